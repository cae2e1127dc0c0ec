"""`tiercache bench overhead`: the store's books per batch of host<->device moves, warm and
after a cache flush, through the real command line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "overhead", *args],
                          capture_output=True, text=True, timeout=300)


def test_overhead_times_every_batch_size_both_ways_and_both_directions():
    """Two batch sizes, one pass over 64 blocks: a row per (batch, direction) with its number
    of rounds and warm and cold times per round and per block that agree with each other,
    and the store's books checked at the end (``measure_overhead`` calls ``check()``)."""
    proc = bench("--json", "--repeat", "1", "--batches", "4,8", "--flush", "8MiB")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["flush_bytes"] == 8 << 20 and out["device"] == "cpu"
    assert [(r["blocks"], r["phase"], r["rounds"]) for r in out["rows"]] == [
        (4, "d2h", 16), (4, "h2d", 16), (8, "d2h", 8), (8, "h2d", 8)]  # 64 blocks, 8 batches of the largest
    for r in out["rows"]:
        assert r["warm_ms"] > 0 and r["cold_ms"] > 0
        assert r["warm_us_per_block"] == pytest.approx(r["warm_ms"] * 1e3 / r["blocks"], rel=0.01)
        assert r["cold_us_per_block"] == pytest.approx(r["cold_ms"] * 1e3 / r["blocks"], rel=0.01)
        assert r["cold_extra_ms"] == pytest.approx(r["cold_ms"] - r["warm_ms"], abs=1e-3)


def test_overhead_with_the_exporter_attached_counts_every_move_in_its_histogram():
    """``--metrics`` times the books with the Prometheus exporter listening, as
    ``serve_metrics`` leaves it: its move histogram counted every block moved (warm and
    cold rounds, both directions), though a batch is one event."""
    proc = bench("--json", "--repeat", "1", "--batches", "4,8", "--flush", "1MiB", "--metrics")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["metrics"] is True
    assert out["exported_moves"] == sum(r["rounds"] * r["blocks"] * 2 for r in out["rows"]) == 512


def test_overhead_prints_a_table_without_json():
    proc = bench("--repeat", "1", "--batches", "2", "--flush", "1MiB")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "cold = after a 1.0 MiB copy" in lines[0]
    assert [line.split()[:2] for line in lines[2:]] == [["2", "d2h"], ["2", "h2d"]]


@pytest.mark.parametrize("args,message", [
    (["--batches", "1,8"], "--batches: 1 must be in [2, 4096]"),
    (["--batches", "ten"], "--batches: 'ten' is not an integer"),
    (["--batches", "100000000"], "--batches: 100000000 must be in [2, 4096]"),  # was pools of 6 TiB
    (["--batches", "8,,16"], "--batches: an empty item in '8,,16'"),
    (["--repeat", "0"], "--repeat: must be >= 1"),
    (["--flush", "0"], "--flush: must be > 0"),
    (["--flush", "lots"], "--flush: cannot parse 'lots'"),
    (["--device", "tpu"], "--device: cpu or cuda, got 'tpu'"),
    (["--flush", "64TiB"], "--flush: two buffers of 64.0 TiB are more than half of this machine's memory"),
])
def test_overhead_refuses_bad_input_in_one_line(args, message):
    proc = bench(*args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_overhead_on_cuda_is_refused_in_one_line_without_cuda():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/test_gpu.py runs it")
    proc = bench("--device", "cuda")
    assert proc.returncode == 2
    assert "--device cuda: no CUDA device here" in proc.stderr and "Traceback" not in proc.stderr
