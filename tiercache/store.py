"""The block store: one object that owns the table, the tiers, the policies and the moves.

Bookkeeping happens under one lock (``self._lock``) and never waits on I/O; bytes move on
the transfer engine's threads, and each move's completion callback commits or rolls back
its table entry. Callers that need a block on the device wait on those moves without the
lock held, and the time they wait is recorded as stall time.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
import os
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Hashable, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from tiercache.config import TierConfig, as_tier_config, check_store_device, format_bytes
from tiercache.disk import NOT_A_RECORD, DiskTier, RecordCodec, RecordError, resolve_disk_io
from tiercache.errors import BlockCorruptedError, CacheDirError, CapacityError, TierCacheError, TierIOError
from tiercache.events import Events
from tiercache.guard import GuardedPolicy, is_plugin
from tiercache.policies import make_eviction
from tiercache.streamread import DiskStreams
from tiercache.table import BlockKey, BlockTable, CopyState, Move, Tier, as_tier, ready_elsewhere
from tiercache.tiers import BlockGeometry, DevicePool, HostPool, aligned_buffer, pin_in_place, unpin_in_place
from tiercache.transfer import Priority, TransferEngine, wait_all

log = logging.getLogger("tiercache")
# CPU host<->device copies (see BlockStore._submit_all): the bytes of one piece (a copy
# call per pool; ~0.7 ms of memcpy) and the most one worker copies before it queues itself
# again (~1.5 ms, the longest a demand read queued behind it waits).
_CRC_AHEAD_BYTES = 256 << 10  # blocks from this size get their CRC computed ahead of the writer
_PIECE_BYTES = 8 << 20
_CHUNK_BYTES = 16 << 20
_READERS_WAIT_S = 5.0  # how long a call waits out copies read by calls in progress (_wait_out_readers)
_CUDA_PIECE_BYTES = 64 << 20  # see _submit_all
_CUDA_JOBS = 2  # copy jobs of a batch, and device staging buffers (_device_lease)
_BELOW_DEVICE = (Tier.HOST, Tier.DISK)  # fastest first
_TIER_LABELS = tuple(tier.label for tier in Tier)  # by tier number
_MOVE_SRC = operator.itemgetter(Move._fields.index("src"))
_DST_SLOT = operator.itemgetter(Move._fields.index("dst_slot"))
# _slot_runs' sort key, (src, dst, src_slot) of a Move: a C getter, not a lambda per move
_RUN_ORDER = operator.itemgetter(*(Move._fields.index(f) for f in ("src", "dst", "src_slot")))
_GATHER_SPLIT = 4  # a demotion's gather goes through scratch for 1/4 of a piece at a time


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _starts_work(method):
    """A public call of ``BlockStore`` that starts work (moves, reads, new blocks): a
    plug-in eviction policy's failure reported before it (``tiercache.guard``; on any
    thread) is raised from it before it does anything. Calls nested in one (``put`` calls
    ``new_blocks``, ``ensure_device`` calls ``prefetch``) do not raise it: the outer call
    would stop halfway (consistent, as on any error, but with its work half done). Calls that
    end work (``unpin``, ``release_views``, ``delete``) never raise it; ``close`` raises
    one that is left, after it has shut the store down."""
    return _store_call(method, raises_policy_failures=True)


def _ends_work(method):
    """A public call of ``BlockStore`` that changes its books without starting moves
    (``delete``, ``link``, ``pin``, ``flush``): refused once the store is closed, and waited
    for by ``close``, as ``_starts_work`` calls are; a plug-in's failure is not raised."""
    return _store_call(method, raises_policy_failures=False)


def _store_call(method, raises_policy_failures: bool):
    """The outermost public call on a thread is counted (``_enter``/``_leave``): once the
    store is closed it raises, and ``close`` waits for those running to end before it
    frees the pools and files. A call after close segfaulted (a copy into the unmapped host
    pool) or wrote through a closed file descriptor that the OS may have given to another
    file; close() on one thread while others called did the first (6 runs of 6, a
    helper's test)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        calls = self._calls
        depth = getattr(calls, "depth", 0)
        try:  # _enter inside: an interrupt as it returns still reaches _leave, which knows
            if not depth:  # whether the call was counted
                self._enter(method.__name__)
            if raises_policy_failures and self._policy_failures and not depth:
                self._raise_policy_failure()
            calls.depth = depth + 1
            return method(self, *args, **kwargs)
        finally:
            calls.depth = depth
            if not depth:
                _uninterrupted(self._leave)
    return call


def _uninterrupted(step) -> None:
    """Run ``step`` (idempotent) to its end even if Ctrl-C lands in it: a KeyboardInterrupt
    (or any exception raised by a signal handler) that cuts it short is held, ``step`` runs
    again, and the interrupt is raised after. A call left counted by an interrupt in
    ``_leave`` made ``close()`` wait for good, and with it the atexit handler: the process
    never exited (a helper's run of 102 SIGINTs hit tiercache's internals, ``_leave`` once)."""
    held: Optional[BaseException] = None
    for _ in range(16):  # a few Ctrl-Cs in a row; not a loop for good on a real error
        try:
            step()
            break
        except BaseException as exc:  # noqa: BLE001 - an interrupt; raised below
            held = exc
    if held is not None:
        raise held


def _key_list(keys: Iterable[Hashable], name: str) -> list:
    """The keys of a call that takes many, as a list. One ``BlockKey`` (a tuple of three
    ints) or a string given instead was iterated: ``pin(key)`` pinned blocks named 0, 0 and
    0, ``demote_now(key)`` did nothing and said nothing."""
    if isinstance(keys, (BlockKey, str, bytes)):
        raise TypeError(f"{name}: expected a list of keys, got one key {keys!r} (pass [key])")
    return list(keys)


@contextlib.contextmanager
def _allocating(field: str, budget: int, device: torch.device) -> Iterator[None]:
    """A tier's pool, allocated whole at open: memory refused (a budget beyond what the
    machine has) is a ``ValueError`` naming the budget, not an allocator's error from deep
    inside generate()."""
    try:
        yield
    except (RuntimeError, OSError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
        text = str(exc)
        if not isinstance(exc, MemoryError) and "memory" not in text.lower():
            raise
        raise ValueError(f"{field}={format_bytes(budget)}: its pool cannot be allocated on {device} "
                         f"({text.splitlines()[0] if text else type(exc).__name__}); lower {field}") from None


class BlockStore:
    """KV blocks across device, host and disk tiers within hard byte budgets.

    Args:
        config: budgets, policies and I/O settings.
        geometry: the shape and dtype of one block.
        device: where the device tier lives (defaults to ``config.device`` or CPU).
        disk_dir: directory of the disk tier (defaults to ``config.disk_dir``).
        persistent: keep disk records across close/reopen (False: a private session file,
            removed on close).
        events: counters to feed (a fresh ``Events`` by default).
    """

    def __init__(self, config: TierConfig, geometry: BlockGeometry, *,
                 device: Optional[torch.device | str] = None, disk_dir: Optional[str] = None,
                 persistent: bool = True, model_digest: bytes = b"",
                 events: Optional[Events] = None, role: str = "") -> None:
        self.closed = False
        self.role = role  # what the store is, in a plug-in policy's failure: "" a cache's own
        self._pid = os.getpid()  # a child made by fork() cannot use the store: see ``_enter``
        self._active = 0  # public calls running (``_store_call``); close waits for them
        self._active_cv = threading.Condition()
        self._calls = threading.local()
        self.config = config = as_tier_config(config)
        if not isinstance(geometry, BlockGeometry):
            raise TypeError(f"geometry: expected a tiercache BlockGeometry, got {type(geometry).__name__}")
        if geometry.block_tokens != config.block_tokens:  # taken silently, one size in the budgets, another in use
            raise ValueError(f"geometry: block_tokens={geometry.block_tokens}, but the TierConfig says "
                             f"block_tokens={config.block_tokens}; give both the same")
        self.geometry = geometry
        self.device = torch.device(device if device is not None else (config.device or "cpu"))
        check_store_device(self.device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # "cuda" means the device current now, for good: pools and later index tensors
            # alike (left bare, a thread whose current device differs put them apart)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.events = events if events is not None else Events(config.eviction)
        self._cuda = self.device.type == "cuda"
        self._copy_jobs = max(1, min(config.io_workers, _usable_cores()))  # see _submit_all
        if self._cuda:
            self._copy_jobs = min(self._copy_jobs, _CUDA_JOBS)
        num_slots = {Tier.DEVICE: self._slots_for("device_budget", config.device_budget, geometry.block_bytes)}
        if config.host_enabled:
            num_slots[Tier.HOST] = self._slots_for("host_budget", config.host_budget, geometry.padded_bytes)
        disk_dir = disk_dir or config.disk_dir
        self.disk: Optional[DiskTier] = None
        if config.disk_enabled and disk_dir is not None:
            disk_io = resolve_disk_io(config.disk_io, self._cuda)  # before anything is allocated
            record_bytes = DiskTier.record_size(geometry)
            num_slots[Tier.DISK] = self._slots_for("disk_budget", config.disk_budget, record_bytes,
                                                   DiskTier.record_layout(geometry))
        self.table = BlockTable(num_slots)
        self.engine: Optional[TransferEngine] = None
        self.host_pool: Optional[HostPool] = None
        try:
            # Pools are ordinary tensors even when built under torch.inference_mode(): the I/O
            # threads write them outside it.
            with torch.inference_mode(False):
                self.tiers = self.table.tiers()
                self._below = dict(zip(self.tiers, self.tiers[1:]))  # tier -> the next one down
                with _allocating("device_budget", config.device_budget, self.device):
                    self.device_pool = DevicePool(geometry, num_slots[Tier.DEVICE], self.device)
                if Tier.HOST in num_slots:
                    with _allocating("host_budget", config.host_budget, torch.device("cpu")):
                        self.host_pool = HostPool(geometry, num_slots[Tier.HOST], pin=self._cuda,
                                                  on_pin_fallback=self.events.pinned_fallback)
                if Tier.DISK in num_slots:
                    self.disk = DiskTier(disk_dir, geometry, num_slots[Tier.DISK], direct_io=config.direct_io,
                                         model_digest=model_digest, persistent=persistent,
                                         allow_shared_dir=config.shared_dir, io=disk_io,
                                         io_threads=config.io_workers, io_fallback=config.disk_io == "auto")
            # A plug-in policy's failures (``tiercache.guard``), raised by the next public call
            # that starts work (``_starts_work``); ``_calls.depth``: such calls running on a thread.
            self._policy_failures: list = []
            self._disk_write_error: Optional[OSError] = None  # the last failed write to disk
            # disk slot -> (key, error) of a freed record whose tombstone failed: the slot is
            # held out of use (``BlockTable.hold``) until ``_retry_tombstones`` invalidates it
            self._unerased: dict = {}
            self.policies = {tier: self._guarded(make_eviction(config.eviction), config.eviction, tier)
                             for tier in self.tiers}
            # CPU with a host tier: attention reads blocks on the device and on the host where
            # they lie (``read_layer``), so a host copy of a block on the device is never read.
            self._reads_both = self.device.type == "cpu" and Tier.HOST in self.tiers
            self._lock = threading.RLock()
            self._putting = 0  # puts filling a slot now (``_put_to``); _put_done: one of them ended
            self._put_done = threading.Condition(self._lock)
            # Prepared moves, started or not -> their waiters' future, made on demand (``_future``):
            # None, or the batch (``_Work``) copying the move until someone asks for one.
            self._inflight: dict = {}
            # moves in ``_inflight`` to or from the device: on CPU each is a memcpy on the thread
            # that runs it (device<->host, or through the staging buffer to or from the disk)
            self._copying = 0
            self._started: set = set()
            self._to_device: dict = {}  # key -> the move filling its device copy
            self._tokens: dict = {}  # key -> tokens written (for disk headers)
            self._token_ids: dict = {}  # key -> packed token ids (prefix-cache blocks)
            self._prefetched: dict = {}  # key -> tier a prefetch brought it to
            self._counted_once: set = set()  # keys whose hit the layer's next read must not count again
            self._evicted_down: set = set()  # demotions an eviction started: written further down after
            self._np_pools: Optional[tuple] = None  # see _byte_pools
            self._gather_buf: Optional[tuple] = None  # see _gather_mixed(reuse=True)
            # CPU with host and disk tiers: disk blocks read straight into attention's buffers
            # (``read_layer(hold=True)``), and key -> the future of such a read in flight.
            self._streams: Optional[DiskStreams] = DiskStreams(self) if self._reads_both and self.disk else None
            self._streaming: dict = {}
            self._reads_gate: Optional[_ReadsGate] = None  # set while reorder_rows holds new reads off (``_quiet``)
            self._views: list = []  # [(entry, copy)] held for views read_layer returned (release_views)
            # How read_layer served attention: zero-copy views, or gathers (copies, bytes, seconds).
            self.read_stats = {"views": 0, "gathers": 0, "gathered_bytes": 0, "gather_seconds": 0.0}
            self._children: dict = {}  # prefix block -> blocks that extend it (see ``link``)
            self._lost: dict = {}  # key -> why its last copy went (a failed check), the latest _LOST_KEPT
            self._parent: dict = {}
            with torch.inference_mode(False):
                # Pinned on CUDA: disk<->device moves then copy asynchronously at full speed.
                self._staging = _BufferPool(geometry.padded_bytes, config.io_workers + 2, pin=self._cuda)
            self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
            # Host<->device moves through a staging copy on the device (``_host_device_copy``):
            # on CUDA; a test switches it on for a CPU store to check the layout.
            self._staged_copies = self._cuda
            self._device_staging: Optional[_BufferPool] = None  # made on first use (_device_lease)
            self._staging_bytes = 0  # of each such buffer, the part for blocks; the rest is gather scratch
            # The stream the model computes on (see ``_compute_barrier``).
            self._compute_stream = torch.cuda.current_stream(self.device) if self._cuda else None
            self.defer_stall = False  # the HF layer records one stall event per layer update
            # False: sealed blocks get no clean copy below (``write_behind`` does nothing); for
            # blocks that have a copy elsewhere already, e.g. those loaded from the prefix cache.
            # A block without a lower copy is demoted (written down) if and when it is evicted.
            self.write_behind_enabled = True
            self._stall_acc = 0.0
            self.engine = TransferEngine(config.io_workers, config.queue_depth, on_wait=self._stalled)
            # host->disk moves: the payload's CRC32C computed ahead of the writers (``_checksum_ahead``)
            self._crcs: dict = {}  # move -> Future of its payload's CRC
            self._crc_pool = None  # one thread, made on the first such move
            if self.disk is not None and persistent:
                self._adopt_disk_records()  # e.g. records of another format version: refused
        except BaseException:  # nothing half built stays open: the disk tier holds its directory's lock
            self._close_partly()
            raise

    # ---- construction helpers --------------------------------------------------------
    @property
    def forked(self) -> bool:
        """Whether this process is a child made by ``fork()`` after the store opened: the
        I/O threads stayed in the parent (a move would wait for good), and the files and
        locks are the parent's."""
        return os.getpid() != self._pid

    def _enter(self, name: str) -> None:
        if self.forked:
            raise RuntimeError(f"BlockStore.{name}: this store was opened in process {self._pid}, and this process "
                               f"is a fork() of it: its I/O threads and files stay with that process. Make a new "
                               f"TieredCache (or store) in this process")
        with self._active_cv:
            if self.closed:
                raise RuntimeError(f"BlockStore.{name}: the store is closed")
            # Still counted: a Ctrl-C in this thread's last call's exit kept it so (after the
            # call, before its ``_leave``); this call takes that count over, and its own
            # ``_leave`` ends it.
            if not getattr(self._calls, "counted", False):
                self._active, self._calls.counted = self._active + 1, True

    def _leave(self) -> None:
        """Uncount this thread's outermost call, once: run again after an interrupt (see
        ``_uninterrupted``), it finds the call already uncounted."""
        calls = self._calls
        if not getattr(calls, "counted", False) and (self._active or self.forked):
            return  # not counted (refused, or done before an interrupt) and nobody to wake
        with self._active_cv:
            if getattr(calls, "counted", False):
                calls.counted, self._active = False, self._active - 1  # one statement: both or neither
            if not self._active:
                self._active_cv.notify_all()

    def _close_partly(self) -> None:
        """A constructor that failed half way (a policy's constructor, an allocation, the
        disk's records) lets go of what it opened: the I/O threads, the disk tier's file and
        the lock on its directory (else a new store on that directory in this process is
        refused as "in use" for as long as the process lives), the pinned buffers."""
        self.closed = True
        for part in (self.engine, getattr(self, "_staging", None), self.disk, self.host_pool):
            if part is not None:
                try:
                    part.close()
                except Exception:  # noqa: BLE001 - the constructor's own error is the one to raise
                    log.exception("tiercache: closing a store that failed to open")

    @staticmethod
    def _slots_for(field: str, budget: int, unit_bytes: int, unit_text: Optional[str] = None) -> int:
        n = budget // unit_bytes
        if n < 1:
            raise ValueError(f"{field}: {budget} bytes ({format_bytes(budget)}) is smaller than one block "
                             f"({unit_text or f'{unit_bytes} bytes on this tier'}); raise it or lower block_tokens")
        return n

    def _guarded(self, policy, name: str, tier: Tier):
        """``policy`` (registered as ``name``) as the store calls it: through
        ``GuardedPolicy`` if it is a plug-in."""
        if not is_plugin(policy):
            return policy
        return GuardedPolicy(policy, name, tier.label, lambda: self.table.ready_keys(tier),
                             self._policy_failures.append, self.role)

    def policy_failures(self) -> list:
        """The ``PolicyError`` of each plug-in eviction policy that failed and was replaced by
        ``lru`` (``tiercache.guard``), one per tier, for as long as the store is open."""
        return [policy.failure for policy in self.policies.values() if getattr(policy, "failure", None) is not None]

    def _raise_policy_failure(self) -> None:
        """Raise the plug-in policy failure reported first (``tiercache.guard``), once."""
        with self._lock:
            failures, self._policy_failures[:] = list(self._policy_failures), []
        if failures:
            raise failures[0]

    def _adopt_disk_records(self) -> None:
        """Adopt the valid records of the data file; erase the bad ones, and cut away those
        past the budget (a smaller one than they were written under), with a warning. The
        whole file is scanned first, so that a file of another model's records is refused
        (``CacheDirError``) before anything in it changes.

        A key with two whole records that differ (its older record's invalidation failed,
        and the block was stored and written again: ``_unerased_at_close``) has all of them
        erased, with a warning: nothing on disk says which one is current, and the first
        one scanned was kept, so a block could come back with its older bytes. A cache
        recomputes a block it lost; it cannot tell a stale one from the right one. Records
        of a key that agree (the same tokens, token ids and payload checksum: a copy of
        the file's bytes) are one block: the first is kept, as before."""
        records = list(self.disk.scan(with_token_ids=True, whole_file=True))
        strangers = sum(1 for _, _, num_tokens, _ in records if num_tokens == NOT_A_RECORD)
        if strangers and strangers == len(records):  # bytes everywhere, not one record header
            raise CacheDirError(f"disk_dir: {self.disk.path!r} is not a tiercache data file of this block size: "
                                f"{strangers} of its slots hold bytes that are no record header (another "
                                f"program's file, or one written with another block shape); nothing was changed "
                                f"(use another directory, or clear this one)")
        seen: dict = {}  # key -> the slots of its whole records
        for slot, key, _, _ in records:
            if key is not None:
                seen.setdefault(key, []).append(slot)
        doubtful = {key for key, slots in seen.items()  # past the budget too: any may be the current one
                    if len(slots) > 1 and not self.disk.records_agree(slots)}
        dropped = past = twice = 0
        inside: list = []  # whole records within the budget, one per key: [(slot, key, num_tokens, token_ids)]
        beyond: list = []  # the same past it (a file written under a larger budget)
        kept: set = set()
        for record in records:
            slot, key = record[0], record[1]
            if key in doubtful:
                twice += 1
                if slot < self.disk.num_slots:
                    self.disk.tombstone(slot)
                    dropped += 1
                else:
                    past += 1
                continue
            if slot >= self.disk.num_slots:
                if key is not None:
                    beyond.append(record)
                continue
            if key is None or key in kept:  # a copy of a record kept above: one of them is kept
                dropped += 1
                if key is None:
                    self.events.integrity_error("disk")
                self.disk.tombstone(slot)
                continue
            kept.add(key)
            inside.append(record)
        unique: list = []
        copies = 0  # past the budget's end, copies of records kept
        for record in beyond:
            if record[1] in kept:  # a copy of a record kept (they agree): one of them is kept
                copies += 1
            else:
                kept.add(record[1])
                unique.append(record)
        beyond = unique
        self.dropped_groups_for_budget: set = set()  # (seq, index) of the blocks dropped for the budget
        cut = 0
        if beyond:  # more blocks than the budget holds: whole groups of them kept, the rest go
            everything = inside + beyond
            inside, beyond = self._fit_to_budget(inside, beyond)
            kept_keys = {r[1] for r in inside + beyond}
            for slot, key, *_ in everything:
                if key not in kept_keys:
                    self.dropped_groups_for_budget.add(_record_group(key))
                    cut += 1
                    if slot < self.disk.num_slots:
                        self.disk.tombstone(slot)
        for slot, key, num_tokens, token_ids in inside:
            self._adopt_record(key, slot, num_tokens, token_ids)
        moved = self._move_within_budget(beyond)
        past += copies + cut + len(beyond) - moved
        self.disk.cut_to_budget()
        if twice:
            log.warning("tiercache: %s held %d differing records of %d blocks (a record whose invalidation "
                        "failed, then the block written again); all of them were dropped, since which one is "
                        "current cannot be told", self.disk.path, twice, len(doubtful))
        if copies:
            log.warning("tiercache: %s held %d saved blocks past disk_budget's end (%d blocks here) that are copies "
                        "of blocks kept; they were dropped", self.disk.path, copies, self.disk.num_slots)
        if cut:
            log.warning("tiercache: %s held more saved blocks than disk_budget holds (%d blocks here): %d were "
                        "dropped (whole groups of a block's layers, a sequence's first blocks kept first), %d "
                        "kept", self.disk.path, self.disk.num_slots, cut, len(inside) + moved)
        if moved:
            log.warning("tiercache: %s: %d saved blocks past disk_budget's end (%d blocks here) were moved into free "
                        "slots within it", self.disk.path, moved, self.disk.num_slots)
        self.dropped_on_open = dropped + past
        self.dropped_past_budget = past

    def _adopt_record(self, key: Hashable, slot: int, num_tokens: int, token_ids: bytes) -> None:
        self.table.adopt(key, Tier.DISK, slot)
        self.policies[Tier.DISK].insert(key)
        self._tokens[key] = num_tokens
        if token_ids:
            self._token_ids[key] = token_ids

    def _fit_to_budget(self, inside: list, beyond: list) -> tuple:
        """Open, with more saved blocks than the budget holds (a smaller one than the file
        was written under; records as ``_adopt_disk_records``' ``inside`` and ``beyond``):
        which to keep. Whole groups — the layers of one block index of one sequence
        (``_record_group``): a prefix block is of use only whole, and only with the blocks
        before it — lowest block index first, then in file order, as many as fit. Returns
        the records kept (within the budget, past it). A smaller budget used to
        cut by file position: 12 prefix blocks, whose layers lay all over the file, all went
        under a budget that holds 6 (a review)."""
        groups: dict = {}  # group -> [records], in file order of their first record
        for record in sorted(inside + beyond, key=lambda r: r[0]):
            groups.setdefault(_record_group(record[1]), []).append(record)
        order = sorted(groups, key=lambda g: (g[1] if len(g) == 2 else 0, groups[g][0][0]))
        # A block missing layers (an open like this one cut short by a crash, after it erased
        # a dropped block's records within the budget but before the cut took those past it;
        # or damage) is of no use: only groups as large as the largest are kept (a review)
        whole = max((len(records) for group, records in groups.items() if len(group) == 2), default=0)
        room, keep = self.disk.num_slots, set()
        for group in order:
            if len(group) == 2 and len(groups[group]) < whole:
                continue
            if len(groups[group]) <= room:
                keep.add(group)
                room -= len(groups[group])
        limit = self.disk.num_slots
        kept = [r for g in keep for r in groups[g]]
        return [r for r in kept if r[0] < limit], [r for r in kept if r[0] >= limit]

    def _move_within_budget(self, beyond: list) -> int:
        """Open: move the records kept past the budget (``_fit_to_budget``) into free slots
        within it, bytes as they are, and adopt them there; returns how many moved (the rest
        go with ``cut_to_budget``). Every payload is written and made durable before any
        header (``DiskTier.copy_record_part``), and the headers before the cut: a crash at
        any point leaves either no valid copy in the slot or two copies that agree, of
        which the next open keeps one. If the disk fails, none is kept."""
        spots = self.table.free_slots(Tier.DISK)
        plan = [(record, next(spots)) for record in sorted(beyond, key=lambda r: r[0])]
        moved = 0
        try:
            for header in (False, True):  # payloads, durable, then headers (``copy_record_part``)
                for (slot, *_), dst in plan:
                    self.disk.copy_record_part(slot, dst, header)
                self.disk.sync()
            for (_, key, num_tokens, token_ids), dst in plan:
                self._adopt_record(key, dst, num_tokens, token_ids)
                moved += 1
        except OSError as exc:  # none is adopted: the originals go with the cut, as before this
            log.warning("tiercache: %s: moving saved blocks within disk_budget failed (%s); they are dropped",
                        self.disk.path, exc.strerror or exc)
            for _, dst in plan:  # a copy whose header landed must not come back at the next open
                try:
                    self.disk.tombstone(dst)
                except OSError:
                    pass
        return moved

    # ---- queries ---------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes

    def num_slots(self, tier: Tier) -> int:
        return self.table.num_slots(as_tier(tier, "num_slots"))

    def capacity_blocks(self) -> int:
        """Distinct blocks that fit when every tier holds different ones."""
        return sum(self.table.num_slots(t) for t in self.tiers)

    def tiers_of(self, key: Hashable) -> list:
        with self._lock:  # a move on another thread changes the block's copies
            entry = self.table.get(key)
            return [] if entry is None else entry.ready_tiers()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self.table

    def __len__(self) -> int:
        with self._lock:
            return len(self.table)

    def tier_stats(self) -> dict:
        out = {}
        with self._lock:
            for tier, name in ((Tier.DEVICE, "device"), (Tier.HOST, "host"), (Tier.DISK, "disk")):
                unit = self._unit_bytes(tier)
                budget = {Tier.DEVICE: self.config.device_budget, Tier.HOST: self.config.host_budget,
                          Tier.DISK: self.config.disk_budget if self.disk is not None else 0}[tier]
                used = self.table.num_used(tier)
                out[name] = {"budget_bytes": budget if tier in self.tiers else 0,
                             "used_bytes": used * unit, "blocks": used,
                             "capacity_blocks": self.table.num_slots(tier)}
            if self.disk is not None:  # how records are read and written
                out["disk"].update(io=self.disk.io, direct_io=self.disk.direct_io)
        return out

    def stats(self) -> dict:
        return self.events.snapshot(self.tier_stats())

    def _unit_bytes(self, tier: Tier) -> int:
        if tier is Tier.DEVICE:
            return self.geometry.block_bytes
        if tier is Tier.HOST:
            return self.geometry.padded_bytes
        return DiskTier.record_size(self.geometry)

    # ---- generic block API -------------------------------------------------------------
    @_starts_work
    def put(self, key: Hashable, block: torch.Tensor, num_tokens: Optional[int] = None,
            token_ids: bytes = b"", tier: Optional[Tier] = None) -> None:
        """Store a new block (``[2, B, H, T, D]``) on the device tier (or on ``tier=Tier.HOST``,
        "host" or 1, when the store has a host tier), evicting as needed; ``tier`` names no
        other tier (the disk is reached by demotion: a ValueError).

        ``token_ids`` (``DiskTier.pack_token_ids``) travel with the block into its disk
        record header, so a reopened store knows which tokens it holds (``token_ids_of``).

        The slot is FILLING while the bytes are copied in, and READY only after: a flush, a
        demotion or a ``get`` on another thread never reads it half written. (The device
        slot was READY first: a concurrent ``flush()`` wrote its old bytes to disk with a
        valid checksum, and the block read back as another block's, found by a helper.)
        """
        self._check_put(key, block, num_tokens, token_ids)
        if tier is not None:  # a name or a number as promote() takes them; it went to the device
            tier = as_tier(tier, "put: tier")  # whatever it named, silently (a review)
            if tier is Tier.DISK:
                raise ValueError("put: tier=disk: a block is stored on the device or the host tier and "
                                 "reaches the disk by demotion (demote, flush)")
        if key in self:  # another copy with other bytes would make its copies disagree
            raise ValueError(f"block {key!r} is already stored; delete it first")
        block = block.to(self.geometry.dtype)
        self._put_to(Tier.HOST if tier is Tier.HOST and Tier.HOST in self.tiers else Tier.DEVICE,
                     key, block, num_tokens, token_ids)

    def _check_put(self, key: Hashable, block: object, num_tokens: Optional[int], token_ids: bytes) -> None:
        """``put``'s arguments, each refused by name: what the disk record cannot hold failed
        only when the block was written down (a bare ``struct.error``, the block stuck above
        the disk, and every later eviction failing with it) or came back as corrupt."""
        if not isinstance(block, torch.Tensor):
            raise TypeError(f"block: expected a torch.Tensor, got {type(block).__name__}")
        if block.device.type == "meta":
            raise ValueError("block: a meta tensor holds no data")
        if tuple(block.shape) != self.geometry.shape:
            raise ValueError(f"block shape {tuple(block.shape)} != {self.geometry.shape}")
        if (block.dtype.is_floating_point != self.geometry.dtype.is_floating_point or block.dtype.is_complex
                or torch.promote_types(block.dtype, self.geometry.dtype) != self.geometry.dtype):
            # float64 -> float32 turned 1e300 into inf, complex lost its imaginary part: silently
            raise ValueError(f"block dtype {block.dtype} does not fit the store's {self.geometry.dtype} "
                             f"without loss; convert it first")
        bt = self.geometry.block_tokens
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                       or not 0 <= num_tokens <= bt):
            raise ValueError(f"num_tokens: an int in [0, {bt}] (the block's tokens), got {num_tokens!r}")
        if not isinstance(token_ids, (bytes, bytearray)):
            raise ValueError(f"token_ids: packed ids as bytes (DiskTier.pack_token_ids), "
                             f"not {type(token_ids).__name__}")
        if len(token_ids) % 3 or len(token_ids) > 3 * RecordCodec.MAX_TOKEN_IDS:
            raise ValueError(f"token_ids: packed ids (DiskTier.pack_token_ids: 3 bytes each, at most "
                             f"{RecordCodec.MAX_TOKEN_IDS}), got {len(token_ids)} bytes")
        if self.disk is not None and not (
                isinstance(key, BlockKey) and all(isinstance(v, int) and not isinstance(v, bool) for v in key)
                and 0 <= key[0] < 1 << 64 and 0 <= key[1] < 1 << 32 and 0 <= key[2] < 1 << 32):
            raise ValueError(f"key: a store with a disk tier names blocks by BlockKey(seq_id, layer, index) of "
                             f"non-negative ints (its records carry the key), got {key!r}")

    def _put_to(self, tier: Tier, key: Hashable, block: torch.Tensor, num_tokens: Optional[int],
                token_ids: bytes) -> None:
        """``put`` into ``tier``: a slot allocated FILLING (nobody reads, moves or evicts it),
        the bytes copied in, then committed READY; a copy that fails gives the slot back."""
        stall = 0.0
        since: list = []  # see _wait_out_readers
        while True:
            with self._lock:
                if self.table.get(key) is not None:  # a put of the same key on another thread won
                    raise ValueError(f"block {key!r} is already stored; delete it first")
                moves = self._room(tier, 1, {key}, allow_writeback=True)
                if self.table.num_free(tier) < 1 and not moves:
                    if self._putting:
                        # Slots that other threads' puts are filling: READY in a moment,
                        # and then they can move down. Six puts at once on a two-slot device
                        # failed with CapacityError while the disk had room (a helper's run).
                        self._put_done.wait(0.05)
                        continue
                    if self._wait_out_readers(tier, {key}, since, new=1):
                        continue
                    raise CapacityError(self._full_message(1, tier, {key}))
                if self.table.num_free(tier) >= 1 and not moves:
                    slot = self.table.allocate(key, tier)  # FILLING
                    entry = self.table.get(key)
                    self._putting += 1
                    break
            stall += self._wait_moves(moves, raise_io=True)
        try:
            if tier is Tier.HOST:
                self.host_pool.view(slot).copy_(block)
            else:
                self.device_pool.write_block(slot, block)
        except BaseException:
            with self._lock:
                self._putting -= 1
                self._put_done.notify_all()
                self._released(key, tier, self.table.abort(entry, tier))
            raise
        with self._lock:
            self._putting -= 1
            self._put_done.notify_all()
            if entry.deleted:  # deleted on another thread while its bytes came in: it landed and went
                self._released(key, tier, self.table.abort(entry, tier))
                self._stalled(stall)
                return
            self.table.commit(entry, tier)
            self.policies[tier].insert(key)
            self._tokens[key] = self.geometry.block_tokens if num_tokens is None else num_tokens
            self._lost.pop(key, None)  # a new block under this key
            if token_ids:
                self._token_ids[key] = bytes(token_ids)
            self._stalled(stall)

    def token_ids_of(self, key: Hashable) -> bytes:
        """The packed token ids stored with ``key`` (b"" when none were)."""
        with self._lock:
            return self._token_ids.get(key, b"")

    @_starts_work
    def get(self, key: Hashable) -> torch.Tensor:
        """A copy of the block's bytes from its fastest intact copy (no promotion).

        Raises ``KeyError`` for an unknown block and ``BlockCorruptedError`` when every copy
        failed its integrity check: then, and for every later call that names the block
        (``get``, ``read_into``, ``pin``, moves), until a block is stored under its key again.
        """
        while True:
            self._past_reorder()
            with self._lock:
                if self.table.get(key) is None:
                    self.events.miss()
                    raise self._unknown(key)
                tier = self.table.best_source(key)
                if tier is None:  # only copies in flight: wait for them, then look again
                    waits = self._inflight_for(key)
                else:
                    entry = self.table.get(key)
                    copy = entry.copies[tier]
                    copy.readers += 1  # a reader: this slot is not freed while we copy
                    slot, waits = copy.slot, None
            if waits is not None:
                t0 = time.perf_counter()
                wait_all(waits)
                self._stalled(time.perf_counter() - t0)
                continue
            out = torch.empty(self.geometry.shape, dtype=self.geometry.dtype)
            corrupted = read = False
            try:
                if tier is Tier.DEVICE:
                    self.device_pool.read_block(slot, out)
                elif tier is Tier.HOST:
                    out.copy_(self.host_pool.view(slot))
                else:
                    with self._staging.take() as buf:
                        self.disk.read(slot, key, buf)
                        out.copy_(self._as_block(buf))
                read = True
            except RecordError as exc:
                corrupted = True
                self.events.integrity_error(tier.label)
                reason = str(exc)
            finally:
                with self._lock:
                    copy.readers -= 1
                    if entry.deleted:  # a failed tombstone is held and logged (``_released``)
                        for t, freed_slot in self.table._collect(entry):
                            self._released(key, t, freed_slot, errors=[])
                    elif corrupted:
                        self._discard(key, tier)
                    elif read:  # a use for the tier's policy (not a read that failed)
                        self.policies[tier].touch(key)
                    lost = corrupted and self.table.best_source(key) is None and not self._moving(key)
                    if lost:
                        self._forget(key)
            if lost:
                raise BlockCorruptedError(f"block {key!r}: its {tier.label} record failed its integrity "
                                          f"check ({reason}) and no intact copy exists")
            if not corrupted:
                self.events.hit(tier.label)
                return out

    READ_CHUNK = 8  # records per job of ``read_into`` (fewer jobs, still enough reads in flight)

    @_starts_work
    def read_into(self, keys: list, outs: list) -> list:
        """Copy the bytes of each of ``keys`` into the matching tensor of ``outs`` (CPU,
        ``[2, B, H, T, D]`` of the store's dtype, any strides: e.g. a block's slice of a
        larger per-layer tensor), like ``get`` (fastest intact copy, no promotion, hits
        counted) but for many blocks at once and without intermediate copies: disk records
        are read on the I/O threads in parallel, straight into ``outs`` (with direct I/O when
        each [T, D] plane of the destination is page-aligned), each checked against its
        CRC32C before it counts as read.

        Returns one entry per key: None when ``outs[i]`` holds the block, else the exception
        ``get`` would raise (``KeyError``, ``BlockCorruptedError``, ``OSError``). A record
        that fails its check is dropped (and counted) as ``get`` drops it; another intact
        copy of the block is used when there is one. Blocks whose copies are all in flight
        are read through ``get``.
        """
        keys = _key_list(keys, "read_into")
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} destination tensors")
        g = self.geometry
        for out in outs:
            if tuple(out.shape) != g.shape or out.dtype != g.dtype or out.device.type != "cpu":
                raise ValueError(f"destination {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                                 f"{g.shape} {g.dtype} on cpu")
        errors: list = [None] * len(keys)
        held, slow = [], []  # held: (i, key, entry, copy, tier)
        self._past_reorder()
        with self._lock:
            for i, key in enumerate(keys):
                entry = self.table.get(key)
                if entry is None:
                    self.events.miss()
                    errors[i] = self._unknown(key)
                    continue
                tier = self.table.best_source(key)
                if tier is None:  # only copies in flight
                    slow.append(i)
                    continue
                copy = entry.copies[tier]
                copy.readers += 1  # not freed while we read it
                held.append((i, key, entry, copy, tier))
        results: dict = {}  # i -> None (read) or the RecordError / OSError of its copy
        futures: list = []
        jobs: list = []
        try:
            chunks = [held[j:j + self.READ_CHUNK] for j in range(0, len(held), self.READ_CHUNK)]
            for c in chunks:
                # The job holds its chunk only: a worker thread keeps its last job alive, and
                # ``outs`` must not outlive this call through it (the chunk is emptied below).
                c_outs = [outs[i] for i, *_ in c]
                futures.append(self.engine.submit(lambda c=c, o=c_outs: self._read_chunk(c, o), Priority.DEMAND))
                jobs.append(c_outs)
            t0 = time.perf_counter()  # a wait for queue room above is counted by the engine (on_wait)
            for chunk, future in zip(chunks, futures):
                try:
                    results.update(future.result())
                except Exception as exc:  # noqa: BLE001 - a job that failed as a whole
                    for i, *_ in chunk:
                        results.setdefault(i, exc)
            self._stalled(time.perf_counter() - t0)
        finally:
            wait_all(futures)  # interrupted: no job may still be reading a copy we let go of
            for c_outs in jobs:
                c_outs.clear()
            retry = []
            with self._lock:
                for i, key, entry, copy, tier in held:
                    copy.readers -= 1
                    outcome = results.get(i)
                    if entry.deleted:  # a failed tombstone is held and logged (``_released``)
                        for t, freed_slot in self.table._collect(entry):
                            self._released(key, t, freed_slot, errors=[])
                        if outcome is None and i in results:
                            self.events.hit(tier.label)
                        else:
                            errors[i] = KeyError(key)
                        continue
                    if i in results and outcome is None:
                        self.events.hit(tier.label)
                        self.policies[tier].touch(key)
                    elif isinstance(outcome, RecordError):
                        self.events.integrity_error(tier.label)
                        self._discard(key, tier)
                        if self.table.best_source(key) is None and not self._moving(key):
                            self._forget(key)
                            errors[i] = BlockCorruptedError(
                                f"block {key!r}: its {tier.label} record failed its integrity check "
                                f"({outcome}) and no intact copy exists")
                        else:
                            retry.append(i)
                    elif i in results:
                        errors[i] = outcome
                    else:  # the wait was interrupted: nothing read
                        errors[i] = RuntimeError(f"block {key!r} was not read")
        for i in slow + retry:
            try:
                outs[i].copy_(self.get(keys[i]))
            except (KeyError, BlockCorruptedError, OSError) as exc:
                errors[i] = exc
        return errors

    @torch.inference_mode()  # ``outs`` may be inference tensors (a caller under inference_mode)
    def _read_chunk(self, chunk: list, outs: list) -> dict:
        """On an I/O thread: read each held copy of ``chunk`` into its tensor of ``outs``."""
        got: dict = {}
        for (i, key, _entry, copy, tier), out in zip(chunk, outs):
            try:
                if tier is Tier.DISK:
                    parts = _byte_planes(out)
                    if parts is not None:
                        self.disk.read_into(copy.slot, key, parts)
                    else:
                        with self._staging.take() as buf:
                            self.disk.read(copy.slot, key, buf)
                            out.copy_(self._as_block(buf))
                elif tier is Tier.HOST:
                    out.copy_(self.host_pool.view(copy.slot))
                else:
                    g = self.geometry
                    plane = (g.batch, g.kv_heads, g.block_tokens, g.head_dim)
                    out[0].copy_(self.device_pool.k[:, copy.slot].view(plane))
                    out[1].copy_(self.device_pool.v[:, copy.slot].view(plane))
                got[i] = None
            except (RecordError, OSError) as exc:
                got[i] = exc
        return got

    @_ends_work
    def delete(self, key: Hashable) -> None:
        """Forget ``key``; copies in flight are freed when their move completes. In a
        persistent store, a disk record of the block being written now is waited for, and
        invalidated, before this returns: it used to land after the delete, and a crash
        before its move completed brought the deleted block back at the next open (with 0
        tokens), or, with the key stored again, dropped the new block as one of two
        differing records after flush() had said it was written (a review: 11 of 12 kills)."""
        with self._lock:
            writing = self._writes_of(key) if self.disk is not None and self.disk.persistent else []
            self._forget(key)
        wait_all(writing)  # the write's own error, if any, is the deleted block's: nothing to report

    def _writes_of(self, key: Hashable) -> list:
        """Under the lock: futures of the moves writing ``key``'s disk record now: those
        started (a job submitted, which runs). One prepared and not yet started is not waited
        for (its caller starts it later, or rolls it back); when it runs, its write sees the
        block gone and is not made (``_copy``)."""
        return [self._future(m) for m in self._inflight
                if m.key == key and m.dst is Tier.DISK and m in self._started]

    @_ends_work
    def link(self, key: Hashable, parent: Hashable) -> None:
        """Declare that block ``key`` extends the prefix block ``parent``.

        A prefix block is never evicted from a tier while a block that extends it is on that
        tier: extensions go first (leaf-first, as radix-tree prefix caches evict), so a shared
        prefix outlives every sequence built on it.
        """
        with self._lock:
            up = parent
            while up is not None:
                if up == key:
                    raise ValueError(f"link({key!r}, {parent!r}) would make a cycle of prefix blocks")
                up = self._parent.get(up)
            self._unlink(key)
            self._parent[key] = parent
            self._children.setdefault(parent, set()).add(key)

    def _unlink(self, key: Hashable) -> None:
        parent = self._parent.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[parent]

    def extended(self, keys: Iterable[Hashable]) -> bool:
        """Whether a stored block extends any of ``keys`` (``link``), on any tier."""
        with self._lock:
            return any(key in self._children for key in keys)

    def _extended_on(self, key: Hashable, tier: Tier) -> bool:
        return any(self.table.copy(child, tier) is not None for child in self._children.get(key, ()))

    @_starts_work
    def evict_candidates(self, tier: Tier, n: int, leaves_only: bool = False) -> list:
        """Up to ``n`` blocks the eviction policy of ``tier`` would remove whole: idle
        copies, and never a prefix block while an extension of it is on that tier (with
        ``leaves_only``, on any tier: for a caller that deletes the blocks everywhere)."""
        tier = as_tier(tier, "evict_candidates")
        if tier not in self.tiers:
            return []
        with self._lock:
            def idle(key) -> bool:
                return self.table.is_movable(key, tier) and not self._extended_on(key, tier) \
                    and not (leaves_only and key in self._children) and not self._moving(key)
            victims = self.policies[tier].evict(n, idle)
            if victims is None:
                victims = [k for k in self.table.keys_on(tier) if idle(k)][:n]
            return victims

    @_ends_work
    def drop_copies(self, tier: Tier) -> int:
        """Drop every idle copy on ``tier``; a block whose only copy it is goes entirely."""
        tier = as_tier(tier, "drop_copies")
        dropped = 0
        failed: list = []  # tombstones that failed: raised once every copy is dropped
        with self._lock:
            for key in list(self.table.keys_on(tier)):
                if self.table.can_drop(key, tier):
                    self._drop(key, tier, evicted=False, errors=failed)
                elif self.table.is_movable(key, tier) and not self._moving(key):
                    try:
                        self._forget(key)
                    except OSError as exc:  # its books are done (``_forget``)
                        failed.append(exc)
                else:
                    continue
                dropped += 1
        if failed:
            raise failed[0]
        return dropped

    @_ends_work
    def pin(self, keys: Iterable[Hashable]) -> None:
        """Pin each block of ``keys`` (a pinned block keeps its device copy); all or none:
        a key the store does not hold is a KeyError, as in ``get``, and nothing is pinned."""
        keys = _key_list(keys, "pin")
        with self._lock:
            for key in keys:
                if self.table.get(key) is None:
                    raise self._unknown(key)
            for key in keys:
                self.table.pin(key)

    def unpin(self, keys: Iterable[Hashable]) -> None:
        """Undo one ``pin`` of each block of ``keys``; blocks deleted since are skipped.
        All or none: a block that is not pinned (as often as it appears in ``keys``) is a
        ValueError naming it, and nothing is unpinned."""
        keys = _key_list(keys, "unpin")
        with self._lock:
            count: dict = {}
            for key in keys:
                entry = self.table.get(key)
                if entry is not None:
                    count[key] = count.get(key, 0) + 1
                    if count[key] > entry.pins:
                        raise ValueError(f"unpin: block {key!r} is not pinned"
                                         + (f" {count[key]} times" if count[key] > 1 else ""))
            for key in keys:
                if key in count:
                    self.table.unpin(key)

    def _check_held(self, keys: Iterable[Hashable]) -> None:
        """A move named a block the store does not hold: a KeyError, as ``get`` and ``pin``
        raise (``BlockCorruptedError`` if it was lost to a failed check). Moves of such
        keys did nothing and said nothing, and only ``promote`` to the device raised."""
        with self._lock:
            for key in keys:
                if self.table.get(key) is None:
                    raise self._unknown(key)

    @_starts_work
    def promote(self, key: Hashable, dst: Tier = Tier.DEVICE) -> Future:
        """Copy ``key`` up to ``dst`` asynchronously (the lower copy stays). A key the store
        does not hold is a KeyError."""
        dst = as_tier(dst, "promote")
        self._check_held((key,))
        if dst is Tier.DEVICE:
            return _done_future(lambda: self.ensure_device([key], pin=False))

        def plan():
            src = self.table.best_source(key, below=dst)
            if src is None or self.table.copy(key, dst) is not None:
                return None
            return src, dst, False, Priority.PREFETCH
        return self._move_when_room(key, plan)

    @_starts_work
    def demote(self, key: Hashable) -> Future:
        """Move the fastest copy of ``key`` one tier down asynchronously. A key the store
        does not hold is a KeyError."""
        self._check_held((key,))
        return self._demote_when_room(key)

    def _demote_when_room(self, key: Hashable) -> Future:
        """``demote`` without the check: a block deleted since its caller looked does nothing."""
        return self._move_when_room(key, lambda: self._demote_plan(key))

    @_starts_work
    def demote_many(self, keys: Iterable[Hashable], missing_ok: bool = False) -> list:
        """``demote`` for many blocks: one future per key, in order. The moves that have
        room below start together (on CPU, host<->device copies in chunks: see
        ``_submit_all``); the rest go one by one as ``demote``, waiting for room. A key
        given twice moves one tier, once; both places get that move's future. All or none: a
        key the store does not hold is a KeyError, and nothing moves (``missing_ok``: such
        keys are skipped, for a caller whose keys another thread may delete meanwhile)."""
        given = _key_list(keys, "demote_many")
        if not missing_ok:
            self._check_held(given)
        keys = list(dict.fromkeys(given))
        futures: list = [_done()] * len(keys)  # in the order of keys
        with self._lock:
            moves, placed, later = self._plan_demotions(keys)
            for i, move in zip(placed, moves):
                futures[i] = self._future(move)
        self._submit_all(moves, Priority.WRITEBACK)
        for i in later:
            futures[i] = self._demote_when_room(keys[i])
        of = dict(zip(keys, futures))
        return [of[key] for key in given]

    @_starts_work
    def demote_now(self, keys: Iterable[Hashable]) -> list:
        """``demote_many``, waited for: every block of ``keys`` moves one tier down (once, if
        given twice), and this returns when all moves are done, with the errors of those that
        failed (each rolled back; nothing is lost). No future per block: the caller waits for
        the batch and helps copy it, as ``ensure_device`` does for fetches and the store's
        own evictions do. On CPU a future per block cost ~0.5 ms per round of 43 blocks of
        1.5 MiB, 10% of the copy (``bench io``'s device->host rounds, which use this). A
        block with no room below waits for room as ``demote`` does, and raises
        ``TierIOError`` as it does when the storage cannot give any. A key the store does not
        hold is a KeyError, and nothing moves."""
        keys = list(dict.fromkeys(_key_list(keys, "demote_now")))
        self._check_held(keys)
        with self._lock:
            moves, _, later = self._plan_demotions(keys)
        mine: list = []
        futures = self._submit_all(moves, Priority.WRITEBACK, mine)
        self._help(mine)
        errors = wait_all(futures) + self._wait_works(mine)
        errors.extend(wait_all([self._demote_when_room(keys[i]) for i in later]))
        for exc in errors:
            if not isinstance(exc, Exception):  # Ctrl-C on a thread that helped copy
                raise exc
        return errors

    def _plan_demotions(self, keys: list) -> tuple:
        """Under the lock: prepare the demotions of ``keys`` that have room below, in source
        order (``_in_source_order``). Returns (moves, the index in ``keys`` of each move's
        key, the indices of keys that must wait for room); keys with nothing to demote are
        in neither."""
        batches: dict = {}  # dst -> ([(key, src)], [index in keys]), prepared together
        free: dict = {}  # dst -> slots left (a drop below may free more: those keys wait)
        later: list = []
        get, below, device = self.table.get, self._below, Tier.DEVICE
        for key, src, i in self._in_source_order(keys):
            # ``_demote_plan`` inline for the usual block (one lookup, no calls); a block
            # that has a copy below already goes through it (its copy here is dropped)
            dst = below.get(src)
            if dst is None:
                continue
            entry = get(key)
            c = entry.copies[src]  # READY: its best copy
            if c.readers or (src is device and entry.pins):  # not ``is_movable``
                continue
            if dst in entry.copies:
                self._demote_plan(key, src)
                continue
            left = free[dst] if dst in free else self.table.num_free(dst)
            if left >= 1:
                batch = batches.get(dst)
                if batch is None:
                    batch = batches[dst] = ([], [])
                batch[0].append((key, src))
                batch[1].append(i)
                left -= 1
            else:
                later.append(i)
            free[dst] = left
        moves: list = []
        placed: list = []
        try:
            for dst, (planned, where) in batches.items():
                moves.extend(self._prepare_all(planned, dst, drop_source=True))
                placed.extend(where)
        except BaseException:  # nothing started yet: the moves prepared go back
            self._abandon(moves)
            raise
        return moves, placed, later

    def _in_source_order(self, keys: list, best_copies: Optional[list] = None) -> list:
        """Under the lock: [(key, its best source tier, its index in ``keys``)], sorted by
        the slot of each key's best copy; keys with no READY copy are left out. Planned in
        that order, moves get destination slots (lowest free first) that line up with their
        sources, adjacent on both sides: one copy for a run (``_slot_runs``), in disk order
        for reads. (One lookup per key: a batch's planning is a share of its moves' cost.)
        ``best_copies``: each key's ``best_copy``, if the caller has just looked them up."""
        best = self.table.best_copy
        planned = []
        for i, key in enumerate(keys):
            found = best(key) if best_copies is None else best_copies[i]
            if found is not None:
                planned.append((found[0], found[1].slot, i, key))
        planned.sort()  # no ties: the indices differ
        return [(key, tier, i) for tier, _, i, key in planned]

    def _demote_plan(self, key: Hashable, src: Optional[Tier] = None) -> Optional[tuple]:
        """Under the lock: (src, dst, drop_source, priority) of demoting ``key`` from ``src``
        (default: its best source), or None."""
        if src is None:
            src = self.table.best_source(key)
        lower = self._lower(src) if src is not None else None
        if lower is None or not self.table.is_movable(key, src):
            return None
        if self.table.copy(key, lower) is not None:  # already below: just drop this copy
            if self.table.can_drop(key, src):
                self._drop(key, src, evicted=False)
            return None
        return src, lower, True, Priority.WRITEBACK

    def _move_when_room(self, key: Hashable, plan) -> Future:
        """Under the lock ``plan()`` returns (src, dst, drop_source, priority) or None; make
        room on dst (waiting for evictions outside the lock, where completions can run) and
        start the move. A move with nowhere to go is a no-op."""
        while True:
            with self._lock:
                decided = plan()
                if decided is None:
                    return _done()
                src, dst, drop_source, priority = decided
                moves = self._room(dst, 1, {key}, allow_writeback=True)
                move = None
                if self.table.num_free(dst) >= 1:
                    move = self._prepare(key, src, dst, drop_source=drop_source)
                elif not moves:
                    return _done()
            if move is not None:
                try:
                    self._submit_all(moves, Priority.WRITEBACK)
                except BaseException:  # interrupted or closing: the prepared move goes back
                    with self._lock:
                        self._abandon([move])
                    raise
                return self._submit(move, priority)
            self._wait_moves(moves, raise_io=True)

    # ---- the decode path -----------------------------------------------------------------
    @_starts_work
    def new_blocks(self, keys: list, protect: Iterable[Hashable] = (), near: Optional[int] = None) -> list:
        """Allocate device slots for new blocks; they come back READY and pinned.

        ``near``: the slot to try for the first key; each later key tries the slot after the
        previous one. Blocks that attention reads together in adjacent slots are read in
        place, without a gather copy (``read_layer``).
        """
        keys = _key_list(keys, "new_blocks")
        seen: set = set()
        for key in keys:
            if key in seen:
                raise ValueError(f"new_blocks: block {key!r} is named twice")
            seen.add(key)
        protect = set(protect) | seen
        stall = 0.0
        since: list = []  # see _wait_out_readers
        while True:
            with self._lock:
                stored = next((k for k in keys if self.table.get(k) is not None), None)
                if stored is not None:  # checked again after each wait: another thread may have put it
                    raise ValueError(f"new_blocks: block {stored!r} is already stored; delete it first")
                moves = self._room(Tier.DEVICE, len(keys), protect, allow_writeback=True)
                if self.table.num_free(Tier.DEVICE) < len(keys) and not moves:
                    if self._wait_out_readers(Tier.DEVICE, protect, since, len(keys), len(keys), len(keys)):
                        continue
                    raise CapacityError(self._full_message(len(keys), Tier.DEVICE, protect))
                if self.table.num_free(Tier.DEVICE) >= len(keys) and not moves:
                    slots = []
                    prefer = near
                    for key in keys:
                        slot = self.table.allocate(key, Tier.DEVICE, prefer)
                        slots.append(slot)
                        prefer = None if near is None else slot + 1
                        self.table.commit(self.table.get(key), Tier.DEVICE)
                        self.table.pin(key)
                        self.policies[Tier.DEVICE].insert(key)
                        self._tokens[key] = 0
                        self._lost.pop(key, None)  # a new block under this key
                    self._stalled(stall)
                    return slots
            stall += self._wait_moves(moves, raise_io=True)

    @_starts_work
    def ensure_device(self, keys: list, pin: bool = True, ahead: Sequence[Hashable] = (),
                      _into: Optional[list] = None, _once: bool = False) -> float:
        """Make every block of ``keys`` READY on the device and pin it; returns seconds waited.

        ``ahead``: blocks to prefetch to the device once the fetches of ``keys`` are queued
        (behind them), before waiting for those: the next layer's reads then follow this
        layer's without a gap.

        ``_into`` (the package's own callers): an empty list that gets the entries pinned, for
        ``_unpin_entries`` to undo exactly these pins. By key, ``unpin`` took the pin of another
        thread that had deleted a key, stored it anew and pinned it meanwhile (a review).
        ``_once=True`` (a layer's tail block, brought up to be written): its hit and prefetch
        outcome are counted here, on the tier it was found on, and the next read of the
        layer (``ensure_device``, ``_hold_in_memory``) does not count them again. It was
        counted twice, one hit a layer for nearly every decode step; then, counted by the
        read alone, as a device hit where it had come up from the host or the disk (two
        reviews)."""
        keys = list(dict.fromkeys(_key_list(keys, "ensure_device")))  # once each: a key given twice is pinned once
        protect = set(keys)
        # entries: a key deleted and stored anew meanwhile names a block not pinned here
        pinned: list = [] if _into is None else _into
        pinned_keys: set = set()  # their keys, for lookups (a batch may hold hundreds of keys)
        first = True  # the first pass over keys: hits and prefetch outcomes are counted in it
        once = self._counted_once  # keys a tail's ensure_device(_once=True) counted already
        if once and not _once:
            self._counted_once = set()
        stall = 0.0
        io_failures = 0
        get, device, ready = self.table.get, Tier.DEVICE, CopyState.READY
        since: list = []  # see _wait_out_readers
        try:
            while True:
                submit: list = []
                waits: list = []
                with self._lock:
                    missing = []
                    fresh = []  # READY on the device, not pinned by this call yet
                    hits = [0, 0, 0]  # blocks found first on each tier (one event each)
                    try:
                        for key in keys:
                            entry = get(key)
                            if entry is None:
                                raise self._unknown(key)
                            copies = entry.copies
                            c = copies.get(device)
                            count = first and not (once and not _once and key in once)
                            if c is not None and c.state is ready:
                                if key not in pinned_keys:
                                    fresh.append(key)
                                if count:
                                    hits[0] += 1
                                    if self._prefetched and self._prefetched.pop(key, None) is not None:
                                        self.events.prefetch("used")
                            elif c is not None:  # FILLING: a prefetch is on its way
                                waits.append(self._future(self._to_device[key]))
                                if count and self._prefetched and self._prefetched.pop(key, None) is not None:
                                    self.events.prefetch("late")
                                    hits[0] += 1
                            else:
                                # ``best_copy``: the fastest READY copy below (no device copy)
                                found = None
                                for tier in _BELOW_DEVICE:
                                    c = copies.get(tier)
                                    if c is not None and c.state is ready:
                                        found = tier, c
                                        break
                                else:
                                    waits.extend(self._inflight_for(key))
                                    continue
                                if count:
                                    hits[found[0]] += 1
                                missing.append((key, found))
                    finally:  # counted even if a later key is unknown, as prefetch outcomes are
                        for tier, n in zip(_TIER_LABELS, hits):
                            self.events.hit(tier, n)
                    if first and _once:
                        self._counted_once = set(keys)
                    first = False
                    self.policies[device].touch_many(fresh)  # a read is a use
                    if pin or missing or waits:
                        # Pinned while the rest comes (or for the caller). Not in the last
                        # pass of ``pin=False``: those pins would go again at once.
                        for key in fresh:
                            self.table.pin(key)
                            pinned.append(get(key))
                            pinned_keys.add(key)
                    if missing:
                        try:
                            # Sources looked up again after an eviction, which may drop a copy
                            # (a clean host copy, to make room below for a dirty victim).
                            evicting = self.table.num_free(Tier.DEVICE) < len(missing)
                            submit.extend(self._room(Tier.DEVICE, len(missing), protect, allow_writeback=True))
                            planned = self._in_source_order([key for key, _ in missing],
                                                            None if evicting else [found for _, found in missing])
                            submit.extend(self._prepare_all([(key, src) for key, src, _ in
                                                             planned[:self.table.num_free(Tier.DEVICE)]],
                                                            Tier.DEVICE, drop_source=False))
                        except BaseException:
                            self._abandon(submit)
                            raise
                    if not missing and not waits:
                        break
                    if not submit and not waits:  # nothing to fetch into, nothing to wait for
                        if self._wait_out_readers(Tier.DEVICE, protect, since, total=len(keys)):
                            continue
                        raise CapacityError(self._resident_message(len(keys), len(missing), protect))
                mine: list = []
                futures = self._submit_all(submit, Priority.DEMAND, mine) + waits
                ahead = self._prefetch_ahead(ahead, protect, Tier.DEVICE, mine)
                t0 = time.perf_counter()
                self._help(mine)
                errors = wait_all(futures) + self._wait_works(mine)
                stall += time.perf_counter() - t0
                for exc in errors:
                    if isinstance(exc, BlockCorruptedError):
                        with self._lock:
                            lost = [k for k in keys if self.table.get(k) is None]
                        if lost:
                            raise exc
                    elif not isinstance(exc, (OSError, RecordError)):
                        raise exc
                io_failures = self._count_io(errors, io_failures)
            self._prefetch_ahead(ahead, protect, Tier.DEVICE)
        except BaseException:
            self._unpin_entries(pinned)
            raise
        if not pin:
            self._unpin_entries(pinned)
        self._stalled(stall)
        return stall

    def _unpin_entries(self, entries: list) -> None:
        """Undo the pins ``ensure_device`` listed in ``entries`` (``_into``), once: the list is
        emptied."""
        with self._lock:
            self.table.unpin_entries(entries)

    def _prefetch_ahead(self, ahead: Sequence[Hashable], protect: set, dst: Tier, mine: Sequence = ()) -> tuple:
        """Start prefetching ``ahead`` (once: returns the empty tuple to carry on with).
        ``mine``: a batch just queued for this thread to help copy (``_submit_all``); if the
        prefetch raises, it goes to a worker instead of waiting for a thread that will not come."""
        try:
            if ahead:
                self.prefetch(list(ahead), protect=protect, dst=dst)
        except BaseException:
            for work in mine:
                self._hand_on(work)
            raise
        return ()

    @_starts_work
    def prefetch(self, keys: list, protect: Iterable[Hashable] = (), dst: Tier = Tier.DEVICE) -> int:
        """Start bringing ``keys`` up to ``dst`` without waiting; only clean copies are evicted."""
        dst = as_tier(dst, "prefetch")
        keys = list(dict.fromkeys(_key_list(keys, "prefetch")))  # a key asked for twice is fetched once
        if dst not in self.tiers:
            return 0
        protect = set(protect) | set(keys)
        submit = []
        with self._lock:
            wanted = []
            for key in keys:
                entry = self.table.get(key)
                if entry is None or any(t <= dst for t in entry.copies):
                    continue
                if self.table.best_source(key, below=dst) is not None:
                    wanted.append(key)
            if not wanted:
                return 0
            try:
                self._room(dst, len(wanted), protect, allow_writeback=False)
                planned = [(key, src) for key in wanted[:self.table.num_free(dst)]
                           if (src := self.table.best_source(key, below=dst)) is not None]
                submit.extend(self._prepare_all(planned, dst, drop_source=False))
                for key, _ in planned:
                    self._prefetched[key] = dst
            except BaseException:
                self._abandon(submit)
                raise
        self._submit_all(submit, Priority.PREFETCH)
        return len(submit)

    @property
    def attention_tier(self) -> Tier:
        """Where attention reads blocks from: the device, or on CPU the device or the host."""
        return Tier.HOST if self._reads_both else Tier.DEVICE

    @property
    def streams_disk_reads(self) -> bool:
        """Whether ``read_layer(hold=True)`` reads disk blocks straight into attention's
        buffers, a layer read ahead into a buffer of its own (``DiskStreams``: a CPU store
        with host and disk tiers)."""
        return self._streams is not None

    @_starts_work
    def read_layer(self, keys: list, num_tokens: int, start_token: int = 0, hold: bool = False,
                   ahead: Sequence[Hashable] = ()) -> tuple:
        """K and V of ``keys`` in order as [B, H, num_tokens, D], for attention.

        On CUDA every block is made resident on the device and gathered there. On CPU the
        device and host tiers are the same memory, so blocks are gathered from whichever of
        the two holds them (disk blocks are first read up to the host): a promotion copy
        would only repeat the gather's own copy.

        With ``hold`` (one layer read at a time, as attention reads them), blocks that sit
        on the device in adjacent slots, in order, are not copied: K and V are views of the
        device pool, and their copies stay held (never freed, evicted or demoted) until
        ``release_views``; other reads land in a buffer the store reuses. Either way the
        result is valid until ``release_views`` or the next ``read_layer(hold=True)``
        (which lets the previous one go). The caller must let go before it writes to those
        blocks again (``begin_write`` does).

        ``ahead`` (the prefetch policy's plan, e.g. the next layer's blocks) is prefetched to
        the attention tier as soon as the fetches of ``keys`` are queued, before waiting for
        them: the transfer queue then never runs dry between two layers.
        """
        if start_token < 0 or num_tokens < 0 or start_token + num_tokens > len(keys) * self.geometry.block_tokens:
            raise ValueError(f"read_layer: tokens {start_token} .. {start_token + num_tokens} are not within the "
                             f"{len(keys)} blocks of {self.geometry.block_tokens} tokens given")
        if hold:
            self.release_views()
            if self._streams is not None:
                return self._streams.read(keys, num_tokens, start_token, ahead)
        if not self._reads_both:
            pins: list = []
            self.ensure_device(keys, ahead=ahead, _into=pins)
            # The gather holds a reader on each copy, as views do: a delete on another thread
            # drops pins, and the slot, freed, could take another block's bytes mid-gather.
            gathering: list = []
            try:
                with self._lock:
                    copies = [self.table.copy(k, Tier.DEVICE) for k in keys]
                    slots = [c.slot for c in copies]
                    held = self._views if hold and DevicePool.consecutive(slots) else gathering
                    for key, copy in zip(keys, copies):
                        copy.readers, held[_END:] = copy.readers + 1, [(self.table.get(key), copy)]  # no call between
                    if held is self._views:
                        self.read_stats["views"] += 1
                        return self.device_pool.view(slots[0], len(slots), num_tokens, start_token)
                t0 = time.perf_counter()
                out = self.device_pool.gather(slots, num_tokens, start_token)
                self._count_gather(len(slots) * self.geometry.block_bytes, t0)
                self.note_compute()  # later copies into these slots wait for the gather
                return out
            finally:
                if gathering:
                    _uninterrupted(lambda: self._let_go(gathering))
                self._unpin_entries(pins)
        # A held read takes its readers straight into the views' list (empty now): whatever
        # point a Ctrl-C lands at, what it took is listed there, and the next release_views
        # lets each go once. (Taken into a list of its own and handed over, a copy was let
        # go twice, or kept for good, by an interrupt around the hand-over: a review.)
        held: list = self._views if hold else []
        try:  # _read_held lets go of what it gathered; once let go, letting go again is a no-op
            self._hold_in_memory(keys, ahead, into=held)
            return self._read_held(held, num_tokens, start_token, hold)
        except BaseException:
            _uninterrupted(lambda: self._let_go(held))
            raise

    def _views_of(self, held: list) -> Optional[int]:
        """CPU: if the held copies ([(entry, copy)]) all lie on the device in adjacent slots,
        in order, the first slot (views of the device pool can be read; the copies stay
        held until ``release_views``); else None."""
        if not held or not all(c is e.copies.get(Tier.DEVICE) for e, c in held) \
                or not DevicePool.consecutive([c.slot for _, c in held]):
            return None
        self.read_stats["views"] += 1
        return held[0][1].slot

    @_starts_work
    def hold_resident(self, write_key: Hashable, keys: list, ahead: Sequence[Hashable] = (),
                      pinned: Optional[list] = None) -> Optional[int]:
        """The decode step's fast path when nothing has to move or wait: in one pass under
        the lock, what ``ensure_device([write_key])``, ``begin_write(write_key)`` and
        ``read_layer(keys, hold=True, ahead=ahead)`` would do, then returns the device slot
        of ``keys[0]`` (the caller reads the views itself). ``write_key`` stays pinned;
        ``pinned``, a list of the caller's, gets it in the statement that pins it.

        Taken only if ``read_layer`` would read the device tier (not a CPU store with a host
        tier: ``hold_mixed``), every block of ``keys`` is READY on the device in adjacent
        slots, in order, ``write_key`` is READY there with no move in flight, and every block
        of ``ahead`` has a device copy (its prefetch would start nothing). Otherwise returns
        None and changes nothing: the caller takes the general path.
        """
        if not keys or self._reads_both:
            return None
        held = self._hold_step(write_key, keys, ahead, (Tier.DEVICE,), pinned)
        if held is None:
            return None
        self.read_stats["views"] += 1
        return held[1][0][1].slot

    @_starts_work
    def hold_mixed(self, write_key: Hashable, keys: list, ahead: Sequence[Hashable] = (),
                   pinned: Optional[list] = None) -> Optional[int]:
        """``hold_resident`` for a CPU store with a host tier, where ``read_layer`` reads
        blocks on the device and on the host where they lie: in one pass under the lock,
        what ``ensure_device([write_key])``, ``begin_write(write_key)`` and the holding part
        of ``read_layer(keys, hold=True, ahead=ahead)`` would do; returns the device slot of
        ``write_key`` (which stays pinned, and goes into ``pinned`` as ``hold_resident``
        says), for the caller to write its new tokens into before ``read_held`` reads the
        blocks. In the host set-up of ``bench decode`` at 8k this took the books of
        ``update`` from about 10.5 to 8 ms a token, of a ~155 ms step (2026-12-06,
        docs/measurements.md).

        Taken only if the store has no disk tier (with one, ``read_layer`` reads through
        ``DiskStreams``, and so does the general path), every block of ``keys`` is READY on the device or the host (the device
        copy read where both are), ``write_key`` is READY on the device with no move in
        flight, and every block of ``ahead`` has a device or host copy (its prefetch to the
        host would start nothing). Otherwise returns None and changes nothing.
        """
        if not keys or not self._reads_both or self._streams is not None:
            return None
        held = self._hold_step(write_key, keys, ahead, (Tier.DEVICE, Tier.HOST), pinned)
        return None if held is None else held[0]

    def _hold_step(self, write_key: Hashable, keys: list, ahead: Sequence[Hashable], tiers: tuple,
                   pinned: Optional[list]) -> Optional[tuple]:
        """``hold_resident`` and ``hold_mixed``: each of ``keys`` read from the first of
        ``tiers`` where it is READY (device only: in adjacent slots, in order), its reader
        taken into the views' list; ``write_key`` pinned, its lower copies dropped. Returns
        (``write_key``'s device slot, the held copies), or None having changed nothing."""
        self.release_views()
        device, ready, filling = Tier.DEVICE, CopyState.READY, CopyState.FILLING
        adjacent = tiers == (device,)
        with self._lock:
            get = self.table.get
            w = get(write_key)
            if w is None:
                return None
            copies = w.copies
            for c in copies.values():  # entry.in_flight(): begin_write would wait
                if c.state is filling or c.readers:
                    return None
            c = copies.get(device)
            if c is None or c.state is not ready:
                return None
            held, where = [], []
            slot = None
            for key in keys:
                entry = get(key)
                if entry is None:
                    return None
                for tier in tiers:
                    c = entry.copies.get(tier)
                    if c is not None and c.state is ready:
                        break
                else:
                    return None
                if adjacent:
                    if slot is not None and c.slot != slot + 1:
                        return None
                    slot = c.slot
                held.append((entry, c))
                where.append(tier)
            for key in ahead:
                entry = get(key)
                if entry is not None and not any(t in entry.copies for t in tiers):
                    return None
            # ensure_device([write_key]), then begin_write(write_key): lower copies are stale.
            # Freeing one can raise (a disk tombstone's write), so it comes before anything
            # is taken; the pin comes last, into the caller's list with it.
            write_slot = copies[device].slot
            if len(copies) > 1:
                failed: list = []
                for tier, s in self.table.drop_others(write_key, device):
                    self._released(write_key, tier, s, errors=failed)
                if failed:
                    raise failed[0]
            # read_layer(keys, hold=True): each reader is taken into the views' list in one
            # statement with no call in it, so that a Ctrl-C anywhere leaves every reader
            # taken where the next release_views lets it go (as _hold_in_memory does)
            views = self._views
            first = len(views)
            for pair in held:
                pair[1].readers, views[_END:] = pair[1].readers + 1, [pair]
            policies, prefetched = self.policies, self._prefetched
            policies[device].touch(write_key)
            used = 0
            if prefetched and prefetched.pop(write_key, None) is not None:
                used += 1
            # write_key's hit, as ensure_device counts it, unless the read holds it too (it
            # always does in a decode step: counted twice, a review)
            hits = {} if write_key in keys else {device: 1}
            self._counted_once = set()  # (nothing an earlier update's tail left is counted here)
            for key, tier in zip(keys, where):
                policies[tier].touch(key)
                hits[tier] = hits.get(tier, 0) + 1
                if prefetched and prefetched.pop(key, None) is not None:
                    used += 1
            for tier, n in hits.items():
                self.events.hit(tier.label, n)
            if used:
                self.events.prefetch("used", used)
            self.table.pin_listed(w, [] if pinned is None else pinned, write_key)
            return write_slot, views[first:]

    @_ends_work
    def read_held(self, num_tokens: int, start_token: int = 0) -> tuple:
        """After ``hold_mixed``: K and V of the blocks it holds, as ``read_layer(hold=True)``
        returns them (views of the device pool where they lie there in adjacent slots, held
        until ``release_views``; else gathered into the reused buffer and let go). Tokens
        past the blocks held (none, if something let them go meanwhile) are a ValueError,
        and the blocks are let go. It starts no work: a plug-in policy's failure in
        ``hold_mixed`` is raised by the next call that does, as it is for views."""
        held = self._views
        if start_token < 0 or num_tokens < 0 or start_token + num_tokens > len(held) * self.geometry.block_tokens:
            _uninterrupted(lambda: self._let_go(held))
            raise ValueError(f"read_held: tokens {start_token} .. {start_token + num_tokens} are not within the "
                             f"{len(held)} blocks of {self.geometry.block_tokens} tokens held")
        return self._read_held(held, num_tokens, start_token, hold=True)

    def _read_held(self, held: list, num_tokens: int, start_token: int, hold: bool) -> tuple:
        """CPU with a host tier: K and V of the held copies ([(entry, copy)], readers taken).
        With ``hold`` (``held`` is the views' list): views if they allow, kept held; otherwise
        (or gathered) the readers are let go."""
        try:
            first = self._views_of(held) if hold else None
            if first is not None:
                return self.device_pool.view(first, len(held), num_tokens, start_token)
            t0 = time.perf_counter()
            out = self._gather_mixed(held, num_tokens, start_token, reuse=hold)
            self._count_gather(num_tokens * (self.geometry.block_bytes // self.geometry.block_tokens), t0)
        except BaseException:
            _uninterrupted(lambda: self._let_go(held))
            raise
        _uninterrupted(lambda: self._let_go(held))  # gathered: nothing to keep
        return out

    def _count_gather(self, num_bytes: int, t0: float) -> None:
        """One gather that copied ``num_bytes`` and started at ``t0`` (on CUDA the copy is
        queued, not finished: the seconds are those of queueing it)."""
        stats = self.read_stats
        stats["gathers"] += 1
        stats["gathered_bytes"] += num_bytes
        stats["gather_seconds"] += time.perf_counter() - t0

    @_starts_work
    def read_segments(self, keys: list, num_tokens: int, start_token: int = 0,
                      ahead: Sequence[Hashable] = ()) -> list:
        """CPU: K and V of ``keys`` where they lie, as ``[(k, v)]`` views ([B, H, t, D] each)
        of the device and host pools, in order, no copy: one per run of adjacent device
        slots and one per host block; the ``t`` sum to ``num_tokens``, from ``start_token``
        of the first block. Disk blocks are read into a buffer (``DiskStreams``: one view per
        run of them there). Held like ``read_layer(hold=True)``: valid until
        ``release_views`` or the next held read."""
        if not self._reads_both:
            raise RuntimeError("read_segments: only for a CPU store with a host tier")
        self.release_views()
        if self._streams is not None:
            return self._streams.read(keys, num_tokens, start_token, ahead, segments=True)
        # held in the views' list (see read_layer): read below, let go by release_views
        held = self._hold_in_memory(keys, ahead, into=self._views)[:]
        runs = [(Tier.DEVICE if on_device else Tier.HOST, slot, count) for on_device, slot, count, _ in _runs(held)]
        return self._segment_views(runs, num_tokens, start_token)

    def _segment_views(self, runs: list, num_tokens: int, start_token: int, buf: Optional[tuple] = None) -> list:
        """[(k, v)] views ([B, H, t, D]) of ``runs`` — (Tier.DEVICE, first slot, count) for
        adjacent device slots, (Tier.HOST, slot, 1) for a host block, (None, first position,
        count) for blocks in ``buf`` (K, V, [rows, capacity, T*D]) — covering ``num_tokens``
        from ``start_token`` of the first block."""
        g = self.geometry
        segments = []
        skip, left = start_token, num_tokens
        for tier, at, count in runs:
            if left <= 0:
                break
            t = min(left, count * g.block_tokens - skip)
            if tier is Tier.DEVICE:
                k, v = self.device_pool.view(at, count, t, skip)
            elif tier is Tier.HOST:
                block = self.host_pool.view(at)
                k, v = block[0][:, :, skip:skip + t], block[1][:, :, skip:skip + t]
            else:
                shape = (g.batch, g.kv_heads, count * g.block_tokens, g.head_dim)
                k, v = (x[:, at:at + count].view(shape)[:, :, skip:skip + t] for x in buf)
            segments.append((k, v))
            left -= t
            skip = 0
        return segments

    def _let_go(self, held: list) -> None:
        """Drop the readers ``held`` took ([(entry, copy)]), emptying ``held``; free what was
        deleted meanwhile. Each copy is taken off the list in the statement after its reader
        is dropped, with no call between (where a signal's exception could land): run again
        after a Ctrl-C, it goes on where it stopped, and no copy is let go twice."""
        with self._lock:
            while held:
                entry, copy = held[-1]
                copy.readers, held[-1:] = copy.readers - 1, []  # one statement, no call in it
                if entry.deleted:  # a failed tombstone is held and logged (``_released``)
                    for t, slot in self.table._collect(entry):
                        self._released(entry.key, t, slot, errors=[])

    def release_views(self) -> None:
        """Attention is done with the views ``read_layer(hold=True)`` returned: let their
        blocks go (they may be written, moved or freed again)."""
        if self._views:  # emptied as they go: after a Ctrl-C the rest are still listed here
            _uninterrupted(lambda: self._let_go(self._views))

    def _hold_in_memory(self, keys: list, ahead: Sequence[Hashable] = (), into: Optional[list] = None) -> list:
        """CPU path: wait until every key has a READY device or host copy; hold each such
        copy with a reader so nothing frees it. Returns [(entry, copy)] in key order.
        ``ahead`` is prefetched to the host once the reads of ``keys`` are queued. ``into``:
        a list of the caller's (empty) that is filled as the readers are taken, so that the
        caller's cleanup lets them go whatever point a Ctrl-C lands at (even as this returns);
        an interrupt inside lets go of what it took."""
        counted: set = set()
        if self._counted_once:  # a tail block counted as it came up to be written (ensure_device)
            counted, self._counted_once = self._counted_once, set()
        stall = 0.0
        io_failures = 0
        since: list = []  # see _wait_out_readers
        while True:
            submit, waits, missing = [], [], []
            with self._lock:
                for key in keys:
                    entry = self.table.get(key)
                    if entry is None:
                        raise self._unknown(key)
                    tier = next((t for t in (Tier.DEVICE, Tier.HOST) if self.table.is_ready(key, t)), None)
                    first = key not in counted
                    counted.add(key)
                    if tier is not None:
                        if first:
                            self.events.hit(tier.label)
                            if self._prefetched.pop(key, None) is not None:
                                self.events.prefetch("used")
                        continue
                    filling = [t for t in (Tier.DEVICE, Tier.HOST) if t in entry.copies]
                    if filling:
                        waits.extend(self._inflight_for(key))
                        if first:
                            self.events.hit("host")
                            if self._prefetched.pop(key, None) is not None:
                                self.events.prefetch("late")
                        continue
                    if first:
                        self.events.hit(Tier.DISK.label)
                    missing.append(key)
                if missing:
                    # Disk blocks come up to the host; what the host cannot take goes to the device.
                    try:
                        protect = set(keys)
                        submit.extend(self._room(Tier.HOST, len(missing), protect, allow_writeback=False))
                        planned = self._in_source_order(missing)
                        to_host = min(len(planned), self.table.num_free(Tier.HOST))
                        submit.extend(self._prepare_all([(key, src) for key, src, _ in planned[:to_host]],
                                                        Tier.HOST, False))
                        rest = planned[to_host:]
                        if rest:
                            submit.extend(self._room(Tier.DEVICE, len(rest), protect, allow_writeback=True))
                            submit.extend(self._prepare_all([(key, src) for key, src, _ in
                                                             rest[:self.table.num_free(Tier.DEVICE)]],
                                                            Tier.DEVICE, False))
                    except BaseException:
                        self._abandon(submit)
                        raise
                if not missing and not waits:
                    held = into if into is not None else []
                    try:
                        for key in keys:
                            entry = self.table.get(key)
                            tier = Tier.DEVICE if self.table.is_ready(key, Tier.DEVICE) else Tier.HOST
                            copy = entry.copies[tier]
                            copy.readers, held[_END:] = copy.readers + 1, [(entry, copy)]  # no call between
                            self.policies[tier].touch(key)  # a read where it lies is a use all the same
                    except BaseException:
                        _uninterrupted(lambda: self._let_go(held))
                        raise
                    break
                if not submit and not waits:
                    if self._wait_out_readers(Tier.HOST, set(keys), since):
                        continue
                    raise CapacityError(f"the host tier holds {self.table.num_slots(Tier.HOST)} blocks but this "
                                        f"step reads {len(keys)} and the rest are busy; raise host_budget")
            mine: list = []
            futures = self._submit_all(submit, Priority.DEMAND, mine) + waits
            ahead = self._prefetch_ahead(ahead, set(keys), Tier.HOST, mine)
            t0 = time.perf_counter()
            self._help(mine)
            errors = wait_all(futures) + self._wait_works(mine)
            stall += time.perf_counter() - t0
            for exc in errors:
                if isinstance(exc, BlockCorruptedError):
                    raise exc
                if not isinstance(exc, (OSError, RecordError)):
                    raise exc
            io_failures = self._count_io(errors, io_failures)
        try:
            self._prefetch_ahead(ahead, set(keys), Tier.HOST)
            self._stalled(stall)
        except BaseException:
            _uninterrupted(lambda: self._let_go(held))
            raise
        return held

    _IO_RETRIES = 3

    def _count_io(self, errors: list, failures: int) -> int:
        """Consecutive wait rounds with OS errors; past ``_IO_RETRIES`` raise ``TierIOError``."""
        io = [e for e in errors if isinstance(e, OSError)]
        if not io:
            return 0
        if failures + 1 >= self._IO_RETRIES:
            raise self._io_error("reading blocks for attention", io[0])
        return failures + 1

    def _gather_mixed(self, held: list, num_tokens: int, start_token: int, reuse: bool = False,
                      into: Optional[tuple] = None, at: Optional[list] = None) -> tuple:
        """CPU: copy the held blocks ([(entry, copy)], device or host) into one K and one V.

        ``reuse``: into the store's one gather buffer (the result is valid until the next
        such read: ``read_layer(hold=True)`` results live until ``release_views``), which
        saves a fresh allocation, and its page faults, per layer and step. ``into``: into
        these K and V ([rows, blocks, T*D]), each held block at its position in ``at``
        (increasing), the others left as they are (``DiskStreams`` read them there);
        ``start_token`` then counts from the buffer's first block.

        One copy per run of blocks whose slots on one tier go up by one step (``_runs``),
        of the tokens read only (a partly read first or last block is copied alone). While
        moves to or from the device are in flight (``_copying``: each is a memcpy that holds
        a core while it runs) they are numpy copies of bytes (a plain single-threaded memcpy):
        torch's ``copy_`` of a block this size starts an OpenMP parallel region, which cost
        ~8 ms per copy instead of ~0.1 ms on a 2-core machine whenever an I/O thread held the
        other core. Otherwise they are torch copies, which use every core: ~20% faster per
        gather on 2 cores. Moves between the host and the disk do not count: their threads
        wait in the kernel for the disk most of the time (the payload goes straight between
        the host slot and the file), and the disk set-up of bench decode ran at 5.3-6.1 tok/s
        alone with torch copies against 4.0-6.0 with numpy ones while disk reads were in
        flight (docs/measurements.md, 2026-12-05).
        """
        g = self.geometry
        rows, width, n = g.batch * g.kv_heads, g.block_tokens * g.head_dim, len(held)
        if into is not None:
            out_k, out_v = into
        elif reuse:
            if self._gather_buf is None or self._gather_buf[0].shape[1] < n:
                with torch.inference_mode(False):
                    buf = torch.empty(2, rows, n + n // 4 + 1, width, dtype=g.dtype, device=self.device)
                self._gather_buf = (buf[0], buf[1])
            out_k, out_v = (t[:, :n] for t in self._gather_buf)
        else:
            out_k = torch.empty(rows, n, width, dtype=g.dtype, device=self.device)
            out_v = torch.empty_like(out_k)
        if self._copying:
            outs = (out_k.view(torch.uint8).numpy(), out_v.view(torch.uint8).numpy())
            dev_k, dev_v, host_k, host_v = self._byte_pools()
            copy = np.copyto
        else:
            outs = (out_k, out_v)
            dev_k, dev_v, (host_k, host_v) = self.device_pool.k, self.device_pool.v, self.host_pool.kv_rows()
            copy = torch.Tensor.copy_
        unit = g.head_dim if copy is torch.Tensor.copy_ else g.head_dim * g.itemsize  # one token of a row
        runs = []
        for i, segment in _segments(held, at):
            for on_device, slot, count, step in _runs(segment, strided=True):
                runs.append((i, on_device, slot, count, step))
                i += count
        # Last block first: attention reads from the first token on, and a layer's K and V
        # are about half of this machine's L3, so the blocks written last are the ones still
        # cached when it starts (SDPA ran ~5 ms per step faster in the host set-up).
        for i, on_device, slot, count, step in reversed(runs):
            # only the tokens attention reads: the tail block is mostly unwritten while decoding
            lo = max(start_token - i * g.block_tokens, 0)
            hi = min(start_token + num_tokens - i * g.block_tokens, count * g.block_tokens)
            # a run of one tier's slots ``step`` apart: one strided copy (plus partial end blocks)
            pool_k, pool_v = (dev_k, dev_v) if on_device else (host_k, host_v)
            slots = slice(slot, slot + (count - 1) * step + 1, step)
            sources = pool_k[:, slots], pool_v[:, slots]
            for out, src in zip(outs, sources):
                _copy_tokens(copy, out[:, i:i + count], src, lo, hi, g.block_tokens, unit)
        shape = (g.batch, g.kv_heads, out_k.shape[1] * g.block_tokens, g.head_dim)
        k, v = out_k.view(shape), out_v.view(shape)
        return k[:, :, start_token:start_token + num_tokens], v[:, :, start_token:start_token + num_tokens]

    def _byte_pools(self) -> tuple:
        """numpy byte views of K and V of the device and host pools, [B*H, slots, T*D*itemsize]."""
        if self._np_pools is None:
            host_k, host_v = self.host_pool.kv_rows()
            self._np_pools = (*self.device_pool.byte_rows(), host_k.view(torch.uint8).numpy(),
                              host_v.view(torch.uint8).numpy())
        return self._np_pools

    def device_slot(self, key: Hashable) -> Optional[int]:
        """The device slot of ``key``'s copy there, or None."""
        with self._lock:
            copy = self.table.copy(key, Tier.DEVICE)
            return None if copy is None else copy.slot

    def device_slots(self, keys: list) -> list:
        """The device slot of each of ``keys``' copies there; a block with no copy on the
        device is a KeyError."""
        with self._lock:
            copies = [self.table.copy(k, Tier.DEVICE) for k in keys]
            missing = next((k for k, c in zip(keys, copies) if c is None), None)
            if missing is not None:
                raise KeyError(f"block {missing!r} has no copy on the device")
            return [c.slot for c in copies]

    @_starts_work
    def begin_write(self, key: Hashable) -> int:
        """Before appending to ``key``'s device copy: wait for moves reading it, drop stale copies.

        The block must be pinned on the device. Returns its device slot. Views that
        ``read_layer`` returned are let go first (whoever writes is done reading them).
        """
        self.release_views()
        while True:
            with self._lock:
                entry = self.table.get(key)
                if entry is None:
                    raise KeyError(key)
                if Tier.DEVICE not in entry.copies:  # the stale copies dropped would be its only ones
                    raise ValueError(f"begin_write: block {key!r} has no copy on the device; "
                                     f"ensure_device (which pins it) first")
                if not entry.in_flight():
                    failed: list = []
                    for tier, slot in self.table.drop_others(key, Tier.DEVICE):
                        self._released(key, tier, slot, errors=failed)
                    if failed:
                        raise failed[0]
                    return entry.copies[Tier.DEVICE].slot
                waits = self._inflight_for(key)
            wait_all(waits)

    def _stalled(self, seconds: float) -> None:
        if self.defer_stall:
            self._stall_acc += seconds
        elif seconds:
            self.events.stall(seconds)

    def take_stall(self) -> float:
        """Stall time accumulated since the last call (with ``defer_stall``)."""
        seconds, self._stall_acc = self._stall_acc, 0.0
        return seconds

    def _filling(self, key: Hashable) -> bool:
        """``key`` is a block that holds fewer tokens than it can (its writer may add more)."""
        tokens = self._tokens.get(key)
        return tokens is not None and tokens < self.geometry.block_tokens

    def note_tokens(self, key: Hashable, num_tokens: int) -> None:
        self._tokens[key] = num_tokens

    def write_behind(self, key: Hashable) -> None:
        """A sealed block gets a clean copy one tier down if there is a free slot there."""
        if not self.write_behind_enabled:
            return
        with self._lock:
            entry = self.table.get(key)
            if entry is None:
                return
            top = self.table.best_source(key)
            lower = self._lower(top) if top is not None else None
            if lower is None or lower in entry.copies or self.table.num_free(lower) < 1:
                return
            move = self._prepare(key, top, lower, drop_source=False)
        self._submit(move, Priority.WRITEBACK, chain=True, blocking=False)

    def observe_scores(self, scores: dict) -> None:
        """Attention mass per block from the attention hook, for policies that want it."""
        with self._lock:
            for policy in self.policies.values():
                if getattr(policy, "wants_scores", False):
                    policy.observe_scores(scores)

    def note_compute(self) -> None:
        """On CUDA: name the calling thread's current stream as the one the model computes
        on; every later move in or out of the device tier waits for the work queued on it
        when the move is started (``_compute_barrier``)."""
        if self._cuda:
            self._compute_stream = torch.cuda.current_stream(self.device)

    def _compute_barrier(self):
        """On CUDA: an event after everything queued so far on the compute stream. A copy
        out of a device slot must wait for the kernels that write it (a block sealed a
        moment ago is demoted or written behind while its ``write_tokens`` may still be
        queued), and a copy into a slot for the attention that last read it; the copy
        stream otherwise runs ahead of both. Recorded when a move starts, from any thread."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream)
        return event

    def wait_idle(self) -> None:
        """Wait until no move is in flight, nor a disk read into attention's buffers (the
        read-ahead of the next step's first layers is still running when a forward returns)."""
        while True:
            with self._lock:
                futures = [self._future(move) for move in list(self._inflight)] + list(self._streaming.values())
            if not futures:
                return
            wait_all(futures)

    @_ends_work
    def drop_read_ahead(self) -> int:
        """At the end of a run: the disk reads a decode step queued for the next step's
        layers (``prefetch="auto"`` on CPU with a disk tier) will not be used. Waits for them
        and counts them as unused prefetches now; returns how many. Without this they were
        counted only at ``close()``, after ``tiercache generate`` had shown its stats (a
        review: "unused: 0" while 94 blocks read ahead were never used). The model's thread
        only, between forwards; a later step reads what it needs again."""
        return 0 if self._streams is None else self._streams.forget()

    @_starts_work
    def reorder_rows(self, rows: torch.Tensor) -> None:
        """Permute the batch rows of every block (beam search); lower copies are refreshed.

        Every copy is permuted where it lies, or dropped, so this first waits until no copy
        is being read or filled (``_quiet``): a ``get`` on another thread reads outside the
        lock, and device blocks permuted under it came back half permuted (7 reads in 100
        reorders in a script). A disk record rewritten under a read would fail its checksum,
        and the store discards a block that fails it.

        Every block is done before an error is raised (a failed tombstone of a stale copy, a
        disk record that could not be read or rewritten): raised from the middle of the
        loop, it left the blocks after it unpermuted, their rows served in the old order.
        A disk record that could not be read or rewritten is dropped (its block too, where
        it was the only copy: a fetch names the loss), never served unpermuted: one that
        failed its checks as bad, one that the disk failed to read or write the held way
        (``_discard``), so that ``close`` says so if its record, whole and unpermuted, stays.
        The first block lost is raised (``BlockCorruptedError``, or ``TierIOError`` naming
        the disk tier)."""
        self.release_views()
        rows = rows.to(torch.long).cpu()
        failed: list = []  # tombstones of stale copies that failed (held: ``_released``)
        lost: list = []  # disk-only blocks that could not be permuted, dropped
        with self._quiet():
            device_keys = list(self.table.keys_on(Tier.DEVICE))
            self.device_pool.reorder_rows([self.table.copy(k, Tier.DEVICE).slot for k in device_keys], rows)
            for key in list(self.table.keys()):
                entry = self.table.get(key)
                for tier in list(entry.copies):
                    if tier is Tier.DEVICE:
                        continue
                    if Tier.DEVICE in entry.copies:  # a failed tombstone: raised once every block is done
                        self._drop(key, tier, evicted=False, errors=failed)
                    elif tier is Tier.HOST:
                        view = self.host_pool.view(entry.copies[tier].slot)
                        view.copy_(view.index_select(1, rows))
                    elif Tier.HOST in entry.copies:
                        self._drop(key, tier, evicted=False, errors=failed)
                    else:  # only on disk: rewrite it in place
                        slot = entry.copies[tier].slot
                        try:
                            with self._staging.take() as buf:
                                self._read_disk(key, slot, buf)
                                block = self._as_block(buf)
                                block.copy_(block.index_select(1, rows))
                                self.disk.write(slot, key, buf, self._tokens.get(key, 0),
                                                self._token_ids.get(key, b""))
                        except (OSError, BlockCorruptedError) as exc:
                            bad = isinstance(exc, BlockCorruptedError)  # else the old record may be whole
                            self._discard(key, tier, bad_record=bad)
                            why = (str(exc) if bad else
                                   f"its disk record could not be permuted for a beam reorder ({exc.strerror or exc})")
                            if key in self._lost:
                                self._lost[key] = why
                            lost.append(exc if bad else TierIOError(
                                f"beam reorder: block {key!r} was dropped: the disk tier under "
                                f"{self.disk.directory!r} could not read or rewrite its record "
                                f"({exc.strerror or exc}), and its rows would be in the old order"))
        if lost or failed:  # a block lost first; a stale copy's tombstone is held, and retried
            raise (lost + failed)[0]

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock at a moment when no move is in flight and no copy of a live block
        is being read (a reader counted on it) or filled: nothing can start one until the
        lock is let go, since reads and moves begin under it. Reads outside the lock are
        short, so it looks again every millisecond until then.

        Meanwhile new reads (``get``, ``read_into``, ``AsyncStore.read_disk_record``) wait
        (``_reads_gate``, ``_past_reorder``): with four threads calling ``get`` in a loop
        there was hardly ever a moment with no reader, and a reorder waited 30 s and more
        (a helper's script)."""
        gate: Optional[_ReadsGate] = None
        try:
            while True:
                self.wait_idle()
                if self._streams is not None:  # disk reads into attention's buffers
                    self._streams.forget()
                with self._lock:
                    other = self._reads_gate
                    if gate is None and other is None:
                        gate = self._reads_gate = _ReadsGate()
                    if gate is not None and not self._inflight and not self._streaming and not self.table.any_in_use():
                        yield
                        return
                if gate is None:  # another thread's reorder: after it
                    other.result()
                else:
                    time.sleep(0.001)
        finally:
            if gate is not None:
                with self._lock:
                    self._reads_gate = None
                gate.set_result(None)

    def _past_reorder(self) -> None:
        """A read about to start waits while ``reorder_rows`` holds new reads off (``_quiet``).
        Not under the lock: a read that slips past as the gate closes is waited for there."""
        gate = self._reads_gate
        while gate is not None:
            gate.result()
            gate = self._reads_gate

    @_ends_work
    def flush(self) -> int:
        """Give every block a disk copy (where disk slots are free); returns blocks written
        (``_flush``)."""
        return self._flush()

    def _flush(self) -> int:
        """Give every block a disk copy (where disk slots are free); returns blocks written.
        Waits for the disk copies being written when it is called, too: such a block (a
        write-behind, or a demotion an eviction chained down) was skipped as having one, and
        flush returned before it was on disk (a test failed 4 times in 20 for it). Only
        those: moves other threads start meanwhile are theirs (waiting until the store is
        idle would wait as long as another thread keeps publishing). A block whose only
        copies were on their way gets its disk copy in a second pass, once they landed."""
        if self.disk is None:
            return 0
        with self._lock:  # deleted blocks' records being written: landed and invalidated first
            gone = [self._future(m) for m in self._inflight
                    if m.dst is Tier.DISK and m in self._started and self.table.get(m.key) is not m.entry]
        wait_all(gone)
        with self._lock:  # first: a slot whose record is invalidated now takes a block's copy below
            self._retry_tombstones()
        written = 0
        for _ in range(2):
            waits: list = []
            moving = False  # a block with no READY copy yet: look again once its moves landed
            with self._lock:
                moves = []
                for key in list(self.table.keys()):
                    entry = self.table.get(key)
                    if Tier.DISK in entry.copies:
                        if not self.table.is_ready(key, Tier.DISK):
                            waits.extend(self._inflight_for(key))
                        continue
                    top = self.table.best_source(key)
                    if top is None:
                        waits.extend(self._inflight_for(key))
                        moving = True
                        continue
                    if self.table.num_free(Tier.DISK) < 1:
                        continue
                    moves.append(self._prepare(key, top, Tier.DISK, drop_source=False))
            self._wait_moves(moves)
            wait_all(waits)
            with self._lock:  # a write that failed (a full disk, EIO) was rolled back: not written
                written += sum(1 for m in moves if self.table.get(m.key) is not None
                               and self.table.is_ready(m.key, Tier.DISK))
            if not moving:
                break
        return written

    def _not_on_disk(self) -> int:
        """Blocks with no finished disk copy (under the lock): what a close loses."""
        return sum(1 for key in self.table.keys() if not self.table.is_ready(key, Tier.DISK))

    def _lost_at_close(self, lost: int, failed: Optional[OSError]) -> TierCacheError:
        """The error ``close`` raises when ``lost`` blocks of a persistent store could not be
        written down (``failed``: the last write's error, if any)."""
        total = len(self.table)
        record = DiskTier.record_size(self.geometry)
        no_room = max(0, lost - self.table.num_free(Tier.DISK))  # the rest had a free slot: their write failed
        if failed is not None and lost > no_room:
            beyond = (f"; {no_room} more than {self.disk_budget_text()}" if no_room else "")
            return TierIOError(f"close: {lost} of {total} blocks are not kept for the next open: {lost - no_room} "
                               f"could not be written to the disk tier under {self.disk.directory!r} "
                               f"({failed.strerror or failed}){beyond}; the blocks already on disk are kept")
        held = len(self._unerased)
        held_text = (f" ({held} of its slots hold freed records that could not be invalidated: the disk failed "
                     f"their writes)" if held else "")
        return CapacityError(f"close: {lost} of {total} blocks are not kept for the next open: "
                             f"{self.disk_budget_text()}{held_text}, and a persistent store keeps only what its disk "
                             f"tier holds; give disk_budget at least {(total + held) * record} bytes, or delete() the "
                             f"blocks it need not keep before close()")

    def disk_budget_text(self) -> str:
        """``disk_budget`` as an error message names it: the blocks it holds, and the bytes
        of one record (more than a block: a CapacityError named only the budget)."""
        return (f"disk_budget={format_bytes(self.config.disk_budget)} (holds {self.table.num_slots(Tier.DISK)} "
                f"blocks, at {DiskTier.record_layout(self.geometry)})")

    def close(self) -> None:
        """Wait for moves, write persistent blocks down to disk, stop workers, close files.
        Then raise what a persistent store could not keep: blocks not written down
        (``_lost_at_close``), or freed records it could not invalidate, which come back on
        reopen (``_unerased_at_close``, a ``TierIOError``). Then raise a plug-in policy's
        failure that no call has raised yet (``tiercache.guard``).
        In a child made by ``fork()`` it only marks the store closed: the threads, files and
        session directory are the parent's (and a lock held at the fork would never open)."""
        if self.forked:
            self.closed = True
            return
        with self._active_cv:
            if self.closed:
                return
            self.closed = True  # new calls are refused from here on
            # a call of this thread that closes, or one a Ctrl-C in its exit left counted
            calls = self._calls
            own = 1 if getattr(calls, "depth", 0) or getattr(calls, "counted", False) else 0
            while self._active > own:
                self._active_cv.wait()
        lost = None
        try:
            self.release_views()
            self.wait_idle()
            if self.disk is not None and self.disk.persistent:
                self._disk_write_error = None  # this flush's own failures (one long gone named a full disk)
                self._flush()  # tries the tombstones that failed again, too
                unerased = self._tombstone_held()
                with self._lock:
                    missing = self._not_on_disk()
                    if missing:  # raised once everything is closed: the blocks on disk are kept
                        lost = self._lost_at_close(missing, self._disk_write_error)
                    unerased += [(key, exc, slot) for slot, (key, exc) in self._unerased.items()]
                    if unerased:
                        lost = self._unerased_at_close(unerased, lost)
        finally:
            self.engine.close()  # every queued job runs first: streamed reads let go of their copies
            if self._crc_pool is not None:
                self._crc_pool.shutdown(wait=True, cancel_futures=True)
            if self._streams is not None:
                self._streams.close()
            self._staging.close()
            if self.disk is not None:
                self.disk.close()
            if self.host_pool is not None:
                self.host_pool.close()
            # a closed store kept as a record (wrap()'s tiercache_last) held its device budget
            self._np_pools = self._gather_buf = None
            if self._device_staging is not None:
                self._device_staging.close()
            self.device_pool.release()
        sync_error = self.disk.sync_error if self.disk is not None else None
        if sync_error is not None and lost is None:
            lost = TierIOError(f"disk_dir: syncing {self.disk.path!r} to the disk failed at close ({sync_error}): "
                               f"blocks written to it may not be on the disk (the kernel reports write-back it "
                               f"lost this way), and may be missing or old at the next open")
        elif sync_error is not None:
            log.error("tiercache: at close, besides the blocks not kept: syncing %s failed: %s", self.disk.path,
                      sync_error)
        if self._policy_failures and lost is not None:  # the blocks lost are what the caller must hear
            with self._lock:
                failures, self._policy_failures[:] = list(self._policy_failures), []
            log.error("tiercache: at close, besides the blocks not kept: %s", failures[0])
        if self._policy_failures:  # a plug-in's failure in the last calls: no later call raised it
            self._raise_policy_failure()
        if lost is not None:
            raise lost

    def _tombstone_held(self) -> list:
        """``close``: tombstone the disk records of deleted blocks that a read still holds.
        ``AsyncStore.read_disk_record`` holds its record across awaits, outside any counted
        call, so ``close`` does not wait for it; the record would be tombstoned when the read
        lets go, by then through a closed file, and the deleted block would come back on
        reopen. (``_released`` skips the tombstone once the disk is closed.) Returns the
        (key, OSError, slot) of each tombstone that failed, for ``_unerased_at_close``."""
        failed = []
        with self._lock:
            for entry in list(self.table._zombies.values()):
                copy = entry.copies.get(Tier.DISK)
                if copy is not None:
                    try:
                        self.disk.tombstone(copy.slot)
                    except OSError as exc:
                        failed.append((entry.key, exc, copy.slot))
        return failed

    def _unerased_at_close(self, unerased: list, lost: Optional[TierCacheError]) -> Optional[TierCacheError]:
        """Under the lock: the error ``close`` raises for the records of ``unerased``, as
        (key, last OSError, slot), freed but whole on disk (their tombstones failed at the
        time and again at close), where the next open will serve a block wrongly; ``lost``:
        the blocks not kept, if any, named after them (returned as is when no record is
        harmful).

        Reopening cannot detect such a record: it is a whole, checksummed record of its
        key, like any live one, and nothing else on disk says it was freed (a journal would
        be one more write on a disk that just failed one). The open adopts a key's records
        when they agree, and drops them all when they differ (``_adopt_disk_records``). So,
        key by key, with the block's current record (if it is on disk) among them:
        - a block no longer stored (deleted, or dropped by the store) whose records agree
          comes back: named (delete it again once the disk works);
        - a block still stored whose current bytes are not on disk, its older records
          agreeing: it comes back with older bytes: named;
        - a block still stored whose current record is on disk beside a differing older
          one: both are dropped, the block is lost at the open: named;
        - records that agree with the current one, or a deleted block's that differ: the
          open does the right thing, nothing to say.
        Records whose headers cannot be read now are taken to differ. (Counted by record,
        and worded for the worst case, the message once said blocks would come back that
        the open dropped, and the other way round: a review.)"""
        failed = unerased[-1][1]
        slots_of: dict = {}
        for key, _, slot in unerased:
            slots_of.setdefault(key, []).append(slot)
        comes = older = dropped = 0
        for key, slots in slots_of.items():
            live = key in self.table
            current = self.table.copy(key, Tier.DISK) if live and self.table.is_ready(key, Tier.DISK) else None
            every = sorted(set(slots) | ({current.slot} if current is not None else set()))
            try:
                agree = self.disk.records_agree(every)
            except OSError:  # the disk that failed the tombstones: taken to differ
                agree = len(every) == 1
            if agree and not live:
                comes += 1
            elif agree and current is None:
                older += 1
            elif not agree and current is not None:
                dropped += 1
        if not (comes or older or dropped):
            return lost

        def blocks(n: int, what: str = "block") -> str:
            return f"{n} {what}{'s' if n > 1 else ''}"
        parts = []
        if comes:
            parts.append(f"{blocks(comes, 'block')} no longer stored (deleted or dropped) "
                         f"come{'' if comes > 1 else 's'} back (delete {'them' if comes > 1 else 'it'} again once "
                         f"the disk works)")
        if older:
            parts.append(f"{blocks(older)} still stored whose current bytes are not on disk come"
                         f"{'' if older > 1 else 's'} back with older bytes (delete {'them' if older > 1 else 'it'} "
                         f"after reopening, or clear the directory)")
        if dropped:
            parts.append(f"{blocks(dropped)} with an older record beside the current one "
                         f"{'are' if dropped > 1 else 'is'} dropped (which record is current cannot be told)")
        text = (f"close: freed disk records could not be invalidated on the disk tier under "
                f"{self.disk.directory!r} ({failed.strerror or failed}), and a record left whole cannot be told "
                f"from a live one: when the directory is reopened, {'; '.join(parts)}")
        if lost is not None:
            text += f"; besides, {lost}"
        return TierIOError(text)

    def __enter__(self) -> "BlockStore":
        return self

    def __exit__(self, exc_type: Any, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the with body's own error goes on; what close() lost is said, not raised over it
            self.close()
        except (CapacityError, TierIOError) as lost:
            log.error("tiercache: %s", lost)

    def check(self) -> None:
        """Assert the table's invariants, that no tier is over budget, that the in-flight
        books agree with one another and that each eviction policy ranks exactly the live
        blocks READY on its tier (tests)."""
        with self._lock:
            self.table.check()
            for tier, stats in self.tier_stats().items():
                if stats["budget_bytes"]:
                    assert stats["used_bytes"] <= stats["budget_bytes"], f"{tier} over budget"
            copying = sum(_touches_device(m) for m in self._inflight)
            assert self._copying == copying, f"_copying is {self._copying}, {copying} device moves in flight"
            assert self._started <= self._inflight.keys(), "a started move is not in flight"
            assert self._evicted_down <= self._inflight.keys(), "an eviction's demotion is not in flight"
            assert all(m in self._inflight and m.key == k for k, m in self._to_device.items()), \
                "a device fill is not in flight"
            for tier, policy in self.policies.items():
                ready = len(self.table.ready_keys(tier))
                assert len(policy) == ready, f"{tier.label} policy ranks {len(policy)} blocks, {ready} are READY there"

    # ---- internals: eviction ------------------------------------------------------------
    def _lower(self, tier: Tier) -> Optional[Tier]:
        return self._below.get(tier)

    def _wait_out_readers(self, tier: Tier, protect: set, since: list, need: int = 1, new: int = 0,
                          total: int = 1) -> bool:
        """Under the lock, where a call found no room for ``need`` blocks on ``tier`` and
        nothing in flight to wait for, before it raises ``CapacityError``: if the room is
        held only by calls in progress on other threads (``_room_after_calls``), wait a
        moment (the lock let go) and return True, for the caller to look again. A ``get``
        holds its block's copy for microseconds; ``ensure_device``, ``put`` and
        ``new_blocks`` raised ``CapacityError`` ("cannot move down") hundreds of times in
        three seconds beside two threads doing only ``get`` (a review's script).

        A request that can never fit fails at once, as before: ``total`` blocks needed on
        ``tier`` at once against its slots, ``new`` blocks more than every tier holds.
        ``since``: the caller's list, [when it first waited, waits so far]; the waits grow
        from 1 to 20 ms, and past ``_READERS_WAIT_S`` the error goes out."""
        now = time.monotonic()
        if since and now - since[0] > _READERS_WAIT_S:
            return False
        if not since and (total > self.table.num_slots(tier)
                          or (new and len(self.table) + new > self.capacity_blocks())):
            return False
        if not self._room_after_calls(tier, protect, need):
            return False
        if not since:
            since.extend((now, 0))
        self._put_done.wait(min(0.001 * (1 << since[1]), 0.02))
        since[1] = min(since[1] + 1, 5)
        return True

    def _room_after_calls(self, tier: Tier, protect: set, need: int) -> bool:
        """Under the lock, after ``_room`` found nothing to free or move: whether ``need``
        slots on ``tier`` can be had once the calls in progress end, and only then. A copy
        read or filled by such a call (a ``get``, a gather, a ``put``) can go then if it has
        a copy below, or moves down if there is a slot below; a deleted block's copy still
        read is freed then; and a copy that could move down but for a full tier below can,
        as far as such calls free slots there, or ``_room`` can make there then (idle copies
        below that it drops or moves further down: a full host tier above a disk tier with
        room; counted as none, two ``put`` calls filling both device slots made a fetch raise
        "cannot move down" with the disk empty, a review's script). Not a pin, one of
        attention's views, a copy the caller keeps (``protect``) or a prefix block with an
        extension on the tier."""
        table, filling = self.table, CopyState.FILLING
        viewed = {id(c) for _, c in self._views}

        def busy(c) -> bool:
            return (c.readers or c.state is filling) and id(c) not in viewed

        lower = self._lower(tier)
        free_below = table.num_free(lower) + self._room_to_make(lower, viewed) if lower is not None else 0
        freed_below = self._freed_by_calls(lower, busy) if lower is not None else 0
        zombies = self._held_zombie_copies(tier, busy)
        free, held, dirty = table.num_free(tier) + zombies, zombies, 0
        for key in table.keys_on(tier):
            if key in protect:
                continue
            entry = table.get(key)
            c = entry.copies.get(tier) if entry is not None else None
            if (c is None or id(c) in viewed or (tier is Tier.DEVICE and entry.pins)
                    or (self._children and self._extended_on(key, tier))):
                continue
            clean = ready_elsewhere(entry, tier)
            if busy(c):
                held += 1
                free += clean
                dirty += not clean
            elif freed_below and not clean:  # it moves down once a call frees a slot below
                dirty += 1
        free += min(dirty, free_below + freed_below)
        return bool(held or freed_below) and free >= need

    def _room_to_make(self, tier: Tier, viewed: set) -> int:
        """Under the lock: slots ``_room`` could free on ``tier`` for blocks coming down from
        above once the moves in flight land, beyond its free ones: copies (not pinned or
        viewed, no extension there) that are clean, or will be when their write-down lands
        (a copy read by a move that fills a copy below), and idle ones that can move down to
        a free slot of the tier below. The last tier: none (its keys are not walked; a disk
        may hold millions)."""
        table, lower = self.table, self._lower(tier)
        if lower is None:
            return 0
        ready, filling = CopyState.READY, CopyState.FILLING
        clean = dirty = 0
        for key in table.keys_on(tier):
            entry = table.get(key)
            c = entry.copies.get(tier) if entry is not None else None
            if (c is None or c.state is not ready or id(c) in viewed or (tier is Tier.DEVICE and entry.pins)
                    or (self._children and self._extended_on(key, tier))):
                continue
            if ready_elsewhere(entry, tier) or (c.readers and any(
                    t > tier and other.state is filling for t, other in entry.copies.items())):
                clean += 1
            elif not c.readers:
                dirty += 1
        return clean + min(dirty, table.num_free(lower))

    def _freed_by_calls(self, tier: Tier, busy) -> int:
        """Under the lock: slots of ``tier`` that the end of calls in progress frees: copies
        they hold (``busy``) of deleted blocks, or of blocks READY on another tier (droppable
        then). The last tier has nothing below: only the deleted blocks' copies (its keys are
        not walked; a disk may hold millions)."""
        table = self.table
        count = self._held_zombie_copies(tier, busy)
        if self._lower(tier) is None:
            return count
        for key in table.keys_on(tier):
            entry = table.get(key)
            c = entry.copies.get(tier) if entry is not None else None
            if c is not None and busy(c) and ready_elsewhere(entry, tier):
                count += 1
        return count

    def _held_zombie_copies(self, tier: Tier, busy) -> int:
        """Under the lock: copies on ``tier`` of deleted blocks that calls in progress hold
        (``busy``): each slot is freed when its call lets go."""
        return sum(1 for c in (z.copies.get(tier) for z in self.table._zombies.values()) if c is not None and busy(c))

    def _room(self, tier: Tier, n: int, protect: set, allow_writeback: bool) -> list:
        """Under the lock: free up to ``n`` slots on ``tier``. Clean copies are dropped now;
        dirty ones get demotion moves, returned for the caller to submit and wait on."""
        need = n - self.table.num_free(tier)
        if need <= 0:
            return []
        lower = self._lower(tier)

        def evictable(key) -> bool:
            if key in protect or (self._children and self._extended_on(key, tier)):
                return False
            if self.table.can_drop(key, tier):
                return True
            return allow_writeback and lower is not None and self.table.is_movable(key, tier)

        policy = self.policies[tier]
        victims = None
        if tier is Tier.DEVICE:
            # A block still being filled (a layer's tail) comes straight back for the next
            # token's write, dirty, so sealed blocks go first, in the policy's order. Without
            # this, `layer-cycle` (which evicts the block read last first: a layer's tail)
            # moved every layer's tail down and up again at every decode step.
            victims = policy.evict(need, lambda key: evictable(key) and not self._filling(key))
        elif tier is Tier.HOST and self._reads_both:
            victims = self._redundant_first(policy, need, evictable)
        if victims is None:
            victims = policy.evict(need, evictable)
        if victims is None:  # fewer than `need` evictable: take all there are
            available = sum(1 for key in self.table.keys_on(tier) if evictable(key))
            victims = policy.evict(available, evictable) or []
        moves = []
        # Clean victims go first: making room below for a dirty one may drop a lower copy
        # (on a CPU host tier, copies of device blocks go first), and if that copy is what
        # made another victim here clean, that victim would have to be written down too.
        dirty = []
        for key in victims:
            if self.table.can_drop(key, tier):  # a failed tombstone is held and logged: the moves go on
                self._drop(key, tier, evicted=True, errors=[])
            else:
                dirty.append(key)
        for key in dirty:
            if self.table.num_free(lower) < 1:
                # `protect` guards copies on this tier only: below, dropping a clean copy
                # of a protected block loses nothing.
                moves.extend(self._room(lower, 1, set(), allow_writeback))
            if self.table.num_free(lower) >= 1:
                move = self._prepare(key, tier, lower, drop_source=True)
                self._evicted_down.add(move)
                moves.append(move)
                self.events.eviction(tier.label)
        if not moves and self.table.num_free(tier) < n:
            # Nothing to evict now. Moves in flight may still help: a demotion frees its
            # source slot, and a copy landing here becomes a clean, droppable copy.
            # A write-behind reading a copy here makes that copy evictable once it completes.
            moves = [m for m in self._inflight if m.src is tier or m.dst is tier]
        return moves

    def _redundant_first(self, policy, need: int, evictable) -> Optional[list]:
        """Under the lock, for a CPU store whose attention reads the device and the host
        tier where blocks lie: ``need`` host victims, first (in the policy's order) the host
        copies of blocks that are READY on the device too. Attention reads the device copy
        of such a block, so its host copy is never read: it only saves a write-down if the
        device evicts the block, which decode rarely does (a new tail block per layer every
        ``block_tokens`` tokens). The policy cannot know this: in the 8k disk set-up of
        ``bench decode`` with `layer-cycle`, 30 of the host tier's 67 slots held such
        copies (each layer's newest sealed block), and every step read 178 blocks from
        disk; with this rule, 146. None when no host copy is redundant, or fewer than
        ``need`` copies can go."""
        table = self.table
        both = table.keys_on(Tier.HOST) & table.keys_on(Tier.DEVICE)  # usually few: one C pass
        redundant = [key for key in both if table.is_ready(key, Tier.DEVICE) and evictable(key)]
        if not redundant:
            return None
        first = policy.evict(min(need, len(redundant)), set(redundant).__contains__) or []
        if len(first) == need:
            return first
        taken = set(first)
        rest = policy.evict(need - len(first), lambda key: key not in taken and evictable(key))
        return None if rest is None else first + rest

    def _drop(self, key: Hashable, tier: Tier, evicted: bool, errors: Optional[list] = None) -> None:
        """Under the lock: drop ``key``'s idle copy on ``tier`` (``errors``: ``_released``'s)."""
        slot = self.table.drop(key, tier)
        self._released(key, tier, slot, errors=errors)
        if evicted:
            self.events.eviction(tier.label)

    def _discard(self, key: Hashable, tier: Tier, bad_record: bool = True) -> None:
        """Under the lock: drop ``key``'s copy on ``tier``, which failed its check. If it
        was the last one, the block is gone: its books go too, and a later read names why
        (it said "not in the cache (lost or deleted)", which hid the corruption).

        A bad record fails its checks again whenever it is read: a failed tombstone of it is
        only logged. ``bad_record=False``: a copy dropped because the disk failed to read or
        rewrite it (``reorder_rows``), whose record may be whole: a failed tombstone is held
        and tried again, as for a deleted block's (``_released``)."""
        freed = self.table.discard(key, tier)
        for t, slot in freed:
            self._released(key, t, slot, rolled_back=bad_record, errors=[])
        if freed and self.table.get(key) is None:
            self._forget(key)
            self._lost[key] = f"its {tier.label} record failed its integrity check and no intact copy existed"
            while len(self._lost) > _LOST_KEPT:
                self._lost.pop(next(iter(self._lost)))

    def _unknown(self, key: Hashable) -> Exception:
        """Under the lock: the error for a call naming ``key``, which the table does not
        hold: ``KeyError``, or ``BlockCorruptedError`` saying why if it was lost to a failed
        check (a second ``get`` of such a block said only KeyError, as for a key never
        stored)."""
        return self._missing(key) if key in self._lost else KeyError(key)

    def _missing(self, key: Hashable) -> BlockCorruptedError:
        """The error for a read of ``key``, which the table does not hold."""
        why = self._lost.get(key)
        return BlockCorruptedError(f"block {key!r} is not in the cache ({why or 'lost or deleted'})")

    def _released(self, key: Hashable, tier: Tier, slot: int, rolled_back: bool = False,
                  errors: Optional[list] = None) -> None:
        """Under the lock, right after a slot was freed (before anyone can reuse it).
        ``rolled_back``: the slot holds no record that could be served: it was reserved for
        a move that failed or never ran (its destination, ``_reserved``; not a deleted
        block's source copy that the roll-back frees too, a live record), so a torn one at
        most, or its record failed its checks (``_discard``): a tombstone that fails there
        is logged, not raised (raised, it cut the roll-back's books short), and not held.
        Any other copy freed must be invalidated, or an old block comes back on reopen: its
        slot is held and the tombstone tried again
        (``_hold_unerased``, which logs it), and the failure is raised once the books are
        done, or appended to ``errors`` when given: a caller freeing several copies (a loop,
        a roll-back, a read letting go) frees them all first, and a read path that only lets
        go does not raise it at all (``close`` does, if the record is never invalidated).
        Raised from inside such a loop, it left readers held and moves in flight for good
        (a review's script: ``reorder_rows`` then waited forever)."""
        failed = None
        if tier is Tier.DISK and not self.disk.closed:  # closed: ``_tombstone_held`` did it
            try:
                self.disk.tombstone(slot)
            except OSError as exc:
                if rolled_back:
                    log.warning("tiercache: could not clear disk slot %d of %s (%s); the record there fails its "
                                "checks if it is ever read", slot, self.disk.path, exc.strerror or exc)
                else:
                    self._hold_unerased(key, slot, exc)
                    failed = exc
        if self.table.copy(key, tier) is None:  # else a zombie's copy went; a newer block with the key lives there
            self._gone_from(key, tier)
        if failed is not None:  # the books are done: the caller hears of it
            if errors is None:
                raise failed
            errors.append(failed)

    def _hold_unerased(self, key: Hashable, slot: int, exc: OSError) -> None:
        """Under the lock: the tombstone of disk ``slot``, just freed from ``key``'s copy,
        failed. The record there is whole, and a reopened store would adopt it: ``key``
        deleted would come back (or, for a stale copy freed, its older bytes). The slot is
        held out of use (a new block's write there would erase the record, but on a failing
        disk it fails and is rolled back, and a reserved slot's tombstone failure is only
        logged: the record would stay, forgotten), and the tombstone is tried again by
        ``flush`` and ``close`` (``_retry_tombstones``); ``close`` raises if it still fails
        then (``_unerased_at_close``)."""
        self.table.hold(Tier.DISK, slot)
        self._unerased[slot] = (key, exc)
        log.warning("tiercache: could not invalidate the disk record of %r (slot %d of %s: %s); the slot is held "
                    "and flush() and close() try again", key, slot, self.disk.path, exc.strerror or exc)

    def _retry_tombstones(self) -> None:
        """Under the lock: try again the tombstones that failed (``_hold_unerased``); a slot
        whose record is invalidated now is free again, the others stay held."""
        if not self._unerased or self.disk is None or self.disk.closed:
            return
        for slot, (key, _) in list(self._unerased.items()):
            try:
                self.disk.tombstone(slot)
            except OSError as exc:
                self._unerased[slot] = (key, exc)
                continue
            del self._unerased[slot]
            self.table.unhold(Tier.DISK, slot)

    def _gone_from(self, key: Hashable, tier: Tier) -> None:
        """Under the lock: the live block ``key`` has no copy on ``tier`` any more."""
        self.policies[tier].remove(key)
        self._prefetch_gone((key,), tier)

    def _gone_from_all(self, keys: Sequence[Hashable], tier: Tier) -> None:
        """``_gone_from`` of each of ``keys`` (a batch of moves that dropped their sources)."""
        self.policies[tier].remove_many(keys)
        self._prefetch_gone(keys, tier)

    def _prefetch_gone(self, keys: Sequence[Hashable], tier: Tier) -> None:
        """Prefetches of ``keys`` to ``tier`` that left it unread: counted as unused."""
        prefetched = self._prefetched
        if prefetched:
            for key in keys:
                if prefetched.get(key) is tier:
                    del prefetched[key]
                    self.events.prefetch("unused")

    def _forget(self, key: Hashable) -> None:
        entry = self.table.get(key)
        failed: list = []  # tombstones that failed (held, ``_hold_unerased``): raised once the books are done
        for tier, slot in self.table.delete(key):
            self._released(key, tier, slot, errors=failed)
        # Copies a move still reads or fills, or a view holds, go when that ends, and the key
        # may name a new block by then: the policies forget the deleted block's now (its
        # copies cannot be evicted anyway), so that they rank live blocks only.
        for tier in entry.copies if entry is not None else ():
            self._gone_from(key, tier)
        self._unlink(key)
        for child in self._children.pop(key, ()):
            self._parent.pop(child, None)
        self._tokens.pop(key, None)
        self._token_ids.pop(key, None)
        if failed:
            raise failed[0]

    def _inflight_for(self, key: Hashable) -> list:
        """Under the lock: futures of the moves of ``key`` in flight, and of a read of its
        disk copy into attention's buffer (``DiskStreams``), to wait on."""
        futures = [self._future(m) for m in [m for m in self._inflight if m.key == key]]
        if self._streaming:
            read = self._streaming.get(key)
            if read is not None:
                futures.append(read)
        return futures

    def _moving(self, key: Hashable) -> bool:
        """Under the lock: whether a move of ``key`` is in flight."""
        return any(m.key == key for m in self._inflight)

    def _capacity_message(self, num_needed: int) -> str:
        g = self.geometry
        return (f"the device tier holds {self.table.num_slots(Tier.DEVICE)} blocks "
                f"(device_budget={format_bytes(self.config.device_budget)}, {format_bytes(g.block_bytes)} "
                f"per block) but this step needs {num_needed} blocks resident at once and the rest are "
                f"pinned or in flight; minimum device_budget = {num_needed * g.block_bytes} bytes "
                f"({format_bytes(num_needed * g.block_bytes)})")

    def _resident_message(self, num_needed: int, num_missing: int, protect: set) -> str:
        """Why ``num_needed`` blocks cannot all be on the device at once (``num_missing`` of
        them are not): more than it holds (its minimum budget), blocks there that cannot move
        down now (``_full_message``), or no room below. In that last case the device budget
        was enough, and the message said it was the minimum, naming the budget it had."""
        slots = self.table.num_slots(Tier.DEVICE)
        if num_needed > slots:
            return self._full_message(num_needed, Tier.DEVICE, protect)  # the device's minimum budget
        if any(self.table.num_free(t) for t in self.tiers if t > Tier.DEVICE):
            return self._full_message(num_missing, Tier.DEVICE, protect)  # what keeps them from going down
        cfg = self.config
        below = [f"host_budget={format_bytes(cfg.host_budget)}" if Tier.HOST in self.tiers else "no host tier",
                 self.disk_budget_text() if Tier.DISK in self.tiers else "no disk tier"]
        return (f"this step needs {num_needed} blocks on the device at once ({num_missing} to bring up), and "
                f"device_budget={format_bytes(cfg.device_budget)} holds {slots}, but "
                f"the blocks there have nowhere to go: every tier below is full ({', '.join(below)}); raise "
                f"{'host_budget' if Tier.HOST in self.tiers else 'device_budget'} or add a disk tier "
                f"(disk_dir, disk_budget); nothing was overwritten")

    def _full_message(self, num_new: int, tier: Tier = Tier.DEVICE, protect: Iterable[Hashable] = ()) -> str:
        """Why ``num_new`` new blocks found no slot on ``tier`` (``_room`` had nothing to
        move; ``protect``: the keys the caller kept from eviction). More than the tier
        holds: the device's minimum budget. A tier below has room: the blocks on ``tier``
        that cannot go down, and why (pinned, kept by this call, read by attention's views
        or moving). Else every tier is full."""
        slots = self.table.num_slots(tier)
        if tier is Tier.DEVICE and num_new > slots:
            return self._capacity_message(num_new)
        below = [t for t in self.tiers if t > tier and self.table.num_free(t)]
        if below:
            protect = set(protect)
            counts = {"pinned": 0, "kept by this call": 0, "read by attention's views or moving": 0}
            for key in self.table.keys_on(tier):
                entry = self.table.get(key)
                c = entry.copies.get(tier) if entry is not None else None
                if c is None:
                    continue
                if key in protect:
                    counts["kept by this call"] += 1
                elif tier is Tier.DEVICE and entry.pins:
                    counts["pinned"] += 1
                elif c.readers or c.state is CopyState.FILLING:
                    counts["read by attention's views or moving"] += 1
            why = ", ".join(f"{n} {what}" for what, n in counts.items() if n) or "none movable now"
            advice = ("unpin blocks or release views (release_views())" if tier is Tier.DEVICE
                      else "release views or let moves finish")
            return (f"no {tier.label} slot for {num_new} new block(s): {self.table.num_free(tier)} of {slots} "
                    f"free, and the blocks there cannot move down ({why}) while the "
                    f"{' and '.join(t.label for t in below)} tier{'s have' if len(below) > 1 else ' has'} room; "
                    f"{advice}, or raise {tier.label}_budget "
                    f"(now {format_bytes(getattr(self.config, f'{tier.label}_budget'))}); nothing was overwritten")
        # Each tier's blocks, not only its budget: a host slot is padded to whole pages, so
        # "5.2 KiB in all" next to host_budget=64KiB read as a contradiction (a review).
        cfg, g = self.config, self.geometry
        def holds(tier: Tier) -> str:
            n = self.table.num_slots(tier)
            return f"holds {n} block{'' if n == 1 else 's'}"

        parts = [f"device_budget={format_bytes(cfg.device_budget)} ({holds(Tier.DEVICE)} of "
                 f"{format_bytes(g.block_bytes)})"]
        if Tier.HOST in self.tiers:
            padded = f", each padded to {format_bytes(g.padded_bytes)}" if g.padded_bytes != g.block_bytes else ""
            parts.append(f"host_budget={format_bytes(cfg.host_budget)} ({holds(Tier.HOST)}{padded})")
        if Tier.DISK in self.tiers:
            parts.append(self.disk_budget_text())
        needed = (len(self.table) + num_new) * g.block_bytes
        return (f"live KV data exceed every tier: {len(self.table)} blocks stored and {num_new} more needed "
                f"({format_bytes(needed)} of KV in all) with {', '.join(parts)}; nothing was overwritten")

    def _wait_moves(self, moves: list, raise_io: bool = False) -> float:
        """Start the prepared ``moves`` that are not running yet and wait for all of them.

        With ``raise_io``, moves that all failed with an OS error (disk full, EIO) raise
        ``TierIOError``: the caller was waiting for room that the storage cannot give, and
        retrying would spin forever. The failed moves were rolled back; nothing is lost.
        """
        mine: list = []
        futures = self._submit_all(moves, Priority.WRITEBACK, mine)
        t0 = time.perf_counter()
        self._help(mine)
        errors = wait_all(futures) + self._wait_works(mine)
        for exc in errors:
            if not isinstance(exc, (OSError, RecordError, BlockCorruptedError)):
                raise exc
        io = [e for e in errors if isinstance(e, OSError)]
        if raise_io and io and len(io) == len(futures) + sum(work.moves for work in mine):
            raise self._io_error("making room", io[0])
        return time.perf_counter() - t0

    def _io_error(self, what: str, exc: OSError) -> TierIOError:
        where = f" under {self.disk.directory!r}" if self.disk is not None else ""
        return TierIOError(f"{what} failed: the disk tier{where} cannot be written or read "
                           f"({exc.strerror or exc}); blocks already stored are untouched")

    # ---- internals: moves ------------------------------------------------------------------
    def _prepare(self, key: Hashable, src: Tier, dst: Tier, drop_source: bool) -> Move:
        """Under the lock: reserve the move in the table and register it as in flight at
        once, so that anyone who sees the FILLING copy can wait for it (``_future``)."""
        return self._prepare_all([(key, src)], dst, drop_source)[0]

    def _prepare_all(self, planned: list, dst: Tier, drop_source: bool) -> list:
        """Under the lock: ``_prepare`` of each ``(key, src)`` of ``planned`` to ``dst``, in
        order, in one table call (``BlockTable.prepare_moves``). All or nothing: if the
        table refuses one, none is prepared."""
        moves: list = []
        touching = 0  # moves to or from the device (``_copying``), once counted
        try:
            moves = self.table.prepare_moves(planned, dst, drop_source)
            fetch = dst is Tier.DEVICE
            touching = len(moves) if fetch else list(map(_MOVE_SRC, moves)).count(Tier.DEVICE)
            self._copying += touching
            if fetch:
                self._to_device.update([(move.key, move) for move in moves])
            self._inflight.update(dict.fromkeys(moves))
        except BaseException:  # Ctrl-C while registering them: undone, as if never prepared
            self._copying -= touching
            for move in moves:
                self._inflight.pop(move, None)
                if self._to_device.get(move.key) is move:
                    del self._to_device[move.key]
                for tier, slot in self.table.complete_move(move, ok=False):
                    self._released(move.key, tier, slot, rolled_back=_reserved(move, tier, slot), errors=[])
            raise
        return moves

    def _future(self, move: Move) -> Future:
        """The future of a move's waiters, made on first demand; a finished one once the
        move is done. Most moves complete with nobody waiting but the batch that copies
        them (``_Work``), and a future each (a ``threading.Condition`` inside, made, set
        and waited on) was a quarter of a fetch's Python."""
        with self._lock:
            held = self._inflight.get(move, _GONE)
            if held is _GONE:  # completed (or rolled back)
                return _done()
            if held is None or held.__class__ is _Work:
                future = _MoveFuture()
                if held is not None:  # a waiter helps copy the batch (``_MoveFuture``)
                    future.pieces = (self, held)
                self._inflight[move] = future
                return future
            return held

    def _take_waiter(self, move: Move) -> Optional[Future]:
        """Under the lock: the move leaves the in-flight maps; returns its waiters' future,
        if anyone asked for one."""
        held = self._inflight.pop(move, _GONE)
        if held is not _GONE and _touches_device(move):
            self._copying -= 1
        self._started.discard(move)
        if move.dst is Tier.DEVICE and self._to_device.get(move.key) is move:
            del self._to_device[move.key]
        return held if held.__class__ is _MoveFuture else None

    def _abandon(self, moves: list) -> None:
        """Under the lock: roll back prepared moves that were never started (planning failed)."""
        for move in moves:
            if move in self._inflight and move not in self._started:
                waiter = self._roll_back(move)
                if waiter is not None:
                    waiter.set_result(None)

    def _roll_back(self, move: Move) -> Optional[Future]:
        """Under the lock: undo a prepared move that will not run; returns its waiters'
        future, for the caller to resolve."""
        waiter = self._take_waiter(move)
        self._evicted_down.discard(move)
        crc = self._crcs.pop(move, None)
        if crc is not None:
            crc.cancel()
        for tier, slot in self.table.complete_move(move, ok=False):  # every move of an _abandon goes back
            self._released(move.key, tier, slot, rolled_back=_reserved(move, tier, slot), errors=[])
        return waiter

    def _submit_all(self, moves: list, priority: Priority, help_here: Optional[list] = None) -> list:
        """Start prepared moves; returns the futures of those that are not copied in a batch
        of this call (not in the order of ``moves``). A caller that waits for the moves
        passes ``help_here``: it receives the batches, to help copy (``_help``) and wait for
        (``_wait_works``).

        On CPU a host<->device move is one memcpy of a block (~0.15 ms for 1.5 MiB). Queued
        one job per move, the queue's and the GIL's per-job cost took up to two thirds of
        the bandwidth with several workers. So the copies started together are sorted by
        slot and cut into pieces (a run of adjacent slots, one copy call per pool, at most
        ``_PIECE_BYTES``), and as many jobs as there are workers or cores, whichever is
        fewer, take pieces off one shared queue until it is empty (``_drain``). A worker
        the scheduler wakes late (1-3 ms on two busy cores) then does less, not its fixed
        half. A caller that waits for the moves passes ``help_here``, a list that receives
        the work; ``_help(help_here)`` copies pieces on the caller's thread too.

        A caller whose copies are the only moves in flight (``bench io``'s rounds; a decode
        step making room with no disk read going) starts no job: it copies each run alone,
        with torch's intra-op threads, as a plain ``copy_`` would. The model's OpenMP
        threads spin for a while after each parallel region; copy jobs on other threads
        then shared the two cores with a spinning thread (with ``OMP_WAIT_POLICY=PASSIVE``
        bench io's ratios rose from 0.67/0.62 to 0.76/0.82), while a parallel region on
        the caller's thread runs on those very threads.

        On CUDA the copies are queued on the copy stream and the host only waits, so none of
        that applies: the pieces hold one direction each, fetches first, up to
        ``_CUDA_PIECE_BYTES`` (64 MiB), each queued back to back with one wait (one job and one wait per
        block reached a quarter of the copy rate that batches reach on an H200), and jobs
        start even when the caller helps, so that a demand batch reaches the stream ahead
        of a prefetch the caller queues before it helps. At most ``_CUDA_JOBS`` jobs: in a
        profile on an H200 the copy engine ran at ~51 GB/s while busy but idled two thirds
        of the time, waiting on the store's Python; 64 MiB pieces instead of 16 took a
        host->device batch from 17 to 23 GB/s, one job instead of four from 17 to 21."""
        disk = Tier.DISK
        copies, disk_moves = [], []
        for m in moves:
            (disk_moves if m.src is disk or m.dst is disk else copies).append(m)
        try:
            if len(copies) < (1 if help_here is not None else 2):
                return [self._submit(m, priority) for m in moves]
            futures = [self._submit(m, priority) for m in disk_moves]
            # before any copy is marked started: if it fails, all go back
            barrier = self._compute_barrier()
        except BaseException:  # interrupted while queueing: the moves not started go back
            with self._lock:
                self._abandon(moves)
            raise
        todo: list = []
        work = None
        with self._lock:
            inflight = self._inflight
            for move in copies:
                if move not in inflight:  # already completed
                    futures.append(_done())
                    continue
                if move in self._started:  # another batch copies it: wait for that
                    futures.append(self._future(move))
                    continue
                self._started.add(move)
                todo.append(move)
            alone = help_here is not None and len(inflight) == len(todo)
            if todo:
                if self._staged_copies:
                    alone = False
                    fetches = [move for move in todo if move.dst is Tier.DEVICE]
                    others = [move for move in todo if move.dst is not Tier.DEVICE]
                    work = _Work(_pieces([d for d in (fetches, others) if d],
                                         max(1, _CUDA_PIECE_BYTES // self.geometry.block_bytes)), len(todo))
                else:
                    most = len(todo) if alone else max(1, _PIECE_BYTES // self.geometry.block_bytes)
                    work = _Work(_pieces(_slot_runs(todo), most), len(todo))
                work.parallel, work.total = alone, len(work)
                work.compute_event = barrier
                # No future per move: the caller waits for the batch (``_wait_works``), and
                # whoever else waits for a move gets one that helps copy the batch (``_future``).
                for move in todo:
                    held = inflight[move]
                    if held is None:
                        inflight[move] = work
                    else:  # a future made before the move started (``demote_many``)
                        held.pieces = (self, work)
        if work is not None:
            jobs = 0 if alone else min(self._copy_jobs, len(work)) - (
                1 if help_here is not None and not self._staged_copies else 0)
            queued = 0
            try:
                for _ in range(jobs):
                    self.engine.submit(lambda: self._drain(work, priority), priority)
                    queued += 1
            except BaseException as exc:  # interrupted or closing: with no job queued, nobody
                if not queued:             # would copy these (the caller does not get to help)
                    while work:
                        try:
                            self._fail_piece(work.popleft(), exc, work)
                        except IndexError:
                            break
                raise
            if help_here is not None:
                help_here.append(work)
        return futures

    def _wait_works(self, works: list) -> list:
        """Wait until every move of the batches in ``works`` is done (after ``_help``, the
        pieces left are those jobs are copying); returns their moves' errors."""
        errors: list = []
        for work in works:
            work.wait()
            errors.extend(work.errors)
        return errors

    def _help(self, works: list) -> None:
        """The caller copies pieces of ``works`` (from ``_submit_all``) until none is left.
        Interrupted (Ctrl-C on the caller's thread), it leaves the rest to a worker, so that
        no move stays in flight for good."""
        try:
            for work in works:
                self._drain(work, None, parallel=work.parallel)
        finally:
            for work in works:
                self._hand_on(work)

    def _help_until(self, future: Future, work: "_Work") -> None:
        """A thread waiting for ``future`` copies pieces of its batch (``work``) until the
        future is done or no piece is left; the jobs started with the batch do the rest.

        If it comes before any job has taken a piece and the batch is all that is in
        flight (``bench io``'s device->host rounds: ``demote_many``, then a wait), it takes
        the whole batch and copies it with torch's intra-op threads, as a caller alone
        does (``_submit_all``); the jobs, once they run, find it taken and stop.
        Interrupted, it leaves what is left to a worker (as ``_help``)."""
        claimed = False
        if not work.parallel and len(work) == work.total and not self._staged_copies:
            with self._lock:
                if not work.parallel and len(work) == work.total and len(self._inflight) == work.moves:
                    work.parallel = claimed = True
        runs: list = []  # whole pieces at every moment: an interrupt puts them back as they are
        try:
            if claimed:  # the pieces joined again into whole runs: one copy call per run
                while work:
                    try:
                        runs.append(work.popleft())
                    except IndexError:
                        break
                runs = _slot_runs([move for piece in runs for move in piece])
                while runs:
                    self._run_piece(runs.pop(0), work, True)
                return
            while not future.done():
                try:
                    piece = work.popleft()
                except IndexError:
                    return
                self._run_piece(piece, work)
        finally:
            work.extend(runs)  # not started (an interrupt)
            if claimed or not future.done():
                self._hand_on(work)

    def _hand_on(self, work: "_Work") -> None:
        """Pieces a helping thread leaves (interrupted) go to a worker, as numpy copies."""
        work.parallel = False
        if work:
            self.engine.submit(functools.partial(self._drain, work, Priority.DEMAND), Priority.DEMAND)

    def _drain(self, work: "_Work", priority: Optional[Priority], parallel: bool = False) -> None:
        """Copy pieces off ``work`` until it is empty. A worker (``priority`` given) stops
        after ``_CHUNK_BYTES`` and queues itself again, so that a demand read queued
        meanwhile waits for one chunk at most. (On CUDA a piece is up to
        ``_CUDA_PIECE_BYTES``; a demand batch gets jobs of its own, but its copies may
        still queue on the copy stream behind the pieces already there: two at most,
        about 2.5 ms at the H200's 53 GB/s.)"""
        done = 0
        while True:
            if priority is not None and work.parallel:  # a waiting thread took the batch
                return
            try:
                piece = work.popleft()
            except IndexError:
                return
            self._run_piece(piece, work, parallel)
            done += len(piece) * self.geometry.block_bytes
            if priority is not None and done >= _CHUNK_BYTES and work:
                try:
                    if self.engine.submit(lambda: self._drain(work, priority), priority, blocking=False) is not None:
                        return
                except RuntimeError:  # the engine is closing: finish here
                    pass
                done = 0

    def _run_piece(self, piece: list, work: "_Work", parallel: bool = False) -> None:
        """CPU copy moves of adjacent slots (both sides): one copy call per pool, not one per
        block (fewer calls, each of which takes the GIL back when it returns). CUDA: the
        piece's copies go on the copy stream back to back, after the batch's compute event,
        with one wait. A piece whose copy fails is done again block by block, so that only
        a move that fails by itself is rolled back. The piece's moves are then settled in
        ``work``; a waiter's future (``_future``), if one was made, gets the outcome."""
        compute_event = work.compute_event
        try:
            seconds = self._copy_run(piece, parallel, compute_event) if len(piece) > 1 else None
        except BaseException as exc:  # an interrupt on a helping caller: the piece rolls back
            self._fail_piece(piece, exc, work)
            raise
        errors: list = []
        if seconds is None:  # a single block, or a run that failed: block by block
            for i, move in enumerate(piece):
                try:
                    error = self._run_move(move, compute_event, chain=False, deliver=True)
                except BaseException as exc:  # noqa: BLE001 - an interrupt between its steps
                    error = exc
                if error is not None:
                    errors.append(error)
                    if not isinstance(error, Exception):  # Ctrl-C on this thread: the rest of
                        work.settle(i + 1, errors, self._lock)  # the piece rolls back, and the
                        self._fail_piece(piece[i + 1:], error, work)  # interrupt goes on up
                        raise error
            work.settle(len(piece), errors, self._lock)
            return
        # Copied: the moves complete under one hold of the lock and are counted at once.
        with self._lock:
            try:
                done, errors = self._complete_copied(piece)
            except BaseException as exc:  # Ctrl-C between its steps: every move of the piece has
                work.settle(len(piece), [exc], self._lock)  # been through the table; settle it
                raise
        first = piece[0]
        resolved = 0
        try:
            self.events.move(first.src.label, first.dst.label, self.geometry.block_bytes, seconds,
                             blocks=len(piece) - sum(error is not None for _, _, error in done))
            for follow, waiter, error in done:
                try:
                    if error is not None:
                        raise error
                    if follow is not None:
                        self._submit(follow, Priority.WRITEBACK, chain=True, blocking=False)
                except BaseException as exc:  # noqa: BLE001 - delivered to its waiters
                    errors.append(exc)
                    if waiter is not None:
                        waiter.set_exception(exc)
                else:
                    if waiter is not None:
                        waiter.set_result(None)
                resolved += 1
        finally:
            if resolved < len(done):  # interrupted (Ctrl-C on a helping thread): the moves are
                rest = done[resolved:]  # complete; their write-behinds go back, waiters learn
                with self._lock:
                    self._abandon([follow for follow, _, _ in rest if follow is not None])
                for _, waiter, error in rest:
                    if waiter is not None and not waiter.done():
                        if error is None:
                            waiter.set_result(None)
                        else:
                            waiter.set_exception(error)
            work.settle(len(piece), errors, self._lock)

    def _complete_copied(self, piece: list) -> tuple:
        """Under the lock: ``_take_waiter`` and ``_complete`` of every move of a copied piece
        (host<->device, one direction). Returns ([(write-behind move or None, waiters' future
        or None, error or None)] for the moves that need more than that: those someone
        waits for, and any that failed to complete; the errors the policies raised, if any,
        for the batch's owner). A live block's move that no eviction
        started (nearly all) needs only the table's commit, done here inline, and the
        policies, told of the whole piece in one call each (``insert_many``, ``remove_many``);
        an eviction's demotion (a write-behind may follow) and a deleted block's take
        ``_complete``. A batch of 43 blocks spent ~6 µs a block in the general path."""
        src, dst = piece[0].src, piece[0].dst
        evicted_down, live, commit = self._evicted_down, self.table.get, self.table.commit_copied
        # ``_take_waiter`` inline: every move of the piece is to or from the device
        inflight, started, to_device, gone = self._inflight, self._started, self._to_device, _GONE
        fetch = dst is Tier.DEVICE
        rest: list = []
        arrived: list = []  # keys now READY on dst, and those whose source copy went: the
        left: list = []     # policies learn of them in one call each, below
        for move in piece:
            waiter = None
            try:  # whatever happens to one move (a bug, Ctrl-C), the others still complete
                held = inflight.pop(move, gone)
                if held is not gone:
                    self._copying -= 1
                started.discard(move)
                if fetch and to_device.get(move.key) is move:
                    del to_device[move.key]
                if held.__class__ is _MoveFuture:
                    waiter = held
                if (evicted_down and move in evicted_down) or live(move.key) is not move.entry:
                    rest.append((self._complete(move, None, False, chain=False), waiter, None))
                    continue
                if commit(move) is not None:  # the source copy went (``_released``: not a
                    left.append(move.key)     # disk slot, and the block is live, not a zombie's)
                arrived.append(move.key)
                if waiter is not None:
                    rest.append((None, waiter, None))
            except BaseException as exc:  # noqa: BLE001 - delivered to its waiters, if any
                rest.append((None, waiter, exc))
        # A policy that raises here (Ctrl-C; a plug-in's own errors stop at its guard) must not
        # leave the piece unsettled. The moves are done; the batch's owner gets the error.
        failed: list = []
        if left:
            self._tell_policy(lambda keys: self._gone_from_all(keys, src), lambda key: self._gone_from(key, src),
                              left, src, failed)
        self._tell_policy(self.policies[dst].insert_many, self.policies[dst].insert, arrived, dst, failed)
        return rest, failed

    def _tell_policy(self, batch_call, one_call, keys: list, tier: Tier, failed: list) -> None:
        """Under the lock: ``batch_call`` of a copied batch's keys (``_complete_copied``). If
        it raises (Ctrl-C, or a bug of a shipped policy: a plug-in's calls go through
        ``tiercache.guard`` and do not raise), the error is logged and kept in
        ``failed`` for the batch's owner, and ``one_call`` goes over the keys one at a time,
        each on its own, so that the policy ranks the blocks the table now holds on ``tier``
        as far as it can (its one-key calls ignore keys already done)."""
        try:
            batch_call(keys)
            return
        except BaseException as exc:  # noqa: BLE001 - delivered to the batch's owner
            failed.append(exc)
            log.error("tiercache: the %s eviction policy failed on a batch of %d blocks (%r); telling it "
                      "one block at a time", tier.label, len(keys), exc)
        for key in keys:
            try:
                one_call(key)
            except BaseException as exc:  # noqa: BLE001 - the same
                failed.append(exc)

    def _fail_piece(self, piece: list, exc: BaseException, work: "_Work") -> None:
        """Roll back the moves of a piece that will not be copied; their waiters get ``exc``."""
        errors = []
        for move in piece:
            try:
                errors.append(self._finish_move(move, 0.0, exc, False, chain=False, deliver=True))
            except BaseException as error:  # noqa: BLE001 - an interrupt between its steps
                errors.append(error)
        work.settle(len(piece), [e for e in errors if e is not None], self._lock)

    def _copy_run(self, run: list, parallel: bool = False, compute_event=None) -> Optional[float]:
        """CPU: copy a run of host<->device moves (from ``_slot_runs``)
        as one strided copy per pool; returns the seconds per move, or None if it failed.
        ``parallel``: torch copies with the intra-op threads (a caller alone, see
        ``_submit_all``), else numpy copies (one thread, no OpenMP region: a job's, or a
        helping caller's while other moves run). CUDA: moves of one direction, any slots,
        through one staging copy on the copy stream (``_host_device_copy``), one wait."""
        t0 = time.perf_counter()
        if self._staged_copies:
            try:
                self._device_copy(lambda nb: self._host_device_copy(run, nb), compute_event)
            except Exception:  # noqa: BLE001 - the caller does the run again block by block
                return None
            return (time.perf_counter() - t0) / len(run)
        _, _, host_k, host_v = self._byte_pools()
        first, last = run[0], run[-1]
        src = slice(first.src_slot, last.src_slot + 1)
        step = 1 if last.dst_slot >= first.dst_slot else -1
        end = last.dst_slot + step
        dst = slice(first.dst_slot, end if end >= 0 else None, step)
        try:
            if parallel and step == 1:
                dev = (self.device_pool.k, self.device_pool.v)
                for d, h in zip(dev, self.host_pool.kv_rows()):
                    if first.src is Tier.HOST:
                        d[:, dst].copy_(h[:, src])
                    else:
                        h[:, dst].copy_(d[:, src])
            elif first.src is Tier.HOST:
                self.device_pool.write_rows(dst, host_k[:, src], host_v[:, src])
            else:
                self.device_pool.read_rows(src, host_k[:, dst], host_v[:, dst])
        except Exception:  # noqa: BLE001 - the caller does the run again block by block
            return None
        return (time.perf_counter() - t0) / len(run)

    def _submit(self, move: Move, priority: Priority, chain: bool = False, blocking: bool = True) -> Future:
        """Start a prepared move (once) as a job of its own; returns its future."""
        with self._lock:
            future = self._future(move)  # a finished one if the move is done
            if move not in self._inflight or move in self._started:
                return future
            self._started.add(move)
        try:
            if move.dst is Tier.DISK and move.src is Tier.HOST and self.geometry.block_bytes >= _CRC_AHEAD_BYTES:
                with self._lock:  # a Ctrl-C in here is rolled back below, the CRC job cancelled with it
                    self._checksum_ahead(move)
            compute_event = self._compute_barrier() if Tier.DEVICE in (move.src, move.dst) else None
            job = lambda: self._run_move(move, compute_event, chain)  # noqa: E731
            inner = self.engine.submit(job, priority, blocking=blocking)
        except BaseException as exc:  # interrupted while waiting for room, or the engine closed
            with self._lock:
                self._roll_back(move)
            future.set_exception(exc)
            raise
        if inner is None:  # queue full and the caller cannot wait: roll the move back
            with self._lock:
                self._roll_back(move)
            future.set_result(None)
            return future
        inner.add_done_callback(lambda f: _relay(f, future))
        return future

    def _checksum_ahead(self, move: Move) -> None:
        """Under the lock: have ``move``'s payload CRC computed on a thread of its own, ahead
        of the I/O worker that writes it (``_payload_crc``). On the writing thread the CRC
        cost ~10% of the store's write rate (an I/O thread busy checksumming has no write
        in flight); computed ahead on another thread, 7% of it came back (session 25's
        ``wdisk4.py``); in ``bench io`` (8 runs side by side) the write ratio's median went
        from 0.883 to 0.907. Blocks under ``_CRC_AHEAD_BYTES`` are not worth a thread's hand-off
        (a 256 KiB CRC takes ~14 us). The host slot does not change while the move holds it."""
        if self._crc_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="tiercache-crc")
        future: Future = Future()
        self._crcs[move] = future
        try:
            self._crc_pool.submit(self._crc_job, move, future)
        except RuntimeError:  # shut down (closing): the writer computes it
            del self._crcs[move]

    def _crc_job(self, move: Move, future: Future) -> None:
        if not future.set_running_or_notify_cancel():  # the writer came first and computes it
            return
        try:
            future.set_result(self.disk.payload_crc(self.host_pool.raw(move.src_slot)))
        except BaseException as exc:  # noqa: BLE001 - the writer computes it again
            future.set_exception(exc)

    def _payload_crc(self, move: Move) -> Optional[int]:
        """The CRC computed ahead for ``move`` (waited for if under way), or None: not
        started yet (then never: the writer computes it), or none asked for."""
        future = self._crcs.pop(move, None)
        if future is None or future.cancel():
            return None
        try:
            return future.result()
        except Exception:  # noqa: BLE001
            return None

    def _run_move(self, move: Move, compute_event, chain: bool, deliver: bool = False) -> Optional[BaseException]:
        """Copy one move and finish it (``_finish_move``)."""
        t0 = time.perf_counter()
        error: Optional[BaseException] = None
        corrupted = False
        try:
            self._copy(move, compute_event)
        except RecordError as exc:
            corrupted = True
            self.events.integrity_error(move.src.label)
            error = BlockCorruptedError(f"block {move.key!r}: {move.src.label} record failed its integrity "
                                        f"check ({exc}); it is never returned as data")
        except BaseException as exc:  # noqa: BLE001 - rolled back, then re-raised to waiters
            error = exc
        return self._finish_move(move, time.perf_counter() - t0, error, corrupted, chain, deliver)

    def _finish_move(self, move: Move, seconds: float, error: Optional[BaseException], corrupted: bool,
                     chain: bool, deliver: bool = False) -> Optional[BaseException]:
        """After a move's copy: complete it in the table (or roll it back on ``error``), count
        it, start a write-behind it calls for, and raise ``error`` (``_submit``'s job: its
        future carries it to the waiters). With ``deliver`` (a batch's move), the waiters'
        future, if one was made, gets the outcome instead, and the error is returned."""
        waiter = None
        try:
            with self._lock:
                # out of the in-flight maps first: nothing below may leave the move there for good
                waiter = self._take_waiter(move)
                follow = self._complete(move, error, corrupted, chain)
            self._counted(move, seconds, error, corrupted, follow)
        except BaseException as exc:  # noqa: BLE001 - delivered below, or raised
            if not deliver:
                raise
            if waiter is not None:
                waiter.set_exception(exc)
            return exc
        if deliver and waiter is not None:
            waiter.set_result(None)
        return None

    def _complete(self, move: Move, error: Optional[BaseException], corrupted: bool, chain: bool) -> Optional[Move]:
        """Under the lock, once the move has left the in-flight maps (``_take_waiter``): the
        table part of ``_finish_move``; returns the write-behind move to start, if any."""
        follow = None
        evicted_down = bool(self._evicted_down) and move in self._evicted_down
        if evicted_down:
            self._evicted_down.discard(move)
        # The block may have been deleted while it moved, and its key given to a new block:
        # then the policy, the checksum's verdict and the write-behind concern the old one,
        # which only needs its copies freed.
        live = self.table.get(move.key) is move.entry
        for tier, slot in self.table.complete_move(move, error is None):  # a failed tombstone: held, logged
            self._released(move.key, tier, slot, rolled_back=error is not None and _reserved(move, tier, slot),
                           errors=[])
        if corrupted and live:
            self._discard(move.key, move.src)
        if error is None and live:
            self.policies[move.dst].insert(move.key)
            # A write-behind goes on down. So does an eviction's demotion: a block pushed
            # down with no copy below gets one while there is room, so that later it can
            # be dropped at once (a prefetch may only drop clean copies) instead of
            # holding its slot until something writes it out. (A demotion asked for, as
            # by demote_many, moves the block and nothing more.)
            if (chain or (evicted_down and self.write_behind_enabled)) and move.dst is not Tier.DISK:
                lower = self._lower(move.dst)
                copies = move.entry.copies
                if (lower is not None and lower not in copies and move.dst in copies
                        and self.table.num_free(lower) >= 1):
                    follow = self._prepare(move.key, move.dst, lower, drop_source=False)
        return follow

    def _counted(self, move: Move, seconds: float, error: Optional[BaseException], corrupted: bool,
                 follow: Optional[Move]) -> None:
        """Outside the lock: the events of a completed move, its write-behind, its error."""
        if error is None:
            self.events.move(move.src.label, move.dst.label, self.geometry.block_bytes, seconds)
        else:
            self.events.failed_move()
            if move.dst is Tier.DISK and isinstance(error, OSError):
                self._disk_write_error = error  # close() names it if blocks go unkept (``_lost_at_close``)
            if not corrupted:
                log.warning("tiercache: move %s %s->%s failed: %s", move.key, move.src.label, move.dst.label, error)
        if follow is not None:
            self._submit(follow, Priority.WRITEBACK, chain=True, blocking=False)
        if error is not None:
            raise error

    def _copy(self, move: Move, compute_event) -> None:
        src, dst = move.src, move.dst
        if src is Tier.DISK:
            if dst is Tier.HOST:
                self.disk.read(move.src_slot, move.key, self.host_pool.raw(move.dst_slot))
            else:
                with self._staging.take() as buf:
                    self.disk.read(move.src_slot, move.key, buf)
                    self._to_device_slot(move.dst_slot, buf, compute_event)
        elif dst is Tier.DISK:
            # The block's tokens, then whether it is still the block this move writes: one
            # deleted meanwhile wrote a record with 0 tokens, or with the token ids of a new
            # block under its key, which a crash before the move completed left on disk (the
            # completion frees the slot: nothing is written for a block that is gone).
            tokens, token_ids = self._tokens.get(move.key, 0), self._token_ids.get(move.key, b"")
            crc = self._payload_crc(move) if src is Tier.HOST else None  # taken either way: not left behind
            if self.table.get(move.key) is not move.entry:
                return
            if src is Tier.HOST:
                self.disk.write(move.dst_slot, move.key, self.host_pool.raw(move.src_slot), tokens, token_ids, crc=crc)
            else:
                with self._staging.take() as buf:
                    self._from_device_slot(move.src_slot, buf, compute_event)
                    self.disk.write(move.dst_slot, move.key, buf, tokens, token_ids)
        elif self._staged_copies:
            self._device_copy(lambda nb: self._host_device_copy([move], nb), compute_event)
        elif not self._cuda:  # device and host are both RAM: plain memcpys of byte rows
            _, _, host_k, host_v = self._byte_pools()
            if src is Tier.HOST and dst is Tier.DEVICE:
                self.device_pool.write_rows(move.dst_slot, host_k[:, move.src_slot], host_v[:, move.src_slot])
            elif src is Tier.DEVICE and dst is Tier.HOST:
                self.device_pool.read_rows(move.src_slot, host_k[:, move.dst_slot], host_v[:, move.dst_slot])
            else:  # pragma: no cover - the store never plans other moves
                raise RuntimeError(f"unsupported move {src.label}->{dst.label}")
        else:  # pragma: no cover - the store never plans other moves
            raise RuntimeError(f"unsupported move {src.label}->{dst.label}")

    def _host_device_copy(self, moves: list, non_blocking: bool) -> None:
        """Host<->device moves of one direction, any slots, through a staging tensor on the
        device laid out as the host slots: fetches copy each run of adjacent host slots up
        as it is, then scatter the blocks into their device slots with one kernel per pool;
        demotions gather, then copy each run down. On CUDA that is a few large copies and
        kernels for the lot, where a plain ``copy_`` into a device slot (strided: K and V
        rows lie apart) costs a temporary, a copy and a kernel for each of K and V of each
        block, which kept batches at 0.1-0.3 of the copy rate on an H200. The staging
        tensor is one of ``_device_lease``'s buffers."""
        fetch = moves[0].dst is Tier.DEVICE
        pairs = sorted((m.src_slot, m.dst_slot) if fetch else (m.dst_slot, m.src_slot) for m in moves)
        unit = self.host_pool.slot_bytes
        device_slots = [d for _, d in pairs]
        with self._device_lease() as buf:
            staged, scratch = buf[:len(pairs) * unit], buf[self._staging_bytes:]
            if not fetch:
                self.device_pool.read_staged(device_slots, staged, unit, scratch)
            host = self.host_pool.buffer
            i = 0
            while i < len(pairs):  # runs of adjacent host slots
                j = i + 1
                while j < len(pairs) and pairs[j][0] == pairs[j - 1][0] + 1:
                    j += 1
                first = pairs[i][0]
                near, far = staged[i * unit:j * unit], host[first * unit:(first + j - i) * unit]
                if fetch:
                    near.copy_(far, non_blocking=non_blocking)
                else:
                    far.copy_(near, non_blocking=non_blocking)
                i = j
            if fetch:
                self.device_pool.write_staged(device_slots, staged, unit)

    def _device_lease(self) -> "_Lease":
        """A staging buffer on the device for ``_host_device_copy``: room for the largest
        piece (``_CUDA_PIECE_BYTES`` of blocks, or the device tier's slots if fewer, laid out
        as host slots) plus scratch for gathering a quarter of them (K or V) at a time.
        ``_CUDA_JOBS`` of them, made on first use, outside ``device_budget``: at most
        2 x 80 MiB at the default block size. A thread that finds none free waits; a
        buffer goes back as soon as its copies are queued, since everything that uses
        these buffers runs on the copy stream, in order. (torch's caching allocator would
        keep every size any thread ever asked for reserved for the copy stream.)"""
        if self._device_staging is None:
            with self._lock:
                if self._device_staging is None:
                    g = self.geometry
                    blocks = max(1, min(_CUDA_PIECE_BYTES // g.block_bytes, self.device_pool.num_slots))
                    plane = g.block_bytes // 2  # K (or V) of one block
                    self._staging_bytes = blocks * g.padded_bytes
                    scratch = -(-blocks // _GATHER_SPLIT) * plane
                    with torch.inference_mode(False):  # as the pools: written outside it too
                        self._device_staging = _BufferPool(self._staging_bytes + scratch, _CUDA_JOBS,
                                                           device=self.device)
        return self._device_staging.take()

    def _to_device_slot(self, slot: int, buf: torch.Tensor, compute_event) -> None:
        """Copy a block from ``buf`` (uint8, laid out as a host slot) into a device slot."""
        def copy(non_blocking: bool) -> None:
            if self._staged_copies:
                with self._device_lease() as staging:
                    staged = staging[:buf.numel()]
                    staged.copy_(buf, non_blocking=non_blocking)
                    self.device_pool.write_staged([slot], staged, buf.numel())
            else:
                self.device_pool.write_block(slot, self._as_block(buf), non_blocking=non_blocking)
        self._device_copy(copy, compute_event)

    def _from_device_slot(self, slot: int, buf: torch.Tensor, compute_event) -> None:
        """The reverse of ``_to_device_slot``."""
        def copy(non_blocking: bool) -> None:
            if self._staged_copies:
                with self._device_lease() as staging:
                    staged = staging[:buf.numel()]
                    self.device_pool.read_staged([slot], staged, buf.numel())
                    buf.copy_(staged, non_blocking=non_blocking)
            else:
                self.device_pool.read_block(slot, self._as_block(buf), non_blocking=non_blocking)
        self._device_copy(copy, compute_event)

    def _device_copy(self, copy, compute_event) -> None:
        """Run ``copy(non_blocking)``; on CUDA on the copy stream, after the compute work that
        was queued when the move was submitted (it may still read the slot), and wait for it.
        The wait happens whatever ``copy`` raises (Ctrl-C half way through a batch): a move
        rolled back frees its slots, and no copy queued into them may still be pending."""
        if not self._cuda:
            copy(False)
            return
        try:
            with torch.cuda.stream(self._copy_stream):
                if compute_event is not None:
                    self._copy_stream.wait_event(compute_event)
                copy(True)
        finally:
            done = torch.cuda.Event()
            done.record(self._copy_stream)
            done.synchronize()

    def _read_disk(self, key: Hashable, slot: int, buf: torch.Tensor) -> None:
        """Read and verify a disk record outside a move; a bad one is counted and named."""
        try:
            self.disk.read(slot, key, buf)
        except RecordError as exc:
            self.events.integrity_error("disk")
            raise BlockCorruptedError(f"block {key!r}: disk record failed its integrity check ({exc})") from None

    def _as_block(self, buf: torch.Tensor) -> torch.Tensor:
        g = self.geometry
        return buf[:g.block_bytes].view(g.dtype).view(g.shape)


_END = sys.maxsize  # lst[_END:] = [x] appends, in a statement with no call (where a signal's exception lands)
_LOST_KEPT = 4096  # blocks lost to failed checks whose reason a later read can still name


def _copy_tokens(copy, dst, src, lo: int, hi: int, block_tokens: int, unit: int) -> None:
    """Copy tokens [lo, hi) of a run of blocks, ``src`` to ``dst`` ([rows, blocks, T*unit]
    each, torch or numpy): whole blocks in one copy, a partly read first or last block alone."""
    if hi <= lo:
        return
    first, last = lo // block_tokens, (hi - 1) // block_tokens
    a, b = (lo - first * block_tokens) * unit, (hi - last * block_tokens) * unit
    if first == last:
        copy(dst[:, first, a:b], src[:, first, a:b])
        return
    whole_from, whole_to = first + (a > 0), last + 1 - (b < block_tokens * unit)
    if a > 0:
        copy(dst[:, first, a:], src[:, first, a:])
    if whole_to > whole_from:
        copy(dst[:, whole_from:whole_to], src[:, whole_from:whole_to])
    if b < block_tokens * unit:
        copy(dst[:, last, :b], src[:, last, :b])


def _record_group(key: Hashable) -> Hashable:
    """The group a saved block belongs to when a smaller budget keeps whole groups
    (``BlockStore._fit_to_budget``): (sequence, block index) of a block key, whose
    layers are of use together; any other key is a group of its own."""
    if isinstance(key, tuple) and len(key) == 3:
        return key[0], key[2]
    return (key,)


def _pieces(runs: list, most: int) -> list:
    """``runs`` cut into pieces of at most ``most`` moves."""
    return [run[i:i + most] for run in runs for i in range(0, len(run), most)]


def _touches_device(move: Move) -> bool:
    """A move to or from the device: counted in ``BlockStore._copying``."""
    return move.src is Tier.DEVICE or move.dst is Tier.DEVICE


def _slot_runs(todo: list) -> list:
    """Moves, sorted by source slot and cut into runs that one copy can do: the same
    direction, source slots adjacent, destination slots adjacent in one direction (moves
    are planned so that they line up ascending; a run downwards is one copy too)."""
    order = sorted(todo, key=_RUN_ORDER)
    n = len(order)
    if n > 1:  # the usual batch, planned in source order: one run, found without a step per move
        first, last = order[0], order[-1]
        if (first.src is last.src and first.dst is last.dst and last.src_slot - first.src_slot == n - 1
                and list(map(_DST_SLOT, order)) == list(range(first.dst_slot, first.dst_slot + n))):
            return [order]  # sorted by tiers: all of one direction; distinct source slots n - 1 apart: adjacent
    runs: list = []
    for move in order:
        if runs:
            run = runs[-1]
            prev = run[-1]
            step = move.dst_slot - prev.dst_slot
            if (move.src is prev.src and move.dst is prev.dst and move.src_slot == prev.src_slot + 1
                    and step in (1, -1) and (len(run) == 1 or step == prev.dst_slot - run[-2].dst_slot)):
                run.append(move)
                continue
        runs.append([move])
    return runs


def _segments(held: list, at: Optional[list]) -> list:
    """``held`` cut where its positions ``at`` (increasing; None: 0, 1, ...) skip:
    [(first position, the held copies at it and after, one position apart)]."""
    if at is None:
        return [(0, held)] if held else []
    out, start = [], 0
    for i in range(1, len(held) + 1):
        if i == len(held) or at[i] != at[i - 1] + 1:
            out.append((at[start], held[start:i]))
            start = i
    return out


def _runs(held: list, strided: bool = False):
    """Walk held copies ([(entry, copy)], in order) as (on_device, first slot, count, step),
    a run covering slots ``first, first + step, ...`` of one tier. Without ``strided``: one
    per run of adjacent device slots (step 1), one per host block. With it, any blocks of
    one tier whose slots go up by one step make a run (one strided copy): a prefill writes
    a block of every layer in turn, so a layer's blocks often lie ``num_layers`` slots apart."""
    on_device = [copy is entry.copies.get(Tier.DEVICE) for entry, copy in held]
    slots = [copy.slot for _, copy in held]
    i, n = 0, len(held)
    while i < n:
        j, step = i + 1, 1
        if on_device[i] or strided:
            if strided and j < n and on_device[j] == on_device[i] and slots[j] > slots[i]:
                step = slots[j] - slots[i]
            while j < n and on_device[j] == on_device[i] and slots[j] == slots[i] + (j - i) * step:
                j += 1
        yield on_device[i], slots[i], j - i, step
        i = j


def _reserved(move: Move, tier: Tier, slot: int) -> bool:
    """Whether ``(tier, slot)`` is the destination ``move`` reserved."""
    return tier is move.dst and slot == move.dst_slot


def _relay(inner: Future, outer: Future) -> None:
    exc = inner.exception()
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(inner.result())


def _byte_planes(out: torch.Tensor) -> Optional[list]:
    """Writable byte memoryviews of the [T, D] planes of ``out`` ([2, B, H, T, D]) in the
    order of a contiguous block, or None when a plane is not contiguous."""
    t_dim, d_dim = out.shape[-2], out.shape[-1]
    if out.stride(-1) != 1 or (t_dim > 1 and out.stride(-2) != d_dim):
        return None
    storage = out.untyped_storage()
    flat = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
    size = out.element_size()
    base = out.storage_offset() * size
    plane = t_dim * d_dim * size
    s0, s1, s2 = (s * size for s in out.stride()[:3])
    return [flat[base + a * s0 + b * s1 + h * s2:base + a * s0 + b * s1 + h * s2 + plane]
            for a in range(out.shape[0]) for b in range(out.shape[1]) for h in range(out.shape[2])]


_DONE: Optional[Future] = None
_GONE = object()  # _future: a move no longer in flight


def _done() -> Future:
    """A finished future with result None, one for all: a finished future cannot change
    (``set_result`` raises, ``cancel`` returns False, a callback added runs at once), and
    each new Future costs a ``threading.Condition`` (a third of the store's Python time
    per move in a profile of 400-block batches that only dropped copies)."""
    global _DONE
    if _DONE is None:
        done: Future = Future()
        done.set_result(None)
        _DONE = done
    return _DONE


def _done_future(fn) -> Future:
    f: Future = Future()
    try:
        f.set_result(fn())
    except BaseException as exc:  # noqa: BLE001
        f.set_exception(exc)
    return f


class _Work(collections.deque):
    """A batch's copy pieces, shared by the jobs and helping threads (``_submit_all``):
    ``total`` pieces for ``moves`` moves; ``parallel`` while one thread copies them all
    with torch's intra-op threads; ``compute_event``: on CUDA, what the copies wait for
    (``_compute_barrier`` when the batch started). Every piece taken off it is settled
    once (``settle``), copied or rolled back; ``wait`` returns once all moves are, and
    ``errors`` holds the failed moves' exceptions.

    The latch is a plain lock, held from the start until the last move is settled. A
    ``threading.Event`` is a Condition, its lock and Python code to make, set and wait on:
    set and waited on, plus an RLock round trip, it took 34 µs right after a 64 MiB copy
    against 3.8 warm (a probe), and on CPU every batch's books run cold after such copies
    (``tiercache bench overhead``)."""

    compute_event = None
    parallel = False
    total = 0

    def __init__(self, pieces: list, moves: int) -> None:
        super().__init__(pieces)
        self.moves = moves
        self.pending = moves
        self.errors: list = []
        self._latch = threading.Lock()
        self._open = not moves
        if moves:
            self._latch.acquire()

    def settle(self, num_moves: int, errors: list, lock) -> None:
        """``num_moves`` moves of the batch are done (``errors`` for those that failed)."""
        with lock:
            self.errors.extend(errors)
            self.pending -= num_moves
            if self.pending <= 0 and not self._open:
                self._open = True
                self._latch.release()

    def wait(self) -> None:
        """Block until every move of the batch is settled."""
        with self._latch:  # each waiter takes the open latch and hands it on
            pass


class _ReadsGate(Future):
    """``_quiet``'s hold on new reads: done when the reorder is. Never cancelled: it is
    shared by every read waiting on it (an asyncio task's cancellation of one,
    through ``asyncio.wrap_future``, would cancel it for all)."""

    def cancel(self) -> bool:
        return False


class _MoveFuture(Future):
    """A move's future, made when someone waits on the move (``BlockStore._future``). For
    a copy started with others (``_submit_all``), ``pieces`` is (store, the batch's shared
    pieces): a thread that waits for the result without a timeout copies pieces on its own
    thread first, instead of sleeping until a worker the scheduler wakes late (0.7-1 ms on
    two busy cores) gets to them."""

    pieces: Optional[tuple] = None

    def cancel(self) -> bool:
        """A move is not called off: its future is shared by everyone waiting on it (a
        ``flush``, another caller). Cancelled (an asyncio task's cancellation does that
        through ``AsyncStore``), it logged an ``InvalidStateError`` when the move ended and
        let a ``flush`` return before the disk copy existed (2 trials of 5, a helper's)."""
        return False

    def result(self, timeout: Optional[float] = None):
        self._help(timeout)
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None):
        self._help(timeout)
        return super().exception(timeout)

    def _help(self, timeout: Optional[float]) -> None:
        pieces = self.pieces
        if pieces is not None and timeout is None and not self.done():
            store, work = pieces
            store._help_until(self, work)


class _BufferPool:
    """Pre-allocated staging buffers (no allocation per call): page-aligned host memory for
    disk I/O, or device memory (``device``: CUDA's host<->device copies)."""

    def __init__(self, num_bytes: int, count: int, pin: bool = False, device: Optional[torch.device] = None) -> None:
        self._free = []
        self._owners = []
        for _ in range(count):
            if device is not None and device.type != "cpu":
                tensor, mm = torch.empty(num_bytes, dtype=torch.uint8, device=device), None
            else:
                tensor, mm = aligned_buffer(num_bytes)
                if pin and not pin_in_place(tensor):  # the host pool's fallback: pageable, said once
                    pin = False
            self._free.append(tensor)
            self._owners.append(mm)
        self._cond = threading.Condition()

    def close(self) -> None:
        """Unpin and let go of the buffers (those taken are the takers' until released)."""
        for tensor in self._free:
            unpin_in_place(tensor)
        self._free = []
        self._owners = []

    def take(self) -> "_Lease":
        return _Lease(self)

    def _acquire(self) -> torch.Tensor:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def _release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class _Lease:
    def __init__(self, pool: _BufferPool) -> None:
        self._pool = pool
        self._buf = None

    def __enter__(self) -> torch.Tensor:
        self._buf = self._pool._acquire()
        return self._buf

    def __exit__(self, *exc) -> None:
        self._pool._release(self._buf)
