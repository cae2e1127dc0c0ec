"""Policies decide, the store mutates. One contract test runs over every registered policy."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from tiercache import BlockKey
from tiercache.policies import (EVICTION_POLICIES, PREFETCH_POLICIES, EvictionPolicy, make_eviction,
                                make_prefetch)
from tiercache.policies.kv import _block_coords


def run_cache(policy, trace, capacity: int, touch_misses: bool = False) -> int:
    """Drive ``policy`` the way the store does on one tier of ``capacity`` blocks; return hits.

    On a hit: touch. On a miss: when full, evict one victim and remove it; then insert
    (and, with ``touch_misses``, touch: the store's reads touch a block fetched for them)."""
    resident, hits = set(), 0
    for key in trace:
        if key in resident:
            hits += 1
            policy.touch(key)
            continue
        if len(resident) >= capacity:
            [victim] = policy.evict(1, lambda k: True)
            policy.remove(victim)
            resident.discard(victim)
        policy.insert(key)
        resident.add(key)
        if touch_misses:
            policy.touch(key)
    return hits


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_eviction_contract(name):
    """Every eviction policy: returns exactly n evictable known keys, None when it cannot,
    never a protected key, and evict() itself changes nothing."""
    p = make_eviction(name)
    for k in range(6):
        p.insert(k)
    p.touch(3)
    assert p.evict(0, lambda k: True) == []
    victims = p.evict(2, lambda k: True)
    assert len(victims) == 2 and len(set(victims)) == 2 and set(victims) <= set(range(6))
    assert p.evict(2, lambda k: True) == victims  # no side effect
    protected = {0, 1, 2, 4}
    assert set(p.evict(2, lambda k: k not in protected)) == {3, 5}
    assert p.evict(3, lambda k: k not in protected) is None
    for v in victims:
        p.remove(v)
    assert not set(victims) & set(p.evict(4, lambda k: True))
    p.remove("unknown")  # ignored
    assert len(p) == 4


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_eviction_contract_random_ops(name):
    """A seeded random mix of insert / touch / remove / evict on string keys. Every evict()
    returns n distinct resident evictable keys, or None exactly when fewer than n are
    evictable; and a twin policy that never had evict() called ends in the same state."""
    rng = random.Random(name)
    p, twin = make_eviction(name), make_eviction(name)
    resident: set = set()
    for step in range(400):
        op = rng.random()
        key = f"k{rng.randrange(12)}"
        if op < 0.35:
            p.insert(key), twin.insert(key)
            resident.add(key)
        elif op < 0.55:
            p.touch(key), twin.touch(key)
        elif op < 0.7:
            p.remove(key), twin.remove(key)
            resident.discard(key)
        elif op < 0.75 and p.wants_scores:
            scores = {f"k{i}": rng.random() for i in rng.sample(range(12), 4)}
            p.observe_scores(scores), twin.observe_scores(scores)
        else:
            protected = set(rng.sample(sorted(resident), len(resident) // 3)) if resident else set()
            evictable = resident - protected
            n = rng.randrange(len(resident) + 2)
            victims = p.evict(n, lambda k: k not in protected)
            if n > len(evictable):
                assert victims is None, (step, n, evictable)
            else:
                assert victims is not None and len(victims) == n and len(set(victims)) == n
                assert set(victims) <= evictable
        assert len(p) == len(resident) == len(twin)
    everything = lambda k: True  # noqa: E731
    assert p.evict(len(p), everything) == twin.evict(len(twin), everything)
    assert sorted(p.evict(len(p), everything)) == sorted(resident)


class _OneKeyLayerCycle(EVICTION_POLICIES["layer-cycle"]):
    """layer-cycle's one-key calls as they were before its batch calls (917f65a), each on
    its own: the reference for its ``*_many``, through which its one-key calls now go."""

    def insert(self, key) -> None:
        if key in self._layer_of:
            return
        coords = _block_coords(key)
        layer = None if coords is None else coords[1]
        self._layer_of[key] = layer
        if layer is None:
            self._other[key] = None
            return
        group = self._layers.get(layer)
        if group is None:
            group = self._layers[layer] = OrderedDict()
        group[key] = None
        if layer > self._highest:
            self._highest = layer
        if not self._read_yet:
            self._current = layer

    def touch(self, key) -> None:
        if key not in self._layer_of:
            return
        layer = self._layer_of[key]
        if layer is None:
            self._other.move_to_end(key)
            return
        self._layers[layer].move_to_end(key)
        if layer != self._current:
            self._current = layer
            self._this_pass.clear()
        self._this_pass.add(key)
        self._read_yet = True

    def remove(self, key) -> None:
        if key not in self._layer_of:
            return
        layer = self._layer_of.pop(key)
        self._this_pass.discard(key)
        group = self._other if layer is None else self._layers[layer]
        del group[key]
        if layer is not None and not group:
            del self._layers[layer]


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_eviction_contract_batch_calls_equal_one_by_one(name):
    """The store inserts, touches and removes a batch of moved blocks in one call
    (``insert_many``, ``touch_many``, ``remove_many``). Every policy, fed seeded random
    batches of block keys over three layers (repeats, unknown keys and a non-block key
    mixed in), ranks exactly as a twin fed the same keys one call each, after every batch
    and every eviction query (some with keys protected). For layer-cycle, whose one-key
    calls go through its batch calls, the twin is its one-key code on its own."""
    rng = random.Random(f"batch-{name}")
    batched = make_eviction(name)
    single = _OneKeyLayerCycle() if name == "layer-cycle" else make_eviction(name)
    keys = [BlockKey(0, layer, i) for layer in range(3) for i in range(6)] + ["other"]
    everything = lambda k: True  # noqa: E731
    for step in range(150):  # inserts only at first: a policy may rank by them until the first read
        op = "insert" if step < 6 else rng.choice(("insert", "insert", "touch", "remove"))
        batch = [rng.choice(keys) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.5:  # a batch of one layer in slot order, as the store's usually are
            layer = rng.randrange(3)
            batch = [BlockKey(0, layer, i) for i in range(rng.randrange(6), 6)]
        getattr(batched, f"{op}_many")(batch)
        for key in batch:
            getattr(single, op)(key)
        assert len(batched) == len(single), (step, op, batch)
        assert batched.evict(len(batched), everything) == single.evict(len(single), everything), (step, op, batch)
        kept = set(rng.sample(keys, 4))
        n = rng.randrange(len(batched) + 1)
        assert batched.evict(n, lambda k: k not in kept) == single.evict(n, lambda k: k not in kept), (step, n)


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_eviction_contract_reinsert_and_scores_flag(name):
    """Re-inserting a resident key does not duplicate it; ``wants_scores`` is a bool and a
    policy that wants scores accepts them."""
    p = make_eviction(name)
    p.insert("a"), p.insert("b"), p.insert("a")
    assert len(p) == 2 and sorted(p.evict(2, lambda k: True)) == ["a", "b"]
    assert p.evict(3, lambda k: True) is None
    assert isinstance(p.wants_scores, bool) and EvictionPolicy.wants_scores is False
    if p.wants_scores:
        p.observe_scores({"a": 1.0, "gone": 2.0})


def test_a_plug_in_eviction_policy_must_subclass_the_interface():
    """A class registered without subclassing ``EvictionPolicy`` (duck-typed insert, touch,
    remove, evict) is refused when built, with a message that says what to do, not with an
    AttributeError from the store's first batch."""
    class Duck:
        def insert(self, key): ...
        def touch(self, key): ...
        def remove(self, key): ...
        def evict(self, n, is_evictable): ...

    EVICTION_POLICIES["duck"] = Duck
    try:
        with pytest.raises(TypeError, match="eviction policy 'duck' is a Duck, not a tiercache.policies.EvictionPolicy"):
            make_eviction("duck")
    finally:
        del EVICTION_POLICIES["duck"]


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="known: arc, attention-score, fifo, layer-cycle, lfu, lru, s3fifo, sinks-recent"):
        make_eviction("random")
    with pytest.raises(ValueError, match="known: history, lookahead, next-layer, none"):
        make_prefetch("oracle")


def test_lru_scenario():
    """insert [1,2,3,4], read 1 -> the least recently used is 2, then 3."""
    p = make_eviction("lru")
    for k in (1, 2, 3, 4):
        p.insert(k)
    p.touch(1)
    assert p.evict(2, lambda k: True) == [2, 3]


def test_fifo_scenario():
    """insert [1,2,3,4], read 1 -> FIFO still evicts 1 first."""
    p = make_eviction("fifo")
    for k in (1, 2, 3, 4):
        p.insert(k)
    p.touch(1)
    assert p.evict(2, lambda k: True) == [1, 2]


def test_lfu_scenario():
    """1 read thrice, 2 once, 3 never: LFU evicts 3, then 4 (older of the unread), then 2."""
    p = make_eviction("lfu")
    for k in (1, 2, 3, 4):
        p.insert(k)
    for _ in range(3):
        p.touch(1)
    p.touch(2)
    assert p.evict(3, lambda k: True) == [3, 4, 2]


@pytest.mark.parametrize("name", sorted(PREFETCH_POLICIES))
def test_prefetch_contract(name):
    """Every prefetch policy returns keys of other layers only, most urgent first."""
    p = make_prefetch(name)
    plan = p.plan(1, 4, lambda layer: [(layer, i) for i in range(2)])
    assert all(layer != 1 for layer, _ in plan)


def test_next_layer_and_lookahead_wrap_to_the_next_step():
    blocks = lambda layer: [(layer, 0)]  # noqa: E731
    assert make_prefetch("next-layer").plan(3, 4, blocks) == [(0, 0)]
    assert make_prefetch("lookahead", depth=2).plan(2, 4, blocks) == [(3, 0), (0, 0)]
    assert make_prefetch("none").plan(0, 4, blocks) == []
    with pytest.raises(ValueError, match="depth"):
        make_prefetch("lookahead", depth=0)


# ---- arc ------------------------------------------------------------------------------

def test_arc_ghost_hit_in_b1_grows_t1():
    """c=4. a, b read twice -> T2=[a,b]; c, d -> T1=[c,d]. Miss e: |T1|=2 > p=0, so T1's LRU
    c goes (ghost in B1). Miss c: d goes; c comes back as a ghost hit: p=1, c joins T2.
    Now |T1|=1 is not > p, so the next victim is T2's LRU a, not e."""
    p = make_eviction("arc")
    run_cache(p, ["a", "b", "a", "b", "c", "d"], capacity=4)
    assert p.evict(1, lambda k: True) == ["c"]
    p.remove("c"), p.insert("e")
    assert p.evict(1, lambda k: True) == ["d"]
    p.remove("d"), p.insert("c")
    assert p.target_t1 == 1.0
    assert p.evict(4, lambda k: True) == ["a", "b", "c", "e"]
    assert p.evict(1, lambda k: k != "a") == ["b"]


def test_arc_keeps_a_reread_working_set_through_a_cyclic_scan():
    """c=4. h0, h1 are read twice, then read again between a cyclic stream of scan keys: 4
    other keys between two reads of h0, so LRU hits only in the first round (4 hits). ARC
    keeps h0, h1 in T2, hits all 40 reads of them, and
    lets the scan churn through T1. A cold cyclic scan with no re-reads gets no hits from
    either: T1 fills the cache, so no B1 ghost survives (as in the paper, case IV.A)."""
    rounds = [("h0", f"s{i % 7}", "h1", f"t{i % 5}", f"u{i % 3}") for i in range(20)]
    hot = ["h0", "h0", "h1", "h1"] + [k for keys in rounds for k in keys]
    assert run_cache(make_eviction("lru"), hot, 4) == 4
    assert run_cache(make_eviction("arc"), hot, 4) == 2 + 40
    loop = list(range(6)) * 10
    assert run_cache(make_eviction("lru"), loop, 4) == run_cache(make_eviction("arc"), loop, 4) == 0


def test_arc_ghosts_are_bounded_by_the_capacity_seen():
    p = make_eviction("arc")
    run_cache(p, [f"k{i}" for i in range(100)], capacity=4)
    assert len(p) == 4 and len(p._b1) + len(p._b2) <= 4


# ---- s3fifo ---------------------------------------------------------------------------

def test_s3fifo_evicts_one_hit_wonders_before_reused_keys():
    """insert 1..10, read 2 and 5 -> S3-FIFO evicts the 8 keys read once first (FIFO order)
    and keeps 2, 5 (promoted to main), where FIFO would evict 1, then 2."""
    p = make_eviction("s3fifo")
    for k in range(1, 11):
        p.insert(k)
    p.touch(2), p.touch(5)
    assert p.evict(8, lambda k: True) == [1, 3, 4, 6, 7, 8, 9, 10]
    assert p.evict(10, lambda k: True) == [1, 3, 4, 6, 7, 8, 9, 10, 2, 5]


def test_s3fifo_one_at_a_time_matches_all_at_once():
    """evict() only simulates; remove() replays the promotions and second chances the scan
    made, so evicting one victim at a time yields the same order as asking for all."""
    p = make_eviction("s3fifo")
    for k in range(1, 11):
        p.insert(k)
    for k in (2, 2, 5, 7):
        p.touch(k)
    everything = p.evict(10, lambda k: True)
    one_by_one = []
    for _ in range(10):
        [victim] = p.evict(1, lambda k: True)
        one_by_one.append(victim)
        p.remove(victim)
    assert one_by_one == everything and len(p) == 0


def test_s3fifo_ghost_hit_goes_to_main():
    """c=4. a is evicted from small unread (ghost); when it comes back it enters main and
    outlives keys that arrive after it but sit in small."""
    p = make_eviction("s3fifo")
    run_cache(p, ["a", "b", "c", "d", "e", "a"], capacity=4)  # e evicts a; a evicts b, enters main
    assert p.evict(3, lambda k: True) == ["c", "d", "e"]


def test_s3fifo_gets_hits_on_a_cyclic_scan_and_keeps_a_hot_set():
    """A cyclic scan of 6 keys on 4 slots: LRU misses every time, S3-FIFO's ghost queue
    sends returning keys to main, which then survive. A hot set read between one-hit
    wonders stays resident: all 60 reads hit, where LRU hits only in the first round."""
    loop = list(range(6)) * 10
    assert run_cache(make_eviction("lru"), loop, 4) == 0
    assert run_cache(make_eviction("s3fifo"), loop, 4) > 10
    hot = ["h0", "h1"] + [k for i in range(30) for k in ("h0", f"s{i}", "h1", f"t{i}", f"u{i}")]
    assert run_cache(make_eviction("lru"), hot, 4) == 2
    assert run_cache(make_eviction("s3fifo"), hot, 4) == 60


# ---- sinks-recent ---------------------------------------------------------------------

def test_sinks_recent_keeps_block_0_and_the_two_newest_of_each_layer():
    """Decode 10 blocks into 2 layers on 6 slots: what stays is block 0 and the two newest
    blocks of each layer."""
    p = make_eviction("sinks-recent")
    trace = [BlockKey(0, layer, i) for i in range(10) for layer in (0, 1)]
    run_cache(p, trace, capacity=6)
    assert sorted(p.evict(6, lambda k: True)) == sorted(
        (0, layer, i) for layer in (0, 1) for i in (0, 8, 9))


def test_sinks_recent_victim_order():
    """Middle blocks in LRU order, then recent ones farthest from the newest first, sinks
    last. Keys that are not (seq, layer, index) tuples of ints count as middle blocks."""
    p = make_eviction("sinks-recent")
    for i in range(6):
        p.insert((7, 0, i))
    p.insert("prompt-cache")
    p.touch((7, 0, 1))
    assert p.evict(7, lambda k: True) == [
        (7, 0, 2), (7, 0, 3), "prompt-cache", (7, 0, 1), (7, 0, 4), (7, 0, 5), (7, 0, 0)]
    assert p.evict(2, lambda k: k != (7, 0, 2)) == [(7, 0, 3), "prompt-cache"]


def test_sinks_recent_arguments_and_forgetting_a_finished_sequence():
    p = make_eviction("sinks-recent", sinks=2, recent=1)
    for i in range(5):
        p.insert((1, 0, i))
    assert p.evict(5, lambda k: True) == [(1, 0, 2), (1, 0, 3), (1, 0, 4), (1, 0, 0), (1, 0, 1)]
    for i in range(5):
        p.remove((1, 0, i))
    for i in range(3):  # sequence id 1 reused: its newest block is 2 now, not 4
        p.insert((1, 0, i))
    assert p.evict(3, lambda k: True) == [(1, 0, 2), (1, 0, 0), (1, 0, 1)]
    with pytest.raises(ValueError, match="sinks"):
        make_eviction("sinks-recent", sinks=-1)


# ---- attention-score ------------------------------------------------------------------

def test_attention_score_evicts_the_least_attended_block():
    """Blocks a, b, c, d; one step gives them 0.5, 0.1, 0.3, 0.1 -> b and d tie at the bottom
    and b goes first (less recently used), then d, then c."""
    p = make_eviction("attention-score")
    assert p.wants_scores
    for k in "abcd":
        p.insert(k)
    p.observe_scores({"a": 0.5, "b": 0.1, "c": 0.3, "d": 0.1})
    assert p.evict(3, lambda k: True) == ["b", "d", "c"]
    p.touch("b")
    assert p.evict(2, lambda k: True) == ["d", "b"]


def test_attention_score_decays_old_attention():
    """a was attended once (1.0) and then not at all; b gets 0.3 every step. Each step halves
    a's score only where a is scored: a's score is kept when it is absent, so a stays ahead
    until the steps report a's low attention."""
    p = make_eviction("attention-score")
    p.insert("a"), p.insert("b")
    p.observe_scores({"a": 1.0, "b": 0.3})
    assert p.evict(1, lambda k: True) == ["b"]
    for _ in range(3):
        p.observe_scores({"a": 0.0, "b": 0.3})  # a: 0.5, 0.25, 0.125; b: 0.45, 0.525, 0.5625
    assert p.evict(1, lambda k: True) == ["a"]


def test_attention_score_new_blocks_count_as_the_mean():
    """A block that was never scored ranks at the mean of the scored ones: after a (0.1) but
    before c (0.9)."""
    p = make_eviction("attention-score")
    p.insert("a"), p.insert("c")
    p.observe_scores({"a": 0.1, "c": 0.9, "not-resident": 5.0})
    p.insert("new")
    assert p.evict(3, lambda k: True) == ["a", "new", "c"]


# ---- history prefetch -----------------------------------------------------------------

def test_history_prefetch_plans_exactly_last_steps_reads():
    """Layer 1 read blocks 3 and 0 last step (of 0..4 listed): while layer 0 computes, plan
    those two, in that order, not the whole layer."""
    p = make_prefetch("history")
    blocks = lambda layer: [(layer, i) for i in range(5)]  # noqa: E731
    p.observe(1, [(1, 3), (1, 0)])
    assert p.plan(0, 4, blocks) == [(1, 3), (1, 0)]


def test_history_prefetch_drops_gone_blocks_and_falls_back_without_history():
    p = make_prefetch("history", depth=2)
    p.observe(0, [(0, 0), (0, 1), (0, 2)])
    listed = {0: [(0, 0), (0, 2), (0, 3)], 3: [(3, 0), (3, 1)]}
    # Layer 3 has no history: all its blocks. Layer 0 (next step): what it read and still
    # lists; (0, 1) is gone and (0, 3) was not read last step.
    assert p.plan(2, 4, lambda layer: listed[layer]) == [(3, 0), (3, 1), (0, 0), (0, 2)]
    p.observe(0, [])  # layer 0 read nothing: fetch nothing for it
    assert p.plan(2, 4, lambda layer: listed[layer]) == [(3, 0), (3, 1)]
    with pytest.raises(ValueError, match="history depth"):
        make_prefetch("history", depth=0)


def _decode_reads(num_layers: int, first_blocks: int, steps: int, grow_every: int = 0) -> list:
    """The block reads of ``steps`` decode steps: layer 0..L-1 in order, each layer's blocks
    in order; with ``grow_every``, each layer gains a block every that many steps."""
    reads = []
    for step in range(steps):
        blocks = first_blocks + (step // grow_every if grow_every else 0)
        reads += [BlockKey(0, layer, i) for layer in range(num_layers) for i in range(blocks)]
    return reads


def _belady_hits(reads: list, capacity: int) -> int:
    """Belady's optimum: on a miss with the tier full, evict the block read again last."""
    next_use, seen = [0] * len(reads), {}
    for i in range(len(reads) - 1, -1, -1):
        next_use[i] = seen.get(reads[i], float("inf"))
        seen[reads[i]] = i
    resident, hits = {}, 0
    for i, key in enumerate(reads):
        if key in resident:
            hits += 1
        elif len(resident) >= capacity:
            del resident[max(resident, key=resident.get)]
        resident[key] = next_use[i]
    return hits


@pytest.mark.parametrize("layers, blocks, capacity, grow_every",
                         [(4, 3, 6, 0), (5, 2, 3, 0), (6, 4, 11, 0), (3, 5, 7, 0), (4, 3, 6, 3), (6, 2, 9, 2)])
def test_layer_cycle_is_the_optimum_on_a_decode_scan(layers, blocks, capacity, grow_every):
    """Decoding reads every layer in order, every step, and the scan is larger than the tier.
    layer-cycle gets exactly Belady's hits (with the layers growing too); LRU, LFU and FIFO
    get none: each evicts the very block the scan reads next."""
    reads = _decode_reads(layers, blocks, 10, grow_every)
    optimum = _belady_hits(reads, capacity)
    assert optimum > 0
    assert run_cache(make_eviction("layer-cycle"), reads, capacity, touch_misses=True) == optimum
    for name in ("lru", "lfu", "fifo"):
        assert run_cache(make_eviction(name), reads, capacity, touch_misses=True) == 0


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "batched"])
def test_layer_cycle_before_any_read_ranks_from_the_layer_inserted_last(batched):
    """Prefill writes layers 0, 2 and then 1, and nothing has been read yet: the layer
    inserted last (1) is the current one, needed first. Evicted first: layer 0 (read again
    furthest ahead on the cycle 1 -> 2 -> 0), then layer 2, then layer 1; within a layer
    the block inserted last goes first. The same with the store's batch calls and with one
    call per key (which go through the batch calls: this pins what both do)."""
    p = make_eviction("layer-cycle", num_layers=3)
    for layer, n in ((0, 3), (2, 2), (1, 2)):
        keys = [BlockKey(0, layer, i) for i in range(n)]
        if batched:
            p.insert_many(keys)
        else:
            for key in keys:
                p.insert(key)
    assert p.evict(7, lambda k: True) == [BlockKey(0, 0, 2), BlockKey(0, 0, 1), BlockKey(0, 0, 0),
                                          BlockKey(0, 2, 1), BlockKey(0, 2, 0), BlockKey(0, 1, 1), BlockKey(0, 1, 0)]


def test_layer_cycle_keeps_the_next_layers_prefetch_and_the_unread_rest_of_this_layer():
    """Layers 0-3 of 2 blocks each are resident; the reader has read block 0 of layer 1
    (block 1 not yet), and a prefetch has just brought layer 2 up. Needed last is what was
    just read, then layer 0, then layer 3, then the prefetched layer 2, and block 1 of
    layer 1, read next, goes last of all. A key that is not a block goes first."""
    p = make_eviction("layer-cycle")
    for layer in (0, 1, 3):
        for i in range(2):
            p.insert(BlockKey(0, layer, i))
    for layer in (0, 1, 3):  # last step's reads, then this step's reads of layers 0 and 1
        for i in range(2):
            p.touch(BlockKey(0, layer, i))
    p.touch(BlockKey(0, 0, 0)), p.touch(BlockKey(0, 0, 1)), p.touch(BlockKey(0, 1, 0))
    p.insert(BlockKey(0, 2, 0)), p.insert(BlockKey(0, 2, 1))  # the prefetch, ahead of the reader
    p.insert("prefix-block")
    order = p.evict(len(p), lambda k: True)
    assert order == ["prefix-block", BlockKey(0, 1, 0), BlockKey(0, 0, 1), BlockKey(0, 0, 0),
                     BlockKey(0, 3, 1), BlockKey(0, 3, 0), BlockKey(0, 2, 1), BlockKey(0, 2, 0),
                     BlockKey(0, 1, 1)]
    assert p.evict(2, lambda k: k[1] != 1 if isinstance(k, tuple) else False) == [BlockKey(0, 0, 1), BlockKey(0, 0, 0)]
    with pytest.raises(ValueError, match="layer-cycle needs num_layers >= 1, got 0"):
        make_eviction("layer-cycle", num_layers=0)
