"""The Triton kernels compiled for real GPU targets without a GPU, and the resources they use.

Triton's compiler and the ``ptxas`` shipped in its wheel compile a kernel for a named target
(``GPUTarget("cuda", 90, 32)``: an H100/H200) on any machine; the shipped ``cuobjdump
--dump-resource-usage`` reads registers, local memory (spills) and static shared memory from the
cubin. This module compiles **every specialisation the launchers produce** and reports one row per
(kernel, target, logits dtype, soft cap, vocabulary, layout):
- the launches are :func:`aepo_kernels.triton_kernels.example_launches` and, for the
  vocabulary-outer head's gradient pass, :func:`aepo_kernels.triton_head.example_launches`
  (:func:`example_launches` here), built by the launchers' own argument builders on ``meta``
  tensors (no memory), so the signature is the launchers';
- the signature, constexprs and alignment attributes come from Triton's own binder
  (``create_function_from_signature`` and ``JITFunction._pack_args``: what ``kernel[grid](...)``
  runs before it compiles), with the ``@triton.heuristics`` values applied as at launch. These are
  Triton internals, checked against Triton 3.7.1 (the pinned version);
- layouts: ``dense`` ``[1, 2, V]``; ``unaligned``, the view ``[:, 1:, :V]`` of a ``[1, 3, V + 1]``
  buffer (row start and stride not multiples of 16: Triton specialises on that); ``int64``, a
  ``[2, 2^17, V]`` batch whose batch stride is >= 2^31 (an i64 argument). ``BLOCK_V`` and
  ``num_warps`` are those :func:`aepo_kernels.triton_kernels._launch_config` picks on a GPU. The
  head's launches take the same layouts for hidden states and weight (D = 5,120; unaligned: views
  of ``[., D + 1]`` buffers; int64: ``V x D >= 2^31``) and ``aepo_kernels.triton_head.GPU_BLOCKS``.

A row fails (:func:`problems`) on a compile error, any local-memory load or store inside a loop
of the SASS (a spill in the sweeps), more than :data:`MAX_STACK_BYTES` of local memory, more
than 255 registers, or shared memory over the target's per-block limit. (ptxas at times keeps a
per-row integer in a 4-8 byte stack slot across the statistics sweep -- one store and one load
per row -- and which specialisations get one moves with small code changes; cuobjdump reports
such spills as ``STACK``, not ``LOCAL``.) Occupancy is in resident warps per SM from registers
and shared memory (:func:`occupancy_warps`).

Under ``TRITON_INTERPRET=1`` (the tests) the ``@triton.jit`` objects are interpreter wrappers
with no compiler front end, and the variable is read when the kernels module is imported, so
:func:`resource_rows` then runs this module in subprocesses without it (one per target). Compiled kernels are
cached by Triton on disk (``~/.triton/cache``) and by specialisation within a process.

    python -m aepo_kernels.triton_targets            # JSON rows on stdout
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .triton_kernels import LOGITS_DTYPES

VOCABS = (32000, 151936, 262144)
DTYPES = tuple(str(dtype).removeprefix("torch.") for dtype in LOGITS_DTYPES)
LAYOUTS = ("dense", "unaligned", "int64")
# The head's gradient-pass kernels at one vocabulary and without fp16: V is a runtime argument of
# theirs (every vocabulary compiles the same specialisations), and fp16 compiles as bf16 does
# (2-byte operands, fp32 accumulators; the full matrix, fp16 and every vocabulary included, was
# compiled once on 2026-12-07 with no spill in any: docs/head.md's table). With all of it the
# matrix took 345 s cold on the 2-core machine, and CI compiles it cold.
HEAD_VOCABS = (151936,)
HEAD_DTYPES = ("bfloat16", "float32")
MAX_REGISTERS = 255  # per thread, every target here
# Local memory allowed outside the loops: ptxas at times keeps one or two per-row integers (the
# row index) in the stack frame across the statistics sweep -- one 4-8 byte store and load per
# row of V elements, nothing next to the row's bytes. Inside a loop, no local traffic is allowed.
MAX_STACK_BYTES = 16


@dataclass(frozen=True)
class TargetLimits:
    """Per-SM limits of a compute capability (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability"; the 1 KiB reserved per block from its shared memory
    section for 8.x and later)."""

    capability: int
    registers_per_sm: int = 65536
    register_unit: int = 256  # registers are allocated per warp in units of 256
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    shared_per_sm: int = 228 * 1024
    shared_per_block: int = 227 * 1024
    shared_reserved_per_block: int = 1024


TARGETS = {
    "sm_80": TargetLimits(80, shared_per_sm=164 * 1024, shared_per_block=163 * 1024),  # A100
    "sm_90": TargetLimits(90),  # H100, H200
    "sm_100": TargetLimits(100),  # B200 (compiled with the wheel's ptxas-blackwell)
}


def occupancy_warps(limits: TargetLimits, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident warps per SM of a kernel with ``registers`` per thread, ``shared_bytes`` per block
    and ``num_warps`` per block: blocks per SM limited by warps, blocks, registers (per-warp
    allocation rounded up to the unit) and shared memory (plus the reserved KiB), times warps."""
    per_warp = -(-max(registers, 1) * 32 // limits.register_unit) * limits.register_unit
    blocks = min(limits.max_blocks_per_sm, limits.max_warps_per_sm // num_warps,
                 limits.registers_per_sm // (per_warp * num_warps),
                 limits.shared_per_sm // (shared_bytes + limits.shared_reserved_per_block))
    return blocks * num_warps


def problems(row: dict) -> list[str]:
    """Why a row fails: a compile error, local memory traffic inside a loop (a spill in the sweeps
    over the vocabulary costs bytes per element), a stack frame over :data:`MAX_STACK_BYTES`, more
    than 255 registers, or shared memory over the target's per-block limit."""
    if row.get("error"):
        return [f"compile error: {row['error']}"]
    found = []
    if row["local_in_loops"]:
        found.append(f"{row['local_in_loops']} local-memory loads/stores inside a loop (spills in the sweeps)")
    if row["spill_bytes"] + row["stack_bytes"] > MAX_STACK_BYTES:
        found.append(f"local memory: {row['spill_bytes']} B + {row['stack_bytes']} B stack > {MAX_STACK_BYTES} B")
    if row["registers"] > MAX_REGISTERS:
        found.append(f"{row['registers']} registers > {MAX_REGISTERS}")
    limit = TARGETS[row["target"]].shared_per_block
    if row["shared_bytes"] > limit:
        found.append(f"{row['shared_bytes']} B shared memory > {limit} B")
    return found


# ---------------------------------------------------------------------------------------------
# Compiling one launch for one target.


def _nvidia_tool(name: str) -> str | None:
    """Path of a tool shipped in Triton's wheel (``backends/nvidia/bin``), or None."""
    from triton import knobs

    tool = getattr(knobs.nvidia, name.replace("-", "_"))
    path = tool.path if tool is not None else None
    return path if path and os.path.exists(path) else None


def available_targets() -> dict[str, str | None]:
    """Target -> None when it can be compiled here, else the reason (sm_100 needs ptxas-blackwell)."""
    reasons = {}
    for name, limits in TARGETS.items():
        tool = "ptxas-blackwell" if limits.capability >= 100 else "ptxas"
        reasons[name] = None if _nvidia_tool(tool) else f"Triton's wheel ships no {tool}"
    return reasons


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    cuobjdump = _nvidia_tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("Triton's wheel ships no cuobjdump (triton/backends/nvidia/bin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, *flags, f.name], capture_output=True, text=True, check=True).stdout


def local_accesses(sass: str) -> tuple[int, int]:
    """``(all, inside loops)`` of the local-memory loads/stores (``LDL``/``STL``) in SASS text; an
    instruction is inside a loop when it lies between a backward branch's target and the branch."""
    local, loops = [], []
    for address, opcode, operands in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)\s*([^;]*);", sass):
        at, base = int(address, 16), opcode.split(".")[0]
        if base in ("LDL", "STL"):
            local.append(at)
        elif base == "BRA" and (target := re.search(r"0x([0-9a-f]+)", operands)) and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    return len(local), sum(any(lo <= at <= hi for lo, hi in loops) for at in local)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """One kernel's cubin through the wheel's ``cuobjdump --dump-resource-usage``:
    ``{"REG": .., "STACK": .., "SHARED": .., "LOCAL": .., ...}``, plus ``local_accesses`` and
    ``local_in_loops`` (:func:`local_accesses`) from its SASS -- disassembled only when the
    kernel has local memory (a stack frame or LOCAL), since otherwise there are none (and the
    disassembly costs half a second)."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    line = next((ln for ln in out.splitlines() if "REG:" in ln), None)
    if line is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{out[-1000:]}")
    usage = {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}
    has_local = usage["STACK"] or usage["LOCAL"]
    usage["local_accesses"], usage["local_in_loops"] = local_accesses(_cuobjdump(cubin, "-sass")) if has_local else (0, 0)
    return usage


_COMPILED: dict[tuple, dict] = {}


def compile_launch(launch, target: str) -> dict:
    """Compiles ``launch`` (a :class:`aepo_kernels.triton_kernels.Launch`) for ``target`` as its
    launch would, and returns its resources: registers, spill/stack bytes, shared bytes (static
    from the cubin + Triton's dynamic allocation), the signature. Cached per specialisation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.autotuner import Heuristics
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel, kwargs = launch.kernel, dict(launch.meta)
    while isinstance(kernel, Heuristics):  # as Heuristics.run: derived constexprs from the arguments
        for name, rule in kernel.values.items():
            kwargs[name] = rule({**dict(zip(kernel.arg_names, launch.args)), **kwargs})
        kernel = kernel.fn
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel!r} is not a JITFunction: import the kernels without TRITON_INTERPRET=1")
    gpu = GPUTarget("cuda", TARGETS[target].capability, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    key = (kernel.fn.__qualname__, target, str(specialization), str(sorted(options.items())))
    if key in _COMPILED:
        return {**_COMPILED[key], "cached": True}
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__)
    usage = resource_usage(compiled.asm["cubin"])
    _COMPILED[key] = {
        "registers": usage["REG"], "spill_bytes": usage["LOCAL"], "stack_bytes": usage["STACK"],
        "local_accesses": usage["local_accesses"], "local_in_loops": usage["local_in_loops"],
        "shared_bytes": usage["SHARED"] + compiled.metadata.shared,
        "signature": ",".join(f"{t}{a or ''}" for t, a in specialization if t != "constexpr"),
        "compile_s": time.perf_counter() - start,
    }
    return {**_COMPILED[key], "cached": False}


# ---------------------------------------------------------------------------------------------
# The matrix.


def example_logits(vocab: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """Meta logits ``[B, T, V]`` of a :data:`LAYOUTS` layout (module docstring)."""
    if layout == "dense":
        return torch.empty(1, 2, vocab, dtype=dtype, device="meta")
    if layout == "unaligned":
        return torch.empty(1, 3, vocab + 1, dtype=dtype, device="meta")[:, 1:, :vocab]
    if layout == "int64":
        return torch.empty(2, 1 << 17, vocab, dtype=dtype, device="meta")
    raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")


def _kernel_name(kernel) -> str:
    while not hasattr(kernel, "__name__") and hasattr(kernel, "fn"):  # heuristics wrappers
        kernel = kernel.fn
    return kernel.__name__


def example_launches(vocab: int, dtype: torch.dtype, layout: str, tanh_scale: float | None) -> dict:
    """Every launch compiled for one (dtype, soft cap, V, layout): the logits-level kernels'
    (:func:`aepo_kernels.triton_kernels.example_launches` on :func:`example_logits`) and the
    vocabulary-outer head's (:func:`aepo_kernels.triton_head.example_launches`: hidden states and
    a ``[V, D]`` weight of that dtype and layout)."""
    from . import triton_head, triton_kernels

    logits = example_logits(vocab, dtype, layout)
    launches = triton_kernels.example_launches(logits, tanh_scale)
    if vocab in HEAD_VOCABS and str(dtype).removeprefix("torch.") in HEAD_DTYPES:
        launches.update(triton_head.example_launches(vocab, dtype, layout, tanh_scale))
    return launches


def _rows_here(targets, vocabs, dtypes, layouts) -> list[dict]:

    reasons = available_targets()
    rows = []
    for target in targets:
        for dtype in dtypes:
            for softcap in (False, True):
                for vocab in vocabs:
                    for layout in layouts:
                        launches = example_launches(vocab, getattr(torch, dtype), layout, 0.5 if softcap else None)
                        for name, launch in launches.items():
                            row = {"kernel": _kernel_name(launch.kernel), "launch": name, "target": target,
                                   "dtype": dtype, "softcap": softcap,
                                   "vocab": vocab, "layout": layout, "block_v": launch.meta["BLOCK_V"],
                                   "num_warps": launch.meta["num_warps"]}
                            row.update({key.lower(): launch.meta[key] for key in ("BLOCK_T", "BLOCK_D")
                                        if key in launch.meta})
                            if reasons[target]:
                                rows.append({**row, "skipped": reasons[target]})
                                continue
                            try:
                                row.update(compile_launch(launch, target))
                            except Exception as exc:  # noqa: BLE001 -- a compile error is a failing row
                                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                                continue
                            row["occupancy_warps_per_sm"] = occupancy_warps(
                                TARGETS[target], row["registers"], row["shared_bytes"], row["num_warps"])
                            row["max_warps_per_sm"] = TARGETS[target].max_warps_per_sm
                            rows.append(row)
    return rows


def resource_rows(targets=tuple(TARGETS), vocabs=VOCABS, dtypes=DTYPES, layouts=LAYOUTS) -> list[dict]:
    """One row per (target, dtype, soft cap, vocab, layout, kernel launch): the launch config and
    the compiled resources, ``error`` on a compile failure, ``skipped`` for a target this wheel
    cannot compile. Under ``TRITON_INTERPRET`` it runs in subprocesses without it, one per
    target, up to the number of CPUs at a time (compiling is single-threaded)."""
    from triton import knobs

    if not knobs.runtime.interpret and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return _rows_here(targets, vocabs, dtypes, layouts)
    # The directory holding this copy of the package (``.shim`` when it is a symlinked checkout).
    package_parent = str(Path(sys.modules[__package__].__file__).parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([package_parent, *filter(None, [env.get("PYTHONPATH")])])
    common = ["--vocabs", *map(str, vocabs), "--dtypes", *dtypes, "--layouts", *layouts]
    pending, rows = list(targets), {}
    running: list[tuple[str, subprocess.Popen, tempfile.TemporaryFile]] = []
    while pending or running:
        while pending and len(running) < max(1, os.cpu_count() or 1):
            target = pending.pop(0)
            cmd = [sys.executable, "-m", f"{__package__}.triton_targets", "--targets", target, *common]
            out = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the compiles
            running.append((target, subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True), out))
        target, proc, out = running.pop(0)
        _, stderr = proc.communicate(timeout=1800)
        out.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling for {target} failed:\n{stderr[-4000:]}")
        rows[target] = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        out.close()
    return [row for target in targets for row in rows[target]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--vocabs", nargs="+", type=int, default=list(VOCABS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    for row in resource_rows(args.targets, args.vocabs, args.dtypes, args.layouts):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
