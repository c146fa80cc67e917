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

Capabilities (``rollout.protocol.Capabilities``): abort and exact entropy always; prefix reuse
where the store is on (below); LoRA where built with it; no sleep mode and no group (one device).

Abort (``capabilities.abort``): ``generate(requests, abort=event)`` checks the event after every
sampled token; once it is set, every unfinished request ends there with finish reason ``"abort"``
and the tokens it has (a request of a later batch that has not started, with none). Asynchronous
training sets it when new weights have arrived, loads them, and continues the cut segments from
their prefix (``rollout.scheduler``).

Prefix reuse (``prefix_cache_gib`` > 0, the default): a multi-turn rollout sends, round after
round, the previous round's context plus the sampled tokens plus a tool result, and branches send
their parent's context again. So the backend keeps the keys and values of every context it
prefilled and of every finished row (its context plus all but the last sampled token, which was
never fed) in a least-recently-used store bounded in bytes, keyed by the token ids they encode. A later request
whose ``prompt_ids`` start with a stored sequence prefills only the rest; requests of one batch
with identical ``prompt_ids`` are prefilled once. The prefill then lays each row out as
``[pad | reused KV | pad | new tokens]`` with an attention mask over it and positions that count
real tokens only, which is the same computation as a full prefill up to float rounding (the
matmuls run over other shapes: logprobs agree to ~1e-6 in float32, and a sampled token can change
only where a uniform falls within that distance of a CDF boundary). Set ``prefix_cache_gib=0`` for
a backend whose every call recomputes its whole context. Weight updates through
``update_weights``/``load_weight_buckets`` empty the store; code that changes the model's weights
in some other way must call ``clear_prefix_cache()``. Only models whose HF cache is a plain
full-attention ``DynamicCache`` (no sliding windows, no recurrent state) reuse prefixes; for others
the store stays off.

Decode cache: for those same models the cache's layers are ``_GrowingLayer``s, which write each
step's keys and values in place into a buffer sized at the prefill (context + the batch's largest
``max_new_tokens``) instead of concatenating the whole cache every step as HF's ``DynamicLayer``
does (``bench/bench_hf_decode.py``).
"""
from __future__ import annotations

import inspect
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from aepo_engine.rollout.entropy import entropy_from_logprobs
from aepo_engine.rollout.protocol import Capabilities, CapabilityAliases, GenOutput, GenRequest

if TYPE_CHECKING:
    from aepo_engine.models.config import LoraConfig


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


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, T, head_dim]


class PrefixStore:
    """Keys and values of token sequences, least recently used first out, within a byte budget.

    Args:
        max_bytes: the most bytes the stored tensors may hold together; 0 stores nothing.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self._lengths: dict[int, int] = {}  # stored sequence length -> how many entries have it
        self.hits = self.misses = self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(kv: KV) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)

    def add(self, ids: Sequence[int], kv: KV) -> None:
        """Store ``kv`` (per layer, [kv_heads, len(ids), head_dim]) as the encoding of ``ids``."""
        key = tuple(ids)
        if not key or key in self._entries:
            return
        size = self._size(kv)
        if size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = kv
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.bytes += size

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self._size(self._entries.pop(key))
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]

    def longest_prefix(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """The longest reusable stored prefix of ``ids``: (its length n, its KV [.., n, ..]), or
        (0, None). At least one token of ``ids`` is left to feed (its logits are needed), so a
        stored ``ids`` itself serves its first len(ids) - 1 positions."""
        ids = tuple(ids)
        exact = [(ids, len(ids) - 1)] if len(ids) > 1 else []
        shorter = ((ids[:n], n) for n in sorted(self._lengths, reverse=True) if n < len(ids))
        for key, n in itertools.chain(exact, shorter):  # longest first, slices made as needed
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.reused_tokens += n
                return n, [(k[:, :n], v[:, :n]) for k, v in kv]
        self.misses += 1
        return 0, None

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0


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
class HFBackend(CapabilityAliases):
    """GenerationBackend over a Hugging Face causal LM (exact entropies).

    Args:
        model_or_path: a loaded ``PreTrainedModel`` or a checkpoint folder/name for
            ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: tokenizer (default: ``AutoTokenizer.from_pretrained(path)``).
        device: torch device for the model.
        dtype: model dtype when loading from a path (default float32 on CPU, bfloat16 on GPU);
            sampling maths always runs in float32.
        max_batch_size: at most this many requests share one forward pass.
        prefix_cache_gib: bytes (in GiB) of keys and values kept across calls for prefix reuse
            (module docstring); 0 turns reuse off.
        lora: the trainer's adapters (``policy.lora``, enabled): the same PEFT adapters are
            injected into this model (``models.lora.apply_lora``, in its dtype), so weight
            pushes carry the adapter's tensors only and are applied in place; the adapter starts
            as PEFT's (B = 0: the base model) until the first push.
    Attributes:
        capabilities: abort, exact entropy, prefix reuse (a store with room: ``prefix_cache_gib``
            > 0 and a model whose cache it can hold), LoRA (``lora`` enabled).
    """

    def __init__(self, model_or_path, tokenizer=None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, max_batch_size: int = 32, prefix_cache_gib: float = 1.0,
                 lora: LoraConfig | None = None):
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
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            from aepo_engine.models.lora import apply_lora

            apply_lora(model, self.lora, dtype=next(model.parameters()).dtype)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._eos = self._collect_eos_ids()
        if prefix_cache_gib < 0:
            raise ValueError(f"prefix_cache_gib must be >= 0, got {prefix_cache_gib}")
        self._plain_cache = _plain_dynamic_cache(self.model)
        self.prefix_store = PrefixStore(int(prefix_cache_gib * 2**30) if self._plain_cache else 0)
        self.capabilities = Capabilities(abort=True, exact_entropy=True, prefix_reuse=self.prefix_store.max_bytes > 0,
                                         lora=self.lora is not None)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        # Stop strings are checked on every row at every step: call a fast tokenizer's Rust
        # decoder directly (the same text when no clean-up of spaces is configured; a third of
        # the time of ``tokenizer.decode``'s Python wrapper).
        raw = getattr(tokenizer, "_tokenizer", None)
        if raw is not None and hasattr(raw, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode_tail = lambda ids: raw.decode(list(ids), skip_special_tokens=False)
        else:
            self._decode_tail = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)

    def clear_prefix_cache(self) -> None:
        """Forget every stored prefix (needed after the model's weights change)."""
        self.prefix_store.clear()

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

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the model's weights (a weight push is gathered in it)."""
        return next(self.model.parameters()).dtype

    # -----------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenRequest], abort: Any = None) -> list[GenOutput]:
        """Sample every request, ``max_batch_size`` at a time; outputs in request order.
        ``abort``: a ``threading.Event`` checked after every token (module docstring)."""
        outputs: list[GenOutput] = []
        for start in range(0, len(requests), self.max_batch_size):
            outputs.extend(self._generate_batch(requests[start : start + self.max_batch_size], abort))
        return outputs

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenRequest], abort: Any = None) -> list[GenOutput]:
        rows = [_Row(r) for r in requests]
        for row in rows:
            if not row.req.prompt_ids:
                raise ValueError("empty prompt_ids: a backend needs at least one context token")
            if row.req.max_new_tokens <= 0:
                row.finish = "length"
            elif abort is not None and abort.is_set():
                row.finish = "abort"
        live = [i for i, row in enumerate(rows) if row.finish is None]
        if live:
            self._run(rows, live, abort)
        return [self._output(row) for row in rows]

    def _run(self, rows: list[_Row], live: list[int], abort: Any = None) -> None:
        spare = max(rows[i].req.max_new_tokens for i in live)  # slots a row's cache may still need
        cache, mask, next_pos, logits = self._prefill([tuple(rows[i].req.prompt_ids) for i in live], spare)
        while True:
            new_tokens = self._sample_step([rows[i] for i in live], logits)
            if abort is not None and abort.is_set():
                for i in live:
                    rows[i].finish = rows[i].finish or "abort"
            keep = [b for b, i in enumerate(live) if rows[i].finish is None]
            if len(keep) < len(live):  # store finished rows, then drop them from every row tensor
                self._store_finished(cache, mask, [(b, rows[i]) for b, i in enumerate(live)
                                                   if rows[i].finish is not None])
                if not keep:
                    return
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

    def _prefill(self, prompts: list[tuple[int, ...]], spare: int):
        """One forward pass over the contexts of a batch; returns (cache, mask [B, L], next
        positions [B, 1], last logits [B, V]) for the rows in ``prompts`` order.

        Identical contexts are computed once. Each distinct context reuses the longest stored
        prefix; row u is laid out as ``[pad | reused n_u | pad | new s_u]`` over P + S slots
        (P = max n_u, S = max s_u), positions counting real tokens only."""
        unique: dict[tuple[int, ...], int] = {}
        row_of = torch.tensor([unique.setdefault(p, len(unique)) for p in prompts])  # [B] -> unique
        contexts = list(unique)
        found = [self.prefix_store.longest_prefix(p) if self.prefix_store.max_bytes else (0, None)
                 for p in contexts]
        reused = max(n for n, _ in found)  # P
        width = max(len(p) - n for p, (n, _) in zip(contexts, found))  # S
        U = len(contexts)
        input_ids = torch.full((U, width), self._pad_id, dtype=torch.long)  # [U, S]
        mask = torch.zeros((U, reused + width), dtype=torch.long)  # [U, P + S]
        for u, (ids, (n, _)) in enumerate(zip(contexts, found)):
            new = ids[n:]
            input_ids[u, width - len(new):] = torch.tensor(new)
            mask[u, reused - n : reused] = 1
            mask[u, reused + width - len(new):] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, reused:]  # [U, S]
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep else {}
        if reused:
            kwargs["past_key_values"] = self._stack_prefixes(found, reused, spare)
        elif self._plain_cache:
            kwargs["past_key_values"] = self._new_cache(spare)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **kwargs)
        cache, logits = out.past_key_values, out.logits[:, -1, :]  # logits: [U, V]
        next_pos = positions[:, -1:] + 1  # [U, 1]
        if self.prefix_store.max_bytes:  # a branch resends its parent's context next round
            for u, ids in enumerate(contexts):
                self.prefix_store.add(ids, self._row_kv(cache, mask, u))
        if U < len(prompts):  # rows with the same context share its prefill
            cache.batch_select_indices(row_of.to(self.device))
            mask, next_pos, logits = mask[row_of], next_pos[row_of], logits[row_of]
        return cache, mask, next_pos, logits

    def _new_cache(self, spare: int):
        """An empty DynamicCache whose layers grow in place (``_GrowingLayer``), with room for
        ``spare`` more positions after the prefill."""
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_GrowingLayer(spare) for _ in cache.layers]
        return cache

    def _stack_prefixes(self, found: list[tuple[int, KV | None]], reused: int, spare: int):
        """A cache of the stored prefixes, right-aligned in ``reused`` slots (zeros before)."""
        cache = self._new_cache(spare)
        sample = next(kv for _, kv in found if kv is not None)
        for layer, (k0, v0) in enumerate(sample):
            keys = k0.new_zeros((len(found), k0.shape[0], reused, k0.shape[2]))  # [U, H, P, D]
            values = v0.new_zeros((len(found), v0.shape[0], reused, v0.shape[2]))
            for u, (n, kv) in enumerate(found):
                if n:
                    keys[u, :, reused - n :] = kv[layer][0]
                    values[u, :, reused - n :] = kv[layer][1]
            cache.layers[layer].update(keys, values)
        return cache

    def _store_finished(self, cache, mask: torch.Tensor, finished: list[tuple[int, _Row]]) -> None:
        """Store the KV of each finished row: its context and all but its last sampled token."""
        if not self.prefix_store.max_bytes:
            return
        for b, row in finished:
            ids = tuple(row.req.prompt_ids) + tuple(row.tokens[:-1])
            kv = self._row_kv(cache, mask, b)
            if kv[0][0].shape[1] != len(ids):
                raise RuntimeError(f"prefix store: row has {kv[0][0].shape[1]} cached slots for {len(ids)} tokens")
            self.prefix_store.add(ids, kv)

    @staticmethod
    def _row_kv(cache, mask: torch.Tensor, b: int) -> KV:
        """Row ``b``'s keys and values at its real (unpadded) slots, in order (copies)."""
        where = mask[b].nonzero().squeeze(-1)
        return [(layer.keys[b].index_select(1, where), layer.values[b].index_select(1, where))
                for layer in cache.layers]

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
        text = self._decode_tail(tail)
        before = self._decode_tail(tail[:-1]) if len(tail) > 1 else ""
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
        """Copy new weights (HF parameter names, any subset) into the model in place; stored
        prefixes were computed with the old weights and are dropped."""
        self.clear_prefix_cache()
        params = dict(self.model.state_dict())
        unknown = [name for name in state_dict if name not in params]
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown[:5]}")
        for name, value in state_dict.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views into buffers with room to grow.

    ``DynamicLayer.update`` concatenates the whole cache with each step's keys/values, which
    moves O(context) bytes per decode step. Here a step writes its slots in place. A buffer is
    allocated with room for ``spare`` positions beyond what it first holds (the backend passes
    the batch's largest ``max_new_tokens``, so a call never grows it); should it fill up, it
    grows by half. Anything that replaces ``keys`` (``batch_select_indices`` when rows finish)
    leaves a tensor that is not a view of the buffer; the next update copies it into a new
    buffer of the same length, as the concatenation would have copied it.
    """

    def __init__(self, spare: int = 0):
        super().__init__()
        self.spare = spare

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        end = used + key_states.shape[-2]
        buffers = getattr(self, "_buffers", None)
        if (buffers is None or buffers[0].shape[-2] < end or buffers[0].shape[0] != key_states.shape[0]
                or self.keys.data_ptr() != buffers[0].data_ptr()):
            room = end + self.spare if buffers is None else buffers[0].shape[-2]  # rows dropped: same room
            if room < end:
                room = end + max(end // 2, 16)
            buffers = tuple(new.new_empty((*new.shape[:-2], room, new.shape[-1])) for new in (key_states, value_states))
            if used:
                buffers[0][..., :used, :] = self.keys
                buffers[1][..., :used, :] = self.values
            self._buffers = buffers
        buffers[0][..., used:end, :] = key_states
        buffers[1][..., used:end, :] = value_states
        self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
        return self.keys, self.values


def _plain_dynamic_cache(model) -> bool:
    """Whether the model's HF cache is one plain full-attention ``DynamicLayer`` per layer (what
    prefix reuse needs: keys and values of every position, nothing else)."""
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - an unusual config: no reuse
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
