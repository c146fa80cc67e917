"""A local BM25 retrieval server speaking the Search-R1-style API of ``aepo_engine.tools.search``.

    python -m aepo_engine.tools.retrieval_server --corpus corpus.jsonl [--host 127.0.0.1]
        [--port 8000] [--topk 3] [--backlog 4096] [--latency-median-s 0 --latency-sigma 0.65
        --latency-cap-s 8 --latency-seed 0] [--verbose]

``POST /retrieve`` takes ``{"queries": [...], "topk": k}`` and answers ``{"result": [[{"document":
{"id", "contents"}, "score"}, ...], ...]}``; ``GET /health`` answers ``{"status": "ok",
"documents": N}``. Bad requests get HTTP 400 with ``{"error": "..."}``. On start it prints one
line ``listening on http://HOST:PORT (N documents)`` (``--port 0`` picks a free port).

How it is served: an ASGI app (:class:`RetrievalApp`) under uvicorn, one asyncio event loop, on a
socket listening with a real backlog (``--backlog``, 4096 by default; the kernel caps it at
``net.core.somaxconn``), so a burst of connections waits in the queue instead of being refused.
BM25 scoring runs in a small thread pool, off the event loop, so the loop keeps accepting and
answering while a query is scored; the index scores one query at a time (``BM25Index`` holds a
lock), which at a few milliseconds a query is far from the bottleneck. ``--latency-*`` makes every
answer wait a log-normal draw (:class:`~aepo_engine.tools.config.LatencyConfig`): a stand-in for
a web search API, whose waiting costs the server nothing (an ``asyncio.sleep``). The load test is
``tests/test_retrieval_server_load.py``; measured figures: ``bench/bench_retrieval_server.py``.

Deliberately left out: authentication and TLS (it binds to loopback by default; put a proxy in
front before exposing it), dense retrievers, and request batching across clients.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np

from aepo_engine.errors import ArgumentParser, entry_point
from aepo_engine.tools.config import LatencyConfig
from aepo_engine.tools.search import CorpusBackend, RetrieveRequest, RetrieveResponse

PROG = "python -m aepo_engine.tools.retrieval_server"
MAX_BODY_BYTES = 1 << 20
MAX_TOPK = 100
DEFAULT_BACKLOG = 4096
SCORING_THREADS = 4

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class LatencyDraws:
    """Seeded draws of a :class:`LatencyConfig` (seconds), in call order; always 0 when its median is."""

    def __init__(self, config: LatencyConfig):
        self.config = config
        self._rng = np.random.default_rng(config.seed)

    def draw(self) -> float:
        cfg = self.config
        if cfg.median_s <= 0:
            return 0.0
        return float(min(cfg.median_s * np.exp(cfg.sigma * self._rng.standard_normal()), cfg.cap_s))


class RetrievalApp:
    """The ASGI application: ``/retrieve`` and ``/health`` answered from one :class:`CorpusBackend`.

    Args:
        backend: the indexed corpus.
        default_topk: used when a request gives no ``topk``.
        latency: what every ``/retrieve`` answer waits (the scoring time included).
        scoring_threads: threads BM25 scoring runs on (off the event loop).
    """

    def __init__(self, backend: CorpusBackend, default_topk: int = 3, latency: LatencyConfig = LatencyConfig(),
                 scoring_threads: int = SCORING_THREADS) -> None:
        self.backend, self.default_topk = backend, default_topk
        self.latency = LatencyDraws(latency)
        self._pool = ThreadPoolExecutor(max_workers=scoring_threads, thread_name_prefix="bm25")

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return
        method, path = scope["method"], scope["path"]
        if path == "/health" and method == "GET":
            status, payload = 200, {"status": "ok", "documents": len(self.backend.documents)}
        elif path == "/retrieve" and method == "POST":
            status, payload = await self._retrieve(scope, receive)
        elif path in ("/health", "/retrieve"):
            status, payload = 405, {"error": f"{method} not allowed on {path}"}
        else:
            status, payload = 404, {"error": f"no such path {path}"}
        body = msgspec.json.encode(payload)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _retrieve(self, scope: dict, receive: Receive) -> tuple[int, Any]:
        start = time.perf_counter()
        wait = self.latency.draw()  # drawn on arrival: the stream does not depend on scoring times
        body = await read_body(scope, receive)
        if body is None:
            return 400, {"error": f"body must be 1..{MAX_BODY_BYTES} bytes"}
        try:
            request = msgspec.json.decode(body, type=RetrieveRequest)
        except msgspec.DecodeError as exc:
            return 400, {"error": f"bad request: {exc}"}
        topk = request.topk or self.default_topk
        if not 1 <= topk <= MAX_TOPK:
            return 400, {"error": f"topk must be in 1..{MAX_TOPK}, got {topk}"}
        loop = asyncio.get_running_loop()
        try:
            hits = await loop.run_in_executor(self._pool, self._score, request.queries, topk)
        except Exception as exc:  # noqa: BLE001 - answer the client instead of dropping it
            return 500, {"error": f"retrieval failed: {type(exc).__name__}: {exc}"}
        # at least the draw: the event loop's timers may fire early by up to a millisecond (uvloop
        # and libuv read a cached clock; an answer 46 us short failed a suite run), so sleep again
        while (left := start + wait - time.perf_counter()) > 0:
            await asyncio.sleep(left)
        return 200, RetrieveResponse(result=hits)

    def _score(self, queries: list[str], topk: int):
        return [self.backend.retrieve(q, topk) for q in queries]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def read_body(scope: dict, receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request body, or None when it is empty or larger than ``limit`` bytes."""
    declared = dict(scope.get("headers") or ()).get(b"content-length")
    if declared is not None and not (declared.isdigit() and 0 < int(declared) <= limit):
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks) or None


def listen(host: str, port: int, backlog: int = DEFAULT_BACKLOG) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` and listening with ``backlog``.

    Raises:
        OSError: the address cannot be bound (the message names it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.listen(backlog)
    return sock


def serve(app: RetrievalApp, sock: socket.socket, backlog: int = DEFAULT_BACKLOG, verbose: bool = False) -> None:
    """Serve ``app`` on the listening ``sock`` with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="off", backlog=backlog, access_log=verbose,
                            log_level="info" if verbose else "warning", timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])


def _stop_with_parent(pid: int, every_s: float = 0.5) -> None:
    """SIGTERM this server (uvicorn's graceful stop) once process ``pid`` is gone or is no longer
    its parent: a trainer killed with SIGKILL runs no clean-up, and its server must not outlive it."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="aepo-parent-watch", daemon=True).start()


def _number_in(low: float, high: float, what: str, kind: type = int):
    """An argparse type: a number of ``kind`` in ``low..high`` (the message says which range)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not {what} ({low}..{high})")
        return value

    return parse


@entry_point
def main(argv: list[str]) -> None:
    """Parse arguments, index the corpus and serve until interrupted; bad input (a missing or
    malformed corpus, a bad port, an address in use, a bad latency) ends with one ``error:`` line
    and status 2 (:mod:`aepo_engine.errors`)."""
    default = LatencyConfig()
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="JSONL, one {id, contents} per line")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback default)")
    parser.add_argument("--port", type=_number_in(0, 65535, "a TCP port"), default=8000, help="0 picks a free port")
    parser.add_argument("--topk", type=_number_in(1, MAX_TOPK, "a hit count"), default=3, help="hits per query when not given")
    parser.add_argument("--backlog", type=_number_in(1, 1 << 16, "a queue length"), default=DEFAULT_BACKLOG,
                        help="connections the kernel queues before accepting (capped by net.core.somaxconn)")
    parser.add_argument("--latency-median-s", type=_number_in(0, 600, "a median in seconds", float),
                        default=default.median_s, help="median added latency per answer (0: none)")
    parser.add_argument("--latency-sigma", type=_number_in(0, 5, "a log-space spread", float), default=default.sigma,
                        help="log-normal sigma of the added latency")
    parser.add_argument("--latency-cap-s", type=_number_in(0, 3600, "a cap in seconds", float), default=default.cap_s,
                        help="the longest added latency")
    parser.add_argument("--latency-seed", type=_number_in(0, 2**32 - 1, "a seed"), default=default.seed,
                        help="seed of the latency draws")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument("--parent-pid", type=_number_in(1, 2**31 - 1, "a process id"), default=None,
                        help="stop when this process is gone (a trainer's served search: killed, its server goes too)")
    args = parser.parse_args(argv)
    latency = LatencyConfig(median_s=args.latency_median_s, sigma=args.latency_sigma, cap_s=args.latency_cap_s,
                            seed=args.latency_seed)
    backend = CorpusBackend.from_jsonl(args.corpus, topk=args.topk)
    if not backend.documents:
        raise ValueError(f"{args.corpus} holds no documents")
    sock = listen(args.host, args.port, args.backlog)
    host, port = sock.getsockname()[:2]
    app = RetrievalApp(backend, args.topk, latency)
    print(f"listening on http://{host}:{port} ({len(backend.documents)} documents)", flush=True)
    if args.parent_pid is not None:
        _stop_with_parent(args.parent_pid)
    try:
        serve(app, sock, args.backlog, args.verbose)
    finally:
        app.close()
        sock.close()


if __name__ == "__main__":
    main()
