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
           selection): scored against exact disk streaming;
- host_inplace, disk_inplace: the host and disk set-ups with ``attend_in_place=True``
           (decode attention over the blocks where they lie, no gather copy; off by default);
- hf_offload: transformers' own ``DynamicCache(offloading=True)`` (a peer, CUDA only: it
           keeps every layer on the host and brings whole layers back each step; a default
           set-up where CUDA is present).
A tiered set-up followed by ``@POLICY`` (``disk@lfu``) is that set-up with that eviction
policy, so that two policies run side by side in one run: the ratios of the default
policy's set-up and of ``disk@lfu`` are then measured in the same rounds. Every disk
set-up's bound in a round uses the raw read taken after the plain ``disk`` set-up's turn
(without ``disk`` in the list, one rate measured after the run); ``quest@P`` is scored
against ``disk@P`` when that runs too, else against ``disk``.
Then every set-up runs again side by side in one process (``--rounds`` rounds, each timing
``--new-tokens`` steps of every set-up in turn, the order reversed every other round; the
median per set-up): on a shared machine a slow spell then slows every set-up alike, where
separate processes minutes apart can differ by 30% for nothing. The ratios come from the
side-by-side run; the separate processes give each set-up's peak RSS and its tokens/s alone.
Every timing starts after two untimed decode steps. The disk set-up is scored against its
bound: the slower of DynamicCache's tokens/s and the disk's read bandwidth over the bytes
read from disk per token, so a perfect overlap of I/O and compute scores 1.0. The disk's bandwidth is
measured right after the disk set-up's turn in every side-by-side round (raw reads of
``--io-size`` with its record size), so each round has its own bound and the ratio is the
median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

from tiercache.cli import WORKER_ERROR, Parser, doc_summary, model_positions, work_dir, worker_failure

SELECTION_BUDGET = 4096  # --selection-budget's default (TierConfig's)
SETUPS = ("dynamic", "fits", "host", "disk", "quest", "host_inplace", "disk_inplace", "hf_offload")
CUDA_ONLY = ("hf_offload",)  # transformers' offloaded cache needs CUDA streams
IN_PLACE = "_inplace"  # suffix: the set-up without it, with attend_in_place=True
WITH_POLICY = "@"  # "disk@lfu": the disk set-up with eviction="lfu"
SIDE_BY_SIDE = "side-by-side"  # the worker that runs every set-up in one process


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


WARMUP_STEPS = 2  # untimed decode steps first: kernels for the one-token shapes, allocator


def _make_cache(setup: str, model, context: int, new_tokens: int, block_tokens: int, workdir: str,
                selection: Optional[str], selection_budget: int, device_fraction: float,
                host_fraction: float, extra_tokens: int = 0, eviction: Optional[str] = None,
                disk_io: str = "auto"):
    from transformers import DynamicCache

    from tiercache import TierConfig, TieredCache

    name = setup.replace(WITH_POLICY, "-")  # its own disk directory
    setup, _, policy = setup.partition(WITH_POLICY)
    eviction = policy or eviction
    if setup == "dynamic":
        return DynamicCache(config=model.config)
    if setup == "hf_offload":
        return DynamicCache(config=model.config, offloading=True)
    base = setup[:-len(IN_PLACE)] if setup.endswith(IN_PLACE) else setup
    kv = kv_bytes_per_token(model) * (context + new_tokens + extra_tokens + block_tokens)
    budgets = {
        "fits": dict(device_budget=int(kv * 1.2), host_budget=0),
        "host": dict(device_budget=kv // 4, host_budget=int(kv * 1.0)),
        # reuse=False: this measures decode streaming; the prefix cache (on by default with a
        # disk_dir) would copy every sealed block into its own host tier and write it to disk.
        "disk": dict(device_budget=int(kv * device_fraction), host_budget=int(kv * host_fraction),
                     disk_budget=int(kv * 1.2), disk_dir=os.path.join(workdir, f"kv-{name}"), direct_io="auto",
                     reuse=False),
    }["disk" if base == "quest" else base]
    if setup != base:
        budgets["attend_in_place"] = True
    if eviction:
        budgets["eviction"] = eviction
    if "disk_dir" in budgets:
        budgets["disk_io"] = disk_io
    if setup == "quest":  # history prefetch fetches last step's selection (next-layer would fetch all)
        budgets.update(selection=selection if selection not in (None, "full") else "quest",
                       selection_budget=selection_budget, prefetch="history")
    return TieredCache(model, TierConfig(block_tokens=block_tokens, **budgets))


def _prefill(model, cache, ids, chunk: int):
    """Prefill ``ids`` in chunks; the next token."""
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start:start + chunk], cache=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def _sync(model) -> None:
    """Wait for the device's queued work: on CUDA the clock would otherwise stop while
    kernels of the last steps still run."""
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode(model, cache, nxt, steps: int, tokens: Optional[list] = None) -> tuple:
    """Time ``steps`` greedy decode steps: (seconds, the next token); each token chosen is
    appended to ``tokens``."""
    _sync(model)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if tokens is not None:
            tokens.append(nxt)
    _sync(model)
    return time.perf_counter() - t0, nxt


EXACT = ("fits", "host", "disk", "hf_offload")  # nothing dropped, attention as SDPA's: DynamicCache's tokens


def _token_list(tokens: list) -> list:
    import torch

    return torch.cat(tokens, dim=-1)[0].tolist()


def check_tokens(results: dict) -> list:
    """The set-ups whose greedy tokens were checked equal to DynamicCache's in ``results``
    (set-up -> result with ``tokens``): those that drop nothing and attend as SDPA does.
    A set-up that differs is a ``TierCacheError``: a wrong cache is not timed and scored
    (only the sequence's length was checked before; a review)."""
    from tiercache.errors import TierCacheError

    ref = results.get("dynamic", {}).get("tokens")
    checked = []
    for setup, result in results.items():
        if ref is None or setup == "dynamic" or _base(setup) not in EXACT or not isinstance(result, dict):
            continue
        got = result.get("tokens")
        if got is None:
            continue
        if got != ref:
            step = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            raise TierCacheError(f"bench decode: the {setup} set-up's tokens differ from DynamicCache's from token "
                                 f"{step} of {len(ref)} on: it drops nothing, so they must be equal; not timed")
        checked.append(setup)
    return checked


def _check_used(setup: str, cache, expected: int) -> None:
    """The cache holds every token decoded so far: a model that ignored ``cache=`` (as
    transformers before 5.24 does without a word) would be timed on a fresh cache per step."""
    held = cache.get_seq_length()
    if held != expected:
        raise RuntimeError(f"bench decode: the {setup} cache holds {held} tokens after decoding, expected "
                           f"{expected}: the model did not use the cache it was given")


def _peak_device_bytes(model) -> Optional[int]:
    """Peak bytes the CUDA caching allocator handed out in this process (None on CPU)."""
    import torch

    device = next(model.parameters()).device
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _moved_since(cache, before: dict) -> dict:
    after = cache.stats()
    return {name: m["bytes"] - before["moves"].get(name, {}).get("bytes", 0) for name, m in after["moves"].items()}


def _disk_read(moved: dict) -> int:
    return sum(v for k, v in moved.items() if k.startswith("disk->"))


def worker(setup: str, context: int, new_tokens: int, block_tokens: int, workdir: str,
           prefill_chunk: int, selection: Optional[str] = None, selection_budget: int = SELECTION_BUDGET,
           device_fraction: float = 0.25, host_fraction: float = 0.25, eviction: Optional[str] = None,
           model_path: Optional[str] = None, disk_io: str = "auto") -> dict:
    """One set-up alone in this process: prefill ``context`` tokens, ``WARMUP_STEPS``
    untimed steps, then time ``new_tokens`` greedy decode steps; peak RSS is this set-up's."""
    import torch

    from tiercache.models import load_model

    model, tokenizer = load_model(model_path)
    ids = make_prompt_ids(tokenizer, context).to(model.device)
    cache = _make_cache(setup, model, context, new_tokens, block_tokens, workdir, selection, selection_budget,
                        device_fraction, host_fraction, extra_tokens=WARMUP_STEPS, eviction=eviction,
                        disk_io=disk_io)
    tiered = hasattr(cache, "stats")  # a TieredCache, not one of transformers' caches
    with torch.inference_mode():
        _sync(model)
        t0 = time.perf_counter()
        nxt = _prefill(model, cache, ids, prefill_chunk)
        _sync(model)
        prefill_s = time.perf_counter() - t0
        tokens = [nxt]
        _, nxt = _decode(model, cache, nxt, WARMUP_STEPS, tokens)
        before = cache.stats() if tiered else None
        reads_before = cache.attention_stats()["reads"] if tiered else None
        decode_s, _ = _decode(model, cache, nxt, new_tokens, tokens)
        _check_used(setup, cache, ids.shape[1] + WARMUP_STEPS + new_tokens)
    result = {"setup": setup, "context": context, "new_tokens": new_tokens, "tps": new_tokens / decode_s,
              "prefill_s": prefill_s, "kv_bytes": kv_bytes_per_token(model) * context,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "peak_device_bytes": _peak_device_bytes(model), "device": str(model.device),
              "tokens": _token_list(tokens)}
    if tiered:
        moved = _moved_since(cache, before)
        result["decode_bytes_moved"] = moved
        result["disk_read_bytes_per_token"] = _disk_read(moved) / new_tokens
        after = cache.stats()
        result["stall_s"] = after["stall_seconds"] - before["stall_seconds"]
        result["eviction"] = cache.tier_config.eviction
        result["tiers"] = after["tiers"]
        result["attention"] = cache.attention_stats()
        # The timed steps' gather copies (blocks copied into one K/V for attention), as a
        # share of their decode time: what attend_in_place or a roomier device tier saves.
        reads = result["attention"]["reads"]
        result["gather_s"] = reads["gather_seconds"] - reads_before["gather_seconds"]
        result["gather_share"] = result["gather_s"] / decode_s
        result["gathered_bytes_per_token"] = (reads["gathered_bytes"] - reads_before["gathered_bytes"]) / new_tokens
        cache.close()
    return result


def worker_side_by_side(setups: list, context: int, new_tokens: int, rounds: int, block_tokens: int,
                        workdir: str, prefill_chunk: int, selection: Optional[str] = None,
                        selection_budget: int = SELECTION_BUDGET, device_fraction: float = 0.25,
                        host_fraction: float = 0.25, eviction: Optional[str] = None,
                        raw_read_bytes: int = 0, model_path: Optional[str] = None,
                        disk_io: str = "auto") -> dict:
    """Every set-up in this one process, each prefilled once; then ``rounds`` rounds, each
    timing ``new_tokens`` steps of every set-up in turn. A slow spell of the machine (this
    one is shared) then slows every set-up alike, so the ratios hold; each set-up's tokens/s
    is its median over the rounds. The order is reversed every other round (as bench io's
    turns), so that no set-up always runs right after the same other one
    (``turn_order_rounds``).

    With ``raw_read_bytes`` and a disk set-up, the raw disk reads that many bytes right
    after the disk set-up's turn in every round (fio or dd, the disk set-up's record size,
    its I/O workers in flight: ``bench io``'s raw reads): the disk's rate then, for the
    bound of that round (``disk_read_gbps_rounds``). This disk's rate swings by 2x within
    seconds, so a rate measured minutes apart from the decoding made the bound a guess."""
    import statistics

    import torch

    from tiercache.models import load_model

    model, tokenizer = load_model(model_path)
    ids = make_prompt_ids(tokenizer, context).to(model.device)
    caches, nxt, tokens = {}, {}, {}
    with torch.inference_mode():
        for setup in setups:
            print(f"bench decode: side by side: prefilling {setup} ...", file=sys.stderr)
            caches[setup] = _make_cache(setup, model, context, new_tokens * rounds, block_tokens, workdir,
                                        selection, selection_budget, device_fraction, host_fraction,
                                        extra_tokens=WARMUP_STEPS, eviction=eviction, disk_io=disk_io)
            nxt[setup] = _prefill(model, caches[setup], ids, prefill_chunk)
            tokens[setup] = [nxt[setup]]
            _, nxt[setup] = _decode(model, caches[setup], nxt[setup], WARMUP_STEPS, tokens[setup])
        raw = _raw_disk_next_to("disk", caches, workdir, raw_read_bytes) if raw_read_bytes else None
        tps = {s: [] for s in setups}
        disk_read = {s: [] for s in setups}  # bytes read from disk per token, per round
        disk_gbps: list = []
        orders = [list(setups) if r % 2 == 0 else list(reversed(setups)) for r in range(rounds)]
        for order in orders:
            for setup in order:
                cache = caches[setup]
                before = cache.stats() if hasattr(cache, "stats") else None
                seconds, nxt[setup] = _decode(model, cache, nxt[setup], new_tokens, tokens[setup])
                tps[setup].append(new_tokens / seconds)
                if before is not None:
                    disk_read[setup].append(_disk_read(_moved_since(cache, before)) / new_tokens)
                if raw is not None and setup == "disk":
                    seconds, num_bytes = raw.read(0, raw.num_requests)
                    disk_gbps.append(num_bytes / seconds / 1e9)
    out = {}
    for setup in setups:
        _check_used(setup, caches[setup], ids.shape[1] + WARMUP_STEPS + new_tokens * rounds)
        out[setup] = {"tps": statistics.median(tps[setup]), "tps_rounds": tps[setup],
                      "disk_read_bytes_per_token": sum(disk_read[setup]) / rounds if disk_read[setup] else 0.0,
                      "disk_read_bytes_per_token_rounds": disk_read[setup], "tokens": _token_list(tokens[setup])}
        if _base(setup) == "quest":
            out[setup]["attention"] = caches[setup].attention_stats()
        if hasattr(caches[setup], "close"):
            caches[setup].close()
    if disk_gbps:
        out["disk_read_gbps_rounds"] = disk_gbps
    out["turn_order_rounds"] = orders
    return out


def _spawn(setup: str, args: argparse.Namespace, workdir: str) -> dict:
    cmd = [sys.executable, "-m", "tiercache.bench.decode", "--worker", setup, "--context", str(args.context),
           "--new-tokens", str(args.new_tokens), "--block-tokens", str(args.block_tokens),
           "--prefill-chunk", str(args.prefill_chunk), "--dir", workdir,
           "--selection", args.selection, "--selection-budget", str(args.selection_budget),
           "--device-fraction", str(args.device_fraction), "--host-fraction", str(args.host_fraction),
           "--eviction", args.eviction, "--disk-io", args.disk_io] + (["--model", args.model] if args.model else [])
    if setup == SIDE_BY_SIDE:
        cmd += ["--setups", ",".join(args.setup_list), "--rounds", str(args.rounds), "--io-size", args.io_size]
        cmd += ["--disk-gbps", str(args.disk_gbps)] if args.disk_gbps is not None else []
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if setup == SIDE_BY_SIDE else subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        error = worker_failure(proc.stdout)
        if error is not None:  # bad input the parent could not see: its one line, not a traceback
            raise ValueError(f"bench decode: the {setup} run: {error}")
        raise RuntimeError(f"bench decode {setup} failed" + (f":\n{proc.stderr[-3000:]}" if proc.stderr else ""))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _base(setup: str) -> str:
    """The set-up without its ``@POLICY``."""
    return setup.partition(WITH_POLICY)[0]


def _disk_bound(setup: str, results: dict, dyn: float, gbps: Optional[float]) -> dict:
    """``setup``'s bound and its ratio to it. The bound is the slower of DynamicCache's
    tokens/s and the disk's read rate over the bytes read from disk per token. With the
    disk's rate measured in every side-by-side round (``disk_read_gbps_rounds``), each round
    has its own bound and the ratio is the median of the rounds' ratios; else one rate
    (``gbps``: measured after the run, or ``--disk-gbps``) serves for all."""
    import statistics

    res = results[setup]
    per_token = res["disk_read_bytes_per_token"]
    out = {f"{setup}_read_bytes_per_token": per_token, f"{setup}_ratio": res["tps"] / dyn}
    rounds_gbps = results.get("disk_read_gbps_rounds") if gbps is None else None
    if rounds_gbps:
        bounds = [min(d, g * 1e9 / b) if b else d
                  for d, g, b in zip(results["dynamic"]["tps_rounds"], rounds_gbps,
                                     res["disk_read_bytes_per_token_rounds"])]
        ratios = [t / b for t, b in zip(res["tps_rounds"], bounds)]
        out.update({f"{setup}_bound_tps": statistics.median(bounds), f"{setup}_bound_ratio": statistics.median(ratios),
                    f"{setup}_bound_ratio_rounds": ratios, "disk_read_gbps": statistics.median(rounds_gbps),
                    "disk_read_gbps_rounds": rounds_gbps})
        return out
    bound = min(dyn, gbps * 1e9 / per_token) if per_token else dyn
    out.update({f"{setup}_bound_tps": bound, f"{setup}_bound_ratio": res["tps"] / bound, "disk_read_gbps": gbps})
    return out


def disk_read_gbps(directory: str, size: str, block_tokens: int) -> float:
    """Raw direct-I/O read bandwidth of the disk under ``directory`` (from bench io), with
    the disk set-up's request size (its blocks' records)."""
    from tiercache.bench.io import measure_io
    from tiercache.config import parse_bytes

    res = measure_io(directory, block_tokens, parse_bytes(size), 4)
    return res["raw_read_gbps"]


def _raw_disk_next_to(setup: str, caches: dict, workdir: str, num_bytes: int):
    """A raw-disk reader with ``setup``'s record size and I/O workers over a file of about
    ``num_bytes`` written now in ``workdir`` (None without that set-up or a disk tier)."""
    from tiercache.bench.io import RawDisk, default_raw_tool

    store = getattr(caches.get(setup), "store", None)
    if store is None or store.disk is None:
        return None
    record = store.disk.record_bytes
    n = max(1, num_bytes // record)
    raw = RawDisk(default_raw_tool(), os.path.join(workdir, "raw-read.dat"), record, n,
                  store.config.io_workers)
    raw.direct = store.disk.direct_io
    raw.write(0, n)
    return raw


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="tiercache bench decode", description=doc_summary(__doc__))
    p.add_argument("--context", type=int, default=8192, help="prompt tokens, at most the model's positions "
                   "(default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per set-up and round "
                   "(default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="side-by-side rounds (default %(default)s); 0 skips "
                   "the side-by-side run and takes the ratios from the separate processes")
    p.add_argument("--block-tokens", type=int, default=1024)
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--setups", default=None, help="comma list of %s (default: all; hf_offload only where CUDA "
                   "is present); a tiered one as SETUP@POLICY (disk@lfu) runs with that eviction policy"
                   % ", ".join(SETUPS))
    p.add_argument("--dir", default=None, help="work directory for the disk tier (default: a temp dir under .)")
    p.add_argument("--disk-gbps", type=float, default=None, help="disk read GB/s (default: measured now)")
    p.add_argument("--io-size", default="512MiB", help="bytes the raw disk reads after the disk set-up's turn "
                   "in each side-by-side round (without that run: one bench io measurement of this size)")
    p.add_argument("--selection", default="full", help="full (default) or quest: adds the quest set-up "
                   "(the disk set-up reading only the selected pages)")
    p.add_argument("--selection-budget", type=int, default=None, help="quest: tokens per KV head and step "
                   f"(>= 3 blocks, a whole number of blocks; default {SELECTION_BUDGET})")
    p.add_argument("--device-fraction", type=float, default=0.25, help="disk/quest set-ups: device tier as a "
                   "share of the KV (default %(default)s)")
    p.add_argument("--host-fraction", type=float, default=0.25, help="disk/quest set-ups: host tier share "
                   "(default %(default)s)")
    p.add_argument("--eviction", default="", help="eviction policy of the tiered set-ups (default: "
                   "TierConfig's)")
    p.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the default "
                   "model, SmolLM2-135M-Instruct); it runs on CUDA where present")
    from tiercache.config import DISK_IO_BACKENDS

    p.add_argument("--disk-io", choices=DISK_IO_BACKENDS, default="auto",
                   help="the disk set-up's disk backend (default auto: kvikio on CUDA when installed, else posix)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def run(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    budget_given = args.selection_budget is not None
    if not budget_given:
        args.selection_budget = SELECTION_BUDGET
    common = (args.block_tokens, args.dir, args.prefill_chunk, args.selection, args.selection_budget,
              args.device_fraction, args.host_fraction, args.eviction or None)
    if args.worker:
        from tiercache.errors import TierCacheError

        try:
            from tiercache import plugins

            plugins.load(plugins.specs_from_env(), source=plugins.ENV)  # the parent's, passed on
            if args.worker == SIDE_BY_SIDE:
                from tiercache.config import parse_bytes

                raw_read_bytes = 0 if args.disk_gbps is not None else parse_bytes(args.io_size, "--io-size")
                result = worker_side_by_side(args.setups.split(","), args.context, args.new_tokens, args.rounds,
                                             *common, raw_read_bytes=raw_read_bytes, model_path=args.model,
                                             disk_io=args.disk_io)
            else:
                result = worker(args.worker, args.context, args.new_tokens, *common, model_path=args.model,
                                disk_io=args.disk_io)
        except (TierCacheError, ValueError) as exc:  # the parent shows this line, not a traceback
            print(json.dumps({WORKER_ERROR: str(exc)}))
            return 2
        print(json.dumps(result))
        return 0
    if args.new_tokens < 1 or args.rounds < 0:
        raise ValueError(f"--new-tokens must be >= 1 and --rounds >= 0, got {args.new_tokens} and {args.rounds}")
    for flag, value in (("--context", args.context), ("--prefill-chunk", args.prefill_chunk)):
        if value < 1:
            raise ValueError(f"{flag}: must be >= 1, got {value}")
    from tiercache.config import TierConfig

    for flag, value in (("--device-fraction", args.device_fraction), ("--host-fraction", args.host_fraction)):
        if not 0 < value <= 1:
            raise ValueError(f"{flag}: must be in (0, 1], got {value}")
    cfg = TierConfig(block_tokens=args.block_tokens, **({"eviction": args.eviction} if args.eviction else {}))
    from tiercache.plugins import check_shared

    if args.eviction:  # refused before any set-up runs: the worker that makes it could not
        check_shared("eviction", args.eviction, "bench decode")
    import torch

    cuda = torch.cuda.is_available()
    if args.setups is None:
        args.setups = ",".join(s for s in SETUPS if cuda or s not in CUDA_ONLY)
    setups = [s.strip() for s in args.setups.split(",")]
    if not any(setups) or "" in setups:  # ',' was a TypeError from the table's width, after the run
        raise ValueError(f"--setups: a comma-separated list of set-ups without empty items, got {args.setups!r}")
    if len(set(setups)) != len(setups):  # two of one shared a cache in the side-by-side run: a RuntimeError
        raise ValueError(f"--setups: {sorted({s for s in setups if setups.count(s) > 1})} named twice")
    if args.disk_gbps is not None and not (math.isfinite(args.disk_gbps) and args.disk_gbps > 0):
        raise ValueError(f"--disk-gbps: a positive rate in GB/s, got {args.disk_gbps}")  # 0: a ZeroDivisionError
    from tiercache.config import parse_bytes

    io_bytes = parse_bytes(args.io_size, "--io-size")
    if io_bytes < 1:  # was parsed by the side-by-side worker, after the set-ups ran
        raise ValueError(f"--io-size: must be > 0, got {args.io_size!r}")
    work_dir("--dir", args.dir or ".")  # the temporary folder goes here
    if args.disk_gbps is None and (args.selection != "full" or any(s.startswith(("disk", "quest")) for s in setups)):
        from tiercache.bench.io import check_free_space

        # the raw disk's file is written next to the set-ups' own: one larger than the free
        # space filled the disk after every set-up had run alone, and ended in a traceback
        check_free_space(args.dir or ".", io_bytes, "--io-size", "--io-size")
    if args.selection != "full" and "quest" not in setups:
        setups.append("quest")
    unknown = sorted(s for s in setups if _base(s) not in SETUPS)
    if unknown:
        raise ValueError(f"--setups: unknown {unknown}; known: {', '.join(SETUPS)}, each tiered one also as "
                         f"SETUP@POLICY (an eviction policy)")
    if any(_base(s) == "quest" for s in setups):
        # the budget checked as the quest set-up uses it (with quest when --selection is full)
        TierConfig(selection=args.selection if args.selection not in (None, "full") else "quest",
                   selection_budget=args.selection_budget, block_tokens=args.block_tokens)
    elif budget_given:
        raise ValueError(f"--selection-budget: only the quest set-up reads it, and --setups {','.join(setups)} has "
                         f"none, so it would be ignored; add quest (or --selection quest), or leave it out")
    for setup in setups:
        name, with_policy, policy = setup.partition(WITH_POLICY)
        if with_policy:
            if name in ("dynamic",) + CUDA_ONLY:
                raise ValueError(f"--setups: {setup}: {name} is not a tiered set-up; it has no eviction policy")
            try:
                TierConfig(eviction=policy)
                check_shared("eviction", policy, "bench decode")
            except ValueError as exc:  # an unknown policy: the message lists the known ones
                raise ValueError(f"--setups: {setup}: {exc}") from None
    if not cuda and set(setups) & set(CUDA_ONLY):
        raise ValueError(f"--setups: {', '.join(sorted(set(setups) & set(CUDA_ONLY)))} needs CUDA, and this "
                         f"machine has none")
    if args.disk_io == "kvikio" and any(s.startswith(("disk", "quest")) for s in setups):
        from tiercache.disk import resolve_disk_io

        resolve_disk_io(args.disk_io)  # here, not in every worker: one clear line
    # The model now, in this process (its config only): a missing folder or an unsupported
    # model was every worker's traceback, and a context past its positions ran regardless.
    # The prompt must fit; the decode steps after it may run a few positions past (the published
    # runs at the default model's 8192 do: 8192 + 2 warm-up + 16 x 3 rounds).
    from tiercache.models import load_config

    limit = model_positions(load_config(args.model)[1])
    if limit is not None and args.context > limit:
        raise ValueError(f"--context: {args.context} tokens exceed the model's {limit} positions")
    args.setup_list = setups
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-", dir=args.dir or ".") as workdir:
        isolated = {}
        for setup in setups:
            print(f"bench decode: {setup} alone at {args.context} tokens ...", file=sys.stderr)
            isolated[setup] = _spawn(setup, args, workdir)
        together = None
        if args.rounds and len(setups) > 1:
            print(f"bench decode: every set-up side by side, {args.rounds} rounds ...", file=sys.stderr)
            together = _spawn(SIDE_BY_SIDE, args, workdir)
        gbps = args.disk_gbps
        if any(s.startswith("disk") for s in isolated) and gbps is None and not (together or {}).get(
                "disk_read_gbps_rounds"):
            gbps = disk_read_gbps(workdir, args.io_size, args.block_tokens)
    # The ratios come from the side-by-side run when there is one (same process, interleaved
    # rounds); the separate processes give each set-up's peak RSS and its tokens/s alone.
    results = together or isolated
    checked = sorted(set(check_tokens(isolated)) | set(check_tokens(together or {})))
    out: dict = {"context": args.context, "new_tokens": args.new_tokens, "block_tokens": args.block_tokens,
                 "eviction": cfg.eviction, "disk_io": args.disk_io,
                 "rounds": args.rounds if together else 0,
                 "ratios_from": "side-by-side" if together else "separate processes",
                 "tokens_equal_dynamic": checked}
    for setup in setups:
        out[f"{setup}_tps"] = results[setup]["tps"]
        out.setdefault("isolated_tps", {})[setup] = isolated[setup]["tps"]
        out.setdefault("peak_rss_bytes", {})[setup] = isolated[setup]["peak_rss_bytes"]
        if isolated[setup].get("peak_device_bytes") is not None:
            out.setdefault("peak_device_bytes", {})[setup] = isolated[setup]["peak_device_bytes"]
        out.setdefault("setups", {})[setup] = isolated[setup]
    if together:
        out["side_by_side"] = together
    dyn = results.get("dynamic", {}).get("tps")
    if dyn:
        for setup in setups:
            if _base(setup) in ("fits", "host", "host" + IN_PLACE, "hf_offload"):
                out[f"{setup}_ratio"] = results[setup]["tps"] / dyn
    for setup in setups:
        if _base(setup) in ("disk", "disk" + IN_PLACE) and dyn:
            out.update(_disk_bound(setup, results, dyn, gbps))
    for setup in setups:  # quest@P against disk@P (exact streaming with the same policy), else disk
        if _base(setup) != "quest":
            continue
        policy = setup.partition(WITH_POLICY)[2]
        candidates = ([f"disk{WITH_POLICY}{policy}"] if policy else []) + ["disk"]
        disk = next((d for d in candidates if d in results), None)
        if disk is None:
            continue
        out[f"{setup}_vs_disk_ratio"] = out[f"{setup}_ratio"] = results[setup]["tps"] / results[disk]["tps"]
        sel = results[setup].get("attention", {}).get("selection") or {}
        if sel.get("pages_total"):
            out[f"{setup}_pages_read_fraction"] = sel["pages_read"] / sel["pages_total"]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        how = (f"median of {args.rounds} side-by-side rounds of {args.new_tokens} steps" if together
               else f"{args.new_tokens} steps")
        print(f"decode tokens/s at {args.context} tokens of context ({how}; alone: each set-up in its own process):")
        width = max(12, *(len(s) for s in setups))
        for setup in setups:
            ratio = out.get(setup + "_bound_ratio", out.get(setup + "_ratio"))
            ratio = "  -  " if ratio is None else f"{ratio:.2f}"  # dynamic: the reference
            gpu = isolated[setup].get("peak_device_bytes")
            print(f"  {setup:<{width}} {results[setup]['tps']:6.2f} tok/s  ratio {ratio}   alone "
                  f"{isolated[setup]['tps']:6.2f} tok/s  peak RSS {isolated[setup]['peak_rss_bytes'] / 2**20:7.0f} MiB"
                  + (f"  peak GPU {gpu / 2**20:7.0f} MiB" if gpu is not None else ""))
        for setup in setups:
            if f"{setup}_vs_disk_ratio" in out:
                print(f"  {setup} / disk streaming: {out[setup + '_vs_disk_ratio']:.2f}x (read "
                      f"{100 * out.get(setup + '_pages_read_fraction', 1.0):.0f}% of the pages per decode step)")
        for setup in setups:
            if f"{setup}_bound_tps" in out:
                print(f"  {setup} bound {out[setup + '_bound_tps']:.2f} tok/s ({out['disk_read_gbps']:.2f} GB/s "
                      f"over {out[setup + '_read_bytes_per_token'] / 2**20:.1f} MiB read from disk per token; "
                      f"ratio = tok/s over bound)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
