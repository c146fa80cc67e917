"""``backend.placement = "split"``: the config's checks, which GPUs each engine gets, and the memory
plan of each role (arithmetic only: nothing here has run on a GPU, docs/async.md)."""
from __future__ import annotations

import pytest

from aepo_engine.config import config_problems, load_train_config
from aepo_engine.memory_plan import VLLM_NON_TORCH, ModelShape, gpu_bytes, plan_memory
from aepo_engine.placement import plan_placement, split_engine_devices
from test_memory_plan import QWEN3_14B, _dry_run

PAPER = ["--preset", "qwen3_14b_deep_research", "--model.path=/m"]
# the preset's engines span 2 GPUs (tensor_parallel_size 2): split, they run in vLLM's own processes
SPLIT = [*PAPER, "--backend.placement=split", "--backend.in_process=false"]


def test_split_needs_async_and_whole_engines():
    cfg = load_train_config([*SPLIT, "--backend.rollout_gpus=4"])
    assert any("backend.placement='split' needs train.mode='async'" in p for p in config_problems(cfg))
    ok = load_train_config([*SPLIT, "--backend.rollout_gpus=4", "--train.mode=async"])
    assert not any("placement" in p for p in config_problems(ok))
    assert not ok.backend.sleeps(cuda=True)  # an engine on GPUs of its own never sleeps for the update
    for args, message in ((["--backend.placement=split"], "rollout_gpus=0 must be a positive multiple"),
                          (["--backend.placement=split", "--backend.rollout_gpus=3", "--backend.tensor_parallel_size=2"],
                           "multiple of tensor_parallel_size=2"),
                          (["--backend.rollout_gpus=2"], "needs placement='split'"),
                          (["--backend.placement=split", "--backend.rollout_gpus=2", "--backend.sleep_between_steps=true"],
                           "never makes room"),
                          (["--backend.placement=split", "--backend.rollout_gpus=2", "--train.mode=async"],
                           "tensor_parallel_size > 1 needs in_process=false")):
        with pytest.raises(Exception, match=message):
            load_train_config([*PAPER, *args])


def test_engines_take_the_gpus_after_the_trainers():
    assert split_engine_devices(4, 4, 1, visible="") == ["4", "5", "6", "7"]
    assert split_engine_devices(4, 4, 2, visible="") == ["4,5", "6,7"]
    assert split_engine_devices(2, 2, 2, visible="3,1,7,5") == ["7,5"]  # mapped through the job's own list
    with pytest.raises(ValueError, match="need 9 GPUs"):
        split_engine_devices(5, 4, 1, visible="0,1,2,3,4,5,6,7")
    with pytest.raises(ValueError, match="multiple"):
        split_engine_devices(4, 3, 2, visible="")


def test_split_plan_of_the_paper_run_on_one_h200_node():
    shape = ModelShape.from_config(QWEN3_14B)
    cfg = load_train_config([*SPLIT, "--backend.rollout_gpus=4", "--train.mode=async", "--train.max_staleness=1"])
    h200 = gpu_bytes("h200")
    split = plan_placement(cfg, shape, trainer_world=4, gpu=h200)
    colocated = plan_memory(load_train_config(PAPER), shape, 8, h200)
    trainer, engine = split.trainer, split.engine
    # the trainer: FSDP over 4 ranks instead of 8 (twice the state per GPU), no engine terms
    assert trainer.terms["params"].bytes == 2 * colocated.terms["params"].bytes
    assert all(trainer.terms[k].bytes == 0 for k in ("vllm_awake", "vllm_idle", "vllm_weights"))
    assert "rollout (engine awake)" not in trainer.phases and "weight push" in trainer.phases
    # an engine GPU: half the bf16 weights (2 bytes x 14.77B / tp 2) + the KV cache gpu_memory_utilization leaves
    p = shape.params()
    assert cfg.backend.tensor_parallel_size == 2
    assert engine.terms["weights"].bytes == int(2 * p / 2)
    # vLLM's share of the GPU less the weights, its profiling peak and what lies outside torch
    profile = engine.terms["profile"].bytes
    assert 0 < profile < 8 * 2**30
    assert engine.terms["kv"].bytes == int(cfg.backend.gpu_memory_utilization * h200) - p - profile - VLLM_NON_TORCH
    # the colocated plan's own figure for an engine alone on 2 GPUs
    assert engine.terms["kv"].bytes == plan_memory(load_train_config(PAPER), shape, 8, h200, gpu_name="h200").kv.cache_bytes
    # Qwen3-14B: 2 (k, v) x 40 layers x 8 KV heads x 128 x 2 bytes = 160 KiB per token, over the engine's 2 GPUs
    assert engine.kv.token_bytes == 163840
    assert split.kv_tokens == engine.terms["kv"].bytes * 2 // 163840
    # (1 + 1) x 64 prompts x 12 trajectories over 2 engines x (2000 + 6192) tokens
    assert split.in_flight_tokens == 768 * 8192
    assert split.engines == 2 and split.fits
    text = "\n".join(split.lines())
    assert "4 trainer GPUs + 2 engine(s) of 2 GPU(s)" in text and "KV cache:" in text


def test_dry_run_prints_both_roles_and_names_a_role_that_does_not_fit(tmp_path):
    code, text = _dry_run(tmp_path, "--gpu", "h200", "--world-size", "4", "--backend.placement=split",
                          "--backend.in_process=false", "--backend.rollout_gpus=4", "--train.mode=async")
    assert "trainer GPU:" in text and "engine GPU:" in text and "problem: memory plan" not in text, text[-3000:]
    # ... and it says that several trainer ranks beside rollout processes are not built on GPUs
    assert code == 2 and "with 4 trainer ranks on GPUs: several trainer ranks beside rollout processes run on CPU" in text
    # 24 GiB: the trainer's unsharded state and the engine's 27.5 GiB of bf16 weights both overflow
    code, text = _dry_run(tmp_path, "--gpu", "24", "--world-size", "1", "--backend.placement=split",
                          "--backend.tensor_parallel_size=1", "--backend.rollout_gpus=1", "--train.mode=async")
    assert code == 2 and "GiB per trainer GPU" in text and "GiB per engine GPU" in text
    assert "backend.tensor_parallel_size" in text
    # 40 GiB at utilization 0.5: the weights fit, no KV cache does
    code, text = _dry_run(tmp_path, "--gpu", "40", "--world-size", "8", "--backend.placement=split",
                          "--backend.tensor_parallel_size=1", "--backend.gpu_memory_utilization=0.5",
                          "--backend.rollout_gpus=1", "--train.mode=async")
    assert code == 2 and "no room for a KV cache" in text


def test_dry_run_refuses_a_node_layout_that_cannot_start(tmp_path):
    """GPU review 2, point 9: 8 trainer ranks and 2 engine GPUs do not fit an 8-GPU node (the
    trainer ranks fill nodes of 8 - 2 = 6 GPUs); the dry run names the knobs. 6 ranks (one node)
    or 12 (two) plan; --gpus-per-node changes the node."""
    split = ("--backend.placement=split", "--backend.in_process=false", "--backend.rollout_gpus=2",
             "--train.mode=async")
    code, text = _dry_run(tmp_path, "--gpu", "h200", "--world-size", "8", *split)
    problem = next(line for line in text.splitlines() if line.startswith("problem: node layout"))
    assert code == 2 and "8 trainer ranks do not fill nodes of 6 trainer GPUs" in problem
    for knob in ("--world-size", "a multiple of 6", "backend.rollout_gpus", "--gpus-per-node"):
        assert knob in problem
    for world, nodes in (("6", ""), ("12", ", 2 nodes")):
        _, text = _dry_run(tmp_path, "--gpu", "h200", "--world-size", world, *split)
        assert "problem: node layout" not in text and f"node layout: 6 trainer ranks + 2 engine GPUs per node of 8{nodes}" in text
    _, text = _dry_run(tmp_path, "--gpu", "h200", "--world-size", "8", "--gpus-per-node", "10", *split)
    assert "problem: node layout" not in text and "8 trainer ranks + 2 engine GPUs per node of 10" in text
    _, text = _dry_run(tmp_path, "--gpu", "h200", "--world-size", "1", "--gpus-per-node", "2",
                       "--backend.placement=split", "--backend.in_process=false", "--backend.rollout_gpus=2",
                       "--train.mode=async")
    assert "leaves no trainer GPU on a node of 2" in text
