"""The asyncio API: the same bytes come back through coroutines and through aiofiles."""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tiercache import BlockCorruptedError, BlockKey, Tier
from tiercache.aio import AsyncStore
from tiercache.policies import EVICTION_POLICIES
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry
from tiercache.transfer import Priority

from conftest import flip_disk_record


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


def test_async_put_takes_the_stores_arguments_and_delete_forgets(make_store, geometry):
    """The coroutines mirror the store's calls: ``put`` takes the tokens written, the token
    ids a disk record keeps and the tier to land on (it took the block alone), and ``delete``
    exists (the async API had none: a caller had to reach for the store from the loop)."""
    store = make_store(device_blocks=2, host_blocks=2)
    astore = AsyncStore(store)
    key, other = BlockKey(0, 0, 0), BlockKey(0, 0, 1)
    block = torch.randn(geometry.shape)
    ids = bytes(range(3 * geometry.block_tokens))  # packed 3-byte token ids, one per token

    async def scenario():
        await astore.put(key, block, num_tokens=geometry.block_tokens, token_ids=ids, tier=Tier.HOST)
        await astore.put(other, block)
        await astore.delete(other)
        await astore.delete(BlockKey(9, 9, 9))  # unknown: a no-op, as the store's
        return await astore.get(key)

    assert torch.equal(asyncio.run(scenario()), block)
    assert store.tiers_of(key) == [Tier.HOST] and store.token_ids_of(key) == ids
    assert other not in store
    with pytest.raises(KeyError):
        store.get(other)


def test_async_read_of_a_flipped_record_raises_and_drops_the_record(make_store, geometry, tmp_path):
    """A block lies on the device and, flushed, on disk; one bit of its disk record flips.
    read_disk_record raises BlockCorruptedError and counts it. It left the bad record as
    the block's disk copy: the device copy then counted as clean, an eviction could drop
    it, and only the bad record was left. Now the record is dropped, as get() drops one:
    the intact device copy stays the block's, is written to disk anew by the next flush,
    and reads back exact; nothing bad is served."""
    store = make_store(device_blocks=1, host_blocks=1)
    key = BlockKey(0, 0, 0)
    block = torch.randn(geometry.shape)
    store.put(key, block)
    store.flush()
    flip_disk_record(store, key, 3)
    with pytest.raises(BlockCorruptedError, match="index=0"):
        asyncio.run(AsyncStore(store).read_disk_record(key))
    assert store.stats()["integrity_errors"] == 1
    assert store.tiers_of(key) == [Tier.DEVICE]  # the bad record is no copy of the block any more
    store.check()
    assert store.flush() == 1  # the intact copy goes down again
    assert torch.equal(asyncio.run(AsyncStore(store).read_disk_record(key)), block)
    store.put(BlockKey(0, 0, 1), torch.randn(geometry.shape))  # evicts the device copy
    assert torch.equal(store.get(key), block)


def test_a_flipped_record_whose_tombstone_fails_is_still_named_as_corrupt(make_store, geometry):
    """A block only on disk whose record has one bit flipped; the disk also fails the small
    write that would invalidate the record (EIO). read_disk_record raised that OSError
    instead of BlockCorruptedError, with the block's books half done (its token count
    kept, its loss not recorded). The record fails its checks whenever it is read, so a
    failed tombstone there is only logged: the read names the corruption, the block is
    gone from the store, and a fetch of it names the loss."""
    import errno

    from tiercache.bench.faults import _failing

    store = make_store(device_blocks=1, host_blocks=1)
    keys = [BlockKey(0, 0, i) for i in range(3)]
    for key in keys:
        store.put(key, torch.randn(geometry.shape), num_tokens=3)
    store.flush()
    store.drop_copies(Tier.DEVICE)
    store.drop_copies(Tier.HOST)
    key = keys[0]
    flip_disk_record(store, key, 5)
    with _failing("pwrite", errno.EIO, after=0):
        with pytest.raises(BlockCorruptedError, match="disk record failed its integrity check"):
            asyncio.run(AsyncStore(store).read_disk_record(key))
    assert key not in store and key not in store._tokens
    with pytest.raises(BlockCorruptedError, match="failed its integrity check and no intact copy existed"):
        store.ensure_device([key])
    store.check()


def test_a_block_deleted_while_its_record_is_read_is_gone_for_good(tmp_path, geometry):
    """``read_disk_record`` holds the record's slot while it reads; a ``delete`` meanwhile
    must still free it when the read ends. The slot stayed taken (disk full after a few
    rounds), and on a persistent store the deleted block came back when it was reopened."""
    from conftest import tiny_config
    from tiercache.store import BlockStore

    cfg = tiny_config(tmp_path, geometry, device_blocks=1, host_blocks=1, disk_blocks=4)
    key = BlockKey(7, 0, 0)

    async def scenario(store):
        astore = AsyncStore(store)
        for _ in range(6):  # more rounds than the disk has slots
            await astore.put(key, torch.randn(geometry.shape))
            await astore.flush()
            task = asyncio.create_task(astore.read_disk_record(key))
            await asyncio.sleep(0)  # the read holds the record now
            store.delete(key)
            await task
            assert key not in store

    with BlockStore(cfg, geometry) as store:
        asyncio.run(scenario(store))
        store.check()
        assert store.table.num_free(Tier.DISK) == 4
    with BlockStore(cfg, geometry) as reopened:
        assert key not in reopened


def test_a_block_deleted_while_its_record_is_read_stays_deleted_when_the_store_closes_first(tmp_path, geometry):
    """The same, but the store closes before the read ends. ``read_disk_record`` is not a
    counted call (it spans awaits), so ``close`` does not wait for it: the deleted block's
    record, held by the read, was never tombstoned and came back on reopen, and the read
    then failed with a ``TypeError`` from writing that tombstone through the closed file
    (a review's script). Now ``close`` tombstones what deleted blocks' reads hold, and the
    read ends with the documented ``RuntimeError``. The file threads are kept busy, so the
    read holds its slot and waits while the block is deleted and the store closed."""
    from conftest import tiny_config
    from tiercache import aio

    cfg = tiny_config(tmp_path, geometry, device_blocks=1, host_blocks=1, disk_blocks=4)
    key, kept = BlockKey(7, 0, 0), BlockKey(7, 0, 1)
    block = torch.randn(geometry.shape)
    release = threading.Event()

    async def scenario(store):
        astore = AsyncStore(store)
        await astore.put(key, torch.randn(geometry.shape))
        await astore.put(kept, block)
        await astore.flush()
        files = aio._file_executor()
        busy = [files.submit(release.wait) for _ in range(aio.FILE_THREADS)]
        try:
            task = asyncio.create_task(astore.read_disk_record(key))
            await asyncio.sleep(0.05)
            assert store.table.copy(key, Tier.DISK).readers == 1  # the read holds the record
            store.delete(key)
            store.close()
        finally:
            release.set()
        with pytest.raises(RuntimeError, match="closed"):
            await task
        for f in busy:
            f.result()

    store = BlockStore(cfg, geometry)
    try:
        asyncio.run(scenario(store))
    finally:
        release.set()
        store.close()
    with BlockStore(cfg, geometry) as reopened:
        assert key not in reopened
        assert torch.equal(reopened.get(kept), block)


def test_a_record_still_being_written_is_waited_for(make_store, geometry):
    """A disk copy in flight (FILLING) holds no record yet: read, it gave a stale record's
    bytes or a false integrity error. The read now waits for the write."""
    store = make_store(device_blocks=1, host_blocks=4, disk_blocks=8, io_workers=1)
    store.write_behind_enabled = False
    key = BlockKey(1, 0, 0)
    block = torch.randn(geometry.shape)

    async def scenario():
        astore = AsyncStore(store)
        await astore.put(key, block)
        await astore.demote(key)  # on the host
        with store._lock:  # prepare the host -> disk move (its disk copy FILLING), not started yet
            move = store._prepare(key, Tier.HOST, Tier.DISK, drop_source=False)
        assert store.table.copy(key, Tier.DISK).state.name == "FILLING"
        reading = asyncio.create_task(astore.read_disk_record(key))
        await asyncio.sleep(0.05)
        assert not reading.done()  # waiting for the write
        store._submit(move, Priority.WRITEBACK)
        return await reading

    got = asyncio.run(scenario())
    assert torch.equal(got, block)
    assert store.stats()["integrity_errors"] == 0


def test_async_calls_refuse_what_the_store_refuses(make_store, geometry):
    """One key given where a list is expected is a TypeError, as for the store; a read after
    close is refused as every call is. Anything but a store to wrap is a TypeError at once
    (``AsyncStore(None)`` was taken, and its first call an AttributeError from inside)."""
    for bad in (None, "kv", {}):
        with pytest.raises(TypeError, match="AsyncStore: expected a tiercache BlockStore, got "):
            AsyncStore(bad)
    store = make_store(device_blocks=1, host_blocks=1)
    key = BlockKey(0, 0, 0)
    store.put(key, torch.randn(geometry.shape))
    store.flush()
    astore = AsyncStore(store)
    with pytest.raises(TypeError, match="expected a list of keys"):
        asyncio.run(astore.ensure_device(key))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(astore.read_disk_record(key))


def test_more_puts_at_once_than_device_slots_all_land(make_store, geometry):
    """Fifty puts gathered at once on a two-slot device (the executor runs several at a
    time): a put that found every device slot being filled by the others raised
    CapacityError while the disk had room. It now waits for them."""
    store = make_store(device_blocks=2, host_blocks=2, disk_blocks=100)
    data = {BlockKey(0, 0, i): torch.randn(geometry.shape) for i in range(50)}

    async def scenario():
        astore = AsyncStore(store)
        return await asyncio.gather(*(astore.put(k, b) for k, b in data.items()), return_exceptions=True)

    errors = [r for r in asyncio.run(scenario()) if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for key, block in data.items():
        assert torch.equal(store.get(key), block)
    store.check()


def test_every_coroutine_answers_an_unknown_key_as_the_store_does(make_store, geometry):
    """A key the store never held, given to each coroutine and to the store's own call for
    the same operation, must come out the same way. ``read_disk_record`` answered None, as
    for a block that has no disk copy yet, where ``get`` (and ``read_into``) raise KeyError:
    a caller could not tell a deleted block from one not written down. It is a read, so it
    now raises KeyError as ``get`` does; None still means "stored, but not on disk".
    A block lost to a failed check (its only copy, on disk, flipped) must come out the same
    way too: ``BlockCorruptedError`` from every call, where ``get`` and ``read_disk_record``
    said KeyError after the first read had found the damage."""
    store = make_store(device_blocks=2, host_blocks=2)
    astore = AsyncStore(store)
    unknown, known, lost = BlockKey(9, 9, 9), BlockKey(0, 0, 0), BlockKey(0, 0, 1)
    store.put(lost, torch.randn(geometry.shape))
    store.flush()
    store.drop_copies(Tier.DEVICE)  # its only copy is the disk record
    flip_disk_record(store, lost, 3)
    with pytest.raises(BlockCorruptedError, match="index=1"):
        store.get(lost)
    assert lost not in store
    store.put(known, torch.randn(geometry.shape))  # on the device only: no disk copy

    def outcome(call):
        try:
            result = call()
            if hasattr(result, "result"):  # promote, demote: a future
                result = result.result()
            return "returns", result
        except Exception as exc:  # noqa: BLE001 - the outcome compared
            return "raises", type(exc)

    async def aoutcome(coro):
        try:
            return "returns", await asyncio.wait_for(coro, 30)
        except Exception as exc:  # noqa: BLE001
            return "raises", type(exc)

    def pairs(key):  # (name, the store's call, the coroutine)
        return [
            ("get", lambda: store.get(key), lambda: astore.get(key)),
            ("promote to the device", lambda: store.promote(key), lambda: astore.promote(key)),
            ("promote to the host", lambda: store.promote(key, Tier.HOST),
             lambda: astore.promote(key, Tier.HOST)),
            ("demote", lambda: store.demote(key), lambda: astore.demote(key)),
            ("ensure_device", lambda: store.ensure_device([key], pin=False),
             lambda: astore.ensure_device([key])),
            # no read of the record itself in the store: the read it is, get
            ("read_disk_record", lambda: store.get(key), lambda: astore.read_disk_record(key)),
        ]
    for name, call, acall in pairs(unknown):
        expected = outcome(call)
        assert asyncio.run(aoutcome(acall())) == expected, name
    for name, call, acall in pairs(lost):
        assert outcome(call) == ("raises", BlockCorruptedError), name
        assert asyncio.run(aoutcome(acall())) == ("raises", BlockCorruptedError), name
    # a block that is stored but has no disk copy is still None, not an error
    assert asyncio.run(astore.read_disk_record(known)) is None
    store.check()


def test_a_block_deleted_while_its_disk_copy_is_awaited_is_a_key_error(make_store, geometry):
    """``read_disk_record`` waits for a disk copy being written. If the block is deleted
    meanwhile the store no longer holds it, and the read says so as ``get`` would (it
    answered None: "no disk copy", as if the block were still there)."""
    store = make_store(device_blocks=1, host_blocks=4, disk_blocks=8, io_workers=1)
    store.write_behind_enabled = False
    key = BlockKey(2, 0, 0)

    async def scenario():
        astore = AsyncStore(store)
        await astore.put(key, torch.randn(geometry.shape))
        await astore.demote(key)  # on the host
        with store._lock:  # a host -> disk move prepared (its disk copy FILLING), not started
            move = store._prepare(key, Tier.HOST, Tier.DISK, drop_source=False)
        reading = asyncio.create_task(astore.read_disk_record(key))
        await asyncio.sleep(0)  # the read looked, found the copy FILLING and waits for its move
        assert not reading.done()
        store.delete(key)
        store._submit(move, Priority.WRITEBACK)
        with pytest.raises(KeyError):
            await asyncio.wait_for(reading, 30)

    asyncio.run(scenario())
    store.check()
    assert key not in store


@pytest.fixture
def held_eviction():
    """An eviction policy (``lru``, registered as a plug-in) whose first ``evict`` after
    ``arm(loop)`` tells the loop it was reached (``entered``, an asyncio.Event) and then
    waits for ``release`` (a threading.Event): a store call caught in the middle of making
    room, on its executor thread, for as long as a test needs. Registered as "held"."""
    class Stage:
        entered: asyncio.Event
        release = threading.Event()
        loop = None

        def arm(self, loop):
            self.entered = asyncio.Event()
            self.loop = loop

    stage = Stage()

    class Held(EVICTION_POLICIES["lru"]):
        def evict(self, n, is_evictable):
            loop, stage.loop = stage.loop, None  # the first call after arm() only
            if loop is not None:
                loop.call_soon_threadsafe(stage.entered.set)
                stage.release.wait(60)
            return super().evict(n, is_evictable)

    EVICTION_POLICIES["held"] = Held
    yield stage
    stage.release.set()  # never leave a thread held, whatever the test did
    del EVICTION_POLICIES["held"]


def test_a_put_cancelled_while_it_runs_is_waited_for_and_lands_whole(make_store, geometry, held_eviction):
    """A put that a thread has started cannot be stopped (its wait for room is inside the
    store's call). Cancelled there, the task heard CancelledError at once while the put
    went on and landed afterwards: the caller, told "cancelled", later found the block in
    the store (and a retry got "already stored"). Now the cancellation waits for the put
    to end, so what the caller sees when CancelledError arrives is final: here the put
    landed (the docstring says a cancelled put may have), whole and readable."""
    store = make_store(device_blocks=1, host_blocks=2, disk_blocks=8, eviction="held")
    astore = AsyncStore(store)
    first, second = BlockKey(3, 0, 0), BlockKey(3, 0, 1)
    blocks = {first: torch.randn(geometry.shape), second: torch.randn(geometry.shape)}

    async def scenario():
        await astore.put(first, blocks[first])  # the one device slot is taken
        held_eviction.arm(asyncio.get_running_loop())
        task = asyncio.create_task(astore.put(second, blocks[second]))
        await asyncio.wait_for(held_eviction.entered.wait(), 30)  # the put is making room, on its thread
        task.cancel()
        for _ in range(3):  # the cancellation reaches the task in one step of the loop
            await asyncio.sleep(0)
        heard_early = task.done()
        held_eviction.release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert not heard_early, "CancelledError came while the put was still under way"
        assert second in store  # settled: it had started, and it landed

    asyncio.run(scenario())
    for key, block in blocks.items():
        assert torch.equal(store.get(key), block)
    store.check()


def test_a_put_cancelled_before_a_thread_took_it_up_never_runs(make_store, geometry):
    """The other side of the rule: a put still queued for the executor when its task is
    cancelled never runs, reserves no slot, and the key can be put again at once."""
    store = make_store(device_blocks=2, host_blocks=2, disk_blocks=8)
    astore = AsyncStore(store)
    key = BlockKey(4, 0, 0)
    block = torch.randn(geometry.shape)
    hold = threading.Event()

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        busy = loop.run_in_executor(None, hold.wait, 60)  # the executor's one thread, taken
        task = asyncio.create_task(astore.put(key, block))
        await asyncio.sleep(0)  # the put is queued behind it
        free = store.table.num_free(Tier.DEVICE)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        hold.set()
        await asyncio.wait_for(busy, 30)
        await asyncio.wait_for(loop.run_in_executor(None, store.wait_idle), 30)  # after anything queued
        assert key not in store and store.table.num_free(Tier.DEVICE) == free
        await asyncio.wait_for(astore.put(key, block), 30)

    try:
        asyncio.run(scenario())
    finally:
        hold.set()
    assert torch.equal(store.get(key), block)
    store.check()


def test_a_cancelled_ensure_device_with_pin_leaves_no_pin(make_store, geometry, held_eviction):
    """``ensure_device(pin=True)`` cancelled while it made room on the device went on and
    pinned its block; the caller, who heard only CancelledError, never learnt of the pin
    and never undid it. The block held its device slot for good, and the next put on the
    one-slot device failed with CapacityError. A cancelled call now undoes its pins."""
    store = make_store(device_blocks=1, host_blocks=2, disk_blocks=8, eviction="held")
    astore = AsyncStore(store)
    keys = [BlockKey(5, 0, i) for i in range(3)]
    blocks = {key: torch.randn(geometry.shape) for key in keys}

    async def scenario():
        await astore.put(keys[0], blocks[keys[0]])
        await astore.put(keys[1], blocks[keys[1]])  # keys[0] goes down to the host
        held_eviction.arm(asyncio.get_running_loop())
        task = asyncio.create_task(astore.ensure_device([keys[0]], pin=True))
        await asyncio.wait_for(held_eviction.entered.wait(), 30)  # making room for keys[0]
        task.cancel()
        held_eviction.release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert store.table.get(keys[0]).pins == 0
        await asyncio.wait_for(astore.put(keys[2], blocks[keys[2]]), 30)  # the device slot can be had

    asyncio.run(scenario())
    for key, block in blocks.items():
        assert torch.equal(store.get(key), block)
    store.check()


def test_a_disk_write_that_fails_while_its_record_is_awaited_reads_as_no_copy(make_store, geometry):
    """``read_disk_record`` of a block whose disk copy is being written waits for the write.
    When that write failed (EIO here, raised by the disk tier's own ``pwritev`` for the
    record), it raised the write's error, which is not this read's: the move rolled back and
    the block is whole on the host. It now looks again, as ``get`` does, and answers what is
    there: no disk copy (None); the block still reads back from the host."""
    store = make_store(device_blocks=2, host_blocks=2)
    astore = AsyncStore(store)
    key = BlockKey(0, 0, 0)
    block = torch.randn(geometry.shape)
    store.put(key, block, tier=Tier.HOST)
    entered, release = threading.Event(), threading.Event()
    real = os.pwritev

    def failing_write(fd, buffers, offset, *args):
        entered.set()
        release.wait(30)
        raise OSError(5, os.strerror(5))  # EIO

    async def scenario():
        demote = asyncio.ensure_future(astore.demote(key))
        assert await asyncio.to_thread(entered.wait, 30)  # the record's write has begun
        read = asyncio.ensure_future(astore.read_disk_record(key))
        await asyncio.sleep(0.05)  # the read finds the disk copy FILLING and waits for it
        assert not read.done()
        release.set()
        got = await asyncio.wait_for(read, 30)
        with pytest.raises(Exception):  # the demotion's own failure is the demote's to report
            await asyncio.wait_for(demote, 30)
        return got

    os.pwritev = failing_write
    try:
        got = asyncio.run(scenario())
    finally:
        os.pwritev = real
        release.set()
    assert got is None
    assert store.tiers_of(key) == [Tier.HOST] and torch.equal(store.get(key), block)


def test_a_reorder_on_a_one_thread_default_executor_does_not_starve_a_disk_read(tmp_path):
    """An asyncio program that runs the store's blocking calls on a default executor of one
    thread: ``reorder_rows`` (beam search) goes there while ``read_disk_record`` holds a
    reader on a record. The reorder waits until no copy is being read; the read's file
    calls went to the same default executor, queued behind the reorder, so neither ever
    finished (the program hung). The read now does its file I/O on threads of its own, and
    both finish: the read returns the record as it was, the reorder then permutes it."""
    from conftest import tiny_config
    geometry = BlockGeometry(batch=2, kv_heads=1, block_tokens=4, head_dim=8, dtype=torch.float32)
    store = BlockStore(tiny_config(tmp_path, geometry, device_blocks=2, host_blocks=2), geometry, persistent=False)
    key, block = BlockKey(0, 0, 0), torch.randn(geometry.shape)
    store.put(key, block)
    assert store.flush() == 1
    swap = torch.tensor([1, 0])
    go = threading.Event()

    def reorder_when_told() -> None:  # the default executor's only thread, busy until go
        go.wait(30)
        store.reorder_rows(swap)

    async def scenario():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        reorder = loop.run_in_executor(None, reorder_when_told)
        read = asyncio.create_task(AsyncStore(store).read_disk_record(key))
        # The read holds its reader: the reorder may start. (Or, with its own threads, it has
        # already finished; before, its file calls waited behind the reorder's thread.)
        while not store.table.any_in_use() and not read.done():
            await asyncio.sleep(0.001)
        go.set()
        try:
            return await asyncio.wait_for(asyncio.gather(read, reorder), 30)
        except asyncio.TimeoutError:
            pytest.fail("read_disk_record and reorder_rows waited for each other (deadlock)")

    try:
        got, _ = asyncio.run(scenario())
        assert torch.equal(got, block)  # read before the reorder
        assert torch.equal(store.get(key), block.index_select(1, swap))
        store.check()
    finally:
        store.close()


def test_a_disk_read_cancelled_at_any_point_leaves_no_file_open_and_no_thread_behind(make_store, geometry):
    """``read_disk_record`` cancelled after 0, 1, 2, ... turns of the loop: wherever the
    cancellation lands, the record's reader is let go and the data file is closed (one
    cancelled while a thread opened the file left it open until the garbage collector
    found it: a ResourceWarning). Reads of many ``AsyncStore``s share a few threads that
    do not grow with them (each had two threads of its own, alive after its store closed)."""
    import gc
    import warnings

    from tiercache.aio import FILE_THREADS

    store = make_store(device_blocks=2, host_blocks=2)
    key, block = BlockKey(0, 0, 0), torch.randn(geometry.shape)
    store.put(key, block)
    store.flush()

    async def cancelled_after(turns: int) -> None:
        task = asyncio.create_task(AsyncStore(store).read_disk_record(key))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            assert torch.equal(await task, block)  # it had finished first
        except asyncio.CancelledError:
            pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for turns in range(40):
            asyncio.run(cancelled_after(turns))
            assert not store.table.any_in_use(), turns
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []

    async def many_stores() -> list:
        return await asyncio.gather(*(AsyncStore(store).read_disk_record(key) for _ in range(20)))
    assert all(torch.equal(got, block) for got in asyncio.run(many_stores()))
    threads = [t for t in threading.enumerate() if t.name.startswith("tiercache-aio-files")]
    assert 0 < len(threads) <= FILE_THREADS
    store.check()
