"""The sharded load (meta model, FSDP2 shards filled from safetensors) and the head's matmul dtypes.

- ``SafetensorsCheckpoint.read_rows`` against the ``safetensors`` package on every dtype and shape.
- Two FSDP2 ranks (gloo): every parameter after the sharded load is bit-identical to today's whole
  ``from_pretrained`` load (tied and untied heads, a bf16 checkpoint in several files, odd sizes so
  that shards are uneven), buffers included; and a bf16 FSDP2 update runs no fp32 matmul with a
  vocabulary-sized operand (issue 25).
- One process, autocast bf16 (no FSDP): the same matmul check, and the update within bf16
  tolerance of the fp32 one.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from matmul_dtypes import MatmulDtypes
from runs import REPO, dist_tests, launch_torchrun
from test_policy_worker import SGD_LIKE, make_worker, random_batch, vocab_of

from aepo_engine.training.loading import SafetensorsCheckpoint, build_meta_model, load_sharded_weights

SCRIPT = REPO / "tests" / "dist_scripts" / "sharded_load.py"


def _tiny(path: Path, tie: bool) -> str:
    """A tiny Qwen3 (vocab 301 or so: odd, so FSDP2's dim-0 shards are uneven), re-saved in bf16
    in several safetensors files (an index), like a hub checkpoint."""
    from transformers import AutoModelForCausalLM

    from aepo_engine.models import build_tiny_qwen3

    source = build_tiny_qwen3(path / "fp32", vocab_size=301, hidden_size=64, intermediate_size=96, num_heads=2,
                              num_kv_heads=1, head_dim=32, tie_word_embeddings=tie, initializer_range=0.3)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(path / "bf16", max_shard_size="40KB")
    for name in os.listdir(source):  # the tokenizer files beside the weights
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "special_tokens_map.json":
            (path / "bf16" / name).write_bytes((Path(source) / name).read_bytes())
    return str(path / "bf16")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sharded_load")
    return {"tied": _tiny(root / "tied", True), "untied": _tiny(root / "untied", False)}


def test_read_rows_matches_the_safetensors_package(tmp_path):
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=gen).bfloat16(), "b": torch.randn(3, 2, 4, generator=gen),
               "c": torch.randn(11, generator=gen).half(), "d": torch.tensor(2.5, dtype=torch.float64),
               "e": torch.randint(-9, 9, (4, 3), generator=gen), "f": torch.zeros(0, 6)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    checkpoint = SafetensorsCheckpoint(tmp_path)
    want = load_file(str(tmp_path / "model.safetensors"))
    for name, value in want.items():
        rows = value.shape[0] if value.dim() else 1
        assert torch.equal(checkpoint.read_rows(name, 0, rows), value), name
        for start, stop in ((0, 0), (rows // 2, rows), (1 % max(rows, 1), rows)):
            if value.dim() and start <= stop:
                assert torch.equal(checkpoint.read_rows(name, start, stop), value[start:stop]), (name, start, stop)
    with pytest.raises(IndexError):
        checkpoint.read_rows("a", 3, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="sharded_load=false"):
        SafetensorsCheckpoint(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsCheckpoint(tmp_path / "bad")


def test_one_process_load_of_a_meta_model_is_identical(models):
    """Without FSDP the same materialisation fills whole tensors (the code path a 1-rank mesh also takes)."""
    from aepo_engine.training.loading import load_hf_model

    for path in models.values():
        model = build_meta_model(path, "sdpa")
        assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
        load_sharded_weights(model, path, torch.device("cpu"))
        whole = load_hf_model(path, "sdpa")
        assert model.state_dict().keys() == whole.state_dict().keys()
        for (name, got), (_, want) in zip(model.state_dict().items(), whole.state_dict().items()):
            assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want), name
        if whole.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_and_misshapen_tensors_are_named(models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = Path(models["untied"])
    state = {}
    for file in src.glob("*.safetensors"):
        state.update(load_file(str(file)))
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text((src / "config.json").read_text())
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "missing" / "model.safetensors"))
    model = build_meta_model(str(tmp_path / "missing"), "sdpa")
    with pytest.raises(KeyError, match="lm_head.weight.*sharded_load=false"):
        load_sharded_weights(model, str(tmp_path / "missing"), torch.device("cpu"))
    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "config.json").write_text((src / "config.json").read_text())
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "shape" / "model.safetensors"))
    model = build_meta_model(str(tmp_path / "shape"), "sdpa")
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_sharded_weights(model, str(tmp_path / "shape"), torch.device("cpu"))


@pytest.mark.slow
@dist_tests
def test_two_ranks_sharded_load_is_identical_and_head_matmuls_are_bf16(models, tmp_path):
    out = tmp_path / "out.json"
    launch_torchrun([str(SCRIPT), str(out), models["tied"], models["untied"]])
    results = json.loads(out.read_text())
    for kind, path in models.items():
        result = results[path]
        assert result["world_size"] == 2
        assert result["different"] == [] and len(result["identical"]) >= 20, (kind, result["different"])
        assert result["buffers_equal"], kind
        assert result["head_matmuls"] >= 3, kind  # the recorder saw the head: logits, d_hidden, d_W
        assert result["fp32_head_matmuls"] == [], (kind, result["fp32_head_matmuls"][:3])


def test_autocast_head_matmuls_are_bf16_and_the_update_is_within_bf16_tolerance(models):
    """No FSDP, param_dtype bf16 (autocast): the backbone's last hidden state comes out fp32 under
    autocast; the head must still multiply in bf16. The parameter change of one update is the
    fp32 update's within bf16 rounding."""
    path = models["untied"]
    vocab = vocab_of(path)
    batch = random_batch(vocab, seed=5)
    deltas = {}
    for dtype in ("float32", "bfloat16"):
        worker = make_worker(path, optim=SGD_LIKE, param_dtype=dtype, micro_batch_size=3)
        before = {k: v.detach().clone() for k, v in worker.model.named_parameters()}
        logprobs, entropy = worker.compute_logprobs(batch)
        with MatmulDtypes() as recorder:
            worker.update(dataclasses.replace(batch, old_logprobs=logprobs, entropy=entropy))
        deltas[dtype] = {k: v.detach() - before[k] for k, v in worker.model.named_parameters()}
        if dtype == "bfloat16":
            assert len(recorder.with_dim(vocab)) >= 3
            assert recorder.fp32_with_dim(vocab) == [], recorder.fp32_with_dim(vocab)[:3]
            assert all(p.dtype == torch.float32 for p in worker.model.parameters())  # master weights
    for name, want in deltas["float32"].items():
        got = deltas["bfloat16"][name]
        assert (got - want).abs().max() <= 0.1 * want.abs().max() + 1e-6, name
    head = deltas["bfloat16"]["lm_head.weight"]
    cosine = torch.nn.functional.cosine_similarity(head.flatten(), deltas["float32"]["lm_head.weight"].flatten(), dim=0)
    assert cosine > 0.99
