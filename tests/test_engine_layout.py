"""Engine layout and vLLM engine options from the config: which ranks host an engine, which
prompts each samples, which GPUs it gets, and that every option reaches ``vllm.LLM``."""
from __future__ import annotations

import pytest

from aepo_engine.rollout import backends
from aepo_engine.rollout.backends import BackendConfig, engine_devices, engine_layout


def test_one_engine_per_rank_by_default():
    layouts = [engine_layout(1, r, 4, r % 2, 2) for r in range(4)]
    assert all(l.host and l.hosts == (0, 1, 2, 3) and l.share == r for r, l in enumerate(layouts))
    # prompt i goes to engine i % 4: every prompt exactly once
    shares = [l.prompts(10) for l in layouts]
    assert shares == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


def test_tensor_parallel_groups_host_one_engine_each():
    # 2 nodes x 4 ranks, TP 2: groups {0,1} {2,3} {4,5} {6,7}; hosts 0, 2, 4, 6
    layouts = [engine_layout(2, r, 8, r % 4, 4) for r in range(8)]
    assert layouts[0].hosts == (0, 2, 4, 6) and layouts[0].engines == 4
    assert [l.host for l in layouts] == [True, False] * 4
    assert [l.share for l in layouts] == [0, None, 1, None, 2, None, 3, None]
    assert layouts[2].prompts(9) == [1, 5] and layouts[3].prompts(9) == []
    covered = sorted(i for l in layouts for i in l.prompts(9))
    assert covered == list(range(9))
    # one engine per node: TP = ranks per node
    per_node = [engine_layout(4, r, 8, r % 4, 4) for r in range(8)]
    assert per_node[0].hosts == (0, 4) and per_node[5].share is None and per_node[4].share == 1


def test_layouts_that_cannot_work_say_why():
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the 4 ranks"):
        engine_layout(3, 0, 4, 0, 4)
    with pytest.raises(ValueError, match="not a multiple of the 4 ranks per node"):
        engine_layout(1, 0, 6, 0, 4)


def test_backend_config_rejects_bad_options():
    with pytest.raises(ValueError, match="needs kind='vllm'"):
        BackendConfig(kind="hf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        BackendConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        BackendConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_gib must be > 0"):
        BackendConfig(kv_cache_gib=0.0)


def test_engine_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_devices(2, 2) == "2,3" and engine_devices(1, 5) == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert engine_devices(2, 2) == "6,7"


def test_build_backend_passes_every_engine_option(monkeypatch):
    """The mapping from the config section to VLLMBackend's arguments (the real engine takes
    them in tests/test_backends_vllm.py)."""
    import aepo_engine.rollout.backends.vllm as vllm_backend

    seen = {}

    class Recorder:
        def __init__(self, model_dir, **kwargs):
            seen.update(kwargs, model_dir=model_dir)

    monkeypatch.setattr(vllm_backend, "VLLMBackend", Recorder)
    cfg = BackendConfig(kind="vllm", tensor_parallel_size=2, dtype="bfloat16", enforce_eager=False,
                        max_num_seqs=32, kv_cache_gib=1.5, enable_prefix_caching=False, max_model_len=4096)
    backends.build_backend(cfg, "/m", None, seed=3, local_rank=2)
    assert seen["tensor_parallel_size"] == 2 and seen["dtype"] == "bfloat16"
    assert seen["enforce_eager"] is False and seen["max_num_seqs"] == 32
    assert seen["kv_cache_memory_bytes"] == int(1.5 * 2**30)
    assert seen["enable_prefix_caching"] is False and seen["max_model_len"] == 4096 and seen["seed"] == 3
    seen.clear()
    backends.build_backend(BackendConfig(kind="vllm"), "/m", None, seed=0)
    assert "max_num_seqs" not in seen and "kv_cache_memory_bytes" not in seen  # vLLM's defaults
    assert seen["enforce_eager"] is None  # resolved by the backend: eager on CPU only


def test_build_backend_hf_prefix_store_from_the_config(tmp_path):
    """The HF backend's prefix store follows enable_prefix_caching and kv_cache_gib."""
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.rollout.backends.hf import HFBackend

    model_dir = build_tiny_qwen3(tmp_path / "m", seed=0)
    default = backends.build_backend(BackendConfig(kind="hf", device="cpu"), model_dir, None, seed=0)
    assert isinstance(default, HFBackend)
    assert default.prefix_store.max_bytes == HFBackend(default.model, default.tokenizer).prefix_store.max_bytes > 0
    sized = backends.build_backend(BackendConfig(kind="hf", device="cpu", kv_cache_gib=0.25), model_dir, None, seed=0)
    assert sized.prefix_store.max_bytes == 2**28
    off = backends.build_backend(BackendConfig(kind="hf", device="cpu", enable_prefix_caching=False,
                                               kv_cache_gib=0.25), model_dir, None, seed=0)
    assert off.prefix_store.max_bytes == 0
