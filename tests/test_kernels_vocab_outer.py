"""The vocabulary-outer fused-linear AEPO head (issue 54, docs/head.md) against the float64
reference (:mod:`aepo_kernels.reference`) and against the token-outer head it can replace."""
from __future__ import annotations

import pytest
import torch

from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss
from aepo_kernels import fused_linear

CLIPS = ["ppo", "aepo", "gppo", "cispo"]


def _inputs(n, d, vocab, dtype, seed, logit_std=3.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen, dtype=torch.float64) * (logit_std / d**0.5)).to(dtype)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    # old and reference log-probs within ~0.3 of the current ones: ratios on both sides of the clip
    logp = torch.log_softmax(hidden.double() @ weight.double().T + bias.double(), -1).gather(-1, labels[:, None])[:, 0]
    old = logp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
    labels[::11] = -100  # rows without a target
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, generator=gen) > 0.2).double()  # masked rows
    # the loss takes its per-token inputs in fp32 (loss_call): values fp32 holds exactly
    old, ref, adv = (t.float().double() for t in (old, ref, adv))
    return hidden, weight, bias, labels, old, adv, mask, ref


def _grads(fn, hidden, weight, bias):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, stats = fn(*leaves)
    loss.backward()
    return loss.detach().double(), [t.grad.double() for t in leaves], stats


# entropy z-score statistics and the token-mean normaliser as the trainer supplies them (values
# fp32 holds exactly, and a power of two: the aggregation weights are fp32 in the loss)
STATS = dict(entropy_mean=torch.tensor(2.5), entropy_std=torch.tensor(0.75), global_token_count=256.0)


def _reference(cfg, labels, old, adv, mask, ref, temperature, softcap=None):
    """The materialised float64 oracle: logits from the inputs' values in float64."""
    return lambda h, w, b: aepo_policy_loss(
        h.double() @ w.double().T + b.double(), labels, old, adv, mask, config=cfg, backend="reference",
        shift_labels=False, temperature=temperature, ref_logprobs=ref, softcap=softcap, **STATS)


def _fused(order, cfg, labels, old, adv, mask, ref, temperature, softcap=None, **kw):
    return lambda h, w, b: fused_linear_aepo_policy_loss(
        h, w, labels, old, adv, mask, bias=b, config=cfg, shift_labels=False, temperature=temperature,
        ref_logprobs=ref, softcap=softcap, head_backward=order, **STATS, **kw)


@pytest.mark.parametrize("clip", CLIPS)
def test_float64_every_clip_rule_odd_shapes_matches_the_reference(clip):
    """V = 2,053, D = 24, N = 423 (odd against every block), KL, entropy bonus and the
    entropy-aware advantage on, masked rows and rows without a target: float64 to 1e-10."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, torch.float64, seed=CLIPS.index(clip))
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3, entropy_coef=0.01, kl_coef=0.05,
                     dual_clip=3.0 if clip in ("ppo", "aepo") else 0.0)
    want = _grads(_reference(cfg, labels, old, adv, mask, ref, 0.7), hidden, weight, bias)
    got = _grads(_fused("vocab_outer", cfg, labels, old, adv, mask, ref, 0.7, token_chunk=61, vocab_chunk=300),
                 hidden, weight, bias)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-10)
    for g, r in zip(got[1], want[1]):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-10)
    for key in ("entropy", "ratio", "clipfrac_high", "clipfrac_low", "kl"):
        torch.testing.assert_close(got[2][key].double(), want[2][key].double(), atol=1e-10, rtol=1e-10)


def test_float64_gradcheck_with_soft_cap_and_bias():
    """Numerical gradients of hidden, weight and bias (ppo: no stop-gradient in the clip, entropy
    shaping off so the loss is the function autograd differentiates), soft cap on."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(9, 5, 37, torch.float64, seed=7)
    cfg = LossConfig(clip="ppo", entropy_adv_alpha=0.0, entropy_coef=0.1, kl_coef=0.2, eps_high=10.0, eps_low=0.9,
                     dual_clip=0.0)
    fn = _fused("vocab_outer", cfg, labels, old, adv, mask, ref, 1.3, softcap=4.0, token_chunk=4, vocab_chunk=10)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(lambda h, w, b: fn(h, w, b)[0], leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", CLIPS)
def test_fp32_and_bf16_are_as_close_to_float64_as_the_token_outer_head(dtype, clip):
    """At V = 2,053, D = 24, N = 423 in fp32 and bf16: the gradients within the fused-linear tests'
    tolerances of the float64 maths on the same (rounded) inputs, and no further from it than
    twice the token-outer head's error (plus a hair of the largest gradient)."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, dtype, seed=11 + CLIPS.index(clip))
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3, entropy_coef=0.01)
    want = _grads(_reference(cfg, labels, old, adv, mask, None, 0.9), hidden, weight, bias)
    vo = _grads(_fused("vocab_outer", cfg, labels, old, adv, mask, None, 0.9, token_chunk=100, vocab_chunk=512),
                hidden, weight, bias)
    to = _grads(_fused("token_outer", cfg, labels, old, adv, mask, None, 0.9, token_chunk=100), hidden, weight, bias)
    loss_tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(vo[0], want[0], **loss_tol)
    for g_vo, g_to, r in zip(vo[1], to[1], want[1]):
        scale = r.abs().max()
        err_vo, err_to = (g_vo - r).abs().max(), (g_to - r).abs().max()
        if dtype == torch.float32:
            torch.testing.assert_close(g_vo, r, atol=1e-4 * scale, rtol=1e-4)
        else:
            assert err_vo <= 5e-2 * scale
        assert err_vo <= 2 * err_to + 1e-3 * scale, (float(err_vo), float(err_to))


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """2 M N K flops of every mm / addmm (in place and out= variants included) run under it."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def test_two_phase_statistics_match_supplied_ones_and_cost_four_matmuls():
    """Entropy statistics not supplied: the vocab-outer statistics pass is also the entropy pass
    (4 matmuls of 2 N D V flops, as the token-outer two-phase path); supplied: token-outer 3,
    vocab-outer 4. The loss equals the call given this batch's own statistics."""
    from aepo_kernels import entropy_moments, entropy_stats_from_moments, fused_linear_logprob_entropy

    n, d, vocab = 64, 16, 517
    hidden, weight, _, labels, old, adv, mask, _ = _inputs(n, d, vocab, torch.float32, seed=3)
    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.4)
    _, entropy = fused_linear_logprob_entropy(hidden, weight, labels, shift_labels=False)
    mean, std = entropy_stats_from_moments(entropy_moments(entropy, mask * (labels != -100)))

    def flops(order, **stats):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _MatmulFlops() as counter:
            loss, _ = fused_linear_aepo_policy_loss(h, w, labels, old, adv, mask, config=cfg, shift_labels=False,
                                                    head_backward=order, token_chunk=20, vocab_chunk=100, **stats)
            loss.backward()
        return counter.flops / (2 * n * d * vocab), loss.detach(), h.grad, w.grad

    two_phase = flops("vocab_outer")
    supplied = flops("vocab_outer", entropy_mean=mean, entropy_std=std)
    assert (two_phase[0], supplied[0]) == (4, 4)
    assert flops("token_outer", entropy_mean=mean, entropy_std=std)[0] == 3 and flops("token_outer")[0] == 4
    for a, b in zip(two_phase[1:], supplied[1:]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_fp32_vocab_by_dim_accumulator_and_the_plan_term_is_the_measured_peak(dtype):
    """The vocab-outer head's peak above its inputs (malloc's in-use bytes) at V = 32,768, D = 256,
    N = 512: d_W in the weight dtype, d_hidden and one block, as the memory plan's
    ``vocab_outer_head_bytes`` counts them (within 3%); the token-outer head holds an fp32 [V, D]
    accumulator and a [rows, V] logits block beside them (fp32: the accumulator is d_W)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
    from memory_measure import HeapMeter

    from aepo_engine.memory_plan import vocab_outer_head_bytes

    n, d, vocab, budget = 512, 256, 32768, 2 << 20
    hidden, weight, _, labels, old, adv, mask, _ = _inputs(n, d, vocab, dtype, seed=5, logit_std=1.0)
    meter, peaks = HeapMeter(), {}
    for order in ("vocab_outer", "token_outer") * 2:  # the first of each compiles
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        meter.start()
        loss, _ = fused_linear_aepo_policy_loss(h, w, labels, old, adv, mask, shift_labels=False, head_backward=order,
                                                chunk_bytes=budget, entropy_mean=torch.tensor(2.0),
                                                entropy_std=torch.tensor(1.0))
        loss.backward()
        peaks[order] = meter.stop()
        del loss, h, w
    c = hidden.element_size()
    d_w = vocab * d * c
    planned = vocab_outer_head_bytes(vocab, d, n, c, budget, cuda=False)
    assert abs(planned - peaks["vocab_outer"]) <= 0.03 * peaks["vocab_outer"], (planned, peaks)
    assert peaks["vocab_outer"] - d_w <= 0.95 * d_w  # the workspace: under one d_W at this shape
    if c != 4:  # bf16: token-outer's fp32 accumulator and bf16 d_W, 3x d_W, against d_W and blocks
        assert peaks["token_outer"] >= vocab * d * (4 + c) > peaks["vocab_outer"], peaks


def test_gradient_filtering_skips_tiles_within_its_bound():
    """filter_eps: tiles whose probability mass is below eps for every row skip their dlogits and
    both gradient matmuls; the error against the exact float64 gradient stays within the bound of
    :func:`fused_linear.gradient_pass` summed over the skipped blocks, target entries included
    exactly. A Zipf-like bias (frequent tokens first, as a trained head's) makes the rare blocks'
    mass small. eps too small to skip anything gives the exact gradient."""
    from aepo_kernels.config import hyper_params
    from aepo_kernels.row_inputs import RowInputs

    n, d, vocab, tc, vc = 96, 16, 1031, 16, 64
    hidden, weight, _, labels, old, adv, mask, _ = _inputs(n, d, vocab, torch.float64, seed=9, logit_std=2.0)
    bias = -3.0 * torch.arange(1, vocab + 1, dtype=torch.float64).log()
    labels[1::3] = vocab - 1 - labels[1::3] % 50  # targets in the rare blocks too
    valid = labels != -100
    inv_t = 1.0
    lse, eu, target = fused_linear.stats_pass(hidden, weight, bias, labels, valid, inv_t, None, tc, vc)
    inputs = RowInputs(old, adv, mask / mask.sum(), torch.tensor(2.0, dtype=torch.float64),
                       torch.tensor(1.0, dtype=torch.float64))
    hp = hyper_params(LossConfig(clip="aepo", entropy_adv_alpha=0.3), False, torch.float64, "cpu")
    g_lp, g_h, _ = fused_linear.head_rows(torch.where(valid, target - lse, 0.0), lse - eu, valid, inputs, hp)

    def grads(eps):
        counts = {}
        out = fused_linear.gradient_pass(hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, None, tc, vc,
                                         filter_eps=eps, counts=counts)
        return out, counts

    exact, _ = grads(None)
    same, none = grads(1e-300)
    assert none["skipped"] == 0 and all(torch.equal(a, b) for a, b in zip(same, exact))
    u = (hidden @ weight.T + bias) * inv_t
    per_row = (g_lp.abs() + g_h.abs() * (eu[:, None] - u).abs().amax(-1)) * inv_t  # |dz| / p off the target
    for eps in (1e-6, 1e-3):
        (got_h, got_w, got_b), counts = grads(eps)
        assert 0 < counts["skipped"] < counts["tiles"], counts
        skipped_mass = counts["skipped"] * eps  # per row, over all its skipped tiles (a generous sum)
        assert ((got_h - exact[0]).abs().amax(-1) <= skipped_mass * per_row * weight.abs().max()).all()
        assert (got_w - exact[1]).abs().max() <= skipped_mass * (per_row[:, None] * hidden.abs()).sum(0).max()
        assert (got_b - exact[2]).abs().max() <= skipped_mass * per_row.sum()
        assert (got_h - exact[0]).abs().max() > 0  # something was left out
    # the target entries of skipped tiles are still there: rows whose target is rare keep d_bias there
    rare = labels[valid & (labels >= vocab - 50)]
    assert (got_b[rare] - exact[2][rare]).abs().max() <= 1e-3 * exact[2][rare].abs().max()


def test_the_order_is_one_option_with_one_default():
    from aepo_kernels.fused_linear import CPU_HEAD_BACKWARD, default_head_backward, resolve_head_backward

    hidden, weight, _, labels, old, adv, mask, _ = _inputs(8, 4, 13, torch.float32, seed=1)
    assert default_head_backward(torch.device("cpu"), 8, 13, 4, 4) == CPU_HEAD_BACKWARD == resolve_head_backward(
        None, hidden, weight) == resolve_head_backward("auto", hidden, weight)
    # on CUDA by the plan's rule (tests/test_kernels_head_lean.py): a small head's workspace fits
    assert default_head_backward("cuda", 8, 13, 4, 2) == "vocab_outer"
    assert default_head_backward(torch.device("cuda", 1), 16384, 151936, 5120, 2) == "vocab_outer_lean"
    assert resolve_head_backward("vocab_outer", hidden, weight) == "vocab_outer"
    with pytest.raises(ValueError, match="head_backward='rows'"):
        fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask, shift_labels=False, head_backward="rows")
    with pytest.raises(ValueError, match="filter_eps"):
        fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask, shift_labels=False,
                                      head_backward="token_outer", filter_eps=1e-3)


# ---------------------------------------------------------------------------------------------
# The Triton gradient pass (aepo_kernels.triton_head), under TRITON_INTERPRET=1 on CPU tensors here
# (tests/conftest.py sets it without a GPU). bf16/fp16 operands are converted to fp32 just before
# each tl.dot under the interpreter (its bf16 dot is wrong); the dlogits are still rounded to the
# compute dtype before the gradient matmuls, as on the GPU.

def _triton_head():
    from conftest import triton_available

    if not triton_available():
        pytest.skip("triton not importable, or no CUDA and TRITON_INTERPRET != 1")
    from aepo_kernels import triton_head

    return triton_head


# (token_chunk, vocab_chunk) of each clip rule's case: the Triton pass takes chunks of
# head_vocab_columns(N, V, D, c, token_chunk, vocab_chunk) columns: 768 (3 chunks, the last of 517
# columns), 2,048 (2 chunks, the last of 5), 2,053 (one chunk), 448 (5 chunks, the last of 261)
TRITON_CHUNKS = {"ppo": (423, 768), "aepo": (400, 2048), "gppo": (423, 4096), "cispo": (423, 448)}


@pytest.mark.parametrize("clip", CLIPS)
def test_triton_every_clip_rule_odd_shapes_matches_the_reference(clip):
    """The loss through the Triton gradient pass (backend="triton") at V = 2,053, D = 24, N = 423
    in fp32, bias, KL, entropy bonus, entropy-aware advantage, dual clip, masked rows and rows
    without a target (label -100), one to 33 vocabulary chunks: loss, gradients and statistics
    against the float64 reference on the same fp32 values, within the fp32 tolerances of the torch
    pass's test, and as close to it as the torch vocab-outer pass."""
    head = _triton_head()
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, torch.float32, seed=20 + CLIPS.index(clip))
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3, entropy_coef=0.01, kl_coef=0.05,
                     dual_clip=3.0 if clip in ("ppo", "aepo") else 0.0)
    token_chunk, vocab_chunk = TRITON_CHUNKS[clip]
    columns = head.head_vocab_columns(423, 2053, 24, 4, token_chunk, vocab_chunk)
    assert columns == {"ppo": 768, "aepo": 2048, "gppo": 2053, "cispo": 448}[clip]
    chunks = dict(token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    want = _grads(_reference(cfg, labels, old, adv, mask, ref, 0.7), hidden, weight, bias)
    got = _grads(_fused("vocab_outer", cfg, labels, old, adv, mask, ref, 0.7, backend="triton", **chunks),
                 hidden, weight, bias)
    torch_pass = _grads(_fused("vocab_outer", cfg, labels, old, adv, mask, ref, 0.7, backend="torch", **chunks),
                        hidden, weight, bias)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, t, r in zip(got[1], torch_pass[1], want[1]):
        scale = r.abs().max()
        torch.testing.assert_close(g, r, atol=1e-4 * scale, rtol=1e-4)
        assert (g - r).abs().max() <= 2 * (t - r).abs().max() + 1e-5 * scale
    for key in ("entropy", "ratio", "clipfrac_high", "clipfrac_low", "kl"):
        torch.testing.assert_close(got[2][key].double(), want[2][key].double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,softcap", [(torch.bfloat16, None), (torch.float16, 20.0)])
def test_triton_low_precision_is_as_close_to_float64_as_the_torch_pass(dtype, softcap):
    """bf16 and fp16 (with a soft cap) hidden states and weights, V = 2,053, D = 24, N = 423, bias
    and KL on, 3 vocabulary chunks of 768 columns: the Triton pass's loss and gradients within the
    bf16 bounds of the torch pass's test of the float64 maths on the same rounded inputs, and no
    further from it than twice the torch vocab-outer pass's error (plus a hair of the largest
    gradient). (bf16 with the soft cap and KL is left out: there the bf16 logits of the statistics
    pass move ratios across the clip and every order is ~12% off the float64 gradient alike.)"""
    _triton_head()
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, dtype, seed=31)
    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.3, entropy_coef=0.01, kl_coef=0.05)
    chunks = dict(token_chunk=423, vocab_chunk=768)
    want = _grads(_reference(cfg, labels, old, adv, mask, ref, 0.9, softcap=softcap), hidden, weight, bias)
    got, torch_pass = (_grads(_fused("vocab_outer", cfg, labels, old, adv, mask, ref, 0.9, softcap=softcap,
                                     backend=backend, **chunks), hidden, weight, bias)
                       for backend in ("triton", "torch"))
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=2e-3)
    for g, t, r in zip(got[1], torch_pass[1], want[1]):
        scale = r.abs().max()
        err, err_torch = (g - r).abs().max(), (t - r).abs().max()
        assert err <= 5e-2 * scale, (float(err), float(scale))
        assert err <= 2 * err_torch + 1e-3 * scale, (float(err), float(err_torch))


def _pass_inputs(n, d, vocab, seed, softcap, bias_on=True):
    """float64 inputs of a gradient pass with its statistics and upstream coefficients: rows
    without a target, a -inf bias column (a masked vocabulary entry)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=gen, dtype=torch.float64) * (3 / d**0.5)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias_on else None
    if bias is not None:
        bias[5] = float("-inf")
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[labels == 5] = 6
    labels[::7] = -100
    valid = labels >= 0
    inv_t, tanh_scale = (4.0 / 1.3, 0.25) if softcap else (1 / 0.8, None)
    lse, eu, _ = fused_linear.stats_pass(hidden, weight, bias, labels, valid, inv_t, tanh_scale, 64, 300)
    g_lp = torch.where(valid, torch.randn(n, generator=gen, dtype=torch.float64), 0.0)
    g_h = torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale


@pytest.mark.parametrize("softcap", [False, True])
def test_triton_gradient_pass_is_the_torch_pass_in_fp32(softcap):
    """triton_gradient_pass against fused_linear.gradient_pass in float64 on the same fp32 values
    and statistics (V = 2,053, D = 24, N = 423; 3 chunks of 768 columns, the last of 517), a -inf
    bias entry and rows without a target: within 2e-6 of the largest gradient; deterministic
    (bitwise the same on a second run); the -inf column gets exactly 0; each subset of ``need``
    gives the same tensors and None for the others; bias None gives no d_bias."""
    head = _triton_head()
    hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale = _pass_inputs(423, 24, 2053, 3, softcap)
    h32, w32, b32 = hidden.float(), weight.float(), bias.float()
    want = fused_linear.gradient_pass(h32.double(), w32.double(), b32.double(), labels, valid, lse, eu, g_lp, g_h,
                                      inv_t, tanh_scale, 64, 300)
    f32 = [t.float() for t in (lse, eu, g_lp, g_h)]

    def run(need=(True, True, True), b=b32):
        return head.triton_gradient_pass(h32, w32, b, labels, valid, *f32, inv_t, tanh_scale, 768, need=need)

    got = run()
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, atol=2e-6 * r.abs().max(), rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(run(), got))
    assert got[1][5].abs().max() == 0 and got[2][5] == 0
    for need in ((True, False, False), (False, False, True)):  # (False, True, False): as bias None below
        part = run(need)
        assert all((p is None) != n for p, n in zip(part, need))
        assert all(torch.equal(p, g) for p, g in zip(part, got) if p is not None)
    no_bias = run(b=None)
    assert no_bias[2] is None and no_bias[0].shape == got[0].shape and no_bias[1].shape == got[1].shape


def test_triton_gradient_pass_bf16_with_fp32_master_weights():
    """bf16 hidden states beside an fp32 weight and bias (fp32 master weights): the kernels cast the
    weight to bf16 as they load it, as the torch pass casts its blocks; d_W comes back fp32,
    d_hidden bf16, both as close to the float64 maths of the bf16-cast operands as the torch
    pass's (within twice its error plus a hair); 3 chunks of 768 columns."""
    head = _triton_head()
    hidden, weight, bias, labels, valid, lse, eu, g_lp, g_h, inv_t, tanh_scale = _pass_inputs(423, 24, 2053, 4, False)
    h16, w32, b32 = hidden.bfloat16(), weight.float(), bias.float()
    exact = fused_linear.gradient_pass(h16.double(), w32.bfloat16().double(), b32.bfloat16().double(), labels, valid,
                                       lse, eu, g_lp, g_h, inv_t, tanh_scale, 64, 300)
    f32 = [t.float() for t in (lse, eu, g_lp, g_h)]
    torch_pass = fused_linear.gradient_pass(h16, w32, b32, labels, valid, *f32, inv_t, tanh_scale, 423, 768,
                                            in_place=True)
    got = head.triton_gradient_pass(h16, w32, b32, labels, valid, *f32, inv_t, tanh_scale, 768)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    for g, t, r in zip(got, torch_pass, exact):
        scale = r.abs().max()
        err, err_torch = (g.double() - r).abs().max(), (t.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-3 * scale, (float(err), float(err_torch), float(scale))


def test_triton_is_the_gradient_pass_backend_triton_runs_and_torch_stays_selectable(monkeypatch):
    """backend="triton" runs the Triton gradient pass (once per call, one loss); "torch" and the CPU
    default ("auto" off CUDA) run fused_linear.gradient_pass; filter_eps and fp64 fall back to it
    (triton_head.supports); both give the same loss and gradients."""
    head = _triton_head()
    calls = []
    real_triton, real_torch = head.triton_gradient_pass, fused_linear.gradient_pass
    monkeypatch.setattr(head, "triton_gradient_pass", lambda *a, **k: calls.append("triton") or real_triton(*a, **k))
    monkeypatch.setattr(fused_linear, "gradient_pass", lambda *a, **k: calls.append("torch") or real_torch(*a, **k))
    hidden, weight, bias, labels, old, adv, mask, _ = _inputs(40, 16, 203, torch.float32, seed=2)
    cfg = LossConfig(clip="aepo")

    def run(dtype=torch.float32, **kw):
        calls.clear()
        out = _grads(_fused("vocab_outer", cfg, labels, old, adv, mask, None, 1.0, token_chunk=16, vocab_chunk=64,
                            **kw), hidden.to(dtype), weight.to(dtype), bias.to(dtype))
        return out, list(calls)

    (tri, which_tri), (tor, which_tor) = run(backend="triton"), run(backend="torch")
    assert (which_tri, which_tor, run()[1]) == (["triton"], ["torch"], ["torch"])
    assert run(backend="triton", filter_eps=1e-30)[1] == ["torch"]
    assert run(torch.float64, backend="triton")[1] == ["torch"]
    torch.testing.assert_close(tri[0], tor[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(tri[1], tor[1]):
        torch.testing.assert_close(a, b, atol=1e-6 * b.abs().max(), rtol=1e-5)


def test_triton_head_columns_rule():
    """The dlogits buffer's columns: within the torch pass's block bytes, capped at vocab_chunk,
    a multiple of 64 below V, all of V when it fits."""
    from aepo_kernels.triton_head import head_vocab_columns

    # the paper preset's micro-batch (N = 16,384, D = 5,120, bf16, default blocks 2,048 x 4,096)
    cols = head_vocab_columns(16384, 151936, 5120, 2, 2048, 4096)
    assert cols == 3072 and 16384 * cols * 2 <= 2048 * 4096 * 2 + 4096 * 5120 * 4
    assert head_vocab_columns(100, 2053, 24, 4, 100, 4096) == 2053
    assert head_vocab_columns(10**6, 151936, 64, 2, 2048, 4096) == 64  # at least one aligned block
    assert head_vocab_columns(423, 2053, 24, 4, 100, 512) % 64 == 0
