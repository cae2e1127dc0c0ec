"""Faults injected for real, on real files: damaged records, files and indexes, a full or
failing disk, a process killed while writing. The cache detects the damage and recomputes
(the answer stays exactly DynamicCache's), or stops with one clear tiercache error; it never
serves wrong KV and never hangs. `tiercache bench faults` runs the same injections many
times for the README's reliability table."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiercache.bench.faults import FAULTS, inject, tiny_model

from conftest import fill_filesystem

DAMAGE = ["payload byte flipped", "header byte flipped", "data file truncated", "data file deleted",
          "index deleted", "index damaged"]
IO = {"ENOSPC on disk write": "No space left on device", "EIO on disk write": "Input/output error",
      "EIO on disk read": "Input/output error"}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_prefix_cache_is_detected_and_recomputed(kind, seed, model, tmp_path):
    """A prompt's blocks are stored, then one thing is damaged; the next request detects it
    (checksum, missing file, damaged index) and loads only what is intact or recomputes,
    with the exact answer."""
    outcome, detail = inject(kind, model, seed, str(tmp_path))
    assert outcome == "recovered", detail
    if kind in ("payload byte flipped", "header byte flipped"):
        assert "reused 28 tokens" not in detail  # the damaged block (and what extends it) was recomputed
        assert "0 errors detected, 0 records dropped" not in detail
    if kind in ("index deleted", "index damaged"):
        assert "reused 28 tokens" in detail  # rebuilt from the record headers


@pytest.mark.timeout(300)
def test_every_header_flip_lands_on_checked_bytes(model, tmp_path):
    """Seed 6 flipped a byte of the padding after the token ids' checksum, which no check
    reads: nothing was detected, the prefix was reused whole, and the run counted as
    "recovered" (a review). The flips now land on the bytes the checks cover."""
    outcome, detail = inject("header byte flipped", model, 6, str(tmp_path))
    assert outcome == "recovered", detail
    assert "0 errors detected, 0 records dropped" not in detail and "reused 28 tokens" not in detail


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(IO))
def test_a_failing_disk_stops_with_one_clear_error_instead_of_spinning(kind, model, tmp_path):
    """Most of the KV lives on the disk tier; its writes (or reads) start failing. Before,
    the store retried the failing moves forever; now it raises TierIOError naming the
    directory and the OS error, and rolls the moves back."""
    outcome, detail = inject(kind, model, 0, str(tmp_path))
    assert outcome == "error", detail
    assert IO[kind] in detail and "disk tier under" in detail


@pytest.mark.timeout(300)
def test_sigkill_while_writing_leaves_only_intact_blocks(model, tmp_path):
    """A process that publishes prompts' blocks in a loop is killed with SIGKILL at random
    moments (3 times here, 20 in the benchmark); each time the next process opens the
    directory, drops what is torn, and still serves the earlier prompt exactly."""
    for seed in range(3):
        outcome, detail = inject("SIGKILL while writing", model, seed, str(tmp_path))
        assert outcome == "recovered", detail
        assert "reused 28 tokens" in detail


@pytest.mark.timeout(300)
def test_bench_faults_reports_every_fault(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "faults", "--repeat", "1", "--json",
                           "--faults", "index deleted,EIO on disk read", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["fault"]: r for r in json.loads(proc.stdout)["faults"]}
    assert rows["index deleted"]["recovered"] == 1 and rows["EIO on disk read"]["error"] == 1
    assert all(r["WRONG"] == 0 for r in rows.values())
    assert set(FAULTS) >= set(rows)


def test_bench_faults_refuses_zero_injections():
    """``--repeat 0`` printed a table of zeros, which reads as "no wrong answer"."""
    from tiercache.bench.faults import run

    with pytest.raises(ValueError, match="--repeat: must be >= 1, got 0"):
        run(["--repeat", "0"])


def test_pinned_memory_failure_falls_back_to_pageable_with_a_warning(caplog):
    """Asking for pinned host memory where it cannot be had (this CPU-only machine has no
    CUDA driver to pin with) gives page-aligned pageable memory, a warning, and the fallback
    callback that feeds stats()["pinned_fallbacks"]; the pool still works."""
    import torch

    from tiercache.tiers import BlockGeometry, HostPool

    if torch.cuda.is_available():
        pytest.skip("pinning works on this machine")
    calls = []
    geometry = BlockGeometry(1, 2, 4, 8, torch.float32)
    with caplog.at_level("WARNING", logger="tiercache"):
        pool = HostPool(geometry, 3, pin=True, on_pin_fallback=lambda: calls.append(1))
    assert not pool.pinned and calls == [1]
    assert "pinned host memory unavailable" in caplog.text
    block = torch.randn(geometry.shape)
    pool.view(1).copy_(block)
    assert torch.equal(pool.view(1), block) and pool.raw(0).data_ptr() % 4096 == 0


@pytest.fixture
def full_filesystem(tmp_path, small_filesystem):
    """A real 256 KiB tmpfs, filled up (mounting needs root: skipped elsewhere)."""
    mnt = small_filesystem(tmp_path / "small", "256k")
    fill_filesystem(mnt)
    return mnt


@pytest.mark.timeout(120)
def test_a_disk_dir_on_a_full_filesystem_stops_with_one_clear_error(full_filesystem, model):
    """A real full filesystem (not an injected error): the run stops with one tiercache
    error naming the directory and ENOSPC, instead of a traceback from deep inside, hanging
    or losing blocks."""
    from tiercache import TierCacheError, TierConfig
    from tiercache.bench.faults import generate, prompt

    cfg = TierConfig(device_budget="12KiB", host_budget="8KiB", disk_dir=str(full_filesystem / "kv"),
                     disk_budget="16MiB", block_tokens=4, reuse=False)
    with pytest.raises(TierCacheError, match="No space left on device") as err:
        generate(model, prompt(0), cfg)
    assert str(full_filesystem / "kv") in str(err.value)


def test_a_disk_budget_larger_than_the_filesystems_free_space_is_said_at_open(tmp_path, small_filesystem, caplog):
    """Scenario: a disk_dir on a real 256 KiB filesystem with disk_budget 16 MiB. The data
    file grows as blocks go down, and once it filled the filesystem every tier writing
    there (a prefix cache's, a session's) failed with ENOSPC, with nothing said before (a
    review). The open says it now; a budget the filesystem holds says nothing."""
    import torch

    from tiercache import TierConfig
    from tiercache.store import BlockStore
    from tiercache.tiers import BlockGeometry

    mnt = small_filesystem(tmp_path / "small", "256k")
    geometry = BlockGeometry(1, 2, 4, 8, torch.float32)
    for budget, warned in (("16MiB", True), ("64KiB", False)):
        caplog.clear()
        cfg = TierConfig(device_budget="8KiB", host_budget=0, disk_dir=str(mnt / budget), disk_budget=budget,
                         block_tokens=4)
        with caplog.at_level("WARNING", logger="tiercache"):
            BlockStore(cfg, geometry, device=torch.device("cpu"), persistent=False).close()
        assert ("disk_budget holds 16.0 MiB" in caplog.text and "free: writes there may fail" in caplog.text) == warned, \
            (budget, caplog.text)


def test_the_readmes_reliability_table_names_each_fault_as_faults_takes_it():
    """The table's first column names the faults as ``--faults`` takes them, every one once,
    so a reader can rerun a row (its names were prose that ``--faults`` refused)."""
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    section = readme.split("## Reliability", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"^\| `([^`]+)`", section, flags=re.M)
    assert named == list(FAULTS)
