"""World-size invariance: one update on 2 FSDP2 ranks (gloo, CPU) == the same update in 1 process.

The 2-rank run also cuts micro-batches by a token budget (ranks then run different numbers of
real micro-batches, padded to the same count), recomputes activations (checkpointing under FSDP2)
and gets odd mini-batches (masked filler rows), so it checks the global token count, the
all-reduced entropy statistics, the loss scaling that undoes FSDP2's gradient averaging, the
strided row gather of ``compute_logprobs``, the full state dict's HF names and a
CheckpointManager save of the sharded worker together. Takes ~30-60 s (two fresh interpreters;
more on a loaded machine); AEPO_DIST_TESTS=0 skips it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from runs import dist_tests, launch_torchrun

SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "policy_update.py"

pytestmark = dist_tests


def run_torchrun(model_dir: Path, out: Path, *flags: str) -> None:
    launch_torchrun([str(SCRIPT), str(model_dir), str(out), *flags])
    assert out.is_file(), f"{SCRIPT.name} wrote no {out}"


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    from aepo_engine.models import build_tiny_qwen3

    sys.path.insert(0, str(SCRIPT.parent))
    from policy_update import run

    model_dir = Path(build_tiny_qwen3(tmp_path / "model", vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.3))
    run_torchrun(model_dir, tmp_path / "two.pt", "--max-tokens=30", "--activation-checkpointing")
    run(str(model_dir), str(tmp_path / "one.pt"))  # in this process: world size 1, no FSDP
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world_size"], one["fsdp"], two["world_size"], two["fsdp"]) == (1, False, 2, True)

    torch.testing.assert_close(two["logprobs"], one["logprobs"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(two["entropy"], one["entropy"], rtol=1e-5, atol=2e-5)
    m1, m2 = one["metrics"], two["metrics"]
    assert m1["optimizer_steps"] == m2["optimizer_steps"] == 3 and m1["tokens"] == m2["tokens"]
    for key in ("loss", "grad_norm", "entropy", "ratio", "clipfrac_low", "clipfrac_high"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # the counterfactual shares (training.counterfactual): all-reduced sums, the same on any world size
    counterfactual = sorted(k for k in m1 if k.startswith("cf/"))
    assert counterfactual and counterfactual == sorted(k for k in m2 if k.startswith("cf/"))
    for key in counterfactual:
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert set(one["state"]) == set(two["state"]) == set(initial)  # HF names, full tensors
    gap = max((one["state"][k] - two["state"][k]).abs().max().item() for k in initial)
    step = max((one["state"][k] - initial[k]).abs().max().item() for k in initial)
    assert step > 1e-3 and gap < 5e-5 * step, (gap, step)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "two.pt_ckpt" / "step_000001" / "hf_model")
    assert all(torch.equal(v, two["state"][k]) for k, v in exported.state_dict().items())


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process_with_lora(tmp_path):
    """policy.lora under FSDP2: the adapters are sharded with their layers (the base weights read
    from the checkpoint under their base names, every rank given the same initial adapter), two
    updates on 2 ranks equal them in 1 process, the base weights do not move, and the checkpoint's
    merged export equals the adapted model."""
    from transformers import AutoModelForCausalLM

    from aepo_engine.models import build_tiny_qwen3
    from aepo_engine.models.lora import is_adapter, merged_state

    sys.path.insert(0, str(SCRIPT.parent))
    from policy_update import run

    model_dir = Path(build_tiny_qwen3(tmp_path / "model", vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.3))
    run_torchrun(model_dir, tmp_path / "two.pt", "--max-tokens=30", "--lora")
    run(str(model_dir), str(tmp_path / "one.pt"), lora=True)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["fsdp"], two["fsdp"]) == (False, True)
    m1, m2 = one["metrics"], two["metrics"]
    for key in ("loss", "grad_norm", "entropy", "ratio"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    adapters = sorted(k for k in one["state"] if is_adapter(k))
    assert adapters and set(one["state"]) == set(two["state"])
    gap = max((one["state"][k] - two["state"][k]).abs().max().item() for k in one["state"])
    moved = max((one["state"][k].abs()).max().item() for k in adapters if ".lora_B." in k)
    assert moved > 1e-3 and gap < 5e-5 * moved, (gap, moved)
    frozen = {k.replace(".base_layer.", "."): v for k, v in two["state"].items() if not is_adapter(k)}
    assert all(torch.equal(frozen[k], v) for k, v in initial.items())  # the base weights did not move
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "two.pt_ckpt" / "step_000001" / "hf_model")
    merged = merged_state(two["state"], 2.0)
    assert all(torch.equal(v, merged[k]) for k, v in exported.state_dict().items())
