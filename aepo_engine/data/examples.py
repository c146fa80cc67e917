"""The records of data loading: one prompt with its ground truth (``Example``), and a rejected row."""
from __future__ import annotations

from typing import Any

import msgspec


class Example(msgspec.Struct, kw_only=True):
    """One prompt with its ground truth.

    Attributes:
        index: Position in the loaded example list (stable for a given config and data).
        question: The question text.
        prompt_messages: The chat prompt from the data ([{role, content}, ...]); None when the source has
            only a question and the prompt template builds the messages.
        ground_truth: The gold answers (at least one, non-empty).
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
