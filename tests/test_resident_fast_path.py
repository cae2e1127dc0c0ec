"""The decode fast path of ``TieredCache.update`` (``_update_resident``, ``BlockStore.hold_resident``).

When a layer's blocks are all on the device in adjacent slots and the new tokens fit in its
tail block, ``update`` takes one pass under the store's lock instead of ``ensure_device``,
``begin_write`` and ``read_layer``. The other exactness tests mostly run tiered set-ups on
CPU, where attention reads the host tier and this path is never taken; here every set-up
has no host tier (the device path of ``read_layer``, as on CUDA), so it is taken, and:

- the tokens and logits equal DynamicCache's (every family and generation mode);
- the counters (hits, moves, evictions, stall events, prefetch outcomes, reads as views or
  gathers) and the table's pins and readers equal those of the same run forced onto the
  general path;
- with a device budget that cannot hold everything (device + disk), steps fall back to the
  general path when blocks must move, and the result stays exact.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tiercache  # noqa: E402
from tiercache import TierConfig  # noqa: E402
from tiercache.store import BlockStore  # noqa: E402

from test_hf_exactness import (BT, CHUNK, FAMILIES, GEN, NEW, PAD, PROMPT, assert_same, block_bytes,  # noqa: E402
                               dynamic_cache_supports, generate, prompt_ids, tiny_model)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODES = ["prefill", "chunked", "batch2", "beam", "assisted", "beam+batch2+chunked"]


def _inputs(family: str, mode: str):
    features = set(mode.split("+"))
    ids, mask, batch = prompt_ids(), None, 1
    kwargs = dict(max_new_tokens=NEW)
    if "chunked" in features:
        kwargs["prefill_chunk_size"] = CHUNK
    if "batch2" in features:
        batch = 2
        ids = prompt_ids(batch=2, seed=1)
        mask = torch.ones_like(ids)
        ids[1, :3] = PAD
        mask[1, :3] = 0
    if "beam" in features:
        batch *= 3
        kwargs.update(num_beams=3, num_return_sequences=1, length_penalty=0.0)
    if "assisted" in features:
        kwargs["assistant_model"] = tiny_model(family, assistant=True)
    return ids, mask, batch, kwargs


def _spy_fast(monkeypatch) -> dict:
    """Count hold_resident calls that took the fast path, and those that fell back."""
    counts = {"fast": 0, "general": 0}
    hold = BlockStore.hold_resident

    def spy(self, *args, **kwargs):
        slot = hold(self, *args, **kwargs)
        counts["fast" if slot is not None else "general"] += 1
        return slot
    monkeypatch.setattr(BlockStore, "hold_resident", spy)
    return counts


def _table_state(cache) -> dict:
    """Pins and readers of every block (what the next update or a move would see), by
    (layer, index): the two runs' caches have different sequence ids."""
    store = cache.store
    with store._lock:
        return {(key.layer, key.index): (entry.pins, {tier: (c.slot, c.state, c.readers) for tier, c in entry.copies.items()})
                for key, entry in store.table._blocks.items()}


def _run(model, ids, mask, cfg, kwargs, fast: bool):
    with tiercache.TieredCache(model, cfg) as cache:
        if not fast:
            cache._plain = False  # the general path only
        out = generate(model, ids, cache=cache, mask=mask, **kwargs)
        stats = cache.stats()
        for name in ("stall_seconds",):
            stats.pop(name)
        return out, stats, cache.attention_stats()["reads"] | {"gather_seconds": 0}, _table_state(cache)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_is_exact_and_changes_no_counter(family, mode, monkeypatch):
    reason = dynamic_cache_supports(family, mode)
    if reason:
        pytest.skip(f"DynamicCache cannot run {family}/{mode} either: {reason}")
    model = tiny_model(family)
    ids, mask, batch, kwargs = _inputs(family, mode)
    # Everything fits on the device: no host tier, no disk (bench decode's "fits").
    cfg = TierConfig(device_budget=64 * block_bytes(model, batch), host_budget=0, block_tokens=BT)
    ref = generate(model, ids, mask=mask, **kwargs)
    counts = _spy_fast(monkeypatch)
    out, stats, reads, table = _run(model, ids, mask, cfg, kwargs, fast=True)
    assert_same(ref, out, f"{family}/{mode}")
    assert counts["fast"] > 0, counts
    slow_out, slow_stats, slow_reads, slow_table = _run(model, ids, mask, cfg, kwargs, fast=False)
    assert torch.equal(slow_out.sequences, out.sequences)
    assert stats == slow_stats
    assert reads == slow_reads
    assert table == slow_table


@pytest.mark.parametrize("prefetch", ["next-layer", "none", "lookahead", "history"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_fast_path_falls_back_when_blocks_move(family, prefetch, monkeypatch, tmp_path):
    """Device and disk, no host: the device holds two layers' blocks and one more, so
    blocks move every step; updates whose blocks are resident take the fast path, the
    others the general one, and the output stays exact."""
    model = tiny_model(family)
    ids, new, bt = prompt_ids(length=PROMPT + 8), 2 * NEW, 2 * BT
    layers = model.config.num_hidden_layers
    bb = block_bytes(model, 1, bt)
    per_layer = -(-(ids.shape[1] + new) // bt)  # blocks of one full layer at the end
    rec = 4096 + -(-bb // 4096) * 4096
    cfg = TierConfig(device_budget=(2 * per_layer + 1) * bb, host_budget=0,
                     disk_dir=str(tmp_path / "kv"), disk_budget=4 * layers * per_layer * rec, block_tokens=bt,
                     prefetch=prefetch, io_workers=2, reuse=False)
    ref = generate(model, ids, max_new_tokens=new)
    counts = _spy_fast(monkeypatch)
    with tiercache.TieredCache(model, cfg) as cache:
        out = generate(model, ids, cache=cache, max_new_tokens=new)
        stats = cache.stats()
    assert_same(ref, out, f"{family}/{prefetch}")
    assert stats["evictions"]["device"] > 0, stats["evictions"]
    assert counts["fast"] > 0 and counts["general"] > 0, counts


def test_fast_path_views_move_with_the_slots(monkeypatch):
    """Beam reorders, crops and resets between steps: the layer views kept per slot range
    are rebuilt whenever a layer's blocks sit elsewhere, and K/V equal DynamicCache's."""
    model = tiny_model("llama")
    cfg = TierConfig(device_budget=64 * block_bytes(model, 1), host_budget=0, block_tokens=BT)
    counts = _spy_fast(monkeypatch)
    ref = __import__("transformers").DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(3)
    with tiercache.TieredCache(model, cfg) as cache, torch.no_grad():
        for step, q in enumerate([5, 1, 1, 1, 2, 1, 1, 3, 1, 1, 1, 1, 1]):
            if step == 6:
                cache.crop(-3)
                ref.crop(-3)
            if step == 9:  # a fresh sequence after reset: blocks get new slots
                cache.reset()
                ref = __import__("transformers").DynamicCache(config=model.config)
                q = 6
            for layer in range(model.config.num_hidden_layers):
                k = torch.randn(1, 2, q, 16, generator=g)
                v = torch.randn(1, 2, q, 16, generator=g)
                got = cache.update(k, v, layer)
                want = ref.update(k, v, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (step, layer)
    assert counts["fast"] > 0, counts
