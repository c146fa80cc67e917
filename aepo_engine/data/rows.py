"""One raw row -> one ``Example``: the question, the chat prompt, the ground truth, the dataset tag.

The keys tried are configurable (``DataConfig.question_keys`` / ``answer_keys``); dotted keys
reach into nested objects. A row that cannot be used raises :class:`RowProblem` with the reason.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from aepo_engine.data.config import HF_PREFIX, DataConfig, parse_hf_spec
from aepo_engine.data.examples import Example, RowProblem
from aepo_engine.rewards import as_ground_truths


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

    Parsing is the rewards' own (:func:`aepo_engine.rewards.as_ground_truths`), so data loading and
    scoring agree: ``"[1, 2]"`` is one maths answer (an interval), not two answers.
    """
    raw = value.tolist() if hasattr(value, "tolist") else value
    for item in raw if isinstance(raw, (list, tuple)) else [raw]:
        _answer_item(item)  # type check before as_ground_truths stringifies
    try:
        answers = as_ground_truths(raw)
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
