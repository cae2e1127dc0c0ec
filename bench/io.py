"""`tiercache bench io`: the store's disk and host<->device moves against the raw hardware.

One measurement (``measure_io``) does, in one fresh directory and one run:

1. puts ``num_blocks`` blocks on the device tier, then times the store moving all of them
   device->host (d2h), then host->disk (write), and, after dropping the page cache,
   disk->host (read) and host->device (h2d). Every phase submits all its moves at once
   (``demote_many``, ``promote`` per block, ``ensure_device``) and waits for all of them, so
   ``io_workers`` moves are in flight: rate = bytes / wall time. The garbage collector runs
   before every timed phase and is off during it, for the store and the plain copy alike;
2. right after the store's write (and read), the raw disk with the same request size (one
   disk record: header + padded payload), the same number of requests and the same
   concurrency (``io_workers`` threads of synchronous I/O) on a file in the same directory:
   fio when installed, else ``dd`` processes running side by side;
3. a plain ``dst.copy_(src)`` of the same total bytes between host memory and the device
   (RAM on CPU; pinned host memory and the GPU with ``non_blocking`` copies on CUDA), the
   best of three.

The files are fresh in every measurement, for the store and for the raw tool alike (a long
run's cache grows into new slots, so that is the write the store does most); the raw file
is laid out with fallocate before it is written, as fio does by default.

Store rates count payload bytes (what the cache gets back); raw rates count every byte the
disk moves, so the 4 KiB record header is part of the store's overhead. GB/s = 1e9 B/s.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch

from tiercache.config import TierConfig, format_bytes, parse_bytes
from tiercache.disk import DiskTier
from tiercache.store import BlockStore
from tiercache.table import BlockKey, Tier
from tiercache.tiers import BlockGeometry, aligned_buffer
from tiercache.transfer import wait_all

# The default model (SmolLM2-135M): 3 KV heads of 64 dims in fp32 -> 1536 bytes per token.
KV_HEADS, HEAD_DIM, DTYPE = 3, 64, torch.float32
SWEEP_BLOCK_TOKENS = (64, 128, 256, 512, 1024)
RATIOS = {  # ratio: (the store's rate, the baseline's rate)
    "write_ratio": ("write_gbps", "raw_write_gbps"),
    "read_ratio": ("read_gbps", "raw_read_gbps"),
    "d2h_ratio": ("d2h_gbps", "copy_d2h_gbps"),
    "h2d_ratio": ("h2d_gbps", "copy_h2d_gbps"),
}
NUM_RANDOM_BLOCKS = 64  # distinct random contents, cycled over the blocks put
PLAIN_COPY_RUNS = 3


def measure_io(directory: str, block_tokens: int, total_bytes: int, workers: int, *,
               raw_tool: str = "auto", device: Optional[str] = None) -> dict:
    """Measure the store's tier moves and the raw hardware with ~``total_bytes`` of blocks.

    Args:
        directory: where the disk tier and the raw test file go (a temporary folder inside
            it is created and removed).
        block_tokens: tokens per block (a block of the default model is 1536 * T bytes).
        total_bytes: bytes of blocks to move (at least one block).
        workers: the store's ``io_workers``; also the raw tool's number of parallel jobs.
        raw_tool: "fio", "dd", or "auto" (fio when installed, else dd).
        device: where the device tier lives; CUDA when available, else CPU.

    Returns a dict of GB/s rates (``write_gbps``, ``read_gbps``, ``raw_write_gbps``,
    ``raw_read_gbps``, ``d2h_gbps``, ``h2d_gbps``, ``copy_d2h_gbps``, ``copy_h2d_gbps``),
    ratios (``write_ratio``, ``read_ratio``, ``d2h_ratio``, ``h2d_ratio``: store / raw)
    and what was measured (``block_tokens``, ``block_bytes``, ``record_bytes``, ...).
    """
    if raw_tool == "auto":
        raw_tool = "fio" if shutil.which("fio") else "dd"
    if raw_tool not in ("fio", "dd"):
        raise ValueError(f"raw_tool: must be fio, dd or auto, got {raw_tool!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    geometry = BlockGeometry(1, KV_HEADS, block_tokens, HEAD_DIM, DTYPE)
    num_blocks = max(1, total_bytes // geometry.block_bytes)
    record_bytes = DiskTier.record_size(geometry)
    os.makedirs(directory, exist_ok=True)
    _check_free_space(directory, 2 * num_blocks * record_bytes)
    workdir = tempfile.mkdtemp(prefix="tiercache-bench-io-", dir=directory)
    try:
        result = _measure_in(workdir, geometry, num_blocks, workers, raw_tool, torch.device(device))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _measure_in(workdir: str, geometry: BlockGeometry, num_blocks: int, workers: int,
                raw_tool: str, device: torch.device) -> dict:
    record_bytes = DiskTier.record_size(geometry)
    config = TierConfig(device_budget=num_blocks * geometry.block_bytes,
                        host_budget=num_blocks * geometry.padded_bytes,
                        disk_budget=num_blocks * record_bytes,
                        disk_dir=os.path.join(workdir, "store"),
                        block_tokens=geometry.block_tokens, io_workers=workers)
    payload_bytes = num_blocks * geometry.block_bytes
    keys = [BlockKey(0, 0, i) for i in range(num_blocks)]
    raw = _RawDisk(raw_tool, os.path.join(workdir, "raw.dat"), record_bytes, num_blocks, workers)
    with BlockStore(config, geometry, device=device, persistent=False) as store:
        raw.direct = store.disk.direct_io  # same I/O path as the store (O_DIRECT or not)
        # The host pool is lazily mapped memory: touch it once so that both the store and the
        # plain copy below run on resident pages (the steady state of a long run).
        store.host_pool.buffer.fill_(0)
        _put_random_blocks(store, keys, geometry, device)

        def phase(move: str, submit_all: Callable[[], object], sync: bool = False) -> float:
            seconds = _timed(submit_all, device if sync else None)
            _expect_moves(store, move, len(keys))
            return seconds

        def each(submit: Callable[[BlockKey], object]) -> Callable[[], None]:
            return lambda: _raise_first(wait_all([submit(key) for key in keys]))

        def demote_all() -> None:
            _raise_first(wait_all(store.demote_many(keys)))

        d2h_s = phase("device->host", demote_all, sync=True)
        write_s = phase("host->disk", demote_all)
        raw_write_s = raw.write()
        dropped = drop_page_cache()
        read_s = phase("disk->host", each(lambda key: store.promote(key, Tier.HOST)))
        raw_read_s = raw.read()
        h2d_s = phase("host->device", lambda: store.ensure_device(keys, pin=False), sync=True)
        direct_io = store.disk.direct_io
    copy_h2d_s, copy_d2h_s = _plain_copy_seconds(payload_bytes, device)

    result = {
        "block_tokens": geometry.block_tokens,
        "block_bytes": geometry.block_bytes,
        "record_bytes": record_bytes,
        "num_blocks": num_blocks,
        "total_bytes": payload_bytes,
        "workers": workers,
        "device": device.type,
        "direct_io": direct_io,
        "raw_tool": raw_tool,
        "page_cache_dropped": dropped,
        "write_gbps": _gbps(payload_bytes, write_s),
        "read_gbps": _gbps(payload_bytes, read_s),
        "raw_write_gbps": _gbps(raw.total_bytes, raw_write_s),
        "raw_read_gbps": _gbps(raw.total_bytes, raw_read_s),
        "d2h_gbps": _gbps(payload_bytes, d2h_s),
        "h2d_gbps": _gbps(payload_bytes, h2d_s),
        "copy_d2h_gbps": _gbps(payload_bytes, copy_d2h_s),
        "copy_h2d_gbps": _gbps(payload_bytes, copy_h2d_s),
    }
    for name, (ours, theirs) in RATIOS.items():
        result[name] = round(result[ours] / result[theirs], 3)
    return result


# ---- the store side ------------------------------------------------------------------------
def _put_random_blocks(store: BlockStore, keys: list, geometry: BlockGeometry, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(0)
    # block: [2, B, H, T, D]; random so that no layer below can compress or deduplicate it
    pool = [torch.randn(geometry.shape, generator=generator, dtype=geometry.dtype).to(device)
            for _ in range(min(NUM_RANDOM_BLOCKS, len(keys)))]
    for i, key in enumerate(keys):
        store.put(key, pool[i % len(pool)])


def _expect_moves(store: BlockStore, move: str, num_blocks: int) -> None:
    """Every block made exactly this move, once (else the rate would be of something else)."""
    done = store.stats()["moves"].get(move, {}).get("blocks", 0)
    if done != num_blocks:
        raise RuntimeError(f"bench io: {done} of {num_blocks} blocks moved {move}; the rate would be wrong")


def _raise_first(errors: list) -> None:
    if errors:
        raise errors[0]


def _timed(fn: Callable[[], object], device: Optional[torch.device] = None) -> float:
    """Seconds of ``fn()``, with Python's garbage collector run before and off during it
    (as ``timeit`` does): a full collection of the ~170k objects that importing torch leaves
    takes ~0.1 s, as long as a whole 512 MiB copy, and falls on whichever phase allocates
    when it comes due."""
    _sync(device)
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_copy_seconds(num_bytes: int, device: torch.device) -> tuple:
    """Seconds of one plain ``dst.copy_(src)`` of ``num_bytes``: (host->device, device->host)."""
    cuda = device.type == "cuda"
    if cuda:
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    else:
        host, _owner = aligned_buffer(num_bytes)  # the same kind of memory as the host tier
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    on_device.fill_(2)
    # The best of a few runs: the baseline is what the hardware can do, not a noisy sample.
    h2d = min(_timed(lambda: on_device.copy_(host, non_blocking=cuda), device) for _ in range(PLAIN_COPY_RUNS))
    d2h = min(_timed(lambda: host.copy_(on_device, non_blocking=cuda), device) for _ in range(PLAIN_COPY_RUNS))
    return h2d, d2h


# ---- the raw disk side ---------------------------------------------------------------------
class _RawDisk:
    """The same requests as the store's (``num_requests`` of ``request_bytes``, ``workers``
    at a time), with fio or dd, on one file: each worker takes one contiguous region."""

    def __init__(self, tool: str, path: str, request_bytes: int, num_requests: int, workers: int) -> None:
        self.tool = tool
        self.path = path
        self.request_bytes = request_bytes
        self.workers = max(1, min(workers, num_requests))
        self.requests_per_worker = max(1, num_requests // self.workers)
        self.total_bytes = self.workers * self.requests_per_worker * request_bytes
        self.direct = True

    def write(self) -> float:
        return self._fio("write") if self.tool == "fio" else self._dd("write")

    def read(self) -> float:
        return self._fio("read") if self.tool == "fio" else self._dd("read")

    def _fio(self, rw: str) -> float:
        region = self.requests_per_worker * self.request_bytes
        cmd = ["fio", "--output-format=json", f"--name=raw-{rw}", f"--filename={self.path}",
               f"--rw={rw}", f"--bs={self.request_bytes}", f"--size={region}",
               f"--offset_increment={region}", f"--numjobs={self.workers}", "--group_reporting",
               "--ioengine=psync", f"--direct={int(self.direct)}", "--thread"]
        out = _run(cmd)
        job = json.loads(out[out.index("{"):])["jobs"][0][rw]
        if not job.get("bw_bytes"):
            raise RuntimeError(f"bench io: fio reported no {rw} bandwidth: {job}")
        return self.total_bytes / job["bw_bytes"]

    def _dd(self, rw: str) -> float:
        n = self.requests_per_worker
        if rw == "write":  # lay the file out first, as fio does (--fallocate=native)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.total_bytes)
            except OSError:
                pass  # a filesystem without fallocate: dd then grows the file as it writes
            finally:
                os.close(fd)
        procs = []
        t0 = time.perf_counter()
        for k in range(self.workers):
            if rw == "write":
                # /dev/zero: a disk that detects zeros will look faster, never slower
                args = ["if=/dev/zero", f"of={self.path}", f"seek={k * n}", "conv=notrunc"]
                args += ["oflag=direct"] if self.direct else []
            else:
                args = [f"if={self.path}", "of=/dev/null", f"skip={k * n}"]
                args += ["iflag=direct"] if self.direct else []
            procs.append(subprocess.Popen(["dd", f"bs={self.request_bytes}", f"count={n}", "status=none", *args],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        errors = [p.communicate()[1].decode(errors="replace").strip() for p in procs]
        seconds = time.perf_counter() - t0
        failed = [(p.returncode, e) for p, e in zip(procs, errors) if p.returncode]
        if failed:
            raise RuntimeError(f"bench io: dd {rw} failed (exit {failed[0][0]}): {failed[0][1]}")
        return seconds


def _run(cmd: list) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"bench io: {cmd[0]} did not finish in 900 s") from None
    if proc.returncode:
        raise RuntimeError(f"bench io: {' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def drop_page_cache() -> bool:
    """Write back and drop the page cache (needs root); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _check_free_space(directory: str, num_bytes: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < num_bytes * 1.1:
        raise ValueError(f"--dir: {directory!r} has {format_bytes(free)} free; this run needs about "
                         f"{format_bytes(num_bytes)} (lower --size)")


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / max(seconds, 1e-9) / 1e9, 3)


# ---- command line ----------------------------------------------------------------------------
def _median_of(runs: list) -> dict:
    """Per-key median of repeated runs (ratios are medians of the per-run ratios)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = round(statistics.median(r[key] for r in runs), 3)
    out["repeats"] = len(runs)
    return out


def _table(rows: list, default_tokens: int) -> str:
    head = (f"{'block_tokens':>12} {'block':>9} | {'write':>6} {'raw':>6} {'ratio':>5} | {'read':>6} "
            f"{'raw':>6} {'ratio':>5} | {'d2h':>6} {'copy':>6} {'ratio':>5} | {'h2d':>6} {'copy':>6} {'ratio':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "*" if r["block_tokens"] == default_tokens else " "
        lines.append(
            f"{r['block_tokens']:>11}{mark} {format_bytes(r['block_bytes']):>9} | "
            f"{r['write_gbps']:>6.2f} {r['raw_write_gbps']:>6.2f} {r['write_ratio']:>5.2f} | "
            f"{r['read_gbps']:>6.2f} {r['raw_read_gbps']:>6.2f} {r['read_ratio']:>5.2f} | "
            f"{r['d2h_gbps']:>6.2f} {r['copy_d2h_gbps']:>6.2f} {r['d2h_ratio']:>5.2f} | "
            f"{r['h2d_gbps']:>6.2f} {r['copy_h2d_gbps']:>6.2f} {r['h2d_ratio']:>5.2f}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    defaults = TierConfig()
    p = argparse.ArgumentParser(
        prog="tiercache bench io",
        description="Disk-tier writes/reads against fio (or dd) with the same request size, and "
                    "host<->device moves against a plain torch copy. Rates in GB/s (1e9 B/s).")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dir", default=".", help="directory on the disk to test (a temporary folder "
                   "is created inside it and removed); default: the current directory")
    p.add_argument("--size", default="1GiB", help="bytes of blocks to move per measurement (default 1GiB)")
    p.add_argument("--block-tokens", type=int, default=defaults.block_tokens,
                   help=f"tokens per block (default {defaults.block_tokens}, TierConfig's default)")
    p.add_argument("--sweep", action="store_true",
                   help=f"also measure block_tokens in {', '.join(map(str, SWEEP_BLOCK_TOKENS))}")
    p.add_argument("--workers", type=int, default=defaults.io_workers,
                   help=f"the store's io_workers and the raw tool's parallel jobs (default {defaults.io_workers})")
    p.add_argument("--repeat", type=int, default=1, help="runs per block size; report medians (default 1)")
    p.add_argument("--raw-tool", choices=("auto", "fio", "dd"), default="auto",
                   help="raw disk tool (default: fio when installed, else dd)")
    return p


def run(argv: Optional[list] = None) -> int:
    """Entry point of ``tiercache bench io``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        total_bytes = parse_bytes(args.size, "--size")
        TierConfig(block_tokens=args.block_tokens, io_workers=args.workers)  # validates both
        if args.repeat < 1:
            raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
    except ValueError as exc:
        print(f"tiercache bench io: {exc}", file=sys.stderr)
        return 2
    sizes = sorted(set(SWEEP_BLOCK_TOKENS) | {args.block_tokens}) if args.sweep else [args.block_tokens]
    rows = []
    for tokens in sizes:
        try:
            runs = [measure_io(args.dir, tokens, total_bytes, args.workers, raw_tool=args.raw_tool)
                    for _ in range(args.repeat)]
        except (ValueError, RuntimeError, OSError) as exc:  # no room, fio/dd failed, ...
            print(f"tiercache bench io: {exc}", file=sys.stderr)
            return 1
        rows.append(_median_of(runs))
        if args.sweep and not args.json:
            print(f"  measured block_tokens={tokens}", file=sys.stderr, flush=True)
    main = next(r for r in rows if r["block_tokens"] == args.block_tokens)
    if args.json:
        out = dict(main)
        if args.sweep:
            out["sweep"] = rows
        print(json.dumps(out))
        return 0
    print(f"tiercache bench io: {format_bytes(main['total_bytes'])} per measurement in "
          f"{os.path.abspath(args.dir)}, {args.workers} workers, raw disk: {main['raw_tool']} "
          f"({'direct I/O' if main['direct_io'] else 'buffered I/O'}), device: {main['device']}, "
          f"GB/s, ratio = store / raw (* = default)")
    print(_table(rows, args.block_tokens))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
