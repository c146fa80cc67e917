"""The policy worker: an HF causal LM under FSDP2 (or plain), its AdamW optimizer and the AEPO update.

One worker per process. Without torchrun it runs single-process; under torchrun it initialises
torch.distributed (gloo on CPU, nccl on CUDA), shards every decoder layer and then the root with
FSDP2 ``fully_shard`` and a ``MixedPrecisionPolicy`` (the root does not cast its forward's
inputs: the loss inputs it receives stay fp32). A sharded model is built on the meta device
and each rank reads only its shards from the checkpoint (:mod:`aepo_engine.training.loading`):
no rank ever holds the whole fp32 model. The lm_head's three matmuls run in ``param_dtype``
(``_in_compute_dtype``; the kernels accumulate in fp32).

Every rank is handed the *same global* :class:`TokenBatch`; the worker cuts it into PPO
mini-batches, gives each rank a strided shard of each mini-batch and runs that shard's
micro-batches (gradient accumulation). Per mini-batch one all-reduce of
``(sum H, sum H^2, valid tokens)`` gives the global token count and entropy statistics, so

    loss = sum over all micro-batches and ranks of  sum_t L_t / N_global

is the token-mean over the whole mini-batch, whatever the micro-batch split and world size.
FSDP2 *averages* gradients over ranks (divides by W), so each rank's loss is multiplied by W
before backward; the reported loss is not.

Entropy statistics (``entropy_stats_scope="global"``): the z-score mean/std of docs/algorithm.md §2b come from
``batch.entropy`` when present (set it from :meth:`PolicyWorker.compute_logprobs`, the pass that
also gives ``old_logprobs``; this costs nothing extra and is exact for the first mini-batch of an
on-policy step), otherwise from a no-grad pass of the current policy over the mini-batch. The
per-token entropy H_t inside the z-score is always the current policy's, detached (the kernel
loss detaches it). ``"micro_batch"`` reproduces the reference code (statistics per micro-batch).
The z-score divides by the entropy std: where entropies are nearly constant (a random-init model
sits within ~1e-3 nats of log V) fp32 noise in H_t (~1e-6) is amplified by 1/std, so two
mathematically equal runs differ by ~1e-3 relative; with real models (std ~1 nat) they agree to ~1e-6.

The loss is computed inside the FSDP root's forward (where the lm_head weight is gathered) in one
pass: :func:`aepo_kernels.fused_linear_aepo_policy_loss` from the final hidden states and the
lm_head weight (no ``[N, V]`` logits; the gradient is computed in the forward loop), or, with
``use_fused_linear=False``, :func:`aepo_kernels.aepo_policy_loss` on materialised logits with the
gradient written over them. Both get the global token count and the global entropy statistics,
so they never need a second pass. Log-probs alone (``compute_logprobs``, the no-grad entropy
pass) come from :func:`aepo_kernels.fused_linear_logprob_entropy` / :func:`aepo_kernels.logprob_entropy`.

With ``pack_sequences`` a micro-batch's rows are concatenated without padding and given per-row
position ids (HF's padding-free format: flash-attn varlen kernels, or a block-diagonal causal mask
for sdpa/eager); outputs are scattered back to the padded ``[B, L]`` layout.

Left out: mini-batch shuffling across PPO epochs, tensor/sequence parallelism, CPU offload of
parameters or optimizer state, models whose logits are post-processed (soft-capping, logit
scale), and weight decay exclusions (all parameters decay, as in verl).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Iterator, Literal

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor, nn

from aepo_engine.distributed import init_distributed
from aepo_engine.errors import require
from aepo_engine.training import counterfactual
from aepo_engine.training.loading import build_meta_model, load_hf_model, load_sharded_weights
from aepo_engine.training.optim import OptimConfig, build_lr_scheduler
from aepo_engine.training.batch import IGNORE_INDEX, TOKEN_ORIGINS, TokenBatch
from aepo_kernels import (
    LossConfig,
    aepo_policy_loss,
    apply_token_weights,
    entropy_moments,
    entropy_stats_from_moments,
    fused_linear_aepo_policy_loss,
    fused_linear_logprob_entropy,
    logprob_entropy,
)

__all__ = ["LossInputs", "PolicyConfig", "PolicyModel", "PolicyWorker"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Per-call statistics of the loss that are token means (re-weighted by tokens).
TOKEN_MEAN_STATS = ("entropy", "ratio", "clipfrac_high", "clipfrac_low", "clipfrac_dual", "kl")
# The same statistics again per token origin (batch.token_origin: branched vs global tokens),
# reported as "<stat>/<origin>" next to "tokens/<origin>"; token-weighted over the whole update.
SPLIT_STATS = ("entropy", "clipfrac_high", "clipfrac_low")


def _weighted_advantages(micro: TokenBatch) -> Tensor:
    """Advantages times the rollout-correction weights (``[B, L]``), or as they are
    (:func:`aepo_kernels.apply_token_weights`: exact for the weighted policy-gradient term)."""
    return apply_token_weights(micro.advantages, micro.is_weights, micro.old_logprobs.shape)


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
            need loss scaling, which is left out.
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
    """

    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    micro_batch_size: int = 4
    micro_batch_max_tokens: int | None = None
    ppo_mini_batch_size: int = 8
    mini_batch_unit: Literal["prompts", "rows"] = "prompts"
    ppo_epochs: int = 1
    use_fused_linear: bool = True
    fused_chunk_bytes: int | None = None
    entropy_stats_scope: Literal["global", "micro_batch"] = "global"
    fsdp: Literal["auto", "on", "off"] = "auto"
    sharded_load: bool = True
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "eager", "varlen", "flash_attention_2"] = "sdpa"
    pack_sequences: Literal["auto", "on", "off"] = "auto"
    counterfactual_stats: bool = True

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


# --- the module FSDP wraps ------------------------------------------------------------------------

@dataclasses.dataclass
class LossInputs:
    """What the one-pass loss needs besides the model's hidden states: per-token ``[B, L]`` tensors
    and the global normalisers / statistics of the mini-batch (0-d tensors or None)."""

    old_logprobs: Tensor
    advantages: Tensor  # [B, L] (per-sequence advantages expanded)
    loss_mask: Tensor
    ref_logprobs: Tensor | None
    global_token_count: Tensor
    entropy_mean: Tensor | None = None
    entropy_std: Tensor | None = None
    stats_masks: dict[str, Tensor] | None = None  # name -> [B, L] mask of split statistics
    token_rows: bool = False  # also return per-token log-probs and entropies (return_token_loss)

    def packed(self, real: Tensor) -> "LossInputs":
        """The per-token fields at the real (non-padding) positions, as one ``[1, T]`` row."""
        pick = lambda t: None if t is None else t[real][None]  # noqa: E731
        masks = None if self.stats_masks is None else {k: pick(v) for k, v in self.stats_masks.items()}
        return dataclasses.replace(self, old_logprobs=pick(self.old_logprobs), advantages=pick(self.advantages),
                                   loss_mask=pick(self.loss_mask), ref_logprobs=pick(self.ref_logprobs),
                                   stats_masks=masks)


class PolicyModel(nn.Module):
    """An HF causal LM returning per-token ``(logprobs, entropy)`` of ``labels``, or, given
    :class:`LossInputs`, the AEPO loss and its statistics (the FSDP root).

    Wrapping keeps the lm_head inside the root's forward, so FSDP2 gathers its weight for the fused
    kernels (which read ``weight`` directly instead of calling the head).
    """

    def __init__(self, hf_model: nn.Module, temperature: float, fused: bool, chunk_bytes: int | None,
                 loss_config: LossConfig | None = None, pack: bool = False):
        super().__init__()
        self.hf = hf_model
        self.temperature, self.fused, self.pack = temperature, fused, pack
        self.chunk_bytes, self.loss_config = chunk_bytes, loss_config or LossConfig()

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, loss_inputs: LossInputs | None = None):
        """Args: ``[B, L]`` each, right-padded. Returns: fp32 ``(logprobs, entropy)`` ``[B, L]``
        (0 logp at -100 and on padding), or with ``loss_inputs`` ``(loss, stats)``."""
        if not self.pack:
            hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            if loss_inputs is not None:
                return self._loss(hidden, labels, loss_inputs)
            return self._head(hidden, labels)  # hidden: [B, L, D]
        # Padding-free: the T real tokens as one row; position ids restart at 0 for every
        # original row, which is how HF detects the packed rows (varlen / block-diagonal mask).
        real = attention_mask.bool()  # [B, L]
        positions = (attention_mask.cumsum(-1) - 1)[real]  # [T]
        hidden = self.decoder(input_ids=input_ids[real][None], position_ids=positions[None],
                              attention_mask=None, use_cache=False).last_hidden_state  # [1, T, D]
        if loss_inputs is not None:
            return self._loss(hidden, labels[real][None], loss_inputs.packed(real))
        logprobs, entropy = self._head(hidden, labels[real][None])  # [1, T] each
        return (logprobs.new_zeros(real.shape).masked_scatter(real, logprobs[0]),
                entropy.new_zeros(real.shape).masked_scatter(real, entropy[0]))

    def _head(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        head = self.hf.get_output_embeddings()  # hidden: [B, L, D]; head.weight: [V, D]
        hidden = _in_compute_dtype(hidden)
        if self.fused:
            logprobs, entropy = fused_linear_logprob_entropy(
                hidden, head.weight, labels, self.temperature, bias=head.bias, chunk_bytes=self.chunk_bytes,
                shift_labels=False)  # labels[t]: the target of hidden row t
        else:
            logits = head(hidden)  # [B, L, V]
            logprobs, entropy = logprob_entropy(logits, labels, self.temperature, shift_labels=False)
        # The kernels return reshaped views; FSDP2 hooks a root's outputs for backward and an in-place
        # op on a view would bypass that hook, so hand out fresh [B, L] tensors (cheap: no V).
        return logprobs.clone(), entropy.clone()

    def _loss(self, hidden: Tensor, labels: Tensor, inputs: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        """The one-pass AEPO loss of ``hidden [B, L, D]`` (gradient computed during this call)."""
        head = self.hf.get_output_embeddings()
        hidden = _in_compute_dtype(hidden)
        kwargs = dict(config=self.loss_config, temperature=self.temperature, ref_logprobs=inputs.ref_logprobs,
                      global_token_count=inputs.global_token_count, entropy_mean=inputs.entropy_mean,
                      entropy_std=inputs.entropy_std, stats_masks=inputs.stats_masks,
                      return_token_loss=inputs.token_rows)
        args = (labels, inputs.old_logprobs, inputs.advantages, inputs.loss_mask)
        if self.fused:
            return fused_linear_aepo_policy_loss(hidden, head.weight, *args, bias=head.bias,
                                                 chunk_bytes=self.chunk_bytes, shift_labels=False, **kwargs)
        # The head's output is used by nothing else: its buffer can take the gradient.
        logits = head(hidden)  # [B, L, V]
        return aepo_policy_loss(logits, *args, inplace_backward=True, shift_labels=False, **kwargs)


def _in_compute_dtype(hidden: Tensor) -> Tensor:
    """The final hidden states in the compute dtype of the head's matmuls.

    Under autocast (no FSDP, ``param_dtype`` bf16) the backbone's residual stream and final norm
    run in fp32, so its last hidden state comes out fp32; the fused head disables autocast and
    multiplies in its input's dtype, so it is cast here to the autocast dtype (the fp32 lm_head
    weight is cast block-wise by the kernel, its gradient accumulated in fp32). Under FSDP2's
    mixed precision the hidden states are already in ``param_dtype``.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return hidden.to(torch.get_autocast_dtype(device_type))
    return hidden


# --- the worker -----------------------------------------------------------------------------------

class PolicyWorker:
    """Holds the policy (``model``: the HF module, ``policy``: the FSDP root), ``optimizer`` and
    ``scheduler``; computes log-probs and runs AEPO/PPO updates on global token batches."""

    def __init__(self, model_path: str, config: PolicyConfig, optim: OptimConfig, total_steps: int,
                 temperature: float = 1.0):
        """
        Args:
            model_path: a local HF directory (``from_pretrained``).
            config: the policy section; optim: optimizer and schedule.
            total_steps: optimizer steps of the whole run (for the cosine schedule).
            temperature: log-probs and entropies are those of softmax(z / T). The trainer passes
                ``rollout.temperature``, the one the trajectories were sampled with: the ratio
                and the entropy-aware advantage are only meaningful under the sampling policy.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.config, self.optim_config = config, optim
        self.rank, self.world_size, self.device = init_distributed()
        self.use_fsdp = config.fsdp == "on" or (config.fsdp == "auto" and self.world_size > 1)
        if self.use_fsdp and not dist.is_initialized():
            raise RuntimeError("fsdp='on' needs torch.distributed (launch with torchrun)")
        on_meta = self.use_fsdp and config.sharded_load
        load = build_meta_model if on_meta else load_hf_model
        self.model = load(model_path, config.attn_implementation)
        if config.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy = PolicyModel(self.model, temperature, config.use_fused_linear, config.fused_chunk_bytes,
                                  loss_config=config.loss, pack=config.packs)
        self._shard_or_place()
        if on_meta:  # the shards exist now: allocate them and read this rank's rows
            load_sharded_weights(self.model, model_path, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas,
                                           eps=optim.eps, weight_decay=optim.weight_decay)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)
        # FSDP2 averages gradients over ranks; scale so the sum (the global token-mean) survives.
        self.loss_scale = float(self.world_size) if self.use_fsdp else 1.0
        self.skipped_steps = 0
        self._cf_threshold: Tensor | None = None  # set per update() (counterfactual_stats)

    def _shard_or_place(self) -> None:
        if not self.use_fsdp:
            self.policy.to(self.device)
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[self.config.param_dtype],
                                  reduce_dtype=DTYPES[self.config.reduce_dtype])
        for layer in self.policy.decoder.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        # The root's forward takes the LossInputs: FSDP2 would cast every floating tensor of them
        # (a dataclass is walked) to param_dtype -- old log-probs, advantages, the global token
        # count and the entropy statistics rounded to bf16 (-7.3456 -> -7.34375, 425 -> 424).
        # They stay fp32; the root's own parameters are still gathered in param_dtype and each
        # decoder layer still casts its input.
        fully_shard(self.policy, mesh=mesh, mp_policy=dataclasses.replace(mp, cast_forward_inputs=False))

    def _autocast(self):
        dtype = DTYPES[self.config.param_dtype]
        if self.use_fsdp or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    # --- forward helpers ------------------------------------------------------------------------

    def _forward(self, micro: TokenBatch) -> tuple[Tensor, Tensor]:
        """``(logprobs, entropy)`` ``[b, l]`` of a micro-batch already on ``self.device``."""
        with self._autocast():
            return self.policy(micro.input_ids, micro.attention_mask, micro.labels)  # [b, l] x2

    def _micro_batches(self, local: TokenBatch) -> tuple[list[TokenBatch], int]:
        """This rank's micro-batches, padded with masked-out ones to the same count on every rank
        (FSDP collectives run per forward/backward); returns ``(micro_batches, real_count)``."""
        cfg = self.config
        if cfg.micro_batch_max_tokens is None:
            parts = local.micro_batches(size=cfg.micro_batch_size)
        else:
            parts = local.micro_batches(max_tokens=cfg.micro_batch_max_tokens, packed=self.policy.pack)
        real = len(parts)
        if self.world_size > 1 and cfg.micro_batch_max_tokens is not None:
            count = torch.tensor([real], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            parts += [local.rows([0]).masked_out()] * (int(count) - real)
        return parts, real

    def _all_reduce(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    # --- log-probs ------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """Log-probs of ``batch.labels`` and entropies under the current policy (temperature applied).

        Args:
            batch: the global batch (the same on every rank).
        Returns:
            ``(logprobs, entropy)``, fp32 CPU ``[B, L]``, both 0 where the label is -100, on every rank.
        """
        self.policy.eval()
        width = batch.input_ids.shape[1]
        local = batch.shard(self.rank, self.world_size)
        parts, real = self._micro_batches(local)
        outs = [self._forward(micro.to(self.device)) for micro in parts][:real]
        pad = lambda t: nn.functional.pad(t.float(), (0, width - t.shape[1]))  # noqa: E731
        local_out = torch.stack([torch.cat([pad(o[i]) for o in outs]) for i in (0, 1)])  # [2, b, L]
        logprobs, entropy = self._gather_rows(local_out, batch.num_rows).cpu().unbind(0)
        # no label, no prediction: padding and the last token hold whatever the batch layout gave
        return logprobs, entropy * (batch.labels != IGNORE_INDEX)

    def _gather_rows(self, local: Tensor, num_rows: int) -> Tensor:
        """Undo :meth:`TokenBatch.shard` (strided rows): ``[2, b, L]`` per rank -> ``[2, B, L]``."""
        if self.world_size == 1:
            return local[:, :num_rows]
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local.contiguous())
        stacked = torch.stack(gathered, dim=2)  # [2, b, W, L]: row j of rank r is global j * W + r
        return stacked.flatten(1, 2)[:, :num_rows]

    # --- update ---------------------------------------------------------------------------------

    def update(self, batch: TokenBatch) -> dict[str, float]:
        """PPO epochs x mini-batches (optimizer steps) x micro-batches (gradient accumulation).

        Args:
            batch: the global batch (same on every rank) with ``old_logprobs`` and ``advantages``
                set; ``entropy`` (from :meth:`compute_logprobs`) if the global entropy statistics
                should come from it instead of a no-grad pass.
        Returns:
            Means over optimizer steps of ``loss``, ``grad_norm`` (before clipping), ``entropy``,
            ``ratio``, ``clipfrac_*``, ``kl`` (with ref_logprobs); ``grad_norm_max``, ``lr`` (after
            the update), ``tokens`` (valid tokens processed, summed), ``optimizer_steps``,
            ``skipped_steps`` (non-finite gradient norm: step skipped, weights untouched),
            ``tokens_per_s``. With ``batch.token_origin``: per origin of ``TOKEN_ORIGINS``
            (``global``, ``branch``) ``tokens/<origin>`` (summed) and ``entropy``/``clipfrac_high``/
            ``clipfrac_low`` ``/<origin>``, token means over the update's steps, left out when the
            update saw no token of that origin.
        """
        self.policy.train()
        start, records = time.perf_counter(), []
        cfg = self.config
        # One high-entropy threshold per update (the step's old-policy entropies): counterfactual stats.
        self._cf_threshold = None if not cfg.counterfactual_stats or batch.entropy is None else \
            counterfactual.high_entropy_threshold(batch.entropy, batch.loss_mask).to(self.device)
        for _ in range(cfg.ppo_epochs):
            for mini in batch.mini_batches(cfg.ppo_mini_batch_size, by=cfg.mini_batch_unit):
                records.append(self._train_step(mini))
        self.policy.eval()
        return self._summarise(records, time.perf_counter() - start)

    def _summarise(self, records: list[dict[str, float]], seconds: float) -> dict[str, float]:
        done = [r for r in records if not r["skipped"]] or records
        not_averaged = ("tokens", "skipped", "split", "counterfactual")
        out = {key: sum(r[key] for r in done) / len(done) for key in done[0] if key not in not_averaged}
        out["grad_norm_max"] = max(r["grad_norm"] for r in records)
        out["tokens"] = sum(r["tokens"] for r in records)
        out["skipped_steps"] = float(sum(r["skipped"] for r in records))
        out["optimizer_steps"] = len(records) - out["skipped_steps"]
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["tokens_per_s"] = out["tokens"] / max(seconds, 1e-9)
        for origin in (TOKEN_ORIGINS if "split" in records[0] else ()):
            count = sum(r["split"][origin]["tokens"] for r in done)
            out[f"tokens/{origin}"] = count
            out.update({f"{key}/{origin}": sum(r["split"][origin][key] for r in done) / count
                        for key in SPLIT_STATS if count > 0})
        if "counterfactual" in records[0]:
            out.update(counterfactual.summarise(torch.tensor([r["counterfactual"] for r in done]).sum(0)))
        return out

    def _train_step(self, mini: TokenBatch) -> dict[str, float]:
        """One optimizer step on a global mini-batch; one host sync at the end."""
        local = mini.shard(self.rank, self.world_size)
        parts, _ = self._micro_batches(local)
        moments = self._entropy_moments(local, parts)  # [3] global (sum H, sum H^2, count)
        stats_kwargs = {}
        if self.config.entropy_stats_scope == "global":
            stats_kwargs = dict(zip(("entropy_mean", "entropy_std"), entropy_stats_from_moments(moments)))
        count = moments[2].clamp(min=1).float()
        split = mini.token_origin is not None
        n_cf = len(counterfactual.GROUPS) * len(counterfactual.SUMS) if self._cf_threshold is not None else 0
        sums = torch.zeros(2 + len(TOKEN_MEAN_STATS) + split * len(TOKEN_ORIGINS) * (1 + len(SPLIT_STATS)) + n_cf,
                           dtype=torch.float64, device=self.device)
        for micro in parts:
            sums += self._micro_step(micro, count, stats_kwargs)
        self._all_reduce(sums)
        grad_norm = self._reduce_and_clip()
        values = torch.cat([sums, grad_norm.reshape(1).double()]).tolist()  # the one host sync
        record = self._finish_step(math.isfinite(values[-1]))
        record.update(loss=values[0], grad_norm=values[-1], tokens=values[1])
        for i, key in enumerate(TOKEN_MEAN_STATS):
            if key != "kl" or mini.ref_logprobs is not None:
                record[key] = values[2 + i] / max(values[1], 1.0)
        if n_cf:  # the counterfactual sums come last
            record["counterfactual"], values = values[-1 - n_cf:-1], values[:-1 - n_cf] + values[-1:]
        if split:  # per origin: (token count, token-weighted sums of SPLIT_STATS)
            width = 1 + len(SPLIT_STATS)
            rest = values[2 + len(TOKEN_MEAN_STATS):-1]
            record["split"] = {origin: dict(zip(("tokens", *SPLIT_STATS), rest[j * width:(j + 1) * width]))
                               for j, origin in enumerate(TOKEN_ORIGINS)}
        return record

    def _micro_step(self, micro: TokenBatch, count: Tensor, stats_kwargs: dict) -> Tensor:
        """Forward + backward of one micro-batch; returns its ``[2 + K]`` metric sums (detached)."""
        micro = micro.to(self.device)
        advantages = _weighted_advantages(micro)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(micro.old_logprobs)
        masks = None if micro.token_origin is None else {
            name: micro.token_origin == value for name, value in TOKEN_ORIGINS.items()}
        cf = self._cf_threshold is not None
        inputs = LossInputs(micro.old_logprobs, advantages, micro.loss_mask, micro.ref_logprobs, count,
                            **stats_kwargs, stats_masks=masks, token_rows=cf)
        with self._autocast():
            loss, stats = self.policy(micro.input_ids, micro.attention_mask, micro.labels, inputs)
        (loss * self.loss_scale).backward()
        tokens = stats["num_tokens"].double()
        weighted = [stats[k].double() * tokens if k in stats else tokens.new_zeros(()) for k in TOKEN_MEAN_STATS]
        for name in masks or ():
            part = stats[f"num_tokens/{name}"].double()
            weighted += [part, *(stats[f"{k}/{name}"].double() * part for k in SPLIT_STATS)]
        out = torch.stack([loss.detach().double(), tokens, *weighted])
        return torch.cat([out, self._counterfactual_sums(micro, advantages, masks, stats, stats_kwargs)]) if cf else out

    def _counterfactual_sums(self, micro: TokenBatch, advantages: Tensor, masks: dict | None, stats: dict,
                             stats_kwargs: dict) -> Tensor:
        """:func:`counterfactual.token_sums` of a micro-batch from the per-token rows its loss returned."""
        logp, entropy = stats["token_logprobs"], stats["token_entropy"]
        if self.policy.pack:  # the loss saw the real tokens as one [1, T] row
            real = micro.attention_mask.bool()
            logp, entropy = (t.new_zeros(real.shape).masked_scatter(real, t[0]) for t in (logp, entropy))
        if stats_kwargs:
            mean, std = stats_kwargs["entropy_mean"], stats_kwargs["entropy_std"]
        else:  # micro_batch scope: the loss took this micro-batch's own statistics
            mean, std = entropy_stats_from_moments(entropy_moments(entropy, micro.loss_mask))
        return counterfactual.token_sums(logp, entropy, micro.old_logprobs, advantages, micro.loss_mask,
                                         micro.entropy, self._cf_threshold, masks, self.config.loss, mean, std)

    def _entropy_moments(self, local: TokenBatch, parts: list[TokenBatch]) -> Tensor:
        """Global ``(sum H, sum H^2, count)`` of the mini-batch's valid tokens (one all-reduce)."""
        if self.config.entropy_stats_scope == "micro_batch":
            entropy = torch.zeros_like(local.loss_mask)  # only the count is used
        elif local.entropy is not None:
            entropy = local.entropy
        else:
            with torch.no_grad():
                parts = [m.to(self.device) for m in parts]
                moments = sum(entropy_moments(self._forward(m)[1], m.loss_mask) for m in parts)
            return self._all_reduce(moments)
        return self._all_reduce(entropy_moments(entropy.to(self.device), local.loss_mask.to(self.device)))

    def _reduce_and_clip(self) -> Tensor:
        """All-reduce gradients when replicated without FSDP; clip; return the pre-clip total norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.world_size > 1 and not self.use_fsdp:
            for p in params:
                dist.all_reduce(p.grad)
        max_norm = self.optim_config.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _finish_step(self, finite: bool) -> dict[str, float]:
        """Step (or skip a non-finite step: the schedule does not advance), then zero the grads."""
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"skipped": float(not finite)}

    # --- weights --------------------------------------------------------------------------------

    def iter_weight_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None) -> Iterator[dict[str, Tensor]]:
        """Full weights with HF names, one size-bounded bucket at a time (collective: every rank
        must exhaust the iterator, in step, since each sharded parameter is all-gathered).

        A bucket holds parameters until their bytes reach ``bucket_bytes`` (one larger parameter
        closes it: a bucket holds at most ``bucket_bytes`` plus one parameter); it is gathered when
        asked for and dropped by the caller before the next, so the extra memory is one bucket, not
        the model. Tied parameters are gathered once and listed under each name. Tensors stay on
        the parameters' device.

        Args:
            bucket_bytes: the size that closes a bucket.
            dtype: the rollout engine's dtype: each rank casts its shard first and the gather runs
                in it (bf16: half the bytes of gathering fp32 and casting after). None: the
                parameters' own dtype.
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        names: dict[int, list[str]] = {}
        params: dict[int, Tensor] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            names.setdefault(id(value), []).append(name)
            params[id(value)] = value
        bucket: dict[str, Tensor] = {}
        size = 0
        for key, value in params.items():
            full = value.detach() if dtype is None else value.detach().to(dtype)  # a shard is cast locally
            if hasattr(full, "full_tensor"):  # an FSDP2 shard (DTensor): all-gather it
                full = full.full_tensor()
            for name in names[key]:
                bucket[name] = full
            size += full.numel() * full.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = {}, 0
        if bucket:
            yield bucket

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, Tensor]:
        """Full (unsharded) CPU weights with HF names (collective: every rank must call it).

        Args:
            rank0_only: gather on rank 0 only (other ranks get ``{}``), else on every rank.
        Returns:
            ``{hf_name: tensor}`` for ``load_state_dict`` / ``save_pretrained``. A rollout engine
            takes :meth:`iter_weight_buckets` instead (one bucket at a time, not the whole model).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        state = get_model_state_dict(self.model, options=options)
        return {name: tensor.detach().cpu() for name, tensor in state.items()}
