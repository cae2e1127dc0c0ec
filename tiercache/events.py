"""Runtime events (moves, hits, misses, evictions, stalls) and the ``stats()`` snapshot.

Every counter lives here; exporters (Prometheus) subscribe with ``add_listener`` and see
the same events, so their counters agree with ``stats()`` exactly.
"""
from __future__ import annotations

import copy
import logging
import threading
from typing import Callable, Optional

TIER_LABELS = ("device", "host", "disk")
log = logging.getLogger("tiercache")


class Events:
    """Thread-safe counters fed by the store and the Hugging Face layer."""

    def __init__(self, eviction_policy: str = "") -> None:
        self._lock = threading.Lock()
        self._listeners: list = []
        self.eviction_policy = eviction_policy
        self._moves: dict = {}
        self._hits = {t: 0 for t in TIER_LABELS}
        self._evictions = {t: 0 for t in TIER_LABELS}
        self._counters = {
            "misses": 0, "stall_seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0,
            "integrity_errors": 0, "pinned_fallbacks": 0, "prefetch_used": 0,
            "prefetch_unused": 0, "prefetch_late": 0, "failed_moves": 0, "stall_events": 0,
            "reused_tokens": 0, "published_blocks": 0,
        }
        self._integrity = {t: 0 for t in TIER_LABELS}

    def add_listener(self, fn: Callable[[str, dict], None]) -> None:
        """``fn(kind, fields)`` is called for every event, after the counters change.

        A ``move`` event stands for ``fields["blocks"]`` moves between the same tiers, each
        of ``fields["bytes"]`` bytes and ``fields["seconds"]`` seconds: a batch of moves
        copied together is one event, not one per block.

        Listeners run on the thread that caused the event, sometimes while the store's lock
        is held: they must be quick and must not call back into the cache. An exception in a
        listener is logged and swallowed.
        """
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[str, dict], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _emit(self, kind: str, **fields) -> None:
        for fn in list(self._listeners):
            try:
                fn(kind, fields)
            except Exception:  # noqa: BLE001 - a broken exporter must not break generation
                log.exception("tiercache: event listener failed on %s", kind)

    def move(self, src: str, dst: str, num_bytes: int, seconds: float, blocks: int = 1) -> None:
        """``blocks`` moves of ``num_bytes`` and ``seconds`` each: one event (see
        ``add_listener``). A batch of moves copied together used to emit one event per
        block, which put Python per block moved back into the batch path whenever a
        listener was attached (the Prometheus exporter, ``tiercache generate``'s progress)."""
        if blocks <= 0:
            return
        with self._lock:
            m = self._moves.setdefault(f"{src}->{dst}", {"blocks": 0, "bytes": 0, "seconds": 0.0})
            m["blocks"] += blocks
            m["bytes"] += num_bytes * blocks
            m["seconds"] += seconds * blocks
        if self._listeners:
            self._emit("move", src=src, dst=dst, bytes=num_bytes, seconds=seconds, blocks=blocks)

    def hit(self, tier: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._hits[tier] += n
            self._emit("hit", tier=tier, n=n)

    def miss(self, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters["misses"] += n
            self._emit("miss", n=n)

    def eviction(self, tier: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._evictions[tier] += n
            self._emit("eviction", tier=tier, n=n, policy=self.eviction_policy)

    def stall(self, seconds: float) -> None:
        """Time attention waited for blocks (one event per layer update, zeros included)."""
        with self._lock:
            self._counters["stall_seconds"] += seconds
            self._counters["stall_events"] += 1
        self._emit("stall", seconds=seconds)

    def tokens(self, prefill: int = 0, decode: int = 0) -> None:
        with self._lock:
            self._counters["prefill_tokens"] += prefill
            self._counters["decode_tokens"] += decode
        self._emit("tokens", prefill=prefill, decode=decode)

    def reused(self, tokens: int = 0, published: int = 0) -> None:
        """Prompt tokens loaded from the prefix cache instead of computed; blocks published."""
        with self._lock:
            self._counters["reused_tokens"] += tokens
            self._counters["published_blocks"] += published
        self._emit("reused", tokens=tokens, published=published)

    def integrity_error(self, tier: str) -> None:
        with self._lock:
            self._counters["integrity_errors"] += 1
            self._integrity[tier] += 1
        self._emit("integrity_error", tier=tier)

    def pinned_fallback(self) -> None:
        with self._lock:
            self._counters["pinned_fallbacks"] += 1
        self._emit("pinned_fallback")

    def prefetch(self, outcome: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counters[f"prefetch_{outcome}"] += n
            self._emit("prefetch", outcome=outcome, n=n)

    def failed_move(self) -> None:
        with self._lock:
            self._counters["failed_moves"] += 1
        self._emit("failed_move")

    def snapshot(self, tiers: Optional[dict] = None) -> dict:
        with self._lock:
            c = self._counters
            out = {
                "tiers": copy.deepcopy(tiers or {}),
                "moves": copy.deepcopy(self._moves),
                "hits": dict(self._hits),
                "misses": c["misses"],
                "evictions": dict(self._evictions),
                "stall_seconds": c["stall_seconds"],
                "stall_events": c["stall_events"],
                "prefill_tokens": c["prefill_tokens"],
                "decode_tokens": c["decode_tokens"],
                "reused_tokens": c["reused_tokens"],
                "published_blocks": c["published_blocks"],
                "integrity_errors": c["integrity_errors"],
                "integrity_errors_by_tier": dict(self._integrity),
                "pinned_fallbacks": c["pinned_fallbacks"],
                "failed_moves": c["failed_moves"],
                "prefetch": {k: c[f"prefetch_{k}"] for k in ("used", "unused", "late")},
            }
        return out
