"""HF backend decode: the cache that grows in place (``hf._GrowingLayer``) vs HF's DynamicCache.

Transformers' ``DynamicLayer.update`` concatenates the whole cache with each decode step's keys
and values, so one step reads and writes every cached byte:
    bytes moved per step = 2 (read + write) x rows x layers x 2 (K, V) x kv_heads x head_dim
                           x context x bytes per element
which grows with the context (O(T^2) per sequence). The backend's layer writes each step's slots
in place into a buffer with spare room (grown by half when full): O(1) bytes per step plus
amortised copies. Everything else is the same code path.

Cases, per context length (same requests, same seeds; the sampled tokens must be identical):
    prefill   max_new_tokens = 1: the prefill and one sampling step (the part both share)
    concat    ``HFBackend.generate`` with a plain DynamicCache (what the backend used before;
              the benchmark swaps the backend's private ``_new_cache`` for it)
    in_place  ``HFBackend.generate`` as shipped
``decode_s`` = total - the prefill case's median. Cases run in turn, ``--rounds`` times, each
``harness.measure``d (time median of the repeats and peak RSS above the start); rows go to
``bench/results/hf_decode.jsonl``.

    python bench/bench_hf_decode.py                        # tiny Qwen3 built here, 32 rows
    python bench/bench_hf_decode.py --model DIR --contexts 512 2048 --rows 16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import measure, print_table, write_rows  # noqa: E402

CASES = ("prefill", "concat", "in_place")


def concat_bytes_per_step(config: Any, rows: int, context: int, element_bytes: int = 4) -> int:
    """Bytes one DynamicCache step moves (read + write of every cached key/value), the formula
    in the module docstring."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * rows * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * context * element_bytes


def run(model_dir: str, contexts: list[int], rows: int, new_tokens: int, warmup: int, repeats: int,
        rounds: int) -> list[dict[str, Any]]:
    from transformers import DynamicCache

    from aepo_engine.rollout.backends.hf import HFBackend
    from aepo_engine.rollout.protocol import GenRequest

    backend = HFBackend(model_dir, max_batch_size=rows, prefix_cache_gib=0)
    in_place = backend._new_cache
    config = backend.model.config
    out = []
    for context in contexts:
        requests = [GenRequest((5 + r % 7,) * context, new_tokens, seed=r) for r in range(rows)]
        tokens: dict[str, list[list[int]]] = {}
        by_case: dict[str, list[dict[str, Any]]] = {}
        for round_index in range(rounds):
            for case in CASES:
                backend._new_cache = (lambda spare: DynamicCache(config=config)) if case == "concat" else in_place
                reqs = [GenRequest(r.prompt_ids, 1, seed=r.seed) for r in requests] if case == "prefill" else requests

                def body(_, reqs=reqs, case=case):
                    tokens[case] = [o.token_ids for o in backend.generate(reqs)]

                row = measure(lambda: None, body, warmup=warmup, repeats=repeats)
                row.update(case=case, context=context, rows=rows, new_tokens=1 if case == "prefill" else new_tokens,
                           round=round_index)
                by_case.setdefault(case, []).append(row)
        backend._new_cache = in_place
        same = tokens["concat"] == tokens["in_place"]
        steps = max(len(t) for t in tokens["in_place"])
        prefill = statistics.median(r["total_s"] for r in by_case["prefill"])
        for case, case_rows in by_case.items():
            for row in case_rows:
                row.update(same_tokens_as_concat=same, decode_steps=steps if case != "prefill" else 1,
                           concat_bytes_last_step=concat_bytes_per_step(config, rows, context + steps),
                           decode_s=None if case == "prefill" else row["total_s"] - prefill,
                           model=model_dir)
                out.append(row)
        if not same:
            raise SystemExit(f"context {context}: the in-place cache sampled other tokens than DynamicCache")
    return out


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (context, case), with the in-place speed-up of the decode part."""
    keyed: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        keyed.setdefault((row["context"], row["case"]), []).append(row)
    out = []
    for (context, case), group in sorted(keyed.items()):
        entry = {"context": context, "case": case, "total_s": statistics.median(r["total_s"] for r in group),
                 "peak_bytes": max(r["peak_bytes"] for r in group)}
        if case != "prefill":
            entry["decode_s"] = statistics.median(r["decode_s"] for r in group)
        out.append(entry)
    for entry in out:
        concat = next((e for e in out if e["context"] == entry["context"] and e["case"] == "concat"), None)
        if entry["case"] == "in_place" and concat:
            entry["decode_speedup"] = concat["decode_s"] / entry["decode_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF model folder (default: a tiny Qwen3 built here)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[150, 1000, 3000])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_hf_decode_") as tmp:
        model_dir = args.model
        if model_dir is None:
            from aepo_engine.models import build_tiny_qwen3

            model_dir = build_tiny_qwen3(Path(tmp) / "model", seed=0)
        rows = run(model_dir, args.contexts, args.rows, args.new_tokens, args.warmup, args.repeats, args.rounds)
    for row in rows:
        row["threads"] = args.threads
        if args.model is None:
            row["model"] = "tiny-qwen3 (build_tiny_qwen3 defaults, random init)"
    path = write_rows("hf_decode", rows)
    print(f"rows appended to {path}")
    print_table(summarize(rows), ["context", "case", "total_s", "decode_s", "decode_speedup", "peak_bytes"])


if __name__ == "__main__":
    main()
