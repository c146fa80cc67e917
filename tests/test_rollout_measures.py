"""Per-step measurements (aepo_engine.rollout.measures), the split clip statistics (token origin
through the loss), and the tree fields of the sample dump -- hand-worked numbers in comments."""
from __future__ import annotations

import dataclasses
import json

import msgspec
import numpy as np
import pytest
import torch

from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.rollout.measures import (branching_metrics, depth_metrics, diversity_metrics, entropy_tail_metrics,
                                          jaccard_distance, premonitoring_metrics, tree_depths)
from aepo_engine.rollout.samples import SampleDumpError, read_sample_rows, sample_rows
from aepo_engine.rollout.trajectory import BranchDecision, ToolCallRecord, Trajectory
from aepo_engine.training.batch import ORIGIN_BRANCH, ORIGIN_GLOBAL, ORIGIN_INHERITED, TokenBatch
from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss
from aepo_kernels.policy_loss import loss_stats


def traj(prompt_index, traj_id, parts, kind="global", parent=None):
    """parts: ("model", ids) or ("tool", ids, tool, payload); entropies = 0.1 * token id."""
    t = Trajectory(prompt_ids=[1, 2], prompt_index=prompt_index, traj_id=traj_id, step=0, kind=kind,
                   parent_id=parent)
    for part in parts:
        if part[0] == "model":
            t.append_model_segment(part[1], [-0.5] * len(part[1]), [0.1 * i for i in part[1]], 2)
        else:
            t.append_tool_result(part[1])
            t.tool_log.append(ToolCallRecord(part[2], part[3], "result", True, 0.0))
            t.tool_calls += 1
    return t


# --- diversity ----------------------------------------------------------------------------------

def test_diversity_by_hand():
    # prompt 0: model-token sets {1,2,3}, {2,3,4}, {5}; t1's tool result holds token 5, which must
    # not count (else J(t1, t2) = 1 - 1/4). Jaccard distances 1 - 2/4 = 0.5, 1, 1 -> mean 5/6.
    # answers "The Paris" and "paris." normalise to "paris" (None left out) -> 1 distinct;
    # tool sequences (search, a) twice (payload stripped) and () -> 2.
    # prompt 1: {7} and {7} -> 0; answers 4 and 5 -> 2; no calls -> 1 sequence.
    p0 = [traj(0, 0, [("model", [1, 2, 3]), ("tool", [9], "search", "a"), ("model", [3])]),
          traj(0, 1, [("model", [2, 3]), ("tool", [5], "search", " a "), ("model", [4])]),
          traj(0, 2, [("model", [5])])]
    p1 = [traj(1, 0, [("model", [7, 7])]), traj(1, 1, [("model", [7])])]
    out = diversity_metrics(p0 + p1, ["The Paris", "paris.", None, "4", "5"])
    assert out["diversity/distinct_answers"] == pytest.approx((1 + 2) / 2)
    assert out["diversity/distinct_tool_sequences"] == pytest.approx((2 + 1) / 2)
    assert out["diversity/pairwise_distance"] == pytest.approx((5 / 6 + 0) / 2)


def test_diversity_is_order_free_and_checks_alignment():
    rng = np.random.default_rng(0)
    trajs = [traj(int(p), i, [("model", list(rng.integers(0, 20, size=int(rng.integers(1, 9)))))])
             for i, p in enumerate(rng.integers(0, 3, size=11))]
    answers = [str(x) for x in rng.integers(0, 4, size=11)]
    order = rng.permutation(11)
    assert diversity_metrics(trajs, answers) == pytest.approx(
        diversity_metrics([trajs[i] for i in order], [answers[i] for i in order]))
    with pytest.raises(ValueError, match="answers"):
        diversity_metrics(trajs, answers[:-1])
    assert jaccard_distance(set(), set()) == 0.0 and jaccard_distance({1}, set()) == 1.0


# --- entropy tail ---------------------------------------------------------------------------------

def test_entropy_tail_by_hand():
    values = np.arange(11) * 0.2  # 0.0, 0.2, ..., 2.0
    out = entropy_tail_metrics(values, threshold=1.0)
    assert out["entropy/mean"] == pytest.approx(1.0)
    assert out["entropy/p90"] == pytest.approx(1.8)           # position 0.9 * 10 = 9
    assert out["entropy/p99"] == pytest.approx(1.8 + 0.9 * 0.2)  # position 9.9
    assert out["entropy/high_frac"] == pytest.approx(5 / 11)  # 1.2, 1.4, ..., 2.0 (1.0 is not above)
    assert entropy_tail_metrics([], 1.0)["entropy/p99"] == 0.0


# --- tree depth ---------------------------------------------------------------------------------

def forked(parent, at_segment, traj_id, own):
    child = parent.fork(at_segment, traj_id)
    child.append_model_segment(own, [-0.5] * len(own), [0.3] * len(own), 2)
    return child


def test_tree_depth_by_hand():
    # prompt 0: t0, t1 global; t2 branch of t0 (depth 1); t3 branch of t2 (2); t4 branch of t1 (1)
    # prompt 1: one global (0). prompt 2: a branch whose parent (t7) is not returned (1).
    t0 = traj(0, 0, [("model", [1]), ("tool", [9], "search", "x"), ("model", [2]), ("tool", [9], "search", "y"),
                     ("model", [3])])
    t1 = traj(0, 1, [("model", [1]), ("tool", [9], "search", "x"), ("model", [2])])
    t2 = forked(t0, 2, 2, [4])
    t2.append_tool_result([9])
    t3 = forked(t2, 4, 3, [5])
    t4 = forked(t1, 2, 4, [6])
    lone = dataclasses.replace(forked(t1, 2, 1, [6]), prompt_index=2, parent_id=7)
    trajs = [t0, t1, t2, t3, t4, traj(1, 0, [("model", [1])]), traj(2, 0, [("model", [1])], kind="probe"), lone]
    depths = tree_depths(trajs)
    assert [depths[(0, i)] for i in range(5)] == [0, 0, 1, 2, 1]
    assert depths[(1, 0)] == 0 and depths[(2, 0)] == 0 and depths[(2, 1)] == 1
    out = depth_metrics(trajs)
    assert out["rollout/tree_depth_mean"] == pytest.approx((2 + 0 + 1) / 3)
    assert out["rollout/tree_depth_max"] == 2
    assert out["rollout/branch_depth_mean"] == pytest.approx((1 + 2 + 1 + 1) / 4)
    assert depth_metrics([traj(0, 0, [("model", [1])])])["rollout/branch_depth_mean"] == 0.0


# --- branching mechanisms and pre-monitoring ---------------------------------------------------

def decision(alpha, l, branched, h_init=1.0, h_now=1.0, step=1):
    """A decision with P as the default rule computes it (gamma 0.2, slope 0.05, penalty on)."""
    p = (alpha + 0.2 * (h_now - h_init)) * (1 - 0.05 * l)
    return BranchDecision(tool_step=step, h_init=h_init, h_now=h_now, alpha=alpha, consecutive_branches=l,
                          probability=p, branched=branched, budget_blocked=False)


def test_branching_metrics_by_hand():
    # prompt 0 (5 trajectories): t0 branches at tool step 1 (l 0, -> t1) and 2 (l 1, -> t3); t1, born
    # with l 1, decides with alpha 0.42 and dH 0.5: P without the penalty 0.42 + 0.1 = 0.52 > 0.5,
    # with it 0.52 * 0.95 = 0.494 <= 0.5 -> not branched, the one decision the penalty decides;
    # t2 branches once (l 0, -> t4). prompt 1 (3): t0 branches once (l 0, -> t1).
    # 4 branches / 8 trajectories; most by one trajectory 2; concentration (2/3 + 1/1) / 2;
    # runs (l + 1 of each branch) [1, 2, 1, 1]: max 2, mean 5/4, share with l >= 1 1/4;
    # 5 decisions, 1 decisive.
    p0 = [traj(0, i, [("model", [1])], kind="global" if i in (0, 2) else "branch") for i in range(5)]
    p0[0].decisions += [decision(0.6, 0, True), decision(0.7, 1, True, step=2)]
    p0[1].decisions += [decision(0.42, 1, False, h_init=1.0, h_now=1.5, step=2)]
    p0[2].decisions += [decision(0.8, 0, True)]
    p1 = [traj(1, i, [("model", [1])], kind="branch" if i == 1 else "global") for i in range(3)]
    p1[0].decisions += [decision(0.9, 0, True)]
    out = branching_metrics(p0 + p1, RolloutConfig())
    assert out == pytest.approx({
        "rollout/branches_per_traj": 4 / 8, "rollout/branches_per_traj_max": 2.0,
        "rollout/branch_concentration": (2 / 3 + 1) / 2, "rollout/branch_run_max": 2.0,
        "rollout/branch_run_mean": 5 / 4, "rollout/consecutive_branch_share": 1 / 4,
        "rollout/penalty_decisive": 1.0, "rollout/penalty_decisive_share": 1 / 5})
    # the count follows the rule's constants: a steeper penalty also decides t0's second branch
    # (0.7 * (1 - 0.3) = 0.49); with gamma 0 t1's P without the penalty is 0.42 (not decisive)
    assert branching_metrics(p0 + p1, RolloutConfig(penalty_slope=0.3))["rollout/penalty_decisive"] == 2.0
    assert branching_metrics(p0 + p1, RolloutConfig(gamma=0.0))["rollout/penalty_decisive"] == 0.0
    # no decisions: counts 0, the shares that need a branch or a decision left out
    assert branching_metrics([traj(0, 0, [("model", [1])])], RolloutConfig()) == {
        "rollout/branches_per_traj": 0.0, "rollout/branches_per_traj_max": 0.0, "rollout/branch_run_max": 0.0,
        "rollout/penalty_decisive": 0.0}


@pytest.mark.parametrize("penalty", [True, False])
def test_branching_metrics_of_real_rollouts(penalty):
    """The scheduler with a scripted agent (3 tool calls) and alpha 0.9, gamma 0, slope 0.5: a
    lineage at l >= 1 has P <= 0.45, so every such decision is decided by the penalty; with it on
    no run is longer than 1 (AEPO), with it off (ARPO) the lineages branch on consecutive steps."""
    from fakes import make, tool_agent

    scheduler, _, _ = make(tool_agent(3), k=8, pre_monitoring=False, fixed_global_samples=2,
                           branch_alpha_mode="constant", branch_alpha=0.9, gamma=0.0, penalty_slope=0.5,
                           branch_penalty=penalty)
    result = scheduler.rollout([[50], [60]], step=0)
    trajs = result.trajectories
    out = branching_metrics(trajs, scheduler.config)
    decisions = [d for t in trajs for d in t.decisions]
    assert out["rollout/branches_per_traj"] * len(trajs) == result.stats.branches > 0
    assert out["rollout/penalty_decisive"] == sum(d.consecutive_branches >= 1 for d in decisions) > 0
    if penalty:
        assert out["rollout/branch_run_max"] == 1 and out["rollout/consecutive_branch_share"] == 0
    else:
        assert out["rollout/branch_run_max"] >= 2 and out["rollout/consecutive_branch_share"] > 0


def test_premonitoring_metrics_by_hand():
    out = premonitoring_metrics([5, 4, 6], [0.2, None, 0.4], [0.1, None, 0.3])
    assert out == pytest.approx({"rollout/m_min": 4.0, "rollout/m_max": 6.0, "rollout/h_root_mean": 0.3,
                                 "rollout/h_tool_mean": 0.2})
    # without pre-monitoring (m = k/2 everywhere) only the budget is reported
    assert premonitoring_metrics([4, 4], [None, None], [None, None]) == {"rollout/m_min": 4.0, "rollout/m_max": 4.0}
    with pytest.raises(ValueError, match="length"):
        premonitoring_metrics([4], [None, None], [None])


# --- token origin and split clip statistics ----------------------------------------------------

def test_token_origin_by_hand():
    # parent: model [21 22], tool [31], model [23]; child forks after the tool (prefix 3 tokens) and
    # writes [24 25]. Prompt [1 2]: response token j sits at label position 1 + j; width 2 + 5.
    parent = traj(0, 0, [("model", [21, 22]), ("tool", [31], "search", "q"), ("model", [23])])
    child = forked(parent, 2, 1, [24, 25])
    batch = TokenBatch.from_trajectories([parent, child], [1.0, -1.0])
    g, b, i = ORIGIN_GLOBAL, ORIGIN_BRANCH, ORIGIN_INHERITED
    assert batch.token_origin.tolist() == [[0, g, g, g, g, 0, 0], [0, i, i, i, b, b, 0]]
    assert batch.labels[1, 4:6].tolist() == [24, 25]
    # splits and shards carry it along
    assert batch.rows([1]).token_origin.tolist() == [[0, i, i, i, b, b, 0]]
    assert batch.rows([0]).token_origin.tolist() == [[0, g, g, g, g, 0]]  # trimmed


def test_split_loss_stats_by_hand():
    # ratio 1.5 (A>0: high clip), 0.5 (A<0: low clip), 1.0, 1.3 (A<0: not a high clip); eps 0.2.
    ratio = torch.tensor([1.5, 0.5, 1.0, 1.3])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4)
    branch = torch.tensor([True, True, False, False])
    stats = loss_stats(torch.zeros(4), ratio, adv, mask, LossConfig(), None,
                        {"branch": branch, "global": ~branch})
    assert stats["clipfrac_high"].item() == pytest.approx(1 / 4)
    assert stats["clipfrac_high/branch"].item() == pytest.approx(1 / 2)
    assert stats["clipfrac_high/global"].item() == 0.0
    assert stats["clipfrac_low/branch"].item() == pytest.approx(1 / 2)
    assert stats["num_tokens/branch"].item() == 2 and stats["num_tokens/global"].item() == 2
    with pytest.raises(ValueError, match="shaped like loss_mask"):
        loss_stats(torch.zeros(4), ratio, adv, mask, LossConfig(), None, {"branch": branch[:3]})


@pytest.mark.parametrize("path", ["logits", "reference", "fused_linear"])
def test_split_stats_equal_stats_of_the_masked_loss(path):
    """A stats mask gives the statistics of the same call with the loss mask narrowed to it."""
    gen = torch.Generator().manual_seed(3)
    B, T, D, V = 3, 37, 16, 101  # odd shapes
    hidden, weight = torch.randn(B, T, D, generator=gen), torch.randn(V, D, generator=gen) * 0.5
    labels = torch.randint(0, V, (B, T), generator=gen)
    old = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None])[..., 0]
    old = old + 0.4 * torch.randn(B, T, generator=gen)  # off-policy: some ratios leave the clip range
    adv, mask = torch.randn(B, T, generator=gen), (torch.rand(B, T, generator=gen) > 0.2).float()
    part = torch.rand(B, T, generator=gen) > 0.5
    common = dict(config=LossConfig(), entropy_mean=torch.tensor(1.0), entropy_std=torch.tensor(0.5))

    def run(loss_mask, masks=None):
        if path != "fused_linear":
            return aepo_policy_loss(hidden @ weight.T, labels, old, adv, loss_mask, stats_masks=masks,
                                    backend="torch" if path == "logits" else "reference", shift_labels=False, **common)[1]
        return fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, loss_mask, backend="torch",
                                             stats_masks=masks, shift_labels=False, **common)[1]

    split, narrowed = run(mask, {"part": part}), run(mask * part)
    assert 0 < narrowed["clipfrac_high"] < 1 and 0 < narrowed["clipfrac_low"] < 1
    for key in ("clipfrac_high", "clipfrac_low", "entropy", "ratio", "num_tokens"):
        torch.testing.assert_close(split[f"{key}/part"], narrowed[key])


def test_worker_reports_branch_and_global_clip_fractions(tmp_path):
    """One optimizer step, off-policy old log-probs: the split clip fractions equal the overall ones
    of the same update with the loss restricted to branch (global) tokens."""
    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.training import PolicyConfig, PolicyWorker
    from aepo_engine.training.optim import OptimConfig

    model = build_tiny_qwen3(tmp_path / "m", vocab_size=120, hidden_size=32, intermediate_size=64, num_heads=2,
                             num_kv_heads=1, head_dim=32, initializer_range=0.3)
    rng = np.random.default_rng(1)
    ids = lambda n: [int(x) for x in rng.integers(10, 120, size=n)]  # noqa: E731
    trajs = []
    for p in range(3):
        parent = traj(p, 0, [("model", ids(5)), ("tool", ids(3), "search", "q"), ("model", ids(4))])
        trajs += [parent, forked(parent, 2, 1, ids(int(rng.integers(3, 9)))), traj(p, 2, [("model", ids(7))])]
    batch = TokenBatch.from_trajectories(trajs, torch.tensor(rng.standard_normal(len(trajs)), dtype=torch.float32))
    policy = PolicyConfig(param_dtype="float32", ppo_mini_batch_size=3, micro_batch_size=2,
                          loss=LossConfig(entropy_adv_alpha=0.0))

    def update(b, **overrides):
        config = msgspec.structs.replace(policy, **overrides)
        worker = PolicyWorker(str(model), config, OptimConfig(lr=1e-3), total_steps=10)
        logprobs, entropy = worker.compute_logprobs(b)
        return worker.update(dataclasses.replace(b, old_logprobs=logprobs + 0.5 * noise, entropy=entropy))

    noise = torch.tensor(np.random.default_rng(2).standard_normal(tuple(batch.loss_mask.shape)), dtype=torch.float32)
    full = update(batch)
    origin = batch.token_origin
    for name, value in (("branch", ORIGIN_BRANCH), ("global", ORIGIN_GLOBAL)):
        only = update(dataclasses.replace(batch, loss_mask=batch.loss_mask * (origin == value)))
        assert full[f"tokens/{name}"] == only["tokens"] == float((batch.loss_mask * (origin == value)).sum())
        for key in ("clipfrac_high", "clipfrac_low", "entropy"):
            assert full[f"{key}/{name}"] == pytest.approx(only[key], rel=1e-5, abs=1e-7)
    inherited = float((batch.loss_mask * (origin == ORIGIN_INHERITED)).sum())
    assert full["tokens/branch"] + full["tokens/global"] + inherited == full["tokens"]
    assert full["clipfrac_high/branch"] + full["clipfrac_low/branch"] > 0
    # micro-batching does not change them (token-weighted sums, not means of means)
    split_once = update(batch, micro_batch_size=9)
    for key in ("tokens/branch", "clipfrac_high/branch", "clipfrac_low/global", "entropy/branch"):
        assert split_once[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7)
    # no branch tokens at all: the branch statistics are left out, the count is 0
    plain = update(dataclasses.replace(batch, loss_mask=batch.loss_mask * (origin == ORIGIN_GLOBAL)))
    assert plain["tokens/branch"] == 0 and "clipfrac_high/branch" not in plain


# --- sample dump ---------------------------------------------------------------------------------

class CharTokenizer:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_sample_rows_dump_whole_trees_and_read_back(tmp_path):
    parent = traj(0, 0, [("model", [21, 22]), ("tool", [31], "search", "q"), ("model", [23])])
    decision = BranchDecision(tool_step=1, h_init=2.15, h_now=2.3, alpha=0.4, consecutive_branches=0,
                              probability=0.43, branched=True, budget_blocked=False)
    parent.decisions.append(decision)
    child = forked(parent, 2, 1, [24, 25])
    other = traj(1, 0, [("model", [5])])
    trajs = [parent, child, traj(0, 2, [("model", [6])]), other, traj(1, 1, [("model", [7])])]
    rows = sample_rows(trajs, [1.0, 0.0, 0.5, 0.0, 1.0], [True, False, False, False, True],
                       ["a", None, "b", None, "c"], CharTokenizer(), count=4, trees=1)
    # the whole tree of prompt 0 (3 rows) + the first 4 trajectories (adds prompt 1's t0)
    assert [(r["prompt_index"], r["traj_id"], r["whole_tree"]) for r in rows] == [
        (0, 0, True), (0, 1, True), (0, 2, True), (1, 0, False)]
    c = rows[1]
    assert (c["kind"], c["parent_id"], c["branch_position"], c["branch_tool_step"], c["depth"]) == ("branch", 0, 3, 1, 1)
    assert c["segments"] == [["model", 0, 2], ["tool", 2, 3], ["model", 3, 5]]
    assert c["head_entropies"] == pytest.approx([2.15, 0.3])  # (2.1 + 2.2) / 2 inherited; its own 0.3
    assert rows[0]["decisions"] == [dataclasses.asdict(decision)] and rows[0]["group_size"] == 3
    assert rows[0]["tool_log"] == [{"tool": "search", "payload": "q", "ok": True}]
    assert c["response"] == "21 22 31 24 25" and c["answer"] is None and rows[0]["answer"] == "a"
    path = tmp_path / "step_000000.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_sample_rows(path, trees=True) == rows
    # an old (format 1) dump reads, but not for trees; broken files say where
    old = {k: rows[0][k] for k in ("prompt_index", "traj_id", "kind", "parent_id", "reward", "response")}
    path.write_text(json.dumps(old) + "\n")
    assert read_sample_rows(path) == [old]
    with pytest.raises(SampleDumpError, match="format-1 dump"):
        read_sample_rows(path, trees=True)
    path.write_text(json.dumps(old) + "\n{oops\n")
    with pytest.raises(SampleDumpError, match=":2: not JSON"):
        read_sample_rows(path)
    with pytest.raises(SampleDumpError, match="no sample dump"):
        read_sample_rows(tmp_path / "step_000009.jsonl")
