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

import torch

from . import contract
from .logits_ops import (
    accumulate_dtype, fast_chunk_grad, fast_chunk_stats, finish_stats, logit_map, map_logits, merge_stats, shift_labels_left,
    shift_to_labels,
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


def _logits_block(hidden_chunk, weight_block, bias_block):
    """``[tc, D] x [vc, D] -> [tc, vc]`` in the operands' (compute) dtype, the bias added inside
    the GEMM (one rounding, as ``nn.Linear`` computes it)."""
    if bias_block is None:
        return hidden_chunk @ weight_block.T
    return torch.addmm(bias_block, hidden_chunk, weight_block.T)


class FusedLinearLogprobEntropyFunction(torch.autograd.Function):
    """autograd for ``(hidden [N, D], weight [V, D], bias [V] | None) -> (logp [N], H [N])``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_t, tanh_scale, ignore_index, token_chunk, vocab_chunk):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        dtype = hidden.dtype  # the compute dtype of every matmul
        f32 = dict(dtype=accumulate_dtype(hidden.dtype), device=hidden.device)
        stats = (torch.full((n_tokens,), float("-inf"), **f32), torch.zeros(n_tokens, **f32), torch.zeros(n_tokens, **f32))
        target = torch.zeros(n_tokens, **f32)
        valid = contract.target_mask(labels, vocab, ignore_index)
        for v0 in range(0, vocab, vocab_chunk):
            w, b = _weight_block(weight, bias, v0, vocab_chunk, dtype)  # [vc, D], [vc] in the compute dtype
            in_block = valid & (labels >= v0) & (labels < v0 + w.shape[0])
            for i0 in range(0, n_tokens, token_chunk):
                rows = slice(i0, i0 + token_chunk)
                z = _logits_block(hidden[rows], w, b)  # [tc, vc]
                hit = in_block[rows]
                local = torch.where(hit, labels[rows] - v0, torch.zeros_like(labels[rows]))
                z_target = map_logits(z.gather(-1, local.unsqueeze(-1)).squeeze(-1), inv_t, tanh_scale).to(target.dtype)
                target[rows] += torch.where(hit, z_target, 0.0)
                merged = merge_stats(tuple(x[rows] for x in stats), fast_chunk_stats(z, inv_t, tanh_scale))
                for acc, value in zip(stats, merged):
                    acc[rows] = value
        lse, eu = finish_stats(*stats)
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
        acc = dict(dtype=lse.dtype, device=hidden.device)
        dtype, vocab = hidden.dtype, weight.shape[0]
        d_hidden = torch.zeros(hidden.shape, **acc)
        d_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        d_bias = torch.empty_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        for v0 in range(0, vocab, vocab_chunk):
            w, b = _weight_block(weight, bias, v0, vocab_chunk, dtype)
            in_block = valid & (labels >= v0) & (labels < v0 + w.shape[0])
            d_w = torch.zeros(w.shape, **acc)
            d_b = torch.zeros(w.shape[0], **acc)
            for i0 in range(0, hidden.shape[0], token_chunk):
                rows = slice(i0, i0 + token_chunk)
                h = hidden[rows]
                z = _logits_block(h, w, b)
                local = torch.where(in_block[rows], labels[rows] - v0, torch.full_like(labels[rows], -1))
                dz = fast_chunk_grad(z, local, lse[rows], eu[rows], g_lp[rows], g_h[rows], inv_t, tanh_scale)  # [tc, vc] fp32
                dz_mm = dz.to(dtype)
                addmm_accumulate(d_hidden[rows], dz_mm, w)  # [tc, D]
                addmm_accumulate(d_w, dz_mm.T, h)  # [vc, D]
                d_b += dz.sum(0)
            if d_weight is not None:
                d_weight[v0 : v0 + vocab_chunk] = d_w.to(weight.dtype)
            if d_bias is not None:
                d_bias[v0 : v0 + vocab_chunk] = d_b.to(bias.dtype)
        return d_hidden.to(hidden.dtype), d_weight, d_bias, None, None, None, None, None, None


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
