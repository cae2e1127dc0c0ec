"""Prefetch policies: none, next-layer, lookahead, history."""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

from .base import PrefetchPolicy

K = Hashable


class NoPrefetch(PrefetchPolicy):
    """Fetch nothing ahead: every block is fetched when attention asks for it."""

    name = "none"

    def plan(self, layer_idx: int, num_layers: int,
             blocks_of_layer: Callable[[int], Sequence[K]]) -> list:
        return []


class LookaheadPrefetch(PrefetchPolicy):
    """Fetch the blocks of the next ``depth`` layers (wrapping to layer 0 for the next step)."""

    name = "lookahead"

    def __init__(self, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"{self.name} depth must be >= 1, got {depth!r}")
        self.depth = depth

    def plan(self, layer_idx: int, num_layers: int,
             blocks_of_layer: Callable[[int], Sequence[K]]) -> list:
        keys: list = []
        for ahead in range(1, min(self.depth, num_layers - 1) + 1):
            keys.extend(blocks_of_layer((layer_idx + ahead) % num_layers))
        return keys


class NextLayerPrefetch(LookaheadPrefetch):
    """Fetch the blocks of layer i+1 while layer i computes."""

    name = "next-layer"

    def __init__(self) -> None:
        super().__init__(depth=1)


class HistoryPrefetch(LookaheadPrefetch):
    """Fetch, for the next ``depth`` layers, the blocks each read in the previous decode step.

    ``observe`` records what a layer read; the record for layer j is replaced when layer j
    reads again, so while layer i computes, layer j > i still holds last step's record (and
    layer 0, planned from the last layer, holds this step's). Keys that ``blocks_of_layer``
    no longer lists are left out; keys it lists that were not read are not fetched. A layer
    with no record yet falls back to all its blocks, like next-layer.
    """

    name = "history"

    def __init__(self, depth: int = 1) -> None:
        super().__init__(depth=depth)
        self._last_read: dict = {}  # layer_idx -> keys it read, in order

    def observe(self, layer_idx: int, keys: Iterable[K]) -> None:
        self._last_read[layer_idx] = list(keys)

    def plan(self, layer_idx: int, num_layers: int,
             blocks_of_layer: Callable[[int], Sequence[K]]) -> list:
        keys: list = []
        for ahead in range(1, min(self.depth, num_layers - 1) + 1):
            layer = (layer_idx + ahead) % num_layers
            listed = blocks_of_layer(layer)
            read = self._last_read.get(layer)
            if read is None:
                keys.extend(listed)
            else:
                live = set(listed)
                keys.extend(k for k in read if k in live)
        return keys
