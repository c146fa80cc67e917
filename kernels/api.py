"""Public entry points: the AEPO loss from logits or from hidden states, and an ``nn.Module``.

Both loss functions take the one-pass path (:mod:`aepo_kernels.one_pass`): log-probs, entropies,
the loss and its gradient come out of one sweep per row, and backward only scales the stored
gradient. Its inputs must all be known before the sweep:
- the aggregation normalisers: ``global_token_count`` / ``global_num_seqs`` when given, else the
  call's own (computed from ``loss_mask`` on the device, no host sync);
- the entropy z-score statistics ``entropy_mean``/``entropy_std`` when ``entropy_adv_alpha != 0``.
  When they are not supplied the path is two-phase: a no-grad log-prob/entropy pass over the
  same logits (hidden states: one more logits matmul) gives this call's statistics, then the
  one pass runs with them. The trainer supplies global statistics, so it never pays for that.
``backend="reference"`` runs :mod:`aepo_kernels.reference`-style full-fp32 autograd instead.

Options both loss functions share (keyword arguments, declared once in :class:`LossOptions`;
each costs nothing when off):
- ``shift_labels=True``: the HF ``labels`` convention. ``labels`` and every per-token tensor are
  aligned with ``input_ids`` (``[B, T]``: token t, its old log-prob, mask, weight ...); logits (or
  hidden states) row t predicts token t+1. The shift happens on the ``[B, T]`` side
  (:func:`_shift_to_logits`): labels move left with ``ignore_index`` in the last slot, the other
  per-token tensors move left with 0 there, so the logits / hidden states are used as given (no
  ``[N, V]`` or ``[N, D]`` copy, and backward returns their full gradient directly). The last
  row costs one wasted row of work per sequence. Per-token outputs come back aligned with
  ``labels`` again (token 0 has no prediction: 0). The result equals slicing by hand
  (``logits[:, :-1]`` with ``labels[:, 1:]`` etc.), ``seq-mean-token-sum-norm``'s default length
  included (T - 1).
- ``ignore_index``: a position whose label is ``ignore_index`` has no target; it is out of the
  loss (as if ``loss_mask`` were 0 there) and out of the statistics.
- ``return_token_loss=True``: ``stats`` also carries ``token_loss`` (L_t, 0 where the mask is 0),
  ``token_logprobs`` and ``token_entropy`` (every position; log-prob 0 without a target), detached
  fp32 tensors shaped like ``labels``, read from the rows the pass computes anyway.
- ``logit_scale`` / ``softcap``: the model maps its raw logits z to ``c tanh(s z / c)`` (Cohere /
  Granite scale, Gemma-2 soft cap) before the temperature. They describe the model's head, not
  the loss: the same :class:`LossConfig` (the algorithm's hyper-parameters, shared by presets
  across models) must stay right for any model, so they are call arguments beside
  ``temperature``. From hidden states (fused-linear) pass the model's values: the kernel applies
  them per logits block, gradient included. On logits, pass them only for raw ``hidden @ W.T``
  logits: HF models that soft-cap or scale return logits that already are.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import LossConfig
from .fused_linear import FusedLinearAEPOLossFunction, chunk_bytes_for, fused_linear_logprob_entropy, token_chunk_for_budget
from .logits_ops import _as_3d, _resolve_backend, logit_map, logprob_entropy, shift_labels_left, shift_to_labels
from .one_pass import OnePassLossFunction, aggregation_weights, one_pass_loss_traceable
from .policy_loss import _loss_stats, apply_token_weights, entropy_moments, entropy_stats_from_moments, policy_loss_from_logprobs
from .row_inputs import RowInputs


# ---------------------------------------------------------------------------------------------
# Per-token bookkeeping shared by both loss functions: shape checks, label shifting, the target mask.

def _check_token_shapes(labels: torch.Tensor, tokens: dict[str, torch.Tensor | None]) -> None:
    """Every per-token tensor is shaped like ``labels``; ``advantages`` may be ``[B]`` per sequence."""
    for name, t in tokens.items():
        if t is None or t.shape == labels.shape:
            continue
        if name == "advantages" and t.shape == labels.shape[:-1]:
            continue
        raise ValueError(f"{name} {tuple(t.shape)} must be shaped like labels {tuple(labels.shape)}"
                         + (" (or [B] per sequence)" if name == "advantages" else ""))


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


def _target_mask(loss_mask: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``loss_mask`` with the positions that have no target (label ``ignore_index``) set to 0."""
    return torch.where(labels != ignore_index, loss_mask, torch.zeros_like(loss_mask))


def _prepare_tokens(labels, tokens: dict, config, ignore_index, shift_labels):
    """Checks, shifts (``shift_labels``) and masks (``ignore_index``) the per-token inputs."""
    _check_token_shapes(labels, tokens)
    if shift_labels:
        labels, tokens, config = _shift_to_logits(labels, tokens, config, ignore_index)
    tokens["loss_mask"] = _target_mask(tokens["loss_mask"], labels, ignore_index)
    return labels, tokens, config


def _finish_stats(stats: dict, shift_labels: bool) -> dict:
    if shift_labels:
        for name in ("token_loss", "token_logprobs", "token_entropy"):
            if name in stats:
                stats[name] = shift_to_labels(stats[name])
    return stats


def _row_inputs(labels, old_logprobs, advantages, loss_mask, config, entropy_stats, global_token_count,
                global_num_seqs, ref_logprobs, token_weights=None) -> RowInputs:
    """Per-token inputs shaped like ``labels`` (``[N]`` or ``[B, T]``), before flattening to 3-D."""
    if config.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    advantages = apply_token_weights(advantages, token_weights, labels.shape)
    if advantages.dim() == labels.dim() - 1 and advantages.shape == labels.shape[:-1]:
        advantages = advantages.unsqueeze(-1).expand(labels.shape)  # per sequence -> per token
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != labels.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must be shaped like labels {tuple(labels.shape)}"
                             + (" (or [B] per sequence)" if name == "advantages" else ""))
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


def _as_3d_inputs(inputs: RowInputs, shape3) -> RowInputs:
    view = lambda t: None if t is None else t.reshape(shape3)  # noqa: E731
    return RowInputs(view(inputs.old_logprobs), view(inputs.advantages), view(inputs.weight),
                     inputs.entropy_mean.to(inputs.weight.device), inputs.entropy_std.to(inputs.weight.device),
                     view(inputs.ref_logprobs))


def _stats(rows, loss_mask, config, has_ref, return_token_loss=False, stats_masks=None) -> dict[str, torch.Tensor]:
    logp, entropy, token_loss, ratio, shaped, kl = (r.reshape(loss_mask.shape) for r in rows)
    stats = _loss_stats(entropy, ratio, shaped, loss_mask, config, kl if has_ref else None, stats_masks)
    if return_token_loss:
        stats["token_loss"] = torch.where(loss_mask != 0, token_loss, torch.zeros_like(token_loss))
        stats["token_logprobs"], stats["token_entropy"] = logp, entropy
    return stats


def _prepare_stats_masks(stats_masks, labels, shift_labels):
    """``stats_masks`` checked against ``labels`` and shifted like ``loss_mask`` (``shift_labels``)."""
    if not stats_masks:
        return stats_masks
    for name, mask in stats_masks.items():
        if mask.shape != labels.shape:
            raise ValueError(f"stats_masks[{name!r}] {tuple(mask.shape)} must be shaped like labels {tuple(labels.shape)}")
    if shift_labels:
        return {name: F.pad(mask[..., 1:], (0, 1)) for name, mask in stats_masks.items()}
    return stats_masks


# ---------------------------------------------------------------------------------------------
# The options both loss functions take, and the prologue/epilogue they share.

class LossOptions(NamedTuple):
    """The keyword options :func:`aepo_policy_loss` and :func:`fused_linear_aepo_policy_loss`
    share: the one place their names and defaults live (each function lists them in its signature
    through :func:`_takes_loss_options`). A ``NamedTuple``, so a caller's ``torch.compile`` traces it.

    Attributes:
        config: :class:`LossConfig`, the algorithm's hyper-parameters.
        temperature: the sampling temperature.
        backend: ``"auto" | "triton" | "torch" | "reference"`` (fused-linear: the row op on each
            logits block, no ``"reference"``).
        entropy_mean, entropy_std: global z-score statistics (see module docstring).
        global_token_count, global_num_seqs: normalisers of the aggregation.
        ref_logprobs: reference log-probs shaped like ``labels`` (needed when ``config.kl_coef != 0``).
        ignore_index: a label with no target (log-prob 0, out of the loss whatever ``loss_mask`` says).
        token_weights: detached per-token weights of the policy-gradient term, shaped like
            ``labels`` (importance-sampling weights; :func:`aepo_kernels.apply_token_weights`).
        stats_masks: name -> mask shaped like ``labels``: the statistics again over each mask's
            valid tokens, as ``<stat>/<name>`` (e.g. tokens of branched trajectories); no extra pass.
        shift_labels: ``labels`` and the per-token tensors are input_ids-aligned; logits (hidden
            states) row t predicts ``labels[t+1]`` (module docstring). Nothing ``[N, V]``/``[N, D]`` is copied.
        return_token_loss: also return the per-token loss, log-probs and entropies in ``stats``.
        logit_scale, softcap: the softmax is taken of ``softcap * tanh(logit_scale * z / softcap) /
            temperature`` -- on logits only for raw ones; from hidden states the model's values
            (module docstring).
    """

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
    shift_labels: bool = False
    return_token_loss: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None


_DEFAULTS = LossOptions()


def _loss_options(function: str, options: dict) -> LossOptions:
    """``**options`` of a loss function as :class:`LossOptions`; an unknown keyword is the
    ``TypeError`` Python raises for any function."""
    for name in options:
        if name not in LossOptions._fields:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
    return LossOptions(**options)


def _takes_loss_options(fn: Callable) -> Callable:
    """Give ``fn(..., **options)`` the signature ``help()`` and ``inspect`` show: its own
    parameters, then every :class:`LossOptions` field as a keyword with its default. Changes
    nothing at call time (``fn`` is returned as it is)."""
    own = inspect.signature(fn)
    params = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    annotations = {name: getattr(a, "__forward_arg__", a) for name, a in LossOptions.__annotations__.items()}
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[name])
               for name, default in LossOptions._field_defaults.items()]
    fn.__signature__ = own.replace(parameters=params)
    return fn


class _Call(NamedTuple):
    """One call after the shared prologue: labels and per-token tensors logits-aligned
    (``shift_labels``), ``loss_mask`` without the ``ignore_index`` positions."""

    labels: torch.Tensor
    tokens: dict[str, torch.Tensor | None]  # old_logprobs, advantages, loss_mask, ref_logprobs, token_weights
    config: LossConfig
    stats_masks: dict[str, torch.Tensor] | None
    backend: str
    inv_t: float
    tanh_scale: float | None  # None without a soft cap (logit_map)

    def row_inputs(self, o: LossOptions, entropy_pass: Callable[[], torch.Tensor]) -> RowInputs:
        """The one pass's per-token inputs; ``entropy_pass`` gives this call's entropies when the
        z-score statistics are needed and not supplied (two-phase)."""
        loss_mask = self.tokens["loss_mask"]
        entropy_stats = _entropy_stats(self.config, loss_mask, o.entropy_mean, o.entropy_std, entropy_pass)
        return _row_inputs(self.labels, self.tokens["old_logprobs"], self.tokens["advantages"], loss_mask,
                           self.config, entropy_stats, o.global_token_count, o.global_num_seqs,
                           self.tokens["ref_logprobs"], self.tokens["token_weights"])

    def stats(self, rows, o: LossOptions) -> dict[str, torch.Tensor]:
        """The statistics of the pass's rows, per-token outputs aligned with the caller's labels."""
        stats = _stats(rows, self.tokens["loss_mask"], self.config, self.tokens["ref_logprobs"] is not None,
                       o.return_token_loss, self.stats_masks)
        return _finish_stats(stats, o.shift_labels)


def _prologue(x: torch.Tensor, labels, old_logprobs, advantages, loss_mask, o: LossOptions) -> _Call:
    """What both loss functions do first: the logit map, the backend for ``x`` (logits or hidden
    states), the statistics masks, and the per-token checks, shift and target mask."""
    inv_t, tanh_scale = logit_map(o.temperature, o.logit_scale, o.softcap)
    backend = _resolve_backend(o.backend, x)
    stats_masks = _prepare_stats_masks(o.stats_masks, labels, o.shift_labels)
    labels, tokens, config = _prepare_tokens(labels, dict(
        old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask, ref_logprobs=o.ref_logprobs,
        token_weights=o.token_weights), o.config, o.ignore_index, o.shift_labels)
    return _Call(labels, tokens, config, stats_masks, backend, inv_t, tanh_scale)


# ---------------------------------------------------------------------------------------------
# The public loss functions.

@_takes_loss_options
def aepo_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    inplace_backward: bool = False,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from logits in one pass (docs/algorithm.md §0, §2b-2d).

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` (logits of position t predict ``labels[t]``), unit
            stride on V (other strides are kept: ``logits[:, :-1]`` is not copied).
        labels: ``[N]`` / ``[B, T]`` sampled token ids; ``ignore_index`` positions have no target
            (log-prob 0, out of the loss whatever ``loss_mask`` says).
        old_logprobs, loss_mask: shaped like ``labels``; advantages: the same or ``[B]`` per
            sequence. See :func:`policy_loss_from_logprobs`.
        inplace_backward: the gradient is written over the logits buffer during the forward call
            (no second ``[N, V]`` tensor). Afterwards ``logits`` holds dL/dlogits (for an incoming
            gradient of 1); its version counter is bumped, so an autograd node that saved these
            logits earlier raises instead of reading gradients. Do not read them afterwards.
        **options: the keywords of :class:`LossOptions` (``config``, ``temperature``, ``backend``,
            ``entropy_mean``/``entropy_std``, ``global_token_count``/``global_num_seqs``,
            ``ref_logprobs``, ``ignore_index``, ``token_weights``, ``stats_masks``,
            ``shift_labels``, ``return_token_loss``, ``logit_scale``/``softcap``), documented there.
    Returns:
        ``(loss, stats)`` with stats a dict of detached scalar tensors (entropy, ratio,
        clipfrac_high/low(/dual), num_tokens, kl with ``ref_logprobs``), plus ``token_loss``,
        ``token_logprobs``, ``token_entropy`` (shaped like ``labels``) with ``return_token_loss``.
    """
    o = _loss_options("aepo_policy_loss", options)
    call = _prologue(logits, labels, old_logprobs, advantages, loss_mask, o)
    labels, tokens, config, backend = call.labels, call.tokens, call.config, call.backend
    if backend == "reference":
        logprobs, entropy = logprob_entropy(logits, labels, o.temperature, backend="reference",
                                            ignore_index=o.ignore_index, logit_scale=o.logit_scale, softcap=o.softcap)
        loss, stats = policy_loss_from_logprobs(
            logprobs, entropy, **tokens, config=config, entropy_mean=o.entropy_mean, entropy_std=o.entropy_std,
            global_token_count=o.global_token_count, global_num_seqs=o.global_num_seqs,
            return_token_loss=o.return_token_loss, stats_masks=call.stats_masks)
        if o.return_token_loss:
            stats["token_logprobs"], stats["token_entropy"] = logprobs.detach(), entropy.detach()
        return loss, _finish_stats(stats, o.shift_labels)
    if torch.compiler.is_compiling():
        # Under a caller's torch.compile: the custom op (opaque to the compiler, never in place).
        entropy_pass = lambda: _traceable(logits.detach(), labels, tokens, LossConfig(entropy_adv_alpha=0.0),  # noqa: E731
                                          call.inv_t, call.tanh_scale, o.ignore_index, backend)[1][1]
    else:
        entropy_pass = lambda: logprob_entropy(logits.detach(), labels, o.temperature, backend=backend,  # noqa: E731
                                               ignore_index=o.ignore_index, logit_scale=o.logit_scale,
                                               softcap=o.softcap)[1]
    inputs = call.row_inputs(o, entropy_pass)
    logits3, labels3 = _as_3d(logits, labels)
    inputs = _as_3d_inputs(inputs, labels3.shape)
    if torch.compiler.is_compiling():
        loss, rows = one_pass_loss_traceable(logits3, labels3, inputs, config, call.inv_t, o.ignore_index, backend,
                                             call.tanh_scale)
    else:
        in_place = inplace_backward and logits3.requires_grad and torch.is_grad_enabled()
        loss, rows = OnePassLossFunction.apply(logits3, labels3, inputs, config, call.inv_t, o.ignore_index, backend,
                                               in_place, call.tanh_scale)
    return loss, call.stats(rows, o)


def _traceable(logits, labels, tokens, config, inv_t, tanh_scale, ignore_index, backend):
    """``(loss, rows)`` through the custom op, statistics unused (alpha_H = 0): the entropy pass
    of the two-phase path under torch.compile."""
    zero = torch.zeros((), device=logits.device)
    inputs = _row_inputs(labels, tokens["old_logprobs"], tokens["advantages"], tokens["loss_mask"], config,
                         (zero, zero + 1), None, None, None)
    logits3, labels3 = _as_3d(logits, labels)
    rows = one_pass_loss_traceable(logits3, labels3, _as_3d_inputs(inputs, labels3.shape), config, inv_t,
                                   ignore_index, backend, tanh_scale)[1]
    return None, rows.reshape(6, *labels.shape)


@_takes_loss_options
def fused_linear_aepo_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
    token_chunk: int | None = None,
    vocab_chunk: int | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from hidden states ``[N, D]``/``[B, T, D]`` and lm_head ``weight [V, D]``
    (optional ``bias [V]``), never materialising ``[N, V]``, gradient computed in the forward loop.

    Args (others as :func:`aepo_policy_loss`):
        chunk_bytes: memory budget of the one ``[token_chunk, V]`` logits block in ``hidden``'s
            dtype (``token_chunk = chunk_bytes // (V * element size)``), unless ``token_chunk`` is given;
            None: 192 MiB off CUDA, from free memory on CUDA (``fused_linear.chunk_bytes_for``).
        vocab_chunk: vocab block of the no-grad entropy pass of the two-phase path only.
        **options: the keywords of :class:`LossOptions`. ``backend``: the row op on each logits
            block, ``"auto"`` (triton on CUDA) | ``"torch"`` | ``"triton"``. ``shift_labels``: hidden
            row t predicts ``labels[t+1]``; hidden states are not copied. ``logit_scale``,
            ``softcap``: the model's logits are ``softcap * tanh(logit_scale * z / softcap)`` of
            ``z = hidden @ weight.T + bias`` (pass the model config's values).
    Returns:
        ``(loss, stats)`` as :func:`aepo_policy_loss`; gradients flow to hidden, weight and bias.
    Cost: 3 matmuls of 2 N D V flops (logits, d_hidden, d_weight) in ``hidden``'s dtype (a weight
    stored wider, e.g. fp32 master weights with bf16 hidden states, is cast to it once per call),
    an fp32 ``[V, D]`` weight-gradient accumulator (the gradient itself for fp32 weights), one
    ``[token_chunk, V]`` block in ``hidden``'s dtype.
    """
    o = _loss_options("fused_linear_aepo_policy_loss", options)
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"shapes: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)}")
    call = _prologue(hidden, labels, old_logprobs, advantages, loss_mask, o)
    if call.backend == "reference":
        raise ValueError("backend='reference': use aepo_policy_loss on materialised logits")
    labels = call.labels
    inputs = call.row_inputs(o, lambda: fused_linear_logprob_entropy(
        hidden.detach(), weight.detach(), labels, o.temperature, bias=None if bias is None else bias.detach(),
        ignore_index=o.ignore_index, vocab_chunk=vocab_chunk, chunk_bytes=chunk_bytes, logit_scale=o.logit_scale,
        softcap=o.softcap)[1])
    n_tokens = labels.numel()
    inputs = _as_3d_inputs(inputs, (1, n_tokens))
    chunk_bytes = chunk_bytes_for(hidden.device, chunk_bytes)
    token_chunk = token_chunk or token_chunk_for_budget(weight.shape[0], chunk_bytes, hidden.element_size())
    loss, rows = FusedLinearAEPOLossFunction.apply(
        hidden.reshape(n_tokens, hidden.shape[-1]), weight, bias, labels.reshape(1, n_tokens).long(), inputs,
        call.config, call.inv_t, o.ignore_index, call.backend, token_chunk, call.tanh_scale)
    return loss, call.stats(rows, o)


class AEPOLoss(nn.Module):
    """``nn.Module`` around :func:`aepo_policy_loss` holding the config, temperature and backend."""

    def __init__(self, config: LossConfig = _DEFAULTS.config, temperature: float = _DEFAULTS.temperature,
                 backend: str = _DEFAULTS.backend, inplace_backward: bool = False):
        super().__init__()
        self.config, self.temperature = config, temperature
        self.backend, self.inplace_backward = backend, inplace_backward

    def forward(self, logits, labels, old_logprobs, advantages, loss_mask, **loss_kwargs):
        return aepo_policy_loss(
            logits, labels, old_logprobs, advantages, loss_mask, config=self.config,
            temperature=self.temperature, backend=self.backend, inplace_backward=self.inplace_backward, **loss_kwargs,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, temperature={self.temperature}, backend={self.backend!r}"
