"""``make demo``: a long-context question over a generated haystack, answered by the default
model with its KV cache spread over device, host and disk. The answer is printed next to
the truth so a person can check it."""
from __future__ import annotations

import random
import sys
import tempfile
from typing import IO, Optional

from tiercache.config import TierConfig, format_bytes

FIRST = ["Mira", "Jonas", "Aiko", "Pavel", "Lena", "Omar", "Greta", "Tariq", "Nadia", "Felix", "Ines", "Kofi",
         "Sven", "Lucia", "Ravi", "Hana", "Diego", "Yara", "Emil", "Zofia"]
LAST = ["Tan", "Berg", "Sato", "Novak", "Weiss", "Haddad", "Lund", "Khan", "Petrova", "Moreau", "Costa", "Mensah",
        "Dahl", "Ferri", "Iyer", "Kim", "Ortega", "Nasser", "Vogel", "Nowak"]
CITIES = ["Oslo", "Lima", "Kyoto", "Porto", "Tunis", "Quito", "Riga", "Perth", "Accra", "Hanoi", "Cusco", "Bergen"]


FILLER = ("The archive office opens at nine and closes at five. Visitors sign the ledger at the front desk, "
          "leave their coats in the cloakroom and wait for a clerk to call their name. ")


def make_haystack(num_records: int, seed: int = 1, filler_lines: int = 0) -> tuple:
    """Synthetic records (after ``filler_lines`` of irrelevant notes), one question about one
    record, and the true answer."""
    rng = random.Random(seed)
    people = rng.sample([(f, l) for f in FIRST for l in LAST], num_records)
    lines, codes = [], {}
    for i, (first, last) in enumerate(people):
        code = rng.randint(1000, 9999)
        codes[(first, last)] = code
        lines.append(f"Record {i + 1:03d}: {first} {last} lives in {rng.choice(CITIES)}; "
                     f"the locker code of {first} {last} is {code}.")
    target = people[rng.randrange(num_records)]
    question = f"What is the locker code of {target[0]} {target[1]}? Answer with the number only."
    notes = ("Notes about the archive: " + FILLER * filler_lines + "\n\n") if filler_lines else ""
    prompt = notes + "Here are the records:\n" + "\n".join(lines) + "\n\n" + question
    return prompt, str(codes[target]), f"{target[0]} {target[1]}"


def run_demo(records: int = 40, disk_dir: Optional[str] = None, max_new_tokens: int = 24) -> int:
    from tiercache.generation import encode_prompt, generate_text
    from tiercache.models import load_model

    print("loading SmolLM2-135M-Instruct (converted once, then cached) ...", file=sys.stderr)
    model, tokenizer = load_model()
    # 40 records behind ~1,500 tokens of notes: ~2,800 tokens, a haystack this 135M-parameter
    # model still answers (with 80 records and no notes it already fails, with any cache).
    prompt, truth, who = make_haystack(records, seed=1, filler_lines=40)

    def tokens_of(n: int) -> int:
        return encode_prompt(tokenizer, make_haystack(n, seed=1, filler_lines=40)[0], chat=True)["input_ids"].shape[1]

    num_tokens = tokens_of(records)
    text = model.config.get_text_config(decoder=True)
    positions = getattr(text, "max_position_embeddings", None)
    if positions and num_tokens + max_new_tokens > positions:  # said after the answer had begun (a review)
        lo, hi = 1, records  # the most records that fit, by bisection (a tokenization each)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if tokens_of(mid) + max_new_tokens <= positions else (lo, mid - 1)
        raise ValueError(f"records (--records): {records} records make a prompt of {num_tokens} tokens, and with "
                         f"the {max_new_tokens}-token answer that is more than the model's {positions} positions; "
                         f"use at most {lo}")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_bytes = 2 * text.num_key_value_heads * head_dim * 4 * text.num_hidden_layers * (num_tokens + max_new_tokens)
    block_tokens = 256
    with tempfile.TemporaryDirectory(prefix="tiercache-demo-") as tmp:
        cfg = TierConfig(device_budget=max(kv_bytes // 5, 2 << 20), host_budget=max(kv_bytes // 5, 1 << 20),
                         disk_dir=disk_dir or f"{tmp}/kv", disk_budget=kv_bytes * 2, block_tokens=block_tokens)
        print(f"haystack: {records} records, {num_tokens} tokens; KV cache {format_bytes(kv_bytes)} over "
              f"device {format_bytes(cfg.device_budget)} + host {format_bytes(cfg.host_budget)} + disk",
              file=sys.stderr)
        print(f"question: What is the locker code of {who}?", file=sys.stderr)
        answer = _Labelled(sys.stdout, "answer:   ")  # after the prefill's progress lines, not among them
        result = generate_text(prompt, cfg, model=model, tokenizer=tokenizer, max_new_tokens=max_new_tokens,
                               stream=answer, progress=True)
        answer.write("")
    print()
    stats = result["stats"]
    found = truth in result["text"]
    print(f"truth:    {truth}   ({'correct' if found else 'WRONG'})")
    moved = {k: format_bytes(v["bytes"]) for k, v in stats["moves"].items()}
    print(f"tiers used: device {stats['tiers']['device']['blocks']} blocks, host {stats['tiers']['host']['blocks']}, "
          f"disk {stats['tiers']['disk']['blocks']}; moved {moved}; stall {stats['stall_seconds']:.2f} s; "
          f"prefill {result['seconds']['prefill']:.1f} s, decode {result['seconds']['decode']:.1f} s")
    return 0


class _Labelled:
    """``stream`` with ``label`` written before its first text: the answer's label comes
    after the prefill's progress (on stderr), so that in one log (``2>&1``) the label stays
    with the answer; written before the run, it ended up on the first progress line."""

    def __init__(self, stream: IO[str], label: str) -> None:
        self.stream, self.label, self.started = stream, label, False

    def write(self, text: str) -> int:
        if not self.started:
            self.started = True
            self.stream.write(self.label)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()
