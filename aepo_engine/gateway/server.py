"""The gateway: an OpenAI-compatible HTTP server in front of the run's generation backend.

Served on ``127.0.0.1`` (never another interface), one asyncio event loop under uvicorn in a
thread of the trainer:

- ``POST /s/{session}/v1/chat/completions``: a chat completion for one episode's session
  (``messages``, ``tools``, ``max_tokens`` / ``max_completion_tokens``, ``stream``); the
  conversation is recorded token-exact (:mod:`aepo_engine.gateway.conversation`);
- ``GET /v1/models`` and ``GET /s/{session}/v1/models``: the one model served;
- ``POST /s/{session}/reward``: ``{"reward": float}``, an episode's reward posted by the agent's
  environment instead of returned by its function.

Every request needs ``Authorization: Bearer <token>``, the run's own random token (the agent's
client gets it as its API key). Errors are OpenAI-style bodies ``{"error": {"message", "type",
"param", "code"}}``: 401 a missing or wrong key, 404 an unknown session or model name, 400 a
malformed request (messages, tools, a context longer than ``max_context_tokens``:
``context_length_exceeded``), 409 a request while the same session's previous one runs.

Sampling is the run's, not the request's: the policy is trained on what it sampled at the
rollout temperature, so ``temperature``, ``top_p``, ``seed`` and the like in a request are
ignored; ``n`` > 1 is refused (an episode is one conversation; AEPO's branching is the engine's).

Batching: completions from all sessions go through one generation thread, which takes whatever
requests are waiting (up to ``max_batch``; after waiting ``batch_window_s`` for more to arrive,
0 by default: requests that arrive while a call runs wait for it anyway and go in the next one)
and samples them in one ``backend.generate`` call: continuous batching at the granularity of a
call. Each request's seed is derived from the gateway's seed, its session's step, prompt and
trajectory numbers and its turn, so a run's samples are the same from run to run and a session's
completions do not depend on which others share its batch (up to the backend's batch-dependent
rounding).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import re
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aepo_engine.gateway.conversation import GatewayError, Session, ToolSet, normalise_messages, parse_tools, tool_set
from aepo_engine.rollout.protocol import GenOutput, GenRequest
from aepo_engine.tools.retrieval_server import listen, read_body

__all__ = ["Gateway", "GatewayStats"]

MAX_REQUEST_BYTES = 8 << 20
_SESSION_PATH = re.compile(r"^/s/([A-Za-z0-9_-]+)(/v1/chat/completions|/v1/models|/reward)$")


@dataclass
class GatewayStats:
    """Counters of a gateway's requests (read with :meth:`Gateway.stats`)."""

    requests: int = 0
    completions: int = 0
    errors: int = 0
    batches: int = 0
    batched_requests: int = 0
    overhead_s: float = 0.0  # time in the gateway outside backend.generate, summed over completions
    replayed: int = 0  # requests of branches answered from their parent's recording


class _Batcher:
    """The generation thread: requests from every session, sampled in batches."""

    def __init__(self, backend: Any, max_batch: int, batch_window_s: float, stats: GatewayStats):
        self.backend, self.max_batch, self.window, self.stats = backend, max_batch, batch_window_s, stats
        self._queue: queue.Queue[tuple[GenRequest, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="aepo-gateway-generate", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest) -> Future:
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            deadline = time.monotonic() + self.window
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            try:
                outputs = self.backend.generate([request for request, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
                for _, future in batch:
                    future.set_exception(exc)
                continue
            self.stats.batches += 1
            self.stats.batched_requests += len(batch)
            for (_, future), output in zip(batch, outputs):
                future.set_result(output)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)


class Gateway:
    """The OpenAI-compatible server of one run (module docstring).

    Args:
        backend: the run's generation backend (``GenerationBackend``).
        tokenizer: the policy's tokenizer (with a chat template).
        model_name: the name ``/v1/models`` lists and requests must give.
        max_tokens: the cap on a completion's tokens (a request may ask for fewer).
        max_context_tokens: a request whose context (prompt + recorded turns) is longer is refused.
        temperature, top_p: the run's sampling.
        n_entropy_tokens: the segment head whose mean entropy a trajectory records (n_e).
        seed: the root of the requests' seeds.
        max_batch: at most this many requests share a ``generate`` call.
        batch_window_s: how long the generation thread waits for more requests before a call.
        port: 0 picks a free port.
        tool_format: the syntax of the policy's tool calls (``tools.format``): "chat_template" (the
            template's own calls; the request's tools offered as the template offers them) or
            "tags" (the paper's ``<search> ...</search>``, the prompt as the engine's tag loop renders it).
    """

    def __init__(self, backend: Any, tokenizer: Any, *, model_name: str = "policy", max_tokens: int = 256,
                 max_context_tokens: int = 4096, temperature: float = 1.0, top_p: float = 1.0,
                 n_entropy_tokens: int = 20, seed: int = 0, max_batch: int = 64, batch_window_s: float = 0.0,
                 port: int = 0, tool_format: str = "chat_template"):
        self.backend, self.tokenizer, self.model_name, self.tool_format = backend, tokenizer, model_name, tool_format
        self.max_tokens, self.max_context_tokens = max_tokens, max_context_tokens
        self.temperature, self.top_p, self.n_entropy_tokens, self.seed = temperature, top_p, n_entropy_tokens, seed
        self.token = secrets.token_urlsafe(24)
        self.version = 0  # the policy version the backend's weights are at (set by the trainer)
        # called with each session after a completion is recorded (in the server's thread, the
        # session locked): the branch decisions of aepo_engine.gateway.branching
        self.on_record: Any = None
        self.stats = GatewayStats()
        self._sessions: dict[str, Session] = {}
        self._toolsets: dict[str, ToolSet] = {}
        self._lock = threading.Lock()
        self.batch_window_s = batch_window_s
        self._batcher = _Batcher(backend, max_batch, batch_window_s, self.stats)
        self._sock = listen("127.0.0.1", port)
        # no Nagle delay: a response's headers and body go out as two writes, and on a kept-alive
        # connection the second waited for the client's delayed ACK (~40 ms a request); accepted
        # sockets inherit the option on Linux
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = self._sock.getsockname()[1]
        self._server: Any = None
        self._thread = threading.Thread(target=self._serve, name="aepo-gateway", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        if not self._started.wait(30) or not self._thread.is_alive():
            raise RuntimeError("the gateway's server did not start within 30 s")

    # -- sessions -------------------------------------------------------------------------------

    def open_session(self, *, prompt_index: int = 0, traj_id: int = 0, step: int = 0, task: Any = None) -> Session:
        """A new episode's session; its base URL is :meth:`base_url`."""
        session = Session(uuid.uuid4().hex, prompt_index=prompt_index, traj_id=traj_id, step=step, task=task)
        with self._lock:
            self._sessions[session.session_id] = session
        return session

    def base_url(self, session: Session) -> str:
        """The OpenAI base URL of ``session`` (the client's ``base_url``; its API key is :attr:`token`)."""
        return f"http://127.0.0.1:{self.port}/s/{session.session_id}/v1"

    def add_session(self, session: Session) -> Session:
        """Serve a session made elsewhere (a branch: ``Session.branch_of``)."""
        with self._lock:
            self._sessions[session.session_id] = session
        return session

    def close_session(self, session: Session) -> Session:
        """Forget ``session`` (later requests to it get 404); returns it with its recording."""
        with self._lock:
            self._sessions.pop(session.session_id, None)
        with session.lock:  # a request still running finishes its recording first
            if session.trajectory is not None and session.trajectory.finish_reason is None:
                session.trajectory.finish_reason = "stop"
        return session

    # -- the server -------------------------------------------------------------------------------

    def _serve(self) -> None:
        import uvicorn

        config = uvicorn.Config(self._app, interface="asgi3", lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=30, backlog=4096)
        self._server = uvicorn.Server(config)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.call_soon(self._started.set)
        try:
            loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        finally:
            loop.close()

    def close(self) -> None:
        """Stop serving (in-flight requests are answered first) and stop the generation thread."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=30)
        self._batcher.close()
        self._sock.close()

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.stats.requests += 1
        try:
            status, payload, stream = await self._route(scope, receive)
        except GatewayError as err:
            self.stats.errors += 1
            status, payload, stream = err.status, err.body(), None
        except Exception as exc:  # noqa: BLE001 - a bug or a backend failure: the agent gets a 500
            self.stats.errors += 1
            status, payload, stream = 500, GatewayError(500, f"{type(exc).__name__}: {exc}", "server_error").body(), None
        if stream is not None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            for chunk in stream:
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _route(self, scope: dict, receive: Any) -> tuple[int, Any, list | None]:
        headers = dict(scope.get("headers") or ())
        key = headers.get(b"authorization", b"").decode("latin-1")
        if not secrets.compare_digest(key.encode(), f"Bearer {self.token}".encode()):
            raise GatewayError(401, "a missing or wrong API key: use the key the engine gave the agent",
                               "authentication_error", "invalid_api_key")
        method, path = scope["method"], scope["path"]
        if path == "/v1/models" and method == "GET":
            return 200, self._models(), None
        match = _SESSION_PATH.match(path)
        if match is None:
            raise GatewayError(404, f"no such path {path}: a session's base URL is /s/<session>/v1", code="not_found")
        session = self._sessions.get(match.group(1))
        if session is None:
            raise GatewayError(404, f"no session {match.group(1)!r} (unknown, or its episode has ended)",
                               code="session_not_found")
        route = match.group(2)
        if route == "/v1/models" and method == "GET":
            return 200, self._models(), None
        if method != "POST":
            raise GatewayError(405, f"{method} not allowed on {path}", code="method_not_allowed")
        body = await read_body(scope, receive, MAX_REQUEST_BYTES)
        if body is None:
            raise GatewayError(400, f"the body must be 1..{MAX_REQUEST_BYTES} bytes of JSON")
        try:
            request = json.loads(body)
        except ValueError as exc:
            raise GatewayError(400, f"the body is not JSON ({exc})") from None
        if not isinstance(request, dict):
            raise GatewayError(400, "the body must be a JSON object")
        if route == "/reward":
            reward = request.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise GatewayError(400, "reward must be a number", param="reward")
            session.reward = float(reward)
            return 200, {"ok": True}, None
        return await self._completion(session, request)

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "aepo_engine"}]}

    async def _completion(self, session: Session, request: dict[str, Any]) -> tuple[int, Any, list | None]:
        t0 = time.perf_counter()
        if request.get("model") != self.model_name:
            raise GatewayError(404, f"the model {request.get('model')!r} is not served here; the gateway serves "
                                    f"{self.model_name!r}", code="model_not_found", param="model")
        if request.get("n", 1) != 1:
            raise GatewayError(400, "n must be 1: an episode is one conversation", param="n")
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise GatewayError(400, "max_tokens must be a positive integer", param="max_tokens")
        messages = normalise_messages(request.get("messages"))
        tools = self._toolset(parse_tools(request.get("tools")))
        if not session.lock.acquire(blocking=False):
            raise GatewayError(409, "this session's previous request is still running: an episode's requests "
                                    "come one at a time", code="session_busy")
        try:
            replayed = session.replayed(messages)
            if replayed is not None:  # a branch's restarted agent, before its fork: the recording's answer
                self.stats.replayed += 1
                return self._response(request, *replayed, {"prompt_tokens": 0, "completion_tokens": 0,
                                                           "total_tokens": 0})
            context = session.prepare(messages, tools)
            budget = min(max_tokens, self.max_tokens, self.max_context_tokens - len(context))
            if budget < 1:
                raise GatewayError(400, f"the context is {len(context)} tokens and this run serves at most "
                                        f"{self.max_context_tokens} (prompt and completion)",
                                   code="context_length_exceeded", param="messages")
            turn = session.requests
            seed = int.from_bytes(hashlib.blake2b(
                f"{self.seed}/{session.step}/{session.prompt_index}/{session.traj_id}/{turn}".encode(),
                digest_size=4).digest(), "little")
            gen = GenRequest(tuple(context), budget, stop_strings=tools.stop_strings, seed=seed,
                             temperature=self.temperature, top_p=self.top_p, entropy_tokens=self.n_entropy_tokens)
            version = self.version
            waited = time.perf_counter()
            output: GenOutput = await asyncio.wrap_future(self._batcher.submit(gen))
            generated = time.perf_counter()
            message, finish = session.record(output, version, self.n_entropy_tokens, tuple(self.backend.eos_token_ids))
            if self.on_record is not None and not session.drifted:
                self.on_record(session)  # AEPO's branch decision after a reaction to a tool result
        finally:
            session.lock.release()
        self.stats.completions += 1
        self.stats.overhead_s += (waited - t0) + (time.perf_counter() - generated)
        return self._response(request, message, finish, {"prompt_tokens": len(context),
                                                         "completion_tokens": len(output.token_ids),
                                                         "total_tokens": len(context) + len(output.token_ids)})

    def _response(self, request: dict[str, Any], message: dict[str, Any], finish: str,
                  usage: dict[str, int]) -> tuple[int, Any, list | None]:
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if request.get("stream"):
            return 200, None, _chunks(cid, created, self.model_name, message, finish, usage,
                                      bool((request.get("stream_options") or {}).get("include_usage")))
        return 200, {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                     "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                     "usage": usage}, None

    def _toolset(self, tools: list[dict[str, Any]]) -> ToolSet:
        key = json.dumps(tools, sort_keys=True)
        found = self._toolsets.get(key)
        if found is None:
            found = self._toolsets[key] = tool_set(self.tool_format, self.tokenizer, tools)
        return found


def _chunks(cid: str, created: int, model: str, message: dict[str, Any], finish: str, usage: dict[str, int],
            include_usage: bool) -> list[dict[str, Any]]:
    """A completion as the chunks of OpenAI's streaming format (the whole completion is sampled
    before the first chunk: the role, the content, the tool call, the finish reason)."""
    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"],
                                                          "arguments": call["function"]["arguments"]}}]}))
    chunks.append(chunk({}, finish))
    if include_usage:
        chunks.append({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage})
    return chunks
