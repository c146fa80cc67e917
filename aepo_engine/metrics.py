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

from aepo_engine.sections import LoggingConfig  # re-exported: its old home
from aepo_engine.files import write_text_atomic


PLOT_GROUPS = {
    "reward": ("reward/mean", "eval/accuracy"),
    "entropy": ("loss/entropy", "rollout/entropy_mean"),
    "entropy_tail": ("entropy/mean", "entropy/p90", "entropy/p99", "entropy/high_frac"),
    "clip_fractions": ("loss/clipfrac_high", "loss/clipfrac_low", "loss/clipfrac_dual"),
    "clip_fractions_by_origin": ("loss/clipfrac_high/branch", "loss/clipfrac_low/branch",
                                 "loss/clipfrac_high/global", "loss/clipfrac_low/global"),
    "branching": ("rollout/branches", "rollout/global_samples"),
    "tree_depth": ("rollout/tree_depth_mean", "rollout/tree_depth_max", "rollout/branch_depth_mean"),
    "diversity": ("diversity/distinct_answers", "diversity/distinct_tool_sequences", "diversity/pairwise_distance"),
    # training.counterfactual: what PPO's clip would zero that AEPO's keeps, on the top-20% entropy tokens
    "counterfactual_clip": ("loss/cf/high_kept_frac", "loss/cf/high_kept_mass", "loss/cf/kept_frac",
                            "loss/cf/high_kept_frac/global", "loss/cf/high_kept_frac/branch"),
    # ... and the share of gradient mass on those tokens with the entropy-aware advantage on / off
    "counterfactual_advantage": ("loss/cf/adv_high_share_on", "loss/cf/adv_high_share_off",
                                 "loss/cf/adv_high_share_on/branch", "loss/cf/adv_high_share_off/branch"),
    "branch_runs": ("rollout/branches_per_traj", "rollout/branch_concentration", "rollout/branch_run_mean",
                    "rollout/consecutive_branch_share", "rollout/penalty_decisive_share"),
    "premonitoring": ("rollout/global_samples", "rollout/m_min", "rollout/m_max", "rollout/h_root_mean",
                      "rollout/h_tool_mean"),
    # asynchronous training (docs/async.md): how stale the trained tokens were
    "staleness": ("staleness/mean", "staleness/max", "staleness/mixed_trajectories", "rollout_correction/ratio_mean",
                  "rollout_correction/truncated_share"),
}

# Where each step's time goes (plots/time.png), one stacked bar per step and panel: the parts a
# step's seconds split into, per training mode (docs/async.md), and the part of the synchronous
# rollout spent in tail rounds (drawn as a line over its bars: a share of generation + tools).
TIME_PANELS = {
    "synchronous step": {"generation": "time/rollout_generate_s", "tools": "time/rollout_tool_s",
                         "update": "time/update_s", "weight push": "time/weight_push_s"},
    "asynchronous trainer": {"waiting for rollouts": "time/wait_for_rollouts_s", "update": "time/update_s",
                             "weight push": "time/weight_push_s"},
    "asynchronous engine (between two steps)": {"generation": "engine/generate_s", "waiting on tools only":
                                                "engine/tool_wait_s", "idle": "engine/idle_s",
                                                "loading weights": "engine/weight_load_s"},
}


class ProgressBar:
    """A single status line: rewritten in place on a terminal, one line per update elsewhere."""

    def __init__(self, total: int, start: int = 0, stream=None, unit: str = "step"):
        self.total, self.start, self.stream, self.unit = total, start, stream or sys.stderr, unit
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def update(self, step: int, fields: dict[str, float]) -> str:
        done = step + 1 - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step - 1)
        width = 20
        filled = int(width * (step + 1) / max(self.total, 1))
        parts = [f"[{'#' * filled}{'.' * (width - filled)}] {self.unit} {step + 1}/{self.total}"]
        parts += [f"{k} {v:.3g}" for k, v in fields.items() if isinstance(v, (int, float)) and math.isfinite(v)]
        parts.append(f"eta {eta:.0f}s" if done > 0 else "eta ?")  # nothing finished: no rate yet
        line = " | ".join(parts)
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


class RunLogger:
    """Writes metrics and samples under ``run_dir``; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | Path, *, rank: int = 0, jsonl: bool = True, tensorboard: bool = False,
                 wandb_project: str | None = None, run_name: str = "", config: dict | None = None):
        self.enabled = rank == 0
        self.jsonl = jsonl
        self.run_dir = Path(run_dir)
        self.tb = self.wandb = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "samples").mkdir(exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        _cut_torn_line(self.metrics_path)
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
        if self.jsonl:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
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
            write_text_atomic(path, "".join(json.dumps(s) + "\n" for s in samples))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _cut_torn_line(path: Path) -> None:
    """Cut a last line left unfinished (a kill or a full disk in the middle of an append), so
    the rows a resumed run appends stay readable."""
    if not path.is_file():
        return
    with path.open("rb+") as handle:
        data = handle.read()
        if data and not data.endswith(b"\n"):
            handle.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a resumed run may repeat steps: the last row of a step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_metrics(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """PNG plots of reward, entropy, clip fractions, branching and evaluation over steps; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # Held-out accuracy and every evaluated benchmark's pass@1 (eval.files), one curve each.
    eval_keys = ("eval/accuracy", *sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/pass@1")}))
    for name, keys in {**PLOT_GROUPS, "eval": eval_keys}.items():
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
    time_plot = plot_time(rows, out_dir / "time.png")
    return written + ([time_plot] if time_plot else [])


def plot_time(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Stacked bars of where each step's seconds went (``TIME_PANELS``); ``other`` is the rest of
    ``time/step_s`` (scoring, logging, bookkeeping). None when the rows hold no timing."""
    import matplotlib.pyplot as plt

    panels = [(title, parts) for title, parts in TIME_PANELS.items()
              if any(key in r for r in rows for key in list(parts.values())[:1])]
    asynchronous = any("engine/version" in r for r in rows)  # the asynchronous source's engine counters
    panels = [(t, p) for t, p in panels if (t == "synchronous step") != asynchronous]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), squeeze=False)
    steps = [r["step"] for r in rows]
    for ax, (title, parts) in zip(axes[:, 0], panels):
        bottom = [0.0] * len(rows)
        for label, key in parts.items():
            values = [float(r.get(key, 0.0)) for r in rows]
            ax.bar(steps, values, bottom=bottom, label=label, width=0.85)
            bottom = [b + v for b, v in zip(bottom, values)]
        if not title.startswith("asynchronous engine"):
            other = [max(float(r.get("time/step_s", b)) - b, 0.0) for r, b in zip(rows, bottom)]
            ax.bar(steps, other, bottom=bottom, label="other", width=0.85, color="lightgrey")
        if title == "synchronous step" and any("time/rollout_tail_s" in r for r in rows):
            ax.plot(steps, [r.get("time/rollout_tail_s", 0.0) for r in rows], "k.-", lw=1,
                    label="of which tail rounds (slowest trajectories)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
