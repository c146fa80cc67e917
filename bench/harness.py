"""Shared benchmark harness: timing with median and spread, peak memory, rows with provenance.

Each case runs in its own subprocess (``run_case_subprocess``) so that peak memory is the case's
own and one case's allocator state cannot slow the next. Inside the subprocess ``measure`` runs
``setup`` (untimed, outside the memory window), then the timed body; peak memory is the high-water
mark above the post-setup baseline:
- CPU: the process's peak resident set (``VmHWM``), reset before each repeat through
  ``/proc/self/clear_refs`` (Linux);
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
Results are rows (dicts) written as JSON lines under ``bench/results/`` with the machine, the
commit, the shape and the figures; ``print_table`` prints the short summary last.
"""
from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from aepo_engine.provenance import git_commit

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """Provenance of a result row: CPU/GPU model, cores, library versions, git commit."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "commit": git_commit(__file__),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for dist in ("transformers", "tokenizers"):  # what the task set-up (a trained tokenizer, the warm start) runs on
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # AVX2 / AVX512 kernels sum floats apart
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Peak bytes allocated above the baseline at ``start()``, on CPU (RSS) or CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def measure(setup: Callable[[], Any], body: Callable[[Any], dict[str, float] | None], *,
            warmup: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Run ``body(setup())`` warmup + repeats times; returns medians/spreads of time and memory.

    ``body`` may return named phase times (e.g. ``{"fwd_s": .., "bwd_s": ..}``); the whole body
    time is ``total_s``. Per key the row has the median (``total_s``), the spread (max - min,
    ``total_spread_s``), the minimum (``total_min_s``) and every timed sample (``samples``): on a VM
    that hands freed memory back to its host a fresh multi-GiB buffer's cost varies several-fold at
    random (host page faults; figures in docs/benchmarks.md), so a median of a few repeats can
    hide what the code does.
    """
    memory = PeakMemory(device)
    samples: dict[str, list[float]] = {}
    peaks = []
    for i in range(warmup + repeats):
        state = setup()
        memory.start()
        t0 = time.perf_counter()
        phases = body(state) or {}
        if memory.cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        peak = memory.peak()
        del state
        if i < warmup:
            continue
        peaks.append(peak)
        for key, value in {**phases, "total_s": total}.items():
            samples.setdefault(key, []).append(value)
    return summarize_samples(samples, peaks)


def summarize_samples(samples: dict[str, list[float]], peaks: list[int]) -> dict[str, Any]:
    """The row of :func:`measure` from its timed samples (key -> seconds per repeat) and peaks."""
    row: dict[str, Any] = {"repeats": len(peaks), "peak_bytes": max(peaks)}
    for key, values in samples.items():
        row[key] = statistics.median(values)
        row[key.replace("_s", "_spread_s")] = max(values) - min(values)
        row[key.replace("_s", "_min_s")] = min(values)
    row["samples"] = samples
    return row


def run_case_subprocess(script: Path, args: list[str], env: dict[str, str] | None = None,
                        timeout: float = 3600) -> dict[str, Any]:
    """Run ``script --case-json ...`` in a fresh interpreter; its last stdout line is a JSON row."""
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_rows(name: str, rows: list[dict[str, Any]], info: dict[str, Any] | None = None) -> Path:
    """Append rows (with machine info) as JSON lines to bench/results/<name>.jsonl.

    ``info``: the :func:`machine` record taken when the measurement started (a long benchmark
    should pass it: the checkout's commit may move while it runs); default: taken now.
    """
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.jsonl"
    info = info if info is not None else machine()
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({**info, **row}) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A fixed-width table of ``columns`` (floats to 4 significant digits; bytes as GiB)."""
    def fmt(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key.endswith("bytes") and isinstance(value, (int, float)):
            return f"{value / 2**30:.3f} GiB"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[fmt(c, r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
