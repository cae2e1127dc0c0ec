"""The decode fast path of ``TieredCache.update`` (``_update_resident``, ``BlockStore.hold_resident``
and, on a CPU store with a host tier, ``BlockStore.hold_mixed``).

When a layer's blocks are all on the device in adjacent slots and the new tokens fit in its
tail block, ``update`` takes one pass under the store's lock instead of ``ensure_device``,
``begin_write`` and ``read_layer``. The other exactness tests mostly run tiered set-ups on
CPU, where attention reads the host tier and this path is never taken; here every set-up
has no host tier (the device path of ``read_layer``, as on CUDA), so it is taken, and:

- the tokens and logits equal DynamicCache's (every family and generation mode);
- the counters (hits, moves, evictions, stall events, prefetch outcomes, reads as views or
  gathers) and the table's pins and readers equal those of the same run forced onto the
  general path;
- with a device budget that cannot hold everything (device + disk), steps fall back to the
  general path when blocks must move, and the result stays exact.

The mixed fast path (``hold_mixed``: a CPU store with a host tier and no disk, where
attention reads blocks on the device and on the host where they lie and gathers them) is
held to the same three promises with a device tier of one layer's blocks and a little more,
so that many blocks are read from the host.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tiercache  # noqa: E402
from tiercache import TierConfig  # noqa: E402
from tiercache.store import BlockStore  # noqa: E402
from tiercache.table import CopyState, Tier  # noqa: E402

from conftest import line_interrupter  # noqa: E402
from test_hf_exactness import (BT, CHUNK, FAMILIES, NEW, PAD, PROMPT, assert_same, assisted_read,  # noqa: E402
                               block_bytes, dynamic_cache_supports, generate, layer_windows, prompt_ids,
                               registered, tiny_model, working_set_blocks)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES = ["prefill", "chunked", "batch2", "beam", "assisted", "beam+batch2+chunked"]


def _inputs(family: str, mode: str):
    features = set(mode.split("+"))
    ids, mask, batch = prompt_ids(), None, 1
    kwargs = dict(max_new_tokens=NEW)
    if "chunked" in features:
        kwargs["prefill_chunk_size"] = CHUNK
    if "batch2" in features:
        batch = 2
        ids = prompt_ids(batch=2, seed=1)
        mask = torch.ones_like(ids)
        ids[1, :3] = PAD
        mask[1, :3] = 0
    if "beam" in features:
        batch *= 3
        kwargs.update(num_beams=3, num_return_sequences=1, length_penalty=0.0)
    if "assisted" in features:
        kwargs["assistant_model"] = tiny_model(family, assistant=True)
    return ids, mask, batch, kwargs


def _spy_fast(monkeypatch, name: str = "hold_resident") -> dict:
    """Count ``name`` calls (``hold_resident`` or ``hold_mixed``) that took the fast path,
    and those that fell back; ``from_host``: fast steps that read a block on the host."""
    counts = {"fast": 0, "general": 0, "from_host": 0}
    hold = getattr(BlockStore, name)

    def spy(self, *args, **kwargs):
        slot = hold(self, *args, **kwargs)
        counts["fast" if slot is not None else "general"] += 1
        if slot is not None and any(c is e.copies.get(Tier.HOST) for e, c in self._views):
            counts["from_host"] += 1
        return slot
    monkeypatch.setattr(BlockStore, name, spy)
    return counts


def _table_state(cache) -> dict:
    """Pins and readers of every block (what the next update or a move would see), the
    tokens the store counts in each, and each tier's eviction order (what the next eviction
    picks), by (layer, index): the two runs' caches have different sequence ids."""
    store = cache.store
    with store._lock:
        blocks = {(key.layer, key.index): (entry.pins, {tier: (c.slot, c.state, c.readers) for tier, c in entry.copies.items()},
                                           store._tokens.get(key))
                  for key, entry in store.table._blocks.items()}
        order = {tier.label: [(key.layer, key.index) for key in policy.evict(len(policy), lambda key: True)]
                 for tier, policy in store.policies.items()}
    return {"blocks": blocks, "eviction order": order}


def _run(model, ids, mask, cfg, kwargs, fast: bool):
    """One generate() on a TieredCache, on the fast path or forced onto the general one:
    its output, counters, reads, and the table's state after every update (a difference
    that a later step evens out is still a difference)."""
    with tiercache.TieredCache(model, cfg) as cache:
        if not fast:
            cache._plain = False  # the general path only
        states = []
        update = cache.update

        def spy(*args, **kw):
            out = update(*args, **kw)
            states.append(_table_state(cache))
            return out
        cache.update = spy
        out = generate(model, ids, cache=cache, mask=mask, **kwargs)
        stats = cache.stats()
        stats.pop("stall_seconds")
        for move in stats["moves"].values():  # how long a copy took is the machine's, not the path's
            move.pop("seconds")
        return out, stats, cache.attention_stats()["reads"] | {"gather_seconds": 0}, states


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_is_exact_and_changes_no_counter(family, mode, monkeypatch):
    reason = dynamic_cache_supports(family, mode)
    if reason:
        pytest.skip(f"DynamicCache cannot run {family}/{mode} either: {reason}")
    model = tiny_model(family)
    ids, mask, batch, kwargs = _inputs(family, mode)
    # Everything fits on the device: no host tier, no disk (bench decode's "fits").
    cfg = TierConfig(device_budget=64 * block_bytes(model, batch), host_budget=0, block_tokens=BT)
    ref = generate(model, ids, mask=mask, **kwargs)
    counts = _spy_fast(monkeypatch)
    out, stats, reads, table = _run(model, ids, mask, cfg, kwargs, fast=True)
    assert_same(ref, out, f"{family}/{mode}")
    assert counts["fast"] > 0, counts
    slow_out, slow_stats, slow_reads, slow_table = _run(model, ids, mask, cfg, kwargs, fast=False)
    assert torch.equal(slow_out.sequences, out.sequences)
    assert stats == slow_stats
    assert reads == slow_reads
    assert table == slow_table


@pytest.mark.parametrize("prefetch", ["next-layer", "none", "lookahead", "history"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_fast_path_falls_back_when_blocks_move(family, prefetch, monkeypatch, tmp_path):
    """Device and disk, no host: the device holds two layers' blocks and one more, so
    blocks move every step; updates whose blocks are resident take the fast path, the
    others the general one, and the output stays exact."""
    model = tiny_model(family)
    ids, new, bt = prompt_ids(length=PROMPT + 8), 2 * NEW, 2 * BT
    layers = model.config.num_hidden_layers
    bb = block_bytes(model, 1, bt)
    per_layer = -(-(ids.shape[1] + new) // bt)  # blocks of one full layer at the end
    rec = 4096 + -(-bb // 4096) * 4096
    cfg = TierConfig(device_budget=(2 * per_layer + 1) * bb, host_budget=0,
                     disk_dir=str(tmp_path / "kv"), disk_budget=4 * layers * per_layer * rec, block_tokens=bt,
                     prefetch=prefetch, io_workers=2, reuse=False)
    ref = generate(model, ids, max_new_tokens=new)
    counts = _spy_fast(monkeypatch)
    with tiercache.TieredCache(model, cfg) as cache:
        out = generate(model, ids, cache=cache, max_new_tokens=new)
        stats = cache.stats()
    assert_same(ref, out, f"{family}/{prefetch}")
    assert stats["evictions"]["device"] > 0, stats["evictions"]
    assert counts["fast"] > 0 and counts["general"] > 0, counts


@pytest.mark.parametrize("base", ["next-layer", "history"])
def test_a_prefetch_policy_hears_each_layer_once_when_the_fast_path_steps_aside(base, monkeypatch, tmp_path):
    """The fast path asks the prefetch policy for its plan before it knows whether it can
    run (the plan is part of what it checks). Where it steps aside, the general path must
    use that plan, not ask again: a policy that counts what it is told (``history``
    counts reads) would count the layer twice, and a plug-in would see two ``observe``
    and two ``plan`` calls for one layer's update.

    Device and disk as in the fall-back test above, so that both paths run, with a plug-in
    that records every call: one ``observe`` and one ``plan`` per update, layer by layer."""
    from tiercache.policies import PREFETCH_POLICIES

    heard: list = []

    class Recording(PREFETCH_POLICIES[base]):
        def observe(self, layer_idx, keys):
            heard.append(("observe", layer_idx))
            super().observe(layer_idx, keys)

        def plan(self, layer_idx, num_layers, blocks_of_layer):
            heard.append(("plan", layer_idx))
            return super().plan(layer_idx, num_layers, blocks_of_layer)

    model = tiny_model("llama")
    ids, new, bt = prompt_ids(length=PROMPT + 8), 2 * NEW, 2 * BT
    layers = model.config.num_hidden_layers
    bb = block_bytes(model, 1, bt)
    per_layer = -(-(ids.shape[1] + new) // bt)
    rec = 4096 + -(-bb // 4096) * 4096
    ref = generate(model, ids, max_new_tokens=new)
    counts = _spy_fast(monkeypatch)
    with registered(PREFETCH_POLICIES, "recording", Recording):
        cfg = TierConfig(device_budget=(2 * per_layer + 1) * bb, host_budget=0,
                         disk_dir=str(tmp_path / "kv"), disk_budget=4 * layers * per_layer * rec, block_tokens=bt,
                         prefetch="recording", io_workers=2, reuse=False)
        with tiercache.TieredCache(model, cfg) as cache:
            updates: list = []
            update = cache.update

            def spy(key_states, value_states, layer_idx, *args, **kwargs):
                updates.append(layer_idx)
                return update(key_states, value_states, layer_idx, *args, **kwargs)
            cache.update = spy
            out = generate(model, ids, cache=cache, max_new_tokens=new)
    assert_same(ref, out, base)
    assert counts["fast"] > 0 and counts["general"] > 0, counts  # both paths ran, and stepped aside
    assert heard == [(call, layer) for layer in updates for call in ("observe", "plan")]


def test_fast_path_views_move_with_the_slots(monkeypatch):
    """Beam reorders, crops and resets between steps: the layer views kept per slot range
    are rebuilt whenever a layer's blocks sit elsewhere, and K/V equal DynamicCache's."""
    model = tiny_model("llama")
    cfg = TierConfig(device_budget=64 * block_bytes(model, 1), host_budget=0, block_tokens=BT)
    counts = _spy_fast(monkeypatch)
    ref = __import__("transformers").DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(3)
    with tiercache.TieredCache(model, cfg) as cache, torch.no_grad():
        for step, q in enumerate([5, 1, 1, 1, 2, 1, 1, 3, 1, 1, 1, 1, 1]):
            if step == 6:
                cache.crop(-3)
                ref.crop(-3)
            if step == 9:  # a fresh sequence after reset: blocks get new slots
                cache.reset()
                ref = __import__("transformers").DynamicCache(config=model.config)
                q = 6
            for layer in range(model.config.num_hidden_layers):
                k = torch.randn(1, 2, q, 16, generator=g)
                v = torch.randn(1, 2, q, 16, generator=g)
                got = cache.update(k, v, layer)
                want = ref.update(k, v, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (step, layer)
    assert counts["fast"] > 0, counts


def _mixed_config(model, batch: int, mode: str) -> TierConfig:
    """CPU, device and host, no disk: the device holds one step's working set (the widest
    layer's blocks) and one block more; the host holds the rest."""
    if "assisted" in mode:  # every layer counted as a full one (``assisted_read``)
        widest = -(-assisted_read(layer_windows(model)) // BT)
    else:
        widest = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    bb = block_bytes(model, batch)
    return TierConfig(device_budget=(widest + 1) * bb, host_budget=64 * -(-bb // 4096) * 4096, block_tokens=BT)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_fast_path_is_exact_and_changes_no_counter(family, mode, monkeypatch):
    """A CPU store with a host tier: decode steps whose blocks all lie on the device or the
    host take ``hold_mixed`` and gather what they read from the host, and everything a user
    or the next step can see is what the general path gives: tokens equal DynamicCache's,
    counters, reads and the table's pins and readers equal the same run's on the general
    path."""
    reason = dynamic_cache_supports(family, mode)
    if reason:
        pytest.skip(f"DynamicCache cannot run {family}/{mode} either: {reason}")
    model = tiny_model(family)
    ids, mask, batch, kwargs = _inputs(family, mode)
    cfg = _mixed_config(model, batch, mode)
    ref = generate(model, ids, mask=mask, **kwargs)
    # No write-behind: its copies to the host finish whenever a worker gets to them, so the
    # tables of two runs (and what later evictions choose) would differ by timing alone.
    monkeypatch.setattr(BlockStore, "write_behind", lambda self, key: None)
    counts = _spy_fast(monkeypatch, "hold_mixed")
    out, stats, reads, table = _run(model, ids, mask, cfg, kwargs, fast=True)
    assert_same(ref, out, f"{family}/{mode}")
    assert counts["fast"] > 0 and counts["from_host"] > 0, counts
    assert stats["tiers"]["host"]["blocks"] > 0, stats["tiers"]
    slow_out, slow_stats, slow_reads, slow_table = _run(model, ids, mask, cfg, kwargs, fast=False)
    assert torch.equal(slow_out.sequences, out.sequences)
    assert stats == slow_stats
    assert reads == slow_reads
    assert table == slow_table


def test_mixed_fast_path_is_not_taken_with_a_disk_tier_or_attend_in_place(monkeypatch, tmp_path):
    """With a disk tier, ``read_layer`` reads through its disk streams, and with
    ``attend_in_place`` attention reads the blocks where they lie: the mixed fast path
    (a gather of its own) steps aside for both, and the output stays exact."""
    model = tiny_model("llama")
    ids = prompt_ids()
    ref = generate(model, ids, max_new_tokens=NEW)
    base = _mixed_config(model, 1, "prefill")
    for extra in (dict(disk_dir=str(tmp_path / "kv"), disk_budget="4MiB"), dict(attend_in_place=True)):
        counts = _spy_fast(monkeypatch, "hold_mixed")
        cfg = TierConfig(**{**{f: getattr(base, f) for f in ("device_budget", "host_budget", "block_tokens")},
                            **extra})
        # wrap() changes the model it is given: a model of this test's own, not the shared one
        model_for = tiercache.wrap(tiny_model.__wrapped__("llama"), cfg) if "attend_in_place" in extra else model
        with tiercache.TieredCache(model_for, cfg) as cache:
            out = generate(model_for, ids, cache=cache, max_new_tokens=NEW)
            in_place = cache.in_place_steps
        if "attend_in_place" in extra:
            assert in_place > 0  # block attention ran, so the probe step saw the hook
            assert (out.sequences == ref.sequences).all()
            # only the probe: the first decode update, which gathers on the general path too
            # (its keys carry the probe that shows the hook sees this cache)
            assert counts["fast"] <= 1, (extra, counts)
        else:
            assert_same(ref, out, "llama/disk")
            assert counts["fast"] == 0, (extra, counts)


def test_mixed_fast_path_changes_nothing_where_it_steps_aside():
    """``hold_mixed`` returns None and leaves pins, readers, policies and counters as they
    were when: the write block is unknown or has no device copy, a read block is unknown or
    only being filled, the write block is being read. Taken, it pins the write block (into
    the caller's list, in the same statement), counts a hit on the tier each
    block is read from (the device where a block has both copies; the write block once,
    as one of them), and holds every read
    block until ``read_held`` has gathered them, and then lets them go."""
    from tiercache.store import BlockStore as Store
    from tiercache.tiers import BlockGeometry
    from tiercache.table import BlockKey

    g = BlockGeometry(1, 2, 4, 8, torch.float32)
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=8 * g.padded_bytes, block_tokens=4)
    with Store(cfg, g, device=torch.device("cpu"), persistent=False) as store:
        keys = [BlockKey(0, 0, i) for i in range(4)]
        blocks = [torch.randn(g.shape) for _ in keys]
        for key, block in zip(keys, blocks):
            store.put(key, block)
        store.demote_now(keys[:2])  # blocks 0, 1 on the host; 2, 3 on the device
        before = (store.stats(), _pins_readers(store))
        assert store.hold_mixed(BlockKey(0, 0, 9), keys) is None  # no such write block
        assert store.hold_mixed(keys[0], keys) is None  # the write block is on the host only
        assert store.hold_mixed(keys[3], keys + [BlockKey(0, 0, 9)]) is None  # a read block not stored
        assert (store.stats(), _pins_readers(store)) == before
        pinned: list = []
        assert store.hold_mixed(keys[3], keys, ahead=[BlockKey(0, 0, 7)], pinned=pinned) is not None
        assert pinned == [keys[3]]  # the caller's record of the pin
        store.release_views()
        store.unpin(pinned)
        after_first = (store.stats(), _pins_readers(store))
        assert after_first[1] == before[1]
        for state, readers, tier, key in [(None, 1, Tier.DEVICE, keys[3]),  # a reader of another thread:
                                          # begin_write would wait
                                          (CopyState.FILLING, 0, Tier.HOST, keys[1])]:  # not written yet
            with store._lock:
                copy = store.table.get(key).copies[tier]
                was = copy.state
                copy.state, copy.readers = state or was, copy.readers + readers
            try:
                assert store.hold_mixed(keys[3], keys) is None
            finally:
                with store._lock:
                    copy.state, copy.readers = was, copy.readers - readers
            assert (store.stats(), _pins_readers(store)) == after_first

        store.ensure_device([keys[1]], pin=False)  # block 1 now on the device and the host
        hits = store.stats()["hits"]
        slot = store.hold_mixed(keys[3], keys)
        assert slot == store.device_slot(keys[3])
        # the device copy is read where there are both, as read_layer reads it
        assert [t.label for e, c in store._views for t in (Tier.DEVICE, Tier.HOST) if e.copies.get(t) is c] == \
            ["host", "device", "device", "device"]
        now = store.stats()["hits"]
        # once each: the write block is among the blocks read (it was counted twice, a review)
        assert (now["device"] - hits["device"], now["host"] - hits["host"]) == (3, 1)
        held = _pins_readers(store)
        assert held[keys[3]][0] == 1 and all(r == 1 for key in keys for r in held[key][1].values() if r), held
        k, v = store.read_held(16)
        assert torch.equal(k, torch.cat(blocks, dim=3)[0])
        store.unpin([keys[3]])
        # The write block with a host copy too (fetched by a prefetch, say): that copy would be
        # stale once the new tokens are written, so it goes, as begin_write drops it.
        assert store.hold_mixed(keys[1], keys) == store.device_slot(keys[1])
        assert store.tiers_of(keys[1]) == [Tier.DEVICE]
        store.unpin([keys[1]])
        store.release_views()
        # A block a prefetch brought to the device is read there, and the prefetch counts as used.
        store.prefetch([keys[0]], dst=Tier.DEVICE)
        store.wait_idle()
        used = store.stats()["prefetch"]["used"]
        assert store.hold_mixed(keys[3], keys) is not None
        assert store.stats()["prefetch"]["used"] == used + 1
        assert store._views[0][1] is store.table.get(keys[0]).copies[Tier.DEVICE]
        k, v = store.read_held(15, 1)
        want = torch.cat(blocks, dim=3)  # [2, B, H, 16, D]
        assert torch.equal(k, want[0][:, :, 1:]) and torch.equal(v, want[1][:, :, 1:])
        assert all(sum(r for r in _pins_readers(store)[key][1].values()) == 0 for key in keys)
        store.unpin([keys[3]])
        assert all(pins == 0 and not any(readers.values()) for pins, readers in _pins_readers(store).values())
        # Tokens past the blocks held are refused, and what was held is let go.
        assert store.hold_mixed(keys[3], keys) is not None
        with pytest.raises(ValueError, match="read_held: tokens 1 .. 17"):
            store.read_held(16, 1)
        store.unpin([keys[3]])
        assert all(pins == 0 and not any(readers.values()) for pins, readers in _pins_readers(store).values())


def _pins_readers(store) -> dict:
    with store._lock:
        return {key: (entry.pins, {t.label: c.readers for t, c in entry.copies.items()})
                for key, entry in store.table._blocks.items()}


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "layer-cycle", "sinks-recent"])
def test_mixed_fast_path_tells_the_policies_what_the_general_path_does(eviction, monkeypatch):
    """Every eviction policy sees the same inserts, touches and removals on the mixed fast
    path as on the general one (so it ranks the blocks the same, and the next eviction
    picks the same victim), and the output stays exact."""
    model = tiny_model("llama")
    ids, mask, batch, kwargs = _inputs("llama", "batch2")
    base = _mixed_config(model, batch, "batch2")
    cfg = TierConfig(device_budget=base.device_budget, host_budget=base.host_budget, block_tokens=BT,
                     eviction=eviction)
    ref = generate(model, ids, mask=mask, **kwargs)
    monkeypatch.setattr(BlockStore, "write_behind", lambda self, key: None)  # as above
    counts = _spy_fast(monkeypatch, "hold_mixed")
    out, stats, reads, table = _run(model, ids, mask, cfg, kwargs, fast=True)
    assert_same(ref, out, eviction)
    assert counts["fast"] > 0 and counts["from_host"] > 0, counts
    slow_out, slow_stats, slow_reads, slow_table = _run(model, ids, mask, cfg, kwargs, fast=False)
    assert (stats, reads) == (slow_stats, slow_reads)
    assert table == slow_table


@pytest.mark.parametrize("path", ["hold_mixed", "read_layer"])
def test_a_ctrl_c_anywhere_in_the_mixed_fast_path_leaves_nothing_held(path):
    """A KeyboardInterrupt at each line of ``hold_mixed``, ``read_held`` and the store code
    they run, in turn (or of ``read_layer(hold=False)``, which shares the gather): once the
    caller lets go of what it holds on record (the views, with ``release_views``, and the
    pins its list names, with ``unpin``), no block is pinned or read, every block reads back
    its bytes, and the table's books add up (``check``). A reader taken in one statement
    and listed in the next was kept for good by an interrupt between them, and the next
    ``begin_write`` of that block waited forever; ``read_layer(hold=False)`` kept the
    readers of an interrupt between its hold and its gather (a review). The counting of
    public calls is swept too (``_enter``, ``_leave``): an interrupt between ``_leave``'s
    two updates left the call counted and its thread's mark cleared, and ``close()``
    waited for it forever. (Not the wrapper's own lines: a tracer raises on lines where no
    signal is checked, such as the store of ``calls.depth`` in its ``finally``.)"""
    import sys

    import tiercache.store as store_module
    import tiercache.table as table_module
    from tiercache.store import BlockStore as Store
    from tiercache.table import BlockKey
    from tiercache.tiers import BlockGeometry

    traced = {(store_module.__file__, name) for name in (
        "hold_mixed", "_hold_step", "read_held", "_read_held", "_views_of", "release_views", "_let_go",
        "_gather_mixed", "_count_gather", "read_layer", "_hold_in_memory", "_prefetch_ahead",
        "_enter", "_leave")} | \
        {(table_module.__file__, "pin_listed")}

    def tracer(target):
        return line_interrupter(traced, target)

    g = BlockGeometry(1, 2, 4, 8, torch.float32)
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=8 * g.padded_bytes, block_tokens=4)
    keys = [BlockKey(0, 0, i) for i in range(4)]
    blocks = [torch.randn(g.shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = torch.cat(blocks, dim=3)

    def fresh():
        store = Store(cfg, g, device=torch.device("cpu"), persistent=False)
        for key, block in zip(keys, blocks):
            store.put(key, block)
        store.demote_now(keys[:2])  # read from the host: 0, 1; from the device: 2, 3
        return store

    def step(store, pinned):
        if path == "hold_mixed":
            assert store.hold_mixed(keys[3], keys, pinned=pinned) is not None
            k, v = store.read_held(16)
        else:
            k, v = store.read_layer(keys, 16)
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])

    store = fresh()
    outer, count = tracer(0)
    sys.settrace(outer)
    try:
        step(store, [])
    finally:
        sys.settrace(None)
        store.close()
    lines = count[0]
    assert lines > 60
    tried = 0
    for point in range(1, lines + 1):
        store, pinned = fresh(), []
        try:
            outer, _ = tracer(point)
            sys.settrace(outer)
            try:
                step(store, pinned)
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            if store._lock._is_owned():  # raised where only a tracer can (the lock taken, its with not entered)
                continue
            tried += 1
            store.release_views()
            store.unpin(pinned)
            busy = {key: (pins, readers) for key, (pins, readers) in _pins_readers(store).items()
                    if pins or any(readers.values())}
            assert not busy, (point, busy)
            assert store._active == 0, (point, "a call is still counted: close() would wait for it forever")
            k, v = store.read_layer(keys, 16, hold=True)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), point
            store.release_views()
            store.check()
        finally:
            if not store._lock._is_owned() and not store._active:
                store.close()
    assert tried > lines // 2, (tried, lines)
