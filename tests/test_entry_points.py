"""Every command answers bad input and unavailable parts with one ``error:`` line and exit status 2,
no traceback (``--debug`` / ``AEPO_DEBUG=1`` show it): :mod:`aepo_engine.errors`.

Each command gets a list of bad inputs, run as real subprocesses (``python -m ...``) a few at a
time; each fails within seconds (before any model work). The commands that import torch and
transformers at start (train, eval, compare) take a few seconds per case, so their lists are in
the ``slow`` tier.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aepo_engine.errors import ArgumentParser, Unavailable, entry_point

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if k != "AEPO_DEBUG"}
    env = {**inherited, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _check_all(module: str, cases: list[tuple[list[str], str]], cwd: Path) -> None:
    """Each case: (arguments, text the error line must contain). Status 2, one ``error:`` line
    first on stderr, no traceback."""
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda case: _run(module, case[0], cwd), cases))
    failures = []
    for (args, expected), proc in zip(cases, results):
        error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        ok = (proc.returncode == 2 and "Traceback" not in proc.stderr and len(error_lines) == 1
              and expected in error_lines[0])
        if not ok:
            failures.append(f"{module} {' '.join(args)}: rc={proc.returncode}\n{proc.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from aepo_engine.models import build_tiny_qwen3

    folder = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_qwen3(folder, seed=0)
    return folder


@pytest.mark.slow
def test_train_bad_inputs(tmp_path):
    cases = [
        (["--no_such_section.key=1"], "unknown key 'no_such_section'"),
        (["--rollout.k=abc"], "--rollout.k=abc"),
        (["--rollout.k=0"], "rollout"),
        (["--config", str(tmp_path / "missing.toml")], "config file not found"),
        (["--preset", "no_such_preset"], "unknown preset 'no_such_preset'"),
        (["--preset"], "--preset"),
        (["--data.overlong_prompts=maybe"], "overlong_prompts"),
    ]
    _check_all("aepo_engine.train", cases, tmp_path)


@pytest.mark.slow
def test_train_reports_a_tool_that_cannot_start_as_that(tmp_path):
    # The embedded default builds its task, then its tools: a sandbox that cannot start is said
    # to be that (with the way out), not a task-data error and not a traceback.
    no_bwrap = _run("aepo_engine.train", [f"--run_dir={tmp_path / 'a'}",
                                          f"--tools.python.bwrap_path={tmp_path / 'no-bwrap'}"], tmp_path)
    assert no_bwrap.returncode == 2 and "Traceback" not in no_bwrap.stderr, no_bwrap.stderr[-2000:]
    assert "error: the python tool cannot isolate generated code: bubblewrap not found" in no_bwrap.stderr
    # A tool that is built but fails on its first call (an interpreter that does not exist):
    # reported as the tool failing while writing the demonstrations, with its own message.
    broken = _run("aepo_engine.train", [f"--run_dir={tmp_path / 'b'}", "--tools.python.isolation=none",
                                        f"--tools.python.python_executable={tmp_path / 'no-python'}"], tmp_path)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr, broken.stderr[-2000:]
    (line,) = [line for line in broken.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: the python tool failed while writing the warm-start demonstrations")
    assert str(tmp_path / "no-python") in line and "neither the question nor the tool results" not in line


@pytest.mark.slow
def test_eval_bad_inputs(tmp_path, tiny_model):
    cases = [
        ([], "no --model given and no embedded-default run"),
        (["--model", str(tmp_path / "missing")], "expected a Hugging Face model folder"),
        (["--model", str(tiny_model), "--data", "no_such_benchmark"], "no_such_benchmark"),
        (["--model", str(tiny_model), "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["--pass-k", "0"], "every pass_k must be >= 1"),
        (["--pass-k", "x"], "--eval.pass_k=x"),
        (["--backend.kind=bogus"], "expected one of 'hf', 'vllm'"),
        (["--no_such_option", "1"], "unknown key 'no_such_option'"),
    ]
    _check_all("aepo_engine.eval", cases, tmp_path)


@pytest.mark.slow
def test_compare_bad_inputs(tmp_path):
    cases = [
        (["--algorithms", "no_such_algorithm", "--plan"], "unknown algorithm(s) no_such_algorithm"),
        (["--jobs", "0"], "--jobs and --threads must be >= 1"),
        (["--preset", "grpo"], "the grid sets presets"),
        (["--seeds", "x"], "argument --seeds"),
        (["--train.no_such_key=1", "--plan"], "unknown key 'train.no_such_key'"),
        (["--summarize-only", "--out", str(tmp_path / "missing")], "grid.json not found"),
    ]
    _check_all("aepo_engine.experiments.compare", cases, tmp_path)


def test_trees_bad_inputs(tmp_path):
    (tmp_path / "run" / "logs" / "samples").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "samples" / "step_000000.jsonl").write_text('{"old": "row"}\n')
    cases = [
        ([], "the following arguments are required: run_dir"),
        ([str(tmp_path / "missing")], "no run folder at"),
        ([str(tmp_path)], "no sample dumps"),
        ([str(tmp_path / "run"), "--step", "x"], "argument --step"),
        ([str(tmp_path / "run"), "--step", "7"], "no dump for step 7"),
        ([str(tmp_path / "run"), "--prompts", "a,b"], "expected comma-separated integers"),
        ([str(tmp_path / "run")], "step_000000.jsonl"),
    ]
    _check_all("aepo_engine.experiments.trees", cases, tmp_path)


def test_retrieval_server_bad_inputs(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"id": "1", "contents": "ok"}\n{"id": 2\n')
    cases = [
        ([], "the following arguments are required: --corpus"),
        (["--corpus", str(tmp_path / "missing.jsonl")], "missing.jsonl: No such file or directory"),
        (["--corpus", str(tmp_path)], "Is a directory"),
        (["--corpus", str(tmp_path / "empty.jsonl")], "holds no documents"),
        (["--corpus", str(tmp_path / "bad.jsonl")], "bad.jsonl:2"),
        (["--corpus", str(tmp_path / "bad.jsonl"), "--port", "70000"], "is not a TCP port"),
        (["--corpus", str(tmp_path / "bad.jsonl"), "--topk", "0"], "is not a hit count"),
    ]
    _check_all("aepo_engine.tools.retrieval_server", cases, tmp_path)


def test_retrieval_server_address_in_use(tmp_path):
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"id": "1", "contents": "a fact"}) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    first = subprocess.Popen([sys.executable, "-m", "aepo_engine.tools.retrieval_server", "--corpus",
                              str(tmp_path / "corpus.jsonl"), "--port", "0"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + first.stderr.read()
        port = line.split(":")[2].split()[0]
        second = _run("aepo_engine.tools.retrieval_server", ["--corpus", str(tmp_path / "corpus.jsonl"),
                                                              "--port", port], tmp_path)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert second.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_debug_shows_the_traceback(tmp_path):
    for extra_args, env in ((["--debug"], {}), ([], {"AEPO_DEBUG": "1"})):
        proc = _run("aepo_engine.experiments.trees", [str(tmp_path / "missing"), *extra_args], tmp_path, env=env)
        assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr, proc.stderr
        assert "FileNotFoundError: no run folder at" in proc.stderr


def test_the_helper_tells_bugs_from_bad_input(capsys):
    # In process: the decorator's three outcomes (what each command above relies on).
    @entry_point
    def command(argv: list[str]) -> int:
        parser = ArgumentParser(prog="cmd")
        parser.add_argument("--what", required=True)
        what = parser.parse_args(argv).what
        if what == "bad":
            raise ValueError("--what bad: use good")
        if what == "missing":
            raise Unavailable("the thing is not installed: pip install thing")
        if what == "bug":
            raise ZeroDivisionError("division by zero")
        return 0

    assert command(["--what", "good"]) == 0
    for argv, status, expected in ((["--what", "bad"], 2, "error: --what bad: use good\n"),
                                   (["--what", "missing"], 2, "error: the thing is not installed: pip install thing\n"),
                                   ([], 2, "error: the following arguments are required: --what (see cmd -h)\n")):
        with pytest.raises(SystemExit) as info:
            command(argv)
        assert info.value.code == status and capsys.readouterr().err == expected
    with pytest.raises(SystemExit) as info:
        command(["--what", "bug"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: internal error (ZeroDivisionError: division by zero)")
    assert "--debug" in err and err.count("\n") == 1
    with pytest.raises(ZeroDivisionError):  # --debug lets it through
        command(["--what", "bug", "--debug"])
