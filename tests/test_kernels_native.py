"""The native C row kernel of the one-pass loss (aepo_kernels.native): against the float64
reference on shapes around its vector width, strided rows, in place or not, rows split across
threads, extreme rows (underflowing exp, NaN), its dispatch and its build's failure modes."""
import ctypes
import mmap
import os
import subprocess
import sys
import time

import pytest
import torch

from aepo_kernels import LossConfig, aepo_policy_loss, fused_linear_aepo_policy_loss, native
from aepo_kernels.one_pass import aggregation_weights, torch_one_pass
from aepo_kernels.reference import aepo_loss_reference
from aepo_kernels.row_inputs import RowInputs


def _inputs(batch, seq, vocab, seed, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=gen) * scale
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, 0] = -100
    old = torch.log_softmax(logits + torch.randn(batch, seq, vocab, generator=gen), -1)
    old_logprobs = old.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    advantages = torch.randn(batch, generator=gen) * 2
    mask = (torch.rand(batch, seq, generator=gen) > 0.2).float()
    ref = old_logprobs + 0.2 * torch.randn(batch, seq, generator=gen)
    return logits, labels, old_logprobs, advantages, mask, ref


def _reference64(logits, labels, old, adv, mask, cfg, temperature, ref):
    leaf = logits.double().clone().requires_grad_()
    loss = aepo_loss_reference(leaf, labels, old.double(), adv.double().unsqueeze(-1).expand_as(old), mask.double(),
                               cfg, temperature, ref_logprobs=None if ref is None else ref.double())
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 4099])
@pytest.mark.parametrize("in_place", [False, True])
def test_native_matches_float64_reference_around_the_vector_width(vocab, in_place):
    cfg = LossConfig(clip="aepo", kl_coef=0.05, entropy_coef=0.01)
    logits, labels, old, adv, mask, ref = _inputs(2, 9, vocab, seed=vocab)
    expected_loss, expected_grad = _reference64(logits, labels, old, adv, mask, cfg, 0.7, ref)
    leaf = logits.clone().requires_grad_()
    loss, _ = aepo_policy_loss(leaf * 1.0, labels, old, adv, mask, config=cfg, temperature=0.7, backend="torch",
                               inplace_backward=in_place, ref_logprobs=ref, shift_labels=False)
    loss.backward()
    torch.testing.assert_close(loss.double(), expected_loss, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(leaf.grad.double(), expected_grad, atol=1e-7, rtol=1e-4)


def test_exp_is_within_two_ulp_and_flushes_below_the_normal_range():
    """The kernel's exp against float64 exp on 1M points of [-87.3, 0] plus the edges: at most 2
    units in the last place of float32; exactly 0 for -inf and below the normal range; NaN stays."""
    x = torch.cat([torch.linspace(-87.3, 0.0, 1_000_001), -torch.rand(100_000) * 20, torch.tensor([0.0, -1e-30])])
    y = native.exp_nonpos(x).double()
    exact = x.double().exp()
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))) - exact.float()).double()
    assert ((y - exact).abs() / ulp).max() <= 2.0
    edges = native.exp_nonpos(torch.tensor([float("-inf"), -88.0, -1000.0, float("nan")]))
    assert edges[:3].tolist() == [0.0, 0.0, 0.0] and torch.isnan(edges[3])


def test_rows_split_across_threads_strided_and_out_of_range_labels(monkeypatch):
    """7 rows over 2 threads (uneven split), a strided view of the logits and of the output, a
    label >= V (no target): native rows and gradient equal the compiled torch path's."""
    monkeypatch.setattr(native, "_MIN_ELEMS_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = LossConfig(clip="gppo", entropy_adv_alpha=0.3)
        logits, labels, old, adv, mask, _ = _inputs(1, 8, 333, seed=3)
        labels[0, 3] = 333
        base = torch.zeros(1, 8, 400)
        base[..., :333] = logits
        view = base[:, 1:, :333]  # row stride 400, 7 rows
        inputs = RowInputs(old[:, 1:], adv.unsqueeze(-1).expand(1, 7).contiguous(),
                           aggregation_weights(mask[:, 1:], cfg), torch.tensor(1.5), torch.tensor(0.7))
        out_native = torch.full((1, 7, 400), 7.0)[..., :333]
        out_torch = torch.empty(1, 7, 333)
        rows_native = native.native_one_pass(view, labels[:, 1:], inputs, cfg, 1.1, -100, out_native)
        rows_torch = torch_one_pass(view, labels[:, 1:], inputs, cfg, 1.1, -100, out_torch)
        torch.testing.assert_close(rows_native, rows_torch, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out_native, out_torch, atol=1e-8, rtol=1e-5)
        assert rows_native[0, 0, 2].item() == 0.0  # label >= V: logp 0, no target
        assert (base[..., 333:] == 0).all()  # nothing written outside the view
    finally:
        torch.set_num_threads(threads)


def _fresh_pages(nbytes: int) -> mmap.mmap:
    """A new anonymous mapping of ``nbytes``, none of its pages in memory yet, and no transparent
    huge pages (a host with THP "always" would fault 2 MiB at a time whatever the kernel writes)."""
    buffer = mmap.mmap(-1, nbytes)
    buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return buffer


def _resident_pages(buffer: mmap.mmap) -> torch.Tensor:
    """Which pages of ``buffer`` are in memory (mincore(2)): of this mapping alone, where the
    process's RSS also moves with everything else the process and the machine do."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-len(buffer) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(buffer)), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return torch.tensor(list(vector), dtype=torch.uint8) & 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore of a mapping (Linux)")
def test_prefault_covers_a_dense_output_only():
    """The kernel faults a new output in with madvise(MADV_POPULATE_WRITE) before its sweeps, but
    only when the output rows are back to back (all of the range is written). Into every other
    row of a fresh 64 MiB buffer it must fault in just the rows it writes: the pages of the rows
    it skips stay out of memory (a populate over the whole span would bring them in)."""
    cfg = LossConfig()
    rows, vocab = 32, 1 << 18  # a 1 MiB row (256 pages); the buffer below holds 64 rows
    _, labels, old, adv, mask, _ = _inputs(1, rows, 64, seed=5)  # labels < 64 <= vocab
    logits = torch.randn(1, rows, vocab)
    inputs = RowInputs(old, adv.unsqueeze(-1).expand(1, rows).contiguous(), aggregation_weights(mask, cfg),
                       torch.tensor(1.0), torch.tensor(0.5))
    pages = _fresh_pages(2 * rows * vocab * 4)
    buffer = torch.frombuffer(pages, dtype=torch.float32).view(1, 2 * rows, vocab)
    assert _resident_pages(pages).sum() == 0
    rows_sparse = native.native_one_pass(logits, labels, inputs, cfg, 1.0, -100, buffer[:, ::2])
    resident = _resident_pages(pages).view(2 * rows, -1)  # [64 rows, 256 pages]
    assert resident[0::2].all(), "a written row is not in memory"
    assert not resident[1::2].any(), f"{int(resident[1::2].sum())} pages of skipped rows were faulted in"
    dense = torch.empty(1, rows, vocab)
    rows_dense = native.native_one_pass(logits, labels, inputs, cfg, 1.0, -100, dense)
    torch.testing.assert_close(rows_dense, rows_sparse, atol=0, rtol=0)
    torch.testing.assert_close(dense, buffer[:, ::2], atol=0, rtol=0)


def test_peaked_rows_underflow_to_zero_and_nan_stays_in_its_row():
    """A row whose mass sits on one logit (every other exp underflows below 2^-126 -> 0, not a
    denormal or garbage) and a row with a NaN logit: the first matches the reference, the NaN row
    is NaN in its loss and gradient, the other rows stay finite."""
    cfg = LossConfig()
    logits, labels, old, adv, mask, _ = _inputs(1, 4, 1000, seed=7)
    mask[:] = 1
    logits[0, 1] = -200.0
    logits[0, 1, labels[0, 1]] = 10.0
    expected_loss, expected_grad = _reference64(logits, labels, old, adv, mask, cfg, 1.0, None)
    leaf = logits.clone().requires_grad_()
    loss, _ = aepo_policy_loss(leaf, labels, old, adv, mask, config=cfg, backend="torch", shift_labels=False)
    loss.backward()
    torch.testing.assert_close(loss.double(), expected_loss, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(leaf.grad.double(), expected_grad, atol=1e-7, rtol=1e-4)
    assert leaf.grad[0, 1].abs().sum() == 0  # p = 1 on the target, exactly 0 elsewhere: no gradient

    logits[0, 2, 17] = float("nan")
    out = torch.empty_like(logits)
    inputs = RowInputs(old, adv.unsqueeze(-1).expand_as(old), aggregation_weights(mask, cfg), torch.tensor(0.0),
                       torch.tensor(0.0))
    rows = native.native_one_pass(logits, labels, inputs, cfg, 1.0, -100, out)
    assert torch.isnan(rows[2, 0, 2]) and torch.isnan(out[0, 2]).all()
    keep = [1, 3]
    assert torch.isfinite(rows[:, 0, keep]).all() and torch.isfinite(out[0, keep]).all()


@pytest.mark.slow
def test_dispatch_takes_native_only_where_it_applies(monkeypatch):
    calls = []
    real = native.native_one_pass
    monkeypatch.setattr(native, "native_one_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, labels, old, adv, mask, _ = _inputs(2, 5, 101, seed=1)
    for dtype, softcap, env, expected in [(torch.float32, None, "1", 1), (torch.bfloat16, None, "1", 0),
                                          (torch.float32, 30.0, "1", 0), (torch.float32, None, "0", 0)]:
        calls.clear()
        monkeypatch.setenv("AEPO_CPU_NATIVE", env)
        aepo_policy_loss(logits.to(dtype).requires_grad_(), labels, old, adv, mask, backend="torch", softcap=softcap, shift_labels=False)
        assert len(calls) == expected, (dtype, softcap, env)
    # fused-linear's row op on fp32 logits blocks (in place, so through the scratch row)
    calls.clear()
    monkeypatch.setenv("AEPO_CPU_NATIVE", "1")
    hidden, weight = torch.randn(10, 16, requires_grad=True), torch.randn(101, 16, requires_grad=True)
    fused_linear_aepo_policy_loss(hidden, weight, labels.reshape(-1), old.reshape(-1),
                                  adv.unsqueeze(-1).expand_as(old).reshape(-1), mask.reshape(-1), backend="torch", shift_labels=False)
    assert len(calls) >= 1


def test_build_errors_name_the_switch(monkeypatch, tmp_path):
    monkeypatch.setenv("AEPO_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(RuntimeError, match="AEPO_CPU_NATIVE=0"):
        native.build()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="no C compiler.*AEPO_CPU_NATIVE=0"):
        native.build()
    assert not list((tmp_path / "cache").glob("*.tmp"))  # no half-written library left behind
    monkeypatch.delenv("CC")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("AEPO_NATIVE_CACHE", str(tmp_path / "file" / "cache"))  # under a file: not creatable
    with pytest.raises(RuntimeError, match="AEPO_NATIVE_CACHE"):
        native.build()


@pytest.mark.slow
def test_build_is_cached_and_shared_by_concurrent_processes(tmp_path):
    """Two processes build into an empty cache at once (as torchrun ranks do): both load a working
    library, one file is left, and a third process reuses it without compiling."""
    code = ("import os, sys, torch; from aepo_kernels import native; p = native.build(); "
            "lib = native.library(); print(p)")
    env = {**os.environ, "AEPO_NATIVE_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert [f.name for f in tmp_path.iterdir()] == [next(iter(paths)).rsplit("/", 1)[1]]
    mtime = next(tmp_path.iterdir()).stat().st_mtime_ns
    third = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and next(tmp_path.iterdir()).stat().st_mtime_ns == mtime


def test_a_forked_child_gets_its_own_threads(monkeypatch):
    """After os.fork the parent's pool threads do not exist in the child: the child's call must
    not wait on them forever (it would hang without the per-pid pool)."""
    monkeypatch.setattr(native, "_MIN_ELEMS_PER_THREAD", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits, labels, old, adv, mask, _ = _inputs(1, 6, 50, seed=4)
        inputs = RowInputs(old, adv.unsqueeze(-1).expand_as(old), aggregation_weights(mask, LossConfig()),
                           torch.tensor(0.0), torch.tensor(0.0))
        expected = native.native_one_pass(logits, labels, inputs, LossConfig(), 1.0, -100, torch.empty_like(logits))
        time.sleep(0.2)  # the pool's threads are idle (and counted so) when the fork happens
        pid = os.fork()
        if pid == 0:  # child: exit code 0 only if the result is right
            got = native.native_one_pass(logits, labels, inputs, LossConfig(), 1.0, -100, torch.empty_like(logits))
            os._exit(0 if torch.equal(got, expected) else 1)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung in native_one_pass")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)
