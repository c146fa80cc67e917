"""The one-pass AEPO loss (aepo_kernels.one_pass) against the fp32 reference: values, gradients,
statistics; fused-linear with the gradient in the forward loop; the compile policy."""
import pytest
import torch

from aepo_kernels import LossConfig, aepo_policy_loss, aggregate, fused_linear_aepo_policy_loss
from aepo_kernels import one_pass
from aepo_kernels.compile import CompiledFunction
from aepo_kernels.config import CLIP_RULES, hyper_params
from aepo_kernels.one_pass import aggregation_weights, token_head
from aepo_kernels.reference import aepo_loss_reference, token_loss_reference

from conftest import backend_params, triton_available
from fresh_process import in_fresh_process

# "torch" runs the native C row kernel for fp32 CPU logits (aepo_kernels.native); "torch-compiled"
# is the same backend with it switched off, so the compiled torch path is checked as well.
BACKENDS = ["torch", "torch-compiled"] + (["triton"] if triton_available() else [])
CLIPS = ["ppo", "aepo", "gppo", "cispo"]
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.fixture
def backend(request, monkeypatch):
    if request.param == "torch-compiled":
        monkeypatch.setenv("AEPO_CPU_NATIVE", "0")
        return "torch"
    return request.param


def _batch(seed, batch=3, seq=11, vocab=997, dtype=torch.float32, per_token_adv=False):
    """Random logits (odd V), ignore_index labels, a masked-out sequence, both advantage signs."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq, vocab, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, -1] = -100
    old = torch.log_softmax(logits.float() + 1.5 * torch.randn(batch, seq, vocab, generator=gen), -1)
    old_logprobs = old.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    adv_shape = (batch, seq) if per_token_adv else (batch,)
    advantages = torch.randn(adv_shape, generator=gen) * 2
    mask = (torch.rand(batch, seq, generator=gen) > 0.25).float()
    mask[1] = 0  # a fully masked sequence
    ref = old_logprobs + 0.3 * torch.randn(batch, seq, generator=gen)
    return logits, labels, old_logprobs, advantages, mask, ref


def _reference(logits, labels, old, adv, mask, cfg, temperature, ref):
    leaf = logits.clone().requires_grad_()
    adv = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(old)
    loss = aepo_loss_reference(leaf, labels, old, adv, mask, cfg, temperature, ref_logprobs=ref)
    loss.backward()
    return loss.detach(), leaf.grad


# --- the per-token head --------------------------------------------------------------------------


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("dual_clip,clamp", [(3.0, 20.0), (0.0, 0.4)])
def test_token_head_matches_autograd_of_the_reference(clip, dual_clip, clamp):
    """Explicit derivatives == autograd of reference.token_loss_reference, on every branch:
    |logp - old| up to ~1.5 crosses both clip bounds, the dual clip and (clamp 0.4) the log-ratio clamp."""
    gen = torch.Generator().manual_seed(len(clip) + int(clamp))
    n = 4000
    cfg = LossConfig(clip=clip, dual_clip=dual_clip, log_ratio_clamp=clamp, eps_high=0.28, kl_coef=0.05,
                     entropy_coef=0.01, entropy_adv_alpha=0.3)
    logp = (-torch.rand(n, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    entropy = (torch.rand(n, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, generator=gen, dtype=torch.float64) * 0.6
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    ref = logp.detach() + torch.randn(n, generator=gen, dtype=torch.float64) * 0.5
    mean, std = torch.tensor(1.4, dtype=torch.float64), torch.tensor(0.8, dtype=torch.float64)
    expected = token_loss_reference(logp, entropy, old, adv, torch.ones(n), cfg, mean, std, ref)
    g_logp, g_h = torch.autograd.grad(expected.sum(), (logp, entropy))
    hp = hyper_params(cfg, True, torch.float64, "cpu")
    loss, d_logp, d_h, ratio, shaped, kl = token_head(logp.detach(), entropy.detach(), old, adv, ref, mean, std, hp)
    # float64, so any wrong term is off by far more than 1e-7; not tighter because in about one
    # fresh process in six on this VM torch's float64 exp is only ~3e-9 accurate (measured against
    # math.exp: 3.3e-9 vs 2.2e-16 in the others; the CPU kernel picked at start-up differs), and
    # the two sides take exp of differently clamped inputs.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(d_logp, g_logp, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(d_h, g_h, rtol=1e-7, atol=1e-9)
    delta = ref - logp.detach()
    torch.testing.assert_close(kl, delta.exp() - delta - 1)
    # every branch was visited: both bounds, and (with dual clip on) the dual clip
    assert (ratio > 1.28).any() and (ratio < 0.8).any()
    if dual_clip and clip != "cispo":
        assert ((shaped < 0) & (ratio > dual_clip)).any()


def test_hyper_params_are_made_once_per_setting_and_usable_outside_inference_mode():
    """One tensor per (config, has_ref, dtype, device), shared by every call (on a GPU no host copy
    per micro-batch); its values are the config's in HYPER_PARAMS order, and one first asked for
    under inference_mode still takes part in autograd afterwards."""
    cfg = LossConfig(clip="gppo", eps_low=0.15, eps_high=0.31, dual_clip=2.5, entropy_adv_alpha=0.4, kl_coef=0.02)
    with torch.inference_mode():
        first = hyper_params(cfg, True, torch.float64, "cpu")
    assert hyper_params(cfg, True, torch.float64, torch.device("cpu")) is first
    assert first.tolist() == [0.15, 0.31, 2.5, cfg.log_ratio_clamp, 0.4, 0.02, cfg.entropy_coef,
                              CLIP_RULES.index("gppo"), 1.0]
    others = [hyper_params(cfg, False, torch.float64, "cpu"), hyper_params(cfg, True, torch.float32, "cpu"),
              hyper_params(LossConfig(clip="gppo", eps_low=0.16), True, torch.float64, "cpu")]
    assert all(o is not first for o in others) and others[0][8] == 0.0 and others[2][0] == 0.16
    assert not first.is_inference()
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (x * first[0]).sum().backward()
    assert x.grad.tolist() == [0.15, 0.15]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregation_weights_reproduce_aggregate(aggregation):
    gen = torch.Generator().manual_seed(3)
    token_loss, mask = torch.randn(5, 9, generator=gen), (torch.rand(5, 9, generator=gen) > 0.3).float()
    mask[2] = 0
    cfg = LossConfig(aggregation=aggregation)
    for kwargs in ({}, {"global_token_count": torch.tensor(61.0), "global_num_seqs": 12}):
        expected = aggregate(token_loss, mask, cfg, **kwargs)
        got = (token_loss * aggregation_weights(mask, cfg, **kwargs)).sum()
        torch.testing.assert_close(got, expected)


# --- logits-level one pass -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params(BACKENDS), indirect=True)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_one_pass_matches_reference(backend, clip, aggregation):
    cfg = LossConfig(clip=clip, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01, eps_high=0.28)
    logits, labels, old, adv, mask, ref = _batch(seed=len(clip) * 7 + len(aggregation), per_token_adv=clip == "gppo")
    expected_loss, expected_grad = _reference(logits, labels, old, adv, mask, cfg, 0.8, ref)
    for in_place in (False, True):
        leaf = logits.clone().requires_grad_()
        produced = leaf * 1.0  # a non-leaf, as logits coming out of a model
        loss, stats = aepo_policy_loss(produced, labels, old, adv, mask, config=cfg, temperature=0.8, backend=backend,
                                       inplace_backward=in_place, ref_logprobs=ref, shift_labels=False)
        assert stats["clipfrac_high"] + stats["clipfrac_low"] > 0 and "kl" in stats  # clipping happens
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected_loss, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(leaf.grad, expected_grad, atol=1e-7, rtol=1e-4)
        assert (leaf.grad[1] == 0).all()  # the fully masked sequence gets no gradient


@pytest.mark.parametrize("backend", backend_params(BACKENDS), indirect=True)
@pytest.mark.parametrize("clip", CLIPS)
def test_one_pass_bf16_and_supplied_statistics(backend, clip):
    """bf16 logits, T != 1, global statistics supplied (the trainer's path): against the reference
    evaluated with the same statistics."""
    cfg = LossConfig(clip=clip, entropy_adv_alpha=0.4)
    logits, labels, old, adv, mask, _ = _batch(seed=11 + len(clip), dtype=torch.bfloat16)
    mean, std, count = torch.tensor(5.5), torch.tensor(0.9), torch.tensor(40.0)
    leaf = logits.clone().requires_grad_()
    loss, stats = aepo_policy_loss(leaf, labels, old, adv, mask, config=cfg, temperature=1.3, backend=backend,
                                   entropy_mean=mean, entropy_std=std, global_token_count=count, shift_labels=False)
    loss.backward()
    ref_leaf = logits.clone().requires_grad_()
    from aepo_kernels.reference import logprob_entropy_reference

    logp, entropy = logprob_entropy_reference(ref_leaf, labels, 1.3)
    mask = mask * (labels != -100)  # no target: out of the loss whatever the mask says
    token_loss = token_loss_reference(logp, entropy, old, adv.unsqueeze(-1).expand_as(old), mask, cfg, mean, std)
    expected = (token_loss * mask).sum() / count
    expected.backward()
    assert leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-4)
    scale = ref_leaf.grad.float().abs().max()
    torch.testing.assert_close(leaf.grad.float(), ref_leaf.grad.float(), atol=2e-2 * scale, rtol=2 ** -7 * 1.01)
    torch.testing.assert_close(stats["entropy"], (entropy * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows_per_chunk", [1, 4, None])
@pytest.mark.parametrize("in_place", [False, True])
def test_cpu_row_chunks_match_the_reference(monkeypatch, rows_per_chunk, in_place):
    """The CPU path's row chunks (a whole sequence by default; AEPO_CPU_CHUNK_ELEMS for smaller
    ones): 11-row sequences cut into 1-row and 4-row chunks (a 3-row tail) give the reference's
    loss and gradient, with the masked sequence, an ignore_index label and odd V."""
    monkeypatch.setenv("AEPO_CPU_NATIVE", "0")  # the compiled path's chunks (the native kernel works per row)
    if rows_per_chunk is not None:
        monkeypatch.setenv("AEPO_CPU_CHUNK_ELEMS", str(rows_per_chunk * 1009))
    cfg = LossConfig(kl_coef=0.1)
    logits, labels, old, adv, mask, ref = _batch(seed=23 + (rows_per_chunk or 0), vocab=1009)
    expected_loss, expected_grad = _reference(logits, labels, old, adv, mask, cfg, 0.9, ref)
    leaf = logits.clone().requires_grad_()
    loss, _ = aepo_policy_loss(leaf * 1.0, labels, old, adv, mask, config=cfg, temperature=0.9, backend="torch",
                               inplace_backward=in_place, ref_logprobs=ref, shift_labels=False)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, expected_grad, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("backend", backend_params(BACKENDS), indirect=True)
def test_strided_logits_and_flat_inputs(backend):
    """logits[:, :-1] (strided token dim, not copied), and [N, V] / [N] inputs."""
    cfg = LossConfig()
    logits, labels, old, adv, mask, _ = _batch(seed=5, seq=8)
    full = logits.clone().requires_grad_()
    view = full[:, :-1]
    loss, _ = aepo_policy_loss(view, labels[:, :-1], old[:, :-1], adv, mask[:, :-1], config=cfg, backend=backend, shift_labels=False)
    loss.backward()
    expected_loss, expected_grad = _reference(logits[:, :-1], labels[:, :-1], old[:, :-1], adv, mask[:, :-1], cfg, 1.0, None)
    torch.testing.assert_close(loss.detach(), expected_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(full.grad[:, :-1], expected_grad, atol=1e-7, rtol=1e-4)
    assert (full.grad[:, -1] == 0).all()
    flat = logits.reshape(-1, logits.shape[-1]).clone().requires_grad_()
    adv_tokens = adv.unsqueeze(-1).expand_as(old).reshape(-1)
    loss_flat, _ = aepo_policy_loss(flat, labels.reshape(-1), old.reshape(-1), adv_tokens, mask.reshape(-1), config=cfg, backend=backend, shift_labels=False)
    expected_flat, _ = _reference(logits, labels, old, adv, mask, cfg, 1.0, None)
    torch.testing.assert_close(loss_flat.detach(), expected_flat, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", backend_params(BACKENDS), indirect=True)
def test_fully_masked_micro_batch(backend):
    logits, labels, old, adv, mask, _ = _batch(seed=8)
    leaf = logits.clone().requires_grad_()
    loss, stats = aepo_policy_loss(leaf, labels, old, adv, torch.zeros_like(mask), backend=backend, global_token_count=torch.tensor(50.0), shift_labels=False)
    loss.backward()
    assert loss.item() == 0 and (leaf.grad == 0).all() and stats["num_tokens"].item() == 0
    assert all(torch.isfinite(v) for v in stats.values())


def test_in_place_writes_the_gradient_and_guards_earlier_users():
    logits, labels, old, adv, mask, _ = _batch(seed=9)
    leaf = logits.clone().requires_grad_()
    produced = leaf * 2.0
    loss, _ = aepo_policy_loss(produced, labels, old, adv, mask, backend="torch", inplace_backward=True, shift_labels=False)
    # the buffer now holds dL/dlogits (chain rule: leaf.grad = 2 * that)
    loss.backward()
    torch.testing.assert_close(leaf.grad, 2.0 * produced.detach())
    leaf2 = logits.clone().requires_grad_()
    produced2 = leaf2 * 2.0
    other = (produced2 * produced2).sum()  # saved `produced2` before the loss overwrote it
    loss2, _ = aepo_policy_loss(produced2, labels, old, adv, mask, backend="torch", inplace_backward=True, shift_labels=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss2 + other).backward()


def test_float64_gradcheck_cpu_path():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 4, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    labels[1, 3] = -100
    old = -torch.rand(2, 4, dtype=torch.float64, generator=gen) * 3
    adv = torch.tensor([1.5, -0.7], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.float64)
    ref = old + 0.2
    # Finite differences see values only, so the check uses the rule whose gradient is the true
    # derivative of its value: ppo, alpha_H = 0. The stop-gradients (sg(H) in the shaped advantage,
    # the aepo/gppo bounds, the cispo weight) are checked against the reference's autograd above.
    for clip in ("ppo",):
        cfg = LossConfig(clip=clip, aggregation="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.05, eps_low=0.5,
                         eps_high=0.5, entropy_adv_alpha=0.0)
        fn = lambda z: aepo_policy_loss(z, labels, old, adv, mask, config=cfg, temperature=0.7, backend="torch",  # noqa: E731
                                        entropy_mean=torch.tensor(2.0), entropy_std=torch.tensor(0.5), ref_logprobs=ref, shift_labels=False)[0]
        assert torch.autograd.gradcheck(fn, (logits,))


# --- fused-linear: the gradient in the forward loop ----------------------------------------------


def _linear_inputs(n, d, vocab, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) / d**0.5 * 3).to(dtype)
    bias = torch.randn(vocab, generator=gen).to(dtype)
    return hidden, weight, bias


@pytest.mark.parametrize("backend", backend_params(BACKENDS), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clip,aggregation", [("aepo", "token-mean"), ("ppo", "seq-mean-token-mean"),
                                              ("gppo", "seq-mean-token-sum-norm"), ("cispo", "token-mean")])
def test_fused_linear_matches_reference(backend, dtype, clip, aggregation):
    batch, seq, d, vocab = 3, 9, 24, 1003
    hidden, weight, bias = _linear_inputs(batch * seq, d, vocab, dtype, seed=len(clip))
    _, labels, old, adv, mask, ref = _batch(seed=len(aggregation), batch=batch, seq=seq, vocab=vocab)
    cfg = LossConfig(clip=clip, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss, stats = fused_linear_aepo_policy_loss(
        leaves[0].reshape(batch, seq, d), leaves[1], labels, old, adv, mask, config=cfg, temperature=0.9,
        bias=leaves[2], backend=backend, token_chunk=7, vocab_chunk=300, ref_logprobs=ref, shift_labels=False)
    (3.0 * loss).backward()  # a non-unit incoming gradient: backward scales
    # The oracle: the logits a head in the inputs' dtype computes (nn.Linear; the fused matmuls run
    # in that dtype too), then the fp32 reference loss.
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(*ref_leaves).float().reshape(batch, seq, vocab)
    expected = aepo_loss_reference(logits, labels, old, adv.unsqueeze(-1).expand_as(old), mask, cfg, 0.9, ref_logprobs=ref)
    (3.0 * expected).backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-4)
    assert stats["clipfrac_high"] > 0
    for got, want in zip(leaves, ref_leaves):
        assert got.grad.dtype == dtype
        want_grad = want.grad.float()
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2 * want_grad.abs().max(), rtol=2e-2)
        torch.testing.assert_close(got.grad.float(), want_grad, **tol)


def test_fused_linear_micro_batch_invariance_and_budget():
    """Micro-batches with global statistics sum to the whole batch; the chunk from a tiny byte
    budget (1 row) gives the same result as one big chunk."""
    hidden, weight, _ = _linear_inputs(8 * 6, 16, 211, torch.float32, seed=2)
    _, labels, old, adv, mask, _ = _batch(seed=21, batch=8, seq=6, vocab=211)
    cfg = LossConfig()
    h = hidden.reshape(8, 6, 16)
    from aepo_kernels import entropy_moments, entropy_stats_from_moments, fused_linear_logprob_entropy

    with torch.no_grad():
        _, entropy = fused_linear_logprob_entropy(h, weight, labels, shift_labels=False)
    mean, std = entropy_stats_from_moments(entropy_moments(entropy, mask))
    w_whole = weight.clone().requires_grad_()
    whole, _ = fused_linear_aepo_policy_loss(h, w_whole, labels, old, adv, mask, config=cfg, entropy_mean=mean,
                                             entropy_std=std, chunk_bytes=211 * 4, shift_labels=False)
    whole.backward()
    w_split = weight.clone().requires_grad_()
    total = 0.0
    for i in range(0, 8, 2):
        part, _ = fused_linear_aepo_policy_loss(
            h[i:i + 2], w_split, labels[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], config=cfg,
            entropy_mean=mean, entropy_std=std, global_token_count=mask.sum(), shift_labels=False)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w_split.grad, w_whole.grad, atol=1e-7, rtol=1e-5)
    # the two-phase path (statistics of this call) equals the supplied-statistics path here
    w_two = weight.clone().requires_grad_()
    two_phase, _ = fused_linear_aepo_policy_loss(h, w_two, labels, old, adv, mask, config=cfg, shift_labels=False)
    two_phase.backward()
    torch.testing.assert_close(two_phase.detach(), whole.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w_two.grad, w_whole.grad, atol=1e-7, rtol=1e-4)


def test_fused_linear_float64_gradcheck():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(13, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 13, (2, 5), generator=gen)
    labels[0, 0] = -100
    old = -torch.rand(2, 5, dtype=torch.float64, generator=gen) * 3
    adv = torch.tensor([0.8, -1.1], dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    cfg = LossConfig(clip="ppo", entropy_coef=0.1, eps_low=0.6, eps_high=0.6, entropy_adv_alpha=0.0)  # see above
    fn = lambda h, w, b: fused_linear_aepo_policy_loss(  # noqa: E731
        h, w, labels, old, adv, mask, config=cfg, temperature=1.4, bias=b, backend="torch", token_chunk=3, shift_labels=False,
        )[0]
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


# --- compile policy ------------------------------------------------------------------------------


def test_cpu_path_runs_compiled_and_hyper_parameters_do_not_recompile():
    from torch._dynamo.utils import counters

    logits, labels, old, adv, mask, ref = _batch(seed=4)
    aepo_policy_loss(logits.clone().requires_grad_(), labels, old, adv, mask, backend="torch", shift_labels=False)[0].backward()
    assert one_pass.fast_row_head.mode == "compiled"
    graphs = counters["stats"]["unique_graphs"]
    for cfg in (LossConfig(clip="ppo", eps_high=0.3), LossConfig(clip="cispo", entropy_adv_alpha=0.7, kl_coef=0.2),
                LossConfig(clip="gppo", dual_clip=0.0, entropy_coef=0.1)):
        z = logits.clone().requires_grad_()
        aepo_policy_loss(z, labels, old, adv, mask, config=cfg, backend="torch", ref_logprobs=ref,
                         temperature=0.6, shift_labels=False)[0].backward()
    assert counters["stats"]["unique_graphs"] == graphs  # new values, new rule: no recompile


def test_compile_failure_is_loud_and_eager_is_opt_in(monkeypatch):
    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(RuntimeError, match="AEPO_TORCH_COMPILE=0"):
        CompiledFunction(breaks)(torch.zeros(3))
    monkeypatch.setenv("AEPO_TORCH_COMPILE", "0")
    eager = CompiledFunction(breaks)
    torch.testing.assert_close(eager(torch.zeros(3)), torch.ones(3))
    assert eager.mode == "eager"


def test_bad_inputs_say_what_is_wrong():
    logits, labels, old, adv, mask, _ = _batch(seed=1)
    with pytest.raises(ValueError, match="advantages"):
        aepo_policy_loss(logits, labels, old, adv[:2], mask, shift_labels=False)
    with pytest.raises(ValueError, match="old_logprobs"):
        aepo_policy_loss(logits, labels, old[:2], adv, mask, shift_labels=False)
    with pytest.raises(ValueError, match="ref_logprobs"):
        aepo_policy_loss(logits, labels, old, adv, mask, config=LossConfig(kl_coef=0.1), shift_labels=False)
    with pytest.raises(ValueError, match="temperature"):
        aepo_policy_loss(logits, labels, old, adv, mask, temperature=0.0, shift_labels=False)


@pytest.mark.slow
@in_fresh_process
def test_callers_torch_compile_fullgraph_traces_through_the_loss():
    """torch.compile(fullgraph=True) of a caller's step containing aepo_policy_loss: the custom op
    is opaque to the compiler; value and gradient equal the eager path (supplied statistics and
    the two-phase path)."""
    logits, labels, old, adv, mask, ref = _batch(seed=31)
    for kwargs in (dict(entropy_mean=torch.tensor(6.0), entropy_std=torch.tensor(0.7), global_token_count=mask.sum()), {}):
        cfg = LossConfig(clip="gppo", kl_coef=0.05)

        def step(z):
            return aepo_policy_loss(z * 1.0, labels, old, adv, mask, config=cfg, backend="torch", ref_logprobs=ref, shift_labels=False, **kwargs)

        z_eager, z_compiled = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        expected, expected_stats = step(z_eager)
        expected.backward()
        got, stats = torch.compile(step, fullgraph=True)(z_compiled)
        got.backward()
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(stats["clipfrac_high"], expected_stats["clipfrac_high"])
        torch.testing.assert_close(z_compiled.grad, z_eager.grad)
