"""The trainer's handle on the rollout process: start it, push weights, order steps, take results,
and sample with its engine (:class:`RemoteEngine`: an asynchronous run's evaluations).

The process is started with ``multiprocessing``'s spawn method (a fresh interpreter: no torch or
thread state inherited from the trainer) and is not a daemon, because its tools and engine start
processes of their own; :meth:`RolloutProcess.close` stops it (and ``with`` does).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import time
from typing import Any, Iterable, Mapping, Sequence

import torch

from aepo_engine.asynchronous.messages import (EngineCounters, Failed, Generate, Generated, Order, Ready, StepDone,
                                               Stop, WeightsBegin, WeightsEnd, WeightsReceived, encode_buckets)
from aepo_engine.asynchronous.worker import WorkerSpec, worker_main
from aepo_engine.rollout.protocol import Capabilities, CapabilityAliases, GenOutput, GenRequest

__all__ = ["RemoteEngine", "RolloutProcess", "RolloutProcessDied"]


class RolloutProcessDied(RuntimeError):
    """The rollout process failed (its traceback is in the message) or vanished."""


class RolloutProcess:
    """A running rollout process (:mod:`aepo_engine.asynchronous.worker`).

    Args:
        spec: what it builds.
        start_timeout_s: how long building the engine and tools may take.
    Raises:
        RolloutProcessDied: it failed while starting.
    """

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 900.0):
        context = multiprocessing.get_context("spawn")
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(target=worker_main, args=(spec, self.inbox, self.outbox),
                                       name="aepo-rollout", daemon=False)
        self.process.start()
        self._done: dict[int, StepDone] = {}
        # the rollout process's counters in the newest message received: steps may end out of order
        # (a later step's short prompts before an earlier one's), so a step's own are not the newest
        self.counters = EngineCounters()
        self.push_s = 0.0  # seconds the trainer spent handing weights to the queue (and waiting to)
        self._in_flight: int | None = None  # a pushed version the rollout process has not received yet
        self.pushed: int | None = None  # the newest version pushed
        self._generated: dict[int, Generated] = {}
        self._requests = 0
        try:
            message = self._receive(start_timeout_s)
            if not isinstance(message, Ready):
                raise RolloutProcessDied(f"the rollout process sent {type(message).__name__} before it was ready")
            self.pid = message.pid
            self.ready = message  # the engine's weight dtype, capabilities, eos ids
        except BaseException:
            self.close()
            raise

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The engine's weight dtype: pushes are gathered in it (None: as they are)."""
        return self.ready.weight_dtype

    # -- trainer -> rollout process ------------------------------------------------------------

    def push_weights(self, version: int, buckets: Iterable[Mapping[str, torch.Tensor]]) -> float:
        """Send the weights of policy ``version`` (a bucket at a time, as bytes; the call returns
        once they are queued, the queue writes them while the trainer goes on). At most one
        version is on its way: a push first waits until the rollout process has received the
        previous one (a slow reader cannot pile versions up in the queue's buffer). Gather the
        buckets in :attr:`weight_dtype`. Returns seconds."""
        start = time.perf_counter()
        while self._in_flight is not None:
            self._handle(self._receive(None))
        self.inbox.put(WeightsBegin(version))
        for bucket in encode_buckets(buckets):
            self.inbox.put(bucket)
        self.inbox.put(WeightsEnd(version))
        self._in_flight = self.pushed = version
        seconds = time.perf_counter() - start
        self.push_s += seconds
        return seconds

    def order(self, step: int, prompts: list[list[int]], min_version: int) -> None:
        """Have step ``step``'s prompts started once the engine holds weights of ``min_version`` or later."""
        self.inbox.put(Order(step, prompts, min_version))

    def generate(self, requests: Sequence[GenRequest], min_version: int, threads: int = 0) -> list[GenOutput]:
        """Sample ``requests`` with the process's engine once it holds ``min_version`` (it answers
        before its next rollout round; ``threads``: its torch threads meanwhile, 0 = its own)."""
        self._requests += 1
        request_id = self._requests
        self.inbox.put(Generate(request_id, list(requests), min_version, threads))
        while request_id not in self._generated:
            self._handle(self._receive(None))
        return self._generated.pop(request_id).outputs

    # -- rollout process -> trainer ------------------------------------------------------------

    def take(self, step: int, timeout_s: float | None = None) -> StepDone:
        """Wait for step ``step``'s trajectories (those of other steps that come first are kept).

        Raises:
            RolloutProcessDied: the process failed or exited.
            TimeoutError: nothing for ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while step not in self._done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no trajectories for step {step} within {timeout_s}s")
            self._handle(self._receive(left))
        return self._done.pop(step)

    def _handle(self, message) -> None:
        """Keep a step's trajectories; note a push's receipt."""
        if isinstance(message, StepDone):
            self._done[message.step] = message
            self.counters = message.counters
        elif isinstance(message, WeightsReceived) and message.version == self._in_flight:
            self._in_flight = None
        elif isinstance(message, Generated):
            self._generated[message.request_id] = message

    def _receive(self, timeout_s: float | None):
        """The next message; raises if the process failed or died meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                message = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RolloutProcessDied(f"the rollout process exited (code {self.process.exitcode}) "
                                             "without a word; see its output above") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the rollout process sent nothing within {timeout_s}s") from None
                continue
            if isinstance(message, Failed):
                raise RolloutProcessDied(f"the rollout process failed:\n{message.traceback}")
            return message

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the process (it finishes its current round first); kill it if it does not stop."""
        if self.process.is_alive():
            self.inbox.put(Stop())
            deadline = time.monotonic() + timeout_s
            while self.process.is_alive() and time.monotonic() < deadline:
                try:  # drain: a process exits only once what it queued has gone into the pipe
                    self.outbox.get(timeout=0.2)
                except queue.Empty:
                    pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.inbox, self.outbox):
            q.cancel_join_thread()  # do not block exit on buckets nobody will read
            q.close()

    def __enter__(self) -> "RolloutProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteEngine(CapabilityAliases):
    """A generation backend (``aepo_engine.rollout.protocol``) that samples with a rollout process's
    engine: an asynchronous run's trainer evaluates through it instead of starting a second engine
    beside the process's (on a GPU that second one would not fit vLLM's start-up check, and the
    placement plans one engine: GPU review 2, point 3). Its requests wait for the weights of
    :attr:`version`, which the trainer sets (and pushes) before it evaluates; weights reach the
    engine only through :meth:`RolloutProcess.push_weights`.

    Args:
        process: the running rollout process.
        tokenizer: the trainer's tokenizer (the engine's model's).
        threads: the process's torch threads while it samples these (0: its own); on CPU the
            trainer only waits meanwhile, so it may take every core.
    Attributes:
        capabilities: the engine's (``Ready``), less those whose methods this handle does not
            have: abort, sleep and group (the rollout process's loop uses them, not the trainer).
    """

    def __init__(self, process: RolloutProcess, tokenizer: Any, threads: int = 0):
        self.process, self.tokenizer, self.threads = process, tokenizer, threads
        self.capabilities: Capabilities = dataclasses.replace(process.ready.capabilities, abort=False, sleep=False,
                                                              group=False)
        self.version = 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.process.ready.eos_token_ids

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The engine's (pushes go through :meth:`RolloutProcess.push_weights`, gathered in it)."""
        return self.process.weight_dtype

    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        return self.process.generate(requests, self.version, self.threads)
