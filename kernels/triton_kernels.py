"""Triton kernels for :mod:`aepo_kernels.logits_ops` (same maths, see that docstring).

One program per token row (grid axis 0 = token index, so no 65,535 grid limit), looping over the
vocabulary in ``BLOCK_V`` lanes with an online softmax in fp32:
    m' = max(m, max_v u_v)    s' = s e^(m - m') + sum_v e^(u_v - m')
    t' = e^(m - m') (t + s (m - m')) + sum_v e^(u_v - m') (u_v - m')       (t = sum e^(u-m)(u-m))
so at the end lse = m + log s, Eu = m + t / s, H = log s - t / s. Out-of-range lanes are loaded
as -inf before the max and the exp. Logits of -inf (a masked vocabulary) are supported anywhere
in a row, leading blocks included: the shifts use a finite reference while m is still -inf, and
the factors ``u - m`` of ``e (u - m)`` and ``Eu - u`` of ``p (Eu - u)`` are replaced by finite
values where e or p is 0 (0 * -inf is NaN).
Such tokens get probability 0 and gradient 0. A row with no finite logit has no softmax (NaN).

Temperature, row strides and the row count are runtime arguments; the row count and the number
of rows per sequence are not specialised (``do_not_specialize``), so new RL batch shapes never
recompile. The vocabulary size is a runtime argument too; ``BLOCK_V`` and ``num_warps`` are chosen
by a fixed rule rather than autotuning (the interpreter cannot autotune; on an H200 the rule is
checked by bench/gpu_check.py).

Row addresses use int64 arithmetic: 16K rows x 152K vocab exceeds 2^31 elements.

Logit soft cap (:func:`aepo_kernels.logits_ops.logit_map`): with ``SOFTCAP`` (a constexpr derived
from ``tanh_scale != 0``, so the uncapped kernels are exactly the code without it) each lane maps
z -> tanh(z * tanh_scale) before the temperature, and the gradient sweep multiplies by
``tanh_scale (1 - tanh^2)``. tanh is written with ``exp`` (:func:`_tanh`): libdevice's is not
available under the interpreter, and one formula on both keeps the tests on the GPU's code.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .config import CLIP_RULES, HYPER_PARAMS, LossConfig
from .row_inputs import RowInputs

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The logits dtypes the kernels are compiled and tested for (tests/test_kernels_triton_targets.py).
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _tanh(x):
    """tanh from exp: (1 - e^-2|x|) / (1 + e^-2|x|) with the sign of x, and the odd Taylor series
    up to x^9 for |x| < 0.25, where 1 - e^-2|x| would lose digits (both within ~1 ulp there)."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, series, t)
    return tl.where(x < 0, -t, t)


@triton.jit
def _map_logits(b_z, inv_temperature, tanh_scale, SOFTCAP: tl.constexpr):
    """u of raw fp32 logits: ``z * inv_t``, or ``tanh(z * tanh_scale) * inv_t`` with a soft cap."""
    if SOFTCAP:
        b_u = _tanh(b_z * tanh_scale) * inv_temperature
    else:
        b_u = b_z * inv_temperature
    return b_u


@triton.jit
def _row_stats(p_row, vocab, inv_temperature, tanh_scale, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    """Online softmax over one row: returns ``(m, log s, t / s)`` (lse = m + log s, Eu = m + t / s)."""
    b_m = tl.full((), float("-inf"), tl.float32)
    b_s = tl.zeros((), tl.float32)
    b_t = tl.zeros((), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        if SOFTCAP:  # tanh(-inf) = -1: the out-of-range lanes are set to -inf after the map
            b_z = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_u = tl.where(m_v, _map_logits(b_z, inv_temperature, tanh_scale, SOFTCAP), float("-inf"))
        else:
            b_u = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32) * inv_temperature
        b_m_new = tl.maximum(b_m, tl.max(b_u, axis=0))
        # A finite reference while no finite logit has been seen (leading blocks of -inf, e.g. a
        # masked vocabulary): exp(-inf - -inf) would be NaN. Then b_s = 0 and every term below is 0.
        b_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_shift = tl.where(b_s > 0, b_m - b_ref, 0.0)  # b_s = 0: the shift term is 0, not 0 * -inf
        b_scale = tl.exp(b_m - b_ref)
        b_d = b_u - b_ref  # -inf on -inf logits and out-of-range lanes, whose e is 0
        b_e = tl.exp(b_d)
        b_t = b_scale * (b_t + b_s * b_shift) + tl.sum(b_e * tl.where(b_e > 0, b_d, 0.0), axis=0)
        b_s = b_s * b_scale + tl.sum(b_e, axis=0)
        b_m = b_m_new
    return b_m, tl.log(b_s), b_t / b_s


@triton.jit
def _dlogits(b_z, b_lse, b_eu, b_glp, b_gh, is_target, inv_temperature, tanh_scale, SOFTCAP: tl.constexpr):
    """``(g_lp (onehot(y) - p) + g_H p (Eu - u)) du/dz`` of fp32 logits ``b_z`` (any block shape the
    per-token ``b_lse``, ``b_eu``, ``b_glp``, ``b_gh`` and the ``is_target`` mask broadcast to); the
    row op's and the vocabulary-outer head's (``aepo_kernels.triton_head``) one definition."""
    if SOFTCAP:
        b_th = _tanh(b_z * tanh_scale)
        b_u = b_th * inv_temperature
        b_du = (1.0 - b_th * b_th) * (tanh_scale * inv_temperature)
    else:
        b_u = b_z * inv_temperature
        b_du = inv_temperature
    b_p = tl.exp(b_u - b_lse)
    b_u = tl.where(b_p > 0, b_u, b_eu)  # u = -inf (a -inf bias) has p = 0: gradient 0, not 0 * inf
    b_d = b_p * (b_gh * (b_eu - b_u) - b_glp)
    return tl.where(is_target, b_d + b_glp, b_d) * b_du


@triton.jit
def _row_grad(p_row, p_drow, vocab, inv_temperature, tanh_scale, b_lse, b_eu, b_glp, b_gh, y,
              BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    """Writes ``(g_lp (onehot(y) - p) + g_H p (Eu - u)) du/dz`` over one row (y = -1: no target)."""
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_z = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_d = _dlogits(b_z, b_lse, b_eu, b_glp, b_gh, o_v == y, inv_temperature, tanh_scale, SOFTCAP)
        # Same lanes as the load above: in-place mode (p_drow == p_row) is safe.
        tl.store(p_drow + o_v, b_d.to(p_drow.dtype.element_ty), mask=m_v)


_SOFTCAP = triton.heuristics({"SOFTCAP": lambda args: args["tanh_scale"] != 0.0})


@_SOFTCAP
@triton.jit(do_not_specialize=["seq_len"])
def _logprob_entropy_fwd_kernel(
    logits_ptr, stride_b, stride_t, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, eu_ptr,
    seq_len, vocab, inv_temperature, tanh_scale, ignore_index,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)  # flat token index over [B, T]
    p_row = logits_ptr + (i_row // seq_len) * stride_b + (i_row % seq_len) * stride_t
    b_m, b_log_s, b_eu_rel = _row_stats(p_row, vocab, inv_temperature, tanh_scale, BLOCK_V, SOFTCAP)
    b_lse = b_m + b_log_s
    y = tl.load(labels_ptr + i_row)
    valid = (y != ignore_index) & (y >= 0) & (y < vocab)
    b_zy = _map_logits(tl.load(p_row + tl.where(valid, y, 0)).to(tl.float32), inv_temperature, tanh_scale, SOFTCAP)
    tl.store(logp_ptr + i_row, tl.where(valid, b_zy - b_lse, 0.0))
    tl.store(entropy_ptr + i_row, b_log_s - b_eu_rel)
    tl.store(lse_ptr + i_row, b_lse)
    tl.store(eu_ptr + i_row, b_m + b_eu_rel)


@_SOFTCAP
@triton.jit(do_not_specialize=["seq_len"])
def _logprob_entropy_bwd_kernel(
    logits_ptr, stride_b, stride_t, dlogits_ptr, dstride_b, dstride_t,
    labels_ptr, lse_ptr, eu_ptr, g_lp_ptr, g_h_ptr,
    seq_len, vocab, inv_temperature, tanh_scale, ignore_index,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)
    i_b, i_t = i_row // seq_len, i_row % seq_len
    y = tl.load(labels_ptr + i_row)
    y = tl.where(y == ignore_index, -1, y)
    _row_grad(logits_ptr + i_b * stride_b + i_t * stride_t, dlogits_ptr + i_b * dstride_b + i_t * dstride_t,
              vocab, inv_temperature, tanh_scale, tl.load(lse_ptr + i_row), tl.load(eu_ptr + i_row),
              tl.load(g_lp_ptr + i_row), tl.load(g_h_ptr + i_row), y, BLOCK_V, SOFTCAP)


# ---------------------------------------------------------------------------------------------
# The one-pass AEPO loss (aepo_kernels.one_pass): the same head as one_pass.token_head.


@triton.jit
def _pg_head(shaped, logp, ratio, in_clamp, eps_low, eps_high, dual_clip, rule):
    """The policy-gradient term at the shaped advantage ``shaped``: ``(L_pg, dL_pg/dlogp)``."""
    low, high = 1 - eps_low, 1 + eps_high
    is_high, is_low = ratio > high, ratio < low
    pg_plain = -shaped * ratio
    pg_clipped = -shaped * tl.where(is_high, high, tl.where(is_low, low, ratio))
    d_plain = tl.where(in_clamp, pg_plain, 0.0)
    high_grad = tl.where((rule == 1) | (rule == 2), -shaped * high, 0.0)
    low_grad = tl.where(rule == 2, -shaped * low, 0.0)
    d_clipped = tl.where(is_high, tl.where(in_clamp, high_grad, 0.0),
                         tl.where(is_low, tl.where(in_clamp, low_grad, 0.0), d_plain))
    take_clipped = pg_clipped > pg_plain
    loss = tl.where(take_clipped, pg_clipped, pg_plain)
    d_logp = tl.where(take_clipped, d_clipped, d_plain)
    dual_value = -shaped * dual_clip
    dual_hit = (dual_clip != 0) & (shaped < 0) & (loss > dual_value)
    loss = tl.where(dual_hit, dual_value, loss)
    d_logp = tl.where(dual_hit, 0.0, d_logp)
    cispo_weight = tl.minimum(tl.maximum(ratio, low), high)
    loss = tl.where(rule == 3, -shaped * cispo_weight * logp, loss)
    d_logp = tl.where(rule == 3, -shaped * cispo_weight, d_logp)
    return loss, d_logp


@triton.jit
def _shape_and_ratio(logp, entropy, old, adv, mean, std, clamp_c, alpha):
    """The entropy-aware advantage, the clamped ratio and whether the clamp passes the gradient."""
    std = tl.where(std > 0, std, 1.0)
    shaped = adv * (1 + alpha * (entropy - mean) / std)
    diff = logp - old
    in_clamp = (diff >= -clamp_c) & (diff <= clamp_c)
    ratio = tl.exp(tl.minimum(tl.maximum(diff, -clamp_c), clamp_c))
    return shaped, ratio, in_clamp


@triton.jit
def _token_head(logp, entropy, old, adv, ref, mean, std,
                eps_low, eps_high, dual_clip, clamp_c, alpha, kl_coef, entropy_coef, rule, has_ref):
    """Scalar version of ``one_pass.token_head``: ``(L_t, dL/dlogp, ratio, A_t, kl)``."""
    shaped, ratio, in_clamp = _shape_and_ratio(logp, entropy, old, adv, mean, std, clamp_c, alpha)
    loss, d_logp = _pg_head(shaped, logp, ratio, in_clamp, eps_low, eps_high, dual_clip, rule)
    delta = ref - logp
    e_delta = tl.exp(delta)
    kl = tl.where(has_ref != 0, e_delta - delta - 1, 0.0)
    kl_on = (has_ref != 0) & (kl_coef != 0)
    loss = tl.where(kl_on, loss + kl_coef * kl, loss)
    d_logp = tl.where(kl_on, d_logp + kl_coef * (1 - e_delta), d_logp)
    return loss - entropy_coef * entropy, d_logp, ratio, shaped, kl


@triton.jit
def _neg_column(logp, entropy, old, adv_neg, mean, std, eps_low, eps_high, dual_clip, clamp_c, alpha, rule):
    """The second advantage column's policy-gradient term (a folded tree node, ``one_pass.token_head``'s
    ``adv_neg``): ``(L_pg, dL_pg/dlogp, A_t)``; the ratio as :func:`_token_head` forms it."""
    shaped, ratio, in_clamp = _shape_and_ratio(logp, entropy, old, adv_neg, mean, std, clamp_c, alpha)
    loss, d_logp = _pg_head(shaped, logp, ratio, in_clamp, eps_low, eps_high, dual_clip, rule)
    return loss, d_logp, shaped


@triton.heuristics({"SOFTCAP": lambda args: args["tanh_scale"] != 0.0,
                    "HAS_NEG": lambda args: args["adv_neg_ptr"] is not None})
@triton.jit(do_not_specialize=["n_rows", "seq_len", "rule", "has_ref"])
def _aepo_one_pass_kernel(
    logits_ptr, stride_b, stride_t, out_ptr, ostride_b, ostride_t,
    labels_ptr, old_ptr, adv_ptr, weight_ptr, ref_ptr, mean_ptr, std_ptr, rows_ptr,
    n_rows, seq_len, vocab, inv_temperature, tanh_scale, ignore_index,
    eps_low, eps_high, dual_clip, clamp_c, alpha, kl_coef, entropy_coef, rule, has_ref, adv_neg_ptr,
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, HAS_NEG: tl.constexpr,
):
    """One program per token row: stats sweep, loss head, gradient sweep (out may alias logits).

    Per-token inputs are flat ``[N]`` fp32; ``rows_ptr`` is ``[6, N]``: logp, H, L_t, ratio, A_t, kl.
    ``adv_neg_ptr``: None, or the second advantage column (``HAS_NEG``; a folded tree node).
    """
    i_row = tl.program_id(0).to(tl.int64)
    i_b, i_t = i_row // seq_len, i_row % seq_len
    p_row = logits_ptr + i_b * stride_b + i_t * stride_t
    b_m, b_log_s, b_eu_rel = _row_stats(p_row, vocab, inv_temperature, tanh_scale, BLOCK_V, SOFTCAP)
    b_lse, b_eu = b_m + b_log_s, b_m + b_eu_rel
    b_entropy = b_log_s - b_eu_rel
    y = tl.load(labels_ptr + i_row)
    valid = (y != ignore_index) & (y >= 0) & (y < vocab)
    b_zy = _map_logits(tl.load(p_row + tl.where(valid, y, 0)).to(tl.float32), inv_temperature, tanh_scale, SOFTCAP)
    b_logp = tl.where(valid, b_zy - b_lse, 0.0)
    b_w = tl.where(valid, tl.load(weight_ptr + i_row), 0.0)  # no target: no loss, no gradient
    b_loss, b_dlogp, b_ratio, b_shaped, b_kl = _token_head(
        b_logp, b_entropy, tl.load(old_ptr + i_row), tl.load(adv_ptr + i_row), tl.load(ref_ptr + i_row),
        tl.load(mean_ptr), tl.load(std_ptr),
        eps_low, eps_high, dual_clip, clamp_c, alpha, kl_coef, entropy_coef, rule, has_ref)
    if HAS_NEG:
        b_loss_neg, b_dlogp_neg, b_shaped_neg = _neg_column(
            b_logp, b_entropy, tl.load(old_ptr + i_row), tl.load(adv_neg_ptr + i_row), tl.load(mean_ptr),
            tl.load(std_ptr), eps_low, eps_high, dual_clip, clamp_c, alpha, rule)
        b_loss += b_loss_neg
        b_dlogp += b_dlogp_neg
        b_shaped += b_shaped_neg
    tl.store(rows_ptr + i_row, b_logp)
    tl.store(rows_ptr + n_rows + i_row, b_entropy)
    tl.store(rows_ptr + 2 * n_rows + i_row, tl.where(valid, b_loss, 0.0))
    tl.store(rows_ptr + 3 * n_rows + i_row, b_ratio)
    tl.store(rows_ptr + 4 * n_rows + i_row, b_shaped)
    tl.store(rows_ptr + 5 * n_rows + i_row, b_kl)
    b_glp = tl.where(valid, b_dlogp * b_w, 0.0)
    _row_grad(p_row, out_ptr + i_b * ostride_b + i_t * ostride_t, vocab, inv_temperature, tanh_scale,
              b_lse, b_eu, b_glp, -entropy_coef * b_w, tl.where(valid, y, -1), BLOCK_V, SOFTCAP)


def _launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): large blocks for the interpreter, 4K lanes x 8 warps on a GPU."""
    if _INTERPRET:
        return min(triton.next_power_of_2(vocab), 1 << 15), 4
    return min(triton.next_power_of_2(vocab), 4096), 8


# ---------------------------------------------------------------------------------------------
# Launchers. Each kernel's argument list is built in one place, a ``_*_launch`` function that
# returns a :class:`Launch`; the public launchers check their inputs, build and run it. The GPU
# compile check (:mod:`aepo_kernels.triton_targets`) compiles the very same launches
# (:func:`example_launches`) for named GPU targets, so a new argument is covered there as is.


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **meta)``; ``meta`` holds the constexprs the
    launcher picks (``BLOCK_V``) and the launch options (``num_warps``)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict

    def run(self) -> None:
        if math.prod(self.grid) > 0:
            self.kernel[self.grid](*self.args, **self.meta)


def _check(logits: torch.Tensor, labels: torch.Tensor, out: torch.Tensor | None = None,
           stats: dict[str, torch.Tensor] | None = None, per_token: dict[str, torch.Tensor | None] | None = None,
           scalars: dict[str, torch.Tensor] | None = None) -> None:
    """Checks every tensor argument of a launcher, raising an error that names the bad one.

    Args:
        logits: ``[B, T, V]`` on CUDA (or any device under the interpreter), a
            :data:`LOGITS_DTYPES` dtype, unit stride on V.
        labels: int64 ``[B, T]``.
        out: the dlogits buffer: like the logits (dtype, shape, unit vocab stride).
        stats: per-row fp32 ``[B, T]`` tensors the kernels read as fp32 (lse, Eu, upstream gradients).
        per_token: ``B*T``-element floating tensors the launcher converts (None: absent).
        scalars: one-element floating tensors.
    All of them must be on the logits' device.
    """
    if not (logits.is_cuda or _INTERPRET):
        raise RuntimeError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    if logits.dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits dtype {logits.dtype}: the triton backend takes {LOGITS_DTYPES}")
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, T, V] with unit stride on the vocab dim, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    stats, per_token, scalars = stats or {}, per_token or {}, scalars or {}
    rows = logits.shape[:-1]
    for name, t in {"labels": labels, "out": out, **stats, **per_token, **scalars}.items():
        if t is not None and t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, the logits on {logits.device}: every tensor argument "
                             "of the triton backend must be on the logits' device")
    if labels.dtype != torch.int64 or labels.shape != rows:
        raise TypeError(f"labels must be int64 {tuple(rows)}, got {labels.dtype} {tuple(labels.shape)}")
    if out is not None and (out.dtype != logits.dtype or out.shape != logits.shape or out.stride(-1) != 1):
        raise TypeError(f"out must be like the logits ({logits.dtype} {tuple(logits.shape)}, unit vocab stride), "
                        f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    for name, t in stats.items():
        if t.dtype != torch.float32 or t.shape != rows:
            raise TypeError(f"{name} must be float32 {tuple(rows)}, got {t.dtype} {tuple(t.shape)}")
    for name, t in per_token.items():
        if t is not None and (not t.is_floating_point() or t.numel() != rows.numel()):
            raise TypeError(f"{name} must be a floating-point tensor of {rows.numel()} elements (one per row), "
                            f"got {t.dtype} {tuple(t.shape)}")
    for name, t in scalars.items():
        if not t.is_floating_point() or t.numel() != 1:
            raise TypeError(f"{name} must be a one-element floating-point tensor, got {t.dtype} {tuple(t.shape)}")


def _forward_launch(logits, labels, inv_t: float, ignore_index: int, tanh_scale: float | None):
    """``(Launch, (logp, H, lse, Eu))`` of the forward kernel over ``logits [B, T, V]``."""
    batch, seq, vocab = logits.shape
    outputs = tuple(torch.empty(batch, seq, dtype=torch.float32, device=logits.device) for _ in range(4))
    block_v, num_warps = _launch_config(vocab)
    args = (logits, logits.stride(0), logits.stride(1), labels.contiguous(), *outputs,
            seq, vocab, inv_t, tanh_scale or 0.0, ignore_index)
    return Launch(_logprob_entropy_fwd_kernel, (batch * seq,), args, dict(BLOCK_V=block_v, num_warps=num_warps)), outputs


def _backward_launch(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out, tanh_scale) -> Launch:
    batch, seq, vocab = logits.shape
    block_v, num_warps = _launch_config(vocab)
    args = (logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1),
            labels.contiguous(), lse, eu, g_lp.contiguous(), g_h.contiguous(),
            seq, vocab, inv_t, tanh_scale or 0.0, ignore_index)
    return Launch(_logprob_entropy_bwd_kernel, (batch * seq,), args, dict(BLOCK_V=block_v, num_warps=num_warps))


def _one_pass_launch(logits, labels, inputs, config, inv_t: float, ignore_index: int, out, tanh_scale):
    """``(Launch, rows [6, B, T])`` of the one-pass kernel."""
    batch, seq, vocab = logits.shape
    n_rows = batch * seq
    flat = lambda t: t.reshape(n_rows).float().contiguous()  # noqa: E731
    rows = torch.empty(6, batch, seq, dtype=torch.float32, device=logits.device)
    block_v, num_warps = _launch_config(vocab)
    args = (logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1),
            labels.contiguous(), flat(inputs.old_logprobs), flat(inputs.advantages), flat(inputs.weight),
            flat(inputs.ref_or_old), inputs.entropy_mean.float().reshape(()), inputs.entropy_std.float().reshape(()),
            rows, n_rows, seq, vocab, inv_t, tanh_scale or 0.0, ignore_index,
            *(float(getattr(config, name)) for name in HYPER_PARAMS),
            CLIP_RULES.index(config.clip), int(inputs.ref_logprobs is not None),
            None if inputs.advantages_neg is None else flat(inputs.advantages_neg))
    return Launch(_aepo_one_pass_kernel, (n_rows,), args, dict(BLOCK_V=block_v, num_warps=num_warps)), rows


def triton_forward(logits: torch.Tensor, labels: torch.Tensor, inv_t: float, ignore_index: int,
                   tanh_scale: float | None = None):
    """``logits: [B, T, V]`` -> ``(logp, H, lse, Eu)``, each ``[B, T]`` fp32."""
    _check(logits, labels)
    launch, outputs = _forward_launch(logits, labels, inv_t, ignore_index, tanh_scale)
    launch.run()
    return outputs


def triton_backward(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out, tanh_scale=None):
    """Writes dlogits ``[B, T, V]`` into ``out`` (which may be ``logits`` itself)."""
    _check(logits, labels, out, stats=dict(lse=lse, eu=eu, g_lp=g_lp, g_h=g_h))
    _backward_launch(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out, tanh_scale).run()
    return out


def triton_one_pass(logits, labels, inputs, config, inv_t: float, ignore_index: int, out, tanh_scale=None):
    """The one-pass loss over ``logits [B, T, V]`` (contract of ``one_pass.torch_one_pass``):
    returns rows ``[6, B, T]`` fp32 and writes dlogits into ``out`` (may be ``logits``)."""
    _check(logits, labels, out, per_token=dict(
        old_logprobs=inputs.old_logprobs, advantages=inputs.advantages, weight=inputs.weight,
        ref_logprobs=inputs.ref_logprobs, advantages_neg=inputs.advantages_neg),
        scalars=dict(entropy_mean=inputs.entropy_mean, entropy_std=inputs.entropy_std))
    launch, rows = _one_pass_launch(logits, labels, inputs, config, inv_t, ignore_index, out, tanh_scale)
    launch.run()
    return rows


def example_launches(logits: torch.Tensor, tanh_scale: float | None) -> dict[str, Launch]:
    """Every kernel's launches as the launchers build them for ``logits [B, T, V]`` (any device,
    ``meta`` included: nothing runs): dlogits into a new buffer and in place (``out`` is the
    logits, whose layout may differ). :mod:`aepo_kernels.triton_targets` compiles these for GPU
    targets, so its signatures are the launchers' own. A new kernel must be added here
    (tests/test_kernels_triton_targets.py checks that every ``*_kernel`` of this module is)."""
    batch, seq, vocab = logits.shape
    like = lambda dtype=torch.float32: torch.zeros(batch, seq, dtype=dtype, device=logits.device)  # noqa: E731
    labels = like(torch.int64)
    forward, (_, _, lse, eu) = _forward_launch(logits, labels, 1.0, -100, tanh_scale)
    scalar = torch.zeros((), device=logits.device)
    inputs = RowInputs(like(), like(), like(), scalar, scalar + 1, None)
    new_out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    backward = lambda out: _backward_launch(logits, labels, lse, eu, like(), like(), 1.0, -100, out, tanh_scale)  # noqa: E731
    one_pass = lambda out, inputs=inputs: _one_pass_launch(logits, labels, inputs, LossConfig(), 1.0, -100, out,  # noqa: E731
                                                           tanh_scale)[0]
    tree_inputs = dataclasses.replace(inputs, advantages_neg=like())  # a folded tree node's two columns
    return {
        "logprob_entropy_fwd": forward,
        "logprob_entropy_bwd": backward(new_out),
        "logprob_entropy_bwd_inplace": backward(logits),
        "aepo_one_pass": one_pass(new_out),
        "aepo_one_pass_inplace": one_pass(logits),
        "aepo_one_pass_two_columns": one_pass(new_out, tree_inputs),
    }
