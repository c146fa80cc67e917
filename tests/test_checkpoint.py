"""CheckpointManager: exact round trip, RNG continuation, crash safety, pruning, HF export."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aepo_engine import checkpoint as ckpt_mod
from aepo_engine.checkpoint import CheckpointManager, find_latest
from runs import REPO, dist_tests, launch_torchrun


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_optim(model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return optimizer, scheduler


def train_steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        x = torch.randn(5, 7)  # draws from torch's global RNG, so RNG continuation matters
        loss = model(x).pow(2).mean() + 0.01 * random.random() + 0.01 * float(np.random.rand())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def trained(n: int = 3):
    model = make_model()
    optimizer, scheduler = make_optim(model)
    train_steps(model, optimizer, scheduler, n)
    return model, optimizer, scheduler


def save(manager, step, model, optimizer, scheduler, **kw):
    return manager.save(step, model, optimizer=optimizer, scheduler=scheduler,
                        extra_state={"sampler": {"epoch": 1, "offset": 8}, "step": step}, **kw)


# --- round trip -----------------------------------------------------------------------------------

def test_round_trip_restores_params_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = trained()
    manager = CheckpointManager(tmp_path, keep_last=2)
    path = save(manager, 3, model, optimizer, scheduler, config_text="[optim]\nlr = 0.01\n")
    # Continue the original run for 2 steps: this is the reference trajectory.
    train_steps(model, optimizer, scheduler, 2)
    expected = params(model)

    fresh = make_model(seed=123)
    fresh_opt, fresh_sched = make_optim(fresh)
    torch.manual_seed(999)  # scramble the RNG; load must restore it
    random.seed(999)
    np.random.seed(999)
    loaded = manager.load_latest(fresh, fresh_opt, fresh_sched)

    assert loaded.path == path and loaded.step == 3
    assert loaded.extra_state == {"sampler": {"epoch": 1, "offset": 8}, "step": 3}
    assert loaded.config_text == "[optim]\nlr = 0.01\n"
    assert fresh_sched.last_epoch == 3 and fresh_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    train_steps(fresh, fresh_opt, fresh_sched, 2)
    for a, b in zip(expected, params(fresh)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_optimizer_state_identical_after_load(tmp_path):
    model, optimizer, scheduler = trained()
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, scheduler)
    fresh = make_model(seed=5)
    fresh_opt, fresh_sched = make_optim(fresh)
    manager.load_latest(fresh, fresh_opt, fresh_sched)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    want, got = optimizer.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got["state"][index][key]), key


def test_load_without_optimizer_and_without_rng(tmp_path):
    model, optimizer, scheduler = trained()
    CheckpointManager(tmp_path).save(2, model, optimizer=optimizer, scheduler=scheduler)
    fresh = make_model(seed=9)
    before = torch.get_rng_state()
    loaded = CheckpointManager(tmp_path).load_latest(fresh, restore_rng=False)
    assert loaded.step == 2 and loaded.extra_state == {} and loaded.config_text is None
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_save_before_first_step_leaves_optimizer_untouched(tmp_path):
    model = make_model()
    optimizer, scheduler = make_optim(model)
    manager = CheckpointManager(tmp_path)
    manager.save(0, model, optimizer=optimizer, scheduler=scheduler)
    assert not optimizer.state  # no zero-gradient init step was run on it
    fresh = make_model(seed=8)
    fresh_opt, fresh_sched = make_optim(fresh)
    assert manager.load_latest(fresh, fresh_opt, fresh_sched).step == 0
    assert not fresh_opt.state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


# --- resume settings ------------------------------------------------------------------------------

def test_resume_auto_never_and_path(tmp_path):
    model, optimizer, scheduler = trained()
    manager = CheckpointManager(tmp_path / "run", keep_last=3)
    first = save(manager, 1, model, optimizer, scheduler)
    train_steps(model, optimizer, scheduler, 1)
    save(manager, 2, model, optimizer, scheduler)
    fresh = make_model(seed=4)
    assert manager.resume("never", fresh) is None
    assert manager.resume("auto", fresh).step == 2
    assert manager.resume(str(first), fresh).step == 1
    assert manager.resume(str(tmp_path / "run"), fresh).step == 2  # a root: its latest
    assert CheckpointManager(tmp_path / "empty").resume("auto", fresh) is None
    with pytest.raises(FileNotFoundError):
        manager.resume(str(tmp_path / "nowhere"), fresh)


# --- crash safety ---------------------------------------------------------------------------------

def test_exception_mid_save_keeps_previous_latest(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained()
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, scheduler)
    reference = params(model)
    train_steps(model, optimizer, scheduler, 1)

    def broken_export(out_dir, *args):
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "_export_hf", broken_export)
    with pytest.raises(OSError, match="disk full"):
        save(manager, 2, model, optimizer, scheduler)
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert not manager.step_dir(2).exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    fresh = make_model(seed=3)
    assert manager.load_latest(fresh).step == 1
    assert all(torch.equal(a, b) for a, b in zip(reference, fresh.parameters()))


_CHILD = textwrap.dedent("""
    import sys, torch
    from aepo_engine.checkpoint import CheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))  # 4.2M params
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(sys.argv[1], keep_last=3)
    manager.save(1, model, optimizer=optimizer, extra_state={"tag": "first"}, export_hf=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    print("saving 2", flush=True)  # the parent kills us once step 2's temporary directory appears
    manager.save(2, model, optimizer=optimizer, extra_state={"tag": "second"})
    print("done 2", flush=True)
""")


@pytest.mark.slow
def test_sigkill_while_saving_leaves_previous_checkpoint_loadable(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "saving 2"
        deadline = time.monotonic() + 30
        while not [p for p in tmp_path.iterdir() if p.name.startswith("step_000002.tmp-")]:
            assert time.monotonic() < deadline, "the child never started writing step 2"
            assert child.poll() is None, "the child finished before it could be killed"
            time.sleep(0.002)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "step_000002").exists(), "the save finished before the kill; enlarge the model"
    assert (tmp_path / "latest").read_text().strip() == "step_000001"
    assert find_latest(tmp_path) == tmp_path / "step_000001"

    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers, "the kill should leave a temporary directory behind"
    manager = CheckpointManager(tmp_path)  # cleans leftovers
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reference = params(model)  # same init as the child; step 1 moved weights by ~lr only
    loaded = manager.load_latest(model, optimizer, restore_rng=False)
    assert loaded.step == 1 and loaded.extra_state == {"tag": "first"}
    drift = max((a - b).abs().max().item() for a, b in zip(reference, model.parameters()))
    assert 0 < drift < 0.01  # one AdamW step of lr 1e-3, not the +1.0 of the killed save


# --- pruning and markers --------------------------------------------------------------------------

def test_keep_last_prunes_oldest(tmp_path):
    model, optimizer, scheduler = trained(1)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save(manager, step, model, optimizer, scheduler, export_hf=False)
    assert [s for s, _ in manager.checkpoints()] == [3, 4]
    assert manager.latest_path() == tmp_path / "step_000004"


def test_prune_never_deletes_latest(tmp_path):
    model, optimizer, scheduler = trained(1)
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (5, 6):
        save(manager, step, model, optimizer, scheduler, export_hf=False)
    # Resumed from an older run and saving a lower step: latest is step 2 but 6 is newer by number.
    save(manager, 2, model, optimizer, scheduler, export_hf=False)
    assert manager.latest_path() == tmp_path / "step_000002"
    assert (tmp_path / "step_000002").is_dir()


def test_resave_same_step_replaces_it(tmp_path):
    model, optimizer, scheduler = trained(1)
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, scheduler, export_hf=False, config_text="a")
    save(manager, 1, model, optimizer, scheduler, export_hf=False, config_text="b")
    assert manager.load_latest(make_model(), restore_rng=False).config_text == "b"
    assert [s for s, _ in manager.checkpoints()] == [1]


def test_stale_marker_and_incomplete_dirs_are_ignored(tmp_path):
    model, optimizer, scheduler = trained(1)
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, optimizer, scheduler, export_hf=False)
    (tmp_path / "step_000009").mkdir()  # no meta.json: not a checkpoint
    assert manager.latest_path() == tmp_path / "step_000001"
    (tmp_path / "latest").write_text("step_000007\n")  # names a missing dir
    assert manager.latest_path() == tmp_path / "step_000001"


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


# --- HF export ------------------------------------------------------------------------------------

def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)} | {"[UNK]": 60}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_hf_export_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    path = CheckpointManager(tmp_path).save(1, model, tokenizer=tiny_tokenizer(), optimizer=optimizer)

    exported = AutoModelForCausalLM.from_pretrained(path / "hf_model")
    for (name, a), b in zip(model.state_dict().items(), exported.state_dict().values()):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(path / "hf_model")("w1 w2").input_ids == [1, 2]

    fresh = Qwen3ForCausalLM(config)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    CheckpointManager(tmp_path).load_latest(fresh, fresh_opt)
    torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_plain_module_export_is_safetensors_even_with_tied_weights(tmp_path):
    from safetensors.torch import load_file

    embed, head = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False)
    head.weight = embed.weight  # tied: safetensors refuses shared storage unless copied
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    path = CheckpointManager(tmp_path).save(1, model)
    tensors = load_file(path / "hf_model" / "model.safetensors")
    assert set(tensors) == {"embed.weight", "head.weight"}
    assert torch.equal(tensors["head.weight"], embed.weight.detach())


# --- FSDP2 (opt-in: two gloo processes take ~15-30 s) ---------------------------------------------

_FSDP_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from aepo_engine.checkpoint import CheckpointManager

    def sharded(mesh, zero=False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        if zero:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        for module in (model[0], model[2], model):
            fully_shard(module, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optimizer, x):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, optimizer = sharded(mesh)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        step(model, optimizer, torch.randn(4, 8))
    manager = CheckpointManager(sys.argv[1])
    manager.save(2, model, optimizer=optimizer, extra_state={"k": 1})
    x = torch.randn(4, 8)
    step(model, optimizer, x)
    want = {k: v.full_tensor() for k, v in model.state_dict().items()}
    fresh, fresh_opt = sharded(mesh, zero=True)
    loaded = manager.resume("auto", fresh, fresh_opt)  # each rank verifies a share of the files first
    step(fresh, fresh_opt, x)
    same = all(torch.equal(want[k], v.full_tensor()) for k, v in fresh.state_dict().items())
    if dist.get_rank() == 0:
        from safetensors.torch import load_file
        shapes = {k: tuple(v.shape) for k, v in load_file(loaded.path / "hf_model" / "model.safetensors").items()}
        print("RESULT", loaded.step, loaded.extra_state, same, sorted(shapes.items()), flush=True)

    # A tiny HF model with tied embeddings, sharded per layer: the export must be its full weights.
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf_model = Qwen3ForCausalLM(config)
    full = {k: v.clone() for k, v in hf_model.state_dict().items()}
    for module in (*hf_model.model.layers, hf_model):
        fully_shard(module, mesh=mesh)
    path = CheckpointManager(sys.argv[1] + "_hf").save(1, hf_model)
    if dist.get_rank() == 0:
        exported = AutoModelForCausalLM.from_pretrained(path / "hf_model").state_dict()
        print("HF_RESULT", all(torch.equal(full[k], v) for k, v in exported.items()), flush=True)

    # A full disk in rank 0's part of a save (the HF export): every rank raises the error, none
    # waits for rank 0 forever, and nothing of the checkpoint is left.
    import errno
    import aepo_engine.checkpoint as ckpt

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpt._export_hf = full
    try:
        manager.save(3, model, optimizer=optimizer)
        print("SAVE_ERROR none", flush=True)
    except ckpt.CheckpointSaveError as err:
        print(f"SAVE_ERROR rank {dist.get_rank()}: {err}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("LEFT", sorted(p.name for p in manager.root.iterdir()), flush=True)
    dist.destroy_process_group()
    # The end, without the interpreter's exit: after fully_shard, torch keeps the gloo group alive
    # past destroy_process_group (its threads still run), so a normal exit tears it down while the
    # interpreter finalizes and the other rank exits; under the full suite rank 1 once aborted
    # there ("terminate called without an active exception"), as torch's gloo threads can at
    # interpreter finalization (pytorch/pytorch PR 179291, abandoned). Everything is written and printed.
    sys.stdout.flush()
    os._exit(0)
""")


@dist_tests
@pytest.mark.slow
def test_fsdp2_sharded_save_load_and_full_hf_export(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_FSDP_WORKER)
    stdout = launch_torchrun([str(script), str(tmp_path / "ckpt")], timeout=240)
    result = [line for line in stdout.splitlines() if line.startswith("RESULT")]
    report = stdout[-4000:]
    assert result, report
    assert "HF_RESULT True" in stdout, report
    assert result[0] == ("RESULT 2 {'k': 1} True [('0.bias', (16,)), ('0.weight', (16, 8)), "
                         "('2.bias', (4,)), ('2.weight', (4, 16))]")
    assert (tmp_path / "ckpt" / "step_000002" / "train_state" / "__1_0.distcp").is_file()  # sharded write
    for rank in (0, 1):
        assert f"SAVE_ERROR rank {rank}: the checkpoint of step 3 was not saved: the disk is full" in stdout, report
    assert "LEFT ['latest', 'step_000002']" in stdout, report


def test_export_keeps_one_name_per_tied_parameter():
    """A gathered (FSDP) full state dict holds separate copies of tied weights; keep the first name."""
    from aepo_engine.checkpoint import _drop_tied_repeats

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.norm = torch.nn.LayerNorm(3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    copies = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    assert "head.weight" in copies and "embed.weight" in copies
    assert set(_drop_tied_repeats(model, copies)) == {"embed.weight", "norm.weight", "norm.bias"}
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())  # untied: keep both
    assert set(_drop_tied_repeats(model, copies)) == set(copies)
