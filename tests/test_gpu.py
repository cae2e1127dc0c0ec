"""CUDA-only paths: pinned host pool, copy streams, exactness on the GPU. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tiercache import BlockKey, TierConfig, Tier
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")]


def test_pinned_host_pool_and_stream_moves_round_trip(tmp_path):
    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=4 * g.padded_bytes,
                     disk_dir=str(tmp_path / "kv"), disk_budget="16MiB", block_tokens=16, device="cuda")
    with BlockStore(cfg, g, device="cuda") as store:
        assert store.host_pool.pinned and store.device_pool.k.is_cuda
        data = {BlockKey(0, 0, i): torch.randn(g.shape, device="cuda") for i in range(12)}
        for k, v in data.items():
            store.put(k, v)
        store.ensure_device(list(data)[:3], pin=False)
        for k, v in data.items():
            assert torch.equal(store.get(k), v.cpu())
        assert store.stats()["moves"]["device->host"]["blocks"] > 0
        store.check()


def test_cuda_generation_matches_dynamic_cache(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiercache import TieredCache
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 128, (1, 40), device="cuda")
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    block = 2 * 2 * 4 * 16 * 4
    tc = TierConfig(device_budget=14 * block, host_budget=6 * 4096, disk_dir=str(tmp_path / "kv"),
                    disk_budget="1MiB", block_tokens=4)
    with TieredCache(model, tc) as cache:
        out = model.generate(ids, cache=cache, **kw)
        stats = cache.stats()
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert stats["moves"].get("host->device", {}).get("blocks", 0) + stats["moves"].get("disk->device", {}).get("blocks", 0) > 0
    assert stats["tiers"][Tier.DISK.label]["blocks"] > 0
