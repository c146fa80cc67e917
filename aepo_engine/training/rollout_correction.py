"""Rollout/trainer mismatch correction: importance weights between the sampler and the trainer.

The backend that samples (vLLM: its own kernels, bf16, top-k log-probs) and the policy that is
trained score the same tokens differently. The PPO ratio is taken against ``old`` = the trainer's
log-probs before the update, but the tokens came from the ``rollout`` distribution; the
importance ratio ``rho = pi_old / pi_rollout`` corrects for that (truncated IS, as in verl's
rollout correction, TRL's ``vllm_importance_sampling_correction`` and OpenRLHF's TIS).

Modes (``RolloutCorrectionConfig.mode``), with ``log rho_t = old_t - rollout_t`` on model tokens:
- ``off``: weights 1; the metrics are still computed (they show whether correction is needed).
- ``token_tis``: ``w_t = min(rho_t, C)`` (token-level truncated IS).
- ``seq_tis``: ``w_t = min(rho_seq, C)`` for every token of the sequence, ``rho_seq`` the product
  of its token ratios (``sequence_ratio = "product"``) or their geometric mean (``"geometric"``,
  length-independent: a product over thousands of tokens leaves [1/C, C] for tiny per-token gaps).
- ``seq_mask``: sequences whose ``rho_seq`` leaves ``[1/C, C]`` are dropped (loss mask 0: they
  count in neither the loss nor its token normaliser); the others keep weight 1.

The weight multiplies the per-token policy-gradient term only (not the KL or entropy-bonus
terms), detached. Metrics (``rollout_correction/*``): mean and max of the ratio the mode uses,
the share of tokens truncated (TIS) or of sequences masked, and ``kl_k3`` = the k3 estimate of
KL(rollout || old) = mean over sampled tokens of ``rho - 1 - log rho`` (the tokens were drawn
from the rollout policy, so this is an unbiased, non-negative estimate).
"""
from __future__ import annotations

from typing import Literal

import msgspec
import torch
from torch import Tensor

__all__ = ["RolloutCorrectionConfig", "rollout_correction"]

# exp() of a log-ratio above this overflows float32; ratios are clipped to C long before.
_MAX_LOG_RATIO = 80.0


class RolloutCorrectionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Importance weights for the sampler/trainer log-prob gap (see the module docstring).

    Attributes:
        mode: "off", "token_tis" (per-token truncated IS), "seq_tis" (per-sequence truncated IS)
            or "seq_mask" (drop sequences whose ratio leaves [1/threshold, threshold]).
        threshold: C, the truncation cap of TIS and the band of seq_mask; > 1.
        sequence_ratio: how seq_tis / seq_mask form a sequence's ratio from its tokens: "product"
            (the exact sequence likelihood ratio) or "geometric" (its per-token geometric mean).
    """

    mode: Literal["off", "token_tis", "seq_tis", "seq_mask"] = "off"
    threshold: float = 2.0
    sequence_ratio: Literal["product", "geometric"] = "product"

    def __post_init__(self) -> None:
        if not self.threshold > 1.0:
            raise ValueError(f"threshold must be > 1 because it caps ratios from above (TIS) and "
                             f"bounds [1/threshold, threshold] (seq_mask), got {self.threshold}")


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                       config: RolloutCorrectionConfig) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """Importance weights, the loss mask to train with, and the metrics of one batch.

    Args:
        old_logprobs: ``[B, L]`` trainer log-probs of the sampled tokens (before the update).
        rollout_logprobs: ``[B, L]`` the sampler's log-probs of the same tokens.
        loss_mask: ``[B, L]`` 1 on model-written tokens.
        config: the correction.
    Returns:
        ``(weights, loss_mask, metrics)``: weights ``[B, L]`` float32 (None for ``off`` and
        ``seq_mask``, whose weights are all 1), the mask (rows zeroed by ``seq_mask``, else the
        input) and float metrics keyed ``rollout_correction/...``.
    """
    mask = loss_mask > 0
    log_rho = torch.where(mask, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    log_rho = log_rho.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho = log_rho.exp()
    tokens = mask.sum()
    metrics = {"rollout_correction/kl_k3": _mean(rho - 1 - log_rho, mask)}
    cap = config.threshold
    if config.mode in ("off", "token_tis"):
        metrics.update(_ratio_metrics(rho[mask]))
        if config.mode == "off":
            return None, loss_mask, metrics
        truncated = mask & (rho > cap)
        metrics["rollout_correction/truncated_share"] = float(truncated.sum()) / max(int(tokens), 1)
        weights = torch.where(mask, rho.clamp(max=cap), 0.0).float()
        return weights, loss_mask, metrics
    counts = mask.sum(-1)
    rows = counts > 0
    log_seq = log_rho.sum(-1)
    if config.sequence_ratio == "geometric":
        log_seq = log_seq / counts.clamp(min=1)
    seq_rho = log_seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    metrics.update(_ratio_metrics(seq_rho[rows]))
    if config.mode == "seq_tis":
        metrics["rollout_correction/truncated_share"] = _share(rows & (seq_rho > cap), rows)
        weights = torch.where(mask, seq_rho.clamp(max=cap).unsqueeze(-1), 0.0).float()
        return weights, loss_mask, metrics
    outside = rows & ((seq_rho > cap) | (seq_rho < 1.0 / cap))
    metrics["rollout_correction/masked_share"] = _share(outside, rows)
    return None, loss_mask * (~outside).unsqueeze(-1).to(loss_mask.dtype), metrics


def _ratio_metrics(values: Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {"rollout_correction/ratio_mean": 1.0, "rollout_correction/ratio_max": 1.0}
    return {"rollout_correction/ratio_mean": float(values.mean()),
            "rollout_correction/ratio_max": float(values.max())}


def _mean(values: Tensor, mask: Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _share(hit: Tensor, of: Tensor) -> float:
    return float(hit.sum()) / max(int(of.sum()), 1)
