"""What a run trains on: the ``task`` config section and the task-preparation seam.

``prepare_task(task, model, tools, data, run_dir)`` returns a :class:`PreparedTask` - the model
directory to train, the tools config the rollouts use, and the train / eval examples - whatever
the source:

- ``"files"``: ``model.path`` and ``data.train_files`` / ``data.eval_files`` (see ``aepo_engine.data``);
  the tools are the ``tools`` section as configured.
- ``"synthetic"``: the generated knowledge-base task of the embedded preset
  (``aepo_engine.tasks.synthetic_setup``): its own search corpus, a tiny local Qwen3 and a warm
  start, built from the sections of :class:`SyntheticSetupConfig` alone.

The trainer only sees a ``PreparedTask``; a new task source is one more preparer here.
The generated task itself lives in ``aepo_engine.tasks.synthetic``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import msgspec

from aepo_engine.tasks.config import SyntheticSetupConfig, TaskConfig

if TYPE_CHECKING:
    from aepo_engine.data import DataConfig, Example
    from aepo_engine.models.config import ModelConfig
    from aepo_engine.tools.config import ToolsConfig

__all__ = ["PreparedTask", "SyntheticSetupConfig", "TaskConfig", "prepare_task"]


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


def prepare_task(task: TaskConfig, model: "ModelConfig", tools: "ToolsConfig", data: "DataConfig", run_dir: Path, *,
                 setup_in_child: bool = False, log: Callable[[str], None] = print) -> PreparedTask:
    """Prepare ``task.source`` for a run in ``run_dir`` (collective under torchrun).

    Args:
        task, model, tools, data: the run config's sections of those names.
        run_dir: the run folder (the synthetic task builds its files under ``run_dir/setup``).
        setup_in_child: build the synthetic set-up in a child process (the trainer asks for it
            with a vLLM backend: the set-up's search index loads numba, after which a vLLM-CPU
            engine cannot start in the same process).
        log: progress messages (the trainer passes a rank-0 printer).
    Returns:
        The model directory, tools and examples of the run. With the synthetic task a non-empty
        ``model.path`` replaces the tiny model: the warm start (if on) starts from it. A GGUF ``model.path`` is the HF folder
        it was converted into (:mod:`aepo_engine.models.gguf`; rank 0 converts it once).
    """
    model = msgspec.structs.replace(model, path=_model_dir(model.path, log))
    if task.source == "synthetic":
        from aepo_engine.tasks.synthetic_setup import prepare_synthetic_task, synthetic_example

        setup = SyntheticSetupConfig(task=task, tiny=model.tiny, tools=tools, model_path=model.path)
        run = prepare_synthetic_task(setup, run_dir, in_child=setup_in_child, log=log)
        return PreparedTask(model_dir=str(run.model_dir), tools_config=run.tools_config,
                            train_examples=[synthetic_example(i, q, run.tools_config.format)
                                            for i, q in enumerate(run.task.train)],
                            eval_examples=[synthetic_example(i, q, run.tools_config.format)
                                           for i, q in enumerate(run.task.heldout)])
    from aepo_engine.data import load_examples

    train = load_examples(data.train_files, data)
    evals = load_examples(data.eval_files, data) if data.eval_files else []
    log(f"[data] {len(train)} train / {len(evals)} eval examples")
    return PreparedTask(model.path, tools, train, evals)


def _model_dir(path: str, log: Callable[[str], None]) -> str:
    """``model.path`` as a HF folder: a GGUF file is converted by rank 0, then read by all."""
    from aepo_engine import distributed
    from aepo_engine.models.gguf import resolve_model_dir

    if distributed.is_main():
        resolve_model_dir(path, log)
    distributed.barrier()
    return resolve_model_dir(path, log)
