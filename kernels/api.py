"""Public entry points: the AEPO loss from logits or from hidden states, and an ``nn.Module``.

Both loss functions take the one-pass path (:mod:`aepo_kernels.one_pass`): log-probs, entropies,
the loss and its gradient come out of one sweep per row, and backward only scales the stored
gradient. Its inputs must all be known before the sweep:
- the aggregation normalisers: ``global_token_count`` / ``global_num_seqs`` when given, else the
  call's own (computed from ``loss_mask`` on the device, no host sync);
- the entropy z-score statistics ``entropy_mean``/``entropy_std`` when ``entropy_adv_alpha != 0``.
  When they are not supplied the path is two-phase: a no-grad log-prob/entropy pass over the
  same logits (hidden states: one more logits matmul) gives this call's statistics, then the
  one pass runs with them. The trainer supplies global statistics, so it never pays for that.
``backend="reference"`` runs :mod:`aepo_kernels.reference`-style full-fp32 autograd instead.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import LossConfig
from .fused_linear import DEFAULT_CHUNK_BYTES, FusedLinearAEPOLossFunction, fused_linear_logprob_entropy, token_chunk_for_budget
from .logits_ops import _as_3d, _resolve_backend, logprob_entropy
from .one_pass import OnePassLossFunction, RowInputs, aggregation_weights, one_pass_loss_traceable
from .policy_loss import _loss_stats, apply_token_weights, entropy_moments, entropy_stats_from_moments, policy_loss_from_logprobs


def _row_inputs(labels, old_logprobs, advantages, loss_mask, config, entropy_stats, global_token_count,
                global_num_seqs, ref_logprobs, token_weights=None) -> RowInputs:
    """Per-token inputs shaped like ``labels`` (``[N]`` or ``[B, T]``), before flattening to 3-D."""
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    advantages = apply_token_weights(advantages, token_weights, labels.shape)
    if advantages.dim() == labels.dim() - 1 and advantages.shape == labels.shape[:-1]:
        advantages = advantages.unsqueeze(-1).expand(labels.shape)  # per sequence -> per token
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != labels.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must be shaped like labels {tuple(labels.shape)}"
                             + (" (or [B] per sequence)" if name == "advantages" else ""))
    weight = aggregation_weights(loss_mask, config, global_token_count, global_num_seqs)
    mean, std = entropy_stats
    return RowInputs(old_logprobs.float().detach(), advantages.float().detach(), weight, mean, std,
                     None if ref_logprobs is None else ref_logprobs.float().detach())


def _entropy_stats(config, loss_mask, entropy_mean, entropy_std, entropy_pass):
    """The z-score statistics: supplied, unused (alpha 0), or from a no-grad pass (two-phase)."""
    if entropy_mean is not None and entropy_std is not None:
        return torch.as_tensor(entropy_mean).float(), torch.as_tensor(entropy_std).float()
    if config.entropy_adv_alpha == 0.0:
        zero = loss_mask.new_zeros((), dtype=torch.float32)
        return zero, zero + 1
    with torch.no_grad():
        entropy = entropy_pass()
    return entropy_stats_from_moments(entropy_moments(entropy, loss_mask))


def _as_3d_inputs(inputs: RowInputs, shape3) -> RowInputs:
    view = lambda t: None if t is None else t.reshape(shape3)  # noqa: E731
    return RowInputs(view(inputs.old_logprobs), view(inputs.advantages), view(inputs.weight),
                     inputs.entropy_mean.to(inputs.weight.device), inputs.entropy_std.to(inputs.weight.device),
                     view(inputs.ref_logprobs))


def _stats(rows, loss_mask, config, has_ref, stats_masks=None) -> dict[str, torch.Tensor]:
    logp, entropy, _, ratio, shaped, kl = (r.reshape(loss_mask.shape) for r in rows)
    return _loss_stats(entropy, ratio, shaped, loss_mask, config, kl if has_ref else None, stats_masks)


def aepo_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    backend: str = "auto",
    inplace_backward: bool = False,
    entropy_mean: torch.Tensor | None = None,
    entropy_std: torch.Tensor | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ignore_index: int = -100,
    token_weights: torch.Tensor | None = None,
    stats_masks: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from logits in one pass (spec §0, §2b-2d).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` (logits of position t predict ``labels[t]``), unit
            stride on V (other strides are kept: ``logits[:, :-1]`` is not copied).
        labels: ``[N]`` / ``[B, T]`` sampled token ids; ``ignore_index`` rows have log-prob 0.
        old_logprobs, loss_mask, ref_logprobs: shaped like ``labels``; advantages: the same or
            ``[B]`` per sequence. See :func:`policy_loss_from_logprobs`.
        config: :class:`LossConfig`; temperature: the sampling temperature.
        backend: ``"auto" | "triton" | "torch" | "reference"``.
        inplace_backward: the gradient is written over the logits buffer during the forward call
            (no second ``[N, V]`` tensor). Afterwards ``logits`` holds dL/dlogits (for an incoming
            gradient of 1); its version counter is bumped, so an autograd node that saved these
            logits earlier raises instead of reading gradients. Do not read them afterwards.
        entropy_mean, entropy_std: global z-score statistics (see module docstring).
        global_token_count, global_num_seqs: normalisers of the aggregation.
        token_weights: detached per-token weights of the policy-gradient term, shaped like
            ``labels`` (importance-sampling weights; :func:`aepo_kernels.apply_token_weights`).
        stats_masks: name -> mask shaped like ``labels``: the statistics again over each mask's
            valid tokens, as ``<stat>/<name>`` (e.g. tokens of branched trajectories); no extra pass.
    Returns:
        ``(loss, stats)`` with stats a dict of detached scalar tensors (entropy, ratio,
        clipfrac_high/low(/dual), num_tokens, kl with ``ref_logprobs``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    backend = _resolve_backend(backend, logits)
    if backend == "reference":
        logprobs, entropy = logprob_entropy(logits, labels, temperature, backend="reference", ignore_index=ignore_index)
        return policy_loss_from_logprobs(
            logprobs, entropy, old_logprobs, advantages, loss_mask, config=config, entropy_mean=entropy_mean,
            entropy_std=entropy_std, global_token_count=global_token_count, global_num_seqs=global_num_seqs,
            ref_logprobs=ref_logprobs, token_weights=token_weights, stats_masks=stats_masks)
    if torch.compiler.is_compiling():
        # Under a caller's torch.compile: the custom op (opaque to the compiler, never in place).
        entropy_pass = lambda: _traceable(logits.detach(), labels, old_logprobs, advantages, loss_mask,  # noqa: E731
                                          LossConfig(entropy_adv_alpha=0.0), temperature, ignore_index, backend)[1][1]
    else:
        entropy_pass = lambda: logprob_entropy(logits.detach(), labels, temperature, backend=backend,  # noqa: E731
                                               ignore_index=ignore_index)[1]
    stats = _entropy_stats(config, loss_mask, entropy_mean, entropy_std, entropy_pass)
    inputs = _row_inputs(labels, old_logprobs, advantages, loss_mask, config, stats, global_token_count,
                         global_num_seqs, ref_logprobs, token_weights)
    logits3, labels3 = _as_3d(logits, labels)
    inputs = _as_3d_inputs(inputs, labels3.shape)
    if torch.compiler.is_compiling():
        loss, rows = one_pass_loss_traceable(logits3, labels3, inputs, config, 1.0 / temperature, ignore_index, backend)
    else:
        in_place = inplace_backward and logits3.requires_grad and torch.is_grad_enabled()
        loss, rows = OnePassLossFunction.apply(logits3, labels3, inputs, config, 1.0 / temperature, ignore_index, backend, in_place)
    return loss, _stats(rows, loss_mask, config, ref_logprobs is not None, stats_masks)


def _traceable(logits, labels, old_logprobs, advantages, loss_mask, config, temperature, ignore_index, backend):
    """``(loss, rows)`` through the custom op, statistics unused (alpha_H = 0): the entropy pass
    of the two-phase path under torch.compile."""
    zero = torch.zeros((), device=logits.device)
    inputs = _row_inputs(labels, old_logprobs, advantages, loss_mask, config, (zero, zero + 1), None, None, None)
    logits3, labels3 = _as_3d(logits, labels)
    rows = one_pass_loss_traceable(logits3, labels3, _as_3d_inputs(inputs, labels3.shape), config, 1.0 / temperature,
                                   ignore_index, backend)[1]
    return None, rows.reshape(6, *labels.shape)


def fused_linear_aepo_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    entropy_mean: torch.Tensor | None = None,
    entropy_std: torch.Tensor | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    ignore_index: int = -100,
    token_weights: torch.Tensor | None = None,
    stats_masks: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from hidden states ``[N, D]``/``[B, T, D]`` and lm_head ``weight [V, D]``
    (optional ``bias [V]``), never materialising ``[N, V]``, gradient computed in the forward loop.

    Args (others as :func:`aepo_policy_loss`):
        backend: the row op on each logits block: ``"auto"`` (triton on CUDA) | ``"torch"`` | ``"triton"``.
        chunk_bytes: memory budget of the one ``[token_chunk, V]`` logits block
            (``token_chunk = chunk_bytes // (V * 4)``), unless ``token_chunk`` is given.
        vocab_chunk: vocab block of the no-grad entropy pass of the two-phase path only.
    Returns:
        ``(loss, stats)`` as :func:`aepo_policy_loss`; gradients flow to hidden, weight and bias.
    Cost: 3 matmuls of 2 N D V flops (logits, d_hidden, d_weight), an fp32 ``[V, D]`` weight-gradient
    accumulator (the gradient itself for fp32 weights), one ``[token_chunk, V]`` block; on CPU,
    non-fp32 weights are converted to fp32 once per call.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"shapes: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}")
    backend = _resolve_backend(backend, hidden)
    if backend == "reference":
        raise ValueError("backend='reference': use aepo_policy_loss on materialised logits")
    stats = _entropy_stats(config, loss_mask, entropy_mean, entropy_std, lambda: fused_linear_logprob_entropy(
        hidden.detach(), weight.detach(), labels, temperature, bias=None if bias is None else bias.detach(),
        ignore_index=ignore_index, vocab_chunk=vocab_chunk, chunk_bytes=chunk_bytes)[1])
    inputs = _row_inputs(labels, old_logprobs, advantages, loss_mask, config, stats, global_token_count,
                         global_num_seqs, ref_logprobs, token_weights)
    n_tokens = labels.numel()
    inputs = _as_3d_inputs(inputs, (1, n_tokens))
    token_chunk = token_chunk or token_chunk_for_budget(weight.shape[0], chunk_bytes)
    loss, rows = FusedLinearAEPOLossFunction.apply(
        hidden.reshape(n_tokens, hidden.shape[-1]), weight, bias, labels.reshape(1, n_tokens).long(), inputs, config,
        1.0 / temperature, ignore_index, backend, token_chunk)
    return loss, _stats(rows, loss_mask, config, ref_logprobs is not None, stats_masks)


class AEPOLoss(nn.Module):
    """``nn.Module`` around :func:`aepo_policy_loss` holding the config, temperature and backend."""

    def __init__(self, config: LossConfig = LossConfig(), temperature: float = 1.0, backend: str = "auto", inplace_backward: bool = False):
        super().__init__()
        self.config, self.temperature = config, temperature
        self.backend, self.inplace_backward = backend, inplace_backward

    def forward(self, logits, labels, old_logprobs, advantages, loss_mask, **loss_kwargs):
        return aepo_policy_loss(
            logits, labels, old_logprobs, advantages, loss_mask, config=self.config,
            temperature=self.temperature, backend=self.backend, inplace_backward=self.inplace_backward, **loss_kwargs,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, temperature={self.temperature}, backend={self.backend!r}"
