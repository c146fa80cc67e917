"""AEPO's entropy-guided branching for agents the engine does not own (docs/agents.md).

A step starts ``m`` global episodes per prompt (``agent.global_samples``); the other ``k - m``
slots of the prompt's budget are branches. After each completion that reacts to a tool result an
episode received itself, the gateway takes the paper's decision on the episode's recording:

    P = (alpha + gamma * (H_now - H_init)) * (1 - min(1, penalty_slope * l))

(``aepo_engine.algorithms.branching.branch_probability``; alpha, gamma, tau, the penalty and its
slope from the ``rollout`` section, alpha drawn per decision as the engine's own rollout draws it).
On P > tau with a slot left, the session forks (``Session.branch_of``): the agent is started again
on the same task; its requests up to the fork are answered from the parent's recording (replayed,
nothing sampled), and its request at the fork, which must repeat the parent's (the same tool
result), is sampled anew on a copy of the parent's trajectory up to the tool result. A restarted
agent whose requests differ from the recording (a non-deterministic agent or tool) is served from a
fresh rendering instead, and its branch is dropped and counted (``rollout/replay_divergence``).

When all of a prompt's episodes have ended with slots still free (no decision wanted a branch,
or branches were dropped), fresh global episodes fill them, as the engine's own rollout starts
fresh global samples, so every prompt ends with ``k`` episodes.
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, Callable

from aepo_engine.algorithms.branching import branch_probability
from aepo_engine.gateway.conversation import Session
from aepo_engine.rollout.decisions import branch_alpha, decision_due
from aepo_engine.rollout.trajectory import BranchDecision

__all__ = ["AgentBranching"]


class AgentBranching:
    """One step's branch decisions and budgets (the gateway's ``on_record`` hook).

    Args:
        config: the ``rollout`` section (k, the branch rule).
        seed: the rollout's root seed (alpha's draws).
        spawn: starts an episode on a branch's session (``EpisodeRunner.spawn``).
        fresh: starts a fresh global episode of a prompt: ``fresh(prompt_index, traj_id)``.
    """

    def __init__(self, config: Any, seed: int, spawn: Callable[[Session], None],
                 fresh: Callable[[int, int], None]):
        self.config, self.seed, self.spawn, self.fresh = config, seed, spawn, fresh
        self._lock = threading.Lock()
        self._members: dict[int, int] = {}  # prompt -> episodes started (global, branches, fresh)
        self._running: dict[int, int] = {}
        self.branches = self.fresh_samples = 0

    def start_prompt(self, prompt_index: int, m: int) -> None:
        """The prompt's ``m`` global episodes are starting."""
        with self._lock:
            self._members[prompt_index] = m
            self._running[prompt_index] = m

    def __call__(self, session: Session) -> None:
        """The decision after ``session``'s latest completion, if it reacts to a tool result."""
        traj = session.trajectory
        if traj is None or not decision_due(traj):
            return
        cfg = self.config
        j = len(traj.segments) - 1
        tool_step = sum(s.kind == "tool" for s in traj.segments[:j])
        alpha = branch_alpha(cfg, self.seed, traj, tool_step)
        l_before = traj.consecutive_branches
        h_now = traj.segment_entropies[-1]
        p = branch_probability(alpha, cfg.gamma, h_now - traj.h_init, l_before, cfg.penalty_slope, cfg.branch_penalty)
        wants = p > cfg.tau
        child_id = None
        with self._lock:
            if wants and self._members[traj.prompt_index] < cfg.k:
                child_id = self._members[traj.prompt_index]
                self._members[traj.prompt_index] += 1
                self._running[traj.prompt_index] += 1
        traj.decisions.append(BranchDecision(tool_step=tool_step, h_init=traj.h_init, h_now=h_now, alpha=alpha,
                                             consecutive_branches=l_before, probability=p,
                                             branched=child_id is not None, budget_blocked=wants and child_id is None))
        if child_id is None:
            traj.consecutive_branches = 0
            return
        traj.consecutive_branches = l_before + 1
        child = Session.branch_of(session, j, uuid.uuid4().hex, child_id)
        child.forked.consecutive_branches = child.forked.inherited_branches = l_before + 1
        self.branches += 1
        self.spawn(child)

    def ended(self, session: Session) -> None:
        """An episode of the prompt ended: fill the prompt's free slots with fresh global episodes
        once none of its episodes runs (in the runner's loop)."""
        prompt = session.prompt_index
        with self._lock:
            self._running[prompt] -= 1
            if self._running[prompt] > 0 or self._members[prompt] >= self.config.k:
                return
            first, self._members[prompt] = self._members[prompt], self.config.k
            self._running[prompt] = self.config.k - first
        for traj_id in range(first, self.config.k):
            self.fresh_samples += 1
            self.fresh(prompt, traj_id)
