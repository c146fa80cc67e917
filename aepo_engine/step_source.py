"""Where a training step's trajectories come from: the step-source seam.

The trainer's step is written once (:meth:`aepo_engine.train.Trainer.step`)::

    rollouts = source.collect(step)    # this rank's share of the step's prompts, sampled
    score them; all-gather the ranks' shares in prompt order
    source.before_update()             # a colocated engine may hand its memory to the update
    learn: advantages, proximal log-probs, rollout correction, the update
    source.publish(step + 1)           # the engine takes the weights of version step + 1

Two sources implement :class:`StepSource`:

- :class:`SynchronousSource` (``train.mode = "sync"``): this rank's engine samples step s when the
  trainer asks, always with the weights of version s.
- :class:`aepo_engine.asynchronous.source.AsynchronousSource` (``train.mode = "async"``): a rollout
  process samples up to ``train.max_staleness`` steps ahead while the trainer updates.

A source also owns the engine the run's evaluations sample with (:attr:`StepSource.engine`,
readied for a version by :meth:`StepSource.prepare_evaluation`) and the resume point a checkpoint
stores (:meth:`StepSource.resume_point`: the prompt sampler's state before the first step not yet
trained was drawn).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, TypeVar

import torch

from aepo_engine import distributed
from aepo_engine.data import Example, PromptSampler
from aepo_engine.rollout.backends import EngineLayout
from aepo_engine.rollout.continuous import ContinuousRollout
from aepo_engine.rollout.scheduler import RolloutStats
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["PolicyWeights", "StepRollouts", "StepSource", "SynchronousSource", "free_cached_memory", "in_phase"]

T = TypeVar("T")


@dataclass
class StepRollouts:
    """One step's rollouts as this rank's source delivers them.

    Attributes:
        examples: the step's prompts (every rank draws the whole step).
        trajectories: this rank's share; ``prompt_index`` indexes ``examples``.
        stats: their rollout statistics (None where this rank sampled none).
        rollout_s: seconds the engine spent sampling them.
        waited_s: seconds the trainer waited for them.
    """

    examples: list[Example]
    trajectories: list[Trajectory]
    stats: RolloutStats | None
    rollout_s: float
    waited_s: float


class PolicyWeights(Protocol):
    """The weights a source pushes (:class:`aepo_engine.training.policy.PolicyWorker`)."""

    pushed_bytes: int  # bytes of the last push (the adapters' only under LoRA)

    def iter_weight_buckets(self, bucket_bytes: int,
                            dtype: torch.dtype | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The weights to push, a bucket of about ``bucket_bytes`` at a time, in ``dtype`` (None: as
        stored); collective under torchrun (every rank iterates every bucket)."""
        ...


class StepSource(Protocol):
    """Delivers each step's rollouts and takes each new policy version (module docstring)."""

    engine: Any  # the generation backend evaluations sample with; None on a rank that samples nothing

    def start(self, version: int) -> None:
        """Before the first step (``version``: the steps already trained): the engine holds the
        weights of ``version`` afterwards."""
        ...

    def collect(self, step: int) -> StepRollouts:
        """Step ``step``'s prompts and this rank's sampled share of them."""
        ...

    def before_update(self) -> None:
        """The update of the collected step is about to run."""
        ...

    def publish(self, version: int) -> dict[str, float]:
        """Hand the policy's weights, now at ``version``, to the engine; the push's metrics."""
        ...

    def prepare_evaluation(self, version: int) -> None:
        """:attr:`engine` samples with the weights of ``version`` after this."""
        ...

    def resume_point(self) -> dict[str, Any]:
        """The prompt sampler's state before the first step after the last published one was drawn."""
        ...

    def stop(self) -> None:
        """The steps are over (steps in flight are abandoned); the engine still evaluates."""
        ...

    def close(self) -> None:
        """The run is over: release the engine."""
        ...


def free_cached_memory() -> None:
    """Return PyTorch's cached, unused GPU blocks to the driver (garbage first: a block is freed
    only when no tensor holds it). vLLM's sleep mode allocates its weights and KV cache through a
    pool of its own, outside PyTorch's caching allocator, so it cannot reuse the blocks the update
    left cached: without this a wake-up sees the update's reserved peak still held (TRL and verl
    empty the cache around sleep and wake for the same reason). A no-op without CUDA."""
    gc.collect()
    torch.cuda.empty_cache()


def in_phase(engine: Any, fn: Callable[[], T]) -> T:
    """``fn()``: sampling with this rank's engine, on this rank's share of the prompts. A follower
    of an in-process tensor-parallel group (``Capabilities.group``) first replays the host's engine
    calls (until the host has returned), then runs ``fn`` on its own share, which is empty; the
    host releases the followers afterwards. Keep collectives out of ``fn``."""
    grouped = engine is not None and engine.capabilities.group
    if grouped and not engine.leads:
        engine.follow()
        return fn()
    try:
        return fn()
    finally:
        if grouped:
            engine.end_phase()


class SynchronousSource:
    """Each step sampled by this rank's engine when the trainer asks (``train.mode = "sync"``).

    Args:
        engine: this rank's generation backend (None on a rank that hosts none and replays none).
        rollout: the step's scheduler over ``engine`` (``rollout.schedule``: continuous or rounds).
        sampler: the run's prompt sampler (every rank draws every step).
        layout: which of a step's prompts this rank's engine samples.
        encode: a prompt's token ids.
        weights: the policy whose weights each :meth:`publish` pushes.
        bucket_bytes: the weight push's bucket size.
        sleeps: the engine sleeps through each update (``backend.sleeps``): it drops its KV cache
            (and weights) before the update and gets them back around the push.

    Constructing it is collective under torchrun (the push's dtype is the engine's, broadcast from
    rank 0: every rank must gather alike, including those that hold no engine).
    """

    def __init__(self, engine: Any, rollout: ContinuousRollout, sampler: PromptSampler, layout: EngineLayout,
                 encode: Callable[[Example], list[int]], weights: PolicyWeights, bucket_bytes: int, sleeps: bool):
        self.engine, self.rollout, self.sampler, self.layout = engine, rollout, sampler, layout
        self.encode, self.weights, self.bucket_bytes = encode, weights, bucket_bytes
        self.sleeps = engine is not None and sleeps  # build_backend made sure: engine.capabilities.sleep
        self.pushed = 0  # the version the engine holds: it was built from the initial weights
        self.weight_dtype = distributed.broadcast_object(None if engine is None else engine.weight_dtype)

    def start(self, version: int) -> None:
        self.prepare_evaluation(version)  # a resumed run: the engine was built from the initial weights

    def collect(self, step: int) -> StepRollouts:
        t0 = time.perf_counter()
        examples = self.sampler.next_batch()
        mine = self.layout.prompts(len(examples))
        local = in_phase(self.engine, lambda: self.rollout.run_step([self.encode(examples[i]) for i in mine], step)
                         if mine else None)
        for traj in local.trajectories if local else ():
            traj.prompt_index = mine[traj.prompt_index]  # the step-global group id
        seconds = time.perf_counter() - t0
        return StepRollouts(examples, local.trajectories if local else [], local.stats if local else None,
                            rollout_s=seconds, waited_s=seconds)

    def before_update(self) -> None:
        if self.sleeps:  # the update gets the engine's memory back until the push
            self.engine.sleep()
            free_cached_memory()

    def publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self._push(version)
        return {"time/weight_push_s": time.perf_counter() - t0, "engine/push_bytes": float(self.weights.pushed_bytes)}

    def _push(self, version: int) -> None:
        """Stream the weights into the engine, a bucket at a time, gathered in the engine's dtype
        (collective: every rank gathers every bucket, a rank without an engine then drops it). A
        sleeping engine gets its weights' memory back first and its KV cache after the push:
        update -> empty cache -> wake weights -> push -> empty cache -> wake KV cache."""
        buckets = self.weights.iter_weight_buckets(self.bucket_bytes, dtype=self.weight_dtype)
        if self.engine is None:
            for _ in buckets:
                pass
            self.pushed = version
            return
        if self.sleeps:
            self._wake(["weights"])
        self.engine.load_weight_buckets(buckets)
        if self.sleeps:
            self._wake(["kv_cache"])
        self.pushed = version

    def _wake(self, tags: list[str]) -> None:
        """Reallocate ``tags`` of the engine, after returning PyTorch's cached blocks to the driver."""
        free_cached_memory()
        self.engine.wake_up(tags)

    def prepare_evaluation(self, version: int) -> None:
        if self.pushed != version:  # collective: every rank's source holds the same versions
            self._push(version)

    def resume_point(self) -> dict[str, Any]:
        return self.sampler.state_dict()  # drawn up to the last trained step

    def stop(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """The engine is the trainer's (built and released with it)."""
