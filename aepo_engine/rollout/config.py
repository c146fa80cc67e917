"""Configuration of the entropy-balanced rollout (docs/algorithm.md §1): one frozen struct, one
source of truth.

Every field's help text is in the ``Attributes:`` block (``aepo_engine.config_loader`` reads it for
``--help`` and TOML dumps). Defaults follow the reference scripts (docs/algorithm.md §3) where
they exist.
``__post_init__`` rejects values and combinations that cannot work and says why.
"""
from __future__ import annotations

import math
from typing import ClassVar, Literal

import msgspec

from aepo_engine.errors import require


# The keys of [rollout.experimental]: set in [rollout] (where the first six once were), each is
# refused with its place named (RolloutConfig.MOVED_KEYS).
EXPERIMENTAL_FIELDS = ("reuse_probe_as_sample", "speculative_global_samples", "branch_before_m",
                       "speculative_branches", "presample_children", "monitor_tool_steps", "settle_s",
                       "sample_ahead")


class RolloutExperiments(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Scheduling ablations and variants of the rollout (``rollout.experimental``), for experiments.

    The defaults are the engine's tested choices; a training run leaves this section alone. Four
    change only when trajectories start, not what the rollout computes (m and the branch
    decisions are the same, the kept samples the same in distribution):
    ``speculative_global_samples``, ``branch_before_m``, ``speculative_branches``,
    ``presample_children``; together at 0 / false / 0 / false they give the strict order of
    docs/algorithm.md §1a. Two are variants of the algorithm: ``reuse_probe_as_sample=False`` (the
    reference code's discarded probe) and ``monitor_tool_steps`` (m from the probe's first tool
    steps). What each does and what it was measured to cost: docs/rollouts.md.

    Attributes:
        reuse_probe_as_sample: Keep the probe as one of the m global samples (it is a valid
            on-policy sample); False throws it away like the reference code (one extra trajectory).
        speculative_global_samples: Global samples started beside the pre-monitoring probe, before
            m is known, so the probe does not run alone. They are the same trajectories (same ids,
            same seeds) the order of docs/algorithm.md §1a would start after the probe. Those
            beyond the m the probe sets go to the reserve (the branches they took are dropped;
            they go on sampling while the prompt has fewer than k trajectories) and fill unused
            branch slots first; the rest is discarded (their tokens counted as discarded).
            None = max(0, k // 2 - 1) from the start, one below the global samples of a neutral
            probe, then topped up to m_max - 1 once H_root is known after the probe's first round
            (m_max = the m of H_tool = 0, the most any probe can set); a number = exactly that
            many, no top-up; 0 = the probe first, alone (with branch_before_m=False and
            speculative_branches=0: the strict order of docs/algorithm.md §1a). Starting k // 2
            (the top-up always reaches that many) would start one of them a round earlier, but in
            the rollout benchmark it only added discarded tokens (docs/rollouts.md).
            Ignored without pre-monitoring.
        branch_before_m: Trajectories that run before m is known (the probe, speculative globals,
            their branches) take their branch decisions online, while the k - m_max branch slots
            that every m leaves last (entropies are >= 0, so m <= m_max); a decision that wants a
            slot beyond those waits for m, with the trajectory's later decisions (they depend on
            its branch count l), and all waiting decisions then claim the budget in the order
            they were taken. So the budget goes to decisions in the order they are taken, as if
            m had been known from the start: m, the branch count and P are the strict order's,
            the tree shape is that of m known from the start (in the strict order the probe
            claims first; docs/rollouts.md). False: every decision waits for
            m (slower: the children of late decisions run after the others).
        speculative_branches: Per prompt, this many waiting decisions (``branch_before_m``) that
            want a branch start their child at once (only a trajectory's first waiting decision,
            whose P is known): if m leaves it a slot when the decision's turn comes, the child is
            kept, further along than a child started then; if not, it is discarded (its tokens
            counted as discarded). The decisions and their outcomes are unchanged; only the ids
            (hence seeds) of later trajectories can shift by the discarded children's. 0 = off; k
            or more = every trajectory's first waiting decision that wants a branch (fewer rounds,
            more discarded tokens: docs/rollouts.md).
        presample_children: A trajectory that has just received a tool result samples its
            reaction, and the branch decision (spec 1c) needs that reaction's entropy, so a child
            started after the decision runs one round behind its parent. With this on, while a
            branch slot is certainly free, a would-be child (a copy of the trajectory up to the
            tool result) samples its own reaction in the same round as the parent; if the parent's
            decision branches, it is the child (already a round along), otherwise it is discarded
            before its tool call runs (its tokens counted as discarded). At most one per free slot,
            in trajectory-id order. The decisions, their P and outcomes and every kept token's
            distribution are unchanged (the child's reaction does not depend on the parent's);
            trajectory ids, hence seeds, of later trajectories shift by the discarded ones. Off by
            default: in the rollout benchmark it only added discarded tokens (docs/rollouts.md);
            it can pay where tool chains are long and a round's latency, not its tokens,
            dominates.
        monitor_tool_steps: Post-tool segments of the probe that H_tool averages; m is set as
            soon as the probe has them (or has ended). None = all of them, the rule of
            docs/algorithm.md §1a (m once the whole probe has ended); 1 = m from the probe's
            first reaction to a tool result (a different, faster rule: it does not wait for the
            probe's later tool calls).
        settle_s: Under the continuous schedule (``rollout.schedule``: "continuous", or "auto" in
            an asynchronous run), the longest a round waits for tool results expected back before it samples
            (``ContinuousRollout.settle``; only how batches form, never the trees). None = one
            round's generation time, the ski-rental window; 0 = never wait; seconds = that window.
        sample_ahead: Under the continuous schedule, the trajectories their prompt may still
            discard (before m: the probe, the speculative globals and their branches; the reserve)
            sample on as soon as their own tool result is back, as those kept for certain do,
            instead of round by round with their prompt (which waits for the prompt's slowest
            call of each round until the probe has ended). The trees, m and every decision are
            the same (the rules read each trajectory as of the round they belong to); what m
            then discards may hold segments and tool calls sampled ahead (more discarded tokens;
            ``rollout/tool_calls_dropped`` counts the calls). False: nothing is sampled that the
            round schedule would have discarded first, at the price of the prompt's round waits
            (docs/async.md, "No round barrier", has both measured).
    """

    reuse_probe_as_sample: bool = True
    speculative_global_samples: int | None = None
    branch_before_m: bool = True
    speculative_branches: int = 1
    presample_children: bool = False
    monitor_tool_steps: int | None = None
    settle_s: float | None = None
    sample_ahead: bool = True

    def __post_init__(self) -> None:
        # speculative_global_samples <= k - 1 needs k: RolloutConfig checks it.
        if self.settle_s is not None:
            require(math.isfinite(self.settle_s) and self.settle_s >= 0,
                   f"experimental.settle_s must be seconds >= 0 (or none for one round's generation "
                   f"time), got {self.settle_s}")
        require(self.speculative_branches >= 0,
               f"experimental.speculative_branches must be >= 0, got {self.speculative_branches}")
        if self.monitor_tool_steps is not None:
            require(self.monitor_tool_steps >= 1,
                   f"experimental.monitor_tool_steps must be >= 1 (or none for all), got "
                   f"{self.monitor_tool_steps}")


class RolloutConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Knobs of the entropy-balanced rollout (``EntropyBalancedRollout``, docs/algorithm.md §1).

    Attributes:
        k: Trajectories per prompt (the GRPO group size); the rollout returns exactly k per prompt.
        pre_monitoring: Entropy pre-monitoring (docs/algorithm.md §1a): one probe trajectory per
            prompt sets the number m of global samples from H_root and H_tool. Off: m =
            fixed_global_samples.
            Ignored (m = k, no probe) when branching is off, since m then trades against nothing.
        beta: Slope of the sigmoid in m = floor(k * sigmoid(beta * (H_root - H_tool))) + 1.
        fixed_global_samples: Global samples per prompt when pre-monitoring is off; None means
            max(1, k // 2), the reference scripts' fixed m = k/2.
        n_entropy_tokens: n_e; a segment's entropy is the mean over its first n_e tokens.
        branching: Branch at tool-call steps (docs/algorithm.md §1c). Off: k independent samples
            (GRPO rollout).
        branch_alpha_mode: Base term alpha of the branch probability: "random" draws alpha ~ U(0, 1)
            per decision from a seeded generator (reference code); "constant" uses branch_alpha
            (the paper's formula).
        branch_alpha: alpha in "constant" mode. With tau = 0.5 and no penalty, 0.5 means "branch iff
            the entropy after the tool result rose above the trajectory's initial entropy".
        gamma: Weight of the entropy change dH = H_now - H_init in the branch probability.
        tau: Branch threshold: a trajectory branches when P > tau.
        penalty_slope: Consecutive-branch penalty Phat(l) = min(1, penalty_slope * l).
        branch_penalty: Apply the consecutive-branch penalty (AEPO); False gives ARPO's rule.
        max_response_tokens: Cap on response tokens (model and tool-result tokens) per trajectory.
        max_tokens_per_segment: Cap on tokens generated in one segment (one backend call); a segment
            that hits it ends the trajectory with finish reason "length".
        max_tool_calls: Tool calls executed per trajectory; a further call ends it ("tool_limit").
        temperature: Sampling temperature passed to the backend.
        top_p: Nucleus sampling top-p passed to the backend.
        seed: Every sampling seed and branch draw derives from (seed, step, prompt index,
            trajectory id, ...), so the same seed reproduces the same rollouts; none = derived from the run's root seed (``aepo_engine.seeding``).
        schedule: How a training step's trajectories take turns (``rollout.continuous``):
            "continuous" moves each trajectory on as soon as its own tool call returns (tool calls
            run beside generation; each backend call takes whatever is ready, up to the backend's
            batch); "rounds" samples every ready trajectory, then waits for all their tool calls
            (each round waits for its slowest call); "auto" (the default, :meth:`resolved_schedule`)
            is "continuous" in an asynchronous run's rollout process with ``train.max_staleness >=
            1`` and "rounds" otherwise: a synchronous step keeps the barrier until the continuous
            schedule is never slower there (measured on CPU, docs/async.md: faster with slow tools,
            slower with none). Both grow the same trees, m, branches and counts for the same
            sampled tokens (the continuous schedule takes each prompt's branch decisions, budget
            slots, ids and refills in the round schedule's order, whatever the tool latencies;
            only ``rounds`` and the seconds differ). Only "rounds" makes two runs bit-identical:
            continuous batches depend on when results arrive, and a backend whose numbers depend
            on its batch (HF on CPU: log-probs within ~1e-5) may then sample another token, rarely.
        experimental: Scheduling ablations and variants, for experiments; a run leaves them at
            their defaults (``RolloutExperiments``).
    """

    k: int = 12
    pre_monitoring: bool = True
    beta: float = 0.5
    fixed_global_samples: int | None = None
    n_entropy_tokens: int = 20
    branching: bool = True
    branch_alpha_mode: Literal["random", "constant"] = "random"
    branch_alpha: float = 0.5
    gamma: float = 0.2
    tau: float = 0.5
    penalty_slope: float = 0.05
    branch_penalty: bool = True
    max_response_tokens: int = 6192
    max_tokens_per_segment: int = 6192
    max_tool_calls: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    schedule: Literal["auto", "continuous", "rounds"] = "auto"
    experimental: RolloutExperiments = msgspec.field(default_factory=RolloutExperiments)

    def resolved_schedule(self, max_staleness: int = 0) -> Literal["continuous", "rounds"]:
        """``schedule`` with "auto" resolved for a rollout whose steps may be ``max_staleness``
        versions ahead of the update (0: a synchronous step, or the asynchronous eta = 0 run,
        which then gives the synchronous run bit for bit): "continuous" where steps overlap,
        "rounds" otherwise."""
        if self.schedule != "auto":
            return self.schedule
        return "continuous" if max_staleness >= 1 else "rounds"

    # Keys that moved into ``experimental`` (the config loader names the new place).
    MOVED_KEYS: ClassVar[dict[str, str]] = {name: f"experimental.{name}" for name in EXPERIMENTAL_FIELDS}

    def __post_init__(self) -> None:
        require(self.k >= 1, f"k must be >= 1 because each prompt needs a group, got {self.k}")
        require(self.beta >= 0,
               f"beta must be >= 0 so a higher H_root never lowers m, got {self.beta}")
        if self.fixed_global_samples is not None:
            require(1 <= self.fixed_global_samples <= self.k,
                   f"fixed_global_samples must be in [1, k={self.k}] because global samples are "
                   f"part of the k trajectories, got {self.fixed_global_samples}")
        speculative = self.experimental.speculative_global_samples
        if speculative is not None:
            require(0 <= speculative <= self.k - 1,
                   f"experimental.speculative_global_samples must be in [0, k - 1 = {self.k - 1}] "
                   f"because the probe is one of the k trajectories, got {speculative}")
        require(self.n_entropy_tokens >= 1,
               f"n_entropy_tokens must be >= 1 to measure any entropy, got {self.n_entropy_tokens}")
        require(self.branch_alpha_mode in ("random", "constant"),
               f"branch_alpha_mode must be 'random' or 'constant', got {self.branch_alpha_mode!r}")
        require(0.0 <= self.branch_alpha <= 1.0,
               f"branch_alpha must be in [0, 1] (a base probability), got {self.branch_alpha}")
        require(self.gamma >= 0, f"gamma must be >= 0 so an entropy rise never lowers P, got "
                                f"{self.gamma}")
        require(self.tau > 0,
               f"tau must be > 0 so that a zero or negative P never branches, got {self.tau}")
        require(self.penalty_slope >= 0,
               f"penalty_slope must be >= 0 so branching more never raises P, got "
               f"{self.penalty_slope}")
        require(self.max_response_tokens >= 1,
               f"max_response_tokens must be >= 1, got {self.max_response_tokens}")
        require(1 <= self.max_tokens_per_segment <= self.max_response_tokens,
               f"max_tokens_per_segment must be in [1, max_response_tokens="
               f"{self.max_response_tokens}] because a segment is part of the response, got "
               f"{self.max_tokens_per_segment}")
        require(self.max_tool_calls >= 0, f"max_tool_calls must be >= 0, got {self.max_tool_calls}")
        require(self.temperature > 0,
               f"temperature must be > 0 because entropies and log-probs are taken under "
               f"softmax(z / T), got {self.temperature}")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.seed is None or self.seed >= 0, f"seed must be >= 0 (numpy SeedSequence), got {self.seed}")

    @property
    def speculative_globals(self) -> int:
        """Global samples started beside the probe (0 unless pre-monitoring runs)."""
        if not (self.branching and self.pre_monitoring):
            return 0
        if self.experimental.speculative_global_samples is not None:
            return self.experimental.speculative_global_samples
        return max(0, self.k // 2 - 1)

    @property
    def speculative_top_up(self) -> bool:
        """Top the speculative globals up to m_max - 1 once H_root is known (the default)."""
        return (self.experimental.speculative_global_samples is None and self.branching
                and self.pre_monitoring)

    @property
    def global_samples_without_monitoring(self) -> int:
        """m when pre-monitoring is off: ``fixed_global_samples`` or max(1, k // 2)."""
        if self.fixed_global_samples is not None:
            return self.fixed_global_samples
        return max(1, self.k // 2)
