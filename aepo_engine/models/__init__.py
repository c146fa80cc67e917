"""Model helpers: the ``model`` config section and a tiny locally built Qwen3 checkpoint for tests
and CPU smoke runs."""
from aepo_engine.models.config import ModelConfig, TinyModelConfig
from aepo_engine.models.tiny_qwen3 import AGENT_TAGS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_qwen3, train_tokenizer

__all__ = ["AGENT_TAGS", "CHAT_TEMPLATE", "ModelConfig", "SPECIAL_TOKENS", "TinyModelConfig", "build_tiny_qwen3",
           "train_tokenizer"]
