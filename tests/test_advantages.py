"""Tests for GRPO group advantages (docs/algorithm.md §2a) and their broadcast to tokens."""
import math

import pytest
import torch

from aepo_engine.algorithms import broadcast_to_tokens, dense_group_index, group_advantages


def loop_reference(rewards, group_ids, normalize_std=True, unbiased=True, eps=1e-6):
    """Plain-Python oracle: one pass per group, float64."""
    rewards, group_ids = rewards.tolist(), group_ids.tolist()
    out = []
    for r, g in zip(rewards, group_ids):
        members = [x for x, h in zip(rewards, group_ids) if h == g]
        mean = sum(members) / len(members)
        if not normalize_std:
            out.append(r - mean)
            continue
        dof = len(members) - 1 if unbiased else len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / max(dof, 1))
        out.append((r - mean) / (std + eps))
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Hand-worked numbers.


def test_hand_worked_two_groups():
    # Group 7: rewards 1, 0, 0, 1 -> mean 0.5, deviations +-0.5, sum of squares 4 * 0.25 = 1,
    #   unbiased var 1/3, std 0.57735; A = 0.5 / 0.57735 = 0.866025 (eps 1e-6 moves the 6th
    #   decimal at most).
    # Group 3: rewards 2, -1 -> mean 0.5, deviations +1.5 / -1.5, unbiased var 4.5 / 1 = 4.5,
    #   std 2.12132; A = 1.5 / 2.12132 = +-0.707107.
    rewards = torch.tensor([1.0, 2.0, 0.0, 0.0, -1.0, 1.0])
    group_ids = torch.tensor([7, 3, 7, 7, 3, 7])
    expected = torch.tensor([0.866025, 0.707107, -0.866025, -0.866025, -0.707107, 0.866025])
    torch.testing.assert_close(group_advantages(rewards, group_ids), expected, atol=2e-6, rtol=0)


def test_hand_worked_population_std_and_centring_only():
    # rewards 1, 0, 0, 1: population var = 1 / 4 = 0.25, std 0.5 -> A = +-0.5 / 0.5 = +-1.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group_ids = torch.zeros(4, dtype=torch.long)
    torch.testing.assert_close(group_advantages(rewards, group_ids, unbiased=False),
                               torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=5e-6, rtol=0)
    # normalize_std=False: A = R - mean = +-0.5.
    torch.testing.assert_close(group_advantages(rewards, group_ids, normalize_std=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_singleton_groups_are_zero():
    # A group of one: R - mean = 0 exactly, and n - 1 = 0 is never divided by.
    rewards = torch.tensor([3.0, -1.1, 0.4])
    out = group_advantages(rewards, torch.tensor([0, 1, 2]))
    assert torch.equal(out, torch.zeros(3))


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -1.0, 1.1, 1 / 3])
@pytest.mark.parametrize("size", [2, 5, 12, 16])
def test_equal_rewards_give_exact_zero(value, size):
    # Without the pivot shift, twelve float32 rewards of 1.1 average to 1.1 + ~1e-7, and
    # ~1e-7 / (std ~1e-7 + eps 1e-6) gives |A| ~ 0.1: noise, not 0.
    rewards = torch.full((size,), value)
    out = group_advantages(rewards, torch.zeros(size, dtype=torch.long))
    assert torch.equal(out, torch.zeros(size))


# ---------------------------------------------------------------------------------------------
# Random inputs against the loop reference.


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("normalize_std,unbiased", [(True, True), (True, False), (False, True)])
def test_random_against_loop(seed, normalize_std, unbiased):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=gen))
    # Sparse, unsorted, negative and repeated ids; groups of uneven sizes (some of size 1).
    group_ids = torch.randint(-5, 12, (n,), generator=gen) * 1000
    rewards = torch.randn(n, generator=gen, dtype=torch.float64)
    out = group_advantages(rewards, group_ids, normalize_std=normalize_std, unbiased=unbiased)
    assert out.dtype == torch.float64
    expected = loop_reference(rewards, group_ids, normalize_std, unbiased)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_float32_and_int32_ids():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=gen)
    group_ids = torch.randint(0, 6, (40,), generator=gen, dtype=torch.int32)
    out = group_advantages(rewards, group_ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), loop_reference(rewards.double(), group_ids),
                               rtol=1e-4, atol=1e-5)


def test_bfloat16_rewards_are_computed_in_float32():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.bfloat16)
    out = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.707106, -0.707106, 0.0, 0.0]),
                               atol=2e-6, rtol=0)


def test_dense_group_index():
    ids = torch.tensor([40, -2, 40, 7, -2, 99])
    assert dense_group_index(ids).tolist() == [2, 0, 2, 1, 0, 3]


def test_invariant_to_permutation():
    gen = torch.Generator().manual_seed(1)
    rewards, group_ids = torch.randn(30, generator=gen), torch.randint(0, 5, (30,), generator=gen)
    perm = torch.randperm(30, generator=gen)
    torch.testing.assert_close(group_advantages(rewards, group_ids)[perm],
                               group_advantages(rewards[perm], group_ids[perm]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError):
        group_advantages(torch.zeros(3), torch.zeros(3))


def test_no_host_syncs_on_meta_tensors():
    # Meta tensors have shapes but no data: .item(), `if tensor:`, torch.unique and boolean
    # masking all raise on them, so running on "meta" proves the code never needs a value on
    # the host (torch.compile(fullgraph=True) does not: it captures .item() since torch 2.x).
    rewards, group_ids = torch.zeros(6, device="meta"), torch.zeros(6, dtype=torch.long,
                                                                     device="meta")
    for unbiased in (True, False):
        assert group_advantages(rewards, group_ids, unbiased=unbiased).shape == (6,)
    assert group_advantages(rewards, group_ids, normalize_std=False).shape == (6,)
    mask = torch.ones(6, 9, device="meta")
    assert broadcast_to_tokens(rewards, mask).shape == (6, 9)
    with pytest.raises(Exception):  # the check can fail: a host sync is caught
        rewards.sum().item()


# ---------------------------------------------------------------------------------------------
# Broadcast to tokens.


def test_broadcast_to_tokens():
    adv = torch.tensor([0.5, -2.0])
    # Row 0: 3 response tokens, then a tool result (mask 0), then 1 token, then padding.
    mask = torch.tensor([[1, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0]])
    expected = torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.5, 0.0], [-2.0, 0, 0, 0, 0, 0]])
    assert torch.equal(broadcast_to_tokens(adv, mask), expected)
    assert torch.equal(broadcast_to_tokens(adv, mask.bool()), expected)
    with pytest.raises(ValueError):
        broadcast_to_tokens(adv, mask[:1])


# ---------------------------------------------------------------------------------------------
# aepo_kernels.step_inputs: the one call an outside loop makes before the loss.


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_step_inputs_make_micro_batch_losses_sum_to_the_step_loss(aggregation):
    """step_inputs over the whole step, its loss_kwargs passed to each micro-batch's call: the
    micro-batch losses (and gradients) sum to the one-call loss of the whole batch, whose own
    statistics are those of the same entropies; the advantages are group_advantages'."""
    from aepo_kernels import LossConfig, aepo_policy_loss, entropy_moments, logprob_entropy, step_inputs

    gen = torch.Generator().manual_seed(4)
    batch, seq, vocab = 6, 5, 23
    logits = torch.randn(batch, seq, vocab, generator=gen) * 2
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = (torch.rand(batch, seq, generator=gen) > 0.3).float()
    rewards, groups = torch.rand(batch, generator=gen), torch.arange(batch) // 3
    old, entropy = logprob_entropy(logits, labels, shift_labels=False)
    step = step_inputs(rewards, groups, entropy, mask)
    torch.testing.assert_close(step.advantages, group_advantages(rewards, groups))
    moments = entropy_moments(entropy, mask)
    assert step.global_token_count == mask.sum() and step.global_num_seqs == batch
    torch.testing.assert_close(step.entropy_mean, (moments[0] / moments[2]).float())
    cfg = LossConfig(aggregation=aggregation, entropy_adv_alpha=0.4)
    old = old + 0.1 * torch.randn(batch, seq, generator=gen)  # ratios != 1
    leaf = logits.clone().requires_grad_()
    whole, _ = aepo_policy_loss(leaf, labels, old, step.advantages, mask, shift_labels=False, config=cfg)
    whole.backward()
    parts = logits.clone().requires_grad_()
    total = sum(aepo_policy_loss(parts[rows], labels[rows], old[rows], step.advantages[rows], mask[rows],
                                 shift_labels=False, config=cfg, **step.loss_kwargs())[0]
                for rows in (slice(0, 2), slice(2, 6)))
    total.backward()
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(parts.grad, leaf.grad, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match=r"step_inputs\(\): entropy \[6, 5\] and loss_mask \[6, 4\]"):
        step_inputs(rewards, groups, entropy, mask[:, :4])
