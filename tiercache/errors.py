"""Exceptions that tiercache raises on purpose. Each message names the problem."""
from __future__ import annotations


class TierCacheError(Exception):
    """Base class for tiercache's own errors."""


class CapacityError(TierCacheError):
    """Live KV data do not fit in the configured budgets. Raised before anything is lost."""


class BlockCorruptedError(TierCacheError):
    """A live block failed its integrity check and no intact copy exists."""


class UnsupportedModelError(TierCacheError, ValueError):
    """The model's architecture cannot be served by a tiered KV cache."""


class CacheDirError(TierCacheError, ValueError):
    """The cache directory cannot be used (locked by another process, wrong owner, ...)."""


class TierIOError(TierCacheError):
    """A tier's storage keeps failing (disk full, I/O errors): the cache cannot make room or
    read a block back. Data already stored are untouched."""


class PolicyError(TierCacheError, RuntimeError):
    """A plug-in policy raised, or broke its contract (``tiercache.guard``). An eviction
    policy's failure cost no data: its tier evicts with ``lru`` from then on. A selection
    or retention policy's answer is refused before it is used."""


class MetricsServerError(TierCacheError, OSError):
    """The metrics endpoint cannot listen where asked (port taken, unknown address, ...)."""
