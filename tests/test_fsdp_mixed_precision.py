"""bf16 FSDP2 keeps the loss inputs fp32 (issue 35, point 1).

The FSDP root's forward receives the :class:`LossInputs`; FSDP2's default
``cast_forward_inputs=True`` walks that dataclass and rounds every floating tensor to
``param_dtype``: with bf16 the old log-probs, advantages, entropy statistics and the global token
count (425 -> 424) arrived rounded, and an on-policy step's ratio was 1.000126 instead of 1 on
this test's batch. Two gloo ranks, ``param_dtype = bfloat16``: what the loss receives inside the
forward is fp32 and bit-equal to what the worker handed the root, the count is the host's exact
one, and the on-policy ratio is 1 within 1e-6 (the log-probs of both passes come from the same
bf16 logits, in fp32). The same for tree batches (``policy.tree_batches=on``: the
:class:`TreeLossInputs` pass the same root forward). ~30 s each; AEPO_DIST_TESTS=0 skips them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runs import dist_tests, launch_torchrun

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "bf16_loss_inputs.py"

pytestmark = dist_tests


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rows", "trees"])
def test_bf16_fsdp_loss_inputs_stay_fp32_and_the_on_policy_ratio_is_one(tmp_path, layout):
    from aepo_engine.models import build_tiny_qwen3

    model_dir = build_tiny_qwen3(tmp_path / "model", vocab_size=300, hidden_size=64, intermediate_size=128,
                                 num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.3)
    launch_torchrun([str(SCRIPT), str(model_dir), str(tmp_path / "out.pt"), layout])
    for rank in (0, 1):
        record = torch.load(tmp_path / f"out.pt.rank{rank}")
        assert len(record["built"]) == len(record["received"]) > 0
        for built, received in zip(record["built"], record["received"]):
            for name, value in built.items():
                assert value.dtype == torch.float32, name
                assert received[name].dtype == torch.float32, (name, received[name].dtype)
                assert torch.equal(received[name], value), name
        (count,) = record["counts"]  # one mini-batch: the exact global token count, > 256
        assert count > 256 and all(r["global_token_count"].item() == count for r in record["received"])
        metrics = record["metrics"]
        assert metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["clipfrac_high"] == metrics["clipfrac_low"] == 0.0
