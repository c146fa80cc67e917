"""What the trainer and the rollout process send each other (pickled through ``multiprocessing``
queues), and the byte path the weights take.

Trainer -> rollout process: :class:`Order` (a step's prompts, to start once the engine holds at
least ``min_version``), a weight push (:class:`WeightsBegin`, one :class:`WeightBucket` per bucket,
:class:`WeightsEnd`), :class:`Generate` (the trainer's own requests: its evaluations sample with
this engine, the run's only one), :class:`Stop`. Rollout process -> trainer: :class:`Ready` (with
the engine's weight dtype, the one pushes are gathered in, and its capabilities),
:class:`WeightsReceived` (a push is in: the trainer starts the next one only then, so at most one
version is on its way), :class:`StepDone` (a step's trajectories), :class:`Generated`,
:class:`Failed`.

Weights cross the process boundary as raw bytes, a bucket at a time (``encode_bucket``: name,
dtype, shape, bytes; the same encoding the out-of-process vLLM engine takes), so the sender never
holds more than the buckets the queue has not yet written into the pipe, and the receiver decodes
one bucket at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch

from aepo_engine.rollout.backends.vllm_ext import decode_bucket, encode_bucket
from aepo_engine.rollout.protocol import Capabilities, GenOutput, GenRequest
from aepo_engine.rollout.scheduler import RolloutStats
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["EngineCounters", "Failed", "Generate", "Generated", "Order", "Ready", "Stop", "StepDone", "WeightBucket",
           "WeightsBegin", "WeightsEnd", "WeightsReceived", "decode_buckets", "encode_buckets"]


@dataclass(frozen=True)
class Order:
    """Start the prompts of training step ``step`` once the engine's weights are at least version
    ``min_version`` (admission control: ``step - train.max_staleness``)."""

    step: int
    prompts: list[list[int]]
    min_version: int


@dataclass(frozen=True)
class WeightsBegin:
    version: int


@dataclass(frozen=True)
class WeightBucket:
    items: list  # encode_bucket output: [(name, dtype, shape, bytes)]


@dataclass(frozen=True)
class WeightsEnd:
    version: int


@dataclass(frozen=True)
class Generate:
    """Sample ``requests`` with the engine once it holds weights of ``min_version`` or later, before
    its next rollout round, with ``threads`` torch threads (0: the process's own); answered by
    :class:`Generated` with the same ``request_id``. The trainer's evaluations go this way, so an
    asynchronous run has one engine (GPU review 2, point 3)."""

    request_id: int
    requests: list[GenRequest]
    min_version: int
    threads: int = 0


@dataclass(frozen=True)
class Generated:
    request_id: int
    outputs: list[GenOutput]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass
class EngineCounters:
    """What the rollout process did since it started (cumulative; the trainer logs differences).

    Attributes:
        version: the policy version the engine holds.
        generate_s: seconds in the backend; tool_wait_s: waiting with nothing to sample but tool
            calls in flight; idle_s: nothing to do (no admitted prompt: waiting for the trainer);
            weight_load_s: loading pushed weights; weight_receive_s: from a push's first byte to
            its last (received while generating).
        tokens_by_version: tokens sampled under each policy version.
        aborts: segments cut short by weight updates (and continued).
        serve_s: seconds sampling the trainer's own requests (:class:`Generate`: its evaluations).
    """

    version: int = 0
    generate_s: float = 0.0
    tool_wait_s: float = 0.0
    idle_s: float = 0.0
    weight_load_s: float = 0.0
    weight_receive_s: float = 0.0
    tokens_by_version: dict[int, int] = field(default_factory=dict)
    aborts: int = 0
    serve_s: float = 0.0


@dataclass(frozen=True)
class Ready:
    """The engine and tools are up. ``weight_dtype``: the dtype the engine holds its weights in
    (pushes are gathered and sent in it: half the bytes of fp32 for a bf16 engine); None: the
    trainer's own. ``capabilities``, ``eos_token_ids``: the engine's (the trainer's handle on it,
    :class:`aepo_engine.asynchronous.client.RemoteEngine`, reports them)."""

    pid: int
    weight_dtype: torch.dtype | None = None
    capabilities: Capabilities = Capabilities()
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class WeightsReceived:
    """Every bucket of push ``version`` is in the rollout process (staged, maybe not loaded yet)."""

    version: int


@dataclass(frozen=True)
class StepDone:
    """A step's k trajectories per prompt (``prompt_index`` = the prompt's place in its order)."""

    step: int
    trajectories: list[Trajectory]
    stats: RolloutStats
    counters: EngineCounters
    seconds: float  # from admission to the last trajectory's end


@dataclass(frozen=True)
class Failed:
    traceback: str


def encode_buckets(buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[WeightBucket]:
    """One :class:`WeightBucket` per bucket, encoded when asked for."""
    for bucket in buckets:
        yield WeightBucket(encode_bucket(dict(bucket)))


def decode_buckets(buckets: Iterable[WeightBucket]) -> Iterator[dict[str, Any]]:
    """``{name: tensor}`` per bucket, decoded when asked for."""
    for bucket in buckets:
        yield dict(decode_bucket(bucket.items))
