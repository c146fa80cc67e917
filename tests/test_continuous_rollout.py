"""Continuous rollouts (asynchronous training's scheduler, ``aepo_engine.rollout.continuous``), the
policy versions on tokens, and the staleness bookkeeping (``aepo_engine.asynchronous.staleness``).

The scheduler's per-prompt logic is the synchronous one (tests/test_rollout_scheduler.py); here:
its rounds one step at a time with a tool barrier are exactly the synchronous rollout; several
steps in flight with tool calls in the background still give exactly k trajectories per prompt
with the token accounting intact, oldest step first; a segment cut by a weight update goes on
under the new weights from its prefix, each token stamped with the version that sampled it (a
real tiny model, teacher-forced under each version's weights); a stop string split by the cut is
still found.
"""
from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from concurrent.futures import Future

import msgspec
import pytest
import torch

from aepo_engine.asynchronous.staleness import (admission_version, branching_version_gaps, staleness_metrics,
                                                token_staleness)
from aepo_engine.rollout.calls import PendingCall
from aepo_engine.rollout.config import RolloutConfig, RolloutExperiments
from aepo_engine.rollout.continuous import ContinuousRollout
from aepo_engine.rollout.decisions import Branching
from aepo_engine.rollout.monitoring import PreMonitoring
from aepo_engine.rollout.protocol import GenOutput
from aepo_engine.rollout.scheduler import EntropyBalancedRollout
from aepo_engine.rollout.segments import cut_at_stop
from aepo_engine.rollout.state import PromptState, state_key
from aepo_engine.rollout.stats import RolloutCounters, rollout_stats
from aepo_engine.rollout.trajectory import BranchDecision, ToolCallRecord, Trajectory
from aepo_engine.tools import Tool, ToolCall, ToolResult, ToolRunner
from aepo_engine.training.batch import TokenBatch
from fakes import CharTokenizer, CutAfter, ScriptedBackend, tool_agent
from test_rollout_scheduler import E2E_TEXTS, PROMPTS, FoundTool, PureRunner, random_tool_agent, tiny_hf  # noqa: F401

CONFIG = dict(k=6, n_entropy_tokens=4, max_response_tokens=400, max_tokens_per_segment=100)


def _signature(trajectories):
    return [(t.step, t.prompt_index, t.traj_id, t.kind, t.parent_id, tuple(t.response_ids), tuple(t.logprobs),
             tuple(d.branched for d in t.decisions)) for t in trajectories]


def _drain(rollout: ContinuousRollout, abort=None) -> dict[int, object]:
    results = {}
    while rollout.steps_in_flight:
        if not rollout.round(abort):
            rollout.take_tool_results(wait_s=0.05)
        results.update(dict(rollout.finished()))
    return results


# ---------------------------------------------------------------------------------------------
# Against the synchronous scheduler


def test_barrier_rounds_one_step_at_a_time_are_the_synchronous_rollout():
    for step in range(6):
        expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                          RolloutConfig(**CONFIG)).rollout(PROMPTS, step=step)
        continuous = ContinuousRollout(ScriptedBackend(random_tool_agent()), PureRunner(), RolloutConfig(**CONFIG),
                                       tool_barrier=True)
        continuous.policy_version = step
        continuous.admit(PROMPTS, step)
        (got,) = _drain(continuous).values()
        assert _signature(got.trajectories) == _signature(expected.trajectories)
        assert got.stats.rounds == expected.stats.rounds and got.stats.m == expected.stats.m
        assert all(v == step for t in got.trajectories for v, m in zip(t.versions, t.loss_mask) if m)


class ScriptedLatency(Tool):
    """The result a :class:`PureRunner` gives (``search(q)``), after a latency drawn from the
    payload and ``order`` (each order a different arrival order of the same calls)."""

    name = "search"

    def __init__(self, order: int, most_s: float = 0.03):
        self.order, self.most_s = order, most_s

    def __call__(self, payload: str) -> ToolResult:
        time.sleep(random.Random(f"{self.order}:{payload}").uniform(0.0, self.most_s))
        return ToolResult(f"search({payload})", ok=True)


EXPERIMENTS = {
    "default": RolloutExperiments(),
    "strict": RolloutExperiments(speculative_global_samples=0, branch_before_m=False, speculative_branches=0),
    "reserve": RolloutExperiments(speculative_global_samples=5, speculative_branches=6),
    "presampled": RolloutExperiments(presample_children=True, speculative_branches=3),
    "first_tool_step": RolloutExperiments(reuse_probe_as_sample=False, monitor_tool_steps=1),
}


def _counts(stats):
    """Every statistic but the rounds and the seconds."""
    return {k: v for k, v in dataclasses.asdict(stats).items() if k != "rounds" and not k.endswith("_s")}


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("max_batch", [None, 3])
@pytest.mark.parametrize("experiments", list(EXPERIMENTS))
@pytest.mark.parametrize("ahead", [False, True], ids=["by_rounds", "sample_ahead"])
def test_the_continuous_schedule_grows_the_round_schedules_trees_whatever_the_latencies(order, max_batch, experiments,
                                                                                        ahead):
    """Issue 52: without the round barrier each trajectory samples again as soon as its own call is
    back, in batches of whatever is ready (at most ``max_batch``), so the rounds' batches differ
    from the round schedule's; the branch decisions wait for their evidence, never for other
    trajectories, so the trees (kinds, parents, tokens, log-probs, decisions), m and the branch
    counts are the round schedule's for the same seeds and sampled tokens (and every counter but
    the rounds: the same tokens sampled and discarded, the same calls run), with each
    scheduling variant of ``rollout.experimental``. With ``sample_ahead`` the trajectories m may
    discard sample ahead too: the same trees, and at least the round schedule's discarded tokens."""
    experimental = msgspec.structs.replace(EXPERIMENTS[experiments], sample_ahead=ahead)
    config = RolloutConfig(**CONFIG, experimental=experimental)
    for step in range(3):
        expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                          config).rollout(PROMPTS, step=step)
        widths = []

        class Recording(ContinuousRollout):
            def ready(self):
                batch = super().ready()
                widths.append(len(batch))
                return batch

        with ToolRunner({"search": ScriptedLatency(order)}, max_workers=16) as runner:
            unsettled = msgspec.structs.replace(config, experimental=msgspec.structs.replace(config.experimental,
                                                                                             settle_s=0.0))
            continuous = Recording(ScriptedBackend(random_tool_agent()), runner, unsettled,
                                   max_batch=max_batch)  # no settling: rounds apart
            got = continuous.run_step(PROMPTS, step, poll_s=0.01)
            assert not continuous.states
            while continuous.waiting_on_tools:  # calls of trajectories m discarded while they ran
                continuous.take_tool_results(wait_s=1.0)
        # every call the runner ran was taken or dropped, and counted once (closing the runner
        # waited for any still running)
        assert runner.stats["search"]["calls"] == got.stats.tool_calls_executed + got.stats.tool_calls_dropped
        assert got.stats.tool_calls_dropped == 0 or ahead  # by rounds, nothing m discards has a call
        assert _signature(got.trajectories) == _signature(expected.trajectories)
        assert got.stats.m == expected.stats.m and got.stats.branches == expected.stats.branches
        if ahead:  # what m discards may hold more; what is kept is the same
            assert got.stats.discarded_tokens >= expected.stats.discarded_tokens
            assert (got.stats.tokens_generated - got.stats.discarded_tokens
                    == expected.stats.tokens_generated - expected.stats.discarded_tokens)
        else:
            assert got.stats.tool_calls_executed == expected.stats.tool_calls_executed
            assert _counts(got.stats) == _counts(expected.stats)
        assert max_batch is None or max(widths) <= max_batch
        assert got.stats.rounds > expected.stats.rounds  # the calls came back apart: more, narrower rounds


def test_a_slow_call_holds_back_no_other_trajectory_only_the_decisions_after_it():
    """Without the barrier a trajectory its prompt keeps for certain (here every global sample:
    m is known from the start) samples on while another's call runs; the decisions that come
    after the slow trajectory's in the round schedule's order wait for it (the budget goes in that
    order), and once its result is back the tree is the round schedule's."""
    config = RolloutConfig(**CONFIG, pre_monitoring=False, branch_alpha_mode="constant", branch_alpha=1.0)
    expected = EntropyBalancedRollout(ScriptedBackend(tool_agent(3)), PureRunner(), config).rollout(PROMPTS[:1], step=0)
    runner = HeldRunner()
    rollout = ContinuousRollout(ScriptedBackend(tool_agent(3)), runner, config)
    rollout.admit(PROMPTS[:1], 0)
    assert rollout.round()  # round 0: the m = 3 global samples, each ending with a call
    slow = runner.calls[0][0]  # trajectory 0's
    while True:
        runner.answer(keep=slow)
        if not rollout.round() and not rollout.take_tool_results():
            break
    state = rollout.states[(0, 0)]
    assert [t.done for t in state.members] == [False, True, True]  # 1 and 2 went on to their answers
    assert not any(t.decisions for t in state.members)  # their decisions wait for 0's first one
    results = {}
    while rollout.steps_in_flight:  # 0's result is back: the rest follows
        runner.answer()
        if not rollout.round():
            rollout.take_tool_results()
        results.update(dict(rollout.finished()))
    assert _signature(results[0].trajectories) == _signature(expected.trajectories)
    assert results[0].stats.branches == expected.stats.branches == 3


class TimedBackend(ScriptedBackend):
    """A scripted backend whose every call takes ``call_s`` whatever its batch (a decode step's
    cost barely moves with the batch): extra, narrower calls cost time."""

    def __init__(self, agent, call_s: float):
        super().__init__(agent)
        self.call_s = call_s

    def generate(self, requests):
        time.sleep(self.call_s)
        return super().generate(requests)


class Counted(ContinuousRollout):
    """Records each round's width and how long it waited for tool results before sampling."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.widths, self.settled_s = [], []

    def settle(self, window_s=None):
        start = time.perf_counter()
        taken = super().settle(window_s)
        self.settled_s.append(time.perf_counter() - start)
        return taken

    def ready(self):
        batch = super().ready()
        self.widths.append(len(batch))
        return batch


def test_fast_tools_are_waited_for_so_a_step_takes_the_round_schedules_rounds():
    """Issue 52, never slower at zero latency: tool calls of a few milliseconds against a round
    that generates for 50 ms are expected back within a round, so :meth:`ContinuousRollout.settle`
    (the ski-rental window: one round's generation time) waits for them and a step takes the round
    schedule's rounds, not more and narrower ones (measured before this rule, with a fixed 10 ms
    window: the embedded job's sandboxed calls of tens of ms made 6 -> 10 rounds a step)."""
    for step in range(3):
        expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                          RolloutConfig(**CONFIG)).rollout(PROMPTS, step=step)
        with ToolRunner({"search": ScriptedLatency(step, most_s=0.01)}, max_workers=16) as runner:
            continuous = Counted(TimedBackend(random_tool_agent(), 0.05), runner, RolloutConfig(**CONFIG))
            got = continuous.run_step(PROMPTS, step)
        assert _signature(got.trajectories) == _signature(expected.trajectories)
        assert got.stats.rounds == expected.stats.rounds
        assert max(continuous.settled_s) < 0.05 + 0.03  # never more than a round's time (and the poll)


def test_settle_s_from_the_config_sets_the_window_and_zero_never_waits():
    """``rollout.experimental.settle_s`` reaches the scheduler through ``for_schedule`` (the one
    constructor the trainer and the rollout process use): 0 turns the wait off, so the same fast
    calls as above cost extra, narrower rounds, with the same trees; a bad value is refused."""
    from aepo_engine.rollout.config import RolloutExperiments

    expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                      RolloutConfig(**CONFIG)).rollout(PROMPTS, step=0)
    config = RolloutConfig(**CONFIG, schedule="continuous", experimental=RolloutExperiments(settle_s=0.0))
    with ToolRunner({"search": ScriptedLatency(0, most_s=0.01)}, max_workers=16) as runner:
        continuous = Counted.for_schedule(TimedBackend(random_tool_agent(), 0.05), runner, config)
        assert continuous.settle_s == 0.0 and not continuous.tool_barrier
        got = continuous.run_step(PROMPTS, 0)
    assert _signature(got.trajectories) == _signature(expected.trajectories)
    assert got.stats.rounds > expected.stats.rounds
    assert max(continuous.settled_s) < 0.005
    with pytest.raises(ValueError, match="experimental.settle_s must be seconds >= 0"):
        RolloutExperiments(settle_s=float("nan"))


def test_slow_tools_are_not_waited_for_once_their_durations_are_known():
    """The other side of the rule: calls of ~0.3-0.4 s against rounds of 20 ms are not expected
    back within a round once a few have been timed, so the ready trajectories sample without
    waiting (more, narrower rounds than the round schedule: the barrier is gone) and no round
    waits longer than its window; the trees stay the round schedule's."""
    class Slow(Tool):
        name = "search"

        def __call__(self, payload: str) -> ToolResult:
            time.sleep(0.3 + random.Random(payload).uniform(0.0, 0.1))
            return ToolResult(f"search({payload})", ok=True)

    expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                      RolloutConfig(**CONFIG)).rollout(PROMPTS, step=1)
    with ToolRunner({"search": Slow()}, max_workers=64) as runner:
        continuous = Counted(TimedBackend(random_tool_agent(), 0.02), runner, RolloutConfig(**CONFIG))
        got = continuous.run_step(PROMPTS, 1)
    assert _signature(got.trajectories) == _signature(expected.trajectories)
    assert got.stats.rounds > expected.stats.rounds
    assert continuous.round_s == pytest.approx(0.02, abs=0.015)
    assert max(continuous.settled_s) < 0.1  # a round's window (~20 ms) and the wait's granularity
    timed = sorted(continuous._durations["search"])
    assert len(timed) == got.stats.tool_calls_executed and 0.3 <= timed[0] and timed[-1] < 0.6


def test_settle_predicts_a_calls_return_from_its_tools_recorded_durations():
    """The prediction itself: the median excess of the recorded durations longer than the call
    has run; with none longer (none recorded, or all outrun), as long again as it has run."""
    rollout = ContinuousRollout(ScriptedBackend(random_tool_agent()), PureRunner(), RolloutConfig(**CONFIG))
    future = Future()
    traj = Trajectory(prompt_ids=[1], prompt_index=0, traj_id=0, step=0, kind="global")
    rollout._tools[future] = PendingCall(traj, ToolCall("search", "q"), False)
    rollout._call_times[future] = [time.perf_counter() - 1.0]  # it has run for 1 s
    assert not rollout._expected_within(0.9) and rollout._expected_within(1.1)  # no record: 1 s more
    rollout._durations["search"] = deque([0.5, 0.9, 1.2, 1.4, 3.0])
    assert rollout._expected_within(0.45)  # remaining 0.2, 0.4, 2.0: median 0.4
    assert not rollout._expected_within(0.35)
    rollout._durations["search"] = deque([0.5, 0.9])  # outrun: as long again
    assert not rollout._expected_within(0.9) and rollout._expected_within(1.1)
    future.set_result(None)
    assert rollout._expected_within(0.0)  # back already


def test_for_schedule_builds_the_round_or_the_continuous_scheduler():
    class Batched(ScriptedBackend):
        max_batch_size = 7

    rounds = ContinuousRollout.for_schedule(Batched(random_tool_agent()), PureRunner(),
                                            RolloutConfig(**CONFIG, schedule="rounds"))
    continuous = ContinuousRollout.for_schedule(Batched(random_tool_agent()), PureRunner(),
                                                RolloutConfig(**CONFIG, schedule="continuous"))
    assert (rounds.tool_barrier, rounds.max_batch) == (True, None)
    assert (continuous.tool_barrier, continuous.max_batch) == (False, 7)
    # "auto", the default: rounds for a synchronous step (and eta = 0), continuous where steps
    # overlap -- the asynchronous mode ran on rounds after the default changed, and its gain at 1 s
    # search latency went with it (65.6 s for 6 steps against 34.8 s; docs/async.md)
    auto = RolloutConfig(**CONFIG)
    assert auto.schedule == "auto"
    assert [auto.resolved_schedule(eta) for eta in (0, 1, 2)] == ["rounds", "continuous", "continuous"]
    assert ContinuousRollout.for_schedule(Batched(random_tool_agent()), PureRunner(), auto).tool_barrier
    assert not ContinuousRollout.for_schedule(Batched(random_tool_agent()), PureRunner(), auto, 1).tool_barrier
    for eta in (0, 1):  # a schedule named is kept
        assert RolloutConfig(**CONFIG, schedule="rounds").resolved_schedule(eta) == "rounds"
        assert RolloutConfig(**CONFIG, schedule="continuous").resolved_schedule(eta) == "continuous"
    expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                      RolloutConfig(**CONFIG)).rollout(PROMPTS, step=2)
    got = rounds.run_step(PROMPTS, 2)  # the round schedule through run_step: the same call, round for round
    assert _signature(got.trajectories) == _signature(expected.trajectories)
    assert got.stats.rounds == expected.stats.rounds


class SlowSearch(Tool):
    """Answers after a random few milliseconds (seeded by the payload): results come back out of order."""

    name = "search"

    def __call__(self, payload: str) -> ToolResult:
        time.sleep(random.Random(payload).uniform(0.0, 0.02))
        return ToolResult(f"search({payload})", ok=True)


def test_many_steps_in_flight_each_get_k_per_prompt_oldest_first():
    sampled_steps = []

    class Recording(ContinuousRollout):
        def ready(self):
            batch = super().ready()
            sampled_steps.append(sorted({t.step for t in batch}))
            return batch

    with ToolRunner({"search": SlowSearch()}, max_workers=8) as runner:
        rollout = Recording(ScriptedBackend(random_tool_agent()), runner, RolloutConfig(**CONFIG), max_batch=5)
        for step in (4, 5, 6):
            rollout.admit(PROMPTS, step)
        with pytest.raises(ValueError, match="admitted already"):
            rollout.admit(PROMPTS, 5)
        results = _drain(rollout)
    assert sorted(results) == [4, 5, 6] and not rollout.states
    for step, result in results.items():
        assert len(result.trajectories) == CONFIG["k"] * len(PROMPTS)
        assert all(t.done and t.step == step for t in result.trajectories)
        kept = sum(sum(t.loss_mask[t.branch_position or 0:]) for t in result.trajectories)
        assert result.stats.tokens_generated - result.stats.discarded_tokens == kept
    assert sampled_steps[0] == [4]  # the oldest step's trajectories fill the first rounds
    assert max(len(s) for s in sampled_steps) > 1  # and later steps sample while it waits on tools


# ---------------------------------------------------------------------------------------------
# Partial rollouts: a cut segment goes on under new weights


def test_cut_segments_continue_under_the_new_weights(tiny_hf):
    from transformers import AutoModelForCausalLM

    from aepo_engine.rollout.backends.hf import HFBackend

    base, tok = tiny_hf
    model = AutoModelForCausalLM.from_config(base.config)
    model.load_state_dict(base.state_dict())
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in v0.items()}
    config = RolloutConfig(k=4, n_entropy_tokens=4, max_response_tokens=60, max_tokens_per_segment=24,
                           max_tool_calls=3, seed=1, temperature=0.9)
    prompts = [tok("Q:")["input_ids"], tok("Q: ")["input_ids"]]
    with ToolRunner({"search": FoundTool()}, max_workers=2) as runner:
        backend = HFBackend(model, tok)
        rollout = ContinuousRollout(backend, runner, config)
        rollout.admit(prompts, step=0)
        assert rollout.round(CutAfter(5))  # every segment of the first round is cut after 5 tokens
        assert rollout.cut_segments > 0
        backend.update_weights(v1)
        rollout.policy_version = 1
        (result,) = _drain(rollout).values()
    trajectories = result.trajectories
    assert len(trajectories) == 8 and all(t.done for t in trajectories)
    assert any(len({v for v, m in zip(t.versions, t.loss_mask) if m}) == 2 for t in trajectories)
    for weights, version in ((v0, 0), (v1, 1)):
        model.load_state_dict(weights)
        for t in trajectories:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(t.prompt_ids) - 1:-1]
            logp = torch.log_softmax(logits.float() / config.temperature, -1)
            token_logp = logp.gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
            mine = torch.tensor([m == 1 and v == version for m, v in zip(t.loss_mask, t.versions)])
            # the prefix the continuation saw is the stored one: its tokens score as sampled
            torch.testing.assert_close(token_logp[mine], torch.tensor(t.logprobs)[mine], atol=1e-3, rtol=0)
    assert all(v == -1 for t in trajectories for v, m in zip(t.versions, t.loss_mask) if not m)


def test_a_stop_string_split_by_the_cut_ends_the_segment():
    tok = CharTokenizer()
    ids = tok.encode("ab</se") + tok.encode("arch>and on")  # the backend's continuation missed the stop
    output = GenOutput(ids, [-0.5] * len(ids), [1.0] * len(ids), "length")
    cut = cut_at_stop(output, resumed_at=6, stop_strings=("</search>", "</python>"), tokenizer=tok)
    assert tok.decode(cut.token_ids) == "ab</search>" and cut.finish_reason == "stop" and cut.stop_string == "</search>"
    assert len(cut.logprobs) == len(cut.entropies) == len(cut.token_ids)
    inside = GenOutput(tok.encode("ab cd</search>"), [0.0] * 14, [0.0] * 14, "stop", "</search>")
    assert cut_at_stop(inside, 3, ("</search>",), tok) is inside  # a stop string after the cut: the backend's
    assert cut_at_stop(output, 0, ("</search>",), tok) is output  # no cut: nothing to look for


# ---------------------------------------------------------------------------------------------
# Versions on tokens and the staleness bookkeeping


def _traj(versions, mask, kind="global", prompt_ids=(1, 2)):
    t = Trajectory(prompt_ids=list(prompt_ids), prompt_index=0, traj_id=0, step=0, kind=kind)
    t.response_ids = list(range(3, 3 + len(versions)))
    t.loss_mask, t.versions = list(mask), list(versions)
    t.logprobs, t.entropies = [-0.1] * len(mask), [0.5] * len(mask)
    return t


def test_versions_follow_segments_branches_and_the_batch():
    t = Trajectory(prompt_ids=[1, 2], prompt_index=0, traj_id=0, step=3, kind="global")
    t.append_model_segment([5, 6], [-0.1, -0.2], [1.0, 1.0], 2, versions=[2, 3])
    t.append_tool_result([7, 8, 9])
    t.append_model_segment([10], [-0.3], [0.5], 2, versions=3)
    assert t.versions == [2, 3, -1, -1, -1, 3]
    child = t.fork(2, traj_id=1)
    assert child.versions == [2, 3, -1, -1, -1]  # the inherited prefix keeps its versions
    with pytest.raises(ValueError, match="versions"):
        t.append_model_segment([1, 2], [0.0, 0.0], [0.0, 0.0], 2, versions=[1])
    batch = TokenBatch.from_trajectories([t, child], [1.0, -1.0])
    # row 0: prompt of 2 -> response token j at label position 1 + j
    assert batch.versions[0, 1:7].tolist() == [2, 3, -1, -1, -1, 3] and batch.versions[0, 0] == -1
    assert batch.versions[1, 6:].eq(-1).all()  # padding


def test_admission_and_staleness_hand_worked():
    # eta = 2: step 5 may start from version 3; never before the run's first version
    assert admission_version(5, 2) == 3 and admission_version(1, 2) == 0 and admission_version(6, 2, first_version=5) == 5
    versions = torch.tensor([[-1, 4, 4, 3, -1], [-1, 5, 5, -1, -1], [-1, -1, -1, -1, -1]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 1, 0, 0, 0]])  # row 2: no version recorded
    stale = token_staleness(versions, mask, step=5)
    assert stale.tolist() == [[0, 1, 1, 2, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    m = staleness_metrics(versions, mask, step=5)
    # known tokens: staleness 1, 1, 2, 0, 0 -> mean 0.8; row 0 mixes versions 3 and 4
    assert m["staleness/mean"] == pytest.approx(0.8) and m["staleness/max"] == 2
    assert (m["staleness/tokens_d0"], m["staleness/tokens_d1"], m["staleness/tokens_d2"]) == (2, 2, 1)
    assert (m["staleness/tokens_v5"], m["staleness/tokens_v4"], m["staleness/tokens_v3"]) == (2, 2, 1)
    assert m["staleness/mixed_trajectories"] == pytest.approx(1 / 2)
    assert staleness_metrics(versions, torch.zeros_like(mask), 5) == {}


def test_branch_decisions_report_the_version_gap_of_their_entropies():
    t = Trajectory(prompt_ids=[1], prompt_index=0, traj_id=0, step=0, kind="global")
    t.append_model_segment([5, 6], [0.0, 0.0], [1.0, 1.0], 2, versions=0)
    t.append_tool_result([7])
    t.append_model_segment([8], [0.0], [1.0], 2, versions=2)
    t.decisions.append(BranchDecision(1, 1.0, 1.0, 0.5, 0, 0.5, False, False))
    assert branching_version_gaps([t]) == [2]
    assert branching_version_gaps([_traj([1, 1], [1, 1])]) == []


class HeldRunner:
    """A tool runner whose results come back when the test says (``submit`` gives a Future)."""

    def __init__(self):
        self.calls: list[tuple[Future, object]] = []

    def submit(self, call) -> Future:
        future = Future()
        self.calls.append((future, call))
        return future

    def answer(self, keep=None) -> None:
        for future, call in self.calls:
            if future is not keep and not future.done():
                future.set_result(ToolResult(f"search({call.payload})", ok=True))


def test_no_tool_call_runs_for_a_trajectory_its_prompt_discarded():
    """The bench's seed-2, eta-2 run died with ``KeyError`` in ``take_tool_results``: a
    trajectory's call was still running when its prompt discarded it (a speculative sample beyond
    m), the step ended and its states were removed, then the result came back. A prompt now
    discards only at the end of a round of the round schedule, once that round's results are
    back, and reads a pre-sampled child's call only once a decision has taken it (issue 52).
    Here each turn holds back the oldest call still running, as long as anything else can go on:
    every call in flight belongs to a trajectory its prompt still samples, no result is dropped,
    and the step is the round schedule's."""
    for seed in range(4):
        for experimental in (RolloutExperiments(), RolloutExperiments(presample_children=True, speculative_branches=3)):
            config = RolloutConfig(**CONFIG, seed=seed, experimental=experimental)
            expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(),
                                              config).rollout(PROMPTS, step=0)
            runner = HeldRunner()
            rollout = ContinuousRollout(ScriptedBackend(random_tool_agent()), runner, config, max_batch=4)
            rollout.admit(PROMPTS, 0)
            results = {}
            while rollout.steps_in_flight:
                for pending in rollout._tools.values():
                    state = rollout.states[state_key(pending.traj)]
                    assert any(t is pending.traj for t in state.generating())
                running = [future for future, _ in runner.calls if not future.done()]
                runner.answer(keep=running[0] if running else None)
                if not rollout.round() and not rollout.take_tool_results():
                    runner.answer()  # nothing else can go on: the held call comes back
                    rollout.take_tool_results()
                results.update(dict(rollout.finished()))
            assert list(results) == [0] and not rollout.states and not rollout.waiting_on_tools
            assert _signature(results[0].trajectories) == _signature(expected.trajectories)
            assert results[0].stats.tool_calls_dropped == 0


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_training_run_on_the_continuous_schedule(tmp_path):
    """The trainer's steps on the continuous schedule (``rollout.schedule = "continuous"``; the
    default is rounds): the synchronous step source drives ``ContinuousRollout.run_step`` with tool calls in the
    background, and the run ends with its evaluation, every step's k trajectories per prompt and
    where the rollout's seconds went."""
    import json

    import runs
    from aepo_engine.metrics import read_metrics

    run_dir = tmp_path / "continuous"
    proc = runs.train(run_dir, "--rollout.schedule=continuous", "--train.steps=2", "--checkpoint.every_n_steps=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'schedule = "continuous"' in (run_dir / "config.toml").read_text()
    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/rounds"] >= 1 and row["loss/tokens"] > 0  # sampled, then trained on
        assert row["time/rollout_s"] >= row["time/rollout_generate_s"] > 0
    assert "accuracy" in json.loads((run_dir / "summary.json").read_text())["eval_after"]


# ---------------------------------------------------------------------------------------------
# The longest chain of tool calls: no schedule returns a step sooner


def _called(traj, seconds):
    traj.append_model_segment([5], [-0.1], [1.0], 2)
    traj.tool_log.append(ToolCallRecord("search", "q", "r", True, seconds))
    traj.append_tool_result([7])
    traj.tool_calls += 1


def test_the_longest_chain_counts_the_calls_before_a_branch_point_hand_worked():
    parent = Trajectory(prompt_ids=[1, 2], prompt_index=0, traj_id=0, step=0, kind="global")
    _called(parent, 0.2)
    child = parent.fork(2, traj_id=1)  # after the parent's first result: its 0.2 s is the child's too
    _called(parent, 0.5)  # parent: 0.2 + 0.5 = 0.7
    _called(child, 0.9)  # child: 0.2 + 0.9 = 1.1
    other = Trajectory(prompt_ids=[1, 2], prompt_index=0, traj_id=2, step=0, kind="global")
    _called(other, 0.3)
    _called(other, 0.6)  # 0.9
    stats = rollout_stats([2], [None], [None], [parent, child, other], RolloutCounters())
    assert stats.tool_chain_s == pytest.approx(1.1)
    assert rollout_stats([1], [None], [None], [], RolloutCounters()).tool_chain_s == 0.0


class FixedLatency(Tool):
    name = "search"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, payload: str) -> ToolResult:
        time.sleep(self.seconds)
        return ToolResult(f"search({payload})", ok=True)


@pytest.mark.parametrize("barrier", [True, False])
def test_no_schedule_returns_a_step_sooner_than_its_longest_chain_of_calls(barrier):
    """Each call of a chain waits for the one before it: a step takes at least its longest
    chain's seconds, on either schedule, and the chain is the most calls behind a returned
    trajectory times each call's latency."""
    config = RolloutConfig(**CONFIG)
    with ToolRunner({"search": FixedLatency(0.02)}, max_workers=32) as runner:
        rollout = ContinuousRollout(ScriptedBackend(random_tool_agent()), runner, config, tool_barrier=barrier)
        start = time.perf_counter()
        got = rollout.run_step(PROMPTS, 0, poll_s=0.01)
        wall = time.perf_counter() - start
    calls = max(len(t.tool_log) for t in got.trajectories)
    assert calls >= 2
    assert got.stats.tool_chain_s == pytest.approx(calls * 0.02, abs=0.5 * calls * 0.02)
    assert got.stats.tool_chain_s >= calls * 0.02 and wall >= got.stats.tool_chain_s


@pytest.mark.parametrize("step", [4, 22, 26])
def test_sampled_ahead_reserve_samples_resumed_by_a_refill_decide_as_of_their_round(step):
    """A reserve sample samples ahead of its prompt's rounds (``sample_ahead``); a refill that
    resumes it takes its late, blocked decisions for the segments of the rounds up to the
    refill only (``PromptState.as_of``), the later ones in their own rounds: the round
    schedule's trees, in steps whose prompts refill from the reserve (7 speculative globals)."""
    fields = dict(k=8, n_entropy_tokens=4, max_response_tokens=400, max_tokens_per_segment=100)
    expected = EntropyBalancedRollout(ScriptedBackend(random_tool_agent()), PureRunner(), RolloutConfig(
        **fields, experimental=RolloutExperiments(speculative_global_samples=7))).rollout(PROMPTS, step=step)
    assert expected.stats.fresh_global_samples > 0  # a refill resumed reserve samples
    config = RolloutConfig(**fields, experimental=RolloutExperiments(speculative_global_samples=7,
                                                                     sample_ahead=True, settle_s=0.0))
    with ToolRunner({"search": ScriptedLatency(step)}, max_workers=32) as runner:
        got = ContinuousRollout(ScriptedBackend(random_tool_agent()), runner, config).run_step(PROMPTS, step, poll_s=0.01)
    assert _signature(got.trajectories) == _signature(expected.trajectories)
    assert got.stats.m == expected.stats.m and got.stats.fresh_global_samples == expected.stats.fresh_global_samples


def test_a_refill_reads_a_reserve_sample_as_of_the_round_that_resumes_it():
    """Hand-built: k = 2, m = 1; the member has ended and the reserve sample has sampled its
    reactions to two tool results, the second one round ahead of the prompt (sample_ahead). The
    refill at the end of round 1 resumes it and takes its late decision for round 1's reaction
    only; round 2's reaction takes its decision in round 2."""
    config = RolloutConfig(k=2, n_entropy_tokens=1, max_response_tokens=400, max_tokens_per_segment=100)
    state = PromptState(0, [1, 2])
    state.m = 1
    member, reserve = state.new("global"), state.new("global")
    state.members, state.reserve = [member], [reserve]
    state.note_births(0)  # both start in round 0
    member.append_model_segment([5], [-0.1], [1.0], 1)
    member.finish_reason = "eos"
    for _ in range(2):  # rounds 0 and 1: a segment ending with a call, and its result
        reserve.append_model_segment([5], [-0.1], [1.0], 1)
        reserve.append_tool_result([7])
    reserve.append_model_segment([6], [-0.1], [1.0], 1)  # round 2's reaction, sampled ahead
    state.as_of = 1
    PreMonitoring(config, Branching(config, seed=0)).advance(state)
    assert state.members == [member, reserve] and not state.reserve  # the refill resumed it
    assert [d.tool_step for d in reserve.decisions] == [1]  # round 1's reaction only
