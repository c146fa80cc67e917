"""One sandboxed run, start to clean-up, under an isolation already checked.

bwrap (``isolation="bwrap"``): the code reaches the sandbox through an anonymous memory file;
``isolation="none"`` (trusted code only): no namespaces and no syscall filter, the code sees the
host filesystem with the sandbox uid's permissions (world-readable files are readable, writes
land in world-writable ``/tmp``, ``/var/tmp``, ``/dev/shm`` and are deleted after the run) and
has the network; its work dir is a temporary directory removed afterwards.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.bwrap import MASKED_FILES, SANDBOX_WORKDIR, bwrap_command
from aepo_engine.tools.sandbox.cgroups import CgroupScope, check_cgroup
from aepo_engine.tools.sandbox.child import python_argv, sandbox_environment, sandbox_interpreter
from aepo_engine.tools.sandbox.process import SandboxOutcome, execute, signal_from_init_status
from aepo_engine.tools.sandbox.scratch import Scratch, inode_cap_available
from aepo_engine.tools.sandbox.seccomp import seccomp_filter
from aepo_engine.tools.sandbox.uids import UidLease, kill_uid_processes, remove_uid_files


def run_under(code: str, config: PythonConfig, isolation: str) -> SandboxOutcome:
    """One run under ``isolation`` (already checked, or the probe itself), with its uid lease,
    cgroup and clean-up.

    Args:
        code: the Python source to run.
        config: limits and isolation options.
        isolation: ``"bwrap"`` or ``"none"``; not checked here (:func:`run_python` checks it).

    Returns:
        The captured output and how the run ended.
    """
    check_cgroup(config)
    lease = UidLease(config.sandbox_uid_base, config.uid_pool_size) \
        if os.geteuid() == 0 and config.sandbox_uid_base is not None else None
    uid = lease.uid if lease else None
    scope = CgroupScope(config.cgroup_parent, config) if config.cgroup_parent else None
    try:
        if isolation == "bwrap":
            return _run_bwrap(code, config, uid, scope)
        return _run_unisolated(code, config, uid, scope)
    finally:
        if scope:
            scope.close()
        if uid is not None:
            kill_uid_processes(uid)
            if isolation == "none":
                remove_uid_files(uid)
        if lease:
            lease.release()


def _run_bwrap(code: str, config: PythonConfig, uid: int | None,
               scope: CgroupScope | None) -> SandboxOutcome:
    # The code reaches the sandbox through an anonymous memory file that bwrap copies into the
    # scratch tmpfs: nothing of it is written to the host's disk. Each masked host file is read
    # from an empty descriptor of its own (bwrap reads each to its end).
    scratch, fds = None, []
    try:
        scratch = Scratch(config.scratch_mb, config.scratch_inodes) if inode_cap_available() else None
        fds += [_memfd("aepo_main_py", code.encode("utf-8")), _memfd("aepo_seccomp", seccomp_filter())]
        fds += [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in MASKED_FILES]
        command = bwrap_command(config, uid, fds[0], fds[1], scratch.path if scratch else None,
                                tuple(fds[2:]))
        outcome = execute(command, config, cwd="/", env=sandbox_environment(SANDBOX_WORKDIR),
                          uid=uid, scope=scope, pass_fds=tuple(fds))
    finally:
        for fd in fds:
            os.close(fd)
        if scratch:
            scratch.close()
    outcome.returncode = signal_from_init_status(outcome.returncode)
    outcome.isolation = "bwrap"
    return outcome


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_unisolated(code: str, config: PythonConfig, uid: int | None,
                    scope: CgroupScope | None) -> SandboxOutcome:
    workdir = tempfile.mkdtemp(prefix="aepo_py_")
    try:
        script = Path(workdir) / "main.py"
        script.write_text(code, encoding="utf-8")
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(script, uid, uid)
        command = python_argv(sandbox_interpreter(config, uid), config, uid)
        return execute(command, config, cwd=workdir, env=sandbox_environment(workdir), uid=uid,
                        scope=scope)
    finally:
        remove_tree(workdir)


def remove_tree(path: str) -> None:
    """Delete the work dir even when the code made parts of it unreadable (chmod 000).

    Only modes inside the tree are touched: when ``path`` itself fails (the code removed its
    own work dir, or left it non-empty at the last moment) its parent - the host's /tmp - must
    keep its mode (an earlier version set it to 0700 here).
    """

    def make_writable_and_retry(function, failed_path, _exc_info) -> None:
        if os.path.abspath(failed_path) == os.path.abspath(path):
            return
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)

