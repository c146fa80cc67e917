"""The Triton kernels compile for real GPUs (sm_80, sm_90, and sm_100 where the wheel ships
ptxas-blackwell) with no GPU: every specialisation the launchers produce -- each kernel launch,
logits dtype, soft cap on/off, V in {32000, 151936, 262144} with the GPU's BLOCK_V/num_warps, and
the dense / unaligned / int64-stride layouts, and the vocabulary-outer head's gradient-pass kernels
(aepo_kernels.triton_head) for the same dtypes, soft cap and layouts -- compiles without
local-memory traffic in its loops, within 255 registers and the target's shared memory
(aepo_kernels.triton_targets).

The matrix is compiled once per session in a subprocess without TRITON_INTERPRET (conftest sets
it, and the interpreter's kernels have no compiler front end); Triton's disk cache makes reruns
fast. A cold run took ~55 s on the 2-core CI machine before the head's kernels; with their 240
specialisations (every vocabulary and dtype), 345 s (225 s of CPU) on the 2-core machine under a
load average of 5-7, and 35 s warm (2026-12-07); so the head's kernels are compiled at one
vocabulary, in bf16 and fp32 (aepo_kernels.triton_targets.HEAD_VOCABS, HEAD_DTYPES)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from aepo_kernels import triton_head, triton_kernels, triton_targets  # noqa: E402
from aepo_kernels.triton_targets import (  # noqa: E402
    DTYPES, LAYOUTS, TARGETS, VOCABS, available_targets, occupancy_warps, problems,
)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return triton_targets.resource_rows()


def _label(row: dict) -> str:
    return (f"{row['launch']} {row['target']} {row['dtype']} softcap={row['softcap']} V={row['vocab']} "
            f"{row['layout']} BLOCK_V={row['block_v']} warps={row['num_warps']}")


def test_every_specialisation_compiles_within_the_limits(rows):
    failures = [f"{_label(r)}: {'; '.join(problems(r))}" for r in rows if not r.get("skipped") and problems(r)]
    assert not failures, "\n".join(failures)
    compiled = [r for r in rows if "registers" in r]
    assert compiled and all(0 < r["registers"] <= 255 and r["occupancy_warps_per_sm"] > 0 for r in compiled)


def test_the_matrix_covers_every_launch_and_target(rows):
    """Each (target, dtype, soft cap, V, layout) has a row for every launch of example_launches (the
    logits-level kernels' and the vocabulary-outer head's); sm_80/sm_90 are always compiled; the
    launch config is the GPU's (the subprocesses really ran without the interpreter)."""
    expected = {(t, d, s, v, lay) for t in TARGETS for d in DTYPES for s in (False, True) for v in VOCABS
                for lay in LAYOUTS}
    for key in expected:
        launches = set(triton_targets.example_launches(key[3], getattr(torch, key[1]), "dense", None))
        head = key[3] in triton_targets.HEAD_VOCABS and key[1] in triton_targets.HEAD_DTYPES
        assert bool({name for name in launches if name.startswith("head_")}) == head, key
        got = {r["launch"] for r in rows if (r["target"], r["dtype"], r["softcap"], r["vocab"], r["layout"]) == key}
        assert got == launches, key
    reasons = available_targets()
    assert reasons["sm_80"] is None and reasons["sm_90"] is None
    assert all(("skipped" in r) == (reasons[r["target"]] is not None) for r in rows)
    # the GPU's launch config, not this process's (the interpreter's) for the same vocabulary
    logits_rows = [r for r in rows if not r["launch"].startswith("head_")]
    assert all((r["block_v"], r["num_warps"]) != triton_kernels._launch_config(r["vocab"]) for r in logits_rows)
    head_rows = [r for r in rows if r["launch"].startswith("head_")]
    gpu_blocks = {tuple(b) for blocks in triton_head.GPU_BLOCKS.values() for b in blocks.values()}
    assert head_rows and all((r["block_t"], r["block_v"], r["block_d"], r["num_warps"]) in gpu_blocks
                             for r in head_rows)


def test_every_kernel_of_the_module_has_an_example_launch():
    """A new ``*_kernel`` must be added to example_launches, or it is never compiled for a GPU."""
    kernels = {name for name in dir(triton_kernels) if name.endswith("_kernel")}
    launched = {launch.kernel for launch in triton_kernels.example_launches(
        torch.empty(1, 2, 8, device="meta"), None).values()}
    assert kernels and {name for name in kernels if getattr(triton_kernels, name) in launched} == kernels
    # and the head's (aepo_kernels.triton_head), through aepo_kernels.triton_targets.example_launches
    head_kernels = {name for name in dir(triton_head) if name.endswith("_kernel")}
    head_launched = {launch.kernel for launch in triton_targets.example_launches(
        triton_targets.HEAD_VOCABS[0], torch.bfloat16, "dense", None).values()}
    assert head_kernels == {"_head_dlogits_kernel", "_head_dweight_kernel", "_head_dhidden_kernel"}
    assert {name for name in head_kernels if getattr(triton_head, name) in head_launched} == head_kernels


def test_occupancy_hand_worked():
    sm80, sm90 = TARGETS["sm_80"], TARGETS["sm_90"]
    # 48 registers: 48 x 32 = 1536 per warp (a multiple of 256); 65536 / (1536 x 8) = 5 blocks of 8 warps
    assert occupancy_warps(sm90, 48, 1056, 8) == 40
    # 80: 2560 per warp, 65536 / 20480 = 3 blocks -> 24 warps; 255: 8160 -> 8192, one block -> 8 warps
    assert occupancy_warps(sm90, 80, 0, 8) == 24 and occupancy_warps(sm90, 255, 0, 8) == 8
    # shared memory bound on sm_80: 164 KiB / (40000 + 1024 reserved) = 4 blocks of 4 warps
    assert occupancy_warps(sm80, 32, 40000, 4) == 16
    # warps bound: 64 / 8 = 8 blocks at 16 registers -> all 64 warps
    assert occupancy_warps(sm90, 16, 0, 8) == 64


def test_problems_rules():
    row = {"target": "sm_90", "registers": 64, "spill_bytes": 0, "stack_bytes": 8, "local_in_loops": 0,
           "shared_bytes": 1056}
    assert problems(row) == []  # a small stack slot outside the loops passes
    assert "inside a loop" in problems({**row, "local_in_loops": 2})[0]
    assert "stack" in problems({**row, "stack_bytes": 24})[0]
    assert "registers" in problems({**row, "registers": 256})[0]
    assert "shared memory" in problems({**row, "shared_bytes": 227 * 1024 + 1})[0]
    assert problems({"error": "boom"}) == ["compile error: boom"]


SPILLING_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def spilling_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """BLOCK fp32 accumulators over one warp: BLOCK / 32 values per thread, far over 255 registers."""
    o = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(n):
        acc = acc * 1.0001 + tl.load(x_ptr + i * BLOCK + o)
    tl.store(out_ptr + o, acc)
'''


def test_a_kernel_that_spills_in_its_loop_fails(tmp_path):
    """The check can fail: a kernel holding 512 fp32 values per thread across its loop spills there."""
    (tmp_path / "spilling.py").write_text(SPILLING_KERNEL)
    script = textwrap.dedent("""
        import json, torch
        from spilling import spilling_kernel
        from aepo_kernels.triton_kernels import Launch
        from aepo_kernels.triton_targets import compile_launch, problems
        x = torch.empty(1 << 20, device="meta")
        launch = Launch(spilling_kernel, (1,), (x, x, 7), dict(BLOCK=16384, num_warps=1))
        row = {"target": "sm_90", **compile_launch(launch, "sm_90")}
        print(json.dumps({"row": row, "problems": problems(row)}))
    """)
    package_parent = Path(triton_kernels.__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(package_parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["row"]["local_in_loops"] > 0 and any("inside a loop" in p for p in result["problems"])
