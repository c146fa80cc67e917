"""aepo_kernels: fused AEPO loss kernels (import name ``aepo_kernels``; folder ``kernels/``).

Depends on torch (and triton for the GPU path) only. In any trainer (docs/library.md)::

    from aepo_kernels import aepo_policy_loss, LossConfig
    # HF logits [B, T, V] and input_ids [B, T]: logits row t predicts input_ids[t + 1]
    loss, stats = aepo_policy_loss(logits, input_ids, old_logprobs, advantages, loss_mask,
                                   shift_labels=True, temperature=0.7,
                                   config=LossConfig(clip="aepo", entropy_adv_alpha=0.2))

The losses run in one pass per row (``one_pass``: log-prob, entropy, shaped advantage, clip,
loss and dlogits together). See also ``logprob_entropy`` (log-probs and entropies from logits),
``fused_linear_logprob_entropy`` (from hidden states, no ``[N, V]`` tensor), ``policy_loss``
(clip rules, advantages, aggregation on given log-probs) and ``step_inputs`` (group advantages,
entropy statistics and normalisers of one optimizer step, in one call).

Rollout trees (``tree_loss``): ``aepo_tree_policy_loss`` / ``fused_linear_aepo_tree_policy_loss``
take a tree's nodes once and each trajectory token as an ``Occurrences`` entry pointing at its node;
``sequence_tree`` builds the trie from token rows, ``tree_occurrences`` / ``node_values`` its inputs.
``decoupled_ppo_weights``: the behaviour-to-proximal weight of decoupled PPO, as ``token_weights``.

Every entry point checks its inputs (``contract``: dtypes, shapes, labels in range, masks as
weights >= 0; ``shift_labels`` has no default). Options for other trainers (keywords of both loss
functions, declared once in ``LossOptions``): ``token_weights`` (IS weights),
``return_token_loss``, ``shift_labels`` (HF labels convention), ``ignore_index``,
``logit_scale`` / ``softcap`` (the model's logit map, e.g. Gemma-2's soft cap).
"""
from typing import TYPE_CHECKING

from .config import AGGREGATIONS, CLIP_RULES, LossConfig

# The kernels load on first use (``aepo_kernels.X`` or ``from aepo_kernels import X``), so reading
# ``LossConfig`` (the engine's ``loss`` config section) imports no torch. name -> its module.
_LAZY = {
    "StepInputs": "advantages", "group_advantages": "advantages", "step_inputs": "advantages",
    "AEPOLoss": "api", "LossOptions": "api", "aepo_policy_loss": "api", "fused_linear_aepo_policy_loss": "api",
    "DEFAULT_CHUNK_BYTES": "fused_linear", "fused_linear_logprob_entropy": "fused_linear",
    "BACKENDS": "logits_ops", "logprob_entropy": "logits_ops",
    "Occurrences": "tree_loss", "aepo_tree_policy_loss": "tree_loss",
    "fused_linear_aepo_tree_policy_loss": "tree_loss",
    **dict.fromkeys(("SequenceTree", "node_values", "sequence_tree", "tree_occurrences"), "trie"),
    **dict.fromkeys(("aggregate", "apply_token_weights", "clipped_token_loss", "decoupled_ppo_weights",
                     "entropy_aware_advantages", "entropy_moments", "entropy_stats_from_moments",
                     "policy_loss_from_logprobs"), "policy_loss"),
}

if TYPE_CHECKING:  # what the names are, for readers and type checkers
    from .advantages import StepInputs, group_advantages, step_inputs
    from .api import AEPOLoss, LossOptions, aepo_policy_loss, fused_linear_aepo_policy_loss
    from .fused_linear import DEFAULT_CHUNK_BYTES, fused_linear_logprob_entropy
    from .logits_ops import BACKENDS, logprob_entropy
    from .tree_loss import Occurrences, aepo_tree_policy_loss, fused_linear_aepo_tree_policy_loss
    from .trie import SequenceTree, node_values, sequence_tree, tree_occurrences
    from .policy_loss import (aggregate, apply_token_weights, clipped_token_loss, decoupled_ppo_weights,
                              entropy_aware_advantages, entropy_moments, entropy_stats_from_moments,
                              policy_loss_from_logprobs)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


__all__ = [
    "AEPOLoss", "AGGREGATIONS", "BACKENDS", "CLIP_RULES", "DEFAULT_CHUNK_BYTES", "LossConfig", "LossOptions",
    "Occurrences", "SequenceTree", "StepInputs", "aepo_policy_loss", "aepo_tree_policy_loss",
    "fused_linear_aepo_tree_policy_loss", "node_values", "sequence_tree", "tree_occurrences",
    "aggregate", "apply_token_weights", "clipped_token_loss", "decoupled_ppo_weights", "entropy_aware_advantages",
    "entropy_moments",
    "entropy_stats_from_moments", "fused_linear_aepo_policy_loss", "fused_linear_logprob_entropy",
    "group_advantages", "logprob_entropy", "policy_loss_from_logprobs", "step_inputs",
]
