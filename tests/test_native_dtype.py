"""``"bfloat16_if_native"`` (aepo_engine/native_dtype.py): bf16 on CUDA and on a CPU with AMX or
AVX512-BF16, float32 on other CPUs; resolved once per run, recorded in what the run writes."""
from __future__ import annotations

import pytest
import torch

from aepo_engine import native_dtype as nd
from aepo_engine.config import TrainConfig, load_train_config


@pytest.fixture
def cpu_features(monkeypatch):
    """Set which native bf16 features the CPU reports."""
    def set_features(amx: bool, avx512_bf16: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    return set_features


@pytest.mark.parametrize("amx,avx512_bf16,cpu_dtype", [(False, False, "float32"), (True, False, "bfloat16"),
                                                        (False, True, "bfloat16"), (True, True, "bfloat16")])
def test_the_rule(cpu_features, amx, avx512_bf16, cpu_dtype):
    cpu_features(amx, avx512_bf16)
    assert nd.cpu_multiplies_bfloat16() == (cpu_dtype == "bfloat16")
    assert nd.native_dtype(nd.NATIVE_BF16, "cpu") == cpu_dtype
    assert nd.native_dtype(nd.NATIVE_BF16, "cuda") == "bfloat16"
    for name in ("float32", "bfloat16", "auto", "float16"):  # other names pass through
        assert nd.native_dtype(name, "cpu") == name


def test_a_torch_without_the_feature_checks_is_a_cpu_without_them(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    assert not nd.cpu_multiplies_bfloat16()


@pytest.mark.parametrize("native", [False, True])
def test_the_smollm2_preset_resolves_all_three_fields(cpu_features, native):
    cpu_features(native, False)
    cfg = load_train_config(["--preset", "smollm2"])
    assert (cfg.backend.dtype, cfg.policy.param_dtype, cfg.task.warm_start.compute_dtype) == (nd.NATIVE_BF16,) * 3
    resolved = nd.resolve_train_dtypes(cfg, "cpu")
    want = "bfloat16" if native else "float32"
    assert (resolved.backend.dtype, resolved.policy.param_dtype, resolved.task.warm_start.compute_dtype) == (want,) * 3
    # nothing else changes; a config without the value comes back as the same object
    assert resolved.optim == cfg.optim and resolved.rollout == cfg.rollout and resolved.model == cfg.model
    assert nd.resolve_train_dtypes(resolved, "cpu") is resolved
    default = TrainConfig()
    assert nd.resolve_train_dtypes(default, "cpu") is default


def test_the_dry_run_names_the_dtype_this_cpu_runs_and_a_gpu_plan_runs_bf16(cpu_features, capsys):
    """The config printed keeps the value (it loads back and resolves where it runs); the report
    names what it resolves to, and the plans use that."""
    from aepo_engine.dry_run import dry_run

    cpu_features(False, False)
    cfg = load_train_config(["--preset", "smollm2", "--model.path="])  # no model to read: the config alone
    dry_run(cfg)
    printed = capsys.readouterr()
    assert f'param_dtype = "{nd.NATIVE_BF16}"' in printed.out
    assert f"dtype: {nd.NATIVE_BF16} is float32 on this CPU" in printed.err
    dry_run(cfg, gpu="h100-80gb", world_size="1")
    printed = capsys.readouterr()
    assert f"dtype: {nd.NATIVE_BF16} is bfloat16 on a GPU" in printed.err
    cpu_features(True, False)
    dry_run(cfg)
    assert f"dtype: {nd.NATIVE_BF16} is bfloat16 on this CPU" in capsys.readouterr().err


def test_the_update_computes_in_the_resolved_dtype(cpu_features, tmp_path):
    """A tiny policy under ``bfloat16_if_native``: the update autocasts to bf16 only where the CPU has it."""
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.training.config import OptimConfig, PolicyConfig
    from aepo_engine.training.policy import PolicyWorker

    model_dir = build_tiny_qwen3(tmp_path / "tiny")
    for native in (False, True):
        cpu_features(native, False)
        worker = PolicyWorker(model_dir, PolicyConfig(param_dtype=nd.NATIVE_BF16, fsdp="off"), OptimConfig(),
                              total_steps=1)
        with worker._autocast():
            on = torch.is_autocast_enabled("cpu")
            dtype = torch.get_autocast_dtype("cpu")
        assert on == native and (not native or dtype == torch.bfloat16)
