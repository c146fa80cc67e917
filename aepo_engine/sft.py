"""Supervised warm-start (the paper's "cold start"): teach the tag format before RL.

Each example is a chat prompt plus a gold response that contains tool results. The loss covers
exactly the tokens the model will write itself during rollouts: the prompt and every appended
tool result (`` <result>\\n...\\n</result>``, tags included, as the rollout appends it - docs/algorithm.md
§1b) get loss mask 0; the model's own segments and the end-of-turn token get mask 1.

Segments are tokenized one by one and their ids concatenated - the way a rollout builds a
trajectory (sampled tokens, then the tokenized tool result, then sampled tokens) - so mask
boundaries are exact and no BPE merge crosses a boundary.

Deliberately left out: packing (padding is simpler and the examples are short), gradient
accumulation, mixed precision, distributed training - this runs for a few minutes on a CPU.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from aepo_engine.data import encode_chat_prompt
from aepo_engine.native_dtype import native_dtype
from aepo_engine.seeding import section_seed
from aepo_engine.tools.base import ToolCall
from aepo_engine.tools.parsing import find_tool_call
from aepo_engine.sections import SFTConfig  # re-exported: its old home
from aepo_engine.training.optim import scheduled_lr

# A tool result as the rollout appends it; everything it matches is the tools' text, not the model's.
_TOOL_RESULT = re.compile(r" ?<result>.*?</result>", re.DOTALL)


@dataclass(frozen=True)
class SFTExample:
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 where the token is the model's to predict


# ---------------------------------------------------------------------------------------------
# Tokenization


def split_response(response: str) -> list[tuple[str, bool]]:
    """Split a response into (text, written_by_model) segments; tool results are not the model's."""
    segments: list[tuple[str, bool]] = []
    position = 0
    for match in _TOOL_RESULT.finditer(response):
        if match.start() > position:
            segments.append((response[position:match.start()], True))
        segments.append((match.group(), False))
        position = match.end()
    if position < len(response):
        segments.append((response[position:], True))
    return segments


def tokenize_example(tokenizer: Any, messages: list[dict[str, str]], response: str,
                     encode_prompt: Callable[[list[dict[str, str]]], list[int]] | None = None) -> SFTExample:
    """Prompt (chat template with the generation prompt) + response segments + end-of-turn token.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template and an ``eos_token_id`` (the
            end-of-turn token the policy must learn to emit).
        messages: the chat prompt (system + user).
        response: the assistant's text, tool results included.
        encode_prompt: the prompt's encoder (the rollout's tool format's); default
            :func:`~aepo_engine.data.encode_chat_prompt`.
    """
    input_ids = list(encode_prompt(messages)) if encode_prompt is not None else encode_chat_prompt(tokenizer, messages)
    loss_mask = [0] * len(input_ids)
    for text, written_by_model in split_response(response):
        ids = tokenizer.encode(text, add_special_tokens=False)
        input_ids += ids
        loss_mask += [int(written_by_model)] * len(ids)
    input_ids.append(tokenizer.eos_token_id)
    loss_mask.append(1)
    return SFTExample(tuple(input_ids), tuple(loss_mask))


def tokenize_in_format(tool_format: Any, messages: list[dict[str, str]], response: str) -> SFTExample:
    """A tag-format demonstration rewritten in ``tool_format`` (``aepo_engine.tools.formats``): the
    prompt as that format offers the tools, each ``<tool> payload</tool>`` call as the format writes
    it, each result as the ids the rollout inserts (``result_ids``, mask 0), then end-of-turn.
    A format whose calls end the turn (Llama-3 JSON) gets the end-of-turn token after each call,
    as the model must write it."""
    tokenizer = tool_format.tokenizer
    input_ids = list(tool_format.encode_prompt(messages))
    loss_mask = [0] * len(input_ids)
    ended_turn = after_result = False
    for text, written_by_model in split_response(response):
        if written_by_model:
            text = text.lstrip("\n") if after_result else text  # a new assistant turn starts here
            call = find_tool_call(text, tool_format.tool_names)
            ids = list(tokenizer.encode(text, add_special_tokens=False)) if not isinstance(call, ToolCall) else []
            if isinstance(call, ToolCall):
                # a template that drops text beside a call (Llama 3) gets the call alone
                before = text[:text.rfind(f"<{call.tool}>")] if tool_format.content_with_calls else ""
                ids = list(tokenizer.encode(before + tool_format.render_call(call), add_special_tokens=False))
                ended_turn = tool_format.calls_end_turn
                ids += [tokenizer.eos_token_id] if ended_turn else []
        else:
            result = text.removeprefix(" ").removeprefix("<result>\n").removesuffix("\n</result>")
            ids = tool_format.result_ids(result, ended_turn)
        after_result = not written_by_model
        input_ids += ids
        loss_mask += [int(written_by_model)] * len(ids)
    input_ids.append(tokenizer.eos_token_id)
    loss_mask.append(1)
    return SFTExample(tuple(input_ids), tuple(loss_mask))


def build_examples(tokenizer: Any, prompts: Sequence[list[dict[str, str]]], responses: Sequence[str],
                   max_length: int, tool_format: Any = None) -> list[SFTExample]:
    """Tokenize (prompt, response) pairs; raises if one is longer than ``max_length``. With a
    ``tool_format`` other than the tags, the tag-format responses are rewritten in it
    (:func:`tokenize_in_format`)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if tool_format is not None and tool_format.name != "tags":
        examples = [tokenize_in_format(tool_format, m, r) for m, r in zip(prompts, responses)]
    else:
        encode = tool_format.encode_prompt if tool_format is not None else None
        examples = [tokenize_example(tokenizer, m, r, encode) for m, r in zip(prompts, responses)]
    too_long = [len(e.input_ids) for e in examples if len(e.input_ids) > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} examples exceed max_length={max_length} "
                         f"(longest {max(too_long)} tokens); raise max_length")
    return examples


def collate(examples: Sequence[SFTExample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example. Returns input_ids, attention_mask, loss_mask: [B, T]."""
    length = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), length), dtype=torch.float32)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(example.loss_mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


# ---------------------------------------------------------------------------------------------
# Training


def masked_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean next-token loss over positions whose *target* has loss mask 1.

    The head runs on those positions only (a real vocabulary's [B, T, V] logits for every prompt
    and tool token would be most of the step's memory and a good share of its time); models
    without a separate decoder get the full logits. Against the full-logits form every gradient
    is bit-identical but the head's weight's, which differs by float rounding (its sum runs over
    fewer rows); on the tiny model that was enough to move the warm start's copying skill by
    hundreds of steps, which is why the embedded preset's decay waits for the skill
    (docs/experiments.md, "Why the main job stopped learning")."""
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:] > 0
    decoder, head = _decoder_and_head(model)
    if decoder is None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][mask]
    else:
        hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = head(hidden[:, :-1][mask])  # [N, V]: position t predicts token t + 1
    nll = F.cross_entropy(logits.float(), targets[mask], reduction="sum")
    return nll / mask.sum().clamp_min(1)


def _decoder_and_head(model: torch.nn.Module):
    """(the model's decoder stack, its LM head), or (None, None) when it has no such split."""
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = get_decoder() if get_decoder is not None else None
    if decoder is None or head is None or decoder is model or getattr(model.config, "final_logit_softcapping", None):
        return None, None
    return decoder, head


def learning_rate(step: int, config: SFTConfig, decay_start: int | None = None) -> float:
    """The warm start's lr at ``step``. With ``config.decay_steps`` = 0:
    :func:`~aepo_engine.training.optim.scheduled_lr` over ``config.steps`` peaking at ``config.lr``
    (linear warm-up, then cosine to ``lr * min_lr_ratio``, or constant). With ``decay_steps`` > 0:
    the warm-up, ``lr`` until ``decay_start`` (default ``steps - decay_steps``), then the cosine
    to ``lr * min_lr_ratio`` over ``decay_steps`` steps."""
    if config.decay_steps == 0 or step < config.warmup_steps:
        return scheduled_lr(step, config, config.steps, peak=config.lr)
    start = config.steps - config.decay_steps if decay_start is None else decay_start
    progress = min(1.0, max(0, step - start) / config.decay_steps)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def exact_match_share(model: torch.nn.Module, examples: Sequence[SFTExample], pad_id: int = 0,
                      batch_size: int = 32) -> float:
    """The share of ``examples`` whose every loss-mask token is the model's greedy choice given
    the tokens before it (teacher forcing): the demonstrations it would write token for token.
    The model is left in the mode it was in."""
    if not examples:
        raise ValueError("no examples to score")
    was_training = model.training
    model.eval()
    matched = 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        wrong = (logits.argmax(-1) != batch["input_ids"][:, 1:]) & (batch["loss_mask"][:, 1:] > 0)
        matched += int((~wrong.any(dim=1)).sum())
    model.train(was_training)
    return matched / len(examples)


def _batches(num_examples: int, batch_size: int, generator: torch.Generator):
    """Endless shuffled mini-batches of indices; every example once per epoch."""
    while True:
        order = torch.randperm(num_examples, generator=generator).tolist()
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
        if num_examples < batch_size:
            yield order


def train_sft(model: torch.nn.Module, examples: Sequence[SFTExample], config: SFTConfig,
              log: Callable[[dict[str, float]], None] | None = None,
              pad_id: int = 0, val_examples: Sequence[SFTExample] = ()) -> dict[str, float]:
    """Train ``model`` in place on the masked next-token loss (left in eval mode).

    Args:
        model: a causal LM taking ``input_ids``/``attention_mask`` and returning ``.logits``.
        examples: from :func:`build_examples`.
        config: steps, batch size, learning-rate schedule (and its score-triggered decay), seed.
        log: called after every step with ``{"step", "loss", "lr", "tokens"}``, plus
            ``"val_exact"`` on the steps that score ``val_examples``.
        pad_id: id used for padding (masked out of attention and loss, so any id works).
        val_examples: held-aside demonstrations scored with :func:`exact_match_share` every
            ``config.score_every`` steps and at the end; with ``config.decay_at_score`` their
            score starts the decay (:class:`SFTConfig`).

    Returns:
        ``{"steps": steps taken, "final_loss", "decay_start": the step the decay began (-1:
        none), "val_exact": the final score (absent without val_examples)}``.

    Deterministic for a given model state, examples and config on the same machine.
    """
    if not examples:
        raise ValueError("no SFT examples")
    if config.decay_at_score > 0 and not val_examples:
        raise ValueError("config.decay_at_score needs val_examples to score")
    generator = torch.Generator().manual_seed(section_seed(config.seed, "task.warm_start.seed"))
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, betas=config.betas, eps=config.eps)
    model.train()
    batches = _batches(len(examples), config.batch_size, generator)
    decay_start = config.steps - config.decay_steps if config.decay_steps else None
    end, step, loss = config.steps, 0, torch.tensor(float("nan"))
    while step < end:
        batch = collate([examples[i] for i in next(batches)], pad_id)
        lr = learning_rate(step, config, decay_start)
        for group in optimizer.param_groups:
            group["lr"] = lr
        device = next(model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16,
                            enabled=native_dtype(config.compute_dtype, device) == "bfloat16"):
            loss = masked_nll(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        step += 1
        row = {"step": step - 1, "loss": loss.item(), "lr": lr, "tokens": float(batch["loss_mask"].sum())}
        if val_examples and step % config.score_every == 0 and step < end:
            row["val_exact"] = exact_match_share(model, val_examples, pad_id)
            if (config.decay_at_score > 0 and decay_start is not None and step < decay_start
                    and row["val_exact"] >= config.decay_at_score):
                decay_start, end = step, step + config.decay_steps  # the skill is there: consolidate it
        if log is not None:
            log(row)
    model.eval()
    result = {"steps": step, "final_loss": loss.item(), "decay_start": -1 if decay_start is None else decay_start}
    if val_examples:
        result["val_exact"] = exact_match_share(model, val_examples, pad_id)
    return result
