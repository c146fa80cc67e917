"""Token entropy: exact from full logits, and bounds/estimates from top-k log-probs only.

vLLM returns, per generated position, only the k largest log-probs of the sampling distribution
(k <= 20). AEPO's branching decisions need the entropy H = -sum_v p_v log p_v (docs/algorithm.md §0, §1d).

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

Point estimate (default ``"powerlaw"``): continue the top-k as a power law,
    q_i = p_k (i / k)^(-s),  i = k+1..V,  with s >= 0 solved (bisection) so that sum_i q_i = r.
This tail is continuous at the boundary, decreasing (hence feasible: q_i <= p_min) and carries
exactly the leftover mass, so the estimate lies in [lower, upper] (clamped against bucketing
rounding) and its error is never larger than the bound gap. LM next-token distributions have
roughly power-law tails; on exact Zipf rows the estimate is exact to ~1e-4 nats. Alternatives:
``"upper"`` charges the leftover mass log((V-k)/r) nats per unit — with V = 151,936 about 12 —
and badly over-estimates peaked rows; ``"lower"`` under-estimates flat ones; ``"mid"`` (the
midpoint) has error <= gap/2. ``bench/bench_entropy_estimator.py`` measures all of them on a
tiny model's distributions and on noisy Zipf-like rows with V = 151,936 (mean |error| at k = 20:
powerlaw 0.003-0.06 nats, mid 0.01-1.1).

Under top_p < 1 the backends report log-probs of the *truncated, renormalised* distribution (the
one sampled from); the same formulas hold with tokens outside the nucleus at probability 0.
"""
from __future__ import annotations

from typing import Literal

import torch

EstimateMode = Literal["powerlaw", "mid", "upper", "lower", "truncated"]


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


def _tail_buckets(k: int, vocab_size: int, n_buckets: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks k+1..V grouped into log-spaced buckets: (count n_j, representative rank rho_j)."""
    edges = torch.unique(torch.round(torch.logspace(
        torch.log10(torch.tensor(k + 1.0)), torch.log10(torch.tensor(vocab_size + 1.0)),
        n_buckets + 1, dtype=torch.float64)))  # [M + 1] integer rank edges, e_0 = k + 1
    counts = edges[1:] - edges[:-1]  # [M]
    rep = torch.sqrt(edges[:-1] * (edges[1:] - 1))  # geometric mean of first/last rank; exact for 1
    return counts, rep


def powerlaw_tail_entropy(p_min: torch.Tensor, rest: torch.Tensor, k: int, vocab_size: int,
                          iters: int = 48) -> torch.Tensor:
    """Tail entropy when the tail continues the top-k as a power law.

    Model: q_i = p_k (i / k)^(-s) for ranks i = k+1..V — continuous at the boundary, decreasing
    (so q_i <= p_min as required), with s >= 0 chosen by bisection so that sum_i q_i = r exactly.
    m(0) = p_k (V - k) >= r always, and m(s) decreases to 0, so a root exists. Sums over ranks
    use log-spaced buckets (relative error ~1e-4).

    Args:
        p_min, rest: [...] float64 p_k and leftover mass r.
    Returns:
        [...] float64 -sum_i q_i log q_i.
    """
    counts, rep = _tail_buckets(k, vocab_size)
    log_counts, log_ratio = counts.log(), (rep / k).log()  # [M]
    ok = (rest > 0) & (p_min > 0)
    log_pk = torch.where(ok, p_min, torch.ones_like(p_min)).log()[..., None]  # [..., 1]
    log_r = torch.where(ok, rest, torch.ones_like(rest)).log()[..., None]
    # the first tail rank alone has mass p_k ((k+1)/k)^-s: beyond this s the total is < r
    lo = torch.zeros_like(log_pk)
    hi = ((log_pk - log_r).clamp(min=0) + float(log_counts.max())) / float(log_ratio[0]) + 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        log_mass = log_pk[..., 0] + torch.logsumexp(log_counts - mid * log_ratio, dim=-1)
        too_much = (log_mass > log_r[..., 0])[..., None]
        lo, hi = torch.where(too_much, mid, lo), torch.where(too_much, hi, mid)
    s = 0.5 * (lo + hi)
    log_q = log_pk - s * log_ratio  # [..., M]
    log_q = log_q + log_r - torch.logsumexp(log_counts + log_q, -1, keepdim=True)  # exact mass r
    tail = -(counts * log_q.exp() * log_q).sum(-1)
    return torch.where(ok, tail, torch.zeros_like(tail))


def topk_entropy_estimate(
    topk_logprobs: torch.Tensor, vocab_size: int, mode: EstimateMode = "powerlaw"
) -> torch.Tensor:
    """Estimate the entropy of a distribution from its top-k log-probs.

    Args:
        topk_logprobs: [..., k] log-probs of the k most likely tokens of the distribution.
        vocab_size: V, the size of the distribution's support.
        mode: ``"powerlaw"`` (default: power-law tail with the exact leftover mass, inside the
            bounds), ``"mid"`` (midpoint of the bounds, error <= half the bound gap),
            ``"upper"`` (uniform tail, an upper bound), ``"lower"`` (most concentrated tail, a
            lower bound), ``"truncated"`` (-sum over the top-k only, the reference code's
            quantity before its log V normalisation; also a lower bound, and a loose one).
    Returns:
        [...] entropy estimates in nats (float32).
    """
    if mode == "truncated":
        return entropy_from_logprobs(topk_logprobs.double()).float()
    lower, upper = topk_entropy_bounds(topk_logprobs, vocab_size)
    if mode == "powerlaw":
        logp = topk_logprobs.double()
        k = logp.shape[-1]
        if vocab_size <= k:
            return lower
        p = logp.exp()
        h_top = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
        rest = (1.0 - p.sum(-1)).clamp(min=0.0)
        estimate = (h_top + powerlaw_tail_entropy(p.min(-1).values, rest, k, vocab_size)).float()
        return torch.minimum(torch.maximum(estimate, lower), upper)  # bucketing rounding only
    if mode == "lower":
        return lower
    if mode == "upper":
        return upper
    if mode == "mid":
        return 0.5 * (lower + upper)
    raise ValueError(f"unknown mode {mode!r}; expected powerlaw, mid, upper, lower or truncated")
