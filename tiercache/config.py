"""The one configuration object: a frozen, validated ``TierConfig``."""
from __future__ import annotations

import difflib
import errno
import inspect
import math
import numbers
import os
import re
import tempfile
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Optional, Union
from urllib.parse import parse_qsl, unquote, urlsplit

from tiercache.policies import (EVICTION_POLICIES, PREFETCH_POLICIES, RETENTION_POLICIES, SELECTION_POLICIES,
                                FullSelection, RegistryError, make_eviction, make_prefetch, make_retention, make_selection)

if TYPE_CHECKING:  # torch is imported where a device is checked, not with the config
    import torch

Budget = Union[int, str]

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50, "eib": 1 << 60,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4, "pb": 1000 ** 5, "eb": 1000 ** 6,
}  # up to EiB: the limit below is stated in it (and "1EiB" was a parse error; a review)
# The largest budget taken, in bytes: 1 EiB. More than any machine can address (x86-64 and
# arm64 map at most 2**57 bytes, 128 PiB, with 5-level page tables), and far enough below
# 2**63 - 1, the largest size a C int64 / off_t / ssize_t holds, that the pool sizes and file
# offsets computed from a budget stay in range. A larger one (a 400-digit number) raised
# OverflowError from inside the parser or torch; it is refused here, by field.
MAX_BUDGET = 1 << 60
_MAX_BUDGET_TEXT = "1 EiB (2**60 bytes)"
_MAX_BUDGET_DIGITS = len(str(MAX_BUDGET))  # a whole part with more digits is past MAX_BUDGET in any unit
# A fractional part with more significant digits is whole bytes in no unit: a unit holds at
# most 2**60 (EiB) or 10**18 (EB), which clear at most 60 decimal places. In a unit, the
# digits past them are far below a byte (dropped); in bytes, they are refused.
_MAX_FRACTION_DIGITS = 60
# sign, whole part, fractional part, unit
_BUDGET_RE = re.compile(r"^\s*(-?)([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*$")
DIRECT_IO_MODES = ("auto", "on", "off")
AUTO = "auto"  # ``prefetch``: the policy that suits the store (``TieredCache``)
# The prefetch settings that read ``prefetch_depth``: TieredCache builds ``lookahead`` with it
# (``_set_prefetch``), and ``auto`` picks lookahead where disk blocks stream into attention;
# none, next-layer, history and plug-ins are built without it.
PREFETCH_DEPTH_POLICIES = ("lookahead", AUTO)
_DEFAULT_PREFETCH_DEPTH = 2  # TierConfig.prefetch_depth's default: any other needs one of the above
DISK_IO_BACKENDS = ("auto", "posix", "kvikio")
REUSE_ADMISSIONS = ("always", "reused")  # the first is TierConfig.reuse_admission's default
REMOTE_SCHEMES = ("redis", "rediss", "unix")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
REMOTE_ENV_USERNAME = "TIERCACHE_REMOTE_USERNAME"
REMOTE_ENV_PASSWORD = "TIERCACHE_REMOTE_PASSWORD"


def redact_url(url: Optional[str]) -> Optional[str]:
    """``url`` with its password replaced by ``***`` (for logs, stats and errors)."""
    if not url:
        return url
    # From the raw text, not urlsplit: a password with '/', '?' or '#' in it (not
    # percent-encoded) cuts urlsplit's netloc short, and it found no password to hide; and a
    # port that does not parse must not make this raise (it is called from error paths).
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # redis-py also takes a password from the query (?password=..., the usual way with
    # unix://). Those values go first, wherever a query could start: an '@' in one of them
    # was then taken for the user-info's, and the whole password showed (a review).
    rest = _OPTION_RE.sub(lambda m: m.group(1) + m.group(2) + "=***" if _secret_option(m.group(2)) else m.group(0),
                          rest)
    at = rest.rfind("@")
    if at >= 0 and ":" in rest[:at]:
        rest = rest[:at].split(":", 1)[0] + ":***" + rest[at:]
    return f"{scheme}://{rest}"


_OPTION_RE = re.compile(r"([?&])([^=&?#]*)=[^&#]*")  # a query option: separator, name, value


def _secret_option(name: str) -> bool:
    """A URL query option that holds a secret (redis-py's ``password``, ``ssl_password``)."""
    return "password" in unquote(name).lower()


def check_store_device(device: Union["torch.device", str], field: str = "device") -> None:
    """Refuse a device the tiers cannot live on, by name: the pools are plain tensors on a
    CPU, or on a CUDA device with copy streams. A ``meta`` store took every put and stored
    nothing (each later read failed deep inside torch), and ``cuda`` on a torch built
    without CUDA failed in torch's own assertion (a review)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise ValueError(f"{field}: {str(device)!r}, but {why}; use 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{field}: {str(device)!r}, but this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
        return
    what = "holds no data" if device.type == "meta" else "is not supported"
    raise ValueError(f"{field}: {str(device)!r} {what}; tiercache keeps its tiers on 'cpu' or a 'cuda' device")


def _max_reuse_block_tokens() -> int:
    """The longest block the prefix cache can store: a record's header holds its token ids."""
    from tiercache.disk import RecordCodec

    return RecordCodec.MAX_TOKEN_IDS


_DEFAULT_SELECTION_BUDGET = 4096  # TierConfig.selection_budget's default, rounded to whole blocks when not chosen
_DEFAULT_RETENTION_BUDGET = 1024  # TierConfig.retention_budget's default
_DEFAULT_REUSE_HOST_BUDGET = "1GiB"  # TierConfig.reuse_host_budget's default


_SCORE_ROWS = ("none", "all", "last", "window")  # RetentionPolicy.score_rows: the query rows that score


def _retention_min_budget(name: str) -> int:
    """The registered retention policy ``name``, made and checked as the cache will use it:
    it can be built with no arguments, names its ``score_rows`` (one of ``_SCORE_ROWS``;
    ``window`` with a ``window_for``), and its ``min_budget()`` is a whole number of tokens
    >= 1, which is returned. A plug-in that fails one of these is a ValueError naming it
    here, not a TypeError from the config's comparison or a KeyError from the attention
    hook at the first forward (a review)."""
    policy = _made("retention", name, make_retention)
    rows = getattr(policy, "score_rows", None)
    if rows not in _SCORE_ROWS or (rows == "window" and not callable(getattr(policy, "window_for", None))):
        raise ValueError(f"retention: the policy {name!r} has score_rows={rows!r}; expected one of "
                         f"{', '.join(_SCORE_ROWS)} ('window' with a window_for(budget) method)")
    try:
        low = policy.min_budget()
    except Exception as exc:  # noqa: BLE001 - a plug-in's, named
        raise ValueError(f"retention: the policy {name!r} failed in min_budget ({type(exc).__name__}: {exc})") from exc
    if isinstance(low, bool) or not isinstance(low, numbers.Integral) or low < 1:
        raise ValueError(f"retention: the policy {name!r} says its min_budget() is {low!r}; expected a whole number "
                         f"of tokens >= 1")
    return int(low)


def _made(field: str, name: str, make: Callable, **kwargs) -> Any:
    """The policy registered as ``name``, made here as the cache makes it (``make(name,
    **kwargs)``): one that cannot be (an instance registered, a constructor with a required
    argument, a class that is not the kind's base class) was a bare TypeError naming no
    policy, from the cache's constructor or its first forward (a review); it is a
    ValueError naming ``field`` and the policy, when the config is made."""
    try:
        return make(name, **kwargs)
    except RegistryError as exc:  # says what to do
        raise ValueError(f"{field}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a plug-in's, named
        advice = ""
        if isinstance(exc, TypeError):  # the arguments: what the cache passes, and nothing more
            given = ", ".join(f"{k}=" for k in kwargs)
            advice = (f"; register a class that takes {given} and whose other parameters have defaults" if given
                      else "; register a class whose parameters have defaults")
        raise ValueError(f"{field}: the policy {name!r} cannot be made as the cache makes it "
                         f"({type(exc).__name__}: {exc}){advice}") from exc


def _check_remote_address(url: str, scheme: str) -> None:
    """A redis:// or rediss:// URL's host, port and database index, checked here: a port
    that does not parse was accepted and then raised from the remote tier's writer thread
    (or made it count a server error every 5 s); a database index that is not a number
    silently meant database 0."""
    parts = urlsplit(url)
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"remote_url: no socket path in {redact_url(url)} (expected unix:///path/to/redis.sock)")
        return
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port == -1 or port == 0:
        raise ValueError(f"remote_url: the port must be a number in [1, 65535], got {redact_url(url)}")
    if not parts.hostname:
        raise ValueError(f"remote_url: no host in {redact_url(url)} (expected redis://host:port/db)")
    db = parts.path.strip("/")
    if db and not (db.isascii() and db.isdigit()):
        raise ValueError(f"remote_url: the database index must be a number (redis://host:port/0), got {db!r}")


# redis-py options in remote_url's query that the tier cannot work with: replies decoded as
# text (records are bytes: every lookup failed to decode, counted as a server fault every 5 s),
# and the timeouts and retries (the query's win over the tier's own, which bound how long a
# compute thread waits for the server: remote_timeout, and no retry)
_TIMEOUT_OPTION = "the tier bounds every server call with remote_timeout and does not retry; set remote_timeout instead"
_REMOTE_OPTIONS_REFUSED = {"decode_responses": "records are bytes; leave it out (the tier reads bytes)",
                           "socket_timeout": _TIMEOUT_OPTION, "socket_connect_timeout": _TIMEOUT_OPTION,
                           "timeout": _TIMEOUT_OPTION, "retry_on_timeout": _TIMEOUT_OPTION,
                           "retry_on_error": _TIMEOUT_OPTION}


def _check_remote_options(url: str, scheme: str) -> None:
    """Options in remote_url's query: those the tier cannot work with are refused, and so
    are a name the connection would not take (``?ssl_ca_cert=``, a typo of
    ``ssl_ca_certs``) and a value redis-py would not parse (``?db=abc``). Each was accepted,
    then every connection failed, counted as a server fault every 5 s (two reviews)."""
    try:
        from redis.connection import URL_QUERY_ARGUMENT_PARSERS as parsers
    except ImportError:  # no redis-py: the remote tier says so when it opens
        parsers = {}
    known = _remote_option_names(scheme)
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        why = _REMOTE_OPTIONS_REFUSED.get(name.lower())
        if why is not None:
            raise ValueError(f"remote_url: the option {name!r} in {redact_url(url)} cannot be used: {why}")
        if known is not None and name not in known:
            tls = _remote_option_names("rediss") if scheme == "redis" else known
            close = difflib.get_close_matches(name, sorted(tls), n=1)
            hint = " (a TLS option: it needs rediss://)" if name in tls else "" if not close else (
                f" (did you mean {close[0]!r}?)" if close[0] in known
                else f" (did you mean {close[0]!r}? a TLS option: it needs rediss://)")
            raise ValueError(f"remote_url: unknown option {name!r} in {redact_url(url)}{hint}; a {scheme}:// "
                             f"connection takes none by that name")
        parse = parsers.get(name)
        if parse is None or not value:
            continue
        try:
            parse(value)
        except (TypeError, ValueError):
            shown = "***" if _secret_option(name) else repr(value)
            raise ValueError(f"remote_url: the option {name!r} has a value redis-py cannot parse: {shown}") from None


def _remote_option_names(scheme: str) -> Optional[set]:
    """The query options redis-py passes on to a ``scheme`` connection (its pool's and its
    connection class's keyword arguments), or None without redis-py."""
    try:
        from redis import connection as rc
    except ImportError:
        return None
    try:  # AbstractConnection: redis-py 4.5 on (before it, Connection held every argument)
        classes = [getattr(rc, "AbstractConnection", rc.Connection),
                   rc.UnixDomainSocketConnection if scheme == "unix" else rc.Connection]
        if scheme == "rediss":
            classes.append(rc.SSLConnection)
        names = {"max_connections"}  # the pool's
        for cls in classes:
            names.update(name for name, p in inspect.signature(cls.__init__).parameters.items()
                         if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    except (AttributeError, TypeError, ValueError):  # a redis-py laid out otherwise: not checked here
        return None
    return names


def remote_credentials(url: str) -> tuple:
    """(username, password) for the remote tier: from the URL when it has them, else from
    $TIERCACHE_REMOTE_USERNAME / $TIERCACHE_REMOTE_PASSWORD (None where neither says)."""
    parts = urlsplit(url)
    user = unquote(parts.username) if parts.username else os.environ.get(REMOTE_ENV_USERNAME) or None
    password = unquote(parts.password) if parts.password else os.environ.get(REMOTE_ENV_PASSWORD) or None
    return user, password


def parse_bytes(value: Budget, field_name: str = "budget") -> int:
    """Parse ``value`` (int bytes, or a string such as "64MiB", "1.5GiB") into bytes.

    The size is computed exactly (no float), and the part of a byte of a size in a unit is
    dropped: "1.5GiB" is 1610612736 bytes, "0.3KiB" (307.2 bytes) 307. A nonzero size
    under one byte is refused, never 0 bytes (0 disables the host and disk tiers), and so
    is a count of bytes that is not whole ("0.5", "1.5B").

    Raises ``ValueError`` naming ``field_name`` and the value when it is negative, under one
    byte but not 0, bytes that are not whole, more than ``MAX_BUDGET``, or unparsable.
    """
    if isinstance(value, bool):  # numpy's bools are not numbers.Integral: refused below
        raise ValueError(f"{field_name}: expected bytes or a size such as '64MiB', got {value!r}")
    if isinstance(value, numbers.Integral):  # numpy's ints too
        exact = Fraction(int(value))
    elif isinstance(value, numbers.Real):  # floats (numpy's too) and Fractions, exactly: no rounding
        try:
            exact = Fraction(value) if isinstance(value, numbers.Rational) else Fraction(float(value))
        except (OverflowError, ValueError):  # inf, nan
            raise ValueError(f"{field_name}: expected bytes or a size such as '64MiB', got {value!r}") from None
        if exact.denominator != 1:
            raise ValueError(f"{field_name}: {value!r} is not a whole number of bytes")
    elif isinstance(value, str):
        exact = _parse_size_text(value, field_name)
    else:
        raise ValueError(f"{field_name}: expected bytes or a size such as '64MiB', got {_shown(value)}")
    if exact < 0:
        raise ValueError(f"{field_name}: must not be negative, got {_shown(value)}")
    if exact > MAX_BUDGET:  # past what any machine holds; a pool this size overflowed inside torch
        raise _too_large(field_name, value)
    return int(exact)


def _too_large(field_name: str, value: object) -> ValueError:
    return ValueError(f"{field_name}: {_shown(value)} is more than {_MAX_BUDGET_TEXT}, more than any machine holds")


def _parse_size_text(value: str, field_name: str) -> Fraction:
    """The exact size a budget string names, in bytes, with a part of a byte left out ("1.3GiB"
    is 1395864371.2 bytes: 1395864371). Computed in float before, "0.0004KiB" was 0 bytes,
    silently: a host or disk tier given that was off. Now a nonzero size under one byte is a
    ValueError, and so is a count of bytes that is not whole ("0.5", "1.5B")."""
    match = _BUDGET_RE.match(value)
    unit = match.group(4).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{field_name}: cannot parse {_shown(value)}; use bytes or a size such as "
                         f"'512KiB', '64MiB', '1.5GiB'")
    sign, whole, fraction = match.group(1), match.group(2).lstrip("0"), (match.group(3) or "").rstrip("0")
    cut = False
    if len(whole) > _MAX_BUDGET_DIGITS:  # before any arithmetic: a 400-digit size was an OverflowError
        if sign:
            raise ValueError(f"{field_name}: must not be negative, got {_shown(value)}")
        raise _too_large(field_name, value)
    if len(fraction) > _MAX_FRACTION_DIGITS:
        if _UNITS[unit] == 1:
            raise ValueError(f"{field_name}: {_shown(value)} is not a whole number of bytes ({len(fraction)} "
                             f"decimal places)")
        # what follows is far below a byte in any unit, but not 0: "0.<41 zeros>1KiB" is under
        # a byte, not 0 bytes (a 1 in the last place kept stands for it)
        fraction, cut = fraction[:_MAX_FRACTION_DIGITS - 1] + "1", True
    exact = Fraction(int(whole + fraction or "0"), 10 ** len(fraction)) * _UNITS[unit]
    if sign and exact:
        raise ValueError(f"{field_name}: must not be negative, got {_shown(value)}")
    if exact > MAX_BUDGET:
        raise _too_large(field_name, value)
    if exact.denominator != 1:
        lower = math.floor(exact)
        if _UNITS[unit] == 1 or not lower:
            # bytes are whole; and a nonzero size that rounds to 0 would disable a tier
            use = f"{lower} or {lower + 1} bytes" if lower else "1 byte"
            size = "less than one byte" if cut else f"{_decimal_text(exact)} bytes"
            raise ValueError(f"{field_name}: {value!r} is {size}, not a whole number of bytes; use {use}")
        # "1.3GiB" (1395864371.2 bytes): a budget is a ceiling, so the part of a byte goes
        return Fraction(lower)
    return exact


def _decimal_text(exact: Fraction) -> str:
    """``exact`` (>= 0) written out in decimal digits: a size parsed from decimal text times a unit
    has a denominator that divides a power of ten, so this is exact ("307.2")."""
    places = next((k for k in range(2 * _MAX_FRACTION_DIGITS) if 10 ** k % exact.denominator == 0), None)
    if places is None:  # pragma: no cover - not a size parsed from text
        return str(exact)
    digits = str(exact.numerator * (10 ** places // exact.denominator)).rjust(places + 1, "0")
    return digits[:len(digits) - places] + ("." + digits[len(digits) - places:] if places else "")


def _shown(value: object) -> str:
    """``value`` as an error message shows it: a huge number or a long text cut short (the
    repr of an int past 4300 digits raises ValueError itself)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 128:
        return f"an integer of about {int(int(value).bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, str) and len(value) > 64:
        return f"{value[:40]!r}... ({len(value)} characters)"
    return repr(value)


def format_bytes(num_bytes: float) -> str:
    """Human-readable IEC size, e.g. 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes} B"  # pragma: no cover


def default_cache_home() -> str:
    """Where tiercache keeps converted models: $TIERCACHE_HOME, else $XDG_CACHE_HOME/tiercache."""
    home = os.environ.get("TIERCACHE_HOME")
    if home:
        return home
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiercache")


def _broken_link(path: str) -> str:
    """What is wrong with ``path``, a symlink that leads nowhere (``os.path.exists`` False)."""
    try:
        target = os.readlink(path)
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{path!r} is a symlink loop"
        if exc.errno != errno.ENOENT:
            return f"{path!r} is a symlink that cannot be followed ({exc.strerror})"
        return (f"{path!r} is a symlink to a missing target ({target!r}); create that directory, "
                f"or remove the link")
    return f"{path!r} is a symlink to {target!r}, which cannot be reached"  # pragma: no cover - a race


def dangling_link(path: str) -> Optional[str]:
    """Why ``path`` cannot be made when it, or a folder above it that does not exist, is a
    symlink that leads nowhere (a missing target, a loop): a message that starts with
    "disk_dir: " and names the link; None when there is no such link on the way. Creating
    such a path fails with a bare "File exists" (``os.makedirs``), which names neither."""
    probe = path.rstrip(os.sep) or path  # "kv/" names the link "kv" (islink of "kv/" is False)
    while not os.path.exists(probe):
        if os.path.islink(probe):
            return (f"disk_dir: {_broken_link(probe)}" if probe == path.rstrip(os.sep) else
                    f"disk_dir: {path!r} cannot be created: {_broken_link(probe)}")
        parent = os.path.dirname(probe.rstrip(os.sep)) or "."
        if parent == probe:
            break
        probe = parent
    return None


def _check_dir_usable(path: str) -> None:
    """Raise ValueError unless ``path`` is (or can become) a writable directory."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"disk_dir: {path!r} exists and is not a directory")
    problem = dangling_link(path)
    if problem is not None:
        raise ValueError(problem)
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe.rstrip(os.sep)) or "."
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ValueError(f"disk_dir: {path!r} cannot be created: {probe!r} is not a directory")
    # os.access lies for root; really try to create a file.
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".tiercache-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"disk_dir: {path!r} is not writable ({exc.strerror})") from None


@dataclass(frozen=True)
class TierConfig:
    """Budgets, block size and policies of a tiered KV cache. Validated on construction.

    Budgets accept int bytes or IEC strings ("64MiB", "1.5GiB") and are stored as int bytes.
    ``host_budget=0`` disables the host tier; ``disk_budget=0`` or no ``disk_dir`` disables disk.

    Example::

        cfg = TierConfig(device_budget="32MiB", host_budget="128MiB",
                         disk_dir="./kv", disk_budget="4GiB")
    """

    device_budget: Budget = "1GiB"
    host_budget: Budget = "4GiB"
    disk_budget: Budget = "16GiB"
    disk_dir: Optional[str] = None
    block_tokens: int = 1024
    eviction: str = "layer-cycle"  # README "Policy lab": best on the traces and, since 2026-12-04, on CPU decode
    # "auto": ``lookahead`` (``prefetch_depth`` layers, at most 3) where disk blocks are read
    # straight into attention's buffers (a CPU model with host and disk tiers, no selection
    # or retention: reading two layers ahead keeps the disk busy; a buffer per layer read
    # ahead, outside the budgets), else ``next-layer``
    prefetch: str = AUTO
    prefetch_depth: int = _DEFAULT_PREFETCH_DEPTH  # layers ahead, for prefetch "lookahead" (and "auto")
    io_workers: int = 4
    direct_io: str = "auto"
    # Who reads and writes disk records: "posix" (pread/pwrite on the I/O threads), "kvikio"
    # (NVIDIA KvikIO's cuFile API: GPUDirect Storage where the system has it, its own
    # thread pool where not; needs CUDA and the `gds` extra), or "auto": kvikio where it
    # imports and CUDA is in use (the store's device, or the process already), else posix.
    disk_io: str = "auto"
    queue_depth: int = 64
    device: Optional[str] = None
    selection: str = "full"  # which pages attention reads per decode step: "full" (exact) or "quest"
    selection_budget: int = _DEFAULT_SELECTION_BUDGET  # tokens each (row, KV head) reads per quest step
    retention: Optional[str] = None  # lossy: None, "streaming", "h2o", "tova", "snapkv"
    retention_budget: int = _DEFAULT_RETENTION_BUDGET  # tokens each full-attention layer keeps with a retention policy
    reuse: Optional[bool] = None  # prefix cache; None: on when the disk tier is enabled
    reuse_host_budget: Budget = _DEFAULT_REUSE_HOST_BUDGET  # host memory of the prefix cache (warm prefixes)
    reuse_admission: str = REUSE_ADMISSIONS[0]  # "always", or "reused": store a block once seen twice
    shared_dir: bool = False  # opt in: accept a disk_dir with looser permissions or another owner
    # CPU, host tier: decode attention reads each block where it lies instead of gathering the
    # layer into one K and V first (tiercache.streaming): faster, and as close to the exact
    # result as SDPA is, but not bit for bit SDPA's, so off by default.
    attend_in_place: bool = False
    # The remote tier (Redis/Valkey) beside the prefix cache; repr hides the URL's password.
    remote_url: Optional[str] = field(default=None, repr=False)  # redis://, rediss:// (TLS), unix://
    remote_budget: Optional[Budget] = None  # bytes of this model's blocks on the server; None: maxmemory decides
    remote_namespace: str = "tiercache"  # key prefix: "<namespace>:<model digest>-<geometry>:..."
    remote_cluster: bool = False  # Redis/Valkey Cluster (the URL names any one node)
    remote_timeout: float = 0.5  # seconds per server call; a slower server counts as unavailable
    remote_max_inflight: Budget = "256MiB"  # queued writes; beyond it writes are dropped, never waited for

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "disk_budget"):
            object.__setattr__(self, name, parse_bytes(getattr(self, name), name))
        if self.device_budget == 0:
            raise ValueError("device_budget: must be > 0 (attention reads from the device tier)")
        self._check_int("block_tokens", 1, 1 << 20)
        self._check_int("prefetch_depth", 1, 1024)
        self._check_int("io_workers", 1, 256)
        self._check_int("queue_depth", 1, 1 << 16)
        self._check_name("eviction", EVICTION_POLICIES)
        if _made("eviction", self.eviction, make_eviction) is _made("eviction", self.eviction, make_eviction):
            # each tier's policy ranks that tier's blocks: one object for both mixed them up,
            # and its answers broke the contract with a message that did not say why
            raise ValueError(f"eviction: the policy {self.eviction!r} is registered as a function that returns "
                             f"the same object each time; each tier needs one of its own: register the class, "
                             f"or a function that returns a new policy")
        self._check_name("prefetch", {**PREFETCH_POLICIES, AUTO: None})
        if self.prefetch == AUTO and AUTO in PREFETCH_POLICIES:
            raise ValueError(f"prefetch: {AUTO!r} names tiercache's own choice of policy, so a plug-in registered "
                             f"under that name would never run; register it under another name")
        # "auto" picks one of these two where the store opens
        for name in (("next-layer", "lookahead") if self.prefetch == AUTO else (self.prefetch,)):
            _made("prefetch", name, make_prefetch, **({"depth": self.prefetch_depth} if name == "lookahead" else {}))
        # Only a depth told apart from its default (2 given or not, it cannot say): one was
        # taken with prefetch "none" or "next-layer", and did nothing.
        if self.prefetch_depth != _DEFAULT_PREFETCH_DEPTH and self.prefetch not in PREFETCH_DEPTH_POLICIES:
            layers = f"{self.prefetch_depth} layer{'s' * (self.prefetch_depth != 1)}"
            raise ValueError(f"prefetch_depth: {layers}, but prefetch={self.prefetch!r} is built without a depth, "
                             f"so it would be ignored; only prefetch='lookahead' (and 'auto', which picks lookahead "
                             f"where disk blocks stream into attention) reads it: set one of those, or leave "
                             f"prefetch_depth at {_DEFAULT_PREFETCH_DEPTH}")
        self._check_selection_and_retention()
        if self.direct_io not in DIRECT_IO_MODES:
            raise ValueError(f"direct_io: must be one of {', '.join(DIRECT_IO_MODES)}, got {self.direct_io!r}")
        if self.disk_io not in DISK_IO_BACKENDS:
            raise ValueError(f"disk_io: must be one of {', '.join(DISK_IO_BACKENDS)}, got {self.disk_io!r}")
        if self.disk_dir is not None:
            path = os.fspath(self.disk_dir) if isinstance(self.disk_dir, (str, os.PathLike)) else None
            if not isinstance(path, str) or path == "":  # a PathLike of bytes too
                raise ValueError(f"disk_dir: expected a directory path, got {self.disk_dir!r}")
            if "\0" in path:  # was taken, and the first forward failed ("embedded null byte")
                raise ValueError(f"disk_dir: {path!r} contains a NUL character, which no path can hold")
            object.__setattr__(self, "disk_dir", os.path.abspath(os.path.expanduser(path)))
            if self.disk_budget > 0:
                _check_dir_usable(self.disk_dir)
        if self.device is not None:  # a name torch cannot parse failed at the first generate()
            import torch

            try:
                parsed = torch.device(self.device)
            except (RuntimeError, TypeError, ValueError) as exc:
                raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {self.device!r} "
                                 f"({str(exc).splitlines()[0][:120]})") from None
            check_store_device(parsed)
            object.__setattr__(self, "device", str(parsed))
        object.__setattr__(self, "reuse_host_budget", parse_bytes(self.reuse_host_budget, "reuse_host_budget"))
        if self.reuse is not None:
            self._check_bool("reuse", ", or None (auto)")
        self._check_bool("shared_dir")  # "no" was accepted, and counted as True
        if self.shared_dir and not self.disk_enabled:  # it loosens disk_dir's checks: without a disk tier, none
            raise ValueError(f"shared_dir: True applies to the disk tier's directory, and there is none "
                             f"(disk_dir={self.disk_dir!r}, disk_budget={self.disk_budget}); set disk_dir with a "
                             f"disk_budget > 0, or leave shared_dir False")
        if self.reuse and not self.disk_enabled:
            raise ValueError("reuse: the prefix cache lives in disk_dir; set disk_dir (and a disk_budget > 0)")
        if self.reuse and self.block_tokens > _max_reuse_block_tokens():
            raise ValueError(f"reuse: a prefix block's record holds its token ids in the header, at most "
                             f"{_max_reuse_block_tokens()}; block_tokens={self.block_tokens} (use block_tokens <= "
                             f"{_max_reuse_block_tokens()}, or reuse=False)")
        if self.reuse and self.retention is not None:
            raise ValueError(f"reuse: the prefix cache stores exact KV; retention={self.retention!r} drops tokens "
                             f"(set reuse=False or retention=None)")
        if self.reuse_admission not in REUSE_ADMISSIONS:
            raise ValueError(f"reuse_admission: must be one of {', '.join(REUSE_ADMISSIONS)}, "
                             f"got {self.reuse_admission!r}")
        if self.reuse_admission != REUSE_ADMISSIONS[0] and not self.reuse_enabled:
            why, fix = self._why_no_reuse()
            raise ValueError(f"reuse_admission: {self.reuse_admission!r} decides what the prefix cache stores, "
                             f"and {why}, so it would be ignored; {fix}, or leave reuse_admission "
                             f"{REUSE_ADMISSIONS[0]!r}")
        if (self.reuse_host_budget != parse_bytes(_DEFAULT_REUSE_HOST_BUDGET, "reuse_host_budget")
                and not self.reuse_enabled):
            why, fix = self._why_no_reuse()
            raise ValueError(f"reuse_host_budget: {format_bytes(self.reuse_host_budget)} is host memory of the prefix "
                             f"cache, and {why}, so it would be ignored; {fix}, or leave reuse_host_budget at its "
                             f"default ({_DEFAULT_REUSE_HOST_BUDGET})")
        self._check_remote()
        if self.attend_in_place and not self.host_enabled:  # it reads host-tier blocks; host_budget=0: none
            raise ValueError("attend_in_place: True reads the host tier's blocks where they lie, and host_budget=0 "
                             "disables the host tier, so it would do nothing; set a host_budget > 0, or leave "
                             "attend_in_place False")

    def _why_no_reuse(self) -> tuple:
        """(why the prefix cache is off, what would turn it on), where ``reuse_enabled`` is False."""
        if self.reuse is False:
            return "reuse=False turns the prefix cache off", "set reuse=None or True (with a disk tier)"
        if self.retention is not None:
            return (f"retention={self.retention!r} turns it off (the prefix cache stores exact KV)",
                    "set retention=None")
        if not self.disk_enabled:
            return (f"there is no prefix cache without a disk tier (disk_dir={self.disk_dir!r}, "
                    f"disk_budget={self.disk_budget})", "set disk_dir with a disk_budget > 0")
        return (f"block_tokens={self.block_tokens} turns it off (a record's header holds at most "
                f"{_max_reuse_block_tokens()} token ids)", f"use block_tokens <= {_max_reuse_block_tokens()}")

    def _check_remote(self) -> None:
        object.__setattr__(self, "remote_max_inflight", parse_bytes(self.remote_max_inflight, "remote_max_inflight"))
        if self.remote_budget is not None:
            object.__setattr__(self, "remote_budget", parse_bytes(self.remote_budget, "remote_budget"))
        if not isinstance(self.remote_namespace, str) or not _NAMESPACE_RE.match(self.remote_namespace):
            raise ValueError(f"remote_namespace: 1-64 letters, digits, '_', '.' or '-', got {self.remote_namespace!r}")
        self._check_bool("attend_in_place")
        self._check_bool("remote_cluster")
        if (isinstance(self.remote_timeout, bool) or not isinstance(self.remote_timeout, numbers.Real)
                or not 0 < self.remote_timeout <= 600):
            raise ValueError(f"remote_timeout: seconds in (0, 600], got {self.remote_timeout!r}")
        object.__setattr__(self, "remote_timeout", float(self.remote_timeout))
        if self.remote_url is None:
            # Only what is told apart from its default: remote_budget None, remote_cluster False
            # (a namespace or timeout equal to its default may have been given, or not).
            if self.remote_budget is not None:
                raise ValueError(f"remote_budget: {self.remote_budget} bytes, but there is no remote tier "
                                 f"(remote_url is None), so it would be ignored; set remote_url, or leave "
                                 f"remote_budget None")
            if self.remote_cluster:
                raise ValueError("remote_cluster: True, but there is no remote tier (remote_url is None), so it "
                                 "would be ignored; set remote_url to a cluster node, or leave remote_cluster False")
            return
        url = self.remote_url
        try:
            scheme = urlsplit(url).scheme if isinstance(url, str) else ""
        except ValueError as exc:  # "Invalid IPv6 URL" (an unclosed '['), naming no field
            raise ValueError(f"remote_url: cannot parse {redact_url(url)} ({exc})") from None
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(f"remote_url: expected redis://host:port/db, rediss:// (TLS) or unix:///path, "
                             f"got {redact_url(url) if isinstance(url, str) else url!r}")
        if self.remote_cluster and scheme == "unix":
            raise ValueError("remote_cluster: a cluster is reached over TCP (redis:// or rediss://), not unix://")
        _check_remote_address(url, scheme)
        _check_remote_options(url, scheme)
        if not self.reuse_enabled:
            raise ValueError(f"remote_url: the remote tier shares prefix-cache blocks; it needs the prefix cache "
                             f"(set disk_dir with a disk_budget > 0, block_tokens <= {_max_reuse_block_tokens()}, "
                             f"and reuse not False)")
        if self.remote_max_inflight < 1 << 20:
            raise ValueError(f"remote_max_inflight: at least 1MiB, got {self.remote_max_inflight!r}")
        import importlib.util

        if importlib.util.find_spec("redis") is None:
            raise ValueError("remote_url: the remote tier needs the redis client; pip install 'tiercache[remote]'")

    def _check_bool(self, name: str, alternative: str = "") -> None:
        """A bool field: True or False (numpy's bools too, stored as bool); 1 or "no" refused."""
        value = getattr(self, name)
        if not isinstance(value, bool):
            import numpy

            if not isinstance(value, numpy.bool_):
                raise ValueError(f"{name}: must be True or False{alternative}, got {value!r}")
            object.__setattr__(self, name, bool(value))

    @property
    def remote_enabled(self) -> bool:
        return self.remote_url is not None

    def _check_selection_and_retention(self) -> None:
        self._check_name("selection", SELECTION_POLICIES)
        if self.selection == "full" and SELECTION_POLICIES["full"] is not FullSelection:
            raise ValueError("selection: 'full' names reading every block, which the cache does without a policy, "
                             "so a plug-in registered under that name would never run; register it under another "
                             "name")
        if self.selection != "full":
            _made("selection", self.selection, make_selection)
        self._check_int("selection_budget", 1, 1 << 30)
        if self.selection == "full" and self.selection_budget != _DEFAULT_SELECTION_BUDGET:
            raise ValueError(f"selection_budget: {self.selection_budget}, but selection='full' reads every block "
                             f"and has no budget; set selection='quest', or leave selection_budget out")
        if (self.selection != "full" and self.selection_budget == _DEFAULT_SELECTION_BUDGET
                and (self.selection_budget % self.block_tokens or self.selection_budget < 3 * self.block_tokens)):
            # not chosen: whole blocks below it, and at least the 3 a step reads (it was refused
            # with block_tokens above 1365, as a budget the caller had set)
            object.__setattr__(self, "selection_budget",
                               max(3, self.selection_budget // self.block_tokens) * self.block_tokens)
            object.__setattr__(self, "_budget_defaulted", True)  # not a field: ``replace`` rounds the default again
        if self.selection != "full" and self.selection_budget < 3 * self.block_tokens:
            raise ValueError(
                f"selection_budget: {self.selection_budget} tokens is less than 3 blocks of block_tokens="
                f"{self.block_tokens} ({self.selection} reads whole blocks: the first, the newest and at least "
                f"one chosen); use selection_budget >= {3 * self.block_tokens} or a smaller block_tokens")
        if self.selection != "full" and self.selection_budget % self.block_tokens:
            lower = self.selection_budget // self.block_tokens * self.block_tokens
            raise ValueError(
                f"selection_budget: {self.selection_budget} tokens is not a whole number of blocks of block_tokens="
                f"{self.block_tokens} ({self.selection} reads whole blocks; the budget was rounded down, so one "
                f"that covered the context was not exact); use {lower} or {lower + self.block_tokens}")
        self._check_name("retention", RETENTION_POLICIES, none_ok=True)
        self._check_int("retention_budget", 1, 1 << 30)
        if self.retention is None and self.retention_budget != _DEFAULT_RETENTION_BUDGET:
            raise ValueError(f"retention_budget: {self.retention_budget}, but retention is None (nothing is "
                             f"dropped); set retention (one of {', '.join(sorted(RETENTION_POLICIES))}), or "
                             f"leave retention_budget out")
        if self.attend_in_place and (self.selection != "full" or self.retention is not None):
            what = f"selection={self.selection!r}" if self.selection != "full" else f"retention={self.retention!r}"
            raise ValueError(f"attend_in_place: True attends to every block where it lies, and {what} reads and "
                             f"attends through its own plan instead, so it would never run; choose one")
        if self.retention is not None:
            low = _retention_min_budget(self.retention)
            if self.retention_budget < low:
                raise ValueError(f"retention_budget: {self.retention} needs at least {low} tokens, "
                                 f"got {self.retention_budget!r}")
            if self.selection != "full":
                raise ValueError(f"selection={self.selection!r} and retention={self.retention!r} cannot be "
                                 f"combined; choose one")

    def _check_int(self, name: str, low: int, high: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
            raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")
        object.__setattr__(self, name, int(value))  # numpy's ints as int

    def _check_name(self, name: str, registry: dict, none_ok: bool = False) -> None:
        """A policy name: one of ``registry``'s keys (a list or dict given was a bare
        ``TypeError: unhashable type`` naming no field)."""
        value = getattr(self, name)
        if none_ok and value is None:
            return
        if not isinstance(value, str) or value not in registry:
            raise ValueError(f"{name}: unknown policy {value!r}; known: {', '.join(sorted(registry))}"
                             f"{' (or None)' if none_ok else ''}")

    @property
    def host_enabled(self) -> bool:
        return self.host_budget > 0

    @property
    def disk_enabled(self) -> bool:
        return self.disk_dir is not None and self.disk_budget > 0

    @property
    def reuse_enabled(self) -> bool:
        return _prefix_cache_on(self.reuse, self.retention, self.disk_enabled, self.block_tokens)

    def replace(self, **changes) -> "TierConfig":
        """A copy with ``changes`` applied (and validated). A budget the copy leaves without
        its policy (``selection="full"``, ``retention=None``) goes back to its default, as
        does a default selection budget rounded to this config's blocks (the copy rounds the
        default for its own): passed on, the rounded default of one block size was refused
        under another as a budget the caller had chosen, and a copy made to be an exact
        baseline was refused for the budget it no longer uses (reviews). So do the prefix
        cache's ``reuse_host_budget`` and ``reuse_admission`` in a copy that has no prefix
        cache (``reuse=False``, a retention policy, no disk tier), unless ``changes`` set them.
        ``dataclasses.replace`` passes every value on as given."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if getattr(self, "_budget_defaulted", False) or changes.get("selection", self.selection) == "full":
            values["selection_budget"] = _DEFAULT_SELECTION_BUDGET
        if changes.get("retention", self.retention) is None:
            values["retention_budget"] = _DEFAULT_RETENTION_BUDGET
        if _reuse_off({**values, **changes}):  # the prefix cache's settings, of a copy without one
            values["reuse_host_budget"], values["reuse_admission"] = _DEFAULT_REUSE_HOST_BUDGET, REUSE_ADMISSIONS[0]
        values.update(changes)
        return TierConfig(**values)


def _prefix_cache_on(reuse: Optional[bool], retention: Optional[str], disk_on: bool, block_tokens: int) -> bool:
    """``TierConfig.reuse_enabled`` from its inputs: never with a retention policy (the
    prefix cache stores exact KV); with ``reuse=None``, wherever there is a disk tier and a
    record's header holds a block's token ids (``reuse=True`` is refused otherwise)."""
    if retention is not None:
        return False
    if reuse is None:
        return disk_on and block_tokens <= _max_reuse_block_tokens()
    return bool(reuse)


def _reuse_off(values: dict) -> bool:
    """Whether a config of these field values (``TierConfig.replace``'s, before it checks
    them) has no prefix cache (``_prefix_cache_on``); False where a value is invalid (the
    config's own check names it)."""
    try:
        disk_on = values["disk_dir"] is not None and parse_bytes(values["disk_budget"], "disk_budget") > 0
    except ValueError:
        return False
    if not isinstance(values["block_tokens"], int):
        return False
    return not _prefix_cache_on(values["reuse"], values["retention"], disk_on, values["block_tokens"])


def as_tier_config(config: Optional[TierConfig]) -> TierConfig:
    """``config``, or ``TierConfig()`` for None; anything else is refused by name (a dict
    would otherwise fail later, as an AttributeError from deep inside)."""
    if config is None:
        return TierConfig()
    if not isinstance(config, TierConfig):
        hint = " (build one: tiercache.TierConfig(**your_dict))" if isinstance(config, dict) else ""
        raise TypeError(f"config: expected a tiercache.TierConfig, got {type(config).__name__}{hint}")
    return config
