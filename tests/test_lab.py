"""The policy lab: traces recorded from real generation, replayed through the runtime policies."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import tiercache
from tiercache.lab.sim import Bandwidths, InfeasibleBudget, replay
from tiercache.lab.trace import HEADER, TraceError, load_trace, obj_id
from tiercache.policies import LRUPolicy, PrefetchPolicy

from conftest import fixed_tokenizer
from test_hf_exactness import registered

BW = Bandwidths(host_to_device=9e9, device_to_host=9e9, disk_read=1e9, disk_write=1.5e9)
BT = 4  # block tokens
LAYERS, Q_HEADS = 3, 4


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=Q_HEADS, num_key_value_heads=2, initializer_range=0.2,
                                   max_position_embeddings=256, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def record(tmp_path, *, prompt: int = 30, new: int = 12, name: str = "trace.csv", **cfg):
    """Generate with a trace; returns (trace path, logits with the trace, logits without any cache trick)."""
    model = tiny_llama()
    ids = torch.randint(1, 64, (1, prompt), generator=torch.Generator().manual_seed(1))
    gen = dict(do_sample=False, max_new_tokens=new, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, cache=transformers.DynamicCache(), **gen)
    config = tiercache.TierConfig(device_budget=cfg.pop("device_budget", "64KiB"), host_budget="64KiB",
                                  block_tokens=BT, **cfg)
    path = tmp_path / name
    with tiercache.TieredCache(model, config, trace=str(path)) as cache, torch.no_grad():
        out = model.generate(ids, cache=cache, **gen)
    return path, ref, out


def test_a_trace_that_cannot_be_written_still_lets_the_cache_close(tmp_path):
    """``TieredCache(model, cfg, trace="/dev/full")``: the trace's write failed (ENOSPC) in
    close() before anything else closed, so the store's I/O threads and the session folder
    on disk were left behind. Now close() closes the store and removes its files, then
    raises the trace's error."""
    if not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full here")
    model = tiny_llama()
    ids = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    config = tiercache.TierConfig(device_budget="24KiB", host_budget="16KiB", disk_dir=str(tmp_path / "kv"),
                                  disk_budget="1MiB", block_tokens=BT, reuse=False)
    cache = tiercache.TieredCache(model, config, trace="/dev/full")
    with torch.no_grad():
        try:
            model.generate(ids, cache=cache, do_sample=False, max_new_tokens=4)
        except OSError:
            pass  # a row that filled the buffer may have failed already
    with pytest.raises(OSError, match="No space left on device"):
        cache.close()
    assert cache.closed and cache.store.closed
    sessions = tmp_path / "kv" / "sessions"
    assert not sessions.exists() or not any(sessions.iterdir())


def test_a_trace_writer_that_failed_raises_its_own_error_again():
    """A TraceWriter without ``defer_errors`` (``TieredCache(trace=path)``) on a full disk:
    the first failed write closed the file, and every later row then raised "I/O operation
    on closed file" from inside the model's forward, while close() said nothing (a review).
    Each later row raises the disk's own error again, and close() stays quiet: it was said."""
    from tiercache.lab.trace import TraceWriter

    if not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full here")
    writer = TraceWriter("/dev/full")
    keys = [(0, 0, i) for i in range(40000)]  # past the 1 MiB buffer: a write to the file
    with pytest.raises(OSError, match="No space left on device"):
        writer.record("r", keys, 512, 0, 4)
    with pytest.raises(OSError, match="No space left on device"):
        writer.record("r", keys[:1], 512, 1, 4)
    writer.close()
    assert isinstance(writer.error, OSError)


def test_recorded_trace_is_every_access_and_changes_nothing(tmp_path):
    """Recording a trace (and the attention hook that scores blocks) leaves the logits equal to
    DynamicCache's; the file holds one write row per block written and one read row per block
    attention read, per layer and step, with attention scores that sum to one per head."""
    path, ref, out = record(tmp_path, prompt=30, new=12)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert path.read_text().splitlines()[0] == ",".join(HEADER)
    trace = load_trace(str(path))
    assert trace.num_layers == LAYERS and trace.total_tokens == 30 + 11
    for step in range(12):
        seen = 30 + step if step else 30  # tokens in the cache after this forward
        seen = 30 if step == 0 else 30 + step
        for layer in range(LAYERS):
            rows = (trace.step == step) & (trace.layer == layer)
            reads = trace.block[rows & ~trace.is_write]
            assert reads.tolist() == list(range(-(-seen // BT))), (step, layer)
            writes = trace.block[rows & trace.is_write]
            first_new = (seen - (30 if step == 0 else 1)) // BT
            assert writes.tolist() == list(range(first_new, -(-seen // BT)))
            mass = trace.score[rows & ~trace.is_write]
            assert np.isfinite(mass).all()
            assert mass.sum() == pytest.approx(Q_HEADS, rel=1e-4)  # each query head's row sums to one
    assert set(trace.obj_size.tolist()) == {2 * 1 * 2 * BT * 16 * 4}
    assert trace.obj_id[0] == obj_id(int(trace.seq[0]), 0, 0)


@pytest.mark.parametrize("content,message", [
    ("a,b,c\n1,2,3\n", "not a tiercache trace"),
    ("time,obj_id,obj_size\n1,2,3\n", "lacks the column"),
    (",".join(HEADER) + "\n1,2,3,read,0,0,x,0,1,\n", "line 2 is malformed"),
    (",".join(HEADER) + "\n5,2,3,read,0,0,2,0,1,\n4,2,3,read,0,0,2,0,1,\n", "goes backwards"),
    (",".join(HEADER) + "\n5,2,3,erase,0,0,2,0,1,\n", "line 2 is malformed"),
    # a header only was a ZeroDivisionError; a number past int64 an OverflowError; the rest
    # replayed into figures that meant nothing (negative sizes, ids that are not the key,
    # two runs' blocks of other sizes glued together)
    (",".join(HEADER) + "\n", "no rows"),
    (",".join(HEADER) + "\n99999999999999999999999,2,3,read,0,0,2,0,1,\n", "line 2 is malformed"),
    (",".join(HEADER) + "\n5,2,-3,read,0,0,2,0,1,\n", "obj_size -3 is not positive"),
    (",".join(HEADER) + "\n5,7,3,read,0,0,2,0,1,\n", "obj_id 7 is not seq<<40"),
    (",".join(HEADER) + "\n5,2,3,read,0,0,2,0,1,\n6,2,4,read,0,0,2,0,1,\n", "blocks of 2 sizes"),
    # past obj_id's bit ranges two keys shared an id (layer 65536 of seq 0 was layer 0 of seq
    # 1 to libCacheSim); a size of 2^62 overflowed libCacheSim's budgets, which aborted
    (",".join(HEADER) + f"\n5,{1 << 40},3,read,0,65536,0,0,1,\n", "layer 65536 is more than 65535"),
    (",".join(HEADER) + f"\n5,2,{1 << 62},read,0,0,2,0,1,\n", f"obj_size {1 << 62} is more than {1 << 40}"),
    # int() took these; libCacheSim's reader, replaying the same file, read '4_096' as 4
    (",".join(HEADER) + "\n5,2,4_096,read,0,0,2,0,1,\n", "obj_size '4_096' is not a plain integer"),
    (",".join(HEADER) + "\n5,2, 3,read,0,0,2,0,1,\n", "obj_size ' 3' is not a plain integer"),
    (",".join(HEADER) + "\n5,2,3,read,0,0,2,0,1,\n\n", "line 3 is blank"),  # was "list index out of range"
])
def test_bad_trace_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(str(path))


def write_scan_trace(path, layers: int, blocks: int, rounds: int, size: int = 4096) -> None:
    """``layers`` layers of ``blocks`` blocks each, written once and then read layer by layer
    ``rounds`` times: the cyclic scan that exact attention makes."""
    lines = [",".join(HEADER)]
    t = 0
    for step in range(rounds + 1):
        for layer in range(layers):
            t += 100
            for b in range(blocks):
                op = "write" if step == 0 else "read"
                lines.append(f"{t},{obj_id(1, layer, b)},{size},{op},1,{layer},{b},{step},{blocks if step == 0 else 1},")
    path.write_text("\n".join(lines) + "\n")


def test_cyclic_scan_defeats_lru_and_fifo_in_the_replay(tmp_path):
    """The classic result, through the runtime's own LRU and FIFO replayed request by request: a
    loop one block larger than the device never hits; a loop that fits hits on every read after
    the first writes. The runtime pins the layer being read, so its victims come from the next
    layers and some reads do hit: pinning is part of what the replay models."""
    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=5, blocks=2, rounds=5)
    trace = load_trace(str(path))
    for policy in ("lru", "fifo"):
        small = replay(trace, policy, 9 * 4096, bandwidths=BW, pin_reads=False)
        assert small["tier_hit_ratio"]["device"] == 0.0, policy
        assert small["tier_hit_ratio"]["host"] == pytest.approx(50 / 60)
        pinned = replay(trace, policy, 9 * 4096, bandwidths=BW)
        assert pinned["tier_hit_ratio"]["device"] > 0.0, policy
        fits = replay(trace, policy, 10 * 4096, bandwidths=BW)
        assert fits["hit_ratio"] == pytest.approx(50 / 60), policy
        assert fits["tier_hit_ratio"]["miss"] == pytest.approx(10 / 60)
        # only the write-behind of each layer's sealed first block moved: nothing came back up
        assert fits["bytes_moved_by_link"] == {"device->host": 5 * 4096}


def _min_hits(keys: list, slots: int) -> int:
    """Belady's MIN (demand paging) on a list of keys: a reference written for this test."""
    cache: set = set()
    hits = 0
    for i, key in enumerate(keys):
        if key in cache:
            hits += 1
            continue
        if len(cache) >= slots:
            later = {k: next((j for j in range(i + 1, len(keys)) if keys[j] == k), len(keys)) for k in cache}
            cache.remove(max(cache, key=later.get))
        cache.add(key)
    return hits


def test_a_read_that_fetches_its_block_is_a_use_as_in_the_store(tmp_path):
    """The store's ``ensure_device`` inserts a block fetched for a read into the device's
    policy and then touches it (a read is a use); the replay only inserted it. On a pure
    decode scan ``layer-cycle``, which follows the layer being read through touches, then got
    68, 128 and 248 of MIN's 144, 180 and 252 hits here, where the store gets MIN's
    (test_policies.py). Found by a helper's reference simulator."""
    lines = [",".join(HEADER)]
    for step in range(10):
        for layer in range(8):
            lines += [f"{(step * 8 + layer) * 100},{obj_id(1, layer, b)},4096,read,1,{layer},{b},{step},1,"
                      for b in range(4)]
    path = tmp_path / "scan.csv"
    path.write_text("\n".join(lines) + "\n")
    trace = load_trace(str(path))
    keys = list(zip(trace.layer.tolist(), trace.block.tolist()))
    for slots in (16, 20, 28):
        r = replay(trace, "layer-cycle", slots * 4096, bandwidths=BW, pin_reads=False)
        assert round(r["tier_hit_ratio"]["device"] * len(trace)) == _min_hits(keys, slots), slots


def test_a_block_written_and_then_evicted_in_one_forward_is_not_a_hit(tmp_path):
    """One forward of one layer writes blocks 0..3 and attention reads them. Without pinned
    reads and with one device slot, the writes evict each other: the reads are not device
    hits (4 of 8 were counted, and policies beat Belady on 237 traces of a helper's)."""
    lines = [",".join(HEADER)] + [f"{t},{obj_id(1, 0, t % 4)},4096,{'write' if t < 4 else 'read'},1,0,{t % 4},0,1,"
                                  for t in range(8)]
    path = tmp_path / "written.csv"
    path.write_text("\n".join(lines) + "\n")
    r = replay(load_trace(str(path)), "lru", 4096, bandwidths=BW, pin_reads=False)
    assert r["tier_hit_ratio"]["device"] == 0.0 and r["tier_hit_ratio"]["host"] == 0.5


def test_replay_refuses_a_device_smaller_than_one_layer(tmp_path):
    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=2, blocks=5, rounds=2)
    with pytest.raises(InfeasibleBudget, match="device budget >= 20480 bytes"):
        replay(load_trace(str(path)), "lru", 4 * 4096, bandwidths=BW)
    with pytest.raises(ValueError, match=r"host_budget: 4095 bytes is less than one block .*or 0 for no host tier"):
        replay(load_trace(str(path)), "lru", 10 * 4096, host_budget=4095, bandwidths=BW)


def test_replay_budgets_and_bytes_add_up(tmp_path):
    """On a trace from a real run with three tiers: hit ratios per tier sum to one; a larger
    device budget never moves more bytes under LRU with no prefetch; with a tiny host tier, blocks
    go down to disk and come back from it."""
    path, _, _ = record(tmp_path, prompt=40, new=16)
    trace = load_trace(str(path))
    block = trace.block_bytes
    per_layer = -(-(40 + 15) // BT)
    prev = None
    for blocks in (per_layer + 2, 2 * per_layer, 3 * per_layer):
        r = replay(trace, "lru", blocks * block, host_budget=4 * block, bandwidths=BW)
        assert sum(r["tier_hit_ratio"].values()) == pytest.approx(1.0)
        if prev is not None:
            assert r["bytes_moved"] <= prev
        prev = r["bytes_moved"]
    tight = replay(trace, "lru", (per_layer + 2) * block, host_budget=4 * block, bandwidths=BW)
    assert tight["bytes_moved_by_link"]["host->disk"] > 0 and tight["bytes_moved_by_link"]["disk->host"] > 0
    assert tight["tier_hit_ratio"]["disk"] > 0 and tight["est_stall_seconds"] > 0


def test_prefetch_in_the_replay_turns_lower_tier_hits_into_device_hits(tmp_path):
    """next-layer prefetch fetches layer i+1 while layer i computes: device hits go up, and with
    links as fast as in the trace's compute clock nothing is late; a slow link makes them late."""
    path, _, _ = record(tmp_path, prompt=40, new=16)
    trace = load_trace(str(path))
    budget = (2 * -(-(40 + 15) // BT) + 2) * trace.block_bytes
    none = replay(trace, "lru", budget, prefetch="none", bandwidths=BW)
    ahead = replay(trace, "lru", budget, prefetch="next-layer", bandwidths=BW)
    assert ahead["hit_ratio"] > none["hit_ratio"]
    assert ahead["prefetches"]["issued"] > 0 and ahead["prefetches"]["used"] > 0
    assert ahead["est_stall_seconds"] < none["est_stall_seconds"]
    slow = Bandwidths(host_to_device=1e3, device_to_host=1e3, disk_read=1e3, disk_write=1e3)
    late = replay(trace, "lru", budget, prefetch="next-layer", bandwidths=slow)
    assert late["prefetches"]["late"] > 0
    for result in (ahead, late):  # every prefetch is accounted for, those still on the device at the end too
        p = result["prefetches"]
        assert p["issued"] == p["used"] + p["late"] + p["unused"], p


def test_live_runs_give_the_prefetch_depth_only_to_the_policies_that_read_it(tmp_path, monkeypatch):
    """``compare --live`` sweeps prefetch policies over a base config that sets
    ``prefetch="lookahead", prefetch_depth=3``. Each run's config was the base with only the
    prefetch switched: history, next-layer and none kept the depth, which the config refuses
    for them (they are built without one), so their rows were errors instead of runs. Now
    only lookahead (``PREFETCH_DEPTH_POLICIES``) gets the base's depth, and it does build
    with 3 layers ahead; the others run at the default depth. Real generation with a tiny
    model; the caches' own ``_set_prefetch`` is watched, not replaced."""
    from tiercache.hf import TieredCache
    from tiercache.lab.compare import live_runs

    ids = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(2))

    built = []
    real = TieredCache._set_prefetch

    def watched(self, name, depth):
        real(self, name, depth)
        built.append((self.tier_config.prefetch, self.tier_config.prefetch_depth,
                      getattr(self.prefetch_policy, "depth", None)))

    monkeypatch.setattr(TieredCache, "_set_prefetch", watched)
    base = tiercache.TierConfig(device_budget="64KiB", host_budget="64KiB", block_tokens=BT,
                                prefetch="lookahead", prefetch_depth=3)
    prefetches = ("lookahead", "history", "next-layer", "none")
    rows = live_runs("x", base, ["lru"], [base.device_budget], prefetches, model=tiny_llama(),
                     tokenizer=fixed_tokenizer(ids), max_new_tokens=3, chat=False)
    assert [r["prefetch"] for r in rows] == list(prefetches)
    assert not [r["error"] for r in rows if "error" in r]
    assert all(r["decode_tps"] > 0 for r in rows)
    # (config's prefetch, config's depth, the policy's own depth): history and next-layer
    # look 1 layer ahead whatever the config says, none has no depth
    assert built == [("lookahead", 3, 3), ("history", 2, 1), ("next-layer", 2, 1), ("none", 2, None)]


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_compare_cli_json_and_table(tmp_path):
    path, _, _ = record(tmp_path, prompt=40, new=8)
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"h2d_gbps": 9.0, "d2h_gbps": 9.0, "read_gbps": 1.0, "write_gbps": 1.5}))
    proc = cli("compare", "--trace", str(path), "--policies", "lru,fifo", "--budgets", "12KiB,24KiB,1KiB",
               "--libcachesim", "none", "--io-json", str(io), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    got = {(r["policy"], r["prefetch"], r["budget_bytes"]) for r in report["results"]}
    assert got == {(p, f, b) for p in ("lru", "fifo") for f in ("none", "next-layer") for b in (12288, 24576)}
    for r in report["results"]:
        assert 0 <= r["hit_ratio"] <= 1 and r["bytes_moved"] >= 0 and "est_stall_seconds" in r
    assert {s["budget_bytes"] for s in report["skipped"]} == {1024}
    assert report["bandwidths_gbps"]["disk_read"] == 1.0
    text = cli("compare", "--trace", str(path), "--policies", "lru", "--budgets", "24KiB",
               "--libcachesim", "none", "--io-json", str(io))
    assert text.returncode == 0 and "lru" in text.stdout and "next-layer" in text.stdout


def test_a_lab_host_budget_of_exactly_one_block_is_taken():
    """The boundary of the refusal of a small --lab-host-budget (below): one block's bytes
    hold one block (a mutation review found only a budget of 1 byte tested)."""
    from tiercache.lab.sim import check_host_budget

    check_host_budget(4096, 4096, "--lab-host-budget")
    check_host_budget(0, 4096, "--lab-host-budget")  # no host tier
    with pytest.raises(ValueError, match="4095 bytes is less than one block of the trace"):
        check_host_budget(4095, 4096, "--lab-host-budget")


@pytest.mark.parametrize("args,message", [
    (["--policies", "lru,nope"], "unknown eviction policy 'nope'"),
    (["--prefetch-policies", "soon"], "unknown prefetch policy 'soon'"),
    (["--budgets", "12 parsecs"], "--budgets"),
    # every row skipped and exit 0 (with libCacheSim: its own error, after the replay)
    (["--budgets", "0"], "--budgets: every budget must be > 0 bytes and < 2**63, got 0 bytes (from '0')"),
    (["--budgets", "12KiB,0B"], "--budgets: every budget must be > 0 bytes and < 2**63, got 0 bytes"),
    (["--plot", "/nonexistent-dir/x.png"], "--plot: cannot write"),
    # no --io-json: the link rates are measured in --disk-dir (a FileNotFoundError traceback)
    (["--disk-dir", "/nonexistent-dir"], "--disk-dir: '/nonexistent-dir' does not exist"),
    # under one block it held nothing: the replay ran with no host tier, as 0 asks (a review)
    (["--lab-host-budget", "1"], "--lab-host-budget: 1 bytes is less than one block of the trace (4096 bytes)"),
])
def test_compare_cli_bad_input(tmp_path, args, message):
    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=2, blocks=2, rounds=2)
    proc = cli("compare", "--trace", str(path), "--libcachesim", "none", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compare_cli_budgets_that_no_policy_can_replay_are_an_error(tmp_path):
    """Budgets all under what the trace needs (two blocks of a layer here): every row was
    skipped, and the run printed only the skips and exited 0. Now it is one line naming the
    least budget (at least: what the first step that failed needed; a later step may need
    more, so it does not say that budget is enough), exit 2; a budget under it beside one
    that fits is still a skipped row."""
    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=2, blocks=2, rounds=2)
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"h2d_gbps": 9.0, "d2h_gbps": 9.0, "read_gbps": 1.0, "write_gbps": 1.5}))
    # the runtime's policies need two blocks of a layer; libCacheSim's, one block
    for libcsim, least in (("none", "8.0 KiB (8192 bytes)"), ("lru", "4.0 KiB (4096 bytes)")):
        if libcsim != "none":
            pytest.importorskip("libcachesim")
        proc = cli("compare", "--trace", str(path), "--budgets", "1KiB,2KiB", "--libcachesim", libcsim,
                   "--io-json", str(io), "--json")
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.strip() == ("tiercache: error: --budgets: no policy can replay scan.csv at 1.0 KiB, "
                                       f"2.0 KiB; it needs at least {least}")
    proc = cli("compare", "--trace", str(path), "--budgets", "1KiB,12KiB", "--libcachesim", "none",
               "--io-json", str(io), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {r["budget_bytes"] for r in report["results"]} == {12288}
    assert {s["budget_bytes"] for s in report["skipped"]} == {1024}


@pytest.mark.parametrize("io,message", [
    ({"results": []}, "a sweep with no results"),  # an IndexError
    ({"h2d_gbps": 0, "d2h_gbps": 9, "read_gbps": 1, "write_gbps": 1}, "h2d_gbps must be a positive"),  # 1/0
    ({"h2d_gbps": 9, "d2h_gbps": 9, "read_gbps": float("nan"), "write_gbps": 1}, "read_gbps must be"),  # NaN JSON
    ({"h2d_gbps": 9, "d2h_gbps": -9, "read_gbps": 1, "write_gbps": 1}, "d2h_gbps must be"),  # negative stalls
    ({"h2d_gbps": True, "d2h_gbps": 9, "read_gbps": 1, "write_gbps": 1}, "h2d_gbps must be"),  # 1 GB/s
])
def test_compare_cli_bad_io_json_is_one_line(tmp_path, io, message):
    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=2, blocks=2, rounds=2)
    io_path = tmp_path / "io.json"
    io_path.write_text(json.dumps(io))
    proc = cli("compare", "--trace", str(path), "--libcachesim", "none", "--io-json", str(io_path), "--json")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compare_cli_missing_trace_is_one_line(tmp_path):
    proc = cli("compare", "--trace", str(tmp_path / "none.csv"), "--libcachesim", "none")
    assert proc.returncode == 2 and "cannot read trace" in proc.stderr and "Traceback" not in proc.stderr


def test_runtime_lru_and_fifo_agree_with_libcachesim(tmp_path):
    """The policy classes the runtime uses, replayed request by request, agree with
    libCacheSim's LRU and FIFO on a trace of a real run within one percentage point at every
    budget; Belady's optimum is above every runtime policy, pinned or not."""
    from tiercache.lab.libcsim import replay_libcachesim
    from tiercache.policies import EVICTION_POLICIES

    path, _, _ = record(tmp_path, prompt=60, new=24)
    trace = load_trace(str(path))
    per_layer = -(-(60 + 23) // BT)
    budgets = [n * trace.block_bytes for n in (per_layer + 1, 2 * per_layer, 3 * per_layer - 4, 3 * per_layer)]
    ref = {(r["policy"], r["budget_bytes"]): r["hit_ratio"]
           for r in replay_libcachesim(str(path), ["lru", "fifo", "belady"], budgets)}
    for budget in budgets:
        for policy in ("lru", "fifo"):
            ours = replay(trace, policy, budget, bandwidths=BW, pin_reads=False)["hit_ratio"]
            theirs = ref[(f"libcachesim:{policy}", budget)]
            assert abs(ours - theirs) <= 0.01, (policy, budget, ours, theirs)
        belady = ref[("libcachesim:belady", budget)]
        for policy in EVICTION_POLICIES:
            for pinned in (True, False):
                ours = replay(trace, policy, budget, bandwidths=BW, pin_reads=pinned)["hit_ratio"]
                assert ours <= belady + 1e-9, (policy, pinned, budget, ours, belady)


class _CopyOfLRU(LRUPolicy):
    """A plug-in that is lru under another name: the check must not change a figure."""


class _RaisesOnTouch(LRUPolicy):
    def touch(self, key) -> None:
        raise RuntimeError("touch broke")


class _EvictsTheNewest(LRUPolicy):
    """Names the most recently used block, ignoring ``is_evictable`` (pinned reads)."""

    def evict(self, n, is_evictable):
        return list(self._order)[-n:]


class _EvictsThroughAGenerator(LRUPolicy):
    """lru's victims, handed back as a generator (the contract asks for a list; a generator
    of the same keys is read once and then checked: the check used it up, and the replay
    got [] for 'nothing may leave')."""

    def evict(self, n, is_evictable):
        victims = super().evict(n, is_evictable)
        return None if victims is None else (key for key in victims)


class _PlansUnhashable(PrefetchPolicy):
    def plan(self, layer_idx, num_layers, blocks_of_layer):
        return [[layer_idx]]


@pytest.mark.parametrize("kind,cls,message", [
    ("eviction", _RaisesOnTouch, r"the eviction policy 'plugin' failed in touch \(the \w+ tier\): RuntimeError"),
    ("eviction", _EvictsTheNewest, r"the eviction policy 'plugin' broke the contract of evict .*may not be evicted"),
    ("prefetch", _PlansUnhashable, r"the prefetch policy 'plugin' broke the contract of plan: .*not hashable"),
])
def test_replay_stops_at_a_plugin_policys_wrong_answer(tmp_path, kind, cls, message):
    """The lab's replay reports what a policy decided, so a plug-in's wrong answer must stop it
    with a PolicyError naming the policy: answered by lru instead (as the runtime's guard does
    to keep the data), the report would give lru's figures under the plug-in's name; let
    through, the victim it may not name (a block of the layer being read) would be dropped all
    the same, or its exception would come from inside the replay. A plug-in that answers as
    lru does gives lru's figures exactly."""
    from tiercache.policies import EVICTION_POLICIES, PREFETCH_POLICIES

    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=5, blocks=2, rounds=5)
    trace = load_trace(str(path))
    registry = EVICTION_POLICIES if kind == "eviction" else PREFETCH_POLICIES
    kwargs = dict(bandwidths=BW, host_budget=4 * 4096)
    with registered(registry, "plugin", cls):
        with pytest.raises(tiercache.PolicyError, match=message):
            if kind == "eviction":
                replay(trace, "plugin", 9 * 4096, **kwargs)
            else:
                replay(trace, "lru", 9 * 4096, prefetch="plugin", **kwargs)
    for same in (_CopyOfLRU, _EvictsThroughAGenerator):
        with registered(EVICTION_POLICIES, "plugin", same):
            for prefetch in ("none", "next-layer"):
                ours = replay(trace, "plugin", 9 * 4096, prefetch=prefetch, **kwargs)
                ref = replay(trace, "lru", 9 * 4096, prefetch=prefetch, **kwargs)
                assert {k: v for k, v in ours.items() if k != "policy"} == \
                    {k: v for k, v in ref.items() if k != "policy"}, same


class _ByLayer(LRUPolicy):
    """lru, with a look at ``key.layer``, as a policy written against the runtime may."""

    def insert(self, key):
        assert key.layer >= 0  # the replay handed plain tuples: "'tuple' object has no attribute 'layer'"
        super().insert(key)


class _PlansFromTheEnd(PrefetchPolicy):
    """Asks for layer -1 (the last, as a Python index would have it)."""

    def plan(self, layer_idx, num_layers, blocks_of_layer):
        return list(blocks_of_layer(-1))


class _EmptiesWhatItIsGiven(PrefetchPolicy):
    """Plans the next layer's blocks, and empties the list it was handed."""

    def plan(self, layer_idx, num_layers, blocks_of_layer):
        keys = blocks_of_layer((layer_idx + 1) % num_layers)
        plan = list(keys)
        keys.clear()
        return plan


def test_the_replay_hands_plugins_what_the_runtime_does(tmp_path):
    """A plug-in runs in the lab as in ``generate()`` (a review found three differences):
    keys are ``BlockKey``s, whose ``.layer`` an eviction policy may read; ``blocks_of_layer``
    refuses a layer the model does not have (it was []); and it returns a list of the
    plug-in's own (the replay's own was handed out: emptying it changed what the replay
    planned next). The last case's figures are next-layer's exactly."""
    from tiercache.policies import EVICTION_POLICIES, PREFETCH_POLICIES

    path = tmp_path / "scan.csv"
    write_scan_trace(path, layers=5, blocks=2, rounds=5)
    trace = load_trace(str(path))
    kwargs = dict(bandwidths=BW, host_budget=4 * 4096)
    with registered(EVICTION_POLICIES, "by-layer", _ByLayer):
        ours = replay(trace, "by-layer", 9 * 4096, **kwargs)
        assert {k: v for k, v in ours.items() if k != "policy"} == \
            {k: v for k, v in replay(trace, "lru", 9 * 4096, **kwargs).items() if k != "policy"}
    with registered(PREFETCH_POLICIES, "from-the-end", _PlansFromTheEnd):
        with pytest.raises(tiercache.PolicyError, match=r"'from-the-end' failed in plan: IndexError: "
                                                         r"blocks_of_layer\(-1\): the model has layers 0 \.\. 4"):
            replay(trace, "lru", 9 * 4096, prefetch="from-the-end", **kwargs)
    with registered(PREFETCH_POLICIES, "empties", _EmptiesWhatItIsGiven):
        ours = replay(trace, "lru", 9 * 4096, prefetch="empties", **kwargs)
    ref = replay(trace, "lru", 9 * 4096, prefetch="next-layer", **kwargs)
    assert {k: v for k, v in ours.items() if k != "prefetch"} == {k: v for k, v in ref.items() if k != "prefetch"}


def test_the_readmes_policy_table_is_the_saved_runs():
    """README's hit-ratio table (8k trace, no prefetch) is docs/bench-policies.json's, which
    `tiercache bench policies --summarize` reads: a rerun that changes one changes the other."""
    import json
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    saved = json.load(open(os.path.join(root, "docs", "bench-policies.json"), encoding="utf-8"))
    got: dict = {}
    for r in saved["results"]:
        if r["trace"] == "8192 tokens" and r.get("prefetch", "none") == "none":
            name = "Belady (libCacheSim)" if r["policy"] == "libcachesim:belady" else r["policy"]
            got.setdefault(name, []).append((r["budget_fraction"], f"{r['hit_ratio']:.2f}"))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    section = readme.split("Device hit ratio without prefetch, 8k trace", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| ([\w() -]+?) \| ([\d. |]+)\|$", section, flags=re.M)
    assert len(rows) == 9
    for name, cells in rows:
        assert [c.strip() for c in cells.split("|")] == [v for _, v in sorted(got[name])], name
