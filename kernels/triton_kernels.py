"""Triton kernels for :mod:`aepo_kernels.logits_ops` (same maths, see that docstring).

One program per token row (grid axis 0 = token index, so no 65,535 grid limit), looping over the
vocabulary in ``BLOCK_V`` lanes with an online softmax in fp32:
    m' = max(m, max_v u_v)    s' = s e^(m - m') + sum_v e^(u_v - m')
    t' = e^(m - m') (t + s (m - m')) + sum_v e^(u_v - m') (u_v - m')       (t = sum e^(u-m)(u-m))
so at the end lse = m + log s, Eu = m + t / s, H = log s - t / s. Out-of-range lanes are loaded
as -inf before the max and the exp, and masked out of t (0 * -inf would be NaN).

Temperature, row strides and the row count are runtime arguments; the row count and the number
of rows per sequence are not specialised (``do_not_specialize``), so new RL batch shapes never
recompile. The vocabulary size is a runtime argument too; ``BLOCK_V`` and ``num_warps`` are chosen
by a fixed rule rather than autotuning (the interpreter cannot autotune; on an H200 the rule is
checked by bench/gpu_check.py).

Row addresses use int64 arithmetic: 16K rows x 152K vocab exceeds 2^31 elements.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit(do_not_specialize=["seq_len"])
def _logprob_entropy_fwd_kernel(
    logits_ptr, stride_b, stride_t, labels_ptr, logp_ptr, entropy_ptr, lse_ptr, eu_ptr,
    seq_len, vocab, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)  # flat token index over [B, T]
    p_row = logits_ptr + (i_row // seq_len) * stride_b + (i_row % seq_len) * stride_t
    b_m = tl.full((), float("-inf"), tl.float32)
    b_s = tl.zeros((), tl.float32)
    b_t = tl.zeros((), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_u = tl.load(p_row + o_v, mask=m_v, other=float("-inf")).to(tl.float32) * inv_temperature
        b_m_new = tl.maximum(b_m, tl.max(b_u, axis=0))
        # First block: b_m is -inf and b_s is 0; the shift term must be 0, not 0 * -inf.
        b_shift = tl.where(b_s > 0, b_m - b_m_new, 0.0)
        b_scale = tl.exp(b_m - b_m_new)
        b_d = tl.where(m_v, b_u - b_m_new, 0.0)
        b_e = tl.where(m_v, tl.exp(b_d), 0.0)
        b_t = b_scale * (b_t + b_s * b_shift) + tl.sum(b_e * b_d, axis=0)
        b_s = b_s * b_scale + tl.sum(b_e, axis=0)
        b_m = b_m_new
    b_log_s = tl.log(b_s)
    b_eu_rel = b_t / b_s
    b_lse = b_m + b_log_s
    y = tl.load(labels_ptr + i_row)
    valid = (y != ignore_index) & (y >= 0) & (y < vocab)
    b_zy = tl.load(p_row + tl.where(valid, y, 0)).to(tl.float32) * inv_temperature
    tl.store(logp_ptr + i_row, tl.where(valid, b_zy - b_lse, 0.0))
    tl.store(entropy_ptr + i_row, b_log_s - b_eu_rel)
    tl.store(lse_ptr + i_row, b_lse)
    tl.store(eu_ptr + i_row, b_m + b_eu_rel)


@triton.jit(do_not_specialize=["seq_len"])
def _logprob_entropy_bwd_kernel(
    logits_ptr, stride_b, stride_t, dlogits_ptr, dstride_b, dstride_t,
    labels_ptr, lse_ptr, eu_ptr, g_lp_ptr, g_h_ptr,
    seq_len, vocab, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)
    i_b, i_t = i_row // seq_len, i_row % seq_len
    p_row = logits_ptr + i_b * stride_b + i_t * stride_t
    p_drow = dlogits_ptr + i_b * dstride_b + i_t * dstride_t
    b_lse = tl.load(lse_ptr + i_row)
    b_eu = tl.load(eu_ptr + i_row)
    b_glp = tl.load(g_lp_ptr + i_row)
    b_gh = tl.load(g_h_ptr + i_row)
    y = tl.load(labels_ptr + i_row)
    y = tl.where(y == ignore_index, -1, y)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_u = tl.load(p_row + o_v, mask=m_v, other=0.0).to(tl.float32) * inv_temperature
        b_p = tl.exp(b_u - b_lse)
        b_d = b_p * (b_gh * (b_eu - b_u) - b_glp)
        b_d = tl.where(o_v == y, b_d + b_glp, b_d) * inv_temperature
        # Same lanes as the load above: in-place mode (dlogits_ptr == logits_ptr) is safe.
        tl.store(p_drow + o_v, b_d.to(dlogits_ptr.dtype.element_ty), mask=m_v)


def _launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps): large blocks for the interpreter, 4K lanes x 8 warps on a GPU."""
    if _INTERPRET:
        return min(triton.next_power_of_2(vocab), 1 << 15), 4
    return min(triton.next_power_of_2(vocab), 4096), 8


def _check(logits: torch.Tensor) -> None:
    if not (logits.is_cuda or _INTERPRET):
        raise RuntimeError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    if logits.stride(-1) != 1:
        raise ValueError("logits must have unit stride on the vocab dim")


def triton_forward(logits: torch.Tensor, labels: torch.Tensor, inv_t: float, ignore_index: int):
    """``logits: [B, T, V]`` -> ``(logp, H, lse, Eu)``, each ``[B, T]`` fp32."""
    _check(logits)
    batch, seq, vocab = logits.shape
    labels = labels.contiguous()
    logp, entropy, lse, eu = (torch.empty(batch, seq, dtype=torch.float32, device=logits.device) for _ in range(4))
    block_v, num_warps = _launch_config(vocab)
    if batch * seq > 0:
        _logprob_entropy_fwd_kernel[(batch * seq,)](
            logits, logits.stride(0), logits.stride(1), labels, logp, entropy, lse, eu,
            seq, vocab, inv_t, ignore_index, BLOCK_V=block_v, num_warps=num_warps,
        )
    return logp, entropy, lse, eu


def triton_backward(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out):
    """Writes dlogits ``[B, T, V]`` into ``out`` (which may be ``logits`` itself)."""
    _check(logits)
    batch, seq, vocab = logits.shape
    block_v, num_warps = _launch_config(vocab)
    if batch * seq > 0:
        _logprob_entropy_bwd_kernel[(batch * seq,)](
            logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1),
            labels.contiguous(), lse, eu, g_lp.contiguous(), g_h.contiguous(),
            seq, vocab, inv_t, ignore_index, BLOCK_V=block_v, num_warps=num_warps,
        )
    return out
