"""The tree loss (aepo_kernels.tree_loss) against the row loss on the expanded rows, for every clip
rule, aggregation and backend: two advantage columns per node are exact, not an approximation.

The oracle is :func:`aepo_kernels.reference.aepo_loss_reference` (literal maths, autograd) on the
``[B, T]`` rows a tree expands to: row b, position t reads the logits of the node its next token
is. Its gradient w.r.t. those row logits, summed over the rows that share a node, is the node's
gradient. Trees are random tries with the shapes that matter: a shared prompt, deep branches, a
branch at the first response token, identical trajectories, a trajectory that is a prefix of
another, a group of one; advantages of both signs (and 0), masked occurrences, per-token
importance weights.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from aepo_kernels import AGGREGATIONS, CLIP_RULES, LossConfig, aepo_policy_loss
from aepo_kernels.reference import aepo_loss_reference, tree_loss_reference
from aepo_kernels.tree_loss import (Occurrences, aepo_tree_policy_loss, fold_occurrences,
                                    fused_linear_aepo_tree_policy_loss)

from test_kernels_one_pass import BACKENDS, backend  # noqa: F401  (backend: the fixture, torch-compiled = C kernel off)

IGNORE = -100


@dataclasses.dataclass
class Tree:
    """A forest of tries and the rows it expands to."""

    tokens: torch.Tensor  # [N] node tokens
    parent: torch.Tensor  # [N], -1 at a root
    paths: list[list[int]]  # per row, its node at each depth
    group: list[int]  # per row, its trie

    @property
    def labels(self) -> torch.Tensor:
        """[N]: node n's token, no target at the roots."""
        return torch.where(self.parent >= 0, self.tokens, torch.full_like(self.tokens, IGNORE))

    def row_nodes(self) -> torch.Tensor:
        """[B, T] (T = longest row - 1): the node whose token row b predicts at position t, -1 beyond."""
        width = max(len(p) for p in self.paths) - 1
        out = torch.full((len(self.paths), width), -1, dtype=torch.long)
        for b, path in enumerate(self.paths):
            out[b, : len(path) - 1] = torch.tensor(path[1:])
        return out


def random_forest(seed: int, vocab: int) -> Tree:
    """Two tries of several rows (a prompt, forks at random depths, at the first response token,
    an identical row, a prefix row) and a trie of one row."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parent, paths, group = [], [], [], []

    def extend(path: list[int], count: int) -> list[int]:
        path = list(path)
        for _ in range(count):
            tokens.append(int(torch.randint(vocab, (), generator=gen)))
            parent.append(path[-1] if path else -1)
            path.append(len(tokens) - 1)
        return path

    for g, (prompt, rows) in enumerate([(7, 6), (4, 4), (5, 1)]):
        first = extend([], prompt)
        made = [extend(first, 9)]
        for i in range(1, rows):
            kind = i % 4
            base = made[int(torch.randint(len(made), (), generator=gen))]
            if kind == 1:  # a branch at the first response token
                made.append(extend(first, 6))
            elif kind == 2:  # identical trajectory
                made.append(list(base))
            elif kind == 3 and len(base) > prompt + 3:  # a prefix of another
                made.append(base[: prompt + 3])
            else:  # a deep branch
                cut = int(torch.randint(prompt, len(base), (), generator=gen))
                made.append(extend(base[:cut], 1 + int(torch.randint(8, (), generator=gen))))
        paths += made
        group += [g] * len(made)
    return Tree(torch.tensor(tokens), torch.tensor(parent), paths, group)


def _case(seed: int, vocab: int = 61):
    """A forest and per-row inputs: advantages of both signs (and a 0), masks, IS weights."""
    tree = random_forest(seed, vocab)
    gen = torch.Generator().manual_seed(seed + 1)
    n, rows = tree.tokens.shape[0], tree.row_nodes()
    valid = rows >= 0
    logits = torch.randn(n, vocab, generator=gen) * 2
    old = torch.log_softmax(logits + 1.2 * torch.randn(n, vocab, generator=gen), -1)
    old = old.gather(-1, tree.tokens.clamp(min=0)[:, None])[:, 0]  # [N]: one old log-prob per node
    ref = old + 0.3 * torch.randn(n, generator=gen)
    advantages = torch.randn(rows.shape[0], generator=gen) * 1.5
    advantages[2] = 0.0
    mask = ((torch.rand(rows.shape, generator=gen) > 0.2) & valid).float()
    weights = torch.rand(rows.shape, generator=gen) + 0.5
    return tree, rows, valid, logits, old, ref, advantages, mask, weights


def _occurrences(rows, valid, advantages, mask):
    b = torch.arange(rows.shape[0])[:, None].expand_as(rows)
    return Occurrences(rows[valid], advantages[:, None].expand_as(rows)[valid], mask[valid], b[valid], rows.shape[0])


def _row_reference(tree, rows, valid, logits, old, ref, advantages, mask, weights, cfg):
    """(loss, d logits [N, V]) of the literal reference on the expanded rows."""
    leaf = logits.clone().requires_grad_()
    row_adv = advantages[:, None] * weights  # importance weights fold into the advantage
    loss = tree_loss_reference(leaf, tree.tokens, old, rows, row_adv, mask, cfg, node_ref_logprobs=ref)
    loss.backward()
    return loss.detach(), leaf.grad


CONFIGS = {
    "aepo-default": {},
    "all-on": dict(eps_low=0.15, eps_high=0.28, dual_clip=2.5, log_ratio_clamp=1.0, entropy_adv_alpha=0.3,
                   kl_coef=0.05, entropy_coef=0.01),
    "no-shaping": dict(entropy_adv_alpha=0.0, dual_clip=0.0),
}


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("rule", CLIP_RULES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_tree_loss_equals_the_row_loss(backend, aggregation, rule, config_name):
    tree, rows, valid, logits, old, ref, advantages, mask, weights = _case(seed=3 * CLIP_RULES.index(rule) + 1)
    cfg = LossConfig(clip=rule, aggregation=aggregation, seq_norm_length=23, **CONFIGS[config_name])
    want_loss, want_grad = _row_reference(tree, rows, valid, logits, old, ref, advantages, mask, weights, cfg)
    leaf = logits.clone().requires_grad_()
    occ = _occurrences(rows, valid, advantages, mask)
    loss, stats = aepo_tree_policy_loss(leaf, tree.labels, old, occ, shift_labels=False, config=cfg,
                                        backend=backend, ref_logprobs=ref, token_weights=weights[valid])
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-5, atol=1e-7)
    # The tree computes N rows, the rows M: the test's trees do share nodes.
    assert tree.tokens.shape[0] < int(valid.sum())


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("rule", CLIP_RULES)
def test_fused_linear_tree_loss_equals_the_row_loss(backend, rule):
    """From hidden states: gradients w.r.t. the nodes' hidden states, the weight and the bias."""
    tree, rows, valid, _, old, ref, advantages, mask, weights = _case(seed=11 + CLIP_RULES.index(rule), vocab=53)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(tree.tokens.shape[0], 24, generator=gen)
    weight, bias = torch.randn(53, 24, generator=gen) * 0.5, torch.randn(53, generator=gen) * 0.1
    cfg = LossConfig(clip=rule, **CONFIGS["all-on"])
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    want_loss, _ = _row_reference(tree, rows, valid, (h @ w.T + b).detach(), old, ref, advantages, mask, weights, cfg)
    safe = rows.clamp(min=0)
    labels = torch.where(valid, tree.tokens[safe], torch.full_like(safe, IGNORE))
    row_loss = aepo_loss_reference(h[safe] @ w.T + b, labels, old[safe], advantages[:, None] * weights, mask, cfg,
                                   ref_logprobs=ref[safe])
    want = torch.autograd.grad(row_loss, (h, w, b))
    occ = _occurrences(rows, valid, advantages, mask)
    h2, w2, b2 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss, _ = fused_linear_aepo_tree_policy_loss(h2, w2, tree.labels, old, occ, shift_labels=False, bias=b2, config=cfg,
                                                 backend=backend, ref_logprobs=ref, token_weights=weights[valid], token_chunk=7)
    got = torch.autograd.grad(loss, (h2, w2, b2))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
    for name, g, e in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


HEAD_ORDERS = ["token_outer", "vocab_outer", "vocab_outer_lean"]


@pytest.mark.parametrize("order", HEAD_ORDERS)
@pytest.mark.parametrize("rule", CLIP_RULES)
def test_fused_linear_tree_loss_takes_every_head_order(order, rule):
    """``head_backward`` on the tree loss: the flat loss's head (``fused_linear.head_call`` and
    ``fused_linear_aepo_loss``, no second implementation). Hidden states, weight and bias in
    float64, 7-row token chunks and 4 vocabulary blocks, entropy statistics not supplied (the
    two-phase path: for the vocabulary-outer orders their statistics pass is the entropy pass):
    the loss and the gradients of hidden, weight and bias are the float64 tree reference's on the
    expanded rows (to 1e-7 of the largest gradient: the tree folds its per-occurrence weights and
    advantages in fp32) and the token-outer tree loss's to 1e-12."""
    tree, rows, valid, _, old, ref, advantages, mask, weights = _case(seed=31 + CLIP_RULES.index(rule), vocab=53)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(tree.tokens.shape[0], 24, generator=gen, dtype=torch.float64)
    weight = torch.randn(53, 24, generator=gen, dtype=torch.float64) * 0.5
    bias = torch.randn(53, generator=gen, dtype=torch.float64) * 0.1
    cfg = LossConfig(clip=rule, **CONFIGS["all-on"])
    occ = _occurrences(rows, valid, advantages, mask)

    def run(head_backward):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, _ = fused_linear_aepo_tree_policy_loss(
            leaves[0], leaves[1], tree.labels, old, occ, shift_labels=False, bias=leaves[2], config=cfg,
            ref_logprobs=ref, token_weights=weights[valid], token_chunk=7, vocab_chunk=16, head_backward=head_backward)
        return loss.detach(), torch.autograd.grad(loss, leaves)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    h, w, b = leaves
    want_loss = tree_loss_reference(h @ w.T + b, tree.tokens, old.double(), rows,
                                    (advantages[:, None] * weights).double(), mask.double(), cfg,
                                    node_ref_logprobs=ref.double())
    want = torch.autograd.grad(want_loss, leaves)
    loss, got = run(order)
    token_loss, token_got = run("token_outer")
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(loss, token_loss, rtol=1e-12, atol=1e-14)
    for name, g, e, t in zip(("hidden", "weight", "bias"), got, want, token_got):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7 * e.abs().max(), msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(g, t, rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")


def test_statistics_and_token_rows_count_occurrences():
    """The statistics are the row loss's (fast path on the expanded rows): clip fractions, ratio,
    KL, entropy, token counts, split masks, and the per-token rows of every occurrence."""
    tree, rows, valid, logits, old, ref, advantages, mask, weights = _case(seed=21)
    cfg = LossConfig(**CONFIGS["all-on"])
    split = {"odd": (torch.arange(rows.shape[0])[:, None] % 2 == 1).expand_as(rows)}
    safe = rows.clamp(min=0)
    labels = torch.where(valid, tree.tokens[safe], torch.full_like(safe, IGNORE))
    _, want = aepo_policy_loss(logits[safe], labels, old[safe], advantages[:, None] * weights, mask, config=cfg,
                               shift_labels=False, ref_logprobs=ref[safe], stats_masks=split, return_token_loss=True)
    occ = _occurrences(rows, valid, advantages, mask)
    _, got = aepo_tree_policy_loss(logits, tree.labels, old, occ, shift_labels=False, config=cfg, ref_logprobs=ref,
                                   token_weights=weights[valid], stats_masks={"odd": split["odd"][valid]},
                                   return_token_loss=True)
    assert set(got) == set(want)
    for key, value in got.items():
        expected = want[key][valid] if value.dim() == 1 and want[key].dim() == 2 else want[key]
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert float(got["num_tokens"]) == float(mask.sum())


def test_fold_hand_worked():
    """Node 0: occurrences A = 2 (w 0.5), -1 (w 0.25), 3 (w 0.25): W = 1, P = (1 + 0.75) / 1, Q = -0.25.
    Node 1: a masked occurrence only (w 0): W = 0 and both columns 0. Node 2: no occurrence."""
    node = torch.tensor([0, 0, 0, 1])
    pos, neg, weight = fold_occurrences(node, torch.tensor([2.0, -1.0, 3.0, 5.0]),
                                        torch.tensor([0.5, 0.25, 0.25, 0.0]), 3)
    torch.testing.assert_close(weight, torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(pos, torch.tensor([1.75, 0.0, 0.0]))
    torch.testing.assert_close(neg, torch.tensor([-0.25, 0.0, 0.0]))


def test_one_column_would_not_do():
    """Why two columns: folding both signs into one net advantage changes the loss whenever a
    node's occurrences disagree in sign and the ratio is clipped (here r = 1.5 > 1 + eps)."""
    from aepo_kernels.config import hyper_params
    from aepo_kernels.one_pass import token_head

    hp = hyper_params(LossConfig(clip="ppo", entropy_adv_alpha=0.0), False, torch.float64, "cpu")
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    # logp 0, entropy 1, old log-prob log(1/1.5): ratio 1.5; no reference; mean 0, std 1
    head = lambda a, a_neg=None: token_head(f64(0.0), f64(1.0), f64(-0.405465), a, f64(0.0), f64(0.0), f64(1.0),  # noqa: E731
                                            hp, a_neg)[0]
    a, b = torch.tensor(1.0, dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    expanded = head(a) + head(b)  # -1 * 1.2 + 1 * 1.5 = 0.3
    assert abs(float(expanded) - 0.3) < 1e-5
    assert abs(float(head(a, b)) - float(expanded)) < 1e-12
    assert abs(float(head(a + b)) - float(expanded)) > 0.2  # one net column: 0


def test_bad_inputs_say_what_is_wrong():
    """The input contract (aepo_kernels.contract) on both tree entry points: shift_labels is False
    by default (a tree has no other convention, issue 51) and True or a non-bool is refused; the
    per-node and per-occurrence arguments are checked (metadata, then values)."""
    tree, rows, valid, logits, old, ref, advantages, mask, weights = _case(seed=2)
    occ = _occurrences(rows, valid, advantages, mask)
    labels = tree.labels
    loss = lambda *args, **kw: aepo_tree_policy_loss(*args, **{"shift_labels": False, **kw})  # noqa: E731
    assert torch.equal(aepo_tree_policy_loss(logits, labels, old, occ)[0], loss(logits, labels, old, occ)[0])
    hidden, weight = torch.randn(labels.shape[0], 8), torch.randn(logits.shape[1], 8)
    assert torch.equal(fused_linear_aepo_tree_policy_loss(hidden, weight, labels, old, occ)[0],
                       fused_linear_aepo_tree_policy_loss(hidden, weight, labels, old, occ, shift_labels=False)[0])
    with pytest.raises(ValueError, match="no meaning on a tree"):
        loss(logits, labels, old, occ, shift_labels=True)
    with pytest.raises(TypeError, match="shift_labels must be True or False"):
        loss(logits, labels, old, occ, shift_labels=1)
    with pytest.raises(ValueError, match=r"occurrences.node must hold node indices in \[0, "):
        loss(logits, labels, old, occ._replace(node=occ.node + 1000))
    with pytest.raises(TypeError, match="occurrences.node must be a 1-D int64"):
        loss(logits, labels, old, occ._replace(node=occ.node.float()))
    bad = labels.clone()
    bad[3] = logits.shape[1]  # a token id past the vocabulary
    with pytest.raises(ValueError, match=r"labels must hold token ids in \[0, 61\)"):
        loss(logits, bad, old, occ)
    with pytest.raises(ValueError, match="occurrences.loss_mask must hold finite weights >= 0"):
        loss(logits, labels, old, occ._replace(loss_mask=occ.loss_mask - 2))
    nan = weights[valid].clone()
    nan[0] = float("nan")
    with pytest.raises(ValueError, match="token_weights must hold finite weights"):
        loss(logits, labels, old, occ, token_weights=nan)
    with pytest.raises(ValueError, match=r"token_weights \[3\] must be shaped like occurrences.node"):
        loss(logits, labels, old, occ, token_weights=torch.ones(3))
    with pytest.raises(ValueError, match=r"occurrences.sequence must hold trajectory indices"):
        loss(logits, labels, old, occ._replace(sequence=occ.sequence + occ.num_sequences))
    with pytest.raises(TypeError, match="old_logprobs must be a floating-point"):
        loss(logits, labels, old.long(), occ)
    with pytest.raises(ValueError, match=r"old_logprobs \[.*\] must be shaped like labels"):
        loss(logits, labels, old[:-1], occ)
    with pytest.raises(ValueError, match=r"labels .* must be shaped like the leading dims of logits"):
        loss(logits[:-1], labels, old, occ)
    with pytest.raises(ValueError, match="hidden .* and the lm_head weight"):
        fused_linear_aepo_tree_policy_loss(hidden, weight[:, :5], labels, old, occ, shift_labels=False)
    with pytest.raises(ValueError, match="seq_norm_length"):
        loss(logits, labels, old, occ, config=LossConfig(aggregation="seq-mean-token-sum-norm"))
