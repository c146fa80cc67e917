"""The algorithm-comparison grid: planning and its refusals, the aggregation (hand-worked numbers),
and a one-seed, two-algorithm smoke grid through the real trainer: rows, table and plots are
written, the set-up is built once and shared, a finished run is skipped, a run without its
summary resumes, a different budget in the same folder is refused, missing runs are listed."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aepo_engine.config_loader import ConfigError
from aepo_engine.experiments.grid import (ALGORITHMS, DEFAULT_ORDER, RunSpec, check_grid, eval_before_shareable,
                                          parse_order, plan_runs, resolve)
from aepo_engine.experiments.results import (MECHANISM_COLUMNS, clip_steps, eval_before_check, markdown_table,
                                             mean_std_count)
from runs import child_env

# The grid on the tiny preset (tests/runs.py): task presets embedded + tiny, 2 steps, no checkpoints.
TASK = ["embedded", "tiny"]
TINY = ["--train.steps=2", "--eval.samples=2", "--checkpoint.every_n_steps=0", "--logging.plots_at_end=false"]


# --- planning ------------------------------------------------------------------------------------

def test_default_order_names_every_algorithm_once():
    names = [a for group in parse_order(DEFAULT_ORDER) for a in group]
    assert sorted(names) == sorted(ALGORITHMS)
    with pytest.raises(ConfigError, match="unknown algorithm"):
        parse_order(["grpo,aepo_without_anything"])
    with pytest.raises(ConfigError, match="twice"):
        parse_order(["grpo,aepo", "grpo"])


def test_plan_runs_seed_major_inside_a_group(tmp_path):
    specs = plan_runs(tmp_path, ["embedded"], [["grpo", "aepo"], ["arpo"]], [0, 1], ["--train.steps=3"])
    assert [s.name for s in specs] == ["grpo/seed0", "aepo/seed0", "grpo/seed1", "aepo/seed1", "arpo/seed0", "arpo/seed1"]
    cfg = resolve(specs[1])
    assert (cfg.seed, cfg.train.steps, cfg.run_dir) == (0, 3, str(tmp_path / "aepo" / "seed0"))
    assert cfg.policy.loss.clip == "aepo" and resolve(specs[0]).policy.loss.clip == "ppo"


def test_ablations_differ_from_aepo_in_exactly_their_knob(tmp_path):
    def tree(algorithm):
        import msgspec

        spec, = plan_runs(tmp_path, ["embedded"], [[algorithm]], [0], [])
        return msgspec.to_builtins(resolve(spec))

    from aepo_engine.experiments.grid import differences

    aepo = tree("aepo")
    knobs = {"aepo_no_stopgrad_clip": "policy.loss.clip", "aepo_no_entropy_advantage": "policy.loss.entropy_adv_alpha",
             "aepo_no_premonitoring": "rollout.pre_monitoring", "aepo_no_branch_penalty": "rollout.branch_penalty"}
    for algorithm, knob in knobs.items():
        diff = [d for d in differences(aepo, tree(algorithm)) if not d.startswith("run_dir")]
        assert [d.split(" ")[0] for d in diff] == [knob], (algorithm, diff)


def _configs(tmp_path, runs):
    specs = [RunSpec(a, seed, tmp_path / a / f"seed{seed}",
                     ("--preset", "embedded", *(t for p in ALGORITHMS[a] for t in ("--preset", p)), f"--seed={seed}",
                      f"--run_dir={tmp_path / a / f'seed{seed}'}", *extra)) for a, seed, extra in runs]
    return {spec: resolve(spec) for spec in specs}


def test_check_grid_accepts_seeds_and_algorithms_refuses_other_budgets_or_setups(tmp_path):
    ok = _configs(tmp_path, [("grpo", 0, ()), ("aepo", 0, ()), ("arpo", 1, ()), ("aepo_no_premonitoring", 1, ())])
    check_grid(ok)  # derived seeds differ across seeds by design; algorithms differ in their presets
    assert eval_before_shareable(ok)
    other_budget = _configs(tmp_path, [("grpo", 0, ()), ("aepo", 1, ("--train.prompts_per_step=8",))])
    with pytest.raises(ConfigError, match="budget differs at train.prompts_per_step"):
        check_grid(other_budget)
    other_setup = _configs(tmp_path, [("grpo", 0, ()), ("aepo", 0, ("--task.warm_start.steps=500",))])
    with pytest.raises(ConfigError, match="shared set-up would differ at task.warm_start.steps"):
        check_grid(other_setup)
    other_eval = _configs(tmp_path, [("grpo", 0, ()), ("aepo", 0, ("--eval.temperature=0.7",))])
    assert not eval_before_shareable(other_eval)


# --- aggregation ---------------------------------------------------------------------------------

def _row(algorithm, seed, before, after):
    return {"algorithm": algorithm, "seed": seed, "accuracy_before": before, "accuracy_after": after,
            "gain": after - before, "pass_at_n_after": None, "metrics_mean": {}, "metrics_first": {},
            "metrics_last": {}, "tokens_per_step": 1000.0, "step_s": 2.0, "gain_per_mtokens": None,
            "gain_per_hour": None}


def test_mean_std_count_and_table_by_hand():
    mean, sd, n = mean_std_count([0.1, 0.3, None])
    assert (round(mean, 12), n) == (0.2, 2) and math.isclose(sd, math.sqrt(0.02))  # ((0.1)^2 + (0.1)^2) / 1
    assert math.isnan(mean_std_count([5.0])[1]) and mean_std_count([None]) is None
    rows = [_row("grpo", 0, 0.30, 0.50), _row("grpo", 1, 0.40, 0.50), _row("aepo", 0, 0.30, 0.45)]
    table = markdown_table(rows, ["aepo", "grpo", "dapo"]).splitlines()
    assert len(table) == 4 and "dapo" not in "\n".join(table)
    assert "pass@n" not in table[0]  # no row has it: the column is left out
    # grpo: before 30, 40 -> 35.0 ± 7.1 (sd = 10 / sqrt(2)); after 50, 50 -> 50.0 ± 0.0; gain 20, 10 -> 15.0 ± 7.1
    assert table[3].startswith("| grpo | 0,1 | 35.0 ± 7.1 | 50.0 ± 0.0 | 15.0 ± 7.1 |"), table[3]
    assert table[2].startswith("| aepo | 0 | 30.0 | 45.0 | 15.0 |"), table[2]  # one seed: no ± part
    check = eval_before_check(rows)
    assert check[0].startswith("seed 0: identical") and check[1].startswith("seed 1: identical")
    assert eval_before_check([_row("grpo", 0, 0.3, 0.5), _row("aepo", 0, 0.31, 0.5)])[0].startswith("seed 0: DIFFERENT")


def test_clip_steps_and_mechanism_table_by_hand():
    # 4 steps: high+low > 0 in steps 0 and 2 -> 1/2; branched tokens logged in steps 1-2 only, clipped in 2 -> 1/2
    steps = [{"loss/clipfrac_high": 0.1, "loss/clipfrac_low": 0.0, "loss/clipfrac_high/global": 0.0},
             {"loss/clipfrac_high": 0.0, "loss/clipfrac_low": 0.0, "loss/clipfrac_high/global": 0.0,
              "loss/clipfrac_high/branch": 0.0, "loss/clipfrac_low/branch": 0.0},
             {"loss/clipfrac_high": 0.0, "loss/clipfrac_low": 0.2, "loss/clipfrac_high/global": 0.0,
              "loss/clipfrac_high/branch": 0.0, "loss/clipfrac_low/branch": 0.3},
             {"loss/clipfrac_high": 0.0, "loss/clipfrac_low": 0.0, "loss/clipfrac_high/global": 0.0}]
    assert clip_steps(steps) == 0.5 and clip_steps(steps, "/branch") == 0.5 and clip_steps(steps, "/global") == 0.0
    assert clip_steps([{"loss/entropy": 1.0}]) is None  # never logged: no value, not 0
    rows = [{**_row("aepo", s, 0.3, 0.4), "clip_steps": c, "metrics_mean": {"rollout/m_min": 3.0, "rollout/m_max": m}}
            for s, c, m in ((0, 0.5, 5.0), (1, 1.0, 7.0))]
    table = markdown_table(rows, ["aepo"], MECHANISM_COLUMNS).splitlines()
    # clip steps 50, 100 -> 75.0 ± 35.4; m spread 2, 4 -> 3.00 ± 1.41; columns no row has are left out
    assert table[0] == "| algorithm | seeds | steps with a clipped token (%) | m min-max |", table[0]
    assert table[2] == "| aepo | 0,1 | 75.0 ± 35.4 | 3.00 ± 1.41 |", table[2]


# --- the smoke grid ------------------------------------------------------------------------------

def compare(out: Path, results: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "aepo_engine.experiments.compare", "--task", *TASK, "--algorithms", "grpo,aepo",
            "--seeds", "0", f"--out={out}", f"--results-dir={results}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, env=child_env())


@pytest.mark.sandbox
@pytest.mark.slow
def test_smoke_grid_rows_table_plots_resume(tmp_path):
    out, results = tmp_path / "grid", tmp_path / "results"
    proc = compare(out, results, "--setup-only", *TINY)  # the per-seed set-up alone, ahead of the runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "setup/seed0: done" in proc.stdout and not (out / "grpo").exists()
    assert (out / "_setup" / "seed0" / "setup" / "warm_start" / "DONE").exists()
    from aepo_engine.config_loader import loads_config
    from aepo_engine.tasks import SyntheticSetupConfig

    recorded = loads_config(SyntheticSetupConfig, (out / "_setup" / "seed0" / "setup_config.toml").read_text())
    assert recorded.tiny.hidden_size == 64 and recorded.task.warm_start.steps == 6  # TINY's, and nothing else
    proc = compare(out, results, *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (results / "compare_tiny.jsonl").read_text().splitlines()]
    assert [(r["algorithm"], r["seed"]) for r in rows] == [("grpo", 0), ("aepo", 0)]
    for r in rows:
        assert 0 <= r["accuracy_before"] <= 1 and 0 <= r["accuracy_after"] <= 1 and r["steps"] == 2
        assert r["tokens_generated"] > 0 and r["step_s"] > 0 and r["pass_at_n"] == 2
        assert "loss/entropy" in r["metrics_mean"] and r["commit"] is not None
    table = (results / "compare_tiny.md").read_text()
    assert "| grpo | 0 |" in table and "| aepo | 0 |" in table and "No run missing." in table
    assert "seed 0: identical across 2 runs" in table  # same model, same evaluation draws
    assert "Mechanisms" in table and "| aepo | 0 |" in table.split("Mechanisms")[1]
    assert all("loss/cf/kept_frac" in r["metrics_mean"] and "rollout/m_min" in r["metrics_mean"] for r in rows)
    for name in ("compare_tiny_accuracy.png", "compare_tiny_curves.png", "compare_tiny_premonitoring.png"):
        assert (results / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The set-up was built once and hard-linked into both runs.
    shared = out / "_setup" / "seed0" / "setup" / "warm_start" / "model.safetensors"
    assert os.stat(shared).st_nlink == 3
    assert all(os.path.samefile(shared, out / a / "seed0" / "setup" / "warm_start" / "model.safetensors")
               for a in ("grpo", "aepo"))

    # Finished runs are skipped; a run without its summary is resumed from its last checkpoint.
    grpo_summary = out / "grpo" / "seed0" / "summary.json"
    stamp = grpo_summary.stat().st_mtime_ns
    (out / "aepo" / "seed0" / "summary.json").unlink()
    proc = compare(out, results, *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "grpo/seed0: finished earlier, skipped" in proc.stdout
    assert "aepo/seed0: done" in proc.stdout and grpo_summary.stat().st_mtime_ns == stamp
    assert "[resume] from" in (out / "aepo" / "seed0" / "train.log").read_text()

    # Another budget in the same folder is refused; --summarize-only lists what is missing.
    proc = compare(out, results, *[a for a in TINY if not a.startswith("--train.steps")], "--train.steps=3")
    assert proc.returncode == 2 and "use another --out" in proc.stderr
    grid = json.loads((out / "grid.json").read_text())
    (out / "grid.json").write_text(json.dumps({**grid, "seeds": [0, 1]}))
    proc = compare(out, results, "--summarize-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "- grpo seed 1: not started" in proc.stdout and "- aepo seed 1: not started" in proc.stdout


def test_a_setup_another_process_builds_is_not_waited_for_without_wait(tmp_path):
    import fcntl

    from aepo_engine.experiments.runner import SetupBusy, build_setup, setup_dir

    spec, = plan_runs(tmp_path, TASK, [["grpo"]], [0], TINY)
    folder = setup_dir(tmp_path, 0)
    folder.mkdir(parents=True)
    with (folder / ".lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another compare process building it would
        with pytest.raises(SetupBusy):
            build_setup(tmp_path, 0, resolve(spec), threads=1, wait=False)
    assert not (folder / "setup").exists()


def test_a_setup_folder_records_the_sections_it_was_built_from(tmp_path):
    """The record is the set-up's sections (task, model.tiny, tools); a folder recorded before,
    with a whole run config, is still matched by those sections. Nothing is built here (the
    markers say it is done); the smoke grid builds a real one."""
    from aepo_engine.config_loader import dump_config, loads_config
    from aepo_engine.experiments.grid import setup_of
    from aepo_engine.experiments.runner import build_setup, setup_dir
    from aepo_engine.tasks import SyntheticSetupConfig

    spec, = plan_runs(tmp_path, TASK, [["grpo"]], [0], TINY)
    cfg = resolve(spec)
    other_spec, = plan_runs(tmp_path, TASK, [["grpo"]], [0], [*TINY, "--model.tiny.num_layers=3"])
    other = resolve(other_spec)
    folder = setup_dir(tmp_path, 0)
    (folder / "setup" / "warm_start").mkdir(parents=True)
    (folder / "setup" / "warm_start" / "DONE").write_text("ok")
    (folder / "setup" / "corpus.jsonl").write_text("")
    for record in (dump_config(cfg), dump_config(setup_of(cfg))):  # written before / today
        (folder / "setup_config.toml").write_text(record)
        assert build_setup(tmp_path, 0, cfg, threads=1) == folder / "setup"
        with pytest.raises(ConfigError, match=r"built from another set-up: model\.tiny\.num_layers \(4 vs 3\)"):
            build_setup(tmp_path, 0, other, threads=1)
    assert loads_config(SyntheticSetupConfig, dump_config(setup_of(cfg))) == setup_of(cfg)
    assert "run_dir" not in dump_config(setup_of(cfg))  # the set-up's sections only


def test_scheduler_runs_what_it_can_while_another_process_builds_a_setup(tmp_path, monkeypatch):
    """Seed 1's set-up is busy (another process) until both of seed 0's runs have started: seed 0's
    runs go meanwhile, seed 1's wait and then run; nothing is marked failed. Set-up and training are
    stand-ins here (the smoke grid runs the real ones); the busy window is an event, not a clock."""
    import threading

    from aepo_engine.experiments import runner as cmp

    monkeypatch.setattr(cmp, "SETUP_RETRY_S", 0.01)
    released = threading.Event()  # "the other process finished seed 1's set-up"
    started = []
    lock = threading.Lock()

    def fake_build(out, seed, cfg, threads, log=None, wait=True):
        if seed == 1 and not released.is_set():
            raise cmp.SetupBusy("busy")
        path = cmp.setup_dir(out, seed) / "setup"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def fake_train(spec, threads, commit):
        with lock:
            started.append((spec.name, not released.is_set()))
            if sum(name.endswith("seed0") for name, _ in started) == 2:
                released.set()
        (spec.run_dir / "summary.json").write_text("{}")
        return 0

    monkeypatch.setattr(cmp, "build_setup", fake_build)
    monkeypatch.setattr(cmp, "run_training", fake_train)
    specs = plan_runs(tmp_path, TASK, [["grpo", "aepo"]], [0, 1], TINY)
    configs = {spec: resolve(spec) for spec in specs}
    outcomes = cmp.run_grid(tmp_path, specs, configs, jobs=2, log=lambda _: None)
    assert outcomes == {s.name: "done" for s in specs}
    early = {name for name, while_busy in started if while_busy}
    assert early == {"grpo/seed0", "aepo/seed0"}  # seed 1 waited for its set-up, seed 0 did not
