"""tiercache's attention hook: the model's own attention, plus per-block attention mass.

``install(model)`` registers an attention function and a matching mask function under the
name ``"tiercache"`` (a custom attention function without a mask function of the same name
silently gets ``attention_mask=None``) and switches the model to it. The function runs the
implementation the model used before (sdpa, eager, ...) unchanged, so outputs are the same
bit for bit; when the key tensor that ``TieredCache.update`` returned asks for it, it also
computes how much attention the last query row gave each key and hands that to the cache.
Only that row is scored, so the full attention matrix is never materialised.

Selection and retention (``tiercache.selection``, ``tiercache.retention``) hang a *plan* on
the key tensor (attribute ``_tiercache_plan``). The hook calls ``plan.prepare(...)`` before
attention -- it may swap in other K/V and a per-head mask (Quest reads only the chosen
pages: ``update`` never sees the query, this function does) -- and ``plan.finish(...)``
afterwards (retention recomputes the attention weights it scores tokens by). A plan with an
``attend`` method (``tiercache.streaming``: decode attention over every block where they
lie) computes the whole SDPA call itself when ``streaming.plain`` says it can.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

NAME = "tiercache"
_INNER = "_tiercache_inner_attention"
SCORES_ATTR = "_tiercache_on_scores"
PLAN_ATTR = "_tiercache_plan"
PROBE_ATTR = "_tiercache_probe"  # called when the hook sees this key tensor (TieredCache checks routing)


def plan_placeholder(plan: Any, key_states: torch.Tensor, num_tokens: int) -> tuple:
    """K/V of the right shape, [B, H, num_tokens, D], that hold no memory and carry ``plan``
    (the hook reads and attends as it says). NaN, so that attention which bypassed the hook
    could never pass for right (the newest key repeated, as quest's once were, gave
    plausible wrong tokens: a review)."""
    b, h, _, d = key_states.shape
    nan = torch.full((1, 1, 1, 1), float("nan"), dtype=key_states.dtype, device=key_states.device)
    keys = nan.expand(b, h, num_tokens, d)
    setattr(keys, PLAN_ATTR, plan)
    return keys, nan.expand(b, h, num_tokens, d)


class _NoBackward(torch.autograd.Function):
    """A copy of ``kv`` (K/V read from the tiers, holding no graph) tied to ``new`` (this
    forward's K/V): a forward runs as usual, and a backward pass through it raises."""

    @staticmethod
    def forward(ctx: Any, kv: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return kv.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise RuntimeError("TieredCache is for inference: gradients do not flow through the K/V it holds "
                           "(its blocks keep the bytes, not the graph); run the forward under torch.no_grad(), "
                           "or train with transformers' DynamicCache")


def tie_to_graph(kv: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """For attention in a forward with autograd on: a copy of ``kv`` (K/V from the tiers),
    tied to ``new`` (the K/V they stand for) when that requires grad (``_NoBackward``), with
    the attributes this hook reads (a plan, the scores callback, the probe). A copy, as
    DynamicCache's K/V are: attention saves what it is given for backward."""
    out = _NoBackward.apply(kv, new) if new.requires_grad else kv.clone()
    out.__dict__.update(kv.__dict__)
    return out


def _inner_name(config: Any) -> str:
    return getattr(config, _INNER, None) or "sdpa"


def _upcast_and_reordered(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], **kwargs: Any):
    """GPT-2 with ``reorder_and_upcast_attn``: its attention in fp32 (``_upcast_and_reordered_attn``),
    which the model takes only when its attention implementation is named "eager". Routed
    through the hook (named "tiercache") it got the plain eager path instead: in fp16, q.k
    overflowed to NaN logits (a review)."""
    return module._upcast_and_reordered_attn(query, key, value, attention_mask)


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], **kwargs: Any):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = _inner_name(module.config)
    if inner == "eager" and getattr(module, "reorder_and_upcast_attn", False) \
            and hasattr(module, "_upcast_and_reordered_attn"):
        fn = _upcast_and_reordered  # GPT-2's own eager path, which it takes only under "eager"
    elif inner == "eager" or inner not in ALL_ATTENTION_FUNCTIONS:
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    else:
        fn = ALL_ATTENTION_FUNCTIONS[inner]
    probe = getattr(key, PROBE_ATTR, None)
    if probe is not None:
        probe()
    plan = getattr(key, PLAN_ATTR, None)
    if plan is not None and hasattr(plan, "attend") and inner == "sdpa":
        from tiercache.streaming import plain

        if plain(module, query, kwargs):
            return plan.attend(query, key, attention_mask, kwargs.get("scaling"))
    if plan is not None:
        given = key, value
        key, value, attention_mask = plan.prepare(module, query, key, value, attention_mask,
                                                  eager=inner == "eager" or inner not in ALL_ATTENTION_FUNCTIONS)
        if torch.is_grad_enabled():  # K/V a plan read from the tiers (Quest's pages) stand for the ones given
            key = key if key is given[0] else tie_to_graph(key, given[0])
            value = value if value is given[1] else tie_to_graph(value, given[1])
    out = fn(module, query, key, value, attention_mask, **kwargs)
    if plan is not None:
        plan.finish(module, query, key, attention_mask, kwargs.get("scaling"),
                    kwargs.get("softcap", getattr(module.config, "attn_logit_softcapping", None)))
    on_scores: Optional[Callable] = getattr(key, SCORES_ATTR, None)
    if on_scores is not None:
        with torch.no_grad():
            on_scores(last_row_mass(query, key, attention_mask, kwargs.get("scaling"),
                                    kwargs.get("softcap", getattr(module.config, "attn_logit_softcapping", None))))
    return out


def last_row_mass(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor],
                  scaling: Optional[float] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Attention probabilities of the last query row, summed over batch and heads: ``[kv_len]``."""
    q = query[:, :, -1:, :].float()  # [B, Hq, 1, D]
    b, hq, _, d = q.shape
    hkv, n = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    q = q.view(b, hkv, hq // hkv, d)  # grouped query heads share a KV head
    logits = torch.einsum("bgrd,bgnd->bgrn", q, key.float()) * scale  # [B, Hkv, rep, N]
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        row = mask[:, :, -1, :n]  # [B, 1 or Hq, N]
        row = row.unsqueeze(2) if row.shape[1] == 1 else row.reshape(b, hkv, hq // hkv, n)
        if row.dtype == torch.bool:
            logits = logits.masked_fill(~row, float("-inf"))
        else:
            logits = logits + row.float()
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(0, 1, 2))


# ---- masks for plans --------------------------------------------------------------------------
def visible(mask: Optional[torch.Tensor], q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The 4D mask as booleans ``[B or 1, 1 or Hq, q, kv]`` (True: attend). ``None`` means what
    SDPA's ``is_causal`` skip means: causal, aligned to the last key, no padding."""
    if mask is None:
        rows = torch.arange(q_len, device=device).view(-1, 1) + (kv_len - q_len)
        return (torch.arange(kv_len, device=device).view(1, -1) <= rows).view(1, 1, q_len, kv_len)
    mask = mask[..., :kv_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def as_mask(vis: torch.Tensor, eager: bool, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility back to what the inner attention takes: bool for SDPA, additive for eager."""
    if not eager:
        return vis
    zero = torch.zeros((), dtype=dtype, device=vis.device)
    return torch.where(vis, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=vis.device))


def attention_mass(query: torch.Tensor, key: torch.Tensor, vis: torch.Tensor, scaling: Optional[float],
                   softcap: Optional[float], rows: slice, chunk: int = 256) -> torch.Tensor:
    """Attention probabilities of query ``rows``, summed over those rows and each KV head's
    query heads: ``[B, H_kv, N]``. Computed ``chunk`` rows at a time, so a long prefill never
    materialises its whole attention matrix. ``vis``: bool ``[B|1, 1|Hq, q, N]``."""
    b, hq, q_len, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    rep = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    k = key.float()
    out = torch.zeros(b, hkv, n, dtype=torch.float32, device=key.device)
    start, stop, _ = rows.indices(q_len)
    for lo in range(start, stop, chunk):
        hi = min(lo + chunk, stop)
        q = query[:, :, lo:hi].float().reshape(b, hkv, rep * (hi - lo), d)
        logits = torch.matmul(q, k.transpose(-1, -2)).view(b, hkv, rep, hi - lo, n) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        m = vis[:, :, lo:hi]
        m = m.unsqueeze(1) if m.shape[1] == 1 else m.reshape(m.shape[0], hkv, rep, hi - lo, n)
        logits.masked_fill_(~m, float("-inf"))
        out += torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=(2, 3))
    return out


def _mask(*args: Any, config: Any = None, **kwargs: Any):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    inner = _inner_name(config)
    fn = ALL_MASK_ATTENTION_FUNCTIONS[inner if inner in ALL_MASK_ATTENTION_FUNCTIONS else "eager"]
    return fn(*args, config=config, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def install(model: Any) -> None:
    """Route ``model``'s attention through the hook (idempotent; outputs unchanged)."""
    _register()
    configs = [model.config]
    text = model.config.get_text_config(decoder=True)
    if text is not model.config:
        configs.append(text)
    for config in configs:
        current = getattr(config, "_attn_implementation", None) or "sdpa"
        if current != NAME:
            setattr(config, _INNER, current)
            config._attn_implementation = NAME
