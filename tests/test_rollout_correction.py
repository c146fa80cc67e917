"""Rollout/trainer mismatch correction: hand-worked weights, masks and metrics, and the weighted
loss against the policy-gradient term weighted by hand for every clip rule."""
from __future__ import annotations

import math

import msgspec
import pytest
import torch

from aepo_engine.training.batch import TokenBatch
from aepo_engine.training.policy import _weighted_advantages
from aepo_engine.training.rollout_correction import RolloutCorrectionConfig, rollout_correction
from aepo_kernels import LossConfig, policy_loss_from_logprobs
from aepo_kernels.policy_loss import aggregate, clipped_token_loss, entropy_aware_advantages

LN = math.log


def _batch():
    # row 0: token ratios 3, 0.5, 1 (then padding); row 1: 2, 2; row 2: fully masked
    old = torch.tensor([[LN(3), LN(0.5), 0.0, 9.0], [LN(2), LN(2), 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]])
    rollout = torch.zeros(3, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    return old, rollout, mask


def test_token_tis_hand_worked():
    old, rollout, mask = _batch()
    w, new_mask, m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(mode="token_tis", threshold=2.5))
    # rho = 3, 0.5, 1 | 2, 2 -> min(rho, 2.5) = 2.5, 0.5, 1 | 2, 2; zero off the mask
    expect = torch.tensor([[2.5, 0.5, 1.0, 0], [2, 2, 0, 0], [0, 0, 0, 0]])
    assert torch.allclose(w, expect) and torch.equal(new_mask, mask)
    assert m["rollout_correction/ratio_mean"] == pytest.approx((3 + 0.5 + 1 + 2 + 2) / 5)
    assert m["rollout_correction/ratio_max"] == pytest.approx(3.0)
    assert m["rollout_correction/truncated_share"] == pytest.approx(1 / 5)
    # k3 = rho - 1 - ln rho: 3 -> 0.901388, 0.5 -> 0.193147, 1 -> 0, 2 -> 0.306853 (twice)
    k3 = (0.901388 + 0.193147 + 0 + 2 * 0.306853) / 5
    assert m["rollout_correction/kl_k3"] == pytest.approx(k3, abs=1e-6)


def test_off_gives_no_weights_but_the_metrics():
    old, rollout, mask = _batch()
    w, new_mask, m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(mode="off"))
    assert w is None and new_mask is mask
    assert m["rollout_correction/ratio_max"] == pytest.approx(3.0)
    assert "rollout_correction/truncated_share" not in m


@pytest.mark.parametrize("kind, row0, row1", [("product", 1.5, 4.0), ("geometric", 1.5 ** (1 / 3), 2.0)])
def test_seq_tis_hand_worked(kind, row0, row1):
    old, rollout, mask = _batch()
    config = RolloutCorrectionConfig(mode="seq_tis", threshold=3.0, sequence_ratio=kind)
    w, _, m = rollout_correction(old, rollout, mask, config)
    # row 0: 3 * 0.5 * 1 = 1.5 (geometric 1.5^(1/3)); row 1: 2 * 2 = 4 -> capped at 3 (geometric 2)
    assert torch.allclose(w[0, :3], torch.full((3,), row0)) and w[0, 3] == 0
    assert torch.allclose(w[1, :2], torch.full((2,), min(row1, 3.0))) and not w[2].any()
    assert m["rollout_correction/ratio_mean"] == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert m["rollout_correction/truncated_share"] == pytest.approx(0.5 if row1 > 3 else 0.0)


def test_seq_mask_drops_rows_outside_the_band():
    old, rollout, mask = _batch()
    old[0, 0] = LN(0.5)  # row 0: 0.5 * 0.5 * 1 = 0.25 < 1/3 -> dropped; row 1: 4 > 3 -> dropped
    w, new_mask, m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(mode="seq_mask", threshold=3.0))
    assert w is None and not new_mask.any()
    assert m["rollout_correction/masked_share"] == pytest.approx(1.0)
    w, new_mask, m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(mode="seq_mask", threshold=5.0))
    assert torch.equal(new_mask, mask)  # 0.25 >= 1/5 and 4 <= 5: both kept
    assert m["rollout_correction/masked_share"] == 0.0


def test_ratio_statistics_per_origin_and_staleness():
    from aepo_engine.training.batch import ORIGIN_BRANCH, ORIGIN_GLOBAL, ORIGIN_INHERITED

    old, rollout, mask = _batch()  # ratios: row 0: 3, 0.5, 1 | row 1: 2, 2
    origin = torch.tensor([[ORIGIN_GLOBAL] * 3 + [0], [ORIGIN_INHERITED, ORIGIN_BRANCH, 0, 0], [0] * 4])
    staleness = torch.tensor([[0, 1, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]])
    _, _, m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(mode="token_tis", threshold=2.5),
                                 origin, staleness)
    assert m["rollout_correction/ratio_mean/global"] == pytest.approx(1.5)
    assert m["rollout_correction/ratio_max/global"] == pytest.approx(3.0)
    assert m["rollout_correction/truncated_share/global"] == pytest.approx(1 / 3)
    assert m["rollout_correction/ratio_mean/branch"] == pytest.approx(2.0)
    assert m["rollout_correction/ratio_mean/inherited"] == pytest.approx(2.0)
    # staleness 0: ratios 3 and 2; 1: 0.5 and 1; 2: 2 (the padding's staleness 0 is masked out)
    assert m["rollout_correction/ratio_mean/stale0"] == pytest.approx(2.5)
    assert m["rollout_correction/ratio_mean/stale1"] == pytest.approx(0.75)
    assert m["rollout_correction/ratio_max/stale2"] == pytest.approx(2.0)
    assert not any(k.endswith("/stale3") for k in m)


def test_auto_means_decoupled_ppo_when_tokens_may_be_stale():
    auto = RolloutCorrectionConfig(threshold=3.0)
    assert auto.mode == "auto"
    assert auto.resolved(stale_tokens=True) == RolloutCorrectionConfig(mode="token_tis", threshold=3.0)
    assert auto.resolved(stale_tokens=False).mode == "off"
    assert RolloutCorrectionConfig(mode="seq_mask").resolved(stale_tokens=True).mode == "seq_mask"
    old, rollout, mask = _batch()
    with pytest.raises(ValueError, match="resolve mode 'auto'"):
        rollout_correction(old, rollout, mask, auto)


def test_extreme_gaps_stay_finite():
    old = torch.tensor([[200.0, -200.0]])
    w, _, m = rollout_correction(old, torch.zeros(1, 2), torch.ones(1, 2), RolloutCorrectionConfig(mode="token_tis"))
    assert torch.isfinite(w).all() and w[0, 0] == 2.0 and w[0, 1] > 0
    assert all(math.isfinite(v) for v in m.values())


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="threshold must be > 1"):
        RolloutCorrectionConfig(threshold=1.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"mode": "tis"}, RolloutCorrectionConfig)


@pytest.mark.parametrize("clip", ["ppo", "aepo", "gppo", "cispo"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_weighted_loss_is_the_weighted_policy_gradient_term(clip, per_token_adv):
    """The worker's weighted advantages give w_t * (policy-gradient token loss) + unweighted KL
    and entropy terms, value and gradient, with dual clip and entropy-aware shaping on."""
    gen = torch.Generator().manual_seed(7)
    B, T = 3, 5
    logp = (-torch.rand(B, T, generator=gen) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=gen)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=gen)
    entropy = torch.rand(B, T, generator=gen) * 2
    adv = torch.randn(B, T, generator=gen) if per_token_adv else torch.tensor([1.3, -0.7, 0.4])
    mask = (torch.rand(B, T, generator=gen) > 0.2).float()
    w = torch.rand(B, T, generator=gen) * 2 + 0.05
    config = LossConfig(clip=clip, dual_clip=3.0 if clip != "cispo" else 0.0, entropy_adv_alpha=0.3,
                        kl_coef=0.05, entropy_coef=0.01)
    batch = TokenBatch(torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long),
                       torch.zeros(B, T, dtype=torch.long), mask, adv, old, torch.arange(B), token_weights=w)
    loss, _ = policy_loss_from_logprobs(logp, entropy, old, _weighted_advantages(batch), mask,
                                        config=config, ref_logprobs=ref)
    # by hand: shaped advantages, the clip rule's token loss, times w; KL and bonus unweighted
    full_adv = adv if per_token_adv else adv[:, None].expand(B, T)
    shaped = entropy_aware_advantages(full_adv, entropy, mask, 0.3)
    pg, _ = clipped_token_loss(logp, old, shaped, config)
    delta = ref - logp
    token = w * pg + 0.05 * (delta.exp() - delta - 1) - 0.01 * entropy
    expected = aggregate(token, mask, config)
    assert torch.allclose(loss, expected, atol=1e-6)
    g_loss, = torch.autograd.grad(loss, logp, retain_graph=True)
    g_expected, = torch.autograd.grad(expected, logp)
    assert torch.allclose(g_loss, g_expected, atol=1e-6)


def test_no_weights_leaves_advantages_untouched():
    adv = torch.tensor([1.0, -2.0])
    batch = TokenBatch(*(torch.zeros(2, 3),) * 4, adv, torch.zeros(2, 3), torch.arange(2))
    assert _weighted_advantages(batch) is adv


@pytest.mark.parametrize("clip", ["ppo", "aepo", "cispo"])
def test_weighted_advantages_through_the_one_pass_loss(clip):
    """The trainer's path: the one-pass kernel (CPU fast path) given the weighted advantages equals
    the hand-weighted policy-gradient term on the reference log-probs, value and logits gradient."""
    from aepo_kernels import aepo_policy_loss, entropy_moments, entropy_stats_from_moments, logprob_entropy

    gen = torch.Generator().manual_seed(11)
    B, T, V = 2, 7, 53
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64).float()
    labels = torch.randint(0, V, (B, T), generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.25).float()
    with torch.no_grad():
        logp0, h0 = logprob_entropy(logits, labels, backend="reference", shift_labels=False)
    old = logp0 + 0.3 * torch.randn(B, T, generator=gen)
    adv = torch.tensor([0.9, -1.4])
    w = torch.rand(B, T, generator=gen) * 1.5 + 0.1
    mean, std = entropy_stats_from_moments(entropy_moments(h0, mask))
    config = LossConfig(clip=clip, dual_clip=3.0 if clip != "cispo" else 0.0, entropy_adv_alpha=0.3)
    count = mask.sum()
    batch = TokenBatch(torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long), labels, mask, adv,
                       old, torch.arange(B), token_weights=w)
    fast_logits = logits.clone().requires_grad_()
    loss, _ = aepo_policy_loss(fast_logits, labels, old, _weighted_advantages(batch), mask, config=config,
                               backend="torch", entropy_mean=mean, entropy_std=std, global_token_count=count, shift_labels=False)
    ref_logits = logits.clone().requires_grad_()
    logp, entropy = logprob_entropy(ref_logits, labels, backend="reference", shift_labels=False)
    shaped = entropy_aware_advantages(adv[:, None].expand(B, T), entropy, mask, 0.3, mean, std)
    pg, _ = clipped_token_loss(logp, old, shaped, config)
    expected = aggregate(w * pg, mask, config, global_token_count=count)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(fast_logits.grad, ref_logits.grad, atol=1e-5, rtol=1e-4)
