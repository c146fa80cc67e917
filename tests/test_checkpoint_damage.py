"""Checkpoints against the disk: what meta.json records, a damaged checkpoint skipped on resume
(the run then reproduced from the newest intact one), keep_last never losing the newest intact
checkpoint, a full disk during a save (a real tmpfs, and ENOSPC injected at DCP's writer), the
disk a run's checkpoints take, the HF export in the model's own dtype and files written whole."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from aepo_engine import checkpoint as ckpt_mod
from aepo_engine.checkpoint import (CheckpointConfig, CheckpointDamaged, CheckpointManager, CheckpointSaveError,
                                    checkpoint_footprint, model_dtype, space_problem, verify_checkpoint)
from aepo_engine.files import file_checksum, out_of_space, write_text_atomic
from test_checkpoint import make_model, make_optim, params, save, tiny_tokenizer, train_steps


def _run(root: Path, steps: int, keep_last: int = 5, every_step_saved: bool = True):
    """Train ``steps`` steps, saving after each; returns the final parameters (the uninterrupted run)."""
    model = make_model()
    optimizer, scheduler = make_optim(model)
    manager = CheckpointManager(root, keep_last=keep_last)
    for step in range(1, steps + 1):
        train_steps(model, optimizer, scheduler, 1)
        if every_step_saved:
            save(manager, step, model, optimizer, scheduler, export_hf=False)
    return params(model)


def _truncate(path: Path) -> str:
    file = path / "train_state" / "__0_0.distcp"
    os.truncate(file, file.stat().st_size // 2)
    return "train_state/__0_0.distcp has"


def _flip_bit(path: Path) -> str:
    file = path / "train_state" / "__0_0.distcp"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10  # same size: only the checksum can tell
    file.write_bytes(bytes(data))
    return "train_state/__0_0.distcp does not match its recorded xxh3_64 checksum"


def _delete(path: Path) -> str:
    (path / "train_state" / ".metadata").unlink()
    return "train_state/.metadata is missing"


def _drop_meta(path: Path) -> str:
    (path / "meta.json").unlink()
    return "meta.json is missing"


DAMAGE = {"truncated": _truncate, "bit_flipped": _flip_bit, "file_deleted": _delete, "meta_json_missing": _drop_meta}


# --- what a checkpoint records --------------------------------------------------------------------

def test_meta_json_records_every_file_with_its_size_and_checksum(tmp_path):
    model = make_model()
    optimizer, scheduler = make_optim(model)
    train_steps(model, optimizer, scheduler, 1)
    path = save(CheckpointManager(tmp_path), 1, model, optimizer, scheduler, config_text="x = 1\n")
    meta = json.loads((path / "meta.json").read_text())
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(meta["files"]) == on_disk
    assert {"train_state/.metadata", "train_state/__0_0.distcp", "config.toml", "hf_model/model.safetensors"} <= set(on_disk)
    assert meta["checksum"] == "xxh3_64" and meta["format_version"] == 2
    for rel, entry in meta["files"].items():
        assert entry == {"bytes": (path / rel).stat().st_size, "xxh3_64": file_checksum(path / rel)}, rel
    assert verify_checkpoint(path) == []


def test_checksum_is_xxh3_of_the_bytes(tmp_path):
    import xxhash

    data = os.urandom((8 << 20) + 12345)  # more than one read chunk
    (tmp_path / "f").write_bytes(data)
    assert file_checksum(tmp_path / "f") == xxhash.xxh3_64(data).hexdigest()


# --- resuming past damage -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_skips_a_damaged_checkpoint_and_reproduces_the_run(tmp_path, kind):
    """Four saved steps, the newest damaged: resume picks step 3, says why step 4 was skipped, and
    training on from there ends where the uninterrupted run ended."""
    expected = _run(tmp_path / "reference", 4, every_step_saved=False)
    _run(tmp_path / "run", 4)
    newest = tmp_path / "run" / "step_000004"
    said = DAMAGE[kind](newest)

    fresh = make_model(seed=11)
    fresh_opt, fresh_sched = make_optim(fresh)
    manager = CheckpointManager(tmp_path / "run", keep_last=5)
    loaded = manager.resume("auto", fresh, fresh_opt, fresh_sched)
    assert loaded.step == 3 and loaded.path == tmp_path / "run" / "step_000003"
    assert [p for p, _ in loaded.skipped] == [newest] and said in loaded.skipped[0][1]
    train_steps(fresh, fresh_opt, fresh_sched, 1)
    for a, b in zip(expected, params(fresh)):
        assert torch.equal(a, b)


def test_resume_skips_several_damaged_checkpoints(tmp_path):
    _run(tmp_path, 4)
    _truncate(tmp_path / "step_000004")
    _flip_bit(tmp_path / "step_000003")
    loaded = CheckpointManager(tmp_path).resume("auto", make_model())
    assert loaded.step == 2 and [p.name for p, _ in loaded.skipped] == ["step_000004", "step_000003"]


def test_no_intact_checkpoint_is_an_error_with_the_choices(tmp_path):
    _run(tmp_path, 2)
    _truncate(tmp_path / "step_000002")
    _drop_meta(tmp_path / "step_000001")
    with pytest.raises(CheckpointDamaged) as info:
        CheckpointManager(tmp_path).resume("auto", make_model())
    message = str(info.value)
    assert "no intact checkpoint" in message and "--checkpoint.resume never" in message
    assert "step_000002: train_state/__0_0.distcp has" in message and "step_000001: meta.json is missing" in message
    assert "\n" not in message  # one error line


def test_a_damaged_checkpoint_named_explicitly_is_refused_with_the_intact_one_named(tmp_path):
    _run(tmp_path, 3)
    _flip_bit(tmp_path / "step_000003")
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointDamaged) as info:
        manager.resume(str(tmp_path / "step_000003"), make_model())
    assert "checksum" in str(info.value) and str(tmp_path / "step_000002") in str(info.value)
    assert manager.resume(str(tmp_path), make_model()).step == 2  # a checkpoint folder: its newest intact one
    assert manager.resume(str(tmp_path / "step_000001"), make_model()).step == 1


def test_a_checkpoint_saved_before_checksums_loads(tmp_path):
    _run(tmp_path, 1)
    meta_path = tmp_path / "step_000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({k: meta[k] for k in ("step", "time", "world_size")} | {"format_version": 1}))
    assert CheckpointManager(tmp_path).resume("auto", make_model()).step == 1


def test_keep_last_never_deletes_the_newest_intact_checkpoint(tmp_path):
    """Steps 20 (intact), 30 and 40 (damaged). Resumed from 20 and saving every 5 steps with
    keep_last=2, the run keeps two intact checkpoints; the damaged ones neither count nor go."""
    model = make_model()
    optimizer, scheduler = make_optim(model)
    train_steps(model, optimizer, scheduler, 1)
    first = CheckpointManager(tmp_path, keep_last=5)
    for step in (20, 30, 40):
        save(first, step, model, optimizer, scheduler, export_hf=False)
    _truncate(tmp_path / "step_000040")
    _flip_bit(tmp_path / "step_000030")

    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.resume("auto", model, optimizer, scheduler).step == 20
    save(manager, 25, model, optimizer, scheduler, export_hf=False)
    assert {p.name for _, p in manager.checkpoints()} == {"step_000020", "step_000025", "step_000030", "step_000040"}
    save(manager, 30, model, optimizer, scheduler, export_hf=False)  # replaces the damaged step 30
    save(manager, 35, model, optimizer, scheduler, export_hf=False)
    intact = [p.name for _, p in manager.checkpoints() if not verify_checkpoint(p)]
    assert intact == ["step_000030", "step_000035"]
    assert (tmp_path / "step_000040").is_dir()  # damaged, left for a look until step 40 is saved again


# --- a full disk ----------------------------------------------------------------------------------

def _checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_save_on_a_full_tmpfs_is_one_error_and_keeps_the_previous_checkpoint(small_disk):
    """A tmpfs that holds one checkpoint: the second save fails in torch's zip writer (no errno);
    the error says the step, the bytes needed and free, and the checkpoint a resume will use."""
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 300)  # a ~0.7 MiB checkpoint with its AdamW state
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 200)).sum().backward()
    optimizer.step()
    disk = small_disk(1 << 20)
    manager = CheckpointManager(disk / "ckpt", keep_last=3)
    first = manager.save(1, model, optimizer=optimizer, export_hf=False)
    with pytest.raises(CheckpointSaveError) as info:
        manager.save(2, model, optimizer=optimizer, export_hf=False)
    message = str(info.value)
    assert "step 2" in message and "the disk is full" in message and f"a resume will use {first}" in message
    needed = int(message.split(" bytes;")[0].rsplit("= ", 1)[1])
    assert 0.9 < needed / _checkpoint_bytes(first) < 1.1
    assert "bytes are free" in message and "\n" not in message
    assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["latest", "step_000001"]  # no partial folder
    assert verify_checkpoint(first) == []
    assert CheckpointManager(disk / "ckpt").resume("auto", torch.nn.Linear(200, 300)).step == 1


def test_enospc_at_the_storage_writer_is_one_error(tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: an ENOSPC raised where DCP's writer opens its files."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    model = make_model()
    manager = CheckpointManager(tmp_path)
    save(manager, 1, model, None, None, export_hf=False)
    real = FileSystem.create_stream

    def full(self, path, mode):
        if str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full)
    with pytest.raises(CheckpointSaveError, match=r"step 2 was not saved: the disk is full .* a resume will use "
                                                  r".*step_000001"):
        save(manager, 2, model, None, None, export_hf=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]


def test_a_writer_bug_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("a bug, not the disk")

    monkeypatch.setattr(ckpt_mod, "_export_hf", broken)
    with pytest.raises(TypeError, match="a bug"):
        CheckpointManager(tmp_path).save(1, make_model())
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_out_of_space_rules():
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"), free=10 << 30, still_needed=1)
    assert out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), free=10 << 30, still_needed=1)
    zip_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert out_of_space(zip_writer, free=4096, still_needed=100_000)
    assert not out_of_space(zip_writer, free=10 << 30, still_needed=100_000)  # room left: not the disk
    assert not out_of_space(TypeError("bug"), free=0, still_needed=100_000)
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert out_of_space(wrapped, free=10 << 30, still_needed=1)


# --- the disk a run's checkpoints take ------------------------------------------------------------

def _qwen3(vocab=1000, hidden=128, layers=2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def test_footprint_matches_what_a_save_writes(tmp_path):
    model = _qwen3()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    path = CheckpointManager(tmp_path).save(1, model, optimizer=optimizer, hf_dtype=torch.bfloat16)
    files = json.loads((path / "meta.json").read_text())["files"]
    written = {part: sum(e["bytes"] for rel, e in files.items() if rel.startswith(part)) for part in ("train_state/", "hf_model/")}
    footprint = checkpoint_footprint(sum(p.numel() for p in model.parameters()), 2, CheckpointConfig())
    assert 0.97 < written["train_state/"] / footprint.train_state < 1.05, (written, footprint)
    assert 0.97 < written["hf_model/"] / footprint.hf_export < 1.05, (written, footprint)


def test_footprint_counts_the_kept_checkpoints_and_the_exports():
    one = checkpoint_footprint(1000, 2, CheckpointConfig(keep_last=3))
    assert (one.train_state, one.hf_export) == (12_000, 2000)
    assert one.peak == 4 * 12_000 + 2000  # 3 kept + 1 being written, one export (the final checkpoint's)
    every = checkpoint_footprint(1000, 2, CheckpointConfig(keep_last=3, hf_export_every=10))
    assert every.peak == 4 * (12_000 + 2000)
    assert checkpoint_footprint(1000, 2, CheckpointConfig(export_hf=False)).hf_export == 0
    # Qwen3-14B, bf16 export: the training state is what it is; one 27.5 GiB export instead of one per checkpoint
    paper = checkpoint_footprint(14_768_307_200, 2, CheckpointConfig(keep_last=3))
    assert round(paper.train_state / 2**30, 1) == 165.0 and round(paper.hf_export / 2**30, 1) == 27.5


def test_space_problem_on_a_small_disk(small_disk):
    disk = small_disk(1 << 20)
    footprint = checkpoint_footprint(100_000, 4, CheckpointConfig(keep_last=2))  # 1.2 MB each: cannot fit
    problem = space_problem(disk / "ckpt", footprint)
    assert problem and "checkpoint.keep_last" in problem and "free" in problem
    assert space_problem(disk / "ckpt", checkpoint_footprint(1000, 4, CheckpointConfig(keep_last=2))) is None


# --- HF export: when and in which dtype ------------------------------------------------------------

def test_hf_export_only_at_the_end_unless_asked():
    default = CheckpointConfig()
    assert [s for s in range(1, 31) if default.exports_hf(s, final=s == 30)] == [30]
    every = CheckpointConfig(hf_export_every=10)
    assert [s for s in range(1, 26) if every.exports_hf(s, final=s == 25)] == [10, 20, 25]
    assert not CheckpointConfig(export_hf=False).exports_hf(30, final=True)
    with pytest.raises(ValueError, match="hf_export_every"):
        CheckpointConfig(hf_export_every=-1)


def test_hf_export_is_written_in_the_models_own_dtype(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = _qwen3(vocab=64, hidden=64)
    model.save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    config["dtype"] = "bfloat16"  # as a published model declares it
    (tmp_path / "source" / "config.json").write_text(json.dumps(config))
    assert model_dtype(tmp_path / "source") == torch.bfloat16
    path = CheckpointManager(tmp_path / "ckpt").save(1, model, tokenizer=tiny_tokenizer(),
                                                     hf_dtype=model_dtype(tmp_path / "source"))
    export = path / "hf_model"
    with safe_open(export / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.float32  # the training model is untouched
    loaded = AutoModelForCausalLM.from_pretrained(export)
    assert loaded.dtype == torch.bfloat16
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(want.to(torch.bfloat16), got), name
    exported = _checkpoint_bytes(export / "model.safetensors")
    assert exported < 0.55 * 4 * sum(p.numel() for p in model.parameters())  # half the fp32 bytes


def test_model_dtype_reads_both_spellings(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert model_dtype(tmp_path) == torch.float16
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert model_dtype(tmp_path) is None
    assert model_dtype(tmp_path / "nowhere") is None


# --- files written whole --------------------------------------------------------------------------

def test_write_text_atomic_on_a_full_disk_keeps_the_old_file(small_disk):
    disk = small_disk(64 << 10)
    target = disk / "summary.csv"
    write_text_atomic(target, "dataset,pass@1\na,0.5\n")
    with pytest.raises(OSError) as info:
        write_text_atomic(target, "dataset,pass@1\n" + "b,0.25\n" * 20_000)  # 140 kB > 64 kB
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == "dataset,pass@1\na,0.5\n"
    assert [p.name for p in disk.iterdir()] == ["summary.csv"]  # no temporary file left


def test_eval_reports_on_a_full_disk_leave_no_truncated_table(small_disk):
    from aepo_engine.evaluation.report import write_reports

    disk = small_disk(32 << 10)
    summary = {f"set{i}": {"pass@1": 0.5, "questions": 10, "note": "x" * 300} for i in range(200)}  # ~70 kB each
    with pytest.raises(OSError):
        write_reports(summary, disk)
    assert list(disk.iterdir()) == []  # neither a truncated table nor a temporary file


def test_a_torn_metrics_line_is_cut_before_appending(tmp_path):
    from aepo_engine.metrics import RunLogger, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 1.0}\n{"step": 1, "rew')  # cut by a full disk
    logger = RunLogger(tmp_path)
    logger.log(1, {"reward/mean": 2.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "reward/mean": 1.0}, {"step": 1, "reward/mean": 2.0}]
