"""`tiercache bench policies`: which eviction policy keeps the most hits, measured on real traces.

For each context length, the default model prefills a long prompt and decodes a few tokens
with a trace recorded (every block written and read, with the attention mass each block got).
Each trace is then replayed through every registered eviction policy, with and without
prefetch, at device budgets from 10% to 90% of the trace's blocks, and through libCacheSim's
LRU, FIFO, LFU, ARC, S3-FIFO and Belady's optimum. It prints the best runtime policy per
regime (context, prefetch, budget band), and overall the policy with the least estimated
stall summed over every trace, prefetch policy and budget (the time attention would wait for
blocks; ties go to fewer bytes moved). The replay reads from the device tier, as on CUDA;
README ("Policy lab") says how the default (``layer-cycle``) was chosen on CPU, where
attention reads device and host blocks where they lie.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional

from tiercache.cli import CLIError, Parser, doc_summary, int_list, require_extra, split_list, work_dir

FRACTIONS = (0.1, 0.25, 0.4, 0.55, 0.75, 0.9)
BANDS = (("small", 0.0, 0.3), ("medium", 0.3, 0.6), ("large", 0.6, 1.01))


def record(model, tokenizer, context: int, new_tokens: int, block_tokens: int, path: str) -> None:
    import torch

    from tiercache import TierConfig, TieredCache
    from tiercache.bench.decode import make_prompt_ids

    positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if positions is not None and context + new_tokens > positions:
        context = positions - new_tokens  # stay within the model's positions
    ids = make_prompt_ids(tokenizer, context)
    cfg = TierConfig(device_budget="4GiB", host_budget="64MiB", block_tokens=block_tokens)
    with TieredCache(model, cfg, trace=path) as cache, torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                       do_sample=False, prefill_chunk_size=512, pad_token_id=tokenizer.eos_token_id)


def summarize(results: list, fractions: dict) -> dict:
    """Best runtime policy per (trace, prefetch, budget band), and overall.

    Without prefetch every miss stalls attention, so the device hit ratio decides. With
    prefetch, hits are bought with traffic, so the bytes moved per token decide.
    """
    runtime = [r for r in results if not r["policy"].startswith("libcachesim:")]
    groups: dict = {}
    for r in runtime:
        frac = fractions[(r["trace"], r["budget_bytes"])]
        band = next(name for name, lo, hi in BANDS if lo <= frac < hi)
        groups.setdefault((r["trace"], r["prefetch"], band), {}).setdefault(r["policy"], []).append(r)
    regimes = []
    for (trace, prefetch, band), by_policy in sorted(groups.items()):
        hit = {p: statistics.fmean(x["hit_ratio"] for x in v) for p, v in by_policy.items()}
        traffic = {p: statistics.fmean(x["bytes_per_token_total"] for x in v) for p, v in by_policy.items()}
        if prefetch == "none":
            winner = max(hit, key=hit.get)
        else:
            winner = min(traffic, key=traffic.get)
        regimes.append({"trace": trace, "prefetch": prefetch, "band": band, "best": winner,
                        "hit_ratio": round(hit[winner], 4), "bytes_per_token": round(traffic[winner]),
                        "lru_hit_ratio": round(hit.get("lru", float("nan")), 4),
                        "lru_bytes_per_token": round(traffic.get("lru", float("nan")))})
    no_prefetch: dict = {}
    for r in runtime:
        if r["prefetch"] == "none":
            no_prefetch.setdefault(r["policy"], []).append(r["hit_ratio"])
    means = {p: round(statistics.fmean(v), 4) for p, v in no_prefetch.items()}
    traffic: dict = {}
    for r in runtime:
        if r["prefetch"] != "none":
            traffic.setdefault(r["policy"], []).append(r["bytes_per_token_total"])
    mean_traffic = {p: round(statistics.fmean(v)) for p, v in traffic.items()}
    stall: dict = {}
    moved: dict = {}
    for r in runtime:
        # plain floats and ints: numpy's scalars printed as "np.float64(0.007)" in the summary
        stall[r["policy"]] = stall.get(r["policy"], 0.0) + float(r["est_stall_seconds"])
        moved[r["policy"]] = moved.get(r["policy"], 0) + int(r["bytes_moved"])
    ranking = sorted(stall, key=lambda p: (round(stall[p], 2), moved[p]))
    return {"regimes": regimes,
            "total_est_stall_seconds": {p: round(stall[p], 3) for p in ranking},
            "mean_hit_ratio_no_prefetch": dict(sorted(means.items(), key=lambda kv: -kv[1])),
            "mean_bytes_per_token_with_prefetch": dict(sorted(mean_traffic.items(), key=lambda kv: kv[1])),
            "best_overall": ranking[0] if ranking else None}


def _print_summary(summary: dict, out_dir: str) -> None:
    print(f"{'trace':<14} {'prefetch':<11} {'budget':<7} {'best':<16} {'hit':>6} {'MB/token':>9} "
          f"{'lru hit':>8} {'lru MB/tok':>10}")
    for g in summary["regimes"]:
        print(f"{g['trace']:<14} {g['prefetch']:<11} {g['band']:<7} {g['best']:<16} {g['hit_ratio']:>6.3f} "
              f"{g['bytes_per_token'] / 1e6:>9.2f} {g['lru_hit_ratio']:>8.3f} {g['lru_bytes_per_token'] / 1e6:>10.2f}")
    print("mean device hit ratio without prefetch:", summary["mean_hit_ratio_no_prefetch"])
    print("mean bytes moved per token with prefetch:", summary["mean_bytes_per_token_with_prefetch"])
    print("estimated stall summed over every trace, prefetch and budget (s):", summary["total_est_stall_seconds"])
    print(f"best overall: {summary['best_overall']}   (results and plots in {out_dir}/)")


def _resummarize(path: str, as_json: bool) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:  # a missing file was "not a policies.json from this benchmark" (a review)
        raise ValueError(f"--summarize: cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
        results = data["results"]
        if not isinstance(results, list) or not results:  # an empty summary and exit 0 said nothing (a review)
            raise ValueError("it holds no results")
        fractions = {(r["trace"], r["budget_bytes"]): r["budget_fraction"] for r in results if "budget_fraction" in r}
        # inside the check: a `compare --json` report (no budget fractions) or a row with a
        # null hit ratio was a KeyError or TypeError from the summary
        summary = summarize(results, fractions)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--summarize: {path!r} is not a policies.json from this benchmark ({exc!r})") from None
    if as_json:
        print(json.dumps({"summary": summary, "traces": data.get("traces", {})}))
    else:
        _print_summary(summary, os.path.dirname(path) or ".")
    return 0


def run(argv: Optional[list] = None) -> int:
    p = Parser(prog="tiercache bench policies", description=doc_summary(__doc__))
    p.add_argument("--contexts", default="2048,8192", help="prompt lengths in tokens (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per trace (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=256, help="block size of the traces (default %(default)s)")
    p.add_argument("--prefetch-policies", default="none,next-layer,history")
    p.add_argument("--out", default="bench-policies", help="folder for traces, JSON and plots")
    p.add_argument("--io-json", default=None, help="link rates from `tiercache bench io --json` (default: measure)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--summarize", default=None, metavar="POLICIES_JSON",
                   help="only print the summary of a saved policies.json (no recording, no replay)")
    args = p.parse_args(argv)
    if args.summarize:
        return _resummarize(args.summarize, args.json)

    from tiercache.lab.compare import compare_trace, load_bandwidths
    from tiercache.lab.plot import plot_hit_ratio
    from tiercache.lab.trace import load_trace
    from tiercache.models import load_model
    from tiercache.policies import EVICTION_POLICIES

    from tiercache.config import TierConfig
    from tiercache.policies import PREFETCH_POLICIES

    # All before the model loads (a context of 0 tokens was a reshape error from inside it).
    TierConfig(block_tokens=args.block_tokens)  # validates it by name
    contexts = int_list("--contexts", args.contexts, 1)
    if args.new_tokens < 1:
        raise CLIError(f"--new-tokens: must be >= 1, got {args.new_tokens}")
    prefetches = tuple(split_list("--prefetch-policies", args.prefetch_policies))
    unknown = [x for x in prefetches if x not in PREFETCH_POLICIES]
    if unknown:
        raise CLIError(f"--prefetch-policies: unknown {unknown}; known: {', '.join(sorted(PREFETCH_POLICIES))}")
    # libCacheSim replays every trace and matplotlib draws the plots, after minutes of recording
    require_extra("bench policies", "libcachesim", "matplotlib.backends.backend_agg")
    if os.path.exists(args.out):
        work_dir("--out", args.out)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:  # its parent missing or not writable: a traceback after the checks
        raise CLIError(f"--out: cannot make {args.out!r} ({exc.strerror or exc})") from None
    model, tokenizer = load_model()
    results, fractions, traces = [], {}, {}
    bandwidths = load_bandwidths(args.io_json, args.out)
    for context in contexts:
        path = os.path.join(args.out, f"trace-{context}.csv")
        print(f"bench policies: recording {context} tokens + {args.new_tokens} new ...", file=sys.stderr)
        record(model, tokenizer, context, args.new_tokens, args.block_tokens, path)
        trace = load_trace(path)
        import numpy as np
        distinct = len(np.unique(trace.obj_id))
        per_layer = -(-distinct // trace.num_layers)
        budgets = sorted({max(per_layer + 1, round(distinct * f)) * trace.block_bytes for f in FRACTIONS})
        label = f"{context} tokens"
        print(f"bench policies: replaying {len(trace)} accesses x {len(EVICTION_POLICIES)} policies x "
              f"{len(prefetches)} prefetch x {len(budgets)} budgets ...", file=sys.stderr)
        report = compare_trace(trace, sorted(EVICTION_POLICIES), budgets, prefetches=prefetches,
                               bandwidths=bandwidths, label=label)
        for b in budgets:
            fractions[(label, b)] = b / (distinct * trace.block_bytes)
        for r in report["results"]:
            r["budget_fraction"] = round(fractions[(label, r["budget_bytes"])], 3)
        results.extend(report["results"])
        traces[label] = {k: report[k] for k in ("requests", "block_bytes", "tokens", "num_layers")}
        traces[label]["distinct_blocks"] = distinct
    base = [r for r in results if r.get("prefetch", "none") == "none"]
    plot_hit_ratio(base, os.path.join(args.out, "hit-ratio.png"), title="device hit ratio, no prefetch")
    for prefetch in prefetches:
        if prefetch != "none":
            subset = [r for r in results if r.get("prefetch") == prefetch or "belady" in r["policy"]]
            plot_hit_ratio(subset, os.path.join(args.out, f"hit-ratio-{prefetch}.png"),
                           title=f"device hit ratio, {prefetch} prefetch")
    summary = summarize(results, fractions)
    out = {"traces": traces, "block_tokens": args.block_tokens, "new_tokens": args.new_tokens,
           "bandwidths_gbps": {k: round(v / 1e9, 3) for k, v in bandwidths.__dict__.items()},
           "summary": summary, "results": results}
    with open(os.path.join(args.out, "policies.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    if args.json:
        print(json.dumps({"summary": summary, "traces": traces}))
    else:
        _print_summary(summary, args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
