"""How the CPU paths use ``torch.compile``: compiled, or eager only when asked, never silently.

The CPU fast paths are small chunk functions that inductor turns into fused C++ loops; eager
torch runs the same maths several times slower and with chunk-sized temporaries. A compiler
failure used to fall back to eager with a warning, so a missing C++ compiler showed up only as a
slow run. Now:
- by default each function is compiled (``dynamic=True``: new row counts do not recompile;
  ``fullgraph=True``: a graph break is an error, not a partly eager function) and a compile
  failure raises, naming the cause and the switch below;
- ``AEPO_TORCH_COMPILE=0`` runs eager on purpose (e.g. a machine without a C++ compiler), and
  says so once;
- under a caller's ``TorchDispatchMode`` (``FlopCounterMode``, a memory or dtype recorder) the
  eager function runs: dynamo does not trace under an active mode, and the mode sees every op.
``CompiledFunction.mode`` tells which one ran; tests check that it is ``"compiled"`` on CPU.

Each function legitimately compiles a handful of variants (input dtype fp32 / bf16 / fp64 for
gradchecks, soft cap on or off, expanded per-sequence advantages, size-1 specialisations), more
than dynamo's default limit of 8 per code object, a process-wide guard meant for user code. The
limit is raised to :data:`RECOMPILE_LIMIT` for these functions only, for the calls that compile.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
import torch._dynamo.exc

_EAGER_NOTICE_GIVEN = False
RECOMPILE_LIMIT = 64


def compile_enabled() -> bool:
    return os.environ.get("AEPO_TORCH_COMPILE", "1") != "0"


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
        global _EAGER_NOTICE_GIVEN
        if compile_enabled():
            self.impl, self.mode = torch.compile(self.fn, dynamic=True, fullgraph=True), "compiled"
            return
        if not _EAGER_NOTICE_GIVEN:
            warnings.warn("aepo_kernels: AEPO_TORCH_COMPILE=0, the CPU kernels run in eager torch (slower)")
            _EAGER_NOTICE_GIVEN = True
        self.impl, self.mode = self.fn, "eager"


def _in_dispatch_mode() -> bool:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    return is_in_torch_dispatch_mode()


def compiled(fn: Callable) -> CompiledFunction:
    """Decorator form of :class:`CompiledFunction`."""
    return CompiledFunction(fn)
