"""Peak host memory per rank from process start to the first optimizer step: the sharded load
(``policy.sharded_load = true``: meta model, FSDP2 shards read from safetensors) against the
whole-model load (``false``: ``from_pretrained`` in fp32 on every rank, then sharding).

    python bench/bench_sharded_load.py [--model-dir DIR] [--worlds 1 2] [--out bench/results/sharded_load.jsonl]

The model is a Qwen3-architecture model of ~0.53B parameters (Qwen3-0.6B's shapes with 24 layers:
hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072, vocabulary 151,936, tied embeddings), built
locally with a seeded random init and saved as bf16 safetensors in 300 MB files (no download);
``--model-dir`` reuses one. Each (load, world size) runs under torchrun with gloo, FSDP2 on
(``fsdp = "on"``, so one rank is sharded too), ``param_dtype = bfloat16``. Per rank:
- ``baseline``: RSS after the imports and the process group (before the model);
- ``load_peak``: the peak RSS (``VmHWM``) until the worker is built (model, shards, optimizer);
- ``step_peak``: the peak RSS through one update (one optimizer step: gradients and AdamW states
  appear) on 4 short rows;
- the target of issue 25: fp32 model bytes / world + largest tensor (fp32) + baseline, + 10%.
Children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the resident set
(glibc's dynamic threshold would keep some in its heap) and RSS follows live memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULTS_DIR, machine  # noqa: E402

MARK = "SHARDED_LOAD_ROW "
QWEN3_05B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def build_model(out: Path, layers: int | None = None) -> Path:
    """The ~0.53B Qwen3 above, bf16 safetensors in 300 MB files (a tokenizer is not needed).
    ``layers`` keeps its widths (the 151,936 x 1,024 tied embedding, the largest tensor) with fewer
    of its 24 layers: the test suite's memory-plan measurement uses 4 (~0.22B)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    shape = QWEN3_05B if layers is None else {**QWEN3_05B, "num_hidden_layers": layers}
    config = Qwen3Config(**shape, initializer_range=0.02, dtype="bfloat16")
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="300MB")
    return out


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def rank_main(model_dir: str, sharded: bool) -> None:
    """Runs inside torchrun: measure one rank, print one JSON row."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from aepo_engine.distributed import init_distributed
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import PolicyConfig, PolicyWorker, TokenBatch
    from aepo_engine.training.optim import OptimConfig

    init_distributed()
    baseline = _status("VmRSS")
    start = time.perf_counter()
    worker = PolicyWorker(model_dir, PolicyConfig(fsdp="on", sharded_load=sharded, param_dtype="bfloat16",
                                                  micro_batch_size=2, ppo_mini_batch_size=4),
                          OptimConfig(lr=1e-6), total_steps=1)
    load_s = time.perf_counter() - start
    load_peak = _status("VmHWM")
    trajs = []
    for i in range(4):
        traj = Trajectory(prompt_ids=list(range(100 + i, 116 + i)), prompt_index=i, traj_id=0, step=0, kind="global")
        traj.append_model_segment(list(range(200 + i, 232 + i)), [-1.0] * 32, [0.0] * 32, 5)
        trajs.append(traj)
    batch = TokenBatch.from_trajectories(trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    logprobs, entropy = worker.compute_logprobs(batch)
    worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    step_peak = _status("VmHWM")
    numel = {id(p): p.numel() for p in worker.model.parameters()}
    largest = max(p.numel() for p in worker.model.parameters())
    row = dict(rank=worker.rank, world=worker.world_size, sharded_load=sharded, baseline=baseline,
               load_peak=load_peak, step_peak=step_peak, load_s=round(load_s, 2),
               params=sum(numel.values()), largest_tensor=largest)
    print(MARK + json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_case(model_dir: Path, sharded: bool, world: int) -> list[dict]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "AEPO_TORCH_COMPILE": "0",
           "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world}",
               "--master-addr=127.0.0.1", f"--master-port={port}", __file__, "--rank-run", str(model_dir),
               "--sharded" if sharded else "--whole"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(rows) != world:
        raise RuntimeError(f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/aepo_bench_qwen3_05b"))
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "sharded_load.jsonl")
    parser.add_argument("--rank-run", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sharded", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        rank_main(args.rank_run, args.sharded)
        return
    model_dir = build_model(args.model_dir)
    info = machine()
    rows = []
    for world in args.worlds:
        for sharded in (False, True):
            for row in run_case(model_dir, sharded, world):
                fp32 = row["params"] * 4
                row["target"] = int(1.1 * (fp32 / world + row["largest_tensor"] * 4 + row["baseline"]))
                row.update(info, model="qwen3-0.53b-bf16-safetensors")
                rows.append(row)
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    gib = 2**30
    print(f"{'load':8} {'W':>2} {'rank':>4} {'baseline':>9} {'load peak':>10} {'step peak':>10} {'target':>8} "
          f"{'load s':>7}  (GiB)")
    for r in rows:
        verdict = "PASS" if r["load_peak"] <= r["target"] else "FAIL"
        print(f"{'sharded' if r['sharded_load'] else 'whole':8} {r['world']:>2} {r['rank']:>4} "
              f"{r['baseline'] / gib:9.2f} {r['load_peak'] / gib:10.2f} {r['step_peak'] / gib:10.2f} "
              f"{r['target'] / gib:8.2f} {r['load_s']:7.1f}  {verdict}")


if __name__ == "__main__":
    main()
