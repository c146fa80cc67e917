"""Load on a retrieval server: N concurrent clients, each sending requests back to back on a new
connection per request (as ``HttpBackend`` does), all released at once. Shared by the load test
(``tests/test_retrieval_server_load.py``) and ``bench/bench_retrieval_server.py``.

A request fails when it raises (refused or reset connection, timeout) or gets a status other than
200 with the expected number of results. Nothing is retried: a connection the server's listen
queue dropped shows up as a failure or, after the kernel's SYN retransmission, as a latency of 1 s
or more.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aepo_engine.tools.search import stop_server


@dataclass
class LoadResult:
    """What a load run saw: ``latencies_s`` of the successful requests, ``failures`` (a reason each)."""

    clients: int
    requests: int
    seconds: float
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s else float("nan")

    def summary(self) -> dict:
        return {"clients": self.clients, "requests": self.requests, "ok": len(self.latencies_s),
                "failures": len(self.failures), "p50_ms": round(self.percentile_ms(50), 2),
                "p99_ms": round(self.percentile_ms(99), 2), "max_ms": round(self.percentile_ms(100), 2),
                "seconds": round(self.seconds, 3), "requests_per_s": round(self.requests / self.seconds, 1),
                "first_failures": sorted(set(self.failures))[:3]}


def run_load(host: str, port: int, clients: int, requests_per_client: int, queries: list[str],
             timeout_s: float = 30.0) -> LoadResult:
    """``clients`` threads, released together, each sending ``requests_per_client`` ``/retrieve``
    requests of one query each (cycling through ``queries``)."""
    start_line = threading.Barrier(clients + 1)
    lock = threading.Lock()
    result = LoadResult(clients, clients * requests_per_client, 0.0)

    def client(index: int) -> None:
        start_line.wait()
        for j in range(requests_per_client):
            body = json.dumps({"queries": [queries[(index + j) % len(queries)]], "topk": 2}).encode()
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
                conn.request("POST", "/retrieve", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
                conn.close()
                ok = response.status == 200 and len(json.loads(payload)["result"]) == 1
                outcome = None if ok else f"HTTP {response.status}"
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever it is
                outcome = f"{type(exc).__name__}: {exc}"
            elapsed = time.perf_counter() - t0
            with lock:
                (result.failures.append(outcome) if outcome else result.latencies_s.append(elapsed))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    start_line.wait()
    t0 = time.perf_counter()
    for thread in threads:
        thread.join()
    result.seconds = time.perf_counter() - t0
    return result


class ServerProcess:
    """``python -m aepo_engine.tools.retrieval_server`` on a free port, as a context manager;
    ``module`` and ``extra`` choose the server and its options."""

    def __init__(self, corpus: Path, *extra: str, module: str = "aepo_engine.tools.retrieval_server",
                 cwd: Path | None = None):
        self.cmd = [sys.executable, "-m", module, "--corpus", str(corpus), "--port", "0", *extra]
        self.cwd = cwd

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.cwd)
        line = self.proc.stdout.readline()
        if not line.startswith("listening on http://"):
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line}{self.proc.stderr.read()}")
        self.host, port = line.split()[2].removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        return self

    def __exit__(self, *exc) -> None:
        stop_server(self.proc)


def write_corpus(path: Path, documents: int = 2000, seed: int = 0) -> list[str]:
    """A synthetic corpus of ``documents`` passages; returns queries that hit it."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(5000)]
    lines, queries = [], []
    for i in range(documents):
        text = " ".join(rng.choice(words, size=40))
        lines.append(json.dumps({"id": str(i), "contents": f"doc {i} {text}"}))
        queries.append(" ".join(text.split()[:4]))
    path.write_text("\n".join(lines) + "\n")
    return queries
