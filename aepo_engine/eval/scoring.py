"""Scoring one sample, and pass@k.

A sample's answer is the last ``\\boxed{}`` of the response, else its last ``<answer>`` block,
with tool results (``<result>...</result>``, text the engine inserted) cut out first so a web
page's ``\\boxed{}`` is never taken for the model's answer. A response with neither has *no
answer*. Scores (the rewards' own functions, so training and evaluation agree):
- ``em``: SQuAD exact match with any reference; ``f1``: the best token F1 (CJK per character);
- ``math``: maths equivalence with any reference (``rewards.math_answer.math_equal``);
- ``format_ok``: the deep-research tag structure is valid (``rewards.deep_research.check_format``);
- ``correct``: em (qa), math or em (math), either (mixed). A multiple-choice reference ("D")
  also accepts an answer that starts with that letter and a delimiter ("D. Weak Non-Sadism").

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement from the
n contain a correct one; pass@1 is then the mean accuracy over samples.
"""
from __future__ import annotations

import re
from math import comb
from typing import Any, Sequence

from aepo_engine.rewards.deep_research import check_format
from aepo_engine.rewards.math_answer import math_equal
from aepo_engine.rewards.text import exact_match, extract_boxed, extract_tag, token_f1

__all__ = ["pass_at_k", "score_response", "strip_tool_results", "final_answer"]

_RESULT_BLOCK = re.compile(r"<result>.*?(</result>|\Z)", re.DOTALL)
_CHOICE = re.compile(r"^\(?([A-Z])\)?(?:[.):\s]|$)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question: 1 - C(n - c, k) / C(n, k).

    Args:
        n: samples drawn; c: correct ones; k: samples allowed (1 <= k <= n).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def strip_tool_results(response: str) -> str:
    """The response without ``<result>...</result>`` blocks (an unclosed one runs to the end)."""
    return _RESULT_BLOCK.sub(" ", response)


def final_answer(response: str) -> str | None:
    """The sample's answer (module docstring), or None when it gave none."""
    own = strip_tool_results(response)
    boxed = extract_boxed(own)
    if boxed is not None:
        return boxed
    return extract_tag(own, "answer")


def _choice_match(answer: str, reference: str) -> bool:
    ref = reference.strip()
    if len(ref) != 1 or not ref.isalpha():
        return False
    match = _CHOICE.match(answer.strip())
    return bool(match) and match.group(1) == ref.upper()


def score_response(response: str, references: Sequence[str], check: str) -> dict[str, Any]:
    """Scores of one response (module docstring).

    Args:
        response: the model's text, tool results included.
        references: the ground-truth answers (already cut to the answer part).
        check: "qa", "math" or "mixed".

    Returns:
        ``{answer, em, f1, math, format_ok, format_error, correct}``.
    """
    if check not in ("qa", "math", "mixed"):
        raise ValueError(f"unknown answer check {check!r}: use qa, math or mixed")
    form = check_format(response)
    answer = final_answer(response)
    scores: dict[str, Any] = {"answer": answer, "format_ok": form.error is None, "format_error": form.error,
                              "em": 0.0, "f1": 0.0, "math": 0.0, "correct": False}
    if answer is None or not answer.strip():
        return scores
    em = any(exact_match(answer, ref) or _choice_match(answer, ref) for ref in references)
    scores["em"] = float(em)
    scores["f1"] = max(token_f1(answer, ref) for ref in references)
    if check != "qa":
        scores["math"] = float(any(math_equal(answer, ref) for ref in references))
    scores["correct"] = bool(em or scores["math"])
    return scores
