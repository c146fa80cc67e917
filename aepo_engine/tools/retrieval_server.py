"""A local BM25 retrieval server speaking the Search-R1-style API of ``aepo_engine.tools.search``.

    python -m aepo_engine.tools.retrieval_server --corpus corpus.jsonl [--host 127.0.0.1]
        [--port 8000] [--topk 3]

``POST /retrieve`` takes ``{"queries": [...], "topk": k}`` and answers ``{"result": [[{"document":
{"id", "contents"}, "score"}, ...], ...]}``; ``GET /health`` answers ``{"status": "ok",
"documents": N}``. Bad requests get HTTP 400 with ``{"error": "..."}``. On start it prints one
line ``listening on http://HOST:PORT (N documents)`` (``--port 0`` picks a free port).

Deliberately left out: authentication and TLS (it binds to loopback by default; put a proxy in
front before exposing it), dense retrievers, and request batching across clients.
"""
from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec

from aepo_engine.errors import ArgumentParser, entry_point
from aepo_engine.tools.search import CorpusBackend, RetrieveRequest, RetrieveResponse

PROG = "python -m aepo_engine.tools.retrieval_server"
MAX_BODY_BYTES = 1 << 20
MAX_TOPK = 100


class RetrievalHandler(BaseHTTPRequestHandler):
    """Serves ``/retrieve`` and ``/health`` from ``self.server.backend``."""

    server: "RetrievalServer"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/health":
            return self._send(404, {"error": f"no such path {self.path}"})
        self._send(200, {"status": "ok", "documents": len(self.server.backend.documents)})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/retrieve":
            return self._send(404, {"error": f"no such path {self.path}"})
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            return self._send(400, {"error": f"body must be 1..{MAX_BODY_BYTES} bytes"})
        try:
            request = msgspec.json.decode(self.rfile.read(length), type=RetrieveRequest)
        except msgspec.DecodeError as exc:
            return self._send(400, {"error": f"bad request: {exc}"})
        topk = request.topk or self.server.default_topk
        if not 1 <= topk <= MAX_TOPK:
            return self._send(400, {"error": f"topk must be in 1..{MAX_TOPK}, got {topk}"})
        try:
            hits = [self.server.backend.retrieve(q, topk) for q in request.queries]
        except Exception as exc:  # noqa: BLE001 - answer the client instead of dropping it
            return self._send(500, {"error": f"retrieval failed: {type(exc).__name__}: {exc}"})
        self._send(200, RetrieveResponse(result=hits))

    def _send(self, status: int, payload: object) -> None:
        body = msgspec.json.encode(payload)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        if self.server.verbose:
            super().log_message(format, *args)


class RetrievalServer(ThreadingHTTPServer):
    """A threading HTTP server holding one :class:`CorpusBackend`.

    Args:
        address: ``(host, port)``; port 0 picks a free port.
        backend: the indexed corpus.
        default_topk: used when a request gives no ``topk``.
        verbose: log every request to stderr.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], backend: CorpusBackend, default_topk: int = 3,
                 verbose: bool = False) -> None:
        super().__init__(address, RetrievalHandler)
        self.backend, self.default_topk, self.verbose = backend, default_topk, verbose


def _int_in(low: int, high: int, what: str):
    """An argparse type: an integer in ``low..high`` (the message says which range)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not {what} ({low}..{high})")
        return value

    return parse


@entry_point
def main(argv: list[str]) -> None:
    """Parse arguments, index the corpus and serve until interrupted; bad input (a missing or
    malformed corpus, a bad port, an address in use) ends with one ``error:`` line and status 2
    (:mod:`aepo_engine.errors`)."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="JSONL, one {id, contents} per line")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback default)")
    parser.add_argument("--port", type=_int_in(0, 65535, "a TCP port"), default=8000, help="0 picks a free port")
    parser.add_argument("--topk", type=_int_in(1, MAX_TOPK, "a hit count"), default=3, help="hits per query when not given")
    parser.add_argument("--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    backend = CorpusBackend.from_jsonl(args.corpus, topk=args.topk)
    if not backend.documents:
        raise ValueError(f"{args.corpus} holds no documents")
    try:
        server = RetrievalServer((args.host, args.port), backend, args.topk, args.verbose)
    except OSError as exc:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from exc
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port} ({len(backend.documents)} documents)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
