"""The AEPO policy loss inside TRL's ``GRPOTrainer`` (tested with TRL 1.16.0).

Three lines for the user::

    from aepo_kernels import LossConfig
    from aepo_kernels.integrations.trl import AEPOGRPOTrainer
    trainer = AEPOGRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=ds, loss_config=LossConfig())

TRL has no loss hook, so the subclass overrides the private ``_compute_loss`` (and, for the
entropy statistics, wraps ``_generate_and_score_completions`` and
``_get_per_token_logps_and_entropies``); a TRL release that renames them breaks this module
loudly (``AttributeError`` / ``TypeError``), not silently. ``setup.py``'s ``[trl]`` extra pins the
tested version.

Who owns what (one source of truth per setting):
- :class:`LossConfig` owns the policy-gradient term: clip rule and ranges, dual clip, log-ratio
  clamp, entropy-aware advantage (``entropy_adv_alpha``), aggregation. ``GRPOConfig.loss_type``,
  ``epsilon``, ``epsilon_high`` and ``delta`` must stay at TRL's defaults (a changed value raises:
  it would be ignored otherwise). ``seq-mean-token-sum-norm`` without ``seq_norm_length`` uses
  ``max_completion_length`` (TRL's ``dr_grpo`` constant), never the micro-batch's length.
- TRL keeps its optional terms, computed as in ``GRPOTrainer._compute_loss``: the k3 KL
  (``beta``, times the differentiable ratio with ``use_bias_correction_kl``, TRL's default;
  aggregated like the policy term; the fused-linear route takes plain k3 into the kernel as
  ``kl_coef=beta`` and so serves only ``use_bias_correction_kl=False``), the
  vLLM importance-sampling correction, the top-entropy mask (``top_entropy_quantile``) and the
  off-policy sequence mask (``off_policy_mask_threshold``) -- these three multiply the
  policy-gradient term only, exactly what ``token_weights`` does -- the entropy bonus (static or
  adaptive ``entropy_coef``), the MoE auxiliary loss, and the metrics (``entropy``, ``kl``,
  ``clip_ratio/*``). ``LossConfig.kl_coef`` / ``entropy_coef`` must be 0 (set TRL's instead).
- The normaliser: ``token-mean`` divides by the tokens of one optimizer step on this process,
  ``num_items_in_batch / processes * grad_accum / steps_per_generation`` (TRL's ``dapo``
  normaliser); the sequence modes by ``per_device_train_batch_size * grad_accum``. Summed over
  micro-batches and averaged over processes, the gradient is the whole step's mean.
- The temperature: TRL's (``GRPOConfig.temperature``) scales the log-probs, as in sampling.

Entropy statistics over the whole generation batch: with ``entropy_adv_alpha != 0`` the z-score
mean/std must be known before the first micro-batch's loss. They are computed once per
generation batch from the sampling policy's entropies (all-reduced ``entropy_moments`` over
processes) and carried to every micro-batch as 0-dim tensors of the inputs dict (TRL's
``split_tensor_dict`` copies 0-dim tensors to every part). When TRL computes
``old_per_token_logps`` anyway (vLLM IS correction, ``num_iterations > 1``, misaligned steps),
the entropies come out of that same no-grad pass (TRL's fused head computes them in the same
sweep); otherwise one no-grad forward over the generation batch is added. The loss is then
independent of how the batch is split into micro-batches (tested).

Route: TRL 1.16 patches the model with a chunked fused LM head that returns per-token log-probs
and entropies without ``[N, V]`` logits; the loss is :func:`aepo_kernels.policy_loss_from_logprobs`
on them (route ``"trl_logprobs"``). The project's own fused-linear kernel
(:func:`aepo_kernels.fused_linear_aepo_policy_loss`, route ``"fused_linear"``) takes the
backbone's hidden states instead and computes the gradient in its forward loop (3 matmuls of the
head instead of TRL's 4). bench/bench_trl_routes.py measures both on CPU; see
:data:`DEFAULT_ROUTE` for the choice and the figures. The fused-linear route cannot serve the
top-entropy mask or the off-policy mask (both need the current policy's per-token values before
the loss), TRL's bias-corrected KL, the entropy bonus, MoE auxiliary losses, models with logit
soft-capping or a logit scale, PEFT models (TRL's head is patched on the base model) or
multimodal inputs; with any of these the trainer uses ``"trl_logprobs"``. It needs the old
log-probs before its pass: when TRL does not compute them (on-policy steps) they come from the
no-grad pass over the generation batch that also gives the entropy statistics (a pass added for
this alone when ``entropy_adv_alpha == 0``).

Not supported (raises): ``importance_sampling_level="sequence"`` (AEPO's ratio is per token).
"""
from __future__ import annotations

import dataclasses
import functools
import types

import torch
from trl import GRPOTrainer

from ..config import LossConfig
from ..api import fused_linear_aepo_policy_loss
from ..policy_loss import aggregate, entropy_moments, entropy_stats_from_moments, policy_loss_from_logprobs

ROUTES = ("trl_logprobs", "fused_linear")
# The default: the fused-linear kernel does 3 head matmuls to TRL's 4 (no logits recomputation in
# backward) and never holds the [N, V] logits. Time and peak memory of both routes, with dates:
# docs/integrations.md (bench/bench_trl_routes.py, bench/results/trl_routes_cpu.jsonl).
DEFAULT_ROUTE = "fused_linear"

# GRPOConfig fields the AEPO loss replaces, with TRL 1.16's defaults: a changed value would be ignored.
_REPLACED_TRL_FIELDS = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "delta": None}
# The keys of the inputs dict that TRL's _compute_loss forwards to the model (multimodal inputs).
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_ENTROPY_MEAN, _ENTROPY_STD = "aepo_entropy_mean", "aepo_entropy_std"


def _check_args(args, loss_config: LossConfig, route: str) -> LossConfig:
    """Reject settings that would be silently ignored or double-counted; returns the config to use."""
    if route not in ROUTES:
        raise ValueError(f"route={route!r}: choose one of {ROUTES}")
    for name, default in _REPLACED_TRL_FIELDS.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"GRPOConfig.{name}={getattr(args, name)!r}: leave it at TRL's default ({default!r}) because the "
                "AEPO loss replaces it; set the clip rule, eps_low/eps_high, dual_clip and aggregation on LossConfig")
    if loss_config.kl_coef != 0.0:
        raise ValueError("LossConfig.kl_coef != 0: set GRPOConfig.beta instead, because TRL computes the reference "
                         "log-probs only when beta != 0 (the AEPO loss then adds beta * k3 KL)")
    if loss_config.entropy_coef != 0.0:
        raise ValueError("LossConfig.entropy_coef != 0: set GRPOConfig.entropy_coef instead, because TRL owns the "
                         "entropy bonus (static or adaptive) and would add it a second time")
    if args.importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level={args.importance_sampling_level!r}: the AEPO loss needs 'token' "
                         "because its ratio, clip rule and entropy shaping are per token")
    if loss_config.aggregation == "seq-mean-token-sum-norm" and loss_config.seq_norm_length is None:
        # The micro-batch's own T would make the loss depend on padding and on the split.
        loss_config = dataclasses.replace(loss_config, seq_norm_length=args.max_completion_length)
    return loss_config


def _add_hidden_states_forward(model) -> None:
    """``model(..., aepo_hidden_states=True)`` returns the backbone's last hidden state ``[B, L, D]``.

    Called through the (possibly DDP/FSDP-wrapped) model so the wrapper's forward hooks run.
    Installed over TRL's fused-head forward; every other call goes to it unchanged.
    """
    previous = model.forward

    @functools.wraps(type(model).forward)  # keep the signature: generate() validates kwargs against it
    def forward(self, *args, aepo_hidden_states=False, **kwargs):
        if not aepo_hidden_states:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs).last_hidden_state

    model.forward = types.MethodType(forward, model)


class AEPOGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with the AEPO policy loss (see the module docstring).

    Args (besides GRPOTrainer's):
        loss_config: the AEPO loss settings (:class:`aepo_kernels.LossConfig`; its defaults are
            the project's: ``aepo`` clip, dual clip 3, ``entropy_adv_alpha`` 0.2). For TRL's own
            ``dapo`` loss use ``LossConfig(clip="ppo", dual_clip=0, entropy_adv_alpha=0)``.
        route: ``"fused_linear"`` or ``"trl_logprobs"`` (default :data:`DEFAULT_ROUTE`; the
            trainer falls back to ``"trl_logprobs"`` where the fused-linear route cannot serve).
        chunk_bytes: memory budget of the fused-linear route's logits block (None: by device,
            ``aepo_kernels.fused_linear.chunk_bytes_for``).
    """

    def __init__(self, *args, loss_config: LossConfig | None = None, route: str = DEFAULT_ROUTE,
                 chunk_bytes: int | None = None, **kwargs):
        self._captured_entropies = None  # a list while _generate_and_score_completions runs
        super().__init__(*args, **kwargs)
        self.loss_config = _check_args(self.args, loss_config or LossConfig(), route)
        self.chunk_bytes = chunk_bytes
        self.route = "fused_linear" if route == "fused_linear" and self._fused_linear_possible() else "trl_logprobs"
        if self.route == "fused_linear":
            _add_hidden_states_forward(self.model)

    def _fused_linear_possible(self) -> bool:
        text_config = self.model.config.get_text_config()
        scaled = any(getattr(text_config, k, None) not in (None, 1.0) for k in
                     ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"))
        return not (scaled or getattr(text_config, "final_logit_softcapping", None) or self.top_entropy_quantile < 1.0
                    or self.off_policy_mask_threshold is not None or hasattr(self.model, "peft_config")
                    or (self.beta != 0.0 and self.args.use_bias_correction_kl) or self._entropy_bonus_enabled
                    or self.aux_loss_enabled)

    # --- entropy statistics over the whole generation batch ----------------------------------
    def _generate_and_score_completions(self, inputs):
        shaped = self.loss_config.entropy_adv_alpha != 0.0
        if not shaped and self.route == "trl_logprobs":
            return super()._generate_and_score_completions(inputs)
        self._captured_entropies = []
        try:
            output = super()._generate_and_score_completions(inputs)
            captured = self._captured_entropies
        finally:
            self._captured_entropies = None
        if "old_per_token_logps" in output and captured:
            entropy = captured[0]  # from the old-log-prob pass: always TRL's first no-grad pass of self.model
        else:
            logps, entropy = self._sampling_logps_entropies(output)
            if self.route == "fused_linear":
                # The fused-linear loss needs the old log-probs before its pass; TRL's on-policy fallback
                # (old = current, detached) equals the sampling policy's log-probs here.
                output["old_per_token_logps"] = logps
        if shaped:
            mask = output["completion_mask"] * output.get("tool_mask", 1)
            moments = self.accelerator.reduce(entropy_moments(entropy, mask), reduction="sum")
            output[_ENTROPY_MEAN], output[_ENTROPY_STD] = entropy_stats_from_moments(moments)
        return output

    def _get_per_token_logps_and_entropies(self, model, *args, compute_entropy=False, **kwargs):
        capture = (self._captured_entropies is not None and model is self.model and not compute_entropy
                   and not torch.is_grad_enabled())
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, *args, compute_entropy=compute_entropy or capture, **kwargs)
        if capture:
            self._captured_entropies.append(entropies)
            entropies = None
        return logps, entropies, aux

    @torch.no_grad()
    def _sampling_logps_entropies(self, output) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, C]`` log-probs and entropies of the generation batch under the sampling policy (one no-grad pass)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
        attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
        mode = "train" if self.model.training else "eval"
        batch = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        return super()._get_per_token_logps_and_entropies(
            self.model, ids, attention, output["completion_ids"].size(1), batch_size=batch, compute_entropy=True,
            **{k: output[k] for k in _FORWARD_KEYS if k in output})[:2]

    # --- the loss --------------------------------------------------------------------------
    def _normalisers(self, inputs, batch_size: int) -> dict[str, torch.Tensor | float]:
        """``global_token_count`` / ``global_num_seqs`` of one optimizer step on this process."""
        train = self.model.training
        if self.loss_config.aggregation == "token-mean":
            count = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if train:  # num_items_in_batch spans the generation batch: rescale it to one accumulation window
                count = count * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return {"global_token_count": count}
        return {"global_num_seqs": float(batch_size * (self.current_gradient_accumulation_steps if train else 1))}

    def _token_weights(self, inputs, logps, entropies, advantages, mask) -> torch.Tensor | None:
        """``[B, C]`` product of TRL's multiplicative terms on the policy-gradient loss (off-policy
        mask, top-entropy mask, vLLM IS ratio), or None when none is on."""
        weights = []
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps", logps.detach())
            weights.append(self.get_off_policy_mask(
                advantages=advantages if advantages.dim() == 2 else advantages[:, None], per_token_logps=logps,
                sampling_per_token_logps=inputs.get("sampling_per_token_logps", old), mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold))
        if self.top_entropy_quantile < 1.0:
            weights.append(self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile))
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights.append(inputs["importance_sampling_ratio"])  # [B, C] or [B, 1] (sequence modes)
        if not weights:
            return None
        return functools.reduce(torch.mul, [w.float() for w in weights]).expand(mask.shape).detach()

    def _compute_loss(self, model, inputs):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        completion = completion_ids.size(1)
        kwargs = dict(config=self.loss_config, entropy_mean=inputs.get(_ENTROPY_MEAN),
                      entropy_std=inputs.get(_ENTROPY_STD), **self._normalisers(inputs, completion_ids.size(0)))
        if self.loss_config.entropy_adv_alpha != 0.0 and kwargs["entropy_mean"] is None:
            raise RuntimeError("entropy statistics missing from the inputs: _generate_and_score_completions was bypassed")
        if self.route == "fused_linear" and not any(k in inputs for k in _FORWARD_KEYS):  # text-only batch
            loss, stats = self._fused_linear_loss(model, inputs, input_ids, attention_mask, mask, completion, kwargs)
        else:
            logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion, compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **{k: inputs[k] for k in _FORWARD_KEYS if k in inputs})
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old  # TRL's fallback: on-policy, ratio 1
            weights = self._token_weights(inputs, logps, entropies, inputs["advantages"], mask)
            loss, stats = policy_loss_from_logprobs(logps, entropies, old, inputs["advantages"], mask,
                                                    token_weights=weights, **kwargs)
            if weights is not None:  # TRL counts clipped tokens on the raw advantages, masked tokens included
                stats.update(self._trl_clip_fractions(logps, old, inputs["advantages"], mask))
            if self.beta != 0.0:
                kl_loss, stats["kl"] = self._trl_kl(inputs["ref_per_token_logps"], logps, old, mask, kwargs)
                loss = loss + kl_loss
            loss = loss + self._trl_extra_terms(entropies, mask, aux_loss)
        self._log_aepo_metrics(stats, mask)
        return loss

    def _trl_clip_fractions(self, logps, old_logps, advantages, mask) -> dict[str, torch.Tensor]:
        """Clip fractions as TRL defines them: ratio beyond a bound on the side of the raw advantage's sign."""
        ratio = torch.exp(logps.detach() - old_logps)
        advantages = advantages if advantages.dim() == 2 else advantages[:, None]
        count = mask.sum().clamp(min=1.0)
        low = (ratio < 1 - self.loss_config.eps_low) & (advantages < 0)
        high = (ratio > 1 + self.loss_config.eps_high) & (advantages > 0)
        return {"clipfrac_low": (low * mask).sum() / count, "clipfrac_high": (high * mask).sum() / count}

    def _trl_kl(self, ref_logps, logps, old_logps, mask, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta *`` TRL's k3 KL (times the ratio with ``use_bias_correction_kl``), aggregated like the
        policy term; and its masked mean for the ``kl`` metric."""
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if self.args.use_bias_correction_kl:
            kl = kl * torch.exp(logps - old_logps)
        normalisers = {k: v for k, v in kwargs.items() if k.startswith("global_")}
        kl_loss = aggregate(self.beta * kl, mask, kwargs["config"], **normalisers)
        return kl_loss, (kl.detach() * mask).sum() / mask.sum().clamp(min=1.0)

    def _fused_linear_loss(self, model, inputs, input_ids, attention_mask, mask, completion, kwargs):
        with self.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, aepo_hidden_states=True)
        hidden = hidden[:, -completion - 1:-1]  # [B, C, D]: position t predicts completion token t
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        weights = self._token_weights(inputs, None, None, inputs["advantages"], mask)
        if self.beta != 0.0:  # plain k3 (use_bias_correction_kl=False): the kernel's own KL term
            kwargs = {**kwargs, "config": dataclasses.replace(kwargs["config"], kl_coef=self.beta),
                      "ref_logprobs": inputs["ref_per_token_logps"]}
        return fused_linear_aepo_policy_loss(
            hidden, head.weight, inputs["completion_ids"], inputs["old_per_token_logps"], inputs["advantages"], mask,
            temperature=self.temperature, bias=head.bias, chunk_bytes=self.chunk_bytes, token_weights=weights,
            shift_labels=False, **kwargs)

    def _trl_extra_terms(self, entropies, mask, aux_loss) -> torch.Tensor | float:
        """TRL's entropy bonus (static or adaptive) and MoE auxiliary loss, as GRPOTrainer adds them."""
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        extra = 0.0
        if self._entropy_bonus_enabled:
            effective = mask if self.top_entropy_quantile >= 1.0 else mask * self.get_high_entropy_mask(
                entropies, mask, 1 - self.top_entropy_quantile)
            entropy_loss = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / accumulation
            if self.use_adaptive_entropy:
                coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
                self._update_adaptive_entropy(entropies, effective, mode)
            else:
                coef = self.entropy_coef
            extra = extra - coef * entropy_loss
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if self.aux_loss_enabled:
            extra = extra + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return extra

    def _update_adaptive_entropy(self, entropies, effective, mode) -> None:
        """TRL's adaptive entropy controller: window-global entropy vs ``entropy_target`` (as GRPOTrainer)."""
        if mode != "train":
            return
        stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if self.accelerator.sync_gradients:
            window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            delta = self.args.entropy_coef_delta if world_entropy <= self.args.entropy_target else -self.args.entropy_coef_delta
            self.entropy_coef = min(max(self.entropy_coef + delta, self.args.entropy_coef_min), self.args.entropy_coef_max)
            self._last_world_entropy = world_entropy
            self._entropy_window_stats = None

    def _log_aepo_metrics(self, stats: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        """TRL's metric names, token-weighted over processes: entropy, kl, clip_ratio/{low,high,region}_mean."""
        mode = "train" if self.model.training else "eval"
        count = mask.sum().float()
        names = {"entropy": "entropy", "kl": "kl", "clipfrac_low": "clip_ratio/low_mean",
                 "clipfrac_high": "clip_ratio/high_mean", "clipfrac_dual": "clip_ratio/dual_mean"}
        keys = [k for k in names if k in stats]
        region = stats["clipfrac_low"] + stats["clipfrac_high"]
        local = torch.stack([stats[k].float() * count for k in keys] + [region * count, count])
        totals = self.accelerator.reduce(local, reduction="sum").tolist()  # one host sync
        denom = max(totals[-1], 1.0)
        for key, total in zip(keys + ["region"], totals[:-1]):
            self._metrics[mode][names.get(key, "clip_ratio/region_mean")].append(total / denom)
