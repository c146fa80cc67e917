"""Running the project's commands from tests: the one tiny training size, the trainer as a child
process, a command's ``main`` in this process, torchrun on free ports, and the switch of the
multi-process tests.

- :data:`TINY`: ``--preset embedded --preset tiny`` (``aepo_engine/presets/tiny.toml``), the one
  size every test's training run starts from; a test adds only what it is about.
- :func:`train` runs ``python -m aepo_engine.train`` as a child with :func:`child_env`: one torch
  thread (the tiny model's ops are far too small to split, and a second thread only spins on a
  2-core machine that also runs pytest) and the CPU loss kernels eager unless ``compiled`` (a
  child pays a cold ``torch.compile`` of each kernel; the compiled path has its own tests and
  the default end-to-end run keeps it).
- :func:`run_main` calls a command's ``main(argv)`` in this process and returns what a child
  would (exit status, stdout, stderr): for ``--dry-run`` and the other checks that load no model,
  where a child's interpreter start would be most of the test's time.
- :data:`dist_tests`: tests that start several processes (torchrun, gloo) run unless
  ``AEPO_DIST_TESTS=0``.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = ["--preset", "embedded", "--preset", "tiny"]
# What the shared finished run (tests/conftest.py ``tiny_run``) adds to TINY: every checkpoint
# kept, one sampled trajectory and one whole rollout tree dumped per step.
TINY_RUN = ["--checkpoint.keep_last=5", "--logging.sample_trajectories=1", "--logging.sample_trees=1"]

dist_tests = pytest.mark.skipif(os.environ.get("AEPO_DIST_TESTS") == "0",
                                reason="AEPO_DIST_TESTS=0 (tests that start several processes)")


def child_env(compiled: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a test's child run: this one, one torch thread, the CPU kernels eager
    unless ``compiled``, no injected fault unless given (``AEPO_FAULT=...`` in ``extra``)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "AEPO_TORCH_COMPILE": "1" if compiled else "0",
            "AEPO_FAULT": "", **extra}


def train(run_dir: Path, *args: str, compiled: bool = False, env: dict[str, str] | None = None,
          timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m aepo_engine.train TINY --run_dir=RUN_DIR ARGS`` in a child; later arguments win."""
    return subprocess.run([sys.executable, "-m", "aepo_engine.train", *TINY, f"--run_dir={run_dir}", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else child_env(compiled))


def run_main(main: Callable[[Sequence[str]], Any], argv: Sequence[str]) -> subprocess.CompletedProcess:
    """``main(argv)`` in this process, as a child would have run it: its exit status (0 when it
    returns, the ``SystemExit`` code when it exits), and what it printed on stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            result = main(list(argv))
            code = result if isinstance(result, int) else 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_torchrun(args: list[str], timeout: int = 300, nproc: int = 2, compile_kernels: bool = False,
                    **extra_env: str) -> str:
    """``torchrun --nproc_per_node NPROC ARGS`` on a free port (not the fixed default, which parallel
    jobs may hold); fails the test on a non-zero exit or a hang; returns the ranks' output. The CPU
    kernels run eager unless ``compile_kernels`` (compiling them would dominate short runs);
    ``extra_env`` is added to the ranks' environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
    env = {**child_env(compile_kernels, **extra_env),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # own process group: a hang kills both ranks
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out\n{output[-6000:]}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{output[-6000:]}"
    return output
