"""Attention over a rollout tree (:mod:`aepo_engine.training.tree`): each node attends to its
ancestors and itself, wired into an HF model through transformers' attention interface.

:func:`register` adds :data:`TREE_ATTENTION` to ``transformers.AttentionInterface``; a model set
to it (``model.set_attn_implementation``) takes a :class:`TreeMask` as the ``tree_mask`` keyword
of its forward (HF passes it down to every attention layer) and the nodes' depths as position
ids. Without ``tree_mask`` the function is plain SDPA (causal), so the model still runs rows.
HF builds no mask of its own for an implementation it does not know (its mask interface
returns None), so nothing ``[N, N]`` is made behind our back.

Two kernels, one mask (:meth:`TreeMask.allowed`, node q sees node k iff k lies on q's path:
``path[owner[q], depth[k]] == k``):
- CUDA: ``torch.nn.attention.flex_attention`` (compiled: Triton kernels) with a block mask built
  from that rule, so whole ``128 x 128`` blocks that no node of one attends to are skipped.
- CPU: FlexAttention has no backward on CPU in torch 2.13 ("FlexAttention does not support
  backward on CPU"), and SDPA with the dense ``[N, N]`` mask would compute all ``N^2`` scores
  (for a group of k rows of length n that is up to ``k^2 n^2`` instead of the rows' ``k n^2 / 2``).
  So the CPU path is SDPA on *chunks*: each row's own nodes (contiguous, depths
  ``[own_start, len)``) cut at multiples of ``chunk`` depths; a chunk's queries attend to the
  keys of its row's path up to the chunk's end, masked causally by depth. All chunks that end at
  the same depth block form one batched SDPA call (``[n, H, chunk, D]`` against
  ``[n, KV, (j + 1) chunk, D]``), so a layer makes ``L / chunk`` calls and computes about
  ``sum_nodes (depth + chunk)`` scores: the tree's own count plus one chunk per node. The chunk
  is sized to the longest row (:func:`chunk_for`): the gathered keys of a row are
  ``len^2 / (2 chunk)`` instead of ``len``, so longer rows take longer chunks.
Both give the attention of the row layout: the same keys in the same order per query, the
positions (RoPE) are the depths. fp32 results equal the rows' to rounding.

Left out: sliding-window layers (``sliding_window`` is rejected), attention dropout, soft-capped
attention scores, and the varlen packed-rows function (:mod:`aepo_engine.training.attention`, a
separate module).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["TREE_ATTENTION", "TreeMask", "chunk_for", "register", "tree_attention_forward"]

TREE_ATTENTION = "aepo_tree"  # the name in transformers' AttentionInterface


def chunk_for(longest: int) -> int:
    """The CPU path's query chunk: 32 depths, more for long rows (an eighth of the longest row,
    rounded up to 32) so the gathered keys stay within ~4x the rows' (module docstring); the sizes
    were chosen by measurement (docs/trees.md)."""
    return max(32, -(-longest // 8 // 32) * 32)


@dataclass
class _Bucket:
    """One batched SDPA call of the CPU path: the chunks that end at depth block j."""

    queries: Tensor  # [n, C] node index of each query slot (0 where unused)
    keys: Tensor  # [n, K] node index of each key slot, K = (j + 1) C (0 where unused)
    mask: Tensor  # [n, 1, C, K] bool, key depth <= query depth (an unused query sees key 0)
    used_index: Tensor  # [used] long, the query slots (of the n * C) that are nodes


class _Plans:
    """A mask's plans (the CPU path's buckets, FlexAttention's block mask), shared by every copy of
    the mask. FSDP2 copies a dataclass argument per wrapped layer before its forward
    (``torch.distributed.utils._apply_to_tensors``: ``dataclasses.replace`` with each field mapped,
    a ``dict`` field copied), so with a dict field the plans one layer made never reached the next
    and every layer planned the mask again (a 3-layer model built 3 block masks per micro-batch);
    an object of another class is passed through as it is, and with it the first layer's plans."""

    __slots__ = ("memo",)

    def __init__(self):
        self.memo: dict = {}


@dataclass
class TreeMask:
    """Who attends to whom in a forest (nodes ``0..N-1``), and the plans of both kernels.

    Attributes:
        depth: ``[N]`` long, each node's depth.
        owner: ``[N]`` long, the row that made the node.
        path: ``[R, L]`` long, row r's node at depth t (-1 past its end).
        own_start: ``[R]`` long, the first depth of row r's own nodes.
        chunk: the CPU path's query chunk (default :func:`chunk_for` the longest row).
    """

    depth: Tensor
    owner: Tensor
    path: Tensor
    own_start: Tensor
    chunk: int | None = None
    _plans: _Plans = field(default_factory=_Plans, repr=False, compare=False)

    @property
    def _cache(self) -> dict:
        """The plans made for this mask, shared by its copies (:class:`_Plans`)."""
        return self._plans.memo

    def to(self, device: torch.device | str) -> "TreeMask":
        return TreeMask(self.depth.to(device), self.owner.to(device), self.path.to(device), self.own_start.to(device),
                        self.chunk)

    @property
    def num_nodes(self) -> int:
        return int(self.depth.shape[0])

    # --- the rule ------------------------------------------------------------------------------

    def allowed(self, q: Tensor, k: Tensor) -> Tensor:
        """Whether node(s) ``q`` attend to node(s) ``k`` (broadcasting): k is on q's path."""
        width = self.path.shape[1]
        depth_k = self.depth[k]
        on_path = self.path.reshape(-1)[self.owner[q] * width + depth_k.clamp(max=width - 1)]
        return (depth_k <= self.depth[q]) & (on_path == k)

    def dense(self) -> Tensor:
        """``[N, N]`` bool (tests and small checks)."""
        nodes = torch.arange(self.num_nodes, device=self.depth.device)
        return self.allowed(nodes[:, None], nodes[None, :])

    # --- CPU: chunked SDPA ---------------------------------------------------------------------

    def buckets(self) -> tuple[list[_Bucket], Tensor]:
        """The CPU path's SDPA calls and ``order`` [N]: node index -> its slot among the calls'
        used query slots, concatenated (made once per mask, shared by every layer)."""
        if "buckets" not in self._cache:
            self._cache["buckets"] = self._plan_buckets()
        return self._cache["buckets"]

    def _plan_buckets(self) -> tuple[list[_Bucket], Tensor]:
        device = self.depth.device
        lengths = (self.path >= 0).sum(-1)  # [R]
        chunk = self.chunk or chunk_for(int(lengths.max()) if lengths.numel() else 1)
        blocks = -(-int(lengths.max()) // chunk) if lengths.numel() else 0
        width = blocks * chunk
        path = torch.nn.functional.pad(self.path, (0, width - self.path.shape[1]), value=-1)
        slots = torch.arange(chunk, device=device)
        buckets, sources = [], []
        for j in range(blocks):
            lo, hi = j * chunk, (j + 1) * chunk
            rows = torch.nonzero((self.own_start < hi) & (lengths > lo)).flatten()  # rows owning a node in [lo, hi)
            if rows.numel() == 0:
                continue
            depth = lo + slots  # [C]
            used = (depth[None] >= self.own_start[rows, None]) & (depth[None] < lengths[rows, None])  # [n, C]
            queries = torch.where(used, path[rows, lo:hi], torch.zeros_like(used, dtype=torch.long))
            keys = path[rows, :hi].clamp(min=0)  # [n, K]
            key_depth = torch.arange(hi, device=device)
            mask = key_depth[None, None, :] <= depth[None, :, None]  # [1, C, K]
            mask = (mask & (used[:, :, None] | (key_depth == 0)[None, None, :]))[:, None]  # [n, 1, C, K]
            buckets.append(_Bucket(queries, keys, mask, torch.nonzero(used.reshape(-1)).flatten()))
            sources.append(queries[used])
        order = torch.empty(self.num_nodes, dtype=torch.long, device=device)
        placed = torch.cat(sources) if sources else torch.zeros(0, dtype=torch.long, device=device)
        order[placed] = torch.arange(placed.numel(), device=device)
        return buckets, order

    def sdpa_chunks(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """``query [1, H, N, D]``, ``key``/``value [1, KV, N, D]`` -> ``[1, H, N, D]``."""
        buckets, order = self.buckets()
        q, k, v = query[0], key[0], value[0]  # [H, N, D], [KV, N, D]
        outs = []
        # index_select rather than advanced indexing: its backward is index_add (no sort, no
        # accumulate-mode index_put), the cheaper of the two on CPU
        for b in buckets:
            n, c = b.queries.shape
            qb = q.index_select(1, b.queries.reshape(-1)).unflatten(1, (n, c)).transpose(0, 1)  # [n, H, C, D]
            kb = k.index_select(1, b.keys.reshape(-1)).unflatten(1, b.keys.shape).transpose(0, 1)  # [n, KV, K, D]
            vb = v.index_select(1, b.keys.reshape(-1)).unflatten(1, b.keys.shape).transpose(0, 1)
            ob = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, scale=scaling,
                                                                  enable_gqa=kb.shape[1] != qb.shape[1])
            outs.append(ob.transpose(0, 1).flatten(1, 2).index_select(1, b.used_index))  # [H, used, D]
        return torch.cat(outs, dim=1).index_select(1, order)[None]

    # --- CUDA: FlexAttention -------------------------------------------------------------------

    def block_mask(self):
        """FlexAttention's block mask of :meth:`allowed` (made once per mask)."""
        if "block_mask" not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            def mask_mod(b, h, q_idx, kv_idx):
                return self.allowed(q_idx, kv_idx)

            n = self.num_nodes
            # _compile: evaluated block by block, never as a whole [N, N] mask
            self._cache["block_mask"] = create_block_mask(mask_mod, None, None, n, n, device=self.depth.device,
                                                          _compile=True)
        return self._cache["block_mask"]

    def flex(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        flex = _compiled_flex(dynamic=query.device.type == "cuda")
        return flex(query, key, value, block_mask=self.block_mask(), scale=scaling,
                    enable_gqa=key.shape[1] != query.shape[1])

    def attend(self, query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        """The tree attention of ``[1, H, N, D]`` queries: FlexAttention on CUDA, chunked SDPA elsewhere."""
        if query.device.type == "cuda":
            return self.flex(query, key, value, scaling)
        return self.sdpa_chunks(query, key, value, scaling)


@functools.cache
def _compiled_flex(dynamic: bool):
    """FlexAttention compiled; ``dynamic`` (CUDA) so that a new node count does not recompile. On
    CPU (the tests' forward check) torch 2.13's inductor fails to build the dynamic-shape C++
    kernel ("cur_qSplitSize7 was not declared"), so it is compiled per shape there."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=dynamic)


# --- the attention interface -----------------------------------------------------------------------

def tree_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                           dropout: float = 0.0, tree_mask: TreeMask | None = None, **kwargs):
    """transformers' attention function signature: ``query [B, H, N, D]`` -> ``([B, N, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("tree attention: sliding-window layers are left out")
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed forest per call ([1, H, N, D]), got {tuple(query.shape)}")
    out = tree_mask.attend(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Adds the tree attention to transformers' ``AttentionInterface`` (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
    return TREE_ATTENTION
