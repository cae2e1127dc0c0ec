"""Shared fixtures: tiny block geometries and stores with every tier in use."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

from tiercache import TierConfig
from tiercache.disk import DiskTier
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of small-model tests (they are faster that way and
    leave the other core to parallel work); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def geometry() -> BlockGeometry:
    # 2 * 1 * 2 * 4 * 8 * 4 bytes = 512 bytes per block
    return BlockGeometry(batch=1, kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32)


def tiny_config(tmp_path, geometry: BlockGeometry, device_blocks=3, host_blocks=3, disk_blocks=20, **kw) -> TierConfig:
    """Budgets expressed in blocks of each tier's own unit size."""
    return TierConfig(device_budget=device_blocks * geometry.block_bytes,
                      host_budget=host_blocks * geometry.padded_bytes,
                      disk_budget=disk_blocks * DiskTier.record_size(geometry),
                      disk_dir=str(tmp_path / "kv"), block_tokens=geometry.block_tokens, **kw)


@pytest.fixture
def make_store(tmp_path, geometry):
    stores = []

    def make(**kw) -> BlockStore:
        persistent = kw.pop("persistent", True)
        store = BlockStore(tiny_config(tmp_path, geometry, **kw), geometry, persistent=persistent)
        stores.append(store)
        return store

    yield make
    hung, failed = [], []

    def close(store: BlockStore) -> None:
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001 - a persistent store that lost blocks, say: fails the test
            failed.append(exc)

    for s in stores:
        # close() waits for every move: a move left in flight (a bug) would hang it, so it
        # runs on a thread and the test fails with that reason instead of timing out
        closer = threading.Thread(target=close, args=(s,), daemon=True)
        closer.start()
        closer.join(60)
        if closer.is_alive():
            hung.append(s)
    assert not hung, f"close() hung on {len(hung)} store(s): a move stayed in flight"
    assert not failed, f"close() raised: {failed[0]!r}"


def flip_disk_record(store: BlockStore, key, offset: int = 7) -> None:
    """Flip every bit of one byte of ``key``'s disk record, ``offset`` bytes into its payload,
    under an open store (a record that must now fail its checksum)."""
    from tiercache.disk import DATA_NAME, HEADER_BYTES
    from tiercache.table import Tier

    position = store.table.copy(key, Tier.DISK).slot * store.disk.record_bytes + HEADER_BYTES + offset
    with open(os.path.join(store.disk.directory, DATA_NAME), "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


def fixed_tokenizer(ids: torch.Tensor):
    """A stand-in for what ``tiercache.generation.generate_text`` reads of a tokenizer: any
    text encodes to ``ids`` (with a full attention mask), ids decode to their numbers."""

    class Tokenizer:
        chat_template, pad_token_id, eos_token_id = None, 0, None

        def __call__(self, text, return_tensors="pt"):
            return {"input_ids": ids.clone(), "attention_mask": torch.ones_like(ids)}

        def decode(self, new_ids, skip_special_tokens=True):
            return " ".join(map(str, new_ids.tolist()))

    return Tokenizer()


@pytest.fixture
def small_filesystem():
    """Mount a real tmpfs of ``size`` at a path (needs root: skipped elsewhere); unmounted after."""
    mounted = []

    def mount(path, size: str):
        os.makedirs(path, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(path)
        return path

    yield mount
    from tiercache.prefix import close_all

    close_all()  # prefix caches hold files there
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_filesystem(path) -> None:
    """Write a file ``filler`` in ``path`` until its filesystem is full (ENOSPC)."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _close_prefix_caches():
    """The prefix cache is one per directory, model and geometry in a process, kept open (with
    its I/O threads) until ``close_all``: over a whole run, every test's temporary directory
    left one open, hundreds of idle threads in all. Each test closes what it opened."""
    yield
    from tiercache.prefix import close_all

    close_all()


def line_interrupter(traced: set, target: int, files: tuple = ()) -> tuple:
    """A ``sys.settrace`` tracer that raises KeyboardInterrupt at the ``target``-th line run
    (counting from 1) in the functions ``traced`` names, as (file, function name) pairs, and
    in every function of ``files``, on the main thread only; and the list whose one item
    counts the lines seen (``target=0`` counts them all, for a first run that learns how
    many points there are to try)."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == target:
                raise KeyboardInterrupt
        return local

    def outer(frame, event, arg):
        code = frame.f_code
        mine = code.co_filename in files or (code.co_filename, code.co_name) in traced
        return local if mine and threading.current_thread() is threading.main_thread() else None
    return outer, count


def in_a_forked_child(child, timeout: float = 90.0) -> str:
    """Run ``child()`` in a child made by ``os.fork()`` (as multiprocessing's default start
    method and gunicorn's --preload do); returns what it returned (a str), or raises with
    what it raised. A child still running after ``timeout`` (a hang) is killed and fails
    the test."""
    import signal
    import traceback

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 0
        try:
            os.close(read_end)
            torch.set_num_threads(1)  # libgomp's threads do not survive fork (DataLoader's workers do this too)
            try:
                message = "ok " + child()
            except BaseException:  # noqa: BLE001 - reported to the parent
                message, code = "error " + traceback.format_exc(), 1
            os.write(write_end, message.encode())
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_end)
            pytest.fail(f"the forked child hung for {timeout:.0f} s")
        time.sleep(0.05)
    with os.fdopen(read_end, "rb") as f:
        said = f.read().decode()
    assert said.startswith("ok "), said
    return said[3:]
