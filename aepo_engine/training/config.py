"""The sections of the policy update: ``policy`` (model, parallelism, PPO update, with the kernels'
``loss`` inside), ``optim`` (AdamW and its schedule) and ``rollout_correction`` (importance weights
between the sampler's and the trainer's log-probs).

Here, apart from the worker (``training.policy``), the optimizer schedule (``training.optim``) and
the correction itself (``training.rollout_correction``), so that reading them imports no torch (the
rule of ``aepo_engine.config``).
"""
from __future__ import annotations

from typing import Literal

import msgspec

from aepo_engine.errors import require
from aepo_engine.models.config import LoraConfig
from aepo_kernels.config import LossConfig

__all__ = ["OptimConfig", "PolicyConfig", "RolloutCorrectionConfig"]

class PolicyConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Policy model, parallelism and PPO update.

    Attributes:
        loss: The AEPO loss (clip rule, entropy-aware advantage, KL, aggregation).
        micro_batch_size: Rows (trajectories) per forward/backward on each rank (gradient
            accumulation); ignored when micro_batch_max_tokens is set.
        micro_batch_max_tokens: If set, micro-batches are cut greedily so that rows x longest row
            (the sum of row lengths when sequences are packed) stays within this many tokens (a
            longer row goes alone) instead of by row count.
        ppo_mini_batch_size: Prompts (or rows, see mini_batch_unit) per optimizer step, over all ranks.
        mini_batch_unit: "prompts" counts prompt groups (all k trajectories of a prompt stay in one
            mini-batch, as in verl); "rows" counts trajectories.
        ppo_epochs: Passes over the batch per update() call.
        use_fused_linear: Compute the loss from hidden states and the lm_head weight in blocks
            (aepo_kernels.fused_linear_aepo_policy_loss) instead of materialising [B, L, V] logits.
        fused_chunk_bytes: Memory budget of the fused-linear kernels' logits block (its row
            count is derived from it and the vocabulary size); none = 192 MiB on CPU and, on
            CUDA, an eighth of the free memory within 192 MiB-2 GiB (each block re-reads and
            re-writes the fp32 [V, D] weight-gradient accumulator: few large blocks on a GPU).
            With head_backward "vocab_outer" it is the budget of the fp32 [rows, 4096] block instead
            (none = 32 MiB); with "vocab_outer_lean" the budget of its whole workspace (none = 64 MiB).
        head_backward: Loop order of the fused-linear head's gradient (docs/head.md): "token_outer"
            (token chunks of [rows, V] logits, 3 matmuls, an fp32 [V, D] weight-gradient
            accumulator), "vocab_outer" (a statistics pass, then vocabulary blocks outer with the
            logits recomputed: 4 matmuls, each fp32 d_W block finished over all tokens, no [V, D]
            accumulator but an fp32 [N, D] d_hidden one), "vocab_outer_lean" (d_W as vocab_outer,
            d_hidden from a token-outer pass of its own: 5 matmuls, within 64 MiB beyond d_W and
            d_hidden on CUDA), or "auto": the kernels' default for the device and the micro-batch
            (aepo_kernels.fused_linear.default_head_backward: on CUDA, by the memory plan's rule,
            vocab_outer where its workspace fits 64 MiB, else vocab_outer_lean; token_outer on
            CPU, by measurement). The memory plan's head term follows it, for rows and trees alike.
        entropy_stats_scope: "global": entropy mean/std of the entropy-aware advantage are
            all-reduced over all micro-batches and ranks of the mini-batch, so the loss does not
            depend on micro-batching or world size; "micro_batch": per micro-batch, like the reference code.
        fsdp: "auto" shards with FSDP2 when world_size > 1; "on" always (needs torchrun); "off" never
            (with world_size > 1 every rank holds the full model and gradients are all-reduced).
        sharded_load: With FSDP, build the model on the meta device, shard it, and read only this
            rank's shards from the checkpoint's safetensors files (``training.loading``): a rank
            never holds more than its shards plus one shard of one tensor. false loads the whole
            fp32 model on every rank first (``from_pretrained``; for checkpoints whose tensor names
            are not the model's parameter names). Without FSDP the whole model is loaded either way.
        param_dtype: Compute dtype of parameters in forward/backward (master weights stay float32);
            FSDP2 MixedPrecisionPolicy when sharded, torch.autocast otherwise. No float16: it would
            need loss scaling, which is left out. "bfloat16_if_native": bfloat16 on CUDA and on a
            CPU with AMX or AVX512-BF16, float32 on other CPUs (``aepo_engine.native_dtype``).
        reduce_dtype: dtype of the FSDP2 gradient reduce-scatter.
        activation_checkpointing: Recompute each decoder layer in backward (HF gradient
            checkpointing, non-reentrant) to save activation memory.
        attn_implementation: HF attention kernel: "sdpa" (default, any device), "eager",
            "varlen" (packed rows through torch's own FlashAttention varlen kernel on CUDA in
            bf16, the same attention row by row with SDPA elsewhere: ``training.attention``; no
            flash-attn package needed), or "flash_attention_2" (only where flash-attn imports on CUDA).
        pack_sequences: Concatenate a micro-batch's rows without padding into one sequence with
            per-row position ids (HF's padding-free format): varlen and flash_attention_2 then run
            their varlen kernels, sdpa/eager a block-diagonal causal mask. "auto" packs with
            varlen and flash_attention_2 only (the sdpa/eager mask is [T, T] for T tokens per
            micro-batch); "on" / "off" force it ("varlen" needs it).
        counterfactual_stats: Every update also reports ``cf/*``: per-token gradients under PPO's
            and AEPO's clip and with the entropy-aware advantage on and off, from the log-probs and
            entropies the loss already computed (``training.counterfactual``; no model pass). Needs
            the batch's old-policy entropies (``compute_logprobs``); without them it is skipped.
        lora: Low-rank adapters instead of full-weight training (:class:`LoraConfig`; off by default).
        tree_batches: "on": the log-prob pass and the update run on each prompt group's rollout
            tree (``training.tree``): every shared prefix (the prompt, a branch's inherited tokens)
            is one set of positions, attended to through the tree attention
            (``training.tree_attention``; it replaces attn_implementation and pack_sequences), and
            the loss folds each node's occurrences (``aepo_kernels.tree_loss``); the same gradients
            as the rows. Ranks get whole groups; micro-batches are whole groups, up to
            micro_batch_max_tokens tree nodes (or micro_batch_size rows). "off": one row per
            trajectory. Measured, and what is left out: docs/trees.md.
        deterministic: ``torch.use_deterministic_algorithms(True)`` for this process from the
            worker's start (and cuBLAS's fixed workspace, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, when
            the environment sets none): on CUDA the scatter-adds of the tree layout (the loss's
            per-node folding, the gathered parent states' backward) and of the row layout use
            atomics by default, so two runs of one update differ in the last bits; with it they do
            not, at some speed (not measured: no GPU run yet, docs/trees.md). An op with no
            deterministic kernel then raises instead of running.
    """

    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    micro_batch_size: int = 4
    micro_batch_max_tokens: int | None = None
    ppo_mini_batch_size: int = 8
    mini_batch_unit: Literal["prompts", "rows"] = "prompts"
    ppo_epochs: int = 1
    use_fused_linear: bool = True
    fused_chunk_bytes: int | None = None
    head_backward: Literal["auto", "vocab_outer", "token_outer", "vocab_outer_lean"] = "auto"
    entropy_stats_scope: Literal["global", "micro_batch"] = "global"
    fsdp: Literal["auto", "on", "off"] = "auto"
    sharded_load: bool = True
    param_dtype: Literal["float32", "bfloat16", "bfloat16_if_native"] = "bfloat16"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "eager", "varlen", "flash_attention_2"] = "sdpa"
    pack_sequences: Literal["auto", "on", "off"] = "auto"
    counterfactual_stats: bool = True
    tree_batches: Literal["on", "off"] = "off"
    deterministic: bool = False

    @property
    def trees(self) -> bool:
        """Whether the passes run on rollout trees (``tree_batches`` resolved)."""
        return self.tree_batches == "on"

    @property
    def packs(self) -> bool:
        """Whether micro-batches are packed (``pack_sequences`` resolved)."""
        if self.pack_sequences == "auto":
            return self.attn_implementation in ("varlen", "flash_attention_2")
        return self.pack_sequences == "on"

    def __post_init__(self) -> None:
        require(self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        require(self.micro_batch_max_tokens is None or self.micro_batch_max_tokens >= 1,
                f"micro_batch_max_tokens must be >= 1 (or none), got {self.micro_batch_max_tokens}")
        require(self.ppo_mini_batch_size >= 1, f"ppo_mini_batch_size must be >= 1, got {self.ppo_mini_batch_size}")
        require(self.ppo_epochs >= 1, f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
        require(not (self.attn_implementation == "varlen" and self.pack_sequences == "off"),
                "attn_implementation='varlen' with pack_sequences='off': the varlen kernel reads the rows of a "
                "packed micro-batch from its position ids and takes no padding mask; use 'auto' or 'on'")
        require(self.fused_chunk_bytes is None or self.fused_chunk_bytes >= 1,
                f"fused_chunk_bytes must be >= 1 (or none), got {self.fused_chunk_bytes}")
        require(self.loss.aggregation == "token-mean",
                f"loss.aggregation={self.loss.aggregation!r}: the worker normalises by the global token "
                "count, which only token-mean supports; sequence-level modes are left out")

    def steps_per_update(self, num_units: int) -> int:
        """Optimizer steps one ``update()`` takes for ``num_units`` prompts (or rows, see
        ``mini_batch_unit``): the trainer multiplies by its step count for ``total_steps``."""
        return -(-num_units // self.ppo_mini_batch_size) * self.ppo_epochs


class OptimConfig(msgspec.Struct, kw_only=True):
    """AdamW optimizer and learning-rate schedule.

    Attributes:
        lr: Peak learning rate (reference runs: 1e-6, constant).
        weight_decay: Decoupled (AdamW) weight decay.
        grad_clip: Clip the global gradient norm to this value; 0 turns clipping off.
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        warmup_steps: Linear warm-up from 0 to lr over this many optimizer steps; 0 = no warm-up.
        schedule: After warm-up: "constant" keeps lr, "cosine" decays to min_lr_ratio * lr by the last step.
        min_lr_ratio: Final lr as a fraction of lr for the cosine schedule.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        require(all(0 <= b < 1 for b in self.betas),
                f"betas must lie in [0, 1) because AdamW divides by 1 - beta**t, got {self.betas}")
        require(self.eps > 0, f"eps must be > 0 because AdamW divides by sqrt(v) + eps, got {self.eps}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        require(self.schedule == "cosine" or self.min_lr_ratio == 0,
                "min_lr_ratio only applies to schedule='cosine'; set schedule='cosine' or leave it at 0")


class RolloutCorrectionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Importance weights for the sampler/trainer log-prob gap (see the module docstring).

    Attributes:
        mode: "auto" ("token_tis" when tokens may be stale, train.mode "async" with max_staleness >=
            1: the decoupled PPO weight; "off" otherwise), "off", "token_tis" (per-token truncated
            IS), "seq_tis" (per-sequence truncated IS) or "seq_mask" (drop sequences whose ratio
            leaves [1/threshold, threshold]).
        threshold: C, the truncation cap of TIS and the band of seq_mask; > 1.
        sequence_ratio: how seq_tis / seq_mask form a sequence's ratio from its tokens: "product"
            (the exact sequence likelihood ratio) or "geometric" (its per-token geometric mean).
    """

    mode: Literal["auto", "off", "token_tis", "seq_tis", "seq_mask"] = "auto"
    threshold: float = 2.0
    sequence_ratio: Literal["product", "geometric"] = "product"

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"threshold must be > 1 because it caps ratios from above (TIS) and "
                             f"bounds [1/threshold, threshold] (seq_mask), got {self.threshold}")

    def resolved(self, stale_tokens: bool) -> "RolloutCorrectionConfig":
        """This config with ``auto`` replaced by what it means for a run whose updates may
        (``stale_tokens``) or may not use tokens of older policies."""
        if self.mode != "auto":
            return self
        return msgspec.structs.replace(self, mode="token_tis" if stale_tokens else "off")
