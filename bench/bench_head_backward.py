"""CPU benchmark of the fused-linear AEPO head's three loop orders (issue 54, docs/head.md).

Cases (forward + backward of :func:`aepo_kernels.fused_linear_aepo_policy_loss`, gradients for
hidden ``[N, D]`` and weight ``[V, D]``, entropy statistics supplied: the trainer's path):
- ``token_outer``: token chunks of ``[rows, V]`` logits, gradient in the same pass, an fp32
  ``[V, D]`` d_W accumulator; 3 matmuls = 6 N D V flops.
- ``vocab_outer``: statistics pass, then vocabulary blocks outer (logits recomputed), each fp32
  d_W block finished over all tokens; 4 matmuls = 8 N D V flops.
- ``vocab_outer_lean``: d_W as vocab_outer, d_hidden from a token-outer pass of its own (per token
  chunk: statistics, head, an fp32 ``[rows, D]`` block over the vocabulary); no fp32 ``[N, D]``
  accumulator either; 5 matmuls = 10 N D V flops.
- ``vocab_outer@<MiB>x<vocab_chunk>``: the same with another block budget / vocabulary block.
- ``vocab_outer~<eps>``: gradient filtering at ``filter_eps = eps`` (tiles skipped and the gradient
  error against float64 maths are in the row).
- ``<impl>+two_phase``: entropy statistics not supplied (this call's own: one more pass for
  token_outer, none for vocab_outer).
Every case runs in its own subprocess; ``--rounds`` rounds run the cases interleaved (round 1: every
case once, round 2: ...), each subprocess ``--repeats`` timed repeats after one untimed warm-up; the
row is the median over all timed samples. Peak memory: the process's peak RSS above the inputs
(hidden, weight, labels; the gradients it returns are inside the window), and ``workspace_bytes``:
that peak less the gradients it hands back (d_W in the weight's dtype, d_hidden in hidden's).
``--logit-std``: logits ``hidden @ W.T`` with about this standard deviation (1 by default);
``--zipf S``: plus a bias ``-S log(rank)`` and labels drawn from it (frequent tokens first, peaked
distributions as a trained head's: what gradient filtering needs to skip anything). ``--error``: also the gradients' max error
against float64 maths on the same inputs (one more float64 run, slow at the target shape).

    python bench/bench_head_backward.py                                    # V=151936 D=1024 N=2048 fp32
    python bench/bench_head_backward.py --dtype bfloat16 --rounds 3
    python bench/bench_head_backward.py --impl vocab_outer@4x4096 vocab_outer@4x4096~0.000244 --zipf 1.2 --error
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, measure, print_table, run_case_subprocess, write_rows  # noqa: E402

IMPLS = ["token_outer", "vocab_outer", "vocab_outer_lean"]
MATMULS = {"token_outer": 3, "vocab_outer": 4, "vocab_outer_lean": 5}  # of 2 N D V flops, statistics supplied


def parse(impl: str) -> dict:
    """``vocab_outer@32x2048~0.001+two_phase`` -> its options."""
    out = {"two_phase": impl.endswith("+two_phase")}
    impl = impl.removesuffix("+two_phase")
    if "~" in impl:
        impl, eps = impl.split("~")
        out["filter_eps"] = float(eps)
    if "@" in impl:
        impl, blocks = impl.split("@")
        mib, vocab_chunk = blocks.split("x")
        out["chunk_bytes"], out["vocab_chunk"] = int(mib) << 20, int(vocab_chunk)
    out["head_backward"] = impl
    return out


def inputs(n: int, d: int, vocab: int, dtype: torch.dtype, logit_std: float, zipf: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).to(dtype)
    weight = (torch.randn(vocab, d, generator=gen) * (logit_std / d**0.5)).to(dtype)
    # zipf > 0: a bias -zipf * log(rank) (frequent tokens first, as a trained head's), labels drawn from it
    bias = None if not zipf else (-zipf * torch.arange(1, vocab + 1, dtype=torch.float64).log()).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen) if not zipf else torch.multinomial(
        torch.softmax(bias.double(), 0), n, replacement=True, generator=gen)
    old = -torch.rand(n, generator=gen) * 4
    adv = torch.randn(n, generator=gen)
    mask = (torch.rand(n, generator=gen) > 0.1).float()
    return hidden, weight, labels, old, adv, mask, bias


def loss_fn(opts: dict, labels, old, adv, mask, bias=None):
    from aepo_kernels import LossConfig, fused_linear_aepo_policy_loss

    cfg = LossConfig(clip="aepo", entropy_adv_alpha=0.2)
    stats = {} if opts["two_phase"] else {"entropy_mean": torch.tensor(2.0), "entropy_std": torch.tensor(1.0)}
    kw = {k: v for k, v in opts.items() if k != "two_phase"}

    def fn(h, w):
        b = None if bias is None else bias.to(h.dtype)
        return fused_linear_aepo_policy_loss(h, w, labels, old, adv, mask, bias=b, config=cfg, shift_labels=False,
                                             **stats, **kw)[0]
    return fn


def run_case(impl: str, n: int, d: int, vocab: int, dtype: str, repeats: int, logit_std: float, error: bool,
             zipf: float = 0.0) -> dict:
    torch.manual_seed(0)
    opts = parse(impl)
    dt = getattr(torch, dtype)
    hidden, weight, labels, old, adv, mask, bias = inputs(n, d, vocab, dt, logit_std, zipf)
    fn = loss_fn(opts, labels, old, adv, mask, bias)
    small = inputs(64, d, 4099, dt, logit_std, zipf)
    sfn = loss_fn(opts, *small[2:])
    sfn(small[0].requires_grad_(), small[1].requires_grad_()).backward()  # compile outside the timing

    def setup():
        hidden.grad = weight.grad = None
        return hidden.requires_grad_(), weight.requires_grad_()

    grads = {}

    def body(state):
        h, w = state
        t0 = time.perf_counter()
        loss = fn(h, w)
        t1 = time.perf_counter()
        loss.backward()
        grads["h"], grads["w"] = h.grad, w.grad
        return {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}

    row = measure(setup, body, warmup=0, repeats=repeats)
    out_bytes = weight.numel() * weight.element_size() + hidden.numel() * hidden.element_size()
    matmuls = MATMULS[opts["head_backward"]]
    if opts["two_phase"] and opts["head_backward"] == "token_outer":
        matmuls = 4
    row.update(impl=impl, n=n, d=d, vocab=vocab, dtype=dtype, logit_std=logit_std, zipf=zipf, matmuls=matmuls,
               flops=matmuls * 2 * n * d * vocab, gflops=matmuls * 2 * n * d * vocab / row["total_s"] / 1e9,
               workspace_bytes=row["peak_bytes"] - out_bytes, grad_bytes=out_bytes,
               loadavg_1m=os.getloadavg()[0])
    if opts.get("filter_eps") is not None:
        from aepo_kernels import fused_linear

        counts = {}
        original = fused_linear.gradient_pass

        def counting(*a, **k):
            k["counts"] = counts
            return original(*a, **k)
        fused_linear.gradient_pass = counting
        try:
            fn(hidden.detach().requires_grad_(), weight.detach().requires_grad_()).backward()
        finally:
            fused_linear.gradient_pass = original
        row.update(tiles=counts["tiles"], skipped=counts["skipped"])
    if error:
        h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        ref_fn = loss_fn({"head_backward": "vocab_outer", "two_phase": opts["two_phase"]}, labels, old, adv, mask,
                            None if bias is None else bias.double())
        ref_fn(h64, w64).backward()
        for name, got, ref in (("hidden", grads["h"], h64.grad), ("weight", grads["w"], w64.grad)):
            row[f"err_{name}"] = float((got.double() - ref).abs().max())
            row[f"rel_err_{name}"] = row[f"err_{name}"] / float(ref.abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--impl", nargs="+", default=IMPLS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--logit-std", type=float, default=1.0)
    parser.add_argument("--zipf", type=float, default=0.0)
    parser.add_argument("--error", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.n, args.d, args.vocab, args.dtype, args.repeats, args.logit_std,
                                  args.error, args.zipf)))
        return
    info = machine()
    runs: dict[str, list[dict]] = {impl: [] for impl in args.impl}
    for r in range(args.rounds):
        for impl in args.impl:
            case_args = ["--case", impl, "--n", str(args.n), "--d", str(args.d), "--vocab", str(args.vocab),
                         "--dtype", args.dtype, "--repeats", str(args.repeats), "--logit-std", str(args.logit_std),
                         "--zipf", str(args.zipf)]
            row = run_case_subprocess(Path(__file__), case_args + (["--error"] if args.error and r == 0 else []))
            print(json.dumps({"round": r, "impl": impl, **{k: v for k, v in row.items() if k != "samples"}}), flush=True)
            runs[impl].append(row)
    rows = []
    for impl, parts in runs.items():
        ok = [p for p in parts if "error" not in p]
        if not ok:
            rows.append({"impl": impl, "error": parts[0]["error"]})
            continue
        row = {k: v for k, v in ok[0].items() if k != "samples"}
        for key in ("fwd_s", "bwd_s", "total_s"):
            samples = [s for p in ok for s in p["samples"][key]]
            row[key], row[key.replace("_s", "_min_s")] = statistics.median(samples), min(samples)
            row[key.replace("_s", "_spread_s")] = max(samples) - min(samples)
            row.setdefault("samples", {})[key] = samples
        row["peak_bytes"] = max(p["peak_bytes"] for p in ok)
        row["workspace_bytes"] = row["peak_bytes"] - row["grad_bytes"]
        row["repeats"] = len(row["samples"]["total_s"])
        row["loadavg_1m"] = max(p["loadavg_1m"] for p in ok)
        row["rounds"] = len(ok)
        rows.append(row)
    base = next((r for r in rows if r.get("impl") == "token_outer" and "total_s" in r), None)
    for r in rows:
        if base and "total_s" in r:
            r["time_vs_token_outer"] = r["total_s"] / base["total_s"]
            r["peak_vs_token_outer"] = r["peak_bytes"] / base["peak_bytes"]
    if not args.no_write:
        path = write_rows("head_backward_cpu", rows, info)
        print(f"\nrows appended to {path}")
    print(f"N={args.n}, D={args.d}, V={args.vocab}, {args.dtype}, median over {args.rounds} interleaved rounds")
    print_table(rows, ["impl", "total_s", "total_min_s", "peak_bytes", "workspace_bytes", "time_vs_token_outer",
                       "peak_vs_token_outer", "gflops", "skipped", "tiles", "rel_err_hidden", "rel_err_weight", "error"])


if __name__ == "__main__":
    main()
