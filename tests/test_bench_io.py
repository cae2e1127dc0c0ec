"""`tiercache bench io` on a few MiB: every number is there and positive, the JSON parses."""
from __future__ import annotations

import json
import re
import shutil
import statistics

import pytest

import torch

from tiercache import Tier
from tiercache.bench.io import PoolCopy, _interleaved, _rounds_of, measure_io, run
from tiercache.transfer import wait_all

RATE_KEYS = ("write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps",
             "d2h_gbps", "h2d_gbps", "copy_d2h_gbps", "copy_h2d_gbps",
             "flat_copy_d2h_gbps", "flat_copy_h2d_gbps")  # flat_*: CPU only
RATIO_KEYS = ("write_ratio", "read_ratio", "d2h_ratio", "h2d_ratio", "flat_d2h_ratio", "flat_h2d_ratio")


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
    flat = ("flat_d2h", "flat_h2d") if result["device"] == "cpu" else ()  # the flat copies are CPU-only
    for phase in ("write", "read", "d2h", "h2d") + flat:
        rounds = result[f"{phase}_round_ratios"]
        assert len(rounds) == 3 and all(r > 0 for r in rounds)
        assert result[f"{phase}_ratio"] == round(statistics.median(rounds), 3)
    assert result["raw_tool"] == raw_tool
    from tiercache.disk import kvikio_status
    assert result["disk_io"] == ("kvikio" if kvikio_status()[0] else "posix")
    assert result["block_bytes"] == 1536 * 16
    assert result["num_blocks"] == (2 << 20) // (1536 * 16)
    # the store's moves and the raw file are removed afterwards
    assert list(tmp_path.iterdir()) == []


def test_measure_io_refuses_a_directory_that_does_not_exist(tmp_path):
    """Called as a library function, measure_io made a missing ``directory`` (and its parents)
    and measured there, where ``bench io --dir`` refuses it as a typo; now it refuses it too,
    by name, and makes nothing. A file in its place was a FileExistsError."""
    missing = tmp_path / "missing" / "deeper"
    with pytest.raises(ValueError, match=f"^directory: {re.escape(repr(str(missing)))} does not exist"):
        measure_io(str(missing), block_tokens=16, total_bytes=2 << 20, workers=2, raw_tool="dd", rounds=2)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"^directory: {re.escape(repr(str(tmp_path / 'file')))} is not a directory"):
        measure_io(str(tmp_path / "file"), block_tokens=16, total_bytes=2 << 20, workers=2, raw_tool="dd", rounds=2)
    assert (tmp_path / "file").read_text() == "x"
    # too little room: named as the library's arguments (it said --dir and --size, the CLI's)
    with pytest.raises(ValueError, match=r"^directory: .* free; this run needs about .* \(lower total_bytes\)"):
        measure_io(str(tmp_path), block_tokens=16, total_bytes=1 << 60, workers=2, raw_tool="dd", rounds=2)


def test_a_raw_tool_that_is_not_installed_is_named_before_anything_runs(tmp_path, monkeypatch, capsys):
    """``bench io --raw-tool fio`` on a machine without fio wrote the store's blocks, then
    failed with ``[Errno 2] No such file or directory: 'fio'`` and exit status 1, as for a
    failing disk (a review). A tool that is not on PATH is now bad input: named, exit 2,
    nothing written."""
    from tiercache.bench.io import run

    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))
    for tool in ("fio", "dd"):
        with pytest.raises(ValueError, match=f"^raw_tool: {tool} is not installed"):
            measure_io(str(tmp_path), block_tokens=16, total_bytes=2 << 20, workers=2, raw_tool=tool, rounds=2)
        assert list(tmp_path.iterdir()) == []
        assert run(["--raw-tool", tool, "--dir", str(tmp_path), "--size", "2MiB", "--block-tokens", "16"]) == 2
        assert f"raw_tool: {tool} is not installed (not on PATH)" in capsys.readouterr().err


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
    assert run(["--size", "100TiB", "--dir", str(tmp_path)]) == 2  # more than the disk has: the input, up front
    assert "free" in capsys.readouterr().err
    # as every other benchmark: a missing --dir is refused, not made (it was, and kept); one
    # where nothing can be made is refused before any work (a PermissionError traceback)
    assert run(["--dir", str(tmp_path / "missing")]) == 2
    assert f"--dir: {str(tmp_path / 'missing')!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    assert run(["--dir", "/proc/self"]) == 2
    assert "--dir: cannot make a folder in '/proc/self'" in capsys.readouterr().err


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

    # A second baseline (CPU: the flat copy next to the pool copy) sits on the far side of
    # the first one, so the first one is always next to the store.
    turns.clear()

    def flat(first, n):
        turns.append(("flat", first, n))
        return 0.125, n * 100

    out = _interleaved(groups[:2], store, raw, flat)
    assert turns == [("store", 0, 2), ("raw", 0, 2), ("flat", 0, 2),
                     ("flat", 2, 3), ("raw", 2, 3), ("store", 2, 3)]
    assert out["flat_s"] == [0.125, 0.125] and out["flat_bytes"] == [200, 300]


def test_the_pool_baseline_copies_the_very_bytes_the_store_moved(make_store, geometry):
    """On CPU the host<->device baseline copies the same bytes between the same addresses as
    the store's round (its own pools), so where buffers happen to lie in memory weighs on
    both alike. Proof that it copies exactly those bytes: after the store's moves the
    destination slots are scribbled over, the baseline's copy restores them, and every
    block reads back exact, for device->host and for host->device."""
    store = make_store(device_blocks=6, host_blocks=6, disk_blocks=0, io_workers=2)
    data = {key: torch.randn(geometry.shape, generator=torch.Generator().manual_seed(i))
            for i, key in enumerate(_keys(6))}
    for key, block in data.items():
        store.put(key, block)
    keys = list(data)
    d2h = PoolCopy(store, "d2h")
    with pytest.raises(RuntimeError, match="no moved group"):
        d2h.copy(0, 3)
    d2h.before(keys[1:4])
    assert wait_all(store.demote_many(keys[1:4])) == []
    d2h.after(keys[1:4])
    for key in keys[1:4]:
        store.host_pool.raw(store.table.copy(key, Tier.HOST).slot).fill_(0x5A)
    seconds, num_bytes = d2h.copy(1, 3)
    assert seconds > 0 and num_bytes == 3 * geometry.block_bytes
    for key in keys:
        assert torch.equal(store.get(key), data[key])

    h2d = PoolCopy(store, "h2d")
    h2d.before(keys[1:4])
    store.ensure_device(keys[1:4], pin=False)
    h2d.after(keys[1:4])
    for key in keys[1:4]:
        slot = store.device_slot(key)
        store.device_pool.k[:, slot].fill_(7.0)
        store.device_pool.v[:, slot].fill_(7.0)
    assert h2d.copy(1, 3)[1] == 3 * geometry.block_bytes
    for key in keys:
        assert torch.equal(store.get(key), data[key])
    store.check()


def _keys(n: int) -> list:
    from tiercache import BlockKey

    return [BlockKey(0, 0, i) for i in range(n)]
