"""Results of an algorithm-comparison grid: one JSON row per finished run, a Markdown table of
mean +- sample standard deviation over seeds per algorithm, and PNG plots with seed bands.

Everything is read back from the run directories (``summary.json``, ``config.toml``,
``logs/metrics.jsonl``, ``compare_run.json``), so the results can be rebuilt at any time from
whatever runs have finished (``python -m aepo_engine.experiments.compare --summarize-only``), while
the grid is still going. Files written to the results folder, for task ``<task>`` (the last task
preset of the grid):

- ``compare_<task>.jsonl``: one row per finished run (rewritten, not appended: it is a snapshot);
- ``compare_<task>.md``: the table, the budget, the check that every algorithm of a seed measured
  the same held-out accuracy before RL, and the runs still missing;
- ``compare_<task>_accuracy.png`` (held-out accuracy before/after per algorithm, seed error bars),
  ``compare_<task>_curves.png`` (per-step curves, mean over seeds with a +-1 std band) and, when
  some run pre-monitored, ``compare_<task>_premonitoring.png`` (the global budget m per step
  against H_root - H_tool, with spec 1a's rule).

Per-step metrics are summarised per run as the mean over all steps and over the first and last
quarter of the steps (e.g. the entropy trend). Metrics a run did not log show as "-".
"""
from __future__ import annotations

import json
import math
import statistics
import tomllib
from pathlib import Path
from typing import Any, Callable, Sequence

from aepo_engine.experiments.grid import read_grid_file
from aepo_engine.metrics import read_metrics

__all__ = ["CURVES", "collect_rows", "markdown_table", "mean_std_count", "run_row", "summarize_grid"]

# (label, key) of the per-step curves plotted; keys no finished run logged are left out.
CURVES: tuple[tuple[str, str], ...] = (
    ("training accuracy (all k trajectories)", "train/accuracy"),
    ("held-out accuracy (in-run evaluation)", "eval/accuracy"),
    ("policy entropy, mean over response tokens (nats)", "entropy/mean"),
    ("entropy p99 (nats)", "entropy/p99"),
    ("share of tokens above the high-entropy threshold", "entropy/high_frac"),
    ("clip fraction, high bound", "loss/clipfrac_high"),
    ("clip fraction, high bound, branched tokens", "loss/clipfrac_high/branch"),
    ("clip fraction, high bound, global tokens", "loss/clipfrac_high/global"),
    ("clip fraction, low bound", "loss/clipfrac_low"),
    ("top-20% entropy tokens PPO's clip zeroes, AEPO's keeps", "loss/cf/high_kept_frac"),
    ("entropy-aware adv.: gradient-mass share on top-20% H, on - off", "loss/cf/adv_high_shift"),
    ("distinct final answers per prompt", "diversity/distinct_answers"),
    ("distinct tool-call sequences per prompt", "diversity/distinct_tool_sequences"),
    ("pairwise response distance (1 - Jaccard)", "diversity/pairwise_distance"),
    ("branches per step", "rollout/branches"),
    ("branch depth (mean)", "rollout/branch_depth_mean"),
    ("branches taken by the most-branching trajectory (share)", "rollout/branch_concentration"),
    ("position of a branch in its run of consecutive branches", "rollout/branch_run_mean"),
    ("global samples m (mean over prompts)", "rollout/global_samples"),
    ("generated tokens per step", "rollout/tokens_generated"),
    ("seconds per step", "time/step_s"),
)


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


# (column label, value of a row) of the table; a column no row has a value for is left out.
Column = tuple[str, Callable[[dict[str, Any]], float | None]]
COLUMNS: tuple[Column, ...] = (
    ("held-out acc. before (%)", lambda r: _pct(r["accuracy_before"])),
    ("after (%)", lambda r: _pct(r["accuracy_after"])),
    ("gain (points)", lambda r: _pct(r["gain"])),
    ("pass@n after (%)", lambda r: _pct(r.get("pass_at_n_after"))),
    ("train acc., last 25% of steps (%)", lambda r: _pct(r["metrics_last"].get("train/accuracy"))),
    ("entropy, first 25% (nats)", lambda r: r["metrics_first"].get("entropy/mean")),
    ("entropy, last 25% (nats)", lambda r: r["metrics_last"].get("entropy/mean")),
    ("entropy p99, last 25%", lambda r: r["metrics_last"].get("entropy/p99")),
    ("high-entropy share, last 25% (%)", lambda r: _pct(r["metrics_last"].get("entropy/high_frac"))),
    ("clip high (%)", lambda r: _pct(r["metrics_mean"].get("loss/clipfrac_high"))),
    ("clip high, branched tokens (%)", lambda r: _pct(r["metrics_mean"].get("loss/clipfrac_high/branch"))),
    ("clip high, global tokens (%)", lambda r: _pct(r["metrics_mean"].get("loss/clipfrac_high/global"))),
    ("clip low (%)", lambda r: _pct(r["metrics_mean"].get("loss/clipfrac_low"))),
    ("distinct answers / prompt", lambda r: r["metrics_mean"].get("diversity/distinct_answers")),
    ("distinct tool sequences / prompt", lambda r: r["metrics_mean"].get("diversity/distinct_tool_sequences")),
    ("pairwise distance", lambda r: r["metrics_mean"].get("diversity/pairwise_distance")),
    ("branches / step", lambda r: r["metrics_mean"].get("rollout/branches")),
    ("branch depth", lambda r: r["metrics_mean"].get("rollout/branch_depth_mean")),
    ("steps with a clipped token (%)", lambda r: _pct(r.get("clip_steps"))),
    ("tokens / step", lambda r: r["tokens_per_step"]),
    ("s / step", lambda r: r["step_s"]),
    ("points per 1M tokens", lambda r: r["gain_per_mtokens"]),
    ("points per RL hour", lambda r: r["gain_per_hour"]),
)

# The mechanisms table: what each part of AEPO did, per run (means over steps).
MECHANISM_COLUMNS: tuple[Column, ...] = (
    ("optimizer steps / RL step", lambda r: r["metrics_mean"].get("loss/optimizer_steps")),
    ("steps with a clipped token (%)", lambda r: _pct(r.get("clip_steps"))),
    ("... global tokens (%)", lambda r: _pct(r.get("clip_steps/global"))),
    ("... branched tokens (%)", lambda r: _pct(r.get("clip_steps/branch"))),
    ("clip high (%)", lambda r: _pct(r["metrics_mean"].get("loss/clipfrac_high"))),
    ("top-20% H tokens PPO zeroes, AEPO keeps (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/high_kept_frac"))),
    ("... global (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/high_kept_frac/global"))),
    ("... branched (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/high_kept_frac/branch"))),
    ("their share of AEPO's top-20% grad. mass (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/high_kept_mass"))),
    ("kept tokens that are top-20% H (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/kept_high_share"))),
    ("grad. mass on top-20% H, adv. off (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/adv_high_share_off"))),
    ("... on (%)", lambda r: _pct(r["metrics_mean"].get("loss/cf/adv_high_share_on"))),
    ("mass x on top-20% H", lambda r: r["metrics_mean"].get("loss/cf/adv_high_gain")),
    ("mass x on the rest", lambda r: r["metrics_mean"].get("loss/cf/adv_low_gain")),
    ("branches / trajectory", lambda r: r["metrics_mean"].get("rollout/branches_per_traj")),
    ("branch concentration", lambda r: r["metrics_mean"].get("rollout/branch_concentration")),
    ("branch run (mean)", lambda r: r["metrics_mean"].get("rollout/branch_run_mean")),
    ("branch run (max)", lambda r: r["metrics_mean"].get("rollout/branch_run_max")),
    ("branches after a branch (%)", lambda r: _pct(r["metrics_mean"].get("rollout/consecutive_branch_share"))),
    ("penalty-decided decisions / step", lambda r: r["metrics_mean"].get("rollout/penalty_decisive")),
    ("m (mean)", lambda r: r["metrics_mean"].get("rollout/global_samples")),
    ("m min-max", lambda r: _spread(r["metrics_mean"], "rollout/m_min", "rollout/m_max")),
    ("H_root (nats)", lambda r: r["metrics_mean"].get("rollout/h_root_mean")),
    ("H_tool (nats)", lambda r: r["metrics_mean"].get("rollout/h_tool_mean")),
)


def _spread(means: dict[str, float], low: str, high: str) -> float | None:
    """``high - low`` of two per-step means (e.g. the spread of m over a step's prompts)."""
    return means[high] - means[low] if low in means and high in means else None


# ---------------------------------------------------------------------------------------------
# Rows


def _means(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean of every numeric metric over ``rows`` (metrics.jsonl rows)."""
    keys = sorted({k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))})
    out = {}
    for key in keys:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if values:
            out[key] = statistics.fmean(values)
    return out


def clip_steps(steps: Sequence[dict[str, Any]], suffix: str = "") -> float | None:
    """The share of steps whose update clipped a token (``loss/clipfrac_high<suffix>`` +
    ``loss/clipfrac_low<suffix>`` > 0); None when no step logged them (e.g. no branched token)."""
    logged = [r for r in steps if f"loss/clipfrac_high{suffix}" in r]
    if not logged:
        return None
    clipped = [r[f"loss/clipfrac_high{suffix}"] + r.get(f"loss/clipfrac_low{suffix}", 0.0) > 0 for r in logged]
    return sum(clipped) / len(logged)


def run_row(run_dir: Path, task: str, algorithm: str, seed: int) -> dict[str, Any] | None:
    """The result row of a finished run (None when ``summary.json`` is missing).

    Accuracies are fractions; ``gain`` is after - before; ``gain_per_mtokens`` and
    ``gain_per_hour`` are in accuracy points per million generated tokens and per hour of RL steps;
    ``clip_steps`` (``/global``, ``/branch``): :func:`clip_steps`.
    """
    if not (run_dir / "summary.json").exists():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    config = tomllib.loads((run_dir / "config.toml").read_text())
    metrics_path = run_dir / config["logging"]["dir"] / "metrics.jsonl"
    steps = read_metrics(metrics_path) if metrics_path.exists() else []
    quarter = max(1, len(steps) // 4)
    before, after = summary["eval_before"], summary["eval_after"]
    gain = after["accuracy"] - before["accuracy"]
    tokens = sum(r.get("rollout/tokens_generated", 0.0) for r in steps)
    rl_s = sum(r.get("time/step_s", 0.0) for r in steps)
    n = max((int(k.split("@")[1]) for k in after if k.startswith("pass@")), default=None)
    info_path = run_dir / "compare_run.json"
    attempts = json.loads(info_path.read_text())["attempts"] if info_path.exists() else []
    return {
        "task": task, "algorithm": algorithm, "seed": seed, "run_dir": str(run_dir),
        "steps": len(steps), "prompts_per_step": config["train"]["prompts_per_step"], "k": config["rollout"]["k"],
        "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"], "gain": gain,
        "pass_at_n": n, "pass_at_n_before": before.get(f"pass@{n}"), "pass_at_n_after": after.get(f"pass@{n}"),
        "eval_before": before, "eval_after": after,
        "tokens_generated": tokens, "tokens_per_step": tokens / max(len(steps), 1),
        "rl_s": rl_s, "step_s": rl_s / max(len(steps), 1),
        "gain_per_mtokens": 100 * gain / (tokens / 1e6) if tokens else None,
        "gain_per_hour": 100 * gain / (rl_s / 3600) if rl_s else None,
        "metrics_mean": _means(steps), "metrics_first": _means(steps[:quarter]), "metrics_last": _means(steps[-quarter:]),
        "clip_steps": clip_steps(steps), "clip_steps/global": clip_steps(steps, "/global"),
        "clip_steps/branch": clip_steps(steps, "/branch"),
        "wall_s": sum(a.get("wall_s", 0.0) for a in attempts) or None,
        "attempts": len(attempts),
        "loadavg_1min": _mean_or_none([x for a in attempts for x in (a["loadavg_start"][0], a["loadavg_end"][0])]),
        "commit": attempts[-1]["commit"] if attempts else None,
        "finished": attempts[-1]["finished"] if attempts else None,
    }


def _mean_or_none(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def collect_rows(out: Path, task: str, algorithms: Sequence[str], seeds: Sequence[int]) -> tuple[list[dict], list[str]]:
    """Rows of the finished runs of ``algorithms x seeds`` under ``out``, and a line per missing run."""
    rows, missing = [], []
    for algorithm in algorithms:
        for seed in seeds:
            run_dir = out / algorithm / f"seed{seed}"
            row = run_row(run_dir, task, algorithm, seed)
            if row is None:
                missing.append(f"{algorithm} seed {seed}: {_run_state(run_dir)}")
            else:
                rows.append(row)
    return rows, missing


def _run_state(run_dir: Path) -> str:
    """Why a run has no summary: not started, failed (last exit status), or the steps done."""
    if not run_dir.exists():
        return "not started"
    info = run_dir / "compare_run.json"
    if info.exists():
        last = json.loads(info.read_text())["attempts"][-1]
        if last.get("returncode") not in (None, 0):
            return f"failed (exit {last['returncode']}; see {run_dir / 'train.log'})"
    metrics = run_dir / "logs" / "metrics.jsonl"
    done = len(read_metrics(metrics)) if metrics.exists() else 0
    return f"started, {done} steps logged"


# ---------------------------------------------------------------------------------------------
# Aggregation and the table


def mean_std_count(values: Sequence[float | None]) -> tuple[float, float, int] | None:
    """(mean, sample standard deviation, n) of the non-missing values; std is nan for n = 1."""
    present = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not present:
        return None
    sd = statistics.stdev(present) if len(present) > 1 else float("nan")
    return statistics.fmean(present), sd, len(present)


def _fmt(stat: tuple[float, float, int] | None) -> str:
    if stat is None:
        return "-"
    mean, sd, _ = stat
    digits = 2 if abs(mean) < 10 else 1
    return f"{mean:.{digits}f}" if math.isnan(sd) else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]], algorithms: Sequence[str],
                   all_columns: Sequence[Column] = COLUMNS) -> str:
    """One line per algorithm with rows: ``mean ± std`` over its seeds in every column of
    ``all_columns`` that some row has a value for."""
    present = [a for a in algorithms if any(r["algorithm"] == a for r in rows)]
    columns = [(label, get) for label, get in all_columns if any(get(r) is not None for r in rows)]
    lines = ["| algorithm | seeds | " + " | ".join(label for label, _ in columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for algorithm in present:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        cells = [_fmt(mean_std_count([get(r) for r in mine])) for _, get in columns]
        seeds = ",".join(str(r["seed"]) for r in mine)
        lines.append(f"| {algorithm} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def eval_before_check(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per seed: whether every algorithm measured the same held-out accuracy before RL (it should:
    same model, same evaluation draws)."""
    lines = []
    for seed in sorted({r["seed"] for r in rows}):
        mine = [r for r in rows if r["seed"] == seed]
        values = {r["algorithm"]: r["accuracy_before"] for r in mine}
        same = len(set(values.values())) == 1
        shown = ", ".join(f"{a} {100 * v:.2f}%" for a, v in values.items())
        lines.append(f"seed {seed}: {'identical' if same else 'DIFFERENT'} across {len(mine)} runs ({shown})")
    return lines


# ---------------------------------------------------------------------------------------------
# Plots


def _smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _curves(rows: Sequence[dict[str, Any]], key: str) -> dict[str, list[list[float]]]:
    """``{algorithm: [per-seed list of per-step values]}`` of one metric (runs that logged it)."""
    out: dict[str, list[list[float]]] = {}
    for r in rows:
        run_dir = Path(r["run_dir"])
        config = tomllib.loads((run_dir / "config.toml").read_text())
        steps = read_metrics(run_dir / config["logging"]["dir"] / "metrics.jsonl")
        values = [float(s[key]) for s in steps if isinstance(s.get(key), (int, float))]
        if values:
            out.setdefault(r["algorithm"], []).append(values)
    return out


def plot_curves(rows: Sequence[dict[str, Any]], algorithms: Sequence[str], path: Path, title: str) -> Path | None:
    """Per-step curves, one panel per metric: the mean over seeds (moving average) and a +-1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(label, key, _curves(rows, key)) for label, key in CURVES]
    panels = [p for p in panels if p[2]]
    if not panels:
        return None
    ncols = 3
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.2 * nrows), squeeze=False)
    colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(algorithms)}
    for ax, (label, key, curves) in zip(axes.flat, panels):
        for algorithm in (a for a in algorithms if a in curves):
            seeds = curves[algorithm]
            length = min(len(s) for s in seeds)
            window = max(1, length // 12)
            smoothed = [_smooth(s[:length], window) for s in seeds]
            mean = [statistics.fmean(col) for col in zip(*smoothed)]
            sd = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in zip(*smoothed)]
            xs = list(range(1, length + 1))
            ax.plot(xs, mean, color=colors[algorithm], label=f"{algorithm} (n={len(seeds)})", lw=1.4)
            ax.fill_between(xs, [m - s for m, s in zip(mean, sd)], [m + s for m, s in zip(mean, sd)],
                            color=colors[algorithm], alpha=0.15)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{title}: mean over seeds (moving average), band = ±1 std over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_accuracy(rows: Sequence[dict[str, Any]], algorithms: Sequence[str], path: Path, title: str) -> Path | None:
    """Held-out accuracy before and after RL per algorithm: bars = mean, error bars = std, dots = seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [a for a in algorithms if any(r["algorithm"] == a for r in rows)]
    if not present:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(present) + 2), 3.6))
    for offset, key, color in ((-0.2, "accuracy_before", "#999999"), (0.2, "accuracy_after", "#1f77b4")):
        for i, algorithm in enumerate(present):
            values = [100 * r[key] for r in rows if r["algorithm"] == algorithm]
            mean, sd, _ = mean_std_count(values)
            ax.bar(i + offset, mean, width=0.38, color=color, yerr=0 if math.isnan(sd) else sd, capsize=3,
                   label=key.replace("accuracy_", "held-out, ").replace("_", " ") if i == 0 else None)
            ax.scatter([i + offset] * len(values), values, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(present)), present, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"{title}: held-out accuracy before / after RL\n(bars = mean, error bars = std, dots = seeds)",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_premonitoring(rows: Sequence[dict[str, Any]], algorithms: Sequence[str], path: Path,
                       title: str) -> Path | None:
    """The global budget m against the pre-monitoring entropies: one dot per RL step of each run that
    pre-monitored (x: the step's mean H_root - mean H_tool, y: its mean m, bars: the step's min-max
    of m), and the rule m = floor(k sigmoid(beta (H_root - H_tool))) + 1 of spec 1a as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from aepo_engine.algorithms.branching import global_sample_count

    points: dict[str, list[tuple[float, float, float, float]]] = {}
    rule = None
    for r in rows:
        run_dir = Path(r["run_dir"])
        config = tomllib.loads((run_dir / "config.toml").read_text())
        for s in read_metrics(run_dir / config["logging"]["dir"] / "metrics.jsonl"):
            if "rollout/h_root_mean" in s and "rollout/h_tool_mean" in s:
                rule = (config["rollout"]["k"], config["rollout"]["beta"])
                points.setdefault(r["algorithm"], []).append((
                    s["rollout/h_root_mean"] - s["rollout/h_tool_mean"], s["rollout/global_samples"],
                    s["rollout/m_min"], s["rollout/m_max"]))
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.8))
    colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(algorithms)}
    for algorithm in (a for a in algorithms if a in points):
        gap, m, low, high = zip(*points[algorithm])
        ax.errorbar(gap, m, yerr=[[a - b for a, b in zip(m, low)], [b - a for a, b in zip(m, high)]], fmt="o",
                    ms=2.5, lw=0.5, alpha=0.5, color=colors[algorithm], label=f"{algorithm} ({len(gap)} steps)")
    k, beta = rule
    xs = [min(p[0] for v in points.values() for p in v), max(p[0] for v in points.values() for p in v)]
    grid = [xs[0] + (xs[1] - xs[0]) * i / 200 for i in range(201)]
    ax.plot(grid, [global_sample_count(k, beta, g, 0.0) for g in grid], color="black", lw=1,
            label=f"rule (k={k}, beta={beta}) at the step's mean gap")
    ax.set_xlabel("mean H_root - mean H_tool over the step's prompts (nats)")
    ax.set_ylabel("global samples m (mean; bars: min-max)")
    ax.set_title(f"{title}: pre-monitoring's global budget per RL step", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The whole summary


def summarize_grid(out: Path, results_dir: Path) -> str:
    """Rebuild rows, table and plots of the grid under ``out`` (its ``grid.json`` names the task,
    algorithms and seeds); returns the Markdown report (also written to the results folder)."""
    grid = read_grid_file(out)
    if grid is None:
        raise FileNotFoundError(f"{out / 'grid.json'} not found: is {out} a grid started by the compare command?")
    task = grid["task_presets"][-1]
    rows, missing = collect_rows(out, task, grid["algorithms"], grid["seeds"])
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_dir / f"compare_{task}"
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plots = [plot_accuracy(rows, grid["algorithms"], Path(f"{stem}_accuracy.png"), task),
             plot_curves(rows, grid["algorithms"], Path(f"{stem}_curves.png"), task),
             plot_premonitoring(rows, grid["algorithms"], Path(f"{stem}_premonitoring.png"), task)] if rows else []
    report = _report(grid, rows, missing, [p for p in plots if p])
    stem.with_suffix(".md").write_text(report)
    return report


def _report(grid: dict[str, Any], rows: list[dict], missing: list[str], plots: list[Path]) -> str:
    task = grid["task_presets"][-1]
    budget = " ".join(grid["overrides"]) or "(the presets' own)"
    lines = [f"# Algorithm comparison on `{task}`", "",
             f"Task presets: {', '.join(grid['task_presets'])}; budget overrides for every run: `{budget}`.",
             f"Finished runs: {len(rows)} of {len(grid['algorithms']) * len(grid['seeds'])}; "
             "cells are mean ± sample std over the seeds listed.", ""]
    if rows:
        r = rows[0]
        commits = sorted({x["commit"] for x in rows if x["commit"]})
        loads = [x["loadavg_1min"] for x in rows if x["loadavg_1min"] is not None]
        load = f"; 1-minute load average during the runs {min(loads):.1f}-{max(loads):.1f}" if loads else ""
        lines += [f"Each run: {r['steps']} RL steps x {r['prompts_per_step']} prompts x k={r['k']} trajectories; "
                  f"pass@n with n = {r['pass_at_n']}. Code: {', '.join(commits) or 'unknown'}{load}.", "",
                  markdown_table(rows, grid["algorithms"]), "",
                  "Mechanisms (per-step means; `training.counterfactual`, `rollout.measures`; top-20% H = "
                  "the step's 20% highest-entropy tokens):", "",
                  markdown_table(rows, grid["algorithms"], MECHANISM_COLUMNS), "",
                  "Held-out accuracy before RL per seed (must be identical across algorithms):", ""]
        lines += [f"- {line}" for line in eval_before_check(rows)]
        lines += ["", "Plots: " + ", ".join(p.name for p in plots), ""]
    lines += ["Missing runs:" if missing else "No run missing.", ""] + [f"- {m}" for m in missing]
    return "\n".join(lines) + "\n"
