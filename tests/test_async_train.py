"""``train.mode = "async"`` end to end on the tiny job, and the rollout process on its own.

- eta = 0 runs the rollouts in the rollout process, weights sent there as bytes, and is the
  synchronous run bit for bit (metrics, final weights, held-out results): the machinery adds
  nothing but the overlap it is asked for.
- eta = 1: every trained token is at most one version stale, the staleness and engine metrics are
  logged, a run killed after a step leaves no rollout process behind, and resumes.
- the rollout process: weights pushed as bytes arrive exactly; an order waits for its version; a
  failure inside it reaches the trainer with its traceback.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import runs
from aepo_engine.asynchronous.client import RolloutProcess, RolloutProcessDied
from aepo_engine.asynchronous.source import _engine_metrics
from aepo_engine.asynchronous.messages import (EngineCounters, StepDone, WeightBucket, WeightsBegin, WeightsEnd,
                                               WeightsReceived, decode_buckets, encode_buckets)
from aepo_engine.asynchronous.worker import WorkerSpec
from aepo_engine.metrics import read_metrics
from runs import TINY_RUN

VOLATILE = ("time/", "throughput/", "engine/", "tokens_per_s")


def _train(run_dir: Path, *extra: str, fault: str = "") -> "subprocess.CompletedProcess":  # noqa: F821
    return runs.train(run_dir, *TINY_RUN, *extra, env=runs.child_env(compiled=True, AEPO_FAULT=fault))


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(k.startswith(p) or k.endswith(p) for p in VOLATILE)}
            for row in read_metrics(run_dir / "logs" / "metrics.jsonl")]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "hf_model" / "model.safetensors")


@pytest.mark.sandbox
@pytest.mark.slow
def test_eta_zero_is_the_synchronous_run_bit_for_bit(tiny_run, tmp_path):
    run_dir = tmp_path / "async0"
    proc = _train(run_dir, "--train.mode=async", "--train.max_staleness=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[async] rollout process" in proc.stdout
    assert "max staleness 0, rounds wait for their tool calls" in proc.stdout  # rollout.schedule "auto"
    got, expected = _rows(run_dir), _rows(tiny_run)
    assert len(got) == len(expected) == 3
    for got_row, expected_row in zip(got, expected):
        differing = {k: (got_row.get(k), v) for k, v in {**expected_row, **got_row}.items()
                     if got_row.get(k) != expected_row.get(k)}
        assert not differing, f"step {expected_row['step']}: {differing}"
        assert got_row["staleness/max"] == 0
    expected_weights, got_weights = _weights(tiny_run), _weights(run_dir)
    assert all(torch.equal(expected_weights[name], got_weights[name]) for name in expected_weights)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_after"] == json.loads((tiny_run / "summary.json").read_text())["eval_after"]


@pytest.mark.sandbox
@pytest.mark.slow
@runs.dist_tests
def test_two_ranks_each_with_a_rollout_process_are_the_synchronous_two_rank_run(tmp_path):
    """Under torchrun (2 gloo ranks, FSDP2) each rank's rollout process samples its share of a
    step's prompts and the batch is gathered in prompt order: at eta = 0 that is the synchronous
    2-rank run bit for bit (metrics, final weights, held-out results)."""
    common = [*runs.TINY, "--train.steps=2", "--policy.fsdp=on", "--checkpoint.keep_last=5"]
    runs.launch_torchrun(["-m", "aepo_engine.train", *common, f"--run_dir={tmp_path / 'sync'}"], timeout=900)
    output = runs.launch_torchrun(["-m", "aepo_engine.train", *common, f"--run_dir={tmp_path / 'async'}",
                                   "--train.mode=async", "--train.max_staleness=0"], timeout=900)
    assert output.count("[async] rollout process") == 2  # one per rank
    got, expected = _rows(tmp_path / "async"), _rows(tmp_path / "sync")
    assert len(got) == len(expected) == 2
    for got_row, expected_row in zip(got, expected):
        differing = {k: (got_row.get(k), v) for k, v in {**expected_row, **got_row}.items()
                     if got_row.get(k) != expected_row.get(k)}
        assert not differing, f"step {expected_row['step']}: {differing}"
    expected_weights, got_weights = _weights(tmp_path / "sync"), _weights(tmp_path / "async")
    assert all(torch.equal(expected_weights[name], got_weights[name]) for name in expected_weights)
    assert (json.loads((tmp_path / "async" / "summary.json").read_text())["eval_after"]
            == json.loads((tmp_path / "sync" / "summary.json").read_text())["eval_after"])


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.sandbox
@pytest.mark.slow
def test_eta_one_stays_within_one_version_and_a_killed_run_resumes(tmp_path):
    run_dir = tmp_path / "async1"
    killed = _train(run_dir, "--train.mode=async", "--train.max_staleness=1", fault="after_step:2")
    assert killed.returncode == -9, killed.stderr[-2000:]
    pid = int(re.search(r"\[async\] rollout process (\d+)", killed.stdout).group(1))
    # rollout.schedule "auto" where steps overlap: the process's rounds do not wait for tool calls
    assert "max staleness 1, tool calls in the background" in killed.stdout
    assert _gone(pid), "the rollout process outlived its killed trainer"
    resumed = _train(run_dir, "--train.mode=async", "--train.max_staleness=1")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[resume] from" in resumed.stdout
    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["staleness/max"] <= 1
        assert sum(v for k, v in row.items() if k.startswith("staleness/tokens_d")) == row["loss/tokens"]
        for key in ("time/wait_for_rollouts_s", "time/weight_push_s", "engine/generate_s", "engine/idle_s",
                    "engine/version", "rollout_correction/ratio_mean", "rollout_correction/truncated_share"):
            assert key in row, key
    # steps 1 and 2 were ordered one version ahead: sampled (at least partly) by the version before
    assert rows[1].get("staleness/tokens_d1", 0) > 0
    assert all(torch.isfinite(w).all() for w in _weights(run_dir).values())


@pytest.mark.sandbox
@pytest.mark.slow
def test_an_asynchronous_lora_run_pushes_only_the_adapter(tiny_run, tmp_path):
    """policy.lora with train.mode = async: the rollout process's engine is built with the same
    adapters and each push carries them only (engine/push_bytes: the adapters' bytes, a small
    share of the synchronous full-weight run's), and the run ends with the adapter exported."""
    run_dir = tmp_path / "async_lora"
    proc = _train(run_dir, "--train.mode=async", "--train.max_staleness=1", "--policy.lora.enabled=true",
                  "--policy.lora.rank=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, full = read_metrics(run_dir / "logs" / "metrics.jsonl"), read_metrics(tiny_run / "logs" / "metrics.jsonl")
    pushed = [r["engine/push_bytes"] for r in rows[:-1]]  # no push after the last step
    adapter = load_file(run_dir / "checkpoints" / "step_000003" / "adapter" / "adapter_model.safetensors")
    assert pushed == [sum(t.numel() * 4 for t in adapter.values())] * len(pushed)  # fp32 engine: 4 bytes
    assert 0 < pushed[0] < full[0]["engine/push_bytes"] / 5


# ---------------------------------------------------------------------------------------------
# The rollout process on its own


def test_weight_buckets_cross_as_exact_bytes():
    gen = torch.Generator().manual_seed(0)
    buckets = [{"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16)},
               {"c": torch.randint(0, 9, (2, 2), generator=gen)}]
    back = list(decode_buckets(encode_buckets(buckets)))
    assert [sorted(b) for b in back] == [["a", "b"], ["c"]]
    for sent, got in zip(buckets, back):
        for name in sent:
            assert got[name].dtype == sent[name].dtype and torch.equal(got[name], sent[name])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from aepo_engine.models import build_tiny_qwen3

    return Path(build_tiny_qwen3(tmp_path_factory.mktemp("m") / "m", texts=["Q: <search>a</search> A: a"] * 8,
                                 seed=0, hidden_size=64, num_layers=1, head_dim=32, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, vocab_size=200))


def _spec(model_dir: Path, **overrides) -> WorkerSpec:
    from aepo_engine.config import load_train_config

    cfg = load_train_config(["--preset", "embedded", "--preset", "tiny", "--tools.enabled=[]",
                             "--rollout.max_response_tokens=12", "--rollout.max_tokens_per_segment=12"])
    fields = dict(backend=cfg.backend, rollout=cfg.rollout, tools=cfg.tools, model_dir=str(model_dir),
                  engine_seed=0, seed=0, threads=1)
    return WorkerSpec(**{**fields, **overrides})


@pytest.mark.slow
def test_orders_wait_for_their_version_and_tokens_record_it(tiny_model):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    prompts = [[5, 6, 7], [8, 9]]
    with RolloutProcess(_spec(tiny_model)) as process:
        process.push_weights(0, [state])
        process.order(1, prompts, min_version=1)  # needs version 1: waits
        process.order(0, prompts, min_version=0)
        first = process.take(0, timeout_s=300)
        with pytest.raises(TimeoutError):
            process.take(1, timeout_s=3)
        process.push_weights(1, [{k: v * 1.01 for k, v in state.items()}])
        second = process.take(1, timeout_s=300)
    assert {v for t in first.trajectories for v, m in zip(t.versions, t.loss_mask) if m} == {0}
    assert {v for t in second.trajectories for v, m in zip(t.versions, t.loss_mask) if m} == {1}
    assert len(first.trajectories) == len(second.trajectories) == 2 * 2  # k = 2 (tiny preset)
    assert second.counters.tokens_by_version[1] > 0 and second.counters.version == 1


@pytest.mark.slow
def test_a_failure_in_the_rollout_process_reaches_the_trainer(tmp_path):
    with pytest.raises(RolloutProcessDied, match=r"(?s)the rollout process failed:.*Traceback"):
        RolloutProcess(_spec(tmp_path / "no_such_model"), start_timeout_s=300)


def test_engine_metrics_never_go_back_when_steps_end_out_of_order():
    """Step 1 may end before step 0 (its prompts finish first): the per-step engine metrics are
    differences of the newest counters received, never negative (they were: step 1's own counters
    are older than step 0's)."""
    import queue

    process = object.__new__(RolloutProcess)  # the message handling alone, no process behind it
    process.outbox, process._done, process.counters = queue.Queue(), {}, EngineCounters()
    for step, generate_s in ((1, 5.0), (0, 9.0)):  # sent in this order: step 1's counters are the older
        process.outbox.put(StepDone(step, [], None, EngineCounters(version=1, generate_s=generate_s), 1.0))
    before, seen = EngineCounters(), []
    for step in (0, 1):
        assert process.take(step, timeout_s=5).step == step
        seen.append(_engine_metrics(process.counters, before)["engine/generate_s"])
        before = process.counters
    assert seen == [9.0, 0.0]


def test_cpu_threads_are_split_between_the_processes_only_when_they_overlap():
    """At zero search latency, 2 + 2 threads on 2 cores ran the update 5x and generation 7x slower
    than the synchronous run (docs/async.md): eta >= 1 on CPU splits the cores, the trainer taking
    the larger half; eta = 0 (the processes take turns: bit for bit the synchronous run), CUDA and
    an explicit train.torch_threads keep what they have."""
    from aepo_engine.asynchronous.source import cpu_thread_split

    assert cpu_thread_split(2, 1, 0, cuda=False) == (1, 1)
    assert cpu_thread_split(2, 2, 0, cuda=False) == (1, 1)
    assert cpu_thread_split(7, 1, 0, cuda=False) == (4, 3)
    assert cpu_thread_split(1, 1, 0, cuda=False) == (1, 1)
    assert cpu_thread_split(2, 0, 0, cuda=False) == (2, 2)
    assert cpu_thread_split(16, 1, 0, cuda=True) == (16, 16)
    assert cpu_thread_split(2, 1, 3, cuda=False) == (3, 3)


class _Alive:
    """A process that stays alive (or not) for the message handling below."""

    def __init__(self, alive: bool = True):
        self.alive, self.exitcode = alive, None if alive else 1

    def is_alive(self) -> bool:
        return self.alive


def test_a_push_waits_until_the_previous_one_is_received():
    """GPU review 2, point 5: at most one weight version on its way to the rollout process. The
    second push first takes the receipt of the first (keeping a step's trajectories that come
    before it); with no receipt and the process gone, it raises instead of queueing another."""
    import queue

    process = object.__new__(RolloutProcess)
    process.inbox, process.outbox, process.process = queue.Queue(), queue.Queue(), _Alive()
    process._done, process.counters, process.push_s, process._in_flight = {}, EngineCounters(), 0.0, None
    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    process.push_weights(0, [state])
    sent = [process.inbox.get_nowait() for _ in range(process.inbox.qsize())]
    assert [type(m) for m in sent] == [WeightsBegin, WeightBucket, WeightsEnd] and process._in_flight == 0
    process.outbox.put(StepDone(3, [], None, EngineCounters(version=0), 1.0))
    process.outbox.put(WeightsReceived(0))
    process.push_weights(1, [state])
    assert process._in_flight == 1 and 3 in process._done  # the receipt taken, the trajectories kept
    process.process = _Alive(False)  # the rollout process died before receiving version 1
    with pytest.raises(RolloutProcessDied, match="exited"):
        process.push_weights(2, [state])
    assert process.inbox.qsize() == 3  # version 2 was not queued


@pytest.mark.slow
def test_the_rollout_process_reports_its_engines_dtype_and_receipts(tiny_model):
    """The rollout process's Ready carries the engine's weight dtype (the async loop gathers its
    pushes in it, as the synchronous sync does: it sent fp32 to a bf16 engine), and every complete
    push is acknowledged."""
    import dataclasses

    import msgspec
    from transformers import AutoModelForCausalLM

    spec = _spec(tiny_model)
    spec = dataclasses.replace(spec, backend=msgspec.structs.replace(spec.backend, dtype="bfloat16"))
    state = {k: v.to(torch.bfloat16) for k, v in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items()}
    with RolloutProcess(spec) as process:
        assert process.weight_dtype == torch.bfloat16
        for version in range(3):  # each push waits for the previous one's receipt
            process.push_weights(version, [state])
        process.order(0, [[5, 6, 7]], min_version=2)
        done = process.take(0, timeout_s=300)
    assert done.counters.version == 2 and process._in_flight in (None, 2)


@pytest.mark.sandbox
@pytest.mark.slow
def test_an_asynchronous_run_has_one_engine_and_evaluates_with_it(tmp_path, monkeypatch):
    """GPU review 2, point 3: the trainer of an asynchronous run built an engine of its own (for its
    evaluations) beside the rollout process's; on one GPU the two fail vLLM's start-up check and
    the placement plans one. Now the trainer builds none: the evaluations before and after RL
    sample with the rollout process's engine (``engine/serve_s`` of step 0 holds the first)."""
    import aepo_engine.train as train_module
    from aepo_engine.asynchronous.client import RemoteEngine

    built, engines = [], []
    real_build, real_evaluate = train_module.build_backend, train_module.Trainer.evaluate

    def counting_build(*args, **kwargs):
        built.append(args[0].kind)
        return real_build(*args, **kwargs)

    def recording_evaluate(self, label):
        engines.append(type(self.source.engine))
        return real_evaluate(self, label)

    monkeypatch.setattr(train_module, "build_backend", counting_build)
    monkeypatch.setattr(train_module.Trainer, "evaluate", recording_evaluate)
    monkeypatch.setenv("AEPO_FAULT", "")
    run_dir = tmp_path / "one_engine"
    proc = runs.run_main(train_module.main, [*runs.TINY, f"--run_dir={run_dir}", "--train.mode=async",
                                             "--train.max_staleness=1", "--train.steps=2", "--checkpoint.every_n_steps=0"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert built == [] and engines == [RemoteEngine, RemoteEngine]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_before"]["questions"] > 0 and "accuracy" in summary["eval_after"]
    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    assert rows[0]["engine/serve_s"] > 0 and rows[1]["engine/serve_s"] == 0  # no evaluation between the steps


def test_the_trainers_requests_wait_for_their_version():
    """A Generate waits, like an order, until the engine holds the weights it asks for."""
    import threading

    from aepo_engine.asynchronous.messages import Generate, Order
    from aepo_engine.asynchronous.worker import _Inbox

    inbox = _Inbox(None, threading.Event(), threading.Event(), EngineCounters())
    inbox.requests = [Generate(1, [], min_version=2), Generate(2, [], min_version=1)]
    inbox.orders = [Order(5, [[1]], min_version=1)]
    assert [r.request_id for r in inbox.take_requests(1)] == [2]
    assert [r.request_id for r in inbox.take_requests(1)] == []
    assert [r.request_id for r in inbox.take_requests(3)] == [1]
    assert [o.step for o in inbox.take_orders(1)] == [5]


def test_an_asynchronous_trainer_rank_is_not_part_of_its_engines_tensor_parallel_group():
    """GPU review 2, point 3: with ``tensor_parallel_size = 2`` the trainer's one rank was laid out
    as half of a 2-GPU engine (and refused: 2 must divide the node's 1 rank); its rollout process's
    engine has GPUs of its own (split placement), so the rank samples, through it, every prompt."""
    from aepo_engine.config import load_train_config
    from aepo_engine.train import trainer_layout

    split = ["--backend.kind=vllm", "--backend.placement=split", "--backend.rollout_gpus=2",
             "--backend.tensor_parallel_size=2", "--backend.in_process=false"]
    layout = trainer_layout(load_train_config([*split, "--train.mode=async"]), 0, 1, 0, 1)
    assert layout.hosts == (0,) and layout.host and layout.prompts(5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the 1 ranks"):
        trainer_layout(load_train_config(split), 0, 1, 0, 1)  # a synchronous run's engine spans ranks
    # two CPU ranks, each with its own process: prompts alternate, as a synchronous run's two engines
    assert [trainer_layout(load_train_config(["--train.mode=async"]), r, 2, r, 2).prompts(4) for r in (0, 1)] \
        == [[0, 2], [1, 3]]
