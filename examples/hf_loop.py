"""One AEPO training step of a Hugging Face model with the fused loss, end to end.

    python examples/hf_loop.py

What an outside training loop does, in order (docs/library.md explains each choice):
1. generate k samples per prompt at the sampling temperature;
2. old log-probs and entropies of the samples: one no-grad forward, ``logprob_entropy`` in
   Hugging Face's alignment (``shift_labels=True``: logits row t predicts ``input_ids[t + 1]``);
3. rewards (invented here), then ``step_inputs``: group advantages, the entropy z-score
   statistics and the token count of the whole step, in one call;
4. the loss on logits, over two micro-batches (gradient accumulation: each call gets the step's
   statistics, so the micro-batch losses sum to the whole batch's loss), backward;
5. the same loss from hidden states and the lm_head weight (fused-linear, no ``[B, T, V]``
   logits): the same loss and gradient;
6. one optimizer step.
The model is a tiny Qwen3 built here with random weights: nothing is downloaded. The file is the
test's source (tests/test_example_hf_loop.py runs it), so what you copy is what CI runs.
"""
from __future__ import annotations

import json

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, logprob_entropy, step_inputs

PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 2, 4, 6, 10  # B = PROMPTS * SAMPLES sequences
TEMPERATURE = 0.8  # the sampling temperature: generation and every loss call use the same one
CONFIG = LossConfig(clip="aepo", entropy_adv_alpha=0.2)


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 with random weights (tied embeddings, as SmolLM2 and small Qwen3 have)."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    return Qwen3ForCausalLM(config)


def reward(completion: list[int]) -> float:
    """An invented reward: the share of even token ids in the completion."""
    return sum(token % 2 == 0 for token in completion) / max(len(completion), 1)


def generate(model, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T], attention_mask [B, T], completion_mask [B, T])``: SAMPLES samples per
    prompt; the completion mask is 1 on generated tokens up to the first end-of-sequence token."""
    ids = prompts.repeat_interleave(SAMPLES, 0)
    with torch.no_grad():
        input_ids = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=TEMPERATURE,
                                   top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS)
    generated = torch.zeros_like(input_ids, dtype=torch.bool)
    generated[:, PROMPT_LEN:] = True
    ended_before = (input_ids == model.config.eos_token_id).long().cumsum(1) - (input_ids == model.config.eos_token_id).long()
    completion_mask = (generated & (ended_before == 0)).float()  # [B, T], input_ids-aligned
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:, PROMPT_LEN:] = completion_mask[:, PROMPT_LEN:].long()
    return input_ids, attention_mask, completion_mask


def readme_loss(logits, input_ids, old_logprobs, advantages, loss_mask):
    # README snippet (tests/test_docs.py checks the README shows these lines):
    from aepo_kernels import aepo_policy_loss, LossConfig
    # HF logits [B, T, V] and input_ids [B, T]: logits row t predicts input_ids[t + 1]
    loss, stats = aepo_policy_loss(logits, input_ids, old_logprobs, advantages, loss_mask, shift_labels=True,
                                   temperature=0.8, config=LossConfig(clip="aepo", entropy_adv_alpha=0.2))
    # end of README snippet
    return loss, stats


def main() -> dict:
    model = tiny_model()
    prompts = torch.randint(2, model.config.vocab_size, (PROMPTS, PROMPT_LEN))

    # 1. generate
    model.eval()
    input_ids, attention_mask, loss_mask = generate(model, prompts)  # [B, T] each

    # 2. old log-probs and entropies, aligned with input_ids (token 0: 0, nothing predicts it)
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits  # [B, T, V]
        old_logprobs, old_entropy = logprob_entropy(logits, input_ids, TEMPERATURE, shift_labels=True)

    # 3. rewards -> group advantages [B], entropy statistics and token count of the whole step
    rewards = torch.tensor([reward(row[mask > 0].tolist()) for row, mask in zip(input_ids, loss_mask)])
    step = step_inputs(rewards, torch.arange(len(rewards)) // SAMPLES, old_entropy, loss_mask)

    # 4. the loss on logits, two micro-batches (gradient accumulation), backward
    model.train()
    micro_batches = [slice(0, 3), slice(3, len(rewards))]  # any split gives the same gradient
    logits_loss = 0.0
    for rows in micro_batches:
        logits = model(input_ids[rows], attention_mask=attention_mask[rows]).logits
        loss, stats = aepo_policy_loss(logits, input_ids[rows], old_logprobs[rows], step.advantages[rows],
                                       loss_mask[rows], shift_labels=True, temperature=TEMPERATURE, config=CONFIG,
                                       **step.loss_kwargs())
        loss.backward()  # accumulates: the micro-batch losses sum to the step's loss
        logits_loss += loss.detach()
    logits_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    # The README's one call on the whole batch (its own statistics, two-phase): the same loss.
    whole = model(input_ids, attention_mask=attention_mask).logits
    readme, readme_stats = readme_loss(whole, input_ids, old_logprobs, step.advantages, loss_mask)

    # 5. the same loss from hidden states and the lm_head weight: no [B, T, V] logits
    hidden = model.model(input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, D]
    fused_loss, fused_stats = fused_linear_aepo_policy_loss(
        hidden, model.lm_head.weight, input_ids, old_logprobs, step.advantages, loss_mask, shift_labels=True,
        temperature=TEMPERATURE, config=CONFIG, **step.loss_kwargs())
    fused_loss.backward()
    grad_gap = max(float((p.grad - logits_grads[name]).abs().max() / logits_grads[name].abs().max().clamp(min=1e-12))
                   for name, p in model.named_parameters())

    # 6. one optimizer step
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    moved = sum(not torch.equal(p, before[name]) for name, p in model.named_parameters())

    result = {"logits_loss": float(logits_loss), "readme_loss": float(readme.detach()),
              "fused_loss": float(fused_loss.detach()),
              "max_relative_grad_gap": grad_gap, "tokens": float(fused_stats["num_tokens"]),
              "step_tokens": float(step.global_token_count), "readme_tokens": float(readme_stats["num_tokens"]),
              "parameters_moved": moved, "parameters": len(before), "advantages": step.advantages.tolist()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
