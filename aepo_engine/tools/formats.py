"""How a trajectory writes tool calls and tool results (``tools.format``).

``"tags"``, the paper's format (docs/algorithm.md §1b): the model writes ``<search> q</search>``,
generation stops at the closing tag, and `` <result>\\n...\\n</result>`` is appended inside the
same assistant turn.

``"chat_template"``, the model's own format, found by rendering its chat template:
- the tools are offered as the template's tool list (``apply_chat_template(..., tools=...)``);
  a template that does not render tools (SmolLM2's plain ChatML) gets them in the system message
  the way its model was trained on them (a ``<tools>`` block, Hermes-style);
- calls are parsed in the template's syntax: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Hermes / Qwen / SmolLM2; a one-element JSON list is accepted too), or Llama-3's bare
  ``{"name": ..., "parameters": {...}}`` ended by the end-of-turn token. Broken JSON, an unknown
  tool or a missing argument is a malformed call (the trajectory ends with the malformed penalty
  of the reward), never an exception;
- the result goes in as the template renders a tool turn: the rest of the assistant turn after
  the call (``<|im_end|>\\n``), the tool turn's header, the result, its end and the next
  assistant header, all read off two renderings of a probe conversation (without and with a tool
  message), so any template that renders a tool message works. Branching stays at tool results.

Tokens in, tokens out: the ids the policy trains on are the ids sampled plus the ids inserted
here; nothing sampled is decoded and re-encoded. The frames around a result are encoded with the
template's control tokens; the result itself through :func:`~aepo_engine.tools.framing.encode_plain_text` (the one encoder of tool text),
so tool text can neither end the tool turn nor open a forged one.

:func:`retokenization_drift` renders a finished trajectory's conversation with the chat template,
encodes it and counts the positions where those ids differ from the trained ones: 0 when the
template is prefix-stable and the model wrote its calls as the template would.

Left out: several calls in one assistant turn (one call per segment, as with tags), templates
whose tool turns need ids the engine does not keep (``tool_call_id`` values are fixed strings),
and call syntaxes other than the two above (an unsupported template is refused with the reason).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Protocol, Sequence

from aepo_engine.chat_text import chat_text, require_chat_template
from aepo_engine.tools.base import MalformedToolCall, ToolCall
from aepo_engine.tools.framing import encode_plain_text, encode_tool_result
from aepo_engine.tools.parsing import find_tool_call

__all__ = ["ChatTemplateFormat", "TOOL_ARGUMENTS", "TagFormat", "ToolFormat", "build_tool_format", "encode_in_context",
           "hermes_call_text", "with_tools_in_system",
           "drift_metrics", "retokenization_drift", "tool_schemas", "trajectory_turns"]

ToolFormatName = Literal["tags", "chat_template"]

# Each tool takes one text argument: its name and the description the tool list shows.
TOOL_ARGUMENTS: dict[str, tuple[str, str]] = {
    "search": ("query", "Search the knowledge base; returns the best matching pages."),
    "python": ("code", "Run Python code in a sandbox; returns what it prints."),
}
_DEFAULT_ARGUMENT = ("input", "The tool's input text.")

# Probe texts: strings no template writes by itself.
_Q, _R, _C = "QPROBE7Q", "RPROBE7R", "CPROBE7C"
_ESCAPED = 'a"b\nc\\d'  # how the template writes a result's quotes, newlines and backslashes


def encode_in_context(tokenizer: Any, text: str) -> list[int]:
    """Ids of template text (control tokens recognised) as they are in the whole conversation,
    where more text follows: a generation prompt or a tool turn that ends in whitespace
    (Llama 3's ``<|end_header_id|>\n\n``) is cut into other tokens at the end of a string than
    before text (``"\n\n"`` alone, ``"\n" "\n"`` before a word, with GPT-2-style
    pre-tokenizers). Encoded with a following word, then cut back to ``text``; if no cut gives
    ``text`` exactly, plain ``encode``."""
    ids = list(tokenizer.encode(text + "Z", add_special_tokens=False))
    for end in range(len(ids) - 1, max(len(ids) - 4, 0) - 1, -1):
        if tokenizer.decode(ids[:end]) == text:
            return ids[:end]
    return list(tokenizer.encode(text, add_special_tokens=False))


def tool_schemas(tool_names: Sequence[str]) -> list[dict[str, Any]]:
    """The tools as a chat template's tool list (OpenAI function schemas, one string argument each)."""
    schemas = []
    for name in tool_names:
        arg, description = TOOL_ARGUMENTS.get(name, _DEFAULT_ARGUMENT)
        schemas.append({"type": "function", "function": {
            "name": name, "description": description,
            "parameters": {"type": "object", "properties": {arg: {"type": "string", "description": description}},
                           "required": [arg]}}})
    return schemas


def hermes_call_text(tool: str, payload: str) -> str:
    """A call of ``tool`` with its one argument ``payload`` as a Hermes template writes it."""
    arg = TOOL_ARGUMENTS.get(tool, _DEFAULT_ARGUMENT)[0]
    body = json.dumps({"name": tool, "arguments": {arg: payload}}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


class ToolFormat(Protocol):
    """What the rollout, the cold start and the metrics ask of a tool format."""

    name: str
    stop_strings: tuple[str, ...]
    calls_end_turn: bool  # a call is complete only when the model ends its turn (Llama-3 JSON)

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]: ...

    def parse_call(self, text: str) -> ToolCall | MalformedToolCall | None: ...

    def result_ids(self, text: str, ended_turn: bool = False) -> list[int]: ...

    def render_call(self, call: ToolCall) -> str: ...


# ---------------------------------------------------------------------------------------------
# The paper's tags


class TagFormat:
    """``<search> q</search>`` then `` <result>...</result>`` in the same assistant turn."""

    name = "tags"
    calls_end_turn = False
    content_with_calls = True

    def __init__(self, tokenizer: Any, tool_names: Sequence[str]):
        self.tokenizer = tokenizer
        self.tool_names = tuple(tool_names)
        self.stop_strings = tuple(f"</{name}>" for name in self.tool_names)

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        text = chat_text(self.tokenizer, messages)  # a base model's: the plain layout (aepo_engine.chat_text)
        return encode_in_context(self.tokenizer, text)

    def parse_call(self, text: str) -> ToolCall | MalformedToolCall | None:
        return find_tool_call(text, self.tool_names)

    def result_ids(self, text: str, ended_turn: bool = False) -> list[int]:
        return encode_tool_result(self.tokenizer, text, self.tool_names)

    def render_call(self, call: ToolCall) -> str:
        return f"<{call.tool}>{call.payload}</{call.tool}>"

    def conversation(self, messages: list[dict[str, str]], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat a trajectory is: one assistant message holding calls and results as text."""
        return [*messages, {"role": "assistant", "content": "".join(t["text"] for t in turns)}]


# ---------------------------------------------------------------------------------------------
# The chat template's own format


class ChatTemplateFormat:
    """Tool calls and tool turns as the tokenizer's chat template writes them (module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tool_names: the enabled tools.
    Raises:
        ValueError: a tokenizer without a chat template (a base model: the tag format serves it),
            a template whose call syntax is neither Hermes nor Llama-3 JSON, or whose rendering of
            a conversation changes when a tool turn is appended (not prefix-stable).
    """

    name = "chat_template"

    def __init__(self, tokenizer: Any, tool_names: Sequence[str]):
        require_chat_template(tokenizer, "tools.format = 'chat_template'")
        self.tokenizer = tokenizer
        self.tool_names = tuple(tool_names)
        self.schemas = tool_schemas(self.tool_names)
        self.renders_tools = self._render(_probe_chat(), tools=True) != self._render(_probe_chat())
        self.renders_calls = _Q in self._render([*_probe_chat(), _call_message("search", _Q)])
        call_text = self._render([*_probe_chat(), _call_message("search", _Q)]) if self.renders_calls else ""
        self.syntax: Literal["hermes", "llama_json"] = (
            "llama_json" if self.renders_calls and '"parameters"' in call_text and "<tool_call>" not in call_text
            else "hermes")
        if self.renders_calls and self.syntax == "hermes" and "<tool_call>" not in call_text:
            raise ValueError("the chat template writes tool calls in a syntax this engine does not parse "
                             "(neither <tool_call>{json}</tool_call> nor Llama-3 JSON); use tools.format = 'tags'")
        self.calls_end_turn = self.syntax == "llama_json"
        self.stop_strings = ("</tool_call>",) if self.syntax == "hermes" else ()
        # Whether text before a call survives in the template's rendering (Llama 3's drops it).
        self.content_with_calls = not self.renders_calls or _C in self._render(
            [*_probe_chat(), {**_call_message("search", _Q), "content": _C}])
        self._after_call, self._tool_open, self._tool_close = self._frames()
        self._json_results = self._results_as_json()
        self._eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""

    # -- rendering ----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, Any]], tools: bool = False, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas if tools else None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _frames(self) -> tuple[str, str, str]:
        """(the assistant turn's text after a call, the tool turn before the result, the text after
        the result up to the next assistant turn's first token), from two renderings."""
        if self.renders_calls:
            assistant = _call_message("search", _Q)
        else:  # the call is plain text in the assistant's content
            assistant = {"role": "assistant", "content": _C}
        base = self._render([*_probe_chat(), assistant], tools=True)
        full = self._render([*_probe_chat(), assistant, _tool_message("search", _R)], tools=True,
                            generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders the conversation differently once a tool turn follows "
                             "(not prefix-stable): inserted tool turns would not match the template; "
                             "use tools.format = 'tags'")
        marker = _C if not self.renders_calls else (
            "</tool_call>" if self.syntax == "hermes" else json.dumps({"query": _Q}, ensure_ascii=False) + "}")
        after_call = base[base.rindex(marker) + len(marker):]
        tool_turn = full[len(base):]
        if tool_turn.count(_R) != 1:
            raise ValueError("the chat template does not render a tool message's content once")
        tool_open, tool_close = tool_turn.split(_R)
        return after_call, tool_open, tool_close

    def _results_as_json(self) -> bool:
        """Whether the template writes a tool result as a JSON string (Llama 3 applies ``tojson`` to
        string contents: quotes, newlines and backslashes escaped) rather than verbatim."""
        assistant = _call_message("search", _Q) if self.renders_calls else {"role": "assistant", "content": _C}
        text = self._render([*_probe_chat(), assistant, _tool_message("search", _R + _ESCAPED + _R)], tools=True)
        written = text[text.index(_R) + len(_R):text.rindex(_R)]
        if written == _ESCAPED:
            return False
        if written == json.dumps(_ESCAPED)[1:-1]:
            return True
        raise ValueError(f"the chat template rewrites tool results ({_ESCAPED!r} -> {written!r}) in a way this "
                         "engine does not reproduce; use tools.format = 'tags'")

    def call_start(self, text: str) -> int:
        """Where the call that ends ``text`` starts (-1: no call)."""
        if self.syntax == "hermes":
            return text.rfind("<tool_call>")
        found = [i for i in (text.find('{"name"'), text.find('{ "name"')) if i >= 0]
        return min(found) if found else -1

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt with the tools offered: in the template's tool list, or (a template that
        renders none) in the system message."""
        if not self.renders_tools:
            messages = with_tools_in_system(messages, self.schemas)
        text = self._render(messages, tools=self.renders_tools, generation_prompt=True)
        return encode_in_context(self.tokenizer, text)

    def render_call(self, call: ToolCall) -> str:
        """The text of a call as the model writes it (demonstrations)."""
        if self.syntax == "llama_json":
            arg = TOOL_ARGUMENTS.get(call.tool, _DEFAULT_ARGUMENT)[0]
            return json.dumps({"name": call.tool, "parameters": {arg: call.payload}}, ensure_ascii=False)
        return hermes_call_text(call.tool, call.payload)

    # -- parsing ------------------------------------------------------------------------------

    def parse_call(self, text: str) -> ToolCall | MalformedToolCall | None:
        """The call a segment ends with (None: no call; malformed: a broken one)."""
        found = self.find_call(text)
        if found is None or isinstance(found, MalformedToolCall):
            return found
        decoded = self.decode_call(found[1], found[2])
        if isinstance(decoded, MalformedToolCall):
            return decoded
        name, arguments = decoded
        arg = TOOL_ARGUMENTS.get(name, _DEFAULT_ARGUMENT)[0]
        if not isinstance(arguments.get(arg), str) or not arguments[arg].strip():
            return MalformedToolCall(f"the {name} call needs a non-empty string argument {arg!r}", name)
        return ToolCall(name, arguments[arg].strip())

    def find_call(self, text: str) -> tuple[int, str, str] | MalformedToolCall | None:
        """``(where the call starts, its JSON body, the arguments' key)`` of the call a segment
        ends with in the template's syntax; None: no call (or one quoted earlier in free text);
        malformed: an unclosed one."""
        if self.syntax == "llama_json":
            body = text.rstrip()
            if self._eos_text and body.endswith(self._eos_text):
                body = body[: -len(self._eos_text)].rstrip()
            start = self.call_start(body)
            if start < 0 or not body.endswith("}"):
                return None  # an answer, not a call
            return start, body[start:], "parameters"
        end = text.rfind("</tool_call>")
        start = text.rfind("<tool_call>")
        if start < 0:
            return None
        if end < start:
            return MalformedToolCall("unclosed <tool_call>: the segment ended inside the call")
        if text[end + len("</tool_call>"):].strip():
            return None  # a call quoted earlier in free text, not one that ends the segment
        return start, text[start + len("<tool_call>"):end].strip(), "arguments"

    def decode_call(self, body: str, arguments_key: str) -> tuple[str, dict[str, Any]] | MalformedToolCall:
        """``(tool name, arguments)`` of a call's JSON body: an object with a known tool's name and
        an arguments object (a JSON string of one accepted; a one-element list, as SmolLM2 writes)."""
        try:
            value = json.loads(body)
        except ValueError as exc:
            return MalformedToolCall(f"the tool call is not valid JSON ({exc})")
        if isinstance(value, list) and len(value) == 1:  # SmolLM2 writes a list of one call
            value = value[0]
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return MalformedToolCall('the tool call must be a JSON object {"name": ..., "%s": {...}}' % arguments_key)
        name = value["name"]
        if name not in self.tool_names:
            return MalformedToolCall(f"unknown tool {name!r}; available tools: {list(self.tool_names)}", name)
        arguments = value.get(arguments_key, value.get("arguments", value.get("parameters")))
        if isinstance(arguments, str):  # OpenAI-style arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return MalformedToolCall(f"the {name} call's arguments are not valid JSON ({exc})", name)
        if not isinstance(arguments, dict):
            return MalformedToolCall(f"the {name} call's arguments must be a JSON object", name)
        return name, arguments

    # -- results ------------------------------------------------------------------------------

    def result_ids(self, text: str, ended_turn: bool = False) -> list[int]:
        """The ids inserted after a call: the rest of the assistant turn, the tool turn holding
        ``text`` (as plain text), and the next assistant turn's header.

        Args:
            text: the tool's result.
            ended_turn: the call's segment ended with the end-of-turn token (sampled by the
                model, so not inserted again).
        """
        after = self._after_call
        if ended_turn:
            if not after.startswith(self._eos_text):
                raise ValueError(f"the template ends a call's turn with {after!r}, not the end-of-turn token")
            after = after[len(self._eos_text):]
        body = json.dumps(text, ensure_ascii=False)[1:-1] if self._json_results else text
        # The tokenizer cuts a rendering at its control tokens and encodes each stretch between
        # two of them as a whole; so the frame's plain text next to the result (a quote, a
        # "<tool_response>\n") goes into the result's stretch, or "." + '"' would be two tokens
        # here and one ('."') in the rendering.
        opening, open_tail = _split_at_control(self.tokenizer, after + self._tool_open, last=True)
        close_head, closing = _split_at_control(self.tokenizer, self._tool_close, last=False)
        return [*self.tokenizer.encode(opening, add_special_tokens=False),
                *encode_plain_text(self.tokenizer, body, before=open_tail, after=close_head),
                *encode_in_context(self.tokenizer, closing)]

    def conversation(self, messages: list[dict[str, str]], turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat a trajectory is, with calls as the template's tool calls and results as tool
        messages (``turns``: ``{"text", "call", "result"}`` per model segment)."""
        if not self.renders_tools:
            messages = with_tools_in_system(messages, self.schemas)
        chat = list(messages)
        for turn in turns:
            text, call = turn["text"], turn.get("call")
            if call is not None and self.renders_calls:
                start = self.call_start(text)
                arg = TOOL_ARGUMENTS.get(call.tool, _DEFAULT_ARGUMENT)[0]
                chat.append({"role": "assistant", "content": text[:start].rstrip("\n"),
                             "tool_calls": [{"type": "function", "id": "call0",
                                             "function": {"name": call.tool, "arguments": {arg: call.payload}}}]})
            else:
                chat.append({"role": "assistant", "content": text})
            if "result" in turn:
                chat.append(_tool_message(call.tool if call else "tool", turn["result"]))
        return chat


def _split_at_control(tokenizer: Any, text: str, last: bool) -> tuple[str, str]:
    """``text`` cut just after its last control token (``last``) or just before its first one;
    all of it on the plain side when it holds none."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    controls = {t.content for t in added.values() if getattr(t, "special", False)}
    controls |= set(getattr(tokenizer, "all_special_tokens", ()))
    if last:
        cut = max((text.rfind(c) + len(c) for c in controls if c in text), default=0)
    else:
        cut = min((text.find(c) for c in controls if c in text), default=len(text))
    return text[:cut], text[cut:]


def _probe_chat() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]


def _call_message(tool: str, query: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call0", "function": {"name": tool, "arguments": {"query": query}}}]}


def _tool_message(tool: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": tool, "tool_call_id": "call0", "content": content}


def with_tools_in_system(messages: list[dict[str, str]], schemas: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The tools as a Hermes-style block in the system message (SmolLM2's training format)."""
    block = ("You can call tools. Their signatures, in <tools></tools> tags:\n<tools>\n"
             + "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
             + '\n</tools>\nCall one as <tool_call>\n{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>')
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + block}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def build_tool_format(name: ToolFormatName, tokenizer: Any, tool_names: Sequence[str]) -> TagFormat | ChatTemplateFormat:
    """The tool format ``tools.format`` names."""
    if name == "tags":
        return TagFormat(tokenizer, tool_names)
    if name == "chat_template":
        return ChatTemplateFormat(tokenizer, tool_names)
    raise ValueError(f"tools.format must be 'tags' or 'chat_template', got {name!r}")


# ---------------------------------------------------------------------------------------------
# Retokenization drift


def trajectory_turns(trajectory: Any, tool_format: Any) -> list[dict[str, Any]]:
    """A trajectory's model segments as ``{"text", "call", "result"}`` turns (tags: every segment's
    text, tool results included, in order)."""
    decode = tool_format.tokenizer.decode
    ids = trajectory.response_ids
    eos = tool_format.tokenizer.eos_token_id
    if isinstance(tool_format, TagFormat):  # one assistant turn; its end-of-turn is the template's
        return [{"text": decode(ids[:-1] if ids and ids[-1] == eos else ids)}]
    turns, results = [], iter(trajectory.tool_log)
    segments = trajectory.segments
    for i, segment in enumerate(segments):
        if segment.kind != "model":
            continue
        seg_ids = ids[segment.start:segment.end]
        ended = bool(seg_ids) and seg_ids[-1] == eos
        text = decode(seg_ids[:-1] if ended else seg_ids)
        turn: dict[str, Any] = {"text": text}
        if i + 1 < len(segments) and segments[i + 1].kind == "tool":
            record = next(results)
            turn["call"] = ToolCall(record.tool, record.payload)
            turn["result"] = record.result
        turns.append(turn)
    return turns


def retokenization_drift(trajectory: Any, messages: list[dict[str, str]], tool_format: Any) -> int:
    """Positions where the trained ids (prompt + response) differ from the chat template's
    rendering of the same conversation, encoded (0 = token-exact).

    The rendering's ids are compared over the trajectory's length (a rendering ends its last turn
    with the end-of-turn text, which a trajectory cut by a length cap does not have); a
    length difference within that span counts as differing positions.
    """
    tokenizer = tool_format.tokenizer
    chat = tool_format.conversation(messages, trajectory_turns(trajectory, tool_format))
    tools = getattr(tool_format, "renders_tools", False)
    text = chat_text(tokenizer, chat, add_generation_prompt=False, tools=tool_format.schemas if tools else None)
    rendered = list(tokenizer.encode(text, add_special_tokens=False))
    trained = list(trajectory.prompt_ids) + list(trajectory.response_ids)
    span = rendered[:len(trained)]
    return sum(a != b for a, b in zip(trained, span)) + abs(len(trained) - len(span))


def drift_metrics(trajectories: Sequence[Any], prompt_messages: Sequence[list[dict[str, str]]],
                  tool_format: Any) -> dict[str, float]:
    """Per-step retokenization drift: the mean over trajectories of :func:`retokenization_drift`
    (``rollout/retokenization_drift``) and the share of trajectories with any
    (``rollout/drifted_share``). ``prompt_messages[i]`` is the chat of prompt index i."""
    if not trajectories:
        return {}
    drifts = [retokenization_drift(t, prompt_messages[t.prompt_index], tool_format) for t in trajectories]
    return {"rollout/retokenization_drift": sum(drifts) / len(drifts),
            "rollout/drifted_share": sum(d > 0 for d in drifts) / len(drifts)}
