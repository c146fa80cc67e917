"""Entropy-balanced rollout (docs/algorithm.md §1): pre-monitoring, batched tool rounds, entropy branching.

``EntropyBalancedRollout.rollout(prompts, step)`` returns exactly ``k`` trajectories per prompt.
How it schedules them (the probe and the speculative globals, decisions before m, rounds,
branching, the budget, seeds, what is left out) is docs/rollouts.md, "The scheduler, step by
step"; the maths (m, P) is :mod:`aepo_engine.algorithms.branching`.

This module runs the rounds: every unfinished trajectory of every prompt samples a segment in one
backend call, then the round's tool calls run together. The parts it drives, one job each:

- :mod:`~aepo_engine.rollout.state`: one prompt's trajectories during a call (``PromptState``);
- :mod:`~aepo_engine.rollout.monitoring`: its global samples (pre-monitoring and m, speculative
  globals, the reserve, refills);
- :mod:`~aepo_engine.rollout.decisions`: its branch decisions (P, the budget, waiting for m);
- :mod:`~aepo_engine.rollout.segments`: the backend requests and the segments a weight update cuts;
- :mod:`~aepo_engine.rollout.calls`: the tool calls (read, run, results appended);
- :mod:`~aepo_engine.rollout.stats`: the call's counters and :class:`RolloutStats`;
- :mod:`~aepo_engine.rollout.seeds`: the seeds of every sample and draw.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from aepo_engine.rollout.calls import PendingCall, ToolCalls
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.decisions import Branching
from aepo_engine.rollout.monitoring import PreMonitoring
from aepo_engine.rollout.protocol import GenerationBackend, GenOutput
from aepo_engine.rollout.segments import SegmentRequests
from aepo_engine.rollout.state import PromptState, state_key
from aepo_engine.rollout.stats import RolloutCounters, RolloutStats, rollout_stats
from aepo_engine.rollout.trajectory import Trajectory
from aepo_engine.seeding import section_seed
from aepo_engine.tools import TOOL_STOP_STRINGS
from aepo_engine.tools.formats import TagFormat

__all__ = ["EntropyBalancedRollout", "RolloutResult", "RolloutStats"]



@dataclass(frozen=True)
class RolloutResult:
    """The output of one rollout call: ``trajectories`` (k per prompt, grouped by prompt index,
    each group sorted by ``traj_id``) and their :class:`RolloutStats`."""

    trajectories: list[Trajectory]
    stats: RolloutStats


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
        # The policy version of the backend's weights: recorded on every token it samples.
        self.policy_version = 0
        self.tokens_sampled = 0  # every token the backend returned, over the scheduler's life
        self.segments = SegmentRequests(config, self.seed, self.stop_strings, self.tokenizer)
        self.calls = ToolCalls(tool_runner, self.tool_format, self.tokenizer, config)
        self.branching = Branching(config, self.seed)
        self.monitoring = PreMonitoring(config, self.branching)

    def rollout(self, prompts: list[list[int]], step: int, version: int | None = None,
                progress: Callable[[int, int, int], None] | None = None) -> RolloutResult:
        """Sample exactly ``config.k`` trajectories per prompt.

        Args:
            prompts: prompt token ids, one list per prompt.
            step: the training step (part of every seed; trajectories record it).
            version: the policy version of the backend's weights, recorded on every sampled token
                (``Trajectory.versions``); None = ``step`` (a synchronous run's weights have had
                ``step`` updates).
            progress: called after every round with (prompts whose k trajectories have all
                ended, prompts, tokens sampled so far): the evaluations' progress line.

        Returns:
            ``k * len(prompts)`` trajectories grouped by prompt index (ascending), each group
            sorted by ``traj_id``, with the call's statistics.
        """
        self.policy_version = step if version is None else version
        states = self._new_states(prompts, step)
        while True:
            batch = self._next_batch(states)
            if not batch:
                break
            self._round(states, batch)
            for state in states.values():
                self.monitoring.advance(state)
            if progress is not None:
                done = sum(len(s.members) == self.config.k and not s.generating() for s in states.values())
                stats = next(iter(states.values())).stats  # one per call (_new_states)
                progress(done, len(states), stats.tokens_generated)
        return self._result(list(states.values()))

    def _new_states(self, prompts: list[list[int]], step: int) -> dict[tuple[int, int], PromptState]:
        """Started prompt states of one rollout call, keyed by ``(step, prompt index)``."""
        if step < 0:
            raise ValueError(f"step must be >= 0 because it seeds the rollout, got {step}")
        for i, ids in enumerate(prompts):
            if len(ids) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs a context")
        stats = RolloutCounters()
        states = {(step, i): PromptState(i, list(ids), step, stats) for i, ids in enumerate(prompts)}
        for state in states.values():
            self.monitoring.start(state)
        return states

    def _next_batch(self, states: dict[tuple[int, int], PromptState]) -> list[Trajectory]:
        """What the next round samples (pre-sampled children started first, when on)."""
        if self.config.branching and self.config.experimental.presample_children:
            for state in states.values():
                self.branching.presample(state)
        return [t for state in states.values() for t in state.generating()]

    def _result(self, states: list[PromptState]) -> RolloutResult:
        """The call's k trajectories per prompt and statistics, once nothing is left to sample."""
        for state in states:  # reserve samples no refill needed: the budget went to branches
            state.discard_reserve()
        self.segments.forget({(state.step, state.index) for state in states})  # cut segments of discarded trajectories
        out = [t for state in states for t in sorted(state.members, key=lambda t: t.traj_id)]
        assert all(len(s.members) == self.config.k for s in states), "budget bookkeeping broke"
        counters = states[0].stats if states else RolloutCounters()
        return RolloutResult(out, rollout_stats([s.m for s in states], [s.h_root for s in states],
                                            [s.h_tool for s in states], out, counters))

    # -- one round ----------------------------------------------------------------------------

    def _round(self, states: dict[tuple[int, int], PromptState], batch: list[Trajectory]) -> None:
        """One round: sample every trajectory of ``batch``, then run their tool calls together."""
        start = time.perf_counter()
        calls = self._generate(states, batch)
        generated = time.perf_counter()
        if calls:
            self._run_tools(states, calls)
        for stats in {id(states[state_key(t)].stats): states[state_key(t)].stats for t in batch}.values():
            stats.time_round(len(batch), generated - start, time.perf_counter() - generated)

    def _generate(self, states: dict[tuple[int, int], PromptState], batch: list[Trajectory],
                  abort: Any = None) -> list[PendingCall]:
        """Sample a segment for every trajectory of ``batch`` (``abort``: a ``threading.Event`` a
        backend that can stop mid-call checks, ``GenerationBackend.can_abort``; a segment it cuts
        is kept and continued next round), take the branch decisions due and read the segments'
        tool calls; returns the calls to run, with their callers."""
        cfg = self.config
        finished = self._sample(states, batch, abort)
        if cfg.branching:  # decisions first: a child copies the prefix before this segment's call
            for traj, _ in finished:
                self.branching.after_segment(states[state_key(traj)], traj)
        dropped: set[int] = set()  # pre-sampled children no decision took: their calls never run
        for state in {id(states[state_key(t)]): states[state_key(t)] for t in batch}.values():
            for child in state.drop_presampled():
                dropped.add(id(child))
                self.segments.drop(child)
        calls = []
        for traj, output in finished:
            if id(traj) in dropped:
                continue
            call = self.calls.read(traj, output, states[state_key(traj)].stats)
            if call is not None:
                calls.append(call)
        return calls

    def _sample(self, states: dict[tuple[int, int], PromptState], batch: list[Trajectory],
                abort: Any = None) -> list[tuple[Trajectory, GenOutput]]:
        """Sample a segment for every trajectory of ``batch`` (``abort``: see :meth:`_generate`)
        and append it; returns the trajectories whose segment ended, each with its segment."""
        cfg = self.config
        requests = [self.segments.request(t) for t in batch]
        outputs = (self.backend.generate(requests, abort=abort) if abort is not None
                   else self.backend.generate(requests))
        if len(outputs) != len(batch):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(batch)} requests")
        for stats in {id(states[state_key(t)].stats): states[state_key(t)].stats for t in batch}.values():
            stats.rounds += 1
        finished = []
        for traj, output in zip(batch, outputs):
            states[state_key(traj)].stats.tokens_generated += len(output.token_ids)
            self.tokens_sampled += len(output.token_ids)
            output, versions = self.segments.complete(traj, output, self.policy_version)
            if output is None:  # cut by a weight update: continued next round
                continue
            traj.append_model_segment(output.token_ids, output.logprobs, output.entropies,
                                      cfg.n_entropy_tokens, versions)
            finished.append((traj, output))
        return finished

    def _run_tools(self, states: dict[tuple[int, int], PromptState], calls: list[PendingCall]) -> None:
        """Run a round's tool calls together and append each result to its trajectory."""
        for pending, result in zip(calls, self.calls.run(calls)):
            self.calls.take_result(pending, result, states[state_key(pending.traj)].stats)
