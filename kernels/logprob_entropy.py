"""Per-token log-probabilities and entropies from logits, in one pass, with a recomputing backward.

Maths (AEPO_SPEC.md §0), per row t with u = z / T and p = softmax(u):
    lse  = log sum_v exp(u_v)              Eu = sum_v p_v u_v
    logp = u_y - lse                        H  = lse - Eu
    dL/dz = ( g_lp (onehot(y) - p) + g_H p (Eu - u) ) / T
Forward reads the logits once and keeps four fp32 numbers per row (logp, H, lse, Eu); backward
reads them a second time, recomputes p from (lse, Eu) and writes dlogits — into a new buffer, or,
with ``inplace_backward=True``, into the logits buffer itself (no second ``[N, V]`` tensor).

Backends behind one contract (``backend=``):
- ``"triton"``: the kernels in :mod:`aepo_kernels.triton_kernels` (GPU; CPU tensors under
  ``TRITON_INTERPRET=1`` for tests).
- ``"torch"``: the fast CPU path below, chunked over rows so the fp32 working set of a chunk stays
  in cache and no full ``[N, V]`` fp32 temporary is ever made.
- ``"reference"``: :func:`aepo_kernels.reference.logprob_entropy_reference` (full fp32 autograd).
- ``"auto"``: triton for CUDA tensors when triton imports, else torch.

Shapes: logits ``[N, V]`` or ``[B, T, V]`` with unit stride on V and any stride on the other dims
(``logits[:, :-1]`` is not copied); labels ``[N]`` / ``[B, T]``. Not supported: rows whose logits
are all ``-inf`` (their lse is undefined).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
from torch.autograd.graph import increment_version

from .reference import logprob_entropy_reference

BACKENDS = ("auto", "triton", "torch", "reference")

# Rows per CPU chunk are chosen so that one fp32 chunk holds about this many elements (8 MiB):
# two such buffers stay in the L3 cache of a server CPU (bench/bench_logprob_entropy.py).
_CPU_CHUNK_ELEMS = int(os.environ.get("AEPO_CPU_CHUNK_ELEMS", 1 << 21))


# ---------------------------------------------------------------------------------------------
# The fast CPU path: row chunks, fp32 math, in-place work on chunk-local buffers.


def block_stats(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax statistics of a block ``u: [R, C]`` fp32, consumed (overwritten) in place.

    Returns ``(m, s, t)`` with m = max u, s = sum e^(u-m), t = sum e^(u-m) (u-m), each ``[R]``;
    then lse = m + log s and Eu = m + t / s. :func:`merge_stats` combines blocks of one row.
    """
    m = u.amax(-1, keepdim=True)
    u.sub_(m)
    e = u.exp()
    s = e.sum(-1)
    return m.squeeze(-1), s, e.mul_(u).sum(-1)


def merge_stats(a, b):
    """Online-softmax merge of two ``(m, s, t)`` triples of the same rows (see block_stats)."""
    (m_a, s_a, t_a), (m_b, s_b, t_b) = a, b
    m = torch.maximum(m_a, m_b)
    # where() guards the -inf starting value: its s is 0, so its shifted terms must vanish.
    shift_a = torch.where(s_a > 0, m_a - m, torch.zeros_like(m))
    scale_a, scale_b = (m_a - m).exp(), (m_b - m).exp()
    t = scale_a * (t_a + s_a * shift_a) + scale_b * (t_b + s_b * (m_b - m))
    return m, s_a * scale_a + s_b * scale_b, t


def finish_stats(m, s, t) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, Eu)`` from merged ``(m, s, t)``."""
    return m + s.log(), m + t / s


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for fp32/bf16/fp16 inputs; fp64 inputs stay fp64 (for float64 gradchecks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_forward(z: torch.Tensor, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """lse and Eu of ``u = z * inv_t`` for a chunk ``z: [R, V]``; both ``[R]`` fp32 (fp64 for fp64)."""
    u = z.to(accumulate_dtype(z.dtype)) * inv_t  # the chunk's only [R, V] buffers: u and e
    return finish_stats(*block_stats(u))


def _chunk_backward(
    z: torch.Tensor, lse: torch.Tensor, eu: torch.Tensor, g_lp: torch.Tensor, g_h: torch.Tensor, inv_t: float
) -> torch.Tensor:
    """``(g_H p (Eu - u) - g_lp p) / T`` for a chunk ``z: [R, V]``; the one-hot term is added by the caller."""
    u = z.to(accumulate_dtype(z.dtype)) * inv_t
    p = (u - lse.unsqueeze(-1)).exp_()
    # u <- (Eu - u) * g_H - g_lp, then times p and 1/T, all in place.
    u.neg_().add_(eu.unsqueeze(-1)).mul_(g_h.unsqueeze(-1)).sub_(g_lp.unsqueeze(-1))
    return u.mul_(p).mul_(inv_t)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CPU_CHUNK_ELEMS // vocab)


def torch_forward(logits: torch.Tensor, labels: torch.Tensor, inv_t: float, ignore_index: int):
    """Returns ``(logp, H, lse, Eu)``, each ``[B, T]`` fp32 (fp64 for fp64 logits), for ``logits: [B, T, V]``."""
    batch, seq, vocab = logits.shape
    lse = torch.empty(batch, seq, dtype=accumulate_dtype(logits.dtype), device=logits.device)
    eu = torch.empty_like(lse)
    rows = _rows_per_chunk(vocab)
    for b in range(batch):
        for t0 in range(0, seq, rows):
            lse[b, t0 : t0 + rows], eu[b, t0 : t0 + rows] = _chunk_forward(logits[b, t0 : t0 + rows], inv_t)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(lse.dtype) * inv_t
    logp = torch.where(valid, target - lse, torch.zeros_like(lse))
    return logp, lse - eu, lse, eu


def torch_backward(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out):
    """Writes dlogits ``[B, T, V]`` into ``out`` (which may be ``logits`` itself)."""
    batch, seq, vocab = logits.shape
    rows = _rows_per_chunk(vocab)
    for b in range(batch):
        for t0 in range(0, seq, rows):
            sl = slice(t0, t0 + rows)
            out[b, sl] = _chunk_backward(logits[b, sl], lse[b, sl], eu[b, sl], g_lp[b, sl], g_h[b, sl], inv_t)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    onehot_term = torch.where(valid, g_lp * inv_t, torch.zeros_like(g_lp)).unsqueeze(-1)
    # out[b, t, y] += g_lp / T (rounded to out's dtype once, like every other entry).
    current = out.gather(-1, safe.unsqueeze(-1)).to(g_lp.dtype)
    out.scatter_(-1, safe.unsqueeze(-1), (current + onehot_term).to(out.dtype))
    return out


# ---------------------------------------------------------------------------------------------
# Backend table and the autograd Function shared by the torch and triton paths.


def _triton_impl() -> tuple[Callable, Callable]:
    from . import triton_kernels  # imported lazily: triton is optional on CPU-only installs

    return triton_kernels.triton_forward, triton_kernels.triton_backward


def _resolve_backend(backend: str, logits: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    if logits.is_cuda:
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def _impl(backend: str) -> tuple[Callable, Callable]:
    return _triton_impl() if backend == "triton" else (torch_forward, torch_backward)


class LogprobEntropyFunction(torch.autograd.Function):
    """autograd for ``logits [B, T, V] -> (logp [B, T], entropy [B, T])``; see module docstring."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, backend: str, inplace_backward: bool, ignore_index: int):
        forward_impl, _ = _impl(backend)
        inv_t = 1.0 / temperature
        logp, entropy, lse, eu = forward_impl(logits, labels, inv_t, ignore_index)
        ctx.save_for_backward(logits, labels, lse, eu)
        ctx.config = (inv_t, backend, inplace_backward, ignore_index)
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        logits, labels, lse, eu = ctx.saved_tensors
        inv_t, backend, inplace, ignore_index = ctx.config
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_lp = g_lp.masked_fill(labels == ignore_index, 0.0)  # logp is the constant 0 there
        g_h = torch.zeros_like(lse) if g_h is None else g_h.to(lse.dtype)
        if inplace:
            out = logits  # safe: saved_tensors above already checked the version counter
        else:
            out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        _, backward_impl = _impl(backend)
        backward_impl(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out)
        if inplace:
            # Anything else that saved these logits now fails loudly instead of reading gradients.
            increment_version(logits)
        return out, None, None, None, None, None


def _as_3d(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() == 2:
        logits, labels = logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.dim() != 3 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)} must be [N, V] or [B, T, V] with labels {tuple(labels.shape)} = its leading dims")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the vocab dim must be dense; other strides are kept
    return logits, labels.long()


def logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    inplace_backward: bool = False,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy of ``softmax(logits / temperature)``, per token.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, fp32/bf16/fp16, unit stride on V.
        labels: ``[N]`` or ``[B, T]`` token ids; ``ignore_index`` gives log-prob 0 and no gradient.
        temperature: sampling temperature T > 0 (a runtime value: no recompilation).
        backend: ``"auto" | "triton" | "torch" | "reference"``.
        inplace_backward: write dlogits into the logits buffer during backward (saves one
            ``[N, V]`` tensor). Afterwards ``logits`` holds its gradient; any other autograd use
            of these logits then raises a version-counter error instead of reading wrong values.
        ignore_index: label value marking positions without a target.

    Returns:
        ``(logprobs, entropy)``: fp32, shaped like ``labels``, both differentiable.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    backend = _resolve_backend(backend, logits)
    if backend == "reference":
        return logprob_entropy_reference(logits, labels, temperature, ignore_index)
    out_shape = labels.shape
    logits3, labels3 = _as_3d(logits, labels)
    logp, entropy = LogprobEntropyFunction.apply(logits3, labels3, float(temperature), backend, inplace_backward, ignore_index)
    return logp.reshape(out_shape), entropy.reshape(out_shape)
