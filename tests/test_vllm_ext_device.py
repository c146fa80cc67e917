"""The weight-push RPCs run on the worker's device (issue 35, point 7).

vLLM's layer-wise reload materialises each layer on a device it records; where a vLLM version
records the ambient default device, a push run outside ``with torch.device(...)`` (CPU) sends
every layer GPU -> CPU -> GPU on every step. vLLM's own update RPCs set the device; each of ours
does too. A recording fake worker (``device`` cuda:1, which the context manager sets without a
GPU) and recording fakes of vLLM's config context and reload functions note the default device
inside every call the extension makes. Skipped where ``import vllm`` fails.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import vllm_missing

from aepo_engine.rollout.backends.vllm_ext import WeightLoaderExtension, encode_bucket

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))

DEVICE = torch.device("cuda", 1)


class Model:
    def __init__(self, seen):
        self.seen = seen

    def load_weights(self, weights):
        names = [name for name, _ in weights]
        self.seen.append(("load_weights", names, torch.get_default_device()))


class Runner:
    device = torch.device("cpu")  # what vLLM's GPU worker holds is its own ``device``: the worker's wins

    def __init__(self, seen):
        self.model, self.seen = Model(seen), seen

    def get_model(self):
        return self.model

    def reset_mm_cache(self):
        self.seen.append(("reset_mm_cache", None, torch.get_default_device()))


class Worker(WeightLoaderExtension):
    device = DEVICE

    def __init__(self, seen):
        self.model_runner, self.seen = Runner(seen), seen
        self.vllm_config = type("VllmConfig", (), {"model_config": "model-config"})()


def test_every_push_rpc_runs_under_the_workers_device(monkeypatch):
    import vllm.config
    from vllm.model_executor.model_loader.reload import layerwise

    seen: list = []

    @contextlib.contextmanager
    def current_config(config):
        seen.append(("config", None, torch.get_default_device()))
        yield

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", current_config)
    monkeypatch.setattr(layerwise, "initialize_layerwise_reload",
                        lambda model: seen.append(("initialize", None, torch.get_default_device())))
    monkeypatch.setattr(layerwise, "finalize_layerwise_reload",
                        lambda model, config: seen.append(("finalize", config, torch.get_default_device())))
    worker = Worker(seen)
    worker.aepo_begin_weight_update()
    worker.aepo_load_weight_tensors({"a.weight": torch.ones(2)})
    worker.aepo_load_weight_bucket(encode_bucket({"b.weight": torch.zeros(3, dtype=torch.bfloat16)}))
    worker.aepo_finish_weight_update()

    calls = [(name, arg) for name, arg, _ in seen if name != "config"]
    assert calls == [("initialize", None), ("load_weights", ["a.weight"]), ("load_weights", ["b.weight"]),
                     ("finalize", "model-config"), ("reset_mm_cache", None)]
    assert sum(name == "config" for name, _, _ in seen) == 4  # vLLM's config current in each RPC
    assert [device for name, _, device in seen if name not in ("config", "reset_mm_cache")] == [DEVICE] * 4
    assert torch.get_default_device() == torch.device("cpu")  # restored after each call
