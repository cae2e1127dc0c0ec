"""Wrap a model once; every generate() call then gets its own TieredCache.

    python examples/wrap_model.py
"""
import tempfile

import torch

import tiercache
from tiercache.models import load_model

model, tokenizer = load_model()
with tempfile.TemporaryDirectory() as tmp:
    model = tiercache.wrap(model, tiercache.TierConfig(device_budget="8MiB", host_budget="8MiB",
                                                       disk_dir=f"{tmp}/kv", block_tokens=64))
    for question in ("What is the capital of France?", "Name a prime number larger than 10."):
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        print(question, "->", tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        print("   stats:", model.tiercache_last.stats()["hits"])
