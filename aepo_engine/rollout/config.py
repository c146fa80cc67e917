"""Configuration of the entropy-balanced rollout (spec §1): one frozen struct, one source of truth.

Every field carries its help text as the comment above it. Defaults follow the reference scripts
(spec §3) where they exist. ``__post_init__`` rejects values and combinations that cannot work and
says why. Load from a file / override from the command line with ``msgspec.convert`` on a dict.
"""
from __future__ import annotations

from typing import Literal

import msgspec


class RolloutConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Knobs of :class:`aepo_engine.rollout.scheduler.EntropyBalancedRollout`."""

    # Trajectories per prompt (the GRPO group size). The rollout returns exactly k per prompt.
    k: int = 12
    # Entropy pre-monitoring (spec §1a): run one probe trajectory per prompt and derive the number
    # m of global samples from H_root and H_tool. Off: m = fixed_global_samples. Ignored (m = k,
    # no probe) when `branching` is off, because then m has nothing to trade against.
    pre_monitoring: bool = True
    # Slope of the sigmoid in m = floor(k * sigmoid(beta * (H_root - H_tool))) + 1.
    beta: float = 0.5
    # Keep the probe trajectory as one of the m global samples (it is a valid on-policy sample);
    # False throws it away like the reference code (costs one extra trajectory per prompt).
    reuse_probe_as_sample: bool = True
    # Global samples per prompt when pre-monitoring is off; None means max(1, k // 2) (the
    # reference scripts' fixed m = k/2).
    fixed_global_samples: int | None = None
    # n_e: entropies are measured as the mean over the first n_e tokens of a model segment.
    n_entropy_tokens: int = 20
    # Branch at tool-call steps (spec §1c). Off: k independent samples (plain GRPO rollout).
    branching: bool = True
    # Base term alpha of the branch probability: "random" draws alpha ~ U(0, 1) per decision from
    # a seeded generator (reference code); "constant" uses `branch_alpha` (paper formula).
    branch_alpha_mode: Literal["random", "constant"] = "random"
    # alpha for branch_alpha_mode="constant". With tau = 0.5 and no penalty, 0.5 means "branch iff
    # the entropy after the tool result rose above the trajectory's initial entropy".
    branch_alpha: float = 0.5
    # Weight of the entropy change dH = H_now - H_init in the branch probability.
    gamma: float = 0.2
    # Branch threshold: branch when P > tau.
    tau: float = 0.5
    # Consecutive-branch penalty Phat(l) = min(1, penalty_slope * l).
    penalty_slope: float = 0.05
    # Apply the consecutive-branch penalty (AEPO). False gives ARPO's branching rule.
    branch_penalty: bool = True
    # Cap on response tokens (model and tool-result tokens together) per trajectory.
    max_response_tokens: int = 6192
    # Cap on tokens generated in one segment (one backend call); a segment that hits it ends the
    # trajectory with finish reason "length".
    max_tokens_per_segment: int = 6192
    # Tool calls executed per trajectory; a further call ends the trajectory ("tool_limit").
    max_tool_calls: int = 6
    # Sampling temperature and nucleus top-p passed to the backend.
    temperature: float = 1.0
    top_p: float = 1.0
    # Root seed: every sampling seed and every branching draw derives from (seed, step, prompt
    # index, trajectory id, ...), so the same seed reproduces the same rollouts.
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.k >= 1, f"k must be >= 1 because each prompt needs a group, got {self.k}")
        _check(self.beta >= 0, f"beta must be >= 0 so higher H_root never lowers m, got {self.beta}")
        if self.fixed_global_samples is not None:
            _check(1 <= self.fixed_global_samples <= self.k,
                   f"fixed_global_samples must be in [1, k={self.k}] because global samples are "
                   f"part of the k trajectories, got {self.fixed_global_samples}")
        _check(self.n_entropy_tokens >= 1,
               f"n_entropy_tokens must be >= 1 to measure any entropy, got {self.n_entropy_tokens}")
        _check(self.branch_alpha_mode in ("random", "constant"),
               f"branch_alpha_mode must be 'random' or 'constant', got {self.branch_alpha_mode!r}")
        _check(0.0 <= self.branch_alpha <= 1.0,
               f"branch_alpha must be in [0, 1] (a base probability), got {self.branch_alpha}")
        _check(self.gamma >= 0, f"gamma must be >= 0 so an entropy rise never lowers P, got "
                                f"{self.gamma}")
        _check(self.tau > 0,
               f"tau must be > 0 so that a zero or negative P never branches, got {self.tau}")
        _check(self.penalty_slope >= 0,
               f"penalty_slope must be >= 0 so branching more never raises P, got "
               f"{self.penalty_slope}")
        _check(self.max_response_tokens >= 1,
               f"max_response_tokens must be >= 1, got {self.max_response_tokens}")
        _check(1 <= self.max_tokens_per_segment <= self.max_response_tokens,
               f"max_tokens_per_segment must be in [1, max_response_tokens="
               f"{self.max_response_tokens}] because a segment is part of the response, got "
               f"{self.max_tokens_per_segment}")
        _check(self.max_tool_calls >= 0, f"max_tool_calls must be >= 0, got {self.max_tool_calls}")
        _check(self.temperature > 0,
               f"temperature must be > 0 because entropies and log-probs are taken under "
               f"softmax(z / T), got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.seed >= 0, f"seed must be >= 0 (numpy SeedSequence), got {self.seed}")

    @property
    def global_samples_without_monitoring(self) -> int:
        """m when pre-monitoring is off: ``fixed_global_samples`` or max(1, k // 2)."""
        if self.fixed_global_samples is not None:
            return self.fixed_global_samples
        return max(1, self.k // 2)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
