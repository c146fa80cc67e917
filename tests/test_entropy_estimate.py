"""Top-k entropy bounds/estimates against exact entropy from full logits (no vLLM needed)."""
from __future__ import annotations

import math

import pytest
import torch

from aepo_engine.rollout.entropy import (
    entropy_from_logprobs, exact_entropy, topk_entropy_bounds, topk_entropy_estimate,
)


def _check_bounds(logits: torch.Tensor, k: int, temperature: float = 1.0) -> torch.Tensor:
    """Assert lower <= H <= upper, |mid - H| <= gap/2, estimate in bounds; return its abs error."""
    exact = exact_entropy(logits, temperature).double()
    topk = torch.log_softmax(logits.double() / temperature, -1).topk(k, dim=-1).values  # [..., k]
    lower, upper = topk_entropy_bounds(topk, logits.shape[-1])
    assert bool((lower.double() <= exact + 1e-4).all()), (lower - exact).max()
    assert bool((exact <= upper.double() + 1e-4).all()), (exact - upper).max()
    mid_err = (topk_entropy_estimate(topk, logits.shape[-1], "mid").double() - exact).abs()
    assert bool((mid_err <= (upper - lower).double() / 2 + 1e-4).all())
    estimate = topk_entropy_estimate(topk, logits.shape[-1])  # default: power-law tail
    assert bool(((lower <= estimate) & (estimate <= upper)).all())
    err = (estimate.double() - exact).abs()
    truncated = topk_entropy_estimate(topk, logits.shape[-1], "truncated").double()
    assert bool((truncated <= lower.double() + 1e-5).all())
    return err


def test_hand_worked_numbers():
    # p = (1/2, 1/4) known, r = 1/4 over V - k = 2 tokens, p_min = 1/4.
    # top: 1/2 ln2 + 1/4 ln4 = ln2.  upper tail: (1/4) ln(2 / (1/4)) = (1/4) ln 8.
    # lower tail: one token at 1/4 -> (1/4) ln 4.
    topk = torch.tensor([math.log(0.5), math.log(0.25)])
    lower, upper = topk_entropy_bounds(topk, vocab_size=4)
    assert lower.item() == pytest.approx(math.log(2) + 0.25 * math.log(4), abs=1e-6)
    assert upper.item() == pytest.approx(math.log(2) + 0.25 * math.log(8), abs=1e-6)
    # k = V: exact
    full = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1)
    lo, up = topk_entropy_bounds(full, 3)
    assert lo.item() == pytest.approx(entropy_from_logprobs(full).item(), abs=1e-6) == up.item()


@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0, 30.0])
def test_bounds_hold_on_random_logits(k, scale):
    gen = torch.Generator().manual_seed(k * 100 + int(scale * 10))
    logits = torch.randn(64, 1000, generator=gen) * scale
    _check_bounds(logits, k)


def test_bounds_hold_on_zipf_with_qwen_vocab():
    vocab = 151_936
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    for s in (0.8, 1.0, 1.2, 1.6):
        logits = (-s * ranks.log())[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
        err = _check_bounds(logits.float()[None], 20)
        assert err.item() < 2e-3  # an exact power law is the estimator's own model


def test_masked_tokens_and_degenerate_cases():
    logits = torch.tensor([[5.0, 1.0, float("-inf"), float("-inf"), 0.0]])
    _check_bounds(logits, 2)
    onehot = torch.log_softmax(torch.tensor([0.0, -1e4, -1e4, -1e4]), -1)
    lower, upper = topk_entropy_bounds(onehot[:1], 4)
    assert abs(lower.item()) < 1e-6 and abs(upper.item()) < 1e-3
    assert abs(topk_entropy_estimate(onehot[:1], 4).item()) < 1e-3
    with pytest.raises(ValueError):
        topk_entropy_estimate(onehot[:1], 4, "nope")


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_bounds_on_tiny_model_distributions(tmp_path, temperature):
    from transformers import AutoModelForCausalLM

    from aepo_engine.models import build_tiny_qwen3

    model = AutoModelForCausalLM.from_pretrained(build_tiny_qwen3(tmp_path / "m", seed=0, initializer_range=0.2))
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # [2, 48, V]
    for k in (5, 20):
        _check_bounds(logits, k, temperature)


def test_estimate_error_on_noisy_zipf_rows():
    """Quality guard (numbers from bench/bench_entropy_estimator.py): LM-like rows, V = 151,936."""
    vocab, gen = 151_936, torch.Generator().manual_seed(1)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    for s in (0.8, 1.0, 1.5):
        logits = -s * ranks.log() + 0.5 * torch.randn(8, vocab, generator=gen)  # [8, V]
        err = _check_bounds(logits, 20)
        assert err.mean().item() < 0.15, (s, err)
