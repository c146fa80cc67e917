"""Group-relative advantages (GRPO, docs/algorithm.md §2a), and :func:`step_inputs`: in one call
what an outside training loop needs before the loss -- the advantages, the entropy z-score
statistics and the normalisers of one optimizer step.

    A_i = (R_i - mean_g(R)) / (std_g(R) + eps)        g = the group of trajectory i

A group is every trajectory of one prompt, branches included. ``std`` is the *unbiased*
(Bessel-corrected, n-1) standard deviation by default, matching ``torch.std`` and verl's GRPO;
``unbiased=False`` gives the population std. A group of size 1 has A = 0 (its only member is
its own mean; the n-1 = 0 denominator is never divided by). A group of equal rewards has
A = 0 *exactly*: rewards are shifted by their group's minimum before averaging. Without
the shift, float32 rounding of the mean leaves deviations of ~1e-7 that ``/(std + 1e-6)``
blows up: twelve rewards of 1.1 would get advantages of +-0.1 instead of 0.

Everything is vectorised with ``index_add_`` over dense group indices, with no host syncs
(no ``.item()``, no ``torch.unique``, no data-dependent shapes); the tests check this by running
on ``meta`` tensors, which have no data to sync. Group ids may be any integers, in any order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .policy_loss import entropy_moments, entropy_stats_from_moments

__all__ = ["StepInputs", "dense_group_index", "group_advantages", "step_inputs"]


def dense_group_index(group_ids: Tensor) -> Tensor:
    """Map arbitrary integer group ids to dense indices 0..G-1 (G <= n), without a host sync.

    Sorting replaces ``torch.unique``, whose output size would need a device-to-host copy.

    Args:
        group_ids: ``[n]`` integer tensor.

    Returns:
        ``[n]`` int64 tensor; equal ids get equal indices, indices are ordered like the ids.
    """
    sorted_ids, order = torch.sort(group_ids)
    starts = torch.ones_like(sorted_ids, dtype=torch.long)  # 1 where a new group starts
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    dense_sorted = torch.cumsum(starts, dim=0) - 1
    return torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted)


def _group_sum(values: Tensor, index: Tensor) -> Tensor:
    """Per-group sums in a length-n buffer (there are at most n groups)."""
    return torch.zeros_like(values).index_add_(0, index, values)


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: rewards centred (and scaled) within their group.

    Args:
        rewards: ``[n]`` float tensor, one scalar reward per trajectory.
        group_ids: ``[n]`` integer tensor; trajectories with equal ids form a group. Groups may
            have different sizes.
        normalize_std: divide by ``std + eps``; ``False`` only centres (Dr. GRPO style).
        unbiased: Bessel-corrected std (n-1, like ``torch.std`` and verl); ``False`` for the
            population std (n).
        eps: added to the std so equal-reward groups give 0, not NaN.

    Returns:
        ``[n]`` advantages, float32 (float64 if ``rewards`` is float64), on the rewards' device.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [n]; got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    rewards = rewards.to(dtype)
    index = dense_group_index(group_ids.to(rewards.device))
    # Shift by the group minimum: any member would do, but the min is order-independent, so the
    # result is bitwise deterministic (scatter_ with repeated indices keeps an arbitrary one).
    pivots = torch.zeros_like(rewards).scatter_reduce_(0, index, rewards, "amin",
                                                       include_self=False)
    shifted = rewards - pivots[index]  # [n], exactly 0 in an all-equal group
    counts = _group_sum(torch.ones_like(rewards), index)  # [n], 0 past the last group
    means = _group_sum(shifted, index) / counts.clamp_min(1)
    centred = shifted - means[index]
    if not normalize_std:
        return centred
    dof = counts - 1 if unbiased else counts
    variance = _group_sum(centred * centred, index) / dof.clamp_min(1)
    return centred / (variance.sqrt()[index] + eps)


# ---------------------------------------------------------------------------------------------
# One call for an outside loop.


class StepInputs(NamedTuple):
    """What the loss calls of one optimizer step share (:func:`step_inputs`); 0-d tensors except
    ``advantages``. ``loss_kwargs()`` passes the four statistics to every micro-batch's loss call."""

    advantages: Tensor  # [B] per sequence (the loss takes [B] or [B, T])
    entropy_mean: Tensor
    entropy_std: Tensor
    global_token_count: Tensor
    global_num_seqs: Tensor

    def loss_kwargs(self) -> dict[str, Tensor]:
        """``entropy_mean``, ``entropy_std``, ``global_token_count``, ``global_num_seqs`` for
        :func:`aepo_kernels.aepo_policy_loss` / :func:`aepo_kernels.fused_linear_aepo_policy_loss`:
        with them every micro-batch's call is one pass, and the micro-batch losses sum to the
        step's loss (token-mean and the sequence modes alike)."""
        return {name: getattr(self, name) for name in self._fields[1:]}


def step_inputs(rewards: Tensor, group_ids: Tensor, entropy: Tensor, loss_mask: Tensor, *,
                normalize_std: bool = True, unbiased: bool = True) -> StepInputs:
    """Group advantages, entropy statistics and normalisers of one optimizer step, no host sync.

    Args:
        rewards: ``[B]`` one scalar reward per sequence of the step (all its micro-batches).
        group_ids: ``[B]`` integers; sequences with equal ids form a group (the samples of one
            prompt; e.g. ``torch.arange(B) // k`` for k samples per prompt, in order).
        entropy: ``[B, T]`` per-token entropies under the sampling (old) policy, e.g. the second
            output of :func:`aepo_kernels.logprob_entropy` in the no-grad pass that gives the old
            log-probs, in the alignment the loss calls use.
        loss_mask: ``[B, T]``, the loss calls' mask in the same alignment (with
            ``shift_labels=True``: 0 on token 0, which nothing predicts, and wherever the label is
            ``ignore_index``), so the token count here is the loss's.
        normalize_std, unbiased: as :func:`group_advantages` (defaults: GRPO's, Bessel-corrected).
    Returns:
        :class:`StepInputs`: ``advantages [B]`` (``(R - mean_g) / (std_g + 1e-6)``); the entropy
        mean and *population* std over the masked tokens (docs/algorithm.md §2b); the masked token
        count and the sequence count.
    Data parallel: each rank's entropies cover its own sequences only; all-reduce
    :func:`aepo_kernels.entropy_moments` and the count instead (docs/library.md).
    """
    if entropy.shape != loss_mask.shape or entropy.dim() != 2 or entropy.shape[0] != rewards.shape[0]:
        raise ValueError(f"step_inputs(): entropy {list(entropy.shape)} and loss_mask {list(loss_mask.shape)} must "
                         f"both be [B, T] with B = {rewards.shape[0]} sequences (rewards {list(rewards.shape)})")
    advantages = group_advantages(rewards, group_ids, normalize_std=normalize_std, unbiased=unbiased)
    moments = entropy_moments(entropy, loss_mask)
    mean, std = entropy_stats_from_moments(moments)
    sequences = torch.tensor(float(rewards.shape[0]), device=rewards.device)
    return StepInputs(advantages, mean, std, moments[2].float(), sequences)
