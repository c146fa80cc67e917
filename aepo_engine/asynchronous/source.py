"""The asynchronous step source (``train.mode = "async"``): rollouts of later steps run while this step updates.

:meth:`AsynchronousSource.launch` starts the run's rollout process before the evaluation before RL;
the process's engine is the run's only one (the trainer builds none: its evaluations sample through
:class:`~aepo_engine.asynchronous.client.RemoteEngine`, after a push of the version they measure).
The trainer's step (:meth:`aepo_engine.train.Trainer.step`, the same as a synchronous run's: see
:mod:`aepo_engine.step_source`) takes its rollouts from here. With eta = ``train.max_staleness``:

    start:   push the weights (version = start step) unless the process holds them;
             order steps start .. start + eta (each: its prompts, admitted from version step - eta)
    collect: wait for step s's trajectories (the oldest first: steps are trained in order)
    publish: push the weights of version s + 1 (the process loads them while it samples);
             order step s + 1 + eta

so the engine samples up to eta steps ahead of the update and never more. Under torchrun (CPU: gloo)
every rank has a rollout process of its own that samples the rank's share of each step's prompts
(``EngineLayout.prompts``, as a synchronous step shares them); the trainer's step gathers the
scored trajectories in prompt order. eta = 0 orders step s only after the weights of version s are
pushed, on the same scheduler as a synchronous step (``rollout.schedule``): with "rounds" the
synchronous run, across two processes (the same trajectories and updates, bit for bit).

What a resumed run does with trajectories in flight: they are not checkpointed. A checkpoint after
step s holds the sampler's state before step s + 1 was drawn (:meth:`AsynchronousSource.resume_point`),
so a resumed run draws steps s + 1 .. s + 1 + eta again and samples them afresh with the
checkpoint's weights; what the old process had sampled for them is lost with it (the only place
trajectories are dropped).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from aepo_engine.asynchronous.client import RemoteEngine, RolloutProcess
from aepo_engine.asynchronous.messages import EngineCounters
from aepo_engine.asynchronous.staleness import admission_version
from aepo_engine.asynchronous.worker import WorkerSpec
from aepo_engine.config_loader import ConfigError
from aepo_engine.data import Example, PromptSampler
from aepo_engine.models.config import LoraConfig
from aepo_engine.placement import split_engine_devices
from aepo_engine.rollout.backends import EngineLayout
from aepo_engine.rollout.backends.config import BackendConfig
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.step_source import PolicyWeights, StepRollouts
from aepo_engine.tools.config import ToolsConfig

__all__ = ["AsynchronousSource", "cpu_thread_split", "worker_spec"]


def cpu_thread_split(cores: int, eta: int, torch_threads: int, cuda: bool) -> tuple[int, int]:
    """torch intra-op threads of (the trainer, the rollout process).

    With ``eta >= 1`` on CPU the two processes compute at the same time: sized for all ``cores``
    each, their OpenMP pools spin against each other (at zero search latency, 2 + 2 threads on 2
    cores made the update 5x and generation 7x slower than the synchronous run's,
    docs/async.md), so they split the cores, the trainer taking the larger half.
    ``train.torch_threads`` set (> 0) gives each process that many; ``eta = 0`` (the synchronous
    schedule: the processes take turns) and CUDA runs keep ``cores`` in both.
    """
    if torch_threads > 0:
        return torch_threads, torch_threads
    if eta == 0 or cuda or cores < 2:
        return cores, cores
    return cores - cores // 2, cores // 2


def worker_spec(backend: BackendConfig, rollout: RolloutConfig, tools: ToolsConfig, model_dir: str, seed: int,
                world: int, threads: int, lora: LoraConfig | None = None) -> WorkerSpec:
    """The rollout process of one trainer rank: its backend, rollout (the rank's own: its seed
    offset, ranks draw independently) and tools sections, model and seeds, its torch ``threads``,
    and with ``backend.placement = "split"`` on CUDA the engine's GPUs (``aepo_engine.placement``;
    ``world``: the trainer ranks)."""
    environment: tuple[tuple[str, str], ...] = ()
    if backend.placement == "split" and torch.cuda.is_available():
        devices = split_engine_devices(world, backend.rollout_gpus, backend.tensor_parallel_size)
        if len(devices) > 1:
            raise ConfigError(f"backend.rollout_gpus={backend.rollout_gpus} makes {len(devices)} engines: one "
                              "rollout process drives one engine today (several are not built: docs/async.md); use "
                              "rollout_gpus = tensor_parallel_size")
        environment = (("CUDA_VISIBLE_DEVICES", devices[0]),)
    return WorkerSpec(backend=backend, rollout=rollout, tools=tools, model_dir=model_dir, engine_seed=rollout.seed,
                      seed=seed, threads=threads, environment=environment, lora=lora)


class AsynchronousSource:
    """The step source of an asynchronous run (module docstring; the protocol:
    :class:`aepo_engine.step_source.StepSource`).

    Args:
        process: the running rollout process.
        tokenizer: the policy's tokenizer (the evaluations' :class:`RemoteEngine`).
        sampler, layout, encode: the run's prompt sampler, this rank's share of a step's prompts,
            a prompt's token ids.
        weights: the policy whose weights each publish pushes.
        bucket_bytes: the weight push's bucket size.
        max_staleness: eta.
        total_steps: the run's steps (none is ordered past them).
        threads: torch threads of (the trainer during the steps, the process's evaluations).
    """

    def __init__(self, process: RolloutProcess, tokenizer: Any, sampler: PromptSampler, layout: EngineLayout,
                 encode: Callable[[Example], list[int]], weights: PolicyWeights, *, bucket_bytes: int,
                 max_staleness: int, total_steps: int, threads: tuple[int, int]):
        self.process, self.sampler, self.layout, self.encode, self.weights = process, sampler, layout, encode, weights
        self.bucket_bytes, self.eta, self.total_steps = bucket_bytes, max_staleness, total_steps
        self.trainer_threads, self.cores = threads
        self.engine = RemoteEngine(process, tokenizer, threads=self.cores)
        self._examples: dict[int, list[Example]] = {}
        self._shares: dict[int, list[int]] = {}  # step -> the indices of its prompts this rank's process samples
        self._sampler_states: dict[int, dict] = {}  # step -> the sampler's state before its draw
        self._resume_point: dict[str, Any] | None = None
        self._counters = EngineCounters()  # the process's counters at the last publish (the first
        # step's metrics count everything the process did before it, the evaluation before RL included)
        self._first = 0  # the first step this run trains

    @classmethod
    def launch(cls, spec: WorkerSpec, *, torch_threads: int, **parts: Any) -> "AsynchronousSource":
        """Start the rollout process ``spec`` describes (its torch threads: :func:`cpu_thread_split`'s
        share; ``torch_threads``: ``train.torch_threads``) and its source (``parts``: the
        constructor's other arguments). The evaluations sample with every core the trainer has: it
        waits meanwhile."""
        cores = torch.get_num_threads()
        eta = parts["max_staleness"]
        mine, theirs = cpu_thread_split(cores, eta, torch_threads, torch.cuda.is_available())
        process = RolloutProcess(dataclasses.replace(spec, threads=theirs, max_staleness=eta))
        rounds = spec.rollout.resolved_schedule(eta) == "rounds"
        tools = "rounds wait for their tool calls" if rounds else "tool calls in the background"
        print(f"[async] rollout process {process.pid}: max staleness {eta}, {tools}; "
              f"torch threads: trainer {mine}, rollout process {theirs} (its evaluations {cores}); "
              "the run's only engine", flush=True)
        return cls(process, threads=(mine, cores), **parts)

    def _push(self, version: int) -> float:
        """Push the policy's weights as ``version`` (gathered in the engine's dtype, a bucket at a time;
        collective under torchrun: every rank pushes into its own process). Returns seconds."""
        return self.process.push_weights(version, self.weights.iter_weight_buckets(
            self.bucket_bytes, dtype=self.process.weight_dtype))

    def _order(self, step: int, first: int) -> None:
        self._sampler_states[step] = self.sampler.state_dict()  # before the step's draw: a checkpoint's resume point
        self._examples[step] = self.sampler.next_batch()  # every rank draws the whole step, as a synchronous run
        self._shares[step] = self.layout.prompts(len(self._examples[step]))
        if self._shares[step]:
            self.process.order(step, [self.encode(self._examples[step][i]) for i in self._shares[step]],
                               admission_version(step, self.eta, first))

    def start(self, version: int) -> None:
        self._first = version
        torch.set_num_threads(self.trainer_threads)
        if self.process.pushed != version:
            self._push(version)
        for step in range(version, min(version + self.eta + 1, self.total_steps)):
            self._order(step, version)

    def collect(self, step: int) -> StepRollouts:
        t0 = time.perf_counter()
        indices, examples = self._shares.pop(step), self._examples.pop(step)
        done = self.process.take(step) if indices else None
        waited = time.perf_counter() - t0
        for traj in done.trajectories if done else ():
            traj.prompt_index = indices[traj.prompt_index]  # the step-global group id
        return StepRollouts(examples, done.trajectories if done else [], done.stats if done else None,
                            rollout_s=done.seconds if done else 0.0, waited_s=waited)

    def before_update(self) -> None:
        """Nothing: the process samples on while the trainer updates."""

    def publish(self, version: int) -> dict[str, float]:
        push_s = self._push(version)
        metrics = {"time/weight_push_s": push_s, "engine/push_bytes": float(self.weights.pushed_bytes)}
        if version + self.eta < self.total_steps:
            self._order(version + self.eta, self._first)
        self._resume_point = self._sampler_states.pop(version, None) or self.sampler.state_dict()
        metrics.update(_engine_metrics(self.process.counters, self._counters))
        self._counters = self.process.counters
        return metrics

    def prepare_evaluation(self, version: int) -> None:
        if self.process.pushed != version:
            self._push(version)
        self.engine.version = version

    def resume_point(self) -> dict[str, Any]:
        return self._resume_point if self._resume_point is not None else self.sampler.state_dict()

    def stop(self) -> None:
        """Steps in flight are abandoned; the trainer's threads go back to every core (the
        evaluations after the steps run in the process, the trainer waits)."""
        torch.set_num_threads(self.cores)

    def close(self) -> None:
        self.process.close()


def _engine_metrics(now: EngineCounters, before: EngineCounters) -> dict[str, float]:
    """What the rollout process did between two publishes."""
    out = {f"engine/{name}": getattr(now, name) - getattr(before, name)
           for name in ("generate_s", "tool_wait_s", "idle_s", "weight_load_s", "weight_receive_s", "aborts",
                        "serve_s")}
    out["engine/version"] = float(now.version)
    out["engine/tokens"] = float(sum(now.tokens_by_version.values()) - sum(before.tokens_by_version.values()))
    return out
