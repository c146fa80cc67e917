"""Log-probs and entropies straight from hidden states and the lm_head weight: no ``[N, V]`` tensor.

``logits = hidden @ weight.T (+ bias)`` is computed block by block, ``[token_chunk, vocab_chunk]``
at a time, and folded into per-token online-softmax statistics (see
:func:`aepo_kernels.logits_ops.chunk_stats`). Forward keeps ``lse`` and ``Eu`` per token;
backward recomputes each logits block, forms its dlogits block with the same formula as the
logits-level backward, and accumulates
    d hidden += dlogits_block @ weight_block          (fp32 accumulator, [N, D])
    d weight_block += dlogits_block.T @ hidden_chunk  (fp32 accumulator, one [vocab_chunk, D] at a time)
The loops run vocabulary-outer so each weight block is read once per pass and the full-size fp32
weight gradient never exists (only the final gradient in the weight's dtype).

Cost of :func:`fused_linear_logprob_entropy`: the logits matmul is done twice (forward and
backward recompute) plus the two gradient matmuls, 4 N V D multiply-adds: it returns log-probs
and entropies whose upstream gradients are unknown during forward. The AEPO loss does not have
that problem once the entropy statistics and normalisers are supplied:
:class:`FusedLinearAEPOLossFunction` (below; public as
:func:`aepo_kernels.fused_linear_aepo_policy_loss`) knows every per-token gradient inside the
forward loop and computes d_hidden and d_weight there -- 3 matmuls, nothing recomputed.
Its fp32 ``[V, D]`` accumulator is what :class:`FusedLinearAEPOVocabOuterFunction` avoids (issue 54,
docs/head.md): a statistics pass, the per-token head, then this module's vocabulary-outer
gradient pass (:func:`gradient_pass`, or with ``backend="triton"`` asked for explicitly, the
Triton kernels of :mod:`aepo_kernels.triton_head`: not the default before a GPU has run them) with the AEPO loss's ``g_lp``/``g_H`` -- 4
matmuls, one logits recomputation. Its lean passes (:func:`lean_passes`, ``vocab_outer_lean``) avoid the
fp32 ``[N, D]`` d_hidden accumulator too: d_hidden from a token-outer pass of its own (per token chunk:
its statistics, its head, its fp32 ``[rows, D]`` block over the vocabulary), d_W as above -- 5 matmuls.
:func:`fused_linear_aepo_loss` picks the order (``head_backward``; :func:`default_head_backward`).

Matmul dtype: every matmul takes its operands in ``hidden``'s dtype (the compute dtype: bf16 in a
bf16 run), the weight cast to it block by block where it is stored wider (fp32 master weights under
autocast), so a bf16 run never multiplies fp32 copies of ``[tokens, V]`` or ``[V, D]`` operands. The
GEMMs accumulate in fp32 internally (cuBLAS and oneDNN do for bf16/fp16); where a product is added
into a longer-lived fp32 accumulator (d_W, and d_hidden of the two-pass path) :func:`addmm_accumulate`
adds it without rounding it to the compute dtype on CUDA (``addmm(out_dtype=float32)``) and in
vocabulary slices of a rounded product elsewhere. Accumulators and outputs stay fp32.

``logit_scale`` and ``softcap`` (models whose head is followed by ``z * s`` and/or
``c tanh(z / c)``: Cohere, Gemma-2) are applied to each logits block inside the row ops
(:func:`aepo_kernels.logits_ops.logit_map`), gradient included; nothing extra is materialised.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import contract
from .compile import compiled
from .logits_ops import (
    accumulate_dtype, fast_chunk_grad, fast_chunk_grad_inplace, fast_chunk_stats, finish_stats, logit_map, map_logits,
    merge_stats, shift_labels_left, shift_to_labels,
)

# The one memory budget of the fused-linear paths: bytes of the logits block(s) one step may hold.
# At V = 151,936 fp32 it gives 331-row blocks for the one-pass loss. Why 192 MiB (its peak and time
# against 256 MiB and against materialising the logits): docs/benchmarks.md, "The one-pass AEPO loss
# on CPU" (bench/bench_aepo_loss.py ':<M>MiB' cases).
DEFAULT_CHUNK_BYTES = 192 << 20
# On CUDA the budget comes from free memory instead (:func:`chunk_bytes_for`): every token chunk of
# the one-pass loss read-modify-writes the fp32 [V, D] weight-gradient accumulator (2.9 GiB at
# Qwen3-14B's V x D), so 192 MiB blocks (662 bf16 rows at V = 151,936) would move ~155 GB for a
# 16K-token micro-batch; 2 GiB blocks (7,067 rows) cut that to 3 passes.
CUDA_CHUNK_BYTES_MAX = 2 << 30
CUDA_FREE_SHARE = 8  # the block takes at most 1/8 of the free memory


def chunk_bytes_for(device: torch.device, chunk_bytes: int | None = None) -> int:
    """The logits-block budget on ``device``: ``chunk_bytes`` when given; else
    :data:`DEFAULT_CHUNK_BYTES` off CUDA and, on CUDA, an eighth of the free memory within
    ``[DEFAULT_CHUNK_BYTES, CUDA_CHUNK_BYTES_MAX]`` (1-2 GiB with 8-16 GiB free or more)."""
    if chunk_bytes is not None:
        return chunk_bytes
    if device.type != "cuda":
        return DEFAULT_CHUNK_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(CUDA_CHUNK_BYTES_MAX, max(DEFAULT_CHUNK_BYTES, free // CUDA_FREE_SHARE)))


def chunks_for_budget(vocab: int, chunk_bytes: int) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` of :func:`fused_linear_logprob_entropy`: a vocab block of at
    most 16K columns and as many rows as keep ~3 fp32 ``[rows, vocab_chunk]`` temporaries within
    ``chunk_bytes``."""
    vocab_chunk = min(vocab, 1 << 14)
    return max(1, chunk_bytes // (3 * 4 * vocab_chunk)), vocab_chunk


# Rows of the rounded partial product :func:`addmm_accumulate` forms at a time without fp32 output
# GEMMs: bounds its temporary to [rows, N] in the compute dtype.
ACCUMULATE_SLICE_ROWS = 1 << 13


@functools.cache
def _fp32_out_gemm(device: torch.device) -> bool:
    """Whether ``addmm(acc, a, b, out_dtype=float32, out=acc)`` accumulates bf16 operands into an
    fp32 tensor in place on ``device`` (CUDA builds that have the fp32-output GEMM); checked once on a
    small product against float64 so that a build without it, or one that mishandles ``out=input``,
    falls back to the sliced path instead of returning wrong gradients."""
    if device.type != "cuda":
        return False
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(48, 40, device=device, generator=gen).bfloat16()
        b = torch.randn(40, 24, device=device, generator=gen).bfloat16()
        acc = torch.randn(48, 24, device=device, generator=gen)
        want = acc.double() + a.double() @ b.double()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc.double(), want, rtol=1e-4, atol=1e-4))
    except (RuntimeError, TypeError):
        return False


def addmm_accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for a wider accumulator (fp32 ``acc [M, N]``; ``a [M, K]``, ``b [K, N]`` in
    the compute dtype): the GEMM runs on the compute-dtype operands, never on fp32 copies of them.

    Same dtypes: one in-place ``addmm``. CUDA: one GEMM with fp32 output into ``acc``. Elsewhere
    (CPU bf16): the product of ``ACCUMULATE_SLICE_ROWS`` rows at a time, rounded once to the compute
    dtype (its GEMM accumulates in fp32), added into ``acc``.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_out_gemm(a.device) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        for r0 in range(0, a.shape[0], ACCUMULATE_SLICE_ROWS):
            acc[r0 : r0 + ACCUMULATE_SLICE_ROWS].add_(a[r0 : r0 + ACCUMULATE_SLICE_ROWS] @ b)


def _logits_block(hidden_chunk, weight_block, bias_block, out=None):
    """``[tc, D] x [vc, D] -> [tc, vc]`` in the operands' (compute) dtype, the bias added inside
    the GEMM (one rounding, as ``nn.Linear`` computes it); into ``out`` when given."""
    if bias_block is None:
        return torch.mm(hidden_chunk, weight_block.T, out=out)
    return torch.addmm(bias_block, hidden_chunk, weight_block.T, out=out)


class FusedLinearLogprobEntropyFunction(torch.autograd.Function):
    """autograd for ``(hidden [N, D], weight [V, D], bias [V] | None) -> (logp [N], H [N])``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, tanh_scale, ignore_index, token_chunk, vocab_chunk):
        valid = contract.target_mask(labels, weight.shape[0], ignore_index)
        lse, eu, target = stats_pass(hidden, weight, bias, labels, valid, inv_t, tanh_scale, token_chunk, vocab_chunk)
        logp = torch.where(valid, target - lse, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, labels, lse, eu, valid)
        ctx.config = (inv_t, tanh_scale, token_chunk, vocab_chunk)
        return logp, lse - eu

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, bias, labels, lse, eu, valid = ctx.saved_tensors
        inv_t, tanh_scale, token_chunk, vocab_chunk = ctx.config
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype).masked_fill(~valid, 0.0)
        g_h = torch.zeros_like(lse) if g_h is None else g_h.to(lse.dtype)
        d_hidden, d_weight, d_bias = gradient_pass(
            hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale, token_chunk, vocab_chunk,
            need=ctx.needs_input_grad[:3])
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def stats_pass(hidden, weight, bias, labels, valid, inv_t, tanh_scale, token_chunk, vocab_chunk, block=None):
    """Per-token ``(lse, Eu, u_target)`` of the logits ``hidden @ weight.T + bias`` (fp32; fp64 for
    fp64 hidden states), vocabulary blocks outer and token chunks inner, one ``[token_chunk,
    vocab_chunk]`` block at a time: one logits matmul, no gradient. ``u_target`` is 0 where
    ``valid`` is False (no target). ``block``: a flat buffer of at least ``token_chunk x
    vocab_chunk`` elements in the compute dtype the blocks are written into (else each is new)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    dtype = hidden.dtype  # the compute dtype of every matmul
    f32 = dict(dtype=accumulate_dtype(hidden.dtype), device=hidden.device)
    stats = (torch.full((n_tokens,), float("-inf"), **f32), torch.zeros(n_tokens, **f32), torch.zeros(n_tokens, **f32))
    target = torch.zeros(n_tokens, **f32)
    for v0 in range(0, vocab, vocab_chunk):
        w, b = _weight_block(weight, bias, v0, vocab_chunk, dtype)  # [vc, D], [vc] in the compute dtype
        in_block = valid & (labels >= v0) & (labels < v0 + w.shape[0])
        for i0 in range(0, n_tokens, token_chunk):
            rows = slice(i0, i0 + token_chunk)
            z = _logits_block(hidden[rows], w, b, _block_view(block, hidden[rows].shape[0], w.shape[0]))  # [tc, vc]
            hit = in_block[rows]
            local = torch.where(hit, labels[rows] - v0, torch.zeros_like(labels[rows]))
            z_target = map_logits(z.gather(-1, local.unsqueeze(-1)).squeeze(-1), inv_t, tanh_scale).to(target.dtype)
            target[rows] += torch.where(hit, z_target, 0.0)
            merged = merge_stats(tuple(x[rows] for x in stats), fast_chunk_stats(z, inv_t, tanh_scale))
            for acc, value in zip(stats, merged):
                acc[rows] = value
    lse, eu = finish_stats(*stats)
    return lse, eu, target


def gradient_pass(hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale, token_chunk, vocab_chunk,
                  need=(True, True, True), filter_eps: float | None = None, counts: dict | None = None,
                  in_place: bool = False, block=None):
    """``(d_hidden, d_weight, d_bias)`` of ``sum_t g_lp[t] logp_t + g_h[t] H_t`` from the per-token
    statistics ``lse``, ``Eu``: vocabulary blocks outer, token chunks inner. Each logits block is
    recomputed (matmul 1) and turned into its dlogits block (:func:`fast_chunk_grad`); then
        d_hidden[rows] += dz @ W_block            (matmul 2, fp32 ``[N, D]`` accumulator)
        d_W_block      += dz.T @ h[rows]          (matmul 3, fp32 ``[vocab_chunk, D]`` accumulator)
    and each finished ``d_W`` block is written once in the weight's dtype: the full-size fp32
    ``[V, D]`` accumulator never exists. ``need``: which of the three to compute (autograd's
    ``needs_input_grad``); None where not needed.

    ``filter_eps`` (gradient filtering, Cut Cross-Entropy's sparsity; None: off, exact): a
    ``[token_chunk, vocab_chunk]`` tile whose probability mass ``sum_j p_tj`` is below
    ``filter_eps`` for every row ``t`` skips its dlogits and both gradient matmuls; only its
    target entries (a row whose label lies in the block) are added, exactly, as a sparse update.
    The error is what the skipped ``p`` terms would have added (at most ``filter_eps`` times
    ``|g_lp| + |g_h| max|Eu - u|`` per row and block, times the operand norms). ``counts`` (a dict)
    receives ``tiles`` and ``skipped``, added to the counts it already holds.

    ``in_place``: one ``[token_chunk, vocab_chunk]`` buffer in the compute dtype is reused for every
    block and the dlogits are written over the logits in it (as the token-outer loss does; its
    bias gradient sums the dlogits in that dtype): no fp32 dlogits block, no per-block allocation.
    Else each block is new and its dlogits fp32, rounded to the compute dtype for the matmuls.
    """
    need_h, need_w, need_b = need
    acc = dict(dtype=lse.dtype, device=hidden.device)
    dtype, vocab = hidden.dtype, weight.shape[0]
    d_hidden = torch.zeros(hidden.shape, **acc) if need_h else None
    d_weight = torch.empty_like(weight) if need_w else None
    d_bias = torch.empty_like(bias) if bias is not None and need_b else None
    tiles = skipped = 0
    if in_place and block is None:
        block = new_block(hidden, vocab, token_chunk, vocab_chunk)
    for v0 in range(0, vocab, vocab_chunk):
        w, b = _weight_block(weight, bias, v0, vocab_chunk, dtype)
        in_block = valid & (labels >= v0) & (labels < v0 + w.shape[0])
        d_w = torch.zeros(w.shape, **acc) if need_w else None
        d_b = torch.zeros(w.shape[0], **acc) if d_bias is not None else None
        for i0 in range(0, hidden.shape[0], token_chunk):
            rows = slice(i0, i0 + token_chunk)
            h = hidden[rows]
            z = _logits_block(h, w, b, _block_view(block, h.shape[0], w.shape[0]))
            local = torch.where(in_block[rows], labels[rows] - v0, torch.full_like(labels[rows], -1))
            tiles += 1
            if filter_eps is not None and bool(fast_block_mass(z, lse[rows], inv_t, tanh_scale).amax() < filter_eps):
                skipped += 1
                _add_target_entries(z, local, lse[rows], eu[rows], g_lp[rows], g_h[rows], inv_t, tanh_scale, h, w,
                                    None if d_hidden is None else d_hidden[rows], d_w, d_b)
                continue
            if in_place:  # dlogits over the logits block, in the compute dtype (maths in fp32)
                fast_chunk_grad_inplace(z, local, lse[rows], eu[rows], g_lp[rows], g_h[rows], inv_t, tanh_scale)
                dz = dz_mm = z
            else:
                dz = fast_chunk_grad(z, local, lse[rows], eu[rows], g_lp[rows], g_h[rows], inv_t, tanh_scale)  # fp32
                dz_mm = dz.to(dtype)
            if d_hidden is not None:
                addmm_accumulate(d_hidden[rows], dz_mm, w)  # [tc, D]
            if d_w is not None:
                addmm_accumulate(d_w, dz_mm.T, h)  # [vc, D]
            if d_b is not None:
                d_b += dz.sum(0, dtype=acc["dtype"])
            del z, dz, dz_mm  # freed before the next block is made, not after: one block alive at a time
        if d_weight is not None:
            d_weight[v0 : v0 + vocab_chunk].copy_(d_w)  # rounded once, into place: no block-sized copy
        if d_bias is not None:
            d_bias[v0 : v0 + vocab_chunk].copy_(d_b)
        del d_w, d_b
    if counts is not None:  # added to what it holds: a call of several passes sums them
        counts.update(tiles=counts.get("tiles", 0) + tiles, skipped=counts.get("skipped", 0) + skipped)
    return None if d_hidden is None else d_hidden.to(hidden.dtype), d_weight, d_bias


def new_block(hidden, vocab: int, token_chunk: int, vocab_chunk: int) -> torch.Tensor:
    """The flat buffer one ``[token_chunk, vocab_chunk]`` logits block of ``hidden``'s dtype lives in."""
    return torch.empty(min(token_chunk, hidden.shape[0]) * min(vocab_chunk, vocab), dtype=hidden.dtype,
                       device=hidden.device)


def _block_view(block, rows: int, cols: int):
    """``[rows, cols]`` contiguous in the flat ``block`` (None: None)."""
    return None if block is None else block[: rows * cols].view(rows, cols)


def block_mass(z, lse, inv_t: float, tanh_scale: float | None = None) -> torch.Tensor:
    """``[R]``: the probability mass ``sum_j exp(u_j - lse)`` of each row of the block ``z [R, C]``."""
    return (map_logits(z, inv_t, tanh_scale) - lse.unsqueeze(-1)).exp().sum(-1)


fast_block_mass = compiled(block_mass)


def _add_target_entries(z, local, lse, eu, g_lp, g_h, inv_t, tanh_scale, h, w, d_hidden_rows, d_w, d_b):
    """The exact dlogits of the target entries of a filtered tile (rows whose label is in the block),
    added as sparse updates to ``d_hidden``, the ``d_W`` block and ``d_b``."""
    rows = (local >= 0).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return
    cols = local[rows]
    x = z[rows, cols].to(lse.dtype)
    if tanh_scale is None:
        u, du_dz = x * inv_t, inv_t
    else:
        th = torch.tanh(x * tanh_scale)
        u, du_dz = th * inv_t, (1 - th * th) * (tanh_scale * inv_t)
    p = (u - lse[rows]).exp()
    dz = (g_lp[rows] * (1 - p) + g_h[rows] * p * (eu[rows] - u)) * du_dz  # [k]
    if d_hidden_rows is not None:
        d_hidden_rows.index_add_(0, rows, (dz.unsqueeze(-1) * w[cols].to(dz.dtype)).to(d_hidden_rows.dtype))
    if d_w is not None:
        d_w.index_add_(0, cols, (dz.unsqueeze(-1) * h[rows].to(dz.dtype)).to(d_w.dtype))
    if d_b is not None:
        d_b.index_add_(0, cols, dz.to(d_b.dtype))


def _weight_block(weight, bias, v0, vocab_chunk, dtype):
    """Rows ``v0 : v0 + vocab_chunk`` of the weight (and bias) in the compute dtype (a copy only
    when the weight is stored wider, e.g. fp32 master weights under autocast)."""
    w = weight[v0 : v0 + vocab_chunk].to(dtype)
    return w, None if bias is None else bias[v0 : v0 + vocab_chunk].to(dtype)


def fused_linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    shift_labels: bool | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    chunk_bytes: int | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` and entropies of ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: ``[N, D]`` or ``[B, T, D]`` final hidden states (after the last norm).
        weight: ``[V, D]`` lm_head weight (hidden first: Liger's order is (weight, hidden)); bias:
            optional ``[V]``.
        labels: ``[N]`` / ``[B, T]`` token ids in ``[0, V)``; ``ignore_index`` gives log-prob 0 and
            no gradient; other values are refused (:mod:`aepo_kernels.contract`).
        shift_labels: required, no default. True: hidden row t predicts ``labels[t+1]``; outputs
            aligned with ``labels`` (token 0: 0), as :func:`aepo_kernels.logprob_entropy`. False:
            hidden row t predicts ``labels[t]``.
        token_chunk, vocab_chunk: block sizes, by default derived from ``chunk_bytes``
            (:func:`chunks_for_budget`; None: :func:`chunk_bytes_for` the device); peak extra memory is a few fp32
            ``[token_chunk, vocab_chunk]`` blocks plus an fp32 ``[N, D]`` and ``[vocab_chunk, D]``.
        logit_scale, softcap: the model's logits are ``softcap * tanh(logit_scale * z / softcap)``
            of the raw ``z = hidden @ weight.T + bias`` (:func:`aepo_kernels.logits_ops.logit_map`).
    Returns:
        ``(logprobs, entropy)``: fp32, shaped like ``labels``; gradients flow to hidden, weight, bias.
        The matmuls run in ``hidden``'s dtype (module docstring).
    """
    shift = contract.alignment("fused_linear_logprob_entropy", shift_labels)
    contract.check_hidden("fused_linear_logprob_entropy", hidden, weight, labels, bias)
    contract.enforce("fused_linear_logprob_entropy", [contract.label_rule(labels, weight.shape[0], ignore_index)])
    inv_t, tanh_scale = logit_map(temperature, logit_scale, softcap)
    auto_tokens, auto_vocab = chunks_for_budget(weight.shape[0], chunk_bytes_for(hidden.device, chunk_bytes))
    token_chunk, vocab_chunk = token_chunk or auto_tokens, vocab_chunk or auto_vocab
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels_left(labels, ignore_index) if shift else labels
    logp, entropy = FusedLinearLogprobEntropyFunction.apply(
        flat_hidden, weight, bias, targets.reshape(-1).long(), inv_t, tanh_scale, ignore_index, token_chunk, vocab_chunk
    )
    logp, entropy = logp.reshape(labels.shape), entropy.reshape(labels.shape)
    return (shift_to_labels(logp), shift_to_labels(entropy)) if shift else (logp, entropy)


# ---------------------------------------------------------------------------------------------
# The one-pass AEPO loss from hidden states: the gradient is computed in the forward loop.

def token_chunk_for_budget(vocab: int, chunk_bytes: int, element_size: int = 4) -> int:
    """Rows of the ``[rows, V]`` logits buffer of :class:`FusedLinearAEPOLossFunction` (elements of
    ``element_size`` bytes: the compute dtype's) that fit in ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // max(1, vocab * element_size))


class FusedLinearAEPOLossFunction(torch.autograd.Function):
    """``(hidden [N, D], weight [V, D], bias [V] | None) -> (loss, rows [6, N])``.

    Per token chunk of ``token_chunk`` rows: ``z = h @ W.T (+ b)`` into one reused ``[rows, V]``
    buffer (matmul 1); the one-pass row op (:func:`aepo_kernels.one_pass.one_pass_rows`) turns z
    into dlogits in place; ``d_hidden[rows] = dz @ W`` (matmul 2) and ``d_W += dz.T @ h``
    (matmul 3, into an fp32 accumulator, :func:`addmm_accumulate`). All three take their operands
    in ``hidden``'s dtype (W cast once per call when stored wider); the row op reads and writes the
    buffer in that dtype and does its maths in fp32. Backward only scales the three stored gradients.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inputs, config, inv_t, ignore_index, backend, token_chunk,
                tanh_scale=None):
        # The matmul dtype is hidden's (the caller casts it), not an enclosing autocast region's.
        with torch.autocast(hidden.device.type, enabled=False):
            return FusedLinearAEPOLossFunction._forward(ctx, hidden, weight, bias, labels, inputs, config, inv_t,
                                                        ignore_index, backend, token_chunk, tanh_scale)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, labels, inputs, config, inv_t, ignore_index, backend, token_chunk,
                 tanh_scale):
        from .one_pass import one_pass_rows

        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        dtype, acc = hidden.dtype, accumulate_dtype(hidden.dtype)
        w_mm = weight.to(dtype)  # [V, D]; a copy only when the weight is stored wider than hidden
        b_mm = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        d_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if need_b and bias is not None else None
        rows_out = torch.empty(6, n_tokens, dtype=acc, device=hidden.device)
        buffer = torch.empty(min(token_chunk, n_tokens), vocab, dtype=dtype, device=hidden.device)
        for i0 in range(0, n_tokens, token_chunk):
            rows = slice(i0, i0 + token_chunk)
            h = hidden[rows]  # [tc, D]
            z = buffer[: h.shape[0]]  # [tc, V]
            if b_mm is None:
                torch.mm(h, w_mm.T, out=z)
            else:
                torch.addmm(b_mm, h, w_mm.T, out=z)
            part = inputs.rows(slice(0, 1), rows)  # [1, tc] fields
            z3 = z[None]  # one object as logits and out: the row op writes dlogits in place
            rows_out[:, rows] = one_pass_rows(z3, labels[:, rows], part, config, inv_t, ignore_index, z3, backend,
                                              tanh_scale)[:, 0]
            if d_hidden is not None:
                torch.mm(z, w_mm, out=d_hidden[rows])
            if d_weight is not None:
                addmm_accumulate(d_weight, z.T, h)  # [V, D] fp32 += [V, tc] @ [tc, D]
            if d_bias is not None:
                d_bias += z.sum(0, dtype=acc)
        ctx.mark_non_differentiable(rows_out)
        ctx.save_for_backward(
            None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))
        loss = (rows_out[2] * inputs.weight[0].to(acc)).sum()
        return loss, rows_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_rows):
        from .one_pass import scale_gradient

        d_hidden, d_weight, d_bias = (scale_gradient(g, grad_loss) for g in ctx.saved_tensors)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# The vocabulary-outer head: no fp32 [V, D] weight-gradient accumulator (docs/head.md).

# The three orders of the AEPO loss's head (:func:`fused_linear_aepo_loss`, docs/head.md); which one
# a call takes when it names none is :func:`default_head_backward`'s, the one place the default lives.
HEAD_BACKWARDS = ("vocab_outer", "token_outer", "vocab_outer_lean")
# The CPU default, by measurement at V = 151,936, D = 1,024, N = 2,048 (docs/head.md,
# bench/bench_head_backward.py). CUDA: by the memory plan's rule until a GPU measures it
# (:func:`default_head_backward`).
CPU_HEAD_BACKWARD = "token_outer"
# What the head may hold beyond its outputs (d_W in the weight's dtype, d_hidden in hidden's): the
# CUDA default's rule (:func:`default_head_backward`) and the budget vocab_outer_lean's blocks are
# cut from (:func:`lean_chunks`). The one constant of both.
HEAD_WORKSPACE_BYTES = 64 << 20
# Blocks of the vocabulary-outer passes: ``VOCAB_OUTER_CHUNK`` vocabulary columns by as many token
# rows as keep one fp32 ``[rows, VOCAB_OUTER_CHUNK]`` block within ``VOCAB_OUTER_BLOCK_BYTES``
# (the logits block in the compute dtype and the bf16 copy of dlogits come beside it). Measured
# on CPU: docs/head.md.
VOCAB_OUTER_CHUNK = 4096
VOCAB_OUTER_BLOCK_BYTES = 32 << 20


def default_head_backward(device: torch.device | str, n_tokens: int, vocab: int, dim: int, element_size: int) -> str:
    """The head order a call of ``n_tokens`` rows, ``weight [vocab, dim]`` and hidden states of
    ``element_size`` bytes on ``device`` takes when it names none (:data:`HEAD_BACKWARDS`): off CUDA
    :data:`CPU_HEAD_BACKWARD` (measured); on CUDA the memory plan's rule, "the head's workspace
    beyond its outputs stays within :data:`HEAD_WORKSPACE_BYTES`": ``vocab_outer`` (4 matmuls)
    where its fp32 ``[N, D]`` d_hidden accumulator and its default blocks fit
    (:func:`vocab_outer_workspace`), else ``vocab_outer_lean`` (5 matmuls, blocks cut from that
    budget). The kernels' dispatch and the memory plan (``"cuda"`` / ``"cpu"``) both ask it."""
    if torch.device(device).type != "cuda":
        return CPU_HEAD_BACKWARD
    fits = vocab_outer_workspace(n_tokens, vocab, dim, element_size) <= HEAD_WORKSPACE_BYTES
    return "vocab_outer" if fits else "vocab_outer_lean"


def resolve_head_backward(head_backward: str | None, hidden: torch.Tensor, weight: torch.Tensor) -> str:
    """``head_backward`` checked, or :func:`default_head_backward` of ``hidden [..., D]`` and
    ``weight [V, D]`` when None (or ``"auto"``)."""
    if head_backward in (None, "auto"):
        dim = hidden.shape[-1]
        return default_head_backward(hidden.device, hidden.numel() // max(1, dim), weight.shape[0], dim,
                                     hidden.element_size())
    if head_backward not in HEAD_BACKWARDS:
        raise ValueError(f"head_backward={head_backward!r}: choose one of {HEAD_BACKWARDS} (or None / 'auto')")
    return head_backward


def vocab_outer_chunks(n_tokens: int, vocab: int, block_bytes: int = VOCAB_OUTER_BLOCK_BYTES,
                       vocab_chunk: int = VOCAB_OUTER_CHUNK) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` of the vocabulary-outer passes: ``vocab_chunk`` columns (at
    most V) and as many rows (at most ``n_tokens``) as keep an fp32 block within ``block_bytes``."""
    vocab_chunk = min(vocab, vocab_chunk)
    return max(1, min(n_tokens, block_bytes // (4 * vocab_chunk))), vocab_chunk


def lean_chunks(n_tokens: int, vocab: int, dim: int, budget: int = HEAD_WORKSPACE_BYTES,
                vocab_chunk: int | None = None) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` of ``vocab_outer_lean`` from its workspace ``budget``: half
    of it for the fp32 ``[vocab_chunk, D]`` d_W block (a multiple of 64 columns, at least 64, at
    most :data:`VOCAB_OUTER_CHUNK` and V; ``vocab_chunk`` when given), half for a token chunk's
    rows: its fp32 ``[rows, D]`` d_hidden block with its copy in hidden's dtype (8 bytes per
    element, an fp32 copy counted) and its ``[rows, vocab_chunk]`` logits block (4 bytes per
    element). On CUDA in bf16 the workspace (:func:`lean_workspace`) stays within ``budget``:
    1,600 columns x 708 rows, 33 MiB, at D = 5,120 and 64 MiB."""
    half = budget // 2
    if vocab_chunk is None:
        vocab_chunk = min(VOCAB_OUTER_CHUNK, max(64, half // (4 * dim) // 64 * 64))
    vocab_chunk = min(vocab, vocab_chunk)
    return max(1, min(n_tokens, half // (8 * dim + 4 * vocab_chunk))), vocab_chunk


def head_chunks(order: str, n_tokens: int, vocab: int, dim: int, chunk_bytes: int | None = None,
                token_chunk: int | None = None, vocab_chunk: int | None = None) -> tuple[int, int]:
    """``(token_chunk, vocab_chunk)`` of a vocabulary-outer order: ``vocab_outer``,
    :func:`vocab_outer_chunks` with ``chunk_bytes`` the fp32 block's budget (None:
    :data:`VOCAB_OUTER_BLOCK_BYTES`); ``vocab_outer_lean``, :func:`lean_chunks` with ``chunk_bytes``
    its workspace budget (None: :data:`HEAD_WORKSPACE_BYTES`). A given chunk wins."""
    if order == "vocab_outer_lean":
        rows, columns = lean_chunks(n_tokens, vocab, dim, chunk_bytes or HEAD_WORKSPACE_BYTES, vocab_chunk)
    else:
        rows, columns = vocab_outer_chunks(n_tokens, vocab, chunk_bytes or VOCAB_OUTER_BLOCK_BYTES,
                                           vocab_chunk or VOCAB_OUTER_CHUNK)
    return token_chunk or rows, columns


def _product_bytes(element_size: int, cuda: bool) -> int:
    """Bytes per element :func:`addmm_accumulate` makes beside an fp32 accumulator: off CUDA in a
    low-precision run the rounded product and its fp32 conversion for the addition; none on CUDA
    (the fp32-output GEMM) or in fp32 (an in-place ``addmm``)."""
    return 0 if cuda or element_size == 4 else element_size + 4


def vocab_outer_workspace(n_tokens: int, vocab: int, dim: int, element_size: int, block_bytes: int | None = None,
                          cuda: bool = True) -> int:
    """Bytes ``vocab_outer`` holds beyond its outputs at its peak (its gradient pass): the fp32
    ``[N, D]`` d_hidden accumulator (none in fp32: it is d_hidden), the one ``[rows,
    vocab_chunk]`` logits block in the compute dtype, the fp32 ``[vocab_chunk, D]`` d_W block and
    what :func:`addmm_accumulate` adds to it (:func:`_product_bytes`); blocks from
    :func:`vocab_outer_chunks` of ``block_bytes`` (None: :data:`VOCAB_OUTER_BLOCK_BYTES`)."""
    rows, vocab_chunk = vocab_outer_chunks(n_tokens, vocab, block_bytes or VOCAB_OUTER_BLOCK_BYTES)
    accumulator = 4 * n_tokens * dim if element_size != 4 else 0
    return accumulator + rows * vocab_chunk * element_size + vocab_chunk * dim * (
        4 + _product_bytes(element_size, cuda))


def lean_workspace(n_tokens: int, vocab: int, dim: int, element_size: int, budget: int | None = None,
                   cuda: bool = True) -> int:
    """Bytes ``vocab_outer_lean`` holds beyond its outputs at its peak, the larger of its two
    passes' (blocks from :func:`lean_chunks` of ``budget``, None: :data:`HEAD_WORKSPACE_BYTES`), each
    with the one ``[rows, vocab_chunk]`` logits block in the compute dtype: the d_hidden pass, a
    token chunk's fp32 ``[rows, D]`` block with what :func:`addmm_accumulate` adds to it, or at its
    end its copy in hidden's dtype (none in fp32); the d_W pass, the fp32 ``[vocab_chunk, D]``
    block with what :func:`addmm_accumulate` adds to it."""
    rows, vocab_chunk = lean_chunks(n_tokens, vocab, dim, budget or HEAD_WORKSPACE_BYTES)
    product = _product_bytes(element_size, cuda)
    copy = element_size if element_size != 4 else 0
    d_hidden_pass = rows * dim * (4 + max(product, copy))
    return rows * vocab_chunk * element_size + max(d_hidden_pass, vocab_chunk * dim * (4 + product))


def head_rows(logp, entropy, valid, inputs, hp):
    """The per-token head of the one-pass loss from finished ``logp``/``entropy`` (``[N]``, the
    math dtype): ``(g_lp, g_h, rows [6, N])`` exactly as :func:`aepo_kernels.one_pass.row_head`
    (``inputs``: :class:`RowInputs` with ``[N]`` fields)."""
    from .one_pass import token_head

    acc = logp.dtype
    adv_neg = None if inputs.advantages_neg is None else inputs.advantages_neg.to(acc)
    loss, d_logp, d_h, ratio, shaped, kl = token_head(
        logp, entropy, inputs.old_logprobs.to(acc), inputs.advantages.to(acc), inputs.ref_or_old.to(acc),
        inputs.entropy_mean.to(acc), inputs.entropy_std.to(acc), hp, adv_neg)
    weight = torch.where(valid, inputs.weight.to(acc), torch.zeros_like(logp))
    g_lp = torch.where(valid, d_logp * weight, torch.zeros_like(d_logp))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    return g_lp, d_h * weight, torch.stack([logp, entropy, loss, ratio, shaped, kl])


def lean_passes(hidden, weight, bias, labels, valid, inputs, hp, inv_t, tanh_scale, token_chunk, vocab_chunk,
                need=(True, True, True), filter_eps=None, counts=None, stats=None, block=None):
    """``((d_hidden, d_weight, d_bias), rows [6, N])`` of the one-pass loss in the order
    ``vocab_outer_lean`` (docs/head.md): neither an fp32 ``[V, D]`` nor an fp32 ``[N, D]`` tensor.

    1. token chunks outer, ``token_chunk`` rows each: :func:`stats_pass` of the chunk, vocabulary
       blocks inner (matmul 1; none when ``stats``, the two-phase path's entropy pass, are given);
       :func:`head_rows` of the chunk (``g_lp``, ``g_H``, its rows; ``inputs``: :class:`RowInputs`
       with ``[1, N]`` fields); :func:`gradient_pass` of the chunk for d_hidden only: the logits
       again (matmul 2), dlogits over them, ``dh += dz @ W_block`` (matmul 3) into the chunk's fp32
       ``[rows, D]`` block, written once in hidden's dtype;
    2. :func:`gradient_pass` over all tokens for d_W (and d_b) only: vocabulary blocks outer, the
       logits again (matmul 4), ``dW_block += dz.T @ h`` (matmul 5), each block written once in the
       weight's dtype. None of it for a frozen weight without a bias gradient (``need``).
    ``filter_eps`` skips tiles in both gradient sweeps; ``counts`` sums their tiles.
    """
    need_h, need_w, need_b = need
    need_b = need_b and bias is not None
    n_tokens = hidden.shape[0]
    f32 = dict(dtype=accumulate_dtype(hidden.dtype), device=hidden.device)
    lse, eu, target = stats if stats is not None else (torch.empty(n_tokens, **f32) for _ in range(3))
    g_lp, g_h, rows_out = torch.empty(n_tokens, **f32), torch.empty(n_tokens, **f32), torch.empty(6, n_tokens, **f32)
    d_hidden = torch.empty_like(hidden) if need_h else None
    for i0 in range(0, n_tokens, token_chunk):
        rows = slice(i0, i0 + token_chunk)
        h, y, ok = hidden[rows], labels[rows], valid[rows]
        if stats is None:
            lse[rows], eu[rows], target[rows] = stats_pass(h, weight, bias, y, ok, inv_t, tanh_scale, token_chunk,
                                                           vocab_chunk, block)
        logp = torch.where(ok, target[rows] - lse[rows], torch.zeros_like(lse[rows]))
        g_lp[rows], g_h[rows], rows_out[:, rows] = head_rows(logp, lse[rows] - eu[rows], ok, inputs.rows(0, rows), hp)
        if need_h:
            d_hidden[rows] = gradient_pass(h, weight, bias, y, ok, lse[rows], eu[rows], g_lp[rows], g_h[rows], inv_t,
                                           tanh_scale, token_chunk, vocab_chunk, need=(True, False, False),
                                           filter_eps=filter_eps, counts=counts, in_place=True, block=block)[0]
    d_weight = d_bias = None
    if need_w or need_b:
        _, d_weight, d_bias = gradient_pass(hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale,
                                            token_chunk, vocab_chunk, need=(False, need_w, need_b),
                                            filter_eps=filter_eps, counts=counts, in_place=True, block=block)
    return (d_hidden, d_weight, d_bias), rows_out


class FusedLinearAEPOVocabOuterFunction(torch.autograd.Function):
    """``(hidden [N, D], weight [V, D], bias [V] | None) -> (loss, rows [6, N])``, the weight
    gradient accumulated one vocabulary block at a time (docs/head.md).

    1. :func:`stats_pass`: ``lse``, ``Eu`` and the target's logit per token (logits matmul 1);
    2. :func:`head_rows`: log-prob, entropy, the AEPO head (shaped advantage, ratio, clip rule, KL,
       entropy bonus), ``g_lp``, ``g_H`` per token;
    3. :func:`gradient_pass`: vocabulary blocks outer, token chunks inner: the logits block again
       (matmul 2), its dlogits written over it, ``d_hidden += dz @ W_block`` (matmul 3, fp32
       ``[N, D]``), ``d_W_block += dz.T @ h`` (matmul 4, fp32 ``[vocab_chunk, D]``), each ``d_W``
       block written once in the weight's dtype.
    Both passes reuse one ``[token_chunk, vocab_chunk]`` buffer in the compute dtype.
    4 matmuls of 2 N D V flops (8 N D V; the token-outer :class:`FusedLinearAEPOLossFunction`:
    3, 6 N D V), no ``[V, D]`` fp32 accumulator and no ``[token_chunk, V]`` block. Same autograd
    contract as :class:`FusedLinearAEPOLossFunction` (gradients computed in forward, backward
    scales them); ``filter_eps``: :func:`gradient_pass`'s filtering (None: exact).

    ``backend``: ``"triton"`` runs step 3 as the Triton kernels of :mod:`aepo_kernels.triton_head`
    (same maths, same 4 matmuls; its ``[N, C]`` dlogits buffer in place of the block) where
    :func:`aepo_kernels.triton_head.supports` the call (fp32/bf16/fp16, no ``filter_eps``); any
    other value, or a call it does not support, runs :func:`gradient_pass`. The statistics pass
    is the torch one either way.

    ``lean``: the order ``vocab_outer_lean`` instead (:func:`lean_passes`: d_hidden from a
    token-outer pass of its own, no fp32 ``[N, D]`` accumulator; 5 matmuls), its passes torch
    whatever ``backend`` says.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inputs, config, inv_t, ignore_index, token_chunk, vocab_chunk,
                tanh_scale=None, filter_eps=None, counts=None, stats=None, backend="torch", lean=False):
        from .config import hyper_params

        with torch.autocast(hidden.device.type, enabled=False):
            flat = labels.reshape(-1)
            valid = contract.target_mask(flat, weight.shape[0], ignore_index)
            block = new_block(hidden, weight.shape[0], token_chunk, vocab_chunk)  # both passes' one logits block
            hp = hyper_params(config, inputs.ref_logprobs is not None, accumulate_dtype(hidden.dtype), hidden.device)
            need = ctx.needs_input_grad[:3]
            if lean:
                grads, rows_out = lean_passes(hidden, weight, bias, flat, valid, inputs, hp, inv_t, tanh_scale,
                                              token_chunk, vocab_chunk, need, filter_eps, counts, stats, block)
            else:
                if stats is None:  # else the two-phase path's entropy pass made them (the same stats_pass)
                    stats = stats_pass(hidden, weight, bias, flat, valid, inv_t, tanh_scale, token_chunk, vocab_chunk,
                                       block)
                lse, eu, target = stats
                logp = torch.where(valid, target - lse, torch.zeros_like(lse))
                g_lp, g_h, rows_out = head_rows(logp, lse - eu, valid, inputs.rows(0, slice(None)), hp)
                if backend == "triton" and _triton_head().supports(hidden, weight, filter_eps):
                    del block  # the kernels' dlogits buffer takes its place
                    head = _triton_head()
                    columns = head.head_vocab_columns(hidden.shape[0], weight.shape[0], hidden.shape[1],
                                                      hidden.element_size(), token_chunk, vocab_chunk)
                    grads = head.triton_gradient_pass(hidden, weight, bias, flat, valid, lse, eu, g_lp, g_h, inv_t,
                                                      tanh_scale, columns, need=need)
                else:
                    grads = gradient_pass(hidden, weight, bias, flat, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale,
                                          token_chunk, vocab_chunk, need=need, filter_eps=filter_eps, counts=counts,
                                          in_place=True, block=block)
        ctx.mark_non_differentiable(rows_out)
        ctx.save_for_backward(*grads)
        loss = (rows_out[2] * inputs.weight[0].to(rows_out.dtype)).sum()
        return loss, rows_out

    @staticmethod
    def backward(ctx, grad_loss, _grad_rows):
        from .one_pass import scale_gradient

        d_hidden, d_weight, d_bias = (scale_gradient(g, grad_loss) for g in ctx.saved_tensors)
        return (d_hidden, d_weight, d_bias) + (None,) * 13


def _triton_head():
    """:mod:`aepo_kernels.triton_head`, imported when first used (triton is optional on CPU)."""
    from . import triton_head

    return triton_head


class HeadCall(NamedTuple):
    """One call's head order and blocks (:func:`head_call`) and what its two-phase entropy pass
    leaves for the loss (``made["stats"]``: :func:`head_entropy`)."""

    order: str
    chunk_bytes: int | None
    token_chunk: int
    vocab_chunk: int | None
    made: dict


def head_call(head_backward: str | None, hidden, weight, chunk_bytes: int | None = None, token_chunk: int | None = None,
              vocab_chunk: int | None = None) -> HeadCall:
    """The order (:func:`resolve_head_backward`) and blocks of the head of ``hidden [N, D]`` and
    ``weight [V, D]``, as the flat and the tree loss call :func:`fused_linear_aepo_loss`:
    token_outer, ``[token_chunk, V]`` blocks of :func:`chunk_bytes_for` ``chunk_bytes``; the
    vocabulary-outer orders, :func:`head_chunks`."""
    order = resolve_head_backward(head_backward, hidden, weight)
    if order == "token_outer":
        chunk_bytes = chunk_bytes_for(hidden.device, chunk_bytes)
        rows = token_chunk or token_chunk_for_budget(weight.shape[0], chunk_bytes, hidden.element_size())
        return HeadCall(order, chunk_bytes, rows, vocab_chunk, {})
    rows, columns = head_chunks(order, hidden.shape[0], weight.shape[0], hidden.shape[-1], chunk_bytes, token_chunk,
                                vocab_chunk)
    return HeadCall(order, chunk_bytes, rows, columns, {})


def head_entropy(head: HeadCall, hidden, weight, bias, labels, ignore_index: int, temperature: float,
                 logit_scale: float, softcap: float | None) -> torch.Tensor:
    """``[N]`` entropies of the head call's logits (``hidden [N, D]``, ``labels [N]``), no
    gradient: the two-phase path's entropy pass. token_outer: :func:`fused_linear_logprob_entropy`
    (one more logits matmul); the vocabulary-outer orders: :func:`stats_pass` in the call's blocks,
    its ``(lse, Eu, target)`` kept in ``head.made["stats"]`` for the loss, whose statistics pass
    it then is (no matmul added)."""
    detached = (hidden.detach(), weight.detach(), None if bias is None else bias.detach())
    if head.order == "token_outer":
        return fused_linear_logprob_entropy(
            detached[0], detached[1], labels, temperature, bias=detached[2], shift_labels=False,
            ignore_index=ignore_index, vocab_chunk=head.vocab_chunk, chunk_bytes=head.chunk_bytes,
            logit_scale=logit_scale, softcap=softcap)[1]
    inv_t, tanh_scale = logit_map(temperature, logit_scale, softcap)
    flat = labels.reshape(-1).long()
    valid = contract.target_mask(flat, weight.shape[0], ignore_index)
    with torch.autocast(hidden.device.type, enabled=False):
        head.made["stats"] = stats_pass(*detached, flat, valid, inv_t, tanh_scale, head.token_chunk, head.vocab_chunk)
    lse, eu, _ = head.made["stats"]
    return lse - eu


def fused_linear_aepo_loss(hidden, weight, bias, labels, inputs, config, inv_t, ignore_index, backend, tanh_scale, *,
                           head_backward: str | None = None, chunk_bytes: int | None = None,
                           token_chunk: int | None = None, vocab_chunk: int | None = None,
                           filter_eps: float | None = None, counts: dict | None = None, stats=None,
                           head_kernel: str = "torch"):
    """``(loss, rows [6, N])`` of the one-pass AEPO loss from ``hidden [N, D]`` and ``weight
    [V, D]`` in the order ``head_backward`` names (None: :func:`default_head_backward`):
    ``"token_outer"``: :class:`FusedLinearAEPOLossFunction` (``[token_chunk, V]`` blocks from
    ``chunk_bytes``; ``backend`` picks the row op); ``"vocab_outer"``:
    :class:`FusedLinearAEPOVocabOuterFunction` (``[token_chunk, vocab_chunk]`` blocks,
    :func:`vocab_outer_chunks` with ``chunk_bytes`` as the fp32 block's budget, else
    :data:`VOCAB_OUTER_BLOCK_BYTES`; ``filter_eps`` and ``stats`` -- a :func:`stats_pass` result
    already made by the caller's entropy pass -- only here; ``head_kernel`` ``"triton"`` runs its
    gradient pass as the Triton kernels of :mod:`aepo_kernels.triton_head`, ``"torch"`` as
    :func:`gradient_pass`); ``"vocab_outer_lean"``: the same class's lean passes
    (:func:`lean_passes`, blocks of :func:`lean_chunks` with ``chunk_bytes`` as the workspace budget,
    else :data:`HEAD_WORKSPACE_BYTES`; ``filter_eps`` and ``stats`` too, torch passes only).
    Blocks: :func:`head_call`. ``labels``: ``[1, N]`` long, ``inputs``: :class:`RowInputs` with
    ``[1, N]`` fields."""
    head = head_call(head_backward, hidden, weight, chunk_bytes, token_chunk, vocab_chunk)
    if head.order == "token_outer":
        if filter_eps is not None:
            raise ValueError("filter_eps (gradient filtering) needs head_backward='vocab_outer' or 'vocab_outer_lean'")
        return FusedLinearAEPOLossFunction.apply(hidden, weight, bias, labels, inputs, config, inv_t, ignore_index,
                                                 backend, head.token_chunk, tanh_scale)
    if filter_eps is not None and not filter_eps > 0:
        raise ValueError(f"filter_eps={filter_eps}: must be > 0 (or None: no filtering)")
    return FusedLinearAEPOVocabOuterFunction.apply(hidden, weight, bias, labels, inputs, config, inv_t, ignore_index,
                                                   head.token_chunk, head.vocab_chunk, tanh_scale, filter_eps, counts,
                                                   stats, head_kernel, head.order == "vocab_outer_lean")
