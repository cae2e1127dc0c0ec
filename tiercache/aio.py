"""An asyncio face of the block store, for callers that live in an event loop.

Moves already run on the store's I/O threads; these coroutines await their futures instead
of blocking the loop. Disk records can also be read straight from the data file with
aiofiles and verified (header and payload CRC32C) without touching the store's table.
"""
from __future__ import annotations

import asyncio
from typing import Hashable, Iterable, Optional

import aiofiles
import aiofiles.os
import crc32c
import torch

from tiercache.disk import HEADER_BYTES, RecordError
from tiercache.errors import BlockCorruptedError
from tiercache.store import BlockStore
from tiercache.table import Tier


class AsyncStore:
    """Wrap a ``BlockStore``; every method is a coroutine.

    Example::

        astore = AsyncStore(store)
        await astore.put(key, block)
        await astore.demote(key)
        block = await astore.get(key)
    """

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    async def put(self, key: Hashable, block: torch.Tensor) -> None:
        await aiofiles.os.wrap(self.store.put)(key, block)

    async def get(self, key: Hashable) -> torch.Tensor:
        return await aiofiles.os.wrap(self.store.get)(key)

    async def promote(self, key: Hashable, tier: Tier = Tier.DEVICE) -> None:
        await asyncio.wrap_future(self.store.promote(key, tier))

    async def demote(self, key: Hashable) -> None:
        await asyncio.wrap_future(self.store.demote(key))

    async def ensure_device(self, keys: Iterable[Hashable], pin: bool = False) -> float:
        return await aiofiles.os.wrap(self.store.ensure_device)(list(keys), pin)

    async def flush(self) -> int:
        return await aiofiles.os.wrap(self.store.flush)()

    async def read_disk_record(self, key: Hashable) -> Optional[torch.Tensor]:
        """Read ``key``'s disk record with aiofiles and verify it; None if it has no disk copy.

        Raises ``BlockCorruptedError`` when the record fails its checks.
        """
        store, disk = self.store, self.store.disk
        if disk is None:
            return None
        with store._lock:
            copy = store.table.copy(key, Tier.DISK)
            if copy is None:
                return None
            copy.readers += 1  # the slot cannot be freed or reused while we read it
            slot = copy.slot
        try:
            async with aiofiles.open(disk.path, "rb") as f:
                await f.seek(slot * disk.record_bytes)
                raw = await f.read(HEADER_BYTES + disk.payload_bytes)
        finally:
            with store._lock:
                copy.readers -= 1
        try:
            if len(raw) < HEADER_BYTES + disk.payload_bytes:
                raise RecordError("truncated record")
            found, _, crc = disk.decode_header(memoryview(raw[:HEADER_BYTES]))
            payload = raw[HEADER_BYTES:]
            if found != key or crc32c.crc32c(payload) != crc:
                raise RecordError("key or payload checksum mismatch")
        except RecordError as exc:
            store.events.integrity_error("disk")
            raise BlockCorruptedError(f"block {key!r}: disk record failed its integrity check ({exc})") from None
        g = store.geometry
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(g.dtype).view(g.shape).clone()
