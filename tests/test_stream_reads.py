"""Disk blocks read straight into attention's buffer (CPU, host and disk tiers; ``DiskStreams``).

A decode step reads every block of every layer. The blocks the device and host tiers hold
stay there; the rest are read from disk into their place in the layer's buffer, the next
layer's while this one computes, and never take a host slot: so a step reads from disk
exactly the blocks that are in no memory tier, not more. Bytes read ahead are used only if
the block is still the one they were read from, and a record that fails its check is never
used.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from tiercache import BlockCorruptedError, BlockKey, CapacityError, Tier, TieredCache
from tiercache.disk import HEADER_BYTES
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry

from conftest import line_interrupter, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BT = 4


def _llama(layers: int = 3):
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      initializer_range=0.2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


def _tiered(model, tmp_path, device_blocks: int, host_blocks: int) -> TieredCache:
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    cfg = tiny_config(tmp_path, geometry, device_blocks=device_blocks, host_blocks=host_blocks, disk_blocks=200,
                      reuse=False)
    return TieredCache(model, cfg)


def _in_memory(store: BlockStore, keys: list) -> int:
    return sum(1 for key in keys if {Tier.DEVICE, Tier.HOST} & set(store.tiers_of(key)))


def _reads_done(store: BlockStore) -> None:
    """Wait for the reads in flight into attention's buffers (those of the layer read ahead)."""
    for busy in (store._streams._busy if store._streams is not None else ()):
        for future in busy:
            future.result()


def test_a_decode_step_reads_from_disk_only_the_blocks_in_no_memory_tier(tmp_path):
    """Three layers of 12-15 blocks, 16 device and 8 host slots: each decode step must read
    from disk exactly the blocks that neither memory tier holds, straight into attention's
    buffer (``disk->device``), never through a host slot (``disk->host``), and give
    DynamicCache's logits. Through the host tier a step read more: each block read took a
    host slot and pushed out one the same step would read again."""
    model = _llama()
    ids = torch.randint(2, 64, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), _tiered(model, tmp_path, device_blocks=16, host_blocks=8) as cache:
        out = model(ids, cache=cache, use_cache=True).logits
        want = model(ids, cache=ref, use_cache=True).logits
        assert (out - want).abs().max().item() == 0.0
        nxt = want[:, -1:].argmax(-1)
        store = cache.store
        exact, last = 0, {"first": 1}
        _reads_done(store)
        for step in range(10):
            keys = [key for layer in range(3) for key in cache._blocks_of(layer)]
            in_memory = _in_memory(store, keys)
            before = cache.stats()["moves"]
            out = model(nxt, cache=cache, use_cache=True).logits
            want = model(nxt, cache=ref, use_cache=True).logits
            assert (out - want).abs().max().item() == 0.0, f"step {step}: logits differ"
            # Every move this step started lands before it is counted: a write-behind
            # (host->disk) still running landed in the next step's count, on a loaded
            # machine (3 exact steps where 4 are, in a clean clone's suite).
            store.wait_idle()
            moves = cache.stats()["moves"]
            moved = {name: m["blocks"] - before.get(name, {}).get("blocks", 0) for name, m in moves.items()}
            moved = {name: n for name, n in moved.items() if n}
            assert moved.get("disk->host", 0) == 0, f"step {step}: {moved}"
            # Unless a new tail block pushed blocks down a tier (one per layer every BT steps),
            # the memory tiers kept what they held, and the count is exact. (It counts the
            # next step's first layer, read ahead, in place of this step's own.)
            if set(moved) <= {"disk->device"} and set(last) <= {"disk->device"}:
                assert moved.get("disk->device", 0) == len(keys) - in_memory, f"step {step}: {moved}"
                exact += 1
            last = moved
            nxt = want[:, -1:].argmax(-1)
        assert exact >= 4
        stats = cache.stats()
        assert stats["hits"]["disk"] > 0 and stats["prefetch"]["used"] > 0


def _to_disk(store: BlockStore, key: BlockKey) -> None:
    """Leave ``key`` with its disk copy only."""
    while store.tiers_of(key) != [Tier.DISK]:
        store.demote_now([key])


def _two_layers_on_disk(store: BlockStore, g: torch.Generator) -> tuple:
    """Four random blocks in each of layers 0 and 1, on disk only: (layer 0's keys, layer
    1's keys, key -> block)."""
    return _layers_on_disk(store, g, 2)


def _layers_on_disk(store: BlockStore, g: torch.Generator, layers: int) -> tuple:
    """Four random blocks in each of ``layers`` layers, on disk only: (each layer's keys...,
    key -> block)."""
    keys = [[BlockKey(0, layer, i) for i in range(4)] for layer in range(layers)]
    data = {}
    for key in sum(keys, []):
        data[key] = torch.randn(store.geometry.shape, generator=g)
        store.put(key, data[key])
    store.flush()
    for key in sum(keys, []):
        _to_disk(store, key)
    return (*keys, data)


def test_each_layer_read_ahead_fills_a_buffer_of_its_own_once(tmp_path):
    """A plan two layers deep (``lookahead``): while layer a is read, layers b and c are
    read from disk, each into a buffer of its own, neither the one a's result lies in. The
    next read (b, planning c and a) uses b's reads, keeps c's (not read again) and reads a
    ahead once more; so does the one after. Every result is the blocks' bytes, every block
    is read once per plan that first names it, and nothing read ahead goes unused. A plan
    deeper than ``MAX_LAYERS_AHEAD`` reads that many layers into buffers and prefetches the
    rest to the host tier."""
    from tiercache.streamread import MAX_LAYERS_AHEAD

    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=8, disk_blocks=80), geometry,
                    persistent=False) as store:
        a, b, c, d, e, data = _layers_on_disk(store, torch.Generator().manual_seed(6), 5)

        def disk_reads() -> int:
            return store.stats()["moves"].get("disk->device", {}).get("blocks", 0)

        k, v = store.read_layer(a, 4 * BT, 0, hold=True, ahead=b + c)
        assert torch.equal(k, torch.cat([data[key][0] for key in a], dim=-2))
        streams = store._streams
        pending = streams._pending
        assert list(pending) == [(0, 1), (0, 2)]
        bufs = {group.buf for group in pending.values()}
        assert len(bufs) == 2 and streams._read_buf not in bufs, "a layer read ahead shares a buffer"
        store.release_views()
        _reads_done(store)
        assert disk_reads() == 12  # a now, b and c ahead
        for keys, ahead, total in ((b, c + a, 16), (c, a + b, 20), (a, b + c, 24)):
            k, v = store.read_layer(keys, 4 * BT, 0, hold=True, ahead=ahead)
            assert torch.equal(k, torch.cat([data[key][0] for key in keys], dim=-2))
            assert torch.equal(v, torch.cat([data[key][1] for key in keys], dim=-2))
            store.release_views()
            _reads_done(store)
            assert disk_reads() == total, "a layer still read ahead was read again"
        stats = store.stats()
        assert stats["prefetch"]["unused"] == 0
        assert stats["prefetch"]["used"] + stats["prefetch"]["late"] == 12
        deep = [b, c, d, e][:MAX_LAYERS_AHEAD + 1]
        store.read_layer(a, 4 * BT, 0, hold=True, ahead=sum(deep, []))
        store.release_views()
        store.wait_idle()
        assert list(store._streams._pending) == [key[0][:2] for key in deep[:-1]]
        assert all(Tier.HOST in store.tiers_of(key) for key in deep[-1]), "the layer past the buffers"
        store.check()


def test_bytes_damaged_in_the_buffer_after_their_read_are_never_served(tmp_path):
    """A block's payload is checked (CRC32C) when its layer is read, over the bytes where they
    lie in attention's buffer, not when the I/O thread read them. So bytes that changed in
    the buffer after their read (here: a stray write into the layer read ahead) are refused
    and the block is read again, through the host tier: the result is the block's own
    bytes. Checked on the I/O thread, those bytes were served."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        a, b, data = _two_layers_on_disk(store, torch.Generator().manual_seed(8))
        store.read_layer(a, 4 * BT, 0, hold=True, ahead=b)
        store.release_views()
        _reads_done(store)
        (group,) = store._streams._pending.values()
        (k_buf, v_buf), _, _ = store._streams._bufs[group.buf]
        hit = b[2][2] - group.first
        v_buf[0, hit, 5] += 1.0  # one value of b[2], after its read finished
        before = store.stats()["moves"]
        k, v = store.read_layer(b, 4 * BT, 0, hold=True)
        assert torch.equal(k, torch.cat([data[key][0] for key in b], dim=-2))
        assert torch.equal(v, torch.cat([data[key][1] for key in b], dim=-2)), "damaged bytes were served"
        store.release_views()
        moves = store.stats()["moves"]
        assert moves["disk->host"]["blocks"] - before.get("disk->host", {}).get("blocks", 0) == 1
        assert Tier.HOST in store.tiers_of(b[2])
        store.check()


def test_bytes_read_ahead_are_not_served_once_the_block_changed(tmp_path):
    """The next layer's blocks are read into the other buffer while this one is read. Then
    one of them is written (brought up, appended to) and another deleted and stored again
    with other bytes: the next read must return the new bytes of both, not what was read
    ahead."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        g = torch.Generator().manual_seed(1)
        a, b, data = _two_layers_on_disk(store, g)
        k, v = store.read_layer(a, 4 * BT, 0, hold=True, ahead=b)
        assert torch.equal(k, torch.cat([data[key][0] for key in a], dim=-2))
        pending = store._streams._pending
        assert list(pending) == [(0, 1)] and len(pending[(0, 1)].reads) == 4  # b read ahead, from disk
        store.release_views()
        # b[1]: brought up and written (the disk copy read ahead is dropped first)
        store.ensure_device([b[1]])
        slot = store.begin_write(b[1])
        fresh = torch.randn(1, 2, BT, 8, generator=g)
        store.device_pool.write_tokens(slot, 0, fresh, -fresh)
        data[b[1]] = torch.stack([fresh, -fresh])
        store.unpin([b[1]])
        # b[2]: deleted, and stored again under its key with other bytes, down to the disk
        store.delete(b[2])
        data[b[2]] = torch.randn(geometry.shape, generator=g)
        store.put(b[2], data[b[2]])
        store.flush()
        _to_disk(store, b[2])
        k, v = store.read_layer(b, 4 * BT, 0, hold=True)
        assert torch.equal(k, torch.cat([data[key][0] for key in b], dim=-2))
        assert torch.equal(v, torch.cat([data[key][1] for key in b], dim=-2))
        store.release_views()
        store.check()


def _read(store: BlockStore, how: str, keys: list, num_tokens: int, start_token: int = 0, ahead=()) -> tuple:
    """A layer's K and V as ``read_layer(hold=True)`` gives them, or as ``read_segments``
    (attend_in_place) gives them, concatenated; the caller releases the views."""
    if how == "gathered":
        return store.read_layer(keys, num_tokens, start_token, hold=True, ahead=ahead)
    segments = store.read_segments(keys, num_tokens, start_token, ahead=ahead)
    return torch.cat([k for k, _ in segments], dim=-2), torch.cat([v for _, v in segments], dim=-2)


@pytest.mark.parametrize("how", ["gathered", "segments"])
@pytest.mark.parametrize("ahead", [False, True], ids=["read-now", "read-ahead"])
def test_a_record_that_fails_its_check_is_never_used(tmp_path, ahead, how):
    """A disk-only block whose record is damaged on disk, read straight into the buffer (now,
    or ahead of its layer), for a gather or for attention in place: the read is refused
    (``BlockCorruptedError``, the block's only copy is gone), never served; the layer's
    other blocks are unharmed."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        a, b, data = _two_layers_on_disk(store, torch.Generator().manual_seed(2))
        bad = b[2]
        slot = store.table.copy(bad, Tier.DISK).slot
        with open(store.disk.path, "r+b") as f:
            f.seek(slot * store.disk.record_bytes + HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        if ahead:
            _read(store, how, a, 4 * BT, 0, ahead=b)
            store.release_views()
        with pytest.raises(BlockCorruptedError, match="integrity"):
            _read(store, how, b, 4 * BT)
        assert store.stats()["integrity_errors"] >= 1
        assert bad not in store
        good = [key for key in b if key != bad]
        k, _ = _read(store, how, good, 3 * BT)
        assert torch.equal(k, torch.cat([data[key][0] for key in good], dim=-2))
        store.release_views()
        store.check()


def test_attention_in_place_sees_disk_blocks_in_the_buffer_and_the_rest_where_they_lie(tmp_path):
    """``read_segments`` (attend_in_place) on a layer whose blocks lie on the device, on the
    host and only on disk, read from a token inside the first block to one inside the last:
    the segments, in order, hold exactly the layer's tokens. The disk blocks were read into
    attention's buffer (a ``disk->device`` move each), ahead with the layer before or now,
    and took no host slot; the others are views of their pools, held until released."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        a, b, data = _two_layers_on_disk(store, torch.Generator().manual_seed(5))
        store.ensure_device([b[0]], pin=False)  # b: device, host, disk, disk
        store.promote(b[1], Tier.HOST).result(30)
        before = dict(store.stats()["moves"])
        _read(store, "segments", a, 4 * BT, 0, ahead=b)
        store.release_views()
        segments = store.read_segments(b, 4 * BT - 3, 1)
        with store._lock:
            held = {key for key in b if any(c.readers for c in store.table.get(key).copies.values())}
        assert held == {b[0], b[1]}  # the blocks in memory, for their views
        k = torch.cat([k for k, _ in segments], dim=-2)
        v = torch.cat([v for _, v in segments], dim=-2)
        want = [torch.cat([data[key][i] for key in b], dim=-2)[:, :, 1:4 * BT - 2] for i in (0, 1)]
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])
        assert len(segments) == 3  # the device block, the host block, the run of two in the buffer
        store.release_views()
        moves = store.stats()["moves"]
        done = {name: moves.get(name, {}).get("blocks", 0) - before.get(name, {}).get("blocks", 0)
                for name in ("disk->device", "disk->host")}
        assert done == {"disk->device": 4 + 2, "disk->host": 0}
        store.check()


@pytest.mark.parametrize("plan", ["in-order", "reversed", "repeated", "later-blocks", "middle-blocks", "first-block"])
def test_a_plan_in_any_order_is_read_once_into_a_layer_sized_buffer(tmp_path, plan):
    """A plug-in prefetch plan may name the next layer's blocks in any order, more than once,
    or only some of them. Each block is read ahead once, into the position its index gives,
    in a buffer no wider than the layer (+25%), and the layer's read then uses it. A plan
    repeated 20 times made the buffers 301 blocks wide and read every block 20 times, and a
    reversed one threw every read-ahead away (a review). A plan that leaves out the layer's
    first blocks placed the others where a read from the first block cannot use them: they
    were read again, and the read-ahead counted as unused; so were those of a plan too short
    for the layer (the buffer grew under them). The read now moves them where it wants
    them (a copy in memory) and uses them."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        a, b, data = _two_layers_on_disk(store, torch.Generator().manual_seed(4))
        ahead = {"in-order": b, "reversed": b[::-1], "repeated": b * 20, "later-blocks": b[2:],
                 "middle-blocks": [b[2], b[1]], "first-block": b[:1]}[plan]
        store.read_layer(a, 4 * BT, 0, hold=True, ahead=ahead)
        store.release_views()
        _reads_done(store)
        read_ahead = len(set(ahead))
        assert store.stats()["moves"]["disk->device"]["blocks"] == 4 + read_ahead
        widths = [bufs[0][0].shape[1] for bufs in store._streams._bufs if bufs is not None]
        assert max(widths) <= 4 + 4 // 4 + 1
        k, v = store.read_layer(b, 4 * BT, 0, hold=True)
        assert torch.equal(k, torch.cat([data[key][0] for key in b], dim=-2))
        assert torch.equal(v, torch.cat([data[key][1] for key in b], dim=-2))
        store.release_views()
        stats = store.stats()
        assert stats["moves"]["disk->device"]["blocks"] == 8  # nothing read twice
        assert stats["prefetch"]["used"] + stats["prefetch"]["late"] == read_ahead
        assert stats["prefetch"]["unused"] == 0
        store.check()


@pytest.mark.parametrize("memory", [False, True], ids=["disk-only", "some-in-memory"])
def test_an_interrupt_anywhere_in_a_streamed_read_leaves_nothing_held(tmp_path, memory):
    """Ctrl-C (a KeyboardInterrupt raised at a line of ``tiercache/streamread.py``, as a
    signal handler would raise it there) during layer reads with one and two layers read
    ahead (a layer already read ahead kept, another read), at every third line the reads run: afterwards no disk copy keeps a reader, no waiter is
    left a read that never ends, a block can be written, and both layers read back exactly.
    Disk copies kept readers for good (a later ``begin_write`` spun), and a read queued but
    not yet counted could write into a buffer after its result was handed out (a review).
    With blocks of the layers on the device and the host too, and the store's own lines
    traced as well (``_hold_in_memory``, ``release_views``, the hand-over of held copies to
    views): an interrupt there let a copy go twice (its readers at -1, the block then
    freed under its view) or kept it held for good (a review of this session's diff).
    Points where the interrupt lands on the exit of a ``with lock:`` are skipped: a trace
    function raises there before the lock is released, which no signal does."""
    import sys

    import tiercache.streamread as streamread

    def run(store, a, b, c):
        store.read_layer(a, 4 * BT, 0, hold=True, ahead=b)
        store.read_layer(b, 4 * BT, 0, hold=True, ahead=c + a)  # two layers ahead
        store.read_layer(c, 4 * BT, 0, hold=True, ahead=a + b)  # a kept, b read ahead
        store.read_segments(a, 4 * BT, 0)  # attend_in_place's read
        store.read_segments(b, 4 * BT - 3, 1, ahead=a)
        store.release_views()

    import tiercache.store as store_module

    # the store's side of a held read: taking readers, handing them to views, letting go
    traced = {(store_module.__file__, name) for name in ("read_layer", "read_segments", "_hold_in_memory",
                                                          "_views_of", "release_views", "_let_go")} if memory else set()

    def tracer(target):
        return line_interrupter(traced, target, files=(streamread.__file__,))
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    trial = [0]

    def fresh():
        trial[0] += 1
        path = tmp_path / f"t{trial[0]}"
        path.mkdir()
        store = BlockStore(tiny_config(path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                           persistent=False)
        a, b, c, data = _layers_on_disk(store, torch.Generator().manual_seed(3), 3)
        if memory:  # a device block in each layer, a host block in the second
            store.ensure_device([a[2], b[0]], pin=False)
            store.promote(b[1], Tier.HOST).result(30)
        return store, a, b, c, data

    store, a, b, c, _ = fresh()
    outer, count = tracer(0)
    sys.settrace(outer)
    try:
        run(store, a, b, c)
    finally:
        sys.settrace(None)
    store.close()
    lines = count[0]
    assert lines > 100
    tried = 0
    step = 7 if memory else 3
    for point in range(1, lines + 1, step):
        store, a, b, c, data = fresh()
        try:
            outer, _ = tracer(point)
            sys.settrace(outer)
            try:
                run(store, a, b, c)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            if store._lock._is_owned():  # the trace-only case in the docstring
                continue
            tried += 1
            store.release_views()
            for busy in store._streams._busy:
                for future in busy:
                    future.result(timeout=10)
            with store._lock:
                held = [key for key in store.table.keys() for c in store.table.get(key).copies.values() if c.readers]
            assert not held and not store._streaming, (point, held, store._streaming)
            for keys in (a, b, c):
                k, v = store.read_layer(keys, 4 * BT, 0, hold=True)
                assert torch.equal(k, torch.cat([data[key][0] for key in keys], dim=-2)), point
                assert torch.equal(v, torch.cat([data[key][1] for key in keys], dim=-2)), point
                store.release_views()
            store.ensure_device([b[1]])
            store.begin_write(b[1])
            store.unpin([b[1]])
            store.check()
        finally:
            if not store._lock._is_owned():
                store.close()
    assert tried > lines // (step + 1)


def test_a_sliding_layer_that_records_its_past_reads_only_its_window_ahead(tmp_path):
    """Assisted generation makes a sliding layer keep every block (to crop back), but its
    attention reads only the window. The prefetch plan named all it stored, and the next
    layer's out-of-window blocks were read from disk at every step and thrown away (a
    review: 399 reads where 168 did, 342 unused read-aheads). The plan now names what the
    layer reads; tokens stay DynamicCache's."""
    from test_hf_exactness import generate, prompt_ids, tight_config, tiny_model

    model = tiny_model("mistral")  # every layer slides
    ids = prompt_ids(length=14, seed=1)
    ref = generate(model, ids, max_new_tokens=40)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=15, host_blocks=2, reuse=False)
    with TieredCache(model, cfg) as cache:
        cache.activate_past_recording()
        out = generate(model, ids, cache=cache, max_new_tokens=40)
        stats = cache.stats()
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) == 0.0
    assert stats["moves"]["disk->device"]["blocks"] > 0
    assert stats["prefetch"]["unused"] <= 5, stats["prefetch"]


def test_wait_idle_waits_for_the_reads_ahead(tmp_path):
    """A forward returns with its last layer's read-ahead (the next step's first layer) still
    running; ``wait_idle`` waits for it too, so stats() taken after it stay put (a metrics
    test saw one more ``disk->device`` move in a scrape than in the stats() just before)."""
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=40), geometry,
                    persistent=False) as store:
        a, b, _ = _two_layers_on_disk(store, torch.Generator().manual_seed(5))
        for _ in range(5):
            store.read_layer(a, 4 * BT, 0, hold=True, ahead=b)
            store.release_views()
            store.wait_idle()
            assert not store._streaming
            assert all(read.done.done() for read in store._streams._pending[(0, 1)].reads.values())
            store.read_layer(b, 4 * BT, 0, hold=True, ahead=a)
            store.release_views()
            store.wait_idle()
            assert all(read.done.done() for read in store._streams._pending[(0, 0)].reads.values())


def test_a_disk_copy_being_read_ahead_is_held_until_the_read_ends(tmp_path):
    """A read ahead (the next layer's blocks, straight into attention's other buffer) runs
    on an I/O thread while the model computes. Its block is deleted meanwhile and new
    blocks fill the disk: the slot it reads must not be freed or reused until the read has
    ended, or it reads another block's bytes (a mutation that dropped the read's hold on
    the copy went unnoticed: the record's checks would have refused them, as wasted I/O or
    worse). Once the read ends, the slot is free again."""
    import threading

    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=3, host_blocks=3, disk_blocks=10), geometry,
                    persistent=False) as store:
        g = torch.Generator().manual_seed(1)
        a, b, _ = _two_layers_on_disk(store, g)
        entered, go = threading.Event(), threading.Event()
        read_unchecked = store.disk.read_unchecked

        def held_read(slot, key, parts, **kw):
            if key == b[0]:
                entered.set()
                assert go.wait(30), "the test never let the read go on"
            return read_unchecked(slot, key, parts, **kw)
        store.disk.read_unchecked = held_read
        try:
            store.read_layer(a, 4 * BT, 0, hold=True, ahead=b)
            store.release_views()
            assert entered.wait(30), "b[0] was not read ahead"
            copy = store.table.copy(b[0], Tier.DISK)
            assert copy.readers == 1
            store.delete(b[0])
            _fill_the_disk_around(store, copy.slot, g)
        finally:
            go.set()
        store.wait_idle()
        assert not any(c.slot == copy.slot for c in _disk_copies(store)) and store.table._slots[Tier.DISK].is_free(
            copy.slot), "the slot of the deleted block was not freed once its read ended"
        store.check()


def _disk_copies(store: BlockStore) -> list:
    return [c for c in (store.table.copy(k, Tier.DISK) for k in store.table.keys()) if c is not None]


def _fill_the_disk_around(store: BlockStore, held: int, g: torch.Generator) -> None:
    """Put new blocks and flush them until the disk is full, checking after each that the
    disk slot ``held`` was given to none of them."""
    for i in range(20):
        try:
            store.put(BlockKey(1, 0, i), torch.randn(store.geometry.shape, generator=g))
            store.flush()
        except CapacityError:
            break
        assert not store.table._slots[Tier.DISK].is_free(held), "the slot being read was freed"
        assert all(c.slot != held for c in _disk_copies(store)), "the slot being read was given to another block"


def test_read_destinations_are_made_once_per_buffer_and_follow_it_when_it_grows(tmp_path):
    """An I/O thread reads a disk block into byte views of its planes in the layer's
    buffer. The views (and whether direct I/O can use them) are made on a position's first
    read and kept with the buffer: making and checking them cost as much CPU per block as
    a third of the read itself. The story: a short layer is read, then a longer one, which
    makes the buffer grow, then the short one again. Every read must land in the buffer it
    returns (views kept from the buffer before the growth would write into freed memory and
    leave the result wrong); the planes here are whole pages, so every read may use direct
    I/O; and a position read twice into one buffer reuses its views."""
    geometry = BlockGeometry(1, 2, 16, 64, torch.float32)  # a plane: 16 x 64 x 4 B = one page
    with BlockStore(tiny_config(tmp_path, geometry, device_blocks=2, host_blocks=2, disk_blocks=40), geometry,
                    persistent=False) as store:
        g = torch.Generator().manual_seed(5)
        short = [BlockKey(0, 0, i) for i in range(2)]
        long = [BlockKey(0, 1, i) for i in range(9)]
        data = {}
        for key in short + long:
            data[key] = torch.randn(geometry.shape, generator=g)
            store.put(key, data[key])
        store.flush()
        for key in short + long:
            _to_disk(store, key)
        hints = []
        read_unchecked = store.disk.read_unchecked

        def noted(slot, key, parts, aligned=None):
            hints.append(aligned)
            return read_unchecked(slot, key, parts, aligned=aligned)
        store.disk.read_unchecked = noted
        made = []
        for keys in (short, short, long, long, short, long):  # each buffer is first short, then grows
            k, v = store.read_layer(keys, len(keys) * geometry.block_tokens, 0, hold=True)
            assert torch.equal(k, torch.cat([data[key][0] for key in keys], dim=-2))
            assert torch.equal(v, torch.cat([data[key][1] for key in keys], dim=-2))
            store.release_views()
            made.append([list(bufs[2]) for bufs in store._streams._bufs if bufs is not None])
        assert len(hints) == 3 * (len(short) + len(long))
        assert all(hint is True for hint in hints)
        # the buffers did not grow after the fourth read: the views made by then are reused
        assert all(a is b or a is None for x, y in zip(made[3], made[5]) for a, b in zip(x, y))
        assert any(a is not None and a is b for x, y in zip(made[3], made[5]) for a, b in zip(x, y))
        store.check()


@pytest.mark.parametrize("tiers", ["host+disk", "host", "next-layer"])
def test_auto_prefetch_reads_two_layers_ahead_where_disk_blocks_stream(tmp_path, tiers):
    """``prefetch="auto"``, the default, is ``lookahead`` (``prefetch_depth`` layers, 2) on a
    CPU cache with host and disk tiers, where each layer read ahead fills a buffer of its
    own: after a decode step the next step's first two layers are being read. It is
    ``next-layer`` without a disk tier, and a policy named is the policy used. Logits equal
    DynamicCache's over the prefill and every decode step."""
    model = _llama(4)
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    host_blocks, disk_blocks = (80, 0) if tiers == "host" else (8, 200)
    extra = {"prefetch": "next-layer"} if tiers == "next-layer" else {}
    cfg = tiny_config(tmp_path, geometry, device_blocks=16, host_blocks=host_blocks, disk_blocks=disk_blocks,
                      reuse=False, **extra)
    assert cfg.prefetch == extra.get("prefetch", "auto")
    ids = torch.randint(2, 64, (1, 48), generator=torch.Generator().manual_seed(1))
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), TieredCache(model, cfg) as cache:
        # said as configured until the first forward opens the store and resolves it
        assert cache.prefetch_name == extra.get("prefetch", "auto")
        out = model(ids, cache=cache, use_cache=True).logits
        want = model(ids, cache=ref, use_cache=True).logits
        assert (out - want).abs().max().item() == 0.0
        name = "lookahead" if tiers == "host+disk" else "next-layer"
        assert cache.prefetch_name == name and cache.prefetch_policy.name == name
        assert cache.prefetch_policy.depth == (2 if tiers == "host+disk" else 1)
        nxt = want[:, -1:].argmax(-1)
        for step in range(6):
            out = model(nxt, cache=cache, use_cache=True).logits
            want = model(nxt, cache=ref, use_cache=True).logits
            assert (out - want).abs().max().item() == 0.0, f"step {step}: logits differ"
            nxt = want[:, -1:].argmax(-1)
            if tiers == "host+disk":
                assert [layer for _, layer in cache.store._streams._pending] == [0, 1]
        streams = cache.store._streams
        if tiers == "host+disk":
            assert cache.stats()["prefetch"]["used"] > 0
        else:  # no disk tier: nothing streams; next-layer: one layer ahead at most
            assert (streams is None) == (tiers == "host") and (streams is None or len(streams._pending) <= 1)


@pytest.mark.parametrize("extra, name, depth", [
    (dict(prefetch_depth=6), "lookahead", 3),
    (dict(prefetch_depth=1), "lookahead", 1),
    (dict(selection="quest", selection_budget=64), "next-layer", 1),
    (dict(retention="streaming", retention_budget=64), "next-layer", 1),
], ids=["deep", "shallow", "selection", "retention"])
def test_auto_prefetch_reads_no_deeper_than_the_buffers_and_only_where_reads_stream(tmp_path, extra, name, depth):
    """``auto`` plans at most ``MAX_LAYERS_AHEAD`` layers: deeper, the layers past the
    buffers went up to the host tier, each pushing out a block a later layer reads (a
    review: depth 6 moved ~240 blocks disk -> host and wasted as many prefetches where depth
    2 moved none). With selection or retention the cache's reads go through the host tier,
    not into attention's buffers, so ``auto`` stays ``next-layer`` there."""
    from tiercache.streamread import MAX_LAYERS_AHEAD

    assert MAX_LAYERS_AHEAD == 3
    model = _llama(4)
    geometry = BlockGeometry(1, 2, BT, 8, torch.float32)
    cfg = tiny_config(tmp_path, geometry, device_blocks=16, host_blocks=8, disk_blocks=200, reuse=False, **extra)
    ids = torch.randint(2, 64, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), TieredCache(model, cfg) as cache:
        model(ids, cache=cache, use_cache=True)
        assert (cache.prefetch_name, cache.prefetch_policy.depth) == (name, depth)


def test_reads_ahead_left_at_the_end_of_a_run_are_counted_before_close(tmp_path):
    """A decode step reads the next step's first layers ahead. At the end of a run those are
    never used, and were counted as unused only at ``close()``, after ``tiercache generate``
    had printed and saved its stats ("unused: 0" while 94 blocks read ahead went unused; a
    review). ``drop_read_ahead()`` counts them when the run ends (the CLI calls it before
    its snapshot): the prefetch outcomes then cover every read ahead, and close() adds
    nothing. A step after it reads what it needs again, exact."""
    model = _llama()
    ids = torch.randint(2, 64, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad(), _tiered(model, tmp_path, device_blocks=16, host_blocks=8) as cache:
        model(ids, cache=cache, use_cache=True)
        nxt = model(ids, cache=ref, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = model(nxt, cache=cache, use_cache=True).logits
            want = model(nxt, cache=ref, use_cache=True).logits
            nxt = want[:, -1:].argmax(-1)
        assert (out - want).abs().max().item() == 0.0
        before = cache.stats()["prefetch"]
        dropped = cache.store.drop_read_ahead()
        assert dropped > 0, "the last step read nothing ahead: the scenario did not happen"
        at_end = cache.stats()["prefetch"]
        assert at_end["unused"] == before["unused"] + dropped
        assert cache.store.drop_read_ahead() == 0  # once
        out = model(nxt, cache=cache, use_cache=True).logits
        want = model(nxt, cache=ref, use_cache=True).logits
        assert (out - want).abs().max().item() == 0.0
        cache.store.drop_read_ahead()
        settled = cache.stats()["prefetch"]
    assert cache.stats()["prefetch"] == settled  # close() had nothing left to count
