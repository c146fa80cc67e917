"""Measured host memory of one rank through load, log-probs, forward+backward and the optimizer
step, to hold the memory plan's terms against (``aepo_engine.memory_plan``).

    python -m torch.distributed.run --nproc_per_node W \\
        tests/dist_scripts/memory_measure.py MODEL_DIR OUT.json TOKENS [--checkpointing]

FSDP2 on (one rank is sharded too), bf16 compute, the sharded load; one mini-batch of rows of
equal length (no padding: the attention runs its fused kernel, as flash-attention does on GPU)
that is exactly two micro-batches of TOKENS tokens per rank (the second accumulates into the first's
gradients, as any step with gradient accumulation does), updated twice (the first update creates
AdamW's states). Memory is malloc's in-use bytes (:class:`HeapMeter`), current and peak, at each
point. Every rank writes its row to OUT.json.rank<R>.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapMeter:
    """Bytes allocated by malloc now (glibc ``mallinfo2``: in-use arena bytes + mmapped chunks; torch's
    CPU tensors are malloc'd), and their peak, sampled every ~0.2 ms by a thread between ``start``
    and ``stop``. Unlike the resident set it does not count code pages or freed memory the
    allocator keeps."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _MallInfo2
        self.running = False

    def now(self) -> int:
        info = self.libc.mallinfo2()
        return info.hblkhd + info.uordblks

    def start(self) -> int:
        self.base = self.peak = self.now()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self.base

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.0002)

    def stop(self) -> int:
        """The peak above the level at ``start``."""
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.now())
        return self.peak - self.base


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("tokens", type=int)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--updates", type=int, default=2, help="updates measured (the first creates AdamW's states)")
    args = parser.parse_args()

    from aepo_engine.distributed import init_distributed
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import PolicyConfig, PolicyWorker, TokenBatch
    from aepo_engine.training.optim import OptimConfig

    torch.set_num_threads(1)
    rank, world, _ = init_distributed()
    rows, row_len = 8 * world, args.tokens // 4  # two micro-batches of TOKENS tokens per rank
    config = PolicyConfig(fsdp="on", param_dtype="bfloat16", activation_checkpointing=args.checkpointing,
                          ppo_mini_batch_size=rows, mini_batch_unit="rows", micro_batch_max_tokens=args.tokens)
    out: dict = {"rank": rank, "world": world, "tokens": args.tokens, "checkpointing": args.checkpointing}
    meter = HeapMeter()
    import aepo_engine.training.policy as policy_module

    load = policy_module.load_sharded_weights

    def measured_load(*a, **k):  # the shards themselves, and the transient above them while reading
        meter.start()
        load(*a, **k)
        out["load_peak"] = meter.stop()
        out["params"] = meter.now() - meter.base

    policy_module.load_sharded_weights = measured_load
    worker = PolicyWorker(args.model_dir, config, OptimConfig(lr=1e-6, weight_decay=0.0), total_steps=2)
    vocab = worker.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(rows):
        ids = torch.randint(3, vocab, (row_len,), generator=gen).tolist()
        traj = Trajectory(prompt_ids=ids[:8], prompt_index=i, traj_id=0, step=0, kind="global")
        traj.append_model_segment(ids[8:], [-1.0] * (row_len - 8), [0.0] * (row_len - 8), 5)
        trajs.append(traj)
    batch = TokenBatch.from_trajectories(trajs, torch.randn(rows, generator=gen))
    meter.start()
    logprobs, entropy = worker.compute_logprobs(batch)
    out["logprob_pass_peak"] = meter.stop()
    finish = worker._finish_step
    points: dict = {}

    def measured_finish(finite: bool):
        # after forward + backward, before the optimizer step (which creates AdamW's states)
        points["backward_peak"] = meter.stop()
        points["grads"] = meter.now() - meter.base
        meter.start()
        result = finish(finite)  # step, then zero_grad(set_to_none): the gradients are freed
        points["step_peak"] = meter.stop()
        points["after_step"] = meter.now() - meter.base
        return result

    worker._finish_step = measured_finish
    forward = worker.policy.forward

    def measured_forward(*a, **k):  # the peak up to the end of the last forward (the head's included)
        result = forward(*a, **k)
        if len(a) + len(k) > 1:  # (the layout's inputs, the loss inputs): the loss forward, not a log-prob pass
            points["forward_peak"] = max(meter.peak, meter.now()) - meter.base
        return result

    worker.policy.forward = measured_forward
    fused = policy_module.fused_linear_aepo_policy_loss

    def measured_head(*a, **k):  # the head's own peak: logits block, fp32 d_W accumulator, d_hidden
        before = meter.now()
        peak_before, meter.peak = meter.peak, before
        result = fused(*a, **k)
        points["head_peak"] = max(points.get("head_peak", 0), max(meter.peak, meter.now()) - before)
        meter.peak = max(peak_before, meter.peak)
        return result

    policy_module.fused_linear_aepo_policy_loss = measured_head
    for update in range(args.updates):  # from the second on: AdamW's states exist, steady allocator state
        points.clear()
        meter.start()
        worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
        out.update({f"{key}_{update}": value for key, value in points.items()})
    out["micro_batches"] = len(batch.rows(list(range(rows))).shard(rank, world).micro_batches(
        max_tokens=args.tokens, packed=False))
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))


if __name__ == "__main__":
    from aepo_engine.distributed import run_and_exit

    run_and_exit(lambda: sys.exit(main()))


# --- the plan's terms against a measured row ---------------------------------------------------------

def compare(plan, row: dict) -> dict[str, tuple[int, int]]:
    """``{term: (planned bytes, measured bytes)}`` for what one rank's row measures: the state terms,
    the head, the load's read buffer and the update's peak (measured from the update's start, where
    the parameters and AdamW's states already exist; the second update, in a steady state)."""
    terms = {name: term.bytes for name, term in plan.terms.items()}
    before = terms["params"] + terms["adam"]
    update = max(plan.phase_bytes(phase) for phase in plan.phases if phase.startswith("update")) - before
    return {
        "params": (terms["params"], row["params"]),
        "grads": (terms["grads"], row["grads_1"]),
        "adam": (terms["adam"], row["after_step_0"] + row["grads_1"]),  # the step frees the grads
        # The lowest of the steady updates: the meter is process-wide, and once in a few runs under
        # load (rank 0, one update in six) another thread's ~8 MiB transient fell into the head's
        # window (15.3 MiB measured against 3.8 in the other updates).
        "head": (terms["head"], min(v for k, v in row.items() if k.startswith("head_peak_") and k != "head_peak_0")),
        "load read buffer": (plan.load_read_bytes, row["load_peak"] - row["params"]),
        "update peak": (update, max(row["forward_peak_1"], row["backward_peak_1"])),
    }
