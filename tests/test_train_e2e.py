"""End to end: ``python -m aepo_engine.train`` on a tiny generated task, its outputs, a kill -9
in the middle of writing a checkpoint followed by ``--checkpoint.resume auto`` reproducing the
uninterrupted run exactly, damaged checkpoints skipped on resume (the run again reproduced), a
full disk during a save (one error line; ``checkpoint.on_save_error = "warn"`` trains on), and
config errors."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import runs
from aepo_engine.checkpoint import verify_checkpoint
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
    # the HF export only with the final checkpoint (checkpoint.hf_export_every = 0), every one verifiable
    exported = {p.parent.name for p in (uninterrupted / "checkpoints").glob("step_*/hf_model")}
    assert exported == {"step_000003"}
    for step in ("step_000001", "step_000002", "step_000003"):
        assert verify_checkpoint(uninterrupted / "checkpoints" / step) == [], step


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


@pytest.mark.sandbox
@pytest.mark.slow
def test_kill_during_a_lora_runs_checkpoint_then_resume_reproduces_it(tmp_path):
    """policy.lora: the checkpoints hold the adapter (train_state) beside its merged and PEFT
    exports; a kill -9 while writing step 2's then a resume ends bit-exactly where the
    uninterrupted LoRA run ends."""
    lora = ("--policy.lora.enabled=true", "--policy.lora.rank=4", "--optim.lr=1e-3")
    whole = tmp_path / "whole"
    done = train(whole, *lora)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = whole / "checkpoints" / "step_000003"
    assert (last / "adapter" / "adapter_model.safetensors").is_file() and verify_checkpoint(last) == []
    run_dir = tmp_path / "killed"
    killed = train(run_dir, *lora, fault="checkpoint_write:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = train(run_dir, *lora)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[resume] from" in resumed.stdout
    assert _metrics(run_dir) == _metrics(whole)
    for export in ("hf_model/model.safetensors", "adapter/adapter_model.safetensors"):
        expected, got = (load_file(r / "checkpoints" / "step_000003" / export) for r in (whole, run_dir))
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected), export
    adapter = load_file(last / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)


def _truncate(path: Path) -> None:
    """The issue's case: the newest checkpoint's data file cut to half its size."""
    file = path / "train_state" / "__0_0.distcp"
    os.truncate(file, file.stat().st_size // 2)


def _flip_bit(path: Path) -> None:
    file = path / "train_state" / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[len(data) // 3] ^= 0x01
    file.write_bytes(bytes(data))


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.parametrize("damage", [
    {"step_000003": (_truncate, "train_state/__0_0.distcp has"),
     "step_000002": (_flip_bit, "train_state/__0_0.distcp does not match its recorded xxh3_64 checksum")},
    {"step_000003": (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
     "step_000002": (lambda p: (p / "train_state" / ".metadata").unlink(), "train_state/.metadata is missing")},
], ids=["truncated_and_bit_flipped", "meta_json_missing_and_file_deleted"])
def test_damaged_checkpoints_are_skipped_and_the_run_reproduced(uninterrupted, tmp_path, damage):
    """The two newest checkpoints of a finished run damaged: resuming warns about each (naming the
    file), starts from step 1, and ends exactly where the uninterrupted run ended."""
    run_dir = tmp_path / "damaged"
    shutil.copytree(uninterrupted, run_dir, symlinks=True)
    for name in ("summary.json", "plots"):  # so that they must be written again
        shutil.rmtree(run_dir / name) if (run_dir / name).is_dir() else (run_dir / name).unlink()
    for step, (damage_fn, _) in damage.items():
        damage_fn(run_dir / "checkpoints" / step)

    resumed = train(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    first = run_dir / "checkpoints" / "step_000001"
    for step, (_, said) in damage.items():
        assert (f"warning: checkpoint {run_dir / 'checkpoints' / step} is damaged ({said}"
                in resumed.stderr), resumed.stderr[-3000:]
        assert f"skipped; resuming from {first} instead" in resumed.stderr
    assert f"[resume] from {first} (after step 1)" in resumed.stdout
    assert len((run_dir / "logs" / "metrics.jsonl").read_text().splitlines()) == 3 + 2  # steps 2 and 3 again
    got_rows, expected_rows = _metrics(run_dir), _metrics(uninterrupted)
    assert got_rows == expected_rows
    expected, got = _final_weights(uninterrupted), _final_weights(run_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {**json.loads((uninterrupted / "summary.json").read_text()), "rl_seconds": summary["rl_seconds"]}
    assert all(verify_checkpoint(run_dir / "checkpoints" / step) == [] for step in damage)  # saved again


@pytest.mark.sandbox
@pytest.mark.slow
def test_full_disk_during_a_save_is_one_error_line_then_warn_trains_on(small_disk, tmp_path):
    """The checkpoints on a 5 MiB tmpfs that holds one (3.3 MB) of the tiny run's: a warning
    before step 1 that keep_last of them cannot fit; the step-2 save fails with one error line
    (exit 2) naming the step, the bytes needed and free, and step 1 as what a resume will use;
    step 1 is intact. Resumed with checkpoint.on_save_error=warn, the run finishes (exit 0),
    warning at each save the disk refuses."""
    disk = small_disk(5 << 20)
    run_dir = tmp_path / "run"
    stopped = train(run_dir, f"--checkpoint.dir={disk / 'ckpt'}")
    assert stopped.returncode == 2, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    assert f"warning: the checkpoints need up to" in stopped.stderr and str(disk / "ckpt") in stopped.stderr
    errors = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    first = disk / "ckpt" / "step_000001"
    assert len(errors) == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert errors[0].startswith("error: the checkpoint of step 2 was not saved: the disk is full (it needs about ")
    assert "bytes are free in" in errors[0] and f"a resume will use {first}" in errors[0]
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["latest", "step_000001"]
    assert verify_checkpoint(first) == []

    warned = train(run_dir, f"--checkpoint.dir={disk / 'ckpt'}", "--checkpoint.on_save_error=warn")
    assert warned.returncode == 0, warned.stdout[-3000:] + warned.stderr[-3000:]
    assert f"[resume] from {first} (after step 1)" in warned.stdout
    for step in (2, 3):
        assert (f"warning: the checkpoint of step {step} was not saved: the disk is full" in warned.stderr
                and "training goes on (checkpoint.on_save_error = 'warn')" in warned.stderr), warned.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["latest", "step_000001"]


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
