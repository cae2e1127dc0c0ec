"""Replay a tiercache block-access trace through libCacheSim's reference policies.

The trace is our CSV (header ``time,obj_id,obj_size,op,seq,layer,block,step,tokens``);
every row is one request. libCacheSim reads the original file with its own CSV
reader: fields are numbered from 1, columns it is not told about are skipped, so
only ``time``, ``obj_id`` and ``obj_size`` are handed over. ``op`` is deliberately
not: a write is a request like a read here.

Belady needs each request's next access time, which a CSV trace does not carry.
libCacheSim's own converter (``Util.convert_to_oracleGeneral``) reads the CSV
through the same reader and writes an oracleGeneral binary copy with the next
access filled in; Belady replays that copy from a temporary directory. Belady
here is demand-paging MIN (every miss is inserted): optimal for equal-sized
blocks, not necessarily when sizes differ.

libcachesim is imported only inside :func:`replay_libcachesim`
(``pip install 'tiercache[lab]'``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


# Our policy name -> libcachesim class name (resolved on use, so importing this
# module does not import libcachesim).
LIBCACHESIM_ALGORITHMS: dict[str, str] = {
    "lru": "LRU",
    "fifo": "FIFO",
    "lfu": "LFU",
    "arc": "ARC",
    "s3fifo": "S3FIFO",
    "belady": "Belady",
}

# Columns libCacheSim needs, located by name in the header.
_REQUIRED_COLUMNS = ("time", "obj_id", "obj_size")


# libCacheSim's S3-FIFO gives its small FIFO 10% of the bytes: under 10 blocks that holds
# no block, every request misses, and below 10 bytes it aborts the process.
S3FIFO_MIN_BLOCKS = 10


def replay_libcachesim(
    trace_path: str | os.PathLike, algorithms: list[str], budgets: list[int],
    skipped: Optional[list] = None,
) -> list[dict]:
    """Run each libCacheSim algorithm at each byte budget over a trace.

    Args:
        trace_path: CSV trace with a header naming ``time``, ``obj_id`` and
            ``obj_size`` (further columns are ignored).
        algorithms: names from :data:`LIBCACHESIM_ALGORITHMS`.
        budgets: cache sizes in bytes, each > 0 and < 2**63.
        skipped: where the (algorithm, budget) pairs libCacheSim cannot replay go, one
            dict each (``policy``, ``prefetch``, ``budget_bytes``, ``reason``): budgets
            under one block, and S3-FIFO's under ``S3FIFO_MIN_BLOCKS`` blocks (0 hits
            whatever the trace). Without it, such a pair is a ValueError.

    Returns:
        One dict per (algorithm, budget), algorithms outer, with keys ``policy``
        (``"libcachesim:<name>"``), ``budget_bytes``, ``requests``, ``hits``,
        ``hit_ratio`` and ``bytes_missed`` (sum of ``obj_size`` over misses).

    Example:
        >>> replay_libcachesim("trace.csv", ["lru", "belady"], [64 << 20])  # doctest: +SKIP
        [{'policy': 'libcachesim:lru', 'budget_bytes': 67108864, ...}, ...]
    """
    _check_names(algorithms)
    for budget_bytes in budgets:
        if not 0 < int(budget_bytes) < 1 << 63:  # past int64: libCacheSim's C overflows, or aborts
            raise ValueError(f"budgets: every budget must be > 0 bytes and < 2**63, got {budget_bytes!r}")
    trace_path = Path(trace_path)
    # libCacheSim aborts the whole process on a missing file, so check first.
    if not trace_path.is_file():
        raise FileNotFoundError(f"trace not found: {trace_path}")
    fields = _field_numbers(trace_path)

    try:
        import libcachesim
    except ImportError as err:
        raise ImportError(
            "replay_libcachesim needs libCacheSim; install it with "
            "`pip install 'tiercache[lab]'`"
        ) from err

    params = libcachesim.ReaderInitParam(has_header=True, has_header_set=True, delimiter=",")
    params.time_field = fields["time"]
    params.obj_id_field = fields["obj_id"]
    params.obj_size_field = fields["obj_size"]
    reader = libcachesim.TraceReader(str(trace_path), libcachesim.TraceType.CSV_TRACE, params)

    # process_trace only returns miss ratios; one pass gives the totals to turn
    # them back into counts.
    num_requests = 0
    requested_bytes = 0
    largest = 0
    for req in reader:
        num_requests += 1
        requested_bytes += req.obj_size
        largest = max(largest, req.obj_size)
    if num_requests == 0:
        # libCacheSim's oracle converter aborts the process on an empty trace.
        raise ValueError(f"trace has no requests: {trace_path}")
    runnable = {name: _runnable(name, budgets, largest, skipped) for name in algorithms}

    def run(name: str, trace_reader, budget_bytes: int) -> dict:
        cache_cls = getattr(libcachesim, LIBCACHESIM_ALGORITHMS[name])
        cache = cache_cls(int(budget_bytes))
        miss_ratio, byte_miss_ratio = cache.process_trace(trace_reader)
        num_hits = round(num_requests * (1.0 - miss_ratio))
        return {
            "policy": f"libcachesim:{name}",
            "budget_bytes": int(budget_bytes),
            "requests": num_requests,
            "hits": num_hits,
            "hit_ratio": num_hits / num_requests,
            "bytes_missed": round(requested_bytes * byte_miss_ratio),
        }

    results_by_name: dict[str, list[dict]] = {}
    online = [name for name in algorithms if name != "belady"]
    for name in online:
        results_by_name[name] = [run(name, reader, b) for b in runnable[name]]

    if "belady" in algorithms:
        results_by_name["belady"] = []
    if runnable.get("belady"):
        with tempfile.TemporaryDirectory(prefix="tiercache-oracle-") as tmp:
            oracle_path = os.path.join(tmp, "trace.oracleGeneral")
            with _quiet_stderr():  # the converter logs INFO lines from C on fd 2
                libcachesim.Util.convert_to_oracleGeneral(reader._reader, oracle_path)
            oracle = libcachesim.TraceReader(
                oracle_path, libcachesim.TraceType.ORACLE_GENERAL_TRACE
            )
            results_by_name["belady"] = [run("belady", oracle, b) for b in runnable["belady"]]
            # Dropping the reader closes its file; TraceReader.close() would make
            # the destructor free it a second time (libcachesim 0.3.5 aborts).
            del oracle

    return [row for name in dict.fromkeys(algorithms) for row in results_by_name[name]]


def _runnable(name: str, budgets: list[int], block_bytes: int, skipped: Optional[list]) -> list[int]:
    """The budgets ``name`` can replay with blocks of ``block_bytes``; the others are noted
    in ``skipped`` (or, without it, raise ValueError)."""
    least = block_bytes * (S3FIFO_MIN_BLOCKS if name == "s3fifo" else 1)
    out = []
    for budget in budgets:
        if int(budget) >= least:
            out.append(int(budget))
            continue
        reason = (f"libCacheSim's S3-FIFO needs {S3FIFO_MIN_BLOCKS} blocks ({least} bytes): its small FIFO, 10% "
                  f"of the budget, would hold no block" if name == "s3fifo" and int(budget) >= block_bytes
                  else f"a budget under one block ({block_bytes} bytes)")
        if skipped is None:
            raise ValueError(f"budgets: libcachesim:{name} at {budget} bytes: {reason}")
        skipped.append({"policy": f"libcachesim:{name}", "prefetch": "none", "budget_bytes": int(budget),
                        "reason": reason, "min_budget_bytes": least})
    return out


def _check_names(algorithms: list[str]) -> None:
    for name in algorithms:
        if name not in LIBCACHESIM_ALGORITHMS:
            known = ", ".join(sorted(LIBCACHESIM_ALGORITHMS))
            raise ValueError(f"unknown libCacheSim algorithm {name!r}; known: {known}")


def _field_numbers(trace_path: Path) -> dict[str, int]:
    """1-based field numbers (libCacheSim's convention) of the columns it reads."""
    with open(trace_path, encoding="utf-8") as f:
        header = f.readline().strip().split(",")
    missing = [c for c in _REQUIRED_COLUMNS if c not in header]
    if missing:
        raise ValueError(
            f"trace {trace_path} header {','.join(header)!r} lacks column(s) {missing}"
        )
    return {c: header.index(c) + 1 for c in _REQUIRED_COLUMNS}
