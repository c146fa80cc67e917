"""examples/hf_loop.py, run as a user runs it (``python examples/hf_loop.py``): one AEPO step of a
tiny Hugging Face model with the fused loss. The example is the source of this test, so the code
docs/library.md points a user to is the code CI runs.

Checked from what it prints: the loss on logits summed over two micro-batches (with the step's
statistics from ``step_inputs``) equals the README's one call on the whole batch and the
fused-linear loss; the fused-linear gradient equals the logits one; every token count agrees;
the optimizer step moves every parameter; the advantages are centred within each group.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_loop.py"


@pytest.mark.slow
def test_hf_loop_example_runs_and_its_paths_agree():
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, env=dict(os.environ), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["logits_loss"] == pytest.approx(result["readme_loss"], rel=1e-5, abs=1e-7)
    assert result["fused_loss"] == pytest.approx(result["logits_loss"], rel=1e-5, abs=1e-7)
    assert result["logits_loss"] != 0.0
    assert result["max_relative_grad_gap"] < 1e-4
    assert result["tokens"] == result["step_tokens"] == result["readme_tokens"] > 0
    assert result["parameters_moved"] == result["parameters"] > 0
    advantages = result["advantages"]
    for group in range(0, len(advantages), 4):
        assert abs(sum(advantages[group:group + 4])) < 1e-5
    assert any(abs(a) > 0.1 for a in advantages)
