"""One AEPO update of a tiny model on a fixed global batch; run plain (1 process) or under torchrun.

    python tests/dist_scripts/policy_update.py MODEL_DIR OUT.pt
    python -m torch.distributed.run --nproc_per_node 2 tests/dist_scripts/policy_update.py MODEL_DIR OUT.pt \
        --max-tokens 30 --activation-checkpointing [--fsdp off]

Rank 0 saves {"logprobs", "entropy", "metrics", "state", "fsdp", "world_size", "tree_masks",
"mask_plans"} (tree masks made by the worker, plans of their attention) to OUT.pt, and a
CheckpointManager checkpoint (sharded train state + HF export) goes to OUT.pt_ckpt. Batch:
5 prompts with 2, 3, 1, 2, 3 trajectories, mini-batches of 2 prompts (5, 3, 3 rows: odd, so
ranks get masked-out filler rows); with ``--max-tokens`` the micro-batches are cut by a token
budget, so ranks run different numbers of real micro-batches (padded to the same count).
``--lora``: LoRA adapters (policy.lora, rank 4) on every projection: only they train and stream.
``--tree-batches on``: the rollout-tree layout (policy.tree_batches) on the hand-made tries of
tests/test_tree_batches.py (ranks get whole groups; 4 groups, mini-batches of 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the batch helper

from test_policy_worker import random_batch, vocab_of  # noqa: E402

from aepo_engine.checkpoint import CheckpointManager  # noqa: E402
from aepo_engine.training.optim import OptimConfig  # noqa: E402
from aepo_engine.training import PolicyConfig, PolicyWorker  # noqa: E402

OPTIM = OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0, grad_clip=0.0)  # SGD-like first steps


class GatherRecorder(TorchDispatchMode):
    """Records the dtypes of the all-gathers (FSDP2's ``full_tensor``) run inside it."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_gather" in str(func):
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def run(model_dir: str, out: str, max_tokens: int | None = None, fsdp: str = "auto",
        activation_checkpointing: bool = False, tree_batches: str = "off", hand_made: bool = False,
        lora: bool = False) -> None:
    """Build the worker, compute log-probs, update once, save the results on rank 0."""
    from aepo_engine.models.config import LoraConfig
    from aepo_engine.models.lora import is_adapter

    config = PolicyConfig(param_dtype="float32", ppo_mini_batch_size=2, micro_batch_size=2,
                          micro_batch_max_tokens=max_tokens, fsdp=fsdp,
                          activation_checkpointing=activation_checkpointing, tree_batches=tree_batches,
                          lora=LoraConfig(enabled=lora, rank=4, alpha=8.0))
    worker = PolicyWorker(model_dir, config, OPTIM, total_steps=10)
    if hand_made or tree_batches == "on":
        from test_tree_batches import hand_made_batch

        batch = hand_made_batch(seed=1)
    else:
        batch = random_batch(vocab_of(model_dir), group_sizes=(2, 3, 1, 2, 3), seed=1)
    # the tree masks the worker makes (one per micro-batch and pass) and the plans of their
    # attention (CPU: the SDPA buckets) that the layers make
    from aepo_engine.training.tree import TreeMicroBatch
    from aepo_engine.training.tree_attention import TreeMask

    counts, plan, inputs = {"masks": 0, "plans": 0}, TreeMask._plan_buckets, TreeMicroBatch.model_inputs

    def counted(name, fn):
        def wrapper(self):
            counts[name] += 1
            return fn(self)
        return wrapper

    TreeMask._plan_buckets, TreeMicroBatch.model_inputs = counted("plans", plan), counted("masks", inputs)
    logprobs, entropy = worker.compute_logprobs(batch)
    metrics = worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    if lora:  # a second step: the first moves B only (A's gradient is s B^T G, 0 while B = 0)
        metrics = worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    TreeMask._plan_buckets, TreeMicroBatch.model_inputs = plan, inputs
    state = worker.full_state_dict()
    everywhere = worker.full_state_dict(rank0_only=False)  # the whole model on every rank
    assert everywhere and (worker.rank != 0 or all(torch.equal(v, state[k]) for k, v in everywhere.items()))
    assert worker.rank == 0 or not state  # rank0_only: the others get {}
    # what a rollout engine receives: the same tensors streamed in buckets (~2 KB: many of them)
    streamed, sizes = {}, []
    for bucket in worker.iter_weight_buckets(2048):
        sizes.append(sum(t.numel() * t.element_size() for t in {id(t): t for t in bucket.values()}.values()))
        streamed.update(bucket)
    pushed = {k: v for k, v in everywhere.items() if is_adapter(k) or not lora}  # LoRA: the adapters only
    assert set(streamed) == set(pushed) and len(sizes) > 3
    assert all(torch.equal(streamed[k].cpu(), v) for k, v in pushed.items())
    largest = max(t.numel() * t.element_size() for t in pushed.values())
    assert all(size < 2048 + largest for size in sizes)  # a bucket closes once it reaches the bound
    # in a bf16 engine's dtype: every shard is cast before its all-gather (half the bytes)
    with GatherRecorder() as gathers:
        streamed_bf16 = {k: v for bucket in worker.iter_weight_buckets(2048, dtype=torch.bfloat16)
                         for k, v in bucket.items()}
    assert all(torch.equal(streamed_bf16[k].cpu(), v.to(torch.bfloat16)) for k, v in pushed.items())
    assert gathers.dtypes == ({torch.bfloat16} if worker.use_fsdp else set())
    CheckpointManager(out + "_ckpt").save(1, worker.model, optimizer=worker.optimizer, scheduler=worker.scheduler)
    if worker.rank == 0:
        torch.save({"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "state": state,
                    "fsdp": worker.use_fsdp, "world_size": worker.world_size,
                    "tree_masks": counts["masks"], "mask_plans": counts["plans"]}, out)
    if dist.is_initialized():
        dist.barrier()  # run_and_exit destroys the group


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--fsdp", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--tree-batches", default="off", choices=["on", "off"])
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    from aepo_engine.distributed import run_and_exit

    run_and_exit(lambda: run(args.model_dir, args.out, args.max_tokens, args.fsdp, args.activation_checkpointing, args.tree_batches,
        lora=args.lora))
