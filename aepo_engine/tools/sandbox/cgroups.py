"""Per-sandbox memory and process caps: one cgroup v2 per run.

``memory_mb`` (RLIMIT_AS) and ``nproc`` (RLIMIT_NPROC) are per process / per uid; with a
delegated cgroup v2 (``cgroup_parent``, see :class:`CgroupScope`) each run also gets its own
cgroup with ``memory.max = memory_mb`` (no swap) and ``pids.max = nproc`` for the whole sandbox.
Without one the worst case of one run is ``nproc`` x ``memory_mb`` of memory (32 x 1 GiB with the
defaults) plus ``scratch_mb`` of tmpfs.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.host import IsolationUnavailable

_CGROUP_CONTROLLERS = ("memory", "pids")


def cgroup_problem(parent: str) -> str | None:
    """Why per-sandbox cgroups cannot be made under ``parent``, or None when they can.

    ``parent`` must be a cgroup v2 directory this process may write, with the memory and pids
    controllers available and enabled for its children (they are enabled here when missing,
    which the kernel refuses while ``parent`` itself holds processes: delegate an empty one).
    """
    root = Path(parent)
    try:
        available = (root / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return f"{parent} is no cgroup v2 directory ({exc.strerror}: cgroup.controllers)"
    missing = [c for c in _CGROUP_CONTROLLERS if c not in available]
    if missing:
        return (f"the {'/'.join(missing)} controller(s) are not delegated to {parent} "
                f"(cgroup.controllers: {' '.join(available) or 'empty'})")
    try:
        enabled = (root / "cgroup.subtree_control").read_text().split()
        todo = [c for c in _CGROUP_CONTROLLERS if c not in enabled]
        if todo:
            (root / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in todo))
    except OSError as exc:
        return f"cannot enable {'/'.join(_CGROUP_CONTROLLERS)} for children of {parent}: {exc}"
    if not os.access(root, os.W_OK):
        return f"{parent} is not writable by this process"
    return None


def check_cgroup(config: PythonConfig) -> None:
    """Fail loudly when a ``cgroup_parent`` is configured but unusable (no silent downgrade).

    Raises:
        IsolationUnavailable: with what is missing.
    """
    if config.cgroup_parent:
        problem = cgroup_problem(config.cgroup_parent)
        if problem:
            raise IsolationUnavailable(f"python.cgroup_parent: {problem}; leave it empty to use "
                                       "per-process limits only")


class CgroupScope:
    """One run's cgroup under ``parent``: memory (no swap) and pids caps for the whole sandbox.

    Args:
        parent: a delegated cgroup v2 directory (see :func:`cgroup_problem`).
        config: ``memory_mb`` and ``nproc`` become ``memory.max`` and ``pids.max``.
    """

    def __init__(self, parent: str, config: PythonConfig) -> None:
        self.path = Path(parent) / f"aepo_sandbox_{os.getpid()}_{time.monotonic_ns()}"
        self.path.mkdir()
        limits = {"memory.max": config.memory_mb << 20, "memory.swap.max": 0,
                  "pids.max": config.nproc}
        for name, value in limits.items():
            if name != "memory.swap.max" or (self.path / name).exists():  # no swap accounting
                (self.path / name).write_text(str(value))

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` started inside this cgroup: a shell moves itself in, then execs it, so
        every process of the run is born in the cgroup."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                *command]

    def close(self) -> None:
        """Kill what is left in the cgroup and remove it."""
        try:
            (self.path / "cgroup.kill").write_text("1")  # Linux >= 5.14
        except OSError:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    continue
        for _ in range(50):  # the kernel removes a cgroup only once its last process is reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.01)

