"""The authors' training reward, reproduced: ``deep_research(..., rules="authors")``.

Written from our reading of the AEPO/ARPO authors' public code (github.com/RUC-NLPIR/ARPO, read at
commit a95cd08: ``ARPO/verl_arpo_entropy/verl/utils/reward_score/deep_research.py``), in our own
code. It is checked against our reading, not against their code run side by side. The rules, all
on the raw response text (tool results included, as their verl rollout hands it over):

1. Format (``authors_format_error``), in this order:
   - ``<think>`` and ``</think>`` occur equally often, and at least once;
   - ``<answer>`` and ``</answer>`` occur exactly once each, *anywhere*: a web page that quotes
     ``<answer>`` inside a ``<result>`` makes the response malformed;
   - for every ``<search>`` (then every ``<python>``), scanning on from the previous call's
     ``</result>``: its closing tag, a ``<result>`` and a ``</result>`` follow, in that order;
   - the text from ``<answer>`` to ``</answer>`` holds ``\\boxed{`` and a ``}``.
2. The answer: the text of the first ``<answer>...</answer>`` block; in it, when ``\\boxed ``
   (with a space) occurs, everything after its last occurrence up to a ``$``; otherwise the last
   ``\\boxed`` (else ``\\fbox``) with its braces counted from there. A box that is unclosed, or is
   an ``\\fbox``, or is a ``\\boxed`` not followed by its brace, cannot be unwrapped: that is a
   format error too ("find box error"). ``\\text{}`` inside the box is *not* unwrapped.
3. F1: SQuAD normalisation (lowercase, ASCII punctuation dropped, a/an/the dropped, whitespace
   collapsed; no per-character CJK tokens) and token F1, the best over the ground truths, with the
   HotpotQA rule (yes / no / noanswer on either side and the sides differ: that ground truth is
   skipped, i.e. scores 0).
4. Score: ``format_penalty`` (-1) when malformed; ``F1 + tool_bonus`` (+0.1) when F1 > 0 and the
   strings ``</search>`` and ``</python>`` both occur anywhere in the response (a page quoting
   them counts); else F1.

Where we differ, and why (also in docs/scoring.md):
- ``correct`` (their reward has none): the normalised answer equals a normalised ground truth.
- An integer ground truth is compared as its decimal string (theirs raises on ``.lower()``).
- Their EOS stripping needs a tokenizer in ``extra_info``, which verl's default reward manager
  does not pass; the engine's decoded response is scored as it is (the EOS follows ``</answer>``,
  so it changes nothing scored here).
- ``think_opened_in_prompt`` (an engine option for chat templates that open ``<think>`` in the
  prompt) still prepends ``<think>`` before the checks.
- The ground truths are the ones the data loader parsed (``base.as_ground_truths``): a ground truth
  stored as a JSON-encoded list of strings is several ground truths here and one string to them
  (no row of the shared RL parquet sets is stored that way).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

from .base import RewardResult

__all__ = ["authors_answer_part", "authors_f1", "authors_format_error", "authors_reward",
           "authors_reward_normalize", "authors_unbox"]

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_YES_NO = ("yes", "no", "noanswer")


def authors_reward_normalize(text: str) -> str:
    """Their reward's SQuAD normalisation: lowercase, ASCII punctuation, articles, whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def authors_f1(prediction: str, ground_truths: Sequence[str]) -> float:
    """Their reward's F1: the best token F1 over the ground truths, yes/no/noanswer all-or-nothing.

    Args:
        prediction: the unboxed answer.
        ground_truths: the ground-truth strings.

    Returns:
        F1 in [0, 1].
    """
    pred = authors_reward_normalize(prediction)
    best = 0.0
    for ground_truth in ground_truths:
        truth = authors_reward_normalize(ground_truth)
        if (pred in _YES_NO or truth in _YES_NO) and pred != truth:
            continue
        common = sum((Counter(pred.split()) & Counter(truth.split())).values())
        if common:
            precision, recall = common / len(pred.split()), common / len(truth.split())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def _calls_in_order(text: str, tag: str) -> str | None:
    """Every ``<tag>`` is followed by ``</tag>``, then ``<result>``, then ``</result>``."""
    pos = 0
    while (start := text.find(f"<{tag}>", pos)) != -1:
        result = text.find("<result>", start)
        close = text.find(f"</{tag}>", start)
        result_end = text.find("</result>", result) if result != -1 else -1
        if -1 in (result, close, result_end):
            return f"{tag}/result tags are incomplete"
        if not start < close < result < result_end:
            return f"{tag}/result tags are nested in the wrong order"
        pos = result_end
    return None


def authors_format_error(text: str) -> str | None:
    """Their format check (module docstring, rule 1): None when well formed, else the reason."""
    if text.count("<think>") != text.count("</think>"):
        return "<think> </think> not paired"
    if text.count("<think>") == 0:
        return "<think> or </think> not found"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "<answer> or </answer> not found"
    for tag in ("search", "python"):
        error = _calls_in_order(text, tag)
        if error is not None:
            return error
    start, end = text.find("<answer>"), text.find("</answer>")
    if start > end:
        return "<answer> must be before </answer>"
    block = text[start:end]
    if "\\boxed{" not in block or "}" not in block:
        return "answer is missing \\boxed{} format"
    return None


def authors_answer_part(text: str) -> str | None:
    """The text of the first ``<answer>...</answer>`` block of the stripped text, or None."""
    text = text.strip()
    start = text.find("<answer>")
    end = text.find("</answer>", start + len("<answer>")) if start != -1 else -1
    return text[start + len("<answer>"):end] if end != -1 else None


def authors_unbox(block: str) -> str:
    """The answer inside their last box of ``block`` (module docstring, rule 2).

    Raises:
        ValueError: no box, an unclosed one, or one that is not ``\\boxed{...}`` (their asserts).
    """
    if "\\boxed " in block:
        return block.split("\\boxed ")[-1].split("$")[0]
    start = block.rfind("\\boxed")
    if start < 0:
        start = block.rfind("\\fbox")
    if start < 0:
        raise ValueError("no \\boxed")
    depth = 0
    for pos in range(start, len(block)):
        depth += {"{": 1, "}": -1}.get(block[pos], 0)
        if block[pos] == "}" and depth == 0:
            box = block[start:pos + 1]
            if not box.startswith("\\boxed{"):
                raise ValueError(f"{box[:20]!r} is not \\boxed{{...}}")
            return box[len("\\boxed{"):-1]
    raise ValueError("unclosed \\boxed")


def authors_reward(response: str, ground_truths: Sequence[str], format_penalty: float,
                   tool_bonus: float) -> RewardResult:
    """Their ``compute_score`` (module docstring) as a :class:`RewardResult`.

    Args:
        response: the model's text, tool results included (``<think>`` already prepended when the
            prompt opened it).
        ground_truths: the ground-truth strings.
        format_penalty: score of a malformed response (theirs: -1).
        tool_bonus: added when F1 > 0 and both closing tool tags occur (theirs: 0.1).

    Returns:
        ``details`` = ``{format_error}`` when malformed, else ``{answer, f1, em, tools_used}``.
    """
    error = authors_format_error(response)
    block = authors_answer_part(response) if error is None else None
    if error is None and block is None:
        error = "cannot extract answer"
    if error is None:
        try:
            answer = authors_unbox(block)
        except ValueError as err:
            error = f"find box error: {err}"
    if error is not None:
        return RewardResult(format_penalty, False, {"format_error": error})
    f1 = authors_f1(answer, ground_truths)
    em = any(authors_reward_normalize(answer) == authors_reward_normalize(truth) for truth in ground_truths)
    tools = sorted(tag for tag in ("python", "search") if f"</{tag}>" in response)
    bonus = tool_bonus if f1 > 0 and len(tools) == 2 else 0.0
    return RewardResult(f1 + bonus, em, {"answer": answer, "f1": f1, "em": float(em), "tools_used": tools})
