"""What a run trains on: the ``task`` config section and the task-preparation seam.

``prepare_task(cfg, run_dir)`` returns a :class:`PreparedTask` - the model directory to train, the
tools config the rollouts use, and the train / eval examples - whatever the source:

- ``"files"``: ``model.path`` and ``data.train_files`` / ``data.eval_files`` (see ``aepo_engine.data``);
  the tools are ``cfg.tools`` as configured.
- ``"synthetic"``: the generated knowledge-base task of the embedded preset
  (``aepo_engine.default_setup``): its own search corpus, a tiny local Qwen3 and a warm start.

The trainer only sees a ``PreparedTask``; a new task source is one more preparer here.
The generated task itself lives in ``aepo_engine.tasks.synthetic``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import msgspec

from aepo_engine.sft import SFTConfig
from aepo_engine.tasks.synthetic import SyntheticTaskConfig

if TYPE_CHECKING:
    from aepo_engine.data import Example
    from aepo_engine.tools.config import ToolsConfig

__all__ = ["PreparedTask", "TaskConfig", "prepare_task"]


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What the agent is trained on.

    Attributes:
        source: "files" (model.path and data.train_files / data.eval_files) or "synthetic" (the
            generated knowledge-base task of the embedded preset, with its own search corpus).
        synthetic: size and mix of the generated task (synthetic only).
        warm_start: supervised warm start on generated demonstrations before RL (synthetic only).
        warm_start_enabled: run the warm start (synthetic only).
    """

    source: Literal["files", "synthetic"] = "files"
    synthetic: SyntheticTaskConfig = msgspec.field(default_factory=SyntheticTaskConfig)
    warm_start: SFTConfig = msgspec.field(default_factory=SFTConfig)
    warm_start_enabled: bool = True


@dataclass
class PreparedTask:
    """Everything a run needs from its task.

    Attributes:
        model_dir: the HF model directory the policy starts from.
        tools_config: the tools the rollouts call (the synthetic task points search at its corpus).
        train_examples: RL prompts with ground truth.
        eval_examples: held-out prompts (may be empty).
    """

    model_dir: str
    tools_config: "ToolsConfig"
    train_examples: "list[Example]"
    eval_examples: "list[Example]"


def prepare_files_task(cfg: Any, run_dir: Path, log: Callable[[str], None]) -> PreparedTask:
    """``task.source = "files"``: the configured model, tools and data files."""
    from aepo_engine.data import load_examples

    train = load_examples(cfg.data.train_files, cfg.data)
    evals = load_examples(cfg.data.eval_files, cfg.data) if cfg.data.eval_files else []
    log(f"[data] {len(train)} train / {len(evals)} eval examples")
    return PreparedTask(cfg.model.path, cfg.tools, train, evals)


def prepare_task(cfg: Any, run_dir: Path, log: Callable[[str], None] = print) -> PreparedTask:
    """Prepare ``cfg.task.source`` for a run in ``run_dir`` (collective under torchrun).

    Args:
        cfg: the ``TrainConfig``.
        run_dir: the run folder (the synthetic task builds its files under ``run_dir/setup``).
        log: progress messages (the trainer passes a rank-0 printer).
    """
    if cfg.task.source == "synthetic":
        from aepo_engine.default_setup import prepare_synthetic_task

        return prepare_synthetic_task(cfg, run_dir, log)
    return prepare_files_task(cfg, run_dir, log)
