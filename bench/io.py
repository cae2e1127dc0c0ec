"""`tiercache bench io`: the store's disk and host<->device moves against the raw hardware.

One measurement (``measure_io``) does, in one fresh directory and one run:

1. puts ``num_blocks`` blocks on the device tier, then times the store moving all of them
   device->host (d2h), then host->disk (write), and, after dropping the page cache,
   disk->host (read) and host->device (h2d). Each phase is cut into rounds of about
   ``ROUND_BYTES``; a round submits its moves at once (``demote_now``, ``promote`` per
   block, ``ensure_device``) and waits for all of them, so ``io_workers`` moves are in
   flight: rate = bytes / wall time;
2. in every round, right before or after the store's turn (the order alternating: store,
   baseline, baseline, store, ...), the baseline does the same bytes:
   - disk: the raw disk with the same requests (one disk record each: header + padded
     payload) in the same order with the same concurrency, on a file in the same
     directory: fio (libaio, ``io_workers`` in flight) when installed, else ``dd``
     processes side by side;
   - host<->device on CPU: plain torch ``copy_`` calls of the same bytes between the same
     addresses, in the store's own pools (``PoolCopy``), and next to it, as ``flat_*``, one
     ``dst.copy_(src)`` between two buffers of its own (``PlainCopy``);
   - host<->device on CUDA: ``PlainCopy``, pinned host memory and the GPU with
     ``non_blocking`` copies.
   The disk's rate here swings by 2x within seconds and the machine is shared, so one
   long store phase against one long baseline phase compared two moods of the hardware;
   taking turns gives both the same mix (``_interleaved``). Rates are total bytes over
   total seconds; each ratio is the median of the rounds' ratios
   (``<phase>_round_ratios``). The garbage collector runs once before the phases and is
   off during them, for the store and the baselines alike.

The files are fresh in every measurement, for the store and for the raw tool alike (a long
run's cache grows into new slots, so that is the write the store does most); the raw file
is laid out with fallocate before it is written, as fio does by default.

Store rates count payload bytes (what the cache gets back); raw rates count every byte the
disk moves, so the 4 KiB record header is part of the store's overhead. GB/s = 1e9 B/s.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Iterator, Optional

import torch

from tiercache.cli import Parser, work_dir
from tiercache.config import DISK_IO_BACKENDS, TierConfig, format_bytes, parse_bytes
from tiercache.disk import DiskTier
from tiercache.store import BlockStore
from tiercache.table import BlockKey, Tier
from tiercache.tiers import BlockGeometry, aligned_buffer
from tiercache.transfer import wait_all

# The default model (SmolLM2-135M): 3 KV heads of 64 dims in fp32 -> 1536 bytes per token.
KV_HEADS, HEAD_DIM, DTYPE = 3, 64, torch.float32
SWEEP_BLOCK_TOKENS = (64, 128, 256, 512, 1024)
RATES = {  # phase: (the store's rate, the baseline's rate); its ratio is f"{phase}_ratio"
    "write": ("write_gbps", "raw_write_gbps"),
    "read": ("read_gbps", "raw_read_gbps"),
    "d2h": ("d2h_gbps", "copy_d2h_gbps"),
    "h2d": ("h2d_gbps", "copy_h2d_gbps"),
}
NUM_RANDOM_BLOCKS = 64  # distinct random contents, cycled over the blocks put
ROUND_BYTES = 64 << 20  # bytes per turn of the store and of its baseline (see _interleaved)


def measure_io(directory: str, block_tokens: int, total_bytes: int, workers: int, *,
               raw_tool: str = "auto", device: Optional[str] = None, rounds: Optional[int] = None,
               disk_io: str = "auto") -> dict:
    """Measure the store's tier moves and the raw hardware with ~``total_bytes`` of blocks.

    Args:
        directory: an existing directory, where the disk tier and the raw test file go (a
            temporary folder inside it is created and removed); a missing one is a ValueError.
        block_tokens: tokens per block (a block of the default model is 1536 * T bytes).
        total_bytes: bytes of blocks to move (at least one block).
        workers: the store's ``io_workers``; also the raw tool's requests in flight (fio) or
            parallel processes (dd).
        raw_tool: "fio", "dd", or "auto" (fio when installed, else dd).
        device: where the device tier lives; CUDA when available, else CPU.
        rounds: how many slices each phase is cut into, the store and its baseline taking
            turns slice by slice (default: one per ``ROUND_BYTES``, at least 2).
        disk_io: the store's disk backend (``TierConfig.disk_io``); the result's ``disk_io``
            names the one that ran.

    Returns a dict of GB/s rates (``write_gbps``, ``read_gbps``, ``raw_write_gbps``,
    ``raw_read_gbps``, ``d2h_gbps``, ``h2d_gbps``, ``copy_d2h_gbps``, ``copy_h2d_gbps``),
    ratios (``write_ratio``, ``read_ratio``, ``d2h_ratio``, ``h2d_ratio``: store / baseline,
    each the median of its ``<phase>_round_ratios``, one per round) and what was measured
    (``block_tokens``, ``block_bytes``, ``record_bytes``, ``rounds``, ...).
    """
    if raw_tool == "auto":
        raw_tool = default_raw_tool()
    if raw_tool not in ("fio", "dd"):
        raise ValueError(f"raw_tool: must be fio, dd or auto, got {raw_tool!r}")
    if not shutil.which(raw_tool):  # else an ENOENT from the first run of it, after the store's writes (a review)
        raise ValueError(f"raw_tool: {raw_tool} is not installed (not on PATH); install it, or use "
                         f"{'dd' if raw_tool == 'fio' else 'fio'} or auto")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    geometry = BlockGeometry(1, KV_HEADS, block_tokens, HEAD_DIM, DTYPE)
    num_blocks = max(1, total_bytes // geometry.block_bytes)
    record_bytes = DiskTier.record_size(geometry)
    if rounds is None:
        rounds = max(2, -(-total_bytes // ROUND_BYTES))
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds}")
    if not os.path.isdir(directory):  # as `bench io --dir` refuses it: a missing one is a typo, not made here
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise ValueError(f"directory: {directory!r} {what} (measure_io makes its folder inside an existing one)")
    check_free_space(directory, 2 * num_blocks * record_bytes, "directory", "total_bytes")
    workdir = tempfile.mkdtemp(prefix="tiercache-bench-io-", dir=directory)
    try:
        result = _measure_in(workdir, geometry, num_blocks, workers, raw_tool, torch.device(device),
                             min(rounds, num_blocks), disk_io)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _measure_in(workdir: str, geometry: BlockGeometry, num_blocks: int, workers: int,
                raw_tool: str, device: torch.device, rounds: int, disk_io: str = "auto") -> dict:
    record_bytes = DiskTier.record_size(geometry)
    config = TierConfig(device_budget=num_blocks * geometry.block_bytes,
                        host_budget=num_blocks * geometry.padded_bytes,
                        disk_budget=num_blocks * record_bytes,
                        disk_dir=os.path.join(workdir, "store"),
                        block_tokens=geometry.block_tokens, io_workers=workers, disk_io=disk_io)
    payload_bytes = num_blocks * geometry.block_bytes
    keys = [BlockKey(0, 0, i) for i in range(num_blocks)]
    raw = RawDisk(raw_tool, os.path.join(workdir, "raw.dat"), record_bytes, num_blocks, workers)
    groups = _rounds_of(keys, rounds)
    plain = PlainCopy(payload_bytes, geometry.block_bytes, device)
    with BlockStore(config, geometry, device=device, persistent=False) as store:
        raw.direct = store.disk.direct_io  # same I/O path as the store (O_DIRECT or not)
        # The host pool is lazily mapped memory: touch it once so that both the store and the
        # plain copy below run on resident pages (the steady state of a long run).
        store.host_pool.buffer.fill_(0)
        _put_random_blocks(store, keys, geometry, device)

        def timed(fn: Callable[[], object], sync: bool = False) -> float:
            t0 = time.perf_counter()
            fn()
            _sync(device if sync else None)
            return time.perf_counter() - t0

        def demote(group: list) -> Callable[[], None]:
            return lambda: _raise_first(store.demote_now(group))

        def read_up(group: list) -> Callable[[], None]:
            return lambda: _raise_first(wait_all([store.promote(key, Tier.HOST) for key in group]))

        def copies(phase: str, move: Callable[[list], Callable[[], object]]) -> dict:
            """The phase's rounds: against ``PlainCopy`` on CUDA; on CPU against the same
            bytes in the store's pools (``PoolCopy``), with ``PlainCopy`` as ``flat``."""
            plain_copy = plain.d2h if phase == "d2h" else plain.h2d
            if device.type == "cuda":
                return _interleaved(groups, lambda g: timed(move(g), sync=True), plain_copy)
            pool = PoolCopy(store, phase)

            def turn(group: list) -> float:
                pool.before(group)
                seconds = timed(move(group))
                pool.after(group)
                return seconds
            return _interleaved(groups, turn, pool.copy, flat=plain_copy)

        phases = {}
        with _no_gc(device):
            phases["d2h"] = copies("d2h", demote)
            _expect_moves(store, "device->host", len(keys))
            phases["write"] = _interleaved(groups, lambda g: timed(demote(g)), raw.write)
            _expect_moves(store, "host->disk", len(keys))
            dropped = drop_page_cache()
            phases["read"] = _interleaved(groups, lambda g: timed(read_up(g)), raw.read)
            _expect_moves(store, "disk->host", len(keys))
            phases["h2d"] = copies("h2d", lambda g: lambda: store.ensure_device(g, pin=False))
            _expect_moves(store, "host->device", len(keys))
        direct_io, disk_io = store.disk.direct_io, store.disk.io

    result = {
        "block_tokens": geometry.block_tokens,
        "block_bytes": geometry.block_bytes,
        "record_bytes": record_bytes,
        "num_blocks": num_blocks,
        "total_bytes": payload_bytes,
        "workers": workers,
        "device": device.type,
        "direct_io": direct_io,
        "disk_io": disk_io,
        "raw_tool": raw_tool,
        "page_cache_dropped": dropped,
        "rounds": len(groups),
    }
    # Rates: total bytes over total seconds. Ratios: the medians of the rounds' ratios (each
    # round: the store and the baseline on the same slice, back to back), so a slow spell
    # that lands on one side of one round moves the ratio of the totals but not the median.
    for phase, (ours, theirs) in RATES.items():
        turns = phases[phase]
        result[ours] = _gbps(payload_bytes, sum(turns["store_s"]))
        result[theirs] = _gbps(sum(turns["raw_bytes"]), sum(turns["raw_s"]))
        result[f"{phase}_round_ratios"] = [
            round((len(g) * geometry.block_bytes / s_) / (b / r), 3)
            for g, s_, b, r in zip(groups, turns["store_s"], turns["raw_bytes"], turns["raw_s"])]
        result[f"{phase}_ratio"] = round(statistics.median(result[f"{phase}_round_ratios"]), 3)
        if "flat_s" in turns:  # CPU: the same ratio against PlainCopy's separate buffers
            result[f"flat_{theirs}"] = _gbps(sum(turns["flat_bytes"]), sum(turns["flat_s"]))
            result[f"flat_{phase}_round_ratios"] = [
                round((len(g) * geometry.block_bytes / s_) / (b / r), 3)
                for g, s_, b, r in zip(groups, turns["store_s"], turns["flat_bytes"], turns["flat_s"])]
            result[f"flat_{phase}_ratio"] = round(statistics.median(result[f"flat_{phase}_round_ratios"]), 3)
    return result


def _rounds_of(keys: list, rounds: int) -> list:
    """``keys`` cut into ``rounds`` contiguous slices of (nearly) equal length."""
    bounds = [len(keys) * i // rounds for i in range(rounds + 1)]
    return [keys[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _interleaved(groups: list, store: Callable[[list], float], raw: Callable[[int, int], tuple],
                 flat: Optional[Callable[[int, int], tuple]] = None) -> dict:
    """The store and the baseline take turns, slice by slice, on the same blocks: ``store``
    moves a group and returns its seconds; ``raw(first, n)`` does the same requests (blocks
    ``first .. first + n``) and returns (seconds, bytes). Who goes first alternates (store,
    baseline, baseline, store, ...), so a slow spell of the hardware hits both alike.
    ``flat``, a second baseline called as ``raw``, goes right next to it on the side away
    from the store (store, raw, flat, flat, raw, store, ...): ``flat_s``, ``flat_bytes``."""
    out: dict = {"store_s": [], "raw_s": [], "raw_bytes": []}
    baselines = [("raw", raw)] + ([("flat", flat)] if flat is not None else [])
    for name, _ in baselines[1:]:
        out.update({f"{name}_s": [], f"{name}_bytes": []})
    first = 0
    for i, group in enumerate(groups):
        turns = [("store", None)] + baselines
        for name, baseline in (turns if i % 2 == 0 else turns[::-1]):
            if baseline is None:
                out["store_s"].append(store(group))
            else:
                seconds, num_bytes = baseline(first, len(group))
                out[f"{name}_s"].append(seconds)
                out[f"{name}_bytes"].append(num_bytes)
        first += len(group)
    return out


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


@contextlib.contextmanager
def _no_gc(device: torch.device) -> Iterator[None]:
    """Python's garbage collector run once and then off (as ``timeit`` does), for the store
    and the baselines alike: a full collection of the ~170k objects that importing torch
    leaves takes ~0.1 s, as long as a whole 512 MiB copy, and fell on whichever turn
    allocated when it came due."""
    _sync(device)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class PoolCopy:
    """CPU baseline of the host<->device moves: the same bytes as a round of the store's
    moves, between the same addresses (the store's own device and host pools), with one
    plain torch ``copy_`` per pool (K, V) and run of adjacent slots.

    Why not only ``PlainCopy``: on this machine (a VM) a copy's speed depends on where its
    buffers lie. With ``PlainCopy``'s buffers allocated before the store's pools, as here,
    the store's ratio to it was 0.62-0.83 device->host and 0.57-0.78 host->device in eight
    runs; with the same buffers allocated after the pools, 0.94-1.15 and 1.11-1.16 in four
    (a script that moved only the allocation, not kept).
    A plain copy of the store's own bytes in place compares the store with the very memory
    it copies, so what is left is what the store adds: planning, threads, completion.

    ``before(group)`` and ``after(group)`` bracket the store's turn (they note the group's
    source and destination slots; a d2h move frees its source slot, whose bytes stay until
    the slot is reused, which no move of that phase does). ``copy(first, n)`` copies the
    last group the store moved (the one it just moved, or the one before when the baseline
    goes first): the bytes it writes are the ones already there."""

    def __init__(self, store: BlockStore, phase: str) -> None:
        self.store = store
        self.src, self.dst = (Tier.DEVICE, Tier.HOST) if phase == "d2h" else (Tier.HOST, Tier.DEVICE)
        self._sources: dict = {}
        self._moved: Optional[list] = None  # [(src slot, dst slot)] of the last group moved

    def _slot(self, key, tier: Tier) -> int:
        copy = self.store.table.copy(key, tier)
        if copy is None:
            raise RuntimeError(f"bench io: block {key!r} has no {tier.label} copy; the baseline would be wrong")
        return copy.slot

    def before(self, group: list) -> None:
        self._sources = {key: self._slot(key, self.src) for key in group}

    def after(self, group: list) -> None:
        self._moved = sorted((self._sources[key], self._slot(key, self.dst)) for key in group)

    def copy(self, first: int, n: int) -> tuple:
        """Seconds and bytes of copying the last group moved again, run by run."""
        store = self.store
        if self._moved is None:
            raise RuntimeError("bench io: the pool baseline has no moved group to copy yet")
        device = (store.device_pool.k, store.device_pool.v)
        host = store.host_pool.kv_rows()
        src_pools, dst_pools = (device, host) if self.src is Tier.DEVICE else (host, device)
        runs: list = []  # [src first, dst first, count]
        for s, d in self._moved:
            if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        t0 = time.perf_counter()
        for s, d, count in runs:
            for src, dst in zip(src_pools, dst_pools):
                dst[:, d:d + count].copy_(src[:, s:s + count])
        return time.perf_counter() - t0, len(self._moved) * store.geometry.block_bytes


class PlainCopy:
    """The baseline of the host<->device moves on CUDA (and a second one on CPU, see
    ``PoolCopy``): one plain ``dst.copy_(src)`` of the same number of bytes as a round of
    the store's moves, between a host buffer (pinned on CUDA, else the host tier's kind of
    memory) and a device buffer as large as all the blocks, with ``non_blocking`` on CUDA."""

    def __init__(self, num_bytes: int, block_bytes: int, device: torch.device) -> None:
        self.device = device
        self.block_bytes = block_bytes
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.host, self._owner = aligned_buffer(num_bytes)
        self.on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.host.fill_(1)  # resident pages, as the store's pools
        self.on_device.fill_(2)

    def h2d(self, first: int, n: int) -> tuple:
        """Seconds and bytes of copying blocks ``first .. first + n`` host -> device."""
        return self._copy(self.on_device, self.host, first, n)

    def d2h(self, first: int, n: int) -> tuple:
        """Seconds and bytes of copying blocks ``first .. first + n`` device -> host."""
        return self._copy(self.host, self.on_device, first, n)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, first: int, n: int) -> tuple:
        # the round's share of buffers as large as the store's pools, as the store's moves
        a, b = first * self.block_bytes, (first + n) * self.block_bytes
        _sync(self.device)
        t0 = time.perf_counter()
        dst[a:b].copy_(src[a:b], non_blocking=self.cuda)
        _sync(self.device)
        return time.perf_counter() - t0, b - a


# ---- the raw disk side ---------------------------------------------------------------------
def default_raw_tool() -> str:
    """fio when installed, else dd."""
    return "fio" if shutil.which("fio") else "dd"


class RawDisk:
    """The store's disk requests (``request_bytes`` each, ``workers`` at a time) done by fio
    or dd on one file laid out beforehand (as fio does by default). A turn covers requests
    ``first .. first + n``. fio reads or writes them as the store does: in order, one
    stream, ``workers`` in flight (libaio); dd cannot, so each of ``workers`` processes takes
    one contiguous share."""

    def __init__(self, tool: str, path: str, request_bytes: int, num_requests: int, workers: int) -> None:
        self.tool = tool
        self.path = path
        self.request_bytes = request_bytes
        self.num_requests = num_requests
        self.workers = max(1, workers)
        self.direct = True
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, num_requests * request_bytes)
        except OSError:
            pass  # a filesystem without fallocate: the first writes grow the file
        finally:
            os.close(fd)

    def write(self, first: int, n: int) -> tuple:
        """Seconds and bytes of writing requests ``first .. first + n``."""
        return self._turn("write", first, n)

    def read(self, first: int, n: int) -> tuple:
        """Seconds and bytes of reading requests ``first .. first + n``."""
        return self._turn("read", first, n)

    def _turn(self, rw: str, first: int, n: int) -> tuple:
        if self.tool == "fio":
            return self._fio(rw, first, n), n * self.request_bytes
        jobs = max(1, min(self.workers, n))
        per_job = max(1, n // jobs)
        return self._dd(rw, first, jobs, per_job), jobs * per_job * self.request_bytes

    def _fio(self, rw: str, first: int, n: int) -> float:
        """One sequential stream with ``workers`` requests in flight: the store's pattern."""
        cmd = ["fio", "--output-format=json", f"--name=raw-{rw}", f"--filename={self.path}",
               f"--rw={rw}", f"--bs={self.request_bytes}", f"--offset={first * self.request_bytes}",
               f"--size={n * self.request_bytes}", "--ioengine=libaio", f"--iodepth={self.workers}",
               f"--direct={int(self.direct)}"]
        out = _run(cmd)
        job = json.loads(out[out.index("{"):])["jobs"][0][rw]
        if not job.get("bw_bytes"):
            raise RuntimeError(f"bench io: fio reported no {rw} bandwidth: {job}")
        return n * self.request_bytes / job["bw_bytes"]

    def _dd(self, rw: str, first: int, jobs: int, per_job: int) -> float:
        """dd processes side by side, as the store's workers run: started held (each a shell
        waiting on its stdin), then let go together. The time is the span of their own
        transfers: from the first one's start to the last one's end, each start being its
        end less the time dd reports (its start-up excluded). The slowest one's own time
        was used before; the processes were started one after another, did not all run at
        once, and the span of their transfers was 1.11-1.30x that (a review), so the raw
        rate was too high."""
        procs = []
        for k in range(jobs):
            start = first + k * per_job
            if rw == "write":
                # /dev/zero: a disk that detects zeros will look faster, never slower
                args = ["if=/dev/zero", f"of={self.path}", f"seek={start}", "conv=notrunc"]
                args += ["oflag=direct"] if self.direct else []
            else:
                args = [f"if={self.path}", "of=/dev/null", f"skip={start}"]
                args += ["iflag=direct"] if self.direct else []
            dd = ["dd", f"bs={self.request_bytes}", f"count={per_job}", *args]
            # the shell waits for one line on stdin, then becomes dd (whose stdin dd does not read)
            procs.append(subprocess.Popen(["sh", "-c", 'read _ && exec "$@" </dev/null', "sh", *dd],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          env={**os.environ, "LC_ALL": "C"}))
        ends = [0.0] * jobs

        def reap(i: int) -> None:
            procs[i].wait()
            ends[i] = time.perf_counter()

        waiters = [threading.Thread(target=reap, args=(i,), daemon=True) for i in range(jobs)]
        for w in waiters:
            w.start()
        for p in procs:  # let go together
            try:
                p.stdin.write(b"go\n")
                p.stdin.close()
            except BrokenPipeError:  # it failed already: its report says why
                pass
        for w in waiters:
            w.join()
        reports = [p.stderr.read().decode(errors="replace").strip() for p in procs]
        for p in procs:
            p.stderr.close()
        failed = [(p.returncode, e) for p, e in zip(procs, reports) if p.returncode]
        if failed:
            raise RuntimeError(f"bench io: dd {rw} failed (exit {failed[0][0]}): {failed[0][1]}")
        seconds = [re.search(r"copied, ([0-9.e+-]+) s", report) for report in reports]
        if not all(seconds):
            raise RuntimeError(f"bench io: could not read dd's time from {reports[0]!r}")
        own = [float(m.group(1)) for m in seconds]
        return max(ends) - min(end - t for end, t in zip(ends, own))


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


def check_free_space(directory: str, num_bytes: int, name: str = "--dir", size: str = "--size") -> None:
    """ValueError naming ``name`` (the folder's flag or argument) when ``directory`` has less
    than ``num_bytes`` (+10%) free; ``size`` names what to lower."""
    free = shutil.disk_usage(directory).free
    if free < num_bytes * 1.1:
        raise ValueError(f"{name}: {directory!r} has {format_bytes(free)} free; this run needs about "
                         f"{format_bytes(num_bytes)} (lower {size})")


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / max(seconds, 1e-9) / 1e9, 3)


# ---- command line ----------------------------------------------------------------------------
def _median_of(runs: list) -> dict:
    """Per-key median of repeated runs; each ratio is the median of every round of every run."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = round(statistics.median(r[key] for r in runs), 3)
        elif isinstance(value, list):  # per-round ratios: all of them
            out[key] = [x for r in runs for x in r[key]]
    for key in [k for k in out if k.endswith("_round_ratios")]:  # d2h_round_ratios -> d2h_ratio, ...
        out[key[:-len("_round_ratios")] + "_ratio"] = round(statistics.median(out[key]), 3)
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
    p = Parser(
        prog="tiercache bench io",
        description="Disk-tier writes/reads against fio (or dd) with the same request size, and "
                    "host<->device moves against a plain torch copy. Rates in GB/s (1e9 B/s).")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dir", default=".", help="existing directory on the disk to test (a temporary folder "
                   "is created inside it and removed); default: the current directory")
    p.add_argument("--size", default="1GiB", help="bytes of blocks to move per measurement (default 1GiB)")
    p.add_argument("--block-tokens", type=int, default=defaults.block_tokens,
                   help=f"tokens per block (default {defaults.block_tokens}, TierConfig's default)")
    p.add_argument("--sweep", action="store_true",
                   help=f"also measure block_tokens in {', '.join(map(str, SWEEP_BLOCK_TOKENS))}")
    p.add_argument("--workers", type=int, default=defaults.io_workers,
                   help=f"the store's io_workers and the raw tool's parallel jobs (default {defaults.io_workers})")
    p.add_argument("--repeat", type=int, default=1, help="runs per block size; report medians (default 1)")
    p.add_argument("--round-size", default=None,
                   help=f"bytes per turn of the store and of the baseline (default {ROUND_BYTES >> 20}MiB, "
                        "and at least two rounds); as large as --size: one turn each")
    p.add_argument("--raw-tool", choices=("auto", "fio", "dd"), default="auto",
                   help="raw disk tool (default: fio when installed, else dd)")
    p.add_argument("--disk-io", choices=DISK_IO_BACKENDS, default=defaults.disk_io,
                   help="the store's disk backend (default auto: kvikio on CUDA when installed, else posix)")
    return p


def run(argv: Optional[list] = None) -> int:
    """Entry point of ``tiercache bench io``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        total_bytes = parse_bytes(args.size, "--size")
        TierConfig(block_tokens=args.block_tokens, io_workers=args.workers)  # validates both
        if args.repeat < 1:
            raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
        rounds = None  # measure_io's default
        if args.round_size is not None:
            round_bytes = parse_bytes(args.round_size, "--round-size")
            if round_bytes < 1:
                raise ValueError(f"--round-size: must be > 0, got {args.round_size!r}")
            rounds = max(1, -(-total_bytes // round_bytes))
        work_dir("--dir", args.dir)  # as every benchmark: a missing one is a typo, not made here
        sizes = sorted(set(SWEEP_BLOCK_TOKENS) | {args.block_tokens}) if args.sweep else [args.block_tokens]
        largest = BlockGeometry(1, KV_HEADS, max(sizes), HEAD_DIM, DTYPE).block_bytes
        if total_bytes < largest:  # was rounded up to one block, silently
            raise ValueError(f"--size: {args.size} is less than one block ({format_bytes(largest)} at "
                             f"block_tokens={max(sizes)})")
        for tokens in sizes:  # now, not after the sizes before it were measured
            geometry = BlockGeometry(1, KV_HEADS, tokens, HEAD_DIM, DTYPE)
            num_blocks = max(1, total_bytes // geometry.block_bytes)
            check_free_space(args.dir, 2 * num_blocks * DiskTier.record_size(geometry))
    except ValueError as exc:
        print(f"tiercache: error: bench io: {exc}", file=sys.stderr)
        return 2
    rows = []
    for tokens in sizes:
        try:
            runs = [measure_io(args.dir, tokens, total_bytes, args.workers, raw_tool=args.raw_tool, rounds=rounds,
                               disk_io=args.disk_io)
                    for _ in range(args.repeat)]
        except (ValueError, RuntimeError, OSError) as exc:  # no room, fio/dd failed, ...
            print(f"tiercache: error: bench io: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, ValueError) else 1  # ValueError: the input (--size too big for --dir)
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
          f"({'direct I/O' if main['direct_io'] else 'buffered I/O'}), store's disk I/O: {main['disk_io']}, "
          f"device: {main['device']}, "
          f"GB/s, ratio = store / raw (* = --block-tokens)")
    print(_table(rows, args.block_tokens))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
