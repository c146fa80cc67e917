"""``policy.attn_implementation = "varlen"`` (issue 35, point 4): packed rows through torch's own
FlashAttention varlen kernel (``torch.nn.attention.varlen.varlen_attn``) on CUDA, row-by-row SDPA
elsewhere, registered with transformers' attention interface (``aepo_engine.training.attention``).

On CPU: the attention function against SDPA with the packed row's block-diagonal causal mask
(float64, grouped-query heads, rows of odd lengths, gradients too); the CUDA branch with recording
fakes of ``varlen_attn`` of two signatures (torch 2.13's and 2.10's), each computing varlen
attention its own way; the policy worker packed with "varlen" against padded sdpa; the paper
preset, which now uses it, dry-runs without flash-attn installed.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from test_policy_worker import make_worker, params, random_batch, relative_delta_gap, vocab_of, with_old_policy

from aepo_engine.training import PolicyConfig, attention
from aepo_engine.training.attention import packed_rows, varlen_attention_forward


def _packed(lengths: list[list[int]], heads: int = 4, kv_heads: int = 2, dim: int = 16, dtype=torch.float64, seed=0):
    """q ``[B, H, L, D]``, k/v ``[B, Hkv, L, D]`` and position ids ``[B, L]`` of batch rows each
    holding packed rows of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    length = sum(lengths[0])
    assert all(sum(row) == length for row in lengths)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    q = torch.randn(len(lengths), heads, length, dim, generator=gen, dtype=dtype)
    k, v = (torch.randn(len(lengths), kv_heads, length, dim, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, v, positions


def _block_diagonal_sdpa(q, k, v, positions, scale):
    """The reference: SDPA over each batch row with the mask ``same packed row and causal``."""
    row = (positions == 0).cumsum(-1)  # [B, L]: the packed row of each token
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    mask = (row[:, :, None] == row[:, None, :]) & causal  # [B, L, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [B, L, H, D]


class Module:
    """What the attention function reads of an attention layer (nothing)."""


@pytest.mark.parametrize("lengths", [[[5, 1, 9, 3]], [[7, 4], [2, 9]], [[11]]])
def test_matches_sdpa_with_the_block_diagonal_mask(lengths):
    q, k, v, positions = _packed(lengths)
    scale = 0.3
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = varlen_attention_forward(Module(), *leaves, None, scaling=scale, position_ids=positions)
    ref = _block_diagonal_sdpa(*ref_leaves, positions, scale)
    assert weights is None and out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)


def test_packed_rows_start_at_every_position_zero_and_every_batch_row():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1], [1, 2, 0, 1, 2, 3]])  # row 2 starts mid-sequence
    cu, longest = packed_rows(positions, 2, 6)
    assert cu.tolist() == [0, 3, 4, 6, 8, 12] and longest == 4 and cu.dtype == torch.int32
    cu, longest = packed_rows(None, 3, 5)
    assert cu.tolist() == [0, 5, 10, 15] and longest == 5


def _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, calls, **kwargs):
    """varlen attention computed its own way: an explicit softmax over each row's causal scores."""
    calls.append(dict(kwargs, cu=cu_seq_q.tolist(), max_q=max_q, max_k=max_k, heads=(query.shape[1], key.shape[1])))
    if kwargs.get("enable_gqa"):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    assert key.shape[1] == query.shape[1], "GQA without enable_gqa"
    scale = kwargs.get("scale") or query.shape[-1] ** -0.5
    out = torch.empty_like(query)
    bounds = cu_seq_q.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", query[s:e], key[s:e]) * scale
        scores = scores.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), -math.inf)
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[s:e])
    return out


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size == (-1, 0)  # causal
    return _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, CALLS, scale=scale,
                             enable_gqa=enable_gqa)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert is_causal
    return _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, CALLS)


CALLS: list = []


@pytest.mark.parametrize("fake", [varlen_attn_2_13, varlen_attn_2_10])
def test_the_cuda_branch_calls_torchs_varlen_kernel_right(fake, monkeypatch):
    """Recording fakes of ``varlen_attn`` (torch 2.13's signature, and 2.10's: no scale, no
    enable_gqa, ``is_causal``), with the CUDA branch forced: the packed rows, the longest row,
    causality, the scale and grouped-query heads reach the kernel; the output is the reference's."""
    import torch.nn.attention.varlen as varlen

    CALLS.clear()
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(attention, "_uses_varlen", lambda query: True)
    attention._varlen_kwargs.cache_clear()
    try:
        q, k, v, positions = _packed([[6, 2, 5]])
        out, _ = varlen_attention_forward(Module(), q, k, v, None, scaling=0.2, position_ids=positions)
    finally:
        attention._varlen_kwargs.cache_clear()
    torch.testing.assert_close(out, _block_diagonal_sdpa(q, k, v, positions, 0.2), rtol=1e-12, atol=1e-12)
    (call,) = CALLS
    assert call["cu"] == [0, 6, 8, 13] and call["max_q"] == call["max_k"] == 6
    if fake is varlen_attn_2_13:
        assert call["enable_gqa"] and call["heads"] == (4, 2) and call["scale"] == 0.2
    else:  # heads repeated, scale folded into the queries
        assert call["heads"] == (4, 4)


def test_under_autocast_the_kernel_sees_the_compute_dtype(monkeypatch):
    """GPU review 2, point 6: under autocast Qwen3's q/k norms hand back fp32 queries and keys
    (fp32 norm weights) beside bf16 values, so the varlen kernel (half precision only) was never
    chosen on one GPU. The attention now casts them to autocast's dtype; here on CPU the dtype
    the kernel choice sees is recorded, and the output is close to the fp32 reference."""
    seen = []
    monkeypatch.setattr(attention, "_uses_varlen", lambda query: seen.append(query.dtype) or False)
    q, k, v, positions = _packed([[5, 3]], dtype=torch.float32)
    before = dict(attention.KERNEL_CALLS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention_forward(Module(), q, k, v.bfloat16(), None, position_ids=positions)
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    assert attention.KERNEL_CALLS["sdpa_rows"] == before.get("sdpa_rows", 0) + 1
    reference = _block_diagonal_sdpa(q, k, v.bfloat16().float(), positions, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)
    out, _ = varlen_attention_forward(Module(), q, k, v, None, position_ids=positions)  # no autocast: as given
    assert seen[-1] == torch.float32 and out.dtype == torch.float32


def test_the_rows_bounds_are_found_once_per_micro_batch_not_per_layer(tiny_model, monkeypatch):
    """GPU review 2, point 8: each layer's call found the packed rows again from the position ids
    (two host syncs a layer). The worker now hands the bounds down once per micro-batch
    (``packed_row_kwargs``, transformers' flash-attention keyword names); the attention uses them
    and the log-probs are unchanged."""
    batch = random_batch(vocab_of(tiny_model))
    packed = make_worker(tiny_model, attn_implementation="varlen", micro_batch_size=3)
    reference = packed.compute_logprobs(batch)
    found, bounds, original = [], [], attention.packed_rows
    monkeypatch.setattr(attention, "packed_rows", lambda *a: found.append(a) or original(*a))
    forward = attention.varlen_attention_forward

    def recording(*args, **kwargs):
        bounds.append(kwargs.get("cu_seq_lens_q"))
        return forward(*args, **kwargs)

    from transformers import AttentionInterface
    monkeypatch.setitem(AttentionInterface._global_mapping, attention.VARLEN, recording)
    lp, h = packed.compute_logprobs(batch)
    layers = packed.model.config.num_hidden_layers
    assert not found and bounds and len(bounds) % layers == 0 and all(b is not None for b in bounds)
    per_micro_batch = [bounds[i:i + layers] for i in range(0, len(bounds), layers)]
    assert len(per_micro_batch) > 1 and all(all(b is calls[0] for b in calls) for calls in per_micro_batch)
    torch.testing.assert_close(lp, reference[0], rtol=0, atol=0)
    torch.testing.assert_close(h, reference[1], rtol=0, atol=0)
    kwargs = attention.packed_row_kwargs(torch.tensor([3, 0, 5, 1]))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 8, 9] and kwargs["max_length_q"] == 5
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]


def test_padding_masks_dropout_and_windows_are_refused():
    q, k, v, positions = _packed([[4]])
    with pytest.raises(ValueError, match="pack_sequences"):
        varlen_attention_forward(Module(), q, k, v, torch.ones(1, 1, 4, 4), position_ids=positions)
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention_forward(Module(), q, k, v, None, dropout=0.1, position_ids=positions)
    with pytest.raises(ValueError, match="varlen"):
        PolicyConfig(attn_implementation="varlen", pack_sequences="off")
    assert PolicyConfig(attn_implementation="varlen").packs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from aepo_engine.models import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("varlen_qwen3"), vocab_size=300, hidden_size=64,
                            intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=32, initializer_range=0.3)


def test_the_worker_packed_with_varlen_matches_padded_sdpa(tiny_model):
    batch = random_batch(vocab_of(tiny_model))
    padded = make_worker(tiny_model, attn_implementation="sdpa", pack_sequences="off", micro_batch_size=3)
    packed = make_worker(tiny_model, attn_implementation="varlen", micro_batch_size=3)
    assert packed.policy.pack and packed.model.config._attn_implementation == attention.VARLEN
    (lp_pad, h_pad), (lp_pack, h_pack) = padded.compute_logprobs(batch), packed.compute_logprobs(batch)
    torch.testing.assert_close(lp_pack, lp_pad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_pack, h_pad, rtol=1e-5, atol=1e-5)
    updated = {}
    for name, worker in (("padded", padded), ("packed", packed)):
        before = params(worker)
        metrics = worker.update(with_old_policy(worker, batch))
        updated[name] = (before, params(worker), metrics)
    before, plain, m_plain = updated["padded"]
    _, pack, m_pack = updated["packed"]
    assert relative_delta_gap(before, plain, pack) < 2e-5
    assert m_pack["loss"] == pytest.approx(m_plain["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed here")
def test_the_paper_preset_dry_runs_without_flash_attn(tiny_model, tmp_path):
    from runs import run_main

    from aepo_engine.train import main

    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "What is 1?", "answer": "1"}\n')
    proc = run_main(main, ["--preset", "qwen3_14b_deep_research", f"--model.path={tiny_model}",
                           f"--data.train_files={data}", "--tools.search.backend=corpus",
                           f"--tools.search.corpus_path={tmp_path / 'none.jsonl'}", "--dry-run"])
    assert 'attn_implementation = "varlen"' in proc.stdout
    problems = [line for line in proc.stderr.splitlines() if line.startswith("problem: ")]
    assert not [p for p in problems if "flash" in p or "attn_implementation" in p], problems
