"""Continuous rollouts: the prompts of several training steps in flight at once, for asynchronous
training (docs/async.md).

:class:`ContinuousRollout` runs the entropy-balanced scheduler of :mod:`aepo_engine.rollout.scheduler`
(the same per-prompt logic: pre-monitoring, branching, the budget, the seeds) over whatever has been
admitted, round after round, and hands back each step's k trajectories per prompt as soon as the last
of them has ended. What differs from one :meth:`EntropyBalancedRollout.rollout` call:

- **Admission.** :meth:`admit` adds a step's prompts at any time (the caller decides when:
  ``train.max_staleness``); their seeds are those a synchronous run would use for that step.
- **No round barrier on tools** (``tool_barrier=False``): a tool call is submitted and the round
  returns; the trajectory samples again in the first round after its result is back, while the
  others go on. With ``tool_barrier=True`` each round waits for its calls, as the synchronous
  scheduler does (and then, admitting one step at a time, produces exactly its trajectories).
- **Oldest first.** A round samples at most ``max_batch`` trajectories (the backend's batch), those
  of the oldest step first: the trainer waits for the oldest step.
- **Late results.** A prompt may discard a trajectory while its call runs (a speculative sample
  beyond m, a tentative child), and its step may end before the result is back: such a result is
  dropped (``dropped_tool_results``).
- **Partial rollouts.** :meth:`round` takes the ``abort`` event a backend with
  ``capabilities.abort`` checks every token; a weight update sets it, the segments it cuts are
  kept and continued from their prefix under the new weights (``policy_version`` is stamped on
  every token), never dropped.

Deliberately left out: priorities beyond step order, and preemption of a running tool call.
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any, Sequence

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenerationBackend
from aepo_engine.rollout.calls import PendingCall
from aepo_engine.rollout.scheduler import EntropyBalancedRollout, RolloutResult
from aepo_engine.rollout.state import PromptState, state_key
from aepo_engine.rollout.trajectory import Trajectory

__all__ = ["ContinuousRollout"]


class ContinuousRollout(EntropyBalancedRollout):
    """Entropy-balanced rollouts of many steps at once (module docstring).

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
        self.states: dict[tuple[int, int], PromptState] = {}
        self._steps: dict[int, list[tuple[int, int]]] = {}  # step -> its prompts' state keys
        self._tools: dict[Future, PendingCall] = {}
        self.generate_s = self.tool_wait_s = 0.0  # seconds in the backend / waiting on tools alone
        self.dropped_tool_results = 0  # results whose trajectory was discarded while the call ran

    # -- admission and results ------------------------------------------------------------------

    def admit(self, prompts: list[list[int]], step: int) -> None:
        """Start the prompts of training step ``step`` (its seeds; a step is admitted once)."""
        if step in self._steps:
            raise ValueError(f"step {step} was admitted already")
        states = self._new_states(prompts, step)
        self.states.update(states)
        self._steps[step] = list(states)

    @property
    def steps_in_flight(self) -> list[int]:
        return sorted(self._steps)

    def finished(self) -> list[tuple[int, RolloutResult]]:
        """Steps whose every prompt has its k ended trajectories (removed from the session), in
        step order, each as a :meth:`EntropyBalancedRollout.rollout` call would return it."""
        done = []
        for step in sorted(self._steps):
            states = [self.states[key] for key in self._steps[step]]
            if any(state.generating() for state in states):
                continue
            done.append((step, self._result(states)))
            for key in self._steps.pop(step):
                del self.states[key]
        return done

    # -- rounds ---------------------------------------------------------------------------------

    def ready(self) -> list[Trajectory]:
        """What the next round samples: trajectories not waiting on a tool, oldest step first,
        at most ``max_batch``."""
        waiting = {id(pending.traj) for pending in self._tools.values()}
        batch = [t for t in self._next_batch(self.states) if id(t) not in waiting]
        batch.sort(key=lambda t: (t.step, t.prompt_index, t.traj_id))
        return batch if self.max_batch is None else batch[: self.max_batch]

    def round(self, abort: Any = None) -> bool:
        """One round over :meth:`ready` (``abort``: see the module docstring); then take the tool
        results that are back and advance the prompts. Returns False when nothing was ready."""
        batch = self.ready()
        if not batch:
            return False
        start = time.perf_counter()
        calls = self._generate(self.states, batch, abort)
        self.generate_s += time.perf_counter() - start
        if self.tool_barrier:
            tools_start = time.perf_counter()
            if calls:
                self._run_tools(self.states, calls)
            self.tool_wait_s += time.perf_counter() - tools_start
        else:
            for pending in calls:
                self._tools[self.tool_runner.submit(pending.call)] = pending
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
        self.tool_wait_s += time.perf_counter() - start if wait_s else 0.0
        for future in sorted(done, key=lambda f: _order(self._tools[f].traj)):  # deterministic order
            pending = self._tools.pop(future)
            state = self.states.get(state_key(pending.traj))
            if state is None or not any(t is pending.traj for t in state.generating()):
                # Its prompt discarded the trajectory (a speculative sample beyond m, a tentative
                # child) while the call ran, and may have ended with its step: nothing takes it.
                self.dropped_tool_results += 1
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
        for state in self.states.values():
            self.monitoring.advance(state)


def _order(traj: Trajectory) -> tuple[int, int, int]:
    return traj.step, traj.prompt_index, traj.traj_id
