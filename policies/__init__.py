"""Pluggable policies, installed as ``tiercache.policies``.

Registries are plain dicts from name to factory; ``make_eviction`` and ``make_prefetch``
raise ``ValueError`` listing the known names.
"""
from __future__ import annotations

from typing import Callable

from .base import EvictionPolicy, PrefetchPolicy
from .eviction import FIFOPolicy, LFUPolicy, LRUPolicy
from .prefetch import LookaheadPrefetch, NextLayerPrefetch, NoPrefetch

EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
}

PREFETCH_POLICIES: dict[str, Callable[[], PrefetchPolicy]] = {
    "none": NoPrefetch,
    "next-layer": NextLayerPrefetch,
    "lookahead": LookaheadPrefetch,
}


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} policy {name!r}; known: {known}") from None


def make_eviction(name: str) -> EvictionPolicy:
    """Build the eviction policy registered under ``name``."""
    return _lookup(EVICTION_POLICIES, "eviction", name)()


def make_prefetch(name: str, **kwargs) -> PrefetchPolicy:
    """Build the prefetch policy registered under ``name``."""
    return _lookup(PREFETCH_POLICIES, "prefetch", name)(**kwargs)


__all__ = [
    "EvictionPolicy", "PrefetchPolicy", "LRUPolicy", "FIFOPolicy", "LFUPolicy",
    "NoPrefetch", "NextLayerPrefetch", "LookaheadPrefetch",
    "EVICTION_POLICIES", "PREFETCH_POLICIES", "make_eviction", "make_prefetch",
]
