"""The optimizer section (``OptimConfig``) and the learning-rate schedule it describes.

AdamW over all parameters (the policy worker builds it); ``build_lr_scheduler`` gives linear
warm-up, then a constant or cosine schedule. Defaults follow docs/algorithm.md §3 (lr 1e-6
constant, weight decay 0.01, grad clip 1.0).
"""
from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch

from aepo_engine.errors import require

__all__ = ["OptimConfig", "build_lr_scheduler", "scheduled_lr"]


class OptimConfig(msgspec.Struct, kw_only=True):
    """AdamW optimizer and learning-rate schedule.

    Attributes:
        lr: Peak learning rate (reference runs: 1e-6, constant).
        weight_decay: Decoupled (AdamW) weight decay.
        grad_clip: Clip the global gradient norm to this value; 0 turns clipping off.
        betas: AdamW (beta1, beta2).
        eps: AdamW epsilon.
        warmup_steps: Linear warm-up from 0 to lr over this many optimizer steps; 0 = no warm-up.
        schedule: After warm-up: "constant" keeps lr, "cosine" decays to min_lr_ratio * lr by the last step.
        min_lr_ratio: Final lr as a fraction of lr for the cosine schedule.
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        require(all(0 <= b < 1 for b in self.betas),
                f"betas must lie in [0, 1) because AdamW divides by 1 - beta**t, got {self.betas}")
        require(self.eps > 0, f"eps must be > 0 because AdamW divides by sqrt(v) + eps, got {self.eps}")
        require(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        require(self.schedule == "cosine" or self.min_lr_ratio == 0,
                "min_lr_ratio only applies to schedule='cosine'; set schedule='cosine' or leave it at 0")


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
