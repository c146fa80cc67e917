"""Attention kernels the policy adds to transformers' attention interface (``AttentionInterface``).

``policy.attn_implementation = "varlen"``: packed micro-batches (HF's padding-free format: the
rows of a micro-batch concatenated into one, position ids restarting at 0 at each row) through
``torch.nn.attention.varlen.varlen_attn``, FlashAttention's variable-length kernel shipped inside
torch, on CUDA in bf16/fp16: a GPU run needs no flash-attn build. Everywhere else (CPU, fp32, a
torch without it) the same attention runs per packed row with SDPA's causal kernel: the
block-diagonal causal mask of the packed row, without materialising it.

The kernel is registered under :data:`VARLEN` by :func:`register_attention` (the model loaders
call :func:`hf_attn_implementation` before building a model). transformers makes no mask for a
name it does not know (``masking_utils._preprocess_mask_arguments``), so the rows come from the
position ids each layer passes on: a row starts at every position id 0 and at every batch row.
``varlen_attn``'s signature changed between torch releases (2.10: ``is_causal``; 2.11:
``window_size``; 2.12: ``enable_gqa``): :func:`_varlen_kwargs` reads it, so the torch of a bare GPU
machine (2.11) runs it too; grouped-query heads are repeated where it has no ``enable_gqa``.

Left out: padding masks (the worker packs instead: ``pack_sequences`` must be on), attention
dropout, sliding windows, KV caches (training and log-prob passes only).
"""
from __future__ import annotations

import collections
import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KERNEL_CALLS", "VARLEN", "hf_attn_implementation", "packed_row_kwargs", "packed_rows", "register_attention",
           "varlen_attention_forward"]

VARLEN = "aepo_varlen"  # the name transformers knows the kernel by
# policy.attn_implementation values that name a kernel of this module -> the registered name
REGISTERED = {"varlen": VARLEN}
# Which kernel served each layer call of varlen_attention_forward since the process started:
# "varlen" (torch's FlashAttention varlen kernel) or "sdpa_rows" (SDPA row by row). What a GPU
# check reads to tell that the packed path really ran the varlen kernel (bench/gpu_check.py).
KERNEL_CALLS: collections.Counter = collections.Counter()


def packed_rows(position_ids: Tensor | None, batch: int, length: int) -> tuple[Tensor, int]:
    """Where the packed rows of ``[batch, length]`` tokens start: ``(cu_seqlens [N+1] int32, longest row)``.

    A row starts at each position id 0 and at the start of each batch row (the tokens are taken
    as one flattened ``[batch * length]`` sequence); without position ids each batch row is one row.
    """
    total = batch * length
    if position_ids is None:
        cu = torch.arange(0, total + 1, length, dtype=torch.int32)
        return cu, length
    starts = (position_ids.expand(batch, length) == 0).clone()  # [B, L]
    starts[:, 0] = True
    index = starts.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([index, index.new_tensor([total])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())  # host syncs: packed_row_kwargs spares the layers them


@functools.cache
def _varlen_kwargs() -> frozenset[str] | None:
    """The keyword arguments of this torch's ``varlen_attn`` (None: it has none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _uses_varlen(query: Tensor) -> bool:
    """Whether torch's FlashAttention varlen kernel serves ``query`` (CUDA, half precision)."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_kwargs() is not None


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scale: float) -> Tensor:
    """``varlen_attn`` on ``[T, H, D]`` tensors, causal within each row, whatever its signature."""
    from torch.nn.attention.varlen import varlen_attn

    params, kwargs = _varlen_kwargs(), {}
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(D): fold the asked one into the queries
        query = query * (scale * math.sqrt(query.shape[-1]))
    return varlen_attn(query, key, value, cu, cu, longest, longest, **kwargs)


def _per_row_sdpa(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale: float) -> Tensor:
    """The same attention on ``[T, H, D]`` tensors, one packed row at a time (SDPA, causal)."""
    groups = query.shape[1] // key.shape[1]
    bounds = cu.tolist()
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # [1, H, n, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
        rows.append(out[0].transpose(0, 1))  # [n, Hq, D]
    return torch.cat(rows)


def varlen_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, position_ids: Tensor | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query [B, Hq, L, D]``, ``key``/``value``
    ``[B, Hkv, L, D]`` -> ``([B, L, Hq, D], None)``, causal within each packed row (module docstring).

    Raises:
        ValueError: a padding mask, attention dropout or a sliding window (left out).
    """
    if attention_mask is not None:
        raise ValueError("varlen attention takes packed rows (position ids), not a padding mask: set "
                         "policy.pack_sequences to 'on' or 'auto'")
    if dropout or sliding_window is not None:
        raise ValueError("varlen attention has no attention dropout and no sliding window")
    batch, heads, length, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    if torch.is_autocast_enabled(query.device.type):
        # Under autocast the projections are in its dtype, but Qwen3's q/k norms (fp32 weights)
        # hand back fp32 queries and keys: the attention runs in the compute dtype, as SDPA would.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is not None:  # the rows' bounds, computed once per micro-batch by the caller
        cu, longest = bounds, int(kwargs["max_length_q"])
    else:
        cu, longest = packed_rows(position_ids, batch, length)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]  # [T, H, D]
    if _uses_varlen(query):
        KERNEL_CALLS["varlen"] += 1
        out = _varlen(*flat, cu.to(device=query.device, dtype=torch.int32), longest, scale)
    else:
        KERNEL_CALLS["sdpa_rows"] += 1
        out = _per_row_sdpa(*flat, cu.cpu(), scale)
    return out.reshape(batch, length, heads, dim), None


def packed_row_kwargs(lengths: Tensor) -> dict:
    """The keyword arguments that carry packed rows' bounds through a transformers model to its
    attention (the names of transformers' ``FlashAttentionKwargs``, which its flash-attn path
    reads too): ``cu_seq_lens_q/k`` (int32, on ``lengths``' device) and ``max_length_q/k``. Made
    once per micro-batch from the rows' token counts (``lengths`` [R]; rows of 0 are dropped), so
    no layer syncs with the host to find them: one ``.item()`` here instead of two per layer."""
    lengths = lengths[lengths > 0]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def register_attention() -> None:
    """Add this module's kernels to transformers' global attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)


def hf_attn_implementation(name: str) -> str:
    """The ``attn_implementation`` to hand transformers for ``policy.attn_implementation = name``:
    this module's kernels are registered first and named by their registered name."""
    if name in REGISTERED:
        register_attention()
        return REGISTERED[name]
    return name
