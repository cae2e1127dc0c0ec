"""`tiercache bench io` on a few MiB: every number is there and positive, the JSON parses."""
from __future__ import annotations

import json
import shutil
import statistics

import pytest

from tiercache.bench.io import _interleaved, _rounds_of, measure_io, run

RATE_KEYS = ("write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps",
             "d2h_gbps", "h2d_gbps", "copy_d2h_gbps", "copy_h2d_gbps")
RATIO_KEYS = ("write_ratio", "read_ratio", "d2h_ratio", "h2d_ratio")


@pytest.fixture(autouse=True)
def _keep_page_cache(monkeypatch):
    # dropping the page cache is system-wide: fine for a benchmark run, not for a unit test
    monkeypatch.setattr("tiercache.bench.io.drop_page_cache", lambda: False)


def _tools() -> list:
    return ["dd"] + (["fio"] if shutil.which("fio") else [])


@pytest.mark.parametrize("raw_tool", _tools())
def test_measure_io_reports_every_rate_and_ratio(tmp_path, raw_tool):
    result = measure_io(str(tmp_path), block_tokens=16, total_bytes=2 << 20, workers=2, raw_tool=raw_tool,
                        rounds=3)
    for key in RATE_KEYS + RATIO_KEYS:
        assert result[key] > 0, key
    # every ratio is the median of the three rounds' paired ratios
    assert result["rounds"] == 3
    for phase in ("write", "read", "d2h", "h2d"):
        rounds = result[f"{phase}_round_ratios"]
        assert len(rounds) == 3 and all(r > 0 for r in rounds)
        assert result[f"{phase}_ratio"] == round(statistics.median(rounds), 3)
    assert result["raw_tool"] == raw_tool
    assert result["block_bytes"] == 1536 * 16
    assert result["num_blocks"] == (2 << 20) // (1536 * 16)
    # the store's moves and the raw file are removed afterwards
    assert list(tmp_path.iterdir()) == []


def test_run_json_prints_one_object(tmp_path, capsys):
    assert run(["--json", "--size", "4MiB", "--dir", str(tmp_path), "--block-tokens", "64", "--workers", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_tokens"] == 64 and out["workers"] == 2
    for key in ("read_gbps", "write_gbps", "raw_read_gbps", "raw_write_gbps", "read_ratio", "write_ratio",
                "h2d_ratio", "d2h_ratio"):
        assert out[key] > 0, key
    assert "sweep" not in out
    assert out["rounds"] == 2 and len(out["read_round_ratios"]) == 2  # 64 MiB rounds, at least two
    assert run(["--json", "--size", "4MiB", "--dir", str(tmp_path), "--block-tokens", "64", "--workers", "2",
                "--round-size", "1MiB"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"] == 4


def test_run_sweep_table_and_bad_arguments(tmp_path, capsys, monkeypatch):
    # two sizes instead of five, 1 MiB each: only the table's shape is checked
    monkeypatch.setattr("tiercache.bench.io.SWEEP_BLOCK_TOKENS", (16, 32))
    assert run(["--sweep", "--size", "1MiB", "--dir", str(tmp_path), "--block-tokens", "32", "--workers", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "block_tokens" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == ["16", "32*"]
    assert run(["--size", "lots", "--dir", str(tmp_path)]) == 2
    assert "--size" in capsys.readouterr().err
    assert run(["--round-size", "0", "--dir", str(tmp_path)]) == 2
    assert "--round-size" in capsys.readouterr().err
    assert run(["--size", "100TiB", "--dir", str(tmp_path)]) == 1  # more than the disk has
    assert "free" in capsys.readouterr().err


def test_the_store_and_the_raw_tool_take_turns_on_the_same_requests():
    # Ten blocks in four rounds: the raw tool gets the very requests the store gets in each
    # round, and who goes first alternates, so a slow spell of the disk hits both alike.
    keys = list(range(10))
    groups = _rounds_of(keys, 4)
    assert [len(g) for g in groups] == [2, 3, 2, 3] and sum(groups, []) == keys
    turns = []

    def store(group):
        turns.append(("store", group[0], len(group)))
        return 0.5

    def raw(first, n):
        turns.append(("raw", first, n))
        return 0.25, n * 100

    out = _interleaved(groups, store, raw)
    assert turns == [("store", 0, 2), ("raw", 0, 2), ("raw", 2, 3), ("store", 2, 3),
                     ("store", 5, 2), ("raw", 5, 2), ("raw", 7, 3), ("store", 7, 3)]
    assert out == {"store_s": [0.5] * 4, "raw_s": [0.25] * 4, "raw_bytes": [200, 300, 200, 300]}
    assert _rounds_of(keys[:2], 4) == [[0], [1]]  # fewer blocks than rounds: no empty round
