"""CPU benchmark: the first loss call of a process, with empty caches and with warm ones.

The first call builds the native C row kernel (``$AEPO_NATIVE_CACHE``) and compiles the torch
paths it needs (inductor, ``$TORCHINDUCTOR_CACHE_DIR``); later calls, and later processes with the
same caches, reuse both. Each case runs twice in fresh subprocesses over one pair of cache
folders made for it: ``cold`` (the folders empty), then ``warm`` (filled by the cold run). Per
run: the first call's and the second call's wall time (``aepo_policy_loss`` forward + backward on
``[2, 64, V]`` logits) and the process's CPU time.

Cases: ``one_pass_fp32`` (entropy statistics supplied, fp32: the C kernel only),
``two_phase_fp32`` (no statistics: the C kernel and the compiled entropy pass),
``one_pass_bf16`` (bf16 logits: the compiled row path).

    python bench/bench_first_call.py
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, print_table, run_case_subprocess, write_rows  # noqa: E402

CASES = ["one_pass_fp32", "two_phase_fp32", "one_pass_bf16"]


def run_case(case: str, vocab: int) -> dict:
    t0 = time.perf_counter()
    import torch

    from aepo_kernels import LossConfig, aepo_policy_loss

    imported = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    labels = torch.randint(0, vocab, (2, 64), generator=gen)
    old, adv, mask = -torch.rand(2, 64, generator=gen) * 9, torch.randn(2, generator=gen), torch.ones(2, 64)
    stats = {} if case.startswith("two_phase") else dict(entropy_mean=torch.tensor(9.0), entropy_std=torch.tensor(0.5))
    times = []
    for _ in range(2):
        logits = torch.randn(2, 64, vocab, generator=gen).to(dtype).requires_grad_()
        t = time.perf_counter()
        loss, _ = aepo_policy_loss(logits, labels, old, adv, mask, shift_labels=False, config=LossConfig(),
                                   backend="torch", **stats)
        loss.backward()
        times.append(time.perf_counter() - t)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # the C compiler, inductor's compile workers
    return {"import_s": imported, "first_call_s": times[0], "second_call_s": times[1], "cpu_s": time.process_time(),
            "children_cpu_s": children.ru_utime + children.ru_stime, "load_1min": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_json:
        print(json.dumps(run_case(**json.loads(args.case_json))))
        return
    info, rows = machine(), []
    for case in args.case:
        with tempfile.TemporaryDirectory() as native, tempfile.TemporaryDirectory() as inductor:
            env = {"AEPO_NATIVE_CACHE": native, "TORCHINDUCTOR_CACHE_DIR": inductor}
            for caches in ("cold", "warm"):
                row = run_case_subprocess(Path(__file__), ["--case-json", json.dumps({"case": case, "vocab": args.vocab})],
                                          env=env)
                rows.append({"case": case, "caches": caches, "vocab": args.vocab, **row})
    write_rows("first_call_cpu", rows, info)
    print_table(rows, ["case", "caches", "import_s", "first_call_s", "second_call_s", "cpu_s", "children_cpu_s",
                      "load_1min"])


if __name__ == "__main__":
    main()
