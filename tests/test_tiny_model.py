"""build_tiny_qwen3: a real checkpoint folder that loads with the ordinary from_pretrained calls."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aepo_engine.models import AGENT_TAGS, build_tiny_qwen3


def test_build_and_load(tmp_path):
    out = build_tiny_qwen3(tmp_path / "m", seed=3)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3" and model.config.head_dim in (32, 64)
    assert model.config.vocab_size == len(tok)  # a random model must not sample undecodable ids
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    # tags are single, non-special tokens: they survive skip_special_tokens and never merge
    for tag in AGENT_TAGS:
        ids = tok(f"x{tag}y")["input_ids"]
        assert tok.convert_tokens_to_ids(tag) in ids
        assert tok.decode(ids, skip_special_tokens=True) == f"x{tag}y"
    text = "<think>ok</think> naïve 東京 <search>q</search>"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless on any text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        logits = model(torch.tensor([tok(chat)["input_ids"]])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_seeded_and_custom_shape(tmp_path):
    a = build_tiny_qwen3(tmp_path / "a", seed=1, texts=["some text <search>q</search>"] * 4)
    b = build_tiny_qwen3(tmp_path / "b", seed=1, texts=["some text <search>q</search>"] * 4)
    c = build_tiny_qwen3(tmp_path / "c", seed=2, hidden_size=64, num_layers=1, head_dim=64, num_heads=2, num_kv_heads=1)
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(x) for x in (a, b, c))
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert mc.config.num_hidden_layers == 1 and mc.config.head_dim == 64


def test_train_steps_lower_the_loss(tmp_path):
    texts = ["<think>a</think><answer>b</answer>"] * 8
    raw = AutoModelForCausalLM.from_pretrained(build_tiny_qwen3(tmp_path / "r", texts=texts, seed=0))
    trained_dir = build_tiny_qwen3(tmp_path / "t", texts=texts, seed=0, train_steps=30)
    trained, tok = AutoModelForCausalLM.from_pretrained(trained_dir), AutoTokenizer.from_pretrained(trained_dir)
    ids = torch.tensor([tok(texts[0])["input_ids"]])
    with torch.no_grad():
        assert trained(ids, labels=ids).loss < raw(ids, labels=ids).loss - 1.0
