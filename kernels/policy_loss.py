"""The AEPO policy loss on per-token log-probs and entropies (docs/algorithm.md §2b-2d).

The ``[N, V]`` work (log-probs and entropies from logits or from hidden states) is done once by
:func:`aepo_kernels.logprob_entropy` or :func:`aepo_kernels.fused_linear_logprob_entropy`; what is
left is elementwise over tokens (O(N) bytes, nothing next to the O(N V) pass) and stays plain
torch code, so autograd derives ``g_lp`` and ``g_H`` and hands them to the kernels' backward.

Pieces, each an independent choice of :class:`LossConfig`:
1. entropy-aware advantage ``A_t = A * (1 + alpha_H * zscore(H_t))`` with H detached; the z-score
   statistics are the call's own or supplied by the caller (global mean/std from
   :func:`entropy_moments` all-reduced), which makes the loss independent of micro-batching;
2. the ratio ``r = exp(clamp(logp - old_logp))`` and a clip rule (ppo / aepo / gppo / cispo);
3. optional k3 KL to reference log-probs and entropy bonus;
4. aggregation: token-mean (optionally over a caller-supplied global token count), seq-mean-
   token-mean, seq-mean-token-sum-norm.
Statistics come back as detached tensors: no ``.item()`` / host sync anywhere here.

:func:`aepo_kernels.aepo_policy_loss` and :func:`aepo_kernels.fused_linear_aepo_policy_loss`
compute the same loss in one pass over the logits (:mod:`aepo_kernels.one_pass`, whose
``token_head`` is this module's maths with explicit derivatives); this module is the loss for
callers that already hold per-token log-probs and entropies.

Gradient of the ``aepo`` rule w.r.t. logp (the change from PPO is the first line):
    A > 0, r > 1 + eps_high : -A (1 + eps_high)      (PPO: 0)
    A < 0, r < 1 - eps_low  : 0
    A < 0, r > c            : 0                        (dual clip)
    otherwise               : -A r
"""
from __future__ import annotations

import torch

from . import contract
from .config import LossConfig


def apply_token_weights(advantages: torch.Tensor, token_weights: torch.Tensor | None,
                        shape: torch.Size) -> torch.Tensor:
    """Advantages (per token ``shape``, or ``[B]`` per sequence of ``[B, T]``) times detached
    per-token weights ``token_weights`` (``shape``, >= 0; e.g. importance-sampling weights of the
    rollout/trainer mismatch), or unchanged when ``token_weights`` is None.

    Multiplying the advantage is exactly weighting the policy-gradient term of the token loss:
    every clip rule is positively homogeneous in A (a weight > 0 keeps its sign, hence the branch
    taken; 0 zeroes the term) and the entropy-aware shaping is a factor of A. The KL and entropy
    bonus terms are not weighted (as in TRL's and verl's IS corrections).
    """
    if token_weights is None:
        return advantages
    if token_weights.shape != shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must be shaped like the tokens {tuple(shape)}")
    if len(shape) >= 1 and advantages.dim() == len(shape) - 1:
        advantages = advantages.unsqueeze(-1)
    return advantages * token_weights.detach().to(advantages.dtype if advantages.is_floating_point() else torch.float32)


def weight_total(total: torch.Tensor) -> torch.Tensor:
    """A sum of mask weights as a divisor: itself when positive, 1 when nothing is weighted (the
    numerator is 0 then). Fractional weights summing below 1 are divided by their sum, not by 1:
    ``loss = sum_t w_t L_t / sum_t w_t`` (docs/library.md, "Masks are weights")."""
    return torch.where(total > 0, total, torch.ones_like(total))


MAX_LOG_RATIO = 80.0  # |log w| is clamped here first: exp(80) = 5.5e34 still fits float32


def decoupled_ppo_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                          loss_mask: torch.Tensor | None = None, cap: float | None = 2.0,
                          over_cap: str = "truncate") -> torch.Tensor:
    """Decoupled PPO's per-token weight on the policy-gradient term, ``w_t = pi_prox / pi_behav``
    (arXiv 2505.24298): the policy the update starts from (``proximal``: the trainer's log-probs
    before the update, the ``old_logprobs`` the ratio is clipped against) over the one that
    sampled the token (``behaviour``: the engine's, possibly some versions older). Pass the result
    as ``token_weights``: every clip rule's loss is positively homogeneous in the advantage, so a
    detached weight on it is exactly the decoupled objective (tests/test_decoupled_ppo.py).

    Args:
        proximal_logprobs, behaviour_logprobs: same shape, the sampled tokens' log-probs.
        loss_mask: where the weight counts (0 elsewhere); None: everywhere.
        cap: C > 1; None: no cap.
        over_cap: ``"truncate"`` -> ``min(w, C)`` (truncated IS, the engine's ``token_tis``);
            ``"drop"`` -> 0 where ``w > C`` (AReaL's ``behav_imp_weight_cap``).
    Returns:
        Detached float32 weights shaped like the inputs (computed in float64, ``|log w|`` clamped
        at :data:`MAX_LOG_RATIO`).
    """
    if proximal_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"decoupled_ppo_weights: proximal_logprobs {list(proximal_logprobs.shape)} and "
                         f"behaviour_logprobs {list(behaviour_logprobs.shape)} differ in shape")
    if cap is not None and not cap > 1.0:
        raise ValueError(f"decoupled_ppo_weights: cap must be > 1 (or None), got {cap}")
    if over_cap not in ("truncate", "drop"):
        raise ValueError(f"decoupled_ppo_weights: over_cap must be 'truncate' or 'drop', got {over_cap!r}")
    mask = torch.ones_like(proximal_logprobs, dtype=torch.bool) if loss_mask is None else loss_mask > 0
    log_w = (proximal_logprobs.detach().double() - behaviour_logprobs.detach().double())
    w = torch.where(mask, log_w, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    if cap is not None:
        w = w.clamp(max=cap) if over_cap == "truncate" else torch.where(w > cap, 0.0, w)
    return torch.where(mask, w, 0.0).float()


def entropy_moments(entropy: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64 ``(sum H, sum H^2, count)`` over valid tokens, detached.

    All-reduce (sum) these over micro-batches and ranks, then call
    :func:`entropy_stats_from_moments` to get statistics that do not depend on the split.
    """
    h = entropy.detach().double()
    mask = loss_mask.double()
    return torch.stack([(h * mask).sum(), (h * h * mask).sum(), mask.sum()])


def entropy_stats_from_moments(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` (population std, fp32 scalars) from :func:`entropy_moments` output."""
    total, total_sq, count = moments.unbind()
    count = weight_total(count)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp(min=0)
    return mean.float(), var.sqrt().float()


def entropy_aware_advantages(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    alpha: float,
    entropy_mean: torch.Tensor | None = None,
    entropy_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """docs/algorithm.md §2b: ``A_t = A * (1 + alpha * (H_t - mean) / std)``, H detached, std 0 -> 1."""
    if alpha == 0.0:
        return advantages
    if entropy_mean is None or entropy_std is None:
        entropy_mean, entropy_std = entropy_stats_from_moments(entropy_moments(entropy, loss_mask))
    std = torch.where(entropy_std > 0, entropy_std, torch.ones_like(entropy_std))
    return advantages * (1 + alpha * (entropy.detach() - entropy_mean) / std)


def clipped_token_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss of the configured clip rule; returns ``(loss, ratio)``."""
    log_ratio = (logprobs - old_logprobs).clamp(-config.log_ratio_clamp, config.log_ratio_clamp)
    ratio = log_ratio.exp()
    low, high = 1.0 - config.eps_low, 1.0 + config.eps_high
    if config.clip == "cispo":
        return -advantages * ratio.clamp(low, high).detach() * logprobs, ratio
    # unit: value 1, gradient that of log r -- "bound * unit" is the stop-gradient bound of §2c.
    unit = (log_ratio - log_ratio.detach()).exp()
    high_bound = high * unit if config.clip in ("aepo", "gppo") else torch.full_like(ratio, high)
    low_bound = low * unit if config.clip == "gppo" else torch.full_like(ratio, low)
    clipped = torch.where(ratio > high, high_bound, torch.where(ratio < low, low_bound, ratio))
    pg_unclipped, pg_clipped = -advantages * ratio, -advantages * clipped
    loss = torch.where(pg_clipped > pg_unclipped, pg_clipped, pg_unclipped)
    if config.dual_clip != 0.0:
        dual = -advantages * config.dual_clip  # constant: no gradient through the dual clip
        loss = torch.where((advantages < 0) & (loss > dual), dual, loss)
    return loss, ratio


def aggregate(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    global_token_count: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar (docs/algorithm.md §2d).

    ``token-mean`` divides the masked sum by ``global_token_count`` when given (the number of
    valid tokens of the whole optimizer step, over all micro-batches and ranks), so that summing
    the losses (or gradients) of the parts gives exactly the whole-batch loss. Sequence-level
    modes need ``[B, T]`` inputs and divide by ``global_num_seqs`` (default B) the same way.
    """
    mask = loss_mask.to(token_loss.dtype)
    masked = token_loss * mask
    if config.aggregation == "token-mean":
        denom = weight_total(mask.sum()) if global_token_count is None else global_token_count
        return masked.sum() / denom
    if token_loss.dim() != 2:
        raise ValueError(f"aggregation={config.aggregation!r} needs [B, T] inputs, got {tuple(token_loss.shape)}")
    if config.aggregation == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / weight_total(mask.sum(-1))
    else:
        per_seq = masked.sum(-1) / (config.seq_norm_length or token_loss.shape[-1])
    denom = token_loss.shape[0] if global_num_seqs is None else global_num_seqs
    return per_seq.sum() / denom


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (values.detach().float() * mask).sum() / count


def loss_stats(entropy, ratio, advantages, loss_mask, config, kl, stats_masks=None) -> dict[str, torch.Tensor]:
    """Detached per-call statistics (means over this call's valid tokens), no host syncs.

    ``stats_masks`` (name -> mask shaped like ``loss_mask``) adds every statistic again over the
    valid tokens inside each mask, as ``<stat>/<name>`` (``num_tokens/<name>`` counts them), e.g.
    clip fractions of branched-trajectory tokens apart from the others; the loss is unchanged.
    """
    stats = _token_stats(entropy, ratio, advantages, loss_mask, config, kl)
    for name, extra in (stats_masks or {}).items():
        if extra.shape != loss_mask.shape:
            raise ValueError(f"stats mask {name!r} {tuple(extra.shape)} must be shaped like loss_mask "
                             f"{tuple(loss_mask.shape)}")
        part = _token_stats(entropy, ratio, advantages, loss_mask.float() * extra.float(), config, kl)
        stats.update({f"{key}/{name}": value for key, value in part.items()})
    return stats


def _token_stats(entropy, ratio, advantages, loss_mask, config, kl) -> dict[str, torch.Tensor]:
    mask = loss_mask.float()
    count = weight_total(mask.sum())
    pos, neg = advantages > 0, advantages < 0
    stats = {
        "entropy": _masked_mean(entropy, mask, count),
        "ratio": _masked_mean(ratio, mask, count),
        "clipfrac_high": _masked_mean(pos & (ratio > 1 + config.eps_high), mask, count),
        "clipfrac_low": _masked_mean(neg & (ratio < 1 - config.eps_low), mask, count),
        "num_tokens": mask.sum(),
    }
    if config.dual_clip != 0.0 and config.clip != "cispo":
        stats["clipfrac_dual"] = _masked_mean(neg & (ratio > config.dual_clip), mask, count)
    if kl is not None:
        stats["kl"] = _masked_mean(kl, mask, count)
    return stats


def _check(function, logprobs, entropy, old_logprobs, advantages, loss_mask, ref_logprobs, token_weights,
           stats_masks) -> None:
    """The contract (:mod:`aepo_kernels.contract`) for per-token inputs shaped like ``logprobs``."""
    if not isinstance(logprobs, torch.Tensor) or not logprobs.is_floating_point():
        given = logprobs.dtype if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise TypeError(f"{function}(): logprobs must be a floating-point tensor [N] or [B, T], got {given}")
    contract.check_loss_tokens(function, logprobs, "logprobs", dict(
        entropy=entropy, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask,
        ref_logprobs=ref_logprobs, token_weights=token_weights), stats_masks)


def policy_loss_from_logprobs(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig = LossConfig(),
    entropy_mean: torch.Tensor | None = None,
    entropy_std: torch.Tensor | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    stats_masks: dict[str, torch.Tensor] | None = None,
    return_token_loss: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AEPO loss given per-token ``logprobs`` and ``entropy`` (both ``[N]`` or ``[B, T]``).

    Args:
        old_logprobs: log-probs of the sampling (old) policy, shaped like ``logprobs``.
        advantages: per-token (shaped like ``logprobs``) or per-sequence (``[B]`` for ``[B, T]``).
        loss_mask: 1/True on tokens that count (model-written response tokens).
        entropy_mean, entropy_std: global z-score statistics (see :func:`entropy_moments`);
            computed over this call's valid tokens when omitted.
        global_token_count, global_num_seqs: normalizers of the aggregation (see :func:`aggregate`).
        ref_logprobs: reference-policy log-probs for the k3 KL (needed when ``kl_coef != 0``).
        token_weights: detached per-token weights of the policy-gradient term, shaped like
            ``logprobs`` (importance-sampling weights; see :func:`apply_token_weights`).
        stats_masks: name -> mask shaped like ``loss_mask``: the statistics again over each
            mask's valid tokens, as ``<stat>/<name>`` (the loss does not depend on them).
        return_token_loss: also put the detached per-token loss ``token_loss`` (L_t before
            aggregation, 0 where ``loss_mask`` is 0) in ``stats``.
    Returns:
        ``(loss, stats)``: a scalar and a dict of detached scalar tensors (+ ``token_loss``).
    """
    _check("policy_loss_from_logprobs", logprobs, entropy, old_logprobs, advantages, loss_mask, ref_logprobs,
           token_weights, stats_masks)
    advantages = apply_token_weights(advantages, token_weights, logprobs.shape)
    if advantages.dim() == logprobs.dim() - 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    shaped_adv = entropy_aware_advantages(
        advantages.float(), entropy, loss_mask, config.entropy_adv_alpha, entropy_mean, entropy_std
    )
    token_loss, ratio = clipped_token_loss(logprobs, old_logprobs.float(), shaped_adv, config)
    kl = None
    if ref_logprobs is not None:
        delta = ref_logprobs.float() - logprobs
        kl = delta.exp() - delta - 1
        if config.kl_coef != 0.0:
            token_loss = token_loss + config.kl_coef * kl
    if config.entropy_coef != 0.0:
        token_loss = token_loss - config.entropy_coef * entropy
    loss = aggregate(token_loss, loss_mask, config, global_token_count, global_num_seqs)
    stats = loss_stats(entropy, ratio, shaped_adv, loss_mask, config, kl, stats_masks)
    if return_token_loss:
        token_loss = token_loss.detach()
        stats["token_loss"] = torch.where(loss_mask != 0, token_loss, torch.zeros_like(token_loss))
    return loss, stats
