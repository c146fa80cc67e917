"""``python -m aepo_engine.experiments.trees RUN_DIR [--step N] [--out trees.html] [--png trees.png]``:
one training step's rollout trees, drawn from the run's sample dumps.

Reads ``RUN_DIR/<logging.dir>/samples/step_NNNNNN.jsonl`` (format 2, :mod:`aepo_engine.rollout.samples`;
the whole trees of the step's first ``logging.sample_trees`` prompts) and writes a self-contained
HTML file (inline SVG, no scripts, no external files) and optionally a PNG (matplotlib).

How a tree reads: one lane (row) per trajectory, parents above their branches. Columns are tool
steps: the circle in column j is the trajectory's model segment that follows tool result j
(column 0: the first segment, from the prompt), coloured by its head entropy (mean entropy of its
first n_e tokens: H_init in column 0, H_now after a tool result). Under a circle that reacts to a
tool result: the branch probability P of the decision taken there and the base probability alpha
drawn for it; a thick ring marks a decision that branched, a dashed ring one that wanted to
(P > tau) but found the prompt's budget spent. Small squares between columns are tool results
(hover: the call). A branch leaves its parent's lane at the tool result it copied its prefix up
to, and starts its own segment in the next column. The box at the end of a lane is the leaf:
its reward (green: correct) and why it ended; hover shows the final answer and the response.

Left out: interactive zoom/filtering (the HTML is static); token-level detail inside segments.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from aepo_engine.config_loader import ConfigError, read_config_file
from aepo_engine.errors import ArgumentParser, entry_point
from aepo_engine.rollout.samples import SampleDumpError, read_sample_rows, sample_path

PROG = "python -m aepo_engine.experiments.trees"

# ---------------------------------------------------------------------------------------------
# Layout (shared by the SVG and the PNG)


@dataclass
class Node:
    """A model segment of one lane: column ``col`` (= tool results before it)."""

    col: int
    head_entropy: float
    decision: dict[str, Any] | None  # the branch decision taken after it, if any
    call: dict[str, Any] | None      # the executed tool call it made, if any


@dataclass
class Lane:
    """One trajectory drawn as a row ``y`` from column ``start`` to its leaf."""

    row: dict[str, Any]
    y: int
    start: int
    nodes: list[Node]
    parent_y: int | None = None  # the parent's lane (a branch whose parent is in the tree)

    @property
    def end(self) -> int:
        return self.nodes[-1].col if self.nodes else self.start


@dataclass
class Tree:
    """The laid-out rollout tree of one prompt."""

    prompt_index: int
    step: int
    prompt: str
    lanes: list[Lane] = field(default_factory=list)

    @property
    def columns(self) -> int:
        return max((lane.end for lane in self.lanes), default=0) + 1


def build_trees(rows: Sequence[dict[str, Any]]) -> list[Tree]:
    """The whole trees of a format-2 dump, one per prompt, lanes in depth-first order.

    Raises:
        SampleDumpError: no whole tree in the rows, or a tree with fewer rows than its group size.
    """
    prompts: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("whole_tree"):
            prompts.setdefault(row["prompt_index"], []).append(row)
    if not prompts:
        raise SampleDumpError("the dump holds no whole rollout tree (trained with logging.sample_trees = 0?): "
                              "only single sampled trajectories")
    trees = []
    for index in sorted(prompts):
        members = sorted(prompts[index], key=lambda r: r["traj_id"])
        if len(members) != members[0]["group_size"]:
            raise SampleDumpError(f"prompt {index}: {len(members)} of {members[0]['group_size']} trajectories "
                                  "in the dump; the tree is incomplete")
        trees.append(_lay_out(index, members))
    return trees


def _lay_out(index: int, members: list[dict[str, Any]]) -> Tree:
    ids = {r["traj_id"] for r in members}
    children: dict[int | None, list[dict[str, Any]]] = {}
    for row in members:
        parent = row["parent_id"] if row["parent_id"] in ids else None
        children.setdefault(parent, []).append(row)
    tree = Tree(index, members[0].get("step", 0), members[0].get("prompt", ""))

    def visit(row: dict[str, Any], parent_y: int | None) -> None:
        lane = _lane(row, len(tree.lanes), parent_y)
        tree.lanes.append(lane)
        for child in sorted(children.get(row["traj_id"], []), key=lambda r: (r["branch_tool_step"], r["traj_id"])):
            visit(child, lane.y)

    for root in children.get(None, []):
        visit(root, None)
    return tree


def _lane(row: dict[str, Any], y: int, parent_y: int | None) -> Lane:
    start = (row["branch_tool_step"] or 0) if row["kind"] == "branch" else 0
    decisions = {d["tool_step"]: d for d in row["decisions"]}
    calls = row.get("tool_log", [])
    nodes = [Node(col, float(h), decisions.get(col), calls[col] if col < len(calls) else None)
             for col, h in enumerate(row["head_entropies"]) if col >= start]
    return Lane(row, y, start, nodes, parent_y if row["kind"] == "branch" else None)


# ---------------------------------------------------------------------------------------------
# Colours: head entropy on a blue -> yellow -> red scale over [0, h_max]


_STOPS = ((0.0, (49, 54, 149)), (0.5, (254, 224, 144)), (1.0, (165, 0, 38)))


def entropy_colour(h: float, h_max: float) -> str:
    """``#rrggbb`` of entropy ``h`` on the scale [0, h_max]."""
    x = min(max(h / h_max, 0.0), 1.0) if h_max > 0 else 0.0
    for (x0, c0), (x1, c1) in zip(_STOPS, _STOPS[1:]):
        if x <= x1:
            t = (x - x0) / (x1 - x0)
            return "#" + "".join(f"{round(a + t * (b - a)):02x}" for a, b in zip(c0, c1))
    return "#%02x%02x%02x" % _STOPS[-1][1]


def entropy_scale(trees: Sequence[Tree]) -> float:
    """The top of the colour scale: the largest head entropy drawn (at least 1e-6)."""
    return max([n.head_entropy for t in trees for lane in t.lanes for n in lane.nodes] + [1e-6])


# ---------------------------------------------------------------------------------------------
# SVG / HTML

COL, LANE, LEFT, TOP, LEAF_W = 150, 46, 130, 28, 118


def _x(col: float) -> float:
    return LEFT + COL * col


def _y(lane: int) -> float:
    return TOP + LANE * lane + LANE / 2


def _lane_label(lane: Lane) -> str:
    row = lane.row
    return f"t{row['traj_id']} {row['kind']}" + (f" ← t{row['parent_id']}" if row["kind"] == "branch" else "")


def _leaf_text(row: dict[str, Any]) -> str:
    """``r=<reward> · <finish reason>``."""
    finish = row.get("finish_reason")
    return f"r={row['reward']:.2f}" + (f" · {finish}" if finish else "")


def _leaf_colour(row: dict[str, Any]) -> str:
    """Green: correct; orange: a positive reward that is not correct; grey: the rest."""
    return "#2ca02c" if row.get("correct") else "#ffbb78" if row["reward"] > 0 else "#d9d9d9"


def _hover(row: dict[str, Any]) -> str:
    response = row.get("response", "")
    response = response if len(response) <= 1500 else response[:1500] + " …"
    return (f"t{row['traj_id']} ({row['kind']}), reward {row['reward']:.3f}, correct {row.get('correct')}, "
            f"answer {row.get('answer')!r}, finish {row.get('finish_reason')}\n\n{response}")


def render_svg(tree: Tree, h_max: float, tau: float | None = None) -> str:
    """One tree as an ``<svg>`` element (see the module docstring for how it reads)."""
    width = _x(tree.columns - 1) + COL / 2 + LEAF_W + 20
    height = TOP + LANE * len(tree.lanes) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="sans-serif" font-size="10">']
    for col in range(tree.columns):  # column heads
        label = "from prompt" if col == 0 else f"after tool {col}"
        out.append(f'<text x="{_x(col):.0f}" y="14" text-anchor="middle" fill="#555">{label}</text>')
    for lane in tree.lanes:
        out += _svg_lane(lane, h_max, tau)
    out.append("</svg>")
    return "\n".join(out)


def _svg_lane(lane: Lane, h_max: float, tau: float | None) -> list[str]:
    y, row = _y(lane.y), lane.row
    first = _x(lane.start)
    leaf_x = _x(lane.end) + COL / 2
    out = [f'<text x="6" y="{y + 3:.0f}" fill="#222">{html.escape(_lane_label(lane))}</text>']
    if lane.parent_y is not None:  # from the parent's copy of tool result `start` to this lane
        px, py = _x(lane.start) - COL / 2, _y(lane.parent_y)
        out.append(f'<path d="M{px:.0f},{py:.0f} C{px:.0f},{y:.0f} {px:.0f},{y:.0f} {first - 14:.0f},{y:.0f}" '
                   f'fill="none" stroke="#888" stroke-width="1.5"/>')
    out.append(f'<line x1="{first:.0f}" y1="{y:.0f}" x2="{leaf_x:.0f}" y2="{y:.0f}" stroke="#bbb" stroke-width="2"/>')
    for node in lane.nodes:
        cx = _x(node.col)
        if node.call is not None:  # its tool call, answered between this column and the next
            call = node.call
            tip = html.escape(f"{call['tool']}: {call['payload']} ({'ok' if call['ok'] else 'failed'})")
            out.append(f'<rect x="{cx + COL / 2 - 5:.0f}" y="{y - 5:.0f}" width="10" height="10" '
                       f'fill="{"#8c8c8c" if call["ok"] else "#d62728"}"><title>{tip}</title></rect>')
        out += _svg_node(node, cx, y, h_max, tau)
    out.append(f'<g><title>{html.escape(_hover(row))}</title>'
               f'<rect x="{leaf_x + 6:.0f}" y="{y - 13:.0f}" width="{LEAF_W:.0f}" height="26" rx="4" '
               f'fill="{_leaf_colour(row)}"/>'
               f'<text x="{leaf_x + 12:.0f}" y="{y + 4:.0f}">{html.escape(_leaf_text(row))}</text></g>')
    return out


def _svg_node(node: Node, cx: float, y: float, h_max: float, tau: float | None) -> list[str]:
    d = node.decision
    tip = f"head entropy {node.head_entropy:.4f}"
    ring = ""
    if d is not None:
        tip += (f"\nP = {d['probability']:.4f} (alpha {d['alpha']:.3f}, H_now - H_init "
                f"{d['h_now'] - d['h_init']:+.4f}, l {d['consecutive_branches']})"
                + (f", tau {tau}" if tau is not None else "")
                + ("\nbranched" if d["branched"] else "\nbudget spent: no branch" if d["budget_blocked"] else ""))
        if d["branched"]:
            ring = ' stroke="#000" stroke-width="3"'
        elif d["budget_blocked"]:
            ring = ' stroke="#000" stroke-width="1.5" stroke-dasharray="3,2"'
    out = [f'<g><title>{html.escape(tip)}</title>'
           f'<circle cx="{cx:.0f}" cy="{y:.0f}" r="9" fill="{entropy_colour(node.head_entropy, h_max)}"{ring}/>'
           f'<text x="{cx:.0f}" y="{y - 12:.0f}" text-anchor="middle">H {node.head_entropy:.2f}</text>']
    if d is not None:
        mark = " ✓" if d["branched"] else ""
        out.append(f'<text x="{cx:.0f}" y="{y + 20:.0f}" text-anchor="middle" fill="#333">'
                   f'P {d["probability"]:.2f} α {d["alpha"]:.2f}{mark}</text>')
    out.append("</g>")
    return out


def _summary(tree: Tree) -> str:
    rows = [lane.row for lane in tree.lanes]
    kinds = {k: sum(r["kind"] == k for r in rows) for k in ("probe", "global", "branch")}
    decisions = [d for r in rows for d in r["decisions"]]
    mean_reward = sum(r["reward"] for r in rows) / len(rows)
    return (f"{len(rows)} trajectories ({kinds['probe']} probe, {kinds['global']} global, {kinds['branch']} branch), "
            f"{len(decisions)} branch decisions, {sum(d['branched'] for d in decisions)} branched; "
            f"mean reward {mean_reward:.3f}, {sum(bool(r.get('correct')) for r in rows)} correct")


def render_html(trees: Sequence[Tree], title: str, tau: float | None = None) -> str:
    """A self-contained HTML page: a legend and one SVG per tree."""
    h_max = entropy_scale(trees)
    scale = "".join(f'<span style="background:{entropy_colour(h_max * i / 8, h_max)};padding:0 9px"></span>'
                    for i in range(9))
    parts = [
        "<!DOCTYPE html>", '<html><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:16px;color:#222} .tree{margin:18px 0 28px}"
        " .prompt{font-family:monospace;font-size:11px;white-space:pre-wrap;color:#555;max-height:6em;"
        "overflow:auto;border-left:3px solid #ddd;padding-left:6px}</style></head><body>",
        f"<h2>{html.escape(title)}</h2>",
        f"<p>Head entropy (nats): 0 {scale} {h_max:.2f}. Circle: a model segment (column j: after tool "
        "result j); P: branch probability of the decision taken there, α: its drawn base probability; "
        "thick ring: branched (✓), dashed ring: P &gt; τ but no budget left"
        + (f" (τ = {tau})" if tau is not None else "")
        + ". Square: a tool result (hover: the call). Box: the leaf's reward (green: correct) and finish "
        "reason; hover for the answer and the response.</p>",
    ]
    for tree in trees:
        parts += [f'<div class="tree"><h3>prompt {tree.prompt_index}</h3>',
                  f"<p>{html.escape(_summary(tree))}</p>",
                  f'<div class="prompt">{html.escape(_tail(tree.prompt, 600))}</div>',
                  render_svg(tree, h_max, tau), "</div>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def _tail(text: str, n: int) -> str:
    """The last n characters (a chat prompt's question sits at its end)."""
    return text if len(text) <= n else "… " + text[-n:]


# ---------------------------------------------------------------------------------------------
# PNG (matplotlib)


def render_png(trees: Sequence[Tree], path: str | Path, title: str) -> Path:
    """The same drawing as the SVG, one panel per tree, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h_max = entropy_scale(trees)
    columns = max(t.columns for t in trees)
    heights = [max(len(t.lanes), 1) + 1 for t in trees]
    fig, axes = plt.subplots(len(trees) + 1, 1, figsize=(max(8.0, 2.0 + 2.1 * columns), 0.45 * sum(heights) + 1.6),
                             height_ratios=[*heights, 0.35], layout="constrained")
    for ax, tree in zip(axes[:-1], trees):
        _png_tree(ax, tree, h_max, columns)
    cmap = matplotlib.colors.LinearSegmentedColormap.from_list("head_entropy", [entropy_colour(x * h_max, h_max)
                                                                               for x, _ in _STOPS])
    mappable = matplotlib.cm.ScalarMappable(matplotlib.colors.Normalize(0, h_max), cmap)
    bar = fig.colorbar(mappable, cax=axes[-1], orientation="horizontal")
    bar.set_label("head entropy (nats).  Thick ring: branched; dashed ring: P > tau but no budget; P: branch "
                  "probability, α: its drawn base; square: tool result", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _png_tree(ax, tree: Tree, h_max: float, columns: int) -> None:
    for lane in tree.lanes:
        y, row = -lane.y, lane.row
        if lane.parent_y is not None:
            ax.plot([lane.start - 0.5, lane.start - 0.5, lane.start - 0.1], [-lane.parent_y, y, y], color="#888", lw=1.2)
        ax.plot([lane.start, lane.end + 0.5], [y, y], color="#bbb", lw=2, zorder=1)
        ax.text(-0.45, y, _lane_label(lane), ha="right", va="center", fontsize=7)
        for node in lane.nodes:
            d = node.decision
            width = 2.5 if d and d["branched"] else 1.0 if d and d["budget_blocked"] else 0.0
            ax.scatter([node.col], [y], s=110, color=entropy_colour(node.head_entropy, h_max), edgecolors="black",
                       linewidths=width, linestyles="--" if d and d["budget_blocked"] else "-", zorder=3)
            ax.text(node.col, y + 0.28, f"H {node.head_entropy:.2f}", ha="center", fontsize=6)
            if d is not None:
                ax.text(node.col, y - 0.42, f"P {d['probability']:.2f} α {d['alpha']:.2f}"
                        + (" ✓" if d["branched"] else ""), ha="center", fontsize=6)
            if node.call is not None:
                ax.scatter([node.col + 0.5], [y], marker="s", s=22, zorder=3,
                           color="#8c8c8c" if node.call["ok"] else "#d62728")
        ax.text(lane.end + 0.58, y, _leaf_text(row), va="center", fontsize=7,
                bbox=dict(boxstyle="round,pad=0.25", fc=_leaf_colour(row), ec="none"))
    ax.set_xlim(-1.6, columns + 0.6)
    ax.set_ylim(-len(tree.lanes) + 0.3, 0.8)
    ax.set_xticks(range(columns), ["from prompt"] + [f"after tool {c}" for c in range(1, columns)], fontsize=7)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"prompt {tree.prompt_index}: {_summary(tree).replace('; ', chr(10))}", fontsize=8, loc="left")


# ---------------------------------------------------------------------------------------------
# The command


def samples_dir(run_dir: Path) -> Path:
    """The samples folder of a run (``<logging.dir>/samples``, logging.dir from config.toml), or
    ``run_dir`` itself when it already is one."""
    if run_dir.is_dir() and any(run_dir.glob("step_*.jsonl")):
        return run_dir
    logs = _run_config(run_dir).get("logging", {}).get("dir", "logs")
    return run_dir / logs / "samples"


def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config.toml as a raw dict; {} without one (a bare samples folder)."""
    path = run_dir / "config.toml"
    try:
        return read_config_file(path) if path.is_file() else {}
    except ConfigError:
        return {}  # only the display of tau and logging.dir depend on it


def dumped_steps(folder: Path) -> list[int]:
    """Steps with a dump in ``folder`` (sorted)."""
    return sorted(int(m.group(1)) for p in folder.glob("step_*.jsonl") if (m := re.fullmatch(r"step_(\d+)\.jsonl", p.name)))


@entry_point
def main(argv: list[str]) -> int:
    """The command; bad input ends with one ``error:`` line and status 2 (:mod:`aepo_engine.errors`)."""
    parser = ArgumentParser(prog=PROG, description="Draw one step's rollout trees from a run's sample dumps.")
    parser.add_argument("run_dir", type=Path, help="a run folder (or its logs/samples folder)")
    parser.add_argument("--step", type=int, default=None, help="training step (0-based); default: the last dumped")
    parser.add_argument("--out", type=Path, default=Path("trees.html"), help="HTML file to write")
    parser.add_argument("--png", type=Path, default=None, help="also write a PNG (matplotlib)")
    parser.add_argument("--prompts", type=str, default=None, help="comma-separated prompt indices to draw (default all)")
    args = parser.parse_args(argv)
    written = render_step(args.run_dir, args.step, args.out, args.png, _prompt_list(args.prompts))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _prompt_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompts {text!r}: expected comma-separated integers, e.g. 0,3") from None


def render_step(run_dir: Path, step: int | None, out: Path, png: Path | None = None,
                prompts: list[int] | None = None) -> list[Path]:
    """Render one step's trees to ``out`` (HTML) and ``png``; returns the files written.

    Raises:
        FileNotFoundError: no run folder or no dumps in it; SampleDumpError: the step's dump is
        missing (the dumped steps are listed), old-format, or holds no whole tree; ValueError:
        ``prompts`` names prompts without a whole tree.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run folder at {run_dir}")
    folder = samples_dir(run_dir)
    steps = dumped_steps(folder) if folder.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"no sample dumps (step_*.jsonl) in {folder}")
    step = steps[-1] if step is None else step
    if step not in steps:
        shown = ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "")
        raise SampleDumpError(f"no dump for step {step} in {folder}; dumped steps: {shown}")
    trees = build_trees(read_sample_rows(sample_path(folder, step), trees=True))
    if prompts is not None:
        have = {t.prompt_index for t in trees}
        if not set(prompts) <= have:
            raise ValueError(f"prompts {sorted(set(prompts) - have)} have no whole tree in step {step}; "
                             f"these do: {sorted(have)}")
        trees = [t for t in trees if t.prompt_index in prompts]
    tau = _run_config(run_dir).get("rollout", {}).get("tau")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"rollout trees of {run_dir.name}, step {step} (rendered {stamp})"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(trees, title, tau))
    written = [out]
    if png is not None:
        png.parent.mkdir(parents=True, exist_ok=True)
        written.append(render_png(trees, png, f"rollout trees of {run_dir.name}, step {step}"))
    return written


if __name__ == "__main__":
    raise SystemExit(main())
