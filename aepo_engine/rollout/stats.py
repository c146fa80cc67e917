"""What a rollout call counts: :class:`RolloutCounters` while it runs, :class:`RolloutStats`
(:func:`rollout_stats`) when it returns.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["RolloutCounters", "RolloutStats", "rollout_stats"]


@dataclass
class RolloutCounters:
    """The running counts of one rollout call, shared by its prompts (:class:`RolloutStats`
    says what each counts)."""

    rounds: int = 0
    tokens_generated: int = 0
    tool_tokens: int = 0
    tool_calls_executed: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    fresh_global_samples: int = 0
    discarded_probes: int = 0
    discarded_speculative: int = 0
    discarded_tokens: int = 0
    waited_decisions: int = 0
    tool_calls_dropped: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    tail_s: float = 0.0
    widest_round: int = 0

    def time_round(self, width: int, generate_s: float, tool_s: float) -> None:
        """Add a round's seconds; a round less than half as wide as the widest so far counts as
        tail (the call waiting for its slowest trajectories)."""
        self.generate_s += generate_s
        self.tool_s += tool_s
        self.widest_round = max(self.widest_round, width)
        if 2 * width < self.widest_round:
            self.tail_s += generate_s + tool_s


@dataclass(frozen=True)
class RolloutStats:
    """What one :meth:`EntropyBalancedRollout.rollout` call did.

    Attributes:
        m: global samples per prompt (spec 1a).
        h_root, h_tool: pre-monitoring entropies per prompt (None without pre-monitoring).
        branches: branches taken; branch_decisions: branch decisions made;
            branch_budget_blocked: decisions with P > tau but no budget left.
        mean_branch_probability: mean P over the decisions (None without decisions).
        tool_calls_executed, tool_errors, malformed_calls: tool use.
        finish_reasons, kinds: counts over the returned trajectories.
        tokens_generated: all sampled tokens, discarded probes included; tool_tokens: tool-result
            tokens appended; rounds: backend calls.
        fresh_global_samples: global samples started because a prompt's trajectories all ended;
            discarded_probes: probes thrown away (``reuse_probe_as_sample=False``);
            discarded_speculative: speculative samples beyond m that no refill needed, thrown
            away (branches used the budget), the branches that speculative samples beyond m
            took before m was known, and children started early for waiting decisions that got
            no slot (``speculative_branches``), and pre-sampled children no decision took
            (``presample_children``);
            waited_decisions: branch decisions that waited for m (``branch_before_m``);
            tool_calls_dropped: calls that ran for a trajectory discarded while they ran (the
            continuous schedule's ``sample_ahead``): not in tool_calls_executed, their results
            untaken;
            discarded_tokens: model tokens sampled in discarded trajectories (part of
            tokens_generated; the rest is what the returned trajectories hold).
        generate_s, tool_s: seconds in the backend and waiting for tool calls (the slowest call
            of each round); tail_s: the part of both spent in rounds less than half as wide as
            the widest before them (the slowest trajectories, with the rest finished).
        tool_chain_s: the longest chain of tool calls behind a returned trajectory: the sum of
            its calls' seconds, those its ancestors made before its branch point included. Each
            call of a chain waits for the one before it, so no schedule that grows these trees
            returns them sooner (docs/async.md, "No round barrier").
    """

    m: list[int]
    h_root: list[float | None]
    h_tool: list[float | None]
    branches: int
    branch_decisions: int
    branch_budget_blocked: int
    mean_branch_probability: float | None
    tool_calls_executed: int
    tool_errors: int
    malformed_calls: int
    finish_reasons: dict[str, int]
    kinds: dict[str, int]
    tokens_generated: int
    tool_tokens: int
    rounds: int
    fresh_global_samples: int
    discarded_probes: int
    discarded_speculative: int
    discarded_tokens: int
    waited_decisions: int
    tool_calls_dropped: int = 0
    generate_s: float = 0.0
    tool_s: float = 0.0
    tail_s: float = 0.0
    tool_chain_s: float = 0.0


def rollout_stats(m: list[int], h_root: list[float | None], h_tool: list[float | None],
              trajectories: Sequence[Trajectory], counters: RolloutCounters) -> RolloutStats:
    """The statistics of a rollout call.

    Args:
        m, h_root, h_tool: per prompt (``PromptState``'s).
        trajectories: the call's returned trajectories; the branch decisions, finish reasons and
            kinds are counted over them.
        counters: the call's counters.
    """
    decisions = [d for t in trajectories for d in t.decisions]
    probs = [d.probability for d in decisions]
    return RolloutStats(
        m=m,
        h_root=h_root,
        h_tool=h_tool,
        branches=sum(d.branched for d in decisions),
        branch_decisions=len(decisions),
        branch_budget_blocked=sum(d.budget_blocked for d in decisions),
        mean_branch_probability=sum(probs) / len(probs) if probs else None,
        tool_calls_executed=counters.tool_calls_executed,
        tool_errors=counters.tool_errors,
        malformed_calls=counters.malformed_calls,
        finish_reasons=dict(Counter(t.finish_reason for t in trajectories)),
        kinds=dict(Counter(t.kind for t in trajectories)),
        tokens_generated=counters.tokens_generated,
        tool_tokens=counters.tool_tokens,
        rounds=counters.rounds,
        fresh_global_samples=counters.fresh_global_samples,
        discarded_probes=counters.discarded_probes,
        discarded_speculative=counters.discarded_speculative,
        discarded_tokens=counters.discarded_tokens,
        waited_decisions=counters.waited_decisions,
        tool_calls_dropped=counters.tool_calls_dropped,
        generate_s=counters.generate_s,
        tool_s=counters.tool_s,
        tail_s=counters.tail_s,
        tool_chain_s=max((sum(call.elapsed_s for call in t.tool_log) for t in trajectories), default=0.0),
    )
