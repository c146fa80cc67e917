"""The ``task`` config section, and the sections the synthetic task's set-up is built from.

Here, below the run config (``aepo_engine.config`` composes ``TaskConfig`` into ``TrainConfig``),
so that the task side never needs the whole run config: the synthetic set-up reads a
:class:`SyntheticSetupConfig` and nothing else.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from aepo_engine.models.config import TinyModelConfig
from aepo_engine.sft import SFTConfig
from aepo_engine.tasks.synthetic import SyntheticTaskConfig
from aepo_engine.tools.config import ToolsConfig

__all__ = ["SyntheticSetupConfig", "TaskConfig"]


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the agent is trained on.

    Attributes:
        source: "files" (model.path and data.train_files / data.eval_files) or "synthetic" (the
            generated knowledge-base task of the embedded preset, with its own search corpus).
        synthetic: size and mix of the generated task (synthetic only).
        warm_start: supervised warm start on generated demonstrations before RL (synthetic only):
            of the tiny model, or with model.path set of that pretrained model (the cold start).
        warm_start_enabled: run the warm start (synthetic only).
    """

    source: Literal["files", "synthetic"] = "files"
    synthetic: SyntheticTaskConfig = msgspec.field(default_factory=SyntheticTaskConfig)
    warm_start: SFTConfig = msgspec.field(default_factory=SFTConfig)
    warm_start_enabled: bool = True


class SyntheticSetupConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the synthetic task's set-up (task, corpus, tokenizer, tiny model, warm start) is built
    from: three sections of the run config, and nothing else of it.

    The root seed reaches the set-up through the sub-seeds the run config derives from it
    (``task.synthetic.seed``, ``task.warm_start.seed``, ``model.tiny.seed``; ``aepo_engine.seeding``);
    a sub-seed left at none here resolves as root seed 0 would.

    Attributes:
        task: the run's ``task`` section.
        tiny: the run's ``model.tiny`` section (the tiny Qwen3 the set-up builds).
        tools: the run's ``tools`` section (the demonstrations call the real tools; search is
            pointed at the generated corpus).
        model_path: a pretrained HF folder (the run's ``model.path``, a GGUF file already
            converted) that the warm start starts from (the paper's cold start); empty = build
            the tiny model.
    """

    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    tools: ToolsConfig = msgspec.field(default_factory=ToolsConfig)
    model_path: str = ""
