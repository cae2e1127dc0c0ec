"""CPU: a layer's disk blocks read straight into attention's buffer, past the host tier.

On CPU the device and host tiers are the same memory, and ``BlockStore.read_layer`` gathers
a layer's blocks from wherever they lie into one K and one V. A block that was only on disk
used to be read up into a host slot first and then copied into that buffer. That cost
twice: the host slot it took evicted a block the next decode step reads again (the host
tier became a queue of blocks passing through instead of a set of blocks kept), and the
gather copied its bytes once more. Here such a block is read from its disk record straight
into its place in the buffer, on the I/O threads; the device and host tiers keep what they
hold. The layers the prefetch plan names next (``ahead``: ``next-layer`` one, ``lookahead``
its depth, at most ``MAX_LAYERS_AHEAD``) are read the same way, each into a buffer of its
own, while this one's attention runs, so the result of a ``read_layer(hold=True)`` is valid
until the next one, as before; the layers past ``MAX_LAYERS_AHEAD`` are prefetched to the
host tier.

Each block's payload is checked (CRC32C, against its record's header) when its layer is
read, on the model's thread, over the bytes where they lie in the buffer, before any of
them is used. The I/O threads only read: on a machine with few cores their checksums
preempted the model's OpenMP threads, and a parallel region waits for its slowest thread
(docs/measurements.md, 2026-12-06, the twenty-third session). Checked here, the bytes are
also in the cache when attention reads them.

What it costs: a buffer of one layer's K and V per layer read ahead (outside the budgets,
as the one gather buffer was). A block is in flight here only while its record is read: the
read holds its disk copy (a reader, so the slot is not freed or reused) and lets go when it
finishes; anyone waiting on the block (``_inflight_for``) waits for that read. Bytes read into a
buffer are used only if, when the layer is read, the same disk copy of the same block is
still the block's (a write drops the disk copy first; ``reorder_rows``, which rewrites
records in place, settles every read and uses none), at the position the read expects. A
read that failed (a record whose header or payload fails its check, an I/O error) is not
used: the block is read again the usual way, through the host tier, which drops a bad record
and takes another copy, or names the problem (``BlockCorruptedError``, ``TierIOError``).

These reads are counted as ``disk->device`` moves: the buffer is the model's device memory.
``attend_in_place`` (``BlockStore.read_segments``) reads the same way, and attends to the
disk blocks in the buffer and to the others where they lie (no gather).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Hashable, Optional, Sequence

import torch

from tiercache.disk import RecordError, aligned_parts, parts_crc
from tiercache.table import BlockKey, CopyState, Tier
from tiercache.tiers import aligned_buffer
from tiercache.transfer import Priority

if TYPE_CHECKING:
    from tiercache.store import BlockStore

log = logging.getLogger("tiercache")

_QUEUED, _RUNNING, _LET_GO = 0, 1, 2  # a read's hold on its disk copy
MAX_LAYERS_AHEAD = 3  # layers of a plan read into buffers of their own; the rest go to the host


class _Read:
    """One disk block read into one buffer position."""

    __slots__ = ("key", "entry", "copy", "done", "state", "held", "error", "crc")

    def __init__(self, key: Hashable, entry, copy) -> None:
        self.key = key
        self.entry = entry
        self.copy = copy  # the disk copy read (a reader is held on it while ``held``)
        self.done: Future = Future()  # set once the read has let go of the copy
        self.state = _QUEUED
        self.held = False
        self.error: Optional[BaseException] = None  # None: the bytes are in place (checked by ``_check``)
        self.crc = 0  # the payload's CRC32C, from the record's header


class _Group:
    """The reads into one buffer, for one layer: position -> _Read. A block's position is
    its index in the layer less ``first``, the lowest index the plan named (a layer is read
    as a run of consecutive indices, so a read starting at index i takes its blocks from
    position i - first on)."""

    __slots__ = ("buf", "seq_layer", "first", "reads")

    def __init__(self, buf: int, seq_layer: tuple, first: int) -> None:
        self.buf = buf
        self.seq_layer = seq_layer
        self.first = first
        self.reads: dict = {}


def _where(key: Hashable) -> Optional[tuple]:
    """((seq_id, layer), index) of a ``BlockKey``, else None (not streamed: prefetched as before)."""
    return ((key[0], key[1]), key[2]) if isinstance(key, BlockKey) else None


def _uninterrupted(step) -> None:
    from tiercache.store import _uninterrupted as run  # store imports this module

    run(step)


class DiskStreams:
    """The buffers and the reads into them, for a CPU store with host and disk tiers: one
    for the layer read now, one per layer read ahead. Used by the model's thread only
    (``read_layer(hold=True)``, whose result is valid until the next such call, is one
    caller's at a time, as it was)."""

    def __init__(self, store: "BlockStore") -> None:
        self.store = store
        g = store.geometry
        self._rows, self._width = g.batch * g.kv_heads, g.block_tokens * g.head_dim
        self._bufs: list = []  # per buffer: ((K, V) each [rows, capacity, width], mmap owner, planes)
        self._busy: list = []  # per buffer: the ``done`` of every read registered into it
        self._pending: dict = {}  # (seq_id, layer) -> the _Group of a layer read ahead
        self._read_buf = -1  # the buffer the read running now fills

    def _free_buffer(self, taken: set) -> int:
        """A buffer no group in ``taken`` (buffer indices) uses; a new one if none is free
        (made when first sized, ``_buffer``)."""
        for b in range(len(self._bufs)):
            if b not in taken:
                return b
        self._bufs, self._busy = self._bufs + [None], self._busy + [[]]  # one statement: the same length
        return len(self._bufs) - 1

    def _settle(self, b: int) -> float:
        """Wait for every read registered into buffer ``b``; returns the seconds waited."""
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
            # the last item: each position's read destination, made once (``_planes``)
            have = self._bufs[b] = ((flat[0], flat[1]), owner, [None] * capacity)
        return have[0]

    def _drop(self, groups: list) -> int:
        """These planned reads will not be used: counted as unused prefetches (how many)."""
        unused = sum(len(group.reads) for group in groups)
        if unused:
            self.store.events.prefetch("unused", unused)
        return unused

    def _drop_pending(self) -> int:
        pending, self._pending = self._pending, {}
        return self._drop(list(pending.values()))

    def forget(self) -> int:
        """Before blocks' disk records change in place (``reorder_rows``), or at the end of
        a run (``BlockStore.drop_read_ahead``): no read in flight, and nothing read so far is
        used; returns the reads dropped."""
        for b in range(len(self._busy)):
            self._settle(b)
        return self._drop_pending()

    def close(self) -> None:
        """After the store's I/O threads have stopped (every queued read has run)."""
        self._drop_pending()
        self._bufs = []
        self._busy = []

    # ---- reads ------------------------------------------------------------------------------
    def _register(self, group: _Group, pos: int, key: Hashable, entry) -> Optional[_Read]:
        """Under the lock: if ``key``'s only copy is READY on disk (none in memory, READY or
        filling), a read of it into ``pos`` of the group's buffer, holding the copy (a
        reader), counted in ``_busy`` and ``_streaming``; not started (``_start``)."""
        copies = entry.copies
        if Tier.DEVICE in copies or Tier.HOST in copies:
            return None
        disk = copies.get(Tier.DISK)
        if disk is None or disk.state is not CopyState.READY:
            return None
        read = _Read(key, entry, disk)
        group.reads[pos] = read
        self._busy[group.buf].append(read.done)  # from here on, _settle waits for it
        disk.readers, read.held = disk.readers + 1, True  # one statement: no interrupt between them
        self.store._streaming[key] = read.done  # a waiter on the block waits for its read
        return read

    def _start(self, group: _Group, reads: list, priority: Priority) -> None:
        """Queue the registered ``reads`` ([(position, _Read)]), one I/O job each: a layer's
        few blocks then go to every I/O thread at once."""
        buf = self._bufs[group.buf]
        submit = self.store.engine.submit
        for pos, read in reads:
            submit(lambda p=pos, r=read: self._job(buf, p, r), priority)

    def _cancel(self, group: _Group) -> None:
        """After an interrupt or error while reads were registered or queued: every read not
        started lets go (its job, if it was queued, then does nothing). Idempotent."""
        with self.store._lock:
            for read in group.reads.values():
                if read.state is _QUEUED:
                    read.error = RuntimeError("not read")
                    self._let_go(read)
        for read in group.reads.values():
            if read.state is _LET_GO:
                _finish(read.done)

    def _let_go(self, read: _Read) -> None:
        """Under the lock: the read holds its disk copy no more."""
        store = self.store
        read.state = _LET_GO
        if read.held:
            read.held = False
            read.copy.readers -= 1
        if store._streaming.get(read.key) is read.done:
            del store._streaming[read.key]
        if read.entry.deleted:  # a failed tombstone is held and logged (``BlockStore._released``)
            for t, slot in store.table._collect(read.entry):
                store._released(read.key, t, slot, errors=[])

    def _job(self, buf: tuple, pos: int, read: _Read) -> None:
        """On an I/O thread: read the record into its position of ``buf`` (an item of
        ``_bufs``) and check its header (the payload is checked when used: ``_check``),
        then let go of the disk copy (under the store's lock) before ``read.done`` is set."""
        store = self.store
        with store._lock:
            if read.state is not _QUEUED:  # cancelled
                return
            read.state = _RUNNING
        t0 = time.perf_counter()
        try:
            parts, aligned = self._planes(buf, pos)
            _, read.crc = store.disk.read_unchecked(read.copy.slot, read.key, parts, aligned=aligned)
        except Exception as exc:  # noqa: BLE001 - the reader reads this block the usual way
            read.error = exc
            if not isinstance(exc, (RecordError, OSError)):
                log.warning("tiercache: reading block %r into attention's buffer failed (%r); it is "
                            "read through the host tier instead", read.key, exc)
        finally:
            with store._lock:
                self._let_go(read)
            try:
                if read.error is None:  # counted before ``done``: who waited for the read sees it
                    store.events.move("disk", "device", store.geometry.block_bytes, time.perf_counter() - t0)
            finally:
                _finish(read.done)

    def _planes(self, buf: tuple, pos: int) -> tuple:
        """Byte views of position ``pos``'s [T*D] planes in ``buf``, K rows then V rows (a
        record's payload order), and whether direct I/O can read into them
        (``DiskTier.read_into``'s ``aligned``). Made on a position's first read and kept
        with its buffer: making them took ~20 us a block, and checking their alignment as
        much again, of the I/O threads' CPU, which the model's threads share."""
        made = buf[2][pos]
        if made is None:
            (k, v), _, cache = buf
            with torch.inference_mode():
                parts = [memoryview(t[r, pos].view(torch.uint8).numpy()) for t in (k, v) for r in range(self._rows)]
            made = cache[pos] = (parts, aligned_parts(parts))
        return made

    def _plan_ahead(self, keys: list, ahead: Sequence[Hashable]) -> None:
        """Read the disk-only blocks of the plan's first ``MAX_LAYERS_AHEAD`` layers (runs
        of block keys of one layer) each into a buffer of its own (``_pending``): a layer
        already read ahead keeps its buffer and reads, and reads what it lacks. The rest of
        the plan is prefetched to the host as before."""
        store = self.store
        runs: list = []  # [(seq_layer, keys)] in the plan's order
        taken = 0
        for key in ahead:
            where = _where(key)
            if where is None:
                break
            if not runs or runs[-1][0] != where[0]:
                if len(runs) == MAX_LAYERS_AHEAD or any(layer == where[0] for layer, _ in runs):
                    break
                runs.append((where[0], []))
            runs[-1][1].append(key)
            taken += 1
        rest = list(ahead[taken:])
        old = self._pending
        self._pending = {layer: old.pop(layer) for layer, _ in runs if layer in old}
        self._drop(list(old.values()))
        busy = {self._read_buf} | {group.buf for group in self._pending.values()}
        mine = set(keys)
        for layer, run in runs:
            with store._lock:  # the positions: indices of the blocks stored, from the lowest
                found = [(key, entry) for key in dict.fromkeys(run)
                         if key not in mine and (entry := store.table.get(key)) is not None]
            if not found:
                continue
            group = self._pending.get(layer)
            if group is None:
                b = self._free_buffer(busy)
                busy.add(b)
                self._settle(b)
                lo = min(key[2] for key, _ in found)
                self._buffer(b, max(key[2] for key, _ in found) - lo + 1)
                group = self._pending[layer] = _Group(b, layer, lo)
            capacity = self._bufs[group.buf][0][0].shape[1]
            try:
                with store._lock:
                    reads = [(p, read) for key, entry in found
                             if 0 <= (p := key[2] - group.first) < capacity and p not in group.reads
                             and (read := self._register(group, p, key, entry)) is not None]
                self._start(group, reads, Priority.PREFETCH)
            except BaseException:
                _uninterrupted(lambda: self._cancel(group))
                raise
        if rest:
            store._prefetch_ahead(rest, mine, Tier.HOST)

    def read(self, keys: list, num_tokens: int, start_token: int, ahead: Sequence[Hashable],
             segments: bool = False):
        """``BlockStore.read_layer(keys, num_tokens, start_token, hold=True, ahead=ahead)``
        on a CPU store with host and disk tiers (the caller has let go of the last views).
        With ``segments``, ``BlockStore.read_segments`` instead: no gather; the blocks in
        memory are views of their pools, held until ``release_views``, and the disk blocks
        views of the buffer they were read into."""
        store = self.store
        bt = store.geometry.block_tokens
        # This layer's reads ahead, if it was planned: its group leaves the pending ones.
        where = _where(keys[0]) if keys else None
        pending = self._pending.pop(where[0], None) if where is not None else None
        b = self._read_buf = pending.buf if pending is not None else \
            self._free_buffer({group.buf for group in self._pending.values()})
        # Was each prefetched read done before this read wanted it (a prefetch "used"), or not ("late")?
        early = {r for r in pending.reads.values() if r.done.done()} if pending is not None else set()
        self._plan_ahead(keys, ahead)  # the next layers' reads go first, into other buffers
        stall = self._settle(b)  # this layer's prefetched reads
        # Where keys[0] lies in the planned layer's buffer (a run of consecutive indices).
        # A read ahead at position p of the buffer belongs at p + shift of this read's result.
        base, usable, shift = 0, {}, 0
        if pending is not None:
            usable, shift = pending.reads, pending.first - where[1]
        have = self._bufs[b]
        if usable and have is not None and shift <= 0 and have[0][0].shape[1] >= len(keys) - shift:
            base = -shift  # where this read wants them: the result starts at position -shift
            k_buf, v_buf = have[0]
        else:
            # A plan that left out the layer's first blocks read the others too low, or the
            # buffer grows: the reads ahead move (a copy, checked where it lands, not a second read).
            k_buf, v_buf = self._buffer(b, len(keys))
            if usable:
                usable = _moved(have[0], (k_buf, v_buf), usable, shift, len(keys))
        group = _Group(b, (), 0)  # this read's own reads, at the positions it reads (not a plan)
        used: dict = {}  # position -> _Read whose bytes this read takes
        memory: list = []  # indices into ``keys`` read from the device and host tiers
        try:
            with store._lock:
                get = store.table.get
                for j, key in enumerate(keys):
                    p = base + j
                    entry = get(key)
                    read = usable.get(p)
                    # the same disk copy still the block's: a write would have dropped it first
                    if read is not None and read.error is None and read.key == key and entry is read.entry \
                            and entry.copies.get(Tier.DISK) is read.copy:
                        used[p] = read
                    elif entry is None or self._register(group, p, key, entry) is None:
                        memory.append(j)
            self._start(group, sorted(group.reads.items()), Priority.DEMAND)
        except BaseException:
            _uninterrupted(lambda: self._cancel(group))
            raise
        if pending is not None:
            taken = set(used.values())  # by identity: a shifted read sits at another position
            unused = sum(1 for r in pending.reads.values() if r not in taken)
            if unused:
                store.events.prefetch("unused", unused)
            if used:
                late = sum(1 for r in used.values() if r not in early)
                if late:
                    store.events.prefetch("late", late)
                if len(used) > late:
                    store.events.prefetch("used", len(used) - late)
        # The readers go straight into the store's views list (empty: the caller let the last
        # views go), so that a Ctrl-C anywhere leaves each listed once, for the next
        # release_views (see BlockStore.read_layer); a gather lets them go at once.
        held = store._views
        try:
            store._hold_in_memory([keys[j] for j in memory], into=held)
            # on the device, in order: views of the pool (held for them, until release_views)
            first = None if segments or used or group.reads else store._views_of(held)
            if first is not None:
                store._stalled(stall)
                return store.device_pool.view(first, len(keys), num_tokens, start_token)
            stall += self._settle(b)  # this layer's own reads
            store._stalled(stall)
            used.update(group.reads)
            again = self._check(used, base, self._bufs[b])
            in_order = list(held)
            if again:  # read the usual way: through the host tier, where errors are named
                taken = len(held)
                store._hold_in_memory([keys[j] for j in again], into=held)
                by_index = dict(zip(memory, in_order))
                by_index.update(zip(again, held[taken:]))
                memory = sorted(by_index)
                in_order = [by_index[j] for j in memory]
            if segments:  # held for the views, until release_views
                return self._segments(len(keys), dict(zip(memory, in_order)), base, num_tokens, start_token,
                                      (k_buf, v_buf))
            t0 = time.perf_counter()
            k, v = store._gather_mixed(in_order, num_tokens, base * bt + start_token, into=(k_buf, v_buf),
                                       at=[base + j for j in memory])
            store._count_gather(len(in_order) * store.geometry.block_bytes, t0)
        except BaseException:
            _uninterrupted(lambda: store._let_go(held))
            raise
        _uninterrupted(lambda: store._let_go(held))  # gathered: nothing to keep
        return k, v

    def _segments(self, n: int, memory: dict, base: int, num_tokens: int, start_token: int, buf: tuple) -> list:
        """``read_segments``' answer: [(k, v)] views ([B, H, t, D]) covering ``num_tokens``
        from ``start_token`` of the first of ``n`` blocks, in order: one per run of adjacent
        device slots, one per host block, one per run of buffer positions. ``memory``: index
        -> the held (entry, copy) of each block read from the device or host tier; the others
        lie in ``buf`` (K, V) at ``base`` + their index."""
        store = self.store
        runs: list = []  # [tier (None: the buffer), first slot or position, count]
        for j in range(n):
            held = memory.get(j)
            if held is None:
                tier, at = None, base + j
            else:
                entry, copy = held
                tier, at = (Tier.DEVICE if copy is entry.copies.get(Tier.DEVICE) else Tier.HOST), copy.slot
            last = runs[-1] if runs else None
            if last is not None and last[0] is tier and tier is not Tier.HOST and at == last[1] + last[2]:
                last[2] += 1
            else:
                runs.append([tier, at, 1])
        return store._segment_views(runs, num_tokens, start_token, buf)

    def _check(self, used: dict, base: int, buf: tuple) -> list:
        """The reads of ``used`` have finished: check the bytes each put in ``buf`` (their
        CRC32C, here on the model's thread, just before attention reads them); count those
        that read their block (a disk hit, a use for the disk's policy); return the indices
        into the layer's keys of the others (an I/O error, a record that failed its check),
        to read the usual way, which drops a bad record, takes another copy, or raises
        ``BlockCorruptedError`` or ``TierIOError`` naming the problem.

        Why here and not on the I/O thread that read it: on a CPU with few cores the I/O
        threads' checksums preempted the model's OpenMP threads, and a parallel region waits
        for its slowest thread; here the check costs its own time and leaves the bytes in
        the cache for attention."""
        store = self.store
        again, good = [], []
        for p, read in used.items():
            if read.error is None and parts_crc(self._planes(buf, p)[0]) != read.crc:
                read.error = RecordError("payload checksum mismatch")
            if read.error is not None:
                again.append(p - base)
            else:
                good.append(read.key)
        if good:
            with store._lock:
                store.events.hit(Tier.DISK.label, len(good))
                store.policies[Tier.DISK].touch_many(good)  # a read is a use
        return sorted(again)


def _moved(src: tuple, dst: tuple, reads: dict, shift: int, width: int) -> dict:
    """The reads of ``reads`` (position -> _Read, all finished) that read their block, copied
    from position p of ``src`` to p + ``shift`` of ``dst`` (K and V, [rows, capacity, T*D]
    each; ``dst`` may be ``src``), those that land in [0, ``width``). Position -> _Read after
    the move. Within one buffer the copies go in the order that copies every source before
    anything overwrites it."""
    moved = {}
    for p in sorted(reads, reverse=shift > 0):
        read = reads[p]
        if read.error is None and 0 <= p + shift < width:
            for s, d in zip(src, dst):
                d[:, p + shift].copy_(s[:, p])
            moved[p + shift] = read
    return moved


def _finish(done: Future) -> None:
    """Set ``done`` once (a read's job and an interrupted submit may both get here)."""
    try:
        done.set_result(None)
    except Exception:  # noqa: BLE001 - InvalidStateError: already set
        pass
