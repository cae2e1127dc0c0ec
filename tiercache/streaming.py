"""Decode attention over every block where it lies (CPU), without gathering them first.

On CPU the device and host tiers are both RAM, so a decode step can attend to each block in
its own pool slot: per block (or run of adjacent device slots) one ``q @ K^T``, one softmax
over all the logits, then one ``p @ V`` per block. A gather would first copy the whole
layer's K and V into one buffer (a write and a read of every byte, per layer and step) and
then attention would read them again; here attention reads each byte once. Measured on 2
cores at 8k tokens, cache-cold: 2.2-2.3 ms per layer against 2.9-3.1 ms for gather + SDPA.

``TieredCache.update`` hands out a ``BlockAttentionPlan`` on a placeholder K (the way
selection does) for a decode step of a layer whose attention is SDPA; tiercache's attention
hook calls ``plan.attend``, which reads the blocks (``BlockStore.read_segments``) and returns
what SDPA would: the same softmax(q K^T * scale + mask) V, computed in fp32, equal to SDPA's
output to float rounding (not bit for bit: hence opt-in, ``TierConfig.attend_in_place``). Anything else (eager or other kernels, softcapping, attention
sinks, dropout, several query tokens) is not planned: ``update`` reads and gathers as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from tiercache.attention import plan_placeholder

if TYPE_CHECKING:
    from tiercache.hf import TieredCache


class BlockAttentionPlan:
    """One layer's decode-step read and attention, deferred to the attention hook."""

    def __init__(self, cache: "TieredCache", layer_idx: int, keys: list, num_tokens: int, offset: int,
                 ahead: Sequence) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.keys = keys
        self.num_tokens = num_tokens
        self.offset = offset
        self.ahead = ahead

    def placeholder(self, key_states: torch.Tensor) -> tuple:
        """K/V that carry the plan (``tiercache.attention.plan_placeholder``)."""
        return plan_placeholder(self, key_states, self.num_tokens)

    def attend(self, query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor],
               scaling: Optional[float]) -> tuple:
        """What ``sdpa_attention_forward`` returns: ([B, q, Hq, D], None)."""
        cache = self.cache
        segments = cache.store.read_segments(self.keys, self.num_tokens, self.offset, ahead=self.ahead)
        cache.in_place_steps += 1
        cache._after_read(self.layer_idx, self.keys, self.offset, key, key, planned=True)
        return block_attention(query, segments, mask, scaling), None

    def prepare(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor], eager: bool) -> tuple:
        """The hook's fallback when this call is not one ``attend`` computes (see
        ``plain``): read and gather the layer as ``update`` would have."""
        cache = self.cache
        k, v = cache.store.read_layer(self.keys, self.num_tokens, self.offset, hold=True, ahead=self.ahead)
        k, v = cache._after_read(self.layer_idx, self.keys, self.offset, k, v, planned=True)
        return k, v, mask

    def finish(self, *args: Any) -> None:
        pass


def plain(module: Any, query: torch.Tensor, kwargs: dict) -> bool:
    """Is this SDPA call one that ``block_attention`` computes (the same formula, to float
    rounding)? One query token, no dropout, no logit softcapping, no attention sinks."""
    if query.shape[2] != 1 or (module.training and kwargs.get("dropout", 0.0)):
        return False
    if kwargs.get("softcap") or getattr(module.config, "attn_logit_softcapping", None):
        return False
    return not any(kwargs.get(name) is not None for name in ("s_aux", "sinks")) and getattr(module, "sinks", None) is None


def block_attention(query: torch.Tensor, segments: list, mask: Optional[torch.Tensor],
                    scaling: Optional[float]) -> torch.Tensor:
    """softmax(q K^T * scale + mask) V for one query token over K/V in segments.

    query: [B, Hq, 1, D]; segments: [(k, v)], each [B, Hkv, t, D] (Hq a multiple of Hkv:
    grouped query heads share a KV head); mask: None, or SDPA's [B|1, 1|Hq, 1, >=N] boolean
    (True: attend) or additive mask. Returns [B, 1, Hq, D] in the query's dtype."""
    b, hq, _, d = query.shape
    hkv = segments[0][0].shape[1]
    rep = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, hkv, rep, d).float()
    logits = torch.cat([torch.matmul(q, k.float().transpose(-1, -2)) for k, _ in segments], dim=-1)
    logits.mul_(scale)  # [B, Hkv, rep, N]
    n = logits.shape[-1]
    if mask is not None:
        row = mask[:, :, -1, :n]  # [B|1, 1|Hq, N]
        row = row.unsqueeze(2) if row.shape[1] == 1 else row.reshape(row.shape[0], hkv, rep, n)
        if row.dtype == torch.bool:
            logits.masked_fill_(~row, float("-inf"))
        else:
            logits.add_(row.float())
    probs = torch.softmax(logits, dim=-1)
    if mask is not None:  # a query that may see nothing (a padded row's first token): 0, as SDPA gives, not NaN
        blind = torch.isneginf(logits).all(dim=-1, keepdim=True)
        if blind.any():
            probs.masked_fill_(blind, 0.0)
    out = None
    lo = 0
    for _, v in segments:
        t = v.shape[2]
        part = torch.matmul(probs[..., lo:lo + t], v.float())
        out = part if out is None else out.add_(part)
        lo += t
    return out.to(query.dtype).reshape(b, hq, 1, d).transpose(1, 2).contiguous()
