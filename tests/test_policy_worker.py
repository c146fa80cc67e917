"""TokenBatch alignment and splits; PolicyWorker (single process) on a tiny random Qwen3.

Update invariance is checked with AdamW's eps = 1: the first AdamW step is then
lr * g / (|g| + 1), close to plain SGD, so parameter changes follow the gradient's size and
direction (with the default eps the first step is lr * sign(g) and would hide most differences).
"""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from aepo_engine.rollout.trajectory import Trajectory
from aepo_engine.training.optim import OptimConfig
from aepo_engine.training import IGNORE_INDEX, PolicyConfig, PolicyWorker, TokenBatch, build_lr_scheduler, concat_rows
from aepo_kernels import LossConfig

SGD_LIKE = OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0, grad_clip=0.0)


def make_traj(prompt, segments, prompt_index=0, traj_id=0):
    """segments: list of ("model", ids, logprobs) or ("tool", ids)."""
    traj = Trajectory(prompt_ids=list(prompt), prompt_index=prompt_index, traj_id=traj_id, step=0, kind="global")
    for seg in segments:
        if seg[0] == "model":
            traj.append_model_segment(seg[1], seg[2], [0.0] * len(seg[1]), 5)
        else:
            traj.append_tool_result(seg[1])
    return traj


def random_batch(vocab: int, group_sizes=(2, 2, 2, 2), seed: int = 0) -> TokenBatch:
    """Prompts with several trajectories of mixed length, some with a tool result in the middle."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(20, vocab) for _ in range(n)]  # noqa: E731
    trajs = []
    for p, size in enumerate(group_sizes):
        prompt = ids(rng.randint(2, 7))
        for k in range(size):
            n = rng.randint(2, 14)
            segs = [("model", ids(n), [-2.0] * n)]
            if rng.random() < 0.5:
                segs += [("tool", ids(4)), ("model", ids(3), [-2.0] * 3)]
            trajs.append(make_traj(prompt, segs, p, k))
    gen = torch.Generator().manual_seed(seed)
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=gen))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from aepo_engine.models import build_tiny_qwen3

    # initializer_range 0.3: peaked distributions (entropy std ~0.5 nats). With the default 0.02 the
    # entropies all sit within 1e-3 of log V, and the z-score (docs/algorithm.md §2b) divides
    # fp32 noise by that.
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), vocab_size=300, hidden_size=64,
                            intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=32,
                            initializer_range=0.3)


def vocab_of(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def make_worker(path, optim=SGD_LIKE, temperature=1.0, **overrides) -> PolicyWorker:
    overrides.setdefault("param_dtype", "float32")
    return PolicyWorker(str(path), PolicyConfig(**overrides), optim, total_steps=100, temperature=temperature)


def with_old_policy(worker: PolicyWorker, batch: TokenBatch) -> TokenBatch:
    logprobs, entropy = worker.compute_logprobs(batch)
    return dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy)


def params(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


def relative_delta_gap(before, after_a, after_b) -> float:
    """max |delta_a - delta_b| / max |delta_a| over all parameters."""
    gap = max((after_a[k] - after_b[k]).abs().max().item() for k in before)
    scale = max((after_a[k] - before[k]).abs().max().item() for k in before)
    return gap / scale


# --- TokenBatch -------------------------------------------------------------------------------------

def test_token_batch_alignment_by_hand():
    # prompt [11 12 13]; model 21 22; tool 31 32; model 23.  Second row: prompt [14], model 24.
    a = make_traj([11, 12, 13], [("model", [21, 22], [-0.1, -0.2]), ("tool", [31, 32]), ("model", [23], [-0.3])])
    b = make_traj([14], [("model", [24], [-0.4])], prompt_index=1)
    batch = TokenBatch.from_trajectories([a, b], [1.5, -0.5], pad_token_id=0)
    # position: 0   1   2   3   4   5   6   7
    # ids     : 11  12  13  21  22  31  32  23
    # label   : 12  13  21  22  31  32  23  --    (position t predicts token t+1)
    # mask    :  0   0   1   1   0   0   1   0    (labels 21, 22, 23 are model-written)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 23], [14, 24, 0, 0, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1, 0, 0, 0, 0, 0, 0]]
    x = IGNORE_INDEX
    assert batch.labels.tolist() == [[12, 13, 21, 22, 31, 32, 23, x], [24, x, x, x, x, x, x, x]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(batch.old_logprobs[0], torch.tensor([0, 0, -0.1, -0.2, 0, 0, -0.3, 0]))
    torch.testing.assert_close(batch.old_logprobs[1], torch.tensor([-0.4, 0, 0, 0, 0, 0, 0, 0]))
    assert batch.group_ids.tolist() == [0, 1] and batch.advantages.tolist() == [1.5, -0.5]
    # the mask sits on labels equal to the model tokens, in order
    assert batch.labels[batch.loss_mask.bool()].tolist() == [21, 22, 23, 24]


def test_token_batch_splits():
    batch = random_batch(100, group_sizes=(2, 3, 1, 2, 3))  # 11 rows
    minis = batch.mini_batches(2, by="prompts")
    assert [m.num_rows for m in minis] == [5, 3, 3]
    assert [m.group_ids.tolist() for m in minis] == [[0, 0, 1, 1, 1], [2, 3, 3], [4, 4, 4]]
    assert [m.num_rows for m in batch.mini_batches(4, by="rows")] == [4, 4, 3]
    shard0, shard1 = minis[0].shard(0, 2), minis[0].shard(1, 2)
    assert shard0.num_rows == shard1.num_rows == 3
    assert shard1.loss_mask[-1].sum() == 0 and shard1.advantages[-1] == 0  # dummy row: no loss
    assert shard0.loss_mask.sum() + shard1.loss_mask.sum() == minis[0].loss_mask.sum()
    for part in minis[0].micro_batches(max_tokens=40):
        assert part.num_rows == 1 or part.num_rows * int(part.lengths.max()) <= 40
        assert part.input_ids.shape[1] == int(part.lengths.max())  # trimmed
    packed_parts = minis[0].micro_batches(max_tokens=40, packed=True)  # budget = sum of lengths
    for part in packed_parts:
        assert part.num_rows == 1 or int(part.lengths.sum()) <= 40
    assert sum(p.num_rows for p in packed_parts) == minis[0].num_rows
    assert len(packed_parts) <= len(minis[0].micro_batches(max_tokens=40))
    shuffled = batch.rows([0, 2, 1])  # prompt 0, prompt 1, prompt 0 again
    with pytest.raises(ValueError, match="consecutive"):
        shuffled.mini_batches(1)
    rejoined = concat_rows(batch.micro_batches(size=3))
    assert torch.equal(rejoined.labels, batch.labels) and torch.equal(rejoined.loss_mask, batch.loss_mask)


def test_lr_schedule_warmup_then_cosine():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(optimizer, OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), 12)
    lrs = []
    for _ in range(13):
        lrs.append(sched.get_last_lr()[0])
        optimizer.step()
        sched.step()
    # warm-up 0.5, 1.0; cosine over 10 steps: halfway (step 7) = 0.1 + 0.9 * 0.5 = 0.55; end 0.1
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0]) and lrs[7] == pytest.approx(0.55)
    assert lrs[12] == pytest.approx(0.1)


def test_policy_config_rejects_bad_values():
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"micro_batch_sz": 2}, PolicyConfig)
    with pytest.raises(ValueError, match="token-mean"):
        PolicyConfig(loss=LossConfig(aggregation="seq-mean-token-mean"))
    assert msgspec.convert({"loss": {"clip": "ppo"}}, PolicyConfig).loss.clip == "ppo"
    # docs/algorithm.md §3: 64 prompts per step, mini-batches of 8 prompts -> 8 optimizer steps (x epochs)
    assert PolicyConfig().steps_per_update(64) == 8 and PolicyConfig(ppo_epochs=2).steps_per_update(65) == 18


# --- PolicyWorker -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
def test_compute_logprobs_matches_hf_forward(tiny_model, fused):
    from transformers import AutoModelForCausalLM

    batch = random_batch(vocab_of(tiny_model))
    worker = make_worker(tiny_model, use_fused_linear=fused, temperature=0.7, micro_batch_size=3)
    logprobs, entropy = worker.compute_logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double() / 0.7
    logp_all = logits.log_softmax(-1)  # [B, L, V]
    valid = batch.labels != IGNORE_INDEX
    want = logp_all.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0] * valid
    want_h = -(logp_all.exp() * logp_all).sum(-1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[valid].double(), want_h[valid], rtol=1e-5, atol=1e-5)


def update_once(path, batch, **overrides):
    worker = make_worker(path, **overrides)
    before = params(worker)
    metrics = worker.update(with_old_policy(worker, batch))
    return before, params(worker), metrics


def test_update_is_micro_batch_invariant(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    common = dict(ppo_mini_batch_size=2)  # 2 optimizer steps of 2 prompts (4 rows)
    before, one, m_one = update_once(tiny_model, batch, micro_batch_size=1, **common)
    _, four, m_four = update_once(tiny_model, batch, micro_batch_size=4, **common)
    _, budget, _ = update_once(tiny_model, batch, micro_batch_max_tokens=30, **common)
    assert m_one["optimizer_steps"] == 2 and m_one["skipped_steps"] == 0
    assert relative_delta_gap(before, one, four) < 2e-5
    assert relative_delta_gap(before, one, budget) < 2e-5
    assert m_one["loss"] == pytest.approx(m_four["loss"], rel=1e-5, abs=1e-7)
    assert m_one["grad_norm"] == pytest.approx(m_four["grad_norm"], rel=1e-5)
    assert m_one["tokens"] == m_four["tokens"] == batch.loss_mask.sum().item()


def test_micro_batch_entropy_scope_depends_on_the_split(tiny_model):
    """The reference behaviour: the same data, split differently, gives a different update."""
    batch = random_batch(vocab_of(tiny_model))
    common = dict(ppo_mini_batch_size=2, entropy_stats_scope="micro_batch")
    before, one, m_one = update_once(tiny_model, batch, micro_batch_size=1, **common)
    _, four, m_four = update_once(tiny_model, batch, micro_batch_size=4, **common)
    assert relative_delta_gap(before, one, four) > 1e-3
    assert abs(m_one["grad_norm"] - m_four["grad_norm"]) > 1e-4 * m_four["grad_norm"]


def test_fused_and_materialised_paths_give_the_same_update(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    before, fused, m_fused = update_once(tiny_model, batch, use_fused_linear=True, temperature=0.8)
    _, plain, m_plain = update_once(tiny_model, batch, use_fused_linear=False, temperature=0.8)
    assert relative_delta_gap(before, fused, plain) < 2e-5
    assert m_fused["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_sequences_give_the_same_logprobs_and_update(tiny_model, attn):
    """Padding-free micro-batches (one row, per-row position ids -> block-diagonal causal mask)
    against padded ones: same log-probs, entropies, loss and update."""
    batch = random_batch(vocab_of(tiny_model))
    padded = make_worker(tiny_model, attn_implementation=attn, pack_sequences="off", micro_batch_size=3)
    packed = make_worker(tiny_model, attn_implementation=attn, pack_sequences="on", micro_batch_size=3)
    assert packed.policy.pack and not padded.policy.pack
    (lp_pad, h_pad), (lp_pack, h_pack) = padded.compute_logprobs(batch), packed.compute_logprobs(batch)
    torch.testing.assert_close(lp_pack, lp_pad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_pack, h_pad, rtol=1e-5, atol=1e-5)
    before, plain, m_plain = update_once(tiny_model, batch, attn_implementation=attn, pack_sequences="off")
    _, pack, m_pack = update_once(tiny_model, batch, attn_implementation=attn, pack_sequences="on")
    assert relative_delta_gap(before, plain, pack) < 2e-5
    assert m_pack["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)
    assert m_pack["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)


def test_pack_sequences_auto_packs_only_with_flash_attention():
    assert PolicyConfig(attn_implementation="flash_attention_2").packs
    assert not PolicyConfig(attn_implementation="sdpa").packs
    assert PolicyConfig(attn_implementation="sdpa", pack_sequences="on").packs
    assert not PolicyConfig(attn_implementation="flash_attention_2", pack_sequences="off").packs


def test_activation_checkpointing_gives_the_same_update(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    before, plain, _ = update_once(tiny_model, batch)
    _, ckpt, _ = update_once(tiny_model, batch, activation_checkpointing=True)
    assert relative_delta_gap(before, plain, ckpt) < 2e-5


def test_no_entropy_in_batch_uses_a_no_grad_pass_with_the_same_result(tiny_model):
    """On-policy first step: statistics from compute_logprobs' entropies == a fresh pass."""
    batch = random_batch(vocab_of(tiny_model))
    before, stored, _ = update_once(tiny_model, batch, ppo_mini_batch_size=4)
    worker = make_worker(tiny_model, ppo_mini_batch_size=4)
    worker.update(dataclasses.replace(with_old_policy(worker, batch), entropy=None))
    assert relative_delta_gap(before, stored, params(worker)) < 2e-5


def test_non_finite_gradient_skips_the_step(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    worker = make_worker(tiny_model, optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=4)
    before = params(worker)
    poisoned = with_old_policy(worker, batch)
    poisoned.advantages = batch.advantages.clone()
    poisoned.advantages[0] = float("nan")
    metrics = worker.update(poisoned)
    assert metrics["skipped_steps"] == 1 and metrics["optimizer_steps"] == 0
    assert math.isnan(metrics["grad_norm"])
    after = params(worker)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not worker.optimizer.state  # AdamW never stepped: no moments polluted by NaN
    assert all(p.grad is None for p in worker.model.parameters())
    healthy = worker.update(with_old_policy(worker, batch))  # the worker is still usable
    assert healthy["skipped_steps"] == 0 and math.isfinite(healthy["grad_norm"])
    assert all(torch.isfinite(p).all() for p in worker.model.parameters())


def test_updates_raise_the_advantage_weighted_logprob(tiny_model):
    batch = random_batch(vocab_of(tiny_model), group_sizes=(2, 2), seed=3)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    worker = make_worker(tiny_model, optim=OptimConfig(lr=3e-3), ppo_mini_batch_size=2)

    def objective(logprobs):  # sum_t A_i * logp_t over model tokens
        return (batch.advantages[:, None] * logprobs * batch.loss_mask).sum().item()

    start, losses = None, []
    for _ in range(4):
        current = with_old_policy(worker, batch)
        start = objective(current.old_logprobs) if start is None else start
        losses.append(worker.update(current)["loss"])
    end = objective(worker.compute_logprobs(batch)[0])
    assert end > start + 1.0, (start, end)
    assert losses[0] < 0 or losses[-1] < losses[0]


def test_full_state_dict_has_hf_names_and_loads_back(tiny_model):
    from transformers import AutoModelForCausalLM

    worker = make_worker(tiny_model)
    state = worker.full_state_dict()
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert set(state) == set(hf.state_dict())
    hf.load_state_dict(state)
    assert all(t.device.type == "cpu" for t in state.values())


def test_checkpoint_manager_round_trip(tiny_model, tmp_path):
    """model/optimizer/scheduler as the worker exposes them save and resume with CheckpointManager."""
    from aepo_engine.checkpoint import CheckpointManager

    batch = random_batch(vocab_of(tiny_model))
    optim = OptimConfig(lr=1e-3, warmup_steps=3)
    worker = make_worker(tiny_model, optim=optim, ppo_mini_batch_size=2)
    worker.update(with_old_policy(worker, batch))
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.save(1, worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler)
    resumed = make_worker(tiny_model, optim=optim, ppo_mini_batch_size=2)
    manager.load_latest(resumed.model, resumed.optimizer, resumed.scheduler)
    assert resumed.scheduler.get_last_lr() == worker.scheduler.get_last_lr()
    next_batch = with_old_policy(worker, batch)
    worker.update(next_batch)
    resumed.update(next_batch)
    a, b = params(worker), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_kl_to_reference_is_reported_and_zero_at_the_reference(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    worker = make_worker(tiny_model, loss=LossConfig(kl_coef=0.1), ppo_mini_batch_size=4)  # one step
    current = with_old_policy(worker, batch)
    current.ref_logprobs = current.old_logprobs.clone()  # reference = the policy before the update
    assert worker.update(current)["kl"] < 1e-6  # measured before the step: at the reference
    assert worker.update(current)["kl"] > 1e-4  # one step away from it
    with pytest.raises(ValueError, match="ref_logprobs"):  # kl_coef != 0 without a reference
        worker.update(with_old_policy(worker, batch))


@pytest.mark.parametrize("fused, head", [(True, "token_outer"), (True, "vocab_outer"), (True, "vocab_outer_lean"),
                                        (False, "auto")])
def test_worker_loss_is_the_one_pass_loss_of_the_two_stage_formula(tiny_model, fused, head, monkeypatch):
    """The worker's in-forward one-pass loss and gradient == policy_loss_from_logprobs on the
    model's log-probs/entropies (the former two-stage path), with the global statistics, in the
    three loop orders of the fused head (``policy.head_backward``, docs/head.md); and no extra no-grad
    pass runs inside the loss (the statistics are supplied)."""
    from aepo_engine.training.layout import LossInputs, RowModelInputs
    from aepo_kernels import entropy_moments, entropy_stats_from_moments, policy_loss_from_logprobs
    import aepo_kernels.loss_call as loss_call

    worker = make_worker(tiny_model, use_fused_linear=fused, temperature=0.8, head_backward=head)
    assert worker.policy.head_backward == head
    batch = with_old_policy(worker, random_batch(vocab_of(tiny_model)))
    batch = dataclasses.replace(batch, old_logprobs=batch.old_logprobs + 0.3 * torch.randn(batch.old_logprobs.shape))
    mean, std = entropy_stats_from_moments(entropy_moments(batch.entropy, batch.loss_mask))
    count = batch.loss_mask.sum()
    cfg = LossConfig(entropy_coef=0.01)
    worker.policy.loss_config = cfg
    adv = batch.advantages[:, None].expand_as(batch.old_logprobs)

    def grads(loss):
        worker.model.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in worker.model.named_parameters() if p.grad is not None}

    logp, entropy = worker.policy(RowModelInputs(batch.input_ids, batch.attention_mask, batch.labels))
    two_stage, stats_two = policy_loss_from_logprobs(logp, entropy, batch.old_logprobs, batch.advantages, batch.loss_mask,
                                                     config=cfg, entropy_mean=mean, entropy_std=std, global_token_count=count)
    expected = grads(two_stage)
    monkeypatch.setattr(loss_call, "_entropy_stats", lambda config, mask, m, s, entropy_pass: (m, s))  # no second pass
    import aepo_kernels.fused_linear as fused_linear

    orders = []
    for name in ("FusedLinearAEPOLossFunction", "FusedLinearAEPOVocabOuterFunction"):
        function = getattr(fused_linear, name)
        monkeypatch.setattr(function, "apply", lambda *a, _f=function.apply, _n=name: orders.append(_n) or _f(*a))
    inputs = LossInputs(batch.old_logprobs, adv, batch.loss_mask, None, count, mean, std)
    one_pass, stats_one = worker.policy(RowModelInputs(batch.input_ids, batch.attention_mask, batch.labels), inputs)
    got = grads(one_pass)
    if fused:  # the order asked for is the one that ran
        assert orders == [{"token_outer": "FusedLinearAEPOLossFunction",
                           "vocab_outer": "FusedLinearAEPOVocabOuterFunction",
                           "vocab_outer_lean": "FusedLinearAEPOVocabOuterFunction"}[head]]
    assert stats_one["clipfrac_high"] + stats_one["clipfrac_low"] > 0
    torch.testing.assert_close(one_pass, two_stage, rtol=1e-5, atol=1e-7)
    for key in ("entropy", "ratio", "clipfrac_high", "clipfrac_low"):
        torch.testing.assert_close(stats_one[key], stats_two[key], rtol=1e-5, atol=1e-6)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6)
