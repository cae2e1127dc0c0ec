"""``tiercache bench decode``: decode tokens/s of DynamicCache and TieredCache side by side.

Set-ups, each in its own process (so peak RSS is its own) on the default model at one
context length:
- dynamic: transformers' DynamicCache (the reference);
- fits:    TieredCache with everything on the device tier;
- host:    device budget 25% of the KV, the rest on the host tier;
- disk:    device 25%, host 25%, the rest on disk with direct I/O (``--device-fraction``,
           ``--host-fraction`` change the shares of this set-up);
- quest:   the disk set-up with Quest page selection (``--selection quest``, budget
           ``--selection-budget`` tokens per KV head) and history prefetch (last step's
           selection): scored against exact disk streaming.
Ratios are measured in the same run. The disk set-up is scored against its bound: the
slower of DynamicCache's tokens/s and the disk's read bandwidth over the bytes read from
disk per token, so a perfect overlap of I/O and compute scores 1.0.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

SETUPS = ("dynamic", "fits", "host", "disk", "quest")


def kv_bytes_per_token(model) -> int:
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * text.num_key_value_heads * head_dim * itemsize * text.num_hidden_layers


def make_prompt_ids(tokenizer, context: int):
    """``context`` token ids of natural-looking text (the demo's records, repeated)."""
    import torch

    from tiercache.demo import make_haystack

    text, _, _ = make_haystack(200, seed=3)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    reps = context // ids.numel() + 1
    return torch.cat([ids] * reps)[:context].unsqueeze(0)


def worker(setup: str, context: int, new_tokens: int, block_tokens: int, workdir: str,
           prefill_chunk: int, selection: Optional[str] = None, selection_budget: int = 4096,
           device_fraction: float = 0.25, host_fraction: float = 0.25) -> dict:
    """Prefill ``context`` tokens, then time ``new_tokens`` greedy decode steps."""
    import torch
    from transformers import DynamicCache

    from tiercache import TierConfig, TieredCache
    from tiercache.models import load_model

    model, tokenizer = load_model()
    ids = make_prompt_ids(tokenizer, context)
    kv = kv_bytes_per_token(model) * (context + new_tokens + block_tokens)
    if setup == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        budgets = {
            "fits": dict(device_budget=int(kv * 1.2), host_budget=0),
            "host": dict(device_budget=kv // 4, host_budget=int(kv * 1.0)),
            "disk": dict(device_budget=int(kv * device_fraction), host_budget=int(kv * host_fraction),
                         disk_budget=int(kv * 1.2), disk_dir=os.path.join(workdir, "kv"), direct_io="auto"),
        }["disk" if setup == "quest" else setup]
        if setup == "quest":  # history prefetch fetches last step's selection (next-layer would fetch all)
            budgets.update(selection=selection or "quest", selection_budget=selection_budget, prefetch="history")
        cache = TieredCache(model, TierConfig(block_tokens=block_tokens, **budgets))
    with torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, context, prefill_chunk):
            out = model(ids[:, start:start + prefill_chunk], cache=cache, use_cache=True)
        prefill_s = time.perf_counter() - t0
        nxt = out.logits[:, -1:].argmax(-1)
        before = cache.stats() if setup != "dynamic" else None
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    result = {"setup": setup, "context": context, "new_tokens": new_tokens, "tps": new_tokens / decode_s,
              "prefill_s": prefill_s, "kv_bytes": kv,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if setup != "dynamic":
        after = cache.stats()
        moved = {}
        for name, m in after["moves"].items():
            moved[name] = m["bytes"] - before["moves"].get(name, {}).get("bytes", 0)
        result["decode_bytes_moved"] = moved
        result["disk_read_bytes_per_token"] = sum(v for k, v in moved.items() if k.startswith("disk->")) / new_tokens
        result["stall_s"] = after["stall_seconds"] - before["stall_seconds"]
        result["tiers"] = after["tiers"]
        result["attention"] = cache.attention_stats()
        cache.close()
    return result


def _spawn(setup: str, args: argparse.Namespace, workdir: str) -> dict:
    cmd = [sys.executable, "-m", "tiercache.bench.decode", "--worker", setup, "--context", str(args.context),
           "--new-tokens", str(args.new_tokens), "--block-tokens", str(args.block_tokens),
           "--prefill-chunk", str(args.prefill_chunk), "--dir", workdir,
           "--selection", args.selection, "--selection-budget", str(args.selection_budget),
           "--device-fraction", str(args.device_fraction), "--host-fraction", str(args.host_fraction)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench decode {setup} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def disk_read_gbps(directory: str, size: str) -> float:
    """Raw direct-I/O read bandwidth of the disk under ``directory`` (from bench io)."""
    from tiercache.bench.io import measure_io
    from tiercache.config import parse_bytes

    res = measure_io(directory, 256, parse_bytes(size), 4)
    return res["raw_read_gbps"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192, help="prompt tokens (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed (default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--setups", default=",".join(SETUPS), help="comma list of %s" % ", ".join(SETUPS))
    p.add_argument("--dir", default=None, help="work directory for the disk tier (default: a temp dir under .)")
    p.add_argument("--disk-gbps", type=float, default=None, help="disk read GB/s (default: measured now)")
    p.add_argument("--io-size", default="512MiB", help="bytes for the disk bandwidth measurement")
    p.add_argument("--selection", default="full", help="full (default) or quest: adds the quest set-up "
                   "(the disk set-up reading only the selected pages)")
    p.add_argument("--selection-budget", type=int, default=4096, help="quest: tokens per KV head and step "
                   "(>= 3 blocks; default %(default)s)")
    p.add_argument("--device-fraction", type=float, default=0.25, help="disk/quest set-ups: device tier as a "
                   "share of the KV (default %(default)s)")
    p.add_argument("--host-fraction", type=float, default=0.25, help="disk/quest set-ups: host tier share "
                   "(default %(default)s)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def run(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.context, args.new_tokens, args.block_tokens, args.dir,
                                args.prefill_chunk, args.selection, args.selection_budget,
                                args.device_fraction, args.host_fraction)))
        return 0
    from tiercache.config import TierConfig

    for flag, value in (("--device-fraction", args.device_fraction), ("--host-fraction", args.host_fraction)):
        if not 0 < value <= 1:
            raise ValueError(f"{flag}: must be in (0, 1], got {value}")
    TierConfig(selection=args.selection, selection_budget=args.selection_budget, block_tokens=args.block_tokens)
    setups = [s for s in args.setups.split(",") if s]
    if args.selection != "full" and "quest" not in setups:
        setups.append("quest")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        raise ValueError(f"--setups: unknown {unknown}; known: {', '.join(SETUPS)}")
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-", dir=args.dir or ".") as workdir:
        results = {}
        for setup in setups:
            print(f"bench decode: {setup} at {args.context} tokens ...", file=sys.stderr)
            results[setup] = _spawn(setup, args, workdir)
        gbps = args.disk_gbps
        if "disk" in results and gbps is None:
            gbps = disk_read_gbps(workdir, args.io_size)
    out: dict = {"context": args.context, "new_tokens": args.new_tokens, "block_tokens": args.block_tokens}
    for setup, r in results.items():
        out[f"{setup}_tps"] = r["tps"]
        out.setdefault("peak_rss_bytes", {})[setup] = r["peak_rss_bytes"]
        out.setdefault("setups", {})[setup] = r
    dyn = results.get("dynamic", {}).get("tps")
    if dyn:
        for setup in ("fits", "host"):
            if setup in results:
                out[f"{setup}_ratio"] = results[setup]["tps"] / dyn
    if "disk" in results and dyn:
        per_token = results["disk"]["disk_read_bytes_per_token"]
        disk_tps = gbps * 1e9 / per_token if per_token else float("inf")
        bound = min(dyn, disk_tps)
        out.update(disk_read_gbps=gbps, disk_read_bytes_per_token=per_token, disk_bound_tps=bound,
                   disk_bound_ratio=results["disk"]["tps"] / bound, disk_ratio=results["disk"]["tps"] / dyn)
    if "quest" in results and "disk" in results:
        out["quest_vs_disk_ratio"] = out["quest_ratio"] = results["quest"]["tps"] / results["disk"]["tps"]
        sel = results["quest"].get("attention", {}).get("selection") or {}
        if sel.get("pages_total"):
            out["quest_pages_read_fraction"] = sel["pages_read"] / sel["pages_total"]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"decode tokens/s at {args.context} tokens of context ({args.new_tokens} steps):")
        for setup, r in results.items():
            extra = f"  ratio {out.get(setup + '_ratio', out.get('disk_bound_ratio', 1.0) if setup == 'disk' else 1.0):.2f}"
            print(f"  {setup:<8} {r['tps']:6.2f} tok/s  peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB{extra}")
        if "quest_vs_disk_ratio" in out:
            print(f"  quest / disk streaming: {out['quest_vs_disk_ratio']:.2f}x (read "
                  f"{100 * out.get('quest_pages_read_fraction', 1.0):.0f}% of the pages per decode step)")
        if "disk_bound_tps" in out:
            print(f"  disk bound {out['disk_bound_tps']:.2f} tok/s ({out['disk_read_gbps']:.2f} GB/s over "
                  f"{out['disk_read_bytes_per_token'] / 2**20:.1f} MiB read from disk per token)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
