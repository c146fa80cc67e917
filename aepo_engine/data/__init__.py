"""Prompt data: read sources into ``Example``s, report bad rows, encode prompts, sample batches.

One module per job:
- :mod:`.config`: the ``data`` section (``DataConfig``) and ``hf:`` source specs;
- :mod:`.readers`: sources (parquet, JSONL, JSON, Hugging Face datasets, a reader of the user's
  own: ``register_reader``, ``data.reader_path``) -> raw rows;
- :mod:`.rows`: one raw row -> one ``Example`` (question, chat prompt, ground truth);
- :mod:`.loading`: sources -> ``Example``s, bad rows skipped with a warning or raised;
- :mod:`.prompts`: chat prompt -> token ids (the caller's tokenizer), and the
  ``max_prompt_tokens`` filter;
- :mod:`.sampler`: ``PromptSampler``, deterministic resumable batches.
Every public name is importable from ``aepo_engine.data``.
"""
from aepo_engine.data.config import HF_PREFIX, DataConfig, parse_hf_spec
from aepo_engine.data.examples import BadRow, BadRowError, Example, RowProblem
from aepo_engine.data.loading import load_examples, load_source
from aepo_engine.data.prompts import drop_long_prompts, encode_chat_prompt, fit_prompts
from aepo_engine.data.readers import data_problems, detect_format, read_source, register_reader
from aepo_engine.data.rows import parse_row
from aepo_engine.data.sampler import PromptSampler

__all__ = [
    "DataConfig",
    "HF_PREFIX",
    "parse_hf_spec",
    "encode_chat_prompt",
    "BadRow",
    "BadRowError",
    "Example",
    "PromptSampler",
    "RowProblem",
    "data_problems",
    "detect_format",
    "drop_long_prompts",
    "fit_prompts",
    "load_examples",
    "load_source",
    "parse_row",
    "read_source",
    "register_reader",
]
