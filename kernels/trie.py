"""Rollout trees from token sequences: the trie the tree loss (:mod:`aepo_kernels.tree_loss`) runs on.

A prompt group's rows (its k trajectories, branches included) share their prompt and, for a
branch, its parent's response up to the fork. :func:`sequence_tree` lays rows out as one trie per
group: every node is one model position holding one token, its position id is its depth, it
attends to its ancestors only; node n's loss row predicts its own token from its parent's hidden
state (a root, a group's first token, has none). :func:`tree_occurrences` then says where each
row's label position reads (:class:`~aepo_kernels.tree_loss.Occurrences`) and
:func:`node_values` moves per-token values (old log-probs) onto the nodes.

How the trie is found (per group, rows in order): row i shares its first ``own`` positions with
the earlier row whose prefix agrees with its own the longest, comparing every *key* at each
position (the token ids, and whatever else must be equal for a node's occurrences to fold, e.g.
the old log-probs); the rest are row i's own new nodes. Node order: groups in row order, within
a group the rows' new nodes in row order (each row's own nodes contiguous, parents first).

    tree = sequence_tree(input_ids, lengths, groups)            # [B, L] padded rows
    labels, occurrences = tree_occurrences(tree, advantages, loss_mask)
    old = node_values(tree, old_logprobs)                        # label-aligned [B, L] -> [N]
    # hidden states of the nodes (position ids tree.depth, the tree mask), then each node's
    # parent's state is its loss row: hidden[tree.parent.clamp(min=0)]
    loss, stats = fused_linear_aepo_tree_policy_loss(hidden[tree.parent.clamp(min=0)], lm_head.weight,
                                                     labels, old, occurrences)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .tree_loss import Occurrences

__all__ = ["SequenceTree", "group_slices", "node_values", "sequence_tree", "tree_occurrences", "trie_rows"]


class SequenceTree(NamedTuple):
    """The tries of a batch's rows (module docstring); tensors on the rows' device.

    Attributes:
        tokens: ``[N]`` long, each node's token id.
        depth: ``[N]`` long, each node's depth (its position id).
        parent: ``[N]`` long, the parent node, -1 at a root.
        owner: ``[N]`` long, the row whose insertion made the node.
        path: ``[B, L]`` long, the node at row b, position t (-1 at and past the row's length).
        own_start: ``[B]`` long, row b's first position that is its own node.
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    owner: torch.Tensor
    path: torch.Tensor
    own_start: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def trie_rows(keys: Sequence[torch.Tensor], lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The trie of one group's rows.

    Args:
        keys: ``[k, L]`` tensors compared position by position (the token ids first); position t of
            rows i and j is shared when every key agrees at t and at every earlier position.
        lengths: ``[k]`` row lengths (positions at or past a row's length never match).
    Returns:
        ``(base, own)``, ``[k]`` long each: the earlier row each row shares its first ``own``
        positions with (-1 for none; ``own`` 0 then).
    All pairs at once (``[k, k, L]`` comparisons: a few tensor ops per group, not per row).
    """
    rows, width = keys[0].shape
    valid = torch.arange(width, device=lengths.device) < lengths[:, None]  # [k, L]
    same = valid[:, None, :] & valid[None, :, :]  # [k, k, L]: rows i, j at position t
    for key in keys:
        same &= key[:, None, :] == key[None, :, :]
    prefix = same.int().cumprod(-1).sum(-1)  # [k, k] common prefix of every pair
    earlier = torch.ones(rows, rows, dtype=torch.bool, device=lengths.device).tril(-1)  # j < i
    own, base = torch.where(earlier, prefix, -1).max(-1)
    own = own.clamp(min=0)
    return torch.where(own > 0, base, -1), own


def group_slices(groups: torch.Tensor) -> list[slice]:
    """Consecutive runs of equal group ids as slices of rows.

    Raises:
        ValueError: a group whose rows are not consecutive (its trie needs them together).
    """
    ids = groups.tolist()
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    if len(starts) != len(set(ids)):
        raise ValueError("the rows of one group must be consecutive to build its trie (sort them by group first)")
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(ids)])]


def sequence_tree(input_ids: torch.Tensor, lengths: torch.Tensor | None = None, groups: torch.Tensor | None = None,
                  keys: Sequence[torch.Tensor] = ()) -> SequenceTree:
    """The tries of ``input_ids``'s rows, one per group (module docstring).

    Args:
        input_ids: ``[B, L]`` long, right-padded rows (prompt then response).
        lengths: ``[B]`` real lengths (None: every row is L long).
        groups: ``[B]`` group ids, each group's rows consecutive (None: all rows one group). Rows
            of different groups never share a node.
        keys: further ``[B, L]`` tensors that must also agree for a position to be shared (e.g.
            token-aligned old log-probs: a node then has one value for all its occurrences).
    Returns:
        The :class:`SequenceTree`.
    Raises:
        ValueError: shapes that disagree, or a group's rows not consecutive.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"sequence_tree: input_ids must be [B, L], got {list(input_ids.shape)}")
    rows, width = input_ids.shape
    device = input_ids.device
    lengths = torch.full((rows,), width, device=device) if lengths is None else lengths.to(device).long()
    groups = torch.zeros(rows, dtype=torch.long) if groups is None else groups.cpu()
    if lengths.shape != (rows,) or groups.shape != (rows,):
        raise ValueError(f"sequence_tree: lengths and groups must be [B] = [{rows}], got "
                         f"{list(lengths.shape)} and {list(groups.shape)}")
    for key in keys:
        if key.shape != input_ids.shape:
            raise ValueError(f"sequence_tree: every key must be [B, L] = {list(input_ids.shape)}, got {list(key.shape)}")
    all_keys = [input_ids, *keys]
    base = torch.full((rows,), -1, dtype=torch.long, device=device)
    own = torch.zeros(rows, dtype=torch.long, device=device)
    for part in group_slices(groups):
        group_base, own[part] = trie_rows([k[part] for k in all_keys], lengths[part])
        base[part] = torch.where(group_base >= 0, group_base + part.start, -1)
    columns = torch.arange(width, device=device)
    owned = (columns >= own[:, None]) & (columns < lengths[:, None])  # [B, L] each row's new nodes
    path = torch.full((rows, width), -1, dtype=torch.long, device=device)
    path[owned] = torch.arange(int(owned.sum()), device=device)  # row-major: each row's nodes contiguous
    inherited = columns < own[:, None]
    while True:  # a row's shared prefix is its base row's nodes; bases come earlier, one level per sweep
        missing = inherited & (path < 0)
        if not bool(missing.any()):
            break
        path = torch.where(missing, path[base.clamp(min=0)], path)
    before = torch.nn.functional.pad(path[:, :-1], (1, 0), value=-1)  # the node at t - 1
    grid = lambda values: values.expand(rows, width)[owned]  # noqa: E731
    return SequenceTree(input_ids[owned], grid(columns[None]), before[owned],
                        grid(torch.arange(rows, device=device)[:, None]), path, own)


def tree_occurrences(tree: SequenceTree, advantages: torch.Tensor, loss_mask: torch.Tensor,
                     ignore_index: int = -100) -> tuple[torch.Tensor, Occurrences]:
    """The tree loss's per-node labels and the rows' occurrences.

    Args:
        tree: from :func:`sequence_tree`.
        advantages: ``[B]`` per row, or ``[B, L]`` per label position.
        loss_mask: ``[B, L]`` label-aligned: position t weights the prediction of token t + 1
            (Hugging Face's ``shift_labels=True`` layout after the shift; the last position, and any
            whose next token is past the row's length, must be 0).
        ignore_index: the label of a root (no parent: nothing predicts it).
    Returns:
        ``(labels [N], occurrences)``: node n's label is its own token (``ignore_index`` at a root);
        an occurrence per masked-in label position: the node holding the predicted token, its
        advantage, its mask weight, its row (``num_sequences`` = B).
    Raises:
        ValueError: a masked-in position that predicts no token of its row.
    """
    rows, width = tree.path.shape
    if loss_mask.shape != (rows, width):
        raise ValueError(f"tree_occurrences: loss_mask must be [B, L] = [{rows}, {width}], got {list(loss_mask.shape)}")
    target = torch.nn.functional.pad(tree.path[:, 1:], (0, 1), value=-1)  # [B, L]: the node of token t + 1
    picked = loss_mask != 0
    if bool((picked & (target < 0)).any()):
        raise ValueError("tree_occurrences: loss_mask weights a position whose next token is past its row (the "
                         "last position of a row is never a label position)")
    b, t = picked.nonzero(as_tuple=True)
    adv = advantages[b] if advantages.dim() == 1 else advantages[b, t]
    occurrences = Occurrences(node=target[b, t], advantages=adv.float(), loss_mask=loss_mask[b, t].float(),
                              sequence=b, num_sequences=rows)
    labels = torch.where(tree.parent >= 0, tree.tokens, torch.full_like(tree.tokens, ignore_index))
    return labels, occurrences


def node_values(tree: SequenceTree, values: torch.Tensor, label_aligned: bool = True) -> torch.Tensor:
    """Per-position values as per-node values ``[N]`` (each node takes the value of the row that
    made it; positions sharing a node must hold equal values: make the values a key of
    :func:`sequence_tree` when they may differ).

    Args:
        tree: from :func:`sequence_tree`.
        values: ``[B, L]``; ``label_aligned`` (position t describes token t + 1: log-probs of
            ``shift_labels=True`` rows) or token-aligned (position t describes token t).
    Returns:
        ``[N]`` in ``values``'s dtype; 0 at roots for label-aligned values.
    """
    if values.shape != tree.path.shape:
        raise ValueError(f"node_values: values must be [B, L] = {list(tree.path.shape)}, got {list(values.shape)}")
    aligned = torch.nn.functional.pad(values[:, :-1], (1, 0)) if label_aligned else values
    out = torch.zeros(tree.num_nodes, dtype=values.dtype, device=values.device)
    owned = tree.path >= 0
    mine = owned & (torch.arange(tree.path.shape[1], device=values.device) >= tree.own_start[:, None])
    out[tree.path[mine]] = aligned[mine]
    return out
