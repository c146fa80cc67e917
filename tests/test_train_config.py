"""The run config: one default per field, the embedded preset as the no-argument default, one
root seed, cross-section problems listed together, and --help showing what a run would get."""
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from aepo_engine.config import (
    DEFAULT_PRESET,
    TrainConfig,
    config_problems,
    load_train_config,
    preset_path,
    split_train_args,
)
from aepo_engine.config_loader import ConfigError, check_config_class, dump_config, load_config, loads_config
from aepo_engine.data import DataConfig
from aepo_engine.evaluation.config import EvalConfig
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.seeding import SEED_OFFSETS, section_seed
from aepo_engine.training.policy import PolicyConfig


def test_no_config_and_no_preset_means_the_embedded_preset():
    args = split_train_args(["--train.steps=3"])
    assert args.presets == [DEFAULT_PRESET] and args.files == [preset_path("embedded")]
    assert load_train_config(["--train.steps=3"]) == load_config(
        TrainConfig, path=[preset_path("embedded")], overrides=["--train.steps=3"])


def test_a_config_file_alone_starts_from_the_section_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npath = "/m"\n')
    cfg = load_train_config(["--config", str(path)])
    # none of the embedded preset's toy values leak into a file-configured run
    assert cfg.rollout == RolloutConfig(seed=0) and cfg.task.source == "files" and cfg.backend.kind == "vllm"
    assert cfg.tools.search.topk == 5 and cfg.rollout.max_tokens_per_segment == 6192


def test_section_classes_are_the_only_default_source():
    assert check_config_class(TrainConfig) == []
    # the top-level default is the sections' own defaults, seeds derived from root seed 0
    assert TrainConfig().rollout == RolloutConfig(seed=0) and TrainConfig().policy == PolicyConfig()


def test_override_keeps_the_presets_other_values():
    cfg = load_train_config(["--rollout.seed=1", "--task.warm_start.seed=1", "--policy.ppo_mini_batch_size=4"])
    assert cfg.rollout.seed == 1 and cfg.rollout.k == 8 and cfg.rollout.max_response_tokens == 160
    assert cfg.task.warm_start.seed == 1 and cfg.task.warm_start.steps == 1400
    assert cfg.policy.ppo_mini_batch_size == 4 and cfg.policy.param_dtype == "float32"


def test_every_sub_seed_derives_from_the_root_seed():
    # Before the root seed existed, the seed benchmark set six fields by hand; --seed N must give
    # exactly those values (the same random streams), and data.shuffle_seed the old sampler seed.
    for seed in (0, 2):
        derived = load_train_config([f"--seed={seed}"])
        by_hand = load_train_config([f"--seed={seed}", f"--model.tiny.seed={seed}", f"--task.warm_start.seed={seed}",
                                     f"--rollout.seed={seed}", f"--task.synthetic.seed={seed}",
                                     f"--eval.seed={12345 + seed}", f"--data.shuffle_seed={seed}"])
        assert derived == by_hand
    explicit = load_train_config(["--seed=3", "--rollout.seed=11"])
    assert explicit.rollout.seed == 11 and explicit.eval.seed == 12348 and explicit.model.tiny.seed == 3
    assert set(SEED_OFFSETS) == {"data.shuffle_seed", "model.tiny.seed", "task.synthetic.seed",
                                 "task.warm_start.seed", "rollout.seed", "eval.seed"}
    # a section used on its own resolves none as root seed 0 would
    assert section_seed(EvalConfig().seed, "eval.seed") == 12345 and section_seed(None, "rollout.seed") == 0
    assert section_seed(7, "eval.seed") == 7


def test_resolved_config_round_trips():
    cfg = load_train_config(["--policy.loss.clip=gppo", "--rollout.k=4", "--seed=9"])
    assert loads_config(TrainConfig, dump_config(cfg)) == cfg


def test_rollout_temperature_is_the_only_temperature_of_the_policy():
    assert "temperature" not in PolicyConfig.__struct_fields__
    with pytest.raises(ConfigError, match="unknown key 'policy.temperature'"):
        load_train_config(["--policy.temperature=0.7"])


def test_config_problems_are_all_reported():
    problems = config_problems(TrainConfig())
    assert any("model.path is required" in p for p in problems)
    assert any("data.train_files is required" in p for p in problems)
    cfg = TrainConfig(model=msgspec.convert({"path": "/m"}, type(TrainConfig().model)),
                      data=DataConfig(train_files=["a.jsonl"], max_prompt_tokens=3000),
                      eval=EvalConfig(every_n_steps=5),
                      tools=msgspec.convert({"enabled": ["search", "browser"]}, type(TrainConfig().tools)))
    problems = config_problems(cfg)
    assert len(problems) == 3, problems
    assert any("backend.max_model_len=8192" in p and "9192" in p for p in problems)
    assert any("eval.every_n_steps=5" in p for p in problems)
    assert any("'browser'" in p for p in problems)
    assert config_problems(load_train_config([])) == []


def test_served_search_needs_a_corpus_unless_the_task_brings_one():
    from aepo_engine.tasks.synthetic_setup import synthetic_tools_config

    files = load_train_config(["--config", str(preset_path("qwen3_14b_deep_research")), "--model.path=/m",
                               "--data.train_files=a.jsonl", "--tools.search.backend=served"])
    assert any("tools.search.corpus_path is required" in p for p in config_problems(files))
    served = load_train_config(["--preset", "embedded", "--preset", "web_search"])
    assert config_problems(served) == []
    tools = synthetic_tools_config(served.tools, Path("/run/setup/corpus.jsonl"))
    assert (tools.search.backend, tools.search.corpus_path) == ("served", "/run/setup/corpus.jsonl")
    assert tools.search.latency.median_s == 1.0
    plain = synthetic_tools_config(load_train_config([]).tools, Path("/c.jsonl")).search
    assert (plain.backend, plain.corpus_path) == ("corpus", "/c.jsonl")


def test_train_steps_from_epochs():
    cfg = load_train_config(["--config", str(preset_path("qwen3_14b_deep_research"))])
    assert cfg.train.steps is None and cfg.train.resolved_steps(1071) == 84  # ceil(5 * 1071 / 64)
    assert load_train_config([]).train.resolved_steps(1000) == 60  # the embedded preset sets steps


def _help(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", *args, "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_help_shows_the_defaults_a_run_gets_and_where_they_come_from():
    text = _help()
    assert "preset 'embedded'" in text and "qwen3_14b_deep_research" in text
    for flag in ("--rollout.k  int = 8\n", "--optim.lr  float = 0.0003\n", "--task.warm_start.steps  int = 1400\n",
                 "--data.max_examples  int | None = none\n", "--rollout.seed  int | None = 0\n"):
        assert flag in text, flag
    paper = _help("--preset", "qwen3_14b_deep_research")
    assert "preset 'qwen3_14b_deep_research'" in paper and "preset 'embedded'" not in paper
    for flag in ("--rollout.k  int = 12\n", "--rollout.max_tokens_per_segment  int = 6192\n",
                 "--optim.lr  float = 1e-06\n", "--train.steps  int | None = none\n"):
        assert flag in paper, flag


def test_torch_threads_sizes_torchs_pool_and_rejects_negatives():
    from aepo_engine.train import apply_torch_threads

    before = torch.get_num_threads()
    try:
        apply_torch_threads(0)  # torch's default stays
        assert torch.get_num_threads() == before
        apply_torch_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="torch_threads must be >= 0"):
        load_config(TrainConfig, overrides=["--train.torch_threads=-1"])


def test_a_shortened_warm_start_names_the_decay_to_shorten_with_it():
    # The embedded preset decays over its last 400 of 1,400 warm-start steps: 50 steps alone is an
    # inconsistent config, refused with the flag that fixes it; with that flag the run is valid.
    with pytest.raises(ConfigError, match=r"decay_steps=400 must lie in \[0, steps - warmup_steps\] = \[0, 30\]"
                                          r".*--task.warm_start.decay_steps=N"):
        load_train_config(["--task.warm_start.steps=50"])
    cfg = load_train_config(["--task.warm_start.steps=50", "--task.warm_start.decay_steps=10"])
    assert cfg.task.warm_start.decay_steps == 10 and config_problems(cfg) == []


def test_the_shortened_main_jobs_of_ci_and_gpu_check_are_valid_configs():
    # CI's newcomer step and the GPU acceptance script run the main job shrunk by flags; a preset
    # change that makes those flags an invalid config must fail here, not after CI's install.
    import shlex

    root = Path(__file__).resolve().parents[1]
    script = (root / ".ci" / "newcomer.sh").read_text().replace("\\\n", " ")
    calls = [shlex.split(call[:call.index(">")]) for call in script.split("-m aepo_engine.train")[1:]]
    calls = [[a for a in call if not a.startswith("--run_dir") and a != "--dry-run"] for call in calls]
    assert len(calls) == 3 and "--task.warm_start.steps=50" in calls[0], calls  # the main job, smollm2 x 2
    for args in calls:
        assert config_problems(load_train_config(args)) == [], args

    sys.path.insert(0, str(root / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(root / "bench"))
    for args in (gpu_check.train_vllm_args(True), gpu_check.train_vllm_args(False), gpu_check.train_async_args()):
        assert config_problems(load_train_config(args)) == []
    # 32 questions with the preset's 64 held aside: refused by the config, not after the set-up
    with pytest.raises(ConfigError, match="val_questions=64 would leave none of synthetic.num_train=32"):
        load_train_config(["--task.synthetic.num_train=32", "--task.warm_start.steps=50",
                           "--task.warm_start.decay_steps=10"])
