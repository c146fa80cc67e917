"""Per-step measurements of a rollout: diversity, entropy tail, tree depth (cheap, no model pass).

What the algorithm comparison logs per training step (``train.py`` writes them to metrics.jsonl
under the names below). All of it is computed from the step's trajectories and the entropies the
trainer already has; at k = 8 the pairwise part is 28 set comparisons per prompt.

Rollout diversity, per prompt (its k trajectories), then averaged over the step's prompts:
- ``diversity/distinct_answers``: distinct final answers, where a final answer is the answer the
  reward read (``RewardResult.details["answer"]``), normalised by :func:`normalize_answer`
  (SQuAD: case, punctuation, articles, whitespace). Trajectories without an answer (a format
  error, a reward that reports none) are left out: 8 unanswered responses give 0, not 1.
- ``diversity/distinct_tool_sequences``: distinct sequences of executed tool calls, a call being
  its ``(tool, payload.strip())`` pair; the empty sequence (no call) is one sequence too.
- ``diversity/pairwise_distance``: mean over the k(k-1)/2 pairs of ``1 - |A & B| / |A | B|``
  (token-set Jaccard distance) where A, B are the sets of token ids the model wrote itself
  (loss-mask 1: tool results left out, they follow from the calls); two empty sets are at 0.
  A set distance ignores order and counts: cheap, and 0 only for responses made of the same ids.

Policy entropy of the valid (model-written) response tokens of the step, from the trainer's
no-grad pass (the old policy, the one that sampled): ``entropy/mean``, ``entropy/p90``,
``entropy/p99`` (linear-interpolated quantiles, numpy's default) and ``entropy/high_frac``, the
share of tokens whose entropy exceeds ``logging.high_entropy_threshold`` nats.

Tree depth: a trajectory's depth is the number of branchings in its lineage (probe and global
samples 0, a branch of a global sample 1, a branch of that branch 2, ...); a branch whose parent
is not among the returned trajectories still counts 1 more than nothing known, i.e. 1.
``rollout/tree_depth_mean`` is the mean over prompts of their tree's deepest trajectory,
``rollout/tree_depth_max`` the deepest of the step, ``rollout/branch_depth_mean`` the mean depth of
the branch trajectories alone (0 when none branched).

Branching mechanisms (:func:`branching_metrics`), from the branch decisions the returned
trajectories took (``Trajectory.decisions``; a decision of a discarded trajectory is not counted):
- ``rollout/branches_per_traj``: branches taken / trajectories returned; ``rollout/branches_per_traj_max``:
  the most branches one trajectory took; ``rollout/branch_concentration``: per prompt with a branch,
  the share of its branches taken by its most-branching trajectory (1: all from one), mean over those prompts;
- runs of consecutive branched tool steps along a lineage (what the consecutive-branch penalty of
  docs/algorithm.md §1c acts on): a branch taken with l = ``consecutive_branches`` (the lineage's run before the
  decision) is the (l + 1)-th branch of its run. ``rollout/branch_run_max``: the longest run of the
  step (0 without branches); ``rollout/branch_run_mean``: the mean of l + 1 over the branches taken;
  ``rollout/consecutive_branch_share``: the share of branches taken with l >= 1;
- ``rollout/penalty_decisive``: decisions the penalty decides, i.e. P without it
  (alpha + gamma dH) > tau >= P with it; with the penalty on they were not branched, with it off
  (ARPO) they were the branches it would have stopped (budget permitting); ``rollout/penalty_decisive_share``:
  the same over all decisions (left out without decisions).
Pre-monitoring (:func:`premonitoring_metrics`, docs/algorithm.md §1a), from the rollout statistics:
``rollout/m_min`` / ``rollout/m_max`` (the global budget m over the step's prompts; its mean is
``rollout/global_samples``), ``rollout/h_root_mean`` / ``rollout/h_tool_mean`` (prompts that were
pre-monitored; left out without pre-monitoring).

Left out: embedding-based (semantic) distances, which need a model pass; edit distances (order
aware, but O(n^2) per pair).
"""
from __future__ import annotations

from itertools import combinations
from typing import Iterable, Sequence

import numpy as np

from aepo_engine.algorithms.branching import branch_probability
from aepo_engine.rewards.text import normalize_answer
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["jaccard_distance", "normalized_answer", "tool_sequence", "tree_depths", "diversity_metrics",
           "entropy_tail_metrics", "depth_metrics", "branching_metrics", "premonitoring_metrics"]


def normalized_answer(answer: object) -> str | None:
    """The SQuAD-normalised answer string, or None for no answer (None or empty after normalising)."""
    if answer is None:
        return None
    text = normalize_answer(str(answer))
    return text or None


def tool_sequence(traj: Trajectory) -> tuple[tuple[str, str], ...]:
    """The executed calls of a trajectory as ``(tool, payload.strip())`` pairs, in order."""
    return tuple((record.tool, record.payload.strip()) for record in traj.tool_log)


def jaccard_distance(a: set[int], b: set[int]) -> float:
    """``1 - |a & b| / |a | b|``; 0.0 for two empty sets."""
    union = len(a | b)
    return 1.0 - len(a & b) / union if union else 0.0


def model_token_set(traj: Trajectory) -> set[int]:
    """The ids of the response tokens the model wrote (loss mask 1)."""
    return {tok for tok, keep in zip(traj.response_ids, traj.loss_mask) if keep}


def _groups(trajectories: Sequence[Trajectory], values: Sequence) -> dict[int, list[tuple[Trajectory, object]]]:
    groups: dict[int, list[tuple[Trajectory, object]]] = {}
    for traj, value in zip(trajectories, values):
        groups.setdefault(traj.prompt_index, []).append((traj, value))
    return groups


def diversity_metrics(trajectories: Sequence[Trajectory], answers: Sequence[object]) -> dict[str, float]:
    """Rollout diversity per prompt, averaged over prompts (module docstring).

    Args:
        trajectories: the step's trajectories (any order; grouped by ``prompt_index``).
        answers: the final answer of each trajectory as the reward read it (None: no answer).
    Returns:
        ``diversity/distinct_answers``, ``diversity/distinct_tool_sequences``,
        ``diversity/pairwise_distance``; zeros for no trajectories.
    """
    if len(trajectories) != len(answers):
        raise ValueError(f"{len(trajectories)} trajectories but {len(answers)} answers")
    per_prompt = []
    for members in _groups(trajectories, answers).values():
        normalised = {normalized_answer(a) for _, a in members} - {None}
        sequences = {tool_sequence(t) for t, _ in members}
        sets = [model_token_set(t) for t, _ in members]
        pairs = [jaccard_distance(a, b) for a, b in combinations(sets, 2)]
        per_prompt.append((len(normalised), len(sequences), float(np.mean(pairs)) if pairs else 0.0))
    means = np.mean(per_prompt, axis=0) if per_prompt else np.zeros(3)
    return {"diversity/distinct_answers": float(means[0]), "diversity/distinct_tool_sequences": float(means[1]),
            "diversity/pairwise_distance": float(means[2])}


def entropy_tail_metrics(entropies: Iterable[float] | np.ndarray, threshold: float) -> dict[str, float]:
    """Mean, p90, p99 and the share above ``threshold`` of per-token entropies (nats).

    Args:
        entropies: the entropies of the valid tokens only (already masked).
        threshold: the fixed entropy (nats) above which a token counts as high-entropy.
    Returns:
        ``entropy/mean``, ``entropy/p90``, ``entropy/p99``, ``entropy/high_frac``; zeros for no tokens.
    """
    values = np.asarray(entropies, dtype=np.float64).ravel()
    if values.size == 0:
        return {"entropy/mean": 0.0, "entropy/p90": 0.0, "entropy/p99": 0.0, "entropy/high_frac": 0.0}
    p90, p99 = np.quantile(values, [0.9, 0.99])
    return {"entropy/mean": float(values.mean()), "entropy/p90": float(p90), "entropy/p99": float(p99),
            "entropy/high_frac": float((values > threshold).mean())}


def tree_depths(trajectories: Sequence[Trajectory]) -> dict[tuple[int, int], int]:
    """``(prompt_index, traj_id) -> depth`` (branchings in the lineage; module docstring)."""
    by_id = {(t.prompt_index, t.traj_id): t for t in trajectories}
    depths: dict[tuple[int, int], int] = {}

    def depth(key: tuple[int, int]) -> int:
        if key not in depths:
            traj = by_id[key]
            parent = (traj.prompt_index, traj.parent_id)
            if traj.kind != "branch":
                depths[key] = 0
            else:  # parent ids are smaller than the child's: the recursion ends
                depths[key] = 1 + (depth(parent) if parent in by_id else 0)
        return depths[key]

    for key in by_id:
        depth(key)
    return depths


def depth_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout/tree_depth_mean``, ``rollout/tree_depth_max``, ``rollout/branch_depth_mean``."""
    depths = tree_depths(trajectories)
    per_prompt: dict[int, int] = {}
    for (prompt, _), d in depths.items():
        per_prompt[prompt] = max(per_prompt.get(prompt, 0), d)
    branch = [d for (p, i), d in depths.items() if d > 0]
    return {"rollout/tree_depth_mean": float(np.mean(list(per_prompt.values()))) if per_prompt else 0.0,
            "rollout/tree_depth_max": float(max(per_prompt.values(), default=0)),
            "rollout/branch_depth_mean": float(np.mean(branch)) if branch else 0.0}


def branching_metrics(trajectories: Sequence[Trajectory], config: RolloutConfig) -> dict[str, float]:
    """Branches per trajectory, their concentration, runs of consecutive branches and the
    decisions the consecutive-branch penalty decides (module docstring).

    Args:
        trajectories: the step's returned trajectories.
        config: the rollout section (gamma, tau, penalty_slope of the branch rule).
    Returns:
        The ``rollout/`` branching measures; zeros for a step without decisions (the shares that
        need a decision or a branch are left out).
    """
    decisions = [d for t in trajectories for d in t.decisions]
    taken = [d for d in decisions if d.branched]
    per_traj = [sum(d.branched for d in t.decisions) for t in trajectories]
    by_prompt: dict[int, list[int]] = {}
    for traj, count in zip(trajectories, per_traj):
        by_prompt.setdefault(traj.prompt_index, []).append(count)
    concentration = [max(c) / sum(c) for c in by_prompt.values() if sum(c) > 0]
    decisive = 0
    for d in decisions:
        without = branch_probability(d.alpha, config.gamma, d.h_now - d.h_init, d.consecutive_branches,
                                     config.penalty_slope, penalty=False)
        with_penalty = branch_probability(d.alpha, config.gamma, d.h_now - d.h_init, d.consecutive_branches,
                                          config.penalty_slope, penalty=True)
        decisive += without > config.tau >= with_penalty
    runs = [d.consecutive_branches + 1 for d in taken]
    out = {"rollout/branches_per_traj": len(taken) / len(trajectories) if trajectories else 0.0,
           "rollout/branches_per_traj_max": float(max(per_traj, default=0)),
           "rollout/branch_run_max": float(max(runs, default=0)),
           "rollout/penalty_decisive": float(decisive)}
    if concentration:
        out["rollout/branch_concentration"] = float(np.mean(concentration))
    if runs:
        out["rollout/branch_run_mean"] = float(np.mean(runs))
        out["rollout/consecutive_branch_share"] = float(np.mean([r > 1 for r in runs]))
    if decisions:
        out["rollout/penalty_decisive_share"] = decisive / len(decisions)
    return out


def premonitoring_metrics(m: Sequence[int], h_root: Sequence[float | None],
                          h_tool: Sequence[float | None]) -> dict[str, float]:
    """``rollout/m_min``, ``rollout/m_max`` and, over pre-monitored prompts, ``rollout/h_root_mean``
    and ``rollout/h_tool_mean`` (module docstring).

    Args:
        m, h_root, h_tool: per prompt, as in ``RolloutStats`` (None: not pre-monitored).
    """
    if not len(m) == len(h_root) == len(h_tool):
        raise ValueError(f"per-prompt lists differ in length: {len(m)}, {len(h_root)}, {len(h_tool)}")
    out = {"rollout/m_min": float(min(m, default=0)), "rollout/m_max": float(max(m, default=0))}
    roots = [h for h in h_root if h is not None]
    tools = [h for h in h_tool if h is not None]
    if roots:
        out["rollout/h_root_mean"] = float(np.mean(roots))
    if tools:
        out["rollout/h_tool_mean"] = float(np.mean(tools))
    return out
