"""tiercache: a tiered KV-cache runtime for Hugging Face causal LMs.

Heavy modules (torch, transformers) load on first use of the names that need them, so
``import tiercache`` is cheap and has no side effects.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tiercache.config import TierConfig, parse_bytes
from tiercache.errors import (BlockCorruptedError, CacheDirError, CapacityError, MetricsServerError, PolicyError,
                              TierCacheError, TierIOError, UnsupportedModelError)
from tiercache.table import BlockKey, Tier

__version__ = "0.1.0"

_LAZY = {
    "BlockStore": ("tiercache.store", "BlockStore"),
    "BlockGeometry": ("tiercache.tiers", "BlockGeometry"),
    "TieredCache": ("tiercache.hf", "TieredCache"),
    "wrap": ("tiercache.hf", "wrap"),
    "AsyncStore": ("tiercache.aio", "AsyncStore"),
    "serve_metrics": ("tiercache.metrics", "serve_metrics"),
}

if TYPE_CHECKING:  # pragma: no cover
    from tiercache.hf import TieredCache, wrap  # noqa: F401
    from tiercache.store import BlockStore  # noqa: F401
    from tiercache.tiers import BlockGeometry  # noqa: F401


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")


__all__ = ["TierConfig", "parse_bytes", "TierCacheError", "TierIOError", "CapacityError", "PolicyError",
           "BlockCorruptedError", "UnsupportedModelError", "CacheDirError", "MetricsServerError", "BlockKey", "Tier",
           *_LAZY]
