"""Eviction policies that know what a KV block is: sinks-recent and attention-score."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Hashable, Mapping, Optional

from .eviction import LRUPolicy, _first_n

K = Hashable


def _block_coords(key: K) -> Optional[tuple]:
    """(seq_id, layer, index) for a block key, None for any other key."""
    if isinstance(key, tuple) and len(key) == 3 and all(isinstance(x, int) for x in key):
        return tuple(key)
    return None


class SinksRecentPolicy(LRUPolicy):
    """Keep each layer's first ``sinks`` blocks and newest ``recent`` blocks (StreamingLLM).

    Keys are ``(seq_id, layer, index)`` tuples (``BlockKey`` or plain); any other key is a
    middle block. "Newest" is relative to the highest index inserted so far for that
    (seq_id, layer); that record is forgotten when the pair has no resident key left.
    Victims: middle blocks in LRU order, then recent blocks farthest from their layer's
    newest first (ties: LRU), then sinks in LRU order. A block that is both sink and
    recent counts as a sink.
    """

    name = "sinks-recent"

    def __init__(self, sinks: int = 1, recent: int = 2) -> None:
        if sinks < 0 or recent < 0:
            raise ValueError(f"sinks-recent needs sinks >= 0 and recent >= 0, got {sinks!r}, {recent!r}")
        super().__init__()
        self.sinks = sinks
        self.recent = recent
        self._newest: dict = {}  # (seq_id, layer) -> [highest index inserted, resident keys]

    def insert(self, key: K) -> None:
        if key not in self._order:
            coords = _block_coords(key)
            if coords is not None:
                group = self._newest.setdefault(coords[:2], [coords[2], 0])
                group[0] = max(group[0], coords[2])
                group[1] += 1
        super().insert(key)

    def remove(self, key: K) -> None:
        if key not in self._order:
            return
        del self._order[key]
        coords = _block_coords(key)
        if coords is not None:
            group = self._newest[coords[:2]]
            group[1] -= 1
            if group[1] == 0:
                del self._newest[coords[:2]]

    def _is_middle(self, key: K) -> bool:
        coords = _block_coords(key)
        if coords is None:
            return True
        return coords[2] >= self.sinks and self._newest[coords[:2]][0] - coords[2] >= self.recent

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        if n <= 0:
            return []
        quick = []  # usually enough: the least recently used middle blocks
        for key in self._order:
            if self._is_middle(key) and is_evictable(key):
                quick.append(key)
                if len(quick) == n:
                    return quick
        middle, recent, sinks = [], [], []
        for lru_pos, key in enumerate(self._order):
            coords = _block_coords(key)
            if coords is None:
                middle.append(key)
                continue
            age = self._newest[coords[:2]][0] - coords[2]  # 0 for the newest block
            if coords[2] < self.sinks:
                sinks.append(key)
            elif age < self.recent:
                recent.append((-age, lru_pos, key))
            else:
                middle.append(key)
        recent.sort(key=lambda r: r[:2])
        return _first_n(itertools.chain(middle, (r[2] for r in recent), sinks), n, is_evictable)


class AttentionScorePolicy(LRUPolicy):
    """Keep the blocks that recent decode steps attended to most (H2O-style heavy hitters).

    ``observe_scores`` takes the attention mass one decode step gave each block (summed
    over heads) and updates ``score = decay * score + mass`` for the keys it names; other
    keys keep their score, and masses for non-resident keys are ignored. ``evict`` returns
    the lowest score first, ties by least recent use. A key that was never scored counts
    as the mean score of the scored resident keys (0 when none is), so a new block is
    neither immortal nor the first to go; its first observed mass is added to 0.
    """

    name = "attention-score"
    wants_scores = True

    def __init__(self, decay: float = 0.5) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"attention-score decay must be in [0, 1), got {decay!r}")
        super().__init__()
        self.decay = decay
        self._score: dict = {}  # scored resident key -> decayed attention mass

    def observe_scores(self, scores: Mapping[K, float]) -> None:
        """Attention mass the last decode step gave each block, summed over heads."""
        for key, mass in scores.items():
            if key in self._order:
                self._score[key] = self.decay * self._score.get(key, 0.0) + float(mass)

    def remove(self, key: K) -> None:
        super().remove(key)
        self._score.pop(key, None)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        if n <= 0:
            return []
        unscored = sum(self._score.values()) / len(self._score) if self._score else 0.0
        score = self._score.get
        candidates = ((score(key, unscored), pos, key) for pos, key in enumerate(self._order) if is_evictable(key))
        victims = [key for _, _, key in heapq.nsmallest(n, candidates)]
        return victims if len(victims) == n else None
