"""Policies decide, the store mutates. One contract test runs over every registered policy."""
from __future__ import annotations

import pytest

from tiercache.policies import (EVICTION_POLICIES, PREFETCH_POLICIES, make_eviction, make_prefetch)


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


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="known: fifo, lfu, lru"):
        make_eviction("random")
    with pytest.raises(ValueError, match="known: lookahead, next-layer, none"):
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
