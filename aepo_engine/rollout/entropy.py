"""Token entropy: exact from full logits, and bounds/estimates from top-k log-probs only.

vLLM returns, per generated position, only the k largest log-probs of the sampling distribution
(k <= 20). AEPO's branching decisions need the entropy H = -sum_v p_v log p_v (spec §0, §1d).

Derivation. Let p_1 >= ... >= p_k be the top-k probabilities, S = sum_i p_i, r = 1 - S the mass
left on the other n = V - k tokens, and p_min = p_k. Split
    H = H_top + H_tail,    H_top = -sum_{i<=k} p_i log p_i   (known exactly)
    H_tail = -sum_{j>k} q_j log q_j,   sum_j q_j = r,  0 <= q_j <= p_min,  j = 1..n.
Entropy is Schur-concave, so over this constraint set
- the *upper bound* is the uniform tail (majorised by every other feasible tail):
      H_tail <= r log(n / r)
  (and, since each q_j <= p_min, this is attained only when r/n <= p_min, always true here);
- the *lower bound* is the most concentrated feasible tail (it majorises every other one):
  m = floor(r / p_min) tokens at p_min and one token with the rest rho = r - m p_min:
      H_tail >= -m p_min log p_min - rho log rho.
So  lower <= H <= upper  holds exactly for *any* distribution (up to float rounding), which the
tests check. The truncated entropy H_top that the reference code uses is below both.

Which point estimate? The upper bound charges the leftover mass log(V-k) nats per unit — with
V = 151,936 that is ~12 nats, so it badly over-estimates peaked distributions whose tail is
small-but-not-tiny; the lower bound under-estimates flat ones. The default ``"mid"`` returns the
midpoint of the two bounds, which is never further than (upper - lower)/2 from the truth (a
guaranteed error bar, returned by :func:`topk_entropy_bounds`). ``bench/bench_entropy_estimator.py``
measures the three on a tiny model's distributions and on Zipf-like ones with V = 151,936.

Under top_p < 1 the backends report log-probs of the *truncated, renormalised* distribution (the
one sampled from); the same formulas hold with tokens outside the nucleus at probability 0.
"""
from __future__ import annotations

from typing import Literal

import torch

EstimateMode = Literal["mid", "upper", "lower", "truncated"]


# ---------------------------------------------------------------------------------------------
def exact_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H(softmax(logits / T)) in float32 over the last dim.

    Args:
        logits: [..., V] raw logits (tokens masked out may be -inf).
        temperature: T > 0.
    Returns:
        [...] entropies in nats.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return entropy_from_logprobs(logp)


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dim of normalised log-probs; -inf entries contribute 0."""
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def topk_entropy_bounds(topk_logprobs: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper bounds on the entropy of a distribution from its k largest log-probs.

    Args:
        topk_logprobs: [..., k] log-probs of the k most likely tokens (any order; -inf allowed).
        vocab_size: V, the number of tokens the distribution is over (V > k).
    Returns:
        (lower, upper), each [...] in nats; lower <= H <= upper (see the module docstring).
    """
    logp = topk_logprobs.double()
    k = logp.shape[-1]
    n_tail = vocab_size - k
    if n_tail <= 0:  # the top-k is the whole distribution: exact
        h = entropy_from_logprobs(logp).float()
        return h, h
    p = logp.exp()
    h_top = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    rest = (1.0 - p.sum(-1)).clamp(min=0.0)  # r: float rounding can make it slightly negative
    p_min = p.min(-1).values.clamp(min=1e-300)
    upper_tail = torch.where(rest > 0, rest * (torch.log(torch.tensor(float(n_tail), dtype=rest.dtype)) - rest.log()), torch.zeros_like(rest))
    n_full = torch.floor(rest / p_min).clamp(max=n_tail)
    leftover = (rest - n_full * p_min).clamp(min=0.0)
    lower_tail = -n_full * p_min * p_min.log() - torch.where(leftover > 0, leftover * leftover.log(), torch.zeros_like(leftover))
    return (h_top + lower_tail).float(), (h_top + upper_tail).float()


def topk_entropy_estimate(
    topk_logprobs: torch.Tensor, vocab_size: int, mode: EstimateMode = "mid"
) -> torch.Tensor:
    """Estimate the entropy of a distribution from its top-k log-probs.

    Args:
        topk_logprobs: [..., k] log-probs of the k most likely tokens of the distribution.
        vocab_size: V, the size of the distribution's support.
        mode: ``"mid"`` (default: midpoint of the bounds, error <= half the bound gap),
            ``"upper"`` (uniform tail, an upper bound), ``"lower"`` (most concentrated tail, a
            lower bound), ``"truncated"`` (-sum over the top-k only, the reference code's
            quantity before its log V normalisation; also a lower bound, and a loose one).
    Returns:
        [...] entropy estimates in nats (float32).
    """
    if mode == "truncated":
        return entropy_from_logprobs(topk_logprobs.double()).float()
    lower, upper = topk_entropy_bounds(topk_logprobs, vocab_size)
    if mode == "lower":
        return lower
    if mode == "upper":
        return upper
    if mode == "mid":
        return 0.5 * (lower + upper)
    raise ValueError(f"unknown mode {mode!r}; expected mid, upper, lower or truncated")
