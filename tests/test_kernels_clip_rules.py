"""Every implementation of the per-token clip head against the reference, for every clip rule.

The head (shaped advantage, ratio, clip rule, dual clip, k3 KL, entropy bonus and dL/dlogp) is
written five times on purpose (see the note beside ``CLIP_RULES`` in kernels/config.py):

1. ``reference.token_loss_reference`` -- the oracle, the formula written literally, autograd;
2. ``policy_loss.policy_loss_from_logprobs`` (``clipped_token_loss``) -- autograd;
3. ``one_pass.token_head`` -- explicit derivatives, all rules evaluated then one selected;
4. ``triton_kernels._token_head`` -- the same in Triton (interpreter mode on the CPU);
5. ``token_head`` of the native C kernel (``kernels/csrc/one_pass_rows.c``) -- reached through
   its row pass, where the C compiler is there (which gives the position without a target no
   loss and no gradient, whatever its weight).

The rules are read from ``CLIP_RULES``, so a new rule is tested in all five the day it is added;
``test_reference_tells_every_rule_apart`` fails for a rule the reference does not implement (it
would fall back to another rule's maths). Inputs are fresh random values with log-ratios in
[-1.6, 1.6] (ratios 0.2-5: outside both clip bounds, past the dual clip and, with
``log_ratio_clamp=1``, past the clamp), negative and positive advantages, masked tokens and a
position without a target.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from aepo_kernels import CLIP_RULES, LossConfig, native, policy_loss_from_logprobs
from aepo_kernels.one_pass import RowInputs, token_head
from aepo_kernels.reference import logprob_entropy_reference, token_loss_reference

from conftest import triton_available

from aepo_kernels.config import hyper_params

IGNORE = -100
OUTPUTS = ("loss", "d_logp", "d_entropy", "ratio", "shaped", "kl")


def _configs(rule: str) -> dict[str, LossConfig]:
    """Plain clip; everything on (shaping, KL, entropy bonus, a tight log-ratio clamp); no dual clip."""
    return {
        "plain": LossConfig(clip=rule, entropy_adv_alpha=0.0, eps_high=0.28),
        "all-on": LossConfig(clip=rule, eps_low=0.15, eps_high=0.28, dual_clip=2.5, log_ratio_clamp=1.0,
                             entropy_adv_alpha=0.3, kl_coef=0.05, entropy_coef=0.01),
        "no-dual": LossConfig(clip=rule, dual_clip=0.0, entropy_adv_alpha=0.2),
    }


@dataclass
class Case:
    """One batch ``[B, T]`` (logits ``[B, T, V]``), in ``dtype``; values fp32-representable."""

    logits: torch.Tensor
    labels: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor
    mask: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _case(seed: int, dtype: torch.dtype, batch: int = 3, seq: int = 37, vocab: int = 29) -> Case:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen) * 2
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[1, 3] = IGNORE
    logp, entropy = logprob_entropy_reference(logits, labels, ignore_index=IGNORE)
    log_ratio = (torch.rand(batch, seq, generator=gen) * 2 - 1) * 1.6
    mask = (torch.rand(batch, seq, generator=gen) > 0.25).float()
    mask[0, :5] = 0
    cast = lambda t: t.to(dtype)  # noqa: E731
    return Case(cast(logits), labels, cast(logp), cast(entropy), cast(logp - log_ratio),
                cast(torch.randn(batch, seq, generator=gen) * 1.5), cast(logp + 0.3 * torch.randn(batch, seq, generator=gen)),
                cast(mask), cast(torch.rand((), generator=gen) + 0.5), cast(torch.rand((), generator=gen) + 0.3))


def _oracle(c: Case, cfg: LossConfig, logp=None, entropy=None) -> dict[str, torch.Tensor]:
    """The reference head at ``logp``/``entropy`` (default: the case's): values and autograd
    derivatives per token (``L_t`` is elementwise, so d sum(L) / d logp_t = dL_t / d logp_t)."""
    logp = (c.logp if logp is None else logp).detach().clone().requires_grad_()
    entropy = (c.entropy if entropy is None else entropy).detach().clone().requires_grad_()
    loss = token_loss_reference(logp, entropy, c.old, c.adv, c.mask, cfg, c.mean, c.std, ref_logprobs=c.ref)
    d_logp, d_entropy = torch.autograd.grad(loss.sum(), (logp, entropy), allow_unused=True)
    zero = torch.zeros_like(logp)
    delta = c.ref - logp.detach()
    log_ratio = (logp.detach() - c.old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    return {"loss": loss.detach(), "d_logp": zero if d_logp is None else d_logp,
            "d_entropy": zero if d_entropy is None else d_entropy, "ratio": log_ratio.exp(),
            "shaped": c.adv * (1 + cfg.entropy_adv_alpha * (entropy.detach() - c.mean) / c.std),
            "kl": delta.exp() - delta - 1}


# ---------------------------------------------------------------------------------------------
# The implementations under test: each returns some of OUTPUTS per token, and what it is compared
# against (the oracle at the case's inputs, or at the log-probs/entropies the kernel computed).


def _policy_loss(c: Case, cfg: LossConfig):
    """Autograd through policy_loss_from_logprobs (token-mean: dL/dlogp_t = mask_t / count * dL_t)."""
    logp, entropy = c.logp.clone().requires_grad_(), c.entropy.clone().requires_grad_()
    loss, stats = policy_loss_from_logprobs(logp, entropy, c.old, c.adv, c.mask, config=cfg, entropy_mean=c.mean,
                                            entropy_std=c.std, ref_logprobs=c.ref, return_token_loss=True)
    d_logp, d_entropy = torch.autograd.grad(loss, (logp, entropy), allow_unused=True)
    count = c.mask.sum()
    zero = torch.zeros_like(logp)
    got = {"loss": stats["token_loss"], "d_logp": (zero if d_logp is None else d_logp) * count,
           "d_entropy": (zero if d_entropy is None else d_entropy) * count}
    expected = {name: value * c.mask for name, value in _oracle(c, cfg).items()}  # 0 off the mask
    return got, expected


def _one_pass(c: Case, cfg: LossConfig):
    hp = hyper_params(cfg, True, c.logp.dtype, "cpu")
    got = dict(zip(OUTPUTS, token_head(c.logp, c.entropy, c.old, c.adv, c.ref, c.mean, c.std, hp)))
    got["d_entropy"] = got["d_entropy"].expand_as(c.logp)
    return got, _oracle(c, cfg)


def _triton(c: Case, cfg: LossConfig):
    """``_token_head`` inside a one-block test kernel (the Triton interpreter on the CPU)."""
    kernel = _triton_head_kernel()
    n = c.logp.numel()
    flat = [t.reshape(n).contiguous() for t in (c.logp, c.entropy, c.old, c.adv, c.ref)]
    out = torch.empty(5, n, dtype=torch.float32)
    kernel[(1,)](*flat, out, n, float(c.mean), float(c.std), cfg.eps_low, cfg.eps_high, cfg.dual_clip,
                 cfg.log_ratio_clamp, cfg.entropy_adv_alpha, cfg.kl_coef, cfg.entropy_coef,
                 CLIP_RULES.index(cfg.clip), 1, BLOCK=triton_next_power_of_2(n))
    got = {name: row.reshape(c.logp.shape) for name, row in zip(("loss", "d_logp", "ratio", "shaped", "kl"), out)}
    return got, _oracle(c, cfg)


def _native(c: Case, cfg: LossConfig):
    """The C row pass: L_t, ratio, A_t, kl compared with the oracle at the kernel's own log-probs
    and entropies (the head alone); dlogits = mask_t * dL_t/dz with the float64 autograd reference
    through the logits (the head's dL/dlogp and dL/dH inside the gradient sweep)."""
    inputs = RowInputs(c.old, c.adv, c.mask, c.mean, c.std, c.ref)
    out = torch.empty_like(c.logits)
    rows = native.native_one_pass(c.logits, c.labels, inputs, cfg, 1.0, IGNORE, out)
    got = {"loss": rows[2], "ratio": rows[3], "shaped": rows[4], "kl": rows[5]}
    expected = _oracle(c, cfg, logp=rows[0], entropy=rows[1])
    has_target = c.labels != IGNORE  # the row pass gives a row without a target no loss, no gradient
    expected["loss"] = torch.where(has_target, expected["loss"], torch.zeros_like(expected["loss"]))
    z = c.logits.double().requires_grad_()
    logp, entropy = logprob_entropy_reference(z, c.labels, ignore_index=IGNORE)
    d = lambda t: t.double()  # noqa: E731
    loss = token_loss_reference(logp, entropy, d(c.old), d(c.adv), d(c.mask), cfg, d(c.mean), d(c.std),
                                ref_logprobs=d(c.ref))
    (d_logits,) = torch.autograd.grad((loss * d(c.mask) * has_target).sum(), z)
    got["dlogits"], expected["dlogits"] = out.double(), d_logits
    return got, expected


def _native_problem() -> str | None:
    if not native.enabled():
        return "the native C kernel is off here (AEPO_CPU_NATIVE=0 or no C compiler on PATH)"
    try:
        native.library()
    except Exception as exc:  # noqa: BLE001 - the reason is the skip message
        return f"the native C kernel does not build here: {type(exc).__name__}: {str(exc)[:200]}"
    return None


if triton_available():
    import triton
    import triton.language as tl

    from aepo_kernels.triton_kernels import _token_head

    triton_next_power_of_2 = triton.next_power_of_2

    @triton.jit
    def _head_kernel(logp_ptr, entropy_ptr, old_ptr, adv_ptr, ref_ptr, out_ptr, n, mean, std, eps_low, eps_high,
                     dual_clip, clamp_c, alpha, kl_coef, entropy_coef, rule, has_ref, BLOCK: tl.constexpr):
        o_n = tl.arange(0, BLOCK)
        m_n = o_n < n
        b_loss, b_dlogp, b_ratio, b_shaped, b_kl = _token_head(
            tl.load(logp_ptr + o_n, mask=m_n, other=0.0), tl.load(entropy_ptr + o_n, mask=m_n, other=0.0),
            tl.load(old_ptr + o_n, mask=m_n, other=0.0), tl.load(adv_ptr + o_n, mask=m_n, other=0.0),
            tl.load(ref_ptr + o_n, mask=m_n, other=0.0), mean, std, eps_low, eps_high, dual_clip, clamp_c, alpha,
            kl_coef, entropy_coef, rule, has_ref)
        tl.store(out_ptr + o_n, b_loss, mask=m_n)
        tl.store(out_ptr + n + o_n, b_dlogp, mask=m_n)
        tl.store(out_ptr + 2 * n + o_n, b_ratio, mask=m_n)
        tl.store(out_ptr + 3 * n + o_n, b_shaped, mask=m_n)
        tl.store(out_ptr + 4 * n + o_n, b_kl, mask=m_n)

    def _triton_head_kernel():
        return _head_kernel
else:
    def _triton_head_kernel():
        raise AssertionError("unreachable: skipped without triton")


def _triton_problem() -> str | None:
    return None if triton_available() else "triton is not importable, or no GPU and TRITON_INTERPRET is not 1"


# name -> (function, dtypes it computes in, why it cannot run here or None)
IMPLEMENTATIONS = {
    "policy_loss": (_policy_loss, (torch.float32, torch.float64), lambda: None),
    "one_pass.token_head": (_one_pass, (torch.float32, torch.float64), lambda: None),
    "triton._token_head": (_triton, (torch.float32,), _triton_problem),  # the kernel's per-token inputs are fp32
    "native C token_head": (_native, (torch.float32,), _native_problem),  # fp32 CPU logits only
}
CASES = [(name, dtype) for name, (_, dtypes, _) in IMPLEMENTATIONS.items() for dtype in dtypes]


def _tolerance(impl: str, dtype: torch.dtype, name: str) -> dict[str, float]:
    if dtype == torch.float64 and impl == "policy_loss":
        # policy_loss_from_logprobs takes advantages as fp32 (``advantages.float()``), so e.g. the
        # dual-clip value -A c is an fp32 product there: fp32 rounding, relative to the value.
        return dict(rtol=2e-7, atol=1e-9)
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    if name == "dlogits":  # fp32 sweeps over V against float64 autograd
        return dict(rtol=1e-4, atol=2e-6)
    return dict(rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("config_name", ["plain", "all-on", "no-dual"])
@pytest.mark.parametrize("rule", CLIP_RULES)
@pytest.mark.parametrize("impl,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_every_implementation_matches_the_reference_for_every_rule(impl, dtype, rule, config_name):
    fn, _, problem = IMPLEMENTATIONS[impl]
    reason = problem()
    if reason:
        pytest.skip(reason)
    cfg = _configs(rule)[config_name]
    case = _case(seed=17 * CLIP_RULES.index(rule) + len(config_name), dtype=dtype)
    ratio = (case.logp - case.old).exp()
    # The inputs reach every branch: both clip bounds, the dual clip (A < 0, r > c), the clamp.
    assert (ratio > 1 + cfg.eps_high).any() and (ratio < 1 - cfg.eps_low).any()
    assert ((case.adv < 0) & (ratio > 3.0)).any() and ((case.logp - case.old).abs() > 1.0).any()
    got, expected = fn(case, cfg)
    assert got, impl
    for name, value in got.items():
        assert value.dtype == (torch.float64 if name == "dlogits" else dtype), (impl, name, value.dtype)
        torch.testing.assert_close(value, expected[name], **_tolerance(impl, dtype, name), msg=lambda m: f"{impl} {name}: {m}")


def test_reference_tells_every_rule_apart():
    """A rule added to CLIP_RULES but not to the reference would take another rule's maths there
    (and in the kernels, which select by index): every pair of rules differs in L_t or dL/dlogp."""
    case = _case(seed=5, dtype=torch.float64)
    cfg = _configs("ppo")["plain"]
    heads = {rule: _oracle(case, dataclasses.replace(cfg, clip=rule)) for rule in CLIP_RULES}
    for i, a in enumerate(CLIP_RULES):
        for b in CLIP_RULES[i + 1:]:
            same = all(torch.equal(heads[a][k], heads[b][k]) for k in ("loss", "d_logp"))
            assert not same, f"clip rules {a!r} and {b!r} give the same per-token loss and gradient"

