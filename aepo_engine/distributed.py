"""torch.distributed helpers, in one place: join the torchrun group, rank queries, barrier,
broadcast and all-gather of Python objects.

Every helper is a no-op (or the identity) in a single process without a process group, so the
same code runs plain, under torchrun with gloo on CPU and with nccl on CUDA.

Waiting for other ranks: two waits, two timeouts.
- **Waiting for a slower rank** (the long wait). Ranks sample their own agentic rollouts (tools,
  HTTP search) and rank 0 alone writes checkpoint exports, so a rank may wait long for a slower one
  at the next gather or barrier. Those waits are the Python-object gathers and barriers of this
  module, and they run on a gloo group (host memory, no kernel waiting on a GPU): the default group
  on CPU, a group of their own on CUDA. It gets ``timeout`` (the trainer passes
  ``train.collective_timeout_minutes``, hours); a gather or barrier that gives up raises
  :class:`CollectiveTimeout` naming the setting to raise.
- **Device collectives** (NCCL on CUDA: FSDP2's all-gathers and reduce-scatters, the weight
  sync's gathers). They start only after every rank has passed an object gather (the step's
  rollouts), so none of them waits for a rollout: they keep a short ``device_timeout`` (the
  trainer passes ``train.device_collective_timeout_minutes``; torch's NCCL default is 10 minutes),
  with NCCL's watchdog and its heartbeat monitor as torch sets them, so a hung GPU collective stops
  the run in minutes instead of hours. (Before, NCCL got the long timeout too.)
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from aepo_engine.errors import Unavailable

__all__ = ["CollectiveTimeout", "all_gather_objects", "barrier", "broadcast_object", "collective_timeout",
           "init_distributed", "is_initialized", "run_and_exit", "is_main", "local_rank", "local_world_size", "rank", "world_size"]

# Set by init_distributed: the timeout of every group (None: torch's defaults), the setting that
# holds it (named in CollectiveTimeout), and the gloo group of objects and barriers (None: the default group).
_TIMEOUT: datetime.timedelta | None = None
_TIMEOUT_SETTING = ""
_OBJECT_GROUP: Any = None


class CollectiveTimeout(Unavailable):
    """Ranks waited longer than the collective timeout for each other (a slow rank or a dead one)."""


def init_distributed(timeout: datetime.timedelta | None = None, timeout_setting: str = "",
                     device_timeout: datetime.timedelta | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun process group if launched by torchrun; return ``(rank, world, device)``.

    Args:
        timeout: how long a gather or barrier of Python objects waits for the other ranks (the
            gloo group's; None: torch's default). Only the call that creates the groups sets it.
        timeout_setting: the config field that holds ``timeout``, named when a wait gives up.
        device_timeout: on CUDA, the NCCL group's (device collectives; None: torch's default).
    """
    global _TIMEOUT, _TIMEOUT_SETTING, _OBJECT_GROUP
    cuda = torch.cuda.is_available()
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=device_timeout if cuda else timeout)
        _TIMEOUT, _TIMEOUT_SETTING = timeout, timeout_setting
        if dist.get_backend() != "gloo":  # collective: every rank makes it, in the same order
            _OBJECT_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    if not dist.is_initialized():
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def collective_timeout() -> datetime.timedelta | None:
    """The timeout :func:`init_distributed` gave the gloo group of objects (None: torch's
    default): for the other object groups a caller makes (``dist.new_group(..., backend="gloo",
    timeout=collective_timeout())``)."""
    return _TIMEOUT


def _waiting(what: str, call: Callable[[], Any]) -> Any:
    """``call()``, a collective that waits for the other ranks; a timeout becomes
    :class:`CollectiveTimeout` naming the setting that holds it."""
    try:
        return call()
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
            raise
        minutes = f"{_TIMEOUT.total_seconds() / 60:g} minutes" if _TIMEOUT else "torch's default timeout"
        setting = f"; raise {_TIMEOUT_SETTING} (now {_TIMEOUT.total_seconds() / 60:g})" if _TIMEOUT_SETTING and _TIMEOUT else ""
        raise CollectiveTimeout(f"rank {dist.get_rank()} waited more than {minutes} for the other ranks at "
                                f"{what} (a slower rank's rollouts or checkpoint, or a rank that died){setting} "
                                f"[{type(exc).__name__}: {str(exc).splitlines()[0][:200]}]") from exc


def is_initialized() -> bool:
    """Whether a process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    """This rank's index on its node (torchrun's LOCAL_RANK; 0 in a single process)."""
    return int(os.environ.get("LOCAL_RANK", 0)) if is_initialized() else 0


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 in a single process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size())) if is_initialized() else 1


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes files and prints."""
    return rank() == 0


def barrier(what: str = "a barrier") -> None:
    """Wait for every rank (on the gloo group of objects: a host-side wait)."""
    if is_initialized():
        _waiting(what, lambda: dist.barrier(group=_OBJECT_GROUP))


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not is_initialized():
        return value
    box = [value]
    _waiting("a broadcast", lambda: dist.broadcast_object_list(box, src=0, group=_OBJECT_GROUP))
    return box[0]


def all_gather_objects(value: Any, what: str = "a gather") -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` in a single process).

    Args:
        what: what is gathered, for the :class:`CollectiveTimeout` message.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    _waiting(what, lambda: dist.all_gather_object(out, value, group=_OBJECT_GROUP))
    return out


def run_and_exit(main: Callable[[], Any]) -> NoReturn:
    """Run a command's ``main()`` and end the process with its exit status; a process that joined a
    process group ends without the interpreter's finalization.

    Why: after ``fully_shard`` torch keeps the gloo group's threads (``gloo_tcp_loop``,
    ``pt_gloo_runloop``) running past ``destroy_process_group``; a normal exit then tears the group
    down while the interpreter finalizes, and a rank can abort there with "terminate called without
    an active exception" (SIGABRT) after all its work is done, so torchrun reports a finished run as
    failed (seen in CI on a 2-rank test, once in a few hundred runs; pytorch/pytorch PR 179291, which
    would destroy the groups from an atexit handler, was abandoned). Here the group is destroyed, the
    ``atexit`` handlers run while the interpreter is whole, the standard streams are flushed, and
    ``os._exit`` ends the process. A single process (no group, not one of several torchrun ranks)
    exits as usual, and so does a process that loaded vLLM: its CPU engines' shared-memory
    segments (``/dev/shm/*-cpushm_<rank>``, named the same in every run) are removed by C++
    destructors at a normal exit only, and ``os._exit`` left them behind, so the next run's engine
    group failed to start (``create shm in SHMManager failed. errno: 17``). An exception other
    than ``SystemExit`` (``--debug`` lets them through) propagates as usual.
    """
    status: Any = 0
    try:
        main()
    except SystemExit as exc:
        status = exc.code
    if "vllm" in sys.modules or (not is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) <= 1):
        raise SystemExit(status)
    if status is not None and not isinstance(status, int):  # SystemExit("message"): printed, status 1
        print(status, file=sys.stderr)
        status = 1
    try:
        if is_initialized():
            dist.destroy_process_group()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status or 0)
