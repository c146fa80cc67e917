"""torch.distributed helpers, in one place: join the torchrun group, rank queries, barrier,
broadcast and all-gather of Python objects.

Every helper is a no-op (or the identity) in a single process without a process group, so the
same code runs plain, under torchrun with gloo on CPU and with nccl on CUDA.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_objects", "barrier", "broadcast_object", "init_distributed", "is_initialized",
           "is_main", "local_rank", "local_world_size", "rank", "world_size"]


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun process group if launched by torchrun; return ``(rank, world, device)``."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    if not dist.is_initialized():
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


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


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (``[value]`` in a single process)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
