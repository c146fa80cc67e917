"""The trainer's step around a sleeping vLLM engine, with recording fakes of the CUDA calls and of
the engine (issue 35, points 2 and 6): vLLM's sleep-mode pool allocates outside PyTorch's caching
allocator, so PyTorch's cached blocks must go back to the driver before each wake-up, or the
update's reserved peak and the woken engine add up (out of memory at the first wake-up on an 80 GB
GPU); and the weight sync gathers in the engine's dtype, not the fp32 of the master weights.

``Trainer.step`` itself runs here with the real synchronous step source (the real batch building,
rollout correction, metrics, weight push); only the parts that need a GPU or a model are fakes: the
rollouts (fixed trajectories and their scores), the policy worker (records its calls, yields 3
buckets), the engine (records sleep, wake-up and the buckets it takes) and ``torch.cuda.empty_cache``
(records the call).
"""
from __future__ import annotations

import torch
from test_policy_worker import make_traj

from aepo_engine.config import TrainConfig
from aepo_engine.data.examples import Example
from aepo_engine.rollout.backends import engine_layout
from aepo_engine.rollout.protocol import Capabilities
from aepo_engine.rollout.scheduler import RolloutResult, RolloutStats
from aepo_engine.step_source import SynchronousSource
from aepo_engine.train import Trainer

ENGINE_DTYPE = torch.bfloat16


class RecordingPolicy:
    def __init__(self, events):
        self.events = events
        self.pushed_bytes = 0  # PolicyWorker's count of the last push (engine/push_bytes)

    def compute_logprobs(self, batch):
        self.events.append("compute_logprobs")
        return torch.full(batch.labels.shape, -1.0), torch.ones(batch.labels.shape)

    def update(self, batch):
        self.events.append("update")
        return {"loss": 0.5}

    def iter_weight_buckets(self, bucket_bytes, dtype=None):
        for i in range(3):
            self.events.append(("gather", dtype))
            yield {f"w{i}": torch.zeros(4, dtype=dtype or torch.float32)}


class RecordingEngine:
    weight_dtype = ENGINE_DTYPE
    capabilities = Capabilities(sleep=True)

    def __init__(self, events):
        self.events = events

    def sleep(self):
        self.events.append("sleep")

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags)))

    def load_weight_buckets(self, buckets):
        for bucket in buckets:
            self.events.append(("load", *[t.dtype for t in bucket.values()]))


class Examples:
    def next_batch(self):
        return [Example(index=i, question=f"q{i}", prompt_messages=None, ground_truth=["a"], data_source="t")
                for i in range(2)]


class Tokenizer:
    pad_token_id = 0

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class Logger:
    def dump_samples(self, step, rows):
        pass


def _stats() -> RolloutStats:
    return RolloutStats(m=[1, 1], h_root=[None, None], h_tool=[None, None], branches=0, branch_decisions=0,
                        branch_budget_blocked=0, mean_branch_probability=None, tool_calls_executed=0, tool_errors=0,
                        malformed_calls=0, finish_reasons={"eos": 4}, kinds={"global": 4}, tokens_generated=20,
                        tool_tokens=0, rounds=1, fresh_global_samples=0, discarded_probes=0, discarded_speculative=0,
                        discarded_tokens=0, waited_decisions=0)


class FixedRollout:
    """Four trajectories (2 prompts x 2) whatever the prompts."""

    def run_step(self, prompts, step):
        assert len(prompts) == 2
        trajectories = [make_traj([5, 6, 7], [("model", [8 + i, 9, 10 + k], [-1.0, -2.0, -0.5])], i, k)
                        for i in range(2) for k in range(2)]
        return RolloutResult(trajectories, _stats())


def _score(self, trajectories, examples):
    return [(t, r, c, a) for t, r, c, a in zip(trajectories, [1.0, 0.0, 0.0, 1.0], [True, False, False, True],
                                                 ["a", None, None, "a"])]


def _trainer(events, monkeypatch, sleeps=True) -> Trainer:
    trainer = Trainer.__new__(Trainer)  # the parts a step needs, without building a model
    trainer.cfg = TrainConfig()
    trainer.policy = RecordingPolicy(events)
    trainer.source = SynchronousSource(RecordingEngine(events), FixedRollout(), Examples(), engine_layout(1, 0, 1, 0, 1),
                                       encode=lambda example: [1, 2], weights=trainer.policy, bucket_bytes=1 << 20,
                                       sleeps=sleeps)
    trainer.tokenizer, trainer.logger = Tokenizer(), Logger()
    trainer.correction = trainer.cfg.rollout_correction.resolved(stale_tokens=trainer.cfg.train.stale_tokens)
    monkeypatch.setattr(Trainer, "score", _score)
    # The retokenization-drift metric renders the chat template of a real tokenizer (none here);
    # it records that it saw the step's prompts, which is all this test needs of it.
    monkeypatch.setattr("aepo_engine.train.drift_metrics",
                        lambda trajs, chats, fmt: events.append(("drift", len(trajs), len(chats))) or {})
    trainer.tool_format = None
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    return trainer


def test_the_step_empties_the_cache_before_each_wake_up_and_gathers_in_the_engine_dtype(monkeypatch):
    events: list = []
    metrics = _trainer(events, monkeypatch).step(0)
    gathered_and_loaded = [("gather", ENGINE_DTYPE), ("load", ENGINE_DTYPE)] * 3
    assert events.count(("drift", 4, 2)) == 1  # the step's metrics saw its 4 trajectories and 2 chats
    assert [e for e in events if e[0] != "drift"] == [
        "sleep", "empty_cache", "compute_logprobs", "update",
        "empty_cache", ("wake_up", ("weights",)), *gathered_and_loaded,
        "empty_cache", ("wake_up", ("kv_cache",))]
    assert metrics["loss/loss"] == 0.5 and metrics["engine/push_bytes"] == 0
    assert metrics["time/step_s"] >= metrics["time/weight_push_s"] > 0


def test_an_engine_that_does_not_sleep_is_not_woken(monkeypatch):
    events: list = []
    _trainer(events, monkeypatch, sleeps=False).step(0)
    assert [e for e in events if e[0] != "drift"] == [
        "compute_logprobs", "update", *[("gather", ENGINE_DTYPE), ("load", ENGINE_DTYPE)] * 3]
