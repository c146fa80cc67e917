"""Answer extraction (``<answer>``, ``\\boxed{}``) and SQuAD-style text matching.

Extraction (:func:`final_answer`): tool results (text the engine inserted) are cut out first, so a
web page's ``\\boxed{}`` or ``<answer>`` is never taken for the model's answer. Where they are is
the engine's record (``tool_spans``, ``rollout.trajectory.decode_response``); a response without
that record (a file of saved samples) falls back to its ``<result>...</result>`` blocks, which a
tool cannot close early either (``tools.framing`` rewrites the tags in tool text). Then the last complete ``<answer>...</answer>`` block wins: its last
``\\boxed{}``, else its text. Only a response with no answer block falls back to its last
``\\boxed{}`` (a box in the reasoning never beats the answer block). Every scan here is linear
in the length of the text, so a model's degenerate output (100k unclosed ``\\boxed{``) cannot
stall scoring.

SQuAD normalisation: lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace; F1 is the token-overlap F1 of the two bags of words, with the official HotpotQA
rule that a ``yes`` / ``no`` / ``noanswer`` on either side scores 0 unless both sides are that
same word ("not yes" against "yes" is wrong, not 2/3 right). Four deliberate extensions, all
no-ops for plain ASCII English:
- LaTeX text wrappers (``\\text{}``, ``\\textbf{}``, ``\\mathrm{}``, ``\\mbox{}``, ...) are
  unwrapped first, so ``\\boxed{\\text{Frank Lowy}}`` reads "frank lowy", not "textfrank lowy".
- Punctuation is every Unicode punctuation character as well as ``string.punctuation``
  (curly quotes and Chinese full stops count).
- CJK characters are split into one token each, so Chinese answers (WebWalker, xbench) get a
  character-level F1 instead of one giant token.
- If removing articles leaves the *ground truth* empty (a multiple-choice answer "A"), articles
  are kept on both sides; otherwise "A" could never be matched and the empty string would.
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Sequence

__all__ = ["normalize_answer", "answer_tokens", "token_f1", "exact_match", "cover_match", "extract_boxed",
           "extract_tag", "extract_answer", "final_answer", "ground_truth_answer", "reference_answer",
           "strip_latex_wrappers", "strip_tool_results", "ToolSpans"]

_ASCII_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# CJK Unified Ideographs (+ ext. A), Hiragana/Katakana, Hangul syllables, CJK compatibility.
_CJK = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")
# Wrappers whose content is the answer; one level per pass, a few passes for \text{\textbf{x}}.
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|textsf|texttt|mbox|mathrm|mathbf|mathit|mathsf|operatorname)"
                       r"\s*\{([^{}]*)\}")
_WRAPPER_PASSES = 4
# HotpotQA's official F1: these answers are all-or-nothing.
_YES_NO = frozenset({"yes", "no", "noanswer"})


def strip_latex_wrappers(text: str) -> str:
    """``text`` with LaTeX text wrappers replaced by their padded content: ``\\text{ cm}`` -> ``"  cm "``.

    Args:
        text: any text.

    Returns:
        The text with up to four nested levels of wrappers removed (each pass is one linear
        regex scan, so the cost stays linear however deep a degenerate answer nests them).
    """
    for _ in range(_WRAPPER_PASSES):
        text, count = _WRAPPERS.subn(r" \1 ", text)
        if not count:
            break
    return text


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(text: str, remove_articles: bool = True) -> str:
    """SQuAD normalisation (see the module docstring for the extensions).

    Args:
        text: raw answer text.
        remove_articles: drop a/an/the (SQuAD does).

    Returns:
        The normalised text, tokens separated by single spaces.
    """
    text = "".join(ch for ch in strip_latex_wrappers(text).lower() if not _is_punct(ch))
    if remove_articles:
        text = _ARTICLES.sub(" ", text)
    text = _CJK.sub(r" \1 ", text)
    return " ".join(text.split())


def answer_tokens(prediction: str, ground_truth: str) -> tuple[list[str], list[str]]:
    """Normalised tokens of a prediction and a ground truth, keeping articles if the ground truth
    would otherwise be empty.

    Returns:
        ``(prediction_tokens, reference_tokens)``.
    """
    truth = normalize_answer(ground_truth).split()
    keep = not truth
    pred = normalize_answer(prediction, remove_articles=not keep).split()
    if keep:
        truth = normalize_answer(ground_truth, remove_articles=False).split()
    return pred, truth


def token_f1(prediction: str, ground_truth: str) -> float:
    """Token-level F1 between one prediction and one ground truth.

    Args:
        prediction: the model's answer.
        ground_truth: one ground-truth answer.

    Returns:
        F1 in [0, 1]; 0 when either side has no tokens, or when either side is exactly
        yes / no / noanswer and the other side is not the same word.
    """
    pred, truth = answer_tokens(prediction, ground_truth)
    if pred != truth and (" ".join(pred) in _YES_NO or " ".join(truth) in _YES_NO):
        return 0.0
    common = sum((Counter(pred) & Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, ground_truth: str) -> bool:
    """Whether the normalised token sequences are identical (and non-empty)."""
    pred, truth = answer_tokens(prediction, ground_truth)
    return bool(truth) and pred == truth


def cover_match(prediction: str, ground_truth: str) -> bool:
    """Whether the normalised ground truth occurs as a run of whole tokens in the normalised
    prediction (the "cover match" or ``acc`` column: "Paris, France" covers "Paris").

    Args:
        prediction: the model's answer.
        ground_truth: one ground-truth answer.

    Returns:
        True when the ground truth has tokens and they appear contiguously in the prediction.
    """
    pred, truth = answer_tokens(prediction, ground_truth)
    # Tokens hold no spaces, so a padded substring test is a whole-token run test, in linear time.
    return bool(truth) and f" {' '.join(truth)} " in f" {' '.join(pred)} "


# ---------------------------------------------------------------------------------------------
# Extraction.

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_RESULT_BLOCK = re.compile(r"<result>.*?(?:</result>|\Z)", re.DOTALL)


def extract_boxed(text: str) -> str | None:
    """Content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces respected.

    One left-to-right pass: a running brace depth, and a stack of the boxes still open with the
    depth each opened at; a box closes where the depth first returns to its opening depth.

    Args:
        text: any text.

    Returns:
        The content between the matching braces (escaped ``\\{``/``\\}`` do not count),
        stripped, of the complete box that starts last; ``None`` if there is no complete
        ``\\boxed{...}`` (an unclosed one at the end, as in a truncated response, is skipped in
        favour of an earlier complete one).
    """
    starts = {m.end() - 1: m.end() for m in _BOXED.finditer(text)}  # the box's "{" -> content start
    open_boxes: list[tuple[int, int]] = []  # (depth before its "{", content start)
    best: tuple[int, int] | None = None  # (content start, content end) of the last-starting box
    depth = 0
    for pos in _braces(text):
        if text[pos] == "{":
            if pos in starts:
                open_boxes.append((depth, starts[pos]))
            depth += 1
            continue
        depth -= 1
        if open_boxes and open_boxes[-1][0] == depth:
            _, start = open_boxes.pop()
            if best is None or start > best[0]:
                best = (start, pos)
    return text[best[0]:best[1]].strip() if best is not None else None


def _braces(text: str):
    """Positions of the unescaped braces of ``text`` (a brace after a backslash is a character)."""
    for match in re.finditer(r"[{}]", text):
        pos = match.start()
        if pos == 0 or text[pos - 1] != "\\":
            yield pos


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last complete ``<tag>...</tag>`` block (the last closing tag and the
    nearest opening tag before it), stripped, or ``None``."""
    end = text.rfind(f"</{tag}>")
    start = text.rfind(f"<{tag}>", 0, end) if end >= 0 else -1
    return text[start + len(tag) + 2:end].strip() if start >= 0 else None


ToolSpans = Sequence[tuple[int, int]]
"""Character ``(start, end)`` of each tool result in a response, as the engine recorded them."""


def strip_tool_results(response: str, tool_spans: ToolSpans | None = None) -> str:
    """The response with each tool result replaced by a space.

    Args:
        response: the model's text, tool results included.
        tool_spans: where the engine put the results (``decode_response``); None: the
            ``<result>...</result>`` blocks of the text (an unclosed one runs to the end).
    """
    if tool_spans is None:
        return _RESULT_BLOCK.sub(" ", response)
    parts, pos = [], 0
    for start, end in sorted(tool_spans):
        parts.append(response[pos:max(pos, start)])
        pos = max(pos, end)
    return " ".join(parts + [response[pos:]])


def final_answer(response: str, require_box: bool = False, tool_spans: ToolSpans | None = None) -> str | None:
    """The answer of a response (module docstring): with tool results cut out, the last
    ``\\boxed{}`` of the last ``<answer>`` block, else that block's text; with no answer block,
    the last ``\\boxed{}``.

    Args:
        response: the model's text, tool results included.
        require_box: only a ``\\boxed{}`` counts (an answer block without one gives None).
        tool_spans: where the engine put the tool results (:func:`strip_tool_results`).

    Returns:
        The answer (stripped), or None when the response gives none.
    """
    own = strip_tool_results(response, tool_spans)
    block = extract_tag(own, "answer")
    boxed = extract_boxed(own if block is None else block)
    if boxed is not None or require_box or block is None:
        return boxed
    return block


def ground_truth_answer(ground_truth: str) -> str:
    """The answer part of a ground truth: a few ground truths are whole solutions, so take their
    last ``\\boxed{}``, else the text after the last ``####`` (GSM8K style), else all of it."""
    boxed = extract_boxed(ground_truth)
    if boxed is not None:
        return boxed
    return ground_truth.rsplit("####", 1)[-1].strip()


reference_answer = ground_truth_answer  # its old name, for old reward code


def extract_answer(text: str, tool_spans: ToolSpans | None = None) -> str:
    """The answer of a free-form response: :func:`final_answer`, else the whole text (stripped)."""
    answer = final_answer(text, tool_spans=tool_spans)
    return answer if answer is not None else text.strip()
