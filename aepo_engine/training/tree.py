"""The rollout tree as the batch: a group's trajectories as one trie of token ids, each shared
prefix one set of positions.

A group's k rows share their prompt, and a branch shares its parent's response up to the tool
result where it forked. :func:`build_forest` lays the rows of a :class:`TokenBatch` out as tries,
one per prompt group: every trie node is one model position holding one token, its position id
is its depth, and it attends to its ancestors only (:mod:`aepo_engine.training.tree_attention`).
Node n's loss row is the prediction of its own token from its parent's hidden state, so a node
shared by several rows is computed once and read by each of them (its *occurrences*, the
``[B, L]`` label positions that point at it: :attr:`Forest.label_node`).

How the trie is found (per group, rows in batch order): row i shares with the earlier row j
whose prefix agrees with its own the longest, the longest common prefix over the *keys* of each
position -- the token id, and whatever else the loss reads per node and must be equal across a
node's occurrences to be folded (:func:`update_keys`: the old and reference log-probs of the
token). The async mode's per-token versions and behaviour->proximal weights are not keys: the
weights scale each occurrence's advantage (``apply_token_weights``), per row, as the advantages
themselves do. Its first ``own`` positions
are row j's nodes, the rest are new nodes (``own`` may be the whole row: an identical or prefix
trajectory adds nothing). A trie keyed on what the rows actually hold needs no trust in the
rollout's lineage: a branch whose inherited prefix differed from its parent's (it never should)
would share only up to the first difference and keep the rest as its own nodes, i.e. fall back
to a plain row there. :attr:`Forest.inherited_unshared` counts such inherited tokens (0 on every
batch measured).

Node order: groups in batch order, within a group the rows' new nodes in row order, so each row's
own nodes are contiguous and every parent precedes its children.

Positions: a micro-batch of rows computes ``sum_b len_b`` positions, its forest ``N`` nodes;
:func:`position_ratio` is what the tree saves (the update reports ``positions`` and
``position_ratio``: ``loss/position_ratio`` in a run's metrics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from aepo_engine.training.batch import IGNORE_INDEX, ORIGIN_INHERITED, TokenBatch
from aepo_kernels.trie import group_slices, sequence_tree, trie_rows

if TYPE_CHECKING:
    from aepo_engine.training.tree_attention import TreeMask

__all__ = ["NODE_FIELDS", "Forest", "TreeInputs", "TreeMicroBatch", "build_forest", "group_slices", "logprob_keys",
           "pack_groups", "position_ratio", "shard_groups", "tree_micro_batches", "trie_rows", "update_keys"]


@dataclass
class Forest:
    """The tries of a batch's rows (module docstring); every tensor on the host.

    Attributes:
        tokens: ``[N]`` long, each node's token id.
        depth: ``[N]`` long, each node's depth = its position id.
        parent: ``[N]`` long, -1 at a root (a group's first prompt token).
        owner: ``[N]`` long, the row whose insertion made the node.
        path: ``[B, L]`` long, the node at row b, position t (-1 on padding); L = the batch's width.
        own_start: ``[B]`` long, the first position of row b that is its own node.
        inherited_unshared: branch-inherited tokens (``ORIGIN_INHERITED``) that did not share a
            node with another row (expected 0).
    """

    tokens: Tensor
    depth: Tensor
    parent: Tensor
    owner: Tensor
    path: Tensor
    own_start: Tensor
    inherited_unshared: int = 0

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def label_node(self) -> Tensor:
        """``[B, L]`` long: the node whose token label position (b, t) predicts (``path[b, t + 1]``),
        -1 where the row has no label (its last token, padding)."""
        return torch.nn.functional.pad(self.path[:, 1:], (0, 1), value=-1)

    @property
    def labels(self) -> Tensor:
        """``[N]`` long: node n's loss-row label, its own token (-100 at the roots)."""
        return torch.where(self.parent >= 0, self.tokens, torch.full_like(self.tokens, IGNORE_INDEX))


# --- one group -------------------------------------------------------------------------------------

# --- keys ----------------------------------------------------------------------------------------

def _token_aligned(label_aligned: Tensor) -> Tensor:
    """A label-aligned ``[B, L]`` value (position t describes token t + 1) moved onto its token."""
    return torch.nn.functional.pad(label_aligned[:, :-1], (1, 0))


def logprob_keys(batch: TokenBatch) -> list[Tensor]:
    """The keys of a log-prob pass: the token ids only (the pass computes the per-node values)."""
    return [batch.input_ids]


# The label-aligned TokenBatch fields the loss reads per node: every occurrence of a node must hold
# the same value. A per-token field the loss reads per node belongs here; per-occurrence values
# (advantages, the async mode's importance weights on them) do not.
NODE_FIELDS = ("old_logprobs", "ref_logprobs")


def update_keys(batch: TokenBatch) -> list[Tensor]:
    """The keys of the update: token ids, and the :data:`NODE_FIELDS` the batch has, so that every
    occurrence of a node agrees on them. After a tree log-prob pass they agree wherever the
    tokens do; values computed otherwise (the row pass) may differ in the last bit between rows,
    and the trie then shares less, never wrongly."""
    values = (getattr(batch, name, None) for name in NODE_FIELDS)
    return [batch.input_ids, *(_token_aligned(v) for v in values if v is not None)]


# --- the forest ----------------------------------------------------------------------------------

def build_forest(batch: TokenBatch, keys: Sequence[Tensor]) -> Forest:
    """The tries of ``batch``'s prompt groups (module docstring; the trie itself is the library's,
    :func:`aepo_kernels.trie.sequence_tree`).

    Args:
        batch: rows of whole groups, consecutive per group (host tensors).
        keys: ``[B, L]`` tensors aligned with ``batch.input_ids``, the token ids first
            (:func:`logprob_keys`, :func:`update_keys`).
    Returns:
        The :class:`Forest`.
    """
    tree = sequence_tree(keys[0], batch.lengths, batch.group_ids, keys=keys[1:])
    return Forest(tree.tokens, tree.depth, tree.parent, tree.owner, tree.path, tree.own_start,
                  _inherited_unshared(batch, tree.own_start))


def _inherited_unshared(batch: TokenBatch, own_start: Tensor) -> int:
    """Branch-inherited tokens that the trie did not share (label-aligned origin moved onto tokens)."""
    if batch.token_origin is None:
        return 0
    inherited = _token_aligned(batch.token_origin) == ORIGIN_INHERITED
    columns = torch.arange(batch.input_ids.shape[1])
    return int((inherited & (columns >= own_start[:, None])).sum())


def position_ratio(batch: TokenBatch, forest: Forest) -> float:
    """Nodes computed / row positions (non-padding) of the same rows."""
    return forest.num_nodes / max(1, int(batch.lengths.sum()))


# --- micro-batches ---------------------------------------------------------------------------------

def pack_groups(node_counts: Sequence[int], row_counts: Sequence[int], max_nodes: int | None,
                max_rows: int | None) -> list[slice]:
    """Consecutive groups packed greedily: a micro-batch takes groups while its node count stays
    within ``max_nodes`` (or its row count within ``max_rows``); a group over the budget goes alone.
    Returns slices over the groups."""
    if (max_nodes is None) == (max_rows is None):
        raise ValueError("give exactly one of max_nodes and max_rows")
    sizes, budget = (node_counts, max_nodes) if max_nodes is not None else (row_counts, max_rows)
    parts, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            parts.append(slice(start, i))
            start, total = i, 0
        total += size
    parts.append(slice(start, len(sizes)))
    return parts


@dataclass
class TreeInputs:
    """What the model takes for a forest (on the device): node tokens and depths ``[1, N]``, each
    node's parent ``[N]`` (its loss row reads the parent's hidden state), the loss rows' labels
    ``[N]`` and the attention mask."""

    tokens: Tensor
    depth: Tensor
    parent: Tensor
    labels: Tensor
    mask: "TreeMask"

    def run(self, model: Any, loss_inputs: Any):
        """``model``'s forward for a forest (``training.policy.PolicyModel.tree_forward``; with
        ``training.layout.TreeLossInputs``: the tree loss)."""
        return model.tree_forward(self, loss_inputs)


@dataclass
class TreeMicroBatch:
    """Whole groups of rows (the per-token loss inputs, row layout) and their forest.

    ``rows`` and ``forest`` live where the micro-batch was built (the host); :meth:`to` moves both.
    """

    rows: TokenBatch
    forest: Forest

    @classmethod
    def build(cls, rows: TokenBatch, keys=logprob_keys) -> "TreeMicroBatch":
        return cls(rows, build_forest(rows, keys(rows)))

    def to(self, device) -> "TreeMicroBatch":
        f = self.forest
        moved = Forest(*(t.to(device, non_blocking=True) for t in (f.tokens, f.depth, f.parent, f.owner, f.path,
                                                                     f.own_start)), f.inherited_unshared)
        return TreeMicroBatch(self.rows.to(device), moved)

    @property
    def occurrence(self) -> Tensor:
        """``[b, L]`` bool: the label positions (each reads the node :attr:`Forest.label_node` names)."""
        return self.forest.label_node >= 0

    def node_values(self, label_aligned: Tensor) -> Tensor:
        """``[N]``: a label-aligned ``[b, L]`` value per node, read from (any of) its occurrences."""
        picked = self.occurrence
        out = label_aligned.new_zeros(self.forest.num_nodes)
        return out.index_put_((self.forest.label_node[picked],), label_aligned[picked])

    def to_rows(self, node_values: Tensor) -> Tensor:
        """``[b, L]``: a per-node value at every label position that reads the node (0 elsewhere)."""
        node = self.forest.label_node
        return torch.where(node >= 0, node_values[node.clamp(min=0)], node_values.new_zeros(()))

    def model_inputs(self) -> TreeInputs:
        from aepo_engine.training.tree_attention import TreeMask

        f = self.forest
        return TreeInputs(f.tokens[None], f.depth[None], f.parent, f.labels,
                          TreeMask(f.depth, f.owner, f.path, f.own_start))


def tree_micro_batches(local: TokenBatch, keys, max_nodes: int | None, max_rows: int | None) -> list[TreeMicroBatch]:
    """``local``'s groups packed into micro-batches by node count (``max_nodes``) or row count
    (``max_rows``), each with its forest (:func:`pack_groups`)."""
    groups = group_slices(local.group_ids)  # the prompt groups as slices of consecutive rows
    lengths, key_rows = local.lengths, keys(local)
    nodes = []
    for part in groups:
        _, own = trie_rows([k[part] for k in key_rows], lengths[part])
        nodes.append(int((lengths[part] - own).sum()))
    rows = [g.stop - g.start for g in groups]
    packs = pack_groups(nodes, rows, max_nodes, max_rows)
    return [TreeMicroBatch.build(local.rows(slice(groups[p.start].start, groups[p.stop - 1].stop)), keys)
            for p in packs]


def shard_groups(batch: TokenBatch, rank: int, world_size: int) -> tuple[TokenBatch, list[int]]:
    """Rank ``rank``'s whole groups (group g goes to rank ``g mod W``) and their row indices in
    ``batch``; a rank with no group gets one masked-out copy of row 0 (index -1), so that every
    rank runs forward/backward (FSDP's collectives)."""
    groups = group_slices(batch.group_ids)
    mine = [i for g in groups[rank::world_size] for i in range(g.start, g.stop)]
    if not mine:
        return batch.rows([0]).masked_out(), [-1]
    return batch.rows(mine), mine
