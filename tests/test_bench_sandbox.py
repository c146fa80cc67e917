"""bench/bench_sandbox.py keeps working: its percentile is hand-checked and one tiny case runs
through the real sandbox (skipped, with the reason, where bwrap cannot sandbox)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_percentile_is_nearest_rank():
    sys.path.insert(0, str(BENCH))
    from bench_sandbox import percentile

    values = [float(v) for v in range(1, 21)]  # 1..20: p95 is the 19th value, p50 the 10th
    assert percentile(values, 0.95) == 19.0 and percentile(values, 0.5) == 10.0
    assert percentile(list(reversed(values)), 1.0) == 20.0 and percentile([3.0], 0.95) == 3.0


@pytest.mark.slow
@pytest.mark.sandbox
def test_bench_sandbox_smoke():
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sandbox.py"), "--cases", "print",
                           "--repeats", "2", "--warmup", "0", "--no-write", "--label", "smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = proc.stdout.splitlines()
    assert table[0].split()[:4] == ["label", "case", "median_ms", "p95_ms"]
    row = table[1].split()
    assert row[:2] == ["smoke", "print"] and float(row[2]) > 0 and row[-1] == "-"  # no error
