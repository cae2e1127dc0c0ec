"""Retention policies: which tokens a layer keeps for good when its cache exceeds the budget.

Lossy: a dropped token never comes back. A policy decides from per-token scores that the
runtime recomputes from the attention weights (SDPA does not return them) and returns the
indices of the tokens to keep; the runtime compacts the cache. torch is imported lazily.

Scores are [B, H_kv, N] (per batch row and KV head; a group's query heads are summed).
``score_rows`` says which query rows' attention the policy needs:
  "none": no scores (streaming);  "all": every query row, accumulated over steps (h2o);
  "last": the last query row of each forward (tova);  "window": the last ``window`` rows
  of a multi-token forward, at the end of the prompt (snapkv).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional


def _sorted(index: Any) -> Any:
    return index.sort(dim=-1).values


class RetentionPolicy(ABC):
    """Decides which tokens of one layer stay; ``keep`` returns sorted indices [B, H_kv, budget]."""

    name: str = ""
    score_rows: str = "none"
    prompt_only: bool = False  # compress once, when the prompt ends (snapkv)

    def min_budget(self) -> int:
        """The smallest budget (tokens) the policy can work with."""
        return 1

    def combine(self, previous: Optional[Any], mass: Any) -> Any:
        """Merge this forward's attention mass [B, H, N] into the stored scores (aligned already)."""
        return mass

    @abstractmethod
    def keep(self, scores: Optional[Any], valid: Any, budget: int) -> Any:
        """Indices (sorted, per row and KV head) of the ``budget`` tokens to keep:
        [B, H_kv, budget] integers, distinct, the last the newest token (N - 1), which the
        step being decoded attends to. A plug-in's answer is checked against this.

        scores: [B, H_kv, N] floats or None; valid: [B, H_kv, N] bool (False: a padding token,
        invisible to attention anyway, so the first to go). Tokens are in arrival order.
        """


def _arange_keep(valid: Any, index: Any) -> Any:
    b, h, _ = valid.shape
    return index.to(valid.device).view(1, 1, -1).expand(b, h, -1).contiguous()


class StreamingRetention(RetentionPolicy):
    """StreamingLLM (Xiao et al., 2023): the first ``sinks`` tokens and the newest ``budget - sinks``."""

    name = "streaming"

    def __init__(self, sinks: int = 4) -> None:
        if sinks < 0:
            raise ValueError(f"streaming needs sinks >= 0, got {sinks!r}")
        self.sinks = sinks

    def min_budget(self) -> int:
        return self.sinks + 1

    def keep(self, scores: Optional[Any], valid: Any, budget: int) -> Any:
        """The sinks are each row's first *visible* tokens: in a left-padded row the first
        tokens are padding, which attention never sees (keeping them spent the row's sink
        slots on nothing and dropped its real first tokens)."""
        import torch

        n = valid.shape[-1]
        sinks = min(self.sinks, budget)
        older = n - (budget - sinks)
        tail = torch.arange(older, n, device=valid.device).view(1, 1, -1).expand(*valid.shape[:2], -1)
        if not sinks:
            return tail.contiguous()
        order = torch.arange(older, device=valid.device).view(1, 1, -1) + (~valid[..., :older]).long() * n
        first = order.topk(sinks, dim=-1, largest=False).indices  # visible first, in order
        return _sorted(torch.cat([first, tail], dim=-1))


def _top_with_recent(scores: Any, valid: Any, budget: int, recent: int) -> Any:
    """The newest ``recent`` tokens plus the ``budget - recent`` best-scoring older ones."""
    import torch

    n = scores.shape[-1]
    recent = min(recent, budget)
    older = n - recent
    ranked = scores[..., :older].float().masked_fill(~valid[..., :older], float("-inf"))
    top = ranked.topk(budget - recent, dim=-1).indices
    tail = torch.arange(older, n, device=scores.device).view(1, 1, -1).expand(*scores.shape[:2], -1)
    return _sorted(torch.cat([top, tail], dim=-1))


class H2ORetention(RetentionPolicy):
    """H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window.

    Each token's score is the attention it received from every query so far (all prefill
    rows, then each decode step), per KV head; ``recent_fraction`` of the budget keeps the
    newest tokens, the rest the heaviest older ones.
    """

    name = "h2o"
    score_rows = "all"

    def __init__(self, recent_fraction: float = 0.5) -> None:
        if not 0.0 <= recent_fraction < 1.0:
            raise ValueError(f"h2o needs 0 <= recent_fraction < 1, got {recent_fraction!r}")
        self.recent_fraction = recent_fraction

    def min_budget(self) -> int:
        return 2

    def combine(self, previous: Optional[Any], mass: Any) -> Any:
        return mass if previous is None else previous + mass

    def keep(self, scores: Optional[Any], valid: Any, budget: int) -> Any:
        return _top_with_recent(scores, valid, budget, max(1, int(budget * self.recent_fraction)))


class TOVARetention(RetentionPolicy):
    """TOVA (Oren et al., 2024): keep the tokens the last query attends to most.

    The score is the last query row's attention averaged over the layer's heads, so every
    head of a layer keeps the same tokens; the newest token is always kept.
    """

    name = "tova"
    score_rows = "last"

    def keep(self, scores: Optional[Any], valid: Any, budget: int) -> Any:
        mean = scores.float().mean(dim=1, keepdim=True).expand_as(scores)
        return _top_with_recent(mean, valid, budget, 1)


class SnapKVRetention(RetentionPolicy):
    """SnapKV (Li et al., 2024): at the end of the prompt, keep the prompt tokens that the last
    ``window`` prompt tokens (the observation window) attend to most, pooled over
    ``kernel`` neighbouring positions, plus the window itself. Decode tokens are then
    appended without further drops (the cache grows past the budget, as in the paper)."""

    name = "snapkv"
    score_rows = "window"
    prompt_only = True

    def __init__(self, window: int = 32, kernel: int = 7) -> None:
        if window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"snapkv needs window >= 1 and an odd kernel >= 1, got {window!r}, {kernel!r}")
        self.window = window
        self.kernel = kernel

    def min_budget(self) -> int:
        return 2

    def window_for(self, budget: int) -> int:
        return max(1, min(self.window, budget // 2))

    def keep(self, scores: Optional[Any], valid: Any, budget: int) -> Any:
        """Pooled over each token's visible neighbours only: a left-padded row's first real
        tokens were averaged with the padding's zero scores, so the row kept other tokens
        than it keeps alone (8.2 in its logits, in a helper's batch test)."""
        import torch

        b, h, n = scores.shape
        pool = dict(kernel_size=self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)
        seen = valid.float().reshape(b * h, 1, n)
        total = torch.nn.functional.avg_pool1d(scores.float().reshape(b * h, 1, n) * seen, **pool)
        count = torch.nn.functional.avg_pool1d(seen, **pool)  # the same divisor: their ratio is a mean
        pooled = (total / count.clamp_min(1e-12)).view(b, h, n)
        return _top_with_recent(pooled, valid, budget, self.window_for(budget))
