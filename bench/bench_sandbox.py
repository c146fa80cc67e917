"""Python-tool sandbox latency: per-call time of trivial code, and 64 concurrent calls.

Cases (each in its own subprocess, ``harness.run_case_subprocess``; ``--label`` says which code
state was measured, e.g. ``before`` / ``after`` a sandbox change):
- ``print``: ``print(1)`` with the standard library only (``site_packages=False``);
- ``numpy``: ``import numpy; print(numpy.zeros(3).sum())`` with ``site_packages=True``;
- ``concurrent64``: 64 calls of ``print(1)`` submitted at once to 64 threads (the default
  ``uid_pool_size``), timed from first submit to last result: calls/s and the per-call latencies.

Per single-call case: ``warmup`` untimed calls, then ``repeats`` calls of ``run_python`` timed one
by one (wall clock, ``time.perf_counter`` around the whole call: lease, set-up, run, clean-up);
median, p95, min and max. Memory, two figures: ``engine_peak_bytes``, the engine process's
resident-set high-water mark above its baseline over the timed calls (``harness.PeakMemory``:
what the sandbox machinery costs the trainer, threads and pipes included), and
``sandbox_python_rss_bytes``, the peak RSS of the sandboxed interpreter itself, read by one
extra untimed call that prints its own ``ru_maxrss`` (the sandbox's helper processes - bwrap,
its init - are not in it). The machine is shared: every row records the 1-minute load average
before and after the case; read times beside it.

    python bench/bench_sandbox.py --label after                    # all cases, default config
    python bench/bench_sandbox.py --cases print --repeats 50 --config '{"scratch_mb": 32}'
    python bench/bench_sandbox.py --compare-commit a6f080e --rounds 3  # before/after, interleaved

``--compare-commit SHA`` exports that commit's ``aepo_engine`` (``git archive``) to a temporary
folder and runs every case ``--rounds`` times alternately on it (label ``before@SHA``) and on
the working tree (label ``after``), so both see the same machine load; each round is a row.

Rows go to ``bench/results/sandbox_latency.jsonl``. Deliberately left out: long-running code
(the sandbox's cost is fixed per call, so trivial code isolates it) and GPU anything.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

CODE = {
    "print": ("print(1)", "1\n", {}),
    "numpy": ("import numpy\nprint(numpy.zeros(3).sum())", "0.0\n", {"site_packages": True}),
    "concurrent64": ("print(1)", "1\n", {}),
}
CONCURRENCY = 64
REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile by nearest rank on sorted values (q=0.95: p95)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _one_call(code: str, expected: str, config) -> float:
    from aepo_engine.tools.sandbox import run_python

    t0 = time.perf_counter()
    outcome = run_python(code, config)
    elapsed = time.perf_counter() - t0
    if outcome.returncode != 0 or outcome.stdout != expected:
        raise RuntimeError(f"sandbox call failed: rc={outcome.returncode} out={outcome.stdout!r} "
                           f"err={outcome.stderr[-500:]!r}")
    return elapsed


def run_case(case: str, repeats: int, warmup: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Time one case in this process; returns its row (without machine info)."""
    import msgspec

    from aepo_engine.tools.config import PythonConfig

    code, expected, fields = CODE[case]
    config = msgspec.convert({**fields, **overrides}, PythonConfig)
    for _ in range(warmup):
        _one_call(code, expected, config)
    import aepo_engine

    row: dict[str, Any] = {"case": case, "config": {**fields, **overrides},
                           "engine_dir": str(Path(aepo_engine.__file__).parent)}
    memory = harness.PeakMemory("cpu")
    memory.start()
    if case == "concurrent64":
        walls, latencies = [], []
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for _ in range(repeats):
                t0 = time.perf_counter()
                latencies += list(pool.map(lambda _: _one_call(code, expected, config),
                                           range(CONCURRENCY)))
                walls.append(time.perf_counter() - t0)
        row.update(calls=CONCURRENCY, wall_s=statistics.median(walls),
                   wall_spread_s=max(walls) - min(walls),
                   calls_per_s=CONCURRENCY / statistics.median(walls))
        samples = latencies
    else:
        samples = [_one_call(code, expected, config) for _ in range(repeats)]
    row.update(repeats=repeats, median_s=statistics.median(samples),
               p95_s=percentile(samples, 0.95), min_s=min(samples), max_s=max(samples),
               engine_peak_bytes=memory.peak(),
               sandbox_python_rss_bytes=_sandbox_rss(code, config))
    return row


def _sandbox_rss(code: str, config) -> int:
    """Peak RSS in bytes of the sandboxed interpreter after running ``code`` (one extra call)."""
    from aepo_engine.tools.sandbox import run_python

    probe = code + "\nimport resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    outcome = run_python(probe, config)
    return int(outcome.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def export_tree(commit: str, dest: Path) -> None:
    """``aepo_engine`` as of ``commit`` into ``dest`` (read from git, the work tree untouched)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "aepo_engine"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def _run_in_subprocess(case: str, label: str, tree: str, args) -> dict[str, Any]:
    repeats = args.concurrent_repeats if case == "concurrent64" else args.repeats
    load_before = os.getloadavg()[0]
    payload = json.dumps({"case": case, "repeats": repeats, "warmup": args.warmup})
    pythonpath = os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH", "")])])
    row = harness.run_case_subprocess(Path(__file__), ["--config", args.config, "--case-json", payload],
                                      env={"PYTHONPATH": pythonpath})
    return {"label": label, "case": case, **row, "load_before": load_before,
            "load_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CODE), default=["print", "numpy",
                                                                               "concurrent64"])
    parser.add_argument("--repeats", type=int, default=40,
                        help="timed calls per single-call case; rounds of 64 for concurrent64")
    parser.add_argument("--concurrent-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--label", default="", help="which code state this is (before/after)")
    parser.add_argument("--config", default="{}", help="JSON PythonConfig fields for every case")
    parser.add_argument("--no-write", action="store_true", help="print only, write no rows")
    parser.add_argument("--compare-commit", default="",
                        help="also time this commit's aepo_engine, interleaved with the working tree")
    parser.add_argument("--rounds", type=int, default=1, help="alternations with --compare-commit")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    overrides = json.loads(args.config)
    if args.case_json:
        case = json.loads(args.case_json)
        print(json.dumps(run_case(case["case"], case["repeats"], case["warmup"], overrides)))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="aepo_bench_sandbox_") as baseline:
        trees = [(args.label or "after", str(REPO))]
        if args.compare_commit:
            export_tree(args.compare_commit, Path(baseline))
            trees.insert(0, (f"before@{args.compare_commit}", baseline))
        for _ in range(args.rounds):
            for case in args.cases:
                for label, tree in trees:
                    rows.append(_run_in_subprocess(case, label, tree, args))
    if not args.no_write:
        print("rows ->", harness.write_rows("sandbox_latency", rows))
    for row in rows:
        for key in ("median_s", "p95_s", "min_s", "max_s", "wall_s"):
            if key in row:
                row[key.replace("_s", "_ms")] = row[key] * 1000
    harness.print_table(rows, ["label", "case", "median_ms", "p95_ms", "min_ms", "max_ms",
                               "wall_ms", "calls_per_s", "engine_peak_bytes",
                               "sandbox_python_rss_bytes", "load_before",
                               "load_after", "error"])


if __name__ == "__main__":
    main()
