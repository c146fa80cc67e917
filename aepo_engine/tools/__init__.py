"""Tools for agent rollouts: parsing tool calls, running them, and the built-in tools.

Public API (the rollout scheduler codes against exactly this)::

    from aepo_engine.tools import (ToolCall, MalformedToolCall, ToolResult, Tool, register_tool,
                                   build_tool, ToolRunner, find_tool_call, format_tool_result,
                                   encode_tool_result, encode_plain_text, TOOL_STOP_STRINGS)

Built-in tools: ``search`` (offline cache / local BM25 corpus / HTTP retrieval server) and
``python`` (sandboxed subprocess). Configure them with :class:`ToolsConfig` and
:func:`build_tools`. A new tool is a small ``Tool`` subclass with ``@register_tool("name")``; one
outside the package is named by ``tools.path`` and set by ``tools.options.NAME``.
"""
from aepo_engine.tools.base import (
    MalformedToolCall,
    Tool,
    ToolCall,
    ToolResult,
    build_tool,
    build_tools,
    register_tool,
    registered_tools,
    tool_problems,
    truncate_text,
)
from aepo_engine.tools.config import PythonConfig, SearchConfig, ToolsConfig
from aepo_engine.tools.framing import (encode_plain_text, encode_tool_result, format_tool_result,
                                      neutralise)
from aepo_engine.tools.parsing import TOOL_STOP_STRINGS, find_tool_call
from aepo_engine.tools.runner import ToolRunner

# Importing the built-in tools registers them.
from aepo_engine.tools import python_tool as _python_tool  # noqa: E402,F401
from aepo_engine.tools import search as _search  # noqa: E402,F401

__all__ = [
    "MalformedToolCall", "PythonConfig", "SearchConfig", "TOOL_STOP_STRINGS", "Tool", "ToolCall",
    "ToolResult", "ToolRunner", "ToolsConfig", "build_tool", "build_tools", "encode_plain_text",
    "encode_tool_result", "find_tool_call", "format_tool_result", "neutralise", "register_tool", "registered_tools",
    "tool_problems", "truncate_text",
]
