"""Adaptive eviction policies: arc and s3fifo.

The store never tells a policy the tier's size. These policies use the largest number of
resident keys they have seen: the tier fills before it evicts.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Hashable, Optional

from .base import EvictionPolicy
from .eviction import _END

K = Hashable


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03).

    T1 holds keys read once since they arrived, T2 keys read again; both are LRU lists.
    B1 and B2 are ghost lists: keys recently evicted from T1 and T2 (keys only, no data).
    ``p`` is the adaptive target size of T1: a ghost hit in B1 means T1 was too small and
    raises it, a ghost hit in B2 lowers it.

    Adapted to the store's interface:

    - ``insert``: a key in B1/B2 is a ghost hit (adapt ``p``, key goes to T2's MRU end);
      any other key goes to T1's MRU end. Re-inserting a resident key counts as a read.
    - ``touch``: a hit; the key moves to T2's MRU end.
    - ``remove``: the key becomes a ghost in B1 (from T1) or B2 (from T2). The policy cannot
      tell an eviction from a delete, so both leave a ghost.
    - capacity ``c`` is the largest number of resident keys seen; ghosts are bounded as in
      ARC by |T1| + |B1| <= c and |B1| + |B2| <= c (oldest ghosts are dropped first).
    - ``evict`` replays REPLACE without knowing the incoming key: from T1's LRU end while
      the remaining |T1| > p, else from T2's, skipping non-evictable keys and falling back to
      the other list when one has no evictable key left. The store evicts before it
      inserts, so a ghost hit adapts ``p`` one eviction later than in the paper (and the
      paper's tie rule for a B2 hit with |T1| == p is not applied).
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict = OrderedDict()  # LRU first
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()  # oldest ghost first
        self._b2: OrderedDict = OrderedDict()
        self._p = 0.0
        self._capacity = 0

    @property
    def target_t1(self) -> float:
        """ARC's ``p``: how many resident keys T1 should hold."""
        return self._p

    def insert(self, key: K) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            self._p = min(self._p + max(1.0, len(self._b2) / len(self._b1)), float(self._capacity))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(self._p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._capacity = max(self._capacity, len(self))
        self._trim_ghosts()

    def touch(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self._capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        t1 = (k for k in self._t1 if is_evictable(k))
        t2 = (k for k in self._t2 if is_evictable(k))
        t1_size = len(self._t1)  # shrinks as REPLACE would take keys from T1
        victims: list = []
        while len(victims) < n:
            first, second = (t1, t2) if t1_size > self._p else (t2, t1)
            key = next(first, _END)
            if key is _END:
                key = next(second, _END)
                if key is _END:
                    return None
            if key in self._t1:
                t1_size -= 1
            victims.append(key)
        return victims

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP '23): a small FIFO, a main FIFO and a ghost FIFO.

    New keys enter the small queue (``small_ratio`` of the capacity); a key whose ghost is
    still remembered enters main. Each key has a frequency counter capped at 3. Eviction
    takes from small while it holds at least its target size, else from main. A small key
    that was read moves to main instead of leaving; one that was not leaves and becomes a
    ghost. A main key that was read goes back to main's tail with its counter decremented
    (a second chance); one that was not leaves. Capacity is the largest number of resident
    keys seen; the ghost queue holds at most that many keys.

    ``evict`` must not change state, so it simulates this on copies of the queues. The
    moves the simulated scan made (small to main, counter decrements) are applied lazily
    by ``remove`` when it drops a key with counter 0: keys ahead of it in its queue are
    promoted (small) or given their second chance (main). Approximations: that replay
    makes one pass, so when a scan wraps around main (every main key was read) the extra
    decrements are forgotten; and removing a key for another reason (a delete) also ages
    the keys ahead of it, as if the scan had reached it. Non-evictable keys are skipped
    and keep their place.
    """

    name = "s3fifo"
    max_freq = 3

    def __init__(self, small_ratio: float = 0.1) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"s3fifo small_ratio must be in (0, 1), got {small_ratio!r}")
        self.small_ratio = small_ratio
        self._small: OrderedDict = OrderedDict()  # oldest first
        self._main: OrderedDict = OrderedDict()
        self._ghost: OrderedDict = OrderedDict()
        self._freq: dict = {}  # resident key -> 0..max_freq
        self._capacity = 0

    def _small_target(self) -> int:
        return max(1, int(self.small_ratio * self._capacity))

    def insert(self, key: K) -> None:
        if key in self._freq:
            self.touch(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0
        self._capacity = max(self._capacity, len(self._freq))

    def touch(self, key: K) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.max_freq)

    def remove(self, key: K) -> None:
        if key not in self._freq:
            return
        if self._freq[key] == 0:
            self._replay_scan_to(key)
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            while len(self._ghost) > self._capacity:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]
        del self._freq[key]

    def _promote(self, key: K) -> None:
        del self._small[key]
        self._main[key] = None

    def _replay_scan_to(self, key: K) -> None:
        """Apply what the eviction scan that reached ``key`` did to the keys ahead of it."""
        if key in self._small:
            for k in list(self._small):
                if k == key:
                    return
                if self._freq[k] >= 1:
                    self._promote(k)
            return
        target = self._small_target()
        for k in list(self._small):  # the small-queue steps before the scan turned to main
            if len(self._small) < target:
                break
            if self._freq[k] >= 1:
                self._promote(k)
        for k in list(self._main):
            if k == key:
                return
            if self._freq[k] >= 1:
                self._freq[k] -= 1
                self._main.move_to_end(k)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        small, main = deque(self._small), deque(self._main)
        freq: dict = {}  # decremented counters, over self._freq
        small_size = len(small)  # skipped (non-evictable) keys stay in the small queue
        target = self._small_target()
        victims: list = []
        # Terminates: each step takes a key out of a queue, moves one from small to main
        # (once per key) or lowers a counter.
        while len(victims) < n:
            if small and (small_size >= target or not main):
                key = small.popleft()
                if freq.get(key, self._freq[key]) >= 1:
                    main.append(key)
                    small_size -= 1
                elif is_evictable(key):
                    victims.append(key)
                    small_size -= 1
            elif main:
                key = main.popleft()
                f = freq.get(key, self._freq[key])
                if f >= 1:
                    freq[key] = f - 1
                    main.append(key)
                elif is_evictable(key):
                    victims.append(key)
            else:
                return None
        return victims

    def __len__(self) -> int:
        return len(self._freq)
