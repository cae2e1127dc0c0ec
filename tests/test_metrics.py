"""Prometheus metrics: scraped over real HTTP during a real generation that uses every tier,
parsed with prometheus_client's parser and checked against ``cache.stats()``."""
from __future__ import annotations

import os
import socket
import threading
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tiercache
from tiercache import TierConfig, TieredCache
from tiercache.metrics import CacheMetrics, metrics_for, serve_metrics, stop_metrics, write_textfile

transformers = pytest.importorskip("transformers")

HISTOGRAMS = ("tiercache_move_seconds", "tiercache_stall_seconds")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None  # always generate max_new_tokens
    return m


@pytest.fixture
def make_cache(model, tmp_path):
    """Blocks are 1 KiB; device 16 blocks, host 6 slots (4 KiB each), disk the rest."""
    caches = []

    def make() -> TieredCache:
        cfg = TierConfig(device_budget=16 * 1024, host_budget=6 * 4096, disk_dir=str(tmp_path / f"kv{len(caches)}"),
                         disk_budget="1MiB", block_tokens=4)
        caches.append(TieredCache(model, cfg))
        return caches[-1]

    yield make
    for cache in caches:
        stop_metrics(cache)
        cache.close()


def generate(model, cache, num_prompt_tokens: int = 16, max_new_tokens: int = 20) -> None:
    """A generation, then the cache idle: the last step's read-ahead of the next step's first
    layer may still be landing when generate() returns, and a scrape compared with stats()
    would count it on one side only."""
    ids = torch.randint(0, 128, (1, num_prompt_tokens), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, cache=cache)
    cache.store.wait_idle()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict:
    """{(sample name, sorted labels): value} of every counter and gauge sample."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in HISTOGRAMS:
            continue
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def histogram(text: str, name: str) -> dict:
    """{labels without le: {"count", "sum", "buckets": [(le, value)]}} of one histogram."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            h = out.setdefault(labels, {"buckets": []})
            if s.name.endswith("_bucket"):
                h["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                h["count"] = s.value
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
    return out


def expected(stats: dict, policy: str = TierConfig.eviction) -> dict:
    """What the exporter must show for ``stats``: one sample per stats() number."""
    out = {}

    def put(name: str, value: float, **labels: str) -> None:
        out[(name, tuple(sorted(labels.items())))] = float(value)

    for tier, t in stats["tiers"].items():
        put("tiercache_tier_budget_bytes", t["budget_bytes"], tier=tier)
        put("tiercache_tier_used_bytes", t["used_bytes"], tier=tier)
        put("tiercache_tier_blocks", t["blocks"], tier=tier)
    for direction, m in stats["moves"].items():
        src, dst = direction.split("->")
        put("tiercache_moves_total", m["blocks"], src=src, dst=dst)
        put("tiercache_move_bytes_total", m["bytes"], src=src, dst=dst)
    for tier, n in stats["hits"].items():
        put("tiercache_hits_total", n, tier=tier)
    put("tiercache_misses_total", stats["misses"])
    for tier, n in stats["evictions"].items():
        put("tiercache_evictions_total", n, tier=tier, policy=policy)
    for outcome, n in stats["prefetch"].items():
        put("tiercache_prefetch_total", n, outcome=outcome)
    put("tiercache_prefill_tokens_total", stats["prefill_tokens"])
    put("tiercache_decode_tokens_total", stats["decode_tokens"])
    put("tiercache_reused_tokens_total", stats["reused_tokens"])
    put("tiercache_published_blocks_total", stats["published_blocks"])
    for tier, n in stats["integrity_errors_by_tier"].items():
        put("tiercache_integrity_errors_total", n, tier=tier)
    put("tiercache_pinned_fallback_total", stats["pinned_fallbacks"])
    put("tiercache_failed_moves_total", stats["failed_moves"])
    return out


def is_counter(key: tuple) -> bool:
    return key[0].endswith("_total")


def test_scrapes_during_and_after_a_generation_that_uses_every_tier_agree_with_stats(model, make_cache):
    cache = make_cache()
    port = serve_metrics(cache)
    assert tiercache.serve_metrics is serve_metrics  # the lazy export

    # 1. From the compute thread itself, in the middle of decoding: a real HTTP scrape bracketed
    #    by stats() before and after. Async moves may land in between; tokens cannot.
    mid: list = []

    def scrape_mid_decode(kind: str, fields: dict) -> None:
        if kind == "tokens" and fields["decode"] and not mid:
            before = cache.stats()
            text = scrape(port)
            mid.append((before, samples(text), cache.stats()))

    cache.events.add_listener(scrape_mid_decode)

    # 2. From another thread, as often as it can, for the whole generation: every scrape parses
    #    and no counter ever goes down.
    done = threading.Event()
    background: list = []
    errors: list = []

    def hammer() -> None:
        try:
            while not done.is_set():
                background.append(samples(scrape(port)))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        generate(model, cache)
    finally:
        done.set()
        thread.join()
    assert not errors
    assert len(background) >= 2
    for older, newer in zip(background, background[1:]):
        for key, value in older.items():
            if is_counter(key):
                assert newer.get(key, 0.0) >= value, key

    [(before, got, after)] = mid
    exp_before, exp_after = expected(before), expected(after)
    assert 0 < got[("tiercache_decode_tokens_total", ())] == before["decode_tokens"] == after["decode_tokens"]
    assert set(got) <= set(exp_after)
    for key, value in got.items():
        if is_counter(key):
            assert exp_before.get(key, 0.0) <= value <= exp_after[key], key

    # 3. After the generation (``generate`` waits for the cache to be idle), with the cache
    #    still open: every number equals stats() exactly.
    stats = cache.stats()
    assert all(stats["tiers"][t]["blocks"] > 0 for t in ("device", "host", "disk")), stats["tiers"]
    assert {"device->host", "host->disk"} <= set(stats["moves"])
    assert {"disk->host", "disk->device"} & set(stats["moves"])  # read back up from disk
    # hits below the device (a read that a prefetch served in time counts where it landed,
    # so which lower tier gets them depends on timing)
    assert stats["hits"]["host"] + stats["hits"]["disk"] > 0, stats["hits"]
    text = scrape(port)
    assert samples(text) == expected(stats)

    # The histograms saw every move and stall since the exporter attached (here: all of them).
    moves = histogram(text, "tiercache_move_seconds")
    assert {f"{dict(k)['src']}->{dict(k)['dst']}" for k in moves} == set(stats["moves"])
    for labels, h in moves.items():
        m = stats["moves"][f"{dict(labels)['src']}->{dict(labels)['dst']}"]
        assert h["count"] == m["blocks"] == h["buckets"][-1][1]
        assert h["sum"] == pytest.approx(m["seconds"], rel=1e-9)
        assert [v for _, v in h["buckets"]] == sorted(v for _, v in h["buckets"])
    stall = histogram(text, "tiercache_stall_seconds")[()]
    assert stall["count"] > 0 and stall["sum"] == pytest.approx(stats["stall_seconds"], rel=1e-9)

    # 4. Closing the cache keeps its last numbers scrapeable; stopping the exporter frees the port.
    cache.close()
    assert samples(scrape(port)) == expected(cache.stats())
    stop_metrics(cache)
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def _outbound_ip() -> str:
    """A non-loopback address of this machine (no packet is sent), or skip."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route
        except OSError:
            pytest.skip("no non-loopback interface")
        ip = s.getsockname()[0]
    if ip.startswith("127.") or ip == "0.0.0.0":
        pytest.skip("no non-loopback interface")
    return ip


def test_serves_on_loopback_only_unless_another_address_is_asked_for(make_cache):
    cache = make_cache()
    port = serve_metrics(cache)
    assert metrics_for(cache).addresses == [("127.0.0.1", port)]
    scrape(port)
    ip = _outbound_ip()
    with pytest.raises(OSError):  # refused: nothing listens there
        socket.create_connection((ip, port), timeout=5).close()

    wide = serve_metrics(cache, addr="0.0.0.0")
    assert ("0.0.0.0", wide) in metrics_for(cache).addresses
    with urllib.request.urlopen(f"http://{ip}:{wide}/metrics", timeout=10) as response:
        assert "tiercache_tier_budget_bytes" in response.read().decode()


def test_addr_none_is_loopback_and_a_wrong_address_type_is_named(make_cache):
    """``addr=None`` (a wrapper passing an unset setting) reached prometheus_client, which
    listened on every interface; an address of another type was a TypeError from getaddrinfo
    that named no parameter."""
    cache = make_cache()
    port = serve_metrics(cache, addr=None)
    assert metrics_for(cache).addresses == [("127.0.0.1", port)]
    with pytest.raises(OSError):
        socket.create_connection((_outbound_ip(), port), timeout=5).close()
    with pytest.raises(TypeError, match="metrics addr: expected an address string .* got 123"):
        serve_metrics(cache, addr=123)
    for empty in ("", " "):  # a string, but no address: a ValueError naming it (it was a TypeError)
        with pytest.raises(ValueError, match="metrics addr: an empty address"):
            serve_metrics(cache, addr=empty)
    assert metrics_for(cache).addresses == [("127.0.0.1", port)]
    from tiercache.metrics import metrics_url  # what `tiercache generate` prints: IPv6 in brackets

    assert metrics_url("::1", 9464) == "http://[::1]:9464/metrics"
    assert metrics_url("127.0.0.1", 9464) == "http://127.0.0.1:9464/metrics"


def test_stopping_an_exporter_detaches_it_and_a_failed_one_leaves_nothing_behind(make_cache):
    """``stop_metrics`` left the stopped exporter listening to the cache's events (one more
    per serve/stop cycle, each called on every move); an exporter whose registration into
    the default registry failed (a second cache there) stayed attached too."""
    cache = make_cache()
    listeners = list(cache.events._listeners)
    for _ in range(5):
        scrape(serve_metrics(cache))
        stop_metrics(cache)
    assert cache.events._listeners == listeners
    other = make_cache()
    first = CacheMetrics(cache, register_default=True)
    try:
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            CacheMetrics(other, register_default=True)
        assert other.events._listeners == [fn for fn in other.events._listeners if fn not in listeners] == []
    finally:
        first.close()
    assert b"tiercache_" not in generate_latest(REGISTRY)
    # metrics_for(register_default=True) on a cache that has an exporter registers that one
    # (it was ignored: the default registry stayed empty)
    metrics_for(cache)
    try:
        assert metrics_for(cache, register_default=True) is metrics_for(cache)
        assert b"tiercache_tier_budget_bytes" in generate_latest(REGISTRY)
    finally:
        stop_metrics(cache)
    assert b"tiercache_" not in generate_latest(REGISTRY)


def test_an_exporter_closed_while_serve_starts_its_server_leaves_nothing_listening(make_cache, monkeypatch):
    """``serve`` starts the HTTP server and then lists it; a ``close`` on another thread in
    between took the list without it, and the server kept answering after ``close``
    returned, with nothing left to stop it (a review). Now ``serve`` sees the exporter
    closed when it lists the server, stops it and says so. Scenario: the server is up and
    ``serve`` is held just before listing it; ``close`` runs; ``serve`` goes on."""
    from tiercache import metrics as metrics_module

    cache = make_cache()
    exporter = CacheMetrics(cache)
    real_start = metrics_module.start_http_server
    started, go, bound, outcome = threading.Event(), threading.Event(), [], []

    def held_start(*args, **kwargs):
        server, thread = real_start(*args, **kwargs)
        bound.append(server.server_address[1])
        started.set()
        assert go.wait(30), "the test never let serve go on"
        return server, thread

    def serve():
        try:
            outcome.append(exporter.serve(0))
        except RuntimeError as exc:
            outcome.append(exc)
    monkeypatch.setattr(metrics_module, "start_http_server", held_start)
    server_thread = threading.Thread(target=serve)
    server_thread.start()
    try:
        assert started.wait(30)
        scrape(bound[0])  # listening, not listed yet
        exporter.close()
    finally:
        go.set()
        server_thread.join(30)
    assert isinstance(outcome[0], RuntimeError) and "closed" in str(outcome[0]), outcome
    assert exporter.addresses == []
    with pytest.raises(urllib.error.URLError):
        scrape(bound[0])


def test_an_endpoint_that_cannot_listen_is_one_clear_error(make_cache):
    """A port another socket holds, an address no interface has, a port out of range: one
    error naming the address and the reason (a ``MetricsServerError``, still an
    ``OSError``), not an ``OverflowError`` or ``gaierror`` from inside the socket module.
    The cache's metrics keep working on a port that is free."""
    cache = make_cache()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        with pytest.raises(tiercache.MetricsServerError, match=rf"cannot serve on 127.0.0.1:{port} \(.*in use"):
            serve_metrics(cache, port=port)
    finally:
        taken.close()
    with pytest.raises(OSError, match=r"cannot serve on 999.1.1.1:0 \("):
        serve_metrics(cache, addr="999.1.1.1")
    for bad in (70000, -1, "8080"):
        with pytest.raises(ValueError, match=r"metrics port: must be an integer in \[0, 65535\]"):
            serve_metrics(cache, port=bad)
    scrape(serve_metrics(cache))


def test_each_cache_has_its_own_registry_and_nothing_goes_to_the_default_one_unless_asked(model, make_cache):
    first, second = make_cache(), make_cache()
    generate(model, first, max_new_tokens=4)
    m1, m2 = CacheMetrics(first), CacheMetrics(second)
    assert m1.registry is not m2.registry
    assert samples(generate_latest(m1.registry).decode()) == expected(first.stats())
    assert samples(generate_latest(m2.registry).decode())[("tiercache_decode_tokens_total", ())] == 0
    assert b"tiercache_" not in generate_latest(REGISTRY)

    default = CacheMetrics(second, register_default=True)
    try:
        assert b"tiercache_tier_budget_bytes" in generate_latest(REGISTRY)
    finally:
        default.close()
    assert b"tiercache_" not in generate_latest(REGISTRY)


def test_before_the_first_update_gauges_show_the_budgets_and_counters_are_zero(make_cache):
    cache = make_cache()
    assert cache.store is None
    got = samples(generate_latest(metrics_for(cache).registry).decode())
    assert got == expected(cache.stats())
    assert got[("tiercache_tier_budget_bytes", (("tier", "host"),))] == 6 * 4096
    assert all(v == 0 for k, v in got.items() if is_counter(k))


def test_textfile_written_after_generation_counts_what_happened_before_attaching(model, make_cache, tmp_path):
    cache = make_cache()
    generate(model, cache, max_new_tokens=8)  # no exporter yet
    path = tmp_path / "tiercache.prom"
    write_textfile(cache, str(path))
    text = path.read_text()
    assert samples(text) == expected(cache.stats())
    assert cache.stats()["moves"] and histogram(text, "tiercache_move_seconds") == {}  # only since attaching


def test_a_textfile_through_a_symlink_writes_where_the_link_leads_and_the_link_stays(model, make_cache, tmp_path):
    """node_exporter set-ups often give the job a link into the collector's folder. Before,
    ``write_textfile`` renamed its temporary file over the link itself: the link became a
    plain file, and the file it pointed to (the one node_exporter reads) was never written.
    Now the file the link leads to is replaced, atomically (its temporary file is made next
    to it, in its own folder, and nothing is left behind), and the link stays a link; a
    dangling link gets its target made."""
    cache = make_cache()
    generate(model, cache, max_new_tokens=2)
    collector = tmp_path / "collector"
    collector.mkdir()
    target = collector / "tiercache.prom"
    target.write_text("# the previous run's metrics\n")
    link = tmp_path / "job.prom"
    link.symlink_to(target)
    write_textfile(cache, str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert samples(target.read_text()) == expected(cache.stats())
    dangling = tmp_path / "new.prom"
    dangling.symlink_to(collector / "second.prom")
    write_textfile(cache, str(dangling))
    assert dangling.is_symlink() and samples((collector / "second.prom").read_text()) == expected(cache.stats())
    assert sorted(os.listdir(collector)) == ["second.prom", "tiercache.prom"]  # no temporary file left
    assert sorted(os.listdir(tmp_path)) == ["collector", "job.prom", "kv0", "new.prom"]


def test_a_textfile_path_that_is_a_fifo_or_a_directory_is_refused_and_left_as_it_was(model, make_cache, tmp_path):
    """The rename replaced whatever was at the path: a named pipe (its reader then waited
    for good) became a plain file, and as root ``/dev/full`` did too. (A device node cannot
    be made without root, and this test must not risk a real one: a FIFO stands for every
    kind that is not a regular file.) Now a FIFO, or a link to one, is refused with a
    ValueError naming the path and what it is, and stays a FIFO; a directory is refused
    the same way (it was an IsADirectoryError from deep inside prometheus_client)."""
    import stat

    cache = make_cache()
    fifo = tmp_path / "pipe.prom"
    os.mkfifo(fifo)
    link = tmp_path / "link.prom"
    link.symlink_to(fifo)
    folder = tmp_path / "folder.prom"
    folder.mkdir()
    for path, kind in ((fifo, "a named pipe"), (link, "a named pipe"), (folder, "a directory")):
        with pytest.raises(ValueError, match=f"metrics textfile: '{path}' .*is {kind}"):
            write_textfile(cache, str(path))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and folder.is_dir()
    assert sorted(os.listdir(tmp_path)) == ["folder.prom", "link.prom", "pipe.prom"]  # no temporary file
    assert os.listdir(folder) == []


def test_a_batch_is_one_event_and_the_histogram_matches_prometheus_clients():
    """A batch of moves is one ``move`` event that carries ``blocks``; the exporter's
    histogram counts it in one step. Oracle: prometheus_client's own ``Histogram`` fed the
    same values one observation at a time, in a registry of its own. Both expositions
    must hold the same ``_bucket`` and ``_count`` samples and the same ``_sum`` to rounding
    (the values straddle bucket edges, with an exact edge, zero and a value past the last
    bucket)."""
    from prometheus_client import CollectorRegistry, Histogram

    from tiercache.events import Events
    from tiercache.metrics import MOVE_BUCKETS, STALL_BUCKETS

    class Cache:  # what CacheMetrics reads: events and stats()
        def __init__(self) -> None:
            self.events = Events()

        def stats(self) -> dict:
            return self.events.snapshot()

    cache = Cache()
    first = CacheMetrics(cache)
    fresh = generate_latest(first.registry).decode()
    first.close()
    stall_registry = CollectorRegistry()
    Histogram("tiercache_stall_seconds", "stalls", buckets=STALL_BUCKETS, registry=stall_registry)
    # an unlabelled histogram shows zeros before its first observation, as prometheus_client's does
    assert histogram(fresh, "tiercache_stall_seconds") == histogram(
        generate_latest(stall_registry).decode(), "tiercache_stall_seconds") != {}
    seen: list = []
    cache.events.add_listener(lambda kind, fields: seen.append(fields) if kind == "move" else None)
    metrics = CacheMetrics(cache)
    oracle_registry = CollectorRegistry()
    oracle = Histogram("tiercache_move_seconds", "Duration of one block move", ["src", "dst"],
                       buckets=MOVE_BUCKETS, registry=oracle_registry)
    batches = [("device", "host", 2.5e-5, 43), ("device", "host", 3e-5, 1), ("host", "device", 0.0, 7),
               ("host", "disk", 0.0123, 12), ("disk", "host", 2.0, 3), ("device", "host", 1e-3, 5)]
    for src, dst, seconds, n in batches:
        cache.events.move(src, dst, 1 << 20, seconds, blocks=n)
        for _ in range(n):
            oracle.labels(src, dst).observe(seconds)
    assert [(f["src"], f["dst"], f["blocks"]) for f in seen] == [(s, d, n) for s, d, _, n in batches]
    ours = histogram(generate_latest(metrics.registry).decode(), "tiercache_move_seconds")
    theirs = histogram(generate_latest(oracle_registry).decode(), "tiercache_move_seconds")
    assert ours.keys() == theirs.keys() and len(ours) == 4
    for labels, h in ours.items():  # n * value, not n additions: the sums agree to rounding
        assert h["buckets"] == theirs[labels]["buckets"] and h["count"] == theirs[labels]["count"]
        assert h["sum"] == pytest.approx(theirs[labels]["sum"], rel=1e-12)
    assert ours[(("dst", "host"), ("src", "device"))]["count"] == 49
    metrics.close()


def test_a_broken_event_never_reaches_the_store(make_cache):
    cache = make_cache()
    metrics = metrics_for(cache)
    metrics._on_event("move", {"src": "device"})  # missing fields: logged, not raised
    metrics.close()
    metrics.close()  # idempotent
    assert metrics_for(cache) is not metrics  # a closed exporter is replaced on next use


def test_the_dashboard_and_the_docs_only_use_metrics_that_exist(make_cache, tmp_path):
    import json
    import pathlib
    import re

    from tiercache.disk import RecordCodec
    from tiercache.metrics import _remote_families
    from tiercache.remote import RemoteTier

    root = pathlib.Path(__file__).resolve().parent.parent
    dashboard = json.loads((root / "examples" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    cache = make_cache()
    families = {f.name: f.type for f in text_string_to_metric_families(
        generate_latest(metrics_for(cache).registry).decode())}
    # the remote tier's series exist only with a remote tier (none is connected here)
    remote = RemoteTier(TierConfig(disk_dir=str(tmp_path / "kv"), remote_url="redis://127.0.0.1:1/0"),
                        RecordCodec(tiercache.BlockGeometry(1, 2, 4, 8, torch.float32)),
                        "tag", 2)
    families.update({f.name: f.type for f in _remote_families(remote.stats())})
    exported = {f"{n}_total" if t == "counter" else n for n, t in families.items()}
    exported |= {f"{n}{s}" for n, t in families.items() if t == "histogram" for s in ("_bucket", "_sum", "_count")}
    for text in (exprs, (root / "docs" / "metrics.md").read_text()):
        used = set(re.findall(r"tiercache_[a-z_]+", text))
        assert used and used <= exported, used - exported
    assert {"tiercache_tier_used_bytes", "tiercache_move_bytes_total", "tiercache_hits_total",
            "tiercache_stall_seconds_sum", "tiercache_evictions_total"} <= set(re.findall(r"tiercache_[a-z_]+", exprs))
