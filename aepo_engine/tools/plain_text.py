"""Tool text as plain text: the one encoder of text the model did not write (tool results).

A search page or a program's output may contain the strings of the tokenizer's control tokens
(``<|im_end|>``, ``<|im_start|>``, ``<|eot_id|>``...). Encoded with the tokenizer's defaults those
strings become the control ids, so a tool could close the tool turn and open a forged one (a
fake user or assistant turn) in the ids the policy trains on. Here they are split like any other
text (``split_special_tokens=True``), and the result is checked to hold no control id at all.

Every place that turns tool text into ids (the tag format's result block, the chat template's
tool turn) calls :func:`encode_plain_text`; the frames around it (tags, turn headers) are encoded
by their callers, with control tokens recognised.
"""
from __future__ import annotations

from typing import Any

__all__ = ["control_token_ids", "encode_plain_text"]


def control_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (turn markers, end-of-text...): the ones text must
    never produce. Added tokens that are not special (a format's tags, e.g. the tiny model's
    ``<result>``) are ordinary vocabulary and stay matched."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = [i for i, token in added.items() if getattr(token, "special", False)]
    return frozenset(int(i) for i in (*getattr(tokenizer, "all_special_ids", ()), *special))


def encode_plain_text(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` with every control-token string in it encoded as ordinary text.

    Args:
        tokenizer: a Hugging Face tokenizer (or any object with ``encode(text, add_special_tokens)``
            and no control tokens).
        text: tool output (untrusted).
    Returns:
        Ids that decode back to ``text`` and hold no control id.
    Raises:
        ValueError: the tokenizer produced a control id anyway (its BPE merges reach one); such a
            tokenizer cannot keep tool text from forging turns, and is refused rather than trusted.
    """
    if callable(tokenizer):  # a Hugging Face tokenizer
        ids = list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    else:  # a tokenizer with no special tokens to split (the tests' character tokenizer)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    forged = set(ids) & control_token_ids(tokenizer)
    if forged:
        raise ValueError(f"the tokenizer encodes tool text to control ids {sorted(forged)} even with "
                         "split_special_tokens; tool text could forge turns with it")
    return ids
