"""Continuous rollouts: the one scheduler of a training run's steps, synchronous or asynchronous
(docs/async.md).

:class:`ContinuousRollout` runs the entropy-balanced scheduler of :mod:`aepo_engine.rollout.scheduler`
(the same per-prompt logic: pre-monitoring, branching, the budget, the seeds) over whatever has been
admitted, round after round, and hands back each step's k trajectories per prompt as soon as the last
of them has ended. A synchronous run samples one step at a time with :meth:`run_step`; the
asynchronous rollout process admits up to ``train.max_staleness`` steps ahead and drives
:meth:`round` itself (:mod:`aepo_engine.asynchronous.worker`). What differs from one
:meth:`EntropyBalancedRollout.rollout` call:

- **Admission.** :meth:`admit` adds a step's prompts at any time (the caller decides when:
  ``train.max_staleness``); their seeds are those a synchronous run would use for that step.
- **No round barrier on tools** (``tool_barrier=False``, ``rollout.schedule = "continuous"``): a
  tool call is submitted and the round returns; the trajectory samples again in the first round
  after its result is back, while the others go on. Before a round the scheduler waits for the
  results expected back within one round's generation time, and for no others (:meth:`settle`,
  the ski-rental rule): fast tools then cost no extra, narrower backend calls, slow ones hold
  back nobody but their own trajectory. With ``tool_barrier=True``
  (``rollout.schedule = "rounds"``) each round waits for its calls, as
  :meth:`EntropyBalancedRollout.rollout` does (and then, admitting one step at a time, produces
  exactly its trajectories).
- **The round schedule's trees** (issue 52). Without the barrier a prompt still takes its
  actions on shared things (branch decisions and the budget's slots, trajectory ids, m, refills,
  the reserve, tentative and pre-sampled children) in the round schedule's order: round by
  round, within a round in trajectory-id order, each round's pre-monitoring after its
  decisions. A trajectory's segment j belongs to round (its first round) + j, whenever it is
  sampled; a decision is taken once every trajectory of its prompt that samples in its round has
  sampled up to its own, the round's end once their tool results are back. A trajectory its prompt
  keeps for certain (a member once m is known) samples on as soon as its own result is back,
  rounds ahead of the prompt; the rest (the probe, globals and branches before m, the reserve,
  pre-sampled children) sample a round only once the prompt has reached it, so they do not sample
  what the round schedule would discard before sampling it. So the trees, m, the branch counts
  and every counter but ``rounds`` and the seconds are the round schedule's, whatever the tool
  latencies and the batches (a segment a weight update cuts stays in its round too). With
  ``rollout.experimental.sample_ahead`` (the default) the probe, the speculative globals, their
  branches and the reserve sample ahead too (the rules read every trajectory as of the round
  they belong to, ``PromptState.as_of``): the same trees, and m discards what they sampled ahead
  (more discarded tokens and calls; a call still running for a discarded trajectory is dropped
  when it returns, ``rollout/tool_calls_dropped``).
- **Oldest first.** A round samples at most ``max_batch`` trajectories (the backend's batch), those
  of the oldest step first: the trainer waits for the oldest step.
- **Late results.** Without the barrier a prompt discards a trajectory (a speculative sample
  beyond m, a tentative child) only at the end of a round, once that round's results are back,
  and reads a pre-sampled child's call only once a decision has taken it: no call runs for a
  trajectory its prompt has discarded (by rounds; with ``sample_ahead`` a trajectory m discards
  may have sampled ahead and have a call running). A result that nothing takes is dropped, not
  taken, and counted in its step's ``tool_calls_dropped``.
- **Partial rollouts.** :meth:`round` takes the ``abort`` event a backend with
  ``capabilities.abort`` checks every token; a weight update sets it, the segments it cuts are
  kept and continued from their prefix under the new weights (``policy_version`` is stamped on
  every token), never dropped.

Deliberately left out: priorities beyond step order, and preemption of a running tool call.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Sequence

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenerationBackend, GenOutput
from aepo_engine.rollout.calls import PendingCall
from aepo_engine.rollout.scheduler import EntropyBalancedRollout, RolloutResult
from aepo_engine.rollout.state import PromptState, state_key
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["ContinuousRollout", "TOOL_HISTORY"]

# Durations remembered per tool: the scheduler predicts when a running call returns from them
# (ContinuousRollout.settle).
TOOL_HISTORY = 64
# Weight of the newest round in the running generation time of a round (ContinuousRollout.round_s).
ROUND_EMA = 0.3


@dataclass
class _Round:
    """Where a prompt stands in the round schedule (without the tool barrier): the round whose
    actions it takes, the trajectories that sample in it (None: not started yet), how many of
    them have taken their decision, the pre-sampled children its decisions left (dropped), and
    whether the prompt has ended (no trajectory samples after this round)."""

    number: int = 0
    group: list[Trajectory] | None = None
    decided: int = 0
    dropped: set[int] | None = None
    ended: bool = False


class ContinuousRollout(EntropyBalancedRollout):
    """Entropy-balanced rollouts of many steps at once (module docstring). Without the barrier a
    round first waits for the tool results expected back soon, at most
    ``config.experimental.settle_s`` (:meth:`settle`; None: as long as a round's generation takes).

    Args:
        backend, tool_runner, config, tokenizer, tool_names, tool_format: as
            :class:`EntropyBalancedRollout`;
            the tool runner must have ``submit(call) -> Future`` unless ``tool_barrier``.
        tool_barrier: each round waits for its tool calls (the synchronous scheduler's rounds).
        max_batch: the most trajectories one round samples (e.g. the backend's batch); None = all
            that are ready.
    """

    def __init__(self, backend: GenerationBackend, tool_runner: Any, config: RolloutConfig, tokenizer: Any = None,
                 tool_names: Sequence[str] | None = None, tool_format: Any = None, *, tool_barrier: bool = False,
                 max_batch: int | None = None) -> None:
        super().__init__(backend, tool_runner, config, tokenizer=tokenizer, tool_names=tool_names,
                         tool_format=tool_format)
        self.tool_barrier = tool_barrier
        self.max_batch = max_batch
        self.settle_s = config.experimental.settle_s
        self.round_s = 0.0  # running generation time of a round (ROUND_EMA), 0 before the first
        self.states: dict[tuple[int, int], PromptState] = {}
        self._steps: dict[int, list[tuple[int, int]]] = {}  # step -> its prompts' state keys
        self._tools: dict[Future, PendingCall] = {}
        self._call_times: dict[Future, list[float]] = {}  # [submitted, returned] (perf_counter)
        self._durations: dict[str, deque[float]] = {}  # per tool: its last TOOL_HISTORY calls' seconds
        self._in_flight: set[int] = set()  # ids of the trajectories whose tool call runs
        # without the barrier: each prompt's place in the round schedule, and the segments of
        # pre-sampled children waiting for their parent's decision before their calls are read
        self._rounds: dict[tuple[int, int], _Round] = {}
        self._held: dict[tuple[int, int, int], tuple[Trajectory, GenOutput]] = {}
        self.generate_s = self.tool_wait_s = 0.0  # seconds in the backend / waiting on tools alone

    @classmethod
    def for_schedule(cls, backend: GenerationBackend, tool_runner: Any, config: RolloutConfig,
                     max_staleness: int = 0, **kwargs: Any) -> "ContinuousRollout":
        """The scheduler ``config.schedule`` asks for (``RolloutConfig.resolved_schedule`` of
        ``max_staleness``: "auto" is "continuous" only where steps overlap): "rounds" waits for
        each round's tool calls and samples every ready trajectory; "continuous" does not wait
        and samples at most the backend's batch (``max_batch_size``; all that are ready when it
        has none) per round, after waiting for the results expected back within
        ``config.experimental.settle_s``."""
        barrier = config.resolved_schedule(max_staleness) == "rounds"
        return cls(backend, tool_runner, config, tool_barrier=barrier,
                   max_batch=None if barrier else getattr(backend, "max_batch_size", None), **kwargs)

    # -- admission and results ------------------------------------------------------------------

    def admit(self, prompts: list[list[int]], step: int) -> None:
        """Start the prompts of training step ``step`` (its seeds; a step is admitted once)."""
        if step in self._steps:
            raise ValueError(f"step {step} was admitted already")
        states = self._new_states(prompts, step)
        self.states.update(states)
        self._steps[step] = list(states)
        if not self.tool_barrier:
            for key, state in states.items():
                state.note_births(0)
                self._rounds[key] = _Round()
                self._follow(key, state)

    @property
    def steps_in_flight(self) -> list[int]:
        return sorted(self._steps)

    def finished(self) -> list[tuple[int, RolloutResult]]:
        """Steps whose every prompt has its k ended trajectories (removed from the session), in
        step order, each as a :meth:`EntropyBalancedRollout.rollout` call would return it."""
        done = []
        for step in sorted(self._steps):
            states = [self.states[key] for key in self._steps[step]]
            if (any(state.generating() for state in states) if self.tool_barrier
                    else not all(self._rounds[key].ended for key in self._steps[step])):
                continue
            # calls still running for its trajectories: those of discarded ones (sample_ahead),
            # counted here, dropped when they return
            keys = set(self._steps[step])  # its prompts share one set of counters
            states[0].stats.tool_calls_dropped += sum(state_key(p.traj) in keys for p in self._tools.values())
            done.append((step, self._result(states)))
            for key in self._steps.pop(step):
                del self.states[key]
                self._rounds.pop(key, None)
        return done

    # -- rounds ---------------------------------------------------------------------------------

    def ready(self) -> list[Trajectory]:
        """What the next round samples: trajectories not waiting on a tool, oldest step first,
        at most ``max_batch``; without the barrier, those a prompt keeps for certain (with
        ``sample_ahead``, all but the children that wait on or anticipate a decision) and the
        others of the round it has reached (module docstring)."""
        if self.tool_barrier:
            batch = self._next_batch(self.states)
        else:
            batch = []
            ahead = self.config.experimental.sample_ahead
            for key, state in self.states.items():
                now, pool = self._rounds[key], state.generating()
                if ahead:  # all but the children that wait on or anticipate a decision
                    free = {id(t) for t in pool} - {id(t) for t in (*state.tentative.values(),
                                                                     *state.presampled.values())}
                else:  # those the prompt keeps for certain
                    free = {id(t) for t in state.members} if state.m is not None else set()
                batch += [t for t in pool if id(t) not in self._in_flight
                          and _uid(t) not in self._held
                          and (id(t) in free or state.rounds_sampled(t) <= now.number)]
        batch.sort(key=lambda t: (t.step, t.prompt_index, t.traj_id))
        return batch if self.max_batch is None else batch[: self.max_batch]

    def run_step(self, prompts: list[list[int]], step: int, version: int | None = None,
                 poll_s: float = 1.0) -> RolloutResult:
        """Sample step ``step``'s ``config.k`` trajectories per prompt, alone in flight: what
        :meth:`EntropyBalancedRollout.rollout` returns, on this scheduler (``poll_s``: the longest
        wait for a tool result before looking again; it returns at the first result). Timing
        decides batches, never trees.

        Args:
            prompts, step, version: as :meth:`EntropyBalancedRollout.rollout` (``version`` None:
                ``step``, a synchronous run's weights).
        """
        self.policy_version = step if version is None else version
        self.admit(prompts, step)
        while True:
            sampled = self.round()
            for done, result in self.finished():
                if done == step:
                    return result
            if sampled:
                continue
            if not self.waiting_on_tools:
                raise RuntimeError(f"step {step}: nothing left to sample or wait for, yet not finished")
            self.take_tool_results(wait_s=poll_s)

    def settle(self, window_s: float | None = None) -> int:
        """Before a round without the barrier: wait for the tool results expected back soon, at
        most ``window_s`` (None: :attr:`settle_s`, or when that is None the running generation
        time of a round, :attr:`round_s`); returns how many were taken.

        The rule is the ski-rental one: a result that comes back just after a round starts waits
        for that whole round and then samples in the next, so waiting up to one round's generation
        time for it costs the trajectories already ready at most what it saves the late one, and
        never more than twice the best choice in hindsight. The wait stops as soon as no running
        call is expected back within what is left of the window (each tool's recent durations
        predict its calls' returns, given how long they have run: a 1 s search is not waited for
        by a 0.1 s round, a 20 ms sandboxed call is) or a full batch is ready. At near-zero tool
        latency a step then takes the round schedule's rounds (no extra, narrower backend calls);
        at high latency rounds do not wait for slow calls."""
        window = window_s if window_s is not None else self.settle_s if self.settle_s is not None else self.round_s
        if window <= 0 or not self._tools:
            return 0
        deadline, taken = time.perf_counter() + window, 0
        while self._tools:
            left = deadline - time.perf_counter()
            if left <= 0 or not self._expected_within(left):
                break
            if self.max_batch is not None and len(self.ready()) >= self.max_batch:
                break
            got = self.take_tool_results(wait_s=left)
            if not got:
                break
            taken += got
        return taken

    def _expected_within(self, seconds: float) -> bool:
        """Some running call is expected back within ``seconds``. A call's remaining time is
        predicted from its tool's recorded durations longer than it has run so far (their median
        excess); with no such record (none yet, or it has outrun them all) the guess is as long
        again as it has run (a fresh call: at once; one running for 1 s: another second)."""
        now = time.perf_counter()
        for future, pending in self._tools.items():
            if future.done():
                return True
            ran = now - self._call_times[future][0]
            longer = [d - ran for d in self._durations.get(pending.call.tool, ()) if d > ran]
            if (statistics.median(longer) if longer else ran) <= seconds:
                return True
        return False

    def round(self, abort: Any = None) -> bool:
        """One round over :meth:`ready` (``abort``: see the module docstring); then take the tool
        results that are back and advance the prompts. Returns False when nothing was ready."""
        if not self.tool_barrier:
            self.settle()
        batch = self.ready()
        if not batch:
            return False
        start = time.perf_counter()
        if self.tool_barrier:
            calls = self._generate(self.states, batch, abort)
        else:  # the decisions wait for the prompt's round (_follow)
            calls = self._read_calls(self._sample(self.states, batch, abort))
        generated = time.perf_counter()
        self.generate_s += generated - start
        self.round_s += ROUND_EMA * (generated - start - self.round_s) if self.round_s else generated - start
        if self.tool_barrier:
            if calls:
                self._run_tools(self.states, calls)
            self.tool_wait_s += time.perf_counter() - generated
        else:
            for pending in calls:
                self._submit(pending)
        for stats in {id(self.states[state_key(t)].stats): self.states[state_key(t)].stats for t in batch}.values():
            stats.time_round(len(batch), generated - start, time.perf_counter() - generated)
        self.take_tool_results()
        return True

    def take_tool_results(self, wait_s: float = 0.0) -> int:
        """Append the results of finished tool calls (waiting up to ``wait_s`` for the first when
        none is finished) and advance the prompts; returns how many were taken."""
        if not self._tools:
            self._advance_all()
            return 0
        start = time.perf_counter()
        done, _ = wait_futures(list(self._tools), timeout=wait_s, return_when=FIRST_COMPLETED)
        if wait_s:  # waiting on tools alone: every step in flight waited
            waited = time.perf_counter() - start
            self.tool_wait_s += waited
            for counters in {id(self.states[keys[0]].stats): self.states[keys[0]].stats
                             for keys in self._steps.values() if keys}.values():
                counters.tool_s += waited
        for future in sorted(done, key=lambda f: _uid(self._tools[f].traj)):  # deterministic order
            pending = self._tools.pop(future)
            self._in_flight.discard(id(pending.traj))
            submitted, *returned = self._call_times.pop(future)  # its callback may not have run yet
            returned = returned[0] if returned else time.perf_counter()
            self._durations.setdefault(pending.call.tool, deque(maxlen=TOOL_HISTORY)).append(returned - submitted)
            state = self.states.get(state_key(pending.traj))
            if state is None or not any(t is pending.traj for t in state.generating()):
                # Its prompt discarded the trajectory (a speculative sample beyond m, a tentative
                # child) while the call ran, and may have ended with its step (which counted the
                # call then, finished()): nothing takes it.
                if state is not None:
                    state.stats.tool_calls_dropped += 1
                continue
            self.calls.take_result(pending, future.result(), state.stats)
        self._advance_all()
        return len(done)

    @property
    def waiting_on_tools(self) -> int:
        return len(self._tools)

    @property
    def cut_segments(self) -> int:
        """Segments cut by a weight update and waiting to be continued."""
        return len(self.segments)

    def _advance_all(self) -> None:
        for key, state in self.states.items():
            if self.tool_barrier:
                self.monitoring.advance(state)
            else:
                self._follow(key, state)

    # -- the round schedule's order, without the barrier -----------------------------------------

    def _submit(self, pending: PendingCall) -> None:
        times = [time.perf_counter()]
        future = self.tool_runner.submit(pending.call)
        future.add_done_callback(lambda _: times.append(time.perf_counter()))  # when it returned
        self._tools[future] = pending
        self._call_times[future] = times
        self._in_flight.add(id(pending.traj))

    def _read_calls(self, finished: list[tuple[Trajectory, GenOutput]]) -> list[PendingCall]:
        """The tool calls of these just-sampled segments; a pre-sampled child's segment is held
        until its parent's decision (its call runs only if the decision takes the child)."""
        calls = []
        for traj, output in finished:
            state = self.states[state_key(traj)]
            if any(traj is child for child in state.presampled.values()):
                self._held[_uid(traj)] = (traj, output)
                continue
            call = self.calls.read(traj, output, state.stats)
            if call is not None:
                calls.append(call)
        return calls

    def _follow(self, key: tuple[int, int], state: PromptState) -> None:
        """Take the prompt's actions of the round schedule, in its order, as far as what has been
        sampled and answered allows: a round starts (its pre-sampled children, who samples in
        it), its trajectories take their decisions in id order, each once its segment of the
        round is sampled; the children no decision took are dropped (the others' calls run);
        once every tool result of the round is back, its pre-monitoring (m, refills, the
        reserve) ends it."""
        now = self._rounds[key]
        while not now.ended:
            if now.group is None:
                self._start_round(state, now)
            if not self._decide(state, now):
                return
            if now.dropped is None:
                now.dropped = self._settle_presampled(key, state)
            if not self._results_back(state, now):
                return
            self._end_round(state, now)

    def _start_round(self, state: PromptState, now: _Round) -> None:
        """Round ``now.number`` starts: the children pre-sampled beside their parent's reaction,
        and the trajectories that sample in it (as the round schedule saw them then)."""
        state.as_of = now.number - 1
        if self.config.branching and self.config.experimental.presample_children:
            self.branching.presample(state)
        state.note_births(now.number)
        now.group, now.decided, now.dropped = state.generating(), 0, None
        state.as_of = None

    def _decide(self, state: PromptState, now: _Round) -> bool:
        """Take the round's decisions in id order, up to the first trajectory whose segment of
        the round is not sampled yet; True once all are taken."""
        for traj in now.group[now.decided:]:
            if state.rounds_sampled(traj) <= now.number:
                return False
            if self.config.branching:
                self.branching.after_segment(state, traj, _model_segment(state, traj, now.number))
            state.note_births(now.number + 1)  # its child starts next round
            now.decided += 1
        return True

    def _settle_presampled(self, key: tuple[int, int], state: PromptState) -> set[int]:
        """Drop the pre-sampled children that no decision of the round took; read the calls of
        those taken and run them. Returns the ids of the dropped."""
        dropped = set()
        for child in state.drop_presampled():
            dropped.add(id(child))
            self.segments.drop(child)
            self._held.pop(_uid(child), None)
        for uid in [uid for uid in self._held if uid[:2] == key]:
            traj, output = self._held.pop(uid)
            call = self.calls.read(traj, output, state.stats)
            if call is not None:
                self._submit(call)
        return dropped

    def _results_back(self, state: PromptState, now: _Round) -> bool:
        """Every tool result of the round's segments is back (a trajectory that has sampled
        its next round's segment has its own)."""
        return not any(id(traj) not in now.dropped and state.rounds_sampled(traj) == now.number + 1
                       and (id(traj) in self._in_flight or _uid(traj) in self._held) for traj in now.group)

    def _end_round(self, state: PromptState, now: _Round) -> None:
        """The round's pre-monitoring (as the round schedule saw the prompt at its end); the
        prompt has ended when nothing samples after it."""
        state.as_of = now.number
        self.monitoring.advance(state)
        state.note_births(now.number + 1)
        now.ended = not state.generating()
        state.as_of = None
        now.number, now.group = now.number + 1, None


def _model_segment(state: PromptState, traj: Trajectory, round_: int) -> int:
    """The index in ``traj.segments`` of its model segment of round ``round_``."""
    birth, inherited = state.births[traj.traj_id]
    wanted, seen = inherited + round_ - birth, -1
    for j, segment in enumerate(traj.segments):
        seen += segment.kind == "model"
        if seen == wanted:
            return j
    raise ValueError(f"{traj.uid} has no segment of round {round_}")


def _uid(traj: Trajectory) -> tuple[int, int, int]:
    """A key unique to a trajectory for the scheduler's life, in (step, prompt, id) order."""
    return traj.step, traj.prompt_index, traj.traj_id
