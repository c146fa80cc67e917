"""Held-out evaluation: sample answers with real tool calls, score them, report accuracy.

Evaluation reuses the rollout scheduler with branching and pre-monitoring off, so every
question gets ``samples`` independent trajectories through exactly the machinery training uses
(same prompts, stop strings, tools, token accounting). Accuracy is the mean of the reward's
``correct`` flag over all samples (pass@1 averaged over samples); ``pass@k`` is the fraction of
questions with at least one correct sample; ``no_tool_share`` the share of samples that made
no tool call. With ``categories`` (a label per question: the data source, the question kind)
accuracy is also reported per label as ``accuracy/<label>``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.seeding import section_seed
from aepo_engine.rollout.scheduler import EntropyBalancedRollout


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Held-out evaluation.

    Attributes:
        num_questions: held-out questions evaluated (the first ones of the eval set; 0 = all).
        samples: independent samples per question (accuracy averages over them).
        temperature: sampling temperature of evaluation rollouts.
        every_n_steps: evaluate during training every n steps (0 = only before and after RL).
        seed: seed of the evaluation rollouts (fixed, so before/after compare the same draws);
            none = derived from the run's root seed (``aepo_engine.seeding``).
    """

    num_questions: int = 0
    samples: int = 1
    temperature: float = 1.0
    every_n_steps: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.num_questions < 0 or self.samples < 1:
            raise ValueError("num_questions must be >= 0 and samples >= 1")
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 because evaluation samples (no greedy path)")


def evaluate(
    backend: Any,
    tool_runner: Any,
    tokenizer: Any,
    rollout_config: RolloutConfig,
    prompts: Sequence[list[int]],
    ground_truths: Sequence[Any],
    reward_fn: Callable[..., Any],
    config: EvalConfig,
    categories: Sequence[str] | None = None,
) -> dict[str, float]:
    """Accuracy, pass@k, mean reward and tool use of the policy behind ``backend``.

    Args:
        prompts: tokenized chat prompts; ground_truths: references per prompt.
        reward_fn: ``(response_text, ground_truth) -> RewardResult`` (``score``, ``correct``).
        rollout_config: the training rollout's config; branching settings are overridden.
        categories: optional label per prompt; adds ``accuracy/<label>`` for each label.
    """
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"categories has {len(categories)} labels for {len(prompts)} prompts")
    if config.num_questions:
        prompts, ground_truths = prompts[: config.num_questions], ground_truths[: config.num_questions]
        categories = categories[: config.num_questions] if categories is not None else None
    if not prompts:
        return {"accuracy": 0.0, f"pass@{config.samples}": 0.0, "reward": 0.0, "tool_calls": 0.0,
                "no_tool_share": 0.0, "questions": 0.0}
    eval_rollout = msgspec.structs.replace(
        rollout_config, k=config.samples, branching=False, pre_monitoring=False,
        fixed_global_samples=config.samples, temperature=config.temperature,
        seed=section_seed(config.seed, "eval.seed"),
    )
    trajectories = EntropyBalancedRollout(backend, tool_runner, eval_rollout, tokenizer=tokenizer).rollout(list(prompts), step=0).trajectories
    correct_by_question = [0] * len(prompts)
    rewards, tool_calls = [], []
    for traj in trajectories:
        result = reward_fn(tokenizer.decode(traj.response_ids), ground_truths[traj.prompt_index])
        rewards.append(result.score)
        correct_by_question[traj.prompt_index] += bool(result.correct)
        tool_calls.append(traj.tool_calls)
    n = max(len(trajectories), 1)
    result = {
        "accuracy": sum(correct_by_question) / n,
        f"pass@{config.samples}": sum(c > 0 for c in correct_by_question) / max(len(prompts), 1),
        "reward": sum(rewards) / n,
        "tool_calls": sum(tool_calls) / n,
        "no_tool_share": sum(c == 0 for c in tool_calls) / n,
        "questions": float(len(prompts)),
    }
    for label in sorted(set(categories or ())):
        members = [i for i, c in enumerate(categories) if c == label]
        result[f"accuracy/{label}"] = sum(correct_by_question[i] for i in members) / (len(members) * config.samples)
        result[f"questions/{label}"] = float(len(members))
    return result


def merge_eval_results(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine :func:`evaluate` results over disjoint question shards (one per rank).

    Each metric is weighted by the questions it was measured on: ``questions`` for the overall
    ones, ``questions/<label>`` for ``accuracy/<label>`` (a shard may lack some labels).
    """
    def weight(part: dict[str, float], key: str) -> float:
        return part.get("questions/" + key.split("/", 1)[1], 0.0) if key.startswith("accuracy/") else part["questions"]

    keys = sorted({k for p in parts for k in p if not k.startswith("questions")},
                  key=lambda k: (k.startswith("accuracy/"), k))
    result = {}
    for key in keys:
        total = sum(weight(p, key) for p in parts if key in p)
        result[key] = sum(p[key] * weight(p, key) for p in parts if key in p) / max(total, 1.0)
    result["questions"] = float(sum(p["questions"] for p in parts))
    for key in sorted({k for p in parts for k in p if k.startswith("questions/")}):
        result[key] = float(sum(p.get(key, 0.0) for p in parts))
    return result
