"""The learning-rate schedule the optimizer section (``OptimConfig``, in ``training.config``) describes.

AdamW over all parameters (the policy worker builds it); ``build_lr_scheduler`` gives linear
warm-up, then a constant or cosine schedule. Defaults follow docs/algorithm.md §3 (lr 1e-6
constant, weight decay 0.01, grad clip 1.0).
"""
from __future__ import annotations

import math
import torch

from aepo_engine.training.config import OptimConfig

__all__ = ["OptimConfig", "build_lr_scheduler", "scheduled_lr"]


def scheduled_lr(step: int, optim: OptimConfig, total_steps: int, peak: float = 1.0) -> float:
    """The learning rate at ``step``: linear warm-up to ``peak`` over ``warmup_steps``, then
    constant, or cosine to ``min_lr_ratio * peak`` at ``total_steps``.

    The one copy of the schedule: the RL run's ``LambdaLR`` takes it with ``peak=1`` (a factor of
    the optimizer's lr), the supervised warm start (:mod:`aepo_engine.sft`) with ``peak=lr``.
    ``peak`` multiplies first, so either caller's arithmetic is what it was before they shared it.

    Args:
        step: optimizer steps taken so far (0-based).
        optim: warm-up length, schedule and ``min_lr_ratio``.
        total_steps: optimizer steps over the whole run; the cosine ends there.
        peak: the learning rate after warm-up (1.0: the schedule's factor).

    Returns:
        The learning rate (or factor) for this step.
    """
    if step < optim.warmup_steps:
        return peak * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return peak
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    return peak * (optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
    """Linear warm-up to ``lr`` over ``warmup_steps``, then constant or cosine to ``min_lr_ratio * lr``
    at ``total_steps`` (optimizer steps over the whole run): :func:`scheduled_lr` as a factor."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: scheduled_lr(step, optim, total_steps))
