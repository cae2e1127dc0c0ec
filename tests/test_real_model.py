"""Exactness on the default real model (SmolLM2-135M-Instruct), with every tier in use.

Invariant: a ~300-token prompt and 8 greedy new tokens give the same tokens and logits
within 1e-5 (fp32) with a TieredCache as with DynamicCache, while the device tier holds
only one layer's KV (plus one block), the host tier one layer more, and the disk tier the
other 28 layers. The model has 30 layers, 3 KV heads of dim 64: 2 * 3 * 64 * 4 = 1536 bytes
of fp32 KV per token per layer (46 KB per token over all layers).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tiercache
from tiercache import CapacityError, TierConfig

pytestmark = pytest.mark.model

BT = 16  # block_tokens
NEW = 8
PROMPT_TOKENS = 300
ATOL = 1e-5
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 3 * 64 * 4  # K and V, 3 KV heads, head_dim 64, fp32


@pytest.fixture(scope="session")
def real_model():
    """(model, tokenizer) of the default model, loaded once per session (skip if absent)."""
    from tiercache.models import ModelNotFoundError, load_model

    try:
        model, tokenizer = load_model(device="cpu")
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    model.requires_grad_(False)
    return model, tokenizer


def _prompt(tokenizer, num_tokens: int) -> torch.Tensor:
    text = ("The tiered cache keeps recent blocks of keys and values in fast memory, demotes older "
            "blocks to host memory and then to files on disk, and brings them back just before "
            "attention reads them. ")
    ids = tokenizer(text * 20, return_tensors="pt").input_ids[:, :num_tokens]
    assert ids.shape[-1] == num_tokens
    return ids


def _generate(model, ids, cache=None):
    kwargs = {"cache": cache} if cache is not None else {}
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)


def test_real_model_matches_dynamic_cache(real_model, tmp_path):
    """~300-token prompt, 8 new tokens, block_tokens=16: device = one layer's blocks + 1,
    host = as many slots, disk = the rest. Same tokens as DynamicCache, logits within 1e-5
    at every step, and blocks moved through host and disk and were read back from disk."""
    model, tokenizer = real_model
    cfg_model = model.config
    assert (cfg_model.num_hidden_layers, cfg_model.num_key_value_heads) == (30, 3)
    assert getattr(cfg_model, "head_dim", None) in (None, 64)
    ids = _prompt(tokenizer, PROMPT_TOKENS)
    ref = _generate(model, ids)

    block_bytes = BT * KV_BYTES_PER_TOKEN_PER_LAYER  # 24 KiB, already a multiple of 4096
    layer_blocks = math.ceil((PROMPT_TOKENS + NEW - 1) / BT)  # blocks one layer reads at the last step
    total_blocks = layer_blocks * cfg_model.num_hidden_layers
    device_blocks = layer_blocks + 1
    host_blocks = layer_blocks + 1
    disk_record = 4096 + block_bytes
    cfg = tiercache.TierConfig(
        device_budget=device_blocks * block_bytes, host_budget=host_blocks * block_bytes,
        disk_budget=(total_blocks + 16) * disk_record, disk_dir=str(tmp_path / "kv"), block_tokens=BT)
    with tiercache.TieredCache(model, cfg) as cache:
        out = _generate(model, ids, cache=cache)
        stats = cache.stats()
        assert cache.store.geometry.block_bytes == block_bytes

    assert torch.equal(ref.sequences, out.sequences), (ref.sequences[0, -NEW:], out.sequences[0, -NEW:])
    assert len(out.logits) == NEW
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff <= ATOL, f"max abs logit difference {diff:.3g} > {ATOL}"

    tiers = stats["tiers"]
    assert tiers["device"]["blocks"] <= device_blocks
    assert tiers["disk"]["blocks"] >= total_blocks - device_blocks - host_blocks  # the bulk lives on disk
    moves = {name: m["blocks"] for name, m in stats["moves"].items()}
    assert moves.get("device->host", 0) > 0, moves  # demoted to host ...
    assert moves.get("host->disk", 0) + moves.get("device->disk", 0) > 0, moves  # ... and on to disk
    # ... and read back. (Hits per tier depend on the policy and on timing: a read that a
    # prefetch served in time counts where it landed. Reads from disk cannot be zero.)
    assert moves.get("disk->device", 0) + moves.get("disk->host", 0) > 0, moves
    assert tiers["host"]["blocks"] > 0
    assert stats["prefill_tokens"] == PROMPT_TOKENS and stats["decode_tokens"] == NEW - 1


def test_real_model_attending_in_place_matches_dynamic_cache(real_model, tmp_path):
    """The same run with ``attend_in_place``: decode attention reads each block where it
    lies (device run, host slot; disk blocks read into attention's buffer). Same tokens as
    DynamicCache, logits within float rounding of SDPA's (1e-4; a wrong block or order moves
    them by far more), and every layer of every decode step attended in place but the first
one (layer 0 of the first decode step gathers, and shows that the hook sees the keys)."""
    model, tokenizer = real_model
    ids = _prompt(tokenizer, PROMPT_TOKENS)
    ref = _generate(model, ids)
    block_bytes = BT * KV_BYTES_PER_TOKEN_PER_LAYER
    layer_blocks = math.ceil((PROMPT_TOKENS + NEW - 1) / BT)
    cfg = tiercache.TierConfig(
        device_budget=(layer_blocks + 1) * block_bytes, host_budget=(layer_blocks + 1) * block_bytes,
        disk_budget=(layer_blocks * 30 + 16) * (4096 + block_bytes), disk_dir=str(tmp_path / "kv"),
        block_tokens=BT, attend_in_place=True)
    with tiercache.TieredCache(model, cfg) as cache:
        out = _generate(model, ids, cache=cache)
        stats, steps = cache.stats(), cache.attention_stats()["in_place_layer_steps"]
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences[0, -NEW:], out.sequences[0, -NEW:])
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff <= 1e-4, f"max abs logit difference {diff:.3g}"
    assert steps == 30 * (NEW - 1) - 1, steps  # 7 decode steps of 30 layers; layer 0 of the first probes the hook
    assert stats["moves"]["disk->device"]["blocks"] > 0, stats["moves"]  # read back from disk ...
    assert "disk->host" not in stats["moves"], stats["moves"]  # ... taking no host slot


def test_real_model_prefix_reuse_matches_a_cold_run(real_model, tmp_path):
    """The default model: a second request with the same ~300-token prompt loads 18 full
    16-token blocks (288 tokens) from the prefix cache, computes the last 12, and gives the
    same tokens as DynamicCache with logits within 1e-5 at every step; a third request in a
    fresh prefix-cache session (closed and reopened from disk) does the same.

    A warm run loads the KV of 288 tokens that the cold run computed in its one 300-token
    prefill, then computes the last 12 over them. Its reference is DynamicCache given just
    that: the 300-token prefill's KV cropped to 288 tokens, then the same generate. (Other
    matmul shapes round differently: DynamicCache itself gave logits 2.5e-5 apart between
    one 300-token prefill and 288 + 12 on an AVX512 machine, 2026-12-05; on an AMD EPYC,
    2026-12-06, the warm runs were 3.4e-5 from that split reference.) The cold run is held
    to the one-shot reference."""
    import transformers

    from tiercache.prefix import close_all

    model, tokenizer = real_model
    ids = _prompt(tokenizer, PROMPT_TOKENS)
    ref = _generate(model, ids, cache=transformers.DynamicCache())
    cropped = transformers.DynamicCache()
    with torch.no_grad():
        model(ids, cache=cropped, use_cache=True)
    cropped.crop(-(PROMPT_TOKENS - 288))
    ref_warm = _generate(model, ids, cache=cropped)
    assert torch.equal(ref.sequences, ref_warm.sequences)
    cfg = tiercache.TierConfig(device_budget="8MiB", host_budget="8MiB", disk_dir=str(tmp_path / "kv"),
                               disk_budget="256MiB", block_tokens=BT)
    close_all()
    try:
        for run in ("cold", "warm from host", "warm from disk"):
            if run == "warm from disk":
                close_all()
            with tiercache.TieredCache(model, cfg) as cache:
                loaded = cache.load_prefix(ids)
                out = _generate(model, ids, cache=cache)
                stats = cache.stats()
            assert loaded == (0 if run == "cold" else 288), run
            assert stats["prefill_tokens"] == PROMPT_TOKENS - loaded, run
            assert torch.equal(ref.sequences, out.sequences), run
            against = ref if run == "cold" else ref_warm
            diff = max((a - b).abs().max().item() for a, b in zip(against.logits, out.logits))
            assert diff <= ATOL, f"{run}: max abs logit difference {diff:.3g}"
    finally:
        close_all()


def test_generate_text_refuses_a_device_budget_under_the_prompts_need_before_the_run(real_model, tmp_path):
    """``tiercache generate``'s body checks the budget before the prefill: the error states
    the minimum for the whole prompt (and with the new tokens), and a run at that minimum
    goes through (a 5k-token prompt in chunks failed chunk after chunk, each error asking for
    a little more)."""
    import re

    from tiercache.generation import generate_text

    model, tokenizer = real_model
    prompt = "The tiered cache keeps recent blocks in fast memory. " * 12
    cfg = TierConfig(device_budget="64KiB", host_budget="4MiB", disk_dir=str(tmp_path / "kv"), disk_budget="64MiB",
                     block_tokens=16)
    with pytest.raises(CapacityError, match=r"this prompt of \d+ tokens: minimum device_budget = \d+ bytes") as info:
        generate_text(prompt, cfg, model=model, tokenizer=tokenizer, max_new_tokens=4, chat=False, prefill_chunk=32,
                      progress=False)
    need, whole = map(int, re.findall(r"(\d+) bytes", str(info.value)))
    assert 0 < need <= whole
    run = generate_text(prompt, dataclasses.replace(cfg, device_budget=whole), model=model, tokenizer=tokenizer,
                        max_new_tokens=4, chat=False, prefill_chunk=32, progress=False)
    assert len(run["new_token_ids"]) == 4
