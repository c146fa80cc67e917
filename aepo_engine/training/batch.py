"""Padded token tensors for the policy update, built from rollout trajectories.

Alignment (the one thing to get right here): row b holds ``prompt_ids + response_ids`` (length
n_b = P_b + R_b), right-padded to L. Position t predicts token t+1, so

    labels[b, t]       = input_ids[b, t + 1]          for t < n_b - 1, else -100
    loss_mask[b, t]    = traj.loss_mask[t + 1 - P_b]  for P_b - 1 <= t < n_b - 1, else 0
    old_logprobs[b, t] = traj.logprobs[t + 1 - P_b]   (same positions), else 0

so ``loss_mask`` is 1 exactly where the label is a model-written response token (prompt,
tool-result tokens and padding are 0). ``token_origin`` (same positions) says which kind of
trajectory sampled each response token (``TOKEN_ORIGINS``): statistics only, e.g. clip fractions of
branched tokens apart from the others; the loss does not read it. ``versions`` (same positions) is
the policy version that sampled each response token (``Trajectory.versions``; -1 elsewhere): the
staleness of asynchronous training is the updated version minus it. Labels are kept on prompt and tool positions too (they are
real next tokens; the mask, not the label, decides what counts).

Splitting: a batch is cut into PPO mini-batches (consecutive rows, by prompt group or count),
each mini-batch into rank shards (strided rows, padded with masked-out dummy rows so every rank
runs the same number of forward/backward calls, which FSDP's collectives need) and each shard
into micro-batches (by row count or a token budget: padded, or summed when the worker packs the
rows); every piece is trimmed to its own longest row. Splitting runs on the host (the batch stays
on CPU; each micro-batch is copied to the device once), so reading lengths there syncs nothing.
Packing itself (rows concatenated without padding) happens in the worker's forward
(``PolicyModel``); the batch keeps the padded layout. Left out: left padding.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from aepo_engine.rollout.trajectory import Trajectory

IGNORE_INDEX = -100
# token_origin values: 0 prompt / padding; a probe or global trajectory's own response token; a
# branch trajectory's own token (after its branch point); a branch's prefix copied from its parent.
ORIGIN_NONE, ORIGIN_GLOBAL, ORIGIN_BRANCH, ORIGIN_INHERITED = 0, 1, 2, 3
TOKEN_ORIGINS = {"global": ORIGIN_GLOBAL, "branch": ORIGIN_BRANCH}  # the groups statistics are split by

__all__ = ["IGNORE_INDEX", "ORIGIN_BRANCH", "ORIGIN_GLOBAL", "ORIGIN_INHERITED", "ORIGIN_NONE", "TOKEN_ORIGINS",
           "TokenBatch", "concat_rows"]


@dataclass
class TokenBatch:
    """Right-padded token tensors of B trajectories (see the module docstring for alignment).

    Attributes:
        input_ids: ``[B, L]`` long, prompt + response, padded with ``pad_token_id``.
        attention_mask: ``[B, L]`` long, 1 on real tokens.
        labels: ``[B, L]`` long, next token; -100 where there is no target.
        loss_mask: ``[B, L]`` float, 1 where the label is a model-written response token.
        advantages: ``[B]`` per trajectory or ``[B, L]`` per token (aligned with labels).
        old_logprobs: ``[B, L]`` float, log-probs of the labels under the sampling policy.
        group_ids: ``[B]`` long, the prompt each row belongs to (mini-batching by prompt).
        entropy: ``[B, L]`` float or None; per-token entropies of the old policy, filled by
            ``PolicyWorker.compute_logprobs`` and used for global entropy statistics.
        ref_logprobs: ``[B, L]`` float or None; reference-policy log-probs for the k3 KL.
        token_weights: ``[B, L]`` float or None; the detached per-token factors on the
            policy-gradient term that the kernels take as ``token_weights``: here the importance
            weights pi_old / pi_rollout (truncated, or sequences masked) that the rollout
            correction (``training.rollout_correction``, the config section of that name) computes;
            None means all 1.
        token_origin: ``[B, L]`` long or None; who sampled each label (``ORIGIN_*``, aligned with
            labels): for split statistics only.
        versions: ``[B, L]`` long or None; the policy version that sampled each label (-1 on
            prompt, tool and padding positions, and where a trajectory recorded none).
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    loss_mask: Tensor
    advantages: Tensor
    old_logprobs: Tensor
    group_ids: Tensor
    entropy: Tensor | None = None
    ref_logprobs: Tensor | None = None
    token_weights: Tensor | None = None
    token_origin: Tensor | None = None
    versions: Tensor | None = None

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], advantages: Tensor | Sequence[float],
                          pad_token_id: int = 0) -> "TokenBatch":
        """Build the padded batch.

        Args:
            trajectories: rollout output; each needs ``len(response_ids) == len(loss_mask) ==
                len(logprobs)`` and a non-empty prompt.
            advantages: ``[B]`` per-trajectory advantages (same order).
            pad_token_id: id written into padding (never a label).
        Returns:
            A CPU ``TokenBatch``; ``group_ids`` are the trajectories' ``prompt_index``;
            ``token_origin`` from their kind and branch position, ``versions`` from theirs.
        """
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        if advantages.shape != (len(trajectories),):
            raise ValueError(f"advantages {tuple(advantages.shape)} != ({len(trajectories)},)")
        width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
        rows = [_encode(t, width, pad_token_id) for t in trajectories]
        ids, attn, labels, mask, old, origin, versions = (torch.stack(col) for col in zip(*rows))
        groups = torch.tensor([t.prompt_index for t in trajectories], dtype=torch.long)
        return cls(ids, attn, labels, mask, advantages, old, groups, token_origin=origin, versions=versions)

    # --- properties -----------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """``[B]`` number of real tokens per row."""
        return self.attention_mask.sum(-1)

    def to(self, device: torch.device | str) -> "TokenBatch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    # --- slicing --------------------------------------------------------------------------------

    def rows(self, index: Tensor | Sequence[int] | slice) -> "TokenBatch":
        """The rows ``index`` (a slice, list or long tensor), trimmed to their longest row."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        picked = self._map(lambda t: t[index])
        return picked.trim()

    def trim(self) -> "TokenBatch":
        """Drop trailing columns that are padding in every row."""
        width = max(int(self.lengths.max()) if self.num_rows else 0, 1)
        if width == self.input_ids.shape[1]:
            return self
        return self._map(lambda t: t[:, :width] if t.dim() == 2 else t)

    def masked_out(self) -> "TokenBatch":
        """A copy whose rows carry no loss (loss mask and advantages zero): padding for shards."""
        return dataclasses.replace(self, loss_mask=torch.zeros_like(self.loss_mask),
                                   advantages=torch.zeros_like(self.advantages))

    def _map(self, fn) -> "TokenBatch":
        return TokenBatch(**{f.name: None if getattr(self, f.name) is None else fn(getattr(self, f.name))
                             for f in dataclasses.fields(self)})

    # --- splitting ------------------------------------------------------------------------------

    def mini_batches(self, size: int, by: str = "prompts") -> list["TokenBatch"]:
        """Consecutive PPO mini-batches of ``size`` prompt groups (``by="prompts"``) or rows.

        Rows of one prompt must be consecutive when splitting by prompts (as rollouts emit them).
        """
        if by == "rows":
            return [self.rows(slice(i, i + size)) for i in range(0, self.num_rows, size)]
        groups = self.group_ids.tolist()
        starts = [0] + [i for i in range(1, self.num_rows) if groups[i] != groups[i - 1]]
        if len(starts) != len(set(groups)):
            raise ValueError("rows of one prompt must be consecutive to split by prompts "
                             "(a prompt's trajectories would land in two mini-batches)")
        cuts = starts[::size] + [self.num_rows]
        return [self.rows(slice(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]

    def shard(self, rank: int, world_size: int) -> "TokenBatch":
        """Rows ``rank, rank + W, ...``; every rank gets ``ceil(B / W)`` rows, the short ones
        padded with masked-out copies of row 0 (no loss, no gradient)."""
        per_rank = -(-self.num_rows // world_size)
        own = list(range(rank, self.num_rows, world_size))
        shard = self.rows(own) if own else None
        missing = per_rank - len(own)
        if missing == 0:
            return shard
        filler = self.rows([0] * missing).masked_out()
        return filler if shard is None else concat_rows([shard, filler])

    def micro_batches(self, size: int | None = None, max_tokens: int | None = None,
                      packed: bool = False) -> list["TokenBatch"]:
        """Split by row count (``size``) or greedily by a token budget (``max_tokens``: rows x
        longest row per micro-batch, or the sum of row lengths when the rows will be ``packed``
        without padding; a row longer than the budget goes alone)."""
        if (size is None) == (max_tokens is None):
            raise ValueError("give exactly one of size and max_tokens")
        if size is not None:
            return [self.rows(slice(i, i + size)) for i in range(0, self.num_rows, size)]
        lengths, groups, start, longest, total = self.lengths.tolist(), [], 0, 0, 0
        for i, n in enumerate(lengths):
            cost = total + n if packed else max(longest, n) * (i - start + 1)
            if i > start and cost > max_tokens:
                groups.append((start, i))
                start, longest, total = i, 0, 0
            longest, total = max(longest, n), total + n
        groups.append((start, self.num_rows))
        return [self.rows(slice(a, b)) for a, b in groups]


def concat_rows(batches: Sequence[TokenBatch]) -> TokenBatch:
    """Stack batches row-wise, right-padding the ``[B, L]`` tensors to the widest."""
    width = max(b.input_ids.shape[1] for b in batches)
    fill = {"labels": IGNORE_INDEX, "versions": -1}

    def cat(name: str):
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            return None
        if parts[0].dim() == 2:
            pad_value = fill.get(name, 0)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=pad_value) for p in parts]
        return torch.cat(parts)

    return TokenBatch(**{f.name: cat(f.name) for f in dataclasses.fields(TokenBatch)})


def _encode(traj: Trajectory, width: int, pad_token_id: int) -> tuple[Tensor, ...]:
    """One row: ``(input_ids, attention_mask, labels, loss_mask, old_logprobs, token_origin, versions)``, each
    ``[width]``."""
    n_prompt, n_resp = len(traj.prompt_ids), len(traj.response_ids)
    if n_prompt == 0 or not n_resp == len(traj.loss_mask) == len(traj.logprobs):
        raise ValueError(f"{traj.uid}: needs a prompt and aligned response/loss_mask/logprobs "
                         f"({n_prompt}, {n_resp}, {len(traj.loss_mask)}, {len(traj.logprobs)})")
    n = n_prompt + n_resp
    ids = torch.full((width,), pad_token_id, dtype=torch.long)
    ids[:n] = torch.tensor(traj.prompt_ids + traj.response_ids, dtype=torch.long)
    attn = torch.zeros(width, dtype=torch.long)
    attn[:n] = 1
    labels = torch.full((width,), IGNORE_INDEX, dtype=torch.long)
    labels[: n - 1] = ids[1:n]
    # position t predicts token t + 1: response token j sits at label position P - 1 + j
    resp = slice(n_prompt - 1, n - 1)
    loss_mask = torch.zeros(width)
    loss_mask[resp] = torch.tensor(traj.loss_mask, dtype=torch.float32)
    old = torch.zeros(width)
    old[resp] = torch.tensor(traj.logprobs, dtype=torch.float32) * loss_mask[resp]
    origin = torch.zeros(width, dtype=torch.long)
    if traj.kind == "branch":
        cut = traj.branch_position or 0
        origin[resp] = torch.tensor([ORIGIN_INHERITED] * cut + [ORIGIN_BRANCH] * (n_resp - cut), dtype=torch.long)
    else:
        origin[resp] = ORIGIN_GLOBAL
    versions = torch.full((width,), -1, dtype=torch.long)
    if traj.versions:
        if len(traj.versions) != n_resp:
            raise ValueError(f"{traj.uid}: {len(traj.versions)} versions for {n_resp} response tokens")
        versions[resp] = torch.tensor(traj.versions, dtype=torch.long)
    return ids, attn, labels, loss_mask, old, origin, versions
