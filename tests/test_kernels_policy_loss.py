"""AEPO policy loss: hand-worked clip branches, entropy advantage, aggregation, invariance."""
import math

import pytest
import torch

from aepo_kernels import (
    AEPOLoss,
    LossConfig,
    aepo_policy_loss,
    entropy_aware_advantages,
    entropy_moments,
    entropy_stats_from_moments,
    policy_loss_from_logprobs,
)
from aepo_kernels.reference import aepo_loss_reference, token_loss_reference

from conftest import backend_params, triton_available

NO_SHAPING = dict(entropy_adv_alpha=0.0)


def _token_value_and_grad(clip, advantage, ratio, **config):
    """Loss and dL/dlogp of one token with old logp 0 and logp = log(ratio)."""
    cfg = LossConfig(clip=clip, **{**NO_SHAPING, **config})
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss_from_logprobs(
        logp, torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.tensor([advantage]), torch.ones(1), config=cfg
    )
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_()
    ref = token_loss_reference(ref_logp, torch.zeros(1), torch.zeros(1), torch.tensor([advantage]), torch.ones(1), cfg)
    (ref_grad,) = torch.autograd.grad(ref.sum(), ref_logp)
    return loss.item(), grad.item(), ref.item(), ref_grad.item()


# eps_low = eps_high = 0.2, dual clip c = 3. Each row: (A, r, loss, dL/dlogp), worked by hand:
AEPO_CASES = [
    # A>0, r=1.5 > 1.2: pg1 = -3, pg2 = -2*1.2 = -2.4, L = max = -2.4; grad -A(1+eps) = -2.4 (PPO: 0)
    (2.0, 1.5, -2.4, -2.4),
    # A<0, r=0.5 < 0.8: pg1 = 0.5, pg2 = 0.8, L = 0.8 (constant) -> grad 0
    (-1.0, 0.5, 0.8, 0.0),
    # A<0, r=4 > c: pg1 = 4, pg2 = 1.2, max 4, dual clip min(4, 3) = 3 -> grad 0
    (-1.0, 4.0, 3.0, 0.0),
    # A<0, r=2 (above the clip, below c): L = max(2, 1.2) = 2, grad -A r = 2
    (-1.0, 2.0, 2.0, 2.0),
    # inside: A=1, r=1.1: L = -1.1, grad -A r = -1.1
    (1.0, 1.1, -1.1, -1.1),
    # A>0, r=0.5 < 0.8: pg1 = -0.5 > pg2 = -0.8, L = -0.5, grad -A r = -0.5
    (1.0, 0.5, -0.5, -0.5),
]


@pytest.mark.parametrize("advantage,ratio,value,grad", AEPO_CASES)
def test_aepo_clip_branches_hand_worked(advantage, ratio, value, grad):
    loss, g, ref_loss, ref_g = _token_value_and_grad("aepo", advantage, ratio)
    assert loss == pytest.approx(value, abs=1e-9) and ref_loss == pytest.approx(value, abs=1e-6)
    assert g == pytest.approx(grad, abs=1e-9) and ref_g == pytest.approx(grad, abs=1e-6)


@pytest.mark.parametrize(
    "clip,advantage,ratio,value,grad",
    [
        ("ppo", 2.0, 1.5, -2.4, 0.0),  # PPO: clipped region has no gradient
        ("ppo", -1.0, 4.0, 3.0, 0.0),
        ("gppo", 2.0, 1.5, -2.4, -2.4),  # gradient-preserving high bound, like aepo
        ("gppo", -1.0, 0.5, 0.8, 0.8),  # ... and low bound: -A (1 - eps) = 0.8
        # cispo: L = -sg(clip(r)) A logp; A=2, r=1.5 -> w = 1.2, L = -2.4 ln 1.5 = -0.973116, grad -2.4
        ("cispo", 2.0, 1.5, -2.4 * math.log(1.5), -2.4),
        # cispo, A=-1, r=0.5 -> w = 0.8, L = 0.8 ln 0.5 = -0.554518, grad 0.8
        ("cispo", -1.0, 0.5, 0.8 * math.log(0.5), 0.8),
    ],
)
def test_other_clip_rules_hand_worked(clip, advantage, ratio, value, grad):
    loss, g, ref_loss, ref_g = _token_value_and_grad(clip, advantage, ratio)
    assert loss == pytest.approx(value, abs=1e-6) and ref_loss == pytest.approx(value, abs=1e-6)
    assert g == pytest.approx(grad, abs=1e-6) and ref_g == pytest.approx(grad, abs=1e-6)


def test_entropy_aware_advantage_hand_worked():
    # H = (1, 2, 3, 99 masked): mean 2, population std sqrt(2/3) = 0.816497;
    # alpha 0.2, A = 1: A_t = 1 + 0.2 * (-1.224745, 0, 1.224745) = (0.755051, 1, 1.244949)
    entropy = torch.tensor([1.0, 2.0, 3.0, 99.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    shaped = entropy_aware_advantages(torch.ones(4), entropy, mask, alpha=0.2)
    torch.testing.assert_close(shaped[:3], torch.tensor([0.755051, 1.0, 1.244949]))
    # std 0 -> 1: all-equal entropies leave the advantages unchanged.
    flat = entropy_aware_advantages(torch.full((3,), -2.0), torch.full((3,), 5.0), torch.ones(3), alpha=0.2)
    torch.testing.assert_close(flat, torch.full((3,), -2.0))


def test_kl_and_entropy_bonus():
    # k3 KL with ref - logp = 0.5: e^0.5 - 0.5 - 1 = 0.148721; coefficient 0.1 adds 0.0148721.
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, **NO_SHAPING)
    logp = torch.tensor([-1.0], requires_grad=True)
    entropy = torch.tensor([2.0], requires_grad=True)
    loss, stats = policy_loss_from_logprobs(
        logp, entropy, torch.tensor([-1.0]), torch.tensor([1.0]), torch.ones(1), config=cfg, ref_logprobs=torch.tensor([-0.5])
    )
    # pg = -A r = -1; + 0.0148721; - 0.01 * 2
    assert loss.item() == pytest.approx(-1 + 0.0148721 - 0.02, abs=1e-6)
    assert stats["kl"].item() == pytest.approx(0.148721, abs=1e-6)
    (g_h,) = torch.autograd.grad(loss, entropy)
    assert g_h.item() == pytest.approx(-0.01)  # the entropy gradient is real
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss_from_logprobs(logp, entropy, logp, logp, torch.ones(1), config=cfg)


def test_stats_hand_worked():
    # 4 valid tokens: A>0 r=1.5 (high clip), A<0 r=0.5 (low clip), A<0 r=4 (low? no: dual), inside.
    ratios = torch.tensor([1.5, 0.5, 4.0, 1.0, 9.0])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    _, stats = policy_loss_from_logprobs(
        ratios.log(), torch.arange(5.0), torch.zeros(5), adv, mask, config=LossConfig(**NO_SHAPING)
    )
    assert stats["clipfrac_high"].item() == 0.25
    assert stats["clipfrac_low"].item() == 0.25
    assert stats["clipfrac_dual"].item() == 0.25
    assert stats["entropy"].item() == pytest.approx(1.5)  # mean of 0, 1, 2, 3
    assert stats["num_tokens"].item() == 4
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())


def _batch(seed, batch=4, seq=16, vocab=97, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    old = torch.log_softmax(logits.float() + 0.8 * torch.randn(batch, seq, vocab, generator=gen), -1)
    old_logprobs = old.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    advantages = torch.rand(batch, generator=gen) * torch.tensor([1.0, -1.0]).repeat(batch // 2)  # both signs
    mask = (torch.rand(batch, seq, generator=gen) > 0.25).float()
    mask[1] = 0  # a fully masked sequence
    return logits, labels, old_logprobs, advantages, mask


BACKENDS = ["torch"] + (["triton"] if triton_available() else [])


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("clip", ["ppo", "aepo", "gppo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_full_loss_matches_reference(backend, clip, aggregation):
    cfg = LossConfig(clip=clip, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)
    logits, labels, old, adv, mask = _batch(seed=len(clip) + len(aggregation))
    ref_logp = old + 0.1
    z1, z2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, stats = aepo_policy_loss(z1, labels, old, adv, mask, config=cfg, temperature=0.8, backend=backend, ref_logprobs=ref_logp, shift_labels=False)
    assert stats["clipfrac_high"] > 0 and stats["clipfrac_low"] > 0  # the clip branches are exercised
    ref = aepo_loss_reference(z2, labels, old, adv.unsqueeze(-1).expand_as(old), mask, cfg, 0.8, ref_logprobs=ref_logp)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(z1.grad, z2.grad, atol=1e-7, rtol=1e-4)


def test_micro_batch_invariance_with_global_statistics():
    """1 batch of 8 sequences == 4 micro-batches of 2, with the global token count and the
    all-reduced entropy moments (what the trainer does across micro-batches and ranks)."""
    cfg = LossConfig()  # aepo clip, entropy advantage on
    logits, labels, old, adv, mask = _batch(seed=7, batch=8)
    whole = logits.clone().requires_grad_()
    loss, _ = aepo_policy_loss(whole, labels, old, adv, mask, config=cfg, shift_labels=False)
    loss.backward()

    with torch.no_grad():  # pass 1: statistics (the trainer all-reduces these)
        from aepo_kernels import logprob_entropy

        _, entropy = logprob_entropy(logits, labels, shift_labels=False)
        mean, std = entropy_stats_from_moments(sum(entropy_moments(entropy[i : i + 2], mask[i : i + 2]) for i in range(0, 8, 2)))
    split = logits.clone().requires_grad_()
    total = 0.0
    for i in range(0, 8, 2):
        part, _ = aepo_policy_loss(
            split[i : i + 2], labels[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], config=cfg,
            entropy_mean=mean, entropy_std=std, global_token_count=mask.sum(), shift_labels=False,
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, loss.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split.grad, whole.grad, atol=1e-8, rtol=1e-5)

    # Without the supplied statistics the micro-batch result differs (the reference code's defect).
    local, _ = aepo_policy_loss(logits[:2], labels[:2], old[:2], adv[:2], mask[:2], config=cfg, global_token_count=mask.sum(), shift_labels=False)
    with_global, _ = aepo_policy_loss(
        logits[:2], labels[:2], old[:2], adv[:2], mask[:2], config=cfg, entropy_mean=mean, entropy_std=std, global_token_count=mask.sum(), shift_labels=False
    )
    assert not torch.allclose(local, with_global)


def test_module_and_config_validation():
    module = AEPOLoss(LossConfig(clip="ppo", entropy_adv_alpha=0.0), temperature=1.0, backend="torch", shift_labels=False)
    logits, labels, old, adv, mask = _batch(seed=9)
    loss, stats = module(logits, labels, old, adv, mask)
    assert loss.dim() == 0 and "clipfrac_high" in stats
    with pytest.raises(ValueError, match="clip"):
        LossConfig(clip="ppo2")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=1.1)
    with pytest.raises(ValueError, match="needs \\[B, T\\]"):
        policy_loss_from_logprobs(
            torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3),
            config=LossConfig(aggregation="seq-mean-token-mean"),
        )


def test_token_loss_compiles_fullgraph():
    cfg = LossConfig(kl_coef=0.0)
    logp = torch.randn(64, requires_grad=True)
    args = (torch.rand(64) * 3, torch.randn(64), torch.randn(64), (torch.rand(64) > 0.3).float())
    compiled = torch.compile(lambda *a: policy_loss_from_logprobs(*a, config=cfg)[0], fullgraph=True)
    got = compiled(logp, *args)
    expected = policy_loss_from_logprobs(logp, *args, config=cfg)[0]
    torch.testing.assert_close(got, expected)
