"""The rollout's seeds: every sampling seed and branch draw derives from integers that identify
it (docs/rollouts.md, "Randomness"), so results do not depend on batching order and the same
root seed reproduces the same rollouts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ALPHA", "SAMPLE", "derive_seed"]

SAMPLE, ALPHA = 0, 1  # seed purposes, so sampling seeds and branch draws never coincide


def derive_seed(root_seed: int, step: int, prompt_index: int, traj_id: int, counter: int,
                purpose: int, resumed_at: int = 0) -> int:
    """A 63-bit seed from the identifying integers (independent of batch order); ``resumed_at`` > 0
    for the continuation of a segment cut after that many tokens (a new seed for the rest)."""
    words = [root_seed, step, prompt_index, traj_id, counter, purpose] + ([resumed_at] if resumed_at else [])
    seq = np.random.SeedSequence(words)
    return int(seq.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)
