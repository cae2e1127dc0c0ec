"""Prefetch policies: none, next-layer, lookahead."""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

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
            raise ValueError(f"lookahead depth must be >= 1, got {depth!r}")
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
