"""The library's rollout-tree helpers (``aepo_kernels.trie``, issue 51): a trie built from token
rows with ``sequence_tree``, its loss inputs from ``tree_occurrences`` / ``node_values``, and the
tree loss on it equal to the row loss on the rows; ``decoupled_ppo_weights`` hand-worked."""
from __future__ import annotations

import math

import pytest
import torch

from aepo_kernels import (LossConfig, aepo_policy_loss, aepo_tree_policy_loss, decoupled_ppo_weights, node_values,
                          sequence_tree, tree_occurrences)

V = 23


def _rows():
    """Two groups: a prompt [1 2 3] with a branch sharing [1 2 3 4 5]; a second prompt alone."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 0],
                        [1, 2, 3, 4, 5, 7, 8],
                        [1, 2, 3, 9, 0, 0, 0],
                        [5, 5, 6, 0, 0, 0, 0]])
    return ids, torch.tensor([6, 7, 4, 3]), torch.tensor([0, 0, 0, 1])


def test_the_trie_of_hand_made_rows():
    ids, lengths, groups = _rows()
    tree = sequence_tree(ids, lengths, groups)
    # group 0: row 0's 6 nodes, row 1 adds 7 8, row 2 adds 9; group 1: 3 nodes of its own
    assert tree.num_nodes == 6 + 2 + 1 + 3
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 5, 6]
    assert tree.parent.tolist() == [-1, 0, 1, 2, 3, 4, 4, 6, 2, -1, 9, 10]
    assert tree.depth.tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 3, 0, 1, 2]
    assert tree.path[1].tolist() == [0, 1, 2, 3, 4, 6, 7] and tree.path[2].tolist() == [0, 1, 2, 8, -1, -1, -1]
    assert tree.own_start.tolist() == [0, 5, 3, 0]
    with pytest.raises(ValueError, match="consecutive"):
        sequence_tree(ids, lengths, torch.tensor([0, 1, 0, 1]))


@pytest.mark.parametrize("clip", ["ppo", "aepo"])
def test_the_tree_loss_on_the_trie_is_the_row_loss_on_the_rows(clip):
    """Logits of a label position depend on the prefix it reads (a table indexed by the node at t):
    the row loss over the padded rows and the tree loss over the trie's nodes are the same loss,
    with the same gradient on every node's logits."""
    ids, lengths, groups = _rows()
    tree = sequence_tree(ids, lengths, groups)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(tree.num_nodes, V, generator=gen, dtype=torch.float64)
    cols = torch.arange(ids.shape[1])
    loss_mask = ((cols[None] >= 2) & (cols[None] < lengths[:, None] - 1)).double()  # responses' label positions
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    # old log-probs: a function of the predicted node, so positions sharing a node agree
    node_old = -torch.rand(tree.num_nodes, generator=gen, dtype=torch.float64)
    target = torch.nn.functional.pad(tree.path[:, 1:], (0, 1), value=-1)
    old_rows = torch.where(target >= 0, node_old[target.clamp(min=0)], 0.0)
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3)

    row_table = table.clone().requires_grad_()
    row_logits = row_table[tree.path.clamp(min=0)]  # [B, L, V]: position t reads node path[b, t]
    labels = torch.where(target >= 0, ids.roll(-1, 1), -100)
    row_loss, _ = aepo_policy_loss(row_logits, labels, old_rows, advantages, loss_mask, shift_labels=False, config=cfg)
    row_loss.backward()

    tree_table = table.clone().requires_grad_()
    node_labels, occurrences = tree_occurrences(tree, advantages, loss_mask)
    old = node_values(tree, old_rows)
    tree_logits = tree_table[tree.parent.clamp(min=0)]  # node n's loss row: its parent's state
    tree_loss, _ = aepo_tree_policy_loss(tree_logits, node_labels, old, occurrences, config=cfg)
    tree_loss.backward()
    torch.testing.assert_close(tree_loss, row_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tree_table.grad, row_table.grad, rtol=1e-9, atol=1e-12)
    assert occurrences.num_sequences == 4 and int(occurrences.node.shape[0]) == int((loss_mask > 0).sum())


def test_a_weighted_position_past_the_row_is_refused():
    ids, lengths, groups = _rows()
    tree = sequence_tree(ids, lengths, groups)
    mask = torch.zeros(ids.shape)
    mask[3, 2] = 1.0  # row 3 has 3 tokens: position 2 predicts nothing
    with pytest.raises(ValueError, match="past its row"):
        tree_occurrences(tree, torch.zeros(4), mask)


def test_decoupled_ppo_weights_by_hand():
    prox = torch.tensor([math.log(0.5), math.log(0.9), math.log(0.2), -1.0])
    behav = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.4), -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # w = 1, 3, 0.5 on the masked-in tokens; 0 where masked out
    assert torch.allclose(decoupled_ppo_weights(prox, behav, mask, cap=None), torch.tensor([1.0, 3.0, 0.5, 0.0]))
    assert torch.allclose(decoupled_ppo_weights(prox, behav, mask, cap=2.0), torch.tensor([1.0, 2.0, 0.5, 0.0]))
    assert torch.allclose(decoupled_ppo_weights(prox, behav, mask, cap=2.0, over_cap="drop"),
                          torch.tensor([1.0, 0.0, 0.5, 0.0]))
    assert not decoupled_ppo_weights(prox.requires_grad_(), behav, mask).requires_grad
    with pytest.raises(ValueError, match="cap must be > 1"):
        decoupled_ppo_weights(prox, behav, cap=1.0)


def test_sequence_level_aggregation_needs_the_number_of_trajectories():
    """Issue 51: Occurrences.num_sequences had a default (sequence.max() + 1) that miscounts when
    the last trajectories are masked out entirely; the sequence-level aggregations now need it."""
    from aepo_kernels import Occurrences

    ids, lengths, groups = _rows()
    tree = sequence_tree(ids, lengths, groups)
    cols = torch.arange(ids.shape[1])
    mask = ((cols[None] >= 2) & (cols[None] < lengths[:, None] - 1)).float()
    mask[3] = 0.0  # the last trajectory counts as a sequence with no token
    labels, occ = tree_occurrences(tree, torch.ones(4), mask)
    logits = torch.randn(tree.num_nodes, V, generator=torch.Generator().manual_seed(1))
    old = -torch.rand(tree.num_nodes)
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="needs Occurrences.num_sequences"):
        aepo_tree_policy_loss(logits, labels, old, occ._replace(num_sequences=None), config=cfg)
    counted, _ = aepo_tree_policy_loss(logits, labels, old, occ, config=cfg)  # divides by 4 sequences
    three, _ = aepo_tree_policy_loss(logits, labels, old, occ._replace(num_sequences=None), config=cfg,
                                     global_num_seqs=3)
    torch.testing.assert_close(counted * 4, three * 3)
