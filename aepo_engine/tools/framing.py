"""How tool output enters a trajectory so that the policy cannot forge what the engine or the
reward reads: the tool's text is *plain text*, whatever it printed.

Code the model writes (and a web page it finds) can print the engine's own markup: a
``</result>`` that closes the result block early and then ``<search>q</search><result>`` (a
search that never ran, counted for the tool bonus) or ``<answer>\\boxed{7}</answer>`` (an answer
the model never wrote), or a chat-control token such as ``<|im_end|>`` that ``tokenizer.encode``
turns into the real control id (a forged turn boundary in the model's context). Two guards, for
every tool and every prompt format:

1. :func:`neutralise` rewrites each *reserved string* in the tool's text so that it no longer
   occurs: its first character becomes an HTML entity (``</result>`` -> ``&lt;/result>``,
   ``<|im_end|>`` -> ``&lt;|im_end|>``, ``[INST]`` -> ``&#91;INST]``). Reserved are the engine's
   tags (``<result>``, ``<answer>``, ``<think>``, each tool's tag, opening and closing; any case)
   and the text of every token the tokenizer adds to its vocabulary (special or not: a
   tokenizer matches those strings before its ordinary encoding, so they are the only way text
   becomes a control id). :func:`encode_plain_text` encodes the rewritten text and checks that
   no added-token id came out. The same text in the same place reads the same to the model; only
   the markup it could mistake for the engine's is spelt differently.
2. The engine records where it put each tool result (the trajectory's tool segments,
   ``rollout.trajectory.decode_response`` turns them into character spans), and the rewards
   locate result blocks by those spans, not by searching the text for tags
   (``rewards.text.strip_tool_results``, ``rewards.deep_research.check_format``).

:func:`encode_tool_result` frames a result for the tag format (`` <result>\\n...\\n</result>``);
another prompt format passes its own framing to :func:`encode_plain_text`.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Iterable

RESULT_OPEN, RESULT_CLOSE = " <result>\n", "\n</result>"
ENGINE_TAGS: tuple[str, ...] = ("think", "answer", "result")
"""Tags of the prompt format that are not tools (the tools' own tags are reserved too)."""
DEFAULT_TOOLS: tuple[str, ...] = ("search", "python")
"""The built-in tools, whose tags a result's text may not hold when no list is given."""
_ROUNDS = 4


def engine_tag_strings(tool_names: Iterable[str] = DEFAULT_TOOLS) -> tuple[str, ...]:
    """``<tag>`` and ``</tag>`` of every engine tag and tool name."""
    return tuple(f"<{slash}{tag}>" for tag in (*ENGINE_TAGS, *tool_names) for slash in ("", "/"))


def added_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The text of every token the tokenizer adds (special or not), which its encoder matches
    before ordinary text.

    Args:
        tokenizer: a Hugging Face tokenizer (or anything with ``get_added_vocab`` and/or
            ``all_special_tokens``); one with neither adds none.
    """
    strings = set(getattr(tokenizer, "all_special_tokens", None) or ())
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added):
        strings |= set(get_added())
    return tuple(sorted(s for s in strings if s))


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens of :func:`added_token_strings`."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    get_added = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added):
        ids |= set(get_added().values())
    return frozenset(int(i) for i in ids)


@functools.lru_cache(maxsize=64)
def _pattern(reserved: tuple[str, ...]) -> re.Pattern[str] | None:
    if not reserved:
        return None
    ordered = sorted(set(reserved), key=len, reverse=True)  # the longest string wins at a position
    return re.compile("|".join(re.escape(s) for s in ordered), re.IGNORECASE)


def _entity(char: str) -> str:
    return "&lt;" if char == "<" else f"&#{ord(char)};"


def neutralise(text: str, reserved: Iterable[str]) -> str:
    """``text`` with no reserved string left in it (module docstring, guard 1).

    Args:
        text: tool output.
        reserved: the strings that must not occur (matched without regard to case).

    Returns:
        The text with the first character of each occurrence written as an HTML entity;
        unchanged when nothing reserved occurs.
    """
    pattern = _pattern(tuple(sorted(set(reserved))))
    if pattern is None:
        return text
    for _ in range(_ROUNDS):  # a rewrite cannot create a new occurrence but for odd tokenizers
        text, count = pattern.subn(lambda m: _entity(m.group(0)[0]) + m.group(0)[1:], text)
        if not count:
            return text
    return text.replace("<", "&lt;")


def encode_plain_text(tokenizer: Any, text: str, reserved: Iterable[str] = (), *, before: str = "",
                      after: str = "") -> list[int]:
    """Token ids of ``before + text + after`` where ``text`` (the tool's) is plain text: no
    reserved string and no added/special token id comes from it (guard 1 of the module
    docstring); ``before``/``after`` (the format's own framing) are encoded as markup. The one
    encoder of tool text, for every prompt format. One ``encode`` call, so that the framed text
    tokenizes as a whole demonstration of it does.

    Args:
        tokenizer: a Hugging Face tokenizer (``encode``, ``get_added_vocab``).
        text: the tool's text.
        reserved: strings the prompt format reserves besides the tokenizer's added tokens (the
            engine's tags: :func:`engine_tag_strings`).
        before, after: the framing around the text.

    Returns:
        The ids (no special tokens added).

    Raises:
        RuntimeError: the ids hold an added-token id the framing does not account for (a
            tokenizer whose normaliser rewrote the entity back): refused rather than let a forged
            control id in.
    """
    safe = neutralise(text, (*added_token_strings(tokenizer), *reserved))
    ids = list(tokenizer.encode(before + safe + after, add_special_tokens=False))
    added = added_token_ids(tokenizer)
    frame = [i for part in (before, after) if part
             for i in tokenizer.encode(part, add_special_tokens=False) if i in added]
    found = [i for i in ids if i in added]
    if found != frame:
        raise RuntimeError(f"tool text encoded to added-token ids {found} where the framing has "
                           f"{frame}; {type(tokenizer).__name__} needs another escape")
    return ids


def format_tool_result(text: str, tool_names: Iterable[str] = DEFAULT_TOOLS) -> str:
    """A tool result framed for the tag format (docs/algorithm.md §1b), engine tags neutralised.

    Args:
        text: the result text.
        tool_names: the enabled tools (their tags are reserved too).

    Returns:
        ``" <result>\\n" + neutralise(text) + "\\n</result>"``.
    """
    return RESULT_OPEN + neutralise(text, engine_tag_strings(tool_names)) + RESULT_CLOSE


def encode_tool_result(tokenizer: Any, text: str, tool_names: Iterable[str] = DEFAULT_TOOLS) -> list[int]:
    """Token ids of :func:`format_tool_result`: the frame as the engine's own markup, the text
    as plain text (:func:`encode_plain_text`).

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the result text.
        tool_names: the enabled tools.
    """
    return encode_plain_text(tokenizer, text, engine_tag_strings(tool_names), before=RESULT_OPEN,
                             after=RESULT_CLOSE)
