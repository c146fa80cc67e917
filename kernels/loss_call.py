"""The set-up both loss functions of :mod:`aepo_kernels.api` share: their keyword options, the
input contract (:mod:`aepo_kernels.contract`), the label shift, the target mask, the one pass's
per-token inputs and, afterwards, the statistics.

A call goes: :func:`loss_options` (the keywords as :class:`LossOptions`) -> :func:`prologue`
(checks; ``shift_labels``: input_ids-aligned tensors -> logits-aligned; ``loss_mask`` without the
positions that have no target) -> :meth:`Call.row_inputs` (aggregation weights, entropy z-score
statistics: supplied, or from a no-grad pass) -> the pass -> :meth:`Call.stats` (per-token outputs
back in the caller's alignment).

``shift_labels=True``: the HF ``labels`` convention. ``labels`` and every per-token tensor are
aligned with ``input_ids`` (``[B, T]``: token t, its old log-prob, mask, weight ...); logits (or
hidden states) row t predicts token t+1. The shift happens on the ``[B, T]`` side
(:func:`_shift_to_logits`): labels move left with ``ignore_index`` in the last slot, the other
per-token tensors move left with 0 there, so the logits / hidden states are used as given (no
``[N, V]`` or ``[N, D]`` copy, and backward returns their full gradient directly). The last row
costs one wasted row of work per sequence. Per-token outputs come back aligned with ``labels``
again (token 0 has no prediction: 0). The result equals slicing by hand (``logits[:, :-1]`` with
``labels[:, 1:]`` etc.), ``seq-mean-token-sum-norm``'s default length included (T - 1).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from . import contract
from .config import LossConfig
from .logits_ops import as_3d, logit_map, resolve_backend, shift_labels_left, shift_to_labels
from .one_pass import aggregation_weights, one_pass_loss_traceable
from .policy_loss import apply_token_weights, entropy_moments, entropy_stats_from_moments, loss_stats
from .row_inputs import RowInputs

# ---------------------------------------------------------------------------------------------
# The options both loss functions take.


class LossOptions(NamedTuple):
    """The keyword options :func:`aepo_kernels.aepo_policy_loss` and
    :func:`aepo_kernels.fused_linear_aepo_policy_loss` share: the one place their names and
    defaults live (each function lists them in its signature through :func:`takes_loss_options`).
    A ``NamedTuple``, so a caller's ``torch.compile`` traces it.

    Attributes:
        shift_labels: required, True or False (no default: :func:`aepo_kernels.contract.alignment`).
            True: ``labels`` and the per-token tensors are input_ids-aligned; logits (hidden
            states) row t predicts ``labels[t+1]`` (module docstring). Nothing ``[N, V]``/``[N, D]``
            is copied. False: logits row t predicts ``labels[t]``.
        config: :class:`LossConfig`, the algorithm's hyper-parameters.
        temperature: the sampling temperature.
        backend: ``"auto" | "triton" | "torch" | "reference"`` (fused-linear: the row op on each
            logits block, no ``"reference"``).
        entropy_mean, entropy_std: global z-score statistics (population std over the step's
            valid tokens, :func:`aepo_kernels.entropy_stats_from_moments`); without them and with
            ``entropy_adv_alpha != 0`` the call is two-phase (one more no-grad pass).
        global_token_count, global_num_seqs: normalisers of the aggregation.
        ref_logprobs: reference log-probs shaped like ``labels`` (needed when ``config.kl_coef != 0``).
        ignore_index: a label with no target (log-prob 0, out of the loss whatever ``loss_mask`` says).
        token_weights: detached per-token weights >= 0 of the policy-gradient term, shaped like
            ``labels`` (importance-sampling weights; :func:`aepo_kernels.apply_token_weights`).
        stats_masks: name -> mask shaped like ``labels``: the statistics again over each mask's
            valid tokens, as ``<stat>/<name>`` (e.g. tokens of branched trajectories); no extra pass.
        return_token_loss: also return the per-token loss, log-probs and entropies in ``stats``.
        logit_scale, softcap: the softmax is taken of ``softcap * tanh(logit_scale * z / softcap) /
            temperature`` -- on logits only for raw ones; from hidden states the model's values
            (:mod:`aepo_kernels.api`).
    """

    shift_labels: bool | None = None
    config: LossConfig = LossConfig()
    temperature: float = 1.0
    backend: str = "auto"
    entropy_mean: torch.Tensor | None = None
    entropy_std: torch.Tensor | None = None
    global_token_count: torch.Tensor | float | None = None
    global_num_seqs: torch.Tensor | float | None = None
    ref_logprobs: torch.Tensor | None = None
    ignore_index: int = -100
    token_weights: torch.Tensor | None = None
    stats_masks: dict[str, torch.Tensor] | None = None
    return_token_loss: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None


DEFAULTS = LossOptions()
# Options a caller must give (their NamedTuple default only marks "not given").
_REQUIRED = ("shift_labels",)


def loss_options(function: str, options: dict) -> LossOptions:
    """``**options`` of a loss function as :class:`LossOptions`; an unknown keyword is the
    ``TypeError`` Python raises for any function."""
    for name in options:
        if name not in LossOptions._fields:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return LossOptions(**options)


def takes_loss_options(fn: Callable | None = None, *, defaults: dict | None = None) -> Callable:
    """Give ``fn(..., **options)`` the signature ``help()`` and ``inspect`` show: its own
    parameters, then every :class:`LossOptions` field as a keyword with its default (the required
    ones without, unless ``defaults`` gives the function's own: the tree losses' shift_labels=False).
    Changes nothing at call time (``fn`` is returned as it is). Used bare or as
    ``@takes_loss_options(defaults={...})``."""
    if fn is None:
        return lambda f: takes_loss_options(f, defaults=defaults)
    defaults = defaults or {}
    own = inspect.signature(fn)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    annotations = {name: getattr(a, "__forward_arg__", a) for name, a in LossOptions.__annotations__.items()}
    for name, default in LossOptions._field_defaults.items():
        default = defaults[name] if name in defaults else inspect.Parameter.empty if name in _REQUIRED else default
        annotation = "bool" if name in _REQUIRED else annotations[name]
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    fn.__signature__ = own.replace(parameters=params)
    return fn


# ---------------------------------------------------------------------------------------------
# Per-token bookkeeping: label shifting, the target mask, statistics masks.

def _shift_to_logits(labels, tokens: dict, config: LossConfig, ignore_index: int):
    """``shift_labels=True``: input_ids-aligned ``labels``/``tokens`` -> logits-aligned ones
    (row t's target is token t+1; the last row gets ``ignore_index`` and zeros, so it is out of
    the loss). Per-sequence advantages are left alone. Returns ``(labels, tokens, config)``;
    ``seq-mean-token-sum-norm`` keeps its by-hand-slicing default length T - 1."""
    targets = shift_labels_left(labels, ignore_index)
    shifted = {name: t if t is None or t.shape != labels.shape else F.pad(t[..., 1:], (0, 1))
               for name, t in tokens.items()}
    if config.aggregation == "seq-mean-token-sum-norm" and config.seq_norm_length is None:
        config = dataclasses.replace(config, seq_norm_length=labels.shape[-1] - 1)
    return targets, shifted, config


def _prepare_stats_masks(stats_masks, shift_labels):
    """``stats_masks`` (checked by the prologue) shifted like ``loss_mask`` (``shift_labels``)."""
    if not stats_masks or not shift_labels:
        return stats_masks
    return {name: F.pad(mask[..., 1:], (0, 1)) for name, mask in stats_masks.items()}


def _check(function: str, labels, vocab: int, tokens: dict, o: LossOptions) -> None:
    """The per-token part of the contract (:mod:`aepo_kernels.contract`), metadata then values."""
    contract.check_loss_tokens(function, labels, "labels", tokens, o.stats_masks)
    contract.enforce(function, [contract.label_rule(labels, vocab, o.ignore_index)])


# ---------------------------------------------------------------------------------------------
# The one pass's inputs and the statistics of its rows.

def _row_inputs(labels, old_logprobs, advantages, loss_mask, config, entropy_stats, global_token_count,
                global_num_seqs, ref_logprobs, token_weights=None) -> RowInputs:
    """Per-token inputs shaped like ``labels`` (``[N]`` or ``[B, T]``, checked by the prologue),
    before flattening to 3-D."""
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    advantages = apply_token_weights(advantages, token_weights, labels.shape)
    if advantages.shape != labels.shape:  # per sequence -> per token
        advantages = advantages.unsqueeze(-1).expand(labels.shape)
    weight = aggregation_weights(loss_mask, config, global_token_count, global_num_seqs)
    mean, std = entropy_stats
    return RowInputs(old_logprobs.float().detach(), advantages.float().detach(), weight, mean, std,
                     None if ref_logprobs is None else ref_logprobs.float().detach())


def _entropy_stats(config, loss_mask, entropy_mean, entropy_std, entropy_pass):
    """The z-score statistics: supplied, unused (alpha 0), or from a no-grad pass (two-phase)."""
    if entropy_mean is not None and entropy_std is not None:
        return torch.as_tensor(entropy_mean).float(), torch.as_tensor(entropy_std).float()
    if config.entropy_adv_alpha == 0.0:
        zero = loss_mask.new_zeros((), dtype=torch.float32)
        return zero, zero + 1
    with torch.no_grad():
        entropy = entropy_pass()
    return entropy_stats_from_moments(entropy_moments(entropy, loss_mask))


def as_3d_inputs(inputs: RowInputs, shape3) -> RowInputs:
    """The per-token inputs viewed as ``shape3`` (``[B, T]`` of the 3-D logits, or ``[1, N]``)."""
    view = lambda t: None if t is None else t.reshape(shape3)  # noqa: E731
    return RowInputs(view(inputs.old_logprobs), view(inputs.advantages), view(inputs.weight),
                     inputs.entropy_mean.to(inputs.weight.device), inputs.entropy_std.to(inputs.weight.device),
                     view(inputs.ref_logprobs))


def _stats(rows, loss_mask, config, has_ref, return_token_loss=False, stats_masks=None) -> dict[str, torch.Tensor]:
    logp, entropy, token_loss, ratio, shaped, kl = (r.reshape(loss_mask.shape) for r in rows)
    stats = loss_stats(entropy, ratio, shaped, loss_mask, config, kl if has_ref else None, stats_masks)
    if return_token_loss:
        stats["token_loss"] = torch.where(loss_mask != 0, token_loss, torch.zeros_like(token_loss))
        stats["token_logprobs"], stats["token_entropy"] = logp, entropy
    return stats


def caller_aligned_stats(stats: dict, shift_labels: bool) -> dict:
    """Per-token outputs back in the caller's (input_ids) alignment."""
    if shift_labels:
        for name in ("token_loss", "token_logprobs", "token_entropy"):
            if name in stats:
                stats[name] = shift_to_labels(stats[name])
    return stats


# ---------------------------------------------------------------------------------------------
# One call after the shared prologue.

class Call(NamedTuple):
    """One call after :func:`prologue`: labels and per-token tensors logits-aligned
    (``shift_labels``), ``loss_mask`` without the positions that have no target."""

    labels: torch.Tensor
    tokens: dict[str, torch.Tensor | None]  # old_logprobs, advantages, loss_mask, ref_logprobs, token_weights
    config: LossConfig
    stats_masks: dict[str, torch.Tensor] | None
    backend: str
    inv_t: float
    tanh_scale: float | None  # None without a soft cap (logit_map)
    options: LossOptions

    def row_inputs(self, entropy_pass: Callable[[], torch.Tensor]) -> RowInputs:
        """The one pass's per-token inputs; ``entropy_pass`` gives this call's entropies when the
        z-score statistics are needed and not supplied (two-phase)."""
        o, loss_mask = self.options, self.tokens["loss_mask"]
        entropy_stats = _entropy_stats(self.config, loss_mask, o.entropy_mean, o.entropy_std, entropy_pass)
        return _row_inputs(self.labels, self.tokens["old_logprobs"], self.tokens["advantages"], loss_mask,
                           self.config, entropy_stats, o.global_token_count, o.global_num_seqs,
                           self.tokens["ref_logprobs"], self.tokens["token_weights"])

    def stats(self, rows) -> dict[str, torch.Tensor]:
        """The statistics of the pass's rows, per-token outputs aligned with the caller's labels."""
        stats = _stats(rows, self.tokens["loss_mask"], self.config, self.tokens["ref_logprobs"] is not None,
                       self.options.return_token_loss, self.stats_masks)
        return caller_aligned_stats(stats, self.options.shift_labels)


def prologue(function: str, x: torch.Tensor, vocab: int, labels, old_logprobs, advantages, loss_mask,
             o: LossOptions) -> Call:
    """What both loss functions do first, after checking ``x`` (logits or hidden states) and
    ``labels`` themselves: the alignment, the logit map, the backend for ``x``, the per-token
    checks, the shift and the target mask (``ignore_index`` and out-of-range labels out)."""
    shift = contract.alignment(function, o.shift_labels)
    inv_t, tanh_scale = logit_map(o.temperature, o.logit_scale, o.softcap)
    backend = resolve_backend(o.backend, x)
    tokens = dict(old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask, ref_logprobs=o.ref_logprobs,
                  token_weights=o.token_weights)
    _check(function, labels, vocab, tokens, o)
    config = o.config
    if shift:
        labels, tokens, config = _shift_to_logits(labels, tokens, config, o.ignore_index)
    mask = tokens["loss_mask"]
    tokens["loss_mask"] = torch.where(contract.target_mask(labels, vocab, o.ignore_index), mask, torch.zeros_like(mask))
    return Call(labels, tokens, config, _prepare_stats_masks(o.stats_masks, shift), backend, inv_t, tanh_scale, o)


def traceable_entropy_pass(logits, call: Call) -> torch.Tensor:
    """This call's entropies through the custom op (statistics unused: alpha_H = 0): the entropy
    pass of the two-phase path under a caller's ``torch.compile``."""
    zero = torch.zeros((), device=logits.device)
    tokens = call.tokens
    config = LossConfig(entropy_adv_alpha=0.0)
    inputs = _row_inputs(call.labels, tokens["old_logprobs"], tokens["advantages"], tokens["loss_mask"], config,
                         (zero, zero + 1), None, None, None)
    logits3, labels3 = as_3d(logits, call.labels)
    rows = one_pass_loss_traceable(logits3, labels3, as_3d_inputs(inputs, labels3.shape), config, call.inv_t,
                                   call.options.ignore_index, call.backend, call.tanh_scale)[1]
    return rows[1].reshape(call.labels.shape)
