"""The benchmark scripts keep working: the GPU check's --smoke mode runs its code on CPU tiny
shapes; the AEPO-loss benchmark's cases run at its small shape and its matmul floors compute the
loss's matmuls; the default-run benchmark runs a shrunken default and its summary is hand-checked."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_check_smoke.jsonl").read_text().splitlines()]
    check = next(r for r in rows if r.get("check") == "logprob_entropy")
    assert check["max_abs_logp"] < 1e-4 and check["max_rel_dlogits"] < 2e-2
    assert {r.get("impl") for r in rows} >= {"triton", "triton_inplace", "naive_eager", "naive_compiled"}
    one_pass = [r for r in rows if r.get("check") == "one_pass"]
    assert len(one_pass) == 4 and all(r["max_rel_dlogits"] < 2e-2 and r["abs_loss"] < 1e-4 for r in one_pass)
    fused = next(r for r in rows if r.get("check") == "fused_linear_one_pass")
    assert fused["max_rel_dweight"] < 2e-2 and fused["abs_loss"] < 1e-3
    assert {r["impl"] for r in rows if r.get("bench") == "one_pass_loss" and "fwd_bwd_s" in r} >= {
        "one_pass_inplace", "one_pass", "two_stage_inplace", "reference_eager"}


def test_aepo_loss_bench_cases_and_matmul_floor():
    """gemm3 / gemm3_chunked (odd chunk) are the loss gradient's matmuls: with dlogits in place of
    z they give the fused loss's d_hidden and d_weight; a case row has its time, memory and rate."""
    sys.path.insert(0, str(BENCH))
    from bench_aepo_loss import gemm3, gemm3_chunked, run_case

    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(45, 16, generator=gen), torch.randn(301, 16, generator=gen)
    z = h @ w.T
    for d_h, d_w in (gemm3(h, w), gemm3_chunked(h, w, 7)):
        torch.testing.assert_close(d_h, z @ w, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(d_w, z.T @ h, rtol=1e-5, atol=1e-4)
    for level, impl in (("logits", "one_pass_inplace"), ("logits", "copy_into"), ("linear", "gemm3_chunked")):
        row = run_case(level, impl, "small", warmup=0, repeats=1)
        assert row["total_s"] > 0 and row["peak_bytes"] >= 0 and row["impl"] == impl
        assert row["gflops" if level == "linear" else "gb_per_s"] > 0


def test_default_run_bench_summary_hand_worked():
    sys.path.insert(0, str(BENCH))
    from bench_default_run import summarize

    rows = [{"gain": g, "acc_before": b, "wall_s": w} for g, b, w in ((0.1, 0.3, 400.0), (0.2, 0.5, 420.0), (0.3, 0.4, 410.0))]
    summary = summarize(rows)
    assert summary["gain_mean"] == pytest.approx(0.2) and summary["gain_sd"] == pytest.approx(0.1)
    assert summary["paired_t"] == pytest.approx(0.2 / (0.1 / 3 ** 0.5))
    assert summary["min_gain"] == pytest.approx(0.1) and summary["max_wall_s"] == 420.0


@pytest.mark.sandbox
@pytest.mark.slow
def test_default_run_bench_smoke(tmp_path):
    """One seed of a shrunken default run through the benchmark script (the real trainer)."""
    tiny = ["--train.steps=1", "--task.warm_start.steps=2", "--task.warm_start.warmup_steps=1",
            "--eval.num_questions=4", "--task.synthetic.num_train=40", "--task.synthetic.num_heldout=8",
            "--train.prompts_per_step=2", "--rollout.k=2", "--checkpoint.every_n_steps=0"]
    proc = subprocess.run([sys.executable, str(BENCH / "bench_default_run.py"), "--seeds", "5", "--base-dir",
                           str(tmp_path), "--results", "", "--extra", *tiny],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"seed": 5')))
    assert row["steps"] == 1 and row["samples"] == 8 and 0.0 <= row["acc_before"] <= 1.0
    # every sub-seed derived from --seed 5 (eval draws offset by 12345)
    assert row["seeds"] == {"data.shuffle_seed": 5, "model.tiny.seed": 5, "task.synthetic.seed": 5,
                            "task.warm_start.seed": 5, "rollout.seed": 5, "eval.seed": 12350}
    assert row["per_kind_before"] and set(row["per_kind_before"]) <= {
        "accuracy/synthetic/lookup", "accuracy/synthetic/two_hop", "accuracy/synthetic/arithmetic"}
    assert json.loads((tmp_path / "seed5" / "summary.json").read_text())["steps"] == 1
    assert '"seeds": 1' in proc.stdout


def test_harness_measure_keeps_every_sample_and_the_minimum():
    """Scripted phase times (the harness times the real body too, so total_s is only bounded)."""
    sys.path.insert(0, str(BENCH))
    from harness import measure

    phases = iter([{"fwd_s": 9.0}, {"fwd_s": 3.0}, {"fwd_s": 1.0}, {"fwd_s": 2.0}])  # first: warm-up
    row = measure(lambda: None, lambda _: next(phases), warmup=1, repeats=3)
    assert row["samples"]["fwd_s"] == [3.0, 1.0, 2.0]
    assert (row["fwd_s"], row["fwd_min_s"], row["fwd_spread_s"]) == (2.0, 1.0, 2.0)
    assert len(row["samples"]["total_s"]) == 3 and row["total_min_s"] <= row["total_s"]


@pytest.mark.slow
def test_aepo_loss_bench_interleaved_cases_take_turns():
    """--interleave: one row per case with all its samples; cases needing their own environment
    (an @ suffix) are refused with the reason."""
    sys.path.insert(0, str(BENCH))
    from bench_aepo_loss import interleave_problem, run_interleaved

    rows = run_interleaved("logits", ["one_pass_inplace", "copy"], "small", warmup=1, repeats=2, hot_pages=True)
    assert [r["impl"] for r in rows] == ["one_pass_inplace", "copy"]
    assert all(len(r["samples"]["total_s"]) == 2 and r["hot_pages"] and r["total_min_s"] > 0 for r in rows)
    assert interleave_problem(["copy"]) is None and "one_pass@compiled" in interleave_problem(["copy", "one_pass@compiled"])
    with pytest.raises(ValueError, match="own environment"):
        run_interleaved("logits", ["one_pass@compiled"], "small", warmup=0, repeats=1)


@pytest.mark.slow
def test_hf_decode_bench_rows_and_byte_formula(tmp_path):
    """bench_hf_decode: every case has a row per round, the two caches sample the same tokens, the
    decode time is the total less the prefill case's, and the byte count is the formula by hand."""
    sys.path.insert(0, str(BENCH))
    from bench_hf_decode import concat_bytes_per_step, run, summarize
    from transformers import Qwen3Config

    from aepo_engine.models import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "m", seed=0, num_layers=1)
    rows = run(model_dir, contexts=[12, 30], rows=3, new_tokens=5, warmup=0, repeats=1, rounds=2)
    assert len(rows) == 2 * 3 * 2 and all(r["same_tokens_as_concat"] for r in rows)
    assert {(r["context"], r["case"]) for r in rows} == {(c, k) for c in (12, 30) for k in ("prefill", "concat", "in_place")}
    assert all(r["decode_steps"] == 5 for r in rows if r["case"] != "prefill")
    for context in (12, 30):
        prefill = sorted(r["total_s"] for r in rows if r["context"] == context and r["case"] == "prefill")
        for r in rows:
            if r["context"] == context and r["case"] != "prefill":
                assert r["decode_s"] == pytest.approx(r["total_s"] - sum(prefill) / 2)  # median of two
    summary = summarize(rows)
    assert {e["case"] for e in summary if "decode_speedup" in e} == {"in_place"}
    config = Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=8, hidden_size=32, num_attention_heads=4)
    assert concat_bytes_per_step(config, rows=5, context=100) == 2 * 5 * 3 * 2 * 2 * 8 * 100 * 4
