"""``python -m aepo_engine.train``: the AEPO training driver.

One step (docs/algorithm.md):
    sample prompts -> entropy-balanced rollouts with real tools (§1) -> rewards -> group
    advantages (§2a) -> old log-probs and entropies (no grad, fused kernel) -> PPO mini-batch
    updates with the fused AEPO loss (§2b-2d; token-mean over the global token count) ->
    gradient clipping (a non-finite norm skips the step) -> AdamW -> push the weights to the
    rollout backend -> metrics, samples, checkpoint.
With no arguments it runs the embedded preset (see :mod:`aepo_engine.tasks.synthetic_setup`): a
generated tool-use task, a tiny local Qwen3, a warm start, then AEPO; held-out accuracy is
measured before and after RL. ``--preset NAME`` (repeatable: ``--preset embedded --preset grpo``)
and ``--config FILE`` load presets and files (see :mod:`aepo_engine.config`); ``-h`` lists every
option with the defaults those give; ``--dry-run`` checks the run without starting it
(:mod:`aepo_engine.dry_run`).

Under ``torchrun`` every rank samples rollouts for its share of the step's prompts with its own
generation backend; trajectories are all-gathered so every rank holds the same global batch,
which the policy worker splits over ranks (FSDP2). Only rank 0 writes logs and plots.

The step exists once (:meth:`Trainer.step`); where its rollouts come from is the run's step
source (:mod:`aepo_engine.step_source`): this rank's engine when asked (``train.mode = "sync"``), or
a rollout process that samples while this one updates (``train.mode = "async"``, docs/async.md,
:mod:`aepo_engine.asynchronous.source`).
"""
from __future__ import annotations

import datetime
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from aepo_kernels.compile import give_toolchain_notice

from aepo_engine import distributed
from aepo_engine.algorithms.advantages import group_advantages
from aepo_engine.asynchronous.staleness import branching_version_gaps, staleness_metrics, token_staleness
from aepo_engine.checkpoint import (CheckpointManager, CheckpointSaveError, checkpoint_footprint, model_dtype,
                                    space_problem)
from aepo_engine.config import TrainConfig, apply_torch_threads, config_problems, list_presets, split_train_args
from aepo_engine.config_loader import ConfigError, dump_config, format_help, load_config
from aepo_engine.errors import entry_point
from aepo_engine.data import Example, PromptSampler, fit_prompts
from aepo_engine.evaluation.benchmarks import load_eval_source
from aepo_engine.evaluation.during_run import RunEvaluation
from aepo_engine.evaluation.judge import start_judge
from aepo_engine.faults import fault_point
from aepo_engine.files import write_text_atomic
from aepo_engine.metrics import ProgressBar, RunLogger, plot_metrics
from aepo_engine.models.lora import is_adapter
from aepo_engine.native_dtype import resolve_train_dtypes
from aepo_engine.rewards import build_reward_fn
from aepo_engine.rollout.backends import build_backend, engine_group, engine_layout
from aepo_engine.rollout.measures import (branching_metrics, depth_metrics, diversity_metrics, entropy_tail_metrics,
                                          premonitoring_metrics)
from aepo_engine.rollout.samples import sample_rows
from aepo_engine.rollout.continuous import ContinuousRollout
from aepo_engine.rollout.scheduler import RolloutStats
from aepo_engine.step_source import StepSource, SynchronousSource
from aepo_engine.rollout.trajectory import reward_view
from aepo_engine.tasks import prepare_task
from aepo_engine.tools import ToolRunner, build_tools
from aepo_engine.tools.formats import build_tool_format, drift_metrics
from aepo_engine.tools.sandbox import describe_limits
from aepo_engine.training.batch import TokenBatch
from aepo_engine.training.policy import PolicyWorker
from aepo_engine.training.rollout_correction import rollout_correction

PROG = "python -m aepo_engine.train"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _log(message: str) -> None:
    if distributed.is_main():
        print(message, flush=True)


def _warn(message: str) -> None:
    """One ``warning:`` line on stderr (rank 0)."""
    if distributed.is_main():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def trainer_layout(cfg: TrainConfig, rank: int, world: int, local_rank: int, local_world: int):
    """Which ranks sample which prompts (``rollout.backends.engine_layout``). A synchronous run's
    engines span ``backend.tensor_parallel_size`` of its ranks' GPUs; in an asynchronous run every
    rank samples with its own rollout process's engine, whose GPUs are its own (the placement's:
    with ``tensor_parallel_size = 2`` the one trainer rank is not half an engine)."""
    tp = 1 if cfg.train.asynchronous else cfg.backend.tensor_parallel_size
    return engine_layout(tp, rank, world, local_rank, local_world)


class Trainer:
    """Builds the parts from a :class:`TrainConfig` and runs the RL loop."""

    def __init__(self, cfg: TrainConfig):
        problems = config_problems(cfg)
        if problems:
            raise ConfigError("the config cannot run:\n" + "\n".join(f"- {p}" for p in problems))
        # "bfloat16_if_native" becomes the dtype this machine runs, in config.toml too (a resumed
        # run keeps it): aepo_engine.native_dtype.
        cfg = resolve_train_dtypes(cfg, "cuda" if torch.cuda.is_available() else "cpu")
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.config_text = dump_config(cfg)
        seed_everything(cfg.seed)
        apply_torch_threads(cfg.train.torch_threads, _log)
        give_toolchain_notice(emit=lambda notice: _log(f"[kernels] {notice}"))  # no compiler: eager, said once
        self.rank, self.world, _ = distributed.init_distributed(
            datetime.timedelta(minutes=cfg.train.collective_timeout_minutes), "train.collective_timeout_minutes",
            device_timeout=datetime.timedelta(minutes=cfg.train.device_collective_timeout_minutes))
        if cfg.train.asynchronous and self.world > 1 and (torch.cuda.is_available() or
                                                          cfg.backend.tensor_parallel_size > 1):
            raise ConfigError(f"train.mode='async' with {self.world} trainer ranks runs on CPU, one engine per rank: "
                              "rollout processes beside several ranks on GPUs (each with its engine's GPUs) and "
                              "engines spanning ranks are not built (docs/async.md)")
        self.layout = trainer_layout(cfg, self.rank, self.world, distributed.local_rank(),
                                     distributed.local_world_size())
        task = prepare_task(cfg.task, cfg.model, cfg.tools, cfg.data, self.run_dir,
                            setup_in_child=cfg.backend.kind == "vllm", log=_log)
        self.model_dir, self.tools_config = task.model_dir, task.tools_config
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.tool_format = build_tool_format(cfg.tools.format, self.tokenizer, self.tools_config.enabled)
        self.train_examples = fit_prompts(task.train_examples, self.prompt_length, cfg.data, "train")
        self.eval_examples = fit_prompts(task.eval_examples, self.prompt_length, cfg.data, "eval")
        self.eval_sets = [load_eval_source(spec, cfg.eval.data_root, cfg.eval.num_questions) for spec in cfg.eval.files]
        for eval_set in self.eval_sets:
            _log(f"[data] eval {eval_set.name}: {len(eval_set.examples)} questions from {eval_set.source}"
                 + (f" ({len(eval_set.skipped)} rows skipped, first: {eval_set.skipped[0]})" if eval_set.skipped else ""))
        self.total_steps = cfg.train.resolved_steps(len(self.train_examples))
        self.policy = PolicyWorker(self.model_dir, cfg.policy, cfg.optim, total_steps=self._optimizer_steps(),
                                   temperature=cfg.rollout.temperature)
        self.reward_fn = build_reward_fn(cfg.reward)
        # The backend before the tools: a vLLM engine must start before the search index loads
        # numba. An in-process engine is built on every rank of its group (the host drives it,
        # the others replay its calls); otherwise ranks that host no engine sample nothing. An
        # asynchronous run builds none here: its rollout process's engine is the run's only one
        # (started by run(); the evaluations sample through it, asynchronous.client.RemoteEngine).
        in_process = cfg.backend.kind == "vllm" and cfg.backend.in_process
        group = engine_group(self.layout, self.world) if in_process else None
        self.backend = (build_backend(cfg.backend, self.model_dir, self.tokenizer,
                                      seed=cfg.rollout.seed + self.layout.group[0],
                                      local_rank=distributed.local_rank(), group=group, lora=cfg.policy.lora)
                        if (self.layout.host or in_process) and not cfg.train.asynchronous else None)
        self.source: StepSource | None = None  # where the steps' rollouts come from (run())
        self.version = 0  # the policy version the weights are at: the steps trained
        self.tools = ToolRunner(build_tools(self.tools_config), max_workers=self.tools_config.max_workers)
        if "python" in self.tools_config.enabled:
            _log(f"[tools] python: {describe_limits(self.tools_config.python)}")
        rollout_cfg = _rank_rollout_config(cfg.rollout, self.rank)
        # the step's scheduler (rollout.schedule); an asynchronous run's process builds its own.
        # With agent.function, an agent program's episodes through the gateway instead.
        self.agent_rollout = None  # with agent.function: the agent's rollouts and the gateway they go through
        if cfg.agent.enabled:
            from aepo_engine.gateway.rollout import build_agent_rollout

            self.rollout = self.agent_rollout = build_agent_rollout(cfg.agent, rollout_cfg, self.backend, self.tokenizer,
                                               corpus_path=self.tools_config.search.corpus_path,
                                               max_prompt_tokens=cfg.data.max_prompt_tokens, tool_format=cfg.tools.format)
        else:
            self.rollout = ContinuousRollout.for_schedule(self.backend, self.tools, rollout_cfg,
                                                          tokenizer=self.tokenizer, tool_format=self.tool_format)
        self.sampler = PromptSampler(self.train_examples, cfg.train.prompts_per_step, cfg.data.shuffle_seed,
                                     shuffle=cfg.data.shuffle)
        self.checkpoints = CheckpointManager(self.run_dir / cfg.checkpoint.dir, cfg.checkpoint.keep_last)
        self.logger = RunLogger(self.run_dir / cfg.logging.dir, rank=self.rank, jsonl=cfg.logging.jsonl,
                                tensorboard=cfg.logging.tensorboard_enabled(),
                                wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
                                run_name=cfg.logging.run_name or "")
        self.judge = None  # eval.files' LLM judge (rank 0; None when off or its endpoint is down)
        if self.rank == 0 and self.eval_sets:
            self.judge, _ = start_judge(cfg.eval.judge, self.run_dir / cfg.logging.dir / "judge_cache.jsonl",
                                        warn=lambda line: _log(f"[eval] {line}"))
        self.correction = cfg.rollout_correction.resolved(stale_tokens=cfg.train.stale_tokens)
        if cfg.agent.enabled:  # the held-out questions asked by the agent, through the gateway
            from aepo_engine.gateway.rollout import AgentEvaluation

            self.evaluation = AgentEvaluation(self.rollout, self.eval_examples, cfg.eval.num_questions,
                                              cfg.eval.n_samples, log=_log)
        else:
            self.evaluation = RunEvaluation(cfg.eval, cfg.rollout, self.eval_examples, self.eval_sets, self.tools,
                                            self.tokenizer, self.tool_format, self.reward_fn, self.prompt_ids,
                                            self.layout, self.judge, self.run_dir / cfg.logging.dir / "eval_samples",
                                            log=_log)

    # --- set-up -----------------------------------------------------------------------------

    def _optimizer_steps(self) -> int:
        policy, train = self.cfg.policy, self.cfg.train
        units = train.prompts_per_step * (self.cfg.rollout.k if policy.mini_batch_unit == "rows" else 1)
        return max(1, self.total_steps * policy.steps_per_update(units))

    def prompt_ids(self, example: Example) -> list[int]:
        return self.tool_format.encode_prompt(example.messages())

    def prompt_length(self, example: Example) -> int:
        return len(self.prompt_ids(example))

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Resume if asked, evaluate, train, evaluate; returns the summary (also summary.json). The
        step source and the tools close however it ends (the source first: an asynchronous run's
        rollout process): a served search's server and the sandbox pool outlive no run."""
        try:
            return self._run()
        finally:
            try:
                if self.source is not None:
                    self.source.close()
            finally:
                try:
                    self.tools.close()
                finally:
                    if self.agent_rollout is not None:
                        self.agent_rollout.close()  # the gateway

    def _run(self) -> dict[str, Any]:
        _log(f"[config]\n{self.config_text}")
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(self.config_text)
        self._check_checkpoint_space()
        start, extra = self._resume()
        self.version = start
        self.source = self.make_step_source()
        eval_before = extra.get("eval_before") or self.evaluate("before RL")
        bar = ProgressBar(self.total_steps, start)
        every = self.cfg.logging.print_every_n_steps
        t0, eval_s = time.perf_counter(), 0.0
        self.source.start(start)
        try:
            for step in range(start, self.total_steps):
                metrics = self.step(step)
                self.version = step + 1
                metrics["time/loop_s"] = time.perf_counter() - t0 - eval_s  # the loop so far, evaluations excluded
                if self.cfg.eval.every_n_steps and (step + 1) % self.cfg.eval.every_n_steps == 0:
                    t_eval = time.perf_counter()
                    metrics.update({f"eval/{k}": v for k, v in self.evaluate(f"step {step + 1}").items()})
                    eval_s += time.perf_counter() - t_eval
                self.logger.log(step, metrics)
                if self.rank == 0 and every and (step + 1) % every == 0:
                    bar.update(step, _progress_fields(metrics))
                if self._checkpoint_due(step):
                    self.save(step, eval_before)
                fault_point("after_step", step + 1)
        finally:
            self.source.stop()  # an asynchronous run: its steps in flight are abandoned
        bar.close()
        eval_after = self.evaluate("after RL")
        return self._finish(eval_before, eval_after, time.perf_counter() - t0)

    def make_step_source(self) -> StepSource:
        """The run's step source (:mod:`aepo_engine.step_source`): this rank's engine, or in an
        asynchronous run a rollout process started now (its engine is the run's only one)."""
        cfg = self.cfg
        encode = (lambda example: example) if cfg.agent.enabled else self.prompt_ids  # an agent reads the example
        parts = dict(sampler=self.sampler, layout=self.layout, encode=encode, weights=self.policy,
                     bucket_bytes=int(cfg.backend.weight_sync_bucket_mb * 2**20))
        if not cfg.train.asynchronous:
            return SynchronousSource(self.backend, self.rollout, sleeps=cfg.backend.sleeps(torch.cuda.is_available()),
                                     **parts)
        from aepo_engine.asynchronous.source import AsynchronousSource, worker_spec

        spec = worker_spec(cfg.backend, self.rollout.config, self.tools_config, str(self.model_dir), cfg.seed,
                           self.world, threads=0, lora=cfg.policy.lora)
        return AsynchronousSource.launch(spec, torch_threads=cfg.train.torch_threads, tokenizer=self.tokenizer,
                                         max_staleness=cfg.train.max_staleness, total_steps=self.total_steps, **parts)

    def step(self, step: int) -> dict[str, Any]:
        """Step ``step``, whatever the run's mode: its rollouts from the step source (this rank's
        share), scored and gathered over ranks in prompt order, the update (:meth:`learn`), the
        new weights published to the engine; the step's metrics."""
        t0 = time.perf_counter()
        rollouts = self.source.collect(step)
        scored = self.score(rollouts.trajectories, rollouts.examples)
        t_ranks = time.perf_counter()
        gathered = distributed.all_gather_objects((scored, rollouts.stats), "the step's rollouts")
        waited_ranks = time.perf_counter() - t_ranks  # this rank's wait for the slowest one
        everything = sorted((s for part, _ in gathered for s in part), key=lambda s: (s[0].prompt_index, s[0].traj_id))
        stats = [st for _, st in gathered if st is not None]
        self.source.before_update()
        metrics = self.learn(step, rollouts.examples, *([s[i] for s in everything] for i in range(4)), stats)
        metrics.update(self.source.publish(step + 1))
        elapsed = time.perf_counter() - t0
        tokens = float(sum(len(s[0].response_ids) for s in everything))
        if self.cfg.agent.enabled:
            metrics.update(self.rollout.last_counts)
        metrics.update({"time/rollout_s": rollouts.rollout_s, "time/wait_for_rollouts_s": rollouts.waited_s,
                        "time/wait_for_ranks": waited_ranks, "time/step_s": elapsed,
                        "throughput/tokens_per_s": tokens / elapsed})
        if stats:
            metrics.update({f"time/rollout_{part}_s": sum(getattr(st, f"{part}_s") for st in stats) / len(stats)
                            for part in ("generate", "tool", "tail")})
            metrics["time/rollout_tool_chain_s"] = max(st.tool_chain_s for st in stats)  # the slowest rank's
        return metrics

    def learn(self, step: int, examples: list[Example], trajectories, rewards, correct, answers,
              stats: list[RolloutStats]) -> dict[str, Any]:
        """The learning part of step ``step``: group advantages, the proximal log-probs (the policy
        before this update), the behaviour->proximal correction, the update; the step's metrics
        (without its timing) and sample dump. ``trajectories`` etc. are in group order; their
        ``prompt_index`` indexes ``examples``, the step's prompts."""
        t0 = time.perf_counter()
        group_ids = torch.tensor([t.prompt_index for t in trajectories])
        advantages = group_advantages(torch.tensor(rewards), group_ids)
        batch = TokenBatch.from_trajectories(trajectories, advantages, self.tokenizer.pad_token_id or 0)
        rollout_logprobs = batch.old_logprobs  # what the backend reported while sampling
        batch.old_logprobs, batch.entropy = self.policy.compute_logprobs(batch)
        sampled = batch.loss_mask > 0
        entropy_tail = entropy_tail_metrics(batch.entropy[sampled].numpy(), self.cfg.logging.high_entropy_threshold)
        # Backend vs policy on the sampled tokens: ~0 for the HF backend; for vLLM the gap of its
        # kernels / precision. A large value means the two hold different weights.
        logprob_gap = float((rollout_logprobs - batch.old_logprobs)[sampled].abs().mean()) if sampled.any() else 0.0
        staleness = token_staleness(batch.versions, batch.loss_mask, step)
        batch.token_weights, batch.loss_mask, correction = rollout_correction(
            batch.old_logprobs, rollout_logprobs, batch.loss_mask, self.correction, batch.token_origin, staleness)
        update = self.policy.update(batch)
        gaps = branching_version_gaps(trajectories)
        metrics = {
            "reward/mean": float(np.mean(rewards)), "reward/std": float(np.std(rewards)),
            "train/accuracy": float(np.mean(correct)),
            **{f"loss/{k}": v for k, v in update.items()},
            **_rollout_metrics(stats, trajectories), "rollout/logprob_gap": logprob_gap, **correction,
            **diversity_metrics(trajectories, answers), **entropy_tail, **depth_metrics(trajectories),
            **branching_metrics(trajectories, self.cfg.rollout),
            **staleness_metrics(batch.versions, sampled, step),
            **({"staleness/branch_version_gap_mean": float(np.mean(gaps))} if gaps else {}),
            **drift_metrics(trajectories, [e.messages() for e in examples], self.tool_format),
            "time/update_s": time.perf_counter() - t0,
        }
        log_cfg = self.cfg.logging
        self.logger.dump_samples(step, sample_rows(trajectories, rewards, correct, answers, self.tokenizer,
                                                  log_cfg.sample_trajectories, log_cfg.sample_trees))
        return metrics

    def score(self, trajectories, examples: list[Example]) -> list[tuple[Any, float, bool, Any]]:
        """``(trajectory, reward, correct, answer)`` of each trajectory; ``prompt_index`` indexes ``examples``."""
        scored = []
        for traj in trajectories:
            if traj.agent_reward is not None:  # an agent's episode: its agent's reward
                correct = traj.agent_correct if traj.agent_correct is not None else traj.agent_reward > 0
                scored.append((traj, traj.agent_reward, bool(correct), None))
                continue
            text, tool_spans = reward_view(traj, self.tool_format)
            result = self.reward_fn(text, examples[traj.prompt_index].ground_truth, tool_spans)
            scored.append((traj, float(result.score), bool(result.correct), result.details.get("answer")))
        return scored

    def evaluate(self, label: str) -> dict[str, float]:
        """The run's evaluation (:class:`~aepo_engine.evaluation.during_run.RunEvaluation`) with the
        step source's engine at the weights trained so far."""
        if not self.evaluation:
            return {}
        self.source.prepare_evaluation(self.version)
        return self.evaluation(self.source.engine, label)

    # --- checkpoints ------------------------------------------------------------------------

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every_n_steps
        last = step + 1 == self.total_steps
        return (every > 0 and (step + 1) % every == 0) or (last and self.cfg.checkpoint.save_at_end)

    def save(self, step: int, eval_before: dict[str, float]) -> None:
        """Checkpoint after ``step``; the HF export (in the model's own dtype) only with the final
        checkpoint unless checkpoint.hf_export_every asks. A save the disk refuses ends the run
        (checkpoint.on_save_error = "stop") or is reported and retried at the next checkpoint ("warn")."""
        # An asynchronous run has drawn the prompts of later steps already: it saves the sampler's
        # state before those (a resumed run draws them again and samples them afresh).
        sampler_state = self.source.resume_point()
        extra = {"step": step, "sampler": sampler_state, "eval_before": eval_before}
        ckpt = self.cfg.checkpoint
        try:
            self.checkpoints.save(step + 1, self.policy.model, self.tokenizer, self.policy.optimizer,
                                  self.policy.scheduler, extra, self.config_text,
                                  export_hf=ckpt.exports_hf(step + 1, final=step + 1 == self.total_steps),
                                  hf_dtype=model_dtype(self.model_dir))
        except CheckpointSaveError as err:
            if ckpt.on_save_error == "stop":
                raise
            _warn(f"{err}; training goes on (checkpoint.on_save_error = 'warn')")

    def _check_checkpoint_space(self) -> None:
        """Warn before the first step when keep_last checkpoints (and the HF export) would not fit."""
        if self.rank != 0:
            return
        ckpt = self.cfg.checkpoint
        dtype = model_dtype(self.model_dir) or torch.float32
        params = sum(p.numel() for n, p in self.policy.model.named_parameters() if not is_adapter(n))  # the base
        trainable = sum(p.numel() for p in self.policy.trainable_parameters())
        footprint = checkpoint_footprint(params, dtype.itemsize, ckpt, trainable=trainable)
        _log(f"[checkpoint] disk: {footprint.describe(ckpt, str(dtype).removeprefix('torch.'))}")
        problem = space_problem(self.checkpoints.root, footprint)
        if problem:
            _warn(problem)

    def _resume(self) -> tuple[int, dict[str, Any]]:
        loaded = self.checkpoints.resume(self.cfg.checkpoint.resume, self.policy.model,
                                         self.policy.optimizer, self.policy.scheduler)
        if loaded is None:
            return 0, {}
        for path, problem in loaded.skipped:
            _warn(f"checkpoint {path} is damaged ({problem}): skipped; resuming from {loaded.path} instead")
        self.sampler.load_state_dict(loaded.extra_state["sampler"])  # the engine gets the weights: source.start
        _log(f"[resume] from {loaded.path} (after step {loaded.step})")
        return loaded.step, loaded.extra_state

    def _finish(self, before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
        summary = {"eval_before": before, "eval_after": after, "rl_seconds": seconds, "steps": self.total_steps,
                   # which rules produced these numbers (docs/scoring.md)
                   "scoring": {"reward": self.cfg.reward.rules, "eval": self.cfg.eval.scoring,
                               "judge_prompt": self.cfg.eval.judge.prompt if self.judge is not None else None}}
        if self.rank == 0:
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            if self.cfg.logging.plots_at_end and self.logger.enabled and self.logger.metrics_path.exists():
                try:
                    plot_metrics(self.logger.metrics_path, self.run_dir / "plots")
                except ImportError as exc:
                    _log(f"[plots] skipped: {exc}")
        _log(f"[done] held-out accuracy {before.get('accuracy', float('nan')):.4f} -> "
             f"{after.get('accuracy', float('nan')):.4f}; run folder {self.run_dir}")
        self.logger.close()
        return summary


# ---------------------------------------------------------------------------------------------
# Helpers


def _load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _rank_rollout_config(rollout_cfg, rank: int):
    """Each rank samples different prompts: offset its seed so their draws are independent."""
    return msgspec.structs.replace(rollout_cfg, seed=rollout_cfg.seed + 1_000_003 * rank) if rank else rollout_cfg


def _rollout_metrics(stats: list[RolloutStats], trajectories) -> dict[str, float]:
    """Rollout statistics summed/averaged over ranks."""
    def total(key):
        return float(sum(getattr(s, key) for s in stats))

    m_values = [m for s in stats for m in s.m]
    # the sampling entropies the backend computed (all tokens for HF; segment heads for vLLM)
    model_entropies = [e for t in trajectories for e, keep in zip(t.entropies, t.loss_mask) if keep and e == e]
    return {
        "rollout/global_samples": float(np.mean(m_values)) if m_values else 0.0,
        "rollout/branches": total("branches"),
        "rollout/branch_decisions": total("branch_decisions"),
        "rollout/tool_calls": total("tool_calls_executed"),
        "rollout/tool_calls_dropped": total("tool_calls_dropped"),
        "rollout/tool_errors": total("tool_errors"),
        "rollout/malformed_calls": total("malformed_calls"),
        "rollout/tokens_generated": total("tokens_generated"),
        "rollout/discarded_tokens": total("discarded_tokens"),
        "rollout/rounds": float(max(s.rounds for s in stats)),
        "rollout/waited_decisions": total("waited_decisions"),
        "rollout/fresh_global_samples": total("fresh_global_samples"),
        "rollout/entropy_mean": float(np.mean(model_entropies)) if model_entropies else 0.0,
        "rollout/response_tokens_mean": float(np.mean([len(t.response_ids) for t in trajectories])),
        **premonitoring_metrics(m_values, [h for s in stats for h in s.h_root], [h for s in stats for h in s.h_tool]),
    }


def _progress_fields(metrics: dict[str, Any]) -> dict[str, float]:
    keys = {"reward": "reward/mean", "acc": "train/accuracy", "H": "loss/entropy",
            "branches": "rollout/branches", "tok/s": "throughput/tokens_per_s", "eval": "eval/accuracy"}
    return {name: metrics[key] for name, key in keys.items() if key in metrics}


@entry_point
def main(argv: list[str]) -> dict[str, Any] | None:
    """``python -m aepo_engine.train [--preset NAME ...] [--config FILE ...] [--section.key=value ...]
    [--dry-run [--gpu NAME|GiB] [--world-size N] [--gpus-per-node N]] [--debug] [-h]``: exit status 2 on bad input or an
    unavailable part (and on problems found by --dry-run, a memory plan that does not fit included),
    with one ``error:`` line (:mod:`aepo_engine.errors`)."""
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    gpu, argv = _take_flag(argv, "--gpu")
    world_size, argv = _take_flag(argv, "--world-size")
    gpus_per_node, argv = _take_flag(argv, "--gpus-per-node")
    args = split_train_args(argv)
    if "-h" in argv or "--help" in argv:
        overrides = [a for a in args.overrides if a not in ("-h", "--help")]
        cfg = load_config(TrainConfig, path=args.files, overrides=overrides)
        source = f"{args.describe()}\n(presets, for --preset: {', '.join(list_presets())})"
        print(format_help(TrainConfig, PROG, defaults=cfg, defaults_from=source,
                          usage="[--preset NAME ...] [--config FILE ...] [--section.key=value ...] "
                                "[--dry-run [--gpu h100-80gb|h200|a100-80gb|GiB] [--world-size N] "
                                "[--gpus-per-node N]] [--debug]"))
        return None
    cfg = load_config(TrainConfig, path=args.files, overrides=args.overrides)
    if (gpu or world_size or gpus_per_node) and not dry_run:
        raise ConfigError("--gpu, --world-size and --gpus-per-node plan a run's memory: use them with --dry-run")
    if dry_run:
        from aepo_engine.dry_run import dry_run as check

        raise SystemExit(check(cfg, args.describe(), gpu=gpu, world_size=world_size, gpus_per_node=gpus_per_node))
    return Trainer(cfg).run()


def _take_flag(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """``(value, rest)`` of ``flag VALUE`` / ``flag=VALUE`` in ``argv`` (the last one wins)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == flag:
            if i + 1 >= len(argv):
                raise ConfigError(f"{flag} needs a value")
            value, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith(flag + "="):
            value = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return value, rest


if __name__ == "__main__":
    distributed.run_and_exit(main)
