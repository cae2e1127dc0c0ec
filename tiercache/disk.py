"""The disk tier: fixed-size records in a data file, each with a header and CRC32C.

Record layout (one slot): a 4096-byte header, then the payload padded to 4096 bytes, so a
slot can be read or written with direct I/O in one vectored call. The header carries the
format version, model digest, block key, token count, dtype, shape, payload length, the
payload's CRC32C and its own CRC32C. Every read checks both checksums and the key; a record
that fails is never returned as data. Records are only written into free slots, so a torn
write can only damage a slot that held nothing live; freeing a slot of a persistent tier
writes a tombstone so that a reopened tier cannot resurrect deleted data.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import weakref
from typing import Iterator, Optional, Sequence

import crc32c
import numpy as np
import torch

from tiercache.config import dangling_link, format_bytes
from tiercache.errors import CacheDirError
from tiercache.table import BlockKey
from tiercache.tiers import ALIGN, BlockGeometry, aligned_buffer, align_up

log = logging.getLogger("tiercache")

MAGIC = b"TCKV"
FORMAT_VERSION = 1
HEADER_BYTES = ALIGN
_HEADER = struct.Struct("<4sHHI16sQIIIBB2x6IQI")  # + header crc (I); the I after the header
# length is the byte count of an optional token-id section that follows the header crc
# (3 bytes per id, then its own CRC32C): prefix-cache records carry the ids of their tokens
_CRC = struct.Struct("<I")
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
LOCK_NAME = "tiercache.lock"
DATA_NAME = "blocks.dat"


_KVIKIO_LOCK = threading.Lock()  # kvikio's settings are process-wide (and _LOCKED_HERE)
# real path of each directory this process's disk tiers hold locked -> the pid that took the
# lock (a child made by fork inherits this dict, not the lock: it must not call the parent's
# lock its own)
_LOCKED_HERE: dict = {}
# this process's open disk tiers, for a child made by fork() (``_after_fork``)
_OPEN_TIERS: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()
_IN_FORKED_CHILDREN: list = []  # handlers given to os.register_at_fork (``in_forked_children``)


def in_forked_children(handler) -> None:
    """Run ``handler`` in every child that ``fork()`` makes from now on; once per handler,
    registered when the first thing that needs it opens (not at import). Handlers are
    idempotent, so two threads registering one at once do no harm."""
    if handler not in _IN_FORKED_CHILDREN and hasattr(os, "register_at_fork"):
        _IN_FORKED_CHILDREN.append(handler)
        os.register_at_fork(after_in_child=handler)


def _after_fork() -> None:
    """In a child made by ``fork()``: let go of the parent's disk tiers. The child's copies
    of their descriptors share the parent's open files, so its copy of a lock descriptor
    kept the parent's flock held for as long as the child lived: the parent could not
    open its prefix directory again (``close_all()``, then a run) while a worker lived,
    and was told that its own pid held it. Closing the copies here leaves the parent's
    lock and files as they are; the tiers are marked closed in the child."""
    global _KVIKIO_LOCK
    _KVIKIO_LOCK = threading.Lock()  # another thread may have held it at the fork
    for tier in list(_OPEN_TIERS):
        tier.closed = True
        for name in ("_lock_fd", "_fd_direct", "_fd"):
            fd = getattr(tier, name, None)
            setattr(tier, name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
    _OPEN_TIERS.clear()


def kvikio_status() -> tuple:
    """Can the kvikio backend run here: ``(True, version)`` or ``(False, why not)``.
    kvikio loads libcuda even for host buffers, so it is only tried where CUDA is."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available (kvikio needs libcuda even for host buffers)"
    try:
        import kvikio
    except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from its shared libraries
        return False, (f"kvikio does not import ({type(exc).__name__}: {exc}); install it with pip install "
                       f"'tiercache[gds]' (CUDA 12) or 'tiercache[gds-cu13]' (CUDA 13)")
    return True, str(getattr(kvikio, "__version__", "?"))


def resolve_disk_io(choice: str, on_cuda: bool = False) -> str:
    """The disk backend ``TierConfig.disk_io`` names. "auto" is kvikio where kvikio imports
    and either the store is on CUDA (``on_cuda``) or this process already uses CUDA (a
    store whose pools are in RAM, such as the prefix cache's next to a model on the GPU:
    kvikio reads into host memory too), else posix; it does not start CUDA for a CPU-only
    job on a GPU machine. "kvikio" where it cannot run raises ``ValueError`` saying why."""
    if choice == "posix" or (choice == "auto" and not on_cuda and not torch.cuda.is_initialized()):
        return "posix"
    ok, why = kvikio_status()
    if choice == "kvikio" and not ok:
        raise ValueError(f"disk_io: 'kvikio' cannot run here: {why}; use disk_io='posix' or 'auto'")
    return "kvikio" if ok else "posix"


NOT_A_RECORD = -1  # ``DiskTier.scan``'s num_tokens for a slot that holds bytes but no record magic


class RecordError(Exception):
    """A record failed validation: bad magic, version, checksum, key or bounds."""


class ForeignRecordError(RecordError):
    """An intact record written by another format version, model, dtype or geometry."""


def ensure_private_dir(path: str, allow_shared: bool = False) -> None:
    """Create ``path`` as 0700; refuse an existing one with looser permissions or another owner.
    A ``path`` that is (or lies below) a symlink to a missing target is refused by name, as
    ``TierConfig`` refuses it (a config built before the target vanished reaches here)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(dangling_link(path) or f"disk_dir: cannot create {path!r} ({exc.strerror})") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"disk_dir: {path!r} is not a directory")
    if allow_shared:
        return
    if st.st_uid != os.geteuid():
        raise CacheDirError(f"disk_dir: {path!r} is owned by uid {st.st_uid}, not by this user "
                            f"(uid {os.geteuid()}); refusing to use it")
    if st.st_mode & 0o077:
        raise CacheDirError(f"disk_dir: {path!r} has permissions {oct(st.st_mode & 0o777)}; "
                            f"expected 0700 (chmod 700 it, or opt in to a shared directory)")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_sessions(sessions: str) -> list:
    """Remove the session folders (``<pid>-<id>``, one per ``TieredCache`` store) whose
    process is gone: a process killed (SIGKILL, out of memory) never closes its store, and
    its folder kept a data file allocated up to ``disk_budget`` for good (found by a
    helper's adversarial run: 64 MiB per killed process, never reclaimed). A folder goes
    only if the process its name gives is not running and the lock on it is free (a process
    holds that lock while its store is open; a pid namespace or a reused pid makes a folder
    look stale or live wrongly, the lock does not), and only tiercache's files are removed:
    a folder with others stays. Returns the names removed."""
    try:
        names = os.listdir(sessions)
    except OSError:
        return []
    removed = []
    for name in names:
        pid, _, rest = name.partition("-")
        path = os.path.join(sessions, name)
        if not (pid.isascii() and pid.isdigit()) or not rest or int(pid) == os.getpid():
            continue
        try:
            if _process_alive(int(pid)):
                continue
        except (OverflowError, ValueError):  # not a pid this system has: not a session folder
            continue
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        fd = None
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            files = os.listdir(path)
            if any(f not in (DATA_NAME, LOCK_NAME) and not f.startswith(".direct-probe-") for f in files):
                continue
            for f in files:
                if f != LOCK_NAME:
                    os.unlink(os.path.join(path, f))
            os.unlink(os.path.join(path, LOCK_NAME))
            os.rmdir(path)
            removed.append(name)
        except OSError:  # held (a live store), or gone meanwhile: left alone
            continue
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def probe_direct_io(directory: str) -> bool:
    """Whether the filesystem under ``directory`` accepts O_DIRECT aligned I/O."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    buf, mm = aligned_buffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    view = None  # a signal turned into an exception (SIGTERM in the CLI) may land before it is made
    try:
        view = memoryview(buf.numpy())
        os.pwritev(fd, [view], 0)
        os.preadv(fd, [view], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        del view
        try:
            os.unlink(path)
        except OSError:
            pass


def _damaged_magic(head: bytes) -> bool:
    """Whether ``head``, a whole header that lacks the record magic, passes its checksum with
    the magic put back: a record of ours whose first bytes were damaged."""
    if len(head) < _HEADER.size + 4:
        return False
    (crc,) = _CRC.unpack(head[_HEADER.size:_HEADER.size + 4])
    return crc32c.crc32c(MAGIC + head[4:_HEADER.size]) == crc


def _addr(mv: memoryview) -> int:
    """The address of a memoryview's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mv)) if len(mv) else 0


def parts_crc(parts: Sequence) -> int:
    """CRC32C of the bytes of ``parts`` (buffers) in order: a payload read in pieces."""
    value = 0
    for p in parts:
        value = crc32c.crc32c(p, value)
    return value


def aligned_parts(parts: list) -> bool:
    """Whether every part of a scattered destination is page-aligned in address and length
    (direct I/O can read into it: ``DiskTier.read_into``)."""
    return all(len(p) % ALIGN == 0 and _addr(p) % ALIGN == 0 for p in parts)


def _ptr_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0 and t.numel() % ALIGN == 0


class RecordCodec:
    """The record format shared by the disk tier and the remote tier: a ``HEADER_BYTES``
    header (format version, model digest, block key, token count, dtype, shape, payload
    length and CRC32C, optional token ids with their own CRC32C, the header's CRC32C), then
    the payload. Nothing is ever unpickled: a record is bytes checked field by field."""

    def __init__(self, geometry: BlockGeometry, model_digest: bytes = b"") -> None:
        self.geometry = geometry
        self.model_digest = (model_digest or b"").ljust(16, b"\0")[:16]
        self.payload_bytes = geometry.block_bytes

    MAX_TOKEN_IDS = (HEADER_BYTES - _HEADER.size - 8) // 3

    def encode_header(self, mv: memoryview, key: BlockKey, num_tokens: int, payload_crc: int,
                       token_ids: bytes = b"") -> None:
        g = self.geometry
        shape = list(g.shape) + [0] * (6 - len(g.shape))
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, len(token_ids), self.model_digest,
                            key.seq_id, key.layer, key.index, num_tokens,
                            DTYPE_CODES[g.dtype], len(g.shape), *shape, self.payload_bytes, payload_crc)
        mv[:len(head)] = head
        mv[len(head):len(head) + 4] = _CRC.pack(crc32c.crc32c(head))
        at = len(head) + 4
        if token_ids:
            mv[at:at + len(token_ids)] = token_ids
            mv[at + len(token_ids):at + len(token_ids) + 4] = _CRC.pack(crc32c.crc32c(token_ids))
            at += len(token_ids) + 4
        mv[at:] = bytes(HEADER_BYTES - at)

    @staticmethod
    def pack_token_ids(ids) -> bytes:
        """Token ids as 3-byte little-endian integers (ids up to 16,777,215)."""
        out = bytearray()
        for t in ids:
            if not 0 <= t < 1 << 24:
                raise ValueError(f"token id {t} does not fit the record's 3-byte ids")
            out += int(t).to_bytes(3, "little")
        return bytes(out)

    @staticmethod
    def unpack_token_ids(data: bytes) -> list:
        return [int.from_bytes(data[i:i + 3], "little") for i in range(0, len(data), 3)]

    def decode_token_ids(self, mv: memoryview) -> bytes:
        """The token-id section of a validated header (b"" when it has none). Raises RecordError."""
        (length,) = struct.unpack_from("<I", mv, 8)
        if not length:
            return b""
        at = _HEADER.size + 4
        if length % 3 or at + length + 4 > HEADER_BYTES:
            raise RecordError(f"token-id section of {length} bytes is malformed")
        data = bytes(mv[at:at + length])
        (crc,) = _CRC.unpack(bytes(mv[at + length:at + length + 4]))
        if crc32c.crc32c(data) != crc:
            raise RecordError("token-id checksum mismatch")
        return data

    def decode_header(self, mv: memoryview) -> tuple:
        """Validate a header; return (key, num_tokens, payload_crc). Raises RecordError."""
        head = bytes(mv[:_HEADER.size])
        (crc,) = _CRC.unpack(bytes(mv[_HEADER.size:_HEADER.size + 4]))
        if head[:4] != MAGIC:
            raise RecordError("bad magic (not a tiercache record)")
        if crc32c.crc32c(head) != crc:
            raise RecordError("header checksum mismatch")
        fields = _HEADER.unpack(head)
        _, version, header_len, _, digest, seq_id, layer, index, num_tokens, dtype_code, ndim = fields[:11]
        shape = fields[11:17]
        payload_len, payload_crc = fields[17], fields[18]
        if version != FORMAT_VERSION:
            raise ForeignRecordError(f"written by tiercache format version {version}; this one reads "
                                     f"version {FORMAT_VERSION}")
        if header_len != HEADER_BYTES:
            raise ForeignRecordError(f"header length {header_len}, expected {HEADER_BYTES}")
        if digest != self.model_digest:
            raise ForeignRecordError("written for another model or dtype")
        g = self.geometry
        if (CODE_DTYPES.get(dtype_code) != g.dtype or ndim != len(g.shape)
                or tuple(shape[:ndim]) != g.shape or payload_len != self.payload_bytes):
            raise ForeignRecordError("written with another block shape, dtype or length")
        if not 0 <= num_tokens <= g.block_tokens:
            raise RecordError(f"token count {num_tokens} out of range")
        return BlockKey(seq_id, layer, index), num_tokens, payload_crc

    def encode(self, key: BlockKey, payload: memoryview, num_tokens: int, token_ids: bytes = b"") -> bytes:
        """One whole record as bytes (header, then the unpadded payload)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        head = bytearray(HEADER_BYTES)
        self.encode_header(memoryview(head), key, num_tokens, crc32c.crc32c(payload), token_ids)
        return bytes(head) + bytes(payload)

    def decode(self, data: bytes, key: BlockKey, token_ids: bytes = b"") -> tuple:
        """Check a whole record (``encode``'s bytes) written for ``key`` (and ``token_ids``
        when given); return ``(num_tokens, payload memoryview)``. Raises RecordError, or
        ForeignRecordError for an intact record of another format, model or geometry."""
        if len(data) != HEADER_BYTES + self.payload_bytes:
            raise RecordError(f"record of {len(data)} bytes, expected {HEADER_BYTES + self.payload_bytes}")
        mv = memoryview(data)
        found, num_tokens, crc = self.decode_header(mv[:HEADER_BYTES])
        if found != key:
            raise RecordError(f"record holds {found!r}, expected {key!r}")
        if token_ids and self.decode_token_ids(mv[:HEADER_BYTES]) != token_ids:
            raise RecordError("record holds other token ids")
        payload = mv[HEADER_BYTES:]
        if crc32c.crc32c(payload) != crc:
            raise RecordError("payload checksum mismatch")
        return num_tokens, payload


class DiskTier(RecordCodec):
    """Slots of ``record_bytes`` in one data file inside a private, locked directory."""

    def __init__(self, directory: str, geometry: BlockGeometry, num_slots: int, *,
                 direct_io: str = "auto", model_digest: bytes = b"", persistent: bool = True,
                 allow_shared_dir: bool = False, io: str = "posix", io_threads: int = 4,
                 io_fallback: bool = False) -> None:
        """``io_fallback``: ``io`` is what ``disk_io="auto"`` chose; if kvikio cannot open
        the file, the tier warns and uses posix instead of failing."""
        super().__init__(geometry, model_digest)
        if io not in ("posix", "kvikio"):  # before the lock and files are taken: nothing to undo
            raise ValueError(f"disk_io: unknown backend {io!r}; known: posix, kvikio")
        self.directory = directory
        self.num_slots = num_slots
        self.persistent = persistent
        self.sync_error: Optional[OSError] = None  # the fsync at close failed (``close``)
        self.record_bytes = HEADER_BYTES + align_up(self.payload_bytes)
        ensure_private_dir(directory, allow_shared_dir)
        self._lock_fd = self._take_lock()
        self.path = os.path.join(directory, DATA_NAME)
        if not persistent:
            try:
                size = os.stat(self.path).st_size
            except OSError:
                size = 0
            if size:  # a store's saved blocks: this tier would overwrite them, and delete the file
                self._release_lock()
                raise CacheDirError(f"disk_dir: {directory!r} holds saved blocks ({DATA_NAME}, {size} bytes); a store "
                                    f"with persistent=False would overwrite them and delete the file when it "
                                    f"closes: use an empty directory, or persistent=True")
        supported = probe_direct_io(directory)
        if direct_io == "on" and not supported:
            self._release_lock()
            raise ValueError(f"direct_io: 'on' but the filesystem under {directory!r} does not support O_DIRECT")
        self.direct_io = supported and direct_io != "off"
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self._fd = None
        try:
            self._fd = os.open(self.path, flags, 0o600)
            self._fd_direct = os.open(self.path, flags | os.O_DIRECT) if self.direct_io else None
        except OSError as exc:
            if self._fd is not None:  # the direct descriptor failed: the plain one goes too
                os.close(self._fd)
            self._release_lock()
            raise CacheDirError(f"disk_dir: cannot create the data file in {directory!r} ({exc.strerror})") from None
        # kvikio: record payloads go through a cuFile handle on the same file (headers,
        # tombstones, scans and scattered reads stay on the file descriptors above).
        self.io = io
        self._cufile = None
        if io == "kvikio":
            try:
                self._cufile = self._open_cufile(io_threads)
            except Exception as exc:
                if not io_fallback:
                    self.closed = False
                    self.close()  # descriptors, lock, and a non-persistent tier's files
                    raise
                log.warning("tiercache: disk_io 'auto': kvikio cannot serve %r (%s); using posix",
                            self.path, exc)
                self.io = "posix"
            except BaseException:
                self.closed = False
                self.close()
                raise
        self._local = threading.local()
        self._grow_lock = threading.Lock()
        self._allocated = os.fstat(self._fd).st_size
        self._warn_if_no_room()
        self.closed = False

    def _warn_if_no_room(self) -> None:
        """A budget the filesystem cannot hold is said at open: the data file grows as blocks
        go down, and on a filesystem shared with other tiers (a session's disk tier beside
        a prefix cache) one filling it made the others' writes fail with ENOSPC, unsaid
        until then (a review). Not refused: free space changes, and a budget is a bound."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return
        free, more = st.f_bavail * st.f_frsize, self.num_slots * self.record_bytes - self._allocated
        if more > free:
            log.warning("tiercache: disk_budget holds %s in %r, but its filesystem has %s free: writes there "
                        "may fail with 'No space left on device' once it fills; lower disk_budget or free space",
                        format_bytes(self.num_slots * self.record_bytes), self.directory, format_bytes(free))

    def _open_cufile(self, threads: int):
        """A kvikio handle on the data file. kvikio's thread pool is process-wide and has one
        thread unless ``KVIKIO_NTHREADS`` says otherwise; the store's ``threads`` I/O workers
        would then queue behind it, so a pool smaller than that grows to it (never
        shrinks), unless the user set ``KVIKIO_NTHREADS``. (An H200 probe wrote 1.94, 2.46
        and 2.94 GB/s with 1, 4 and 8 kvikio threads.)"""
        ok, why = kvikio_status()
        if not ok:
            raise ValueError(f"disk_io: 'kvikio' cannot run here: {why}; use disk_io='posix' or 'auto'")
        import kvikio
        import kvikio.defaults

        defaults = kvikio.defaults
        with _KVIKIO_LOCK:  # defaults.get/set since kvikio 25; get_num_threads/num_threads_reset before
            current = defaults.get("num_threads") if hasattr(defaults, "get") else defaults.get_num_threads()
            if "KVIKIO_NTHREADS" not in os.environ and current < threads:
                log.info("tiercache: kvikio's thread pool (process-wide) grows to %d threads", threads)
                if hasattr(defaults, "set"):
                    defaults.set("num_threads", threads)
                else:
                    defaults.num_threads_reset(threads)
        try:
            return kvikio.CuFile(self.path, "r+")
        except RuntimeError as exc:
            raise CacheDirError(f"disk_dir: kvikio cannot open {self.path!r} ({exc})") from None

    @staticmethod
    def record_size(geometry: BlockGeometry) -> int:
        """Bytes of one slot on disk: header plus padded payload."""
        return HEADER_BYTES + align_up(geometry.block_bytes)

    @staticmethod
    def record_layout(geometry: BlockGeometry) -> str:
        """``record_size`` spelled out, for a message that sizes ``disk_budget``: a disk
        tier of N blocks takes N records, each more than the block's bytes (a CapacityError
        named only the budget, and 64 KiB held 3 blocks of 16 KiB, not 4)."""
        payload, padded = geometry.block_bytes, align_up(geometry.block_bytes)
        pad = f" padded to {padded}" if padded != payload else ""
        return (f"{HEADER_BYTES + padded} bytes per disk record: the block's {payload} bytes{pad} plus a "
                f"{HEADER_BYTES}-byte header, in {ALIGN}-byte pages for O_DIRECT")

    # ---- locking -------------------------------------------------------------------
    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None  # first: a fork between the two must not close the number again
        if fd is not None:
            os.close(fd)
        with _KVIKIO_LOCK:
            _LOCKED_HERE.pop(os.path.realpath(self.directory), None)

    def _take_lock(self) -> int:
        path = os.path.join(self.directory, LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise CacheDirError(f"disk_dir: cannot create {path!r} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = ""
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                if _LOCKED_HERE.get(os.path.realpath(self.directory)) == os.getpid():
                    raise CacheDirError(f"disk_dir: {self.directory!r} is in use by another tiercache store "
                                        f"in this process; close it first, or use another directory") from None
                raise CacheDirError(f"disk_dir: {self.directory!r} is in use by another tiercache "
                                    f"process{f' (pid {holder})' if holder else ''}; use another directory") from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise CacheDirError(f"disk_dir: cannot write in {self.directory!r} ({exc.strerror})") from None
        with _KVIKIO_LOCK:
            _LOCKED_HERE[os.path.realpath(self.directory)] = os.getpid()
            _OPEN_TIERS.add(self)
        in_forked_children(_after_fork)
        return fd

    # ---- record codec ----------------------------------------------------------------
    def _header_buf(self) -> tuple:
        buf = getattr(self._local, "header", None)
        if buf is None:
            tensor, mm = aligned_buffer(HEADER_BYTES)
            buf = self._local.header = (tensor, mm, memoryview(tensor.numpy()))
        return buf

    # ---- I/O -----------------------------------------------------------------------------
    def _fd_for(self, payload: torch.Tensor) -> int:
        if self._fd_direct is not None and _ptr_aligned(payload):
            return self._fd_direct
        return self._fd

    def payload_crc(self, payload: torch.Tensor) -> int:
        """The CRC32C a record of ``payload`` carries (``write``'s ``crc``)."""
        return crc32c.crc32c(memoryview(payload.numpy())[:self.payload_bytes])

    def write(self, slot: int, key: BlockKey, payload: torch.Tensor, num_tokens: int,
              token_ids: bytes = b"", crc: Optional[int] = None) -> None:
        """Write a record. ``payload`` is a contiguous uint8 CPU tensor, ideally page-aligned;
        ``token_ids`` (``pack_token_ids``) go into the header when given; ``crc``: the
        payload's ``payload_crc``, where it was computed ahead (computed here if None)."""
        self._check_slot(slot)
        if payload.numel() < self.payload_bytes:
            raise ValueError("payload buffer too small")
        if len(token_ids) > 3 * self.MAX_TOKEN_IDS:
            raise ValueError(f"at most {self.MAX_TOKEN_IDS} token ids fit a record header")
        _, _, hmv = self._header_buf()
        pmv = memoryview(payload.numpy())
        if crc is None:
            crc = crc32c.crc32c(pmv[:self.payload_bytes])
        self.encode_header(hmv, key, num_tokens, crc, token_ids)
        fd = self._fd_for(payload)
        if fd == self._fd_direct:
            length = align_up(self.payload_bytes)
            parts = [hmv, pmv[:length]]
        else:
            parts = [hmv, pmv[:self.payload_bytes]]
        total = sum(len(p) for p in parts)
        self._reserve((slot + 1) * self.record_bytes)
        if self._cufile is not None:
            self._cufile_io("write", slot, parts[1])
            return
        written = os.pwritev(fd, parts, slot * self.record_bytes)
        if written != total:
            raise OSError(errno.EIO, f"short write ({written} of {total} bytes)")

    def _cufile_io(self, op: str, slot: int, payload: memoryview) -> int:
        """kvikio: the payload through the cuFile handle (queued on kvikio's threads) while
        the header goes through a file descriptor here; waits for both. kvikio's message is
        kept, as EIO (it gives no errno). A torn record (one written, not the other) fails
        its checksum on read, as one torn write does."""
        _, _, hmv = self._header_buf()
        offset = slot * self.record_bytes
        array = np.frombuffer(payload, dtype=np.uint8)
        call = self._cufile.pwrite if op == "write" else self._cufile.pread
        future = call(array, len(payload), offset + HEADER_BYTES)
        try:
            fd = self._fd_direct if self._fd_direct is not None else self._fd
            done = os.pwrite(fd, hmv, offset) if op == "write" else os.preadv(fd, [hmv], offset)
        finally:  # the payload buffer is in use until kvikio is done with it
            try:
                moved = future.get()
            except RuntimeError as exc:
                if op == "read" and "EOF" in str(exc):
                    raise RecordError("truncated record (kvikio: end of file)") from None
                raise OSError(errno.EIO, f"kvikio {op} of disk slot {slot} failed: {exc}") from None
        if op == "write" and (done != HEADER_BYTES or moved != len(payload)):
            raise OSError(errno.EIO, f"short write ({done + moved} of {HEADER_BYTES + len(payload)} bytes)")
        return done + moved

    _GROW_BYTES = 64 << 20

    def _reserve(self, end: int) -> None:
        """Allocate the data file ahead of the highest slot written: appending writes under
        O_DIRECT are serialised by the filesystem, and a full disk shows up here (ENOSPC)
        instead of in the middle of a record.

        The file at least doubles each time (64 MiB at first, never past the budget): an
        allocation waits for the file's direct writes in flight (ext4), so every step
        empties the write queue. In 64 MiB steps that cost the store 18% of its write rate
        against a file allocated beforehand (``bench io``); doubling makes it a few steps
        per run, for at most twice the bytes written held in reserve."""
        if end <= self._allocated:
            return
        with self._grow_lock:
            if end <= self._allocated:
                return
            step = max(self._allocated, self._GROW_BYTES)
            target = max(min(self._allocated + step, self.num_slots * self.record_bytes), end)
            try:
                self._allocate(target)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or target == end:
                    raise
                self._allocate(end)  # no room for the step ahead; the record itself may fit
                target = end
            self._allocated = target

    def _allocate(self, target: int) -> None:
        try:
            os.posix_fallocate(self._fd, self._allocated, target - self._allocated)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", 95)):
                raise

    def read(self, slot: int, key: BlockKey, out: torch.Tensor) -> int:
        """Read and verify the record in ``slot`` into ``out``; returns its token count."""
        self._check_slot(slot)
        _, _, hmv = self._header_buf()
        pmv = memoryview(out.numpy())
        fd = self._fd_for(out)
        length = align_up(self.payload_bytes) if fd == self._fd_direct else self.payload_bytes
        if self._cufile is not None:  # exactly the payload: kvikio aligns by itself and raises at EOF
            got = self._cufile_io("read", slot, pmv[:self.payload_bytes])
        else:
            got = os.preadv(fd, [hmv, pmv[:length]], slot * self.record_bytes)
        if got < HEADER_BYTES + self.payload_bytes:
            raise RecordError(f"truncated record ({got} bytes)")
        found, num_tokens, crc = self.decode_header(hmv)
        if found != key:
            raise RecordError(f"slot holds {found!r}, expected {key!r}")
        if crc32c.crc32c(pmv[:self.payload_bytes]) != crc:
            raise RecordError("payload checksum mismatch")
        return num_tokens

    def read_into(self, slot: int, key: BlockKey, parts: list, aligned: Optional[bool] = None) -> int:
        """Read and verify the record in ``slot`` straight into ``parts``: writable byte
        memoryviews whose lengths add up to the payload (a scattered destination, e.g. the
        planes of a block inside a larger tensor). Returns the token count.

        Direct I/O when every part is page-aligned in address and length: ``aligned``, the
        caller's ``aligned_parts(parts)`` for parts it reuses, or None to check here. The
        payload's CRC32C is checked over the parts; on any failure (``RecordError``) the
        parts hold garbage and must not be used.
        """
        num_tokens, crc = self.read_unchecked(slot, key, parts, aligned)
        if parts_crc(parts) != crc:
            raise RecordError("payload checksum mismatch")
        return num_tokens

    def read_unchecked(self, slot: int, key: BlockKey, parts: list, aligned: Optional[bool] = None) -> tuple:
        """``read_into`` less the payload's check: the header is checked (its CRC32C, the
        key), the payload only read. Returns (token count, the payload's CRC32C as the
        header gives it). The parts hold bytes nobody may use until ``parts_crc(parts)``
        equals that CRC: the caller checks them where it can best afford to."""
        self._check_slot(slot)
        if sum(len(p) for p in parts) != self.payload_bytes:
            raise ValueError(f"parts hold {sum(len(p) for p in parts)} bytes; a payload is {self.payload_bytes}")
        _, _, hmv = self._header_buf()
        fd = self._fd
        if self._fd_direct is not None and (aligned_parts(parts) if aligned is None else aligned):
            fd = self._fd_direct
        got = os.preadv(fd, [hmv, *parts], slot * self.record_bytes)
        if got < HEADER_BYTES + self.payload_bytes:
            raise RecordError(f"truncated record ({got} bytes)")
        found, num_tokens, crc = self.decode_header(hmv)
        if found != key:
            raise RecordError(f"slot holds {found!r}, expected {key!r}")
        return num_tokens, crc

    def cut_to_budget(self) -> None:
        """Cut the data file to the budget's slots: a file written under a larger budget
        held records past it, which no store under this one sees, erases or overwrites:
        they came back, deleted blocks among them, when a later store had room again."""
        end = self.num_slots * self.record_bytes
        if os.fstat(self._fd).st_size > end:
            os.ftruncate(self._fd, end)
            self._allocated = min(self._allocated, end)

    def copy_record_part(self, src: int, dst: int, header: bool) -> None:
        """Copy the payload (``header`` False) or the header (True) of the record in slot
        ``src`` to slot ``dst``, bytes as they are (a header names its block, not its slot),
        leaving ``src`` as it was. An open under a smaller budget moves records from past it
        into free slots within it: every payload first, ``sync``, then every header,
        ``sync``, then ``cut_to_budget``. A copy cut short is then a slot with no valid
        header, or one whose payload is whole: written in one go, header first, a torn
        payload under a whole header agreed with the original (same header) and the
        original was cut away (a review)."""
        size, start = self.record_bytes, (0 if header else HEADER_BYTES)
        length = HEADER_BYTES if header else size - HEADER_BYTES
        data = os.pread(self._fd, length, src * size + start)
        if len(data) != length:
            raise OSError(errno.EIO, f"slot {src} holds {len(data)} of its record's {length} bytes there")
        view, offset = memoryview(data), dst * size + start
        while view:
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def sync(self) -> None:
        """Make what was written to the data file durable (``fdatasync``)."""
        os.fdatasync(self._fd)

    def tombstone(self, slot: int) -> None:
        """Invalidate the record in ``slot`` (only needed when the tier persists)."""
        if self.persistent:
            offset = slot * self.record_bytes
            if offset >= os.fstat(self._fd).st_size:
                # past the end: nothing there to invalidate (a write that failed on a full disk
                # left it so, and zeros written there failed too, inside its roll-back)
                return
            os.pwrite(self._fd, bytes(_HEADER.size + 4), offset)

    SCAN_THREADS = 8  # header reads in flight while scanning (they are small and random)
    SCAN_CHUNK = 32  # slots per read job

    def scan(self, with_token_ids: bool = False, whole_file: bool = False) -> Iterator[tuple]:
        """Yield (slot, key, num_tokens) of every valid header, plus its token ids (bytes)
        when ``with_token_ids``; a header that fails its checks gives key None, and so does
        one without the record magic whose first bytes are not all zeros, with num_tokens
        ``NOT_A_RECORD`` (a slot never written, or a tombstone, is zeros there and is left
        out): a damaged magic used to pass for a free slot, and the block vanished with no
        count and no warning; a file that is not ours passed for an empty one. The slots
        of the budget, or with ``whole_file`` every slot the file holds (a file written
        under a larger budget holds more).

        Only headers are checked here; payloads are checked when read. The headers are read
        by a few threads at once (a header is one 4 KiB read per record: serial reads wait
        on the disk's latency), with direct I/O where available (no readahead of payloads).
        """
        size = os.fstat(self._fd).st_size
        last = size // self.record_bytes + (1 if size % self.record_bytes else 0)
        if not whole_file:
            last = min(self.num_slots, last)
        for slot, head in self._read_headers(self._slots_with_data(last)):
            if not any(head[:_HEADER.size + 4]):  # never written (zeros), past the end, or a tombstone
                continue
            if len(head) < _HEADER.size + 4 or head[:4] != MAGIC:  # damaged, or not a record at all
                # One of ours, damaged, when it starts with the magic (a file cut short in a
                # header) or when it passes the header checksum with the magic put back (a flip
                # in the magic): counted as damage, not as a stranger's bytes, so that a file
                # whose only live record was hit opens without it (a review: it was refused as
                # "another program's file", and the directory could not be used).
                ours = head[:4] == MAGIC or _damaged_magic(head)
                if ours and len(head) >= _HEADER.size + 4:
                    # a whole header: of this model and block shape? A foreign one is refused as
                    # an intact one is (a review: a store of another shape opened such a file
                    # and wrote over its other records)
                    self._refuse_foreign(MAGIC + head[4:])
                num = 0 if ours else NOT_A_RECORD
                yield (slot, None, num, None) if with_token_ids else (slot, None, num)
                continue
            mv = memoryview(head + bytes(HEADER_BYTES - len(head)))
            try:
                key, num_tokens, _ = self.decode_header(mv)
                ids = self.decode_token_ids(mv) if with_token_ids else None
            except ForeignRecordError as exc:
                raise self._foreign(exc) from None
            except RecordError:
                yield (slot, None, 0, None) if with_token_ids else (slot, None, 0)
                continue
            if slot * self.record_bytes + HEADER_BYTES + self.payload_bytes > size:
                # a whole header whose payload the file cuts short: incomplete, as a read of it
                # finds (it was kept at open, and failed at its first read; a review)
                yield (slot, None, 0, None) if with_token_ids else (slot, None, 0)
                continue
            yield (slot, key, num_tokens, ids) if with_token_ids else (slot, key, num_tokens)

    def _foreign(self, exc: Exception) -> CacheDirError:
        return CacheDirError(f"disk_dir: {self.directory!r} holds records {exc}; nothing was changed "
                             f"(use another directory, or clear this one)")

    def _refuse_foreign(self, head: bytes) -> None:
        """Raise ``CacheDirError`` if ``head``, a whole header, is a record of another format,
        model or block shape; a damaged one of ours passes."""
        try:
            self.decode_header(memoryview(head + bytes(max(0, HEADER_BYTES - len(head)))))
        except ForeignRecordError as exc:
            raise self._foreign(exc) from None
        except RecordError:
            pass

    def _slots_with_data(self, last: int) -> list:
        """The slots below ``last`` whose header lies in a part of the file that holds data:
        the holes of a sparse file (grown by a truncate, or never written) are zeros, free
        slots, so their headers need no read. Opening a 1 GiB sparse file under a 20-slot
        budget read 131072 headers (2 s here). All of them where the filesystem cannot say
        (no SEEK_DATA)."""
        rb, end = self.record_bytes, last * self.record_bytes
        slots: list = []
        pos = 0
        try:
            while pos < end:
                try:
                    start = os.lseek(self._fd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:  # no data past pos
                        break
                    raise
                if start >= end:
                    break
                stop = min(os.lseek(self._fd, start, os.SEEK_HOLE), end)
                lo = start // rb  # the header of the record the data starts in
                if slots and slots[-1] >= lo:
                    lo = slots[-1] + 1
                slots.extend(range(lo, -(-stop // rb)))
                pos = max(stop, pos + 1)
        except (OSError, AttributeError):  # no SEEK_DATA here: every slot
            return list(range(last))
        return slots

    def record_stamps(self, slots: list) -> dict:
        """slot -> (num_tokens, payload CRC32C, token ids) of the whole records in ``slots``
        (ascending), read from their headers; a slot whose header fails its checks is left
        out. Two records of one key with the same stamp hold the same block (the CRC covers
        the payload)."""
        stamps = {}
        for slot, head in self._read_headers(slots):
            if len(head) < HEADER_BYTES:
                continue
            mv = memoryview(head)
            try:
                _, num_tokens, payload_crc = self.decode_header(mv)
                stamps[slot] = (num_tokens, payload_crc, self.decode_token_ids(mv))
            except RecordError:
                continue
        return stamps

    def records_agree(self, slots: list) -> bool:
        """Whether the whole records in ``slots`` hold one block (``record_stamps`` alike);
        a slot whose header fails its checks agrees with none."""
        if len(slots) < 2:
            return True
        stamps = self.record_stamps(sorted(slots))
        return len({stamps.get(slot, slot) for slot in slots}) == 1

    def _read_headers(self, slots: list) -> Iterator[tuple]:
        """(slot, header bytes) of ``slots`` (ascending), in order (short at the end of the file)."""
        if not slots:
            return

        def job(part: list) -> list:
            out = []
            if self._fd_direct is not None:
                _, _, hmv = self._header_buf()
                for slot in part:
                    got = os.preadv(self._fd_direct, [hmv], slot * self.record_bytes)
                    out.append(bytes(hmv[:got]))
            else:
                for slot in part:
                    out.append(os.pread(self._fd, HEADER_BYTES, slot * self.record_bytes))
            return out

        chunks = [slots[i:i + self.SCAN_CHUNK] for i in range(0, len(slots), self.SCAN_CHUNK)]
        if len(chunks) == 1:
            yield from zip(slots, job(slots))
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.SCAN_THREADS, len(chunks)), thread_name_prefix="tiercache-scan") as pool:
            futures = [pool.submit(job, part) for part in chunks]
            try:
                for part, future in zip(chunks, futures):
                    yield from zip(part, future.result())
            finally:
                for future in futures:
                    future.cancel()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"disk slot {slot} out of range")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.persistent:
            try:
                os.fsync(self._fd)
            except OSError as exc:  # the kernel's word that written pages did not reach the disk:
                self.sync_error = exc  # ignored, close reported success (a review); the store raises it
        if self._cufile is not None:
            try:
                self._cufile.close()
            except Exception as exc:  # noqa: BLE001 - the descriptors and files still go
                log.warning("tiercache: closing kvikio's handle on %s failed: %s", self.path, exc)
        # not left holding the numbers, and let go of before they are closed: the OS hands
        # them to the next file opened, and a late write through them (or a fork's
        # ``_after_fork`` closing them again in the child) would land on that file
        fds, self._fd_direct, self._fd = (self._fd_direct, self._fd), None, None
        for fd in fds:
            if fd is not None:
                os.close(fd)
        if not self.persistent:
            for name in (DATA_NAME, LOCK_NAME):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass
            try:
                os.rmdir(self.directory)
            except OSError:
                pass
        self._release_lock()
