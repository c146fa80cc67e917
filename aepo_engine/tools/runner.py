"""Running a batch of tool calls concurrently over a bounded thread pool.

The rollout collects the calls of all active trajectories after a generation round and hands
them to :meth:`ToolRunner.run` at once; results come back in call order. Bad calls and tool
failures become ``ok=False`` results with a readable text, never exceptions, so one broken
trajectory cannot stop a rollout.

Deliberately left out: retries (a call is run exactly once: re-running code is not idempotent,
docs/algorithm.md §4), per-call cancellation (Python threads cannot be killed: tools enforce their own time
limits; ``call_timeout_s`` only stops *waiting* for a hung user tool, whose thread then keeps a
pool slot until it returns) and process pools (the heavy tools already run in subprocesses or
remote services).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Mapping, Sequence

from aepo_engine.tools.base import MalformedToolCall, Tool, ToolCall, ToolResult, error_result

MALFORMED_KEY = "<malformed>"
"""Stats key under which malformed calls are counted when their tool is unknown."""


class ToolRunner:
    """Concurrent, order-preserving executor for tool calls.

    Args:
        tools: tool name -> tool instance.
        max_workers: the most calls running at once.
        call_timeout_s: optional cap on waiting for one call (see module docstring); None waits.

    ``stats`` maps tool name -> ``{"calls", "errors", "timeouts"}`` counts.
    """

    def __init__(self, tools: Mapping[str, Tool], max_workers: int = 4,
                 call_timeout_s: float | None = None) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.tools = dict(tools)
        self.call_timeout_s = call_timeout_s
        self.stats: dict[str, dict[str, int]] = {}
        self._stats_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="aepo-tool")

    def run(self, calls: Sequence[ToolCall | MalformedToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently and return their results in the same order.

        Args:
            calls: parsed calls; malformed ones and unknown tools yield ``ok=False`` results.

        Returns:
            One :class:`ToolResult` per call.
        """
        pending: list[Future | ToolResult] = [self._submit(call) for call in calls]
        results = [self._collect(item) for item in pending]
        for call, result in zip(calls, results):
            self._count(call, result)
        return results

    def submit(self, call: ToolCall | MalformedToolCall) -> Future:
        """Start one call and return at once; the future's result is its :class:`ToolResult`
        (counted in ``stats`` when it is there). ``call_timeout_s`` does not apply: a caller that
        must not wait on a hung tool waits on the future with its own timeout."""
        item = self._submit(call)
        future: Future = item if isinstance(item, Future) else Future()
        if not isinstance(item, Future):
            future.set_result(item)
        future.add_done_callback(lambda done: None if done.cancelled() else self._count(call, done.result()))
        return future

    def _submit(self, call: ToolCall | MalformedToolCall) -> Future | ToolResult:
        if isinstance(call, MalformedToolCall):
            return error_result(f"malformed tool call: {call.reason}")
        tool = self.tools.get(call.tool)
        if tool is None:
            return error_result(f"unknown tool {call.tool!r}; available tools: {sorted(self.tools)}")
        return self._pool.submit(_call_tool, tool, call.payload)

    def _collect(self, item: Future | ToolResult) -> ToolResult:
        if isinstance(item, ToolResult):
            return item
        try:
            return item.result(timeout=self.call_timeout_s)
        except FutureTimeout:
            return error_result(f"tool call did not finish within {self.call_timeout_s}s",
                                timed_out=True, elapsed_s=self.call_timeout_s or 0.0)

    def _count(self, call: ToolCall | MalformedToolCall, result: ToolResult) -> None:
        key = call.tool if call.tool is not None else MALFORMED_KEY
        with self._stats_lock:
            entry = self.stats.setdefault(key, {"calls": 0, "errors": 0, "timeouts": 0})
            entry["calls"] += 1
            entry["errors"] += int(not result.ok)
            entry["timeouts"] += int(result.timed_out)

    def close(self) -> None:
        """Shut the pool down (waits for running calls) and close the tools."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tool in self.tools.values():
            tool.close()

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _call_tool(tool: Tool, payload: str) -> ToolResult:
    """Call ``tool`` and turn any escaping exception into an error result; fill elapsed time."""
    start = time.perf_counter()
    try:
        result = tool(payload)
    except Exception as exc:  # noqa: BLE001 - a tool bug must not crash the rollout
        result = error_result(f"tool {tool.name!r} failed: {type(exc).__name__}: {exc}")
    if not isinstance(result, ToolResult):
        result = error_result(f"tool {tool.name!r} returned {type(result).__name__}, "
                              "not a ToolResult")
    if not result.elapsed_s:
        result.elapsed_s = time.perf_counter() - start
    return result
