"""Finding the tool call at the end of a generated segment (its result's framing: :mod:`.framing`).

The rollout generates until a stop string such as ``</search>`` (docs/algorithm.md §1b), so a segment that
calls a tool ends with the closing tag. The parser looks only at the end of the segment: the
last complete ``<name>payload</name>``. Tags are exact (``<search>``, no attributes, no spaces).

Deliberately left out: JSON/function-call syntaxes and tags with attributes. An unknown tag at
the end of a segment is reported only when it is not one of the prompt format's own tags
(``think``, ``answer``, ``result``), so a normal ``</answer>`` ending is never a tool call.
"""
from __future__ import annotations

import re
from typing import Iterable

from aepo_engine.tools.base import MalformedToolCall, ToolCall
from aepo_engine.tools.framing import DEFAULT_TOOLS, ENGINE_TAGS

TOOL_STOP_STRINGS: tuple[str, ...] = tuple(f"</{name}>" for name in DEFAULT_TOOLS)
"""Stop strings for the default tools: generation pauses right after one of these."""

NON_TOOL_TAGS: tuple[str, ...] = ENGINE_TAGS
DEFAULT_MAX_PAYLOAD_CHARS = 20_000

_TRAILING_CLOSE = re.compile(r"</([A-Za-z_][A-Za-z0-9_]*)>\s*\Z")


def find_tool_call(
    segment_text: str,
    tool_names: Iterable[str],
    *,
    max_payload_chars: int = DEFAULT_MAX_PAYLOAD_CHARS,
    non_tool_tags: Iterable[str] = NON_TOOL_TAGS,
) -> ToolCall | MalformedToolCall | None:
    """Parse the tool call that ends ``segment_text``.

    Args:
        segment_text: one generated segment (it ends with e.g. ``"</search>"`` on a tool call).
        tool_names: the enabled tool tags.
        max_payload_chars: payloads longer than this are malformed.
        non_tool_tags: tags of the prompt format that are never tool calls.

    Returns:
        The last complete call at the end of the segment; ``None`` when the segment makes no tool
        call; :class:`MalformedToolCall` for an opened-but-broken call.
    """
    names = tuple(tool_names)
    match = _TRAILING_CLOSE.search(segment_text)
    if match is None or match.group(1) in non_tool_tags:
        return _unclosed_call(segment_text, names)
    name = match.group(1)
    if name not in names:
        return _unknown_tool_call(segment_text[: match.start()], name, names)
    return _closed_call(segment_text[: match.start()], name, max_payload_chars)


def _closed_call(body: str, name: str, max_chars: int):
    """The call whose closing tag ``</name>`` ends the segment; ``body`` is the text before it."""
    open_tag = f"<{name}>"
    start = body.rfind(open_tag)
    if start < 0:
        return MalformedToolCall(f"found </{name}> without a matching {open_tag}", name)
    earlier = body[:start]
    if earlier.rfind(open_tag) > earlier.rfind(f"</{name}>"):
        return MalformedToolCall(f"nested or unclosed {open_tag} before this call", name)
    # Other tools' tags inside the payload are allowed: code may legitimately print "<search>".
    payload = body[start + len(open_tag):].strip()
    if not payload:
        return MalformedToolCall(f"empty {open_tag} payload", name)
    if len(payload) > max_chars:
        return MalformedToolCall(
            f"{open_tag} payload has {len(payload)} chars, over the {max_chars} limit", name)
    return ToolCall(name, payload)


def _unknown_tool_call(body: str, name: str, names: tuple[str, ...]):
    """A segment ending in ``</name>`` for a tag that is not an enabled tool."""
    if f"<{name}>" not in body:
        return None  # a stray closing tag in free text is not a call attempt
    return MalformedToolCall(f"unknown tool <{name}>; available tools: {list(names)}", name)


def _unclosed_call(segment_text: str, names: tuple[str, ...]):
    """Detect a segment that ended inside an opened tool tag (e.g. cut by the length limit)."""
    best_name, best_pos = None, -1
    for name in names:
        pos = segment_text.rfind(f"<{name}>")
        if pos > best_pos:
            best_name, best_pos = name, pos
    if best_name is None or "</" in segment_text[best_pos:]:
        return None
    return MalformedToolCall(f"unclosed <{best_name}>: the segment ended inside the call",
                             best_name)
