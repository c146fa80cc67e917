"""Generation backends implementing ``aepo_engine.rollout.protocol.GenerationBackend``, and the
``backend`` config section that picks one.

- ``hf.HFBackend``: own sampling loop over a Hugging Face model; exact entropies; CPU or GPU.
- ``vllm.VLLMBackend``: vLLM offline engine; entropies estimated from top-k log-probs.
``build_backend`` imports only the one asked for (``vllm`` is optional and heavy).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["BackendConfig", "build_backend"]


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
    """

    kind: Literal["hf", "vllm"] = "vllm"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = 64
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 8192
    logprobs_topk: int = 20

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


def build_backend(cfg: BackendConfig, model_dir: str, tokenizer: Any, seed: int) -> Any:
    """The backend ``cfg`` names, loaded from ``model_dir``.

    Args:
        cfg: the backend section.
        model_dir: a local HF model directory.
        tokenizer: its tokenizer (the HF backend decodes with it).
        seed: engine seed (vLLM); per-request seeds come from the rollout.
    """
    import torch

    if cfg.kind == "vllm":
        from aepo_engine.rollout.backends.vllm import VLLMBackend

        return VLLMBackend(model_dir, seed=seed, max_model_len=cfg.max_model_len,
                           gpu_memory_utilization=cfg.gpu_memory_utilization, logprobs_topk=cfg.logprobs_topk)
    from aepo_engine.rollout.backends.hf import HFBackend

    device = cfg.device
    if device == "auto":
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return HFBackend(model_dir, tokenizer, device=device, max_batch_size=cfg.max_batch_size)
