"""Held-out evaluation: overall and per-category accuracy, and merging rank shards."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from aepo_engine.evaluation import EvalConfig, evaluate, merge_eval_results
from aepo_engine.rollout.config import RolloutConfig
from fakes import CharTokenizer, ScriptedBackend, ScriptedRunner


def _answer_with_prompt_letter(context: str, request):
    """Answers the prompt's first character; prompts "a?" are answered "a", i.e. correctly."""
    return f"<answer>{context[0]}</answer>", 0.5, True


def _reward(response: str, ground_truth, tool_spans=None):
    correct = f"<answer>{ground_truth[0]}</answer>" in response
    return SimpleNamespace(score=float(correct), correct=correct)


def test_per_category_accuracy_hand_worked():
    tok = CharTokenizer()
    prompts = [tok.encode(p) for p in ("x1", "y2", "z3", "w4")]
    truths = [["x"], ["y"], ["z"], ["nope"]]  # the last question is always answered wrongly
    result = evaluate(ScriptedBackend(_answer_with_prompt_letter), ScriptedRunner(), tok,
                      RolloutConfig(k=2, max_response_tokens=50, max_tokens_per_segment=50),
                      prompts, truths, _reward, EvalConfig(samples=3, num_questions=0),
                      categories=["lookup", "lookup", "math", "math"])
    assert result["accuracy"] == pytest.approx(3 / 4)
    assert result["pass@3"] == pytest.approx(3 / 4)
    assert result["no_tool_share"] == 1.0  # the scripted policy answers at once
    assert result["accuracy/lookup"] == pytest.approx(1.0)
    assert result["accuracy/math"] == pytest.approx(0.5)
    assert result["questions/lookup"] == 2 and result["questions/math"] == 2
    with pytest.raises(ValueError, match="3 labels for 4 prompts"):
        evaluate(ScriptedBackend(_answer_with_prompt_letter), ScriptedRunner(), tok, RolloutConfig(k=2),
                 prompts, truths, _reward, EvalConfig(), categories=["a", "b", "c"])


def test_merge_weights_each_metric_by_its_own_question_count():
    rank0 = {"accuracy": 0.5, "reward": 1.0, "questions": 4.0, "accuracy/a": 0.25, "questions/a": 4.0}
    rank1 = {"accuracy": 1.0, "reward": 0.0, "questions": 2.0, "accuracy/a": 1.0, "questions/a": 1.0,
             "accuracy/b": 1.0, "questions/b": 1.0}  # rank 0 has no question of category b
    merged = merge_eval_results([rank0, rank1])
    assert merged["accuracy"] == pytest.approx((0.5 * 4 + 1.0 * 2) / 6)
    assert merged["reward"] == pytest.approx(4 / 6)
    assert merged["accuracy/a"] == pytest.approx((0.25 * 4 + 1.0) / 5)
    assert merged["accuracy/b"] == pytest.approx(1.0)
    assert merged["questions"] == 6 and merged["questions/a"] == 5 and merged["questions/b"] == 1
    assert merge_eval_results([rank0]) == rank0
