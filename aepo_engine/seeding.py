"""One root seed: every other seed of a run derives from ``TrainConfig.seed`` unless set.

A section's seed field (``rollout.seed``, ``eval.seed``, ...) defaults to none, meaning "derived":
``TrainConfig`` fills it in as ``root + offset`` with the offsets below, so ``--seed 3`` moves every
random stream of the run (world, model init, warm start, data order, rollouts, evaluation draws)
and a field set explicitly stays as set. A section used on its own (a test, a benchmark, a
trainer that imports only the rollout) resolves none as root seed 0 through :func:`section_seed`.

The offsets are part of the results: with them root seed 0 reproduces the seeds the embedded
default ran with before the root seed existed (eval 12345, all others 0).
"""
from __future__ import annotations

__all__ = ["SEED_OFFSETS", "section_seed"]

# dotted config key -> offset added to the root seed
SEED_OFFSETS: dict[str, int] = {
    "data.shuffle_seed": 0,
    "model.tiny.seed": 0,
    "task.synthetic.seed": 0,
    "task.warm_start.seed": 0,
    "rollout.seed": 0,
    "eval.seed": 12345,
}


def section_seed(seed: int | None, key: str) -> int:
    """The seed a section uses: its own value, or (none: not derived by a TrainConfig) the value
    root seed 0 would give it.

    Args:
        seed: the section's seed field.
        key: its dotted key in ``SEED_OFFSETS``, e.g. ``"eval.seed"``.
    """
    return SEED_OFFSETS[key] if seed is None else seed
