"""The ``deep_research`` reward of the AEPO reference runs (docs/algorithm.md §3), under the project's rules
(``rules="project"``, the default, below) or the authors' (``rules="authors"``,
:mod:`aepo_engine.rewards.authors`; the differences are listed in docs/scoring.md).

    score = format_penalty (-1)            if the response is malformed
          = F1 + tool_bonus (0.1)          if F1 > 0 and both <search> and <python> were used
          = F1                             otherwise
    F1 = max over the ground truths of the SQuAD token F1 of the last \\boxed{} inside <answer>
         (``text.token_f1``: LaTeX text wrappers unwrapped, yes/no/noanswer all-or-nothing).

A response is malformed when any of these holds (``details["format_error"]`` says which):
- ``<think>``/``</think>`` do not pair up in order (none at all is allowed);
- there is not exactly one ``<answer>...</answer>``, or a tool call opens inside it;
- tool calls and results are out of order: a call (``<search>``/``<python>``) is unclosed or
  nested, a closed call is not followed by a ``<result>`` block before anything else, a
  ``<result>`` appears without a preceding call, or a result is unclosed;
- the answer has no ``\\boxed{}``.
Tool output is located by the engine's record of where it put it (``tool_spans``,
``rollout.trajectory.decode_response``): each span is one result block and any tag in it (a web
page that contains "<answer>", code that prints ``</result><search>q</search>``) is ignored, so
the tool bonus counts completed calls the model wrote, and a ``<result>`` tag outside a span is
the model's own and malformed. Without the record (saved text) the ``<result>...</result>`` blocks
of the text are the results, which a tool cannot close early either: ``tools.framing`` rewrites
the engine's tags in tool text. ``correct`` is the exact match of the boxed answer with a ground truth
(F1 = 1 can also come from reordered words).
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

from .base import RULES, RewardResult, as_ground_truths, register_reward
from .authors import authors_reward
from .text import ToolSpans, exact_match, extract_boxed, ground_truth_answer, token_f1

__all__ = ["deep_research", "check_format", "FormatCheck"]

TOOL_TAGS = ("search", "python")
_TAG = re.compile(r"<(/?)(think|answer|result|search|python)>")


@dataclass
class _Scan:
    """State of the left-to-right tag scan."""

    think_open: bool = False
    answer_open: bool = False
    answers: int = 0
    in_result: bool = False
    open_call: str | None = None
    awaiting_result: bool = False
    tools_used: set[str] = field(default_factory=set)


def _step(scan: _Scan, closing: bool, name: str) -> str | None:
    """Advance the scan by one tag; return an error message or ``None``."""
    if scan.awaiting_result and name != "result":
        return "tool call not followed by <result>"
    if scan.open_call is not None and name != scan.open_call:
        return f"<{'/' * closing}{name}> inside <{scan.open_call}>"
    if name == "result":
        if closing:
            return "</result> without <result>"
        if not scan.awaiting_result:
            return "<result> without a preceding tool call"
        scan.awaiting_result, scan.in_result = False, True
    elif name in TOOL_TAGS:
        if closing:
            if scan.open_call != name:
                return f"</{name}> without <{name}>"
            scan.open_call, scan.awaiting_result = None, True
            scan.tools_used.add(name)
        elif scan.open_call is not None or scan.answer_open:
            return f"<{name}> inside <{scan.open_call or 'answer'}>"
        else:
            scan.open_call = name
    elif name == "think":
        if scan.think_open != closing:
            return "unpaired <think>"
        scan.think_open = not closing
    else:  # answer
        if scan.answer_open != closing or (not closing and scan.answers):
            return "not exactly one <answer>...</answer>"
        scan.answer_open = not closing
        scan.answers += int(closing)
    return None


@dataclass(frozen=True)
class FormatCheck:
    """Result of :func:`check_format`.

    Attributes:
        error: ``None`` for a well-formed response, else a short reason.
        tools_used: names of the tools whose calls completed (closing tag seen).
        answer: the text between ``<answer>`` and ``</answer>`` (``None`` if malformed).
    """

    error: str | None
    tools_used: frozenset[str]
    answer: str | None = None


def _final_error(scan: _Scan) -> str | None:
    if scan.in_result:
        return "unclosed <result>"
    if scan.open_call or scan.awaiting_result:
        return "tool call not followed by <result>"
    if scan.think_open:
        return "unpaired <think>"
    if scan.answers != 1 or scan.answer_open:
        return "not exactly one <answer>...</answer>"
    return None


def check_format(response: str, tool_spans: ToolSpans | None = None) -> FormatCheck:
    """Check the tag structure of a deep-research response.

    Args:
        response: the model's text, tool results included.
        tool_spans: where the engine put the tool results (``decode_response``): each is one
            result block whatever it holds; None: the ``<result>...</result>`` blocks of the text.

    Returns:
        A :class:`FormatCheck`.
    """
    if tool_spans is not None:
        return _check_with_spans(response, sorted(tool_spans))
    scan, answer_start, answer_end = _Scan(), 0, 0
    for match in _TAG.finditer(response):
        closing, name = match.group(1) == "/", match.group(2)
        if scan.in_result:
            scan.in_result = not (closing and name == "result")
            continue
        error = _step(scan, closing, name)
        if error is not None:
            return FormatCheck(error, frozenset(scan.tools_used))
        if name == "answer" and closing:
            answer_end = match.start()
        elif name == "answer":
            answer_start = match.end()
    error = _final_error(scan)
    answer = response[answer_start:answer_end] if error is None else None
    return FormatCheck(error, frozenset(scan.tools_used), answer)


def _check_with_spans(response: str, spans: list[tuple[int, int]]) -> FormatCheck:
    """:func:`check_format` on the engine's spans: tags inside one are not scanned, each span is
    a whole result block, and a result tag outside every span is an error."""
    starts = [start for start, _ in spans]
    events = [(start, None, "span") for start in starts]
    for match in _TAG.finditer(response):
        i = bisect.bisect_right(starts, match.start()) - 1
        if i < 0 or match.start() >= spans[i][1]:  # outside every span
            events.append((match.start(), match, match.group(2)))
    scan, answer_start, answer_end = _Scan(), 0, 0
    for _, match, name in sorted(events, key=lambda e: e[0]):
        if match is None:  # a result the engine inserted: opened and closed
            error = _step(scan, False, "result")
            scan.in_result = False
        elif name == "result":
            error = "a result tag the engine did not insert"
        else:
            closing = match.group(1) == "/"
            error = _step(scan, closing, name)
            if name == "answer" and closing:
                answer_end = match.start()
            elif name == "answer":
                answer_start = match.end()
        if error is not None:
            return FormatCheck(error, frozenset(scan.tools_used))
    error = _final_error(scan)
    answer = response[answer_start:answer_end] if error is None else None
    return FormatCheck(error, frozenset(scan.tools_used), answer)


@register_reward("deep_research")
def deep_research(
    response: str,
    ground_truth: Any,
    *,
    format_penalty: float = -1.0,
    tool_bonus: float = 0.1,
    think_opened_in_prompt: bool = False,
    rules: str = "project",
    tool_spans: ToolSpans | None = None,
) -> RewardResult:
    """Score a deep-research response (see the module docstring for the rules).

    Args:
        response: the model's text (prompt excluded), tool results included.
        ground_truth: a string, a list of strings, or a JSON-encoded list.
        format_penalty: score of a malformed response.
        tool_bonus: added when F1 > 0 and both search and python were used.
        think_opened_in_prompt: the chat template already wrote ``<think>`` into the prompt
            (Qwen3 thinking mode), so the response starts inside the think block.
        rules: "project" (module docstring) or "authors" (the authors' reward,
            :mod:`aepo_engine.rewards.authors`); ``reward.rules`` in the config.
        tool_spans: where the engine put the tool results (module docstring); the authors' rules
            read the text as theirs did and do not use it.

    Returns:
        ``RewardResult`` with ``details`` = ``{format_error}`` for a malformed response, else
        ``{answer, f1, em, tools_used}``.

    Raises:
        ValueError: unknown ``rules``.
    """
    if rules not in RULES:
        raise ValueError(f"unknown reward rules {rules!r}: use one of {', '.join(RULES)}")
    if think_opened_in_prompt:
        response = "<think>" + response
        if tool_spans is not None:
            tool_spans = [(start + len("<think>"), end + len("<think>")) for start, end in tool_spans]
    if rules == "authors":
        return authors_reward(response, as_ground_truths(ground_truth), format_penalty, tool_bonus)
    check = check_format(response, tool_spans)
    answer = extract_boxed(check.answer) if check.answer is not None else None
    error = check.error or (None if answer is not None else "no \\boxed{} in <answer>")
    if error is not None:
        return RewardResult(format_penalty, False, {"format_error": error})
    truths = [ground_truth_answer(truth) for truth in as_ground_truths(ground_truth)]
    f1 = max(token_f1(answer, truth) for truth in truths)
    em = any(exact_match(answer, truth) for truth in truths)
    bonus = tool_bonus if f1 > 0 and check.tools_used >= set(TOOL_TAGS) else 0.0
    details = {"answer": answer, "f1": f1, "em": float(em), "tools_used": sorted(check.tools_used)}
    return RewardResult(f1 + bonus, em, details)
