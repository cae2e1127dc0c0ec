"""CUDA-only paths: pinned host pool, copy streams, exactness on the GPU. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tiercache import BlockKey, TierConfig, Tier
from tiercache.store import BlockStore
from tiercache.tiers import BlockGeometry

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)")]


def test_pinned_host_pool_and_stream_moves_round_trip(tmp_path):
    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=4 * g.padded_bytes,
                     disk_dir=str(tmp_path / "kv"), disk_budget="16MiB", block_tokens=16, device="cuda")
    with BlockStore(cfg, g, device="cuda") as store:
        assert store.host_pool.pinned and store.device_pool.k.is_cuda
        data = {BlockKey(0, 0, i): torch.randn(g.shape, device="cuda") for i in range(12)}
        for k, v in data.items():
            store.put(k, v)
        store.ensure_device(list(data)[:3], pin=False)
        for k, v in data.items():
            assert torch.equal(store.get(k), v.cpu())
        assert store.stats()["moves"]["device->host"]["blocks"] > 0
        store.check()
        # "cuda" is the device current at open, for good: its index is kept (a review: left
        # bare, later index tensors went to whatever device a thread had current)
        assert store.device == torch.device("cuda", torch.cuda.current_device())


def test_the_pinned_host_pool_pins_exactly_its_budget_and_lets_go_on_close():
    """The host pool is registered with cudaHostRegister, not taken from torch's pinned
    allocator, which rounds a request up to a power of two (a 40 GiB host tier pinned
    64 GiB) and keeps it cached after the pool is gone. So: pinned, async copies from it
    land exact, torch's pinned allocator grew by less than the pool (the staging of a
    copy may use it), and close() unregisters it."""
    from tiercache import tiers
    from tiercache.tiers import HostPool

    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("allocated_bytes.current", 0) if stats else 0
    pool = HostPool(g, 5, pin=True)  # 5 slots: a size that torch's allocator would round up
    assert pool.pinned and pool.buffer.is_pinned()
    if stats:
        assert stats().get("allocated_bytes.current", 0) - before < pool.nbytes
    block = torch.randn(g.shape)
    pool.view(3).copy_(block)
    on_gpu = pool.view(3).to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), block)
    ptr = pool.buffer.data_ptr()
    assert ptr in tiers._registered
    pool.close()
    assert ptr not in tiers._registered


def _busy_gpu(ms: float = 50.0) -> None:
    """Queue a kernel that keeps the current stream busy for about ``ms`` (the work queued
    behind it then runs late, as a model's kernels do when the CPU runs ahead)."""
    torch.cuda._sleep(int(ms * 2e6))  # cycles; the H200 runs at ~2 GHz


def test_a_block_written_behind_slow_kernels_is_copied_down_only_after_they_ran(tmp_path):
    """The compute stream is busy when a block is written into its device slot, so the write
    waits in the queue; the demotion that follows runs on the copy stream, which must wait
    for that write (``_compute_barrier``); without it the copy could read the slot first,
    and the stale host copy would be served from then on."""
    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=8 * g.padded_bytes, disk_budget=0,
                     block_tokens=16, device="cuda")
    with BlockStore(cfg, g, device="cuda") as store:
        for i in range(6):
            key, value = BlockKey(0, 0, i), torch.randn(g.shape, device="cuda")
            _busy_gpu()
            store.put(key, value)  # queued behind the busy kernel
            store.demote(key).result()  # device -> host on the copy stream
            assert store.tiers_of(key) == [Tier.HOST]
            assert torch.equal(store.get(key), value.cpu()), f"block {i}: the host copy is not what was written"
        store.check()


def test_many_blocks_move_in_one_batch_and_stay_exact(tmp_path):
    """ensure_device of many host and disk blocks at once: the host->device copies go on the
    copy stream in batches (disk blocks through pinned staging), every block arrives exact
    and is counted as one fetch, and evictions demote others device->host meanwhile."""
    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    cfg = TierConfig(device_budget=12 * g.block_bytes, host_budget=16 * g.padded_bytes,
                     disk_dir=str(tmp_path / "kv"), disk_budget="16MiB", block_tokens=16, device="cuda")
    with BlockStore(cfg, g, device="cuda") as store:
        data = {BlockKey(0, 0, i): torch.randn(g.shape, device="cuda") for i in range(40)}
        for k, v in data.items():
            store.put(k, v)
        keys = list(data)

        def fetched() -> int:  # blocks counted as moved into the device tier so far
            moves = store.stats()["moves"]
            return sum(moves.get(f"{src}->device", {}).get("blocks", 0) for src in ("host", "disk"))
        for lo in (0, 10, 20, 30, 5):
            store.wait_idle()
            need = [k for k in keys[lo:lo + 10] if Tier.DEVICE not in store.tiers_of(k)]
            before = fetched()
            _busy_gpu(5)
            store.ensure_device(keys[lo:lo + 10], pin=False)
            for k in keys[lo:lo + 10]:
                assert Tier.DEVICE in store.tiers_of(k)
            # each fetch counted once, under its own direction (the batch that makes room
            # moves blocks device->host in the same call)
            assert fetched() - before == len(need)
        store.wait_idle()
        for k, v in data.items():
            assert torch.equal(store.get(k), v.cpu()), k
        moves = store.stats()["moves"]
        assert moves["host->device"]["blocks"] > 0 and moves["device->host"]["blocks"] > 0
        assert moves.get("disk->device", moves.get("disk->host", {})).get("blocks", 0) > 0
        store.check()


def _needs_kvikio() -> None:
    from tiercache.disk import kvikio_status
    ok, why = kvikio_status()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("slow_writes,disk_io", [(False, "posix"), (True, "posix"), (False, "kvikio")],
                         ids=["plain", "slow-writes", "kvikio"])
def test_cuda_generation_matches_dynamic_cache(tmp_path, monkeypatch, slow_writes, disk_io):
    """Generation on CUDA with every tier in use gives DynamicCache's tokens and logits.
    ``slow-writes``: each write of new tokens into a device slot waits behind a busy kernel,
    so a sealed block's write-behind (device->host) finds its write still queued.
    ``kvikio``: the disk records are written and read through kvikio."""
    if disk_io == "kvikio":
        _needs_kvikio()
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiercache import TieredCache
    from tiercache.tiers import DevicePool

    if slow_writes:
        write_tokens = DevicePool.write_tokens

        def slow(self, *args, **kwargs):
            _busy_gpu(10)
            return write_tokens(self, *args, **kwargs)
        monkeypatch.setattr(DevicePool, "write_tokens", slow)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 128, (1, 40), device="cuda")
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    block = 2 * 2 * 4 * 16 * 4
    tc = TierConfig(device_budget=14 * block, host_budget=6 * 4096, disk_dir=str(tmp_path / "kv"),
                    disk_budget="1MiB", block_tokens=4, disk_io=disk_io)
    with TieredCache(model, tc) as cache:
        out = model.generate(ids, cache=cache, **kw)
        stats = cache.stats()
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert stats["moves"].get("host->device", {}).get("blocks", 0) + stats["moves"].get("disk->device", {}).get("blocks", 0) > 0
    assert stats["tiers"][Tier.DISK.label]["blocks"] > 0 and stats["tiers"]["disk"]["io"] == disk_io
    assert stats["moves"].get("disk->host", {}).get("blocks", 0) + stats["moves"].get("disk->device", {}).get("blocks", 0) > 0


def test_kvikio_records_round_trip_and_a_corrupted_one_is_never_returned(tmp_path):
    """Records written through kvikio read back exact (kvikio and posix alike: one format);
    a payload byte flipped on disk fails the checksum; a record cut short by a truncated
    file is refused; "auto" picks kvikio on a CUDA store."""
    _needs_kvikio()
    import os

    from tiercache.disk import HEADER_BYTES, DiskTier, RecordError
    g = BlockGeometry(1, 2, 16, 64, torch.float32)
    payload = g.padded_bytes
    blocks = [torch.randint(0, 255, (payload,), dtype=torch.uint8).pin_memory() for _ in range(6)]
    kv = str(tmp_path / "kv")
    disk = DiskTier(kv, g, 8, io="kvikio")
    for i, b in enumerate(blocks):
        disk.write(i, BlockKey(0, 0, i), b, 16)
    out = torch.empty(payload, dtype=torch.uint8).pin_memory()
    for i, b in enumerate(blocks):
        assert disk.read(i, BlockKey(0, 0, i), out) == 16
        assert torch.equal(out[:g.block_bytes], b[:g.block_bytes]), i
    with pytest.raises(RecordError, match="expected"):
        disk.read(1, BlockKey(0, 0, 2), out)
    disk.close()
    with open(os.path.join(kv, "blocks.dat"), "r+b") as f:  # flip one payload byte of record 3
        f.seek(3 * disk.record_bytes + HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.truncate(5 * disk.record_bytes + HEADER_BYTES + 10)  # record 5 cut short
    for io in ("kvikio", "posix"):
        disk = DiskTier(kv, g, 8, io=io)
        for i in (0, 1, 2, 4):
            disk.read(i, BlockKey(0, 0, i), out)
            assert torch.equal(out[:g.block_bytes], blocks[i][:g.block_bytes]), (io, i)
        with pytest.raises(RecordError, match="checksum"):
            disk.read(3, BlockKey(0, 0, 3), out)
        with pytest.raises(RecordError, match="truncated"):
            disk.read(5, BlockKey(0, 0, 5), out)
        disk.close()
    cfg = TierConfig(device_budget=4 * g.block_bytes, host_budget=0, disk_dir=str(tmp_path / "kv2"),
                     disk_budget="16MiB", block_tokens=16, device="cuda")
    with BlockStore(cfg, g, device="cuda") as store:
        assert store.stats()["tiers"]["disk"]["io"] == "kvikio"
        import kvikio.defaults
        if "KVIKIO_NTHREADS" not in os.environ:  # the pool grew to the store's I/O workers
            assert kvikio.defaults.get("num_threads") >= cfg.io_workers
        data = {BlockKey(0, 0, i): torch.randn(g.shape, device="cuda") for i in range(12)}
        for k, v in data.items():
            store.put(k, v)  # device -> disk through pinned staging and kvikio
        for k, v in data.items():
            assert torch.equal(store.get(k), v.cpu())
        store.check()


@pytest.mark.parametrize("mode", ["fits", "beam3", "batch2-padded", "host-tier"])
def test_cuda_decode_fast_path_is_exact_and_taken(mode, monkeypatch):
    """``update``'s resident fast path (``BlockStore.hold_resident``) on CUDA: with the whole
    cache on the device it serves most decode steps, and the tokens and logits equal
    DynamicCache's (greedy, beam search, a left-padded batch of two); with a host tier,
    steps switch between it and the general path as blocks move, still exact."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_resident_fast_path import _spy_fast
    from tiercache import TieredCache

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).cuda().eval()
    block = 2 * 2 * 8 * 16 * 4  # K and V of 8 tokens, 2 KV heads of 16, fp32
    batch = 2 if mode == "batch2-padded" else 1
    ids = torch.randint(2, 128, (batch, 40), device="cuda")
    mask = torch.ones_like(ids)
    if batch == 2:
        ids[1, :3], mask[1, :3] = 0, 0
    kw = dict(max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True,
              attention_mask=mask, pad_token_id=0)
    if mode == "beam3":
        kw.update(num_beams=3, length_penalty=0.0)
    rows = 3 if mode == "beam3" else batch
    tc = (TierConfig(device_budget=15 * block, host_budget=64 * 4096, disk_budget=0, block_tokens=8)
          if mode == "host-tier" else TierConfig(device_budget=rows * 64 * block, host_budget=0, block_tokens=8))
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        taken = _spy_fast(monkeypatch)
        with TieredCache(model, tc) as cache:
            out = model.generate(ids, cache=cache, **kw)
            moves = sum(m["blocks"] for m in cache.stats()["moves"].values())
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5
    assert taken["fast"] > 0, taken
    if mode == "host-tier":
        assert moves > 0 and taken["general"] > 0, (moves, taken)


def test_bench_overhead_times_the_books_of_batches_on_the_cuda_path():
    """``tiercache bench overhead --device cuda``'s measurement: batches of 4 and 8 blocks
    moved through the staging buffer and the copy stream, every move completed (it ends with
    ``check()``), a time per round for each batch size and direction."""
    from tiercache.bench.overhead import measure_overhead

    out = measure_overhead((4, 8), repeat=1, flush_bytes=8 << 20, device="cuda")
    assert out["device"] == "cuda"
    assert [(r["blocks"], r["phase"], r["rounds"]) for r in out["rows"]] == [
        (4, "d2h", 16), (4, "h2d", 16), (8, "d2h", 8), (8, "h2d", 8)]
    assert all(r["warm_ms"] > 0 and r["cold_ms"] > 0 for r in out["rows"])
