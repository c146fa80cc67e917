"""``PromptSampler``: fixed-size batches from a seeded per-epoch permutation, resumable.

Its ``state_dict`` (epoch, offset, seed) makes a resumed run continue with exactly the batches it
would have seen.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from aepo_engine.data.examples import Example


class PromptSampler:
    """Deterministic, resumable batches of examples.

    Epoch e visits the examples in ``permutation(seed, e)`` order (identity order when shuffle is
    off). With ``drop_last`` the tail of an epoch that cannot fill a batch is skipped, so every batch
    has ``batch_size`` prompts (the reference trainer does the same).
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        """
        Args:
            examples: the examples to draw from.
            batch_size: prompts per batch.
            seed: permutation seed.
            shuffle: shuffle every epoch.
            drop_last: skip an epoch's incomplete tail batch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(examples):
            raise ValueError(f"batch_size {batch_size} > {len(examples)} examples: no full batch exists")
        if not examples:
            raise ValueError("no examples to sample from")
        self.examples = list(examples)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        # Seeded from (seed, epoch) alone, so any epoch's order can be rebuilt on resume.
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.examples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def next_batch(self) -> list[Example]:
        """Return the next batch, moving to a new epoch when this one is used up.

        Returns:
            ``batch_size`` examples (fewer only for the last batch of an epoch without drop_last).
        """
        remaining = len(self.examples) - self.offset
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        picked = self._order[self.offset:self.offset + self.batch_size]
        self.offset += len(picked)
        return [self.examples[i] for i in picked]

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Return the data position: epoch, offset within the epoch, seed and the data size."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the saved seed and shuffle setting win).

        Args:
            state: a ``state_dict()`` result.

        Raises:
            ValueError: the data has a different number of examples than when the state was saved.
        """
        if state["num_examples"] != len(self.examples):
            raise ValueError(f"sampler state is for {state['num_examples']} examples but the data has "
                             f"{len(self.examples)}: the data or its filters changed since the checkpoint")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
