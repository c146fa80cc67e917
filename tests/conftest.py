"""Shared test set-up.

Triton kernels run on CPU tensors in interpreter mode; the variable must be set before any
``@triton.jit`` function is decorated, i.e. before ``aepo_kernels.triton_kernels`` is imported.
"""
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"


@pytest.fixture
def shared_data() -> Path:
    """../shared/data/arpo beside the checkout; tests needing it skip where a clone lacks it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"public benchmark data not found at {SHARED_DATA} (a clone without ../shared)")
    return SHARED_DATA


def vllm_missing() -> str | None:
    """Why ``import vllm`` fails here (None when it works): the skip reason of the vLLM tests."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        return f"import vllm failed: {type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
