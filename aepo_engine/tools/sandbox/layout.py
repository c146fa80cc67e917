"""What of the host an interpreter needs to run, and nothing more: the sandbox's read-only view.

:func:`interpreter_layout` asks the interpreter itself (one subprocess per interpreter and engine
process) and returns an :class:`InterpreterLayout`:
- its install trees (prefix, base prefix, the real executable's directory), bound whole, except
  a tree in ``/usr`` or ``/`` itself (a Debian or Docker system Python: ``/usr``,
  ``/usr/local``, ``/usr/bin``), of which only the executable file and the standard library are
  bound;
- the directories of the shared libraries it maps once it has imported every extension module
  of its standard library (``lib-dynload``): the dynamic loader, libc, libssl, libffi... (on a
  Debian host: ``/usr/lib/x86_64-linux-gnu``), and the locale data it maps;
- the symbolic links on the way to the executable and to its program interpreter (``PT_INTERP``,
  e.g. ``/lib64/ld-linux-x86-64.so.2``), recreated as links;
- every site directory (``site-packages``, ``dist-packages``) of the interpreter, of its base
  installation and any other inside a bound directory, hidden unless ``site_packages``.
Nothing else of ``/usr`` is there: no ``/usr/bin`` (no shell, no system commands), no
``/usr/share`` but the time-zone data, no other Python's packages (Debian's
``/usr/lib/python3/dist-packages``), no host configuration. A package imported with
``site_packages`` that links a library outside these directories does not load.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aepo_engine.tools.sandbox.child import SAFE_PATH

# Trees other software shares: never bound whole (a system Python's prefix, its bin directory).
SHARED_TREES = ("/usr",)
# Data the standard library reads at run time (zoneinfo), bound when present.
RUNTIME_DATA = ("/usr/share/zoneinfo",)
_MAX_LINKS = 40

# Runs in the interpreter (-I): where it lives, its site directories and those of its base
# installation (a venv's python finds its base's too, with --system-site-packages or a sys.path
# edit), and what it maps once every standard extension module is loaded.
_LAYOUT_PROBE = r"""
import importlib, json, os, site, struct, sys, sysconfig
base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
        "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
site_dirs = {*site.getsitepackages(), *site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])}
for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars=base)):
    site_dirs |= {paths["purelib"], paths["platlib"]}
stdlib = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
dynload = os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload")
for name in sorted(os.listdir(dynload)) if os.path.isdir(dynload) else ():
    if name.endswith(".so"):
        try:
            importlib.import_module(name.split(".")[0])
        except Exception:
            pass
mapped = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            mapped.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
interp = None
with open(os.path.realpath(sys.executable), "rb") as exe:
    head = exe.read(64)
    if head[:5] == b"\x7fELF\x02" and head[5] == 1:  # 64-bit little-endian
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        exe.seek(phoff)
        table = exe.read(phentsize * phnum)
        for i in range(phnum):
            kind, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == 3:  # PT_INTERP
                exe.seek(offset)
                interp = exe.read(size).rstrip(b"\0").decode()
print(json.dumps({
    "executable": sys.executable,
    "roots": sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                     os.path.dirname(os.path.realpath(sys.executable))}),
    "site_dirs": sorted(site_dirs),
    "stdlib": sorted(stdlib),
    "mapped": sorted(mapped),
    "interp": interp,
}))
"""


@dataclass(frozen=True)
class InterpreterLayout:
    """Where an interpreter lives and what it needs (module docstring).

    Args:
        executable: the interpreter path (as given; symlinks are recreated on the way).
        roots: its install trees (prefixes, the real executable's directory).
        site_dirs: the site directories of the interpreter and of its base installation.
        binds: host directories and files to bind read-only at their own paths, shortest first,
            none inside another.
        links: ``(path, target)`` of the symbolic links to recreate on the way to the
            executable and to its program interpreter.
        hidden: every site directory inside a bound directory (:func:`site_dirs_within`).
    """

    executable: str
    roots: tuple[str, ...]
    site_dirs: tuple[str, ...]
    binds: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    hidden: tuple[str, ...] = ()


def site_dirs_within(binds: tuple[str, ...], site_dirs: tuple[str, ...]) -> list[str]:
    """Every site directory inside a bound directory: the interpreter's own, and any other
    Python's found there (``python3*/{site,dist}-packages``, ``lib*/python*/...``)."""
    found = {d for d in site_dirs if os.path.isdir(d) and _inside_any(d, binds)}
    for bound in binds:
        if not os.path.isdir(bound):
            continue
        for pattern in ("*-packages", "python*/*-packages", "lib*/python*/*-packages",
                        "local/lib*/python*/*-packages"):
            found |= {d for d in glob.glob(os.path.join(bound, pattern))
                      if d.endswith(("/site-packages", "/dist-packages")) and os.path.isdir(d)}
    return sorted(found)


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or inside it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _shared(root: str) -> bool:
    return root == "/" or _inside_any(root, SHARED_TREES)


def _inside_any(path: str, roots) -> bool:
    return any(under(path, root) for root in roots)


def link_chain(path: str) -> list[tuple[str, str]]:
    """The symbolic links met while resolving ``path``, in order: ``(link path, target)``.

    Args:
        path: an absolute host path.

    Returns:
        Each link as it is stored (a relative target stays relative).
    """
    links: list[tuple[str, str]] = []
    parts, current = list(Path(path).parts[1:]), "/"
    while parts and len(links) <= _MAX_LINKS:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links.append((candidate, target))
            parts = [*Path(target).parts[1 if target.startswith("/") else 0:], *parts]
            current = "/" if target.startswith("/") else current
        else:
            current = candidate
    return links


def _binds(info: dict, site_packages: bool) -> list[str]:
    """The host paths to bind (module docstring), none inside another."""
    wanted: set[str] = set()
    executable = os.path.realpath(info["executable"])
    for root in info["roots"]:
        if _shared(root) or _shared(os.path.realpath(root)):
            wanted.add(executable)
            wanted.update(info["stdlib"])
        else:
            wanted.add(root)
    if site_packages:
        wanted.update(info["site_dirs"])
    # the executable is bound above, on its own or in its tree
    for mapped in info["mapped"]:
        real = os.path.realpath(mapped)
        if real != executable and os.path.isfile(real) and not real.startswith(("/proc/", "/dev/", "/sys/")):
            wanted.add(os.path.dirname(real))
    wanted.update(RUNTIME_DATA)
    binds: list[str] = []
    for path in sorted((p for p in wanted if os.path.exists(p)), key=len):
        if not _inside_any(path, binds):
            binds.append(path)
    return binds


@functools.lru_cache(maxsize=None)
def interpreter_layout(python: str, site_packages: bool = False) -> InterpreterLayout:
    """Ask ``python`` where it lives and what it maps (once per interpreter and process).

    Args:
        python: the interpreter path.
        site_packages: its site directories are bound too (else hidden where a bind holds them).

    Raises:
        RuntimeError: when ``python`` does not run.
    """
    try:
        proc = subprocess.run([python, "-I", "-c", _LAYOUT_PROBE], capture_output=True,
                              text=True, timeout=60, env={"PATH": SAFE_PATH}, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the sandbox interpreter {python!r} does not run: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"the sandbox interpreter {python!r} failed: {proc.stderr[-300:]}")
    info = json.loads(proc.stdout)
    binds = _binds(info, site_packages)
    links = {}
    for path in (info["executable"], info["interp"]):
        for link, target in link_chain(path) if path else ():
            if not _inside_any(link, binds):
                links[link] = target
    site_dirs = tuple(info["site_dirs"])
    return InterpreterLayout(python, tuple(info["roots"]), site_dirs, tuple(binds),
                             tuple(sorted(links.items())), tuple(site_dirs_within(tuple(binds), site_dirs)))
