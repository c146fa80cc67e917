"""config_loader: files, dicts, CLI overrides with coercion, unknown keys, cross-field errors, dump/help."""
from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

import msgspec
import pytest

from aepo_engine.config_loader import (
    ConfigError,
    check_config_class,
    dump_config,
    field_help,
    format_help,
    load_config,
    loads_config,
    merge_trees,
    parse_args,
)
from aepo_engine.checkpoint import CheckpointConfig
from aepo_engine.data import DataConfig
from aepo_engine.metrics import LoggingConfig
from aepo_engine.training.optim import OptimConfig


# A stand-in for a section owned by another module, using every supported annotation.
class ToyRollout(msgspec.Struct, kw_only=True):
    """Toy rollout settings.

    Attributes:
        k: Trajectories per prompt.
        temperature: Sampling temperature.
        stop: Stop strings.
        mode: Branching base: "random" or "constant".
        max_tokens: Optional cap; none = no cap.
        tags: Free-form labels, as a table.
        enabled: Whether rollouts run.
        ratio: Either a number or "auto".
    """

    k: int = 12
    temperature: float = 1.0
    stop: list[str] = msgspec.field(default_factory=lambda: ["</search>", "</python>"])
    mode: Literal["random", "constant"] = "random"
    max_tokens: int | None = None
    tags: dict[str, int] = {}
    enabled: bool = True
    ratio: float | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.mode == "constant" and self.k < 2:
            raise ValueError("mode='constant' needs k >= 2 because a branch needs a sibling")


class Inner(msgspec.Struct, kw_only=True):
    """Nested section.

    Attributes:
        depth: How deep.
    """

    depth: int = 1


class Outer(msgspec.Struct, kw_only=True):
    """Section with a subsection.

    Attributes:
        inner: A nested section.
        name: A name with
            a help text on two lines.
    """

    inner: Inner = msgspec.field(default_factory=Inner)
    name: str = "x"


class Top(msgspec.Struct, kw_only=True):
    """Top-level test config.

    Attributes:
        seed: Global seed.
        data: Data section.
        optim: Optimizer section.
        checkpoint: Checkpoint section.
        logging: Logging section.
        rollout: Rollout section (owned elsewhere).
        outer: Nested sections.
    """

    seed: int = 0
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    rollout: ToyRollout = msgspec.field(default_factory=ToyRollout)
    outer: Outer = msgspec.field(default_factory=Outer)


# --- loading --------------------------------------------------------------------------------------

def test_defaults_match_spec():
    cfg = load_config(Top)
    assert cfg == Top()
    optim = cfg.optim
    assert (optim.lr, optim.weight_decay, optim.grad_clip, optim.schedule) == (1e-6, 0.01, 1.0, "constant")
    assert cfg.checkpoint.keep_last == 3 and cfg.checkpoint.resume == "auto"
    assert cfg.logging.jsonl and not cfg.logging.wandb and cfg.data.max_prompt_tokens == 2000


def test_toml_file_then_dict_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[optim]\nlr = 2e-6\nbetas = [0.9, 0.95]\n[outer.inner]\ndepth = 4\n')
    cfg = load_config(Top, path=path, data={"optim": {"warmup_steps": 10}}, overrides=["--seed=5"])
    assert cfg.seed == 5 and cfg.optim.lr == 2e-6 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.optim.warmup_steps == 10 and cfg.outer.inner.depth == 4


def test_several_files_merge_in_order(tmp_path):
    (tmp_path / "a.toml").write_text("[optim]\nlr = 1e-5\nwarmup_steps = 3\n")
    (tmp_path / "b.toml").write_text("[optim]\nlr = 3e-5\n")
    cfg = load_config(Top, path=[tmp_path / "a.toml", tmp_path / "b.toml"])
    assert cfg.optim.lr == 3e-5 and cfg.optim.warmup_steps == 3


def test_merge_trees_merges_tables_and_replaces_the_rest():
    """The one deep merge (files, and the eval command's run settings under its own)."""
    base = {"eval": {"pass_k": [1, 5], "judge": {"url": "http://a/v1", "model": "m"}}, "seed": 1}
    update = {"eval": {"pass_k": [2], "judge": {"url": "http://b/v1"}}, "tools": {"enabled": ["search"]}}
    merged = merge_trees(base, update)
    assert merged == {"eval": {"pass_k": [2], "judge": {"url": "http://b/v1", "model": "m"}}, "seed": 1,
                      "tools": {"enabled": ["search"]}}
    assert base["eval"]["judge"]["url"] == "http://a/v1"  # the inputs are not changed
    merged["tools"]["enabled"] = []
    assert update["tools"]["enabled"] == ["search"]  # nor shared with the result


@pytest.mark.skipif(importlib.util.find_spec("yaml") is None, reason="PyYAML not installed")
def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 5.0e-6\nrollout:\n  stop: ['</a>']\n")
    cfg = load_config(Top, path=path)
    assert cfg.optim.lr == 5e-6 and cfg.rollout.stop == ["</a>"]


def test_yaml_without_pyyaml_says_how_to_fix(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_yaml(name, *args, **kwargs):
        if name == "yaml":
            raise ImportError("no yaml")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    path = tmp_path / "run.yml"
    path.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match="PyYAML"):
        load_config(Top, path=path)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Top, path=tmp_path / "missing.toml")
    (tmp_path / "x.ini").write_text("")
    with pytest.raises(ConfigError, match="suffix"):
        load_config(Top, path=tmp_path / "x.ini")
    (tmp_path / "broken.toml").write_text("[optim\nlr = 1")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(Top, path=tmp_path / "broken.toml")


# --- overrides and coercion -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, attr, expected", [
    (["--optim.lr=3e-6"], ("optim", "lr"), 3e-6),
    (["--optim.lr", "3e-6"], ("optim", "lr"), 3e-6),
    (["--rollout.k=16"], ("rollout", "k"), 16),
    (["--logging.wandb"], ("logging", "wandb"), True),  # bare flag switches a bool on
    (["--logging.jsonl=off"], ("logging", "jsonl"), False),
    (["--rollout.enabled", "no"], ("rollout", "enabled"), False),
    (["--optim.schedule=cosine"], ("optim", "schedule"), "cosine"),
    (["--rollout.stop=</a>,</b>"], ("rollout", "stop"), ["</a>", "</b>"]),
    (['--rollout.stop=["x, y", "z"]'], ("rollout", "stop"), ["x, y", "z"]),
    (["--rollout.stop="], ("rollout", "stop"), []),
    (["--optim.betas=0.8,0.9"], ("optim", "betas"), (0.8, 0.9)),
    (["--rollout.max_tokens=512"], ("rollout", "max_tokens"), 512),
    (["--rollout.max_tokens=none"], ("rollout", "max_tokens"), None),
    (["--rollout.ratio=0.5"], ("rollout", "ratio"), 0.5),
    (["--rollout.ratio=auto"], ("rollout", "ratio"), "auto"),
    (["--rollout.tags={a = 1, b = 2}"], ("rollout", "tags"), {"a": 1, "b": 2}),
    (["--rollout.tags.c=3"], ("rollout", "tags"), {"c": 3}),
    (["--outer.inner.depth=7"], ("outer", "inner"), Inner(depth=7)),
    (["--data.max-prompt-tokens=100"], ("data", "max_prompt_tokens"), 100),
    (["--logging.run_name", "-weird-"], ("logging", "run_name"), "-weird-"),
])
def test_override_coercion(argv, attr, expected):
    cfg = load_config(Top, overrides=argv)
    assert getattr(getattr(cfg, attr[0]), attr[1]) == expected


def test_override_beats_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[optim]\nlr = 2e-6\n")
    assert load_config(Top, path=path, overrides=["--optim.lr=4e-6"]).optim.lr == 4e-6


@pytest.mark.parametrize("argv, message", [
    (["--optim.lr=fast"], "could not convert|invalid"),
    (["--rollout.k=1.5"], "invalid literal"),
    (["--logging.wandb=maybe"], "expected a bool"),
    (["--optim.schedule=cos"], "did you mean 'cosine'"),
    (["--optim"], "is a section"),
    (["--optim.lr"], "needs a value"),
    (["--seed.x=1"], "not a section"),
    (["optim.lr=1"], "unexpected argument"),
    (["--rollout.max_tokens=lots"], "fits none of"),
])
def test_bad_override_values(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Top, overrides=argv)


# --- unknown keys ---------------------------------------------------------------------------------

def test_unknown_override_key_lists_valid_keys_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(Top, overrides=["--optim.learning_rat=1"])
    text = str(err.value)
    assert "optim.learning_rat" in text and "Valid keys in [optim]: lr, weight_decay" in text
    with pytest.raises(ConfigError, match="did you mean 'optim.warmup_steps'"):
        load_config(Top, overrides=["--optim.warmup_step=1"])
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(Top, overrides=["--rollot.k=1"])


def test_unknown_file_keys_are_all_reported(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("sed = 1\n[optim]\nlrr = 1e-6\n[outer.inner]\ndepht = 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(Top, path=path)
    text = str(err.value)
    assert "'sed'" in text and "did you mean 'seed'" in text and str(path) in text
    assert "'optim.lrr'" in text and "did you mean 'optim.lr'" in text
    assert "'outer.inner.depht'" in text and "Valid keys in [outer.inner]: depth" in text


# --- type and cross-field errors ------------------------------------------------------------------

def test_wrong_type_in_file_names_the_field():
    with pytest.raises(ConfigError, match=r"optim\.warmup_steps.*Expected `int`"):
        load_config(Top, data={"optim": {"warmup_steps": "ten"}})


@pytest.mark.parametrize("data, message", [
    ({"optim": {"lr": 0.0}}, "lr must be > 0"),
    ({"optim": {"betas": [0.9, 1.0]}}, r"betas must lie in \[0, 1\) because"),
    ({"optim": {"min_lr_ratio": 0.1}}, "only applies to schedule='cosine'"),
    ({"checkpoint": {"keep_last": 0}}, "keep_last must be >= 1 because"),
    ({"checkpoint": {"every_n_steps": 0, "save_at_end": False}}, "never save"),
    ({"data": {"train_files": ["a.parquet", "a.parquet"]}}, "twice"),
    ({"data": {"train_files": ["hf:"]}}, "bad Hugging Face dataset spec"),
    ({"data": {"format": "hf", "train_files": ["a.jsonl"]}}, "lack the hf: prefix"),
    ({"data": {"max_examples": 0}}, "max_examples must be > 0"),
    ({"logging": {"sample_trajectories": -1}}, "sample_trajectories must be >= 0"),
    ({"rollout": {"mode": "constant", "k": 1}}, "needs k >= 2 because"),
])
def test_cross_field_checks_surface_as_config_errors(data, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(Top, data=data)
    assert f"'{next(iter(data))}'" in str(err.value)  # the section is named


def test_direct_construction_also_validates():
    with pytest.raises(ValueError, match="grad_clip must be >= 0"):
        OptimConfig(grad_clip=-1.0)
    assert OptimConfig(schedule="cosine", min_lr_ratio=0.1).min_lr_ratio == 0.1


# --- dump / round trip ----------------------------------------------------------------------------

def test_dump_load_round_trip_with_non_defaults():
    cfg = load_config(Top, overrides=[
        "--seed=42", "--optim.lr=1.5e-5", "--optim.betas=0.85,0.95", "--optim.schedule=cosine",
        "--optim.min_lr_ratio=0.1", "--data.train_files=a.parquet,b.jsonl", "--logging.run_name=r\"1\"\t",
        "--rollout.stop=</x>", "--rollout.max_tokens=64", "--rollout.tags.q=3", "--outer.inner.depth=9",
        "--outer.name=ünïcode \\ slash", "--rollout.ratio=0.25", "--checkpoint.resume=/ckpt/step_000010",
    ])
    text = dump_config(cfg)
    assert loads_config(Top, text) == cfg
    assert loads_config(Top, dump_config(cfg, comments=False)) == cfg


def test_dump_has_sections_help_and_unset_optional():
    text = dump_config(Top())
    assert "[optim]\n" in text and "[outer.inner]\n" in text
    assert "# Peak learning rate" in text
    assert "# max_tokens = (none)" in text
    assert loads_config(Top, text) == Top()


def test_dump_special_floats_round_trip():
    class F(msgspec.Struct):
        """Floats.

        Attributes:
            a: a.
            b: b.
        """

        a: float = float("inf")
        b: float = -1e-300

    assert loads_config(F, dump_config(F())) == F()


# --- help -----------------------------------------------------------------------------------------

def test_help_lists_every_field_with_default_and_help():
    text = format_help(Top, prog="train")
    assert text.startswith("usage: train")
    for flag in ("--seed  int = 0", "--optim.lr  float = 1e-06", "--outer.inner.depth  int = 1",
                 "--rollout.max_tokens  int | None = none", "--optim.schedule  'constant' | 'cosine'"):
        assert flag in text, flag
    assert "a help text on two lines." in text  # continuation lines are joined
    assert "(no help)" not in text


def test_parse_args_help_and_config_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(Top, ["--help"])
    assert exit_info.value.code == 0 and "--checkpoint.keep_last" in capsys.readouterr().out
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = 7e-6\n")
    cfg = parse_args(Top, ["--config", str(path), "--seed=2"])
    assert cfg.optim.lr == 7e-6 and cfg.seed == 2
    with pytest.raises(SystemExit) as exit_info:
        parse_args(Top, ["--optim.nope=1"])
    assert exit_info.value.code == 2 and "did you mean" not in capsys.readouterr().out


def test_every_owned_section_documents_every_field():
    assert check_config_class(Top) == []
    for section in (DataConfig, OptimConfig, CheckpointConfig, LoggingConfig):
        assert set(field_help(section)) == set(section.__struct_fields__), section


def test_check_config_class_flags_problems():
    class Bad(msgspec.Struct):
        """Bad.

        Attributes:
            a: documented.
        """

        a: int | None = 3
        b: int = 0

    problems = check_config_class(Bad)
    assert any("Optional but defaults to 3" in p for p in problems)
    assert any("Bad.b (b) has no help" in p for p in problems)


def test_meta_description_is_used_as_help():
    class M(msgspec.Struct):
        x: Annotated[int, msgspec.Meta(ge=0, description="Count of things.")] = 1

    assert field_help(M) == {"x": "Count of things."}
    assert load_config(M, overrides=["--x=4"]).x == 4
    with pytest.raises(ConfigError, match="x"):
        load_config(M, overrides=["--x=-1"])


def test_config_flag_without_path_is_a_config_error():
    with pytest.raises(ConfigError, match="--config needs a value"):
        parse_args(Top, ["--config"], exit_on_error=False)


def test_tensorboard_auto_on_off(monkeypatch):
    import aepo_engine.sections as sections

    monkeypatch.setattr(sections.importlib.util, "find_spec", lambda name: None)
    assert LoggingConfig(tensorboard="auto").tensorboard_enabled() is False
    assert LoggingConfig(tensorboard="off").tensorboard_enabled() is False
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        LoggingConfig(tensorboard="on").tensorboard_enabled()
    monkeypatch.setattr(sections.importlib.util, "find_spec", lambda name: object())
    assert LoggingConfig(tensorboard="auto").tensorboard_enabled() is True
