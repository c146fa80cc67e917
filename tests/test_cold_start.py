"""A pretrained model's cold start, the CPU memory plan and the evaluations' progress lines, on
small local parts (the real model's runs: tests/test_real_model.py).

- with ``model.path`` the synthetic task's warm start trains that model (no tiny model is built)
  and the run starts from the result; with the warm start off, from ``model.path`` itself;
- the CPU plan's terms are the arithmetic its docstring states;
- an evaluation prints questions done / total, tokens/s and an ETA after each round.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import msgspec
import pytest

from aepo_engine.models import build_tiny_qwen3
from aepo_engine.sft import SFTConfig
from aepo_engine.tasks import SyntheticSetupConfig, TaskConfig
from aepo_engine.tasks.synthetic import SyntheticTaskConfig
from aepo_engine.tasks.synthetic_setup import prepare_synthetic_run
from aepo_engine.tools.config import ToolsConfig


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A small "pretrained" model folder standing in for a real one (its tokenizer knows the tags)."""
    path = tmp_path_factory.mktemp("pretrained") / "model"
    build_tiny_qwen3(path, texts=["Zorva age 34. <search> Zorva age</search> <answer> \\boxed{34} </answer>"] * 20,
                     vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                     intermediate_size=64, seed=1)
    return path


def _setup(model_path: Path, warm: bool) -> SyntheticSetupConfig:
    task = TaskConfig(source="synthetic", synthetic=SyntheticTaskConfig(num_people=12, num_cities=3, num_train=8,
                                                                       num_heldout=2, seed=0),
                      warm_start=SFTConfig(steps=2, warmup_steps=0, batch_size=4, lr=1e-3), warm_start_enabled=warm)
    return SyntheticSetupConfig(task=task, tools=ToolsConfig(enabled=["search", "python"]), model_path=str(model_path))


def test_the_warm_start_trains_the_pretrained_model(pretrained, tmp_path):
    run = prepare_synthetic_run(_setup(pretrained, warm=True), tmp_path, log=lambda _: None)
    assert run.model_dir == tmp_path / "setup" / "warm_start" and (run.model_dir / "DONE").exists()
    assert not (tmp_path / "setup" / "random_init").exists()  # no tiny model was built
    info = json.loads((run.model_dir / "warm_start.json").read_text())
    config = json.loads((pretrained / "config.json").read_text())
    assert info["steps"] == 2 and json.loads((run.model_dir / "config.json").read_text())["hidden_size"] == config["hidden_size"]


def test_without_the_warm_start_the_run_starts_from_model_path(pretrained, tmp_path):
    run = prepare_synthetic_run(_setup(pretrained, warm=False), tmp_path, log=lambda _: None)
    assert run.model_dir == pretrained
    assert not (tmp_path / "setup" / "warm_start").exists()


def test_cpu_memory_plan_terms():
    from aepo_engine.config import load_train_config
    from aepo_engine.cpu_memory_plan import CPU_BASELINE, plan_cpu_memory
    from aepo_engine.memory_plan import GIB, ModelShape
    from aepo_engine.native_dtype import cpu_multiplies_bfloat16

    shape = ModelShape.from_config({"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                                    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
                                    "vocab_size": 49152, "tie_word_embeddings": True})
    p = shape.params()
    cfg = load_train_config(["--preset", "smollm2", "--model.path=/m", "--backend.dtype=bfloat16",
                             "--policy.param_dtype=bfloat16", "--backend.kv_cache_gib=0.5", "--train.prompts_per_step=64",
                             "--policy.lora.enabled=false"])
    plan = plan_cpu_memory(cfg, shape)
    assert plan.held["baseline (imports)"] == CPU_BASELINE
    assert plan.held["policy: fp32 weights + AdamW states"] == 12 * p
    # the preset's LoRA: fp32 base + adapters, AdamW states and gradients of the adapters only
    # (r x (in + out) per projection: 16 x 10,176 per layer x 30 layers)
    lora = plan_cpu_memory(msgspec.structs.replace(cfg, policy=msgspec.structs.replace(
        cfg.policy, lora=msgspec.structs.replace(cfg.policy.lora, enabled=True))), shape)
    adapters = 30 * 16 * 10_176
    assert lora.held["policy: fp32 weights + AdamW states"] == 4 * (p + adapters) + 8 * adapters
    assert lora.update["gradients (fp32)"] == 4 * adapters
    assert plan.held["autocast's bfloat16 weight copies"] == 2 * p
    assert plan.held["rollout backend weights (bfloat16)"] == 2 * p
    assert plan.held["prefix store (until the weight sync)"] == int(0.5 * GIB)  # capped by kv_cache_gib
    # 64 rows of the preset's prompt + response tokens, 30 layers x (K, V) x 192 wide x 2 bytes
    row = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    assert row == 768 + 128
    assert plan.rollout["decode cache (a batch's keys and values)"] == 64 * row * 30 * 2 * 192 * 2
    assert plan.peak == sum(plan.held.values()) + max(sum(plan.rollout.values()), sum(plan.update.values()))
    fp32 = plan_cpu_memory(load_train_config(["--preset", "smollm2", "--model.path=/m", "--backend.dtype=float32",
                                              "--policy.param_dtype=float32"]), shape)
    assert "autocast's float32 weight copies" not in fp32.held
    assert fp32.held["rollout backend weights (float32)"] == 4 * p
    # an evaluation with more rows than a training step sizes the rollout terms: 16 training rows
    # (4 prompts x 4), 40 questions -> a decode batch of 40 (max_batch_size 64), not 16
    few = load_train_config(["--preset", "smollm2", "--model.path=/m", "--train.prompts_per_step=4",
                             "--eval.num_questions=40", "--backend.max_batch_size=64"])
    # (the preset's engine dtype: bf16 where this CPU multiplies it natively, else float32)
    kv = 30 * 2 * 192 * (2 if cpu_multiplies_bfloat16() else 4)
    assert plan_cpu_memory(few, shape).rollout["decode cache (a batch's keys and values)"] == 40 * row * kv


def test_evaluations_print_progress():
    from fakes import ScriptedBackend, ScriptedRunner, tool_agent

    from aepo_engine.evaluation.config import EvalConfig
    from aepo_engine.evaluation.core import progress_printer
    from aepo_engine.rollout.config import RolloutConfig
    from aepo_engine.rollout.scheduler import EntropyBalancedRollout

    backend = ScriptedBackend(tool_agent(2))
    stream = io.StringIO()
    report = progress_printer(3, "held-out", stream=stream)
    rollout = EntropyBalancedRollout(backend, ScriptedRunner(), RolloutConfig(k=1, branching=False,
                                                                              max_response_tokens=200,
                                                                              max_tokens_per_segment=50))
    rollout.rollout([[5, 6], [7, 8], [9]], step=0, progress=report)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # one per round: two tool rounds, then the answers
    assert "[eval held-out] question 0/3" in lines[0] and "eta ?" in lines[0]
    assert "question 3/3" in lines[-1] and "tok/s" in lines[-1] and "eta 0s" in lines[-1]
    assert EvalConfig  # the trainer passes its label through evaluate(progress=...)
