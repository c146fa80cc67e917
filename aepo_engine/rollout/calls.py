"""The tool calls of a round (docs/rollouts.md, step 2): the call a finished segment ends with, or
why its trajectory ends there (eos, a length cap, a stop string without a call, a malformed call,
the call limit); running a round's calls; appending each result to its trajectory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.protocol import GenOutput
from aepo_engine.rollout.stats import RolloutCounters
from aepo_engine.rollout.trajectory import ToolCallRecord, Trajectory
from aepo_engine.tools import MalformedToolCall, ToolCall

__all__ = ["PendingCall", "ToolCalls"]


@dataclass(frozen=True)
class PendingCall:
    """A tool call a segment ended with, waiting for its result."""

    traj: Trajectory
    call: ToolCall
    ended_turn: bool  # the segment ended the model's turn (eos): the format inserts the result after it


class ToolCalls:
    """Reads, runs and answers the tool calls of a rollout's trajectories.

    Args:
        tool_runner: an object with ``run(calls) -> list[ToolResult]`` (e.g. ``ToolRunner``).
        tool_format: parses calls and encodes results (``aepo_engine.tools.formats``).
        tokenizer: decodes a segment the backend returned without text.
        config: the rollout knobs (``max_response_tokens``, ``max_tool_calls``).
    """

    def __init__(self, tool_runner: Any, tool_format: Any, tokenizer: Any, config: RolloutConfig) -> None:
        self.tool_runner = tool_runner
        self.tool_format = tool_format
        self.tokenizer = tokenizer
        self.config = config

    def read(self, traj: Trajectory, output: GenOutput, stats: RolloutCounters) -> PendingCall | None:
        """The tool call ``traj``'s latest segment (``output``) ends with; None, with the finish
        reason set, when the trajectory ends here instead."""
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
            return PendingCall(traj, call, output.finish_reason == "eos")
        return None

    def run(self, calls: Sequence[PendingCall]) -> list[Any]:
        """Run a round's calls together (``tool_runner.run``); their results, in order."""
        results = self.tool_runner.run([pending.call for pending in calls])
        if len(results) != len(calls):
            raise RuntimeError(f"tool runner returned {len(results)} results for "
                               f"{len(calls)} calls")
        return results

    def take_result(self, pending: PendingCall, result: Any, stats: RolloutCounters) -> None:
        """Append a tool call's result to its trajectory (cut to the response budget)."""
        traj, call = pending.traj, pending.call
        traj.tool_log.append(ToolCallRecord(call.tool, call.payload, result.text, result.ok, result.elapsed_s))
        remaining = self.config.max_response_tokens - len(traj.response_ids)
        # plain text: tags and control tokens the tool printed cannot act as the engine's
        ids = self.tool_format.result_ids(result.text, pending.ended_turn)
        traj.append_tool_result(list(ids)[:remaining])
        traj.tool_calls += 1
        stats.tool_calls_executed += 1
        stats.tool_errors += int(not result.ok)
        stats.tool_tokens += min(len(ids), remaining)
        if len(traj.response_ids) >= self.config.max_response_tokens:
            traj.finish_reason = "length"
