"""The one-pass AEPO loss: log-prob, entropy, shaped advantage, clipped ratio, loss and dlogits
in one sweep per row, from logits ``[B, T, V]`` (this module's CPU path, or the Triton kernel in
:mod:`aepo_kernels.triton_kernels`).

Every per-token input of the loss is known before the pass: old log-probs, advantages, the
aggregation weight ``w_t`` (loss mask / normaliser, :func:`aggregation_weights`), reference
log-probs, and the entropy z-score statistics (supplied by the caller, e.g. all-reduced by the
trainer). So per row, with u = z / T (or the soft-capped/scaled map of
:func:`aepo_kernels.logits_ops.logit_map`) and p = softmax(u):
    1. one read of the row: lse, Eu (online softmax) -> logp = u_y - lse, H = lse - Eu;
    2. per-token head (:func:`token_head`): A_t = A (1 + alpha (H - mean) / std), the ratio with
       the log-ratio clamp, the clip rule, k3 KL, entropy bonus -> L_t and its explicit
       derivatives dL_t/dlogp, dL_t/dH; scaled by w_t they are g_lp, g_H;
    3. a second read of the row writes ``dlogits = (g_lp (onehot - p) + g_H p (Eu - u)) du/dz`` into a
       new buffer or over the logits themselves (in place).
The autograd backward then only scales the stored gradient by the incoming scalar gradient.
Bytes: read the logits twice, write them once -- the same as a separate forward and backward,
but with no saved activations and nothing left for backward to do.

The loss is ``sum_t w_t L_t``; per-row ``(logp, H, L_t, ratio, A_t, kl)`` come back as detached
vectors for the statistics (clip fractions etc., :func:`aepo_kernels.policy_loss.loss_stats`):
no host sync. The maths of the head is exactly :func:`aepo_kernels.policy_loss.clipped_token_loss`
(values and autograd gradients), written with explicit derivatives; the oracle for both is
:mod:`aepo_kernels.reference`.

Backends: the Triton kernel does all three steps in one program per row; so does the native C
kernel (:mod:`aepo_kernels.native`), which takes fp32 CPU logits without a soft cap, one row at a
time while it sits in the core's cache, with one ``exp`` per element. The compiled torch path
(every other CPU case, or all of them with ``AEPO_CPU_NATIVE=0``) works per chunk of rows (a
whole sequence, :func:`aepo_kernels.logits_ops.cpu_chunk_elems`): the stats sweep, the head and
the gradient sweep are three compiled functions run back to back on the chunk
(:func:`torch_one_pass`). A caller's
``torch.compile(fullgraph=True)`` sees the op as the custom op ``aepo_kernels::one_pass_loss``
(:func:`one_pass_loss_op`, never in place). With ``in_place`` the logits are overwritten during
the forward call (their version counter is bumped, so a node that saved them earlier raises).

Hyper-parameters, the clip rule included, are runtime values (a small tensor here, scalar kernel
arguments in Triton): changing any of them never recompiles.

A row without a valid target (its label is ``ignore_index`` or outside ``[0, V)``) has log-prob 0,
``L_t = 0`` and no gradient on every backend, whatever its weight: such a label is never counted
(the public functions refuse it, or on CUDA take it out of the mask and fail at the next sync:
:mod:`aepo_kernels.contract`).

Gradients flow to the logits only: old log-probs, advantages, weights and the entropy statistics
are treated as constants (as everywhere in this package). ``-inf`` logits (a masked vocabulary)
are supported on every backend (probability 0, gradient 0; :mod:`aepo_kernels.logits_ops`); rows
whose logits are all ``-inf`` are not.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from . import native
from .compile import compiled
from .config import HYPER_PARAMS, LossConfig, hyper_params
from .logits_ops import (
    _row_chunks, accumulate_dtype, fast_chunk_grad_inplace, fast_chunk_grad_into, fast_chunk_stats, finish_stats, map_logits,
)
from .policy_loss import weight_total
from .row_inputs import RowInputs

# ---------------------------------------------------------------------------------------------
# The per-token head: values and explicit derivatives.


def token_head(logp, entropy, old_logp, adv, ref_logp, ent_mean, ent_std, hp, adv_neg=None):
    """Per-token loss ``L_t`` and its derivatives, elementwise over any shape.

    Args:
        logp, entropy: current log-probs and entropies (values; their dtype is the math dtype).
        old_logp, adv, ref_logp: per-token inputs (``ref_logp`` is ignored when hp says it is
            absent); ent_mean, ent_std: 0-d statistics. hp: the :func:`aepo_kernels.config.hyper_params` vector.
        adv_neg: optional second advantage column (a folded tree node, :mod:`aepo_kernels.tree_loss`):
            the policy-gradient term is evaluated at both and summed; KL and entropy bonus once.
    Returns:
        ``(loss, d_logp, d_entropy, ratio, shaped_adv, kl)`` -- kl is 0 without reference log-probs;
        with ``adv_neg``, ``shaped_adv`` is the sum of both shaped columns.
    The derivatives are those autograd finds for :func:`policy_loss.clipped_token_loss` (+ KL and
    entropy bonus), including the log-ratio clamp's zero gradient outside ``[-c, c]``. All four
    clip rules are evaluated and one is selected: cheap per token, and one compiled graph.
    """
    eps_low, eps_high, dual, clamp_c, alpha, kl_coef, ent_coef, rule, has_ref = hp.unbind()
    std = torch.where(ent_std > 0, ent_std, torch.ones_like(ent_std))
    shaped = adv * (1 + alpha * (entropy - ent_mean) / std)  # H is detached in the shaping
    diff = logp - old_logp
    log_ratio = torch.minimum(torch.maximum(diff, -clamp_c), clamp_c)
    in_clamp = (diff >= -clamp_c) & (diff <= clamp_c)  # torch.clamp passes the gradient here
    ratio = log_ratio.exp()
    loss, d_logp = _pg_head(shaped, logp, ratio, in_clamp, hp)
    if adv_neg is not None:
        shaped_neg = adv_neg * (1 + alpha * (entropy - ent_mean) / std)
        loss_neg, d_neg = _pg_head(shaped_neg, logp, ratio, in_clamp, hp)
        loss, d_logp, shaped = loss + loss_neg, d_logp + d_neg, shaped + shaped_neg
    # k3 KL: reported whenever reference log-probs are given, in the loss when kl_coef != 0.
    zero = torch.zeros_like(ratio)
    delta = ref_logp - logp
    e_delta = delta.exp()
    kl = torch.where(has_ref != 0, e_delta - delta - 1, zero)
    kl_on = (has_ref != 0) & (kl_coef != 0)
    loss = torch.where(kl_on, loss + kl_coef * kl, loss)
    d_logp = torch.where(kl_on, d_logp + kl_coef * (1 - e_delta), d_logp)
    loss = loss - ent_coef * entropy
    d_entropy = (-ent_coef).expand_as(loss)
    return loss, d_logp, d_entropy, ratio, shaped, kl


def _pg_head(shaped, logp, ratio, in_clamp, hp):
    """The policy-gradient term of :func:`token_head` at the shaped advantage ``shaped``: ``(L_pg, dL_pg/dlogp)``."""
    eps_low, eps_high, dual, _, _, _, _, rule, _ = hp.unbind()
    low, high = 1 - eps_low, 1 + eps_high
    zero = torch.zeros_like(ratio)
    # ppo / aepo / gppo: max(-A r, -A clip(r)), then the dual clip for A < 0.
    is_high, is_low = ratio > high, ratio < low
    pg_plain = -shaped * ratio
    pg_clipped = -shaped * torch.where(is_high, high, torch.where(is_low, low, ratio))
    d_plain = torch.where(in_clamp, pg_plain, zero)  # d(-A r)/dlogp = -A r dlogr/dlogp
    # The clipped branch's gradient: 0 for a constant bound (ppo), bound * dlogr/dlogp for the
    # stop-gradient bound of docs/algorithm.md §2c (aepo: high bound; gppo: both bounds).
    high_grad = torch.where((rule == 1) | (rule == 2), -shaped * high, zero)
    low_grad = torch.where(rule == 2, -shaped * low, zero)
    d_clipped = torch.where(is_high, torch.where(in_clamp, high_grad, zero),
                            torch.where(is_low, torch.where(in_clamp, low_grad, zero), d_plain))
    take_clipped = pg_clipped > pg_plain
    loss = torch.where(take_clipped, pg_clipped, pg_plain)
    d_logp = torch.where(take_clipped, d_clipped, d_plain)
    dual_value = -shaped * dual  # constant: no gradient through the dual clip
    dual_hit = (dual != 0) & (shaped < 0) & (loss > dual_value)
    loss = torch.where(dual_hit, dual_value, loss)
    d_logp = torch.where(dual_hit, zero, d_logp)
    # cispo: -sg(clip(r)) A logp.
    cispo_weight = torch.minimum(torch.maximum(ratio, low), high)
    is_cispo = rule == 3
    loss = torch.where(is_cispo, -shaped * cispo_weight * logp, loss)
    d_logp = torch.where(is_cispo, -shaped * cispo_weight, d_logp)
    return loss, d_logp


# ---------------------------------------------------------------------------------------------
# The fast CPU path: per row chunk, the stats sweep, the head and the gradient sweep, each a
# compiled function (the first and last are logits_ops' own chunk kernels, shared with
# logprob_entropy). Why three functions and not one: docs/benchmarks.md.


def row_head(z, local_labels, m, s, t, old, adv, weight, ref, mean, std, hp, inv_t, tanh_scale=None, adv_neg=None):
    """The per-row middle of the pass for a chunk ``z: [R, V]`` with merged stats ``(m, s, t)``:
    returns ``(lse, eu, g_lp, g_h, rows [6, R])``. ``local_labels`` is the target column or -1
    (no target: logp is the constant 0, and the row has no loss and no gradient whatever its
    weight). ``rows`` stacks ``(logp, H, L_t, ratio, A_t, kl)``; ``adv_neg``: the second advantage
    column or None."""
    acc = m.dtype
    lse, eu = finish_stats(m, s, t)
    valid = local_labels >= 0
    z_y = map_logits(z.gather(-1, local_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), inv_t, tanh_scale).to(acc)
    logp = torch.where(valid, z_y - lse, torch.zeros_like(lse))
    entropy = lse - eu
    loss, d_logp, d_h, ratio, shaped, kl = token_head(
        logp, entropy, old.to(acc), adv.to(acc), ref.to(acc), mean.to(acc), std.to(acc), hp,
        None if adv_neg is None else adv_neg.to(acc))
    weight = torch.where(valid, weight.to(acc), torch.zeros_like(lse))
    g_lp = torch.where(valid, d_logp * weight, torch.zeros_like(d_logp))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return lse, eu, g_lp, d_h * weight, torch.stack([logp, entropy, loss, ratio, shaped, kl])


fast_row_head = compiled(row_head)


def torch_one_pass(logits, labels, inputs: RowInputs, config: LossConfig, inv_t: float, ignore_index: int, out,
                   tanh_scale: float | None = None):
    """CPU path: ``logits [B, T, V]`` -> rows ``[6, B, T]``; dlogits written into ``out``
    (``logits`` itself for in place). ``inv_t``/``tanh_scale``: :func:`aepo_kernels.logits_ops.logit_map`."""
    batch, seq, vocab = logits.shape
    acc = accumulate_dtype(logits.dtype)
    hp = hyper_params(config, inputs.ref_logprobs is not None, acc, logits.device)
    local = torch.where(labels != ignore_index, labels, torch.full_like(labels, -1))
    local = torch.where(local < vocab, local, torch.full_like(local, -1))
    rows_out = torch.empty(6, batch, seq, dtype=acc, device=logits.device)
    # The row chunks of logprob_entropy's CPU path (whole sequences when compiled): chunks small
    # enough to stay in cache for the second sweep lose more to the compiled calls' per-call and
    # per-thread overheads than they gain (docs/benchmarks.md).
    for b, rows in _row_chunks(logits):
        part, z, labels_part = inputs.rows(b, rows), logits[b, rows], local[b, rows]
        stats = fast_chunk_stats(z, inv_t, tanh_scale)
        lse, eu, g_lp, g_h, rows_out[:, b, rows] = fast_row_head(
            z, labels_part, *stats, part.old_logprobs, part.advantages, part.weight, part.ref_or_old,
            part.entropy_mean, part.entropy_std, hp, inv_t, tanh_scale, part.advantages_neg)
        if out is logits:
            fast_chunk_grad_inplace(z, labels_part, lse, eu, g_lp, g_h, inv_t, tanh_scale)
        else:
            fast_chunk_grad_into(z, labels_part, lse, eu, g_lp, g_h, inv_t, out[b, rows], tanh_scale)
    return rows_out


def _triton_one_pass():
    from .triton_kernels import triton_one_pass  # lazily: triton is optional on CPU-only installs

    return triton_one_pass


def one_pass_rows(logits, labels, inputs: RowInputs, config: LossConfig, inv_t: float, ignore_index: int, out, backend: str,
                  tanh_scale: float | None = None):
    """Dispatch the row pass (same contract as :func:`torch_one_pass`): ``"triton"`` -> the Triton
    kernel; ``"torch"`` -> the native C kernel (:mod:`aepo_kernels.native`) for fp32 CPU logits
    without a soft cap, else the compiled torch path."""
    if backend == "triton":
        impl = _triton_one_pass()
    elif native.supports(logits, out, tanh_scale):
        impl = native.native_one_pass
    else:
        impl = torch_one_pass
    return impl(logits, labels, inputs, config, inv_t, ignore_index, out, tanh_scale)


# ---------------------------------------------------------------------------------------------
# Aggregation weights and the autograd Function.


def aggregation_weights(loss_mask, config: LossConfig, global_token_count=None, global_num_seqs=None) -> torch.Tensor:
    """Per-token weights ``w_t`` with ``sum_t w_t L_t == aggregate(L, loss_mask, config, ...)``.

    Args/normalisers as :func:`aepo_kernels.policy_loss.aggregate`. Returns fp32 shaped like
    ``loss_mask`` (0 on masked tokens); computed without host syncs.
    """
    mask = loss_mask.float()
    if config.aggregation == "token-mean":
        denom = weight_total(mask.sum()) if global_token_count is None else global_token_count
        return mask / denom
    if mask.dim() != 2:
        raise ValueError(f"aggregation={config.aggregation!r} needs [B, T] inputs, got {tuple(mask.shape)}")
    if config.aggregation == "seq-mean-token-mean":
        per_seq = mask / weight_total(mask.sum(-1, keepdim=True))
    else:
        per_seq = mask / (config.seq_norm_length or mask.shape[-1])
    return per_seq / (mask.shape[0] if global_num_seqs is None else global_num_seqs)


def scale_gradient(grad: torch.Tensor | None, grad_output: torch.Tensor) -> torch.Tensor | None:
    """``grad * grad_output``, in place; skipped when the incoming gradient is a CPU 1.0 (the
    common case; on CUDA reading it would be a device sync, so the multiply always runs there)."""
    if grad is None:
        return None
    if grad_output.device.type == "cpu" and float(grad_output) == 1.0:
        return grad
    return grad.mul_(grad_output.to(grad.dtype))


class OnePassLossFunction(torch.autograd.Function):
    """``logits [B, T, V] -> (loss, rows [6, B, T])``; dlogits computed in forward."""

    @staticmethod
    def forward(ctx, logits, labels, inputs: RowInputs, config: LossConfig, inv_t: float, ignore_index: int,
                backend: str, in_place: bool, tanh_scale: float | None = None):
        out = logits if in_place else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        rows = one_pass_rows(logits, labels, inputs, config, inv_t, ignore_index, out, backend, tanh_scale)
        if in_place:
            # The logits now hold their gradient: any node that saved them fails loudly.
            increment_version(logits)
        ctx.save_for_backward(out)
        ctx.mark_non_differentiable(rows)
        loss = (rows[2] * inputs.weight.to(rows.dtype)).sum()
        return loss, rows

    @staticmethod
    def backward(ctx, grad_loss, _grad_rows):
        (dlogits,) = ctx.saved_tensors
        return scale_gradient(dlogits, grad_loss), None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The same op as a torch.library custom op, so that a caller's torch.compile(fullgraph=True)
# traces through the loss: the op is opaque to the compiler (a fake implementation gives its
# output shapes), and its autograd formula is "scale the stored dlogits". The eager path above
# stays the default because it also offers the in-place variant (custom ops with autograd may
# not mutate their inputs).


@torch.library.custom_op("aepo_kernels::one_pass_loss", mutates_args=())
def one_pass_loss_op(
    logits: torch.Tensor, labels: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
    weight: torch.Tensor, ref_logprobs: torch.Tensor, entropy_mean: torch.Tensor, entropy_std: torch.Tensor,
    params: list[float], clip: str, has_ref: bool, inv_t: float, ignore_index: int, backend: str,
    tanh_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss [], rows [6, B, T], dlogits [B, T, V])`` of ``logits [B, T, V]``; ``params`` are
    :data:`HYPER_PARAMS` in order (the config travels as plain values)."""
    config = LossConfig(clip=clip, **dict(zip(HYPER_PARAMS, params)))
    inputs = RowInputs(old_logprobs, advantages, weight, entropy_mean, entropy_std, ref_logprobs if has_ref else None)
    dlogits = torch.empty_like(logits)
    # tanh_scale 0.0 = no soft cap (a plain float in the op's schema)
    rows = one_pass_rows(logits, labels, inputs, config, inv_t, ignore_index, dlogits, backend, tanh_scale or None)
    return (rows[2] * weight.to(rows.dtype)).sum(), rows, dlogits


@one_pass_loss_op.register_fake
def _(logits, labels, old_logprobs, advantages, weight, ref_logprobs, entropy_mean, entropy_std, params, clip,
      has_ref, inv_t, ignore_index, backend, tanh_scale):
    acc = accumulate_dtype(logits.dtype)
    rows = logits.new_empty((6, *logits.shape[:2]), dtype=acc)
    return logits.new_empty((), dtype=acc), rows, torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[2])


def _backward(ctx, grad_loss, _grad_rows, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    return (dlogits * grad_loss.to(dlogits.dtype),) + (None,) * 14


one_pass_loss_op.register_autograd(_backward, setup_context=_setup_context)


def one_pass_loss_traceable(logits, labels, inputs: RowInputs, config: LossConfig, inv_t: float, ignore_index: int,
                            backend: str, tanh_scale: float | None = None):
    """``(loss, rows)`` through :func:`one_pass_loss_op` (what runs under ``torch.compile``)."""
    if inputs.advantages_neg is not None:
        raise NotImplementedError("the tree loss's second advantage column is not traced under torch.compile: "
                                  "call it outside the compiled region")
    ref = inputs.ref_or_old
    loss, rows, _ = one_pass_loss_op(
        logits, labels, inputs.old_logprobs, inputs.advantages, inputs.weight, ref, inputs.entropy_mean,
        inputs.entropy_std, [float(getattr(config, name)) for name in HYPER_PARAMS], config.clip,
        inputs.ref_logprobs is not None, inv_t, ignore_index, backend, tanh_scale or 0.0)
    return loss, rows.detach()
