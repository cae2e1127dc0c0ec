#!/usr/bin/env bash
# The checks that need CUDA, in one prepared run on a GPU machine:
#   bash bench/gpu_check.sh OUTDIR [MODEL_DIR]
# MODEL_DIR: a local model folder for bench decode, e.g. the default model's config and
# tokenizer with random weights (python -m tiercache.bench.random_model SRC MODEL_DIR) where
# the weights cannot travel.
# tiercache must be installed (not only this checkout: it runs from a scratch folder, where
# the checkout's tiercache/ cannot shadow the installed package). Steps, each with its own
# time limit and log OUTDIR/<step>.log, a failed step not stopping the rest:
#   env      GPU, driver, torch, transformers, the scratch folder's filesystem
#   gputests the `gpu`-marked tests
#   decode   tiercache bench decode --json (with --model MODEL_DIR if given; $DECODE_SETUPS
#            picks the set-ups)
#   io       tiercache bench io --json (the store's disk backend: auto, kvikio where installed)
#   io_posix the same with --disk-io posix, for comparison
#   overhead tiercache bench overhead --device cuda --json (the store's Python per batch)
#   suite    the rest of the test suite on this CUDA machine (not the `model` tests)
# $STEPS (default: all seven) picks the steps to run, e.g. STEPS="env gputests io".
# $PACK: a folder made by bench/gpu_pack.sh (carried along: the GPU machine has no network).
# Its wheels (tiercache's own and the dependencies the image lacks) are installed first into
# a folder of the scratch space, put ahead on PYTHONPATH (log OUTDIR/install.log); without
# MODEL_DIR, bench decode runs on a model made there from PACK/model-src with random weights.
# Step limits are ceilings, not durations (the 2026-12-04 runs of env, gputests, decode and
# both io steps took 155 s in all); a device call runs 600 s at most, so `suite`, the
# longest, goes last, where a cut loses only it.
# Exit status: the number of steps that failed (install and model count as steps).
set -u
STEPS=${STEPS:-env gputests decode io io_posix overhead suite}
OUT=${1:?usage: gpu_check.sh OUTDIR [MODEL_DIR]}
MODEL=${2:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
# absolute: the steps run in a scratch folder
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd) || exit 1
if [ -n "$MODEL" ]; then MODEL=$(cd "$MODEL" && pwd) || exit 1; fi
if [ -n "${PACK:-}" ]; then PACK=$(cd "$PACK" && pwd) || exit 1; fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tiercache-gpu-XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
cd "$WORK" || exit 1
FAILED=0
step() {
    local name=$1 limit=$2 start rc
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name (limit ${limit}s)"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
    echo "== $name: rc=$rc in $(( $(date +%s) - start ))s"
    tail -n "${TAIL:-20}" "$OUT/$name.log"
}
env_info() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
    df -hT "$WORK"; nproc; free -g
    python3 -c "from tiercache.disk import probe_direct_io, kvikio_status; print('O_DIRECT:', probe_direct_io('$WORK'), 'kvikio:', kvikio_status())"
}
if [ -n "${PACK:-}" ]; then
    echo "== install (from $PACK)"
    if python3 -m pip install --no-deps --no-index --target "$WORK/site" "$PACK"/wheels/*.whl \
            >"$OUT/install.log" 2>&1; then
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
        python3 -c "import tiercache, transformers, crc32c; print('tiercache from', tiercache.__file__, '| transformers', transformers.__version__)"
    else
        FAILED=$((FAILED + 1))
        echo "== install failed:"; tail -n 20 "$OUT/install.log"
    fi
    case " $STEPS " in *" decode "*)  # a model to decode with, only if decode runs
        if [ -z "$MODEL" ] && [ -d "$PACK/model-src" ]; then
            MODEL="$WORK/model"
            STEPS="$STEPS model"
            step model 120 python3 -m tiercache.bench.random_model "$PACK/model-src" "$MODEL"
        fi ;;
    esac
fi
export WORK
step env 30 bash -c "$(declare -f env_info); env_info"
step gputests 90 python3 -m pytest "$REPO/tests/test_gpu.py" -v -rfEs --tb=short -p no:cacheprovider
step decode "${DECODE_LIMIT:-240}" python3 -m tiercache.cli bench decode --json --dir "$WORK" \
    ${DECODE_SETUPS:+--setups "$DECODE_SETUPS"} ${MODEL:+--model "$MODEL"}
step io 90 python3 -m tiercache.cli bench io --json --dir "$WORK" --size 1GiB
step io_posix 90 python3 -m tiercache.cli bench io --json --dir "$WORK" --size 1GiB --disk-io posix
step overhead 60 python3 -m tiercache.cli bench overhead --device cuda --json --repeat 4
# -v: each result is its own line as it comes, so failures are named even if the limit cuts
# the run short (-rfE's summary would come only at the end)
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${SUITE_WORKERS:-12}")  # pytest-xdist if installed
TAIL=5 step suite "${SUITE_LIMIT:-100}" python3 -m pytest "$REPO/tests" -v -rfE --tb=short -p no:cacheprovider \
    -m "not model and not gpu" $XDIST --timeout 100 --ignore "$REPO/tests/test_packaging.py"
[ -f "$OUT/suite.log" ] && grep -E "(FAILED|ERROR) " "$OUT/suite.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort -u | head -40
exit "$FAILED"
