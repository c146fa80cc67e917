"""Tests of the entropy-balanced rollout scheduler (docs/algorithm.md §1) against a scripted backend
(``tests/fakes.py``: a character-level fake model). Tool runners are scripted (records every
batch) except in the test that uses the real ``ToolRunner``.
"""
from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from aepo_engine.algorithms.branching import branch_probability, global_sample_count, sigmoid
from aepo_engine.rollout.config import EXPERIMENTAL_FIELDS, RolloutConfig, RolloutExperiments
from aepo_engine.rollout.decisions import branch_alpha, decision_due, free_slots, slot_left
from aepo_engine.rollout.monitoring import evidence_ready, most_global_samples, tool_entropy
from aepo_engine.rollout.protocol import GenRequest
from aepo_engine.rollout.scheduler import EntropyBalancedRollout
from aepo_engine.rollout.seeds import ALPHA, SAMPLE, derive_seed
from aepo_engine.rollout.trajectory import Trajectory, format_rollout_tree, rollout_tree
from aepo_engine.tools import Tool, ToolResult, ToolRunner, format_tool_result
from fakes import EOS, CharTokenizer, Policy, ScriptedBackend, ScriptedRunner, make, tool_agent

PROMPTS = [[50, 51, 52], [60, 61], [70]]


def by_prompt(trajs: list[Trajectory]) -> dict[int, list[Trajectory]]:
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.prompt_index, []).append(t)
    return groups


def signature(trajs: list[Trajectory]):
    return [(t.prompt_index, t.traj_id, t.parent_id, t.kind, tuple(t.response_ids),
             tuple(d.branched for d in t.decisions)) for t in trajs]


# ---------------------------------------------------------------------------------------------
# The maths, hand-worked


def test_global_sample_count_hand_worked():
    # k=12, beta=0.5, H_root=2.0, H_tool=1.0: sigmoid(0.5) = 0.62246, 12 * 0.62246 = 7.47,
    # floor -> 7, + 1 -> m = 8.
    assert sigmoid(0.5) == pytest.approx(0.6224593, abs=1e-7)
    assert global_sample_count(12, 0.5, 2.0, 1.0) == 8
    # Equal entropies: floor(12 * 0.5) + 1 = 7.
    assert global_sample_count(12, 0.5, 1.0, 1.0) == 7
    # H_tool far above H_root: floor(12 * ~0) + 1 = 1; far below: floor(12 * 1.0) + 1 = 13 -> 12.
    assert global_sample_count(12, 0.5, 0.0, 100.0) == 1
    assert global_sample_count(12, 0.5, 100.0, 0.0) == 12
    assert global_sample_count(1, 0.5, 2.0, 1.0) == 1


def test_branch_probability_hand_worked():
    # alpha 0.6, gamma 0.2, dH 0.5, l 3: (0.6 + 0.1) * (1 - 0.15) = 0.595.
    assert branch_probability(0.6, 0.2, 0.5, 3, 0.05) == pytest.approx(0.595)
    # Penalty off (ARPO): 0.7 whatever l is.
    assert branch_probability(0.6, 0.2, 0.5, 3, 0.05, penalty=False) == pytest.approx(0.7)
    # l = 20: Phat = min(1, 1.0) = 1 -> P = 0; l = 30 saturates at 0 too.
    assert branch_probability(0.6, 0.2, 0.5, 20, 0.05) == 0.0
    assert branch_probability(0.6, 0.2, 0.5, 30, 0.05) == 0.0
    # Entropy drop: (0.6 + 0.2 * -1.5) * 1 = 0.3.
    assert branch_probability(0.6, 0.2, -1.5, 0, 0.05) == pytest.approx(0.3)


# ---------------------------------------------------------------------------------------------
# The scheduler's rules, hand-worked (rollout.monitoring, rollout.decisions, rollout.seeds)


def test_tool_entropy_and_when_the_probe_has_told_enough():
    # Probe head entropies: H_root 2.0, then 1.0 and 3.0 after its two tool results.
    # H_tool over all post-tool segments: (1 + 3) / 2 = 2.0; over the first only: 1.0; a probe
    # without a tool call gives the neutral H_tool = H_root.
    assert tool_entropy([2.0, 1.0, 3.0], None) == 2.0
    assert tool_entropy([2.0, 1.0, 3.0], 1) == 1.0
    assert tool_entropy([0.7], None) == 0.7
    seen = [2.0, 1.0]  # one post-tool segment so far, still running
    assert not evidence_ready(False, seen, None)  # the rule of §1a: m once the whole probe has ended
    assert evidence_ready(False, seen, 1) and not evidence_ready(False, seen, 2)
    assert evidence_ready(True, seen, None) and evidence_ready(True, seen, 2)  # ended


def test_most_global_samples_hand_worked():
    # m_max is the m of H_tool = -0.001 (entropies are >= 0, less float rounding).
    # k=12, beta=0.5, H_root=2.0: sigmoid(0.5 * 2.001) = 0.73116, 12 * 0.73116 = 8.77 -> 8 + 1 = 9.
    # H_root=0: 12 * sigmoid(0.0005) = 6.0015 -> 6 + 1 = 7. k=4: 4 * 0.500125 = 2.0005 -> 3.
    assert most_global_samples(12, 0.5, 2.0) == 9
    assert most_global_samples(12, 0.5, 0.0) == 7
    assert most_global_samples(4, 0.5, 0.0) == 3
    for h_root in (0.0, 0.4, 2.0):  # it bounds the m of every H_tool a probe can report
        for h_tool in (0.0, 0.4, 1.9, 9.0):
            assert global_sample_count(12, 0.5, h_root, h_tool) <= most_global_samples(12, 0.5, h_root)


def test_branch_slots_hand_worked():
    # m known (k = 8): 7 members leave 1 slot; 8 leave none (False), whatever the early counters say.
    assert free_slots(8, 5, 7, 0, None) == 1 and slot_left(8, 5, 7, 0, None) is True
    assert free_slots(8, 5, 8, 2, 3) == 0 and slot_left(8, 5, 8, 2, 3) is False
    # m unknown, H_root known with m_max = 5: k - m_max = 3 certain slots; 1 taken -> 2 left;
    # 3 taken -> whether one is left depends on m (None).
    assert free_slots(8, None, 4, 1, 3) == 2 and slot_left(8, None, 4, 1, 3) is True
    assert free_slots(8, None, 6, 3, 3) == 0 and slot_left(8, None, 6, 3, 3) is None
    # Before H_root (certain_slots None) no slot is certain.
    assert free_slots(8, None, 1, 0, None) == 0 and slot_left(8, None, 1, 0, None) is None


def test_decision_due_only_after_a_tool_result_of_its_own():
    t = Trajectory(prompt_ids=[5], prompt_index=0, traj_id=0, step=0, kind="global")
    t.append_model_segment([10, 11], [0.0, 0.0], [1.0, 1.0], 2)
    assert not decision_due(t)  # no tool result yet
    t.append_tool_result([12])
    assert not decision_due(t)  # its reaction is not sampled yet
    t.append_model_segment([13], [0.0], [1.5], 2)
    assert decision_due(t)  # model, tool, model: the reaction's entropy is known
    child = t.fork(2, traj_id=1)
    child.append_model_segment([14], [0.0], [0.5], 2)
    assert not decision_due(child)  # the inherited result's decision was its parent's
    child.append_tool_result([15])
    child.append_model_segment([16], [0.0], [0.5], 2)
    assert decision_due(child)


def test_branch_alpha_is_the_constant_or_a_draw_of_its_own_seed():
    t = Trajectory(prompt_ids=[5], prompt_index=2, traj_id=3, step=4, kind="global")
    assert branch_alpha(RolloutConfig(branch_alpha_mode="constant", branch_alpha=0.3), 7, t, 1) == 0.3
    draws = [branch_alpha(RolloutConfig(), 7, t, tool_step) for tool_step in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2] and all(0.0 <= a < 1.0 for a in draws)
    assert draws[0] == np.random.default_rng(derive_seed(7, 4, 2, 3, 1, ALPHA)).random()
    assert derive_seed(7, 4, 2, 3, 1, ALPHA) != derive_seed(7, 4, 2, 3, 1, SAMPLE)


def test_derived_seeds_are_those_of_earlier_runs():
    # Pinned: every sampling seed and branch draw comes from derive_seed, so a change to it
    # changes every rollout a config has produced so far.
    assert derive_seed(0, 0, 0, 0, 0, SAMPLE) == 2635072618980576772
    assert derive_seed(0, 0, 0, 0, 0, ALPHA) == 5674686527938357681
    assert derive_seed(0, 0, 0, 0, 0, SAMPLE, resumed_at=5) == 1537899932462778545


def test_config_rejects_bad_values_and_unknown_fields():
    with pytest.raises(ValueError, match="k must be >= 1"):
        RolloutConfig(k=0)
    with pytest.raises(ValueError, match="fixed_global_samples"):
        RolloutConfig(k=4, fixed_global_samples=5)
    with pytest.raises(ValueError, match="tau"):
        RolloutConfig(tau=0.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"k": 4, "n_e": 3}, RolloutConfig)
    assert RolloutConfig(k=12).global_samples_without_monitoring == 6
    assert RolloutConfig(k=1).global_samples_without_monitoring == 1


def test_config_has_help_for_every_field_and_round_trips():
    from aepo_engine.config_loader import check_config_class, dump_config, loads_config

    assert check_config_class(RolloutConfig) == []
    config = RolloutConfig(k=8, branch_alpha_mode="constant", fixed_global_samples=3,
                           experimental=RolloutExperiments(presample_children=True, speculative_branches=2))
    assert loads_config(RolloutConfig, dump_config(config)) == config
    assert "[experimental]" in dump_config(config)


def test_experimental_keys_in_their_old_place_name_the_new_one():
    # The scheduling ablations moved from [rollout] into [rollout.experimental]: a config file or
    # an override that sets one in its old place is refused with the new place in the message.
    from aepo_engine.config import TrainConfig
    from aepo_engine.config_loader import ConfigError, load_config, loads_config

    assert set(EXPERIMENTAL_FIELDS) == set(msgspec.structs.asdict(RolloutExperiments()))
    assert not set(EXPERIMENTAL_FIELDS) & {f.name for f in msgspec.structs.fields(RolloutConfig)}
    for name in EXPERIMENTAL_FIELDS:
        with pytest.raises(ConfigError, match=rf"'rollout\.{name}' in .* has moved to "
                                              rf"'rollout\.experimental\.{name}'"):
            loads_config(TrainConfig, f"[rollout]\n{name} = 1\n")
    with pytest.raises(ConfigError, match=r"'rollout\.branch_before_m' in command-line overrides has "
                                          r"moved to 'rollout\.experimental\.branch_before_m'"):
        load_config(TrainConfig, overrides=["--rollout.branch_before_m=false"])
    config = load_config(TrainConfig, overrides=["--rollout.experimental.branch_before_m=false"])
    assert config.rollout.experimental == RolloutExperiments(branch_before_m=False)
    with pytest.raises(ConfigError, match="unknown key 'rollout.no_such_key'"):  # others: as before
        loads_config(TrainConfig, "[rollout]\nno_such_key = 1\n")


# ---------------------------------------------------------------------------------------------
# Budget and grouping


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(pre_monitoring=False),
    dict(experimental=RolloutExperiments(reuse_probe_as_sample=False)),
    dict(branching=False),
    dict(branch_alpha_mode="constant", branch_alpha=1.0, gamma=0.0, branch_penalty=False, k=7),
    dict(branch_alpha_mode="constant", branch_alpha=1.0, branch_penalty=False, k=7,
         experimental=RolloutExperiments(speculative_global_samples=6)),
    dict(branch_alpha_mode="constant", branch_alpha=1.0, branch_penalty=False, k=5,
         experimental=RolloutExperiments(reuse_probe_as_sample=False, monitor_tool_steps=1)),
    dict(experimental=RolloutExperiments(branch_before_m=False, speculative_global_samples=0)),
])
def test_exactly_k_per_prompt_grouped(overrides):
    scheduler, backend, runner = make(tool_agent(3), **overrides)
    result = scheduler.rollout(PROMPTS, step=0)
    trajs = result.trajectories
    k = scheduler.config.k
    assert len(trajs) == k * len(PROMPTS)
    assert [t.prompt_index for t in trajs] == sorted(t.prompt_index for t in trajs)
    for i, group in by_prompt(trajs).items():
        assert len(group) == k
        assert [t.traj_id for t in group] == sorted(t.traj_id for t in group)
        assert all(t.done and t.prompt_ids == PROMPTS[i] for t in group)
    # One backend call per round, one tool batch per round with calls.
    assert len(backend.batches) == result.stats.rounds
    assert len(runner.batches) <= len(backend.batches)


def test_one_batched_call_per_round_across_prompts():
    scheduler, backend, runner = make(tool_agent(2), branching=False, k=3)
    scheduler.rollout(PROMPTS, step=0)
    # 9 trajectories, all in lockstep: 2 call rounds + 1 answer round.
    assert [len(b) for b in backend.batches] == [9, 9, 9]
    assert [len(b) for b in runner.batches] == [9, 9]


def test_fresh_global_samples_when_all_ended_early():
    answer_now = lambda context, request: ("<answer>x</answer>", 1.0, True)  # noqa: E731
    scheduler, backend, _ = make(answer_now, k=5, pre_monitoring=False, fixed_global_samples=2)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    assert len(trajs) == 5 and all(t.kind == "global" for t in trajs)
    assert result.stats.fresh_global_samples == 3
    assert [len(b) for b in backend.batches] == [2, 3]
    assert result.stats.finish_reasons == {"eos": 5}


# ---------------------------------------------------------------------------------------------
# Pre-monitoring


def test_pre_monitoring_m_from_probe_entropies():
    # Probe: first segment entropy 2.0 (H_root), segments after tool results 1.0 (H_tool)
    # -> m = 8 for k = 12 (hand-worked above). Constant alpha 0 never branches.
    scheduler, _, _ = make(tool_agent(2, h_first=2.0, h_after=1.0), k=12,
                           branch_alpha_mode="constant", branch_alpha=0.0)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    stats = result.stats
    assert stats.m == [8] and stats.h_root == [2.0] and stats.h_tool == [1.0]
    assert stats.kinds == {"probe": 1, "global": 11}   # probe + 7 globals + 4 fresh
    assert stats.fresh_global_samples == 4
    assert trajs[0].kind == "probe" and trajs[0].traj_id == 0


def test_probe_without_tool_calls_uses_neutral_h_tool():
    scheduler, _, _ = make(tool_agent(0, h_first=3.0), k=12)
    result = scheduler.rollout([[50]], step=0)
    # H_tool := H_root -> sigmoid(0) = 0.5 -> floor(6) + 1 = 7.
    assert result.stats.h_tool == [3.0] and result.stats.m == [7]


def test_discarded_probe_is_not_returned():
    scheduler, _, _ = make(tool_agent(1), k=4, experimental=RolloutExperiments(reuse_probe_as_sample=False))
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    assert len(trajs) == 4 and all(t.kind != "probe" and t.traj_id >= 1 for t in trajs)
    assert result.stats.discarded_probes == 1


def test_strict_order_probe_decides_first_and_its_slots_are_certain():
    # Always branch (alpha 1, no penalty); k=6; equal entropies 1.0 -> m = floor(6 * 0.5) + 1 = 4
    # -> 2 branch slots, and m_max = floor(6 * sigmoid(0.5)) + 1 = floor(3.73) + 1 = 4, so both
    # slots are certain once H_root is known. In the strict order the probe decides first
    # whether its decisions wait for m (branch_before_m=False: both after round 3) or are taken
    # online (round 2 and round 3): it takes both slots either way; only the children's ids
    # (creation order) differ. Rounds: probe 3, then globals 1-3 (3 rounds) beside the
    # children = 6 in both.
    runs = {}
    for early in (False, True):
        scheduler, backend, _ = make(tool_agent(2), k=6, branch_alpha_mode="constant",
                                     branch_alpha=1.0, branch_penalty=False,
                                     experimental=RolloutExperiments(
                                         speculative_global_samples=0, branch_before_m=early,
                                         speculative_branches=0))
        runs[early] = (scheduler.rollout([[50]], step=0), backend)
    for early, child_ids in ((False, [4, 5]), (True, [1, 2])):
        result, backend = runs[early]
        probe = result.trajectories[0]
        assert result.stats.m == [4] and result.stats.rounds == 6
        assert [d.branched for d in probe.decisions] == [True, True]
        children = [t for t in result.trajectories if t.parent_id == probe.traj_id]
        assert [c.traj_id for c in children] == child_ids
        assert [c.branch_tool_step for c in children] == [1, 2]
        assert all(c.kind == "branch" for c in children)
        assert result.stats.waited_decisions == (0 if early else 2)
    # online, the first child samples its reaction beside the probe's last segment (round 3)
    # and answers beside the globals' first segments (round 4); waiting, it needs rounds 4-5
    assert [len(b) for b in runs[True][1].batches] == [1, 1, 2, 5, 3, 3]
    assert [len(b) for b in runs[False][1].batches] == [1, 1, 1, 5, 4, 3]


def test_default_decides_online_in_the_order_decisions_are_taken():
    # Same set-up with the defaults: 2 speculative globals (k // 2 - 1) start beside the probe;
    # after round 1 H_root gives m_max = 4, so global 3 is added (top-up to m_max - 1) and the 2
    # certain slots are open. Round 2: probe, globals 1-2 react to tool 1 and decide in id order:
    # the probe takes slot 1 (child 4), global 1 slot 2 (child 5), global 2 finds no certain
    # slot and waits; it is the first waiting decision, so its child starts at once (tentative,
    # id 6). Round 3: the 4 decisions (probe, globals 1-2 after tool 2, global 3 after tool 1)
    # all wait: no certain slot is left (global 2 already waits anyway). The probe ends ->
    # m = 4: globals 1-3 are kept, the 6 slots are full, the waiting decisions are
    # budget-blocked, child 6 is discarded (its reaction, "think1 <search>q1</search>": 26
    # tokens). Round 4: global 3 and the children answer. 4 rounds (strict: 6).
    scheduler, backend, _ = make(tool_agent(2), k=6, branch_alpha_mode="constant",
                                 branch_alpha=1.0, branch_penalty=False)
    result = scheduler.rollout([[50]], step=0)
    by_id = {t.traj_id: t for t in result.trajectories}
    assert result.stats.m == [4] and result.stats.rounds == 4
    assert [len(b) for b in backend.batches] == [3, 4, 7, 3]
    assert sorted(by_id) == [0, 1, 2, 3, 4, 5]
    assert (by_id[4].parent_id, by_id[5].parent_id) == (0, 1)
    assert [d.branched for d in by_id[0].decisions] == [True, False]
    assert [d.branched for d in by_id[1].decisions] == [True, False]
    for tid in (2, 3):
        assert [d.budget_blocked for d in by_id[tid].decisions] == [True, True]
    assert result.stats.branches == 2 and result.stats.waited_decisions == 5
    assert (result.stats.discarded_speculative, result.stats.discarded_tokens) == (1, 26)


def test_tentative_child_kept_when_m_leaves_its_slot():
    # As above, but H_tool 2 > H_root 1: m = floor(6 * sigmoid(-0.5)) + 1 = floor(2.26) + 1 = 3
    # (m_max still 4): 3 slots, 2 of them certain. Global 2's waiting decision (round 2) gets
    # the third when m is known after round 3; its child (id 6) started in round 3, so it
    # answers in round 4 beside the others: 4 rounds. Without the tentative start
    # (speculative_branches=0) the same child is forked after round 3 and needs rounds 4-5.
    # Same trees, ids and decisions either way; global 3 (beyond m) is discarded in both.
    policy = _stepwise_entropy_agent({0: 1.0, 1: 2.0, 2: 2.0})
    runs = {}
    for tentative in (1, 0):
        scheduler, backend, _ = make(policy, PureRunner(), k=6, branch_alpha_mode="constant",
                                     branch_alpha=1.0, branch_penalty=False,
                                     experimental=RolloutExperiments(speculative_branches=tentative))
        runs[tentative] = (scheduler.rollout([[50]], step=0), backend)
    for tentative, batches in ((1, [3, 4, 7, 3]), (0, [3, 4, 6, 3, 1])):
        result, backend = runs[tentative]
        assert result.stats.m == [3] and [len(b) for b in backend.batches] == batches
        assert {t.traj_id: t.parent_id for t in result.trajectories} == {
            0: None, 1: None, 2: None, 4: 0, 5: 1, 6: 2}
        assert result.stats.discarded_speculative == 1  # global 3
    assert _signature(runs[1][0].trajectories) == _signature(runs[0][0].trajectories)
    assert [t.decisions for t in runs[1][0].trajectories] == \
        [t.decisions for t in runs[0][0].trajectories]
    child = next(t for t in runs[1][0].trajectories if t.traj_id == 6)
    assert child.inherited_branches == 1 and child.branch_tool_step == 1


class PureRunner(ScriptedRunner):
    """Results depend on the call only (not on how calls were batched), so that schedules that
    batch differently can be compared token by token."""

    def run(self, calls):
        self.batches.append(list(calls))
        return [ToolResult(f"{c.tool}({c.payload})", ok=True) for c in calls]


def _signature(trajectories):
    return [(t.prompt_index, t.traj_id, t.kind, t.parent_id, t.branch_tool_step,
             tuple(t.response_ids), tuple(t.logprobs)) for t in trajectories]


def test_speculative_globals_are_the_strict_orders_samples():
    # Equal entropies -> neutral m = floor(4 * 0.5) + 1 = 3 for k = 4; alpha 0 never branches, so
    # one slot per prompt is refilled once all have ended. Every trajectory takes 3 rounds
    # (2 tool calls). Strict (0): probe 3 rounds, globals 1-2 3 rounds, refill (id 3) 3 rounds.
    # 2 speculative: probe + globals 1-2 together, then the refill = 6 rounds. 3 speculative:
    # global 3 ran beside them and waits in reserve; the refill resumes it (already ended) = 3.
    runs = {}
    for spec in (0, 2, 3):
        scheduler, backend, _ = make(tool_agent(2, seed_in_text=True), PureRunner(), k=4,
                                     branch_alpha_mode="constant", branch_alpha=0.0,
                                     experimental=RolloutExperiments(speculative_global_samples=spec))
        runs[spec] = (scheduler.rollout(PROMPTS, step=3), backend)
    strict = runs[0][0]
    for spec, rounds in ((0, 9), (2, 6), (3, 3)):
        result, backend = runs[spec]
        assert result.stats.m == [3, 3, 3] and result.stats.rounds == rounds
        assert len(backend.batches[0]) == 3 * (1 + spec)
        assert _signature(result.trajectories) == _signature(strict.trajectories)
        assert result.stats.discarded_speculative == result.stats.discarded_tokens == 0
        assert result.stats.tokens_generated == strict.stats.tokens_generated


def test_speculative_globals_remove_the_probes_rounds():
    # k = 8, equal entropies -> m = 5, no branches -> 3 slots refilled. Strict: probe, then
    # globals 1-4, then the refill: 3 x 3 rounds. 4 speculative: 2 x 3. 7 speculative: 3 (the
    # reserve 5-7 is the refill).
    rounds = {}
    results = {}
    for spec in (0, 4, 7):
        scheduler, _, _ = make(tool_agent(2, seed_in_text=True), PureRunner(), k=8,
                               branch_alpha_mode="constant", branch_alpha=0.0,
                               experimental=RolloutExperiments(speculative_global_samples=spec))
        results[spec] = scheduler.rollout([[50]], step=0)
        rounds[spec] = results[spec].stats.rounds
    assert rounds == {0: 9, 4: 6, 7: 3}
    assert all(r.stats.m == [5] for r in results.values())
    assert _signature(results[4].trajectories) == _signature(results[0].trajectories)
    assert _signature(results[7].trajectories) == _signature(results[0].trajectories)


def test_speculative_globals_wait_for_m_without_branch_before_m():
    # Always branch, k = 6, m = 4 -> 2 slots, branch_before_m=False: every decision taken before
    # m waits for it and then claims in the order it was taken: round 2's decisions of the
    # probe and global 1 take the slots; all later ones are budget-blocked. Rounds: strict 3
    # (probe) + 3 (globals 1-3 beside the children) = 6; with 3 globals beside the probe the
    # children (forked after round 3, 2 and 2 rounds left) follow: 3 + 2 = 5.
    runs = []
    for spec in (0, 3):
        scheduler, _, _ = make(tool_agent(2, seed_in_text=True), PureRunner(), k=6,
                               branch_alpha_mode="constant", branch_alpha=1.0,
                               branch_penalty=False,
                               experimental=RolloutExperiments(speculative_global_samples=spec,
                                                               branch_before_m=False))
        runs.append(scheduler.rollout([[50]], step=0))
    strict, overlap = runs
    assert (strict.stats.rounds, overlap.stats.rounds) == (6, 5)
    by_id = {t.traj_id: t for t in overlap.trajectories}
    assert [d.branched for d in by_id[0].decisions] == [True, False]
    assert [d.branched for d in by_id[1].decisions] == [True, False]
    assert sorted(t.parent_id for t in overlap.trajectories if t.kind == "branch") == [0, 1]
    by_id = {t.traj_id: t for t in strict.trajectories}
    assert [d.branched for d in by_id[0].decisions] == [True, True]  # the probe went first


def test_speculative_globals_no_refill_needs_are_discarded_and_counted():
    # As above but 5 speculative: globals 4-5 wait in reserve, the probe's two children take the
    # slots, so no refill needs them: discarded, and their tokens counted apart.
    scheduler, _, _ = make(tool_agent(2, seed_in_text=True), k=6, branch_alpha_mode="constant",
                           branch_alpha=1.0, branch_penalty=False,
                           experimental=RolloutExperiments(speculative_global_samples=5))
    result = scheduler.rollout([[50]], step=0)
    stats, trajs = result.stats, result.trajectories
    # discarded: globals 4-5 and the tentative child of global 2's waiting decision
    assert len(trajs) == 6 and stats.branches == 2 and stats.discarded_speculative == 3
    assert sorted(t.traj_id for t in trajs) == [0, 1, 2, 3, 6, 7]  # ids 4, 5 were spent
    sampled = sum(sum(t.loss_mask[t.branch_position or 0:]) for t in trajs)
    assert stats.discarded_tokens > 0
    assert stats.tokens_generated - stats.discarded_tokens == sampled


def random_tool_agent(max_calls: int = 4) -> Policy:
    """Entropies and the choice between another search and an answer drawn from the request's
    seed: a different tree shape for every trajectory, reproducible."""
    import random

    def policy(context: str, request: GenRequest):
        done = context.count("<result>")
        rng = random.Random(request.seed)
        entropy = rng.uniform(0.0, 2.0) if done else rng.uniform(0.3, 1.2)
        if done < max_calls and (done == 0 or rng.random() < 0.6):
            return f"t{done} <search>q{rng.randrange(99)}</search>", entropy, False
        return "<answer>x</answer>", entropy, True

    return policy


def _tree_features(result) -> dict[str, float]:
    trajs = {t.traj_id: t for t in result.trajectories}

    def depth(t: Trajectory) -> int:
        return 0 if t.parent_id is None else 1 + depth(trajs[t.parent_id])

    decisions = [d for t in trajs.values() for d in t.decisions]
    depths = [depth(t) for t in trajs.values()]
    return {"m": result.stats.m[0], "branches": sum(d.branched for d in decisions),
            "mean_p": sum(d.probability for d in decisions) / max(1, len(decisions)),
            "blocked": sum(d.budget_blocked for d in decisions),
            "depth_1": depths.count(1), "depth_2+": sum(d >= 2 for d in depths),
            "branch_steps": sum(t.branch_tool_step or 0 for t in trajs.values())}


def _one_call(step: int, **overrides):
    scheduler, _, _ = make(random_tool_agent(), PureRunner(), k=8, **overrides)
    return scheduler.rollout([[50 + step % 3]], step=step)


STRICT = dict(experimental=RolloutExperiments(speculative_global_samples=0, branch_before_m=False))


def test_branch_before_m_is_m_known_from_the_start():
    # With the m - 1 globals the probe will keep started beside it (no reserve, no top-up), the
    # rollout is the one of m known in advance: pre-monitoring off, fixed m, where global 0 is
    # the probe's very sample (seeds derive from the id, not the kind), every decision online.
    # Identical token for token, ids and decisions included, although decisions waited for m.
    waited = branched = 0
    for step in range(60):
        m = _one_call(step, **STRICT).stats.m[0]
        known = _one_call(step, pre_monitoring=False, fixed_global_samples=m)
        early = _one_call(step, experimental=RolloutExperiments(speculative_global_samples=m - 1))
        assert early.stats.m == [m]
        assert signature(early.trajectories)[1:] == signature(known.trajectories)[1:]
        assert [t.decisions for t in early.trajectories] == [t.decisions for t in known.trajectories]
        waited += early.stats.waited_decisions > 0
        branched += early.stats.branches > 0
    assert waited >= 10 and branched >= 50  # the cases that could differ did occur


@pytest.mark.slow
def test_branching_statistics_unchanged_in_distribution():
    # 240 seeded single-prompt calls, each run three ways: the strict order, m known from the
    # start (above), and the default (k // 2 - 1 speculative globals, top-up to m_max - 1, online
    # decisions in certain slots). m is the same in every call (the probe is the same sample).
    # Paired per call, a mean difference beyond 4 standard errors has probability < 1e-4 under
    # equal distributions (CLT; the calls are independent draws). Against the strict order the
    # branch count and P agree while the tree shape does not (the z-scores at 900 calls:
    # docs/rollouts.md): there the reused probe claims the budget first, so its later tool
    # steps win slots. That is why the tree shape is compared with m known from the start, the
    # order the docstring promises.
    # Pre-sampled children (presample_children) change when a child starts, not the tree: the
    # default is compared with itself with them on, on every feature; and they save rounds.
    features = {"strict": [], "known": [], "default": [], "presample": []}
    rounds = {"default": 0, "presample": 0}
    for step in range(240):
        strict = _one_call(step, **STRICT)
        m = strict.stats.m[0]
        features["strict"].append(_tree_features(strict))
        features["known"].append(_tree_features(
            _one_call(step, pre_monitoring=False, fixed_global_samples=m)))
        presample = RolloutExperiments(presample_children=True)
        for name, extra in (("default", {}), ("presample", {"experimental": presample})):
            result = _one_call(step, **extra)
            features[name].append(_tree_features(result))
            rounds[name] += result.stats.rounds
    assert [f["m"] for f in features["default"]] == [f["m"] for f in features["strict"]]
    assert sum(f["branches"] for f in features["default"]) > 500  # budgets were contested
    assert rounds["presample"] < 0.95 * rounds["default"], rounds
    every = ("branches", "mean_p", "blocked", "depth_1", "depth_2+", "branch_steps")
    checks = {"strict": ("branches", "mean_p"), "known": every, "presample": every}
    for reference, keys in checks.items():
        for key in keys:
            diffs = [a[key] - b[key] for a, b in zip(features["default"], features[reference])]
            mean = sum(diffs) / len(diffs)
            std_err = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
            assert abs(mean) <= 4 * std_err + 1e-9, (reference, key, mean, std_err)


def test_presampled_children_same_tree_fewer_rounds():
    # m fixed at 2 of k = 4 (no pre-monitoring), always branch, 2 tool calls each. Without
    # pre-sampling: round 1 globals 0-1 search; round 2 they react to tool 1 and branch (children
    # 2, 3); round 3 they answer while the children react to tool 1; round 4 the children answer.
    # Pre-sampled: before round 2 both slots are free, so children 2 and 3 (same ids, hence the
    # same seeds) react to tool 1 beside their parents and are taken by the decisions: 3 rounds,
    # the same trajectories token for token.
    runs = {}
    for presample in (False, True):
        scheduler, backend, runner = make(tool_agent(2, seed_in_text=True), PureRunner(), k=4,
                                          pre_monitoring=False, fixed_global_samples=2,
                                          branch_alpha_mode="constant", branch_alpha=1.0,
                                          branch_penalty=False,
                                          experimental=RolloutExperiments(presample_children=presample))
        runs[presample] = (scheduler.rollout([[50]], step=0), backend, runner)
    (off, off_backend, _), (on, on_backend, _) = runs[False], runs[True]
    assert [len(b) for b in off_backend.batches] == [2, 2, 4, 2]
    assert [len(b) for b in on_backend.batches] == [2, 4, 4]
    assert _signature(on.trajectories) == _signature(off.trajectories)
    assert [t.decisions for t in on.trajectories] == [t.decisions for t in off.trajectories]
    assert {t.traj_id: t.parent_id for t in on.trajectories} == {0: None, 1: None, 2: 0, 3: 1}
    assert all(t.inherited_branches == 1 for t in on.trajectories if t.parent_id is not None)
    assert on.stats.discarded_speculative == on.stats.discarded_tokens == 0
    assert on.stats.tool_calls_executed == off.stats.tool_calls_executed == 6


def test_presampled_children_not_taken_are_discarded_before_their_calls():
    # Never branch (alpha 0, gamma 0): every pre-sampled child is discarded after its reaction,
    # and its tool call is never run. k = 4, m = 2: before round 2 two slots are free -> two
    # would-be children react to tool 1 ("think1 <search>q1</search>", 26 tokens each) and are
    # dropped; before round 3 the same again, reacting to tool 2 ("<answer>q</answer>" + EOS, 19
    # tokens each): 4 discarded, 90 tokens. Then the refill (2 fresh globals: the budget is
    # spent, so no slot is free and nothing is pre-sampled) runs 3 rounds.
    scheduler, backend, runner = make(tool_agent(2), PureRunner(), k=4, pre_monitoring=False,
                                      fixed_global_samples=2, branch_alpha_mode="constant",
                                      branch_alpha=0.0, gamma=0.0,
                                      experimental=RolloutExperiments(presample_children=True))
    result = scheduler.rollout([[50]], step=0)
    stats = result.stats
    assert [len(b) for b in backend.batches] == [2, 4, 4, 2, 2, 2]
    assert (stats.discarded_speculative, stats.discarded_tokens) == (4, 2 * 26 + 2 * 19)
    assert stats.branches == 0 and stats.fresh_global_samples == 2
    executed = sum(len(b) for b in runner.batches)
    assert executed == stats.tool_calls_executed == 4 * 2  # 4 trajectories x 2 calls, no more
    sampled = sum(sum(t.loss_mask) for t in result.trajectories)
    assert stats.tokens_generated - stats.discarded_tokens == sampled


def test_presampled_children_run_only_kept_calls_on_random_trees():
    # Random trees, no reserve or probe (pre-monitoring off): every tool call that ran belongs to
    # a returned trajectory (inherited calls not counted twice), so no discarded would-be child's
    # call ran; the token accounting holds.
    for step in range(30):
        scheduler, _, runner = make(random_tool_agent(), PureRunner(), k=8, pre_monitoring=False,
                                    experimental=RolloutExperiments(presample_children=True))
        result = scheduler.rollout(PROMPTS, step=step)
        own_calls = sum(t.tool_calls - (t.branch_tool_step or 0) for t in result.trajectories)
        assert sum(len(b) for b in runner.batches) == result.stats.tool_calls_executed == own_calls
        sampled = sum(sum(t.loss_mask[t.branch_position or 0:]) for t in result.trajectories)
        assert result.stats.tokens_generated - result.stats.discarded_tokens == sampled


def test_speculative_beyond_m_drops_its_early_branches():
    # Always branch, k = 8, 7 speculative globals. H_root 0 -> m_max = floor(8 * sigmoid(0)) + 1
    # = 5: 3 certain slots. Round 2: the probe and globals 1-7 react to tool 1 and decide in id
    # order: probe -> child 8, global 1 -> child 9, global 2 -> child 10, globals 3-7 wait.
    # Round 3: the probe answers (H_tool 6 -> m = floor(8 * sigmoid(-3)) + 1 = 1): only the
    # probe is kept; globals 1-7 are paused, children 9 and 10 dropped. The probe's waiting
    # Global 3's waiting decision starts a tentative child (11), dropped with its parent. The
    # probe's waiting decision (tool 2) takes child 12; child 8 branches after its own tool 2
    # in round 4 (child 13, l = 2). Round 5: child 13 answers. 4 members -> 4 refills: globals
    # 1-4 from the reserve (ended already, decisions blocked); globals 5-7 and children 9-11
    # discarded.
    policy = _stepwise_entropy_agent({0: 0.0, 1: 6.0, 2: 6.0})
    scheduler, backend, _ = make(policy, PureRunner(), k=8, branch_alpha_mode="constant",
                                 branch_alpha=1.0, branch_penalty=False,
                                 experimental=RolloutExperiments(speculative_global_samples=7))
    result = scheduler.rollout([[50]], step=0)
    stats, trajs = result.stats, result.trajectories
    assert stats.m == [1] and [len(b) for b in backend.batches] == [8, 8, 12, 2, 1]
    assert {t.traj_id: t.parent_id for t in trajs} == {0: None, 1: None, 2: None, 3: None,
                                                       4: None, 8: 0, 12: 0, 13: 8}
    by_id = {t.traj_id: t for t in trajs}
    assert [d.branched for d in by_id[0].decisions] == [True, True]
    for gid in (1, 2, 3, 4):  # the decisions they took as speculative globals are forgotten
        assert [d.budget_blocked for d in by_id[gid].decisions] == [True, True]
    assert stats.branches == 3 and stats.fresh_global_samples == 4
    assert stats.discarded_speculative == 6  # children 9-11 and globals 5-7
    sampled = sum(sum(t.loss_mask[t.branch_position or 0:]) for t in trajs)
    assert stats.tokens_generated - stats.discarded_tokens == sampled


def test_reserve_runs_only_while_a_refill_may_need_it():
    # Random trees, 7 speculative globals (k = 8): reserve samples keep generating after m is
    # known, so a refill resumes them further along, but never once their prompt has k
    # trajectories (nothing can need them then). Token accounting holds in every call: what
    # was sampled = what the returned trajectories sampled themselves + what was discarded.
    sampled_in_reserve = 0

    class Checked(EntropyBalancedRollout):
        def _round(self, states, batch):
            nonlocal sampled_in_reserve
            for state in states.values():
                if any(t in state.reserve for t in batch):
                    assert len(state.members) < self.config.k
                    sampled_in_reserve += 1
            super()._round(states, batch)

    for step in range(40):
        backend = ScriptedBackend(random_tool_agent())
        config = RolloutConfig(k=8, n_entropy_tokens=4, max_response_tokens=400,
                               max_tokens_per_segment=100,
                               experimental=RolloutExperiments(speculative_global_samples=7))
        result = Checked(backend, PureRunner(), config).rollout(PROMPTS, step=step)
        stats = result.stats
        assert len(result.trajectories) == 8 * len(PROMPTS)
        sampled = sum(sum(t.loss_mask[t.branch_position or 0:]) for t in result.trajectories)
        assert stats.tokens_generated - stats.discarded_tokens == sampled
    assert sampled_in_reserve > 0


def test_no_branch_decisions_without_branching():
    # GRPO rollout: k global samples; no decision is taken (nor counted as budget-blocked)
    scheduler, _, _ = make(tool_agent(2), k=4, branching=False)
    result = scheduler.rollout(PROMPTS, step=0)
    assert result.stats.branch_decisions == 0 and result.stats.branch_budget_blocked == 0
    assert all(not t.decisions for t in result.trajectories)


def _stepwise_entropy_agent(entropies: dict[int, float]) -> Policy:
    """tool_agent(2) whose segment entropy depends on the tool results seen so far."""
    def policy(context: str, request: GenRequest):
        done = context.count("<result>")
        if done < 2:
            return f"think{done} <search>q{done}</search>", entropies[done], False
        return "<answer>q</answer>", entropies[done], True
    return policy


def test_monitor_tool_steps_sets_m_from_the_first_reaction():
    # Probe entropies: first segment 2.0 (H_root), after tool 1: 1.0, after tool 2: 3.0. k = 12.
    # Spec: H_tool = (1 + 3) / 2 = 2 -> m = floor(12 * 0.5) + 1 = 7.
    # monitor_tool_steps=1: H_tool = 1 -> floor(12 * sigmoid(0.5)) + 1 = floor(7.47) + 1 = 8, set
    # after round 2 (the probe's first reaction), while the probe still runs.
    policy = _stepwise_entropy_agent({0: 2.0, 1: 1.0, 2: 3.0})
    results = {}
    for steps in (None, 1):
        scheduler, _, _ = make(policy, PureRunner(), k=12, branch_alpha_mode="constant",
                               branch_alpha=1.0, branch_penalty=False,
                               experimental=RolloutExperiments(monitor_tool_steps=steps))
        results[steps] = scheduler.rollout([[50]], step=0)
    spec, early = results[None].stats, results[1].stats
    assert (spec.h_tool, spec.m) == ([2.0], [7]) and (early.h_tool, early.m) == ([1.0], [8])
    assert early.rounds < spec.rounds
    probe = next(t for t in results[1].trajectories if t.kind == "probe")
    assert probe.finish_reason == "eos" and len(probe.decisions) == 2  # late, then online
    assert len(results[1].trajectories) == 12


def test_monitor_tool_steps_with_a_discarded_probe_stops_it():
    scheduler, _, _ = make(tool_agent(3), k=4,
                           experimental=RolloutExperiments(reuse_probe_as_sample=False, monitor_tool_steps=1))
    result = scheduler.rollout([[50]], step=0)
    assert result.stats.discarded_probes == 1 and all(t.kind != "probe" for t in result.trajectories)
    # the probe sampled its first segment and its first reaction, then stopped: 2 segments of
    # "thinkN <search>qN</search>" = 26 tokens each
    assert result.stats.discarded_tokens == 52


def test_speculative_config():
    assert RolloutConfig(k=8).speculative_globals == 3
    assert RolloutConfig(k=1).speculative_globals == 0
    assert RolloutConfig(k=8, pre_monitoring=False).speculative_globals == 0
    assert RolloutConfig(k=8, branching=False).speculative_globals == 0
    seven = RolloutExperiments(speculative_global_samples=7)
    assert RolloutConfig(k=8, experimental=seven).speculative_globals == 7
    assert RolloutConfig(k=8).speculative_top_up
    three = RolloutExperiments(speculative_global_samples=3)
    assert not RolloutConfig(k=8, experimental=three).speculative_top_up
    assert not RolloutConfig(k=8, pre_monitoring=False).speculative_top_up
    # the default start never exceeds what the top-up adds after round 1: m_max - 1
    for k in range(1, 17):
        for beta in (0.0, 0.5, 3.0):
            for h_root in (0.0, 1e-9, 0.7, 12.0):
                m_max = global_sample_count(k, beta, h_root, -1e-3)
                assert RolloutConfig(k=k, beta=beta).speculative_globals <= m_max - 1, (k, beta, h_root)
    with pytest.raises(ValueError, match="speculative_global_samples must be in"):
        RolloutConfig(k=8, experimental=RolloutExperiments(speculative_global_samples=8))
    with pytest.raises(ValueError, match="monitor_tool_steps must be >= 1"):
        RolloutConfig(experimental=RolloutExperiments(monitor_tool_steps=0))


# ---------------------------------------------------------------------------------------------
# Branching and lineage


def check_lineage_rule(traj: Trajectory, inherited: int) -> None:
    """l before each decision: inherited, then +1 after a branch, 0 after no branch."""
    l = inherited
    for d in traj.decisions:
        assert d.consecutive_branches == l, (traj.uid, traj.decisions)
        l = l + 1 if d.branched else 0
    assert traj.consecutive_branches == l


def test_lineage_counters_are_per_lineage():
    # alpha 0.9, gamma 0, slope 0.5: l=0 -> P=0.9 branch; l=1 -> P=0.45 no branch (reset).
    scheduler, _, _ = make(tool_agent(3), k=8, pre_monitoring=False, fixed_global_samples=2,
                           branch_alpha_mode="constant", branch_alpha=0.9, gamma=0.0,
                           penalty_slope=0.5)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    by_id = {t.traj_id: t for t in trajs}
    a, b = by_id[0], by_id[1]
    # Both global lineages branch at their first tool result with l=0: a per-prompt counter
    # would have given the second one l=1 (P=0.45, no branch).
    assert [d.consecutive_branches for d in a.decisions] == [0, 1, 0]
    assert [d.consecutive_branches for d in b.decisions] == [0, 1, 0]
    assert [d.branched for d in a.decisions] == [True, False, True]
    assert [d.branched for d in b.decisions] == [True, False, True]
    for t in trajs:
        if t.kind == "branch":
            parent = by_id[t.parent_id]
            # the child inherited parent's count + 1 at its branch point
            at = next(d for d in parent.decisions if d.tool_step == t.branch_tool_step)
            assert at.branched and t.inherited_branches == at.consecutive_branches + 1
            check_lineage_rule(t, t.inherited_branches)
            assert t.decisions == [] or t.decisions[0].tool_step == t.branch_tool_step + 1
        else:
            check_lineage_rule(t, 0)
    assert len(trajs) == 8 and result.stats.branches == 6


def test_branch_never_exceeds_budget_and_child_copies_prefix():
    scheduler, backend, _ = make(tool_agent(4, seed_in_text=True), k=5, pre_monitoring=False,
                                 fixed_global_samples=1, branch_alpha_mode="constant",
                                 branch_alpha=1.0, branch_penalty=False)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    assert len(trajs) == 5
    by_id = {t.traj_id: t for t in trajs}
    for t in trajs:
        if t.kind != "branch":
            continue
        parent, cut = by_id[t.parent_id], t.branch_position
        assert t.response_ids[:cut] == parent.response_ids[:cut]
        assert t.loss_mask[:cut] == parent.loss_mask[:cut]
        assert t.segments[len([s for s in t.segments if s.end <= cut]) - 1].kind == "tool"
        assert t.tool_calls == sum(s.kind == "tool" for s in t.segments)
        assert t.h_init == parent.h_init
    assert result.stats.branch_budget_blocked > 0


def test_branching_depends_on_entropy_change():
    # Constant alpha 0.5, tau 0.5: branch iff dH > 0 (gamma > 0).
    up, _, _ = make(tool_agent(2, h_first=1.0, h_after=2.0), k=4, pre_monitoring=False,
                    fixed_global_samples=1, branch_alpha_mode="constant", branch_alpha=0.5)
    down, _, _ = make(tool_agent(2, h_first=2.0, h_after=1.0), k=4, pre_monitoring=False,
                      fixed_global_samples=1, branch_alpha_mode="constant", branch_alpha=0.5)
    up_stats = up.rollout([[50]], step=0).stats
    down_stats = down.rollout([[50]], step=0).stats
    assert up_stats.branches > 0
    assert down_stats.branches == 0 and down_stats.fresh_global_samples == 3
    # (0.5 + 0.2 * 1.0) * (1 - 0.05 * 0) = 0.7 at the first decision
    assert up_stats.mean_branch_probability > 0.5


def test_no_stale_h_init_across_steps():
    # Prompt "A" (step 0): H_init 5, after-tool 1 -> P = 0.9 + 0.2 * (-4) = 0.1: no branch.
    # Prompt "B" (step 1): H_init 1, after-tool 1 -> P = 0.9: branch. A baseline kept from step 0
    # (the reference code's defect) would give P = 0.1 at step 1 too.
    def policy(context, request):
        h_first = 5.0 if context.startswith("A") else 1.0
        return tool_agent(2, h_first=h_first, h_after=1.0)(context, request)

    scheduler, _, _ = make(policy, k=4, pre_monitoring=False, fixed_global_samples=2,
                           branch_alpha_mode="constant", branch_alpha=0.9)
    tok = CharTokenizer()
    result = scheduler.rollout([tok.encode("A?")], step=0)
    step0 = result.trajectories
    assert result.stats.branches == 0
    assert all(d.h_init == 5.0 for t in step0 for d in t.decisions)
    result = scheduler.rollout([tok.encode("B?")], step=1)
    step1 = result.trajectories
    assert result.stats.branches > 0
    assert all(d.h_init == 1.0 for t in step1 for d in t.decisions)
    assert all(t.step == 1 and t.uid.startswith("step1/") for t in step1)


# ---------------------------------------------------------------------------------------------
# Token bookkeeping


def test_masks_logprobs_and_tool_tokens_aligned():
    scheduler, backend, runner = make(tool_agent(2), k=2, branching=False)
    result = scheduler.rollout([[50, 51]], step=0)
    trajs = result.trajectories
    tok = CharTokenizer()
    for t in trajs:
        n = len(t.response_ids)
        assert len(t.loss_mask) == len(t.logprobs) == len(t.entropies) == n
        assert [s.kind for s in t.segments] == ["model", "tool", "model", "tool", "model"]
        assert t.finish_reason == "eos" and t.response_ids[-1] == EOS and t.tool_calls == 2
        for seg in t.segments:
            ids = t.response_ids[seg.start:seg.end]
            mask, lps = t.loss_mask[seg.start:seg.end], t.logprobs[seg.start:seg.end]
            if seg.kind == "tool":
                assert mask == [0] * len(ids) and lps == [0.0] * len(ids)
                assert tok.decode(ids).startswith(" <result>\n")
                assert tok.decode(ids).endswith("\n</result>")
            else:
                context = tuple(t.prompt_ids + t.response_ids[:seg.start])
                sampled = [(o.token_ids, o.logprobs, o.entropies) for o in backend.outputs[context]]
                assert (ids, lps, t.entropies[seg.start:seg.end]) in sampled
                assert mask == [1] * len(ids)
    # Tool-result text exactly as format_tool_result made it (token-in/out for the rest).
    first = trajs[0]
    seg = first.segments[1]
    call = runner.batches[0][0]
    assert tok.decode(first.response_ids[seg.start:seg.end]) == format_tool_result(
        f"{call.tool}({call.payload})#0")


def test_tool_call_limit():
    scheduler, _, runner = make(tool_agent(100), k=2, branching=False, max_tool_calls=2)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    for t in trajs:
        assert t.tool_calls == 2 and t.finish_reason == "tool_limit"
        assert [s.kind for s in t.segments] == ["model", "tool", "model", "tool", "model"]
    assert sum(len(b) for b in runner.batches) == 4


def test_length_cap_truncates_and_stops():
    scheduler, _, _ = make(tool_agent(100), k=2, branching=False, max_response_tokens=60,
                           max_tokens_per_segment=30)
    result = scheduler.rollout([[50]], step=0)
    trajs = result.trajectories
    for t in trajs:
        assert len(t.response_ids) <= 60 and t.finish_reason == "length"


def test_malformed_calls_counted_not_run():
    def policy(context, request):
        if context.startswith("2"):
            return "oops <search>   </search>", 1.0, False   # empty payload: malformed
        return tool_agent(1)(context, request)

    scheduler, _, runner = make(policy, k=3)
    tok = CharTokenizer()
    result = scheduler.rollout([tok.encode("1?"), tok.encode("2?")], step=0)
    trajs = result.trajectories
    bad = by_prompt(trajs)[1]
    assert len(bad) == 3
    assert all(t.malformed_calls == 1 and t.finish_reason == "malformed" for t in bad)
    assert all(t.tool_calls == 0 for t in bad)
    assert result.stats.malformed_calls == 3
    assert all(call.payload.startswith("q") for batch in runner.batches for call in batch)


# ---------------------------------------------------------------------------------------------
# Determinism


def test_same_seed_same_rollouts_different_seed_different_branching():
    def run(seed: int):
        scheduler, backend, _ = make(tool_agent(3, seed_in_text=True), k=6, seed=seed)
        result = scheduler.rollout(PROMPTS, step=3)
        trajs = result.trajectories
        return signature(trajs), [r.seed for b in backend.batches for r in b]

    first, seeds_first = run(0)
    again, seeds_again = run(0)
    assert first == again and seeds_first == seeds_again
    branching = lambda sig: [(p, i, parent, dec) for p, i, parent, _, _, dec in sig]  # noqa
    others = [run(seed)[0] for seed in (1, 2, 3)]
    assert any(branching(o) != branching(first) for o in others)
    assert all(o != first for o in others)


# ---------------------------------------------------------------------------------------------
# Real tool runner and tree printing


class EchoTool(Tool):
    name = "echo"

    def __call__(self, payload: str) -> ToolResult:
        return ToolResult(f"echo: {payload}", ok=True)


def test_with_real_tool_runner():
    def policy(context, request):
        if context.count("<result>") < 2:
            return f"<echo>hi{context.count('<result>')}</echo>", 1.0, False
        return "<answer>done</answer>", 1.0, True

    with ToolRunner({"echo": EchoTool()}, max_workers=2) as runner:
        scheduler, _, _ = make(policy, runner=runner, k=3)
        assert scheduler.stop_strings == ("</echo>",)
        result = scheduler.rollout([[50], [51]], step=0)
        trajs = result.trajectories
    tok = CharTokenizer()
    assert len(trajs) == 6
    for t in trajs:
        tool_texts = [tok.decode(t.response_ids[s.start:s.end]) for s in t.segments
                      if s.kind == "tool"]
        assert tool_texts == [format_tool_result("echo: hi0"), format_tool_result("echo: hi1")]
        assert t.finish_reason == "eos"
    assert runner.stats["echo"]["errors"] == 0


def test_rollout_tree_lists_every_trajectory_under_its_parent():
    scheduler, _, _ = make(tool_agent(3), k=8, pre_monitoring=False, fixed_global_samples=2,
                           branch_alpha_mode="constant", branch_alpha=0.9, gamma=0.0,
                           penalty_slope=0.5)
    result = scheduler.rollout([[50], [60]], step=0)
    trajs = result.trajectories
    tree = rollout_tree(trajs, 1)
    assert [t.traj_id for t in tree[None]] == [0, 1]
    assert sum(len(v) for v in tree.values()) == 8
    text = format_rollout_tree(trajs, 1)
    assert text.splitlines()[0] == "prompt 1: 8 trajectories"
    assert len(text.splitlines()) == 9
    child = next(t for t in trajs if t.prompt_index == 1 and t.kind == "branch")
    line = next(x for x in text.splitlines() if f"- t{child.traj_id} [" in x)
    parent_line = next(x for x in text.splitlines() if f"- t{child.parent_id} [" in x)
    indent = lambda s: len(s) - len(s.lstrip())  # noqa: E731
    assert indent(line) == indent(parent_line) + 2
    assert not math.isnan(result.stats.mean_branch_probability)


# ---------------------------------------------------------------------------------------------
# End to end: a tiny trained Qwen3 through the HF backend, with the real ToolRunner

E2E_TEXTS = [
    "Q: <search>cat</search> <result>\nfound cat\n</result> <search>dog</search> <result>\n"
    "found dog\n</result> <answer>cat</answer>",
    "Q: <search>sun</search> <result>\nfound sun\n</result> <answer>sun</answer>",
]


class FoundTool(Tool):
    name = "search"

    def __call__(self, payload: str) -> ToolResult:
        return ToolResult(f"found {payload}", ok=True)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """(model, tokenizer) of a 1-layer Qwen3 trained for 40 steps to call <search>."""
    pytest.importorskip("aepo_engine.rollout.backends.hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aepo_engine.models import build_tiny_qwen3

    path = build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "m", texts=E2E_TEXTS,
                            train_steps=40, seed=0, hidden_size=64, num_layers=1, head_dim=32,
                            num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=300)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_end_to_end_hf_backend_token_in_token_out(tiny_hf):
    import torch

    from aepo_engine.rollout.backends.hf import HFBackend

    model, tok = tiny_hf
    config = dict(k=4, n_entropy_tokens=4, max_response_tokens=60, max_tokens_per_segment=24,
                  max_tool_calls=3, seed=1, temperature=0.9)
    prompts = [tok("Q:")["input_ids"], tok("Q: ")["input_ids"]]

    def run():
        with ToolRunner({"search": FoundTool()}, max_workers=2) as runner:
            scheduler = EntropyBalancedRollout(HFBackend(model, tok), runner,
                                               RolloutConfig(**config))
            result = scheduler.rollout(prompts, step=0)
            return result.trajectories, result.stats

    trajs, stats = run()
    assert [len(g) for g in by_prompt(trajs).values()] == [4, 4]
    assert stats.tool_calls_executed > 0 and all(t.done for t in trajs)
    for t in trajs:
        assert len(t.response_ids) <= 60
        for seg in t.segments:
            if seg.kind == "tool":
                text = tok.decode(t.response_ids[seg.start:seg.end])
                assert text.startswith(" <result>\nfound ") and text.endswith("\n</result>")
        # Teacher-forced recomputation over prompt + response must reproduce the sampling
        # log-probs and entropies at every model token: the context the model saw is exactly
        # the stored token sequence (tool results included), nothing was re-tokenized.
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(t.prompt_ids) - 1:-1]  # [R, V]
        logp = torch.log_softmax(logits.float() / config["temperature"], dim=-1)
        token_logp = logp.gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        model_pos = torch.tensor(t.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(token_logp[model_pos], torch.tensor(t.logprobs)[model_pos],
                                   atol=1e-3, rtol=0)
        torch.testing.assert_close(entropy[model_pos], torch.tensor(t.entropies)[model_pos],
                                   atol=1e-3, rtol=0)
    again, _ = run()
    assert signature(again) == signature(trajs)
