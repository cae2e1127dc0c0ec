"""``tiercache compare``: every chosen policy on one trace, at every device budget.

Runtime policies are replayed by ``tiercache.lab.sim`` (the registered policy classes
themselves); libCacheSim's algorithms, Belady's optimum among them, replay the same CSV file
through libCacheSim's own reader. ``record_trace`` runs a real generation to make a trace, and
``live_runs`` runs each policy for real, reporting measured tokens/s and stall time.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any, Callable, Optional

from tiercache.config import PREFETCH_DEPTH_POLICIES, TierConfig, format_bytes
from tiercache.lab.sim import Bandwidths, InfeasibleBudget, replay
from tiercache.lab.trace import Trace
from tiercache.policies import EVICTION_POLICIES, PREFETCH_POLICIES

LIBCACHESIM_DEFAULT = ("lru", "fifo", "lfu", "arc", "s3fifo", "belady")


def bandwidths_from_io(result: dict) -> Bandwidths:
    """Link rates from a ``tiercache bench io --json`` object (the store's own measured rates)."""
    rates = {}
    for name in ("h2d_gbps", "d2h_gbps", "read_gbps", "write_gbps"):
        try:
            value = result[name]
        except (KeyError, TypeError):
            raise ValueError(f"--io-json: not the output of `tiercache bench io --json` (no {name!r})") from None
        # a rate of 0 divided by zero in the replay; NaN or infinity made its JSON invalid;
        # a negative one gave negative stall seconds; true passed as 1 GB/s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"--io-json: {name} must be a positive number of GB/s, got {value!r}")
        rates[name] = float(value) * 1e9
    return Bandwidths(host_to_device=rates["h2d_gbps"], device_to_host=rates["d2h_gbps"],
                      disk_read=rates["read_gbps"], disk_write=rates["write_gbps"])


def measure_bandwidths(directory: Optional[str], block_tokens: int = 1024, total_bytes: int = 64 << 20) -> Bandwidths:
    """Measure the store's link rates now with a short ``bench io`` run in ``directory``."""
    from tiercache.bench.io import measure_io

    with tempfile.TemporaryDirectory(prefix="tiercache-compare-", dir=directory) as tmp:
        return bandwidths_from_io(measure_io(tmp, block_tokens, total_bytes, workers=4))


def load_bandwidths(io_json: Optional[str], directory: Optional[str]) -> Bandwidths:
    if io_json is None:
        return measure_bandwidths(directory)
    try:
        with open(io_json, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--io-json: cannot read {io_json!r} ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--io-json: {io_json!r} is not JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--io-json: {io_json!r} is not JSON (not UTF-8 text)") from None
    if isinstance(data, dict) and "results" in data and isinstance(data["results"], list):
        if not data["results"]:
            raise ValueError(f"--io-json: {io_json!r} holds a sweep with no results")
        data = data["results"][0]  # a sweep: the first (default) block size
    return bandwidths_from_io(data)


def check_names(policies: list, prefetches: list, libcachesim: list) -> None:
    for name in policies:
        if name not in EVICTION_POLICIES:
            raise ValueError(f"--policies: unknown eviction policy {name!r}; "
                             f"known: {', '.join(sorted(EVICTION_POLICIES))}")
    for name in prefetches:
        if name not in PREFETCH_POLICIES:
            raise ValueError(f"--prefetch-policies: unknown prefetch policy {name!r}; "
                             f"known: {', '.join(sorted(PREFETCH_POLICIES))}")
    if libcachesim:
        from tiercache.lab.libcsim import LIBCACHESIM_ALGORITHMS
        for name in libcachesim:
            if name not in LIBCACHESIM_ALGORITHMS:
                raise ValueError(f"--libcachesim: unknown algorithm {name!r}; known: "
                                 f"{', '.join(sorted(LIBCACHESIM_ALGORITHMS))}")


def compare_trace(trace: Trace, policies: list, budgets: list, *, prefetches: tuple = ("none",),
                  host_budget: Optional[int] = None, bandwidths: Bandwidths,
                  libcachesim: tuple = LIBCACHESIM_DEFAULT, prefetch_depth: int = 2,
                  label: Optional[str] = None) -> dict:
    """Replay ``trace`` through each runtime policy (with each prefetch policy) and each
    libCacheSim algorithm at each device budget; one result dict per combination."""
    check_names(policies, list(prefetches), list(libcachesim))
    label = label or os.path.basename(trace.path)
    results, skipped = [], []
    for budget in budgets:
        for prefetch in prefetches:
            for policy in policies:
                try:
                    r = replay(trace, policy, budget, host_budget=host_budget, prefetch=prefetch,
                               prefetch_depth=prefetch_depth, bandwidths=bandwidths)
                except InfeasibleBudget as exc:
                    skipped.append({"policy": policy, "prefetch": prefetch, "budget_bytes": budget,
                                    "reason": str(exc), "min_budget_bytes": exc.min_budget_bytes})
                    continue
                r["trace"] = label
                r["bytes_per_token_total"] = r["bytes_moved"] / max(trace.total_tokens, 1)
                results.append(r)
    if libcachesim:
        from tiercache.lab.libcsim import replay_libcachesim
        for r in replay_libcachesim(trace.path, list(libcachesim), list(budgets), skipped=skipped):
            r["trace"] = label
            r.setdefault("prefetch", "none")
            r.setdefault("bytes_moved", r.get("bytes_missed", 0))
            r["bytes_per_token_total"] = r["bytes_moved"] / max(trace.total_tokens, 1)
            results.append(r)
    return {"trace": trace.path, "label": label, "requests": len(trace), "block_bytes": trace.block_bytes,
            "tokens": trace.total_tokens, "num_layers": trace.num_layers,
            "bandwidths_gbps": {k: round(v / 1e9, 3) for k, v in bandwidths.__dict__.items()},
            "host_budget_bytes": host_budget, "results": results, "skipped": skipped}


def record_trace(prompt: str, config: TierConfig, trace_out: str, *, model_path: Optional[str] = None,
                 max_new_tokens: int = 32, chat: bool = True, progress: bool = False,
                 model: Any = None, tokenizer: Any = None) -> dict:
    """Generate from ``prompt`` with a trace recorded to ``trace_out``; returns the run."""
    from tiercache.generation import generate_text

    return generate_text(prompt, config, model_path=model_path, max_new_tokens=max_new_tokens, chat=chat,
                         progress=progress, model=model, tokenizer=tokenizer, trace_out=trace_out)


def live_runs(prompt: str, base: TierConfig, policies: list, budgets: list, prefetches: tuple, *,
              model: Any, tokenizer: Any, max_new_tokens: int = 32, chat: bool = True,
              log: Optional[Callable[[str], None]] = None) -> list:
    """Run generation for real with each policy, prefetch policy and device budget."""
    from dataclasses import replace

    from tiercache.errors import CapacityError
    from tiercache.generation import generate_text

    out = []
    for budget in budgets:
        for prefetch in prefetches:
            for policy in policies:
                # base's prefetch_depth only where this prefetch reads one: "none" with a depth is refused
                depth = base.prefetch_depth if prefetch in PREFETCH_DEPTH_POLICIES else TierConfig.prefetch_depth
                try:  # a budget under one block: that row's error, as the replay skips it (was: the whole run lost)
                    cfg = replace(base, device_budget=budget, eviction=policy, prefetch=prefetch, prefetch_depth=depth)
                except ValueError as exc:
                    out.append({"policy": policy, "prefetch": prefetch, "budget_bytes": budget, "error": str(exc)})
                    continue
                try:
                    run = generate_text(prompt, cfg, max_new_tokens=max_new_tokens, chat=chat, progress=False,
                                        model=model, tokenizer=tokenizer)
                except CapacityError as exc:
                    out.append({"policy": policy, "prefetch": prefetch, "budget_bytes": budget,
                                "error": str(exc)})
                    continue
                s, sec = run["stats"], run["seconds"]
                row = {"policy": policy, "prefetch": prefetch, "budget_bytes": budget,
                       "decode_tps": s["decode_tokens"] / max(sec["decode"], 1e-9),
                       "stall_seconds": s["stall_seconds"], "hits": s["hits"],
                       "bytes_moved": sum(m["bytes"] for m in s["moves"].values())}
                out.append(row)
                if log:
                    log(f"live {policy}+{prefetch} @ {format_bytes(budget)}: {row['decode_tps']:.2f} tok/s, "
                        f"stall {row['stall_seconds']:.2f} s")
    return out


def table(report: dict) -> str:
    """Plain-text results: one line per policy, prefetch and budget."""
    lines = [f"trace {report['label']}: {report['requests']} requests, {report['tokens']} tokens, "
             f"block {format_bytes(report['block_bytes'])}, {report['num_layers']} layers; links (GB/s) "
             f"{report['bandwidths_gbps']}",
             f"{'policy':<22} {'prefetch':<11} {'budget':>10} {'hit':>6} {'host':>6} {'disk':>6} "
             f"{'B/token':>10} {'late':>5} {'unused':>6} {'stall s':>8}"]
    for r in sorted(report["results"], key=lambda r: (r["budget_bytes"], r.get("prefetch", ""), r["policy"])):
        tiers = r.get("tier_hit_ratio", {})
        pf = r.get("prefetches", {})
        stall = r.get("est_stall_seconds")
        lines.append(
            f"{r['policy']:<22} {r.get('prefetch', 'none'):<11} {format_bytes(r['budget_bytes']):>10} "
            f"{r['hit_ratio']:>6.3f} {tiers.get('host', float('nan')):>6.3f} {tiers.get('disk', float('nan')):>6.3f} "
            f"{format_bytes(int(r['bytes_per_token_total'])):>10} {pf.get('late', '-'):>5} {pf.get('unused', '-'):>6} "
            f"{'-' if stall is None else f'{stall:.3f}':>8}")
    for s in report["skipped"]:
        lines.append(f"skipped {s['policy']}+{s['prefetch']} @ {format_bytes(s['budget_bytes'])}: {s['reason']}")
    return "\n".join(lines)
