"""``tiercache cache ls|stats|clear`` on real prefix directories written by real runs of a tiny
Llama: the listing matches what was published and hit, works while another process holds the
directory, and survives a damaged index; clear removes everything (the next run loads
nothing) but never a directory another process holds. Plus a smoke run of ``bench prefix``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from tiercache import TierConfig, TieredCache
from tiercache import cache_admin as admin
from tiercache.prefix import close_all

BT = 4
PROMPT = 30
NEW = 6
LAYERS = 3
# 30 prompt tokens + 5 fed-back answer tokens = 35 tokens seen: 8 full blocks of 4.
BLOCKS = (PROMPT + NEW - 1) // BT
# A warm run loads the 7 blocks before the last prompt token: one hit each.
WARM_HITS = (PROMPT - 1) // BT


def tiny_model(seed: int = 0, vocab: int = 64):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   initializer_range=0.2, max_position_embeddings=256, eos_token_id=None,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt_ids() -> torch.Tensor:
    return torch.randint(1, 64, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def config(kv: str) -> TierConfig:
    return TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir=kv, disk_budget="16MiB", block_tokens=BT)


def run(model, kv: str) -> dict:
    """One request with its own TieredCache on ``kv``; its stats."""
    ids = prompt_ids()
    with TieredCache(model, config(kv)) as cache, torch.no_grad():
        cache.load_prefix(ids)
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False, max_new_tokens=NEW)
        return cache.stats()


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def ls(kv: str) -> list:
    proc = cli("cache", "ls", "--disk-dir", kv, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["directories"]


def one_line_error(proc, code: int = 2) -> str:
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def snapshot(path: str) -> dict:
    """Name -> (size, mtime) of every file under ``path``."""
    out = {}
    for folder, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(folder, f))
            out[os.path.relpath(os.path.join(folder, f), path)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(autouse=True)
def _fresh_registry():
    close_all()
    yield
    close_all()


@pytest.fixture
def kv(tmp_path) -> str:
    return str(tmp_path / "kv")


def test_names_and_record_size_agree_with_the_store():
    """cache_admin copies a few names and the record layout to stay free of torch."""
    from tiercache import disk, prefix
    from tiercache.tiers import ALIGN, BlockGeometry

    assert (admin.INDEX_NAME, admin.DATA_NAME, admin.LOCK_NAME) == (prefix.INDEX_NAME, disk.DATA_NAME, disk.LOCK_NAME)
    assert (admin.HEADER_BYTES, admin.ALIGN) == (disk.HEADER_BYTES, ALIGN)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = BlockGeometry(1, 3, 256, 64, dtype)
        assert admin.record_bytes(256, 3, 64, str(dtype).split(".")[-1]) == disk.DiskTier.record_size(g)
    assert "torch" not in subprocess.run([sys.executable, "-c", "import sys, tiercache.cache_admin, tiercache.cli; "
                                          "print(sorted(sys.modules))"], capture_output=True, text=True).stdout


def test_ls_and_stats_show_blocks_prefixes_and_hits_after_a_warm_run(kv):
    """A cold run publishes 8 blocks of 3 layers (one prompt: one prefix); a warm run loads 7
    of them (7 hits). ls reads the index while this process still holds the directory."""
    model = tiny_model()
    assert run(model, kv)["published_blocks"] == BLOCKS * LAYERS
    assert run(model, kv)["reused_tokens"] == WARM_HITS * BT
    (d,) = ls(kv)
    record = admin.record_bytes(BT, 2, 16, "float32")
    assert d["state"] == "ok" and d["geometry"] == "t4-h2-d16-float32" and d["num_layers"] == LAYERS
    assert d["num_blocks"] == BLOCKS and d["num_prefixes"] == 1 and d["hits"] == WARM_HITS
    assert d["stored_bytes"] == BLOCKS * LAYERS * record and d["file_bytes"] >= d["stored_bytes"]
    assert d["holder_pid"] == os.getpid() and d["last_used"] is not None
    text = cli("cache", "ls", "--disk-dir", kv)
    assert text.returncode == 0 and d["model_digest"][:12] in text.stdout
    assert f"in use by pid {os.getpid()}" in text.stdout

    run(tiny_model(seed=5), kv)  # another model: its own directory
    proc = cli("cache", "stats", "--disk-dir", kv, "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert len(stats["models"]) == 2 and stats["models"][d["model_digest"]]["hits"] == WARM_HITS
    assert stats["totals"]["num_blocks"] == 2 * BLOCKS and stats["totals"]["directories"] == 2
    assert stats["sessions"]["num_sessions"] == 0  # closed caches remove their session files
    text = cli("cache", "stats", "--disk-dir", kv).stdout
    assert "total" in text and "sessions/" in text


def test_clear_removes_everything_and_the_next_run_loads_nothing(kv):
    model, other = tiny_model(), tiny_model(seed=5)
    run(model, kv)
    run(other, kv)
    close_all()
    digests = {d["model_digest"] for d in ls(kv)}
    keep = digests - {ls(kv)[0]["model_digest"]}
    gone = ls(kv)[0]["model_digest"]
    proc = cli("cache", "clear", "--disk-dir", kv, "--model-digest", gone[:10])
    assert proc.returncode == 0 and "removed 1 prefix directory" in proc.stdout, proc.stderr
    assert {d["model_digest"] for d in ls(kv)} == keep

    proc = cli("cache", "clear", "--disk-dir", kv)
    assert proc.returncode == 0 and "removed 1 prefix directory" in proc.stdout, proc.stderr
    assert ls(kv) == [] and os.listdir(os.path.join(kv, "prefix")) == []
    again = cli("cache", "ls", "--disk-dir", kv)
    assert again.returncode == 0 and again.stdout.strip() == f"no prefix cache in {kv}"
    stats = run(model, kv)
    assert stats["reused_tokens"] == 0 and stats["prefill_tokens"] == PROMPT
    assert one_line_error(cli("cache", "clear", "--disk-dir", kv, "--model-digest", "xyz")).startswith(
        "tiercache: error: --model-digest: expected hex digits")


def test_model_digest_picks_one_models_directories_for_ls_and_stats(kv):
    """``--model-digest`` (a unique prefix of the hex digits, as clear takes it) narrows ls and
    stats to that model: it was documented for clear alone, and ls and stats listed every
    model with it."""
    run(tiny_model(), kv)
    run(tiny_model(seed=5), kv)
    close_all()
    everything = ls(kv)
    mine, other = (d["model_digest"] for d in everything)
    proc = cli("cache", "ls", "--disk-dir", kv, "--model-digest", mine[:10], "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["directories"] == [d for d in everything if d["model_digest"] == mine]
    text = cli("cache", "ls", "--disk-dir", kv, "--model-digest", mine[:10].upper())
    assert text.returncode == 0 and mine[:12] in text.stdout and other[:12] not in text.stdout
    proc = cli("cache", "stats", "--disk-dir", kv, "--model-digest", other[:10], "--json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert list(stats["models"]) == [other] and stats["totals"]["directories"] == 1
    assert stats["totals"]["num_blocks"] == BLOCKS
    text = cli("cache", "stats", "--disk-dir", kv, "--model-digest", other[:10]).stdout
    assert other in text and mine not in text
    assert len(ls(kv)) == 2  # read-only: nothing removed


def test_a_model_digest_that_matches_nothing_is_an_error_and_clears_nothing(kv):
    """``cache clear --model-digest`` that matched no directory printed "nothing removed" and
    exited 0, as if done; now it is one line and exit 2, as a --disk-dir that does not exist
    is, and so for ls and stats. Nothing is touched."""
    run(tiny_model(), kv)
    close_all()
    (digest,) = (d["model_digest"] for d in ls(kv))
    absent = next(c for c in "0123456789abcdef" if not digest.startswith(c))
    before = snapshot(kv)
    for action in ("clear", "ls", "stats"):
        for extra in ((), ("--json",)):
            line = one_line_error(cli("cache", action, "--disk-dir", kv, "--model-digest", absent, *extra))
            assert line.startswith(f"tiercache: error: --model-digest: {absent!r} matches no prefix directory "
                                   f"in {kv}"), line
            assert ("; nothing was removed" in line) == (action == "clear")
    assert snapshot(kv) == before and [d["model_digest"] for d in ls(kv)] == [digest]


HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from test_cache_admin import tiny_model, config, prompt_ids, NEW
    from tiercache import TieredCache
    model, ids = tiny_model(), prompt_ids()
    with TieredCache(model, config({kv!r})) as cache, torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False, max_new_tokens=NEW)
    print("published", flush=True)  # the prefix cache stays open (and locked) until exit
    sys.stdin.read()
""")


def test_clear_is_refused_while_another_process_holds_the_directory(kv):
    """A live process holds the prefix directory: ls still reads it (and names the holder);
    clear says which pid holds it, exits 2 and touches nothing; once it exits, clear works."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=os.path.dirname(__file__), kv=kv)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "published", holder.stderr.read()
        (d,) = ls(kv)
        assert d["num_blocks"] == BLOCKS and d["holder_pid"] == holder.pid
        before = snapshot(kv)
        line = one_line_error(cli("cache", "clear", "--disk-dir", kv))
        assert f"in use by another tiercache process (pid {holder.pid})" in line and "nothing was removed" in line
        assert snapshot(kv) == before
    finally:
        holder.communicate("", timeout=60)
    assert cli("cache", "clear", "--disk-dir", kv).returncode == 0
    assert ls(kv) == []


SESSION_HOLDER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    from test_cache_admin import tiny_model, config, prompt_ids
    from tiercache import TieredCache, TierConfig
    model, ids = tiny_model(), prompt_ids()
    cfg = TierConfig(device_budget="24KiB", host_budget="32KiB", disk_dir={kv!r}, disk_budget="16MiB",
                     block_tokens=4, reuse=False)
    cache = TieredCache(model, cfg)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False, max_new_tokens=3)
    print("generating", flush=True)  # the session folder is open (and locked) until the process ends
    sys.stdin.read()
""")


def _session_holder(kv: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SESSION_HOLDER.format(tests=os.path.dirname(__file__), kv=kv)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "generating", proc.stderr.read()
    return proc


def test_session_folders_of_killed_processes_are_reclaimed_and_live_ones_left(kv):
    """A process killed with SIGKILL never closes its store: its session folder, with a data
    file allocated ahead, stayed for good (every killed run leaked up to disk_budget). The
    next TieredCache on the directory removes it, and so does ``cache clear``; the folder
    of a process that is still generating stays, and that process is not disturbed."""
    import signal

    sessions = os.path.join(kv, "sessions")
    live = _session_holder(kv)
    try:
        for _ in range(2):  # one reclaimed by the next cache, one by cache clear
            dead = _session_holder(kv)
            dead.send_signal(signal.SIGKILL)
            dead.wait(60)
            names = os.listdir(sessions)
            assert any(n.startswith(f"{dead.pid}-") for n in names), names
            if _ == 0:
                run(tiny_model(), kv)
                close_all()
            else:
                proc = cli("cache", "clear", "--disk-dir", kv)
                assert proc.returncode == 0 and "removed 1 session folder of processes that are gone" in proc.stdout, \
                    proc.stdout + proc.stderr
            names = os.listdir(sessions)
            assert not any(n.startswith(f"{dead.pid}-") for n in names), names
            assert [n for n in names if n.startswith(f"{live.pid}-")], names  # still held: left alone
    finally:
        live.communicate("", timeout=60)
    assert live.returncode == 0, live.stderr
    assert os.listdir(sessions) == []  # the live one removed its own on exit


def test_a_damaged_index_is_reported_not_fatal_and_rebuilt_by_the_next_run(kv):
    model = tiny_model()
    run(model, kv)
    close_all()
    (d,) = ls(kv)
    index = os.path.join(d["path"], admin.INDEX_NAME)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(index + suffix):
            os.unlink(index + suffix)
    with open(index, "r+b") as f:
        f.write(b"this is not an sqlite database" * 40)
    (d,) = ls(kv)
    assert d["state"] == "damaged" and "index.sqlite" in d["error"] and d["num_blocks"] == 0
    text = cli("cache", "ls", "--disk-dir", kv)
    assert text.returncode == 0 and "damaged" in text.stdout and "rebuilds it" in text.stdout
    assert json.loads(cli("cache", "stats", "--disk-dir", kv, "--json").stdout)["totals"]["damaged"] == 1
    assert run(model, kv)["reused_tokens"] == WARM_HITS * BT  # rebuilt from the record headers
    (d,) = ls(kv)
    assert d["state"] == "ok" and d["num_blocks"] == BLOCKS


@pytest.mark.parametrize("value", [1e300, "garbage"], ids=["far-future", "text"])
def test_an_index_value_that_is_not_a_time_is_damage_not_a_traceback(kv, value):
    """SQLite keeps no checksum of values: an index whose ``last_used`` went bad (a flipped
    bit, a foreign writer) still passes ``quick_check``. ``cache ls`` and ``cache stats``
    then died with an OverflowError or a TypeError traceback (a review). The directory is
    reported as damaged now, as an unreadable index is, and both exit 0."""
    import sqlite3

    run(tiny_model(), kv)
    close_all()
    (d,) = ls(kv)
    db = sqlite3.connect(os.path.join(d["path"], admin.INDEX_NAME))
    db.execute("UPDATE blocks SET last_used = ? WHERE rowid = (SELECT min(rowid) FROM blocks)", (value,))
    db.commit()
    assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    db.close()
    (d,) = ls(kv)
    assert d["state"] == "damaged" and "is not a time" in d["error"], d
    for action in ("ls", "stats"):
        proc = cli("cache", action, "--disk-dir", kv)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (action, proc.stderr)
        assert "damaged" in proc.stdout, proc.stdout


def test_an_index_this_user_may_not_read_is_unreadable_not_damaged(kv):
    """A shared cache (``shared_dir=True``) of another user: its folders open to all, its
    files 0600. ``cache ls`` said the index was "damaged ... the next open rebuilds it",
    with 0 blocks: it is intact, and nothing rebuilds what one may not read. It says
    "unreadable (index.sqlite: permission denied)" now, and counts it apart."""
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("as root, needs setpriv to drop the right to read any file")
        as_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    else:
        as_user = []
    run(tiny_model(), kv)
    close_all()
    (d,) = ls(kv)
    for folder, _, files in os.walk(kv):
        os.chmod(folder, 0o755)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o600)
            if os.geteuid() == 0:
                os.chown(os.path.join(folder, name), 65534, 65534)  # another user's files
            else:
                os.chmod(os.path.join(folder, name), 0)
    try:
        for action, want in (("ls", "unreadable (index.sqlite: permission denied)"), ("stats", "(1 unreadable)")):
            proc = subprocess.run(as_user + [sys.executable, "-m", "tiercache.cli", "cache", action, "--disk-dir", kv],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, (action, proc.stderr)
            assert want in proc.stdout and "rebuilds" not in proc.stdout and "damaged" not in proc.stdout, proc.stdout
    finally:
        for folder, _, files in os.walk(kv):
            for name in files:
                os.chown(os.path.join(folder, name), os.geteuid(), os.getegid())
                os.chmod(os.path.join(folder, name), 0o600)
    (d,) = ls(kv)
    assert d["state"] == "ok" and d["num_blocks"] == BLOCKS  # nothing was wrong with it


def test_ls_leaves_no_files_behind(kv):
    """Reading a closed index read-only creates no -wal/-shm files beside it."""
    run(tiny_model(), kv)
    close_all()
    before = sorted(snapshot(kv))
    ls(kv)
    assert sorted(snapshot(kv)) == before


@pytest.mark.parametrize("action", ["ls", "stats", "clear"])
def test_a_missing_dir_is_one_line_and_exit_2_an_empty_one_says_so(tmp_path, action):
    missing = str(tmp_path / "nope")
    assert one_line_error(cli("cache", action, "--disk-dir", missing)) == \
        f"tiercache: error: --disk-dir: {missing!r} does not exist"
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in one_line_error(cli("cache", action, "--disk-dir", str(tmp_path / "file")))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("cache", action, "--disk-dir", str(empty))
    assert proc.returncode == 0 and proc.stderr == ""
    assert f"no prefix cache in {empty}" in proc.stdout


def test_clear_through_a_symlinked_prefix_directory_removes_only_the_caches_files(kv, tmp_path):
    """A prefix directory may be a symlink to a folder elsewhere (another disk). clear
    removed every file in the folder it points to, then failed on the link ("Not a
    directory", exit 2) with the data gone. Now it removes the cache's files there and the
    link, reports the directory removed, and leaves a file tiercache did not make."""
    run(tiny_model(), kv)
    close_all()
    (d,) = ls(kv)
    elsewhere = tmp_path / "elsewhere"
    os.rename(d["path"], elsewhere)
    os.symlink(elsewhere, d["path"])
    (elsewhere / "notes.txt").write_text("mine")
    assert ls(kv)[0]["num_blocks"] == BLOCKS
    proc = cli("cache", "clear", "--disk-dir", kv)
    assert proc.returncode == 0 and "removed 1 prefix directory" in proc.stdout, proc.stderr
    assert not os.path.lexists(d["path"]) and ls(kv) == []
    assert os.listdir(elsewhere) == ["notes.txt"]


def test_clear_goes_on_past_a_prefix_directory_with_other_files(kv):
    """A file someone put in one model's prefix directory stays (with that folder), with a
    warning; clear goes on to the other models' directories (it stopped at the first)."""
    run(tiny_model(), kv)
    run(tiny_model(seed=5), kv)
    close_all()
    first, second = sorted(d["path"] for d in ls(kv))
    with open(os.path.join(first, "notes.txt"), "w") as f:
        f.write("mine")
    proc = cli("cache", "clear", "--disk-dir", kv)
    assert proc.returncode == 0 and "removed 2 prefix directories" in proc.stdout, proc.stderr
    assert "left 1 that tiercache did not make (notes.txt)" in proc.stderr
    assert os.listdir(first) == ["notes.txt"] and not os.path.exists(second)


def test_odd_names_in_the_sessions_folder_are_left_alone(tmp_path):
    """Folders that look like a pid but are not one this system has (a superscript digit,
    20 digits) made the sweep raise, and with it every cache's first forward."""
    from tiercache.disk import remove_stale_sessions

    for name in ("\u00b2-abc", "99999999999999999999-abc", "notapid-abc", "123"):
        os.makedirs(tmp_path / name)
    assert remove_stale_sessions(str(tmp_path)) == []
    assert len(os.listdir(tmp_path)) == 4


def test_cache_commands_on_a_directory_this_user_cannot_read_are_one_line(kv):
    """Another user's 0700 cache: ls, stats and clear were a PermissionError traceback
    where the user may enter the folder above it (a shared parent), and said the cache
    "does not exist" where it may not."""
    import tempfile

    if not shutil.which("setpriv") or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run as another user")
    as_other = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    probe = subprocess.run(as_other + ["-c", "import tiercache.cli"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HOME": "/tmp"})
    if probe.returncode:  # a checkout in a private folder (a fresh clone under mktemp -d)
        pytest.skip("another user cannot import tiercache from this checkout")
    run(tiny_model(), kv)
    close_all()
    shared = tempfile.mkdtemp(prefix="tiercache-shared-", dir="/tmp")
    try:
        os.chmod(shared, 0o711)
        moved = shutil.move(kv, os.path.join(shared, "kv"))  # root's own 0700 cache, in a folder all may enter
        for disk_dir in (moved, kv + "-behind-a-private-folder"):
            if disk_dir != moved:
                os.makedirs(disk_dir, mode=0o700)  # under pytest's root-only tmp folders
            for action in ("ls", "stats", "clear"):
                proc = subprocess.run(as_other + ["-m", "tiercache.cli", "cache", action, "--disk-dir", disk_dir],
                                      capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
                assert proc.returncode == 2, (action, proc.stderr)
                assert "cannot read" in proc.stderr and "Permission denied" in proc.stderr, proc.stderr
                assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert ls(moved)[0]["num_blocks"] == BLOCKS  # nothing was touched
    finally:
        shutil.rmtree(shared)


def tiny_bench_model(folder) -> str:
    """A tiny random Llama with the default model's tokenizer (128 positions) saved in
    ``folder``: what ``bench prefix --model`` loads quickly. Skips without the tokenizer."""
    from tiercache.models import converted_dir

    if not os.path.exists(os.path.join(converted_dir(), "tokenizer.json")):
        pytest.skip("the default model's tokenizer is not converted on this machine")
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir())
    model = tiny_model(vocab=len(tokenizer))
    model.config.max_position_embeddings = 128
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_bench_prefix_smoke(tmp_path):
    """bench prefix end to end on a tiny random Llama with the default tokenizer: every
    figure is there, warm runs load the prefix and match the cold logits."""
    tiny_bench_model(tmp_path / "model")
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "bench", "prefix", "--model", str(tmp_path / "model"),
                           "--context", "200", "--turns", "2", "--answer-tokens", "4", "--block-tokens", "8",
                           "--dir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["context"] == 128 - 8  # clamped below the model's positions
    for key in ("recompute_ttft_s", "warm_host_ttft_s", "warm_disk_ttft_s", "warm_disk_speedup", "disk_bytes_read"):
        assert r[key] > 0, key
    assert r["reused_tokens"] == (120 - 1) // 8 * 8 and r["computed_tokens"] == 120 - r["reused_tokens"]
    assert r["loaded_kv_bytes"] == (120 - 1) // 8 * LAYERS * 2 * 2 * 8 * 16 * 4  # blocks x layers x block bytes
    assert r["loaded_kv_bytes"] <= r["disk_bytes_read"] <= 2 * r["loaded_kv_bytes"]
    assert r["warm_host_max_abs_diff"] <= 1e-5 and r["warm_disk_max_abs_diff"] <= 1e-5
    conv = r["parts"]["conversation"]
    assert len(conv["turns"]) == 2 and conv["turns"][1]["reused_tokens"] > 0 and conv["answers_match"]
    assert os.listdir(tmp_path) and not [n for n in os.listdir(tmp_path) if n.startswith("tiercache-bench-prefix-")]
