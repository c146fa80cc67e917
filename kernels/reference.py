"""Plain fp32 reference for the AEPO loss: docs/algorithm.md's maths as torch code, the test oracle.

Everything here is written for clarity, not speed: full ``[N, V]`` fp32 log-softmax and softmax,
autograd for every gradient, the clip rule written literally as in docs/algorithm.md §2c with
``torch.clamp`` and a stop-gradient, one loop-free expression per formula. The fast backends
(`aepo_kernels.logprob_entropy`, `aepo_kernels.policy_loss`) are tested against these functions.
"""
from __future__ import annotations

import torch

from .config import LossConfig


def logprob_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100,
    logit_scale: float = 1.0, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) and H_t of softmax(z_t / T) (docs/algorithm.md §0), fp32, differentiable in both.

    Args:
        logits: ``[..., V]`` any float dtype (fp64 stays fp64, for gradchecks).
        labels: ``[...]`` int; ``ignore_index`` rows get log-prob 0.
        logit_scale, softcap: the logits are first mapped z -> z * logit_scale, then
            z -> softcap * tanh(z / softcap) (when softcap is not None), then divided by T.
    Returns:
        ``(logprobs, entropy)``, both ``[...]`` fp32 (fp64 for fp64 logits).
    """
    z = (logits if logits.dtype == torch.float64 else logits.float()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    scaled = z / temperature
    log_p = torch.log_softmax(scaled, dim=-1)
    # -inf logits (masked vocabulary) have p = 0 and log p = -inf: their term of the entropy is 0.
    # log p is replaced before the product, not after: a where() after it would send 0 * inf =
    # NaN into the gradient.
    finite_log_p = torch.where(log_p > float("-inf"), log_p, torch.zeros_like(log_p))
    entropy = -(log_p.exp() * finite_log_p).sum(-1)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    logprobs = log_p.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logprobs, torch.zeros_like(logprobs)), entropy


def token_loss_reference(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    entropy_mean: torch.Tensor | None = None,
    entropy_std: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token loss ``L_t`` (before aggregation), docs/algorithm.md §2b-2c, written literally."""
    mask = loss_mask.float()
    if config.entropy_adv_alpha != 0.0:
        h = entropy.detach()
        if entropy_mean is None:
            count = mask.sum()
            entropy_mean = (h * mask).sum() / count
            entropy_std = (((h - entropy_mean) ** 2 * mask).sum() / count).sqrt()
        std = entropy_std if float(entropy_std) > 0 else torch.ones_like(entropy_std)
        advantages = advantages * (1 + config.entropy_adv_alpha * (h - entropy_mean) / std)

    log_ratio = torch.clamp(logprobs - old_logprobs, -config.log_ratio_clamp, config.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    low, high = 1 - config.eps_low, 1 + config.eps_high
    sg_unit = ratio / ratio.detach()  # value 1, gradient d ratio / ratio
    if config.clip == "cispo":
        weight = torch.clamp(ratio, low, high).detach()
        loss = -advantages * weight * logprobs
    else:
        low_bound = low * sg_unit if config.clip == "gppo" else torch.full_like(ratio, low)
        high_bound = high * sg_unit if config.clip in ("aepo", "gppo") else torch.full_like(ratio, high)
        pg1 = -advantages * ratio
        pg2 = -advantages * torch.clamp(ratio, low_bound, high_bound)
        loss = torch.max(pg1, pg2)
        if config.dual_clip != 0.0:
            dual = torch.min(loss, -advantages * config.dual_clip)
            loss = torch.where(advantages < 0, dual, loss)
    if config.kl_coef != 0.0 and ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        loss = loss + config.kl_coef * (torch.exp(delta) - delta - 1)
    if config.entropy_coef != 0.0:
        loss = loss - config.entropy_coef * entropy
    return loss


def aggregate_reference(
    token_loss: torch.Tensor, loss_mask: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """Aggregate ``[B, T]`` (or ``[N]`` for token-mean) per-token losses, docs/algorithm.md §2d."""
    mask = loss_mask.float()
    if config.aggregation == "token-mean":
        total = mask.sum()  # the weights' sum (1 when nothing is weighted: the sum above is 0)
        return (token_loss * mask).sum() / (total if total > 0 else 1.0)
    per_seq_sum = (token_loss * mask).sum(-1)
    if config.aggregation == "seq-mean-token-mean":
        lengths = mask.sum(-1)
        per_seq = per_seq_sum / torch.where(lengths > 0, lengths, torch.ones_like(lengths))
    else:  # seq-mean-token-sum-norm
        per_seq = per_seq_sum / (config.seq_norm_length or token_loss.shape[-1])
    return per_seq.mean()


def aepo_loss_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    ref_logprobs: torch.Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The whole AEPO loss of one batch, statistics computed over this batch. Positions whose
    label is ``ignore_index`` have no target: they are out of the loss whatever ``loss_mask`` says."""
    logprobs, entropy = logprob_entropy_reference(logits, labels, temperature, ignore_index, logit_scale, softcap)
    loss_mask = loss_mask * (labels != ignore_index)
    token_loss = token_loss_reference(
        logprobs, entropy, old_logprobs, advantages, loss_mask, config, ref_logprobs=ref_logprobs
    )
    return aggregate_reference(token_loss, loss_mask, config)


def tree_loss_reference(
    node_logits: torch.Tensor,
    node_labels: torch.Tensor,
    node_old_logprobs: torch.Tensor,
    row_nodes: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    node_ref_logprobs: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The loss of a rollout tree (:mod:`aepo_kernels.tree_loss`) written as the rows it stands for:
    row b, position t reads the logits, label and old/reference log-probs of node
    ``row_nodes[b, t]`` (-1: no target), and :func:`aepo_loss_reference` takes the ``[B, T]`` rows.
    Nothing is folded: every occurrence is its own row, which is what the fold must equal.

    Args:
        node_logits: ``[N, V]``; node_labels, node_old_logprobs, node_ref_logprobs: ``[N]``.
        row_nodes: ``[B, T]`` long; advantages: ``[B]`` or ``[B, T]``; loss_mask: ``[B, T]``.
    """
    safe = row_nodes.clamp(min=0)
    labels = torch.where(row_nodes >= 0, node_labels[safe], torch.full_like(safe, ignore_index))
    ref = None if node_ref_logprobs is None else node_ref_logprobs[safe]
    return aepo_loss_reference(node_logits[safe], labels, node_old_logprobs[safe], advantages, loss_mask, config,
                               temperature, ref_logprobs=ref, ignore_index=ignore_index)
