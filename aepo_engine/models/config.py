"""The ``model`` section: which policy model a run trains (a local HF directory, or the tiny
Qwen3 the synthetic task builds for itself)."""
from __future__ import annotations

import msgspec

__all__ = ["ModelConfig", "TinyModelConfig"]


class TinyModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The locally built tiny Qwen3 of the synthetic task (used when model.path is empty).

    Attributes:
        vocab_size: BPE vocabulary trained on the task's corpus and demonstrations.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: per-head width; 32 or 64 (what vLLM's CPU attention supports).
        intermediate_size: MLP width.
        tie_word_embeddings: share the embedding matrix and the LM head (the warm start learns
            to copy names and numbers much faster with it).
        seed: initialisation seed; none = derived from the run's root seed (``aepo_engine.seeding``).
    """

    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    tie_word_embeddings: bool = True
    seed: int | None = None


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The policy model.

    Attributes:
        path: a local Hugging Face model directory (config, safetensors, tokenizer), loaded with
            from_pretrained. Required with task.source "files"; with the synthetic task, empty
            builds and warm-starts the tiny model below.
        tiny: shape of the locally built tiny model (synthetic task with an empty path only).
    """

    path: str = ""
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
