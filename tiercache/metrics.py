"""Prometheus metrics for one ``TieredCache``, in a registry of its own.

Counters and gauges are read from ``cache.stats()`` at scrape time, so they agree with it
exactly, include what happened before the exporter attached and are never stale. The two
histograms (move and stall durations) need every single observation, so they are fed by an
``Events`` listener and cover what happened after the exporter attached: attach it before
generating. A batch of moves is one event (``blocks`` moves of the same duration), which
``_Histogram`` counts in one step. Nothing here is global: each cache gets its own ``CollectorRegistry``;
``register_default=True`` also registers it into prometheus_client's default registry.

Example::

    with tiercache.TieredCache(model, cfg) as cache:
        port = tiercache.serve_metrics(cache)  # http://127.0.0.1:<port>/metrics
        model.generate(**inputs, cache=cache, max_new_tokens=256)
        tiercache.metrics.stop_metrics(cache)
"""
from __future__ import annotations

import bisect
import logging
import math
import os
import stat
import threading
from typing import Any, Iterable, Optional

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from tiercache.errors import MetricsServerError

log = logging.getLogger("tiercache")

# One block moves in microseconds (RAM) to tens of milliseconds (NVMe, large blocks).
MOVE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                0.25, 0.5, 1.0)
# A stall is one wait of the compute thread for blocks that are not on the device yet.
STALL_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0)

_ATTR = "_tiercache_metrics"  # where metrics_for() keeps a cache's exporter, on the cache itself


class CacheMetrics(Collector):
    """The Prometheus collector of one cache, registered in ``self.registry``.

    Args:
        cache: the ``TieredCache`` (anything with ``.events`` and ``.stats()``).
        registry: where to register; a new ``CollectorRegistry`` when None.
        register_default: also register into prometheus_client's default ``REGISTRY``
            (one cache per process: a second one raises ``ValueError``, duplicated series).
    """

    def __init__(self, cache: Any, registry: Optional[CollectorRegistry] = None,
                 register_default: bool = False) -> None:
        if not (hasattr(cache, "events") and callable(getattr(cache, "stats", None))):  # a dict was an AttributeError
            raise TypeError(f"metrics: expected a TieredCache or a BlockStore, got {type(cache).__name__}")
        self.cache = cache
        self.registry = registry if registry is not None else CollectorRegistry()
        self.closed = False
        self._lock = threading.Lock()
        self._servers: list = []  # (server, thread) pairs from start_http_server
        self._registries: list = []
        self._move_seconds = _Histogram("tiercache_move_seconds", "Duration of one block move", ["src", "dst"],
                                        MOVE_BUCKETS)
        self._stall_seconds = _Histogram("tiercache_stall_seconds", "One wait of the compute thread "
                                         "for blocks to reach the device", [], STALL_BUCKETS)
        try:  # registered first: a failed registration (a second cache in REGISTRY) left the listener
            for reg in [self.registry] + ([REGISTRY] if register_default else []):
                reg.register(self)
                self._registries.append(reg)
        except BaseException:
            for reg in self._registries:
                reg.unregister(self)
            raise
        cache.events.add_listener(self._on_event)

    def register_default(self) -> None:
        """Also register into prometheus_client's default ``REGISTRY`` (once)."""
        with self._lock:
            if self.closed:
                raise RuntimeError("CacheMetrics is closed")
            if REGISTRY not in self._registries:
                REGISTRY.register(self)
                self._registries.append(REGISTRY)

    def _on_event(self, kind: str, fields: dict) -> None:
        # Called by Events, sometimes under the store's lock: never call back into the cache
        # here, and never raise into the store's move path.
        if self.closed:
            return
        try:
            if kind == "move":
                self._move_seconds.observe(fields["seconds"], (fields["src"], fields["dst"]), fields["blocks"])
            elif kind == "stall":
                self._stall_seconds.observe(fields["seconds"])
        except Exception:  # noqa: BLE001 - a metrics bug must not break generation
            log.exception("tiercache: metrics listener failed on %r event", kind)

    def describe(self) -> list:
        """The metric families without samples (lets registries check names without a scrape)."""
        return self._families(None)

    def collect(self) -> list:
        """Every metric, read from ``cache.stats()`` now plus the two histograms."""
        # No lock of ours is held here: listeners run under the store's lock and stats() takes it.
        return self._families(self.cache.stats())

    def _families(self, stats: Optional[dict]) -> list:
        s = stats or {"tiers": {}, "moves": {}, "hits": {}, "evictions": {}, "prefetch": {},
                      "integrity_errors_by_tier": {}}
        policy = getattr(self.cache.events, "eviction_policy", "") or ""
        tiers = s["tiers"].items()
        moves = [(tuple(direction.split("->", 1)), m) for direction, m in s["moves"].items()]
        out: list = [
            _gauge("tiercache_tier_budget_bytes", "Byte budget of a tier (0: tier disabled)",
                   [((t,), v["budget_bytes"]) for t, v in tiers]),
            _gauge("tiercache_tier_used_bytes", "Bytes of a tier's slots that hold blocks",
                   [((t,), v["used_bytes"]) for t, v in tiers]),
            _gauge("tiercache_tier_blocks", "Blocks held by a tier", [((t,), v["blocks"]) for t, v in tiers]),
            _counter("tiercache_moves_total", "Blocks moved between tiers", ["src", "dst"],
                     [(d, m["blocks"]) for d, m in moves]),
            _counter("tiercache_move_bytes_total", "Bytes moved between tiers", ["src", "dst"],
                     [(d, m["bytes"]) for d, m in moves]),
            _counter("tiercache_hits_total", "Blocks attention needed, by the tier they were found on",
                     ["tier"], [((t,), n) for t, n in s["hits"].items()]),
            _counter("tiercache_misses_total", "Blocks attention needed that no tier held", [],
                     [((), s.get("misses", 0))]),
            _counter("tiercache_evictions_total", "Blocks evicted from a tier", ["tier", "policy"],
                     [((t, policy), n) for t, n in s["evictions"].items()]),
            _counter("tiercache_prefetch_total", "Prefetched blocks by outcome (used, unused, late)",
                     ["outcome"], [((o,), n) for o, n in s["prefetch"].items()]),
            _counter("tiercache_prefill_tokens_total", "Prompt tokens written to the cache", [],
                     [((), s.get("prefill_tokens", 0))]),
            _counter("tiercache_decode_tokens_total", "Tokens written to the cache after the prompt", [],
                     [((), s.get("decode_tokens", 0))]),
            _counter("tiercache_reused_tokens_total", "Prompt tokens loaded from the prefix cache instead of computed",
                     [], [((), s.get("reused_tokens", 0))]),
            _counter("tiercache_published_blocks_total", "Blocks stored in the prefix cache", [],
                     [((), s.get("published_blocks", 0))]),
            _counter("tiercache_integrity_errors_total", "Records that failed their checksum", ["tier"],
                     [((t,), n) for t, n in s["integrity_errors_by_tier"].items()]),
            _counter("tiercache_pinned_fallback_total", "Host buffers that could not be pinned", [],
                     [((), s.get("pinned_fallbacks", 0))]),
            _counter("tiercache_failed_moves_total", "Block moves that failed and were rolled back", [],
                     [((), s.get("failed_moves", 0))]),
        ]
        out.extend(_remote_families(s.get("remote")))
        out.extend(hist.family(samples=stats is not None) for hist in (self._move_seconds, self._stall_seconds))
        return out

    def serve(self, port: int = 0, addr: Optional[str] = "127.0.0.1") -> int:
        """Serve ``/metrics`` over HTTP from a daemon thread; returns the bound port.

        Listens on loopback unless ``addr`` says otherwise ("0.0.0.0" for every interface).
        ``port=0`` lets the OS pick a free port. A closed exporter (also one that ``close``
        closed on another thread while this started its server) is a ``RuntimeError``, and
        no server is left listening.
        """
        if self.closed:
            raise RuntimeError("CacheMetrics is closed")
        port, addr = _endpoint(port, addr)
        try:
            server, thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:  # port taken, an address no interface has, a name that does not resolve
            raise MetricsServerError(f"metrics: cannot serve on {addr}:{port} ({exc.strerror or exc})") from exc
        with self._lock:
            closing = self.closed  # close() ran while the server started: it did not see this one
            if not closing:
                self._servers.append((server, thread))
        if closing:
            server.shutdown()
            server.server_close()
            thread.join()
            raise RuntimeError("CacheMetrics is closed")
        return int(server.server_address[1])

    @property
    def addresses(self) -> list:
        """(host, port) of every server this exporter runs."""
        with self._lock:
            return [server.server_address[:2] for server, _ in self._servers]

    def close(self) -> None:
        """Stop the HTTP servers, unregister from every registry and stop observing events."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            servers, self._servers = self._servers, []
        for server, thread in servers:
            server.shutdown()
            server.server_close()
            thread.join()
        for reg in self._registries:
            reg.unregister(self)
        self._registries = []
        self.cache.events.remove_listener(self._on_event)  # was left attached: one per serve/stop cycle


class _Histogram:
    """A Prometheus histogram that takes ``n`` observations of one value in one step.

    prometheus_client's ``Histogram`` observes one value per call; a batch of 43 moves
    then cost 43 calls, each with its own lock and bucket search, under the store's lock.
    This one keeps, per label values, the count of each bucket and the sum, and exposes
    them as a ``HistogramMetricFamily`` with the same samples as prometheus_client's
    (cumulative ``_bucket`` series up to ``+Inf``, ``_count``, ``_sum``; no ``_created``,
    which means little over a cache's lifetime)."""

    def __init__(self, name: str, doc: str, labelnames: list, buckets: tuple) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(set(bounds)) or not bounds:
            raise ValueError(f"{name}: buckets must be distinct and increasing, got {buckets!r}")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self._bounds = tuple(bounds)
        self._les = [floatToGoString(b) for b in bounds]
        self._lock = threading.Lock()
        self._series: dict = {}  # label values -> [counts per bucket (not cumulative), sum]
        if not self.labelnames:  # as prometheus_client's: zeros from the start, not "no data"
            self._series[()] = [[0] * len(self._bounds), 0.0]

    def observe(self, value: float, labels: tuple = (), n: int = 1) -> None:
        """``n`` observations of ``value`` (seconds) for ``labels`` (one value per label name)."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {labels!r}")
        i = bisect.bisect_left(self._bounds, value)  # the first bucket with value <= le
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = [[0] * len(self._bounds), 0.0]
            series[0][i] += n
            series[1] += value * n

    def family(self, samples: bool = True) -> HistogramMetricFamily:
        """The metric family, with its samples now (``samples=False``: the family alone)."""
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        if not samples:
            return family
        with self._lock:
            series = [(labels, list(counts), total) for labels, (counts, total) in self._series.items()]
        for labels, counts, total in series:
            cumulative, buckets = 0, []
            for le, count in zip(self._les, counts):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(labels), buckets, total)
        return family


def _remote_families(remote: Optional[dict]) -> list:
    """The remote tier's series (none without a remote tier)."""
    if remote is None:
        return []
    up = GaugeMetricFamily("tiercache_remote_up", "1 while the remote tier (Redis/Valkey) answers, else 0")
    up.add_metric([], 1 if remote["state"] == "up" else 0)
    return [
        up,
        _counter("tiercache_remote_blocks_total", "Prefix blocks looked up on the remote tier, by result",
                 ["result"], [(("hit",), remote["hits"]), (("miss",), remote["misses"])]),
        _counter("tiercache_remote_bytes_total", "Bytes read from and written to the remote tier", ["direction"],
                 [(("read",), remote["bytes_read"]), (("write",), remote["bytes_written"])]),
        _counter("tiercache_remote_writes_dropped_total", "Remote writes dropped (server down or queue full)",
                 [], [((), remote["writes_dropped"])]),
        _counter("tiercache_remote_evictions_total", "Blocks deleted from the remote tier to keep remote_budget",
                 [], [((), remote["evicted_blocks"])]),
        _counter("tiercache_remote_errors_total", "Remote tier faults by kind (unavailable, timeout, auth, "
                 "server, corrupt, foreign)", ["kind"], [((k,), n) for k, n in remote["errors"].items()]),
    ]


def _gauge(name: str, doc: str, items: Iterable) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["tier"])
    for labels, value in items:
        family.add_metric(list(labels), value)
    return family


def _counter(name: str, doc: str, labels: list, items: Iterable) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, value in items:
        family.add_metric(list(values), value)
    return family


def metrics_for(cache: Any, register_default: bool = False) -> CacheMetrics:
    """The cache's exporter, created (and attached to ``cache.events``) on first use;
    ``register_default``: registered into the default ``REGISTRY`` too, if not yet."""
    metrics = getattr(cache, _ATTR, None)
    if metrics is None or metrics.closed:
        metrics = CacheMetrics(cache, register_default=register_default)
        setattr(cache, _ATTR, metrics)
    elif register_default:  # was ignored when the cache had an exporter already
        metrics.register_default()
    return metrics


def _endpoint(port: Any, addr: Any) -> tuple:
    """(port, addr) checked: an int port in [0, 65535]; an address string, None meaning the
    default, loopback (prometheus_client took None for every interface)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"metrics port: must be an integer in [0, 65535], got {port!r}")
    if addr is None:
        addr = "127.0.0.1"
    if not isinstance(addr, str):
        raise TypeError(f"metrics addr: expected an address string such as '127.0.0.1' or '0.0.0.0', got {addr!r}")
    if not addr.strip():
        raise ValueError(f"metrics addr: an empty address; give one such as '127.0.0.1' or '0.0.0.0', got {addr!r}")
    return port, addr


def metrics_url(addr: str, port: int) -> str:
    """``http://addr:port/metrics``, an IPv6 address in brackets."""
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
    return f"http://{host}:{port}/metrics"


def check_endpoint(port: int, addr: Optional[str]) -> None:
    """Raise ``MetricsServerError`` now if ``serve(port, addr)`` could not listen there (a
    port taken, an address no interface has): ``tiercache generate`` calls this before it
    loads the model, not after. A probe socket, closed again: the port may still be taken
    by someone else in between, which ``serve`` then reports."""
    import socket

    port, addr = _endpoint(port, addr)
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server does
            probe.bind(sockaddr)
    except OSError as exc:
        raise MetricsServerError(f"metrics: cannot serve on {addr}:{port} ({exc.strerror or exc})") from exc


def serve_metrics(cache: Any, port: int = 0, addr: Optional[str] = "127.0.0.1") -> int:
    """Serve the cache's metrics at ``http://addr:port/metrics``; returns the bound port.

    Loopback only by default (``addr=None`` too); pass ``addr="0.0.0.0"`` (or an interface
    address) to expose them to other machines. Stop with ``stop_metrics(cache)``.
    """
    return metrics_for(cache).serve(port, addr)


def stop_metrics(cache: Any) -> None:
    """Stop every metrics server of ``cache`` and detach its exporter (no-op if none)."""
    metrics = getattr(cache, _ATTR, None)
    if metrics is not None:
        metrics.close()


def _file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "of another kind"  # pragma: no cover - every kind Linux has is named above


def textfile_target(path: str, what: str = "metrics textfile") -> str:
    """The file that ``write_textfile(cache, path)`` replaces: ``path``, or where its symlinks
    lead (``os.path.realpath``), so that a link stays a link and the file it points to gets
    the metrics (the rename went over the link itself, which became a plain file and its
    target was never written). ValueError, naming ``what`` and ``path``, when something
    that is not a regular file is there: a device node, a FIFO, a directory would be replaced
    by the rename (as root, ``/dev/full`` became a regular file)."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except OSError:  # none yet (or a dangling link's target): the rename makes it; a folder
        return target  # that cannot be searched, say: the write itself reports that
    if not stat.S_ISREG(mode):
        shown = repr(path) if target == os.path.abspath(path) else f"{path!r} (a link to {target!r})"
        raise ValueError(f"{what}: {shown} is {_file_kind(mode)}; only a regular file (or a new one) can take "
                         f"the textfile, which is written as a new file renamed over it")
    return target


def write_textfile(cache: Any, path: str) -> None:
    """Write the cache's metrics atomically to ``path`` (a ``.prom`` file for node_exporter):
    a temporary file next to it, renamed over it. A symlink is followed (the file it points
    to is replaced, the link stays); ``path`` that is a device node, a FIFO or a directory is
    refused (ValueError) before anything is written (``textfile_target``)."""
    write_to_textfile(textfile_target(path), metrics_for(cache).registry)
