"""The native CPU row kernel of the one-pass loss: ``csrc/one_pass_rows.c``, built on first use.

Why a hand-written kernel beside the compiled torch path: inductor turns the stats sweep, the
per-token head and the gradient sweep into separate loops over all rows of a chunk, so the
gradient sweep reads each row from memory again and evaluates ``exp`` a second time. The C kernel
processes one row at a time while it sits in the core's L2 cache (a 151,936-float row is 0.6 MB):
the row is read from memory once, ``exp`` is evaluated once per element (its values kept in the
output row, or in a per-thread scratch row when writing in place), and the gradient is written
once -- the bytes of a plain copy plus one ``exp`` per element. A new (not in-place, dense) output
has its pages faulted in by one ``madvise(MADV_POPULATE_WRITE)`` per thread before the sweeps
instead of one page fault per 4 KiB page inside them (Linux >= 5.14; elsewhere a no-op).

Scope: fp32 logits on the CPU with unit stride along the vocabulary and no soft cap. Everything
else (bf16/fp64 logits, soft-capped logits, CUDA tensors) takes the other paths of
:func:`aepo_kernels.one_pass.one_pass_rows`.

Build: the machine's C compiler (``$CC``, else ``cc``) with ``-O3 -march=native -fopenmp-simd``
(SIMD pragmas only: no OpenMP runtime is linked, so none clashes with torch's). The shared library
is cached under ``$AEPO_NATIVE_CACHE`` (default ``~/.cache/aepo_kernels``), named by a hash of the
source, the flags, the compiler's version and the CPU's feature flags, and written atomically, so
concurrent ranks and machines sharing a home directory are safe. Threads: one ctypes call per
thread (``torch.get_num_threads()``), each on a contiguous range of rows; ctypes releases the GIL.

Switch: ``AEPO_CPU_NATIVE=0`` disables it (the compiled torch path runs instead). Without a C
compiler on PATH it is off too, with one notice saying so (:mod:`aepo_kernels.compile`). When
enabled and the build fails, the first call raises with the compiler's message and names the
switch: a slow path is never chosen silently.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .compile import c_compiler, give_toolchain_notice
from .config import LossConfig, hyper_params
from .row_inputs import RowInputs

SOURCE = Path(__file__).with_name("csrc") / "one_pass_rows.c"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared", "-std=c11")
_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2  # logits, out with their strides
    + [ctypes.c_void_p] * 7  # labels, old, adv, weight, ref, mean_std, rows_out
    + [ctypes.c_int64] * 5  # r0, r1, n_rows, seq_len, vocab
    + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]  # inv_t, ignore_index, hp, scratch
    + [ctypes.c_void_p]  # adv_neg: the second advantage column, or NULL
)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_pool: ThreadPoolExecutor | None = None
_pool_key = (0, 0)  # (threads, pid): a forked child gets its own pool (the parent's threads are gone)


def enabled() -> bool:
    """Off with ``AEPO_CPU_NATIVE=0``, and where no C compiler is on PATH (then with one notice,
    :func:`aepo_kernels.compile.give_toolchain_notice`)."""
    if os.environ.get("AEPO_CPU_NATIVE", "1") == "0":
        return False
    if c_compiler() is None:
        give_toolchain_notice()
        return False
    return True


def supports(logits: torch.Tensor, out: torch.Tensor, tanh_scale: float | None) -> bool:
    """Whether the native kernel takes this call (see the module docstring for the scope)."""
    return (enabled() and tanh_scale is None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and out.dtype == torch.float32 and logits.stride(-1) == 1 and out.stride(-1) == 1)


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _cache_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    try:
        version = subprocess.run([*_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"aepo_kernels: no C compiler {shlex.join(_compiler())!r} for the native CPU kernel ({exc}); "
                           "set CC, or AEPO_CPU_NATIVE=0 to use the compiled torch path") from exc
    digest.update(version.encode())
    try:  # -march=native: a library built on one CPU must not be loaded on another
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        digest.update(flags.encode())
    except (OSError, StopIteration):
        pass
    return digest.hexdigest()[:20]


def build() -> Path:
    """Compiles the kernel into the cache (once per source, compiler and CPU); returns the path."""
    cache = Path(os.environ.get("AEPO_NATIVE_CACHE") or Path.home() / ".cache" / "aepo_kernels")
    target = cache / f"one_pass_rows-{_cache_key()}.so"
    if target.exists():
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so.tmp")
    except OSError as exc:
        raise RuntimeError(f"aepo_kernels: cannot write the native kernel's cache {cache} ({exc}); set "
                           "AEPO_NATIVE_CACHE to a writable folder, or AEPO_CPU_NATIVE=0") from exc
    os.close(fd)
    try:
        result = subprocess.run([*_compiler(), *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                                timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"aepo_kernels: building the native CPU kernel failed:\n{result.stderr[-2000:]}\n"
                               "Set AEPO_CPU_NATIVE=0 to use the compiled torch path instead.")
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            lib = ctypes.CDLL(str(build()))
            lib.aepo_one_pass_rows.argtypes = _ARGTYPES
            lib.aepo_one_pass_rows.restype = None
            lib.aepo_exp_nonpos.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            lib.aepo_exp_nonpos.restype = None
            _library = lib
    return _library


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    with _lock:
        key = (threads, os.getpid())
        if _pool is None or _pool_key != key:
            if _pool is not None and _pool_key[1] == key[1]:
                _pool.shutdown(wait=True)
            _pool, _pool_key = ThreadPoolExecutor(threads, thread_name_prefix="aepo-native"), key
    return _pool


def exp_nonpos(x: torch.Tensor) -> torch.Tensor:
    """The kernel's ``exp`` (meant for x <= 0) on a float32 tensor: for tests and measurements."""
    x = x.to(torch.float32).contiguous()
    y = torch.empty_like(x)
    library().aepo_exp_nonpos(x.data_ptr(), y.data_ptr(), x.numel())
    return y


# Below this many elements per thread a single call is cheaper than handing work to the pool.
_MIN_ELEMS_PER_THREAD = 1 << 18


def native_one_pass(logits, labels, inputs: RowInputs, config: LossConfig, inv_t: float, ignore_index: int, out,
                    tanh_scale: float | None = None) -> torch.Tensor:
    """The one-pass loss (contract of :func:`aepo_kernels.one_pass.torch_one_pass`) through the
    native kernel: returns rows ``[6, B, T]`` fp32, writes dlogits into ``out`` (may be ``logits``)."""
    if not supports(logits, out, tanh_scale):
        raise ValueError("native_one_pass: needs fp32 CPU logits and out with unit vocab stride, no soft cap")
    lib = library()
    batch, seq, vocab = logits.shape
    n_rows = batch * seq
    rows = torch.empty(6, batch, seq, dtype=torch.float32)
    if n_rows == 0:
        return rows
    flat = lambda t: t.reshape(n_rows).to(torch.float32).contiguous()  # noqa: E731
    keep = [labels.reshape(n_rows).to(torch.int64).contiguous(), flat(inputs.old_logprobs),
            flat(inputs.advantages), flat(inputs.weight), flat(inputs.ref_or_old),
            torch.stack([inputs.entropy_mean.reshape(()), inputs.entropy_std.reshape(())]).to(torch.float32)]
    adv_neg = None if inputs.advantages_neg is None else flat(inputs.advantages_neg)
    hp = hyper_params(config, inputs.ref_logprobs is not None, torch.float32, "cpu")
    threads = max(1, min(torch.get_num_threads(), n_rows, (n_rows * vocab) // _MIN_ELEMS_PER_THREAD or 1))
    scratch = torch.empty(threads, vocab, dtype=torch.float32) if out.data_ptr() == logits.data_ptr() else None
    common = (logits.data_ptr(), logits.stride(0), logits.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
              *(t.data_ptr() for t in keep), rows.data_ptr())
    tail = (n_rows, seq, vocab, float(inv_t), ignore_index, hp.data_ptr())

    def call(k: int, r0: int, r1: int) -> None:
        lib.aepo_one_pass_rows(*common, r0, r1, *tail, None if scratch is None else scratch[k].data_ptr(),
                               None if adv_neg is None else adv_neg.data_ptr())

    bounds = [n_rows * k // threads for k in range(threads + 1)]
    if threads == 1:
        call(0, 0, n_rows)
    else:
        for future in [_executor(threads).submit(call, k, bounds[k], bounds[k + 1]) for k in range(threads)]:
            future.result()
    return rows
