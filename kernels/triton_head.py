"""Triton kernels of the vocabulary-outer head's gradient pass (issue 54, docs/head.md).

:func:`aepo_kernels.fused_linear.gradient_pass` as three Triton kernels over vocabulary chunks of
``C`` columns (:func:`head_vocab_columns`), given the per-token statistics of the statistics pass
(``lse``, ``Eu``) and the head's upstream coefficients (``g_lp``, ``g_H``):

    for each vocabulary chunk [v0, v0 + C):
      1. _head_dlogits_kernel   grid (token blocks, vocab blocks of the chunk):
             z[BT, BV] = h[t] @ W[v].T (+ b[v])       tl.dot over D in BLOCK_D steps, fp32 accumulator
             dz = (g_lp (onehot(y) - p) + g_H p (Eu - u)) du/dz     (the maths of _row_grad/chunk_grad)
             dz -> the chunk's buffer dz[N, C] in the compute dtype (hidden's)
      2. _head_dweight_kernel   grid (vocab blocks of the chunk, D blocks):
             dW[v, d] = sum over ALL tokens of dz[t, v].T @ h[t, d]   fp32 in the program, written
             once in the weight's dtype; d_b[v] = sum over all tokens of dz[t, v] (the d = 0 programs)
      3. _head_dhidden_kernel   grid (token blocks, D blocks):
             dh[t, d] (+)= sum over the chunk's columns of dz[t, v] @ W[v, d]   fp32 in the program;
             written in hidden's dtype after the last chunk, into an fp32 [N, D] accumulator before
             (none when there is one chunk, or when hidden is fp32: d_hidden itself accumulates)

Why a buffer of dlogits and not the whole gradient in one program per vocabulary block: that
program would hold an fp32 ``[BLOCK_V, D]`` d_W block across its token loop -- 1.25 MiB at
BLOCK_V = 64, D = 5,120, where an SM has 256 KiB of registers and 227 KiB of shared memory -- so
it would have to split D across programs and recompute each logits tile once per D block
(``ceil(D / BLOCK_D)`` recomputations, 40 at D = 5,120 with 128-wide blocks), or keep its d_W
block in global memory and read-modify-write it once per token block. With the chunk's dlogits in
a buffer, each logits tile is computed once (kernel 1) and read by the two gradient matmuls
(kernels 2 and 3), whose fp32 tiles fit in registers at any D: the pass is 3 matmuls of
``2 N D V`` flops, and the head 4 with its statistics pass (8 N D V, as the torch order).
Alternatives for d_hidden and what they cost: a token-outer pass of its own that recomputes the
logits (5 matmuls, 10 N D V, and again ``ceil(D / BLOCK_D)`` recomputations of each tile unless a
token tile's ``[BLOCK_T, D]`` fp32 accumulator fits a program), or fp32 atomics from kernel 1
(4 matmuls, but the summation order changes from run to run: not deterministic). The kernels here
are deterministic: every output element is written by one program, its sum in a fixed order.

Memory: the dlogits buffer ``[N, C]`` in the compute dtype takes at most the bytes the torch pass's
``[token_chunk, vocab_chunk]`` block and fp32 ``[vocab_chunk, D]`` d_W block would
(:func:`head_vocab_columns`), plus the fp32 ``[N, D]`` d_hidden accumulator when there is more
than one chunk in a bf16/fp16 run (the torch pass always has one). No fp32 ``[V, D]`` tensor.
Traffic beyond the matmuls' operands: the buffer written once and read twice per chunk, and the
d_hidden accumulator read and written once per chunk (``8 N D ceil(V / C)`` bytes).

Dtypes: hidden (the compute dtype) fp32, bf16 or fp16; the weight and bias any of these (a wider
weight is cast to hidden's dtype as it is loaded, as the torch pass casts its blocks). fp32 dots
follow ``torch.backends.cuda.matmul.allow_tf32`` (off: IEEE fp32, as torch's default matmul).
fp64 and gradient filtering stay on the torch pass (:func:`supports`).

Under ``TRITON_INTERPRET=1`` (the tests) bf16/fp16 operands are converted to fp32 just before
each ``tl.dot`` (``DOT_FP32``): the interpreter's bf16 dot returns garbage. A product of two bf16
or fp16 values is exact in fp32 and the tensor cores accumulate in fp32, so the maths is the
GPU's; the rounding of dlogits to the compute dtype before the gradient matmuls is kept. The
interpreter's fp32 -> bf16 conversion truncates, so :func:`_cast` rounds to nearest even on the
bits there (the GPU's conversion does so itself).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .triton_kernels import _INTERPRET, LOGITS_DTYPES, Launch, _dlogits

# The compute dtypes the kernels take (hidden's dtype; the weight and bias may be any of them).
HEAD_DTYPES = LOGITS_DTYPES
# Columns of the dlogits buffer are a multiple of this (when fewer than V): aligned rows.
COLUMN_ALIGN = 64


# Under the interpreter fp32 -> bf16 conversions truncate (and its round-to-nearest-even option
# mishandles a carry into the exponent); :func:`_cast` rounds to nearest even on the bits instead.
_EMULATE_BF16_ROUNDING = tl.constexpr(_INTERPRET)


# ---------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """``x.to(dtype)``, rounded to nearest even (the GPU's conversion; emulated under the
    interpreter for bf16: add 0x7FFF plus the lowest kept bit, keep the high 16 bits)."""
    if _EMULATE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.heuristics({"SOFTCAP": lambda args: args["tanh_scale"] != 0.0,
                    "HAS_BIAS": lambda args: args["b_ptr"] is not None})
@triton.jit(do_not_specialize=["n_tokens", "v0", "v_end"])
def _head_dlogits_kernel(
    h_ptr, stride_h, w_ptr, stride_w, b_ptr, dz_ptr, stride_dz,
    labels_ptr, lse_ptr, eu_ptr, g_lp_ptr, g_h_ptr,
    n_tokens, dim, v0, v_end, inv_temperature, tanh_scale,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One ``[BLOCK_T, BLOCK_V]`` tile of the chunk ``[v0, v_end)``: the logits recomputed, their
    dlogits written into ``dz`` (column ``v - v0``) in the buffer's dtype. ``labels``: the target
    per token, -1 where there is none (the caller's ``valid``)."""
    i_t, i_v = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_v = v0 + (i_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    m_t, m_v = o_t < n_tokens, o_v < v_end
    b_z = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < dim
        b_h = tl.load(h_ptr + o_t[:, None] * stride_h + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
        b_w = tl.load(w_ptr + o_v[:, None] * stride_w + o_d[None, :], mask=m_v[:, None] & m_d[None, :], other=0.0)
        b_w = _cast(b_w, b_h.dtype)  # a wider weight is cast to the compute dtype, as the torch pass does
        if DOT_FP32:
            b_h, b_w = b_h.to(tl.float32), b_w.to(tl.float32)
        b_z = tl.dot(b_h, tl.trans(b_w), b_z, input_precision=INPUT_PRECISION)
    if HAS_BIAS:  # the bias in the compute dtype, as the torch pass adds it
        b_b = tl.load(b_ptr + o_v, mask=m_v, other=0.0)
        b_b = _cast(b_b, h_ptr.dtype.element_ty).to(tl.float32)
        b_z += b_b[None, :]
    # Rounded to the compute dtype, as the statistics pass's GEMM writes its logits: lse and Eu
    # come from those, and p = exp(u - lse) must sum to 1 over the row (no-op for fp32).
    b_z = _cast(b_z, h_ptr.dtype.element_ty).to(tl.float32)
    b_lse = tl.load(lse_ptr + o_t, mask=m_t, other=0.0)[:, None]
    b_eu = tl.load(eu_ptr + o_t, mask=m_t, other=0.0)[:, None]
    b_glp = tl.load(g_lp_ptr + o_t, mask=m_t, other=0.0)[:, None]
    b_gh = tl.load(g_h_ptr + o_t, mask=m_t, other=0.0)[:, None]
    y = tl.load(labels_ptr + o_t, mask=m_t, other=-1)
    b_d = _dlogits(b_z, b_lse, b_eu, b_glp, b_gh, o_v[None, :] == y[:, None], inv_temperature, tanh_scale, SOFTCAP)
    p_dz = dz_ptr + o_t[:, None] * stride_dz + (o_v - v0)[None, :]
    tl.store(p_dz, _cast(b_d, dz_ptr.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])


@triton.heuristics({"HAS_DW": lambda args: args["dw_ptr"] is not None,
                    "HAS_BIAS": lambda args: args["db_ptr"] is not None})
@triton.jit(do_not_specialize=["n_tokens", "n_cols", "v0"])
def _head_dweight_kernel(
    dz_ptr, stride_dz, h_ptr, stride_h, dw_ptr, stride_dw, db_ptr,
    n_tokens, n_cols, dim, v0,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_DW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """``dW[v0 + c, d] = sum_t dz[t, c] h[t, d]`` for one ``[BLOCK_V, BLOCK_D]`` tile, summed over
    every token in fp32 in this program and written once in the weight's dtype; with a bias, the
    ``d = 0`` programs also write ``d_b[v0 + c] = sum_t dz[t, c]``."""
    i_v, i_d = tl.program_id(0), tl.program_id(1)
    o_c = (i_v * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_c, m_d = o_c < n_cols, o_d < dim
    b_dw = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    b_db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for t0 in range(0, n_tokens, BLOCK_T):
        o_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        m_t = o_t < n_tokens
        b_dz = tl.load(dz_ptr + o_t[:, None] * stride_dz + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        if HAS_BIAS:
            b_db += tl.sum(b_dz.to(tl.float32), axis=0)
        if HAS_DW:
            b_h = tl.load(h_ptr + o_t[:, None] * stride_h + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
            if DOT_FP32:
                b_dz, b_h = b_dz.to(tl.float32), b_h.to(tl.float32)
            b_dw = tl.dot(tl.trans(b_dz), b_h, b_dw, input_precision=INPUT_PRECISION)
    o_v = v0 + o_c
    if HAS_DW:
        p_dw = dw_ptr + o_v[:, None] * stride_dw + o_d[None, :]
        tl.store(p_dw, _cast(b_dw, dw_ptr.dtype.element_ty), mask=m_c[:, None] & m_d[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + o_v, _cast(b_db, db_ptr.dtype.element_ty), mask=m_c & (i_d == 0))


@triton.heuristics({"HAS_ACC": lambda args: args["acc_ptr"] is not None})
@triton.jit(do_not_specialize=["n_tokens", "n_cols", "v0"])
def _head_dhidden_kernel(
    dz_ptr, stride_dz, w_ptr, stride_w, acc_ptr, out_ptr,
    n_tokens, n_cols, dim, v0,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ACC: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """``out[t, d] = acc[t, d] + sum_c dz[t, c] W[v0 + c, d]`` for one ``[BLOCK_T, BLOCK_D]`` tile
    (``acc`` None: 0), the chunk's columns summed in fp32 in this program. ``acc`` and ``out`` are
    ``[N, dim]`` contiguous; they may be one tensor (the same lanes are read, then written)."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_t, m_d = o_t < n_tokens, o_d < dim
    m_out = m_t[:, None] & m_d[None, :]
    p_out = o_t[:, None] * dim + o_d[None, :]
    if HAS_ACC:
        b_dh = tl.load(acc_ptr + p_out, mask=m_out, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_V):
        o_c = (c0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        m_c = o_c < n_cols
        b_dz = tl.load(dz_ptr + o_t[:, None] * stride_dz + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        b_w = tl.load(w_ptr + (v0 + o_c)[:, None] * stride_w + o_d[None, :], mask=m_c[:, None] & m_d[None, :],
                      other=0.0)
        b_w = _cast(b_w, b_dz.dtype)
        if DOT_FP32:
            b_dz, b_w = b_dz.to(tl.float32), b_w.to(tl.float32)
        b_dh = tl.dot(b_dz, b_w, b_dh, input_precision=INPUT_PRECISION)
    tl.store(out_ptr + p_out, _cast(b_dh, out_ptr.dtype.element_ty), mask=m_out)


# ---------------------------------------------------------------------------------------------
# Launch configuration and launches (built in one place each, as in triton_kernels, so the GPU
# compile check compiles the launchers' own argument lists).

# (BLOCK_T, BLOCK_V, BLOCK_D, num_warps) per kernel on a GPU: "fp32" where an operand it loads is
# fp32 (fp32 compute dtype, or an fp32 weight beside bf16/fp16 hidden states), else "16bit". Fixed,
# not autotuned (no GPU has run them yet): the largest of a few tiles tried that compile for
# sm_80/90/100 in every layout with no local memory (aepo_kernels.triton_targets). fp32 operands
# hold more registers (IEEE/TF32 dots, no vectorised loads of unaligned rows): (64, 128, 64)
# logits tiles, (64 | 128, 128) d_hidden tiles and (64, 128) d_W tiles spilled there; 16-bit
# (64, 128, 64) logits tiles took 254-255 registers on unaligned rows (sm_80/90), BLOCK_D = 32 172.
GPU_BLOCKS = {
    "dlogits": {"16bit": (64, 128, 32, 8), "fp32": (64, 128, 32, 8)},
    "dweight": {"16bit": (32, 128, 128, 8), "fp32": (32, 64, 64, 4)},
    "dhidden": {"16bit": (128, 32, 128, 8), "fp32": (128, 32, 64, 8)},
}


def _blocks(kernel: str, dim: int, *dtypes: torch.dtype) -> tuple[int, int, int, int]:
    """The kernel's blocks for operands of ``dtypes``: :data:`GPU_BLOCKS`, or under the
    interpreter large tiles (fewer programs: each of its ops is a numpy call) with BLOCK_D
    covering a small D in one step."""
    if not _INTERPRET:
        return GPU_BLOCKS[kernel]["fp32" if torch.float32 in dtypes else "16bit"]
    block_d = min(128, max(16, triton.next_power_of_2(dim)))
    return {"dlogits": (512, 256, block_d, 4), "dweight": (512, 256, block_d, 4),
            "dhidden": (512, 256, block_d, 4)}[kernel]


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision for fp32 operands: IEEE unless torch allows TF32 matmuls."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _dot_fp32(dtype: torch.dtype) -> bool:
    return _INTERPRET and dtype != torch.float32


def _dlogits_launch(hidden, weight, bias, dz, labels, lse, eu, g_lp, g_h, v0, n_cols, inv_t, tanh_scale) -> Launch:
    n_tokens, dim = hidden.shape
    bt, bv, bd, warps = _blocks("dlogits", dim, hidden.dtype, weight.dtype)
    args = (hidden, hidden.stride(0), weight, weight.stride(0), bias, dz, dz.stride(0),
            labels, lse, eu, g_lp, g_h, n_tokens, dim, v0, v0 + n_cols, inv_t, tanh_scale or 0.0)
    meta = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd, DOT_FP32=_dot_fp32(hidden.dtype),
                INPUT_PRECISION=_precision(hidden.dtype), num_warps=warps)
    return Launch(_head_dlogits_kernel, (triton.cdiv(n_tokens, bt), triton.cdiv(n_cols, bv)), args, meta)


def _dweight_launch(dz, hidden, d_weight, d_bias, v0, n_cols) -> Launch:
    n_tokens, dim = hidden.shape
    bt, bv, bd, warps = _blocks("dweight", dim, hidden.dtype)
    args = (dz, dz.stride(0), hidden, hidden.stride(0), d_weight, 0 if d_weight is None else d_weight.stride(0),
            d_bias, n_tokens, n_cols, dim, v0)
    meta = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd, DOT_FP32=_dot_fp32(hidden.dtype),
                INPUT_PRECISION=_precision(hidden.dtype), num_warps=warps)
    d_blocks = triton.cdiv(dim, bd) if d_weight is not None else 1
    return Launch(_head_dweight_kernel, (triton.cdiv(n_cols, bv), d_blocks), args, meta)


def _dhidden_launch(dz, weight, acc, out, v0, n_cols) -> Launch:
    n_tokens, dim = out.shape
    bt, bv, bd, warps = _blocks("dhidden", dim, dz.dtype, weight.dtype)
    args = (dz, dz.stride(0), weight, weight.stride(0), acc, out, n_tokens, n_cols, dim, v0)
    meta = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd, DOT_FP32=_dot_fp32(dz.dtype),
                INPUT_PRECISION=_precision(dz.dtype), num_warps=warps)
    return Launch(_head_dhidden_kernel, (triton.cdiv(n_tokens, bt), triton.cdiv(dim, bd)), args, meta)


# ---------------------------------------------------------------------------------------------
# The gradient pass.


def supports(hidden: torch.Tensor, weight: torch.Tensor, filter_eps: float | None = None) -> bool:
    """Whether :func:`triton_gradient_pass` takes this call: hidden (the compute dtype) and the
    weight in :data:`HEAD_DTYPES` and no gradient filtering. Others run the torch pass."""
    return filter_eps is None and hidden.dtype in HEAD_DTYPES and weight.dtype in HEAD_DTYPES


def head_vocab_columns(n_tokens: int, vocab: int, dim: int, element_size: int, token_chunk: int,
                       vocab_chunk: int) -> int:
    """Columns ``C`` of the ``[N, C]`` dlogits buffer: at most ``vocab_chunk``, and within the bytes
    the torch pass holds for the same blocks (``[token_chunk, vocab_chunk]`` in the compute dtype and
    the fp32 ``[vocab_chunk, D]`` d_W block), a multiple of :data:`COLUMN_ALIGN` below V (at least
    one such multiple). At N = 16,384, D = 5,120, bf16 and the default blocks (2,048 x 4,096):
    3,072 columns, 96 MiB."""
    budget = token_chunk * vocab_chunk * element_size + vocab_chunk * dim * 4
    cols = min(vocab_chunk, budget // max(1, n_tokens * element_size))
    if cols >= vocab:
        return vocab
    return max(COLUMN_ALIGN, cols // COLUMN_ALIGN * COLUMN_ALIGN)


def _check(hidden, weight, bias, labels, stats: dict) -> None:
    if not (hidden.is_cuda or _INTERPRET):
        raise RuntimeError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in HEAD_DTYPES:
            raise TypeError(f"{name} dtype {t.dtype}: the triton head takes {HEAD_DTYPES}")
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
    n_tokens = hidden.shape[0]
    if labels.shape != (n_tokens,) or labels.device != hidden.device:
        raise ValueError(f"labels must be [{n_tokens}] on {hidden.device}, got {tuple(labels.shape)} on {labels.device}")
    for name, t in stats.items():
        if t.dtype != torch.float32 or t.shape != (n_tokens,) or t.device != hidden.device:
            raise TypeError(f"{name} must be float32 [{n_tokens}] on {hidden.device}, got {t.dtype} "
                            f"{tuple(t.shape)} on {t.device}")


def triton_gradient_pass(hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t: float,
                         tanh_scale: float | None, vocab_columns: int, need=(True, True, True)):
    """``(d_hidden, d_weight, d_bias)`` of :func:`aepo_kernels.fused_linear.gradient_pass` (same
    arguments, same maths; None where ``need`` says not needed), computed by the three kernels of
    this module over chunks of ``vocab_columns`` vocabulary columns (:func:`head_vocab_columns`).
    d_hidden comes back in hidden's dtype, d_weight and d_bias in theirs."""
    need_h, need_w, need_b = need
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    stats = {name: t.contiguous() for name, t in dict(lse=lse, eu=eu, g_lp=g_lp, g_h=g_h).items()}
    _check(hidden, weight, bias, labels, stats)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    d_weight = torch.empty_like(weight) if need_w else None
    d_bias = torch.empty_like(bias) if bias is not None and need_b else None
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
    if n_tokens == 0 or not (need_h or d_weight is not None or d_bias is not None):
        if d_hidden is not None:
            d_hidden.zero_()
        for t in (d_weight, d_bias):
            if t is not None:
                t.zero_()
        return d_hidden, d_weight, d_bias
    cols = max(1, min(vocab_columns, vocab))
    chunks = math.ceil(vocab / cols)
    targets = torch.where(valid, labels, torch.full_like(labels, -1)).to(torch.int64).contiguous()
    dz = torch.empty(n_tokens, cols, dtype=hidden.dtype, device=hidden.device)
    # d_hidden's fp32 accumulator across chunks: d_hidden itself when fp32, none with one chunk
    acc = None
    if need_h and chunks > 1:
        acc = d_hidden if hidden.dtype == torch.float32 else torch.empty(hidden.shape, dtype=torch.float32,
                                                                          device=hidden.device)
    for i, v0 in enumerate(range(0, vocab, cols)):
        n_cols = min(cols, vocab - v0)
        _dlogits_launch(hidden, weight, bias, dz, targets, stats["lse"], stats["eu"], stats["g_lp"], stats["g_h"],
                        v0, n_cols, inv_t, tanh_scale).run()
        if d_weight is not None or d_bias is not None:
            _dweight_launch(dz, hidden, d_weight, d_bias, v0, n_cols).run()
        if need_h:
            last = i == chunks - 1
            _dhidden_launch(dz, weight, None if i == 0 else acc, d_hidden if last or acc is None else acc,
                            v0, n_cols).run()
    return d_hidden, d_weight, d_bias


# ---------------------------------------------------------------------------------------------
# What the GPU compile check compiles (aepo_kernels.triton_targets).

# Example shapes of the compile matrix: D of the dense and unaligned layouts (Qwen3-14B's), and
# the token count (a runtime, unspecialised argument).
EXAMPLE_DIM = 5120
EXAMPLE_TOKENS = 16384


def example_launches(vocab: int, dtype: torch.dtype, layout: str, tanh_scale: float | None) -> dict[str, Launch]:
    """Every launch :func:`triton_gradient_pass` makes, built by its own launch builders on meta
    tensors for a ``[V, D]`` head in ``dtype`` (nothing runs): with and without a bias, d_W with
    and without d_b, d_hidden's first chunk (no accumulator; written in hidden's dtype) and a later
    one (read from the fp32 accumulator), and the weight stored in fp32 beside bf16/fp16 hidden
    states (fp32 master weights). Layouts as :func:`aepo_kernels.triton_targets.example_logits`:
    ``dense`` [N, D] / [V, D]; ``unaligned``, row-offset views of ``[., D + 1]`` buffers (starts and
    strides not multiples of 16 bytes); ``int64``, a weight of ``V x D >= 2^31`` elements (the
    kernels' offsets are int64 throughout)."""
    meta = dict(dtype=dtype, device="meta")
    dim = EXAMPLE_DIM
    if layout == "int64":
        need = -(-(1 << 31) // vocab)
        dim = -(-need // COLUMN_ALIGN) * COLUMN_ALIGN
    n = EXAMPLE_TOKENS

    def matrix(rows: int, wide: torch.dtype = dtype) -> torch.Tensor:
        if layout == "unaligned":
            return torch.empty(rows, dim + 1, dtype=wide, device="meta")[:, 1:]
        return torch.empty(rows, dim, dtype=wide, device="meta")

    hidden, weight = matrix(n), matrix(vocab)
    bias = torch.empty(vocab, **meta)
    like = lambda dt=torch.float32: torch.empty(n, dtype=dt, device="meta")  # noqa: E731
    labels, stats = like(torch.int64), [like() for _ in range(4)]
    cols = head_vocab_columns(n, vocab, dim, hidden.element_size(), 2048, 4096)
    dz = torch.empty(n, cols, **meta)
    d_hidden = torch.empty(n, dim, **meta)
    acc = torch.empty(n, dim, dtype=torch.float32, device="meta")

    def dlogits(w, b):
        return _dlogits_launch(hidden, w, b, dz, labels, *stats, cols, cols, 1.0, tanh_scale)

    def dweight(w_dtype, with_bias):
        d_b = torch.empty(vocab, dtype=w_dtype, device="meta") if with_bias else None
        return _dweight_launch(dz, hidden, torch.empty(vocab, dim, dtype=w_dtype, device="meta"), d_b, cols, cols)

    launches = {
        "head_dlogits": dlogits(weight, None),
        "head_dlogits_bias": dlogits(weight, bias),
        "head_dweight": dweight(dtype, False),
        "head_dweight_dbias": dweight(dtype, True),
        # d_hidden: one chunk (no accumulator); the first, a middle and the last of several
        "head_dhidden_one_chunk": _dhidden_launch(dz, weight, None, d_hidden, 0, cols),
        "head_dhidden_first": _dhidden_launch(dz, weight, None, acc, 0, cols),
        "head_dhidden_middle": _dhidden_launch(dz, weight, acc, acc, cols, cols),
        "head_dhidden_last": _dhidden_launch(dz, weight, acc, d_hidden, cols, cols),
    }
    if dtype == torch.float32:  # with torch.backends.cuda.matmul.allow_tf32 on: TF32 dots
        for name in ("head_dlogits", "head_dweight", "head_dhidden_last"):
            launch = launches[name]
            launches[f"{name}_tf32"] = dataclasses.replace(launch, meta={**launch.meta, "INPUT_PRECISION": "tf32"})
    else:  # fp32 master weights beside low-precision hidden states
        wide = matrix(vocab, torch.float32)
        launches["head_dlogits_fp32_weight"] = dlogits(wide, None)
        launches["head_dweight_fp32_weight"] = dweight(torch.float32, False)
        launches["head_dhidden_fp32_weight"] = _dhidden_launch(dz, wide, acc, d_hidden, cols, cols)
    return launches
