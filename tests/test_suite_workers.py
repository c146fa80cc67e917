"""The suite's own set-up on pytest-xdist workers (tests/conftest.py): how many workers ``-n auto``
takes, that a fixture shared by several tests is still built once when they run on two workers,
that ``slow`` tests are handed out first, and that each worker gets its share of the cores.

The second test runs a small suite of its own under the real xdist (two workers) with this
conftest copied beside it, and reads what its tests wrote.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import pytest_xdist_auto_num_workers


@pytest.mark.parametrize("cores,memory_gib,workers", [(2, 24, 2), (16, 128, 4), (1, 8, 1), (8, 16, 1), (4, 30, 3)])
def test_auto_workers_follow_cores_and_memory(monkeypatch, cores, memory_gib, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory_gib * 2**30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert pytest_xdist_auto_num_workers(None) == workers


SAMPLE = '''
import json, os, time
from pathlib import Path

import pytest
import torch

LOG = Path(os.environ["SUITE_LOG"])


def record(**fields):
    with LOG.open("a") as f:
        f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"), "t": time.time(), **fields}) + "\\n")


@pytest.fixture(scope="module")
def engine():
    record(built="engine")
    return "engine"


@pytest.mark.parametrize("i", range(6))
def test_uses_the_module_fixture(engine, i):
    record(test=f"module_{i}", threads=torch.get_num_threads(), omp=os.environ.get("OMP_NUM_THREADS"))
    time.sleep(0.05)


@pytest.mark.parametrize("i", range(6))
def test_plain(i):
    record(test=f"plain_{i}")
    time.sleep(0.05)


@pytest.mark.slow
def test_slow_last_in_the_file():
    record(test="slow")
'''


@pytest.mark.slow  # two xdist workers start (each imports torch)
def test_two_workers_build_a_shared_fixture_once_and_start_slow_tests_first(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), tests / "conftest.py")
    shutil.copy(Path(__file__).parents[1] / "pytest.ini", tmp_path / "pytest.ini")
    (tests / "test_sample.py").write_text(SAMPLE)
    log = tmp_path / "log.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k not in (
        "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}
    env["SUITE_LOG"] = str(log)
    # -n 2 whatever this machine's auto count is; pytest.ini's --dist loadgroup as the suite has it
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "13 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(1 for r in rows if r.get("built") == "engine") == 1  # one worker ran all six users
    assert len({r["worker"] for r in rows if r.get("test", "").startswith("module_")}) == 1
    assert len({r["worker"] for r in rows if "test" in r}) == 2  # both workers got work
    ran = [r for r in rows if "test" in r]
    slow_worker = next(r["worker"] for r in ran if r["test"] == "slow")
    assert next(r for r in ran if r["worker"] == slow_worker)["test"] == "slow"  # first on its worker
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    assert all(r["threads"] == share and r["omp"] == str(share) for r in ran if "threads" in r)
