"""What runs in the sandboxed process before the model's code, and what it is given.

Every run, in both isolation modes, gets:
- an isolated interpreter: ``python -I -S -B`` (no user site, no PYTHON* variables, no
  site-packages unless ``site_packages``; cwd not on ``sys.path``);
- a scrubbed environment: PATH, HOME/TMPDIR (the work dir), LANG and single-thread BLAS/OpenMP
  settings only - nothing of the engine's environment (API keys, tokens) reaches the code;
- resource limits set in the child before the code runs: CPU seconds, address space, file size,
  open files, processes (RLIMIT_NPROC), no core dumps; plus ``no_new_privs``.
The switch to a sandbox uid (see :mod:`.uids`) happens in the bootstrap, before any user code.
"""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from aepo_engine.tools.config import PythonConfig

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"

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


def python_argv(python: str, config: PythonConfig, uid: int | None) -> list[str]:
    """The interpreter command; ``uid`` is the one the bootstrap switches to (None: stay)."""
    flags = ["-I", "-B"] if config.site_packages else ["-I", "-S", "-B"]
    settings = {"uid": uid, "rlimits": _rlimits(config)}
    return [python, *flags, "-c", _BOOTSTRAP, json.dumps(settings), "main.py"]


def sandbox_environment(workdir: str) -> dict[str, str]:
    """The code's whole environment; ``workdir`` as it is seen from inside."""
    # One BLAS/OpenMP thread: threads count against RLIMIT_NPROC and a 64-core machine would
    # otherwise make ``import numpy`` fail under the default nproc.
    single_thread = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                            "MKL_NUM_THREADS")}
    return {"PATH": SAFE_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            **single_thread}

