"""The lean vocabulary-outer head (``head_backward="vocab_outer_lean"``, issue 54, docs/head.md):
d_W vocabulary-outer, d_hidden from a token-outer pass of its own, neither an fp32 ``[V, D]`` nor an
fp32 ``[N, D]`` tensor. Against the float64 reference (:mod:`aepo_kernels.reference`), against the
other two orders, its matmul count, its measured peak against the memory plan's term, its options
and its refusals. Helpers are those of tests/test_kernels_vocab_outer.py."""
from __future__ import annotations

import pytest
import torch

from aepo_kernels import LossConfig, fused_linear_aepo_policy_loss
from aepo_kernels import fused_linear

from test_kernels_vocab_outer import CLIPS, _fused, _grads, _inputs, _MatmulFlops, _reference

LEAN = "vocab_outer_lean"


def _close(got, want, atol=1e-12, rtol=1e-10):
    """Loss and the three gradients of :func:`_grads` results."""
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=rtol)
    for g, r in zip(got[1], want[1]):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize("clip", CLIPS)
def test_float64_every_clip_rule_odd_shapes_matches_the_reference_and_the_other_orders(clip):
    """V = 2,053, D = 24, N = 423 (odd against every block: 7 token chunks of 61 rows, 7 vocabulary
    blocks of 300 columns), bias, KL, entropy bonus, the entropy-aware advantage and the dual clip
    on, masked rows and rows without a target: float64 to 1e-10 of the reference, and the same
    loss, gradients and statistics as token_outer and vocab_outer."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, torch.float64, seed=CLIPS.index(clip))
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3, entropy_coef=0.01, kl_coef=0.05,
                     dual_clip=3.0 if clip in ("ppo", "aepo") else 0.0)
    want = _grads(_reference(cfg, labels, old, adv, mask, ref, 0.7), hidden, weight, bias)
    got = _grads(_fused(LEAN, cfg, labels, old, adv, mask, ref, 0.7, token_chunk=61, vocab_chunk=300),
                 hidden, weight, bias)
    _close(got, want)
    for order in ("token_outer", "vocab_outer"):
        other = _grads(_fused(order, cfg, labels, old, adv, mask, ref, 0.7, token_chunk=61, vocab_chunk=300),
                       hidden, weight, bias)
        _close(got, other, atol=1e-13, rtol=1e-12)
    for key in ("entropy", "ratio", "clipfrac_high", "clipfrac_low", "kl"):
        torch.testing.assert_close(got[2][key].double(), want[2][key].double(), atol=1e-10, rtol=1e-10)


def test_float64_gradcheck_with_soft_cap_logit_scale_and_bias():
    """Numerical gradients of hidden, weight and bias (ppo with bounds that never clip, entropy
    shaping off: the loss is the function autograd differentiates), soft cap and logit scale on."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(9, 5, 37, torch.float64, seed=7)
    cfg = LossConfig(clip="ppo", entropy_adv_alpha=0.0, entropy_coef=0.1, kl_coef=0.2, eps_high=10.0, eps_low=0.9,
                     dual_clip=0.0)
    fn = _fused(LEAN, cfg, labels, old, adv, mask, ref, 1.3, softcap=4.0, token_chunk=4, vocab_chunk=10,
                logit_scale=0.7)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    assert torch.autograd.gradcheck(lambda h, w, b: fn(h, w, b)[0], leaves)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip", CLIPS)
def test_fp32_and_bf16_are_as_close_to_float64_as_the_token_outer_head(dtype, clip):
    """At V = 2,053, D = 24, N = 423 in fp32 and bf16: the loss and gradients within the
    fused-linear tests' tolerances of the float64 maths on the same (rounded) inputs, no further
    from it than twice the token-outer head's error (plus a hair of the largest gradient), and in
    fp32 the token-outer head's loss and gradients."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(423, 24, 2053, dtype, seed=11 + CLIPS.index(clip))
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.3, entropy_coef=0.01)
    want = _grads(_reference(cfg, labels, old, adv, mask, None, 0.9), hidden, weight, bias)
    lean = _grads(_fused(LEAN, cfg, labels, old, adv, mask, None, 0.9, token_chunk=100, vocab_chunk=512),
                  hidden, weight, bias)
    to = _grads(_fused("token_outer", cfg, labels, old, adv, mask, None, 0.9, token_chunk=100), hidden, weight, bias)
    loss_tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lean[0], want[0], **loss_tol)
    torch.testing.assert_close(lean[0], to[0], **loss_tol)
    for g_lean, g_to, r in zip(lean[1], to[1], want[1]):
        scale = r.abs().max()
        err_lean, err_to = (g_lean - r).abs().max(), (g_to - r).abs().max()
        if dtype == torch.float32:
            torch.testing.assert_close(g_lean, r, atol=1e-4 * scale, rtol=1e-4)
            torch.testing.assert_close(g_lean, g_to, atol=1e-4 * scale, rtol=1e-4)
        else:
            assert err_lean <= 5e-2 * scale
        assert err_lean <= 2 * err_to + 1e-3 * scale, (float(err_lean), float(err_to))


def test_fp32_master_weights_with_bf16_hidden_states():
    """bf16 hidden states beside an fp32 weight and bias (fp32 master weights): the blocks of W are
    cast to bf16 for the matmuls, d_W comes back fp32 and d_hidden bf16, as close to the float64
    maths of the bf16-cast operands as token_outer's (within twice its error plus a hair)."""
    hidden, weight, bias, labels, old, adv, mask, _ = _inputs(423, 24, 2053, torch.float64, seed=4)
    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.3, kl_coef=0.0)
    h16, w32, b32 = hidden.bfloat16(), weight.float(), bias.float()
    want = _grads(_reference(cfg, labels, old, adv, mask, None, 1.0), h16.double(), w32.bfloat16().double(),
                  b32.bfloat16().double())
    leaves = [h16.clone().requires_grad_(), w32.clone().requires_grad_(), b32.clone().requires_grad_()]
    results = {}
    for order in (LEAN, "token_outer"):
        for t in leaves:
            t.grad = None
        loss, _ = _fused(order, cfg, labels, old, adv, mask, None, 1.0, token_chunk=100, vocab_chunk=512)(*leaves)
        loss.backward()
        results[order] = [t.grad for t in leaves]
    assert [g.dtype for g in results[LEAN]] == [torch.bfloat16, torch.float32, torch.float32]
    for g_lean, g_to, r in zip(results[LEAN], results["token_outer"], want[1]):
        scale = r.abs().max()
        err_lean, err_to = (g_lean.double() - r).abs().max(), (g_to.double() - r).abs().max()
        assert err_lean <= 2 * err_to + 1e-3 * scale, (float(err_lean), float(err_to))


def test_options_token_weights_ignore_index_logit_scale_soft_cap_as_token_outer():
    """token_weights, another ignore_index, logit_scale and a soft cap, KL: the lean head's loss,
    gradients and statistics are token_outer's (float64)."""
    hidden, weight, bias, labels, old, adv, mask, ref = _inputs(120, 16, 517, torch.float64, seed=8)
    labels = torch.where(labels == -100, torch.full_like(labels, -1), labels)
    weights = torch.rand(120, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    cfg = LossConfig(clip="gppo", entropy_adv_alpha=0.2, kl_coef=0.1)
    kw = dict(token_weights=weights.float().double(), ignore_index=-1, logit_scale=0.8, token_chunk=32,
              vocab_chunk=128)
    got, want = (_grads(_fused(order, cfg, labels, old, adv, mask, ref, 0.9, softcap=6.0, **kw), hidden, weight, bias)
                 for order in (LEAN, "token_outer"))
    _close(got, want, atol=1e-13, rtol=1e-12)
    for key in ("entropy", "ratio", "kl", "clipfrac_high", "clipfrac_low"):
        torch.testing.assert_close(got[2][key], want[2][key], atol=1e-12, rtol=1e-12)


def _count(order, hidden, weight, bias, labels, old, adv, mask, cfg, needs=(True, True, True), **stats):
    """(matmul flops / 2 N D V, loss, grads or None) of one forward + backward."""
    leaves = [t.clone().requires_grad_(need) for t, need in zip((hidden, weight, bias), needs)]
    with _MatmulFlops() as counter:
        loss, _ = fused_linear_aepo_policy_loss(leaves[0], leaves[1], labels, old, adv, mask, bias=leaves[2],
                                                config=cfg, shift_labels=False, head_backward=order, token_chunk=20,
                                                vocab_chunk=100, **stats)
        loss.backward()
    n, d, vocab = hidden.shape[0], hidden.shape[1], weight.shape[0]
    return counter.flops / (2 * n * d * vocab), loss.detach(), [t.grad for t in leaves]


def test_five_matmuls_two_phase_included_and_fewer_for_frozen_inputs():
    """Every ``mm``/``addmm`` counted: 5 matmuls of 2 N D V flops with the entropy statistics
    supplied and without them (the two-phase path's entropy pass is its statistics pass), the same
    loss and gradients both ways; a frozen weight without a bias gradient runs no d_W pass (3:
    statistics, logits again, d_hidden), a frozen weight with one a d_W pass without the d_W
    matmul (4), a frozen hidden state no d_hidden sweep (3); each frozen run's remaining gradients
    are the full run's."""
    from aepo_kernels import entropy_moments, entropy_stats_from_moments, fused_linear_logprob_entropy

    hidden, weight, bias, labels, old, adv, mask, _ = _inputs(64, 16, 517, torch.float32, seed=3)
    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.4)
    _, entropy = fused_linear_logprob_entropy(hidden, weight, labels, shift_labels=False, bias=bias)
    mean, std = entropy_stats_from_moments(entropy_moments(entropy, mask * (labels != -100)))
    args = (hidden, weight, bias, labels, old, adv, mask, cfg)
    supplied = _count(LEAN, *args, entropy_mean=mean, entropy_std=std)
    two_phase = _count(LEAN, *args)
    assert (supplied[0], two_phase[0]) == (5, 5)
    torch.testing.assert_close(two_phase[1], supplied[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(two_phase[2], supplied[2]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for needs, matmuls in (((True, False, False), 3), ((True, False, True), 4), ((False, True, True), 3)):
        flops, loss, grads = _count(LEAN, *args, needs=needs, entropy_mean=mean, entropy_std=std)
        assert flops == matmuls, (needs, flops)
        assert torch.equal(loss, supplied[1])
        for need, got, full in zip(needs, grads, supplied[2]):
            assert (got is None) != need
            if need:
                torch.testing.assert_close(got, full, atol=1e-7, rtol=1e-6)


@pytest.mark.slow  # ~8-20 s here, most of it compiling the float64 block ops
def test_gradient_filtering_in_both_sweeps_is_vocab_outers(monkeypatch):
    """filter_eps: with the same blocks the lean head skips the same tiles as vocab_outer in each of
    its two gradient sweeps (d_hidden per token chunk, d_W over all tokens) and so returns the same
    filtered gradients (float64, a Zipf-like bias that makes rare blocks' mass small); the tile
    counts of its two sweeps add up (``gradient_pass``'s ``counts``)."""
    n, d, vocab = 96, 16, 1031
    hidden, weight, _, labels, old, adv, mask, _ = _inputs(n, d, vocab, torch.float64, seed=9, logit_std=2.0)
    bias = -3.0 * torch.arange(1, vocab + 1, dtype=torch.float64).log()
    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.3)
    counts = {}
    real = fused_linear.gradient_pass
    monkeypatch.setattr(fused_linear, "gradient_pass", lambda *a, **k: real(*a, **{**k, "counts": counts}))

    def run(order, **kw):
        counts.clear()
        out = _grads(_fused(order, cfg, labels, old, adv, mask, None, 1.0, token_chunk=16, vocab_chunk=64, **kw),
                     hidden, weight, bias)
        return out, dict(counts)

    (lean, lean_counts), (vocab_outer, vo_counts) = run(LEAN, filter_eps=1e-3), run("vocab_outer", filter_eps=1e-3)
    exact, _ = run(LEAN)
    assert 0 < vo_counts["skipped"] < vo_counts["tiles"] == 6 * 17
    assert lean_counts == {k: 2 * v for k, v in vo_counts.items()}
    _close(lean, vocab_outer, atol=1e-14, rtol=1e-12)
    assert (lean[1][0] - exact[1][0]).abs().max() > 0  # something was left out


def test_refusals_and_the_kernel_path():
    """An unknown order names the three; filter_eps must be > 0 (and token_outer has none);
    ``backend="triton"`` runs the lean head's torch passes (no Triton kernel is asked for)."""
    hidden, weight, bias, labels, old, adv, mask, _ = _inputs(40, 8, 203, torch.float32, seed=1)
    call = lambda **kw: fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask,  # noqa: E731
                                                      shift_labels=False, **kw)
    with pytest.raises(ValueError, match="head_backward='lean'.*vocab_outer_lean"):
        call(head_backward="lean")
    for eps in (0.0, -1e-3):
        with pytest.raises(ValueError, match="filter_eps.*must be > 0"):
            call(head_backward=LEAN, filter_eps=eps)
    with pytest.raises(ValueError, match="filter_eps.*vocab_outer_lean"):
        call(head_backward="token_outer", filter_eps=1e-3)
    cfg = LossConfig(clip="aepo")
    torch_pass = _grads(_fused(LEAN, cfg, labels, old, adv, mask, None, 1.0, token_chunk=16, backend="torch"),
                        hidden, weight, bias)
    original = fused_linear._triton_head
    fused_linear._triton_head = lambda: pytest.fail("the lean head asked for the Triton kernels")
    try:
        triton = _grads(_fused(LEAN, cfg, labels, old, adv, mask, None, 1.0, token_chunk=16, backend="triton"),
                        hidden, weight, bias)
    finally:
        fused_linear._triton_head = original
    _close(triton, torch_pass, atol=0, rtol=0)


def test_the_default_rule_and_the_blocks_at_the_paper_preset():
    """One default (``default_head_backward``) for the kernels and the plan: token_outer off CUDA;
    on CUDA vocab_outer where its fp32 [N, D] accumulator and blocks fit HEAD_WORKSPACE_BYTES
    (N = 2,048, D = 1,024 bf16: 40 MiB), else vocab_outer_lean (Qwen3-14B's head at 16,384
    tokens: 416 MiB). The lean blocks there: 708 rows x 1,600 columns, 33 MiB of workspace on
    CUDA, d_W + d_hidden + that = 1.64 GiB (the issue's target: 1.67)."""
    from aepo_engine.memory_plan import lean_head_bytes
    from aepo_kernels.fused_linear import (
        CPU_HEAD_BACKWARD, HEAD_WORKSPACE_BYTES, default_head_backward, lean_chunks, lean_workspace,
        resolve_head_backward, vocab_outer_workspace,
    )

    v, big = 151936, (16384, 151936, 5120, 2)
    assert default_head_backward("cpu", *big) == CPU_HEAD_BACKWARD == "token_outer"
    assert vocab_outer_workspace(2048, v, 1024, 2) == 40 << 20
    assert default_head_backward("cuda", 2048, v, 1024, 2) == "vocab_outer"
    assert vocab_outer_workspace(8192, v, 1024, 2) == HEAD_WORKSPACE_BYTES  # the boundary: still vocab_outer
    assert default_head_backward("cuda", 8192, v, 1024, 2) == "vocab_outer" != default_head_backward(
        "cuda", 8193, v, 1024, 2)
    assert vocab_outer_workspace(*big) == 416 << 20
    assert default_head_backward(torch.device("cuda", 1), *big) == LEAN
    hidden, weight = torch.zeros(3, 4, 8), torch.zeros(11, 8)
    assert resolve_head_backward(None, hidden, weight) == resolve_head_backward("auto", hidden, weight) == "token_outer"
    assert resolve_head_backward(LEAN, hidden, weight) == LEAN
    assert lean_chunks(16384, v, 5120) == (708, 1600)
    assert lean_workspace(*big) <= HEAD_WORKSPACE_BYTES
    outputs = v * 5120 * 2 + 16384 * 5120 * 2
    assert lean_head_bytes(v, 5120, 16384, 2) - outputs == lean_workspace(*big)
    assert 1.63 < lean_head_bytes(v, 5120, 16384, 2) / (1 << 30) < (outputs + (64 << 20)) / (1 << 30) < 1.67
    assert lean_chunks(2048, v, 1024) == (1365, 4096)  # CPU's bench shape: large blocks
    assert lean_chunks(5, 37, 5) == (5, 37)


@pytest.mark.slow  # ~8-10 s per dtype here: five heads at V = 32,768
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_term_is_the_measured_peak(dtype):
    """The lean head's peak above its inputs (malloc's in-use bytes) at V = 32,768, D = 256,
    N = 512, with two workspace budgets (4 MiB: 204-row token chunks and 2,048-column blocks; the
    default): d_W, d_hidden and its workspace as the memory plan's ``lean_head_bytes`` counts them,
    within 2%; below vocab_outer's peak with its blocks of 2 MiB (fp32) and the plans say so too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist_scripts"))
    from memory_measure import HeapMeter

    from aepo_engine.memory_plan import lean_head_bytes, vocab_outer_head_bytes

    n, d, vocab = 512, 256, 32768
    hidden, weight, _, labels, old, adv, mask, _ = _inputs(n, d, vocab, dtype, seed=5, logit_std=1.0)
    meter, peaks = HeapMeter(), {}
    for order, budget in ((LEAN, 4 << 20), (LEAN, None), (LEAN, 4 << 20), (LEAN, None), ("vocab_outer", 2 << 20)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        meter.start()  # (the first run of each compiles; the second is measured)
        loss, _ = fused_linear_aepo_policy_loss(h, w, labels, old, adv, mask, shift_labels=False, head_backward=order,
                                                chunk_bytes=budget, entropy_mean=torch.tensor(2.0),
                                                entropy_std=torch.tensor(1.0))
        loss.backward()
        peaks[order, budget] = meter.stop()
        del loss, h, w
    c = hidden.element_size()
    for budget in (4 << 20, None):
        planned = lean_head_bytes(vocab, d, n, c, budget, cuda=False)
        assert abs(planned - peaks[LEAN, budget]) <= 0.02 * peaks[LEAN, budget], (budget, planned, peaks)
    assert peaks[LEAN, 4 << 20] < peaks["vocab_outer", 2 << 20]
    assert vocab_outer_head_bytes(vocab, d, n, c, 2 << 20, cuda=False) > lean_head_bytes(vocab, d, n, c, 4 << 20,
                                                                                         cuda=False)
