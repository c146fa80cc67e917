"""find_tool_call / format_tool_result: good calls, broken calls, and segments that are no call."""
import pytest

from aepo_engine.tools import (TOOL_STOP_STRINGS, MalformedToolCall, ToolCall, find_tool_call,
                               format_tool_result)

TOOLS = ("search", "python")


@pytest.mark.parametrize("segment, expected", [
    ("<think>need facts</think> <search>capital of France</search>",
     ToolCall("search", "capital of France")),
    ("<python>\nprint(1 + 1)\n</python>\n", ToolCall("python", "print(1 + 1)")),
    # several calls in one segment (a backend that did not stop): the last one counts
    ("<search>first</search> <result>\nx\n</result> <search>second</search>",
     ToolCall("search", "second")),
    ("<search>a</search> then <python>print('<search>')</python>",
     ToolCall("python", "print('<search>')")),
])
def test_good_calls(segment, expected):
    assert find_tool_call(segment, TOOLS) == expected


@pytest.mark.parametrize("segment", [
    "<think>done</think> <answer>\\boxed{42}</answer>",
    "plain text that ended at EOS",
    "I could use <search> tags here </think><answer>\\boxed{1}</answer>",
    "",
    "stray </unknown> closing tag",
])
def test_no_call(segment):
    assert find_tool_call(segment, TOOLS) is None


@pytest.mark.parametrize("segment, tool, reason_part", [
    ("no opening tag </search>", "search", "without a matching <search>"),
    ("<search>a <search>b</search>", "search", "nested or unclosed"),
    ("<search>   \n </search>", "search", "empty"),
    ("<python></python>", "python", "empty"),
    ("let me look <search>query that got cut by the length li", "search", "unclosed"),
    ("<browse>https://example.com</browse>", "browse", "unknown tool"),
])
def test_malformed_calls(segment, tool, reason_part):
    result = find_tool_call(segment, TOOLS)
    assert isinstance(result, MalformedToolCall)
    assert result.tool == tool
    assert reason_part in result.reason


def test_payload_size_cap():
    huge = "<search>" + "word " * 10_000 + "</search>"
    result = find_tool_call(huge, TOOLS, max_payload_chars=1000)
    assert isinstance(result, MalformedToolCall) and "over the 1000 limit" in result.reason
    assert find_tool_call(huge, TOOLS, max_payload_chars=100_000) == \
        ToolCall("search", ("word " * 10_000).strip())


def test_disabled_tool_is_unknown():
    result = find_tool_call("<python>print(1)</python>", ["search"])
    assert isinstance(result, MalformedToolCall) and "unknown tool <python>" in result.reason


def test_format_and_stop_strings():
    assert format_tool_result("Page 1: x") == " <result>\nPage 1: x\n</result>"
    assert TOOL_STOP_STRINGS == ("</search>", "</python>")
    for stop in TOOL_STOP_STRINGS:
        name = stop[2:-1]
        assert find_tool_call(f"<{name}>x{stop}", TOOLS) == ToolCall(name, "x")
