"""Per-dataset summaries of sample records, as a printed table, Markdown, CSV and JSON.

Columns (one row per dataset, over its questions and their n samples each):
``questions``, ``samples`` (n), ``pass@k`` for every reported k (unbiased estimator; pass@1 is the
mean accuracy over samples; what "correct" means per set and scoring mode is in docs/scoring.md),
``em`` / ``f1`` / ``acc`` (cover match) / ``math`` (maths equivalence; mean over samples; the
paper's number is ``f1`` on QA sets and ``math`` on maths sets under ``eval.scoring = "authors"``),
``judge`` (share judged correct among samples with a verdict), ``judge_errors`` (samples without
one) and ``judge_pass@k`` (pass@k with the judge's verdict as "correct", a sample without a verdict
counting as wrong), ``calls/<tool>`` (mean calls per sample) and
``latency_s/<tool>`` (mean seconds per call), ``response_tokens`` (mean model tokens per sample),
``format_errors`` and ``no_answer`` (shares of samples).
"""
from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from aepo_engine.evaluation.scoring import pass_at_k
from aepo_engine.files import write_text_atomic

__all__ = ["format_table", "provenance", "summarize", "write_reports"]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_dataset(records: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """The summary row of one dataset's records (every question must have the same n samples)."""
    by_question: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_question[r["question_index"]].append(r)
    counts = {len(v) for v in by_question.values()}
    if len(counts) != 1:
        raise ValueError(f"questions have different sample counts {sorted(counts)}: pass@k needs the same n")
    n = counts.pop()
    row: dict[str, Any] = {"questions": len(by_question), "samples": n}
    for k in ks:
        if k <= n:
            row[f"pass@{k}"] = _mean([pass_at_k(n, sum(s["correct"] for s in group), k)
                                       for group in by_question.values()])
    for metric in ("em", "f1", "acc", "math"):
        row[metric] = _mean([r.get(metric, 0.0) for r in records])  # records written before acc lack it
    judged = [r["judge"]["correct"] for r in records if r.get("judge") and r["judge"]["correct"] is not None]
    if any(r.get("judge") for r in records):
        row["judge"] = _mean([float(v) for v in judged])
        row["judge_errors"] = sum(1 for r in records if r.get("judge") and r["judge"]["correct"] is None)
        for k in ks:
            if k <= n:
                row[f"judge_pass@{k}"] = _mean([pass_at_k(n, sum(bool((s.get("judge") or {}).get("correct"))
                                                                 for s in group), k)
                                                 for group in by_question.values()])
    tools = sorted({c["tool"] for r in records for c in r["tool_calls"]})
    for tool in tools:
        calls = [c for r in records for c in r["tool_calls"] if c["tool"] == tool]
        row[f"calls/{tool}"] = len(calls) / len(records)
        row[f"latency_s/{tool}"] = _mean([c["latency_s"] for c in calls])
    row["response_tokens"] = _mean([r["response_tokens"] for r in records])
    row["format_errors"] = _mean([float(not r["format_ok"]) for r in records])
    row["no_answer"] = _mean([float(not r["answer"]) for r in records])
    return row


def summarize(records: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, dict[str, Any]]:
    """``{dataset: summary row}`` in the order datasets first appear in ``records``."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["dataset"], []).append(r)
    return {name: summarize_dataset(group, ks) for name, group in groups.items()}


def _columns(summary: dict[str, dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in summary.values():
        columns += [c for c in row if c not in columns]
    return columns


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def format_table(summary: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    """The summary as an aligned text table, or a Markdown table."""
    columns = _columns(summary)
    rows = [["dataset", *columns]] + [[name, *(_cell(row.get(c, "")) for c in columns)]
                                      for name, row in summary.items()]
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]]) + "\n"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
                     for r in rows) + "\n"


def provenance(extra: dict[str, Any]) -> str:
    """One line saying which scoring and judge produced a summary (from ``extra``)."""
    judge = extra.get("judge") or {}
    judged = f"judge {judge.get('model') or '?'} with the {judge.get('prompt')} prompt" if judge else "no judge"
    return f"Scoring: {extra.get('scoring', 'project')} rules (docs/scoring.md); {judged}."


def write_reports(summary: dict[str, dict[str, Any]], out_dir: str | Path, extra: dict[str, Any] | None = None
                  ) -> list[Path]:
    """Write summary.md (the table and the :func:`provenance` line), summary.csv and summary.json
    (the table and ``extra``, which says the scoring and the judge) into ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns = _columns(summary)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["dataset", *columns])
    for name, row in summary.items():
        writer.writerow([name, *(row.get(c, "") for c in columns)])
    paths = [out / "summary.md", out / "summary.csv", out / "summary.json"]
    markdown = format_table(summary, markdown=True) + "\n" + provenance(extra or {}) + "\n"
    # each whole or not at all: a CSV or table cut short by a full disk would still read as one
    write_text_atomic(paths[0], markdown)
    write_text_atomic(paths[1], buffer.getvalue())
    write_text_atomic(paths[2], json.dumps({"datasets": summary, **(extra or {})}, indent=2, ensure_ascii=False))
    return paths
