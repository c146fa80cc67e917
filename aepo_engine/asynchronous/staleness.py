"""Staleness bookkeeping of asynchronous training: the admission rule and the per-step metrics.

Versions: the policy after ``v`` updates is version ``v``; step ``s`` updates version ``s`` (the
proximal policy) into ``s + 1``. A token sampled by version ``u`` and trained at step ``s`` is
``s - u`` versions stale. Admission control keeps every token within ``eta``
(``train.max_staleness``): step ``s``'s prompts start only once the engine holds version
``s - eta`` or later; every token of theirs is sampled by that version or a later one, and all of
them are trained at step ``s`` (the trainer takes steps in order: the oldest data first), so no
token is more than ``eta`` behind and nothing has to be dropped.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["admission_version", "branching_version_gaps", "staleness_metrics", "token_staleness"]


def admission_version(step: int, max_staleness: int, first_version: int = 0) -> int:
    """The oldest policy version that may start step ``step``'s prompts (never before the first
    version the engine is given, ``first_version``)."""
    return max(step - max_staleness, first_version)


def token_staleness(versions: Tensor, loss_mask: Tensor, step: int) -> Tensor:
    """``[B, L]`` long: ``step - version`` on sampled tokens, 0 elsewhere (and where no version was
    recorded)."""
    known = (loss_mask > 0) & (versions >= 0)
    return torch.where(known, step - versions, torch.zeros_like(versions))


def staleness_metrics(versions: Tensor, loss_mask: Tensor, step: int) -> dict[str, float]:
    """The step's staleness histogram (``staleness/tokens_d<d>``: sampled tokens ``d`` versions
    behind), its mean and max, the tokens per policy version (``staleness/tokens_v<v>``), and the
    share of trajectories whose tokens come from more than one version (partial rollouts)."""
    known = (loss_mask > 0) & (versions >= 0)
    stale = (step - versions)[known]
    if stale.numel() == 0:
        return {}
    out = {"staleness/mean": float(stale.double().mean()), "staleness/max": float(stale.max())}
    for d, count in zip(*torch.unique(stale, return_counts=True)):
        out[f"staleness/tokens_d{int(d)}"] = float(count)
        out[f"staleness/tokens_v{step - int(d)}"] = float(count)
    low = torch.where(known, versions, torch.full_like(versions, 1 << 40)).min(-1).values
    high = torch.where(known, versions, torch.full_like(versions, -1)).max(-1).values
    rows = known.any(-1)
    out["staleness/mixed_trajectories"] = float(((high > low) & rows).sum()) / max(int(rows.sum()), 1)
    return out


def branching_version_gaps(trajectories: Sequence[Trajectory]) -> list[int]:
    """For every branch decision: the version that sampled the head of the reacting segment (H_now)
    minus the version that sampled the trajectory's first segment (H_init). 0 in a synchronous run;
    asynchronous runs compare entropies of two policies when it is not (docs/async.md)."""
    gaps = []
    for traj in trajectories:
        if not traj.versions:
            continue
        heads = [traj.versions[seg.start] if seg.end > seg.start else None
                 for seg in traj.segments if seg.kind == "model"]
        for decision in traj.decisions:
            if decision.tool_step < len(heads) and None not in (heads[0], heads[decision.tool_step]):
                gaps.append(heads[decision.tool_step] - heads[0])
    return gaps
