"""Synchronous vs asynchronous training on the embedded job: RL steps per hour and held-out accuracy.

    python bench/bench_async.py --seeds 0 1 2 --modes sync async:1 async:2 --latency-median-s 1.0
    python bench/bench_async.py --modes sync:rounds sync:continuous async:1 --latency-median-s 0 0.3 1 \
        --results rollout_barrier
    python bench/bench_async.py --seeds 0 --modes sync async:1 --latency-median-s 0 --extra --train.steps=20

For each seed the task set-up (corpus, tokenizer, tiny model, warm start) is built once, without
search latency (it does not depend on it), and copied into every mode's run folder, so the modes
start from the same model. Then each mode runs ``python -m aepo_engine.train --preset embedded``
(plus ``--preset web_search`` and ``--tools.search.latency.median_s`` when the latency is > 0: the
search tool behind the retrieval server with a log-normal latency), one after the other, modes
interleaved per seed. A mode is ``sync`` or ``async:ETA`` (``train.mode=async``,
``train.max_staleness=ETA``), either with ``:rounds`` or ``:continuous`` (``rollout.schedule``), and
any ``+KEY=VALUE`` settings of its own.

Per run, one row in ``bench/results/<results>.jsonl``: steps per hour over the training loop
(``time/loop_s`` of the last step, evaluation excluded, checkpoints included) and in steady state
(from the end of the first step to the end of the last: the rollout process's start-up left out),
held-out accuracy before and after, where the time went (sums of the step metrics), and what the
machine was doing: load averages at start and end, the run's CPU seconds (user + system of the run
and its children, from ``/usr/bin/time -v`` when present) and peak RSS. The machine is shared:
compare runs of one seed, taken back to back, and read the load beside every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, write_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIME_KEYS = ("time/rollout_generate_s", "time/rollout_tool_s", "time/rollout_tail_s", "time/rollout_tool_chain_s",
             "time/update_s", "time/wait_for_rollouts_s", "time/weight_push_s", "engine/generate_s",
             "engine/tool_wait_s", "engine/idle_s", "engine/weight_load_s", "time/step_s")


def mode_args(mode: str) -> list[str]:
    """``sync`` (the config's schedule), ``sync:rounds`` / ``sync:continuous`` (``rollout.schedule``),
    ``async:ETA`` (on the config's schedule) or ``async:ETA:SCHEDULE``; each may end with
    ``+KEY=VALUE`` settings of that mode's runs alone (``sync:continuous+rollout.experimental.sample_ahead=true``)."""
    base, *settings = mode.split("+")
    match = re.fullmatch(r"(sync|async:(\d+))(?::(rounds|continuous))?", base)
    if not match or not all(re.fullmatch(r"[a-z_][a-z0-9_.]*=\S+", s) for s in settings):
        raise SystemExit(f"mode {mode!r}: use sync, sync:SCHEDULE, async:ETA or async:ETA:SCHEDULE "
                         "(SCHEDULE: rounds or continuous), then any +KEY=VALUE")
    args = (["--train.mode=sync"] if match.group(2) is None else
            ["--train.mode=async", f"--train.max_staleness={match.group(2)}"])
    return args + ([f"--rollout.schedule={match.group(3)}"] if match.group(3) else []) + [f"--{s}" for s in settings]


def build_setup(seed: int, folder: Path, extra: list[str]) -> Path:
    """The seed's task set-up (no search latency), built once in ``folder/setup``."""
    from aepo_engine.config import load_train_config
    from aepo_engine.config_loader import dump_config
    from aepo_engine.tasks.config import SyntheticSetupConfig

    if (folder / "setup" / "warm_start" / "DONE").exists():
        return folder / "setup"
    cfg = load_train_config(["--preset", "embedded", f"--seed={seed}", *extra])  # extra: presets and task sizes too
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "setup_config.toml").write_text(dump_config(SyntheticSetupConfig(task=cfg.task, tiny=cfg.model.tiny,
                                                                               tools=cfg.tools)))
    subprocess.run([sys.executable, "-m", "aepo_engine.tasks.synthetic_setup", str(folder / "setup_config.toml"),
                    str(folder)], check=True, cwd=REPO)
    return folder / "setup"


def run_one(seed: int, mode: str, latency: float, setup: Path, run_dir: Path, extra: list[str]) -> dict:
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: remove it (a reused run folder would resume, not measure)")
    shutil.copytree(setup, run_dir / "setup")
    presets = ["--preset", "embedded"] + (["--preset", "web_search", f"--tools.search.latency.median_s={latency}"]
                                          if latency > 0 else [])
    command = [sys.executable, "-m", "aepo_engine.train", *presets, f"--seed={seed}", f"--run_dir={run_dir}",
               *mode_args(mode), *extra]
    timer = ["/usr/bin/time", "-v"] if Path("/usr/bin/time").exists() else []
    print("$", " ".join(command), flush=True)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    log_path = run_dir.with_suffix(".log")
    with log_path.open("w") as log:
        subprocess.run(timer + command, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=REPO)
    wall = time.perf_counter() - t0
    return summarize_run(run_dir, log_path.read_text(), {
        "seed": seed, "mode": mode, "latency_median_s": latency, "extra_args": extra, "wall_s": round(wall, 1),
        "load_avg_start": [round(x, 2) for x in load_start], "load_avg_end": [round(x, 2) for x in os.getloadavg()]})


def summarize_run(run_dir: Path, log: str, row: dict) -> dict:
    """The row of one finished run (``row``: what the caller knows), from its summary, metrics and log."""
    from aepo_engine.metrics import read_metrics

    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    loop = [r["time/loop_s"] for r in rows]
    steps = len(rows)
    row.update({
        "steps": steps, "loop_s": round(loop[-1], 1),
        "steps_per_hour": round(3600 * steps / loop[-1], 1),
        "steady_steps_per_hour": round(3600 * (steps - 1) / (loop[-1] - loop[0]), 1) if steps > 1 else None,
        "acc_before": summary["eval_before"].get("accuracy"), "acc_after": summary["eval_after"].get("accuracy"),
        "time_sums_s": {k: round(sum(r.get(k, 0.0) for r in rows), 1) for k in TIME_KEYS if any(k in r for r in rows)},
        "staleness_mean": _mean(rows, "staleness/mean"), "truncated_share_mean": _mean(rows, "rollout_correction/truncated_share"),
        "reward_mean_last10": _mean(rows[-10:], "reward/mean"),
        "search_calls": sum(r.get("rollout/tool_calls", 0.0) for r in rows),
        # the share of the loop the engine did not generate (waiting on tools, on the update, idle)
        "engine_idle_share": round(1 - sum(r.get("engine/generate_s", r.get("time/rollout_generate_s", 0.0))
                                           for r in rows) / loop[-1], 3),
        # the share of the loop the trainer waited for rollouts (its update's device idle)
        "trainer_idle_share": round(sum(r.get("time/wait_for_rollouts_s", 0.0) for r in rows) / loop[-1], 3),
    })
    cpu = re.search(r"User time \(seconds\): ([\d.]+)\s+System time \(seconds\): ([\d.]+)", log)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log)
    if cpu:
        row["cpu_s"] = round(float(cpu.group(1)) + float(cpu.group(2)), 1)
    if rss:
        row["max_rss_mb"] = round(int(rss.group(1)) / 1024, 1)
    return row


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=["sync", "async:1", "async:2"])
    parser.add_argument("--latency-median-s", type=float, nargs="+", default=[1.0],
                        help="one or several: each seed runs every mode at every latency")
    parser.add_argument("--base-dir", type=Path, default=Path("runs/bench-async"))
    parser.add_argument("--results", default="async_runs", help="bench/results/<name>.jsonl ('' = do not write)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="arguments passed to the trainer")
    args = parser.parse_args()
    for mode in args.modes:
        mode_args(mode)
    info = machine()  # the commit the runs start from
    for seed in args.seeds:
        setup = build_setup(seed, args.base_dir / f"seed{seed}", args.extra)
        for latency in args.latency_median_s:
            for mode in args.modes:
                name = re.sub(r"[^A-Za-z0-9_.=-]", "", mode.replace("+", "_")) + f"_lat{latency:g}"
                row = run_one(seed, mode, latency, setup, args.base_dir / f"seed{seed}" / name, args.extra)
                print(json.dumps(row), flush=True)
                if args.results:
                    write_rows(args.results, [row], info)


if __name__ == "__main__":
    main()
