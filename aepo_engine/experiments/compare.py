"""``python -m aepo_engine.experiments.compare``: a grid of algorithms x seeds on one task, at one budget.

Every run is an ordinary training run directory made by the normal trainer in a subprocess::

    python -m aepo_engine.train --preset <task presets...> --preset <algorithm presets...> \\
        --seed N --run_dir OUT/<algorithm>/seed<N> <budget overrides>

An algorithm is a list of presets (:data:`ALGORITHMS`; the values live in the preset files and
nowhere else). Every run of a grid gets the same task presets and the same budget overrides, so the
budget is equal by construction: the same prompts per step, the same k trajectories per prompt,
the same steps, response limits and evaluation; :func:`check_grid` verifies it on the resolved
configs and refuses a grid where they differ. Since branching changes how many tokens a step
generates and how long it takes, the results also report gains per generated token and per second.

Shared per seed: what is identical across the algorithms of one seed is built once. The synthetic
task's set-up (generated task, corpus, tokenizer, tiny model, warm start: ``run_dir/setup``, see
:mod:`aepo_engine.default_setup`) is built in ``OUT/_setup/seed<N>`` and hard-linked into each run
(cheap, and each run directory stays complete), after checking that the config sections it depends
on (``task``, ``model``, ``tools``) resolve identically for every algorithm of the seed.
The held-out evaluation before RL is also identical per seed (the same model and evaluation draws:
evaluation turns branching and pre-monitoring off), but it is not shared: it costs a few seconds
per run and sharing it would need a trainer option; the summary checks instead that every
algorithm of a seed measured the same ``eval_before``.

Resumable: a run with ``summary.json`` is finished and skipped; any other run is (re)started with
``--checkpoint.resume auto``, which resumes from its last checkpoint or starts over (metrics rows
of repeated steps are superseded by the last). Runs go one at a time or ``--jobs N`` at a time,
each with ``cores // N`` torch threads (``--threads`` overrides: on a machine others load too, 1
thread per process was 3-4x faster than 2). A seed's set-up is built just before its first run;
a worker that cannot start the next run yet builds the next seed's set-up, and a set-up another
compare process is building (a lock file) is looked at again later instead of holding a worker.
``--setup-only`` builds the set-ups alone, e.g. ahead of the grid. ``--summarize-only`` rebuilds the results (one JSON row per
finished run, a Markdown table, PNG plots; :mod:`aepo_engine.experiments.results`) from whatever
runs are finished and lists those that are missing.

Deliberately left out: DAPO's dynamic sampling (the dapo preset is clip-higher with token-mean
aggregation only), more than one task per grid (run the command once per task), and scheduling
across machines.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgspec

from aepo_engine.config import TrainConfig, load_train_config
from aepo_engine.config_loader import ConfigError, dump_config
from aepo_engine.errors import ArgumentParser, entry_point
from aepo_engine.rollout.config import RolloutConfig

__all__ = ["ALGORITHMS", "DEFAULT_ORDER", "RunSpec", "check_grid", "main", "plan_runs"]

PROG = "python -m aepo_engine.experiments.compare"

# Algorithm name -> the presets that make it, stacked after the task presets. The ablations are
# one-knob presets stacked after aepo (see their files).
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "grpo": ("grpo",),
    "dapo": ("dapo",),
    "arpo": ("arpo",),
    "aepo": ("aepo",),
    "aepo_no_stopgrad_clip": ("aepo", "aepo_no_stopgrad_clip"),
    "aepo_no_entropy_advantage": ("aepo", "aepo_no_entropy_advantage"),
    "aepo_no_premonitoring": ("aepo", "aepo_no_premonitoring"),
    "aepo_no_branch_penalty": ("aepo", "aepo_no_branch_penalty"),
    "gppo": ("gppo",),
    "cispo": ("cispo",),
}
# Groups in run order; inside a group the seeds are the outer loop, so a grid stopped early has
# the first group's algorithms on the same seeds.
DEFAULT_ORDER = ("grpo,aepo", "arpo,dapo",
                 "aepo_no_stopgrad_clip,aepo_no_entropy_advantage,aepo_no_premonitoring,aepo_no_branch_penalty",
                 "gppo,cispo")
# Config sections the synthetic set-up (task, corpus, tokenizer, model, warm start) is built from.
SETUP_SECTIONS = ("seed", "task", "model", "tools")
# What must be equal across every run of a grid for the comparison to be at one budget.
BUDGET_KEYS = ("train.steps", "train.prompts_per_step", "train.epochs", "rollout.k", "rollout.max_response_tokens",
               "rollout.max_tokens_per_segment", "rollout.max_tool_calls", "rollout.temperature", "rollout.top_p",
               "policy.ppo_mini_batch_size", "policy.mini_batch_unit", "policy.ppo_epochs", "optim", "eval",
               "backend.kind", "reward", "data")
# Rollout fields that act only when branching is on (evaluation samples without branching).
BRANCH_ONLY_ROLLOUT_FIELDS = ("pre_monitoring", "beta", "experimental", "branch_alpha_mode", "branch_alpha", "gamma",
                              "tau", "penalty_slope", "branch_penalty")
GRID_FILE = "grid.json"
SETUP_RETRY_S = 30.0  # how often a set-up another process is building is looked at again
RUN_INFO = "compare_run.json"


@dataclass(frozen=True)
class RunSpec:
    """One run of the grid.

    Attributes:
        algorithm: a key of :data:`ALGORITHMS`.
        seed: the run's root seed.
        run_dir: its run directory.
        argv: the trainer's arguments (presets, seed, run_dir, budget overrides).
    """

    algorithm: str
    seed: int
    run_dir: Path
    argv: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.algorithm}/seed{self.seed}"


# ---------------------------------------------------------------------------------------------
# Planning


def parse_order(groups: Sequence[str]) -> list[list[str]]:
    """``["grpo,aepo", "arpo"]`` -> ``[["grpo", "aepo"], ["arpo"]]``; unknown names are an error."""
    order = [[name.strip() for name in group.split(",") if name.strip()] for group in groups]
    unknown = sorted({name for group in order for name in group} - set(ALGORITHMS))
    if unknown:
        raise ConfigError(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    names = [name for group in order for name in group]
    if len(names) != len(set(names)):
        raise ConfigError(f"an algorithm is listed twice in {groups}")
    return [group for group in order if group]


def plan_runs(out: Path, task_presets: Sequence[str], order: Sequence[Sequence[str]], seeds: Sequence[int],
              overrides: Sequence[str]) -> list[RunSpec]:
    """The grid's runs in run order: group by group, seed by seed, algorithm by algorithm."""
    specs = []
    for group in order:
        for seed in seeds:
            for algorithm in group:
                run_dir = out / algorithm / f"seed{seed}"
                presets = [token for name in (*task_presets, *ALGORITHMS[algorithm]) for token in ("--preset", name)]
                argv = (*presets, f"--seed={seed}", f"--run_dir={run_dir}", *overrides)
                specs.append(RunSpec(algorithm, seed, run_dir, argv))
    return specs


def resolve(spec: RunSpec) -> TrainConfig:
    return load_train_config(list(spec.argv))


def _pick(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config trees (leaves, depth first)."""
    out = []
    for key in sorted(set(a) | set(b)):
        dotted = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differences(va, vb, dotted + ".")
        elif va != vb:
            out.append(f"{dotted} ({va!r} vs {vb!r})")
    return out


def _without_seeds(tree: dict[str, Any]) -> dict[str, Any]:
    """A config tree with the seeds derived from the root seed blanked (they differ by design)."""
    from aepo_engine.seeding import SEED_OFFSETS

    tree = json.loads(json.dumps(tree))
    for dotted in SEED_OFFSETS:
        *parents, leaf = dotted.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = None
    return tree


def check_grid(configs: dict[RunSpec, TrainConfig]) -> None:
    """Refuse a grid whose runs differ in their budget, or (within a seed) in what the shared
    set-up is built from.

    Raises:
        ConfigError: naming the runs and the keys that differ.
    """
    trees = {spec: msgspec.to_builtins(cfg) for spec, cfg in configs.items()}
    first = next(iter(trees))
    problems = []
    for spec, tree in trees.items():
        tree = _without_seeds(tree)
        for key in BUDGET_KEYS:
            diff = differences({key: _pick(_without_seeds(trees[first]), key)}, {key: _pick(tree, key)})
            problems += [f"{spec.name} vs {first.name}: budget differs at {d}" for d in diff]
    for seed in sorted({spec.seed for spec in trees}):
        members = [spec for spec in trees if spec.seed == seed]
        for spec in members[1:]:
            for section in SETUP_SECTIONS:
                diff = differences({section: trees[members[0]][section]}, {section: trees[spec][section]})
                problems += [f"{spec.name} vs {members[0].name}: the shared set-up would differ at {d}" for d in diff]
    if problems:
        raise ConfigError("refusing to run the grid:\n" + "\n".join(f"- {p}" for p in problems))


def eval_before_shareable(configs: dict[RunSpec, TrainConfig]) -> bool:
    """Whether the held-out evaluation before RL sees identical inputs for every algorithm of a
    seed: the same set-up (checked by :func:`check_grid`), evaluation, backend, reward, data and
    the rollout settings evaluation keeps (it turns branching and pre-monitoring off)."""
    from aepo_engine.eval.core import eval_rollout_config

    def key(cfg: TrainConfig) -> Any:
        rollout = eval_rollout_config(cfg.rollout, cfg.eval)
        # Branching is off in evaluation, so the knobs that only act on branching do not matter.
        unused = {name: getattr(RolloutConfig(), name) for name in BRANCH_ONLY_ROLLOUT_FIELDS}
        return (cfg.eval, cfg.backend, cfg.reward, cfg.data, msgspec.structs.replace(rollout, **unused))

    by_seed: dict[int, set] = {}
    for spec, cfg in configs.items():
        by_seed.setdefault(spec.seed, set()).add(msgspec.json.encode(key(cfg)))
    return all(len(keys) == 1 for keys in by_seed.values())


# ---------------------------------------------------------------------------------------------
# The grid file: what an output folder was started with


def write_grid_file(out: Path, grid: dict[str, Any], allow_extend: bool = True) -> None:
    """Record the grid in ``out/grid.json``; a folder started with other task presets or budget
    overrides is refused (its finished runs would be at another budget). Algorithms and seeds may
    be added to an existing grid."""
    path = out / GRID_FILE
    if path.exists():
        old = json.loads(path.read_text())
        for key in ("task_presets", "overrides"):
            if old[key] != grid[key]:
                raise ConfigError(f"{out} holds a grid started with {key}={old[key]}, not {grid[key]}: use another "
                                  "--out (a grid's runs must share one task and budget)")
        grid = {**grid, "algorithms": _union(old["algorithms"], grid["algorithms"]),
                "seeds": _union(old["seeds"], grid["seeds"])}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(grid, indent=1))


def _union(old: list, new: list) -> list:
    return old + [x for x in new if x not in old]


def read_grid_file(out: Path) -> dict[str, Any] | None:
    path = out / GRID_FILE
    return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------------------------------------
# Running


def setup_dir(out: Path, seed: int) -> Path:
    return out / "_setup" / f"seed{seed}"


class SetupBusy(RuntimeError):
    """Another process holds the set-up's lock (it is building it)."""


def build_setup(out: Path, seed: int, cfg: TrainConfig, threads: int, log=None, wait: bool = True) -> Path:
    """Build (or reuse) the synthetic set-up of ``seed`` under ``OUT/_setup/seed<N>/setup``.

    Runs ``python -m aepo_engine.default_setup`` (the trainer's own preparation) in a child
    process. A folder built from other set-up sections is refused. ``wait=False`` raises
    :class:`SetupBusy` instead of waiting while another process builds it.
    """
    folder = setup_dir(out, seed)
    folder.mkdir(parents=True, exist_ok=True)
    # Another compare process (e.g. an earlier --setup-only) may be building it: wait for it.
    with (folder / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError as err:
            raise SetupBusy(f"{folder} is being built by another process") from err
        return _build_setup_locked(folder, seed, cfg, threads, log or _log)


def _build_setup_locked(folder: Path, seed: int, cfg: TrainConfig, threads: int, log) -> Path:
    config_text = dump_config(msgspec.structs.replace(cfg, run_dir=str(folder)))
    recorded = folder / "setup_config.toml"
    if recorded.exists():
        diff = _setup_differences(recorded.read_text(), config_text)
        if diff:
            raise ConfigError(f"{folder} was built from another set-up: " + "; ".join(diff[:5]))
    if _setup_done(folder / "setup", cfg):
        return folder / "setup"
    recorded.write_text(config_text)
    log(f"[compare] building the shared set-up of seed {seed} in {folder}")
    with (folder / "setup.log").open("a") as out_log:
        proc = subprocess.run([sys.executable, "-m", "aepo_engine.default_setup", str(recorded), str(folder)],
                              stdout=out_log, stderr=subprocess.STDOUT, env=_thread_env(threads))
    if proc.returncode != 0 or not _setup_done(folder / "setup", cfg):
        raise RuntimeError(f"building the set-up of seed {seed} failed (exit {proc.returncode}); see {folder / 'setup.log'}")
    return folder / "setup"


def _setup_differences(old_text: str, new_text: str) -> list[str]:
    from aepo_engine.config_loader import loads_config

    old, new = (msgspec.to_builtins(loads_config(TrainConfig, t)) for t in (old_text, new_text))
    return [d for s in SETUP_SECTIONS for d in differences({s: old[s]}, {s: new[s]})]


def _setup_done(setup: Path, cfg: TrainConfig) -> bool:
    model = "warm_start" if cfg.task.warm_start_enabled else "random_init"
    return (setup / model / "DONE").exists() and (setup / "corpus.jsonl").exists()


def link_setup(shared: Path, run_dir: Path) -> None:
    """Hard-link the shared set-up into ``run_dir/setup`` (a copy where links fail); a partial
    earlier attempt is replaced. The set-up is only read after it is built, so links are safe."""
    target = run_dir / "setup"
    if target.exists() and _same_tree(shared, target):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "setup.linking"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shared, tmp, copy_function=_link_or_copy)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b


def _thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def run_training(spec: RunSpec, threads: int, commit: str) -> int:
    """Run (or resume) one training run in a subprocess; its output goes to ``run_dir/train.log``
    and its provenance (commit, threads, wall time, load average) to ``run_dir/compare_run.json``."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    info_path = spec.run_dir / RUN_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {"attempts": []}
    attempt = {"commit": commit, "threads": threads, "started": _now(), "loadavg_start": list(os.getloadavg()),
               "argv": list(spec.argv)}
    t0 = time.perf_counter()
    with (spec.run_dir / "train.log").open("a") as log:
        proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", *spec.argv, "--checkpoint.resume=auto"],
                              stdout=log, stderr=subprocess.STDOUT, env=_thread_env(threads))
    attempt.update(finished=_now(), wall_s=round(time.perf_counter() - t0, 1), returncode=proc.returncode,
                   loadavg_end=list(os.getloadavg()))
    info["attempts"].append(attempt)
    info_path.write_text(json.dumps(info, indent=1))
    return proc.returncode


def _log(message: str) -> None:
    print(message, flush=True)  # the grid runs for hours under nohup: show progress as it goes


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def git_commit() -> str:
    """The commit of the code running the grid (empty outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return ""


def run_grid(out: Path, specs: list[RunSpec], configs: dict[RunSpec, TrainConfig], jobs: int,
             log=None, on_done=None, threads: int | None = None, setup_only: bool = False) -> dict[str, str]:
    """Build the per-seed set-ups, then run every unfinished spec, ``jobs`` at a time, in order.

    A seed's set-up is queued just before its first run; a run waits for its set-up, and idle
    workers take the next startable task (often the next seed's set-up) meanwhile.
    ``on_done()`` is called (one call at a time) after each run that finished.

    Returns:
        ``{run name: "done" | "skipped" | "failed (...)"}`` (``{"setup/seed<N>": ...}`` with setup_only).
    """
    log = log or _log
    done_lock = threading.Lock()
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    commit = git_commit()
    todo = [s for s in specs if not is_finished(s.run_dir) and configs[s].task.source == "synthetic"]
    first_of_seed = {s.seed: s for s in reversed(todo)}
    seeds = list(dict.fromkeys(s.seed for s in todo))
    ready = {seed: threading.Event() for seed in seeds}
    shared: dict[int, Path | Exception] = {}

    def setup(seed: int) -> str:
        try:
            shared[seed] = build_setup(out, seed, configs[first_of_seed[seed]], threads, log, wait=False)
        except SetupBusy:
            return "busy"  # not ready: the runs of the seed keep waiting
        except Exception as err:  # noqa: BLE001 - reported by every run of the seed
            shared[seed] = err
            log(f"[compare] set-up of seed {seed} failed: {type(err).__name__}: {err}")
        ready[seed].set()
        return "done" if isinstance(shared[seed], Path) else f"failed ({shared[seed]})"

    def one(spec: RunSpec) -> str:
        try:
            return run_spec(spec)
        except Exception as err:  # noqa: BLE001 - one broken run must not stop the grid
            log(f"[compare] {spec.name}: failed: {type(err).__name__}: {err}")
            return f"failed ({type(err).__name__}: {err})"

    def run_spec(spec: RunSpec) -> str:
        if is_finished(spec.run_dir):
            log(f"[compare] {spec.name}: finished earlier, skipped")
            return "skipped"
        if spec.seed in ready:
            ready[spec.seed].wait()
            if isinstance(shared[spec.seed], Exception):
                raise RuntimeError(f"no set-up for seed {spec.seed}: {shared[spec.seed]}")
            link_setup(shared[spec.seed], spec.run_dir)
        log(f"[compare] {spec.name}: running ({threads} threads) -> {spec.run_dir}")
        rc = run_training(spec, threads, commit)
        outcome = "done" if rc == 0 and is_finished(spec.run_dir) else f"failed (exit {rc})"
        log(f"[compare] {spec.name}: {outcome}")
        if outcome == "done" and on_done is not None:
            with done_lock:
                on_done()
        return outcome

    # The queue: each seed's set-up just before the first run of that seed. A worker takes the first
    # task it can start (a run once its seed's set-up is built), so idle workers build the next
    # seeds' set-ups while the first runs go.
    queue: list[tuple[str, Any, Any]] = []
    for spec in specs:
        if spec.seed in ready and not any(name == f"setup/seed{spec.seed}" for name, _, _ in queue):
            queue.append((f"setup/seed{spec.seed}", setup, spec.seed))
        if not setup_only:
            queue.append((spec.name, one, spec))
    results: dict[str, str] = {}
    cond = threading.Condition()

    retry_at: dict[str, float] = {}  # set-ups another process is building: look again later

    def startable(task: tuple[str, Any, Any]) -> bool:
        if task[1] is setup:
            return time.monotonic() >= retry_at.get(task[0], 0.0)
        return task[2].seed not in ready or ready[task[2].seed].is_set()

    def worker() -> None:
        while True:
            with cond:
                while queue and not any(startable(t) for t in queue):
                    cond.wait(timeout=min(5.0, SETUP_RETRY_S))
                if not queue:
                    return
                task = next(t for t in queue if startable(t))
                position = queue.index(task)
                queue.remove(task)
            outcome = task[1](task[2])
            with cond:
                if outcome == "busy":  # back in its place; this worker takes something else
                    queue.insert(position, task)
                    if task[0] not in retry_at:
                        log(f"[compare] {task[0]}: another process is building it; looking again every {SETUP_RETRY_S:g} s")
                    retry_at[task[0]] = time.monotonic() + SETUP_RETRY_S
                else:
                    results[task[0]] = outcome
                cond.notify_all()

    threads_ = [threading.Thread(target=worker, daemon=True) for _ in range(jobs)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join()
    if setup_only:
        return results
    return {spec.name: results[spec.name] for spec in specs}


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="Other --section.key=value arguments go to every run (the budget), "
                                            "e.g. --train.steps=30.")
    parser.add_argument("--task", nargs="+", default=["embedded"], metavar="PRESET",
                        help="task presets applied before each algorithm's (default: embedded); the last names the task")
    parser.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ORDER), metavar="A,B",
                        help="algorithm groups in run order, comma-separated inside a group "
                             f"(default: {' '.join(DEFAULT_ORDER)}); known: {', '.join(ALGORITHMS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="folder of the grid's runs")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores // jobs threads)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run instead of cores // jobs (e.g. 1 on a machine others load too)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where rows, table and plots go (default: bench/results of the source checkout; "
                             "OUT/results for an installed package)")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: rebuild rows, table and plots from the finished runs under --out")
    parser.add_argument("--plan", action="store_true", help="print the runs in order and the checks, run nothing")
    parser.add_argument("--setup-only", action="store_true",
                        help="only build the per-seed shared set-ups (jobs at a time), e.g. ahead of the grid")
    args, overrides = parser.parse_known_args(list(argv))
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--jobs and --threads must be >= 1")
    bad = [a for a in overrides if not a.startswith("--") or a.startswith(("--preset", "--config", "--seed", "--run_dir"))]
    if bad:
        parser.error(f"{' '.join(bad)}: the grid sets presets, seed and run_dir itself; other arguments must be "
                     "--section.key=value overrides")
    return args, overrides


@entry_point
def main(argv: list[str]) -> int:
    """The command; bad input ends with one ``error:`` line and status 2 (:mod:`aepo_engine.errors`);
    1 when a run of the grid failed."""
    from aepo_engine.experiments.results import summarize_grid

    args, overrides = parse_args(argv)
    results_dir = args.results_dir or default_results_dir(args.out)
    if args.summarize_only:
        report = summarize_grid(args.out, results_dir)
        print(report)
        return 0
    order = parse_order(args.algorithms)
    specs = plan_runs(args.out, args.task, order, args.seeds, overrides)
    configs = {spec: resolve(spec) for spec in specs}
    check_grid(configs)
    shareable = eval_before_shareable(configs)
    _print_plan(specs, configs, shareable)
    if args.plan:
        return 0
    if not args.setup_only:  # a set-up does not depend on the budget: record the grid with its runs
        write_grid_file(args.out, {"task_presets": list(args.task), "overrides": list(overrides),
                                   "algorithms": [a for group in order for a in group], "seeds": list(args.seeds)})
    # The results are rebuilt after every finished run, so they are current while the grid runs.
    outcomes = run_grid(args.out, specs, configs, args.jobs,
                        on_done=lambda: summarize_grid(args.out, results_dir), threads=args.threads,
                        setup_only=args.setup_only)
    if args.setup_only:
        print("\n".join(f"{name}: {outcome}" for name, outcome in outcomes.items()))
        return 0 if all(o == "done" for o in outcomes.values()) else 1
    print(summarize_grid(args.out, results_dir))
    return 0 if all(o in ("done", "skipped") for o in outcomes.values()) else 1


def default_results_dir(out: Path) -> Path:
    """Where rows, table and plots go without ``--results-dir``: ``bench/results`` of the source
    checkout this module runs from, else (an installed package) ``OUT/results``: never a folder
    inside the installed package."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "setup.py").is_file() and (checkout / "bench" / "results").is_dir():
        return checkout / "bench" / "results"
    return Path(out) / "results"


def _print_plan(specs: list[RunSpec], configs: dict[RunSpec, TrainConfig], shareable: bool) -> None:
    cfg = configs[specs[0]]
    steps = cfg.train.steps if cfg.train.steps is not None else f"{cfg.train.epochs} epochs"
    print(f"[compare] {len(specs)} runs; budget per run: {steps} steps x {cfg.train.prompts_per_step} prompts x "
          f"k={cfg.rollout.k}, responses <= {cfg.rollout.max_response_tokens} tokens; held-out eval "
          f"{cfg.eval.num_questions or 'all'} questions x {cfg.eval.n_samples} samples")
    print(f"[compare] the held-out evaluation before RL sees identical inputs per seed: {shareable}")
    for i, spec in enumerate(specs):
        state = "finished" if is_finished(spec.run_dir) else "to run"
        print(f"  {i + 1:3d}. {spec.name:36s} {state}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
