"""The asyncio API: the same bytes come back through coroutines and through aiofiles."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch

from tiercache import BlockCorruptedError, BlockKey, Tier
from tiercache.aio import AsyncStore
from tiercache.disk import DATA_NAME, HEADER_BYTES


def test_async_put_demote_get_and_aiofiles_read(make_store, geometry):
    store = make_store(device_blocks=2, host_blocks=2)
    astore = AsyncStore(store)
    data = {BlockKey(0, 0, i): torch.randn(geometry.shape) for i in range(8)}

    async def scenario():
        for key, block in data.items():
            await astore.put(key, block)
        await astore.flush()
        for key in list(data)[:2]:
            await astore.demote(key)
        got = await asyncio.gather(*(astore.get(k) for k in data))
        on_disk = await asyncio.gather(*(astore.read_disk_record(k) for k in data))
        await astore.ensure_device(list(data)[:1])
        return got, on_disk

    got, on_disk = asyncio.run(scenario())
    for (key, block), g, d in zip(data.items(), got, on_disk):
        assert torch.equal(g, block) and torch.equal(d, block)
    assert store.table.is_ready(BlockKey(0, 0, 0), Tier.DEVICE)


def test_async_read_of_a_flipped_record_raises(make_store, geometry, tmp_path):
    store = make_store(device_blocks=1, host_blocks=1)
    key = BlockKey(0, 0, 0)
    store.put(key, torch.randn(geometry.shape))
    store.flush()
    slot = store.table.copy(key, Tier.DISK).slot
    path = os.path.join(store.disk.directory, DATA_NAME)
    with open(path, "r+b") as f:
        f.seek(slot * store.disk.record_bytes + HEADER_BYTES + 3)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(BlockCorruptedError, match="index=0"):
        asyncio.run(AsyncStore(store).read_disk_record(key))
    assert store.stats()["integrity_errors"] == 1
