"""ToolRunner (order, bounded concurrency, failures, stats), the registry, and ToolsConfig."""
import json
import threading
import time

import msgspec
import pytest

from aepo_engine.tools import (MalformedToolCall, Tool, ToolCall, ToolResult, ToolRunner,
                               ToolsConfig, build_tool, build_tools, register_tool,
                               registered_tools, truncate_text)


class SleepTool(Tool):
    """Sleeps ``payload`` seconds and records how many calls overlapped."""

    name = "sleep"

    def __init__(self) -> None:
        self.active = 0
        self.peak = 0
        self._lock = threading.Lock()

    def __call__(self, payload: str) -> ToolResult:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(float(payload))
        with self._lock:
            self.active -= 1
        return ToolResult(f"slept {payload}", ok=True)


class BrokenTool(Tool):
    name = "broken"

    def __call__(self, payload: str) -> ToolResult:
        raise ValueError(f"cannot handle {payload!r}")


@register_tool("echo_for_tests")
class EchoTool(Tool):
    def __init__(self, prefix: str = "", max_result_chars: int = 3000) -> None:
        self.prefix = prefix
        self.max_result_chars = max_result_chars

    def __call__(self, payload: str) -> ToolResult:
        return ToolResult(truncate_text(self.prefix + payload, self.max_result_chars), ok=True)


def test_bounded_parallelism_and_order():
    sleeper = SleepTool()
    with ToolRunner({"sleep": sleeper}, max_workers=2) as runner:
        start = time.monotonic()
        results = runner.run([ToolCall("sleep", f"0.{i}") for i in (3, 1, 2, 1, 2, 1)])
        elapsed = time.monotonic() - start
    assert [r.text for r in results] == [f"slept 0.{i}" for i in (3, 1, 2, 1, 2, 1)]
    assert sleeper.peak == 2  # two at once, never more than max_workers
    assert elapsed >= 0.5  # 1.0 s of sleeps on 2 workers
    assert all(r.ok and r.elapsed_s >= 0.1 for r in results)


def test_failures_become_error_results_and_are_counted():
    tools = {"sleep": SleepTool(), "broken": BrokenTool()}
    calls = [ToolCall("broken", "boom"), MalformedToolCall("empty <search> payload", "search"),
             ToolCall("nope", "x"), MalformedToolCall("unknown tool <browse>"),
             ToolCall("sleep", "0")]
    with ToolRunner(tools, max_workers=2) as runner:
        results = runner.run(calls)
        assert [r.ok for r in results] == [False, False, False, False, True]
        assert results[0].text == "Error: tool 'broken' failed: ValueError: cannot handle 'boom'"
        assert results[1].text == "Error: malformed tool call: empty <search> payload"
        assert "unknown tool 'nope'" in results[2].text and "['broken', 'sleep']" in results[2].text
        assert runner.run([ToolCall("sleep", "0")])[0].ok  # still usable
        assert runner.stats["broken"] == {"calls": 1, "errors": 1, "timeouts": 0}
        assert runner.stats["search"]["errors"] == 1 and runner.stats["nope"]["errors"] == 1
        assert runner.stats["<malformed>"]["calls"] == 1
        assert runner.stats["sleep"] == {"calls": 2, "errors": 0, "timeouts": 0}


def test_call_timeout_stops_waiting():
    with ToolRunner({"sleep": SleepTool()}, max_workers=2, call_timeout_s=0.2) as runner:
        slow, fast = runner.run([ToolCall("sleep", "1.0"), ToolCall("sleep", "0")])
        assert slow.timed_out and not slow.ok and fast.ok
        assert runner.stats["sleep"]["timeouts"] == 1


def test_registry():
    assert {"search", "python", "echo_for_tests"} <= set(registered_tools())
    tool = build_tool("echo_for_tests", prefix="> ")
    assert tool.name == "echo_for_tests" and tool("hi").text == "> hi"
    with pytest.raises(KeyError, match=r"unknown tool 'nosuch'; registered tools: \[.*'python'"):
        build_tool("nosuch")
    with pytest.raises(ValueError, match="already registered"):
        register_tool("search")(EchoTool)
    with pytest.raises(ValueError, match="identifier"):
        register_tool("not a tag")


def test_truncate_text():
    assert truncate_text("short", 10) == "short"
    cut = truncate_text("x" * 1000, 100)
    assert len(cut) == 100 and cut.endswith("...[truncated 1000 chars]")


# ---------------------------------------------------------------------------------------------
# Config


def test_default_config_is_valid_and_round_trips():
    cfg = ToolsConfig()
    assert cfg.enabled == ["search", "python"] and cfg.search.backend == "http"
    assert msgspec.json.decode(msgspec.json.encode(cfg), type=ToolsConfig) == cfg


@pytest.mark.parametrize("raw, message", [
    ({"unknown": 1}, "unknown"),
    ({"search": {"backend": "cache"}}, "cache_path is required because"),
    ({"search": {"backend": "google"}}, "backend"),
    ({"python": {"memory_mb": 16}}, "needs that much address space"),
    ({"python": {"run_as_uid": 0}}, "no system account"),
    ({"max_workers": 0}, "max_workers"),
    ({"enabled": ["search", "search"]}, "duplicates"),
])
def test_config_rejects_bad_values(raw, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(raw, ToolsConfig)


@pytest.mark.sandbox
def test_build_tools_from_config(tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps({"q": "Page 1: " + "long text " * 100}))
    raw = {"enabled": ["search", "python", "echo_for_tests"], "result_max_chars": 200,
           "search": {"backend": "cache", "cache_path": str(cache)},
           "python": {"timeout_s": 5}}
    tools = build_tools(msgspec.json.decode(json.dumps(raw), type=ToolsConfig))
    assert list(tools) == ["search", "python", "echo_for_tests"]
    assert len(tools["search"]("q").text) == 200
    assert tools["python"].config.timeout_s == 5
    with pytest.raises(KeyError, match="registered tools"):
        build_tools(ToolsConfig(enabled=["missing_tool"]))
