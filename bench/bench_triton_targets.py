"""Resources of the Triton kernels compiled for real GPUs, no GPU needed (aepo_kernels.triton_targets).

Compiles every specialisation the launchers produce for sm_80 (A100), sm_90 (H100/H200) and
sm_100 (B200, with the wheel's ptxas-blackwell) and writes one row per (launch, target, logits
dtype, soft cap, layout) to ``bench/results/triton_targets.jsonl``, with the machine, date and
commit: registers per thread, local memory (LOCAL, stack frame, local loads/stores and how many
sit inside loops), shared memory per block, the launch config (BLOCK_V, num_warps) and the
occupancy in resident warps per SM. The vocabularies that compile to the same specialisation
(same signature and launch config) share a row (``vocabs``).

``--markdown`` also prints the summary table of docs/gpu.md: per kernel, target, dtype and soft cap,
the range over layouts and launch variants (dlogits into a new buffer or in place).

    python bench/bench_triton_targets.py --markdown
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine, write_rows  # noqa: E402

from aepo_kernels.triton_targets import TARGETS, problems, resource_rows  # noqa: E402

# Fields of a compiled row that identify its specialisation (the vocabulary is folded in).
_SAME = ("launch", "target", "dtype", "softcap", "layout", "signature", "block_v", "num_warps")
_DROP = ("cached", "compile_s", "vocab")


def fold_vocabs(rows: list[dict]) -> list[dict]:
    """Rows that differ only in ``vocab`` -> one row with ``vocabs`` (in order of appearance)."""
    folded: dict[tuple, dict] = {}
    for row in rows:
        key = tuple(row.get(k) for k in _SAME) + (row.get("error"), row.get("skipped"))
        if key in folded:
            folded[key]["vocabs"].append(row["vocab"])
            continue
        folded[key] = {**{k: v for k, v in row.items() if k not in _DROP}, "vocabs": [row["vocab"]]}
        folded[key]["problems"] = [] if row.get("skipped") else problems(row)
    return list(folded.values())


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def markdown(rows: list[dict]) -> str:
    """The docs table: one line per (kernel, target, dtype, soft cap), ranges over layouts and launches."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "registers" in row:
            groups.setdefault((row["kernel"], row["target"], row["dtype"], row["softcap"]), []).append(row)
    lines = ["| kernel | target | dtype | soft cap | V | BLOCK_V / warps | registers | stack B (spill) | "
             "local ld/st in loops | shared B | warps/SM (of 64) | pass |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (kernel, target, dtype, softcap), group in groups.items():
        vocabs = sorted({v for r in group for v in r["vocabs"]})
        configs = sorted({(r["block_v"], r["num_warps"]) for r in group})
        lines.append(
            f"| `{kernel.strip('_')}` | {target} | {dtype} | {'on' if softcap else 'off'} | "
            f"{', '.join(map(str, vocabs))} | {', '.join(f'{b} / {w}' for b, w in configs)} | "
            f"{_span([r['registers'] for r in group])} | {_span([r['stack_bytes'] + r['spill_bytes'] for r in group])} | "
            f"{sum(r['local_in_loops'] for r in group)} | {_span([r['shared_bytes'] for r in group])} | "
            f"{_span([r['occupancy_warps_per_sm'] for r in group])} | "
            f"{'yes' if not any(r['problems'] for r in group) else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--markdown", action="store_true", help="print the docs/gpu.md summary table")
    parser.add_argument("--results", default="triton_targets", help="results file name under bench/results ('' = none)")
    args = parser.parse_args()
    rows = fold_vocabs(resource_rows(tuple(args.targets)))
    if args.results:
        print(f"wrote {len(rows)} rows to {write_rows(args.results, rows)}", file=sys.stderr)
    info = machine()
    failing = [r for r in rows if r["problems"] or r.get("error")]
    print(f"{len(rows)} specialisations, {len(failing)} failing; {info['date']} commit {info['commit']} on {info['cpu']}")
    for row in failing:
        print(f"FAIL {row['launch']} {row['target']} {row['dtype']} softcap={row['softcap']} {row['layout']}: "
              f"{'; '.join(row['problems'])}")
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
