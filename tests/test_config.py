"""TierConfig: one frozen config, validated in one place; every bad value is named."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

from tiercache import TierConfig, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("512KiB", 512 << 10), ("4096", 4096), (4096, 4096),
    ("1 GiB", 1 << 30), ("2kb", 2000), ("0", 0),
])
def test_parse_bytes_accepts_iec_and_plain(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1", -5, "lots", "12 parsecs", "1.5.2GiB", None, True, 1.5])
def test_parse_bytes_rejects_with_the_field_named(bad):
    with pytest.raises(ValueError, match="host_budget"):
        parse_bytes(bad, "host_budget")


def test_budgets_are_stored_as_int_bytes_and_config_is_frozen(tmp_path):
    cfg = TierConfig(device_budget="32MiB", host_budget="128MiB", disk_dir=str(tmp_path / "kv"), disk_budget="4GiB")
    assert (cfg.device_budget, cfg.host_budget, cfg.disk_budget) == (32 << 20, 128 << 20, 4 << 30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.device_budget = 1  # type: ignore[misc]
    assert cfg.disk_enabled and cfg.host_enabled
    assert not TierConfig(host_budget=0).host_enabled
    assert not TierConfig(disk_dir=str(tmp_path), disk_budget=0).disk_enabled
    assert not TierConfig().disk_enabled  # no disk_dir: no disk tier


@pytest.mark.parametrize("field,value,message", [
    ("device_budget", "-3MiB", "device_budget"),
    ("device_budget", 0, "device_budget"),
    ("host_budget", "many", "host_budget"),
    ("disk_budget", "-1", "disk_budget"),
    ("block_tokens", 0, "block_tokens"),
    ("block_tokens", "16", "block_tokens"),
    ("io_workers", 0, "io_workers"),
    ("direct_io", "maybe", "direct_io"),
    ("disk_io", "io_uring", "disk_io"),
    # each was accepted: "no" counted as True (a 0777 directory let through), a device name
    # torch cannot parse failed at the first generate(), 1 passed for True
    ("shared_dir", "no", "shared_dir: must be True or False"),
    ("device", "bogus", "device: expected a torch device such as 'cpu' or 'cuda:0', got 'bogus'"),
    # a store on meta took every put and stored nothing; on mps it failed inside torch (a review)
    ("device", "meta", "device: 'meta' holds no data; tiercache keeps its tiers on 'cpu' or a 'cuda' device"),
    ("device", "mps", "device: 'mps' is not supported; tiercache keeps its tiers on 'cpu' or a 'cuda' device"),
    ("attend_in_place", 1, "attend_in_place: must be True or False"),
    ("reuse", 1, "reuse: must be True or False, or None"),
])
def test_invalid_values_name_the_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        TierConfig(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_unknown_policy_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"eviction: unknown policy 'mru'; known: .*fifo.*lfu.*lru"):
        TierConfig(eviction="mru")
    with pytest.raises(ValueError, match=r"prefetch: .*known: auto, .*lookahead.*next-layer.*none"):
        TierConfig(prefetch="psychic")
    assert TierConfig().prefetch == "auto"  # resolved by the cache (test_stream_reads)


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="disk_dir: .* not a directory"):
        TierConfig(disk_dir=str(f))


def test_disk_dir_that_cannot_be_written_is_refused():
    # /proc refuses new files even to root, unlike a chmod'ed directory.
    with pytest.raises(ValueError, match="disk_dir: .*not writable|cannot be created"):
        TierConfig(disk_dir="/proc/tiercache-kv")


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
def test_disk_dir_without_write_permission_is_refused(tmp_path):  # pragma: no cover - non-root only
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not writable"):
        TierConfig(disk_dir=str(d))


def test_replace_validates_again(tmp_path):
    cfg = TierConfig()
    assert cfg.replace(block_tokens=64).block_tokens == 64
    with pytest.raises(ValueError, match="block_tokens"):
        cfg.replace(block_tokens=-1)


def test_numpy_bools_are_bools():
    import numpy as np

    cfg = TierConfig(attend_in_place=np.True_, shared_dir=np.False_, reuse=np.False_)
    assert (cfg.attend_in_place, cfg.shared_dir, cfg.reuse) == (True, False, False)
    assert all(type(v) is bool for v in (cfg.attend_in_place, cfg.shared_dir, cfg.reuse))


@pytest.mark.parametrize("settings,message", [
    # each was accepted and then did nothing: the remote tier's settings without a remote tier,
    # in-place attention over host-tier blocks without a host tier, shared_dir without a disk_dir
    (dict(remote_budget="8GiB"), "remote_budget: 8589934592 bytes, but there is no remote tier (remote_url is None)"),
    (dict(remote_budget=0), "remote_budget: 0 bytes, but there is no remote tier"),
    (dict(remote_cluster=True), "remote_cluster: True, but there is no remote tier (remote_url is None)"),
    (dict(attend_in_place=True, host_budget=0), "attend_in_place: True reads the host tier's blocks where they "
                                                "lie, and host_budget=0 disables the host tier"),
    (dict(shared_dir=True), "shared_dir: True applies to the disk tier's directory, and there is none "
                            "(disk_dir=None, disk_budget=17179869184)"),
    (dict(shared_dir=True, disk_dir="KV", disk_budget=0), "shared_dir: True applies to the disk tier's directory, "
                                                          "and there is none"),
])
def test_a_setting_that_would_be_ignored_is_refused_by_name(settings, message, tmp_path):
    settings = {k: str(tmp_path / "kv") if v == "KV" else v for k, v in settings.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        TierConfig(**settings)


@pytest.mark.parametrize("settings,message", [
    ({"selection_budget": 512}, "selection_budget: 512, but selection='full' reads every block and has no budget"),
    ({"retention_budget": 64}, "retention_budget: 64, but retention is None"),
    ({"attend_in_place": True, "selection": "quest", "selection_budget": 3 * 1024},
     "attend_in_place: True attends to every block where it lies, and selection='quest' reads"),
    ({"attend_in_place": True, "retention": "h2o"},
     "attend_in_place: True attends to every block where it lies, and retention='h2o' reads"),
])
def test_selection_and_retention_settings_that_would_do_nothing_are_refused(settings, message):
    """Accepted before and ignored (a review): a selection budget without selection, a
    retention budget without retention, and attend_in_place with either (their own plans
    read and attend, so in-place attention never ran: 0 layer-steps)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        TierConfig(**settings)


def test_a_copy_rounds_the_default_selection_budget_again_and_drops_a_budget_it_leaves_without_policy():
    """With quest and no budget given, the default (4096 tokens) is rounded to whole
    blocks: 4000 for 250-token blocks. replace(block_tokens=256) passed 4000 on as if the
    caller had chosen it, and refused it as not whole blocks (a review). replace() now
    rounds the default again; a budget the caller chose is still checked as given, and
    dataclasses.replace passes every value on as given. A copy made to be the exact
    baseline (selection="full", retention=None) was refused for the budget it no longer
    uses (a review): replace() puts that budget back to its default."""
    import dataclasses

    cfg = TierConfig(selection="quest", block_tokens=250)
    assert cfg.selection_budget == 4000 and type(cfg.selection_budget) is int
    assert cfg.replace(block_tokens=256).selection_budget == 4096
    assert cfg.replace(block_tokens=300).selection_budget == 3900
    with pytest.raises(ValueError, match="selection_budget: 4000 tokens is not a whole number of blocks"):
        dataclasses.replace(cfg, block_tokens=256)
    with pytest.raises(ValueError, match="selection_budget: 4000 tokens is not a whole number of blocks"):
        TierConfig(selection="quest", block_tokens=256, selection_budget=4000)
    chosen = TierConfig(selection="quest", block_tokens=256, selection_budget=2048)
    assert chosen.replace(block_tokens=512).selection_budget == 2048
    assert chosen.replace(selection="full").selection_budget == 4096
    assert TierConfig(retention="h2o", retention_budget=512).replace(retention=None).retention_budget == 1024


def test_the_settings_refused_alone_are_accepted_with_their_tier(tmp_path):
    """What the refusals above leave alone: each setting with the tier it applies to, and the
    remote fields whose default value cannot be told from one given (namespace, timeout)."""
    kv = str(tmp_path / "kv")
    assert TierConfig(shared_dir=True, disk_dir=kv).shared_dir
    assert TierConfig(attend_in_place=True, host_budget="1MiB").attend_in_place
    assert TierConfig(remote_namespace="team-a", remote_timeout=2.0).remote_url is None
    assert not TierConfig(attend_in_place=False, host_budget=0, shared_dir=False).host_enabled


@pytest.mark.parametrize("field,low,high", [
    ("block_tokens", 1, 1 << 20), ("prefetch_depth", 1, 1024), ("io_workers", 1, 256),
    ("queue_depth", 1, 1 << 16), ("selection_budget", 1, 1 << 30), ("retention_budget", 1, 1 << 30),
])
def test_every_integer_setting_is_refused_just_outside_its_range_and_taken_at_its_ends(field, low, high):
    """Each bound, one past it, by name (``prefetch_depth=0`` was only ever caught by the
    ``lookahead`` policy itself, and ``next-layer`` ignored it: a mutation that let it
    through survived every test)."""
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError, match=f"{field}: must be an integer in \\[{low}, {high}\\], got {bad}"):
            TierConfig(**{field: bad})
    with_policy = {"retention_budget": {"retention": "tova"}}.get(field, {})  # a budget needs its policy
    for good in (low, high) if field not in ("block_tokens", "selection_budget") else ():
        assert getattr(TierConfig(**{field: good}, **with_policy), field) == good


@pytest.mark.parametrize("field,value,message", [
    ("device_budget", 10 ** 23, r"more than 1 EiB \(2\*\*60 bytes\)"),  # overflowed inside torch (a pool)
    ("disk_budget", "2000000TiB", "more than any machine holds"),
    ("host_budget", "0.5", "'0.5' is 0.5 bytes, not a whole number of bytes"),  # was 0 bytes: the host tier off
    ("device_budget", "1.5B", "not a whole number of bytes"),
    ("eviction", ["lru"], r"eviction: unknown policy \['lru'\]; known: .*lru"),  # was TypeError: unhashable
    ("prefetch", {}, r"prefetch: unknown policy \{\}; known: .*next-layer"),
    ("selection", ["quest"], r"selection: unknown policy \['quest'\]"),
    ("retention", ["h2o"], r"retention: unknown policy \['h2o'\]; known: .*\(or None\)"),
])
def test_values_that_were_tracebacks_or_silently_wrong_are_named(field, value, message, tmp_path):
    """Found by a review: each was a traceback from inside torch or Python, or a budget
    silently rounded to nothing."""
    kwargs = {field: value}
    if field == "disk_budget":
        kwargs["disk_dir"] = str(tmp_path / "kv")
    with pytest.raises(ValueError, match=f"{field}: " if "unknown" not in message else message) as info:
        TierConfig(**kwargs)
    assert re.search(message, str(info.value)), info.value


def test_numpy_numbers_and_a_home_folder_are_taken_as_python_ones(tmp_path, monkeypatch):
    """numpy's ints and floats (a sweep's values) were refused with messages that read as
    wrong ("must be an integer ..., got np.int64(16)"); a disk_dir of "~/kv" made a folder
    named "~" in the working directory."""
    import numpy as np

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = TierConfig(block_tokens=np.int64(16), device_budget=np.int64(1 << 20), host_budget=np.float64(4096.0),
                     remote_timeout=np.float32(0.5), disk_dir="~/kv", disk_budget="1MiB", reuse=False)
    assert (cfg.block_tokens, cfg.device_budget, cfg.host_budget, cfg.remote_timeout) == (16, 1 << 20, 4096, 0.5)
    assert all(type(v) is t for v, t in [(cfg.block_tokens, int), (cfg.device_budget, int), (cfg.host_budget, int),
                                         (cfg.remote_timeout, float)])
    assert cfg.disk_dir == str(tmp_path / "kv")
    with pytest.raises(ValueError, match="block_tokens"):
        TierConfig(block_tokens=np.bool_(True))


def test_a_prefetch_plug_in_cannot_hide_under_auto():
    """``prefetch="auto"`` is tiercache's own choice; a plug-in registered as "auto" would
    never run, so the config says so instead of ignoring it."""
    from tiercache.policies import PREFETCH_POLICIES, NextLayerPrefetch

    PREFETCH_POLICIES["auto"] = NextLayerPrefetch
    try:
        with pytest.raises(ValueError, match="prefetch: 'auto' names tiercache's own choice"):
            TierConfig(prefetch="auto")
        TierConfig(prefetch="next-layer")  # other names are unaffected
    finally:
        del PREFETCH_POLICIES["auto"]


def test_an_explicit_reuse_with_retention_is_refused(tmp_path):
    """The prefix cache stores exact KV and retention drops tokens: an explicit ``reuse=True``
    with a retention policy is refused by name, where the default (``reuse=None``) turns the
    prefix cache off for that config (a mutation review found the refusal untested: without
    it, ``reuse=True`` was silently ignored)."""
    common = dict(retention="snapkv", disk_dir=str(tmp_path), disk_budget="64MiB")
    with pytest.raises(ValueError, match="reuse: the prefix cache stores exact KV; retention='snapkv' drops"):
        TierConfig(reuse=True, **common)
    assert not TierConfig(**common).reuse_enabled


class _NeedsAnArgument:
    def __init__(self, capacity):  # no default: the cache makes its policies with no arguments
        self.capacity = capacity


def _plugin_cases():
    from tiercache.policies import LRUPolicy, NextLayerPrefetch, QuestSelection

    class NeedsCapacity(LRUPolicy):
        def __init__(self, capacity):
            super().__init__()

    class NoDepth(NextLayerPrefetch):
        pass

    shared = LRUPolicy()
    return [
        # each was a bare TypeError naming no policy, from the cache or its first forward
        ("eviction", "mine", LRUPolicy(), dict(eviction="mine"),
         "eviction: the eviction policy 'mine' is registered as an instance of LRUPolicy, which cannot be called; "
         "register its class"),
        ("eviction", "mine", NeedsCapacity, dict(eviction="mine"),
         r"eviction: the policy 'mine' cannot be made as the cache makes it \(TypeError: .*capacity.*\); register a "
         "class whose parameters have defaults"),
        ("eviction", "mine", lambda: shared, dict(eviction="mine"),
         "eviction: the policy 'mine' is registered as a function that returns the same object each time"),
        ("prefetch", "mine", lambda: 3, dict(prefetch="mine"),
         "prefetch: the prefetch policy 'mine' is a int, not a tiercache.policies.PrefetchPolicy: subclass it"),
        # "auto" builds lookahead with a depth where disk blocks stream into attention
        ("prefetch", "lookahead", NoDepth, dict(prefetch="auto"),
         "prefetch: the policy 'lookahead' cannot be made as the cache makes it .*depth.*; register a class that "
         "takes depth= and whose other parameters have defaults"),
        ("selection", "mine", QuestSelection(), dict(selection="mine", selection_budget=96, block_tokens=32),
         "selection: the selection policy 'mine' is registered as an instance of QuestSelection"),
        ("selection", "mine", _NeedsAnArgument, dict(selection="mine", selection_budget=96, block_tokens=32),
         "selection: the policy 'mine' cannot be made as the cache makes it"),
        # a plug-in under "full" never ran: the cache reads every block without a policy
        ("selection", "full", QuestSelection, dict(),
         "selection: 'full' names reading every block, which the cache does without a policy"),
        ("retention", "mine", _NeedsAnArgument, dict(retention="mine"),
         "retention: the policy 'mine' cannot be made as the cache makes it"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_plugin_the_cache_cannot_make_is_refused_by_the_config_by_name(case):
    """A plug-in registered as the cache cannot use it is a ValueError naming the field and
    the policy when the config is made (a review found bare TypeErrors from the cache's
    constructor or its first forward, and a "full" plug-in that silently never ran)."""
    from tiercache.policies import (EVICTION_POLICIES, PREFETCH_POLICIES, RETENTION_POLICIES,
                                    SELECTION_POLICIES)

    kind, name, factory, fields, message = _plugin_cases()[case]
    registry = {"eviction": EVICTION_POLICIES, "prefetch": PREFETCH_POLICIES, "selection": SELECTION_POLICIES,
                "retention": RETENTION_POLICIES}[kind]
    saved = registry.get(name)
    registry[name] = factory
    try:
        with pytest.raises(ValueError, match=message):
            TierConfig(**fields)
    finally:
        if saved is None:
            del registry[name]
        else:
            registry[name] = saved
    if name != "mine":
        TierConfig(**fields)  # the shipped policy under that name again: taken


@pytest.mark.parametrize("field,text,message", [
    ("host_budget", "0.0004KiB", "host_budget: '0.0004KiB' is 0.4096 bytes, not a whole number of bytes; use 1 byte"),
    ("disk_budget", "0.0001KB", "disk_budget: '0.0001KB' is 0.1 bytes, not a whole number of bytes; use 1 byte"),
    ("device_budget", "307.2B", "device_budget: '307.2B' is 307.2 bytes, not a whole number of bytes; use 307 or "
                                "308 bytes"),
    ("host_budget", "0." + "0" * 64 + "1KiB", "is less than one byte, not a whole number of bytes; use 1 byte"),
])
def test_a_nonzero_size_never_comes_out_as_zero_bytes(field, text, message, tmp_path):
    """A fractional size was computed in float and cut to an int without a word: "0.0004KiB"
    was 0 bytes, which for host_budget and disk_budget silently disabled the tier. Now the
    size is computed exactly: one under a byte is refused, naming the field, the value and
    the bytes it comes to (use 1 byte, never 0), and so is a count of bytes that is not
    whole."""
    kwargs = {field: text, "disk_dir": str(tmp_path / "kv")}
    with pytest.raises(ValueError, match=re.escape(message)):
        TierConfig(**kwargs)


@pytest.mark.parametrize("text,expected", [
    ("1.3GiB", 1395864371), ("0.3KiB", 307), ("1.0000001MiB", 1048576), ("0.8GiB", 858993459),
    ("1." + "0" * 64 + "1GiB", 1 << 30), ("1." + "9" * 70 + "KiB", 2047),  # past 60 places: far below a byte
])
def test_a_size_in_a_unit_drops_the_part_of_a_byte(text, expected):
    """A budget is a ceiling: "1.3GiB" is 1395864371.2 bytes, and 1395864371 are taken, as
    before (a review found the exact parse refusing "1.3GiB", which had always worked)."""
    assert parse_bytes(text, "host_budget") == expected
    assert TierConfig(host_budget=text).host_budget == expected


@pytest.mark.parametrize("text,expected", [
    ("1.5GiB", 3 << 29), ("0.5KiB", 512), ("1.25 MiB", 5 << 18), ("2.50KiB", 2560), ("0.001KB", 1),
    ("1.5kb", 1500), ("0.0", 0), ("-0", 0), ("1.000000000000000000000000000000000000000000000000KiB", 1024),
    ("1048576TiB", 1 << 60), ("1EiB", 1 << 60), ("1024PiB", 1 << 60), ("0.5EiB", 1 << 59), ("2P", 1 << 51),
    ("1.5PB", 15 * 10 ** 14), ("1EB", 10 ** 18),
    ("0.000000000000000000867361737988403547205962240695953369140625EiB", 1),  # 2**-60 EiB: 60 places
])
def test_fractional_sizes_that_are_whole_bytes_stay_accepted(text, expected):
    """The README's "1.5GiB" and every fraction that is exact in its unit are taken as
    before, now computed without float (trailing zeros, a 0 with a sign, the largest
    budget). Up to EiB, the unit the limit is stated in ("1EiB" was a parse error while
    the message for "2EiB" said "at most 1 EiB"; a review)."""
    assert parse_bytes(text, "host_budget") == expected
    assert TierConfig(host_budget=text).host_budget == expected


@pytest.mark.parametrize("field,value", [
    ("device_budget", 10 ** 400), ("host_budget", "9" * 400), ("disk_budget", "9" * 400 + "GiB"),
    ("device_budget", "9" * 400 + ".5KiB"), ("host_budget", 10 ** 5000), ("reuse_host_budget", "1" + "0" * 30 + "B"),
    ("remote_max_inflight", str((1 << 60) + 1)), ("device_budget", 1e300),
], ids=["int-400-digits", "str-400-digits", "GiB-400-digits", "KiB-fraction-400-digits", "int-5000-digits",
        "B-31-digits", "2**60+1", "float-1e300"])  # an int past 4300 digits has no str() for an id
def test_a_budget_past_any_machine_is_refused_up_front_by_field(field, value, tmp_path):
    """A 400-digit budget with a unit was an OverflowError from the float parsing ("cannot
    convert float infinity to integer"), and a 400-digit int was refused with all 400 digits
    in the message (an int past 4300 digits would have made the message itself raise).
    Every budget above 1 EiB (2**60 bytes: more than any machine addresses, and well within
    the int64 sizes computed from it) is refused by field, in a message of a line."""
    kwargs = {field: value, "disk_dir": str(tmp_path / "kv")}
    with pytest.raises(ValueError, match=re.escape(f"{field}: ")) as info:
        TierConfig(**kwargs)
    assert "is more than 1 EiB (2**60 bytes), more than any machine holds" in str(info.value)
    assert len(str(info.value)) < 200, info.value


def test_the_largest_budget_is_taken_and_one_byte_more_is_not():
    from tiercache.config import MAX_BUDGET

    assert parse_bytes(MAX_BUDGET, "disk_budget") == parse_bytes(str(MAX_BUDGET), "disk_budget") == 1 << 60
    for bad in (MAX_BUDGET + 1, str(MAX_BUDGET + 1), "1048576.0000000000001TiB"):
        with pytest.raises(ValueError, match="disk_budget: .* more than 1 EiB"):
            parse_bytes(bad, "disk_budget")


@pytest.mark.parametrize("prefetch,depth", [("none", 5), ("next-layer", 3), ("next-layer", 1), ("history", 4)])
def test_a_prefetch_depth_that_the_prefetch_policy_does_not_read_is_refused(prefetch, depth):
    """``prefetch_depth`` was taken with prefetch "none", "next-layer" or "history", which
    TieredCache builds without a depth: it did nothing. A depth other than the default
    (a given 2 cannot be told from the default) is refused there, naming both fields and
    the settings that read it."""
    with pytest.raises(ValueError, match=re.escape(
            f"prefetch_depth: {depth} layer{'s' * (depth != 1)}, but prefetch={prefetch!r} is built without a depth, "
            f"so it would be ignored; only prefetch='lookahead' (and 'auto', ")):
        TierConfig(prefetch=prefetch, prefetch_depth=depth)


def test_a_prefetch_depth_is_taken_where_it_is_read():
    """What the refusal leaves alone: a depth with lookahead and auto, and the default depth
    with every policy (the CLI never passes one)."""
    assert TierConfig(prefetch="lookahead", prefetch_depth=5).prefetch_depth == 5
    assert TierConfig(prefetch="auto", prefetch_depth=7).prefetch_depth == 7
    for prefetch in ("none", "next-layer", "history"):
        assert TierConfig(prefetch=prefetch, prefetch_depth=2).prefetch == prefetch


@pytest.mark.parametrize("settings,message", [
    (dict(reuse=False), "reuse_admission: 'reused' decides what the prefix cache stores, and reuse=False turns the "
                        "prefix cache off, so it would be ignored; set reuse=None or True (with a disk tier), or "
                        "leave reuse_admission 'always'"),
    (dict(disk_dir=None), "reuse_admission: 'reused' decides what the prefix cache stores, and there is no prefix "
                          "cache without a disk tier (disk_dir=None, disk_budget=16777216), so it would be ignored"),
    (dict(disk_budget=0), "and there is no prefix cache without a disk tier"),
    (dict(retention="h2o"), "and retention='h2o' turns it off (the prefix cache stores exact KV), so it would be "
                            "ignored; set retention=None"),
    (dict(block_tokens=2048), "and block_tokens=2048 turns it off (a record's header holds at most 1333 token ids)"),
])
def test_a_reuse_admission_without_a_prefix_cache_is_refused(settings, message, tmp_path):
    """``reuse_admission="reused"`` with ``reuse=False`` (or no disk tier, a lossy
    retention, blocks too long for a record) was taken, and the prefix cache it governs
    never ran. It is refused naming both settings and what would turn the cache on."""
    settings = {"disk_dir": str(tmp_path / "kv"), "disk_budget": "16MiB", **settings}
    with pytest.raises(ValueError, match=re.escape(message)):
        TierConfig(reuse_admission="reused", **settings)
    assert TierConfig(reuse_admission="always", **settings).reuse_admission == "always"


@pytest.mark.parametrize("settings,why", [
    (dict(reuse=False), "reuse=False turns the prefix cache off"),
    (dict(disk_dir=None), "there is no prefix cache without a disk tier"),
    (dict(retention="h2o"), "retention='h2o' turns it off"),
    (dict(block_tokens=2048), "block_tokens=2048 turns it off"),
])
def test_a_prefix_host_budget_without_a_prefix_cache_is_refused_and_replace_drops_it(settings, why, tmp_path):
    """``reuse_host_budget`` sizes the prefix cache's host tier. With no prefix cache it was
    taken and ignored, where ``reuse_admission`` is refused: it is refused too, naming why
    the cache is off. The default (1GiB) stays accepted. A copy that turns the prefix cache
    off (``replace(reuse=False)``, as bench prefix makes its plain baseline) gets the
    prefix settings' defaults back instead of being refused for them; one that keeps the
    cache keeps them."""
    settings = {"disk_dir": str(tmp_path / "kv"), "disk_budget": "16MiB", **settings}
    with pytest.raises(ValueError, match=re.escape(f"reuse_host_budget: 64.0 MiB is host memory of the prefix cache, "
                                                   f"and {why}")):
        TierConfig(reuse_host_budget="64MiB", **settings)
    assert TierConfig(**settings).reuse_host_budget == 1 << 30
    with_prefix = TierConfig(disk_dir=str(tmp_path / "kv"), reuse_host_budget="64MiB", reuse_admission="reused")
    plain = with_prefix.replace(**settings)
    assert not plain.reuse_enabled
    assert (plain.reuse_host_budget, plain.reuse_admission) == (1 << 30, "always")
    kept = with_prefix.replace(device_budget="8MiB")
    assert (kept.reuse_host_budget, kept.reuse_admission) == (64 << 20, "reused")
    with pytest.raises(ValueError, match="reuse_host_budget: 32.0 MiB"):
        with_prefix.replace(reuse=False, reuse_host_budget="32MiB")  # asked for in the same copy: refused


def test_a_reuse_admission_with_the_prefix_cache_is_taken(tmp_path):
    kv = str(tmp_path / "kv")
    assert TierConfig(reuse_admission="reused", disk_dir=kv).reuse_enabled
    assert TierConfig(reuse_admission="reused", disk_dir=kv, reuse=True).reuse_admission == "reused"


def test_the_prefix_store_of_a_cache_with_a_lookahead_depth_still_opens(tmp_path, caplog):
    """The prefix cache's own store copies the user's config with prefetch "none"; with the
    user's ``prefetch_depth=3`` (for lookahead) that copy was refused, and the prefix cache
    went off for the run ("prefix cache off"). It takes the default depth now."""
    import torch
    import transformers

    from tiercache import TieredCache

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).eval()
    cfg = TierConfig(device_budget="64KiB", host_budget="64KiB", disk_dir=str(tmp_path / "kv"), disk_budget="4MiB",
                     block_tokens=4, prefetch="lookahead", prefetch_depth=3)
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with caplog.at_level("WARNING", logger="tiercache"), TieredCache(model, cfg) as cache, torch.no_grad():
        cache.load_prefix(ids)
        model(ids, cache=cache)
        assert cache.prefix is not None
    assert "prefix cache off" not in caplog.text


def test_a_disk_dir_with_a_nul_character_is_refused_at_config_time(tmp_path):
    """A NUL in ``disk_dir`` was taken, and the first forward failed ("embedded null
    byte"). It is refused when the config is made, disk tier on or not."""
    for budget in ("1MiB", 0):
        with pytest.raises(ValueError, match=re.escape("disk_dir: ") + ".*" + re.escape(
                "contains a NUL character, which no path can hold")):
            TierConfig(disk_dir=str(tmp_path / "k\0v"), disk_budget=budget)


def test_a_disk_dir_that_is_a_dangling_symlink_is_named(tmp_path):
    """A ``disk_dir`` that is a symlink to a missing folder passed the config (it does not
    exist, and its parent is writable), and opening the disk tier failed with a bare "File
    exists". The config names the path and that it links to a missing target; so for a
    disk_dir below such a link, and for a link loop."""
    link = tmp_path / "kv"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=re.escape(
            f"disk_dir: {str(link)!r} is a symlink to a missing target ({str(tmp_path / 'gone')!r}); create that "
            f"directory, or remove the link")):
        TierConfig(disk_dir=str(link))
    with pytest.raises(ValueError, match=re.escape(
            f"disk_dir: {str(link / 'cache')!r} cannot be created: {str(link)!r} is a symlink to a missing target")):
        TierConfig(disk_dir=str(link / "cache"))
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match=re.escape(f"disk_dir: {str(tmp_path / 'a')!r} is a symlink loop")):
        TierConfig(disk_dir=str(tmp_path / "a"))
    (tmp_path / "gone").mkdir()  # the link's target made: taken
    assert TierConfig(disk_dir=str(link)).disk_enabled


def test_a_disk_records_size_is_spelled_out_with_its_header(tmp_path):
    """A disk tier holds ``disk_budget // record`` blocks, and a record is the block plus a
    header page (payload padded to pages for O_DIRECT): 64 KiB held 3 blocks of 16 KiB, and
    the CapacityError named only the budget. ``DiskTier.record_layout`` says the per-record
    bytes, payload and header, as the store counts them (for its messages: tiercache/store.py)."""
    import torch

    from tiercache import BlockKey, CapacityError, Tier
    from tiercache.disk import DiskTier
    from tiercache.store import BlockStore
    from tiercache.tiers import BlockGeometry

    g = BlockGeometry(1, 2, 16, 64, torch.float32)  # 16 KiB of KV a block
    assert DiskTier.record_layout(g) == ("20480 bytes per disk record: the block's 16384 bytes plus a 4096-byte "
                                         "header, in 4096-byte pages for O_DIRECT")
    cfg = TierConfig(device_budget="32KiB", host_budget=0, disk_dir=str(tmp_path / "kv"), disk_budget="64KiB",
                     block_tokens=16, reuse=False)
    with BlockStore(cfg, g, persistent=False) as store:
        assert store.num_slots(Tier.DISK) == (64 << 10) // 20480 == 3
        for i in range(5):  # 2 on the device, 3 on disk
            store.put(BlockKey(0, 0, i), torch.zeros(g.shape))
        # the CapacityError of live data past every tier says what a record takes
        with pytest.raises(CapacityError, match=r"disk_budget=64.0 KiB \(holds 3 blocks, at 20480 bytes per disk "
                                                r"record: the block's 16384 bytes plus a 4096-byte header"):
            store.put(BlockKey(0, 0, 5), torch.zeros(g.shape))
    with pytest.raises(ValueError, match=r"disk_budget: 16384 bytes .* smaller than one block \(20480 bytes per "
                                         r"disk record"):
        BlockStore(dataclasses.replace(cfg, disk_budget="16KiB"), g, persistent=False)
    odd = BlockGeometry(1, 3, 5, 64, torch.float16)  # 3840 bytes: padded to a page
    assert DiskTier.record_layout(odd).startswith("8192 bytes per disk record: the block's 3840 bytes padded to "
                                                  "4096 plus a 4096-byte header")
    assert DiskTier.record_size(odd) == 8192
