"""Loading sources into ``Example``s, with the bad rows reported.

A malformed row (missing fields, wrong types, empty question, unparseable JSON line) is reported
with its file and row, then skipped (one warning per file with counts by reason) or raised, per
``DataConfig.bad_rows``.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

from aepo_engine.data.config import DataConfig
from aepo_engine.data.examples import BadRow, BadRowError, Example, RowProblem
from aepo_engine.data.readers import import_readers, read_source
from aepo_engine.data.rows import parse_row

logger = logging.getLogger(__name__)


def load_source(spec: str, cfg: DataConfig, first_index: int = 0) -> tuple[list[Example], list[BadRow]]:
    """Read one source; return its examples and the rows skipped (``--dry-run`` reports both).

    Raises:
        BadRowError: the first bad row, when ``cfg.bad_rows == "error"``.
        ValueError: ``data.reader_path`` does not import.
    """
    import_readers(cfg)
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
