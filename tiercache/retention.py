"""Lossy retention over the tiers: full-attention layers keep at most ``retention_budget`` tokens.

Each retained layer stores its kept tokens compacted, per (batch row, KV head), in arrival
order; ``LayerState`` remembers each stored token's absolute position, whether it is a
padding token, and the policy's scores. The bookkeeping that keeps masks and positions
right:

- ``get_seq_length()`` stays the absolute token count, so position ids (RoPE) are right;
- ``get_mask_sizes`` reports the compacted size ``stored + q`` with ``kv_offset = absolute -
  stored``: the mask's last q columns are then exactly the new tokens at their absolute
  indices (causality and padding among them are right), and the hook (``RetentionPlan``)
  replaces the first ``stored`` columns by the stored tokens' own visibility (a stored
  padding token stays hidden), per KV head;
- after attention the hook recomputes the attention weights the policy scores tokens by
  (SDPA does not return them; long prompts are scored a chunk of rows at a time) and the
  layer is compacted to the budget. SnapKV decides at the end of each prompt forward and
  compacts when the next forward is a decode step (a following prompt chunk cancels it).
  Its observation window is the prompt's last ``window`` tokens however the prompt was cut
  into chunks: each layer keeps the queries (and visibility) of the last window rows of
  the chunk before, so that a short last chunk (one token, two) scores with the whole
  window, as the prompt computed at once does. Where generate() told the prompt's length
  (``wrap()``), a one-token chunk is prompt; else a forward of one token is a decode step.

Sliding-window layers keep their window and are not touched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from tiercache.attention import PLAN_ATTR, as_mask, attention_mass, visible
from tiercache.guard import is_plugin, plugin_answer

if TYPE_CHECKING:
    from tiercache.hf import TieredCache, TieredLayer
    from tiercache.policies import RetentionPolicy


class LayerState:
    """What a retained layer knows about each stored token: [B, H_kv, stored] each."""

    def __init__(self) -> None:
        self.positions: Optional[torch.Tensor] = None  # absolute position (long)
        self.valid: Optional[torch.Tensor] = None  # False: a padding token
        self.scores: Optional[torch.Tensor] = None  # the policy's scores (float), when it keeps any
        self.pending: Optional[torch.Tensor] = None  # snapkv: indices to keep once the prompt ended
        # snapkv: the queries [B, Hq, <=w, D] and visibility [B|1, 1|Hq, <=w, N] of the last
        # window rows of the prompt computed so far (``RetentionState._observed``)
        self.window: Optional[tuple] = None

    def append(self, start: int, batch: int, heads: int, q: int, device: torch.device) -> None:
        pos = torch.arange(start, start + q, device=device).view(1, 1, q).expand(batch, heads, q)
        ok = torch.ones(batch, heads, q, dtype=torch.bool, device=device)
        self.positions = pos.clone() if self.positions is None else torch.cat([self.positions, pos], -1)
        self.valid = ok if self.valid is None else torch.cat([self.valid, ok], -1)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, torch.zeros(batch, heads, q, device=device)], -1)

    def keep(self, index: torch.Tensor) -> None:
        self.positions = self.positions.gather(-1, index)
        self.valid = self.valid.gather(-1, index)
        if self.scores is not None:
            self.scores = self.scores.gather(-1, index)
        self.pending = None
        self.window = None

    def crop(self, stored: int) -> None:
        """The layer's tokens from ``stored`` on were removed (before any was dropped: stored
        index = position). A pending snapkv choice that names one of them is forgotten, as
        when more prompt arrives. The state was left as it was, and the next forward failed
        inside torch on mismatched sizes (assisted generation with snapkv always did)."""
        for name in ("positions", "valid", "scores"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[..., :stored])
        if self.pending is not None and bool((self.pending >= stored).any()):
            self.pending = None
        self.window = None  # rows of a prompt whose end was cut off

    def reorder(self, rows: torch.Tensor) -> None:
        for name in ("positions", "valid", "scores", "pending"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows.to(t.device)))
        if self.window is not None:
            self.window = tuple(t if t.shape[0] == 1 else t.index_select(0, rows.to(t.device))
                                for t in self.window)


class RetentionPlan:
    """One retained layer at one forward: fix the mask before attention, score and compact after."""

    def __init__(self, cache: "TieredCache", layer_idx: int, num_past: int, values: torch.Tensor) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.num_past = num_past
        self.values = values
        self.vis: Optional[torch.Tensor] = None

    def prepare(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor], eager: bool) -> tuple:
        state = self.cache.retention_state.layers[self.layer_idx]
        b, hq, q_len, _ = query.shape
        hkv, n = key.shape[1], key.shape[2]
        s = self.num_past
        vis = visible(mask, q_len, n, key.device)  # [B|1, 1, q, N]
        # A padding token does not see itself: learn which new tokens are padding.
        diag = vis[:, 0, torch.arange(q_len), s + torch.arange(q_len)]  # [B|1, q]
        state.valid[:, :, s:] = diag.view(diag.shape[0], 1, q_len).expand(b, hkv, q_len)
        if self.cache.layers[self.layer_idx].dropped == 0:
            self.vis = vis  # nothing dropped yet: the model's own mask is exact
            return key, value, mask
        past = state.valid[:, :, :s]
        if bool(past.all()):
            past_vis = torch.ones(1, 1, q_len, s, dtype=torch.bool, device=key.device)
            new_vis = vis[..., s:]
            self.vis = torch.cat([past_vis.expand(new_vis.shape[0], -1, -1, -1), new_vis], -1)
        else:  # per KV head: stored padding tokens stay hidden
            past_vis = past.repeat_interleave(hq // hkv, dim=1).unsqueeze(2).expand(b, hq, q_len, s)
            self.vis = torch.cat([past_vis, vis[..., s:].expand(b, hq, q_len, n - s)], -1)
        return key, value, as_mask(self.vis, eager, query.dtype)

    def finish(self, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any,
               scaling: Optional[float], softcap: Optional[float]) -> None:
        self.cache.retention_state.after_attention(self, query, key, self.values, scaling, softcap)


class RetentionState:
    """The cache's retention machinery: the policy, the budget and each full layer's state."""

    def __init__(self, cache: "TieredCache", policy: "RetentionPolicy", budget: int, name: str = "") -> None:
        self.cache = cache
        self.policy = policy
        self.budget = budget
        self.name = name or policy.name  # as registered
        self.plugin = is_plugin(policy)  # its answers are checked (``_keep``)
        self.layers: dict = {}  # layer_idx -> LayerState
        self.dropped_tokens = 0
        self.compactions = 0

    def applies(self, layer: "TieredLayer") -> bool:
        return not layer.is_sliding

    def state(self, layer_idx: int) -> LayerState:
        return self.layers.setdefault(layer_idx, LayerState())

    def positions(self, layer_idx: int) -> Optional[torch.Tensor]:
        """Absolute positions of the tokens layer ``layer_idx`` keeps: [B, H_kv, stored]."""
        state = self.layers.get(layer_idx)
        return None if state is None else state.positions

    def settle(self, query_length: int, prompt: Optional[bool] = None) -> None:
        """At the start of a forward: apply pending snapkv compactions if it is a decode step,
        forget them if more prompt arrives. ``prompt``: whether the forward computes prompt
        tokens, where generate() told the prompt's length (``TieredCache._prompt_coming``);
        None where it did not: a forward of one token is then a decode step. (Assisted
        generation's every forward checks several candidate tokens, so it never cuts:
        ``TieredCache`` warns at its first crop.)"""
        for layer_idx, state in self.layers.items():
            if state.window is not None and (prompt is False or (prompt is None and query_length == 1)):
                state.window = None  # the prompt ended: its rows are not needed
            if state.pending is None:
                continue
            if query_length != 1 or prompt:
                state.pending = None
                continue
            layer = self.cache.layers[layer_idx]
            stored = layer.num_tokens - layer.dropped
            keys = self.cache._blocks_of(layer_idx)
            k, v = self.cache.store.read_layer(keys, stored, 0)
            self.compact(layer_idx, state.pending, k, v)

    def after_attention(self, plan: RetentionPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scaling: Optional[float], softcap: Optional[float]) -> None:
        policy, budget = self.policy, self.budget
        state = self.layers[plan.layer_idx]
        q_len, n = query.shape[2], key.shape[2]
        rows = {"none": None, "all": slice(0, q_len), "last": slice(q_len - 1, q_len),
                "window": slice(max(q_len - policy.window_for(budget), 0), q_len) if q_len > 1 and hasattr(
                    policy, "window_for") else None}[policy.score_rows]
        if policy.prompt_only and not self.cache._prompt_forward:
            return
        vis = plan.vis
        if policy.prompt_only and policy.score_rows == "window":
            query, vis = self._observed(state, query, vis, policy.window_for(budget), n)
            rows = slice(max(query.shape[2] - policy.window_for(budget), 0), query.shape[2])
        if policy.prompt_only and n <= budget:
            return
        scores = None
        if rows is not None:
            with torch.no_grad():
                mass = attention_mass(query, key, vis, scaling, softcap, rows)
            previous = state.scores if policy.score_rows == "all" else None
            scores = state.scores = self._combine(previous, mass)
        if n <= budget:
            return
        with torch.no_grad():
            index = self._keep(scores, state.valid, budget)
        if policy.prompt_only:
            state.pending = index
            return
        self.compact(plan.layer_idx, index, key, value)

    @staticmethod
    def _observed(state: LayerState, query: torch.Tensor, vis: torch.Tensor, window: int, n: int) -> tuple:
        """A prompt forward's query rows and their visibility, after the rows of the prompt
        before it that the observation window still reaches (their keys are all stored: a
        prompt_only policy drops nothing before the prompt ends); the last ``window`` of
        them are kept for the next chunk. An earlier row sees none of the keys stored
        after it (attention is causal), hence the False columns it gets."""
        q_len = query.shape[2]
        before = state.window
        if before is not None and q_len < window:
            q0, v0 = before
            q0, v0 = q0[:, :, q_len - window:], v0[:, :, q_len - window:]
            v0 = torch.nn.functional.pad(v0, (0, n - v0.shape[-1]), value=False)
            shape = (max(v0.shape[0], vis.shape[0]), max(v0.shape[1], vis.shape[1]))
            vis = torch.cat([v0.expand(*shape, -1, -1), vis.expand(*shape, -1, -1)], 2)
            query = torch.cat([q0.to(query.dtype), query], 2)
        # copies: views kept the whole chunk's queries and mask alive until decoding (a review)
        state.window = (query[:, :, -window:].detach().clone(), vis[:, :, -window:].clone())
        return query, vis

    def _combine(self, previous: Optional[torch.Tensor], mass: torch.Tensor) -> torch.Tensor:
        """The policy's ``combine``; a plug-in's exception named (``tiercache.guard``)."""
        if not self.plugin:
            return self.policy.combine(previous, mass)
        return plugin_answer("retention", self.name, "combine", lambda: self.policy.combine(previous, mass),
                             lambda answer: _combine_breach(answer, mass))

    def _keep(self, scores: Optional[torch.Tensor], valid: torch.Tensor, budget: int) -> torch.Tensor:
        """The policy's ``keep``; a plug-in's answer checked first (``tiercache.guard``)."""
        if not self.plugin:
            return self.policy.keep(scores, valid, budget)
        index = plugin_answer("retention", self.name, "keep", lambda: self.policy.keep(scores, valid, budget),
                              lambda answer: _keep_breach(answer, valid, budget))
        return index.long()

    def compact(self, layer_idx: int, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep the tokens ``index`` [B, H, budget] of the layer whose stored K/V are key/value."""
        d = key.shape[-1]
        gather = index.unsqueeze(-1).expand(-1, -1, -1, d).to(key.device)
        k, v = key.gather(2, gather), value.gather(2, gather)
        layer = self.cache.layers[layer_idx]
        before = layer.num_tokens - layer.dropped
        self.cache._rewrite_layer(layer_idx, k, v)
        self.layers[layer_idx].keep(index)
        layer.dropped = layer.num_tokens - k.shape[2]
        self.dropped_tokens += before - k.shape[2]
        self.compactions += 1

    def reorder(self, rows: torch.Tensor) -> None:
        for state in self.layers.values():
            state.reorder(rows)

    def drop(self, layer_idx: int) -> None:
        self.layers.pop(layer_idx, None)

    def stats(self) -> dict:
        kept = {i: self.cache.layers[i].num_tokens - self.cache.layers[i].dropped for i in self.layers}
        return {"policy": self.name, "budget_tokens": self.budget, "dropped_tokens": self.dropped_tokens,
                "compactions": self.compactions, "kept_tokens": kept}


def attach(plan: RetentionPlan, keys: torch.Tensor) -> torch.Tensor:
    setattr(keys, PLAN_ATTR, plan)
    return keys


def _combine_breach(answer: object, mass: torch.Tensor) -> str:
    """What is wrong with a plug-in's ``combine`` answer, or "": scores like this forward's
    attention mass, floats of its shape [B, H_kv, N] (one was taken unchecked: a torch error
    from deep inside the cache's books, or a PolicyError blaming ``keep``; a review)."""
    if not isinstance(answer, torch.Tensor):
        return f"it returned {type(answer).__name__}, not a tensor of scores"
    if tuple(answer.shape) != tuple(mass.shape):
        return (f"it returned scores of shape {list(answer.shape)}, not [B, H_kv, N] = {list(mass.shape)} "
                f"(one per batch row, KV head and token)")
    if not answer.is_floating_point():
        return f"it returned {answer.dtype} scores, not floats"
    return ""


def _keep_breach(index: Any, valid: torch.Tensor, budget: int) -> str:
    """What is wrong with ``keep``'s answer (``RetentionPolicy.keep``'s contract), or ""."""
    b, h, n = valid.shape
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype.is_complex \
            or index.dtype == torch.bool:
        return (f"it returned {type(index).__name__} {getattr(index, 'dtype', '')}, not a tensor of token "
                f"indices (integers)").replace("  ", " ")
    if tuple(index.shape) != (b, h, budget):
        return f"it returned indices of shape {tuple(index.shape)}, not [B, H_kv, budget] = {(b, h, budget)}"
    index = index.to(valid.device)
    ok = (index[..., 0] >= 0).all() & (index[..., 1:] > index[..., :-1]).all() & (index[..., -1] == n - 1).all()
    if not bool(ok):
        return (f"the indices must be distinct and sorted per row and KV head, within the {n} tokens stored, "
                f"and end with the newest token ({n - 1})")
    return ""
