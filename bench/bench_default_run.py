"""The embedded default run as a benchmark: wall time and held-out accuracy before/after RL, per seed.

Runs ``python -m aepo_engine.train --seed N`` once per seed, each in a fresh run folder. Every
seed of the run (world and questions, tiny-model init, warm start, data order, rollouts, evaluation
draws) derives from the root seed (``aepo_engine.seeding``), so the spread over seeds is the whole
seed-to-seed noise of the result; each row records the derived seeds from the run's config.toml. Rows go to
``bench/results/default_run.jsonl``; the summary prints the gain (after - before) per seed, its
mean, sample standard deviation and a paired t statistic (mean / (sd / sqrt(n))).

    python bench/bench_default_run.py --seeds 0 1 2 3
    python bench/bench_default_run.py --seeds 0 --extra --train.steps=2   # extra args go to the trainer

Run it alone on the machine: the wall time is part of the result (the default must finish in
10 minutes on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, print_table, write_rows  # noqa: E402

def run_one(seed: int, base_dir: Path, extra: list[str]) -> dict:
    run_dir = base_dir / f"seed{seed}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: remove it or choose another --base-dir (a reused run "
                         "would resume instead of measuring a fresh one)")
    command = [sys.executable, "-m", "aepo_engine.train", f"--run_dir={run_dir}", f"--seed={seed}", *extra]
    print("$", " ".join(command), flush=True)
    t0 = time.perf_counter()
    with (base_dir / f"seed{seed}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    config = tomllib.loads((run_dir / "config.toml").read_text())
    warm = run_dir / "setup" / "warm_start" / "warm_start.json"
    before, after = summary["eval_before"], summary["eval_after"]
    return {
        "seed": seed, "extra_args": extra, "wall_s": round(wall, 1), "rl_s": round(summary["rl_seconds"], 1),
        "warm_start_s": round(json.loads(warm.read_text())["seconds"], 1) if warm.exists() else None,
        "steps": summary["steps"], "samples": int(before["questions"]) * config["eval"]["samples"],
        "seeds": derived_seeds(config),
        "acc_before": before["accuracy"], "acc_after": after["accuracy"],
        "gain": after["accuracy"] - before["accuracy"],
        "no_tool_before": before.get("no_tool_share"), "no_tool_after": after.get("no_tool_share"),
        "per_kind_before": {k: v for k, v in before.items() if k.startswith("accuracy/")},
        "per_kind_after": {k: v for k, v in after.items() if k.startswith("accuracy/")},
    }


def derived_seeds(config: dict) -> dict[str, int]:
    """``{dotted key: seed}`` of every sub-seed as the run resolved it (from its config.toml)."""
    from aepo_engine.seeding import SEED_OFFSETS

    def leaf(key: str) -> int:
        node = config
        for part in key.split("."):
            node = node[part]
        return node

    return {key: leaf(key) for key in SEED_OFFSETS}


def summarize(rows: list[dict]) -> dict:
    gains = [r["gain"] for r in rows]
    mean = statistics.fmean(gains)
    sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
    t = mean / (sd / math.sqrt(len(gains))) if len(gains) > 1 and sd > 0 else float("nan")
    befores = [r["acc_before"] for r in rows]
    return {"seeds": len(rows), "gain_mean": mean, "gain_sd": sd, "paired_t": t,
            "before_mean": statistics.fmean(befores),
            "before_sd": statistics.stdev(befores) if len(befores) > 1 else float("nan"),
            "min_gain": min(gains), "max_wall_s": max(r["wall_s"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--base-dir", type=Path, default=Path("runs/bench-default"))
    parser.add_argument("--results", default="default_run", help="bench/results/<name>.jsonl ('' = do not write)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to the trainer")
    args = parser.parse_args()
    args.base_dir.mkdir(parents=True, exist_ok=True)
    info = machine()  # the commit the runs start from (the checkout may move during a long run)
    rows = []
    for seed in args.seeds:
        rows.append(run_one(seed, args.base_dir, args.extra))
        print(json.dumps(rows[-1]), flush=True)
    if args.results:
        print("rows appended to", write_rows(args.results, rows, info))
    print_table(rows, ["seed", "acc_before", "acc_after", "gain", "no_tool_before", "no_tool_after",
                       "warm_start_s", "rl_s", "wall_s"])
    print(json.dumps(summarize(rows), indent=1))


if __name__ == "__main__":
    main()
