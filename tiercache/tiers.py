"""The bytes of the device and host tiers: pre-allocated pools with hard budgets.

A block is K and V for ``block_tokens`` tokens of one layer: logically ``[2, B, H, T, D]``.
The device pool keeps K and V as ``[B, H, num_slots, T, D]`` so that one ``index_select``
over slots yields a contiguous ``[B, H, S, D]`` view for attention. The host pool keeps each
block contiguous (page-aligned, so the disk tier can use direct I/O on it).
"""
from __future__ import annotations

import functools
import logging
import mmap
import numbers
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

log = logging.getLogger("tiercache")

ALIGN = 4096


def align_up(num_bytes: int, alignment: int = ALIGN) -> int:
    return (num_bytes + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class BlockGeometry:
    """Shape of one block: K and V of ``block_tokens`` tokens, ``[2, batch, kv_heads, T, head_dim]``."""

    batch: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        """A zero or fractional size was a ZeroDivisionError or a torch error from inside the
        store; a dtype named by a string, torch's error at the first allocation."""
        for name in ("batch", "kv_heads", "block_tokens", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"BlockGeometry.{name}: must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"BlockGeometry.dtype: must be a torch.dtype such as torch.float16, got {self.dtype!r}")

    @property
    def shape(self) -> tuple:
        return (2, self.batch, self.kv_heads, self.block_tokens, self.head_dim)

    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def block_bytes(self) -> int:
        return 2 * self.batch * self.kv_heads * self.block_tokens * self.head_dim * self.itemsize

    @functools.cached_property
    def padded_bytes(self) -> int:
        return align_up(self.block_bytes)

    def with_batch(self, batch: int) -> "BlockGeometry":
        return BlockGeometry(batch, self.kv_heads, self.block_tokens, self.head_dim, self.dtype)


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page; smaller buffers are not advised
_MADV_WIPEONFORK = 18  # Linux 4.14+; Python's mmap module has no name for it


def aligned_buffer(num_bytes: int) -> tuple:
    """A page-aligned, zeroed CPU byte tensor and the mmap that owns it (keep both alive).

    Private anonymous memory, advised before any page is touched:
    - ``MADV_HUGEPAGE`` when it is 2 MiB or more (the kernel backs the whole 2 MiB ranges
      inside it). The disk tier reads into these buffers with direct I/O, and for every
      request the kernel pins each page of the destination: on 4 KiB pages that cost 53 ms
      of kernel CPU per GB read, on 2 MiB pages 17 (``preadv`` of 1.5 MiB records into a
      64 MiB buffer, one thread, this 2-core VM, 2026-12-06). The first touch of a byte
      makes its whole 2 MiB resident. The mapping used to be shared (``mmap``'s default),
      which Linux backs with shmem, whose huge pages are off by default
      (``shmem_enabled``: never), so asking made no difference.
    - ``MADV_WIPEONFORK``: a child made by ``fork()`` gets zeros here, not a copy-on-write
      share of the parent's pages. It cannot use the store anyway (``BlockStore.forked``);
      without this advice every page the parent rewrote while a child lived was copied
      (memory doubled), and the kernel copies a page pinned for I/O (a host pool pinned
      with ``cudaHostRegister``) into the child at the fork itself (a review measured 125
      MiB copied, and 179 ms instead of 7, forking beside a pinned 128 MiB buffer). A
      shared mapping had neither cost.
    Advice the kernel does not know (an old kernel, THP not built in) is skipped: the
    buffer works, without it."""
    size = max(num_bytes, ALIGN)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if sys.platform.startswith("linux"):
        _advise(mm, _MADV_WIPEONFORK)
        if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            _advise(mm, mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(mm, dtype=torch.uint8, count=num_bytes) if num_bytes else torch.empty(0, dtype=torch.uint8)
    return tensor, mm


def _advise(mm: mmap.mmap, advice: int) -> None:
    try:
        mm.madvise(advice)
    except OSError:  # EINVAL: a kernel without this advice
        pass


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context
_registered: set = set()  # data_ptr of each buffer pin_in_place registered
_register_lock = threading.Lock()


def pin_in_place(buf: torch.Tensor) -> bool:
    """Page-lock ``buf``, a CPU byte tensor over memory tiercache owns (``aligned_buffer``),
    with ``cudaHostRegister``, so that CUDA copies to and from it run asynchronously at full
    speed: exactly its bytes, and only until ``unpin_in_place``. torch's pinned allocator
    (``pin_memory=True``) rounds every request up to a power of two and keeps the block
    cached after it is freed: a 40 GiB host tier would pin 64 GiB, and hold it when the
    store is closed. Returns False, with a warning, where it cannot (no CUDA, a torch
    without the call, the driver refuses): the buffer then stays pageable, which is correct
    but slower. On a GPU machine, not measured on one yet (2026-12-05)."""
    try:
        cudart = torch.cuda.cudart()
        register, _ = cudart.cudaHostRegister, cudart.cudaHostUnregister  # both, or neither
        nbytes = buf.numel() * buf.element_size()
        err = register(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes: {cudart.cudaGetErrorString(err)}")
    except Exception as exc:  # noqa: BLE001 - no CUDA, an old torch, the driver: all mean pageable
        log.warning("tiercache: pinned host memory unavailable (%s: %s); using pageable memory",
                    type(exc).__name__, exc)
        return False
    with _register_lock:
        _registered.add(buf.data_ptr())
    return True


def unpin_in_place(buf: torch.Tensor) -> None:
    """Undo ``pin_in_place`` (a no-op for a buffer it did not pin); before the memory goes."""
    with _register_lock:
        if buf.data_ptr() not in _registered:
            return
        _registered.discard(buf.data_ptr())
    err = torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    if int(err) != 0:
        log.warning("tiercache: cudaHostUnregister failed (%s)", torch.cuda.cudart().cudaGetErrorString(err))


class DevicePool:
    """Device-tier slots on the model's device (CUDA, or CPU RAM).

    All copies go through 3-D views ``[B*H, num_slots, T*D]``: torch's copy and index_select
    kernels are two orders of magnitude faster on them than on the 5-D layout.
    """

    def __init__(self, geometry: BlockGeometry, num_slots: int, device: torch.device) -> None:
        g = geometry
        self.geometry = g
        self.num_slots = num_slots
        self.device = torch.device(device)
        rows, width = g.batch * g.kv_heads, g.block_tokens * g.head_dim
        # k, v: [B*H, num_slots, T*D]  (block s of row r holds tokens s*T .. s*T+T-1)
        # Not zero-filled: every read is sliced to the tokens written (a slot's unwritten
        # tail is never part of what attention sees), and untouched pages cost no RAM.
        self.k = torch.empty(rows, num_slots, width, dtype=g.dtype, device=self.device)
        self.v = torch.empty_like(self.k)
        self._np_rows: Optional[tuple] = None  # CPU: numpy byte views of k and v (read_rows)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def release(self) -> None:
        """Let go of the slots (the store is closed): a closed cache kept as the record of a
        call (``wrap()``'s ``tiercache_last``) held its whole device budget. Views handed
        out earlier keep their own storage alive."""
        self._np_rows = None
        self.k = torch.empty(0, dtype=self.k.dtype, device=self.device)
        self.v = torch.empty_like(self.k)

    def prefault(self, num_slots: int) -> None:
        """CPU: touch the pages of slots ``0 .. num_slots-1`` (the first a fresh pool hands
        out), so that a bulk fill such as a prefix load does not stop on a page fault per
        4 KiB; a plain memset (numpy: no OpenMP region, the GIL released). No-op on CUDA."""
        n = min(num_slots, self.num_slots)
        if self.device.type != "cpu" or n <= 0:
            return
        for pool in (self.k, self.v):
            pool.view(torch.uint8).numpy()[:, :n].fill(0)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        # [B, H, T, D] -> [B*H, T*D]
        g = self.geometry
        return t.reshape(g.batch * g.kv_heads, -1)

    def write_block(self, slot: int, block: torch.Tensor, non_blocking: bool = False) -> None:
        # block: [2, B, H, T, D]
        block = block.detach()  # a pool takes bytes, never a graph (an autograd forward's K/V)
        self.k[:, slot].copy_(self._rows(block[0]), non_blocking=non_blocking)
        self.v[:, slot].copy_(self._rows(block[1]), non_blocking=non_blocking)

    def read_block(self, slot: int, out: torch.Tensor, non_blocking: bool = False) -> None:
        # out: [2, B, H, T, D], contiguous
        out[0].view(self.k.shape[0], -1).copy_(self.k[:, slot], non_blocking=non_blocking)
        out[1].view(self.v.shape[0], -1).copy_(self.v[:, slot], non_blocking=non_blocking)

    def _staged(self, staged: torch.Tensor, slot_bytes: int) -> tuple:
        # uint8 [n * slot_bytes], blocks laid out as host slots ([2, B, H, T, D], padded)
        # -> K and V as [B*H, n, T*D] views, and the padding [n, pad] (empty if none)
        g = self.geometry
        rows, width = self.k.shape[0], self.k.shape[2]
        plane = rows * width
        flat = staged.view(g.dtype).view(-1, slot_bytes // g.itemsize)
        k = flat[:, :plane].view(-1, rows, width).transpose(0, 1)
        v = flat[:, plane:2 * plane].view(-1, rows, width).transpose(0, 1)
        return k, v, flat[:, 2 * plane:]

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        index = torch.tensor(slots, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: the copy is queued, the host does not wait
            index = index.pin_memory().to(self.device, non_blocking=True)
        return index

    def write_staged(self, slots: Sequence[int], staged: torch.Tensor, slot_bytes: int) -> None:
        """Scatter blocks from ``staged`` (on this pool's device; ``len(slots)`` blocks laid
        out as host slots of ``slot_bytes``) into ``slots``: one kernel per pool for any
        number of blocks, on the current stream. A host->device move is then one copy of
        the host slots' bytes as they are (adjacent slots together) plus this, instead of
        a temporary, a copy and a kernel for each of K and V of each block."""
        k, v, _ = self._staged(staged, slot_bytes)
        if len(slots) == 1:
            self.k[:, slots[0]].copy_(k[:, 0])
            self.v[:, slots[0]].copy_(v[:, 0])
            return
        index = self._index(slots)
        self.k.index_copy_(1, index, k)
        self.v.index_copy_(1, index, v)

    def read_staged(self, slots: Sequence[int], staged: torch.Tensor, slot_bytes: int,
                    scratch: Optional[torch.Tensor] = None) -> None:
        """The reverse of ``write_staged``: gather ``slots`` into ``staged`` as host slots
        (padding zeroed), ready for one copy down per run of adjacent host slots. The gather
        goes through ``scratch`` (uint8, on this device; as many blocks' K at a time as it
        holds, at least one), or through a temporary if it is None."""
        k, v, pad = self._staged(staged, slot_bytes)
        n = len(slots)
        if n == 1:
            k[:, 0].copy_(self.k[:, slots[0]])
            v[:, 0].copy_(self.v[:, slots[0]])
        else:
            index = self._index(slots)
            rows, width = self.k.shape[0], self.k.shape[2]
            step = n if scratch is None else scratch.numel() // (rows * width * self.k.element_size())
            if step < 1:
                raise ValueError("read_staged: scratch holds less than one block's K")
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                for pool, out in ((self.k, k), (self.v, v)):
                    if scratch is None:
                        out[:, lo:hi].copy_(pool.index_select(1, index[lo:hi]))
                    else:
                        tmp = scratch[:rows * (hi - lo) * width * pool.element_size()].view(pool.dtype)
                        tmp = tmp.view(rows, hi - lo, width)
                        torch.index_select(pool, 1, index[lo:hi], out=tmp)
                        out[:, lo:hi].copy_(tmp)
        if pad.numel():
            pad.zero_()

    def read_rows(self, slots: Union[int, slice], k_out, v_out) -> None:
        """CPU: copy the K and V of a slot (or a slice of slots) into ``k_out``, ``v_out``
        (numpy byte arrays [B*H, T*D*itemsize], or [B*H, n, T*D*itemsize] for a slice; e.g.
        host slots' rows): two strided memcpys (numpy releases the GIL while copying and
        starts no OpenMP region; ~1 us of Python each)."""
        k, v = self.byte_rows()
        np.copyto(k_out, k[:, slots])
        np.copyto(v_out, v[:, slots])

    def write_rows(self, slots: Union[int, slice], k_src, v_src) -> None:
        """CPU: the reverse of ``read_rows``."""
        k, v = self.byte_rows()
        np.copyto(k[:, slots], k_src)
        np.copyto(v[:, slots], v_src)

    def byte_rows(self) -> tuple:
        """numpy byte views of K and V, [B*H, num_slots, T*D*itemsize] (CPU pools)."""
        if self._np_rows is None:
            self._np_rows = (self.k.view(torch.uint8).numpy(), self.v.view(torch.uint8).numpy())
        return self._np_rows

    def write_tokens(self, slot: int, offset: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        # k_new, v_new: [B, H, n, D] -> tokens [offset, offset + n) of the slot
        # One strided copy each into an as_strided view of the pool: no reshape of a strided
        # slice into a temporary, and one dispatch instead of an index, a slice and a view
        # (a decode step writes one token per layer: their dispatch is most of its cost).
        g = self.geometry
        d = g.head_dim
        n = k_new.shape[-2]
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"write_tokens: slot {slot} of a pool of {self.num_slots}")
        if offset < 0 or offset + n > g.block_tokens:
            raise ValueError(f"write_tokens: tokens {offset} .. {offset + n} do not fit a block of {g.block_tokens}")
        rows, per_slot = self.k.stride(0), self.k.stride(1)
        size, stride = (g.batch, g.kv_heads, n, d), (g.kv_heads * rows, rows, d, 1)
        at = slot * per_slot + offset * d
        # detached: a pool takes bytes, never a graph (retention's compacted K/V in a forward
        # with autograd on grew the graph the pool held at every step)
        self.k.as_strided(size, stride, self.k.storage_offset() + at).copy_(k_new.detach())
        self.v.as_strided(size, stride, self.v.storage_offset() + at).copy_(v_new.detach())

    def gather(self, slots: list, num_tokens: int, start_token: int = 0) -> tuple:
        """K and V of ``slots`` in order, as [B, H, num_tokens, D] (tokens from ``start_token``).

        Always a copy: the result does not alias the pool (see ``view`` for the no-copy read).
        """
        g = self.geometry
        n = len(slots)
        index = self._index(slots)  # on CUDA: no wait for the queued kernels (torch.tensor(device=) would)
        k = self.k.index_select(1, index)
        v = self.v.index_select(1, index)
        shape = (g.batch, g.kv_heads, n * g.block_tokens, g.head_dim)
        k, v = k.reshape(shape), v.reshape(shape)
        return (k[:, :, start_token:start_token + num_tokens], v[:, :, start_token:start_token + num_tokens])

    @staticmethod
    def consecutive(slots: list) -> bool:
        """Are ``slots`` adjacent and in ascending order (so that ``view`` can read them)?"""
        return bool(slots) and slots[-1] - slots[0] == len(slots) - 1 and all(
            b == a + 1 for a, b in zip(slots, slots[1:]))

    def view(self, first_slot: int, num_slots: int, num_tokens: int, start_token: int = 0) -> tuple:
        """K and V of the adjacent slots ``first_slot ..`` as [B, H, num_tokens, D] views of
        the pool (no copy): valid only while those slots are held and not written."""
        g = self.geometry
        shape = (g.batch, g.kv_heads, num_slots * g.block_tokens, g.head_dim)
        k = self.k[:, first_slot:first_slot + num_slots].view(shape)
        v = self.v[:, first_slot:first_slot + num_slots].view(shape)
        return (k[:, :, start_token:start_token + num_tokens], v[:, :, start_token:start_token + num_tokens])

    def reorder_rows(self, slots: list, rows: torch.Tensor) -> None:
        """Permute the batch rows of ``slots`` (beam search)."""
        if not slots:
            return
        g = self.geometry
        index = self._index(slots)
        rows = rows.to(self.device)
        for pool in (self.k, self.v):
            sub = pool.index_select(1, index).view(g.batch, g.kv_heads, len(slots), -1).index_select(0, rows)
            pool.index_copy_(1, index, sub.reshape(g.batch * g.kv_heads, len(slots), -1))


class HostPool:
    """Host-tier slots: pinned memory when CUDA is present, page-aligned RAM otherwise."""

    def __init__(self, geometry: BlockGeometry, num_slots: int, pin: bool, on_pin_fallback=None) -> None:
        self.geometry = geometry
        self.num_slots = num_slots
        self.slot_bytes = geometry.padded_bytes
        total = self.slot_bytes * num_slots
        self.pinned = False
        self._mm = None
        self._kv_rows: Optional[tuple] = None  # see kv_rows
        self.buffer, self._mm = aligned_buffer(total)
        if pin:  # exactly the budget's bytes (see pin_in_place), or pageable with a warning and a stat
            self.pinned = pin_in_place(self.buffer)
            if not self.pinned and on_pin_fallback is not None:
                on_pin_fallback()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def raw(self, slot: int) -> torch.Tensor:
        """The slot's bytes, padded to the page size (uint8)."""
        return self.buffer[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def view(self, slot: int) -> torch.Tensor:
        """The slot as a [2, B, H, T, D] tensor."""
        g = self.geometry
        return self.raw(slot)[:g.block_bytes].view(g.dtype).view(g.shape)

    def kv_rows(self) -> tuple:
        """K and V of every slot as [B*H, num_slots, T*D] strided views (for gathers and
        copies; made once: each batch of moves asks for them)."""
        if self._kv_rows is not None:
            return self._kv_rows
        g = self.geometry
        rows, width = g.batch * g.kv_heads, g.block_tokens * g.head_dim
        per_slot = self.slot_bytes // g.itemsize
        flat = self.buffer.view(g.dtype)  # [num_slots * per_slot]
        k = flat.as_strided((rows, self.num_slots, width), (width, per_slot, 1))
        v = flat.as_strided((rows, self.num_slots, width), (width, per_slot, 1), rows * width)
        self._kv_rows = (k, v)
        return k, v

    def close(self) -> None:
        self._kv_rows = None
        unpin_in_place(self.buffer)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the GC will reclaim it
            self._mm = None
