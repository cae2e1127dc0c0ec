"""CPU: a layer's disk blocks read straight into attention's buffer, past the host tier.

On CPU the device and host tiers are the same memory, and ``BlockStore.read_layer`` gathers
a layer's blocks from wherever they lie into one K and one V. A block that was only on disk
used to be read up into a host slot first and then copied into that buffer. That cost
twice: the host slot it took evicted a block the next decode step reads again (the host
tier became a queue of blocks passing through instead of a set of blocks kept), and the
gather copied its bytes once more. Here such a block is read from its disk record straight
into its place in the buffer, on the I/O threads, and checked there (CRC32C) before it
counts as read; the device and host tiers keep what they hold. The layer the prefetch plan
names next (``ahead``) is read the same way into a second buffer while this one's attention
runs, so the result of a ``read_layer(hold=True)`` is valid until the next one, as before.

What it costs: a second buffer of one layer's K and V (outside the budgets, as the one
gather buffer was). A block is in flight here only while its record is read: the read holds
its disk copy (a reader, so the slot is not freed or reused) and lets go when it finishes;
anyone waiting on the block (``_inflight_for``) waits for that read. Bytes read into a
buffer are used only if, when the layer is read, the same disk copy of the same block is
still the block's (a write drops the disk copy first; ``reorder_rows``, which rewrites
records in place, settles every read and uses none), at the position the read expects. A
read that failed (a record that fails its check, an I/O error) is not used: the block is
read again the usual way, through the host tier, which drops a bad record and takes another
copy, or names the problem (``BlockCorruptedError``, ``TierIOError``).

These reads are counted as ``disk->device`` moves: the buffer is the model's device memory.
``attend_in_place`` (``BlockStore.read_segments``) still reads disk blocks up to the host.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Hashable, Optional, Sequence

import torch

from tiercache.disk import RecordError
from tiercache.table import CopyState, Tier
from tiercache.tiers import aligned_buffer
from tiercache.transfer import Priority, wait_all

if TYPE_CHECKING:
    from tiercache.store import BlockStore

log = logging.getLogger("tiercache")

CHUNK = 1  # records per I/O job: a layer's reads spread over the I/O threads

_QUEUED, _RUNNING, _LET_GO = 0, 1, 2  # a read's hold on its disk copy


class _Read:
    """One disk block read into one buffer position."""

    __slots__ = ("key", "entry", "copy", "done", "state", "error")

    def __init__(self, key: Hashable, entry, copy, done: Future) -> None:
        self.key = key
        self.entry = entry
        self.copy = copy  # the disk copy read (a reader is held on it until ``state`` is _LET_GO)
        self.done = done  # the read's job's own future: set once the copy is let go
        self.state = _QUEUED
        self.error: Optional[BaseException] = None  # None: the bytes are in place and checked


class _Group:
    """The reads into one buffer for one layer read: position -> _Read."""

    __slots__ = ("buf", "keys", "reads")

    def __init__(self, buf: int, keys: list) -> None:
        self.buf = buf
        self.keys = keys  # the key planned at each position
        self.reads: dict = {}


class DiskStreams:
    """The two buffers and the reads into them, for a CPU store with host and disk tiers.
    Used by the model's thread only (``read_layer`` is called by one thread at a time)."""

    def __init__(self, store: "BlockStore") -> None:
        self.store = store
        g = store.geometry
        self._rows, self._width = g.batch * g.kv_heads, g.block_tokens * g.head_dim
        self._bufs: list = [None, None]  # per buffer: ((K, V) each [rows, capacity, width], mmap owner)
        self._busy: list = [[], []]  # per buffer: futures of reads that may still write into it
        self._last = 1  # the buffer the last result lies in
        self._pending: Optional[_Group] = None  # the reads of the prefetch plan's layer
        self._read_buf = 0  # the buffer the read running now fills

    def _settle(self, b: int) -> float:
        """Wait for every read still writing into buffer ``b``; returns the seconds waited."""
        busy = self._busy[b]
        t0 = time.perf_counter()
        for future in busy:
            future.exception()  # waits; a read's own failure is in its ``error``
        self._busy[b] = []  # only now: after an interrupt above, the next call waits again
        return time.perf_counter() - t0 if busy else 0.0

    def _buffer(self, b: int, blocks: int) -> tuple:
        """K and V of buffer ``b`` ([rows, capacity, width]), at least ``blocks`` wide (settled
        first). Page-aligned planes: direct I/O reads into them."""
        have = self._bufs[b]
        if have is None or have[0][0].shape[1] < blocks:
            self._settle(b)
            g = self.store.geometry
            capacity = blocks + blocks // 4 + 1
            raw, owner = aligned_buffer(2 * self._rows * capacity * self._width * g.itemsize)
            with torch.inference_mode(False):
                flat = raw.view(g.dtype).view(2, self._rows, capacity, self._width)
            have = self._bufs[b] = ((flat[0], flat[1]), owner)
        return have[0]

    def forget(self) -> None:
        """Before blocks' disk records change in place (``reorder_rows``): no read in flight,
        and nothing read so far is used."""
        for b in (0, 1):
            self._settle(b)
        if self._pending is not None:
            unused = len(self._pending.reads)
            self._pending = None
            if unused:
                self.store.events.prefetch("unused", unused)

    def close(self) -> None:
        """After the store's I/O threads have stopped (every queued read has run)."""
        self._bufs = [None, None]
        self._busy = [[], []]
        self._pending = None

    # ---- reads ------------------------------------------------------------------------------
    def _hold_disk_only(self, key: Hashable) -> Optional[tuple]:
        """Under the lock: (entry, disk copy) with a reader taken, if ``key``'s only copy is
        READY on disk (none in memory, READY or filling); else None."""
        entry = self.store.table.get(key)
        if entry is None:
            return None
        copies = entry.copies
        if Tier.DEVICE in copies or Tier.HOST in copies:
            return None
        disk = copies.get(Tier.DISK)
        if disk is None or disk.state is not CopyState.READY:
            return None
        disk.readers += 1
        return entry, disk

    def _start(self, group: _Group, todo: list, priority: Priority) -> None:
        """Queue reads of ``todo`` ([(position, key, entry, disk copy)], readers taken) into
        the group's buffer, ``CHUNK`` records per job."""
        if not todo:
            return
        store = self.store
        k, v = self._bufs[group.buf][0]
        chunks = []
        with store._lock:
            for j in range(0, len(todo), CHUNK):
                done: Future = Future()
                chunk = []
                for pos, key, entry, copy in todo[j:j + CHUNK]:
                    read = group.reads[pos] = _Read(key, entry, copy, done)
                    store._streaming[key] = done  # a waiter on the block waits for its read
                    chunk.append((pos, read))
                chunks.append((chunk, done))
        for i, (chunk, done) in enumerate(chunks):
            try:
                store.engine.submit(lambda c=chunk, f=done: self._job(k, v, c, f), priority)
            except BaseException:  # interrupted or closing: reads that did not start let go
                with store._lock:
                    for rest, _ in chunks[i:]:
                        for _, read in rest:
                            if read.state is _QUEUED:
                                read.error = RuntimeError("not read")
                                self._let_go(read)
                for _, rest_done in chunks[i:]:
                    _finish(rest_done)
                raise
            self._busy[group.buf].append(done)

    def _let_go(self, read: _Read) -> None:
        """Under the lock: the read holds its disk copy no more."""
        store = self.store
        read.state = _LET_GO
        read.copy.readers -= 1
        if store._streaming.get(read.key) is read.done:
            del store._streaming[read.key]
        if read.entry.deleted:
            for t, slot in store.table._collect(read.entry):
                store._released(read.key, t, slot)

    @torch.inference_mode()
    def _job(self, k: torch.Tensor, v: torch.Tensor, chunk: list, done: Future) -> None:
        """On an I/O thread: read each record of ``chunk`` into its position and check it,
        then let go of the disk copies (under the store's lock) before ``done`` is set."""
        store = self.store
        mine: list = []
        read_ok = 0
        t0 = time.perf_counter()
        try:
            with store._lock:
                for pos, read in chunk:
                    if read.state is _QUEUED:
                        read.state = _RUNNING
                        mine.append((pos, read))
            for pos, read in mine:
                try:
                    store.disk.read_into(read.copy.slot, read.key, self._planes(k, v, pos))
                    read_ok += 1
                except Exception as exc:  # noqa: BLE001 - the reader reads this block the usual way
                    read.error = exc
                    if not isinstance(exc, (RecordError, OSError)):
                        log.warning("tiercache: reading block %r into attention's buffer failed (%r); it is "
                                    "read through the host tier instead", read.key, exc)
        finally:
            with store._lock:
                for _, read in mine:
                    self._let_go(read)
            _finish(done)
        if read_ok:
            store.events.move("disk", "device", store.geometry.block_bytes,
                              (time.perf_counter() - t0) / len(mine), blocks=read_ok)

    def _planes(self, k: torch.Tensor, v: torch.Tensor, pos: int) -> list:
        """Byte views of position ``pos``'s [T*D] planes, K rows then V rows: a record's payload order."""
        return [memoryview(t[r, pos].view(torch.uint8).numpy()) for t in (k, v) for r in range(self._rows)]

    def _plan_ahead(self, keys: list, ahead: Sequence[Hashable]) -> None:
        """Read the planned next layer's disk-only blocks into the other buffer (``_pending``);
        the rest of the plan is prefetched to the host as before."""
        store = self.store
        layer = getattr(ahead[0], "layer", None) if ahead else None
        group_keys: list = []
        if layer is not None:
            for key in ahead:
                if getattr(key, "layer", None) != layer:
                    break
                group_keys.append(key)
        rest = [key for key in ahead[len(group_keys):]]
        if group_keys:
            mine = set(keys)
            b = 1 - self._read_buf
            self._settle(b)
            self._buffer(b, len(group_keys))
            group = _Group(b, group_keys)
            todo = []
            with store._lock:
                for pos, key in enumerate(group_keys):
                    if key in mine:
                        continue
                    held = self._hold_disk_only(key)
                    if held is not None:
                        todo.append((pos, key, *held))
            self._pending = group
            self._start(group, todo, Priority.PREFETCH)
        if rest:
            store._prefetch_ahead(rest, set(keys), Tier.HOST)

    def read(self, keys: list, num_tokens: int, start_token: int, ahead: Sequence[Hashable]) -> tuple:
        """``BlockStore.read_layer(keys, num_tokens, start_token, hold=True, ahead=ahead)``
        on a CPU store with host and disk tiers (the caller has let go of the last views)."""
        store = self.store
        bt = store.geometry.block_tokens
        pending, self._pending = self._pending, None
        b = self._read_buf = pending.buf if pending is not None else 1 - self._last
        # Was each prefetched read done before this read wanted it (a prefetch "used"), or not ("late")?
        early = {p for p, r in pending.reads.items() if r.done.done()} if pending is not None else set()
        self._plan_ahead(keys, ahead)  # the next layer's reads go first, into the other buffer
        stall = self._settle(b)  # this layer's prefetched reads
        # The prefetch read the planned keys into positions 0, 1, ...; a read that starts
        # later in that list (a sliding window) takes its positions from there.
        base, usable = 0, {}
        if pending is not None and keys and keys[0] in pending.keys:
            base = pending.keys.index(keys[0])
            usable = pending.reads
        have = self._bufs[b]
        if have is None or have[0][0].shape[1] < base + len(keys):
            base, usable = 0, {}  # the buffer grows: what was read into it is gone
        k_buf, v_buf = self._buffer(b, base + len(keys))
        group = _Group(b, [None] * base + list(keys))
        used: dict = {}  # position -> _Read whose bytes this read takes
        todo: list = []  # [(position, key, entry, disk copy)] to read now
        memory: list = []  # indices into ``keys`` read from the device and host tiers
        with store._lock:
            get = store.table.get
            for j, key in enumerate(keys):
                p = base + j
                read = usable.get(p)
                if read is not None and read.error is None and read.key == key:
                    entry = get(key)
                    # the same disk copy still the block's: a write would have dropped it first
                    if entry is read.entry and entry.copies.get(Tier.DISK) is read.copy:
                        used[p] = read
                        continue
                held = self._hold_disk_only(key)
                if held is None:
                    memory.append(j)
                else:
                    todo.append((p, key, *held))
        self._start(group, todo, Priority.DEMAND)
        if pending is not None:
            unused = sum(1 for p, r in pending.reads.items() if used.get(p) is not r)
            if unused:
                store.events.prefetch("unused", unused)
            prefetched = [p for p, r in used.items() if pending.reads.get(p) is r]
            if prefetched:
                late = sum(1 for p in prefetched if p not in early)
                if late:
                    store.events.prefetch("late", late)
                if len(prefetched) > late:
                    store.events.prefetch("used", len(prefetched) - late)
        held: list = []
        try:
            held = store._hold_in_memory([keys[j] for j in memory])
            if not used and not todo and held and store._views_of(held):  # all on the device, in order
                store._stalled(stall)
                self._last = b
                k, v = store.device_pool.view(held[0][1].slot, len(held), num_tokens, start_token)
                held = []  # held for the views, until release_views
                return k, v
            stall += self._settle(b)  # this layer's own reads
            store._stalled(stall)
            used.update(group.reads)
            again = self._check(used, base)
            if again:  # read the usual way: through the host tier, where errors are named
                more = store._hold_in_memory([keys[j] for j in again])
                by_index = dict(zip(memory, held))
                by_index.update(zip(again, more))
                memory = sorted(by_index)
                held = [by_index[j] for j in memory]
            t0 = time.perf_counter()
            k, v = store._gather_mixed(held, num_tokens, base * bt + start_token, into=(k_buf, v_buf),
                                       at=[base + j for j in memory])
            store._count_gather(len(held) * store.geometry.block_bytes, t0)
        finally:
            store._let_go(held)
        self._last = b
        return k, v

    def _check(self, used: dict, base: int) -> list:
        """The reads of ``used`` have finished: count those that read their block (a disk
        hit, a use for the disk's policy); return the indices into the layer's keys of the
        others (an I/O error, a record that failed its check), to read the usual way, which
        drops a bad record, takes another copy, or raises ``BlockCorruptedError`` or
        ``TierIOError`` naming the problem."""
        store = self.store
        again, good = [], []
        for p, read in used.items():
            if read.error is not None:
                again.append(p - base)
            else:
                good.append(read.key)
        if good:
            with store._lock:
                store.events.hit(Tier.DISK.label, len(good))
                store.policies[Tier.DISK].touch_many(good)  # a read is a use
        return sorted(again)


def _finish(done: Future) -> None:
    """Set ``done`` once (a read's job and an interrupted submit may both get here)."""
    try:
        done.set_result(None)
    except Exception:  # noqa: BLE001 - InvalidStateError: already set
        pass
