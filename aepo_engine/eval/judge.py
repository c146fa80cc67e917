"""LLM judge: is a predicted answer equivalent to the reference? Asked of any OpenAI-compatible
chat endpoint (``vllm serve JUDGE_MODEL`` is one), in the equivalence-prompt style of the
reference evaluation (question, labeled answer, predicted answer -> "Correct" / "Incorrect").

- Bounded concurrency (``judge.concurrency`` requests in flight), a timeout per request.
- Transport errors (connection refused or reset, timeouts, HTTP 5xx and 429) are retried
  ``judge.retries`` times with exponential backoff; a reply that is not the expected JSON, or whose
  verdict is neither word, is not retried (the server answered; asking again rarely helps) and is
  recorded as an error for that sample.
- A persistent JSONL cache keyed by (judge model, question, reference, prediction): a resumed or
  repeated evaluation does not pay twice. Only verdicts are cached, never errors.
- :meth:`LLMJudge.check` asks the endpoint's ``/models`` first and raises :class:`JudgeUnreachable`
  with the URL and the reason, so a run can keep its other scores and say why it has no judge.

Only the standard library is used (urllib), so the judge adds no dependency.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aepo_engine.eval.config import JudgeConfig

__all__ = ["JUDGE_PROMPT", "JudgeUnreachable", "Judgment", "LLMJudge", "parse_verdict"]

JUDGE_PROMPT = """You are an evaluation assistant. Please determine if the predicted answer is equivalent to the labeled answer.

Question: {question}

Labeled Answer: {labeled_answer}

Predicted Answer: {predicted_answer}

Are these answers equivalent? Please respond with "Correct" if they are equivalent, or "Incorrect" if they are not equivalent. Do not include any other text.
"""


class JudgeUnreachable(RuntimeError):
    """The judge endpoint does not answer (or answers nothing usable) at all."""


class _Transport(Exception):
    """A retryable failure: no answer, or HTTP 5xx / 429."""


@dataclass(frozen=True)
class Judgment:
    """One verdict: ``correct`` is None when there is none (``error`` says why)."""

    correct: bool | None
    raw: str = ""
    error: str | None = None
    cached: bool = False
    attempts: int = 0


def parse_verdict(text: str) -> bool | None:
    """"Correct" -> True, "Incorrect" -> False (also 正确 / 错误); anything else -> None."""
    low = text.strip().lower()
    if "incorrect" in low or "not equivalent" in low or "错误" in low:
        return False
    if "correct" in low or "正确" in low:
        return True
    return None


def labeled_answer(references: Sequence[str]) -> str:
    return references[0] if len(references) == 1 else "any of: " + " | ".join(references)


class LLMJudge:
    """Judges (question, references, prediction) triples; see the module docstring.

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
        self._cache: dict[str, bool] = {}
        if self.cache_path.is_file():
            for line in self.cache_path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self._cache[row["key"]] = bool(row["correct"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash: that verdict is asked again

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

    def _key(self, question: str, references: Sequence[str], prediction: str) -> str:
        text = json.dumps([self.model, question, list(references), prediction], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()

    def judge(self, question: str, references: Sequence[str], prediction: str) -> Judgment:
        """One verdict (cached, retried on transport errors)."""
        key = self._key(question, references, prediction)
        with self._lock:
            if key in self._cache:
                return Judgment(self._cache[key], cached=True)
        prompt = JUDGE_PROMPT.format(question=question, labeled_answer=labeled_answer(references),
                                     predicted_answer=prediction)
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0.0, "max_tokens": self.cfg.max_tokens}
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
            return Judgment(None, raw=raw, error="verdict is neither Correct nor Incorrect", attempts=attempts)
        with self._lock:
            self._cache[key] = verdict
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            with self.cache_path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"key": key, "correct": verdict, "raw": raw}, ensure_ascii=False) + "\n")
        return Judgment(verdict, raw=raw, attempts=attempts)

    def judge_many(self, items: Sequence[tuple[str, Sequence[str], str]]) -> list[Judgment]:
        """Verdicts for (question, references, prediction) items, ``concurrency`` at a time, in order."""
        if not items:
            return []
        with ThreadPoolExecutor(max_workers=self.cfg.concurrency, thread_name_prefix="aepo-judge") as pool:
            return list(pool.map(lambda item: self.judge(*item), items))
