"""`tiercache bench overhead`: the store's own Python per batch of host<->device moves, with
the CPU caches warm and cold.

``bench io`` compares a batch of moves with a plain copy of the same bytes; what the store
adds is its books (planning the moves, the batch, completing them), and on CPU that is the
gap. Here the blocks are tiny (16 tokens of one 64-wide head: 8 KiB of K and V), so a
round's time is the books plus the copy calls themselves, which a baseline copy pays too
(about 0.1 ms of a 43-block round: two torch ``copy_`` calls of 172 KiB each, timed inside
the store). Each batch size runs two ways, one pass of each in turn: ``warm``, rounds back
to back, and ``cold``, each round right after a copy of ``--flush`` bytes between two
buffers of its own (untimed), as a round of ``bench io``'s 1.5 MiB blocks is (64 MiB, twice
this machine's 32 MiB L3): the store's code and data then come back from memory. ``d2h``
rounds are ``demote_now``, ``h2d`` rounds ``ensure_device`` (pin=False), as in ``bench
io``. It prints the median milliseconds per round and microseconds per block, and
``cold_extra_ms``, cold minus warm: a cost per round, not per block, where it stays flat as
the batch grows. ``--metrics`` attaches the Prometheus exporter (``CacheMetrics``) to the
store's events first, as ``serve_metrics`` does, so that its cost per batch is counted too.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

from tiercache.bench.io import _put_random_blocks
from tiercache.cli import Parser, doc_summary, int_list
from tiercache.config import TierConfig, format_bytes, parse_bytes
from tiercache.metrics import CacheMetrics
from tiercache.store import BlockStore
from tiercache.table import BlockKey, Tier
from tiercache.tiers import BlockGeometry

GEOMETRY = BlockGeometry(1, 1, 16, 64, torch.float32)  # 8 KiB of K and V: copies cost ~nothing
BATCHES = (10, 43, 86)  # blocks per round; 43 is a round of bench io (64 MiB of 1.5 MiB blocks)
MAX_BATCH = 4096  # the store holds 8 rounds of the largest: 256 MiB of blocks on each of two tiers


def measure_overhead(batches: tuple = BATCHES, repeat: int = 8, flush_bytes: int = 64 << 20,
                     device: str = "cpu", metrics: bool = False) -> dict:
    """Median ms per round of the store's host<->device books, warm and after a cache flush,
    for each batch size (see the module's docstring). ``device="cuda"``: the store on the
    GPU, its moves through the staging buffer and the copy stream (the flush is still a CPU
    copy: it chills the CPU's caches, where the books run). ``metrics``: with the Prometheus
    exporter listening to the store's events."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if repeat < 1:
        raise ValueError(f"--repeat: must be >= 1, got {repeat}")
    if not batches or min(batches) < 2 or max(batches) > MAX_BATCH:
        raise ValueError(f"--batches: need sizes of 2 (a batch) to {MAX_BATCH} blocks, got {list(batches)}")
    if flush_bytes < 1:
        raise ValueError(f"--flush: must be > 0, got {flush_bytes}")
    num_blocks = max(batches) * 8
    keys = [BlockKey(0, 0, i) for i in range(num_blocks)]
    config = TierConfig(device_budget=num_blocks * GEOMETRY.block_bytes, host_budget=num_blocks * GEOMETRY.padded_bytes,
                        disk_budget=0, block_tokens=GEOMETRY.block_tokens, io_workers=2)
    physical = _physical_memory()
    if physical and 2 * flush_bytes > physical // 2:
        raise ValueError(f"--flush: two buffers of {format_bytes(flush_bytes)} are more than half of this "
                         f"machine's memory ({format_bytes(physical)})")
    try:
        src = torch.ones(flush_bytes, dtype=torch.uint8)
        dst = torch.zeros(flush_bytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator: "can't allocate memory"
        raise ValueError(f"--flush: cannot allocate two buffers of {format_bytes(flush_bytes)} ({exc})") from None
    times: dict = {}  # (batch, phase, "warm" | "cold") -> [ms per round]
    with BlockStore(config, GEOMETRY, device=torch.device(device), persistent=False) as store:
        exporter = CacheMetrics(store) if metrics else None  # reads store.events and store.stats()
        _put_random_blocks(store, keys, GEOMETRY, torch.device(device))
        for _ in range(repeat):
            for batch in batches:
                groups = [keys[i:i + batch] for i in range(0, num_blocks - batch + 1, batch)]
                for mode in ("warm", "cold"):
                    store.drop_copies(Tier.HOST)  # every block on the device only, as at the start
                    gc.collect()
                    gc.disable()
                    try:
                        for phase in ("d2h", "h2d"):
                            out = times.setdefault((batch, phase, mode), [])
                            for group in groups:
                                if mode == "cold":
                                    dst.copy_(src)
                                t0 = time.perf_counter()
                                if phase == "d2h":
                                    errors = store.demote_now(group)
                                    if errors:
                                        raise errors[0]
                                else:
                                    store.ensure_device(group, pin=False)
                                out.append((time.perf_counter() - t0) * 1e3)
                    finally:
                        gc.enable()
        store.check()
        exported = None
        if exporter is not None:  # moves its histogram counted: every one, batched or not
            family = next(f for f in exporter.collect() if f.name == "tiercache_move_seconds")
            exported = sum(s.value for s in family.samples if s.name.endswith("_count"))
            exporter.close()
    rows = []
    for batch in batches:
        for phase in ("d2h", "h2d"):
            warm = statistics.median(times[batch, phase, "warm"])
            cold = statistics.median(times[batch, phase, "cold"])
            rows.append({"blocks": batch, "phase": phase, "rounds": len(times[batch, phase, "warm"]),
                         "warm_ms": round(warm, 4), "cold_ms": round(cold, 4),
                         "warm_us_per_block": round(warm * 1e3 / batch, 2),
                         "cold_us_per_block": round(cold * 1e3 / batch, 2),
                         "cold_extra_ms": round(cold - warm, 4)})
    return {"device": device, "block_bytes": GEOMETRY.block_bytes, "flush_bytes": flush_bytes, "repeat": repeat,
            "metrics": metrics, "exported_moves": exported, "rows": rows}


def _physical_memory() -> int:
    """Bytes of RAM, or 0 where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="tiercache bench overhead", description=doc_summary(__doc__))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=8, help="passes over every batch size (default %(default)s)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="blocks per round, a comma list (default %(default)s)")
    p.add_argument("--flush", default="64MiB", help="bytes copied before each cold round (default %(default)s)")
    p.add_argument("--device", default="cpu", help="the store's device: cpu (default) or cuda")
    p.add_argument("--metrics", action="store_true", help="with the Prometheus exporter attached to the store's events")
    return p


def run(argv: Optional[list] = None) -> int:
    """Entry point of ``tiercache bench overhead``; returns the exit status."""
    args = _parser().parse_args(argv)
    # errors (ValueError, CLIError) reach the command line's one-line "tiercache: error: ..."
    batches = tuple(int_list("--batches", args.batches, 2, MAX_BATCH))
    result = measure_overhead(batches, args.repeat, parse_bytes(args.flush, "--flush"), args.device, args.metrics)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"tiercache bench overhead: the store's books per round of host<->device moves ({result['device']}), "
          f"{result['block_bytes']} B blocks, cold = after a {format_bytes(result['flush_bytes'])} copy"
          + (", Prometheus exporter attached" if result["metrics"] else ""))
    print(f"{'blocks':>6} {'phase':>5} | {'warm ms':>8} {'us/blk':>7} | {'cold ms':>8} {'us/blk':>7} | {'extra ms':>8}")
    for r in result["rows"]:
        print(f"{r['blocks']:>6} {r['phase']:>5} | {r['warm_ms']:>8.3f} {r['warm_us_per_block']:>7.2f} | "
              f"{r['cold_ms']:>8.3f} {r['cold_us_per_block']:>7.2f} | {r['cold_extra_ms']:>8.3f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
