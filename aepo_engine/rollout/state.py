"""One prompt during a rollout call (:class:`PromptState`): its trajectories by role (members, the
probe, speculative globals, the reserve, children that wait on or anticipate a decision), what
pre-monitoring has found, and the bookkeeping of trajectories it creates and discards.

What the roles mean and how a prompt moves through them: docs/rollouts.md, "The scheduler, step
by step"; the rules that move it are :mod:`aepo_engine.rollout.monitoring` (global samples) and
:mod:`aepo_engine.rollout.decisions` (branches).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aepo_engine.rollout.stats import RolloutCounters
from aepo_engine.rollout.trajectory import Segment, Trajectory, TrajectoryKind

__all__ = ["PromptState", "state_key"]


def state_key(traj: Trajectory) -> tuple[int, int]:
    """A trajectory's prompt state key: ``(step, prompt index)``."""
    return traj.step, traj.prompt_index


@dataclass
class PromptState:
    """The trajectories of one prompt during a rollout call; ``step`` and ``stats`` are those of
    the call (the training step its prompts are for, and its counters)."""

    index: int
    prompt_ids: list[int]
    step: int = 0
    stats: RolloutCounters = field(default_factory=RolloutCounters)
    members: list[Trajectory] = field(default_factory=list)  # returned; at most k
    probe: Trajectory | None = None      # while probing, and afterwards if discarded
    speculative: list[Trajectory] = field(default_factory=list)  # globals started while probing
    reserve: list[Trajectory] = field(default_factory=list)  # speculative beyond m, not members
    m: int | None = None                 # global samples; None while probing
    h_root: float | None = None
    h_tool: float | None = None
    next_id: int = 0
    # Before m is known (docs/rollouts.md, "Decisions before m"):
    certain_slots: int | None = None     # k - m_max once H_root is known (0: branch_before_m off)
    early_branches: int = 0              # children created while m was unknown
    waiting: set[int] = field(default_factory=set)  # ids of trajectories whose decisions wait
    pending: list[tuple[Trajectory, int, float]] = field(default_factory=list)  # (traj, segment, H_now)
    roots: dict[int, int] = field(default_factory=dict)  # branch id -> id of its root trajectory
    # children started for waiting decisions, keyed by (parent id, segment index)
    tentative: dict[tuple[int, int], Trajectory] = field(default_factory=dict)
    # would-be children sampling beside their parent's reaction this round (same key)
    presampled: dict[tuple[int, int], Trajectory] = field(default_factory=dict)
    # The continuous schedule (rollout.continuous): the round of the round schedule that each
    # trajectory starts in, with the model segments it inherited (traj id -> (round, segments)),
    # and the round whose end the rules read (None: now). Its trajectories kept for certain run
    # ahead of the prompt's rounds; as of a round they have sampled only that round's segments.
    births: dict[int, tuple[int, int]] = field(default_factory=dict)
    as_of: int | None = None

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def new(self, kind: TrajectoryKind) -> Trajectory:
        """A trajectory from the bare prompt (a probe or a global sample) with the next id."""
        return Trajectory(prompt_ids=self.prompt_ids, prompt_index=self.index,
                          traj_id=self.new_id(), step=self.step, kind=kind)

    def fork(self, traj: Trajectory, seg_index: int) -> Trajectory:
        """A child of ``traj`` at ``seg_index`` with a new id, recorded under its root trajectory
        (so that dropping a speculative global drops its descendants)."""
        child = traj.fork(seg_index, self.new_id())
        self.roots[child.traj_id] = self.roots.get(traj.traj_id, traj.traj_id)
        return child

    def running(self) -> list[Trajectory]:
        """Unfinished trajectories that may be returned (the reserve not included)."""
        pool = list(self.members) + self.speculative
        if self.probe is not None and self.probe not in pool:
            pool.append(self.probe)
        return [t for t in pool if not self.ended(t)]

    def generating(self) -> list[Trajectory]:
        """What the next round samples: ``running`` and the unfinished reserve, in id order
        (creation order): within a round, decisions claim the budget in this order."""
        pool = self.running() + [t for t in self.reserve if not self.ended(t)] + \
            [t for t in self.tentative.values() if not self.ended(t)] + list(self.presampled.values())
        return sorted(pool, key=lambda t: t.traj_id)

    def note_births(self, round_: int) -> None:
        """Record ``round_`` as the first round of the trajectories created since the last call."""
        pool = self.members + self.speculative + self.reserve + list(self.tentative.values()) + \
            list(self.presampled.values()) + ([self.probe] if self.probe is not None else [])
        for traj in pool:
            self.births.setdefault(traj.traj_id, (round_, len(traj.segment_entropies)))

    def rounds_sampled(self, traj: Trajectory) -> int:
        """The round after the last one whose segment ``traj`` has sampled (``note_births``)."""
        birth, inherited = self.births[traj.traj_id]
        return birth + len(traj.segment_entropies) - inherited

    def ended(self, traj: Trajectory) -> bool:
        """``traj`` has ended (by the end of round ``as_of``, when set)."""
        return traj.done and (self.as_of is None or self.rounds_sampled(traj) <= self.as_of + 1)

    def seen_segments(self, traj: Trajectory) -> list[Segment]:
        """``traj``'s segments (by the end of round ``as_of``, when set: its model segments up to
        that round's, and the tool result that followed it)."""
        if self.as_of is None:
            return traj.segments
        models, seen = self._models_seen(traj), []
        for segment in traj.segments:
            if segment.kind == "model":
                if models <= 0:
                    break
                models -= 1
            seen.append(segment)
        return seen

    def seen_entropies(self, traj: Trajectory) -> list[float]:
        """The head entropies of ``traj``'s model segments (by the end of round ``as_of``, when
        set: those of :meth:`seen_segments`)."""
        if self.as_of is None:
            return traj.segment_entropies
        return traj.segment_entropies[: max(0, self._models_seen(traj))]

    def _models_seen(self, traj: Trajectory) -> int:
        """How many model segments ``traj`` has by the end of round ``as_of`` (its inherited ones
        and one per round from its birth)."""
        birth, inherited = self.births[traj.traj_id]
        return inherited + self.as_of + 1 - birth

    def count_discarded_child(self, child: Trajectory) -> None:
        """Count a child thrown away: one discarded speculative trajectory, and the tokens it
        sampled itself (those after its branch point)."""
        self.stats.discarded_speculative += 1
        self.stats.discarded_tokens += sum(child.loss_mask[child.branch_position:])

    def drop_presampled(self) -> list[Trajectory]:
        """Discard (and count) the pre-sampled children that no decision of this round took;
        returns them."""
        dropped = list(self.presampled.values())
        for child in dropped:
            self.count_discarded_child(child)
        self.presampled = {}
        return dropped

    def discard_reserve(self) -> None:
        """Discard (and count) the reserve: no refill can need it any more."""
        self.stats.discarded_speculative += len(self.reserve)
        self.stats.discarded_tokens += sum(sum(t.loss_mask) for t in self.reserve)
        self.reserve = []
