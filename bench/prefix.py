"""``tiercache bench prefix``: time to first token (TTFT) with the persistent prefix cache.

On the default model (or ``--model PATH``), for an N-token prompt, greedy, one new token:
- recompute: a cold request on a fresh disk_dir with reuse on (it computes the whole prompt
  and publishes its blocks as it goes: the realistic first request), next to the same
  request with ``reuse=False`` (the cost of publishing);
- warm from host: a second TieredCache in the same process on the same directory;
- warm from disk: a fresh process on the same directory, the page cache dropped when
  allowed (root) and the disk tier reading with O_DIRECT where the filesystem supports it;
- a conversation of ``--turns`` turns, each prompt extending the previous prompt and its
  answer: TTFT per turn with reuse and without;
- with ``--remote URL``: the cold request also publishes to a Redis/Valkey server (a private
  namespace, deleted at the end), and a fresh process on an empty disk_dir (another machine)
  loads the prompt from the server: warm from remote, with the bytes it read.
Each part runs in its own process. TTFT runs from creating the cache to the first token's
logits (the prefix load included); writing the published blocks to disk happens when the
cache closes, after the answer, and is reported apart (``flush_s``). Every process first
runs one short forward so that one-time start-up costs are not counted. The warm first-token
logits are compared with the cold ones (max abs difference).

Block size matters here: whole blocks are reused and the rest of the prompt is computed, so
larger blocks leave up to a block of tokens to compute, smaller ones cost more records to
load. 64 tokens is the default: since records are read in parallel straight into one buffer
per layer, it was faster than 128 on the default model at 8k tokens (the prompt's last 56
tokens computed instead of 120, for 3,810 records instead of 1,890).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from tiercache.cli import WORKER_ERROR, Parser, doc_summary, model_positions, work_dir, worker_failure

POSITION_MARGIN = 8  # tokens left below the model's positions


# ---- in the worker processes (they import torch) ---------------------------------------------
def _setup(args: argparse.Namespace) -> tuple:
    """(model, prompt ids [1, N], config of the prefix runs)."""
    import torch

    from tiercache import TierConfig
    from tiercache.bench.decode import kv_bytes_per_token, make_prompt_ids
    from tiercache.models import load_model

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    context = _context(args.context, positions)
    ids = make_prompt_ids(tokenizer, context).to(next(model.parameters()).device)
    kv = kv_bytes_per_token(model) * (context + args.block_tokens)
    cfg = TierConfig(device_budget=max(int(kv * 1.2), 1 << 24), host_budget=max(int(kv * 1.2), 1 << 24),
                     disk_budget=max(3 * kv, 1 << 28), disk_dir=os.path.join(args.dir, "kv"),
                     block_tokens=args.block_tokens, reuse_host_budget=max(int(kv * 1.5), 1 << 24),
                     remote_url=args.remote, remote_namespace=args.remote_namespace or "tiercache")
    with torch.inference_mode():  # one short forward: kernels and allocators warmed up
        model(ids[:, :min(64, ids.shape[1])])
    return model, ids, cfg


def _gen_kwargs(ids, prefill_chunk: int, computed: int) -> dict:
    import torch

    kw: dict = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    if prefill_chunk and computed > prefill_chunk:
        kw["prefill_chunk_size"] = prefill_chunk
    return kw


def first_token(model: Any, ids, cfg, prefill_chunk: int) -> dict:
    """One request: TTFT (cache creation, prefix load and prefill until the first token's
    logits), its logits [V], what was computed, loaded and read from disk, and the flush time."""
    import torch

    from tiercache import TieredCache

    io0 = _proc_read_bytes()
    t0 = time.perf_counter()
    cache = TieredCache(model, cfg)
    try:
        loaded = cache.load_prefix(ids)
        t_loaded = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, cache=cache, max_new_tokens=1, output_logits=True,
                                 return_dict_in_generate=True,
                                 **_gen_kwargs(ids, prefill_chunk, ids.shape[1] - loaded))
        ttft = time.perf_counter() - t0
        io1 = _proc_read_bytes()
        stats = cache.stats()
        prefix = cache.prefix
        pstats = prefix.store.stats() if prefix is not None else None
    finally:
        t1 = time.perf_counter()
        cache.close()  # writes what this request published down to disk
        flush_s = time.perf_counter() - t1
    result = {"ttft_s": ttft, "load_s": t_loaded - t0, "compute_s": ttft - (t_loaded - t0),
              "prompt_tokens": ids.shape[1], "prefill_tokens": stats["prefill_tokens"],
              "reused_tokens": stats["reused_tokens"], "published_blocks": stats["published_blocks"],
              "flush_s": flush_s, "logits": out.logits[0][0].float().cpu()}
    if prefix is not None and prefix.remote is not None:  # after close: its writes were sent
        result["remote"] = prefix.remote.stats()
    if pstats is not None:
        disk = prefix.store.disk
        block_bytes = prefix.geometry.block_bytes
        reads = sum(m["blocks"] for name, m in pstats["moves"].items() if name.startswith("disk->"))
        reads += pstats["hits"]["disk"]  # get() straight from disk (no move)
        result.update(disk_blocks_read=reads, disk_bytes_read=reads * block_bytes,
                      loaded_kv_bytes=loaded // prefix.geometry.block_tokens * prefix.num_layers * block_bytes,
                      disk_io_bytes=reads * disk.record_bytes if disk is not None else 0,
                      host_blocks_hit=pstats["hits"]["host"], direct_io=bool(disk is not None and disk.direct_io),
                      process_read_bytes=None if io0 is None or io1 is None else io1 - io0)
    return result


def _proc_read_bytes() -> Optional[int]:
    """Bytes this process caused to be read from storage (/proc/self/io), None if unknown."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _max_diff(a, b) -> float:
    return float((a - b).abs().max().item())


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "logits"}


def worker_cold(args: argparse.Namespace) -> dict:
    """Recompute (reuse off, then cold with reuse on), then warm from host in this process."""
    import torch

    from tiercache.prefix import close_all

    model, ids, cfg = _setup(args)
    out: dict = {"context": ids.shape[1], "block_tokens": cfg.block_tokens, "threads": torch.get_num_threads()}
    if not args.no_baseline:
        plain = cfg.replace(reuse=False, remote_url=None, disk_dir=os.path.join(args.dir, "plain"))
        base = first_token(model, ids, plain, args.prefill_chunk)
        out["no_reuse"] = _public(base)
    cold = first_token(model, ids, cfg, args.prefill_chunk)
    torch.save(cold["logits"], os.path.join(args.dir, "cold_logits.pt"))
    out["cold"] = _public(cold)
    if not args.no_baseline:
        out["cold"]["max_abs_diff_vs_no_reuse"] = _max_diff(cold["logits"], base["logits"])
    warm = first_token(model, ids, cfg, args.prefill_chunk)
    out["warm_host"] = _public(warm)
    out["warm_host"]["max_abs_diff"] = _max_diff(warm["logits"], cold["logits"])
    close_all()  # flush and let go of the directory: the next process opens it
    return out


def worker_disk(args: argparse.Namespace) -> dict:
    """Warm from disk in a fresh process: the page cache dropped first when allowed."""
    import torch

    from tiercache.bench.io import drop_page_cache
    from tiercache.prefix import close_all

    model, ids, cfg = _setup(args)
    dropped = drop_page_cache()
    warm = first_token(model, ids, cfg, args.prefill_chunk)
    cold_logits = torch.load(os.path.join(args.dir, "cold_logits.pt"))
    out = _public(warm)
    out.update(page_cache_dropped=dropped, max_abs_diff=_max_diff(warm["logits"], cold_logits))
    close_all()
    return out


class _FirstTokenClock:
    """A generate() streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.t_first: Optional[float] = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.t_first is None:  # call 1 is the prompt
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def _turn(model: Any, ids, cfg, answer_tokens: int, prefill_chunk: int) -> tuple:
    """One conversation turn: (TTFT, answer ids [1, A], stats)."""
    import torch

    from tiercache import TieredCache

    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    with TieredCache(model, cfg) as cache:
        loaded = cache.load_prefix(ids)
        with torch.inference_mode():
            seq = model.generate(ids, cache=cache, max_new_tokens=answer_tokens, streamer=clock,
                                 **_gen_kwargs(ids, prefill_chunk, ids.shape[1] - loaded))
        stats = cache.stats()
    return clock.t_first - t0, seq[:, ids.shape[1]:], stats


def _context(asked: int, positions: Optional[int]) -> int:
    """The prompt's tokens: ``asked``, less what keeps ``POSITION_MARGIN`` of the model's
    positions free for the answers."""
    return min(asked, positions - POSITION_MARGIN) if positions else asked


def worker_conversation(args: argparse.Namespace) -> dict:
    """``--turns`` turns, each prompt = the previous prompt + its answer + a new user part;
    first without reuse (which fixes the answers), then with reuse on a fresh directory."""
    import torch

    from tiercache.prefix import close_all

    model, ids, cfg = _setup(args)
    turns, answer = args.turns, args.answer_tokens
    part = (ids.shape[1] - turns * answer) // turns
    if part < 1:
        raise ValueError(f"--context {ids.shape[1]} is too short for {turns} turns of {answer}-token answers")
    plain = cfg.replace(reuse=False, remote_url=None, disk_dir=os.path.join(args.dir, "plain"))
    reuse = cfg.replace(disk_dir=os.path.join(args.dir, "conversation"))
    prompts, rows = [], []
    history = ids[:, :0]
    for t in range(turns):
        prompt = torch.cat([history, ids[:, t * part:(t + 1) * part]], dim=1)
        ttft, ans, _ = _turn(model, prompt, plain, answer, args.prefill_chunk)
        prompts.append((prompt, ans))
        rows.append({"turn": t + 1, "prompt_tokens": prompt.shape[1], "no_reuse_ttft_s": ttft})
        history = torch.cat([prompt, ans], dim=1)
    same = True
    for row, (prompt, ans) in zip(rows, prompts):
        ttft, got, stats = _turn(model, prompt, reuse, answer, args.prefill_chunk)
        same = same and torch.equal(got, ans)
        row.update(reuse_ttft_s=ttft, reused_tokens=stats["reused_tokens"], prefill_tokens=stats["prefill_tokens"],
                   speedup=row["no_reuse_ttft_s"] / ttft)
    close_all()
    return {"turns": rows, "answer_tokens": answer, "answers_match": same,
            "no_reuse_total_ttft_s": sum(r["no_reuse_ttft_s"] for r in rows),
            "reuse_total_ttft_s": sum(r["reuse_ttft_s"] for r in rows)}


def worker_remote(args: argparse.Namespace) -> dict:
    """Warm from the remote tier: a fresh process on an empty disk_dir (another machine)."""
    import torch

    from tiercache.prefix import close_all

    model, ids, cfg = _setup(args)
    cfg = cfg.replace(disk_dir=os.path.join(args.dir, "other-machine"))
    warm = first_token(model, ids, cfg, args.prefill_chunk)
    cold_logits = torch.load(os.path.join(args.dir, "cold_logits.pt"))
    out = _public(warm)
    out["max_abs_diff"] = _max_diff(warm["logits"], cold_logits)
    close_all()
    return out


def _drop_namespace(url: str, namespace: str) -> int:
    """Delete the bench's keys from the server; returns how many."""
    import redis

    from tiercache.config import remote_credentials

    user, password = remote_credentials(url)
    client = redis.Redis.from_url(url, username=user, password=password, socket_timeout=30)
    keys = list(client.scan_iter(f"{namespace}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.delete(*keys[i:i + 500])
    client.close()
    return len(keys)


WORKERS = {"cold": worker_cold, "disk": worker_disk, "conversation": worker_conversation, "remote": worker_remote}


# ---- the orchestrating process (no torch) ----------------------------------------------------------
def _spawn(part: str, args: argparse.Namespace, workdir: str) -> dict:
    cmd = [sys.executable, "-m", "tiercache.bench.prefix", "--worker", part, "--dir", workdir,
           "--context", str(args.context), "--turns", str(args.turns), "--answer-tokens", str(args.answer_tokens),
           "--block-tokens", str(args.block_tokens), "--prefill-chunk", str(args.prefill_chunk)]
    if args.model:
        cmd += ["--model", args.model]
    if args.no_baseline:
        cmd.append("--no-baseline")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.remote:
        cmd += ["--remote", args.remote, "--remote-namespace", args.remote_namespace]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        error = worker_failure(proc.stdout)
        if error is not None:  # bad input the parent could not see: its one line, not a traceback
            raise ValueError(f"bench prefix: the {part} process: {error}")
        raise RuntimeError(f"bench prefix: the {part} process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(cold: dict, disk: dict, conversation: Optional[dict], remote: Optional[dict] = None) -> dict:
    """The headline figures (one flat object) with every part's details under ``parts``."""
    recompute = cold["cold"]["ttft_s"]
    out = {
        "context": cold["context"], "block_tokens": cold["block_tokens"], "threads": cold["threads"],
        "recompute_ttft_s": recompute,
        "recompute_no_reuse_ttft_s": cold.get("no_reuse", {}).get("ttft_s"),
        "publish_overhead_s": (recompute - cold["no_reuse"]["ttft_s"]) if "no_reuse" in cold else None,
        "flush_s": cold["cold"]["flush_s"],
        "warm_host_ttft_s": cold["warm_host"]["ttft_s"],
        "warm_host_speedup": recompute / cold["warm_host"]["ttft_s"],
        "warm_disk_ttft_s": disk["ttft_s"],
        "warm_disk_speedup": recompute / disk["ttft_s"],
        # against the recompute that publishes nothing (reuse=False): the stricter ratio
        "warm_disk_speedup_vs_no_reuse": (cold["no_reuse"]["ttft_s"] / disk["ttft_s"]) if "no_reuse" in cold else None,
        "warm_disk_load_s": disk["load_s"], "warm_disk_compute_s": disk["compute_s"],
        "reused_tokens": disk["reused_tokens"], "computed_tokens": disk["prefill_tokens"],
        "disk_bytes_read": disk.get("disk_bytes_read", 0), "disk_io_bytes": disk.get("disk_io_bytes", 0),
        "loaded_kv_bytes": disk.get("loaded_kv_bytes", 0),
        "process_read_bytes": disk.get("process_read_bytes"),
        "direct_io": disk.get("direct_io", False), "page_cache_dropped": disk["page_cache_dropped"],
        "warm_host_max_abs_diff": cold["warm_host"]["max_abs_diff"],
        "warm_disk_max_abs_diff": disk["max_abs_diff"],
        "goal_speedup": 20.0,
    }
    out["goal_met"] = out["warm_disk_speedup"] >= out["goal_speedup"]
    if conversation is not None:
        out["conversation_no_reuse_ttft_s"] = [r["no_reuse_ttft_s"] for r in conversation["turns"]]
        out["conversation_reuse_ttft_s"] = [r["reuse_ttft_s"] for r in conversation["turns"]]
        out["conversation_speedup"] = conversation["no_reuse_total_ttft_s"] / conversation["reuse_total_ttft_s"]
    if remote is not None:
        r = remote.get("remote") or {}
        out.update(warm_remote_ttft_s=remote["ttft_s"], warm_remote_speedup=recompute / remote["ttft_s"],
                   warm_remote_load_s=remote["load_s"], warm_remote_reused_tokens=remote["reused_tokens"],
                   remote_bytes_read=r.get("bytes_read", 0),
                   remote_bytes_written=(cold["cold"].get("remote") or {}).get("bytes_written", 0),
                   remote_errors=r.get("errors"), warm_remote_max_abs_diff=remote["max_abs_diff"])
    out["parts"] = {"cold": cold, "warm_disk": disk, "conversation": conversation, "warm_remote": remote}
    return out


def format_report(r: dict) -> str:
    mib = 2 ** 20
    lines = [f"time to first token, {r['context']}-token prompt, block_tokens={r['block_tokens']}, "
             f"{r['threads']} torch thread(s):",
             f"  recompute (cold, publishing)  {r['recompute_ttft_s']:8.3f} s"]
    if r["recompute_no_reuse_ttft_s"] is not None:
        lines.append(f"  recompute (reuse off)         {r['recompute_no_reuse_ttft_s']:8.3f} s   publishing costs "
                     f"{r['publish_overhead_s']:+.3f} s; writing to disk after the answer {r['flush_s']:.3f} s")
    lines += [f"  warm from host                {r['warm_host_ttft_s']:8.3f} s   {r['warm_host_speedup']:6.1f}x   "
              f"max |logit diff| {r['warm_host_max_abs_diff']:.2e}",
              f"  warm from disk (new process)  {r['warm_disk_ttft_s']:8.3f} s   {r['warm_disk_speedup']:6.1f}x   "
              f"max |logit diff| {r['warm_disk_max_abs_diff']:.2e}"
              + (f"   ({r['warm_disk_speedup_vs_no_reuse']:.1f}x against reuse off)"
                 if r["warm_disk_speedup_vs_no_reuse"] is not None else ""),
              f"    load {r['warm_disk_load_s']:.3f} s + compute {r['warm_disk_compute_s']:.3f} s; "
              f"{r['reused_tokens']} tokens loaded, {r['computed_tokens']} computed; "
              f"{r['disk_bytes_read'] / mib:.1f} MiB of KV read for {r['loaded_kv_bytes'] / mib:.1f} MiB loaded "
              f"({r['disk_io_bytes'] / mib:.1f} MiB of records)"
              + (f", process read {r['process_read_bytes'] / mib:.1f} MiB from storage"
                 if r["process_read_bytes"] is not None else ""),
              f"    direct I/O: {'yes' if r['direct_io'] else 'no (filesystem does not support O_DIRECT)'}; "
              f"page cache dropped: {'yes' if r['page_cache_dropped'] else 'no (needs root)'}",
              f"  goal: warm from disk >= {r['goal_speedup']:.0f}x faster: {'met' if r['goal_met'] else 'MISSED'}"]
    if "warm_remote_ttft_s" in r:
        lines += [f"  warm from remote (new process, empty disk_dir) {r['warm_remote_ttft_s']:8.3f} s   "
                  f"{r['warm_remote_speedup']:6.1f}x   max |logit diff| {r['warm_remote_max_abs_diff']:.2e}",
                  f"    load {r['warm_remote_load_s']:.3f} s; {r['warm_remote_reused_tokens']} tokens loaded; "
                  f"{r['remote_bytes_read'] / mib:.1f} MiB read from the server "
                  f"({r['remote_bytes_written'] / mib:.1f} MiB written by the cold request); "
                  f"errors {({k: n for k, n in (r['remote_errors'] or {}).items() if n}) or 'none'}"]
    conv = r["parts"]["conversation"]
    if conv is not None:
        lines.append(f"conversation of {len(conv['turns'])} turns ({conv['answer_tokens']}-token answers), TTFT:")
        for row in conv["turns"]:
            lines.append(f"  turn {row['turn']}: {row['prompt_tokens']:6d} tokens   "
                         f"no reuse {row['no_reuse_ttft_s']:7.3f} s   reuse {row['reuse_ttft_s']:7.3f} s "
                         f"({row['reused_tokens']} loaded)   "
                         f"{row['speedup']:5.1f}x")
        lines.append(f"  total: no reuse {conv['no_reuse_total_ttft_s']:.2f} s, "
                     f"reuse {conv['reuse_total_ttft_s']:.2f} s ({r['conversation_speedup']:.1f}x); "
                     f"answers identical: {conv['answers_match']}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="tiercache bench prefix", description=doc_summary(__doc__))
    p.add_argument("--context", type=int, default=8192, help="prompt tokens, at most the model's positions "
                   f"minus {POSITION_MARGIN} (default %(default)s)")
    p.add_argument("--turns", type=int, default=5, help="conversation turns; 0 skips the conversation "
                   "(default %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=16, help="tokens of each conversation answer "
                   "(default %(default)s)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per block: a prompt's last partial "
                   "block is always recomputed, and each block costs a record per layer to load "
                   "(default %(default)s, the fastest measured at 8k on the default model)")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prefill chunk in tokens (default %(default)s)")
    p.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process, >= 1 (default: "
                   "torch's; 1 is steadier on a machine shared with other work)")
    p.add_argument("--no-baseline", action="store_true", help="skip the reuse=False recompute (saves one prefill)")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir under .); the disk "
                   "tier's direct I/O depends on its filesystem")
    p.add_argument("--remote", default=None, help="also measure warm from a Redis/Valkey server at this URL "
                   "(keys in a private namespace, deleted at the end)")
    p.add_argument("--remote-namespace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--worker", default=None, choices=sorted(WORKERS), help=argparse.SUPPRESS)
    return p


def run(argv: Optional[list] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        from tiercache.errors import TierCacheError

        try:
            result = WORKERS[args.worker](args)
        except (TierCacheError, ValueError) as exc:  # the parent shows this line, not a traceback
            print(json.dumps({WORKER_ERROR: str(exc)}))
            return 2
        print(json.dumps(result))
        return 0
    for flag, value, low in (("--context", args.context, 2), ("--turns", args.turns, 0),
                             ("--answer-tokens", args.answer_tokens, 1), ("--block-tokens", args.block_tokens, 1),
                             ("--prefill-chunk", args.prefill_chunk, 1), ("--threads", args.threads, 1)):
        # --threads -2 was a torch traceback, 0 silently torch's default; --prefill-chunk 0 silently no chunking
        if value is not None and value < low:
            raise ValueError(f"{flag}: must be >= {low}, got {value}")
    work_dir("--dir", args.dir or ".")  # the temporary folder goes here
    from tiercache.models import load_config

    # a bad --model: one line now, not each worker's traceback; and the prompt must fit the
    # model's positions (it was cut to them silently) and hold the conversation's turns
    # (refused only after two whole workers had run)
    limit = model_positions(load_config(args.model)[1])
    context = _context(args.context, limit)  # the prompt the workers make (the default 8192: 8184 tokens)
    if args.turns and (context - args.turns * args.answer_tokens) // args.turns < 1:
        raise ValueError(f"--context: {context} tokens are too short for {args.turns} turns of "
                         f"{args.answer_tokens}-token answers")
    if args.remote:
        import uuid

        from tiercache.config import TierConfig

        TierConfig(disk_dir=args.dir or ".", remote_url=args.remote)  # a bad URL fails now, by name
        args.remote_namespace = f"tiercache-bench-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="tiercache-bench-prefix-", dir=args.dir or ".") as workdir:
        os.chmod(workdir, 0o700)
        log = (lambda m: print(m, file=sys.stderr))
        cut = f" (--context {args.context} cut to the model's {limit} positions less {POSITION_MARGIN})" \
            if context < args.context else ""
        log(f"bench prefix: recompute and warm from host at {context} tokens{cut} ...")
        cold = _spawn("cold", args, workdir)
        log("bench prefix: warm from disk in a fresh process ...")
        disk = _spawn("disk", args, workdir)
        conversation = None
        if args.turns:
            log(f"bench prefix: a conversation of {args.turns} turns, without and with reuse ...")
            conversation = _spawn("conversation", args, workdir)
        remote = None
        if args.remote:
            log("bench prefix: warm from the remote tier in a fresh process on an empty disk_dir ...")
            try:
                remote = _spawn("remote", args, workdir)
            finally:
                _drop_namespace(args.remote, args.remote_namespace)
    report = summarize(cold, disk, conversation, remote)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
