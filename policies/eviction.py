"""Eviction (placement) policies: lru, fifo, lfu, and the helper the others share.

Adaptive policies (arc, s3fifo) are in ``adaptive.py``; the ones that know what a KV block
is (sinks-recent, attention-score) in ``kv.py``.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Hashable, Optional

from .base import EvictionPolicy

K = Hashable
_END = object()  # end of a candidate stream (None is a valid key)


def _first_n(order, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
    victims = []
    if n <= 0:
        return victims
    for key in order:
        if is_evictable(key):
            victims.append(key)
            if len(victims) == n:
                return victims
    return None


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def insert(self, key: K) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        return _first_n(self._order, n, is_evictable)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First in, first out: reads do not change the order."""

    name = "fifo"

    def touch(self, key: K) -> None:
        pass


class LFUPolicy(EvictionPolicy):
    """Least frequently used first; ties broken by least recent use."""

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict = {}
        self._last: dict = {}
        self._clock = itertools.count()

    def insert(self, key: K) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._last[key] = next(self._clock)

    def touch(self, key: K) -> None:
        if key in self._freq:
            self._freq[key] += 1
            self._last[key] = next(self._clock)

    def remove(self, key: K) -> None:
        self._freq.pop(key, None)
        self._last.pop(key, None)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        if n <= 0:
            return []
        freq, last = self._freq, self._last
        victims = heapq.nsmallest(n, (k for k in freq if is_evictable(k)), key=lambda k: (freq[k], last[k]))
        return victims if len(victims) == n else None

    def __len__(self) -> int:
        return len(self._freq)
