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

Inputs: the contract of docs/library.md, checked by :mod:`aepo_kernels.contract` before any
work (dtypes, shapes, devices, labels in range, masks as weights >= 0). The per-call set-up the
two functions share (options, checks, label shift, target mask, the one pass's per-token inputs,
statistics) is :mod:`aepo_kernels.loss_call`; this module is only the public face.

Options both loss functions share (keyword arguments, declared once in :class:`LossOptions`;
each costs nothing when off):
- ``shift_labels`` (required, no default): True for the HF ``labels`` convention -- ``labels``
  and every per-token tensor aligned with ``input_ids``, logits (hidden states) row t predicting
  token t+1, shifted on the ``[B, T]`` side with no ``[N, V]`` copy (:mod:`aepo_kernels.loss_call`);
  False when logits row t predicts ``labels[t]``.
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

import torch
from torch import nn

from . import contract
from .config import LossConfig
from .fused_linear import fused_linear_aepo_loss, head_call, head_entropy
from .logits_ops import as_3d, logprob_entropy
from .loss_call import (
    DEFAULTS, LossOptions, as_3d_inputs, caller_aligned_stats, loss_options, prologue, takes_loss_options,
    traceable_entropy_pass,
)
from .one_pass import OnePassLossFunction, one_pass_loss_traceable
from .policy_loss import policy_loss_from_logprobs

__all__ = ["AEPOLoss", "LossOptions", "aepo_policy_loss", "fused_linear_aepo_policy_loss"]


# ---------------------------------------------------------------------------------------------
# The public loss functions.

@takes_loss_options
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
        logits: ``[N, V]`` or ``[B, T, V]`` floating point, unit stride on V (other strides are
            kept: ``logits[:, :-1]`` is not copied). Which label each row predicts is
            ``shift_labels``' (required).
        labels: ``[N]`` / ``[B, T]`` integer token ids in ``[0, V)``, or ``ignore_index`` (no
            target: log-prob 0, out of the loss whatever ``loss_mask`` says).
        old_logprobs: floating, shaped like ``labels``; advantages: the same or ``[B]`` per
            sequence; loss_mask: shaped like ``labels``, a weight >= 0 per token (0/1 masks;
            bool, integer or floating). See :func:`policy_loss_from_logprobs`.
        inplace_backward: the gradient is written over the logits buffer during the forward call
            (no second ``[N, V]`` tensor). Afterwards ``logits`` holds dL/dlogits (for an incoming
            gradient of 1); its version counter is bumped, so an autograd node that saved these
            logits earlier raises instead of reading gradients. Do not read them afterwards.
        **options: the keywords of :class:`LossOptions` (``shift_labels`` -- required --,
            ``config``, ``temperature``, ``backend``, ``entropy_mean``/``entropy_std``,
            ``global_token_count``/``global_num_seqs``, ``ref_logprobs``, ``ignore_index``,
            ``token_weights``, ``stats_masks``, ``return_token_loss``, ``logit_scale``/``softcap``),
            documented there.
    Returns:
        ``(loss, stats)`` with stats a dict of detached scalar tensors (entropy, ratio,
        clipfrac_high/low(/dual), num_tokens, kl with ``ref_logprobs``), plus ``token_loss``,
        ``token_logprobs``, ``token_entropy`` (shaped like ``labels``) with ``return_token_loss``.
    Raises:
        TypeError / ValueError: an input outside the contract (docs/library.md), naming it. A
        bad value on CUDA fails at the next synchronising call instead (no host sync here).
    """
    o = loss_options("aepo_policy_loss", options)
    contract.check_logits("aepo_policy_loss", logits, labels)
    call = prologue("aepo_policy_loss", logits, logits.shape[-1], labels, old_logprobs, advantages, loss_mask, o)
    labels, tokens, config, backend = call.labels, call.tokens, call.config, call.backend
    if backend == "reference":
        logprobs, entropy = logprob_entropy(logits, labels, o.temperature, backend="reference", shift_labels=False,
                                            ignore_index=o.ignore_index, logit_scale=o.logit_scale, softcap=o.softcap)
        loss, stats = policy_loss_from_logprobs(
            logprobs, entropy, **tokens, config=config, entropy_mean=o.entropy_mean, entropy_std=o.entropy_std,
            global_token_count=o.global_token_count, global_num_seqs=o.global_num_seqs,
            return_token_loss=o.return_token_loss, stats_masks=call.stats_masks)
        if o.return_token_loss:
            stats["token_logprobs"], stats["token_entropy"] = logprobs.detach(), entropy.detach()
        return loss, caller_aligned_stats(stats, o.shift_labels)
    if torch.compiler.is_compiling():
        # Under a caller's torch.compile: the custom op (opaque to the compiler, never in place).
        entropy_pass = lambda: traceable_entropy_pass(logits.detach(), call)  # noqa: E731
    else:
        entropy_pass = lambda: logprob_entropy(logits.detach(), labels, o.temperature, backend=backend,  # noqa: E731
                                               shift_labels=False, ignore_index=o.ignore_index,
                                               logit_scale=o.logit_scale, softcap=o.softcap)[1]
    inputs = call.row_inputs(entropy_pass)
    logits3, labels3 = as_3d(logits, labels)
    inputs = as_3d_inputs(inputs, labels3.shape)
    if torch.compiler.is_compiling():
        loss, rows = one_pass_loss_traceable(logits3, labels3, inputs, config, call.inv_t, o.ignore_index, backend,
                                             call.tanh_scale)
    else:
        in_place = inplace_backward and logits3.requires_grad and torch.is_grad_enabled()
        loss, rows = OnePassLossFunction.apply(logits3, labels3, inputs, config, call.inv_t, o.ignore_index, backend,
                                               in_place, call.tanh_scale)
    return loss, call.stats(rows)


@takes_loss_options
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
    head_backward: str | None = None,
    filter_eps: float | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from hidden states ``[N, D]``/``[B, T, D]`` and lm_head ``weight [V, D]``
    (optional ``bias [V]``), never materialising ``[N, V]``, gradient computed in the forward loop.
    The argument order is (hidden, weight, ...): Liger's fused-linear losses take (weight, hidden).

    Args (others as :func:`aepo_policy_loss`):
        head_backward: the loop order of the head (docs/head.md), None: the device's default
            (``fused_linear.default_head_backward``). ``"token_outer"``: token chunks of
            ``[token_chunk, V]`` logits, the gradient formed in the same pass, 3 matmuls, an fp32
            ``[V, D]`` weight-gradient accumulator. ``"vocab_outer"``: a statistics pass (1
            matmul), then vocabulary blocks outer with the logits recomputed (3 matmuls), each
            fp32 ``d_W`` block finished over all tokens and written once in the weight's dtype:
            no ``[V, D]`` fp32 accumulator and no ``[rows, V]`` block, 4 matmuls (with the
            entropy statistics not supplied, its statistics pass is also the entropy pass: 4
            matmuls for both orders). ``"vocab_outer_lean"``: d_W as vocab_outer, d_hidden from a
            token-outer pass of its own (per token chunk: its statistics, its head, its fp32
            ``[rows, D]`` d_hidden block over the vocabulary), no fp32 ``[N, D]`` accumulator
            either: 5 matmuls (two-phase too). On CUDA ``None`` picks vocab_outer where its
            workspace fits ``fused_linear.HEAD_WORKSPACE_BYTES`` (64 MiB), else vocab_outer_lean.
        chunk_bytes: the logits block's memory budget: token_outer, one ``[token_chunk, V]`` block in
            ``hidden``'s dtype (``token_chunk = chunk_bytes // (V * element size)``), unless
            ``token_chunk`` is given, None: 192 MiB off CUDA, from free memory on CUDA
            (``fused_linear.chunk_bytes_for``); vocab_outer, one fp32 ``[token_chunk, vocab_chunk]``
            block (None: ``fused_linear.VOCAB_OUTER_BLOCK_BYTES``); vocab_outer_lean, its whole
            workspace (``fused_linear.lean_chunks``; None: ``HEAD_WORKSPACE_BYTES``).
        vocab_chunk: token_outer: the vocab block of the no-grad entropy pass of the two-phase path
            only; vocab_outer: the vocabulary block of both passes (None: ``VOCAB_OUTER_CHUNK``, 4096);
            vocab_outer_lean: of all its passes (None: from its budget and D, at most 4096).
        filter_eps: vocab_outer and vocab_outer_lean (both gradient sweeps), None (default): exact.
            Gradient filtering: a ``[token_chunk, vocab_chunk]`` tile whose probability mass is
            below ``filter_eps`` for every token skips its dlogits and gradient matmuls (its target
            entries are still added exactly); measured error and time in docs/head.md.
        **options: the keywords of :class:`LossOptions`. ``backend``: the row op on each logits
            block of token_outer, ``"auto"`` (triton on CUDA) | ``"torch"`` | ``"triton"``;
            vocab_outer (not vocab_outer_lean, whose passes are torch): ``"triton"`` (asked for
            explicitly) runs its gradient pass as the Triton kernels of ``aepo_kernels.triton_head``
            (fp32/bf16/fp16, no ``filter_eps``; compiled for sm_80/90/100 and checked in the
            interpreter, not yet run on a GPU, so ``"auto"`` keeps the torch pass on CUDA too),
            ``"torch"``/``"auto"`` the compiled torch block ops (its statistics pass is torch's
            either way). ``shift_labels`` (required): True when hidden row t predicts
            ``labels[t+1]`` (hidden states are not copied). ``logit_scale``, ``softcap``: the
            model's logits are ``softcap * tanh(logit_scale * z / softcap)`` of ``z = hidden @
            weight.T + bias`` (pass the model config's values).
    Returns:
        ``(loss, stats)`` as :func:`aepo_policy_loss`; gradients flow to hidden, weight and bias.
    Cost (token_outer): 3 matmuls of 2 N D V flops (logits, d_hidden, d_weight) in ``hidden``'s
    dtype (a weight stored wider, e.g. fp32 master weights with bf16 hidden states, is cast to it
    once per call), an fp32 ``[V, D]`` weight-gradient accumulator (the gradient itself for fp32
    weights), one ``[token_chunk, V]`` block in ``hidden``'s dtype. It pays off against
    materialised logits when the rows exceed one block (docs/library.md). vocab_outer: 4 matmuls,
    an fp32 ``[N, D]`` d_hidden accumulator, one fp32 ``[vocab_chunk, D]`` d_W block and the
    logits/dlogits blocks (docs/head.md). vocab_outer_lean: 5 matmuls, within 64 MiB beyond d_W
    and d_hidden on CUDA (docs/head.md).
    """
    o = loss_options("fused_linear_aepo_policy_loss", options)
    contract.check_hidden("fused_linear_aepo_policy_loss", hidden, weight, labels, bias)
    call = prologue("fused_linear_aepo_policy_loss", hidden, weight.shape[0], labels, old_logprobs, advantages,
                    loss_mask, o)
    if call.backend == "reference":
        raise ValueError("fused_linear_aepo_policy_loss(): backend='reference' is not offered from hidden states; "
                         "use aepo_policy_loss on materialised logits")
    labels = call.labels
    n_tokens = labels.numel()
    flat_hidden = hidden.reshape(n_tokens, hidden.shape[-1])
    head = head_call(head_backward, flat_hidden, weight, chunk_bytes, token_chunk, vocab_chunk)
    entropy_pass = lambda: head_entropy(  # noqa: E731
        head, flat_hidden, weight, bias, labels.reshape(-1), o.ignore_index, o.temperature, o.logit_scale,
        o.softcap).reshape(labels.shape)
    inputs = as_3d_inputs(call.row_inputs(entropy_pass), (1, n_tokens))
    loss, rows = fused_linear_aepo_loss(
        flat_hidden, weight, bias, labels.reshape(1, n_tokens).long(), inputs, call.config, call.inv_t,
        o.ignore_index, call.backend, call.tanh_scale, head_backward=head.order, chunk_bytes=head.chunk_bytes,
        token_chunk=head.token_chunk, vocab_chunk=head.vocab_chunk, filter_eps=filter_eps,
        stats=head.made.get("stats"),
        head_kernel="triton" if o.backend == "triton" else "torch")  # "auto": torch until a GPU has run them
    return loss, call.stats(rows)


class AEPOLoss(nn.Module):
    """``nn.Module`` around :func:`aepo_policy_loss` holding the alignment, config, temperature
    and backend (``shift_labels`` is required here too: :class:`LossOptions`)."""

    def __init__(self, config: LossConfig = DEFAULTS.config, temperature: float = DEFAULTS.temperature,
                 backend: str = DEFAULTS.backend, inplace_backward: bool = False, *, shift_labels: bool | None = None):
        super().__init__()
        self.shift_labels = contract.alignment("AEPOLoss", shift_labels)
        self.config, self.temperature = config, temperature
        self.backend, self.inplace_backward = backend, inplace_backward

    def forward(self, logits, labels, old_logprobs, advantages, loss_mask, **loss_kwargs):
        return aepo_policy_loss(
            logits, labels, old_logprobs, advantages, loss_mask, shift_labels=self.shift_labels, config=self.config,
            temperature=self.temperature, backend=self.backend, inplace_backward=self.inplace_backward, **loss_kwargs,
        )

    def extra_repr(self) -> str:
        return (f"{self.config}, shift_labels={self.shift_labels}, temperature={self.temperature}, "
                f"backend={self.backend!r}")
