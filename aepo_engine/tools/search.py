"""The ``<search>`` tool and its three backends.

- ``CacheBackend``: the reference offline cache (JSON object query -> ``"Page 1: ...\\nPage 2:
  ..."``). A query that matches a key after normalization (case, whitespace, surrounding quotes,
  a leading ``"search query:"``) returns that entry's text verbatim; a miss returns the ``topk``
  cached pages that BM25 ranks best for the query.
- ``CorpusBackend``: BM25 over a local JSONL corpus of ``{"id", "contents"}`` passages.
- ``HttpBackend``: a client for a Search-R1-style retrieval server (schema below), served
  locally by ``python -m aepo_engine.tools.retrieval_server``.
- ``ServedCorpusBackend``: that server over a local corpus, started by the tool as a child process
  (with an added latency, ``SearchConfig.latency``), and its client.

Every backend answers with text in the ``"Page 1: ...\\nPage 2: ..."`` format ("" for nothing
found); the tool cuts it to ``max_result_chars``.

Retrieval HTTP schema (JSON, ``POST /retrieve``)::

    request:  {"queries": ["q1", ...], "topk": 3, "return_scores": true}
              topk optional (server default); return_scores for Search-R1 servers, always true
    response: {"result": [[{"document": {"id": "7", "contents": "..."}, "score": 12.5}, ...],
                          ...]}      one list per query, best first; id a string or an integer;
                                     extra document fields are ignored
    error:    HTTP 4xx/5xx with {"error": "message"}

Deliberately left out: live web search (needs keys and network; plug it in as another
backend), dense retrieval (needs an embedding model; run it behind the HTTP API) and query
rewriting.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import msgspec

from aepo_engine.tools.base import ConfiguredTool, ToolResult, error_result, register_tool, truncate_text
from aepo_engine.tools.bm25 import BM25Index
from aepo_engine.tools.config import LatencyConfig, SearchConfig

# ---------------------------------------------------------------------------------------------
# Wire schema of the retrieval API


class Document(msgspec.Struct, forbid_unknown_fields=False):
    """A retrieved passage. Extra fields (title, url...) are allowed and ignored."""

    id: str | int
    contents: str


class Hit(msgspec.Struct):
    """One ranked result."""

    document: Document
    score: float


class RetrieveRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /retrieve``. ``topk`` None means the server's default. ``return_scores``
    is sent so that a Search-R1 server answers with the ``{"document", "score"}`` form; the
    local server always returns scores."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = True


class RetrieveResponse(msgspec.Struct):
    """Answer of ``POST /retrieve``: ``result[i]`` are the hits of ``queries[i]``, best first."""

    result: list[list[Hit]]


class SearchBackendError(RuntimeError):
    """A backend could not answer (unreachable server, bad response); shown to the model."""


# ---------------------------------------------------------------------------------------------
# Text helpers

_PAGE_SPLIT = re.compile(r"(?:^|\n)Page \d+: ")
_WHITESPACE = re.compile(r"\s+")
_QUERY_PREFIX = re.compile(r"^search query:\s*")


def normalize_query(query: str) -> str:
    """Cache key normalization: case-folded, whitespace collapsed, quotes and prefix removed."""
    text = _WHITESPACE.sub(" ", query).strip().casefold()
    text = _QUERY_PREFIX.sub("", text).strip()
    return text.strip("\"'").strip()


def split_pages(text: str) -> list[str]:
    """Split ``"Page 1: a\\nPage 2: b"`` into ``["a", "b"]``; unpaged text is one page."""
    parts = [p.strip() for p in _PAGE_SPLIT.split(text)]
    return [p for p in parts if p]


def format_pages(pages: list[str]) -> str:
    """Render pages as ``"Page 1: ...\\nPage 2: ..."``; each page on one line."""
    return "\n".join(f"Page {i}: {_WHITESPACE.sub(' ', p).strip()}"
                     for i, p in enumerate(pages, start=1))


# ---------------------------------------------------------------------------------------------
# Backends


class SearchBackend(Protocol):
    """Anything that answers a query with ``"Page 1: ...\\nPage 2: ..."`` text ("" for none)."""

    def search(self, query: str) -> str: ...


class CacheBackend:
    """Offline cache in the reference format, with a BM25 fallback over its pages on a miss.

    Args:
        cache: query -> ``"Page 1: ...\\nPage 2: ..."`` text.
        topk: pages returned on a miss.
        bm25_fallback: False returns no pages on a miss.
    """

    def __init__(self, cache: dict[str, str], topk: int = 5, bm25_fallback: bool = True) -> None:
        self.topk = topk
        self._entries: dict[str, str] = {}
        for query, text in cache.items():
            self._entries.setdefault(normalize_query(query), text)
        pages = (p for text in self._entries.values() for p in split_pages(text))
        self._pages = list(dict.fromkeys(pages))  # de-duplicated, order kept
        self._index = BM25Index(self._pages) if bm25_fallback else None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "CacheBackend":
        """Load a JSON cache file. Raises ValueError when it is not a JSON object of strings."""
        cache = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(cache, dict) or not all(isinstance(v, str) for v in cache.values()):
            raise ValueError(f"{path}: expected a JSON object mapping query -> result text")
        return cls(cache, **kwargs)

    def lookup(self, query: str) -> str | None:
        """The cached text of ``query`` after normalization, verbatim, or None on a miss."""
        return self._entries.get(normalize_query(query))

    def search(self, query: str) -> str:
        hit = self.lookup(query)
        if hit is not None:
            return hit
        if self._index is None:
            return ""
        return format_pages([self._pages[i] for i, _ in self._index.search(query, self.topk)])


class CorpusBackend:
    """BM25 over a local corpus of ``{"id", "contents"}`` passages.

    Args:
        documents: the passages.
        topk: pages returned per query.
    """

    def __init__(self, documents: list[Document], topk: int = 5) -> None:
        self.topk = topk
        self.documents = documents
        self._index = BM25Index([d.contents for d in documents])

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: Any) -> "CorpusBackend":
        """Load a JSONL corpus; a bad line raises ValueError naming the line number."""
        decoder = msgspec.json.Decoder(Document)
        documents = []
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    documents.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{path}:{number}: {exc}") from exc
        return cls(documents, **kwargs)

    def retrieve(self, query: str, topk: int | None = None) -> list[Hit]:
        """Ranked hits with scores (the retrieval server's answer for one query)."""
        ranked = self._index.search(query, topk or self.topk)
        return [Hit(self.documents[i], score) for i, score in ranked]

    def search(self, query: str) -> str:
        return format_pages([hit.document.contents for hit in self.retrieve(query)])


class HttpBackend:
    """Client of a retrieval server speaking the schema in the module docstring.

    Args:
        url: the ``/retrieve`` endpoint.
        topk: hits requested per query.
        timeout_s: connect + response timeout.
    """

    def __init__(self, url: str, topk: int = 5, timeout_s: float = 10.0) -> None:
        self.url, self.topk, self.timeout_s = url, topk, timeout_s
        self._decoder = msgspec.json.Decoder(RetrieveResponse)

    def retrieve(self, queries: list[str]) -> list[list[Hit]]:
        """One round trip for several queries. Raises SearchBackendError with the cause."""
        body = msgspec.json.encode(RetrieveRequest(queries=queries, topk=self.topk))
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        raw = self._post(request)
        try:
            response = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise SearchBackendError(f"retrieval server sent a bad response: {exc}") from exc
        if len(response.result) != len(queries):
            raise SearchBackendError(f"retrieval server answered {len(response.result)} "
                                     f"queries, expected {len(queries)}")
        return response.result

    def _post(self, request: urllib.request.Request) -> bytes:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode("utf-8", "replace")
            raise SearchBackendError(f"retrieval server returned HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SearchBackendError(f"retrieval server {self.url} unreachable: {reason}") from exc

    def search(self, query: str) -> str:
        return format_pages([hit.document.contents for hit in self.retrieve([query])[0]])


class ServedCorpusBackend(HttpBackend):
    """A retrieval server over a local corpus, run as a child process for as long as this backend
    lives, and its HTTP client: BM25 behind the same HTTP path (and the same added latency, if
    asked) as a remote search service.

    Args:
        corpus_path: JSONL corpus the server indexes.
        topk: hits requested per query.
        timeout_s: client timeout per request.
        latency: what the server adds to every answer.
    Raises:
        SearchBackendError: the server did not start (its error output is in the message).
    """

    def __init__(self, corpus_path: str | Path, topk: int = 5, timeout_s: float = 10.0,
                 latency: LatencyConfig = LatencyConfig()) -> None:
        cmd = [sys.executable, "-m", "aepo_engine.tools.retrieval_server", "--corpus", str(corpus_path),
               "--port", "0", "--topk", str(topk), "--parent-pid", str(os.getpid()), *latency.cli_args()]
        self._log = tempfile.TemporaryFile()  # the server's stderr: a pipe nobody reads could fill up
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self._proc.stdout.readline()
        if not line.startswith("listening on http://"):
            self._proc.kill()
            self._proc.wait()
            self._log.seek(0)
            err = self._log.read().decode("utf-8", "replace")
            self.close()
            raise SearchBackendError(f"the retrieval server over {corpus_path} did not start: "
                                     f"{(line + err).strip()[-1000:]}")
        super().__init__(line.split()[2] + "/retrieve", topk=topk, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop the server (:func:`stop_server`)."""
        stop_server(self._proc)
        self._proc.stdout.close()
        self._log.close()


def stop_server(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop a server process: SIGTERM (uvicorn's graceful stop), SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _build_search_source(config: SearchConfig) -> SearchBackend:
    """The search source ``config.backend`` names (docs/glossary.md), loaded from its file, pointed at
    its URL, or served."""
    if config.backend == "cache":
        return CacheBackend.from_file(config.cache_path, topk=config.topk,
                                      bm25_fallback=config.cache_bm25_fallback)
    if config.backend == "corpus":
        return CorpusBackend.from_jsonl(config.corpus_path, topk=config.topk)
    if config.backend == "served":
        if not config.corpus_path:
            raise ValueError("search.corpus_path is required because search.backend is 'served'")
        return ServedCorpusBackend(config.corpus_path, topk=config.topk, timeout_s=config.timeout_s,
                                   latency=config.latency)
    return HttpBackend(config.url, topk=config.topk, timeout_s=config.timeout_s)


# ---------------------------------------------------------------------------------------------
# The tool


NO_RESULTS = "No results found."


@register_tool("search")
class SearchTool(ConfiguredTool):
    """``<search>query</search>`` -> ``"Page 1: ...\\nPage 2: ..."``.

    Args:
        backend: where pages come from.
        max_result_chars: the result text is cut to this many characters.
    """

    config_type = SearchConfig

    def __init__(self, backend: SearchBackend, max_result_chars: int = 3000) -> None:
        self.backend = backend
        self.max_result_chars = max_result_chars

    @classmethod
    def from_config(cls, config: SearchConfig, max_result_chars: int) -> "SearchTool":
        """Build from a validated :class:`SearchConfig` (``build_tool`` calls this)."""
        return cls(_build_search_source(config), max_result_chars=max_result_chars)

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def __call__(self, payload: str) -> ToolResult:
        query = payload.strip()
        if not query:
            return error_result("empty search query")
        try:
            text = self.backend.search(query)
        except SearchBackendError as exc:
            return error_result(str(exc))
        return ToolResult(truncate_text(text or NO_RESULTS, self.max_result_chars), ok=True)
