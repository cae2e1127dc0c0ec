"""Pluggable policies, installed as ``tiercache.policies``.

Registries are plain dicts from name to factory; ``make_eviction`` and ``make_prefetch``
raise ``ValueError`` listing the known names.
"""
from __future__ import annotations

from typing import Callable

from .base import EvictionPolicy, PrefetchPolicy
from .adaptive import ARCPolicy, S3FIFOPolicy
from .eviction import FIFOPolicy, LFUPolicy, LRUPolicy
from .kv import AttentionScorePolicy, LayerCyclePolicy, SinksRecentPolicy
from .prefetch import HistoryPrefetch, LookaheadPrefetch, NextLayerPrefetch, NoPrefetch
from .retention import (H2ORetention, RetentionPolicy, SnapKVRetention, StreamingRetention,
                        TOVARetention)
from .selection import FullSelection, QuestSelection, SelectionPolicy

EVICTION_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    "sinks-recent": SinksRecentPolicy,
    "attention-score": AttentionScorePolicy,
    "layer-cycle": LayerCyclePolicy,
}

PREFETCH_POLICIES: dict[str, Callable[..., PrefetchPolicy]] = {
    "none": NoPrefetch,
    "next-layer": NextLayerPrefetch,
    "lookahead": LookaheadPrefetch,
    "history": HistoryPrefetch,
}

SELECTION_POLICIES: dict[str, Callable[..., SelectionPolicy]] = {
    "full": FullSelection,
    "quest": QuestSelection,
}

RETENTION_POLICIES: dict[str, Callable[..., RetentionPolicy]] = {
    "streaming": StreamingRetention,
    "h2o": H2ORetention,
    "tova": TOVARetention,
    "snapkv": SnapKVRetention,
}


def _lookup(registry: dict, kind: str, name: str):
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(sorted(registry))
        raise ValueError(f"unknown {kind} policy {name!r}; known: {known}") from None


class RegistryError(TypeError):
    """What the registry holds under a name makes no policy of its kind."""


def _make(registry: dict, kind: str, name: str, base: type, **kwargs):
    """A new policy from the factory registered as ``name``: a TypeError naming it where the
    registry holds something that cannot be called (an instance: "'MyLRU' object is not
    callable" named no policy) or that makes no ``base``."""
    factory = _lookup(registry, kind, name)
    if not callable(factory):
        raise RegistryError(f"the {kind} policy {name!r} is registered as an instance of {type(factory).__name__}, "
                            f"which cannot be called; register its class (or a function that returns a new policy)")
    policy = factory(**kwargs)
    if not isinstance(policy, base):
        raise RegistryError(f"the {kind} policy {name!r} is a {type(policy).__name__}, not a "
                            f"tiercache.policies.{base.__name__}: subclass it")
    return policy


def make_eviction(name: str, **kwargs) -> EvictionPolicy:
    """Build the eviction policy registered under ``name`` (e.g. ``sinks=4`` for sinks-recent).
    A plug-in must subclass ``EvictionPolicy``: the store calls its batch methods
    (``insert_many``, ...), which the base class provides."""
    return _make(EVICTION_POLICIES, "eviction", name, EvictionPolicy, **kwargs)


def make_prefetch(name: str, **kwargs) -> PrefetchPolicy:
    """Build the prefetch policy registered under ``name`` (``depth=`` for lookahead)."""
    return _make(PREFETCH_POLICIES, "prefetch", name, PrefetchPolicy, **kwargs)


def make_selection(name: str, **kwargs) -> SelectionPolicy:
    """Build the selection policy registered under ``name`` ("full" or "quest")."""
    return _make(SELECTION_POLICIES, "selection", name, SelectionPolicy, **kwargs)


def make_retention(name: str, **kwargs) -> RetentionPolicy:
    """Build the retention policy registered under ``name`` (streaming, h2o, tova, snapkv)."""
    return _make(RETENTION_POLICIES, "retention", name, RetentionPolicy, **kwargs)


__all__ = [
    "EvictionPolicy", "PrefetchPolicy", "LRUPolicy", "FIFOPolicy", "LFUPolicy", "ARCPolicy",
    "S3FIFOPolicy", "SinksRecentPolicy", "AttentionScorePolicy", "LayerCyclePolicy",
    "NoPrefetch", "NextLayerPrefetch", "LookaheadPrefetch", "HistoryPrefetch",
    "EVICTION_POLICIES", "PREFETCH_POLICIES", "make_eviction", "make_prefetch",
    "SelectionPolicy", "FullSelection", "QuestSelection", "RetentionPolicy", "StreamingRetention",
    "H2ORetention", "TOVARetention", "SnapKVRetention", "SELECTION_POLICIES", "RETENTION_POLICIES",
    "make_selection", "make_retention",
]
