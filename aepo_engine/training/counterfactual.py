"""Counterfactual per-token gradients: what each AEPO loss mechanism changes, measured every step.

The loss of an optimizer step already holds, per token, the current log-prob ``logp_t``, the
entropy ``H_t``, the old log-prob, the (importance-weighted) advantage and the entropy z-score
statistics (the one-pass loss returns ``logp_t`` and ``H_t`` as rows; see ``return_token_loss`` in
:mod:`aepo_kernels.api`). From those alone, with no model pass, the per-token derivative
``g_t = dL_t/dlogp_t`` is evaluated again under other settings of the loss, through the kernels'
own per-token head (:func:`aepo_kernels.one_pass.token_head`, fed a modified hyper-parameter
vector), so the maths has one source. One mechanism is changed at a time, the rest stays as
configured:

- clip rule: ``ppo`` (PPO clip, constant bounds) vs ``aepo`` (stop-gradient high clip,
  docs/algorithm.md §2c);
- entropy-aware advantage (docs/algorithm.md §2b): ``alpha_H`` as configured, or the paper's 0.2
  (``LossConfig().entropy_adv_alpha``) when the configured one is 0, vs ``alpha_H = 0``.
Only the policy-gradient term is compared (KL and entropy bonus set to 0 in every variant).

High-entropy tokens are the top :data:`HIGH_ENTROPY_SHARE` of the step's valid tokens by the
old policy's entropy (``batch.entropy``, the trainer's no-grad pass): one threshold per
``update()`` (:func:`high_entropy_threshold`), so a token's class does not change between the
mini-batches and epochs of a step.

Per micro-batch :func:`token_sums` returns additive sums (token counts and gradient masses
``sum |g_t|``, float64) for all valid tokens and per token origin (``global``/``branch``, from
``batch.token_origin``); the worker all-reduces them with its other statistics and
:func:`summarise` turns the update's sums into the logged shares (:data:`SHARES`):

``cf/high_kept_frac``: the share of high-entropy tokens whose gradient PPO zeroes and AEPO keeps
    (``g_ppo = 0``, ``g_aepo != 0``: an advantage > 0 with the ratio above ``1 + eps_high``);
``cf/high_kept_mass``: the share of AEPO's gradient mass on high-entropy tokens carried by those;
``cf/kept_frac``: the share of all tokens PPO zeroes and AEPO keeps; ``cf/kept_high_share``: the
    share of those that are high-entropy tokens;
``cf/adv_high_share_on`` / ``_off``: the share of the gradient mass on high-entropy tokens with
    the entropy-aware advantage on / off, and ``cf/adv_high_shift``, their difference;
``cf/adv_high_gain`` / ``cf/adv_low_gain``: how much the entropy-aware advantage multiplies the
    gradient mass of the high- / low-entropy tokens (on / off).
Each again as ``<name>/global`` and ``<name>/branch``; a share whose denominator is 0 in the
update is left out. Masses are per-token derivatives before the aggregation weight (token-mean:
the same 1/N for every token of a mini-batch, so shares are unaffected).

Left out: the gradient w.r.t. the parameters (it needs a backward pass per variant); GPPO's and
CISPO's rules (the issue asks for PPO vs AEPO; the configured rule may be either of those, the
variants are still PPO and AEPO).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from aepo_engine.training.batch import TOKEN_ORIGINS
from aepo_kernels import LossConfig
from aepo_kernels.config import hyper_params
from aepo_kernels.one_pass import token_head

__all__ = ["GROUPS", "HIGH_ENTROPY_SHARE", "SHARES", "SUMS", "high_entropy_threshold", "summarise", "token_sums",
           "variant_configs"]

HIGH_ENTROPY_SHARE = 0.2  # "high-entropy tokens": the top 20% of the step's entropies
# Additive per-group sums, in this order (all float64).
SUMS = ("tokens", "high", "kept", "kept_high", "mass_high", "kept_mass_high",
        "mass_on", "mass_on_high", "mass_off", "mass_off_high")
# Token groups: every valid token, then each token origin (global, branch).
GROUPS = ("all", *TOKEN_ORIGINS)
# Logged share -> (numerator, denominator) over SUMS, or a callable of the sums dict.
SHARES = {
    "high_kept_frac": ("kept_high", "high"),
    "high_kept_mass": ("kept_mass_high", "mass_high"),
    "kept_frac": ("kept", "tokens"),
    "kept_high_share": ("kept_high", "kept"),
    "adv_high_share_on": ("mass_on_high", "mass_on"),
    "adv_high_share_off": ("mass_off_high", "mass_off"),
}


def variant_configs(config: LossConfig) -> dict[str, LossConfig]:
    """The four loss settings compared: ``ppo`` / ``aepo`` (clip rule changed, advantage shaping as
    configured) and ``adv_on`` / ``adv_off`` (alpha_H changed, clip rule as configured); KL and
    entropy bonus off in all."""
    base = dataclasses.replace(config, kl_coef=0.0, entropy_coef=0.0)
    alpha_on = config.entropy_adv_alpha or LossConfig().entropy_adv_alpha
    return {"ppo": dataclasses.replace(base, clip="ppo"), "aepo": dataclasses.replace(base, clip="aepo"),
            "adv_on": dataclasses.replace(base, entropy_adv_alpha=alpha_on),
            "adv_off": dataclasses.replace(base, entropy_adv_alpha=0.0)}


def high_entropy_threshold(entropy: Tensor, loss_mask: Tensor, share: float = HIGH_ENTROPY_SHARE) -> Tensor:
    """The entropy at or above which a valid token is among the top ``share`` of the step.

    Args:
        entropy: ``[B, L]`` per-token entropies (the old policy's); loss_mask: ``[B, L]``, 1 on valid tokens.
        share: the fraction of tokens called high-entropy, in (0, 1).
    Returns:
        0-d float32 tensor: the ``1 - share`` quantile (linear interpolation) of the valid tokens'
        entropies; +inf when there is no valid token (then no token is high-entropy).
    """
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share}")
    if entropy.shape != loss_mask.shape:
        raise ValueError(f"entropy {tuple(entropy.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    values = entropy[loss_mask > 0].float()
    if values.numel() == 0:
        return torch.tensor(float("inf"), device=entropy.device)
    return torch.quantile(values, 1.0 - share)


def token_sums(logp: Tensor, entropy: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
               old_entropy: Tensor, threshold: Tensor, origin_masks: dict[str, Tensor] | None,
               config: LossConfig, entropy_mean: Tensor, entropy_std: Tensor) -> Tensor:
    """The additive sums of one micro-batch (module docstring).

    Args:
        logp, entropy: ``[b, l]`` the current log-probs and entropies the loss computed.
        old_logp, advantages, loss_mask: ``[b, l]`` what the loss was given (advantages per token,
            importance weights folded in).
        old_entropy: ``[b, l]`` the old policy's entropies (high-entropy class, with ``threshold``).
        threshold: 0-d, from :func:`high_entropy_threshold` over the step.
        origin_masks: ``{"global": [b, l] bool, "branch": ...}`` or None (then those groups are 0).
        config: the configured loss; entropy_mean, entropy_std: the z-score statistics the loss used.
    Returns:
        ``[len(GROUPS) * len(SUMS)]`` float64: group-major, :data:`SUMS` order within a group.
    """
    f32 = lambda t: t.detach().float()  # noqa: E731
    logp, entropy, old_logp, advantages = f32(logp), f32(entropy), f32(old_logp), f32(advantages)
    stats = (f32(entropy_mean).to(logp.device), f32(entropy_std).to(logp.device))
    # dL_t/dlogp_t of each setting per token (the kernels' token head; no reference log-probs)
    grads = {name: token_head(logp, entropy, old_logp, advantages, old_logp, *stats,
                              hyper_params(cfg, False, torch.float32, logp.device))[1]
             for name, cfg in variant_configs(config).items()}
    valid = loss_mask > 0
    high = valid & (f32(old_entropy) >= threshold)
    kept = valid & (grads["ppo"] == 0) & (grads["aepo"] != 0)
    mass = {name: g.abs().double() for name, g in grads.items()}
    out = []
    for group in GROUPS:
        if group == "all":
            member = valid
        elif origin_masks is not None and group in origin_masks:
            member = valid & origin_masks[group].bool()
        else:
            member = torch.zeros_like(valid)
        in_high, in_kept = member & high, member & kept
        out += [member.sum(), in_high.sum(), in_kept.sum(), (in_kept & high).sum(),
                (mass["aepo"] * in_high).sum(), (mass["aepo"] * (in_kept & high)).sum(),
                (mass["adv_on"] * member).sum(), (mass["adv_on"] * in_high).sum(),
                (mass["adv_off"] * member).sum(), (mass["adv_off"] * in_high).sum()]
    return torch.stack([x.double() for x in out])


def summarise(sums: Tensor | list[float]) -> dict[str, float]:
    """The logged shares of an update from its summed :func:`token_sums` (module docstring).

    Args:
        sums: ``[len(GROUPS) * len(SUMS)]``, summed over the update's micro-batches and ranks.
    Returns:
        ``cf/<share>`` for all tokens and ``cf/<share>/<origin>`` per origin; a share whose
        denominator is 0 is left out.
    """
    values = [float(x) for x in sums]
    if len(values) != len(GROUPS) * len(SUMS):
        raise ValueError(f"expected {len(GROUPS) * len(SUMS)} sums, got {len(values)}")
    out = {}
    for g, group in enumerate(GROUPS):
        s = dict(zip(SUMS, values[g * len(SUMS):(g + 1) * len(SUMS)]))
        suffix = "" if group == "all" else f"/{group}"
        shares = {name: (s[num], s[den]) for name, (num, den) in SHARES.items()}
        shares["adv_high_gain"] = (s["mass_on_high"], s["mass_off_high"])
        shares["adv_low_gain"] = (s["mass_on"] - s["mass_on_high"], s["mass_off"] - s["mass_off_high"])
        for name, (num, den) in shares.items():
            if den > 0:
                out[f"cf/{name}{suffix}"] = num / den
        if f"cf/adv_high_share_on{suffix}" in out and f"cf/adv_high_share_off{suffix}" in out:
            shift = out[f"cf/adv_high_share_on{suffix}"] - out[f"cf/adv_high_share_off{suffix}"]
            out[f"cf/adv_high_shift{suffix}"] = shift
    return out
