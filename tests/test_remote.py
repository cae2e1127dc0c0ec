"""The remote tier on a real Redis/Valkey server: processes share prefixes through it, and a
server that is down, killed, paused, full, or holds damaged or foreign values never changes a
token — generation goes on with the local tiers or recomputes, and every case is counted.

Every test talks to a real server process on loopback: the one ``.ci/run`` starts
(``TIERCACHE_TEST_REDIS_URL``) for tests that only need a server, or a private one for tests
that stop, pause or reconfigure it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid

import pytest
import torch
import transformers

from redis_server import SKIP_REASON, RedisServer, free_port, self_signed_cert, server_binary
from test_prefix import BT, GEN, assert_same, prompt, reference, tiny_model
from tiercache import TierConfig, TieredCache
from tiercache.config import redact_url, remote_credentials
from tiercache.disk import HEADER_BYTES, RecordCodec
from tiercache.prefix import close_all, model_digest
from tiercache.table import BlockKey

pytest.importorskip("redis")
needs_server = pytest.mark.skipif(server_binary() is None and not os.environ.get("TIERCACHE_TEST_REDIS_URL"),
                                  reason=SKIP_REASON)
needs_binary = pytest.mark.skipif(server_binary() is None, reason=SKIP_REASON)

PROMPT_LEN = 30  # 7 whole blocks of BT=4 tokens are reusable (the last prompt token is always computed)


@pytest.fixture(autouse=True)
def _fresh_registry():
    close_all()
    yield
    close_all()


@pytest.fixture(scope="module")
def shared_url(tmp_path_factory):
    """The CI's server when there is one, else a private server for this module."""
    url = os.environ.get("TIERCACHE_TEST_REDIS_URL")
    if url:
        yield url
        return
    if server_binary() is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server.url
    server.close()


@pytest.fixture
def server(tmp_path):
    """A private server this test may stop, pause or reconfigure."""
    if server_binary() is None:
        pytest.skip(SKIP_REASON)
    srv = RedisServer(str(tmp_path / "redis"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama saved once: every process (this one and its children) loads it."""
    path = str(tmp_path_factory.mktemp("model"))
    tiny_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def cfg(tmp_path, url, name: str, **kw) -> TierConfig:
    kw.setdefault("remote_namespace", f"t{uuid.uuid4().hex[:10]}")
    return TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir=str(tmp_path / name), disk_budget="16MiB",
                      block_tokens=BT, remote_url=url, **kw)


def run(model, ids, config):
    """One request in a fresh 'machine' (its own disk_dir, a new prefix cache); returns
    (output, stats, tokens loaded)."""
    close_all()
    with TieredCache(model, config) as cache, torch.no_grad():
        loaded = cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        stats = cache.stats()
    close_all()  # flushes the remote writes, as a process exit does
    return out, stats, loaded


def keys_of(client, namespace: str) -> list:
    return sorted(k.decode() for k in client.scan_iter(f"{namespace}:*"))


# ---- configuration ------------------------------------------------------------------------
def test_config_names_every_bad_remote_setting(tmp_path):
    good = dict(disk_dir=str(tmp_path / "kv"), remote_url="redis://127.0.0.1:6379/0")
    for bad, field in [({"remote_url": "http://x"}, "remote_url"), ({"remote_budget": "-1"}, "remote_budget"),
                       ({"remote_namespace": "a b"}, "remote_namespace"), ({"remote_timeout": 0}, "remote_timeout"),
                       ({"remote_max_inflight": "12KiB"}, "remote_max_inflight"),
                       ({"remote_cluster": "yes"}, "remote_cluster")]:
        with pytest.raises(ValueError, match=field):
            TierConfig(**{**good, **bad})
    with pytest.raises(ValueError, match="remote_url.*prefix cache"):
        TierConfig(remote_url="redis://127.0.0.1:6379/0")  # no disk_dir: no prefix cache to share
    with pytest.raises(ValueError, match="remote_url.*prefix cache"):
        TierConfig(**good, reuse=False)
    # A port that does not parse was accepted, then raised from the writer thread (and hung
    # close() for 20 s) or made the tier count a server error every 5 s; a database index
    # that is not a number silently meant database 0.
    for url, message in [("redis://u:secret@127.0.0.1:notaport/0", "the port must be a number"),
                         ("redis://team:s3cr/et@127.0.0.1:6379/0", "the port must be a number"),
                         ("redis://127.0.0.1:99999/0", "the port must be a number"),
                         ("redis://:6379/0", "no host"), ("redis://127.0.0.1:6379/abc", "the database index")]:
        with pytest.raises(ValueError, match=f"remote_url: {message}") as err:
            TierConfig(**{**good, "remote_url": url})
        assert "secret" not in str(err.value) and "s3cr" not in str(err.value)
    # redis-py options go in the URL's query; one that decodes replies as text made every
    # lookup fail on the binary records, counted as a server fault every 5 s (a review)
    for url in ("redis://127.0.0.1:6379/0?decode_responses=true", "unix:///tmp/r.sock?decode_responses=1"):
        with pytest.raises(ValueError, match="remote_url: the option 'decode_responses' .* cannot be used"):
            TierConfig(**{**good, "remote_url": url})
    assert redact_url("redis://u:secret@127.0.0.1:notaport/0") == "redis://u:***@127.0.0.1:notaport/0"
    assert redact_url("redis://team:s3cr/et#?@h:6379/0") == "redis://team:***@h:6379/0"  # not percent-encoded
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("unix:///r.sock?db=1&password=pw&ssl_password=k#x") == "unix:///r.sock?db=1&password=***&ssl_password=***#x"
    # an '@' in the query's password was taken for the user-info's: the password showed
    assert redact_url("unix:///r.sock?db=2&password=p@ss") == "unix:///r.sock?db=2&password=***"
    assert redact_url("rediss://u:pw@h:6380/0?ssl_password=k@p") == "rediss://u:***@h:6380/0?ssl_password=***"
    assert redact_url("redis://h:1/0?pass%77ord=abc") == "redis://h:1/0?pass%77ord=***"  # redis-py decodes names
    # Options redis-py would not parse, or that override the tier's own timeouts (the
    # query's win: ?socket_timeout=30 held a compute thread 30 s on a paused server), and a
    # unix URL with no path: accepted, then every connection failed, counted as a server
    # fault every 5 s (a review)
    for url, message in [("unix:///tmp/r.sock?db=abc", "the option 'db' has a value redis-py cannot parse"),
                         ("redis://127.0.0.1:6379/0?health_check_interval=x", "the option 'health_check_interval'"),
                         ("unix:///r.sock?password=pw&max_connections=z", "the option 'max_connections'"),
                         ("redis://127.0.0.1:6379/0?socket_timeout=30", "the option 'socket_timeout' .* remote_timeout"),
                         ("redis://127.0.0.1:6379/0?retry_on_timeout=yes", "the option 'retry_on_timeout'"),
                         ("unix://", "no socket path")]:
        with pytest.raises(ValueError, match=f"remote_url: {message}") as err:
            TierConfig(**{**good, "remote_url": url})
        assert "pw" not in str(err.value)
    TierConfig(**{**good, "remote_url": "unix:///tmp/r.sock?db=3&password=pw"})  # good options pass
    # A name the connection does not take (a typo of a TLS option) was accepted too, then
    # every connection failed inside redis-py, counted as a server fault every 5 s; an
    # unclosed IPv6 bracket raised urllib's "Invalid IPv6 URL", naming no field (a review)
    for url, message in [
            ("rediss://h:6380/0?ssl_ca_cert=/ca.pem", r"unknown option 'ssl_ca_cert' .* \(did you mean 'ssl_ca_certs'\?\)"),
            ("redis://h:6379/0?ssl_ca_certs=/ca.pem", r"unknown option 'ssl_ca_certs' .* \(a TLS option: it needs rediss://\)"),
            ("redis://h:6379/0?foo=bar", "unknown option 'foo' in redis://h:6379/0.foo=bar; a redis:// connection"),
            ("redis://[::1:6379/0", r"cannot parse redis://\[::1:6379/0 \(Invalid IPv6 URL\)")]:
        with pytest.raises(ValueError, match=f"remote_url: {message}"):
            TierConfig(**{**good, "remote_url": url})
    TierConfig(**{**good, "remote_url": "rediss://h:6380/0?ssl_ca_certs=/ca.pem&ssl_cert_reqs=none&client_name=w1"})


def test_password_never_shows_and_comes_from_the_environment(tmp_path, monkeypatch):
    url = "rediss://alice:s3cret@cache.internal:6380/2"
    config = TierConfig(disk_dir=str(tmp_path / "kv"), remote_url=url)
    assert "s3cret" not in repr(config)
    assert redact_url(url) == "rediss://alice:***@cache.internal:6380/2"
    assert remote_credentials(url) == ("alice", "s3cret")
    monkeypatch.setenv("TIERCACHE_REMOTE_USERNAME", "bob")
    monkeypatch.setenv("TIERCACHE_REMOTE_PASSWORD", "from-env")
    assert remote_credentials("redis://cache.internal:6379/0") == ("bob", "from-env")
    assert remote_credentials(url) == ("alice", "s3cret")  # the URL wins


def test_budget_smaller_than_one_block_is_refused_by_name(tmp_path, model, shared_url):
    with pytest.raises(ValueError, match="remote_budget.*less than one block"):
        run(model, prompt(length=PROMPT_LEN), cfg(tmp_path, shared_url, "a", remote_budget=1024))


def test_model_digest_does_not_depend_on_where_the_model_was_loaded_from(tmp_path, model_dir, model):
    """Two machines keep the same model in different folders; they must share its blocks."""
    elsewhere = str(tmp_path / "copy")
    shutil.copytree(model_dir, elsewhere)
    other = transformers.AutoModelForCausalLM.from_pretrained(elsewhere).eval()
    assert model_digest(other) == model_digest(model)


# ---- sharing ------------------------------------------------------------------------------
@needs_server
def test_a_second_machine_loads_the_prefix_from_the_server_exactly(tmp_path, model, shared_url):
    """Machine A computes a prompt and publishes its blocks; machine B (another disk_dir, so
    a local miss) finds them on the server, promotes them into its local tiers and computes
    only the rest: same tokens and logits as a cold run. A third run on B is a local hit."""
    ids = prompt(length=PROMPT_LEN)
    config_a = cfg(tmp_path, shared_url, "a")
    out_a, stats_a, loaded_a = run(model, ids, config_a)
    assert loaded_a == 0 and stats_a["remote"]["blocks_written"] >= 7
    config_b = config_a.replace(disk_dir=str(tmp_path / "b"))
    out_b, stats_b, loaded_b = run(model, ids, config_b)
    assert loaded_b == 28 and stats_b["prefill_tokens"] == PROMPT_LEN - 28
    assert stats_b["remote"]["hits"] == 7 and stats_b["remote"]["bytes_read"] > 0
    ref = reference(model, ids)
    assert_same(ref, out_a)
    assert_same(ref, out_b)
    out_c, stats_c, loaded_c = run(model, ids, config_b)
    assert loaded_c == 28 and stats_c["remote"]["lookups"] == 0  # promoted: found locally
    assert_same(ref, out_c)


@needs_server
def test_a_local_failure_while_a_prefix_comes_from_the_server_is_raised_not_blamed_on_it(tmp_path, model,
                                                                                         shared_url):
    """Machine B takes the prefix machine A published, while B's plug-in eviction policy
    breaks on the first block it stores (``tiercache.guard``). The ``PolicyError`` that the
    next store call raises is B's own: ``load_prefix`` raises it. It used to be counted as
    a server error, the server marked down for the retry period, and the error lost."""
    from tiercache import PolicyError
    from tiercache.policies import EVICTION_POLICIES

    class Brittle(EVICTION_POLICIES["lru"]):
        armed = False

        def insert(self, key):
            if Brittle.armed:
                raise RuntimeError("policy bug")
            super().insert(key)

    ids = prompt(length=PROMPT_LEN)
    config_a = cfg(tmp_path, shared_url, "a")
    run(model, ids, config_a)
    EVICTION_POLICIES["brittle"] = Brittle
    try:
        close_all()
        with TieredCache(model, config_a.replace(disk_dir=str(tmp_path / "b"), eviction="brittle")) as cache:
            Brittle.armed = True
            with pytest.raises(PolicyError, match="'brittle' of the host tier of the prefix cache's store failed in "
                                                  "insert: RuntimeError"):
                cache.load_prefix(ids)
            Brittle.armed = False
            remote = cache.stats()["remote"]
            assert remote["state"] != "down" and not any(remote["errors"].values()), remote
            assert remote["hits"] + remote["misses"] == 7, remote  # the 7 blocks found, counted
        close_all()
    finally:
        del EVICTION_POLICIES["brittle"]


@needs_server
def test_another_prompt_or_model_never_hits(tmp_path, model, shared_url):
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, shared_url, "a")
    run(model, ids, config)
    _, _, loaded = run(model, prompt(seed=9, length=PROMPT_LEN), config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 0
    other = tiny_model(seed=5)  # same architecture, other weights: another namespace
    out, stats, loaded = run(other, ids, config.replace(disk_dir=str(tmp_path / "c")))
    assert loaded == 0 and stats["remote"]["hits"] == 0
    assert_same(reference(other, ids), out)


CHILD = textwrap.dedent("""
    import json, sys, torch, transformers
    from tiercache import TierConfig, TieredCache
    args = json.loads(sys.argv[1])
    model = transformers.AutoModelForCausalLM.from_pretrained(args["model"]).eval()
    ids = torch.tensor([args["ids"]])
    config = TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir=args["disk_dir"],
                        disk_budget="16MiB", block_tokens=args["bt"], remote_url=args["url"],
                        remote_namespace=args["ns"])
    with TieredCache(model, config) as cache, torch.no_grad():
        loaded = cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                             max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
        stats = cache.stats()
    torch.save({"sequences": out.sequences, "logits": list(out.logits)}, args["out"])
    print(json.dumps({"loaded": loaded, "remote": stats["remote"]}))
""")


def child(model_dir, ids, disk_dir, url, ns, out) -> subprocess.Popen:
    args = json.dumps({"model": model_dir, "ids": ids[0].tolist(), "disk_dir": disk_dir, "url": url, "ns": ns,
                       "bt": BT, "out": out})
    return subprocess.Popen([sys.executable, "-c", CHILD, args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@needs_server
@pytest.mark.slow
def test_two_processes_share_a_prefix_through_the_server(tmp_path, model_dir, model, shared_url):
    """Real processes: two writers publish the same prompt at the same time (duplicate writes
    of one block are harmless), then a third process on a fresh disk_dir loads it from the
    server; every process's logits equal a cold run's."""
    ids = prompt(length=PROMPT_LEN)
    ns = f"t{uuid.uuid4().hex[:10]}"
    writers = [child(model_dir, ids, str(tmp_path / f"w{i}"), shared_url, ns, str(tmp_path / f"w{i}.pt"))
               for i in range(2)]
    for proc in writers:
        finish(proc)
    reader = finish(child(model_dir, ids, str(tmp_path / "r"), shared_url, ns, str(tmp_path / "r.pt")))
    assert reader["loaded"] == 28 and reader["remote"]["hits"] == 7
    ref = reference(model, ids)
    for name in ("w0", "w1", "r"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert torch.equal(got["sequences"], ref.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(ref.logits, got["logits"])) <= 1e-5


# ---- faults -------------------------------------------------------------------------------
@needs_binary
def test_server_down_at_start_generation_runs_on_the_local_tiers(tmp_path, model, server):
    url = server.url
    server.stop()  # nothing listens on that port now
    ids = prompt(length=PROMPT_LEN)
    t0 = time.monotonic()
    out, stats, loaded = run(model, ids, cfg(tmp_path, url, "a"))
    assert time.monotonic() - t0 < 30
    assert loaded == 0 and stats["remote"]["state"] == "down"
    assert stats["remote"]["errors"]["unavailable"] >= 1 and stats["remote"]["writes_dropped"] >= 1
    assert_same(reference(model, ids), out)


class KillAt(transformers.LogitsProcessor):
    """Runs inside generate(): does ``action`` once at decode step ``step``."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.calls = step, action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            self.action()
        return scores


@needs_binary
def test_server_killed_mid_run_then_back(tmp_path, model, server):
    """The server dies while a run is publishing: that run's tokens are unchanged; the next
    machine recomputes (a plain local miss); once a server is back, sharing resumes."""
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, server.url, "a")
    close_all()
    with TieredCache(model, config) as cache, torch.no_grad():
        cache.load_prefix(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                             logits_processor=transformers.LogitsProcessorList([KillAt(2, server.stop)]), **GEN)
    close_all()  # sends what is queued: to a dead server, counted, never raised
    ref = reference(model, ids)
    assert_same(ref, out)
    out_b, stats_b, loaded_b = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded_b == 0 and stats_b["remote"]["errors"]["unavailable"] >= 1
    assert_same(ref, out_b)
    server.start()  # same port, empty
    _, stats_c, _ = run(model, ids, config.replace(disk_dir=str(tmp_path / "c")))
    assert stats_c["remote"]["state"] == "up" and stats_c["remote"]["blocks_written"] >= 7
    out_d, stats_d, loaded_d = run(model, ids, config.replace(disk_dir=str(tmp_path / "d")))
    assert loaded_d == 28
    assert_same(ref, out_d)


@needs_binary
def test_a_paused_server_times_out_and_never_stalls_decode(tmp_path, model, server):
    """SIGSTOP: the server accepts nothing and answers nothing. Lookups and writes time out
    (remote_timeout), are counted, and the run finishes on the local tiers."""
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, server.url, "a", remote_timeout=0.2)
    run(model, ids, config)
    server.pause()
    try:
        t0 = time.monotonic()
        out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
        elapsed = time.monotonic() - t0
    finally:
        server.resume()
    assert loaded == 0 and stats["remote"]["errors"]["timeout"] >= 1
    assert elapsed < 20, elapsed  # a timeout or two, then the server is left alone for a while
    assert_same(reference(model, ids), out)


@needs_binary
def test_writes_are_dropped_not_waited_for_when_the_queue_is_full(tmp_path, model, server):
    """With the server paused, the writer thread hangs on its batch; the compute thread's
    writes fill remote_max_inflight and are then dropped (counted), never waited for; after
    the timeout the writer gives up on that batch and no partial block is ever listed."""
    from tiercache.prefix import chain

    config = cfg(tmp_path, server.url, "a", remote_timeout=2.0, remote_max_inflight="1MiB")
    close_all()
    with TieredCache(model, config) as cache:
        prefix = cache._ensure_prefix()
        remote = prefix.remote
        blocks = chain(list(range(1, 1 + 200 * BT)), BT, prefix.salt)
        kv = torch.randn(prefix.geometry.shape)
        assert remote.lookup(blocks[:1]) == 0  # connected
        server.pause()
        try:
            slowest, accepted = 0.0, 0
            for block in blocks:
                for layer in range(prefix.num_layers):
                    t0 = time.perf_counter()
                    accepted += remote.put(block, layer, kv)
                    slowest = max(slowest, time.perf_counter() - t0)
            stats = remote.stats()
            assert slowest < 0.25, slowest  # enqueueing, never a server round trip
            assert stats["writes_dropped"] >= 1 and accepted * remote.record_bytes <= 1 << 20
            assert remote.flush(timeout=10)  # the hung batch times out and is dropped
        finally:
            server.resume()
        stats = remote.stats()
        assert stats["errors"]["timeout"] >= 1
    close_all()
    # A batch that timed out may still be applied once the server runs again, but a manifest
    # is only ever sent after (or with) all of its block's records: no manifest without them.
    keys = set(keys_of(server.client(), config.remote_namespace))
    for manifest in [k for k in keys if k.endswith(":m")]:
        assert all(manifest[:-1] + str(layer) in keys for layer in range(prefix.num_layers)), manifest


def corrupt(client, key: str, offset: int) -> None:
    value = bytearray(client.get(key))
    value[offset] ^= 0x40
    client.set(key, bytes(value))


def _block3_on_the_server(tmp_path, model, server, ids, config, manifest: bool) -> tuple:
    """A first machine publishes ``ids``; (a client, the server key of block 3's manifest or
    of its layer-1 record)."""
    run(model, ids, config)
    client = server.client()
    keys = keys_of(client, config.remote_namespace)
    close_all()
    with TieredCache(model, config.replace(disk_dir=str(tmp_path / "probe"), reuse=True)) as probe:
        prefix = probe._ensure_prefix()
        from tiercache.prefix import chain
        block3 = chain(ids[0].tolist(), BT, prefix.salt)[3]
        remote = prefix.remote
        target = remote.manifest_key(block3.h) if manifest else remote.record_key(block3.h, 1)
    close_all()
    assert target in keys
    return client, target


def _block3_refused_then_rewritten(tmp_path, model, ids, config) -> dict:
    """Block 3's value on the server is bad: a second machine loads blocks 0-2, counts one
    corrupt value, recomputes the rest (logits equal a cold run) and writes block 3 again,
    so a third machine loads the whole prefix. The second machine's stats."""
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 3 * BT and stats["remote"]["errors"]["corrupt"] == 1
    ref = reference(model, ids)
    assert_same(ref, out)
    out_c, stats_c, loaded_c = run(model, ids, config.replace(disk_dir=str(tmp_path / "c")))
    assert loaded_c == 28 and stats_c["remote"]["errors"]["corrupt"] == 0
    assert_same(ref, out_c)
    return stats


@needs_binary
@pytest.mark.parametrize("where", ["record payload", "record header", "manifest", "truncated record"])
def test_a_corrupted_value_is_never_served(tmp_path, model, server, where):
    """Block 3's value is damaged on the server: blocks 0-2 are served, block 3 and the rest
    are recomputed, the bad value is counted and replaced; logits equal a cold run."""
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, server.url, "a")
    client, target = _block3_on_the_server(tmp_path, model, server, ids, config, where == "manifest")
    if where == "record payload":
        corrupt(client, target, HEADER_BYTES + 5)
    elif where == "record header":
        corrupt(client, target, 40)
    elif where == "manifest":
        corrupt(client, target, 30)
    else:
        client.set(target, client.get(target)[:-7])
    stats = _block3_refused_then_rewritten(tmp_path, model, ids, config)
    assert stats["remote"]["hits"] == 3


@needs_binary
@pytest.mark.parametrize("key_kind", ["manifest", "record"])
def test_a_key_of_another_type_is_counted_corrupt_and_replaced(tmp_path, model, server, key_kind):
    """Block 3's manifest or one of its records is a list on the server (someone else's
    key, a bug elsewhere): its WRONGTYPE failed the whole pipeline, the tier was marked
    down, and the key stayed, so every machine missed that prefix for good. It now counts as
    one corrupt value, is deleted, and the machine that recomputes block 3 writes it again:
    a third machine loads the whole prefix. Logits equal a cold run throughout."""
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, server.url, "a")
    client, target = _block3_on_the_server(tmp_path, model, server, ids, config, key_kind == "manifest")
    client.delete(target)
    client.rpush(target, b"not a record")
    stats = _block3_refused_then_rewritten(tmp_path, model, ids, config)
    assert stats["remote"]["state"] == "up" and stats["remote"]["errors"]["server"] == 0


@needs_binary
@pytest.mark.parametrize("damage", ["reservations not a sorted set", "lru not a sorted set"])
def test_bad_budget_keys_are_reset_not_fatal(tmp_path, model, server, damage):
    """With remote_budget, the namespace's reservations and eviction list are keys too. A
    budget key of the wrong kind stopped every write of the model for good (each batch
    failed and marked the server down). It is reset and counted corrupt once; the blocks
    are written, and a second machine loads them."""
    probe_cfg = cfg(tmp_path, server.url, "p")
    close_all()
    with TieredCache(model, probe_cfg) as probe:
        remote = probe._ensure_prefix().remote
        res_key, lru_key = remote.res_key, remote.lru_key
    close_all()
    config = cfg(tmp_path, server.url, "a", remote_budget=64 * remote.block_bytes,
                 remote_namespace=probe_cfg.remote_namespace)
    client = server.client()
    if damage == "reservations not a sorted set":
        client.set(res_key, b"abc")
    else:
        client.set(lru_key, b"a string")
    ids = prompt(length=PROMPT_LEN)
    _, stats, _ = run(model, ids, config)
    assert stats["remote"]["errors"]["corrupt"] == 1 and stats["remote"]["writes_dropped"] == 0
    assert stats["remote"]["blocks_written"] >= 7 and stats["remote"]["errors"]["server"] == 0
    manifests = len([k for k in keys_of(client, config.remote_namespace) if k.endswith(":m")])
    assert manifests >= 7 and client.type(lru_key) == b"zset"
    # the eviction list holds every block on the server, and nothing is left reserved (a
    # repair that forgot the batch's reservations left its blocks uncounted: over budget)
    assert client.zcard(lru_key) == manifests and client.zcard(res_key) == 0
    out, stats_b, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 28
    assert_same(reference(model, ids), out)


# ---- the remote tier on its own (RemoteTier: 2 layers of 4-token blocks) -------------------
_LAYERS = 2


def _remote_tier(tmp_path, url: str, **kw):
    from tiercache.remote import RemoteTier
    from tiercache.tiers import BlockGeometry

    kw.setdefault("remote_namespace", f"t{uuid.uuid4().hex[:10]}")
    config = TierConfig(disk_dir=str(tmp_path / f"kv-{uuid.uuid4().hex[:8]}"), remote_url=url, **kw)
    return RemoteTier(config, RecordCodec(BlockGeometry(1, 2, 4, 8, torch.float32), b"D" * 16), "tag-abab", _LAYERS)


def _block_bytes(tmp_path, url: str) -> int:
    """What one block of ``_remote_tier``'s geometry occupies on the server."""
    probe = _remote_tier(tmp_path, url)
    probe.close()
    return probe.block_bytes


class _PeakBytes:
    """Samples, on a thread, the bytes of the string values under ``<ns>:*`` (summed inside
    the server by one script, so each sample is an atomic snapshot); ``peak`` after ``with``."""

    def __init__(self, client, ns: str) -> None:
        self._total = client.register_script("""
            local s = 0
            for _, k in ipairs(redis.call('KEYS', ARGV[1])) do
                if redis.call('TYPE', k).ok == 'string' then s = s + redis.call('STRLEN', k) end
            end
            return s""")
        self._pattern, self.peak, self._stop = f"{ns}:*", 0, threading.Event()
        self._thread = threading.Thread(target=self._sample)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, int(self._total(args=[self._pattern])))
            time.sleep(0.002)

    def __enter__(self) -> "_PeakBytes":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _chain(n: int, seed: int) -> list:
    from tiercache.prefix import chain

    ids = torch.randint(0, 1000, (n * 4,), generator=torch.Generator().manual_seed(seed)).tolist()
    return chain(ids, 4, b"salt" + bytes([seed]))


def _publish(tier, blocks: list) -> list:
    """Put every layer of ``blocks`` (in order, as the prefix cache does); what put answered."""
    said = [tier.put(b, layer, torch.full((2, 1, 2, 4, 8), float(10 * b.index + layer)))
            for b in blocks for layer in range(_LAYERS)]
    tier.flush(10)
    return said


def _held(client, tier) -> int:
    """Bytes of the values the namespace holds (the budget's sorted sets aside)."""
    prefix = tier.lru_key[:-len("}:lru")]  # every key of the namespace: "<ns>:{<version>-<tag>...}:..."
    keys = [k for k in client.scan_iter(f"{prefix}*") if k.decode() not in (tier.res_key, tier.lru_key)]
    return sum(client.strlen(k) for k in keys)


@needs_binary
def test_a_block_sent_again_after_its_eviction_is_counted_again(tmp_path, server):
    """remote_budget: a block this process wrote, evicted to make room, then recomputed and
    published again (a long-lived worker) was remembered as counted: it went in uncounted,
    the namespace outgrew the budget, and each later eviction of it took off bytes never
    added (a review). Every write of a block the server does not list is counted now: after
    each step the namespace holds no more than the budget, and the count is what it holds."""
    budget = 2 * _block_bytes(tmp_path, server.url)
    tier = _remote_tier(tmp_path, server.url, remote_budget=budget)
    client = server.client()
    a, b, c = _chain(3, seed=1)
    try:
        for step, blocks in (("a, b", [a, b]), ("c", [c]), ("b again", [b]), ("a again", [a])):
            assert all(_publish(tier, blocks)), step
            held = _held(client, tier)
            assert held <= budget and _counted(client, tier) == held, (step, held, budget)
        assert tier.stats()["evicted_blocks"] >= 2
    finally:
        tier.close()


@needs_binary
def test_a_block_whose_write_was_dropped_is_sent_when_published_again(tmp_path, server, monkeypatch):
    """A record dropped while the server was down marked its block for the life of the
    process: once the server was back, every later publish of it was refused by put(),
    silently, uncounted (a review). The mark now lasts for that publish only (a block's
    publish begins with layer 0); every refused record counts as dropped."""
    import tiercache.remote as remote

    monkeypatch.setattr(remote, "RETRY_SECONDS", 0.5)  # the wait before trying the server again
    tier = _remote_tier(tmp_path, server.url)
    try:
        a, b = _chain(1, seed=2)[0], _chain(1, seed=3)[0]
        server.stop()
        _publish(tier, [a])
        stats = tier.stats()  # each record refused by put() or dropped by the writer
        assert stats["writes_dropped"] == _LAYERS and stats["blocks_written"] == 0
        server.start()
        time.sleep(0.6)
        assert all(_publish(tier, [b]))  # the server answers again
        assert all(_publish(tier, [a]))  # published again: sent
        assert tier.lookup([a]) == 1 and tier.lookup([b]) == 1
        assert tier.stats()["blocks_written"] == 2
    finally:
        tier.close()


@needs_binary
def test_records_close_throws_away_are_counted_dropped(tmp_path, server):
    """close() waits a bounded time for queued writes and then discards the rest: those
    records were neither sent nor counted, and ``queued_bytes`` kept them for good (a
    review). Every record put is now written or counted dropped, and nothing stays queued."""
    tier = _remote_tier(tmp_path, server.url, remote_timeout=0.5)
    time.sleep(0.3)  # connected
    server.pause()
    try:
        put = sum(_publish_no_wait(tier, [_chain(1, seed=10 + i)[0] for i in range(10)]))
        tier.close(timeout=0.1)
        tier._writer.join(10)  # its write to the paused server times out
        stats = tier.stats()
        assert stats["bytes_written"] // tier.record_bytes + stats["writes_dropped"] == put == 2 * 10
        assert stats["queued_bytes"] == 0
    finally:
        server.resume()


def _counted(client, tier) -> int:
    """Bytes the budget counts: the blocks listed and those being written."""
    return (client.zcard(tier.lru_key) + client.zcard(tier.res_key)) * tier.block_bytes


_WORKER = """
import sys, torch
from tiercache.config import TierConfig
from tiercache.disk import RecordCodec
from tiercache.prefix import chain
from tiercache.remote import RemoteTier
from tiercache.tiers import BlockGeometry

url, ns, budget, kv_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
config = TierConfig(disk_dir=kv_dir, remote_url=url, remote_namespace=ns, remote_budget=budget)
tier = RemoteTier(config, RecordCodec(BlockGeometry(1, 2, 4, 8, torch.float32), b"D" * 16), "tag-abab", 2)
for r in range(25):  # chains of its own: no block is written by two workers
    ids = torch.randint(0, 1000, (3 * 4,), generator=torch.Generator().manual_seed(seed * 1000 + r)).tolist()
    for block in chain(ids, 4, b"salt"):
        for layer in range(2):
            tier.put(block, layer, torch.full((2, 1, 2, 4, 8), float(block.index)))
    if r % 4 == 0:
        tier.flush(10)
tier.flush(30)
tier.close()
"""


@needs_binary
def test_several_workers_keep_the_namespace_within_the_budget(tmp_path, server):
    """Three processes write their own prompts' blocks into one namespace with a budget of
    six blocks. The budget was a byte counter each worker resynced to its own blocks being
    written whenever its eviction list ran empty, forgetting the other workers' blocks being
    written: four workers left five times the budget on the server, and it never came back
    (a review). Now every worker counts the blocks listed and those any worker is writing
    (two sorted sets): sampled from another thread while they write, the namespace never
    holds more than the budget and one block (the one an eviction is deleting), and at the
    end what it holds is what the budget counts, nothing reserved left behind."""
    block_bytes = _block_bytes(tmp_path, server.url)
    budget = 6 * block_bytes
    ns = f"t{uuid.uuid4().hex[:10]}"
    client = server.client()
    with _PeakBytes(client, ns) as sampled:
        workers = [subprocess.Popen([sys.executable, "-c", _WORKER, server.url, ns, str(budget),
                                     str(tmp_path / f"kv{i}"), str(i)], stderr=subprocess.PIPE, text=True)
                   for i in range(3)]
        for proc in workers:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
    config = TierConfig(disk_dir=str(tmp_path / "kv-check"), remote_url=server.url, remote_namespace=ns,
                        remote_budget=budget)
    from tiercache.remote import RemoteTier
    from tiercache.tiers import BlockGeometry
    tier = RemoteTier(config, RecordCodec(BlockGeometry(1, 2, 4, 8, torch.float32), b"D" * 16), "tag-abab", _LAYERS)
    try:
        held = _held(client, tier)
        assert 0 < held <= budget, (held, budget)
        assert _counted(client, tier) == held and client.zcard(tier.res_key) == 0
        assert 0 < sampled.peak <= budget + block_bytes, (sampled.peak, budget)
    finally:
        tier.close()


@needs_binary
def test_a_block_whose_publish_stopped_leaves_nothing_counted(tmp_path, server):
    """One worker, a budget of two blocks. A block whose first layer went out and whose
    next record was dropped (the queue full), or whose publish the prefix cache gave up
    (``abandon``: no room locally, a forward that stopped), was counted for the life of the
    process: never listed, so never evicted, each took a block of the budget, and once they
    filled it every later write was refused (a review). Now its reservation goes, with the
    record it sent; the good blocks after them are all written."""
    budget = 2 * _block_bytes(tmp_path, server.url)
    tier = _remote_tier(tmp_path, server.url, remote_budget=budget)
    client = server.client()
    try:
        assert all(_publish(tier, _chain(2, seed=30)))
        for i in range(3):
            half_dropped, half_abandoned = _chain(1, seed=40 + i)[0], _chain(1, seed=50 + i)[0]
            assert tier.put(half_dropped, 0, torch.zeros(2, 1, 2, 4, 8))
            tier.flush(10)
            limit, tier.max_inflight = tier.max_inflight, 0  # the queue is full: layer 1 is dropped
            assert not tier.put(half_dropped, 1, torch.zeros(2, 1, 2, 4, 8))
            tier.max_inflight = limit
            assert tier.put(half_abandoned, 0, torch.zeros(2, 1, 2, 4, 8))
            tier.flush(10)
            tier.abandon(half_abandoned)
            tier.flush(10)
            assert client.zcard(tier.res_key) == 0 and not tier._unlisted, i
            assert _held(client, tier) == _counted(client, tier) <= budget, i
        good = _chain(2, seed=60)
        assert all(_publish(tier, good))
        assert tier.lookup(good) == 2  # written, not refused: the budget was not full of ghosts
        stats = tier.stats()
        assert stats["writes_dropped"] == 3 and stats["blocks_written"] == 4
    finally:
        tier.close()


@needs_binary
def test_releases_the_server_is_not_there_for_do_not_hold_up_close(tmp_path, server):
    """With remote_budget, a block whose record is dropped gives its reservation back on
    the writer thread. With the server gone, nothing can be given back: flush() and close()
    must not wait for that (a flush waits for the writer's work, up to 20 server timeouts)."""
    budget = 4 * _block_bytes(tmp_path, server.url)
    tier = _remote_tier(tmp_path, server.url, remote_budget=budget, remote_timeout=0.5)
    assert _publish(tier, _chain(1, seed=90)) == [True] * _LAYERS
    server.stop()
    _publish(tier, _chain(1, seed=91))  # the writer finds the server gone: down, and idle
    assert tier.stats()["state"] == "down"
    _publish_no_wait(tier, _chain(2, seed=92))  # refused by put(): nothing else wakes the writer
    t0 = time.monotonic()
    assert tier.flush()
    tier.close()
    assert time.monotonic() - t0 < 3.0
    stats = tier.stats()
    assert stats["bytes_written"] // tier.record_bytes + stats["writes_dropped"] == 4 * _LAYERS


def _two_workers(tmp_path, server, blocks_in_budget: int) -> tuple:
    """Two RemoteTiers on one namespace (two workers), and the block size."""
    block_bytes, ns = _block_bytes(tmp_path, server.url), f"t{uuid.uuid4().hex[:10]}"
    budget = blocks_in_budget * block_bytes
    return (_remote_tier(tmp_path, server.url, remote_budget=budget, remote_namespace=ns),
            _remote_tier(tmp_path, server.url, remote_budget=budget, remote_namespace=ns), block_bytes)


@needs_binary
def test_a_worker_that_gives_up_a_shared_block_leaves_the_others_writing_it(tmp_path, server):
    """Two workers publish the same block at once (the same prompt); one of them gives it
    up. Reservations were one per block: the one that gave up took back the other's too,
    and deleted the record it had sent; the other then listed a block whose first layer was
    gone: found by every lookup, never served (a review). Each worker now holds its own
    reservation, and records go only when no worker's remains."""
    x, y, _ = _two_workers(tmp_path, server, 4)
    client = server.client()
    reader = _remote_tier(tmp_path, server.url, remote_namespace=x.namespace.split(":", 1)[0])
    try:
        a = _chain(1, seed=100)[0]
        assert x.put(a, 0, torch.zeros(2, 1, 2, 4, 8)) and y.put(a, 0, torch.zeros(2, 1, 2, 4, 8))
        x.flush(10)
        y.flush(10)
        assert client.zcard(x.res_key) == 2  # each counts it while writing it
        x.abandon(a)
        x.flush(10)
        assert client.zcard(x.res_key) == 1 and client.exists(x.record_key(a.h, 0))
        assert y.put(a, 1, torch.zeros(2, 1, 2, 4, 8))
        y.flush(10)
        assert reader.lookup([a]) == 1
        assert reader.fetch([a], lambda block, layers: True) == 1, "a listed block must be whole"
        assert client.zcard(x.res_key) == 0 and _held(client, x) == _counted(client, x)
    finally:
        for tier in (x, y, reader):
            tier.close()


@needs_binary
def test_a_block_rewritten_in_place_and_evicted_meanwhile_leaves_nothing_when_given_up(tmp_path, server):
    """A worker that finds a block listed rewrites it without reserving it (it is counted).
    If another worker evicts it before those records land, they are uncounted; and if the
    rewriting worker then gives the block up, nothing ever listed or deleted them: over
    the budget for good (a review). Giving up such a block now deletes what it sent when the
    block is no longer listed."""
    x, y, block_bytes = _two_workers(tmp_path, server, 1)
    client = server.client()
    try:
        a, c = _chain(1, seed=110)[0], _chain(1, seed=111)[0]
        assert all(_publish(x, [a]))
        reserve = y._reserve

        def evicted_meanwhile(conn, items):  # y found a listed; x needs the room right then
            out = reserve(conn, items)
            if any(item[0] == "record" and item[1].h == a.h for item in items):
                assert all(_publish(x, [c]))
            return out
        y._reserve = evicted_meanwhile
        assert y.put(a, 0, torch.zeros(2, 1, 2, 4, 8))
        y.flush(10)
        y._reserve = reserve
        y.abandon(a)
        y.flush(10)
        assert not client.exists(y.record_key(a.h, 0)), "the record sent in place outlived its block"
        assert _held(client, x) == _counted(client, x) <= block_bytes
    finally:
        x.close()
        y.close()


@needs_binary
def test_a_writer_gone_mid_block_does_not_hold_the_budget(tmp_path, server):
    """A worker killed mid-block leaves a reservation and some records, which no one would
    ever list or delete. A reservation no record has refreshed for ``STALE_RESERVATION_S``
    is cleared, with its records, before anything live is evicted (cleared only once the
    list was empty, they held the budget for good in a busy namespace: a review)."""
    from tiercache.remote import STALE_RESERVATION_S

    budget = 2 * _block_bytes(tmp_path, server.url)
    tier = _remote_tier(tmp_path, server.url, remote_budget=budget)
    client = server.client()
    try:
        assert all(_publish(tier, _chain(1, seed=69)))  # the list is not empty: cleared all the same
        ghosts = [_chain(1, seed=70 + i)[0] for i in range(2)]
        for ghost in ghosts:  # what the killed worker left: a reservation, its first record
            client.zadd(tier.res_key, {f"{ghost.h:016x}:gone": time.time() - STALE_RESERVATION_S - 5})
            client.set(tier.record_key(ghost.h, 0), b"x" * 100)
        good = _chain(2, seed=80)
        assert all(_publish(tier, good))
        assert tier.lookup(good) == 2
        assert client.zcard(tier.res_key) == 0
        assert not any(client.exists(tier.record_key(ghost.h, 0)) for ghost in ghosts)
        assert _held(client, tier) == _counted(client, tier) <= budget
    finally:
        tier.close()


def _publish_no_wait(tier, blocks: list) -> list:
    return [tier.put(b, layer, torch.zeros(2, 1, 2, 4, 8)) for b in blocks for layer in range(_LAYERS)]


@needs_binary
def test_a_block_already_on_the_server_is_not_counted_twice(tmp_path, model, server):
    """Fresh machines answering the same prompt each write the answer's block again. The
    budget counted its bytes again every time while the server held it once, so the count
    drifted up until every write evicted a live block. Now the count stays at what the
    namespace holds."""
    probe_cfg = cfg(tmp_path, server.url, "p")
    close_all()
    with TieredCache(model, probe_cfg) as probe:
        remote = probe._ensure_prefix().remote
        block_bytes, tier = remote.block_bytes, remote
    close_all()
    config = cfg(tmp_path, server.url, "a", remote_budget=64 * block_bytes, remote_namespace=probe_cfg.remote_namespace)
    client = server.client()
    ids = prompt(length=PROMPT_LEN)
    counts = []
    for machine in range(4):
        _, stats, _ = run(model, ids, config.replace(disk_dir=str(tmp_path / f"m{machine}")))
        listed = len([k for k in keys_of(client, config.remote_namespace) if k.endswith(":m")])
        counts.append((_counted(client, tier), listed * block_bytes))
        assert stats["remote"]["evicted_blocks"] == 0
    assert all(count == held for count, held in counts), counts


@needs_binary
def test_a_value_from_another_model_or_format_is_refused(tmp_path, model, server):
    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, server.url, "a")
    run(model, ids, config)
    client = server.client()
    close_all()
    with TieredCache(model, config.replace(disk_dir=str(tmp_path / "probe"))) as probe:
        prefix = probe._ensure_prefix()
        from tiercache.prefix import chain
        blocks = chain(ids[0].tolist(), BT, prefix.salt)
        remote = prefix.remote
        geometry = prefix.geometry
    close_all()
    # block 2, layer 0: an intact record of the same key and tokens, written for another model
    foreign = RecordCodec(geometry, b"another-model!!!")
    payload = memoryview(bytes(geometry.block_bytes))
    client.set(remote.record_key(blocks[2].h, 0),
               foreign.encode(BlockKey(blocks[2].h, 0, 2), payload, BT, blocks[2].token_ids))
    # block 5: an intact manifest of a future format version (a stray writer: keys carry the version)
    import crc32c
    body = bytearray(client.get(remote.manifest_key(blocks[5].h))[:-4])
    body[4] = 99
    client.set(remote.manifest_key(blocks[5].h), bytes(body) + crc32c.crc32c(bytes(body)).to_bytes(4, "little"))
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    errors = stats["remote"]["errors"]
    assert loaded == 2 * BT and errors["foreign"] == 2 and errors["corrupt"] == 0
    assert_same(reference(model, ids), out)
    assert ":{v1.2-" in remote.manifest_key(blocks[0].h)


@needs_binary
def test_the_servers_own_eviction_is_a_plain_miss(tmp_path, model, server):
    """maxmemory with allkeys-lru: the server drops values on its own; missing values are
    misses (no error), what is left is served, and nothing wrong ever is."""
    client = server.client()
    ids = prompt(length=60)
    config = cfg(tmp_path, server.url, "a")
    run(model, ids, config)
    stored = sum(client.memory_usage(k) or 0 for k in client.scan_iter("*"))
    client.config_set("maxmemory-policy", "allkeys-random")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"] - stored // 2)))
    client.set("filler", b"x" * 1024)  # a write makes the server evict down to maxmemory
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    remote = stats["remote"]
    assert loaded < 14 * BT and remote["misses"] >= 1
    assert remote["errors"]["corrupt"] == remote["errors"]["foreign"] == 0
    assert_same(reference(model, ids), out)


@needs_binary
def test_remote_budget_is_never_exceeded(tmp_path, model, server):
    """Budget of three blocks, two prompts of 14 whole blocks each: the namespace never holds
    more than the budget (sampled from another thread while writes go on). Blocks that find
    the budget full of blocks still being written are not sent (counted as dropped); the
    second prompt's blocks push out the first's, least recently used first; what is left
    still serves exact prefixes."""
    client = server.client()
    probe_cfg = cfg(tmp_path, server.url, "p")
    close_all()
    with TieredCache(model, probe_cfg) as probe:
        remote = probe._ensure_prefix().remote
        block_bytes, tag = remote.block_bytes, remote.namespace.split(":", 1)[1]
    close_all()
    budget = 3 * block_bytes
    config = cfg(tmp_path, server.url, "a", remote_budget=budget)
    ns = config.remote_namespace
    first, second = prompt(seed=1, length=60), prompt(seed=2, length=60)
    with _PeakBytes(server.client(), ns) as sampled:
        _, stats_1, _ = run(model, first, config)
        _, stats_2, _ = run(model, second, config.replace(disk_dir=str(tmp_path / "a2")))
    assert stats_1["remote"]["writes_dropped"] >= 1
    assert stats_2["remote"]["evicted_blocks"] >= 1
    assert 0 < sampled.peak <= budget, (sampled.peak, budget)
    assert len([k for k in keys_of(client, ns) if k.endswith(":m")]) <= 3
    counted = client.zcard(f"{ns}:{{{tag}}}:lru") + client.zcard(f"{ns}:{{{tag}}}:res")
    assert counted * block_bytes <= budget  # the shared count agrees
    out, stats, loaded = run(model, second, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded >= BT and stats["remote"]["hits"] >= 1  # the newest prompt's first blocks
    assert_same(reference(model, second), out)


@needs_binary
def test_credentials_from_the_environment_and_a_wrong_password(tmp_path, model, server, monkeypatch):
    client = server.client()
    client.config_set("requirepass", "s3cret")
    ids = prompt(length=PROMPT_LEN)
    monkeypatch.setenv("TIERCACHE_REMOTE_PASSWORD", "s3cret")
    config = cfg(tmp_path, server.url, "a")
    run(model, ids, config)
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 28
    monkeypatch.setenv("TIERCACHE_REMOTE_PASSWORD", "wrong")
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "c")))
    assert loaded == 0 and stats["remote"]["errors"]["auth"] >= 1
    assert_same(reference(model, ids), out)


def test_a_password_in_the_urls_query_never_shows(tmp_path, model, server, caplog):
    """redis-py takes a password from the URL's query too (``?password=``, the usual way
    with ``unix://`` sockets). It authenticated, and then the password showed in
    ``stats()["remote"]["url"]``, in the log lines and in the CLI's summary (a review)."""
    client = server.client()
    client.config_set("requirepass", "s3cret")
    ids = prompt(length=PROMPT_LEN)
    url = server.url + "?password=s3cret"
    config = cfg(tmp_path, url, "a")
    caplog.set_level("INFO", logger="tiercache")
    run(model, ids, config)
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 28, "the query's password did not authenticate"
    assert stats["remote"]["url"] == server.url + "?password=***"
    wrong = config.replace(disk_dir=str(tmp_path / "c"), remote_url=server.url + "?password=WRONGs3cret")
    out, stats, loaded = run(model, ids, wrong)
    assert loaded == 0 and stats["remote"]["errors"]["auth"] >= 1
    assert "is up" in caplog.text and "unavailable" in caplog.text  # both kinds of line were logged
    assert "s3cret" not in caplog.text and "s3cret" not in json.dumps(stats)
    assert_same(reference(model, ids), out)


@needs_binary
def test_an_acl_user_limited_to_its_namespace(tmp_path, model, server):
    """The README's ACL works as written; a user whose keys pattern excludes the namespace is
    refused by the server (NOPERM, counted as auth) and generation goes on locally."""
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "team-a", "on", ">secret", "~team-a:*", "+get", "+set", "+del",
                          "+zadd", "+zrem", "+zpopmin", "+zcard", "+zrangebyscore", "+zscan", "+ping")
    # every command the budget uses, the rare ones too (a writer gone mid-block: its stale
    # reservation is read and cleared), is allowed on the namespace's keys
    for command in (("ZRANGEBYSCORE", "team-a:{x}:res", "-inf", "1"), ("ZREM", "team-a:{x}:res", "a"),
                    ("ZPOPMIN", "team-a:{x}:lru", "1"), ("ZCARD", "team-a:{x}:res"), ("ZSCAN", "team-a:{x}:res", "0"), ("DEL", "team-a:{x}:0")):
        assert admin.execute_command("ACL", "DRYRUN", "team-a", *command) == b"OK", command
    ids = prompt(length=PROMPT_LEN)
    url = f"redis://team-a:secret@127.0.0.1:{server.port}/0"
    config = cfg(tmp_path, url, "a", remote_namespace="team-a", remote_budget="64MiB")
    run(model, ids, config)
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
    assert loaded == 28 and sum(stats["remote"]["errors"].values()) == 0
    out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "c"), remote_namespace="team-b"))
    assert loaded == 0 and stats["remote"]["errors"]["auth"] >= 1
    assert_same(reference(model, ids), out)


@needs_binary
def test_tls(tmp_path, model):
    """rediss:// with the server's CA in the URL: sharing works over TLS. Without the CA the
    certificate does not verify: counted as unavailable, generation goes on locally."""
    ca = self_signed_cert(str(tmp_path / "tls"))
    if ca is None:
        pytest.skip("no openssl binary to make a test certificate")
    srv = RedisServer(str(tmp_path / "redis"), tls_ca=ca)
    try:
        ids = prompt(length=PROMPT_LEN)
        config = cfg(tmp_path, srv.url, "a")
        run(model, ids, config)
        out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
        assert loaded == 28 and stats["remote"]["hits"] == 7
        unverified = f"rediss://127.0.0.1:{srv.port}/0"
        out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "c"), remote_url=unverified))
        assert loaded == 0 and stats["remote"]["errors"]["unavailable"] >= 1
        assert_same(reference(model, ids), out)
    finally:
        srv.close()


@needs_binary
@pytest.mark.slow
def test_cluster_mode(tmp_path, model):
    """A three-node Redis Cluster: a block's keys share a hash tag (one slot), the blocks of
    a prompt spread over the nodes, and the cluster client's pipelines reach all of them."""
    nodes = []
    try:
        bus_ports = [free_port() for _ in range(3)]  # the default, port + 10000, may not exist
        for i in range(3):
            d = tmp_path / f"node{i}"
            nodes.append(RedisServer(str(d), "--cluster-enabled", "yes", "--cluster-config-file",
                                     str(d / "nodes.conf"), "--cluster-node-timeout", "2000",
                                     "--cluster-port", str(bus_ports[i])))
        ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (low, high) in zip(nodes, ranges):
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        for node, bus in zip(nodes[1:], bus_ports[1:]):
            nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO") for n in nodes):
            assert time.monotonic() < deadline, "cluster did not become ok"
            time.sleep(0.2)
        ids = prompt(length=PROMPT_LEN)
        config = cfg(tmp_path, nodes[1].url, "a", remote_cluster=True, remote_budget="64MiB")
        run(model, ids, config)
        holding = [n for n in nodes if n.client().dbsize() > 0]
        assert len(holding) >= 2  # 7+ blocks over three nodes
        out, stats, loaded = run(model, ids, config.replace(disk_dir=str(tmp_path / "b")))
        assert loaded == 28 and stats["remote"]["cluster"] and stats["remote"]["hits"] == 7
        assert_same(reference(model, ids), out)
    finally:
        for node in nodes:
            node.close()


@needs_server
def test_metrics_show_the_remote_tier(tmp_path, model, shared_url):
    """A real HTTP scrape: the remote tier's series agree with stats()."""
    from tiercache.metrics import serve_metrics, stop_metrics

    ids = prompt(length=PROMPT_LEN)
    config = cfg(tmp_path, shared_url, "a")
    run(model, ids, config)
    close_all()
    with TieredCache(model, config.replace(disk_dir=str(tmp_path / "b"))) as cache, torch.no_grad():
        port = serve_metrics(cache)
        cache.load_prefix(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, **GEN)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        stats = cache.stats()
        stop_metrics(cache)
    assert "tiercache_remote_up 1.0" in body
    assert f'tiercache_remote_blocks_total{{result="hit"}} {float(stats["remote"]["hits"])}' in body
    assert 'tiercache_remote_errors_total{kind="corrupt"} 0.0' in body


@needs_server
@pytest.mark.model
@pytest.mark.slow
def test_cli_two_machines_share_a_prompt_of_the_real_model(tmp_path, shared_url):
    """`tiercache generate` twice with the default model, two disk dirs (two machines), one
    server: the second run loads the prompt's blocks from the server and answers the same."""
    from test_cli import cli

    ns = f"t{uuid.uuid4().hex[:10]}"
    prompt_text = " ".join(f"Record {i}: the colour of box {i} is {['red', 'blue', 'green'][i % 3]}." for i in range(40))
    prompt_text += " What is the colour of box 7?"
    runs = []
    for machine in ("a", "b"):
        stats = tmp_path / f"{machine}.json"
        proc = cli("generate", "--prompt", prompt_text, "--max-new-tokens", "8", "--block-tokens", "64",
                   "--disk-dir", str(tmp_path / machine), "--remote-url", shared_url, "--remote-namespace", ns,
                   "--stats-json", str(stats))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(stats.read_text()))
    first, second = runs
    assert first["stats"]["reused_tokens"] == 0 and first["stats"]["remote"]["blocks_written"] >= 5
    assert second["stats"]["reused_tokens"] >= 5 * 64 and second["stats"]["remote"]["hits"] >= 5
    assert second["text"] == first["text"]


@needs_server
@pytest.mark.slow
def test_bench_prefix_remote_smoke(tmp_path, shared_url):
    """`bench prefix --remote URL`: warm from the server in a fresh process on an empty
    disk_dir, with the bytes read and written, exact logits, and its namespace deleted."""
    import redis

    from test_cache_admin import tiny_bench_model

    tiny_bench_model(tmp_path / "model")
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "prefix", "--model", str(tmp_path / "model"),
                           "--context", "200", "--turns", "2", "--answer-tokens", "4", "--block-tokens", "8",
                           "--dir", str(tmp_path), "--remote", shared_url, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["warm_remote_ttft_s"] > 0 and r["warm_remote_reused_tokens"] == (120 - 1) // 8 * 8
    assert r["remote_bytes_read"] > 0 and r["remote_bytes_written"] >= r["remote_bytes_read"]
    assert r["warm_remote_max_abs_diff"] <= 1e-5 and not any(r["remote_errors"].values())
    client = redis.Redis.from_url(shared_url)
    assert not list(client.scan_iter("tiercache-bench-*"))


def test_the_remote_tier_connects_as_it_opens_so_up_means_up(tmp_path, model, shared_url, server):
    """Until a first lookup or write the tier's state was "unknown", which the exporter's
    ``tiercache_remote_up`` showed as 0, "down", for a healthy server (an alert on it fired
    at every process start). The tier now connects in the background as it opens: a cache
    that only opened its store reads "up" soon, and a server that is not there "down"."""
    from tiercache.metrics import metrics_for
    from prometheus_client import generate_latest

    def state_after_open(url: str, name: str) -> tuple:
        close_all()
        with TieredCache(model, cfg(tmp_path, url, name)) as cache:
            cache.load_prefix(prompt(length=2))  # opens the prefix cache (and its remote tier); nothing to load
            deadline = time.monotonic() + 10
            while cache.stats()["remote"]["state"] == "unknown" and time.monotonic() < deadline:
                time.sleep(0.02)
            scraped = generate_latest(metrics_for(cache).registry).decode()
            return cache.stats()["remote"], scraped

    remote, scraped = state_after_open(shared_url, "up")
    assert remote["state"] == "up" and remote["lookups"] == 0 and remote["bytes_written"] == 0
    assert "tiercache_remote_up 1.0" in scraped
    url = server.url
    server.stop()
    remote, scraped = state_after_open(url, "down")
    assert remote["state"] == "down" and "tiercache_remote_up 0.0" in scraped


def test_a_prefix_cache_that_fails_to_open_closes_its_remote_tier(tmp_path, model, shared_url, monkeypatch):
    """The remote tier connects as it opens; a prefix cache whose index then failed (a full
    disk: the cache runs without reuse, and the next one tries again) left the tier's thread
    and its connection to the server behind, one more per cache (a review's repro)."""
    import threading

    from tiercache.errors import TierIOError
    from tiercache.prefix import PrefixIndex

    def full(self, key, value):
        raise TierIOError("No space left on device (injected)")

    monkeypatch.setattr(PrefixIndex, "set_meta", full)
    ids = prompt(length=PROMPT_LEN)
    before = {t for t in threading.enumerate() if t.name == "tiercache-remote"}
    for i in range(3):
        with TieredCache(model, cfg(tmp_path, shared_url, "a")) as cache, torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=2, do_sample=False)
            assert cache.prefix is None  # off for this run
    close_all()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = {t for t in threading.enumerate() if t.name == "tiercache-remote" and t.is_alive()} - before
        if not left:
            break
        time.sleep(0.05)
    assert not left


@needs_binary
def test_a_server_out_of_memory_never_lists_a_block_with_records_missing(tmp_path, server, monkeypatch):
    """Scenario: the server is full (maxmemory, noeviction) while blocks are published with
    remote_budget. It refuses some records of a batch and takes others. Before, the
    batch's manifests and listings went in the same pipeline after the refused records: a
    block was listed with a record missing, counted against the budget, and every reader
    stopped its prefix there for good (a review; blocks_written said fewer than were
    listed). Now the manifests go only once every record of the batch was taken: every
    block listed is whole, the count is what the server lists, and after close no
    reservation or record of a block that was not listed is left."""
    import tiercache.remote as remote

    monkeypatch.setattr(remote, "RETRY_SECONDS", 0.05)  # try again soon after each refusal
    client = server.client()
    tier = _remote_tier(tmp_path, server.url, remote_budget="1GiB")
    record = tier.record_bytes
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + 40 * record))
    blocks = []
    try:
        for seed in range(24):  # ~4 records a block, ~100 in all: the server takes ~40
            chain_blocks = _chain(4, seed=seed)
            blocks += chain_blocks
            _publish(tier, chain_blocks)
            time.sleep(0.06)
        stats = tier.stats()
    finally:
        tier.close()
    assert stats["errors"]["server"] >= 1 and stats["writes_dropped"] >= 1, "the server never refused a write"
    listed = {int(m, 16) for m in client.zrange(tier.lru_key, 0, -1)}
    manifests = [b for b in blocks if client.exists(tier.manifest_key(b.h))]
    assert manifests, "nothing was written before the server filled up"
    assert {b.h for b in manifests} == listed
    assert stats["blocks_written"] == len(manifests)
    for b in manifests:
        missing = [layer for layer in range(_LAYERS) if not client.exists(tier.record_key(b.h, layer))]
        assert not missing, f"block {b.index} is listed with records of layers {missing} missing"
    assert client.zcard(tier.res_key) == 0, "reservations of blocks never listed were left counted"
    strays = [b for b in blocks if b.h not in listed and any(client.exists(tier.record_key(b.h, layer))
                                                              for layer in range(_LAYERS))]
    assert not strays, f"{len(strays)} blocks that were never listed left records on the server"


@needs_binary
def test_a_refused_manifest_gives_back_its_blocks_records_and_reservation(tmp_path, server, monkeypatch):
    """Scenario: a block's records went in earlier batches and its manifest comes in a batch
    of its own, which the server refuses (here its ACL lets this user write records and the
    budget's sets, not manifests). Only records marked a block as dropped: its reservation
    and records stayed counted against remote_budget until the 10-minute stale timeout (a
    review). The manifest's block is given back too now: after close, nothing of it is
    left on the server and nothing is counted."""
    import tiercache.remote as remote

    monkeypatch.setattr(remote, "RETRY_SECONDS", 0.05)
    monkeypatch.setattr(remote, "BATCH_BYTES", 1)  # one record a batch: the manifest comes alone
    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "writer", "on", ">pw", "+@all", "%R~*", "%W~*}:[0-9]*", "%W~*:lru",
                          "%W~*:res")
    url = f"redis://writer:pw@127.0.0.1:{server.port}/0"
    tier = _remote_tier(tmp_path, url, remote_budget="1GiB")
    (block,) = _chain(1, seed=7)
    try:
        _publish(tier, [block])
        stats = tier.stats()
    finally:
        tier.close()
    assert stats["errors"]["auth"] + stats["errors"]["server"] >= 1 and stats["blocks_written"] == 0, stats
    assert not admin.exists(tier.manifest_key(block.h))
    assert [layer for layer in range(_LAYERS) if admin.exists(tier.record_key(block.h, layer))] == []
    assert admin.zcard(tier.res_key) == 0 and admin.zcard(tier.lru_key) == 0
