"""Short-answer QA rewards: exact match (``qa_em``) and token F1 (``qa_f1``).

The answer is taken from the response by :func:`~aepo_engine.rewards.text.extract_answer`:
the last ``<answer>...</answer>`` block (its last ``\\boxed{}``, else its text), else the last
``\\boxed{}``, else the whole response; tool results are cut out first. Neither takes options
(an unknown option is a ``TypeError``, not ignored), and there is no format penalty (use
``deep_research`` for that). Both take the best score over all ground truths and report ``em`` and
``f1`` in ``details``; ``correct`` is the exact match in both.
"""
from __future__ import annotations

from typing import Any

from .base import RewardResult, as_ground_truths, register_reward
from .text import ToolSpans, exact_match, extract_answer, ground_truth_answer, token_f1

__all__ = ["qa_em", "qa_f1"]


def _qa_scores(response: str, ground_truth: Any, tool_spans: ToolSpans | None) -> dict[str, Any]:
    answer = extract_answer(response, tool_spans)
    truths = [ground_truth_answer(truth) for truth in as_ground_truths(ground_truth)]
    return {
        "answer": answer,
        "em": float(any(exact_match(answer, truth) for truth in truths)),
        "f1": max(token_f1(answer, truth) for truth in truths),
    }


@register_reward("qa_em")
def qa_em(response: str, ground_truth: Any, *, tool_spans: ToolSpans | None = None) -> RewardResult:
    """1.0 if the extracted answer matches any ground truth after SQuAD normalisation, else 0.0.

    Args:
        response: the model's text.
        ground_truth: a string, a list of strings, or a JSON-encoded list.
        tool_spans: where the engine put the tool results (``rewards.text.strip_tool_results``).

    Returns:
        ``RewardResult(score=em, correct=em == 1, details={answer, em, f1})``.
    """
    details = _qa_scores(response, ground_truth, tool_spans)
    return RewardResult(details["em"], details["em"] == 1.0, details)


@register_reward("qa_f1")
def qa_f1(response: str, ground_truth: Any, *, tool_spans: ToolSpans | None = None) -> RewardResult:
    """Token F1 of the extracted answer, maximised over the ground truths.

    Args:
        response: the model's text.
        ground_truth: a string, a list of strings, or a JSON-encoded list.
        tool_spans: where the engine put the tool results (``rewards.text.strip_tool_results``).

    Returns:
        ``RewardResult(score=f1, correct=em == 1, details={answer, em, f1})``.
    """
    details = _qa_scores(response, ground_truth, tool_spans)
    return RewardResult(details["f1"], details["em"] == 1.0, details)
