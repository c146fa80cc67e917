"""Error of the top-k entropy estimators against exact entropy (full logits).

Sources of distributions:
- ``tiny-random``: a randomly initialised tiny Qwen3 (near-uniform, the hardest case for top-k);
- ``tiny-trained``: the same model after a few hundred next-token steps on its corpus (peaked);
- ``zipf-s<S>``: synthetic LM-like rows over V = 151,936 (Qwen's vocab): logits = -s log(rank)
  + N(0, 0.5) noise, in random token order, with a boost on one token in a quarter of the rows
  (LLM positions are often near-deterministic).
For k in {5, 10, 20} and every estimator mode it reports mean/max |estimate - exact| in nats,
the mean exact entropy and the mean bound gap (upper - lower), and writes the rows as JSON to
``bench/results/entropy_estimator.json`` with machine, commit and shapes.

Usage: python bench/bench_entropy_estimator.py [--rows 64] [--out bench/results/entropy_estimator.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from aepo_engine.provenance import git_commit
from aepo_engine.rollout.entropy import exact_entropy, topk_entropy_bounds, topk_entropy_estimate

MODES = ("powerlaw", "mid", "upper", "lower", "truncated")
QWEN_VOCAB = 151_936


# ---------------------------------------------------------------------------------------------
def tiny_model_logits(trained: bool, rows: int) -> torch.Tensor:
    """[N, V] next-token logits of a tiny Qwen3 on its own corpus plus sampled continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.models.tiny_qwen3 import DEFAULT_TEXTS

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen3(tmp, seed=0, train_steps=40 if trained else 0)
        model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    ids = [tok(t)["input_ids"] for t in DEFAULT_TEXTS]
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([x])).logits[0] for x in ids])  # [sum L, V]
    return logits[torch.randperm(len(logits), generator=torch.Generator().manual_seed(0))[:rows]]


def zipf_logits(s: float, rows: int, vocab: int = QWEN_VOCAB, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] Zipf-like logits (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -s * ranks.log() + 0.5 * torch.randn(rows, vocab, generator=gen)  # [rows, V]
    logits[: rows // 4, 0] += 8.0  # near-deterministic positions
    return logits[:, torch.randperm(vocab, generator=gen)]


def measure(source: str, logits: torch.Tensor, temperature: float = 1.0) -> list[dict]:
    exact = exact_entropy(logits, temperature).double()  # [N]
    logp = torch.log_softmax(logits.double() / temperature, -1)
    rows = []
    for k in (5, 10, 20):
        topk = logp.topk(k, dim=-1).values  # [N, k]
        lower, upper = topk_entropy_bounds(topk, logits.shape[-1])
        for mode in MODES:
            err = (topk_entropy_estimate(topk, logits.shape[-1], mode).double() - exact).abs()
            rows.append(dict(
                source=source, temperature=temperature, k=k, mode=mode, n=len(exact),
                vocab=logits.shape[-1], mean_exact=exact.mean().item(),
                mean_gap=(upper - lower).double().mean().item(),
                mean_abs_err=err.mean().item(), max_abs_err=err.max().item(),
                bounds_hold=bool(((lower <= exact + 1e-4) & (exact <= upper + 1e-4)).all()),
            ))
    return rows


def estimator_time_us(n: int = 4096, k: int = 20, repeats: int = 20) -> float:
    """Median wall time of topk_entropy_estimate on [n, k] (float64 maths, CPU)."""
    x = torch.log_softmax(torch.randn(n, QWEN_VOCAB // 64), -1).topk(k, -1).values
    times = []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        topk_entropy_estimate(x, QWEN_VOCAB)
        if i >= 3:  # 3 warm-up calls
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="distributions per source")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "entropy_estimator.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict] = []
    for trained in (False, True):
        logits = tiny_model_logits(trained, args.rows)
        for temperature in (0.7, 1.0):
            rows += measure("tiny-trained" if trained else "tiny-random", logits, temperature)
    for s in (0.8, 1.0, 1.2, 1.5, 2.0):
        rows += measure(f"zipf-s{s}", zipf_logits(s, args.rows))
    meta = dict(machine=platform.node(), cpu=platform.processor(), torch=torch.__version__,
                commit=git_commit(__file__), estimator_us_4096x20=estimator_time_us())
    print(f"{'source':14s} {'T':>4s} {'k':>3s} {'mode':>9s} {'H mean':>7s} {'gap':>6s} {'mean|err|':>9s} {'max|err|':>8s} bounds")
    for r in rows:
        print(f"{r['source']:14s} {r['temperature']:4.1f} {r['k']:3d} {r['mode']:>9s} {r['mean_exact']:7.3f} "
              f"{r['mean_gap']:6.3f} {r['mean_abs_err']:9.4f} {r['max_abs_err']:8.4f} {r['bounds_hold']}")
    print(f"estimator time on [4096, 20]: {meta['estimator_us_4096x20']:.0f} us")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
