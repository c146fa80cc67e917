"""Supervised warm-start: the loss mask covers exactly the model-written tokens; training works."""
import msgspec
import pytest
import torch

from aepo_engine.sft import (SFTConfig, build_examples, collate, exact_match_share, learning_rate, masked_nll,
                             split_response, tokenize_example, train_sft)
from aepo_engine.tasks.synthetic import (SyntheticTaskConfig, make_demonstrations, make_task,
                                         reference_tool_fn)

RESPONSE = ("<think></think>\n<search> Bo age</search> <result>\nPage 1: Bo age 20.\n</result>\n"
            "<python>print( 20 + 1)</python> <result>\n21\n</result>\n<answer> \\boxed{21} </answer>")
MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Bo age plus 1?"}]


@pytest.fixture(scope="module")
def task():
    return make_task(SyntheticTaskConfig(seed=1, num_people=30, num_cities=4, num_train=64, num_heldout=8))


@pytest.fixture(scope="module")
def demos(task):
    return make_demonstrations(task.train, reference_tool_fn(task))


@pytest.fixture(scope="module")
def tokenizer(task, demos):
    from aepo_engine.models import train_tokenizer
    texts = [row["contents"] for row in task.corpus] + [q.text for q in task.train] + demos + [RESPONSE]
    return train_tokenizer(texts, vocab_size=400)


def _tiny_model(tokenizer, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(config)


def test_split_response_marks_tool_results_as_not_the_models():
    segments = split_response(RESPONSE)
    assert "".join(text for text, _ in segments) == RESPONSE
    assert segments == [
        ("<think></think>\n<search> Bo age</search>", True),
        (" <result>\nPage 1: Bo age 20.\n</result>", False),
        ("\n<python>print( 20 + 1)</python>", True),
        (" <result>\n21\n</result>", False),
        ("\n<answer> \\boxed{21} </answer>", True),
    ]
    assert split_response("no tools") == [("no tools", True)]


def test_loss_mask_covers_exactly_the_model_written_tokens(tokenizer):
    example = tokenize_example(tokenizer, MESSAGES, RESPONSE)
    ids, mask = example.input_ids, example.loss_mask
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert list(ids[:n_prompt]) == tokenizer.encode(prompt, add_special_tokens=False)
    assert not any(mask[:n_prompt])
    # Hand check: the trained tokens decode to the model's segments plus the end-of-turn token,
    # the untrained response tokens to the two tool results, in order.
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == ("<think></think>\n<search> Bo age</search>\n<python>print( 20 + 1)</python>"
                       "\n<answer> \\boxed{21} </answer><|im_end|>")
    untrained = tokenizer.decode([t for t, m in zip(ids[n_prompt:], mask[n_prompt:]) if not m])
    assert untrained == " <result>\nPage 1: Bo age 20.\n</result> <result>\n21\n</result>"
    assert ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    # Mask runs: prompt 0, model 1, result 0, model 1, result 0, model 1 (incl. eos).
    runs = [mask[0]] + [b for a, b in zip(mask, mask[1:]) if a != b]
    assert runs == [0, 1, 0, 1, 0, 1]


def test_build_examples_rejects_examples_longer_than_max_length(tokenizer):
    with pytest.raises(ValueError, match="exceed max_length"):
        build_examples(tokenizer, [MESSAGES], [RESPONSE], max_length=10)


def test_masked_nll_ignores_masked_targets_and_padding(tokenizer):
    model = _tiny_model(tokenizer)
    example = tokenize_example(tokenizer, MESSAGES, RESPONSE)
    single = masked_nll(model, collate([example]))
    short = tokenize_example(tokenizer, MESSAGES, "<answer> \\boxed{1} </answer>")
    padded = collate([example, short], pad_id=tokenizer.pad_token_id)
    assert padded["loss_mask"][1, len(short.input_ids):].sum() == 0
    # Reference: cross-entropy over the mask-1 targets of the lone example.
    ids = torch.tensor([example.input_ids])
    logits = model(input_ids=ids).logits[0, :-1]
    keep = torch.tensor(example.loss_mask[1:], dtype=torch.bool)
    reference = torch.nn.functional.cross_entropy(logits[keep], ids[0, 1:][keep])
    torch.testing.assert_close(single, reference)


def test_a_few_steps_reduce_the_loss_and_are_deterministic(tokenizer, task, demos):
    examples = build_examples(tokenizer, [q.messages() for q in task.train], demos, max_length=256)
    config = SFTConfig(steps=12, batch_size=8, lr=1e-2, warmup_steps=2, seed=5)
    batch = collate(examples[:16], pad_id=tokenizer.pad_token_id)
    models, losses = [], []
    for _ in range(2):
        model = _tiny_model(tokenizer)
        with torch.no_grad():
            before = masked_nll(model, batch).item()
        log = []
        result = train_sft(model, examples, config, log=log.append, pad_id=tokenizer.pad_token_id)
        assert result["steps"] == 12 and result["final_loss"] == log[-1]["loss"] and result["decay_start"] == -1
        assert not model.training
        models.append(model)
        with torch.no_grad():
            losses.append((before, masked_nll(model, batch).item()))
        assert [row["step"] for row in log] == list(range(12))
    (before, after), again = losses
    assert after < 0.8 * before, losses
    assert again == losses[0]
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_config_rejects_unknown_fields_and_bad_schedules():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"steps": 10, "stepz": 3}, SFTConfig)
    with pytest.raises(ValueError, match="warmup_steps"):
        SFTConfig(steps=10, warmup_steps=11)
    config = SFTConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    assert [round(learning_rate(s, config), 3) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert learning_rate(10, config) == pytest.approx(0.1)
    # The optimizer fields are OptimConfig's, with its checks and its schedule choices.
    with pytest.raises(ValueError, match="betas"):
        SFTConfig(betas=(0.9, 1.0))
    flat = SFTConfig(steps=10, warmup_steps=2, lr=1.0, schedule="constant", min_lr_ratio=0.0)
    assert [learning_rate(s, flat) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]


def test_decay_steps_hold_the_peak_then_decay_over_the_last_steps():
    config = SFTConfig(steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1, decay_steps=4)
    lrs = [learning_rate(s, config) for s in range(11)]
    assert lrs[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]  # warm-up, then the peak until step 10 - 4
    assert lrs[6] == pytest.approx(1.0) and lrs[8] == pytest.approx(0.55) and lrs[10] == pytest.approx(0.1)
    # an earlier start (the score reached decay_at_score at step 3): the same cosine from there
    assert [round(learning_rate(s, config, decay_start=3), 4) for s in (3, 5, 7, 9)] == [1.0, 0.55, 0.1, 0.1]
    with pytest.raises(ValueError, match="decay_steps"):
        SFTConfig(steps=10, warmup_steps=2, decay_steps=9)
    with pytest.raises(ValueError, match="cosine"):
        SFTConfig(steps=30, decay_steps=4, schedule="constant")
    with pytest.raises(ValueError, match="decay_at_score needs"):
        SFTConfig(steps=30, decay_steps=4, decay_at_score=0.5)


def test_exact_match_share_counts_demonstrations_written_token_for_token(tokenizer):
    """Hand-made: a model whose logits always put the next token of example 0 first reproduces
    example 0 and no other (the padding and masked positions do not count)."""
    examples = [tokenize_example(tokenizer, MESSAGES, RESPONSE),
                tokenize_example(tokenizer, MESSAGES, "<answer> \\boxed{1} </answer>")]
    target = torch.tensor(examples[0].input_ids)

    class Copier(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            logits = torch.zeros(*input_ids.shape, len(tokenizer))
            steps = min(input_ids.shape[1] - 1, len(target) - 1)
            logits[:, torch.arange(steps), target[1:steps + 1]] = 1.0
            return type("Out", (), {"logits": logits})()

    model = Copier().train()
    assert exact_match_share(model, examples, tokenizer.pad_token_id) == 0.5
    assert exact_match_share(model, examples[:1], tokenizer.pad_token_id, batch_size=1) == 1.0
    assert model.training  # left as it was
    with pytest.raises(ValueError, match="no examples"):
        exact_match_share(model, [])


def test_score_reached_starts_the_decay_and_ends_the_run_early(tokenizer, task, demos, monkeypatch):
    """The schedule's logic with scripted scores (0, 0, then 0.5 from step 15): the decay starts at
    the first score at or above decay_at_score and the run ends decay_steps later; below it, the
    decay runs at steps - decay_steps and every step is taken."""
    import aepo_engine.sft as sft

    examples = build_examples(tokenizer, [q.messages() for q in task.train], demos, max_length=256)
    config = SFTConfig(steps=40, batch_size=8, lr=1e-2, warmup_steps=2, seed=5, decay_steps=10,
                       val_questions=4, score_every=5, decay_at_score=0.4)
    for final, expected in ((0.5, (15, 25)), (0.3, (30, 40))):
        scores = iter([0.0, 0.0] + [final] * 20)
        monkeypatch.setattr(sft, "exact_match_share", lambda *args, **kwargs: next(scores))
        log: list[dict] = []
        result = train_sft(_tiny_model(tokenizer), examples, config, log=log.append,
                           pad_id=tokenizer.pad_token_id, val_examples=examples[:4])
        assert (result["decay_start"], result["steps"]) == expected and len(log) == expected[1]
        assert [row["step"] + 1 for row in log if "val_exact" in row][:3] == [5, 10, 15]
        start = expected[0]
        assert log[start - 1]["lr"] == pytest.approx(1e-2) and log[start + 5]["lr"] == pytest.approx(5.5e-3)
        assert log[-1]["lr"] == pytest.approx(learning_rate(expected[1] - 1, config, start))
        assert result["val_exact"] == final
    with pytest.raises(ValueError, match="needs val_examples"):
        train_sft(_tiny_model(tokenizer), examples, config, pad_id=tokenizer.pad_token_id)
