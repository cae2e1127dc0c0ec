"""Quest-style page selection over the tiers: read only the pages that matter, lose nothing.

Per block (a page) the device keeps the element-wise min and max of the keys of each KV
head (``PageBounds``). At a decode step ``TieredCache.update`` of a full-attention layer
writes the new token but does not read the layer: it returns a placeholder K/V carrying a
``SelectionPlan``. tiercache's attention hook, which sees the query, calls
``plan.prepare``: the selection policy scores the pages from the bounds, the union of the
pages chosen by any (row, KV head) is made resident (fetched from host or disk as needed)
and gathered, and a per-head mask hides, for each KV head's query heads, the pages that
head did not choose. Prefill and other multi-token forwards read everything.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from tiercache.attention import as_mask, plan_placeholder, visible
from tiercache.guard import is_plugin, plugin_answer

if TYPE_CHECKING:
    from tiercache.hf import TieredCache
    from tiercache.policies import SelectionPolicy


class PageBounds:
    """Per layer, the element-wise min and max of each block's keys: ``[B, H_kv, P, D]`` each,
    on the device where the model runs. A cropped block keeps its old (looser) bounds: still
    an upper bound of its keys."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.kmin: dict = {}
        self.kmax: dict = {}

    def update(self, layer_idx: int, key_states: torch.Tensor, start: int) -> None:
        """Fold in ``key_states`` [B, H, q, D], the keys of stored tokens [start, start + q)."""
        bt = self.block_tokens
        b, h, q, d = key_states.shape
        first, lead = divmod(start, bt)
        num_blocks = -(-(lead + q) // bt)
        tail = num_blocks * bt - lead - q
        k = key_states.detach()
        pad = (0, 0, lead, tail)
        lo = torch.nn.functional.pad(k, pad, value=float("inf")).view(b, h, num_blocks, bt, d).amin(3)
        hi = torch.nn.functional.pad(k, pad, value=float("-inf")).view(b, h, num_blocks, bt, d).amax(3)
        kmin, kmax = self._room(layer_idx, first + num_blocks, k)
        if lead:  # the tail block already holds tokens
            lo[:, :, 0] = torch.minimum(lo[:, :, 0], kmin[:, :, first])
            hi[:, :, 0] = torch.maximum(hi[:, :, 0], kmax[:, :, first])
        kmin[:, :, first:first + num_blocks] = lo
        kmax[:, :, first:first + num_blocks] = hi

    def _room(self, layer_idx: int, num_blocks: int, like: torch.Tensor) -> tuple:
        kmin = self.kmin.get(layer_idx)
        if kmin is None or kmin.shape[2] < num_blocks or kmin.shape[0] != like.shape[0]:
            b, h, _, d = like.shape
            cap = max(num_blocks, 2 * (kmin.shape[2] if kmin is not None else 0), 8)
            new_min = torch.full((b, h, cap, d), float("inf"), dtype=like.dtype, device=like.device)
            new_max = torch.full((b, h, cap, d), float("-inf"), dtype=like.dtype, device=like.device)
            if kmin is not None and kmin.shape[0] == b:
                n = kmin.shape[2]
                new_min[:, :, :n], new_max[:, :, :n] = kmin, self.kmax[layer_idx]
            self.kmin[layer_idx], self.kmax[layer_idx] = new_min, new_max
        return self.kmin[layer_idx], self.kmax[layer_idx]

    def get(self, layer_idx: int, first: int, last: int) -> tuple:
        """Bounds of blocks [first, last): ``(kmin, kmax)``, each [B, H, last - first, D]."""
        return self.kmin[layer_idx][:, :, first:last], self.kmax[layer_idx][:, :, first:last]

    def reorder(self, rows: torch.Tensor) -> None:
        for table in (self.kmin, self.kmax):
            for layer_idx, t in table.items():
                table[layer_idx] = t.index_select(0, rows.to(t.device))

    def drop(self, layer_idx: int) -> None:
        self.kmin.pop(layer_idx, None)
        self.kmax.pop(layer_idx, None)


class SelectionPlan:
    """One layer's deferred read at one decode step (see the module docstring)."""

    def __init__(self, cache: "TieredCache", layer_idx: int, keys: list, num_tokens: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.keys = keys  # every block of the layer, in order (block i holds tokens i*T ...)
        self.num_tokens = num_tokens

    def placeholder(self, key_states: torch.Tensor) -> tuple:
        """K/V that carry the plan (``tiercache.attention.plan_placeholder``)."""
        return plan_placeholder(self, key_states, self.num_tokens)

    def prepare(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor], eager: bool) -> tuple:
        cache, bt = self.cache, self.cache.tier_config.block_tokens
        sel = cache.selection_state
        b, hq, q_len, d = query.shape
        hkv = key.shape[1]
        num_pages = len(self.keys)
        kmin, kmax = sel.bounds.get(self.layer_idx, 0, num_pages)
        grouped = query[:, :, -1].reshape(b, hkv, hq // hkv, d)  # [B, H_kv, R, D]
        seen = visible(mask, q_len, self.num_tokens, query.device)  # [B|1, 1|Hq, q, N]
        with torch.no_grad():
            chosen = self._choose(sel, grouped, kmin, kmax, seen, num_pages, bt)  # [B, H_kv, P]
        pages = chosen.any(dim=1).any(dim=0).nonzero().flatten().tolist()
        lengths = [min(bt, self.num_tokens - p * bt) for p in pages]
        keys = [self.keys[p] for p in pages]
        sel.note(len(pages), num_pages)
        cache._note_read(keys)
        k, v = cache.store.read_layer(keys, sum(lengths), 0)
        device = k.device
        cols = torch.cat([torch.arange(p * bt, p * bt + n, device=device) for p, n in zip(pages, lengths)])
        page_of = torch.repeat_interleave(torch.arange(len(pages), device=device),
                                          torch.tensor(lengths, device=device))
        k, v = cache._after_read(self.layer_idx, keys, 0, k, v)
        if len(pages) == num_pages and bool(chosen.all()):
            return k, v, mask  # every page, every head: exactly the full read
        cache._attended_in_part(self.layer_idx, q_len)  # not exact: kept out of the prefix cache
        per_head = chosen[:, :, pages][:, :, page_of]  # [B, H_kv, n]
        per_head = per_head.repeat_interleave(hq // hkv, dim=1).unsqueeze(2)  # [B, Hq, 1, n]
        vis = seen[..., cols] & per_head
        return k, v, as_mask(vis, eager, query.dtype)

    def _choose(self, sel: Any, grouped: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                seen: torch.Tensor, num_pages: int, bt: int) -> torch.Tensor:
        """The policy's pages, each row choosing among the pages where it sees a token: a
        left-padded row's leading pages of padding are not offered (its first visible page
        is its first page, the sink Quest keeps). Offered every page, such a row spent its
        forced first page, and with it one page of its budget, on padding at every step,
        and its tokens depended on the rest of the batch (a review). ``seen``: the step's
        visibility (``visible``)."""
        first = None
        if seen.shape[0] == grouped.shape[0]:  # per row (a padding mask, batch 1 too): the keys the last query sees
            seen = seen[:, :, -1].any(dim=1)  # [B, N]
            seen = torch.nn.functional.pad(seen, (0, num_pages * bt - seen.shape[-1]))
            pages_seen = seen.view(seen.shape[0], num_pages, bt).any(dim=-1)  # [B, P]
            first = pages_seen.to(torch.int8).argmax(dim=-1).tolist()  # first page a row sees (0 if none)
        if not first or not any(first):
            return sel.choose(grouped, kmin, kmax)
        chosen = torch.zeros(kmin.shape[:3], dtype=torch.bool, device=kmin.device)
        for f in sorted(set(first)):  # rows that see from the same page choose together
            rows = [r for r, fr in enumerate(first) if fr == f]
            chosen[rows, :, f:] = sel.choose(grouped[rows], kmin[rows, :, f:], kmax[rows, :, f:])
        return chosen

    def finish(self, *args: Any) -> None:
        pass


class SelectionState:
    """The cache's selection machinery: the policy, the page bounds and counters."""

    def __init__(self, policy: "SelectionPolicy", budget_tokens: int, block_tokens: int, name: str = "") -> None:
        self.policy = policy
        self.name = name or policy.name  # as registered
        self.plugin = is_plugin(policy)  # its answers are checked (``choose``)
        self.budget_pages = budget_tokens // block_tokens
        self.bounds = PageBounds(block_tokens)
        self.steps = 0
        self.pages_read = 0
        self.pages_total = 0

    def choose(self, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
        """The policy's pages ([B, H_kv, P] bool); a plug-in's answer checked first
        (``tiercache.guard``): a (row, KV head) that read no page, or not the newest (the
        step's own token), would attend to nothing, or not to itself."""
        policy, budget = self.policy, self.budget_pages
        if not self.plugin:
            return policy.choose(query, key_min, key_max, budget)
        return plugin_answer("selection", self.name, "choose", lambda: policy.choose(query, key_min, key_max, budget),
                             lambda answer: _choice_breach(answer, tuple(key_min.shape[:3])))

    def note(self, pages_read: int, pages_total: int) -> None:
        self.steps += 1
        self.pages_read += pages_read
        self.pages_total += pages_total

    def stats(self) -> dict:
        return {"policy": self.name, "budget_pages": self.budget_pages, "layer_steps": self.steps,
                "pages_read": self.pages_read, "pages_total": self.pages_total}


def _choice_breach(chosen: Any, shape: tuple) -> str:
    """What is wrong with ``choose``'s answer (``SelectionPolicy``'s contract), or ""."""
    if not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.bool:
        dtype = getattr(chosen, "dtype", "")
        return f"it returned {type(chosen).__name__} {dtype}, not a bool tensor".replace("  ", " ")
    if tuple(chosen.shape) != shape:
        return f"it returned pages of shape {tuple(chosen.shape)}, not [B, H_kv, P] = {shape}"
    if not bool(chosen[..., -1].all()):
        return "every row and KV head must read the newest page (it holds the step's own token)"
    return ""
