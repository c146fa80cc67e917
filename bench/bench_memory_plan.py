"""The memory plan's terms (``--dry-run --gpu``) against one measured training step on CPU.

    python bench/bench_memory_plan.py [--models tiny 05b] [--worlds 1 2] [--tokens-tiny 2048] [--tokens-05b 512]

Per model, world size and activation checkpointing (on and off), ``tests/dist_scripts/memory_measure.py``
runs under torchrun (gloo, FSDP2 on, bf16 compute, the sharded load, two micro-batches per rank,
two updates) and measures malloc's in-use bytes per rank; each row holds the planned and the
measured bytes of every term it measures (``memory_measure.compare``) and their ratio.
Models: ``tiny``, the embedded default's Qwen3 (~0.9M parameters, tied); ``05b``, the ~0.53B
Qwen3 of ``bench_sharded_load.py``. Rows go to ``bench/results/memory_plan.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "dist_scripts"))
from harness import RESULTS_DIR, machine  # noqa: E402
from memory_measure import compare  # noqa: E402

SCRIPT = REPO / "tests" / "dist_scripts" / "memory_measure.py"


def measure(model_dir: str, world: int, tokens: int, checkpointing: bool, work: Path) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = work / f"m_{world}_{int(checkpointing)}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world}",
               "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT), model_dir, str(out), str(tokens)]
    command += ["--checkpointing"] if checkpointing else []
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "05b"], choices=["tiny", "05b"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens-tiny", type=int, default=2048)
    parser.add_argument("--tokens-05b", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "memory_plan.jsonl")
    args = parser.parse_args()
    import msgspec

    from aepo_engine.config import TrainConfig
    from aepo_engine.memory_plan import ModelShape, plan_memory
    from aepo_engine.models import build_tiny_qwen3
    from bench_sharded_load import build_model

    info, rows = machine(), []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in args.models:
            model_dir = (build_tiny_qwen3(work / "tiny") if model == "tiny"
                         else str(build_model(Path("/tmp/aepo_bench_qwen3_05b"))))
            tokens = args.tokens_tiny if model == "tiny" else args.tokens_05b
            for world in args.worlds:
                for checkpointing in (False, True):
                    base = TrainConfig()
                    cfg = msgspec.structs.replace(base, policy=msgspec.structs.replace(
                        base.policy, fsdp="on", param_dtype="bfloat16", activation_checkpointing=checkpointing,
                        micro_batch_max_tokens=tokens))
                    plan = plan_memory(cfg, ModelShape.from_dir(model_dir), world, cuda=False)
                    for row in measure(model_dir, world, tokens, checkpointing, work):
                        for term, (planned, measured) in compare(plan, row).items():
                            rows.append({**info, "model": model, "world": world, "rank": row["rank"],
                                         "tokens": tokens, "checkpointing": checkpointing, "term": term,
                                         "planned": planned, "measured": measured,
                                         "ratio": planned / measured if measured else None})
    with args.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{'model':5} {'W':>2} {'ckpt':>4} {'term':18} {'planned MiB':>12} {'measured MiB':>13} {'ratio':>6}")
    for r in rows:
        if r["rank"] == 0:
            ratio = f"{r['ratio']:6.3f}" if r["ratio"] else "     -"
            print(f"{r['model']:5} {r['world']:>2} {str(r['checkpointing'])[0]:>4} {r['term']:18} "
                  f"{r['planned'] / 2**20:12.1f} {r['measured'] / 2**20:13.1f} {ratio}")


if __name__ == "__main__":
    main()
