"""``tiercache`` command line: generate, compare, demo, bench. Argument handling only; the work is
done by the library modules."""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import json
import math
import os
import stat
import sys
import tempfile
import time
from typing import Any, BinaryIO, Iterator, NoReturn, Optional

from tiercache.config import TierConfig, format_bytes
from tiercache.errors import TierCacheError


class CLIError(ValueError):
    """A problem with the user's input: printed as one line, exit status 2. A ValueError, as
    the benchmarks' own checks are, for a caller of their ``run()``."""


def _quiet_transformers() -> None:
    """--quiet: no progress bars of transformers' either (its "Loading weights" bar)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def add_tier_args(p: argparse.ArgumentParser, *, device: str = "1GiB", host: str = "4GiB",
                  disk: str = "16GiB") -> None:
    g = p.add_argument_group("tiers")
    g.add_argument("--device-budget", default=device, help="device tier budget, e.g. 64MiB (default %(default)s)")
    g.add_argument("--host-budget", default=host, help="host tier budget; 0 disables it (default %(default)s)")
    g.add_argument("--disk-budget", default=disk, help="disk tier budget; 0 disables it (default %(default)s)")
    g.add_argument("--disk-dir", default=None, help="directory of the disk tier (disk disabled without it)")
    g.add_argument("--block-tokens", type=int, default=TierConfig.block_tokens, help="tokens per block")
    g.add_argument("--eviction", default=TierConfig.eviction, help="eviction policy: layer-cycle (default), lfu, "
                   "lru, fifo, arc, s3fifo, sinks-recent, attention-score")
    g.add_argument("--prefetch", default=TierConfig.prefetch, help="prefetch policy: auto (default: lookahead, "
                   "at most 3 layers deep, on CPU with host and disk tiers and no selection or retention; else "
                   "next-layer), next-layer, none, lookahead, history")
    g.add_argument("--io-workers", type=int, default=4, help="disk I/O threads")
    g.add_argument("--direct-io", default="auto", choices=["auto", "on", "off"])
    g.add_argument("--disk-io", default="auto", choices=["auto", "posix", "kvikio"],
                   help="who reads and writes disk records (default auto: kvikio on CUDA when installed)")
    g.add_argument("--shared-dir", action="store_true",
                   help="accept a disk dir with looser permissions or another owner (default: refuse; "
                        "needs --disk-dir)")
    g.add_argument("--attend-in-place", action="store_true",
                   help="CPU with a host tier: decode attention reads each block where it lies, no gather "
                        "copy (faster; equal to SDPA to float rounding, not bit for bit)")
    r = p.add_argument_group("remote tier (Redis/Valkey; shares prefix-cache blocks between machines)")
    r.add_argument("--remote-url", default=None, help="redis://host:port/db, rediss:// (TLS) or unix:///path; "
                   "password from the URL or $TIERCACHE_REMOTE_PASSWORD (needs --disk-dir)")
    r.add_argument("--remote-budget", default=None, help="bytes of this model's blocks on the server "
                   "(default: the server's maxmemory decides; needs --remote-url)")
    r.add_argument("--remote-namespace", default=TierConfig.remote_namespace, help="key prefix (default %(default)s)")
    r.add_argument("--remote-cluster", action="store_true", help="the URL names a Redis/Valkey Cluster node "
                   "(needs --remote-url)")
    r.add_argument("--remote-timeout", type=float, default=TierConfig.remote_timeout,
                   help="seconds per server call (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> TierConfig:
    try:
        cfg = TierConfig(device_budget=args.device_budget, host_budget=args.host_budget,
                         disk_budget=args.disk_budget, disk_dir=args.disk_dir, block_tokens=args.block_tokens,
                         eviction=args.eviction, prefetch=args.prefetch, io_workers=args.io_workers,
                         direct_io=args.direct_io, disk_io=args.disk_io, shared_dir=args.shared_dir,
                         attend_in_place=args.attend_in_place, remote_url=args.remote_url,
                         remote_budget=args.remote_budget, remote_namespace=args.remote_namespace,
                         remote_cluster=args.remote_cluster, remote_timeout=args.remote_timeout)
        check_disk_tier(cfg)
        return cfg
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def check_disk_tier(cfg: TierConfig) -> None:
    """The checks the disk tier's store makes when it opens, made before the model loads:
    kvikio asked for where it cannot run, and a folder others can read (refused after the
    model had loaded, and printed twice). ``cfg`` itself checked ``disk_dir`` (a regular
    file there, a folder that cannot be made) as it was built. ValueError naming the problem."""
    if cfg.disk_enabled:
        from tiercache.disk import ensure_private_dir, resolve_disk_io

        resolve_disk_io(cfg.disk_io)
        ensure_private_dir(cfg.disk_dir, cfg.shared_dir)


# The most bytes a prompt (or eval's --text-file) is read of: /dev/zero, or a pipe that
# never ends, was read until memory ran out. The prompt is read before the model loads, so
# its positions are not known yet; this bound is past any model's: Llama 4 Scout's 10M
# positions, the most of any released model, are ~40 MiB of text at ~4 bytes a token. The
# exact limit, the model's positions, is checked in tokens once the model has loaded.
MAX_PROMPT_BYTES = 64 << 20


def read_bounded(f: BinaryIO, where: str, what: str = "a prompt") -> bytes:
    """All of ``f``, at most ``MAX_PROMPT_BYTES``; more is a CLIError naming ``where`` (the
    flag and the path, or stdin) and the limit of ``what``. One byte past the limit is read,
    no more."""
    data = f.read(MAX_PROMPT_BYTES + 1)
    if len(data) > MAX_PROMPT_BYTES:
        raise CLIError(f"{where} is longer than {MAX_PROMPT_BYTES >> 20} MiB ({MAX_PROMPT_BYTES} bytes), the "
                       f"limit of {what}: more is past any model's positions")
    return data


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from --prompt, --prompt-file or stdin; CLIError when it is empty or blank
    (the chat template alone made a prompt of it) or not UTF-8."""
    if args.prompt is not None:  # argv is decoded with surrogateescape too: bad bytes arrive as surrogates
        return _not_blank(_utf8(args.prompt.encode("utf-8", "surrogateescape"), "--prompt", text_mode=False),
                          "--prompt is empty")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                data = read_bounded(f, f"--prompt-file: {args.prompt_file!r}")
        except OSError as exc:
            raise CLIError(f"--prompt-file: cannot read {args.prompt_file!r} ({exc.strerror})") from None
        return _not_blank(_utf8(data, f"--prompt-file: {args.prompt_file!r}"),
                          f"--prompt-file: {args.prompt_file!r} is empty")
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError("no prompt: pass --prompt TEXT, --prompt-file FILE, or pipe it on stdin")
    # bytes, decoded here: Python's own decoding of stdin passes bad bytes on as surrogates,
    # and the tokenizer then failed with a TypeError traceback
    stdin = sys.stdin
    if hasattr(stdin, "buffer"):
        data = read_bounded(stdin.buffer, "stdin")
    else:  # a text stream (a caller's StringIO): characters, at most as many as the bytes allowed
        data = read_bounded(io.BytesIO(stdin.read(MAX_PROMPT_BYTES + 1).encode("utf-8", "surrogateescape")), "stdin")
    return _not_blank(_utf8(data, "stdin"), "stdin is empty")


def _not_blank(text: str, what: str) -> str:
    """``text``, unless it is empty or only whitespace: a mistake (the chat template alone made
    a prompt of it), refused before the model loads."""
    if not text.strip():
        raise CLIError(f"no prompt: {what}; pass --prompt TEXT, --prompt-file FILE, or pipe it on stdin")
    return text


def _utf8(data: bytes, where: str, text_mode: bool = True) -> str:
    """``data`` decoded, else a CLIError naming ``where`` and the first bad byte. ``text_mode``:
    newlines as text mode reads them (\r\n and \r to \n), as files and stdin were read."""
    try:
        text = data.decode("utf-8")
        return text.replace("\r\n", "\n").replace("\r", "\n") if text_mode else text
    except UnicodeDecodeError as exc:
        raise CLIError(f"{where} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def stats_table(stats: dict, seconds: dict) -> str:
    """A plain-text summary: tier occupancy, bytes moved, hits, stall time, tokens/s."""
    lines = ["tier     budget       used         blocks  hits"]
    for tier in ("device", "host", "disk"):
        t = stats["tiers"].get(tier, {})
        io = f"   ({t['io']}, {'direct I/O' if t.get('direct_io') else 'page cache'})" if "io" in t else ""
        lines.append(f"{tier:<8} {format_bytes(t.get('budget_bytes', 0)):>11}  {format_bytes(t.get('used_bytes', 0)):>11}"
                     f"  {t.get('blocks', 0):>6}  {stats['hits'].get(tier, 0)}{io}")
    lines.append("moves:")
    for name, m in sorted(stats["moves"].items()):
        lines.append(f"  {name:<14} {m['blocks']:>7} blocks  {format_bytes(m['bytes']):>11}  {m['seconds']:.2f} s")
    lines.append(f"evictions: {stats['evictions']}   stall: {stats['stall_seconds']:.2f} s   "
                 f"prefetch: {stats['prefetch']}")
    remote = stats.get("remote")
    if remote is not None:
        errors = {k: n for k, n in remote["errors"].items() if n}
        lines.append(f"remote {remote['url']} ({remote['state']}): {remote['hits']} blocks hit, {remote['misses']} "
                     f"missed, {format_bytes(remote['bytes_read'])} read, {format_bytes(remote['bytes_written'])} "
                     f"written, {remote['writes_dropped']} writes dropped, errors {errors or 'none'}")
    pre, dec, loaded = stats["prefill_tokens"], stats["decode_tokens"], stats.get("reused_tokens", 0)
    # A loaded prefix is part of the prompt's time: its tokens are in the rate too, and named
    # (16 tokens "at 5.0 tok/s" read as six times slower than the cold run, a review)
    prompt = f"{pre} tokens" if not loaded else f"{pre} computed + {loaded} loaded tokens"
    lines.append(f"prefill: {prompt} in {seconds['prefill']:.1f} s "
                 f"({(pre + loaded) / max(seconds['prefill'], 1e-9):.1f} tok/s)"
                 f"   decode: {dec} tokens in {seconds['decode']:.1f} s ({dec / max(seconds['decode'], 1e-9):.2f} tok/s)")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from tiercache.generation import generate_text

    cfg = config_from_args(args)
    prompt = read_prompt(args)

    late_errors: list = []  # after the run: reported once the other outputs are written
    answer_ended: list = []  # on_done ended the answer's line on stdout

    def on_open(cache) -> None:
        if args.metrics_textfile:  # attached now: its histograms count from here (at the end they were empty)
            from tiercache.metrics import metrics_for

            metrics_for(cache)
        if args.metrics_port is not None:
            from tiercache.metrics import metrics_url, serve_metrics

            port = serve_metrics(cache, port=args.metrics_port, addr=args.metrics_addr)
            print(f"metrics: {metrics_url(args.metrics_addr, port)}", file=sys.stderr)

    def on_done(cache) -> None:
        from tiercache.metrics import stop_metrics, textfile_target, write_textfile

        if args.metrics_textfile:
            try:  # where a symlink leads: the link stays; a FIFO made there meanwhile, refused
                write_textfile(cache, textfile_target(args.metrics_textfile, what="--metrics-textfile"))
            except ValueError as exc:
                late_errors.append(str(exc))
            except OSError as exc:  # checked before the run, but its temporary file has another name
                late_errors.append(f"--metrics-textfile: cannot write {args.metrics_textfile!r} "
                                   f"({exc.strerror or exc})")
        if args.metrics_port is not None:
            if args.metrics_linger > 0:
                sys.stdout.write("\n")  # the answer's line ends first: both may go to one terminal
                sys.stdout.flush()
                answer_ended.append(True)
                print(f"metrics: serving {args.metrics_linger:g} s more", file=sys.stderr)
                time.sleep(args.metrics_linger)
            stop_metrics(cache)

    def on_trace_error(exc: OSError) -> None:  # a full disk: the run, its answer and stats go on
        late_errors.append(f"--trace-out: cannot write {args.trace_out!r} ({exc.strerror or exc}); the trace "
                           f"is incomplete")

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.prefill_chunk < 1:
        raise CLIError(f"--prefill-chunk: must be >= 1, got {args.prefill_chunk}")
    for flag, value, default in (("--metrics-addr", args.metrics_addr, "127.0.0.1"),
                                 ("--metrics-linger", args.metrics_linger, 0.0)):
        # no endpoint: it did nothing, silently (a review); the default given explicitly does nothing either way
        if value is not None and value != default and args.metrics_port is None:
            raise CLIError(f"{flag}: {value} without --metrics-port would do nothing (no metrics endpoint is "
                           f"served); add --metrics-port PORT (0: any free port), or leave {flag} out")
    args.metrics_addr = "127.0.0.1" if args.metrics_addr is None else args.metrics_addr
    args.metrics_linger = 0.0 if args.metrics_linger is None else args.metrics_linger
    if not (math.isfinite(args.metrics_linger) and 0 <= args.metrics_linger <= 86400):  # inf: an OverflowError at the end
        raise CLIError(f"--metrics-linger: seconds in [0, 86400], got {args.metrics_linger}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise CLIError(f"--metrics-port: must be in [0, 65535] (0: any free port), got {args.metrics_port}")
    for flag, path in (("--trace-out", args.trace_out), ("--stats-json", args.stats_json)):
        if path:
            check_writable(flag, path)
    if args.metrics_textfile:
        check_writable("--metrics-textfile", args.metrics_textfile, replaced=True)
    check_distinct([("--prompt-file", args.prompt_file), ("--trace-out", args.trace_out),
                    ("--stats-json", args.stats_json), ("--metrics-textfile", args.metrics_textfile)])
    if args.metrics_port is not None:  # a port taken, an unknown address: now, not after the model loads
        from tiercache.metrics import check_endpoint

        check_endpoint(args.metrics_port, args.metrics_addr)
    if args.quiet:  # transformers' own "Loading weights" bar too
        _quiet_transformers()
    result = generate_text(prompt, cfg, model_path=args.model, max_new_tokens=args.max_new_tokens,
                           chat=not args.no_chat_template, prefill_chunk=args.prefill_chunk,
                           stream=sys.stdout, progress=not args.quiet, on_open=on_open, on_done=on_done,
                           trace_out=args.trace_out, on_trace_error=on_trace_error)
    if not answer_ended:
        print(file=sys.stdout)
    if not args.quiet:
        print(stats_table(result["stats"], result["seconds"]), file=sys.stderr)
    if args.stats_json:
        try:
            with open(args.stats_json, "w", encoding="utf-8") as f:
                json.dump({"stats": result["stats"], "attention": result["attention"], "seconds": result["seconds"],
                           "text": result["text"]}, f, indent=2)
        except OSError as exc:  # checked before the run; the disk may have filled since
            late_errors.append(f"--stats-json: cannot write {args.stats_json!r} ({exc.strerror or exc})")
    if late_errors:
        raise CLIError("; ".join(late_errors))
    return 0


def check_writable(flag: str, path: str, replaced: bool = False) -> None:
    """Fail before any slow work when an output file cannot be written. A file that exists
    is opened for appending (its bytes untouched; a pipe or a device is not opened, only its
    permission checked); a new one is made and removed again (through a symlink: the file it
    points to). Permission bits alone do not tell: root may write anywhere by them, yet not
    make a file in /proc. ``replaced``: the writer makes a temporary file next to ``path``
    and renames it over it (prometheus' ``write_to_textfile``), so the folder is probed,
    and anything there but a regular file (a device node, a FIFO, a directory) is refused:
    the rename would replace it (``tiercache.metrics.textfile_target``)."""
    if replaced:
        from tiercache.metrics import textfile_target

        try:
            textfile_target(path, what=flag)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    try:
        st = os.stat(path)  # follows links, /proc's own too: /dev/stdout on a pipe has no real path
    except OSError:
        st = None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        if not os.access(path, os.W_OK):  # a device, a FIFO, a pipe: written in place, never made
            raise CLIError(f"{flag}: cannot write {path!r} (permission denied)")
        return
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise CLIError(f"{flag}: {path!r} is a directory")
    if not os.path.isdir(folder):  # a file where the folder should be is not a missing folder
        what = "is not a folder" if os.path.exists(folder) else "missing"
        raise CLIError(f"{flag}: cannot write {path!r} (folder {folder!r} {what})")
    try:
        if replaced:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".tiercache-probe-"):
                pass
        elif os.path.exists(target):
            if stat.S_ISREG(os.stat(target).st_mode):
                with open(target, "a", encoding="utf-8"):
                    pass
            elif not os.access(target, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        else:
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:  # made meanwhile by someone else: theirs, left alone
                return
            os.close(fd)
            os.unlink(target)  # made here a moment ago (O_EXCL): nobody else's
    except OSError as exc:
        raise CLIError(f"{flag}: cannot write {path!r} ({exc.strerror or exc})") from None


def check_distinct(files: list) -> None:
    """CLIError, before any slow work, when two of ``files`` (``(flag, path)`` pairs; a path of
    None: the flag not given) name the same file: one output was written over the other
    (``--trace-out`` and ``--stats-json`` on one file kept the stats alone), or an output over
    the prompt it was read from. The same file: the same path once links are resolved
    (``os.path.realpath``), or, where it exists, the same file by another name (a hard link,
    ``os.path.samefile``). A device or a FIFO may take two outputs (``/dev/null`` for both):
    each is written to it in turn, nothing is replaced."""
    given = [(flag, path) for flag, path in files if path]
    for i, (flag, path) in enumerate(given):
        for other_flag, other in given[i + 1:]:
            if flag in _INPUT_FLAGS and other_flag in _INPUT_FLAGS:
                continue  # two inputs: nothing is written
            if _same_file(path, other):
                both = repr(path) if path == other else f"{path!r} and {other!r}"
                what = {"--prompt-file": "the prompt"}.get(flag, "the file it reads" if flag in _INPUT_FLAGS
                                                            else "the other")
                raise CLIError(f"{flag} and {other_flag} name the same file ({both}): {other_flag} would overwrite "
                               f"{what}; give each its own file")


_INPUT_FLAGS = frozenset({"--prompt-file", "--trace", "--io-json", "--text-file"})  # read, never written


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` are one regular file, or one path where none is yet."""
    try:
        st = os.stat(a)  # follows links, /proc's own too (/dev/stdout on a pipe: no real path)
    except OSError:  # not there yet: made at that path, by both
        return os.path.realpath(a) == os.path.realpath(b)
    if not stat.S_ISREG(st.st_mode):  # a device, a FIFO, a pipe: written in turn (a directory is refused elsewhere)
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:  # ``b`` not there: another file
        return False


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag or value as one line (the problem, then where the usage is):
    argparse printed the whole usage, 21 lines for ``generate``, before the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def doc_summary(doc: Optional[str]) -> str:
    """A module docstring's first paragraph on one line: a command's ``--help`` description
    (its first line alone stopped mid-sentence where the paragraph wraps)."""
    return " ".join((doc or "").strip().split("\n\n", 1)[0].split())


def work_dir(flag: str, path: Optional[str]) -> Optional[str]:
    """A benchmark's work directory: ``path`` must be an existing directory that a folder can
    be made in (None: the benchmark picks one). Else CLIError, before any work, not an
    OSError from deep inside. A folder is made and removed again: permission bits alone do
    not tell (root passes them, yet makes nothing in /proc or /sys)."""
    if path is None:
        return path
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise CLIError(f"{flag}: {path!r} {what}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tiercache-probe-", dir=path))
    except OSError as exc:
        raise CLIError(f"{flag}: cannot make a folder in {path!r} ({exc.strerror or exc})") from None
    return path


def require_extra(flag: str, *modules: str, alternative: str = "") -> None:
    """CLIError, before any slow work, when an optional package of the ``[lab]`` extra
    (libcachesim, matplotlib) cannot be imported: it was an ImportError traceback at the end
    of a run. ``alternative``: how to do without it, appended to the message."""
    missing = []
    for name in modules:
        try:  # the package first: a submodule imported before is found even with the package gone
            importlib.import_module(name.split(".")[0])
            importlib.import_module(name)
        except ImportError:
            missing.append(name.split(".")[0])
    if missing:
        raise CLIError(f"{flag}: needs {' and '.join(missing)}, which is not installed; install it with "
                       f"pip install 'tiercache[lab]'{alternative}")


def model_positions(config: Any) -> Optional[int]:
    """The model's positions (``max_position_embeddings``; None: no limit known), as
    ``generate`` and ``eval`` read them."""
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


WORKER_ERROR = "error"  # a benchmark worker's JSON line: {"error": "..."}, its one-line failure


def worker_failure(stdout: str) -> Optional[str]:
    """The one-line error a benchmark worker printed as its last stdout line (``WORKER_ERROR``)
    when it stopped on bad input (a TierCacheError or ValueError), else None."""
    lines = stdout.strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not isinstance(last, dict) or WORKER_ERROR not in last:
        return None
    return " ".join(str(last[WORKER_ERROR]).split())  # one line, whatever the message held


def split_list(flag: str, text: str) -> list:
    return no_repeats(flag, _items(flag, text), text)


def _items(flag: str, text: str) -> list:
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise CLIError(f"{flag}: give a comma-separated list, got {text!r}")
    if "" in items:  # '128,,256' was 128 and 256 without a word: a typo the run would hide
        raise CLIError(f"{flag}: an empty item in {text!r}")
    return items


def no_repeats(flag: str, values: list, text: str) -> list:
    """``values`` (parsed from ``text``, given to ``flag``), refused where one comes twice: the
    same runs were made twice and counted twice (eval passkey's n doubled and its interval
    narrowed; a review), or shown as two rows."""
    seen: set = set()
    for value in values:
        if value in seen:
            raise CLIError(f"{flag}: {value!r} is given twice in {text!r}")
        seen.add(value)
    return values


def cmd_compare(args: argparse.Namespace) -> int:
    from tiercache.config import parse_bytes
    from tiercache.lab import compare as lab
    from tiercache.lab.sim import check_host_budget
    from tiercache.lab.trace import load_trace
    from tiercache.policies import EVICTION_POLICIES

    policies = split_list("--policies", args.policies) if args.policies else sorted(EVICTION_POLICIES)
    prefetches = split_list("--prefetch-policies", args.prefetch_policies)
    libcsim = [] if args.libcachesim == "none" else split_list("--libcachesim", args.libcachesim)
    lab.check_names(policies, prefetches, libcsim)
    if libcsim:  # the default: all of libCacheSim's reference algorithms
        require_extra("--libcachesim", "libcachesim", alternative=", or pass --libcachesim none")
    if args.plot:
        require_extra("--plot", "matplotlib.backends.backend_agg")
    try:
        budgets = (no_repeats("--budgets", [parse_bytes(b, "--budgets") for b in split_list("--budgets", args.budgets)],
                              args.budgets) if args.budgets else None)
        host_budget = None if args.lab_host_budget is None else parse_bytes(args.lab_host_budget, "--lab-host-budget")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for budget in budgets or ():  # 0: every row skipped and exit 0 (libCacheSim's own check came after the replay)
        if not 0 < budget < 1 << 63:
            raise CLIError(f"--budgets: every budget must be > 0 bytes and < 2**63, got {budget} bytes "
                           f"(from {args.budgets!r})")
    for flag, path in (("--plot", args.plot), ("--trace-out", args.trace_out)):
        if path:
            check_writable(flag, path)
    # --plot over --trace: the trace lost; --trace-out is written only when compare records a trace
    check_distinct([("--trace", args.trace), ("--io-json", args.io_json), ("--prompt-file", args.prompt_file),
                    ("--trace-out", args.trace_out if args.trace is None else None), ("--plot", args.plot)])
    model = tokenizer = prompt = None
    trace_path = args.trace
    if trace_path is None:
        if args.prompt is None and args.prompt_file is None:
            raise CLIError("compare needs --trace FILE, or --prompt-file FILE (or --prompt TEXT) to record one")
        if args.max_new_tokens < 1:  # before the model loads: a trace needs decode steps
            raise CLIError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
        from tiercache.models import load_model

        prompt = read_prompt(args)
        cfg = config_from_args(args)
        model, tokenizer = load_model(args.model)
        trace_path = args.trace_out or os.path.join(tempfile.mkdtemp(prefix="tiercache-trace-"), "trace.csv")
        print(f"recording a trace of {args.max_new_tokens} new tokens to {trace_path}", file=sys.stderr)
        lab.record_trace(prompt, cfg, trace_path, max_new_tokens=args.max_new_tokens,
                         chat=not args.no_chat_template, model=model, tokenizer=tokenizer, progress=not args.json)
    elif args.live:
        raise CLIError("--live runs the model: give --prompt-file (or --prompt) instead of --trace")
    trace = load_trace(trace_path)
    try:
        check_host_budget(host_budget, trace.block_bytes, "--lab-host-budget")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if budgets is None:
        budgets = default_budgets(trace)
    if args.io_json is None:  # the link rates are measured there: a missing one was a traceback
        work_dir("--disk-dir", args.disk_dir)
    bandwidths = lab.load_bandwidths(args.io_json, args.disk_dir)
    report = lab.compare_trace(trace, policies, budgets, prefetches=tuple(prefetches), host_budget=host_budget,
                               bandwidths=bandwidths, libcachesim=tuple(libcsim))
    if not report["results"]:  # every budget under what the trace needs: a table of skips and exit 0 answered nothing
        least = min((s["min_budget_bytes"] for s in report["skipped"] if s.get("min_budget_bytes")), default=0)
        # ``least``: what the first step that failed needed; a later step may need more
        raise CLIError(f"--budgets: no policy can replay {report['label']} at "
                       f"{', '.join(format_bytes(b) for b in budgets)}; it needs at least "
                       f"{format_bytes(least)} ({least} bytes)")
    if args.live:
        base = config_from_args(args)
        report["live"] = lab.live_runs(prompt, base, policies, budgets, tuple(prefetches), model=model,
                                       tokenizer=tokenizer, max_new_tokens=args.max_new_tokens,
                                       chat=not args.no_chat_template,
                                       log=None if args.json else lambda m: print(m, file=sys.stderr))
    if args.plot:
        from tiercache.lab.plot import plot_hit_ratio

        plot_hit_ratio(report["results"], args.plot, title=f"device hit ratio, {report['label']}")
    if args.json:
        print(json.dumps(report))
    else:
        print(lab.table(report))
        for row in report.get("live", []):
            print(f"live {row['policy']}+{row['prefetch']} @ {format_bytes(row['budget_bytes'])}: " + (
                row["error"] if "error" in row else
                f"{row['decode_tps']:.2f} tok/s, stall {row['stall_seconds']:.2f} s, "
                f"{format_bytes(row['bytes_moved'])} moved"))
    return 0


def default_budgets(trace) -> list:
    """Six device budgets from one layer's blocks up to the whole trace's blocks."""
    import numpy as np

    distinct = len(np.unique(trace.obj_id))
    per_layer = -(-distinct // max(trace.num_layers, 1))
    steps = sorted({max(per_layer + 1, round(distinct * f)) for f in (0.1, 0.25, 0.4, 0.55, 0.75, 1.0)})
    return [n * trace.block_bytes for n in steps]


def cmd_demo(args: argparse.Namespace) -> int:
    from tiercache.demo import FIRST, LAST, run_demo

    most = len(FIRST) * len(LAST)  # distinct names
    if not 1 <= args.records <= most:
        raise CLIError(f"--records: must be in [1, {most}], got {args.records}")
    if args.disk_dir is not None:  # a regular file there was refused by the demo's TierConfig, after the model
        try:  # had loaded: the same TierConfig checks (and the store's) now; the budgets do not matter to them
            check_disk_tier(TierConfig(disk_dir=args.disk_dir, disk_budget="1MiB"))
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    return run_demo(records=args.records, disk_dir=args.disk_dir)


def int_list(flag: str, text: str, low: int, high: Optional[int] = None) -> list:
    """The integers of a comma list given to ``flag``, each in [low, high]; else CLIError."""
    values = []
    for item in _items(flag, text):
        try:
            value = int(item)
        except ValueError:
            raise CLIError(f"{flag}: {item!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise CLIError(f"{flag}: {value} must be {bound}")
        values.append(value)
    return no_repeats(flag, values, text)  # "050" and "50" too


# Each eval task's own flags (argparse dest: default): the other task's flags are refused,
# not silently ignored (`eval passkey --text-file F` ran on the generated haystack).
EVAL_TASK_FLAGS = {
    "passkey": {"contexts": "1024,2048,4096", "depths": "0,25,50,75,100", "trials": 1, "max_new_tokens": 8,
                "seed": 0},
    "fidelity": {"text_file": None, "context": 2048, "tokens": 128},
}


def _eval_task_flags(args: argparse.Namespace) -> None:
    """CLIError for a flag of the other eval task; the task's own flags get their defaults."""
    for task, flags in EVAL_TASK_FLAGS.items():
        for dest, default in flags.items():
            if getattr(args, dest) is None:
                setattr(args, dest, default)
            elif task != args.task:
                raise CLIError(f"--{dest.replace('_', '-')}: a flag of eval {task}; eval {args.task} does not use it")


def cmd_eval(args: argparse.Namespace) -> int:
    from tiercache import eval as ev

    _eval_task_flags(args)
    methods = split_list("--methods", args.methods)
    unknown = [m for m in methods if m not in ev.METHODS]
    if unknown:
        raise CLIError(f"--methods: unknown {', '.join(map(repr, unknown))}; known: {', '.join(ev.METHODS)}")
    budgets = int_list("--budgets", args.budgets, 1)
    if args.block_tokens < 1:
        raise CLIError(f"--block-tokens: must be >= 1, got {args.block_tokens}")
    if args.prefill_chunk < 1:
        raise CLIError(f"--prefill-chunk: must be >= 1, got {args.prefill_chunk}")
    ev.check_plan(methods, budgets, args.block_tokens)  # ValueError -> one line, exit 2
    if args.plot:
        require_extra("--plot", "matplotlib.backends.backend_agg")
        check_writable("--plot", args.plot)
        check_distinct([("--text-file", args.text_file), ("--plot", args.plot)])
    text = None
    if args.task == "passkey":
        contexts = int_list("--contexts", args.contexts, 64)
        depths = int_list("--depths", args.depths, 0, 100)
        if args.trials < 1:
            raise CLIError(f"--trials: must be >= 1, got {args.trials}")
        if args.max_new_tokens < 1:  # no answer token: every trial would read as a wrong answer
            raise CLIError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    else:
        if args.context < 1 or args.tokens < 2:
            raise CLIError(f"--context must be >= 1 and --tokens >= 2, got {args.context} and {args.tokens}")
        if args.text_file:
            try:
                with open(args.text_file, "rb") as f:
                    data = read_bounded(f, f"--text-file: {args.text_file!r}", "a text")
            except OSError as exc:
                raise CLIError(f"--text-file: cannot read {args.text_file!r} ({exc.strerror})") from None
            text = _utf8(data, f"--text-file: {args.text_file!r}")  # as --prompt-file: the flag, the file, the byte
    from tiercache.models import load_model

    if args.quiet:
        _quiet_transformers()
    model, tokenizer = load_model(args.model)
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr))
    if args.task == "passkey":
        report = ev.run_passkey(model, tokenizer, contexts=contexts, depths=depths, trials=args.trials,
                                methods=methods, budgets=budgets, block_tokens=args.block_tokens,
                                prefill_chunk=args.prefill_chunk, max_new_tokens=args.max_new_tokens,
                                seed=args.seed, log=log)
    else:
        report = ev.run_fidelity(model, tokenizer, text=text, context=args.context, tokens=args.tokens,
                                 methods=methods, budgets=budgets, block_tokens=args.block_tokens,
                                 prefill_chunk=args.prefill_chunk, log=log)
    if args.plot:
        ev.plot(report, args.plot)
    print(json.dumps(report) if args.json else ev.table(report))
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from tiercache import cache_admin as admin

    if args.action == "ls":
        infos = admin.list_prefix(args.disk_dir, args.model_digest)
        print(json.dumps({"disk_dir": args.disk_dir, "directories": admin.as_json(infos)}) if args.json
              else admin.format_list(args.disk_dir, infos))
    elif args.action == "stats":
        summary = admin.summarize(args.disk_dir, args.model_digest)
        print(json.dumps(summary) if args.json else admin.format_summary(summary))
    else:
        removed = admin.clear(args.disk_dir, args.model_digest)
        stale = admin.clear_stale_sessions(args.disk_dir)
        if args.json:
            print(json.dumps({"disk_dir": args.disk_dir, "removed": admin.as_json(removed),
                              "stale_sessions_removed": stale}))
            return 0
        if not removed:  # with --model-digest, one that matched nothing was refused (exit 2)
            print(f"no prefix cache in {args.disk_dir}; nothing removed")
        else:
            print(f"removed {len(removed)} prefix director{'y' if len(removed) == 1 else 'ies'} "
                  f"({sum(i.num_blocks for i in removed)} blocks, "
                  f"{format_bytes(sum(i.file_bytes for i in removed))}) from {args.disk_dir}")
        if stale:
            print(f"removed {len(stale)} session folder{'s' if len(stale) != 1 else ''} of processes that are gone")
    return 0


def cmd_bench(args: argparse.Namespace, rest: list) -> int:
    if args.what == "io":
        from tiercache.bench.io import run
    elif args.what == "decode":
        from tiercache.bench.decode import run
    elif args.what == "policies":
        from tiercache.bench.policies import run
    elif args.what == "faults":
        from tiercache.bench.faults import run
    elif args.what == "prefix":
        from tiercache.bench.prefix import run
    elif args.what == "overhead":
        from tiercache.bench.overhead import run
    else:  # pragma: no cover - argparse restricts choices
        raise CLIError(f"unknown benchmark {args.what!r}")
    return run(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tiercache", description="Tiered KV cache for long-context generation")
    # read by _plugin_options before parsing; here for --help
    parser.add_argument("--plugin", metavar="MODULE", action="append",
                        help="import MODULE (a module name, or a .py file) first: a plug-in that registers policies; "
                             "repeatable; TIERCACHE_PLUGINS=MOD1,MOD2 does the same")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the KV cache spread over the tiers")
    gen.add_argument("--model", default=None, help="local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None)
    src.add_argument("--prompt-file", default=None)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk size in tokens")
    gen.add_argument("--no-chat-template", action="store_true")
    gen.add_argument("--stats-json", default=None, help="write stats to this JSON file")
    gen.add_argument("--quiet", action="store_true", help="no progress bar or stats table")
    gen.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0: any)")
    gen.add_argument("--metrics-addr", default=None, help="metrics address (default 127.0.0.1: loopback only; "
                     "needs --metrics-port)")
    gen.add_argument("--metrics-linger", type=float, default=None, help="keep serving S seconds after the run "
                     "(needs --metrics-port)")
    gen.add_argument("--metrics-textfile", default=None, help="write the metrics text format here at the end")
    gen.add_argument("--trace-out", default=None, help="record every block access to this CSV file "
                     "(header time,obj_id,obj_size,...: libCacheSim's CSV reader replays it)")
    add_tier_args(gen)

    cmp_ = sub.add_parser("compare", help="compare eviction/prefetch policies on a block-access trace")
    cmp_.add_argument("--trace", default=None, help="a trace from `tiercache generate --trace-out`")
    cmp_.add_argument("--model", default=None, help="record a trace with this model (default SmolLM2-135M)")
    src = cmp_.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None)
    src.add_argument("--prompt-file", default=None)
    cmp_.add_argument("--max-new-tokens", type=int, default=32)
    cmp_.add_argument("--no-chat-template", action="store_true")
    cmp_.add_argument("--trace-out", default=None, help="keep the recorded trace here")
    cmp_.add_argument("--policies", default=None, help="runtime eviction policies (default: all registered)")
    cmp_.add_argument("--prefetch-policies", default="none,next-layer",
                      help="prefetch policies to replay with (default %(default)s)")
    cmp_.add_argument("--budgets", default=None, help="device budgets, e.g. 8MiB,16MiB (default: six "
                      "from one layer's blocks to all of them)")
    cmp_.add_argument("--lab-host-budget", default=None, help="host tier in the replay (default: holds "
                      "everything below the device; 0: no host tier)")
    cmp_.add_argument("--libcachesim", default=",".join(("lru", "fifo", "lfu", "arc", "s3fifo", "belady")),
                      help="libCacheSim algorithms to replay too, or 'none' (default %(default)s)")
    cmp_.add_argument("--io-json", default=None, help="link rates from `tiercache bench io --json` "
                      "(default: measure them now, ~10 s)")
    cmp_.add_argument("--json", action="store_true", help="print one JSON object")
    cmp_.add_argument("--plot", default=None, help="write a hit-ratio-vs-budget PNG here")
    cmp_.add_argument("--live", action="store_true", help="also run each policy for real (tokens/s, stall)")
    add_tier_args(cmp_)

    demo = sub.add_parser("demo", help="long-context needle-in-a-haystack job over all three tiers")
    demo.add_argument("--records", type=int, default=40)
    demo.add_argument("--disk-dir", default=None)

    bench = sub.add_parser("bench", help="benchmarks (io, decode, policies, faults, prefix, overhead); --help after "
                           "the name for options")
    bench.add_argument("what", choices=["io", "decode", "policies", "faults", "prefix", "overhead"])

    ev = sub.add_parser("eval", help="quality of selection/retention: passkey accuracy, fidelity to the full cache")
    ev.add_argument("task", choices=["passkey", "fidelity"])
    ev.add_argument("--methods", default="full,quest,streaming,h2o,tova,snapkv",
                    help="comma list of full, quest, streaming, h2o, tova, snapkv (default: all)")
    ev.add_argument("--budgets", default="128,256,512", help="tokens per layer (quest: per KV head) "
                    "(default %(default)s)")
    # each task's own flags: None here, so that one given to the other task is seen (EVAL_TASK_FLAGS)
    pk, fi = EVAL_TASK_FLAGS["passkey"], EVAL_TASK_FLAGS["fidelity"]
    ev.add_argument("--contexts", default=None, help=f"passkey: prompt tokens (default {pk['contexts']})")
    ev.add_argument("--depths", default=None, help=f"passkey: where the key sits, percent (default {pk['depths']})")
    ev.add_argument("--trials", type=int, default=None, help=f"passkey: keys per context and depth "
                    f"(default {pk['trials']})")
    ev.add_argument("--max-new-tokens", type=int, default=None, help=f"passkey: answer tokens "
                    f"(default {pk['max_new_tokens']})")
    ev.add_argument("--seed", type=int, default=None, help=f"passkey: seed of the keys (default {pk['seed']})")
    ev.add_argument("--text-file", default=None, help="fidelity: the long text, UTF-8 (default: a generated one)")
    ev.add_argument("--context", type=int, default=None, help=f"fidelity: tokens prefilled (default {fi['context']})")
    ev.add_argument("--tokens", type=int, default=None, help=f"fidelity: tokens scored, teacher-forced "
                    f"(default {fi['tokens']})")
    ev.add_argument("--block-tokens", type=int, default=32, help="page size: tokens per block (default 32)")
    ev.add_argument("--prefill-chunk", type=int, default=1024)
    ev.add_argument("--model", default=None, help="local Hugging Face model folder (default SmolLM2-135M)")
    ev.add_argument("--json", action="store_true", help='print {"results": [...]} as JSON')
    ev.add_argument("--plot", default=None, help="write accuracy (or KL) against budget to this PNG")
    ev.add_argument("--quiet", action="store_true", help="no per-sample lines on stderr")

    cache = sub.add_parser("cache", help="the persistent prefix cache in a disk_dir: ls, stats, clear")
    cache.add_argument("action", choices=["ls", "stats", "clear"], help="ls: one line per prefix directory; "
                       "stats: totals per model digest; clear: remove prefix directories")
    cache.add_argument("--disk-dir", required=True, help="the cache's disk_dir")
    cache.add_argument("--model-digest", default=None, help="only this model's prefix directories (hex digest "
                       "from `cache ls`, or a unique prefix of it); one that matches none is an error")
    cache.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C would be: ``finally`` blocks and context
    managers run (a benchmark's work folder, 1.6 GB for bench io, was left behind), and code
    that catches Exception does not swallow it."""


def _on_sigterm(signum: int, frame: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends it at once, cleanup or not
    raise Terminated()


@contextlib.contextmanager
def _sigterm_raises(command_line: bool) -> Iterator[None]:
    """Turn SIGTERM into ``Terminated`` for the command's run: only the command line's own
    process (``main()`` without argv), and only from the main thread, where Python runs
    signal handlers; a caller of ``main(argv)`` keeps its own handling. The default comes
    back when the command ends (a program that calls ``main()`` and goes on was left with
    the handler: a later SIGTERM raised in it instead of ending it)."""
    import signal
    import threading

    mine = command_line and threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if mine:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if mine:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: Optional[list] = None) -> int:
    with _sigterm_raises(argv is None):  # the command line itself (console script, python -m tiercache.cli)
        return _main(argv)


def _main(argv: Optional[list]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        specs, argv = _plugin_options(argv)
    except CLIError as exc:
        parser.error(str(exc))
    if argv[:1] == ["bench"] and len(argv) > 1 and not argv[1].startswith("-"):
        args, rest = parser.parse_args(argv[:2]), argv[2:]
    else:
        args, rest = parser.parse_args(argv), []
    return _run(args, rest, specs)


def _plugin_options(argv: list) -> tuple:
    """The leading ``--plugin MODULE`` options (before the command), and the rest of ``argv``.
    Taken apart here: the commands' own parsers (``bench``'s) never see them."""
    specs = []
    while argv and (argv[0] == "--plugin" or argv[0].startswith("--plugin=")):
        if argv[0] == "--plugin":
            if len(argv) < 2 or argv[1].startswith("-"):
                raise CLIError("--plugin: expected a module name or the path of a .py file")
            specs.append(argv[1])
            argv = argv[2:]
        else:
            specs.append(argv[0].split("=", 1)[1])
            argv = argv[1:]
    if any(not spec.strip() or "," in spec for spec in specs):
        raise CLIError(f"--plugin: one module per --plugin, got {next(s for s in specs if not s.strip() or ',' in s)!r}")
    return specs, argv


@contextlib.contextmanager
def _plugins(specs: list):
    """The plug-in modules of ``TIERCACHE_PLUGINS`` and ``--plugin`` imported; while the
    command runs, ``TIERCACHE_PLUGINS`` names them all, for the processes it starts."""
    from tiercache import plugins

    plugins.load(plugins.specs_from_env(), source=plugins.ENV)
    plugins.load(specs)
    if not specs:
        yield
        return
    before = os.environ.get(plugins.ENV)
    os.environ[plugins.ENV] = ",".join(dict.fromkeys(plugins.specs_from_env() + specs))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(plugins.ENV, None)
        else:
            os.environ[plugins.ENV] = before


def _run(args: argparse.Namespace, rest: list, plugin_specs: list) -> int:
    try:
        with _plugins(plugin_specs):
            return _command(args, rest)
    except (CLIError, TierCacheError, ValueError) as exc:
        print(f"tiercache: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader went away (`| head`): stop quietly, as Unix tools do
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        except (OSError, ValueError):
            pass
        return 128 + 13  # what a shell reports for a tool killed by SIGPIPE
    except Terminated:  # the cleanup ran on the way here
        print("tiercache: terminated (SIGTERM)", file=sys.stderr)
        return 128 + 15
    except KeyboardInterrupt:
        print("tiercache: interrupted", file=sys.stderr)
        return 130


def _command(args: argparse.Namespace, rest: list) -> int:
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "demo":
        return cmd_demo(args)
    if args.command == "compare":
        return cmd_compare(args)
    if args.command == "cache":
        return cmd_cache(args)
    if args.command == "eval":
        return cmd_eval(args)
    return cmd_bench(args, rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
