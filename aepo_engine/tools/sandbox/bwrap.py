"""The bwrap command line of one run: namespaces, capabilities and the sandbox's filesystem.

Each run is one ``bwrap`` (bubblewrap) invocation (which binary: :mod:`.host`):
- a filesystem namespace with a minimal read-only root holding what the interpreter needs
  (:mod:`.layout`: its install trees, the directories of the shared libraries it maps, the links
  on the way to them, its site directories hidden behind empty read-only mounts unless
  ``site_packages``; ``/etc/ld.so.cache``; not the rest of ``/usr``), and one private scratch
  tmpfs at ``/tmp`` (:mod:`.scratch`: ``scratch_mb`` MiB and, as root, ``scratch_inodes`` files)
  holding the working directory ``/tmp/work`` (the code is ``main.py`` there; ``/dev/shm`` is a
  link into it, so the work dir, ``/tmp`` and ``/dev/shm`` share one cap). The interpreter's trees
  are bound *after* the scratch, so an interpreter under ``/tmp`` (a venv in a temporary
  directory) is bound over the scratch instead of hidden by it.
  ``/dev/null|zero|urandom`` (plus ``/dev/fd``, ``/dev/std*`` links) are the host's nodes: the
  code never runs as uid 0 (:mod:`.isolation` refuses it), so it cannot chmod them. A fresh
  ``/proc`` of its own PID namespace, with ``/proc/sys`` bound read-only over it (bwrap leaves it
  writable: it only covers what it can write to itself, and ``/proc/sys`` is a 0555 directory),
  ``/proc/cmdline`` and the boot id replaced by empty files, the host name ``sandbox``.
  Nothing else exists: not the engine's code or data, the checkout, ``/home``, ``/root``,
  ``/etc``, credentials (an interpreter that lives inside such a tree, e.g. a venv in the
  checkout, brings only its own directory, and the directories above it hold only the way
  down). Writes anywhere but the scratch fail (read-only or missing); the scratch vanishes with
  the run. ``/proc/self/mountinfo`` still lists the bound paths (the ones the sandbox sees) and
  the host's device names: a process may always read its own mount table.
- new network (only a loopback of its own: no route to the host or anywhere), PID, IPC, UTS
  and (where possible) cgroup namespaces (:data:`.host.NAMESPACE_ARGS`); bwrap's PID 1 reaps,
  and when the run ends the kernel kills every process left in the namespace, including ones
  that escaped the process group with setsid;
- the syscall filter of :mod:`.seccomp`, read from a file descriptor;
- ``--die-with-parent``, ``--new-session`` (no TIOCSTI into a terminal), ``no_new_privs``.

As root, bwrap runs privileged (so it can bind an interpreter under a 0700 ``/root``) with
every capability dropped but CAP_SETUID/SETGID, which the bootstrap's ``setuid`` to the
sandbox uid then clears. Without root, bwrap uses a user namespace and the code runs as the
engine's uid mapped into it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.child import python_argv
from aepo_engine.tools.sandbox.host import NAMESPACE_ARGS, find_bwrap
from aepo_engine.tools.sandbox.layout import InterpreterLayout, interpreter_layout

SANDBOX_WORKDIR = "/tmp/work"  # inside the bwrap sandbox, on the scratch tmpfs
SANDBOX_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
SANDBOX_HOSTNAME = "sandbox"
# Host facts replaced by empty files (each gets its own descriptor: bwrap reads it to the end).
MASKED_FILES = ("/proc/cmdline", "/proc/sys/kernel/random/boot_id")
# Top-level host paths that are links into /usr on merged-/usr systems (recreated as links; the
# loader's cache names libraries through them).
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def filesystem_args(layout: InterpreterLayout, config: PythonConfig, scratch: str | None = None,
                    mask_fds: tuple[int, ...] = ()) -> list[str]:
    """bwrap arguments for the sandbox's filesystem (see the module docstring), in mount order.

    Args:
        layout: what the interpreter needs.
        config: ``scratch_mb`` (when bwrap makes the scratch) and ``site_packages``.
        scratch: a host tmpfs to bind at /tmp (:class:`.scratch.Scratch`); None: bwrap mounts one
            with the size cap only.
        mask_fds: one empty readable descriptor per :data:`MASKED_FILES` entry.

    The scratch is mounted at /tmp *before* the interpreter's trees are bound, so that an
    interpreter living under /tmp (a venv made in a temporary directory) is bound on top of it
    instead of being hidden by it; the way down to it is then a few read-only directories in
    the scratch.
    """
    args: list[str] = []
    for link in _ROOT_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
    args += ["--perms", "0755", "--dir", "/etc",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    # One tmpfs, one cap: the work dir, /tmp and /dev/shm all draw on it.
    if scratch:
        args += ["--bind", scratch, "/tmp"]
    else:
        args += ["--perms", "1777", "--size", str(config.scratch_mb << 20), "--tmpfs", "/tmp"]
    created = {"/", "/tmp", "/etc", *_ROOT_LINKS}
    for path in layout.binds:
        # bwrap would copy the host's modes onto the directories above (0700 /root): make them
        # traversable, with nothing in them but the way down.
        args += _parents(path, created) + ["--ro-bind", path, path]
        created.add(path)
    for path, target in layout.links:
        if path not in created:
            args += _parents(path, created) + ["--symlink", target, path]
            created.add(path)
    # Compared by real path: a venv's lib64 -> lib makes its site-packages a hidden folder a
    # second time, under another name, and a tmpfs there would hide the allowed one.
    allowed = {os.path.realpath(d) for d in layout.site_dirs} if config.site_packages else set()
    for site_dir in layout.hidden:
        if os.path.realpath(site_dir) not in allowed:
            args += ["--size", "4096", "--tmpfs", site_dir, "--remount-ro", site_dir]
    args += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]
    for fd, path in zip(mask_fds, MASKED_FILES):
        args += ["--perms", "0444", "--ro-bind-data", str(fd), path]
    args += ["--dir", "/dev"]
    for device in SANDBOX_DEVICES:
        args += ["--dev-bind", device, device]
    args += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{name}"]
    args += ["--symlink", "/tmp", "/dev/shm",
             "--perms", "0777", "--dir", SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    return args


def _parents(path: str, created: set[str]) -> list[str]:
    """``--dir`` (0755) for each directory above ``path`` not made yet; marks them made."""
    args = []
    for parent in reversed(Path(path).parents[:-1]):
        if str(parent) not in created:
            args += ["--perms", "0755", "--dir", str(parent)]
            created.add(str(parent))
    return args


def bwrap_command(config: PythonConfig, uid: int | None, code_fd: int, seccomp_fd: int,
                  scratch: str | None = None, mask_fds: tuple[int, ...] = ()) -> list[str]:
    """The whole bwrap command line of one run; the code is copied from ``code_fd``, the
    syscall filter read from ``seccomp_fd``; ``scratch`` and ``mask_fds`` as in
    :func:`filesystem_args`."""
    layout = interpreter_layout(config.python_executable or sys.executable, config.site_packages)
    caps = []
    if os.geteuid() == 0:  # bwrap runs privileged: keep only what the bootstrap's setuid needs
        caps = ["--cap-drop", "ALL"]
        if uid is not None:
            caps += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [find_bwrap(config.bwrap_path) or config.bwrap_path or "bwrap", *NAMESPACE_ARGS, *caps,
            "--hostname", SANDBOX_HOSTNAME, *filesystem_args(layout, config, scratch, mask_fds),
            "--perms", "0644", "--file", str(code_fd), f"{SANDBOX_WORKDIR}/main.py",
            "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--",
            *python_argv(layout.executable, config, uid)]
