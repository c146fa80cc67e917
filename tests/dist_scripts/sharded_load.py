"""Under torchrun (or plain): the sharded load against today's whole load, and the head's matmul
dtypes in one bf16 FSDP2 training step.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_scripts/sharded_load.py OUT.json MODEL_DIR...

Rank 0 writes, per model directory, {"identical": [...], "different": [...], "buffers_equal": bool,
"fp32_head_matmuls": [...], "head_matmuls": n, "world_size": W} to OUT.json.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the helpers

from matmul_dtypes import MatmulDtypes  # noqa: E402
from test_policy_worker import random_batch, vocab_of  # noqa: E402

from aepo_engine.training import PolicyConfig, PolicyWorker  # noqa: E402
from aepo_engine.training.loading import load_hf_model  # noqa: E402
from aepo_engine.training.optim import OptimConfig  # noqa: E402


def check(model_dir: str) -> dict:
    optim = OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0, grad_clip=0.0)
    worker = PolicyWorker(model_dir, PolicyConfig(param_dtype="float32", fsdp="on"), optim, total_steps=4)
    assert worker.use_fsdp and worker.config.sharded_load
    full = worker.full_state_dict(rank0_only=False)
    whole = load_hf_model(model_dir, "sdpa")  # today's load: the whole fp32 model
    want = whole.state_dict()
    identical = sorted(k for k in want if torch.equal(full[k], want[k]))
    different = sorted(k for k in want if k not in identical)
    buffers_equal = all(torch.equal(a, b) for (_, a), (_, b) in zip(worker.model.named_buffers(), whole.named_buffers()))
    del worker, whole

    vocab = vocab_of(model_dir)
    bf16 = PolicyWorker(model_dir, PolicyConfig(param_dtype="bfloat16", fsdp="on"), optim, total_steps=4)
    batch = random_batch(vocab, seed=3)
    logprobs, entropy = bf16.compute_logprobs(batch)
    with MatmulDtypes() as recorder:
        bf16.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    return {"identical": identical, "different": different, "buffers_equal": buffers_equal,
            "fp32_head_matmuls": [str(r) for r in recorder.fp32_with_dim(vocab)],
            "head_matmuls": len(recorder.with_dim(vocab)), "world_size": bf16.world_size, "rank": bf16.rank}


def main() -> None:
    results = {model_dir: check(model_dir) for model_dir in sys.argv[2:]}
    if next(iter(results.values()))["rank"] == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    from aepo_engine.distributed import run_and_exit

    run_and_exit(main)
