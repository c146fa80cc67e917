"""fused_linear_logprob_entropy / fused_linear_aepo_policy_loss against the logits-level path."""
import pytest
import torch

from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy
from aepo_kernels.reference import logprob_entropy_reference


def _inputs(n, d, vocab, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5 * 3).to(dtype)
    bias = torch.randn(vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    return hidden, weight, bias, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_chunk,vocab_chunk", [(16, 300), (7, 1000), (64, 4096)])
def test_matches_materialised_logits(dtype, token_chunk, vocab_chunk):
    hidden, weight, bias, labels = _inputs(45, 24, 1003, dtype, seed=token_chunk)
    # upstream gradients from a seeded generator: torch's global one is wherever the tests before
    # this one on the worker left it, and the bf16 error relative to the largest gradient moves
    # with them (2.1-3.3% over 40 draws, the materialised head's as much as the fused path's)
    gen = torch.Generator().manual_seed(token_chunk)
    g_lp, g_h = torch.randn(45, generator=gen), torch.randn(45, generator=gen)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        logp, ent = fn(*leaves)
        (logp * g_lp + ent * g_h).sum().backward()
        return logp.detach(), ent.detach(), [t.grad.float() for t in leaves]

    got = grads(lambda h, w, b: fused_linear_logprob_entropy(
        h, w, labels, 0.8, bias=b, token_chunk=token_chunk, vocab_chunk=vocab_chunk, shift_labels=False))
    # The oracle: the logits a head in the inputs' dtype computes (nn.Linear: the fused matmuls run
    # in that dtype too), materialised, then the plain fp32 log_softmax reference.
    ref = grads(lambda h, w, b: logprob_entropy_reference(torch.nn.functional.linear(h, w, b).float(), labels, 0.8))
    torch.testing.assert_close(got[0], ref[0], atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], ref[1], atol=5e-5, rtol=1e-5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for g, r in zip(got[2], ref[2]):
        torch.testing.assert_close(g, r, **tol)
    if dtype == torch.bfloat16:  # and as close to fp32 maths on the same inputs as the bf16 head is
        exact = grads(lambda h, w, b: logprob_entropy_reference(h.float() @ w.float().T + b.float(), labels, 0.8))
        for value, want in zip(got[:2], exact[:2]):
            torch.testing.assert_close(value, want, atol=0.1, rtol=2e-2)
        # The CPU bf16 path accumulates d_weight / d_hidden in fp32 across chunks, each chunk's
        # GEMM product rounded once to bf16 (fused_linear.addmm_accumulate); its error against
        # fp32 maths is the bf16 inputs' (at most 1.33x the materialised bf16 head's over 40 draws)
        for g, m, r in zip(got[2], ref[2], exact[2]):
            assert (g - r).abs().max() <= 2 * (m - r).abs().max() + 1e-3 * r.abs().max()
            assert (g - r).abs().max() <= 5e-2 * r.abs().max()


def test_float64_gradcheck_hidden_weight_bias():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(13, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5), generator=gen)
    labels[0, 0] = -100
    fn = lambda h, w, b: fused_linear_logprob_entropy(h, w, labels, 1.4, bias=b, token_chunk=3, vocab_chunk=5, shift_labels=False)
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_loss_matches_logits_level_loss():
    hidden, weight, _, labels = _inputs(32, 16, 517, torch.float32, seed=3)
    labels = labels.clamp(min=0).reshape(4, 8)
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 8, generator=gen) * 6
    adv = torch.randn(4, generator=gen)
    mask = (torch.rand(4, 8, generator=gen) > 0.2).float()
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    h1, w1, h2, w2 = (t.clone().requires_grad_() for t in (hidden, weight, hidden, weight))
    loss, stats = fused_linear_aepo_policy_loss(h1.reshape(4, 8, 16), w1, labels, old, adv, mask, config=cfg, token_chunk=5, vocab_chunk=100, shift_labels=False)
    ref, ref_stats = aepo_policy_loss((h2 @ w2.T).reshape(4, 8, -1), labels, old, adv, mask, config=cfg, backend="reference", shift_labels=False)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["entropy"], ref_stats["entropy"])
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_the_logits_block_is_sized_from_free_memory_on_cuda(monkeypatch):
    """Issue 35, point 9: 192 MiB blocks on a GPU are ~662 bf16 rows of Qwen3's 151,936-token
    vocabulary, so a 16K-token micro-batch read-modify-wrote the 2.9 GiB fp32 weight-gradient
    accumulator 25 times. On CUDA the budget is an eighth of the free memory within 192 MiB-2 GiB
    (a recorded fake of ``torch.cuda.mem_get_info``); elsewhere, and when given, it is unchanged."""
    import math

    from aepo_kernels import fused_linear
    from aepo_kernels.fused_linear import CUDA_CHUNK_BYTES_MAX, DEFAULT_CHUNK_BYTES, chunk_bytes_for, token_chunk_for_budget

    cuda, gib = torch.device("cuda", 3), 1 << 30
    asked, free = [], {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (free["bytes"], 80 * gib))
    for free_gib, budget in ((40, CUDA_CHUNK_BYTES_MAX), (12, 1.5 * gib), (8, gib), (1, DEFAULT_CHUNK_BYTES)):
        free["bytes"] = free_gib * gib
        assert chunk_bytes_for(cuda) == budget, free_gib
    assert asked == [cuda] * 4
    free["bytes"] = 40 * gib
    rows = token_chunk_for_budget(151936, chunk_bytes_for(cuda), element_size=2)
    assert rows == 7067 and math.ceil(16384 / rows) == 3  # d_W passes of a 16K-token micro-batch (was 25)
    assert chunk_bytes_for(torch.device("cpu")) == DEFAULT_CHUNK_BYTES
    assert chunk_bytes_for(cuda, 64 << 20) == 64 << 20 and len(asked) == 5  # a given budget: nothing asked

    # the public loss resolves its default (None) on the device of its hidden states (through
    # fused_linear.head_call, which the flat and the tree loss share; CPU: the token-outer order)
    resolved = []
    monkeypatch.setattr(fused_linear, "chunk_bytes_for", lambda device, budget: resolved.append((device, budget)) or (1 << 20))
    hidden, weight, _, labels = _inputs(9, 8, 50, torch.float32, seed=1)
    fused_linear_aepo_policy_loss(hidden, weight, labels, torch.full((9,), -3.0), torch.ones(9), torch.ones(9),
                                  shift_labels=False)
    # resolved once from None; the calls below head_call pass the resolved budget on unchanged
    assert resolved[0] == (torch.device("cpu"), None)
    assert set(resolved[1:]) <= {(torch.device("cpu"), 1 << 20)}
