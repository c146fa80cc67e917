"""A prompt's global samples (docs/algorithm.md §1a; docs/rollouts.md, steps 1 and 4): entropy
pre-monitoring, which sets their number m from a probe's H_root and H_tool, the speculative
globals started beside the probe, the reserve of those beyond m, and the refills of a prompt
whose trajectories all ended with fewer than k.

The rules, as pure functions of entropies: the probe's H_tool (:func:`tool_entropy`), the bound
m_max that H_root alone sets (:func:`most_global_samples`), when the probe has told enough
(:func:`evidence_ready`). :class:`PreMonitoring` runs a prompt by them, round after round.
"""
from __future__ import annotations

from typing import Sequence

from aepo_engine.algorithms.branching import global_sample_count
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.decisions import Branching
from aepo_engine.rollout.state import PromptState
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["PreMonitoring", "evidence_ready", "most_global_samples", "tool_entropy"]

# Entropies are >= 0; float rounding can put a mean a hair below. m_max is the m of this H_tool,
# so it bounds m for any H_tool the probe can report.
_H_TOOL_FLOOR = -1e-3


def most_global_samples(k: int, beta: float, h_root: float) -> int:
    """m_max: the most global samples any probe with this H_root can set (the m of H_tool = 0)."""
    return global_sample_count(k, beta, h_root, _H_TOOL_FLOOR)


def tool_entropy(segment_entropies: Sequence[float], monitor_tool_steps: int | None) -> float:
    """H_tool of a probe whose model segments have these head entropies: the mean over its
    post-tool segments (the first ``monitor_tool_steps`` of them; None: all), each weighted
    equally; without any (no tool call) its H_root, the neutral value."""
    after_tool = segment_entropies[1:][:monitor_tool_steps]
    return sum(after_tool) / len(after_tool) if after_tool else segment_entropies[0]


def evidence_ready(ended: bool, segment_entropies: Sequence[float], monitor_tool_steps: int | None) -> bool:
    """The probe has ended, or has (with these model segments' entropies) the post-tool segments
    ``monitor_tool_steps`` asks for."""
    return ended or (monitor_tool_steps is not None and len(segment_entropies) - 1 >= monitor_tool_steps)


class PreMonitoring:
    """Starts a rollout's prompts and, after each round, sets m once the probe has told enough or
    refills a prompt whose trajectories all ended.

    Args:
        config: the rollout knobs (k, beta, ``pre_monitoring``, the ``experimental`` scheduling).
        branching: takes the decisions that waited for m, and those of a resumed reserve sample.
    """

    def __init__(self, config: RolloutConfig, branching: Branching) -> None:
        self.config = config
        self.branching = branching

    def start(self, state: PromptState) -> None:
        """The prompt's first trajectories: the probe and speculative globals, or m globals."""
        cfg = self.config
        if cfg.branching and cfg.pre_monitoring:
            state.probe = state.new("probe")
            if cfg.experimental.reuse_probe_as_sample:
                state.members.append(state.probe)
            state.speculative = [state.new("global") for _ in range(cfg.speculative_globals)]
            return
        state.m = cfg.global_samples_without_monitoring if cfg.branching else cfg.k
        for _ in range(state.m):
            state.members.append(state.new("global"))

    def advance(self, state: PromptState) -> None:
        """After a round: finish pre-monitoring, or refill a prompt whose trajectories all ended."""
        stats = state.stats
        if state.m is None:
            probe = state.probe  # as of the round the rules read (it may have sampled ahead)
            if not evidence_ready(state.ended(probe), state.seen_entropies(probe),
                                  self.config.experimental.monitor_tool_steps):
                if state.certain_slots is None and state.probe.segment_entropies:  # after its first segment
                    self._bound_m(state)
                return
            self._finish_probe(state)
        missing = self.config.k - len(state.members)
        if missing > 0 and not state.running():
            resumed, state.reserve = state.reserve[:missing], state.reserve[missing:]
            state.members.extend(resumed)
            for _ in range(missing - len(resumed)):
                state.members.append(state.new("global"))
            stats.fresh_global_samples += missing
            for traj in resumed:  # the budget is spent now: recorded as blocked decisions
                self._decide_late(state, traj)
        if state.m is not None and len(state.members) == self.config.k and state.reserve:
            state.discard_reserve()  # no refill can need it any more

    def _bound_m(self, state: PromptState) -> None:
        """H_root is known: m <= m_max. Free the k - m_max branch slots every m leaves, and top
        the speculative globals up to the most that any m keeps (``speculative_top_up``)."""
        cfg = self.config
        m_max = most_global_samples(cfg.k, cfg.beta, state.probe.segment_entropies[0])
        state.certain_slots = cfg.k - m_max if cfg.experimental.branch_before_m else 0
        if cfg.speculative_top_up:
            most_kept = m_max - int(cfg.experimental.reuse_probe_as_sample)
            for _ in range(most_kept - len(state.speculative)):
                state.speculative.append(state.new("global"))

    def _finish_probe(self, state: PromptState) -> None:
        """Set m from the probe; keep the speculative globals it covers, put the rest in reserve,
        start the missing ones; let the decisions that waited for m claim what is left."""
        cfg, probe, stats = self.config, state.probe, state.stats
        state.h_root = probe.segment_entropies[0]
        state.h_tool = tool_entropy(state.seen_entropies(probe), cfg.experimental.monitor_tool_steps)
        state.m = global_sample_count(cfg.k, cfg.beta, state.h_root, state.h_tool)
        reused = cfg.experimental.reuse_probe_as_sample
        wanted = state.m - int(reused)
        kept, state.reserve = state.speculative[:wanted], state.speculative[wanted:]
        state.speculative = []
        for traj in state.reserve:
            self._to_reserve(state, traj)
        state.members.extend(kept)
        for _ in range(wanted - len(kept)):
            state.members.append(state.new("global"))
        state.probe = None  # a reused probe goes on as a member; a discarded one stops here
        if not reused:
            stats.discarded_probes += 1
            stats.discarded_tokens += sum(probe.loss_mask)
        if len(state.members) > cfg.k:
            raise RuntimeError(f"prompt {state.index}: {len(state.members)} trajectories for "
                               f"k={cfg.k}: a branch before m took a slot m did not leave")
        # The decisions that waited for m claim what is left, in the order they were taken.
        pending, state.pending, state.waiting = state.pending, [], set()
        stats.waited_decisions += len(pending)
        for traj, seg_index, h_now in pending:
            if any(traj is member for member in state.members):  # not in reserve, not dropped
                self.branching.decide(state, traj, seg_index, h_now)
        for child in state.tentative.values():  # their decisions found no slot
            state.count_discarded_child(child)
        state.tentative = {}

    @staticmethod
    def _to_reserve(state: PromptState, traj: Trajectory) -> None:
        """Put a speculative global beyond m in reserve: as a refill it is a fresh global sample
        that can no longer branch, so the branches it took are dropped (their own tokens counted
        as discarded) and its decisions are forgotten (a refill takes them again, blocked)."""
        dropped = [t for t in state.members if state.roots.get(t.traj_id) == traj.traj_id]
        for child in dropped:
            state.members.remove(child)
            state.count_discarded_child(child)
        traj.decisions.clear()
        traj.consecutive_branches = 0

    def _decide_late(self, state: PromptState, traj: Trajectory) -> None:
        """Take the decisions of every model segment of ``traj`` that reacts to a tool result,
        in order (a resumed reserve sample has taken none), as of the round the rules read: a
        later segment's decision is taken in its own round."""
        model_segments = [j for j, s in enumerate(state.seen_segments(traj)) if s.kind == "model"]
        for n_model, seg_index in enumerate(model_segments[1:], start=1):
            self.branching.decide(state, traj, seg_index, traj.segment_entropies[n_model])
