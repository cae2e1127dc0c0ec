"""The persistent prefix cache: prompts that share whole blocks load them instead of
computing them, across caches and processes, exactly, and never from another prompt, model
or a damaged record."""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import transformers

import tiercache
from tiercache import CacheDirError, TierConfig, TieredCache
from tiercache.cache_admin import describe, prefix_dirs
from tiercache.prefix import INDEX_NAME, close_all

from conftest import fixed_tokenizer, in_a_forked_child

BT = 4
PROMPT = 30
NEW = 6


def tiny_model(seed: int = 0, family: str = "llama", dtype=torch.float32):
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=256, eos_token_id=None,
                  pad_token_id=0)
    if family == "mistral":
        cfg = transformers.MistralConfig(sliding_window=6, **common)
    else:
        cfg = transformers.LlamaConfig(**common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt(seed: int = 1, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(1, 64, (1, length), generator=torch.Generator().manual_seed(seed))


def config(tmp_path, **kw) -> TierConfig:
    return TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir=str(tmp_path / "kv"), disk_budget="16MiB",
                      block_tokens=BT, **kw)


GEN = dict(do_sample=False, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)


def run(model, ids, cfg):
    """One request with its own TieredCache; returns (output, stats)."""
    with TieredCache(model, cfg) as cache, torch.no_grad():
        loaded = cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        stats = cache.stats()
    assert stats["reused_tokens"] == loaded
    return out, stats


def reference(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=transformers.DynamicCache(), **GEN)


def assert_same(ref, out) -> None:
    assert torch.equal(ref.sequences, out.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff <= 1e-5, diff


@pytest.fixture(autouse=True)
def _fresh_registry():
    close_all()
    yield
    close_all()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_warm_request_loads_the_prefix_and_computes_only_the_rest(tmp_path, family):
    """The first request computes all 30 prompt tokens and publishes every full block; the
    second loads the 7 full blocks before the last prompt token (28 tokens) and computes 2.
    Both match DynamicCache's logits; with the sliding-window family too."""
    model, ids = tiny_model(family=family), prompt()
    ref = reference(model, ids)
    cold, s1 = run(model, ids, config(tmp_path))
    assert_same(ref, cold)
    assert s1["prefill_tokens"] == PROMPT and s1["reused_tokens"] == 0
    assert s1["published_blocks"] == ((PROMPT + NEW - 1) // BT) * 3  # full blocks x layers
    warm, s2 = run(model, ids, config(tmp_path))
    assert_same(ref, warm)
    assert s2["reused_tokens"] == 28 and s2["prefill_tokens"] == PROMPT - 28
    assert s2["published_blocks"] == 0  # nothing new: the answer's blocks were stored by run 1


def test_attend_in_place_with_no_prefix_host_tier_still_reuses(tmp_path, caplog):
    """The prefix cache's own store copied the user's config with ``reuse_host_budget`` as
    its host tier; with ``attend_in_place=True`` and ``reuse_host_budget=0`` that copy was
    refused (in-place attention with no host tier to read) and the prefix cache went off
    for the run with a warning that named the wrong budget. Attention never reads that
    store, so its copy now has attend_in_place off: the second request loads its prefix."""
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path, attend_in_place=True, reuse_host_budget=0)
    first, _ = run(model, ids, cfg)
    with caplog.at_level("WARNING", logger="tiercache"):
        second, stats = run(model, ids, cfg)
    assert stats["reused_tokens"] == 28 and stats["prefill_tokens"] == PROMPT - 28
    assert "prefix cache off" not in caplog.text
    assert torch.equal(first.sequences, second.sequences)


def test_a_model_whose_kv_are_not_one_per_input_id_publishes_nothing(tmp_path, caplog):
    """CPM-Ant prepends 32 prompt positions to the K/V of its input ids, and names its head
    size ``dim_head`` (its config's usual fields say 16 dims where its K/V have 32).
    - One cache over two requests (``reset()``, then ``load_prefix``): the first published
      blocks named by ids whose K/V they did not hold, and the second loaded them: wrong
      tokens. K/V that do not line up with the ids are now never published.
    - ``wrap()``: its prefix cache, opened with the config's shape, refused every publish
      with ``ValueError: block shape ... != ...``, failing generate(). It is now off for
      that call, with a warning that says why.
    Every call matches DynamicCache."""
    torch.manual_seed(0)
    cfg = transformers.CpmAntConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    dim_head=32, dim_ff=128, init_std=0.2, pad_token_id=0, eos_token_id=None)
    model = transformers.CpmAntForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = prompt()
    ref = reference(model, ids)
    tiers = TierConfig(device_budget="72KiB", host_budget="32KiB", disk_budget="16MiB", disk_dir=str(tmp_path / "kv"),
                       block_tokens=BT)
    with TieredCache(model, tiers) as cache, torch.no_grad():
        assert_same(ref, model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN))
        assert cache.stats()["published_blocks"] == 0
        cache.reset()
        assert cache.load_prefix(ids) == 0
        assert_same(ref, model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN))
    close_all()
    wrapped = tiercache.wrap(model, tiers)
    for _ in range(2):
        with torch.no_grad():
            assert_same(ref, wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN))
        assert wrapped.tiercache_last.stats()["reused_tokens"] == 0
    assert "prefix cache off for this run: the model's K/V are 4 heads x 32 dims" in caplog.text


def test_generate_refuses_a_prompt_that_is_not_the_one_loaded(tmp_path):
    """``cache.load_prefix(A)`` then ``model.generate(B, cache=cache)``: generate() computes
    only what follows the cache's length, so B's tail ran on A's KV and came out as wrong
    tokens, silently; a prompt shorter than the loaded part was a reshape RuntimeError from
    inside the model. Now generate() refuses both with a ValueError that says what was
    loaded and how the prompt differs, before any forward: the cache is untouched, so the
    right prompt then runs exact on it. The model's hooks (on an unwrapped model) go with
    the check."""
    model, a = tiny_model(), prompt()
    b = a.clone()
    b[0, 5] = (b[0, 5] % 63) + 1  # differs from A at token 5, inside the loaded blocks
    run(model, a, config(tmp_path))  # publishes A's blocks
    ref = reference(model, a)
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        assert "_prefill" in vars(model)  # held for the check
        with pytest.raises(ValueError, match=r"differ from them at token 5 \(\d+ != \d+\)"):
            model.generate(b, attention_mask=torch.ones_like(b), cache=cache, **GEN)
        short = a[:, :10]
        with pytest.raises(ValueError, match="first 28 tokens .* given input_ids of 10 tokens"):
            model.generate(short, attention_mask=torch.ones_like(short), cache=cache, **GEN)
        with pytest.raises(ValueError, match="given input_ids of 28 tokens"):  # nothing left to compute
            model.generate(a[:, :28], attention_mask=torch.ones_like(a[:, :28]), cache=cache, **GEN)
        assert cache.get_seq_length() == 28
        out = model.generate(a, attention_mask=torch.ones_like(a), cache=cache, **GEN)
        assert cache.stats()["reused_tokens"] == 28
        assert "_prefill" not in vars(model)  # checked: the hooks went
    assert_same(ref, out)
    # reset() forgets the loaded prefix: any prompt then goes, computed whole
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        cache.reset()
        assert "_prefill" not in vars(model)
        assert_same(reference(model, b), model.generate(b, attention_mask=torch.ones_like(b), cache=cache, **GEN))
    # a cache closed without a generate() lets go of the hooks too
    cache = TieredCache(model, config(tmp_path))
    assert cache.load_prefix(a) == 28
    cache.close()
    assert "_prefill" not in vars(model)
    # and one dropped unclosed, at its collection: noted there (it may run inside the lock
    # that counts the holds), let go at the next hold or release
    cache = TieredCache(model, config(tmp_path))
    assert cache.load_prefix(a) == 28
    del cache
    gc.collect()
    with TieredCache(model, config(tmp_path)) as cache:
        assert cache.load_prefix(a) == 28
        cache.reset()
    assert "_prefill" not in vars(model)


def test_generate_refuses_a_mode_that_does_not_continue_from_the_loaded_prefix(tmp_path):
    """``cache.load_prefix(A)`` then ``generate(A, cache=cache)`` with prompt lookup or a draft
    model: assisted generation feeds the whole prompt again on top of the loaded KV, so the
    cache ended 28 tokens too long and the logits were 7.5 off a fresh run, with no error (a
    review; a DynamicCache filled by hand is as wrong, but the loaded prefix is tiercache's
    to guard). Beams expand the rows. Each is refused by name before any forward, the cache
    untouched; a greedy generate() then runs on it, exact."""
    model, a = tiny_model(), prompt()
    run(model, a, config(tmp_path))  # publishes A's blocks
    ref = reference(model, a)
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        for mode, kw in (("assisted_generation", dict(prompt_lookup_num_tokens=2)),
                         ("assisted_generation", dict(assistant_model=tiny_model(seed=5))),
                         ("beam_search", dict(num_beams=2))):
            with pytest.raises(ValueError, match=rf"first 28 tokens .* load_prefix\(\), and generate\(\) in mode "
                                                 rf"'{mode}' does not continue from a cache's past"):
                model.generate(a, attention_mask=torch.ones_like(a), cache=cache, **GEN, **kw)
            assert cache.get_seq_length() == 28
        out = model.generate(a, attention_mask=torch.ones_like(a), cache=cache, **GEN)
        assert cache.stats()["reused_tokens"] == 28
    assert_same(ref, out)


def test_a_loaded_prefix_continues_with_the_forms_transformers_takes_for_a_past(tmp_path):
    """After ``load_prefix(A)``, transformers takes two more forms of the prompt for a cache
    that holds a past: only the new ids under an attention mask of the whole length, and
    ``inputs_embeds`` of the whole prompt. The prompt check of load_prefix refused both
    (a review found it: both had been exact); they pass again, exact. A mask whose extra
    length is not what was loaded is refused, as are embeddings no longer than it."""
    model, a = tiny_model(), prompt()
    run(model, a, config(tmp_path))
    ref = reference(model, a)
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        tail = model.generate(a[:, 28:], attention_mask=torch.ones_like(a), cache=cache, **GEN)
    # generate() returns what it was given and the new ids: the same new ids, the same logits
    assert torch.equal(tail.sequences[:, -NEW:], ref.sequences[:, -NEW:])
    assert max((x - y).abs().max().item() for x, y in zip(ref.logits, tail.logits)) <= 1e-5
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        with pytest.raises(ValueError, match="under an attention mask of 30, that is after a past of 27 tokens, not 28"):
            model.generate(a[:, 27:], attention_mask=torch.ones_like(a), cache=cache, **GEN)
        embeds = model.get_input_embeddings()(a)
        with pytest.raises(ValueError, match="inputs_embeds of 28 tokens"):
            model.generate(inputs_embeds=embeds[:, :28], cache=cache, **GEN)
        out = model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(a), cache=cache, **GEN)
    assert torch.equal(out.sequences[:, -NEW:], ref.sequences[:, -NEW:])
    assert max((x - y).abs().max().item() for x, y in zip(ref.logits, out.logits)) <= 1e-5
    # BLOOM's forward takes no position_ids, and transformers drops a mask of ones before the
    # prefill, keeping only its length: the check read no length there and refused the tail
    torch.manual_seed(0)
    bloom = transformers.AutoModelForCausalLM.from_config(transformers.BloomConfig(
        vocab_size=64, hidden_size=64, n_layer=2, n_head=4, pad_token_id=0, eos_token_id=None,
        initializer_range=0.2)).eval()
    bloom.generation_config.eos_token_id = None
    bloom.generation_config.pad_token_id = 0
    cfg = config(tmp_path / "bloom")
    run(bloom, a, cfg)
    ref = reference(bloom, a)
    with TieredCache(bloom, cfg) as cache, torch.no_grad():
        assert cache.load_prefix(a) == 28
        tail = bloom.generate(a[:, 28:], attention_mask=torch.ones_like(a), cache=cache, **GEN)
    assert torch.equal(tail.sequences[:, -NEW:], ref.sequences[:, -NEW:])
    assert max((x - y).abs().max().item() for x, y in zip(ref.logits, tail.logits)) <= 1e-5


def test_a_longer_prompt_reuses_the_shared_part_only(tmp_path):
    """A second prompt that shares the first 16 tokens then differs: the 4 shared blocks are
    loaded, the rest computed; a prompt that differs in its first token loads nothing."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    other = prompt(seed=9, length=40)
    other[0, :16] = ids[0, :16]
    out, stats = run(model, other, config(tmp_path))
    assert_same(reference(model, other), out)
    assert stats["reused_tokens"] == 16
    first_differs = ids.clone()
    first_differs[0, 0] = (first_differs[0, 0] % 63) + 1
    _, stats = run(model, first_differs, config(tmp_path))
    assert stats["reused_tokens"] == 0


def test_the_prefix_survives_the_process(tmp_path):
    """A fresh process on the same directory loads the prefix from disk (the index and the
    records persisted) and produces the same tokens and logits as a cold run."""
    model, ids = tiny_model(), prompt()
    cold, _ = run(model, ids, config(tmp_path))
    close_all()
    torch.save({"state": model.state_dict(), "ids": ids}, tmp_path / "model.pt")
    script = textwrap.dedent(f"""
        import json, torch, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_prefix import tiny_model, config, run
        import pathlib
        saved = torch.load({str(tmp_path / "model.pt")!r})
        model = tiny_model(); model.load_state_dict(saved["state"])
        out, stats = run(model, saved["ids"], config(pathlib.Path({str(tmp_path)!r})))
        torch.save(out.logits, {str(tmp_path / "warm.pt")!r})
        print(json.dumps({{"reused": stats["reused_tokens"], "prefill": stats["prefill_tokens"],
                          "seq": out.sequences.tolist()}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["reused"] == 28 and got["prefill"] == 2
    assert got["seq"] == cold.sequences.tolist()
    warm_logits = torch.load(tmp_path / "warm.pt")
    assert max((a - b).abs().max().item() for a, b in zip(cold.logits, warm_logits)) <= 1e-5


def test_a_run_with_the_attention_hook_meets_the_plain_runs_prefixes(tmp_path):
    """The attention hook (installed for a trace, attention-score eviction, selection,
    retention) marks the model's config with ``_tiercache_inner_attention``, which went into
    the model's digest: such a run published under another name and reused nothing of the
    plain runs' prefixes, nor they of its (`tiercache generate --trace-out` then without)."""
    from tiercache.attention import install
    from tiercache.prefix import model_digest

    model, ids = tiny_model(), prompt()
    plain = model_digest(model, torch.float32)
    ref = reference(model, ids)
    run(model, ids, config(tmp_path))  # publishes under the plain name
    install(model)
    assert model.config._tiercache_inner_attention == "sdpa"
    assert model_digest(model, torch.float32) == plain
    out, stats = run(model, ids, config(tmp_path, eviction="attention-score"))  # a hooked run
    assert stats["reused_tokens"] == 28
    assert_same(ref, out)
    # Nested configs (multimodal models) keep their own _name_or_path, as before: dropping it
    # renamed every plain run of those models, orphaning their prefix caches (a review).
    from tiercache.prefix import _naming_fields

    assert _naming_fields({"_name_or_path": "/a", "x": 1, "text_config": {
        "_name_or_path": "", "_tiercache_inner_attention": "sdpa", "id2label": {0: "A"}}}) == {
        "x": 1, "text_config": {"_name_or_path": "", "id2label": {0: "A"}}}


def test_another_model_or_dtype_never_hits(tmp_path):
    """Blocks are salted with the model digest: other weights, or the same weights in
    bfloat16, find nothing (and each gets its own directory)."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    _, stats = run(tiny_model(seed=5), ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    _, stats = run(tiny_model(dtype=torch.bfloat16), ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert len(os.listdir(tmp_path / "kv" / "prefix")) == 3


def test_a_model_that_differs_in_a_few_weights_never_hits(tmp_path):
    """The digest named a model by a sample of each weight (192 elements): a model with a
    few embedding rows retrained (what fine-tuning new tokens with the rest frozen gives)
    kept the digest and was served the first model's KV, silently other tokens. Now every
    byte counts: a copy with 20 embedding rows changed finds nothing, and so does the same
    model object once trained in place (its digest is kept only while no weight changed);
    its tokens are then its own (DynamicCache's)."""
    import copy

    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    other = copy.deepcopy(model)
    with torch.no_grad():
        rows = ids[0, :20].unique()
        other.model.embed_tokens.weight[rows] = torch.randn(len(rows), other.config.hidden_size)
    out, stats = run(other, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(other, ids), out)
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] > 0  # the first model still finds its own
    with torch.no_grad():  # trained in place: the same object, other weights
        model.model.layers[0].self_attn.v_proj.weight[3, 5] += 0.5
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)


def test_weights_changed_through_data_are_named_again(tmp_path):
    """``p.data`` edits do not move torch's version counter, so the kept digest stayed and
    the changed model was served its old weights' KV (silently wrong tokens). A merged
    adapter (a low-rank update added to whole matrices, as PEFT's merge does through
    ``.data``) and weights scaled in place are now seen: nothing reused, tokens exact."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] > 0
    proj = model.model.layers[1].self_attn.v_proj.weight
    lora_a, lora_b = torch.randn(4, proj.shape[1]), torch.randn(proj.shape[0], 4)
    proj.data += 0.05 * lora_b @ lora_a  # merged into one matrix of one layer
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)
    for p in model.parameters():
        p.data.mul_(1.05)
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] > 0
    # every column but 0, 32 and 63 of one matrix: where a sample strided by numel // 64 fell
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    assert k_proj.shape[1] == 64
    others = [c for c in range(64) if c not in (0, 32, 63)]
    k_proj.data[:, others] *= 3.0
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)


def test_a_config_changed_in_place_is_named_again(tmp_path):
    """The model's name covers its config, but it was kept per model object while no
    weight changed: Mistral's ``sliding_window`` (read at every forward) set from 64 to 6 in
    place kept the old name, and the next request was served 28 tokens of KV computed under
    the old window: other tokens than a cold run, logits 7.07 apart (a review). The config
    is part of what is kept now: nothing reused, tokens exact; the same config again hits."""
    model, ids = tiny_model(family="mistral"), prompt()
    model.config.sliding_window = 64
    run(model, ids, config(tmp_path))
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] > 0
    model.config.sliding_window = 6
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] > 0


def test_weights_offloaded_to_the_meta_device_turn_reuse_off(tmp_path):
    """accelerate leaves offloaded weights on the meta device. They named nothing, so two
    models that differed only there shared a digest, and the second was served the first's
    KV (wrong tokens); a prefix load into a model fully offloaded failed deep in SDPA (keys
    on meta). Such a model now runs without the prefix cache (``reuse=None``) or is refused
    (``reuse=True``), and stays exact."""
    import accelerate

    import copy

    ids = prompt()
    models = [tiny_model()]
    models.append(copy.deepcopy(models[0]))
    with torch.no_grad():  # the second differs only in what will be offloaded
        models[1].model.layers[0].mlp.up_proj.weight.mul_(2.0)
    refs = [reference(m, ids) for m in models]
    offload = tmp_path / "offload"
    for i, m in enumerate(models):  # the decoder layers offloaded to disk, the rest on the CPU
        device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                      "model.rotary_emb": "cpu", "lm_head": "cpu"}
        accelerate.dispatch_model(m, device_map=device_map, offload_dir=str(offload / str(i)))
        assert any(p.device.type == "meta" for p in m.parameters())
    runs = [(i, *run(m, ids, config(tmp_path))) for i, m in enumerate(models) for _ in range(2)]
    for i, out, _ in runs:
        assert_same(refs[i], out)
    assert all(stats["reused_tokens"] == 0 and stats["published_blocks"] == 0 for _, _, stats in runs)
    with pytest.raises(tiercache.UnsupportedModelError, match="cannot name weights on the meta device"):
        TieredCache(models[0], config(tmp_path, reuse=True))


def test_the_device_hash_changes_with_any_word_and_only_then():
    """tensor_fingerprint's GPU path (linear_hash), run here on CPU: equal bytes give equal
    hashes; changing any one 32-bit word (first, last, in between, or a byte of a length
    that is not a multiple of 4) changes it."""
    from tiercache.prefix import linear_hash

    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (4 * 1000 + 3,), dtype=torch.uint8, generator=g)
    base = linear_hash(data)
    assert linear_hash(data.clone()) == base and len(base) == 8
    for at in (0, 1, 2, 3, 1999, 2000, 4000, 4002):
        changed = data.clone()
        changed[at] ^= 0x5A
        assert linear_hash(changed) != base, at


def prefix_dir(tmp_path) -> str:
    (name,) = os.listdir(tmp_path / "kv" / "prefix")
    return str(tmp_path / "kv" / "prefix" / name)


def test_a_hash_collision_cannot_return_another_prompts_kv(tmp_path):
    """Make the index claim that a stored block holds other tokens (what a hash collision
    would look like): the token-id comparison refuses it, nothing is loaded, and the
    output is still exact."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    close_all()
    db = sqlite3.connect(os.path.join(prefix_dir(tmp_path), INDEX_NAME))
    (h, tokens) = db.execute("SELECT h, tokens FROM blocks WHERE idx = 0").fetchone()
    db.execute("UPDATE blocks SET tokens = ? WHERE h = ?", (bytes(len(tokens)), h))
    db.commit()
    db.close()
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)


@pytest.mark.parametrize("damage", ["delete", "garbage", "a directory", "an older schema", "text layers",
                                    "tokens not a blob", "an index out of step"])
def test_a_missing_or_damaged_index_is_rebuilt_from_the_record_headers(tmp_path, damage):
    """Whatever is in the index's place, the records' headers rebuild it. A directory
    there was an IsADirectoryError traceback, and an index of an older schema (without the
    ``seen`` column) a "no such column" sqlite3 error on every run. So was one value of the
    wrong type ("text layers", "tokens not a blob"), which passes SQLite's quick_check: a
    TypeError from inside on every later run, reuse=None included, while ``cache ls``
    called the index fine or "rebuilt on the next open" (a review). And so did an index
    of the table out of step with it (one flipped bit can do that; here SQLite's own
    writable_schema names other columns for the entries stored): it passes quick_check,
    and every write then failed, "database disk image is malformed", for good (a review)."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    close_all()
    path = os.path.join(prefix_dir(tmp_path), INDEX_NAME)
    with sqlite3.connect(path) as db:
        links = dict(db.execute("SELECT h, parent FROM blocks").fetchall())
    for suffix in ("-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.unlink(path + suffix)
    if damage == "delete":
        os.unlink(path)
    elif damage == "a directory":
        os.unlink(path)
        os.mkdir(path)
    elif damage == "an older schema":
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE blocks DROP COLUMN seen")
    elif damage in ("text layers", "tokens not a blob"):
        with sqlite3.connect(path) as db:
            db.execute("UPDATE blocks SET layers = 'x' WHERE idx = 3" if damage == "text layers"
                       else "UPDATE blocks SET tokens = 5 WHERE idx = 3")
        ((where, tag),) = prefix_dirs(str(tmp_path / "kv"))
        assert describe(where, tag).state == "damaged"  # ``cache ls`` says what the next open finds
    elif damage == "an index out of step":
        with sqlite3.connect(path, isolation_level=None) as db:
            db.execute("PRAGMA writable_schema=ON")
            db.execute("UPDATE sqlite_master SET sql = 'CREATE INDEX blocks_sightings ON blocks (last_used, layers)' "
                       "WHERE name = 'blocks_sightings'")
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        ((where, tag),) = prefix_dirs(str(tmp_path / "kv"))
        assert describe(where, tag).state == "damaged"
    else:
        with open(path, "r+b") as f:
            f.write(b"this is not an sqlite database" * 40)
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 28  # the token ids came back from the record headers
    assert_same(reference(model, ids), out)
    close_all()
    with sqlite3.connect(path) as db:  # and the chain links, re-derived by re-hashing the ids
        assert dict(db.execute("SELECT h, parent FROM blocks").fetchall()) == links


def test_a_full_disk_under_the_index_is_a_tier_error_naming_it(small_filesystem, tmp_path):
    """SQLite on a real full filesystem: a write to the index was a bare
    sqlite3.OperationalError ("database or disk is full"); it is a TierIOError naming the
    index. What was written before reads back."""
    from tiercache.errors import TierIOError
    from tiercache.prefix import ChainBlock, PrefixIndex

    folder = small_filesystem(tmp_path / "small", "128k")
    index = PrefixIndex(str(folder / INDEX_NAME))
    index.upsert(ChainBlock(1, 0, None, b"\0" * 12), layers=3)
    full = r"prefix index .*index\.sqlite': writing failed \(database or disk is full\)"
    with pytest.raises(TierIOError, match=full):
        for h in range(2, 100000):
            index.upsert(ChainBlock(h, 0, None, os.urandom(3000)), layers=3)
    assert index.get(1)[:2] == (1, 0)
    index.close()


@pytest.mark.parametrize("reuse", [None, True])
def test_a_prefix_cache_on_a_full_disk_is_off_for_the_run_or_one_error(small_filesystem, tmp_path, reuse, caplog):
    """The prefix directory on a real full filesystem (a small tmpfs mounted at
    ``disk_dir/prefix``; the cache's own session files have room): with reuse=None (on
    because a disk tier is) the run warns and goes on without it, DynamicCache's tokens;
    with reuse=True one CacheDirError naming ENOSPC, before anything is generated. Before,
    either was a sqlite3 error from inside, on this run and every later one."""
    os.mkdir(tmp_path / "kv", 0o700)
    small_filesystem(tmp_path / "kv" / "prefix", "64k")
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path, reuse=reuse)
    if reuse:
        with pytest.raises(CacheDirError, match="No space left on device|database or disk is full"):
            run(model, ids, cfg)
        return
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, cfg)
    assert "prefix cache off" in caplog.text and ("No space left" in caplog.text or "disk is full" in caplog.text)
    assert_same(reference(model, ids), out)
    assert stats["reused_tokens"] == 0


def test_a_session_store_that_cannot_open_leaves_no_folder(small_filesystem, tmp_path):
    """A full filesystem under ``disk_dir/sessions`` (a real tmpfs, filled up): the cache's
    store cannot write its lock file and the run stops with a CacheDirError naming ENOSPC.
    Its session folder, made a moment before, stayed behind (empty) until a later process
    swept it: one more with every failed request. Now it goes with the error."""
    os.mkdir(tmp_path / "kv", 0o700)
    sessions = small_filesystem(tmp_path / "kv" / "sessions", "64k")
    fd = os.open(sessions / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    model, ids = tiny_model(), prompt()
    for _ in range(2):
        with pytest.raises(CacheDirError, match="No space left on device"):
            run(model, ids, config(tmp_path, reuse=False))
    assert os.listdir(sessions) == ["filler"]


def test_a_file_in_the_prefix_directorys_place_turns_it_off_for_the_run(tmp_path, caplog):
    """A file where the model's prefix directory goes was a ValueError from inside (the
    store's config check), not the warning reuse=None gives for a directory it cannot use."""
    import shutil

    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    close_all()
    path = prefix_dir(tmp_path)
    shutil.rmtree(path)
    with open(path, "w") as f:
        f.write("not a directory")
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, config(tmp_path))
    assert "prefix cache off for this run" in caplog.text and "is not a directory" in caplog.text
    assert_same(reference(model, ids), out)
    with pytest.raises(CacheDirError, match="is not a directory"):
        run(model, ids, config(tmp_path, reuse=True))


def test_a_corrupted_record_is_recomputed_never_served(tmp_path):
    """Flip one byte in the payload of every stored record: each fails its checksum on load,
    is counted (in the prefix store's stats and the loading cache's), dropped, and its
    tokens are computed instead; the output stays exact."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    close_all()
    from tiercache.disk import DATA_NAME, HEADER_BYTES
    data = os.path.join(prefix_dir(tmp_path), DATA_NAME)
    size = os.path.getsize(data)
    record = HEADER_BYTES + 4096  # the tiny model's 1 KiB payload pads to 4 KiB
    with open(data, "r+b") as f:
        for at in range(0, size, record):
            f.seek(at + HEADER_BYTES + 7)
            byte = f.read(1)
            if byte:
                f.seek(at + HEADER_BYTES + 7)
                f.write(bytes([byte[0] ^ 0xFF]))
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        loaded = cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        errors = cache.prefix.store.stats()["integrity_errors"]
        counted = cache.stats()["integrity_errors"]  # the cache's own stats say so too (they did not)
    assert loaded == 0 and errors >= 1 and counted >= 1
    assert_same(reference(model, ids), out)


def _prefix_of(model, cfg):
    """The process's prefix cache for ``model`` under ``cfg`` (opened by a TieredCache)."""
    with TieredCache(model, cfg) as cache:
        return cache._ensure_prefix()


def _orphans(pc) -> list:
    """Index rows of stored blocks whose parent is not stored: they could never be served."""
    rows = pc.index.rows()
    return [h for h, r in rows.items() if r[4] and r[2] is not None and not (r[2] in rows and rows[r[2]][4])]


def test_forgetting_a_damaged_prefix_forgets_the_blocks_that_extend_it(tmp_path):
    """Prompts X and Y share blocks 0-1; block 1's record is damaged. Loading X forgot
    block 1 and X's own later blocks, but Y's blocks 2-3 stayed stored and indexed with
    their parent gone: never servable, holding budget, and (their link gone) eviction could
    take the republished block 1 while they stayed (a review). Every block that extends a
    forgotten one is forgotten with it now; tokens stay exact, and Y is served again once
    X has published block 1 anew and Y ran once more."""
    from tiercache.disk import DATA_NAME, HEADER_BYTES
    from tiercache.prefix import chain
    from tiercache.table import BlockKey, Tier

    model, cfg = tiny_model(), config(tmp_path)
    base = prompt(seed=7, length=8)
    x, y = (torch.cat([base, prompt(seed=s, length=8)], 1) for s in (11, 12))
    run(model, x, cfg)
    run(model, y, cfg)
    pc = _prefix_of(model, cfg)
    shared = chain(x[0].tolist(), BT, pc.salt)[1]
    slot = pc.store.table.copy(BlockKey(shared.h, 0, 1), Tier.DISK).slot
    offset = slot * pc.store.disk.record_bytes + HEADER_BYTES + 7
    path = os.path.join(pc.directory, DATA_NAME)
    close_all()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    out, stats = run(model, x, cfg)
    assert_same(reference(model, x), out)
    pc = _prefix_of(model, cfg)
    y_blocks = chain(y[0].tolist(), BT, pc.salt)
    assert _orphans(pc) == []
    assert not any(BlockKey(b.h, 0, b.index) in pc.store for b in y_blocks[2:])  # gone with their prefix
    out, _ = run(model, y, cfg)
    assert_same(reference(model, y), out)
    _, stats = run(model, y, cfg)
    assert stats["reused_tokens"] > 2 * BT


def test_a_reopened_prefix_cache_drops_blocks_whose_prefix_was_lost(tmp_path, caplog):
    """An eviction writes extensions to disk before their prefixes, so a process killed
    before it closed could leave on disk a block whose prefix was only in its memory. The
    reopened cache kept such blocks (indexed, counted in stats, never servable: a review's
    kill -9 runs). Here the first block's records go and the index is left as it was: at
    the next open every block of that chain is dropped, with the usual warning."""
    from tiercache.prefix import chain
    from tiercache.table import BlockKey

    model, cfg, ids = tiny_model(), config(tmp_path), prompt()
    run(model, ids, cfg)
    pc = _prefix_of(model, cfg)
    blocks = pc.stats()["blocks"]
    first = chain(ids[0].tolist(), BT, pc.salt)[0]
    for layer in range(pc.num_layers):
        pc.store.delete(BlockKey(first.h, layer, 0))  # its records only; the index still names it
    pc.store.flush()
    close_all()
    with caplog.at_level("WARNING", logger="tiercache"):
        pc = _prefix_of(model, cfg)
        # in records, as the store counts: the other blocks' (the first's were never found)
        orphans = (blocks - 1) * pc.num_layers
        assert f"dropped {orphans} damaged or incomplete records ({blocks} blocks) on open" in caplog.text
    stats = pc.stats()
    assert stats["blocks"] == stats["prefixes"] == stats["records"] == 0 and _orphans(pc) == []
    assert stats["dropped_on_open"] == orphans
    out, stats = run(model, ids, cfg)
    assert stats["reused_tokens"] == 0
    assert_same(reference(model, ids), out)


def test_clear_of_one_tier_forgets_the_blocks_that_went_with_it(tmp_path, caplog):
    """``clear("disk")`` drops the disk copies, and a block whose only copy was there goes
    whole. Its index row stayed: stats counted blocks that were gone, the next open called
    the difference damage ("dropped ... a process was killed"), and a block extending one
    that went stayed, never servable (a review). Now the index forgets them, and their
    extensions too."""
    model, cfg, ids = tiny_model(), config(tmp_path), prompt()
    run(model, ids, cfg)
    close_all()
    pc = _prefix_of(model, cfg)  # a fresh process's view: every block only on disk
    assert pc.stats()["blocks"] > 0
    pc.clear(tiercache.Tier.DISK)
    stats = pc.stats()
    assert stats["blocks"] == stats["records"] == 0 and _orphans(pc) == []
    close_all()
    with caplog.at_level("WARNING", logger="tiercache"):
        pc = _prefix_of(model, cfg)
    assert "dropped" not in caplog.text and pc.stats()["blocks"] == 0


def test_clear_of_the_host_moves_blocks_down_instead_of_losing_them(tmp_path):
    """Scenario: a request stores its prompt's blocks (on the host: their disk copies are
    written when the cache closes) and then clears the host tier to free memory.
    ``clear(tier="host")`` dropped every block whose only copy was there: the next process
    loaded nothing (a review). They move to the disk first now: the index keeps them, the
    host holds none, and the next process loads the prefix and answers exactly."""
    model, cfg, ids = tiny_model(), config(tmp_path), prompt()
    with TieredCache(model, cfg) as cache, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        pc = cache._ensure_prefix()
        blocks, on_host = pc.stats()["blocks"], list(pc.store.table.keys_on(tiercache.Tier.HOST))
        assert blocks > 0 and any(pc.store.tiers_of(k) == [tiercache.Tier.HOST] for k in on_host), \
            "the scenario needs blocks whose only copy is on the host"
        assert cache.clear(tier="host") == len(on_host)
        stats = pc.stats()
        assert stats["blocks"] == blocks and stats["tiers"]["host"]["blocks"] == 0 and _orphans(pc) == []
    close_all()
    out, stats = run(model, ids, cfg)
    assert stats["reused_tokens"] > 0
    assert_same(reference(model, ids), out)


@pytest.mark.parametrize("budget, decoded_blocks_stored", [(12, False), (256, True)])
def test_quest_publishes_only_what_full_attention_computed(tmp_path, budget, decoded_blocks_stored):
    """Scenario: a chat turn runs with quest, which leaves pages out of attention at decode;
    the next turn, exact, sends the whole conversation. The decoded tokens' KV above the
    first layer is not what full attention computes, and the quest turn published it: the
    exact turn loaded it and its logits were 5.4 off DynamicCache's (a review). Now only
    blocks computed with every page go to the prefix cache: the prompt's, and all of them
    when the budget reads every page. The next turn is exact either way."""
    model, ids = tiny_model(), prompt()
    quest = config(tmp_path, selection="quest", selection_budget=budget)
    with TieredCache(model, quest) as cache, torch.no_grad():
        first = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                               **{**GEN, "max_new_tokens": 30})
    close_all()
    turn = first.sequences  # the prompt and 30 decoded tokens: 60 tokens, 15 blocks
    out, stats = run(model, turn, config(tmp_path))
    prompt_blocks = PROMPT // BT
    if decoded_blocks_stored:
        assert stats["reused_tokens"] > (prompt_blocks + 1) * BT
    else:
        assert stats["reused_tokens"] == prompt_blocks * BT, "blocks of quest's decoded tokens were served"
    assert_same(reference(model, turn), out)


def test_a_lora_adapter_switched_off_or_on_names_another_model_and_a_peft_model_reuses(tmp_path):
    """Scenario: a LoRA model (PEFT, the adapter not merged) serves a request with the
    adapter switched off (``disable_adapter()``: a base-model pass), then the adapted
    model serves the same prompt. The weights are the same objects either way, and the
    model digest named only weights and config: the adapted run loaded the base pass's KV
    and its logits were 7.4 off (a review). Adapter switches name the model now: no hit
    across them, a hit within one setting, exact throughout."""
    from tiercache.prefix import _switches_text

    peft = pytest.importorskip("peft")
    # a model with no adapter is named as before: its attention's ``scaling`` is no switch
    # (taken for one, it renamed every model, and every prefix cache stored was left behind)
    assert _switches_text(tiny_model()) == ""
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                                              init_lora_weights=False)).eval()
    inner = model.base_model.model  # the causal LM with the LoRA layers in it
    ids, cfg = prompt(), config(tmp_path)
    with model.disable_adapter():
        base_ref = reference(inner, ids)
        out, stats = run(inner, ids, cfg)
        assert stats["reused_tokens"] == 0
        assert_same(base_ref, out)
    adapted_ref = reference(inner, ids)
    assert not torch.equal(adapted_ref.sequences, base_ref.sequences), "the adapter must change the answer"
    for attempt in ("cold", "warm"):
        out, stats = run(inner, ids, cfg)
        assert (stats["reused_tokens"] > 0) == (attempt == "warm"), (attempt, stats["reused_tokens"])
        assert_same(adapted_ref, out)
    # The PeftModel itself (another name: its weights' names differ): its generate() runs the
    # base model's forward, which the cache's hook on the wrapper never saw, and nothing was
    # stored or loaded, silently (a review)
    for attempt in ("cold", "warm"):
        out, stats = run(model, ids, cfg)
        assert (stats["reused_tokens"] > 0) == (attempt == "warm"), ("PeftModel", attempt, stats["reused_tokens"])
        assert_same(adapted_ref, out)


def test_first_sightings_are_remembered_within_a_bound(tmp_path):
    """With ``reuse_admission="reused"`` every block seen once got an index row, kept for
    good: a service that saw many distinct prompts grew the index past the disk budget
    (48,660 rows, 3 MiB, over 160 KiB of records; a review), and every lookup read it all.
    First sightings are bounded now (the least recently seen go first), and a lookup reads
    only the prompt's own rows."""
    from tiercache.prefix import chain

    model = tiny_model()
    pc = _prefix_of(model, config(tmp_path, reuse_admission="reused"))
    bound = pc._max_sightings
    for seed in range(bound * 3 // 2 // 8):
        ids = torch.randint(1, 64, (8 * BT,), generator=torch.Generator().manual_seed(1000 + seed)).tolist()
        for block in chain(ids, BT, pc.salt):
            assert pc.admit(block) is False  # a first sighting: remembered, not stored
    assert pc.index.sightings() <= bound * 5 // 4
    seen = chain(torch.randint(1, 64, (2 * BT,), generator=torch.Generator().manual_seed(5)).tolist(), BT, pc.salt)
    assert [pc.admit(b) for b in seen] == [False, False] and [pc.admit(b) for b in seen] == [True, True]


def test_a_block_is_served_only_after_the_block_it_was_stored_after(tmp_path):
    """A lookup checked each block's tokens and place, not its parent: two blocks with the
    same tokens at the same place after different prefixes, whose 63-bit names collided,
    would have been served for each other. The parent recorded in the index must be the
    previous block of the lookup's chain."""
    from tiercache.prefix import chain

    model, cfg, ids = tiny_model(), config(tmp_path), prompt()
    run(model, ids, cfg)
    pc = _prefix_of(model, cfg)
    blocks = chain(ids[0].tolist(), BT, pc.salt)
    assert len(pc.match(ids[0].tolist())) == len(blocks) > 3
    # the row of a colliding block: block 2's name and tokens, stored after block 0
    pc.index._execute("writing", "UPDATE blocks SET parent = ? WHERE h = ?", (blocks[0].h, blocks[2].h))
    assert len(pc.match(ids[0].tolist())) == 2


def test_admission_stores_a_block_only_once_it_was_seen_before(tmp_path):
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path, reuse_admission="reused")
    _, s1 = run(model, ids, cfg)
    assert s1["published_blocks"] == 0  # first sighting: remembered, not stored
    _, s2 = run(model, ids, cfg)
    assert s2["reused_tokens"] == 0 and s2["published_blocks"] > 0
    _, s3 = run(model, ids, cfg)
    assert s3["reused_tokens"] == 28


def test_admission_counts_each_request_of_a_cache_reused_through_reset(tmp_path):
    """One cache serving request after request (``reset()`` between them, as a server
    does): it kept its first "not yet" per block for its whole life, so with
    reuse_admission="reused" it stored nothing, ever (a review). Each request is a sighting."""
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    with TieredCache(model, config(tmp_path, reuse_admission="reused")) as cache, torch.no_grad():
        seen = []
        for _ in range(3):
            cache.reset()
            loaded = cache.load_prefix(ids)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
            assert_same(ref, out)
            seen.append((loaded, cache.stats()["published_blocks"]))
    assert seen[0] == (0, 0)  # first sighting: remembered, not stored
    assert seen[1][0] == 0 and seen[1][1] > 0  # second: stored
    assert seen[2][0] == 28  # third: loaded


def test_clear_forgets_everything_or_one_tier(tmp_path):
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    with TieredCache(model, config(tmp_path)) as cache:
        assert cache.clear("host") > 0  # host copies go; the disk still has every block
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 28
    with TieredCache(model, config(tmp_path)) as cache:
        assert cache.clear() > 0
        with pytest.raises(ValueError, match="tier must be"):
            cache.clear("ssd")
    _, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 0


def test_a_second_process_on_the_directory_is_refused_clearly(tmp_path):
    """Another process holds the prefix directory: with reuse=True the error names it; with
    reuse left automatic, the run goes on without the prefix cache."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    close_all()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, os
            from tiercache.disk import DiskTier
            import fcntl
            fd = os.open(os.path.join({prefix_dir(tmp_path)!r}, "tiercache.lock"), os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            print("locked", flush=True)
            sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CacheDirError, match="in use by another tiercache process"):
            run(model, ids, config(tmp_path, reuse=True))
        close_all()
        out, stats = run(model, ids, config(tmp_path))
        assert stats["reused_tokens"] == 0
        assert_same(reference(model, ids), out)
    finally:
        holder.communicate("", timeout=30)


@pytest.mark.parametrize("reuse", [None, True])
def test_a_forked_child_never_hangs_on_its_parents_prefix_cache(tmp_path, reuse):
    """A process that used the prefix cache forks. The child had the parent's open prefix
    cache, whose I/O threads stay in the parent: its first load or publish waited for good.
    Now the child opens its own, which the parent's lock refuses as it refuses any second
    process: reuse=None goes on without it (exact tokens), reuse=True says who holds the
    directory. The child's exit (close_all, as atexit runs it) leaves the parent's cache
    working: its next request loads the prefix, exact."""
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    run(model, ids, config(tmp_path))  # the parent publishes the prompt

    def child() -> str:
        if reuse:
            with pytest.raises(CacheDirError, match=f"in use by another tiercache process \\(pid {os.getppid()}\\)"):
                run(model, ids, config(tmp_path, reuse=True))
        else:
            out, stats = run(model, ids, config(tmp_path))
            assert stats["reused_tokens"] == 0
            assert_same(ref, out)
        close_all()  # what the child's atexit would do: the parent's files are left alone
        return "done"

    assert in_a_forked_child(child) == "done"
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 28
    assert_same(ref, out)


def test_a_live_forked_child_does_not_hold_its_parents_prefix_directory(tmp_path):
    """A forked worker that lives on (a Pool's, gunicorn's) had a copy of the lock file's
    descriptor, which shares the parent's open file: the flock stayed held while it lived,
    so the parent, after close_all() (README's way to apply new prefix settings), was
    refused its own directory, told that its own pid held it. The child now closes its
    copies at the fork."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # an idle worker: waits until the parent is done, then leaves
        try:
            os.close(go_write)
            os.read(go_read, 1)
        finally:
            os._exit(0)
    os.close(go_read)
    try:
        close_all()
        out, stats = run(model, ids, config(tmp_path, reuse=True))
        assert stats["reused_tokens"] == 28
        assert_same(reference(model, ids), out)
    finally:
        os.close(go_write)
        os.waitpid(pid, 0)


def test_an_empty_cache_made_before_fork_works_in_the_child_without_the_parents_prefix(tmp_path):
    """A TieredCache made (and its prefix cache opened) before fork(), with no tokens yet,
    used in the child: load_prefix read the parent's SQLite connection, then failed in the
    parent's store. It now opens the prefix cache again, which the parent's lock refuses
    (reuse=None: the run goes on without it), and generates on a store of its own, exact."""
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    run(model, ids, config(tmp_path))  # the parent publishes the prompt
    fresh = TieredCache(model, config(tmp_path))
    fresh.clear("device")  # opens its prefix cache (the process's), holds no token

    def child() -> str:
        with fresh, torch.no_grad():
            assert fresh.load_prefix(ids) == 0
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=fresh, **GEN)
        assert_same(ref, out)
        return "done"

    try:
        assert in_a_forked_child(child) == "done"
    finally:
        fresh.close()
    out, stats = run(model, ids, config(tmp_path))
    assert stats["reused_tokens"] == 28
    assert_same(ref, out)


def test_a_cache_made_before_fork_is_refused_in_the_child_and_left_to_the_parent(tmp_path):
    """A TieredCache opened before fork(), used in the child: its moves would wait for I/O
    threads that stayed in the parent. It says so instead, and closing it in the child
    neither waits nor touches the parent's session files: the parent goes on with it."""
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    cache = TieredCache(model, config(tmp_path))
    try:
        with torch.no_grad():
            cache.load_prefix(ids)
            first = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        assert_same(ref, first)
        session = cache.store.disk.directory
        assert os.path.isdir(session)

        def child() -> str:
            with pytest.raises(RuntimeError, match="is a fork\\(\\) of it"):
                with torch.no_grad():
                    model(ids[:, -1:], cache=cache, use_cache=True)
            cache.close()
            close_all()
            return "done"

        assert in_a_forked_child(child) == "done"
        assert os.path.isdir(session)
        more = ids.new_tensor([[5, 6, 7]])
        with torch.no_grad():  # the parent's cache still holds its tokens and goes on
            held = cache.get_seq_length()
            logits = model(more, cache=cache, use_cache=True).logits
        with torch.no_grad():
            dyn = transformers.DynamicCache()
            model(first.sequences[:, :held], cache=dyn, use_cache=True)
            want = model(more, cache=dyn, use_cache=True).logits
        assert (logits - want).abs().max().item() <= 1e-5
    finally:
        cache.close()
    assert not os.path.exists(session)


def test_wrap_reuses_prefixes_automatically(tmp_path):
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == 28
    assert_same(ref, out)


def _draft_model():
    torch.manual_seed(99)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                   initializer_range=0.2, eos_token_id=None, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("case", ["prompt lookup", "assistant model", "beams", "return sequences", "embeddings",
                                  "hidden states", "padded mask", "inferred mask", "model's beams", "position ids"])
def test_wrap_loads_a_cached_prefix_only_where_generate_can_continue_from_it(tmp_path, case):
    """``wrap`` fills its fresh cache with a cached prefix, which transformers takes for the
    caller's past. A helper found where that went wrong once the prompt was cached (each
    call here comes after a plain call with the same ids published them, and runs twice):
    - prompt lookup and assisted generation fed the whole prompt again on top of it, and
      ids given with embeddings named KV the model never computed from: wrong tokens;
    - beam search and several return sequences expand the batch: a traceback about batch 1;
    - a mask hiding prompt tokens shifts the positions of the rest: blocks published under
      the ids alone were loaded by a call with another mask, wrong tokens both ways;
    - hidden states and attentions of the prompt covered only its tail.
    A review of the fix found two more ways in: pad tokens in the ids and no mask
    (transformers infers one with zeros), and settings of the model's generation config
    behind a ``generation_config`` the caller passes (transformers fills its unset fields
    from the model's). Now such a call computes its prompt, with exactly the unwrapped
    model's result."""
    model, ids = tiny_model(), prompt()
    ids[0, 12:16] = ids[0, 0:4]  # something for prompt lookup to find
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, max_new_tokens=NEW, return_dict_in_generate=True)
    if case == "prompt lookup":
        kw["prompt_lookup_num_tokens"] = 3
    elif case == "assistant model":
        kw["assistant_model"] = _draft_model()
    elif case in ("beams", "return sequences"):
        kw.update(num_beams=3, num_return_sequences=3 if case == "return sequences" else 1)
    elif case == "hidden states":
        kw.update(output_hidden_states=True, output_attentions=True)
    elif case in ("padded mask", "inferred mask"):
        ids[0, :4] = 0  # the pad token
        mask[0, :4] = 0
        if case == "inferred mask":
            mask = None
    if case != "hidden states":
        kw["output_logits"] = True
    if case == "model's beams":  # the model's config asks for beams; the call passes a config of its own
        kw = dict(generation_config=transformers.GenerationConfig(**kw, num_return_sequences=1))
    if case == "position ids":  # the caller's positions: KV the ids alone do not name
        kw["position_ids"] = torch.arange(20, 20 + ids.shape[1])[None]
    if case == "embeddings":  # embeddings scaled: not what the ids would give
        kw["inputs_embeds"] = model.get_input_embeddings()(ids) * 1.5
    given = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad():
        cfg = config(tmp_path)
        if case in ("beams", "return sequences", "model's beams"):  # three rows: blocks three times larger
            cfg = dataclasses.replace(cfg, device_budget="96KiB", host_budget="96KiB")
        wrapped = tiercache.wrap(tiny_model(), cfg)
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)  # a plain call publishes the ids
        if case == "model's beams":
            model.generation_config.num_beams = wrapped.generation_config.num_beams = 3
        ref = model.generate(ids, **given, **kw)
        outs = [wrapped.generate(ids, **given, **kw) for _ in range(2)]
    for out in outs:
        assert torch.equal(ref.sequences, out.sequences)
        if case == "hidden states":
            assert [h.shape for h in out.hidden_states[0]] == [h.shape for h in ref.hidden_states[0]]
        else:
            assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert wrapped.tiercache_last.stats()["reused_tokens"] == 0
    if case == "padded mask":  # and what it computed was not published under the ids alone
        with torch.no_grad():
            wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert wrapped.tiercache_last.stats()["reused_tokens"] == 28  # the plain call's own blocks


def test_blocks_computed_under_a_mask_that_hides_tokens_are_not_published(tmp_path):
    """A left-padded call (the mask hides its first tokens) computes the rest at shifted
    positions. Run first, with nothing cached yet, it must publish nothing: a plain call
    with the same ids then computes its own prompt, as the unwrapped model does. (The
    padded case above runs after a plain call has published the ids, so a padded call that
    published would have found them there and added nothing: a mutation that let it
    publish survived.)"""
    model, ids = tiny_model(), prompt()
    ids[0, :4] = 0  # the pad token
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ref = reference(model, ids)
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=mask, **GEN)
        assert wrapped.tiercache_last.stats()["published_blocks"] == 0
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert wrapped.tiercache_last.stats()["reused_tokens"] == 0
        assert_same(ref, out)
        # A forward of its own with that mask and no positions (generate derives positions
        # from the mask, and they alone kept it from publishing there)
        with TieredCache(model, config(tmp_path / "forward")) as cache:
            model(ids, attention_mask=mask, cache=cache)
            assert cache.stats()["published_blocks"] == 0


def test_blocks_computed_at_the_callers_positions_are_not_published(tmp_path):
    """A call with ``position_ids`` of its own published its blocks under the ids alone, and a
    plain call with the same ids loaded them (wrong tokens, a helper's repro)."""
    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(20, 50)[None], **GEN)
        assert wrapped.tiercache_last.stats()["published_blocks"] == 0
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert wrapped.tiercache_last.stats()["reused_tokens"] == 0
        assert_same(ref, out)
        # the usual positions, given: the blocks the plain call published are loaded (a review:
        # any position_ids had turned reuse off)
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(30)[None], **GEN)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == 28
    assert_same(ref, out)


def test_a_model_whose_rotary_positions_depend_on_the_length_has_no_prefix_reuse(tmp_path):
    """With dynamic NTK scaling (and LongRoPE's two factors) the rotary frequencies depend on
    the length a forward sees: a short prompt's blocks, loaded into a longer prompt, gave
    other tokens than computing it (a helper's repro). Reuse is off for such a model, and
    asking for it is refused by name."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0}, eos_token_id=None,
                                   pad_token_id=0, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    short, long = prompt(length=13), torch.cat([prompt(length=13), prompt(seed=3, length=27)], dim=1)
    ref = reference(model, long)
    wrapped = tiercache.wrap(model, config(tmp_path))
    with torch.no_grad():
        wrapped.generate(short, attention_mask=torch.ones_like(short), **dict(GEN, max_new_tokens=3))
        out = wrapped.generate(long, attention_mask=torch.ones_like(long), **GEN)
    assert wrapped.tiercache_last.prefix is None and wrapped.tiercache_last.stats()["reused_tokens"] == 0
    assert_same(ref, out)
    with pytest.raises(tiercache.UnsupportedModelError, match="reuse: the prefix cache is not exact for rope_type "
                                                              "'dynamic'"):
        TieredCache(model, config(tmp_path, reuse=True))
    # What the rotary module runs decides, not the config: HunYuan's "dynamic" with an alpha
    # runs as the fixed "ntk_alpha", and reuse was wrongly off for it (a review).
    from tiercache.hf import _ROPE_OF, _rope_kind

    assert _rope_kind(model, model.config) == "dynamic"
    model.model.rotary_emb.rope_type = "ntk_alpha"
    assert _rope_kind(model, model.config) is None
    _ROPE_OF.pop(model)  # the answer is kept per model (a model's rope type does not change)
    TieredCache(model, config(tmp_path, reuse=True)).close()


def test_a_subclass_with_its_own_generate_parameters_is_read_by_them(tmp_path):
    """Its call was read by GenerationMixin.generate's names: a positional ``max_new_tokens``
    taken for a generation config hid the model's ``use_cache=False`` (wrong tokens), and a
    positional mask taken for one was a "Boolean value of Tensor" error (a helper's repros)."""
    class OwnSignature(transformers.LlamaForCausalLM):
        def generate(self, input_ids, attention_mask=None, max_new_tokens=NEW, **kw):
            return super().generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **kw)

    class NoCacheByDefault(transformers.LlamaForCausalLM):  # its own default was not seen (a review)
        def generate(self, input_ids, attention_mask=None, use_cache=False, **kw):
            return super().generate(input_ids, attention_mask=attention_mask, use_cache=use_cache, **kw)

    class MaskThenArgs(transformers.LlamaForCausalLM):  # a mask by position was read as a config
        def generate(self, input_ids, attention_mask=None, *args, **kw):
            return super().generate(input_ids, None, *args, attention_mask=attention_mask, **kw)

    base, ids = tiny_model(), prompt()
    ref = reference(base, ids)

    def own(use_cache: bool, cls=OwnSignature):
        model = cls(base.config).eval()
        model.load_state_dict(base.state_dict())
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        model.generation_config.use_cache = use_cache
        return model

    kw = {k: v for k, v in GEN.items() if k != "max_new_tokens"}
    with torch.no_grad():
        unwrapped = own(False).generate(ids, torch.ones_like(ids), NEW, **kw)
        no_cache = tiercache.wrap(own(False), config(tmp_path))
        out = no_cache.generate(ids, torch.ones_like(ids), NEW, **kw)
        assert torch.equal(unwrapped.sequences, out.sequences) and no_cache.tiercache_last is None
        tiered = tiercache.wrap(own(True), config(tmp_path))
        out = tiered.generate(ids, torch.ones_like(ids), NEW, **kw)
    assert_same(ref, out)
    assert tiered.tiercache_last.stats()["decode_tokens"] == NEW - 1
    with torch.no_grad():
        unwrapped = own(True, NoCacheByDefault).generate(ids, torch.ones_like(ids), **GEN)
        no_cache = tiercache.wrap(own(True, NoCacheByDefault), config(tmp_path))
        out = no_cache.generate(ids, torch.ones_like(ids), **GEN)
    assert torch.equal(unwrapped.sequences, out.sequences) and no_cache.tiercache_last is None
    padded, mask = ids.clone(), torch.ones_like(ids)
    padded[0, :4], mask[0, :4] = 0, 0
    with torch.no_grad():
        want = own(True, MaskThenArgs).generate(padded, mask, **GEN)
        masked = tiercache.wrap(own(True, MaskThenArgs), config(tmp_path))
        masked.generate(padded, torch.ones_like(ids), **GEN)  # publishes the ids under a full mask
        out = masked.generate(padded, mask, **GEN)
    assert masked.tiercache_last.stats()["reused_tokens"] == 0
    assert_same(want, out)

    # A None default means "not given" (it overrode the model's use_cache=False and
    # num_beams=2 in the merge), a keyword-only default of a forwarder is the call's, and a
    # sentinel default transformers refuses leaves the call's own settings (a review).
    class NoneMeansUnset(transformers.LlamaForCausalLM):
        def generate(self, input_ids, attention_mask=None, use_cache=None, num_beams=None, **kw):
            given = {k: v for k, v in (("use_cache", use_cache), ("num_beams", num_beams)) if v is not None}
            return super().generate(input_ids, attention_mask=attention_mask, **given, **kw)

    class KeywordOnlyNoCache(transformers.LlamaForCausalLM):
        def generate(self, *args, use_cache=False, **kw):
            return super().generate(*args, use_cache=use_cache, **kw)

    class Sentinel(transformers.LlamaForCausalLM):
        def generate(self, input_ids, attention_mask=None, max_new_tokens=-1, **kw):
            return super().generate(input_ids, attention_mask=attention_mask,
                                    max_new_tokens=NEW if max_new_tokens < 0 else max_new_tokens, **kw)

    cases = [(NoneMeansUnset, dict(use_cache=False)), (NoneMeansUnset, dict(num_beams=2)),
             (KeywordOnlyNoCache, {}), (Sentinel, dict(use_cache=False))]
    for i, (cls, settings) in enumerate(cases):
        def make():
            model = own(True, cls)
            for key, value in settings.items():
                setattr(model.generation_config, key, value)
            return model
        kw = dict(GEN) if cls is not Sentinel else {k: v for k, v in GEN.items() if k != "max_new_tokens"}
        with torch.no_grad():
            want = make().generate(ids, attention_mask=torch.ones_like(ids), **kw)
            wrapped = tiercache.wrap(make(), config(tmp_path / f"c{i}"))
            if settings.get("num_beams"):  # a cached prompt first: beams must not load it
                wrapped.generation_config.num_beams = 1
                wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                wrapped.generation_config.num_beams = 2
            out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(want.sequences, out.sequences), cls.__name__
        last = getattr(wrapped, "tiercache_last", None)
        if settings.get("num_beams"):
            assert last.stats()["reused_tokens"] == 0
        else:
            assert last is None, cls.__name__  # no cache asked for: untiered


def test_wrap_tiers_a_generate_that_takes_star_args_and_reads_the_chunk_from_the_config(tmp_path):
    """Binding the call's arguments, a ``generate(*args, **kwargs)`` (PEFT's, remote code)
    fell back to the unwrapped call: no tiers, no prefix (a review's repro). And
    ``load_prefix`` was told the chunk size only from a keyword, so a ``prefill_chunk_size``
    in a generation config planned the load for one unchunked prefill (over a budget sized
    for chunks: nothing loaded)."""
    class Forwarding(transformers.LlamaForCausalLM):
        def generate(self, *args, **kwargs):  # the PEFT pattern
            return super().generate(*args, **kwargs)

    model, ids = tiny_model(), prompt()
    ref = reference(model, ids)
    forwarding = Forwarding(model.config).eval()
    forwarding.load_state_dict(model.state_dict())
    forwarding.generation_config.eos_token_id, forwarding.generation_config.pad_token_id = None, 0
    wrapped = tiercache.wrap(forwarding, config(tmp_path))
    with torch.no_grad():
        for _ in range(2):
            out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
            assert_same(ref, out)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == 28
    # A config given by position to such a generate was read as none (the model's): beams
    # after a cached prompt loaded a batch-1 prefix and failed (the review of the fix). The
    # call's arguments now go on exactly as given; they are only read by name.
    beams = transformers.GenerationConfig(**GEN, num_beams=2)
    with torch.no_grad():
        want = model.generate(ids, beams, attention_mask=torch.ones_like(ids))
        got = wrapped.generate(ids, beams, attention_mask=torch.ones_like(ids))
    assert_same(want, got)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == 0

    class NamedFirst(transformers.LlamaForCausalLM):
        def generate(self, inputs=None, *args, **kwargs):  # rebuilt from names, inputs came twice
            return super().generate(inputs, *args, **kwargs)

    named = NamedFirst(model.config).eval()
    named.load_state_dict(model.state_dict())
    named.generation_config.eos_token_id, named.generation_config.pad_token_id = None, 0
    named = tiercache.wrap(named, config(tmp_path))
    with torch.no_grad():
        out = named.generate(ids, transformers.GenerationConfig(**GEN), attention_mask=torch.ones_like(ids))
    assert_same(ref, out)
    assert named.tiercache_last.stats()["decode_tokens"] == NEW - 1  # tiered

    from test_hf_exactness import _all_sliding_model, block_bytes, tight_config

    sliding = _all_sliding_model(10)
    ids = torch.randint(1, 64, (1, 61), generator=torch.Generator().manual_seed(1))
    with TieredCache(sliding, tight_config(sliding, tmp_path / "probe", batch=1, device_blocks=64)) as probe:
        cold = probe.min_device_budget(61, 2, 5)
    wrapped = tiercache.wrap(sliding, tight_config(sliding, tmp_path / "s", batch=1,
                                                   device_blocks=cold // block_bytes(sliding, 1)))
    config_ = transformers.GenerationConfig(max_new_tokens=2, do_sample=False, prefill_chunk_size=5)
    with torch.no_grad():
        for _ in range(2):
            wrapped.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config_)
    assert wrapped.tiercache_last.stats()["reused_tokens"] > 0


@pytest.mark.parametrize("pad,eos,loads", [
    (0, 0, True), (0, [5, 0], True), (torch.tensor(0), None, False), (0, None, False)])
def test_wrap_follows_transformers_rule_for_inferring_a_mask(tmp_path, pad, eos, loads):
    """With no mask given, transformers infers one from pad tokens in the ids, unless the pad
    token is an eos token (SmolLM2's is: every chat prompt holds it). Refusing to load for
    any pad token left the default model without reuse; a pad token given as a tensor was
    not recognised, and a prefix was loaded under an inferred mask (wrong tokens). Both
    from a review; each case here is exactly the unwrapped model's."""
    model, ids = tiny_model(), prompt()
    ids[0, 5] = 0
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    for m in (model, wrapped):
        m.generation_config.pad_token_id, m.generation_config.eos_token_id = pad, eos
    kw = dict(GEN, min_new_tokens=NEW)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kw)  # publishes the ids
        out = wrapped.generate(ids, **kw)
    assert_same(ref, out)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == (28 if loads else 0)


@pytest.mark.parametrize("setting", ["use_cache=False", "cache_implementation='dynamic'", "generation_config",
                                     "use_cache=False behind a call's config", "the call's config asks for dynamic",
                                     "use_cache=False in a config given by position",
                                     "the model's own config, hybrid", "a copy of the model's config, static"])
def test_wrap_steps_aside_when_the_call_asks_for_no_cache_or_another_kind(tmp_path, setting):
    """``use_cache=False`` on a wrapped model got a TieredCache anyway, and transformers fed
    it the whole sequence at every step (108 tokens held for 18: wrong tokens); a
    ``cache_implementation`` in the call was refused by transformers ("passing both"). The
    call now runs as the unwrapped model's. A ``cache_implementation`` only in the model's
    generation config is the model's default, not the caller's: the wrapped call tiers."""
    model, ids = tiny_model(), prompt()
    kw = dict(GEN)
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    if setting == "use_cache=False":
        kw["use_cache"] = False
    elif setting == "generation_config":
        wrapped.generation_config.cache_implementation = "dynamic"
    elif setting == "use_cache=False behind a call's config":  # transformers fills the call's config from the model's
        model.generation_config.use_cache = wrapped.generation_config.use_cache = False
        kw = dict(generation_config=transformers.GenerationConfig(**GEN))
    elif setting == "the call's config asks for dynamic":
        kw = dict(generation_config=transformers.GenerationConfig(**GEN, cache_implementation="dynamic"))
    elif setting == "use_cache=False in a config given by position":  # generate(ids, config): was missed
        kw = dict(use_cache=False, **GEN)
    elif setting == "the model's own config, hybrid":  # Gemma's hub configs; transformers drops "hybrid"
        wrapped.generation_config.cache_implementation = "hybrid"
        kw = dict(generation_config=wrapped.generation_config, **GEN)
    elif setting == "a copy of the model's config, static":  # the model's default, not the caller's choice
        wrapped.generation_config.cache_implementation = "static"
        kw = dict(generation_config=copy.deepcopy(wrapped.generation_config), **GEN)
    else:
        kw["cache_implementation"] = "dynamic"
    positional = setting == "use_cache=False in a config given by position"
    with torch.no_grad():
        if positional:
            ref = model.generate(ids, transformers.GenerationConfig(**kw), attention_mask=torch.ones_like(ids))
            out = wrapped.generate(ids, transformers.GenerationConfig(**kw), attention_mask=torch.ones_like(ids))
        else:  # the reference: the unwrapped model (its own config has no cache_implementation)
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), **(GEN if "model's" in setting else kw))
            out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert_same(ref, out)
    tiered = getattr(wrapped, "tiercache_last", None)
    assert (tiered is not None) == (setting in ("generation_config", "the model's own config, hybrid",
                                                "a copy of the model's config, static"))
    if tiered is not None:
        assert tiered.stats()["decode_tokens"] == NEW - 1


def test_prefix_eviction_keeps_shared_prefixes_longest(tmp_path):
    """A disk budget of a few blocks: as new prompts sharing one 8-token prefix arrive, old
    extensions are evicted, never the shared prefix blocks they extend, so the shared part
    keeps hitting."""
    model, base = tiny_model(), prompt(length=8)
    cfg = TierConfig(device_budget="24KiB", host_budget="0", disk_dir=str(tmp_path / "kv"), disk_budget="160KiB",
                     block_tokens=BT, reuse_host_budget=0)
    for seed in range(2, 7):
        ids = torch.cat([base, prompt(seed=seed, length=10)], dim=1)
        _, stats = run(model, ids, cfg)
        if seed > 2:
            assert stats["reused_tokens"] >= 8, seed


@pytest.mark.parametrize("host", ["8KiB", "1GiB"])
@pytest.mark.parametrize("reuse", [None, True])
def test_a_full_prefix_cache_with_a_host_tier_evicts_and_keeps_publishing(tmp_path, reuse, host, caplog):
    """A long-running service fills its prefix cache. With a host tier (the default
    ``reuse_host_budget`` is 1 GiB), room was counted with the prefix store's two device
    slots, which a publish never reaches: once host and disk were full it evicted nothing,
    and the put failed with CapacityError. With reuse=None the cache turned itself off for
    good (every later run and process too, at its first new block); with reuse=True every
    generate() raised from then on. Now the oldest blocks go, every new prompt is published
    and the newest one loads, exact."""
    model = tiny_model()
    cfg = dataclasses.replace(config(tmp_path), disk_budget="160KiB", reuse_host_budget=host,
                              reuse=reuse)  # 20 records; 2 on the host, or all of them (the default's room)
    for seed in range(100, 112):  # 12 new 20-token prompts: 6 full blocks x 3 layers with the answer, 18 records
        ids = prompt(seed=seed, length=20)
        with caplog.at_level("WARNING", logger="tiercache"):
            out, stats = run(model, ids, cfg)
        assert stats["published_blocks"] == 6 * 3, (seed, stats["published_blocks"])
        assert_same(reference(model, ids), out)
    assert "prefix cache off" not in caplog.text
    # Every block fits the disk, where it outlives the process, and no block is kept with
    # some of its layers: a new process finds no incomplete record, and loads the newest
    # prompt (every full block before its last token), exact.
    close_all()
    with caplog.at_level("WARNING", logger="tiercache"):
        with TieredCache(model, cfg) as cache, torch.no_grad():
            assert cache.load_prefix(ids) == 4 * BT
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
            prefix = cache.prefix.stats()
    assert_same(reference(model, ids), out)
    assert "damaged or incomplete" not in caplog.text
    assert 0 < prefix["records"] <= 20 and prefix["dropped_on_open"] == 0


@pytest.mark.parametrize("host", ["8KiB", "1GiB"])
def test_a_prompt_longer_than_the_prefix_cache_keeps_its_longest_whole_prefix(tmp_path, host, caplog):
    """A 60-token prompt (15 blocks of 3 layers: 45 records) into a cache of 10 records.
    A forward publishes every block's layer 0, then every block's layer 1, and so on: the
    prompt's own blocks, waiting for their later layers, were evicted whole and their later
    layers stored alone, so nothing whole was kept and the next open dropped the pieces as
    "damaged or incomplete". Now no block is stored without its parent or its earlier
    layers, and one that cannot be finished goes: the longest prefix that fits (3 blocks)
    is kept whole, and a new process loads it, exact."""
    model, ids = tiny_model(), prompt(seed=5, length=60)
    cfg = dataclasses.replace(config(tmp_path), host_budget="512KiB", disk_budget="80KiB", reuse_host_budget=host)
    ref = reference(model, ids)
    out, _ = run(model, ids, cfg)
    assert_same(ref, out)
    close_all()
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, cfg)
    assert_same(ref, out)
    assert stats["reused_tokens"] == 3 * BT
    assert "damaged or incomplete" not in caplog.text


def test_an_extension_on_the_host_keeps_its_prefix_on_the_disk(tmp_path):
    """Prompt X, then a new process (its blocks on the disk only), then prompt Y that shares
    X's first 2 blocks: Y's new blocks sit on the host (the default 1 GiB host tier). The
    choice of victims on the disk alone took Y's prefix there, as nothing on the disk
    extended it: Y's 4 new blocks became unreachable, and Y reused 4 tokens next time.
    Extensions now go before their prefixes across tiers."""
    model = tiny_model()
    cfg = dataclasses.replace(config(tmp_path), disk_budget="160KiB", reuse_host_budget="1GiB")  # 20 records
    x = prompt(seed=3, length=12)
    y = torch.cat([x[:, :8], prompt(seed=4, length=16)], dim=1)
    run(model, x, cfg)
    close_all()
    ref = reference(model, y)
    out, stats = run(model, y, cfg)
    assert stats["reused_tokens"] == 8
    assert_same(ref, out)
    close_all()
    out, stats = run(model, y, cfg)
    assert stats["reused_tokens"] == 5 * BT  # every full block before the last prompt token
    assert_same(ref, out)


@pytest.mark.parametrize("reuse", [None, True])
def test_a_prefix_disk_budget_below_one_block_is_said_at_open(tmp_path, reuse, caplog):
    """A disk budget of 2 records, for a model of 3 layers: no block could ever be kept
    whole (the store grew past the disk, and the next open dropped what it had). It is said
    when the prefix cache opens: reuse=True raises naming disk_budget and what one block
    needs; reuse=None runs without it, exact."""
    model, ids = tiny_model(), prompt()
    cfg = dataclasses.replace(config(tmp_path), disk_budget="16KiB", reuse_host_budget="8KiB", reuse=reuse)
    if reuse:
        with pytest.raises(CacheDirError, match=r"disk_budget: the prefix cache .* holds 2 records and one block of "
                                                r"this model needs 3 \(one per layer\)"):
            run(model, ids, cfg)
        return
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, cfg)
    assert "prefix cache off" in caplog.text and "needs 3" in caplog.text
    assert_same(reference(model, ids), out)


def test_load_prefix_on_a_closed_cache_is_refused_before_anything_opens(tmp_path):
    """``load_prefix`` on a closed TieredCache opened a store for it (I/O threads and a
    session folder) and only then failed in the update, which refuses a closed cache; a
    second ``close()`` did nothing, so they stayed for the rest of the process (a review).
    It is refused first now, as ``update`` refuses, and nothing is left behind."""
    import threading

    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    run(model, ids, cfg)  # a warm prefix: the load would have blocks to read
    threads = threading.active_count()
    cache = TieredCache(model, cfg)
    cache.close()
    with pytest.raises(RuntimeError, match="TieredCache is closed"):
        cache.load_prefix(ids)
    cache.close()
    assert cache.store is None and threading.active_count() <= threads
    sessions = tmp_path / "kv" / "sessions"
    assert not sessions.exists() or not any(sessions.iterdir())


def test_a_run_with_too_small_a_disk_budget_leaves_the_saved_cache_as_it_was(tmp_path, caplog):
    """A prefix cache filled under a large disk_budget, then a run whose budget holds less
    than one block of every layer. That run said "prefix cache off for this run" but had
    already opened the store, whose open cut the data file to its budget: the next run
    with the large budget found the cache emptied and blamed a killed process (a review).
    Now the budget is checked before the store opens: the data file keeps every byte and
    the next run reuses the prompt as before."""
    model, ids = tiny_model(), prompt()
    big = dataclasses.replace(config(tmp_path), disk_budget="1MiB")
    run(model, ids, big)
    close_all()
    (data,) = list((tmp_path / "kv").rglob("blocks.dat"))
    before = data.read_bytes()
    with caplog.at_level("WARNING", logger="tiercache"):
        out, _ = run(model, ids, dataclasses.replace(big, disk_budget="16KiB"))
    assert "prefix cache off" in caplog.text and "needs 3" in caplog.text
    assert_same(reference(model, ids), out)
    assert data.read_bytes() == before
    caplog.clear()
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, big)
    assert stats["reused_tokens"] > 0 and "damaged" not in caplog.text
    assert_same(reference(model, ids), out)


def test_a_smaller_disk_budget_keeps_the_first_whole_blocks_and_says_why(tmp_path, caplog):
    """A prefix cache filled under one disk_budget and reopened under one that holds half
    of its blocks. The open cut the data file at the budget's end, and a prefix block's
    layers lie all over the file: every block lost a layer, all were dropped, and the
    loss was blamed on a killed process (a review). Now whole blocks are kept, the first
    ones of the prompt first, records past the end moved into the slots freed: the run
    reuses the blocks that fit, exact, and the log says the budget dropped the others."""
    model, ids = tiny_model(), prompt(length=6 * BT + 2)
    big = dataclasses.replace(config(tmp_path), disk_budget="1MiB", reuse_host_budget="8KiB")
    run(model, ids, big)
    close_all()
    _, stats = run(model, ids, big)
    assert stats["reused_tokens"] == 6 * BT  # every full block before the last prompt token
    close_all()
    from tiercache.disk import DiskTier
    from tiercache.tiers import BlockGeometry
    record = DiskTier.record_size(BlockGeometry(1, 2, BT, 16, torch.float32))  # the tiny model's blocks
    small = dataclasses.replace(big, disk_budget=3 * 3 * record + record)  # 3 blocks of 3 layers, and a slot
    caplog.clear()
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, small)
    assert stats["reused_tokens"] == 3 * BT
    assert_same(reference(model, ids), out)
    assert "held more saved blocks than disk_budget holds (10 blocks here)" in caplog.text
    assert "a sequence's first blocks kept first), 9 kept" in caplog.text and "damaged" not in caplog.text
    # the records cut, counted once: their blocks' index rows were added to them (a review)
    cut = int(re.search(r"\(10 blocks here\): (\d+) were dropped", caplog.text).group(1))
    assert _prefix_of(model, small).stats()["dropped_on_open"] == cut


def test_forwards_that_stop_half_way_leave_no_unfinished_block(tmp_path):
    """Four requests whose forward raises in layer 1 (an error, Ctrl-C) after layer 0 of a
    new block was stored. Those blocks, with one layer of three, were kept and evicted last:
    with them, candidates that could not go filled every search, so the full cache refused
    every new prompt for the rest of the process. A cache now forgets the unfinished blocks
    it started when it closes, and the search asks for more candidates until one may go:
    new prompts are stored and reused, exact, also after a reopen."""
    model = tiny_model()
    cfg = dataclasses.replace(config(tmp_path), disk_budget="240KiB", reuse_host_budget="8KiB",
                              eviction="lru")  # 30 records

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    firsts = [prompt(seed=50 + i, length=8) for i in range(4)]
    for ids in firsts:
        run(model, ids, cfg)  # blocks 0 and 1 whole
    layer1 = model.model.layers[1]
    for ids in firsts:
        layer1.forward = stop
        try:
            with pytest.raises(Stop), TieredCache(model, cfg) as cache, torch.no_grad():
                longer = torch.cat([ids, prompt(seed=90, length=4)], dim=1)
                model(longer, attention_mask=torch.ones_like(longer), cache=cache, use_cache=True)
        finally:
            del layer1.forward
    for seed in (200, 201, 202):
        ids = prompt(seed=seed, length=12)
        ref = reference(model, ids)
        out, stats = run(model, ids, cfg)
        assert stats["published_blocks"] == 4 * 3
        assert_same(ref, out)
        out, stats = run(model, ids, cfg)
        assert stats["reused_tokens"] == 2 * BT
        assert_same(ref, out)
    close_all()
    out, stats = run(model, ids, cfg)
    assert stats["reused_tokens"] == 2 * BT
    assert_same(ref, out)


def test_a_cache_closing_leaves_another_requests_unfinished_blocks_alone(tmp_path):
    """Cache A ran prompt X; X's blocks were evicted since; request B computes X again on
    another thread and is paused after storing layer 0 of its blocks; A closes. A's close
    forgot the unfinished blocks of its chain, B's among them: B then stored nothing of X
    (counting 3 published) and the next run reused nothing. A drops only what it left
    unfinished itself now: B stores X whole, and the next run reuses it, exact."""
    import threading

    model, model_b = tiny_model(), tiny_model()
    cfg = config(tmp_path, reuse=True)
    x = prompt(seed=5, length=12)
    ref = reference(model, x)
    a = TieredCache(model, cfg)
    try:
        with torch.no_grad():
            a.load_prefix(x)
            model.generate(x, attention_mask=torch.ones_like(x), cache=a, **GEN)
        a.prefix.forget(list(a._chain))  # evicted by other requests meanwhile
        go, paused = threading.Event(), threading.Event()

        def pause_once(module, args):
            if not paused.is_set():
                paused.set()
                go.wait(30)

        hook = model_b.model.layers[1].register_forward_pre_hook(pause_once)
        done: dict = {}

        def request_b():
            done["out"], done["stats"] = run(model_b, x, cfg)

        b = threading.Thread(target=request_b)
        b.start()
        assert paused.wait(30)
    finally:
        a.close()
    go.set()
    b.join(60)
    hook.remove()
    assert_same(ref, done["out"])
    out, stats = run(model, x, cfg)
    assert stats["reused_tokens"] == 2 * BT
    assert_same(ref, out)


def test_every_file_of_the_prefix_cache_is_private(tmp_path):
    """The directory is 0700 and every file in it 0600, SQLite's -wal and -shm included
    (they take the database file's mode, so it is created 0600 before SQLite opens it)."""
    import stat

    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    with TieredCache(model, cfg) as cache, torch.no_grad():
        cache.load_prefix(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        root = os.path.join(cfg.disk_dir, "prefix")
        seen = set()
        for folder, dirs, files in os.walk(root):
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
            for name in files:
                seen.add(name)
                mode = stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
                assert mode == 0o600, (name, oct(mode))
    assert {INDEX_NAME, INDEX_NAME + "-wal", INDEX_NAME + "-shm"} <= seen, seen


@pytest.mark.parametrize("warm_from", ["host", "disk"])
def test_a_warm_load_under_inference_mode(tmp_path, warm_from):
    """Users wrap generation in torch.inference_mode(): the prefix is then loaded into
    inference tensors by the I/O threads, which must be allowed to write them."""
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    run(model, ids, cfg)
    if warm_from == "disk":
        close_all()  # a new process: the prefix comes back from the data file
    with TieredCache(model, cfg) as cache, torch.inference_mode():
        loaded = cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
    assert loaded == (PROMPT - 1) // BT * BT
    assert_same(reference(model, ids), out)


@pytest.mark.parametrize("eviction, prefix_policy", [("layer-cycle", "lfu"), ("lru", "lru"), ("lfu", "lfu")])
def test_the_prefix_store_evicts_with_lfu_when_the_policy_assumes_the_decode_scan(tmp_path, eviction, prefix_policy):
    """layer-cycle (the default) assumes every layer is read in order at every step; the
    prefix cache's blocks are not read that way, so its store evicts with lfu instead. Any
    other policy is the prefix store's too. The decode store keeps the configured one."""
    model, ids = tiny_model(), prompt()
    with TieredCache(model, config(tmp_path, eviction=eviction)) as cache, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        assert cache.prefix is not None
        assert {type(p).name for p in cache.prefix.store.policies.values()} == {prefix_policy}
        assert {type(p).name for p in cache.store.policies.values()} == {eviction}


def _twin(model, cls=None):
    """A plain model of ``cls`` (default: the same class) with ``model``'s weights and settings."""
    twin = (cls or type(model))(model.config).eval()
    twin.load_state_dict(model.state_dict())
    twin.generation_config = copy.deepcopy(model.generation_config)
    return twin


def test_wrap_decides_inside_generate_so_a_subclass_body_or_custom_loop_cannot_hide_its_settings(tmp_path):
    """wrap() used to read generate()'s arguments and guess what transformers would run. A
    review of that found it blind to settings made inside a subclass's generate() (beams:
    a traceback; embeddings: wrong tokens), to a custom_generate loop that feeds the whole
    prompt (wrong tokens), to a subclass whose generate() takes no ``cache`` (a TypeError),
    and to a sentinel default transformers refuses (it dropped the subclass's
    ``use_cache=False``). Now the cache is made where transformers makes its own, and the
    prefix is loaded only in transformers' own prefill step: every case below gives the
    unwrapped model's tokens, and loads only where that is exact."""
    class NoKwargs(transformers.LlamaForCausalLM):
        def generate(self, input_ids, attention_mask=None, max_new_tokens=NEW):
            return super().generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                    do_sample=False)

    class BeamsInside(transformers.LlamaForCausalLM):
        def generate(self, *args, **kw):
            kw.setdefault("num_beams", 3)
            return super().generate(*args, **kw)

    class EmbedsInside(transformers.LlamaForCausalLM):  # a soft token in front of the prompt's embeddings
        def generate(self, input_ids, attention_mask=None, **kw):
            embeds = self.get_input_embeddings()(input_ids)
            embeds = torch.cat([embeds[:, :1] * 0.5, embeds], dim=1)
            return super().generate(inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2]), **kw)

    class SentinelNoCache(transformers.LlamaForCausalLM):
        def generate(self, input_ids, attention_mask=None, max_new_tokens=-1, use_cache=False, **kw):
            return super().generate(input_ids, attention_mask=attention_mask, use_cache=use_cache,
                                    max_new_tokens=NEW if max_new_tokens < 0 else max_new_tokens, **kw)

    def feed_the_whole_prompt(model, input_ids, logits_processor=None, stopping_criteria=None,
                              generation_config=None, **model_kwargs):
        cache, step = model_kwargs["cache"], input_ids  # a custom loop: its first step is the whole prompt
        for _ in range(generation_config.max_new_tokens):
            step = model(input_ids=step, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            input_ids = torch.cat([input_ids, step], dim=-1)
        return input_ids

    base, ids = tiny_model(), prompt()
    mask = torch.ones_like(ids)
    plain = dict(do_sample=False, max_new_tokens=NEW)
    cases = [  # (class, call keywords, reused tokens on the second call)
        (NoKwargs, {}, 28),
        (BeamsInside, plain, 0),
        (EmbedsInside, plain, 0),
        (SentinelNoCache, {}, None),  # no cache asked for: untiered
        (transformers.LlamaForCausalLM, dict(custom_generate=feed_the_whole_prompt, **plain), 0),
    ]
    for i, (cls, kw, reused) in enumerate(cases):
        want = _twin(base, cls)
        cfg = dataclasses.replace(config(tmp_path / f"c{i}"), device_budget="256KiB")  # room for 3 beams
        wrapped = tiercache.wrap(_twin(base, cls), cfg)
        with torch.no_grad():
            expected = want.generate(ids, attention_mask=mask, **kw)
            # an earlier plain request published the prompt's blocks
            with TieredCache(wrapped, wrapped._tiercache_config) as cache:
                transformers.LlamaForCausalLM.generate(wrapped, ids, attention_mask=mask, cache=cache, **plain)
            got = wrapped.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(expected, got), cls.__name__
        last = getattr(wrapped, "tiercache_last", None)
        assert (None if last is None else last.stats()["reused_tokens"]) == reused, cls.__name__


def test_wrap_neither_publishes_nor_loads_a_prompt_with_an_image(tmp_path):
    """A vision-language model's image KV sits at placeholder ids that every image shares.
    It was published under the ids alone, and the next request with the same text loaded
    it; LLaVA then failed inside ("Image features and image tokens do not match"), and
    another model could have answered about the first image. Inputs other than the ids
    now stop publishing and loading."""
    image_token = 120
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                                    max_position_embeddings=256, eos_token_id=None, pad_token_id=0)
    llava = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                                     vision_feature_select_strategy="default", vision_feature_layer=-1)
    base = transformers.LlavaForConditionalGeneration(llava).eval()
    base.generation_config.eos_token_id, base.generation_config.pad_token_id = None, 0
    want = _twin(base)
    ids = prompt()
    ids[0, 2:6] = image_token  # an 8x8 image in 4x4 patches: 4 placeholders
    images = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    wrapped = tiercache.wrap(base, config(tmp_path))
    with torch.no_grad():
        for image in images:  # image A, image A again, image B: same text
            got = wrapped.generate(ids, pixel_values=image, **kw)
            assert torch.equal(want.generate(ids, pixel_values=image, **kw), got)
            stats = wrapped.tiercache_last.stats()
            assert stats["reused_tokens"] == 0 and stats["prefill_tokens"] == PROMPT


def test_tiercache_generate_runs_greedy_on_its_cache_whatever_the_models_generation_config_says(tmp_path):
    """``tiercache generate`` (generate_text) loaded the prefix and passed its cache whatever
    the model's generation config said. A checkpoint saved with ``use_cache=False`` (usual
    after training with gradient checkpointing) fed the whole sequence to the cache at every
    step, and prompt lookup ran on top of a loaded prefix: wrong tokens; beams after a
    published run: a traceback. It now runs greedy, one beam, with its cache; a loop that
    does not prefill through transformers' own step (prompt lookup) loads nothing."""
    from tiercache.generation import generate_text

    ids = prompt()

    with torch.no_grad():
        want = tiny_model().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                     do_sample=False)[0, PROMPT:].tolist()
    for i, (setting, reused) in enumerate([(dict(use_cache=False), 28), (dict(num_beams=2), 28),
                                           (dict(prompt_lookup_num_tokens=3), 0)]):
        model, cfg = tiny_model(), config(tmp_path / f"c{i}")
        for key, value in setting.items():
            setattr(model.generation_config, key, value)
        for run_no in range(2):  # cold, then warm from the prefix cache
            result = generate_text("x", cfg, model=model, tokenizer=fixed_tokenizer(ids), max_new_tokens=NEW,
                                   progress=False, prefill_chunk=None)
            assert result["new_token_ids"] == want, (setting, run_no)
            assert result["stats"]["reused_tokens"] == (reused if run_no else 0), (setting, run_no)
    assert "_prefill" not in vars(model)  # its hooks went with the run (a saved model needed tiercache)
    # a wrapped model: the run is on this command's cache, not on one wrap() makes
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path / "w"))
    assert wrapped.tiercache_last is None
    result = generate_text("x", config(tmp_path / "c0"), model=wrapped, tokenizer=fixed_tokenizer(ids),
                           max_new_tokens=NEW, progress=False, prefill_chunk=None)
    assert result["new_token_ids"] == want and result["stats"]["reused_tokens"] == 28
    assert wrapped.tiercache_last is None and isinstance(vars(wrapped)["_prefill"], tiercache.hf._Hook)


def test_a_copy_of_a_wrapped_model_generates_with_its_own_weights(tmp_path):
    """wrap() put a closure over the model on it: ``copy.deepcopy`` kept the closure, so the
    copy's generate() ran the original's weights (a fine-tuned copy answered as the
    original), and once a call had left ``tiercache_last`` the copy failed. The hooks are
    now methods bound to the model, which deepcopy binds to the copy; a closed cache (the
    record of a finished call) is shared by the copy, an open one still cannot be copied."""
    base, ids = tiny_model(), prompt()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    wrapped = tiercache.wrap(base, config(tmp_path))
    with torch.no_grad():
        wrapped.generate(ids, **kw)
        clone = copy.deepcopy(wrapped)  # after a call: tiercache_last is closed
        assert clone.tiercache_last is wrapped.tiercache_last
        for param in clone.parameters():
            param.mul_(-1.0)
        want = _twin(clone).generate(ids, **kw)
        assert torch.equal(clone.generate(ids, **kw), want)
        assert not torch.equal(wrapped.generate(ids, **kw), want)
    assert clone.tiercache_last is not wrapped.tiercache_last


def test_a_wrapped_draft_model_keeps_transformers_cache_inside_assisted_generation(tmp_path):
    """Assisted generation calls the draft model's generate() once per round and hands it
    back its cache of the round before. A wrapped draft got a TieredCache that closed as its
    first call returned: "TieredCache is closed" at the second round. The draft's calls
    within assisted generation now keep transformers' own cache; the target stays tiered."""
    target, draft, ids = tiny_model(), tiny_model(seed=5), prompt()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    with torch.no_grad():
        want = _twin(target).generate(ids, assistant_model=_twin(draft), **kw)
        wrapped_target = tiercache.wrap(target, config(tmp_path / "t"))
        wrapped_draft = tiercache.wrap(draft, config(tmp_path / "d"))
        got = wrapped_target.generate(ids, assistant_model=wrapped_draft, **kw)
    assert torch.equal(want, got)
    assert wrapped_target.tiercache_last.stats()["decode_tokens"] > 0
    assert getattr(wrapped_draft, "tiercache_last", None) is None


def test_a_wrapped_model_round_trips_through_torch_save_and_keeps_its_record(tmp_path):
    """The hooks were bound methods: pickle restores those by looking their names up on the
    model, which had not got them back yet, so ``torch.load`` of a saved wrapped model
    failed (a review). After a call the closed ``tiercache_last`` refused pickling. Now the
    hooks pickle as themselves, and a finished call's record as None; the loaded model is
    still wrapped and gives the same tokens."""
    import io

    base, ids = tiny_model(), prompt()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    with torch.no_grad():
        want = _twin(base).generate(ids, **kw)
    wrapped = tiercache.wrap(base, config(tmp_path))
    for called in (False, True):
        if called:
            with torch.no_grad():
                wrapped.generate(ids, **kw)
        buf = io.BytesIO()
        torch.save(wrapped, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert getattr(loaded, "tiercache_last", None) is None
        with torch.no_grad():
            assert torch.equal(loaded.generate(ids, **kw), want)
        assert loaded.tiercache_last.stats()["decode_tokens"] == NEW - 1  # tiered, on its own weights
        assert loaded.tiercache_last is not getattr(wrapped, "tiercache_last", None)


def test_a_closed_cache_passed_back_is_refused_before_the_prompt_is_touched(tmp_path):
    """``return_dict_in_generate`` hands back the call's cache, closed as the call returns.
    Passed back for a second turn, it failed deep in the model ("TieredCache is closed", 31
    frames down, the prompt already sliced by its length). It is now refused as generate()
    prepares its cache, with what to do instead."""
    wrapped, ids = tiercache.wrap(tiny_model(), config(tmp_path)), prompt()
    with torch.no_grad():
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
        assert out.cache is wrapped.tiercache_last and out.cache.closed
        turn = torch.cat([out.sequences, prompt(seed=2, length=4)], dim=1)
        with pytest.raises(RuntimeError, match="TieredCache is closed.*call generate\\(\\) with the whole "
                                               "conversation.*pass a TieredCache of your own"):
            wrapped.generate(turn, attention_mask=torch.ones_like(turn), cache=out.cache, **GEN)
        again = wrapped.generate(turn, attention_mask=torch.ones_like(turn), **GEN)  # the way it names
    assert_same(reference(tiny_model(), turn), again)
    assert wrapped.tiercache_last.stats()["reused_tokens"] == (PROMPT + NEW - 1) // BT * BT


def test_a_closed_cache_is_refused_by_a_plain_model_too(tmp_path):
    """The refusal lived in wrap()'s hook: a model that was not wrapped, given a closed
    cache, sliced the prompt by its stale length and failed in a reshape inside the model
    (a review). transformers marks a caller's cache before it reads it; that mark now
    refuses a closed one. A cache closed by another thread under an update says so too,
    not "too many indices for tensor" from its released pool."""
    model, ids = tiny_model(), prompt()
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, do_sample=False)
    with pytest.raises(RuntimeError, match="TieredCache is closed"), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, do_sample=False)

    cache = TieredCache(model, config(tmp_path))
    with torch.no_grad():
        model(ids[:, :8], cache=cache, use_cache=True)
        pool = cache.store.device_pool
        write = pool.write_tokens

        def closed_under_it(*args, **kwargs):  # another thread closes the cache mid-update
            cache.close()
            return write(*args, **kwargs)

        pool.write_tokens = closed_under_it
        with pytest.raises(RuntimeError, match="TieredCache is closed") as caught:
            model(ids[:, 8:9], cache=cache, use_cache=True)
    assert caught.value.__cause__ is not None  # what the released pool raised, kept as the cause


def test_wrap_from_two_threads_at_once_keeps_the_models_own_generate(tmp_path):
    """Two threads wrapping one model at once: the second took the first's hook for the
    model's own generate(), and every call then recursed until a RecursionError (a review,
    with the first thread held just before it marks the model wrapped). wrap() now runs
    under a lock, and never takes a hook for the generate() it wraps."""
    import sys as sys_module
    import threading

    import tiercache.hf as hf

    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    mark = next(i for i, line in enumerate(open(hf.__file__).read().splitlines(), 1)
                if "model._tiercache_wrapped = True" in line)
    second_started = threading.Event()

    def hold_before_the_mark(frame, event, arg):
        if frame.f_code is not hf.wrap.__code__:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == mark:
                second_started.wait(10)
                time.sleep(0.3)  # the second wrap() runs now, if nothing keeps it out
            return local
        return local

    def first():
        sys_module.settrace(hold_before_the_mark)
        try:
            tiercache.wrap(model, cfg)
        finally:
            sys_module.settrace(None)

    def second():
        second_started.set()
        tiercache.wrap(model, cfg)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not isinstance(vars(model).get("_tiercache_inner_generate"), hf._Hook)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
    assert_same(reference(tiny_model(), ids), out)


def test_tiercache_last_is_this_calls_cache_or_none(tmp_path, caplog):
    """``tiercache_last`` stayed the previous call's after a call that ran untiered, and was
    the inner call's after a generate() run from a logits processor (a review). It is now the
    call's own cache, or None. A model whose own generation config says ``use_cache=False``
    (kept from training) runs untiered, and wrap() says so; so does a mode a TieredCache
    does not run (contrastive search's loop expands the cache per candidate)."""
    wrapped, ids = tiercache.wrap(tiny_model(), config(tmp_path)), prompt()
    mask = torch.ones_like(ids)

    class Nested(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            wrapped.generate(input_ids[:, :8], attention_mask=torch.ones_like(input_ids[:, :8]), max_new_tokens=1)
            return scores

    with torch.no_grad():
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=2)
        wrapped.generate(ids, attention_mask=mask, max_new_tokens=2, use_cache=False)
        assert wrapped.tiercache_last is None
        wrapped.generate(prompt(seed=3), attention_mask=mask, max_new_tokens=NEW,
                         logits_processor=transformers.LogitsProcessorList([Nested()]))
    stats = wrapped.tiercache_last.stats()
    assert (stats["prefill_tokens"], stats["decode_tokens"]) == (PROMPT, NEW - 1)

    def contrastive_like(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                         **model_kwargs):
        out = model._prefill(input_ids, generation_config, model_kwargs)
        out.cache.batch_repeat_interleave(generation_config.top_k)  # as contrastive search's recipe does
        return input_ids

    no_cache = tiny_model()
    no_cache.generation_config.use_cache = False
    with caplog.at_level("WARNING", logger="tiercache"):
        tiercache.wrap(no_cache, config(tmp_path / "n"))
        with torch.no_grad():
            wrapped.generate(ids, attention_mask=mask, penalty_alpha=0.6, top_k=4, max_new_tokens=3,
                             custom_generate=contrastive_like)
    assert wrapped.tiercache_last is None
    assert "generation_config has use_cache=False" in caplog.text
    assert "'contrastive_search' runs on transformers' own cache" in caplog.text


def test_a_closed_cache_lets_go_of_its_device_pool(tmp_path):
    """A closed store released its host pool but not its device pool, so the record of a
    finished call (``tiercache_last``, or a cache handed back) held the whole device budget:
    on a GPU, that much memory until the next call (a review: 512 MiB held)."""
    wrapped, ids = tiercache.wrap(tiny_model(), dataclasses.replace(config(tmp_path), device_budget="8MiB")), prompt()
    with torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)
    store = wrapped.tiercache_last.store
    assert store.closed and store.device_pool.nbytes == 0
    assert wrapped.tiercache_last.stats()["tiers"]["device"]["budget_bytes"] == 8 << 20


def test_tiercache_generate_checks_the_budget_with_the_chunks_generate_runs(tmp_path):
    """Where the model's generation config sets ``prefill_chunk_size`` and the command sets
    none, generate() prefills in the model's chunks, but the budget was checked for one
    unchunked prefill: runs that fit were refused with a wrong minimum (a review). And a
    model config asking for ``return_dict_in_generate`` ended the run with a TypeError."""
    from tiercache.generation import generate_text

    ids = prompt()

    with torch.no_grad():
        want = tiny_model(family="mistral").generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                                     do_sample=False)[0, PROMPT:].tolist()
    for budget in ("3KiB", "4KiB", "6KiB"):  # a sliding window of 6 in chunks of 4: fits in all three
        model = tiny_model(family="mistral")
        model.generation_config.prefill_chunk_size = 4
        model.generation_config.return_dict_in_generate = True
        cfg = dataclasses.replace(config(tmp_path / budget), device_budget=budget, reuse=False)
        result = generate_text("x", cfg, model=model, tokenizer=fixed_tokenizer(ids), max_new_tokens=NEW,
                               progress=False, prefill_chunk=None)
        assert result["new_token_ids"] == want, budget


def test_a_second_config_on_an_open_prefix_cache_is_named_in_a_warning(tmp_path, caplog):
    """The prefix cache is one per directory, model and geometry in a process, opened with
    the first config's settings; a later config's (re-wrapping with
    ``reuse_admission="reused"``) were ignored without a word (a review)."""
    model, ids = tiny_model(), prompt()
    run(model, ids, config(tmp_path))
    with caplog.at_level("WARNING", logger="tiercache"):
        out, stats = run(model, ids, config(tmp_path, reuse_admission="reused", remote_url="redis://u:secret@h:1"))
    assert "reuse_admission='reused' (open with 'always')" in caplog.text and "another remote_url" in caplog.text
    assert "secret" not in caplog.text
    assert stats["reused_tokens"] == 28  # the open cache's settings: as the warning says
    # once per settings, not at every call (it was); and settings as applied: the prefix
    # store runs lfu for layer-cycle, so lfu is no other setting (a false warning was)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tiercache"):
        for _ in range(3):
            run(model, ids, dataclasses.replace(config(tmp_path), disk_budget="32MiB"))
        run(model, ids, config(tmp_path, eviction="lfu"))
    assert caplog.text.count("is open in this process with other settings") == 1, caplog.text
    assert "disk_budget=33554432 (open with 16777216)" in caplog.text


def test_the_prompt_counts_as_prefill_however_it_is_fed(tmp_path):
    """A forward of one query token counted as a decode step: the token left to compute
    after a loaded prefix, and every prompt token under ``prefill_chunk_size=1``, went to
    ``decode_tokens`` (``tiercache generate`` then showed "prefill: 0 tokens" and folded the
    prompt into its decode rate; a review). Under wrap() the prompt now counts as prefill."""
    ids = prompt(length=4 * BT + 1)  # whole blocks and one token: a warm call computes one
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    with torch.no_grad():
        for expected_prefill in (4 * BT + 1, 1):  # cold, then warm
            wrapped.generate(ids, attention_mask=torch.ones_like(ids), **GEN)
            stats = wrapped.tiercache_last.stats()
            assert (stats["prefill_tokens"], stats["decode_tokens"]) == (expected_prefill, NEW - 1), stats
            assert stats["reused_tokens"] + stats["prefill_tokens"] == 4 * BT + 1
        other = prompt(seed=9)
        wrapped.generate(other, attention_mask=torch.ones_like(other), prefill_chunk_size=1, **GEN)
    stats = wrapped.tiercache_last.stats()
    assert (stats["prefill_tokens"], stats["decode_tokens"]) == (PROMPT, NEW - 1), stats


def test_prompt_counting_covers_embeddings_and_a_callers_cache(tmp_path):
    """The prompt-as-prefill rule missed a one-token prompt given as ``inputs_embeds``
    (transformers passes empty ids then) and a TieredCache the caller passed to a wrapped
    model (a review): both counted the prompt as decode."""
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    embeds = wrapped.get_input_embeddings()(prompt(length=1)).detach()
    with torch.no_grad():
        wrapped.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, 1, dtype=torch.long), **GEN)
        stats = wrapped.tiercache_last.stats()
        assert (stats["prefill_tokens"], stats["decode_tokens"]) == (1, NEW - 1), stats
        ids = prompt(seed=4)
        with TieredCache(wrapped, config(tmp_path / "own")) as cache:
            wrapped.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, prefill_chunk_size=1, **GEN)
            stats = cache.stats()
    assert (stats["prefill_tokens"], stats["decode_tokens"]) == (PROMPT, NEW - 1), stats


@pytest.mark.parametrize("mode", ["assisted", "prompt lookup"])
def test_tokens_after_the_prompt_are_decode_in_verification_forwards(tmp_path, mode):
    """Assisted generation and prompt lookup verify several drafted tokens in one forward.
    Under wrap(), where the prompt's length is known, each such forward counted as prefill:
    31 prefill tokens for a 10-token prompt (a review). The prompt is prefill now, and every
    token written after it is decode, drafted tokens a verification rejects included. After
    the call, a caller's own cache goes back to counting by forward length."""
    ids = prompt(length=10)
    kwargs = dict(GEN, max_new_tokens=12)
    kwargs.pop("do_sample", None)
    if mode == "assisted":
        draft = tiny_model()
        kwargs["assistant_model"] = draft
    else:
        kwargs["prompt_lookup_num_tokens"] = 3
    wrapped = tiercache.wrap(tiny_model(), config(tmp_path))
    with torch.no_grad():
        out = wrapped.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    stats = wrapped.tiercache_last.stats()
    written = stats["prefill_tokens"] + stats["decode_tokens"]
    assert stats["prefill_tokens"] == 10, stats
    assert written >= out.sequences.shape[-1] - 1 and stats["decode_tokens"] >= 11, stats
    with TieredCache(wrapped, config(tmp_path / "own")) as cache, torch.no_grad():
        wrapped.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        assert not cache._prompt_known
        more = torch.randint(2, 100, (1, 3))
        wrapped(more, cache=cache)  # a forward of its own after the call: three tokens, prefill
        stats = cache.stats()
    assert (stats["prefill_tokens"], stats["decode_tokens"]) == (10 + 3, NEW - 1), stats


@pytest.mark.parametrize("form", ["whole prompt", "new ids + whole mask"])
def test_counting_after_load_prefix_on_a_model_not_wrapped_stays_per_call(tmp_path, form):
    """``load_prefix()`` puts the prefill hook on a model that is not wrapped. The hook told
    the cache the prompt's length and nothing took it back: after the first generate() every
    later forward counted as decode (a second turn's 11 prompt tokens, a plain 4-token
    forward; a review). And a prompt given as only its new ids under a mask over the whole
    sequence counted as nothing at all. Now the prompt's length holds for its prefill only,
    and the new-ids form counts its ids as prefill."""
    model, a = tiny_model(), prompt()
    run(model, a, config(tmp_path))  # publishes A's blocks
    with TieredCache(model, config(tmp_path)) as cache, torch.no_grad():
        n = cache.load_prefix(a)
        ids = a if form == "whole prompt" else a[:, n:]
        out = model.generate(ids, attention_mask=torch.ones_like(a), cache=cache, **GEN)
        first = cache.stats()
        assert (first["reused_tokens"], first["prefill_tokens"], first["decode_tokens"]) == (n, PROMPT - n, NEW - 1)
        assert not cache._prompt_known
        seq = torch.cat([a, out.sequences[:, ids.shape[1]:], prompt(seed=5, length=10)], dim=1)
        model.generate(seq, attention_mask=torch.ones_like(seq), cache=cache, **GEN)
        second = cache.stats()
        assert second["prefill_tokens"] - first["prefill_tokens"] == 11  # the last new token and 10 more
        assert second["decode_tokens"] - first["decode_tokens"] == NEW - 1
        model(prompt(seed=6, length=4), cache=cache)  # a forward of its own: prefill by its length
        third = cache.stats()
    assert (third["prefill_tokens"] - second["prefill_tokens"], third["decode_tokens"]) == (4, second["decode_tokens"])


def test_blocks_too_long_for_a_records_token_ids_turn_the_prefix_cache_off(tmp_path):
    """A record's header holds its block's token ids, at most ``MAX_TOKEN_IDS`` (1333).
    ``block_tokens=2048`` with a disk_dir (the prefix cache on by default) failed
    generate() from inside the forward, at the first full block's publish, with "token_ids:
    packed ids ..." (a review). Automatic reuse is now off for such blocks and the run is
    exact; ``reuse=True`` is refused by name when the config is made."""
    from tiercache.disk import RecordCodec

    bt = 2048
    assert bt > RecordCodec.MAX_TOKEN_IDS
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, initializer_range=0.2, max_position_embeddings=4096, eos_token_id=None,
        pad_token_id=0)).eval()
    ids = prompt(length=bt + 60)
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", disk_dir=str(tmp_path / "kv"), disk_budget="16MiB",
                     block_tokens=bt)
    assert not cfg.reuse_enabled
    out, stats = run(model, ids, cfg)
    assert stats["published_blocks"] == 0
    assert_same(reference(model, ids), out)
    with pytest.raises(ValueError, match="reuse: .* at most 1333; block_tokens=2048"):
        cfg.replace(reuse=True)
    assert config(tmp_path).reuse_enabled  # short blocks: on, as before


def test_close_all_on_another_thread_during_a_prefix_load_is_a_miss(tmp_path):
    """``close_all()`` (README: how new prefix settings apply) landing while another
    thread's request loads its prefix closed the store under the load: that generate()
    failed with "BlockStore.read_into: the store is closed" (a review's four threads). The
    load is now a miss, the prompt is computed, and the tokens are the same; so is the
    lookup before it (its index closed under it read as a storage failure: the prefix cache
    off for the run), and a close() of the cache racing the same close_all()."""
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    run(model, ids, cfg)
    ref = reference(model, ids)
    def close_all_first(owner, name: str) -> None:  # the other thread's close_all() lands first
        call = getattr(owner, name)

        def closed_under(*args, **kw):
            close_all()
            return call(*args, **kw)
        setattr(owner, name, closed_under)

    with TieredCache(model, cfg) as cache, torch.no_grad():
        for owner, name in (("store", "read_into"), ("index", "rows")):  # the load, then the lookup
            cache.reset()
            close_all_first(getattr(cache._ensure_prefix(), owner), name)
            assert cache.load_prefix(ids) == 0
            assert cache._reuse, "a prefix cache closed under the lookup read as its storage failing: off"
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
            assert_same(ref, out)
        close_all_first(cache.prefix, "flush")  # close() checks the prefix cache is open, then it closes
    _, stats = run(model, ids, cfg)  # the directory is whole: the next request loads the prefix
    assert stats["reused_tokens"] == 28


def test_close_all_under_an_open_cache_reopens_the_prefix_cache(tmp_path):
    """README says new prefix settings apply after ``tiercache.prefix.close_all()``; a cache
    still open then failed its next publish with "BlockStore.put: the store is closed", half
    way through a forward (a review). It now opens the process's prefix cache again."""
    model, ids = tiny_model(), prompt()
    cfg = config(tmp_path)
    with TieredCache(model, cfg) as cache, torch.no_grad():
        first = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN).sequences
        close_all()
        longer = torch.cat([first, prompt(seed=6, length=8)], dim=1)  # the conversation goes on
        model.generate(longer, attention_mask=torch.ones_like(longer), cache=cache, **GEN)
    out, stats = run(model, longer, cfg)  # what the second call published is there to load
    assert stats["reused_tokens"] == (longer.shape[1] - 1) // BT * BT
    assert_same(reference(model, longer), out)


def test_a_plugin_that_fails_in_the_prefix_caches_store_is_named_there_and_not_forgotten(tmp_path, caplog):
    """The prefix cache's store is the process's, shared by every cache that uses it, and
    it evicts with the cache's eviction policy. A plug-in that failed there was reported as
    if a cache's own tier had failed, with the advice to "make a new cache"; the next
    caches then ran with ``lru`` in its place in that store, in silence (a review). The
    error now names the prefix cache's store and says what helps (closing it), and each
    new cache that opens the store while it is so logs a warning. The tokens stay exact."""
    import logging

    from tiercache.policies import EVICTION_POLICIES, LRUPolicy
    from tiercache.prefix import _OPEN

    class FailsWhenArmed(LRUPolicy):
        armed = False

        def evict(self, n, is_evictable):
            if self.armed:
                raise RuntimeError("a bug in evict")
            return super().evict(n, is_evictable)

    EVICTION_POLICIES["fails-when-armed"] = FailsWhenArmed
    try:
        model = tiny_model()
        cfg = config(tmp_path, eviction="fails-when-armed", reuse_host_budget="16KiB")
        ids = prompt(seed=1)
        assert_same(reference(model, ids), run(model, ids, cfg)[0])
        (store,) = [prefix.store for prefix in _OPEN.values()]
        for policy in store.policies.values():
            policy.inner.armed = True
        message = (r"the eviction policy 'fails-when-armed' of the host tier of the prefix cache's store failed in "
                   r"evict: RuntimeError: a bug in evict\. .* close the prefix cache's store "
                   r"\(tiercache\.prefix\.close_all\(\)\)")
        with pytest.raises(tiercache.PolicyError, match=message):
            for seed in range(2, 12):  # new prompts: the store's host tier fills and evicts
                run(model, prompt(seed=seed), cfg)
        assert [failure for failure in store.policy_failures()]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tiercache"):
            ids = prompt(seed=20)
            assert_same(reference(model, ids), run(model, ids, cfg)[0])
        assert any("still so: the eviction policy 'fails-when-armed'" in r.getMessage() for r in caplog.records)
    finally:
        del EVICTION_POLICIES["fails-when-armed"]
