"""A chat as the text the model reads: the tokenizer's chat template, or for a model without one
(a base model) a plain layout of this engine's own.

The plain layout (:data:`PLAIN_LAYOUT`) writes each message as a labelled paragraph and ends a
prompt with the assistant's label, where the model continues::

    {system}

    User: {question}

    Assistant:{response}{eos}

so a base model's completion is the assistant's turn; it ends at the model's end-of-sequence
token (or the length cap), which a rendered conversation writes after the turn (as a chat
template writes its end-of-turn token: the ids trained on are the rendering's), and the tag
format's calls and results go inside it as they do in a chat model's turn. Only ``tools.format = "tags"`` uses it: ``"chat_template"`` is the template's
own tool syntax and refuses a tokenizer without one (:func:`require_chat_template`).
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["PLAIN_LAYOUT", "PLAIN_GENERATION_PROMPT", "chat_text", "has_chat_template", "require_chat_template"]

# role -> how a message of it is written; a prompt then ends with PLAIN_GENERATION_PROMPT.
# (No tool role: the tag format writes results inside the assistant's turn.)
PLAIN_LAYOUT = {"system": "{content}\n\n", "user": "User: {content}\n\n",
                "assistant": "Assistant:{content}{eos}\n\n"}
PLAIN_GENERATION_PROMPT = "Assistant:"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def require_chat_template(tokenizer: Any, what: str) -> None:
    """Raise a one-line ``ValueError`` naming the alternative when ``tokenizer`` has no chat template."""
    if not has_chat_template(tokenizer):
        raise ValueError(f"{what} needs a tokenizer with a chat template and this model's has none (a base "
                         "model?): use tools.format = 'tags', which writes a plain prompt layout for it "
                         "(aepo_engine.chat_text)")


def chat_text(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
              tools: list[dict[str, Any]] | None = None) -> str:
    """``messages`` as text: the chat template's rendering, or :data:`PLAIN_LAYOUT` without one.

    Args:
        add_generation_prompt: end with the assistant's turn opened (a prompt).
        tools: tool schemas for the template's tool list (a template only).
    """
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    if tools:
        require_chat_template(tokenizer, "a tool list in the prompt")
    unknown = sorted({m["role"] for m in messages} - set(PLAIN_LAYOUT))
    if unknown:
        raise ValueError(f"the plain prompt layout has no role {unknown[0]!r} (roles: {', '.join(PLAIN_LAYOUT)})")
    eos = getattr(tokenizer, "eos_token", None) or ""
    text = "".join(PLAIN_LAYOUT[m["role"]].format(content=m.get("content") or "", eos=eos) for m in messages)
    return text + PLAIN_GENERATION_PROMPT if add_generation_prompt else text
