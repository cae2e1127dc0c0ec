"""An asyncio face of the block store, for callers that live in an event loop.

Moves already run on the store's I/O threads; these coroutines await their futures instead
of blocking the loop. Disk records can also be read straight from the data file with
aiofiles and verified (header and payload CRC32C) without touching the store's table.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable, Optional

import aiofiles
import aiofiles.os
import torch

from tiercache.disk import HEADER_BYTES, RecordError
from tiercache.errors import BlockCorruptedError
from tiercache.store import BlockStore, _key_list
from tiercache.table import CopyState, Tier


class _Gate:
    """A call handed to the executor, and whether a thread has taken it up: ``call_off``
    before that and it never runs."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self._fn, self._args = fn, args
        self._lock = threading.Lock()
        self._started: Optional[bool] = None  # None: queued; True: running or run; False: called off

    def run(self):
        with self._lock:
            if self._started is False:
                return None
            self._started = True
        fn, args, self._fn, self._args = self._fn, self._args, None, ()  # the block is not kept
        return fn(*args)

    def call_off(self) -> bool:
        """Whether the call will never run (called off now or before)."""
        with self._lock:
            if self._started is None:
                self._started = False
            return self._started is False


FILE_THREADS = 4
_files: Optional[ThreadPoolExecutor] = None
_files_pid = 0
_files_lock = threading.Lock()


def _file_executor() -> ThreadPoolExecutor:
    """The threads every ``AsyncStore.read_disk_record`` does its file I/O on: made on first
    use and kept for the process, as asyncio's default executor is (one pool per
    ``AsyncStore`` outlived its store: two threads each). Made anew in a forked child, where
    the parent's threads do not run."""
    global _files, _files_pid
    with _files_lock:
        if _files is None or _files_pid != os.getpid():
            _files, _files_pid = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="tiercache-aio-files"), os.getpid()
        return _files


async def _outlast(fut: asyncio.Future) -> bool:
    """Wait until ``fut`` is done, whatever cancellations the waiting task gets meanwhile;
    returns whether it got one (the caller raises ``CancelledError`` then)."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if not fut.cancelled():
        fut.exception()  # retrieved: a failure the caller will not see is not logged as lost
    return cancelled


class AsyncStore:
    """Wrap a ``BlockStore``; every method is a coroutine.

    Example::

        astore = AsyncStore(store)
        await astore.put(key, block)
        await astore.demote(key)
        block = await astore.get(key)

    Cancellation: the store's calls run on the loop's default executor, and a call a
    thread has not taken up yet when its task is cancelled never runs. One that has
    started (waiting for room counts: that wait is inside the store's call) cannot be
    stopped: the cancellation waits for it to end, and only then raises
    ``CancelledError``. So a caller that sees ``CancelledError`` sees the store settled:
    the call never happened or it has happened (a cancelled ``put`` may have landed:
    ``key in store`` says which), never one still under way.

    ``read_disk_record`` does its file I/O on threads of tiercache's own (``_file_executor``),
    not on the loop's default executor: it holds a reader on the record while it reads, and
    a ``reorder_rows`` running on a one-thread default executor waits for that reader, so a
    read queued behind it would never come.
    """

    def __init__(self, store: BlockStore) -> None:
        if not isinstance(store, BlockStore):  # else an AttributeError at the first call (a review)
            raise TypeError(f"AsyncStore: expected a tiercache BlockStore, got {type(store).__name__}")
        self.store = store

    async def _call(self, fn: Callable, *args, settle: Optional[Callable] = None):
        """``fn(*args)`` on the executor, with the cancellation of the class docstring.
        ``settle(result)``: a coroutine that finishes what a call cancelled after it ran
        left under way (a move it started)."""
        gate = _Gate(fn, args)
        fut = asyncio.get_running_loop().run_in_executor(None, gate.run)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done() and gate.call_off():
                fut.cancel()  # still queued: dropped (a thread that takes it up finds it called off)
                raise
            await _outlast(fut)
            if settle is not None and not fut.cancelled() and fut.exception() is None:
                await settle(fut.result())
            raise

    async def put(self, key: Hashable, block: torch.Tensor, num_tokens: Optional[int] = None,
                  token_ids: bytes = b"", tier: Optional[Tier] = None) -> None:
        """``BlockStore.put``, with its arguments. Cancelled once a thread has started it, the
        cancellation waits for it to end, and the block may have landed (``key in store``);
        before, it never runs and reserves nothing."""
        await self._call(self.store.put, key, block, num_tokens, token_ids, tier)

    async def delete(self, key: Hashable) -> None:
        """``BlockStore.delete``: forget ``key`` (an unknown key is a no-op, as there)."""
        await self._call(self.store.delete, key)

    async def get(self, key: Hashable) -> torch.Tensor:
        """``BlockStore.get``: a copy of the block's bytes. An unknown key is a ``KeyError``."""
        return await self._call(self.store.get, key)

    async def promote(self, key: Hashable, tier: Tier = Tier.DEVICE) -> None:
        """``BlockStore.promote``, waited for. As there, a key the store does not hold is a
        ``KeyError``."""
        # Starting a move can wait (for room on the tier, for a slot in the I/O queue, or, to
        # the device, for the whole fetch): on the executor, not on the loop.
        await self._wait_move(await self._call(self.store.promote, key, tier, settle=self._land))

    async def demote(self, key: Hashable) -> None:
        """``BlockStore.demote``, waited for. As there, a key the store does not hold is a
        ``KeyError``, and a block with nowhere lower to go stays where it is."""
        await self._wait_move(await self._call(self.store.demote, key, settle=self._land))

    async def ensure_device(self, keys: Iterable[Hashable], pin: bool = False) -> float:
        """``BlockStore.ensure_device`` (unpinned unless ``pin``; the store's default pins).
        As there, a key the store does not hold is a ``KeyError`` (``BlockCorruptedError``
        if it was lost to a failed integrity check).
        Cancelled, it pins nothing: pins it made before the cancellation reached it are
        undone (the caller, never told they were made, could not unpin them)."""
        keys = _key_list(keys, "ensure_device")
        pins: list = []  # the entries it pinned: by key, another thread's pin could go instead

        async def unpin(_) -> None:
            self.store._unpin_entries(pins)

        return await self._call(lambda: self.store.ensure_device(keys, pin, _into=pins),
                                settle=unpin if pin else None)

    async def flush(self) -> int:
        """``BlockStore.flush``: blocks written to disk."""
        return await self._call(self.store.flush)

    @staticmethod
    async def _wait_move(move) -> None:
        """Wait for a move's future. A move is not called off (``_MoveFuture.cancel``): a
        cancellation waits for it to land, as for a call already started."""
        fut = asyncio.wrap_future(move)
        if await _outlast(fut):
            raise asyncio.CancelledError
        fut.result()

    @staticmethod
    async def _land(move) -> None:
        """A cancelled promote's or demote's move, waited for (its outcome is not reported)."""
        await _outlast(asyncio.wrap_future(move))

    async def read_disk_record(self, key: Hashable) -> Optional[torch.Tensor]:
        """Read ``key``'s disk record with aiofiles and verify it; None if the block has no
        disk copy (or the store no disk tier).

        A read, as ``get``: a key the store does not hold (never stored, or deleted, also
        while its disk copy was waited for) is a ``KeyError``. A disk copy still being
        written is waited for (if that write fails, there is no disk copy: None). Raises
        ``BlockCorruptedError`` when the record fails its checks (the record is dropped, as
        ``get`` drops it: a later read uses another copy, or names the loss), and
        ``RuntimeError`` once the store is closed. While ``reorder_rows`` holds new reads off, it waits.
        """
        store, disk = self.store, self.store.disk
        while True:
            if store.closed:
                raise RuntimeError("AsyncStore.read_disk_record: the store is closed")
            gate = store._reads_gate  # reorder_rows holds new reads off: after it
            if gate is not None:
                await asyncio.wrap_future(gate)
                continue
            with store._lock:
                entry = store.table.get(key)
                if entry is None:
                    raise store._unknown(key)
                copy = entry.copies.get(Tier.DISK) if disk is not None else None
                if copy is None:
                    return None
                if copy.state is CopyState.READY:
                    copy.readers += 1  # the slot cannot be freed or reused while we read it
                    slot = copy.slot
                    break
                waits = store._inflight_for(key)  # being written: wait for that move
            for future in waits:
                try:
                    await asyncio.wrap_future(future)
                except Exception:  # noqa: BLE001 - that move's failure is its caller's: look again
                    pass
            if not waits:
                await asyncio.sleep(0.001)
        # Read into, verified, then the block's memory. Not a bytearray: zeroing one of a 64
        # MiB block held the GIL, and so the loop, for tens of milliseconds.
        raw = torch.empty(HEADER_BYTES + disk.payload_bytes, dtype=torch.uint8)
        view = memoryview(raw.numpy())
        got = 0
        files = _file_executor()
        f = None
        try:
            # Not ``async with``: aiofiles' __aexit__ closes on the default executor. The open
            # is seen through: cancelled while a thread opened it, the file is still closed.
            opening = asyncio.ensure_future(aiofiles.open(disk.path, "rb", buffering=0, executor=files))
            cancelled = await _outlast(opening)
            if not opening.cancelled() and opening.exception() is None:
                f = opening.result()
            if cancelled:
                raise asyncio.CancelledError
            if f is None:
                opening.result()  # the open failed: its error
            await f.seek(slot * disk.record_bytes)
            while got < len(view):
                n = await f.readinto(view[got:])
                if not n:
                    break
                got += n
        except OSError:
            if store.closed:
                raise RuntimeError("AsyncStore.read_disk_record: the store was closed during the read") from None
            raise
        finally:
            try:
                if f is not None and await _outlast(asyncio.ensure_future(f.close())):
                    raise asyncio.CancelledError  # cancelled while the file closed
            finally:
                store._let_go([(entry, copy)])  # frees the copy if the block was deleted meanwhile
        if store.closed:  # not waited for by close(), which may have tombstoned the record
            raise RuntimeError("AsyncStore.read_disk_record: the store was closed during the read")
        await aiofiles.os.wrap(self._verify)(key, view, got, entry, copy, executor=files)
        g = store.geometry
        return raw[HEADER_BYTES:].view(g.dtype).view(g.shape)

    def _verify(self, key: Hashable, raw: memoryview, got: int, entry, copy) -> None:
        """On the executor: the record's checks (``RecordCodec.decode``: length, header, key,
        a CRC32C over the payload). A record that fails them is dropped, as ``get`` drops
        it, if it is still the block's disk copy (``entry``'s ``copy``, read): kept, it
        stood as the block's copy below, and an intact copy above it could be evicted as
        clean, leaving only the bad record."""
        store = self.store
        try:
            store.disk.decode(raw[:got], key)
        except RecordError as exc:
            store.events.integrity_error("disk")
            with store._lock:
                if store.table.get(key) is entry and entry.copies.get(Tier.DISK) is copy:
                    store._discard(key, Tier.DISK)
            raise BlockCorruptedError(f"block {key!r}: disk record failed its integrity check ({exc})") from None
