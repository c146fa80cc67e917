"""What a batch layout costs, before any model is built: the sizes the memory plans read.

A batch layout (rows or the rollout tree, :mod:`aepo_engine.training.layout`) decides how many
positions a micro-batch makes the model compute and what the tree loss holds besides. The
arithmetic lives here, torch-free, so that :mod:`aepo_engine.memory_plan` asks the layout instead
of branching on ``policy.trees``; the training layouts (``training.layout.RowLayout`` / ``TreeLayout``) are
these classes with the runtime half added.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RowLayoutPlan", "TreeLayoutPlan", "layout_plan"]


class RowLayoutPlan:
    """Right-padded rows (or packed: the same positions, padding dropped)."""

    unit = "tokens"  # what a micro-batch's positions are

    @staticmethod
    def planned_positions(policy: Any, prompt: int, response: int, k: int) -> int:
        """Positions of the largest micro-batch: ``policy.micro_batch_max_tokens``, else
        ``micro_batch_size`` rows of the longest possible row (``prompt + response``)."""
        if policy.micro_batch_max_tokens is not None:
            return policy.micro_batch_max_tokens
        return policy.micro_batch_size * (prompt + response)

    @staticmethod
    def planned_extra(policy: Any, prompt: int, response: int, k: int, positions: int, hidden: int,
                      element: int) -> tuple[str, int, str]:
        """``(what, bytes, note)`` the layout's loss holds besides the head's terms: nothing."""
        return "tree loss (none: tree_batches off)", 0, ""


class TreeLayoutPlan:
    """The tries of whole prompt groups (each prompt once, each shared prefix once)."""

    unit = "tree nodes"

    @staticmethod
    def planned_positions(policy: Any, prompt: int, response: int, k: int) -> int:
        """Nodes of the largest micro-batch: ``policy.micro_batch_max_tokens``, else the groups of
        ``micro_batch_size`` rows (at least one), each its prompt once and ``k`` responses."""
        if policy.micro_batch_max_tokens is not None:
            return policy.micro_batch_max_tokens
        return max(1, policy.micro_batch_size // k) * (prompt + k * response)

    @staticmethod
    def planned_extra(policy: Any, prompt: int, response: int, k: int, positions: int, hidden: int,
                      element: int) -> tuple[str, int, str]:
        """The tree loss's parents' hidden states gathered and their gradient (``positions`` nodes
        of ``hidden`` x ``element`` bytes), and per occurrence (label position) its statistics:
        a node is read by at most the ``k`` rows of its group."""
        if policy.micro_batch_max_tokens is None:
            occurrences = max(policy.micro_batch_size // k, 1) * k * (prompt + response)
        else:
            occurrences = k * positions
        return (f"tree loss: parents' hidden states gathered + their gradient ({positions} nodes), "
                "per-occurrence statistics", 2 * positions * hidden * element + 12 * 4 * occurrences,
                f"{occurrences} occurrences at most")


def layout_plan(policy: Any) -> type[RowLayoutPlan] | type[TreeLayoutPlan]:
    """The layout the policy section trains with (``policy.trees``)."""
    return TreeLayoutPlan if policy.trees else RowLayoutPlan
