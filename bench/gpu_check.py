"""GPU check: the Triton path against the reference at real shapes, and its speed against the floor.

One script, one call on a lent GPU (an H200 in our plans). It prints, and writes to
``bench/results/gpu_check.jsonl`` (or ``$OUT`` when set):
1. correctness of ``logprob_entropy(backend="triton")`` (values and dlogits) against the fp32
   reference at V=151,936, bf16 logits, and of the fused-linear path against materialised logits;
2. the measured device copy bandwidth (``dst.copy_(src)``: reads + writes 2 x size bytes);
3. forward, backward and both for: triton, triton in-place, naive eager, torch.compile of naive,
   and Liger-Kernel's triton GRPO loss when importable, at N in {4096, 16384};
   GB/s against the bytes-moved floor: forward reads N V b bytes, backward reads N V b and writes
   N V b (b = 2 for bf16). Targets: forward >= 80% of copy bandwidth, forward+backward within
   1.3x of the floor time, >= 10x faster than eager.

4. the one-pass AEPO loss (``aepo_policy_loss``, Triton kernel: log-prob, entropy, clip, loss and
   dlogits in one sweep per row): correctness of value and dlogits against the fp32 reference
   (every clip rule, V=151,936, bf16), fused-linear one-pass against materialised logits, and
   forward+backward time of one-pass (in place and not), the previous two-stage path (triton
   log-prob/entropy + torch loss), the eager reference loss and Liger's triton GRPO loss.
   Floor: read the logits twice, write dlogits once (3 N V b bytes). Targets: one-pass in place
   within 1.25x of the floor, >= 10x eager, faster than Liger's GRPO loss (which computes no entropy).

``--smoke`` runs the same code on tiny shapes on the CPU (Triton interpreter), to keep the script
working where no GPU is lent.

    python bench/gpu_check.py            # on the GPU machine
    python bench/gpu_check.py --smoke    # here, CPU only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_logprob_entropy import naive_logprob_entropy  # noqa: E402
from harness import machine  # noqa: E402

from aepo_kernels import (  # noqa: E402
    CLIP_RULES, LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy,
    logprob_entropy, policy_loss_from_logprobs,
)
from aepo_kernels.reference import aepo_loss_reference, logprob_entropy_reference  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median and spread (s) of ``fn()`` over repeats, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times) - min(times)


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    median, _ = timed(lambda: dst.copy_(src), repeats)
    return 2 * n_bytes / median


def check_correctness(n: int, vocab: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (torch.randn(n, vocab, device=DEVICE, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device=DEVICE, generator=gen)
    g_lp, g_h = torch.randn(n, device=DEVICE, generator=gen), torch.randn(n, device=DEVICE, generator=gen)
    results = {}
    for name, fn in [("triton", lambda z: logprob_entropy(z, labels, 0.9, backend="triton")),
                     ("reference", lambda z: logprob_entropy_reference(z, labels, 0.9))]:
        leaf = logits.clone().requires_grad_()
        logp, ent = fn(leaf)
        (logp * g_lp + ent * g_h).sum().backward()
        results[name] = (logp.detach(), ent.detach(), leaf.grad.float())
        del leaf
    (lp, ent, grad), (lp_r, ent_r, grad_r) = results["triton"], results["reference"]
    return {"check": "logprob_entropy", "n": n, "vocab": vocab,
            "max_abs_logp": (lp - lp_r).abs().max().item(), "max_abs_entropy": (ent - ent_r).abs().max().item(),
            "max_abs_dlogits": (grad - grad_r).abs().max().item(),
            "max_rel_dlogits": ((grad - grad_r).abs().max() / grad_r.abs().max()).item()}


def check_fused_linear(n: int, d: int, vocab: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    hidden = torch.randn(n, d, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, d, device=DEVICE, generator=gen) / d**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device=DEVICE, generator=gen)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    t0 = time.perf_counter()
    lp, ent = fused_linear_logprob_entropy(h1, w1, labels)
    (lp + ent).sum().backward()
    sync()
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if DEVICE == "cuda" else None
    h2, w2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp_r, ent_r = logprob_entropy_reference(h2 @ w2.T, labels)
    (lp_r + ent_r).sum().backward()
    return {"check": "fused_linear", "n": n, "d": d, "vocab": vocab, "seconds_incl_first_call": elapsed,
            "peak_bytes": peak, "max_abs_logp": (lp - lp_r).abs().max().item(),
            "max_abs_entropy": (ent - ent_r).abs().max().item(),
            "max_rel_dweight": ((w1.grad.float() - w2.grad).abs().max() / w2.grad.abs().max()).item()}


def _liger_fn(labels: torch.Tensor):
    """Liger-Kernel's triton GRPO loss on the same logits, or None and the reason.

    Its contract: logits ``[B, L+1, V]`` (the last position is dropped), completion ids
    ``[B, L]``, advantages ``[B]``; it returns the loss (or a tuple led by it).
    """
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError as exc:
        return None, f"liger-kernel not importable: {exc}"
    ids = labels.unsqueeze(0)
    advantages = torch.ones(1, device=labels.device)

    def fn(z):
        padded = torch.cat([z, z[-1:]], 0).unsqueeze(0)  # [1, N+1, V]; costs one extra copy
        out = triton_grpo_loss(padded, None, None, ids, advantages, beta=0.0, inplace=True)
        loss = out[0] if isinstance(out, tuple) else out
        return loss.sum(), torch.zeros((), device=z.device)

    return fn, "note: includes one [N+1, V] concatenation copy to fit its [B, L+1, V] contract"


def time_impls(n: int, vocab: int, repeats: int, copy_bw: float) -> list[dict]:
    logits = torch.randn(n, vocab, device=DEVICE, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    g_lp, g_h = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    elem = 2
    floor_fwd, floor_bwd = n * vocab * elem, 2 * n * vocab * elem
    compiled_naive = torch.compile(naive_logprob_entropy)
    impls = {
        "triton": lambda z: logprob_entropy(z, labels, backend="triton"),
        "triton_inplace": lambda z: logprob_entropy(z, labels, backend="triton", inplace_backward=True),
        "naive_eager": lambda z: naive_logprob_entropy(z, labels, 1.0),
        "naive_compiled": lambda z: compiled_naive(z, labels, 1.0),
    }
    liger, liger_note = _liger_fn(labels)
    if liger is not None:
        impls["liger_grpo"] = liger
    rows = []
    for name, fn in impls.items():
        leaf = logits.clone().requires_grad_()

        def fwd():
            return fn(leaf.view_as(leaf))

        def both():
            logp, ent = fn(leaf.view_as(leaf))
            (logp * g_lp + ent * g_h).sum().backward()

        try:
            fwd_s, fwd_spread = timed(lambda: fwd(), repeats)
            both_s, both_spread = timed(both, repeats)
        except Exception as exc:  # noqa: BLE001 -- OOM or a third-party API mismatch: report, go on
            rows.append({"impl": name, "n": n, "vocab": vocab, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        finally:
            del leaf
        bwd_s = both_s - fwd_s
        rows.append({
            "impl": name, "n": n, "vocab": vocab, "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_bwd_s": both_s,
            "fwd_spread_s": fwd_spread, "fwd_bwd_spread_s": both_spread,
            "fwd_gbps": floor_fwd / fwd_s / 1e9, "bwd_gbps": floor_bwd / bwd_s / 1e9 if bwd_s > 0 else None,
            "fwd_frac_copy_bw": floor_fwd / fwd_s / copy_bw,
            "fwd_bwd_over_floor": both_s / ((floor_fwd + floor_bwd) / copy_bw),
        })
    rows.append({"impl": "liger_grpo", "n": n, "vocab": vocab, "note": liger_note})
    eager = next((r for r in rows if r["impl"] == "naive_eager" and "fwd_bwd_s" in r), None)
    for r in rows:
        if eager and "fwd_bwd_s" in r:
            r["speedup_vs_eager"] = eager["fwd_bwd_s"] / r["fwd_bwd_s"]
    return rows


# --- the one-pass AEPO loss ----------------------------------------------------------------------


def _loss_inputs(n: int, vocab: int, seed: int = 2) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return dict(labels=torch.randint(0, vocab, (1, n), device=DEVICE, generator=gen),
                old_logprobs=-torch.rand(1, n, device=DEVICE, generator=gen) * 4 - 9,
                advantages=torch.randn(1, n, device=DEVICE, generator=gen),
                loss_mask=(torch.rand(1, n, device=DEVICE, generator=gen) > 0.1).float())


def check_one_pass(n: int, vocab: int) -> list[dict]:
    """Value and dlogits of the Triton one-pass loss against the reference, every clip rule."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    logits = (torch.randn(1, n, vocab, device=DEVICE, generator=gen) * 3).to(torch.bfloat16)
    inputs = _loss_inputs(n, vocab)
    rows = []
    for clip in CLIP_RULES:
        cfg = LossConfig(clip=clip, kl_coef=0.05, entropy_coef=0.01)
        ref_lp = inputs["old_logprobs"] + 0.1
        leaf = logits.clone().requires_grad_()
        loss, _ = aepo_policy_loss(leaf, **inputs, config=cfg, temperature=0.9, backend="triton", ref_logprobs=ref_lp)
        loss.backward()
        ref_leaf = logits.clone().requires_grad_()
        expected = aepo_loss_reference(ref_leaf, inputs["labels"], inputs["old_logprobs"], inputs["advantages"],
                                       inputs["loss_mask"], cfg, 0.9, ref_logprobs=ref_lp)
        expected.backward()
        g, g_ref = leaf.grad.float(), ref_leaf.grad.float()
        rows.append({"check": "one_pass", "clip": clip, "n": n, "vocab": vocab,
                     "abs_loss": (loss - expected).abs().item(),
                     "max_rel_dlogits": ((g - g_ref).abs().max() / g_ref.abs().max()).item()})
        del leaf, ref_leaf
    return rows


def check_fused_linear_one_pass(n: int, d: int, vocab: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    hidden = torch.randn(1, n, d, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, d, device=DEVICE, generator=gen) / d**0.5).to(torch.bfloat16)
    inputs = _loss_inputs(n, vocab)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    sync()
    t0 = time.perf_counter()
    loss, _ = fused_linear_aepo_policy_loss(h1, w1, **inputs)
    loss.backward()
    sync()
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if DEVICE == "cuda" else None
    h2, w2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    expected, _ = aepo_policy_loss(h2 @ w2.T, **inputs, backend="reference")
    expected.backward()
    return {"check": "fused_linear_one_pass", "n": n, "d": d, "vocab": vocab, "seconds_incl_first_call": elapsed,
            "peak_bytes": peak, "abs_loss": (loss - expected).abs().item(),
            "max_rel_dweight": ((w1.grad.float() - w2.grad).abs().max() / w2.grad.abs().max()).item(),
            "max_rel_dhidden": ((h1.grad.float() - h2.grad).abs().max() / h2.grad.abs().max()).item()}


def time_one_pass(n: int, vocab: int, repeats: int, copy_bw: float) -> list[dict]:
    """Forward+backward of the whole loss; floor = 3 N V b bytes (read twice, write once)."""
    logits = torch.randn(1, n, vocab, device=DEVICE, dtype=torch.bfloat16)
    inputs = _loss_inputs(n, vocab)
    stats = dict(entropy_mean=torch.tensor(9.0, device=DEVICE), entropy_std=torch.tensor(0.5, device=DEVICE),
                 global_token_count=inputs["loss_mask"].sum())
    floor_s = 3 * n * vocab * 2 / copy_bw

    def two_stage(z):
        logp, ent = logprob_entropy(z, inputs["labels"], backend="triton", inplace_backward=True)
        return policy_loss_from_logprobs(logp, ent, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"], **stats)[0]

    liger, liger_note = _liger_fn(inputs["labels"][0])
    impls = {
        "one_pass_inplace": lambda z: aepo_policy_loss(z, **inputs, backend="triton", inplace_backward=True, **stats)[0],
        "one_pass": lambda z: aepo_policy_loss(z, **inputs, backend="triton", **stats)[0],
        "two_stage_inplace": two_stage,
        "reference_eager": lambda z: aepo_loss_reference(z, inputs["labels"], inputs["old_logprobs"], inputs["advantages"],
                                                         inputs["loss_mask"]),
    }
    if liger is not None:
        impls["liger_grpo"] = lambda z: liger(z[0])[0]
    rows = []
    for name, fn in impls.items():
        def both():
            leaf = logits.detach().requires_grad_()  # the in-place variants overwrite it: timing only
            fn(leaf).backward()

        try:
            both_s, spread = timed(both, repeats)
        except Exception as exc:  # noqa: BLE001 -- OOM or a third-party API mismatch: report, go on
            rows.append({"impl": name, "n": n, "vocab": vocab, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({"bench": "one_pass_loss", "impl": name, "n": n, "vocab": vocab, "fwd_bwd_s": both_s,
                     "fwd_bwd_spread_s": spread, "fwd_bwd_over_floor": both_s / floor_s})
    rows.append({"bench": "one_pass_loss", "impl": "liger_grpo", "note": liger_note})
    eager = next((r for r in rows if r["impl"] == "reference_eager" and "fwd_bwd_s" in r), None)
    for r in rows:
        if eager and "fwd_bwd_s" in r:
            r["speedup_vs_eager"] = eager["fwd_bwd_s"] / r["fwd_bwd_s"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU interpreter check")
    vocab = 151936 if not SMOKE else 1000
    sizes = [4096, 16384] if not SMOKE else [8]
    rows: list[dict] = [{"machine": machine()}]
    rows.append(check_correctness(4096 if not SMOKE else 6, vocab))
    rows.append(check_fused_linear(*((8192, 2048, vocab) if not SMOKE else (16, 32, vocab))))
    copy_bw = copy_bandwidth(4 << 30 if not SMOKE else 1 << 20, args.repeats)
    rows.append({"check": "copy_bandwidth_gbps", "value": copy_bw / 1e9})
    for n in sizes:
        rows.extend(time_impls(n, vocab, args.repeats if not SMOKE else 1, copy_bw))
    rows.extend(check_one_pass(4096 if not SMOKE else 6, vocab))
    rows.append(check_fused_linear_one_pass(*((8192, 2048, vocab) if not SMOKE else (16, 32, vocab))))
    for n in sizes:
        rows.extend(time_one_pass(n, vocab, args.repeats if not SMOKE else 1, copy_bw))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / ("gpu_check_smoke.jsonl" if SMOKE else "gpu_check.jsonl")).open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows:
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}))


if __name__ == "__main__":
    main()
