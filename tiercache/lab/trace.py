"""Block-access traces: one CSV row per block that a forward pass wrote or attention read.

The header starts ``time,obj_id,obj_size`` so that libCacheSim's CSV reader replays the file
as it is; the extra columns let tiercache's own replay rebuild the layer structure.

    time      microseconds of compute since the run began (time spent waiting for blocks is
              left out, so a replay can add its own stall estimate)
    obj_id    (seq << 40) | (layer << 24) | block
    obj_size  bytes of the block (all batch rows)
    op        "write" (new tokens went into the block) or "read" (attention read it)
    seq, layer, block   the block key
    step      index of the forward pass; tokens: new tokens that forward processed
    score     attention mass the block received at that read (empty unless recorded)
"""
from __future__ import annotations

import csv
import io
import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

HEADER = ("time", "obj_id", "obj_size", "op", "seq", "layer", "block", "step", "tokens", "score")
_LAYER_BITS, _BLOCK_BITS = 16, 24
MAX_BLOCK_BYTES = 1 << 40  # obj_size: a block of up to 1 TiB


def obj_id(seq: int, layer: int, block: int) -> int:
    """The trace's object id of block ``block`` of ``layer`` in sequence ``seq``."""
    if not (0 <= layer < 1 << _LAYER_BITS and 0 <= block < 1 << _BLOCK_BITS and 0 <= seq < 1 << 23):
        raise ValueError(f"block key out of the trace's id range: seq={seq} layer={layer} block={block}")
    return (seq << (_LAYER_BITS + _BLOCK_BITS)) | (layer << _BLOCK_BITS) | block


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the file and the problem."""


class TraceWriter:
    """Appends access rows to a CSV file; buffered, flushed on ``close``.

    ``defer_errors``: a write that fails (a full disk) does not raise; the first OSError is
    kept in ``error``, the file is closed and later rows are dropped, so the run being
    traced goes on, and its caller reports ``error`` once the run's other outputs are out.
    Without it the OSError is raised by the write (by ``close`` for the last rows), as
    before; the file is closed either way."""

    def __init__(self, path: str, defer_errors: bool = False) -> None:
        self.path = path
        self.defer_errors = defer_errors
        self.error: Optional[OSError] = None
        try:
            self._file = open(path, "w", encoding="ascii", newline="")
        except OSError as exc:
            raise TraceError(f"trace: cannot write {path!r} ({exc.strerror})") from None
        self._buf = io.StringIO()
        self._write(",".join(HEADER) + "\n")
        self._t0 = time.perf_counter()
        self._waited = 0.0
        self._last = 0
        self.rows = 0

    def waited(self, seconds: float) -> None:
        """Time spent waiting for blocks: kept out of the ``time`` column."""
        self._waited += seconds

    def now_us(self) -> int:
        # waits are reported after the fact, so a wait that began before the last reading
        # could move the clock back: it never goes backwards
        self._last = max(self._last, int((time.perf_counter() - self._t0 - self._waited) * 1e6))
        return self._last

    def record(self, op: str, keys: Iterable, size: int, step: int, tokens: int,
               scores: Optional[dict] = None, t_us: Optional[int] = None) -> None:
        if self.error is not None:  # the file failed: it is incomplete whatever comes now
            if not self.defer_errors:  # the same error again, not one of writing to a closed file
                raise self.error
            return
        t = self.now_us() if t_us is None else t_us
        w = self._buf.write
        for key in keys:
            seq, layer, block = key
            score = "" if scores is None or key not in scores else f"{scores[key]:.6g}"
            w(f"{t},{obj_id(seq, layer, block)},{size},{op},{seq},{layer},{block},{step},{tokens},{score}\n")
            self.rows += 1
        if self._buf.tell() > 1 << 20:
            text, self._buf = self._buf.getvalue(), io.StringIO()
            self._write(text)

    def _write(self, text: str) -> None:
        try:
            self._file.write(text)
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """A write failed: the file is closed (its flush fails again, and closes it all the
        same), then ``exc`` is raised, or kept in ``error`` (``defer_errors``)."""
        try:
            self._file.close()
        except OSError:
            pass
        if self.error is None:
            self.error = exc
        if not self.defer_errors:
            raise exc

    def close(self) -> None:
        if self._file.closed:  # closed before, or at a failed write
            return
        text, self._buf = self._buf.getvalue(), io.StringIO()
        try:
            self._file.write(text)
            self._file.close()  # the last buffered bytes: a full disk shows here
        except OSError as exc:
            self._failed(exc)


@dataclass
class Trace:
    """A loaded trace, one numpy array per column (``score`` is NaN where not recorded)."""

    path: str
    time_us: np.ndarray
    obj_id: np.ndarray
    obj_size: np.ndarray
    is_write: np.ndarray
    seq: np.ndarray
    layer: np.ndarray
    block: np.ndarray
    step: np.ndarray
    tokens: np.ndarray
    score: np.ndarray

    def __len__(self) -> int:
        return len(self.obj_id)

    @property
    def num_layers(self) -> int:
        return int(self.layer.max()) + 1 if len(self) else 0

    @property
    def block_bytes(self) -> int:
        return int(self.obj_size.max()) if len(self) else 0

    @property
    def total_tokens(self) -> int:
        """New tokens over all forward passes (each step counted once)."""
        if not len(self):
            return 0
        _, first = np.unique(self.step, return_index=True)
        return int(self.tokens[first].sum())

    @property
    def has_scores(self) -> bool:
        return bool(np.isfinite(self.score).any())


def _check_rows(path: str, ints: dict) -> None:
    """What a replay relies on, refused by name: before, a header-only trace was a
    ZeroDivisionError, and negative sizes, object ids that are not the row's key, or blocks
    of several sizes replayed into figures that looked fine and meant nothing."""
    n = len(ints["time"])
    if not n:
        raise TraceError(f"{path}: the trace has no rows (a header only)")
    if (np.diff(ints["time"]) < 0).any():
        raise TraceError(f"{path}: the time column goes backwards")
    for name in ("obj_size", "seq", "layer", "block", "step", "tokens"):
        bad = np.flatnonzero(ints[name] < (1 if name == "obj_size" else 0))
        if len(bad):
            raise TraceError(f"{path}: line {bad[0] + 2}: {name} {ints[name][bad[0]]} is "
                             f"{'not positive' if name == 'obj_size' else 'negative'}")
    # The key's fields within obj_id's bit ranges (two keys shared one id past them: layer
    # 65536 of seq 0 was layer 0 of seq 1 to libCacheSim), and a block size whose budgets fit
    # libCacheSim's int64 (a size of 2^62 overflowed them, and it aborted the process).
    for name, most in (("seq", (1 << 23) - 1), ("layer", (1 << _LAYER_BITS) - 1),
                       ("block", (1 << _BLOCK_BITS) - 1), ("obj_size", MAX_BLOCK_BYTES)):
        bad = np.flatnonzero(ints[name] > most)
        if len(bad):
            raise TraceError(f"{path}: line {bad[0] + 2}: {name} {ints[name][bad[0]]} is more than {most}, "
                             f"the most a trace holds")
    sizes = np.unique(ints["obj_size"])
    if len(sizes) > 1:
        raise TraceError(f"{path}: blocks of {len(sizes)} sizes ({', '.join(map(str, sizes[:4]))}): one trace "
                         f"is one run's blocks, of one size")
    want = (ints["seq"] << (_LAYER_BITS + _BLOCK_BITS)) | (ints["layer"] << _BLOCK_BITS) | ints["block"]
    bad = np.flatnonzero(want != ints["obj_id"])
    if len(bad):
        raise TraceError(f"{path}: line {bad[0] + 2}: obj_id {ints['obj_id'][bad[0]]} is not "
                         f"seq<<40 | layer<<24 | block ({want[bad[0]]})")


def load_trace(path: str) -> Trace:
    """Read a trace written by ``TraceWriter``; raise ``TraceError`` naming the problem."""
    try:
        with open(path, encoding="ascii", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or tuple(header[:3]) != HEADER[:3]:
                raise TraceError(f"{path}: not a tiercache trace (the first line must start with "
                                 f"'time,obj_id,obj_size', got {','.join(header or [])[:60]!r})")
            missing = [c for c in HEADER[:9] if c not in header]
            if missing:
                raise TraceError(f"{path}: trace lacks the column(s) {', '.join(missing)} that a "
                                 f"replay needs; record it with `tiercache generate --trace-out`")
            col = {name: header.index(name) for name in HEADER if name in header}
            rows = list(reader)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path!r} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a tiercache trace (not ASCII text)") from None
    n = len(rows)
    ints = {name: np.empty(n, dtype=np.int64) for name in ("time", "obj_id", "obj_size", "seq", "layer",
                                                             "block", "step", "tokens")}
    is_write = np.empty(n, dtype=bool)
    score = np.full(n, np.nan)
    for i, row in enumerate(rows):
        if not row:
            raise TraceError(f"{path}: line {i + 2} is blank")
        try:
            for name, arr in ints.items():
                text = row[col[name]]
                # digits only: int() also took '4_096' and ' 12', which libCacheSim's reader,
                # replaying the same file, reads as 4 and 0
                if not (text.isdigit() or (text[:1] == "-" and text[1:].isdigit())):
                    raise ValueError(f"{name} {text!r} is not a plain integer")
                arr[i] = int(text)
            op = row[col["op"]]
            if op not in ("read", "write"):
                raise ValueError(f"op {op!r}")
            is_write[i] = op == "write"
            if "score" in col and col["score"] < len(row) and row[col["score"]]:
                score[i] = float(row[col["score"]])
        except (ValueError, IndexError, OverflowError) as exc:  # Overflow: past int64
            raise TraceError(f"{path}: line {i + 2} is malformed ({exc})") from None
    _check_rows(path, ints)
    return Trace(path=os.fspath(path), time_us=ints["time"], obj_id=ints["obj_id"], obj_size=ints["obj_size"],
                 is_write=is_write, seq=ints["seq"], layer=ints["layer"], block=ints["block"],
                 step=ints["step"], tokens=ints["tokens"], score=score)
