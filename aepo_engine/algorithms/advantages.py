"""Group-relative advantages (docs/algorithm.md §2a) and their broadcast to response tokens.

The advantages themselves live in the kernels package (:mod:`aepo_kernels.advantages`), so an
outside training loop that uses the fused loss gets the same function; this module adds the
engine's broadcast to response tokens.
"""
from __future__ import annotations

from torch import Tensor

from aepo_kernels.advantages import dense_group_index, group_advantages

__all__ = ["dense_group_index", "group_advantages", "broadcast_to_tokens"]


def broadcast_to_tokens(adv: Tensor, response_mask: Tensor) -> Tensor:
    """Give every valid response token its trajectory's advantage.

    Args:
        adv: ``[n]`` per-trajectory advantages.
        response_mask: ``[n, T]`` mask, 1 (or True) on tokens that carry loss (model-generated
            response tokens), 0 on padding and tool-result tokens.

    Returns:
        ``[n, T]`` tensor in ``adv``'s dtype: ``adv[i]`` where the mask is set, else 0.
    """
    if response_mask.dim() != 2 or response_mask.shape[0] != adv.shape[0] or adv.dim() != 1:
        raise ValueError(f"expected adv [n] and response_mask [n, T]; got {tuple(adv.shape)} "
                         f"and {tuple(response_mask.shape)}")
    return adv[:, None] * response_mask.to(adv.dtype)
