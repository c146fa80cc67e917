"""Planning an algorithm-comparison grid: which runs, in which order, and the checks that make
them comparable (:mod:`aepo_engine.experiments.compare` is the command).

An algorithm is a list of presets (:data:`ALGORITHMS`; the values live in the preset files and
nowhere else). Every run of a grid gets the same task presets and the same budget overrides, so the
budget is equal by construction; :func:`check_grid` verifies it on the resolved configs, and that
the runs of one seed can share one synthetic set-up. ``OUT/grid.json`` records what an output
folder was started with (:func:`write_grid_file`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgspec

from aepo_engine.config import TrainConfig, load_train_config
from aepo_engine.config_loader import ConfigError
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.tasks import SyntheticSetupConfig

__all__ = ["ALGORITHMS", "BUDGET_KEYS", "DEFAULT_ORDER", "GRID_FILE", "RunSpec", "check_grid", "differences",
           "eval_before_shareable", "parse_order", "plan_runs", "read_grid_file", "resolve", "setup_differences",
           "setup_of", "write_grid_file"]

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
# What must be equal across every run of a grid for the comparison to be at one budget.
BUDGET_KEYS = ("train.steps", "train.prompts_per_step", "train.epochs", "rollout.k", "rollout.max_response_tokens",
               "rollout.max_tokens_per_segment", "rollout.max_tool_calls", "rollout.temperature", "rollout.top_p",
               "policy.ppo_mini_batch_size", "policy.mini_batch_unit", "policy.ppo_epochs", "optim", "eval",
               "backend.kind", "reward", "data")
# Rollout fields that act only when branching is on (evaluation samples without branching).
BRANCH_ONLY_ROLLOUT_FIELDS = ("pre_monitoring", "beta", "experimental", "branch_alpha_mode", "branch_alpha", "gamma",
                              "tau", "penalty_slope", "branch_penalty")
GRID_FILE = "grid.json"


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


def setup_of(cfg: TrainConfig) -> SyntheticSetupConfig:
    """The sections of a run config that its synthetic set-up is built from (what a seed's runs share)."""
    return SyntheticSetupConfig(task=cfg.task, tiny=cfg.model.tiny, tools=cfg.tools)


def setup_differences(a: SyntheticSetupConfig, b: SyntheticSetupConfig) -> list[str]:
    """Where two set-ups differ, in the run config's dotted keys (``model.tiny.hidden_size``, ...)."""

    def tree(setup: SyntheticSetupConfig) -> dict[str, Any]:
        return {"task": msgspec.to_builtins(setup.task), "model": {"tiny": msgspec.to_builtins(setup.tiny)},
                "tools": msgspec.to_builtins(setup.tools)}

    return differences(tree(a), tree(b))


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
    for seed in sorted({spec.seed for spec in configs}):
        members = [spec for spec in configs if spec.seed == seed]
        first_setup = setup_of(configs[members[0]])
        for spec in members[1:]:
            diff = setup_differences(first_setup, setup_of(configs[spec]))
            problems += [f"{spec.name} vs {members[0].name}: the shared set-up would differ at {d}" for d in diff]
    if problems:
        raise ConfigError("refusing to run the grid:\n" + "\n".join(f"- {p}" for p in problems))


def eval_before_shareable(configs: dict[RunSpec, TrainConfig]) -> bool:
    """Whether the held-out evaluation before RL sees identical inputs for every algorithm of a
    seed: the same set-up (checked by :func:`check_grid`), evaluation, backend, reward, data and
    the rollout settings evaluation keeps (it turns branching and pre-monitoring off)."""
    from aepo_engine.evaluation.core import eval_rollout_config

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
