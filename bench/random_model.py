"""``python -m tiercache.bench.random_model SRC DST``: a model folder with SRC's config and
tokenizer and random weights (seed 0).

For speed runs where the real weights cannot travel (the GPU checks: a device call carries
64 MiB, the default model's GGUF file is 94 MB). Tokens/s does not depend on the weights'
values; the tokens do. SRC is any local model folder (the default model's converted folder:
``tiercache.models.ensure_converted()``)."""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "chat_template.jinja")


def make(src: str, dst: str, seed: int = 0) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src, local_files_only=True))
    model.save_pretrained(dst)
    for name in _COPIED:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def main(argv: Optional[list] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    print("random-weight model in", make(*args))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
