#!/usr/bin/env python
"""Benchmark: what checking every file of a local-tier restore against its checksum costs, as a
fraction of the restore (issue 36), and what taking the checksums costs a local save.

A local step is made of ``--shards`` files of ``--shard-mib`` MiB (random bytes, as optimizer shards
are) and a few small files. Three ways, interleaved ``--repeat`` times in one run:

- plain: the restore's copy as it was, ``shutil.copyfile`` of every file into a staging folder;
- checked: hfscale's restore copy, ``hfscale.checkpoints.local_tier.copy_all_checked`` (each file's
  CRC-32 computed on the way, in the same pass, and compared with the saved one; up to 8 files at
  once, as a node's restore copies them), and the same one file at a time;
- sums: the save's side, ``local_tier.sums_of`` of the same files (each file read back and its
  CRC-32 taken), which a node's ranks split between them after each local save.

The files are written once and read back many times: they sit in the page cache, so the copy is a
memory copy and the checksum's share is the largest it can be; from a cold NVMe (3 GB/s) or the
network its share is smaller. Each measure starts after ``os.sync()`` (no copy pays for the
previous one's write-back), and the order of the three alternates between rounds. Prints one line
per round and the medians.

    python bench/bench_restore_verify.py                         # 8 x 128 MiB
    python bench/bench_restore_verify.py --shards 4 --shard-mib 512 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hfscale.checkpoints import local_tier as tier  # noqa: E402


def make_step(folder: Path, shards: int, shard_mib: int) -> dict[str, int]:
    files = {f"global_step5/zero_pp_rank_{i}_mp_rank_00_optim_states.pt": shard_mib << 20 for i in range(shards)}
    files.update({"trainer_state.json": 4096, "rng_state_0.pth": 15000, "scheduler.pt": 1500})
    block = os.urandom(1 << 20)
    for rel, size in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(block)
            f.write(os.urandom(size % (1 << 20)))
    return files


def timed(work) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hfscale-bench-verify-") as tmp:
        src, dst = Path(tmp) / "own" / "checkpoint-5", Path(tmp) / "staging"
        files = make_step(src, a.shards, a.shard_mib)
        total = sum(files.values())
        sums = tier.sums_of(src, files)
        sources = {rel: tier.Source(str(src), tier.OWN, sums[rel]) for rel in files}

        def plain() -> None:
            for rel in files:
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, dst / rel)

        def checked() -> None:  # as a node's restore copies its files: several at once
            assert set(tier.copy_all_checked(sources, dst).values()) == {None}

        def checked_one_at_a_time() -> None:
            for rel, source in sources.items():
                assert tier.copy_checked(rel, source, dst) is None

        def summed() -> None:
            tier.sums_of(src, files)

        rows: dict[str, list[float]] = {"plain": [], "checked": [], "serial": [], "sums": []}
        plain(), checked()  # warm: every file in the page cache, the staging folder made
        for r in range(a.repeat):
            order = [("plain", plain), ("checked", checked), ("serial", checked_one_at_a_time), ("sums", summed)]
            for name, work in order if r % 2 == 0 else order[::-1]:  # neither always first
                if name != "sums":
                    shutil.rmtree(dst, ignore_errors=True)
                os.sync()  # the previous copy's dirty pages written back: no way's copy pays for another's
                rows[name].append(timed(work))
            print(f"round {r + 1}: plain copy {rows['plain'][-1]:.3f} s, checked copy {rows['checked'][-1]:.3f} s "
                  f"({rows['serial'][-1]:.3f} s one file at a time), checksums alone {rows['sums'][-1]:.3f} s", flush=True)
    gib = total / 2**30
    p, c, one, s = (statistics.median(rows[k]) for k in ("plain", "checked", "serial", "sums"))
    print(f"{len(files)} files, {gib:.2f} GiB, page cache, median of {a.repeat}:")
    print(f"  restore copy: plain {p:.3f} s ({gib / p:.2f} GiB/s), checked {c:.3f} s ({gib / c:.2f} GiB/s): "
          f"the check is {(c - p) / c:.1%} of the checked restore ({c / p:.2f}x the plain copy; one file at a time "
          f"{one:.3f} s, {one / p:.2f}x; {os.cpu_count()} cores here)")
    print(f"  save side: checksums of the step {s:.3f} s ({gib / s:.2f} GiB/s on one core); split over 8 ranks "
          f"of a node, {s / 8 * (3.2 / gib):.3f} s per local save of a 3.2 GB node part")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
