"""The input contract of the public entry points (kernels/contract.py, docs/library.md).

Every public path refuses a bad input with a message naming the function, the argument, what was
given and what is expected: labels equal to V or negative (not ``ignore_index``), int logits,
float labels, wrong shapes (in the caller's shapes, flattened logits included), hidden and weight
in Liger's order, masks and token weights that are negative or not finite, a missing or non-bool
``shift_labels``. Where the check is deferred (CUDA, a caller's torch.compile) an out-of-range
label is still never counted: the loss, its gradient, the token count and the entropy statistics
equal those of the same batch with that position masked out, and every backend's row kernel gives
a row without a target no loss and no gradient whatever its weight. Masks are weights: weight 2 is
the token counted twice.
"""
from __future__ import annotations

import pytest
import torch

from aepo_kernels import (
    AEPOLoss, LossConfig, aepo_policy_loss, contract, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy,
    logprob_entropy, policy_loss_from_logprobs,
)
from aepo_kernels.one_pass import one_pass_rows
from aepo_kernels.row_inputs import RowInputs

from conftest import backend_params, triton_available

V, D = 37, 6
CFG = LossConfig(entropy_coef=0.01, kl_coef=0.0)


def _case(seed=0, batch=2, seq=5):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, D, generator=gen)
    weight = torch.randn(V, D, generator=gen)
    labels = torch.randint(0, V, (batch, seq), generator=gen)
    old = -torch.rand(batch, seq, generator=gen) * 3
    adv = torch.randn(batch, seq, generator=gen)
    mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    return hidden, weight, labels, old, adv, mask


# Every public entry point as a function of (labels, loss_mask, **overrides), so one bad input is
# tried on all of them. "stats": the entropy statistics supplied (one pass) or not (two-phase).
def _entry_points():
    hidden, weight, labels, old, adv, mask = _case()
    logits = hidden @ weight.T
    stats = dict(entropy_mean=torch.tensor(2.0), entropy_std=torch.tensor(0.5))

    def loss_logits(y=labels, m=mask, z=logits, **kw):
        return aepo_policy_loss(z, y, old, adv, m, **{"shift_labels": False, "config": CFG, **kw})

    def loss_fused(y=labels, m=mask, h=hidden, w=weight, **kw):
        return fused_linear_aepo_policy_loss(h, w, y, old, adv, m, **{"shift_labels": False, "config": CFG, **kw})

    return {
        "aepo_policy_loss": loss_logits,
        "aepo_policy_loss+stats": lambda **kw: loss_logits(**stats, **kw),
        "fused_linear_aepo_policy_loss": loss_fused,
        "fused_linear_aepo_policy_loss+stats": lambda **kw: loss_fused(**stats, **kw),
        "logprob_entropy": lambda y=labels, m=None, z=logits, **kw: logprob_entropy(z, y, **{"shift_labels": False, **kw}),
        "fused_linear_logprob_entropy": lambda y=labels, m=None, h=hidden, w=weight, **kw: fused_linear_logprob_entropy(
            h, w, y, **{"shift_labels": False, **kw}),
        "AEPOLoss": lambda y=labels, m=mask, z=logits, **kw: AEPOLoss(CFG, shift_labels=False)(z, y, old, adv, m, **kw),
    }


ENTRY_POINTS = list(_entry_points())


def _name(entry: str) -> str:
    return {"AEPOLoss": "aepo_policy_loss"}.get(entry, entry.split("+")[0])


# --- labels -------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("bad", [V, -5, V + 1000])
def test_out_of_range_labels_are_refused_everywhere(entry, bad):
    """Old code: 12 of these 14-odd calls returned a loss (label V got log-prob 0 and counted)."""
    labels = _case()[2].clone()
    labels[1, 3] = bad
    with pytest.raises(ValueError) as err:
        _entry_points()[entry](y=labels)
    message = str(err.value)
    assert message.startswith(f"{_name(entry)}(): labels") and f"[0, {V})" in message and "ignore_index=-100" in message
    assert f"the first {bad} at (1, 3)" in message


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_ignore_index_and_a_custom_one_are_accepted(entry):
    labels = _case()[2].clone()
    labels[0, 1] = -100
    _entry_points()[entry](y=labels)
    labels[0, 1] = -1
    _entry_points()[entry](y=labels, ignore_index=-1)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        labels[0, 2] = -100  # no longer the ignore index
        _entry_points()[entry](y=labels, ignore_index=-1)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_labels_are_refused(entry, dtype):
    labels = _case()[2].to(dtype)
    with pytest.raises(TypeError, match=rf"{_name(entry)}\(\): labels must be an integer tensor .* got {dtype}"):
        _entry_points()[entry](y=labels)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if "fused" not in e])
def test_integer_logits_are_refused(entry):
    logits = torch.randint(0, 5, (2, 5, V))
    with pytest.raises(TypeError, match=rf"{_name(entry)}\(\): logits must be a floating-point tensor .* got torch.int64"):
        _entry_points()[entry](z=logits)


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if "fused" not in e])
def test_flattened_logits_are_named_in_the_callers_shapes(entry):
    """[B*T, V] logits with [B, T] labels: the message shows both as given, not reshaped."""
    logits = torch.randn(10, V)
    with pytest.raises(ValueError) as err:
        _entry_points()[entry](z=logits)
    assert str(err.value) == (f"{_name(entry)}(): labels [2, 5] must be shaped like the leading dims of logits, "
                              f"[10] (logits is [10, {V}])")


@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if "fused" in e])
def test_hidden_and_weight_in_ligers_order_are_refused(entry):
    hidden, weight = _case()[:2]
    with pytest.raises(ValueError) as err:
        _entry_points()[entry](h=weight, w=hidden)
    message = str(err.value)
    assert f"got hidden [{V}, {D}] and weight [2, 5, {D}]" in message and "Liger's fused-linear losses take (weight, hidden)" in message
    with pytest.raises(ValueError, match=r"expected hidden \[N, D\] or \[B, T, D\] and the lm_head weight \[V, D\]"):
        _entry_points()[entry](w=weight[:, :-1])


# --- per-token tensors and masks --------------------------------------------------------------------

LOSSES = [e for e in ENTRY_POINTS if "logprob_entropy" not in e]


@pytest.mark.parametrize("entry", LOSSES)
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_negative_or_non_finite_masks_are_refused(entry, value):
    mask = _case()[5].clone()
    mask[0, 4] = value
    with pytest.raises(ValueError, match=rf"{_name(entry)}\(\): loss_mask must hold finite weights >= 0 .* at \(0, 4\)"):
        _entry_points()[entry](m=mask)


@pytest.mark.parametrize("entry", LOSSES)
def test_bool_and_integer_masks_are_masks(entry):
    mask = _case()[5]
    want, _ = _entry_points()[entry](m=mask)
    for cast in (torch.bool, torch.int64, torch.bfloat16):
        got, _ = _entry_points()[entry](m=mask.to(cast))
        torch.testing.assert_close(got, want)
    bad = mask.long()
    bad[1, 2] = -2
    with pytest.raises(ValueError, match=r"loss_mask must hold finite weights >= 0.*; got 1 other value\(s\), the first -2"):
        _entry_points()[entry](m=bad)


@pytest.mark.parametrize("entry", LOSSES)
def test_token_weights_and_stats_masks_are_checked(entry):
    weights = torch.ones(2, 5)
    weights[1, 1] = -0.5
    with pytest.raises(ValueError, match=r"token_weights must hold finite weights >= 0.* the first -0.5 at \(1, 1\)"):
        _entry_points()[entry](token_weights=weights)
    with pytest.raises(ValueError, match=r"token_weights \[2, 4\] must be shaped like labels \[2, 5\]"):
        _entry_points()[entry](token_weights=torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"stats_masks\['branch'\] \[5\] must be shaped like labels \[2, 5\]"):
        _entry_points()[entry](stats_masks={"branch": torch.ones(5)})
    with pytest.raises(TypeError, match=r"ref_logprobs must be a floating-point tensor .* got torch.int64"):
        _entry_points()[entry](ref_logprobs=torch.zeros(2, 5, dtype=torch.long))


def test_per_token_shapes_dtypes_and_devices_name_the_argument():
    hidden, weight, labels, old, adv, mask = _case()
    logits = hidden @ weight.T
    call = lambda *a, **kw: aepo_policy_loss(*a, **{"shift_labels": False, **kw})  # noqa: E731
    with pytest.raises(ValueError, match=r"aepo_policy_loss\(\): old_logprobs \[2, 4\] must be shaped like labels \[2, 5\]$"):
        call(logits, labels, old[:, :4], adv, mask)
    with pytest.raises(ValueError, match=r"advantages \[3\] must be shaped like labels \[2, 5\] or \[B\] = \[2\] per sequence"):
        call(logits, labels, old, adv[0, :3], mask)
    with pytest.raises(TypeError, match=r"advantages must be a floating-point tensor .* got torch.int64"):
        call(logits, labels, old, adv.long(), mask)
    with pytest.raises(ValueError, match=r"loss_mask is on meta, labels on cpu"):
        call(logits, labels, old, adv, mask.to("meta"))
    with pytest.raises(TypeError, match=r"old_logprobs must be a torch.Tensor, got list"):
        call(logits, labels, old.tolist(), adv, mask)
    call(logits, labels, old, adv[:, 0], mask)  # [B] per sequence is fine
    with pytest.raises(ValueError, match=r"policy_loss_from_logprobs\(\): entropy \[2, 4\] must be shaped like logprobs \[2, 5\]"):
        policy_loss_from_logprobs(old, old[:, :4], old, adv, mask)
    with pytest.raises(ValueError, match=r"policy_loss_from_logprobs\(\): loss_mask must hold finite weights >= 0"):
        policy_loss_from_logprobs(old, old, old, adv, -mask - 1)


# --- the alignment ------------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", [e for e in ENTRY_POINTS if e != "AEPOLoss"])  # the module: its own test
def test_shift_labels_has_no_default(entry):
    """Old code: shift_labels=False by default, so HF logits with input_ids gave a wrong loss silently."""
    with pytest.raises(TypeError) as err:
        _entry_points()[entry](shift_labels=None)
    message = str(err.value)
    assert "needs shift_labels=True or shift_labels=False (there is no default)" in message
    assert "logits row t predicts labels[t+1]" in message and "logits[:, :-1] with labels=input_ids[:, 1:]" in message
    with pytest.raises(TypeError, match="shift_labels must be True or False, got Tensor .*pass such labels as labels="):
        _entry_points()[entry](shift_labels=_case()[2])


def test_aepo_loss_module_needs_the_alignment():
    with pytest.raises(TypeError, match=r"AEPOLoss\(\) needs shift_labels=True or shift_labels=False"):
        AEPOLoss(LossConfig())
    assert "shift_labels=True" in repr(AEPOLoss(shift_labels=True))


# --- deferred checks: the bad label is never counted --------------------------------------------------

@pytest.mark.parametrize("path", ["logits", "fused"])
@pytest.mark.parametrize("with_stats", [False, True])
@pytest.mark.parametrize("backend", backend_params(["torch"] + (["triton"] if triton_available() else [])))
def test_out_of_range_label_is_not_counted_when_the_check_is_deferred(monkeypatch, path, with_stats, backend):
    """With the check deferred (as on CUDA, where it is a device assert read at the next sync), the
    call must still not count the bad position: loss, gradient, num_tokens and the two-phase
    entropy statistics equal those with the position masked out. Old code counted it (log-prob 0)."""
    monkeypatch.setattr(contract, "enforce", lambda function, rules: None)
    hidden, weight, labels, old, adv, mask = _case(seed=3)
    mask[:] = 1.0
    bad = labels.clone()
    bad[0, 2], bad[1, 4] = V, -7
    masked = mask.clone()
    masked[0, 2] = masked[1, 4] = 0
    stats = dict(entropy_mean=torch.tensor(3.0), entropy_std=torch.tensor(0.4)) if with_stats else {}
    cfg = LossConfig(entropy_coef=0.01, entropy_adv_alpha=0.3)

    def run(y, m):
        h = hidden.clone().requires_grad_()
        if path == "logits":
            loss, out = aepo_policy_loss(h @ weight.T, y, old, adv, m, shift_labels=False, config=cfg, backend=backend,
                                         return_token_loss=True, **stats)
        else:
            loss, out = fused_linear_aepo_policy_loss(h, weight, y, old, adv, m, shift_labels=False, config=cfg,
                                                      backend=backend, return_token_loss=True, **stats)
        loss.backward()
        return loss, h.grad, out

    loss, grad, out = run(bad, mask)
    want, want_grad, want_out = run(labels, masked)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert out["num_tokens"] == want_out["num_tokens"] == 8
    for key in ("entropy", "ratio", "clipfrac_high", "clipfrac_low"):
        torch.testing.assert_close(out[key], want_out[key], msg=key)
    assert out["token_loss"][0, 2] == out["token_loss"][1, 4] == 0


ROW_IMPLS = ["native", "compiled"] + (["triton"] if triton_available() else [])


@pytest.mark.parametrize("impl", [pytest.param(i, marks=pytest.mark.slow) if i == "triton" else i for i in ROW_IMPLS])
@pytest.mark.parametrize("in_place", [False, True])
def test_row_kernels_give_a_row_without_target_no_loss_and_no_gradient(monkeypatch, impl, in_place):
    """Every backend of the one-pass row op (C, compiled torch, Triton), called directly with weight
    1 on every row: rows whose label is ignore_index, V or negative have L_t = 0 and dlogits = 0.
    Old code: L_t computed with log-prob 0 and an entropy-bonus gradient (C, Triton, torch)."""
    if impl == "compiled":
        monkeypatch.setenv("AEPO_CPU_NATIVE", "0")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, V, generator=gen) * 3
    labels = torch.randint(0, V, (2, 6), generator=gen)
    no_target = [(0, 1, -100), (0, 4, V), (1, 0, -3), (1, 5, V + 7)]
    for b, t, y in no_target:
        labels[b, t] = y
    ones = torch.ones(2, 6)
    inputs = RowInputs(-torch.rand(2, 6, generator=gen), torch.randn(2, 6, generator=gen), ones,
                       torch.tensor(2.0), torch.tensor(0.7))
    out = logits.clone() if in_place else torch.empty_like(logits)
    z = out if in_place else logits
    rows = one_pass_rows(z, labels, inputs, LossConfig(entropy_coef=0.05), 1.0, -100, out,
                         "triton" if impl == "triton" else "torch")
    for b, t, _ in no_target:
        assert rows[2, b, t] == 0 and rows[0, b, t] == 0, (b, t)
        assert (out[b, t] == 0).all(), (b, t)
    valid = torch.ones(2, 6, dtype=torch.bool)
    for b, t, _ in no_target:
        valid[b, t] = False
    assert (rows[2][valid] != 0).all() and (out[valid].abs().sum(-1) > 0).all()


def test_the_deferred_check_compiles_without_a_graph_break():
    """On CUDA and under torch.compile the verdict goes to torch._assert_async (no host read): a
    fullgraph compile of the check passes good labels and fails bad ones with the message."""
    check = torch.compile(lambda y: (contract.enforce("f", [contract.label_rule(y, V, -100)]), y.sum())[1],
                          fullgraph=True)
    assert check(torch.tensor([0, V - 1, -100])) == V - 101
    with pytest.raises(RuntimeError, match=rf"f\(\): labels must hold token ids in \[0, {V}\) or ignore_index=-100"):
        check(torch.tensor([0, V, -100]))


# --- masks are weights ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["logits", "reference", "fused"])
def test_a_mask_weight_of_two_is_the_token_counted_twice(path):
    """A weight w >= 0 in loss_mask weights the token's loss, its share of the token count and of
    the entropy statistics: weight 2 on a token == that token present twice (weight 1 each)."""
    gen = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(7, D, generator=gen), torch.randn(V, D, generator=gen)
    labels = torch.randint(0, V, (7,), generator=gen)
    old, adv = -torch.rand(7, generator=gen) * 2, torch.randn(7, generator=gen)
    mask = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 0.0, 1.0])
    twice = torch.tensor([0, 1, 2, 2, 3, 4, 5, 6])
    cfg = LossConfig(entropy_adv_alpha=0.5, entropy_coef=0.02)

    def run(index, m):
        h = hidden.clone().requires_grad_()
        args = (labels[index], old[index], adv[index], m)
        if path == "fused":
            loss, stats = fused_linear_aepo_policy_loss(h[index], weight, *args, shift_labels=False, config=cfg)
        else:
            loss, stats = aepo_policy_loss(h[index] @ weight.T, *args, shift_labels=False, config=cfg,
                                           backend="reference" if path == "reference" else "torch")
        loss.backward()
        return loss, h.grad, stats

    loss, grad, stats = run(torch.arange(7), mask)
    want, want_grad, want_stats = run(twice, torch.where(mask[twice] > 0, 1.0, 0.0))
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    for key in ("num_tokens", "entropy", "ratio", "clipfrac_high", "clipfrac_low"):
        torch.testing.assert_close(stats[key], want_stats[key], msg=key)
    assert stats["num_tokens"] == 6


@pytest.mark.parametrize("path", ["logits", "reference", "fused", "tree"])
def test_weights_summing_below_one_divide_by_their_sum(path):
    """Issue 51: token-mean divides by the weights' sum (docs/library.md, "Masks are weights"), also
    when fractional weights sum to less than 1 (it divided by max(sum, 1): the loss of a short
    sequence with down-weighted tokens came out 0.3 x too small). Hand-worked: weights 0.1 and 0.2
    (sum 0.3) give (0.1 L_0 + 0.2 L_2) / 0.3, the same loss as weights 1 and 2 (sum 3); the
    statistics' means likewise."""
    from aepo_kernels import Occurrences, aepo_tree_policy_loss

    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(3, D, generator=gen), torch.randn(V, D, generator=gen)
    labels = torch.randint(0, V, (3,), generator=gen)
    old, adv = -torch.rand(3, generator=gen) * 2, torch.randn(3, generator=gen)
    cfg = LossConfig(entropy_adv_alpha=0.5, entropy_coef=0.02)

    def run(mask):
        if path == "fused":
            return fused_linear_aepo_policy_loss(hidden, weight, labels, old, adv, mask, shift_labels=False, config=cfg)
        if path == "tree":  # three nodes, each read once, from the parents' hidden states = the rows here
            occ = Occurrences(node=torch.arange(3), advantages=adv, loss_mask=mask, sequence=torch.zeros(3, dtype=torch.long),
                              num_sequences=1)
            return aepo_tree_policy_loss(hidden @ weight.T, labels, old, occ, shift_labels=False, config=cfg)
        return aepo_policy_loss(hidden @ weight.T, labels, old, adv, mask, shift_labels=False, config=cfg,
                                backend="reference" if path == "reference" else "torch")

    small, small_stats = run(torch.tensor([0.1, 0.0, 0.2]))
    whole, whole_stats = run(torch.tensor([1.0, 0.0, 2.0]))
    torch.testing.assert_close(small, whole, rtol=1e-5, atol=1e-6)
    assert small.abs() > 1e-3  # a real loss, not 0 = 0
    for key in ("entropy", "ratio"):
        if key in small_stats:
            torch.testing.assert_close(small_stats[key], whole_stats[key], rtol=1e-5, atol=1e-6, msg=key)
