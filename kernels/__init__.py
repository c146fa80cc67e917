"""aepo_kernels: fused AEPO loss kernels (import name ``aepo_kernels``; folder ``kernels/``).

Depends on torch (and triton for the GPU path) only. Three lines in any trainer::

    from aepo_kernels import aepo_policy_loss, LossConfig
    loss, stats = aepo_policy_loss(logits, labels, old_logprobs, advantages, loss_mask,
                                   config=LossConfig(clip="aepo", entropy_adv_alpha=0.2))

The losses run in one pass per row (``one_pass``: log-prob, entropy, shaped advantage, clip,
loss and dlogits together). See also ``logprob_entropy`` (log-probs and entropies from logits),
``fused_linear_logprob_entropy`` (from hidden states, no ``[N, V]`` tensor) and ``policy_loss``
(clip rules, advantages, aggregation on given log-probs).

Rollout trees (``tree_loss``): ``aepo_tree_policy_loss`` / ``fused_linear_aepo_tree_policy_loss``
take a tree's nodes once and each trajectory token as an ``Occurrences`` entry pointing at its node.

Options for other trainers (keywords of both loss functions, declared once in ``LossOptions``):
``token_weights`` (IS weights), ``return_token_loss``, ``shift_labels`` (HF labels convention),
``ignore_index``, ``logit_scale`` / ``softcap`` (the model's logit map, e.g. Gemma-2's soft cap).
"""
from .api import AEPOLoss, LossOptions, aepo_policy_loss, fused_linear_aepo_policy_loss
from .config import AGGREGATIONS, CLIP_RULES, LossConfig
from .fused_linear import DEFAULT_CHUNK_BYTES, fused_linear_logprob_entropy
from .logits_ops import BACKENDS, logprob_entropy
from .tree_loss import Occurrences, aepo_tree_policy_loss, fused_linear_aepo_tree_policy_loss
from .policy_loss import (
    aggregate,
    apply_token_weights,
    clipped_token_loss,
    entropy_aware_advantages,
    entropy_moments,
    entropy_stats_from_moments,
    policy_loss_from_logprobs,
)

__all__ = [
    "AEPOLoss", "AGGREGATIONS", "BACKENDS", "CLIP_RULES", "DEFAULT_CHUNK_BYTES", "LossConfig", "LossOptions",
    "Occurrences", "aepo_policy_loss", "aepo_tree_policy_loss", "fused_linear_aepo_tree_policy_loss",
    "aggregate", "apply_token_weights", "clipped_token_loss", "entropy_aware_advantages", "entropy_moments",
    "entropy_stats_from_moments", "fused_linear_aepo_policy_loss", "fused_linear_logprob_entropy",
    "logprob_entropy", "policy_loss_from_logprobs",
]
