"""Watching a run: JSONL metrics, a one-line progress bar, TensorBoard, sample dumps, PNG plots.

Only rank 0 writes. ``metrics.jsonl`` gets one JSON object per step (floats only); the progress
bar shows step, reward, accuracy, entropy, branch statistics, tokens/s and the ETA; TensorBoard
is used when the ``tensorboard`` package is installed (``LoggingConfig.tensorboard``); wandb when
asked for and installed; ``plot_metrics`` writes PNGs of reward, entropy and clip fractions
(matplotlib, imported only there).
Deliberately left out: a live dashboard; metrics from non-zero ranks (the trainer reduces first).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable

PLOT_GROUPS = {
    "reward": ("reward/mean", "eval/accuracy"),
    "entropy": ("loss/entropy", "rollout/entropy_mean"),
    "clip_fractions": ("loss/clipfrac_high", "loss/clipfrac_low", "loss/clipfrac_dual"),
    "branching": ("rollout/branches", "rollout/global_samples"),
}


class ProgressBar:
    """A single status line: rewritten in place on a terminal, one line per update elsewhere."""

    def __init__(self, total: int, start: int = 0, stream=None):
        self.total, self.start, self.stream = total, start, stream or sys.stderr
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, step: int, fields: dict[str, float]) -> str:
        done = step + 1 - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        width = 20
        filled = int(width * (step + 1) / max(self.total, 1))
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] step {step + 1}/{self.total}"]
        parts += [f"{k} {v:.3g}" for k, v in fields.items() if isinstance(v, (int, float)) and math.isfinite(v)]
        parts.append(f"eta {eta:.0f}s")
        line = " | ".join(parts)
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


class RunLogger:
    """Writes metrics and samples under ``run_dir``; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | Path, *, rank: int = 0, tensorboard: bool = False,
                 wandb_project: str | None = None, run_name: str = "", config: dict | None = None):
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.tb = self.wandb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name or None, config=config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (non-numbers are dropped from TensorBoard/wandb)."""
        if not self.enabled:
            return
        row = {"step": step, **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.tb is not None:
            for key, value in numeric.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def dump_samples(self, step: int, samples: Iterable[dict[str, Any]]) -> None:
        """Write a step's sample trajectories (text, reward, lineage) for inspection."""
        if self.enabled:
            path = self.run_dir / "samples" / f"step_{step:06d}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a resumed run may repeat steps: the last row of a step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_metrics(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """PNG plots of reward, entropy, clip fractions and branching over steps; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in PLOT_GROUPS.items():
        series = {k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
