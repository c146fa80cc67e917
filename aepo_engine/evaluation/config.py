"""The ``eval`` config section: what to evaluate, how to sample, how to judge.

One section serves both callers: the trainer's in-run evaluation (``eval.files``,
``eval.every_n_steps``) and ``python -m aepo_engine.eval`` (whose ``--data``, ``--pass-k``, ... are
short names of these fields). Defaults live here and nowhere else.
"""
from __future__ import annotations

from typing import ClassVar

import msgspec

from aepo_engine.errors import require
from aepo_engine.rewards.config import RULES, RULES_RENAMED

__all__ = ["EvalConfig", "JudgeConfig", "SYSTEM_PROMPT_RENAMED"]

# Old values of eval.system_prompt: the authors' prompt was "reference", as the authors' rules were
# (RULES_RENAMED); loaded with a warning.
SYSTEM_PROMPT_RENAMED = {"reference": "authors"}


class JudgeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """LLM judge over an OpenAI-compatible chat endpoint (off unless url is set).

    Attributes:
        url: base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8001/v1 (a `vllm serve`
            of the judge model); empty = no judge.
        model: model name sent to the endpoint; empty = the first model its /models lists.
        concurrency: judge requests in flight at once.
        timeout_s: seconds to wait for one response (connect + read).
        retries: retries of a request after a transport error (refused, reset, timeout, HTTP 5xx or
            429), with exponential backoff; a malformed reply is not retried.
        backoff_s: first backoff; doubles after each retry.
        max_tokens: tokens the judge may write (its verdict is one word); project prompt only (the
            authors' prompt is sent with the server's default sampling, as the authors sent it).
        cache_path: JSONL cache of judgments, keyed by (judge model, the request sent); empty =
            judge_cache.jsonl in the output folder (the trainer: the run's logs).
        prompt: "project" (the project's equivalence prompt, temperature 0) or "authors" (the
            AEPO/ARPO authors' judge prompt and gold formatting, their string-equivalence shortcut,
            server-default sampling); both parse the verdict strictly (docs/scoring.md).
    """

    url: str = ""
    model: str = ""
    concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    max_tokens: int = 16
    cache_path: str = ""
    prompt: str = "project"

    RENAMED_VALUES: ClassVar[dict[str, dict[str, str]]] = {"prompt": RULES_RENAMED}

    def __post_init__(self) -> None:
        require(self.prompt in RULES, f"judge.prompt must be one of {', '.join(RULES)}, got {self.prompt!r}")
        require(not self.url or self.url.startswith(("http://", "https://")),
                f"judge.url must be an http(s) URL, got {self.url!r}")
        require(self.concurrency >= 1, f"judge.concurrency must be >= 1, got {self.concurrency}")
        require(self.timeout_s > 0, f"judge.timeout_s must be > 0, got {self.timeout_s}")
        require(self.retries >= 0 and self.backoff_s >= 0, "judge.retries and judge.backoff_s must be >= 0")
        require(self.max_tokens >= 1, f"judge.max_tokens must be >= 1, got {self.max_tokens}")


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Evaluation: benchmarks, samples per question, pass@k, the judge.

    Attributes:
        files: benchmarks to evaluate: names resolved under data_root (gaia, hle, webwalker,
            xbench, hotpotqa, 2wiki, musique, bamboogle, simpleqa, aime24, aime25, math500, gsm8k,
            math) or files (.jsonl/.json question-answer files, reference .parquet sets, the project's
            JSONL). math (the paper's MATH set) is not in the shared data: set data_root to a folder
            holding the reference's math/test.jsonl, or give that file. In training they are
            evaluated beside the task's own held-out set.
        data_root: folder the benchmark names resolve against (one sub-folder per benchmark, the
            reference data's layout: gaia/, hle/, aime24/, ...); empty: names cannot be used,
            only files (nothing outside the repository is assumed).
        num_questions: questions evaluated per benchmark (the first ones; 0 = all).
        samples: independent samples per question (n of pass@k); none = the largest pass_k (1 if none).
        pass_k: pass@k values reported besides pass@1 (each <= samples); pass@n is always reported.
            (Once ``eval.k``; not ``rollout.k``, the trajectories per prompt in training.)
        temperature: sampling temperature of evaluation rollouts.
        top_p: nucleus top-p of evaluation rollouts.
        system_prompt: system message for question-only benchmarks: "authors" (the tool and
            answer-format instructions of the reference RL parquet sets, so a model trained on them
            is evaluated in the format it learned), "none" (the question alone), or the text itself.
            Rows that carry a chat prompt keep theirs.
        every_n_steps: evaluate during training every n steps (0 = only before and after RL).
        seed: seed of the evaluation rollouts (fixed, so before/after compare the same draws);
            none = derived from the run's root seed (``aepo_engine.seeding``).
        scoring: "project" (the project's answer extraction and scores) or "authors" (the AEPO/ARPO
            authors' evaluator reproduced, mistakes included, for numbers comparable with the
            paper's table); both report em, f1, acc (cover match) and math; docs/scoring.md.
        judge: the LLM judge (off by default).
    """

    files: list[str] = []
    data_root: str = ""
    num_questions: int = 0
    samples: int | None = None
    pass_k: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    system_prompt: str = "authors"
    every_n_steps: int = 0
    seed: int | None = None
    scoring: str = "project"
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)

    RENAMED_KEYS: ClassVar[dict[str, str]] = {"k": "pass_k"}
    RENAMED_VALUES: ClassVar[dict[str, dict[str, str]]] = {"scoring": RULES_RENAMED,
                                                           "system_prompt": SYSTEM_PROMPT_RENAMED}

    def __post_init__(self) -> None:
        require(self.scoring in RULES, f"eval.scoring must be one of {', '.join(RULES)}, got {self.scoring!r}")
        require(self.num_questions >= 0, f"num_questions must be >= 0, got {self.num_questions}")
        require(self.samples is None or self.samples >= 1, f"samples must be >= 1, got {self.samples}")
        require(all(k >= 1 for k in self.pass_k), f"every pass_k must be >= 1, got {self.pass_k}")
        require(all(k <= self.n_samples for k in self.pass_k),
                f"pass_k={self.pass_k} asks for pass@k with k > samples={self.n_samples}: "
                "pass@k needs at least k samples")
        require(self.temperature > 0, "temperature must be > 0 because evaluation samples (no greedy path)")
        require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        require(self.every_n_steps >= 0, f"every_n_steps must be >= 0, got {self.every_n_steps}")
        require(bool(self.system_prompt.strip()), "system_prompt must be 'authors', 'none' or the text itself")

    @property
    def n_samples(self) -> int:
        """Samples per question: ``samples``, else the largest k, else 1."""
        return self.samples if self.samples is not None else max(self.pass_k, default=1)

    @property
    def pass_ks(self) -> list[int]:
        """The k of every pass@k reported: 1, the asked ones and n, sorted."""
        return sorted({1, self.n_samples, *self.pass_k})
