"""The rollout process of asynchronous training: an engine that never waits for the update.

:func:`worker_main` runs in a process of its own (``multiprocessing`` spawn, started by
:class:`aepo_engine.asynchronous.client.RolloutProcess`). It builds the generation backend, the tools
and a :class:`~aepo_engine.rollout.continuous.ContinuousRollout`, then loops:

1. new weights fully received (a reader thread takes the pushed buckets while the loop samples)?
   Load them; from then on tokens record the new version. While they arrive, the backend's
   ``abort`` event is set once the last bucket is in, so a segment being sampled is cut at its next
   token and continued under the new weights (partial rollouts), never dropped;
2. answer the trainer's own requests (:class:`Generate`, its evaluations) whose version the engine
   holds, before the next round: the trainer builds no engine of its own;
3. start every ordered step whose ``min_version`` the engine holds (admission control);
4. one round over the oldest ready trajectories; tool calls run in the background;
5. send every step whose trajectories have all ended (:class:`StepDone`);
6. nothing to sample: wait for a tool result, or, with no tool call in flight, for the trainer.

It stops on :class:`Stop`, and by itself when the trainer process is gone (killed: its queue
closes, its process sentinel fires), so a killed run leaves no engine behind.

The time of each part is counted (:class:`EngineCounters`). A failure is sent as :class:`Failed`
with its traceback before the process exits.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aepo_engine.asynchronous.messages import (EngineCounters, Failed, Generate, Generated, Order, Ready, StepDone,
                                               Stop, WeightBucket, WeightsBegin, WeightsEnd, WeightsReceived,
                                               decode_buckets)
from aepo_engine.rollout.backends import BackendConfig, build_backend
from aepo_engine.models.config import LoraConfig
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.continuous import ContinuousRollout
from aepo_engine.tools import ToolRunner, build_tools
from aepo_engine.tools.config import ToolsConfig
from aepo_engine.tools.formats import build_tool_format

__all__ = ["RENDEZVOUS_VARIABLES", "WorkerSpec", "own_environment", "worker_main"]

_POLL_S = 0.05  # how long a wait on tools lasts before the loop looks for weights and orders again


@dataclass(frozen=True)
class WorkerSpec:
    """What the rollout process is built from (picklable).

    Attributes:
        backend, rollout, tools: the run's sections (the rollout's seed is the run's: a step's
            seeds are those a synchronous run gives it).
        model_dir: the model the engine starts from (weights are pushed before any order).
        engine_seed: the engine's own seed (vLLM); per-request seeds come from the rollout.
        seed: python/numpy/torch seed of the process.
        threads: torch intra-op threads.
        environment: variables set before anything is built (e.g. ``CUDA_VISIBLE_DEVICES`` of the
            engine's GPUs).
        lora: the policy's adapters (``policy.lora``): with them enabled the engine takes adapter pushes.
        max_staleness: ``train.max_staleness`` (``rollout.schedule = "auto"`` resolves by it).
    """

    backend: BackendConfig
    rollout: RolloutConfig
    tools: ToolsConfig
    model_dir: str
    engine_seed: int
    seed: int
    threads: int
    environment: tuple[tuple[str, str], ...] = ()
    lora: LoraConfig | None = None
    max_staleness: int = 0


# What torchrun gives each rank to find the others (torch.distributed.run, torchelastic). A spawned
# process inherits them; the rollout process is no rank of the trainer's world, and vLLM's
# in-process engine (external launcher) or any init_process_group in it would rendezvous at the
# trainer's MASTER_PORT as the trainer's rank: EADDRINUSE, or a hang in the trainer's store.
RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                        "TORCHELASTIC_USE_AGENT_STORE")


def own_environment(environment: tuple[tuple[str, str], ...] = ()) -> None:
    """Make this process a world of its own: drop the trainer's rendezvous variables
    (:data:`RENDEZVOUS_VARIABLES`; an engine that needs a world then makes one of one on a free
    port, ``backends.vllm``), then set ``environment`` (the spec's, e.g. ``CUDA_VISIBLE_DEVICES``)."""
    for name in RENDEZVOUS_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(dict(environment))


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any) -> None:
    """The rollout process (module docstring); ``inbox``/``outbox`` are ``multiprocessing`` queues."""
    own_environment(spec.environment)
    tools = None
    try:
        torch.set_num_threads(spec.threads)
        random.seed(spec.seed)
        np.random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        # the engine before the tools: a vLLM engine must start before the search index loads numba
        backend = build_backend(spec.backend, spec.model_dir, tokenizer, seed=spec.engine_seed, lora=spec.lora)
        tools = ToolRunner(build_tools(spec.tools), max_workers=spec.tools.max_workers)
        tool_format = build_tool_format(spec.tools.format, tokenizer, spec.tools.enabled)  # as the trainer's
        rollout = ContinuousRollout.for_schedule(backend, tools, spec.rollout, spec.max_staleness,
                                                 tokenizer=tokenizer, tool_format=tool_format)
        outbox.put(Ready(os.getpid(), backend.weight_dtype, capabilities=backend.capabilities,
                         eos_token_ids=tuple(backend.eos_token_ids)))
        _EngineLoop(rollout, backend, inbox, outbox).run()
    except BaseException:  # noqa: BLE001 - the trainer must hear of any failure
        outbox.put(Failed(traceback.format_exc()))
        raise
    finally:
        if tools is not None:
            tools.close()


class _Inbox(threading.Thread):
    """Reads the trainer's messages while the loop samples: orders, weight buckets (kept until their
    push is complete), the trainer's own requests, stop."""

    def __init__(self, inbox: Any, abort: threading.Event, wake: threading.Event, counters: EngineCounters,
                 outbox: Any = None):
        super().__init__(name="aepo-rollout-inbox", daemon=True)
        self.inbox, self.abort, self.wake, self.counters, self.outbox = inbox, abort, wake, counters, outbox
        self.lock = threading.Lock()
        self.orders: list[Order] = []
        self.requests: list[Generate] = []
        self.staged: tuple[int, list[WeightBucket]] | None = None  # the newest complete push
        self.stopped = False

    def run(self) -> None:
        buckets: list[WeightBucket] = []
        started = 0.0
        while True:
            try:
                message = self.inbox.get()
            except (EOFError, OSError):  # the trainer is gone (killed): stop
                message = Stop()
            if isinstance(message, WeightsBegin):
                buckets, started = [], time.perf_counter()
            elif isinstance(message, WeightBucket):
                buckets.append(message)
            elif isinstance(message, WeightsEnd):
                with self.lock:
                    self.staged = (message.version, buckets)  # a newer push replaces an unloaded one
                    self.counters.weight_receive_s += time.perf_counter() - started
                buckets = []
                if self.outbox is not None:  # the trainer may send the next version now
                    self.outbox.put(WeightsReceived(message.version))
                self.abort.set()  # cut the segments being sampled: they go on under the new weights
            elif isinstance(message, Order):
                with self.lock:
                    self.orders.append(message)
            elif isinstance(message, Generate):
                with self.lock:
                    self.requests.append(message)
            elif isinstance(message, Stop):
                self.stopped = True
                self.abort.set()
                self.wake.set()
                return
            self.wake.set()

    def take_weights(self) -> tuple[int, list[WeightBucket]] | None:
        with self.lock:
            staged, self.staged = self.staged, None
            return staged

    def take_orders(self, version: int) -> list[Order]:
        """Orders whose ``min_version`` the engine holds, in the order they came."""
        with self.lock:
            due = [o for o in self.orders if o.min_version <= version]
            self.orders = [o for o in self.orders if o.min_version > version]
            return due

    def take_requests(self, version: int) -> list[Generate]:
        """The trainer's requests whose ``min_version`` the engine holds, in the order they came."""
        with self.lock:
            due = [r for r in self.requests if r.min_version <= version]
            self.requests = [r for r in self.requests if r.min_version > version]
            return due


class _EngineLoop:
    def __init__(self, rollout: ContinuousRollout, backend: Any, inbox: Any, outbox: Any):
        self.rollout, self.backend, self.outbox = rollout, backend, outbox
        self.counters = EngineCounters(version=-1)
        self.abort, self.wake = threading.Event(), threading.Event()
        self.inbox = _Inbox(inbox, self.abort, self.wake, self.counters, outbox)
        self.admitted: dict[int, float] = {}  # step -> when it was admitted

    def run(self) -> None:
        self.inbox.start()
        parent = multiprocessing.parent_process()
        while not self.inbox.stopped and (parent is None or parent.is_alive()):
            self._load_weights()
            for request in self.inbox.take_requests(self.counters.version):
                self._serve(request)
            for order in self.inbox.take_orders(self.counters.version):
                self.rollout.admit(order.prompts, order.step)
                self.admitted[order.step] = time.perf_counter()
            if self.abort.is_set() and self.inbox.staged is None:
                self.abort.clear()  # set by a push loaded above, or by stop
            tokens = self.rollout.tokens_sampled
            sampled = self.rollout.round(self.abort if self.backend.capabilities.abort else None)
            self._count_tokens(self.rollout.tokens_sampled - tokens)
            for step, result in self.rollout.finished():
                self.outbox.put(StepDone(step, result.trajectories, result.stats, _copy(self.counters),
                                         time.perf_counter() - self.admitted.pop(step)))
            if sampled:
                continue
            start = time.perf_counter()
            if self.rollout.waiting_on_tools:
                self.rollout.take_tool_results(wait_s=_POLL_S)
                self.counters.tool_wait_s += time.perf_counter() - start
            else:  # nothing admitted is left to sample: wait for an order or weights
                self.wake.wait(timeout=1.0)
                self.wake.clear()
                self.counters.idle_s += time.perf_counter() - start

    def _serve(self, request: Generate) -> None:
        """Sample the trainer's requests with the engine as it is (no abort: a push waits for them)."""
        start, threads = time.perf_counter(), torch.get_num_threads()
        if request.threads:
            torch.set_num_threads(request.threads)  # on CPU the trainer waits meanwhile: its cores too
        try:
            outputs = self.backend.generate(request.requests)
        finally:
            torch.set_num_threads(threads)
        self.counters.serve_s += time.perf_counter() - start
        self.outbox.put(Generated(request.request_id, outputs))

    def _load_weights(self) -> None:
        staged = self.inbox.take_weights()
        if staged is None:
            return
        version, buckets = staged
        start = time.perf_counter()
        self.backend.load_weight_buckets(decode_buckets(buckets))
        self.counters.weight_load_s += time.perf_counter() - start
        self.counters.version = self.rollout.policy_version = version
        self.counters.aborts += self.rollout.cut_segments

    def _count_tokens(self, count: int) -> None:
        if count:
            by_version = self.counters.tokens_by_version
            by_version[self.counters.version] = by_version.get(self.counters.version, 0) + count
        self.counters.generate_s = self.rollout.generate_s


def _copy(counters: EngineCounters) -> EngineCounters:
    return EngineCounters(**{**counters.__dict__, "tokens_by_version": dict(counters.tokens_by_version)})
