"""The ``backend`` config section: which generation backend samples rollouts, and how its engines
are laid out and sized (apart from the backends, per the rule of ``aepo_engine.config``)."""
from __future__ import annotations

from typing import Literal

import msgspec

from aepo_engine.rollout.backends.registry import backend_builder

__all__ = ["BackendConfig"]


class BackendConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The generation backend that samples rollouts.

    Attributes:
        kind: the registered backend that samples (``backends.registry``): "vllm" (vLLM engine
            with prefix caching; entropies estimated from top-k logprobs; what a GPU run uses) or
            "hf" (Hugging Face model, exact entropies; CPU runs), or one a module of yours
            registered before the config is read.
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
            "bfloat16_if_native": bfloat16 on CUDA and on a CPU with AMX or AVX512-BF16, float32
            on other CPUs (``aepo_engine.native_dtype``).
        enforce_eager: vLLM without CUDA graphs / torch.compile; none = eager on CPU only (where
            compilation costs start-up time and buys nothing for tiny models).
        max_num_seqs: most sequences one vLLM engine schedules at once; none = vLLM's default.
        kv_cache_gib: KV-cache budget of one engine in GiB (vLLM's kv_cache_memory_bytes, which
            then replaces gpu_memory_utilization's share: the engine is started with the
            utilization its weights, this cache and its activations need, the memory plan's
            figure, since vLLM asks that share of the GPU free at start-up whatever the cache's
            size); none = from gpu_memory_utilization.
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
        placement: where the engines run on a GPU node. "colocated": in the training ranks, on
            their GPUs (sleeping during the update on CUDA). "split": on GPUs of their own
            (``rollout_gpus`` of a node), the trainer on the others, rollouts overlapping the
            update: needs ``train.mode = "async"`` (``max_staleness = 0`` for a synchronous
            schedule); memory per role in ``--dry-run --gpu`` (``aepo_engine.placement``). On a
            CPU the rollout process of an async run shares the cores either way.
        rollout_gpus: with placement "split", the GPUs of a node given to engines (a multiple of
            tensor_parallel_size: one engine per tensor_parallel_size GPUs); the trainer ranks use
            the others.
    """

    kind: str = "vllm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = 64
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 8192
    logprobs_topk: int = 20
    tensor_parallel_size: int = 1
    dtype: Literal["auto", "bfloat16", "float16", "float32", "bfloat16_if_native"] = "auto"
    enforce_eager: bool | None = None
    max_num_seqs: int | None = None
    kv_cache_gib: float | None = None
    enable_prefix_caching: bool = True
    weight_sync_bucket_mb: float = 256.0
    in_process: bool = True
    sleep_between_steps: bool | None = None
    sleep_level: Literal[1, 2] = 2
    placement: Literal["colocated", "split"] = "colocated"
    rollout_gpus: int = 0

    def sleeps(self, cuda: bool) -> bool:
        """Whether the engine sleeps between steps (``sleep_between_steps`` resolved) on a machine
        with (``cuda``) or without CUDA."""
        if self.sleep_between_steps is None:
            return self.kind == "vllm" and self.in_process and cuda and self.placement == "colocated"
        return self.sleep_between_steps

    def __post_init__(self) -> None:
        backend_builder(self.kind)  # raises for a kind no backend registered, listing those that are
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
        if self.placement == "split":
            if self.rollout_gpus < 1 or self.rollout_gpus % self.tensor_parallel_size:
                raise ValueError(f"rollout_gpus={self.rollout_gpus} must be a positive multiple of tensor_parallel_size="
                                 f"{self.tensor_parallel_size} because placement='split' gives each engine "
                                 "tensor_parallel_size GPUs of its own")
            if self.sleep_between_steps:
                raise ValueError("sleep_between_steps=true with placement='split': an engine on GPUs of its own "
                                 "never makes room for the update")
            if self.kind == "vllm" and self.tensor_parallel_size > 1 and self.in_process:
                raise ValueError("placement='split' with tensor_parallel_size > 1 needs in_process=false: the engine "
                                 "spans its GPUs with vLLM's own worker processes, not with training ranks")
        elif self.rollout_gpus:
            raise ValueError(f"rollout_gpus={self.rollout_gpus} needs placement='split' (colocated engines share "
                             "the training ranks' GPUs)")
