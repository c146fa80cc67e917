"""Decoupled PPO (AReaL) through the one-pass kernels: the behaviour-to-proximal weight is exactly a
detached per-token weight, for every clip rule.

Asynchronous training samples a token with a behaviour policy (log-probs the engine reported) up
to eta versions older than the proximal policy (the trainer's log-probs at the start of the
update). The decoupled objective clips the ratio pi_theta / pi_prox by the rule and multiplies the
token's loss by w = min(pi_prox / pi_behav, C), detached. The engine feeds that weight to the
kernels as ``token_weights`` (``rollout_correction`` mode ``token_tis``); the claim is that this is
the decoupled objective for every rule, value and gradient. The reference below is written apart
from the kernels: float64, the per-token value of each rule and its derivative in logp written out
case by case (docs/algorithm.md §2c for aepo; PPO's, GPPO's and CISPO's cases alike), the gradient
to the logits assembled by hand as dL/dlogp * (onehot - p), no autograd.
"""
from __future__ import annotations

import pytest
import torch

from aepo_engine.training.rollout_correction import RolloutCorrectionConfig, rollout_correction
from aepo_kernels import CLIP_RULES, LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss

from conftest import triton_available

BACKENDS = ["torch", "reference"] + (["triton"] if triton_available() else [])


def _case(seed: int, batch: int = 4, seq: int = 11, vocab: int = 37, hidden: int = 12):
    """Three policies over one vocabulary: theta (being trained), the proximal one (theta at the start
    of the update: close to it) and the behaviour one (older: further away), tokens sampled from
    the behaviour policy. float64."""
    gen = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.6
    logits = hidden_states @ weight.T  # theta
    prox_logits = logits + 0.7 * torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    behav_logits = prox_logits + 0.9 * torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    labels = torch.multinomial(behav_logits.softmax(-1).view(-1, vocab), 1, generator=gen).view(batch, seq)
    pick = lambda z: torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0]  # noqa: E731
    mask = (torch.rand(batch, seq, generator=gen) > 0.25).double()
    signs = torch.tensor([1.0, -1.0] * batch, dtype=torch.float64)[:batch]  # both signs in every case
    advantages = signs * (torch.rand(batch, generator=gen, dtype=torch.float64) * 2 + 0.2)
    return hidden_states, weight, logits, labels, pick(prox_logits), pick(behav_logits), mask, advantages


def _rule_value_and_slope(rule: str, A: torch.Tensor, r: torch.Tensor, logp: torch.Tensor, cfg: LossConfig):
    """Per-token L_t and dL_t/dlogp_t of one clip rule, written out by cases (float64)."""
    low, high, c = 1 - cfg.eps_low, 1 + cfg.eps_high, cfg.dual_clip
    if rule == "cispo":
        weight = r.clamp(low, high)
        return -weight * A * logp, -weight * A
    value = torch.maximum(-A * r, -A * r.clamp(low, high))
    slope = torch.where((A > 0) & (r > high), torch.zeros_like(r), -A * r)  # PPO: flat above the high bound
    slope = torch.where((A < 0) & (r < low), torch.zeros_like(r), slope)
    if rule in ("aepo", "gppo"):  # gradient kept above the high bound: -A (1 + eps_high)
        slope = torch.where((A > 0) & (r > high), -A * high, slope)
    if rule == "gppo":  # ... and below the low bound: -A (1 - eps_low)
        slope = torch.where((A < 0) & (r < low), -A * low, slope)
    if c:
        dual = (A < 0) & (-A * r > -A * c)  # A < 0 and r > c: the loss is the constant -A c
        value = torch.where(dual, -A * c, value)
        slope = torch.where(dual, torch.zeros_like(r), slope)
    return value, slope


def decoupled_reference(logits, labels, prox, behav, advantages, mask, cfg: LossConfig, cap: float):
    """AReaL's decoupled loss (token-mean) and its gradient to the logits, float64 by hand."""
    logp_all = torch.log_softmax(logits, -1)
    probs = logp_all.exp()
    logp = logp_all.gather(-1, labels[..., None])[..., 0]
    entropy = -(probs * logp_all).sum(-1)
    valid = mask > 0
    mean = entropy[valid].mean()
    std = entropy[valid].std(correction=0)
    A = advantages[:, None] * (1 + cfg.entropy_adv_alpha * (entropy - mean) / std)  # §2b, H detached
    r = (logp - prox).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp).exp()
    w = (prox - behav).exp().clamp(max=cap)  # behaviour -> proximal, truncated, detached
    value, slope = _rule_value_and_slope(cfg.clip, A, r, logp, cfg)
    count = mask.sum()
    loss = (mask * w * value).sum() / count
    d_logp = mask * w * slope / count
    onehot = torch.nn.functional.one_hot(labels, logits.shape[-1]).double()
    return loss, d_logp[..., None] * (onehot - probs)


def _cases_hit(logits, labels, prox, adv, mask, cfg: LossConfig) -> list[bool]:
    """Which branches of the rules the data reaches: above/below the bounds with either sign, past the dual clip."""
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    r, A, valid = (logp - prox).exp(), adv[:, None].expand_as(logp), mask > 0
    regions = ((A > 0) & (r > 1 + cfg.eps_high), (A > 0) & (r < 1 - cfg.eps_low), (A < 0) & (r < 1 - cfg.eps_low),
               (A < 0) & (r > 1 + cfg.eps_high) & (r < cfg.dual_clip), (A < 0) & (r > cfg.dual_clip))
    return [bool((region & valid).any()) for region in regions]


@pytest.mark.parametrize("rule", CLIP_RULES)
def test_decoupled_weight_is_a_per_token_weight_for_every_rule(rule):
    cfg = LossConfig(clip=rule, eps_low=0.2, eps_high=0.28, dual_clip=1.8, entropy_adv_alpha=0.2)
    cap, hit, truncated = 1.5, [False] * 5, False
    for seed in range(3):
        h, w, logits, labels, prox, behav, mask, adv = _case(seed)
        expected, expected_grad = decoupled_reference(logits, labels, prox, behav, adv, mask, cfg, cap)
        weights, kept_mask, metrics = rollout_correction(prox, behav, mask, RolloutCorrectionConfig(mode="token_tis",
                                                                                                      threshold=cap))
        assert torch.equal(kept_mask, mask)
        hit = [a or b for a, b in zip(hit, _cases_hit(logits, labels, prox, adv, mask, cfg))]
        truncated = truncated or metrics["rollout_correction/truncated_share"] > 0
        for backend in BACKENDS:
            leaf = logits.float().requires_grad_()
            loss, _ = aepo_policy_loss(leaf, labels, prox.float(), adv.float(), mask.float(), config=cfg,
                                       backend=backend, token_weights=weights, shift_labels=False)
            loss.backward()
            torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-6, msg=f"{rule} {backend}")
            torch.testing.assert_close(leaf.grad.double(), expected_grad, rtol=1e-4, atol=2e-7,
                                       msg=f"{rule} {backend} gradient")
        hidden = h.float().requires_grad_()
        loss, _ = fused_linear_aepo_policy_loss(hidden, w.float(), labels, prox.float(), adv.float(), mask.float(),
                                                config=cfg, backend="torch", token_weights=weights, shift_labels=False)
        loss.backward()
        torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(hidden.grad.double(), expected_grad @ w, rtol=1e-4, atol=2e-6)
    assert all(hit) and truncated, (hit, truncated)  # every branch of the rules, and the cap, were exercised


def test_reference_tells_the_rules_apart_and_the_weight_matters():
    h, w, logits, labels, prox, behav, mask, adv = _case(0)
    losses = {}
    for rule in CLIP_RULES:
        cfg = LossConfig(clip=rule, eps_high=0.28, entropy_adv_alpha=0.2)
        losses[rule] = decoupled_reference(logits, labels, prox, behav, adv, mask, cfg, 2.0)
        plain = decoupled_reference(logits, labels, prox, prox, adv, mask, cfg, 2.0)  # behaviour = proximal
        assert not torch.allclose(plain[1], losses[rule][1])
    grads = [g for _, g in losses.values()]
    assert all(not torch.allclose(a, b) for i, a in enumerate(grads) for b in grads[i + 1:])


def test_on_policy_tokens_get_weight_one():
    # eta = 0 with the HF backend: behaviour = proximal up to float noise, so the correction is 1
    _, _, _, _, prox, _, mask, _ = _case(3)
    weights, _, metrics = rollout_correction(prox, prox.clone(), mask, RolloutCorrectionConfig(mode="token_tis"))
    assert torch.equal(weights, mask.float())
    assert metrics["rollout_correction/kl_k3"] == 0.0
