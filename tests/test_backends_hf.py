"""HFBackend on a tiny Qwen3: finish reasons, exact logprobs/entropies, seeds, batching, weight push, prefix reuse."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from aepo_engine.models import build_tiny_qwen3
from aepo_engine.rollout.backends.hf import HFBackend, PrefixStore, sampling_logprobs
from aepo_engine.rollout.protocol import GenRequest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("hf") / "model", seed=0)


@pytest.fixture(scope="module")
def backend(model_dir):
    return HFBackend(model_dir, max_batch_size=8)


def _prompt(tok, text: str) -> tuple[int, ...]:
    msgs = [{"role": "user", "content": text}]
    return tuple(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])


def _recompute(model, prompt, tokens, temperature, top_p=1.0):
    """Sampling-distribution log-probs [T, V] from one full forward pass (no cache, no padding)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.stack([sampling_logprobs(row, temperature, top_p) for row in logits])


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_logprobs_and_entropy_match_full_forward(backend, temperature, top_p):
    tok = backend.tokenizer
    prompts = [_prompt(tok, t) for t in ("hello", "a much longer question about France and Paris?", "x")]
    reqs = [GenRequest(p, 20, seed=i, temperature=temperature, top_p=top_p) for i, p in enumerate(prompts)]
    for req, out in zip(reqs, backend.generate(reqs)):
        logp = _recompute(backend.model, req.prompt_ids, out.token_ids, temperature, top_p)  # [T, V]
        picked = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), picked, atol=1e-4, rtol=0)
        entropy = -(logp.exp() * logp.clamp(min=-1e30)).sum(-1)
        torch.testing.assert_close(torch.tensor(out.entropies), entropy, atol=1e-4, rtol=0)
        assert torch.isfinite(picked).all()  # every sampled token lies inside the nucleus
        if top_p < 1:  # truncation removes mass: entropy below the untruncated one
            full = _recompute(backend.model, req.prompt_ids, out.token_ids, temperature)
            assert bool((entropy <= -(full.exp() * full).sum(-1) + 1e-5).all())


@pytest.mark.slow
def test_length_and_determinism_and_batch_invariance(backend):
    tok = backend.tokenizer
    prompts = [_prompt(tok, t) for t in ("one", "two words here", "three is a longer prompt than the others")]
    reqs = [GenRequest(p, 16, seed=100 + i) for i, p in enumerate(prompts)]
    batched = backend.generate(reqs)
    again = backend.generate(reqs)
    alone = [backend.generate([r])[0] for r in reqs]
    for a, b, c in zip(batched, again, alone):
        assert a.token_ids == b.token_ids == c.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(c.logprobs), atol=1e-5, rtol=0)
        if a.finish_reason == "length":
            assert len(a.token_ids) == 16
    assert any(o.finish_reason == "length" for o in batched)
    other_seed = backend.generate([GenRequest(prompts[0], 16, seed=999)])[0]
    assert other_seed.token_ids != batched[0].token_ids
    # max_batch_size=2 splits the same requests into two forward batches: same tokens
    small = HFBackend(backend.model, backend.tokenizer, max_batch_size=2).generate(reqs)
    assert [o.token_ids for o in small] == [o.token_ids for o in batched]


def test_stop_string_ends_generation_and_is_included(backend):
    tok = backend.tokenizer
    req = GenRequest(_prompt(tok, "search something"), 40, seed=5)
    full = backend.generate([req])[0]
    stop = tok.decode(full.token_ids[6:8])  # a string the same seed is known to produce
    out = backend.generate([GenRequest(req.prompt_ids, 40, ("never-appears", stop), seed=5)])[0]
    assert out.finish_reason == "stop" and out.stop_string == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) <= 8
    assert tok.decode(out.token_ids).endswith(stop) or stop in tok.decode(out.token_ids[-2:])


def test_tag_stop_string(backend):
    """An agent tag as the stop string (one added token): find a seed whose sample contains a tag."""
    from aepo_engine.models import AGENT_TAGS

    tok = backend.tokenizer
    tag_ids = {tok.convert_tokens_to_ids(t): t for t in AGENT_TAGS}
    prompt = _prompt(tok, "go")
    for seed in range(40):
        full = backend.generate([GenRequest(prompt, 40, seed=seed)])[0]
        hits = [i for i, t in enumerate(full.token_ids) if t in tag_ids]
        if hits and full.finish_reason == "length":
            break
    else:
        pytest.fail("no sample with a tag in 40 seeds")
    tag = tag_ids[full.token_ids[hits[0]]]
    out = backend.generate([GenRequest(prompt, 40, (tag,), seed=seed)])[0]
    assert out.finish_reason == "stop" and out.stop_string == tag
    assert out.token_ids == full.token_ids[: hits[0] + 1] and out.text.endswith(tag)


def test_eos(model_dir):
    """A second EOS id (as real checkpoints have) taken from a known sample ends generation there."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reqs = [GenRequest(_prompt(tok, "hi"), 20, seed=s) for s in range(8)]
    full, req = next((o, r) for o, r in zip(HFBackend(model, tok).generate(reqs), reqs) if o.finish_reason == "length")
    extra_eos = full.token_ids[4]
    model.generation_config.eos_token_id = [tok.eos_token_id, extra_eos]
    backend = HFBackend(model, tok)
    assert set(backend.eos_token_ids) == {tok.eos_token_id, extra_eos}
    out = backend.generate([req])[0]
    assert out.finish_reason == "eos" and out.token_ids[-1] == extra_eos
    assert out.token_ids == full.token_ids[: full.token_ids.index(extra_eos) + 1]


def test_update_weights_changes_outputs(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = HFBackend(model_dir)
    reqs = [GenRequest(_prompt(tok, "hello"), 12, seed=s) for s in range(3)]
    before = backend.generate(reqs)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in backend.model.state_dict().items()}
    backend.update_weights(new)
    after = backend.generate(reqs)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    logp = _recompute(backend.model, reqs[0].prompt_ids, after[0].token_ids, 1.0)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    ref.load_state_dict(new)
    torch.testing.assert_close(logp, _recompute(ref, reqs[0].prompt_ids, after[0].token_ids, 1.0), atol=1e-5, rtol=0)
    with pytest.raises(KeyError):
        backend.update_weights({"not.a.param": torch.zeros(1)})


def test_greedy_and_zero_budget(backend):
    tok = backend.tokenizer
    p = _prompt(tok, "greedy")
    a, b = backend.generate([GenRequest(p, 8, seed=1, temperature=0), GenRequest(p, 8, seed=2, temperature=0)])
    assert a.token_ids == b.token_ids
    logp = _recompute(backend.model, p, a.token_ids, 1.0)
    assert a.token_ids == logp.argmax(-1).tolist()
    empty = backend.generate([GenRequest(p, 0)])[0]
    assert empty.token_ids == [] and empty.finish_reason == "length"


# --- prefix reuse -----------------------------------------------------------------------------
def _kv(length: int, layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer keys/values of ``length`` tokens, 2 heads x 4 dims of float32: 2 layers x 2
    tensors x 32 bytes = 128 bytes a token."""
    return [(torch.full((2, length, 4), fill, dtype=torch.float32), torch.full((2, length, 4), fill, dtype=torch.float32))
            for _ in range(layers)]


def test_prefix_store_longest_proper_prefix_and_lru_budget():
    store = PrefixStore(max_bytes=128 * 10)  # ten tokens' worth
    store.add((1, 2), _kv(2, fill=1))
    store.add((1, 2, 3, 4), _kv(4, fill=2))
    store.add((7,), _kv(1, fill=3))
    assert len(store) == 3 and store.bytes == 128 * 7
    n, kv = store.longest_prefix((1, 2, 3, 4, 5))
    assert n == 4 and float(kv[0][0][0, 0, 0]) == 2
    n, kv = store.longest_prefix((1, 2, 3))
    assert n == 2 and float(kv[1][1][0, 0, 0]) == 1
    n, kv = store.longest_prefix((1, 2, 3, 4))  # stored itself: all but the last token, to feed it
    assert n == 3 and kv[0][0].shape == (2, 3, 4) and float(kv[0][1][1, 2, 3]) == 2
    assert store.longest_prefix((1, 3)) == (0, None) and store.longest_prefix((7,)) == (0, None)
    assert (store.hits, store.misses, store.reused_tokens) == (3, 2, 9)
    store.longest_prefix((1, 2, 5))
    # (1, 2) was used last, (7,) is the oldest untouched entry, then (1, 2, 3, 4)
    store.add((9, 9, 9, 9), _kv(4))  # needs 1 more token of room: (7,) goes
    assert store.bytes == 128 * 10 and store.longest_prefix((7, 0)) == (0, None)
    store.add((5, 5), _kv(2))  # needs 2 more: (1, 2, 3, 4) goes, (1, 2) stays
    assert store.longest_prefix((1, 2, 3, 4, 5))[0] == 2 and store.bytes == 128 * 8
    store.add((8,) * 11, _kv(11))  # larger than the whole budget: not stored, nothing evicted
    assert len(store) == 3 and store.bytes == 128 * 8
    store.clear()
    assert len(store) == 0 and store.bytes == 0 and store.longest_prefix((1, 2, 3)) == (0, None)
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixStore(-1)


def _rounds(backend, prompts, rounds: int, tool_text: str, group: int = 1):
    """Multi-round requests as a rollout sends them: each round extends the previous context by
    the sampled tokens and a tool result; ``group`` requests per prompt share each context."""
    tok = backend.tokenizer
    suffix = tuple(tok(tool_text)["input_ids"])
    reqs = [GenRequest(p, 14, seed=10 * i + j, temperature=1.2) for i, p in enumerate(prompts) for j in range(group)]
    history = []
    for r in range(rounds):
        outs = backend.generate(reqs)
        history.append((reqs, outs))
        reqs = [GenRequest(q.prompt_ids + tuple(o.token_ids) + suffix, 14, seed=q.seed + 1000, temperature=1.2)
                for q, o in zip(reqs, outs)]
    return history


@pytest.mark.slow
def test_prefix_reuse_matches_full_recompute_over_rounds(model_dir):
    """Three rounds with reuse against a backend that re-prefills everything and against one full
    forward pass per request: same tokens, logprobs and entropies to float rounding, and most
    of the context of rounds 2-3 taken from the store."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    reuse = HFBackend(model, tok, max_batch_size=16)
    fresh = HFBackend(model, tok, max_batch_size=16, prefix_cache_gib=0)
    assert fresh.prefix_store.max_bytes == 0 and reuse.prefix_store.max_bytes == 2**30
    prompts = [_prompt(tok, t) for t in ("hello", "a much longer question about France and Paris?", "x")]
    a = _rounds(reuse, prompts, 3, "<result> 42 </result>", group=3)
    b = _rounds(fresh, prompts, 3, "<result> 42 </result>", group=3)
    assert len(fresh.prefix_store) == 0 and reuse.prefix_store.hits > 0
    later_context = sum(len(q.prompt_ids) for reqs, _ in a[1:] for q in reqs)
    assert reuse.prefix_store.reused_tokens > 0.6 * later_context
    for (reqs, outs), (_, ref_outs) in zip(a, b):
        for req, out, ref in zip(reqs, outs, ref_outs):
            assert out.token_ids == ref.token_ids
            torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=2e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(out.entropies), torch.tensor(ref.entropies), atol=2e-5, rtol=0)
    for req, out in zip(*a[-1]):  # the independent reference: one forward pass, no cache, no padding
        logp = _recompute(model, req.prompt_ids, out.token_ids, 1.2)
        picked = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), picked, atol=2e-5, rtol=0)
    # one batch mixing rows that reuse a long prefix, a stored context sent again (a branch), a
    # context never seen (no reuse: pads in front of all its new tokens) and a one-token prompt
    last_reqs, last_outs = a[-1]
    mixed = [GenRequest(last_reqs[0].prompt_ids + tuple(last_outs[0].token_ids), 10, seed=1),
             GenRequest(last_reqs[4].prompt_ids, 10, seed=2),
             GenRequest(_prompt(tok, "never seen before, and long enough to be the widest suffix"), 10, seed=3),
             GenRequest((5,), 10, seed=4)]
    hits = reuse.prefix_store.hits
    got, ref = reuse.generate(mixed), fresh.generate(mixed)
    assert reuse.prefix_store.hits == hits + 2
    for x, y in zip(got, ref):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0)


@pytest.mark.slow
def test_identical_contexts_prefill_once_and_sample_alone(backend):
    """Rows with the same context share one prefill row, yet each samples as it would alone."""
    tok = backend.tokenizer
    backend.clear_prefix_cache()
    p = _prompt(tok, "same context")
    reqs = [GenRequest(p, 12, seed=s) for s in range(5)] + [GenRequest(_prompt(tok, "other"), 12, seed=0)]
    batched = backend.generate(reqs)
    backend.clear_prefix_cache()
    alone = [backend.generate([r])[0] for r in reqs]
    assert len({tuple(o.token_ids) for o in batched[:5]}) > 1  # different seeds, different samples
    for x, y in zip(batched, alone):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0)


def test_weight_update_empties_the_store(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = HFBackend(model_dir)
    first = _rounds(backend, [_prompt(tok, "hello")], 1, "<result> 1 </result>")
    assert len(backend.prefix_store) > 0
    gen = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in backend.model.state_dict().items()}
    backend.load_weight_buckets([dict(list(new.items())[:3]), dict(list(new.items())[3:])])
    assert len(backend.prefix_store) == 0
    req, out = first[0][0][0], first[0][1][0]
    follow = GenRequest(req.prompt_ids + tuple(out.token_ids), 10, seed=3)
    got = backend.generate([follow])[0]  # nothing stale to reuse: computed with the new weights
    logp = _recompute(backend.model, follow.prompt_ids, got.token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(got.logprobs), logp.gather(-1, torch.tensor(got.token_ids)[:, None])[:, 0],
                               atol=2e-5, rtol=0)


def test_sliding_window_model_does_not_reuse(tmp_path):
    """A cache that is not plain full attention (here a sliding-window layer) keeps the store off."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                         sliding_window=4, max_window_layers=1,
                         layer_types=["full_attention", "sliding_attention"])
    tok = AutoTokenizer.from_pretrained(build_tiny_qwen3(tmp_path / "m", seed=0))
    backend = HFBackend(Qwen3ForCausalLM(config), tok)
    assert backend.prefix_store.max_bytes == 0
    out = backend.generate([GenRequest((1, 2, 3), 5, seed=0)])[0]
    assert len(out.token_ids) == 5 and len(backend.prefix_store) == 0


def test_stop_check_decoder_matches_the_tokenizer(backend):
    """The stop-string check decodes with the Rust tokenizer directly: same text as the tokenizer's
    own decode (special tokens included), on random ids and on every agent tag."""
    from aepo_engine.models import AGENT_TAGS

    tok = backend.tokenizer
    gen = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, len(tok), (int(n),), generator=gen).tolist()
               for n in torch.randint(0, 14, (300,), generator=gen)]
    samples += [[tok.convert_tokens_to_ids(t), 5, 6] for t in AGENT_TAGS] + [[tok.eos_token_id, 7]]
    for ids in samples:
        assert backend._decode_tail(ids) == tok.decode(ids, skip_special_tokens=False)
    for cleans, python_calls in ((False, 0), (True, 1)):  # space clean-up: keep the Python decode
        wrapped = _CountingTokenizer(tok, cleans)
        assert HFBackend(backend.model, wrapped)._decode_tail([5, 6]) == tok.decode([5, 6])
        assert wrapped.calls == python_calls


class _CountingTokenizer:
    """The test tokenizer with a chosen ``clean_up_tokenization_spaces``, counting its decodes."""

    def __init__(self, inner, clean_up_tokenization_spaces: bool):
        self._inner, self._tokenizer = inner, inner._tokenizer
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.pad_token_id, self.eos_token_id = inner.pad_token_id, inner.eos_token_id
        self.calls = 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        return self._inner.decode(ids, **kwargs)


def test_growing_layer_matches_dynamic_layer_and_writes_in_place():
    """Prefill, decode steps, a row drop and more steps: the same keys/values as HF's concatenating
    layer; the buffer is sized to the prefill plus the spare positions, and a step writes into it
    instead of copying the cache."""
    from transformers.cache_utils import DynamicLayer

    from aepo_engine.rollout.backends.hf import _GrowingLayer

    gen = torch.Generator().manual_seed(0)
    grow, ref = _GrowingLayer(spare=3), DynamicLayer()

    for rows, length in [(3, 5), (3, 1), (3, 1)]:  # a prefill of 5, two steps
        k, v = torch.randn(rows, 2, length, 4, generator=gen), torch.randn(rows, 2, length, 4, generator=gen)
        got, want = grow.update(k, v), ref.update(k, v)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    buffer = grow.keys.data_ptr()
    k, v = torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 4, generator=gen)
    grow.update(k, v), ref.update(k, v)
    assert grow.keys.data_ptr() == buffer and grow.get_seq_length() == ref.get_seq_length() == 8
    assert grow._buffers[0].shape[-2] == 8  # the prefill's 5 and the 3 spare positions, never grown
    keep = torch.tensor([2, 0])
    grow.batch_select_indices(keep), ref.batch_select_indices(keep)
    for _ in range(20):  # past the spare room: the buffer grows, the contents stay
        k, v = torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen)
        got, want = grow.update(k, v), ref.update(k, v)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    assert grow.get_seq_length() == 28


def test_list_prompts_are_accepted(backend):
    """Requests built with lists instead of tuples work as before (the store keys on tuples)."""
    p = _prompt(backend.tokenizer, "a list prompt")
    a = backend.generate([GenRequest(list(p), 6, seed=1), GenRequest(list(p), 6, seed=1)])
    b = backend.generate([GenRequest(p, 6, seed=1)])
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
