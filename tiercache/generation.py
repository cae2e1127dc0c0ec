"""Long-context generation with a TieredCache: the body of ``tiercache generate``."""
from __future__ import annotations

import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from tiercache.config import TierConfig
from tiercache.errors import TierCacheError

if TYPE_CHECKING:
    from tiercache.lab.trace import TraceWriter


class PromptTooLongError(TierCacheError, ValueError):
    """The prompt plus the new tokens exceed the model's positions."""


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> dict:
    """Token ids (and mask) for ``prompt``, through the chat template when the model has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def check_length(model: Any, num_prompt_tokens: int, max_new_tokens: int) -> None:
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and num_prompt_tokens + max_new_tokens > limit:
        raise PromptTooLongError(f"the prompt has {num_prompt_tokens} tokens and {max_new_tokens} new tokens were "
                                 f"asked for, but the model has {limit} positions; shorten the prompt or "
                                 f"--max-new-tokens")


class _Progress:
    """Prefill and decode progress on stderr, fed by the cache's token events.

    On a terminal, a bar redrawn in place (``\\r``); elsewhere (a log file, a pipe) a line
    per prefill chunk and per tenth of the decode, without carriage returns (a review: a
    log filled with redrawn bars). The decode's progress only where the streamed answer
    does not go where stderr goes (one terminal, or one log with ``2>&1``: there the answer
    itself shows it, and progress lines would tear it): stdout redirected, say, or no
    stream at all."""

    def __init__(self, prefill_total: int, decode_total: int, enabled: bool, tty: bool = False,
                 decode_shown: bool = True, out: Optional[IO[str]] = None) -> None:
        self.enabled, self.tty, self.decode_shown = enabled, tty, decode_shown
        self.out = out if out is not None else sys.stderr
        self.prefill_total, self.decode_total = prefill_total, decode_total
        self.prefilled = self.decoded = 0
        self.t_start = time.perf_counter()
        self.t_first_decode: Optional[float] = None
        self._open_line = False  # a bar drawn in place without its newline yet
        self._decode_tenth = 0

    def __call__(self, kind: str, fields: dict) -> None:
        if kind != "tokens":
            return
        self.prefilled += fields["prefill"]
        if fields["decode"] and self.t_first_decode is None:
            self.t_first_decode = time.perf_counter()
        self.decoded += fields["decode"]
        if not self.enabled:
            return
        if fields["prefill"]:
            self._draw("prefill", self.prefilled, self.prefill_total, "")
        elif fields["decode"] and self.decode_shown:
            # new tokens so far: the first came out of the prefill's forward, and each decode
            # forward writes the one before the token it makes
            total, done = max(self.decode_total, 1), min(self.decoded + 1, max(self.decode_total, 1))
            tenth = 10 * done // total
            if self.tty or tenth > self._decode_tenth or done >= total:
                self._decode_tenth = tenth
                seconds = time.perf_counter() - self.t_first_decode
                rate = f" ({(self.decoded - 1) / seconds:.2f} tok/s)" if self.decoded > 1 and seconds > 0 else ""
                self._draw("decode", done, total, rate)

    def _draw(self, what: str, done: int, total: int, tail: str) -> None:
        bar = "#" * int(30 * min(done / max(total, 1), 1.0))
        text = f"{what} [{bar:<30}] {done}/{total} tokens{tail}"
        if self.tty:
            self.out.write(f"\r{text}")
            self._open_line = done < total
            if not self._open_line:
                self.out.write("\n")
        else:  # a prefill chunk, or a tenth of the decode (``__call__``)
            self.out.write(text + "\n")
        self.out.flush()

    def finish(self) -> None:
        """The run ended (at its last token, or before: an end-of-sequence token): a bar drawn
        in place gets its newline."""
        if self._open_line:
            self.out.write("\n")
            self.out.flush()
            self._open_line = False


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _same_target(a: Any, b: Any) -> bool:
    """Whether two streams write to one file, pipe or terminal (stdout and stderr both to a
    terminal, or ``2>&1`` into one log): progress lines there would tear the answer's."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, ValueError, OSError):  # not files (io.StringIO): a terminal is a guess
        return _isatty(a) and _isatty(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _check_device_budget(cache: Any, config: TierConfig, num_prompt: int, max_new_tokens: int,
                         prefill_chunk: Optional[int], loaded: int = 0) -> None:
    """Before the prefill: a device budget under what it needs fails here, with the minimum
    for the whole prompt, not after some chunks with the minimum for the chunk that failed
    (following that advice failed again further in: a helper's report). ``loaded``: prompt
    tokens already loaded from the prefix cache."""
    from tiercache.config import format_bytes
    from tiercache.errors import CapacityError

    prefill_chunk = prefill_chunk or None  # a prefill_chunk_size of 0 prefills at once, as transformers does
    need = cache.min_device_budget(num_prompt, 0, prefill_chunk, loaded)
    if need and config.device_budget < need:
        whole = cache.min_device_budget(num_prompt, max_new_tokens, prefill_chunk, loaded)
        raise CapacityError(
            f"device_budget={format_bytes(config.device_budget)} is less than attention needs resident for this "
            f"prompt of {num_prompt} tokens: minimum device_budget = {need} bytes ({format_bytes(need)}) for its "
            f"prefill, {whole} bytes ({format_bytes(whole)}) with {max_new_tokens} new tokens")
    need, room = cache.min_capacity_blocks(num_prompt, max_new_tokens), cache.capacity_blocks()
    if need > room:  # else it failed part way, after some of the answer was printed (a review)
        disk = (f"disk_budget={format_bytes(config.disk_budget)}" if config.disk_enabled
                else "no disk tier" if config.disk_dir is None else "disk_budget=0")
        raise CapacityError(
            f"the KV cache of this run needs {need} blocks (a prompt of {num_prompt} tokens and {max_new_tokens} "
            f"new ones, in blocks of {config.block_tokens} tokens, every layer) but the tiers hold {room} "
            f"(device_budget={format_bytes(config.device_budget)}, host_budget={format_bytes(config.host_budget)}, "
            f"{disk}); raise a budget, or lower --max-new-tokens")


def generate_text(prompt: str, config: TierConfig, *, model_path: Optional[str] = None,
                  max_new_tokens: int = 128, chat: bool = True, prefill_chunk: Optional[int] = 512,
                  stream: Optional[IO[str]] = None, progress: bool = True, model: Any = None,
                  tokenizer: Any = None, trace_out: Union[str, "os.PathLike[str]", "TraceWriter", None] = None,
                  on_open: Optional[Callable[[Any], None]] = None,
                  on_done: Optional[Callable[[Any], None]] = None,
                  on_trace_error: Optional[Callable[[OSError], None]] = None) -> dict:
    """Generate greedily from ``prompt`` with a TieredCache; returns text, stats and timings.

    ``trace_out``: write every block access of the run to this CSV file (see
    ``tiercache.lab.trace``; a ``TraceWriter`` of the caller's is used as it is). A write of
    the file that fails (a full disk) does not stop the run: the rest of the trace is
    dropped and, once the run is over and its cache closed, ``on_trace_error`` is called
    with the OSError and the result is returned; without ``on_trace_error``, a
    ``TraceError`` naming the file is raised then instead (the run's result lost). It was an
    OSError from the cache's close, which lost the result either way."""
    from transformers import TextStreamer

    from tiercache.hf import TieredCache, _inner_generate, _tiering
    from tiercache.models import check_token_ids, load_model

    if model is None:
        model, tokenizer = load_model(model_path)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    inputs = encode_prompt(tokenizer, prompt, chat)
    check_token_ids(model, inputs["input_ids"])
    num_prompt = inputs["input_ids"].shape[1]
    if num_prompt == 0:
        raise ValueError("the prompt is empty: it encodes to 0 tokens (give some text, or drop "
                         "--no-chat-template where the model has a chat template)")
    check_length(model, num_prompt, max_new_tokens)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    tty = _isatty(sys.stderr)
    meter = _Progress(num_prompt, max_new_tokens, progress, tty=tty,
                      decode_shown=stream is None or not _same_target(stream, sys.stderr))
    streamer = None
    if stream is not None:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamed: list = []  # whether any text went out: an error after it starts on a line of its own

        def on_text(text: str, stream_end: bool = False) -> None:
            if text:
                streamed[:] = [True]
            stream.write(text)
            stream.flush()
        streamer.on_finalized_text = on_text
    trace, writer = trace_out, None
    if isinstance(trace_out, (str, os.PathLike)):
        from tiercache.lab.trace import TraceWriter

        trace = writer = TraceWriter(os.fspath(trace_out), defer_errors=True)
    t0 = time.perf_counter()
    try:
        tiered = TieredCache(model, config, trace=trace)
    except BaseException:
        if writer is not None:  # opened here, for a cache that never was
            writer.close()
        raise
    with tiered as cache:
        cache.events.add_listener(meter)
        if on_open is not None:
            on_open(cache)
        chunked = bool(prefill_chunk) and num_prompt > prefill_chunk

        def before_prefill(cache: Any, ids: torch.Tensor, generation_config: Any, loaded: int) -> None:
            # the prefix is loaded (where that is exact: wrap()'s rule) before the device
            # budget is checked: a loaded prefix moves where the chunks fall. The chunk size is
            # the one generate() settled on (the model's own where this run sets none).
            chunk = getattr(generation_config, "prefill_chunk_size", None)
            _check_device_budget(cache, config, num_prompt, max_new_tokens, chunk, loaded)
            meter.prefill_total = num_prompt - loaded  # the bar counts what is computed, to its end

        handed: list = []

        def make() -> Any:
            if handed:  # one cache per run; a second cache asked for is a loop this command does not run
                raise RuntimeError("tiercache generate: generate() asked for a second cache")
            handed.append(cache)
            return cache

        kwargs = {"prefill_chunk_size": prefill_chunk} if chunked else {}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Greedy, one beam, with a cache, whatever the model's generation config says (its
        # use_cache=False, kept from training, fed the whole sequence to the cache at every
        # step). The generate() of before wrap(): a wrapped one would make a cache of its own.
        generate = _inner_generate(model)
        try:
            with _tiering(model, make, before_prefill), torch.inference_mode():
                out = generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               num_return_sequences=1, use_cache=True, return_dict_in_generate=False,
                               streamer=streamer, pad_token_id=pad, **kwargs)
        except Exception:
            if stream is not None and streamed:  # the part of the answer printed ends its line, and the
                try:                              # error that follows starts its own (a review)
                    stream.write("\n")
                    stream.flush()
                except (OSError, ValueError):
                    pass
            raise
        finally:
            meter.finish()
        if not handed:
            raise RuntimeError(f"tiercache generate: {type(model).__name__}.generate() made no cache of its own, "
                               f"so nothing ran on the tiers")
        t_end = time.perf_counter()
        cache.store.drop_read_ahead()  # the run is over: what was read ahead for a next step is unused
        stats = cache.stats()
        attention = cache.attention_stats()
        if on_done is not None:
            on_done(cache)
    first = meter.t_first_decode or t_end
    new_ids = out[0, num_prompt:]
    result = {"text": tokenizer.decode(new_ids, skip_special_tokens=True), "num_prompt_tokens": num_prompt,
              "new_token_ids": new_ids.tolist(), "stats": stats, "attention": attention,
              "seconds": {"prefill": first - t0, "decode": t_end - first, "total": t_end - t0}}
    if writer is not None and writer.error is not None:
        if on_trace_error is None:
            from tiercache.lab.trace import TraceError

            raise TraceError(f"trace: cannot write {writer.path!r} "
                             f"({writer.error.strerror or writer.error})") from writer.error
        on_trace_error(writer.error)
    return result
