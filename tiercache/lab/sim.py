"""Replay a block-access trace through tiercache's own policy objects, tier by tier.

The replay models the runtime's placement, not its bytes: tiers are inclusive as in the
``BlockStore`` (a promotion keeps the lower copy, so evicting a clean copy moves nothing; a
block that is written loses its lower copies and is written behind once it is sealed, i.e.
when the next block of its layer is started), the blocks of the layer being computed are
pinned, a prefetch only evicts clean copies, and the device tier is where attention reads
(as on CUDA). The eviction and prefetch policies are the registered classes themselves.

Time is simulated per link (host->device, disk->host) at the given bandwidths, on top of
the trace's compute clock: a demand fetch stalls until its copy lands, a prefetch is "late"
when its block is read before it lands (the reader stalls for the rest), "unused" when its
block leaves the device unread, or is still there unread when the trace ends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from tiercache.guard import CheckedPolicy, as_plan, is_plugin, plan_breach, plugin_answer
from tiercache.lab.trace import Trace
from tiercache.policies import make_eviction, make_prefetch
from tiercache.table import BlockKey

DEVICE, HOST, DISK = 0, 1, 2
LINKS = ("device->host", "host->device", "host->disk", "disk->host", "device->disk", "disk->device")


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of each link."""

    host_to_device: float
    device_to_host: float
    disk_read: float
    disk_write: float


class InfeasibleBudget(ValueError):
    """The device tier cannot hold the blocks of one layer (the runtime's CapacityError)."""

    def __init__(self, needed_blocks: int, block_bytes: int) -> None:
        self.min_budget_bytes = needed_blocks * block_bytes
        super().__init__(f"attention needs {needed_blocks} blocks of one layer resident: device budget "
                         f">= {self.min_budget_bytes} bytes")


def check_host_budget(host_budget: Optional[int], block_bytes: int, name: str) -> None:
    """A host budget under one block held nothing and was taken, silently, for 0: no host tier."""
    if host_budget is not None and 0 < host_budget < block_bytes:
        raise ValueError(f"{name}: {host_budget} bytes is less than one block of the trace ({block_bytes} bytes); "
                         f"give at least {block_bytes}, or 0 for no host tier")


class _Replay:
    def __init__(self, trace: Trace, eviction: str, device_budget: int, host_budget: Optional[int],
                 prefetch: str, prefetch_depth: int, bw: Bandwidths, pin_reads: bool) -> None:
        self.trace, self.bw, self.pin_reads = trace, bw, pin_reads
        self.size = trace.block_bytes
        check_host_budget(host_budget, self.size, "host_budget")
        self.cap = {DEVICE: device_budget // self.size,
                    HOST: None if host_budget is None else host_budget // self.size}
        self.pol = {tier: self._eviction(eviction, tier) for tier in (DEVICE, HOST)}
        self.pf = make_prefetch(prefetch, **({"depth": prefetch_depth} if prefetch == "lookahead" else {}))
        self.pf_name = prefetch
        self.where: dict = {}  # key -> set of tiers holding a copy
        self.count = {DEVICE: 0, HOST: 0}
        self.hits = {"device": 0, "host": 0, "disk": 0, "miss": 0}
        self.moved = dict.fromkeys(LINKS, 0)
        self.prefetched: dict = {}  # key -> time its device copy lands
        self.pf_stats = {"issued": 0, "used": 0, "late": 0, "unused": 0}
        self.link_free = {"h2d": 0.0, "disk": 0.0}
        self.stall = 0.0
        self.last_read: dict = {}  # layer -> keys it read last
        self.tail: dict = {}  # (seq, layer) -> the block being written

    def _eviction(self, name: str, tier: int):
        """The registered policy ``name`` for ``tier``; a plug-in is called through
        ``CheckedPolicy``: its exception or a victim it may not name stops the replay with a
        ``PolicyError`` naming it, where it would otherwise be an error from inside the replay
        or figures no policy produced."""
        policy = make_eviction(name)
        if not is_plugin(policy):
            return policy
        return CheckedPolicy(policy, name, ("device", "host")[tier],
                             lambda: [key for key, tiers in self.where.items() if tier in tiers])

    def _plan(self, layer: int, reads: list) -> list:
        """The prefetch policy hears what ``layer`` read and names what to bring up next; a
        plug-in's answers are checked as the runtime checks them (``TieredCache._plan_ahead``)."""
        pf, blocks_of = self.pf, self._blocks_of
        if not is_plugin(pf):
            pf.observe(layer, reads)
            return pf.plan(layer, self.trace.num_layers, blocks_of)
        heard = tuple(reads)  # a copy, as the runtime hands it: the replay keeps ``reads``
        plugin_answer("prefetch", self.pf_name, "observe", lambda: pf.observe(layer, heard), lambda _: "")
        return plugin_answer("prefetch", self.pf_name, "plan",
                             lambda: as_plan(pf.plan(layer, self.trace.num_layers, blocks_of)), plan_breach)

    def _blocks_of(self, layer: int) -> list:
        """``blocks_of_layer`` as the runtime answers it (``TieredCache._read_blocks_of``): a
        list of its own, and an IndexError for a layer the model does not have. The replay's
        own list was handed out, and a layer out of range was [] (a review)."""
        if not 0 <= layer < self.trace.num_layers:
            raise IndexError(f"blocks_of_layer({layer}): the model has layers 0 .. {self.trace.num_layers - 1}")
        return list(self.last_read.get(layer, ()))

    # ---- placement ----------------------------------------------------------------------
    def _has(self, key, tier: int) -> bool:
        return tier in self.where.get(key, ())

    def _add(self, key, tier: int) -> None:
        self.where.setdefault(key, set()).add(tier)
        if tier != DISK:
            self.count[tier] += 1
            self.pol[tier].insert(key)

    def _drop(self, key, tier: int) -> None:
        self.where[key].discard(tier)
        if tier != DISK:
            self.count[tier] -= 1
            self.pol[tier].remove(key)
        if tier == DEVICE and self.prefetched.pop(key, None) is not None:
            self.pf_stats["unused"] += 1

    def _room(self, tier: int, protect: set, clean_only: bool = False) -> bool:
        """Free one slot on ``tier``; False when nothing may leave."""
        cap = self.cap[tier]
        if cap is None or self.count[tier] < cap:
            return True
        below = [t for t in (HOST, DISK) if t > tier and (t != HOST or self.cap[HOST] != 0)]

        def evictable(key) -> bool:
            if key in protect or not self._has(key, tier):
                return False
            return not clean_only or any(self._has(key, t) for t in below)

        victims = self.pol[tier].evict(1, evictable)
        if not victims:
            return False
        victim = victims[0]
        if not any(self._has(victim, t) for t in below):  # dirty: demote it one tier down
            dst = below[0]
            if dst == HOST:
                if not self._room(HOST, {victim}):
                    return False
                self.moved["device->host" if tier == DEVICE else "host->disk"] += self.size
            else:
                self.moved["device->disk" if tier == DEVICE else "host->disk"] += self.size
            self._add(victim, dst)
        self._drop(victim, tier)
        return True

    def _transfer_seconds(self, src: int) -> tuple:
        t_h2d = self.size / self.bw.host_to_device
        return (t_h2d, 0.0) if src == HOST else (t_h2d, self.size / self.bw.disk_read)

    def _bring_up(self, key, protect: set, now: float, clean_only: bool) -> Optional[float]:
        """Copy ``key`` to the device from the best lower tier; returns when it lands."""
        src = HOST if self._has(key, HOST) else DISK
        if not self._room(DEVICE, protect, clean_only):
            return None
        t_h2d, t_disk = self._transfer_seconds(src)
        start = now
        if src == DISK:
            if self.cap[HOST] != 0:
                if not self._room(HOST, {key}):
                    return None
                self._add(key, HOST)
                self.moved["disk->host"] += self.size
            start = max(now, self.link_free["disk"]) + t_disk
            self.link_free["disk"] = start
        done = max(start, self.link_free["h2d"]) + t_h2d
        self.link_free["h2d"] = done
        self.moved["host->device" if src == HOST or self.cap[HOST] != 0 else "disk->device"] += self.size
        self._add(key, DEVICE)
        return done

    # ---- one forward of one layer -----------------------------------------------------------
    def update(self, now: float, writes: list, reads: list, scores: dict) -> float:
        protect = set(writes) | set(reads) if self.pin_reads else set()
        for key in writes:
            now = self._access(key, protect, now, write=True)
        written = set(writes)
        for key in reads:
            if key in written and DEVICE in self.where.get(key, ()):  # just written, still there
                self.hits["device"] += 1  # (without pin_reads a later write may have evicted it)
                self.pol[DEVICE].touch(key)
            else:
                now = self._access(key, protect, now, write=False)
        for tier in (DEVICE, HOST):
            if scores and getattr(self.pol[tier], "wants_scores", False):
                self.pol[tier].observe_scores(scores)
        if reads:
            layer = reads[0][1]
            self.last_read[layer] = reads
            self._prefetch(self._plan(layer, reads), protect, now)
        return now

    def _access(self, key, protect: set, now: float, write: bool) -> float:
        tiers = self.where.get(key, set())
        if DEVICE in tiers:
            self.hits["device"] += 1
            self.pol[DEVICE].touch(key)
            landed = self.prefetched.pop(key, None)
            if landed is not None:
                if landed > now:
                    self.pf_stats["late"] += 1
                    self.stall += landed - now
                    now = landed
                else:
                    self.pf_stats["used"] += 1
        elif tiers:
            src = HOST if HOST in tiers else DISK
            self.hits["host" if src == HOST else "disk"] += 1
            done = self._bring_up(key, protect, now, clean_only=False)
            if done is None:
                raise InfeasibleBudget(max(len(protect), 1), self.size)  # the block itself, at least
            # As BlockStore.ensure_device: the block arrives (insert), then the read that
            # fetched it is a use (touch); the host copy it came from is not told. Without
            # the touch, layer-cycle never saw a missed read and fell to 47-68% of Belady's
            # hits on a pure decode scan where the store gets Belady's (a helper's replay).
            self.pol[DEVICE].touch(key)
            self.stall += done - now
            now = done
        else:  # a new block
            self.hits["miss"] += 1
            if not self._room(DEVICE, protect):
                raise InfeasibleBudget(max(len(protect), 1), self.size)  # the block itself, at least
            self._add(key, DEVICE)
        if write:
            self._written(key)
        return now

    def _written(self, key) -> None:
        for tier in (HOST, DISK):
            if self._has(key, tier):
                self._drop(key, tier)
        chain = (key[0], key[1])
        prev = self.tail.get(chain)
        if prev is not None and prev != key and self._has(prev, DEVICE) and not any(
                self._has(prev, t) for t in (HOST, DISK)):
            # the previous tail is sealed: write it behind (as BlockStore.write_behind does)
            if self.cap[HOST] != 0 and self._room(HOST, {prev}, clean_only=True):
                self._add(prev, HOST)
                self.moved["device->host"] += self.size
        self.tail[chain] = key

    def _prefetch(self, plan: list, protect: set, now: float) -> None:
        keep = protect | set(plan)
        for key in plan:
            tiers = self.where.get(key)
            if not tiers or DEVICE in tiers:
                continue
            done = self._bring_up(key, keep, now, clean_only=True)
            if done is None:
                break
            self.prefetched[key] = done
            self.pf_stats["issued"] += 1


def replay(trace: Trace, eviction: str, device_budget: int, *, host_budget: Optional[int] = None,
           prefetch: str = "none", prefetch_depth: int = 2, bandwidths: Bandwidths,
           pin_reads: bool = True) -> dict:
    """Replay ``trace`` with the runtime policy ``eviction`` at ``device_budget`` bytes.

    ``pin_reads`` (the runtime's behaviour) keeps every block of the layer being computed on
    the device until its attention is done, so victims come from other layers; False replays
    the policy alone, request by request, as a plain cache simulator such as libCacheSim does.

    ``host_budget`` None means the host tier holds everything below the device (no disk
    traffic); 0 means no host tier (demotions go to disk). Raises ``InfeasibleBudget`` when
    the device cannot hold one layer's blocks, and ``PolicyError`` naming a plug-in policy
    (one tiercache does not ship) that raised or broke its contract (``CheckedPolicy``).
    """
    sim = _Replay(trace, eviction, device_budget, host_budget, prefetch, prefetch_depth, bandwidths, pin_reads)
    step, layer = trace.step, trace.layer
    cut = np.flatnonzero((np.diff(step) != 0) | (np.diff(layer) != 0)) + 1
    bounds = np.concatenate(([0], cut, [len(trace)]))
    # keys as the runtime names blocks: a plug-in that read ``key.layer`` failed in the lab only
    keys = [BlockKey(*key) for key in zip(trace.seq.tolist(), trace.layer.tolist(), trace.block.tolist())]
    is_write, score, t_us = trace.is_write, trace.score, trace.time_us
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        writes = [keys[i] for i in range(lo, hi) if is_write[i]]
        reads = [keys[i] for i in range(lo, hi) if not is_write[i]]
        scores = {keys[i]: float(score[i]) for i in range(lo, hi) if not is_write[i] and np.isfinite(score[i])}
        sim.update(t_us[lo] / 1e6 + sim.stall, writes, reads, scores)
    # fetched ahead for a read the trace never made: unused, as the runtime's read-ahead
    # dropped when a run ends (left out, issued was more than used, late and unused together)
    sim.pf_stats["unused"] += len(sim.prefetched)
    sim.prefetched.clear()
    requests = len(trace)
    tokens = max(trace.total_tokens, 1)
    moved = sum(sim.moved.values())
    return {
        "policy": eviction, "prefetch": prefetch, "budget_bytes": int(device_budget), "pin_reads": pin_reads,
        "host_budget_bytes": host_budget, "requests": requests,
        "hit_ratio": sim.hits["device"] / max(requests, 1),
        "tier_hit_ratio": {k: v / max(requests, 1) for k, v in sim.hits.items()},
        "bytes_moved": moved,
        "bytes_moved_by_link": {k: v for k, v in sim.moved.items() if v},
        "bytes_per_token": {k: v / tokens for k, v in sim.moved.items() if v},
        "prefetches": dict(sim.pf_stats),
        "est_stall_seconds": sim.stall,
        "compute_seconds": float(t_us[-1] - t_us[0]) / 1e6 if requests else 0.0,
    }
