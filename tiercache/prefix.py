"""The persistent prefix cache: KV blocks addressed by content, reused across requests and
process restarts.

A full block of a sequence is named by a hash chained over the previous block's name and
this block's token ids, salted with the model digest (architecture, config, dtype, weights
identity) and the block geometry; each layer's record of it is the ``BlockKey(h, layer,
index)`` where ``h`` is the first 63 bits of that hash. The records live in a persistent
``BlockStore`` under ``<disk_dir>/prefix/<digest>-<geometry>/`` (host tier in memory, disk
tier in a data file whose record headers carry the block's token ids), with an SQLite index
(WAL mode) beside it holding the chain (parent links), token ids, hit counts and last use.

A hit compares the block's token ids with the prompt's, so a hash collision can never
return another prompt's KV. On open, the index is reconciled with the record headers: rows
whose records are gone are dropped and records the index lacks are added back from their
headers; an index that is missing or damaged is rebuilt the same way. One process at a time
holds a prefix directory (flock); another gets ``CacheDirError``.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import crc32c
import torch

from tiercache.cache_admin import BAD_INDEX_ROWS
from tiercache.config import TierConfig

if TYPE_CHECKING:
    from tiercache.remote import RemoteTier
from tiercache.disk import DiskTier, in_forked_children
from tiercache.errors import BlockCorruptedError, CacheDirError, TierIOError, UnsupportedModelError
from tiercache.events import Events
from tiercache.store import BlockStore
from tiercache.table import BlockKey, Tier
from tiercache.tiers import ALIGN, BlockGeometry

log = logging.getLogger("tiercache")

INDEX_NAME = "index.sqlite"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    h INTEGER PRIMARY KEY,      -- chained content hash (63 bits)
    idx INTEGER NOT NULL,       -- block index in its sequence
    parent INTEGER,             -- h of the block it extends (NULL for a first block)
    tokens BLOB NOT NULL,       -- packed token ids (3 bytes each)
    layers INTEGER NOT NULL,    -- layers whose record is stored
    hits INTEGER NOT NULL DEFAULT 0,
    seen INTEGER NOT NULL DEFAULT 1,
    created REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks (parent);
CREATE INDEX IF NOT EXISTS blocks_sightings ON blocks (layers, last_used);
"""


_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (state, dtype, digest)
_DIGESTS_LOCK = threading.Lock()
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64: the golden-ratio multiplier
_WORDS_PER_STEP = 1 << 22  # 32-bit words hashed per step on a device (~160 MiB of temporaries)


def tensor_fingerprint(t: torch.Tensor) -> bytes:
    """Bytes that change with any byte of ``t``: the CRC32C of all its bytes on CPU (the
    hardware CRC, ~28 GB/s here: 20 ms for SmolLM2-135M's 540 MB), and on a GPU a linear
    hash of its 32-bit words computed there (sum of word * odd pseudo-random multiplier,
    mod 2^64), so that a model's weights are never copied to the host to be named. One
    changed word always changes either; several cancel with odds of ~2^-32 (CPU) or
    ~2^-64 (GPU)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or flat.device.type == "meta":
        return b""
    data = flat.view(torch.uint8)
    if data.device.type == "cpu":
        return crc32c.crc32c(data.numpy()).to_bytes(4, "little")
    return linear_hash(data)


def linear_hash(data: torch.Tensor) -> bytes:
    """``tensor_fingerprint`` on a device: 8 bytes from the 1-D uint8 tensor ``data``,
    computed where it lies (any device; CPU in the tests)."""
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), _WORDS_PER_STEP):
        chunk = words[lo:lo + _WORDS_PER_STEP].to(torch.int64)
        index = torch.arange(lo, lo + chunk.numel(), dtype=torch.int64, device=words.device)
        total += (chunk * ((index * _MIX) ^ (index >> 29) | 1)).sum()
    return int(total).to_bytes(8, "little", signed=True)


def _naming_fields(fields: dict, top: bool = True) -> dict:
    """A config's fields that name the model's KV: not where it was loaded from (machines
    differ; the top level's ``_name_or_path``, as always, so that no user's prefix cache is
    renamed), nor tiercache's own marks (the attention hook's ``_tiercache_inner_attention``,
    set by a run with a trace, selection or retention: such runs published under another
    name and never met the plain runs' prefixes), in nested configs too."""
    return {k: _naming_fields(v, top=False) if isinstance(v, dict) else v for k, v in fields.items()
            if not (top and k == "_name_or_path") and not str(k).startswith("_tiercache")}


_SAMPLES_PER_TENSOR = 64
_SAMPLE_AT: dict = {}  # (numel, device) -> the flat indices sampled


def _sample_at(numel: int, device: torch.device) -> torch.Tensor:
    """64 flat indices spread over ``numel`` by the golden ratio (a low-discrepancy sequence),
    plus the last: evenly strided ones fell in the same few columns of a matrix whose row
    length divides the stride (3 of 64 columns), and an edit of the other 61 went unseen."""
    at = _SAMPLE_AT.get((numel, device))
    if at is None:
        k = torch.arange(1, _SAMPLES_PER_TENSOR + 1, dtype=torch.float64)
        at = torch.cat([((k * 0.6180339887498949) % 1.0 * numel).long().clamp_(max=numel - 1),
                        torch.tensor([numel - 1])]).to(device)
        _SAMPLE_AT[(numel, device)] = at
    return at


def _weights_sample(tensors: list) -> bytes:
    """A few elements of each tensor, spread over it (``_sample_at``): a change that torch's
    version counter does not see (an edit through ``.data``, as PEFT merges an adapter into
    its base weights) shows here unless it misses every sampled element."""
    parts: list = []
    for _, t in tensors:
        t = t.detach()
        if not t.numel():
            continue
        at = _sample_at(t.numel(), t.device)
        if t.is_contiguous():
            picked = t.reshape(-1)[at]
        else:  # reshape would copy all of it, every call (46 ms for a transposed 4096 x 4096)
            picked = t[torch.unravel_index(at, t.shape)] if t.dim() else t.reshape(1)
        parts.append(picked.reshape(-1).view(torch.uint8))
    if not parts:
        return b""
    by_device: dict = {}
    for part in parts:
        by_device.setdefault(part.device, []).append(part)
    return b"".join(torch.cat(group).cpu().numpy().tobytes() for group in by_device.values())


def model_digest(model: Any, dtype: Optional[torch.dtype] = None) -> bytes:
    """16 bytes naming the model: class, full config, dtype, and every byte of every weight
    and buffer (``tensor_fingerprint``). Two models that differ anywhere get different
    prefix caches: a digest over a sample of each weight (192 elements) matched a model
    with 20 embedding rows retrained, which was then served the other model's KV
    (silently wrong tokens; found by a helper's adversarial test). Kept per model object
    while no weight changed: each tensor's address and version counter, and a sample of
    its elements (``_weights_sample``; weights scaled through ``.data``, which the counter
    does not see, were served the old weights' KV). Weights on the meta device (offloaded
    by accelerate) cannot be named: ``UnsupportedModelError`` (they named nothing, so two
    models that differed only there shared a prefix cache: wrong tokens)."""
    tensors = []
    if hasattr(model, "named_parameters"):
        tensors = list(model.named_parameters()) + list(model.named_buffers())
    meta = [name for name, t in tensors if t.device.type == "meta"]
    if meta:
        raise UnsupportedModelError(f"{type(model).__name__}: the prefix cache cannot name weights on the meta device "
                                    f"({len(meta)} tensors, such as {meta[0]!r}: offloaded by accelerate?)")
    config = getattr(model, "config", None)
    # where the model was loaded from does not name it: machines differ
    config_text = json.dumps(_naming_fields(config.to_dict()), sort_keys=True, default=str) if config is not None \
        else ""
    config_text += _switches_text(model)
    with torch.no_grad():  # the config too: one changed in place (a sliding window) computes other KV
        state = (tuple((name, t.data_ptr(), t._version) for name, t in tensors), _weights_sample(tensors),
                 config_text)
    with _DIGESTS_LOCK:
        try:
            known = _DIGESTS.get(model)
        except TypeError:  # not weak-referenceable: named every time
            known = None
    if known is not None and known[0] == state and known[1] == dtype:
        return known[2]
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__name__.encode())
    h.update(config_text.encode())
    h.update(str(dtype or (tensors[0][1].dtype if tensors else "")).encode())
    with torch.no_grad():
        for name, t in tensors:
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:".encode())
            h.update(tensor_fingerprint(t))
    digest = h.digest()
    with _DIGESTS_LOCK:
        try:
            _DIGESTS[model] = (state, dtype, digest)
        except TypeError:
            pass
    return digest


# Attributes of a submodule that change what it computes with the same weights: PEFT's
# adapters (LoRA and the rest, ``BaseTunerLayer``) switched off (``disable_adapter()``),
# another adapter made active (``set_adapter``), merged, or rescaled (``set_scale``). A run
# with the adapter off published under the adapted model's name, and the adapted run then
# loaded it: logits 7.4 off (a review).
_BEHAVIOUR_SWITCHES = ("_disable_adapters", "_active_adapter", "merged_adapters", "scaling")


def _switches_text(model: Any) -> str:
    """The values of ``_BEHAVIOUR_SWITCHES`` on ``model``'s submodules that have them ("" if none)."""
    if not hasattr(model, "named_modules"):
        return ""
    found = []
    for name, module in model.named_modules():
        if "_disable_adapters" not in vars(module):  # not an adapter layer (attention has a ``scaling`` too)
            continue
        values = {attr: getattr(module, attr) for attr in _BEHAVIOUR_SWITCHES if attr in vars(module)}
        found.append(f"{name}:{sorted((k, repr(v)) for k, v in values.items())}")
    return "|switches:" + ";".join(found) if found else ""


def _aligned_empty(num_bytes: int) -> torch.Tensor:
    """An uninitialised CPU byte tensor of ``num_bytes`` starting on a page boundary."""
    raw = torch.empty(num_bytes + ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + num_bytes]


@dataclass(frozen=True)
class ChainBlock:
    """One full block of a token sequence, named by its chained hash."""

    h: int
    index: int
    parent: Optional[int]
    token_ids: bytes  # packed, DiskTier.pack_token_ids
    digest: bytes = b""  # the full chained hash (h is its first 63 bits)


def extend(prev: Optional[ChainBlock], token_ids: Sequence[int], salt: bytes) -> ChainBlock:
    """The block after ``prev`` (None: the first block) holding ``token_ids``."""
    packed = DiskTier.pack_token_ids(token_ids)
    digest = hashlib.blake2b((prev.digest if prev else salt) + packed, digest_size=16).digest()
    h = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    return ChainBlock(h, prev.index + 1 if prev else 0, prev.h if prev else None, packed, digest)


def chain(token_ids: Sequence[int], block_tokens: int, salt: bytes) -> list:
    """The ``ChainBlock`` of every full block of ``token_ids``."""
    out: list = []
    for index in range(len(token_ids) // block_tokens):
        out.append(extend(out[-1] if out else None, token_ids[index * block_tokens:(index + 1) * block_tokens], salt))
    return out


class PrefixIndex:
    """The SQLite index of one prefix directory (WAL mode, one connection, its own lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        self.rebuilt = False
        try:
            self._db = self._connect()
        except (sqlite3.DatabaseError, OSError) as exc:  # damaged, an older schema, not a file
            log.warning("prefix index %s is damaged (%s); rebuilding it from the record headers", path, exc)
            self._move_aside()
            try:
                self._db = self._connect()
            except (sqlite3.Error, OSError) as again:
                raise CacheDirError(f"prefix index {path!r} cannot be opened or rebuilt ({again})") from None
            self.rebuilt = True

    def _connect(self) -> sqlite3.Connection:
        fresh = not os.path.exists(self.path)
        # Created 0600 first: SQLite gives its -wal and -shm files the database file's mode.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600))
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(self.path + suffix):
                os.chmod(self.path + suffix, 0o600)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            # every column this code reads: an index of an older schema is rebuilt, not a
            # "no such column" error from the first query that needs it
            db.execute("SELECT h, idx, parent, tokens, layers, hits, seen, created, last_used FROM blocks "
                       "LIMIT 1").fetchone()
            db.execute("SELECT key, value FROM meta LIMIT 1").fetchone()
            # integrity_check, not quick_check: a flipped bit that left an index out of step
            # with its table passed quick_check, and every write then failed ("database disk
            # image is malformed"): the prefix cache was off for good (a review)
            (check,) = db.execute("PRAGMA integrity_check(1)").fetchone()
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity_check: {check}")
            # SQLite keeps whatever type a row was given: a text or negative number of layers
            # passed quick_check, and every later open failed with a TypeError from inside
            (bad,) = db.execute(BAD_INDEX_ROWS).fetchone()
            if bad:
                raise sqlite3.DatabaseError(f"{bad} rows hold values of the wrong type or range")
        except sqlite3.DatabaseError:
            db.close()
            raise
        os.chmod(self.path, 0o600)
        self.rebuilt = self.rebuilt or fresh
        return db

    def _move_aside(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            path = self.path + suffix
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # a directory in a file's place (empty: else it stays and the reopen fails)
                else:
                    os.replace(path, path + ".damaged")
            except OSError:
                pass

    def _io(self, what: str, exc: Exception) -> TierIOError:
        return TierIOError(f"prefix index {self.path!r}: {what} failed ({exc})")

    def _execute(self, what: str, sql: str, args=(), many: bool = False) -> sqlite3.Cursor:
        """One statement under the lock; SQLite's errors (a full disk, a file made read-only
        or damaged meanwhile) are a ``TierIOError`` naming the index, not a sqlite3 error
        from inside."""
        with self._lock:
            try:
                return (self._db.executemany if many else self._db.execute)(sql, args)
            except sqlite3.Error as exc:
                raise self._io(what, exc) from None

    def _fetch(self, sql: str, args=(), one: bool = False):
        """A query's rows (or its first row), under the lock; errors as ``_execute``'s."""
        with self._lock:
            cur = self._execute("reading", sql, args)
            try:
                return cur.fetchone() if one else cur.fetchall()
            except sqlite3.Error as exc:
                raise self._io("reading", exc) from None

    def rows(self, hs: Optional[Sequence[int]] = None) -> dict:
        """h -> (h, idx, parent, tokens, layers, hits, seen) of every block, or of ``hs``."""
        sql = "SELECT h, idx, parent, tokens, layers, hits, seen FROM blocks"
        if hs is None:
            return {r[0]: r for r in self._fetch(sql)}
        return {r[0]: r for r in self._fetch_in(f"{sql} WHERE h IN ({{}})", hs)}

    def descendants(self, hs: Sequence[int]) -> dict:
        """h -> idx of every block that extends one of ``hs``, directly or not."""
        return dict(self._fetch_in("WITH RECURSIVE d(h) AS (SELECT h FROM blocks WHERE parent IN ({}) "
                                   "UNION SELECT b.h FROM blocks b JOIN d ON b.parent = d.h) "
                                   "SELECT b.h, b.idx FROM blocks b JOIN d ON b.h = d.h", hs))

    def _fetch_in(self, sql: str, values: Sequence[int]) -> list:
        """The rows of ``sql`` with its ``{}`` filled by placeholders for ``values``, asked in
        parts of 500 (SQLite's limit on bound parameters)."""
        values, out = list(values), []
        for lo in range(0, len(values), 500):
            part = values[lo:lo + 500]
            out.extend(self._fetch(sql.format(",".join("?" * len(part))), part))
        return out

    def sightings(self) -> int:
        """Rows of blocks seen once and not stored (``reuse_admission="reused"``)."""
        return self._fetch("SELECT count(*) FROM blocks WHERE layers = 0", one=True)[0]

    def trim_sightings(self, n: int) -> None:
        """Forget the ``n`` least recently seen first sightings."""
        self._execute("writing", "DELETE FROM blocks WHERE h IN "
                                 "(SELECT h FROM blocks WHERE layers = 0 ORDER BY last_used LIMIT ?)", (n,))

    def upsert(self, block: ChainBlock, layers: int, seen: int = 1) -> None:
        now = time.time()
        self._execute("writing",
                      "INSERT INTO blocks (h, idx, parent, tokens, layers, seen, created, last_used) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(h) DO UPDATE SET layers=excluded.layers, "
                      "seen=max(blocks.seen, excluded.seen), last_used=excluded.last_used",
                      (block.h, block.index, block.parent, block.token_ids, layers, seen, now, now))

    def get(self, h: int) -> Optional[tuple]:
        return self._fetch("SELECT h, idx, parent, tokens, layers, hits, seen FROM blocks WHERE h = ?", (h,), one=True)

    def hit(self, hs: Sequence[int]) -> None:
        now = time.time()
        self._execute("writing", "UPDATE blocks SET hits = hits + 1, last_used = ? WHERE h = ?",
                      [(now, h) for h in hs], many=True)

    def delete(self, hs: Sequence[int]) -> None:
        self._execute("writing", "DELETE FROM blocks WHERE h = ?", [(h,) for h in hs], many=True)

    def set_meta(self, key: str, value: str) -> None:
        self._execute("writing", "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.DatabaseError:
                pass
            self._db.close()


def prefix_eviction(name: str) -> str:
    """The eviction policy of the prefix store: ``name``, unless it assumes the decode scan."""
    from tiercache.policies import EVICTION_POLICIES

    return "lfu" if getattr(EVICTION_POLICIES.get(name), "assumes_layer_scan", False) else name


class PrefixCache:
    """Content-addressed KV blocks of one model and geometry under ``<root>/prefix/``.

    Args:
        root: the cache's ``disk_dir``.
        config: budgets and policies; the prefix store gets ``reuse_host_budget`` of host
            memory and ``disk_budget`` of disk, and evicts with ``config.eviction``
            (extensions before the prefixes they extend), or with ``lfu`` when that policy
            assumes decoding's layer scan (``layer-cycle``): prefix blocks are not read so.
        geometry: block shape (batch 1).
        digest: ``model_digest(model)``.
        num_layers: layers per block of tokens.
    """

    def __init__(self, root: str, config: TierConfig, geometry: BlockGeometry, digest: bytes,
                 num_layers: int) -> None:
        self.geometry, self.num_layers, self.digest = geometry, num_layers, digest
        self._pid = os.getpid()  # see ``forked``
        g = geometry
        tag = f"{digest.hex()}-t{g.block_tokens}-h{g.kv_heads}-d{g.head_dim}-{str(g.dtype).split('.')[-1]}"
        self.directory = os.path.join(root, "prefix", tag)
        from tiercache.disk import ensure_private_dir
        ensure_private_dir(root, config.shared_dir)  # first, so no subfolder gets looser permissions
        ensure_private_dir(os.path.join(root, "prefix"), config.shared_dir)
        self.salt = hashlib.blake2b(tag.encode(), digest_size=16).digest()
        eviction = prefix_eviction(config.eviction)
        try:  # checks the directory: a file or an unwritable folder in its place is a CacheDirError
            # (attention never reads this store: attend_in_place off, or reuse_host_budget=0
            # with it on was refused as a host tier it cannot read, and the cache went off)
            # (prefetch "none" takes no prefetch_depth: the user's, set for lookahead, was refused)
            store_cfg = replace(config, device_budget=2 * g.block_bytes, host_budget=config.reuse_host_budget,
                                disk_dir=self.directory, prefetch="none", prefetch_depth=TierConfig.prefetch_depth,
                                eviction=eviction, attend_in_place=False)
        except ValueError as exc:
            raise CacheDirError(str(exc)) from None
        self.events = Events(eviction)
        record_bytes = DiskTier.record_size(geometry)
        slots = config.disk_budget // record_bytes
        if slots < num_layers:  # no block could ever be kept whole; refused before the store opens,
            # whose open cuts the data file to this budget: a run with the cache off for a too
            # small budget emptied the cache a larger one had filled (a review)
            raise CacheDirError(f"disk_budget: the prefix cache under {root!r} holds {slots} records and one block "
                                f"of this model needs {num_layers} (one per layer); raise disk_budget to at least "
                                f"{num_layers * record_bytes} bytes, or pass reuse=False")
        self.store = BlockStore(store_cfg, geometry, disk_dir=self.directory, persistent=True,
                                model_digest=digest, events=self.events, role="the prefix cache's store")
        self.admission = config.reuse_admission
        # First sightings remembered (admission "reused"): four times the blocks the disk
        # holds. Kept for good, they grew the index past the disk budget with every distinct
        # block a service saw, and every lookup read them all.
        self._max_sightings = max(4096, 4 * (self.store.num_slots(Tier.DISK) // num_layers))
        self._sightings = 0
        self._lock = threading.RLock()
        self._filling: dict = {}  # (h, index) of blocks stored with some of their layers -> who stores them
        self.remote: Optional["RemoteTier"] = None
        try:
            if config.remote_enabled:
                from tiercache import remote as remote_tier
                from tiercache.disk import RecordCodec
                self.remote = remote_tier.RemoteTier(config, RecordCodec(geometry, digest), tag, num_layers)
            self.index = PrefixIndex(os.path.join(self.directory, INDEX_NAME))
            try:
                self.index.set_meta("model_digest", digest.hex())
                self.index.set_meta("layers", str(num_layers))
                self._reconcile()
                self._sightings = self.index.sightings()
            except TierIOError as exc:  # a full disk, say: the prefix cache cannot open (reuse=None: off)
                self.index.close()
                raise CacheDirError(str(exc)) from None
        except BaseException:
            if self.remote is not None:  # it connects as it opens: its thread and socket went on for good
                self.remote.close(timeout=0)
            self.store.close()
            raise
        self.closed = False

    # ---- opening ------------------------------------------------------------------------
    def _keys(self, h: int, index: int) -> list:
        return [BlockKey(h, layer, index) for layer in range(self.num_layers)]

    def _reconcile(self) -> None:
        """Make the index agree with the records the store found in the data file."""
        stored: dict = {}
        for key in self.store.table.keys():
            stored.setdefault((key.seq_id, key.index), set()).add(key.layer)
        rows = rows_before = self.index.rows()
        stale = [h for h, row in rows.items() if len(stored.get((h, row[1]), ())) < self.num_layers
                 and row[4] > 0]
        self.index.delete(stale)
        recovered = []
        incomplete = 0  # records deleted here: of blocks stored with some layers only, or unverifiable
        for (h, index), layers in stored.items():
            if h in rows and h not in stale:
                continue
            ids = self.store.token_ids_of(BlockKey(h, min(layers), index))
            if len(layers) < self.num_layers or not ids:  # incomplete or unverifiable: drop
                for layer in layers:
                    self.store.delete(BlockKey(h, layer, index))
                incomplete += len(layers)
                continue
            recovered.append((h, index, ids, len(layers)))
        parents = self._parents_of([(h, i, ids) for h, i, ids, _ in recovered], rows, set(stale))
        for h, index, ids, layers in recovered:
            self.index.upsert(ChainBlock(h, index, parents.get(h), ids), layers)
        # Blocks whose chain does not reach a first block could never be served: an eviction
        # writes extensions down before their prefixes, so a process killed before it closed
        # left some on disk whose prefix was only in its memory.
        rows, servable = self.index.rows(), set()
        for h, row in sorted(rows.items(), key=lambda item: item[1][1]):
            if row[4] >= self.num_layers and (row[1] == 0 or row[2] in servable):
                servable.add(h)
        orphans = [ChainBlock(h, row[1], None, b"") for h, row in rows.items() if row[4] and h not in servable]
        orphan_records = sum(rows[b.h][4] for b in orphans)
        self.forget(orphans)
        added = len(recovered)
        # records, as the store's count: stale index rows added too counted a block the store
        # had already counted by its records (1,600 "dropped" for 1,200 records cut; a review)
        self.dropped_incomplete = incomplete + orphan_records
        self.recovered = added
        # Blocks dropped because a smaller disk_budget holds fewer are not damage: the store
        # warned of them (a review: they were blamed on a killed process)
        cut = self.store.dropped_groups_for_budget
        stale_cut = sum(1 for h in stale if (h, rows_before[h][1]) in cut)
        damaged = self.store.dropped_on_open - self.store.dropped_past_budget + self.dropped_incomplete
        lost = len(stale) - stale_cut + len(orphans)  # blocks, a file cut short's included
        if damaged or lost:
            log.warning("prefix cache %s: dropped %d damaged or incomplete records (%d blocks) on open (a "
                        "process was killed while writing, or the files were damaged); their tokens will "
                        "be recomputed", self.directory, damaged, lost)
        self._link_all()

    def _parents_of(self, recovered: list, rows: dict, stale: set) -> dict:
        """Re-derive the chain links of blocks recovered from record headers: re-hash each
        block's token ids onto every candidate parent one level up, from block 0 down."""
        from tiercache.disk import DiskTier

        by_level: dict = {}
        for h, row in rows.items():
            if h not in stale and row[4]:
                by_level.setdefault(row[1], []).append((h, row[3]))
        for h, index, ids in recovered:
            by_level.setdefault(index, []).append((h, ids))
        digests: dict = {}  # h -> ChainBlock with its full digest
        parents: dict = {}
        for level in sorted(by_level):
            for h, packed in by_level[level]:
                ids = DiskTier.unpack_token_ids(packed)
                candidates = [None] if level == 0 else [digests[p] for p, _ in by_level.get(level - 1, ())
                                                        if p in digests]
                for parent in candidates:
                    block = extend(parent, ids, self.salt)
                    if block.h == h:
                        digests[h] = block
                        parents[h] = block.parent
                        break
        return parents

    def _link_all(self) -> None:
        rows = self.index.rows()
        for h, (_, idx, parent, *_rest) in rows.items():
            if parent is not None and parent in rows:
                for layer in range(self.num_layers):
                    self.store.link(BlockKey(h, layer, idx), BlockKey(parent, layer, idx - 1))

    # ---- lookups --------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> list:
        """The longest run of full blocks of ``token_ids``, from the first, stored for every
        layer with exactly these tokens. With a remote tier, the run goes on with the blocks
        the server holds; those are fetched, checked and promoted into the local tiers."""
        wanted = chain(token_ids, self.geometry.block_tokens, self.salt)
        rows = self.index.rows([b.h for b in wanted])  # the prompt's own: not every row of the index
        hits = []
        for block in wanted:
            row = rows.get(block.h)
            # the same tokens, at the same place, after the same block (a 63-bit hash collision
            # between blocks with the same tokens after different prefixes is not served)
            if row is None or row[3] != block.token_ids or row[1] != block.index or row[2] != block.parent \
                    or row[4] < self.num_layers:
                break
            if not all(k in self.store for k in self._keys(block.h, block.index)):
                break
            hits.append(block)
        if self.remote is not None and len(hits) < len(wanted):
            hits.extend(self._from_remote(wanted[len(hits):]))
        return hits

    def _from_remote(self, blocks: list) -> list:
        """Fetch the leading ``blocks`` the remote tier holds and promote them into the local
        tiers (without writing them back to the server); returns the blocks promoted."""
        found = self.remote.lookup(blocks)
        promoted: list = []

        def take(block: ChainBlock, kvs: list) -> bool:
            for layer, kv in enumerate(kvs):
                self.publish(block, layer, kv, remote=False)
            if not all(k in self.store for k in self._keys(block.h, block.index)):
                return False  # the local tiers could not hold it: the run ends here
            promoted.append(block)
            return True

        if found:
            self.remote.fetch(blocks[:found], take)
        return promoted

    def load(self, blocks: list, events: Optional[Events] = None) -> tuple:
        """Read the KV of ``blocks`` for every layer: ``(usable, kv)`` where ``kv[layer]`` is
        one CPU tensor ``[2, B, H, usable * T, D]``: K and V of the first ``usable`` blocks of
        that layer, in order (what ``TieredCache.update`` takes for a layer). The records are
        read in parallel straight into these tensors (page-aligned), each checked
        against its CRC32C. A block that fails its check or cannot be read ends the run
        there: it and its extensions are forgotten and their tokens recomputed
        (``usable`` counts the blocks before it; ``kv`` is [] when it is 0). A record that
        fails its check is counted in the prefix store's ``integrity_errors`` and in
        ``events`` (the loading cache's, where its user looks).
        """
        g, n, layers = self.geometry, len(blocks), self.num_layers
        if not n:
            return 0, []
        t = g.block_tokens
        # One page-aligned buffer per layer (direct I/O reads land in it), from torch's
        # allocator: the caller frees each as it is consumed.
        kv = [_aligned_empty(n * g.block_bytes).view(g.dtype).view(2, g.batch, g.kv_heads, n * t, g.head_dim)
              for _ in range(layers)]
        keys, outs = [], []
        for layer in range(layers):  # layer by layer: the order update() consumes them
            for i, block in enumerate(blocks):
                keys.append(BlockKey(block.h, layer, block.index))
                outs.append(kv[layer][:, :, :, i * t:(i + 1) * t])
        errors = self.store.read_into(keys, outs)
        usable, reason = n, None
        for j, exc in enumerate(errors):
            if exc is None:
                continue
            if not isinstance(exc, (BlockCorruptedError, KeyError, OSError)):
                raise exc
            if isinstance(exc, BlockCorruptedError) and events is not None:
                events.integrity_error("disk")
            if j % n < usable:
                usable, reason = j % n, exc
        if usable < n:
            log.warning("prefix block %d of a cached prompt is unreadable (%s); recomputing from there",
                        usable, reason)
            self.forget(blocks[usable:])
        if not usable:
            return 0, []
        self.index.hit([b.h for b in blocks[:usable]])
        return usable, [x if usable == n else x[:, :, :, :usable * t] for x in kv]

    # ---- writing ----------------------------------------------------------------------------
    def admit(self, block: ChainBlock) -> bool:
        """Whether ``block`` should be stored. With ``reuse_admission="reused"`` a block is
        only stored once it was seen before (the first sighting is remembered in the index)."""
        if self.admission == "always":
            return True
        with self._lock:
            if self.index.get(block.h) is None:
                self.index.upsert(block, 0, seen=1)
                self._sightings += 1
                if self._sightings > self._max_sightings * 5 // 4:  # in batches: a count is a scan
                    self.index.trim_sightings(self._sightings - self._max_sightings)
                    self._sightings = self.index.sightings()
                return False
            return True

    def publish(self, block: ChainBlock, layer: int, kv: torch.Tensor, remote: bool = True,
                owner: object = None) -> bool:
        """Store one layer's record of ``block`` (False when it is already stored, or not
        stored: see below); with a remote tier (and ``remote``) also queue it for the
        server. ``kv`` must not change afterwards (the remote writer sends it later).

        Layers come in order (a forward publishes a block's layers one after another), and
        only what can be served is kept: a block whose parent is not stored (a lookup walks
        from the first block, so it could never be reached) or whose earlier layers are not
        is not stored, and when no room can be made (``_room``) the block's layers stored
        so far go too. A block is never left with some of its layers."""
        key = BlockKey(block.h, layer, block.index)
        with self._lock:
            if key in self.store:
                return False
            keys = self._keys(block.h, block.index)
            parent = None if block.parent is None else BlockKey(block.parent, layer, block.index - 1)
            if ((parent is not None and parent not in self.store) or not all(k in self.store for k in keys[:layer])
                    or not self._room(block)):
                if layer:  # what is stored of it could never be served
                    self.forget([block])
                    if self.remote is not None:  # nor what the server got of it
                        self.remote.abandon(block)
                return False
            if layer + 1 < self.num_layers:  # before the put: an interrupt after it leaves it marked
                self._filling[(block.h, block.index)] = owner
            self.store.put(key, kv, self.geometry.block_tokens, token_ids=block.token_ids, tier=Tier.HOST)
            if parent is not None:
                self.store.link(key, parent)
            self.index.upsert(block, layer + 1, seen=2)
            if layer + 1 == self.num_layers:
                self._filling.pop((block.h, block.index), None)
        if remote and self.remote is not None:
            self.remote.put(block, layer, kv)
        return True

    def _room(self, publishing: ChainBlock) -> bool:
        """Before a put of ``publishing``: make room for one record, or say there is none.

        Every block must fit the disk tier, where ``flush`` gives it the copy that outlives
        the process: while the store holds as many records as the disk has slots, a whole
        block (every layer) is forgotten, chosen by the eviction policy of the disk tier,
        else of the host. Only a leaf goes (a block that no stored block extends, on any
        tier: an extension goes before its prefix, which it needs to be found), and never
        ``publishing`` or the block it extends. Returns False when nothing may go.

        (Counted over every tier, a full cache evicted nothing, its two device slots never
        reached: the put raised CapacityError, turning reuse=None off for good and failing
        every reuse=True generate(). Counted over host and disk, a host tier larger than
        the disk kept blocks that the flush at close could not write down. Choosing on one
        tier at a time, a prefix on disk went while its extensions sat on the host, and a
        prompt's own blocks went while their later layers were still to come: blocks that
        could never be served, dropped as incomplete at the next open.)"""
        store = self.store
        capacity = store.num_slots(Tier.DISK) if Tier.DISK in store.tiers else store.capacity_blocks()
        spare = {(publishing.h, publishing.index)}
        if publishing.parent is not None:
            spare.add((publishing.parent, publishing.index - 1))
        while len(store) + 1 > capacity:
            victim = None
            # whole blocks first; blocks still being filled (a forward stores every block's
            # first layer, then every block's second...) only when no whole one may go
            for avoid in (spare | self._filling.keys(), spare):
                for tier in reversed(store.tiers):  # the disk's choice; with none there, the host's
                    victim = self._leaf(tier, avoid)
                    if victim is not None:
                        break
                if victim is not None:
                    break
            if victim is None:
                return False
            self.forget([ChainBlock(victim.seq_id, victim.index, None, b"")])
        return True

    def _leaf(self, tier: Tier, avoid: set) -> Optional[BlockKey]:
        """The eviction policy's first choice on ``tier`` of a block that is a leaf in every
        layer (an extension may have its first layers only, so a key can be a leaf while
        its block is not) and not in ``avoid``; None when there is none. Asks for more
        candidates until one fits or the tier has no more."""
        store, n = self.store, (len(avoid) + 1) * self.num_layers + 1
        while True:
            found = store.evict_candidates(tier, n, leaves_only=True)
            for k in found:
                if (k.seq_id, k.index) not in avoid and not store.extended(self._keys(k.seq_id, k.index)):
                    return k
            if len(found) < n:
                return None
            n *= 4

    def drop_unfinished(self, blocks: Sequence[ChainBlock], owner: object = None) -> int:
        """Forget those of ``blocks`` that ``owner`` stored with some of their layers only
        (the forward that stored them stopped half way: an exception, Ctrl-C): they could
        never be served, and would be evicted last. Another owner's (a request on another
        thread still storing them) stay. Returns how many went."""
        with self._lock:
            gone = [b for b in blocks if self._filling.get((b.h, b.index), _NOBODY) is owner]
            if gone:
                self.forget(gone)
        if self.remote is not None:
            for block in gone:
                self.remote.abandon(block)
        return len(gone)

    def forget(self, blocks: list) -> None:
        """Drop ``blocks`` and every block that extends them: a lookup walks from the first
        block, so an extension whose prefix is gone could never be served (and, its parent
        link gone, an eviction took a prefix while such an extension stayed)."""
        with self._lock:
            gone = {b.h: b.index for b in blocks}
            if gone:
                gone.update(self.index.descendants(list(gone)))
            for h, index in gone.items():
                self._filling.pop((h, index), None)
                for key in self._keys(h, index):
                    self.store.delete(key)
            self.index.delete(list(gone))

    def clear(self, tier: Optional[Tier] = None) -> int:
        """Drop every prefix block (``tier`` None) or only their copies on ``tier``; returns
        how many blocks or copies left it. A block whose only copy is on the host (or the
        device) moves a tier down first, so that clearing memory keeps the blocks: in the
        process that had just stored them (their disk copies are written at close),
        ``clear("host")`` dropped them all (a review). One that cannot move (no room below
        that eviction can make, a disk that fails) goes whole, as a block whose only copy
        is on the disk does with ``clear("disk")``."""
        with self._lock:
            rows = self.index.rows()
            if tier is None:
                self.forget([ChainBlock(h, r[1], None, b"") for h, r in rows.items()])
                return len(rows)
            moved = 0
            below = self.store.tiers[self.store.tiers.index(tier) + 1:] if tier in self.store.tiers else []
            if below:
                alone = [key for h, r in rows.items() if r[4] for key in self._keys(h, r[1])
                         if self.store.tiers_of(key) == [tier]]
                try:
                    failed = self.store.demote_now(alone)
                except (KeyError, TierIOError) as exc:  # gone meanwhile, or no room to be had: dropped below
                    log.warning("tiercache: clear(%r) could not move the prefix blocks down first (%s); "
                                "those with no other copy go", tier.label, exc)
                    failed = alone
                moved = len(alone) - len(failed)
            dropped = self.store.drop_copies(tier)
            # a block whose only copy was on ``tier`` went whole: its index row (and the blocks
            # that extend it, which could not be served any more) go too
            self.forget([ChainBlock(h, r[1], None, b"") for h, r in rows.items()
                         if r[4] and not all(k in self.store for k in self._keys(h, r[1]))])
            return moved + dropped

    @property
    def forked(self) -> bool:
        """Whether this process is a child made by ``fork()`` after the cache opened (its
        store, index connection and remote writer are the parent's)."""
        return os.getpid() != self._pid

    def flush(self) -> None:
        """Give every block a disk copy (blocks survive the process) and send the remote
        tier's queued writes (bounded wait). Nothing in a forked child (see ``forked``)."""
        if self.forked:
            return
        self.store.flush()
        if self.remote is not None:
            self.remote.flush()

    def stats(self) -> dict:
        rows = self.index.rows()
        children = {r[2] for r in rows.values() if r[2] is not None}
        return {"directory": self.directory, "blocks": sum(1 for r in rows.values() if r[4]),
                "dropped_on_open": self.store.dropped_on_open + self.dropped_incomplete,
                "records": len(self.store), "bytes": len(self.store) * self.geometry.block_bytes,
                "prefixes": sum(1 for h, r in rows.items() if r[4] and h not in children),
                "hits": sum(r[5] for r in rows.values()), "tiers": self.store.tier_stats(),
                **({"remote": self.remote.stats()} if self.remote is not None else {})}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.forked:  # the parent's: its SQLite connection, files and threads are left alone
            return
        try:
            if self.remote is not None:
                self.remote.close()
            self.store.close()
        finally:
            self.index.close()


_NOBODY = object()  # drop_unfinished: no block's owner
_OPEN: dict = {}
_OPEN_LOCK = threading.Lock()


def open_prefix_cache(root: str, config: TierConfig, geometry: BlockGeometry, digest: bytes,
                      num_layers: int) -> PrefixCache:
    """The process's one ``PrefixCache`` for this directory, model and geometry (kept open,
    with its host copies warm, until ``close_all`` or exit)."""
    key = (os.path.realpath(root), digest, geometry)
    with _OPEN_LOCK:
        cache = _OPEN.get(key)
        if cache is None or cache.closed:
            if not _OPEN:
                atexit.register(close_all)
                in_forked_children(_after_fork)
            cache = _OPEN[key] = PrefixCache(root, config, geometry, digest, num_layers)
            cache.settings = _prefix_settings(config)
            _WARNED.difference_update([said for said in _WARNED if said[0] == key])
        elif _prefix_settings(config) != cache.settings:
            # Other caches of this process may be using it: the settings it opened with stay (a
            # re-wrap with reuse_admission="reused" went on publishing on first sight, unsaid).
            # Said once per directory and settings, not at every generate() call.
            theirs, mine = cache.settings, _prefix_settings(config)
            said = (key, tuple(mine.items()))
            if said not in _WARNED:
                _WARNED.add(said)
                changed = ", ".join(f"{name}={mine[name]!r} (open with {theirs[name]!r})" if name != "remote_url"
                                    else "another remote_url" for name in mine if mine[name] != theirs[name])
                log.warning("tiercache: the prefix cache of %s is open in this process with other settings; %s do "
                            "not apply until tiercache.prefix.close_all() closes it", cache.directory, changed)
        return cache


_WARNED: set = set()  # (prefix cache key, settings) said to differ from the open cache's


# the TierConfig fields the prefix cache reads as it opens (PrefixCache.__init__)
_PREFIX_FIELDS = ("disk_budget", "reuse_host_budget", "reuse_admission", "eviction", "io_workers", "queue_depth",
                  "direct_io", "disk_io", "shared_dir", "remote_url", "remote_budget", "remote_namespace",
                  "remote_cluster", "remote_timeout", "remote_max_inflight")


def _prefix_settings(config: TierConfig) -> dict:
    """The prefix cache's settings from ``config``, as it applies them (eviction: the prefix
    store's own, ``prefix_eviction``)."""
    settings = {name: getattr(config, name) for name in _PREFIX_FIELDS}
    settings["eviction"] = prefix_eviction(config.eviction)
    return settings


def _after_fork() -> None:
    """In a child made by ``fork()`` (multiprocessing's default on Linux, gunicorn's
    ``--preload``): no open prefix cache. It had the parent's, whose I/O threads did not
    come along: its first read or write waited for good. The child opens its own, which
    the parent's lock on the directory refuses as it refuses any second process
    (``reuse=None``: off with a warning; ``reuse=True``: CacheDirError)."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # another thread may have held it at the fork
    _OPEN.clear()  # not closed: they are the parent's (``PrefixCache.close`` leaves them alone)
    _WARNED.clear()


def close_all() -> None:
    """Flush and close every open prefix cache of this process."""
    with _OPEN_LOCK:
        caches = list(_OPEN.values())
        _OPEN.clear()
        _WARNED.clear()
    for cache in caches:
        try:
            cache.close()
        except Exception as exc:  # noqa: BLE001 - shutting down
            log.warning("closing prefix cache %s: %s", cache.directory, exc)
