"""The AEPO loss over a rollout tree: each tree node's log-prob and entropy once, every trajectory
that passes through it counted, in the same one pass as the row loss (:mod:`aepo_kernels.one_pass`).

A group's trajectories share their prompt, and a branch shares its parent's tokens up to where it
forked. Laid out as a tree (a trie of token ids), each node is one position of the model and one
loss row: the token it holds, predicted from its parent's hidden state. A node shared by several
trajectories has one log-prob ``logp`` and one entropy ``H`` (same context, same token), but each
trajectory j through it -- an *occurrence* -- brings its own advantage ``A_j`` (its group
advantage, times its importance weight) and its own aggregation weight ``w_j`` (token-mean:
``mask_j / N``; the sequence-level modes divide by its own sequence's length). The row loss
would add ``sum_j w_j L(logp, H; A_j)``.

Folding (why two advantage columns are exact). With ``s = 1 + alpha_H zscore(H)`` (the
entropy-aware factor, the same for every occurrence: it reads the node's entropy) the shaped
advantage is ``a_j = s A_j``, and for a fixed ratio the policy-gradient term of every clip rule
in :data:`aepo_kernels.config.CLIP_RULES` is positively homogeneous in ``a``:
- ``ppo`` / ``aepo`` / ``gppo``: ``L = max(-a r, -a clip(r))``; scaling ``a`` by ``lambda > 0``
  scales both arguments, so the same branch wins and ``L`` and ``dL/dlogp`` scale (the branch
  taken depends only on the sign of ``a`` and on ``r``). The stop-gradient bounds change only the
  derivative of the clipped branch (``-a (1 + eps_high)`` and ``-a (1 - eps_low)``): linear in ``a``.
- the dual clip: ``min(L, -a c)`` for ``a < 0``: both sides scale by ``lambda``; which side wins
  depends on ``r`` only.
- ``cispo``: ``L = -a sg(clip(r)) logp``: linear in ``a`` outright.
So within one sign of ``a`` (all occurrences with ``A_j > 0`` share the sign of ``s A_j``, as do
all with ``A_j < 0``), ``sum_j w_j L(s A_j) = L(s sum_j w_j A_j)``. With ``W = sum_j w_j``,
``P = sum_{A_j > 0} w_j A_j / W`` and ``Q = sum_{A_j < 0} w_j A_j / W`` the node's row is

    W * ( L_pg(s P) + L_pg(s Q) + kl_coef KL - entropy_coef H )  ==  sum_j w_j L_j

(KL and entropy bonus do not read the advantage: weight ``W``). That is the one-pass kernels'
``advantages`` / ``advantages_neg`` columns with ``weight = W`` (:class:`RowInputs`): no rule
needs its nodes expanded. Occurrences with ``A_j = 0`` or ``w_j = 0`` add nothing to ``P``/``Q``
(``L_pg(0) = 0`` for every rule); a masked occurrence adds nothing to ``W``.

What the node rows cannot hold, and so is computed per occurrence (``[M]`` elementwise, nothing
next to the ``[N, V]`` pass): the statistics. They count occurrences, as the row loss does
(clip fractions and the shaped advantage read ``A_j``, ``num_tokens`` counts masked-in
occurrences, the KL mean too): the node's log-prob, entropy, ratio and KL are gathered to its
occurrences and :func:`aepo_kernels.one_pass.token_head` is evaluated there.

Requirements (the caller's tree builder checks them; they hold by construction for a trie keyed
on the tokens and these values): every occurrence of a node has the same old log-prob and
reference log-prob (they are per node here). Inputs: the contract of :mod:`aepo_kernels.contract`
(per node like ``labels``, per occurrence like ``occurrences.node``); ``shift_labels`` is False
by default and may only be False (a node row is already its token's prediction). Left out: ``backend="reference"`` (the oracle is
:func:`aepo_kernels.reference.tree_loss_reference`: the literal row loss on the expanded rows),
``torch.compile`` tracing of the two-column op.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import contract
from .config import LossConfig, hyper_params
from .fused_linear import fused_linear_aepo_loss, head_call, head_entropy
from .logits_ops import logit_map, logprob_entropy, resolve_backend
from .loss_call import _entropy_stats, _stats, loss_options, takes_loss_options
from .one_pass import OnePassLossFunction, token_head
from .policy_loss import apply_token_weights, weight_total
from .row_inputs import RowInputs

__all__ = ["Occurrences", "aepo_tree_policy_loss", "fold_occurrences", "fused_linear_aepo_tree_policy_loss",
           "occurrence_weights"]


class Occurrences(NamedTuple):
    """The trajectory tokens of a rollout tree, each pointing at the node (loss row) it reads.

    Attributes:
        node: ``[M]`` long, the loss row of each occurrence (``0 <= node < N``).
        advantages: ``[M]`` float, the occurrence's advantage (its trajectory's).
        loss_mask: ``[M]`` float, 1 where the occurrence counts.
        sequence: ``[M]`` long or None, the occurrence's trajectory (``0 <= sequence < num_sequences``):
            needed by the sequence-level aggregations only.
        num_sequences: the number of trajectories, masked-out ones included; the sequence-level
            aggregations need it (or ``global_num_seqs``): ``sequence.max() + 1`` would miss
            trajectories whose every token is masked out.
    """

    node: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    sequence: torch.Tensor | None = None
    num_sequences: int | None = None


def occurrence_weights(occ: Occurrences, config: LossConfig, global_token_count=None,
                       global_num_seqs=None) -> torch.Tensor:
    """Aggregation weights ``w_j`` ``[M]`` with ``sum_j w_j L_j`` equal to the row loss's aggregate
    (:func:`aepo_kernels.one_pass.aggregation_weights` on the expanded ``[B, T]`` rows)."""
    mask = occ.loss_mask.float()
    if config.aggregation == "token-mean":
        denom = weight_total(mask.sum()) if global_token_count is None else global_token_count
        return mask / denom
    if occ.sequence is None:
        raise ValueError(f"aggregation={config.aggregation!r} needs Occurrences.sequence (each occurrence's trajectory)")
    num_seqs = occ.num_sequences
    if num_seqs is None and global_num_seqs is None:
        # (sequence.max() + 1 would miss trajectories whose every token is masked out: a wrong count)
        raise ValueError(f"aggregation={config.aggregation!r} needs Occurrences.num_sequences (the number of "
                         "trajectories, masked-out ones included) or global_num_seqs")
    num_seqs = num_seqs if num_seqs is not None else global_num_seqs
    if config.aggregation == "seq-mean-token-mean":
        lengths = torch.zeros(num_seqs, dtype=mask.dtype, device=mask.device).index_add_(0, occ.sequence, mask)
        per_seq = mask / weight_total(lengths)[occ.sequence]
    else:
        if config.seq_norm_length is None:
            raise ValueError("aggregation='seq-mean-token-sum-norm' on a tree needs config.seq_norm_length: the row "
                             "loss's default (the padded width T) has no meaning for a tree")
        per_seq = mask / config.seq_norm_length
    return per_seq / (num_seqs if global_num_seqs is None else global_num_seqs)


def fold_occurrences(node: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                     num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two advantage columns and the weight of each node (module docstring).

    Args:
        node: ``[M]`` long; advantages, weights: ``[M]`` float (weights >= 0).
        num_nodes: N.
    Returns:
        ``(advantages_pos, advantages_neg, weight)``, each ``[N]`` fp32: ``sum w A / W`` over the
        occurrences with ``A > 0`` (resp. ``A < 0``), and ``W = sum w`` (0 and 0 where W = 0).
    """
    zeros = lambda: torch.zeros(num_nodes, dtype=torch.float32, device=node.device)  # noqa: E731
    weights, advantages = weights.float(), advantages.float()
    total = zeros().index_add_(0, node, weights)
    weighted = weights * advantages
    pos = zeros().index_add_(0, node, torch.where(advantages > 0, weighted, torch.zeros_like(weighted)))
    neg = zeros().index_add_(0, node, torch.where(advantages < 0, weighted, torch.zeros_like(weighted)))
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return pos / safe, neg / safe, total


# ---------------------------------------------------------------------------------------------
# The shared prologue and epilogue of both tree losses.

class _TreeCall(NamedTuple):
    inputs: RowInputs  # [1, N] fields, the two advantage columns folded
    occ_mask: torch.Tensor  # [M], occurrences whose node has a target
    occ_adv: torch.Tensor  # [M], advantages times token weights
    config: LossConfig
    backend: str
    inv_t: float
    tanh_scale: float | None


def _check(function: str, labels: torch.Tensor, vocab: int, old_logprobs, occ: Occurrences, o) -> None:
    """The input contract (:mod:`aepo_kernels.contract`) on a tree: per node (``[N]``, like
    ``labels``) ``old_logprobs`` and ``ref_logprobs``; per occurrence (``[M]``, like
    ``occurrences.node``) its advantages, mask, trajectory, ``token_weights`` and ``stats_masks``;
    labels in ``[0, V)`` or ``ignore_index``, nodes in ``[0, N)``, trajectories in
    ``[0, num_sequences)``, masks and weights finite and >= 0 (at once on the CPU, a device-side
    assert on CUDA). ``shift_labels`` is False (the default here: a tree has no other convention)."""
    if o.shift_labels is not None and not isinstance(o.shift_labels, bool):
        contract.alignment(function, o.shift_labels)  # its TypeError for a non-bool
    if o.shift_labels:
        raise ValueError(f"{function}(): shift_labels=True has no meaning on a tree: node row n already predicts "
                         "labels[n] (its own token, from its parent's state); pass shift_labels=False")
    if o.backend == "reference":
        raise ValueError(f"{function}(): backend='reference' is not offered for the tree loss: compare with the row "
                         "loss on the expanded rows (aepo_kernels.reference.tree_loss_reference)")
    if labels.dim() != 1:
        raise ValueError(f"{function}(): a tree's labels are [N] (one per node), got {list(labels.shape)}")
    contract.check_per_token(function, labels, [contract.PerToken("old_logprobs", old_logprobs),
                                                contract.PerToken("ref_logprobs", o.ref_logprobs)])
    node = contract._tensor(function, "occurrences.node", occ.node)
    if node.dtype not in (torch.int64, torch.int32) or node.dim() != 1:
        raise TypeError(f"{function}(): occurrences.node must be a 1-D int64/int32 tensor of node indices [M], got "
                        f"{node.dtype} {list(node.shape)}")
    sequence = occ.sequence
    if sequence is not None and (sequence.dtype not in (torch.int64, torch.int32) or sequence.shape != node.shape):
        raise TypeError(f"{function}(): occurrences.sequence must be int64/int32 shaped like occurrences.node "
                        f"{list(node.shape)}, got {sequence.dtype} {list(sequence.shape)}")
    masks = {f"stats_masks[{name!r}]": mask for name, mask in (o.stats_masks or {}).items()}
    contract.check_per_token(
        function, node, [contract.PerToken("occurrences.advantages", occ.advantages),
                         contract.PerToken("occurrences.loss_mask", occ.loss_mask, "mask"),
                         contract.PerToken("token_weights", o.token_weights)]
        + [contract.PerToken(name, mask, "mask") for name, mask in masks.items()], anchor="occurrences.node")
    contract._same_device(function, "labels", labels, "occurrences.node", node.device)
    n = labels.shape[0]
    rules = [contract.label_rule(labels, vocab, o.ignore_index),
             contract.ValueRule("occurrences.node", node, (node < 0) | (node >= n), f"node indices in [0, {n})")]
    if sequence is not None and occ.num_sequences is not None:
        rules.append(contract.ValueRule("occurrences.sequence", sequence,
                                        (sequence < 0) | (sequence >= occ.num_sequences),
                                        f"trajectory indices in [0, num_sequences={occ.num_sequences})"))
    elif sequence is not None:
        rules.append(contract.ValueRule("occurrences.sequence", sequence, sequence < 0, "trajectory indices >= 0"))
    rules += contract.weight_rules({"occurrences.loss_mask": occ.loss_mask, "token_weights": o.token_weights,
                                    **masks})
    contract.enforce(function, rules)


def _prologue(function: str, x, vocab: int, labels, old_logprobs, occ: Occurrences, o, entropy_pass) -> _TreeCall:
    _check(function, labels, vocab, old_logprobs, occ, o)
    config = o.config
    if config.kl_coef != 0.0 and o.ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    inv_t, tanh_scale = logit_map(o.temperature, o.logit_scale, o.softcap)
    backend = resolve_backend(o.backend, x)
    has_target = contract.target_mask(labels, vocab, o.ignore_index)[occ.node]
    occ_mask = torch.where(has_target, occ.loss_mask.float(), torch.zeros_like(occ.loss_mask, dtype=torch.float32))
    occ_adv = apply_token_weights(occ.advantages.float(), o.token_weights, occ.node.shape)
    mean, std = _entropy_stats(config, occ_mask, o.entropy_mean, o.entropy_std, lambda: entropy_pass()[occ.node])
    weights = occurrence_weights(occ._replace(loss_mask=occ_mask), config, o.global_token_count, o.global_num_seqs)
    pos, neg, weight = fold_occurrences(occ.node, occ_adv, weights, labels.shape[0])
    row = lambda t: None if t is None else t.float().detach().reshape(1, -1)  # noqa: E731
    device = weight.device
    inputs = RowInputs(row(old_logprobs), row(pos), row(weight), mean.to(device), std.to(device), row(o.ref_logprobs),
                       row(neg))
    return _TreeCall(inputs, occ_mask, occ_adv, config, backend, inv_t, tanh_scale)


def _occurrence_stats(call: _TreeCall, node_rows: torch.Tensor, occ: Occurrences, o) -> dict[str, torch.Tensor]:
    """Statistics over the occurrences (the row loss's, token for token): the node's log-prob and
    entropy gathered, the head evaluated per occurrence."""
    inputs = call.inputs
    logp, entropy = node_rows[0][occ.node], node_rows[1][occ.node]  # [M]
    old = inputs.old_logprobs[0][occ.node]
    ref = inputs.ref_or_old[0][occ.node]
    has_ref = inputs.ref_logprobs is not None
    hp = hyper_params(call.config, has_ref, logp.dtype, logp.device)
    mean, std = inputs.entropy_mean.to(logp.dtype), inputs.entropy_std.to(logp.dtype)
    loss, _, _, ratio, shaped, kl = token_head(logp, entropy, old, call.occ_adv.to(logp.dtype), ref, mean, std, hp)
    rows = torch.stack([logp, entropy, loss, ratio, shaped, kl])
    return _stats(rows, call.occ_mask, call.config, has_ref, o.return_token_loss, o.stats_masks)


# ---------------------------------------------------------------------------------------------
# The public tree losses.

@takes_loss_options(defaults={"shift_labels": False})
def aepo_tree_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    occurrences: Occurrences,
    *,
    inplace_backward: bool = False,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AEPO loss of a rollout tree from its nodes' logits (module docstring).

    Args:
        logits: ``[N, V]``, row n predicts ``labels[n]`` (node n's token, from its parent's state).
        labels: ``[N]``; ``ignore_index`` rows (roots) have no target.
        old_logprobs: ``[N]``, one per node.
        occurrences: where each trajectory token reads its row (:class:`Occurrences`).
        inplace_backward: as :func:`aepo_kernels.aepo_policy_loss`.
        **options: the keywords of :class:`aepo_kernels.LossOptions`; per node (``[N]``):
            ``ref_logprobs``; per occurrence (``[M]``): ``token_weights``, ``stats_masks``.
    Returns:
        ``(loss, stats)``: the row loss of the expanded trajectories (one pass over N rows, not M)
        and its statistics over the occurrences; ``token_loss``/``token_logprobs``/``token_entropy``
        are ``[M]`` with ``return_token_loss``.
    """
    function = "aepo_tree_policy_loss"
    o = loss_options(function, {"shift_labels": False, **options})
    contract.check_logits(function, logits, labels)
    entropy_pass = lambda: logprob_entropy(  # noqa: E731
        logits.detach(), labels, o.temperature, shift_labels=False, backend=o.backend, ignore_index=o.ignore_index,
        logit_scale=o.logit_scale, softcap=o.softcap)[1]
    call = _prologue(function, logits, logits.shape[-1], labels, old_logprobs, occurrences, o, entropy_pass)
    in_place = inplace_backward and logits.requires_grad and torch.is_grad_enabled()
    loss, rows = OnePassLossFunction.apply(logits[None], labels[None], call.inputs, call.config, call.inv_t,
                                           o.ignore_index, call.backend, in_place, call.tanh_scale)
    return loss, _occurrence_stats(call, rows[:, 0], occurrences, o)


@takes_loss_options(defaults={"shift_labels": False})
def fused_linear_aepo_tree_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    occurrences: Occurrences,
    *,
    bias: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    head_backward: str | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AEPO loss of a rollout tree from its nodes' hidden states ``[N, D]`` (each node's
    parent's final state) and the lm_head ``weight [V, D]``: :func:`aepo_tree_policy_loss` without
    ``[N, V]`` logits. The head is the flat loss's (:func:`aepo_kernels.fused_linear_aepo_policy_loss`:
    ``head_backward``, ``chunk_bytes``, ``token_chunk``, ``vocab_chunk`` as there, docs/head.md)."""
    function = "fused_linear_aepo_tree_policy_loss"
    o = loss_options(function, {"shift_labels": False, **options})
    contract.check_hidden(function, hidden, weight, labels, bias)
    head = head_call(head_backward, hidden, weight, chunk_bytes, token_chunk, vocab_chunk)
    entropy_pass = lambda: head_entropy(head, hidden, weight, bias, labels, o.ignore_index, o.temperature,  # noqa: E731
                                        o.logit_scale, o.softcap)
    call = _prologue(function, hidden, weight.shape[0], labels, old_logprobs, occurrences, o, entropy_pass)
    loss, rows = fused_linear_aepo_loss(
        hidden, weight, bias, labels.reshape(1, -1).long(), call.inputs, call.config, call.inv_t, o.ignore_index,
        call.backend, call.tanh_scale, head_backward=head.order, chunk_bytes=head.chunk_bytes,
        token_chunk=head.token_chunk, vocab_chunk=head.vocab_chunk, stats=head.made.get("stats"),
        head_kernel="triton" if o.backend == "triton" else "torch")
    return loss, _occurrence_stats(call, rows, occurrences, o)
