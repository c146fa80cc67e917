"""VLLMBackend with LoRA: adapter-only pushes, checked against Hugging Face's PEFT-adapted model.

One subprocess (this file run as a script: the in-process engine makes it a world of one, which a
pytest process must not become) builds a LoRA engine in process (``external_launcher``, the
default for vLLM), samples the base model, then takes three adapter pushes (random A and B, so the
adapter really changes the model; the third repeats the first's values under a new version; after
the first, calls with an ``abort`` event: never set, and cut after a few engine steps) and a
refused full-weight push; an engine in processes of its own then takes the first push too. It
writes a JSON report; the tests below check it against ``apply_lora``'s HF model with the same
adapter values, and against the base model (the adapter must change the log-probs). Skipped when
``import vllm`` fails.
"""
from __future__ import annotations

import gc
import json
import sys
import threading
import time

import pytest
import torch
from conftest import vllm_missing
from vllm_cases import _prompts

SKIP_REASON = vllm_missing()
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
              pytest.mark.slow]  # two vLLM engines start here (~20 s each on CPU)
RANK, ALPHA, B_STD = 4, 8.0, 0.1  # rank 4: vLLM pads it into max_lora_rank 8
TEMPERATURE = 0.8
BASE_NAME = "model.layers.0.self_attn.q_proj.weight"  # a frozen base weight: refused under LoRA


def lora_config():
    from aepo_engine.models.config import LoraConfig

    return LoraConfig(enabled=True, rank=RANK, alpha=ALPHA)


def adapted_model(model_dir: str, seed: int | None):
    """The HF model with ``lora_config()``'s adapters (fp32, eval), and the adapter's tensors:
    A as PEFT initialises it, B ~ N(0, B_STD^2) (both drawn from ``seed``, so the subprocess and
    the tests rebuild the same values); ``seed=None``: no adapter (the base model, empty dict)."""
    from transformers import AutoModelForCausalLM

    from aepo_engine.models.lora import apply_lora, initial_adapter

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if seed is None:
        return model, {}
    apply_lora(model, lora_config())
    tensors = initial_adapter(model, seed=seed)
    generator = torch.Generator().manual_seed(10_000 + seed)
    for name in tensors:
        if ".lora_B." in name:
            tensors[name] = B_STD * torch.randn(tensors[name].shape, generator=generator)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all(".lora_" not in n for n in missing)
    return model, tensors


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log pi(token) of each generated token under ``model`` (full forward, TEMPERATURE applied)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# ---------------------------------------------------------------------------------------------
# The subprocess side (runs only under `python tests/test_vllm_lora.py MODEL_DIR OUT_JSON`).
def _dump(outputs) -> list[dict]:
    return [dict(token_ids=o.token_ids, logprobs=o.logprobs) for o in outputs]


def _buckets(state: dict[str, torch.Tensor], size: int = 8) -> list[dict[str, torch.Tensor]]:
    names = list(state)
    return [{n: state[n] for n in names[i:i + size]} for i in range(0, len(names), size)]


def _push(engine, tensors: dict[str, torch.Tensor], report: dict, key: str) -> None:
    engine.load_weight_buckets(iter(_buckets(tensors)))
    report[key] = dict(bytes=engine.adapter_bytes_pushed, sync_s=engine.last_sync_s, version=engine.adapter_version,
                       path=str(engine.adapter_path), loras=sorted(engine.llm.llm_engine.list_loras()),
                       dirs=sorted(p.name for p in engine.adapter_path.parent.iterdir()))


def _scenarios(model_dir: str) -> dict:
    from aepo_engine.rollout.backends.vllm import VLLMBackend
    from aepo_engine.rollout.protocol import GenRequest

    report: dict = {}
    t0 = time.perf_counter()
    engine = VLLMBackend(model_dir, seed=0, max_model_len=1024, dtype="float32", in_process=True, lora=lora_config())
    report["start_s"] = time.perf_counter() - t0
    config = engine.llm.llm_engine.vllm_config
    report["engine_lora"] = dict(max_lora_rank=config.lora_config.max_lora_rank, max_loras=config.lora_config.max_loras,
                                 executor=config.parallel_config.distributed_executor_backend)
    report["lora_rank"] = engine.lora.rank
    prompts = _prompts(engine.tokenizer)
    report["prompts"] = prompts
    reqs = [GenRequest(tuple(p), 32, seed=10 + i, temperature=TEMPERATURE) for i, p in enumerate(prompts)]
    report["base"] = _dump(engine.generate(reqs))  # before any push: the base model, no adapter
    model, first = adapted_model(model_dir, seed=1)
    # the engine holds fp32 weights, so a push moves 4 bytes per element
    report["model_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                if ".lora_" not in n)
    report["adapter_bytes"] = sum(t.numel() * t.element_size() for t in first.values())
    report["adapter_tensors"] = len(first)
    _push(engine, first, report, "push1")
    report["v1"] = _dump(engine.generate(reqs))
    # abort under the adapter (the engine stepped by hand: tests/test_backends_vllm_abort.py)
    from test_backends_vllm_abort import CutAfter

    report["v1_never_set"] = _dump(engine.generate(reqs, abort=threading.Event()))
    cut = engine.generate(reqs, abort=CutAfter(6))
    report["v1_cut"] = [dict(d, finish_reason=o.finish_reason) for d, o in zip(_dump(cut), cut)]
    _push(engine, adapted_model(model_dir, seed=2)[1], report, "push2")
    report["v2"] = _dump(engine.generate(reqs))
    _push(engine, first, report, "push3")  # the first values again, as a new version
    report["v3"] = _dump(engine.generate(reqs))
    try:
        frozen = model.state_dict()[BASE_NAME.replace(".weight", ".base_layer.weight")]
        engine.load_weight_buckets([{BASE_NAME: frozen}])
        report["refused"] = None
    except ValueError as exc:
        report["refused"] = str(exc)
    report["after_refused"] = dict(version=engine.adapter_version, loras=sorted(engine.llm.llm_engine.list_loras()))
    # An engine in processes of its own reads the same adapter folder format from its engine core.
    other = VLLMBackend(model_dir, seed=0, max_model_len=1024, dtype="float32", in_process=False, lora=lora_config())
    _push(other, first, report, "other_push")
    report["other_v1"] = _dump(other.generate(reqs))
    root = other.adapter_path.parent
    del other
    gc.collect()
    report["root_removed_on_gc"] = not root.exists()
    return report


# ---------------------------------------------------------------------------------------------
# The pytest side.
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from vllm_cases import engine_script_report

    t0 = time.perf_counter()
    model_dir, rep = engine_script_report(tmp_path_factory.mktemp("vllm_lora"), __file__)
    rep["subprocess_s"] = time.perf_counter() - t0
    return model_dir, rep


def _tokens(outputs) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def _max_gap(model, prompts, outputs) -> float:
    """The largest |vLLM log-prob - HF log-prob| over every sampled token of ``outputs``."""
    return max(float((torch.tensor(o["logprobs"]) - hf_logprobs(model, p, o["token_ids"])).abs().max())
               for p, o in zip(prompts, outputs))


def test_engine_is_built_for_adapters(report):
    _, rep = report
    assert rep["engine_lora"] == dict(max_lora_rank=8, max_loras=1, executor="external_launcher")
    assert rep["lora_rank"] == RANK
    print(f"engine start {rep['start_s']:.1f}s, whole subprocess {rep['subprocess_s']:.1f}s; "
          f"pushes {[round(rep[k]['sync_s'], 3) for k in ('push1', 'push2', 'push3', 'other_push')]} s")


def test_adapter_push_matches_hf_adapted_model_and_changes_the_base(report):
    model_dir, rep = report
    base, _ = adapted_model(model_dir, seed=None)
    adapted, _ = adapted_model(model_dir, seed=1)
    prompts = rep["prompts"]
    # before any push the engine samples the base model (the trainer's adapter starts with B = 0)
    assert _max_gap(base, prompts, rep["base"]) < 2e-4
    # after the push: the adapted model's log-probs (fp32 engine vs fp32 HF: kernel rounding only) ...
    gap = _max_gap(adapted, prompts, rep["v1"])
    # ... and not the base model's: the adapter is used
    off = _max_gap(base, prompts, rep["v1"])
    print(f"v1: max |vLLM - HF adapted| {gap:.2e}, max |vLLM - HF base| {off:.3f}")
    assert gap < 2e-4
    assert off > 1e-2
    assert _tokens(rep["v1"]) != _tokens(rep["base"])


def test_each_push_is_a_new_version(report):
    model_dir, rep = report
    second, _ = adapted_model(model_dir, seed=2)
    gap = _max_gap(second, rep["prompts"], rep["v2"])
    print(f"v2: max |vLLM - HF adapted| {gap:.2e}")
    assert gap < 2e-4
    assert _tokens(rep["v2"]) != _tokens(rep["v1"])
    # the first values again under version 3: exactly the first version's samples
    assert _tokens(rep["v3"]) == _tokens(rep["v1"])
    torch.testing.assert_close(torch.tensor(sum((o["logprobs"] for o in rep["v3"]), [])),
                               torch.tensor(sum((o["logprobs"] for o in rep["v1"]), [])), atol=1e-5, rtol=0)
    # one adapter in the engine at a time, a new int id per version; the folders of the current
    # and the previous version only
    assert [rep[k]["version"] for k in ("push1", "push2", "push3")] == [1, 2, 3]
    assert [rep[k]["loras"] for k in ("push1", "push2", "push3")] == [[1], [2], [3]]
    assert [rep[k]["dirs"] for k in ("push1", "push2", "push3")] == [["v1"], ["v1", "v2"], ["v2", "v3"]]
    assert rep["root_removed_on_gc"]


def test_abort_under_the_adapter(report):
    """Stepped by hand with an event never set, the engine samples what ``LLM.generate`` does under
    the adapter; cut after a few steps, each request returns the first tokens of its uncut run."""
    _, rep = report
    assert rep["v1_never_set"] == rep["v1"]
    assert sum(o["finish_reason"] == "abort" for o in rep["v1_cut"]) >= 3
    for cut, full in zip(rep["v1_cut"], rep["v1"]):
        n = len(cut["token_ids"])
        if cut["finish_reason"] == "abort":
            assert 0 < n < len(full["token_ids"]) and cut["token_ids"] == full["token_ids"][:n]
            torch.testing.assert_close(torch.tensor(cut["logprobs"]), torch.tensor(full["logprobs"][:n]),
                                       atol=1e-5, rtol=0)
        else:  # ended within those steps: as uncut
            assert cut["token_ids"] == full["token_ids"]


def test_non_adapter_push_is_refused(report):
    _, rep = report
    assert rep["refused"] is not None and BASE_NAME in rep["refused"]
    assert "adapter tensors only" in rep["refused"] and "frozen" in rep["refused"]
    assert rep["after_refused"] == dict(version=3, loras=[3])  # the engine kept its adapter


def test_only_the_adapter_is_pushed(report):
    _, rep = report
    for key in ("push1", "push2", "push3", "other_push"):
        assert rep[key]["bytes"] == rep["adapter_bytes"]
    assert rep["adapter_bytes"] < rep["model_bytes"] / 10
    print(f"adapter push {rep['adapter_bytes']} B ({rep['adapter_tensors']} tensors) vs model {rep['model_bytes']} B")


def test_engine_in_processes_of_its_own_samples_the_same(report):
    _, rep = report
    assert _tokens(rep["other_v1"]) == _tokens(rep["v1"])
    gap = max(float((torch.tensor(a["logprobs"]) - torch.tensor(b["logprobs"])).abs().max())
              for a, b in zip(rep["other_v1"], rep["v1"]))
    print(f"in process vs own processes: max log-prob gap {gap:.2e}")
    assert gap < 1e-5


def test_max_lora_rank_is_the_smallest_vllm_allows():
    from aepo_engine.rollout.backends.vllm import lora_rank_slot

    assert [lora_rank_slot(r) for r in (1, 2, 8, 9, 16, 17, 64, 300, 512)] == [1, 8, 8, 16, 16, 32, 64, 320, 512]
    with pytest.raises(ValueError, match="largest max_lora_rank"):
        lora_rank_slot(513)


if __name__ == "__main__":
    model_dir_arg, out_path = sys.argv[1], sys.argv[2]
    with open(out_path, "w") as fh:
        json.dump(_scenarios(model_dir_arg), fh)
