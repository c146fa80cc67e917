"""Smoke test of bench/bench_rollout.py: its case function at a tiny size, in-process.

Keeps the benchmark from rotting when the rollout, tools, SFT or task APIs change: a 1-layer
Qwen3 gets a 20-step warm start, then the ``plain`` and ``aepo`` cases each time one rollout call
(2 prompts x k=4, short token caps) through the HF backend with the real tools. The figures are
not checked, only that the rows are complete and consistent.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import msgspec
import pytest

from aepo_engine.rollout.config import RolloutExperiments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_rollout  # noqa: E402

TINY_SHAPE = dict(vocab_size=512, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  intermediate_size=128)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """(model dir, corpus path, model info) of a tiny warm-started model on the bench task."""
    tmp = tmp_path_factory.mktemp("bench_rollout")
    task = bench_rollout.bench_task(0)
    info = bench_rollout.warm_start(str(tmp / "model"), task, steps=20, seed=0, lr=1e-2,
                                    shape=TINY_SHAPE)
    return str(tmp / "model"), str(task.write_corpus(tmp / "kb.jsonl")), info


def case(workload, mode: str) -> dict:
    model_dir, corpus_path, _ = workload
    spec = bench_rollout.CaseSpec(backend="hf", mode=mode, model_dir=model_dir,
                                  corpus_path=corpus_path, prompts=2, k=4,
                                  max_response_tokens=64, max_tokens_per_segment=24,
                                  warmup=0, repeats=1, threads=1)
    return bench_rollout.run_case(spec)


@pytest.mark.slow
@pytest.mark.sandbox
def test_cases_give_complete_rows_and_a_ratio(workload):
    rows = [case(workload, "plain"), case(workload, "aepo")]
    for row in rows:
        assert row["trajectories"] == 8
        assert row["tokens_generated"] > 0 and row["rounds"] >= 1
        assert row["tokens_per_s"] > 0 and row["total_s"] > 0
        assert 0 < row["gen_s"] <= row["total_s"] and 0 <= row["tool_s"] <= row["total_s"]
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["tokens_per_cpu_s"] > 0 and len(row["calls"]) == 1
        assert row["model_tokens_per_traj"] <= row["response_tokens_per_traj"] <= 64
        assert isinstance(row["peak_bytes"], int) and not math.isnan(row["load_1m_before"])
    plain, aepo = rows
    assert plain["branches"] == 0 and plain["mean_m"] == 4  # branching off: k global samples
    assert 1 <= aepo["mean_m"] <= 4  # from pre-monitoring
    summary = {r["mode"]: r for r in bench_rollout.aggregate(rows + [plain])}  # plain twice
    assert summary["plain"]["cases"] == 2 and summary["plain"]["calls"] == 2
    assert summary["plain"]["vs_plain"] == 1.0
    assert summary["aepo"]["vs_plain"] == pytest.approx(
        aepo["tokens_per_s"] / plain["tokens_per_s"])
    assert workload[2]["model"].startswith("tiny-qwen3 + 20-step SFT")


def test_modes_differ_only_in_the_branching_rule():
    limits = dict(k=6, max_response_tokens=100, max_tokens_per_segment=50, seed=3)
    plain, aepo, strict, presample, early, arpo = (
        bench_rollout.mode_config(m, **limits)
        for m in ("plain", "aepo", "aepo_strict", "aepo_presample", "aepo_early", "arpo"))
    assert not plain.branching
    assert aepo.branching and aepo.pre_monitoring and aepo.branch_penalty
    assert aepo.speculative_globals == 2 and strict.speculative_globals == 0
    assert aepo.experimental == RolloutExperiments()
    assert strict.experimental == RolloutExperiments(speculative_global_samples=0, branch_before_m=False,
                                                     speculative_branches=0)
    assert presample.experimental == RolloutExperiments(presample_children=True)
    assert early.experimental == RolloutExperiments(monitor_tool_steps=1)
    for mode in (strict, presample, early):  # and nothing else differs from aepo
        assert msgspec.structs.replace(mode, experimental=RolloutExperiments()) == aepo
    assert arpo.branching and not arpo.pre_monitoring and not arpo.branch_penalty
    for config in (plain, aepo, strict, early, arpo):
        assert (config.k, config.max_response_tokens, config.seed) == (6, 100, 3)
    with pytest.raises(ValueError, match="unknown mode"):
        bench_rollout.mode_config("grpo", **limits)


@pytest.mark.slow
@pytest.mark.sandbox
def test_prefix_store_leaves_the_rollout_as_it_was(workload):
    """A whole AEPO rollout (real tools, branching) through the HF backend with and without its
    prefix store: the same trajectories, token for token, and most of the context reused."""
    from aepo_engine.rollout.scheduler import EntropyBalancedRollout

    model_dir, corpus_path, _ = workload
    limits = dict(k=4, max_response_tokens=64, max_tokens_per_segment=24, seed=0)
    results = {}
    for gib in (None, 0.0):
        spec = bench_rollout.CaseSpec(backend="hf", mode="aepo", model_dir=model_dir,
                                      corpus_path=corpus_path, prefix_cache_gib=gib)
        backend = bench_rollout.make_backend(spec)
        prompts = bench_rollout.chat_prompts(backend.tokenizer, bench_rollout.bench_task(0), 2)
        with bench_rollout.make_tool_runner(corpus_path) as runner:
            rollout = EntropyBalancedRollout(backend, runner, bench_rollout.mode_config("aepo", **limits))
            results[gib] = [rollout.rollout(prompts, step=s) for s in range(2)], backend.prefix_store
    (with_store, store), (without, no_store) = results[None], results[0.0]
    assert store.reused_tokens > 0 and no_store.reused_tokens == 0 and len(no_store) == 0
    assert sum(r.stats.tool_calls_executed for r in with_store) > 0
    assert sum(r.stats.branches for r in with_store) > 0  # children resend their parent's context
    for a, b in zip(with_store, without):
        assert [t.response_ids for t in a.trajectories] == [t.response_ids for t in b.trajectories]
        assert [t.parent_id for t in a.trajectories] == [t.parent_id for t in b.trajectories]
        for x, y in zip(a.trajectories, b.trajectories):
            assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0.0) < 2e-5
