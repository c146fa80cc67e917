"""The async benchmark's bookkeeping (bench/bench_async.py) and the paper-node simulation
(bench/simulate_async.py) on hand-made inputs: what a row says follows from the run's metrics, and
the simulation's schedules add up the way they are described."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import bench_async  # noqa: E402
import simulate_async as sim  # noqa: E402


def test_modes_and_run_rows(tmp_path):
    assert bench_async.mode_args("sync") == ["--train.mode=sync"]
    assert bench_async.mode_args("async:2") == ["--train.mode=async", "--train.max_staleness=2"]
    assert bench_async.mode_args("sync:continuous") == ["--train.mode=sync", "--rollout.schedule=continuous"]
    assert bench_async.mode_args("async:1:rounds") == ["--train.mode=async", "--train.max_staleness=1",
                                                       "--rollout.schedule=rounds"]
    with pytest.raises(SystemExit, match="SCHEDULE"):
        bench_async.mode_args("sync:fast")
    assert bench_async.mode_args("sync:continuous+rollout.experimental.sample_ahead=true") == [
        "--train.mode=sync", "--rollout.schedule=continuous", "--rollout.experimental.sample_ahead=true"]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_async.mode_args("sync+sample_ahead")
    with pytest.raises(SystemExit, match="async:ETA"):
        bench_async.mode_args("async")
    logs = tmp_path / "logs"
    logs.mkdir()
    # three steps ending at 40, 60 and 80 s of the loop: 135 steps/hour overall, 180 in steady state
    rows = [{"step": i, "time/loop_s": t, "time/step_s": 20.0, "time/update_s": 5.0, "staleness/mean": s,
             "reward/mean": 0.1 * i, "engine/generate_s": 8.0, "time/wait_for_rollouts_s": 10.0}
            for i, (t, s) in enumerate(((40.0, 0.0), (60.0, 1.0), (80.0, 0.5)))]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"eval_before": {"accuracy": 0.3}, "eval_after": {"accuracy": 0.5}}))
    log = "\tUser time (seconds): 100.5\n\tSystem time (seconds): 9.5\n\tMaximum resident set size (kbytes): 2048000\n"
    row = bench_async.summarize_run(tmp_path, log, {"mode": "async:1"})
    assert row["steps_per_hour"] == 135.0 and row["steady_steps_per_hour"] == 180.0
    assert row["time_sums_s"] == {"time/update_s": 15.0, "time/step_s": 60.0, "engine/generate_s": 24.0,
                                  "time/wait_for_rollouts_s": 30.0}
    assert (row["acc_before"], row["acc_after"], row["cpu_s"], row["max_rss_mb"]) == (0.3, 0.5, 110.0, 2000.0)
    assert row["staleness_mean"] == 0.5
    assert (row["engine_idle_share"], row["trainer_idle_share"]) == (0.7, 0.375)  # 24 s generating, 30 s waiting of 80


def _shapes():
    # one tool call each: 10 + 20 model tokens around a 5-token result; and no tool call: 30 tokens
    return [sim.Shape([10, 20], [("search", 5)]), sim.Shape([30], [])]


def test_scaling_keeps_the_shape_and_caps_the_response():
    job = sim.Job(max_response=500)
    scaled = sim.scale_shapes(_shapes(), mean_model_tokens=300.0, tool_result_tokens=50.0, job=job)
    assert scaled[0].segments == [100, 200] and scaled[1].segments == [300]  # x 10: the mean was 30
    assert scaled[0].tools == [("search", 50)]
    capped = sim.scale_shapes(_shapes(), mean_model_tokens=600.0, tool_result_tokens=5.0, job=job)
    assert sum(capped[1].segments) == 500  # 600 cut to the response budget


def test_sync_step_is_its_parts_and_async_hides_the_rollout_behind_a_longer_update():
    job = sim.Job(prompts=2, k=2, prompt_tokens=10)
    hw = sim.Hardware()
    shapes = sim.scale_shapes(_shapes(), 300.0, 50.0, job)
    sync = sim.simulate_sync(hw, job, shapes, steps=3, kv_tokens=10**7, seed=0)
    assert sync["step_s"] == pytest.approx(sync["rollout_s"] + sync["update_s"] + sync["sync_s"])
    assert sync["rollout_s"] > 1.0  # at least the tool latency of the slowest trajectory (1 s median)
    # a trainer so slow that the rollouts always finish first: the async step is the update + push
    slow = sim.Hardware(train_flops=1e9)
    result = sim.simulate_async(slow, job, shapes, steps=5, engine_gpus=4, tp=1, kv_tokens=10**7, eta=1, seed=0)
    assert result["step_s"] == pytest.approx(result["update_s"] + result["push_s"], rel=0.05)
    assert math.isfinite(result["engine_busy"]) and 0 < result["engine_busy"] <= 1


def test_shapes_are_read_from_sample_dumps(tmp_path):
    samples = tmp_path / "run" / "logs" / "samples"
    samples.mkdir(parents=True)
    row = {"segments": [["model", 0, 4], ["tool", 4, 9], ["model", 9, 12]], "tool_log": [{"tool": "python"}]}
    (samples / "step_000000.jsonl").write_text(json.dumps(row) + "\n")
    (shape,) = sim.load_shapes([tmp_path])
    assert shape.segments == [4, 3] and shape.tools == [("python", 5)]
