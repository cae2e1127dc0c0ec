"""libCacheSim replay of tiercache CSV traces, and the hit-ratio plot."""

from __future__ import annotations

import random
import sys

import pytest

from tiercache.lab.libcsim import LIBCACHESIM_ALGORITHMS, replay_libcachesim

HEADER = "time,obj_id,obj_size,op,seq,layer,block,step,tokens"
BLOCK_BYTES = 4096
NUM_LOOP_BLOCKS = 40
NUM_ROUNDS = 20
ALL_NAMES = sorted(LIBCACHESIM_ALGORITHMS)
# 4 .. 64 blocks: below, at and above the 40-block loop.
BUDGETS = [n * BLOCK_BYTES for n in (4, 10, 20, 39, 40, 64)]


def _obj_id(seq: int, layer: int, block: int) -> int:
    return (seq << 40) | (layer << 24) | block


def _write_trace(path, accesses: list[tuple[int, int, int, str]]) -> None:
    """accesses: (seq, layer, block, op); one row each, 10 us apart."""
    with open(path, "w") as f:
        f.write(HEADER + "\n")
        for i, (seq, layer, block, op) in enumerate(accesses):
            obj = _obj_id(seq, layer, block)
            f.write(f"{i * 10},{obj},{BLOCK_BYTES},{op},{seq},{layer},{block},{i // 8},1\n")


def _scan(num_rounds: int = NUM_ROUNDS) -> list[tuple[int, int, int, str]]:
    # Block b of sequence 1 lives on layer b % 4; the first round writes, later rounds read.
    return [
        (1, b % 4, b, "write" if r == 0 else "read")
        for r in range(num_rounds)
        for b in range(NUM_LOOP_BLOCKS)
    ]


@pytest.fixture(scope="module")
def scan_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("lab") / "scan.csv"
    _write_trace(path, _scan())
    return path


@pytest.fixture(scope="module")
def mixed_results(tmp_path_factory):
    """A scan of sequence 1 interleaved with zipf-ish reads of sequence 2's 100 blocks."""
    pytest.importorskip("libcachesim")
    rng = random.Random(7)
    weights = [1.0 / (k + 1) for k in range(100)]
    accesses = []
    for access in _scan():
        accesses.append(access)
        for block in rng.choices(range(100), weights=weights, k=2):
            accesses.append((2, 0, block, "read"))
    path = tmp_path_factory.mktemp("lab") / "mixed.csv"
    _write_trace(path, accesses)
    skipped: list = []
    return replay_libcachesim(path, ALL_NAMES, BUDGETS, skipped=skipped), len(accesses), skipped


def test_every_algorithm_and_budget_reports_consistent_counts(mixed_results):
    results, num_requests, skipped = mixed_results
    # S3-FIFO under 10 blocks is skipped, saying why: libCacheSim's small FIFO (10% of the
    # bytes) holds no block there, and it reported 0 hits whatever the trace.
    assert [(r["policy"], r["budget_bytes"]) for r in results] == [
        (f"libcachesim:{name}", b) for name in ALL_NAMES for b in BUDGETS
        if not (name == "s3fifo" and b < 10 * BLOCK_BYTES)
    ]
    assert [(s["policy"], s["budget_bytes"]) for s in skipped] == [("libcachesim:s3fifo", 4 * BLOCK_BYTES)]
    assert "small FIFO" in skipped[0]["reason"] and skipped[0]["min_budget_bytes"] == 10 * BLOCK_BYTES
    for r in results:
        assert r["requests"] == num_requests
        assert 0.0 <= r["hit_ratio"] <= 1.0
        assert r["hit_ratio"] == r["hits"] / r["requests"]
        # Every block has the same size, so missed bytes are misses x block.
        assert r["bytes_missed"] == (r["requests"] - r["hits"]) * BLOCK_BYTES


def test_belady_is_at_least_every_online_policy_at_every_budget(mixed_results):
    results, _, _ = mixed_results
    ratio = {(r["policy"], r["budget_bytes"]): r["hit_ratio"] for r in results}
    for budget in BUDGETS:
        best = ratio[("libcachesim:belady", budget)]
        for name in ALL_NAMES:
            if (f"libcachesim:{name}", budget) in ratio:
                assert best >= ratio[(f"libcachesim:{name}", budget)], (name, budget)
    # And it is strictly better where the loop does not fit.
    assert ratio[("libcachesim:belady", 20 * BLOCK_BYTES)] > ratio[("libcachesim:lru", 20 * BLOCK_BYTES)]


def test_lru_on_a_cyclic_scan_hits_nothing_until_the_loop_fits(scan_trace):
    pytest.importorskip("libcachesim")
    # 39 slots for a 40-block loop: LRU always evicts the block needed next.
    too_small, fits = replay_libcachesim(
        scan_trace, ["lru"], [39 * BLOCK_BYTES, NUM_LOOP_BLOCKS * BLOCK_BYTES]
    )
    assert too_small["hits"] == 0 and too_small["hit_ratio"] == 0.0
    # 40 slots: only the first round misses.
    assert fits["hit_ratio"] == pytest.approx((NUM_ROUNDS - 1) / NUM_ROUNDS)
    assert fits["bytes_missed"] == NUM_LOOP_BLOCKS * BLOCK_BYTES


def test_belady_on_a_cyclic_scan_matches_min(scan_trace):
    pytest.importorskip("libcachesim")
    # MIN on a 40-block loop with 39 slots: 40 cold misses, then one miss per 39
    # requests -> 59 misses in 800 (hand-checked against a plain MIN simulation).
    (row,) = replay_libcachesim(scan_trace, ["belady"], [39 * BLOCK_BYTES])
    assert row["requests"] == NUM_LOOP_BLOCKS * NUM_ROUNDS
    assert row["requests"] - row["hits"] == 59


def test_columns_are_found_by_header_name(tmp_path, scan_trace):
    pytest.importorskip("libcachesim")
    # Same requests with the columns shuffled: field numbers come from the header.
    reordered = tmp_path / "reordered.csv"
    with open(scan_trace) as src, open(reordered, "w") as dst:
        for line in src:
            time, obj_id, obj_size, *rest = line.rstrip("\n").split(",")
            dst.write(",".join([*rest, obj_size, obj_id, time]) + "\n")
    budgets = [20 * BLOCK_BYTES, 40 * BLOCK_BYTES]
    assert replay_libcachesim(reordered, ["lru", "belady"], budgets) == replay_libcachesim(
        scan_trace, ["lru", "belady"], budgets
    )


def test_unknown_algorithm_names_the_known_ones(scan_trace):
    with pytest.raises(ValueError, match="'clock'") as excinfo:
        replay_libcachesim(scan_trace, ["lru", "clock"], [BLOCK_BYTES])
    for name in LIBCACHESIM_ALGORITHMS:
        assert name in str(excinfo.value)


def test_bad_inputs_raise_before_libcachesim_can_abort(tmp_path, scan_trace):
    # libCacheSim aborts the process on a missing file or an empty trace.
    with pytest.raises(FileNotFoundError):
        replay_libcachesim(tmp_path / "missing.csv", ["lru"], [BLOCK_BYTES])
    with pytest.raises(ValueError, match="budgets"):
        replay_libcachesim(scan_trace, ["lru"], [0])
    with pytest.raises(ValueError, match="budgets: every budget must be > 0 bytes and < 2"):
        replay_libcachesim(scan_trace, ["lru"], [1 << 63])
    pytest.importorskip("libcachesim")
    # Under one block libCacheSim's S3-FIFO aborted the process (SIGABRT: no table, no
    # error line) from `tiercache compare --budgets 8,16,32`: a ValueError, or a skipped row.
    with pytest.raises(ValueError, match=r"libcachesim:s3fifo at 8 bytes: a budget under one block \(4096 bytes\)"):
        replay_libcachesim(scan_trace, ["s3fifo"], [8])
    skipped: list = []
    assert replay_libcachesim(scan_trace, ["s3fifo", "belady"], [8, 5 * BLOCK_BYTES], skipped=skipped) == [
        r for r in replay_libcachesim(scan_trace, ["belady"], [5 * BLOCK_BYTES])]
    assert [(s["policy"], s["budget_bytes"]) for s in skipped] == [
        ("libcachesim:s3fifo", 8), ("libcachesim:s3fifo", 5 * BLOCK_BYTES), ("libcachesim:belady", 8)]
    empty = tmp_path / "empty.csv"
    empty.write_text(HEADER + "\n")
    pytest.importorskip("libcachesim")
    with pytest.raises(ValueError, match="no requests"):
        replay_libcachesim(empty, ["belady"], [BLOCK_BYTES])


def test_plot_writes_a_png(tmp_path, mixed_results):
    pytest.importorskip("matplotlib")
    from tiercache.lab.plot import plot_hit_ratio

    results, _, _ = mixed_results
    path = plot_hit_ratio(results, tmp_path / "hr.png", title="mixed")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_one_subplot_per_trace_and_prefetch_labels(tmp_path):
    pytest.importorskip("matplotlib")
    from tiercache.lab.plot import _label, plot_hit_ratio

    rows = [
        {"trace": trace, "policy": policy, "prefetch": prefetch,
         "budget_bytes": mib << 20, "hit_ratio": hit_ratio}
        for trace in ("short", "long")
        for policy, prefetch, hit_ratio in (
            ("lru", "none", 0.2), ("lru", "next-layer", 0.4), ("belady", "none", 0.6)
        )
        for mib in (1, 2, 4)
    ]
    one = plot_hit_ratio([r for r in rows if r["trace"] == "short"], tmp_path / "one.png")
    two = plot_hit_ratio(rows, tmp_path / "two.png")
    assert two.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR width (bytes 16-20): two side-by-side subplots make a twice-as-wide image.
    width = lambda p: int.from_bytes(p.read_bytes()[16:20], "big")  # noqa: E731
    assert width(two) == 2 * width(one)

    assert [_label(r) for r in rows[:9:3]] == ["lru", "lru+next-layer", "Belady (optimal)"]


def test_missing_optional_packages_point_at_the_lab_extra(monkeypatch, scan_trace, tmp_path):
    from tiercache.lab.plot import plot_hit_ratio

    monkeypatch.setitem(sys.modules, "libcachesim", None)
    with pytest.raises(ImportError, match=r"tiercache\[lab\]"):
        replay_libcachesim(scan_trace, ["lru"], [BLOCK_BYTES])
    # Hide matplotlib as if it were not installed (it may already be imported).
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    row = {"policy": "lru", "budget_bytes": 1 << 20, "hit_ratio": 0.5}
    with pytest.raises(ImportError, match=r"tiercache\[lab\]"):
        plot_hit_ratio([row], tmp_path / "x.png")
