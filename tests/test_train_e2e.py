"""End to end: ``python -m aepo_engine.train`` on a tiny generated task, its outputs, a kill -9
in the middle of writing a checkpoint followed by ``--checkpoint.resume auto`` reproducing the
uninterrupted run exactly, and config errors."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import runs
from aepo_engine.metrics import read_metrics
from runs import TINY, TINY_RUN, dist_tests

VOLATILE = ("time/", "throughput/", "tokens_per_s")


def train(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """A run as the shared ``tiny_run`` (tests/conftest.py) was made, optionally with a fault."""
    return runs.train(run_dir, *TINY_RUN, *extra, env=runs.child_env(compiled=True, AEPO_FAULT=fault or ""))


def _metrics(run_dir: Path) -> list[dict]:
    """The run's metric rows (a resumed step's last row wins), without the timing-dependent keys."""
    return [{k: v for k, v in row.items() if not any(k.startswith(p) or k.endswith(p) for p in VOLATILE)}
            for row in read_metrics(run_dir / "logs" / "metrics.jsonl")]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "hf_model" / "model.safetensors")


@pytest.fixture
def uninterrupted(tiny_run) -> Path:
    return tiny_run


@pytest.mark.sandbox
@pytest.mark.slow
def test_run_writes_everything_a_user_looks_at(uninterrupted):
    summary = json.loads((uninterrupted / "summary.json").read_text())
    for phase in ("eval_before", "eval_after"):
        assert set(summary[phase]) >= {"accuracy", "reward", "tool_calls", "no_tool_share"}
        assert any(key.startswith("accuracy/synthetic/") for key in summary[phase])
    rows = _metrics(uninterrupted)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "loss/entropy", "loss/clipfrac_high", "rollout/branches", "loss/grad_norm",
                "rollout/rounds", "rollout/waited_decisions", "rollout/fresh_global_samples", "loss/cf/kept_frac",
                "rollout/branches_per_traj", "rollout/branch_run_max", "rollout/penalty_decisive", "rollout/m_min",
                "rollout/h_root_mean"):
        assert all(key in r for r in rows), key
    assert all(r["rollout/rounds"] >= 1 for r in rows)
    # the HF backend samples with the very weights the policy holds: same log-probs up to fp32 noise
    assert all(r["rollout/logprob_gap"] < 1e-4 for r in rows)
    # ... so the mismatch correction's ratios are 1 and its KL estimate 0 (metrics logged every step)
    assert all(abs(r["rollout_correction/ratio_mean"] - 1) < 1e-4 and r["rollout_correction/kl_k3"] < 1e-6
               for r in rows)
    assert (uninterrupted / "config.toml").read_text().startswith("#")
    assert {"counterfactual_clip.png", "premonitoring.png"} <= {p.name for p in (uninterrupted / "plots").glob("*.png")}
    assert len(list((uninterrupted / "logs" / "samples").glob("step_*.jsonl"))) == 3
    from transformers import AutoModelForCausalLM

    latest = (uninterrupted / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000003"
    AutoModelForCausalLM.from_pretrained(uninterrupted / "checkpoints" / latest / "hf_model")


@pytest.mark.sandbox
@pytest.mark.slow
def test_kill_during_checkpoint_then_resume_reproduces_the_run(uninterrupted, tmp_path):
    run_dir = tmp_path / "killed"
    killed = train(run_dir, fault="checkpoint_write:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000001"
    assert any(".tmp" in p.name for p in checkpoints.iterdir())  # the half-written step 2

    resumed = train(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[resume] from" in resumed.stdout
    assert not any(".tmp" in p.name for p in checkpoints.iterdir())
    got_rows, expected_rows = _metrics(run_dir), _metrics(uninterrupted)
    assert len(got_rows) == len(expected_rows)
    for got_row, expected_row in zip(got_rows, expected_rows):
        differing = {k: (got_row.get(k), v) for k, v in expected_row.items() if got_row.get(k) != v}
        assert not differing, f"step {expected_row['step']}: {differing}"
    expected, got = _final_weights(uninterrupted), _final_weights(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {**json.loads((uninterrupted / "summary.json").read_text()), "rl_seconds": summary["rl_seconds"]}


@pytest.mark.parametrize("args,message", [
    (["--rollout.kk=3"], "did you mean"),
    (["--policy.loss.clip=ppo2"], "clip"),
    (["--task.source=files"], "data.train_files"),
    (["--preset", "nope"], "unknown preset"),
])
def test_config_errors_say_why(args, message, tmp_path):
    from aepo_engine.train import main

    # in this process (the command's error form as a child process: tests/test_entry_points.py)
    proc = runs.run_main(main, [f"--run_dir={tmp_path}", *args])
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr[-2000:]


@pytest.mark.sandbox
@pytest.mark.slow
@dist_tests
def test_whole_trainer_under_torchrun_two_ranks(uninterrupted, tmp_path):
    """The trainer itself on 2 gloo ranks with FSDP2: rank 0 builds the set-up, each rank samples
    its share of the prompts, the batch is all-gathered, evaluation is sharded and merged, only
    rank 0 writes; the sharded state is checkpointed and exported as one HF model."""
    from runs import launch_torchrun

    run_dir = tmp_path / "torchrun"
    output = launch_torchrun(["-m", "aepo_engine.train", *TINY, f"--run_dir={run_dir}", "--train.steps=2",
                              "--policy.fsdp=on", "--logging.sample_trajectories=8"], timeout=600)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]  # one writer: a row per step, not per rank
    # the gathered global batch: prompt 0 sampled on rank 0, prompt 1 on rank 1, k=2 trajectories each
    samples = [json.loads(line) for line in (run_dir / "logs" / "samples" / "step_000000.jsonl").read_text().splitlines()]
    assert sorted((s["prompt_index"], s["traj_id"]) for s in samples) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["questions"] == 2  # one question per rank, merged
    assert output.count("[done] held-out accuracy") == 1
    weights = _final_weights(run_dir)
    assert weights.keys() == _final_weights(uninterrupted).keys()
    assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.sandbox
@pytest.mark.slow
def test_logging_switches_and_prompt_limit(tmp_path):
    """logging.print_every_n_steps=0 prints no progress line, logging.jsonl=false writes no
    metrics.jsonl, and data.max_prompt_tokens=1 with overlong_prompts=error refuses to start."""
    run_dir = tmp_path / "quiet"
    proc = train(run_dir, "--train.steps=1", "--logging.print_every_n_steps=0", "--logging.jsonl=false",
                 "--checkpoint.every_n_steps=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 1/1" not in proc.stdout + proc.stderr
    assert not (run_dir / "logs" / "metrics.jsonl").exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1
    refused = train(tmp_path / "long", "--data.max_prompt_tokens=1", "--data.overlong_prompts=error")
    assert refused.returncode != 0 and "longer than data.max_prompt_tokens=1" in refused.stderr
