"""Policy interfaces. Policies decide; the block store mutates.

Nothing here imports torch: policies see opaque, hashable block keys and return decisions.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Generic, Hashable, Iterable, Optional, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Chooses which copies leave one tier when it is full.

    The store calls ``insert`` when a copy lands on the tier, ``touch`` when it is read,
    ``remove`` when it leaves, and ``evict`` when it needs ``n`` slots. One instance serves
    exactly one tier.
    """

    name: str = ""
    # True when the policy ranks blocks by attention: the runtime then passes each decode
    # step's per-block attention mass to ``observe_scores(scores: Mapping[key, float])``.
    wants_scores: bool = False
    # True when the policy assumes decoding's access pattern (every layer read in order,
    # every step). The prefix cache's store, whose blocks are not read that way, then
    # evicts with ``lfu`` instead.
    assumes_layer_scan: bool = False

    @abstractmethod
    def insert(self, key: K) -> None:
        """A copy of ``key`` arrived on this tier."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """``key`` was read on this tier."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """``key`` left this tier (evicted, moved or deleted). Unknown keys are ignored."""

    def insert_many(self, keys: Iterable[K]) -> None:
        """``insert`` of each key, in order. The store calls it for a batch of moves; a
        policy may override it with one loop of its own (it is called per batch, not per
        block), but must leave the state ``insert`` one by one would."""
        for key in keys:
            self.insert(key)

    def touch_many(self, keys: Iterable[K]) -> None:
        """``touch`` of each key, in order (see ``insert_many``)."""
        for key in keys:
            self.touch(key)

    def remove_many(self, keys: Iterable[K]) -> None:
        """``remove`` of each key, in order (see ``insert_many``)."""
        for key in keys:
            self.remove(key)

    @abstractmethod
    def evict(self, n: int, is_evictable: Callable[[K], bool]) -> Optional[list[K]]:
        """Return ``n`` victims in eviction order, or None when fewer than ``n`` are evictable.

        Must not change the policy's state: the store calls ``remove`` for each victim it
        actually evicts.
        """

    def __len__(self) -> int:  # pragma: no cover - overridden
        return 0


class PrefetchPolicy(ABC, Generic[K]):
    """Chooses which blocks to bring up to the device before attention asks for them."""

    name: str = ""

    @abstractmethod
    def plan(self, layer_idx: int, num_layers: int,
             blocks_of_layer: Callable[[int], Sequence[K]]) -> list[K]:
        """Blocks to fetch ahead, most urgent first, while ``layer_idx`` computes."""

    def observe(self, layer_idx: int, keys: Iterable[K]) -> None:
        """The blocks that layer ``layer_idx`` actually read this step (optional hook)."""
