"""Reading sources into raw rows: parquet, JSONL, JSON and Hugging Face datasets.

Sources (``DataConfig.train_files`` / ``eval_files``):
- parquet in the reference (verl/ARPO) format: ``prompt`` (chat list of {role, content}),
  ``reward_model.ground_truth`` (a string, a list or a JSON-encoded list), ``extra_info`` {index,
  question, split}, ``data_source``, ``ability``, ``metadata``;
- JSONL / JSON question-answer files;
- Hugging Face datasets as ``hf:NAME[:SPLIT]`` / ``hf:NAME:CONFIG:SPLIT``, only if ``datasets`` is
  installed (it is not a dependency).
A row a source cannot decode (an unparseable JSON line) comes out as its problem text, for the
caller to report.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from aepo_engine.data.config import HF_PREFIX, parse_hf_spec


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
