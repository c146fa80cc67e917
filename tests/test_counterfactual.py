"""Counterfactual per-token gradients (aepo_engine.training.counterfactual): each quantity on
hand-worked tokens, then through the policy worker (the same numbers from the loss's own rows,
whatever the micro-batch split or packing; off when asked or when the batch has no entropies)."""
from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
import torch

from aepo_engine.training.batch import ORIGIN_BRANCH, ORIGIN_GLOBAL
from aepo_engine.training.counterfactual import (GROUPS, SUMS, high_entropy_threshold, summarise, token_sums,
                                                 variant_configs)
from aepo_kernels import LossConfig

# Five tokens, entropy z-score statistics mean 1, std 1 (given, as the worker gives global ones),
# alpha_H = 0.2, eps 0.2: shaped A_t = A (1 + 0.2 (H - 1)).
#   token  A   H    r    shaped  AEPO g = dL/dlogp             PPO g   alpha_H = 0 (rule aepo)
#   a      1   1    1.5  1.0     -1.0 * 1.2 = -1.2  (r > 1.2)  0       -1.2
#   b      1   2    1.0  1.2     -1.2 * 1.0 = -1.2             -1.2    -1.0
#   c     -1   0    0.5 -0.8     0 (r < 0.8, A < 0)            0       0
#   d     -1   0.5  1.0 -0.9     +0.9                          +0.9    +1.0
#   e      2   3    1.5  2.8     -2.8 * 1.2 = -3.36            0       -2.4
# High-entropy threshold 1.5 -> high = {b, e}; kept by AEPO, zeroed by PPO: {a, e}.
# Origins: a, b global; c, d branch; e inherited (in "all" only).
ADV = [1.0, 1.0, -1.0, -1.0, 2.0]
H = [1.0, 2.0, 0.0, 0.5, 3.0]
RATIO = [1.5, 1.0, 0.5, 1.0, 1.5]
ORIGIN = ["global", "global", "branch", "branch", "inherited"]


def hand_tokens():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.2])
    logp = old + torch.log(torch.tensor(RATIO))
    masks = {name: torch.tensor([o == name for o in ORIGIN]) for name in ("global", "branch")}
    return logp, torch.tensor(H), old, torch.tensor(ADV), torch.ones(5), masks


def sums_by_group(sums: torch.Tensor) -> dict[str, dict[str, float]]:
    n = len(SUMS)
    return {g: dict(zip(SUMS, sums[i * n:(i + 1) * n].tolist())) for i, g in enumerate(GROUPS)}


def test_token_sums_by_hand():
    logp, entropy, old, adv, mask, masks = hand_tokens()
    sums = token_sums(logp, entropy, old, adv, mask, entropy, torch.tensor(1.5), masks, LossConfig(),
                      torch.tensor(1.0), torch.tensor(1.0))
    got = sums_by_group(sums)
    expected = {
        # tokens, high {b,e}, kept {a,e}, kept&high {e}, AEPO mass on high |b|+|e| = 1.2+3.36, kept there 3.36,
        # alpha on: 1.2+1.2+0+0.9+3.36 = 6.66 (high 4.56); alpha off: 1.2+1.0+0+1.0+2.4 = 5.6 (high 3.4)
        "all": dict(tokens=5, high=2, kept=2, kept_high=1, mass_high=4.56, kept_mass_high=3.36,
                    mass_on=6.66, mass_on_high=4.56, mass_off=5.6, mass_off_high=3.4),
        "global": dict(tokens=2, high=1, kept=1, kept_high=0, mass_high=1.2, kept_mass_high=0.0,
                       mass_on=2.4, mass_on_high=1.2, mass_off=2.2, mass_off_high=1.0),
        "branch": dict(tokens=2, high=0, kept=0, kept_high=0, mass_high=0.0, kept_mass_high=0.0,
                       mass_on=0.9, mass_on_high=0.0, mass_off=1.0, mass_off_high=0.0),
    }
    for group, values in expected.items():
        assert got[group] == pytest.approx(values, rel=1e-6, abs=1e-6), group


def test_summarise_by_hand():
    logp, entropy, old, adv, mask, masks = hand_tokens()
    sums = token_sums(logp, entropy, old, adv, mask, entropy, torch.tensor(1.5), masks, LossConfig(),
                      torch.tensor(1.0), torch.tensor(1.0))
    out = summarise(sums)
    assert out == pytest.approx({
        "cf/high_kept_frac": 1 / 2, "cf/high_kept_mass": 3.36 / 4.56, "cf/kept_frac": 2 / 5,
        "cf/kept_high_share": 1 / 2,
        "cf/adv_high_share_on": 4.56 / 6.66, "cf/adv_high_share_off": 3.4 / 5.6,
        "cf/adv_high_shift": 4.56 / 6.66 - 3.4 / 5.6,
        "cf/adv_high_gain": 4.56 / 3.4, "cf/adv_low_gain": (6.66 - 4.56) / (5.6 - 3.4),  # 2.1 / 2.2
        "cf/high_kept_frac/global": 0.0, "cf/high_kept_mass/global": 0.0, "cf/kept_frac/global": 1 / 2,
        "cf/kept_high_share/global": 0.0, "cf/adv_high_share_on/global": 1.2 / 2.4,
        "cf/adv_high_share_off/global": 1.0 / 2.2, "cf/adv_high_shift/global": 1.2 / 2.4 - 1.0 / 2.2,
        "cf/adv_high_gain/global": 1.2 / 1.0, "cf/adv_low_gain/global": 1.2 / 1.2,
        # branch: no high-entropy and no kept token -> those shares are left out
        "cf/kept_frac/branch": 0.0, "cf/adv_high_share_on/branch": 0.0, "cf/adv_high_share_off/branch": 0.0,
        "cf/adv_high_shift/branch": 0.0, "cf/adv_low_gain/branch": 0.9 / 1.0,
    }, rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="sums"):
        summarise([1.0, 2.0])


def test_variants_change_one_mechanism_from_the_configured_loss():
    # GRPO's loss (ppo, alpha 0): the clip variants keep alpha 0; "adv_on" takes the spec's 0.2 with PPO's clip.
    grpo = LossConfig(clip="ppo", entropy_adv_alpha=0.0, kl_coef=0.1, entropy_coef=0.01)
    v = variant_configs(grpo)
    assert (v["ppo"].clip, v["aepo"].clip, v["adv_on"].clip, v["adv_off"].clip) == ("ppo", "aepo", "ppo", "ppo")
    alphas = (v["ppo"].entropy_adv_alpha, v["adv_on"].entropy_adv_alpha, v["adv_off"].entropy_adv_alpha)
    assert alphas == (0.0, 0.2, 0.0)
    assert all(c.kl_coef == 0.0 and c.entropy_coef == 0.0 for c in v.values())
    assert variant_configs(LossConfig(entropy_adv_alpha=0.5))["adv_on"].entropy_adv_alpha == 0.5
    # Under GRPO's rule (PPO clip) a and e (A > 0, r 1.5 > 1.2) get no gradient, c none either (r < 0.8):
    # alpha 0.2: b 1.2 + d 0.9 = 2.1 (high: b 1.2); alpha 0: b 1.0 + d 1.0 = 2.0 (high: b 1.0).
    logp, entropy, old, adv, mask, masks = hand_tokens()
    got = sums_by_group(token_sums(logp, entropy, old, adv, mask, entropy, torch.tensor(1.5), masks, grpo,
                                   torch.tensor(1.0), torch.tensor(1.0)))["all"]
    masses = (got["mass_on"], got["mass_on_high"], got["mass_off"], got["mass_off_high"])
    assert masses == pytest.approx((2.1, 1.2, 2.0, 1.0))
    # the clip comparison runs at alpha 0 here: AEPO keeps a (1.2) and e (2 * 1.2 = 2.4)
    kept = (got["kept"], got["kept_high"], got["mass_high"], got["kept_mass_high"])
    assert kept == pytest.approx((2, 1, 1.0 + 2.4, 2.4))


def test_high_entropy_threshold_by_hand():
    # valid entropies [0, 1, 1, 2, 3] (the 9 is masked out): 0.8 quantile at position 0.8 * 4 = 3.2 -> 2 + 0.2 * 1
    entropy = torch.tensor([[1.0, 2.0, 0.0], [1.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert float(high_entropy_threshold(entropy, mask)) == pytest.approx(2.2)
    assert float(high_entropy_threshold(entropy, mask, share=0.5)) == pytest.approx(1.0)
    assert math.isinf(float(high_entropy_threshold(entropy, torch.zeros_like(mask))))
    with pytest.raises(ValueError, match="share"):
        high_entropy_threshold(entropy, mask, share=1.0)
    with pytest.raises(ValueError, match="differ"):
        high_entropy_threshold(entropy, mask[:, :2])


def test_masked_tokens_and_missing_origins_count_nowhere():
    logp, entropy, old, adv, mask, masks = hand_tokens()
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # e out: kept {a}, high {b}
    got = sums_by_group(token_sums(logp, entropy, old, adv, mask, entropy, torch.tensor(1.5), None, LossConfig(),
                                   torch.tensor(1.0), torch.tensor(1.0)))
    assert (got["all"]["tokens"], got["all"]["high"], got["all"]["kept"], got["all"]["kept_high"]) == (4, 1, 1, 0)
    assert all(v == 0 for g in ("global", "branch") for v in got[g].values())


# --- through the worker ---------------------------------------------------------------------------

def _batch_and_worker(tmp_path, **policy_overrides):
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import PolicyConfig, PolicyWorker, TokenBatch
    from aepo_engine.training.optim import OptimConfig

    model = build_tiny_qwen3(tmp_path / "m", vocab_size=120, hidden_size=32, intermediate_size=64, num_heads=2,
                             num_kv_heads=1, head_dim=32, initializer_range=0.3)
    gen = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(10, 120, (n,), generator=gen).tolist()  # noqa: E731
    trajs = []
    for p in range(3):
        parent = Trajectory(prompt_ids=[1, 2, 3], prompt_index=p, traj_id=0, step=0, kind="global")
        parent.append_model_segment(ids(5), [-0.5] * 5, [0.0] * 5, 2)
        parent.append_tool_result(ids(3))
        parent.append_model_segment(ids(4), [-0.5] * 4, [0.0] * 4, 2)
        child = parent.fork(2, 1)
        child.append_model_segment(ids(6), [-0.5] * 6, [0.0] * 6, 2)
        other = Trajectory(prompt_ids=[1, 2, 3], prompt_index=p, traj_id=2, step=0, kind="global")
        other.append_model_segment(ids(7), [-0.5] * 7, [0.0] * 7, 2)
        trajs += [parent, child, other]
    batch = TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=gen))
    config = PolicyConfig(param_dtype="float32", ppo_mini_batch_size=3, micro_batch_size=9, **policy_overrides)

    def worker(**overrides):
        return PolicyWorker(str(model), msgspec.structs.replace(config, **overrides), OptimConfig(lr=1e-3),
                            total_steps=10)

    return batch, worker, gen


def test_worker_reports_the_counterfactuals_of_its_own_loss_rows(tmp_path):
    """One optimizer step over the whole batch: the logged shares equal token_sums on the current
    policy's log-probs and entropies (compute_logprobs), with the old log-probs moved so that
    clipping happens; the same for any micro-batch split and with packed rows."""
    from aepo_kernels import entropy_moments, entropy_stats_from_moments

    batch, make, gen = _batch_and_worker(tmp_path)
    first = make()
    logp, entropy = first.compute_logprobs(batch)
    noise = 0.6 * torch.randn(logp.shape, generator=gen)
    batch = dataclasses.replace(batch, old_logprobs=logp + noise, entropy=entropy)
    adv = batch.advantages[:, None].expand_as(logp)
    masks = {"global": batch.token_origin == ORIGIN_GLOBAL, "branch": batch.token_origin == ORIGIN_BRANCH}
    mean, std = entropy_stats_from_moments(entropy_moments(entropy, batch.loss_mask))
    threshold = high_entropy_threshold(entropy, batch.loss_mask)
    expected = summarise(token_sums(logp, entropy, batch.old_logprobs, adv, batch.loss_mask, entropy, threshold,
                                    masks, LossConfig(), mean, std))
    assert expected["cf/high_kept_frac"] > 0 and expected["cf/kept_frac"] > 0  # the clip acts in this batch
    assert "cf/high_kept_frac/branch" in expected and "cf/adv_high_shift/global" in expected
    for overrides in ({"ppo_mini_batch_size": 3}, {"ppo_mini_batch_size": 3, "micro_batch_size": 2},
                      {"ppo_mini_batch_size": 3, "pack_sequences": "on"}):
        got = make(**overrides).update(batch)
        cf = {k: v for k, v in got.items() if k.startswith("cf/")}
        assert cf.keys() == expected.keys(), overrides
        for key in expected:
            assert cf[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (overrides, key)


def test_counterfactuals_sum_over_the_steps_of_an_update_and_can_be_turned_off(tmp_path):
    batch, make, gen = _batch_and_worker(tmp_path)
    worker = make(ppo_mini_batch_size=1, ppo_epochs=2)  # 3 prompts -> 6 optimizer steps
    logp, entropy = worker.compute_logprobs(batch)
    noise = 0.6 * torch.randn(logp.shape, generator=gen)
    batch = dataclasses.replace(batch, old_logprobs=logp + noise, entropy=entropy)
    out = worker.update(batch)
    assert out["optimizer_steps"] == 6
    assert 0 < out["cf/high_kept_frac"] <= 1 and 0 <= out["cf/adv_high_share_off"] <= out["cf/adv_high_share_on"] <= 1
    assert not any(k.startswith("cf/") for k in make(counterfactual_stats=False).update(batch))
    assert not any(k.startswith("cf/") for k in make().update(dataclasses.replace(batch, entropy=None)))
    # the rest of the update's report is unchanged by the measurement
    on, off = make().update(batch), make(counterfactual_stats=False).update(batch)
    for key in ("loss", "grad_norm", "clipfrac_high", "clipfrac_high/branch", "tokens/global", "entropy"):
        assert on[key] == pytest.approx(off[key], rel=1e-6, abs=1e-9), key
