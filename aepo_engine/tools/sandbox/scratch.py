"""The sandbox's one writable place: a tmpfs of ``scratch_mb`` MiB and ``scratch_inodes`` files.

As root, each run's scratch is a tmpfs this module mounts with ``size`` *and* ``nr_inodes``
under a root-only directory (``<tmp>/aepo_sandbox_scratch_0``) and bwrap binds at ``/tmp``;
it is unmounted (lazily: nothing of the run is left to use it) and removed when the run ends.
The inode cap matters because a file's inode and name cost kernel memory that the size cap does
not count: 220,000 empty files held 274 MiB while the scratch showed 0 MiB used. bwrap's own
``--tmpfs`` takes a size only, so without root (bwrap then makes its mounts in a user namespace
of its own) the scratch is bwrap's tmpfs with the size cap alone, and the start-up note says so.
A scratch left mounted by an engine that was killed is unmounted by the next engine's start-up\ncheck (:func:`sweep_stale`).
"""
from __future__ import annotations

import ctypes
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_MNT_DETACH = 2
_LIBC = ctypes.CDLL(None, use_errno=True)
# One thread unmounts finished scratches (its queue is drained at exit; a killed engine's are
# swept at the next start).
_RELEASER = ThreadPoolExecutor(1, thread_name_prefix="aepo-scratch-release")


def scratch_parent() -> Path:
    """The root-only directory the scratch mounts live in (made on first use)."""
    parent = Path(tempfile.gettempdir()) / f"aepo_sandbox_scratch_{os.geteuid()}"
    parent.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(parent)
    if info.st_uid != os.geteuid() or not os.path.isdir(parent) or os.path.islink(parent):
        raise RuntimeError(f"{parent} is not a directory owned by us; refusing to use it")
    return parent


def inode_cap_available() -> bool:
    """Whether this engine mounts its scratches itself (with the inode cap): it runs as root."""
    return os.geteuid() == 0


class Scratch:
    """One run's scratch tmpfs, mounted at :attr:`path` on the host until :meth:`close`.

    Args:
        size_mb: the size cap (``scratch_mb``).
        inodes: the inode cap (``scratch_inodes``).

    Raises:
        OSError: the mount failed (the message names the call).
    """

    def __init__(self, size_mb: int, inodes: int) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{os.getpid()}_", dir=scratch_parent())
        options = f"size={size_mb << 20},nr_inodes={inodes},mode=1777".encode()
        if _LIBC.mount(b"tmpfs", self.path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options):
            err = ctypes.get_errno()
            os.rmdir(self.path)
            raise OSError(err, f"mount of the sandbox scratch tmpfs at {self.path}: {os.strerror(err)}")

    def close(self) -> None:
        """Unmount and remove the mount point, in the background: nothing of the run is left to
        use it, and an unmount waits for the kernel (about 4 ms, plus 4 ms for the rmdir, on the
        2-core VM), time the call need not spend."""
        _RELEASER.submit(_release, self.path)


def _release(path: str) -> None:
    _LIBC.umount2(path.encode(), _MNT_DETACH)
    try:
        os.rmdir(path)
    except OSError:
        pass


def sweep_stale() -> int:
    """Unmount the scratches of engine processes that are gone (one killed mid-run leaves its
    mount); each mount point's name starts with its engine's pid.

    Returns:
        How many were removed.
    """
    parent = str(scratch_parent()) + "/"
    removed = 0
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo if line.split()[4].startswith(parent)]
    for point in points:
        try:
            os.kill(int(point[len(parent):].split("_", 1)[0]), 0)
        except ProcessLookupError:
            _release(point)
            removed += 1
        except (ValueError, PermissionError):
            continue
    return removed
