"""The branch decisions (docs/algorithm.md §1c; docs/rollouts.md, step 3): after the segment that
reacts to a tool result, P = (alpha + gamma * (H_now - H_init)) * (1 - min(1, penalty_slope * l))
(:func:`aepo_engine.algorithms.branching.branch_probability`); on P > tau a child copies the
trajectory up to the tool result if the prompt's budget has a slot left.

The rules, as pure functions of entropies and counters: when a decision is due
(:func:`decision_due`), its base probability alpha (:func:`branch_alpha`), the branch slots
(:func:`free_slots`, :func:`slot_left`). :class:`Branching` applies them to a prompt: a decision
taken now, or left waiting for m (with a tentative child), and the pre-sampled children.
"""
from __future__ import annotations

import numpy as np

from aepo_engine.algorithms.branching import branch_probability
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.seeds import ALPHA, derive_seed
from aepo_engine.rollout.state import PromptState
from aepo_engine.rollout.trajectory import BranchDecision, Trajectory

__all__ = ["Branching", "branch_alpha", "decision_due", "free_slots", "slot_left"]


def decision_due(traj: Trajectory, seg_index: int | None = None) -> bool:
    """The model segment ``seg_index`` (None: the last segment) reacts to a tool result this
    trajectory received itself."""
    segs = traj.segments
    j = len(segs) - 1 if seg_index is None else seg_index
    return j >= 1 and segs[j - 1].kind == "tool" and segs[j].start != traj.branch_position


def branch_alpha(config: RolloutConfig, seed: int, traj: Trajectory, tool_step: int) -> float:
    """alpha of ``traj``'s decision after its ``tool_step``-th tool result: ``branch_alpha``, or
    in ``"random"`` mode a U(0, 1) draw seeded by the decision (``seed``: the rollout's root)."""
    if config.branch_alpha_mode == "random":
        draw_seed = derive_seed(seed, traj.step, traj.prompt_index, traj.traj_id, tool_step, ALPHA)
        return float(np.random.default_rng(draw_seed).random())
    return config.branch_alpha


def free_slots(k: int, m: int | None, members: int, early_branches: int, certain_slots: int | None) -> int:
    """Branch slots certainly free: with m known, k less the prompt's ``members``; before m, the
    ``certain_slots`` (k - m_max, None before H_root) less the ``early_branches`` taken."""
    if m is not None:
        return k - members
    return (certain_slots or 0) - early_branches


def slot_left(k: int, m: int | None, members: int, early_branches: int, certain_slots: int | None) -> bool | None:
    """A branch slot is free (True), taken (False), or depends on the unknown m (None)."""
    if free_slots(k, m, members, early_branches, certain_slots) > 0:
        return True
    return None if m is None else False


class Branching:
    """The branch decisions of a rollout's prompts.

    Args:
        config: the rollout knobs (the branch rule, k, the ``experimental`` scheduling).
        seed: the rollout's root seed (the draws of alpha).
    """

    def __init__(self, config: RolloutConfig, seed: int) -> None:
        self.config = config
        self.seed = seed

    def decides(self, state: PromptState, traj: Trajectory) -> bool:
        """``traj`` takes branch decisions: it will be returned if its prompt's m keeps it (a
        discarded probe never is, a reserve sample only once a refill resumes it)."""
        if any(traj is t for t in state.reserve):
            return False
        return traj is not state.probe or self.config.experimental.reuse_probe_as_sample

    def after_segment(self, state: PromptState, traj: Trajectory, seg_index: int | None = None) -> None:
        """Take the decision due after ``traj``'s model segment ``seg_index`` (None: its latest
        segment), if it has one of its own."""
        j = len(traj.segments) - 1 if seg_index is None else seg_index
        if decision_due(traj, j) and self.decides(state, traj):
            n_model = sum(s.kind == "model" for s in traj.segments[:j])
            self.take(state, traj, j, traj.segment_entropies[n_model])

    def take(self, state: PromptState, traj: Trajectory, seg_index: int, h_now: float) -> None:
        """Decide now, or leave the decision waiting for m (with the trajectory's later ones:
        their l depends on its outcome)."""
        if traj.traj_id in state.waiting:
            state.pending.append((traj, seg_index, h_now))
        elif not self.decide(state, traj, seg_index, h_now):
            state.waiting.add(traj.traj_id)
            state.pending.append((traj, seg_index, h_now))
            if len(state.tentative) < self.config.experimental.speculative_branches:
                self._start_tentative(state, traj, seg_index)

    def decide(self, state: PromptState, traj: Trajectory, seg_index: int, h_now: float) -> bool:
        """Take the branch decision for the model segment ``traj.segments[seg_index]``; False
        (nothing recorded) when it wants a branch slot whose existence depends on m."""
        cfg = self.config
        tool_step = sum(s.kind == "tool" for s in traj.segments[:seg_index])
        alpha = branch_alpha(cfg, self.seed, traj, tool_step)
        l_before = traj.consecutive_branches
        p = branch_probability(alpha, cfg.gamma, h_now - traj.h_init, l_before,
                               cfg.penalty_slope, cfg.branch_penalty)
        wants = p > cfg.tau
        slot = slot_left(cfg.k, state.m, len(state.members), state.early_branches,
                         state.certain_slots) if wants else False
        if slot is None:
            return False
        if slot:
            traj.consecutive_branches = l_before + 1
            key = (traj.traj_id, seg_index)
            child = (state.tentative.pop(key, None) or state.presampled.pop(key, None)
                     or state.fork(traj, seg_index))
            child.consecutive_branches = child.inherited_branches = l_before + 1
            state.members.append(child)
            state.early_branches += int(state.m is None)
        else:
            traj.consecutive_branches = 0
        traj.decisions.append(BranchDecision(
            tool_step=tool_step, h_init=traj.h_init, h_now=h_now, alpha=alpha,
            consecutive_branches=l_before, probability=p, branched=slot,
            budget_blocked=wants and not slot))
        return True

    def presample(self, state: PromptState) -> None:
        """Start the would-be children of this round's decisions, one per certainly free slot
        (docs/rollouts.md, "Pre-sampled children")."""
        free = free_slots(self.config.k, state.m, len(state.members), state.early_branches,
                          state.certain_slots)
        for traj in sorted(state.running(), key=lambda t: t.traj_id):
            if free <= 0:
                return
            segs = state.seen_segments(traj)  # those of the round schedule's round
            if (traj.traj_id in state.waiting or not segs or segs[-1].kind != "tool"
                    or segs[-1].end == traj.branch_position or not self.decides(state, traj)):
                continue  # no decision of its own follows this round, or it waits for m
            state.presampled[(traj.traj_id, len(segs))] = state.fork(traj, len(segs))
            free -= 1

    @staticmethod
    def _start_tentative(state: PromptState, traj: Trajectory, seg_index: int) -> None:
        """Start now the child a waiting decision (it wants a branch) gets if m leaves it a slot,
        so that it does not start rounds late; it takes no decision of its own before that."""
        child = state.presampled.pop((traj.traj_id, seg_index), None) or state.fork(traj, seg_index)
        child.consecutive_branches = child.inherited_branches = traj.consecutive_branches + 1
        state.waiting.add(child.traj_id)
        state.tentative[(traj.traj_id, seg_index)] = child
