"""Code of the user's own outside the package, named in a TOML config and imported: a tool
(``tools.path``, its settings in ``tools.options.NAME``) and a dataset reader
(``data.reader_path``), through the real config loader, the run's problems and the dry run.
(``reward.path``: tests/test_rewards.py.)"""
import json

import pytest

from aepo_engine.config import config_problems, load_train_config
from aepo_engine.config_loader import ConfigError
from aepo_engine.data import load_examples
from aepo_engine.tools import build_tools
from aepo_engine.train import main as train_main
from runs import run_main

TOOL = '''
import msgspec
from aepo_engine.tools.base import ConfiguredTool, ToolResult, register_tool


class ShoutConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    times: int = 1
    suffix: str = "!"

    def __post_init__(self):
        if self.times < 1:
            raise ValueError(f"times must be >= 1, got {self.times}")


@register_tool(NAME)
class Shout(ConfiguredTool):
    config_type = ShoutConfig

    def __init__(self, config, max_result_chars):
        self.config, self.max_result_chars = config, max_result_chars

    @classmethod
    def from_config(cls, config, max_result_chars):
        return cls(config, max_result_chars)

    def __call__(self, payload):
        return ToolResult(text=(payload.upper() + self.config.suffix) * self.config.times, ok=True)
'''

READER = '''
from aepo_engine.data.readers import register_reader


@register_reader(NAME, suffixes=[".tsv"])
def read_tsv(spec):
    with open(spec, encoding="utf-8") as handle:
        for line in handle:
            question, answer = line.rstrip("\\n").split("\\t")
            yield {"question": question, "answer": answer}
'''


def _toml(path, text):
    path.write_text(text)
    return ["--config", str(path)]


def _problems(cfg):
    return [p for p in config_problems(cfg) if p.startswith(("tools.", "data.format", "data.reader_path"))]


def test_a_tool_outside_the_package_named_by_path(tmp_path):
    name = f"shout_{tmp_path.name}"  # the registry is per process: one name per test run
    (tmp_path / "my_tools.py").write_text(TOOL.replace("NAME", repr(name)))
    args = _toml(tmp_path / "run.toml", f'[tools]\nenabled = ["{name}"]\npath = "{tmp_path / "my_tools.py"}"\n'
                                        f'[tools.options.{name}]\ntimes = 2\n')
    cfg = load_train_config(args)
    assert _problems(cfg) == []
    tools = build_tools(cfg.tools)
    assert list(tools) == [name] and tools[name]("hi").text == "HI!HI!"
    # a command-line override reaches a field of the tool's own settings (a TOML value: 3 is an int)
    cfg = load_train_config([*args, f"--tools.options.{name}.times=3", f"--tools.options.{name}.suffix=?"])
    assert build_tools(cfg.tools)[name]("a").text == "A?A?A?" and _problems(cfg) == []

    # what is wrong is said once, naming the setting
    misspelt = load_train_config([*args, f"--tools.options.{name}.tiems=3"])
    assert _problems(misspelt) == [f"tools.options.{name}: Object contains unknown field `tiems`"]
    with pytest.raises(ValueError, match=f"tools.options.{name}: Object contains unknown field `tiems`"):
        build_tools(misspelt.tools)
    bad_value = load_train_config([*args, f"--tools.options.{name}.times=0"])
    assert _problems(bad_value) == [f"tools.options.{name}: times must be >= 1, got 0"]
    stranger = load_train_config([*args, "--tools.options.nobody={x = 1}"])
    assert _problems(stranger)[0].startswith("tools.options.nobody: no tool 'nobody' is registered")
    missing = load_train_config([*args, f"--tools.path={tmp_path / 'nope.py'}"])
    assert _problems(missing) == [f"tools.path = '{tmp_path / 'nope.py'}': no such file ({tmp_path / 'nope.py'})"]
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    broken = load_train_config([*args, f"--tools.path={tmp_path / 'broken.py'}"])
    assert "tools.path" in _problems(broken)[0] and "ModuleNotFoundError" in _problems(broken)[0]
    unregistered = load_train_config([*args, "--tools.path=", f"--tools.enabled=search,{name}x"])
    assert _problems(unregistered)[0].startswith(f"tools.enabled names '{name}x', which is no registered tool")
    # the settings of a tool of one's own under [tools.NAME]: the unknown-key error says where they go
    with pytest.raises(ConfigError, match=rf"unknown key 'tools.{name}'.*go under tools.options.NAME"):
        load_train_config(_toml(tmp_path / "wrong.toml", f"[tools.{name}]\ntimes = 2\n"))
    with pytest.raises(ConfigError, match=r"tools.options.search: the search tool has its own section"):
        load_train_config(["--config", str(tmp_path / "run.toml"), "--tools.options.search={topk = 3}"])


def test_a_dataset_reader_outside_the_package_named_by_path(tmp_path, capsys):
    name = f"tsv_{tmp_path.name}"
    (tmp_path / "my_readers.py").write_text(READER.replace("NAME", repr(name)))
    data = tmp_path / "train.tsv"
    data.write_text("What is 1?\t1\nWhat is 2?\t2\nWhat is 3?\t3\n")
    toml = (f'[data]\ntrain_files = ["{data}"]\nreader_path = "{tmp_path / "my_readers.py"}"\n'
            '[tools]\nenabled = []\n')
    args = _toml(tmp_path / "run.toml", toml)
    cfg = load_train_config(args)
    assert _problems(cfg) == []
    examples = load_examples(cfg.data.train_files, cfg.data)  # ".tsv": the reader's suffix, format "auto"
    assert [(e.question, e.ground_truth) for e in examples] == [(f"What is {i}?", [str(i)]) for i in (1, 2, 3)]
    # format = the reader's name reads a file of another suffix with it
    other = tmp_path / "train.txt"
    other.write_text("Q\tA\n")
    named = load_train_config([*args, f"--data.train_files={other}", f"--data.format={name}"])
    assert [(e.question, e.ground_truth) for e in load_examples(named.data.train_files, named.data)] == [("Q", ["A"])]

    # the dry run reads the file through the reader
    proc = run_main(train_main, [*args, "--dry-run"])
    assert f"note: train: {data}: 3 rows" in proc.stderr, proc.stderr

    with pytest.raises(ConfigError, match="format='csv' is no built-in format"):
        load_train_config([*args, "--data.reader_path=", "--data.format=csv"])
    misnamed = load_train_config([*args, "--data.format=csv"])
    assert _problems(misnamed) == [f"data.format = 'csv': no reader has that name (built in: auto, parquet, jsonl, "
                                   f"json, hf; registered by data.reader_path: {', '.join(_readers())})"]
    missing = load_train_config([*args, f"--data.reader_path={tmp_path / 'nope.py'}"])
    assert _problems(missing) == [f"data.reader_path = '{tmp_path / 'nope.py'}': no such file ({tmp_path / 'nope.py'})"]
    with pytest.raises(ValueError, match="data.reader_path = .*nope.py': no such file"):
        load_examples(missing.data.train_files, missing.data)
    proc = run_main(train_main, [*args, f"--data.reader_path={tmp_path / 'nope.py'}", "--dry-run"])
    assert f"problem: data.reader_path = '{tmp_path / 'nope.py'}': no such file" in proc.stderr


def _readers():
    from aepo_engine.data.readers import registered_readers
    return registered_readers()
