"""Prompt data: read sources into ``Example``s, report bad rows, sample batches resumably.

Sources (``DataConfig.train_files`` / ``eval_files``):
- parquet in the reference (verl/ARPO) format: ``prompt`` (chat list of {role, content}),
  ``reward_model.ground_truth`` (a string, a list or a JSON-encoded list), ``extra_info`` {index,
  question, split}, ``data_source``, ``ability``, ``metadata``;
- JSONL / JSON question-answer files (``question``/``answer``, ``golden_answers`` lists, ...; the keys
  tried are configurable, dotted keys reach into nested objects);
- Hugging Face datasets as ``hf:NAME[:SPLIT]`` / ``hf:NAME:CONFIG:SPLIT``, only if ``datasets`` is
  installed (it is not a dependency).

A malformed row (missing fields, wrong types, empty question, unparseable JSON line) is reported with
its file and row, then skipped (one warning per file with counts by reason) or raised, per
``DataConfig.bad_rows``. Prompts are not tokenized here: ``drop_long_prompts`` takes a token counter
from the caller, who owns the tokenizer and chat template.

``PromptSampler`` draws fixed-size batches from a seeded per-epoch permutation; its ``state_dict``
(epoch, offset, seed) makes a resumed run continue with exactly the batches it would have seen.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Sequence

import msgspec
import numpy as np

from aepo_engine.rewards import as_references

__all__ = [
    "DataConfig",
    "parse_hf_spec",
    "encode_chat_prompt",
    "BadRow",
    "BadRowError",
    "Example",
    "PromptSampler",
    "RowProblem",
    "detect_format",
    "drop_long_prompts",
    "fit_prompts",
    "load_examples",
    "load_source",
    "parse_row",
    "read_source",
]

logger = logging.getLogger(__name__)


# --- config ---------------------------------------------------------------------------------------
def _require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ``ok``; msgspec reports it with the section's path."""
    if not ok:
        raise ValueError(message)


HF_PREFIX = "hf:"


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """Split ``hf:NAME[:SPLIT]`` or ``hf:NAME:CONFIG:SPLIT`` into (name, config, split).

    Args:
        spec: a data source string starting with ``hf:``.

    Returns:
        (dataset name, config name or None, split; "train" when omitted).
    """
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise ValueError(
            f"bad Hugging Face dataset spec {spec!r}: use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT"
        )
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else "train"


class DataConfig(msgspec.Struct, kw_only=True):
    """Training and evaluation data: where it is and how rows become examples.

    Attributes:
        train_files: Training data sources: .parquet files in the reference (verl/ARPO) format, .jsonl /
            .json question-answer files, or Hugging Face datasets as hf:NAME[:SPLIT] or
            hf:NAME:CONFIG:SPLIT (needs the `datasets` package). Empty: no training data (set it).
        eval_files: Evaluation data sources, same forms as train_files.
        format: Source format; "auto" picks it from the suffix (.parquet, .jsonl, .json) or the hf: prefix.
        prompt_key: Column holding a chat prompt (list of {role, content}); rows without it are built
            from the question by the prompt template.
        question_keys: Keys tried in order for the question text; dotted keys reach into nested columns
            (extra_info.question in the reference parquet files).
        answer_keys: Keys tried in order for the ground truth: a string, a list of strings (e.g.
            golden_answers) or a JSON-encoded list; numbers are turned into strings.
        max_prompt_tokens: Longest chat prompt in tokens (with the model's chat template), checked
            for train and eval prompts when the run starts; never truncated, since a cut question can
            have a different answer (see overlong_prompts).
        overlong_prompts: A prompt over max_prompt_tokens: "drop" skips it with a count in the log,
            "error" refuses to start.
        bad_rows: What to do with a malformed row (missing fields, wrong types, empty question,
            unparseable JSON line): "skip" warns with counts per file, "error" stops at the first one.
        shuffle: Shuffle the training prompts each epoch.
        shuffle_seed: Seed of the per-epoch permutation; the sampler's state stores it, so a resumed run
            continues with the same order; none = derived from the run's root seed (``aepo_engine.seeding``).
        max_examples: Use only the first N examples of each source (for debugging); none = all.
    """

    train_files: list[str] = []
    eval_files: list[str] = []
    format: Literal["auto", "parquet", "jsonl", "json", "hf"] = "auto"
    prompt_key: str = "prompt"
    question_keys: list[str] = msgspec.field(
        default_factory=lambda: ["extra_info.question", "question", "Question", "problem"])
    answer_keys: list[str] = msgspec.field(
        default_factory=lambda: ["reward_model.ground_truth", "answer", "golden_answers"])
    max_prompt_tokens: int = 2000
    overlong_prompts: Literal["drop", "error"] = "drop"
    bad_rows: Literal["skip", "error"] = "skip"
    shuffle: bool = True
    shuffle_seed: int | None = None
    max_examples: int | None = None

    def __post_init__(self) -> None:
        sources = self.train_files + self.eval_files
        _require(all(s.strip() for s in sources), "data sources must be non-empty strings")
        dupes = sorted({s for s in self.train_files if self.train_files.count(s) > 1})
        _require(not dupes, f"train_files lists {dupes} twice, which would double their weight silently")
        for spec in sources:
            if spec.startswith(HF_PREFIX):
                parse_hf_spec(spec)
        if self.format == "hf":
            bad = [s for s in sources if not s.startswith(HF_PREFIX)]
            _require(not bad, f"format='hf' but {bad} lack the hf: prefix; use format='auto' to mix")
        _require(self.question_keys != [], "question_keys must name at least one key")
        _require(self.answer_keys != [], "answer_keys must name at least one key")
        _require(self.max_prompt_tokens > 0, f"max_prompt_tokens must be > 0, got {self.max_prompt_tokens}")
        _require(self.max_examples is None or self.max_examples > 0,
                 f"max_examples must be > 0 (or none for all), got {self.max_examples}")


# --- prompts --------------------------------------------------------------------------------------

def encode_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (the assistant turn starts
    next). The warm start, the RL rollouts and the benchmarks all encode prompts here, so the
    policy sees the same prompt tokens in each."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


class Example(msgspec.Struct, kw_only=True):
    """One prompt with its references.

    Attributes:
        index: Position in the loaded example list (stable for a given config and data).
        question: The question text.
        prompt_messages: The chat prompt from the data ([{role, content}, ...]); None when the source has
            only a question and the prompt template builds the messages.
        ground_truth: Reference answers (at least one, non-empty).
        data_source: Dataset tag (the ``data_source`` column, else the file stem).
        meta: Source file and row, plus the row's remaining columns (extra_info, ability, ...).
    """

    index: int
    question: str
    prompt_messages: list[dict[str, str]] | None
    ground_truth: list[str]
    data_source: str
    meta: dict[str, Any] = {}

    def messages(self) -> list[dict[str, str]]:
        """The chat prompt: ``prompt_messages``, or the question as one user message."""
        return self.prompt_messages or [{"role": "user", "content": self.question}]


class BadRow(msgspec.Struct, frozen=True):
    """Where and why a row was rejected."""

    source: str
    row: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source} row {self.row}: {self.reason}"


class BadRowError(ValueError):
    """A malformed row with ``bad_rows="error"``."""

    def __init__(self, bad: BadRow):
        super().__init__(f"bad data row: {bad} (set data.bad_rows='skip' to skip such rows)")
        self.bad = bad


class RowProblem(ValueError):
    """``parse_row`` could not use a row; the message is the reason (file and row are added by the caller)."""


# --- reading sources ------------------------------------------------------------------------------

def detect_format(spec: str, fmt: str = "auto") -> str:
    """Return the format of a source: 'parquet', 'jsonl', 'json' or 'hf'.

    Args:
        spec: a file path or ``hf:`` spec.
        fmt: the configured format; anything but "auto" is returned as is.
    """
    if fmt != "auto":
        return fmt
    if spec.startswith(HF_PREFIX):
        return "hf"
    suffix = Path(spec).suffix.lower()
    formats = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}
    if suffix not in formats:
        raise ValueError(f"cannot tell the format of {spec!r} from its suffix; set data.format")
    return formats[suffix]


# A source yields (row number, row dict) or (row number, problem text) for rows it could not decode.
RowStream = Iterator[tuple[int, "dict[str, Any] | str"]]


def _read_parquet(path: Path) -> RowStream:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield row, record
            row += 1


def _json_rows(rows: list[Any], first: int = 0) -> RowStream:
    for i, record in enumerate(rows, start=first):
        yield i, record if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"


def _read_jsonl(path: Path) -> RowStream:
    """Rows are numbered by line (1-based) so the number can be found in an editor."""
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, f"unparseable JSON line ({err.msg})"
                continue
            yield from _json_rows([record], line_no)


def _read_json(path: Path) -> RowStream:
    """A JSON array (or {"data": [...]}) of rows; falls back to JSON lines (some .json files are)."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        yield from _read_jsonl(path)
        return
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of rows (or JSON lines)")
    yield from _json_rows(data)


def _read_hf(spec: str) -> RowStream:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"{spec} needs the Hugging Face `datasets` package: pip install datasets") from err
    name, config, split = parse_hf_spec(spec)
    yield from enumerate(datasets.load_dataset(name, config, split=split))


def read_source(spec: str, fmt: str = "auto") -> RowStream:
    """Iterate the raw rows of one source.

    Args:
        spec: a file path or ``hf:`` spec.
        fmt: the configured format ("auto" = from the suffix).

    Returns:
        An iterator of (row number, row dict), or (row number, problem) for rows that could not be
        decoded. Parquet/JSON rows count from 0, JSONL rows are line numbers (from 1).
    """
    fmt = detect_format(spec, fmt)
    if fmt == "hf":
        return _read_hf(spec)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data source not found: {spec}")
    readers = {"parquet": _read_parquet, "jsonl": _read_jsonl, "json": _read_json}
    return readers[fmt](path)


# --- parsing rows ---------------------------------------------------------------------------------

_MISSING = object()


def _lookup(row: dict[str, Any], dotted: str) -> Any:
    """Return ``row[a][b]`` for key ``a.b`` (a literal key ``a.b`` wins), or ``_MISSING``."""
    if dotted in row:
        return row[dotted]
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _first(row: dict[str, Any], keys: Sequence[str]) -> tuple[str | None, Any]:
    """Return (key, value) for the first key present with a non-None value."""
    for key in keys:
        value = _lookup(row, key)
        if value is not _MISSING and value is not None:
            return key, value
    return None, _MISSING


def _parse_messages(value: Any) -> list[dict[str, str]]:
    """Check a chat prompt: a non-empty list of {role: str, content: str} (or its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RowProblem("prompt is a string but not a JSON chat list") from err
    if not isinstance(value, (list, tuple)) or not value:
        raise RowProblem(f"prompt must be a non-empty list of messages, got {type(value).__name__}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise RowProblem(f"prompt message {i} must be {{role: str, content: str}}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _answer_item(item: Any) -> str:
    if isinstance(item, bool) or not isinstance(item, (str, int, float)):
        raise RowProblem(f"ground truth items must be strings or numbers, got {type(item).__name__}")
    return str(item)


def _parse_ground_truth(value: Any) -> list[str]:
    """A string, a number, a list of them, or a JSON-encoded list of strings -> non-empty list.

    Parsing is the rewards' own (:func:`aepo_engine.rewards.as_references`), so data loading and
    scoring agree: ``"[1, 2]"`` is one maths answer (an interval), not two references.
    """
    raw = value.tolist() if hasattr(value, "tolist") else value
    for item in raw if isinstance(raw, (list, tuple)) else [raw]:
        _answer_item(item)  # type check before as_references stringifies
    try:
        answers = as_references(raw)
    except ValueError as exc:
        raise RowProblem("ground truth is empty" if "empty" in str(exc) else f"ground truth: {exc}") from None
    if not all(a.strip() for a in answers):
        raise RowProblem("ground truth is empty")
    return answers


def _question_from(row: dict[str, Any], cfg: DataConfig,
                   messages: list[dict[str, str]] | None) -> tuple[str | None, str]:
    """Return (key used or None if taken from the prompt's last user message, question)."""
    key, value = _first(row, cfg.question_keys)
    if key is None and messages:
        user = [m["content"] for m in messages if m["role"] == "user"]
        value = user[-1] if user else _MISSING
    if value is _MISSING:
        raise RowProblem(f"no question: none of {cfg.question_keys} is present")
    if not isinstance(value, str):
        raise RowProblem(f"question must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowProblem("empty question")
    return key, value


def parse_row(row: dict[str, Any], cfg: DataConfig, source: str, row_number: int, index: int) -> Example:
    """Turn one raw row into an Example.

    Args:
        row: the decoded row.
        cfg: data settings (keys to look for).
        source: the source spec, for the data_source fallback and meta.
        row_number: the row's number within its source.
        index: the example's index in the loaded list.

    Returns:
        The Example.

    Raises:
        RowProblem: the row is unusable (the message says why).
    """
    prompt = row.get(cfg.prompt_key)
    messages = None if prompt is None else _parse_messages(prompt)
    question_key, question = _question_from(row, cfg, messages)
    answer_key, answer = _first(row, cfg.answer_keys)
    if answer_key is None:
        raise RowProblem(f"no ground truth: none of {cfg.answer_keys} is present")
    data_source = row.get("data_source")
    # Columns consumed whole are left out of meta; a nested key (reward_model.ground_truth) keeps its
    # parent column, which may carry more (reward_model.style).
    used = {cfg.prompt_key, "data_source"} | {k for k in (question_key, answer_key) if k and "." not in k}
    meta = {k: v for k, v in row.items() if k not in used and v is not None}
    return Example(
        index=index,
        question=question,
        prompt_messages=messages,
        ground_truth=_parse_ground_truth(answer),
        data_source=data_source if isinstance(data_source, str) and data_source else _stem(source),
        meta={"source": source, "row": row_number, **meta},
    )


_SPLIT_NAMES = {"train", "test", "valid", "validation", "dev", "eval"}


def _stem(source: str) -> str:
    """Dataset tag from a source: the hf name, else the file stem (the folder for eval/gaia/test.jsonl)."""
    if source.startswith(HF_PREFIX):
        return parse_hf_spec(source)[0]
    path = Path(source)
    return path.parent.name if path.stem.lower() in _SPLIT_NAMES and path.parent.name else path.stem


# --- loading --------------------------------------------------------------------------------------

def load_source(spec: str, cfg: DataConfig, first_index: int = 0) -> tuple[list[Example], list[BadRow]]:
    """Read one source; return its examples and the rows skipped (``--dry-run`` reports both).

    Raises:
        BadRowError: the first bad row, when ``cfg.bad_rows == "error"``.
    """
    examples: list[Example] = []
    bad: list[BadRow] = []
    for row_number, row in read_source(spec, cfg.format):
        if cfg.max_examples is not None and len(examples) >= cfg.max_examples:
            break
        try:
            if isinstance(row, str):
                raise RowProblem(row)
            examples.append(parse_row(row, cfg, spec, row_number, first_index + len(examples)))
        except RowProblem as err:
            problem = BadRow(spec, row_number, str(err))
            if cfg.bad_rows == "error":
                raise BadRowError(problem) from None
            bad.append(problem)
    return examples, bad


def _warn_skipped(spec: str, kept: int, bad: list[BadRow]) -> None:
    """Log one warning per source: how many rows were skipped, by reason, with a few row numbers."""
    by_reason = Counter(b.reason for b in bad)
    parts = []
    for reason, count in by_reason.most_common():
        rows = [b.row for b in bad if b.reason == reason][:5]
        parts.append(f"{count} x {reason} (rows {', '.join(map(str, rows))}{', ...' if count > 5 else ''})")
    logger.warning("skipped %d of %d rows in %s: %s", len(bad), kept + len(bad), spec, "; ".join(parts))


def load_examples(sources: Sequence[str], cfg: DataConfig) -> list[Example]:
    """Load every source into one list of Examples (indices 0..N-1 in source order).

    Args:
        sources: file paths / ``hf:`` specs (e.g. ``cfg.train_files``).
        cfg: data settings.

    Returns:
        The examples. Bad rows are skipped with a warning per source, or raise ``BadRowError`` when
        ``cfg.bad_rows == "error"``.
    """
    examples: list[Example] = []
    for spec in sources:
        loaded, bad = load_source(spec, cfg, len(examples))
        if bad:
            _warn_skipped(spec, len(loaded), bad)
        if not loaded:
            raise ValueError(f"{spec}: no usable rows" + (f" ({len(bad)} bad)" if bad else ""))
        examples += loaded
    return examples


def drop_long_prompts(
    examples: Sequence[Example], count_tokens: Callable[[Example], int], max_tokens: int
) -> list[Example]:
    """Drop examples whose rendered prompt is longer than ``max_tokens``; log how many.

    Args:
        examples: the loaded examples.
        count_tokens: prompt length in tokens (the caller applies its tokenizer and chat template).
        max_tokens: ``DataConfig.max_prompt_tokens``.

    Returns:
        The kept examples, re-indexed 0..K-1 so sampler state refers to the filtered list.
    """
    kept = [e for e in examples if count_tokens(e) <= max_tokens]
    if len(kept) < len(examples):
        logger.warning("dropped %d of %d prompts longer than %d tokens",
                       len(examples) - len(kept), len(examples), max_tokens)
    return [msgspec.structs.replace(e, index=i) for i, e in enumerate(kept)]


def fit_prompts(examples: Sequence[Example], count_tokens: Callable[[Example], int], cfg: DataConfig,
                split: str = "train") -> list[Example]:
    """Apply ``cfg.max_prompt_tokens`` as ``cfg.overlong_prompts`` says.

    Args:
        examples: the loaded examples (may be empty).
        count_tokens: prompt length in tokens with the model's tokenizer and chat template.
        cfg: the data section.
        split: "train" or "eval", for the messages.

    Returns:
        The examples that fit, re-indexed (see ``drop_long_prompts``); the drop is logged.

    Raises:
        ValueError: an over-long prompt with ``overlong_prompts="error"``, or no prompt fits.
    """
    if not examples:
        return []
    kept = drop_long_prompts(examples, count_tokens, cfg.max_prompt_tokens)
    dropped = len(examples) - len(kept)
    if dropped and cfg.overlong_prompts == "error":
        raise ValueError(f"{dropped} of {len(examples)} {split} prompts are longer than data.max_prompt_tokens="
                         f"{cfg.max_prompt_tokens} tokens (set data.overlong_prompts='drop' to skip them)")
    if not kept:
        raise ValueError(f"no {split} prompt fits in data.max_prompt_tokens={cfg.max_prompt_tokens} tokens")
    return kept


# --- sampling -------------------------------------------------------------------------------------

class PromptSampler:
    """Deterministic, resumable batches of examples.

    Epoch e visits the examples in ``permutation(seed, e)`` order (identity order when shuffle is
    off). With ``drop_last`` the tail of an epoch that cannot fill a batch is skipped, so every batch
    has ``batch_size`` prompts (the reference trainer does the same).
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        """
        Args:
            examples: the examples to draw from.
            batch_size: prompts per batch.
            seed: permutation seed.
            shuffle: shuffle every epoch.
            drop_last: skip an epoch's incomplete tail batch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(examples):
            raise ValueError(f"batch_size {batch_size} > {len(examples)} examples: no full batch exists")
        if not examples:
            raise ValueError("no examples to sample from")
        self.examples = list(examples)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        # Seeded from (seed, epoch) alone, so any epoch's order can be rebuilt on resume.
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.examples)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def next_batch(self) -> list[Example]:
        """Return the next batch, moving to a new epoch when this one is used up.

        Returns:
            ``batch_size`` examples (fewer only for the last batch of an epoch without drop_last).
        """
        remaining = len(self.examples) - self.offset
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        picked = self._order[self.offset:self.offset + self.batch_size]
        self.offset += len(picked)
        return [self.examples[i] for i in picked]

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Return the data position: epoch, offset within the epoch, seed and the data size."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the saved seed and shuffle setting win).

        Args:
            state: a ``state_dict()`` result.

        Raises:
            ValueError: the data has a different number of examples than when the state was saved.
        """
        if state["num_examples"] != len(self.examples):
            raise ValueError(f"sampler state is for {state['num_examples']} examples but the data has "
                             f"{len(self.examples)}: the data or its filters changed since the checkpoint")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
