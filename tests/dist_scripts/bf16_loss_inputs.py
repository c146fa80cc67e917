"""What the loss receives inside a bf16 FSDP2 forward: one on-policy update of a tiny model.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_scripts/bf16_loss_inputs.py MODEL_DIR OUT.pt [rows|trees]

Every rank records, per micro-batch, the :class:`LossInputs` the worker hands to the FSDP root
(what the batch holds) and the one the loss received inside the root's forward, and rank r saves
{"built", "received", "metrics", "counts"} to OUT.pt.rank<r>. ``counts``: the valid tokens of
each mini-batch, counted on the host (the exact global token count). ``trees``: the same with
``policy.tree_batches=on`` (the :class:`TreeLossInputs` reach the tree loss; the occurrences'
advantages and mask are recorded beside the per-node old log-probs).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the batch helper

from test_policy_worker import random_batch, vocab_of  # noqa: E402

from aepo_engine.training import policy  # noqa: E402
from aepo_engine.training.optim import OptimConfig  # noqa: E402

FIELDS = ("old_logprobs", "advantages", "loss_mask", "global_token_count", "entropy_mean", "entropy_std")


def _fields(inputs) -> dict:
    occ = getattr(inputs, "occurrences", None)  # a TreeLossInputs: per-occurrence advantages and mask
    return {name: getattr(occ if occ is not None and name in ("advantages", "loss_mask") else inputs,
                          name).detach().clone() for name in FIELDS}


def run(model_dir: str, out: str, layout: str = "rows") -> None:
    built, received = [], []

    call, loss, tree_forward = policy.PolicyModel.__call__, policy.PolicyModel._loss, policy.PolicyModel.tree_forward

    def recorded_call(self, *args, **kwargs):  # the worker's call: what the batch holds
        if len(args) == 2:  # (the layout's inputs, the loss inputs)
            built.append(_fields(args[1]))
        return call(self, *args, **kwargs)

    def recorded_loss(self, hidden, labels, inputs):  # inside the FSDP root's forward
        received.append(_fields(inputs))
        return loss(self, hidden, labels, inputs)

    def recorded_tree(self, tree, inputs):  # the tree path's loss, inside the root's forward
        if inputs is not None:
            received.append(_fields(inputs))
        return tree_forward(self, tree, inputs)

    policy.PolicyModel.__call__, policy.PolicyModel._loss = recorded_call, recorded_loss
    policy.PolicyModel.tree_forward = recorded_tree
    config = policy.PolicyConfig(param_dtype="bfloat16", fsdp="on", ppo_mini_batch_size=8, micro_batch_size=8,
                                 tree_batches="on" if layout == "trees" else "off")
    worker = policy.PolicyWorker(model_dir, config, OptimConfig(lr=1e-3), total_steps=10)
    # 8 prompts x 6 trajectories: > 256 valid tokens per mini-batch (bf16 holds integers to 256 exactly)
    batch = random_batch(vocab_of(model_dir), group_sizes=(6,) * 8, seed=3)
    logprobs, entropy = worker.compute_logprobs(batch)
    on_policy = dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy)
    counts = [int(mini.loss_mask.sum()) for mini in on_policy.mini_batches(8, by="prompts")]
    metrics = worker.update(on_policy)
    torch.save({"built": built, "received": received, "metrics": metrics, "counts": counts}, f"{out}.rank{worker.rank}")
    dist.barrier()


if __name__ == "__main__":
    from aepo_engine.distributed import run_and_exit

    run_and_exit(lambda: run(*sys.argv[1:4]))  # destroys the group and exits without finalization
