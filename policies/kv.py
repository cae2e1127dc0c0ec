"""Eviction policies that know what a KV block is: sinks-recent, attention-score, layer-cycle."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Hashable, Mapping, Optional

from .base import EvictionPolicy
from .eviction import LRUPolicy, _first_n

K = Hashable


def _block_coords(key: K) -> Optional[tuple]:
    """(seq_id, layer, index) for a block key, None for any other key. Called per block
    moved (an insert per arrival): no generator, which cost as much as the rest of it."""
    if isinstance(key, tuple) and len(key) == 3:
        seq_id, layer, index = key
        if isinstance(seq_id, int) and isinstance(layer, int) and isinstance(index, int):
            return seq_id, layer, index
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


class LayerCyclePolicy(EvictionPolicy):
    """Evict the blocks that decoding reads again furthest in the future (Belady on the layer scan).

    A decode step reads layer 0, 1, ..., L-1, the blocks of a layer in order, and the next
    step starts again at layer 0. While layer ``c`` is read, the block needed last is the
    one of layer ``c`` read last, then the others already read this pass, then the blocks of
    layer ``c - 1``, ``c - 2``, ... back to ``c + 1``, and the blocks of ``c`` not read yet
    are needed first. Within a layer, the block read last is needed last. That is the
    optimum's order on this scan, and it keeps what a prefetch just brought up for the next
    layer. LRU does the opposite: on a scan larger than the tier, it evicts exactly the
    blocks needed next.

    Keys are ``(seq_id, layer, index)`` tuples; any other key goes first, least recently
    used first. ``c`` is the layer of the last key touched (read), or of the last key
    inserted before any read (a prefetch inserts ahead of the reader, so after the first
    read only reads move ``c``); L is ``num_layers``, or one more than the highest layer seen.
    """

    name = "layer-cycle"
    assumes_layer_scan = True

    def __init__(self, num_layers: Optional[int] = None) -> None:
        if num_layers is not None and num_layers < 1:
            raise ValueError(f"layer-cycle needs num_layers >= 1, got {num_layers!r}")
        self._num_layers = num_layers
        self._layers: dict = {}  # layer -> OrderedDict of its resident keys, least recently read first
        self._layer_of: dict = {}  # resident key -> its layer (None: not a block key)
        self._other: OrderedDict = OrderedDict()
        self._current: Optional[int] = None
        self._this_pass: set = set()  # keys of the current layer read since it became current
        self._read_yet = False
        self._highest = -1

    # One loop per batch: the store inserts, touches and removes a batch of moved or read
    # blocks at once, and this policy is the default; the one-key calls go through them.
    def insert(self, key: K) -> None:
        self.insert_many((key,))

    def touch(self, key: K) -> None:
        self.touch_many((key,))

    def remove(self, key: K) -> None:
        self.remove_many((key,))

    def insert_many(self, keys) -> None:
        layer_of, layers = self._layer_of, self._layers
        last, group = None, None  # the layer of the previous key, and its keys
        for key in keys:
            if key in layer_of:
                continue
            coords = _block_coords(key)
            if coords is None:
                layer_of[key] = None
                self._other[key] = None
                continue
            layer = layer_of[key] = coords[1]
            if layer != last:
                group = layers.get(layer)
                if group is None:  # not setdefault: that builds an OrderedDict per insert
                    group = layers[layer] = OrderedDict()
                last = layer
                if layer > self._highest:
                    self._highest = layer
                if not self._read_yet:
                    self._current = layer
            group[key] = None

    def touch_many(self, keys) -> None:
        layer_of, layers, this_pass = self._layer_of, self._layers, self._this_pass
        for key in keys:
            if key not in layer_of:
                continue
            layer = layer_of[key]
            if layer is None:
                self._other.move_to_end(key)
                continue
            layers[layer].move_to_end(key)
            if layer != self._current:
                self._current = layer
                this_pass.clear()
            this_pass.add(key)
            self._read_yet = True

    def remove_many(self, keys) -> None:
        layer_of, layers, this_pass = self._layer_of, self._layers, self._this_pass
        for key in keys:
            if key not in layer_of:
                continue
            layer = layer_of.pop(key)
            this_pass.discard(key)
            group = self._other if layer is None else layers[layer]
            del group[key]
            if layer is not None and not group:
                del layers[layer]

    def _scan_order(self):
        """Resident keys in eviction order."""
        yield from self._other
        if not self._layers:
            return
        num_layers = max(self._num_layers or 0, self._highest + 1)
        current = self._current if self._current is not None else self._highest
        mine = self._layers.get(current, {})
        yield from (key for key in reversed(mine) if key in self._this_pass)
        for layer in sorted(self._layers, key=lambda layer: (current - layer) % num_layers):
            if layer != current:
                yield from reversed(self._layers[layer])
        yield from (key for key in reversed(mine) if key not in self._this_pass)

    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list]:
        return _first_n(self._scan_order(), n, is_evictable)

    def __len__(self) -> int:
        return len(self._layer_of)
