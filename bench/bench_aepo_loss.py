"""CPU benchmark of the whole AEPO loss, forward + backward: the one-pass path against today's
two-stage path and against peers, each case in its own subprocess (harness.py), side by side.

Subjects (``--level``):
- ``linear``: from hidden ``[N, D]`` and lm_head ``[V, D]`` (gradients for both), fp32:
  ``one_pass_fused_linear`` (:func:`aepo_kernels.fused_linear_aepo_policy_loss`: gradient in the
  forward loop, 3 matmuls of 2 N D V flops), ``two_stage_fused_linear`` (the previous path:
  ``fused_linear_logprob_entropy`` with its recomputing backward, 4 matmuls, then
  ``policy_loss_from_logprobs``), ``one_pass_materialised`` (``logits = h @ W.T`` then the one-pass
  loss in place), ``two_stage_materialised`` (logits, then ``logprob_entropy`` with the in-place
  backward, then the loss), and the peer ``liger_grpo`` (Liger-Kernel's
  ``LigerFusedLinearGRPOLoss``, its torch-chunked path; it computes no entropy). Floors, no loss:
  ``gemm3`` (the 3 bare matmuls of every path: ``z = h W^T``, ``z W``, ``z^T h``, 3 x 2 N D V flops)
  and ``gemm3_chunked`` (the same in the one-pass path's token chunks, ``d_W`` by ``addmm_``).
  What a path spends beyond ``gemm3`` is its non-matmul work: the fused path can only beat the
  materialised one by that part of the materialised path's time.
- ``logits``: from logits ``[N, V]`` fp32: ``one_pass_inplace``, ``one_pass`` (dlogits in a new
  buffer), ``two_stage_inplace`` (the previous path), and the memory-bound floors ``read``
  (``logits.sum()``: reads N V 4 bytes), ``copy`` (``logits.clone()``: reads N V 4 bytes and writes
  them to new memory) and ``copy_into`` (the same into a buffer touched before: no page faults). The
  one-pass loss reads the logits twice and writes dlogits once (3 N V 4 bytes). The backward timed
  is the loss's own: ``torch.autograd.grad`` to the logits (what the lm_head's backward would take),
  not a further copy into a leaf's ``.grad``.
- ``<impl>@16MiB``: the case with the CPU row chunks of before this change (16 MiB, 27 rows at
  V=151,936) instead of one chunk per sequence: ``two_stage_inplace@16MiB`` is the previous path as
  it ran.
- ``<impl>@compiled``: the case with the native C row kernel switched off (``AEPO_CPU_NATIVE=0``),
  i.e. the compiled torch path that every fp32 CPU call took before it: ``one_pass@compiled``
  against ``one_pass`` is the kernel's gain in the same run. The native kernel keeps each row in
  cache between its sweeps, so its memory traffic is that of a copy (2 N V 4 bytes); the compiled
  path's is 3 N V 4 bytes (``gb_per_s`` uses each path's own count).
- ``<impl>:<M>MiB`` (linear level): the fused-linear one-pass loss (or ``gemm3_chunked``) with
  ``chunk_bytes = M MiB`` instead of :data:`aepo_kernels.DEFAULT_CHUNK_BYTES`, e.g.
  ``one_pass_fused_linear:128MiB``: the memory budget's effect on time and peak, in the same run.
- ``*_softcap`` (both levels): the same one-pass call with Gemma-2's soft cap (``softcap=30``,
  ``logit_scale=0.5``): the cost of the option, against its uncapped twin in the same run.
- ``*_two_phase`` (``one_pass_inplace_two_phase``, ``one_pass_fused_linear_two_phase``): the same
  call without ``entropy_mean``/``entropy_std``, so it first runs its own no-grad log-prob/entropy
  pass (from hidden states: one more logits matmul): what not supplying the statistics costs.
Rows keep every timed sample (``samples``) and the minimum beside the median. ``--interleave``
runs the listed cases in one subprocess, one call of each in turn (no ``@`` suffixes): the fair
way to compare cases that allocate a new [N, V] buffer on this VM, where a fresh buffer's cost
depends on what the host did with freed memory meanwhile (:func:`run_interleaved`).
``--hot-pages`` frees a written buffer of the logits' size just before each logits-level call
(:func:`touch_and_free`: why, and what it changes at each shape).
Every loss case runs the AEPO defaults (aepo clip, entropy-aware advantage with supplied global
statistics, token-mean over a supplied token count) -- the trainer's call.

    python bench/bench_aepo_loss.py --level linear --shape big      # N=8192 D=2048 V=151936
    python bench/bench_aepo_loss.py --level linear --shape mid      # N=2048 (B=2 x T=1024) D=1024 V=32000
    python bench/bench_aepo_loss.py --level logits --shape big      # [4096, 151936]
    python bench/bench_aepo_loss.py --level logits --shape big --repeats 9 --interleave --hot-pages \
        --impl one_pass copy one_pass_inplace two_stage_inplace copy_into

The shapes live in SHAPES (also used by the pytest-benchmark cases in test_kernel_benchmarks.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import measure, print_table, run_case_subprocess, summarize_samples, write_rows  # noqa: E402

# One source of truth for the benchmark shapes: name -> (N tokens, D hidden, V vocab).
SHAPES = {
    "linear": {"big": (8192, 2048, 151936), "mid": (2048, 1024, 32000), "small": (256, 128, 4099)},
    "logits": {"big": (4096, 0, 151936), "mid": (1024, 0, 151936), "small": (64, 0, 32003)},
}
IMPLS = {
    "linear": ["one_pass_fused_linear", "one_pass_fused_linear@compiled", "two_stage_fused_linear", "one_pass_materialised", "two_stage_materialised",
               "liger_grpo", "one_pass_fused_linear_softcap", "one_pass_fused_linear_two_phase", "gemm3", "gemm3_chunked"],
    "logits": ["one_pass_inplace", "one_pass", "one_pass_inplace@compiled", "one_pass@compiled", "two_stage_inplace",
               "two_stage_inplace@16MiB", "read", "copy", "copy_into", "one_pass_inplace_softcap", "one_pass_inplace_two_phase"],
}
NO_GRAD = ("read", "copy", "copy_into", "gemm3", "gemm3_chunked")  # floors: no loss, no backward
WARM_UP_TOKENS = {"linear": 256, "logits": 64}  # tokens of the untimed compile run (at the timed D, V)
# An impl name + one of these suffixes runs with the environment given (see the module docstring):
# @16MiB: the CPU row chunks of before (16 MiB, 27 rows at V=151,936) instead of one chunk per
# sequence (logits_ops.cpu_chunk_elems), on the compiled path; @compiled: the native kernel off.
ENV_SUFFIXES = {"@16MiB": {"AEPO_CPU_CHUNK_ELEMS": str(1 << 22), "AEPO_CPU_NATIVE": "0"},
                "@compiled": {"AEPO_CPU_NATIVE": "0"}}
BUDGET_SEP = ":"  # one_pass_fused_linear:128MiB -> chunk_bytes = 128 MiB (linear level)
BUDGETED = ("one_pass_fused_linear", "one_pass_fused_linear_softcap", "gemm3_chunked")
SEQ_LEN = 1024  # rows are cut into sequences of this length (Liger takes [B, T, D])
TWO_PHASE = "_two_phase"  # one_pass_inplace_two_phase: the call without entropy statistics


def loss_inputs(n: int, vocab: int, seed: int = 0) -> dict:
    """Per-token inputs of a batch of n tokens: labels, old log-probs, advantages, mask [B, T]."""
    gen = torch.Generator().manual_seed(seed)
    seq = min(n, SEQ_LEN)
    batch = n // seq
    return dict(
        labels=torch.randint(0, vocab, (batch, seq), generator=gen),
        old_logprobs=-torch.rand(batch, seq, generator=gen) * 4 - 8,  # near log(1/V) of random logits
        advantages=torch.randn(batch, generator=gen),
        loss_mask=(torch.rand(batch, seq, generator=gen) > 0.1).float(),
    )


def split_budget(name: str) -> tuple[str, int | None]:
    """``"one_pass_fused_linear:128MiB"`` -> ``("one_pass_fused_linear", 128 << 20)``; no suffix -> None."""
    impl, sep, budget = name.partition(BUDGET_SEP)
    if not sep:
        return impl, None
    if not budget.endswith("MiB") or not budget[:-3].isdigit() or int(budget[:-3]) < 1:
        raise ValueError(f"{name!r}: the budget suffix is ':<positive integer>MiB', e.g. ':128MiB'")
    return impl, int(budget[:-3]) << 20


def strip_env_suffix(name: str) -> str:
    for suffix in ENV_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def case_env(name: str) -> dict[str, str]:
    """The environment a case name's suffix asks for (empty without one)."""
    return next((env for suffix, env in ENV_SUFFIXES.items() if name.endswith(suffix)), {})


def make_loss_fn(impl: str, inputs: dict, chunk_bytes: int | None = None):
    """A callable of the level's tensors returning the scalar loss (its backward is timed too).
    ``chunk_bytes``: the fused-linear one-pass path's budget (None: the library default)."""
    from aepo_kernels import (DEFAULT_CHUNK_BYTES, LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, fused_linear_logprob_entropy,
                              logprob_entropy, policy_loss_from_logprobs)

    cfg = LossConfig()
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    labels, old, adv, mask = inputs["labels"], inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"]
    stats = dict(entropy_mean=torch.tensor(9.0), entropy_std=torch.tensor(0.5), global_token_count=mask.sum())
    if impl.endswith(TWO_PHASE):  # no entropy statistics: the call runs its own no-grad pass first
        impl, stats = impl.removesuffix(TWO_PHASE), dict(global_token_count=mask.sum())
    shape = labels.shape

    def two_stage(logp, entropy):
        return policy_loss_from_logprobs(logp.reshape(shape), entropy.reshape(shape), old, adv, mask, config=cfg, **stats)[0]

    if impl in ("one_pass_fused_linear", "one_pass_fused_linear_softcap"):
        head = dict(softcap=30.0, logit_scale=0.5) if impl.endswith("_softcap") else {}
        return lambda h, w: fused_linear_aepo_policy_loss(h.reshape(*shape, -1), w, labels, old, adv, mask, config=cfg,
                                                          chunk_bytes=budget, shift_labels=False, **stats, **head)[0]
    if impl == "two_stage_fused_linear":  # the previous defaults: 1024 x 8192 blocks, recomputing backward
        return lambda h, w: two_stage(*fused_linear_logprob_entropy(h, w, labels.reshape(-1), token_chunk=1024, vocab_chunk=8192, shift_labels=False))
    if impl == "one_pass_materialised":
        return lambda h, w: aepo_policy_loss((h @ w.T).reshape(*shape, -1), labels, old, adv, mask, config=cfg,
                                             backend="torch", inplace_backward=True, shift_labels=False, **stats)[0]
    if impl == "two_stage_materialised":
        return lambda h, w: two_stage(*logprob_entropy(h @ w.T, labels.reshape(-1), backend="torch", inplace_backward=True, shift_labels=False))
    if impl == "liger_grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")
        return lambda h, w: liger(h.reshape(*shape, -1), w, labels, mask, adv, old_per_token_logps=old)[0]
    if impl in ("one_pass_inplace", "one_pass_inplace_softcap"):
        head = dict(softcap=30.0, logit_scale=0.5) if impl.endswith("_softcap") else {}
        return lambda z: aepo_policy_loss(z.reshape(*shape, -1), labels, old, adv, mask, config=cfg, backend="torch",
                                          inplace_backward=True, shift_labels=False, **stats, **head)[0]
    if impl == "one_pass":
        return lambda z: aepo_policy_loss(z.reshape(*shape, -1), labels, old, adv, mask, config=cfg, backend="torch", shift_labels=False, **stats)[0]
    if impl == "two_stage_inplace":
        return lambda z: two_stage(*logprob_entropy(z, labels.reshape(-1), backend="torch", inplace_backward=True, shift_labels=False))
    if impl == "read":
        return lambda z: z.sum()
    if impl == "copy":
        return lambda z: z.clone()
    if impl == "copy_into":
        target = []

        def copy_into(z):
            if not target:
                target.append(torch.zeros_like(z))
            return target[0].copy_(z)

        return copy_into
    if impl == "gemm3":
        return gemm3
    if impl == "gemm3_chunked":
        from aepo_kernels.fused_linear import token_chunk_for_budget

        return lambda h, w: gemm3_chunked(h, w, token_chunk_for_budget(w.shape[0], budget))
    raise ValueError(f"impl {impl!r}")


@torch.no_grad()
def gemm3(h, w):
    """The 3 matmuls of the loss's gradient, nothing else: ``z [N, V]``, ``d_h [N, D]``, ``d_W [V, D]``."""
    z = h @ w.T
    return z @ w, z.T @ h


@torch.no_grad()
def gemm3_chunked(h, w, token_chunk: int):
    """:func:`gemm3` in token chunks, as the one-pass fused-linear loop does them (one reused block)."""
    d_h, d_w = torch.empty_like(h), torch.zeros_like(w)
    block = torch.empty(min(token_chunk, h.shape[0]), w.shape[0])
    for i0 in range(0, h.shape[0], token_chunk):
        rows = slice(i0, i0 + token_chunk)
        z = block[: h[rows].shape[0]]
        torch.mm(h[rows], w.T, out=z)
        torch.mm(z, w, out=d_h[rows])
        d_w.addmm_(z.T, h[rows])
    return d_h, d_w


def make_tensors(level: str, n: int, d: int, vocab: int, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(1)
    if level == "linear":
        hidden = torch.randn(n, d, generator=gen)
        weight = torch.randn(vocab, d, generator=gen) / d**0.5
        return [hidden.requires_grad_(requires_grad), weight.requires_grad_(requires_grad)]
    return [torch.randn(n, vocab, generator=gen) * 2]


def loss_backward(level: str, loss: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """The loss's own backward: into the leaves' ``.grad`` (linear: hidden and weight), or up to
    the non-leaf logits only (logits: what the lm_head's backward would receive next)."""
    if level == "linear":
        loss.backward()
    else:
        torch.autograd.grad(loss, tensors)


def warm_up(level: str, impl: str, base: list[torch.Tensor], chunk_bytes: int | None = None) -> None:
    """Compile the CPU kernels outside the timing, on the first WARM_UP_TOKENS rows of the timed
    tensors (the timed D and V: no compile-time specialisation is left for the timed call)."""
    if impl in NO_GRAD:
        return
    n, vocab = WARM_UP_TOKENS[level], base[-1].shape[0 if level == "linear" else -1]
    if level == "linear":
        tensors = [base[0][:n].detach().requires_grad_(), base[1]]
    else:
        tensors = [base[0][:n].clone().requires_grad_() * 1.0]
    loss_backward(level, make_loss_fn(impl, loss_inputs(n, vocab), chunk_bytes)(*tensors), tensors)
    if level == "linear":
        base[1].grad = None


def touch_and_free(like: torch.Tensor) -> None:
    """``--hot-pages``: allocate a buffer like ``like``, write it and free it just before a timed
    logits-level call.

    The cases that return a new [N, V] buffer (``one_pass``, ``copy``) fault its pages in inside
    the timing. On a VM whose balloon device reports freed guest memory to the host (virtio-balloon
    free page reporting, feature bit 5) the host takes the pages back: a later first touch then
    faults in the host too. The pages freed last are the ones the guest hands out next: those a
    trainer's steady state reuses, and all that bare metal has. The faults inside the guest stay in
    the timing. It helps at [4096, 151936] and adds noise at [1024, 151936] (the host's reclaim of
    the freed buffer then overlaps the call), so it is off by default; the figures:
    docs/benchmarks.md, "A new dlogits buffer at [4096, 151,936]"."""
    torch.empty_like(like).zero_()


def run_case(level: str, name: str, shape: str, warmup: int, repeats: int, hot_pages: bool = False) -> dict:
    """One case in this process: ``warmup + repeats`` timed calls; returns its row."""
    n, d, vocab = SHAPES[level][shape]
    setup, body, describe = prepare_case(level, name, shape, make_tensors(level, n, d, vocab), hot_pages)
    return describe(measure(setup, body, warmup=warmup, repeats=repeats))


def run_interleaved(level: str, names: list[str], shape: str, warmup: int, repeats: int,
                    hot_pages: bool = False) -> list[dict]:
    """Every case in this one process, one call of each in turn, ``warmup + repeats`` times;
    one row per case. For the cases that allocate a new [N, V] buffer per call (``one_pass``,
    ``copy``): a VM whose balloon device reports freed memory to the host (virtio-balloon free page
    reporting) makes a fresh 2.3 GiB buffer's cost depend on whether its pages were handed back
    meanwhile (several-fold, docs/benchmarks.md): with a subprocess per case that luck can differ
    between cases, taking turns spreads it over all of them alike. The cases share the input tensors."""
    if (problem := interleave_problem(names)) is not None:
        raise ValueError(problem)
    n, d, vocab = SHAPES[level][shape]
    base = make_tensors(level, n, d, vocab)
    cases = [prepare_case(level, name, shape, base, hot_pages) for name in names]
    samples: list[dict[str, list[float]]] = [{} for _ in names]
    peaks: list[list[int]] = [[] for _ in names]
    for i in range(warmup + repeats):
        for k, (setup, body, _) in enumerate(cases):
            row = measure(setup, body, warmup=0, repeats=1)
            if i < warmup:
                continue
            peaks[k].append(row["peak_bytes"])
            for key, values in row["samples"].items():
                samples[k].setdefault(key, []).extend(values)
    return [describe(dict(summarize_samples(samples[k], peaks[k]), interleaved=names))
            for k, (_, _, describe) in enumerate(cases)]


def interleave_problem(names: list[str]) -> str | None:
    """Why these cases cannot share one process (an environment suffix needs its own), or None."""
    suffixed = [name for name in names if case_env(name)]
    return f"--interleave runs every case in one process: {suffixed} need their own environment" if suffixed else None


def prepare_case(level: str, name: str, shape: str, base: list[torch.Tensor], hot_pages: bool = False):
    """``(setup, body, describe)`` of a case for :func:`harness.measure`, warmed up (compiled) on
    ``base`` (the level's tensors from :func:`make_tensors`); ``describe(row)`` adds the case's
    fields and rate to a measured row. ``hot_pages``: :func:`touch_and_free` before each call
    (logits level)."""
    n, d, vocab = SHAPES[level][shape]
    impl, chunk_bytes = split_budget(strip_env_suffix(name))  # the suffix travels in the environment
    if chunk_bytes is not None and (level != "linear" or impl not in BUDGETED):
        raise ValueError(f"{name!r}: a budget suffix applies to the linear level's {BUDGETED} only")
    fn = make_loss_fn(impl, loss_inputs(n, vocab), chunk_bytes)
    needs_grad = impl not in NO_GRAD
    if impl == "liger_grpo":
        # Liger's compiled chunk function fails to recompile for a second shape here (a dynamo
        # symbolic-shape assertion), so it is warmed up (compiled) at the timed shape instead.
        fn(*base).backward()
    else:
        warm_up(level, impl, base, chunk_bytes)
    if impl == "copy_into":
        fn(*base)  # its target buffer exists (and is touched) before the timing

    def setup():
        if level == "linear":
            for t in base:
                t.grad = None
            return base
        # logits: a fresh non-leaf each repeat (the in-place variants overwrite it); made before
        # the memory window opens, like a model's output would be.
        leaf = base[0].clone().requires_grad_(needs_grad)
        tensors = [leaf * 1.0 if needs_grad else leaf]
        if hot_pages:
            touch_and_free(base[0])
        return tensors

    def body(tensors):
        t0 = time.perf_counter()
        out = fn(*tensors)
        t1 = time.perf_counter()
        if needs_grad:
            loss_backward(level, out, tensors)
        return {"fwd_s": t1 - t0, "bwd_s": time.perf_counter() - t1}

    return setup, body, lambda row: describe_row(dict(row, hot_pages=hot_pages), level, name, impl, shape, chunk_bytes)


def describe_row(row: dict, level: str, name: str, impl: str, shape: str, chunk_bytes: int | None) -> dict:
    """A measured row with the case's fields and its rate (GFLOP/s or GB/s, see the module doc)."""
    from aepo_kernels import DEFAULT_CHUNK_BYTES, native

    n, d, vocab = SHAPES[level][shape]
    row.update(level=level, impl=name, shape=shape, n=n, d=d, vocab=vocab,
               chunk_bytes=DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes,
               cpu_chunk_elems=os.environ.get("AEPO_CPU_CHUNK_ELEMS", "sequence"),
               cpu_native=native.enabled())
    if level == "linear":
        matmuls = 4 if impl == "two_stage_fused_linear" else 3  # flops: matmuls x 2 N D V
        row["gflops"] = matmuls * 2 * n * d * vocab / row["total_s"] / 1e9
    else:
        # bytes: read + write for copy / in-place ... see module docstring
        native_row_kernel = native.enabled() and impl in ("one_pass", "one_pass_inplace")
        passes = {"read": 1, "copy": 2, "copy_into": 2}.get(impl, 2 if native_row_kernel else 3)
        row["gb_per_s"] = passes * n * vocab * 4 / row["total_s"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", choices=list(SHAPES), default="linear")
    parser.add_argument("--shape", default="mid")
    parser.add_argument("--impl", nargs="+")
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hot-pages", action="store_true", help="see touch_and_free (logits level)")
    parser.add_argument("--interleave", action="store_true",
                        help="run the cases in one subprocess, one call of each in turn (see run_interleaved)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--cases-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.level, args.case, args.shape, args.warmup, args.repeats, args.hot_pages)))
        return
    if args.cases_json:
        print(json.dumps({"rows": run_interleaved(args.level, json.loads(args.cases_json), args.shape, args.warmup,
                                                  args.repeats, args.hot_pages)}))
        return
    names = args.impl or IMPLS[args.level]
    common = ["--level", args.level, "--shape", args.shape, "--warmup", str(args.warmup),
              "--repeats", str(args.repeats)] + ["--hot-pages"] * args.hot_pages
    rows = []
    if args.interleave:
        if (problem := interleave_problem(names)) is not None:
            parser.error(problem)
        result = run_case_subprocess(Path(__file__), ["--cases-json", json.dumps(names), *common])
        cases = result["rows"] if "rows" in result else [result] * len(names)  # else: the error, for each
    else:
        cases = (run_case_subprocess(Path(__file__), ["--case", impl, *common], env=case_env(impl) or None)
                 for impl in names)
    for impl, row in zip(names, cases):
        row = {"impl": impl, **row, "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = write_rows(f"aepo_loss_{args.level}_cpu", rows)
    print(f"\nrows appended to {path}; {args.level} {args.shape} {SHAPES[args.level][args.shape]}, fp32, "
          f"median of {args.repeats}")
    rate = "gflops" if args.level == "linear" else "gb_per_s"
    print_table(rows, ["impl", "fwd_s", "bwd_s", "total_s", "total_min_s", "peak_bytes", rate, "loadavg_1m", "error"])


if __name__ == "__main__":
    main()
