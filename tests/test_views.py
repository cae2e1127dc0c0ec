"""Reads without copies: a layer whose blocks sit in adjacent device slots is returned as
views of the device pool (held until ``release_views``); other layers are gathered. Both
must give exactly the bytes written, and a held block must never be freed or reused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache import BlockKey, Tier, TierConfig, TieredCache
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry, DevicePool

from conftest import tiny_config
from test_hf_exactness import assert_same, generate, kv_shape, prompt_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _aliases_pool(store: BlockStore, t: torch.Tensor) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return ptr in (store.device_pool.k.untyped_storage().data_ptr(), store.device_pool.v.untyped_storage().data_ptr())


def _fill(store: BlockStore, keys: list, near=None, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    data = {}
    slots = store.new_blocks(keys, near=near)
    for key, slot in zip(keys, slots):
        block = torch.randn(store.geometry.shape, generator=g).to(store.geometry.dtype)
        store.device_pool.write_block(slot, block)
        data[key] = block
    store.unpin(keys)
    return data


def _expected(data: dict, keys: list, num_tokens: int, start: int) -> tuple:
    k = torch.cat([data[key][0] for key in keys], dim=-2)[:, :, start:start + num_tokens]
    v = torch.cat([data[key][1] for key in keys], dim=-2)[:, :, start:start + num_tokens]
    return k, v


def test_consecutive():
    assert DevicePool.consecutive([3]) and DevicePool.consecutive([4, 5, 6])
    assert not DevicePool.consecutive([]) and not DevicePool.consecutive([5, 4])
    assert not DevicePool.consecutive([1, 3]) and not DevicePool.consecutive([1, 2, 2, 3])


@pytest.mark.parametrize("host", [False, True])
def test_adjacent_device_blocks_are_read_in_place_and_held_until_released(tmp_path, geometry, host):
    cfg = tiny_config(tmp_path, geometry, device_blocks=6, host_blocks=3 if host else 0, disk_blocks=20)
    with BlockStore(cfg, geometry) as store:
        keys = [BlockKey(0, 0, i) for i in range(3)]
        data = _fill(store, keys, near=2)
        assert store.device_slots(keys) == [2, 3, 4]
        k, v = store.read_layer(keys, 3 * geometry.block_tokens - 3, 1, hold=True)
        assert _aliases_pool(store, k) and _aliases_pool(store, v)
        want_k, want_v = _expected(data, keys, 3 * geometry.block_tokens - 3, 1)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        # Held: deleting them frees nothing, and new blocks never land in their slots.
        for key in keys:
            store.delete(key)
        store.check()
        assert store.table.num_free(Tier.DEVICE) == 3
        others = [BlockKey(1, 0, i) for i in range(3)]
        _fill(store, others, near=2, seed=1)
        assert not set(store.device_slots(others)) & {2, 3, 4}
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        store.release_views()
        store.check()
        assert store.table.num_free(Tier.DEVICE) == 3
        # Without hold, or when the slots are not in order: a copy.
        k2, _ = store.read_layer(others, 2, 0)
        assert not _aliases_pool(store, k2)
        k3, _ = store.read_layer(list(reversed(others)), 2, 0, hold=True)
        assert not _aliases_pool(store, k3)
        assert not store._views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_device_and_host_blocks_gather_exactly(tmp_path, dtype):
    geometry = BlockGeometry(batch=2, kv_heads=2, block_tokens=4, head_dim=8, dtype=dtype)
    cfg = tiny_config(tmp_path, geometry, device_blocks=4, host_blocks=8, disk_blocks=20)
    with BlockStore(cfg, geometry) as store:
        keys = [BlockKey(0, 0, i) for i in range(8)]
        data = {}
        for i, key in enumerate(keys):  # later blocks push earlier ones down to the host
            data.update(_fill(store, [key], seed=i))
        store.wait_idle()
        store.ensure_device([keys[1], keys[2]], pin=False)  # a run of device blocks amid host ones
        tiers = [store.tiers_of(key)[0] for key in keys]
        assert Tier.HOST in tiers and Tier.DEVICE in tiers
        order = [keys[3], keys[1], keys[2], keys[0], keys[7], keys[5]]
        for start, n in ((0, 24), (3, 17), (1, 22), (0, 23), (5, 2), (4, 8)):
            k, v = store.read_layer(order, n, start, hold=True)
            want_k, want_v = _expected(data, order, n, start)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
            store.release_views()
        store.check()


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_copy_tokens_copies_exactly_the_tokens_read(kind):
    """The gather copies only the tokens attention reads: whole blocks in one copy, a partly
    read first or last block alone; nothing outside [lo, hi) of the run is written."""
    from tiercache.store import _copy_tokens

    rows, blocks, bt, unit = 3, 4, 4, 2
    src = torch.arange(rows * blocks * bt * unit, dtype=torch.float32).view(rows, blocks, bt * unit)
    for lo, hi in ((0, 16), (1, 16), (0, 15), (3, 13), (5, 7), (4, 8), (8, 8), (15, 16)):
        dst = torch.full_like(src, -1.0)
        if kind == "numpy":
            _copy_tokens(np.copyto, dst.numpy(), src.numpy(), lo, hi, bt, unit)
        else:
            _copy_tokens(torch.Tensor.copy_, dst, src, lo, hi, bt, unit)
        flat_dst, flat_src = dst.view(rows, -1), src.view(rows, -1)
        assert torch.equal(flat_dst[:, lo * unit:hi * unit], flat_src[:, lo * unit:hi * unit]), (lo, hi)
        assert (flat_dst[:, :lo * unit] == -1).all() and (flat_dst[:, hi * unit:] == -1).all(), (lo, hi)


def test_write_tokens_from_a_strided_slice(geometry):
    pool = DevicePool(geometry, 3, "cpu")
    g = geometry
    src = torch.randn(g.batch, g.kv_heads, 10, g.head_dim)
    pool.write_tokens(1, 1, src[:, :, 4:7], src[:, :, 2:5] * 2)
    k, v = pool.view(1, 1, 3, 1)
    assert torch.equal(k, src[:, :, 4:7]) and torch.equal(v, src[:, :, 2:5] * 2)


def test_write_tokens_outside_its_slot_is_refused_and_writes_nothing(geometry):
    """``write_tokens`` writes through a strided view it builds itself, which would not stop
    at a slot's end: tokens past the block, a negative offset or a slot outside the pool are
    refused before anything is written (the neighbouring slots keep their bytes)."""
    g = geometry
    pool = DevicePool(g, 3, "cpu")
    pool.k.fill_(-1)
    pool.v.fill_(-1)
    new = torch.randn(g.batch, g.kv_heads, 2, g.head_dim)
    for slot, offset in [(1, g.block_tokens - 1), (1, -1), (3, 0), (-1, 0)]:
        with pytest.raises((ValueError, IndexError), match="write_tokens"):
            pool.write_tokens(slot, offset, new, new)
    assert (pool.k == -1).all() and (pool.v == -1).all()
    pool.write_tokens(2, g.block_tokens - 2, new, new)  # the last two tokens of the last slot
    k, v = pool.view(2, 1, 2, g.block_tokens - 2)
    assert torch.equal(k, new) and torch.equal(v, new)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("mode", ["greedy", "beam", "batch2"])
def test_a_roomy_device_tier_reads_layers_in_place_and_stays_exact(family, mode, monkeypatch):
    """Blocks of a layer go to adjacent slots, so attention reads them in place; logits are
    still DynamicCache's (sliding layers free blocks while their views are held)."""
    model = tiny_model(family)
    batch = 2 if mode == "batch2" else 1
    ids = prompt_ids(batch)
    kwargs = dict(max_new_tokens=10, num_beams=2 if mode == "beam" else 1)
    ref = generate(model, ids, **kwargs)
    reads = {"view": 0, "copy": 0}
    original = BlockStore.read_layer

    def counting(self, *args, **kw):
        k, v = original(self, *args, **kw)
        reads["view" if _aliases_pool(self, k) else "copy"] += 1
        return k, v

    monkeypatch.setattr(BlockStore, "read_layer", counting)
    with TieredCache(model, TierConfig(device_budget="1MiB", host_budget=0, block_tokens=4)) as cache:
        out = generate(model, ids, cache=cache, **kwargs)
        cache.store.check()
    assert_same(ref, out, f"{family} {mode}")
    assert reads["view"] > 0 and reads["view"] >= reads["copy"], reads


def test_read_stats_count_views_and_gather_copies():
    """attention_stats()["reads"] says how each layer read got its K/V: zero-copy views of
    the device pool, or a gather copy (with its bytes and seconds). With everything on the
    device every read is a view; with most blocks on the host every decode read copies
    exactly the blocks attention needs; with attention in place only the reads before it starts gather."""
    model = tiny_model("llama")
    ids = prompt_ids(1)
    layers, new, bt = model.config.num_hidden_layers, 6, 4
    kv_heads, head_dim = kv_shape(model)
    block_bytes = 2 * kv_heads * bt * head_dim * 4  # K and V of one block, batch 1, fp32
    # Forwards: the prompt, then one per new token but the last; each reads every token so
    # far, and a gather copies just those (not the unwritten rest of the tail block).
    tokens_read = [ids.shape[1] + s for s in range(new)]
    per_token = block_bytes // bt

    def reads_of(**budgets):
        with TieredCache(model, TierConfig(block_tokens=bt, **budgets)) as cache:
            generate(model, ids, cache=cache, max_new_tokens=new)
            assert cache.store.geometry.block_bytes == block_bytes
            return cache.attention_stats(), cache.stats()

    stats, _ = reads_of(device_budget="1MiB", host_budget=0)
    assert stats["reads"] == {"views": layers * new, "gathers": 0, "gathered_bytes": 0, "gather_seconds": 0.0}

    stats, tiers = reads_of(device_budget=4 * block_bytes, host_budget="1MiB")
    reads = stats["reads"]
    assert tiers["tiers"]["host"]["blocks"] > 0
    # Every decode read gathers (no layer fits on the device); in the prompt's forward the
    # first layers still find their fresh blocks side by side on the device.
    assert reads["views"] + reads["gathers"] == layers * new and reads["views"] < layers
    assert reads["gathered_bytes"] == (layers * sum(tokens_read) - reads["views"] * tokens_read[0]) * per_token
    assert reads["gather_seconds"] > 0

    stats, _ = reads_of(device_budget=4 * block_bytes, host_budget="1MiB", attend_in_place=True)
    # The prompt's layers (views or gathers) and layer 0 of the first decode step (which
    # probes the hook) read with read_layer; every later decode read is in place.
    reads = stats["reads"]
    assert reads["views"] + reads["gathers"] == layers + 1 and reads["views"] < layers
    assert stats["in_place_layer_steps"] == layers * (new - 1) - 1
    assert reads["gathered_bytes"] == ((layers - reads["views"]) * tokens_read[0] + tokens_read[1]) * per_token
