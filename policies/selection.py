"""Selection policies: which pages (blocks) attention reads at a decode step.

Nothing is dropped: a page that is not read this step stays in the cache and can be read
the next one. A policy decides from per-page key bounds and the step's query; it returns a
boolean page mask and touches no storage. torch is imported lazily (``import tiercache``
stays cheap).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class SelectionPolicy(ABC):
    """Chooses, per batch row and KV head, which pages of one layer attention reads.

    ``choose(query, key_min, key_max, budget_pages)``:
      query:   [B, H_kv, R, D]  the step's query heads grouped by the KV head they share (R per group)
      key_min, key_max: [B, H_kv, P, D]  element-wise bounds of the keys in each of the P pages
      budget_pages: how many pages each (row, KV head) may read
    returns a bool tensor [B, H_kv, P]: True where that (row, KV head) reads the page.
    """

    name: str = ""
    needs_bounds: bool = False

    @abstractmethod
    def choose(self, query: Any, key_min: Any, key_max: Any, budget_pages: int) -> Any:
        """The pages to read (see the class docstring)."""


class FullSelection(SelectionPolicy):
    """Read every page: exact attention (the default)."""

    name = "full"

    def choose(self, query: Any, key_min: Any, key_max: Any, budget_pages: int) -> Any:
        import torch

        b, h, p = key_min.shape[0], key_min.shape[1], key_min.shape[2]
        return torch.ones(b, h, p, dtype=torch.bool, device=key_min.device)


class QuestSelection(SelectionPolicy):
    """Quest (Tang et al., 2024): read the pages whose keys can score highest against the query.

    Per page the upper bound of q·k over its keys is ``sum_i max(q_i * min_i, q_i * max_i)``;
    a KV head group takes the largest bound over its query heads. Each (row, KV head) reads
    its first ``sink_pages`` pages (attention sinks), its newest ``recent_pages`` pages (the
    page being written holds the current token), and the top-scoring other pages up to
    ``budget_pages`` in all.
    """

    name = "quest"
    needs_bounds = True

    def __init__(self, sink_pages: int = 1, recent_pages: int = 1) -> None:
        if sink_pages < 0 or recent_pages < 1:
            raise ValueError(f"quest needs sink_pages >= 0 and recent_pages >= 1, got {sink_pages!r}, {recent_pages!r}")
        self.sink_pages = sink_pages
        self.recent_pages = recent_pages

    @staticmethod
    def page_scores(query: Any, key_min: Any, key_max: Any) -> Any:
        """Upper bound of q·k per page: [B, H_kv, P] (max over the group's R query heads)."""
        import torch

        q = query.float().unsqueeze(3)  # [B, H, R, 1, D]
        lo, hi = key_min.float().unsqueeze(2), key_max.float().unsqueeze(2)  # [B, H, 1, P, D]
        bound = torch.maximum(q * lo, q * hi).sum(-1)  # [B, H, R, P]
        return bound.amax(dim=2)

    def choose(self, query: Any, key_min: Any, key_max: Any, budget_pages: int) -> Any:
        import torch

        b, h, p = key_min.shape[0], key_min.shape[1], key_min.shape[2]
        chosen = torch.zeros(b, h, p, dtype=torch.bool, device=key_min.device)
        if budget_pages >= p:
            return chosen.fill_(True)
        forced = torch.zeros(p, dtype=torch.bool, device=key_min.device)
        forced[:min(self.sink_pages, p)] = True
        forced[max(p - self.recent_pages, 0):] = True
        num_top = budget_pages - int(forced.sum())
        chosen |= forced
        if num_top > 0:
            scores = self.page_scores(query, key_min, key_max).masked_fill(forced, float("-inf"))
            top = scores.topk(num_top, dim=-1).indices  # [B, H, num_top]
            chosen.scatter_(-1, top, True)
        return chosen
