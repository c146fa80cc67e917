"""Prompts as tokens: encoding a chat prompt, and keeping to ``data.max_prompt_tokens``.

The caller owns the tokenizer and chat template: :func:`encode_chat_prompt` takes the tokenizer,
and the length filters take a token counter (built on it), so this module loads no model files.
Over-long prompts are never truncated (a cut question can have a different answer): they are
dropped with a count in the log, or refused, per ``DataConfig.overlong_prompts``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import msgspec

from aepo_engine.chat_text import chat_text
from aepo_engine.data.config import DataConfig
from aepo_engine.data.examples import Example

logger = logging.getLogger(__name__)


def encode_chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (the assistant turn starts
    next). The warm start, the RL rollouts and the benchmarks all encode prompts here, so the
    policy sees the same prompt tokens in each."""
    text = chat_text(tokenizer, messages)  # the template's, or the plain layout of a base model's
    return list(tokenizer.encode(text, add_special_tokens=False))


def drop_long_prompts(
    examples: Sequence[Example], count_tokens: Callable[[Example], int], max_tokens: int
) -> list[Example]:
    """Drop examples whose rendered prompt is longer than ``max_tokens``; log how many.

    Args:
        examples: the loaded examples.
        count_tokens: prompt length in tokens (the caller applies its tokenizer and chat template).
        max_tokens: ``DataConfig.max_prompt_tokens``.

    Returns:
        The kept examples, re-indexed 0..K-1 so sampler state refers to the filtered list.
    """
    kept = [e for e in examples if count_tokens(e) <= max_tokens]
    if len(kept) < len(examples):
        logger.warning("dropped %d of %d prompts longer than %d tokens",
                       len(examples) - len(kept), len(examples), max_tokens)
    return [msgspec.structs.replace(e, index=i) for i, e in enumerate(kept)]


def fit_prompts(examples: Sequence[Example], count_tokens: Callable[[Example], int], cfg: DataConfig,
                split: str = "train") -> list[Example]:
    """Apply ``cfg.max_prompt_tokens`` as ``cfg.overlong_prompts`` says.

    Args:
        examples: the loaded examples (may be empty).
        count_tokens: prompt length in tokens with the model's tokenizer and chat template.
        cfg: the data section.
        split: "train" or "eval", for the messages.

    Returns:
        The examples that fit, re-indexed (see ``drop_long_prompts``); the drop is logged.

    Raises:
        ValueError: an over-long prompt with ``overlong_prompts="error"``, or no prompt fits.
    """
    if not examples:
        return []
    kept = drop_long_prompts(examples, count_tokens, cfg.max_prompt_tokens)
    dropped = len(examples) - len(kept)
    if dropped and cfg.overlong_prompts == "error":
        raise ValueError(f"{dropped} of {len(examples)} {split} prompts are longer than data.max_prompt_tokens="
                         f"{cfg.max_prompt_tokens} tokens (set data.overlong_prompts='drop' to skip them)")
    if not kept:
        raise ValueError(f"no {split} prompt fits in data.max_prompt_tokens={cfg.max_prompt_tokens} tokens")
    return kept
