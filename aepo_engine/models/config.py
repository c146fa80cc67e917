"""The ``model`` section: which policy model a run trains (a local HF directory, or the tiny
Qwen3 the synthetic task builds for itself), and the shape of the low-rank adapters trained on
it (``policy.lora``: :class:`LoraConfig`, used by ``models.lora``)."""
from __future__ import annotations

import msgspec

from aepo_engine.errors import require

__all__ = ["LoraConfig", "ModelConfig", "TinyModelConfig"]

# The projections of a Llama/Qwen-style decoder layer (attention and MLP): LoRA's default targets.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Modules LoRA may not wrap: the fused kernels read the head's weight (and a tied embedding's) directly.
LORA_REFUSED_TARGETS = ("lm_head", "embed_tokens")


class LoraConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Low-rank adapters (PEFT's LoRA) on the decoder's projections: only the adapters train, the
    base weights stay frozen, and rollout engines receive only the adapters each step
    (``models.lora``; docs/lora.md).

    Attributes:
        enabled: Train adapters instead of every weight (off by default).
        rank: r, the adapters' inner dimension.
        alpha: The adapter's output is scaled by alpha / r (alpha / sqrt(r) with ``rslora``).
        dropout: Dropout on the adapter's input while training (0 keeps the trainer's log-probs
            equal to the engine's, which samples without dropout).
        target_modules: Names of the linear layers that get adapters (PEFT's suffix match). The
            head and the embedding are refused: the fused loss reads their weights directly.
        rslora: Rank-stabilised scaling (alpha / sqrt(r)).
    """

    enabled: bool = False
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS
    rslora: bool = False

    @property
    def scaling(self) -> float:
        """The factor on B @ A: alpha / r, or alpha / sqrt(r) with rslora."""
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def __post_init__(self) -> None:
        require(self.rank >= 1, f"lora.rank must be >= 1, got {self.rank}")
        require(self.alpha > 0, f"lora.alpha must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, f"lora.dropout must lie in [0, 1), got {self.dropout}")
        require(len(self.target_modules) > 0, "lora.target_modules is empty: name the linear layers to adapt")
        refused = [m for m in self.target_modules if m.split(".")[-1] in LORA_REFUSED_TARGETS]
        require(not refused, f"lora.target_modules has {refused}: the fused loss reads the head's (and a tied "
                "embedding's) weight directly, so they cannot carry adapters; adapt the decoder's projections")


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
