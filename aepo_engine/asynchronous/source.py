"""The trainer's side of ``train.mode = "async"``: rollouts of later steps run while this step updates.

:func:`start_rollout_process` starts the run's rollout process before the evaluation before RL; the
process's engine is the run's only one (the trainer builds none: its evaluations sample through
:class:`~aepo_engine.asynchronous.client.RemoteEngine`, after :func:`push_weights` of the version they
measure). :func:`async_steps` is what :meth:`aepo_engine.train.Trainer.run` iterates instead of its
synchronous steps. With eta = ``train.max_staleness``:

    push the weights (version = start step) unless the process holds them
    order steps start .. start + eta (each: its prompts, admitted from version step - eta)
    for each step s:
        wait for step s's trajectories (the oldest first: steps are trained in order)
        score them, learn (Trainer.learn: proximal log-probs, decoupled correction, update)
        push the weights of version s + 1 (the process loads them while it samples)
        order step s + 1 + eta

so the engine samples up to eta steps ahead of the update and never more. Under torchrun (CPU: gloo)
every rank has a rollout process of its own that samples the rank's share of each step's prompts
(``EngineLayout.prompts``, as a synchronous step shares them), the scored trajectories are
all-gathered in prompt order, the FSDP update is the ranks' collective, and each rank pushes the
gathered weights into its own process. eta = 0 orders step s
only after the weights of version s are pushed, with rounds that wait for their tool calls: the
synchronous loop, run across two processes (the same trajectories and updates, bit for bit).

What a resumed run does with trajectories in flight: they are not checkpointed. A checkpoint after
step s holds the sampler's state before step s + 1 was drawn, so a resumed run draws steps s + 1 ..
s + 1 + eta again and samples them afresh with the checkpoint's weights; what the old process had
sampled for them is lost with it (the only place trajectories are dropped).
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from aepo_engine import distributed
from aepo_engine.asynchronous.client import RemoteEngine, RolloutProcess
from aepo_engine.asynchronous.messages import EngineCounters
from aepo_engine.asynchronous.staleness import admission_version
from aepo_engine.asynchronous.worker import WorkerSpec
from aepo_engine.config_loader import ConfigError
from aepo_engine.placement import engine_devices

__all__ = ["async_steps", "cpu_thread_split", "push_weights", "start_rollout_process", "worker_spec"]


def cpu_thread_split(cores: int, eta: int, torch_threads: int, cuda: bool) -> tuple[int, int]:
    """torch intra-op threads of (the trainer, the rollout process).

    With ``eta >= 1`` on CPU the two processes compute at the same time: sized for all ``cores``
    each, their OpenMP pools spin against each other (at zero search latency, 2 + 2 threads on 2
    cores made the update 5x and generation 7x slower than the synchronous run's,
    docs/async.md), so they split the cores, the trainer taking the larger half.
    ``train.torch_threads`` set (> 0) gives each process that many; ``eta = 0`` (the synchronous
    loop: the processes take turns) and CUDA runs keep ``cores`` in both.
    """
    if torch_threads > 0:
        return torch_threads, torch_threads
    if eta == 0 or cuda or cores < 2:
        return cores, cores
    return cores - cores // 2, cores // 2


def worker_spec(trainer: Any, threads: int | None = None) -> WorkerSpec:
    """The rollout process of ``trainer``'s run: its backend, rollout and tools sections, model and
    seeds, its torch threads (``threads``; none: this process's), and with ``backend.placement =
    "split"`` on CUDA the engine's GPUs (``aepo_engine.placement``)."""
    cfg = trainer.cfg
    environment: tuple[tuple[str, str], ...] = ()
    if cfg.backend.placement == "split" and torch.cuda.is_available():
        devices = engine_devices(trainer.world, cfg.backend.rollout_gpus, cfg.backend.tensor_parallel_size)
        if len(devices) > 1:
            raise ConfigError(f"backend.rollout_gpus={cfg.backend.rollout_gpus} makes {len(devices)} engines: one "
                              "rollout process drives one engine today (several are not built: docs/async.md); use "
                              "rollout_gpus = tensor_parallel_size")
        environment = (("CUDA_VISIBLE_DEVICES", devices[0]),)
    rollout = trainer.rollout.config  # the rank's own (its seed offset: ranks draw independently)
    return WorkerSpec(backend=cfg.backend, rollout=rollout, tools=trainer.tools_config,
                      model_dir=str(trainer.model_dir), engine_seed=rollout.seed, seed=cfg.seed,
                      threads=torch.get_num_threads() if threads is None else threads,
                      tool_barrier=cfg.train.max_staleness == 0,
                      environment=environment, lora=cfg.policy.lora)


def start_rollout_process(trainer: Any) -> tuple[RolloutProcess, RemoteEngine]:
    """Start ``trainer``'s rollout process (its torch threads: :func:`cpu_thread_split`'s share) and
    the handle the trainer evaluates through (sampling with every core the trainer has: it waits
    meanwhile)."""
    cores = torch.get_num_threads()
    eta = trainer.cfg.train.max_staleness
    mine, theirs = cpu_thread_split(cores, eta, trainer.cfg.train.torch_threads, torch.cuda.is_available())
    process = RolloutProcess(worker_spec(trainer, theirs))
    print(f"[async] rollout process {process.pid}: max staleness {eta}, "
          f"{'rounds wait for their tool calls' if eta == 0 else 'tool calls in the background'}; "
          f"torch threads: trainer {mine}, rollout process {theirs} (its evaluations {cores}); "
          "the run's only engine", flush=True)
    return process, RemoteEngine(process, trainer.tokenizer, threads=cores)


def push_weights(trainer: Any, process: RolloutProcess, version: int) -> float:
    """Push the policy's weights as ``version`` (gathered in the engine's dtype, a bucket at a time;
    collective under torchrun: every rank pushes into its own process). Returns seconds."""
    bucket_bytes = int(trainer.cfg.backend.weight_sync_bucket_mb * 2**20)
    return process.push_weights(version, trainer.policy.iter_weight_buckets(bucket_bytes, dtype=process.weight_dtype))


def async_steps(trainer: Any, process: RolloutProcess, start: int) -> Iterator[dict[str, Any]]:
    """Run steps ``start .. trainer.total_steps - 1`` asynchronously with ``process``
    (:func:`start_rollout_process`); yields each step's metrics (module docstring). The process
    outlives the generator: the trainer evaluates through it after the last step, then closes it."""
    eta, total = trainer.cfg.train.max_staleness, trainer.total_steps
    examples: dict[int, list] = {}
    sampler_states: dict[int, dict] = {}

    shares: dict[int, list[int]] = {}  # step -> the indices of its prompts this rank's process samples

    def order(step: int) -> None:
        sampler_states[step] = trainer.sampler.state_dict()  # before the step's draw: a checkpoint's resume point
        examples[step] = trainer.sampler.next_batch()  # every rank draws the whole step, as a synchronous run
        shares[step] = trainer.layout.prompts(len(examples[step]))
        if shares[step]:
            process.order(step, [trainer.prompt_ids(examples[step][i]) for i in shares[step]],
                          admission_version(step, eta, start))

    cores = torch.get_num_threads()
    mine, _ = cpu_thread_split(cores, eta, trainer.cfg.train.torch_threads, torch.cuda.is_available())
    torch.set_num_threads(mine)
    try:
        if process.pushed != start:
            push_weights(trainer, process, start)
        for step in range(start, min(start + eta + 1, total)):
            order(step)
        before = EngineCounters()
        for step in range(start, total):
            t0 = time.perf_counter()
            indices, prompts = shares.pop(step), examples.pop(step)
            done = process.take(step) if indices else None
            waited = time.perf_counter() - t0
            for traj in done.trajectories if done else ():
                traj.prompt_index = indices[traj.prompt_index]  # the step-global group id
            scored = trainer.score(done.trajectories, prompts) if done else []
            # under torchrun, each rank's process sampled its share: the batch is gathered in prompt
            # order, as the synchronous step's (one process: the identity)
            t_ranks = time.perf_counter()
            gathered = distributed.all_gather_objects((scored, done.stats if done else None), "the step's rollouts")
            waited_ranks = time.perf_counter() - t_ranks
            everything = sorted((s for part, _ in gathered for s in part), key=lambda s: (s[0].prompt_index, s[0].traj_id))
            stats = [st for _, st in gathered if st is not None]
            metrics = trainer.learn(step, prompts, *([s[i] for s in everything] for i in range(4)), stats)
            push_s, pushed = 0.0, 0
            if step + 1 < total:
                push_s = push_weights(trainer, process, step + 1)
                pushed = trainer.policy.pushed_bytes
            if step + 1 + eta < total:
                order(step + 1 + eta)
            trainer.resume_sampler_state = sampler_states.pop(step + 1, None) or trainer.sampler.state_dict()
            elapsed = time.perf_counter() - t0
            tokens = float(sum(len(s[0].response_ids) for s in everything))
            metrics.update({"time/wait_for_rollouts_s": waited, "time/weight_push_s": push_s, "time/step_s": elapsed,
                            "engine/push_bytes": float(pushed),
                            "time/rollout_s": done.seconds if done else 0.0, "time/wait_for_ranks": waited_ranks,
                            "throughput/tokens_per_s": tokens / elapsed, **_engine_metrics(process.counters, before)})
            before = process.counters
            yield metrics
    finally:
        torch.set_num_threads(cores)


def _engine_metrics(now: EngineCounters, before: EngineCounters) -> dict[str, float]:
    """What the rollout process did between two steps' results."""
    out = {f"engine/{name}": getattr(now, name) - getattr(before, name)
           for name in ("generate_s", "tool_wait_s", "idle_s", "weight_load_s", "weight_receive_s", "aborts",
                        "serve_s")}
    out["engine/version"] = float(now.version)
    out["engine/tokens"] = float(sum(now.tokens_by_version.values()) - sum(before.tokens_by_version.values()))
    return out

