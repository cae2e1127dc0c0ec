"""Looking after a persistent prefix cache on disk: ``tiercache cache ls|stats|clear``.

A ``disk_dir`` holds ``prefix/<digest>-t<T>-h<H>-d<D>-<dtype>/`` directories (one per model
digest and block geometry; see ``tiercache.prefix``) and ``sessions/`` (each live cache's
private files). Listing reads each directory's ``index.sqlite`` read-only, so it works while
another process holds the directory; clearing takes the directory's lock first and refuses
(touching nothing) when another process holds it.

Plain Python: no torch, so the command answers in a fraction of a second.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import sqlite3
import stat
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

from tiercache.config import format_bytes
from tiercache.errors import CacheDirError

# Rows of a prefix index whose values tiercache could not use (SQLite keeps whatever type a
# row was given): ``PrefixIndex._connect`` rebuilds such an index, ``describe`` calls it damaged.
BAD_INDEX_ROWS = (
    "SELECT count(*) FROM blocks WHERE typeof(h) != 'integer' OR typeof(idx) != 'integer' OR idx < 0 "
    "OR (parent IS NOT NULL AND typeof(parent) != 'integer') OR typeof(tokens) != 'blob' "
    "OR length(tokens) % 3 != 0 OR typeof(layers) != 'integer' OR layers < 0 OR typeof(hits) != 'integer' "
    "OR typeof(seen) != 'integer' OR typeof(created) NOT IN ('real', 'integer') "
    "OR typeof(last_used) NOT IN ('real', 'integer')")

log = logging.getLogger("tiercache")

# Names shared with tiercache.disk and tiercache.prefix (copied so that this module needs no
# torch; tests/test_cache_admin.py checks they agree).
PREFIX_DIR = "prefix"
SESSIONS_DIR = "sessions"
INDEX_NAME = "index.sqlite"
DATA_NAME = "blocks.dat"
LOCK_NAME = "tiercache.lock"
HEADER_BYTES = 4096
_LATEST = 1e11  # seconds since the epoch (the year 5138): a later last_used is damage, not a time
ALIGN = 4096
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_TAG = re.compile(r"^(?P<digest>[0-9a-f]{32})-t(?P<t>\d+)-h(?P<h>\d+)-d(?P<d>\d+)-(?P<dtype>[a-z0-9]+)$")


class CacheInUseError(CacheDirError):
    """A prefix directory is held by another process (its pid, when known, is ``pid``)."""

    def __init__(self, message: str, pid: Optional[int]) -> None:
        super().__init__(message)
        self.pid = pid


@dataclass(frozen=True)
class PrefixDirInfo:
    """One prefix directory as its index describes it.

    ``state`` is "ok", "damaged" (the index cannot be read: the next process that opens the
    directory rebuilds it from the record headers), "no index" (likewise) or "unreadable"
    (this user may not read it: nothing is wrong with it). Block counts are 0 unless the
    state is "ok".
    """

    path: str
    model_digest: str  # 32 hex digits
    geometry: str  # "t<block_tokens>-h<kv_heads>-d<head_dim>-<dtype>"
    block_tokens: int
    record_bytes: int  # one layer's record of one block on disk: header + padded payload
    state: str
    error: Optional[str]
    num_layers: Optional[int]
    num_blocks: int  # blocks with records stored
    num_seen_only: int  # blocks seen once and remembered, not stored (admission "reused")
    num_prefixes: int  # stored blocks that no stored block extends (the ends of cached prompts)
    stored_bytes: int  # records stored (sum over blocks of their layers) x record_bytes
    file_bytes: int  # bytes the data file occupies on disk (allocated, ahead of use)
    hits: int
    last_used: Optional[float]  # epoch seconds
    holder_pid: Optional[int]  # the process holding the directory now (None: free or unknown)


def record_bytes(block_tokens: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """Bytes of one layer's record of one block (``DiskTier.record_size`` of batch 1)."""
    payload = 2 * kv_heads * block_tokens * head_dim * ITEMSIZE.get(dtype, 4)
    return HEADER_BYTES + (payload + ALIGN - 1) // ALIGN * ALIGN


def check_disk_dir(disk_dir: str) -> None:
    """Raise ``CacheDirError`` unless ``disk_dir`` is an existing directory."""
    try:
        st = os.stat(disk_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise CacheDirError(f"--disk-dir: {disk_dir!r} does not exist") from None
    except OSError as exc:  # a folder on the way this user may not enter
        raise CacheDirError(f"--disk-dir: cannot read {disk_dir!r} ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"--disk-dir: {disk_dir!r} is not a directory")


def prefix_dirs(disk_dir: str) -> list:
    """``(path, tag match)`` of every prefix directory under ``disk_dir``, sorted by name."""
    root = os.path.join(disk_dir, PREFIX_DIR)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CacheDirError(f"--disk-dir: {root!r} is not a directory") from None
    except OSError as exc:  # another user's 0700 cache, say
        raise CacheDirError(f"--disk-dir: cannot read {root!r} ({exc.strerror})") from None
    out = []
    for name in names:
        m = _TAG.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            out.append((path, m))
    return out


def allocated_bytes(path: str) -> int:
    """Bytes ``path`` occupies on disk (0 when it is gone)."""
    try:
        return os.stat(path).st_blocks * 512
    except OSError:
        return 0


def tree_bytes(path: str) -> int:
    """Allocated bytes of every file under ``path`` (files that vanish meanwhile count 0)."""
    total = 0
    for folder, _, files in os.walk(path):
        total += sum(allocated_bytes(os.path.join(folder, f)) for f in files)
    return total


def lock_holder(lock_path: str) -> Optional[int]:
    """The pid holding a flock on ``lock_path`` now, from /proc/locks (None: free, or not
    knowable here). Reading /proc/locks takes no lock, so it cannot disturb the holder."""
    try:
        st = os.stat(lock_path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not the holder
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == ident:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


def lock_file_pid(lock_path: str) -> Optional[int]:
    """The pid written in the lock file by its latest holder (None when unreadable)."""
    try:
        with open(lock_path, "rb") as f:
            return int(f.read(32).decode(errors="replace").strip())
    except (OSError, ValueError):
        return None


def _open_index(path: str) -> sqlite3.Connection:
    # Read-only. With a -wal file present (a holder is live, or one crashed) SQLite reads
    # through the WAL as usual. Without one nobody has the index open, so it is opened as
    # immutable: a plain read-only open of a WAL database would create -wal/-shm files.
    immutable = "" if os.path.exists(path + "-wal") else "&immutable=1"
    return sqlite3.connect(f"file:{path}?mode=ro{immutable}", uri=True)


def describe(path: str, tag: re.Match) -> PrefixDirInfo:
    """Read one prefix directory's index (read-only) into a ``PrefixDirInfo``."""
    bt, heads, dim, dtype = int(tag["t"]), int(tag["h"]), int(tag["d"]), tag["dtype"]
    fields = dict(path=path, model_digest=tag["digest"], geometry=f"t{bt}-h{heads}-d{dim}-{dtype}",
                  block_tokens=bt, record_bytes=record_bytes(bt, heads, dim, dtype), state="ok", error=None,
                  num_layers=None, num_blocks=0, num_seen_only=0, num_prefixes=0, stored_bytes=0,
                  file_bytes=allocated_bytes(os.path.join(path, DATA_NAME)), hits=0, last_used=None,
                  holder_pid=lock_holder(os.path.join(path, LOCK_NAME)))
    index = os.path.join(path, INDEX_NAME)
    if not os.path.exists(index):
        return PrefixDirInfo(**{**fields, "state": "no index", "error": "index.sqlite is missing"})
    if not os.access(index, os.R_OK):  # SQLite says only "unable to open database file"
        return PrefixDirInfo(**{**fields, "state": "unreadable", "error": "index.sqlite: permission denied"})
    try:
        db = _open_index(index)
        try:
            (check,) = db.execute("PRAGMA integrity_check(1)").fetchone()  # as the open checks it
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity_check: {check}")
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            num_blocks, num_seen, records, hits, last_used = db.execute(
                "SELECT coalesce(sum(layers > 0), 0), coalesce(sum(layers = 0), 0), coalesce(sum(layers), 0), "
                "coalesce(sum(hits), 0), max(last_used) FROM blocks").fetchone()
            (bad_rows,) = db.execute(BAD_INDEX_ROWS).fetchone()
            (num_prefixes,) = db.execute(
                "SELECT count(*) FROM blocks WHERE layers > 0 AND h NOT IN "
                "(SELECT parent FROM blocks WHERE layers > 0 AND parent IS NOT NULL)").fetchone()
        finally:
            db.close()
        # SQLite keeps no checksum of values: a damaged one passes quick_check
        if not all(isinstance(n, int) and n >= 0 for n in (num_blocks, num_seen, records, hits, num_prefixes)):
            raise sqlite3.DatabaseError("a block count is not a count")
        if last_used is not None and not (isinstance(last_used, (int, float)) and 0 <= last_used < _LATEST):
            raise sqlite3.DatabaseError(f"last_used {last_used!r} is not a time")
        if bad_rows:  # as the next open finds them (``PrefixIndex``): it rebuilds the index
            raise sqlite3.DatabaseError(f"{bad_rows} rows hold values of the wrong type or range")
    except sqlite3.Error as exc:
        return PrefixDirInfo(**{**fields, "state": "damaged", "error": f"index.sqlite: {exc}"})
    layers = meta.get("layers")  # "²".isdigit() is True, and int("²") a ValueError
    return PrefixDirInfo(**{**fields, "num_layers": int(layers) if layers and layers.isascii() and layers.isdigit()
                            else None,
                            "num_blocks": num_blocks, "num_seen_only": num_seen, "num_prefixes": num_prefixes,
                            "stored_bytes": records * fields["record_bytes"], "hits": hits,
                            "last_used": last_used})


def of_model(found: list, model_digest: Optional[str], disk_dir: str, nothing_done: str = "") -> list:
    """The ``(path, tag match)`` pairs of ``found`` (``prefix_dirs``) of one model digest, given
    as its hex digits or a unique prefix of them; all of them for None. ``CacheDirError`` for
    a digest that is not hex, that matches several models, or that matches none (``nothing_done``
    is appended to that message: what was not done)."""
    if model_digest is None:
        return found
    want = model_digest.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", want):
        raise CacheDirError(f"--model-digest: expected hex digits (as `tiercache cache ls` shows), "
                            f"got {model_digest!r}")
    digests = {tag["digest"] for _, tag in found if tag["digest"].startswith(want)}
    if len(digests) > 1:
        raise CacheDirError(f"--model-digest: {model_digest!r} matches {len(digests)} models "
                            f"({', '.join(sorted(d[:12] for d in digests))}); give more digits")
    if not digests:  # a typo, or another disk_dir: not an empty listing, nor a clear that did nothing
        raise CacheDirError(f"--model-digest: {model_digest!r} matches no prefix directory in {disk_dir}"
                            f"{nothing_done} (`tiercache cache ls` lists the model digests there)")
    return [(p, tag) for p, tag in found if tag["digest"] in digests]


def list_prefix(disk_dir: str, model_digest: Optional[str] = None) -> list:
    """Every prefix directory of ``disk_dir`` (or of one model digest, as ``clear`` takes it)
    as a ``PrefixDirInfo`` (read-only)."""
    check_disk_dir(disk_dir)
    return [describe(path, tag) for path, tag in of_model(prefix_dirs(disk_dir), model_digest, disk_dir)]


def summarize(disk_dir: str, model_digest: Optional[str] = None) -> dict:
    """``list_prefix`` added up per model digest (or for one), with totals and the sessions/
    size (of every model: session folders are not per model)."""
    infos = list_prefix(disk_dir, model_digest)
    models: dict = {}
    for info in infos:
        m = models.setdefault(info.model_digest, {
            "directories": 0, "geometries": [], "num_blocks": 0, "num_seen_only": 0, "num_prefixes": 0,
            "stored_bytes": 0, "file_bytes": 0, "hits": 0, "last_used": None, "damaged": 0, "unreadable": 0})
        m["directories"] += 1
        m["geometries"].append(info.geometry)
        for key in ("num_blocks", "num_seen_only", "num_prefixes", "stored_bytes", "file_bytes", "hits"):
            m[key] += getattr(info, key)
        m["damaged"] += info.state in ("damaged", "no index")
        m["unreadable"] += info.state == "unreadable"
        if info.last_used is not None:
            m["last_used"] = max(m["last_used"] or 0.0, info.last_used)
    totals = {key: sum(m[key] for m in models.values())
              for key in ("directories", "num_blocks", "num_seen_only", "num_prefixes", "stored_bytes",
                          "file_bytes", "hits", "damaged", "unreadable")}
    sessions = os.path.join(disk_dir, SESSIONS_DIR)
    try:
        num_sessions = len(os.listdir(sessions)) if os.path.isdir(sessions) else 0
    except OSError as exc:
        raise CacheDirError(f"--disk-dir: cannot read {sessions!r} ({exc.strerror})") from None
    return {"disk_dir": disk_dir, "models": models, "totals": totals,
            "sessions": {"num_sessions": num_sessions, "bytes": tree_bytes(sessions)}}


def clear_stale_sessions(disk_dir: str) -> list:
    """Remove the session folders of processes that are gone (``remove_stale_sessions``);
    returns their names."""
    from tiercache.disk import remove_stale_sessions

    return remove_stale_sessions(os.path.join(disk_dir, SESSIONS_DIR))


def _take_lock(path: str) -> int:
    """flock the directory's lock file (exclusive, non-blocking); its fd. Raises CacheInUseError."""
    lock_path = os.path.join(path, LOCK_NAME)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        pid = lock_file_pid(lock_path)
        raise CacheInUseError(f"cache clear: {path} is in use by another tiercache process"
                              f"{f' (pid {pid})' if pid is not None else ''}; nothing was removed "
                              f"(stop it, or wait for it to exit, then clear again)", pid) from None
    return fd


def clear(disk_dir: str, model_digest: Optional[str] = None) -> list:
    """Remove every prefix directory of ``disk_dir`` (or of one model digest; a unique prefix
    of its hex digits will do) and return what was removed.

    Every directory's lock is taken first; if another process holds any of them, nothing is
    removed and ``CacheInUseError`` names the pid in its lock file. A ``model_digest`` that
    matches no directory is a ``CacheDirError`` (nothing is removed).
    """
    check_disk_dir(disk_dir)
    found = of_model(prefix_dirs(disk_dir), model_digest, disk_dir, "; nothing was removed")
    fds: list = []
    try:
        for path, _ in found:
            fds.append(_take_lock(path))
        infos = [replace(describe(path, tag), holder_pid=None) for path, tag in found]  # we hold them
        for path, _ in found:
            others = _remove(path)
            if others:  # the cache's files are gone; the folder stays for the others
                log.warning("tiercache: cache clear: %s: removed the cache's files; left %d that tiercache did not "
                            "make (%s%s)", path, len(others), ", ".join(others[:5]), ", ..." if len(others) > 5 else "")
    except OSError as exc:
        raise CacheDirError(f"cache clear: {exc.filename or disk_dir}: {exc.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)
    return infos


def _ours(name: str) -> bool:
    """A file name a prefix directory holds: its data file, its index (with SQLite's side
    files, and those moved aside as damaged), a direct-I/O probe left by a killed process."""
    base = name[:-len(".damaged")] if name.endswith(".damaged") else name
    return (base in (DATA_NAME, INDEX_NAME, INDEX_NAME + "-wal", INDEX_NAME + "-shm", INDEX_NAME + "-journal")
            or name.startswith(".direct-probe-"))


def _remove(path: str) -> list:
    """Delete a locked prefix directory: its data and index first, the lock file last. Only
    the files tiercache makes there: a prefix directory that is a symlink to a folder of
    other files (or one where someone put other files) keeps those; the symlink itself
    goes (``os.rmdir`` refused it, after its files were gone, and the clear reported a
    failure), and a folder left with other files stays. Returns those files' names."""
    others = []
    for name in sorted(os.listdir(path)):
        if name == LOCK_NAME:
            continue
        if not _ours(name):
            others.append(name)
            continue
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.unlink(target)
    os.unlink(os.path.join(path, LOCK_NAME))
    if os.path.islink(path):
        os.unlink(path)
    elif not others:
        os.rmdir(path)
    return others


# ---- text ------------------------------------------------------------------------------------
def _when(epoch: Optional[float]) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def _state(info: PrefixDirInfo) -> str:
    if info.state == "unreadable":
        text = f"unreadable ({info.error})"
    elif info.state != "ok":
        text = f"{info.state} ({info.error}; the next open rebuilds it)"
    else:
        text = "ok"
    if info.holder_pid is not None:
        text += f", in use by pid {info.holder_pid}"
    return text


def format_list(disk_dir: str, infos: list) -> str:
    """``tiercache cache ls``: one line per prefix directory."""
    if not infos:
        return f"no prefix cache in {disk_dir}"
    lines = [f"{'model digest':<14}{'geometry':<24}{'blocks':>8}{'stored':>12}{'file':>12}{'prefixes':>10}"
             f"{'hits':>8}  {'last used':<21}state"]
    for i in infos:
        lines.append(f"{i.model_digest[:12]:<14}{i.geometry:<24}{i.num_blocks:>8}{format_bytes(i.stored_bytes):>12}"
                     f"{format_bytes(i.file_bytes):>12}{i.num_prefixes:>10}{i.hits:>8}  {_when(i.last_used):<21}"
                     f"{_state(i)}")
    lines.append("stored = blocks x layers x record size (header + padded payload); file = the data file's "
                 "allocated size")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    """``tiercache cache stats``: totals per model digest, then overall."""
    lines = []
    if not summary["models"]:
        lines.append(f"no prefix cache in {summary['disk_dir']}")
    else:
        lines.append(f"{'model digest':<34}{'dirs':>5}{'blocks':>8}{'stored':>12}{'file':>12}{'prefixes':>10}"
                     f"{'hits':>8}  last used")
        rows = list(summary["models"].items()) + [("total", summary["totals"])]
        for digest, m in rows:
            damaged = f"  ({m['damaged']} damaged)" if m["damaged"] else ""
            if m["unreadable"]:
                damaged += f"  ({m['unreadable']} unreadable)"
            last = _when(m.get("last_used")) if digest != "total" else ""
            lines.append(f"{digest:<34}{m['directories']:>5}{m['num_blocks']:>8}{format_bytes(m['stored_bytes']):>12}"
                         f"{format_bytes(m['file_bytes']):>12}{m['num_prefixes']:>10}{m['hits']:>8}  {last}{damaged}")
    s = summary["sessions"]
    lines.append(f"sessions/: {s['num_sessions']} session folders, {format_bytes(s['bytes'])}")
    return "\n".join(lines)


def as_json(infos: list) -> list:
    return [asdict(i) for i in infos]
