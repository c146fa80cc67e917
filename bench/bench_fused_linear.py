"""CPU benchmark: log-prob + entropy from hidden states, fused-linear vs materialised logits.

Implementations (each in its own subprocess, see harness.py), forward + backward of
``sum(logp * g1 + H * g2)`` with gradients for hidden ``[N, D]`` and weight ``[V, D]``:
- ``fused_linear``: ``aepo_kernels.fused_linear_logprob_entropy`` (no ``[N, V]`` tensor).
- ``materialised_fused``: ``logits = hidden @ weight.T`` then the fused logits kernel with the
  in-place backward (the best one can do once ``[N, V]`` exists).
- ``materialised_naive``: ``logits = hidden @ weight.T`` then fp32 log_softmax + softmax + gather.
Peak memory is above the inputs (hidden, weight); both weight-gradient buffers count.

FLOPs: the materialised paths do 3 matmuls of 2 N D V flops, the fused path 4 (its backward
recomputes the logits blocks), so the fused path trades ~33% more matmul work for memory.

    python bench/bench_fused_linear.py                       # N=8192, D=2048, V=151936, fp32
    python bench/bench_fused_linear.py --n 1024 --d 512 --vocab 32000 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_logprob_entropy import naive_logprob_entropy  # noqa: E402
from harness import measure, print_table, run_case_subprocess, write_rows  # noqa: E402

IMPLS = ["fused_linear", "materialised_fused", "materialised_naive"]


def _impl_fn(impl: str, token_chunk: int, vocab_chunk: int):
    from aepo_kernels import fused_linear_logprob_entropy, logprob_entropy

    if impl == "fused_linear":
        return lambda h, w, y: fused_linear_logprob_entropy(h, w, y, token_chunk=token_chunk, vocab_chunk=vocab_chunk, shift_labels=False)
    if impl == "materialised_fused":
        return lambda h, w, y: logprob_entropy(h @ w.T, y, backend="torch", inplace_backward=True, shift_labels=False)
    return lambda h, w, y: naive_logprob_entropy(h @ w.T, y, 1.0)


def run_case(impl: str, n: int, d: int, vocab: int, warmup: int, repeats: int, token_chunk: int, vocab_chunk: int) -> dict:
    torch.manual_seed(0)
    fn = _impl_fn(impl, token_chunk, vocab_chunk)
    small = (torch.randn(64, 32, requires_grad=True), torch.randn(300, 32, requires_grad=True))
    sum(t.sum() for t in fn(*small, torch.randint(0, 300, (64,)))).backward()  # compile outside the timing
    hidden = torch.randn(n, d)
    weight = torch.randn(vocab, d) / d**0.5
    labels = torch.randint(0, vocab, (n,))
    g_lp, g_h = torch.randn(n), torch.randn(n)

    def setup():
        hidden.grad = weight.grad = None
        return hidden.requires_grad_(), weight.requires_grad_()

    def body(state):
        h, w = state
        t0 = time.perf_counter()
        logp, entropy = fn(h, w, labels)
        t1 = time.perf_counter()
        (logp * g_lp + entropy * g_h).sum().backward()
        return {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}

    row = measure(setup, body, warmup=warmup, repeats=repeats)
    matmuls = 4 if impl == "fused_linear" else 3
    row.update(impl=impl, n=n, d=d, vocab=vocab, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
               gflops=matmuls * 2 * n * d * vocab / row["total_s"] / 1e9,
               logits_fp32_bytes=n * vocab * 4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--impl", nargs="+", default=IMPLS, choices=IMPLS)
    parser.add_argument("--token-chunk", type=int, default=1024)
    parser.add_argument("--vocab-chunk", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.n, args.d, args.vocab, args.warmup, args.repeats,
                                  args.token_chunk, args.vocab_chunk)))
        return
    rows = []
    for impl in args.impl:
        case_args = ["--case", impl, "--n", str(args.n), "--d", str(args.d), "--vocab", str(args.vocab),
                     "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                     "--token-chunk", str(args.token_chunk), "--vocab-chunk", str(args.vocab_chunk)]
        row = run_case_subprocess(Path(__file__), case_args)
        row.setdefault("impl", impl)
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = write_rows("fused_linear_cpu", rows)
    fused = next((r for r in rows if r.get("impl") == "fused_linear" and "peak_bytes" in r), None)
    for r in rows:
        if fused and "peak_bytes" in r:
            r["fused_mem_fraction"] = fused["peak_bytes"] / r["peak_bytes"]
    print(f"\nrows appended to {path}; N={args.n}, D={args.d}, V={args.vocab}, fp32, median of {args.repeats}")
    print_table(rows, ["impl", "fwd_s", "bwd_s", "total_s", "peak_bytes", "fused_mem_fraction", "gflops", "error"])


if __name__ == "__main__":
    main()
