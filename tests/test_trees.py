"""The rollout-tree renderer (aepo_engine.experiments.trees): hand-made dumps with known branching,
clear errors on missing / old / partial dumps, and a real short training run's dumps."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from aepo_engine.experiments.trees import build_trees, entropy_colour, main, render_html, render_svg
from aepo_engine.rollout.samples import SampleDumpError, sample_rows
from aepo_engine.rollout.trajectory import BranchDecision, ToolCallRecord, Trajectory

SVG = "{http://www.w3.org/2000/svg}"


class SpaceTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def model(t: Trajectory, ids, h):
    t.append_model_segment(ids, [-0.5] * len(ids), [h] * len(ids), 2)


def tool(t: Trajectory, payload, ok=True):
    t.tool_log.append(ToolCallRecord("search", payload, "res", ok, 0.0))
    t.append_tool_result([9, 9])
    t.tool_calls += 1


def decide(t: Trajectory, tool_step, p, branched, blocked=False):
    t.decisions.append(BranchDecision(tool_step, t.h_init, t.segment_entropies[tool_step], 0.25, 0, p, branched, blocked))


def hand_tree():
    """Prompt 0 (k = 4): t0 global -> tool -> (branches: t2 at tool 1) -> tool -> (t3 branches off t2
    at tool 2); t1 global without tools. Prompt 1 (k = 2): two globals, only t0 dumped (not whole)."""
    t0 = Trajectory([1, 2], 0, 0, 5, "global")
    model(t0, [10, 11], 0.5)
    tool(t0, "who")
    model(t0, [12], 1.5)
    decide(t0, 1, 0.7, True)
    t2 = t0.fork(2, 2)
    tool(t0, "where")
    model(t0, [13], 0.2)
    decide(t0, 2, 0.1, False)
    model(t2, [14], 2.0)  # t2's own reaction to tool result 1
    decide(t2, 1, 0.9, False, blocked=True)
    tool(t2, "what", ok=False)
    model(t2, [15], 1.0)
    decide(t2, 2, 0.6, True)
    t3 = t2.fork(4, 3)
    model(t3, [16], 0.8)
    t1 = Trajectory([1, 2], 0, 1, 5, "global")
    model(t1, [17], 0.4)
    p1 = [Trajectory([3], 1, i, 5, "global") for i in range(2)]
    for t in p1:
        model(t, [20], 0.3)
    trajs = [t0, t1, t2, t3, *p1]
    return sample_rows(trajs, [1.0, 0.0, 0.5, -1.0, 0.0, 0.0], [True, False, False, False, False, False],
                       ["x", None, "y", None, None, None], SpaceTokenizer(), count=5, trees=1)


def test_layout_by_hand():
    (tree,) = build_trees(hand_tree())  # prompt 1 is not a whole tree: left out
    assert [lane.row["traj_id"] for lane in tree.lanes] == [0, 2, 3, 1]  # depth first
    t0, t2, t3, t1 = tree.lanes
    assert [n.col for n in t0.nodes] == [0, 1, 2] and t0.parent_y is None
    assert (t2.start, [n.col for n in t2.nodes], t2.parent_y) == (1, [1, 2], 0)
    assert (t3.start, [n.col for n in t3.nodes], t3.parent_y) == (2, [2], 1)
    assert [n.head_entropy for n in t2.nodes] == pytest.approx([2.0, 1.0])
    assert t0.nodes[1].decision["branched"] and t2.nodes[0].decision["budget_blocked"]
    assert [n.call and n.call["payload"] for n in t0.nodes] == ["who", "where", None]
    assert tree.columns == 3 and tree.step == 5


def test_svg_draws_every_node_decision_and_leaf():
    rows = hand_tree()
    trees = build_trees(rows)
    svg = ET.fromstring(render_svg(trees[0], h_max=2.0, tau=0.5))
    circles = svg.findall(f".//{SVG}circle")
    assert len(circles) == 3 + 2 + 1 + 1  # own segments of t0, t2, t3, t1
    rings = [c.get("stroke-width") for c in circles]
    assert rings.count("3") == 2  # t0 at tool 1, t2 at tool 2 branched
    assert sum(c.get("stroke-dasharray") is not None for c in circles) == 1  # t2's blocked decision
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert "P 0.70 α 0.25 ✓" in texts and "P 0.90 α 0.25" in texts and "H 2.00" in texts
    assert sorted(t for t in texts if t.startswith("r=")) == ["r=-1.00", "r=0.00", "r=0.50", "r=1.00"]
    assert len(svg.findall(f".//{SVG}path")) == 2  # two branch connectors
    squares = svg.findall(f".//{SVG}rect[@width='10']")
    assert len(squares) == 3 and sum(s.get("fill") == "#d62728" for s in squares) == 1  # t2's failed call
    # colours: the scale ends, and the hottest node is the darkest red
    assert entropy_colour(0.0, 2.0) == "#313695" and entropy_colour(2.0, 2.0) == "#a50026"
    assert circles[3].get("fill") == "#a50026"  # t2's first segment, H = 2.0
    page = render_html(trees, "hand <made>", tau=0.5)
    assert page.startswith("<!DOCTYPE html>") and "hand &lt;made&gt;" in page
    assert not re.search(r"<script|src=|href=", page)  # self-contained


def write_dump(folder: Path, step: int, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_command_writes_html_and_png(tmp_path, capsys):
    run = tmp_path / "run"
    write_dump(run / "logs" / "samples", 3, hand_tree())
    (run / "config.toml").write_text("[rollout]\ntau = 0.5\n")
    out, png = tmp_path / "o" / "trees.html", tmp_path / "o" / "trees.png"
    assert main([str(run), "--out", str(out), "--png", str(png)]) == 0  # the last step by default
    assert "τ = 0.5" in out.read_text() and "step 3" in out.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(run / "logs" / "samples"), "--step", "3", "--out", str(out), "--prompts", "0"]) == 0


@pytest.mark.parametrize("case, message", [
    ("no_run", "no run folder"),
    ("no_dumps", "no sample dumps"),
    ("wrong_step", "no dump for step 7 in .*dumped steps: 3"),
    ("old_format", "format-1 dump"),
    ("no_trees", "no whole rollout tree"),
    ("partial", "prompt 0: 3 of 4 trajectories"),
    ("bad_prompt", r"prompts \[5\] have no whole tree"),
])
def test_command_errors_are_clear(tmp_path, capsys, case, message):
    run, rows, args = tmp_path / "run", hand_tree(), []
    samples = run / "logs" / "samples"
    if case == "no_run":
        run = tmp_path / "nowhere"
    elif case == "no_dumps":
        samples.mkdir(parents=True)
    elif case == "old_format":
        write_dump(samples, 3, [{k: r[k] for k in ("prompt_index", "traj_id", "kind", "parent_id", "reward")}
                                for r in rows])
    elif case == "no_trees":
        write_dump(samples, 3, [dict(r, whole_tree=False) for r in rows])
    elif case == "partial":
        write_dump(samples, 3, [r for r in rows if r["traj_id"] != 3 or r["prompt_index"] != 0])
    else:
        write_dump(samples, 3, rows)
        args = ["--step", "7"] if case == "wrong_step" else ["--prompts", "0,5"]
    with pytest.raises(SystemExit) as info:
        main([str(run), "--out", str(tmp_path / "t.html"), *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(message, err) and "Traceback" not in err
    assert not (tmp_path / "t.html").exists()


# --- a real short run ------------------------------------------------------------------------------

@pytest.mark.sandbox
@pytest.mark.slow
def test_real_run_logs_the_measurements_and_its_trees_render(tiny_run, tmp_path):
    """The shared tiny run (tests/conftest.py, k = 2): every step logs the comparison's
    measurements, dumps one whole tree (k rows) plus nothing else, and renders."""
    from aepo_engine.metrics import read_metrics

    run = tiny_run
    rows = read_metrics(run / "logs" / "metrics.jsonl")
    keys = ("diversity/distinct_answers", "diversity/distinct_tool_sequences", "diversity/pairwise_distance",
            "entropy/mean", "entropy/p90", "entropy/p99", "entropy/high_frac", "rollout/tree_depth_mean",
            "rollout/tree_depth_max", "rollout/branch_depth_mean", "loss/tokens/branch", "loss/tokens/global",
            "loss/clipfrac_high/global", "loss/clipfrac_low/global")
    for row in rows:
        assert all(k in row for k in keys), [k for k in keys if k not in row]
        assert 0 <= row["diversity/pairwise_distance"] <= 1 and 1 <= row["diversity/distinct_tool_sequences"] <= 2
        assert row["entropy/mean"] <= row["entropy/p99"] + 1e-9 and row["entropy/p90"] <= row["entropy/p99"]
        assert row["loss/tokens/global"] + row["loss/tokens/branch"] <= row["loss/tokens"]
        assert ("loss/clipfrac_high/branch" in row) == (row["loss/tokens/branch"] > 0)
    assert (run / "plots" / "diversity.png").is_file()
    dump = [json.loads(line) for line in (run / "logs" / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["traj_id"], r["whole_tree"]) for r in dump] == [(0, i, True) for i in range(2)]
    out = tmp_path / "trees.html"
    assert main([str(run), "--step", "1", "--out", str(out), "--png", str(tmp_path / "trees.png")]) == 0
    svg = re.search(r"<svg.*?</svg>", out.read_text(), re.S).group(0)
    assert len(ET.fromstring(svg).findall(f".//{SVG}circle")) == sum(
        len(r["head_entropies"]) - (r["branch_tool_step"] or 0) for r in dump)
