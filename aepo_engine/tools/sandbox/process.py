"""Running one sandbox command and collecting its output under the limits.

A wall-clock timeout after which the whole process group is SIGKILLed, an output cap
(stdout+stderr bytes) past which the run is killed; stdin is /dev/null. Leftover processes of
the run (its process group, and its uid when it has one) are killed as soon as the main process
exits.
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.cgroups import CgroupScope
from aepo_engine.tools.sandbox.uids import kill_uid_processes

_READ_CHUNK = 65_536
_EXIT_GRACE_S = 0.5


@dataclass
class SandboxOutcome:
    """What one sandboxed run produced.

    Args:
        stdout, stderr: captured output (decoded, at most ``max_output_bytes`` together).
        returncode: the exit status; negative: killed by that signal; None: not started.
        timed_out: the wall-clock limit killed it.
        output_limited: the output cap killed it.
        elapsed_s: wall-clock seconds.
        isolation: ``"bwrap"`` or ``"none"``; uid: the host uid it ran as (None: the engine's).
    """

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool = False
    output_limited: bool = False
    elapsed_s: float = 0.0
    isolation: str = "none"
    uid: int | None = None



def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect_output(proc: subprocess.Popen, deadline: float, cap: int,
                    on_exit) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until both close, the deadline passes or ``cap`` bytes arrived.

    ``on_exit`` is called once when the main process has exited but pipes are still open
    (a background child holds them), to kill the leftovers; reading then stops within
    ``_EXIT_GRACE_S`` even if an escaped process keeps the pipes open, and that is no timeout.

    Returns:
        ``(stdout, stderr, timed_out, output_limited)``.
    """
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in buffers:
        selector.register(stream, selectors.EVENT_READ)
    timed_out = limited = exited = False
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = not exited
            break
        for key, _ in selector.select(timeout=min(remaining, 0.1)):
            chunk = os.read(key.fd, _READ_CHUNK)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            buffers[key.fileobj] += chunk
        if sum(len(b) for b in buffers.values()) > cap:
            limited = True
            break
        if not exited and proc.poll() is not None:
            exited = True
            on_exit()
            deadline = min(deadline, time.monotonic() + _EXIT_GRACE_S)
    selector.close()
    out, err = bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr])
    return out[:cap], err[: max(0, cap - len(out))], timed_out, limited


def execute(command: list[str], config: PythonConfig, *, cwd: str, env: dict[str, str],
             uid: int | None, scope: CgroupScope | None, **popen_options) -> SandboxOutcome:
    """Start ``command`` in its own session (and cgroup), collect its output under the limits,
    kill leftovers.

    Args:
        command: the whole command line (bwrap's, or the bare interpreter's).
        config: ``timeout_s`` and ``max_output_bytes`` apply here.
        cwd, env: the working directory and the whole environment of the process.
        uid: the sandbox uid whose leftover processes are killed (None: none).
        scope: the run's cgroup, which the command is started inside (None: none).
        **popen_options: passed to ``subprocess.Popen`` (``pass_fds``).

    Returns:
        The outcome; ``isolation`` is set by the caller.
    """
    if scope:
        command = scope.wrap(command)
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **popen_options)

    def on_exit() -> None:
        _kill_group(proc)
        if uid is not None:
            kill_uid_processes(uid)

    with proc:
        out, err, timed_out, limited = _collect_output(
            proc, start + config.timeout_s, config.max_output_bytes, on_exit)
        _kill_group(proc)
        returncode = proc.wait()
    return SandboxOutcome(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                          returncode, timed_out, limited, time.monotonic() - start, "none", uid)


_FATAL_SIGNALS = {int(s) for s in (signal.SIGXCPU, signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT,
                                   signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTERM,
                                   signal.SIGXFSZ, signal.SIGSYS)}


def signal_from_init_status(returncode: int | None) -> int | None:
    """bwrap (its PID 1) reports a child killed by signal N as exit status 128 + N; map it back
    to -N like subprocess does (a program that itself exits with such a status reads the same)."""
    if returncode is not None and returncode > 128 and returncode - 128 in _FATAL_SIGNALS:
        return -(returncode - 128)
    return returncode
