"""Running untrusted, model-written Python in a sandbox that sees nothing of the host (Linux).

Each run (:func:`run_python`) is one ``bwrap`` invocation, ``isolation="bwrap"``, the default,
and never less than configured: a host that cannot give it raises
:class:`IsolationUnavailable` (trusted code may opt out with ``isolation="none"``). One file per
mechanism, each saying what it guarantees:
- :mod:`.host`: which bwrap binary, and why a host refuses its namespaces;
- :mod:`.bwrap`: the bwrap command line: namespaces, capabilities, the read-only filesystem;
- :mod:`.layout`: what of the host the interpreter needs (its trees, the libraries it maps);
- :mod:`.scratch`: the one writable tmpfs, with its size and (as root) file caps;
- :mod:`.seccomp`: the syscall filter (no new namespaces, mounts, ptrace, keyring, bpf, SysV
  shared memory, memory files, inotify, flock, io_uring, sockets but unix/inet...);
- :mod:`.child`: the bootstrap run before the code: interpreter flags, scrubbed environment,
  rlimits, the switch to the sandbox uid;
- :mod:`.uids`: one sandbox uid per run as root, and killing/removing what it left;
- :mod:`.cgroups`: per-sandbox memory and pids caps (cgroup v2);
- :mod:`.process`: starting the command, the wall-clock timeout and output cap;
- :mod:`.run`: one run, start to clean-up, under an isolation already checked;
- :mod:`.isolation`: the probe that refuses to start without the isolation (no silent
  downgrade), and the log line of what a run gets.
Kernel exploits are out of scope. The user's view: docs/sandbox.md.
"""
from __future__ import annotations

from aepo_engine.tools.config import PythonConfig
from aepo_engine.tools.sandbox.bwrap import (MASKED_FILES, SANDBOX_DEVICES, SANDBOX_HOSTNAME,
                                             SANDBOX_WORKDIR, bwrap_command, filesystem_args)
from aepo_engine.tools.sandbox.cgroups import CgroupScope, cgroup_problem, check_cgroup
from aepo_engine.tools.sandbox.child import SAFE_PATH, sandbox_interpreter, world_executable
from aepo_engine.tools.sandbox.host import IsolationUnavailable
from aepo_engine.tools.sandbox.isolation import (bwrap_problem, check_isolation, describe_limits,
                                                 isolation_problem, worst_case_mib)
from aepo_engine.tools.sandbox.layout import InterpreterLayout, interpreter_layout, link_chain
from aepo_engine.tools.sandbox.process import SandboxOutcome
from aepo_engine.tools.sandbox.run import run_under
from aepo_engine.tools.sandbox.seccomp import seccomp_filter, seccomp_problem
from aepo_engine.tools.sandbox.uids import (WORLD_WRITABLE_DIRS, UidLease, kill_uid_processes,
                                            remove_uid_files)

__all__ = ["MASKED_FILES", "SAFE_PATH", "SANDBOX_DEVICES", "SANDBOX_HOSTNAME", "SANDBOX_WORKDIR", "WORLD_WRITABLE_DIRS", "CgroupScope",
           "InterpreterLayout", "IsolationUnavailable", "SandboxOutcome", "UidLease", "bwrap_command",
           "bwrap_problem", "cgroup_problem", "check_cgroup", "check_isolation", "describe_limits",
           "filesystem_args", "interpreter_layout", "isolation_problem", "kill_uid_processes", "link_chain",
           "remove_uid_files", "run_python", "sandbox_interpreter", "seccomp_filter",
           "seccomp_problem", "world_executable", "worst_case_mib"]


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
    return run_under(code, config, check_isolation(config))
