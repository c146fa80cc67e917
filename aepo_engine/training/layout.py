"""How a batch's tokens reach the model: rows or the rollout tree (the batch-layout seam).

The policy worker (:class:`aepo_engine.training.policy.PolicyWorker`) picks one layout when it is
built (``policy.trees``) and asks it everything that depends on the layout; it never branches on
rows vs tree itself:

- :meth:`prepare`: what the model needs to read the layout (the tree's attention mask);
- :meth:`shard`: this rank's part of a global :class:`TokenBatch` (strided rows, or whole prompt
  groups: a group's trie cannot be cut);
- :meth:`micro_batches`: that part cut into micro-batches (a filler part, :meth:`filler`, pads
  every rank to the same count: FSDP's collectives run per forward/backward);
- :meth:`values`: the no-grad ``(logprobs, entropy)`` ``[b, l]`` of a micro-batch;
- :meth:`loss`: the one-pass AEPO loss of a micro-batch (its gradient computed in the call);
- :meth:`gather`: the ranks' ``[2, b, L]`` values back into the global ``[2, B, L]``;
- :meth:`positions`: what a micro-batch costs the model (positions computed vs row positions);
  and before any batch exists, what the memory plans read (:mod:`aepo_engine.layout_plan`).

:class:`RowLayout` lays a micro-batch out as right-padded ``[b, l]`` rows (or, with
``pack_sequences``, their real tokens as one row: HF's padding-free format); :class:`TreeLayout`
as the tries of its prompt groups (:mod:`aepo_engine.training.tree`), each shared prefix computed once.
What the model's forward takes is the layout's inputs object (:class:`RowModelInputs`,
:class:`aepo_engine.training.tree.TreeInputs`): ``PolicyModel``'s forward hands it back to
the matching method, so the module FSDP wraps does not branch either.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from aepo_engine.layout_plan import RowLayoutPlan, TreeLayoutPlan
from aepo_engine.training import tree_attention
from aepo_engine.training.batch import TokenBatch
from aepo_engine.training.config import PolicyConfig
from aepo_engine.training.tree import TreeMicroBatch, logprob_keys, shard_groups, tree_micro_batches, update_keys
from aepo_kernels import Occurrences

__all__ = ["BatchLayout", "LossInputs", "RowLayout", "RowModelInputs", "TreeLayout", "TreeLossInputs", "batch_layout"]

Purpose = Literal["logprobs", "update"]  # what the micro-batches are for (a tree folds by different keys)


@dataclasses.dataclass
class LossInputs:
    """What the one-pass loss needs besides the model's hidden states: per-token ``[B, L]`` tensors
    and the global normalisers / statistics of the mini-batch (0-d tensors or None)."""

    old_logprobs: Tensor
    advantages: Tensor  # [B, L] (per-sequence advantages expanded)
    loss_mask: Tensor
    ref_logprobs: Tensor | None
    global_token_count: Tensor
    entropy_mean: Tensor | None = None
    entropy_std: Tensor | None = None
    stats_masks: dict[str, Tensor] | None = None  # name -> [B, L] mask of split statistics
    token_rows: bool = False  # also return per-token log-probs and entropies (return_token_loss)

    def packed(self, real: Tensor) -> "LossInputs":
        """The per-token fields at the real (non-padding) positions, as one ``[1, T]`` row."""
        pick = lambda t: None if t is None else t[real][None]  # noqa: E731
        masks = None if self.stats_masks is None else {k: pick(v) for k, v in self.stats_masks.items()}
        return dataclasses.replace(self, old_logprobs=pick(self.old_logprobs), advantages=pick(self.advantages),
                                   loss_mask=pick(self.loss_mask), ref_logprobs=pick(self.ref_logprobs),
                                   stats_masks=masks)


@dataclasses.dataclass
class TreeLossInputs:
    """What the tree loss needs besides the nodes' hidden states (:mod:`aepo_kernels.tree_loss`):
    per node ``[N]`` the old (and reference) log-probs, per occurrence (label position) where it
    reads and its advantage / mask / statistics masks, and the mini-batch's normaliser and
    statistics as for :class:`LossInputs`."""

    old_logprobs: Tensor  # [N]
    ref_logprobs: Tensor | None  # [N]
    occurrences: Occurrences  # [M] each
    global_token_count: Tensor
    entropy_mean: Tensor | None = None
    entropy_std: Tensor | None = None
    stats_masks: dict[str, Tensor] | None = None  # name -> [M]
    token_rows: bool = False  # also return per-occurrence log-probs and entropies


@dataclasses.dataclass
class RowModelInputs:
    """A micro-batch of rows as the model takes it: right-padded ``[b, l]`` tensors."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor

    def run(self, model: Any, loss_inputs: LossInputs | None):
        """``model``'s forward for rows (``training.policy.PolicyModel.rows_forward``)."""
        return model.rows_forward(self, loss_inputs)


class RowLayout(RowLayoutPlan):
    """Right-padded rows (module docstring).

    Args:
        micro_batch_size: rows per micro-batch (``policy.micro_batch_size``), or
        max_tokens: a token budget per micro-batch instead (``policy.micro_batch_max_tokens``).
        pack: the model sees a micro-batch's real tokens as one row (``pack_sequences``).
        rank, world_size: this rank and the ranks.
    """

    def __init__(self, micro_batch_size: int, max_tokens: int | None, pack: bool, rank: int, world_size: int):
        self.micro_batch_size, self.max_tokens, self.pack = micro_batch_size, max_tokens, pack
        self.rank, self.world_size = rank, world_size
        # strided shards cut by rows give every rank as many micro-batches; a token budget may not
        self.uneven = max_tokens is not None

    def prepare(self, model: nn.Module) -> None:
        """Nothing: the model's own attention reads rows."""

    def shard(self, batch: TokenBatch) -> TokenBatch:
        return batch.shard(self.rank, self.world_size)

    def micro_batches(self, local: TokenBatch, purpose: Purpose) -> list[TokenBatch]:
        if self.max_tokens is None:
            return local.micro_batches(size=self.micro_batch_size)
        return local.micro_batches(max_tokens=self.max_tokens, packed=self.pack)

    def filler(self, local: TokenBatch, purpose: Purpose) -> TokenBatch:
        """A micro-batch that changes nothing (every token masked out)."""
        return local.rows([0]).masked_out()

    def rows(self, micro: TokenBatch) -> TokenBatch:
        """The micro-batch's rows (per-token fields ``[b, l]``)."""
        return micro

    def values(self, model: nn.Module, micro: TokenBatch) -> tuple[Tensor, Tensor]:
        return model(RowModelInputs(micro.input_ids, micro.attention_mask, micro.labels))  # [b, l] x2

    def loss(self, model: nn.Module, micro: TokenBatch, advantages: Tensor, masks: dict[str, Tensor] | None,
             count: Tensor, stats: dict[str, Tensor], token_rows: bool):
        inputs = LossInputs(micro.old_logprobs, advantages, micro.loss_mask, micro.ref_logprobs, count, **stats,
                            stats_masks=masks, token_rows=token_rows)
        loss, out = model(RowModelInputs(micro.input_ids, micro.attention_mask, micro.labels), inputs)
        if not token_rows:
            return loss, out, None
        logp, entropy = out["token_logprobs"], out["token_entropy"]
        if self.pack:  # the loss saw the real tokens as one [1, T] row
            real = micro.attention_mask.bool()
            logp, entropy = (t.new_zeros(real.shape).masked_scatter(real, t[0]) for t in (logp, entropy))
        return loss, out, (logp, entropy)

    def gather(self, local: Tensor, batch: TokenBatch) -> Tensor:
        """Undo :meth:`TokenBatch.shard` (strided rows): ``[2, b, L]`` per rank -> ``[2, B, L]``."""
        if self.world_size == 1:
            return local[:, :batch.num_rows]
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local.contiguous())
        stacked = torch.stack(gathered, dim=2)  # [2, b, W, L]: row j of rank r is global j * W + r
        return stacked.flatten(1, 2)[:, :batch.num_rows]

    def positions(self, micro: TokenBatch) -> tuple[int, int]:
        real = int(micro.lengths.sum())
        return (real if self.pack else micro.input_ids.numel()), real


class TreeLayout(TreeLayoutPlan):
    """The tries of the prompt groups (module docstring; :mod:`aepo_engine.training.tree`).

    Args:
        micro_batch_size: prompt groups per micro-batch, or
        max_nodes: a node budget per micro-batch instead (``policy.micro_batch_max_tokens``).
        rank, world_size: this rank and the ranks.
    """

    def __init__(self, micro_batch_size: int, max_nodes: int | None, rank: int, world_size: int):
        self.micro_batch_size, self.max_nodes = micro_batch_size, max_nodes
        self.rank, self.world_size = rank, world_size
        self.uneven = True  # whole groups per rank: their forests differ in size

    @staticmethod
    def _keys(purpose: Purpose):
        return update_keys if purpose == "update" else logprob_keys

    def prepare(self, model: nn.Module) -> None:
        """The HF model attends through the tree mask (:mod:`aepo_engine.training.tree_attention`)."""
        model.set_attn_implementation(tree_attention.register())

    def shard(self, batch: TokenBatch) -> TokenBatch:
        return shard_groups(batch, self.rank, self.world_size)[0]

    def micro_batches(self, local: TokenBatch, purpose: Purpose) -> list[TreeMicroBatch]:
        return tree_micro_batches(local, self._keys(purpose), self.max_nodes,
                                  self.micro_batch_size if self.max_nodes is None else None)

    def filler(self, local: TokenBatch, purpose: Purpose) -> TreeMicroBatch:
        return TreeMicroBatch.build(local.rows([0]).masked_out(), self._keys(purpose))

    def rows(self, micro: TreeMicroBatch) -> TokenBatch:
        return micro.rows

    def values(self, model: nn.Module, micro: TreeMicroBatch) -> tuple[Tensor, Tensor]:
        """The nodes' values at every label position that reads them, ``[b, l]``."""
        logprobs, entropy = model(micro.model_inputs())  # [N] x2
        return micro.to_rows(logprobs), micro.to_rows(entropy)

    def loss(self, model: nn.Module, micro: TreeMicroBatch, advantages: Tensor, masks: dict[str, Tensor] | None,
             count: Tensor, stats: dict[str, Tensor], token_rows: bool):
        rows, occurs = micro.rows, micro.occurrence  # occurs: [b, l] label positions
        occurrences = Occurrences(micro.forest.label_node[occurs], advantages[occurs], rows.loss_mask[occurs])
        ref = None if rows.ref_logprobs is None else micro.node_values(rows.ref_logprobs)
        inputs = TreeLossInputs(micro.node_values(rows.old_logprobs), ref, occurrences, count, **stats,
                                stats_masks=None if masks is None else {k: m[occurs] for k, m in masks.items()},
                                token_rows=token_rows)
        loss, out = model(micro.model_inputs(), inputs)
        if not token_rows:
            return loss, out, None
        scatter = lambda t: t.new_zeros(occurs.shape).masked_scatter(occurs, t)  # noqa: E731  [M] -> [b, l]
        return loss, out, (scatter(out["token_logprobs"]), scatter(out["token_entropy"]))

    def gather(self, local: Tensor, batch: TokenBatch) -> Tensor:
        """Undo :func:`shard_groups`: ``[2, b_r, L]`` per rank -> ``[2, B, L]`` (every rank knows
        every rank's rows: the split depends on the global batch only)."""
        if self.world_size == 1:
            return local
        index = [shard_groups(batch, r, self.world_size)[1] for r in range(self.world_size)]
        most = max(len(i) for i in index)
        padded = nn.functional.pad(local, (0, 0, 0, most - local.shape[1]))
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded.contiguous())
        out = local.new_zeros(2, batch.num_rows, local.shape[2])
        for rows, part in zip(index, gathered):
            if rows != [-1]:
                out[:, rows] = part[:, : len(rows)]
        return out

    def positions(self, micro: TreeMicroBatch) -> tuple[int, int]:
        return micro.forest.num_nodes, int(micro.rows.lengths.sum())


BatchLayout = RowLayout | TreeLayout


def batch_layout(config: PolicyConfig, rank: int, world_size: int) -> BatchLayout:
    """The layout the policy section asks for (``trees``; ``micro_batch_size``,
    ``micro_batch_max_tokens``, ``pack_sequences`` resolved) on ``rank`` of ``world_size``."""
    if config.trees:
        return TreeLayout(config.micro_batch_size, config.micro_batch_max_tokens, rank, world_size)
    return RowLayout(config.micro_batch_size, config.micro_batch_max_tokens, config.packs, rank, world_size)
