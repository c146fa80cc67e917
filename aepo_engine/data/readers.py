"""Reading sources into raw rows: parquet, JSONL, JSON and Hugging Face datasets.

Sources (``DataConfig.train_files`` / ``eval_files``):
- parquet in the reference (verl/ARPO) format: ``prompt`` (chat list of {role, content}),
  ``reward_model.ground_truth`` (a string, a list or a JSON-encoded list), ``extra_info`` {index,
  question, split}, ``data_source``, ``ability``, ``metadata``;
- JSONL / JSON question-answer files;
- Hugging Face datasets as ``hf:NAME[:SPLIT]`` / ``hf:NAME:CONFIG:SPLIT``, only if ``datasets`` is
  installed (it is not a dependency);
- any other format through a reader of the user's own: a function ``(spec) -> iterable of row
  dicts`` registered with ``@register_reader("name", suffixes=(".csv",))`` in a module outside the
  package that ``data.reader_path`` names (imported before the first source is read); sources
  ending in one of its suffixes, or every source with ``data.format = "name"``, go through it.
A row a source cannot decode (an unparseable JSON line) comes out as its problem text, for the
caller to report.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from aepo_engine.data.config import BUILT_IN_FORMATS, HF_PREFIX, DataConfig, parse_hf_spec
from aepo_engine.plugins import import_user_code

# Readers of the user's own: format name -> (function, the file suffixes it reads in format "auto").
Reader = Callable[[str], Iterable[Any]]
_READERS: dict[str, tuple[Reader, tuple[str, ...]]] = {}


def register_reader(name: str, suffixes: Sequence[str] = ()) -> Callable[[Reader], Reader]:
    """Decorator registering a dataset reader of your own under the format ``name``.

    Args:
        name: the ``data.format`` value that selects it (not a built-in format's name).
        suffixes: file suffixes (``".csv"``) that format "auto" reads with it.

    Returns:
        The decorator; the function (``spec -> iterable of row dicts``) is returned unchanged.
    """
    if name in BUILT_IN_FORMATS:
        raise ValueError(f"reader name {name!r} is a built-in format ({', '.join(BUILT_IN_FORMATS)})")

    def decorate(fn: Reader) -> Reader:
        previous = _READERS.get(name)
        if previous is not None and previous[0] is not fn:
            raise ValueError(f"a reader {name!r} is already registered ({previous[0]!r})")
        _READERS[name] = (fn, tuple(s.lower() for s in suffixes))
        return fn
    return decorate


def registered_readers() -> list[str]:
    """Names of the readers of the user's own registered so far, sorted."""
    return sorted(_READERS)


def import_readers(cfg: DataConfig) -> None:
    """Import ``data.reader_path`` (once per process), registering its readers.

    Raises:
        ValueError: no such file or module, or its import failed (naming ``data.reader_path``).
    """
    if cfg.reader_path:
        import_user_code(cfg.reader_path, "data.reader_path")


def data_problems(cfg: DataConfig) -> list[str]:
    """The ``data`` section's problems that need the readers: ``data.reader_path`` that does not
    import, or a ``data.format`` no reader has."""
    try:
        import_readers(cfg)
    except ValueError as err:
        return [str(err)]
    if cfg.format in ("auto", *BUILT_IN_FORMATS) or cfg.format in _READERS:
        return []
    return [f"data.format = {cfg.format!r}: no reader has that name (built in: auto, "
            f"{', '.join(BUILT_IN_FORMATS)}; registered by data.reader_path: {', '.join(_READERS) or 'none'})"]


def detect_format(spec: str, fmt: str = "auto") -> str:
    """Return the format of a source: 'parquet', 'jsonl', 'json', 'hf' or a registered reader's name.

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
    formats.update((s, name) for name, (_, suffixes) in _READERS.items() for s in suffixes)
    if suffix not in formats:
        raise ValueError(f"cannot tell the format of {spec!r} from its suffix; set data.format (or register a "
                         "reader for it in the module data.reader_path names)")
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


def _json_rows(rows: Iterable[Any], first: int = 0) -> RowStream:
    for i, record in enumerate(rows, start=first):
        problem = f"expected a JSON object (a row dict), got {type(record).__name__}"
        yield i, record if isinstance(record, dict) else problem


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
    if fmt in _READERS:  # the user's reader gets the spec as written, a file or not
        return _json_rows(_READERS[fmt][0](spec))
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data source not found: {spec}")
    readers = {"parquet": _read_parquet, "jsonl": _read_jsonl, "json": _read_json}
    if fmt not in readers:
        raise ValueError(f"data.format = {fmt!r}: no reader has that name (registered by data.reader_path: "
                         f"{', '.join(_READERS) or 'none'})")
    return readers[fmt](path)
