"""Crash injection for recovery tests: ``AEPO_FAULT=<point>:<step>`` kills the process there.

Points: ``after_step`` (after step N's update and logging) and ``checkpoint_write`` (inside the
checkpoint of step N, after the training state is written and before it is published). The
process dies with SIGKILL, like an OOM kill or a pre-empted node: no ``finally`` blocks, no
flushing. Unset (the normal case) it costs one environment lookup per call.
"""
from __future__ import annotations

import os
import signal


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process if ``AEPO_FAULT`` names this point and step."""
    spec = os.environ.get("AEPO_FAULT")
    if spec and spec == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
