"""The checksum a checkpoint records per file: candidates' throughput on one core.

    python bench/bench_checksum.py [--mib 512] [--repeats 5]

Each candidate hashes the same random buffer in 8 MiB pieces (as ``aepo_engine.files.file_checksum``
reads a file); ``file_checksum`` itself is timed on a file of that size just written (so read from
the page cache: the CPU side of a verification, not the disk's). GB/s = bytes / median seconds
(bytes: the buffer's size, each byte read once). Rows go to ``bench/results/checksum.jsonl``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import RESULTS_DIR, machine  # noqa: E402

CHUNK = 8 << 20


def _stream(update: Callable[[memoryview], None], data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(data), CHUNK):
        update(view[start:start + CHUNK])


def candidates() -> dict[str, Callable[[bytes], None]]:
    import xxhash

    def crc32(data: bytes) -> None:
        state = 0
        view = memoryview(data)
        for start in range(0, len(data), CHUNK):
            state = zlib.crc32(view[start:start + CHUNK], state)

    return {
        "xxh3_64 (xxhash)": lambda data: _stream(xxhash.xxh3_64().update, data),
        "xxh64 (xxhash)": lambda data: _stream(xxhash.xxh64().update, data),
        "crc32 (zlib)": crc32,
        "blake2b (hashlib)": lambda data: _stream(hashlib.blake2b().update, data),
        "sha256 (hashlib)": lambda data: _stream(hashlib.sha256().update, data),
    }


def timed(fn: Callable[[], None], repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "checksum.jsonl")
    args = parser.parse_args()
    from aepo_engine.files import file_checksum

    data = os.urandom(args.mib << 20)
    info = machine()
    rows = []
    for name, fn in candidates().items():
        rows.append((name, timed(lambda: fn(data), args.repeats)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob"
        path.write_bytes(data)
        rows.append(("file_checksum (xxh3_64, page cache)", timed(lambda: file_checksum(path), args.repeats)))
    with args.out.open("a") as out:
        for name, times in rows:
            median = statistics.median(times)
            row = {**info, "case": name, "bytes": len(data), "repeats": args.repeats, "median_s": median,
                   "spread_s": max(times) - min(times), "gb_per_s": len(data) / median / 1e9,
                   "load": os.getloadavg()[0]}
            out.write(json.dumps(row) + "\n")
            print(f"{name:40s} {row['gb_per_s']:6.2f} GB/s (median of {args.repeats}, spread {row['spread_s']:.3f} s)")
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
