"""Evaluation: benchmarks, sampling with the training rollout's tools, scores, pass@k, an LLM judge,
reports. The trainer runs this code (:func:`evaluate`, :func:`sample_records`) during training;
``python -m aepo_engine.eval`` (:mod:`aepo_engine.eval`, the command beside this library as
``aepo_engine.train`` is beside ``training``, above the run config) runs it on a model or a run
folder.

Modules: ``config`` (the ``eval`` section), ``benchmarks`` (names, formats, prompts), ``scoring``
(per-sample scores, pass@k), ``authors`` (the AEPO/ARPO authors' evaluator reproduced, for
``eval.scoring = "authors"``), ``core`` (sampling and scoring), ``judge`` (OpenAI-compatible LLM
judge), ``report`` (summaries and files), ``during_run`` (a training run's evaluations: before RL,
every ``eval.every_n_steps``, after RL). docs/scoring.md compares the project's and the authors'
rules.
"""
from typing import TYPE_CHECKING

from aepo_engine.evaluation.config import EvalConfig, JudgeConfig
from aepo_engine.lazy import lazy_exports

if TYPE_CHECKING:
    from aepo_engine.evaluation.core import evaluate, merge_eval_results, sample_records
    from aepo_engine.evaluation.scoring import pass_at_k, score_response

# core (sampling) imports torch: loaded on first use, so the ``eval`` section reads without it.
__getattr__ = lazy_exports(__name__, {"evaluate": ".core", "merge_eval_results": ".core", "sample_records": ".core",
                                      "pass_at_k": ".scoring", "score_response": ".scoring"})

__all__ = ["EvalConfig", "JudgeConfig", "evaluate", "merge_eval_results", "pass_at_k", "sample_records",
           "score_response"]
