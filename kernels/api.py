"""Public entry points: the AEPO loss from logits or from hidden states, and an ``nn.Module``."""
from __future__ import annotations

import torch
from torch import nn

from .config import LossConfig
from .fused_linear import fused_linear_logprob_entropy
from .logits_ops import logprob_entropy
from .policy_loss import policy_loss_from_logprobs


def aepo_policy_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    backend: str = "auto",
    inplace_backward: bool = False,
    **loss_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from logits: one pass for log-probs and entropies, then spec §2b-2d.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]`` (logits of position t predict ``labels[t]``).
        labels: ``[N]`` / ``[B, T]`` sampled token ids.
        old_logprobs, advantages, loss_mask: see :func:`policy_loss_from_logprobs`.
        config: :class:`LossConfig`; temperature: the sampling temperature.
        backend, inplace_backward: see :func:`aepo_kernels.logprob_entropy`.
        **loss_kwargs: ``entropy_mean``, ``entropy_std``, ``global_token_count``,
            ``global_num_seqs``, ``ref_logprobs`` (see :func:`policy_loss_from_logprobs`).
    Returns:
        ``(loss, stats)`` with stats a dict of detached scalar tensors.
    """
    logprobs, entropy = logprob_entropy(
        logits, labels, temperature, backend=backend, inplace_backward=inplace_backward
    )
    return policy_loss_from_logprobs(
        logprobs, entropy, old_logprobs, advantages, loss_mask, config=config, **loss_kwargs
    )


def fused_linear_aepo_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: LossConfig = LossConfig(),
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    token_chunk: int = 1024,
    vocab_chunk: int = 8192,
    **loss_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AEPO policy loss from hidden states ``[N, D]``/``[B, T, D]`` and lm_head ``weight [V, D]``,
    never materialising ``[N, V]`` (see :mod:`aepo_kernels.fused_linear`)."""
    logprobs, entropy = fused_linear_logprob_entropy(
        hidden, weight, labels, temperature, bias=bias, token_chunk=token_chunk, vocab_chunk=vocab_chunk
    )
    return policy_loss_from_logprobs(
        logprobs, entropy, old_logprobs, advantages, loss_mask, config=config, **loss_kwargs
    )


class AEPOLoss(nn.Module):
    """``nn.Module`` around :func:`aepo_policy_loss` holding the config, temperature and backend."""

    def __init__(self, config: LossConfig = LossConfig(), temperature: float = 1.0, backend: str = "auto", inplace_backward: bool = False):
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
