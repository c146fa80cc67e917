"""logprob_entropy: every backend against the fp32 reference, gradchecks, in-place backward."""
import pytest
import torch

from aepo_kernels import logprob_entropy
from aepo_kernels.reference import logprob_entropy_reference

from conftest import backend_params, triton_available

BACKENDS = ["torch"] + (["triton"] if triton_available() else [])
# bf16 gradients: the reference rounds its fp32 gradient to bf16 once; the Triton interpreter
# truncates instead of rounding, so allow one bf16 ulp (2^-7 relative).
GRAD_TOL = {torch.float32: dict(atol=2e-6, rtol=1e-4), torch.bfloat16: dict(atol=1e-4, rtol=2 ** -7 * 1.01)}


def _inputs(shape, vocab, dtype, seed, ignore_frac=0.2):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignore_frac] = -100  # masked rows
    return logits, labels


def _run(logits, labels, temperature, backend, g_lp, g_h, **kw):
    leaf = logits.clone().requires_grad_()
    if backend == "reference":
        logp, entropy = logprob_entropy_reference(leaf, labels, temperature)
    else:
        logp, entropy = logprob_entropy(leaf, labels, temperature, backend=backend, shift_labels=False, **kw)
    (logp * g_lp + entropy * g_h).sum().backward()
    return logp.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,vocab,temperature", [((7,), 1000, 1.0), ((2, 5), 32003, 0.7), ((3,), 151936, 1.3)])
def test_matches_reference(backend, dtype, shape, vocab, temperature):
    logits, labels = _inputs(shape, vocab, dtype, seed=vocab + len(shape))
    gen = torch.Generator().manual_seed(1)
    g_lp, g_h = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    logp, ent, grad = _run(logits, labels, temperature, backend, g_lp, g_h)
    logp_ref, ent_ref, grad_ref = _run(logits, labels, temperature, "reference", g_lp, g_h)
    assert logp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    # float32 sums over up to 151,936 logits in blocks: 1.3e-5 relative on one log-prob on an
    # AVX2-only CPU (the interpreter's numpy reductions), over a 1e-5 bound
    torch.testing.assert_close(logp, logp_ref, atol=2e-5, rtol=3e-5)
    torch.testing.assert_close(ent, ent_ref, atol=2e-5, rtol=3e-5)
    assert (logp[labels == -100] == 0).all()
    torch.testing.assert_close(grad.float(), grad_ref.float(), **GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_strided_token_dim_and_in_place_backward(backend):
    # logits[:, :-1] of a [B, T, V] tensor: a non-contiguous token dim, never copied.
    logits, labels = _inputs((3, 9), 777, torch.float32, seed=3, ignore_frac=0.0)
    g_lp, g_h = torch.randn(3, 8), torch.randn(3, 8)
    expected = _run(logits[:, :-1], labels[:, :-1], 0.9, "reference", g_lp, g_h)

    full = logits.clone().requires_grad_()
    logp, ent = logprob_entropy(full[:, :-1], labels[:, :-1], 0.9, backend=backend, shift_labels=False)
    (logp * g_lp + ent * g_h).sum().backward()
    torch.testing.assert_close(full.grad[:, :-1], expected[2], atol=2e-6, rtol=1e-4)
    assert (full.grad[:, -1] == 0).all()

    # In-place: the logits buffer (a non-leaf here, as in a model) receives dlogits.
    base = logits.clone().requires_grad_()
    produced = base * 1.0
    logp, ent = logprob_entropy(produced, labels, 0.9, backend=backend, inplace_backward=True, shift_labels=False)
    (logp[:, :-1] * g_lp + ent[:, :-1] * g_h).sum().backward()
    torch.testing.assert_close(base.grad[:, :-1], expected[2], atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(produced.detach()[:, :-1], expected[2], atol=2e-6, rtol=1e-4)


def test_in_place_backward_is_safe_with_other_users_of_the_logits():
    logits, labels = _inputs((4,), 50, torch.float32, seed=4, ignore_frac=0.0)

    def grads(inplace, other_first):
        leaf = logits.clone().requires_grad_()
        produced = leaf * 2.0
        if other_first:  # its backward runs after ours, reading the saved `produced`
            other = (produced * produced).sum()
        logp, _ = logprob_entropy(produced, labels, backend="torch", inplace_backward=inplace, shift_labels=False)
        if not other_first:  # its backward runs before ours, while `produced` is intact
            other = (produced * produced).sum()
        (logp.sum() + other).backward()
        return leaf.grad

    # Our backward runs last: in place is harmless and the gradient is exact.
    torch.testing.assert_close(grads(True, other_first=False), grads(False, other_first=False))
    # Our backward would overwrite a tensor another node still needs: a loud error, not garbage.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads(True, other_first=True)


def test_float64_gradcheck_logprob_and_entropy():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    labels[1, 2] = -100
    for temperature in (1.0, 0.6):
        # Both outputs are checked: the entropy gradient is part of the contract.
        assert torch.autograd.gradcheck(lambda z: logprob_entropy(z, labels, temperature, backend="torch", shift_labels=False), (logits,))
        assert torch.autograd.gradcheck(lambda z: logprob_entropy(z, labels, temperature, backend="torch", shift_labels=False)[1].sum(), (logits,))


def test_entropy_hand_worked():
    # Uniform over 4 tokens: H = log 4, log p = -log 4, for any temperature.
    logits = torch.zeros(1, 4)
    logp, ent = logprob_entropy(logits, torch.tensor([2]), 0.5, backend="torch", shift_labels=False)
    torch.testing.assert_close(ent, torch.tensor([1.3862944]))
    torch.testing.assert_close(logp, torch.tensor([-1.3862944]))
    # Two tokens with logits (0, log 3) at T=1: p = (1/4, 3/4), H = -(.25 ln .25 + .75 ln .75) = 0.5623351.
    logp, ent = logprob_entropy(torch.tensor([[0.0, 1.0986123]]), torch.tensor([1]), backend="torch", shift_labels=False)
    torch.testing.assert_close(ent, torch.tensor([0.5623351]))
    torch.testing.assert_close(logp, torch.tensor([-0.2876821]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        logprob_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0.0, shift_labels=False)
    with pytest.raises(ValueError, match="backend"):
        logprob_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), backend="cuda", shift_labels=False)
    with pytest.raises(ValueError, match="leading dims"):
        logprob_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), shift_labels=False)


def test_eager_fallback_matches_compiled(monkeypatch):
    """The CPU path without torch.compile (AEPO_TORCH_COMPILE=0, or no compiler) is the same maths."""
    from aepo_kernels import logits_ops

    logits, labels = _inputs((2, 6), 301, torch.float32, seed=6)
    g_lp, g_h = torch.randn(2, 6), torch.randn(2, 6)
    compiled = _run(logits, labels, 0.8, "torch", g_lp, g_h, inplace_backward=True)
    for name in ("chunk_stats", "chunk_grad_into", "chunk_grad_inplace"):
        monkeypatch.setattr(logits_ops, f"fast_{name}", getattr(logits_ops, name))
    for inplace in (False, True):
        eager = _run(logits, labels, 0.8, "torch", g_lp, g_h, inplace_backward=inplace)
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cpu_chunk_policy_and_chunk_boundaries(monkeypatch):
    """Compiled: one chunk per sequence; eager: 16 MiB chunks; AEPO_CPU_CHUNK_ELEMS overrides both.
    2-row chunks of 7-row sequences (a 1-row tail) give the same values and gradients as whole ones."""
    from aepo_kernels import logits_ops

    monkeypatch.delenv("AEPO_CPU_CHUNK_ELEMS", raising=False)
    assert logits_ops.cpu_chunk_elems() is None
    monkeypatch.setenv("AEPO_TORCH_COMPILE", "0")
    assert logits_ops.cpu_chunk_elems() == logits_ops._EAGER_CHUNK_ELEMS
    monkeypatch.delenv("AEPO_TORCH_COMPILE")
    for bad in ("0", "-5", "1e6", "lots"):
        monkeypatch.setenv("AEPO_CPU_CHUNK_ELEMS", bad)
        with pytest.raises(ValueError, match="AEPO_CPU_CHUNK_ELEMS"):
            logits_ops.cpu_chunk_elems()
    monkeypatch.delenv("AEPO_CPU_CHUNK_ELEMS")
    logits, labels = _inputs((3, 7), 503, torch.float32, seed=9)
    g_lp, g_h = torch.randn(3, 7), torch.randn(3, 7)
    whole = _run(logits, labels, 1.1, "torch", g_lp, g_h, inplace_backward=True)
    monkeypatch.setenv("AEPO_CPU_CHUNK_ELEMS", str(2 * 503))
    assert list(logits_ops._row_chunks(logits))[:4] == [(0, slice(0, 2)), (0, slice(2, 4)), (0, slice(4, 6)), (0, slice(6, 8))]
    for inplace in (False, True):
        chunked = _run(logits, labels, 1.1, "torch", g_lp, g_h, inplace_backward=inplace)
        for a, b in zip(whole, chunked):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
