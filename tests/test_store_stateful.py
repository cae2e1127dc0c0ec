"""A stateful property test: random put / get / pin / unpin / promote / demote / delete /
prefetch across all three tiers with tiny budgets. After every step: every read returns
exactly the bytes written, no tier is over budget, and the table is consistent (nothing in
flight was freed or handed out twice)."""
from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiercache import BlockKey, CapacityError, Tier, TierConfig
from tiercache.disk import DiskTier
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry

GEOMETRY = BlockGeometry(batch=1, kv_heads=1, block_tokens=2, head_dim=4, dtype=torch.float32)
KEYS = st.integers(min_value=0, max_value=11).map(lambda i: BlockKey(0, 0, i))


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tiercache-hyp-")
        g = GEOMETRY
        cfg = TierConfig(device_budget=3 * g.block_bytes, host_budget=2 * g.padded_bytes,
                         disk_budget=6 * DiskTier.record_size(g), disk_dir=self.dir + "/kv",
                         block_tokens=g.block_tokens, io_workers=2)
        self.store = BlockStore(cfg, g)
        self.model: dict = {}
        self.pins: dict = {}
        self.futures: list = []
        self.views: list = []  # (keys, K, V, expected K, expected V) of the last read with hold=True
        self.counter = 0

    def teardown(self) -> None:
        # A persistent store keeps what its 6 disk records hold: more live blocks than that,
        # and close() says exactly how many it could not keep (it kept them silently lost).
        live = len(self.store)
        try:
            self.store.close()
        except CapacityError as exc:
            assert live > 6 and f"close: {live - 6} of {live} blocks are not kept" in str(exc), str(exc)
        else:
            assert live <= 6
        shutil.rmtree(self.dir, ignore_errors=True)

    def _block(self) -> torch.Tensor:
        self.counter += 1
        return torch.full(GEOMETRY.shape, float(self.counter)) + torch.arange(GEOMETRY.shape[-1])

    @rule(key=KEYS)
    def put(self, key):
        if key in self.model:
            return
        block = self._block()
        try:
            self.store.put(key, block)
        except CapacityError as exc:
            held = sum(len(v[0]) for v in self.views)  # held blocks: not evictable, maybe deleted
            pinned = sum(1 for k in self.pins if self.pins[k])
            if "no device slot for 1 new block(s): 0 of 3 free" in str(exc):  # stuck, not full
                assert pinned + held >= 3, str(exc)
            else:
                assert len(self.model) >= 3 + 2 + 6 - pinned - 3 - 2 * held, str(exc)
            return
        self.model[key] = block

    @rule(key=KEYS)
    def get(self, key):
        if key not in self.model:
            with pytest.raises(KeyError):
                self.store.get(key)
            return
        assert torch.equal(self.store.get(key), self.model[key])

    @precondition(lambda self: sum(self.pins.values()) < 2)
    @rule(key=KEYS)
    def pin_on_device(self, key):
        if key not in self.model:
            return
        try:
            self.store.ensure_device([key], pin=True)
        except CapacityError:
            return
        self.pins[key] = self.pins.get(key, 0) + 1
        assert self.store.table.is_ready(key, Tier.DEVICE)

    @rule(key=KEYS)
    def unpin(self, key):
        if self.pins.get(key):
            self.store.unpin([key])
            self.pins[key] -= 1

    @rule(key=KEYS, tier=st.sampled_from([Tier.HOST, Tier.DEVICE]))
    def promote(self, key, tier):
        if key in self.model:
            self.futures.append(self.store.promote(key, tier))

    @rule(key=KEYS)
    def demote(self, key):
        if key in self.model:
            self.futures.append(self.store.demote(key))

    @rule(key=KEYS)
    def prefetch(self, key):
        self.store.prefetch([key])

    @rule(key=KEYS)
    def delete(self, key):
        if key in self.model and not self.pins.get(key):
            self.store.delete(key)
            del self.model[key]

    @rule(first=KEYS, n=st.integers(min_value=1, max_value=2))
    def read_held(self, first, n):
        """read_layer(hold=True): the K/V (views of the device pool when the blocks sit in
        adjacent device slots) hold exactly the blocks' bytes until release_views or the
        next such read."""
        keys = [BlockKey(0, 0, first.index + i) for i in range(n)]
        if any(k not in self.model for k in keys):
            return
        self.views.clear()  # the read lets the previous one go
        t = GEOMETRY.block_tokens
        try:
            k, v = self.store.read_layer(keys, n * t - 1, 1, hold=True)
        except CapacityError:
            return
        want_k = torch.cat([self.model[key][0] for key in keys], dim=-2)[:, :, 1:]
        want_v = torch.cat([self.model[key][1] for key in keys], dim=-2)[:, :, 1:]
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        self.views.append((keys, k, v, want_k, want_v))

    @rule()
    def release_views(self):
        self.store.release_views()
        self.views.clear()

    @rule()
    def settle(self):
        for f in self.futures:
            try:
                f.result(timeout=30)
            except CapacityError:
                pass
        self.futures.clear()
        self.store.wait_idle()

    @invariant()
    def consistent_and_within_budget(self):
        self.store.check()
        for _, k, v, want_k, want_v in self.views:  # nothing held was freed or overwritten
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert len(self.store) == len(self.model)
        for key, n in self.pins.items():
            if n:
                assert self.store.table.is_ready(key, Tier.DEVICE), f"pinned {key} left the device"


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_store_state_machine = StoreMachine.TestCase
