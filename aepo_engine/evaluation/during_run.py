"""A training run's evaluations: before RL, every ``eval.every_n_steps`` and after RL.

:class:`RunEvaluation` samples the held-out questions of the run's task and each benchmark of
``eval.files`` with the run's engine (the step source's: this rank's, or an asynchronous run's
rollout process), at whatever weights the caller has readied it with
(``StepSource.prepare_evaluation``). Under torchrun the questions are shared out over the engines
(``engine_layout``) like a step's prompts and the results all-gathered; rank 0 writes the
benchmark records and asks the judge.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec

from aepo_engine import distributed
from aepo_engine.data import Example
from aepo_engine.evaluation.benchmarks import EvalSet, eval_messages
from aepo_engine.evaluation.config import EvalConfig
from aepo_engine.evaluation.core import evaluate, judge_records, merge_eval_results, sample_records
from aepo_engine.evaluation.report import summarize
from aepo_engine.files import write_text_atomic
from aepo_engine.rollout.backends import EngineLayout
from aepo_engine.rollout.config import RolloutConfig
from aepo_engine.step_source import in_phase

__all__ = ["RunEvaluation"]


class RunEvaluation:
    """The held-out metrics, then ``<benchmark>/<metric>`` for each of ``eval.files``.

    Args:
        config: the ``eval`` section; rollout: the ``rollout`` section (the evaluation samples as
            the training rollout does).
        questions: the task's held-out questions (the first ``eval.num_questions`` are asked).
        benchmarks: the loaded ``eval.files``.
        tools, tokenizer, tool_format, reward_fn: the run's.
        encode: a question's prompt ids.
        layout: which questions this rank's engine samples.
        judge: the benchmarks' LLM judge (rank 0; None when off).
        samples_dir: where rank 0 writes ``<label>/<benchmark>.jsonl``.
        log: where the one-line summary of each evaluation goes.
    """

    def __init__(self, config: EvalConfig, rollout: RolloutConfig, questions: Sequence[Example],
                 benchmarks: Sequence[EvalSet], tools: Any, tokenizer: Any, tool_format: Any, reward_fn: Any,
                 encode: Callable[[Example], list[int]], layout: EngineLayout, judge: Any, samples_dir: Path,
                 log: Callable[[str], None]):
        self.config, self.rollout, self.questions, self.benchmarks = config, rollout, list(questions), list(benchmarks)
        self.tools, self.tokenizer, self.tool_format, self.reward_fn = tools, tokenizer, tool_format, reward_fn
        self.encode, self.layout, self.judge, self.samples_dir, self.log = encode, layout, judge, samples_dir, log

    def __bool__(self) -> bool:
        """Whether there is anything to ask."""
        return bool(self.questions or self.benchmarks)

    def __call__(self, engine: Any, label: str) -> dict[str, float]:
        """Every question asked with ``engine`` (collective under torchrun); ``label`` names the
        evaluation in the log and in the records' folder."""
        t0 = time.perf_counter()
        result = {}
        if self.questions:
            chosen = self.questions[: self.config.num_questions or None]
            mine = [chosen[i] for i in self.layout.prompts(len(chosen))]
            local = in_phase(engine, lambda: evaluate(
                engine, self.tools, self.tokenizer, self.rollout, [self.encode(e) for e in mine],
                [e.ground_truth for e in mine], self.reward_fn, msgspec.structs.replace(self.config, num_questions=0),
                categories=[e.data_source for e in mine], tool_format=self.tool_format,
                progress=label if distributed.is_main() else None))
            result = merge_eval_results(distributed.all_gather_objects(local, "the held-out evaluation"))
        for benchmark in self.benchmarks:
            result.update(self._benchmark(engine, benchmark, label))
        self.log(f"[eval {label}] " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()
                                                if not k.startswith("questions/"))
                 + f" ({time.perf_counter() - t0:.0f}s)")
        return result

    def _benchmark(self, engine: Any, benchmark: EvalSet, label: str) -> dict[str, float]:
        """One benchmark of eval.files through the eval command's code: samples, scores, judge,
        summary; the records go to ``samples_dir/<label>/<benchmark>.jsonl`` (rank 0)."""
        mine = [benchmark.examples[i] for i in self.layout.prompts(len(benchmark.examples))]
        prompts = [self.tool_format.encode_prompt(eval_messages(e, self.config.system_prompt)) for e in mine]
        local = in_phase(engine, lambda: sample_records(
            engine, self.tools, self.tokenizer, self.rollout, self.config, prompts, mine, benchmark.check,
            tool_format=self.tool_format, progress=f"{label} {benchmark.name}" if distributed.is_main() else None))
        records = [r for part in distributed.all_gather_objects(local, f"the evaluation of {benchmark.name}")
                   for r in part]
        if not distributed.is_main():
            return {}
        if self.judge is not None:
            judge_records(records, self.judge)
        folder = self.samples_dir / label.replace(" ", "_")
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / f"{benchmark.name}.jsonl",
                          "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        summary = summarize(records, self.config.pass_ks)[benchmark.name]
        return {f"{benchmark.name}/{key}": float(value) for key, value in summary.items()}
