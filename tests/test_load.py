"""Load: four threads on one cache directory with prompts that share prefixes, and a long
decode whose memory must stay flat."""
from __future__ import annotations

import random
import resource
import threading
import time

import pytest
import torch
import transformers

from tiercache import TierConfig, TieredCache
from tiercache.prefix import close_all

BT = 4


def tiny_model(positions: int = 256):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                   max_position_embeddings=positions, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


GEN = dict(do_sample=False, max_new_tokens=5, output_logits=True, return_dict_in_generate=True)


@pytest.mark.timeout(300)
def test_four_threads_share_one_prefix_cache_without_a_wrong_block(tmp_path):
    """For 20 s, four threads each pick one of three shared 12-token prefixes plus a random
    tail, load what is cached, check every block they were served against DynamicCache's
    recomputed KV, generate, and compare the tokens and logits. No wrong block, no
    exception, no thread left hanging, and prefixes were actually shared."""
    model = tiny_model()
    cfg = TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir=str(tmp_path / "kv"), disk_budget="32MiB",
                     block_tokens=BT)
    prefixes = [torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    deadline = time.monotonic() + 20
    results: list = []
    errors: list = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < deadline:
                tail = torch.randint(1, 64, (1, rng.randrange(1, 14)), generator=torch.Generator().manual_seed(
                    rng.randrange(1 << 30)))
                ids = torch.cat([rng.choice(prefixes), tail], dim=1)
                mask = torch.ones_like(ids)
                with torch.no_grad():
                    ref_cache = transformers.DynamicCache()
                    ref = model.generate(ids, attention_mask=mask, cache=ref_cache, **GEN)
                    with TieredCache(model, cfg) as cache:
                        loaded = cache.load_prefix(ids)
                        # every block served from the prefix cache against the recomputed KV
                        kv_diff = 0.0
                        for layer in range(3):
                            for i in range(loaded // BT):
                                block = cache.store.get(cache._key(layer, i))[:, 0]  # [2, H, BT, D]
                                span = slice(i * BT, (i + 1) * BT)
                                want = torch.stack([ref_cache.layers[layer].keys[0, :, span],
                                                    ref_cache.layers[layer].values[0, :, span]])
                                kv_diff = max(kv_diff, (block - want).abs().max().item())
                        out = model.generate(ids, attention_mask=mask, cache=cache, **GEN)
                diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
                results.append((loaded, torch.equal(ref.sequences, out.sequences), diff, kv_diff))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    close_all()
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=200)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        close_all()
    assert not errors, errors
    assert len(results) >= 8
    # A wrong block would be off by O(1). Blocks match the recomputation to float rounding;
    # logits to 1e-4 (computing only the uncached rest changes the matmul shapes, which moves
    # these large random-model logits by up to ~1e-5).
    bad = [r for r in results if not r[1] or r[2] > 1e-4 or r[3] > 1e-5]
    assert not bad, bad
    assert sum(1 for r in results if r[0] >= 12) >= 3  # shared prefixes were loaded, not recomputed


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.timeout(300)
def test_memory_stays_flat_over_1000_decode_steps(tmp_path):
    """1,000 greedy decode steps with the KV spread over a device tier of one layer and a bit
    (72 blocks of 16 tokens), a 4-slot host tier and disk: resident memory after step 1,000
    is within 16 MiB of what it was at step 200 (the pools are pre-allocated; nothing grows
    per token but the disk file)."""
    model = tiny_model(positions=1100)
    cfg = TierConfig(device_budget="288KiB", host_budget="16KiB", disk_dir=str(tmp_path / "kv"), disk_budget="64MiB",
                     block_tokens=16, reuse=False)
    samples: dict = {}
    with TieredCache(model, cfg) as cache, torch.no_grad():
        def sample(kind: str, fields: dict) -> None:
            if kind == "tokens" and fields["decode"]:
                n = cache.stats()["decode_tokens"]
                if n in (200, 1000):
                    samples[n] = rss_bytes()
        cache.events.add_listener(sample)
        ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(3))
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False, max_new_tokens=1001)
        stats = cache.stats()
    assert stats["decode_tokens"] == 1000 and stats["tiers"]["disk"]["blocks"] > 100
    growth = samples[1000] - samples[200]
    assert growth < 16 << 20, f"RSS grew {growth / 2**20:.1f} MiB between step 200 and 1000"
