"""Evaluation: benchmarks, sampling with the training rollout's tools, scores, pass@k, an LLM judge,
reports. ``python -m aepo_engine.eval`` is the command (:mod:`aepo_engine.eval.cli`); the trainer
runs the same code (:func:`evaluate`, :func:`sample_records`) during training.

Modules: ``config`` (the ``eval`` section), ``benchmarks`` (names, formats, prompts), ``scoring``
(per-sample scores, pass@k), ``reference`` (the AEPO/ARPO authors' evaluator reproduced, for
``eval.scoring = "reference"``), ``core`` (sampling and scoring), ``judge`` (OpenAI-compatible LLM
judge), ``report`` (summaries and files), ``cli`` (the command, resume, progress). docs/scoring.md
compares the engine's and the authors' rules.
"""
from aepo_engine.eval.config import EvalConfig, JudgeConfig
from aepo_engine.eval.core import evaluate, merge_eval_results, sample_records
from aepo_engine.eval.scoring import pass_at_k, score_response

__all__ = ["EvalConfig", "JudgeConfig", "evaluate", "merge_eval_results", "pass_at_k", "sample_records",
           "score_response"]
