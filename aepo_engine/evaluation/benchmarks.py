"""The benchmarks of the paper's table, by name, and every source turned into eval ``Example``s.

``load_eval_source(spec, cfg)`` takes a benchmark name (resolved under ``eval.data_root``) or a
file, and returns a :class:`EvalSet`: the examples, the rows skipped with their file and row, and
how answers are checked. Formats handled (rows go through ``aepo_engine.data.load_source``, so
malformed rows are reported and skipped exactly as in training data):

- ``question``/``answer`` JSONL, the answer a string or a list of aliases (HotpotQA, 2Wiki,
  MuSiQue, Bamboogle, SimpleQA, WebWalker, xbench, MATH500);
- the reference's MATH set, ``math/test.jsonl`` with ``problem``/``answer`` (the paper's 14th set;
  not in the shared data: a file whose path ends in ``math/test.jsonl``, or ``--data math`` with
  ``eval.data_root`` at a folder holding it);
- GAIA's ``Question``/``answer`` with ``Level`` (kept in ``meta``);
- AIME's ``problem``/``answer`` (the answer an int in aime25, a string in aime24);
- GSM8K, whose answer is a worked solution ending ``#### N``: the reference is N;
- HLE's ``hle/top.json`` (JSON lines): multiple-choice and exact-match rows (``answer_type`` kept);
  rows with ``has_image`` are skipped with a count, since the agent reads text only;
- the reference RL parquet sets (chat prompt included) and the engine's own JSONL.

Each benchmark example keeps its gold as the authors' evaluation loader reads it in
``meta["gold"]`` (the raw answer field; for GSM8K the number after ``####`` without commas), which
``eval.scoring = "authors"`` and the authors' judge prompt use.

Question-only rows get the system prompt of the reference parquet sets (``system_prompt``), so a
model trained on those sees the format it learned. Chinese sets need nothing special here: token
F1 splits CJK text per character (``aepo_engine.rewards.text``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from aepo_engine.data import BadRow, DataConfig, Example, load_source, read_source
from aepo_engine.evaluation.authors import gsm8k_gold
from aepo_engine.rewards.text import reference_answer

__all__ = ["AUTHORS_SYSTEM_PROMPT", "BENCHMARKS", "Benchmark", "EvalSet", "load_eval_source", "resolve_source",
           "system_message"]

AnswerCheck = Literal["qa", "math", "mixed"]
"""How a sample counts as correct: qa = exact match after SQuAD normalisation; math = maths
equivalence (or exact match); mixed = either (HLE holds both kinds)."""

# The system prompt of every row of the reference RL parquet sets (rl_datasets/*.parquet), verbatim:
# "\x08oxed" is a backspace + "oxed", the reference's unescaped "\b" in a Python string. A model
# trained on those sets learned this exact text, so it is reproduced, not corrected.
AUTHORS_SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool and python interpreter tool. Given a question, you need to first think about the reasoning "
    "process in the mind and then provide the answer. During thinking, you can invoke the wikipedia search tool "
    "to search and python interpreter tool to calculate the math problem for fact information about specific "
    "topics if needed. The reasoning process and answer are enclosed within <think> </think> and <answer> "
    "</answer> tags respectively, and the search query and result are enclosed within <search> </search> and "
    "<result> </result> tags respectively. For example, <think> This is the reasoning process. </think> "
    "<search> search query here </search> <result> search result here </result> <think> This is the reasoning "
    "process. </think> <python> python code here </python> <result> python interpreter result here </result> "
    "<think> This is the reasoning process. </think> <answer> The final answer is \\[ \x08oxed{answer here} \\] "
    "</answer>. In the last part of the answer, the final exact answer is enclosed within \x08oxed{} with latex "
    "format."
)


@dataclass(frozen=True)
class Benchmark:
    """A benchmark of the paper's table.

    Attributes:
        name: the name used on the command line (lower case).
        path: its file, relative to ``eval.data_root``.
        check: how answers are checked (see ``AnswerCheck``).
        question_keys: keys holding the question; answer key is always ``answer``.
        missing: what to say when its file is not under ``eval.data_root``, besides the path.
    """

    name: str
    path: str
    check: AnswerCheck
    question_keys: tuple[str, ...] = ("question",)
    missing: str = ""


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gaia", "gaia/test.jsonl", "qa", ("Question",)),
    Benchmark("hle", "hle/top.json", "mixed"),
    Benchmark("webwalker", "webwalker/test.jsonl", "qa"),
    Benchmark("xbench", "xbench/test.jsonl", "qa"),
    Benchmark("hotpotqa", "hotpotqa/test.jsonl", "qa"),
    Benchmark("2wiki", "2wiki/test.jsonl", "qa"),
    Benchmark("musique", "musique/test.jsonl", "qa"),
    Benchmark("bamboogle", "bamboogle/test.jsonl", "qa"),
    Benchmark("simpleqa", "SimpleQA/test.jsonl", "qa"),
    Benchmark("aime24", "aime24/test.jsonl", "math", ("problem", "question")),
    Benchmark("aime25", "aime25/test.jsonl", "math", ("problem",)),
    Benchmark("math500", "math500/test.jsonl", "math"),
    Benchmark("gsm8k", "gsm8k/test.jsonl", "math"),
    Benchmark("math", "math/test.jsonl", "math", ("problem",),
              missing="the public ARPO eval data has no MATH set; the reference keeps it "
                      "as evaluation/data/math/test.jsonl in RUC-NLPIR/ARPO (problem/answer JSON lines): give "
                      "that file (--data PATH/math/test.jsonl) or a --data-root holding math/test.jsonl"),
)}

_MATH_SOURCES = ("math", "aime", "gsm8k", "amc")
_KEEP_META = ("source", "row", "Level", "answer_type", "category", "id", "task_id", "ability")


@dataclass
class EvalSet:
    """One evaluated source.

    Attributes:
        name: the dataset label reports use (the benchmark name, or the file's data source).
        examples: its questions (``data_source`` is ``name``; ``meta`` keeps file, row and labels).
        check: how answers are checked.
        skipped: rows left out, with file, row and reason (malformed rows, HLE image rows).
        source: the file read.
    """

    name: str
    examples: list[Example]
    check: AnswerCheck
    skipped: list[BadRow] = field(default_factory=list)
    source: str = ""


def resolve_source(spec: str, data_root: str | Path) -> tuple[Path, Benchmark | None]:
    """The file a source spec names, and its benchmark when it is a benchmark name.

    Raises:
        ValueError: neither a known benchmark nor an existing file (the message lists the names).
        FileNotFoundError: a known benchmark whose file is not under ``data_root``.
    """
    bench = BENCHMARKS.get(spec.strip().lower())
    if bench is not None and not str(data_root):
        raise FileNotFoundError(f"benchmark {bench.name!r}: eval.data_root is not set; pass --data-root DIR "
                                f"(eval.data_root), the folder holding {bench.path.split('/')[0]}/ (the "
                                "reference data's layout), or give the file itself")
    if bench is not None:
        path = Path(data_root) / bench.path
        if not path.is_file():
            hint = bench.missing or (f"set eval.data_root (--data-root) to the folder holding "
                                     f"{bench.path.split('/')[0]}/")
            raise FileNotFoundError(f"benchmark {bench.name!r}: {path} not found; {hint}")
        return path, bench
    path = Path(spec)
    if path.is_file():
        # A file in the reference's layout (<root>/math/test.jsonl) is that benchmark.
        laid_out = [b for b in BENCHMARKS.values() if path.as_posix().endswith("/" + b.path)]
        return path, laid_out[0] if laid_out else None
    raise ValueError(f"unknown benchmark or missing file {spec!r}; known benchmarks: {', '.join(BENCHMARKS)} "
                     "(or give a .jsonl/.json/.parquet file)")


def _file_check(examples: list[Example], name: str) -> AnswerCheck:
    """A file's answer check: maths when its rows say so (``ability``) or its name does."""
    abilities = {str(e.meta.get("ability") or "") for e in examples}
    if abilities == {"math"} or any(tag in name.lower() for tag in _MATH_SOURCES):
        return "math"
    return "mixed" if "math" in abilities else "qa"


def load_eval_source(spec: str, data_root: str | Path, max_examples: int = 0) -> EvalSet:
    """Read one benchmark name or file into an :class:`EvalSet` (bad rows skipped and listed).

    Args:
        spec: a benchmark name (see ``BENCHMARKS``) or a data file.
        data_root: where benchmark names resolve.
        max_examples: keep the first N usable questions (0 = all).
    """
    path, bench = resolve_source(spec, data_root)
    keys = list(bench.question_keys) if bench else DataConfig().question_keys
    data_cfg = DataConfig(question_keys=keys, answer_keys=["answer"] if bench else DataConfig().answer_keys,
                          bad_rows="skip")
    loaded, skipped = load_source(str(path), data_cfg)
    examples = []
    for example in loaded:
        if example.meta.get("has_image"):
            skipped.append(BadRow(str(path), example.meta["row"], "has_image (the agent reads text only)"))
            continue
        if max_examples and len(examples) >= max_examples:
            continue
        examples.append(example)
    if not examples:
        raise ValueError(f"{path}: no usable rows ({len(skipped)} skipped; first: {skipped[0] if skipped else '-'})")
    name = bench.name if bench else (examples[0].data_source if examples else path.stem)
    examples = [msgspec.structs.replace(
        e, index=i, data_source=name,
        # GSM8K-style references are worked solutions: keep their final answer only.
        ground_truth=[reference_answer(g) for g in e.ground_truth],
        meta={k: v for k, v in e.meta.items() if k in _KEEP_META}) for i, e in enumerate(examples)]
    if bench is not None:
        examples = _with_golds(examples, path, bench)
    check = bench.check if bench else _file_check(loaded, name)
    return EvalSet(name, examples, check, skipped, str(path))


def _with_golds(examples: list[Example], path: Path, bench: Benchmark) -> list[Example]:
    """``meta["gold"]``: the answer field as the authors' evaluation loader reads it (module docstring)."""
    answers = {row: value.get("answer") for row, value in read_source(str(path)) if isinstance(value, dict)}
    out = []
    for e in examples:
        gold = answers[e.meta["row"]]
        if bench.name == "gsm8k":
            gold = gsm8k_gold(str(gold)) or e.ground_truth[0]  # theirs asserts a "#### N" line
        out.append(msgspec.structs.replace(e, meta={**e.meta, "gold": gold}))
    return out


def system_message(system_prompt: str) -> list[dict[str, str]]:
    """The system message ``eval.system_prompt`` names ([] for "none")."""
    if system_prompt == "none":
        return []
    text = AUTHORS_SYSTEM_PROMPT if system_prompt == "authors" else system_prompt
    return [{"role": "system", "content": text}]


def eval_messages(example: Example, system_prompt: str) -> list[dict[str, str]]:
    """The chat prompt of an eval question: the row's own, or the system prompt + the question."""
    if example.prompt_messages:
        return example.prompt_messages
    return system_message(system_prompt) + [{"role": "user", "content": example.question}]
