"""LoRA (``policy.lora``, ``aepo_engine.models.lora``): the config, the adapters' gradient against
the full model's (float64), the worker training and pushing only the adapters, an HF engine
sampling with the pushed adapter, the checkpoint (adapter + optimizer; merged and PEFT exports)
and an exact resume. vLLM's side: tests/test_vllm_lora.py; FSDP2: tests/test_fsdp_invariance.py;
kill -9 during a LoRA run's checkpoint: tests/test_train_e2e.py."""
from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from aepo_engine.checkpoint import ADAPTER_EXPORT, HF_EXPORT, CheckpointManager
from aepo_engine.config_loader import ConfigError
from aepo_engine.models.config import LoraConfig
from aepo_engine.models.lora import (adapter_names, apply_lora, base_name, is_adapter, merged_state, read_adapter,
                                     write_adapter)
from aepo_engine.training import PolicyConfig, PolicyWorker
from aepo_engine.training.optim import OptimConfig
from aepo_engine.training.layout import LossInputs, RowModelInputs
from aepo_engine.training.policy import PolicyModel
from test_policy_worker import random_batch, vocab_of, with_old_policy

LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
OPTIM = OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0, grad_clip=0.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from aepo_engine.models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_lora"), vocab_size=300, hidden_size=64,
                            intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                            initializer_range=0.3, tie_word_embeddings=True)


def load(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def randomise_b(model, std=0.2, seed=0) -> None:
    """Nonzero B (PEFT starts it at 0, where the adapter changes nothing and A gets no gradient)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * std)


def lora_worker(path, **overrides) -> PolicyWorker:
    overrides.setdefault("param_dtype", "float32")
    overrides.setdefault("lora", LORA)
    return PolicyWorker(str(path), PolicyConfig(**overrides), OPTIM, total_steps=100)


# --- config -----------------------------------------------------------------------------------------

def test_config_is_off_by_default_and_refuses_the_head():
    assert not PolicyConfig().lora.enabled
    assert LoraConfig(rank=8, alpha=16).scaling == 2.0 and LoraConfig(rank=16, alpha=8, rslora=True).scaling == 2.0
    for bad, words in [({"target_modules": ("q_proj", "lm_head")}, "reads the head"), ({"rank": 0}, "rank"),
                       ({"dropout": 1.0}, "dropout"), ({"target_modules": ()}, "empty")]:
        with pytest.raises((ConfigError, ValueError, msgspec.ValidationError), match=words):
            LoraConfig(**bad)


def test_the_lora_section_is_read_from_the_command_line(tmp_path):
    from aepo_engine.config import load_train_config

    cfg = load_train_config(["--policy.lora.enabled=true", "--policy.lora.rank=8",
                             '--policy.lora.target_modules=["q_proj","v_proj"]'])
    assert cfg.policy.lora == LoraConfig(enabled=True, rank=8, target_modules=("q_proj", "v_proj"))


def test_no_matching_module_is_one_clear_error(tiny_model):
    with pytest.raises(ValueError, match="matches no linear layer"):
        apply_lora(load(tiny_model), LoraConfig(enabled=True, target_modules=("no_such_proj",)))


# --- the adapted model, its exports -----------------------------------------------------------------

def test_merged_weights_and_the_peft_adapter_compute_the_adapted_model(tiny_model, tmp_path):
    from peft import PeftModel

    model = apply_lora(load(tiny_model), LORA)
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())
    assert len(adapter_names(model)) == 2 * 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        untouched = model(ids).logits  # B = 0: the adapter changes nothing yet
        assert torch.equal(untouched, load(tiny_model)(ids).logits)
        randomise_b(model)
        adapted = model(ids).logits
        assert (adapted - untouched).abs().max() > 1e-2

        merged = load(tiny_model)
        merged.load_state_dict(merged_state(model.state_dict(), LORA.scaling), strict=True)
        # W + s*B@A merged against W x + s*B(A x): float32 rounding of two matmul orders; on an
        # AVX2-only CPU it reached 1.05e-5 (absolute) on one logit of 6,600, over a 1e-5 bound
        torch.testing.assert_close(merged(ids).logits, adapted, rtol=1e-5, atol=5e-5)

        write_adapter(tmp_path / "adapter", model.state_dict(), LORA, base_model=str(tiny_model))
        peft_model = PeftModel.from_pretrained(load(tiny_model), tmp_path / "adapter")  # PEFT's own reader
        assert torch.equal(peft_model(ids).logits, adapted)
        # PEFT's merge agrees with ours
        unloaded = peft_model.merge_and_unload().state_dict()
        ours = merged_state(model.state_dict(), LORA.scaling)
        assert max((unloaded[k] - ours[k]).abs().max().item() for k in ours) < 1e-6
    assert set(read_adapter(tmp_path / "adapter")) == set(adapter_names(model))
    assert base_name("model.layers.0.mlp.up_proj.base_layer.weight") == "model.layers.0.mlp.up_proj.weight"


# --- the gradient -------------------------------------------------------------------------------------

def test_the_adapters_gradient_is_the_full_gradient_restricted_to_them_float64(tiny_model):
    """dL/dB = s G A^T and dL/dA = s B^T G, where G = dL/dW of the merged weight W + s B A, with
    the fused AEPO loss (clip, entropy-aware advantage) on both sides, in float64."""
    adapted = apply_lora(load(tiny_model, torch.float64), LORA)
    randomise_b(adapted)
    merged = load(tiny_model, torch.float64)
    merged.load_state_dict(merged_state(adapted.state_dict(), LORA.scaling))
    batch = random_batch(vocab_of(tiny_model), group_sizes=(2, 3), seed=3)
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(batch.labels.shape, generator=gen, dtype=torch.float64) * 0.3 - 2.0
    inputs = LossInputs(old_logprobs=old, advantages=batch.advantages[:, None].double().expand_as(old).contiguous(),
                        loss_mask=batch.loss_mask.double(), ref_logprobs=None,
                        global_token_count=batch.loss_mask.sum().double())
    for model in (adapted, merged):
        loss, _ = PolicyModel(model, 1.0, fused=True, chunk_bytes=None)(
            RowModelInputs(batch.input_ids, batch.attention_mask, batch.labels), inputs)
        loss.backward()
    params = dict(adapted.named_parameters())
    checked = 0
    for name in adapter_names(adapted):
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        a, b = params[name], params[name.replace("lora_A", "lora_B")]
        g = merged.get_parameter(f"{module}.weight").grad
        torch.testing.assert_close(b.grad, LORA.scaling * g @ a.detach().T, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(a.grad, LORA.scaling * b.detach().T @ g, rtol=1e-9, atol=1e-12)
        assert b.grad.abs().max() > 1e-6 and a.grad.abs().max() > 1e-6
        checked += 1
    assert checked == 7 * adapted.config.num_hidden_layers
    assert all(p.grad is None for n, p in adapted.named_parameters() if not is_adapter(n))


# --- the worker -----------------------------------------------------------------------------------------

def test_the_worker_trains_and_pushes_only_the_adapters(tiny_model):
    worker = lora_worker(tiny_model)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    assert {id(p) for g in worker.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in worker.model.named_parameters() if is_adapter(n)}
    batch = with_old_policy(worker, random_batch(vocab_of(tiny_model), seed=2))
    for _ in range(2):  # the first step moves B only (A's gradient is s B^T G = 0 while B = 0)
        metrics = worker.update(batch)
    assert metrics["optimizer_steps"] > 0 and metrics["skipped_steps"] == 0
    after = dict(worker.model.named_parameters())
    for name, value in before.items():
        moved = not torch.equal(after[name].detach(), value)
        assert moved == is_adapter(name), name
    pushed = {k: v for bucket in worker.iter_weight_buckets(4096, dtype=torch.bfloat16) for k, v in bucket.items()}
    assert set(pushed) == set(adapter_names(worker.model))
    pushed_bytes = sum(t.numel() * t.element_size() for t in pushed.values())
    model_bytes = sum(p.numel() * 2 for p in worker.model.parameters())
    assert pushed_bytes < model_bytes / 5, (pushed_bytes, model_bytes)


def test_an_hf_engine_samples_with_the_pushed_adapter(tiny_model):
    """The engine (its own model, the same adapters injected) takes the trainer's adapter push and
    then samples with the trainer's policy: the sampled tokens' log-probs equal the trainer's."""
    from transformers import AutoTokenizer

    from aepo_engine.rollout.backends.hf import HFBackend
    from aepo_engine.rollout.protocol import GenRequest
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import TokenBatch

    worker = lora_worker(tiny_model)
    randomise_b(worker.model, std=0.3)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    engine = HFBackend(str(tiny_model), tokenizer, dtype=torch.float32, lora=LORA)
    base = HFBackend(str(tiny_model), tokenizer, dtype=torch.float32)
    prompt = [5, 17, 42, 9]
    request = GenRequest(prompt_ids=prompt, max_new_tokens=12, temperature=1.0, seed=3)
    before = engine.generate([request])[0]
    assert before.logprobs == base.generate([request])[0].logprobs  # B = 0 until the first push
    engine.load_weight_buckets(worker.iter_weight_buckets(1024, dtype=engine.weight_dtype))
    out = engine.generate([request])[0]
    traj = Trajectory(prompt_ids=prompt, prompt_index=0, traj_id=0, step=0, kind="global")
    traj.append_model_segment(out.token_ids, out.logprobs, out.entropies, 5)
    batch = TokenBatch.from_trajectories([traj], torch.zeros(1))
    trainer_logprobs, _ = worker.compute_logprobs(batch)
    trainer = trainer_logprobs[batch.loss_mask.bool()]
    gap = (trainer - torch.tensor(out.logprobs)).abs().max().item()
    assert gap < 1e-4, gap
    base_logprobs = torch.tensor(base.generate([dataclasses.replace(request)])[0].logprobs)
    assert out.token_ids != before.token_ids or (base_logprobs - torch.tensor(out.logprobs)).abs().max() > 1e-2


# --- checkpoint and resume ------------------------------------------------------------------------------

def test_a_checkpoint_holds_the_adapter_and_resumes_exactly(tiny_model, tmp_path):
    from peft import PeftModel

    batch = random_batch(vocab_of(tiny_model), seed=4)
    worker = lora_worker(tiny_model)
    worker.update(with_old_policy(worker, batch))
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler)
    step_dir = tmp_path / "ckpt" / "step_000001"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(step_dir / "train_state")).read_metadata().state_dict_metadata
    weights = [k.removeprefix("model.") for k in saved if k.startswith("model.") and k.endswith(".weight")]
    assert sorted(weights) == sorted(adapter_names(worker.model))  # no frozen base weight in the train state

    ids = batch.input_ids[:2]
    with torch.no_grad():
        expected = worker.model(ids).logits
        exported = load(step_dir / HF_EXPORT)  # the merged model: plain from_pretrained
        torch.testing.assert_close(exported(ids).logits, expected, rtol=1e-5, atol=1e-5)
        peft_model = PeftModel.from_pretrained(load(tiny_model), step_dir / ADAPTER_EXPORT)
        torch.testing.assert_close(peft_model(ids).logits, expected, rtol=1e-6, atol=1e-6)

    resumed = lora_worker(tiny_model)
    manager.load(step_dir, resumed.model, optimizer=resumed.optimizer, scheduler=resumed.scheduler)
    second = random_batch(vocab_of(tiny_model), seed=5)
    worker.update(with_old_policy(worker, second))
    resumed.update(with_old_policy(resumed, second))
    for (name, a), (_, b) in zip(worker.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


# --- plans -----------------------------------------------------------------------------------------------

def test_the_plans_count_the_adapters_the_model_really_has(tiny_model):
    """The memory plan's adapter count equals the injected model's (an independent count); under
    LoRA gradients and AdamW states are the adapters', the frozen head gets no d_W, and a
    checkpoint's training state is the adapters' (hand-worked: 4 bytes x (1 + 2 moments))."""
    import json
    from pathlib import Path

    from aepo_engine.checkpoint import checkpoint_footprint
    from aepo_engine.config import TrainConfig
    from aepo_engine.memory_plan import ModelShape, plan_memory
    from aepo_engine.sections import CheckpointConfig

    shape = ModelShape.from_config(json.loads((Path(tiny_model) / "config.json").read_text()))
    model = apply_lora(load(tiny_model), LORA)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert shape.trainable_params(LORA) == adapters
    assert shape.trainable_params(LoraConfig()) == shape.params()  # disabled: every weight
    full = plan_memory(TrainConfig(), shape, world=1, cuda=False).terms
    lora = plan_memory(TrainConfig(policy=PolicyConfig(lora=LORA)), shape, world=1, cuda=False).terms
    assert (lora["grads"].bytes, lora["adam"].bytes) == (4 * adapters, 8 * adapters)
    assert lora["params"].bytes == 4 * (shape.params() + adapters) and full["grads"].bytes == 4 * shape.params()
    # no fp32 d_W accumulator (4 bytes) and no d_W handed to autograd in bf16 (2 bytes)
    assert full["head"].bytes - lora["head"].bytes == (4 + 2) * shape.vocab * shape.hidden
    footprint = checkpoint_footprint(shape.params(), 2, CheckpointConfig(), trainable=adapters)
    assert footprint.train_state == 12 * adapters and footprint.hf_export == 2 * (shape.params() + adapters)
    assert "LoRA adapters" in footprint.describe(CheckpointConfig(), "bfloat16")


def test_the_dry_run_reports_the_adapters_and_unknown_targets(tmp_path):
    from runs import TINY, run_main

    from aepo_engine.train import main

    ok = run_main(main, [*TINY, f"--run_dir={tmp_path}", "--policy.lora.enabled=true", "--dry-run"])
    assert ok.returncode == 0, ok.stderr[-2000:]
    note = next(line for line in ok.stderr.splitlines() if line.startswith("note: LoRA:"))
    assert "adapter parameters train" in note and "per weight push instead of the model" in note
    bad = run_main(main, [*TINY, f"--run_dir={tmp_path}", "--policy.lora.enabled=true",
                          '--policy.lora.target_modules=["qkv_proj"]', "--dry-run"])
    assert bad.returncode != 0 and "name no projection of this model" in bad.stderr
