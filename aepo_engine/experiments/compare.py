"""``python -m aepo_engine.experiments.compare``: a grid of algorithms x seeds on one task, at one budget.

Every run is an ordinary training run directory made by the normal trainer in a subprocess::

    python -m aepo_engine.train --preset <task presets...> --preset <algorithm presets...> \\
        --seed N --run_dir OUT/<algorithm>/seed<N> <budget overrides>

An algorithm is a list of presets (:data:`ALGORITHMS`; the values live in the preset files and
nowhere else). Every run of a grid gets the same task presets and the same budget overrides, so the
budget is equal by construction: the same prompts per step, the same k trajectories per prompt,
the same steps, response limits and evaluation; the plan is checked on the resolved configs, and
a grid where they differ is refused (:mod:`aepo_engine.experiments.grid`). Since branching changes
how many tokens a step generates and how long it takes, the results also report gains per
generated token and per second.

Shared per seed: what is identical across the algorithms of one seed is built once. The synthetic
task's set-up (generated task, corpus, tokenizer, tiny model, warm start: ``run_dir/setup``, see
:mod:`aepo_engine.tasks.synthetic_setup`) is built in ``OUT/_setup/seed<N>`` and hard-linked into
each run (cheap, and each run directory stays complete), after checking that the config sections
it is built from (``task``, ``model.tiny``, ``tools``) resolve identically for every algorithm of
the seed.
The held-out evaluation before RL is also identical per seed (the same model and evaluation draws:
evaluation turns branching and pre-monitoring off), but it is not shared: it costs a few seconds
per run and sharing it would need a trainer option; the summary checks instead that every
algorithm of a seed measured the same ``eval_before``.

Resumable: a run with ``summary.json`` is finished and skipped; any other run is (re)started with
``--checkpoint.resume auto``, which resumes from its last checkpoint or starts over (metrics rows
of repeated steps are superseded by the last). Runs go one at a time or ``--jobs N`` at a time,
each with ``cores // N`` torch threads (``--threads`` overrides, e.g. 1 on a machine others load
too: docs/experiments.md). A seed's set-up is built just before its first run; a worker that
cannot start the next run yet builds the next seed's set-up, and a set-up another compare process
is building (a lock file) is looked at again later instead of holding a worker
(:mod:`aepo_engine.experiments.runner`).
``--setup-only`` builds the set-ups alone, e.g. ahead of the grid. ``--summarize-only`` rebuilds the results (one JSON row per
finished run, a Markdown table, PNG plots; :mod:`aepo_engine.experiments.results`) from whatever
runs are finished and lists those that are missing.

Deliberately left out: DAPO's dynamic sampling (the dapo preset is clip-higher with token-mean
aggregation only), more than one task per grid (run the command once per task), and scheduling
across machines.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from aepo_engine.config import TrainConfig
from aepo_engine.errors import ArgumentParser, entry_point
from aepo_engine.experiments.grid import (ALGORITHMS, DEFAULT_ORDER, RunSpec, check_grid, eval_before_shareable,
                                          parse_order, plan_runs, resolve, write_grid_file)
from aepo_engine.experiments.results import summarize_grid
from aepo_engine.experiments.runner import is_finished, run_grid

__all__ = ["main"]

PROG = "python -m aepo_engine.experiments.compare"


def _parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
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
    args, overrides = _parse_args(argv)
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
