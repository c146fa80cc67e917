"""The GPU check script keeps working: its --smoke mode runs the same code on CPU tiny shapes."""
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_gpu_check_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu_check_smoke.jsonl").read_text().splitlines()]
    check = next(r for r in rows if r.get("check") == "logprob_entropy")
    assert check["max_abs_logp"] < 1e-4 and check["max_rel_dlogits"] < 2e-2
    assert {r.get("impl") for r in rows} >= {"triton", "triton_inplace", "naive_eager", "naive_compiled"}
