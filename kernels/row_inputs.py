"""The per-token inputs of the one-pass loss, shared by its backends (:mod:`aepo_kernels.one_pass`,
:mod:`aepo_kernels.triton_kernels`, :mod:`aepo_kernels.native`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowInputs"]


@dataclass(frozen=True)
class RowInputs:
    """Per-token inputs of the one-pass loss, all ``[B, T]`` float (``ref_logprobs`` optional).

    ``weight`` is the aggregation weight w_t (0 on masked tokens); ``entropy_mean``/``entropy_std``
    are 0-d tensors. Per-token importance weights are already folded into ``advantages``
    (:func:`aepo_kernels.apply_token_weights`).

    ``advantages_neg`` (optional) is a second advantage column: the row's policy-gradient term is
    then ``L_pg(advantages) + L_pg(advantages_neg)`` (KL and entropy bonus once). A rollout-tree
    node that several trajectories share carries its positive and its negative advantages folded
    into these two columns (:mod:`aepo_kernels.tree_loss`, which says why that is exact).
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    weight: torch.Tensor
    entropy_mean: torch.Tensor
    entropy_std: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    advantages_neg: torch.Tensor | None = None

    @property
    def ref_or_old(self) -> torch.Tensor:
        """The reference log-probs, or a stand-in of the same shape when there are none."""
        return self.old_logprobs if self.ref_logprobs is None else self.ref_logprobs

    def rows(self, b, rows: slice) -> "RowInputs":
        """Rows ``rows`` of sequence ``b`` (an int: ``[R]`` fields; a slice: ``[b, R]`` fields)."""
        pick = lambda t: None if t is None else t[b, rows]  # noqa: E731
        return RowInputs(pick(self.old_logprobs), pick(self.advantages), pick(self.weight),
                         self.entropy_mean, self.entropy_std, pick(self.ref_logprobs), pick(self.advantages_neg))
