"""The bwrap command line of one run: namespaces, capabilities and the sandbox's filesystem.

Each run is one ``bwrap`` (bubblewrap) invocation (which binary: :mod:`.host`):
- a filesystem namespace with a minimal read-only root: ``/usr`` (and the ``/bin``, ``/lib``...
  links to it), ``/etc/ld.so.cache``, one private tmpfs of ``scratch_mb`` MiB at ``/tmp``
  holding the working directory ``/tmp/work`` (the code is ``main.py`` there; ``/dev/shm`` is a
  link into it, so the work dir, ``/tmp`` and ``/dev/shm`` share one cap), then the
  interpreter's own install trees (prefix, base prefix, the real executable's directory) bound
  read-only at their host paths, *after* the tmpfs, so an interpreter under ``/tmp`` (a venv in
  a temporary directory) is bound over the scratch instead of hidden by it; every site directory
  of the interpreter and of its base installation hidden behind an empty read-only mount unless
  ``site_packages``; ``/dev/null|zero|urandom`` (plus ``/dev/fd``, ``/dev/std*`` links) and a
  fresh ``/proc`` of its own PID namespace (bwrap covers ``/proc/sys`` & co read-only).
  Nothing else exists: not the engine's code or data, the checkout, ``/home``, ``/root``,
  ``/etc``, credentials (an interpreter that lives inside such a tree, e.g. a venv in the
  checkout, brings only its own directory, and the directories above it hold only the way
  down). Writes anywhere but the tmpfs fail (read-only or missing); the tmpfs vanishes with
  the namespace.
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

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.child import SAFE_PATH, python_argv
from aepo_engine.tools.sandbox.host import NAMESPACE_ARGS, find_bwrap

SANDBOX_WORKDIR = "/tmp/work"  # inside the bwrap sandbox, on the scratch tmpfs
SANDBOX_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
# Top-level host paths that are links into /usr on merged-/usr systems (bound as they are).
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


# The site directories of the interpreter *and* of its base installation: a venv's python finds
# its base's site-packages too (with --system-site-packages, or by a sys.path edit in the code),
# so hiding only the venv's would leave the base's packages one import away.
_LAYOUT_PROBE = r"""
import json, os, site, sys, sysconfig
base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
        "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
site_dirs = {*site.getsitepackages(), *site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])}
for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars=base)):
    site_dirs |= {paths["purelib"], paths["platlib"]}
print(json.dumps({
    "executable": sys.executable,
    "roots": sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                     os.path.dirname(os.path.realpath(sys.executable))}),
    "site_dirs": sorted(site_dirs),
}))
"""


@dataclass(frozen=True)
class InterpreterLayout:
    """Where an interpreter lives: what to bind so it runs, and its site-packages to hide.

    Args:
        executable: the interpreter path (as given; symlinks resolve inside the binds).
        roots: install trees (prefixes, the real executable's directory) to bind read-only.
        site_dirs: the site directories of the interpreter and of its base installation.
    """

    executable: str
    roots: tuple[str, ...]
    site_dirs: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def interpreter_layout(python: str) -> InterpreterLayout:
    """Ask ``python`` where it lives (one subprocess per interpreter and engine process).

    Raises:
        RuntimeError: when ``python`` does not run.
    """
    try:
        proc = subprocess.run([python, "-I", "-c", _LAYOUT_PROBE], capture_output=True,
                              text=True, timeout=60, env={"PATH": SAFE_PATH})
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the sandbox interpreter {python!r} does not run: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"the sandbox interpreter {python!r} failed: {proc.stderr[-300:]}")
    info = json.loads(proc.stdout)
    return InterpreterLayout(python, tuple(info["roots"]), tuple(info["site_dirs"]))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def filesystem_args(layout: InterpreterLayout, config: PythonConfig) -> list[str]:
    """bwrap arguments for the sandbox's filesystem (see the module docstring), in mount order.

    The scratch tmpfs is mounted at /tmp *before* the interpreter's trees are bound, so that an
    interpreter living under /tmp (a venv made in a temporary directory) is bound on top of it
    instead of being hidden by it; the way down to it is then a few read-only directories in
    the scratch.
    """
    args = ["--ro-bind", "/usr", "/usr"]
    for link in _ROOT_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    args += ["--perms", "0755", "--dir", "/etc",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    # One tmpfs, one cap: the work dir, /tmp and /dev/shm all draw on it.
    args += ["--perms", "1777", "--size", str(config.scratch_mb << 20), "--tmpfs", "/tmp"]
    bound, created = ["/usr"], {"/tmp"}
    for root in sorted(layout.roots, key=len):
        if os.path.isdir(root) and not any(_under(root, b) for b in bound):
            # bwrap would copy the host's modes onto the directories above (0700 /root): make
            # them traversable, with nothing in them but the way down.
            for parent in reversed(Path(root).parents[:-1]):
                if str(parent) not in created:
                    args += ["--perms", "0755", "--dir", str(parent)]
                    created.add(str(parent))
            args += ["--ro-bind", root, root]
            bound.append(root)
    if not config.site_packages:
        for site_dir in layout.site_dirs:
            if os.path.isdir(site_dir) and any(_under(site_dir, b) for b in bound):
                args += ["--size", "4096", "--tmpfs", site_dir, "--remount-ro", site_dir]
    args += ["--proc", "/proc", "--dir", "/dev"]
    for device in SANDBOX_DEVICES:
        args += ["--dev-bind", device, device]
    args += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{name}"]
    args += ["--symlink", "/tmp", "/dev/shm",
             "--perms", "0777", "--dir", SANDBOX_WORKDIR, "--chdir", SANDBOX_WORKDIR]
    return args


def bwrap_command(config: PythonConfig, uid: int | None, code_fd: int,
                  seccomp_fd: int) -> list[str]:
    """The whole bwrap command line of one run; the code is copied from ``code_fd``, the
    syscall filter read from ``seccomp_fd``."""
    layout = interpreter_layout(config.python_executable or sys.executable)
    caps = []
    if os.geteuid() == 0:  # bwrap runs privileged: keep only what the bootstrap's setuid needs
        caps = ["--cap-drop", "ALL"]
        if uid is not None:
            caps += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [find_bwrap(config.bwrap_path) or config.bwrap_path or "bwrap", *NAMESPACE_ARGS, *caps,
            *filesystem_args(layout, config),
            "--perms", "0644", "--file", str(code_fd), f"{SANDBOX_WORKDIR}/main.py",
            "--remount-ro", "/", "--seccomp", str(seccomp_fd), "--",
            *python_argv(layout.executable, config, uid)]

