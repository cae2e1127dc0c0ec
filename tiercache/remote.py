"""The remote tier: prefix-cache blocks in Redis or Valkey, shared by processes and machines.

Beside the local prefix cache (host memory and disk), blocks are also kept in a server the
user already runs. Keys are the prefix cache's content-addressed names, namespaced per
model digest and block geometry::

    (<tag> = v<record format>.<manifest format>-<model digest>-<geometry>)
    <namespace>:{<tag>:<h>}:m        manifest of block h: index, parent, token ids, layers
    <namespace>:{<tag>:<h>}:<layer>  one layer's record, in the disk tier's record format
    <namespace>:{<tag>}:lru          sorted set of stored blocks by last use (remote_budget)
    <namespace>:{<tag>}:res          sorted set of blocks being written, "<h>:<worker>", by
                                     when a record of theirs was last sent (remote_budget)

The ``{...}`` hash tags keep a block's keys on one cluster slot. Values are checked bytes,
never pickled: a record carries its key, model digest, geometry, token ids and CRC32Cs, and
a manifest its own CRC32C. A lookup reads the manifests of a whole prompt in one pipeline and
the records in a few more; writes go through one background thread with bounded queued bytes,
so the compute thread never waits for the server (over the bound, a write is dropped and
counted). A manifest is written after its block's records, so a reader that sees it finds the
records unless the server evicted them since (a plain miss).

Faults never reach the caller: a server that is down, slow (``remote_timeout``), refuses the
credentials or answers with an error is counted and skipped for a few seconds while
generation continues on the local tiers; a value that fails its checks (corrupted, or written
by another model or format version) is counted and never returned, and a corrupted one is
deleted. Keys carry the record and manifest format versions, so workers of different
versions share a server without meeting each other's values.
"""
from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Optional, Sequence

import crc32c
import torch

from tiercache.config import TierConfig, redact_url, remote_credentials
from tiercache.disk import FORMAT_VERSION, HEADER_BYTES, ForeignRecordError, RecordCodec, RecordError
from tiercache.table import BlockKey

log = logging.getLogger("tiercache")

MANIFEST_MAGIC = b"TCMF"
# 2: the budget counts the blocks listed and those being written (two sorted sets, seen by
# every worker), no byte counter: workers of version 1 keep their own namespaces
MANIFEST_VERSION = 2
_MANIFEST = struct.Struct("<4sHH16sQQqI")  # magic, version, layers, digest, h, index, parent (-1), ids length
_CRC = struct.Struct("<I")
ERROR_KINDS = ("unavailable", "timeout", "auth", "server", "corrupt", "foreign")
RETRY_SECONDS = 5.0  # after a failure the server is left alone this long, then tried again
BATCH_BYTES = 32 << 20  # bytes of values per pipeline (reads and writes)
# A block being written whose records stopped coming this long ago: its writer is gone (a
# process killed mid-block). Its reservation goes, with the records it sent.
STALE_RESERVATION_S = 600.0


class RemoteTier:
    """The prefix cache's blocks of one model and geometry on a Redis/Valkey server.

    Args:
        config: ``remote_url``, ``remote_budget``, ``remote_namespace``, ``remote_cluster``,
            ``remote_timeout`` and ``remote_max_inflight`` are used.
        codec: the record format of this model and geometry.
        tag: the prefix directory's name (model digest and geometry).
        num_layers: layers per block.
    """

    def __init__(self, config: TierConfig, codec: RecordCodec, tag: str, num_layers: int) -> None:
        if config.remote_url is None:
            raise ValueError("remote_url: not set")
        self.url = config.remote_url
        self.cluster = config.remote_cluster
        self.timeout = float(config.remote_timeout)
        self.budget = config.remote_budget
        self.max_inflight = config.remote_max_inflight
        self.codec, self.num_layers = codec, num_layers
        # The formats are part of the keys: workers of another version never meet these values.
        tag = f"v{FORMAT_VERSION}.{MANIFEST_VERSION}-{tag}"
        self._ns, self._tag = config.remote_namespace, tag
        self.namespace = f"{config.remote_namespace}:{tag}"
        self.lru_key = f"{self._ns}:{{{tag}}}:lru"
        self.res_key = f"{self._ns}:{{{tag}}}:res"
        self.record_bytes = HEADER_BYTES + codec.payload_bytes
        self.manifest_bytes = _MANIFEST.size + 3 * codec.geometry.block_tokens + _CRC.size
        self.block_bytes = num_layers * self.record_bytes + self.manifest_bytes  # what one block occupies
        if self.budget is not None and self.budget < self.block_bytes:
            raise ValueError(f"remote_budget: {self.budget} bytes is less than one block of this model "
                             f"({self.block_bytes} bytes: {num_layers} layers of {self.record_bytes}-byte records)")
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._down_until = 0.0
        self._state = "unknown"
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._queue: deque = deque()
        self._inflight = 0
        self._busy = False
        self._pending: dict = {}  # h -> layers queued for a block whose manifest is not queued yet
        # blocks with a dropped or failed record in the current publish of them (it began with
        # layer 0): its later records are dropped and it gets no manifest (insertion ordered)
        self._poisoned: dict = {}
        self._unlisted: set = set()  # blocks this process reserved (``res_key``) and has not listed (writer)
        self._in_place: set = set()  # blocks it rewrites unreserved: listed when their writes began (writer)
        self._worker = uuid.uuid4().hex[:12]  # this tier's name in its reservations: "<h>:<worker>"
        self._to_release: set = set()  # blocks whose publish stopped: their reservations go (writer)
        self._release_later: set = set()  # releases the server was not there for (writer's own)
        self._evicted: set = set()  # blocks the writer's evictions deleted in the batch it is writing
        self._writer: Optional[threading.Thread] = None
        self.closed = False
        self._counts = {"lookups": 0, "hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0,
                        "blocks_written": 0, "writes_dropped": 0, "evicted_blocks": 0}
        self._errors = {k: 0 for k in ERROR_KINDS}
        # The writer connects at once (in the background): until a first lookup or write the
        # state stayed "unknown", which tiercache_remote_up exported as 0, "down", for a
        # healthy server.
        with self._cv:
            self._start_writer_locked()

    # ---- keys -------------------------------------------------------------------------------
    def manifest_key(self, h: int) -> str:
        return f"{self._ns}:{{{self._tag}:{h:016x}}}:m"

    def record_key(self, h: int, layer: int) -> str:
        return f"{self._ns}:{{{self._tag}:{h:016x}}}:{layer}"

    def block_keys(self, h: int) -> list:
        """Every key of block ``h``, the manifest first (one hash tag: one cluster slot)."""
        return [self.manifest_key(h)] + [self.record_key(h, layer) for layer in range(self.num_layers)]

    # ---- values -----------------------------------------------------------------------------
    def encode_manifest(self, block: Any) -> bytes:
        head = _MANIFEST.pack(MANIFEST_MAGIC, MANIFEST_VERSION, self.num_layers, self.codec.model_digest,
                              block.h, block.index, -1 if block.parent is None else block.parent,
                              len(block.token_ids))
        body = head + block.token_ids
        return body + _CRC.pack(crc32c.crc32c(body))

    def check_manifest(self, value: bytes, block: Any) -> None:
        """Raise RecordError unless ``value`` is ``block``'s manifest (ForeignRecordError when
        it is intact but written by another format version or model)."""
        if len(value) < _MANIFEST.size + 4 or value[:4] != MANIFEST_MAGIC:
            raise RecordError("not a tiercache manifest")
        body, (crc,) = value[:-4], _CRC.unpack(value[-4:])
        if crc32c.crc32c(body) != crc:
            raise RecordError("manifest checksum mismatch")
        _, version, layers, digest, h, index, parent, length = _MANIFEST.unpack(body[:_MANIFEST.size])
        if version != MANIFEST_VERSION:  # keys carry the version, so only a stray writer gets here
            raise ForeignRecordError(f"manifest format version {version}; this one reads {MANIFEST_VERSION}")
        if digest != self.codec.model_digest or layers != self.num_layers:
            raise ForeignRecordError("manifest written for another model")
        ids = body[_MANIFEST.size:]
        if (h, index, None if parent < 0 else parent) != (block.h, block.index, block.parent) \
                or length != len(ids) or ids != block.token_ids:
            raise RecordError("manifest names another block or other token ids")

    def _tensor(self, payload: memoryview) -> torch.Tensor:
        g = self.codec.geometry
        out = torch.empty(g.shape, dtype=g.dtype)
        flat = out.view(-1).view(torch.uint8)
        flat.numpy()[:] = memoryview(payload).cast("B")
        return out

    # ---- the connection -------------------------------------------------------------------
    def _connection(self) -> Any:
        """The client, connecting if needed; None while the server is counted as down."""
        with self._client_lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until or self.closed:
                return None
            try:
                client = self._connect()
                client.ping()
            except Exception as exc:  # noqa: BLE001 - any client failure means "no remote now"
                self._failed_locked(exc, "connecting")
                return None
            if self._state != "up":
                log.info("remote tier %s is up", redact_url(self.url))
            self._client, self._state = client, "up"
            return client

    def _connect(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        user, password = remote_credentials(self.url)
        kwargs: dict = {"socket_timeout": self.timeout, "socket_connect_timeout": self.timeout,
                        "retry": Retry(NoBackoff(), 0), "username": user, "password": password}
        if self.cluster:
            from redis.cluster import RedisCluster
            return RedisCluster.from_url(self.url, **kwargs)
        return redis.Redis.from_url(self.url, **kwargs)

    def _failed(self, exc: BaseException, doing: str) -> None:
        with self._client_lock:
            self._failed_locked(exc, doing)

    def _failed_locked(self, exc: BaseException, doing: str) -> None:
        kind = classify(exc)
        with self._lock:
            self._errors[kind] += 1
        client, self._client = self._client, None
        self._down_until = time.monotonic() + RETRY_SECONDS
        if self._state != "down":
            log.warning("remote tier %s unavailable while %s (%s: %s); going on with the local tiers, "
                        "retrying in %.0f s", redact_url(self.url), doing, kind, exc, RETRY_SECONDS)
        self._state = "down"
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _bad_value(self, exc: RecordError, keys: Sequence[str]) -> None:
        """A value failed its checks: count it; delete it when corrupt (best effort). An
        intact foreign value is left alone: a machine that recomputes the block overwrites it."""
        kind = "foreign" if isinstance(exc, ForeignRecordError) else "corrupt"
        with self._lock:
            self._errors[kind] += 1
        log.warning("remote tier: refused a %s value (%s); its tokens will be recomputed", kind, exc)
        if kind == "foreign":
            return
        client = self._connection()
        if client is not None:
            try:
                client.delete(*keys)  # one block's keys share a hash tag: one slot
            except Exception as err:  # noqa: BLE001
                self._failed(err, "deleting a bad value")

    def _pipeline_get(self, client: Any, keys: Sequence[str]) -> list:
        """The values of ``keys``, None where missing. A key holding another type (a list,
        a hash) answers WRONGTYPE: that failed the whole pipeline, which marked the server
        down, and the key was never repaired, so every later lookup of that prefix did the
        same. It reads as an empty value: it fails its check, is counted corrupt and deleted."""
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        values = pipe.execute(raise_on_error=False)
        for i, value in enumerate(values):
            if _wrong_type(value):
                values[i] = b""
            elif isinstance(value, BaseException):  # the server's failure (loading, busy, ...)
                raise value
        return values

    # ---- reading ----------------------------------------------------------------------------
    def lookup(self, blocks: Sequence[Any]) -> int:
        """How many of ``blocks`` (a chain, from its first) the server holds: one round trip
        for their manifests. Never raises."""
        if not blocks:
            return 0
        client = self._connection()
        self._count(lookups=1)
        if client is None:
            self._count(misses=len(blocks))
            return 0
        try:
            values = self._pipeline_get(client, [self.manifest_key(b.h) for b in blocks])
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "looking up a prefix")
            self._count(misses=len(blocks))
            return 0
        found = 0
        try:
            found = self._found(blocks, values)
        finally:
            self._count(misses=len(blocks) - found)
        return found

    def _found(self, blocks: Sequence[Any], values: list) -> int:
        found = 0
        for block, value in zip(blocks, values):
            if value is None:
                break
            try:
                self.check_manifest(value, block)
            except RecordError as exc:
                self._bad_value(exc, [self.manifest_key(block.h)])
                break
            found += 1
        return found

    def fetch(self, blocks: Sequence[Any], take: Callable[[Any, list], bool]) -> int:
        """Read every layer of ``blocks`` (found by ``lookup``) in pipelines of at most 32 MiB,
        handing each block's checked ``[2, B, H, T, D]`` tensors (one per layer) to
        ``take(block, tensors)``, which returns False to stop. A missing or bad record ends
        the run at its block. Returns the blocks taken. A failure of the server is counted
        and swallowed (the remote tier is a cache); one that ``take`` raises (the local
        store's: a full tier, a plug-in policy's ``PolicyError``) is the caller's, raised
        as it is, the blocks taken before it counted as hits and the rest as misses."""
        client = self._connection()
        taken = 0
        per_batch = max(1, BATCH_BYTES // self.block_bytes)
        local: Optional[BaseException] = None  # what ``take`` raised: not the server's fault
        try:
            for start in range(0, len(blocks), per_batch):
                if client is None or taken < start:
                    break
                group = blocks[start:start + per_batch]
                keys = [self.record_key(b.h, layer) for b in group for layer in range(self.num_layers)]
                values = self._pipeline_get(client, keys)
                for i, block in enumerate(group):
                    layers = self._decode_block(block, values[i * self.num_layers:(i + 1) * self.num_layers])
                    values[i * self.num_layers:(i + 1) * self.num_layers] = [None] * self.num_layers
                    if layers is None:
                        break
                    try:
                        took = take(block, layers)
                    except BaseException as exc:
                        local = exc
                        raise
                    if not took:
                        break
                    taken += 1
        except Exception as exc:  # noqa: BLE001
            if exc is not local:
                self._failed(exc, "reading a prefix")
        finally:
            if local is not None:  # counted as below: hits and misses add up to the blocks asked for
                self._count(hits=taken, misses=len(blocks) - taken,
                            bytes_read=taken * self.num_layers * self.record_bytes)
        if local is not None:
            raise local
        self._count(hits=taken, misses=len(blocks) - taken, bytes_read=taken * self.num_layers * self.record_bytes)
        if taken:
            self.touch(blocks[:taken])
        return taken

    def _decode_block(self, block: Any, values: list) -> Optional[list]:
        layers = []
        for layer, value in enumerate(values):
            if value is None:  # evicted by the server (maxmemory) or never written: a plain miss
                return None
            try:
                _, payload = self.codec.decode(value, BlockKey(block.h, layer, block.index), block.token_ids)
            except RecordError as exc:
                self._bad_value(exc, [self.manifest_key(block.h), self.record_key(block.h, layer)])
                return None
            layers.append(self._tensor(payload))
        return layers

    # ---- writing ----------------------------------------------------------------------------
    def put(self, block: Any, layer: int, kv: torch.Tensor) -> bool:
        """Queue one layer's record of ``block`` (``kv`` is not modified afterwards by the
        caller). Never waits: False when it is dropped (server down, or the queue full)."""
        with self._cv:
            if self.closed:
                return False
            if layer == 0:  # a new publish of the block: a record dropped in an earlier one is past
                self._poisoned.pop(block.h, None)
            if block.h in self._poisoned:
                self._counts["writes_dropped"] += 1
                return False
            if self._state == "down" and time.monotonic() < self._down_until \
                    or self._inflight + self.record_bytes > self.max_inflight:
                self._counts["writes_dropped"] += 1
                self._poison(block.h)
                return False
            self._inflight += self.record_bytes
            self._queue.append(("record", block, layer, kv))
            layers = self._pending.setdefault(block.h, set())
            layers.add(layer)
            if len(layers) == self.num_layers:
                del self._pending[block.h]
                self._queue.append(("manifest", block, -1, None))
            self._start_writer_locked()
            self._cv.notify_all()
            return True

    def _start_writer_locked(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="tiercache-remote", daemon=True)
            self._writer.start()

    def touch(self, blocks: Sequence[Any]) -> None:
        """Mark ``blocks`` used now (their remote_budget eviction order); queued, never waits."""
        if self.budget is None:
            return
        with self._cv:
            if not self.closed:  # a worker that only reads still keeps the eviction order
                self._queue.append(("touch", list(blocks), -1, None))
                self._start_writer_locked()
                self._cv.notify_all()

    def _score(self, block: Any) -> float:
        # Least recently used first, by the minute; within a minute, longer extensions first,
        # so a prefix leaves after the blocks that extend it.
        return float(int(time.time() // 60) * 4096 - min(block.index, 4095))

    def _write_loop(self) -> None:
        if not self.closed:
            self._connection()  # up or down now, not "unknown" until the first request
        while True:
            with self._cv:
                while not self._queue and not self._to_release and not self.closed:
                    self._cv.wait()
                if not self._queue and not self._to_release:  # closed, and nothing left to do
                    return
                batch, size = [], 0
                while self._queue and size < BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    size += self.record_bytes if item[0] == "record" else 0
                self._busy = True
            try:
                self._write_batch(batch)
            finally:
                with self._cv:
                    self._inflight -= size
                    self._busy = False
                    self._cv.notify_all()

    def _write_batch(self, batch: list) -> None:
        client = self._connection()
        with self._lock:
            poisoned = set(self._poisoned)
            release, self._to_release = self._to_release | self._release_later, set()
        # blocks whose publish stopped (a dropped record, an abandoned block) and that are not
        # being published again: their reservations go, and the records they sent
        release = [h for h in release if (h in self._unlisted or h in self._in_place) and h in poisoned]
        self._release_later = set()
        items = [it for it in batch if it[0] == "touch" or it[1].h not in poisoned]
        if client is None:
            self._drop(batch)
            self._release_later.update(release)  # with the next batch (not a loop while down)
            return
        try:
            self._release_own(client, release)
            items = self._reserve(client, items)
            # The records go first, in a pipeline of their own, and the manifests only once
            # every record was taken. In one pipeline, a server out of memory (maxmemory,
            # noeviction) refused some records and took the manifests after them: the
            # blocks were listed with records missing, counted against the budget, and
            # every reader stopped its prefix there for good (a review).
            records = client.pipeline(transaction=False)
            wrote_records = wrote_blocks = 0
            for kind, block, layer, kv in items:
                if kind == "record":
                    key = BlockKey(block.h, layer, block.index)
                    payload = memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
                    record = self.codec.encode(key, payload, self.codec.geometry.block_tokens, block.token_ids)
                    records.set(self.record_key(block.h, layer), record)
                    wrote_records += 1
            if wrote_records:
                failed = [r for r in records.execute(raise_on_error=False) if isinstance(r, BaseException)]
                if failed:  # the batch is dropped: its blocks are not listed, their records released
                    raise failed[0]
            pipe = client.pipeline(transaction=False)
            listed: list = []
            manifest_at: dict = {}  # block -> the index of its manifest's SET in the pipeline
            for kind, block, layer, kv in items:
                if kind == "record":
                    continue
                if kind == "manifest":  # after the block's records: a reader that sees it finds them
                    manifest_at[block.h] = len(pipe)
                    pipe.set(self.manifest_key(block.h), self.encode_manifest(block))
                    if self.budget is not None:  # listed, then no longer being written: counted once
                        pipe.zadd(self.lru_key, {f"{block.h:016x}": self._score(block)})
                        pipe.zrem(self.res_key, self._member(block.h))
                        listed.append(block.h)
                    wrote_blocks += 1
                else:  # touch: only blocks still listed (XX), never resurrecting an evicted one
                    pipe.zadd(self.lru_key, {f"{b.h:016x}": self._score(b) for b in block}, xx=True)
            if self.budget is not None:  # the blocks still being written sent a record just now
                sending = {self._member(block.h): time.time() for kind, block, _, _ in items
                           if kind == "record" and block.h in self._unlisted and block.h not in listed}
                if sending:
                    pipe.zadd(self.res_key, sending, xx=True)
            results = pipe.execute(raise_on_error=False)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed and (self.budget is None or not all(_wrong_type(r) for r in failed)):
                # Refused in part (out of memory, an ACL): a block whose manifest and listing
                # went in is written, whole, and counted so; a manifest that went in unlisted
                # goes again, so that the block's release (it is dropped below) takes its records.
                def took(i: int) -> bool:
                    return not isinstance(results[i], BaseException)
                written = {h for h, i in manifest_at.items() if took(i) and (self.budget is None or took(i + 1))}
                stray_manifests = [self.manifest_key(h) for h, i in manifest_at.items()
                                   if took(i) and h not in written]
                # and a listing that went in without its manifest goes, uncounting the block
                stray_listings = [f"{h:016x}" for h, i in manifest_at.items()
                                  if self.budget is not None and h not in written and took(i + 1)]
                self._unlisted.difference_update(written)
                self._in_place.difference_update(written)
                self._count(bytes_written=self.record_bytes * sum(
                    1 for kind, block, _, _ in items if kind == "record" and block.h in written),
                    blocks_written=len(written))
                batch = [it for it in batch if it[0] == "touch" or it[1].h not in written]  # before any call
                if stray_listings:
                    client.zrem(self.lru_key, *stray_listings)
                if stray_manifests:
                    client.delete(*stray_manifests)
                raise failed[0]
            self._unlisted.difference_update(listed)
            self._in_place.difference_update(listed)
            if failed:  # only the budget's sorted sets can meet a wrong type: the manifests went in
                self._repair_budget(client, failed[0], [block for kind, block, _, _ in items if kind == "manifest"])
            if listed and self.budget is not None:
                # A block listed when this batch began (not counted again) may have been
                # evicted by another worker and written back here: counted again now that it
                # is listed, it may put the namespace over; back within the budget at once.
                self._fit(client)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc, "writing blocks")
            self._drop(batch)
            self._release_later.update(h for h in release if h in self._unlisted or h in self._in_place)
            return
        self._count(bytes_written=wrote_records * self.record_bytes, blocks_written=wrote_blocks)

    def _reserve(self, client: Any, items: list) -> list:
        """With remote_budget: reserve each new block (``res_key``, seen by every worker)
        before its first record is written, then delete least recently used blocks until the
        blocks listed and reserved fit the budget (``_fit``), so the namespace never holds
        more than remote_budget. A block that cannot get room is not written (its records are
        dropped and counted). Returns the items to write.

        Reserving first and counting after makes racing workers careful, not generous: each
        counts the others' reservations too. (A byte counter kept per worker was resynced to
        that worker's own blocks being written when its eviction list ran empty: other
        workers' blocks went uncounted, and four workers held five times the budget, for
        good; a review.)"""
        if self.budget is None:
            return items
        blocks = list(dict.fromkeys(it[1].h for it in items if it[0] == "record"))
        # Counted already: blocks this process reserved (``_unlisted``), and blocks listed on
        # the server (written by another worker, or by this one before), which are rewritten
        # in place. Not those that left it: a block written, evicted and then written again
        # was never counted again, and the namespace outgrew the budget.
        fresh = [h for h in blocks if h not in self._unlisted]
        on_server: set = set()
        if fresh:
            # GET, not EXISTS: the README's ACL grants GET (manifests are small); a key of
            # another type reads as empty (_pipeline_get): that block is counted, SET replaces it
            there = self._pipeline_get(client, [self.manifest_key(h) for h in fresh])
            on_server = {h for h, value in zip(fresh, there) if value}
        todo = [h for h in fresh if h not in on_server]
        # Rewritten unreserved: if another worker evicts one meanwhile, what is sent here is
        # uncounted until it is listed; if its publish stops first, ``_release`` deletes it.
        self._in_place.update(on_server)
        refused: set = set()
        self._evicted = set()
        while todo:
            h = todo.pop(0)
            self._reserve_one(client, h)
            if not self._fit(client):
                self._release_own(client, [h])
                refused.add(h)
            gone = on_server & self._evicted  # rewritten here, deleted to make room: counted anew
            on_server -= gone
            self._in_place -= gone
            todo.extend(gone)
        if not refused:
            return items
        kept = [it for it in items if it[0] == "touch" or it[1].h not in refused]
        self._drop([it for it in items if it[0] != "touch" and it[1].h in refused])
        return kept

    def _reserve_one(self, client: Any, h: int) -> None:
        """Count block ``h`` as being written by this process (``res_key``, ``_unlisted``)."""
        from redis.exceptions import ResponseError

        self._unlisted.add(h)  # first: a reservation made and not known here would never go
        try:
            client.zadd(self.res_key, {self._member(h): time.time()})
        except ResponseError as exc:
            if not _wrong_type(exc):
                raise
            self._repair_budget(client, exc)  # reserves every block of ``_unlisted``: this one too

    def _used(self, client: Any) -> int:
        """Blocks the budget counts: listed on the server plus being written, by any worker."""
        pipe = client.pipeline(transaction=False)
        pipe.zcard(self.lru_key)
        pipe.zcard(self.res_key)
        listed, writing = pipe.execute(raise_on_error=False)
        for value in (listed, writing):
            if isinstance(value, BaseException):
                if not _wrong_type(value):
                    raise value
                self._repair_budget(client, value)
                return self._used(client)  # both are sorted sets (or absent) now
        return int(listed) + int(writing)

    def _fit(self, client: Any) -> bool:
        """Delete least recently used blocks until the blocks listed and being written fit
        remote_budget; False when that is not possible (everything counted is being written,
        after reservations left by a writer that is gone were cleared)."""
        from redis.exceptions import ResponseError

        cleared = False
        while True:
            if self._used(client) * self.block_bytes <= self.budget:
                return True
            if not cleared:  # before evicting anything live: a busy list is never empty
                cleared = True
                if self._clear_stale(client):
                    continue
            try:
                popped = client.zpopmin(self.lru_key, 1)
            except ResponseError as exc:
                if not _wrong_type(exc):
                    raise  # refused, out of memory, read-only, ...: the server's error, not a bad key
                self._repair_budget(client, exc)
                continue
            if not popped:
                return False
            try:
                h = int(popped[0][0], 16)
            except ValueError:  # not a member this code wrote; it is gone now
                continue
            keys = self.block_keys(h)
            pipe = client.pipeline(transaction=False)
            pipe.delete(keys[0])  # the manifest first: readers stop seeing the block at once
            pipe.delete(*keys[1:])
            pipe.execute()
            self._evicted.add(h)
            self._count(evicted_blocks=1)

    def _member(self, h: int) -> str:
        """This tier's reservation of block ``h``: one per worker, so that a worker giving
        up a block that another is writing too takes back only its own (one member per
        block took back the other's as well, and deleted the records it was sending)."""
        return f"{h:016x}:{self._worker}"

    def _clear_stale(self, client: Any) -> int:
        """Reservations no record has refreshed for ``STALE_RESERVATION_S`` (their writer was
        killed mid-block): they go, with the records they sent. Returns how many went."""
        cutoff = time.time() - STALE_RESERVATION_S
        stale = client.zrangebyscore(self.res_key, "-inf", cutoff)
        if not stale:
            return 0
        members: dict = {}
        for member in stale:
            try:
                members.setdefault(int(member.split(b":", 1)[0], 16), []).append(member)
            except ValueError:  # not a member this code wrote
                client.zrem(self.res_key, member)
        self._release(client, members)
        return len(stale)

    def _release_own(self, client: Any, hs: Sequence[int]) -> None:
        """``_release`` of this process's blocks ``hs`` (its own reservation of each; a block
        it rewrote unreserved has none), which it then no longer writes."""
        self._release(client, {h: [self._member(h)] for h in hs})
        self._unlisted.difference_update(hs)
        self._in_place.difference_update(hs)

    def _release(self, client: Any, members: dict) -> None:
        """Take back reservations of blocks that will not be listed (block -> its
        reservations to remove). The records they sent go too, unless the block is listed
        after all (another worker wrote it whole) or another worker's reservation of it
        remains (it is sending them too)."""
        if not members:
            return
        pipe = client.pipeline(transaction=False)
        for h, mine in members.items():
            pipe.zrem(self.res_key, *mine)
        pipe.execute()
        blocks = list(members)
        there = self._pipeline_get(client, [self.manifest_key(h) for h in blocks])
        pipe = client.pipeline(transaction=False)
        for h, manifest in zip(blocks, there):
            if not manifest and not self._reserved_elsewhere(client, h):
                pipe.delete(*self.block_keys(h)[1:])
        pipe.execute()

    def _reserved_elsewhere(self, client: Any, h: int) -> bool:
        """Whether a reservation of block ``h`` remains (another worker is writing it)."""
        return any(True for _ in client.zscan_iter(self.res_key, match=f"{h:016x}:*", count=64))

    def _drop(self, batch: list) -> None:
        with self._lock:
            for kind, block, _layer, _kv in batch:
                if kind == "record":
                    self._counts["writes_dropped"] += 1
                    self._poison(block.h)
                elif kind == "manifest":  # its records went in earlier batches: they and its
                    self._poison(block.h)  # reservation go, not left to the stale timeout (a review)

    _POISON_KEPT = 1 << 16  # blocks remembered: far more than the queue holds records of

    def _poison(self, h: int) -> None:
        """Under the lock: block ``h`` lost a record; it gets no manifest in this publish,
        and its reservation goes (``_write_batch``) unless a new publish of it comes first."""
        self._pending.pop(h, None)
        self._poisoned[h] = None
        if self.budget is not None:
            self._to_release.add(h)
            self._cv.notify_all()  # the writer releases it (and a flush waits for that)
        while len(self._poisoned) > self._POISON_KEPT:  # the oldest left the queue long ago
            self._poisoned.pop(next(iter(self._poisoned)))

    def abandon(self, block: Any) -> None:
        """The caller stops publishing ``block`` before its last layer (the prefix cache
        could not store it, or the forward stopped): it gets no manifest, and with
        remote_budget its reservation goes with the records sent. A block left half sent
        stayed counted for good: the budget filled with such blocks and refused every
        later write (a review)."""
        with self._cv:
            if self.closed or (block.h not in self._pending and self.budget is None):
                return
            self._poison(block.h)

    def _repair_budget(self, client: Any, exc: BaseException, relist: Sequence[Any] = ()) -> None:
        """An eviction list or reservation set held a value of the wrong kind: such a key is
        deleted (the order it kept is lost); ``relist``, the blocks just written whose
        listing failed on it, are listed again, and this process's blocks being written are
        reserved again. Counted corrupt. Only for a bad value: a refused command (an ACL
        without ZCARD, say) is the server's error, raised."""
        from redis.exceptions import ResponseError

        with self._lock:
            self._errors["corrupt"] += 1
        log.warning("remote tier: the budget's keys %s, %s held bad values (%s); resetting them",
                    self.lru_key, self.res_key, exc)
        for key in (self.lru_key, self.res_key):
            try:
                client.zcard(key)
            except ResponseError as err:
                if not _wrong_type(err):
                    raise
                client.delete(key)  # not a sorted set
        if relist:
            client.zadd(self.lru_key, {f"{b.h:016x}": self._score(b) for b in relist})
            client.zrem(self.res_key, *[self._member(b.h) for b in relist])
            self._unlisted.difference_update(b.h for b in relist)
        if self._unlisted:
            client.zadd(self.res_key, {self._member(h): time.time() for h in self._unlisted})

    # ---- lifecycle --------------------------------------------------------------------------
    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait (up to ``timeout`` seconds, default 20 server timeouts) until every queued
        write has been sent; True when the queue drained."""
        deadline = time.monotonic() + (timeout if timeout is not None else max(5.0, 20 * self.timeout))
        with self._cv:
            while self._queue or self._busy or self._to_release:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["errors"] = dict(self._errors)
            out["queued_bytes"] = self._inflight
        out.update(url=redact_url(self.url), state=self._state, namespace=self.namespace,
                   budget_bytes=self.budget, cluster=self.cluster)
        return out

    def close(self, timeout: Optional[float] = None) -> None:
        """Send what is queued (bounded wait), stop the writer and disconnect."""
        if self.closed:
            return
        with self._cv:  # blocks whose last layers never came: never listed, their reservations go
            for h in list(self._pending):
                self._poison(h)
            self._cv.notify_all()
        drained = self.flush(timeout)
        with self._cv:
            self.closed = True
            left = len(self._queue)
            unsent = sum(1 for item in self._queue if item[0] == "record")
            self._counts["writes_dropped"] += unsent  # records not sent, as every other drop
            self._inflight -= unsent * self.record_bytes
            self._queue.clear()
            self._cv.notify_all()
        if not drained and left:
            log.warning("remote tier %s: %d queued writes were not sent before close", redact_url(self.url), left)
        if self._writer is not None:
            self._writer.join(timeout=max(1.0, 2 * self.timeout))
        with self._client_lock:
            client, self._client = self._client, None
        self._release_at_close(client)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass

    def _release_at_close(self, client: Any) -> None:
        """The reservations whose release waited for a next batch (``_release_later``: the
        server was down, or had just refused a batch, when their publish stopped) are taken
        back once more, if the server answers. Left, they counted against every worker's
        remote_budget until one cleared them as stale, ten minutes on: a batch refused for
        lack of memory left its blocks' reservations so (a review)."""
        if self._writer is not None and self._writer.is_alive():  # still running: it owns them
            return
        later = [h for h in self._release_later if h in self._unlisted or h in self._in_place]
        self._release_later = set()
        if not later:
            return
        own = client is None
        try:
            if own:
                client = self._connect()
            self._release_own(client, later)
        except Exception as exc:  # noqa: BLE001 - stale in the end: another worker clears them
            with self._lock:
                self._errors[classify(exc)] += 1
            log.warning("remote tier %s: %d block reservation(s) not taken back at close (%s); other "
                        "workers clear them as stale after %.0f s", redact_url(self.url), len(later), exc,
                        STALE_RESERVATION_S)
        finally:
            if own and client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass


def _wrong_type(value: object) -> bool:
    """A pipeline's answer for a key that holds another type than the command needs."""
    from redis.exceptions import ResponseError

    return isinstance(value, ResponseError) and str(value).startswith("WRONGTYPE")


def classify(exc: BaseException) -> str:
    """The error kind counted for a failed server call."""
    import redis.exceptions as rx

    seen, cause = 0, exc
    while cause is not None and seen < 8:  # a cluster client wraps the timeout it met
        if isinstance(cause, (rx.TimeoutError, TimeoutError)):
            return "timeout"
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    denied = (rx.AuthenticationError, rx.AuthorizationError, rx.NoPermissionError)
    if isinstance(exc, denied) or "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
        return "auth"
    if isinstance(exc, (rx.ConnectionError, ConnectionError, OSError)):
        return "unavailable"
    return "server"
