"""A ``TorchDispatchMode`` that records the operand dtypes and shapes of every matmul it sees."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_addmm_activation")


class MatmulDtypes(TorchDispatchMode):
    """``records``: ``(op name, [(dtype, shape) of each tensor operand])`` per matmul call (forward
    and backward: the autograd engine runs CPU backward on the calling thread)."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, list[tuple[torch.dtype, tuple[int, ...]]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in MATMULS:
            operands = [(a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            self.records.append((name, operands))
        return func(*args, **(kwargs or {}))

    def fp32_with_dim(self, size: int) -> list:
        """The recorded fp32 matmuls with an operand that has a dimension of ``size`` (e.g. V)."""
        return [r for r in self.records
                if any(dtype == torch.float32 and size in shape for dtype, shape in r[1])]

    def with_dim(self, size: int) -> list:
        return [r for r in self.records if any(size in shape for _, shape in r[1])]
