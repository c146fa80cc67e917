"""One agent episode's conversation as token ids: what the gateway records for training.

An agent written against the OpenAI API re-sends the whole conversation as text with every
request. Retokenizing that text would not give back the ids the policy sampled (a BPE
tokenizer splits a decoded completion differently, a template rewrites a tool call), so the
trajectory trained on would not be the one sampled. A :class:`Session` therefore keeps the ids
itself and only ever *appends* (prefix-preserving, token-in/token-out):

- the first request's messages are rendered with the chat template (the tools offered as the
  template offers them, or in the system message for a template that renders none, exactly as
  ``tools.format = "chat_template"`` does in the engine's own loop) and encoded: the prompt;
- every completion's sampled ids are appended as a model segment (loss mask 1, with their
  log-probs, entropies and the policy version that sampled them);
- a later request must repeat the conversation so far (the messages sent before, then the
  assistant messages the gateway returned, compared as messages, not as text) and add to it:
  a tool message answering the last tool call becomes the template's tool turn
  (``ChatTemplateFormat.result_ids``: the same ids the engine's own tool loop inserts), any
  other new messages (a user turn) the template's rendering of them after the assistant's turn.
  Those ids are appended as an inserted segment (loss mask 0).

When a request does not repeat the recorded conversation (an agent that edits its history,
drops a message or rewrites a reply) the ids cannot be kept: the request is served from a fresh
rendering of its messages and the session is marked *drifted* (``drift_tokens`` counts the
positions where that rendering differs from the recording); a drifted episode is left out of
training and counted (``agent/drifted_episodes``).

One tool call per assistant turn, as in the engine's own loop: generation stops at the end of a
call (``</tool_call>``), and the call is returned as the message's ``tool_calls``.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aepo_engine.chat_text import chat_text
from aepo_engine.rollout.protocol import GenOutput
from aepo_engine.rollout.trajectory import ToolCallRecord, Trajectory
from aepo_engine.tools.base import MalformedToolCall
from aepo_engine.tools.formats import ChatTemplateFormat, TagFormat, encode_in_context, with_tools_in_system

__all__ = ["GatewayError", "Session", "TagToolSet", "ToolSet", "normalise_messages", "parse_tools", "tool_set"]

_PROBE = "CPROBE7C"


class GatewayError(Exception):
    """A request the gateway refuses, as an OpenAI-style error body.

    Args:
        status: the HTTP status (400 bad request, 401 bad key, 404 unknown session or model, 409
            a request while the session's previous one is running).
        message: the reason, for the agent's developer.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        code: OpenAI's error code (``context_length_exceeded``, ``model_not_found``, ...).
        param: the request field at fault.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` checked: a list of ``{"type": "function", "function": {"name": str,
    "parameters": {...}}}`` (description optional). Raises :class:`GatewayError` (400) naming the fault."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise GatewayError(400, "tools must be a list of function tools", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise GatewayError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                               param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
            raise GatewayError(400, f"tools[{i}].function.name must be a name of letters, digits, _ and -",
                               param=f"tools[{i}].function.name")
        if name in names:
            raise GatewayError(400, f"tools[{i}]: the tool {name!r} is listed twice", param=f"tools[{i}]")
        names.add(name)
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise GatewayError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                               param=f"tools[{i}].function.parameters")
    return tools


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise GatewayError(400, f"{where}: only text content parts are served", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise GatewayError(400, f"{where}: content must be a string or a list of text parts", param=where)


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages as plain dicts the template renders and the session compares:
    ``role`` and text ``content``; an assistant's ``tool_calls`` as ``[{"id", "name", "arguments"
    (a dict)}]``; a tool message's ``tool_call_id``. Raises :class:`GatewayError` (400)."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise GatewayError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise GatewayError(400, f"{where}.role must be system, developer, user, assistant or tool, got {role!r}",
                               param=f"{where}.role")
        item: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise GatewayError(400, f"{where}.tool_calls[{j}] must hold a function with a name",
                                       param=f"{where}.tool_calls[{j}]")
                arguments = function.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except ValueError as exc:
                        raise GatewayError(400, f"{where}.tool_calls[{j}].function.arguments is not JSON ({exc})",
                                           param=f"{where}.tool_calls[{j}]") from None
                calls.append({"id": str(call.get("id", "")), "name": function["name"], "arguments": arguments})
            item["tool_calls"] = calls
        if role == "tool":
            item["tool_call_id"] = str(message.get("tool_call_id", ""))
        out.append(item)
    return out


def _payload(arguments: dict[str, Any]) -> str:
    """A call's arguments as a tool-log payload: the value of a lone string argument (as the
    engine's own tools log it), else the arguments' JSON."""
    if len(arguments) == 1 and isinstance(next(iter(arguments.values())), str):
        return next(iter(arguments.values()))
    return json.dumps(arguments, ensure_ascii=False)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A normalised message as chat templates take it (tool calls in the HF form)."""
    if message["role"] == "assistant" and message.get("tool_calls"):
        return {"role": "assistant", "content": message["content"], "tool_calls": [
            {"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in message["tool_calls"]]}
    if message["role"] == "tool":
        return {"role": "tool", "tool_call_id": message["tool_call_id"], "content": message["content"]}
    return {"role": message["role"], "content": message["content"]}


class ToolSet:
    """The chat template's tool syntax for one list of tools (the request's): the prompt's
    rendering, the parsing of a completion's call and the ids of a tool turn.

    Args:
        tokenizer: the policy's tokenizer (a chat template needed).
        tools: the request's ``tools`` (:func:`parse_tools`).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        self.tokenizer = tokenizer
        self.tools = tools
        self.names = tuple(t["function"]["name"] for t in tools)
        try:
            self.format = ChatTemplateFormat(tokenizer, self.names or ("search",))
        except ValueError as exc:
            raise GatewayError(400, f"this model's chat template cannot serve tool calls: {exc}") from None
        self.format.schemas = tools  # the agent's own schemas, as the prompt shows them
        self.stop_strings = self.format.stop_strings if tools else ()

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The messages as the template writes them, the tools offered as ``encode_prompt`` does."""
        chat = [_template_message(m) for m in messages]
        renders_tools = self.format.renders_tools
        if self.tools and not renders_tools:
            chat = with_tools_in_system(chat, self.tools)
        return self.tokenizer.apply_chat_template(chat, tools=self.tools if self.tools and renders_tools else None,
                                                  tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """A prompt's ids (the generation prompt opened)."""
        return encode_in_context(self.tokenizer, self.render(messages, generation_prompt=True))

    def parse(self, text: str) -> tuple[str, dict[str, Any] | None, str | None]:
        """``(content, call, problem)`` of a completion's text: a call ending it as ``{"name",
        "arguments"}`` with the text before it as content; a broken call (not JSON, an unknown
        tool, arguments that are no object) gives ``problem`` and the whole text as content."""
        if not self.tools:
            return text, None, None
        found = self.format.find_call(text)  # the engine's own parsing, for any tool's arguments
        if found is None:
            return text, None, None
        if isinstance(found, MalformedToolCall):
            return text, None, found.reason
        decoded = self.format.decode_call(found[1], found[2])
        if isinstance(decoded, MalformedToolCall):
            return text, None, decoded.reason
        return text[:found[0]].strip(), {"name": decoded[0], "arguments": decoded[1]}, None

    def tool_turn(self, result: str, ended_turn: bool) -> list[int]:
        """The ids after a call: the rest of the assistant turn, the tool turn holding ``result``,
        the next assistant header (as the engine's own tool loop inserts them)."""
        return self.format.result_ids(result, ended_turn=ended_turn)

    def turns_after_reply(self, new: list[dict[str, Any]], ended_turn: bool) -> list[int]:
        """The ids after an assistant reply for the new messages ``new`` (a user turn, say) and
        the next assistant header, from the template's rendering of a probe reply followed by them."""
        probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                 {"role": "assistant", "content": _PROBE}]
        base = self.render(probe, generation_prompt=False)
        full = self.render(probe + new, generation_prompt=True)
        if not full.startswith(base):
            raise GatewayError(400, "this model's chat template renders a conversation differently once more "
                                    "messages follow (not prefix-stable): the conversation cannot be extended")
        text = base[base.rindex(_PROBE) + len(_PROBE):] + full[len(base):]
        eos = self.tokenizer.decode([self.tokenizer.eos_token_id]) if self.tokenizer.eos_token_id is not None else ""
        if ended_turn and eos and text.startswith(eos):
            text = text[len(eos):]
        return encode_in_context(self.tokenizer, text)


class TagToolSet(ToolSet):
    """The paper's tag format (``tools.format = "tags"``) for one list of tools: the prompt as the
    engine's own tag loop renders it (the tools named by the task's system prompt, not by the
    request's list), calls written ``<name> payload</name>`` and returned to the agent as
    ``tool_calls`` with the tool's one argument (its first required parameter) set to the payload,
    results inserted as `` <result>...</result>`` in the same assistant turn (``TagFormat``).

    Args:
        tokenizer: the policy's tokenizer.
        tools: the request's ``tools``: each takes one string argument here.
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]):
        self.tokenizer = tokenizer
        self.tools = tools
        self.names = tuple(t["function"]["name"] for t in tools)
        self.arguments = {}
        for tool in tools:
            parameters = tool["function"].get("parameters") or {}
            names = list(parameters.get("required") or ()) or list((parameters.get("properties") or {}))
            self.arguments[tool["function"]["name"]] = names[0] if names else "input"
        self.format = TagFormat(tokenizer, self.names)
        self.stop_strings = self.format.stop_strings

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return chat_text(self.tokenizer, [_template_message(m) for m in messages],
                         add_generation_prompt=generation_prompt)

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.format.encode_prompt([_template_message(m) for m in messages])

    def parse(self, text: str) -> tuple[str, dict[str, Any] | None, str | None]:
        call = self.format.parse_call(text) if self.tools else None
        if call is None:
            return text, None, None
        if isinstance(call, MalformedToolCall):
            return text, None, call.reason
        start = text.rfind(f"<{call.tool}>")
        return text[:start].strip(), {"name": call.tool, "arguments": {self.arguments[call.tool]: call.payload}}, None


def tool_set(format_name: str, tokenizer: Any, tools: list[dict[str, Any]]) -> ToolSet:
    """The request's tools in the run's tool format (``tools.format``: the syntax the policy writes)."""
    if format_name == "tags":
        return TagToolSet(tokenizer, tools)
    if format_name == "chat_template":
        return ToolSet(tokenizer, tools)
    raise ValueError(f"the gateway serves tools.format 'tags' or 'chat_template', got {format_name!r}")


@dataclass
class Session:
    """One episode's recording (module docstring).

    Args:
        session_id: the id in the session's base URL.
        prompt_index, traj_id, step: where the trajectory goes in the step's batch.
        task: what the agent was given (kept for the report).
    """

    session_id: str
    prompt_index: int = 0
    traj_id: int = 0
    step: int = 0
    task: Any = None
    trajectory: Trajectory | None = None
    tools: ToolSet | None = None
    covered: list[dict[str, Any]] = field(default_factory=list)
    pending_call: dict[str, Any] | None = None
    replied_at: float = 0.0
    ended_turn: bool = False
    drifted: bool = False
    drift_tokens: int = 0
    requests: int = 0
    reward: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    replay: list[dict[str, Any]] | None = None
    fork_messages: list[dict[str, Any]] | None = None
    forked: Trajectory | None = None
    diverged: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def branch_of(cls, parent: "Session", seg_index: int, session_id: str, traj_id: int) -> "Session":
        """A branch of ``parent`` at its model segment ``seg_index`` (the reaction to a tool
        result): the restarted agent's requests before that reaction are answered from the
        parent's recording (replayed, no sampling) if they repeat the parent's requests; the
        request of the reaction itself must repeat the parent's too, and is sampled anew on a
        copy of the parent's trajectory up to the tool result (``Trajectory.fork``)."""
        n_completion = sum(s.kind == "model" for s in parent.trajectory.segments[:seg_index])
        return cls(session_id, prompt_index=parent.prompt_index, traj_id=traj_id, step=parent.step, task=parent.task,
                   tools=parent.tools, replay=[dict(h) for h in parent.history[:n_completion]],
                   fork_messages=parent.history[n_completion]["messages"],
                   forked=parent.trajectory.fork(seg_index, traj_id))

    def replayed(self, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], str] | None:
        """The recorded answer to a branch's replayed request (None: not replaying, or the
        request diverged from the recording: the session is then served as drifted)."""
        if self.replay is None or self.diverged:
            return None
        if self.replay and messages == self.replay[0]["messages"]:
            item = self.replay.pop(0)
            self.requests += 1
            self.history.append(item)  # a branch of this branch replays it too
            self.covered = [*messages, item["covered"]]
            return item["message"], item["finish"]
        if not self.replay and messages == self.fork_messages:
            return None  # the reaction: sampled on the forked trajectory (prepare)
        self.diverged = True
        return None

    @property
    def context(self) -> list[int]:
        """The ids the next completion continues."""
        if self.trajectory is None:
            return []
        return [*self.trajectory.prompt_ids, *self.trajectory.response_ids]

    def prepare(self, messages: list[dict[str, Any]], tools: ToolSet) -> list[int]:
        """The context ids for a request's (normalised) ``messages``: the recorded ids extended
        by the new messages, or a fresh rendering for a drifted session. Raises :class:`GatewayError`."""
        self.requests += 1
        if self.diverged:
            return self._drift(messages, tools)
        if self.trajectory is None and self.forked is not None:  # a branch's reaction (replayed)
            self.trajectory, self.covered, self.replay = self.forked, list(messages), None
            return self.context
        if self.trajectory is None:
            self.tools = tools
            self.trajectory = Trajectory(prompt_ids=tools.encode(messages), prompt_index=self.prompt_index,
                                         traj_id=self.traj_id, step=self.step, kind="global")
            self.covered = list(messages)
            return self.context
        if tools.tools != self.tools.tools:
            raise GatewayError(400, "a session's requests must offer the same tools as its first one", param="tools")
        known = len(self.covered)
        if self.drifted or messages[:known] != self.covered:
            return self._drift(messages, tools)
        new = messages[known:]
        if not new:
            raise GatewayError(400, "the request adds no message after the assistant's last reply", param="messages")
        if self.pending_call is not None:
            answer = new[0]
            if answer["role"] != "tool" or len(new) > 1:
                raise GatewayError(400, "the assistant's last reply is a tool call: the next request must add exactly "
                                        "one tool message with its result", param="messages")
            ids = tools.tool_turn(answer["content"], ended_turn=self.ended_turn)
            call = self.pending_call
            self.trajectory.append_tool_result(ids)
            self.trajectory.tool_calls += 1
            self.trajectory.tool_log.append(ToolCallRecord(call["name"], _payload(call["arguments"]),
                                                           answer["content"], True,
                                                           time.monotonic() - self.replied_at))
            self.pending_call = None
        else:
            self.trajectory.append_tool_result(tools.turns_after_reply(new, ended_turn=self.ended_turn))
        self.covered = list(messages)
        return self.context

    def _drift(self, messages: list[dict[str, Any]], tools: ToolSet) -> list[int]:
        """Serve a request that does not repeat the recording from a fresh rendering (module docstring)."""
        fresh = tools.encode(messages)
        if not self.drifted:
            recorded = self.context
            span = fresh[:len(recorded)]
            self.drift_tokens = sum(a != b for a, b in zip(recorded, span)) + abs(len(recorded) - len(span))
            self.drifted = True
        self.covered = list(messages)
        return fresh

    def record(self, output: GenOutput, version: int, n_entropy_tokens: int,
               eos_ids: tuple[int, ...]) -> tuple[dict[str, Any], str]:
        """Append a completion; return ``(the assistant message, OpenAI's finish reason)``."""
        ids = list(output.token_ids)
        ended = bool(ids) and ids[-1] in eos_ids
        text = self.tools.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        content, call, problem = self.tools.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if call is not None:
            call_id = f"call_{len(self.history)}_{self.session_id[:8]}"
            message["tool_calls"] = [{"id": call_id, "type": "function",
                                      "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]
            finish = "tool_calls"
        else:
            finish = "length" if output.finish_reason == "length" else "stop"
        if not self.drifted:
            self.trajectory.append_model_segment(ids, output.logprobs, output.entropies, n_entropy_tokens, version)
            self.ended_turn = ended
            self.pending_call = {**call, "id": message["tool_calls"][0]["id"]} if call is not None else None
            if problem is not None:
                self.trajectory.malformed_calls += 1
            self.trajectory.finish_reason = ("malformed" if problem is not None else
                                             None if call is not None else
                                             "length" if output.finish_reason == "length" else "eos")
        normalised = {"role": "assistant", "content": content or ""}
        if call is not None:
            normalised["tool_calls"] = [{"id": message["tool_calls"][0]["id"], "name": call["name"],
                                         "arguments": call["arguments"]}]
        self.history.append({"messages": list(self.covered), "message": message, "finish": finish,
                             "covered": normalised})
        self.covered.append(normalised)
        self.replied_at = time.monotonic()
        return message, finish
