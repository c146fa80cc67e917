"""Scoring one sample, and pass@k.

Two rule sets (``eval.scoring``); docs/scoring.md compares them case by case.

``"project"`` (default; the project's rules). The answer is :func:`~aepo_engine.rewards.text.final_answer`: tool results
(where the rollout put them, ``tool_spans``; else the ``<result>...</result>`` blocks) cut out, then the last ``<answer>`` block's
last ``\\boxed{}`` (else the block's text), else the last ``\\boxed{}``; a response with neither has
*no answer*. Scores (the rewards' own functions, so training and evaluation agree):
- ``em``: SQuAD exact match with any ground truth; ``f1``: the best token F1 (CJK per character,
  LaTeX text wrappers unwrapped, yes/no/noanswer all-or-nothing); ``acc``: a ground truth occurs as
  a run of whole tokens in the answer (cover match), or the answer is correct;
- ``math``: maths equivalence with any ground truth (``rewards.math_answer.math_equal``);
- ``format_ok``: the deep-research tag structure is valid (``rewards.deep_research.check_format``);
- ``correct``: on "qa" sets, em with the same numbers on both sides; on "math" and "mixed" (HLE)
  sets, maths equivalence, or, when the ground truth and the answer are both plain words (no digit,
  no maths symbol), SQuAD exact match. SQuAD normalisation deletes ``-``, ``.`` and brackets, so
  it never decides a number on its own (``-50`` is not ``50``, ``9.5`` is not ``95``, GAIA's
  ``-34689`` is not ``34689``). On every set a multiple-choice ground truth ("D") also accepts an
  answer that starts with that letter and a delimiter ("D. Weak Non-Sadism").

``"authors"``: the AEPO/ARPO authors' evaluator reproduced (:mod:`aepo_engine.evaluation.authors`):
their prediction, their ``em``/``acc``/``f1``/``math_equal``, ``correct`` = math_equal on maths
sets and em elsewhere. ``format_ok`` is the project's check in both modes.

pass@k is the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without replacement from the
n contain a correct one; pass@1 is then the mean accuracy over samples.
"""
from __future__ import annotations

import re
from math import comb
from typing import Any, Sequence

from aepo_engine.evaluation.authors import authors_metrics, authors_prediction, authors_task
from aepo_engine.rewards.config import RULES
from aepo_engine.rewards.deep_research import check_format
from aepo_engine.rewards.math_answer import math_equal
from aepo_engine.rewards.text import (ToolSpans, cover_match, exact_match, final_answer, strip_latex_wrappers,
                                      strip_tool_results, token_f1)

__all__ = ["CHECKS", "final_answer", "pass_at_k", "score_response", "strip_tool_results"]

CHECKS = ("qa", "math", "mixed")
_CHOICE = re.compile(r"^\(?([A-Z])\)?(?:[.):\s]|$)")
# A hyphen between letters ("Jean-Paul") is a word's; anywhere else it may be a minus sign.
_WORD_HYPHEN = re.compile(r"(?<=[^\W\d_])-(?=[^\W\d_])")
_MATHS_SYMBOL = re.compile(r"[\d\\^_{}\[\]=<>+*/|$%-]")
_LETTER = re.compile(r"[^\W\d_]")
# Decimal numbers, thousands commas allowed, with a minus sign unless the hyphen joins a word or a
# range ("A-1", "2-3"): what SQuAD's em must not lose.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question: 1 - C(n - c, k) / C(n, k).

    Args:
        n: samples drawn; c: correct ones; k: samples allowed (1 <= k <= n).

    Returns:
        The probability that k of the n samples, drawn without replacement, hold a correct one.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _choice_match(answer: str, ground_truth: str) -> bool:
    truth = ground_truth.strip()
    if len(truth) != 1 or not truth.isalpha():
        return False
    match = _CHOICE.match(answer.strip())
    return bool(match) and match.group(1) == truth.upper()


def _plain_words(text: str) -> bool:
    """Letters, spaces and text punctuation only: nothing SQuAD normalisation could misread."""
    text = _WORD_HYPHEN.sub("", strip_latex_wrappers(text))
    return bool(_LETTER.search(text)) and not _MATHS_SYMBOL.search(text)


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in _NUMBER.findall(text)]


def _qa_correct(answer: str, ground_truth: str) -> bool:
    """``correct`` on a QA set: em, and the numbers in both (signs and decimal points) agree."""
    if _choice_match(answer, ground_truth):
        return True
    return exact_match(answer, ground_truth) and _numbers(answer) == _numbers(ground_truth)


def _maths_correct(answer: str, ground_truth: str) -> bool:
    """``correct`` on a maths or mixed set (module docstring)."""
    if math_equal(answer, ground_truth) or _choice_match(answer, ground_truth):
        return True
    return _plain_words(answer) and _plain_words(ground_truth) and exact_match(answer, ground_truth)


def _ground_truths(ground_truths: Any) -> list[str]:
    """A ground-truth list as strings; a bare string or number is one ground truth (AIME golds are ints)."""
    if isinstance(ground_truths, (str, int, float)):
        return [str(ground_truths)]
    return [str(truth) for truth in ground_truths]


def _project_scores(response: str, ground_truths: list[str], check: str,
                   tool_spans: ToolSpans | None = None) -> dict[str, Any]:
    answer = final_answer(response, tool_spans=tool_spans)
    scores: dict[str, Any] = {"answer": answer, "em": 0.0, "f1": 0.0, "acc": 0.0, "math": 0.0, "correct": False}
    if answer is None or not answer.strip() or not ground_truths:
        return scores
    em = any(exact_match(answer, truth) or _choice_match(answer, truth) for truth in ground_truths)
    if check == "qa":
        correct = any(_qa_correct(answer, truth) for truth in ground_truths)
    else:
        scores["math"] = float(any(math_equal(answer, truth) for truth in ground_truths))
        correct = any(_maths_correct(answer, truth) for truth in ground_truths)
    scores.update(em=float(em), f1=max(token_f1(answer, truth) for truth in ground_truths), correct=correct,
                  acc=float(correct or any(cover_match(answer, truth) for truth in ground_truths)))
    return scores


def _authors_scores(response: str, ground_truths: list[str], check: str, gold: Any) -> dict[str, Any]:
    if gold is None:  # no gold as their loader reads it: one ground truth is their string form
        gold = ground_truths[0] if len(ground_truths) == 1 else ground_truths
    task = authors_task(check)
    answer = authors_prediction(response)
    scores: dict[str, Any] = {"answer": answer, **authors_metrics(answer, gold, task)}
    scores["correct"] = bool(scores["math"] if task == "math" else scores["em"])
    return scores


def score_response(response: str, ground_truths: Sequence[str] | str | int, check: str, scoring: str = "project",
                   gold: Any = None, tool_spans: ToolSpans | None = None) -> dict[str, Any]:
    """Scores of one response (module docstring).

    Args:
        response: the model's text, tool results included.
        ground_truths: the ground-truth answers (already cut to the answer part); a bare string or
            number is one ground truth; an empty list scores 0 everywhere.
        check: "qa", "math" or "mixed".
        scoring: "project" or "authors" (``eval.scoring``).
        gold: for "authors", the gold as the authors' loader reads it (a string, an int, or a
            list; ``benchmarks.load_eval_source`` keeps it as ``meta["gold"]``); None = the one
            ground truth as a string, or the list of several.
        tool_spans: where the rollout put the tool results (``decode_response``); the project's
            rules read them there (the authors' read the text as theirs did).

    Returns:
        ``{answer, em, f1, acc, math, format_ok, format_error, correct}``.
    """
    if check not in CHECKS:
        raise ValueError(f"unknown answer check {check!r}: use {', '.join(CHECKS)}")
    if scoring not in RULES:
        raise ValueError(f"unknown scoring {scoring!r}: use {', '.join(RULES)}")
    truths = _ground_truths(ground_truths)
    form = check_format(response, tool_spans)
    if scoring == "authors":
        scores = _authors_scores(response, truths, check, gold)
    else:
        scores = _project_scores(response, truths, check, tool_spans)
    return {**scores, "format_ok": form.error is None, "format_error": form.error}
