"""Sandbox uids: one per run when the engine runs as root, and the clean-up after it.

When the engine runs as root (the usual container case) each run gets its own uid
(``run_as_uid`` + a slot, locked with flock so concurrent runs, even from other engine
processes, never share one): that is what makes RLIMIT_NPROC bite (the kernel ignores it for
root) and what lets every leftover process of the uid be killed, and (without isolation) every
file it left in the world-writable directories be deleted. The switch to the uid happens in the
bootstrap (:mod:`.child`), before any user code. As root, ``run_as_uid="engine"`` would make the
code uid 0, which may write ``/proc/sys`` files no capability guards and owns the host's device
nodes: :func:`.isolation.check_isolation` refuses it under bwrap (``isolation="none"``, for
trusted code only, still runs as the engine's uid).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import time
from pathlib import Path

WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# Where the uid locks live: a fixed path, not tempfile.gettempdir(). The uids are the machine's,
# so every engine process must see the same locks whatever its TMPDIR; with the locks under each
# one's TMPDIR (a batch system sets one per job) two processes leased the same uid and each
# one's clean-up SIGKILLed the other's running code and deleted its files.
UID_LOCK_PARENT = "/tmp"


class UidLease:
    """Exclusive use of one sandbox uid, held through an flock on a per-uid lock file."""

    def __init__(self, base: int, pool_size: int) -> None:
        lock_dir = Path(UID_LOCK_PARENT) / f"aepo_sandbox_uids_{os.geteuid()}"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(lock_dir)
        if info.st_uid != os.geteuid() or not os.path.isdir(lock_dir) or os.path.islink(lock_dir):
            raise RuntimeError(f"{lock_dir} is not a directory owned by us; refusing to use it")
        for uid in range(base, base + pool_size):
            fd = os.open(lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"all {pool_size} sandbox uids from {base} are busy")

    def release(self) -> None:
        """Unlock the uid for the next run."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def kill_uid_processes(uid: int, rounds: int = 3) -> int:
    """SIGKILL every process owned by ``uid`` (a few rounds, to catch ones forked meanwhile).

    Returns:
        How many kill signals were sent.
    """
    sent = 0
    for _ in range(rounds):
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        sent += found
        if not found:
            break
        time.sleep(0.02)
    return sent


def remove_uid_files(uid: int, dirs: tuple[str, ...] = WORLD_WRITABLE_DIRS) -> list[str]:
    """Delete the top-level entries of ``dirs`` owned by ``uid`` (what a run left behind).

    Returns:
        The removed paths.
    """
    removed = []
    for directory in dirs:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:
                continue
    return removed

