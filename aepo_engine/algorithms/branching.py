"""The entropy-balanced rollout's maths (docs/algorithm.md §1a, §1c), as pure functions.

    m = clamp(floor(k * sigmoid(beta * (H_root - H_tool))) + 1, 1, k)           (§1a)
    P = (alpha + gamma * (H_now - H_init)) * (1 - min(1, penalty_slope * l))   (§1c)

The rollout applies them (``aepo_engine.rollout.monitoring``: m; ``aepo_engine.rollout.decisions``:
P); the tests check them by hand.
"""
from __future__ import annotations

import math

__all__ = ["branch_probability", "global_sample_count", "sigmoid"]


def sigmoid(x: float) -> float:
    """Numerically safe logistic function."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def global_sample_count(k: int, beta: float, h_root: float, h_tool: float) -> int:
    """m = clamp(floor(k * sigmoid(beta * (h_root - h_tool))) + 1, 1, k)  (docs/algorithm.md §1a)."""
    m = math.floor(k * sigmoid(beta * (h_root - h_tool))) + 1
    return min(max(m, 1), k)


def branch_probability(alpha: float, gamma: float, delta_h: float, consecutive_branches: int,
                       penalty_slope: float, penalty: bool = True) -> float:
    """P = (alpha + gamma * dH) * (1 - min(1, penalty_slope * l)) (docs/algorithm.md §1c); no
    penalty: ARPO."""
    phat = min(1.0, penalty_slope * consecutive_branches) if penalty else 0.0
    return (alpha + gamma * delta_h) * (1.0 - phat)
