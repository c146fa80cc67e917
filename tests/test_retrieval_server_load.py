"""The retrieval server under load (issue 42): 256 concurrent clients, each on a new connection per
request, released at once, get every answer; its added latency follows the configured
distribution; a ``served`` search backend starts and stops its own server.

On the old ``ThreadingHTTPServer`` (listen backlog 5) the burst overflows the listen queue: the
kernel drops SYNs, which the clients' kernels resend after 1 s (p99 >= 1 s) or which fail
outright; the thresholds below fail there (measured: bench/results/retrieval_server.jsonl).
"""
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from retrieval_load import ServerProcess, run_load, write_corpus  # noqa: E402

from aepo_engine.tools import build_tool  # noqa: E402
from aepo_engine.tools.config import LatencyConfig  # noqa: E402
from aepo_engine.tools.retrieval_server import LatencyDraws  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("load") / "corpus.jsonl"
    return path, write_corpus(path, documents=500)


@pytest.mark.slow
def test_256_concurrent_clients_all_answered(corpus):
    path, queries = corpus
    # 20 ms of added latency keeps the 256 connections overlapping, as slow searches do
    with ServerProcess(path, "--latency-median-s", "0.02", "--latency-sigma", "0", cwd=REPO) as server:
        overflows = _listen_overflows()
        result = run_load(server.host, server.port, clients=256, requests_per_client=4, queries=queries)
        overflows = _listen_overflows() - overflows
    summary = result.summary()
    assert summary["failures"] == 0, summary
    assert summary["ok"] == 1024
    # No connection found the listen queue full (the old server's backlog of 5 overflowed: its
    # clients' SYNs were dropped and resent a second later, the 1 s p99). The latency itself is
    # the machine's load as much as the server's (p99 0.3 s quiet, 2.4 s at load 23): the bench
    # reports it, the test does not bound it.
    if overflows is not None:
        assert overflows == 0, (overflows, summary)


def _listen_overflows() -> int | None:
    """The kernel's count of connections dropped for a full listen queue (TcpExt ListenOverflows,
    this network namespace), or None where /proc does not say."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:]))
            return int(fields["ListenOverflows"]) if "ListenOverflows" in fields else None
    return None


def test_latency_draws_follow_the_configured_lognormal():
    cfg = LatencyConfig(median_s=1.0, sigma=0.65, cap_s=8.0, seed=3)
    draws = np.array([LatencyDraws(cfg).draw() for _ in range(1)])  # a fresh stream per server
    stream = LatencyDraws(cfg)
    many = np.array([stream.draw() for _ in range(20000)])
    assert draws[0] == many[0]  # seeded: the same first draw
    assert abs(np.median(many) - 1.0) < 0.03
    # p95 / p50 = exp(1.645 sigma) = 2.91 for sigma 0.65
    assert abs(np.percentile(many, 95) / np.median(many) - np.exp(1.645 * 0.65)) < 0.1
    assert many.max() <= 8.0 and (many == 8.0).sum() < 40  # P(draw > 8 s) = 7e-4
    assert LatencyDraws(LatencyConfig()).draw() == 0.0


def test_latency_is_added_to_answers(corpus):
    path, queries = corpus
    with ServerProcess(path, "--latency-median-s", "0.3", "--latency-sigma", "0", cwd=REPO) as server:
        result = run_load(server.host, server.port, clients=8, requests_per_client=2, queries=queries)
    assert not result.failures
    assert min(result.latencies_s) >= 0.3
    assert result.seconds < 0.3 * 2 + 3  # the 8 clients waited side by side, not one after another


def test_bad_latency_settings_are_clean_errors(tmp_path):
    import subprocess

    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "1", "contents": "x"}) + "\n")
    for args, message in ((["--latency-median-s", "-1"], "is not a median in seconds"),
                          (["--latency-median-s", "2", "--latency-cap-s", "1"], "must be >= median_s")):
        proc = subprocess.run([sys.executable, "-m", "aepo_engine.tools.retrieval_server", "--corpus",
                               str(tmp_path / "c.jsonl"), "--port", "0", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error:") and message in proc.stderr, proc.stderr


def test_served_backend_starts_answers_and_stops_its_server(corpus):
    path, queries = corpus
    tool = build_tool("search", backend="served", corpus_path=str(path), topk=1,
                      latency={"median_s": 0.2, "sigma": 0.0})
    proc = tool.backend._proc
    start = time.perf_counter()
    result = tool(queries[7])
    assert result.ok and result.text.startswith("Page 1: doc 7 "), result.text[:80]
    assert time.perf_counter() - start >= 0.2
    tool.close()
    assert proc.poll() is not None  # the child server is gone


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited, not yet reaped by its new parent


def test_a_served_search_stops_when_its_owner_is_killed(corpus):
    """A trainer killed with SIGKILL (an OOM kill, a pre-empted node, the crash tests) runs no
    clean-up: the retrieval server it served its search from stopped with it only since it
    watches its parent (the bench found one left running after a crashed run)."""
    path, _ = corpus
    code = ("import sys, time; from aepo_engine.tools.search import ServedCorpusBackend; "
            f"b = ServedCorpusBackend({str(path)!r}); print(b._proc.pid, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        server = int(owner.stdout.readline())
        assert not _gone(server)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server), "the retrieval server outlived the process that started it"
    finally:
        owner.kill()


def test_a_failed_run_closes_its_tools():
    """``Trainer.run`` closes the tools however the run ends (a served search's server, the
    sandbox pool): an asynchronous run whose rollout process died left its server running. The
    step source (an asynchronous run's: its rollout process) closes first."""
    from types import SimpleNamespace

    from aepo_engine.train import Trainer

    closed = []

    def fail():
        raise RuntimeError("the rollout process failed")

    def close_process():
        closed.append("process")
        raise RuntimeError("the rollout process would not stop")

    trainer = SimpleNamespace(_run=fail, tools=SimpleNamespace(close=lambda: closed.append("tools")),
                              source=SimpleNamespace(close=close_process),
                              agent_rollout=SimpleNamespace(close=lambda: closed.append("gateway")))
    with pytest.raises(RuntimeError, match="rollout process"):
        Trainer.run(trainer)
    assert closed == ["process", "tools", "gateway"]  # the tools and an agent's gateway close even so


def test_served_backend_that_cannot_start_says_why(tmp_path):
    from aepo_engine.tools.search import SearchBackendError, ServedCorpusBackend

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SearchBackendError, match="did not start.*holds no documents"):
        ServedCorpusBackend(tmp_path / "empty.jsonl")
