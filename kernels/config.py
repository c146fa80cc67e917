"""Hyper-parameters of the AEPO policy loss (docs/algorithm.md §2), one frozen object.

Independent choices stay independent fields: the clip rule, the entropy-aware advantage, KL,
the entropy bonus and the aggregation. Every value is a runtime argument of plain torch code or a
Triton launch (never a ``tl.constexpr``), so changing an epsilon never recompiles anything.

This is a plain dataclass so ``aepo_kernels`` depends on torch (and triton) only; msgspec decodes
it directly, so the engine's config embeds it as its ``loss`` section with no second copy. The
module itself imports no torch (:func:`hyper_params` does, when called): the engine reads its
config's defaults without loading torch (``aepo_kernels/__init__.py`` loads the kernels on first use).

Beside it, the one order every backend reads the hyper-parameters in (:data:`HYPER_PARAMS`,
:func:`hyper_params`): the torch path's vector, the Triton kernel's scalar arguments and the C
kernel's ``hyper_t`` struct (``csrc/one_pass_rows.c``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

if TYPE_CHECKING:
    import torch

ClipRule = Literal["ppo", "aepo", "gppo", "cispo"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# The per-token clip head is written five times, deliberately: each backend needs it in its own
# language, fused into its own row pass. (1) reference.token_loss_reference (the oracle, literal
# maths, autograd); (2) policy_loss.clipped_token_loss (autograd, for given log-probs);
# (3) one_pass.token_head (explicit derivatives, compiled torch path); (4) triton_kernels._token_head;
# (5) token_head in the native C kernel (kernels/csrc/one_pass_rows.c). The kernels receive a rule
# as its index in this tuple. A new rule goes into all five: tests/test_kernels_clip_rules.py
# checks every implementation against the reference for every rule listed here.
CLIP_RULES: tuple[str, ...] = ("ppo", "aepo", "gppo", "cispo")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the AEPO policy loss.

    Attributes:
        clip: ratio clip rule. ``ppo``: PPO clip (+ dual clip). ``aepo``: stop-gradient high clip
            (docs/algorithm.md §2c: value as PPO, gradient -A(1+eps_high) above the high bound when A>0).
            ``gppo``: gradient-preserving clip on both bounds. ``cispo``: REINFORCE with a
            clipped, stop-gradient importance weight, ``-sg(clip(r)) * A * logp``.
        eps_low: lower clip range, bound ``1 - eps_low``.
        eps_high: upper clip range, bound ``1 + eps_high`` (DAPO's clip-higher: e.g. 0.28).
        dual_clip: dual-clip constant c for A<0 (0 disables; not used by cispo).
        log_ratio_clamp: log(r) is clamped to [-x, x] before exp.
        entropy_adv_alpha: alpha_H of the entropy-aware advantage
            ``A_t = A * (1 + alpha_H * zscore(H_t))`` (docs/algorithm.md §2b); 0 turns it off.
        kl_coef: coefficient of the k3 KL to reference log-probs (0 = off).
        entropy_coef: entropy bonus coefficient (subtracted from the loss; 0 = off).
        aggregation: ``token-mean`` (over valid tokens; pass a global token count for
            micro-batch/world-size invariance), ``seq-mean-token-mean``, or
            ``seq-mean-token-sum-norm`` (Dr. GRPO: per-sequence sum / ``seq_norm_length``).
        seq_norm_length: the constant of ``seq-mean-token-sum-norm`` (default: T of the batch).
    """

    clip: ClipRule = "aepo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float = 3.0
    log_ratio_clamp: float = 20.0
    entropy_adv_alpha: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: Aggregation = "token-mean"
    seq_norm_length: Optional[int] = None

    def __post_init__(self) -> None:
        if self.clip not in CLIP_RULES:
            raise ValueError(f"clip={self.clip!r}: choose one of {CLIP_RULES}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r}: choose one of {AGGREGATIONS}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low={self.eps_low}: must be in [0, 1) because 1 - eps_low is a ratio bound")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high={self.eps_high}: must be >= 0")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0 + self.eps_high:
            raise ValueError(
                f"dual_clip={self.dual_clip}: must exceed 1 + eps_high = {1 + self.eps_high} "
                "(or 0 to disable it) because the dual clip only bounds ratios above the high clip"
            )
        if self.log_ratio_clamp <= 0.0:
            raise ValueError(f"log_ratio_clamp={self.log_ratio_clamp}: must be > 0")
        if self.seq_norm_length is not None and self.seq_norm_length <= 0:
            raise ValueError(f"seq_norm_length={self.seq_norm_length}: must be positive")


# The order of the hyper-parameter vector (torch path), of the Triton kernel's scalar arguments and
# of the C kernel's ``hyper_t`` struct; :func:`hyper_params` appends the clip rule and has_ref.
HYPER_PARAMS = ("eps_low", "eps_high", "dual_clip", "log_ratio_clamp", "entropy_adv_alpha", "kl_coef", "entropy_coef")


def hyper_params(config: LossConfig, has_ref: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """The loss's hyper-parameters as one runtime tensor, so no new value -- not even a new clip
    rule -- recompiles anything.

    Args:
        config: the loss's hyper-parameters.
        has_ref: whether reference log-probs are given (the KL term reads them).
        dtype, device: of the returned tensor.
    Returns:
        ``[9]``: :data:`HYPER_PARAMS`, the clip rule's index in :data:`CLIP_RULES`, and 1/0 for has_ref;
        the same tensor for the same arguments (callers read it, never write it).
    """
    import torch  # here, not at the top: the loss section is read by configs that never load torch

    return _hyper_params(config, bool(has_ref), dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _hyper_params(config: LossConfig, has_ref: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`hyper_params`, made once per (config, has_ref, dtype, device) and shared read-only: a
    loss call on a GPU then copies nothing from the host (a pageable copy waits for the stream)."""
    import torch

    values = [float(getattr(config, name)) for name in HYPER_PARAMS]
    with torch.inference_mode(False):  # a normal tensor even when first asked for under inference_mode
        return torch.tensor([*values, CLIP_RULES.index(config.clip), float(has_ref)], dtype=dtype, device=device)
