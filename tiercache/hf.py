"""The Hugging Face hook: ``TieredCache``, a ``transformers.Cache`` whose KV lives in a BlockStore.

Per layer and forward, ``update`` appends the new tokens into the layer's tail block in
place (new blocks are allocated on the device tier), makes every block that attention
reads resident on the device (waiting only for what is not there yet), returns K/V for
attention, and starts fetching the next layer's blocks (prefetch policy). The blocks of the
layer just returned stay pinned until the next ``update``, so nothing attention is reading
can be evicted under it.
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import logging
import numbers
import os
import shutil
import threading
import types
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from tiercache.config import AUTO, TierConfig, as_tier_config, format_bytes
from tiercache.disk import DiskTier, ensure_private_dir, in_forked_children, remove_stale_sessions
from tiercache.errors import CapacityError, TierCacheError, TierIOError, UnsupportedModelError
from tiercache.events import Events
from tiercache.guard import as_plan, is_plugin, plan_breach, plugin_answer
from tiercache.policies import make_eviction, make_prefetch
from tiercache.attention import PROBE_ATTR, SCORES_ATTR, _inner_name, tie_to_graph
from tiercache.store import BlockStore
from tiercache.streamread import MAX_LAYERS_AHEAD
from tiercache.table import BlockKey, Tier
from tiercache.tiers import BlockGeometry

if TYPE_CHECKING:
    from tiercache.lab.trace import TraceWriter
    from tiercache.prefix import PrefixCache

log = logging.getLogger("tiercache")

_SEQ_IDS = itertools.count(1)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def _uses_alibi(config: Any) -> bool:
    """Does the model position its tokens with ALiBi (Bloom, MPT, Falcon with ``alibi``)?"""
    return (getattr(config, "model_type", None) in ("bloom", "mpt") or getattr(config, "alibi", False) is True
            or getattr(config, "position_embedding_type", None) == "alibi"
            or getattr(getattr(config, "attn_config", None), "alibi", False) is True)


def _visible_start(num_tokens: int, window: Optional[int]) -> int:
    """First of ``num_tokens`` stored tokens that attention sees in the next update: 0 for a
    full layer, the window's start for a sliding one (``window``)."""
    return 0 if window is None else max(num_tokens - window + 1, 0)


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
        self.dropped = 0  # tokens dropped for good by a retention policy (stored = num_tokens - dropped)
        self.record_past = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True
        self.device = key_states.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def visible_start(self) -> int:
        """First token that attention sees before the next update (sliding: the window)."""
        return _visible_start(self.num_tokens, self.sliding_window if self.is_sliding else None)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Same sizes as DynamicLayer / DynamicSlidingWindowLayer, so masks match DynamicCache's.
        retention = self._cache.retention_state
        if retention is not None and retention.applies(self):
            # Compacted: the stored tokens, then the new ones at their absolute indices
            # (tiercache.retention explains why the offset makes the mask right).
            retention.settle(query_length, self._cache._prompt_coming())
            stored = self.num_tokens - self.dropped
            return stored + query_length, self.num_tokens - stored
        start = self.visible_start()
        return self.num_tokens - start + query_length, start

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def activate_past_recording(self, **kwargs: Any) -> None:  # 5.25 passes recurrent_states_to_keep
        self.record_past = True

    def reset(self) -> None:
        self._cache._drop_layer(self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        self._cache._crop_layer(self.layer_idx, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # done cache-wide
        pass

    def offload(self) -> None:  # transformers' per-layer offload, in tiers (TieredCache.offload)
        self._cache._offload_layer(self.layer_idx)

    def prefetch(self) -> None:
        self._cache._prefetch_layer(self.layer_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("TieredCache does not support batch_repeat_interleave "
                                  "(contrastive search); use greedy, sampling, beam or assisted generation")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("TieredCache does not support batch_select_indices")


MIN_TRANSFORMERS = "5.24"  # the first release whose generate() and models take ``cache=``


def check_transformers() -> None:
    """Raise ``TierCacheError`` when transformers is older than ``MIN_TRANSFORMERS``. Older
    5.x releases take the cache as ``past_key_values=`` only: ``generate(cache=...)`` is
    refused and a model's forward drops ``cache=`` silently, so decoding would run on a
    fresh cache each step and give wrong tokens without an error."""
    from packaging.version import Version

    import transformers

    found = transformers.__version__
    if Version(found) < Version(MIN_TRANSFORMERS):
        raise TierCacheError(f"tiercache needs transformers >= {MIN_TRANSFORMERS} (found {found}): older "
                             f"releases do not take the cache as cache=; pip install "
                             f"'transformers>={MIN_TRANSFORMERS},<5.26'")


def check_supported(config: Any) -> Any:
    """Return the decoder's text config, or raise UnsupportedModelError naming the reason
    (or ``TierCacheError`` for a transformers release too old, ``check_transformers``)."""
    check_transformers()
    if not callable(getattr(config, "get_text_config", None)):
        raise TypeError(f"expected a transformers model or its config (a PretrainedConfig), got "
                        f"{type(config).__name__}")
    arch = ", ".join(getattr(config, "architectures", None) or [getattr(config, "model_type", "?")])
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch}: encoder-decoder models are not supported (decoder-only causal LMs only)")
    text = config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None):
        raise UnsupportedModelError(f"{arch}: multi-latent attention (compressed KV) is not supported")
    shared = getattr(text, "num_kv_shared_layers", 0)
    if shared:
        raise UnsupportedModelError(f"{arch}: layers that reuse another layer's KV cache (num_kv_shared_layers="
                                    f"{shared}) are not supported")
    shapes = _kv_shapes_per_layer(text)
    if len(shapes) > 1:
        raise UnsupportedModelError(f"{arch}: layers of different KV shapes (head_dim, num_key_value_heads: "
                                    f"{', '.join(map(str, sorted(shapes, key=str)))}) are not supported; "
                                    f"tiercache's blocks have one shape for every layer")
    try:  # (a heterogeneous config raises for a per-layer field read globally: judged above)
        k_dim, v_dim = getattr(text, "head_dim", None), getattr(text, "v_head_dim", None)
    except AttributeError:
        k_dim = v_dim = None
    if isinstance(v_dim, int) and isinstance(k_dim, int) and v_dim != k_dim:
        # MiMo-V2-Flash: refused by name here, not at its first update ("differ in shape")
        raise UnsupportedModelError(f"{arch}: keys and values of different head dims (head_dim={k_dim}, "
                                    f"v_head_dim={v_dim}) are not supported; tiercache's blocks hold K and V "
                                    f"of one shape")
    if getattr(text, "model_type", None) == "mpt" or getattr(config, "model_type", None) == "mpt":
        # transformers' MPT, given a cache, feeds the whole sequence again at every decode step
        # (a DynamicCache passed in grows by the sequence a step, 40 + 5 tokens made it 210, and
        # the logits differ from generate() without one by 0.014; a sweep of the model types)
        raise UnsupportedModelError(f"{arch}: transformers' MPT feeds every token again at each decode step when a "
                                    f"cache is passed (DynamicCache too: the cache grows by the whole sequence a "
                                    f"step and the logits go wrong), so no cache passed to it can be exact")
    cross = getattr(text, "cross_attention_layers", None)
    if cross:  # Mllama: the image's K/V sit in those layers' cache, which a model reads directly
        raise UnsupportedModelError(f"{arch}: cross-attention layers (cross_attention_layers={list(cross)}) are not "
                                    f"supported; tiercache serves self-attention KV caches only")
    layer_types, _ = get_layer_types_and_kwargs(text)
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise UnsupportedModelError(f"{arch}: layer types {other} (linear-attention or hybrid layers) are not "
                                    f"supported; tiercache serves attention KV caches only")
    return text


_TAKES_CACHE: dict = {}  # model class -> whether it or a model inside it takes a KV cache


def check_takes_cache(model: Any) -> None:
    """Raise UnsupportedModelError for a transformers model none of whose models (itself, or
    one inside it: BLIP-2's language model) has a forward that takes a KV cache (RWKV keeps a
    recurrent state; GPT-1 caches nothing): a TieredCache given to it held nothing, with no
    error. Other modules (a PEFT wrapper passing ``**kwargs`` on) are not judged."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return
    takes = _TAKES_CACHE.get(type(model))
    if takes is None:
        def takes_cache(module: Any) -> bool:
            params = inspect.signature(module.forward).parameters
            return "cache" in params or "past_key_values" in params
        takes = _TAKES_CACHE[type(model)] = any(
            takes_cache(m) for m in model.modules() if isinstance(m, PreTrainedModel))
    if not takes:
        raise UnsupportedModelError(f"{type(model).__name__}: its forward takes no KV cache (no cache= or "
                                    f"past_key_values= parameter), so there is nothing for tiercache to hold")


def _same_device(named: torch.device, actual: torch.device) -> bool:
    """``named`` (from a config: "cuda" means the current device) is ``actual``."""
    def index(d: torch.device) -> int:
        if d.index is not None:
            return d.index
        return torch.cuda.current_device() if d.type == "cuda" else 0
    return named.type == actual.type and index(named) == index(actual)


def _kv_shapes_per_layer(text: Any) -> set:
    """The (head_dim, num_key_value_heads) of each layer, where the config says them per
    layer (transformers' heterogeneous configs, ``per_layer_config``: Gemma4's full-attention
    layers have their own ``global_head_dim``); empty where it does not."""
    try:
        per_layer = getattr(text, "per_layer_config", None)
        if not per_layer:
            return set()
        layers = [per_layer[i] for i in range(len(per_layer))]
    except (TypeError, KeyError, IndexError):  # a layout this release does not have
        return set()
    return {(getattr(layer, "head_dim", None), getattr(layer, "num_key_value_heads", None)) for layer in layers}


_ALL_SLIDING_SEEN: set = set()  # (model type, setting) warned of doing nothing (TieredCache)


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
        self.tier_config = as_tier_config(config)
        model_config = getattr(model, "config", model)
        text = check_supported(model_config)
        check_takes_cache(model)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        layers = [TieredLayer(self, i, kw.get("sliding_window") if t != "full_attention" else None)
                  for i, (t, kw) in enumerate(zip(layer_types, layer_kwargs))]
        super().__init__(layers=layers)
        self.num_layers = len(layers)
        self.events = Events(self.tier_config.eviction)
        auto = self.tier_config.prefetch == AUTO
        self._set_prefetch("next-layer" if auto else self.tier_config.prefetch, self.tier_config.prefetch_depth)
        if auto:  # nothing plans before the store opens, which resolves it (``_resolve_prefetch``)
            self.prefetch_name = AUTO
        self.seq_id = next(_SEQ_IDS)
        self._key_rows: list = [[] for _ in layers]  # per layer: BlockKey of block i at [i] (made once)
        # per layer: (pool K, first slot, slots, K, V, their geometry): views of the device pool
        # over the slots the layer's blocks were last read from in place (``_update_resident``)
        self._layer_views: list = [None] * len(layers)
        self.wants_scores = getattr(make_eviction(self.tier_config.eviction), "wants_scores", False)
        self.trace = self._open_trace(trace)
        self._step = -1
        self._step_tokens = 0
        self._pending_read: Optional[tuple] = None  # (keys, t_us) awaiting the attention hook's scores
        self._pending_scores: Optional[dict] = None
        self.selection_state, self.retention_state = self._make_selection_and_retention()
        if (self.selection_state is not None or self.retention_state is not None) and all(
                layer.is_sliding for layer in self.layers):  # accepted, then did nothing, silently (a review)
            asked = " and ".join(f"{name}={value!r}" for name, value, state in (
                ("selection", self.tier_config.selection, self.selection_state),
                ("retention", self.tier_config.retention, self.retention_state)) if state is not None)
            seen = (getattr(text, "model_type", None), asked)
            if seen not in _ALL_SLIDING_SEEN:  # once per model type and setting (wrap(): a cache per call)
                _ALL_SLIDING_SEEN.add(seen)
                log.warning("tiercache: every layer of this model slides (a window of %s tokens): selection and "
                            "retention apply to full-attention layers only, so %s does nothing here",
                            self.layers[0].sliding_window, asked)
        if (self.retention_state is not None or self.selection_state is not None) and _uses_alibi(text):
            # ALiBi biases attention by the distance between positions, in the float mask.
            # Retention's compaction changes those distances (Falcon sized its mask from the
            # absolute length: a torch shape error inside the model), and selection rebuilds
            # the mask of the pages it reads as booleans, dropping the bias: quest on Falcon
            # with ALiBi was off by 0.27 in the logits with every page read (a review)
            what = "retention" if self.retention_state is not None else "selection"
            raise UnsupportedModelError(f"{getattr(text, 'model_type', 'this model')}: its ALiBi attention biases "
                                        f"by the distance between positions, which {what} "
                                        f"{'changes by dropping tokens' if what == 'retention' else 'loses'}; use "
                                        f"{what} with a RoPE or learned-position model, or leave it off")
        # update() may take the resident fast path: no trace, scores, selection or retention
        self._plain = (self.trace is None and not self.wants_scores and self.selection_state is None
                       and self.retention_state is None)
        self._attn_config = text  # selection/retention need tiercache's attention hook on this config
        self._hook_seen = False  # the hook ran for this cache's keys (block attention relies on it)
        # selection and retention act inside the hook: its keys carry a probe until the hook is
        # seen; _probe_step: the step a probe was first handed out (``_check_hook``)
        self._needs_hook = self.selection_state is not None or self.retention_state is not None
        self._probe_step: Optional[int] = None
        self.in_place_steps = 0  # layer-steps of decode attention computed in place (attend_in_place)
        # (thread, last layer it updated): one forward pass at a time (``_claim``)
        self._forward: tuple = (None, -1)
        self._forward_lock = threading.Lock()
        if (self.wants_scores or self.trace is not None or self.selection_state is not None
                or self.retention_state is not None or self._wants_in_place(model)) \
                and hasattr(model, "config") and hasattr(model, "forward"):
            from tiercache.attention import install
            # Same outputs; adds per-block attention mass, selection, retention and (CPU, host
            # tier) decode attention over the blocks in place (tiercache.streaming).
            install(model)
        self.store: Optional[BlockStore] = None
        self._pinned: list = []
        # (blocks read, prefetch plan) the fast path asked the policy for this update, if any:
        # where it steps aside, the general path uses it (the policy hears each read once)
        self._asked: Optional[tuple] = None
        self._session_dir: Optional[str] = None
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._text_config = text
        self.prefix: Optional["PrefixCache"] = None
        # Retention compacts blocks, so their content no longer matches the token ids: no reuse.
        # Lossy retention rewrites blocks, so their tokens no longer name their content: no reuse.
        self._reuse = (self.tier_config.reuse_enabled and self._model is not None
                       and getattr(self.tier_config, "retention", None) is None) and self.retention_state is None
        if self._reuse and any(p.device.type == "meta" for p in self._model.parameters()):
            # offloaded by accelerate: weights the prefix cache cannot name (model_digest)
            if self.tier_config.reuse:
                raise UnsupportedModelError("reuse: the prefix cache cannot name weights on the meta device "
                                            "(offloaded by accelerate); set reuse=None or False")
            self._reuse = False
        rope = _length_dependent_rope(self._model, text)
        if self._reuse and rope is not None:
            # The rotary frequencies depend on the length each forward sees: a prefix computed
            # within a short prompt is not what a longer one computes (wrong tokens, a helper found).
            if self.tier_config.reuse:
                raise UnsupportedModelError(f"reuse: the prefix cache is not exact for rope_type {rope!r}, whose "
                                            f"positions depend on the sequence length; set reuse=None or False")
            self._reuse = False
        self._token_ids: Optional[list] = []  # ids of the sequence so far (None: not batch 1)
        self._chain: list = []  # ChainBlock of each full block of _token_ids
        # tokens from here on were computed with pages left out of attention (quest): their
        # KV above the layer it happened at is not exact, and never goes to the prefix cache
        self._exact_tokens: float = float("inf")
        # ids that load_prefix() loaded, until generate()'s prefill checks its prompt starts
        # with them (_prefill_hook), and the hold on the model's hooks that check needs
        self._loaded_ids: Optional[list] = None
        self._loaded_hold: Optional[weakref.finalize] = None
        self._admitted: dict = {}  # chained hash -> admission decision
        self._injecting = False
        self._grad_forward = False  # an update with autograd on is running (update)
        self._generation_mode: Optional[str] = None  # set by wrap()'s hooks (_prepare_cache_hook)
        self._prefill_seen = False  # wrap()'s hooks: the first prefill came (_prefill_hook)
        self._prompt_pending = 0  # prompt tokens generate() is about to compute (_prefill_hook)
        self._prompt_known = False  # the hook told the prompt's length for this generate() call
        self._prompt_forward = False  # this forward computes prompt tokens (update, at layer 0)
        self._hook = None
        if self._model is not None:  # the hook holds the cache weakly: an unclosed cache can still be collected
            ref = weakref.ref(self)

            def observe(module: Any, args: tuple, kwargs: Optional[dict] = None) -> None:
                cache = ref()
                if cache is None:
                    return
                if kwargs is not None and kwargs.get("use_cache") is False and any(
                        kwargs.get(name) is cache for name in ("cache", "past_key_values")):
                    raise ValueError(_NO_USE_CACHE)
                if not cache._reuse:
                    return
                if kwargs is None:
                    # torch may call a hook without its kwargs while other threads register
                    # hooks on the same model: the tokens of this forward are unknown, so
                    # this cache publishes nothing more (a block named by wrong ids never).
                    cache._token_ids = None
                    return
                cache._observe_inputs(module, args, kwargs)
            self._hook = _runs_forward(self._model).register_forward_pre_hook(observe, with_kwargs=True)
            weakref.finalize(self, self._hook.remove)  # a cache dropped unclosed leaves no hook behind
        self.closed = False

    def _set_prefetch(self, name: str, depth: int) -> None:
        self.prefetch_name = name  # the policy in use; "auto" until ``_open_store`` resolves it
        self.prefetch_policy = make_prefetch(name, **({"depth": depth} if name == "lookahead" else {}))
        self._prefetch_plugin = is_plugin(self.prefetch_policy)  # its plans are checked (``_plan_ahead``)

    def _resolve_prefetch(self, store: BlockStore) -> None:
        """``prefetch="auto"``: ``lookahead``, ``prefetch_depth`` layers but no more than
        ``MAX_LAYERS_AHEAD``, where this cache's reads stream disk blocks into attention's
        buffers, a layer read ahead into a buffer of its own (a CPU store with host and disk
        tiers, reading every block: no selection or retention, whose reads go through the
        host tier, where a deeper plan only moves more blocks); ``next-layer`` elsewhere."""
        streams = store.streams_disk_reads and self.selection_state is None and self.retention_state is None
        if streams:
            self._set_prefetch("lookahead", min(self.tier_config.prefetch_depth, MAX_LAYERS_AHEAD))
        else:
            self._set_prefetch("next-layer", self.tier_config.prefetch_depth)

    # ---- the store ----------------------------------------------------------------------
    def _open_store(self, key_states: torch.Tensor) -> BlockStore:
        cfg = self.tier_config
        batch, kv_heads, _, head_dim = key_states.shape
        geometry = BlockGeometry(batch, kv_heads, cfg.block_tokens, head_dim, key_states.dtype)
        disk_dir = None
        if cfg.disk_enabled:
            ensure_private_dir(cfg.disk_dir, cfg.shared_dir)
            sessions = os.path.join(cfg.disk_dir, "sessions")
            ensure_private_dir(sessions, cfg.shared_dir)
            stale = remove_stale_sessions(sessions)
            if stale:
                log.info("tiercache: removed %d session folders of processes that are gone from %s",
                         len(stale), sessions)
            disk_dir = os.path.join(sessions, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._session_dir = disk_dir
        device = key_states.device
        if cfg.device is not None and not _same_device(torch.device(cfg.device), device):
            raise ValueError(f"device: the TierConfig says {cfg.device!r} but the model computes on {device}; the "
                             f"device tier is where attention reads, so leave device=None (the model's) or name that")
        try:
            store = BlockStore(cfg, geometry, device=device, disk_dir=disk_dir, persistent=False, events=self.events)
        except BaseException:  # its session folder (its own, by name) goes with it, not at a later sweep
            if disk_dir is not None:
                shutil.rmtree(disk_dir, ignore_errors=True)
            raise
        store.defer_stall = True
        if cfg.prefetch == AUTO:
            self._resolve_prefetch(store)
        self._layer_views = [None] * self.num_layers  # views of an older store's pool would keep it alive
        g = self.prefix.geometry if self.prefix is not None else None
        if g is not None and (g.kv_heads, g.head_dim, g.dtype) != (kv_heads, head_dim, key_states.dtype):
            # opened by load_prefix with the shape the config names (CPM-Ant names its head
            # size dim_head): every publish would fail ("block shape ... != ...")
            log.warning("prefix cache off for this run: the model's K/V are %d heads x %d dims of %s, not the "
                        "%d x %d of %s that its config names", kv_heads, head_dim, key_states.dtype, g.kv_heads,
                        g.head_dim, g.dtype)
            self.prefix, self._reuse = None, False
        if self._reuse and self.prefix is None:
            self.prefix = self._open_prefix(geometry)
        return store

    # ---- the prefix cache -------------------------------------------------------------------
    def _observe_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: note the token ids fed with this cache (they name its blocks)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not self or self._token_ids is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.dim() != 2 or ids.shape[0] != 1:
            self._token_ids = None  # batches, beams and embeddings are not published
            return
        if _other_inputs(kwargs):
            # images, embeddings, token types: KV that the ids alone do not name (a VLM's
            # image placeholders were published, then loaded without the image: a traceback)
            self._token_ids = None
            return
        mask = kwargs.get("attention_mask")
        if mask is not None and not (mask.dim() == 2 and bool(mask.all())):
            # A mask hiding some tokens (left padding of one row) shifts the positions of
            # the rest: their KV is not what these ids name. Was published, then loaded by
            # a call with the same ids and another mask (wrong tokens).
            self._token_ids = None
            return
        positions = kwargs.get("position_ids")
        if positions is not None and not _usual_positions(positions, ids.shape[1], len(self._token_ids)):
            self._token_ids = None  # KV named by the ids alone holds only at the usual positions
            return
        self._token_ids.extend(ids[0].tolist())

    def _kv_shape(self) -> tuple:
        """(KV heads, head dim) as the config names them."""
        text = self._text_config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads

    def _geometry_of_model(self) -> tuple:
        param = next(self._model.parameters())
        return *self._kv_shape(), param.dtype, param.device

    def _open_prefix(self, geometry: BlockGeometry) -> Optional["PrefixCache"]:
        from tiercache.errors import CacheDirError
        from tiercache.prefix import model_digest, open_prefix_cache

        if geometry.batch != 1:
            return None
        if not self.tier_config.reuse and self.tier_config.disk_budget < DiskTier.record_size(geometry):
            # not one block fits: the store's open refuses the budget, with the one message
            # (a warning that the prefix cache is off, with advice for the Python API, came
            # first, a review)
            self._reuse = False
            return None
        try:
            digest = model_digest(self._model, geometry.dtype)  # kept per model while its weights stay
            prefix = open_prefix_cache(self.tier_config.disk_dir, self.tier_config, geometry, digest,
                                       self.num_layers)
            for failure in prefix.store.policy_failures():  # raised once, to the cache it failed under
                log.warning("tiercache: still so: %s", failure)
            return prefix
        except (CacheDirError, UnsupportedModelError) as exc:
            if self.tier_config.reuse:
                raise
            log.warning("prefix cache off for this run: %s", exc)
            self._reuse = False
            return None

    def _ensure_prefix(self) -> Optional["PrefixCache"]:
        # tiercache.prefix.close_all() under this cache, or a child made by fork() since: the
        # process's prefix cache now, opened again (with this cache's settings; in a child,
        # refused while the parent holds the directory, as for any second process)
        if self.prefix is not None and (self.prefix.closed or self.prefix.forked):
            self.prefix = None
        if self.prefix is None and self._reuse:
            kv_heads, head_dim, dtype, _ = self._geometry_of_model()
            self.prefix = self._open_prefix(BlockGeometry(1, kv_heads, self.tier_config.block_tokens, head_dim, dtype))
        return self.prefix

    def load_prefix(self, input_ids: torch.Tensor, prefill_chunk: Optional[int] = None) -> int:
        """Fill this empty cache with the longest cached prefix of ``input_ids`` (whole blocks,
        always leaving the last prompt token to compute); returns the tokens loaded.

        ``generate()`` then computes only the rest of the prompt (it slices ``input_ids`` by
        ``get_seq_length()``), in chunks of ``prefill_chunk`` if it is given that
        ``prefill_chunk_size``: pass the same here, and no more is loaded than keeps those
        chunks within the device budget. ``wrap()`` and ``tiercache generate`` call this for you.
        """
        # a list was an AttributeError from inside, a 1-D tensor a silent miss (a review)
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"load_prefix: input_ids must be a torch.Tensor of token ids shaped [1, N] (as generate() "
                            f"takes them), got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"load_prefix: input_ids must be shaped [1, N] (as generate() takes them), got "
                             f"{tuple(input_ids.shape)}; for one sequence of ids, pass ids[None]")
        if self.closed:  # before anything opens: a store opened here was never closed (a review)
            raise RuntimeError(_CLOSED)
        if not self._reuse or input_ids.shape[0] != 1 or any(layer.num_tokens for layer in self.layers):
            return 0
        prefix = self._ensure_prefix()
        if prefix is None:
            return 0
        ids = input_ids[0].tolist()
        try:
            blocks = prefix.match(ids[:len(ids) - 1])
        except Exception as exc:  # noqa: BLE001 - sorted by _prefix_error
            self._prefix_error(prefix, exc)
            return 0
        usable, kv = 0, []
        if blocks:
            kv_heads, head_dim, dtype, device = self._geometry_of_model()
            # One update per layer writes the whole prefix: all of it resident on the device at
            # once, sliding layers too. More than the device holds failed there (CapacityError)
            # where the same prompt, computed in chunks, fits: load what fits, compute the rest.
            block_bytes = BlockGeometry(1, kv_heads, self.tier_config.block_tokens, head_dim, dtype).block_bytes
            blocks = blocks[:self._loadable_blocks(len(blocks), len(ids), prefill_chunk, block_bytes)]
        if blocks:
            opening = None
            if self.store is None:  # the cache's own store is built (pools allocated) while the reads run
                from concurrent.futures import ThreadPoolExecutor

                template = torch.empty(1, kv_heads, 0, head_dim, dtype=dtype, device=device)
                pool = ThreadPoolExecutor(1, thread_name_prefix="tiercache-open")
                opening = pool.submit(self._open_store_for, template, len(blocks) * self.num_layers)
                pool.shutdown(wait=False)
            try:
                usable, kv = prefix.load(blocks, self.events)  # kv[layer]: [2, 1, H, usable*bt, D]
            except Exception as exc:  # noqa: BLE001 - sorted by _prefix_error
                self._prefix_error(prefix, exc)
                usable, kv = 0, []
            finally:
                if opening is not None:
                    self.store = opening.result()
        self._token_ids = []
        if not usable:
            return 0
        bt = self.tier_config.block_tokens
        _, _, _, device = self._geometry_of_model()
        self._injecting = True
        try:
            with torch.no_grad():
                for layer_idx in range(self.num_layers):
                    layer_kv = kv[layer_idx].to(device)
                    kv[layer_idx] = None
                    if self.store is None:
                        self.store = self._open_store(layer_kv[0])
                    # The loaded blocks have their copy in the prefix cache: no write-behind
                    # (a block is written down only if it is ever evicted).
                    self.store.write_behind_enabled = False
                    self.update(layer_kv[0], layer_kv[1], layer_idx)
        finally:
            self._injecting = False
            if self.store is not None:
                self.store.write_behind_enabled = True
        self._token_ids = ids[:usable * bt]
        self._chain = list(blocks[:usable])
        self._expect_prompt(ids[:usable * bt])
        self.events.reused(tokens=usable * bt)
        return usable * bt

    def _expect_prompt(self, ids: list) -> None:
        """The next ``generate()`` on this cache must be given a prompt that starts with
        ``ids`` and goes on past them: generate() computes only what follows the cache's
        length, so another prompt got the KV of these ids (wrong tokens, silently) and a
        shorter one a reshape error from inside the model. Its ``_prefill`` step checks it
        (``_check_loaded_prompt``): the hooks stay on the model until then."""
        self._loaded_ids = ids
        if self._loaded_hold is None and self._model is not None:
            _hold_hooks(self._model)
            # a cache dropped unclosed lets go too, at its collection: then only noted (the
            # collection may run on a thread inside _hold_hooks, under its re-entrant lock)
            self._loaded_hold = weakref.finalize(self, _PENDING_RELEASES.append, weakref.ref(self._model))

    def _prompt_checked(self) -> None:
        self._loaded_ids = None
        hold, self._loaded_hold = self._loaded_hold, None
        if hold is not None and hold.detach() is not None:  # once: the hooks go if nothing else holds them
            _release_hooks(self._model)

    def _attended_in_part(self, layer_idx: int, query_length: int) -> None:
        """Quest left pages out of this forward's attention at ``layer_idx``: the KV of its
        tokens above that layer, and of every later token, is not what full attention
        computes, so none of it is published to the prefix cache (``_publish``)."""
        first = self.layers[layer_idx].num_tokens - query_length
        self._exact_tokens = min(self._exact_tokens, first)

    def _prompt_coming(self) -> Optional[bool]:
        """Before a forward's layer-0 update (its mask's sizes): whether it computes prompt
        tokens, where generate() told the prompt's length (``_prefill_hook``); else None."""
        return self._prompt_pending > 0 if self._prompt_known else None

    def _check_loaded_prompt(self, input_ids: Any, model_kwargs: Optional[dict] = None,
                             generation_config: Any = None) -> None:
        """generate()'s prefill on this cache, after ``load_prefix``: its prompt must start
        with the loaded ids and have at least one token more. Two forms transformers takes
        for a cache that holds a past pass as they are: only the new ids with an attention
        mask over the whole sequence (the mask's extra length must be what was loaded), and
        ``inputs_embeds`` of the whole prompt (longer than what was loaded; embeddings
        cannot be compared with ids, so they are the caller's word)."""
        loaded = self._loaded_ids
        if loaded is None:
            return
        n = len(loaded)
        model_kwargs = model_kwargs or {}
        what = "this TieredCache holds the first {n} tokens of a prompt, loaded by load_prefix(), but generate() "
        advice = "pass generate() the same input_ids as load_prefix(), or reset() the cache first"
        embeds = model_kwargs.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 and not (
                isinstance(input_ids, torch.Tensor) and input_ids.numel()):
            if embeds.shape[1] <= n:
                raise ValueError(what.format(n=n) + f"was given inputs_embeds of {embeds.shape[1]} tokens; it needs "
                                 f"the whole prompt (more than the {n} loaded): {advice}")
            self._prompt_checked()
            return
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] == 1):
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(what.format(n=n) + f"was given input_ids of shape {shape}; {advice} (one row)")
        total = _sequence_length(model_kwargs, generation_config)
        if total > input_ids.shape[1]:
            past = total - input_ids.shape[1]  # the ids are what follows a past of this length
            if past != n:
                raise ValueError(what.format(n=n) + f"was given {input_ids.shape[1]} input_ids under an attention "
                                 f"mask of {total}, that is after a past of {past} tokens, not {n}: {advice}")
            self._prompt_checked()
            return
        if input_ids.shape[1] <= n:
            raise ValueError(what.format(n=n) + f"was given input_ids of {input_ids.shape[1]} tokens; it needs the "
                             f"whole prompt (more than the {n} loaded): {advice}")
        head = input_ids[0, :n].tolist()
        if head != loaded:
            at = next(i for i, (a, b) in enumerate(zip(head, loaded)) if a != b)
            raise ValueError(what.format(n=n) + f"was given input_ids that differ from them at token {at} "
                             f"({head[at]} != {loaded[at]}): the loaded KV is not theirs; {advice}")
        self._prompt_checked()

    def _open_store_for(self, template: torch.Tensor, num_blocks: int) -> BlockStore:
        """Open this cache's store with the first ``num_blocks`` device slots paged in (the
        prefix load fills them next; on CPU each page would otherwise fault in then)."""
        store = self._open_store(template)
        store.device_pool.prefault(num_blocks)
        return store

    def _publish(self, key: BlockKey, slot: int) -> None:
        """A block of ``key.layer`` just filled up: store it in the prefix cache by content."""
        ids, bt = self._token_ids, self.tier_config.block_tokens
        if self.prefix is None or ids is None or len(ids) < (key.index + 1) * bt:
            return
        if self.prefix.closed or self.prefix.forked:  # close_all() under this cache (it failed here: "the
            # store is closed"), or a child made by fork() since
            self._ensure_prefix()
            if self.prefix is None:
                return
        from tiercache.prefix import extend

        while len(self._chain) <= key.index:
            nxt = len(self._chain)
            self._chain.append(extend(self._chain[-1] if self._chain else None, ids[nxt * bt:(nxt + 1) * bt],
                                      self.prefix.salt))
        block = self._chain[key.index]
        if (key.index + 1) * bt > self._exact_tokens:
            # A token of it was computed with pages left out of attention at a layer below this
            # one (quest, at decode): the prefix cache serves exact KV, and a later exact run
            # loaded these (logits 5.4 off; a review). Its layers stored so far go too.
            if key.layer:
                self.prefix.drop_unfinished([block], owner=self)
            return
        admitted = self._admitted.get(block.h)
        if admitted is None:
            admitted = self._admitted[block.h] = self.prefix.admit(block)
        if admitted:
            kv = torch.empty(self.store.geometry.shape, dtype=self.store.geometry.dtype)
            self.store.device_pool.read_block(slot, kv)
            prefix = self.prefix
            try:
                if prefix.publish(block, key.layer, kv, owner=self):
                    self.events.reused(published=1)
            except (TierIOError, CapacityError) as exc:
                self._prefix_failed(exc)
            except RuntimeError:
                if not prefix.closed:
                    raise  # closed under this publish by close_all(): this block goes unpublished

    def _prefix_error(self, prefix: "PrefixCache", exc: Exception, failures: tuple = (TierIOError,)) -> None:
        """What a call into ``prefix`` raised: nothing to do if ``close_all()`` on another
        thread closed it under the call (its index, store or remote tier: a miss, or a flush
        close_all did), its storage failing (``failures``) goes to ``_prefix_failed``, and
        anything else is raised again."""
        if prefix.closed:
            return
        if not isinstance(exc, failures):
            raise exc
        self._prefix_failed(exc)

    def _prefix_failed(self, exc: Exception) -> None:
        """The prefix cache's storage failed (a full disk, its index made read-only): with
        ``reuse=True`` that is the caller's error; with ``reuse=None`` (on because a disk
        tier is), a warning and this run goes on without it, as when it cannot open. The
        generation's own KV is not in the prefix cache: nothing of it is lost."""
        if self.tier_config.reuse:
            raise exc
        log.warning("prefix cache off for the rest of this run: %s", exc)
        self.prefix = None
        self._reuse = False

    # ---- traces and attention scores -----------------------------------------------------
    @staticmethod
    def _open_trace(trace: Union[str, "TraceWriter", None]) -> Optional["TraceWriter"]:
        if trace is None:
            return None
        if not isinstance(trace, (str, os.PathLike)):  # trace=123 failed mid-generate() (a review)
            if not all(callable(getattr(trace, name, None)) for name in ("record", "now_us", "waited", "close")):
                raise TypeError(f"trace: expected a file path or a tiercache.lab.trace.TraceWriter, got "
                                f"{type(trace).__name__}")
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
        row = self._key_rows[layer_idx]
        if index >= len(row):
            self._grow_keys(layer_idx, index + 1)
        return row[index]

    def _keys(self, layer_idx: int, lo: int, hi: int) -> list:
        """The keys of blocks ``lo .. hi-1`` of the layer (a fresh list)."""
        row = self._key_rows[layer_idx]
        if hi > len(row):
            self._grow_keys(layer_idx, hi)
        return row[lo:hi]

    def _grow_keys(self, layer_idx: int, n: int) -> None:
        row, seq = self._key_rows[layer_idx], self.seq_id
        row.extend(BlockKey(seq, layer_idx, i) for i in range(len(row), n))

    def _blocks_of(self, layer_idx: int) -> list:
        return self._keys(layer_idx, *self._block_range(layer_idx))

    def _read_blocks_of(self, layer_idx: int) -> list:
        """The blocks the layer's attention reads, as ``update`` names them: from the first
        visible one on. A sliding layer that records its past (assisted generation) stores
        more than its window, and a prefetch plan of all it stores brought up, and read from
        disk at every step, blocks no step reads (a review: 399 disk reads where 168 did).
        A layer the model does not have is an IndexError (a negative one named a layer from
        the end)."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"blocks_of_layer({layer_idx}): the model has layers 0 .. {self.num_layers - 1}")
        first, end = self._block_range(layer_idx)
        bt = self.tier_config.block_tokens
        return self._keys(layer_idx, max(first, self.layers[layer_idx].visible_start() // bt), end)

    def _block_range(self, layer_idx: int) -> tuple:
        """(first, end) indices of the blocks the layer stores."""
        layer = self.layers[layer_idx]
        bt = self.tier_config.block_tokens
        return layer.first_block, (layer.num_tokens - layer.dropped + bt - 1) // bt

    def min_device_budget(self, prompt_tokens: int, new_tokens: int = 0, prefill_chunk: Optional[int] = None,
                          loaded: int = 0) -> int:
        """The smallest ``device_budget`` (bytes) that lets one row of ``prompt_tokens``,
        of which the first ``loaded`` came from the prefix cache (``load_prefix``: one update
        per layer), the rest prefilled in chunks of ``prefill_chunk`` (None: at once), then
        ``new_tokens`` decode steps run on this cache: attention needs each layer's visible
        blocks resident, in every forward (``_check_capacity``). 0 where no such bound holds
        (selection or retention on, which read or keep fewer blocks). Over chunked prefill
        the need grows with every chunk, so a budget that the first chunks fit fails later:
        ``tiercache generate`` checks this before the prefill."""
        # "10" was a bare TypeError from inside, 0 a range() error, negatives an answer
        prompt_tokens = _count_arg("min_device_budget", "prompt_tokens", prompt_tokens, 1)
        new_tokens = _count_arg("min_device_budget", "new_tokens", new_tokens, 0)
        loaded = _count_arg("min_device_budget", "loaded", loaded, 0)
        if prefill_chunk is not None:
            prefill_chunk = _count_arg("min_device_budget", "prefill_chunk", prefill_chunk, 1)
        if loaded >= prompt_tokens:
            raise ValueError(f"min_device_budget: loaded={loaded} must be less than prompt_tokens={prompt_tokens} "
                             f"(load_prefix always leaves the last prompt token to compute)")
        widest = self._widest_blocks(prompt_tokens, new_tokens, prefill_chunk, loaded)
        if widest is None:
            return 0
        if self._model is not None:
            kv_heads, head_dim, dtype, _ = self._geometry_of_model()
        else:  # built from a config: the K/V dtype is the store's, once open, else the config's
            g = self.store.geometry if self.store is not None else None
            kv_heads, head_dim, dtype = (g.kv_heads, g.head_dim, g.dtype) if g is not None else self._config_kv()
        return widest * BlockGeometry(1, kv_heads, self.tier_config.block_tokens, head_dim, dtype).block_bytes

    def _config_kv(self) -> tuple:
        """(KV heads, head dim, dtype) from the config alone (a cache built from a config,
        before its first forward). The dtype the config names, else torch's default dtype,
        which is what a model built from such a config computes in."""
        text = self._text_config
        dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.get_default_dtype()
        return *self._kv_shape(), dtype

    def min_capacity_blocks(self, prompt_tokens: int, new_tokens: int = 0) -> int:
        """The fewest distinct blocks a run of one row of ``prompt_tokens`` plus
        ``new_tokens`` decode steps holds at its end, over all layers: every stored token of
        a full layer, a sliding layer's window (0 where a retention policy drops tokens).
        Over every tier's slots, the run fails part way with ``CapacityError``; ``tiercache
        generate`` compares it with ``capacity_blocks`` before the prefill (a review: a run
        streamed half an answer, then failed naming what that step needed)."""
        prompt_tokens = _count_arg("min_capacity_blocks", "prompt_tokens", prompt_tokens, 1)
        new_tokens = _count_arg("min_capacity_blocks", "new_tokens", new_tokens, 0)
        if self.retention_state is not None:
            return 0
        bt = self.tier_config.block_tokens
        total = prompt_tokens + max(new_tokens - 1, 0)  # the last new token is never fed back
        windows = [layer.sliding_window if layer.is_sliding else None for layer in self.layers]

        def held(stored: int, after: int) -> int:  # blocks of every layer at a step (``_check_capacity``)
            return sum((after + bt - 1) // bt - _visible_start(stored, w) // bt for w in windows)
        # The decode steps: full layers grow to the last; a sliding layer's window spans one
        # block more where it straddles a block edge, which recurs every block past the
        # window, so the last window + 2 blocks of steps hold the widest. (Not the prefill:
        # run in chunks it holds fewer, and a failure there comes before any answer.)
        span = max([w for w in windows if w is not None], default=0) + 2 * bt
        steps = range(max(prompt_tokens, total - span), total)
        return max((held(s, s + 1) for s in steps), default=held(prompt_tokens - 1, prompt_tokens))

    def capacity_blocks(self) -> int:
        """Distinct blocks of one row the tiers hold together (each tier in its own unit:
        device blocks, host slots, disk records), before the store opens too."""
        if self.store is not None and self.store.geometry.batch == 1:
            return self.store.capacity_blocks()

        kv_heads, head_dim, dtype, _ = self._geometry_of_model()
        g = BlockGeometry(1, kv_heads, self.tier_config.block_tokens, head_dim, dtype)
        cfg = self.tier_config
        return (cfg.device_budget // g.block_bytes + (cfg.host_budget // g.padded_bytes if cfg.host_enabled else 0)
                + (cfg.disk_budget // DiskTier.record_size(g) if cfg.disk_enabled else 0))

    def _widest_blocks(self, prompt_tokens: int, new_tokens: int, prefill_chunk: Optional[int],
                       loaded: int) -> Optional[int]:
        """``min_device_budget`` in blocks (None: no bound)."""
        if self.selection_state is not None or self.retention_state is not None:
            return None
        bt = self.tier_config.block_tokens
        chunk = prefill_chunk or prompt_tokens
        ends = [loaded] if loaded else []
        ends += list(range(loaded + chunk, prompt_tokens, chunk)) + [prompt_tokens]
        forwards = list(zip([0] + ends[:-1], ends))  # (tokens stored before, after)
        total = prompt_tokens + max(new_tokens - 1, 0)  # the first new token comes with the prefill
        widest = 0
        for window in {layer.sliding_window if layer.is_sliding else None for layer in self.layers}:
            steps = forwards
            if window is None:  # a full layer: the last step is its widest
                steps = forwards + ([(total - 1, total)] if total > prompt_tokens else [])
            else:  # a sliding one: where the window meets block edges; periodic past the window
                last = min(total, prompt_tokens + window + 2 * bt)
                steps = forwards + [(s, s + 1) for s in range(prompt_tokens, last)]
            for stored, after in steps:
                first = _visible_start(stored, window) // bt
                widest = max(widest, (after + bt - 1) // bt - first)
        return widest

    def _loadable_blocks(self, matched: int, prompt_tokens: int, prefill_chunk: Optional[int], block_bytes: int) -> int:
        """How many of ``matched`` cached blocks to load so that the prefill of the rest stays
        within the device budget: at most what the device holds (the load writes them in one
        update per layer), and no more than keeps the chunks after them within it. Loading
        moves where the chunks fall, and with a sliding window a chunk can then need a block
        more than the same prompt computed from its start (a warm run failed at the cold
        run's minimum: a review's sweep). 0 when no load fits."""
        bt = self.tier_config.block_tokens
        slots = self.tier_config.device_budget // block_bytes
        usable = min(matched, slots)
        sliding = any(layer.is_sliding for layer in self.layers)
        if not all(layer.is_sliding for layer in self.layers) and -(-prompt_tokens // bt) > slots:
            return 0  # a full layer holds the whole prompt at its last chunk, loaded or not: it cannot fit
        while usable > 0:
            widest = self._widest_blocks(prompt_tokens, 0, prefill_chunk, usable * bt)
            if widest is None or widest <= slots:
                return usable
            if not sliding:  # the need does not depend on the load: the prompt does not fit at all
                return 0
            usable -= 1
        return 0

    def _check_capacity(self, query_length: int) -> None:
        """Before the first layer of a forward writes anything: will every layer fit?"""
        store, bt = self.store, self.tier_config.block_tokens
        new_blocks, widest = 0, 0
        for layer in self.layers:
            stored = layer.num_tokens - layer.dropped
            after = stored + query_length
            new_blocks += (after + bt - 1) // bt - (stored + bt - 1) // bt
            first = layer.visible_start() // bt
            widest = max(widest, (after + bt - 1) // bt - first)
        g = store.geometry
        if widest > store.num_slots(store.tiers[0]):
            raise CapacityError(
                f"device_budget={format_bytes(self.tier_config.device_budget)} holds "
                f"{store.num_slots(store.tiers[0])} blocks of {format_bytes(g.block_bytes)}, but attention "
                f"needs one whole layer resident: {widest} blocks; minimum device_budget = "
                f"{widest * g.block_bytes} bytes ({format_bytes(widest * g.block_bytes)}) for this step, one block "
                f"more per {bt} tokens after it (TieredCache.min_device_budget(prompt_tokens, new_tokens) gives a "
                f"whole run's)")
        if not new_blocks:  # every live block has a slot already (len(store) walks the table)
            return
        live = len(store)
        if live + new_blocks > store.capacity_blocks():
            needed = (live + new_blocks) * g.block_bytes
            cfg = self.tier_config
            raise CapacityError(
                f"the KV cache needs {live + new_blocks} blocks ({format_bytes(needed)}) but the tiers hold "
                f"{store.capacity_blocks()} (device_budget={format_bytes(cfg.device_budget)}, "
                f"host_budget={format_bytes(cfg.host_budget)}, "
                f"{store.disk_budget_text() if store.disk is not None else 'disk_budget=0 (no disk_dir)'}); "
                f"nothing was written")

    # ---- transformers.Cache API -------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            if torch.is_grad_enabled():
                # A forward with autograd on (outside no_grad): the blocks take the bytes,
                # never the graph (written as they were, every forward's graph stayed alive
                # in the pools: memory grew with every call), and attention gets copies (a
                # view of the pools, saved for backward, was overwritten by later forwards
                # and kept a closed store's pool alive) tied to this forward's K/V, so that
                # a backward pass that needs their gradient stops with an error saying why.
                self._grad_forward = True
                try:
                    keys, values = self._update(key_states.detach(), value_states.detach(), layer_idx)
                finally:
                    self._grad_forward = False
                return tie_to_graph(keys, key_states), tie_to_graph(values, value_states)
            return self._update(key_states, value_states, layer_idx)
        except Exception as exc:
            if self.closed:  # closed by another thread under this update: its pools are gone
                raise RuntimeError(_CLOSED) from exc
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, q, D]
        if self.closed:
            raise RuntimeError(_CLOSED)
        if not 0 <= layer_idx < self.num_layers:  # before the forward is claimed: nothing changes
            if layer_idx >= self.num_layers:
                raise ValueError(f"TieredCache: layer {layer_idx} of a model with more layers than the "
                                 f"{self.num_layers} this cache was built for; build the cache with the model that "
                                 f"uses it")
            raise ValueError(f"TieredCache.update: layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        store = self.store
        if store is not None and not self.layers[layer_idx].is_initialized and (
                key_states.device != store.device and not _same_device(store.device, key_states.device)):
            # A model split over devices (device_map): the blocks would be copied across into
            # the first layer's device pool, and attention on this one fail deep inside (a review)
            raise ValueError(f"TieredCache: layer {layer_idx} computes on {key_states.device}, but the cache's device "
                             f"tier is on {store.device}, where the first layer computed; a model split over devices "
                             f"(device_map) is not supported: put the whole model on one device")
        me = _thread_token()
        if layer_idx and self._forward[0] is me:  # on with this thread's forward pass
            self._forward = (me, layer_idx)
        else:  # a forward pass starts (under the lock: two threads may start at once)
            self._claim(me, layer_idx)
        if self.store is None:
            _check_kv(key_states, value_states)
            self.store = self._open_store(key_states)
        else:
            g, shape = self.store.geometry, key_states.shape
            if shape[0] != g.batch or key_states.dtype != g.dtype or shape[1] != g.kv_heads or shape[3] != g.head_dim:
                _check_kv(key_states, value_states)
                self._reopen_for(key_states, layer_idx)
        store, bt = self.store, self.tier_config.block_tokens
        layer = self.layers[layer_idx]
        layer.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._flush_trace()
        if layer_idx == 0:
            try:
                self._check_capacity(q)
            except CapacityError:  # nothing was written: the forward pass did not start
                self._forward = (None, -1)
                raise
            if not self._injecting:  # tokens loaded from the prefix cache are not computed
                # Where generate() told the prompt's length (_prefill_hook: wrap(), the CLI),
                # its tokens are prefill however they are fed (the last one after a loaded
                # prefix, chunks of one token), and every token after them is decode: a
                # verification forward of assisted generation or prompt lookup (its drafted
                # tokens included) counted as prefill (two reviews). Else a forward of more
                # than one token is prefill, one token decode.
                if self._prompt_known:
                    prefill = min(q, self._prompt_pending)
                    self._prompt_pending -= prefill
                else:
                    prefill = q if q > 1 else 0
                self.events.tokens(prefill=prefill, decode=q - prefill)
                self._prompt_forward = prefill > 0  # quest reads every page for it (_selects)
            self._step += 1
            self._step_tokens = q
        store.note_compute()
        store.unpin(self._pinned)  # attention of the previous layer is done
        store.release_views()
        self._pinned = []
        self._asked = None
        if self._plain and not self._injecting:
            out = self._update_resident(layer, key_states, value_states, q)
            if out is not None:
                return out
        if self._needs_hook and not self._hook_seen and layer_idx == 0:
            self._check_hook()
        retention = self.retention_state
        if retention is not None and layer_idx == 0:
            # snapkv: the prompt ended (a no-op if get_mask_sizes did it)
            retention.settle(q, self._prompt_forward if self._prompt_known else None)

        base = layer.dropped  # tokens a retention policy dropped: stored index = absolute - base
        start, end = layer.num_tokens - base, layer.num_tokens - base + q
        first_new = (start + bt - 1) // bt
        write_keys = []
        if start % bt:  # a partly filled tail block
            tail = self._key(layer_idx, start // bt)
            store.ensure_device([tail], _once=True)  # counted here; the layer's read below skips it
            self._pinned.append(tail)
            store.begin_write(tail)
            write_keys.append(tail)
        fresh = self._keys(layer_idx, first_new, (end + bt - 1) // bt)
        if fresh:
            store.new_blocks(fresh, protect=write_keys, near=self._slot_hint(layer_idx, first_new))
            self._pinned.extend(fresh)
            write_keys.extend(fresh)
        ids = self._token_ids
        if ids is not None and len(ids) != layer.num_tokens + q and not self._injecting:
            # K/V that are not one per input id (CPM-Ant prepends 32 prompt positions; a
            # forward this cache's model did not see): blocks named by the ids would hold
            # other tokens' KV, so nothing of this sequence is published
            self._token_ids = None
        for key, slot in zip(write_keys, store.device_slots(write_keys)):
            lo, hi = max(start, key.index * bt), min(end, (key.index + 1) * bt)
            store.device_pool.write_tokens(slot, lo - key.index * bt, key_states[:, :, lo - start:hi - start],
                                           value_states[:, :, lo - start:hi - start])
            store.note_tokens(key, hi - key.index * bt)
            if hi == (key.index + 1) * bt:
                store.write_behind(key)  # sealed: give it a clean copy below
                if self.prefix is not None and not self._injecting:
                    self._publish(key, slot)
        selects = self._selects(layer, q)
        if self.selection_state is not None and not layer.is_sliding:
            self.selection_state.bounds.update(layer_idx, key_states, start)
        retained = retention is not None and retention.applies(layer) and self._routed()
        if retained:
            retention.state(layer_idx).append(layer.num_tokens, key_states.shape[0], key_states.shape[1], q,
                                              key_states.device)
        read_from = layer.visible_start()  # sliding layers drop nothing: base == 0
        layer.num_tokens = end + base

        needed = self._keys(layer_idx, read_from // bt, (end + bt - 1) // bt)
        offset = read_from - (read_from // bt) * bt
        if self.trace is not None:
            t_us = self.trace.now_us()
            self.trace.record("write", write_keys, store.geometry.block_bytes, self._step, q, t_us=t_us)
            self._pending_read = (needed, t_us)
        if self._injecting:  # load_prefix: nothing attends to this layer now, skip the gather
            return self._after_read(layer_idx, needed, offset, key_states, value_states)
        if selects:  # the attention hook chooses the pages and reads them (it sees the query)
            from tiercache.selection import SelectionPlan

            return SelectionPlan(self, layer_idx, needed, end - read_from).placeholder(key_states)
        # Views of the device pool when the blocks are adjacent there (held until the next
        # update); a copy with retention, which rewrites blocks while attention still runs.
        # The prefetch plan is queued behind this layer's own reads, before waiting for them.
        asked = self._asked  # the fast path stepped aside after asking: the policy heard this read
        ahead = asked[1] if asked is not None and asked[0] == needed else self._plan_ahead(layer_idx, needed)
        if q == 1 and not retained and self._attends_in_place():
            from tiercache.streaming import BlockAttentionPlan

            return BlockAttentionPlan(self, layer_idx, needed, end - read_from, offset, ahead).placeholder(key_states)
        keys, values = store.read_layer(needed, end - read_from, offset, hold=not retained, ahead=ahead)
        keys, values = self._after_read(layer_idx, needed, offset, keys, values, planned=True)
        if not self._hook_seen and (self._needs_hook or q == 1 and self.tier_config.attend_in_place):
            setattr(keys, PROBE_ATTR, self._saw_hook)  # the hook will show it sees this cache's keys
            if self._probe_step is None and self._routed():  # unrouted: nothing could call it (yet)
                self._probe_step = self._step
        if retained:
            from tiercache.attention import PLAN_ATTR
            from tiercache.retention import RetentionPlan

            setattr(keys, PLAN_ATTR, RetentionPlan(self, layer_idx, start, values))
        return keys, values

    def _claim(self, me: object, layer_idx: int) -> None:
        """``update`` from a thread other than the last one: it may start a forward pass (layer
        0) once the other thread's has updated every layer. Else two forward passes would run
        on one cache at once, unpinning and overwriting each other's blocks: errors blaming
        corruption, or silently wrong tokens. The refused thread changes no block; the other
        goes on, but this cache publishes nothing more to the prefix cache (the refused
        forward's input ids were already taken in by the model's hook: blocks named by them
        would be served for other prompts). A forward pass that stopped half way (an error)
        leaves the cache half updated: ``reset()`` before using it again, from any thread."""
        with self._forward_lock:
            owner, at = self._forward
            if owner not in (None, me) and (layer_idx != 0 or at != self.num_layers - 1):
                self._token_ids = None
                raise RuntimeError(f"TieredCache: another thread's forward pass is at layer {at} of "
                                   f"{self.num_layers}: one cache serves one forward pass at a time; give each "
                                   f"thread its own cache (wrap() does, per generate() call), or reset() it after "
                                   f"a forward pass that stopped with an error")
            self._forward = (me, layer_idx)

    def _reopen_for(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """``key_states`` do not fit the store's blocks: a new store if the cache holds no
        token yet (a new batch size or dtype after ``reset()``), else a clear error."""
        g, shape = self.store.geometry, key_states.shape
        if all(layer.num_tokens == 0 for layer in self.layers):
            self.store.close()
            self.store = self._open_store(key_states)
        elif shape[1] != g.kv_heads or shape[3] != g.head_dim:
            raise UnsupportedModelError(
                f"layer {layer_idx} gave K/V of {shape[1]} heads x {shape[3]} dims, but this cache's blocks "
                f"hold {g.kv_heads} x {g.head_dim} (the first layer's): a model whose layers differ in KV shape "
                f"is not supported, and a cache serves only the model it was built for")
        else:
            raise ValueError(f"TieredCache holds batch {g.batch} of {g.dtype}; got batch {shape[0]} of "
                             f"{key_states.dtype} (use a new cache or reset() this one)")

    def _update_resident(self, layer: TieredLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                         q: int) -> Optional[tuple]:
        """``update``'s fast path, for a decode step when nothing has to move: the new tokens
        go into the layer's tail block without filling it (no new block, no write-behind, no
        publish), and the blocks attention reads are where it reads them, the next layer's
        too. On the device in adjacent slots (``BlockStore.hold_resident``), K/V are views of
        the device pool (what ``read_layer(hold=True)`` returns) and the write is one copy
        each, from the pool's geometry kept per layer and slot range. On a CPU store with a
        host tier, on the device or the host (``BlockStore.hold_mixed``), they are gathered
        as ``read_layer`` gathers them. Returns None, having changed nothing, where the
        general path must run; the prefetch plan, if it was asked for, is left in ``_asked``
        for the general path. The caller did what every update does first (capacity, token
        events, compute stream, unpins, views)."""
        bt, layer_idx = self.tier_config.block_tokens, layer.layer_idx
        start = layer.num_tokens  # no retention: nothing dropped, stored index = absolute
        off = start % bt
        if not off or off + q >= bt or key_states.requires_grad or value_states.requires_grad:
            return None
        tail = start // bt
        read_from = layer.visible_start()
        lo = read_from // bt
        store = self.store
        mixed = store.attention_tier is Tier.HOST  # a CPU store with a host tier
        if mixed and q == 1 and self._attends_in_place():  # block attention reads them, not a gather
            return None
        needed = self._keys(layer_idx, lo, tail + 1)
        ahead = self._plan_ahead(layer_idx, needed)
        self._asked = (needed, ahead)  # if this steps aside, the general path uses this plan
        end = start + q
        offset = read_from - lo * bt
        if mixed:
            slot = store.hold_mixed(needed[-1], needed, ahead, pinned=self._pinned)
            if slot is None:
                return None
            store.device_pool.write_tokens(slot, off, key_states, value_states)
            store.note_tokens(needed[-1], off + q)
            layer.num_tokens = end
            keys, values = store.read_held(end - read_from, offset)
        else:
            first = store.hold_resident(needed[-1], needed, ahead, pinned=self._pinned)
            if first is None:
                return None
            n = len(needed)
            pool = store.device_pool
            geo = self._layer_views[layer_idx]
            if geo is None or geo[0] is not pool.k or geo[1] != first or geo[2] != n:
                k, v = pool.view(first, n, n * bt)  # [B, H, n*bt, D] over the slots, in order
                geo = self._layer_views[layer_idx] = (pool.k, first, n, k, v, k.shape[:2], k.shape[3], k.stride(),
                                                      k.storage_offset(), v.storage_offset())
            _, _, _, k, v, bh, d, stride, k0, v0 = geo
            # as_strided: the same views as narrow() along the tokens, at less dispatch cost
            at = ((tail - lo) * bt + off) * stride[2]
            k.as_strided((*bh, q, d), stride, k0 + at).copy_(key_states)
            v.as_strided((*bh, q, d), stride, v0 + at).copy_(value_states)
            store.note_tokens(needed[-1], off + q)
            layer.num_tokens = end
            at, size = offset * stride[2], (*bh, end - read_from, d)
            keys, values = k.as_strided(size, stride, k0 + at), v.as_strided(size, stride, v0 + at)
        keys, values = self._after_read(layer_idx, needed, offset, keys, values, planned=True)
        if q == 1 and not self._hook_seen and self.tier_config.attend_in_place:
            setattr(keys, PROBE_ATTR, self._saw_hook)  # the hook will show it sees this cache's keys
        return keys, values

    def _slot_hint(self, layer_idx: int, index: int) -> Optional[int]:
        """Where block ``index`` of the layer should go on the device: right after the
        layer's previous block, or for its first block at the start of the layer's share of
        the slots. A layer whose blocks sit in adjacent slots is read without a copy."""
        store = self.store
        if index > self.layers[layer_idx].first_block:
            prev = store.device_slot(self._key(layer_idx, index - 1))
            return None if prev is None else prev + 1
        return layer_idx * (store.num_slots(store.tiers[0]) // self.num_layers)

    def _make_selection_and_retention(self) -> tuple:
        cfg = self.tier_config
        selection = retention = None
        if cfg.selection != "full":
            from tiercache.policies import make_selection
            from tiercache.selection import SelectionState

            selection = SelectionState(make_selection(cfg.selection), cfg.selection_budget, cfg.block_tokens,
                                       cfg.selection)
        if cfg.retention is not None:
            from tiercache.policies import make_retention
            from tiercache.retention import RetentionState

            retention = RetentionState(self, make_retention(cfg.retention), cfg.retention_budget, cfg.retention)
        return selection, retention

    def attention_stats(self) -> dict:
        """What selection and retention did: pages read of pages there were (per layer and
        decode step, summed), tokens dropped, compactions and the tokens each layer keeps;
        how many layer-steps of decode attention ran in place (``attend_in_place``); and
        ``reads``: how the other layer reads got their K/V, as zero-copy ``views`` of the
        device pool or as ``gathers`` into one buffer (``gathered_bytes``, ``gather_seconds``)."""
        reads = dict(self.store.read_stats) if self.store is not None else \
            {"views": 0, "gathers": 0, "gathered_bytes": 0, "gather_seconds": 0.0}
        return {"selection": self.selection_state.stats() if self.selection_state is not None else None,
                "retention": self.retention_state.stats() if self.retention_state is not None else None,
                "in_place_layer_steps": self.in_place_steps, "reads": reads}

    def _routed(self) -> bool:
        """Does attention run through tiercache's hook (needed by selection and retention)?"""
        if getattr(self._attn_config, "_attn_implementation", None) == "tiercache":
            return True
        if not getattr(self, "_warned_unrouted", False):
            self._warned_unrouted = True
            log.warning("tiercache: selection/retention need tiercache's attention hook; pass the model (not "
                        "its config) to TieredCache or call tiercache.attention.install(model). Reading "
                        "every block and dropping nothing meanwhile.")
        return False

    def _wants_in_place(self, model: Any) -> bool:
        """Does the config ask for in-place attention, with a host tier, for a model on CPU?"""
        cfg = self.tier_config
        if not (cfg.attend_in_place and cfg.host_enabled) or not isinstance(model, torch.nn.Module):
            return False
        device = cfg.device
        if device is None:
            param = next(model.parameters(), None)
            device = param.device if param is not None else "cpu"
        return torch.device(device).type == "cpu"

    def _saw_hook(self) -> None:
        self._hook_seen = True

    def _attends_in_place(self) -> bool:
        """Decode attention over the blocks where they lie (``tiercache.streaming``): with
        ``attend_in_place``, on a CPU store with a host tier, once tiercache's hook has shown
        that it sees this cache's keys (a probe on an earlier step), when the inner attention
        is SDPA and nothing wants the attention scores."""
        store = self.store
        return (self.tier_config.attend_in_place and self._hook_seen and store.device.type == "cpu"
                and not self._grad_forward  # its output would not reach tie_to_graph's node
                and Tier.HOST in store.tiers
                and not self.wants_scores and self.trace is None
                and getattr(self._attn_config, "_attn_implementation", None) == "tiercache"
                and _inner_name(self._attn_config) == "sdpa")

    def _selects(self, layer: TieredLayer, query_length: int) -> bool:
        """Quest applies to decode steps (one query token) of full-attention layers, once the
        hook has shown it sees this cache's keys (``_check_hook``). Not to a prompt token
        computed alone (the last one after a loaded prefix, or a one-token last chunk), where
        the prompt's length is known: it chose pages for it, so a warm prefix cache or the
        chunk size changed the answer (a review); a prompt reads everything."""
        return (self.selection_state is not None and query_length == 1 and not layer.is_sliding
                and not self._prompt_forward and self._hook_seen and self._routed())

    def _check_hook(self) -> None:
        """At a forward's first layer, before anything is written: selection and retention
        work inside tiercache's attention hook, and an earlier forward handed the hook a
        probe that it never called. The model computes attention itself (GPT-Neo, Bloom:
        its config names the hook, but its attention never calls it), so its queries are
        never seen. Quest handed such a model its placeholder keys and it attended to them: wrong
        tokens, no error; retention kept every token past its budget, without a word (a
        review). An ``UnsupportedModelError`` naming it instead. (A probe counts only once
        attention is routed to the hook: one handed out while a cache built from a config
        had no hook yet was never callable.)"""
        if self._probe_step is None or self._probe_step >= self._step or not self._routed():
            return
        names = [name for name, state in (("selection", self.selection_state), ("retention", self.retention_state))
                 if state is not None]
        what = " and ".join(names)
        model = type(self._model).__name__ if self._model is not None else "this model"
        raise UnsupportedModelError(
            f"{model}: its attention does not run through transformers' attention interface, so tiercache's "
            f"attention hook never sees its queries, and {what} work{'s' if len(names) == 1 else ''} inside that "
            f"hook; use {what} with a model "
            f"whose attention does (Llama, Mistral, Qwen2/3, Gemma2, Phi3, GPT-2, ...), or leave it off")

    def _note_read(self, keys: list) -> None:
        """The blocks a selection actually reads (for the trace)."""
        if self.trace is not None and self._pending_read is not None:
            self._pending_read = (keys, self._pending_read[1])

    def _plan_ahead(self, layer_idx: int, needed: list) -> list:
        """The prefetch policy hears which blocks layer ``layer_idx`` reads (``observe``) and
        names those to bring up next (``plan``). A plug-in's exception, or a plan that is not
        a list of block keys (``plan_breach``), is a ``PolicyError`` naming it
        (``tiercache.guard``), not an error from inside the store."""
        policy = self.prefetch_policy
        if not self._prefetch_plugin:
            policy.observe(layer_idx, needed)
            return policy.plan(layer_idx, self.num_layers, self._read_blocks_of)
        name = self.prefetch_name
        # a copy: the store reads ``needed`` after this, so a plug-in that sorted or kept and
        # changed the list it heard made attention read other blocks, silently (a review)
        heard = tuple(needed)
        plugin_answer("prefetch", name, "observe", lambda: policy.observe(layer_idx, heard), lambda _: "")
        return plugin_answer("prefetch", name, "plan",
                             lambda: as_plan(policy.plan(layer_idx, self.num_layers, self._read_blocks_of)),
                             plan_breach)

    def _after_read(self, layer_idx: int, needed: list, offset: int, keys: torch.Tensor,
                    values: torch.Tensor, planned: bool = False) -> tuple:
        """After a layer's blocks were read: scores hook, prefetch (unless ``planned``: the
        read already queued it), sliding frees, stall time."""
        store, layer = self.store, self.layers[layer_idx]
        if self.wants_scores or self.trace is not None:
            setattr(keys, SCORES_ATTR, self._scores_hook(needed, offset))
        if not planned:
            plan = self._plan_ahead(layer_idx, needed)  # with selection: the pages chosen
            if plan:
                store.prefetch(plan, protect=needed, dst=store.attention_tier)
        if layer.is_sliding and not layer.record_past:
            self._free_outside_window(layer)
        stall = store.take_stall()
        self.events.stall(stall)
        if self.trace is not None:
            self.trace.waited(stall)
        return keys, values

    def _rewrite_layer(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Retention: replace the layer's stored tokens by ``keys``/``values`` [B, H, S', D]."""
        store, bt, layer = self.store, self.tier_config.block_tokens, self.layers[layer_idx]
        store.unpin([k for k in self._pinned if k.layer == layer_idx])  # its attention is done
        self._pinned = [k for k in self._pinned if k.layer != layer_idx]
        old = (layer.num_tokens - layer.dropped + bt - 1) // bt
        new = (keys.shape[2] + bt - 1) // bt
        existing = [self._key(layer_idx, i) for i in range(min(old, new))]
        fresh = [self._key(layer_idx, i) for i in range(old, new)]
        pinned = []
        try:
            if existing:
                store.ensure_device(existing)
                pinned.extend(existing)
                for key in existing:
                    store.begin_write(key)  # waits for moves reading it; lower copies are stale now
            if fresh:
                store.new_blocks(fresh, protect=existing)
                pinned.extend(fresh)
            for key, slot in zip(pinned, store.device_slots(pinned)):
                lo, hi = key.index * bt, min(keys.shape[2], (key.index + 1) * bt)
                store.device_pool.write_tokens(slot, 0, keys[:, :, lo:hi], values[:, :, lo:hi])
                store.note_tokens(key, hi - lo)
        finally:
            store.unpin(pinned)
        for index in range(new, old):
            store.delete(self._key(layer_idx, index))

    def _free_outside_window(self, layer: TieredLayer) -> None:
        """Free a sliding layer's blocks that hold no token the next step can see."""
        self._free_before(layer, layer.visible_start() // self.tier_config.block_tokens)

    def _free_before(self, layer: TieredLayer, first_block: int) -> None:
        for index in range(layer.first_block, first_block):
            self.store.delete(self._key(layer.layer_idx, index))
        layer.first_block = max(layer.first_block, first_block)

    def _drop_layer(self, layer_idx: int) -> None:
        layer = self.layers[layer_idx]
        if self.store is not None and not self.store.closed:  # a closed one holds nothing to free
            self.store.unpin([k for k in self._pinned if k.layer == layer_idx])
            self._pinned = [k for k in self._pinned if k.layer != layer_idx]
            for key in self._blocks_of(layer_idx):
                self.store.delete(key)
        layer.num_tokens = 0
        layer.first_block = 0
        layer.dropped = 0
        if self.selection_state is not None:
            self.selection_state.bounds.drop(layer_idx)
        if self.retention_state is not None:
            self.retention_state.drop(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        """``Cache.crop``, all layers or none: each layer that cannot roll back is found before
        any is cropped. Refused half way (a sliding layer cropped, then a full one that
        retention cut refusing), the layers disagreed on their length, and the next forward
        failed inside torch or ran on a rejected draft token (a review)."""
        for layer_idx in range(len(self.layers)):
            refusal = self._crop_refusal(layer_idx, tokens_to_remove)
            if refusal is not None:
                raise refusal
        super().crop(tokens_to_remove)

    def _crop_refusal(self, layer_idx: int, tokens_to_remove: int) -> Optional[Exception]:
        """Why layer ``layer_idx`` cannot be cropped by ``tokens_to_remove``, or None."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
            return TypeError(f"crop: expected an int number of tokens, got {tokens_to_remove!r}")
        if tokens_to_remove > 0:
            return ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        layer = self.layers[layer_idx]
        if layer.num_tokens == 0 or (tokens_to_remove == 0 and not layer.is_sliding):
            return None
        if layer.dropped:
            return RuntimeError(f"crop: layer {layer_idx} dropped {layer.dropped} tokens for good (retention="
                                f"{self.tier_config.retention!r}), so it cannot roll back; assisted generation "
                                f"and other rollbacks need a lossless cache")
        bt = self.tier_config.block_tokens
        new_len = max(layer.num_tokens + tokens_to_remove, 0)
        if layer.is_sliding and new_len < layer.first_block * bt + (layer.sliding_window - 1) and layer.first_block:
            return RuntimeError("crop: the sliding-window layer already dropped the tokens needed to roll back "
                                "(call activate_past_recording() first, as assisted generation does)")
        return None

    def _crop_layer(self, layer_idx: int, tokens_to_remove: int) -> None:
        refusal = self._crop_refusal(layer_idx, tokens_to_remove)  # (crop() checked every layer first)
        if refusal is not None:
            raise refusal
        layer = self.layers[layer_idx]
        if layer.num_tokens == 0 or (tokens_to_remove == 0 and not layer.is_sliding):
            return  # (crop(0) of a sliding layer trims it to its window, below)
        retention = self.retention_state
        if (layer_idx == 0 and retention is not None and retention.policy.prompt_only and not retention.compactions
                and not getattr(self, "_warned_uncut", False)
                and any(lay.num_tokens > retention.budget for lay in self.layers if retention.applies(lay))):
            self._warned_uncut = True
            log.warning("tiercache: retention=%r cuts the prompt when the first decode step of one token runs; in "
                        "assisted generation (a rollback: crop) each step checks several candidate tokens, so "
                        "nothing has been dropped: the cache keeps every token (exact, but no memory saved)",
                        self.tier_config.retention)
        bt = self.tier_config.block_tokens
        new_len = max(layer.num_tokens + tokens_to_remove, 0)
        self.store.unpin(self._pinned)
        self._pinned = []
        for index in range((new_len + bt - 1) // bt, (layer.num_tokens + bt - 1) // bt):
            self.store.delete(self._key(layer_idx, index))
        layer.num_tokens = new_len
        if layer.is_sliding:
            # Back to what the next step can see, as DynamicCache's sliding layer trims itself
            # in crop(): recording the past (assisted generation, prompt lookup) keeps every
            # block only until the rollback, which never goes back past this crop. Kept
            # instead, a sliding layer grew with every token of the run (a review: 18 blocks a
            # layer after 60 tokens, where plain generation held 2), and a run that fit its
            # budgets raised CapacityError.
            self._free_outside_window(layer)
        state = self.retention_state.layers.get(layer_idx) if self.retention_state is not None else None
        if state is not None:
            state.crop(new_len)
        if layer_idx == 0 and self._token_ids is not None:
            del self._token_ids[new_len:]
            del self._chain[new_len // bt:]
        if layer_idx == 0 and new_len <= self._exact_tokens:  # what quest computed in part is gone
            self._exact_tokens = float("inf")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute the batch rows of every block on every tier. ``beam_idx``
        gives, for each row, the row it now holds: as many integers as the cache has rows,
        each in [0, rows) (the cache keeps the batch size it was filled with)."""
        if self.store is not None:
            beam_idx = _row_index(beam_idx, self.store.geometry.batch)
            self.store.unpin(self._pinned)
            self._pinned = []
            self.store.reorder_rows(beam_idx)
        if self.selection_state is not None:
            self.selection_state.bounds.reorder(beam_idx)
        if self.retention_state is not None:
            self.retention_state.reorder(beam_idx)

    def offload(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """transformers' ``Cache.offload``, in tiers: the blocks of ``layer_idx`` that are on
        the device move one tier down, asynchronously (a block with a clean copy below just
        drops its device copy), freeing their device slots. Blocks pinned for a forward in
        progress stay. A sliding layer is skipped when ``only_non_sliding``, as in
        transformers. The layer's tokens stay in the cache: the next forward (or
        ``prefetch``) brings them back."""
        super().offload(self._layer_index(layer_idx, "offload"), only_non_sliding)

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True) -> None:
        """transformers' ``Cache.prefetch``, in tiers: start bringing the blocks of
        ``layer_idx`` up to the device without waiting (as far as the device budget allows;
        the next forward waits for what is still on its way). A sliding layer is skipped
        when ``only_non_sliding``."""
        layer_idx = self._layer_index(layer_idx, "prefetch")
        if not (only_non_sliding and self.layers[layer_idx].is_sliding):
            self.layers[layer_idx].prefetch()

    def _layer_index(self, layer_idx: Any, call: str) -> int:
        """``layer_idx`` checked: an int in [0, layers) (99 was an IndexError from inside
        transformers, "a" a TypeError; -1 was taken as the last layer)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral) \
                or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"{call}: layer_idx must be an integer in [0, {len(self.layers)}), got {layer_idx!r}")
        return int(layer_idx)

    def _offload_layer(self, layer_idx: int) -> None:
        store = self.store
        if store is None or store.closed or self.closed:
            return
        on_device = [k for k in self._layer_keys_now(layer_idx) if Tier.DEVICE in store.tiers_of(k)]
        if on_device:  # generate() on another thread may drop some of them meanwhile
            store.demote_many(on_device, missing_ok=True)

    def _prefetch_layer(self, layer_idx: int) -> None:
        store = self.store
        if store is None or store.closed or self.closed:
            return
        store.prefetch(self._layer_keys_now(layer_idx))

    def _layer_keys_now(self, layer_idx: int) -> list:
        """``_blocks_of``, for a call that may come from another thread than the forward's
        (offload, prefetch): new keys, never the layer's own rows, which ``_grow_keys`` on
        two threads at once would fill with duplicates."""
        return [BlockKey(self.seq_id, layer_idx, i) for i in range(*self._block_range(layer_idx))]

    def reset(self) -> None:
        for i in range(self.num_layers):
            self._drop_layer(i)
        self._forward = (None, -1)
        self._token_ids = [] if self._token_ids is not None else None
        self._chain = []
        self._exact_tokens = float("inf")
        self._prompt_checked()  # nothing loaded any more: any prompt goes
        self._prompt_pending = 0
        self._prompt_known = False
        self._probe_step = None  # the hook may have been installed since (install(model), as warned)
        # a new request: a block it computes again is a new sighting (reuse_admission="reused"
        # stored nothing in a cache reused through reset(), its first answer kept for good)
        self._admitted = {}

    # ---- tiercache API ------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tier occupancy, moves, hits, misses, evictions, stall time and token counts."""
        if self.store is not None and not self.store.closed:
            snap = self.store.stats()
        else:
            cfg = self.tier_config
            tiers = {name: {"budget_bytes": budget, "used_bytes": 0, "blocks": 0, "capacity_blocks": 0}
                     for name, budget in (("device", cfg.device_budget), ("host", cfg.host_budget),
                                          ("disk", cfg.disk_budget if cfg.disk_enabled else 0))}
            snap = self.events.snapshot(getattr(self, "_last_tiers", tiers))
        remote = getattr(self.prefix, "remote", None)
        if remote is not None:  # the process's remote tier of this model (shared by its caches)
            snap["remote"] = remote.stats()
        return snap

    def close(self) -> None:
        """Wait for moves, stop the I/O workers and remove this cache's session files."""
        if self.closed:
            return
        self.closed = True
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._prompt_checked()
        # In a child made by fork() after this cache opened, the store, its locks (another
        # thread may have held one at the fork) and the prefix cache are the parent's: the
        # cache is only marked closed there.
        forked = self.store is not None and self.store.forked
        try:
            # a trace that fails to write (a full disk) raises here, after the rest is closed:
            # it skipped the prefix flush and the store's close (threads, session files left)
            if self.trace is not None:
                try:
                    if self.store is not None and not forked:
                        self._flush_trace()
                finally:
                    self.trace.close()
        finally:
            self._close_rest(forked)

    def _close_rest(self, forked: bool) -> None:
        """``close`` after the trace: the prefix cache's flush, then the store."""
        try:
            if self.prefix is not None and not self.prefix.closed and not forked:
                prefix = self.prefix
                try:
                    prefix.drop_unfinished(self._chain, owner=self)  # a forward that stopped half way
                    prefix.flush()  # what this run published survives the process
                except Exception as exc:  # noqa: BLE001 - sorted by _prefix_error
                    self._prefix_error(prefix, exc, (TierIOError, CapacityError))
        finally:
            self._layer_views = [None] * self.num_layers
            if self.store is not None:
                if not forked:
                    self._last_tiers = self.store.tier_stats()
                self.store.close()  # last: it may raise a plug-in policy's failure (tiercache.guard)

    def clear(self, tier: Optional[str] = None) -> int:
        """Drop the prefix cache's blocks of this model: all of them (``tier`` None), or only
        their copies on "host" or "disk". Returns how many blocks or copies went."""
        from tiercache.table import Tier

        tiers = {"device": Tier.DEVICE, "host": Tier.HOST, "disk": Tier.DISK}
        if tier is not None and tier not in tiers:
            raise ValueError(f"clear: tier must be None, 'device', 'host' or 'disk', got {tier!r}")
        prefix = self._ensure_prefix()
        if prefix is None:
            return 0
        return prefix.clear(None if tier is None else tiers[tier])

    # transformers marks a cache the caller passed (``_prepare_cache_for_generation``) before
    # anything reads it: a closed one is refused there, not by a reshape inside the model.
    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if self.closed:
            raise RuntimeError(_CLOSED)
        self.__dict__["_user_defined"] = value

    # A closed cache is the record of a finished run (stats() only): a copy of a model that
    # holds one (wrap()'s ``tiercache_last``) shares it. An open one holds pools and files.
    def __copy__(self) -> "TieredCache":
        if self.closed:
            return self
        raise TypeError(_NOT_COPYABLE)

    def __deepcopy__(self, memo: dict) -> "TieredCache":
        if self.closed:
            return self
        raise TypeError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol: int):
        if self.closed:  # a finished call's record: a pickled model (torch.save) carries None
            return (type(None), ())
        raise TypeError(_NOT_COPYABLE)

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


_THREADS = threading.local()
_CLOSED = ("TieredCache is closed: it cannot take more tokens. wrap() closes the cache of each generate() call "
           "as the call returns (also the one return_dict_in_generate hands back). To continue a conversation, "
           "call generate() with the whole conversation (the prefix cache loads what was computed) or pass a "
           "TieredCache of your own, closed when you are done")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")  # their rotary frequencies change with the sequence length


_ROPE_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> _length_dependent_rope's answer


def _length_dependent_rope(model: Any, text: Any) -> Optional[str]:
    """``_rope_kind`` of ``model``, kept per model: ``wrap`` builds a cache per call, and the
    walk over the modules took 1.7 ms at 80 layers."""
    if isinstance(model, torch.nn.Module):
        if model not in _ROPE_OF:
            _ROPE_OF[model] = _rope_kind(model, text)
        return _ROPE_OF[model]
    return _rope_kind(model, text)


def _rope_kind(model: Any, text: Any) -> Optional[str]:
    """The rope type of ``model`` if its rotary positions depend on the sequence length a
    forward sees (dynamic NTK scaling, LongRoPE's short and long factors), else None. Read
    from the model's rotary modules, which hold the type transformers runs (a HunYuan
    checkpoint's "dynamic" with an ``alpha`` runs as the fixed "ntk_alpha"); from the config
    where no module says."""
    kinds: list = []
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, str):
            kinds.append(kind)
        elif isinstance(kind, dict):  # one per layer type
            kinds.extend(v for v in kind.values() if isinstance(v, str))
    if not kinds:
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(text, name, None)
            if isinstance(params, dict):
                for entry in [params] + [v for v in params.values() if isinstance(v, dict)]:  # per layer type too
                    kinds.append(entry.get("rope_type", entry.get("type")))
    return next((kind for kind in kinds if kind in _LENGTH_DEPENDENT_ROPE), None)


# transformers' prompt-reuse recipe deep-copies a cache; this one's blocks live in pools, files
# and I/O threads (the error was "cannot pickle '_thread.lock' object")
_NOT_COPYABLE = ("TieredCache cannot be copied or pickled: its blocks live in the tiers' pools and files. To reuse "
                 "a prompt's KV across requests, give the TierConfig a disk_dir: the prefix cache keeps it, and "
                 "load_prefix() (wrap() calls it) loads it into a new cache")


def _thread_token() -> object:
    """An object of this thread's own, which the forward-pass claim holds (``_claim``). Not
    ``threading.get_ident()``: the OS gives a finished thread's id to a new one, which then
    passed for the thread whose forward pass had stopped half way."""
    token = getattr(_THREADS, "token", None)
    if token is None:
        token = _THREADS.token = object()
    return token


# ---- generate(): where transformers makes its cache, and where it prefills --------------------
# wrap() and ``tiercache generate`` do not read generate()'s arguments. Reading them, the way
# transformers would merge them, kept missing settings (a subclass's defaults, a setting its
# generate() makes in its body, a sentinel default transformers refuses, a custom_generate
# loop, images): each a case of wrong tokens. Instead, two of the model's own generation
# steps are hooked, on the instance, and act only inside a ``_tiering`` scope of this thread:
# - ``_prepare_cache_for_generation``, which transformers calls with its settled config and
#   inputs: where it would make its own cache, the scope makes a TieredCache;
# - ``_prefill``, the one step that slices the prompt by what the cache already holds: there,
#   and only for a plain loop, the cached prefix is loaded. A loop that never calls it
#   (assisted generation, a custom one) computes the whole prompt: nothing is loaded.

_SCOPES = threading.local()  # .stack: this thread's open _Scopes, innermost last
_PREFIX_MODES = ("greedy_search", "sample")  # GenerationMode values whose loop prefills through _prefill
# the modes a TieredCache runs (their cache calls: update, reorder_cache, crop); others (contrastive
# search's batch_repeat_interleave, say) keep transformers' cache
_TIERED_MODES = ("greedy_search", "sample", "beam_search", "beam_sample", "assisted_generation")
_UNTIERED_SEEN: set = set()  # modes warned about once
# model inputs of a plain text prefill: any other one (pixel_values, inputs_embeds, token_type_ids,
# ...) makes KV that the prompt's ids alone do not name
_PLAIN_INPUTS = frozenset({"input_ids", "cache", "past_key_values", "attention_mask", "position_ids", "use_cache",
                           "logits_to_keep", "return_dict", "cache_position", "output_attentions",
                           "output_hidden_states"})


def _other_inputs(kwargs: dict) -> bool:
    """Inputs of a forward or prefill other than the ids and their positions (flags aside)."""
    return any(name not in _PLAIN_INPUTS and value is not None and not isinstance(value, (bool, int, float, str))
               for name, value in kwargs.items())


class _Scope:
    """One tiered ``generate()`` of ``model`` on this thread: ``make()`` gives the cache,
    ``made`` keeps what it gave, ``on_prefill(cache, input_ids, generation_config, loaded)``
    runs once the prefix is loaded, before the prefill."""

    __slots__ = ("model", "make", "made", "on_prefill")

    def __init__(self, model: Any, make: Callable[[], "TieredCache"],
                 on_prefill: Optional[Callable[..., None]] = None) -> None:
        self.model, self.make, self.made, self.on_prefill = model, make, [], on_prefill


def _scope_of(model: Any) -> Optional[_Scope]:
    for scope in reversed(getattr(_SCOPES, "stack", ())):
        if scope.model is model:
            return scope
    return None


@contextlib.contextmanager
def _tiering(model: Any, make: Callable[[], "TieredCache"], on_prefill: Optional[Callable[..., None]] = None):
    """While open, ``model.generate()`` on this thread runs on ``make()``'s cache wherever it
    would make a cache of its own, and loads the cached prefix where that is exact. On a
    model that is not wrapped, the hooks go again when its last scope closes (a model that
    ``tiercache generate`` ran kept them, and then needed tiercache to be unpickled)."""
    _hold_hooks(model)
    stack = _SCOPES.__dict__.setdefault("stack", [])
    scope = _Scope(model, make, on_prefill)
    stack.append(scope)
    try:
        yield scope
    finally:
        stack.remove(scope)
        _release_hooks(model)


_PENDING_RELEASES: collections.deque = collections.deque()  # holds of caches collected unclosed


def _hold_hooks(model: Any) -> None:
    """Install the hooks on ``model`` (once) for a scope, or a cache that loaded a prefix."""
    with _HOOK_LOCK:
        _release_pending()
        _install_hooks(model)
        _OPEN_SCOPES[model] = _OPEN_SCOPES.get(model, 0) + 1


def _release_hooks(model: Any) -> None:
    """One hold less; the last one removes the hooks of a model that is not wrapped."""
    with _HOOK_LOCK:
        _release_pending()
        _release_one(model)


def _release_pending() -> None:
    """Under ``_HOOK_LOCK``: the holds of caches collected since (``_expect_prompt``)."""
    while _PENDING_RELEASES:
        try:
            model = _PENDING_RELEASES.popleft()()
        except IndexError:
            return
        if model is not None:  # else its hooks went with it
            _release_one(model)


def _release_one(model: Any) -> None:
    _OPEN_SCOPES[model] -= 1
    if not _OPEN_SCOPES[model]:
        del _OPEN_SCOPES[model]
        if not vars(model).get("_tiercache_wrapped", False):
            _remove_hooks(model)


class _Hook:
    """A hook on one model: ``function(model, ...)``. Not a closure, nor a bound method:
    ``copy.deepcopy`` of the model gives the copy a hook on the copy (a closure ran the
    original's weights), and pickle (``torch.save``) restores it by name, where a bound
    method's name was looked up on a model that had not got it back yet."""

    __slots__ = ("name", "model")

    def __init__(self, name: str, model: Any) -> None:
        self.name, self.model = name, model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _PENDING_RELEASES:  # holds of caches collected unclosed: the hooks may go once this call is done
            with _HOOK_LOCK:
                _release_pending()
        return _HOOKS[self.name](self.model, *args, **kwargs)

    def __reduce__(self) -> tuple:
        return (_Hook, (self.name, self.model))

    def __repr__(self) -> str:
        return f"<tiercache hook {self.name} of {type(self.model).__name__}>"


def _check_kv(keys: Any, values: Any) -> None:
    """``update``'s K and V where they set the store's block shape (the first update, a new
    batch size or dtype): floating-point tensors of one 4-D shape [batch, KV heads, tokens,
    head dim]. A 3-D one was a ValueError from unpacking its shape, K and V of different
    lengths a RuntimeError from a copy, and int64 ones were taken as a store of ints (a
    review of direct ``update()`` calls)."""
    for name, t in (("key_states", keys), ("value_states", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"TieredCache.update: {name} must be a floating-point tensor shaped [batch, KV heads, "
                             f"tokens, head dim], got {what}")
    if keys.shape != values.shape:
        raise ValueError(f"TieredCache.update: key_states {tuple(keys.shape)} and value_states "
                         f"{tuple(values.shape)} differ in shape")


def _row_index(index: Any, rows: int) -> torch.Tensor:
    """``reorder_cache``'s index, checked: a 1-D run of ``rows`` integers in [0, rows), as a
    tensor. One of another length (DynamicCache changes its batch size with it) was a
    RuntimeError from inside a copy, and a float one was truncated (a review)."""
    what = (f"{type(index).__name__} {tuple(index.shape)} {index.dtype}" if isinstance(index, torch.Tensor)
            else repr(index)[:80])
    if isinstance(index, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in index):
        index = torch.tensor(index, dtype=torch.long)
    if not (isinstance(index, torch.Tensor) and index.dim() == 1 and index.numel() == rows
            and not index.is_floating_point() and not index.is_complex() and index.dtype is not torch.bool):
        raise ValueError(f"reorder_cache: expected {rows} integer row indices (a 1-D tensor, one per row of the "
                         f"cache, which keeps the batch size it was filled with), got {what}")
    if rows and not (0 <= int(index.min()) and int(index.max()) < rows):
        raise ValueError(f"reorder_cache: row indices must lie in [0, {rows}), got {index.tolist()}")
    return index


_HOOK_LOCK = threading.RLock()  # installing and removing hooks, wrap()
_OPEN_SCOPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> _tiering scopes open


def _new_hook_lock_after_fork() -> None:
    """In a child made by ``fork()``: another thread of the parent may have held the lock
    at the fork (opening or closing a generate() scope), and would never let go of it."""
    global _HOOK_LOCK
    _HOOK_LOCK = threading.RLock()


def _install_hooks(model: Any) -> None:
    """Put the two hooks on ``model`` (once; under ``_HOOK_LOCK``)."""
    in_forked_children(_new_hook_lock_after_fork)
    if "_tiercache_hooked" not in vars(model):
        model._prepare_cache_for_generation = _Hook("prepare_cache", model)
        model._prefill = _Hook("prefill", model)
        model._tiercache_hooked = True


def _remove_hooks(model: Any) -> None:
    for name in ("_prepare_cache_for_generation", "_prefill", "_tiercache_hooked"):
        vars(model).pop(name, None)


def _tiers_the_call(model: Any, generation_config: Any, model_kwargs: dict) -> bool:
    """Whether transformers is about to make a cache of its default kind: not where the caller
    passed one, asked for none (``use_cache=False``, from wherever it came), or chose another
    kind, nor for a draft model's calls within assisted generation. A ``cache_implementation``
    equal to the model's default (or "hybrid", which transformers drops) is no choice of the
    caller's."""
    if model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None:
        return False
    if getattr(generation_config, "use_cache", True) is False:
        return False
    if getattr(generation_config, "is_assistant", False):
        # a wrapped draft model inside assisted generation: transformers keeps the draft's
        # cache across its generate() calls, and the cache of a call is closed as it returns
        return False
    chosen = getattr(generation_config, "cache_implementation", None)
    default = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    if chosen not in (None, "hybrid", default):
        return False
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return supports is None or bool(supports())


def _prepare_cache_hook(self: Any, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                        *args: Any, **kwargs: Any) -> Any:
    scope = _scope_of(self)  # a closed cache the caller passed: refused as transformers marks it
    mode = getattr(generation_mode, "value", generation_mode)
    passed = next((model_kwargs[k] for k in ("cache", "past_key_values") if model_kwargs.get(k) is not None), None)
    if isinstance(passed, TieredCache) and passed._loaded_ids is not None and mode not in _PREFIX_MODES:
        # Only the plain loops prefill from the cache's length (``_check_loaded_prompt``):
        # assisted generation and prompt lookup feed the whole prompt again on top of the
        # loaded KV (logits 7.5 off a fresh run, silently, in a review; DynamicCache filled
        # by hand the same way is as wrong), beams expand the rows.
        raise ValueError(f"this TieredCache holds the first {len(passed._loaded_ids)} tokens of a prompt, loaded by "
                         f"load_prefix(), and generate() in mode {mode!r} does not continue from a cache's past "
                         f"(only greedy and sampling do): call load_prefix() only before those, or reset() the "
                         f"cache first (tiercache.wrap() loads a cached prefix where the mode allows it)")
    tiered = scope is not None and _tiers_the_call(self, generation_config, model_kwargs)
    if tiered and mode not in _TIERED_MODES:
        if mode not in _UNTIERED_SEEN:
            _UNTIERED_SEEN.add(mode)
            log.warning("tiercache: generate() in mode %r runs on transformers' own cache, not tiered (TieredCache "
                        "runs %s)", mode, ", ".join(_TIERED_MODES))
        tiered = False
    if not tiered:
        return type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                                        *args, **kwargs)
    cache = scope.make()
    scope.made.append(cache)
    cache._generation_mode = mode
    model_kwargs["cache"] = cache
    return None


_HOOKS = {"prepare_cache": _prepare_cache_hook}


# A cache passed with use_cache=False: generate() then feeds the whole sequence at every step
# and the model still writes it into the cache (DynamicCache the same), so each step's KV went
# in again: tokens silently wrong, or a CapacityError naming budgets (a review).
_NO_USE_CACHE = ("use_cache=False with a TieredCache passed: the model would still write every step's whole "
                 "sequence into the cache (generate() feeds it all again without a cache), so the tokens would "
                 "be wrong; pass use_cache=True (the default), or no cache")


def _runs_forward(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward generate() calls: a PEFT model's base model (its generate()
    goes to the base model's, which calls its own forward; a hook on the wrapper saw no
    forward, and the prefix cache stored nothing, silently; a review), else ``model``."""
    inner = getattr(model, "get_base_model", None)
    if callable(inner):
        try:
            base = inner()
        except Exception:  # noqa: BLE001 - not PEFT's: the model itself
            return model
        if isinstance(base, torch.nn.Module):
            return base
    return model


def _prefill_hook(self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
                  *args: Any, **kwargs: Any) -> Any:
    scope = _scope_of(self)
    cache = model_kwargs.get("cache")
    first = kwargs.get("is_first_iteration", args[0] if args else True)
    if first and isinstance(cache, TieredCache):
        ours = scope is not None and any(cache is made for made in scope.made) and not cache._prefill_seen
        loaded = 0
        if ours:
            cache._prefill_seen = True
            if _prefix_loadable(self, cache, input_ids, generation_config, model_kwargs):
                loaded = cache.load_prefix(input_ids,
                                           prefill_chunk=getattr(generation_config, "prefill_chunk_size", None))
        # the prompt tokens this prefill computes count as prefill however they are fed
        embeds = model_kwargs.get("inputs_embeds")
        fed = embeds.shape[1] if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 else (
            input_ids.shape[1] if input_ids.dim() == 2 else 0)
        cache._prompt_pending = _prompt_to_compute(fed, model_kwargs, generation_config, cache.get_seq_length())
        cache._prompt_known = True  # for this prefill only (below)
        cache._check_loaded_prompt(input_ids, model_kwargs, generation_config)  # after the caller's load_prefix()
        if ours and scope.on_prefill is not None:
            scope.on_prefill(cache, input_ids, generation_config, loaded)
        try:
            return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        finally:
            # the prompt is computed; later forwards are counted by their length again. Left set,
            # a caller's cache (after load_prefix(), on a model not wrapped) counted every
            # later forward as decode, and quest selected pages for one-token prompt chunks (a
            # review). The decode steps of these loops are one token each: decode either way.
            cache._prompt_known, cache._prompt_pending = False, 0
    return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)


def _prompt_to_compute(fed: int, model_kwargs: dict, generation_config: Any, cached: int) -> int:
    """The prompt tokens a prefill of ``fed`` tokens will compute on a cache holding
    ``cached``: all of them where the mask or the positions cover a past before them (only
    the new ids passed, as transformers takes them on a cache with a past), else those past
    the cache's length (transformers slices the whole prompt by it). The new-ids form
    counted as nothing (a review: a second turn's 5 prompt tokens went to decode)."""
    if _sequence_length(model_kwargs, generation_config) > fed:
        return fed
    return max(0, fed - cached)


def _sequence_length(model_kwargs: dict, generation_config: Any) -> int:
    """The whole sequence's length as generate() says it: the mask's, the positions' it made
    from the mask, or, where transformers dropped a mask of ones before the prefill, the
    length it kept (a model that takes no position_ids, BLOOM's, has nothing else to say
    it); -1 where none says."""
    spans = [t.shape[-1] for t in (model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"))
             if isinstance(t, torch.Tensor) and t.dim() == 2]
    spans.append(getattr(generation_config, "_mask_length", -1))
    return max(spans)


_HOOKS["prefill"] = _prefill_hook


def _count_arg(call: str, name: str, value: Any, low: int) -> int:
    """``value`` checked: an integer (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{call}: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _usual_positions(positions: Any, length: int, start: int = 0) -> bool:
    """Whether ``positions`` are ``start, start + 1, ...`` for ``length`` tokens (every row)."""
    return (isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[-1] == length
            and bool((positions == torch.arange(start, start + length, device=positions.device)).all()))


def _prefix_loadable(model: Any, cache: "TieredCache", input_ids: torch.Tensor, generation_config: Any,
                     model_kwargs: dict) -> bool:
    """Whether this first prefill may start from a cached prefix: transformers then computes
    only the prompt's tail (it slices the ids by the cache's length). Only where the KV of
    the prompt's ids alone, at the usual positions, is what the model would compute: one
    row, the plain loops, a mask (given or inferred) that hides nothing and covers the ids
    (transformers slices only then), no inputs but the ids (images, embeddings), and no
    outputs asked for the prompt (hidden states, attentions: they would cover its tail)."""
    if getattr(cache, "_generation_mode", None) not in _PREFIX_MODES:
        return False
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        return False
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        if not (mask.dim() == 2 and mask.shape[1] == input_ids.shape[1] and bool(mask.all())):
            return False
    elif getattr(generation_config, "_mask_length", -1) != input_ids.shape[1]:
        return False
    positions = model_kwargs.get("position_ids")
    if positions is not None and not _usual_positions(positions, input_ids.shape[1]):
        return False
    if _other_inputs(model_kwargs):
        return False
    return not (getattr(generation_config, "output_hidden_states", False)
                or getattr(generation_config, "output_attentions", False))


def _inner_generate(model: Any) -> Callable[..., Any]:
    """``model.generate`` as it was before ``wrap()``: an instance's own (custom_generate's),
    else its class's."""
    if not vars(model).get("_tiercache_wrapped", False):
        return model.generate
    inner = vars(model).get("_tiercache_inner_generate")
    return inner if inner is not None else types.MethodType(type(model).generate, model)


def _tiered_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``generate()`` of a wrapped model: the model's own, on a TieredCache wherever it would
    make a cache of its own (see ``_tiering``). The caches are closed when it returns."""
    call = _inner_generate(self)
    # The prompt's length, for counting tokens (``update``): the plain loops and beams tell
    # it again in ``_prefill`` (after a loaded prefix); assisted generation and prompt lookup
    # never call that, and their first forward holds the prompt and the drafted tokens.
    prompt = _prompt_length(args, kwargs)
    passed = [c for c in (kwargs.get("cache"), kwargs.get("past_key_values")) if isinstance(c, TieredCache)]

    def make() -> "TieredCache":
        cache = TieredCache(self, self._tiercache_config)
        self.tiercache_last = cache
        if prompt is not None:
            cache._prompt_pending, cache._prompt_known = prompt, True
        return cache

    if prompt is not None:
        for cache in passed:
            cache._prompt_pending, cache._prompt_known = _prompt_to_compute(
                prompt, kwargs, kwargs.get("generation_config"), cache.get_seq_length()), True
    with _tiering(self, make) as scope:
        try:
            return call(*args, **kwargs)
        finally:
            # this call's cache, not one of a generate() run inside it (from a logits
            # processor, say); None where it ran untiered (use_cache=False, a cache of its own)
            self.tiercache_last = scope.made[0] if scope.made else None
            for cache in scope.made:
                cache.close()
            for cache in passed:  # a forward after this call is counted by its length
                cache._prompt_known, cache._prompt_pending = False, 0


_HOOKS["generate"] = _tiered_generate


def _prompt_length(args: tuple, kwargs: dict) -> Optional[int]:
    """The prompt's length in a ``generate()`` call's arguments (embeddings first, as
    transformers takes them for a decoder), or None where it does not say."""
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return embeds.shape[1]
    ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        return ids.shape[1]
    return None


def wrap(model: Any, config: Optional[TierConfig] = None) -> Any:
    """Make ``model.generate()`` use a TieredCache (one per call) wherever it would make a
    cache of its own: not where the call passes a cache, asks for none or for another kind.
    A cached prompt prefix is loaded only where generate() prefills through its plain loop.

    The cache of the latest call stays readable as ``model.tiercache_last`` (None after a
    call that ran untiered); it is closed when the call returns.
    """
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"wrap: expected a transformers model (with generate()), got {type(model).__name__}")
    check_supported(model.config)
    check_takes_cache(model)
    cfg = as_tier_config(config)
    for name in ("_prepare_cache_for_generation", "_prefill"):
        if not callable(getattr(type(model), name, None)):
            raise TypeError(f"wrap: {type(model).__name__} has no transformers {name}(); wrap() needs a model "
                            f"whose generate() is transformers' GenerationMixin.generate")
    model._tiercache_config = cfg
    if vars(model).get("_tiercache_wrapped", False):
        return model
    if getattr(getattr(model, "generation_config", None), "use_cache", None) is False:
        log.warning("tiercache: wrap: %s's generation_config has use_cache=False, so its generate() calls run "
                    "without a cache, untiered; set model.generation_config.use_cache = True to tier them",
                    type(model).__name__)
    with _HOOK_LOCK:  # two threads wrapping at once: the second took the first's hook for the model's own
        if vars(model).get("_tiercache_wrapped", False):
            return model
        _install_hooks(model)
        inner = vars(model).get("generate")
        model._tiercache_inner_generate = None if isinstance(inner, _Hook) else inner
        model.generate = _Hook("generate", model)
        model.tiercache_last = None
        model._tiercache_wrapped = True
    return model
