"""Hugging Face backend: our own batched sampling loop over a ``*ForCausalLM`` with a KV cache.

Why not ``model.generate``: we need, at every sampled position, the log-prob of the sampled token
and the *exact* entropy of the distribution it was drawn from, per-request seeds, and
token-in/token-out stop-string handling. The loop is short enough to own.

What one step does, for a batch of B live rows:
    logits [B, V] (float32) -> z / T -> log_softmax -> (top_p < 1: drop tokens outside the nucleus,
    renormalise) -> logp [B, V];  entropy = -sum exp(logp) logp;  token = inverse-CDF sample with
    u ~ U(0,1) from the request's own CPU ``torch.Generator``;  logprob = logp[token].
So ``logprobs``/``entropies`` describe exactly the distribution sampled from. Under top_p < 1 that
is the truncated, renormalised nucleus distribution (its entropy is lower than the entropy of
softmax(z/T) that the trainer recomputes from full logits). Temperature 0 means greedy; the
reported logprob/entropy are then those of softmax(z) (T = 1).

Batching: prompts are left-padded; the attention mask and explicit position ids make each row's
computation that of the row alone, and each row draws its uniforms from its own generator, so a
request's tokens do not depend on what it is batched with (up to float rounding differences that
would have to fall right on a CDF boundary). Finished rows are dropped from the KV cache.

Stop strings: after each token the decoded tail of the row's output is checked; the output ends
with the token that completes a stop string (the string's tokens are part of ``token_ids``).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from aepo_engine.rollout.entropy import entropy_from_logprobs
from aepo_engine.rollout.protocol import GenOutput, GenRequest


# ---------------------------------------------------------------------------------------------
def sampling_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor,
                      top_p: float | torch.Tensor) -> torch.Tensor:
    """Log-probs of the sampling distribution.

    Args:
        logits: [V] or [B, V] raw logits.
        temperature: T > 0, a float or one per row [B] (T <= 0 is treated as T = 1: the greedy
            path reports the logprob/entropy of softmax(z)).
        top_p: nucleus mass in (0, 1], a float or one per row [B]; the smallest set of top tokens
            whose mass reaches top_p is kept and renormalised.
    Returns:
        float32 log-probs of the same shape as ``logits``, -inf outside the nucleus.
    """
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)  # [B, V]
    if bool((top_p >= 1.0).all()):
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()  # mass strictly above each token
    drop_sorted = mass_before >= top_p.unsqueeze(-1)  # never drops the top token (mass_before 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def sample_inverse_cdf(logp: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling in token-id order.

    Args:
        logp: [B, V] log-probs (rows sum to 1; -inf allowed).
        uniform: [B] draws in [0, 1).
    Returns:
        [B] token ids. ``searchsorted`` returns the first id with cdf >= target; with target > 0
        that id has positive probability, so masked tokens are never drawn.
    """
    cdf = logp.exp().double().cumsum(-1)  # [B, V]
    target = uniform.double().clamp(min=1e-12) * cdf[:, -1]  # [B]
    idx = torch.searchsorted(cdf, target.unsqueeze(-1)).squeeze(-1)
    return idx.clamp(max=logp.shape[-1] - 1)


class _Row:
    """Book-keeping for one request while it is generated."""

    def __init__(self, req: GenRequest):
        self.req = req
        self.gen = torch.Generator().manual_seed(int(req.seed))
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.finish: str | None = None
        self.stop_string: str | None = None


# ---------------------------------------------------------------------------------------------
class HFBackend:
    """GenerationBackend over a Hugging Face causal LM (exact entropies).

    Args:
        model_or_path: a loaded ``PreTrainedModel`` or a checkpoint folder/name for
            ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: tokenizer (default: ``AutoTokenizer.from_pretrained(path)``).
        device: torch device for the model.
        dtype: model dtype when loading from a path (default float32 on CPU, bfloat16 on GPU);
            sampling maths always runs in float32.
        max_batch_size: at most this many requests share one forward pass.
    """

    entropy_is_exact = True

    def __init__(self, model_or_path, tokenizer=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, max_batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            model = AutoModelForCausalLM.from_pretrained(str(model_or_path), dtype=dtype)
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_or_path))
        else:
            model = model_or_path
        if tokenizer is None:
            raise ValueError("tokenizer is required when a model object is passed")
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._eos = self._collect_eos_ids()

    def _collect_eos_ids(self) -> tuple[int, ...]:
        ids = set()
        for src in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else src)
        return tuple(sorted(ids))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    # -----------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        """Sample every request, ``max_batch_size`` at a time; outputs in request order."""
        outputs: list[GenOutput] = []
        for start in range(0, len(requests), self.max_batch_size):
            outputs.extend(self._generate_batch(requests[start : start + self.max_batch_size]))
        return outputs

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenRequest]) -> list[GenOutput]:
        rows = [_Row(r) for r in requests]
        for row in rows:
            if not row.req.prompt_ids:
                raise ValueError("empty prompt_ids: a backend needs at least one context token")
            if row.req.max_new_tokens <= 0:
                row.finish = "length"
        live = [i for i, row in enumerate(rows) if row.finish is None]
        if live:
            self._run(rows, live)
        return [self._output(row) for row in rows]

    def _run(self, rows: list[_Row], live: list[int]) -> None:
        # Prefill: left-padded prompts, positions count real tokens only.
        width = max(len(rows[i].req.prompt_ids) for i in live)
        input_ids = torch.full((len(live), width), self._pad_id, dtype=torch.long)  # [B, L]
        mask = torch.zeros((len(live), width), dtype=torch.long)  # [B, L]
        for b, i in enumerate(live):
            ids = rows[i].req.prompt_ids
            input_ids[b, width - len(ids):] = torch.tensor(ids)
            mask[b, width - len(ids):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]  # logits: [B, V]
        next_pos = positions[:, -1:] + 1  # [B, 1]
        while True:
            new_tokens = self._sample_step([rows[i] for i in live], logits)
            keep = [b for b, i in enumerate(live) if rows[i].finish is None]
            if not keep:
                return
            if len(keep) < len(live):  # drop finished rows from the cache and all row tensors
                cache.batch_select_indices(torch.tensor(keep, device=self.device))
                mask, next_pos = mask[keep], next_pos[keep]
                new_tokens = [new_tokens[b] for b in keep]
                live = [live[b] for b in keep]
            step_ids = torch.tensor(new_tokens, device=self.device).unsqueeze(-1)  # [B, 1]
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=-1)  # [B, L + t]
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=next_pos,
                             past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1

    def _sample_step(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Sample one token per row from logits [B, V]; records logprob/entropy/finish per row."""
        reqs = [row.req for row in rows]
        logp = sampling_logprobs(logits, torch.tensor([r.temperature for r in reqs]),
                                 torch.tensor([r.top_p for r in reqs]))  # [B, V]
        # one uniform per row from the row's own generator (drawn even when greedy: same stream)
        uniform = torch.stack([torch.rand((), generator=row.gen) for row in rows]).to(logits.device)
        greedy = torch.tensor([r.temperature <= 0 for r in reqs], device=logits.device)
        tokens = torch.where(greedy, logp.argmax(-1), sample_inverse_cdf(logp, uniform))  # [B]
        picked = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B]
        stats = torch.stack([tokens.double(), picked.double(), entropy_from_logprobs(logp).double()])
        token_list, logprob_list, entropy_list = stats.tolist()  # the step's only device sync
        out = []
        for row, token, logprob, entropy in zip(rows, token_list, logprob_list, entropy_list):
            token = int(token)
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.entropies.append(entropy)
            if token in self._eos:
                row.finish = "eos"
            elif (hit := self._stop_hit(row)) is not None:
                row.finish, row.stop_string = "stop", hit
            elif len(row.tokens) >= row.req.max_new_tokens:
                row.finish = "length"
            out.append(token)
        return out

    def _stop_hit(self, row: _Row) -> str | None:
        """The stop string completed by the last token, if any (earliest-ending wins)."""
        stops = row.req.stop_strings
        if not stops:
            return None
        # Each token decodes to >= 1 byte, so a window of (longest stop in bytes + 1) tokens
        # covers every stop string that could end inside the last token.
        window = max(len(s.encode()) for s in stops) + 1
        tail = row.tokens[-window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
        common = len(before)
        while common > 0 and not text.startswith(before[:common]):
            common -= 1  # a trailing partial UTF-8 char may decode differently once completed
        best: tuple[int, str] | None = None
        for s in stops:
            at = text.find(s, max(0, common - len(s) + 1))
            if at >= 0 and (best is None or at + len(s) < best[0]):
                best = (at + len(s), s)
        return None if best is None else best[1]

    def _output(self, row: _Row) -> GenOutput:
        return GenOutput(
            token_ids=row.tokens, logprobs=row.logprobs, entropies=row.entropies,
            finish_reason=row.finish or "length", stop_string=row.stop_string,
            text=self.tokenizer.decode(row.tokens, skip_special_tokens=True),
        )

    # -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        """Copy weights in, a bucket at a time (see ``update_weights``)."""
        for bucket in buckets:
            self.update_weights(bucket)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights (HF parameter names, any subset) into the model in place."""
        params = dict(self.model.state_dict())
        unknown = [name for name in state_dict if name not in params]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]}")
        for name, value in state_dict.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))
