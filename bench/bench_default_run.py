"""Does a preset learn? Held-out accuracy before and after RL, per seed and thread count, and the gate.

Runs ``python -m aepo_engine.train --seed N`` (with ``--train.torch_threads=T`` for each of
``--threads``) once per seed, each in a fresh run folder. Every seed of the run (world and
questions, tiny-model init, warm start, data order, rollouts, evaluation draws) derives from the
root seed (``aepo_engine.seeding``), so the spread over seeds is the whole seed-to-seed noise of
the result; each row records the derived seeds from the run's config.toml. With no ``--preset``
the job is the embedded default (``python -m aepo_engine.train``) and the rows go to
``bench/results/main_job.jsonl``; with presets (``--preset smollm2``, ``--preset embedded --preset
web_search``) to ``learning_runs.jsonl`` under ``bench/results`` (made by the first such run).
The summary prints the gain (after - before) per run, its mean, median, sample standard deviation
and a paired t statistic (mean / (sd / sqrt(n))). Each row also holds the run's peak resident set,
every held-out evaluation (accuracy, tool calls per question, no-tool share, reward) and the
evaluations where tool calls fell below half the first one's while accuracy fell (reward hacking).

    python bench/bench_default_run.py --seeds 0 1 2 3 4 --threads 1 2
    python bench/bench_default_run.py --seeds 0 1 2 --preset embedded --preset grpo
    python bench/bench_default_run.py --seeds 0 --gate --results ''     # CI's learning gate
    python bench/bench_default_run.py --seeds 0 --extra --train.steps=2   # extra args go to the trainer
    python bench/bench_default_run.py --seeds 0 1 2 --preset smollm2 --preset smollm2_lora --parallel 3 \
        --results smollm2_runs                                            # the real model with LoRA

``--gate`` fails (exit 1) when a run's held-out accuracy after the warm start or its RL gain is
below the gate's floor (:data:`GATES`, per preset set; derived from the 5-seed rows in
docs/experiments.md), printing both figures. Run it alone on the machine: the wall time is part of
the result (the default must finish in 6 minutes on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, print_table, write_rows  # noqa: E402

# The learning gate's floors, by the presets the job runs with (() = the embedded default): issue
# 48's targets for every seed, 25% held-out accuracy after the warm start and +10 points of RL.
# The 5 seeds x 1 and 2 threads measured at 1b3150d (bench/results/main_job.jsonl; docs/
# experiments.md, "The learning gate") were at worst 41.75% and +15.75 points: a run that learns
# as they did passes, one that learns as the broken warm start did (6.0%, +0.5 points) fails.
GATES: dict[tuple[str, ...], dict[str, float]] = {
    (): {"acc_before": 0.25, "gain": 0.10},
}


class Run:
    """One training run as a child process: started by :meth:`start`, measured by :meth:`finish`
    (its wall time and peak resident set, from ``os.wait4``'s rusage of that child alone)."""

    def __init__(self, seed: int, threads: int | None, base_dir: Path, presets: list[str], extra: list[str]):
        self.seed, self.threads, self.base_dir, self.presets, self.extra = seed, threads, base_dir, presets, extra
        self.name = f"seed{seed}" + (f"-t{threads}" if threads is not None else "")
        self.run_dir = base_dir / self.name
        if self.run_dir.exists():
            raise SystemExit(f"{self.run_dir} exists: remove it or choose another --base-dir (a reused run "
                             "would resume instead of measuring a fresh one)")

    def start(self) -> None:
        command = [sys.executable, "-m", "aepo_engine.train", f"--run_dir={self.run_dir}", f"--seed={self.seed}",
                   *(arg for p in self.presets for arg in ("--preset", p)),
                   *([f"--train.torch_threads={self.threads}"] if self.threads is not None else []), *self.extra]
        print("$", " ".join(command), flush=True)
        self.t0 = time.perf_counter()
        with (self.base_dir / f"{self.name}.log").open("w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def finish(self) -> dict:
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - self.t0
        if self.proc.returncode != 0:
            tail = (self.base_dir / f"{self.name}.log").read_text().splitlines()[-30:]
            raise SystemExit("\n".join(tail) + f"\nthe run failed (exit {self.proc.returncode}): "
                             f"{self.base_dir / self.name}.log")
        return run_row(self.seed, self.presets, self.extra, self.run_dir, wall, usage.ru_maxrss / 2**20)


EVAL_FIELDS = ("accuracy", "tool_calls", "no_tool_share", "reward")


def eval_curve(run_dir: Path, summary: dict) -> list[dict]:
    """Every held-out evaluation of the run in order: before RL, those during it (``eval.every_n_steps``,
    from logs/metrics.jsonl) and after RL, each with its accuracy, tool calls per question,
    no-tool share and reward."""
    from aepo_engine.metrics import read_metrics

    curve = [{"rl_step": 0, **{k: summary["eval_before"].get(k) for k in EVAL_FIELDS}}]
    metrics = run_dir / "logs" / "metrics.jsonl"
    for row in read_metrics(metrics) if metrics.exists() else []:
        if "eval/accuracy" in row and row.get("step", 0) < summary["steps"]:
            curve.append({"rl_step": row["step"], **{k: row.get(f"eval/{k}") for k in EVAL_FIELDS}})
    curve.append({"rl_step": summary["steps"], **{k: summary["eval_after"].get(k) for k in EVAL_FIELDS}})
    return curve


def reward_hacking(curve: list[dict]) -> list[str]:
    """Evaluations where tool calls per question fell below half the first evaluation's while
    accuracy fell below it (the policy earning reward by skipping the tools): empty when none."""
    first = curve[0]
    return [f"RL step {e['rl_step']}: {e['tool_calls']:.2f} tool calls/question (< half of {first['tool_calls']:.2f}) "
            f"with accuracy {e['accuracy']:.3f} < {first['accuracy']:.3f}"
            for e in curve[1:] if e["tool_calls"] is not None and first["tool_calls"]
            and e["tool_calls"] < 0.5 * first["tool_calls"] and e["accuracy"] < first["accuracy"]]


def run_row(seed: int, presets: list[str], extra: list[str], run_dir: Path, wall: float, max_rss_gib: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    config = tomllib.loads((run_dir / "config.toml").read_text())
    warm_path = run_dir / "setup" / "warm_start" / "warm_start.json"
    warm = json.loads(warm_path.read_text()) if warm_path.exists() else {}
    before, after = summary["eval_before"], summary["eval_after"]
    curve = eval_curve(run_dir, summary)
    return {
        "seed": seed, "threads": config["train"].get("torch_threads") or None, "presets": presets, "extra_args": extra,
        "wall_s": round(wall, 1), "max_rss_gib": round(max_rss_gib, 2), "rl_s": round(summary["rl_seconds"], 1),
        "warm_start_s": round(warm["seconds"], 1) if warm else None,
        "warm_start_loss": round(warm["final_loss"], 4) if warm else None,
        "warm_start_steps": warm.get("steps"), "warm_start_val_exact": warm.get("val_exact"),
        "steps": summary["steps"], "samples": int(before["questions"]) * config["eval"]["samples"],
        "seeds": derived_seeds(config),
        "acc_before": before["accuracy"], "acc_after": after["accuracy"],
        "gain": after["accuracy"] - before["accuracy"],
        "no_tool_before": before.get("no_tool_share"), "no_tool_after": after.get("no_tool_share"),
        "per_kind_before": {k: v for k, v in before.items() if k.startswith("accuracy/")},
        "per_kind_after": {k: v for k, v in after.items() if k.startswith("accuracy/")},
        "evals": curve, "reward_hacking": reward_hacking(curve),
    }


def derived_seeds(config: dict) -> dict[str, int]:
    """``{dotted key: seed}`` of every sub-seed as the run resolved it (from its config.toml)."""
    from aepo_engine.seeding import SEED_OFFSETS

    def leaf(key: str) -> int | None:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    # (a key an older trainer's config lacks is left out: the gate can run against older code)
    return {key: value for key in SEED_OFFSETS if (value := leaf(key)) is not None}


def summarize(rows: list[dict]) -> dict:
    gains = [r["gain"] for r in rows]
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
    t = mean / (sd / math.sqrt(len(gains))) if len(gains) > 1 and sd > 0 else float("nan")
    befores = [r["acc_before"] for r in rows]
    return {"seeds": len(rows), "gain_mean": mean, "gain_median": statistics.median(gains), "gain_sd": sd,
            "paired_t": t, "before_mean": statistics.fmean(befores),
            "before_sd": statistics.stdev(befores) if len(befores) > 1 else float("nan"),
            "min_before": min(befores), "min_gain": min(gains), "max_wall_s": max(r["wall_s"] for r in rows)}


def gate_failures(rows: list[dict], floors: dict[str, float]) -> list[str]:
    """One line per run and figure below its floor (empty: the gate passes)."""
    return [f"seed {r['seed']}" + (f" ({r['threads']} threads)" if r.get("threads") else "")
            + f": {key} {r[key]:.4f} < {floor:.4f}"
            for r in rows for key, floor in floors.items() if r[key] < floor]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="run each seed with each of these train.torch_threads (default: the config's)")
    parser.add_argument("--preset", action="append", default=[],
                        help="presets, in order (none: the embedded default); repeat for several")
    parser.add_argument("--base-dir", type=Path, default=Path("runs/bench-default"))
    parser.add_argument("--results", default=None,
                        help="bench/results/<name>.jsonl ('' = do not write; default main_job, or "
                             "learning_runs with --preset)")
    parser.add_argument("--gate", action="store_true",
                        help="exit 1 when a run's accuracy after the warm start or its RL gain is below the "
                             "floor in GATES for these presets")
    parser.add_argument("--note", default="", help="recorded in each row (e.g. what else ran on the machine)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs at a time (each row records it: wall times of concurrent runs share the cores)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to the trainer")
    args = parser.parse_args(argv)
    floors = GATES.get(tuple(p for p in args.preset if p != "embedded"))
    if args.gate and floors is None:
        parser.error(f"no gate is defined for presets {args.preset} (GATES has {sorted(GATES)})")
    results = args.results if args.results is not None else ("learning_runs" if args.preset else "main_job")
    args.base_dir.mkdir(parents=True, exist_ok=True)
    info = machine()  # the commit the runs start from (the checkout may move during a long run)
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    pending = [Run(seed, threads, args.base_dir, args.preset, args.extra)
               for seed in args.seeds for threads in args.threads or [None]]
    rows, running = [], []
    while pending or running:
        while pending and len(running) < args.parallel:
            running.append(pending.pop(0))
            running[-1].start()
        rows.append({**running.pop(0).finish(), "parallel": args.parallel})
        print(json.dumps(rows[-1]), flush=True)
    if results:
        print("rows appended to", write_rows(results, [{**r, "note": args.note} if args.note else r for r in rows],
                                             info))
    print_table(rows, ["seed", "threads", "warm_start_loss", "acc_before", "acc_after", "gain", "no_tool_before",
                       "no_tool_after", "warm_start_s", "rl_s", "wall_s"])
    print(json.dumps(summarize(rows), indent=1))
    if args.gate:
        failures = gate_failures(rows, floors)
        floor_text = ", ".join(f"{k} >= {v:.2f}" for k, v in floors.items())
        if failures:
            print(f"learning gate FAILED (needs {floor_text}):\n  " + "\n  ".join(failures))
            return 1
        print(f"learning gate passed ({floor_text}): "
              + "; ".join(f"seed {r['seed']}: {r['acc_before']:.4f} after the warm start, gain {r['gain']:+.4f}"
                          for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
