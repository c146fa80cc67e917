"""Running an algorithm-comparison grid: the per-seed shared set-ups (built once, under a file
lock, by the task's own set-up code in a child process, then hard-linked into each run), one
training run per subprocess, and the worker pool that orders them.

A seed's set-up is built just before its first run; a worker that cannot start the next run yet
builds the next seed's set-up, and a set-up another compare process is building (its lock is
held) is looked at again later instead of holding a worker. A run with ``summary.json`` is
finished and skipped; any other run is (re)started with ``--checkpoint.resume auto``.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from aepo_engine.config import TrainConfig
from aepo_engine.config_loader import ConfigError, loads_config
from aepo_engine.experiments.grid import RunSpec, setup_differences, setup_of
from aepo_engine.provenance import git_commit
from aepo_engine.tasks import SyntheticSetupConfig
from aepo_engine.tasks.synthetic_setup import SETUP_FILE, build_in_child

__all__ = ["SetupBusy", "build_setup", "is_finished", "link_setup", "run_grid", "run_training", "setup_dir"]

SETUP_RETRY_S = 30.0  # how often a set-up another process is building is looked at again
RUN_INFO = "compare_run.json"


def setup_dir(out: Path, seed: int) -> Path:
    return out / "_setup" / f"seed{seed}"


class SetupBusy(RuntimeError):
    """Another process holds the set-up's lock (it is building it)."""


def build_setup(out: Path, seed: int, cfg: TrainConfig, threads: int, log: Callable[[str], None] | None = None,
                wait: bool = True) -> Path:
    """Build (or reuse) the synthetic set-up of ``seed`` under ``OUT/_setup/seed<N>/setup``.

    The task's own set-up code builds it in a child process
    (:func:`aepo_engine.tasks.synthetic_setup.build_in_child`, given the set-up's sections alone).

    Args:
        out: the grid's folder.
        seed: the root seed of the runs that share it.
        cfg: the resolved config of one of those runs.
        threads: torch threads of the child.
        log: progress messages.
        wait: wait while another process builds it; False raises :class:`SetupBusy` instead.
    Returns:
        The built set-up folder.
    Raises:
        ConfigError: the folder was built from other set-up sections.
        SetupBusy: another process holds its lock (only with ``wait=False``).
    """
    folder = setup_dir(out, seed)
    folder.mkdir(parents=True, exist_ok=True)
    # Another compare process (e.g. an earlier --setup-only) may be building it: wait for it.
    with (folder / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError as err:
            raise SetupBusy(f"{folder} is being built by another process") from err
        return _build_setup_locked(folder, seed, setup_of(cfg), threads, log or _log)


def _build_setup_locked(folder: Path, seed: int, setup: SyntheticSetupConfig, threads: int,
                        log: Callable[[str], None]) -> Path:
    recorded = folder / SETUP_FILE  # what the folder was (last) built from
    if recorded.exists():
        diff = setup_differences(recorded_setup(recorded.read_text()), setup)
        if diff:
            raise ConfigError(f"{folder} was built from another set-up: " + "; ".join(diff[:5]))
    if _setup_done(folder / "setup", setup):
        return folder / "setup"
    log(f"[compare] building the shared set-up of seed {seed} in {folder}")
    with (folder / "setup.log").open("a") as out_log:
        returncode = build_in_child(setup, folder, stdout=out_log, env=_thread_env(threads))
    if returncode != 0 or not _setup_done(folder / "setup", setup):
        raise RuntimeError(f"building the set-up of seed {seed} failed (exit {returncode}); see {folder / 'setup.log'}")
    return folder / "setup"


def recorded_setup(text: str) -> SyntheticSetupConfig:
    """The set-up a folder's ``setup_config.toml`` records: the set-up's sections, or (folders
    built before the set-up took its sections alone) a whole run config, whose sections are taken."""
    try:
        return loads_config(SyntheticSetupConfig, text)
    except ConfigError:
        return setup_of(loads_config(TrainConfig, text))


def _setup_done(setup_folder: Path, setup: SyntheticSetupConfig) -> bool:
    model = "warm_start" if setup.task.warm_start_enabled else "random_init"
    return (setup_folder / model / "DONE").exists() and (setup_folder / "corpus.jsonl").exists()


def link_setup(shared: Path, run_dir: Path) -> None:
    """Hard-link the shared set-up into ``run_dir/setup`` (a copy where links fail); a partial
    earlier attempt is replaced. The set-up is only read after it is built, so links are safe."""
    target = run_dir / "setup"
    if target.exists() and _same_tree(shared, target):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "setup.linking"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(shared, tmp, copy_function=_link_or_copy)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b


def _thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def is_finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def run_training(spec: RunSpec, threads: int, commit: str) -> int:
    """Run (or resume) one training run in a subprocess; its output goes to ``run_dir/train.log``
    and its provenance (commit, threads, wall time, load average) to ``run_dir/compare_run.json``."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    info_path = spec.run_dir / RUN_INFO
    info = json.loads(info_path.read_text()) if info_path.exists() else {"attempts": []}
    attempt = {"commit": commit, "threads": threads, "started": _now(), "loadavg_start": list(os.getloadavg()),
               "argv": list(spec.argv)}
    t0 = time.perf_counter()
    with (spec.run_dir / "train.log").open("a") as log:
        proc = subprocess.run([sys.executable, "-m", "aepo_engine.train", *spec.argv, "--checkpoint.resume=auto"],
                              stdout=log, stderr=subprocess.STDOUT, env=_thread_env(threads))
    attempt.update(finished=_now(), wall_s=round(time.perf_counter() - t0, 1), returncode=proc.returncode,
                   loadavg_end=list(os.getloadavg()))
    info["attempts"].append(attempt)
    info_path.write_text(json.dumps(info, indent=1))
    return proc.returncode


def _log(message: str) -> None:
    print(message, flush=True)  # the grid runs for hours under nohup: show progress as it goes


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_grid(out: Path, specs: list[RunSpec], configs: dict[RunSpec, TrainConfig], jobs: int,
             log=None, on_done=None, threads: int | None = None, setup_only: bool = False) -> dict[str, str]:
    """Build the per-seed set-ups, then run every unfinished spec, ``jobs`` at a time, in order.

    A seed's set-up is queued just before its first run; a run waits for its set-up, and idle
    workers take the next startable task (often the next seed's set-up) meanwhile.
    ``on_done()`` is called (one call at a time) after each run that finished.

    Returns:
        ``{run name: "done" | "skipped" | "failed (...)"}`` (``{"setup/seed<N>": ...}`` with setup_only).
    """
    log = log or _log
    done_lock = threading.Lock()
    threads = threads or max(1, (os.cpu_count() or 1) // jobs)
    commit = git_commit()
    todo = [s for s in specs if not is_finished(s.run_dir) and configs[s].task.source == "synthetic"]
    first_of_seed = {s.seed: s for s in reversed(todo)}
    seeds = list(dict.fromkeys(s.seed for s in todo))
    ready = {seed: threading.Event() for seed in seeds}
    shared: dict[int, Path | Exception] = {}

    def setup(seed: int) -> str:
        try:
            shared[seed] = build_setup(out, seed, configs[first_of_seed[seed]], threads, log, wait=False)
        except SetupBusy:
            return "busy"  # not ready: the runs of the seed keep waiting
        except Exception as err:  # noqa: BLE001 - reported by every run of the seed
            shared[seed] = err
            log(f"[compare] set-up of seed {seed} failed: {type(err).__name__}: {err}")
        ready[seed].set()
        return "done" if isinstance(shared[seed], Path) else f"failed ({shared[seed]})"

    def one(spec: RunSpec) -> str:
        try:
            return run_spec(spec)
        except Exception as err:  # noqa: BLE001 - one broken run must not stop the grid
            log(f"[compare] {spec.name}: failed: {type(err).__name__}: {err}")
            return f"failed ({type(err).__name__}: {err})"

    def run_spec(spec: RunSpec) -> str:
        if is_finished(spec.run_dir):
            log(f"[compare] {spec.name}: finished earlier, skipped")
            return "skipped"
        if spec.seed in ready:
            ready[spec.seed].wait()
            if isinstance(shared[spec.seed], Exception):
                raise RuntimeError(f"no set-up for seed {spec.seed}: {shared[spec.seed]}")
            link_setup(shared[spec.seed], spec.run_dir)
        log(f"[compare] {spec.name}: running ({threads} threads) -> {spec.run_dir}")
        rc = run_training(spec, threads, commit)
        outcome = "done" if rc == 0 and is_finished(spec.run_dir) else f"failed (exit {rc})"
        log(f"[compare] {spec.name}: {outcome}")
        if outcome == "done" and on_done is not None:
            with done_lock:
                on_done()
        return outcome

    # The queue: each seed's set-up just before the first run of that seed. A worker takes the first
    # task it can start (a run once its seed's set-up is built), so idle workers build the next
    # seeds' set-ups while the first runs go.
    queue: list[tuple[str, Any, Any]] = []
    for spec in specs:
        if spec.seed in ready and not any(name == f"setup/seed{spec.seed}" for name, _, _ in queue):
            queue.append((f"setup/seed{spec.seed}", setup, spec.seed))
        if not setup_only:
            queue.append((spec.name, one, spec))
    results: dict[str, str] = {}
    cond = threading.Condition()

    retry_at: dict[str, float] = {}  # set-ups another process is building: look again later

    def startable(task: tuple[str, Any, Any]) -> bool:
        if task[1] is setup:
            return time.monotonic() >= retry_at.get(task[0], 0.0)
        return task[2].seed not in ready or ready[task[2].seed].is_set()

    def worker() -> None:
        while True:
            with cond:
                while queue and not any(startable(t) for t in queue):
                    cond.wait(timeout=min(5.0, SETUP_RETRY_S))
                if not queue:
                    return
                task = next(t for t in queue if startable(t))
                position = queue.index(task)
                queue.remove(task)
            outcome = task[1](task[2])
            with cond:
                if outcome == "busy":  # back in its place; this worker takes something else
                    queue.insert(position, task)
                    if task[0] not in retry_at:
                        log(f"[compare] {task[0]}: another process is building it; looking again every {SETUP_RETRY_S:g} s")
                    retry_at[task[0]] = time.monotonic() + SETUP_RETRY_S
                else:
                    results[task[0]] = outcome
                cond.notify_all()

    threads_ = [threading.Thread(target=worker, daemon=True) for _ in range(jobs)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join()
    if setup_only:
        return results
    return {spec.name: results[spec.name] for spec in specs}
