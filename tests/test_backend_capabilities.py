"""Backends declare their capabilities per instance, and are built by registered name.

- the HF backend on a tiny Qwen3: abort and exact entropies always, prefix reuse unless its store
  is off (``prefix_cache_gib=0``, ``backend.enable_prefix_caching=false``), LoRA when built with it;
- the registry: an unknown kind is refused with the registered names, a third backend registered
  by name is built from the config, and ``build_backend`` refuses one that lacks a capability the
  run relies on;
- ``RemoteEngine`` reports its rollout process's engine's capabilities (less the ones whose methods
  it does not have), with a stand-in process and with a real one (slow);
- vLLM-CPU (slow, a subprocess: this file run as a script): abort, estimated entropies, prefix
  caching as the engine reports it, LoRA when built with it.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import vllm_missing

from aepo_engine.models import build_tiny_qwen3
from aepo_engine.models.config import LoraConfig
from aepo_engine.rollout.backends import BackendConfig, backend_names, build_backend, register_backend, registry
from aepo_engine.rollout.backends.hf import HFBackend
from aepo_engine.rollout.protocol import Capabilities, requires

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("caps") / "model", seed=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFBackend(model_dir)


def test_hf_backend_declares_abort_exact_entropy_and_prefix_reuse(hf):
    assert hf.capabilities == Capabilities(abort=True, exact_entropy=True, prefix_reuse=True)
    assert hf.entropy_is_exact is True and hf.can_abort is True  # the older names, read from it
    with pytest.raises(AttributeError):
        hf.can_abort = False  # read-only: capabilities are the one record


def test_hf_backend_reports_what_it_was_built_with(hf, model_dir):
    assert HFBackend(hf.model, hf.tokenizer, prefix_cache_gib=0).capabilities.prefix_reuse is False
    adapted = HFBackend(model_dir, lora=LORA)
    assert adapted.capabilities == Capabilities(abort=True, exact_entropy=True, prefix_reuse=True, lora=True)
    assert HFBackend(model_dir, lora=LoraConfig(enabled=False)).capabilities.lora is False
    off = build_backend(BackendConfig(kind="hf", device="cpu", enable_prefix_caching=False), model_dir, None, seed=0)
    assert off.capabilities == Capabilities(abort=True, exact_entropy=True)
    assert build_backend(BackendConfig(kind="hf", device="cpu"), model_dir, None, seed=0, lora=LORA).capabilities.lora


def test_requires_names_the_missing_capability_and_why(hf):
    requires(hf, "abort", "exact_entropy", why="unused")
    with pytest.raises(ValueError, match=r"HFBackend backend lacks the sleep, lora capabilities .*: the update"):
        requires(hf, "abort", "sleep", "lora", why="the update needs them")
    with pytest.raises(ValueError, match=r"no backend capability \['teleport'\]"):
        requires(hf, "teleport", why="")


# -- the registry -------------------------------------------------------------------------------------

@pytest.fixture
def own_registry(monkeypatch):
    """The registry as it is, restored after the test (which may register backends)."""
    monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))


class _Echo:
    """A third backend's stand-in (built here, never sampled from): what it was built with."""

    def __init__(self, capabilities: Capabilities, **built_with):
        self.capabilities, self.built_with = capabilities, built_with
        self.tokenizer, self.weight_dtype, self.eos_token_ids = None, None, ()


def test_an_unknown_kind_is_refused_with_the_registered_names():
    assert {"hf", "vllm"} <= set(backend_names())
    with pytest.raises(ValueError, match="backend kind 'nope' is not registered: expected one of 'hf', 'vllm'"):
        BackendConfig(kind="nope")
    with pytest.raises(ValueError, match="expected one of 'hf', 'vllm'"):
        registry.backend_builder("nope")


def test_a_registered_backend_is_built_by_name_from_the_config(own_registry):
    @register_backend("echo")
    def build_echo(cfg, model_dir, tokenizer, *, seed, local_rank, group, lora):
        return _Echo(Capabilities(lora=lora is not None), model_dir=model_dir, seed=seed, kind=cfg.kind)

    assert "echo" in backend_names()
    from aepo_engine.config import load_train_config

    cfg = load_train_config(["--backend.kind=echo"]).backend
    backend = build_backend(cfg, "/m", None, seed=7, lora=LORA)
    assert isinstance(backend, _Echo) and backend.built_with == {"model_dir": "/m", "seed": 7, "kind": "echo"}
    assert register_backend("echo")(build_echo) is build_echo  # the same builder again: no change
    with pytest.raises(ValueError, match="backend 'echo' is already registered"):
        register_backend("echo")(lambda *args, **kwargs: None)


def test_build_backend_refuses_a_backend_without_what_the_run_relies_on(own_registry):
    register_backend("plain")(lambda cfg, *args, **kwargs: _Echo(Capabilities()))
    cfg = BackendConfig(kind="plain")
    assert build_backend(cfg, "/m", None, seed=0).capabilities == Capabilities()
    with pytest.raises(ValueError, match="lacks the lora capability .*policy.lora is enabled"):
        build_backend(cfg, "/m", None, seed=0, lora=LORA)
    with pytest.raises(ValueError, match="lacks the group capability"):
        build_backend(cfg, "/m", None, seed=0, group=object())
    with pytest.raises(ValueError, match="lacks the sleep capability"):
        build_backend(BackendConfig(kind="plain", sleep_between_steps=True), "/m", None, seed=0)


# -- the rollout process's engine ----------------------------------------------------------------------

def test_remote_engine_reports_its_engines_capabilities():
    from aepo_engine.asynchronous.client import RemoteEngine
    from aepo_engine.asynchronous.messages import Ready

    everything = Capabilities(**{f.name: True for f in dataclasses.fields(Capabilities)})
    process = SimpleNamespace(ready=Ready(1, torch.bfloat16, capabilities=everything, eos_token_ids=(2,)),
                              weight_dtype=torch.bfloat16)
    remote = RemoteEngine(process, tokenizer=None)
    # abort, sleep and group name methods of the engine that the rollout process calls, not this handle
    assert remote.capabilities == Capabilities(exact_entropy=True, prefix_reuse=True, lora=True)
    assert remote.entropy_is_exact is True and remote.can_abort is False
    assert remote.weight_dtype == torch.bfloat16 and remote.eos_token_ids == (2,)
    estimated = SimpleNamespace(ready=Ready(1, capabilities=Capabilities(abort=True)), weight_dtype=None)
    assert RemoteEngine(estimated, tokenizer=None).capabilities == Capabilities()


@pytest.mark.slow
def test_a_rollout_process_sends_its_engines_capabilities(tmp_path):
    from aepo_engine.asynchronous.client import RemoteEngine, RolloutProcess
    from aepo_engine.asynchronous.worker import WorkerSpec
    from aepo_engine.config import load_train_config

    model_dir = build_tiny_qwen3(tmp_path / "m", seed=0, hidden_size=64, num_layers=1, head_dim=32, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64, vocab_size=200)
    cfg = load_train_config(["--preset", "embedded", "--preset", "tiny", "--tools.enabled=[]",
                             "--backend.enable_prefix_caching=false"])
    spec = WorkerSpec(backend=cfg.backend, rollout=cfg.rollout, tools=cfg.tools, model_dir=str(model_dir),
                      engine_seed=0, seed=0, threads=1, lora=LORA)
    with RolloutProcess(spec) as process:
        sent = process.ready.capabilities
        remote = RemoteEngine(process, tokenizer=None)
    assert sent == Capabilities(abort=True, exact_entropy=True, lora=True)
    assert remote.capabilities == Capabilities(exact_entropy=True, lora=True)


# -- vLLM-CPU -------------------------------------------------------------------------------------------

def _vllm_scenarios(model_dir: str) -> dict:
    """In process with the defaults; then, in processes of its own through ``build_backend``, with
    prefix caching off and LoRA on."""
    from aepo_engine.rollout.backends.vllm import VLLMBackend

    def describe(backend) -> dict:
        return dict(capabilities=dataclasses.asdict(backend.capabilities), entropy_is_exact=backend.entropy_is_exact,
                    can_abort=backend.can_abort)

    report = {"default": describe(VLLMBackend(model_dir, seed=0, max_model_len=256, dtype="float32", in_process=True))}
    cfg = BackendConfig(kind="vllm", max_model_len=256, dtype="float32", enable_prefix_caching=False, in_process=False)
    report["configured"] = describe(build_backend(cfg, model_dir, None, seed=0, lora=LORA))
    return report


@pytest.mark.slow  # two vLLM engines start (~20 s each on CPU)
@pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
def test_vllm_backend_declares_what_it_was_built_with(tmp_path):
    from vllm_cases import engine_script_report

    _, report = engine_script_report(tmp_path, __file__)
    assert report["default"] == {"capabilities": dataclasses.asdict(Capabilities(abort=True, prefix_reuse=True)),
                                 "entropy_is_exact": False, "can_abort": True}
    assert report["configured"]["capabilities"] == dataclasses.asdict(Capabilities(abort=True, lora=True))


if __name__ == "__main__":
    model_dir_arg, out_path = sys.argv[1], sys.argv[2]
    with open(out_path, "w") as fh:
        json.dump(_vllm_scenarios(model_dir_arg), fh)
