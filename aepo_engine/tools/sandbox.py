"""Running untrusted, model-written Python in a subprocess sandbox (Linux).

What every run gets:
- a fresh private working directory (mode 0700), deleted afterwards; the code is ``main.py`` in it;
- an isolated interpreter: ``python -I -S -B`` (no user site, no PYTHON* variables, no
  site-packages unless ``site_packages``; cwd not on ``sys.path``);
- a scrubbed environment: PATH, HOME/TMPDIR (the work dir), LANG and single-thread BLAS/OpenMP
  settings only - nothing of the engine's environment (API keys, tokens) reaches the code;
- resource limits set in the child before the code runs: CPU seconds, address space, file size,
  open files, processes (RLIMIT_NPROC), no core dumps; plus ``no_new_privs`` so set-uid binaries
  cannot raise privileges;
- a wall-clock timeout after which the whole process group is SIGKILLed, and an output cap
  (stdout+stderr bytes) past which the run is killed;
- stdin is /dev/null.

When the engine runs as root (the usual container case) it also gets:
- its own uid (``run_as_uid`` + a slot, locked with flock so concurrent runs, even from other
  engine processes, never share one). That is what makes RLIMIT_NPROC bite - the kernel ignores
  it for root, so a fork bomb run as root is bounded only by the timeout kill - and what denies
  writes outside the work dir except to world-writable places (/tmp, /var/tmp, /dev/shm). Files
  the uid left there are deleted after the run and every process of the uid is killed.
- Linux namespaces via ``unshare`` when they work here (``isolation="auto"``): a new network
  namespace (no interfaces but a down loopback: no network at all, not even to the host's
  loopback services) and a new PID namespace with /proc remounted (the code sees only its own
  processes; when the run ends, the kernel kills every process in the namespace, including ones
  that escaped the process group with setsid). Without root, ``unshare --user`` maps the engine
  user to root inside a user namespace for the same effect, when the kernel allows it.

What it cannot do (do not run hostile code on a machine with secrets on disk):
- read access to world-readable files (the code can read /etc, the engine's source, data files
  that are not 0600); no filesystem namespace/chroot is set up;
- disk space: RLIMIT_FSIZE caps each file, not the total written to /tmp;
- without root and without user namespaces, neither uid separation nor namespaces apply: the
  code then runs as the engine user with network access, limited by rlimits and the timeout;
- memory is capped per process (RLIMIT_AS), not per sandbox (no cgroups), so ``nproc`` x
  ``memory_mb`` is the real worst case; kernel exploits are out of scope.
"""
from __future__ import annotations

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
import time
from dataclasses import dataclass
from pathlib import Path

from aepo_engine.tools.config import PythonConfig

WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65_536
_EXIT_GRACE_S = 0.5

# Runs first in the child. As PID 1 of a new PID namespace the kernel drops signals it has no
# handler for (SIGXCPU, SIGTERM...), so there it forks: the parent stays a minimal init that
# reaps and exits with the child's status (128 + signal when killed), the child runs the code.
# Then: no_new_privs, limits, the user's code as __main__ with the bootstrap frame removed from
# tracebacks. argv: [limits_json, script].
_BOOTSTRAP = r"""
import os, sys, resource
if os.getpid() == 1:
    _child = os.fork()
    if _child:
        while True:
            _pid, _status = os.wait()
            if _pid == _child:
                os._exit(os.waitstatus_to_exitcode(_status) % 256 if os.WIFEXITED(_status)
                         else 128 + os.WTERMSIG(_status))
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
except Exception:
    pass
for _name, (_soft, _hard) in __import__("json").loads(sys.argv[1]).items():
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
        isolation: ``"namespaces"`` or ``"none"``; uid: the uid it ran as.
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
# Isolation: namespaces and sandbox uids


def _namespace_prefix(as_root: bool) -> list[str]:
    user_ns = [] if as_root else ["--user", "--map-root-user"]
    return ["unshare", *user_ns, "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


@functools.lru_cache(maxsize=None)
def namespaces_work() -> bool:
    """Whether ``unshare`` can create network + PID namespaces here (probed once)."""
    if shutil.which("unshare") is None:
        return False
    cmd = [*_namespace_prefix(os.geteuid() == 0), "--", "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def resolve_isolation(mode: str) -> str:
    """Map the configured mode to what is used: ``"namespaces"`` or ``"none"``.

    Raises:
        RuntimeError: when ``mode == "namespaces"`` and they do not work here.
    """
    if mode == "none":
        return "none"
    if namespaces_work():
        return "namespaces"
    if mode == "namespaces":
        raise RuntimeError("python.isolation='namespaces' but `unshare --net --pid` fails here "
                           "(no CAP_SYS_ADMIN and no user namespaces?); use 'auto' or 'none'")
    return "none"


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


# ---------------------------------------------------------------------------------------------
# One run


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


def _command(config: PythonConfig, isolation: str, uid: int | None) -> list[str]:
    python = sandbox_interpreter(config, uid)
    flags = ["-I", "-B"] if config.site_packages else ["-I", "-S", "-B"]
    prefix: list[str] = []
    if isolation == "namespaces":
        prefix = _namespace_prefix(os.geteuid() == 0)
        if uid is not None:
            prefix += ["--setuid", str(uid), "--setgid", str(uid)]
        prefix.append("--")
    return [*prefix, python, *flags, "-c", _BOOTSTRAP, json.dumps(_rlimits(config)), "main.py"]


def _environment(workdir: str) -> dict[str, str]:
    # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and a 64-core machine would
    # otherwise make ``import numpy`` fail under the default nproc.
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                            "MKL_NUM_THREADS")}
    return {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            **single_thread}


def _remove_tree(path: str) -> None:
    """Delete the work dir even when the code made parts of it unreadable (chmod 000)."""

    def make_writable_and_retry(function, failed_path, _exc_info) -> None:
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


def run_python(code: str, config: PythonConfig) -> SandboxOutcome:
    """Run ``code`` once in a fresh sandbox (never retried).

    Args:
        code: Python source written by the model.
        config: limits and isolation options.

    Returns:
        The captured output and how the run ended.
    """
    isolation = resolve_isolation(config.isolation)
    lease = UidLease(config.sandbox_uid_base, config.uid_pool_size) \
        if os.geteuid() == 0 and config.sandbox_uid_base is not None else None
    uid = lease.uid if lease else None
    workdir = tempfile.mkdtemp(prefix="aepo_py_")
    try:
        return _run_in(workdir, code, config, isolation, uid)
    finally:
        if uid is not None:
            kill_uid_processes(uid)
            remove_uid_files(uid)
        _remove_tree(workdir)
        if lease:
            lease.release()


def _run_in(workdir: str, code: str, config: PythonConfig, isolation: str,
            uid: int | None) -> SandboxOutcome:
    script = Path(workdir) / "main.py"
    script.write_text(code, encoding="utf-8")
    if uid is not None:
        os.chown(workdir, uid, uid)
        os.chown(script, uid, uid)
    drop = {} if uid is None or isolation == "namespaces" else \
        {"user": uid, "group": uid, "extra_groups": []}
    start = time.monotonic()
    proc = subprocess.Popen(_command(config, isolation, uid), cwd=workdir,
                            env=_environment(workdir), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **drop)

    def on_exit() -> None:
        _kill_group(proc)
        if uid is not None:
            kill_uid_processes(uid)

    with proc:
        out, err, timed_out, limited = _collect_output(
            proc, start + config.timeout_s, config.max_output_bytes, on_exit)
        _kill_group(proc)
        returncode = proc.wait()
    if isolation == "namespaces":
        returncode = _signal_from_init_status(returncode)
    return SandboxOutcome(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                          returncode, timed_out, limited, time.monotonic() - start,
                          isolation, uid)


_FATAL_SIGNALS = {int(s) for s in (signal.SIGXCPU, signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT,
                                   signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTERM,
                                   signal.SIGXFSZ)}


def _signal_from_init_status(returncode: int) -> int:
    """The namespace init reports a child killed by signal N as exit status 128 + N; map it back
    to -N like subprocess does (a program that itself exits with such a status reads the same)."""
    if returncode > 128 and returncode - 128 in _FATAL_SIGNALS:
        return -(returncode - 128)
    return returncode
