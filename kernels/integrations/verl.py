"""The AEPO policy loss in verl (tested with verl 0.9.1): ``policy_loss.loss_mode=aepo``.

Importing this module registers the policy loss ``aepo`` with ``@register_policy_loss`` and
makes verl's actor loss (``verl.workers.utils.losses.ppo_loss``) hand it the per-token entropy.
verl imports it by itself: ``setup.py`` declares it as a ``verl.plugins`` entry point, and
``import verl`` loads every such entry point in every process (driver and Ray workers), so
a run needs no user code, only the config::

    actor_rollout_ref.actor.policy_loss.loss_mode=aepo
    actor_rollout_ref.actor.calculate_entropy=True      # the entropy-aware advantage needs H_t

(verl logs a failed plugin import at debug level only; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns
the discovery off, then ``import aepo_kernels.integrations.verl`` does the same by hand.)

Where each AEPO option lives (one place each):
- verl's existing actor fields: ``clip_ratio_low``/``clip_ratio_high`` -> ``eps_low``/``eps_high``
  (``clip_ratio`` when they are null), ``clip_ratio_c`` -> ``dual_clip``, ``loss_agg_mode`` and
  ``loss_scale_factor`` -> the aggregation (below). verl keeps its own KL loss (``use_kl_loss``)
  and entropy bonus (``entropy_coeff``): ``ppo_loss`` adds them around the policy loss, so the
  AEPO loss never adds its own (``kl_coef = entropy_coef = 0``).
- The AEPO-only options are fields of :class:`AEPOPolicyLossConfig`, a subclass of verl's
  ``PolicyLossConfig`` (which rejects unknown keys). Their defaults apply when the config only
  says ``loss_mode=aepo``; to change them, make verl build the subclass and add the keys::

      actor_rollout_ref.actor.policy_loss._target_=aepo_kernels.integrations.verl.AEPOPolicyLossConfig
      +actor_rollout_ref.actor.policy_loss.entropy_adv_alpha=0.1
      +actor_rollout_ref.actor.policy_loss.clip=gppo

Aggregation: verl's normalisers map onto :func:`aepo_kernels.aggregate`'s. verl divides by the
global count and multiplies by ``dp_size`` because data-parallel gradients are averaged:
``token-mean`` -> token-mean over ``batch_num_tokens / dp_size``; ``token-sum`` -> token-mean
over ``1 / dp_size``; ``seq-mean-token-mean`` -> the same over ``global_batch_size / dp_size``
sequences (default: this call's sequences with a valid token); ``seq-mean-token-sum`` ->
``seq-mean-token-sum-norm`` with length 1; ``seq-mean-token-sum-norm`` -> the same with
``loss_scale_factor`` (default: the response length). ``rollout_is_weights`` become the loss's
``token_weights`` (they weight the policy-gradient term only, as in verl's own losses).

Entropy statistics: verl computes the per-token entropy in the same forward as the loss, so no
pass over the whole mini-batch exists before the first micro-batch's loss: the z-score of the
entropy-aware advantage uses this micro-batch's statistics (on this rank). Use
``ppo_micro_batch_size_per_gpu = ppo_mini_batch_size / dp`` (one micro-batch per mini-batch)
when the statistics must cover the rank's whole mini-batch. The project's own trainer does
better (global statistics); this is verl's structure, not a choice made here.
"""
from __future__ import annotations

import contextvars
import dataclasses
import sys
from dataclasses import dataclass

import torch
from verl.trainer.ppo.core_algos import register_policy_loss
from verl.workers.config import PolicyLossConfig

from ..config import LossConfig
from ..policy_loss import policy_loss_from_logprobs, weight_total

LOSS_NAME = "aepo"
# verl's aggregation modes -> (AEPO aggregation, fixed seq_norm_length or None)
_AGGREGATIONS = {
    "token-mean": ("token-mean", None),
    "token-sum": ("token-mean", None),
    "seq-mean-token-mean": ("seq-mean-token-mean", None),
    "seq-mean-token-sum": ("seq-mean-token-sum-norm", 1),
    "seq-mean-token-sum-norm": ("seq-mean-token-sum-norm", None),
}
# What the loss's refusals call verl's tensors (a bad input is named in the loss's words first).
_VERL_NAMES = ("policy_loss_from_logprobs's logprobs, old_logprobs, advantages, loss_mask, token_weights are verl's "
               "log_prob, old_log_prob, advantages, response_mask, rollout_is_weights")
# The padded per-token entropy of the micro-batch, set by the ppo_loss wrapper around the call.
_ENTROPY: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("aepo_entropy", default=None)


@dataclass
class AEPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the AEPO-only options (defaults: the project's,
    docs/algorithm.md §2).

    Args:
        clip: ratio clip rule, ``aepo`` (stop-gradient high clip) | ``ppo`` | ``gppo`` | ``cispo``.
        entropy_adv_alpha: alpha_H of ``A_t = A (1 + alpha_H zscore(H_t))``; 0 turns it off
            (and makes ``calculate_entropy`` unnecessary).
        log_ratio_clamp: ``log r`` is clamped to ``[-x, x]`` before ``exp`` (verl's vanilla: 20).
    """

    loss_mode: str = LOSS_NAME
    clip: str = LossConfig.clip
    entropy_adv_alpha: float = LossConfig.entropy_adv_alpha
    log_ratio_clamp: float = LossConfig.log_ratio_clamp

    def __post_init__(self):
        getattr(super(), "__post_init__", lambda: None)()
        LossConfig(clip=self.clip, entropy_adv_alpha=self.entropy_adv_alpha, log_ratio_clamp=self.log_ratio_clamp)


_AEPO_ONLY = {f.name: f.default for f in dataclasses.fields(AEPOPolicyLossConfig) if f.name in
              ("clip", "entropy_adv_alpha", "log_ratio_clamp")}


def loss_config_from_verl(config, loss_agg_mode: str) -> LossConfig:
    """The :class:`LossConfig` an actor config asks for (see the module docstring)."""
    if loss_agg_mode not in _AGGREGATIONS:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: the aepo loss maps {sorted(_AGGREGATIONS)}")
    aggregation, seq_norm_length = _AGGREGATIONS[loss_agg_mode]
    if aggregation == "seq-mean-token-sum-norm" and seq_norm_length is None:
        seq_norm_length = config.global_batch_info.get("loss_scale_factor") or config.get("loss_scale_factor")
    clip_ratio = config.get("clip_ratio", 0.2)
    eps_low, eps_high = config.get("clip_ratio_low"), config.get("clip_ratio_high")
    policy_loss = config.get("policy_loss") or {}
    options = {k: policy_loss.get(k, default) for k, default in _AEPO_ONLY.items()}
    return LossConfig(eps_low=clip_ratio if eps_low is None else eps_low,
                      eps_high=clip_ratio if eps_high is None else eps_high,
                      dual_clip=config.get("clip_ratio_c", 3.0), aggregation=aggregation,
                      seq_norm_length=seq_norm_length, kl_coef=0.0, entropy_coef=0.0, **options)


def verl_normalisers(loss_agg_mode: str, response_mask: torch.Tensor, dp_size: int = 1, batch_num_tokens=None,
                     global_batch_size=None, **_) -> dict[str, torch.Tensor | float]:
    """``global_token_count`` / ``global_num_seqs`` reproducing ``verl.trainer.ppo.core_algos.agg_loss``."""
    if loss_agg_mode == "token-sum":
        return {"global_token_count": 1.0 / dp_size}
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = response_mask.sum()
        return {"global_token_count": batch_num_tokens / dp_size}
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = (response_mask.sum(-1) > 0).sum()  # verl excludes fully masked sequences
    return {"global_num_seqs": global_batch_size / dp_size}


@register_policy_loss(LOSS_NAME)
def compute_policy_loss_aepo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                             config=None, rollout_is_weights=None):
    """verl's ``PolicyLossFn`` signature; all tensors ``[B, T]``. Returns ``(pg_loss, metrics)``."""
    if config is None:
        raise ValueError("the aepo policy loss needs the actor config (verl passes it as config=)")
    loss_config = loss_config_from_verl(config, loss_agg_mode)
    entropy = _ENTROPY.get()
    if entropy is None:
        if loss_config.entropy_adv_alpha != 0.0:
            raise ValueError("policy_loss.loss_mode=aepo with entropy_adv_alpha != 0 needs the per-token entropy: "
                             "set actor_rollout_ref.actor.calculate_entropy=True (or entropy_adv_alpha=0 via "
                             "AEPOPolicyLossConfig)")
        entropy = torch.zeros_like(log_prob)
    mask = response_mask.float()
    try:
        loss, stats = policy_loss_from_logprobs(
            log_prob, entropy, old_log_prob, advantages, mask, config=loss_config, token_weights=rollout_is_weights,
            **verl_normalisers(loss_agg_mode, mask, **config.global_batch_info))
    except (TypeError, ValueError) as err:  # the input contract (aepo_kernels.contract), in verl's names
        raise type(err)(f"{err} [{_VERL_NAMES}]") from err
    ppo_kl = ((old_log_prob - log_prob).detach() * mask).sum() / weight_total(mask.sum())
    values = torch.stack([stats["clipfrac_high"] + stats["clipfrac_low"], ppo_kl,
                          stats.get("clipfrac_dual", torch.zeros_like(ppo_kl)), stats["entropy"]]).tolist()
    metrics = dict(zip(("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/aepo_entropy"), values))
    return loss, metrics


# --- forwarding the entropy: a wrapper around verl's actor loss ------------------------------
def _wrap_ppo_loss(ppo_loss):
    from verl.workers.utils.padding import no_padding_2_padding

    def ppo_loss_with_entropy(config, model_output, data, dp_group=None):
        entropy = model_output.get("entropy", None)
        if entropy is None or config.policy_loss.get("loss_mode", "vanilla") != LOSS_NAME:
            return ppo_loss(config, model_output, data, dp_group)
        token = _ENTROPY.set(no_padding_2_padding(entropy, data))  # [B, T] like log_prob
        try:
            return ppo_loss(config, model_output, data, dp_group)
        finally:
            _ENTROPY.reset(token)

    ppo_loss_with_entropy.__wrapped__ = ppo_loss
    ppo_loss_with_entropy._aepo = True
    return ppo_loss_with_entropy


def install() -> None:
    """Make verl's ``ppo_loss`` forward the entropy (idempotent); modules that imported it by name
    before this ran get the wrapper too."""
    import verl.workers.utils.losses as losses

    if getattr(losses.ppo_loss, "_aepo", False):
        return
    wrapped = _wrap_ppo_loss(losses.ppo_loss)
    original = losses.ppo_loss
    losses.ppo_loss = wrapped
    for name in ("verl.workers.engine_workers", "verl.trainer.distillation.losses"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "ppo_loss", None) is original:
            module.ppo_loss = wrapped


install()
