"""The Hugging Face hook: ``TieredCache``, a ``transformers.Cache`` whose KV lives in a BlockStore.

Per layer and forward, ``update`` appends the new tokens into the layer's tail block in
place (new blocks are allocated on the device tier), makes every block that attention
reads resident on the device (waiting only for what is not there yet), returns K/V for
attention, and starts fetching the next layer's blocks (prefetch policy). The blocks of the
layer just returned stay pinned until the next ``update``, so nothing attention is reading
can be evicted under it.
"""
from __future__ import annotations

import itertools
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from tiercache.config import TierConfig, format_bytes
from tiercache.disk import ensure_private_dir
from tiercache.errors import CapacityError, UnsupportedModelError
from tiercache.events import Events
from tiercache.policies import make_eviction, make_prefetch
from tiercache.attention import SCORES_ATTR
from tiercache.store import BlockStore
from tiercache.table import BlockKey
from tiercache.tiers import BlockGeometry

if TYPE_CHECKING:
    from tiercache.lab.trace import TraceWriter

log = logging.getLogger("tiercache")

_SEQ_IDS = itertools.count(1)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


class TieredLayer(CacheLayerMixin):
    """Bookkeeping of one layer: how many tokens it holds and which blocks are live.

    The bytes live in the cache's block store; the layer never holds K/V tensors itself.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "TieredCache", layer_idx: int, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.num_tokens = 0  # absolute tokens seen (kept across dropped sliding blocks)
        self.first_block = 0  # first block still stored (sliding layers free older ones)
        self.record_past = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True
        self.device = key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def visible_start(self) -> int:
        """First token that attention sees before the next update (sliding: the window)."""
        if not self.is_sliding:
            return 0
        return max(self.num_tokens - self.sliding_window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same sizes as DynamicLayer / DynamicSlidingWindowLayer, so masks match DynamicCache's.
        start = self.visible_start()
        return self.num_tokens - start + query_length, start

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def activate_past_recording(self) -> None:
        self.record_past = True

    def reset(self) -> None:
        self._cache._drop_layer(self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._cache._crop_layer(self.layer_idx, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # done cache-wide
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TieredCache does not support batch_repeat_interleave "
                                  "(contrastive search); use greedy, sampling, beam or assisted generation")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TieredCache does not support batch_select_indices")


def check_supported(config: Any) -> Any:
    """Return the decoder's text config, or raise UnsupportedModelError naming the reason."""
    arch = ", ".join(getattr(config, "architectures", None) or [getattr(config, "model_type", "?")])
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch}: encoder-decoder models are not supported (decoder-only causal LMs only)")
    text = config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None):
        raise UnsupportedModelError(f"{arch}: multi-latent attention (compressed KV) is not supported")
    layer_types, _ = get_layer_types_and_kwargs(text)
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedModelError(f"{arch}: layer types {other} (linear-attention or hybrid layers) are not "
                                    f"supported; tiercache serves attention KV caches only")
    return text


class TieredCache(Cache):
    """A ``transformers.Cache`` that keeps the KV cache in blocks across device, host and disk.

    Args:
        model: the model (or its config) the cache serves.
        config: budgets and policies; ``TierConfig()`` by default.

    Example::

        cfg = tiercache.TierConfig(device_budget="32MiB", host_budget="128MiB",
                                   disk_dir="./kv", disk_budget="4GiB")
        with tiercache.TieredCache(model, cfg) as cache:
            out = model.generate(**inputs, cache=cache, max_new_tokens=256)
            print(cache.stats()["moves"])
    """

    def __init__(self, model: Any, config: Optional[TierConfig] = None, *,
                 trace: Union[str, "TraceWriter", None] = None) -> None:
        self.tier_config = config if config is not None else TierConfig()
        model_config = getattr(model, "config", model)
        text = check_supported(model_config)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers = [TieredLayer(self, i, kw.get("sliding_window") if t != "full_attention" else None)
                  for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        super().__init__(layers=layers)
        self.num_layers = len(layers)
        self.events = Events(self.tier_config.eviction)
        self.prefetch_policy = make_prefetch(self.tier_config.prefetch, **(
            {"depth": self.tier_config.prefetch_depth} if self.tier_config.prefetch == "lookahead" else {}))
        self.seq_id = next(_SEQ_IDS)
        self.wants_scores = getattr(make_eviction(self.tier_config.eviction), "wants_scores", False)
        self.trace = self._open_trace(trace)
        self._step = -1
        self._step_tokens = 0
        self._pending_read: Optional[tuple] = None  # (keys, t_us) awaiting the attention hook's scores
        self._pending_scores: Optional[dict] = None
        if (self.wants_scores or self.trace is not None) and hasattr(model, "config") and hasattr(model, "forward"):
            from tiercache.attention import install
            install(model)  # same outputs; adds per-block attention mass
        self.store: Optional[BlockStore] = None
        self._pinned: list = []
        self._session_dir: Optional[str] = None
        self.closed = False

    # ---- the store ----------------------------------------------------------------------
    def _open_store(self, key_states: torch.Tensor) -> BlockStore:
        cfg = self.tier_config
        batch, kv_heads, _, head_dim = key_states.shape
        geometry = BlockGeometry(batch, kv_heads, cfg.block_tokens, head_dim, key_states.dtype)
        disk_dir = None
        if cfg.disk_enabled:
            ensure_private_dir(cfg.disk_dir)
            sessions = os.path.join(cfg.disk_dir, "sessions")
            ensure_private_dir(sessions)
            disk_dir = os.path.join(sessions, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._session_dir = disk_dir
        device = cfg.device or key_states.device
        store = BlockStore(cfg, geometry, device=device, disk_dir=disk_dir, persistent=False, events=self.events)
        store.defer_stall = True
        return store

    # ---- traces and attention scores -----------------------------------------------------
    @staticmethod
    def _open_trace(trace: Union[str, "TraceWriter", None]) -> Optional["TraceWriter"]:
        if trace is None or not isinstance(trace, (str, os.PathLike)):
            return trace
        from tiercache.lab.trace import TraceWriter
        return TraceWriter(os.fspath(trace))

    def _flush_trace(self) -> None:
        if self.trace is None or self._pending_read is None:
            return
        keys, t_us = self._pending_read
        self.trace.record("read", keys, self.store.geometry.block_bytes, self._step, self._step_tokens,
                          scores=self._pending_scores, t_us=t_us)
        self._pending_read = self._pending_scores = None

    def _scores_hook(self, keys: list, offset: int):
        bt = self.tier_config.block_tokens

        def on_scores(mass: torch.Tensor) -> None:
            padded = torch.nn.functional.pad(mass.float().cpu(), (offset, len(keys) * bt - offset - mass.shape[0]))
            per_block = padded.view(len(keys), bt).sum(dim=1).tolist()
            scores = dict(zip(keys, per_block))
            if self.wants_scores and self.store is not None:
                self.store.observe_scores(scores)
            if self.trace is not None:
                self._pending_scores = scores
        return on_scores

    def _key(self, layer_idx: int, index: int) -> BlockKey:
        return BlockKey(self.seq_id, layer_idx, index)

    def _blocks_of(self, layer_idx: int) -> list:
        layer = self.layers[layer_idx]
        bt = self.tier_config.block_tokens
        last = (layer.num_tokens + bt - 1) // bt
        return [self._key(layer_idx, i) for i in range(layer.first_block, last)]

    def _check_capacity(self, query_length: int) -> None:
        """Before the first layer of a forward writes anything: will every layer fit?"""
        store, bt = self.store, self.tier_config.block_tokens
        new_blocks, widest = 0, 0
        for layer in self.layers:
            after = layer.num_tokens + query_length
            new_blocks += (after + bt - 1) // bt - (layer.num_tokens + bt - 1) // bt
            first = layer.visible_start() // bt
            widest = max(widest, (after + bt - 1) // bt - first)
        g = store.geometry
        if widest > store.num_slots(store.tiers[0]):
            raise CapacityError(
                f"device_budget={format_bytes(self.tier_config.device_budget)} holds "
                f"{store.num_slots(store.tiers[0])} blocks of {format_bytes(g.block_bytes)}, but attention "
                f"needs one whole layer resident: {widest} blocks; minimum device_budget = "
                f"{widest * g.block_bytes} bytes ({format_bytes(widest * g.block_bytes)})")
        live = len(store)
        if live + new_blocks > store.capacity_blocks():
            needed = (live + new_blocks) * g.block_bytes
            cfg = self.tier_config
            raise CapacityError(
                f"the KV cache needs {live + new_blocks} blocks ({format_bytes(needed)}) but the tiers hold "
                f"{store.capacity_blocks()} (device_budget={format_bytes(cfg.device_budget)}, "
                f"host_budget={format_bytes(cfg.host_budget)}, disk_budget="
                f"{format_bytes(cfg.disk_budget) if cfg.disk_enabled else '0 (no disk_dir)'}); "
                f"nothing was written")

    # ---- transformers.Cache API -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, q, D]
        if self.closed:
            raise RuntimeError("TieredCache is closed")
        if self.store is None:
            self.store = self._open_store(key_states)
        elif key_states.shape[0] != self.store.geometry.batch or key_states.dtype != self.store.geometry.dtype:
            if all(layer.num_tokens == 0 for layer in self.layers):
                self.store.close()
                self.store = self._open_store(key_states)
            else:
                raise ValueError(f"TieredCache holds batch {self.store.geometry.batch} of "
                                 f"{self.store.geometry.dtype}; got batch {key_states.shape[0]} of "
                                 f"{key_states.dtype} (use a new cache or reset() this one)")
        store, bt = self.store, self.tier_config.block_tokens
        layer = self.layers[layer_idx]
        layer.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._flush_trace()
        if layer_idx == 0:
            self._check_capacity(q)
            self.events.tokens(prefill=q if q > 1 else 0, decode=1 if q == 1 else 0)
            self._step += 1
            self._step_tokens = q
        store.note_compute()
        store.unpin(self._pinned)  # attention of the previous layer is done
        self._pinned = []

        start, end = layer.num_tokens, layer.num_tokens + q
        first_new = (start + bt - 1) // bt
        write_keys = []
        if start % bt:  # a partly filled tail block
            tail = self._key(layer_idx, start // bt)
            store.ensure_device([tail])
            self._pinned.append(tail)
            store.begin_write(tail)
            write_keys.append(tail)
        fresh = [self._key(layer_idx, i) for i in range(first_new, (end + bt - 1) // bt)]
        if fresh:
            store.new_blocks(fresh, protect=write_keys)
            self._pinned.extend(fresh)
            write_keys.extend(fresh)
        for key, slot in zip(write_keys, store.device_slots(write_keys)):
            lo, hi = max(start, key.index * bt), min(end, (key.index + 1) * bt)
            store.device_pool.write_tokens(slot, lo - key.index * bt, key_states[:, :, lo - start:hi - start],
                                           value_states[:, :, lo - start:hi - start])
            store.note_tokens(key, hi - key.index * bt)
            if hi == (key.index + 1) * bt:
                store.write_behind(key)  # sealed: give it a clean copy below
        read_from = layer.visible_start()
        layer.num_tokens = end

        needed = [self._key(layer_idx, i) for i in range(read_from // bt, (end + bt - 1) // bt)]
        offset = read_from - (read_from // bt) * bt
        if self.trace is not None:
            t_us = self.trace.now_us()
            self.trace.record("write", write_keys, store.geometry.block_bytes, self._step, q, t_us=t_us)
            self._pending_read = (needed, t_us)
        keys, values = store.read_layer(needed, end - read_from, offset)
        if self.wants_scores or self.trace is not None:
            setattr(keys, SCORES_ATTR, self._scores_hook(needed, offset))
        self.prefetch_policy.observe(layer_idx, needed)
        plan = self.prefetch_policy.plan(layer_idx, self.num_layers, self._blocks_of)
        if plan:
            store.prefetch(plan, protect=needed, dst=store.attention_tier)
        if layer.is_sliding and not layer.record_past:
            self._free_before(layer, max(end - layer.sliding_window + 1, 0) // bt)
        stall = store.take_stall()
        self.events.stall(stall)
        if self.trace is not None:
            self.trace.waited(stall)
        return keys, values

    def _free_before(self, layer: TieredLayer, first_block: int) -> None:
        for index in range(layer.first_block, first_block):
            self.store.delete(self._key(layer.layer_idx, index))
        layer.first_block = max(layer.first_block, first_block)

    def _drop_layer(self, layer_idx: int) -> None:
        layer = self.layers[layer_idx]
        if self.store is not None:
            self.store.unpin([k for k in self._pinned if k.layer == layer_idx])
            self._pinned = [k for k in self._pinned if k.layer != layer_idx]
            for key in self._blocks_of(layer_idx):
                self.store.delete(key)
        layer.num_tokens = 0
        layer.first_block = 0

    def _crop_layer(self, layer_idx: int, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        layer = self.layers[layer_idx]
        if tokens_to_remove == 0 or layer.num_tokens == 0:
            return
        bt = self.tier_config.block_tokens
        new_len = max(layer.num_tokens + tokens_to_remove, 0)
        if layer.is_sliding and new_len < layer.first_block * bt + (layer.sliding_window - 1) and layer.first_block:
            raise RuntimeError("crop: the sliding-window layer already dropped the tokens needed to roll back "
                               "(call activate_past_recording() first, as assisted generation does)")
        self.store.unpin(self._pinned)
        self._pinned = []
        for index in range((new_len + bt - 1) // bt, (layer.num_tokens + bt - 1) // bt):
            self.store.delete(self._key(layer_idx, index))
        layer.num_tokens = new_len

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute the batch rows of every block on every tier."""
        if self.store is not None:
            self.store.unpin(self._pinned)
            self._pinned = []
            self.store.reorder_rows(beam_idx)

    def reset(self) -> None:
        for i in range(self.num_layers):
            self._drop_layer(i)

    # ---- tiercache API ------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tier occupancy, moves, hits, misses, evictions, stall time and token counts."""
        if self.store is not None and not self.store.closed:
            return self.store.stats()
        cfg = self.tier_config
        tiers = {name: {"budget_bytes": budget, "used_bytes": 0, "blocks": 0, "capacity_blocks": 0} for name, budget in (
            ("device", cfg.device_budget), ("host", cfg.host_budget),
            ("disk", cfg.disk_budget if cfg.disk_enabled else 0))}
        snap = self.events.snapshot(getattr(self, "_last_tiers", tiers))
        return snap

    def close(self) -> None:
        """Wait for moves, stop the I/O workers and remove this cache's session files."""
        if self.closed:
            return
        self.closed = True
        if self.trace is not None:
            if self.store is not None:
                self._flush_trace()
            self.trace.close()
        if self.store is not None:
            self._last_tiers = self.store.tier_stats()
            self.store.close()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"TieredCache(layers={self.num_layers}, config={self.tier_config!r})"


def wrap(model: Any, config: Optional[TierConfig] = None) -> Any:
    """Make ``model.generate()`` use a TieredCache (one per call) unless a cache is passed.

    The cache of the latest call stays readable as ``model.tiercache_last``; its I/O workers
    stop when the call returns.
    """
    check_supported(model.config)
    cfg = config if config is not None else TierConfig()
    if getattr(model, "_tiercache_wrapped", False):
        model._tiercache_config = cfg
        return model
    original = model.generate

    def generate(*args, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return original(*args, **kwargs)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        cache = TieredCache(model, model._tiercache_config)
        model.tiercache_last = cache
        try:
            return original(*args, cache=cache, **kwargs)
        finally:
            cache.close()

    model._tiercache_config = cfg
    model._tiercache_wrapped = True
    model.generate = generate
    return model
