"""The OpenAI-compatible gateway (issue 53): the real ``openai`` client against the real server,
over the HF backend on a tiny model, and over a scripted model where a test needs known output
(a tool call the tiny random model would not write). What is checked: the responses (plain,
streamed, tool calls), the token-exact recording (the same ids as the engine's own
chat-template tool loop), drift, the OpenAI-style errors, agents that crash, hang or post their
reward, concurrency, and a training run through the gateway."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from aepo_engine.gateway.agents import load_agent, run_episodes  # noqa: E402
from aepo_engine.gateway.server import Gateway  # noqa: E402
from aepo_engine.rollout.protocol import Capabilities, GenOutput  # noqa: E402
from aepo_engine.tools.formats import ChatTemplateFormat, retokenization_drift, tool_schemas  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOOLS = tool_schemas(["search", "python"])  # the engine's own schemas (the example agent's)
MESSAGES = [{"role": "system", "content": "Use the search and python tools."},
            {"role": "user", "content": "What is the age of Zovo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from aepo_engine.models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("gateway") / "model", seed=0)


@pytest.fixture(scope="module")
def hf_gateway(model_dir):
    from aepo_engine.rollout.backends.hf import HFBackend

    backend = HFBackend(model_dir, prefix_cache_gib=0)
    gateway = Gateway(backend, backend.tokenizer, max_tokens=12, max_context_tokens=3000, seed=1)
    yield gateway
    gateway.close()


class ScriptedModel:
    """A backend that writes given texts, one per call in order (token-in/token-out through the
    real tokenizer; log-prob -0.5 and entropy 1.0 per token), ending each with the end-of-turn
    token unless the text ends a tool call (a stop string)."""

    capabilities = Capabilities()
    weight_dtype = None

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, list(texts), []
        self.eos_token_ids = (tokenizer.eos_token_id,)

    def generate(self, requests):
        outputs = []
        for request in requests:
            self.calls.append(request)
            text = self.texts.pop(0)
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            stop = next((s for s in request.stop_strings if text.endswith(s)), None)
            if stop is None:
                ids.append(self.tokenizer.eos_token_id)
            outputs.append(GenOutput(ids, [-0.5] * len(ids), [1.0] * len(ids), "stop" if stop else "eos", stop, text))
        return outputs


def _client(gateway, session, **kwargs):
    return openai.OpenAI(base_url=gateway.base_url(session), api_key=gateway.token, max_retries=0, **kwargs)


def test_plain_and_streamed_completions_and_the_models_list(hf_gateway):
    session = hf_gateway.open_session()
    client = _client(hf_gateway, session)
    reply = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and reply.usage.completion_tokens <= 12
    assert reply.usage.prompt_tokens == len(session.trajectory.prompt_ids)
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    chunks = list(client.chat.completions.create(model="policy", messages=history, tools=TOOLS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length", "tool_calls")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == ["policy"]
    hf_gateway.close_session(session)
    traj = session.trajectory
    assert [s.kind for s in traj.segments] == ["model", "tool", "model"] and not session.drifted
    assert traj.logprobs[0] < 0 and traj.versions[0] == hf_gateway.version and sum(traj.loss_mask) == \
        reply.usage.completion_tokens + chunks[-1].usage.completion_tokens


def test_errors_are_openai_style_with_a_reason(hf_gateway):
    session = hf_gateway.open_session()
    client = _client(hf_gateway, session)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=hf_gateway.base_url(session), api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="policy", messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        client.chat.completions.create(model="policy", messages=MESSAGES, tools=[{"type": "function"}])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 4000}])
    assert err.value.body["code"] == "context_length_exceeded"
    other = hf_gateway.open_session()
    hf_gateway.close_session(other)
    with pytest.raises(openai.NotFoundError, match="no session"):
        _client(hf_gateway, other).chat.completions.create(model="policy", messages=MESSAGES)
    # the gateway refuses and goes on: the same session still serves
    assert _client(hf_gateway, session).chat.completions.create(model="policy", messages=MESSAGES).choices
    hf_gateway.close_session(session)


def test_a_tool_call_is_recorded_as_the_engines_own_chat_template_loop_records_it(model_dir):
    """A scripted model writes a Hermes call, the agent answers it, the model answers: the
    recording's prompt is ``ChatTemplateFormat.encode_prompt``'s, the tool turn its
    ``result_ids``, the sampled ids are kept as sampled, and re-rendering the conversation with
    the chat template gives the same ids (retokenization drift 0)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "Zovo age"}}\n</tool_call>'
    model = ScriptedModel(tokenizer, [call, "<answer> \\boxed{53} </answer>"])
    gateway = Gateway(model, tokenizer, max_tokens=64)
    try:
        session = gateway.open_session()
        client = _client(gateway, session)
        first = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.tool_calls[0].function.name == "search"
        assert json.loads(message.tool_calls[0].function.arguments) == {"query": "Zovo age"}
        history = [*MESSAGES, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Page 1: Zovo age 53."}]
        second = client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
        assert second.choices[0].message.content == "<answer> \\boxed{53} </answer>"
        assert model.calls[0].stop_strings == ("</tool_call>",)
        gateway.close_session(session)
    finally:
        gateway.close()
    fmt = ChatTemplateFormat(tokenizer, ["search", "python"])
    traj = session.trajectory
    call_ids = tokenizer.encode(call, add_special_tokens=False)
    assert traj.prompt_ids == fmt.encode_prompt(MESSAGES)
    assert traj.response_ids[:len(call_ids)] == call_ids
    tool_ids = fmt.result_ids("Page 1: Zovo age 53.")
    assert traj.response_ids[len(call_ids):len(call_ids) + len(tool_ids)] == tool_ids
    assert [s.kind for s in traj.segments] == ["model", "tool", "model"] and traj.finish_reason == "eos"
    assert traj.tool_log[0].tool == "search" and traj.tool_log[0].payload == "Zovo age"
    assert retokenization_drift(traj, MESSAGES, fmt) == 0
    assert traj.loss_mask == [1] * len(call_ids) + [0] * len(tool_ids) + [1] * (len(traj.loss_mask) - len(call_ids)
                                                                                - len(tool_ids))


def test_an_agent_that_rewrites_its_history_drifts_and_is_counted(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = ScriptedModel(tokenizer, ["I think 41.", "Then 53."])
    gateway = Gateway(model, tokenizer, max_tokens=64)
    try:
        session = gateway.open_session()
        client = _client(gateway, session)
        client.chat.completions.create(model="policy", messages=MESSAGES)
        edited = [*MESSAGES, {"role": "assistant", "content": "I think 42."}, {"role": "user", "content": "Sure?"}]
        assert client.chat.completions.create(model="policy", messages=edited).choices[0].message.content == "Then 53."
        # the edited conversation was served from its own rendering, not the recording
        assert list(model.calls[1].prompt_ids) == ChatTemplateFormat(tokenizer, []).tokenizer.encode(
            tokenizer.apply_chat_template(edited, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        gateway.close_session(session)
    finally:
        gateway.close()
    assert session.drifted and session.drift_tokens > 0
    assert [s.kind for s in session.trajectory.segments] == ["model"]  # nothing recorded after the drift


def _write_agents(tmp_path: Path) -> Path:
    path = tmp_path / "agents.py"
    path.write_text('''
import asyncio, httpx

async def answers(task, client):
    reply = await client.chat.completions.create(model="policy", messages=task["messages"])
    return {"reward": 1.0, "correct": True}

async def posts(task, client):
    await client.chat.completions.create(model="policy", messages=task["messages"])
    base = str(client.base_url).rstrip("/")[: -len("/v1")]
    async with httpx.AsyncClient() as http:
        response = await http.post(base + "/reward", json={"reward": 0.25},
                                   headers={"Authorization": "Bearer " + client.api_key})
        response.raise_for_status()

async def crashes(task, client):
    raise RuntimeError("the agent's own bug")

async def hangs(task, client):
    await asyncio.sleep(60)

async def no_reward(task, client):
    return None

def not_async(task, client):
    return 1.0
''')
    return path


def test_agents_that_crash_hang_or_give_no_reward_end_their_episode_not_the_run(hf_gateway, tmp_path):
    path = _write_agents(tmp_path)
    task = {"messages": MESSAGES}
    results = {}
    for name in ("answers", "posts", "crashes", "hangs", "no_reward"):
        (episode,) = run_episodes(hf_gateway, load_agent(f"{path}:{name}"), [(task, {})], timeout_s=3)
        results[name] = episode
    assert results["answers"].reward == 1.0 and results["answers"].correct is True and results["answers"].error is None
    assert results["posts"].reward == 0.25 and results["posts"].error is None
    assert "the agent's own bug" in results["crashes"].error and results["crashes"].reward is None
    assert "agent.timeout_s" in results["hangs"].error and results["hangs"].seconds < 10
    assert "no reward" in results["no_reward"].error
    with pytest.raises(ValueError, match="async def"):
        load_agent(f"{path}:not_async")
    with pytest.raises(ValueError, match="has no"):
        load_agent(f"{path}:missing")
    with pytest.raises(ValueError, match="module:function"):
        load_agent("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent("no_such_module_here:run")


def test_concurrent_sessions_are_batched_and_none_fails(hf_gateway):
    """64 episodes at once, each two requests: every one answered, batched into few generate calls."""
    async def episode(i):
        session = hf_gateway.open_session(traj_id=i)
        client = openai.AsyncOpenAI(base_url=hf_gateway.base_url(session), api_key=hf_gateway.token, max_retries=0)
        try:
            first = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
            history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "user", "content": f"question {i}"}]
            await client.chat.completions.create(model="policy", messages=history, max_tokens=4)
        finally:
            await client.close()
        return hf_gateway.close_session(session)

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(64)))

    batches = hf_gateway.stats.batches
    sessions = asyncio.run(main())
    assert all(len(s.trajectory.segments) == 3 and not s.drifted for s in sessions)
    assert hf_gateway.stats.batches - batches < 64  # batched: fewer calls than the 128 requests


def test_a_second_request_while_the_first_runs_is_refused(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    release = threading.Event()

    class Slow(ScriptedModel):
        def generate(self, requests):
            release.wait(30)
            return super().generate(requests)

    gateway = Gateway(Slow(tokenizer, ["a", "b"]), tokenizer, max_tokens=8)
    try:
        session = gateway.open_session()
        client = _client(gateway, session)
        first = threading.Thread(target=lambda: client.chat.completions.create(model="policy", messages=MESSAGES))
        first.start()
        deadline = time.monotonic() + 30
        while session.requests == 0 and time.monotonic() < deadline:  # the first request is in
            time.sleep(0.01)
        assert session.requests == 1
        with pytest.raises(openai.ConflictError, match="still running"):
            client.chat.completions.create(model="policy", messages=MESSAGES)
        release.set()
        first.join(30)
    finally:
        release.set()
        gateway.close()


@pytest.mark.slow
def test_a_training_run_through_the_gateway_with_the_example_agent(tmp_path):
    """The tiny preset in the chat template's format with examples/search_agent.py as the agent,
    one global episode per prompt and one slot for a branch: the run ends, its steps count the
    agent's episodes (k = 2 per prompt, global or branched or fresh) and its evaluations are the
    agent's."""
    from runs import train

    run_dir = tmp_path / "run"
    proc = train(run_dir, "--tools.format=chat_template", f"--agent.function={REPO}/examples/search_agent.py:run",
                 "--agent.global_samples=1", "--checkpoint.every_n_steps=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_after"]["questions"] == 2
    assert "failed_share" in summary["eval_before"]
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["agent/episodes"] == 4 and row["agent/failed_episodes"] == 0 for row in rows)
    assert all(row["agent/branches"] + row["agent/fresh_global_samples"] == 2 for row in rows)
    assert "[eval before RL] agent:" in proc.stdout


def test_the_agent_config_refuses_what_it_cannot_run():
    from aepo_engine.config import config_problems, load_train_config

    cfg = load_train_config(["--agent.function=x.py:run", "--train.mode=async"])
    assert any("synchronous training" in p for p in config_problems(cfg))
    with pytest.raises(Exception, match="timeout_s"):
        load_train_config(["--agent.timeout_s=0"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


class ContextModel(ScriptedModel):
    """Writes a search call to a prompt without a tool turn yet, an answer after one."""

    def __init__(self, tokenizer, call, answer, tool_marker):
        super().__init__(tokenizer, [])
        self.call, self.answer, self.tool_marker = call, answer, tool_marker

    def generate(self, requests):
        self.texts = [self.answer if self.tool_marker in self.tokenizer.decode(list(r.prompt_ids)) else self.call
                      for r in requests]
        return super().generate(requests)


def _branching_rollout(model_dir, tmp_path, agent_name, alpha, k=4, m=2):
    from transformers import AutoTokenizer

    from aepo_engine.gateway.config import AgentConfig
    from aepo_engine.gateway.rollout import AgentRollout
    from aepo_engine.rollout.config import RolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "Zovo age"}}\n</tool_call>'
    model = ContextModel(tokenizer, call, "<answer> \\boxed{53} </answer>", "TOOLRESULT")
    gateway = Gateway(model, tokenizer, max_tokens=64)
    path = tmp_path / "branch_agents.py"
    path.write_text('''
import itertools, json
counter = itertools.count()

async def _episode(task, client, result):
    messages = list(task["messages"])
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=task["tools"])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"reward": 1.0, "correct": True}
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result()})
    return 0.0

async def deterministic(task, client):
    return await _episode(task, client, lambda: "TOOLRESULT Page 1: Zovo age 53.")

async def flaky(task, client):  # a tool whose answer changes from call to call
    return await _episode(task, client, lambda: f"TOOLRESULT Page 1: Zovo age {next(counter)}.")
''')
    rollout_cfg = RolloutConfig(k=k, branch_alpha_mode="constant", branch_alpha=alpha, seed=3)
    config = AgentConfig(function=f"{path}:{agent_name}", global_samples=m)
    rollout = AgentRollout(gateway, load_agent(config.function), config, rollout_cfg,
                           lambda example: {"messages": MESSAGES, "tools": TOOLS})
    return rollout, gateway


def test_branching_forks_an_agent_after_a_tool_result_and_replays_its_prefix(model_dir, tmp_path):
    """alpha 0.6 > tau 0.5 (equal entropies): both global episodes branch after their tool
    result; each branch's restarted agent gets the recorded call back without sampling, then
    samples its own reaction on a copy of its parent's trajectory up to the tool result."""
    rollout, gateway = _branching_rollout(model_dir, tmp_path, "deterministic", alpha=0.6)
    try:
        result = rollout.run_step([object()], step=0)
    finally:
        gateway.close()
    trajs = result.trajectories
    assert [t.traj_id for t in trajs] == [0, 1, 2, 3]
    assert [t.kind for t in trajs] == ["global", "global", "branch", "branch"]
    assert sorted(t.parent_id for t in trajs[2:]) == [0, 1]
    for child in trajs[2:]:
        parent = trajs[child.parent_id]
        cut = child.branch_position
        assert child.response_ids[:cut] == parent.response_ids[:cut] and child.segments[1].kind == "tool"
        assert child.prompt_ids == parent.prompt_ids and child.consecutive_branches == 1
        assert child.decisions == []  # the decision at the fork is its parent's
    assert all(t.decisions[0].branched and t.decisions[0].probability == pytest.approx(0.6) for t in trajs[:2])
    assert gateway.stats.replayed == 2 and rollout.last_counts["rollout/replay_divergence"] == 0
    assert rollout.last_counts["agent/branches"] == 2 and result.stats.m == [2]


def test_a_branch_whose_agent_diverges_from_the_recording_is_dropped_and_counted(model_dir, tmp_path):
    rollout, gateway = _branching_rollout(model_dir, tmp_path, "flaky", alpha=0.6)
    try:
        result = rollout.run_step([object()], step=0)
    finally:
        gateway.close()
    assert [t.kind for t in result.trajectories] == ["global", "global"]
    assert rollout.last_counts["rollout/replay_divergence"] == 2


def test_without_a_branch_fresh_global_episodes_fill_the_budget(model_dir, tmp_path):
    rollout, gateway = _branching_rollout(model_dir, tmp_path, "deterministic", alpha=0.1)
    try:
        result = rollout.run_step([object(), object()], step=0)
    finally:
        gateway.close()
    assert [(t.prompt_index, t.traj_id, t.kind) for t in result.trajectories] == \
        [(p, j, "global") for p in (0, 1) for j in range(4)]
    assert all(not d.branched for t in result.trajectories for d in t.decisions)
    assert rollout.last_counts["agent/fresh_global_samples"] == 4


def test_in_the_tag_format_a_call_is_recorded_as_the_engines_own_tag_loop_records_it(model_dir):
    """tools.format = "tags": the prompt is TagFormat's, the model's ``<search> q</search>`` comes
    back as a tool call with the tool's one argument, and the result is TagFormat's ``<result>``
    ids inside the same assistant turn."""
    from transformers import AutoTokenizer

    from aepo_engine.tools.formats import TagFormat

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = ScriptedModel(tokenizer, ["<think>look it up</think><search> Zovo age</search>",
                                      "<answer> \\boxed{53} </answer>"])
    gateway = Gateway(model, tokenizer, max_tokens=64, tool_format="tags")
    try:
        session = gateway.open_session()
        client = _client(gateway, session)
        first = client.chat.completions.create(model="policy", messages=MESSAGES, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content == "<think>look it up</think>"
        assert json.loads(message.tool_calls[0].function.arguments) == {"query": "Zovo age"}
        history = [*MESSAGES, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Page 1: Zovo age 53."}]
        client.chat.completions.create(model="policy", messages=history, tools=TOOLS)
        assert model.calls[0].stop_strings == ("</search>", "</python>")
        gateway.close_session(session)
    finally:
        gateway.close()
    fmt = TagFormat(tokenizer, ["search", "python"])
    traj = session.trajectory
    call_ids = tokenizer.encode("<think>look it up</think><search> Zovo age</search>", add_special_tokens=False)
    tool_ids = fmt.result_ids("Page 1: Zovo age 53.")
    assert traj.prompt_ids == fmt.encode_prompt(MESSAGES)
    assert traj.response_ids[:len(call_ids) + len(tool_ids)] == call_ids + tool_ids
    assert traj.tool_log[0].payload == "Zovo age" and traj.finish_reason == "eos"


def test_an_agent_that_is_a_program_gets_its_session_in_its_environment(hf_gateway, tmp_path):
    """agent.command: the shell runs a program per episode with OPENAI_BASE_URL / OPENAI_API_KEY /
    AEPO_MODEL / AEPO_TASK; its last printed line is the reward; a failing program or one that
    prints no reward is a failed episode."""
    from aepo_engine.gateway.agents import command_agent

    program = tmp_path / "agent_program.py"
    program.write_text('''
import json, os, sys
import openai
task = json.loads(os.environ["AEPO_TASK"])
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model=os.environ["AEPO_MODEL"], messages=task["messages"], max_tokens=3)
print("some log line")
print(json.dumps({"reward": 0.5, "correct": False}) if sys.argv[1] == "ok" else "no reward here")
''')
    task = {"messages": MESSAGES}
    done = {}
    for mode, command in (("ok", f"{sys.executable} {program} ok"), ("bad", f"{sys.executable} {program} bad"),
                          ("exits", "echo broken >&2; exit 3")):
        (done[mode],) = run_episodes(hf_gateway, command_agent(command), [(task, {})], timeout_s=60)
    assert done["ok"].reward == 0.5 and done["ok"].correct is False and done["ok"].error is None
    assert sum(done["ok"].session.trajectory.loss_mask) >= 1  # its completion was recorded
    assert "not a number or JSON" in done["bad"].error
    assert "status 3" in done["exits"].error and "broken" in done["exits"].error
    from aepo_engine.gateway.config import AgentConfig

    with pytest.raises(ValueError, match="set one"):
        AgentConfig(function="a.py:run", command="./agent")
