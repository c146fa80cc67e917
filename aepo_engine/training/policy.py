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
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from aepo_engine.distributed import init_distributed
from aepo_engine.models.lora import apply_lora, initial_adapter, is_adapter
from aepo_engine.native_dtype import native_dtype
from aepo_engine.training import counterfactual
from aepo_engine.training.attention import packed_row_kwargs
from aepo_engine.training.loading import build_meta_model, load_hf_model, load_sharded_weights
from aepo_engine.training.config import OptimConfig, PolicyConfig  # PolicyConfig re-exported: its old home
from aepo_engine.training.optim import build_lr_scheduler
from aepo_engine.training.batch import IGNORE_INDEX, TOKEN_ORIGINS, TokenBatch
from aepo_engine.training.layout import (BatchLayout, LossInputs, RowModelInputs, TreeLossInputs, Purpose,
                                        batch_layout)
from aepo_engine.training.tree import TreeInputs
from aepo_kernels import (
    LossConfig,
    aepo_policy_loss,
    aepo_tree_policy_loss,
    apply_token_weights,
    entropy_moments,
    entropy_stats_from_moments,
    fused_linear_aepo_policy_loss,
    fused_linear_aepo_tree_policy_loss,
    fused_linear_logprob_entropy,
    logprob_entropy,
)
from aepo_kernels.policy_loss import weight_total

# LossInputs / TreeLossInputs: their home is training.layout (re-exported here, their old one)
__all__ = ["LossInputs", "PolicyConfig", "PolicyModel", "PolicyWorker", "TreeLossInputs"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Per-call statistics of the loss that are token means (re-weighted by tokens).
TOKEN_MEAN_STATS = ("entropy", "ratio", "clipfrac_high", "clipfrac_low", "clipfrac_dual", "kl")
# The same statistics again per token origin (batch.token_origin: branched vs global tokens),
# reported as "<stat>/<origin>" next to "tokens/<origin>"; token-weighted over the whole update.
SPLIT_STATS = ("entropy", "clipfrac_high", "clipfrac_low")


def _weighted_advantages(micro: TokenBatch) -> Tensor:
    """Advantages times the rollout-correction weights (``[B, L]``), or as they are
    (:func:`aepo_kernels.apply_token_weights`: exact for the weighted policy-gradient term)."""
    return apply_token_weights(micro.advantages, micro.token_weights, micro.old_logprobs.shape)


# --- the module FSDP wraps ------------------------------------------------------------------------

class PolicyModel(nn.Module):
    """An HF causal LM returning per-token ``(logprobs, entropy)`` of ``labels``, or, given
    :class:`LossInputs`, the AEPO loss and its statistics (the FSDP root).

    Wrapping keeps the lm_head inside the root's forward, so FSDP2 gathers its weight for the fused
    kernels (which read ``weight`` directly instead of calling the head).
    """

    def __init__(self, hf_model: nn.Module, temperature: float, fused: bool, chunk_bytes: int | None,
                 loss_config: LossConfig | None = None, pack: bool = False, row_bounds: bool = False,
                 head_backward: str = "auto"):
        super().__init__()
        self.hf = hf_model
        self.temperature, self.fused, self.pack = temperature, fused, pack
        self.row_bounds = pack and row_bounds  # hand the attention the packed rows' bounds
        self.chunk_bytes, self.loss_config = chunk_bytes, loss_config or LossConfig()
        self.head_backward = head_backward  # the fused head's loop order (policy.head_backward; docs/head.md)

    @property
    def decoder(self) -> nn.Module:
        return getattr(self.hf, self.hf.base_model_prefix)

    def forward(self, inputs: RowModelInputs | TreeInputs, loss_inputs: LossInputs | TreeLossInputs | None = None):
        """The batch layout's inputs (:mod:`aepo_engine.training.layout`) run their own forward:
        :meth:`rows_forward` or :meth:`tree_forward`."""
        return inputs.run(self, loss_inputs)

    def rows_forward(self, inputs: RowModelInputs, loss_inputs: LossInputs | None):
        """RowLayout ``[B, L]`` each, right-padded. Returns: fp32 ``(logprobs, entropy)`` ``[B, L]`` (0 logp
        at -100 and on padding), or with ``loss_inputs`` ``(loss, stats)``."""
        input_ids, attention_mask, labels = inputs.input_ids, inputs.attention_mask, inputs.labels
        if not self.pack:
            hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            if loss_inputs is not None:
                return self._loss(hidden, labels, loss_inputs)
            return self._head(hidden, labels)  # hidden: [B, L, D]
        # Padding-free: the T real tokens as one row; position ids restart at 0 for every
        # original row, which is how HF detects the packed rows (varlen / block-diagonal mask).
        real = attention_mask.bool()  # [B, L]
        positions = (attention_mask.cumsum(-1) - 1)[real]  # [T]
        # the rows' bounds once per micro-batch, not per layer (varlen / flash-attn kernels)
        bounds = packed_row_kwargs(real.sum(-1)) if self.row_bounds else {}
        hidden = self.decoder(input_ids=input_ids[real][None], position_ids=positions[None],
                              attention_mask=None, use_cache=False, **bounds).last_hidden_state  # [1, T, D]
        if loss_inputs is not None:
            return self._loss(hidden, labels[real][None], loss_inputs.packed(real))
        logprobs, entropy = self._head(hidden, labels[real][None])  # [1, T] each
        return (logprobs.new_zeros(real.shape).masked_scatter(real, logprobs[0]),
                entropy.new_zeros(real.shape).masked_scatter(real, entropy[0]))

    def _loss_kwargs(self, inputs: LossInputs | TreeLossInputs) -> dict:
        """The loss functions' keyword options (both layouts carry these fields)."""
        return dict(config=self.loss_config, temperature=self.temperature, ref_logprobs=inputs.ref_logprobs,
                    global_token_count=inputs.global_token_count, entropy_mean=inputs.entropy_mean,
                    entropy_std=inputs.entropy_std, stats_masks=inputs.stats_masks, return_token_loss=inputs.token_rows)

    def tree_forward(self, tree: TreeInputs, inputs: TreeLossInputs | None):
        """The forest's nodes as one sequence (depths as position ids, the tree mask); node n's
        loss row is its token predicted from its parent's hidden state. Returns ``(logprobs,
        entropy)`` ``[N]`` per node, or with ``inputs`` the tree loss ``(loss, stats)``."""
        hidden = self.decoder(input_ids=tree.tokens, position_ids=tree.depth, attention_mask=None, use_cache=False,
                              tree_mask=tree.mask).last_hidden_state  # [1, N, D]
        hidden = hidden[0, tree.parent.clamp(min=0)]  # [N, D]; a root's row has no label
        if inputs is None:
            logprobs, entropy = self._head(hidden[None], tree.labels[None])
            return logprobs[0], entropy[0]
        head = self.hf.get_output_embeddings()
        hidden = _in_compute_dtype(hidden)
        kwargs = self._loss_kwargs(inputs)
        args = (tree.labels, inputs.old_logprobs, inputs.occurrences)
        if self.fused:
            return fused_linear_aepo_tree_policy_loss(hidden, head.weight, *args, bias=head.bias,
                                                      chunk_bytes=self.chunk_bytes, shift_labels=False,
                                                      head_backward=self.head_backward, **kwargs)
        # logits [N, V]; node row n predicts labels[n] (the tree loss refuses shift_labels=True)
        return aepo_tree_policy_loss(head(hidden), *args, inplace_backward=True, shift_labels=False, **kwargs)

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
        kwargs = self._loss_kwargs(inputs)
        args = (labels, inputs.old_logprobs, inputs.advantages, inputs.loss_mask)
        if self.fused:
            return fused_linear_aepo_policy_loss(hidden, head.weight, *args, bias=head.bias,
                                                 chunk_bytes=self.chunk_bytes, shift_labels=False,
                                                 head_backward=self.head_backward, **kwargs)
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
        if config.deterministic:  # before anything runs on the device (PolicyConfig.deterministic)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.rank, self.world_size, self.device = init_distributed()
        self.use_fsdp = config.fsdp == "on" or (config.fsdp == "auto" and self.world_size > 1)
        if self.use_fsdp and not dist.is_initialized():
            raise RuntimeError("fsdp='on' needs torch.distributed (launch with torchrun)")
        on_meta = self.use_fsdp and config.sharded_load
        load = build_meta_model if on_meta else load_hf_model
        self.model = load(model_path, config.attn_implementation)
        self.lora = config.lora if config.lora.enabled else None
        if self.lora is not None:  # before sharding: FSDP2 shards the adapters with their layers
            apply_lora(self.model, self.lora)
        # rows or the rollout tree: everything that depends on it is the layout's (training.layout)
        self.layout: BatchLayout = batch_layout(config, self.rank, self.world_size)
        self.layout.prepare(self.model)
        if config.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy = PolicyModel(self.model, temperature, config.use_fused_linear, config.fused_chunk_bytes,
                                  loss_config=config.loss, pack=config.packs,
                                  row_bounds=config.attn_implementation in ("varlen", "flash_attention_2"),
                                  head_backward=config.head_backward)
        self._shard_or_place()
        if on_meta:  # the shards exist now: allocate them and read this rank's rows
            load_sharded_weights(self.model, model_path, self.device,
                                 initial=initial_adapter(self.model) if self.lora is not None else None)
        # Only what trains (every weight, or the adapters under LoRA) gets AdamW moments.
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=optim.lr, betas=optim.betas,
                                           eps=optim.eps, weight_decay=optim.weight_decay)
        self.scheduler = build_lr_scheduler(self.optimizer, optim, total_steps)
        # FSDP2 averages gradients over ranks; scale so the sum (the global token-mean) survives.
        self.loss_scale = float(self.world_size) if self.use_fsdp else 1.0
        self.skipped_steps = 0
        self.pushed_bytes = 0  # bytes of the last weight push's tensors (iter_weight_buckets)
        self._cf_threshold: Tensor | None = None  # set per update() (counterfactual_stats)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates: all of them, or the adapters under LoRA."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _shard_or_place(self) -> None:
        if not self.use_fsdp:
            self.policy.to(self.device)
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[native_dtype(self.config.param_dtype, self.device.type)],
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
        dtype = DTYPES[native_dtype(self.config.param_dtype, self.device.type)]
        if self.use_fsdp or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    # --- forward helpers ------------------------------------------------------------------------

    def _values(self, micro) -> tuple[Tensor, Tensor]:
        """``(logprobs, entropy)`` ``[b, l]`` of a micro-batch already on ``self.device``."""
        with self._autocast():
            return self.layout.values(self.policy, micro)

    def _parts(self, local: TokenBatch, purpose: Purpose = "update") -> tuple[list, int]:
        """This rank's micro-batches (the layout's), padded with ones that change nothing to the
        same count on every rank (FSDP's collectives run per forward/backward); returns
        ``(micro_batches, real_count)``."""
        parts = self.layout.micro_batches(local, purpose)
        real = len(parts)
        if self.world_size > 1 and self.layout.uneven:  # one host sync, only where counts can differ
            count = torch.tensor([real], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            parts += [self.layout.filler(local, purpose)] * (int(count) - real)
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
        local = self.layout.shard(batch)
        parts, real = self._parts(local, "logprobs")
        outs = [self._values(micro.to(self.device)) for micro in parts][:real]
        pad = lambda t: nn.functional.pad(t.float(), (0, width - t.shape[1]))  # noqa: E731
        local_out = torch.stack([torch.cat([pad(o[i]) for o in outs]) for i in (0, 1)])  # [2, b, L]
        logprobs, entropy = self.layout.gather(local_out, batch).cpu().unbind(0)
        # no label, no prediction: padding and the last token hold whatever the batch layout gave
        return logprobs, entropy * (batch.labels != IGNORE_INDEX)

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
        not_averaged = ("tokens", "skipped", "split", "counterfactual", "positions", "row_positions")
        out = {key: sum(r[key] for r in done) / len(done) for key in done[0] if key not in not_averaged}
        out["grad_norm_max"] = max(r["grad_norm"] for r in records)
        out["tokens"] = sum(r["tokens"] for r in records)
        out["positions"] = sum(r["positions"] for r in records)
        out["position_ratio"] = out["positions"] / max(1.0, sum(r["row_positions"] for r in records))
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
        local = self.layout.shard(mini)
        parts, real = self._parts(local)
        moments = self._entropy_moments(local, parts)  # [3] global (sum H, sum H^2, count)
        stats_kwargs = {}
        if self.config.entropy_stats_scope == "global":
            stats_kwargs = dict(zip(("entropy_mean", "entropy_std"), entropy_stats_from_moments(moments)))
        count = weight_total(moments[2]).float()
        split = mini.token_origin is not None
        n_cf = len(counterfactual.GROUPS) * len(counterfactual.SUMS) if self._cf_threshold is not None else 0
        sums = torch.zeros(2 + len(TOKEN_MEAN_STATS) + split * len(TOKEN_ORIGINS) * (1 + len(SPLIT_STATS)) + n_cf,
                           dtype=torch.float64, device=self.device)
        for micro in parts:
            sums += self._micro_step(micro, count, stats_kwargs)
        positions = torch.tensor([sum(self.layout.positions(p)[i] for p in parts[:real]) for i in (0, 1)],
                                 dtype=torch.float64, device=self.device)
        sums = self._all_reduce(torch.cat([sums, positions]))
        grad_norm = self._reduce_and_clip()
        values = torch.cat([sums, grad_norm.reshape(1).double()]).tolist()  # the one host sync
        record = self._finish_step(math.isfinite(values[-1]))
        record.update(positions=values[-3], row_positions=values[-2])
        values = values[:-3] + values[-1:]
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

    def _micro_step(self, micro, count: Tensor, stats_kwargs: dict) -> Tensor:
        """Forward + backward of one micro-batch (the layout's); returns its ``[2 + K]`` metric sums (detached)."""
        micro = micro.to(self.device)
        rows = self.layout.rows(micro)
        advantages = _weighted_advantages(rows)
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(rows.old_logprobs)
        masks = None if rows.token_origin is None else {
            name: rows.token_origin == value for name, value in TOKEN_ORIGINS.items()}
        cf = self._cf_threshold is not None
        with self._autocast():
            loss, stats, token_rows = self.layout.loss(self.policy, micro, advantages, masks, count, stats_kwargs, cf)
        (loss * self.loss_scale).backward()
        tokens = stats["num_tokens"].double()
        weighted = [stats[k].double() * tokens if k in stats else tokens.new_zeros(()) for k in TOKEN_MEAN_STATS]
        for name in masks or ():
            part = stats[f"num_tokens/{name}"].double()
            weighted += [part, *(stats[f"{k}/{name}"].double() * part for k in SPLIT_STATS)]
        out = torch.stack([loss.detach().double(), tokens, *weighted])
        if not cf:
            return out
        return torch.cat([out, self._counterfactual_sums(rows, advantages, masks, *token_rows, stats_kwargs)])

    def _counterfactual_sums(self, micro: TokenBatch, advantages: Tensor, masks: dict | None, logp: Tensor,
                             entropy: Tensor, stats_kwargs: dict) -> Tensor:
        """:func:`counterfactual.token_sums` of a micro-batch from the per-token rows its loss returned."""
        if stats_kwargs:
            mean, std = stats_kwargs["entropy_mean"], stats_kwargs["entropy_std"]
        else:  # micro_batch scope: the loss took this micro-batch's own statistics
            mean, std = entropy_stats_from_moments(entropy_moments(entropy, micro.loss_mask))
        return counterfactual.token_sums(logp, entropy, micro.old_logprobs, advantages, micro.loss_mask,
                                         micro.entropy, self._cf_threshold, masks, self.config.loss, mean, std)

    def _entropy_moments(self, local: TokenBatch, parts: list) -> Tensor:
        """Global ``(sum H, sum H^2, count)`` of the mini-batch's valid tokens (one all-reduce)."""
        if self.config.entropy_stats_scope == "micro_batch":
            entropy = torch.zeros_like(local.loss_mask)  # only the count is used
        elif local.entropy is not None:
            entropy = local.entropy
        else:
            with torch.no_grad():
                parts = [m.to(self.device) for m in parts]
                moments = sum(entropy_moments(self._values(m)[1], self.layout.rows(m).loss_mask) for m in parts)
            return self._all_reduce(moments)
        return self._all_reduce(entropy_moments(entropy.to(self.device), local.loss_mask.to(self.device)))

    def _reduce_and_clip(self) -> Tensor:
        """All-reduce gradients when replicated without FSDP; clip; return the pre-clip total norm."""
        params = [p for p in self.trainable_parameters() if p.grad is not None]
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
        must exhaust the iterator, in step, since each sharded parameter is all-gathered). Under
        LoRA only the adapter's tensors (the base weights never change: the engine has them).

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
            if self.lora is not None and not is_adapter(name):
                continue
            names.setdefault(id(value), []).append(name)
            params[id(value)] = value
        bucket: dict[str, Tensor] = {}
        size = 0
        self.pushed_bytes = 0  # this push's distinct tensors (a tied one once): the metric engine/push_bytes
        for key, value in params.items():
            full = value.detach() if dtype is None else value.detach().to(dtype)  # a shard is cast locally
            if hasattr(full, "full_tensor"):  # an FSDP2 shard (DTensor): all-gather it
                full = full.full_tensor()
            for name in names[key]:
                bucket[name] = full
            size += full.numel() * full.element_size()
            self.pushed_bytes += full.numel() * full.element_size()
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
