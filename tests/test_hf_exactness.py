"""Exactness of ``TieredCache`` against transformers' ``DynamicCache``.

The invariant under test (from the issue): with a lossless configuration -- any budgets,
any eviction and prefetch policy -- the logits of ``model.generate`` with a TieredCache
equal those with the default ``DynamicCache`` (max abs difference <= 1e-5 in fp32), and the
generated tokens are identical. Budgets are chosen so small that every tier is used: the
device tier holds one layer's working set and a little more, the host tier a few blocks,
and the disk tier (under pytest's ``tmp_path``) the rest.

Tiny random models of seven families are used (2-3 layers, hidden 64, vocab 128,
``initializer_range=0.2`` so that a wrong mask, a stale block or a misplaced row changes
the logits visibly). Gemma2, Mistral and Qwen2 carry sliding-window layers whose window (6)
is exceeded by the prompt alone.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import re
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: E402

import tiercache  # noqa: E402
from tiercache import CapacityError, Tier, TierConfig, TieredCache, UnsupportedModelError  # noqa: E402
from tiercache.config import AUTO, PREFETCH_DEPTH_POLICIES  # noqa: E402
from tiercache.policies import EVICTION_POLICIES  # noqa: E402

BT = 4  # block_tokens
PROMPT = 10  # prompt tokens (> sliding window 6)
NEW = 12  # new tokens per generate() call
WINDOW = 6  # sliding window of the families that have one
ATOL = 1e-5
VOCAB = 128
PAD, BOS = 0, 1
HOST_BLOCKS = 3  # host slots: fewer than one layer's blocks
EXTRA = 7  # tokens appended to the first output before the second generate() call
ASSISTANT_TOKENS = 3  # initial num_assistant_tokens (the heuristic schedule changes it)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2"]
# Not "reuse+assisted": transformers 5.24's assisted decoding re-feeds the whole prompt on a
# non-empty cache (DynamicCache too: 15 cached tokens + a 24-token forward), so there is no
# meaningful reference to match.
MODES = ["prefill", "chunked", "batch2", "beam", "reuse", "assisted", "beam+batch2+chunked", "reuse+chunked"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Tiny configs and models
# ---------------------------------------------------------------------------------------------
def make_config(family: str, assistant: bool = False):
    """A tiny config of ``family``; ``assistant=True`` gives a smaller model of the same vocab.

    No EOS token, so every generation runs its full length; PAD is token 0.
    """
    layers = 2 if assistant else 3
    hidden, heads, kv_heads = (32, 2, 1) if assistant else (64, 4, 2)
    common = dict(vocab_size=VOCAB, initializer_range=0.2, pad_token_id=PAD, bos_token_id=BOS,
                  eos_token_id=None, tie_word_embeddings=False)
    dec = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
               **common)
    if family == "llama":
        return transformers.LlamaConfig(**dec)
    if family == "mistral":  # every layer slides
        return transformers.MistralConfig(sliding_window=WINDOW, **dec)
    if family == "qwen2":  # layer 0 full, the others sliding
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **dec)
    if family == "qwen3":  # explicit head_dim, q/k norms
        return transformers.Qwen3Config(head_dim=16, **dec)
    if family == "gemma2":  # sliding and full layers alternate; soft-capping; eager attention
        types = ["sliding_attention", "full_attention", "sliding_attention"][:layers]
        return transformers.Gemma2Config(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                         layer_types=types, **dec)
    if family == "phi3":  # fused qkv
        return transformers.Phi3Config(**dec)
    if family == "gpt2":  # learned positions, no GQA
        return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=256, **common)
    raise ValueError(family)


@functools.lru_cache(maxsize=None)
def tiny_model(family: str, assistant: bool = False):
    """The seeded tiny model of ``family`` (built once per session; inference only)."""
    torch.manual_seed(1234 + (7 if assistant else 0))
    config = make_config(family, assistant)
    kwargs = {"attn_implementation": "eager"} if family == "gemma2" else {}
    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()
    model.requires_grad_(False)
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, PAD, BOS
    gc.do_sample = False
    if assistant:  # varied draft lengths, reset at every call (no state leaks between runs)
        gc.num_assistant_tokens = ASSISTANT_TOKENS
        gc.num_assistant_tokens_schedule = "heuristic_transient"
    return model


def prompt_ids(batch: int = 1, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=g)


# ---------------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------------
def kv_shape(model) -> tuple:
    """(kv_heads, head_dim) of the model's attention layers."""
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return kv_heads, head_dim


def block_bytes(model, batch: int, block_tokens: int = BT) -> int:
    kv_heads, head_dim = kv_shape(model)
    return 2 * batch * kv_heads * block_tokens * head_dim * model.dtype.itemsize


def layer_windows(model) -> list:
    """Per layer: the sliding window, or None for a full-attention layer."""
    types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return [kw.get("sliding_window") if t != "full_attention" else None for t, kw in zip(types, kwargs)]


def assisted_read(windows: list) -> int:
    """The most tokens one layer reads in a forward of assisted generation (``NEW`` new
    tokens after a ``PROMPT``-token prompt). Past recording keeps a sliding layer's blocks
    from one crop to the next (the draft tokens on top of the window), so each layer counts
    as a full one reading this many. Where every layer slides, a forward reads at most the
    prompt and the longest verification (the crops trim the rest); a full layer may read
    the whole run and a draft more."""
    if all(w is not None for w in windows):
        return PROMPT + NEW + 1
    return PROMPT + NEW + ASSISTANT_TOKENS + 8


def working_set_blocks(windows: list, schedule: list, block_tokens: int = BT) -> int:
    """Blocks that one layer's attention reads at once, maxed over layers and forwards.

    ``schedule`` lists the query length of each forward. A sliding layer reads the last
    ``window - 1`` cached tokens plus the new ones; a full layer reads everything.
    """
    widest = 0
    for window in windows:
        seen = 0
        for q in schedule:
            start = max(seen - window + 1, 0) if window else 0
            end = seen + q
            widest = max(widest, math.ceil(end / block_tokens) - start // block_tokens)
            seen = end
    return widest


def tight_config(model, tmp_path, *, batch: int, device_blocks: int, host_blocks: int = None,
                 block_tokens: int = BT, **policies) -> TierConfig:
    """Device: ``device_blocks`` blocks; host: a few slots; disk: plenty, under tmp_path."""
    bb = block_bytes(model, batch, block_tokens)
    host_slot = math.ceil(bb / 4096) * 4096
    disk_record = 4096 + host_slot
    if host_blocks is None:
        host_blocks = HOST_BLOCKS
    return TierConfig(device_budget=device_blocks * bb, host_budget=host_blocks * host_slot,
                      disk_budget=256 * disk_record, disk_dir=str(tmp_path / "kv"),
                      block_tokens=block_tokens, io_workers=2, **policies)


@contextlib.contextmanager
def registered(registry: dict, name: str, cls):
    """``cls`` registered as ``name`` in a policy registry for the block (a plug-in)."""
    registry[name] = cls
    try:
        yield name
    finally:
        del registry[name]


def assert_plugin_refused(registry: dict, kind: str, cls, message: str, tmp_path, max_new_tokens: int = NEW,
                          **config) -> None:
    """``cls``, registered as the ``kind`` policy "broken" (with ``config``), stops
    ``generate()`` on the tiny Llama with a ``PolicyError`` naming it and ``message``."""
    model = tiny_model("llama")
    with registered(registry, "broken", cls):
        cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, **{kind: "broken"}, **config)
        with tiercache.TieredCache(model, cfg) as cache:
            with pytest.raises(tiercache.PolicyError, match=rf"the {kind} policy 'broken' .*{message}"):
                generate(model, prompt_ids(), cache=cache, max_new_tokens=max_new_tokens)


# ---------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------
GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def generate(model, ids, cache=None, mask=None, **kwargs):
    if mask is None:
        mask = torch.ones_like(ids)
    if cache is not None:
        kwargs["cache"] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN, **kwargs)


def assert_same(ref, out, what: str = "") -> float:
    """Same tokens; logits within ATOL at every step. Returns the max abs difference."""
    assert torch.equal(ref.sequences, out.sequences), f"{what}: tokens differ\n{ref.sequences}\n{out.sequences}"
    assert len(ref.logits) == len(out.logits), what
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert diff <= ATOL, f"{what}: max abs logit difference {diff:.3g} > {ATOL}"
    return diff


def moved(stats: dict, src: str = None, dst: str = None) -> int:
    return sum(m["blocks"] for name, m in stats["moves"].items()
               if (src is None or name.split("->")[0] == src) and (dst is None or name.split("->")[1] == dst))


def assert_all_tiers_used(stats: dict) -> None:
    """Blocks went down to host and to disk, and came back up from below (to the device, or on
    CPU, where attention reads host blocks in place, from disk to the host)."""
    assert stats["tiers"]["disk"]["budget_bytes"] > 0 and stats["tiers"]["host"]["budget_bytes"] > 0
    assert moved(stats, dst="host") > 0, stats["moves"]
    assert moved(stats, dst="disk") > 0, stats["moves"]
    assert stats["evictions"]["device"] > 0, stats["evictions"]
    assert stats["hits"]["host"] + stats["hits"]["disk"] > 0, stats["hits"]  # reads served from below
    assert stats["hits"]["host"] + stats["hits"]["disk"] > 0, stats["hits"]


CHUNK = 3  # prefill_chunk_size: not a multiple of block_tokens, so chunks append to tail blocks


def run_mode(family: str, mode: str, tmp_path, *, block_tokens: int = BT, device_extra: int = 1,
             host_blocks: int = None, chunk: int = CHUNK, **policies) -> dict:
    """Run ``mode`` with DynamicCache and with a tight TieredCache; compare; return stats.

    ``mode`` is "prefill" or "+"-joined features: "chunked" (prefill in chunks of ``chunk``
    tokens), "batch2" (two rows, one left-padded), "beam" (3 beams), "reuse" (two generate()
    calls on one cache), "assisted" (a draft model; the cache is cropped on rejections).
    The device tier gets the working set of one step plus ``device_extra`` blocks.
    """
    model = tiny_model(family)
    windows = layer_windows(model)
    features = set(mode.split("+"))
    batch = 1
    ids = prompt_ids()
    mask = None
    kwargs = dict(max_new_tokens=NEW)
    prefill = [PROMPT]
    decode = [1] * (NEW - 1)
    if "chunked" in features:
        kwargs["prefill_chunk_size"] = chunk
        prefill = [chunk] * (PROMPT // chunk) + ([PROMPT % chunk] if PROMPT % chunk else [])
    if "batch2" in features:
        batch = 2
        ids = prompt_ids(batch=2, seed=1)
        mask = torch.ones_like(ids)
        ids[1, :3] = PAD  # left padding of row 1
        mask[1, :3] = 0
    if "beam" in features:
        batch *= 3
        kwargs.update(num_beams=3, num_return_sequences=1, length_penalty=0.0)
    if "reuse" in features:
        half = NEW // 2
        decode = [1] * (half - 1) + [EXTRA + 1] + [1] * (half - 1)
    if "assisted" in features:
        kwargs["assistant_model"] = tiny_model(family, assistant=True)
        windows = [None] * len(windows)
        prefill, decode = [assisted_read(layer_windows(model))], []

    device_blocks = working_set_blocks(windows, prefill + decode, block_tokens) + device_extra
    cfg = tight_config(model, tmp_path, batch=batch, device_blocks=device_blocks, host_blocks=host_blocks,
                       block_tokens=block_tokens, **policies)

    if "reuse" in features:
        kwargs.pop("max_new_tokens")
        return _run_reuse(model, ids, cfg, **kwargs)

    ref = generate(model, ids, mask=mask, **kwargs)
    with tiercache.TieredCache(model, cfg) as cache:
        calls = _spy(cache)
        out = generate(model, ids, cache=cache, mask=mask, **kwargs)
        stats = cache.stats()
        rows = cache.store.geometry.batch
    assert out.sequences.shape[-1] == PROMPT + NEW, "generation stopped early"
    assert_same(ref, out, f"{family}/{mode}")
    # The scenario really happened on the tiered cache:
    assert rows == batch
    if "chunked" in features:
        assert calls["update"][:len(prefill)] == prefill, calls["update"]
    if "beam" in features:
        assert calls["reorder_cache"], "beam search never reordered the cache"
    if "assisted" in features:
        assert calls["crop"], "assisted generation never rolled the cache back (crop)"
        assert any(q > 1 for q in calls["update"][1:]), "no multi-token verification step"
    return stats


def _spy(cache) -> dict:
    """Record query lengths of layer-0 updates, negative crops and beam reorders."""
    calls = {"update": [], "crop": [], "reorder_cache": []}
    update, crop, reorder = cache.update, cache.crop, cache.reorder_cache

    def spy_update(key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            calls["update"].append(key_states.shape[-2])
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    def spy_crop(n):
        if n < 0:
            calls["crop"].append(n)
        return crop(n)

    def spy_reorder(beam_idx):
        calls["reorder_cache"].append(beam_idx.tolist())
        return reorder(beam_idx)

    cache.update, cache.crop, cache.reorder_cache = spy_update, spy_crop, spy_reorder
    return calls


def _run_reuse(model, ids, cfg, **kwargs) -> dict:
    """Two generate() calls on one cache; the second prompt extends the first output by
    EXTRA tokens (more than a sliding window). DynamicCache does the same for reference."""
    extra = prompt_ids(length=EXTRA, seed=5)
    half = NEW // 2
    ref_cache = transformers.DynamicCache(config=model.config)
    ref1 = generate(model, ids, cache=ref_cache, max_new_tokens=half, **kwargs)
    ref_len1 = ref_cache.get_seq_length()
    ref2 = generate(model, torch.cat([ref1.sequences, extra], -1), cache=ref_cache, max_new_tokens=half, **kwargs)
    with tiercache.TieredCache(model, cfg) as cache:
        out1 = generate(model, ids, cache=cache, max_new_tokens=half, **kwargs)
        assert_same(ref1, out1, "reuse, first call")
        assert cache.get_seq_length() == ref_len1
        out2 = generate(model, torch.cat([out1.sequences, extra], -1), cache=cache, max_new_tokens=half, **kwargs)
        assert cache.get_seq_length() == ref_cache.get_seq_length()
        stats = cache.stats()
    assert_same(ref2, out2, "reuse, second call")
    assert out2.sequences.shape[-1] == PROMPT + NEW + EXTRA
    return stats


# ---------------------------------------------------------------------------------------------
# The matrix: families x modes
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def dynamic_cache_supports(family: str, mode: str):
    """None when DynamicCache runs ``mode`` for ``family``, else the reason it cannot."""
    features = set(mode.split("+"))
    kwargs = {}
    if "assisted" in features:
        kwargs["assistant_model"] = tiny_model(family, assistant=True)
    if "chunked" in features:
        kwargs["prefill_chunk_size"] = CHUNK
    if "beam" in features:
        kwargs["num_beams"] = 3
    try:
        generate(tiny_model(family), prompt_ids(), max_new_tokens=2, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure means the family cannot do it
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_dynamic_cache(family, mode, tmp_path):
    """Each family x generation mode, on budgets that force every tier: tokens identical and
    logits within 1e-5 of DynamicCache's at every step; blocks visibly moved through host and
    disk and were read back from below."""
    reason = dynamic_cache_supports(family, mode)
    if reason:
        pytest.skip(f"{family} cannot run {mode} even with DynamicCache: {reason}")
    stats = run_mode(family, mode, tmp_path)
    assert_all_tiers_used(stats)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prefetch", ["none", "next-layer", "lookahead"])
@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu"])
def test_policies_are_lossless(eviction, prefetch, mode, tmp_path):
    """Every eviction x prefetch policy is lossless in every mode: Gemma2 (sliding + full
    layers, soft-capping) matches DynamicCache exactly while blocks cycle through all tiers."""
    stats = run_mode("gemma2", mode, tmp_path, eviction=eviction, prefetch=prefetch)
    assert_all_tiers_used(stats)


def test_a_plugin_policy_bug_stops_generate_by_name_and_costs_no_tokens(tmp_path):
    """A plug-in eviction policy that raises on its sixth ``evict`` (mid-decode, blocks on
    every tier): ``generate()`` stops with a ``PolicyError`` naming the policy, the tier and
    the call (raised by the store's next call, once the step that met it is complete), and
    what the cache holds then is consistent and exact. The same plug-in, fixed, in a new
    cache gives DynamicCache's logits."""
    class Brittle(EVICTION_POLICIES["lru"]):
        calls, breaks_at = 0, 6

        def evict(self, n, is_evictable):
            Brittle.calls += 1
            if Brittle.calls == Brittle.breaks_at:
                raise ZeroDivisionError("policy bug")
            return super().evict(n, is_evictable)

    with registered(EVICTION_POLICIES, "brittle", Brittle):
        model = tiny_model("llama")
        ids = prompt_ids()
        need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
        cfg = tight_config(model, tmp_path, batch=1, device_blocks=need + 1, eviction="brittle")
        ref = generate(model, ids, max_new_tokens=NEW)
        cache = tiercache.TieredCache(model, cfg)
        with pytest.raises(tiercache.PolicyError, match=r"'brittle' of the \w+ tier failed in evict: "
                                                        r"ZeroDivisionError: policy bug"):
            generate(model, ids, cache=cache, max_new_tokens=NEW)
        # What the cache holds after the failure is whole and exact: the table's invariants
        # and budgets hold, no pin beyond the current step's own, and every token stored so
        # far has DynamicCache's K and V.
        store = cache.store
        store.wait_idle()
        store.check()
        assert sum(store.table.get(k).pins for k in store.table.keys()) == len(cache._pinned)
        for i, layer in enumerate(cache.layers):
            n = layer.num_tokens
            assert 0 < n <= ref.past_key_values.get_seq_length(i)
            kv = torch.cat([store.get(key) for key in cache._blocks_of(i)], dim=3)[..., :n, :]
            want = ref.past_key_values.layers[i]
            assert torch.allclose(kv[0], want.keys[:, :, :n], atol=ATOL), f"layer {i}: K differs"
            assert torch.allclose(kv[1], want.values[:, :, :n], atol=ATOL), f"layer {i}: V differs"
        cache.close()
        assert Brittle.calls >= Brittle.breaks_at
        Brittle.breaks_at = -1  # fixed
        with tiercache.TieredCache(model, tight_config(model, tmp_path / "again", batch=1, device_blocks=need + 1,
                                                       eviction="brittle")) as cache:
            out = generate(model, ids, cache=cache, max_new_tokens=NEW)
            stats = cache.stats()
        assert_same(ref, out, "the fixed plug-in")
        assert_all_tiers_used(stats)


def _streamed_run(tmp_path, **config):
    """The tiny Llama, a prompt, and a config whose device holds the working set and two
    blocks more, so that blocks stream from every tier: (model, ids, config)."""
    model = tiny_model("llama")
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    return model, prompt_ids(), tight_config(model, tmp_path, batch=1, device_blocks=need + 2, **config)


@pytest.mark.parametrize("breach, message", [
    ("a number", "plan: it returned int, not a list of block keys"),
    ("an unhashable key", r"plan: it named \[1, 2\], which is not a block key"),
    ("raises in plan", "failed in plan: KeyError"),
    ("raises in observe", "failed in observe: KeyError"),
    ("keys it does not hold", None),
    ("a set", None),
    ("a generator", None),
])
def test_a_plugin_prefetch_plan_is_checked_and_keys_it_does_not_hold_are_skipped(breach, message, tmp_path):
    """A plug-in prefetch policy's plan must be a list of block keys, most urgent first (a
    set or a generator will do). A number, an unhashable key, or an exception in ``plan``
    or ``observe`` stops ``generate()`` with a ``PolicyError`` naming the policy and the
    call (an unhashable key used to be a ``TypeError`` from inside the store). Keys the
    cache does not hold (another sequence's, made up) are skipped: the logits equal
    DynamicCache's."""
    from tiercache.policies import PREFETCH_POLICIES

    class Sloppy(PREFETCH_POLICIES["next-layer"]):
        def observe(self, layer_idx, keys):
            if breach == "raises in observe" and layer_idx == 1:
                raise KeyError(layer_idx)
            super().observe(layer_idx, keys)

        def plan(self, layer_idx, num_layers, blocks_of_layer):
            ahead = list(super().plan(layer_idx, num_layers, blocks_of_layer))
            if breach == "a number":
                return len(ahead)
            if breach == "a generator":
                return (key for key in ahead)
            if breach == "a set":
                return set(ahead)
            if breach == "an unhashable key":
                return ahead + [[1, 2]]
            if breach == "raises in plan" and layer_idx == 1:
                raise KeyError(layer_idx)
            if breach == "keys it does not hold":
                return [tiercache.BlockKey(99, layer_idx, 0), ("made", "up")] + ahead
            return ahead

    with registered(PREFETCH_POLICIES, "sloppy", Sloppy):
        model, ids, cfg = _streamed_run(tmp_path, prefetch="sloppy")
        with tiercache.TieredCache(model, cfg) as cache:
            if message is None:
                out = generate(model, ids, cache=cache, max_new_tokens=NEW)
                assert_same(generate(model, ids, max_new_tokens=NEW), out, breach)
                assert_all_tiers_used(cache.stats())
            else:
                with pytest.raises(tiercache.PolicyError, match=rf"the prefetch policy 'sloppy' .*{message}"):
                    generate(model, ids, cache=cache, max_new_tokens=NEW)


NEW_EVICTIONS = sorted(set(EVICTION_POLICIES) - {"lru", "fifo", "lfu"})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eviction,prefetch", [(e, "next-layer") for e in NEW_EVICTIONS] + [("lru", "history")])
def test_lab_policies_are_lossless(eviction, prefetch, mode, tmp_path):
    """The policy lab's policies (arc, s3fifo, sinks-recent, layer-cycle, attention-score with the attention
    hook feeding it scores, and history prefetch) are placement only: exact in every mode."""
    stats = run_mode("gemma2", mode, tmp_path, eviction=eviction, prefetch=prefetch)
    assert_all_tiers_used(stats)


def test_attention_score_policy_gets_scores_from_the_hook(tmp_path):
    """With eviction="attention-score", TieredCache routes attention through tiercache's hook,
    which feeds each decode step's per-block attention mass to the device tier's policy."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, eviction="attention-score")
    with TieredCache(model, cfg) as cache:
        generate(model, prompt_ids(), cache=cache, max_new_tokens=4)
        assert model.config._attn_implementation == "tiercache"
        policy = cache.store.policies[Tier.DEVICE]
        assert policy._score and all(v >= 0 for v in policy._score.values())


def test_lookahead_deeper_than_model(tmp_path):
    """A lookahead depth larger than the number of layers stays exact (it wraps around)."""
    stats = run_mode("llama", "prefill", tmp_path, prefetch="lookahead", prefetch_depth=8)
    assert_all_tiers_used(stats)


# the policies tiercache ships (a plug-in another installed package registers would reshuffle the cases)
BUILT_IN_EVICTIONS = sorted(name for name, cls in EVICTION_POLICIES.items()
                            if cls.__module__.startswith("tiercache.policies."))


def _random_cases(n: int, seed: int = 2024) -> list:
    import random

    rng = random.Random(seed)
    cases = []
    for i in range(n):
        case = [rng.choice(FAMILIES), rng.choice(MODES), rng.choice([1, 2, 3, 5, 8]), rng.randint(0, 3),
                rng.randint(1, 12), rng.choice(BUILT_IN_EVICTIONS),
                rng.choice(["none", "next-layer", "lookahead", "history", AUTO]), rng.randint(1, 4),
                rng.choice([2, 3, 5, 8])]
        if case[6] not in PREFETCH_DEPTH_POLICIES:  # a depth the policy does not read is refused
            case[7] = TierConfig.prefetch_depth
        cases.append(pytest.param(*case, id=f"case{i}"))
    return cases


@pytest.mark.parametrize("family,mode,block_tokens,device_extra,host_blocks,eviction,prefetch,depth,chunk",
                         _random_cases(32))
def test_random_budgets_and_block_sizes(family, mode, block_tokens, device_extra, host_blocks, eviction,
                                        prefetch, depth, chunk, tmp_path):
    """Seeded random family, mode, block size (1..8 tokens, so blocks straddle chunk and
    window edges differently), prefill chunk (2..8, up to more than the window), device
    slack (0..3 blocks above the minimum), host size (1..12 slots) and policies (every
    shipped eviction policy; every prefetch policy and ``auto``, 1..4 layers deep):
    still exact."""
    reason = dynamic_cache_supports(family, mode)
    if reason:
        pytest.skip(f"{family} cannot run {mode} even with DynamicCache: {reason}")
    run_mode(family, mode, tmp_path, block_tokens=block_tokens, device_extra=device_extra,
             host_blocks=host_blocks, chunk=chunk, eviction=eviction, prefetch=prefetch, prefetch_depth=depth)


def test_bfloat16_is_lossless_too(tmp_path):
    """A bf16 model (blocks of 2-byte elements) on all tiers: same tokens, same logits."""
    import copy

    model = copy.deepcopy(tiny_model("gemma2")).to(torch.bfloat16)
    ids = prompt_ids()
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need + 1)
    ref = generate(model, ids, max_new_tokens=NEW)
    with tiercache.TieredCache(model, cfg) as cache:
        out = generate(model, ids, cache=cache, max_new_tokens=NEW)
        stats = cache.stats()
        assert cache.store.geometry.dtype == torch.bfloat16
    assert_same(ref, out, "bf16")
    assert_all_tiers_used(stats)


def test_reset_then_reuse_with_another_batch(tmp_path):
    """reset() empties the cache; the same cache then serves a batch of two (left-padded)
    exactly like a fresh DynamicCache."""
    model = tiny_model("qwen2")
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    cfg = tight_config(model, tmp_path, batch=2, device_blocks=need + 1)
    ids2 = prompt_ids(batch=2, seed=3)
    mask2 = torch.ones_like(ids2)
    ids2[0, :4], mask2[0, :4] = PAD, 0
    ref1 = generate(model, prompt_ids(), max_new_tokens=NEW)
    ref2 = generate(model, ids2, mask=mask2, max_new_tokens=NEW)
    with tiercache.TieredCache(model, cfg) as cache:
        out1 = generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW)
        cache.reset()
        assert cache.get_seq_length() == 0
        out2 = generate(model, ids2, cache=cache, mask=mask2, max_new_tokens=NEW)
        stats = cache.stats()
    assert_same(ref1, out1, "before reset")
    assert_same(ref2, out2, "after reset, batch 2")
    assert_all_tiers_used(stats)


def test_offload_and_prefetch_move_a_layer_between_tiers_and_stay_exact(tmp_path):
    """transformers' ``Cache.offload(layer)`` / ``Cache.prefetch(layer)`` on a TieredCache (they
    crashed inside transformers, a layer holding no tensors): a manual decode loop offloads
    the layers after each step, so the next step reads them back from the host; a prefetch
    brings one up before it is needed; blocks pinned for the forward stay. Logits equal
    DynamicCache's at every step; sliding layers stay put unless ``only_non_sliding=False``,
    as in transformers."""
    model = tiny_model("gemma2")
    sliding = [layer.is_sliding for layer in tiercache.TieredCache(model).layers]
    assert sliding == [True, False, True]
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", block_tokens=BT)
    ids = prompt_ids()

    def on_device(cache, layer_idx: int) -> int:
        return sum(Tier.DEVICE in cache.store.tiers_of(k) for k in cache._blocks_of(layer_idx))

    ref, out = transformers.DynamicCache(config=model.config), tiercache.TieredCache(model, cfg)
    with out, torch.no_grad():
        x_ref = x_out = ids
        for step in range(NEW):
            a = model(x_ref, cache=ref, use_cache=True).logits[:, -1]
            b = model(x_out, cache=out, use_cache=True).logits[:, -1]
            assert torch.equal(a.argmax(-1), b.argmax(-1)), step
            assert (a - b).abs().max().item() <= ATOL, step
            x_ref = x_out = a.argmax(-1, keepdim=True)
            out.store.wait_idle()
            before = [on_device(out, i) for i in range(3)]
            assert all(before), before
            out.offload(0)  # sliding: skipped by default, as in transformers
            out.offload(1)
            out.offload(2, only_non_sliding=False)  # pinned until the next forward: stays
            out.store.wait_idle()
            assert [on_device(out, i) for i in range(3)] == [before[0], 0, before[2]]
            out.offload(0, only_non_sliding=False)
            out.store.wait_idle()
            assert [on_device(out, i) for i in range(3)] == [0, 0, before[2]]
            if step % 2:
                out.prefetch(0)  # sliding: skipped
                out.prefetch(1)
                out.store.wait_idle()
                assert [on_device(out, i) for i in range(3)] == [0, len(out._blocks_of(1)), before[2]]
        stats = out.stats()
    assert stats["moves"]["device->host"]["blocks"] > 0 and stats["moves"]["host->device"]["blocks"] > 0


def test_the_cache_api_names_a_wrong_argument(tmp_path):
    """Found by a review: ``offload(99)`` was an IndexError from inside transformers,
    ``prefetch("a")`` a TypeError, ``offload(-1)`` taken as the last layer; ``trace=123``
    was accepted and failed mid-generate(); ``load_prefix`` of a list was an AttributeError
    from inside and of a 1-D tensor a silent miss (0 tokens loaded); ``serve_metrics({})``
    an AttributeError. Each is now an error that names the argument; nothing was changed."""
    from tiercache.metrics import serve_metrics

    model = tiny_model("llama")
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", disk_dir=str(tmp_path / "kv"), disk_budget="4MiB",
                     block_tokens=BT)
    ids = prompt_ids()
    with pytest.raises(TypeError, match="trace: expected a file path or a tiercache.lab.trace.TraceWriter, got int"):
        tiercache.TieredCache(model, cfg, trace=123)
    with tiercache.TieredCache(model, cfg) as cache:
        generate(model, ids, cache=cache, max_new_tokens=2)
        layers = len(cache.layers)
        for call in (cache.offload, cache.prefetch):
            for bad in (layers, -1, "a", 1.0, True):
                with pytest.raises(ValueError, match=rf"layer_idx must be an integer in \[0, {layers}\), got "):
                    call(bad)
    # direct update() calls (a review): a negative layer was taken (and its disk moves failed
    # later, logged), a 3-D K an unpacking error, K and V of two lengths an error from a copy,
    # int64 K/V a store of ints; each is now named before anything is stored
    kv = torch.randn(1, 2, 3, 16)
    with tiercache.TieredCache(model, cfg) as fresh:
        for k, v, layer_idx, message in (
                (kv, kv, -1, r"layer_idx must be in \[0, 3\), got -1"),
                (kv[0], kv[0], 0, r"key_states must be a floating-point tensor shaped \[batch, KV heads, tokens, "
                                  r"head dim\], got \(2, 3, 16\)"),
                (kv, kv[:, :, :2], 0, r"key_states \(1, 2, 3, 16\) and value_states \(1, 2, 2, 16\) differ"),
                (kv.long(), kv.long(), 0, "got .* torch.int64")):
            with pytest.raises(ValueError, match=message):
                fresh.update(k, v, layer_idx)
            assert fresh.store is None and fresh.get_seq_length() == 0
    with tiercache.TieredCache(model, cfg) as fresh:
        with pytest.raises(TypeError, match=r"input_ids must be a torch.Tensor of token ids shaped \[1, N\]"):
            fresh.load_prefix(ids[0].tolist())
        with pytest.raises(ValueError, match=r"input_ids must be shaped \[1, N\] .*got \(\d+,\); .*ids\[None\]"):
            fresh.load_prefix(ids[0])
        assert fresh.load_prefix(ids) > 0  # the same prompt, as generate() takes it: loaded
    with pytest.raises(TypeError, match="metrics: expected a TieredCache or a BlockStore, got dict"):
        serve_metrics({})


def test_a_layer_on_another_device_is_refused_by_name(tmp_path):
    """A model split over devices (``device_map``): the store opens on the first layer's
    device, and a later layer's K/V were copied across into that pool, so that attention on
    the other device failed deep inside torch (a review of the CUDA paths). The first update
    of a layer computing elsewhere is now a ValueError naming both devices, before that
    layer stores anything. (CPU here: the other device is ``meta``.)"""
    model = tiny_model("llama")
    kv = torch.randn(1, 2, 3, 16)
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=4)) as cache:
        cache.update(kv, kv, 0)
        with pytest.raises(ValueError, match=r"layer 1 computes on meta, but the cache's device tier is on cpu.*"
                                             r"split over devices \(device_map\) is not supported"):
            cache.update(kv.to("meta"), kv.to("meta"), 1)
        assert cache.layers[1].num_tokens == 0 and not cache.layers[1].is_initialized
        keys, _ = cache.update(kv, kv, 1)  # the same layer on the right device goes on
        assert torch.equal(keys, kv)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("prompt_len", [3, 9])
def test_min_capacity_blocks_is_exactly_what_a_whole_run_needs(family, prompt_len):
    """``min_capacity_blocks``, which ``tiercache generate`` compares with what the tiers
    hold before the prefill: with exactly that many blocks the run goes, with one fewer it
    fails. It counted a sliding layer's window as ceil(W / block) blocks, but a window that
    straddles a block edge spans one more, and such runs passed the check and failed in a
    decode step, after part of the answer was printed (a review)."""
    model, new = tiny_model(family), 12
    ids = torch.randint(2, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    probe = TierConfig(device_budget="1MiB", host_budget=0, block_tokens=BT)
    with tiercache.TieredCache(model, probe) as cache:
        need = cache.min_capacity_blocks(prompt_len, new)
        device = -(-cache.min_device_budget(prompt_len, new) // (block_bytes(model, 1, BT)))
    assert 0 < device < need
    for host, fits in ((need - device, True), (need - device - 1, False)):
        cfg = TierConfig(device_budget=device * block_bytes(model, 1, BT), host_budget=host * 4096, block_tokens=BT)
        with tiercache.TieredCache(model, cfg) as cache:
            assert cache.capacity_blocks() == device + host
            if fits:
                generate(model, ids, cache=cache, max_new_tokens=new)
                continue
            with pytest.raises(CapacityError, match="nothing was written"):
                generate(model, ids, cache=cache, max_new_tokens=new)


def test_reorder_cache_names_an_index_that_is_not_one_per_row(tmp_path):
    """``reorder_cache`` with an index of another length (DynamicCache changes its batch size
    with one) was a RuntimeError from inside a copy, and a float index was truncated (a
    review). Each is a ValueError naming the rows, before anything moves; a list of ints is
    taken as a tensor is, and the cache then reorders exactly as DynamicCache."""
    model = tiny_model("llama")
    ids = prompt_ids(batch=2, seed=2)
    nxt = prompt_ids(batch=2, length=1, seed=3)
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=ref, use_cache=True)
        ref.reorder_cache(torch.tensor([1, 1]))
        expected = model(nxt, cache=ref, use_cache=True).logits
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=2, device_blocks=4)) as cache:
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        for bad, message in ((torch.tensor([0, 0, 0]), r"expected 2 integer row indices .* got Tensor \(3,\)"),
                             (torch.tensor([1.0, 0.0]), "got Tensor .* torch.float32"),
                             (torch.tensor([[1, 0]]), r"got Tensor \(1, 2\)"),
                             (torch.tensor([0, 2]), r"must lie in \[0, 2\), got \[0, 2\]"),
                             ([1, -1], r"must lie in \[0, 2\)"), ("ab", "got 'ab'")):
            with pytest.raises(ValueError, match=message):
                cache.reorder_cache(bad)
        cache.reorder_cache([1, 1])
        with torch.no_grad():
            got = model(nxt, cache=cache, use_cache=True).logits
    assert (got - expected).abs().max() <= ATOL


def test_offload_and_prefetch_from_another_thread_during_generate(tmp_path):
    """A thread calling offload() and prefetch() on random layers as fast as it can while
    generate() runs on the cache: the block table was read without the store's lock (a
    "dictionary changed size during iteration" now and then, a helper's 4 in 1.7M calls).
    Tokens and logits stay DynamicCache's, the churning thread sees no error, and the
    store's books check out."""
    import random
    import threading

    model = tiny_model("gemma2")
    ids = prompt_ids()
    ref = generate(model, ids, max_new_tokens=2 * NEW)
    errors: list = []
    calls = [0]
    for trial in range(2):
        cfg = tight_config(model, tmp_path / str(trial), batch=1, device_blocks=16, host_blocks=8)
        cache = tiercache.TieredCache(model, cfg)
        stop = threading.Event()

        def churn(seed: int = trial) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                try:
                    layer = r.randrange(3)
                    if r.random() < 0.5:
                        cache.offload(layer, only_non_sliding=False)
                    else:
                        cache.prefetch(layer, only_non_sliding=False)
                    calls[0] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    errors.append(repr(exc))

        thread = threading.Thread(target=churn)
        thread.start()
        try:
            out = generate(model, ids, cache=cache, max_new_tokens=2 * NEW)
        finally:
            stop.set()
            thread.join()
        assert_same(ref, out, f"trial {trial}")
        cache.store.wait_idle()
        cache.store.check()
        cache.close()
    assert errors == [] and calls[0] > 100, (errors[:3], calls[0])


AUTOGRAD_CONFIGS = {
    "plain": {},
    "quest": dict(selection="quest", selection_budget=4096),  # a budget over the whole context: exact
    "h2o": dict(retention="h2o", retention_budget=16, reuse=False),  # lossy: compared with itself
    "attention-score": dict(eviction="attention-score"),
}


@pytest.mark.parametrize("kind", list(AUTOGRAD_CONFIGS))
def test_forwards_with_autograd_on_keep_no_graph_and_refuse_backward(kind, tmp_path, monkeypatch):
    """A manual decode loop without torch.no_grad() (autograd on: the default outside
    generate()). The K/V written into the pools carried each forward's graph, which stayed
    alive after close(): memory grew with every call (~6,400 tensors a run in a helper's
    loop). Now the blocks keep the bytes only:
    - logits equal the same loop's under no_grad, and DynamicCache's where lossless (the
      first fix lost the plans that quest, h2o and attention-score read from the K/V: wrong
      tokens, nothing dropped, no scores);
    - no forward's activations outlive the cache, and an output kept after close() does
      not keep the store's pool alive (the first fix returned views of it);
    - a backward pass stops with an error saying why, also after later forwards (with a
      view, torch's in-place error came first)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama")).eval()  # weights require grad
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, **AUTOGRAD_CONFIGS[kind])
    ids = prompt_ids()

    def decode(cache, grad: bool) -> list:
        out, x = [], ids
        with torch.set_grad_enabled(grad):
            for _ in range(NEW):
                logits = model(x, cache=cache, use_cache=True).logits[:, -1]
                out.append(logits)
                x = logits.argmax(-1, keepdim=True)
        return out

    from tiercache.policies.kv import AttentionScorePolicy

    scored = [0]  # the attention-score policy's feed from the hook, counted
    observe = AttentionScorePolicy.observe_scores

    def counted(self, scores):
        scored[0] += 1
        return observe(self, scores)
    monkeypatch.setattr(AttentionScorePolicy, "observe_scores", counted)

    ref = [t.detach() for t in decode(transformers.DynamicCache(config=model.config), False)]
    with tiercache.TieredCache(model, cfg) as cache:
        plain = decode(cache, False)
        plain_attention = cache.attention_stats()
    plain_scored, scored[0] = scored[0], 0
    assert (plain_scored > 0) == (kind == "attention-score")
    alive: list = []
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: alive.append(weakref.ref(out)))
    try:
        cache = tiercache.TieredCache(model, cfg)
        got = decode(cache, True)
        assert all(t.requires_grad for t in got)
        assert max((a - b.detach()).abs().max().item() for a, b in zip(plain, got)) == 0.0
        if kind != "h2o":
            assert max((a - b.detach()).abs().max().item() for a, b in zip(ref, got)) <= ATOL
        attention = cache.attention_stats()
        for key in ("selection", "retention"):  # what quest read and h2o dropped
            assert attention[key] == plain_attention[key], key
        assert scored[0] == plain_scored
        # h2o rewrites the pools compacted: they held a graph that grew every step
        assert not (cache.store.device_pool.k.requires_grad or cache.store.device_pool.v.requires_grad)
        for step in (0, NEW - 1):  # the prefill, after later forwards; a decode step (quest reads pages)
            with pytest.raises(RuntimeError, match="TieredCache is for inference: gradients do not flow"):
                got[step].sum().backward(retain_graph=True)
        pool = weakref.ref(cache.store.device_pool.k)
        cache.close()
        del cache
        gc.collect()
        assert pool() is None  # the outputs in got are still alive
        del got
        gc.collect()
        assert sum(r() is not None for r in alive) == 0
    finally:
        hook.remove()


@pytest.mark.parametrize("attend_in_place", [False, True])
def test_a_backward_that_needs_no_kv_gradient_matches_dynamic_cache(attend_in_place, tmp_path):
    """Only the last layer's query projection trains (an adapter on q_proj): the K/V need
    no gradient, so a backward pass through a decode step is fine, and its gradient must be
    DynamicCache's. Attention was given views of the pools, which later forwards overwrite:
    torch's in-place error, and a closed store's pool kept alive by the outputs."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama")).eval()
    model.requires_grad_(False)
    q_proj = model.model.layers[-1].self_attn.q_proj.weight
    q_proj.requires_grad_(True)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, attend_in_place=attend_in_place)
    grads = []
    for cache in (transformers.DynamicCache(config=model.config), tiercache.TieredCache(model, cfg)):
        x, outs = prompt_ids(), []
        for _ in range(NEW):
            logits = model(x, cache=cache, use_cache=True).logits[:, -1]
            outs.append(logits)
            x = logits.argmax(-1, keepdim=True)
        q_proj.grad = None
        outs[2].sum().backward()  # a decode step, after later forwards
        grads.append(q_proj.grad.clone())
        if isinstance(cache, tiercache.TieredCache):
            pool = weakref.ref(cache.store.device_pool.k)
            cache.close()
            del cache
            gc.collect()
            assert pool() is None  # outs still alive
    assert (grads[0] - grads[1]).abs().max().item() <= ATOL


def test_wrap_matches_dynamic_cache(tmp_path):
    """tiercache.wrap(model, cfg): plain model.generate() calls (no cache argument) run on a
    fresh TieredCache each and match DynamicCache; the last cache's stats show every tier."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama")).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
    ids = prompt_ids()
    refs = [generate(model, ids, max_new_tokens=NEW), generate(model, ids[:, :7], max_new_tokens=NEW)]
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    tiercache.wrap(model, tight_config(model, tmp_path, batch=1, device_blocks=need + 1))
    for ref, prompt in zip(refs, [ids, ids[:, :7]]):
        out = generate(model, prompt, max_new_tokens=NEW)
        assert_same(ref, out, "wrapped generate")
        assert isinstance(model.tiercache_last, tiercache.TieredCache)
        assert model.tiercache_last.closed
    assert_all_tiers_used(model.tiercache_last.stats())


@pytest.mark.parametrize("none_kwarg", ["cache", "past_key_values"])
def test_wrap_accepts_explicit_none_cache(none_kwarg):
    """``generate(ids, cache=None)`` on a wrapped model means "no cache given": it gets a
    TieredCache like a call without the argument (same for ``past_key_values=None``). The
    call reaches transformers as given: ``cache=None`` without a warning, and the deprecated
    ``past_key_values`` with transformers' own deprecation warning, as unwrapped."""
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama")).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
    ids = prompt_ids()
    ref = generate(model, ids, max_new_tokens=4)
    tiercache.wrap(model, TierConfig(device_budget="1MiB", host_budget=0, block_tokens=BT))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             **{none_kwarg: None}, **GEN)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    if none_kwarg == "cache":
        assert future == []
    else:
        assert future and all("`past_key_values` is deprecated" in m for m in future), future
    assert_same(ref, out, f"wrapped generate({none_kwarg}=None)")
    assert model.tiercache_last.stats()["decode_tokens"] == 3


# ---------------------------------------------------------------------------------------------
# The smallest device budget
# ---------------------------------------------------------------------------------------------
_MIN_RE = re.compile(r"minimum device_budget = (\d+) bytes")


@pytest.mark.parametrize("when", ["prefill", "decode"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_capacity_error_states_minimum(family, when, tmp_path):
    """One block below the working set of one step raises CapacityError at the first forward
    that needs more, before that forward writes anything; the message states the minimum
    device budget, which is exactly that step's working set (one layer's blocks)."""
    model = tiny_model(family)
    windows = layer_windows(model)
    if when == "prefill":  # the prompt alone does not fit
        need = working_set_blocks(windows, [PROMPT])
        tokens_before = 0
    else:  # the prompt fits; decoding grows the layer past the device tier
        need = working_set_blocks(windows, [PROMPT] + [1] * (NEW - 1))
        tokens_before = (need - 1) * BT  # the forward that opens block `need` fails
    assert need > 1
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need - 1)
    with tiercache.TieredCache(model, cfg) as cache:
        with pytest.raises(CapacityError, match="minimum") as info:
            generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW)
        lengths = {layer.get_seq_length() for layer in cache.layers}
    match = _MIN_RE.search(str(info.value))
    assert match, str(info.value)
    assert int(match.group(1)) == need * block_bytes(model, 1), str(info.value)
    assert "for this step" in str(info.value) and "min_device_budget" in str(info.value)  # a later step needs more
    assert lengths == {tokens_before}, "a layer was written by the forward that failed"


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_min_device_budget_is_the_working_set_of_the_whole_run_chunked_or_not(family, tmp_path):
    """``TieredCache.min_device_budget`` (what ``tiercache generate`` checks before a run) is
    the widest working set over the prefill's chunks and the decode steps; a run at exactly
    that budget, prefilled in chunks, is exact, and one block less stops with CapacityError.
    (Over chunked prefill the error's own minimum is the failing chunk's, which grows with
    each chunk: following it failed again further in, as a helper's 5k-token prompt showed.)"""
    model = tiny_model(family)
    windows = layer_windows(model)
    bb = block_bytes(model, 1)
    ids = prompt_ids(length=PROMPT)
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=64)) as probe:
        for chunk in (None, CHUNK):
            schedule = [PROMPT] if chunk is None else [CHUNK] * (PROMPT // CHUNK) + [PROMPT % CHUNK]
            prefill = working_set_blocks(windows, schedule)
            whole = working_set_blocks(windows, schedule + [1] * (NEW - 1))
            assert probe.min_device_budget(PROMPT, 0, chunk) == prefill * bb, (chunk, prefill)
            assert probe.min_device_budget(PROMPT, NEW, chunk) == whole * bb, (chunk, whole)
    ref = generate(model, ids, max_new_tokens=NEW)
    need = working_set_blocks(windows, [CHUNK] * (PROMPT // CHUNK) + [PROMPT % CHUNK] + [1] * (NEW - 1))
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=need)) as cache:
        assert_same(ref, generate(model, ids, cache=cache, max_new_tokens=NEW, prefill_chunk_size=CHUNK))
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=need - 1)) as cache:
        with pytest.raises(CapacityError, match="minimum"):
            generate(model, ids, cache=cache, max_new_tokens=NEW, prefill_chunk_size=CHUNK)


def _all_sliding_model(window: int = 8):
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     sliding_window=window, initializer_range=0.2, eos_token_id=None, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def test_min_device_budget_of_a_cache_built_from_a_config(tmp_path):
    """``TieredCache(model.config, cfg)`` serves generate() as one built from the model, but
    its ``min_device_budget`` raised AttributeError ('NoneType' object has no attribute
    'parameters'): it looked for the model's dtype (a review). It takes the dtype the config
    names, else torch's default (what a model built from that config computes in), and
    after a forward pass the store's: the same bytes as the model-built cache gives, for
    fp32 and for a config that says bfloat16."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=64)
    with tiercache.TieredCache(model, cfg) as probe:
        want = probe.min_device_budget(PROMPT, NEW, 4)
    with tiercache.TieredCache(model.config, cfg) as cache:
        assert cache.min_device_budget(PROMPT, NEW, 4) == want > 0
        generate(model, prompt_ids(), cache=cache, max_new_tokens=2)
        assert cache.min_device_budget(PROMPT, NEW, 4) == want  # from the store's geometry now
    config = copy.deepcopy(model.config)
    config.dtype = torch.bfloat16
    with tiercache.TieredCache(config, cfg) as cache:
        assert cache.min_device_budget(PROMPT, NEW, 4) == want // 2


@pytest.mark.parametrize("args, error", [
    (("10", 5), "prompt_tokens must be an integer >= 1, got '10'"),
    ((0, 5), "prompt_tokens must be an integer >= 1, got 0"),
    ((-10, 5), "prompt_tokens must be an integer >= 1, got -10"),
    ((True, 1), "prompt_tokens must be an integer >= 1, got True"),
    ((10.5, 1), "prompt_tokens must be an integer >= 1, got 10.5"),
    ((10, -5), "new_tokens must be an integer >= 0, got -5"),
    ((10, 5, 0), "prefill_chunk must be an integer >= 1, got 0"),
    ((10, 5, None, -4), "loaded must be an integer >= 0, got -4"),
    ((10, 5, None, 10), "loaded=10 must be less than prompt_tokens=10"),
])
def test_min_device_budget_refuses_what_is_not_a_count(tmp_path, args, error):
    """``min_device_budget("10", 5)`` was a bare TypeError from inside, ``(0, 5)`` a range()
    error, and ``(-10, 5)`` answered 0, as did negative new tokens or a loaded prefix longer
    than the prompt. Each is now a ValueError naming the argument and the value."""
    model = tiny_model("llama")
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=64)) as cache:
        with pytest.raises(ValueError, match=re.escape(f"min_device_budget: {error}")):
            cache.min_device_budget(*args)
        assert cache.min_device_budget(10, 0, None, 9) > 0  # the edges that make sense still answer


def test_min_device_budget_of_a_model_whose_every_layer_slides(tmp_path):
    """Where every layer slides, a decode step's working set depends on how the window meets
    the block edges, so an early step can need more than the last: counting only the last
    gave 2 blocks where a run needs 3 (a review's repro: window 8, 4-token blocks, a 6-token
    prompt, 7 new tokens). And a prefix loaded from the prefix cache is written in one update
    per layer, the window no help: a warm run at the cold run's minimum failed in
    ``load_prefix``. It now loads what the device holds and computes the rest."""
    model = _all_sliding_model()
    bb = block_bytes(model, 1)
    windows = layer_windows(model)
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=64)) as probe:
        for prompt_len, new in ((6, 7), (5, 12), (13, 9), (40, 4)):
            assert probe.min_device_budget(prompt_len, new) == \
                working_set_blocks(windows, [prompt_len] + [1] * (new - 1)) * bb, (prompt_len, new)
        need = probe.min_device_budget(40, 4, 8)
    ids = prompt_ids(length=40)
    ref = generate(model, ids, max_new_tokens=4)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need // bb)
    for run in ("cold", "warm"):  # the cold run publishes the prompt's blocks
        with tiercache.TieredCache(model, cfg) as cache:
            loaded = cache.load_prefix(ids, prefill_chunk=8)
            out = generate(model, ids, cache=cache, max_new_tokens=4, prefill_chunk_size=8)
        assert_same(ref, out, run)
        assert loaded == (0 if run == "cold" else need // bb * BT)  # what the device holds, not all 36


@pytest.mark.parametrize("rollback", ["assisted", "prompt lookup"])
def test_sliding_layers_keep_their_window_under_assisted_generation(rollback, tmp_path):
    """Assisted generation and prompt lookup record the past (``activate_past_recording``)
    so that ``crop`` can roll back rejected draft tokens. DynamicCache's sliding layer trims
    itself back to its window in ``crop``; a tiered sliding layer kept every block instead:
    on the tiny Mistral (every layer slides, window 6, 4-token blocks) 18 blocks a layer
    after 60 new tokens, against 2 in plain generation, and a run whose budgets fit plain
    generation raised CapacityError at 39 tokens (a review). Now: the same budgets are
    enough, the tokens and logits are DynamicCache's, the cache rolled back, and no layer
    ever holds more than its window's blocks plus one step's draft tokens."""
    model = tiny_model("mistral")
    ids = prompt_ids()
    kwargs = ({"assistant_model": tiny_model("mistral", assistant=True)} if rollback == "assisted"
              else {"prompt_lookup_num_tokens": 3})
    ref = generate(model, ids, max_new_tokens=60, **kwargs)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=8, host_blocks=3)
    cfg = cfg.replace(disk_budget=20 * (cfg.disk_budget // 256))  # 20 records: a window-bounded run's room
    with tiercache.TieredCache(model, cfg) as cache:
        calls = _spy(cache)
        most = [0]
        crop = cache.crop

        def crop_and_count(*args, **kw):
            crop(*args, **kw)
            most[0] = max(most[0], max(len(cache._blocks_of(i)) for i in range(len(cache.layers))))
        cache.crop = crop_and_count
        out = generate(model, ids, cache=cache, max_new_tokens=60, **kwargs)
        after = [len(cache._blocks_of(i)) for i in range(len(cache.layers))]
    assert_same(ref, out, rollback)
    assert calls["crop"], "the run never rolled the cache back"
    assert after == [2] * len(after)  # the window (5 tokens) over 4-token blocks, as in plain generation
    assert most[0] == 2  # right after every crop: the window's 5 tokens lie in 2 blocks at most


def test_a_warm_run_fits_wherever_the_cold_run_fits(tmp_path):
    """Loading a prefix moves where the prefill's chunks fall, and with a sliding window a
    chunk can then need a block more than the same prompt computed from its start: a review's
    sweep found 42 cases (window 10, 4-token blocks, a 21-token prompt in chunks of 5: the
    warm run failed at the cold run's minimum). ``load_prefix(prefill_chunk=...)`` loads no
    more than keeps the chunks within the budget; every case of a smaller sweep runs exact."""
    # three of a sweep's cases where loading all that the device holds needs a block more
    for window, length, chunk in ((10, 21, 5), (6, 19, 5), (11, 22, 5)):
        model = _all_sliding_model(window)
        bb = block_bytes(model, 1)
        ids = prompt_ids(length=length, seed=window)
        ref = generate(model, ids, max_new_tokens=3)
        with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=64)) as probe:
            cold = probe.min_device_budget(length, 3, chunk)
        cfg = tight_config(model, tmp_path / f"w{window}", batch=1, device_blocks=cold // bb)
        for run in ("cold", "warm"):
            with tiercache.TieredCache(model, cfg) as cache:
                loaded = cache.load_prefix(ids, prefill_chunk=chunk)
                assert cache.min_device_budget(length, 3, chunk, loaded) <= cold
                assert (loaded > 0) == (run == "warm")  # a part of the prompt came from the prefix cache
                if run == "warm":  # all the device holds would not have fitted: the limit is what kept this
                    assert cache.min_device_budget(length, 3, chunk, cold // bb * BT) > cold
                out = generate(model, ids, cache=cache, max_new_tokens=3, prefill_chunk_size=chunk)
            assert_same(ref, out, f"{run}, window {window}")


@pytest.mark.parametrize("prefetch", ["none", "next-layer", "lookahead"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_minimum_device_budget_is_enough(family, prefetch, tmp_path):
    """The device budget of exactly one step's working set works for every prefetch policy
    (prefetch is best-effort and never makes the minimum fail) and stays exact."""
    model = tiny_model(family)
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need, prefetch=prefetch)
    ids = prompt_ids()
    ref = generate(model, ids, max_new_tokens=NEW)
    with tiercache.TieredCache(model, cfg) as cache:
        out = generate(model, ids, cache=cache, max_new_tokens=NEW)
        stats = cache.stats()
    assert_same(ref, out, f"{family} at the minimum device budget, prefetch={prefetch}")
    assert_all_tiers_used(stats)


def slow_device_reads(monkeypatch, seconds: float) -> None:
    """Every read of a device slot (a busy copy engine) takes ``seconds`` longer: the torch
    path (``read_block``: staging for disk, CUDA) and the CPU device->host move (``read_rows``)."""
    from tiercache.tiers import DevicePool

    read_block, read_rows = DevicePool.read_block, DevicePool.read_rows

    def slow_read_block(self, slot, out, non_blocking=False):
        time.sleep(seconds)
        return read_block(self, slot, out, non_blocking=non_blocking)

    def slow_read_rows(self, slot, k_out, v_out):
        time.sleep(seconds)
        return read_rows(self, slot, k_out, v_out)

    monkeypatch.setattr(DevicePool, "read_block", slow_read_block)
    monkeypatch.setattr(DevicePool, "read_rows", slow_read_rows)


@pytest.mark.parametrize("family,block_tokens,slack", [("llama", BT, 0), ("mistral", BT, 0), ("llama", 1, None)])
def test_slow_transfers_only_stall(family, block_tokens, slack, monkeypatch, tmp_path):
    """Slow device reads (a busy copy engine; here 50 ms per block) only add stall time.
    A device slot whose block is still being copied down (write-behind of a sealed block)
    must be waited for, not reported as a CapacityError -- neither at the minimum device
    budget (slack 0: the error would contradict its own stated minimum) nor at twice the
    minimum with 1-token blocks (slack None), where a prefill seals many blocks at once."""
    slow_device_reads(monkeypatch, 0.05)
    if slack is None:
        slack = working_set_blocks(layer_windows(tiny_model(family)), [PROMPT] + [1] * (NEW - 1), block_tokens)
    # A roomy host tier: every sealed block gets a write-behind copy, so device slots are busy.
    # reuse=False: publishing to the prefix cache would read each sealed block on the compute
    # thread (slowly, here), giving the write-behind copies time to finish
    stats = run_mode(family, "prefill", tmp_path, block_tokens=block_tokens, device_extra=slack,
                     host_blocks=64, prefetch="none", reuse=False)
    assert_all_tiers_used(stats)
    assert stats["stall_seconds"] > 0


@pytest.mark.parametrize("path", ["new_blocks", "ensure_device"])
def test_device_slots_being_written_behind_are_waited_for(path, monkeypatch, tmp_path):
    """Minimal form of the failure above, on the block store: both device slots hold sealed
    blocks whose write-behind copy to host is in flight (their device copies have a reader).
    Making room must wait for those copies (then drop the now-clean device copy), not raise
    CapacityError with host and disk nearly empty. Covers allocating a new block (what
    ``update`` does for new tokens) and fetching a host block (what attention needs)."""
    from tiercache import BlockKey
    from tiercache.store import BlockStore
    from tiercache.tiers import BlockGeometry

    geometry = BlockGeometry(batch=1, kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32)
    cfg = TierConfig(device_budget=2 * geometry.block_bytes, host_budget=8 * geometry.padded_bytes,
                     disk_budget="1MiB", disk_dir=str(tmp_path / "kv"), block_tokens=4)
    with BlockStore(cfg, geometry, persistent=False) as store:
        on_host = BlockKey(1, 0, 9)
        data = torch.randn(geometry.shape)
        store.put(on_host, data)
        store.demote(on_host).result()
        assert store.tiers_of(on_host)[0] is tiercache.Tier.HOST

        slow_device_reads(monkeypatch, 0.3)
        for index in range(2):
            store.put(BlockKey(1, 0, index), torch.randn(geometry.shape))
            store.write_behind(BlockKey(1, 0, index))  # sealed: a clean host copy is on its way
        if path == "new_blocks":
            store.put(BlockKey(1, 0, 2), torch.randn(geometry.shape))
        else:
            store.ensure_device([on_host], pin=False)
            assert torch.equal(store.get(on_host), data)
        store.wait_idle()
        store.check()


@pytest.mark.parametrize("host_blocks", [1, 2])
def test_host_tier_smaller_than_working_set(host_blocks, tmp_path):
    """A host tier of one or two slots (fewer than the blocks one layer reads, all of which
    the next step fetches from host or disk) is a valid lossless configuration: blocks that
    do not fit on host go on to disk, and logits stay exact."""
    model = tiny_model("llama")
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need + 1, host_blocks=host_blocks)
    ids = prompt_ids()
    ref = generate(model, ids, max_new_tokens=NEW)
    with tiercache.TieredCache(model, cfg) as cache:
        out = generate(model, ids, cache=cache, max_new_tokens=NEW)
        stats = cache.stats()
    assert_same(ref, out, f"host tier of {host_blocks} slots")
    assert_all_tiers_used(stats)


# ---------------------------------------------------------------------------------------------
# Unsupported families
# ---------------------------------------------------------------------------------------------
def _encoder_decoder_t5():
    return transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                 num_decoder_layers=1, num_heads=4, decoder_start_token_id=0)


def _encoder_decoder_bart():
    return transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4,
                                   encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def _mla_deepseek_v3():
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)


def _linear_hybrid_qwen3_next():
    return transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _gemma4(**kwargs):
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers release has no Gemma4")
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **kwargs)


def _per_layer_head_dim_gemma4():
    return _gemma4(global_head_dim=32)  # its full-attention layers: K/V of another shape


def _shared_kv_gemma4():
    return _gemma4(global_head_dim=16, num_kv_shared_layers=2)  # the last two layers reuse others' KV


def _cross_attention_mllama():  # its cross-attention layers' cache holds the image's K/V
    return transformers.MllamaTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1])


def _kv_head_dims_mimo():  # keys of 16 dims, values of 128 (it failed at the first update before)
    if not hasattr(transformers, "MiMoV2FlashConfig"):
        pytest.skip("this transformers release has no MiMo-V2-Flash")
    return transformers.MiMoV2FlashConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, v_head_dim=32)


def _refeeding_mpt():  # given a cache, transformers' MPT feeds every token again at each step
    return transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=256)


UNSUPPORTED = {
    "mimo_v2_flash": (_kv_head_dims_mimo, "keys and values of different head dims (head_dim=16, v_head_dim=32)"),
    "mpt": (_refeeding_mpt, "transformers' MPT feeds every token again at each decode step when a cache is passed"),
    "gemma4-head-dims": (_per_layer_head_dim_gemma4, "layers of different KV shapes (head_dim, num_key_value_heads: "
                                                     "(16, 2), (32, 2))"),
    "gemma4-shared-kv": (_shared_kv_gemma4, "layers that reuse another layer's KV cache (num_kv_shared_layers=2)"),
    "t5": (_encoder_decoder_t5, "encoder-decoder"),
    "bart": (_encoder_decoder_bart, "encoder-decoder"),
    "deepseek_v3": (_mla_deepseek_v3, "multi-latent attention"),
    "qwen3_next": (_linear_hybrid_qwen3_next, "linear_attention"),
    "mllama": (_cross_attention_mllama, "cross-attention layers (cross_attention_layers=[1])"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_families_are_refused(name, tmp_path):
    """Encoder-decoder, multi-latent attention, linear-attention hybrids, layers whose K/V
    differ in shape (Gemma4's full-attention layers with their own head size: accepted
    before, then a torch error from inside the block pool at the first forward) and layers
    that reuse another's KV (named as linear-attention layers of type 'dummy' before) are
    refused with UnsupportedModelError naming the model and the reason, by TieredCache and
    by wrap(), before any file is written."""
    build, reason = UNSUPPORTED[name]
    config = build()
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", disk_budget="1MiB", disk_dir=str(tmp_path / "kv"))
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)) as info:
        tiercache.TieredCache(config, cfg)
    assert config.model_type in str(info.value)
    assert isinstance(info.value, ValueError)

    class _Model:  # wrap() only reads .config before refusing
        pass

    fake = _Model()
    fake.config = config
    fake.generate = lambda *a, **k: None
    with pytest.raises(UnsupportedModelError, match=re.escape(reason)):
        tiercache.wrap(fake, cfg)
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("name", ["rwkv", "openai-gpt"])
def test_a_model_whose_forward_takes_no_cache_is_refused(name, tmp_path):
    """RWKV keeps a recurrent state and GPT-1 caches nothing: their forwards take no cache.
    A TieredCache given to RWKV's generate() held nothing, and said nothing (all its stats
    0); both are now refused by name, by TieredCache and by wrap()."""
    torch.manual_seed(0)
    if name == "rwkv":
        config = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                         attention_hidden_size=32, intermediate_size=64)
    else:
        config = transformers.OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", disk_budget="1MiB", disk_dir=str(tmp_path / "kv"))
    for make in (tiercache.TieredCache, tiercache.wrap):
        with pytest.raises(UnsupportedModelError, match=rf"{type(model).__name__}: its forward takes no KV cache"):
            make(model, cfg)
    assert not (tmp_path / "kv").exists()


def test_a_model_whose_language_model_takes_the_cache_is_served(tmp_path):
    """BLIP-2's own forward takes no cache, but its generate() hands one to its language
    model: the first form of the check above refused it. Served, and exact, with all tiers."""
    torch.manual_seed(0)
    vision = transformers.Blip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=16, patch_size=8)
    qformer = transformers.Blip2QFormerConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64, encoder_hidden_size=32, vocab_size=VOCAB)
    text = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=128,
                                  eos_token_id=None, pad_token_id=PAD)
    config = transformers.Blip2Config(vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
                                      text_config=text.to_dict(), num_query_tokens=4, image_token_index=VOCAB - 1)
    model = transformers.Blip2ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
    pixels = torch.randn(1, 3, 16, 16)
    ids = torch.cat([torch.full((1, 4), VOCAB - 1), prompt_ids(length=PROMPT)], 1)

    def run(**kwargs):  # BLIP-2's generate() takes pixel_values first
        with torch.no_grad():
            return model.generate(pixel_values=pixels, input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=NEW, **GEN, **kwargs)

    ref = run()
    cfg = TierConfig(device_budget=12 * block_bytes(model, 1), host_budget=8192, disk_dir=str(tmp_path / "kv"),
                     disk_budget="1MiB", block_tokens=BT)
    with tiercache.TieredCache(model, cfg) as cache:
        assert_same(ref, run(cache=cache))
        assert_all_tiers_used(cache.stats())


def test_a_cache_serves_only_the_model_it_was_built_for(tmp_path):
    """A cache built for one model and handed to another: a model with more layers was an
    IndexError from inside update(), and one whose K/V have another shape a torch error
    from inside the block pool. Each is now a clear error at the first layer that does
    not fit; the cache's own model still generates exactly with it afterwards (reset)."""
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                max_position_embeddings=256, eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2,
                                                                   **base)).eval()
    deeper = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=3, num_key_value_heads=2,
                                                                    **base)).eval()
    other_heads = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=1,
                                                                         **base)).eval()
    cfg = tight_config(small, tmp_path, batch=1, device_blocks=8)
    with tiercache.TieredCache(small, cfg) as cache:
        generate(small, prompt_ids(), cache=cache, max_new_tokens=2)
        with pytest.raises(ValueError, match="layer 2 of a model with more layers than the 2 this cache was built"):
            generate(deeper, prompt_ids(), cache=cache, max_new_tokens=2)
        cache.reset()
        generate(small, prompt_ids(), cache=cache, max_new_tokens=2)
        with pytest.raises(UnsupportedModelError, match=r"gave K/V of 1 heads x 8 dims, but this cache's blocks hold "
                                                        r"2 x 8 .*serves only the model it was built for"):
            generate(other_heads, prompt_ids(), cache=cache, max_new_tokens=2)
        cache.reset()
        ref = generate(small, prompt_ids(), max_new_tokens=4)
        out = generate(small, prompt_ids(), cache=cache, max_new_tokens=4)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) == 0.0


def test_a_config_device_other_than_the_models_is_refused_by_name(tmp_path):
    """TierConfig(device=...) naming another device than the one the model computes on
    built the device tier there, and attention failed inside with a device mismatch. It is
    refused at the first forward naming both; the model's own device is accepted. (On this
    CPU-only machine no other device can hold a tier: ``meta``, which holds no data, is
    refused by the config itself, and so is ``cuda`` on a torch without CUDA.)"""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path / "cpu", batch=1, device_blocks=12, device="cpu")
    with tiercache.TieredCache(model, cfg) as cache:
        generate(model, prompt_ids(), cache=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="device: 'meta' holds no data"):
        tight_config(model, tmp_path / "meta", batch=1, device_blocks=12, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda', but this torch is built without CUDA|no CUDA device"):
            tight_config(model, tmp_path / "cuda", batch=1, device_blocks=12, device="cuda")


def test_a_new_thread_with_a_finished_threads_id_does_not_inherit_its_half_forward(tmp_path):
    """A forward pass that stops half way (an error in layer 1) leaves the cache half
    updated, and other threads are refused until ``reset()``. The claim was keyed by the
    thread's id, which the OS gives to the next thread: a new thread with the failed one's
    id was let through, onto layers that held a token more than layer 0 would."""
    import threading

    model = tiny_model("llama")
    ids = prompt_ids()
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12)
    failed_in: list = []

    def fail_once(module, args):
        if not failed_in:
            failed_in.append(threading.get_ident())
            raise RuntimeError("layer 1 broke")

    def attempt(out: list) -> None:
        out.append(threading.get_ident())
        try:
            out.append(generate(model, ids, cache=cache, max_new_tokens=2))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    hook = model.model.layers[1].register_forward_pre_hook(fail_once)
    try:
        with tiercache.TieredCache(model, cfg) as cache:
            first: list = []
            t = threading.Thread(target=attempt, args=(first,))
            t.start()
            t.join(60)
            assert str(first[1]) == "layer 1 broke"
            for _ in range(50):  # until the OS hands the failed thread's id to a new one
                later: list = []
                t = threading.Thread(target=attempt, args=(later,))
                t.start()
                t.join(60)
                if later[0] == first[0]:
                    break
            else:
                pytest.skip("the OS gave no new thread the failed thread's id")
            assert isinstance(later[1], RuntimeError), later[1]
            assert "another thread's forward pass is at layer 0" in str(later[1])
            cache.reset()
            assert torch.equal(generate(model, ids, cache=cache, max_new_tokens=2).sequences,
                               generate(model, ids, max_new_tokens=2).sequences)
    finally:
        hook.remove()


def test_a_second_thread_on_a_cache_mid_forward_is_refused_and_the_first_stays_exact(tmp_path):
    """Two threads generating on one cache at once: before, the second thread's forward pass
    unpinned and overwrote the first one's blocks, and one of them failed with "block ... is
    not in the cache (lost or deleted)", blaming corruption, or got other tokens without a
    word. Now thread B, starting while thread A's forward pass is half way through its
    layers (A waits in a hook on layer 1 until B has tried), is refused with an error that
    says why, having changed nothing; A then completes with DynamicCache's tokens and
    logits. Once A is done, B may use the cache (one after the other is fine)."""
    import threading

    model = tiny_model("llama")
    ids, other = prompt_ids(), prompt_ids(seed=5)
    ref = generate(model, ids, max_new_tokens=NEW)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12)  # a disk tier: the prefix cache is on
    a_inside, b_tried = threading.Event(), threading.Event()
    a_thread: list = []
    results: dict = {}

    def hold_a(module, args):
        if threading.get_ident() in a_thread and not b_tried.is_set():
            a_inside.set()
            assert b_tried.wait(60)

    def run(name, ids=ids, **kwargs):
        try:
            results[name] = generate(model, ids, cache=cache, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[name] = exc
        finally:
            if name == "b":
                b_tried.set()

    hook = model.model.layers[1].register_forward_pre_hook(hold_a)
    try:
        with tiercache.TieredCache(model, cfg) as cache:
            a = threading.Thread(target=run, args=("a",), kwargs=dict(max_new_tokens=NEW))
            a.start()
            a_thread.append(a.ident)
            assert a_inside.wait(60)
            b = threading.Thread(target=run, args=("b",), kwargs=dict(ids=other, max_new_tokens=2))
            b.start()
            b.join(60)
            a.join(60)
            assert isinstance(results["b"], RuntimeError), results["b"]
            layers = len(model.model.layers)
            assert f"another thread's forward pass is at layer 0 of {layers}" in str(results["b"])
            out = results["a"]
            assert not isinstance(out, Exception), out
            assert torch.equal(ref.sequences, out.sequences)
            assert max((x - y).abs().max().item() for x, y in zip(ref.logits, out.logits)) == 0.0
            # B's prompt reached the model's hook before B was refused: A's later blocks, named
            # by ids with B's in them, must not reach the prefix cache (a review found them served)
            assert cache._token_ids is None
            cache.reset()
            later = threading.Thread(target=run, args=("later",), kwargs=dict(max_new_tokens=NEW))
            later.start()
            later.join(60)
            assert torch.equal(ref.sequences, results["later"].sequences)
    finally:
        hook.remove()
    mixed = torch.cat([ids[0], other[0]])[None, :ids.shape[1] + 7]  # A's prompt, then B's
    with tiercache.TieredCache(model, cfg) as fresh:
        fresh.load_prefix(mixed)
        out = generate(model, mixed, cache=fresh, max_new_tokens=4)
    want = generate(model, mixed, max_new_tokens=4)
    assert torch.equal(want.sequences, out.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(want.logits, out.logits)) <= 1e-5


def test_a_transformers_release_without_cache_kwarg_is_refused_by_name(monkeypatch, tmp_path):
    """Before 5.24, transformers' generate() refuses ``cache=`` and a model's forward drops
    it silently (decoding would run on a fresh cache each step: wrong tokens, no error).
    Seen on a GPU machine with 5.17. TieredCache and wrap() name the release and the fix
    before anything is built; the installed release passes."""
    tiercache.hf.check_transformers()  # the one installed here
    # the module object in sys.modules, which transformers swaps once models are imported
    monkeypatch.setattr(__import__("sys").modules["transformers"], "__version__", "5.17.0")
    cfg = TierConfig(device_budget="1MiB", host_budget="1MiB", disk_budget="1MiB", disk_dir=str(tmp_path / "kv"))
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    for build in (lambda: tiercache.TieredCache(config, cfg), lambda: tiercache.wrap(_Fake(config), cfg)):
        with pytest.raises(tiercache.TierCacheError, match=r"transformers >= 5\.24 \(found 5\.17\.0\)"):
            build()
    assert not (tmp_path / "kv").exists()


class _Fake:  # wrap() reads only .config and .generate before refusing
    def __init__(self, config) -> None:
        self.config = config
        self.generate = lambda *a, **k: None


def test_unsupported_real_model_object(tmp_path):
    """A real (tiny) encoder-decoder model object is refused too, not only its config."""
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(_encoder_decoder_t5()).eval()
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        tiercache.TieredCache(model, TierConfig(device_budget="1MiB"))


def test_wrong_objects_are_refused_by_name():
    """The wrong object in the wrong place gets a TypeError naming what was expected and
    what came, not an AttributeError from deep inside: no model, a model name instead of a
    model, a dict of settings instead of a TierConfig (which ``wrap`` used to accept, to
    fail at the first generate()), the config where the model goes, a string as the
    store's geometry."""
    from tiercache.store import BlockStore

    model = tiny_model("llama")
    refusals = [
        (lambda: tiercache.TieredCache(None), r"expected a transformers model or its config .*got NoneType"),
        (lambda: tiercache.TieredCache("HuggingFaceTB/SmolLM2-135M"), r"a PretrainedConfig\), got str"),
        (lambda: tiercache.TieredCache(TierConfig()), r"a PretrainedConfig\), got TierConfig"),
        (lambda: tiercache.TieredCache(model, {"device_budget": "1MiB"}),
         r"config: expected a tiercache.TierConfig, got dict \(build one: tiercache.TierConfig\(\*\*your_dict\)\)"),
        (lambda: tiercache.wrap(model, "32MiB"), r"config: expected a tiercache.TierConfig, got str"),
        (lambda: tiercache.wrap(None), r"wrap: expected a transformers model \(with generate\(\)\), got NoneType"),
        (lambda: BlockStore({"device_budget": 1 << 20}, None), r"config: expected a tiercache.TierConfig, got dict"),
        (lambda: BlockStore(TierConfig(), "geometry"), r"geometry: expected a tiercache BlockGeometry, got str"),
    ]
    for call, message in refusals:
        with pytest.raises(TypeError, match=message):
            call()
    assert not getattr(model, "_tiercache_wrapped", False)


def test_a_cache_passed_with_use_cache_false_is_refused_before_anything_is_written(tmp_path):
    """Scenario: generate(cache=TieredCache(...), use_cache=False). transformers then feeds
    the whole sequence at every step and the model still writes it into the cache passed
    (DynamicCache too): every step's KV went in again, and the tokens were wrong without a
    word (6.9 in the logits), or a CapacityError named budgets (a review). A ValueError says
    why at the first forward, before anything is written; the cache then runs a normal
    generate() exactly."""
    model, ids = tiny_model("llama"), prompt_ids()
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12)
    ref = generate(model, ids, max_new_tokens=NEW)
    with TieredCache(model, cfg) as cache:
        with pytest.raises(ValueError, match="use_cache=False with a TieredCache passed"):
            generate(model, ids, cache=cache, max_new_tokens=NEW, use_cache=False)
        assert cache.get_seq_length() == 0
        assert_same(ref, generate(model, ids, cache=cache, max_new_tokens=NEW))
        with pytest.raises(ValueError, match="use_cache=False"), torch.no_grad():  # a forward of its own too
            model(ids, cache=cache, use_cache=False)
    # every cache made with a model hooks its forward for this; one dropped unclosed leaves none
    import gc

    hooks = len(model._forward_pre_hooks)
    TieredCache(model, tiercache.TierConfig(device_budget="1MiB", host_budget=0, block_tokens=BT))
    gc.collect()
    assert len(model._forward_pre_hooks) == hooks


def test_copying_or_pickling_a_cache_is_a_clear_type_error(tmp_path):
    """transformers' prompt-reuse recipe deep-copies a prefilled cache; this one's blocks live
    in pools, files and I/O threads. The error was pickle's "cannot pickle '_thread.lock'
    object"; it now names TieredCache and the way to reuse a prompt (the prefix cache)."""
    import copy
    import pickle

    model = tiny_model("llama")
    with tiercache.TieredCache(model, tight_config(model, tmp_path, batch=1, device_blocks=12)) as cache:
        generate(model, prompt_ids(), cache=cache, max_new_tokens=2)
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="TieredCache cannot be copied or pickled.*load_prefix"):
                attempt(cache)


@pytest.mark.parametrize("tiers", ["all", "device+host", "attend in place", "no host, no prefetch"])
def test_each_block_attention_reads_is_one_hit_on_the_tier_it_was_on(tmp_path, tiers):
    """``hits`` counts the blocks attention needed, once per layer update, on the tier each
    was found on. A decode token written into a partly filled tail block counted that block
    twice: once as it was brought up to be written (``ensure_device``, or the fast path's
    write key) and once in the layer's read (a review: 177 against 153 blocks read here;
    on SmolLM2 at its default block size, 330 device hits against 180). Counted by the read
    alone, a tail brought up from the disk was a device hit (a second review: 51 device and
    102 disk hits where 47 and 106 were found there). Before each layer update the test
    notes where each block the update reads lies (the device, else the host, else the
    disk; a block the update makes is on the device), and the hits must be those counts,
    on all three tiers, on the device and host with the one-pass fast path, with attention
    reading the blocks in place, and with no host tier and no prefetch (tails come up from
    disk)."""
    model = tiny_model("llama")  # full attention: a layer reads every block it holds
    need = working_set_blocks(layer_windows(model), [PROMPT] + [1] * (NEW - 1))
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=need + 1)
    if tiers == "device+host":
        cfg = cfg.replace(disk_dir=None, disk_budget=0, host_budget=64 * 4096)
    elif tiers == "attend in place":
        cfg = cfg.replace(attend_in_place=True)
    elif tiers == "no host, no prefetch":
        cfg = tight_config(model, tmp_path, batch=1, device_blocks=need, host_blocks=0, prefetch="none")
    found = {"device": 0, "host": 0, "disk": 0}
    with tiercache.TieredCache(model, cfg) as cache:
        update = cache.update

        def counted(k, v, layer_idx, *args, **kwargs):
            layer, store = cache.layers[layer_idx], cache.store
            blocks = math.ceil((layer.num_tokens + k.shape[-2]) / cfg.block_tokens)  # the layer's, all read
            for key in cache._keys(layer_idx, 0, blocks):
                tiers_now = store.tiers_of(key) if store is not None else []  # (opened at the first update)
                tier = next((t for t in (Tier.DEVICE, Tier.HOST, Tier.DISK) if t in tiers_now), Tier.DEVICE)
                found[tier.label] += 1
            return update(k, v, layer_idx, *args, **kwargs)

        cache.update = counted
        generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW)
        stats = cache.stats()
    assert sum(found.values()) == 3 * sum(math.ceil((PROMPT + i) / BT) for i in range(NEW))
    assert stats["misses"] == 0
    if tiers == "all" or tiers == "attend in place":  # a host copy the update's own room-making sends
        below = ("host", "disk")                      # down is found on disk: only their sum is known
        assert stats["hits"]["device"] == found["device"], (stats["hits"], found)
        assert sum(stats["hits"][t] for t in below) == sum(found[t] for t in below), (stats["hits"], found)
    else:
        assert stats["hits"] == found, (stats["hits"], found)
    if tiers in ("all", "no host, no prefetch"):
        assert stats["hits"]["disk"] > 0


def test_a_prefetch_plugin_hears_a_copy_of_the_blocks_a_layer_reads(tmp_path):
    """A prefetch plug-in's ``observe`` was handed the cache's own list of the blocks the
    layer was about to read; one that sorted it newest first, or kept it and swapped two
    keys later, made attention read other blocks: logits 7.45 off DynamicCache, no error
    (a review). It hears a tuple now: sorting it in place is its own error, named; keeping
    it changes nothing; the logits equal DynamicCache's."""
    from tiercache.policies import PREFETCH_POLICIES

    heard = []

    class Rearranges(PREFETCH_POLICIES["next-layer"]):
        def observe(self, layer_idx, keys):
            heard.append(keys)
            if isinstance(keys, list):  # what the old hand-over let it do
                keys.reverse()
            if len(heard) > 1 and isinstance(heard[-2], list) and len(heard[-2]) > 1:
                heard[-2][0], heard[-2][1] = heard[-2][1], heard[-2][0]  # a list kept, changed later
            super().observe(layer_idx, keys)

    with registered(PREFETCH_POLICIES, "rearranges", Rearranges):
        model, ids, cfg = _streamed_run(tmp_path, prefetch="rearranges")
        with tiercache.TieredCache(model, cfg) as cache:
            out = generate(model, ids, cache=cache, max_new_tokens=NEW)
            assert_all_tiers_used(cache.stats())
        assert heard and all(isinstance(keys, tuple) for keys in heard)
        assert_same(generate(model, ids, max_new_tokens=NEW), out, "a plug-in that rearranges what it hears")


def test_a_rollback_into_a_dropped_window_is_refused_even_by_one_token(tmp_path):
    """A sliding layer not recording its past frees the blocks before its window. A crop
    that keeps ``n`` tokens is possible only if the next token's window (the ``window - 1``
    tokens before it) is still held: with blocks from token ``first * bt`` on, ``n`` must be
    at least ``first * bt + window - 1``. Rolling back a single token already fails that
    here (the window starts inside a freed block): it is refused, and the layer keeps its
    tokens, where accepting it would attend next over a window with tokens missing (a
    mutation review found only crops below the first kept block tested)."""
    model = tiny_model("mistral")  # every layer slides, window 6
    ids = prompt_ids()
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=16)
    with tiercache.TieredCache(model, cfg) as cache:
        generate(model, ids, cache=cache, max_new_tokens=NEW)
        layer = cache.layers[0]
        held, window = layer.num_tokens, layer.sliding_window
        first = layer.first_block
        assert first > 0 and held - 1 < first * BT + window - 1 <= held  # one token back lands in the gap
        with pytest.raises(RuntimeError, match="already dropped the tokens needed to roll back"):
            cache.crop(-1)
        assert [lay.num_tokens for lay in cache.layers] == [held] * len(cache.layers)
