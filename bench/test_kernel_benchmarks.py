"""Kernel microbenchmarks under pytest-benchmark: saved baselines and diffs for speed regressions.

    python -m pytest bench/ -n 0 --benchmark-only --benchmark-autosave     # save a baseline
    python -m pytest bench/ -n 0 --benchmark-only --benchmark-compare      # diff against the last one

Cases: the ``small`` and ``mid`` shapes of ``bench_aepo_loss.SHAPES`` (the one table of shapes;
the subprocess script runs the big ones with whole-process peak memory), forward + backward of
the AEPO loss per implementation. Each case's peak resident-memory growth (harness.PeakMemory,
over the measured rounds) goes into ``extra_info["peak_bytes"]``. Skipped unless
``--benchmark-only`` is given, so a plain ``pytest`` run never times anything; ``-n 0`` keeps
them in one process (pytest.ini's default runs xdist workers, under which pytest-benchmark times
nothing).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_benchmark")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_aepo_loss import (  # noqa: E402
    SHAPES, case_env, loss_backward, loss_inputs, make_loss_fn, make_tensors, strip_env_suffix, warm_up,
)
from harness import PeakMemory  # noqa: E402

pytestmark = pytest.mark.skipif("not config.getoption('benchmark_only', False)",
                                reason="kernel benchmarks: python -m pytest bench/ -n 0 --benchmark-only")

LINEAR = ["one_pass_fused_linear", "two_stage_fused_linear", "one_pass_materialised", "two_stage_materialised"]
LOGITS = ["one_pass_inplace", "one_pass", "one_pass@compiled", "two_stage_inplace", "copy"]
ROUNDS = {"small": 5, "mid": 3}


def _run(benchmark, monkeypatch, level: str, name: str, shape: str) -> None:
    for key, value in case_env(name).items():  # e.g. one_pass@compiled: the native kernel off
        monkeypatch.setenv(key, value)
    impl = strip_env_suffix(name)
    n, d, vocab = SHAPES[level][shape]
    fn = make_loss_fn(impl, loss_inputs(n, vocab))
    base = make_tensors(level, n, d, vocab)
    warm_up(level, impl, base)
    needs_grad = impl != "copy"

    def setup():
        if level == "linear":
            for t in base:
                t.grad = None
            return tuple(base), {}
        leaf = base[0].clone().requires_grad_(needs_grad)
        return (leaf * 1.0 if needs_grad else leaf,), {}

    def body(*tensors):
        out = fn(*tensors)
        if needs_grad:
            loss_backward(level, out, list(tensors))

    memory = PeakMemory("cpu")
    memory.start()
    benchmark.pedantic(body, setup=setup, rounds=ROUNDS[shape], warmup_rounds=1)
    benchmark.extra_info.update(peak_bytes=memory.peak(), n=n, d=d, vocab=vocab, level=level)


@pytest.mark.parametrize("shape", ["small", "mid"])
@pytest.mark.parametrize("impl", LINEAR)
def test_linear_loss(benchmark, monkeypatch, impl, shape):
    _run(benchmark, monkeypatch, "linear", impl, shape)


@pytest.mark.parametrize("shape", ["small", "mid"])
@pytest.mark.parametrize("impl", LOGITS)
def test_logits_loss(benchmark, monkeypatch, impl, shape):
    _run(benchmark, monkeypatch, "logits", impl, shape)
