"""Per-token weights of the policy-gradient term (importance-sampling weights), through every
loss entry point, against a reference that multiplies the reference's per-token PG loss by the
weight and adds the unweighted KL and entropy-bonus terms."""
import dataclasses

import pytest
import torch

from aepo_kernels import (
    LossConfig, aepo_policy_loss, apply_token_weights, fused_linear_aepo_policy_loss, logprob_entropy,
    policy_loss_from_logprobs,
)
from aepo_kernels.reference import aggregate_reference, logprob_entropy_reference, token_loss_reference

from conftest import triton_available

BACKENDS = ["torch", "reference"] + (["triton"] if triton_available() else [])


def _inputs(seed, batch=3, seq=7, vocab=61, hidden=16):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    old = torch.log_softmax(h @ w.T + torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64), -1)
    old = old.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    adv = torch.randn(batch, generator=gen) * 2
    mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    weights = torch.rand(batch, seq, generator=gen) * 3
    weights[0, :2] = 0.0  # masked out by the correction (seq_mask / zero weight)
    ref = old + 0.2 * torch.randn(batch, seq, generator=gen)
    return h.float(), w.float(), labels, old, adv, mask, weights, ref


def _weighted_reference(logits, labels, old, adv, mask, weights, cfg, ref):
    """sum_t mask * (w_t * PG_t + kl_coef * KL_t - entropy_coef * H_t), aggregated."""
    logp, ent = logprob_entropy_reference(logits, labels)
    pg_cfg = dataclasses.replace(cfg, kl_coef=0.0, entropy_coef=0.0)
    adv = adv.unsqueeze(-1).expand_as(old)
    pg = token_loss_reference(logp, ent, old, adv, mask, pg_cfg)
    delta = ref - logp
    token = weights * pg + cfg.kl_coef * (delta.exp() - delta - 1) - cfg.entropy_coef * ent
    return aggregate_reference(token, mask, cfg)


@pytest.mark.parametrize("clip", ["ppo", "aepo", "gppo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_weights_scale_only_the_policy_gradient_term(clip, aggregation):
    h, w, labels, old, adv, mask, weights, ref = _inputs(1)
    cfg = LossConfig(clip=clip, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, eps_high=0.28)
    leaf = (h @ w.T).requires_grad_()
    expected = _weighted_reference(leaf, labels, old, adv, mask, weights, cfg, ref)
    expected.backward()
    for backend in BACKENDS:
        logits = (h @ w.T).requires_grad_()
        loss, _ = aepo_policy_loss(logits, labels, old, adv, mask, config=cfg, backend=backend,
                                   ref_logprobs=ref, token_weights=weights, shift_labels=False)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=backend)
        torch.testing.assert_close(logits.grad, leaf.grad, rtol=1e-4, atol=1e-6, msg=backend)
    # the logprob-level loss and the fused-linear loss take the same weights
    logits = (h @ w.T).requires_grad_()
    logp, ent = logprob_entropy(logits, labels, backend="torch", shift_labels=False)
    loss, _ = policy_loss_from_logprobs(logp, ent, old, adv, mask, config=cfg, ref_logprobs=ref, token_weights=weights)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    hidden = h.clone().requires_grad_()
    loss, _ = fused_linear_aepo_policy_loss(hidden, w, labels, old, adv, mask, config=cfg, backend="torch",
                                            ref_logprobs=ref, token_weights=weights, shift_labels=False)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, leaf.grad @ w, rtol=1e-4, atol=1e-6)


def test_unit_weights_change_nothing_and_weights_matter():
    h, w, labels, old, adv, mask, weights, ref = _inputs(2)
    logits = h @ w.T
    plain, _ = aepo_policy_loss(logits, labels, old, adv, mask, backend="torch", shift_labels=False)
    ones, _ = aepo_policy_loss(logits, labels, old, adv, mask, backend="torch", token_weights=torch.ones_like(old), shift_labels=False)
    weighted, _ = aepo_policy_loss(logits, labels, old, adv, mask, backend="torch", token_weights=weights, shift_labels=False)
    torch.testing.assert_close(ones, plain)
    assert not torch.allclose(weighted, plain)


def test_weights_are_detached_and_shape_checked():
    _, _, labels, old, adv, mask, weights, _ = _inputs(3)
    weights.requires_grad_()
    shaped = apply_token_weights(adv, weights, old.shape)
    assert shaped.shape == old.shape and not shaped.requires_grad
    with pytest.raises(ValueError, match="token_weights"):
        apply_token_weights(adv, weights[:, :-1], old.shape)
