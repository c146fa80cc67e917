"""Sampling and scoring evaluation questions: the one path the trainer and the eval command share.

Evaluation reuses the rollout scheduler with branching and pre-monitoring off, so every question
gets ``n`` independent trajectories through exactly the machinery training uses (same prompts,
stop strings, tools, token accounting). :func:`sample_records` returns one record per sample
(prompt, response, each tool call with its result and latency, scores, judge verdict);
``aepo_engine.evaluation.report`` turns records into per-dataset summaries.

:func:`evaluate` is the trainer's held-out measurement on top of the same records: accuracy (the
mean of the reward's ``correct`` over samples, i.e. pass@1), unbiased pass@k, mean reward, tool
use, and accuracy per category label.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

import msgspec

from aepo_engine.evaluation.config import EvalConfig
from aepo_engine.evaluation.scoring import pass_at_k, score_response
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.scheduler import EntropyBalancedRollout
from aepo_engine.rollout.trajectory import Trajectory, decode_response, reward_view
from aepo_engine.seeding import section_seed

__all__ = ["eval_rollout_config", "evaluate", "judge_records", "merge_eval_results", "progress_printer", "sample_records",
           "trajectory_record"]


def eval_rollout_config(rollout_config: RolloutConfig, cfg: EvalConfig) -> RolloutConfig:
    """The training rollout's settings with n independent samples: no branching, no probe."""
    n = cfg.n_samples
    return msgspec.structs.replace(
        rollout_config, k=n, branching=False, pre_monitoring=False, fixed_global_samples=n,
        temperature=cfg.temperature, top_p=cfg.top_p, seed=section_seed(cfg.seed, "eval.seed"))


def trajectory_record(traj: Trajectory, tokenizer: Any, sample: int, tool_format: Any = None) -> dict[str, Any]:
    """The generation side of a sample record: prompt, response (as the reward reads it:
    ``aepo_engine.rollout.trajectory.reward_view``), where the engine put the tool results in it
    (``tool_spans``, what the scores read), tool calls, token counts."""
    response, tool_spans = reward_view(traj, tool_format) if tool_format is not None else decode_response(traj, tokenizer)
    return {
        "sample": sample,
        "prompt": tokenizer.decode(traj.prompt_ids),
        "response": response,
        "tool_spans": [list(span) for span in tool_spans],
        "tool_calls": [{"tool": r.tool, "payload": r.payload, "result": r.result, "ok": r.ok,
                        "latency_s": round(r.elapsed_s, 6)} for r in traj.tool_log],
        "response_tokens": sum(traj.loss_mask),
        "total_tokens": len(traj.response_ids),
        "finish_reason": traj.finish_reason,
        "malformed_calls": traj.malformed_calls,
    }


def sample_records(backend: Any, tool_runner: Any, tokenizer: Any, rollout_config: RolloutConfig,
                   cfg: EvalConfig, prompts: Sequence[list[int]], examples: Sequence[Any], check: str,
                   reward_fn: Callable[..., Any] | None = None, step: int = 0,
                   tool_format: Any = None, progress: str | None = None) -> list[dict[str, Any]]:
    """Sample ``cfg.n_samples`` trajectories per prompt and score each.

    Args:
        prompts: tokenized chat prompts, one per example.
        examples: the ``aepo_engine.data.Example`` of each prompt (question, ground truth, labels).
        check: answer check of :func:`~aepo_engine.evaluation.scoring.score_response` ("qa", "math", "mixed").
        reward_fn: ``(response, ground_truth, tool_spans=...) -> RewardResult``
            (``rewards.build_reward_fn``); when given, ``correct`` is the reward's (the training task's own notion of a
            right answer) and its score is kept as ``reward``.
        step: part of every sampling seed (the same step and questions give the same samples).
        tool_format: how calls and results are written (``aepo_engine.tools.formats``); none = tags.
        progress: a label: print questions done / total, tokens/s and an ETA on stderr after
            every rollout round (:func:`progress_printer`); none = silent.

    Returns:
        One record per sample, grouped by question: dataset, question index, question, ground_truth (the gold answers),
        generation fields (:func:`trajectory_record`) and scores.
    """
    if len(prompts) != len(examples):
        raise ValueError(f"{len(prompts)} prompts for {len(examples)} examples")
    if not prompts:
        return []
    rollout = EntropyBalancedRollout(backend, tool_runner, eval_rollout_config(rollout_config, cfg),
                                     tokenizer=tokenizer, tool_format=tool_format)
    records = []
    report = progress_printer(len(prompts), progress) if progress else None
    for traj in rollout.rollout(list(prompts), step=step, progress=report).trajectories:
        example = examples[traj.prompt_index]
        record = {"dataset": example.data_source, "question_index": example.index,
                  "question": example.question, "ground_truth": list(example.ground_truth),
                  "meta": dict(example.meta), **trajectory_record(traj, tokenizer, traj.traj_id, tool_format)}
        spans = [tuple(span) for span in record["tool_spans"]]
        record.update(score_response(record["response"], example.ground_truth, check, scoring=cfg.scoring,
                                     gold=example.meta.get("gold"), tool_spans=spans))
        if reward_fn is not None:
            result = reward_fn(record["response"], example.ground_truth, tool_spans=spans)
            record["reward"], record["correct"] = float(result.score), bool(result.correct)
        records.append(record)
    return records


def progress_printer(total: int, label: str, stream: Any = None) -> Callable[[int, int, int], None]:
    """``report(done, total, tokens)`` printing ``[eval LABEL] [####....] question 12/100 | tok/s 230 |
    eta 95s`` (the training bar's line: :class:`aepo_engine.metrics.ProgressBar`)."""
    from aepo_engine.metrics import ProgressBar

    bar = ProgressBar(total, stream=stream or sys.stderr, unit=f"[eval {label}] question")

    def report(done: int, _total: int, tokens: int) -> None:
        elapsed = time.perf_counter() - bar.t0
        bar.update(done - 1, {"tok/s": tokens / max(elapsed, 1e-9)})
        if done == total:
            bar.close()

    return report


def judge_records(records: list[dict[str, Any]], judge: Any) -> None:
    """Add ``judge`` = {correct, error, cached, raw, source} to each record; answerless samples are
    judged wrong without a request. The gold as the authors' loader reads it (``meta["gold"]``)
    goes along for the authors' judge prompt."""
    asked = [r for r in records if r.get("answer")]
    for record in records:
        if not record.get("answer"):
            record["judge"] = {"correct": False, "error": None, "cached": False, "skipped": "no answer"}
    verdicts = judge.judge_many([(r["question"], r["ground_truth"], r["answer"], r.get("meta", {}).get("gold"))
                                 for r in asked])
    for record, verdict in zip(asked, verdicts):
        record["judge"] = {"correct": verdict.correct, "error": verdict.error, "cached": verdict.cached,
                           "raw": verdict.raw, "source": verdict.source}


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
    tool_format: Any = None,
    progress: str | None = None,
) -> dict[str, float]:
    """Accuracy, pass@k, mean reward and tool use of the policy behind ``backend`` (the trainer's
    held-out measurement).

    Args:
        prompts: tokenized chat prompts; ground_truths: ground truths per prompt.
        reward_fn: ``(response_text, ground_truth, tool_spans=...) -> RewardResult`` (``score``,
            ``correct``; ``rewards.build_reward_fn``).
        rollout_config: the training rollout's config; branching settings are overridden.
        categories: optional label per prompt; adds ``accuracy/<label>`` for each label.
        tool_format: the rollout's tool format (none = tags).
        progress: a label to print progress under (:func:`sample_records`); none = silent.
    """
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"categories has {len(categories)} labels for {len(prompts)} prompts")
    if config.num_questions:
        prompts, ground_truths = prompts[: config.num_questions], ground_truths[: config.num_questions]
        categories = categories[: config.num_questions] if categories is not None else None
    n = config.n_samples
    if not prompts:
        return {"accuracy": 0.0, **{f"pass@{k}": 0.0 for k in config.pass_ks}, "reward": 0.0,
                "tool_calls": 0.0, "no_tool_share": 0.0, "questions": 0.0}
    from aepo_engine.data import Example

    labels = list(categories) if categories is not None else [""] * len(prompts)
    examples = [Example(index=i, question="", prompt_messages=None, ground_truth=list(g) if isinstance(g, (list, tuple))
                        else [str(g)], data_source=label) for i, (g, label) in enumerate(zip(ground_truths, labels))]
    records = sample_records(backend, tool_runner, tokenizer, rollout_config, config, prompts, examples, "qa",
                             reward_fn=reward_fn, tool_format=tool_format, progress=progress)
    correct = [0] * len(prompts)
    for r in records:
        correct[r["question_index"]] += r["correct"]
    result = {
        "accuracy": sum(correct) / len(records),
        **{f"pass@{k}": sum(pass_at_k(n, c, k) for c in correct) / len(prompts) for k in config.pass_ks},
        "reward": sum(r["reward"] for r in records) / len(records),
        "tool_calls": sum(len(r["tool_calls"]) for r in records) / len(records),
        "no_tool_share": sum(not r["tool_calls"] for r in records) / len(records),
        "questions": float(len(prompts)),
    }
    for label in sorted(set(categories or ())):
        members = [i for i, c in enumerate(labels) if c == label]
        result[f"accuracy/{label}"] = sum(correct[i] for i in members) / (len(members) * n)
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
