"""The vLLM tests' shared cases: the prompts, the perturbed weights pushed into an engine (both
sides rebuild them from a seed), and the Hugging Face recomputation of log-probs and entropies
the engines' outputs are checked against. Used by tests/test_backends_vllm.py (and its
subprocess), tests/test_backends_vllm_in_process.py and tests/dist_scripts/vllm_tp_group.py.
"""
from __future__ import annotations

import torch

PROMPT_TEXTS = ["hello", "what is the population of France?", "compute 3 * 7 in python", "hi"]
NOISE_SEED = 1234


def _prompts(tokenizer) -> list[list[int]]:
    shared = "You are a careful research agent. Use <search> and <python> tools. " * 3
    msgs = [[{"role": "system", "content": shared}, {"role": "user", "content": t}] for t in PROMPT_TEXTS]
    return [list(tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"]) for m in msgs]


def perturbed_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """The weights pushed by the update test (deterministic, so both sides can rebuild them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(NOISE_SEED)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _hf_recompute(model_dir: str, prompt: list[int], tokens: list[int], temperature: float,
                  state_dict=None, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-forward log pi(token) and exact entropy at each generated position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    logp = torch.log_softmax(logits / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], entropy


def vllm_child_env() -> dict[str, str]:
    """The environment of a test's child process that starts a vLLM-CPU engine: a 1 GiB KV cache
    unless the environment sets one, this repository and tests/ importable, and no torchrun
    variables (an in-process engine would take them as its own world's)."""
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{repo / 'tests'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def engine_script_report(root, script: str, *args: str) -> tuple[str, dict]:
    """Build the tiny Qwen3 under ``root``, run ``script MODEL_DIR *ARGS REPORT.json`` in a child
    with :func:`vllm_child_env` (a vLLM engine's start-up, once per test module) and return the
    model folder and the report the script wrote."""
    import json
    import subprocess
    import sys

    from aepo_engine.models import build_tiny_qwen3

    model_dir = build_tiny_qwen3(root / "model", seed=0)
    out = root / "report.json"
    proc = subprocess.run([sys.executable, script, model_dir, *args, str(out)], env=vllm_child_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return model_dir, json.loads(out.read_text())
