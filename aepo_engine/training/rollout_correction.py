"""Behaviour-to-proximal correction: importance weights between the policy that sampled a token and
the policy the update starts from.

Two gaps have this one form. (1) The backend that samples (vLLM: its own kernels, bf16, top-k
log-probs) and the policy that is trained score the same tokens differently. (2) In asynchronous
training (``train.mode = "async"``, docs/async.md) a token may have been sampled by a policy up to
``train.max_staleness`` versions older than the one updated. Either way the PPO ratio is taken
against ``old`` = the trainer's log-probs at the start of the update (the *proximal* policy of
AReaL's decoupled PPO: what ``PolicyWorker.compute_logprobs`` computes), while the tokens came
from the *behaviour* distribution whose log-probs the engine reported (``rollout``); the
importance ratio ``rho = pi_old / pi_rollout`` corrects for that (truncated IS, as in verl's
rollout correction, TRL's ``vllm_importance_sampling_correction``, OpenRLHF's TIS, and AReaL's
decoupled objective ``w_t * clip-rule loss(pi_theta / pi_prox)`` with ``w_t = pi_prox / pi_behav``).
Every clip rule's per-token loss is positively homogeneous in the advantage, so the weight acts as
a detached factor on the advantage (``aepo_kernels.apply_token_weights``). Names: the *rollout
correction* is this procedure (and its config section); the weights it returns are the batch's
``token_weights``, the tensor the kernels take under that name, which there means any detached
per-token factor on the policy-gradient term (verl passes its ``rollout_is_weights``, TRL its vLLM
importance-sampling correction). The one-pass kernels need no second path (proved per rule
against a float64 reference of the decoupled objective in ``tests/test_decoupled_ppo.py``).

Modes (``RolloutCorrectionConfig.mode``), with ``log rho_t = old_t - rollout_t`` on model tokens:
- ``auto`` (the default): ``token_tis`` when tokens may be stale (``train.mode = "async"`` with
  ``max_staleness >= 1``: decoupled PPO), ``off`` otherwise (the sampler holds the trainer's weights).
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
from the rollout policy, so this is an unbiased, non-negative estimate). Given the tokens' origins
(``TokenBatch.token_origin``) and staleness (policy versions behind the updated one), the token
ratio's mean, max and truncated share are also reported per origin (``.../global``,
``.../branch`` for a branch's own tokens, ``.../inherited`` for the prefix it copied) and per
staleness (``.../stale0``, ``.../stale1``, ...).
"""
from __future__ import annotations

import torch
from torch import Tensor

from aepo_engine.training.batch import ORIGIN_BRANCH, ORIGIN_GLOBAL, ORIGIN_INHERITED
from aepo_engine.training.config import RolloutCorrectionConfig
from aepo_kernels.policy_loss import MAX_LOG_RATIO, decoupled_ppo_weights

__all__ = ["RolloutCorrectionConfig", "rollout_correction"]



# Token groups of the split ratio statistics: name -> the TokenBatch.token_origin value.
ORIGIN_GROUPS = {"global": ORIGIN_GLOBAL, "branch": ORIGIN_BRANCH, "inherited": ORIGIN_INHERITED}


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor,
                       config: RolloutCorrectionConfig, token_origin: Tensor | None = None,
                       staleness: Tensor | None = None) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """Importance weights, the loss mask to train with, and the metrics of one batch.

    Args:
        old_logprobs: ``[B, L]`` trainer log-probs of the sampled tokens (before the update: the
            proximal policy).
        rollout_logprobs: ``[B, L]`` the sampler's log-probs of the same tokens (the behaviour policy).
        loss_mask: ``[B, L]`` 1 on model-written tokens.
        config: the correction (``auto`` must be resolved first: :meth:`RolloutCorrectionConfig.resolved`).
        token_origin: ``[B, L]`` ``TokenBatch.token_origin``, for the per-origin ratio statistics.
        staleness: ``[B, L]`` long, versions between each token's sampler and the updated policy,
            for the per-staleness ratio statistics.
    Returns:
        ``(weights, loss_mask, metrics)``: weights ``[B, L]`` float32, the batch's
        ``token_weights`` (None for ``off`` and ``seq_mask``, whose weights are all 1), the mask
        (rows zeroed by ``seq_mask``, else the input) and float metrics keyed
        ``rollout_correction/...``.
    """
    if config.mode == "auto":
        raise ValueError("rollout_correction: resolve mode 'auto' for the run first (RolloutCorrectionConfig.resolved)")
    mask = loss_mask > 0
    log_rho = torch.where(mask, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    log_rho = log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    rho = log_rho.exp()
    tokens = mask.sum()
    metrics = {"rollout_correction/kl_k3": _mean(rho - 1 - log_rho, mask)}
    cap = config.threshold
    metrics.update(split_ratio_metrics(rho, mask, cap, token_origin, staleness))
    if config.mode in ("off", "token_tis"):
        metrics.update(_ratio_metrics(rho[mask]))
        if config.mode == "off":
            return None, loss_mask, metrics
        truncated = mask & (rho > cap)
        metrics["rollout_correction/truncated_share"] = float(truncated.sum()) / max(int(tokens), 1)
        return decoupled_ppo_weights(old_logprobs, rollout_logprobs, loss_mask, cap), loss_mask, metrics
    counts = mask.sum(-1)
    rows = counts > 0
    log_seq = log_rho.sum(-1)
    if config.sequence_ratio == "geometric":
        log_seq = log_seq / counts.clamp(min=1)
    seq_rho = log_seq.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    metrics.update(_ratio_metrics(seq_rho[rows]))
    if config.mode == "seq_tis":
        metrics["rollout_correction/truncated_share"] = _share(rows & (seq_rho > cap), rows)
        weights = torch.where(mask, seq_rho.clamp(max=cap).unsqueeze(-1), 0.0).float()
        return weights, loss_mask, metrics
    outside = rows & ((seq_rho > cap) | (seq_rho < 1.0 / cap))
    metrics["rollout_correction/masked_share"] = _share(outside, rows)
    return None, loss_mask * (~outside).unsqueeze(-1).to(loss_mask.dtype), metrics


def split_ratio_metrics(rho: Tensor, mask: Tensor, cap: float, token_origin: Tensor | None,
                        staleness: Tensor | None) -> dict[str, float]:
    """The token ratio's mean, max and share above ``cap`` per token origin and per staleness
    (groups with no token are left out)."""
    groups = {}
    if token_origin is not None:
        groups.update({name: mask & (token_origin == value) for name, value in ORIGIN_GROUPS.items()})
    if staleness is not None:
        for d in sorted(set(staleness[mask].tolist())):
            groups[f"stale{int(d)}"] = mask & (staleness == d)
    out = {}
    for name, where in groups.items():
        values = rho[where]
        if values.numel():
            out.update({f"rollout_correction/ratio_mean/{name}": float(values.mean()),
                        f"rollout_correction/ratio_max/{name}": float(values.max()),
                        f"rollout_correction/truncated_share/{name}": float((values > cap).double().mean())})
    return out


def _ratio_metrics(values: Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {"rollout_correction/ratio_mean": 1.0, "rollout_correction/ratio_max": 1.0}
    return {"rollout_correction/ratio_mean": float(values.mean()),
            "rollout_correction/ratio_max": float(values.max())}


def _mean(values: Tensor, mask: Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _share(hit: Tensor, of: Tensor) -> float:
    return float(hit.sum()) / max(int(of.sum()), 1)
