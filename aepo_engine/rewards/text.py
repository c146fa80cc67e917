"""Answer extraction (``\\boxed{}``, ``<answer>``) and SQuAD-style text matching.

SQuAD normalisation: lowercase, drop punctuation, drop the articles a/an/the, collapse
whitespace; F1 is the token-overlap F1 of the two bags of words. Three deliberate extensions,
all no-ops for plain ASCII English:
- Punctuation is every Unicode punctuation character as well as ``string.punctuation``
  (curly quotes and Chinese full stops count).
- CJK characters are split into one token each, so Chinese answers (WebWalker, xbench) get a
  character-level F1 instead of one giant token.
- If removing articles leaves the *reference* empty (a multiple-choice answer "A"), articles
  are kept on both sides; otherwise "A" could never be matched and the empty string would.
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

__all__ = ["normalize_answer", "answer_tokens", "token_f1", "exact_match", "extract_boxed",
           "extract_tag", "extract_answer", "reference_answer"]

_ASCII_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# CJK Unified Ideographs (+ ext. A), Hiragana/Katakana, Hangul syllables, CJK compatibility.
_CJK = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff])")


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
    text = "".join(ch for ch in text.lower() if not _is_punct(ch))
    if remove_articles:
        text = _ARTICLES.sub(" ", text)
    text = _CJK.sub(r" \1 ", text)
    return " ".join(text.split())


def answer_tokens(prediction: str, reference: str) -> tuple[list[str], list[str]]:
    """Normalised tokens of a prediction and a reference, keeping articles if the reference
    would otherwise be empty.

    Returns:
        ``(prediction_tokens, reference_tokens)``.
    """
    ref = normalize_answer(reference).split()
    keep = not ref
    pred = normalize_answer(prediction, remove_articles=not keep).split()
    if keep:
        ref = normalize_answer(reference, remove_articles=False).split()
    return pred, ref


def token_f1(prediction: str, reference: str) -> float:
    """Token-level F1 between one prediction and one reference.

    Args:
        prediction: the model's answer.
        reference: one ground-truth answer.

    Returns:
        F1 in [0, 1]; 0 when either side has no tokens.
    """
    pred, ref = answer_tokens(prediction, reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> bool:
    """Whether the normalised token sequences are identical (and non-empty)."""
    pred, ref = answer_tokens(prediction, reference)
    return bool(ref) and pred == ref


# ---------------------------------------------------------------------------------------------
# Extraction.

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces respected.

    Args:
        text: any text.

    Returns:
        The content between the matching braces (escaped ``\\{``/``\\}`` do not count),
        stripped; ``None`` if there is no complete ``\\boxed{...}`` (an unclosed one at the
        end, as in a truncated response, is skipped in favour of an earlier complete one).
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            if text[pos - 1] != "\\":  # escaped \{ and \} are characters, not groups
                depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[start:pos].strip()
    return None


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` block, stripped, or ``None``."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return blocks[-1].strip() if blocks else None


def reference_answer(reference: str) -> str:
    """The answer part of a reference: a few references are whole solutions, so take their
    last ``\\boxed{}``, else the text after the last ``####`` (GSM8K style), else all of it."""
    boxed = extract_boxed(reference)
    if boxed is not None:
        return boxed
    return reference.rsplit("####", 1)[-1].strip()


def extract_answer(text: str) -> str:
    """The answer of a free-form response: the last ``\\boxed{}`` if any, else the last
    ``<answer>...</answer>`` block, else the whole text (stripped)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    tagged = extract_tag(text, "answer")
    return tagged if tagged is not None else text.strip()
