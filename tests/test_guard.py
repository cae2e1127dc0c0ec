"""A plug-in eviction policy's bugs never cost data (``tiercache.guard``).

The store tells its policies of each change between the steps of that change. A plug-in
that raised there used to leave the step half done: a fault-injection run found ``put``
leaving its block pinned for good and READY with the bytes its slot held before. Each
scenario here breaks a plug-in in one way; the blocks must read back exactly, no pin or
move may be left behind, the user must hear of the bug by name (``PolicyError``), and the
store must go on working with ``lru`` in the plug-in's place.
"""
from __future__ import annotations

import random

import pytest
import torch

from tiercache import BlockKey, PolicyError, Tier
from tiercache.guard import GuardedPolicy
from tiercache.policies import EVICTION_POLICIES

LRU = EVICTION_POLICIES["lru"]


class Bug(Exception):
    """What the plug-ins below raise."""


@pytest.fixture
def plugin():
    """Register a plug-in class under a name for one test; returns the register function."""
    names = []

    def register(cls, name="flaky"):
        EVICTION_POLICIES[name] = cls
        names.append(name)
        return name
    yield register
    for name in names:
        del EVICTION_POLICIES[name]


def block(geometry, seed):
    return torch.randn(geometry.shape, generator=torch.Generator().manual_seed(seed))


def no_pins(store) -> bool:
    return all(store.table.get(key).pins == 0 for key in store.table.keys())


def test_a_plugin_that_raises_while_a_block_is_stored_costs_no_data(make_store, geometry, plugin):
    """The case the fault injection found. A block is stored and deleted, so that its slot
    holds its bytes; then a new block is stored into that slot while the plug-in's
    ``insert`` raises. ``put`` completes (the table had committed the slot, and the guard
    keeps the policy's bug out of it): the new block reads back exactly, nothing stays
    pinned. The next call raises a ``PolicyError`` that names the policy, the tier and the
    method; after it, the device tier evicts with ``lru`` and the store works as before."""
    class RaisesOnInsert(LRU):
        armed = False

        def insert(self, key):
            if RaisesOnInsert.armed:
                raise Bug("insert broke")
            super().insert(key)

    store = make_store(device_blocks=3, host_blocks=3, disk_blocks=20, eviction=plugin(RaisesOnInsert))
    old, new = BlockKey(0, 0, 0), BlockKey(0, 0, 1)
    store.put(old, block(geometry, 1))
    store.delete(old)
    RaisesOnInsert.armed = True
    store.put(new, block(geometry, 2))  # the guard reports the bug; put itself completes
    RaisesOnInsert.armed = False
    assert no_pins(store), "put left its block pinned"
    with pytest.raises(PolicyError, match=r"'flaky' of the device tier failed in insert: Bug: insert broke") as info:
        store.get(new)
    assert isinstance(info.value.__cause__, Bug)
    assert torch.equal(store.get(new), block(geometry, 2)), "the block read back other bytes"
    guard = store.policies[Tier.DEVICE]
    assert isinstance(guard, GuardedPolicy) and type(guard.inner) is LRU
    store.check()  # lru ranks exactly what each tier holds
    keys = [BlockKey(0, 0, i) for i in range(2, 12)]  # more than the device holds: evictions
    for i, key in enumerate(keys):
        store.put(key, block(geometry, 10 + i))
    store.wait_idle()
    store.check()
    for i, key in enumerate(keys):
        assert torch.equal(store.get(key), block(geometry, 10 + i))


@pytest.mark.parametrize("breach, message", [
    ("pinned", r"named BlockKey\(seq=0, layer=0, index=0\), which may not be evicted now"),
    ("twice", r"named a block twice"),
    ("too many", r"evict\(1\) returned 2 victims"),
    ("none", r"evict\(1\) returned None with 2 blocks evictable"),
])
def test_a_plugin_victim_outside_the_contract_is_not_evicted(make_store, geometry, plugin, breach, message):
    """``evict`` must name ``n`` distinct blocks that ``is_evictable`` allows, or None when
    fewer are evictable. A plug-in that names a pinned block (here: always the oldest,
    pinned by the test), a block twice or too many blocks would have had the store move or
    drop what it may not; one that says None while two blocks could go, refuse the put
    with a ``CapacityError`` that blames the pins. The guard
    checks the answer; ``lru`` answers instead, so the put that needed room completes, the
    pinned block stays on the device with its bytes, and the next call raises the breach."""
    class Careless(LRU):
        def evict(self, n, is_evictable):
            oldest = list(self._order)  # without asking is_evictable
            if breach == "pinned":
                return oldest[:n]
            if breach == "twice":
                return [oldest[1]] * (n + 1)
            if breach == "none":  # "fewer than n evictable": the store would believe it
                return None
            return oldest[1:n + 2]

    store = make_store(device_blocks=3, host_blocks=3, disk_blocks=20, eviction=plugin(Careless))
    keys = [BlockKey(0, 0, i) for i in range(4)]
    for i, key in enumerate(keys[:3]):
        store.put(key, block(geometry, i))
    store.pin([keys[0]])
    store.put(keys[3], block(geometry, 3))  # needs one device slot: the plug-in names its victim
    assert store.table.is_ready(keys[0], Tier.DEVICE), "the pinned block left the device"
    with pytest.raises(PolicyError, match=message):
        store.get(keys[0])
    for i, key in enumerate(keys):
        assert torch.equal(store.get(key), block(geometry, i))
    store.unpin([keys[0]])
    assert no_pins(store)
    store.check()


@pytest.mark.timeout(120)
def test_a_failure_inside_a_call_is_raised_by_the_next_one_not_halfway(make_store, geometry, plugin):
    """``ensure_device`` makes room (the plug-in's ``evict`` raises there), queues its
    fetches and then prefetches the next blocks (``ahead``) with a call of its own before
    it copies. That inner call does not raise the failure: were it to, ``ensure_device``
    would stop halfway (its fetches handed to a worker, its pins let go) and raise. It
    completes instead, with every block on the device, and the next call raises it."""
    class RaisesOnEvict(LRU):
        armed = False

        def evict(self, n, is_evictable):
            if RaisesOnEvict.armed:
                raise Bug("evict broke")
            return super().evict(n, is_evictable)

    store = make_store(device_blocks=3, host_blocks=6, disk_blocks=20, eviction=plugin(RaisesOnEvict))
    keys = [BlockKey(0, 0, i) for i in range(6)]
    for i, key in enumerate(keys):
        store.put(key, block(geometry, i), tier=Tier.HOST)
    store.ensure_device(keys[:2], pin=False)
    RaisesOnEvict.armed = True
    store.ensure_device(keys[2:4], pin=False, ahead=[keys[4]])
    RaisesOnEvict.armed = False
    assert all(store.table.is_ready(key, Tier.DEVICE) for key in keys[2:4])
    with pytest.raises(PolicyError, match="failed in evict: Bug: evict broke"):
        store.ensure_device(keys[4:], pin=False)
    store.wait_idle()
    assert not store._inflight and no_pins(store)
    store.check()
    for i, key in enumerate(keys):
        assert torch.equal(store.get(key), block(geometry, i))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plugin_that_raises_anywhere_never_costs_a_block(make_store, geometry, plugin, seed):
    """Fault injection: a plug-in that raises in any call with probability 0.2, under puts,
    reads, deletes, fetches to the device, demotions and promotions on three tiny tiers
    (moves completed by two workers, so a failure can land on a worker's thread). After
    every step: each block stored reads back exactly, ``check()`` holds (the table's
    invariants, the budgets, the in-flight books, and each tier's policy ranking exactly
    what the tier holds) and nothing stays pinned. After each failure (a ``PolicyError``
    from some later call) the test starts again with a fresh store, so that the plug-in
    itself keeps being called. With the plug-in called directly instead (the store before
    the guard), each seed left a put's block pinned for good within its first six steps."""
    rng = random.Random(seed)
    armed = [False]

    def maybe(method):
        if armed[0] and rng.random() < 0.2:
            raise Bug(method)

    class Flaky(LRU):
        def insert(self, key): maybe("insert"); super().insert(key)  # noqa: E702
        def touch(self, key): maybe("touch"); super().touch(key)  # noqa: E702
        def remove(self, key): maybe("remove"); super().remove(key)  # noqa: E702
        def insert_many(self, keys): maybe("insert_many"); super().insert_many(keys)  # noqa: E702
        def touch_many(self, keys): maybe("touch_many"); super().touch_many(keys)  # noqa: E702
        def remove_many(self, keys): maybe("remove_many"); super().remove_many(keys)  # noqa: E702

        def evict(self, n, is_evictable):
            maybe("evict")
            return super().evict(n, is_evictable)

    name = plugin(Flaky)
    store, truth, failures, step = None, {}, 0, 0

    def fresh():
        return make_store(device_blocks=3, host_blocks=3, disk_blocks=12, io_workers=2, eviction=name,
                          persistent=False)
    store = fresh()
    keys = [BlockKey(0, 0, i) for i in range(10)]
    for step in range(150):
        op, key = rng.choice(["put", "put", "get", "delete", "ensure", "demote", "promote"]), rng.choice(keys)
        data = block(geometry, 1000 * seed + step)
        armed[0] = True
        try:
            if op == "put" and key not in truth:
                store.put(key, data)
                truth[key] = data
            elif op == "get" and key in truth:
                store.get(key)
            elif op == "delete" and key in truth:
                store.delete(key)
                del truth[key]
            elif op == "ensure" and key in truth:
                store.ensure_device(rng.sample(sorted(truth), min(2, len(truth))), pin=False)
            elif op == "demote" and key in truth:
                assert store.demote_now([key]) == []
            elif op == "promote" and key in truth:
                store.promote(key).result(timeout=30)
        except PolicyError:
            failures += 1
        finally:
            armed[0] = False
        store.wait_idle()
        assert no_pins(store), f"step {step} ({op}) left a pin"
        store.check()
        try:
            for k, b in truth.items():
                assert torch.equal(store.get(k), b), f"step {step} ({op}): {k!r} read back other bytes"
        except PolicyError:
            failures += 1
            for k, b in truth.items():  # raised once: now the reads go through
                assert torch.equal(store.get(k), b), f"step {step} ({op}): {k!r} read back other bytes"
        if any(getattr(p, "failure", None) for p in store.policies.values()):
            store.close()
            store, truth = fresh(), {}
    assert failures >= 10, f"only {failures} failures: the plug-in was hardly exercised"


def test_a_failure_in_the_last_call_is_raised_by_close(make_store, geometry, plugin):
    """A failure that no later call raised (the plug-in broke in the run's last call) is
    raised by ``close()``, once the store has shut down, so the user hears of it."""
    class RaisesOnTouch(LRU):
        def touch(self, key):
            raise Bug("touch broke")

    store = make_store(device_blocks=3, host_blocks=3, disk_blocks=20, eviction=plugin(RaisesOnTouch))
    key = BlockKey(0, 0, 0)
    store.put(key, block(geometry, 0))
    assert torch.equal(store.get(key), block(geometry, 0))  # touch breaks; the read is exact
    with pytest.raises(PolicyError, match="failed in touch: Bug: touch broke"):
        store.close()
    assert store.closed and store.engine._closed
    store.close()  # once


def test_the_fallback_is_tiercaches_lru_even_when_the_registry_name_is_taken(make_store, geometry):
    """A user may register a class of their own under "lru". It is a plug-in, so it is
    guarded; when it fails, the fallback must be tiercache's ``LRUPolicy``, not another
    instance of the class that just failed (whose next failure would go straight into the
    store's half-done step)."""
    from tiercache.policies import LRUPolicy

    class MyLRU(LRU):
        def touch(self, key):
            raise Bug("touch broke")

    saved = EVICTION_POLICIES["lru"]
    EVICTION_POLICIES["lru"] = MyLRU
    try:
        store = make_store(device_blocks=3, host_blocks=3, disk_blocks=20, eviction="lru")
        key = BlockKey(0, 0, 0)
        store.put(key, block(geometry, 0))
        store.get(key)  # touch breaks
        guard = store.policies[Tier.DEVICE]
        assert isinstance(guard, GuardedPolicy) and type(guard.inner) is LRUPolicy
        with pytest.raises(PolicyError, match="'lru' of the device tier failed in touch"):
            store.get(key)
        assert torch.equal(store.get(key), block(geometry, 0))  # lru's touch: no failure now
    finally:
        EVICTION_POLICIES["lru"] = saved


def test_a_plugin_that_consumes_the_keys_it_is_told_of_leaves_the_stores_own_list(make_store, geometry, plugin):
    """The store tells a policy of a batch (``touch_many`` of the blocks a read finds on the
    device) and then pins those same blocks. A plug-in that emptied the list it was handed
    (a review: one popped keys off as it went) made the store pin none of them and then
    unpin them: "unpin: block ... is not pinned" out of ``generate()``, with no word of the
    policy. The guard hands a plug-in a copy of each batch that it cannot change."""
    heard = []

    class Consumes(LRU):
        def touch_many(self, keys):
            heard.append(type(keys))
            while keys:
                self.touch(keys.pop())  # a tuple has no pop: that is this plug-in's bug, named

    class KeepsACopy(LRU):
        def touch_many(self, keys):
            heard.append(type(keys))
            keys = list(keys)
            while keys:
                self.touch(keys.pop())

    store = make_store(device_blocks=4, host_blocks=6, disk_blocks=20, eviction=plugin(KeepsACopy, "keeps"),
                       persistent=False)
    keys = [BlockKey(0, 0, i) for i in range(4)]
    for i, key in enumerate(keys):
        store.put(key, block(geometry, i))
    store.ensure_device(keys, pin=True)  # every block on the device: touched, then pinned
    assert heard and all(kind is tuple for kind in heard)
    assert all(store.table.get(key).pins == 1 for key in keys)
    store.unpin(keys)
    assert no_pins(store)
    for i, key in enumerate(keys):
        assert torch.equal(store.get(key), block(geometry, i))
    store.close()

    heard.clear()
    store = make_store(device_blocks=4, host_blocks=6, disk_blocks=20, eviction=plugin(Consumes, "consumes"),
                       persistent=False)
    for i, key in enumerate(keys):
        store.put(key, block(geometry, i))
    store.ensure_device(keys, pin=True)  # the plug-in fails on the copy; the store's pins stand
    assert all(store.table.get(key).pins == 1 for key in keys)
    store.unpin(keys)
    with pytest.raises(PolicyError, match="'consumes' of the device tier failed in touch_many: AttributeError"):
        store.get(keys[0])
    for i, key in enumerate(keys):
        assert torch.equal(store.get(key), block(geometry, i))
    store.check()
