"""The command line: bad input gets one clear line and exit status 2, never a traceback;
a real generation with every tier in use streams an answer and writes stats and metrics."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def cli(*args, input_text=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True,
                          input=input_text, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--device-budget=-5MiB"], "device_budget: must not be negative"),
    (["--host-budget", "lots"], "host_budget: cannot parse 'lots'"),
    (["--eviction", "mru"], "eviction: unknown policy 'mru'; known: arc, attention-score, fifo, layer-cycle, lfu, lru, s3fifo, sinks-recent"),
    (["--prefetch", "psychic"], "prefetch: unknown policy"),
    (["--block-tokens", "0"], "block_tokens"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file: cannot read"),
    (["--model", "/nonexistent/model"], "is not a local model folder"),
    (["--remote-url", "http://cache:6379"], "remote_url: expected redis://host:port/db"),
    (["--remote-url", "redis://127.0.0.1:1/0"], "remote_url: the remote tier shares prefix-cache blocks"),
    (["--remote-url", "redis://127.0.0.1:1/0", "--remote-timeout", "0"], "remote_timeout"),
    # each was accepted and then did nothing: no remote tier, no host tier, no disk tier
    (["--remote-budget", "8GiB"], "remote_budget: 8589934592 bytes, but there is no remote tier"),
    (["--remote-cluster"], "remote_cluster: True, but there is no remote tier"),
    (["--attend-in-place", "--host-budget", "0"], "attend_in_place: True reads the host tier's blocks"),
    (["--shared-dir"], "shared_dir: True applies to the disk tier's directory, and there is none"),
    (["--shared-dir", "--disk-dir", "KV", "--disk-budget", "0"], "shared_dir: True applies to the disk tier's"),
    (["--disk-dir", "KV", "--disk-io", "kvikio"], "disk_io: 'kvikio' cannot run here"),
    # before the model loads (its progress bar made two lines), not after it
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    # a torch traceback from inside transformers' prefill (negative), silently no chunking (0)
    (["--prefill-chunk", "-3"], "--prefill-chunk: must be >= 1, got -3"),
    (["--prefill-chunk", "0"], "--prefill-chunk: must be >= 1, got 0"),
    # refused before the run, not a traceback after it (/proc: root passes the permission
    # bits, but no file can be made there)
    (["--stats-json", "/proc/tiercache-stats.json"], "--stats-json: cannot write '/proc/tiercache-stats.json'"),
    (["--metrics-textfile", "/nonexistent/m.prom"], "--metrics-textfile: cannot write '/nonexistent/m.prom'"),
    (["--metrics-port", "99999"], "--metrics-port: must be in [0, 65535]"),  # was an OverflowError
    # was a TypeError traceback ("expected an address string ... got ''")
    (["--metrics-port", "0", "--metrics-addr", ""], "metrics addr: an empty address"),
    (["--metrics-port", "0", "--metrics-linger", "inf"], "--metrics-linger: seconds in [0, 86400]"),  # an OverflowError after the run
    (["--metrics-port", "0", "--metrics-linger", "-5"], "--metrics-linger: seconds in [0, 86400]"),
    # with no endpoint they did nothing, silently (a review)
    (["--metrics-linger", "5"], "--metrics-linger: 5.0 without --metrics-port would do nothing"),
    (["--metrics-addr", "0.0.0.0"], "--metrics-addr: 0.0.0.0 without --metrics-port would do nothing"),
    # argparse's own refusals printed its 21-line usage first (a review)
    (["--block-tokens", "abc"], "tiercache generate: error: argument --block-tokens: invalid int value: 'abc' "
                                "(see tiercache generate --help)"),
    (["--direct-io", "maybe"], "argument --direct-io: invalid choice: 'maybe'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    if message.startswith("disk_io: 'kvikio'"):
        from tiercache.disk import kvikio_status
        if kvikio_status()[0]:
            pytest.skip("kvikio runs here")
    args = [str(tmp_path / "kv") if a == "KV" else a for a in args]
    proc = cli("generate", "--prompt", "hi", *args) if "--prompt-file" not in args else cli("generate", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "kv"
    f.write_text("not a directory")
    proc = cli("generate", "--prompt", "hi", "--disk-dir", str(f))
    assert proc.returncode == 2 and "disk_dir:" in proc.stderr and "Traceback" not in proc.stderr


def test_a_disk_dir_others_can_read_is_refused_once_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A --disk-dir with permissions 0755 was refused only after the model had loaded (7 s
    with the default model), and the error came twice: as the prefix cache's warning, then
    as the error (a review)."""
    from tiercache.cli import main

    import tiercache.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the folder was checked")

    monkeypatch.setattr(tiercache.models, "load_model", no_model)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert main(["generate", "--prompt", "hi", "--disk-dir", str(loose)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: disk_dir: ") and "has permissions 0o755" in err
    assert len(err.strip().splitlines()) == 1


def test_unsupported_model_family_is_named(tmp_path):
    from transformers import T5Config
    T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    from transformers import AutoTokenizer  # noqa: F401 - tokenizer missing is fine: config is checked first
    proc = cli("generate", "--prompt", "hi", "--model", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "t5" in proc.stderr.lower() or "T5" in proc.stderr


def test_no_prompt_says_how_to_give_one():
    """No prompt, with stdin a terminal or an empty pipe: one line saying how to give one,
    before the model loads. The empty pipe had gone on with the chat template alone (a
    30-token prompt), and this test had accepted either outcome."""
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "generate"], stdin=follower,
                              capture_output=True, text=True, timeout=120)
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("tiercache: error: no prompt: pass --prompt TEXT, --prompt-file FILE, "
                                   "or pipe it on stdin")
    proc = cli("generate", input_text="")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("tiercache: error: no prompt: stdin is empty; pass --prompt TEXT, "
                                   "--prompt-file FILE, or pipe it on stdin")


@pytest.mark.parametrize("source,what", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", " \n\t"], "--prompt is empty"),
    (["--prompt-file", "EMPTY"], "--prompt-file: 'EMPTY' is empty"),
    (["--prompt-file", "BLANK"], "--prompt-file: 'BLANK' is empty"),
    (["--no-chat-template", "--prompt", ""], "--prompt is empty"),
])
def test_an_empty_prompt_is_one_line_and_exit_2(source, what, tmp_path, capsys):
    """An empty or blank --prompt or --prompt-file ran on the chat template alone (as an empty
    stdin had); without the template it was a traceback from inside the model ("cannot
    reshape tensor of 0 elements"). Refused as an empty stdin is, before the model loads."""
    from tiercache.cli import main

    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"  \r\n\n")
    paths = {"EMPTY": str(tmp_path / "empty.txt"), "BLANK": str(tmp_path / "blank.txt")}
    for command in ("generate", "compare"):
        assert main([command, *[paths.get(a, a) for a in source]]) == 2
        err = capsys.readouterr().err
        for name, path in paths.items():
            what = what.replace(f"'{name}'", repr(path))
        assert err == (f"tiercache: error: no prompt: {what}; pass --prompt TEXT, --prompt-file FILE, "
                       f"or pipe it on stdin\n")
    proc = cli("generate", input_text=" \n")  # a blank pipe, as an empty one
    assert proc.returncode == 2 and "no prompt: stdin is empty" in proc.stderr


@pytest.mark.model
def test_real_generation_over_all_tiers_with_stats_and_metrics(tmp_path):
    stats_file, prom = tmp_path / "stats.json", tmp_path / "kv.prom"
    proc = cli("generate", "--prompt", "Name three colours.", "--max-new-tokens", "8", "--block-tokens", "4",
               "--device-budget", "256KiB", "--host-budget", "512KiB", "--disk-dir", str(tmp_path / "kv"),
               "--disk-budget", "64MiB", "--stats-json", str(stats_file), "--metrics-port", "0",
               "--metrics-textfile", str(prom), "--metrics-linger", "1", "--trace-out", str(tmp_path / "t.csv"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    data = json.loads(stats_file.read_text())
    tiers = data["stats"]["tiers"]
    assert tiers["host"]["blocks"] > 0 and tiers["disk"]["blocks"] > 0
    assert tiers["disk"]["io"] == "posix"  # no CUDA here: kvikio is not started
    disk_row = next(line for line in proc.stderr.splitlines() if line.startswith("disk "))
    assert "(posix, " in disk_row, disk_row
    assert data["stats"]["decode_tokens"] >= 1 and "decode:" in proc.stderr
    assert "tiercache_decode_tokens_total" in prom.read_text()
    assert "metrics: http://127.0.0.1:" in proc.stderr and "metrics: serving 1 s more" in proc.stderr
    from tiercache.lab.trace import load_trace
    trace = load_trace(str(tmp_path / "t.csv"))  # every block access of the run, 30 layers
    assert trace.num_layers == 30 and trace.has_scores
    assert trace.total_tokens == data["stats"]["prefill_tokens"] + data["stats"]["decode_tokens"]


@pytest.mark.model
def test_generate_attend_in_place_gives_the_same_answer(tmp_path):
    """`generate --attend-in-place` over all three tiers answers as the default run does,
    and its decode steps attended in place (the stats JSON counts them)."""
    answers = []
    for flags in ([], ["--attend-in-place"]):
        stats_file = tmp_path / f"stats{len(flags)}.json"
        proc = cli("generate", "--prompt", "Name three colours.", "--max-new-tokens", "8", "--block-tokens", "4",
                   "--device-budget", "256KiB", "--host-budget", "512KiB", "--disk-dir", str(tmp_path / "kv"),
                   "--disk-budget", "64MiB", "--quiet", "--stats-json", str(stats_file), *flags)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(stats_file.read_text())
        answers.append(proc.stdout)
        assert data["stats"]["tiers"]["disk"]["blocks"] > 0
        assert (data["attention"]["in_place_layer_steps"] > 0) == bool(flags), data["attention"]
    assert answers[0] == answers[1] and answers[0].strip()


@pytest.mark.model
def test_compare_records_a_trace_and_runs_policies_live(tmp_path):
    """`tiercache compare --prompt ... --live`: records a trace with the default model, replays it
    through runtime policies and libCacheSim (Belady included), runs each policy for real, and
    plots hit ratio against budget."""
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"h2d_gbps": 9.0, "d2h_gbps": 9.0, "read_gbps": 1.0, "write_gbps": 1.5}))
    plot = tmp_path / "hit.png"
    proc = cli("compare", "--prompt", "Count from one to twenty: one, two, three,", "--max-new-tokens", "4",
               "--block-tokens", "4", "--policies", "lru,attention-score", "--prefetch-policies", "none",
               "--budgets", "640KiB,1MiB", "--host-budget", "64MiB", "--io-json", str(io), "--live", "--json",
               "--plot", str(plot), "--trace-out", str(tmp_path / "t.csv"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    policies = {r["policy"] for r in report["results"]}
    assert {"lru", "attention-score", "libcachesim:lru", "libcachesim:belady"} <= policies
    belady = {r["budget_bytes"]: r["hit_ratio"] for r in report["results"] if r["policy"] == "libcachesim:belady"}
    for r in report["results"]:
        assert r["hit_ratio"] <= belady[r["budget_bytes"]] + 1e-9, r
    live = {(r["policy"], r["budget_bytes"]) for r in report["live"] if "error" not in r}
    assert live == {(p, b) for p in ("lru", "attention-score") for b in (640 << 10, 1 << 20)}
    assert all(r["decode_tps"] > 0 for r in report["live"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(60)  # a FIFO opened for writing with no reader would block for good
def test_the_output_file_probe_leaves_everything_as_it_found_it(tmp_path):
    """``check_writable`` runs before the slow work. It must not change what it probes: an
    existing file keeps its bytes, a new file is not left behind, a dangling symlink stays
    (nothing is made through it), a named pipe is not opened (that would end its reader's
    input, or block with none). A file that is replaced by a rename (the metrics textfile)
    is judged by its folder: a read-only file in a writable folder is fine."""
    import os

    from tiercache.cli import CLIError, check_writable

    existing = tmp_path / "stats.json"
    existing.write_text("keep me")
    check_writable("--stats-json", str(existing))
    assert existing.read_text() == "keep me"
    check_writable("--stats-json", str(tmp_path / "new.json"))
    assert not (tmp_path / "new.json").exists()
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")
    check_writable("--stats-json", str(link))
    assert link.is_symlink() and not (tmp_path / "target.json").exists()
    os.mkfifo(tmp_path / "pipe")
    check_writable("--stats-json", str(tmp_path / "pipe"))
    read_only = tmp_path / "old.prom"
    read_only.write_text("# old")
    read_only.chmod(0o444)
    check_writable("--metrics-textfile", str(read_only), replaced=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "old.prom", "pipe", "stats.json"]
    with pytest.raises(CLIError, match="--stats-json: .* is a directory"):
        check_writable("--stats-json", str(tmp_path))


@pytest.mark.parametrize("argv,message", [
    # each was a traceback (faults: NotADirectoryError from tempfile; policies: a reshape
    # error from inside the model at 0 tokens), a silent run on other input, or a hang
    # allocating pools for 8 x 10^8 blocks (overhead)
    (["bench", "faults", "--dir", "FILE"], "--dir: 'FILE' is not a directory"),
    (["bench", "faults", "--dir", "MISSING"], "--dir: 'MISSING' does not exist"),
    (["bench", "faults", "--faults", "payload-flip,"], "--faults: an empty item"),
    (["bench", "policies", "--contexts", "0"], "--contexts: 0 must be >= 1"),
    (["bench", "policies", "--contexts", "2k"], "--contexts: '2k' is not an integer"),
    (["bench", "policies", "--new-tokens", "0"], "--new-tokens: must be >= 1, got 0"),
    (["bench", "policies", "--block-tokens", "0"], "block_tokens"),
    (["bench", "policies", "--prefetch-policies", "none,psychic"], "--prefetch-policies: unknown ['psychic']"),
    (["bench", "policies", "--out", "FILE"], "--out: 'FILE' is not a directory"),
    (["bench", "overhead", "--batches", "100000000"], "--batches: 100000000 must be in [2, 4096]"),
    (["bench", "prefix", "--dir", "MISSING"], "--dir: 'MISSING' does not exist"),
    (["bench", "io", "--dir", "FILE"], "bench io: --dir: 'FILE' is not a directory"),
    # a PermissionError traceback from inside the run (root passes the permission bits, yet makes
    # nothing in /proc or /sys); bench io made a missing --dir where the others refused it
    (["bench", "io", "--dir", "MISSING"], "bench io: --dir: 'MISSING' does not exist"),
    (["bench", "io", "--dir", "/proc/self"], "bench io: --dir: cannot make a folder in '/proc/self'"),
    (["bench", "faults", "--dir", "/sys/kernel"], "--dir: cannot make a folder in '/sys/kernel'"),
    (["bench", "prefix", "--dir", "/proc/self"], "--dir: cannot make a folder in '/proc/self'"),
    (["bench", "decode", "--dir", "/proc/self"], "--dir: cannot make a folder in '/proc/self'"),
    (["bench", "policies", "--out", "/proc/self"], "--out: cannot make a folder in '/proc/self'"),
    (["bench", "policies", "--out", "/sys/kernel/bp"], "--out: cannot make '/sys/kernel/bp'"),
    (["bench", "io", "--size", "0"], "bench io: --size: 0 is less than one block (1.5 MiB at block_tokens=1024)"),
    (["compare", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    # a bad --model was each worker process's whole traceback; now the parent's one line
    (["bench", "decode", "--model", "MISSING"], "--model: 'MISSING' is not a local model folder"),
    (["bench", "decode", "--model", "TMP"], "--model: cannot read a model config from 'TMP'"),
    (["bench", "prefix", "--model", "MISSING"], "--model: 'MISSING' is not a local model folder"),
    (["bench", "prefix", "--model", "TMP"], "--model: cannot read a model config from 'TMP'"),
    # a torch traceback (-2), silently torch's default (0)
    (["bench", "prefix", "--threads", "-2"], "--threads: must be >= 1, got -2"),
    (["bench", "prefix", "--threads", "0"], "--threads: must be >= 1, got 0"),
    # bench prefix ran with 0 (silently no chunking) and passed -3 to its workers, after the
    # model loaded; bench decode refused both. Before the --model check: an unchecked value
    # fails here on the model, not by running the benchmark
    (["bench", "prefix", "--prefill-chunk", "0", "--model", "MISSING"], "--prefill-chunk: must be >= 1, got 0"),
    (["bench", "prefix", "--prefill-chunk", "-3", "--model", "MISSING"], "--prefill-chunk: must be >= 1, got -3"),
    (["bench", "decode", "--prefill-chunk", "0", "--model", "MISSING"], "--prefill-chunk: must be >= 1, got 0"),
    # parsed by the side-by-side worker, after every set-up had run alone
    (["bench", "decode", "--io-size", "-1"], "--io-size: must not be negative"),
    (["bench", "decode", "--io-size", "0"], "--io-size: must be > 0"),
    # ran every set-up, then filled the disk and ended in a traceback (a review)
    (["bench", "decode", "--io-size", "1000PiB", "--dir", "TMP"], "--io-size: 'TMP' has"),
    # shown as two rows of one run
    (["compare", "--trace", "t.csv", "--budgets", "1MiB,1048576"], "--budgets: 1048576 is given twice"),
    (["bench", "overhead", "--batches", "10,10"], "--batches: 10 is given twice"),
    # ran past the model's positions (generate and eval refuse that)
    (["bench", "decode", "--context", "100000"], "--context: 100000 tokens exceed the model's 8192 positions"),
])
def test_benchmarks_and_compare_refuse_bad_arguments_before_any_work(argv, message, tmp_path, capsys):
    """Every refusal is one line, ``tiercache: error: ...``, exit status 2, before a model
    loads or a file is written (in process, so a model load would show as time, and a
    traceback as an exception here)."""
    from tiercache.cli import main

    (tmp_path / "file").write_text("not a directory")
    paths = {"FILE": str(tmp_path / "file"), "MISSING": str(tmp_path / "missing"), "TMP": str(tmp_path)}
    argv = [paths.get(a, a) for a in argv]
    for name, path in paths.items():
        message = message.replace(f"'{name}'", repr(path))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("content", [
    # a `tiercache compare --json` report: rows without budget fractions (a KeyError from the summary)
    {"results": [{"policy": "lru", "trace": "t.csv", "budget_bytes": 4096, "prefetch": "none", "hit_ratio": 0.5,
                  "bytes_per_token_total": 1.0, "est_stall_seconds": 0.1, "bytes_moved": 1}]},
    # a row with a null hit ratio (a TypeError from statistics.fmean)
    {"results": [{"policy": "lru", "trace": "t", "budget_bytes": 4096, "budget_fraction": 0.5, "prefetch": "none",
                  "hit_ratio": None, "bytes_per_token_total": 1.0, "est_stall_seconds": 0.1, "bytes_moved": 1}]},
    # no results: an empty summary and exit 0 (a review)
    {"results": []},
])
def test_bench_policies_summarize_refuses_other_json_in_one_line(content, tmp_path, capsys):
    from tiercache.cli import main

    path = tmp_path / "other.json"
    path.write_text(json.dumps(content))
    assert main(["bench", "policies", "--summarize", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiercache: error: --summarize: {str(path)!r} is not a policies.json")
    assert err.count("\n") == 1
    # a missing file is said to be missing, not "not a policies.json" (a review)
    assert main(["bench", "policies", "--summarize", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    missing = str(tmp_path / "none.json")
    assert err == f"tiercache: error: --summarize: cannot read {missing!r}: No such file or directory\n"


def test_a_prompt_that_is_not_utf8_is_one_line_from_stdin_or_a_file(tmp_path):
    """Python decodes stdin with surrogateescape, so bad bytes reached the tokenizer and
    failed there (a TypeError traceback, exit 1); a file's error named neither the flag nor
    the file. Both are refused before the model loads, naming where and which byte."""
    bad = b"ok \xff\xfe\x80abc"
    (tmp_path / "p.txt").write_bytes(bad)
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "generate", "--max-new-tokens", "1"],
                          input=bad, capture_output=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == "tiercache: error: stdin is not UTF-8 text (byte 0xff at offset 3)"
    proc = cli("generate", "--prompt-file", str(tmp_path / "p.txt"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"tiercache: error: --prompt-file: {str(tmp_path / 'p.txt')!r} is not UTF-8 text "
                                   f"(byte 0xff at offset 3)")
    proc = subprocess.run([sys.executable.encode(), b"-m", b"tiercache.cli", b"generate", b"--prompt", bad],
                          capture_output=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == "tiercache: error: --prompt is not UTF-8 text (byte 0xff at offset 3)"


def test_prompt_newlines_are_read_as_text_mode_reads_them(tmp_path):
    from argparse import Namespace

    from tiercache.cli import read_prompt

    (tmp_path / "p.txt").write_bytes("a\r\nb\rc\n\u00e9".encode())
    assert read_prompt(Namespace(prompt=None, prompt_file=str(tmp_path / "p.txt"))) == "a\nb\nc\n\u00e9"


def test_a_metrics_port_that_is_taken_is_refused_before_the_model_loads():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        proc = cli("generate", "--prompt", "hi", "--metrics-port", str(port))
    finally:
        taken.close()
    assert proc.returncode == 2
    want = f"tiercache: error: metrics: cannot serve on 127.0.0.1:{port} (Address already in use)"
    assert proc.stderr.strip() == want
    proc = cli("generate", "--prompt", "hi", "--metrics-port", "0", "--metrics-addr", "999.1.1.1")
    assert proc.returncode == 2 and proc.stderr.startswith("tiercache: error: metrics: cannot serve on 999.1.1.1:0 (")
    assert "Loading" not in proc.stderr


@pytest.mark.model
def test_a_metrics_textfile_that_fails_at_the_end_is_one_line_and_the_stats_are_still_written(tmp_path):
    """The check before the run probes the folder, but prometheus_client writes a temporary
    file of another name (``<path>.<pid>.<tid>.tmp``) after the run: a name near the limit
    passes the check and fails there. That was a traceback (exit 1) after the whole run,
    and --stats-json, written after it, was lost."""
    textfile = tmp_path / ("m" * 235 + ".prom")
    stats = tmp_path / "stats.json"
    proc = cli("generate", "--prompt", "hi", "--max-new-tokens", "1", "--quiet", "--device-budget", "4MiB",
               "--metrics-textfile", str(textfile), "--stats-json", str(stats))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tiercache: error: --metrics-textfile: cannot write {str(textfile)!r} (File name too long")
    assert "Traceback" not in proc.stderr
    assert json.loads(stats.read_text())["stats"]["decode_tokens"] == 0  # one new token: the prefill's



@pytest.mark.model
def test_a_metrics_textfile_holds_the_runs_histograms(tmp_path):
    """The exporter was made after the run, for the file alone: its histograms (move and
    stall seconds) had counted nothing (``tiercache_stall_seconds_count 0``)."""
    from prometheus_client.parser import text_string_to_metric_families

    textfile = tmp_path / "m.prom"
    # the endpoint's settings at their defaults, given with no endpoint: nothing to refuse (a review)
    proc = cli("generate", "--prompt", "hi " * 40, "--max-new-tokens", "2", "--quiet", "--device-budget", "2MiB",
               "--host-budget", "4MiB", "--block-tokens", "16", "--metrics-textfile", str(textfile),
               "--metrics-addr", "127.0.0.1", "--metrics-linger", "0")
    assert proc.returncode == 0, proc.stderr
    samples = {s.name: s.value for f in text_string_to_metric_families(textfile.read_text()) for s in f.samples
               if not s.labels}
    layers = 30  # SmolLM2-135M: one stall observation per layer update
    assert samples["tiercache_stall_seconds_count"] == 2 * layers  # the prefill and one decode step
    # --quiet: "no progress bar": transformers' "Loading weights" bar was still there (a review)
    assert "Loading weights" not in proc.stderr and "it/s" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["decode", "faults", "overhead", "policies", "prefix"])
def test_each_benchmarks_help_describes_it_in_whole_sentences(name):
    """The description was the docstring's first line: two stopped mid-sentence ("... on
    real files, and")."""
    import importlib

    from tiercache.cli import doc_summary

    text = doc_summary(importlib.import_module(f"tiercache.bench.{name}").__doc__)
    assert text.startswith(f"``tiercache bench {name}``") or text.startswith(f"`tiercache bench {name}`")
    assert text.endswith(".") and "\n" not in text


@pytest.mark.parametrize("missing,argv,message", [
    # each was an ImportError traceback: compare's default --libcachesim at the end of the replay,
    # bench policies' plots after minutes of recording, --plot after the whole run
    ("libcachesim", ["compare", "--trace", "T"], "--libcachesim: needs libcachesim, which is not installed; "
     "install it with pip install 'tiercache[lab]', or pass --libcachesim none"),
    ("matplotlib", ["compare", "--trace", "T", "--libcachesim", "none", "--plot", "P"],
     "--plot: needs matplotlib, which is not installed"),
    ("libcachesim", ["bench", "policies", "--out", "OUT"], "bench policies: needs libcachesim"),
    ("matplotlib", ["bench", "policies", "--out", "OUT"], "bench policies: needs matplotlib"),
    ("matplotlib", ["eval", "fidelity", "--plot", "P"], "--plot: needs matplotlib"),
])
def test_a_missing_lab_extra_is_one_line_before_any_work(missing, argv, message, tmp_path, monkeypatch, capsys):
    from tiercache.cli import main

    import tiercache.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the missing package was noticed")

    monkeypatch.setattr(tiercache.models, "load_model", no_model)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    paths = {"T": str(tmp_path / "t.csv"), "P": str(tmp_path / "x.png"), "OUT": str(tmp_path / "bp")}
    assert main([paths.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing made: no --out folder, no plot


def test_compare_names_the_prefetch_policies_flag(capsys):
    from tiercache.cli import main

    assert main(["compare", "--trace", "t.csv", "--libcachesim", "none", "--prefetch-policies", "nope"]) == 2
    assert capsys.readouterr().err.startswith("tiercache: error: --prefetch-policies: unknown prefetch policy 'nope'")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["decode", "prefix"])
def test_a_benchmark_worker_that_fails_on_bad_input_is_one_line(name, tmp_path):
    """A model folder with a config but no weights passes the parent's check; the worker's
    ModelNotFoundError was its whole traceback under the parent's own. Now its one line."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model)
    extra = ["--setups", "dynamic", "--rounds", "0", "--new-tokens", "1"] if name == "decode" else ["--turns", "0"]
    proc = cli("bench", name, "--model", str(model), "--context", "16", "--dir", str(tmp_path), *extra, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tiercache: error: bench {name}: the ")
    assert f"cannot load a model from {str(model)!r}" in last
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the work folder removed


@pytest.mark.parametrize("argv,message", [
    (["--context", "20", "--turns", "5"], "--context: 20 tokens are too short for 5 turns of 16-token answers"),
    # the prompt leaves 8 positions for the answers: 504 tokens, too few for 40 turns of 16
    (["--context", "512", "--turns", "40"], "--context: 504 tokens are too short for 40 turns of 16-token answers"),
    (["--context", "512", "--turns", "2"], None),  # the model's positions, as the default 8192 on SmolLM2: runs
    (["--context", "100000", "--turns", "0"], None),  # cut to the positions, and the log says so
])
def test_bench_prefix_checks_its_context_before_any_worker(argv, message, tmp_path, monkeypatch,
                                                           capsys):
    """A context too short for the turns was refused by the conversation worker, after two
    whole workers had prefilled it (a review); it now fails before any worker. A context
    past the model's positions less the margin the answers need (the default run's 8192 on
    SmolLM2, or more) is cut to it, as before, and the log now says so (it named the size
    asked for)."""
    from transformers import LlamaConfig

    from tiercache.bench import prefix
    from tiercache.cli import main

    class Started(Exception):
        pass

    def no_worker(*args, **kwargs):
        raise Started()

    monkeypatch.setattr(prefix, "_spawn", no_worker)
    model = tmp_path / "model"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512).save_pretrained(model)
    if message is None:
        with pytest.raises(Started):
            main(["bench", "prefix", "--model", str(model), "--dir", str(tmp_path), *argv])
        assert f"at 504 tokens (--context {argv[1]} cut to the model's 512 positions less 8)" in \
            capsys.readouterr().err
        return
    assert main(["bench", "prefix", "--model", str(model), "--dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_an_output_file_under_a_regular_file_says_so(tmp_path):
    """``--stats-json afile/x.json`` said "(folder ... missing)" of a file that is there."""
    from tiercache.cli import CLIError, check_writable

    (tmp_path / "afile").write_text("a file")
    target = str(tmp_path / "afile" / "x.json")
    with pytest.raises(CLIError) as info:
        check_writable("--stats-json", target)
    folder = str(tmp_path / "afile")
    assert str(info.value) == f"--stats-json: cannot write {target!r} (folder {folder!r} is not a folder)"
    with pytest.raises(CLIError, match="missing"):
        check_writable("--stats-json", str(tmp_path / "nope" / "x.json"))


@pytest.mark.timeout(120)
def test_sigterm_removes_the_benchmarks_work_folder(tmp_path):
    """bench io killed with SIGTERM left its work folder (1.6 GB by default) behind: its
    ``finally`` did not run. The command line turns SIGTERM into an exception, so it does."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "tiercache.cli", "bench", "io", "--dir", str(tmp_path),
                             "--size", "512MiB", "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert any(tmp_path.iterdir()), "the benchmark made no work folder"
        time.sleep(0.5)  # into the measurement: files being written
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "tiercache: terminated (SIGTERM)" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_main_with_argv_leaves_sigterm_alone(capsys):
    """Only the command line's own process handles SIGTERM: importing the module or calling
    ``main(argv)`` changes no signal handler of the caller's."""
    import signal

    import tiercache.cli

    before = signal.getsignal(signal.SIGTERM)
    assert tiercache.cli.main(["demo", "--records", "0"]) == 2
    assert signal.getsignal(signal.SIGTERM) == before


def test_main_from_sys_argv_gives_sigterm_back_when_it_returns(monkeypatch, capsys):
    """``main()`` without argv (the command line) turns SIGTERM into a clean exit while the
    command runs, and puts the default back when it returns: a program that called it and
    went on was left with the handler, and a later SIGTERM raised in it (a review)."""
    import signal

    import tiercache.cli

    monkeypatch.setattr(signal, "signal", _recording(signal.signal, seen := []))
    monkeypatch.setattr("sys.argv", ["tiercache", "demo", "--records", "0"])
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert tiercache.cli.main() == 2
        assert [handler for signum, handler in seen if signum == signal.SIGTERM][1:] == \
            [tiercache.cli._on_sigterm, signal.SIG_DFL]  # installed for the run, then the default again
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def _recording(fn, seen: list):
    def call(signum, handler):
        seen.append((signum, handler))
        return fn(signum, handler)
    return call


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's tokenizer (128 positions), saved as a
    model folder: the output-file scenarios below need a whole run, not a good answer, and
    it loads in a second where SmolLM2 takes several. Skips where the tokenizer is not
    converted."""
    from test_cache_admin import tiny_bench_model

    return tiny_bench_model(tmp_path_factory.mktemp("tiny") / "model")


def run_tiny(model: str, *args: str) -> subprocess.CompletedProcess:
    """``tiercache generate`` with the tiny model, one new token, no progress or table."""
    return cli("generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "1", "--quiet", *args)


def test_generate_refuses_a_run_its_tiers_cannot_hold_before_any_answer(tiny_model, tmp_path):
    """Budgets whose tiers hold fewer blocks than the whole run needs, though the device
    holds what the prefill needs: the run streamed part of its answer, then failed naming
    what that one step needed (120 blocks, where the run needed 150), with no newline after
    the half answer (a review). Now it is refused before the prefill, naming the whole run's
    blocks and what the tiers hold: exit 2, nothing on stdout."""
    from tiercache import TierConfig, TieredCache
    from tiercache.models import load_model

    model, tokenizer = load_model(tiny_model, device="cpu")
    probe = TierConfig(device_budget="1MiB", host_budget=0, block_tokens=4)
    from tiercache.generation import encode_prompt

    num_prompt = encode_prompt(tokenizer, "hi", True)["input_ids"].shape[1]
    with TieredCache(model, probe) as cache:
        need = cache.min_capacity_blocks(num_prompt, 40)
        device = cache.min_device_budget(num_prompt, 40, 512)  # the whole run's, on the device
        block = cache.min_device_budget(num_prompt, 0, 512) // -(-num_prompt // 4)
    assert need * block > device  # the prefill fits the device; the run does not
    proc = cli("generate", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens", "40", "--quiet",
               "--device-budget", str(device), "--host-budget", "0", "--block-tokens", "4")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert (f"tiercache: error: the KV cache of this run needs {need} blocks (a prompt of {num_prompt} tokens and 40 "
            f"new ones, in blocks of 4 tokens, every layer) but the tiers hold {device // block}") in proc.stderr
    proc = cli("generate", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens", "40", "--quiet",
               "--device-budget", str(device), "--host-budget", "1MiB", "--block-tokens", "4")
    assert proc.returncode == 0, proc.stderr  # room on the host: the same run goes


def test_an_error_after_part_of_the_answer_starts_its_own_line(tiny_model):
    """A run that fails after some of its answer was streamed (here: the cache's update
    raises at the fourth decode step) ends the half-printed line before the error comes."""
    import io

    from tiercache import TierConfig, TieredCache
    from tiercache.generation import generate_text
    from tiercache.models import load_model

    model, tokenizer = load_model(tiny_model, device="cpu")
    calls = []
    real = TieredCache.update

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 5 * len(self.layers):
            raise RuntimeError("the disk went away")
        return real(self, *args, **kwargs)

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TieredCache, "update", failing)
        with pytest.raises(RuntimeError, match="the disk went away"):
            generate_text("hi", TierConfig(device_budget="1MiB", host_budget=0, block_tokens=4), model=model,
                          tokenizer=tokenizer, max_new_tokens=20, stream=out, progress=False)
    assert out.getvalue().strip() and out.getvalue().endswith("\n")


def test_a_metrics_textfile_behind_a_link_stays_a_link_and_a_fifo_is_refused_up_front(tiny_model, tmp_path):
    """``--metrics-textfile`` renamed its temporary file over whatever the path named: a
    symlink became a plain file (the file it pointed to, the one node_exporter reads, was
    never written), a FIFO became a plain file, and as root ``/dev/full`` did. Now the file
    a link leads to gets the metrics and the link stays, as ``--stats-json`` (opened
    through the link) always did; a path that is a FIFO (here for every kind that is not a
    regular file: a test must not risk a real device node) is refused with one line naming
    the flag and the path, before the model loads (a model path that does not exist is
    never reached), and stays a FIFO."""
    import stat

    fifo = tmp_path / "pipe.prom"
    os.mkfifo(fifo)
    proc = cli("generate", "--prompt", "hi", "--model", str(tmp_path / "no-model"), "--metrics-textfile", str(fifo))
    assert proc.returncode == 2
    assert proc.stderr == (f"tiercache: error: --metrics-textfile: {str(fifo)!r} is a named pipe (FIFO); only a "
                           f"regular file (or a new one) can take the textfile, which is written as a new file "
                           f"renamed over it\n")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    collector = tmp_path / "collector"
    collector.mkdir()
    (collector / "tiercache.prom").write_text("# the previous run's\n")
    prom, stats = tmp_path / "job.prom", tmp_path / "job.json"
    prom.symlink_to(collector / "tiercache.prom")
    stats.symlink_to(collector / "stats.json")  # a dangling link: --stats-json makes its target
    proc = run_tiny(tiny_model, "--metrics-textfile", str(prom), "--stats-json", str(stats))
    assert proc.returncode == 0, proc.stderr
    assert prom.is_symlink() and stats.is_symlink()
    assert "tiercache_decode_tokens_total" in (collector / "tiercache.prom").read_text()
    assert json.loads((collector / "stats.json").read_text())["stats"]["prefill_tokens"] > 0
    assert sorted(os.listdir(collector)) == ["stats.json", "tiercache.prom"]


def test_two_flags_naming_one_file_are_refused_before_the_model_loads(tmp_path, capsys):
    """``--trace-out F --stats-json F`` was accepted: the trace was written, then the stats
    JSON over it, and the trace was gone without a word (so with ``--metrics-textfile``,
    and an output over ``--prompt-file`` replaced the prompt). Now two flags that name one
    file are refused with one line naming both, before the model loads (the model path
    given does not exist and is never reached): the same path, a symlink to it, a hard
    link, a dangling link and the file it will make. ``/dev/null`` for two outputs is
    still fine: nothing is replaced there (the run goes on, to the missing model)."""
    from tiercache.cli import main

    out = tmp_path / "out"
    out.write_text("")
    (tmp_path / "link").symlink_to(out)
    os.link(out, tmp_path / "hard")
    (tmp_path / "dangling").symlink_to(tmp_path / "new")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hi")
    no_model = ["--model", str(tmp_path / "no-model")]
    for argv, flags, shown in (
            (["--trace-out", "OUT", "--stats-json", "OUT"], ("--trace-out", "--stats-json"), "'OUT'"),
            (["--trace-out", "LINK", "--stats-json", "OUT"], ("--trace-out", "--stats-json"), "'LINK' and 'OUT'"),
            (["--stats-json", "HARD", "--metrics-textfile", "OUT"], ("--stats-json", "--metrics-textfile"),
             "'HARD' and 'OUT'"),
            (["--trace-out", "DANGLING", "--metrics-textfile", "NEW"], ("--trace-out", "--metrics-textfile"),
             "'DANGLING' and 'NEW'")):
        names = {"OUT": out, "LINK": tmp_path / "link", "HARD": tmp_path / "hard",
                 "DANGLING": tmp_path / "dangling", "NEW": tmp_path / "new"}
        for name, path in names.items():
            shown = shown.replace(f"'{name}'", repr(str(path)))
        assert main(["generate", "--prompt", "hi", *no_model, *[str(names.get(a, a)) for a in argv]]) == 2
        assert capsys.readouterr().err == (f"tiercache: error: {flags[0]} and {flags[1]} name the same file "
                                           f"({shown}): {flags[1]} would overwrite the other; give each its own "
                                           f"file\n")
    assert main(["generate", "--prompt-file", str(prompt), *no_model, "--stats-json", str(prompt)]) == 2
    assert capsys.readouterr().err == (f"tiercache: error: --prompt-file and --stats-json name the same file "
                                       f"({str(prompt)!r}): --stats-json would overwrite the prompt; give each "
                                       f"its own file\n")
    assert prompt.read_text() == "hi" and out.read_text() == "" and not (tmp_path / "new").exists()
    assert main(["compare", "--prompt-file", str(tmp_path / "link"), *no_model, "--trace-out", str(out),
                 "--libcachesim", "none"]) == 2  # the trace recorded over the prompt
    assert "--prompt-file and --trace-out name the same file" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", *no_model, "--trace-out", "/dev/null", "--stats-json",
                 "/dev/null"]) == 2
    assert capsys.readouterr().err.startswith("tiercache: error: --model: ")


def test_an_output_over_an_input_is_refused_and_a_pipe_takes_two(tmp_path, capsys):
    """A review: ``compare --trace T --plot T`` wrote the PNG over the trace it had read
    (exit 0, the trace gone), and ``eval fidelity --text-file X --plot X`` over the text.
    Both are refused before any work now. And ``/dev/stdout`` on a pipe was refused for any
    output (its resolved path, /proc/<pid>/fd/pipe:[N], names no file): it is written in
    place, by two flags too."""
    from tiercache.cli import main

    trace = tmp_path / "trace.csv"
    trace.write_text("time,obj_id\n")
    assert main(["compare", "--trace", str(trace), "--plot", str(trace), "--libcachesim", "none"]) == 2
    assert capsys.readouterr().err == (f"tiercache: error: --trace and --plot name the same file ({str(trace)!r}): "
                                       f"--plot would overwrite the file it reads; give each its own file\n")
    assert trace.read_text() == "time,obj_id\n"
    # --trace-out is written only when compare records a trace: beside --trace it names nothing
    assert main(["compare", "--trace", str(trace), "--trace-out", str(trace), "--libcachesim", "none"]) != 0
    assert "name the same file" not in capsys.readouterr().err
    assert trace.read_text() == "time,obj_id\n"
    text = tmp_path / "long.txt"
    text.write_text("words " * 10)
    assert main(["eval", "fidelity", "--text-file", str(text), "--plot", str(text), "--model",
                 str(tmp_path / "no-model")]) == 2
    assert "--text-file and --plot name the same file" in capsys.readouterr().err
    assert text.read_text() == "words " * 10
    proc = cli("generate", "--prompt", "hi", "--model", str(tmp_path / "no-model"), "--stats-json", "/dev/stdout",
               "--trace-out", "/dev/stdout")  # stdout is a pipe here
    assert proc.returncode == 2 and proc.stderr.startswith("tiercache: error: --model: "), proc.stderr


def full_disk() -> str:
    """A path whose every write fails with ENOSPC: ``/dev/full``, where this system has one
    that this user may open; else the test skips (a tmpfs would need mount rights)."""
    if not os.path.exists("/dev/full") or not os.access("/dev/full", os.W_OK):
        pytest.skip("no writable /dev/full here to stand for a full disk")
    return "/dev/full"


def test_a_trace_on_a_full_disk_is_one_line_after_the_runs_other_outputs(tiny_model, tmp_path):
    """``--trace-out`` on a full disk: the trace's last rows failed to flush when the cache
    closed, an OSError traceback (exit 1) came at the end of the run, and the stats JSON
    and the metrics textfile, written after it, were lost. Now the run goes on, its answer,
    table, stats JSON and textfile are written, and the failure is one last line naming the
    flag and the path, exit 2. ``compare`` recording its trace there says the same in one
    line (the trace it would replay is incomplete)."""
    target = full_disk()
    stats, prom = tmp_path / "stats.json", tmp_path / "m.prom"
    proc = cli("generate", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens", "2", "--trace-out", target,
               "--stats-json", str(stats), "--metrics-textfile", str(prom))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (f"tiercache: error: --trace-out: cannot write {target!r} (No space "
                                            f"left on device); the trace is incomplete")
    assert proc.stdout.strip() and "decode: 1 tokens" in proc.stderr  # the answer, the table
    data = json.loads(stats.read_text())
    assert data["stats"]["decode_tokens"] == 1 and data["text"] == proc.stdout.strip("\n")
    assert "tiercache_decode_tokens_total" in prom.read_text()
    io = tmp_path / "io.json"
    io.write_text(json.dumps({"h2d_gbps": 9.0, "d2h_gbps": 9.0, "read_gbps": 1.0, "write_gbps": 1.5}))
    proc = cli("compare", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens", "2", "--trace-out", target,
               "--libcachesim", "none", "--io-json", str(io), "--json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"tiercache: error: trace: cannot write {target!r} (No space left on device)"


def test_a_prompt_that_never_ends_is_refused_past_64_mib_from_a_file_or_stdin(tmp_path, capsys):
    """``--prompt-file /dev/zero``, or stdin that never ends, was read until memory ran out
    (a MemoryError traceback, or the kernel's OOM killer). Now the read stops one byte past
    64 MiB, which is past any model's positions, and that is one line naming the flag and
    the file (or stdin) and the limit, exit 2, before the model loads. (The runs here get a
    4 GiB address space, so that without the bound they fail fast instead of taking the
    machine's memory.) A prompt of exactly 64 MiB is read: it is refused later, in tokens,
    against the model's positions (here the model path given does not exist)."""
    import resource

    from tiercache.cli import main

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    limit = "is longer than 64 MiB (67108864 bytes), the limit of a prompt: more is past any model's positions"
    for argv, where in ((["--prompt-file", "/dev/zero"], "--prompt-file: '/dev/zero'"), ([], "stdin")):
        with open("/dev/zero", "rb") as zero:
            proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "generate", *argv], stdin=zero,
                                  capture_output=True, text=True, timeout=120, preexec_fn=limited)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == f"tiercache: error: {where} {limit}\n"
    whole = tmp_path / "whole.txt"
    with open(whole, "wb") as f:
        f.truncate(64 << 20)  # NUL bytes: UTF-8 text, and not blank
    assert main(["generate", "--prompt-file", str(whole), "--model", str(tmp_path / "no-model")]) == 2
    assert capsys.readouterr().err.startswith("tiercache: error: --model: ")


@pytest.mark.model
def test_demo_with_more_records_than_the_model_has_positions_says_how_many_fit(capsys):
    """``demo --records 400`` (allowed: up to 400 distinct names) makes a prompt of ~14k
    tokens for a model of 8192 positions: the error came after "answer:" was printed and
    told the user to shorten the prompt or --max-new-tokens, which the demo has neither of
    (a review). Now it names --records and the most that fit, before any answer."""
    from tiercache.cli import main

    assert main(["demo", "--records", "400"]) == 2
    out, err = capsys.readouterr()
    assert "answer:" not in out
    match = re.search(r"tiercache: error: records \(--records\): 400 records make a prompt of (\d+) tokens, and "
                      r"with the 24-token answer that is more than the model's 8192 positions; use at most (\d+)", err)
    assert match and int(match.group(1)) > 8192 and 100 < int(match.group(2)) < 400, err


def test_demo_refuses_a_disk_dir_that_is_a_file_before_the_model_loads(tmp_path, capsys):
    """``demo --disk-dir FILE`` (a regular file) loaded the default model first (seconds,
    and its progress bar on stderr), and only then did the demo's TierConfig refuse the
    path. Now TierConfig's own check runs before anything loads: the same one line, exit 2,
    and nothing else on stderr; a folder others can read is refused up front too, as
    ``generate --disk-dir`` refuses it."""
    from tiercache import TierConfig
    from tiercache.cli import main

    afile = tmp_path / "kv"
    afile.write_text("not a directory")
    with pytest.raises(ValueError) as info:
        TierConfig(disk_dir=str(afile), disk_budget="1GiB")
    assert main(["demo", "--disk-dir", str(afile)]) == 2
    assert capsys.readouterr().err == f"tiercache: error: {info.value}\n"
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    assert main(["demo", "--disk-dir", str(loose)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tiercache: error: disk_dir: {str(loose)!r} has permissions 0o755") and err.count("\n") == 1


def test_a_tokenizer_of_another_model_is_named_not_an_index_error(tmp_path):
    """A model folder whose tokenizer has more tokens than the model has embeddings (the
    default model's tokenizer next to a 100-token model): ``generate`` died in an
    IndexError from inside torch's embedding. Now it is one error line that names the
    token id, the model's range and the mismatch, and exit 2."""
    from test_cache_admin import tiny_bench_model, tiny_model as random_llama

    folder = tiny_bench_model(tmp_path / "model")
    small = random_llama(vocab=100)
    small.config.max_position_embeddings = 128
    small.save_pretrained(folder)  # the default tokenizer stays: its ids go far past 99
    proc = run_tiny(folder)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"tiercache: error: the tokenizer gave token id \d+, but the model has embeddings for ids "
                     r"0\.\.99 only: the tokenizer does not belong to this model", proc.stderr), proc.stderr


def test_a_disk_budget_under_one_block_is_one_error_not_a_warning_first(tiny_model, tmp_path):
    """``--disk-budget 10``: a warning that the prefix cache is off ("pass reuse=False", a
    Python argument the command line has no flag for) came before the error that the budget
    holds no block (a review). Only the error now."""
    proc = run_tiny(tiny_model, "--disk-dir", str(tmp_path / "kv"), "--disk-budget", "10")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tiercache: error: disk_budget: 10 bytes (10 B) is smaller than one block")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_the_answer_line_ends_before_lingering_metrics_and_a_loaded_prefix_is_named(tiny_model, tmp_path):
    """Two runs of one prompt on one disk_dir, stdout and stderr on one stream as on a
    terminal. "metrics: serving 1 s more" was written onto the answer's line; it starts its
    own now, and the answer is followed by one newline. The second run loads the prompt's
    whole blocks from the prefix cache: its table said "prefill: 16 tokens ... (5.0 tok/s)",
    six times slower-looking than the cold run that computed them all (a review); it names
    the tokens loaded, and its rate counts them."""
    args = [sys.executable, "-m", "tiercache.cli", "generate", "--model", tiny_model, "--prompt", "hello " * 40,
            "--max-new-tokens", "3", "--block-tokens", "16", "--disk-dir", str(tmp_path / "kv"),
            "--disk-budget", "64MiB", "--prefill-chunk", "8"]
    lingering = subprocess.run(args + ["--metrics-port", "0", "--metrics-linger", "0.2"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=600)
    assert lingering.returncode == 0, lingering.stdout
    assert "\nmetrics: serving 0.2 s more\n" in lingering.stdout, lingering.stdout
    warm = cli(*args[3:], "--stats-json", str(tmp_path / "s.json"))
    assert warm.returncode == 0, warm.stderr
    assert warm.stdout.endswith("\n") and not warm.stdout.endswith("\n\n")
    stats = json.loads((tmp_path / "s.json").read_text())["stats"]
    assert stats["reused_tokens"] > 0
    line = next(x for x in warm.stderr.splitlines() if x.startswith("prefill:"))
    assert line.startswith(f"prefill: {stats['prefill_tokens']} computed + {stats['reused_tokens']} loaded tokens in")


def test_progress_into_a_log_is_lines_and_shows_the_decode(tiny_model, tmp_path):
    """stderr into a file or a pipe of its own (a log): the prefill bar was redrawn with carriage
    returns into it, and the decode showed no progress at all (the issue asks for both; a
    review). Now a line per prefill chunk and per tenth of the decode, no carriage return,
    and the answer on stdout is the answer alone. With both on one pipe (``2>&1``) the
    decode's lines are left out: they would tear the answer's line."""
    proc = cli("generate", "--model", tiny_model, "--prompt", "hello " * 20, "--max-new-tokens", "20",
               "--prefill-chunk", "8", "--block-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    prefill = [x for x in lines if x.startswith("prefill [")]
    decode = [x for x in lines if x.startswith("decode [")]
    assert len(prefill) >= 3 and prefill[-1].endswith(" tokens") and "[" + "#" * 30 + "]" in prefill[-1]
    assert 2 <= len(decode) <= 11 and "decode [" + "#" * 30 + "] 20/20 tokens" in decode[-1], decode
    assert "decode [" not in proc.stdout and "prefill [" not in proc.stdout

    merged = subprocess.run([sys.executable, "-m", "tiercache.cli", "generate", "--model", tiny_model, "--prompt",
                             "hello " * 20, "--max-new-tokens", "20", "--block-tokens", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert merged.returncode == 0 and "decode [" not in merged.stdout  # 2>&1: the answer's line stays whole
    assert proc.stdout.strip() in merged.stdout


@pytest.mark.model
def test_the_demo_in_one_log_keeps_its_answer_on_the_answer_line(tmp_path):
    """``make demo`` with stdout and stderr into one log (as fresh-check and CI keep it):
    the answer's label, written before the run, landed on the first progress line, and the
    answer stood on a line of its own. The label now comes with the answer's first text."""
    proc = subprocess.run([sys.executable, "-m", "tiercache.cli", "demo", "--records", "40",
                           "--disk-dir", str(tmp_path / "kv")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    answer = [x for x in lines if x.startswith("answer:")]
    assert len(answer) == 1 and "prefill [" not in answer[0] and len(answer[0]) > len("answer:   "), proc.stdout
    assert lines.index(answer[0]) > max(i for i, x in enumerate(lines) if x.startswith("prefill ["))


PLUGIN = '''
import os

from tiercache.policies import EVICTION_POLICIES, LRUPolicy


class Marked(LRUPolicy):
    """lru, leaving a line in $MARK each time the cache makes one (one per tier)."""

    def __init__(self):
        super().__init__()
        with open(os.environ["MARK"], "a") as f:
            f.write(f"{os.getpid()}\\n")


EVICTION_POLICIES["marked"] = Marked
'''


def test_a_plugin_module_names_its_policies_on_the_command_line(tiny_model, tmp_path):
    """A policy registered from Python was unknown to the command line ("unknown policy"),
    and ``bench decode`` took one registered in its own process, ran the other set-ups, and
    then failed in the worker process that had never heard of it (a review).
    ``tiercache --plugin MODULE`` (a module name or a .py file; or ``TIERCACHE_PLUGINS``)
    imports the module first, for the command and for the processes it starts: here
    ``generate`` and a ``bench decode`` worker each make the plug-in's policy."""
    plugin = tmp_path / "my_policies.py"
    plugin.write_text(PLUGIN)
    mark = tmp_path / "mark"
    env = {**os.environ, "MARK": str(mark)}

    def run(*args, extra_env=None):
        return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True,
                              timeout=600, env={**env, **(extra_env or {})})

    proc = run("generate", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens", "1", "--quiet",
               "--eviction", "marked", "--disk-dir", str(tmp_path / "kv"))
    assert proc.returncode == 2 and "eviction: unknown policy 'marked'" in proc.stderr
    proc = run("--plugin", str(plugin), "generate", "--model", tiny_model, "--prompt", "hi", "--max-new-tokens",
               "1", "--quiet", "--eviction", "marked", "--disk-dir", str(tmp_path / "kv"))
    assert proc.returncode == 0, proc.stderr
    assert mark.read_text().split(), "the plug-in's policy was never made"
    mark.unlink()
    # the same through the environment, into the worker processes of bench decode
    proc = run("bench", "decode", "--model", tiny_model, "--context", "32", "--new-tokens", "2", "--rounds", "0",
               "--block-tokens", "8", "--setups", "dynamic,fits@marked", "--dir", str(tmp_path), "--json",
               extra_env={"TIERCACHE_PLUGINS": str(plugin)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert str(os.getpid()) not in mark.read_text().split() and mark.read_text().split()  # made in a worker
    assert json.loads(proc.stdout)["fits@marked_tps"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--plugin", "no_such_module_here", "generate", "--prompt", "hi"],
     "--plugin 'no_such_module_here': cannot import it (ModuleNotFoundError"),
    (["--plugin", "json", "generate", "--prompt", "hi"], "--plugin 'json': imported, but it registered no policy"),
    (["--plugin", "/nonexistent/p.py", "generate", "--prompt", "hi"],
     "--plugin '/nonexistent/p.py': cannot import it (FileNotFoundError: no file '/nonexistent/p.py')"),
])
def test_a_plugin_that_cannot_be_used_is_one_line(argv, message, capsys):
    from tiercache.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_bench_decode_refuses_a_policy_its_workers_cannot_make():
    """A plug-in registered in this process only (not through a plug-in module) is refused
    by ``bench decode`` before any set-up runs: its set-ups run in processes of their own."""
    from tiercache.bench.decode import run
    from tiercache.policies import EVICTION_POLICIES, LRUPolicy

    class Local(LRUPolicy):
        pass

    EVICTION_POLICIES["local"] = Local
    try:
        for argv in (["--setups", "dynamic,fits@local"], ["--eviction", "local"]):
            with pytest.raises(ValueError, match="the eviction policy 'local' is registered in this process only, "
                                                 "and bench decode runs each set-up in a process of its own"):
                run(argv)
    finally:
        del EVICTION_POLICIES["local"]
