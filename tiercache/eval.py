"""Quality of selection and retention: ``tiercache eval passkey`` and ``tiercache eval fidelity``.

passkey: a synthetic haystack (repeated filler sentences) hides one five-digit pass key at a
given depth; the haystack is prefilled in chunks, the question is then fed one token at a
time through the decode path (so per-step selection and retention act on it), and the
answer is generated greedily. Exact match: the first number in the answer equals the key.
Accuracy per (method, budget, context) comes with a 95% Wilson interval.

fidelity: teacher-forced on a long text: after prefilling ``context`` tokens, ``tokens``
next-token distributions are compared with the full cache's (KL(full || method), top-1
agreement and perplexity change): the first is the prefill's last position's, where no
method has dropped anything yet; the other ``tokens - 1`` come from the next tokens fed one
at a time through the decode path.

The full cache (transformers' DynamicCache) is always measured first: it is the baseline,
and where it fails the model itself fails. Methods: full, quest (selection, lossless),
streaming, h2o, tova, snapkv (retention, lossy). Budgets are tokens per layer (per KV head
for quest, which reads whole pages of ``block_tokens``).
"""
from __future__ import annotations

import math
import random
import re
import time
from typing import Any, Callable, Optional

from tiercache.config import TierConfig
from tiercache.models import check_token_ids
from tiercache.policies import RETENTION_POLICIES, SELECTION_POLICIES

METHODS = ("full", "quest", *RETENTION_POLICIES)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


def wilson(correct: int, total: int, z: float = 1.96) -> tuple:
    """95% Wilson score interval of ``correct / total``."""
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def method_config(method: str, budget: Optional[int], block_tokens: int,
                  device_budget: int = 1 << 20) -> Optional[TierConfig]:
    """The TierConfig of ``method`` at ``budget`` tokens (None: the full DynamicCache baseline).

    Quality does not depend on where blocks live, so everything stays on the device tier
    (``device_budget`` bytes: size it to the run's KV, the pool is allocated up front).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    if method == "full":
        return None
    common = dict(device_budget=device_budget, host_budget=0, block_tokens=block_tokens, prefetch="none")
    if method in SELECTION_POLICIES:
        return TierConfig(selection=method, selection_budget=budget, **common)
    return TierConfig(retention=method, retention_budget=budget, **common)


def check_plan(methods: list, budgets: list, block_tokens: int) -> list:
    """Validate every (method, budget) before any model work; returns the runs, full first."""
    runs = [("full", None)] if "full" in methods else []
    for method in dict.fromkeys(methods):  # a method given twice, too (a review)
        if method == "full":
            continue
        for budget in dict.fromkeys(budgets):  # a budget given twice counted the same runs twice in n
            method_config(method, budget, block_tokens)  # raises ValueError naming the problem
            runs.append((method, budget))
    if not runs:
        raise ValueError("--methods: nothing to run")
    return runs


def kv_bytes(model: Any, num_tokens: int, block_tokens: int) -> int:
    """Bytes of K and V for ``num_tokens`` tokens (rounded up to whole blocks) over every layer."""
    text = model.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    blocks = -(-num_tokens // block_tokens) + 1
    return 2 * kv_heads * head_dim * itemsize * blocks * block_tokens * text.num_hidden_layers


def make_cache(model: Any, method: str, budget: Optional[int], block_tokens: int, num_tokens: int) -> Any:
    """A fresh cache for one sample of ``num_tokens`` tokens (DynamicCache for "full")."""
    from transformers import DynamicCache

    from tiercache.hf import TieredCache

    cfg = method_config(method, budget, block_tokens, device_budget=kv_bytes(model, num_tokens, block_tokens))
    return DynamicCache(config=model.config) if cfg is None else TieredCache(model, cfg)


def _close(cache: Any) -> None:
    if hasattr(cache, "close"):
        cache.close()


# ---- passkey ------------------------------------------------------------------------------------
def passkey_sample(tokenizer: Any, context: int, depth: int, key: str) -> tuple:
    """(haystack ids, question ids) of ``context`` tokens in all, the key at ``depth`` percent."""
    import torch

    def ids(text: str) -> list:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    intro, needle, question = ids(INTRO), ids(f" The pass key is {key}. Remember it. {key} is the pass key. "), \
        ids(QUESTION)
    filler_len = context - len(intro) - len(needle) - len(question)
    if filler_len < 0:
        raise ValueError(f"--contexts: {context} tokens cannot hold the haystack's fixed parts "
                         f"({context - filler_len} tokens)")
    one = ids(FILLER)
    filler = (one * (filler_len // len(one) + 1))[:filler_len]
    at = round(filler_len * depth / 100)
    hay = intro + filler[:at] + needle + filler[at:]
    return torch.tensor([hay]), torch.tensor([question])


def answer(model: Any, cache: Any, haystack: Any, question: Any, max_new_tokens: int, chunk: int) -> list:
    """Prefill ``haystack`` in chunks, feed ``question`` token by token, decode greedily."""
    import torch

    with torch.inference_mode():
        out = None
        for start in range(0, haystack.shape[1], chunk):
            out = model(haystack[:, start:start + chunk], cache=cache, use_cache=True)
        for t in range(question.shape[1]):
            out = model(question[:, t:t + 1], cache=cache, use_cache=True)
        tokens = []
        for _ in range(max_new_tokens):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            out = model(nxt, cache=cache, use_cache=True)
    return tokens


def is_correct(text: str, key: str) -> bool:
    match = re.search(r"\d+", text)
    return match is not None and match.group(0) == key


def run_passkey(model: Any, tokenizer: Any, *, contexts: list, depths: list, trials: int, methods: list,
                budgets: list, block_tokens: int = 32, prefill_chunk: int = 1024, max_new_tokens: int = 8,
                seed: int = 0, log: Optional[Callable[[str], None]] = None) -> dict:
    """Passkey accuracy per (method, budget, context); the full cache is run first."""
    runs = check_plan(methods, budgets, block_tokens)
    # a context or depth given twice made the same samples twice, counted twice in n
    contexts, depths = list(dict.fromkeys(contexts)), list(dict.fromkeys(depths))
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    for context in contexts:
        if limit and context + max_new_tokens > limit:
            raise ValueError(f"--contexts: {context} + {max_new_tokens} new tokens exceed the model's "
                             f"{limit} positions")
    tally: dict = {}
    for context in contexts:
        for depth in depths:
            for trial in range(trials):
                key = str(random.Random(f"{seed}-{context}-{depth}-{trial}").randint(10000, 99999))
                haystack, question = passkey_sample(tokenizer, context, depth, key)
                check_token_ids(model, haystack)
                check_token_ids(model, question)
                for method, budget in runs:
                    t0 = time.perf_counter()
                    total = haystack.shape[1] + question.shape[1] + max_new_tokens
                    cache = make_cache(model, method, budget, block_tokens, total)
                    try:
                        tokens = answer(model, cache, haystack, question, max_new_tokens, prefill_chunk)
                    finally:
                        _close(cache)
                    text = tokenizer.decode(tokens)
                    ok = is_correct(text, key)
                    row = tally.setdefault((method, budget, context), {"correct": 0, "n": 0, "by_depth": {},
                                                                        "seconds": 0.0})
                    row["correct"] += ok
                    row["n"] += 1
                    row["seconds"] += time.perf_counter() - t0
                    d = row["by_depth"].setdefault(str(depth), [0, 0])
                    d[0] += ok
                    d[1] += 1
                    if log:
                        log(f"passkey context={context} depth={depth} trial={trial} {method}"
                            f"{'' if budget is None else '@' + str(budget)}: {'ok' if ok else 'WRONG'} {text!r}")
    results = []
    for (method, budget, context), row in tally.items():
        low, high = wilson(row["correct"], row["n"])
        results.append({"method": method, "budget": budget, "context": context,
                        "accuracy": row["correct"] / row["n"], "ci_low": low, "ci_high": high,
                        "correct": row["correct"], "n": row["n"],
                        "by_depth": {k: v[0] / v[1] for k, v in row["by_depth"].items()},
                        "seconds": row["seconds"]})
    return {"task": "passkey", "block_tokens": block_tokens, "results": results,
            "baseline_failures": _baseline_failures(results)}


def _baseline_failures(results: list) -> list:
    """Where the full cache itself misses: (context, depth) cells below 100%."""
    out = []
    for r in results:
        if r["method"] == "full":
            out.extend({"context": r["context"], "depth": int(d), "accuracy": a}
                       for d, a in r["by_depth"].items() if a < 1.0)
    return out


# ---- fidelity -----------------------------------------------------------------------------------
def fidelity_text_ids(tokenizer: Any, text: Optional[str], num_tokens: int) -> Any:
    """Token ids of the user's text, or of a generated one (the demo's records), ``num_tokens`` long."""
    import torch

    if text is None:
        from tiercache.demo import make_haystack

        parts, seed = [], 0
        while sum(len(p) for p in parts) < num_tokens:
            prompt, _, _ = make_haystack(200, seed=seed, filler_lines=0)
            parts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            seed += 1
        ids = [t for p in parts for t in p]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"the text has {len(ids)} tokens; --context + --tokens needs {num_tokens}")
    return torch.tensor([ids[:num_tokens]])


def teacher_forced(model: Any, cache: Any, ids: Any, context: int, chunk: int) -> Any:
    """Log-probabilities [tokens, vocab] predicting ids[context:]: row 0 from the prefill's
    last position, the others from ids[context:-1] fed one token at a time."""
    import torch

    rows = []
    with torch.inference_mode():
        out = None
        for start in range(0, context, chunk):
            out = model(ids[:, start:min(start + chunk, context)], cache=cache, use_cache=True)
        rows.append(out.logits[0, -1].float().log_softmax(-1))
        for t in range(context, ids.shape[1] - 1):
            out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            rows.append(out.logits[0, -1].float().log_softmax(-1))
    return torch.stack(rows)  # row i predicts ids[context + i]


def run_fidelity(model: Any, tokenizer: Any, *, text: Optional[str], context: int, tokens: int, methods: list,
                 budgets: list, block_tokens: int = 32, prefill_chunk: int = 1024,
                 log: Optional[Callable[[str], None]] = None) -> dict:
    """KL divergence to the full cache, top-1 agreement and perplexity change per method and budget."""
    runs = check_plan(["full", *[m for m in methods if m != "full"]], budgets, block_tokens)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit and context + tokens > limit:  # as run_passkey: a run past them measured nothing meaningful
        raise ValueError(f"--context: {context} + {tokens} scored tokens exceed the model's {limit} positions")
    ids = fidelity_text_ids(tokenizer, text, context + tokens)
    check_token_ids(model, ids)
    targets = ids[0, context:context + tokens]
    ref = None
    results = []
    for method, budget in runs:
        t0 = time.perf_counter()
        cache = make_cache(model, method, budget, block_tokens, context + tokens)
        try:
            logp = teacher_forced(model, cache, ids, context, prefill_chunk)
        finally:
            _close(cache)
        nll = -logp.gather(1, targets.view(-1, 1)).mean().item()
        if ref is None:
            ref, ref_nll = logp, nll
        kl = (ref.exp() * (ref - logp)).sum(-1).clamp(min=0)
        row = {"method": method, "budget": budget, "context": context, "tokens": tokens,
               "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
               "top1_agreement": (logp.argmax(-1) == ref.argmax(-1)).float().mean().item(),
               "perplexity": math.exp(nll), "perplexity_full": math.exp(ref_nll),
               "perplexity_change": math.exp(nll) / math.exp(ref_nll) - 1.0,
               "seconds": time.perf_counter() - t0}
        results.append(row)
        if log:
            log(f"fidelity {method}{'' if budget is None else '@' + str(budget)}: KL {row['kl_mean']:.4f}, "
                f"top-1 {row['top1_agreement']:.3f}, ppl {row['perplexity']:.3f}")
    return {"task": "fidelity", "block_tokens": block_tokens, "results": results}


# ---- output -------------------------------------------------------------------------------------
def table(report: dict) -> str:
    """A plain-text table of the results."""
    lines = []
    if report["task"] == "passkey":
        lines.append("method     budget  context  accuracy  95% CI          n   by depth")
        for r in sorted(report["results"], key=lambda r: (r["context"], r["method"] != "full", r["method"],
                                                          r["budget"] or 0)):
            depths = " ".join(f"{d}:{a:.2f}" for d, a in r["by_depth"].items())
            lines.append(f"{r['method']:<10} {str(r['budget'] or '-'):>6}  {r['context']:>7}  {r['accuracy']:>8.3f}  "
                         f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]  {r['n']:>3}   {depths}")
        if report.get("baseline_failures"):
            misses = [f"context {f['context']} depth {f['depth']}% ({f['accuracy']:.2f})"
                      for f in report["baseline_failures"]]
            lines.append("the full cache itself misses at: " + ", ".join(misses))
    else:
        lines.append("method     budget  context  KL(full||m)  top-1   ppl      ppl change")
        for r in report["results"]:
            lines.append(f"{r['method']:<10} {str(r['budget'] or '-'):>6}  {r['context']:>7}  {r['kl_mean']:>11.4f}  "
                         f"{r['top1_agreement']:.3f}  {r['perplexity']:7.3f}  {100 * r['perplexity_change']:+7.2f}%")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Accuracy (passkey) or KL (fidelity) against budget, one line per method, one panel per context."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ValueError("--plot needs matplotlib: pip install 'tiercache[lab]'") from err
    passkey = report["task"] == "passkey"
    metric = "accuracy" if passkey else "kl_mean"
    contexts = sorted({r["context"] for r in report["results"]})
    fig = Figure(figsize=(4.5 * len(contexts), 3.6))
    FigureCanvasAgg(fig)
    for i, context in enumerate(contexts):
        ax = fig.add_subplot(1, len(contexts), i + 1)
        rows = [r for r in report["results"] if r["context"] == context]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["budget"], r[metric], r.get("ci_low"), r.get("ci_high")) for r in rows
                         if r["method"] == method and r["budget"] is not None)
            if method == "full":
                full = next(r[metric] for r in rows if r["method"] == "full")
                ax.axhline(full, color="black", linestyle="--", label="full")
                continue
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", label=method)
            if passkey:
                ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], alpha=0.12)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens)")
        ax.set_ylabel("passkey accuracy" if passkey else "KL(full || method)")
        ax.set_title(f"context {context}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
