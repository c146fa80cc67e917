"""The collective timeout (issue 35, point 3): torch's default (10 minutes for NCCL) stopped a run
whenever one rank's agentic rollouts took 10 minutes longer than another's. The trainer now gives
``train.collective_timeout_minutes`` to the gloo group Python objects and barriers go through (NCCL
keeps ``train.device_collective_timeout_minutes``), reports a rank's wait (``time/wait_for_ranks``) and stops with an error naming the setting
when a wait gives up.
"""
from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from runs import TINY, child_env, dist_tests, free_port

from aepo_engine import distributed

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "slow_rank_train.py"


def test_the_long_wait_goes_to_the_object_group_and_nccl_keeps_a_short_one(monkeypatch):
    """On CUDA (recorded fakes of the calls that need it): the gloo group that objects and barriers
    go through (the waits for a slower rank's rollouts) gets the long timeout, NCCL the device
    timeout (GPU review 2, point 10: NCCL got the 180-minute wait too)."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw.get("backend"), kw)) or "gloo")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index, {})))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name, value in (("_TIMEOUT", None), ("_TIMEOUT_SETTING", ""), ("_OBJECT_GROUP", None)):
        monkeypatch.setattr(distributed, name, value)
    timeout, device_timeout = datetime.timedelta(minutes=180), datetime.timedelta(minutes=10)

    rank, world, device = distributed.init_distributed(timeout, "train.collective_timeout_minutes",
                                                       device_timeout=device_timeout)

    assert (rank, world, device) == (1, 2, torch.device("cuda", 1))
    assert calls[0] == ("set_device", 1, {})
    assert calls[1] == ("init", "nccl", {"timeout": device_timeout})
    assert calls[2][:2] == ("new_group", "gloo") and calls[2][2]["timeout"] == timeout
    assert distributed.collective_timeout() == timeout


def test_on_cpu_the_one_gloo_group_waits_long(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in (("_TIMEOUT", None), ("_TIMEOUT_SETTING", ""), ("_OBJECT_GROUP", None)):
        monkeypatch.setattr(distributed, name, value)
    timeout = datetime.timedelta(minutes=180)
    distributed.init_distributed(timeout, "train.collective_timeout_minutes", device_timeout=datetime.timedelta(1))
    assert calls == [("gloo", {"timeout": timeout})] and distributed._OBJECT_GROUP is None


def _train(run_dir: Path, timeout_minutes: float, delay_s: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(SCRIPT), *TINY, f"--run_dir={run_dir}",
               "--train.steps=1", "--checkpoint.every_n_steps=0",
               f"--train.collective_timeout_minutes={timeout_minutes}"]
    env = {**child_env(), "AEPO_TEST_ROLLOUT_DELAY_S": str(delay_s),
           "PYTHONPATH": f"{Path(__file__).resolve().parents[1]}:{child_env().get('PYTHONPATH', '')}"}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.sandbox
@pytest.mark.slow
@dist_tests
def test_a_rank_delayed_past_the_timeout_stops_the_run_naming_the_setting(tiny_run, tmp_path):
    """Two gloo ranks, rank 1's rollouts late: 20 s against a 6 s timeout stops the run with an
    error that names the setting; 10 s against 5 minutes lets it finish, and rank 0 reports the
    wait. (The delays were 40 and 20 s: the sleeps held an xdist worker for a minute of CI.)"""
    for name in ("short", "long"):  # the tiny run's set-up (task, corpus, warm start), reused
        shutil.copytree(tiny_run / "setup", tmp_path / name / "setup")
    short = _train(tmp_path / "short", 0.1, 20)
    output = short.stdout + short.stderr
    assert short.returncode != 0
    assert "waited more than 0.1 minutes for the other ranks at the step's rollouts" in output, output[-3000:]
    assert "raise train.collective_timeout_minutes (now 0.1)" in output

    long = _train(tmp_path / "long", 5, 10)
    assert long.returncode == 0, (long.stdout + long.stderr)[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "long" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert 7 < row["time/wait_for_ranks"] < 300


_ENDING = """
import atexit, sys, types
import torch.distributed as dist
from aepo_engine.distributed import run_and_exit
atexit.register(lambda: print("atexit ran", flush=True))
class Finalized:  # prints when the interpreter finalizes (a normal exit), not under os._exit
    def __del__(self):
        print("finalized", flush=True)
kept = Finalized()
if sys.argv[1] == "group_vllm":
    sys.modules["vllm"] = types.ModuleType("vllm")  # as if an engine was loaded
def main():
    if sys.argv[1].startswith("group"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    print("worked", end="")  # unflushed: run_and_exit flushes it
    raise SystemExit(int(sys.argv[3]) if sys.argv[3].isdigit() else sys.argv[3])
run_and_exit(main)
print("after run_and_exit")  # never: it ends the process
"""


@pytest.mark.parametrize("case", ["group", "group_vllm", "torchrun_env", "single"])
@pytest.mark.parametrize("status", ["0", "3", "a message"])
def test_run_and_exit_ends_a_rank_with_its_status_after_the_atexit_handlers(case, status, tmp_path):
    """distributed.run_and_exit (the end of `python -m aepo_engine.train` and of the torchrun test
    scripts): a process in a group, or one of several torchrun ranks, ends by os._exit after
    destroying the group, running the atexit handlers and flushing its output, with main's exit
    status (a message: printed, status 1); a lone process exits as usual, and so does one that
    loaded vLLM (its CPU engines' shared memory is removed at a normal exit only)."""
    script = tmp_path / "ending.py"
    script.write_text(_ENDING)
    env = {**child_env(False), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    if case == "torchrun_env":
        env["WORLD_SIZE"] = "2"
    else:
        env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(script), case, str(free_port()), status], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == (int(status) if status.isdigit() else 1), proc.stderr[-2000:]
    assert proc.stdout.startswith("worked") and "atexit ran" in proc.stdout, proc.stdout
    assert "after run_and_exit" not in proc.stdout
    assert ("a message" in proc.stderr) == (status == "a message")
    assert ("finalized" in proc.stdout) == (case in ("group_vllm", "single")), proc.stdout
