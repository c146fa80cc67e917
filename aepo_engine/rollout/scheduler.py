"""Entropy-balanced rollout (docs/algorithm.md §1): pre-monitoring, batched tool rounds, entropy branching.

``EntropyBalancedRollout.rollout(prompts, step)`` returns exactly ``k`` trajectories per prompt.
How it schedules them (the probe and the speculative globals, decisions before m, rounds,
branching, the budget, seeds, what is left out) is docs/rollouts.md, "The scheduler, step by
step"; the maths (m, P) is :mod:`aepo_engine.algorithms.branching`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from aepo_engine.algorithms.branching import branch_probability, global_sample_count
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenerationBackend, GenOutput, GenRequest
from aepo_engine.seeding import section_seed
from aepo_engine.rollout.trajectory import BranchDecision, ToolCallRecord, Trajectory
from aepo_engine.tools import TOOL_STOP_STRINGS, MalformedToolCall, ToolCall
from aepo_engine.tools.formats import TagFormat

# ---------------------------------------------------------------------------------------------
# Seeds

_SAMPLE, _ALPHA = 0, 1  # seed purposes, so sampling seeds and branch draws never coincide
# Entropies are >= 0; float rounding can put a mean a hair below. m_max is the m of this H_tool,
# so it bounds m for any H_tool the probe can report.
_H_TOOL_FLOOR = -1e-3


def derive_seed(root_seed: int, step: int, prompt_index: int, traj_id: int, counter: int,
                purpose: int) -> int:
    """A 63-bit seed from the identifying integers (independent of batch order)."""
    seq = np.random.SeedSequence([root_seed, step, prompt_index, traj_id, counter, purpose])
    return int(seq.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------
# Bookkeeping


@dataclass
class _PromptState:
    """The trajectories of one prompt during a rollout call."""

    index: int
    prompt_ids: list[int]
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

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def running(self) -> list[Trajectory]:
        """Unfinished trajectories that may be returned (the reserve not included)."""
        pool = list(self.members) + self.speculative
        if self.probe is not None and self.probe not in pool:
            pool.append(self.probe)
        return [t for t in pool if not t.done]

    def generating(self) -> list[Trajectory]:
        """What the next round samples: ``running`` and the unfinished reserve, in id order
        (creation order): within a round, decisions claim the budget in this order."""
        pool = self.running() + [t for t in self.reserve if not t.done] + \
            [t for t in self.tentative.values() if not t.done] + list(self.presampled.values())
        return sorted(pool, key=lambda t: t.traj_id)


@dataclass
class _Stats:
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
            discarded_tokens: model tokens sampled in discarded trajectories (part of
            tokens_generated; the rest is what the returned trajectories hold).
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


@dataclass(frozen=True)
class RolloutResult:
    """The output of one rollout call: ``trajectories`` (k per prompt, grouped by prompt index,
    each group sorted by ``traj_id``) and their :class:`RolloutStats`."""

    trajectories: list[Trajectory]
    stats: RolloutStats


# ---------------------------------------------------------------------------------------------
# The scheduler


class EntropyBalancedRollout:
    """Samples k tool-using trajectories per prompt with AEPO's entropy-balanced rollout.

    Args:
        backend: a :class:`GenerationBackend` (token-in/token-out, per-token entropies).
        tool_runner: an object with ``run(calls) -> list[ToolResult]`` (e.g. ``ToolRunner``).
        config: the rollout knobs.
        tokenizer: encodes tool-result text (``encode(text, add_special_tokens=False)``) and
            decodes segments when the backend gives no text; default ``backend.tokenizer``.
        tool_names: enabled tool tags; default the keys of ``tool_runner.tools`` if present,
            else the tags of ``TOOL_STOP_STRINGS``.
        tool_format: how calls are parsed and results inserted (``aepo_engine.tools.formats``:
            the paper's tags, the default, or the chat template's own format); its stop strings
            end a segment.
    """

    def __init__(self, backend: GenerationBackend, tool_runner: Any, config: RolloutConfig,
                 tokenizer: Any = None, tool_names: Sequence[str] | None = None, tool_format: Any = None) -> None:
        self.backend = backend
        self.tool_runner = tool_runner
        self.config = config
        self.seed = section_seed(config.seed, "rollout.seed")
        self.tokenizer = tokenizer if tokenizer is not None else backend.tokenizer
        if tool_names is None:
            runner_tools = getattr(tool_runner, "tools", None)
            tool_names = (list(runner_tools) if runner_tools else
                          [s.removeprefix("</").removesuffix(">") for s in TOOL_STOP_STRINGS])
        self.tool_names = tuple(tool_names)
        self.tool_format = tool_format if tool_format is not None else TagFormat(self.tokenizer, self.tool_names)
        self.stop_strings = tuple(self.tool_format.stop_strings)

    # -- public -------------------------------------------------------------------------------

    def rollout(self, prompts: list[list[int]], step: int,
                progress: Callable[[int, int, int], None] | None = None) -> RolloutResult:
        """Sample exactly ``config.k`` trajectories per prompt.

        Args:
            prompts: prompt token ids, one list per prompt.
            step: the training step (part of every seed; trajectories record it).
            progress: called after every round with (prompts whose k trajectories have all
                ended, prompts, tokens sampled so far): the evaluations' progress line.

        Returns:
            ``k * len(prompts)`` trajectories grouped by prompt index (ascending), each group
            sorted by ``traj_id``, with the call's statistics.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0 because it seeds the rollout, got {step}")
        for i, ids in enumerate(prompts):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs a context")
        stats = _Stats()
        states = [_PromptState(i, list(ids)) for i, ids in enumerate(prompts)]
        for state in states:
            self._start(state, step)
        while True:
            if self.config.branching and self.config.experimental.presample_children:
                for state in states:
                    self._presample(state)
            batch = [t for state in states for t in state.generating()]
            if not batch:
                break
            self._round(states, batch, step, stats)
            for state in states:
                self._advance(state, step, stats)
            if progress is not None:
                done = sum(len(s.members) == self.config.k and not s.generating() for s in states)
                progress(done, len(states), stats.tokens_generated)
        for state in states:  # reserve samples no refill needed: the budget went to branches
            self._discard_reserve(state, stats)
        out = [t for state in states for t in sorted(state.members, key=lambda t: t.traj_id)]
        assert all(len(s.members) == self.config.k for s in states), "budget bookkeeping broke"
        return RolloutResult(out, self._summarize(states, out, stats))

    # -- prompt life cycle --------------------------------------------------------------------

    def _start(self, state: _PromptState, step: int) -> None:
        cfg = self.config
        if cfg.branching and cfg.pre_monitoring:
            state.probe = self._new(state, step, "probe")
            if cfg.experimental.reuse_probe_as_sample:
                state.members.append(state.probe)
            state.speculative = [self._new(state, step, "global")
                                 for _ in range(cfg.speculative_globals)]
            return
        state.m = cfg.global_samples_without_monitoring if cfg.branching else cfg.k
        for _ in range(state.m):
            state.members.append(self._new(state, step, "global"))

    def _advance(self, state: _PromptState, step: int, stats: _Stats) -> None:
        """After a round: finish pre-monitoring, or refill a prompt whose trajectories all ended."""
        if state.m is None:
            if not self._evidence_ready(state.probe):
                if state.certain_slots is None:  # after the probe's first round
                    self._bound_m(state, step)
                return
            self._finish_probe(state, step, stats)
        missing = self.config.k - len(state.members)
        if missing > 0 and not state.running():
            resumed, state.reserve = state.reserve[:missing], state.reserve[missing:]
            state.members.extend(resumed)
            for _ in range(missing - len(resumed)):
                state.members.append(self._new(state, step, "global"))
            stats.fresh_global_samples += missing
            for traj in resumed:  # the budget is spent now: recorded as blocked decisions
                self._decide_late(state, traj, step)
        if state.m is not None and len(state.members) == self.config.k and state.reserve:
            self._discard_reserve(state, stats)  # no refill can need it any more

    @staticmethod
    def _discard_reserve(state: _PromptState, stats: _Stats) -> None:
        stats.discarded_speculative += len(state.reserve)
        stats.discarded_tokens += sum(sum(t.loss_mask) for t in state.reserve)
        state.reserve = []

    def _evidence_ready(self, probe: Trajectory) -> bool:
        """The probe has ended, or has the post-tool segments ``monitor_tool_steps`` asks for."""
        wanted = self.config.experimental.monitor_tool_steps
        return probe.done or (wanted is not None and len(probe.segment_entropies) - 1 >= wanted)

    def _bound_m(self, state: _PromptState, step: int) -> None:
        """H_root is known: m <= m_max. Free the k - m_max branch slots every m leaves, and top
        the speculative globals up to the most that any m keeps (``speculative_top_up``)."""
        cfg = self.config
        m_max = global_sample_count(cfg.k, cfg.beta, state.probe.segment_entropies[0],
                                    _H_TOOL_FLOOR)
        state.certain_slots = cfg.k - m_max if cfg.experimental.branch_before_m else 0
        if cfg.speculative_top_up:
            most_kept = m_max - int(cfg.experimental.reuse_probe_as_sample)
            for _ in range(most_kept - len(state.speculative)):
                state.speculative.append(self._new(state, step, "global"))

    def _finish_probe(self, state: _PromptState, step: int, stats: _Stats) -> None:
        cfg, probe = self.config, state.probe
        state.h_root = probe.segment_entropies[0]
        after_tool = probe.segment_entropies[1:][: cfg.experimental.monitor_tool_steps]
        # No tool call: no evidence about post-tool uncertainty -> neutral H_tool (module doc).
        state.h_tool = sum(after_tool) / len(after_tool) if after_tool else state.h_root
        state.m = global_sample_count(cfg.k, cfg.beta, state.h_root, state.h_tool)
        reused = cfg.experimental.reuse_probe_as_sample
        wanted = state.m - int(reused)
        kept, state.reserve = state.speculative[:wanted], state.speculative[wanted:]
        state.speculative = []
        for traj in state.reserve:
            self._to_reserve(state, traj, stats)
        state.members.extend(kept)
        for _ in range(wanted - len(kept)):
            state.members.append(self._new(state, step, "global"))
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
                self._decide(state, traj, seg_index, h_now, step)
        for child in state.tentative.values():  # their decisions found no slot
            stats.discarded_speculative += 1
            stats.discarded_tokens += sum(child.loss_mask[child.branch_position:])
        state.tentative = {}

    def _to_reserve(self, state: _PromptState, traj: Trajectory, stats: _Stats) -> None:
        """Put a speculative global beyond m in reserve: as a refill it is a fresh global sample
        that can no longer branch, so the branches it took are dropped (their own tokens counted
        as discarded) and its decisions are forgotten (a refill takes them again, blocked)."""
        dropped = [t for t in state.members if state.roots.get(t.traj_id) == traj.traj_id]
        for child in dropped:
            state.members.remove(child)
            stats.discarded_speculative += 1
            stats.discarded_tokens += sum(child.loss_mask[child.branch_position:])
        traj.decisions.clear()
        traj.consecutive_branches = 0

    def _decide_late(self, state: _PromptState, traj: Trajectory, step: int) -> None:
        """Take the decisions of every model segment of ``traj`` that reacts to a tool result,
        in order (a resumed reserve sample has taken none)."""
        model_segments = [j for j, s in enumerate(traj.segments) if s.kind == "model"]
        for n_model, seg_index in enumerate(model_segments[1:], start=1):
            self._decide(state, traj, seg_index, traj.segment_entropies[n_model], step)

    def _new(self, state: _PromptState, step: int, kind: str) -> Trajectory:
        return Trajectory(prompt_ids=state.prompt_ids, prompt_index=state.index,
                          traj_id=state.new_id(), step=step, kind=kind)

    # -- one round ----------------------------------------------------------------------------

    def _round(self, states: list[_PromptState], batch: list[Trajectory], step: int,
               stats: _Stats) -> None:
        cfg = self.config
        outputs = self.backend.generate([self._request(t, step) for t in batch])
        if len(outputs) != len(batch):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(batch)} requests")
        stats.rounds += 1
        for traj, output in zip(batch, outputs):
            traj.append_model_segment(output.token_ids, output.logprobs, output.entropies,
                                      cfg.n_entropy_tokens)
            stats.tokens_generated += len(output.token_ids)
        for traj in batch:  # branch decisions first: a child copies the prefix before this call
            state = states[traj.prompt_index]
            if cfg.branching and self._decision_due(traj) and self._samples(state, traj):
                self._take_decision(state, traj, len(traj.segments) - 1,
                                    traj.segment_entropies[-1], step)
        dropped: set[int] = set()  # pre-sampled children no decision took: their calls never run
        for state in states:
            for child in state.presampled.values():
                dropped.add(id(child))
                stats.discarded_speculative += 1
                stats.discarded_tokens += sum(child.loss_mask[child.branch_position:])
            state.presampled = {}
        calls, callers, ended_turns = [], [], []
        for traj, output in zip(batch, outputs):
            if id(traj) in dropped:
                continue
            call = self._classify(traj, output, stats)
            if call is not None:
                calls.append(call)
                callers.append(traj)
                ended_turns.append(output.finish_reason == "eos")
        if calls:
            self._run_tools(calls, callers, ended_turns, stats)

    def _request(self, traj: Trajectory, step: int) -> GenRequest:
        cfg = self.config
        remaining = cfg.max_response_tokens - len(traj.response_ids)
        seed = derive_seed(self.seed, step, traj.prompt_index, traj.traj_id, len(traj.segments),
                           _SAMPLE)
        return GenRequest(prompt_ids=tuple(traj.prompt_ids) + tuple(traj.response_ids),
                          max_new_tokens=min(cfg.max_tokens_per_segment, remaining),
                          stop_strings=self.stop_strings, seed=seed,
                          temperature=cfg.temperature, top_p=cfg.top_p, entropy_tokens=cfg.n_entropy_tokens)

    def _classify(self, traj: Trajectory, output: GenOutput, stats: _Stats
                  ) -> ToolCall | None:
        """Set the finish reason of a trajectory that ends here, or return its tool call."""
        cfg = self.config
        # A format whose calls end the turn (Llama-3 JSON) reads a call from a segment ended by eos.
        if output.finish_reason == "eos" and not self.tool_format.calls_end_turn:
            traj.finish_reason = "eos"
            return None
        if output.finish_reason == "length" or len(traj.response_ids) >= cfg.max_response_tokens:
            traj.finish_reason = "length"  # a call at the cap could not receive its result
            return None
        text = output.text or self.tokenizer.decode(output.token_ids)
        call = self.tool_format.parse_call(text)
        if call is None:
            traj.finish_reason = "eos" if output.finish_reason == "eos" else "stop"
        elif isinstance(call, MalformedToolCall):
            traj.malformed_calls += 1
            stats.malformed_calls += 1
            traj.finish_reason = "malformed"
        elif traj.tool_calls >= cfg.max_tool_calls:
            traj.finish_reason = "tool_limit"
        else:
            return call
        return None

    def _run_tools(self, calls: list[ToolCall], callers: list[Trajectory], ended_turns: list[bool],
                   stats: _Stats) -> None:
        results = self.tool_runner.run(calls)
        if len(results) != len(calls):
            raise RuntimeError(f"tool runner returned {len(results)} results for "
                               f"{len(calls)} calls")
        for call, traj, result, ended_turn in zip(calls, callers, results, ended_turns):
            traj.tool_log.append(ToolCallRecord(call.tool, call.payload, result.text, result.ok, result.elapsed_s))
            remaining = self.config.max_response_tokens - len(traj.response_ids)
            # plain text: tags and control tokens the tool printed cannot act as the engine's
            ids = self.tool_format.result_ids(result.text, ended_turn)
            traj.append_tool_result(list(ids)[:remaining])
            traj.tool_calls += 1
            stats.tool_calls_executed += 1
            stats.tool_errors += int(not result.ok)
            stats.tool_tokens += min(len(ids), remaining)
            if len(traj.response_ids) >= self.config.max_response_tokens:
                traj.finish_reason = "length"

    # -- branching ----------------------------------------------------------------------------

    @staticmethod
    def _decision_due(traj: Trajectory) -> bool:
        """The last segment reacts to a tool result this trajectory received itself."""
        segs = traj.segments
        return (len(segs) >= 2 and segs[-2].kind == "tool"
                and segs[-1].start != traj.branch_position)

    def _samples(self, state: _PromptState, traj: Trajectory) -> bool:
        """``traj`` will be returned if its prompt's m keeps it (a discarded probe never is, a
        reserve sample only once a refill resumes it)."""
        if any(traj is t for t in state.reserve):
            return False
        return traj is not state.probe or self.config.experimental.reuse_probe_as_sample

    def _take_decision(self, state: _PromptState, traj: Trajectory, seg_index: int,
                       h_now: float, step: int) -> None:
        """Decide now, or leave the decision waiting for m (with the trajectory's later ones:
        their l depends on its outcome)."""
        if traj.traj_id in state.waiting:
            state.pending.append((traj, seg_index, h_now))
        elif not self._decide(state, traj, seg_index, h_now, step):
            state.waiting.add(traj.traj_id)
            state.pending.append((traj, seg_index, h_now))
            if len(state.tentative) < self.config.experimental.speculative_branches:
                self._start_tentative(state, traj, seg_index)

    def _start_tentative(self, state: _PromptState, traj: Trajectory, seg_index: int) -> None:
        """Start now the child a waiting decision (it wants a branch) gets if m leaves it a slot,
        so that it does not start rounds late; it takes no decision of its own before that."""
        child = state.presampled.pop((traj.traj_id, seg_index), None) or \
            self._fork(state, traj, seg_index)
        child.consecutive_branches = child.inherited_branches = traj.consecutive_branches + 1
        state.waiting.add(child.traj_id)
        state.tentative[(traj.traj_id, seg_index)] = child

    def _decide(self, state: _PromptState, traj: Trajectory, seg_index: int, h_now: float,
                step: int) -> bool:
        """Take the branch decision for the model segment ``traj.segments[seg_index]``; False
        (nothing recorded) when it wants a branch slot whose existence depends on m."""
        cfg = self.config
        tool_step = sum(s.kind == "tool" for s in traj.segments[:seg_index])
        if cfg.branch_alpha_mode == "random":
            seed = derive_seed(self.seed, step, traj.prompt_index, traj.traj_id, tool_step, _ALPHA)
            alpha = float(np.random.default_rng(seed).random())
        else:
            alpha = cfg.branch_alpha
        l_before = traj.consecutive_branches
        p = branch_probability(alpha, cfg.gamma, h_now - traj.h_init, l_before,
                               cfg.penalty_slope, cfg.branch_penalty)
        wants = p > cfg.tau
        slot = self._slot_left(state) if wants else False
        if slot is None:
            return False
        if slot:
            traj.consecutive_branches = l_before + 1
            key = (traj.traj_id, seg_index)
            child = (state.tentative.pop(key, None) or state.presampled.pop(key, None)
                     or self._fork(state, traj, seg_index))
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

    @staticmethod
    def _fork(state: _PromptState, traj: Trajectory, seg_index: int) -> Trajectory:
        """A child of ``traj`` at ``seg_index`` with a new id, recorded under its root trajectory
        (so that dropping a speculative global drops its descendants)."""
        child = traj.fork(seg_index, state.new_id())
        state.roots[child.traj_id] = state.roots.get(traj.traj_id, traj.traj_id)
        return child

    def _presample(self, state: _PromptState) -> None:
        """Start the would-be children of this round's decisions, one per certainly free slot
        (module doc, "Pre-sampled children")."""
        if state.m is not None:
            free = self.config.k - len(state.members)
        else:
            free = (state.certain_slots or 0) - state.early_branches
        for traj in sorted(state.running(), key=lambda t: t.traj_id):
            if free <= 0:
                return
            segs = traj.segments
            if (traj.traj_id in state.waiting or not segs or segs[-1].kind != "tool"
                    or segs[-1].end == traj.branch_position or not self._samples(state, traj)):
                continue  # no decision of its own follows this round, or it waits for m
            state.presampled[(traj.traj_id, len(segs))] = self._fork(state, traj, len(segs))
            free -= 1

    def _slot_left(self, state: _PromptState) -> bool | None:
        """A branch slot is free (True), taken (False), or depends on the unknown m (None)."""
        if state.m is not None:
            return len(state.members) < self.config.k
        return True if state.early_branches < (state.certain_slots or 0) else None

    # -- statistics ---------------------------------------------------------------------------

    def _summarize(self, states: list[_PromptState], out: list[Trajectory], stats: _Stats
                   ) -> RolloutStats:
        decisions = [d for t in out for d in t.decisions]
        probs = [d.probability for d in decisions]
        return RolloutStats(
            m=[s.m for s in states],
            h_root=[s.h_root for s in states],
            h_tool=[s.h_tool for s in states],
            branches=sum(d.branched for d in decisions),
            branch_decisions=len(decisions),
            branch_budget_blocked=sum(d.budget_blocked for d in decisions),
            mean_branch_probability=sum(probs) / len(probs) if probs else None,
            tool_calls_executed=stats.tool_calls_executed,
            tool_errors=stats.tool_errors,
            malformed_calls=stats.malformed_calls,
            finish_reasons=dict(Counter(t.finish_reason for t in out)),
            kinds=dict(Counter(t.kind for t in out)),
            tokens_generated=stats.tokens_generated,
            tool_tokens=stats.tool_tokens,
            rounds=stats.rounds,
            fresh_global_samples=stats.fresh_global_samples,
            discarded_probes=stats.discarded_probes,
            discarded_speculative=stats.discarded_speculative,
            discarded_tokens=stats.discarded_tokens,
            waited_decisions=stats.waited_decisions,
        )
