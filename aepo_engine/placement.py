"""Engines on some GPUs, the trainer on the others (``backend.placement = "split"``): which GPUs each
role gets, and the memory plan of each role.

On a node of G GPUs with ``backend.rollout_gpus = E``, the trainer's T = G - E ranks take the first
T GPUs (torchrun's local ranks) and the E others hold ``E / tensor_parallel_size`` engines, each on
``tensor_parallel_size`` consecutive GPUs of its own (:func:`split_engine_devices`). Rollouts never
wait for the update (``train.mode = "async"``), so neither role makes room for the other: there is
no sleeping engine and no phase where both share a GPU.

Memory per role (:func:`plan_placement`), from the model's ``config.json`` and the run's config:

- **trainer GPU**: :func:`aepo_engine.memory_plan.plan_memory` over the T trainer ranks with the
  engine terms at 0 (no engine on these GPUs) and the phases of an update; the weight push gathers
  one bucket at a time (its fp32 gather on the GPU, its bytes through host memory).
- **engine GPU**: the engine's weights in its dtype (``2 P / tensor_parallel_size`` for bf16), its KV
  cache (``backend.kv_cache_gib``, else :func:`aepo_engine.memory_plan.engine_kv_cache`: what
  ``gpu_memory_utilization`` leaves after the weights, vLLM's profiling peak and the memory outside
  torch, the colocated plan's arithmetic), one pushed bucket being loaded; and how many tokens that cache holds
  against the most the run can have in flight: ``(eta + 1) x prompts_per_step x k`` trajectories
  of at most ``max_prompt_tokens + max_response_tokens`` tokens, over the engines (vLLM queues what
  does not fit; the plan says when it would).

What has run: the arithmetic and the checks, on CPU (``tests/test_placement.py``). Nothing of this
placement has run on a GPU: on GPUs the asynchronous loop runs one trainer process with one
rollout process (several trainer ranks beside rollout processes run on CPU only; several engines
fed by one trainer are not built), and the vLLM/CUDA terms are the memory plan's assumptions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from aepo_engine.memory_plan import (VLLM_NON_TORCH, MemoryPlan, ModelShape, Term, engine_dtype_bytes,
                                     engine_kv_cache, plan_memory)

__all__ = ["PlacementPlan", "plan_placement", "split_engine_devices"]

_ENGINE_TERMS = ("vllm_awake", "vllm_idle", "vllm_weights")


def split_engine_devices(trainer_ranks: int, rollout_gpus: int, tensor_parallel_size: int,
                         visible: str | None = None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each engine of a node: the GPUs after the trainer's ``trainer_ranks``,
    ``tensor_parallel_size`` consecutive ones per engine, mapped through the job's own
    ``CUDA_VISIBLE_DEVICES`` (``visible``; default: the environment's).

    Raises:
        ValueError: the engines' GPUs are not a multiple of their size, or the job sees too few.
    """
    if rollout_gpus < 1 or rollout_gpus % tensor_parallel_size:
        raise ValueError(f"rollout_gpus={rollout_gpus} must be a positive multiple of tensor_parallel_size="
                         f"{tensor_parallel_size}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    names = visible.split(",") if visible else None
    needed = trainer_ranks + rollout_gpus
    if names is not None and len(names) < needed:
        raise ValueError(f"{trainer_ranks} trainer ranks + {rollout_gpus} engine GPUs need {needed} GPUs; "
                         f"CUDA_VISIBLE_DEVICES lists {len(names)}")
    first = trainer_ranks
    return [",".join(names[i] if names else str(i) for i in range(start, start + tensor_parallel_size))
            for start in range(first, first + rollout_gpus, tensor_parallel_size)]


@dataclass
class PlacementPlan:
    """The memory plan of a trainer GPU and of an engine GPU, and the engines' in-flight capacity."""

    trainer: MemoryPlan
    engine: MemoryPlan
    engines: int
    kv_tokens: int  # tokens one engine's cache holds
    in_flight_tokens: int  # the most tokens one engine may have to hold (every admitted trajectory at full length)

    @property
    def fits(self) -> bool:
        return self.trainer.fits and self.engine.fits and self.kv_tokens > 0

    def lines(self) -> list[str]:
        out = [f"placement: split, {self.trainer.world} trainer GPUs + {self.engines} engine(s) of "
               f"{self.engine.world} GPU(s)", "trainer GPU:"]
        out += ["  " + line for line in self.trainer.lines()]
        out.append("engine GPU:")
        out += ["  " + line for line in self.engine.lines()]
        share = self.in_flight_tokens / max(self.kv_tokens, 1)
        out.append(f"  KV cache: {self.kv_tokens:,} tokens per engine; at most {self.in_flight_tokens:,} in flight "
                   f"(every admitted trajectory at full length): {share:.0%} of it"
                   + ("" if share <= 1 else " (vLLM queues the rest: fewer in flight than admitted)"))
        return out


def plan_placement(cfg: Any, shape: ModelShape, trainer_world: int, gpu: int = 0,
                   gpu_name: str = "") -> PlacementPlan:
    """The split placement's memory plans (module docstring).

    Args:
        cfg: a resolved ``TrainConfig`` with ``backend.placement = "split"``.
        shape: the model's shapes.
        trainer_world: trainer ranks (all nodes); the engines are ``rollout_gpus`` per node.
        gpu: bytes of one GPU (0: terms only).
        gpu_name: the ``--gpu`` name (for the trainer's plan, as plan_memory).
    """
    backend = cfg.backend
    tp = backend.tensor_parallel_size
    trainer = plan_memory(cfg, shape, trainer_world, gpu, cuda=True, gpu_name=gpu_name)
    trainer.kv = None  # no engine on a trainer GPU
    for key in _ENGINE_TERMS:
        trainer.terms[key] = Term(f"{key} (none: engines on GPUs of their own)", 0)
    trainer.phases.pop("rollout (engine awake)", None)
    trainer.phases["weight push"] = trainer.phases.pop("weight sync")
    trainer.sync_bytes = {"gathered per push (fp32, all ranks)": int(4 * shape.params()),
                          "bytes through host memory per engine (its dtype)": int(2 * shape.params())}
    trainer.knobs = [k for k in trainer.knobs if "sleep" not in k and "gpu_memory_utilization" not in k]

    params = shape.params()
    dtype_bytes = engine_dtype_bytes(cfg)
    weights = dtype_bytes * params // tp
    # vLLM's own arithmetic (the colocated plan's too): its share of the GPU less the weights, its
    # profiling peak and the memory outside torch; the trajectories per engine of one step
    kv = engine_kv_cache(cfg, shape, backend.rollout_gpus, gpu, gpu_name)
    bucket = backend.weight_sync_bucket_mb * (1 << 20)
    engine = MemoryPlan(gpu=gpu, world=tp, kv=kv)
    engine.terms = {
        "weights": Term(f"engine weights ({dtype_bytes} bytes / {tp} GPUs)", int(weights)),
        "kv": Term("KV cache", kv.cache_bytes, "backend.kv_cache_gib" if backend.kv_cache_gib is not None else
                   f"gpu_memory_utilization {backend.gpu_memory_utilization} of the GPU, less the rest of vLLM's share"),
        "profile": Term("vLLM's profiling peak (activations, sampler; estimated)", kv.profile_bytes),
        "non_torch": Term("memory outside torch (NCCL, cuBLAS, CUDA graphs; assumed)", VLLM_NON_TORCH),
        "bucket": Term("one pushed bucket being loaded (engine dtype)", int(bucket * dtype_bytes / 4)),
    }
    engine.phases = {"sampling": ["weights", "kv", "profile", "non_torch"],
                     "loading pushed weights (between tokens)": ["weights", "kv", "profile", "non_torch", "bucket"]}
    engine.host = {"received buckets (bytes) until a push is complete": int(dtype_bytes * params)}
    engine.sync_bytes = {"received per push (its dtype)": int(dtype_bytes * params)}
    engines = backend.rollout_gpus // tp
    kv_tokens = kv.tokens
    eta = cfg.train.max_staleness if cfg.train.asynchronous else 0
    trajectories = (eta + 1) * cfg.train.prompts_per_step * cfg.rollout.k
    context = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    in_flight = -(-trajectories // max(engines, 1)) * context
    if not engine.fits or (gpu and kv_tokens == 0):
        engine.knobs = [f"a larger backend.tensor_parallel_size (now {tp})",
                        f"backend.gpu_memory_utilization (now {backend.gpu_memory_utilization}) or backend.kv_cache_gib "
                        "sized to the GPU"]
    return PlacementPlan(trainer, engine, engines, kv_tokens, in_flight)

