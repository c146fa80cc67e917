"""Per-token log-probabilities and entropies from logits, in one pass, with a recomputing backward.

Maths (docs/algorithm.md §0), per row t with u = z / T and p = softmax(u):
    lse  = log sum_v exp(u_v)              Eu = sum_v p_v u_v
    logp = u_y - lse                        H  = lse - Eu
    dL/dz = ( g_lp (onehot(y) - p) + g_H p (Eu - u) ) du/dz,     du/dz = 1 / T
With a logit scale s and a soft cap c (:func:`logit_map`) the model's logits are
``c tanh(s z / c)`` and u = c tanh(s z / c) / T, so du/dz = (s / T)(1 - tanh^2(s z / c)); without a
cap the scale folds into the temperature (u = z s / T): no extra work.
Forward reads the logits once and keeps four fp32 numbers per row (logp, H, lse, Eu); backward
reads them a second time, recomputes p from (lse, Eu) and writes dlogits — into a new buffer, or,
with ``inplace_backward=True``, into the logits buffer itself (no second ``[N, V]`` tensor).

Backends behind one contract (``backend=``):
- ``"triton"``: the kernels in :mod:`aepo_kernels.triton_kernels` (GPU; CPU tensors under
  ``TRITON_INTERPRET=1`` for tests).
- ``"torch"``: the fast CPU path below: compiled chunk functions over row chunks (whole sequences,
  :func:`cpu_chunk_elems`); no ``[N, V]`` fp32 temporary is ever made.
- ``"reference"``: :func:`aepo_kernels.reference.logprob_entropy_reference` (full fp32 autograd).
- ``"auto"``: triton for CUDA tensors when triton imports, else torch.

Shapes: logits ``[N, V]`` or ``[B, T, V]`` with unit stride on V and any stride on the other dims
(``logits[:, :-1]`` is not copied); labels ``[N]`` / ``[B, T]``.

``-inf`` logits (a masked or padded vocabulary) are supported on every backend, anywhere in a row:
such a token has probability 0 and gradient 0, and the entropy is that of the finite support (a
label on such a token has log-prob -inf). Not supported: rows whose logits are all ``-inf``
(their lse is undefined: NaN).
"""
from __future__ import annotations

import math
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.graph import increment_version

from . import contract
from .compile import compile_enabled, compiled
from .reference import logprob_entropy_reference

BACKENDS = ("auto", "triton", "torch", "reference")

# Elements per CPU row chunk when the chunk functions run in eager torch: each eager op makes
# [R, V] temporaries, so about this many elements (16 MiB of fp32) per chunk keeps them small.
_EAGER_CHUNK_ELEMS = 1 << 22


# ---------------------------------------------------------------------------------------------
# The fast CPU path: row chunks through two small functions that torch.compile (inductor) turns
# into fused C++ loops; every [R, V] temporary is chunk-sized. Measured against eager chunked
# code and against (compiled) naive code in bench/bench_logprob_entropy.py.


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for fp32/bf16/fp16 inputs; fp64 inputs stay fp64 (for float64 gradchecks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def logit_map(temperature: float, logit_scale: float = 1.0, softcap: float | None = None) -> tuple[float, float | None]:
    """``(inv_t, tanh_scale)`` of the map from raw logits z to the softmax input u:
    ``u = z * inv_t`` (no cap; inv_t = logit_scale / T) or ``u = tanh(z * tanh_scale) * inv_t``
    (soft cap c: tanh_scale = logit_scale / c, inv_t = c / T), i.e. u = c tanh(s z / c) / T.

    The order is that of the models: scale first (Cohere's ``logit_scale``; Granite divides by
    ``logits_scaling``, so pass its inverse), then the soft cap (Gemma-2's
    ``final_logit_softcapping``), then the temperature. Raises ValueError on a value that is not
    a positive finite number.
    """
    for name, value in (("temperature", temperature), ("logit_scale", logit_scale), ("softcap", softcap)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value}: must be a positive finite number"
                             + (" (None turns the soft cap off)" if name == "softcap" else ""))
    if softcap is None:
        return float(logit_scale) / temperature, None
    return float(softcap) / temperature, float(logit_scale) / softcap


def map_logits(z: torch.Tensor, inv_t: float, tanh_scale: float | None = None) -> torch.Tensor:
    """The softmax input ``u`` of raw logits ``z`` (any shape) in the math dtype; see :func:`logit_map`."""
    x = z.to(accumulate_dtype(z.dtype))
    if tanh_scale is not None:
        x = torch.tanh(x * tanh_scale)
    return x * inv_t


def chunk_stats(z: torch.Tensor, inv_t: float, tanh_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax statistics of ``u = map_logits(z, inv_t, tanh_scale)`` for a block ``z: [R, C]``.

    Returns ``(m, s, t)``, each ``[R]``: m = max u, s = sum e^(u-m), t = sum e^(u-m) (u-m);
    lse = m + log s and Eu = m + t / s (:func:`finish_stats`); :func:`merge_stats` combines
    blocks of the same rows.
    """
    u = map_logits(z, inv_t, tanh_scale)
    m = u.amax(-1, keepdim=True)
    d = u - _finite_or_zero(m)  # a block of only -inf: m = -inf, s = t = 0 (merge_stats takes it)
    e = d.exp()
    return m.squeeze(-1), e.sum(-1), _e_times_d(e, d).sum(-1)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """The running max as a shift reference: 0 where it is still -inf (nothing finite seen), since
    -inf - -inf is NaN; the terms it scales are 0 there anyway."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def _e_times_d(e: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``e * d`` with 0 where e is 0: a -inf logit has e = 0 and d = -inf (0 * -inf is NaN)."""
    return e * torch.where(e > 0, d, torch.zeros_like(d))


def merge_stats(a, b):
    """Online-softmax merge of two ``(m, s, t)`` triples of the same rows (see chunk_stats)."""
    (m_a, s_a, t_a), (m_b, s_b, t_b) = a, b
    m = torch.maximum(m_a, m_b)
    ref = _finite_or_zero(m)
    # where() guards the -inf starting value and blocks of only -inf: their s is 0, so their
    # shifted terms must vanish (not 0 * -inf).
    shift_a = torch.where(s_a > 0, m_a - ref, torch.zeros_like(m))
    shift_b = torch.where(s_b > 0, m_b - ref, torch.zeros_like(m))
    scale_a, scale_b = (m_a - ref).exp(), (m_b - ref).exp()
    t = scale_a * (t_a + s_a * shift_a) + scale_b * (t_b + s_b * shift_b)
    return m, s_a * scale_a + s_b * scale_b, t


def finish_stats(m, s, t) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, Eu)`` from merged ``(m, s, t)``."""
    return m + s.log(), m + t / s


def chunk_grad(z, local_labels, lse, eu, g_lp, g_h, inv_t: float, tanh_scale: float | None = None) -> torch.Tensor:
    """dL/dz for a block ``z: [R, C]``: ``(g_lp (onehot - p) + g_H p (Eu - u)) du/dz``.

    ``local_labels: [R]`` is the target's column inside this block, or -1 when it lies outside
    (or the row has no target). Returns the fp32 (fp64 for fp64) block.
    """
    x = z.to(accumulate_dtype(z.dtype))
    if tanh_scale is None:
        u, du_dz = x * inv_t, inv_t
    else:  # soft cap: d/dz tanh(a z) = a (1 - tanh^2(a z))
        th = torch.tanh(x * tanh_scale)
        u, du_dz = th * inv_t, (1 - th * th) * (tanh_scale * inv_t)
    p = (u - lse.unsqueeze(-1)).exp()
    g_lp, g_h, eu = g_lp.unsqueeze(-1), g_h.unsqueeze(-1), eu.unsqueeze(-1)
    u = torch.where(p > 0, u, eu)  # u = -inf has p = 0: gradient 0, not 0 * inf
    grad = p * (g_h * (eu - u) - g_lp)
    hit = torch.arange(z.shape[-1], device=z.device) == local_labels.unsqueeze(-1)
    return torch.where(hit, grad + g_lp, grad) * du_dz


def chunk_grad_into(z, local_labels, lse, eu, g_lp, g_h, inv_t: float, out: torch.Tensor,
                    tanh_scale: float | None = None) -> None:
    """:func:`chunk_grad` written straight into ``out`` (its dtype), which must not overlap ``z``:
    compiled, the store is fused into the same loop, with no chunk-sized temporary."""
    out.copy_(chunk_grad(z, local_labels, lse, eu, g_lp, g_h, inv_t, tanh_scale))


def chunk_grad_inplace(z, local_labels, lse, eu, g_lp, g_h, inv_t: float, tanh_scale: float | None = None) -> None:
    """:func:`chunk_grad` written over ``z`` itself. A separate function because a compiled
    graph that receives two different views of one buffer as ``z`` and ``out`` is not safe."""
    z.copy_(chunk_grad(z, local_labels, lse, eu, g_lp, g_h, inv_t, tanh_scale))


fast_chunk_stats = compiled(chunk_stats)
fast_chunk_grad = compiled(chunk_grad)
fast_chunk_grad_into = compiled(chunk_grad_into)
fast_chunk_grad_inplace = compiled(chunk_grad_inplace)


def cpu_chunk_elems() -> int | None:
    """Elements per CPU row chunk; None: one chunk per sequence.

    Compiled (the default), a chunk is a whole sequence: inductor's kernels make no ``[R, V]``
    temporary (the stats kernel keeps one V-sized row buffer per thread; the gradient is stored in
    the loop that computes it), so a chunk costs per-row vectors only, whatever R. Fewer, longer
    calls measured 1.9-2.3x faster than the former 16 MiB chunks for the two-stage sweeps at
    ``[1024 | 4096, 151936]`` on the loaded 2-core VM (bench/bench_aepo_loss.py --level logits,
    ``two_stage_inplace`` vs ``two_stage_inplace@16MiB``): each compiled call pays its
    Python/guard cost and two OpenMP regions whose barriers stall whenever another process holds
    one of the cores.
    Eager (``AEPO_TORCH_COMPILE=0``): :data:`_EAGER_CHUNK_ELEMS`. ``AEPO_CPU_CHUNK_ELEMS`` sets
    the chunk for both (tests of chunk boundaries, experiments).
    """
    override = os.environ.get("AEPO_CPU_CHUNK_ELEMS")
    if override is not None:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"AEPO_CPU_CHUNK_ELEMS={override!r}: must be a positive number of elements")
        return int(override)
    return None if compile_enabled() else _EAGER_CHUNK_ELEMS


def _row_chunks(logits: torch.Tensor):
    """Yields ``(b, slice)`` over ``[B, T, V]`` rows, in chunks of :func:`cpu_chunk_elems`."""
    batch, seq, vocab = logits.shape
    elems = cpu_chunk_elems()
    rows = seq if elems is None else max(1, elems // vocab)
    for b in range(batch):
        for t0 in range(0, seq, rows):
            yield b, slice(t0, t0 + rows)


def torch_forward(logits: torch.Tensor, labels: torch.Tensor, inv_t: float, ignore_index: int,
                  tanh_scale: float | None = None):
    """Returns ``(logp, H, lse, Eu)``, each ``[B, T]`` fp32 (fp64 for fp64 logits), for ``logits: [B, T, V]``."""
    lse = torch.empty(logits.shape[:2], dtype=accumulate_dtype(logits.dtype), device=logits.device)
    eu = torch.empty_like(lse)
    for b, rows in _row_chunks(logits):
        lse[b, rows], eu[b, rows] = finish_stats(*fast_chunk_stats(logits[b, rows], inv_t, tanh_scale))
    valid = contract.target_mask(labels, logits.shape[-1], ignore_index)  # else no target: log-prob 0
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = map_logits(logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1), inv_t, tanh_scale).to(lse.dtype)
    logp = torch.where(valid, target - lse, torch.zeros_like(lse))
    return logp, lse - eu, lse, eu


def torch_backward(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out, tanh_scale=None):
    """Writes dlogits ``[B, T, V]`` into ``out`` (which may be ``logits`` itself)."""
    valid = contract.target_mask(labels, logits.shape[-1], ignore_index)
    local = torch.where(valid, labels, torch.full_like(labels, -1))
    for b, rows in _row_chunks(logits):
        args = (logits[b, rows], local[b, rows], lse[b, rows], eu[b, rows], g_lp[b, rows], g_h[b, rows], inv_t)
        if out is logits:
            fast_chunk_grad_inplace(*args, tanh_scale)
        else:
            fast_chunk_grad_into(*args, out[b, rows], tanh_scale)
    return out


# ---------------------------------------------------------------------------------------------
# Backend table and the autograd Function shared by the torch and triton paths.


def _triton_impl() -> tuple[Callable, Callable]:
    from . import triton_kernels  # imported lazily: triton is optional on CPU-only installs

    return triton_kernels.triton_forward, triton_kernels.triton_backward


def resolve_backend(backend: str, logits: torch.Tensor) -> str:
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
    def forward(ctx, logits, labels, inv_t: float, tanh_scale: float | None, backend: str, inplace_backward: bool,
                ignore_index: int):
        forward_impl, _ = _impl(backend)
        logp, entropy, lse, eu = forward_impl(logits, labels, inv_t, ignore_index, tanh_scale)
        ctx.save_for_backward(logits, labels, lse, eu)
        ctx.config = (inv_t, tanh_scale, backend, inplace_backward, ignore_index)
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        logits, labels, lse, eu = ctx.saved_tensors
        inv_t, tanh_scale, backend, inplace, ignore_index = ctx.config
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        # logp is the constant 0 where there is no target (ignore_index, or a label outside [0, V))
        g_lp = g_lp.masked_fill(~contract.target_mask(labels, logits.shape[-1], ignore_index), 0.0)
        g_h = torch.zeros_like(lse) if g_h is None else g_h.to(lse.dtype)
        if inplace:
            out = logits  # safe: saved_tensors above already checked the version counter
        else:
            out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        _, backward_impl = _impl(backend)
        backward_impl(logits, labels, lse, eu, g_lp, g_h, inv_t, ignore_index, out, tanh_scale)
        if inplace:
            # Anything else that saved these logits now fails loudly instead of reading gradients.
            increment_version(logits)
        return out, None, None, None, None, None, None


def shift_labels_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``shift_labels=True``: input_ids-aligned ``labels [..., T]`` -> the target of each logits
    row (row t predicts token t+1; the last row has none: ``ignore_index``). ``[..., T]``-sized."""
    if labels.shape[-1] < 2:
        raise ValueError(f"shift_labels=True needs at least 2 tokens per sequence, labels are {tuple(labels.shape)}")
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def shift_to_labels(t: torch.Tensor) -> torch.Tensor:
    """A per-logits-row output back to the input_ids alignment of the labels (token 0, which no
    row predicts, gets 0)."""
    return F.pad(t[..., :-1], (1, 0))


def as_3d(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (:func:`aepo_kernels.contract.check_logits`) ``[N, V]``/``[B, T, V]`` logits and
    their labels as ``[B, T, V]`` (``[1, N, V]``) with a dense vocab dim, and int64 labels."""
    if logits.dim() == 2:
        logits, labels = logits.unsqueeze(0), labels.unsqueeze(0)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the vocab dim must be dense; other strides are kept
    return logits, labels.long()


def logprob_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    shift_labels: bool | None = None,
    backend: str = "auto",
    inplace_backward: bool = False,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``labels`` and entropy of ``softmax(logits / temperature)``, per token.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, fp32/bf16/fp16 (fp64 on the torch and reference
            backends), unit stride on V.
        labels: ``[N]`` or ``[B, T]`` integer token ids in ``[0, V)``, or ``ignore_index`` (log-prob
            0, no gradient). Other values are refused (:mod:`aepo_kernels.contract`).
        temperature: sampling temperature T > 0 (a runtime value: no recompilation).
        shift_labels: required, no default. True: ``labels`` are input_ids-aligned and logits row
            t predicts ``labels[t+1]`` (HF convention); the outputs are aligned with ``labels``
            (token 0: log-prob and entropy 0); no logits copy. False: row t predicts ``labels[t]``.
        backend: ``"auto" | "triton" | "torch" | "reference"``.
        inplace_backward: write dlogits into the logits buffer during backward (saves one
            ``[N, V]`` tensor). Afterwards ``logits`` holds its gradient; any other autograd use
            of these logits then raises a version-counter error instead of reading wrong values.
        ignore_index: label value marking positions without a target.
        logit_scale, softcap: the softmax is that of ``softcap * tanh(logit_scale * logits / softcap)
            / temperature`` (:func:`logit_map`). Only for raw logits: a model whose forward already
            applies its scale/soft cap (HF Gemma-2, Cohere) returns logits that need neither.

    Returns:
        ``(logprobs, entropy)``: fp32, shaped like ``labels``, both differentiable.
    """
    shift = contract.alignment("logprob_entropy", shift_labels)
    contract.check_logits("logprob_entropy", logits, labels)
    contract.enforce("logprob_entropy", [contract.label_rule(labels, logits.shape[-1], ignore_index)])
    inv_t, tanh_scale = logit_map(temperature, logit_scale, softcap)
    backend = resolve_backend(backend, logits)
    targets = shift_labels_left(labels, ignore_index) if shift else labels
    if backend == "reference":
        logp, entropy = logprob_entropy_reference(logits, targets, temperature, ignore_index, logit_scale, softcap)
    else:
        logits3, labels3 = as_3d(logits, targets)
        logp, entropy = LogprobEntropyFunction.apply(logits3, labels3, inv_t, tanh_scale, backend, inplace_backward,
                                                     ignore_index)
        logp, entropy = logp.reshape(labels.shape), entropy.reshape(labels.shape)
    return (shift_to_labels(logp), shift_to_labels(entropy)) if shift else (logp, entropy)
