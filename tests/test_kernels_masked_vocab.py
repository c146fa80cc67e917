"""-inf logits (a masked or padded vocabulary) on every backend: rows whose leading block, last
block or all but one token are -inf, one -inf token, scattered -inf. Expected values are those of
the softmax over the finite support, computed in float64 from the finite logits only (a masked
token is simply absent there): log-prob of the finite label, entropy over the finite support,
gradient 0 on the -inf entries, everything finite.

V = 40,000 puts the -inf leading block across a whole Triton block (the interpreter's BLOCK_V is
32,768) and across the fused-linear path's first vocabulary chunks (16,384 columns)."""
import math

import pytest
import torch

from aepo_kernels import (
    LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy, logprob_entropy,
    policy_loss_from_logprobs,
)
from aepo_kernels.logits_ops import chunk_stats, merge_stats

from conftest import triton_available

VOCAB = 40000
NEG_INF = float("-inf")
LOGITS_BACKENDS = ["torch", "reference"] + (["triton"] if triton_available() else [])


def _masked_rows(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[6, V]`` logits and labels (on finite tokens, or -100):
    0: only tokens 33000 (z = 0) and 39000 (z = ln 3) finite: the first block is all -inf;
    1: -inf on the last Triton block [32768, V);  2: only the label finite;
    3: one -inf token;  4: 30% of the tokens -inf at random;  5: leading -inf and no target."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    labels = torch.empty(6, dtype=torch.long)
    logits[0] = NEG_INF
    logits[0, 33000], logits[0, 39000], labels[0] = 0.0, math.log(3.0), 39000
    logits[1, 32768:], labels[1] = NEG_INF, 1234
    logits[2], labels[2] = NEG_INF, 20000
    logits[2, 20000] = 1.5
    logits[3, 17], labels[3] = NEG_INF, 18
    scattered = torch.rand(VOCAB, generator=gen) < 0.3
    logits[4, scattered] = NEG_INF
    labels[4] = int(torch.nonzero(~scattered)[7])
    logits[5, :33000], labels[5] = NEG_INF, -100
    return logits.to(dtype), labels


def _finite_support(logits64, labels, temperature=1.0):
    """Per row, leaves of the finite logits only (float64) and ``(logp, H)`` of their softmax."""
    leaves, logps, entropies = [], [], []
    for row, label in zip(logits64, labels.tolist()):
        finite = torch.isfinite(row)
        leaf = row[finite].clone().requires_grad_()
        log_p = torch.log_softmax(leaf / temperature, -1)
        position = int(finite[:label].sum()) if label >= 0 else None  # the label's index among the finite
        logps.append(log_p[position] if position is not None else log_p.new_zeros(()))
        entropies.append(-(log_p.exp() * log_p).sum())
        leaves.append((finite, leaf))
    return leaves, torch.stack(logps), torch.stack(entropies)


def _scatter_grads(leaves, shape) -> torch.Tensor:
    grad = torch.zeros(shape, dtype=torch.float64)
    for i, (finite, leaf) in enumerate(leaves):
        grad[i, finite] = leaf.grad
    return grad


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=2 ** -7 * 1.01)


# ---------------------------------------------------------------------------------------------
# Log-probs and entropies (logits_ops: triton interpreter, compiled torch, reference).


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_hand_worked_row_with_a_masked_first_block(backend):
    """Row 0: p = (1/4, 3/4) on tokens 33000 and 39000. logp(39000) = ln 3/4 = -0.287682;
    H = ln 4 - (3/4) ln 3 = 0.562335. dlogp/dz = onehot - p: (-1/4, +1/4);
    dH/dz_j = -p_j (ln p_j + H): token 33000: -(1/4)(-1.386294 + 0.562335) = +0.205990, token
    39000: -0.205990; every other entry 0."""
    logits, labels = _masked_rows(torch.float32)
    for g_lp, g_h, expected in ((1.0, 0.0, (-0.25, 0.25)), (0.0, 1.0, (0.205990, -0.205990))):
        leaf = logits[:1].clone().requires_grad_()
        logp, entropy = logprob_entropy(leaf, labels[:1], backend=backend, shift_labels=False)
        (g_lp * logp + g_h * entropy).sum().backward()
        assert logp.item() == pytest.approx(math.log(0.75), abs=1e-6)
        assert entropy.item() == pytest.approx(math.log(4) - 0.75 * math.log(3), abs=1e-6)
        grad = leaf.grad[0]
        assert grad[33000].item() == pytest.approx(expected[0], abs=1e-6)
        assert grad[39000].item() == pytest.approx(expected[1], abs=1e-6)
        others = torch.ones(VOCAB, dtype=torch.bool)
        others[[33000, 39000]] = False
        assert (grad[others] == 0).all()


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_entropy_over_the_finite_support(backend, dtype):
    logits, labels = _masked_rows(dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    g_lp, g_h = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    leaf = logits.clone().requires_grad_()
    logp, entropy = logprob_entropy(leaf, labels, 0.8, backend=backend, shift_labels=False)
    (logp * g_lp + entropy * g_h).sum().backward()
    leaves, logp64, entropy64 = _finite_support(logits.double(), labels, 0.8)
    (logp64 * g_lp.double() + entropy64 * g_h.double()).sum().backward()
    grad64 = _scatter_grads(leaves, logits.shape)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all() and torch.isfinite(leaf.grad).all()
    torch.testing.assert_close(logp.double(), logp64.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), entropy64.detach(), atol=2e-5, rtol=1e-5)
    assert logp[2] == 0 and entropy[2].abs() < 1e-6  # one finite token: p = 1
    assert (leaf.grad[~torch.isfinite(logits)] == 0).all()
    torch.testing.assert_close(leaf.grad.double(), grad64, **_tol(dtype))


@pytest.mark.parametrize("backend", LOGITS_BACKENDS)
def test_soft_cap_maps_minus_inf_to_the_floor(backend):
    """With a soft cap c, -inf maps to -c: a finite logit of the capped model, gradient 0
    (d tanh = 1 - tanh^2 = 0). Expected: float64 autograd of c tanh(z / c) / T."""
    logits, labels = _masked_rows(torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    g_lp, g_h = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    leaf = logits.clone().requires_grad_()
    logp, entropy = logprob_entropy(leaf, labels, 0.9, backend=backend, softcap=5.0, shift_labels=False)
    (logp * g_lp + entropy * g_h).sum().backward()
    leaf64 = logits.double().requires_grad_()
    log_p = torch.log_softmax(5.0 * torch.tanh(leaf64 / 5.0) / 0.9, -1)
    logp64 = torch.where(labels >= 0, log_p.gather(-1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    entropy64 = -(log_p.exp() * log_p).sum(-1)
    (logp64 * g_lp.double() + entropy64 * g_h.double()).sum().backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[~torch.isfinite(logits)] == 0).all()
    # fp32 sums of ~40,000 equal terms (the capped -inf tokens): a few 1e-5 relative off float64
    # (3.7e-5 on an AVX2-only CPU)
    torch.testing.assert_close(logp.double(), logp64.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(entropy.double(), entropy64.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(leaf.grad.double(), leaf64.grad, atol=2e-6, rtol=1e-4)


def test_online_softmax_merges_blocks_of_only_minus_inf():
    """A block of only -inf has stats (-inf, 0, 0); merging it on either side changes nothing,
    and two such blocks stay (-inf, 0, 0) with no NaN. Block b: u = (0, ln 3): m = ln 3,
    s = 1/3 + 1 = 4/3, t = (1/3)(-ln 3) + 0 = -ln(3)/3."""
    empty = chunk_stats(torch.full((1, 5), NEG_INF), 1.0)
    assert [x.item() for x in empty] == [NEG_INF, 0.0, 0.0]
    block = chunk_stats(torch.tensor([[0.0, math.log(3.0)]]), 1.0)
    expected = [math.log(3.0), 4 / 3, -math.log(3.0) / 3]
    for merged in (merge_stats(empty, block), merge_stats(block, empty)):
        assert [x.item() for x in merged] == pytest.approx(expected, abs=1e-6)
    assert [x.item() for x in merge_stats(empty, empty)] == [NEG_INF, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# The one-pass loss: triton interpreter, native C row kernel, compiled torch, reference.

ONE_PASS_CASES = [("reference", torch.float32, "1"), ("torch", torch.float32, "1"), ("torch", torch.float32, "0"),
                  ("torch", torch.bfloat16, "1")] + ([("triton", torch.float32, "1"), ("triton", torch.bfloat16, "1")]
                                                     if triton_available() else [])


def _loss_inputs(logp64, seed):
    gen = torch.Generator().manual_seed(seed)
    old = (logp64.detach() + 0.1 * torch.randn(6, generator=gen, dtype=torch.float64)).float()
    advantages = torch.randn(6, generator=gen)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    return old, advantages, mask


@pytest.mark.parametrize("backend,dtype,native", ONE_PASS_CASES)
def test_one_pass_loss_over_the_finite_support(backend, dtype, native, monkeypatch):
    """``native``: AEPO_CPU_NATIVE (the C row kernel takes fp32 CPU rows; "0": compiled torch)."""
    monkeypatch.setenv("AEPO_CPU_NATIVE", native)
    logits, labels = _masked_rows(dtype, seed=5)
    config = LossConfig(clip="aepo", entropy_coef=0.01, kl_coef=0.05)
    leaves, logp64, entropy64 = _finite_support(logits.double(), labels)
    old, advantages, mask = _loss_inputs(logp64, seed=6)
    ref = old - 0.05
    expected, _ = policy_loss_from_logprobs(logp64, entropy64, old.double(), advantages.double(),
                                            (mask * (labels >= 0)).double(), config=config, ref_logprobs=ref.double())
    expected.backward()
    grad64 = _scatter_grads(leaves, logits.shape)
    leaf = logits.clone().requires_grad_()
    loss, stats = aepo_policy_loss(leaf, labels, old, advantages, mask, config=config, backend=backend,
                                   ref_logprobs=ref, return_token_loss=True, shift_labels=False)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()
    assert (leaf.grad[~torch.isfinite(logits)] == 0).all()
    assert loss.item() == pytest.approx(expected.item(), abs=2e-5, rel=1e-5)
    torch.testing.assert_close(stats["token_entropy"].double(), entropy64.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), grad64, **_tol(dtype))


# ---------------------------------------------------------------------------------------------
# From hidden states: a bias of -inf masks vocabulary columns for every row.


def _fused_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(6, 8, generator=gen), torch.randn(VOCAB, 8, generator=gen) / 2
    bias = torch.randn(VOCAB, generator=gen)
    bias[:33000] = NEG_INF  # the first Triton block and the first two vocab chunks
    bias[35000] = NEG_INF
    labels = torch.randint(33001, VOCAB, (6,), generator=gen)
    labels[labels == 35000] = 35001
    labels[2] = -100
    return hidden, weight, bias, labels


def _fused_expected(hidden, weight, bias, labels):
    """Float64 over the finite columns only: ``(leaves (h, W_F, b_F), finite, logp, H)``."""
    finite = torch.isfinite(bias)
    h = hidden.double().requires_grad_()
    w_f, b_f = weight[finite].double().requires_grad_(), bias[finite].double().requires_grad_()
    log_p = torch.log_softmax(h @ w_f.T + b_f, -1)
    position = (torch.cumsum(finite.long(), 0)[labels.clamp(min=0)] - 1).clamp(min=0)
    logp = torch.where(labels >= 0, log_p.gather(-1, position[:, None])[:, 0], 0.0)
    return (h, w_f, b_f), finite, logp, -(log_p.exp() * log_p).sum(-1)


def _check_fused_grads(leaves, finite, h_leaf, w_leaf, b_leaf):
    h, w_f, b_f = leaves
    for got in (h_leaf.grad, w_leaf.grad, b_leaf.grad):
        assert torch.isfinite(got).all()
    assert (w_leaf.grad[~finite] == 0).all() and (b_leaf.grad[~finite] == 0).all()
    torch.testing.assert_close(h_leaf.grad.double(), h.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(w_leaf.grad[finite].double(), w_f.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(b_leaf.grad[finite].double(), b_f.grad, atol=2e-5, rtol=1e-4)


def test_fused_linear_logprob_entropy_with_masked_columns():
    hidden, weight, bias, labels = _fused_inputs(seed=7)
    leaves, finite, logp64, entropy64 = _fused_expected(hidden, weight, bias, labels)
    (logp64 + 0.5 * entropy64).sum().backward()
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, entropy = fused_linear_logprob_entropy(h, w, labels, bias=b, shift_labels=False)
    (logp + 0.5 * entropy).sum().backward()
    torch.testing.assert_close(logp.double(), logp64.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), entropy64.detach(), atol=2e-5, rtol=1e-5)
    _check_fused_grads(leaves, finite, h, w, b)


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if triton_available() else []))
def test_fused_linear_loss_with_masked_columns(backend):
    hidden, weight, bias, labels = _fused_inputs(seed=8)
    leaves, finite, logp64, entropy64 = _fused_expected(hidden, weight, bias, labels)
    old, advantages, mask = _loss_inputs(logp64, seed=9)
    config = LossConfig(entropy_coef=0.01)
    expected, _ = policy_loss_from_logprobs(logp64, entropy64, old.double(), advantages.double(),
                                            (mask * (labels >= 0)).double(), config=config)
    expected.backward()
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    loss, _ = fused_linear_aepo_policy_loss(h, w, labels, old, advantages, mask, bias=b, config=config, backend=backend, shift_labels=False)
    loss.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=2e-5, rel=1e-5)
    _check_fused_grads(leaves, finite, h, w, b)
