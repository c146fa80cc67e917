"""The retrieval server under concurrent clients: failures, p50/p99 latency, requests per second.

    python bench/bench_retrieval_server.py [--clients 64 256] [--requests 8] [--latency-median-s 0]
        [--before main] [--out bench/results/retrieval_server.jsonl]

Each client sends ``--requests`` one-query ``/retrieve`` requests back to back, a new connection
each (as ``HttpBackend`` does), all clients released at once (``bench/retrieval_load.py``; no
retries: a refused, reset or timed-out request is a failure). ``--before REF`` runs the server of a
git ref too (its ``aepo_engine/tools/retrieval_server.py``, over this checkout's package), e.g. the
``ThreadingHTTPServer`` it replaced. One row per (server, clients), with the machine's load
average and the client's CPU time, since client threads share the machine with the server.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS_DIR, machine  # noqa: E402
from retrieval_load import ServerProcess, run_load, write_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def server_at(ref: str, folder: Path) -> Path:
    """The server module of git ``ref``, written to ``folder`` (run as a script beside this package)."""
    source = subprocess.run(["git", "show", f"{ref}:aepo_engine/tools/retrieval_server.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    path = folder / "retrieval_server_before.py"
    path.write_text(source)
    return path


def measure(label: str, corpus: Path, queries: list[str], clients: int, requests: int, extra: list[str],
            module: str) -> dict:
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    with ServerProcess(corpus, *extra, module=module, cwd=REPO) as server:
        result = run_load(server.host, server.port, clients, requests, queries)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"bench": "retrieval_server", "server": label, **result.summary(), "extra_args": extra,
            "client_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 2),
            "load_avg_1m": os.getloadavg()[0], **machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--latency-median-s", type=float, default=0.0)
    parser.add_argument("--before", default=None, help="a git ref whose server is measured too")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "retrieval_server.jsonl")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        queries = write_corpus(corpus, documents=2000)
        servers = [("uvicorn+asyncio", "aepo_engine.tools.retrieval_server",
                    ["--latency-median-s", str(args.latency_median_s)])]
        if args.before:
            module_path = server_at(args.before, Path(tmp))
            sys.path.insert(0, tmp)
            servers.append((f"ThreadingHTTPServer@{args.before}", module_path.stem, []))
        env_path = os.pathsep.join([tmp, str(REPO), os.environ.get("PYTHONPATH", "")])
        os.environ["PYTHONPATH"] = env_path
        for clients in args.clients:
            for label, module, extra in servers:
                row = measure(label, corpus, queries, clients, args.requests, extra, module)
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("server", "clients", "requests", "failures", "p50_ms",
                                                      "p99_ms", "requests_per_s", "load_avg_1m")}), flush=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
