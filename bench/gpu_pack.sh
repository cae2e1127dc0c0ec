#!/usr/bin/env bash
# What a GPU machine of this workplace lacks, packed here to carry along (it has no network,
# and a call carries 64 MiB of ignored files):
#   bash bench/gpu_pack.sh [PACK]          (default: .gpu-pack in the checkout, git-ignored)
# PACK/wheels     this checkout's tiercache wheel, and for CPython $PY (default 3.12, the
#                 image's) on x86-64 Linux the dependencies the image lacks or holds in versions
#                 tiercache refuses (transformers 5.24+, crc32c, kvikio-cu13, ...): the same
#                 versions as this machine's .venv where it has them. Not numpy, torch or cupy:
#                 the image has them, and they alone would fill the 64 MiB.
# PACK/model-src  the default model's config and tokenizer, no weights (94 MB of GGUF cannot
#                 travel): bench/gpu_check.sh makes random weights from it there.
# Then, with the device tool (one call; see bench/gpu_check.sh for the steps):
#   run(carry=[".gpu-pack"], timeout_s=560,
#       command="PACK=.gpu-pack bash bench/gpu_check.sh out-gpu")
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PACK=${1:-$REPO/.gpu-pack}
PY=${PY:-3.12}
VENV_PY=${VENV_PY:-$REPO/.venv/bin/python}
rm -rf "$PACK/wheels" "$PACK/model-src"
mkdir -p "$PACK/wheels" "$PACK/model-src"
PACK=$(cd "$PACK" && pwd)
# this checkout, as committed or not (what is being checked)
"$VENV_PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$PACK/wheels" "$REPO"
pinned() {  # NAME==VERSION as this venv has it, else NAME (the newest)
    local v
    v=$("$VENV_PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1")
    echo "$1${v:+==$v}"
}
WANTED=()
for name in transformers huggingface_hub tokenizers safetensors crc32c aiofiles prometheus-client; do
    WANTED+=("$(pinned "$name")")
done
WANTED+=(kvikio-cu13)  # the image's CUDA is 13 (torch 2.11+cu130)
"$VENV_PY" -m pip download --quiet --dest "$PACK/wheels" --only-binary=:all: \
    --python-version "$PY" --implementation cp --abi "cp${PY/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${WANTED[@]}"
# the image's own (and the bulk): numpy, torch, cupy and NVIDIA's CUDA libraries
rm -f "$PACK"/wheels/numpy-* "$PACK"/wheels/torch-* "$PACK"/wheels/cupy* "$PACK"/wheels/nvidia_*
MODEL_SRC=$("$VENV_PY" -c "from tiercache.models import ensure_converted; print(ensure_converted())")
for name in config.json generation_config.json tokenizer.json tokenizer_config.json \
            special_tokens_map.json chat_template.jinja; do
    if [ -f "$MODEL_SRC/$name" ]; then cp "$MODEL_SRC/$name" "$PACK/model-src/"; fi
done
SIZE=$(du -sm "$PACK" | cut -f1)
echo "packed $(ls "$PACK/wheels" | wc -l) wheels and the model's config in $PACK: ${SIZE} MiB"
if [ "$SIZE" -gt 60 ]; then
    echo "gpu_pack: $PACK is ${SIZE} MiB; a device call carries 64 MiB in all" >&2
    exit 1
fi
