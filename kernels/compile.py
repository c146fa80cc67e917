"""How the CPU paths use ``torch.compile``: compiled, or eager when asked or when no compiler is
here, never silently.

The CPU fast paths are small chunk functions that inductor turns into fused C++ loops; eager
torch runs the same maths several times slower and with chunk-sized temporaries. A compiler
failure used to fall back to eager with a warning, so a missing C++ compiler showed up only as a
slow run. Now:
- by default each function is compiled (``dynamic=True``: new row counts do not recompile;
  ``fullgraph=True``: a graph break is an error, not a partly eager function) and a compile
  failure raises, naming the cause and the switch below;
- a machine without the C++ compiler inductor uses (``$CXX``, else ``g++``; e.g. the
  ``python:3.11-slim`` image) runs eager and says so once, with what it costs
  (:func:`toolchain_notice`); so does one without the C compiler of the native row kernel
  (:mod:`aepo_kernels.native`), which then leaves the fp32 loss to the compiled path;
- ``AEPO_TORCH_COMPILE=0`` runs eager on purpose, and says so once;
- under a caller's ``TorchDispatchMode`` (``FlopCounterMode``, a memory or dtype recorder) the
  eager function runs: dynamo does not trace under an active mode, and the mode sees every op.
``CompiledFunction.mode`` tells which one ran; tests check that it is ``"compiled"`` on CPU.

Each function legitimately compiles a handful of variants (input dtype fp32 / bf16 / fp64 for
gradchecks, soft cap on or off, expanded per-sequence advantages, size-1 specialisations), more
than dynamo's default limit of 8 per code object, a process-wide guard meant for user code. The
limit is raised to :data:`RECOMPILE_LIMIT` for these functions only, for the calls that compile.
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import warnings
from typing import Callable

import torch
import torch._dynamo.exc

_NOTICE_GIVEN = False
RECOMPILE_LIMIT = 64


@functools.lru_cache(maxsize=None)
def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would run (``torch._inductor.config.cpp.cxx``:
    ``$CXX``, else ``g++``) when it is on PATH, else None."""
    from torch._inductor import config as inductor_config

    names = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, (list, tuple)) \
        else (inductor_config.cpp.cxx,)
    for name in names:
        if name and shutil.which(shlex.split(name)[0]):
            return name
    return None


@functools.lru_cache(maxsize=None)
def c_compiler() -> str | None:
    """The C compiler of the native row kernel (``$CC``, else ``cc``) when it is on PATH, else None."""
    command = os.environ.get("CC") or "cc"
    return command if shutil.which(shlex.split(command)[0]) else None


def compile_enabled() -> bool:
    """Whether the CPU chunk functions are compiled: not with ``AEPO_TORCH_COMPILE=0``, and not
    without a C++ compiler (then eager, with :func:`toolchain_notice`)."""
    return os.environ.get("AEPO_TORCH_COMPILE", "1") != "0" and cxx_compiler() is not None


def toolchain_notice() -> str | None:
    """What runs slower here and why, in one line, or None when every CPU path runs at speed.

    Eager chunks instead of compiled ones make the fused loss several times slower at large
    vocabularies; without the native kernel the fp32 one-pass loss takes the compiled path
    instead. The figures, with dates and machines: docs/benchmarks.md, "Without a compiler".
    """
    missing = []
    if os.environ.get("AEPO_TORCH_COMPILE", "1") == "0":
        missing.append("AEPO_TORCH_COMPILE=0 is set: the CPU loss kernels run in eager torch, several "
                       "times slower than compiled at large vocabularies")
    elif cxx_compiler() is None:
        missing.append("no C++ compiler (g++, or $CXX) on PATH: the CPU loss kernels run in eager torch "
                       "instead of compiled, several times slower at large vocabularies")
    if os.environ.get("AEPO_CPU_NATIVE", "1") != "0" and c_compiler() is None:
        missing.append("no C compiler (cc, or $CC) on PATH: the native fp32 loss kernel is off, the "
                       + ("compiled" if compile_enabled() else "eager") + " torch path runs instead")
    if not missing:
        return None
    return ("aepo_kernels: " + "; ".join(missing) + ". The same maths (equal up to float rounding). Install gcc and g++ "
            "(e.g. `apt-get install gcc g++`) for the fast paths; figures in docs/benchmarks.md")


def give_toolchain_notice(emit: Callable[[str], None] | None = None) -> None:
    """Emit :func:`toolchain_notice` once per process (``emit``: a logger; default: a warning).
    The trainer calls it at start; the kernels call it on first use otherwise."""
    global _NOTICE_GIVEN
    if _NOTICE_GIVEN:
        return
    _NOTICE_GIVEN = True
    notice = toolchain_notice()
    if notice:
        if emit is None:
            warnings.warn(notice, stacklevel=3)
        else:
            emit(notice)


class CompiledFunction:
    """``fn`` under ``torch.compile(dynamic=True, fullgraph=True)``, or eager by explicit opt-out."""

    def __init__(self, fn: Callable):
        self.fn, self.impl, self.mode = fn, None, None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        # Detached views (same storage and version counter): these are autograd-free kernels, and
        # a requires_grad flag on an argument would only add a guard and a recompile.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        if self.impl is None:
            self._choose()
        if self.mode == "eager" or _in_dispatch_mode():
            # under a caller's TorchDispatchMode (FlopCounterMode, memory or dtype recorders)
            # dynamo captures no frame; the eager function gives the mode every op to see
            return self.fn(*args)
        try:
            try:
                return self.impl(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                # A new variant past dynamo's default limit: compile it under this module's limit
                # (only calls that compile pay for the patch; later calls hit the cache).
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return self.impl(*args)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
            # compiler failures and graph breaks
            raise RuntimeError(
                f"aepo_kernels: torch.compile of {self.__name__} failed ({type(exc).__name__}: {str(exc)[:300]}). "
                "The CPU path needs a working inductor (a C++ compiler); set AEPO_TORCH_COMPILE=0 "
                "to run it in eager torch instead (same results, several times slower)."
            ) from exc

    def _choose(self) -> None:
        if compile_enabled():
            self.impl, self.mode = torch.compile(self.fn, dynamic=True, fullgraph=True), "compiled"
            return
        give_toolchain_notice()
        self.impl, self.mode = self.fn, "eager"


def _in_dispatch_mode() -> bool:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return is_in_torch_dispatch_mode()


def compiled(fn: Callable) -> CompiledFunction:
    """Decorator form of :class:`CompiledFunction`."""
    return CompiledFunction(fn)
