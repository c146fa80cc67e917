"""CPU benchmark: per-token log-prob + entropy, forward and backward, fused vs naive.

Implementations (each in its own subprocess, see harness.py):
- ``naive_eager``: what TRL-style code does: fp32 ``log_softmax`` + ``softmax`` + gather +
  ``-(p * logp).sum``, autograd backward.
- ``naive_compiled``: ``torch.compile`` of that function (compile time excluded: warm-up).
- ``fused``: ``aepo_kernels.logprob_entropy(backend="torch")`` (compiled chunk functions).
- ``fused_inplace``: the same with ``inplace_backward=True`` (dlogits written into the logits).
- ``fused_eager``: the fused path with ``AEPO_TORCH_COMPILE=0``.
The body is forward, then backward of ``sum(logp * g1 + H * g2)`` with random upstream grads.

Bytes-moved floor (``b`` bytes per logit): forward reads N V b; backward reads N V b and writes
N V b. ``GB/s`` columns are that floor divided by the measured time.

    python bench/bench_logprob_entropy.py                 # N=4096, V in {151936, 32000}
    python bench/bench_logprob_entropy.py --n 512 --vocab 32000 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import measure, print_table, run_case_subprocess, write_rows  # noqa: E402

IMPLS = ["naive_eager", "naive_compiled", "fused", "fused_inplace", "fused_eager"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def naive_logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    scaled = logits.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    entropy = -(probs * log_probs).sum(-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _impl_fn(impl: str):
    if impl.startswith("naive"):
        return torch.compile(naive_logprob_entropy) if impl == "naive_compiled" else naive_logprob_entropy
    from aepo_kernels import logprob_entropy

    inplace = impl == "fused_inplace"
    return lambda z, y, t: logprob_entropy(z, y, t, backend="torch", inplace_backward=inplace, shift_labels=False)


def run_case(impl: str, n: int, vocab: int, dtype: str, warmup: int, repeats: int) -> dict:
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (n,))
    g_lp, g_h = torch.randn(n), torch.randn(n)
    fn = _impl_fn(impl)

    def setup():
        # A non-leaf logits tensor, as a model produces it (in-place backward writes into it).
        leaf = torch.randn(n, vocab, dtype=DTYPES[dtype]).requires_grad_()
        return leaf, leaf.view_as(leaf)

    def body(state):
        leaf, logits = state
        t0 = time.perf_counter()
        logp, entropy = fn(logits, labels, 1.0)
        t1 = time.perf_counter()
        (logp * g_lp + entropy * g_h).sum().backward()
        return {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}

    t_start = time.perf_counter()
    row = measure(setup, body, warmup=warmup, repeats=repeats)
    row["wall_s"] = time.perf_counter() - t_start
    elem = torch.finfo(DTYPES[dtype]).bits // 8
    floor_fwd, floor_bwd = n * vocab * elem, 2 * n * vocab * elem
    row.update(impl=impl, n=n, vocab=vocab, dtype=dtype, floor_fwd_bytes=floor_fwd, floor_bwd_bytes=floor_bwd,
               fwd_gbps=floor_fwd / row["fwd_s"] / 1e9, bwd_gbps=floor_bwd / row["bwd_s"] / 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 32000])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--impl", nargs="+", default=IMPLS, choices=IMPLS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print its row
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.n, args.vocab[0], args.dtype, args.warmup, args.repeats)))
        return
    rows = []
    for vocab in args.vocab:
        for impl in args.impl:
            env = {"AEPO_TORCH_COMPILE": "0"} if impl == "fused_eager" else {}
            case_args = ["--case", impl, "--n", str(args.n), "--vocab", str(vocab), "--dtype", args.dtype,
                         "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
            row = run_case_subprocess(Path(__file__), case_args, env)
            row.setdefault("impl", impl)
            row.setdefault("vocab", vocab)
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = write_rows("logprob_entropy_cpu", rows)
    for vocab in args.vocab:
        base = next((r for r in rows if r.get("vocab") == vocab and r.get("impl") == "naive_eager" and "total_s" in r), None)
        for r in rows:
            if r.get("vocab") == vocab and base and "total_s" in r:
                r["speedup_vs_naive"] = base["total_s"] / r["total_s"]
                r["mem_vs_naive"] = r["peak_bytes"] / base["peak_bytes"]
    print(f"\nrows appended to {path}; N={args.n}, dtype={args.dtype}, median of {args.repeats}")
    print_table(rows, ["vocab", "impl", "fwd_s", "bwd_s", "total_s", "total_spread_s", "peak_bytes",
                       "speedup_vs_naive", "mem_vs_naive", "fwd_gbps", "bwd_gbps", "error"])


if __name__ == "__main__":
    main()
