"""The input contract of the public entry points, checked in one place (docs/library.md).

Every public function that takes logits or hidden states (:func:`aepo_kernels.aepo_policy_loss`,
:func:`aepo_kernels.fused_linear_aepo_policy_loss`, :func:`aepo_kernels.logprob_entropy`,
:func:`aepo_kernels.fused_linear_logprob_entropy`, the tree losses of :mod:`aepo_kernels.tree_loss`)
or per-token log-probs (:func:`aepo_kernels.policy_loss_from_logprobs`, which the TRL and verl
integrations call) checks its arguments here before any work. A refusal names the function, the
argument, what was given
and what is expected, in the caller's own shapes (never the internally flattened ones).

Two kinds of check:
- **Metadata** (dtype, shape, device, the alignment flag): free, always raised at once.
- **Values** (labels in ``[0, V)`` or ``ignore_index``; masks and token weights finite and >= 0):
  an elementwise pass over the ``[N]`` per-token tensors -- nothing next to the ``[N, V]`` work --
  whose verdict must be read on the host. On the CPU that read is free: the call raises at once
  (:class:`ValueError`, with the count and the first offending value and position). On CUDA it
  would be a host-device sync per call, so it is not made: the verdict goes to
  ``torch._assert_async``, a device-side assert that fails the process loudly at the next
  synchronising call, as PyTorch's own ``cross_entropy`` does with an out-of-range target. The
  same device-side path runs under a caller's ``torch.compile`` (a host read would break the graph).
  Whatever the device, an out-of-range label is never counted: :func:`target_mask` takes it out
  of the loss, the token count and the statistics before the pass, and the kernels give a row
  without a target no loss and no gradient.

Masks are weights: ``loss_mask`` (and each ``stats_masks`` entry) may be bool, integer or
floating; a value w >= 0 weights the token's whole loss, its share of the token count and of the
entropy statistics (w = 2 is the token counted twice; 0/1 is the usual mask). Negative or
non-finite values are refused. Per-token weights of the policy-gradient term alone are
``token_weights``.

Depends on torch only (the modules that implement the entry points import it, not the reverse).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# What a float-valued per-token argument may be (fp64 is for float64 gradchecks on the CPU paths).
_FLOAT = "a floating-point tensor (float32, bfloat16, float16 or float64)"


# ---------------------------------------------------------------------------------------------
# Alignment: which logits row predicts which label. No default, on purpose.

def alignment(function: str, shift_labels) -> bool:
    """The caller's ``shift_labels``, which must be given: either convention applied to the other's
    tensors returns a plausible loss that is wrong (no error, no NaN), so neither is assumed."""
    if shift_labels is None:
        raise TypeError(
            f"{function}() needs shift_labels=True or shift_labels=False (there is no default): True when labels "
            "are the input_ids (Hugging Face's convention: logits row t predicts labels[t+1]; the shift is done "
            "for you, no [N, V] copy); False when labels[t] is already the target of logits row t "
            "(e.g. logits[:, :-1] with labels=input_ids[:, 1:])")
    if not isinstance(shift_labels, bool):
        hint = (" (Hugging Face's loss functions take pre-shifted labels as a shift_labels tensor: pass such "
                "labels as labels= with shift_labels=False)") if isinstance(shift_labels, torch.Tensor) else ""
        raise TypeError(f"{function}(): shift_labels must be True or False, got {type(shift_labels).__name__}{hint}")
    return shift_labels


# ---------------------------------------------------------------------------------------------
# Metadata checks: dtype, shape, device.

def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def _tensor(function: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{function}(): {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(function: str, name: str, t: torch.Tensor, anchor: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{function}(): {name} is on {t.device}, {anchor} on {device}: every tensor argument "
                         f"must be on {anchor}'s device")


def check_labels(function: str, labels, rows: torch.Size, anchor: str, anchor_shape: torch.Size,
                 device: torch.device) -> torch.Tensor:
    """``labels``: integer token ids shaped like ``anchor``'s leading dims ``rows``."""
    labels = _tensor(function, "labels", labels)
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{function}(): labels must be an integer tensor of token ids (int64 or int32), "
                        f"got {labels.dtype}")
    if labels.shape != rows:
        raise ValueError(f"{function}(): labels {_shape(labels)} must be shaped like the leading dims of {anchor}, "
                         f"{list(rows)} ({anchor} is {list(anchor_shape)})")
    _same_device(function, "labels", labels, anchor, device)
    return labels


def check_logits(function: str, logits, labels) -> None:
    """``logits [N, V]`` or ``[B, T, V]``, floating point, with ``labels [N]`` / ``[B, T]``."""
    logits = _tensor(function, "logits", logits)
    if not logits.is_floating_point():
        raise TypeError(f"{function}(): logits must be {_FLOAT}, got {logits.dtype}")
    if logits.dim() not in (2, 3) or logits.shape[-1] == 0:
        raise ValueError(f"{function}(): logits must be [N, V] or [B, T, V] with V > 0, got {_shape(logits)}")
    check_labels(function, labels, logits.shape[:-1], "logits", logits.shape, logits.device)


def check_hidden(function: str, hidden, weight, labels, bias=None) -> None:
    """``hidden [N, D]`` / ``[B, T, D]``, the lm_head ``weight [V, D]`` (hidden first: Liger's
    fused-linear functions take ``(weight, hidden)``), optional ``bias [V]``."""
    hidden, weight = _tensor(function, "hidden", hidden), _tensor(function, "weight", weight)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and not _tensor(function, name, t).is_floating_point():
            raise TypeError(f"{function}(): {name} must be {_FLOAT}, got {t.dtype}")
    if hidden.dim() not in (2, 3) or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or weight.shape[0] == 0:
        raise ValueError(
            f"{function}(): expected hidden [N, D] or [B, T, D] and the lm_head weight [V, D] with the same D, "
            f"got hidden {_shape(hidden)} and weight {_shape(weight)} (the order is (hidden, weight, labels, ...); "
            "Liger's fused-linear losses take (weight, hidden))")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{function}(): bias {_shape(bias)} must be [V] = {list(weight.shape[:1])}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _same_device(function, name, t, "hidden", hidden.device)
    check_labels(function, labels, hidden.shape[:-1], "hidden", hidden.shape, hidden.device)


class PerToken(NamedTuple):
    """One per-token argument of a loss: ``kind`` is ``"float"`` (log-probs, advantages, weights)
    or ``"mask"`` (bool, integer or floating weights); ``per_sequence`` allows ``[B]`` for ``[B, T]``."""

    name: str
    tensor: torch.Tensor | None
    kind: str = "float"
    per_sequence: bool = False


def check_per_token(function: str, labels: torch.Tensor, arguments: list[PerToken], anchor: str = "labels") -> None:
    """Each given argument shaped like ``labels`` (or ``[B]`` where ``per_sequence``), of its
    kind's dtype, on ``labels``' device; ``anchor`` is the name ``labels`` has in messages."""
    for arg in arguments:
        if arg.tensor is None:
            continue
        t = _tensor(function, arg.name, arg.tensor)
        if arg.kind == "float" and not t.is_floating_point():
            raise TypeError(f"{function}(): {arg.name} must be {_FLOAT}, got {t.dtype}")
        if arg.kind == "mask" and t.is_complex():
            raise TypeError(f"{function}(): {arg.name} must be bool, integer or floating point, got {t.dtype}")
        per_sequence = arg.per_sequence and labels.dim() == 2 and t.shape == labels.shape[:1]
        if t.shape != labels.shape and not per_sequence:
            also = f" or [B] = {list(labels.shape[:1])} per sequence" if arg.per_sequence and labels.dim() == 2 else ""
            raise ValueError(f"{function}(): {arg.name} {_shape(t)} must be shaped like {anchor} "
                             f"{_shape(labels)}{also}")
        _same_device(function, arg.name, t, anchor, labels.device)


def check_loss_tokens(function: str, anchor: torch.Tensor, anchor_name: str, tokens: dict[str, torch.Tensor | None],
                      stats_masks: dict[str, torch.Tensor] | None) -> None:
    """The per-token arguments of a loss, metadata then values: ``tokens`` holds ``old_logprobs``,
    ``advantages`` (or ``[B]`` per sequence), ``loss_mask`` and optionally ``entropy``,
    ``ref_logprobs``, ``token_weights``; each shaped like ``anchor`` (the labels or the log-probs)."""
    masks = {f"stats_masks[{name!r}]": mask for name, mask in (stats_masks or {}).items()}
    kinds = {"advantages": dict(per_sequence=True), "loss_mask": dict(kind="mask")}
    check_per_token(function, anchor, [PerToken(name, t, **kinds.get(name, {})) for name, t in tokens.items()]
                    + [PerToken(name, mask, "mask") for name, mask in masks.items()], anchor=anchor_name)
    enforce(function, weight_rules({"loss_mask": tokens["loss_mask"], "token_weights": tokens.get("token_weights"),
                                    **masks}))


# ---------------------------------------------------------------------------------------------
# Value checks: raised at once on the CPU, a device-side assert on CUDA (no host sync).

def target_mask(labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """bool, shaped like ``labels``: the positions whose label is a token of the vocabulary (not
    ``ignore_index``, in ``[0, vocab)``); the others have no target and are out of the loss."""
    return (labels != ignore_index) & (labels >= 0) & (labels < vocab)


class ValueRule(NamedTuple):
    """``bad`` (bool, shaped like ``values``) marks the entries of argument ``name`` that break
    ``expected``."""

    name: str
    values: torch.Tensor
    bad: torch.Tensor
    expected: str


def label_rule(labels: torch.Tensor, vocab: int, ignore_index: int) -> ValueRule:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    return ValueRule("labels", labels, bad, f"token ids in [0, {vocab}) or ignore_index={ignore_index}")


def weight_rules(arguments: dict[str, torch.Tensor | None]) -> list[ValueRule]:
    """Masks and token weights: finite and >= 0 (bool masks need no check)."""
    rules = []
    for name, t in arguments.items():
        if t is None or t.dtype == torch.bool:
            continue
        bad = t < 0 if not t.is_floating_point() else ~(torch.isfinite(t) & (t >= 0))
        rules.append(ValueRule(name, t, bad, "finite weights >= 0 (0/1 for a plain mask)"))
    return rules


def enforce(function: str, rules: list[ValueRule]) -> None:
    """Raise for the first rule with a bad entry: at once on the CPU (:class:`ValueError`); on
    CUDA and under ``torch.compile`` through ``torch._assert_async`` (no host sync: the process
    fails at the next synchronising call, the message in the device assert's report)."""
    for rule in rules:
        if rule.values.device.type == "meta":
            continue
        if rule.values.is_cuda or torch.compiler.is_compiling():
            # One tiny reduction and one assert kernel per rule, queued behind the caller's work.
            message = f"{function}(): {rule.name} must hold {rule.expected}"
            torch._assert_async(~rule.bad.any(), message[:250])
            continue
        if not bool(rule.bad.any()):
            continue
        where = rule.bad.nonzero()[0]
        count = int(rule.bad.sum())
        raise ValueError(f"{function}(): {rule.name} must hold {rule.expected}; got {count} other value(s), the "
                         f"first {rule.values[tuple(where)].item()} at {tuple(where.tolist())}")
