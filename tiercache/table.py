"""The block table: which block has a copy on which tier, in which slot, in which state.

It is the only code that changes that state. It knows nothing of tensors, files or
streams, so it is tested with plain keys. Not thread-safe: the store serialises access.

A block may have copies on several tiers at once (a clean copy below a hot one makes
eviction a simple drop). A copy is FILLING while a move writes it and READY after; a copy
that an in-flight move reads has ``readers > 0``. Neither kind is ever freed or reused.
"""
from __future__ import annotations

import enum
import heapq
import sys
from dataclasses import dataclass, field
from typing import Hashable, Iterator, NamedTuple, Optional


class Tier(enum.IntEnum):
    """Storage tiers, fastest first."""

    DEVICE = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        return _LABELS[self]


_TIERS = tuple(Tier)  # fastest first
_LABELS = {tier: tier.name.lower() for tier in Tier}  # looked up per move: not rebuilt each time
_END = sys.maxsize  # lst[_END:] = [x] appends, in a statement with no call
_BY_NAME = {label: tier for tier, label in _LABELS.items()}


def as_tier(value: object, name: str = "tier") -> Tier:
    """``value`` as a ``Tier``: a Tier, its label ("device", "host", "disk") or its number.
    Anything else is a ValueError naming ``name`` and the tiers. (The store compares tiers
    by identity: a plain 1 for the host, or the string "host", took other paths silently,
    or failed deep inside.)"""
    if isinstance(value, Tier):
        return value
    if isinstance(value, str) and value.lower() in _BY_NAME:
        return _BY_NAME[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in _LABELS:
        return Tier(value)
    raise ValueError(f"{name}: expected a Tier ({', '.join(_BY_NAME)}), got {value!r}")


class CopyState(enum.Enum):
    FILLING = "filling"  # a move is writing it; not readable yet
    READY = "ready"


@dataclass(slots=True)  # slots: one per copy, read on every move (smaller, faster to reach)
class Copy:
    slot: int
    state: CopyState
    readers: int = 0  # in-flight moves reading this copy


@dataclass(slots=True)
class BlockEntry:
    key: Hashable
    copies: dict = field(default_factory=dict)  # Tier -> Copy
    pins: int = 0  # a pinned block keeps its device copy
    deleted: bool = False

    def ready_tiers(self) -> list:
        return sorted(t for t, c in self.copies.items() if c.state is CopyState.READY)

    def in_flight(self) -> bool:
        return any(c.state is CopyState.FILLING or c.readers for c in self.copies.values())


class Move(NamedTuple):
    """A prepared move: the source copy is held, the destination slot reserved.

    Immutable, and equal and hashed by identity: ``prepare_move`` makes each move once,
    and the store looks it up in its in-flight maps several times per move (a
    field-by-field hash in Python cost ~8 calls per block moved). A named tuple, not a
    frozen dataclass: one is made per block moved, and a frozen dataclass's ``__init__``
    (one ``object.__setattr__`` per field) took 1.0 µs against 0.4."""

    key: Hashable
    src: Tier
    src_slot: int
    dst: Tier
    dst_slot: int
    drop_source: bool
    entry: Optional["BlockEntry"] = None

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return (f"Move({self.key!r}, {self.src.label}[{self.src_slot}] -> {self.dst.label}[{self.dst_slot}]"
                f"{', drop source' if self.drop_source else ''})")


def ready_elsewhere(entry: BlockEntry, tier: Tier) -> bool:
    """Whether the block has a READY copy on a tier other than ``tier`` (its copy there can
    be dropped without loss)."""
    return any(t is not tier and c.state is CopyState.READY for t, c in entry.copies.items())


class TableError(RuntimeError):
    """A caller broke the table's protocol (a bug in tiercache, never a user error)."""


class _Slots:
    """Free slots: every slot from ``_top`` up, and below it a min-heap and a set of the
    slots given back. ``alloc`` hands out the lowest free slot, so slots taken together are
    adjacent wherever the free ones are, whatever order they were freed in (moves between
    adjacent slots are one copy; a disk tier's file stays short). ``take`` of a given slot
    (adopting records on open) only leaves the set; the heap drops stale entries lazily, so
    opening a directory of n records is O(n log n), not O(n^2). Memory follows the slots
    used, not the budget: a list of every slot took ~6 GiB for a 10 TiB disk budget before
    anything was written."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._top = 0  # slots >= _top are free, all of them
        self._free: list = []  # heap of slots below _top that are free (with stale entries)
        self._free_set: set = set()
        self._used = 0

    def alloc(self) -> Optional[int]:
        if not self._free and self._free_set:  # an interrupted pop left free slots out of the heap
            self._free = sorted(self._free_set)
        while self._free:
            slot = heapq.heappop(self._free)
            if slot in self._free_set:
                self._free_set.discard(slot)
                self._used += 1
                return slot
        if self._top < self.num_slots:
            self._top += 1
            self._used += 1
            return self._top - 1
        return None

    def alloc_many(self, n: int) -> Optional[list]:
        """``alloc`` ``n`` times, in one call (a batch of moves): the ``n`` lowest free
        slots, ascending; None, with nothing taken, if fewer are free. Each slot is counted
        as it is taken, never past ``num_slots``, and an interrupt in here gives back those
        taken (a review: counted at the end, a Ctrl-C in the loop lost them all, and the
        count then let it hand out slots past the tier's size)."""
        if n > self.num_slots - self._used:
            return None
        out: list = []
        free, free_set, pop = self._free, self._free_set, heapq.heappop
        try:
            if len(free_set) > len(free):  # an interrupted pop left free slots out of the heap
                free[:] = sorted(free_set)
            while free and len(out) < n:
                slot = pop(free)
                if slot in free_set:
                    free_set.discard(slot)
                    self._used, out[_END:] = self._used + 1, [slot]  # one statement: both or neither
            while len(out) < n and self._top < self.num_slots:
                self._top, self._used, out[_END:] = self._top + 1, self._used + 1, [self._top]
            if len(out) < n:
                raise TableError(f"{n} free slots counted, {len(out)} found")
        except BaseException:
            for slot in out:
                self.release(slot)
            raise
        return out

    def take(self, slot: int) -> None:
        if slot >= self._top and slot < self.num_slots:
            for below in range(self._top, slot):  # the slots skipped stay free, below _top now
                heapq.heappush(self._free, below)
                self._free_set.add(below)
            self._top = slot + 1
        elif slot in self._free_set:
            self._free_set.discard(slot)  # its heap entry goes stale
        else:
            raise TableError(f"slot {slot} is not free")
        self._used += 1

    def release(self, slot: int) -> None:
        if slot in self._free_set or not 0 <= slot < self._top:
            raise TableError(f"slot {slot} released twice or out of range")
        heapq.heappush(self._free, slot)
        self._free_set.add(slot)
        self._used -= 1
        if len(self._free) > 2 * len(self._free_set) + 64:  # mostly stale entries (take, then release)
            self._free = sorted(self._free_set)  # ascending: a heap

    @property
    def num_free(self) -> int:
        return self.num_slots - self._used

    def is_free(self, slot: int) -> bool:
        return self._top <= slot < self.num_slots or slot in self._free_set


class BlockTable:
    """Blocks, their copies per tier, and the free slots of each tier."""

    def __init__(self, num_slots: dict) -> None:
        self._slots = {tier: _Slots(n) for tier, n in num_slots.items()}
        self._blocks: dict = {}
        # Deleted blocks whose copies are still in flight; their key may already be reused
        # by a new block, so they are kept apart (by identity) until their moves complete.
        self._zombies: dict = {}
        self._on_tier: dict = {tier: set() for tier in num_slots}
        # Slots held out of use though no block has a copy there (``hold``): a freed disk
        # record (a deleted block's) whose tombstone failed, kept until it is invalidated.
        self._held: dict = {tier: set() for tier in num_slots}

    # ---- queries -------------------------------------------------------------------
    def tiers(self) -> list:
        return sorted(self._slots)

    def num_slots(self, tier: Tier) -> int:
        return self._slots[tier].num_slots if tier in self._slots else 0

    def num_free(self, tier: Tier) -> int:
        return self._slots[tier].num_free if tier in self._slots else 0

    def num_used(self, tier: Tier) -> int:
        return self.num_slots(tier) - self.num_free(tier)

    def get(self, key: Hashable) -> Optional[BlockEntry]:
        entry = self._blocks.get(key)
        return None if entry is None or entry.deleted else entry

    def __contains__(self, key: Hashable) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return sum(1 for e in self._blocks.values() if not e.deleted)

    def free_slots(self, tier: Tier) -> Iterator[int]:
        """The free slots of ``tier``, lowest first, looked up lazily (a slot taken while
        this is walked is passed over)."""
        slots = self._slots[tier]
        return (slot for slot in range(slots.num_slots) if slots.is_free(slot))

    def keys(self) -> Iterator:
        return (k for k, e in self._blocks.items() if not e.deleted)

    def keys_on(self, tier: Tier) -> set:
        return self._on_tier.get(tier, set())

    def ready_keys(self, tier: Tier) -> set:
        """Keys of the live blocks with a READY copy on ``tier`` (tests)."""
        return {key for key, e in self._blocks.items()
                if not e.deleted and tier in e.copies and e.copies[tier].state is CopyState.READY}

    def copy(self, key: Hashable, tier: Tier) -> Optional[Copy]:
        entry = self.get(key)
        return None if entry is None else entry.copies.get(tier)

    def is_ready(self, key: Hashable, tier: Tier) -> bool:
        c = self.copy(key, tier)
        return c is not None and c.state is CopyState.READY

    def best_source(self, key: Hashable, below: Optional[Tier] = None) -> Optional[Tier]:
        """The fastest tier holding a READY copy (strictly below ``below`` when given)."""
        entry = self.get(key)
        if entry is None:
            return None
        copies = entry.copies
        for tier in _TIERS if below is None else _TIERS[below + 1:]:
            c = copies.get(tier)
            if c is not None and c.state is CopyState.READY:
                return tier
        return None

    def best_copy(self, key: Hashable) -> Optional[tuple]:
        """(tier, copy) of the fastest READY copy, or None: ``best_source`` and ``copy`` in
        one lookup (the store orders every batch of moves by it)."""
        entry = self._blocks.get(key)
        if entry is None or entry.deleted:
            return None
        copies = entry.copies
        for tier in _TIERS:
            c = copies.get(tier)
            if c is not None and c.state is CopyState.READY:
                return tier, c
        return None

    def can_drop(self, key: Hashable, tier: Tier) -> bool:
        """True when the copy on ``tier`` may go without losing data or racing a move."""
        entry = self._blocks.get(key)
        if entry is None:
            return False
        c = entry.copies.get(tier)
        if c is None or c.state is not CopyState.READY or c.readers:
            return False
        if tier is Tier.DEVICE and entry.pins:
            return False
        if entry.deleted:
            return True
        return ready_elsewhere(entry, tier)

    def any_in_use(self) -> bool:
        """True when a copy of a live block is being read (a reader holds it) or filled."""
        return any(entry.in_flight() for entry in self._blocks.values())

    def is_movable(self, key: Hashable, tier: Tier) -> bool:
        """True when the copy on ``tier`` may be the source of a demotion."""
        entry = self.get(key)
        if entry is None:
            return False
        c = entry.copies.get(tier)
        if c is None or c.state is not CopyState.READY or c.readers:
            return False
        return not (tier is Tier.DEVICE and entry.pins)

    # ---- mutations -----------------------------------------------------------------
    def allocate(self, key: Hashable, tier: Tier, prefer: Optional[int] = None) -> int:
        """Reserve a slot on ``tier`` for a new copy of ``key`` (FILLING): ``prefer`` when
        that slot is free, else any."""
        entry = self._blocks.get(key)
        if entry is None:
            entry = BlockEntry(key)
            slot = self._new_copy(entry, tier, prefer)
            self._blocks[key] = entry
            return slot
        return self._new_copy(entry, tier, prefer)

    def adopt(self, key: Hashable, tier: Tier, slot: int) -> None:
        """Register an existing READY copy in a given slot (used when reopening a disk tier)."""
        if key in self._blocks:
            raise TableError(f"block {key!r} already known")
        self._slots[tier].take(slot)
        self._blocks[key] = BlockEntry(key, {tier: Copy(slot, CopyState.READY)})
        self._on_tier[tier].add(key)

    def commit(self, entry: BlockEntry, tier: Tier) -> None:
        """``entry``'s FILLING copy on ``tier`` (``allocate``) is written: READY. By entry, not
        key: a block deleted while it was filled (and its key maybe stored anew) is parked
        among the zombies, and a lookup by key found nothing or the newer block."""
        c = entry.copies.get(tier)
        if c is None or c.state is not CopyState.FILLING:
            raise TableError(f"copy of {entry.key!r} on {tier.label} is not filling")
        c.state = CopyState.READY

    def abort(self, entry: BlockEntry, tier: Tier) -> int:
        """Give back ``entry``'s FILLING copy on ``tier`` (its write failed, or the block was
        deleted meanwhile); a deleted block with no copies left goes. Returns the freed slot."""
        c = entry.copies.get(tier)
        if c is None or c.state is not CopyState.FILLING:
            raise TableError(f"copy of {entry.key!r} on {tier.label} is not filling")
        slot = self._free_copy(entry, tier)
        self._collect(entry)
        return slot

    def prepare_move(self, key: Hashable, src: Tier, dst: Tier, drop_source: bool) -> Move:
        return self.prepare_moves([(key, src)], dst, drop_source)[0]

    def prepare_moves(self, planned: list, dst: Tier, drop_source: bool) -> list:
        """Prepare a move to ``dst`` of each ``(key, src)`` of ``planned``: hold its READY
        source copy (a reader) and reserve a FILLING copy on ``dst`` in the lowest free slot,
        in order, so that sources planned in slot order get adjacent destinations. Returns
        the moves, in order. All or nothing: if one cannot be prepared (unknown or deleted
        block, no READY source, a pinned or busy source to drop, a copy already on ``dst``,
        no free slot), those prepared are undone and ``TableError`` says why.

        One call for a batch: planning a batch of host<->device moves was about a third of
        the store's Python per block moved."""
        moves: list = []
        blocks, ready, filling, device = self._blocks, CopyState.READY, CopyState.FILLING, Tier.DEVICE
        # ``_new_copy`` inline, its slots taken at once: the lowest free, in order
        dst_slots, on_dst = self._slots[dst], self._on_tier[dst]
        slots = dst_slots.alloc_many(len(planned))
        if slots is None:
            raise TableError(f"no free slot on {dst.label} for {len(planned)} blocks "
                             f"({dst_slots.num_free} free)")
        held = None  # the slot of the last copy made (the move after it may not be)
        try:
            for slot, (key, src) in zip(slots, planned):
                entry = blocks.get(key)
                if entry is None or entry.deleted:
                    raise TableError(f"unknown block {key!r}")
                copies = entry.copies
                c = copies.get(src)
                if c is None or c.state is not ready:
                    raise TableError(f"block {key!r} has no READY copy on {src.label}")
                if drop_source and (c.readers or (src is device and entry.pins)):  # not is_movable
                    raise TableError(f"block {key!r} on {src.label} is pinned or busy")
                if dst in copies:
                    raise TableError(f"block {key!r} already has a copy on {dst.label}")
                copies[dst], held = Copy(slot, filling), slot  # no interrupt between the two
                on_dst.add(key)
                c.readers += 1
                moves.append(Move(key, src, c.slot, dst, slot, drop_source, entry))
        except BaseException:
            for move in moves:
                self.complete_move(move, ok=False)
            for slot in slots[len(moves):]:  # the slots taken for moves not made go back, but
                if slot != held:  # one whose copy an interrupt left made (held, as before)
                    dst_slots.release(slot)
            raise
        return moves

    def complete_move(self, move: Move, ok: bool) -> list:
        """Commit or roll back ``move``. Returns the (tier, slot) pairs it freed."""
        entry = move.entry
        freed = []
        if ok:
            slot = self.commit_copied(move)
            if slot is not None:
                freed.append((move.src, slot))
        else:
            entry.copies[move.src].readers -= 1
            freed.append((move.dst, self._free_copy(entry, move.dst)))
        if entry.deleted or not entry.copies:  # else _collect has nothing to do
            freed.extend(self._collect(entry))
        return freed

    def commit_copied(self, move: Move) -> Optional[int]:
        """The commit of ``complete_move``: ``move``'s destination copy becomes READY, and its
        source copy is freed if the move drops it. Returns that source slot, or None. Alone
        (a batch completing tens of moves under one hold of the store's lock) only for a
        block that is not deleted: a deleted one's other copies are ``complete_move``'s to free."""
        entry = move.entry
        copies = entry.copies
        src = copies[move.src]
        src.readers -= 1
        copies[move.dst].state = CopyState.READY
        if move.drop_source and not src.readers and not (move.src is Tier.DEVICE and entry.pins):
            return self._free_copy(entry, move.src)
        return None

    def drop(self, key: Hashable, tier: Tier) -> int:
        """Free the copy on ``tier``; requires ``can_drop``. Returns the freed slot."""
        if not self.can_drop(key, tier):
            raise TableError(f"copy of {key!r} on {tier.label} cannot be dropped")
        entry = self._blocks[key]
        slot = self._free_copy(entry, tier)
        self._collect(entry)
        return slot

    def drop_others(self, key: Hashable, keep: Tier) -> list:
        """Before a write to the copy on ``keep``: free every other copy (now stale)."""
        entry = self.get(key)
        if entry is None or entry.in_flight():
            raise TableError(f"block {key!r} is unknown or in flight")
        return [(t, self._free_copy(entry, t)) for t in list(entry.copies) if t != keep]

    def delete(self, key: Hashable) -> list:
        """Forget ``key``. Copies in flight are freed when their move completes."""
        entry = self.get(key)
        if entry is None:
            return []
        entry.deleted = True
        entry.pins = 0
        freed = self._collect(entry)
        if entry.copies:  # still in flight: park it so the key can be reused at once
            del self._blocks[key]
            self._zombies[id(entry)] = entry
            for tier in entry.copies:
                self._on_tier[tier].discard(key)
        return freed

    def discard(self, key: Hashable, tier: Tier) -> list:
        """Free a READY copy known to be bad (failed its checksum). Returns freed (tier, slot)."""
        entry = self.get(key)
        if entry is None:
            return []
        c = entry.copies.get(tier)
        if c is None or c.state is not CopyState.READY or c.readers:
            return []
        freed = [(tier, self._free_copy(entry, tier))]
        if not entry.copies:
            del self._blocks[key]
        return freed

    def hold(self, tier: Tier, slot: int) -> None:
        """Take ``slot`` on ``tier``, just freed, out of use again though no block has a copy
        there (a freed record that could not be invalidated): no copy gets it
        until ``unhold``."""
        self._slots[tier].take(slot)
        self._held[tier].add(slot)

    def unhold(self, tier: Tier, slot: int) -> None:
        """Give back a slot ``hold`` took."""
        self._held[tier].remove(slot)
        self._slots[tier].release(slot)

    def pin(self, key: Hashable) -> None:
        entry = self.get(key)
        if entry is None:
            raise TableError(f"unknown block {key!r}")
        entry.pins += 1

    def unpin(self, key: Hashable) -> None:
        entry = self.get(key)
        if entry is None or entry.pins <= 0:
            raise TableError(f"block {key!r} is not pinned")
        entry.pins -= 1

    @staticmethod
    def pin_listed(entry: BlockEntry, listed: list, item: Hashable) -> None:
        """Pin ``entry`` and append ``item`` to ``listed`` (the caller's record of its pins)
        in one statement with no call in it: a Ctrl-C lands before both or after both, so
        whoever undoes the pins ``listed`` names undoes exactly those taken."""
        entry.pins, listed[_END:] = entry.pins + 1, [item]

    @staticmethod
    def unpin_entries(entries: list) -> None:
        """Undo one pin of each of ``entries`` that still lives (``delete`` cleared a deleted
        one's pins), consuming the list (emptied, one entry at a time: each is undone once).
        By entry, not key: a key deleted and stored anew names a block that was never
        pinned."""
        while entries:
            entry = entries.pop()
            if not entry.deleted and entry.pins > 0:
                entry.pins -= 1

    # ---- internals -----------------------------------------------------------------
    def _new_copy(self, entry: BlockEntry, tier: Tier, prefer: Optional[int] = None) -> int:
        """A FILLING copy of ``entry`` on ``tier`` in a free slot (``prefer`` if free)."""
        if tier in entry.copies:
            raise TableError(f"block {entry.key!r} already has a copy on {tier.label}")
        slots = self._slots[tier]
        if prefer is not None and slots.is_free(prefer):
            slots.take(prefer)
            slot = prefer
        else:
            slot = slots.alloc()
            if slot is None:
                raise TableError(f"no free slot on {tier.label}")
        entry.copies[tier] = Copy(slot, CopyState.FILLING)
        self._on_tier[tier].add(entry.key)
        return slot

    def _free_copy(self, entry: BlockEntry, tier: Tier) -> int:
        c = entry.copies.pop(tier)
        if c.readers:
            raise TableError(f"copy of {entry.key!r} on {tier.label} is in flight")
        self._slots[tier].release(c.slot)
        if self._blocks.get(entry.key) is entry:
            self._on_tier[tier].discard(entry.key)
        return c.slot

    def _collect(self, entry: BlockEntry) -> list:
        freed = []
        if entry.deleted:
            for tier, c in list(entry.copies.items()):
                if c.state is CopyState.READY and not c.readers:
                    freed.append((tier, self._free_copy(entry, tier)))
        if not entry.copies:
            if self._blocks.get(entry.key) is entry:
                del self._blocks[entry.key]
            self._zombies.pop(id(entry), None)
        return freed

    def check(self) -> None:
        """Assert internal consistency (used by tests)."""
        entries = list(self._blocks.values()) + list(self._zombies.values())
        for tier, slots in self._slots.items():
            used = [c.slot for e in entries for t, c in e.copies.items() if t == tier] + list(self._held[tier])
            assert len(used) == len(set(used)), f"slot used twice on {tier.label}"
            assert not any(slots.is_free(s) for s in used), f"a used slot is free on {tier.label}"
            assert len(used) + slots.num_free == slots.num_slots, f"slots leaked on {tier.label}"


class BlockKey(tuple):
    """Identity of one block of a live sequence: (seq_id, layer, index)."""

    __slots__ = ()

    def __new__(cls, seq_id: int, layer: int, index: int) -> "BlockKey":
        return tuple.__new__(cls, (seq_id, layer, index))

    @property
    def seq_id(self) -> int:
        return self[0]

    @property
    def layer(self) -> int:
        return self[1]

    @property
    def index(self) -> int:
        return self[2]

    def __repr__(self) -> str:
        return f"BlockKey(seq={self[0]}, layer={self[1]}, index={self[2]})"
