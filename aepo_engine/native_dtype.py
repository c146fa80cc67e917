"""``"bfloat16_if_native"``: bfloat16 where the device multiplies it natively, float32 elsewhere.

A CPU preset picks bfloat16 for speed, and that choice is only right on some CPUs. Where the CPU
has AMX tiles or AVX512-BF16 (oneDNN's bf16 GEMM), a bf16 matmul takes ~4x less CPU time than a
float32 one (the smollm2 preset's measurement). Where it has neither, torch falls back to a scalar
bf16 GEMM: on a 2-core AVX2-only AMD EPYC VM (torch 2.13, 2026-12-07) a [512, 1024] x [1024, 1024]
matmul ran at 0.8 GFLOP/s in bf16 against 54 GFLOP/s in float32, 64x slower. The value
``"bfloat16_if_native"`` of ``backend.dtype``, ``policy.param_dtype`` and
``task.warm_start.compute_dtype`` asks for bfloat16 where it is fast (CUDA, or such a CPU) and
float32 elsewhere; :func:`resolve_train_dtypes` replaces it once, when a run starts, so the run's
``config.toml`` records the dtype that ran (and a resumed run keeps it on any machine).
"""
from __future__ import annotations

import msgspec

NATIVE_BF16 = "bfloat16_if_native"


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU has a native bfloat16 dot product (AMX tiles or AVX512-BF16): torch's bf16
    matmuls then run oneDNN's bf16 kernels. Without them (AVX2, or AVX-512 without its BF16
    extension) a bf16 matmul is at best float32's speed and on AVX2 many times slower."""
    import torch

    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def native_dtype(name: str, device_type: str) -> str:
    """``name`` with ``"bfloat16_if_native"`` replaced by ``"bfloat16"`` on CUDA and on a CPU with a
    native bf16 dot product (:func:`cpu_multiplies_bfloat16`), ``"float32"`` on other CPUs; any other
    name as given."""
    if name != NATIVE_BF16:
        return name
    return "bfloat16" if device_type == "cuda" or cpu_multiplies_bfloat16() else "float32"


def resolve_train_dtypes(cfg, device_type: str):
    """``cfg`` (a :class:`~aepo_engine.config.TrainConfig`) with every ``"bfloat16_if_native"``
    replaced for ``device_type`` (:func:`native_dtype`): the engine's, the update's and the warm
    start's dtype."""
    replace = msgspec.structs.replace
    backend = replace(cfg.backend, dtype=native_dtype(cfg.backend.dtype, device_type))
    policy = replace(cfg.policy, param_dtype=native_dtype(cfg.policy.param_dtype, device_type))
    warm_start = replace(cfg.task.warm_start,
                         compute_dtype=native_dtype(cfg.task.warm_start.compute_dtype, device_type))
    task = replace(cfg.task, warm_start=warm_start)
    if (backend, policy, task) == (cfg.backend, cfg.policy, cfg.task):
        return cfg
    return replace(cfg, backend=backend, policy=policy, task=task)
