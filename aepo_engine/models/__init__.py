"""Model helpers: the ``model`` config section and a tiny locally built Qwen3 checkpoint for tests
and CPU smoke runs (``tiny_qwen3``, which imports torch, loads on first use)."""
from typing import TYPE_CHECKING

from aepo_engine.lazy import lazy_exports
from aepo_engine.models.config import ModelConfig, TinyModelConfig

if TYPE_CHECKING:
    from aepo_engine.models.tiny_qwen3 import (AGENT_TAGS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_qwen3,
                                               render_chat, train_tokenizer)

__getattr__ = lazy_exports(__name__, dict.fromkeys(
    ("AGENT_TAGS", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tiny_qwen3", "render_chat", "train_tokenizer"),
    ".tiny_qwen3"))

__all__ = ["AGENT_TAGS", "CHAT_TEMPLATE", "ModelConfig", "SPECIAL_TOKENS", "TinyModelConfig", "build_tiny_qwen3",
           "render_chat", "train_tokenizer"]
