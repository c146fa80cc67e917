"""Evaluation records through the training rollout: a scripted policy, the real ToolRunner and the
real search tool (offline cache): each tool call's payload, result and latency, scores, seeds."""
from __future__ import annotations

import json

import pytest

from aepo_engine.data import Example
from aepo_engine.evaluation.config import EvalConfig
from aepo_engine.evaluation.core import sample_records
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.tools import ToolRunner, build_tools
from aepo_engine.tools.config import SearchConfig, ToolsConfig
from fakes import CharTokenizer, ScriptedBackend

CACHE = {"capital of france": "Page 1: Paris is the capital of France.",
         "capital of peru": "Page 1: Lima is the capital of Peru."}


def _policy(context: str, request):
    """Searches 'capital of <country>' (the prompt is the country), then answers the result's first word."""
    if "<result>" not in context:
        return f"<think>look up</think><search>capital of {context.split()[0]}</search>", 0.5, False
    found = context.rsplit("Page 1: ", 1)[1].split()[0]
    return f"<answer>\\boxed{{{found}}}</answer>", 0.5, True


@pytest.fixture
def runner(tmp_path):
    cache = tmp_path / "cache.json"
    cache.write_text(json.dumps(CACHE))
    tools = ToolsConfig(enabled=["search"], search=SearchConfig(backend="cache", cache_path=str(cache)))
    with ToolRunner(build_tools(tools), max_workers=2) as runner:
        yield runner


def test_records_carry_tool_calls_and_scores(runner):
    tok = CharTokenizer()
    examples = [Example(index=i, question=q, prompt_messages=None, ground_truth=[a], data_source="toy",
                        meta={"row": i + 1}) for i, (q, a) in enumerate([("france", "Paris"), ("peru", "Quito")])]
    prompts = [tok.encode(e.question + " ?") for e in examples]
    cfg = EvalConfig(pass_k=[2], seed=5)
    rollout = RolloutConfig(k=8, max_response_tokens=200, max_tokens_per_segment=100)
    records = sample_records(ScriptedBackend(_policy), runner, tok, rollout, cfg, prompts, examples, "qa")
    assert [(r["question_index"], r["sample"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first = records[0]
    assert first["dataset"] == "toy" and first["question"] == "france" and first["meta"] == {"row": 1}
    (call,) = first["tool_calls"]
    assert call["tool"] == "search" and call["payload"] == "capital of france" and call["ok"]
    assert call["result"] == CACHE["capital of france"] and call["latency_s"] > 0
    assert first["answer"] == "Paris" and first["correct"] and first["em"] == 1.0 and first["format_ok"]
    assert first["response"].endswith("<answer>\\boxed{Paris}</answer>") and first["finish_reason"] == "eos"
    # the tool result is in the response but not counted as model tokens
    assert first["total_tokens"] > first["response_tokens"] > 0
    assert not records[2]["correct"] and records[2]["answer"] == "Lima" and records[2]["f1"] == 0.0
    again = sample_records(ScriptedBackend(_policy), runner, tok, rollout, cfg, prompts, examples, "qa")
    assert [r["response"] for r in again] == [r["response"] for r in records]


def test_reward_decides_correct_when_given(runner):
    tok = CharTokenizer()
    example = Example(index=0, question="france", prompt_messages=None, ground_truth=["Paris"], data_source="toy")
    calls = []

    def reward(response, truth, tool_spans=None):
        calls.append(truth)
        from types import SimpleNamespace
        return SimpleNamespace(score=0.25, correct=False)

    (record,) = sample_records(ScriptedBackend(_policy), runner, tok, RolloutConfig(k=1), EvalConfig(),
                               [tok.encode("france ?")], [example], "qa", reward_fn=reward)
    assert calls == [["Paris"]] and record["reward"] == 0.25 and record["correct"] is False and record["em"] == 1.0
