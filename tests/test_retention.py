"""Lossy retention (streaming, h2o, tova, snapkv) over the tiers.

The invariant: whatever a policy drops, the compacted cache computes exactly what the full
cache computes with the dropped tokens hidden. The reference runs transformers'
DynamicCache with an explicit mask (per layer and KV head, through a test attention
function) that hides exactly the tokens the TieredCache no longer holds; logits agree
within 1e-5 at every forward, ``get_seq_length()`` stays the absolute count, and positions
(RoPE, learned) stay right. Budgets are small enough that every tier is used.
"""
from __future__ import annotations

import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiercache  # noqa: E402
from tiercache import TieredCache  # noqa: E402
from tiercache.attention import visible  # noqa: E402
from tiercache.policies import RETENTION_POLICIES, make_retention  # noqa: E402
from test_hf_exactness import (ATOL, BT, NEW, PAD, PROMPT, assert_all_tiers_used, assert_plugin_refused,  # noqa: E402
                               generate, layer_windows, prompt_ids, registered, tight_config, tiny_model,
                               working_set_blocks)

REF = "tiercache_test_reference"
BUDGET = 7  # tokens kept per full-attention layer (< PROMPT, so the prompt alone overflows it)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---------------------------------------------------------------------------------------------
# Policy contract (no model)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RETENTION_POLICIES))
def test_retention_policy_contract(name):
    """Every policy returns, per row and KV head, ``budget`` distinct sorted indices into the
    stored tokens, always keeps the newest token, and prefers dropping padding."""
    policy = make_retention(name)
    b, h, n, budget = 2, 3, 40, 12
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(b, h, n, generator=g)
    valid = torch.ones(b, h, n, dtype=torch.bool)
    valid[1, :, :5] = False  # row 1 is left-padded
    index = policy.keep(scores if policy.score_rows != "none" else None, valid, budget)
    assert index.shape == (b, h, budget) and index.dtype == torch.long
    assert torch.equal(index, index.sort(-1).values)
    assert all(len(set(row.tolist())) == budget for row in index.reshape(-1, budget))
    assert bool((index[..., -1] == n - 1).all()), "the newest token must stay"
    assert policy.min_budget() >= 1
    # padding goes first for every policy: streaming's sinks were row 1's padding, attention
    # never sees it, and its real first tokens were dropped (a helper's batch test)
    assert not bool((index[1] < 5).any()), "padding tokens are dropped before real ones"


def test_streaming_keeps_sinks_and_window():
    index = make_retention("streaming", sinks=2).keep(None, torch.ones(1, 1, 10, dtype=torch.bool), 5)
    assert index.flatten().tolist() == [0, 1, 7, 8, 9]


def test_h2o_keeps_heavy_hitters_and_recent():
    scores = torch.zeros(1, 1, 10)
    scores[0, 0, 3] = 5.0  # a heavy hitter
    index = make_retention("h2o").keep(scores, torch.ones(1, 1, 10, dtype=torch.bool), 4)
    assert index.flatten().tolist()[:1] == [3] and index.flatten().tolist()[-2:] == [8, 9]


# ---------------------------------------------------------------------------------------------
# The reference: DynamicCache with the dropped tokens hidden per layer and KV head
# ---------------------------------------------------------------------------------------------
class Hidden:
    """Per layer: bool [B, H_kv, N] of absolute positions the reference must not attend to."""

    def __init__(self):
        self.by_layer: dict = {}


def _ref_attention(hidden: Hidden):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def fn(module, query, key, value, attention_mask, **kwargs):
        eager = module.config._tc_ref_inner == "eager"
        inner = (getattr(sys.modules[type(module).__module__], "eager_attention_forward") if eager
                 else ALL_ATTENTION_FUNCTIONS["sdpa"])
        hid = hidden.by_layer.get(module.layer_idx)
        if hid is not None:
            b, hq, q, _ = query.shape
            hkv, n = key.shape[1], key.shape[2]
            vis = visible(attention_mask, q, n, key.device)
            extra = torch.zeros(b, hkv, n, dtype=torch.bool)
            extra[..., :hid.shape[-1]] = hid
            vis = vis & ~extra.repeat_interleave(hq // hkv, dim=1).unsqueeze(2)
            attention_mask = (torch.where(vis, 0.0, torch.finfo(query.dtype).min).to(query.dtype) if eager else vis)
        return inner(module, query, key, value, attention_mask, **kwargs)
    return fn


def _reference_model(family: str, hidden: Hidden):
    import copy

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(REF, _ref_attention(hidden))
    model = copy.deepcopy(tiny_model(family))
    for config in {id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values():
        config._tc_ref_inner = "eager" if family == "gemma2" else "sdpa"
        config._attn_implementation = REF
    ALL_MASK_ATTENTION_FUNCTIONS.register(
        REF, lambda *a, config=None, **k: ALL_MASK_ATTENTION_FUNCTIONS[config._tc_ref_inner](*a, config=config, **k))
    return model


def _schedule(mode: str) -> tuple:
    """(input ids [B, PROMPT], 2D mask, forward sizes of the prompt)."""
    ids, mask = prompt_ids(), None
    chunks = [PROMPT]
    if "batch2" in mode:
        ids = prompt_ids(batch=2, seed=1)
        mask = torch.ones_like(ids)
        ids[1, :3], mask[1, :3] = PAD, 0
    if "chunked" in mode:
        chunks = [4, 4, 2]
    return ids, (mask if mask is not None else torch.ones_like(ids)), chunks


def run_against_reference(family: str, policy: str, mode: str, tmp_path, budget: int = BUDGET) -> dict:
    """Greedy-decode NEW tokens with a retaining TieredCache (manual forwards); replay the same
    forwards on DynamicCache hiding what the tiered cache dropped; compare logits."""
    model = tiny_model(family)
    ids, mask, chunks = _schedule(mode)
    batch = ids.shape[0]
    # The device holds one retained layer's working set (kept tokens + a forward) and a block more:
    # compacted layers of 2-5 blocks still cycle through host and disk.
    sliding = [w for w in layer_windows(model) if w]
    most = PROMPT + NEW if policy == "snapkv" else budget + max(chunks)  # snapkv grows while decoding
    full = [w for w in layer_windows(model) if not w]
    need = max([-(-most // BT) if full else 1] + ([working_set_blocks(sliding, chunks + [1] * NEW)]
                                                      if sliding else []))
    cfg = tight_config(model, tmp_path, batch=batch, device_blocks=need + 1, retention=policy,
                       retention_budget=budget)
    hidden = Hidden()
    ref_model = _reference_model(family, hidden)
    ref_cache = transformers.DynamicCache(config=model.config)
    seen = 0
    with TieredCache(model, cfg) as cache, torch.no_grad():
        pieces = [ids[:, seen:seen + c] for seen, c in zip([sum(chunks[:i]) for i in range(len(chunks))], chunks)]
        full_mask = mask
        nxt = None
        diffs = []
        for step in range(len(pieces) + NEW):
            if step < len(pieces):
                x = pieces[step]
            else:
                x = nxt
                full_mask = torch.cat([full_mask, torch.ones(batch, 1, dtype=full_mask.dtype)], -1)
            q = x.shape[1]
            attn = full_mask[:, :seen + q]
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -q:]
            # What the tiered cache holds going into this forward (snapkv settles at its start).
            if cache.retention_state is not None:
                cache.retention_state.settle(q)
            for layer_idx, layer in enumerate(cache.layers):
                kept = cache.retention_state.positions(layer_idx)
                if kept is None or layer.dropped == 0:
                    hidden.by_layer.pop(layer_idx, None)
                    continue
                hid = torch.ones(batch, kept.shape[1], seen, dtype=torch.bool)
                hid.scatter_(-1, kept, False)
                hidden.by_layer[layer_idx] = hid
            out = model(x, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
            ref = ref_model(x, attention_mask=attn, position_ids=pos, cache=ref_cache, use_cache=True)
            diffs.append((out.logits - ref.logits).abs().max().item())
            seen += q
            assert cache.get_seq_length() == seen == ref_cache.get_seq_length()
            nxt = out.logits[:, -1:].argmax(-1)
        stats, astats = cache.stats(), cache.attention_stats()
    assert max(diffs) <= ATOL, f"{family}/{policy}/{mode}: logits differ from the masked reference: {diffs}"
    return {"stats": stats, "retention": astats["retention"]}


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2"]


@pytest.mark.parametrize("policy", sorted(RETENTION_POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_retention_matches_masked_full_cache(family, policy, tmp_path):
    """Prefill then decode: every forward's logits equal the full cache's with exactly the
    dropped tokens hidden; the tiers were used; tokens were dropped where a layer has full
    attention (Mistral slides everywhere: nothing to retain)."""
    result = run_against_reference(family, policy, "prefill", tmp_path)
    assert_all_tiers_used(result["stats"])
    if family != "mistral":
        assert result["retention"]["dropped_tokens"] > 0


@pytest.mark.parametrize("policy", sorted(RETENTION_POLICIES))
@pytest.mark.parametrize("mode", ["chunked", "batch2", "batch2+chunked"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_retention_modes_match_masked_full_cache(family, mode, policy, tmp_path):
    """Chunked prefill (compaction between chunks; snapkv waits for the prompt's end) and a
    left-padded batch of two (stored padding stays hidden per head) are exact too."""
    result = run_against_reference(family, policy, mode, tmp_path)
    assert result["retention"]["dropped_tokens"] > 0


@pytest.mark.parametrize("policy", sorted(RETENTION_POLICIES))
def test_compacted_mask_sizes_and_absolute_length(policy, tmp_path):
    """get_mask_sizes reports the compacted size (kept + query) with the offset that puts the
    new tokens at their absolute index; get_seq_length stays the absolute count."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, retention=policy, retention_budget=BUDGET)
    with TieredCache(model, cfg) as cache:
        generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW)
        total = PROMPT + NEW - 1
        assert cache.get_seq_length() == total
        kept = cache.attention_stats()["retention"]["kept_tokens"][0]
        assert cache.get_mask_sizes(1, 0) == (kept + 1, total - kept)
        limit = PROMPT if policy == "snapkv" else BUDGET  # snapkv compresses the prompt, then grows
        assert kept <= max(limit, BUDGET) + (NEW - 1 if policy == "snapkv" else 0)
        positions = cache.retention_state.positions(0)
        assert positions.shape[-1] == kept and int(positions.max()) == total - 1


def test_beam_search_with_retention_runs_and_keeps_lengths(tmp_path):
    """Beam search reorders the retention state with the blocks; lengths stay absolute."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=3, device_blocks=12, retention="h2o", retention_budget=BUDGET)
    with TieredCache(model, cfg) as cache:
        out = generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW, num_beams=3)
        assert out.sequences.shape[-1] == PROMPT + NEW
        assert cache.get_seq_length() >= PROMPT + NEW - 1
        assert cache.retention_state.positions(0).shape[0] == 3


def test_budget_above_context_is_exact_in_generate(tmp_path):
    """With a budget above the whole context nothing is dropped and generate() (greedy and
    beam) equals DynamicCache's; wrap() installs the hook for it."""
    from test_hf_exactness import assert_same

    model = tiny_model("qwen2")
    ids = prompt_ids()
    for kwargs in ({}, {"num_beams": 3}):
        batch = 3 if kwargs else 1
        ref = generate(model, ids, max_new_tokens=NEW, **kwargs)
        cfg = tight_config(model, tmp_path, batch=batch, device_blocks=12, retention="h2o", retention_budget=64)
        with TieredCache(model, cfg) as cache:
            out = generate(model, ids, cache=cache, max_new_tokens=NEW, **kwargs)
        assert_same(ref, out, f"h2o with a budget above the context {kwargs}")


@pytest.mark.parametrize("policy", sorted(RETENTION_POLICIES))
def test_a_crop_before_any_drop_keeps_retention_in_step(policy, tmp_path):
    """crop() before anything was dropped (a budget above the context; what assisted
    generation does after each draft) left the policy's per-token state at the old length,
    and the next forward failed inside torch on mismatched sizes. With a budget above the
    whole context the cache is lossless, so a generate, a crop of 3 tokens and another
    generate give DynamicCache's tokens and logits for the same steps."""
    from test_hf_exactness import assert_same

    model = tiny_model("llama")
    ids = prompt_ids()
    runs = []
    for cache_of in (lambda: transformers.DynamicCache(),
                     lambda: TieredCache(model, tight_config(model, tmp_path / policy, batch=1, device_blocks=12,
                                                             retention=policy, retention_budget=64))):
        cache = cache_of()
        first = generate(model, ids, cache=cache, max_new_tokens=4)
        cache.crop(-3)
        kept = first.sequences[:, :cache.get_seq_length()]
        second = generate(model, torch.cat([kept, ids[:, :5]], dim=1), cache=cache, max_new_tokens=4)
        runs.append((first, second))
        if hasattr(cache, "close"):
            assert cache.retention_state.layers[0].positions.shape[-1] == cache.layers[0].num_tokens
            cache.close()
    (ref_a, ref_b), (out_a, out_b) = runs
    assert_same(ref_a, out_a, f"{policy}: before the crop")
    assert_same(ref_b, out_b, f"{policy}: after the crop")


def test_snapkv_with_assisted_generation_runs(tmp_path, caplog):
    """snapkv commits its choice at the first decode step; assisted generation's first
    verification has several tokens, which cancels it, so nothing was dropped when the
    crop came, and the next forward failed inside torch. It runs now, every tier in use,
    and the store's books hold. Nothing is dropped in the whole run (every verification has
    several tokens), which went unsaid (a review): a warning says so at the first crop."""
    model, draft = tiny_model("llama"), tiny_model("llama", assistant=True)
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, retention="snapkv", retention_budget=BUDGET)
    with TieredCache(model, cfg) as cache, caplog.at_level("WARNING", logger="tiercache"):
        out = generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW, assistant_model=draft)
        assert out.sequences.shape[1] == PROMPT + NEW
        cache.store.check()
        assert cache.retention_state.compactions == 0
    assert caplog.text.count("retention='snapkv' cuts the prompt when the first decode step of one token runs") == 1
    caplog.clear()  # with a budget above the whole run there was nothing to cut: no warning (a review)
    roomy = tight_config(model, tmp_path / "roomy", batch=1, device_blocks=12, retention="snapkv",
                         retention_budget=PROMPT + NEW + 8)
    with TieredCache(model, roomy) as cache, caplog.at_level("WARNING", logger="tiercache"):
        generate(model, prompt_ids(), cache=cache, max_new_tokens=NEW, assistant_model=draft)
    assert "cuts the prompt" not in caplog.text


@pytest.mark.parametrize("policy", sorted(RETENTION_POLICIES))
def test_a_left_padded_row_keeps_what_it_keeps_alone(policy, tmp_path):
    """A row's choice of tokens does not depend on its padding: in a batch of two where row
    1 is left-padded by 6 tokens, it generates what it generates alone, with logits within
    float rounding (DynamicCache's own batch differs by ~5e-6). streaming kept the padding as
    its sinks, and snapkv pooled its scores over the padding's zeros: 8.2 in the logits."""
    model, pad = tiny_model("llama"), 6
    x = prompt_ids(batch=2, length=20, seed=1)
    mask = torch.ones_like(x)
    x[1, :pad], mask[1, :pad] = PAD, 0
    outs = []
    for ids, m, batch in ((x, mask, 2), (x[1:, pad:], None, 1)):
        cfg = tight_config(model, tmp_path / f"b{batch}", batch=batch, device_blocks=9, retention=policy,
                           retention_budget=8)
        with TieredCache(model, cfg) as cache:
            outs.append(generate(model, ids, cache=cache, mask=m, max_new_tokens=8))
            assert cache.retention_state.dropped_tokens > 0
    both, alone = outs
    assert both.sequences[1, 20:].tolist() == alone.sequences[0, 20 - pad:].tolist(), policy
    assert max((a[1] - b[0]).abs().max().item() for a, b in zip(both.logits, alone.logits)) <= 1e-4


def test_assisted_generation_refuses_rollback_after_drops(tmp_path):
    """A cache that dropped tokens cannot be cropped: a clear error, not wrong output."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, retention="streaming", retention_budget=BUDGET)
    with TieredCache(model, cfg) as cache:
        generate(model, prompt_ids(), cache=cache, max_new_tokens=3)
        with pytest.raises(RuntimeError, match="cannot roll back"):
            cache.crop(-2)


def test_a_refused_rollback_crops_no_layer(tmp_path):
    """Gemma2 (a sliding layer before a full one) recording its past, as assisted generation
    does, with a retention policy that cut the full layers: ``crop(-2)`` is refused, and no
    layer is cropped. The sliding layer was cropped first and the full one then refused, so
    the layers disagreed on their length (13, 11, 13) and later forwards failed inside torch
    or attended to a rejected draft token (a review). The cache then goes on as if no crop
    had been asked for: its next tokens are those of a run that never asked."""
    model = tiny_model("gemma2")
    outs = []
    for ask in (True, False):
        cfg = tight_config(model, tmp_path / str(ask), batch=1, device_blocks=12, retention="streaming",
                           retention_budget=BUDGET)
        with TieredCache(model, cfg) as cache:
            for layer in cache.layers:
                layer.activate_past_recording()
            first = generate(model, prompt_ids(), cache=cache, max_new_tokens=4)
            lengths = [layer.num_tokens for layer in cache.layers]
            assert any(layer.dropped for layer in cache.layers) and not cache.layers[0].dropped
            if ask:
                with pytest.raises(RuntimeError, match="layer 1 dropped .* cannot roll back"):
                    cache.crop(-2)
                assert [layer.num_tokens for layer in cache.layers] == lengths
            outs.append(generate(model, first.sequences, cache=cache, max_new_tokens=3).sequences)
    assert torch.equal(outs[0], outs[1])


def test_wrap_installs_retention(tmp_path):
    """tiercache.wrap(model, cfg) with a retention policy: plain generate() drops tokens."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    tiercache.wrap(model, tight_config(model, tmp_path, batch=1, device_blocks=12, retention="tova",
                                       retention_budget=BUDGET))
    out = generate(model, prompt_ids(), max_new_tokens=NEW)
    assert out.sequences.shape[-1] == PROMPT + NEW
    assert model.tiercache_last.attention_stats()["retention"]["dropped_tokens"] > 0


@pytest.mark.parametrize("breach, message", [
    ("a token twice", "distinct and sorted"),
    ("past the end", "distinct and sorted"),
    ("too few", r"shape \(1, 2, 6\), not \[B, H_kv, budget\] = \(1, 2, 7\)"),
    ("floats", "not a tensor of token indices"),
    ("raises", "failed in keep: IndexError: policy bug"),
    ("raises in combine", "failed in combine: IndexError: policy bug"),
    # combine's answer was taken unchecked: a torch error from the cache's books (a review)
    ("combine sums the heads", r"broke the contract of combine: it returned scores of shape \[1, \d+\], not "
                               r"\[B, H_kv, N\] = \[1, 2, \d+\]"),
    ("combine returns None", "broke the contract of combine: it returned NoneType, not a tensor of scores"),
])
def test_a_plugin_retention_that_breaks_keep_is_named_before_it_costs_a_token(breach, message, tmp_path):
    """A plug-in retention policy whose ``keep`` names a token twice (a silently wrong cache:
    that token would count twice in attention), one past the stored tokens, fewer than the
    budget, floats, or raises (in ``keep`` or in ``combine``, which merges attention scores):
    ``generate()`` stops with a ``PolicyError`` that names the policy and the breach, before
    the answer is used. (Before the check, the first and the third case generated their
    tokens without a word, and the second and fourth stopped with an error from inside
    torch's ``gather``.)"""
    from tiercache.policies import RETENTION_POLICIES as registry

    class Broken(registry["h2o" if "combine" in breach else "streaming"]):  # h2o scores
        def combine(self, previous, mass):
            if breach == "raises in combine":
                raise IndexError("policy bug")
            if breach == "combine sums the heads":
                return mass.sum(dim=1)
            if breach == "combine returns None":
                return None
            return super().combine(previous, mass)

        def keep(self, scores, valid, budget):
            index = super().keep(scores, valid, budget)
            if breach == "a token twice":
                index[..., 1] = index[..., 0]
            elif breach == "past the end":
                index[..., -1] = valid.shape[-1]
            elif breach == "too few":
                index = index[..., 1:]
            elif breach == "floats":
                index = index.float()
            else:
                raise IndexError("policy bug")
            return index

    assert_plugin_refused(registry, "retention", Broken, message, tmp_path, max_new_tokens=3, retention_budget=BUDGET)


@pytest.mark.parametrize("attrs, message", [
    ({"score_rows": "every"}, "has score_rows='every'; expected one of none, all, last, window"),
    ({"min_budget": lambda self: "2"}, "says its min_budget() is '2'; expected a whole number of tokens >= 1"),
    ({"__init__": lambda self, ratio: None}, "cannot be made as the cache makes it (TypeError"),
])
def test_a_plugin_retention_policy_that_cannot_be_used_is_named_by_the_config(attrs, message):
    """A registered retention policy whose score_rows is misspelt (a KeyError from the
    attention hook at the first forward), whose min_budget() is not a number (a TypeError
    from the config's comparison) or that needs constructor arguments (a TypeError from the
    config): each is a ValueError naming the policy when the config is made (a review)."""
    from tiercache.policies import RETENTION_POLICIES as registry

    broken = type("Broken", (registry["streaming"],), dict(attrs))
    with registered(registry, "broken", broken):
        with pytest.raises(ValueError, match=re.escape(f"retention: the policy 'broken' {message}")):
            tiercache.TierConfig(retention="broken")


@pytest.mark.parametrize("chunk", [9, 3, 4])  # last chunks of 1, 1 and 2 tokens; snapkv's window is 3
def test_snapkv_observes_the_prompt_window_across_chunks(chunk, tmp_path):
    """Scenario: a wrapped model computes a 10-token prompt in chunks whose last one is
    shorter than snapkv's observation window (3 tokens at this budget). SnapKV scores the
    prompt's last 3 tokens however the prompt was cut: the kept tokens, and so the
    answer, are those of the prompt computed at once. Before, a one-token last chunk
    cut the prompt with the chunk before's window (and left the last token out of it),
    and a two-token one scored with 2 rows instead of 3."""
    import copy

    from test_hf_exactness import assert_same

    model = copy.deepcopy(tiny_model("llama"))
    assert make_retention("snapkv").window_for(BUDGET) == 3
    runs = {}
    for name, size in (("whole", None), ("chunked", chunk)):
        tiercache.wrap(model, tight_config(model, tmp_path / name, batch=1, device_blocks=12, retention="snapkv",
                                           retention_budget=BUDGET))
        kwargs = {} if size is None else {"prefill_chunk_size": size}
        out = generate(model, prompt_ids(), max_new_tokens=3, **kwargs)
        state = model.tiercache_last.retention_state
        assert state.compactions > 0, f"{name}: snapkv never cut the prompt"
        runs[name] = (out, {i: state.positions(i).clone() for i in state.layers})
    (whole, kept_whole), (chunked, kept_chunked) = runs["whole"], runs["chunked"]
    assert kept_whole.keys() == kept_chunked.keys()
    for layer_idx in kept_whole:
        assert torch.equal(kept_whole[layer_idx], kept_chunked[layer_idx]), (
            f"layer {layer_idx}: kept {kept_chunked[layer_idx].tolist()} with chunks of {chunk}, "
            f"{kept_whole[layer_idx].tolist()} with the prompt at once")
    assert_same(whole, chunked, f"chunks of {chunk}")
    assert all(state.window is None for state in model.tiercache_last.retention_state.layers.values()), \
        "the prompt's window rows are let go once decoding starts"


def test_snapkv_keeps_only_its_window_rows_of_a_prompt_chunk(tmp_path):
    """The rows kept for the next chunk are copies: views of the chunk's last window rows
    kept the whole chunk's queries and mask alive until decoding (an 8B model's 2048-token
    chunks: about half a GiB; a review)."""
    model = tiny_model("llama")
    cfg = tight_config(model, tmp_path, batch=1, device_blocks=12, retention="snapkv", retention_budget=BUDGET)
    ids = prompt_ids()
    with TieredCache(model, cfg) as cache, torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
        windows = [state.window for state in cache.retention_state.layers.values()]
        assert windows and all(w is not None for w in windows)
        for query, vis in windows:
            assert query.shape[2] == vis.shape[2] == 3  # the window at this budget
            for t in (query, vis):
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a view of the whole chunk"
