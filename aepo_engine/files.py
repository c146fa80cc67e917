"""Files that survive a crash or a full disk: atomic writes, fsync, checksums, free space.

- :func:`write_text_atomic` writes a file whole or not at all (a fsynced temporary file renamed
  over the target), so a full disk or a kill never leaves a truncated file that a later reader
  takes for a complete one (a shorter JSONL or CSV parses).
- :func:`file_checksum` is the checksum checkpoints record for each file: xxHash's XXH3-64, about
  4x ``zlib.crc32`` and 7x sha256 on one core of the 2-core CI VM (``bench/bench_checksum.py``,
  rows in ``bench/results/checksum.jsonl``), so verifying is bound by the disk, not the CPU.
- :func:`out_of_space` tells a write that failed for lack of space from other failures.
  torch's zip writer reports a full disk without an errno (``RuntimeError: [enforce fail at
  inline_container.cc] unexpected pos``), so besides ENOSPC/EDQUOT it also counts a failed write
  when the filesystem has less room left than the write still needed.
Nothing here imports torch.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

import xxhash

__all__ = ["CHECKSUM", "TMP_TAG", "file_checksum", "format_bytes", "free_bytes", "fsync_dir", "fsync_tree",
           "out_of_space", "storage_error", "tree_bytes", "write_text_atomic"]

CHECKSUM = "xxh3_64"  # the name checkpoints record beside their checksums
TMP_TAG = ".tmp-"  # in the name of every temporary file or folder written here and by checkpoints
_CHUNK = 8 << 20  # bytes read at a time when checksumming
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory (deepest first), so a rename publishes complete data."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(dirpath))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a fsynced temporary file beside it, then
    ``os.replace``. On any failure (a full disk) the temporary file is removed, ``path`` keeps
    what it held before, and the error is raised."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TMP_TAG}{uuid.uuid4().hex}")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_checksum(path: str | Path) -> str:
    """The file's XXH3-64 as 16 hex digits (:data:`CHECKSUM`)."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path`` (its nearest
    existing ancestor when it does not exist yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def tree_bytes(root: str | Path) -> int:
    """Total size of the files under ``root`` (0 when it does not exist)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def format_bytes(count: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` carries (``failures: {rank: (exception, traceback)}``)."""
    seen, stack = set(), [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():
            stack.append(failure[0] if isinstance(failure, tuple) else failure)


def out_of_space(exc: BaseException, free: int, still_needed: int) -> bool:
    """Whether a failed write ran out of space.

    Args:
        exc: what the write raised.
        free: the filesystem's free bytes measured after the failure (before cleaning up).
        still_needed: bytes the write had yet to put on disk when it failed (an estimate).

    Returns:
        True for ENOSPC/EDQUOT anywhere in the exception's chain, and for an OSError or a
        writer's RuntimeError while the filesystem holds less than ``still_needed`` plus 1 MiB.
    """
    causes = list(_causes(exc))
    if any(isinstance(c, OSError) and c.errno in _SPACE_ERRNOS for c in causes):
        return True
    writer_failed = any(isinstance(c, (OSError, RuntimeError)) for c in causes)
    return writer_failed and free < max(still_needed, 0) + (1 << 20)


def storage_error(exc: BaseException) -> bool:
    """Whether an OSError (a full disk, an I/O error, a permission) is in the exception's chain."""
    return any(isinstance(c, OSError) for c in _causes(exc))
