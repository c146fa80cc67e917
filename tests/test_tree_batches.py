"""Training on the rollout tree (policy.tree_batches) against one row per trajectory.

The tries (training/tree.py) by hand; the tree attention (training/tree_attention.py) against
SDPA with the dense ancestor mask; then the PolicyWorker in both layouts on the same weights:
log-probs, entropies, the loss, its statistics and every parameter's gradient agree to fp32
rounding (relative 1e-5), for every clip rule, on hand-made tries (deep branches, a branch at the
first response token, identical trajectories, a prefix trajectory, a group of one) and on batches
the real rollout scheduler made with branching; with KL, entropy bonus, rollout-correction
weights and masks, counterfactual statistics and node-budget micro-batches.
"""
from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch
from runs import dist_tests, launch_torchrun

from aepo_engine.rollout.trajectory import Trajectory
from aepo_engine.training import TokenBatch
from aepo_engine.training.batch import ORIGIN_INHERITED
from aepo_engine.training.tree import TreeMicroBatch, build_forest, logprob_keys, pack_groups, update_keys
from aepo_engine.training.tree_attention import TreeMask
from aepo_kernels import CLIP_RULES, LossConfig

from test_policy_worker import make_worker, tiny_model, vocab_of  # noqa: F401  (tiny_model: fixture)


# --- batches ---------------------------------------------------------------------------------------

def _global(prompt, group, traj_id, rng, segments):
    traj = Trajectory(prompt_ids=list(prompt), prompt_index=group, traj_id=traj_id, step=0, kind="global")
    _extend(traj, rng, segments)
    return traj


def _extend(traj, rng, segments):
    """segments: ("model", n) / ("tool", n) / ("model", [ids]) appended with random ids."""
    for kind, what in segments:
        ids = what if isinstance(what, list) else [rng.randrange(20, 290) for _ in range(what)]
        if kind == "model":
            traj.append_model_segment(ids, [-1.5] * len(ids), [1.0] * len(ids), 4)
        else:
            traj.append_tool_result(ids)
    return traj


def hand_made_batch(seed: int = 0) -> TokenBatch:
    """Four groups: deep branches (a branch of a branch of a branch), a fork at the first response
    token, identical and prefix trajectories, a group of one."""
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(20, 290) for _ in range(n)]  # noqa: E731
    trajs = []
    p = prompt(6)  # deep branches
    t0 = _global(p, 0, 0, rng, [("model", 7), ("tool", 3), ("model", 5), ("tool", 4), ("model", 6)])
    t1 = _extend(t0.fork(2, 1), rng, [("model", 4), ("tool", 2), ("model", 5)])
    t2 = _extend(t1.fork(4, 2), rng, [("model", 3), ("tool", 3), ("model", 4)])
    t3 = _extend(t2.fork(6, 3), rng, [("model", 6)])
    t4 = _extend(t0.fork(4, 4), rng, [("model", 2)])
    trajs += [t0, t1, t2, t3, t4]
    p = prompt(4)  # a fork at the first response token: only the prompt is shared
    first = [rng.randrange(20, 290) for _ in range(5)]
    trajs += [_global(p, 1, 0, rng, [("model", first), ("tool", 2), ("model", 3)]),
              _global(p, 1, 1, rng, [("model", [first[0] + 1] + first[1:])]),
              _global(p, 1, 2, rng, [("model", 8)])]
    p = prompt(5)  # identical trajectories and a prefix of one
    same = [rng.randrange(20, 290) for _ in range(9)]
    trajs += [_global(p, 2, i, rng, [("model", list(same))]) for i in range(2)]
    trajs += [_global(p, 2, 2, rng, [("model", same[:4])])]
    trajs += [_global(prompt(7), 3, 0, rng, [("model", 6), ("tool", 2), ("model", 3)])]  # a group of one
    gen = torch.Generator().manual_seed(seed)
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=gen))


def scheduler_batch(seed: int = 0) -> TokenBatch:
    """Trajectories from the real rollout scheduler (branching after tool results, entropies that
    rise after results so that it branches), over a scripted character-level model."""
    from fakes import make, tool_agent

    rollout, _, _ = make(tool_agent(3, h_first=0.5, h_after=3.0, seed_in_text=True), k=6, seed=seed,
                         max_tokens_per_segment=40, max_response_tokens=200)
    result = rollout.rollout([[40 + i, 50 + i, 60] for i in range(3)], step=0)
    trajs = sorted(result.trajectories, key=lambda t: (t.prompt_index, t.traj_id))
    assert any(t.kind == "branch" for t in trajs), "the scripted rollout was meant to branch"
    gen = torch.Generator().manual_seed(seed)
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=gen))


# --- the tries ---------------------------------------------------------------------------------------

def test_trie_by_hand():
    # row 0: 5 6 7 8      row 1: 5 6 9      row 2 (group 1): 3 4      row 3 (group 1): 3 4 (identical)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [3, 4, 0, 0], [3, 4, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])
    zeros = torch.zeros(4, 4)
    batch = TokenBatch(ids, attn, ids, zeros, torch.zeros(4), zeros, torch.tensor([0, 0, 1, 1]))
    forest = build_forest(batch, logprob_keys(batch))
    # nodes: 0:5 1:6 2:7 3:8 (row 0), 4:9 (row 1), 5:3 6:4 (row 2); row 3 adds nothing
    assert forest.tokens.tolist() == [5, 6, 7, 8, 9, 3, 4]
    assert forest.parent.tolist() == [-1, 0, 1, 2, 1, -1, 5]
    assert forest.depth.tolist() == [0, 1, 2, 3, 2, 0, 1]
    assert forest.path.tolist() == [[0, 1, 2, 3], [0, 1, 4, -1], [5, 6, -1, -1], [5, 6, -1, -1]]
    assert forest.own_start.tolist() == [0, 2, 0, 2]
    assert forest.label_node.tolist() == [[1, 2, 3, -1], [1, 4, -1, -1], [6, -1, -1, -1], [6, -1, -1, -1]]
    assert forest.labels.tolist() == [-100, 6, 7, 8, 9, -100, 4]
    # a key that differs (e.g. an old log-prob) splits the shared prefix where it differs
    old = zeros.clone()
    old[1, 0] = 0.5  # row 1's label position 0 = its token 1
    tampered = dataclasses.replace(batch, old_logprobs=old)
    keyed = build_forest(tampered, update_keys(tampered))
    assert keyed.own_start.tolist() == [0, 1, 0, 2] and keyed.num_nodes == 8  # row 1: 6', 9
    assert pack_groups([5, 3, 9, 2, 2], [1, 1, 1, 1, 1], 8, None) == [slice(0, 2), slice(2, 3), slice(3, 5)]


def test_hand_made_tries_share_what_they_should():
    batch = hand_made_batch()
    forest = build_forest(batch, logprob_keys(batch))
    real = batch.attention_mask.bool()
    assert torch.equal(forest.tokens[forest.path[real]], batch.input_ids[real])  # every row reads its own tokens
    assert torch.equal(forest.depth[forest.path[real]], torch.nonzero(real)[:, 1])
    assert forest.inherited_unshared == 0  # every inherited token is its parent's node
    rows = batch.lengths.tolist()
    assert forest.own_start[9] == rows[9] and forest.own_start[10] == rows[10]  # identical / prefix: no node
    assert forest.own_start[5:8].tolist() == [0, 4, 4]  # the fork at the first response token
    assert forest.own_start[11] == 0  # the group of one
    # a branch whose inherited prefix was tampered with shares only up to the change
    trajs_changed = batch.input_ids.clone()
    trajs_changed[1, 10] += 1  # inside branch 1's inherited prefix (prompt 6 + 7 model tokens)
    changed = dataclasses.replace(batch, input_ids=trajs_changed)
    assert build_forest(changed, logprob_keys(changed)).inherited_unshared > 0
    assert (batch.token_origin == ORIGIN_INHERITED).any()


@pytest.mark.parametrize("make_batch", [hand_made_batch, scheduler_batch])
def test_tree_attention_is_the_ancestor_mask(make_batch):
    batch = make_batch()
    forest = build_forest(batch, logprob_keys(batch))
    mask = TreeMask(forest.depth, forest.owner, forest.path, forest.own_start, chunk=8)
    n = forest.num_nodes
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for node in range(n):
        a = node
        while a >= 0:
            ancestors[node, a] = True
            a = int(forest.parent[a])
    assert torch.equal(mask.dense(), ancestors)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 32, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ancestors, enable_gqa=True)
    got = mask.sdpa_chunks(q, k, v, None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(mask.buckets()[0]) > 2  # rows longer than one chunk: several SDPA calls


@pytest.mark.slow
def test_flex_block_mask_matches_on_cpu_forward():
    """The CUDA path's block mask, checked where it runs here: FlexAttention's compiled CPU forward
    (no backward on CPU in torch 2.13) against the chunked SDPA."""
    batch = scheduler_batch()
    forest = build_forest(batch, logprob_keys(batch))
    mask = TreeMask(forest.depth, forest.owner, forest.path, forest.own_start)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, forest.num_nodes, 32, generator=gen) for h in (4, 2, 2))
    with torch.no_grad():
        got = mask.flex(q, k, v, None)
    torch.testing.assert_close(got, mask.sdpa_chunks(q, k, v, None), rtol=1e-5, atol=1e-5)


# --- the worker in both layouts ---------------------------------------------------------------------

def _per_node_noise(batch: TokenBatch, scale: float, seed: int) -> torch.Tensor:
    """[B, L] label-aligned noise that is the same at every occurrence of a trie node (so the
    update's keys still share), 0 where the label is not model-written."""
    micro = TreeMicroBatch.build(batch)
    noise = torch.randn(micro.forest.num_nodes, generator=torch.Generator().manual_seed(seed)) * scale
    return micro.to_rows(noise) * (batch.loss_mask > 0)


def _run(model, batch: TokenBatch, trees: bool, perturb: bool = True, **config):
    """Log-probs, entropies, the update's metrics and every optimizer step's gradients."""
    torch.manual_seed(0)
    worker = make_worker(model, tree_batches="on" if trees else "off", **config)
    logprobs, entropy = worker.compute_logprobs(batch)
    update = dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy)
    if perturb:  # ratios away from 1: every clip branch is reached
        update = dataclasses.replace(update, old_logprobs=logprobs + _per_node_noise(batch, 0.5, 1))
    grads = []
    worker.optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: p.grad.detach().clone() for n, p in worker.model.named_parameters()}))
    metrics = worker.update(update)
    return logprobs, entropy, metrics, grads


def _assert_same(rows, tree, cf_rel=1e-4):
    lp_r, ent_r, m_r, g_r = rows
    lp_t, ent_t, m_t, g_t = tree
    torch.testing.assert_close(lp_t, lp_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_t, ent_r, rtol=1e-5, atol=1e-5)
    assert len(g_r) == len(g_t) > 0
    for step_r, step_t in zip(g_r, g_t):
        for name, g in step_r.items():
            gap = float((step_t[name] - g).norm() / g.norm().clamp(min=1e-30))
            # float32 sums in another order (shared prefixes once): 1.07e-5 on an AVX2-only CPU
            assert gap < 3e-5, (name, gap)
    skip = {"tokens_per_s", "positions", "position_ratio", "lr"}
    assert set(m_r) == set(m_t)
    for key, value in m_r.items():
        if key in skip:
            continue
        rel = cf_rel if key.startswith("cf/") else 1e-5
        assert m_t[key] == pytest.approx(value, rel=rel, abs=1e-7), key
    assert m_t["positions"] < m_r["positions"] and m_t["position_ratio"] < 1.0


@pytest.mark.parametrize("clip", CLIP_RULES)
def test_tree_update_equals_rows_for_every_clip_rule(tiny_model, clip):
    batch = hand_made_batch()
    config = dict(loss=LossConfig(clip=clip), micro_batch_size=6, ppo_mini_batch_size=2)
    _assert_same(_run(tiny_model, batch, False, **config), _run(tiny_model, batch, True, **config))


def test_tree_update_takes_the_head_order(tiny_model, monkeypatch):
    """``policy.head_backward`` reaches the tree loss as it reaches the row loss (docs/head.md): with
    ``vocab_outer_lean`` both layouts run the lean head, and the tree update equals the rows'."""
    import aepo_kernels.fused_linear as fused_linear

    ran = []
    real = fused_linear.lean_passes
    monkeypatch.setattr(fused_linear, "lean_passes", lambda *a, **k: ran.append(1) or real(*a, **k))
    batch = hand_made_batch()
    config = dict(loss=LossConfig(clip="aepo"), micro_batch_size=6, ppo_mini_batch_size=2,
                  head_backward="vocab_outer_lean")
    rows = _run(tiny_model, batch, False, **config)
    in_rows = len(ran)
    tree = _run(tiny_model, batch, True, **config)
    assert 0 < in_rows < len(ran)
    _assert_same(rows, tree)


def test_deterministic_mode_runs_the_tree_update_and_repeats_it_bit_for_bit(tiny_model, monkeypatch):
    """GPU review 2, point 11: ``policy.deterministic`` turns on torch's deterministic algorithms
    when the worker starts (every op of the tree update has a deterministic kernel: none raises),
    and the update repeats bit for bit. On CUDA the same switch replaces the scatter-adds' atomics;
    CPU kernels are deterministic anyway, so here it checks the wiring and that nothing refuses."""
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the worker's setdefault is undone after
    batch = hand_made_batch()
    try:
        runs = [_run(tiny_model, batch, True, deterministic=True, micro_batch_size=6, ppo_mini_batch_size=2)
                for _ in range(2)]
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    (lp_a, _, m_a, g_a), (lp_b, _, m_b, g_b) = runs
    assert torch.equal(lp_a, lp_b) and m_a["loss"] == m_b["loss"] and len(g_a) == len(g_b) > 0
    assert all(torch.equal(a[n], b[n]) for a, b in zip(g_a, g_b) for n in a)


def test_tree_update_on_scheduler_rollouts_with_everything_on(tiny_model):
    """Branched rollouts of the real scheduler; KL to reference log-probs, entropy bonus, dual clip,
    rollout-correction weights and a sequence masked out, node-budget micro-batches, logits path."""
    batch = scheduler_batch()
    gen = torch.Generator().manual_seed(3)
    ref = _per_node_noise(batch, 0.3, 2) - 1.0
    weights = torch.rand(batch.loss_mask.shape, generator=gen) + 0.5
    mask = batch.loss_mask.clone()
    mask[2] = 0  # a sequence the correction dropped
    batch = dataclasses.replace(batch, ref_logprobs=ref, token_weights=weights, loss_mask=mask)
    loss = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)
    rows = _run(tiny_model, batch, False, loss=loss, micro_batch_size=5, ppo_mini_batch_size=2, use_fused_linear=False)
    tree = _run(tiny_model, batch, True, loss=loss, micro_batch_max_tokens=200, ppo_mini_batch_size=2,
                use_fused_linear=False)
    _assert_same(rows, tree)
    assert "kl" in rows[2] and any(k.startswith("cf/") for k in rows[2])


def test_tree_micro_batches_do_not_change_the_update(tiny_model):
    """One micro-batch per group, or all groups in one: the same update (token-mean over the
    global count, statistics all-reduced)."""
    batch = hand_made_batch(seed=1)
    one = _run(tiny_model, batch, True, micro_batch_max_tokens=1, ppo_mini_batch_size=4)
    all_ = _run(tiny_model, batch, True, micro_batch_max_tokens=10_000, ppo_mini_batch_size=4)
    for a, b in zip(one[3][0].values(), all_[3][0].values()):
        assert float((a - b).norm() / b.norm()) < 1e-5
    assert one[2]["loss"] == pytest.approx(all_[2]["loss"], rel=1e-5)


@pytest.mark.slow
@dist_tests
def test_two_fsdp_ranks_on_trees_match_one_process_on_rows(tmp_path):
    """FSDP2 on 2 gloo ranks with tree batches (whole groups per rank, a node budget, activation
    checkpointing) == one process on rows: log-probs, metrics and the updated weights."""
    from transformers import AutoModelForCausalLM

    from aepo_engine.models import build_tiny_qwen3

    script = Path(__file__).resolve().parent / "dist_scripts" / "policy_update.py"
    sys.path.insert(0, str(script.parent))
    from policy_update import run

    model_dir = Path(build_tiny_qwen3(tmp_path / "model", vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.3))
    launch_torchrun([str(script), str(model_dir), str(tmp_path / "tree.pt"), "--tree-batches=on", "--max-tokens=40",
                     "--activation-checkpointing"])
    run(str(model_dir), str(tmp_path / "rows.pt"), hand_made=True)
    rows, tree = torch.load(tmp_path / "rows.pt"), torch.load(tmp_path / "tree.pt")
    assert (tree["world_size"], tree["fsdp"]) == (2, True)
    # each micro-batch's mask is planned once for all its layers and passes (FSDP2 copies the
    # mask per wrapped layer: before the shared plans, 2 layers x the passes planned it again)
    assert rows["tree_masks"] == rows["mask_plans"] == 0 and tree["tree_masks"] > 0
    assert tree["mask_plans"] == tree["tree_masks"], (tree["mask_plans"], tree["tree_masks"])
    torch.testing.assert_close(tree["logprobs"], rows["logprobs"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(tree["entropy"], rows["entropy"], rtol=1e-5, atol=2e-5)
    m_r, m_t = rows["metrics"], tree["metrics"]
    assert m_r["optimizer_steps"] == m_t["optimizer_steps"] == 2 and m_r["tokens"] == m_t["tokens"]
    for key in ("loss", "grad_norm", "entropy", "ratio", "clipfrac_low", "clipfrac_high"):
        assert m_t[key] == pytest.approx(m_r[key], rel=1e-5, abs=1e-7), key
    assert m_t["position_ratio"] < 0.8
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    gap = max((rows["state"][k] - tree["state"][k]).abs().max().item() for k in initial)
    step = max((rows["state"][k] - initial[k]).abs().max().item() for k in initial)
    assert step > 1e-3 and gap < 5e-5 * step, (gap, step)


def test_memory_plan_counts_nodes():
    """With tree batches the micro-batch is whole groups: without a node budget its positions are
    the groups' prompts once plus k responses each (4 rows < k = 12: one group of 12 rows), and the
    loss adds its gathered parent states; with a budget the activations are the budget's."""
    from aepo_engine.config import load_train_config
    from aepo_engine.memory_plan import ModelShape, micro_batch_tokens, plan_memory

    from test_memory_plan import QWEN3_14B

    shape = ModelShape.from_config(QWEN3_14B)
    base = ["--preset", "qwen3_14b_deep_research", "--policy.micro_batch_max_tokens=null"]
    rows, tree = (load_train_config(base + [f"--policy.tree_batches={m}"]) for m in ("off", "on"))
    assert micro_batch_tokens(rows) == 4 * (2000 + 6192)
    assert micro_batch_tokens(tree) == 2000 + 12 * 6192
    plan_rows, plan_tree = plan_memory(rows, shape, 8), plan_memory(tree, shape, 8)
    assert plan_rows.terms["tree"].bytes == 0
    assert plan_tree.terms["tree"].bytes >= 2 * micro_batch_tokens(tree) * 5120 * 2
    budget = load_train_config(["--preset", "qwen3_14b_deep_research", "--policy.tree_batches=on"])
    assert plan_memory(budget, shape, 8).terms["act_forward"].bytes == plan_memory(
        load_train_config(["--preset", "qwen3_14b_deep_research"]), shape, 8).terms["act_forward"].bytes
    assert "tree nodes" in plan_tree.terms["act_forward"].name


@pytest.mark.slow
def test_trainer_runs_on_trees(tmp_path):
    """``python -m aepo_engine.train`` with tree batches: rollouts, log-probs, update, metrics."""
    import json

    import runs

    proc = runs.train(tmp_path / "run", "--train.steps=2", "--policy.tree_batches=on", "--checkpoint.every_n_steps=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0 < r["loss/position_ratio"] < 1 for r in rows)
    assert all(r["loss/positions"] > 0 and r["loss/optimizer_steps"] >= 1 for r in rows)
