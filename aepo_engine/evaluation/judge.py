"""LLM judge: is a predicted answer equivalent to the ground truth? Asked of any OpenAI-compatible
chat endpoint (``vllm serve JUDGE_MODEL`` is one), with one of two prompts (``judge.prompt``):

- ``"project"``: the project's own equivalence prompt (:data:`JUDGE_PROMPT`; question, labeled
  answer, predicted answer -> "Correct" / "Incorrect"), sent at temperature 0 with
  ``judge.max_tokens``. It is *not* the authors' prompt.
- ``"authors"``: the AEPO/ARPO authors' judge (``evaluation/src/llm_evaluator_sds.py`` of
  RUC-NLPIR/ARPO, read at commit a95cd08): their prompt text verbatim
  (:data:`AUTHORS_JUDGE_PROMPT`, the model input, so it is reproduced, not reworded), the gold as
  their loader reads it (a list shows as its Python text, ``['Frank Lowy']``), the server's default
  sampling, and their shortcut: when their string equivalence (``evaluation.authors.is_equiv``) of
  prediction and gold holds, the answer is correct without asking.

Both parse the reply the same strict way (:func:`parse_verdict`); a reply it cannot read is an
error for that sample, with the reply kept (the authors count it as "Incorrect").

- Bounded concurrency (``judge.concurrency`` requests in flight), a timeout per request.
- Transport errors (connection refused or reset, timeouts, HTTP 5xx and 429) are retried
  ``judge.retries`` times with exponential backoff; a reply that is not the expected JSON, or whose
  verdict cannot be read, is not retried (the server answered; asking again rarely helps) and is
  recorded as an error for that sample.
- A persistent JSONL cache keyed by the judge model and the exact request (prompt text and
  sampling settings), so a resumed or repeated evaluation does not pay twice and a different
  prompt never reuses another's verdicts. The cache keeps the raw reply and parses it again when
  read, so verdicts follow the current parser. Only readable verdicts are cached, never errors.
- :meth:`LLMJudge.check` asks the endpoint's ``/models`` first and raises :class:`JudgeUnreachable`
  with the URL and the reason, so a run can keep its other scores and say why it has no judge.

Only the standard library is used (urllib), so the judge adds no dependency.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from aepo_engine.evaluation.config import JudgeConfig
from aepo_engine.evaluation.authors import is_equiv

__all__ = ["AUTHORS_JUDGE_PROMPT", "JUDGE_PROMPT", "JudgeUnreachable", "Judgment", "LLMJudge", "parse_verdict",
           "start_judge"]

logger = logging.getLogger(__name__)

JUDGE_PROMPT = """You are an evaluation assistant. Please determine if the predicted answer is equivalent to the labeled answer.

Question: {question}

Labeled Answer: {labeled_answer}

Predicted Answer: {predicted_answer}

Are these answers equivalent? Please respond with "Correct" if they are equivalent, or "Incorrect" if they are not equivalent. Do not include any other text.
"""

# The authors' judge prompt (llm_evaluator_sds.py), verbatim: the judge model's input decides its
# verdicts, so a comparable number needs the same text.
AUTHORS_JUDGE_PROMPT = """Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. The prediction is correct if it fully aligns with the meaning and key information of the Golden Answer. Respond with "Correct" if the prediction is correct and "Incorrect" otherwise.
Golden Answer may have multiple options, and matching any one of them is considered correct.

Question: {question}
Golden Answer: {labeled_answer}
Predicted Answer: {predicted_answer}
"""

# Verdict words. Negations are looked for first, so "not correct", "incorrect" and "correct, but
# the wording is wrong" are verdicts against; a hedge ("cannot tell whether it is correct") is none.
_NEGATIVE = re.compile(r"\b(?:incorrect|not\s+correct|wrong|not\s+equivalent|inequivalent|not\s+the\s+same)\b"
                       r"|错误|不正确|不等价")
_POSITIVE = re.compile(r"\b(?:correct|equivalent)\b|正确|等价")
_HEDGE = re.compile(r"\b(?:cannot|can't|unable|not\s+sure|unsure|unclear)\b|无法|不确定")
_ONE_WORD = {"yes": True, "true": True, "right": True, "no": False, "false": False}
_DECORATION = " \t\n.!*\"'`()[]【】:："


class JudgeUnreachable(RuntimeError):
    """The judge endpoint does not answer (or answers nothing usable) at all."""


class _Transport(Exception):
    """A retryable failure: no answer, or HTTP 5xx / 429."""


@dataclass(frozen=True)
class Judgment:
    """One verdict: ``correct`` is None when there is none (``error`` says why).

    ``source`` is "judge" for the model's verdict, "string-equivalence" for the authors' prompt's
    shortcut (no request).
    """

    correct: bool | None
    raw: str = ""
    error: str | None = None
    cached: bool = False
    attempts: int = 0
    source: str = "judge"


def parse_verdict(text: str) -> bool | None:
    """The verdict of a judge reply: True, False, or None when it gives none.

    Read from the ``<judgment>...</judgment>`` part when there is one. A reply that is one word
    (yes / no / true / false / right, any case and decoration) is that word; otherwise a negation
    (incorrect, not correct, wrong, not equivalent, 错误, 不正确, ...) anywhere means False, else
    "correct" / "equivalent" / 正确 means True. A hedge ("cannot determine") or no label is None.

    Args:
        text: the judge's reply.

    Returns:
        The verdict, or None.
    """
    start, end = text.find("<judgment>"), text.find("</judgment>")
    if start != -1 and end > start:
        text = text[start + len("<judgment>"):end]
    low = text.strip().lower()
    word = low.strip(_DECORATION)
    if word in _ONE_WORD:
        return _ONE_WORD[word]
    if _HEDGE.search(low):
        return None
    if _NEGATIVE.search(low):
        return False
    return True if _POSITIVE.search(low) else None


def labeled_answer(ground_truths: Sequence[str]) -> str:
    """The project prompt's labeled answer: the ground truth, or "any of: a | b" for several."""
    return str(ground_truths[0]) if len(ground_truths) == 1 else "any of: " + " | ".join(map(str, ground_truths))


def authors_labeled_answer(ground_truths: Sequence[str], gold: Any = None) -> Any:
    """The authors' prompt's golden answer: the gold as the authors' loader reads it (a list is
    shown as its Python text by ``str.format``), else the one ground truth, else the list."""
    if gold is not None:
        return gold
    return ground_truths[0] if len(ground_truths) == 1 else list(ground_truths)


class LLMJudge:
    """Judges (question, ground_truths, prediction) triples; see the module docstring.

    Args:
        cfg: the judge section (``cfg.url`` must be set).
        cache_path: the JSONL cache file (created on first verdict).
    """

    def __init__(self, cfg: JudgeConfig, cache_path: str | Path):
        if not cfg.url:
            raise ValueError("the judge needs eval.judge.url (an OpenAI-compatible base URL)")
        self.cfg = cfg
        self.base = cfg.url.rstrip("/")
        self.model = cfg.model
        self.cache_path = Path(cache_path)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[bool, str]] = {}
        if self.cache_path.is_file():
            for line in self.cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    verdict = parse_verdict(row["raw"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash, or an older cache's row: that verdict is asked again
                if verdict is not None:
                    self._cache[row["key"]] = (verdict, row["raw"])

    # --- endpoint ---------------------------------------------------------------------------

    def _http(self, path: str, body: dict | None = None) -> dict:
        """One request; raises _Transport for retryable failures, ValueError for bad replies."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
                payload = response.read()
        except urllib.error.HTTPError as err:
            if err.code >= 500 or err.code == 429:
                raise _Transport(f"HTTP {err.code}") from err
            raise ValueError(f"HTTP {err.code}: {err.read()[:200]!r}") from err
        except (urllib.error.URLError, OSError) as err:  # refused, reset, timeout
            raise _Transport(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from err
        try:
            return json.loads(payload)
        except ValueError as err:
            raise ValueError(f"reply is not JSON: {payload[:200]!r}") from err

    def _with_retries(self, path: str, body: dict | None = None) -> tuple[dict, int]:
        delay = self.cfg.backoff_s
        for attempt in range(1, self.cfg.retries + 2):
            try:
                return self._http(path, body), attempt
            except _Transport:
                if attempt > self.cfg.retries:
                    raise
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def check(self) -> str:
        """Ask ``/models``; return the judge model's name.

        Raises:
            JudgeUnreachable: no answer after the retries, or no usable model list.
        """
        try:
            reply, _ = self._with_retries("/models")
            names = [m["id"] for m in reply["data"]]
        except _Transport as err:
            raise JudgeUnreachable(f"judge endpoint {self.base} is unreachable ({err}); start it (e.g. "
                                   f"`vllm serve MODEL --port PORT`) or leave eval.judge.url empty") from None
        except (ValueError, KeyError, TypeError) as err:
            raise JudgeUnreachable(f"judge endpoint {self.base}/models gave no model list: {err}") from None
        if self.model and self.model not in names:
            raise JudgeUnreachable(f"judge model {self.model!r} is not served at {self.base} (it serves {names})")
        self.model = self.model or (names[0] if names else "")
        if not self.model:
            raise JudgeUnreachable(f"judge endpoint {self.base} serves no model")
        return self.model

    # --- judging ----------------------------------------------------------------------------

    def _request(self, question: str, ground_truths: Sequence[str], prediction: str, gold: Any) -> dict:
        """The chat request for one item under ``judge.prompt`` (module docstring)."""
        if self.cfg.prompt == "authors":
            prompt = AUTHORS_JUDGE_PROMPT.format(question=question, predicted_answer=prediction,
                                                 labeled_answer=authors_labeled_answer(ground_truths, gold))
            return {"model": self.model, "messages": [{"role": "user", "content": prompt}]}
        prompt = JUDGE_PROMPT.format(question=question, labeled_answer=labeled_answer(ground_truths),
                                     predicted_answer=prediction)
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0.0, "max_tokens": self.cfg.max_tokens}

    def judge(self, question: str, ground_truths: Sequence[str], prediction: str, gold: Any = None) -> Judgment:
        """One verdict (cached, retried on transport errors).

        Args:
            question: the question text.
            ground_truths: the ground truth answers.
            prediction: the sample's answer.
            gold: the gold as the authors' loader reads it (the authors' prompt only; None = from
                ``ground_truths``).

        Returns:
            The :class:`Judgment`.
        """
        if self.cfg.prompt == "authors" and is_equiv(prediction, authors_labeled_answer(ground_truths, gold)):
            return Judgment(True, source="string-equivalence")
        body = self._request(question, ground_truths, prediction, gold)
        key = hashlib.sha256(json.dumps(body, ensure_ascii=False, sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                verdict, raw = self._cache[key]
                return Judgment(verdict, raw=raw, cached=True)
        try:
            reply, attempts = self._with_retries("/chat/completions", body)
        except _Transport as err:
            return Judgment(None, error=f"transport: {err} (after {self.cfg.retries} retries)",
                            attempts=self.cfg.retries + 1)
        except ValueError as err:
            return Judgment(None, error=f"malformed reply: {err}", attempts=1)
        try:
            raw = reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            return Judgment(None, error=f"malformed reply: no choices[0].message.content in {str(reply)[:200]}",
                            attempts=attempts)
        verdict = parse_verdict(raw)
        if verdict is None:
            logger.warning("judge reply without a readable verdict (counted as an error): %r", raw[:200])
            return Judgment(None, raw=raw, error=f"verdict is neither Correct nor Incorrect: {raw[:200]!r}",
                            attempts=attempts)
        with self._lock:
            self._cache[key] = (verdict, raw)
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with self.cache_path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"key": key, "correct": verdict, "raw": raw}, ensure_ascii=False) + "\n")
        return Judgment(verdict, raw=raw, attempts=attempts)

    def judge_many(self, items: Sequence[tuple[Any, ...]]) -> list[Judgment]:
        """Verdicts for (question, ground_truths, prediction[, gold]) items, ``concurrency`` at a time,
        in order."""
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="aepo-judge") as pool:
            return list(pool.map(lambda item: self.judge(*item), items))


def start_judge(cfg: JudgeConfig, cache_path: str | Path, warn: Callable[[str], None]
                ) -> tuple[LLMJudge | None, str | None]:
    """The judge of a run or of the eval command, checked to answer.

    Args:
        cfg: the judge section; an empty ``cfg.url`` means no judge.
        cache_path: the judge cache when ``cfg.cache_path`` is empty (the caller's output folder).
        warn: called with one line when the endpoint does not answer.

    Returns:
        ``(judge, None)``; ``(None, None)`` when the judge is off; ``(None, why)`` when it is
        unreachable: the other scores still count, so the caller goes on without it.
    """
    if not cfg.url:
        return None, None
    judge = LLMJudge(cfg, cfg.cache_path or cache_path)
    try:
        judge.check()
    except JudgeUnreachable as err:
        warn(f"error: {err}; going on without the judge")
        return None, str(err)
    return judge, None
