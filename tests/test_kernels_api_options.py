"""The loss API's options for integrations: logit_scale / softcap (logits and fused-linear paths,
Triton and torch), shift_labels, ignore_index on every path, return_token_loss.

The oracle is the fp32 reference (:mod:`aepo_kernels.reference`), which applies the scale and
soft cap to the logits literally (``c * tanh(s z / c)``) and then does its usual maths; the
shifted loss is checked against slicing by hand."""
import inspect
import math

import pytest
import torch

from aepo_kernels import (
    AEPOLoss, LossConfig, LossOptions, aepo_policy_loss, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy, logprob_entropy,
    policy_loss_from_logprobs,
)
from aepo_kernels.logits_ops import logit_map
from aepo_kernels.reference import aepo_loss_reference, logprob_entropy_reference, token_loss_reference

from conftest import backend_params, triton_available
from fresh_process import in_fresh_process

BACKENDS = ["torch"] + (["triton"] if triton_available() else [])

if triton_available():
    import triton
    import triton.language as tl

    from aepo_kernels.triton_kernels import _tanh

    @triton.jit
    def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(y_ptr + o, _tanh(tl.load(x_ptr + o, mask=o < n, other=0.0)), mask=o < n)
CAPS = [(1.0, None), (0.7, None), (1.0, 6.0), (1.3, 4.0)]  # (logit_scale, softcap)


def _batch(seed, batch=3, seq=7, vocab=1009, dtype=torch.float32, ignore_index=-100):
    """Large logits (|z| up to ~20, so a soft cap of 4-6 saturates), odd V and T, masked rows,
    a fully masked sequence, ignore_index labels with mask 1, old log-probs near the current ones."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 6).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, 2] = labels[-1, -1] = ignore_index
    old = torch.log_softmax(logits.float() * 0.5 + torch.randn(batch, seq, vocab, generator=gen), -1)
    old_logprobs = old.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    advantages = torch.randn(batch, seq, generator=gen) * 2
    mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    mask[1] = 0
    mask[0, 2] = mask[-1, -1] = 1  # no target there: out of the loss anyway
    ref = old_logprobs + 0.3 * torch.randn(batch, seq, generator=gen)
    return logits, labels, old_logprobs, advantages, mask, ref


def _reference(logits, labels, old, adv, mask, cfg, temperature, ref, scale, cap, ignore_index=-100):
    """(loss, dlogits, per-token loss L_t (0 off the mask), log-probs, entropies), all fp32 autograd."""
    leaf = logits.float().clone().requires_grad_()
    loss = aepo_loss_reference(leaf, labels, old, adv, mask, cfg, temperature, ref_logprobs=ref,
                               ignore_index=ignore_index, logit_scale=scale, softcap=cap)
    loss.backward()
    with torch.no_grad():
        logp, ent = logprob_entropy_reference(logits, labels, temperature, ignore_index, scale, cap)
        target_mask = mask * (labels != ignore_index)
        token = token_loss_reference(logp, ent, old, adv, target_mask, cfg, ref_logprobs=ref)
    return loss.detach(), leaf.grad, torch.where(target_mask != 0, token, 0.0), logp, ent


# --- logit_scale / softcap -----------------------------------------------------------------------


def test_logit_map_folds_the_scale_and_rejects_bad_values():
    assert logit_map(2.0, 0.5, None) == (0.25, None)  # u = z * 0.5 / 2: folded, no extra work
    assert logit_map(2.0, 0.5, 10.0) == (5.0, 0.05)  # u = tanh(z * 0.5 / 10) * 10 / 2
    for kwargs in (dict(softcap=0.0), dict(softcap=-3.0), dict(logit_scale=0.0), dict(logit_scale=math.nan),
                   dict(softcap=math.inf)):
        with pytest.raises(ValueError, match="positive finite"):
            logit_map(1.0, **{"logit_scale": 1.0, "softcap": None, **kwargs})
    logits, labels, old, adv, mask, _ = _batch(0)
    with pytest.raises(ValueError, match="softcap"):
        aepo_policy_loss(logits, labels, old, adv, mask, softcap=-1.0, shift_labels=False)
    with pytest.raises(ValueError, match="logit_scale"):
        fused_linear_aepo_policy_loss(torch.zeros(3, 7, 4), torch.zeros(1009, 4), labels, old, adv, mask, logit_scale=0.0, shift_labels=False)


def test_reference_soft_cap_is_literal():
    """Hand-worked: z = 10, s = 0.5, c = 4 -> 4 tanh(5 / 4) = 4 * 0.8482836 = 3.3931346; the
    reference's log-prob is that logit's among two zeros: 3.3931346 - log(e^3.3931346 + 2) = -0.0650444."""
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    capped = 4 * math.tanh(10 * 0.5 / 4)
    assert abs(capped - 3.3931346) < 1e-6
    logp, _ = logprob_entropy_reference(logits, torch.tensor([0]), 1.0, logit_scale=0.5, softcap=4.0)
    assert abs(logp.item() - (-0.0650444)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("scale,cap", CAPS)
def test_logprob_entropy_with_scale_and_softcap(backend, scale, cap):
    logits, labels, *_ = _batch(1)
    gen = torch.Generator().manual_seed(2)
    g_lp, g_h = torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen)
    leaf, ref_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, ent = logprob_entropy(leaf, labels, 0.8, backend=backend, logit_scale=scale, softcap=cap, shift_labels=False)
    (logp * g_lp + ent * g_h).sum().backward()
    ref_logp, ref_ent = logprob_entropy_reference(ref_leaf, labels, 0.8, logit_scale=scale, softcap=cap)
    (ref_logp * g_lp + ref_ent * g_h).sum().backward()
    torch.testing.assert_close(logp, ref_logp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, atol=1e-6, rtol=1e-4)
    if cap is not None:  # the cap changes the answer (the test can fail)
        plain, _ = logprob_entropy_reference(logits, labels, 0.8, logit_scale=scale)
        assert (plain - ref_logp.detach()).abs().max() > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("scale,cap", CAPS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_with_scale_and_softcap_matches_reference(backend, scale, cap, dtype):
    cfg = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01, eps_high=0.28, entropy_adv_alpha=0.3)
    logits, labels, old, adv, mask, ref = _batch(3 + len(str(cap)), dtype=dtype)
    expected, expected_grad, token, logp, ent = _reference(logits, labels, old, adv, mask, cfg, 0.9, ref, scale, cap)
    g = torch.rand(()) + 0.5  # a random incoming gradient
    for in_place in (False, True):
        leaf = logits.clone().requires_grad_()
        loss, stats = aepo_policy_loss(leaf * 1.0, labels, old, adv, mask, config=cfg, temperature=0.9, backend=backend,
                                       ref_logprobs=ref, logit_scale=scale, softcap=cap, inplace_backward=in_place,
                                       return_token_loss=True, shift_labels=False)
        (g * loss).backward()
        assert leaf.grad.dtype == dtype
        torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(stats["token_loss"], token, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(stats["token_logprobs"], logp, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(stats["token_entropy"], ent, atol=2e-5, rtol=1e-5)
        want = g * expected_grad
        if dtype == torch.float32:
            torch.testing.assert_close(leaf.grad, want, atol=1e-7, rtol=1e-4)
        else:
            scale_max = want.abs().max()
            torch.testing.assert_close(leaf.grad.float(), want, atol=2e-2 * scale_max, rtol=2 ** -7 * 1.01)
        assert (leaf.grad[1] == 0).all() and (leaf.grad[0, 2] == 0).all()  # masked / no-target rows


@pytest.mark.slow
def test_float64_gradcheck_scale_and_softcap_cpu_path():
    """Finite differences through c tanh(s z / c): logits path (logprob_entropy and the one-pass
    loss) and fused-linear (hidden, weight, bias). ppo with alpha_H = 0 (the stop-gradient rules
    have no finite-difference counterpart; they are checked against the reference above)."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 5, 13, dtype=torch.float64, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, 13, (2, 5), generator=gen)
    labels[1, 3] = -100
    old = -torch.rand(2, 5, dtype=torch.float64, generator=gen) * 3
    adv = torch.tensor([1.5, -0.7], dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    cfg = LossConfig(clip="ppo", kl_coef=0.1, entropy_coef=0.05, eps_low=0.6, eps_high=0.6, entropy_adv_alpha=0.0)
    opts = dict(logit_scale=0.8, softcap=3.0)
    assert torch.autograd.gradcheck(
        lambda z: logprob_entropy(z, labels, 0.7, backend="torch", shift_labels=False, **opts), (logits,))
    assert torch.autograd.gradcheck(
        lambda z: aepo_policy_loss(z, labels, old, adv, mask, config=cfg, temperature=0.7, backend="torch",
                                   ref_logprobs=old + 0.2, shift_labels=False, **opts)[0], (logits,))
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = (torch.randn(13, 4, dtype=torch.float64, generator=gen) * 2).requires_grad_()
    bias = torch.randn(13, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, w, b: fused_linear_aepo_policy_loss(
        h, w, labels, old, adv, mask, config=cfg, temperature=1.4, bias=b, backend="torch", token_chunk=3,
        ref_logprobs=old - 0.3, shift_labels=False, **opts)[0],
        (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: fused_linear_logprob_entropy(
        h, w, labels, 1.4, bias=b, token_chunk=3, vocab_chunk=5, shift_labels=False, **opts), (hidden, weight, bias))


def test_triton_tanh_from_exp_is_accurate():
    """The kernels' exp-based tanh (libdevice is not available under the interpreter) against
    torch.tanh: tiny, around the series/closed-form switch at 0.25, large and infinite inputs."""
    if not triton_available():
        pytest.skip("triton not importable, or no CUDA and TRITON_INTERPRET != 1")
    import triton

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([0.0, 1e-30, -1e-7, 0.2499, 0.25, 0.2501, -0.25, 9.0, 20.0, -50.0, 1e4,
                                 float("inf"), float("-inf")]),
                   torch.randn(1000, generator=gen) * 0.3, torch.randn(1000, generator=gen) * 5])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = x.to(device)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    expected = torch.tanh(x.double())
    # within 2 fp32 ulps of the true value (relative), everywhere
    assert ((y.double() - expected).abs() <= 2.4e-7 * expected.abs() + 1e-38).all()


@pytest.mark.slow
def test_changing_softcap_or_scale_does_not_recompile_and_off_is_the_old_graph():
    from torch._dynamo.utils import counters

    from aepo_kernels import one_pass

    logits, labels, old, adv, mask, _ = _batch(6)
    aepo_policy_loss(logits.clone().requires_grad_(), labels, old, adv, mask, backend="torch", shift_labels=False)[0].backward()
    aepo_policy_loss(logits.clone().requires_grad_(), labels, old, adv, mask, backend="torch", softcap=5.0, shift_labels=False)[0].backward()
    assert one_pass.fast_row_head.mode == "compiled"
    graphs = counters["stats"]["unique_graphs"]
    for scale, cap in ((0.5, None), (2.0, 30.0), (1.0, 7.5)):
        aepo_policy_loss(logits.clone().requires_grad_(), labels, old, adv, mask, backend="torch", logit_scale=scale,
                         softcap=cap, temperature=0.7, shift_labels=False)[0].backward()
    assert counters["stats"]["unique_graphs"] == graphs


# --- shift_labels ---------------------------------------------------------------------------------


def _shift_case(seed, vocab=211):
    logits, labels, old, adv, mask, ref = _batch(seed, seq=9, vocab=vocab)
    gen = torch.Generator().manual_seed(seed + 100)
    weights = torch.rand(labels.shape, generator=gen) * 2
    return logits, labels, old, adv, mask, ref, weights


def _by_hand(t):
    return t[..., 1:]


@pytest.mark.parametrize("backend", backend_params(BACKENDS + ["reference"]))
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_shift_labels_equals_manual_shifting(backend, aggregation):
    """input_ids-aligned labels and per-token tensors + shift_labels == logits[:, :-1] with every
    per-token tensor[:, 1:] by hand; per-token outputs come back aligned with labels."""
    logits, labels, old, adv, mask, ref, weights = _shift_case(len(aggregation))
    cfg = LossConfig(aggregation=aggregation, kl_coef=0.05, entropy_coef=0.02)
    kwargs = dict(config=cfg, backend=backend, temperature=1.1, return_token_loss=True, softcap=5.0)
    shifted_leaf = logits.clone().requires_grad_()
    loss, stats = aepo_policy_loss(shifted_leaf, labels, old, adv, mask, ref_logprobs=ref, token_weights=weights,
                                   shift_labels=True, **kwargs)
    loss.backward()
    hand_leaf = logits.clone().requires_grad_()
    want, want_stats = aepo_policy_loss(hand_leaf[:, :-1], _by_hand(labels), _by_hand(old), _by_hand(adv),
                                        _by_hand(mask), ref_logprobs=_by_hand(ref), token_weights=_by_hand(weights),
                                        shift_labels=False, **kwargs)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shifted_leaf.grad, hand_leaf.grad, atol=1e-7, rtol=1e-5)
    assert (shifted_leaf.grad[:, -1] == 0).all()
    for name, value in want_stats.items():
        got = stats[name]
        if name.startswith("token_"):
            assert got.shape == labels.shape and (got[:, 0] == 0).all()
            got = got[:, 1:]
        torch.testing.assert_close(got, value, atol=1e-6, rtol=1e-5, msg=name)
    # the shift matters: the unshifted loss of the same tensors is another number
    unshifted, _ = aepo_policy_loss(logits, labels, old, adv, mask, ref_logprobs=ref, token_weights=weights, shift_labels=False, **kwargs)
    assert not torch.allclose(unshifted, loss)


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
def test_shift_labels_fused_linear_equals_manual_shifting(backend):
    """From hidden states: shift_labels (hidden not copied) == hidden[:, :-1] by hand."""
    _, labels, old, adv, mask, ref, weights = _shift_case(9, vocab=301)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 9, 12, generator=gen)
    weight = torch.randn(301, 12, generator=gen)
    cfg = LossConfig(aggregation="seq-mean-token-sum-norm", entropy_coef=0.01)
    kwargs = dict(config=cfg, backend=backend, token_chunk=5, return_token_loss=True, logit_scale=1.5, softcap=6.0)
    h1, w1, h2, w2 = (t.clone().requires_grad_() for t in (hidden, weight, hidden, weight))
    loss, stats = fused_linear_aepo_policy_loss(h1, w1, labels, old, adv, mask, token_weights=weights,
                                                shift_labels=True, **kwargs)
    loss.backward()
    want, want_stats = fused_linear_aepo_policy_loss(h2[:, :-1], w2, _by_hand(labels), _by_hand(old), _by_hand(adv),
                                                     _by_hand(mask), token_weights=_by_hand(weights), shift_labels=False, **kwargs)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats["token_loss"][:, 1:], want_stats["token_loss"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(stats["token_entropy"][:, 1:], want_stats["token_entropy"], atol=1e-6, rtol=1e-5)


def test_shift_labels_flat_tokens_and_bad_shapes():
    logits, labels, old, adv, mask, *_ = _shift_case(4)
    flat = [t[0] for t in (logits, labels, old, adv, mask)]
    loss, _ = aepo_policy_loss(*flat, backend="torch", shift_labels=True)
    want, _ = aepo_policy_loss(flat[0][:-1], *(t[1:] for t in flat[1:]), backend="torch", shift_labels=False)
    torch.testing.assert_close(loss, want)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        aepo_policy_loss(logits[:, :1], labels[:, :1], old[:, :1], adv[:, :1], mask[:, :1], shift_labels=True)
    with pytest.raises(ValueError, match="old_logprobs"):  # the caller's shapes are named, not the shifted ones
        aepo_policy_loss(logits, labels, old[:, :-1], adv, mask, shift_labels=True)


# --- ignore_index and the per-token loss on every path ---------------------------------------------


def test_ignore_index_on_every_path():
    """A custom ignore_index (-1): such positions are out of the loss even with mask 1, on the
    logits path (every backend), fused-linear and logprob_entropy; equal to masking them by hand."""
    _, labels, old, adv, mask, ref = _batch(7, vocab=307, ignore_index=-1)
    gen = torch.Generator().manual_seed(8)
    hidden, weight = torch.randn(3, 7, 10, generator=gen), torch.randn(307, 10, generator=gen)
    logits = hidden @ weight.T
    hand_mask = mask * (labels != -1)
    hand_labels = labels.clamp(min=0)  # any valid id: its row is masked out by hand
    cfg = LossConfig(entropy_coef=0.01, kl_coef=0.1)
    want = aepo_loss_reference(logits, hand_labels, old, adv, hand_mask, cfg, ref_logprobs=ref)
    for backend in BACKENDS + ["reference"]:
        leaf = logits.clone().requires_grad_()
        loss, stats = aepo_policy_loss(leaf, labels, old, adv, mask, config=cfg, backend=backend, ref_logprobs=ref,
                                       ignore_index=-1, return_token_loss=True, shift_labels=False)
        loss.backward()
        torch.testing.assert_close(loss.detach(), want, atol=1e-6, rtol=1e-5, msg=backend)
        assert stats["num_tokens"] == hand_mask.sum()
        assert (leaf.grad[labels == -1] == 0).all() and (stats["token_loss"][labels == -1] == 0).all()
        assert (stats["token_logprobs"][labels == -1] == 0).all()
    for backend in BACKENDS:
        loss, _ = fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask, config=cfg, backend=backend,
                                                ref_logprobs=ref, ignore_index=-1, token_chunk=4, shift_labels=False)
        torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5, msg=f"fused-linear {backend}")
        logp, _ = logprob_entropy(logits, labels, backend=backend, ignore_index=-1, shift_labels=False)
        assert (logp[labels == -1] == 0).all() and (logp[labels != -1] != 0).all()
    logp, _ = fused_linear_logprob_entropy(hidden, weight, labels, ignore_index=-1, vocab_chunk=100, shift_labels=False)
    assert (logp[labels == -1] == 0).all() and (logp[labels != -1] != 0).all()


@pytest.mark.parametrize("backend", backend_params(BACKENDS + ["reference"]))
def test_token_loss_on_request_and_only_then(backend):
    """return_token_loss: stats carry L_t (0 off the mask), log-probs and entropies matching the
    reference; sum_t w_t L_t is the loss; without the flag the stats are the old ones."""
    cfg = LossConfig(clip="gppo", aggregation="seq-mean-token-mean", kl_coef=0.05)
    logits, labels, old, adv, mask, ref = _batch(12, vocab=401)
    expected, _, token, logp, ent = _reference(logits, labels, old, adv, mask, cfg, 1.0, ref, 1.0, None)
    loss, stats = aepo_policy_loss(logits, labels, old, adv, mask, config=cfg, backend=backend, ref_logprobs=ref,
                                   return_token_loss=True, shift_labels=False)
    torch.testing.assert_close(stats["token_loss"], token, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["token_logprobs"], logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats["token_entropy"], ent, atol=1e-5, rtol=1e-5)
    target_mask = mask * (labels != -100)
    per_seq = (stats["token_loss"].sum(-1) / target_mask.sum(-1).clamp(min=1)).mean()
    torch.testing.assert_close(per_seq, loss, atol=1e-6, rtol=1e-5)
    assert not any(t.requires_grad for t in stats.values())
    _, plain = aepo_policy_loss(logits, labels, old, adv, mask, config=cfg, backend=backend, ref_logprobs=ref, shift_labels=False)
    assert not {"token_loss", "token_logprobs", "token_entropy"} & plain.keys()
    # policy_loss_from_logprobs: the same per-token loss from given log-probs
    _, from_logprobs = policy_loss_from_logprobs(logp, ent, old, adv, target_mask, config=cfg, ref_logprobs=ref,
                                                 return_token_loss=True)
    torch.testing.assert_close(from_logprobs["token_loss"], token, atol=1e-6, rtol=1e-6)


# --- fused-linear == materialised logits, with every option ----------------------------------------


@pytest.mark.parametrize("backend", backend_params(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_equals_materialised_logits_with_all_options(backend, dtype):
    """Same options on both: shift_labels, logit_scale + softcap, a custom ignore_index, token
    weights, return_token_loss, bias; the materialised side is the fp32 reference backend on the
    logits computed in the inputs' dtype (the fused matmuls run in it, as a bf16 lm_head's do)."""
    batch, seq, d, vocab = 2, 11, 20, 509
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(batch, seq, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) * 1.5).to(dtype)
    bias = torch.randn(vocab, generator=gen).to(dtype)
    _, labels, old, adv, mask, ref = _batch(22, batch=batch, seq=seq, vocab=vocab, ignore_index=7)
    weights = torch.rand(batch, seq, generator=gen) + 0.5
    cfg = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)
    opts = dict(config=cfg, temperature=0.9, ref_logprobs=ref, token_weights=weights, shift_labels=True,
                ignore_index=7, logit_scale=0.6, softcap=8.0, return_token_loss=True)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, stats = fused_linear_aepo_policy_loss(leaves[0], leaves[1], labels, old, adv, mask, bias=leaves[2],
                                                backend=backend, token_chunk=6, **opts)
    loss.backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(*ref_leaves).float()
    want, want_stats = aepo_policy_loss(logits, labels, old, adv, mask, backend="reference", **opts)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-4)
    for name in ("token_loss", "token_logprobs", "token_entropy", "entropy", "clipfrac_high", "kl"):
        torch.testing.assert_close(stats[name], want_stats[name], atol=1e-4, rtol=1e-4, msg=name)
    for got, ref_leaf in zip(leaves, ref_leaves):
        assert got.grad.dtype == dtype
        want_grad = ref_leaf.grad.float()
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2 * want_grad.abs().max(), rtol=2e-2)
        torch.testing.assert_close(got.grad.float(), want_grad, **tol)


@pytest.mark.parametrize("scale,cap", CAPS)
def test_fused_linear_logprob_entropy_with_scale_and_softcap(scale, cap):
    """Vocab blocks (merged online softmax) with the cap applied per block, against the reference."""
    gen = torch.Generator().manual_seed(31)
    hidden, weight = torch.randn(23, 16, generator=gen), torch.randn(613, 16, generator=gen)
    labels = torch.randint(0, 613, (23,), generator=gen)
    labels[::4] = -100
    g_lp, g_h = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    h1, w1, h2, w2 = (t.clone().requires_grad_() for t in (hidden, weight, hidden, weight))
    logp, ent = fused_linear_logprob_entropy(h1, w1, labels, 1.2, token_chunk=5, vocab_chunk=200, logit_scale=scale,
                                             softcap=cap, shift_labels=False)
    (logp * g_lp + ent * g_h).sum().backward()
    ref_logp, ref_ent = logprob_entropy_reference(h2 @ w2.T, labels, 1.2, logit_scale=scale, softcap=cap)
    (ref_logp * g_lp + ref_ent * g_h).sum().backward()
    torch.testing.assert_close(logp, ref_logp.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@in_fresh_process
def test_callers_torch_compile_traces_the_options():
    """torch.compile(fullgraph=True) of a step using softcap, logit_scale, shift_labels and
    return_token_loss (the custom op path) equals eager."""
    logits, labels, old, adv, mask, _ = _batch(41, vocab=101)

    def step(z):
        return aepo_policy_loss(z * 1.0, labels, old, adv, mask, config=LossConfig(clip="gppo"), backend="torch",
                                softcap=4.0, logit_scale=0.8, shift_labels=True, return_token_loss=True)

    eager_leaf, compiled_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want, want_stats = step(eager_leaf)
    want.backward()
    got, stats = torch.compile(step, fullgraph=True)(compiled_leaf)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_leaf.grad, eager_leaf.grad)
    torch.testing.assert_close(stats["token_loss"], want_stats["token_loss"])


def test_more_kernel_variants_than_dynamos_default_limit_compile():
    """dtype x soft cap on/off x size-1 shapes gives a kernel more than dynamo's default 8
    compiled variants; they compile (the module's own limit), stay compiled and are right."""
    from torch._dynamo.utils import counters

    from aepo_kernels.compile import CompiledFunction

    def kernel(x, tanh_scale=None):
        if tanh_scale is not None:
            x = torch.tanh(x * tanh_scale)
        return x * 2 + 1

    compiled = CompiledFunction(kernel)
    gen = torch.Generator().manual_seed(0)
    variants = [(torch.randn(n, generator=gen).to(dtype), cap) for dtype in (torch.float32, torch.float64, torch.bfloat16)
                for cap in (None, 0.5) for n in (1, 10)]
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        for x, cap in variants:
            # bf16: inductor computes in fp32 and rounds once, eager rounds per op (1 ulp apart)
            tol = dict(atol=2e-2, rtol=2e-2) if x.dtype == torch.bfloat16 else {}
            torch.testing.assert_close(compiled(x, cap), kernel(x, cap), **tol)
    assert compiled.mode == "compiled" and counters["stats"]["unique_graphs"] - before == len(variants) > 8


@pytest.mark.parametrize("backend", backend_params(BACKENDS + ["reference"]))
def test_logprob_entropy_shift_labels_round_trip(backend):
    """logprob_entropy(shift_labels=True) == slicing by hand, aligned with the labels; fed back
    as old log-probs to the shifted loss (same alignment) every ratio is 1 (no clipping)."""
    logits, labels, _, adv, mask, *_ = _shift_case(13)
    leaf, hand = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, ent = logprob_entropy(leaf, labels, 0.9, backend=backend, softcap=5.0, shift_labels=True)
    want_logp, want_ent = logprob_entropy(hand[:, :-1], labels[:, 1:], 0.9, backend=backend, softcap=5.0, shift_labels=False)
    (logp.sum() + ent.sum()).backward()
    (want_logp.sum() + want_ent.sum()).backward()
    assert logp.shape == labels.shape and (logp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    torch.testing.assert_close(logp[:, 1:], want_logp)
    torch.testing.assert_close(ent[:, 1:], want_ent)
    torch.testing.assert_close(leaf.grad, hand.grad)
    _, stats = aepo_policy_loss(logits, labels, logp.detach(), adv, mask, backend=backend, temperature=0.9,
                                softcap=5.0, shift_labels=True, return_token_loss=True)
    torch.testing.assert_close(stats["ratio"], torch.tensor(1.0))
    torch.testing.assert_close(stats["token_logprobs"], logp.detach())
    gen = torch.Generator().manual_seed(14)
    hidden, weight = torch.randn(3, 9, 8, generator=gen), torch.randn(211, 8, generator=gen)
    fused = fused_linear_logprob_entropy(hidden, weight, labels, 0.9, softcap=5.0, shift_labels=True, vocab_chunk=64)
    by_hand = logprob_entropy_reference(hidden[:, :-1] @ weight.T, labels[:, 1:], 0.9, softcap=5.0)
    for got, want in zip(fused, by_hand):
        assert (got[:, 0] == 0).all()
        torch.testing.assert_close(got[:, 1:], want, atol=2e-5, rtol=1e-5)


def test_both_loss_functions_take_every_shared_option_with_its_one_default():
    """The shared keywords are declared once (LossOptions): both signatures list each with that
    default (shift_labels with none: it is required), AEPOLoss's defaults are the same, and a
    misspelt keyword is a TypeError naming it."""
    for fn in (aepo_policy_loss, fused_linear_aepo_policy_loss):
        params = inspect.signature(fn).parameters
        for name, default in LossOptions._field_defaults.items():
            want = inspect.Parameter.empty if name == "shift_labels" else default
            assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default == want, (fn, name)
    assert len(LossOptions._fields) == 15
    module = AEPOLoss(shift_labels=False)
    assert (module.config, module.temperature, module.backend) == (LossConfig(), 1.0, "auto")
    logits, labels, old, adv, mask, _ = _batch(11)
    with pytest.raises(TypeError, match="aepo_policy_loss\\(\\) got an unexpected keyword argument 'temprature'"):
        aepo_policy_loss(logits, labels, old, adv, mask, temprature=0.7, shift_labels=False)
    hidden, weight = torch.randn(3, 7, 5), torch.randn(1009, 5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'inplace_backward'"):
        fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask, inplace_backward=True, shift_labels=False)
