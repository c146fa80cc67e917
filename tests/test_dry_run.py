"""``python -m aepo_engine.train ... --dry-run``: the resolved config on stdout, every problem on
stderr, exit 0 when clean and 2 otherwise, no weights loaded; on a real model directory, data
files with bad rows, and the reference data in ../shared when the clone has it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aepo_engine.config import TrainConfig, load_train_config
from aepo_engine.config_loader import loads_config
from aepo_engine.models import build_tiny_qwen3
from aepo_engine.train import main as train_main
from runs import child_env, run_main

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "arpo"
PAPER = ["--preset", "qwen3_14b_deep_research"]
# The paper preset on a CPU machine without vLLM/flash-attn packages concerns: HF backend (one
# device: no tensor parallelism), sdpa.
CPU = ["--backend.kind=hf", "--backend.tensor_parallel_size=1", "--policy.attn_implementation=sdpa"]


def dry_run(*args: str) -> subprocess.CompletedProcess:
    """The train command's ``--dry-run`` in this process (it loads no model: a child's interpreter
    start would be most of the time); the command-line path itself is the first test's."""
    return run_main(train_main, [*args, "--dry-run"])


def problems(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("problem: ")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_qwen3(tmp_path_factory.mktemp("dry") / "model", seed=0))


@pytest.fixture
def qa_file(tmp_path) -> Path:
    rows = [json.dumps({"question": f"What is {i}?", "answer": str(i)}) for i in range(3)]
    rows += [json.dumps({"question": "no answer"}), "{not json", json.dumps({"question": "x" * 4000, "answer": "y"})]
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.sandbox
def test_embedded_default_is_clean_and_prints_its_config(tmp_path):
    # as a user runs it: a child process, from a folder of its own
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no run folder, no task built, no weights written
    assert loads_config(TrainConfig, proc.stdout) == load_train_config([])
    assert proc.stdout.startswith("# resolved from: section defaults (real-model run) + preset 'embedded'")
    assert proc.stderr.rstrip().endswith("dry run: no problems found")


@pytest.mark.slow
def test_every_problem_is_reported_not_the_first():
    proc = dry_run(*PAPER, "--model.path=/nonexistent/model", "--data.train_files=/nonexistent/a.parquet",
                   "--tools.search.backend=cache", "--tools.search.cache_path=/nonexistent/cache.json",
                   "--reward.options.nope=1", "--checkpoint.resume=/nonexistent/step_000001")
    assert proc.returncode == 2
    found = "\n".join(problems(proc))
    for text in ("model.path '/nonexistent/model' is not a directory", "'/nonexistent/a.parquet' does not exist",
                 "tools.search.cache_path", "reward.options ['nope'] do not fit", "checkpoint.resume"):
        assert text in found, (text, found)
    loads_config(TrainConfig, proc.stdout)  # the config is printed even when it cannot run


@pytest.mark.slow
def test_missing_inputs_of_the_paper_preset():
    proc = dry_run(*PAPER)
    assert proc.returncode == 2
    found = "\n".join(problems(proc))
    assert "model.path is required" in found and "data.train_files is required" in found


@pytest.mark.sandbox
@pytest.mark.slow
def test_model_directory_and_data_rows(model_dir, qa_file, tmp_path):
    proc = dry_run(*PAPER, *CPU, f"--model.path={model_dir}", f"--data.train_files={qa_file}",
                   "--train.prompts_per_step=2", "--tools.search.backend=corpus",
                   f"--tools.search.corpus_path={tmp_path / 'none.jsonl'}", "--data.max_prompt_tokens=200")
    assert "Qwen3ForCausalLM" in proc.stderr
    note = next(line for line in proc.stderr.splitlines() if line.startswith(f"note: train: {qa_file}"))
    # 4 parse (one is over-long), 2 bad rows (a missing answer, a broken JSON line)
    assert "4 rows, 2 bad (rows 4, 5;" in note and "1 prompts over data.max_prompt_tokens=200" in note
    assert "note: train: 10 RL steps of 2 prompts" in proc.stderr  # ceil(5 epochs * 4 / 2)
    assert problems(proc) == [f"problem: tools.search.corpus_path '{tmp_path / 'none.jsonl'}' does not exist"]
    assert proc.returncode == 2

    strict = dry_run(*PAPER, *CPU, f"--model.path={model_dir}", f"--data.train_files={qa_file}",
                     "--tools.search.backend=corpus", f"--tools.search.corpus_path={qa_file}",
                     "--data.bad_rows=error", "--data.max_prompt_tokens=200", "--data.overlong_prompts=error")
    found = "\n".join(problems(strict))
    assert "has 2 bad rows and data.bad_rows='error'" in found
    assert "1 prompts over data.max_prompt_tokens and data.overlong_prompts='error'" in found
    assert "expected JSONL rows with 'contents'" in found  # a QA file is no search corpus


@pytest.mark.slow
def test_model_directory_without_tokenizer_or_weights(model_dir, qa_file, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    proc = dry_run(*PAPER, *CPU, f"--model.path={bare}", f"--data.train_files={qa_file}")
    found = "\n".join(problems(proc))
    assert "has no tokenizer" in found and "has no weights" in found and proc.returncode == 2


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.skipif(not SHARED.is_dir(), reason="no ../shared/data/arpo in this clone (reference data)")
def test_paper_run_on_the_reference_data(model_dir):
    """The paper's run as a user would launch it, with the search cache standing in for the
    retrieval server: clean, 1,071 prompts, 84 steps."""
    proc = dry_run(*PAPER, *CPU, f"--model.path={model_dir}",
                   f"--data.train_files={SHARED / 'rl_datasets' / 'hard_search_1k.parquet'}",
                   f"--data.eval_files={SHARED / 'rl_datasets' / 'gaia_test.parquet'}",
                   "--tools.search.backend=cache", f"--tools.search.cache_path={SHARED / 'search_cache.json'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hard_search_1k.parquet: 1071 rows\n" in proc.stderr
    assert "gaia_test.parquet: 103 rows" in proc.stderr
    assert "note: train: 84 RL steps of 64 prompts x 12 trajectories" in proc.stderr
    assert "search_cache.json with 1000 queries" in proc.stderr


@pytest.mark.slow
@pytest.mark.sandbox
def test_eval_files_are_resolved_and_read():
    if not SHARED.is_dir():
        pytest.skip(f"public benchmark data not found at {SHARED}")
    proc = dry_run("--eval.files=bamboogle,gaiaa", f"--eval.data_root={SHARED / 'eval'}")
    assert proc.returncode == 2
    assert "eval: bamboogle: 125 questions" in proc.stderr + proc.stdout
    (problem,) = problems(proc)
    assert "eval.files: unknown benchmark or missing file 'gaiaa'; known benchmarks: gaia" in problem


def test_it_prints_the_disk_each_checkpoint_takes(tmp_path):
    """Qwen3-14B as published (bf16): 165 GiB of training state per checkpoint, one 27.5 GiB bf16
    HF export at the end (not a 59 GB fp32 one with every checkpoint)."""
    from test_memory_plan import QWEN3_14B

    model = tmp_path / "qwen3-14b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN3_14B, "dtype": "bfloat16"}))
    proc = dry_run(*PAPER, *CPU, f"--model.path={model}", f"--run_dir={tmp_path / 'run'}")
    line = next(line for line in proc.stderr.splitlines() if line.startswith("note: checkpoint disk:"))
    assert ("165.0 GiB of training state per checkpoint" in line and "HF export 27.5 GiB (bfloat16) at the end" in line
            and "up to 687.7 GiB with keep_last 3" in line), line
    every = dry_run(*PAPER, *CPU, f"--model.path={model}", "--checkpoint.hf_export_every=10")
    assert "HF export 27.5 GiB (bfloat16) every 10 steps and at the end" in every.stderr


def test_checkpoints_that_cannot_fit_are_a_problem(small_disk, tmp_path):
    disk = small_disk(1 << 20)  # the tiny preset's checkpoints take ~3.4 MB each
    proc = dry_run("--preset", "embedded", "--preset", "tiny", f"--run_dir={tmp_path / 'run'}",
                   f"--checkpoint.dir={disk / 'ckpt'}")
    assert proc.returncode == 2
    assert any(p.startswith(f"problem: the checkpoints need up to ") and str(disk / "ckpt") in p
               and "checkpoint.keep_last" in p for p in problems(proc)), proc.stderr[-2000:]
    fits = dry_run("--preset", "embedded", "--preset", "tiny", f"--run_dir={tmp_path / 'run'}")
    assert not [p for p in problems(fits) if "checkpoints need" in p]


def test_a_damaged_resume_checkpoint_is_a_problem(tmp_path):
    from aepo_engine.checkpoint import CheckpointManager

    import torch

    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    for step in (1, 2):
        manager.save(step, torch.nn.Linear(30, 40), export_hf=False)
    data = tmp_path / "run" / "checkpoints" / "step_000002" / "train_state" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    tiny = ["--preset", "embedded", "--preset", "tiny", f"--run_dir={tmp_path / 'run'}"]
    proc = dry_run(*tiny)
    assert "warning: checkpoint" in proc.stderr and "step_000002 is damaged (train_state/__0_0.distcp has 100 bytes" in proc.stderr
    assert f"note: resume: from {tmp_path / 'run' / 'checkpoints' / 'step_000001'}" in proc.stderr
    named = dry_run(*tiny, f"--checkpoint.resume={data.parent.parent}")
    assert named.returncode == 2 and any("step_000002' is damaged: train_state/__0_0.distcp" in p for p in problems(named))


def test_a_gguf_file_that_cannot_be_read_is_one_problem(tmp_path, monkeypatch):
    """Issue 50: without accelerate (the [real] extra had only gguf) the dry run said so, then that
    model.path 'package:...' is not a directory. One problem now, naming what to install."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # gguf present or not (a newcomer's [cpu,dev] venv)
                        lambda name, *a: None if name in ("gguf", "accelerate") else real_find_spec(name, *a))
    monkeypatch.setenv("AEPO_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    found = problems(dry_run("--preset", "smollm2", f"--model.path={gguf}"))
    assert len(found) == 1, found
    assert "needs gguf and accelerate: pip install -e '.[real]'" in found[0] and "not a directory" not in found[0]


def _base_model(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with a tokenizer that has no chat template (a base model)."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out)
    for name in ("chat_template.jinja", "chat_template.json"):
        (out / name).unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template is None
    return out


def test_a_base_model_runs_in_the_tag_format_and_the_chat_template_format_refuses_it(model_dir, tmp_path):
    """Issue 50: a base model's tokenizer has no chat template; the dry run said "no problems
    found" and the run stopped after the set-up. The tag format writes the plain layout (a note);
    tools.format = 'chat_template' is a problem naming the alternative."""
    base = _base_model(model_dir, tmp_path / "base")
    tags = dry_run("--preset", "smollm2", f"--model.path={base}")
    assert problems(tags) == [] and "note: model: no chat template (a base model)" in tags.stderr, tags.stderr[-2000:]
    refused = problems(dry_run("--preset", "smollm2", f"--model.path={base}", "--tools.format=chat_template"))
    assert len(refused) == 1 and "needs a tokenizer with a chat template" in refused[0], refused
    assert "use tools.format = 'tags'" in refused[0]


@pytest.mark.sandbox
def test_prompt_lengths_are_measured_in_the_runs_tool_format(model_dir, qa_file, tmp_path):
    """The dry run counted prompts with the bare chat template while the trainer measures them in
    tools.format: under "chat_template" the tool list (here ~370 tokens) went uncounted, so a
    limit every prompt exceeds was reported as met."""
    common = [*PAPER, *CPU, f"--model.path={model_dir}", f"--data.train_files={qa_file}",
              "--tools.search.backend=corpus", f"--tools.search.corpus_path={qa_file}", "--data.max_prompt_tokens=200"]

    def over(proc):
        note = next(line for line in proc.stderr.splitlines() if line.startswith(f"note: train: {qa_file}"))
        return int(note.split(" prompts over data.max_prompt_tokens")[0].rsplit(" ", 1)[-1])

    assert over(dry_run(*common, "--tools.format=tags")) == 1  # the one over-long question
    assert over(dry_run(*common, "--tools.format=chat_template")) == 4  # every prompt, with the tool list
