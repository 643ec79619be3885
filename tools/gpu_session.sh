#!/usr/bin/env bash
# The GPU checks of lowbit, in stages that each fit one 10-minute device call.
#
#   bash tools/gpu_session.sh STAGE [STAGE ...]
#
# Run from the repository root on a CUDA machine whose Python ($PYTHON, default python3) has
# torch, triton, transformers, safetensors, pytest, hypothesis and nvidia-ml-py (the lent
# H100/H200 image does); lowbit runs from src/ without being installed. Tables and logs go to
# $OUT when it is set (the device tool's folder that comes back), else to docs/results/gpu/.
# Stages:
#
#   tests         every `gpu` test (compiled Triton kernels, CUDA recipes, StaticCache +
#                 inductor)
#   gemv-int      bench_gemv, integer kernels at M = 1, 16, 2048 on 4096x4096 and 11008x4096
#                 beside cuBLAS fp16 and torch's int4 kernel (first calls tune: several
#                 compiles a shape)
#   gemv-int-big  the same on 4096x11008, 14336x4096
#   gemv-spqr     bench_gemv --formats spqr at M = 1, 16 on its six GPU shapes
#   gemv-mixed    bench_gemv --mixed (async / sync / outliers apart / none) beside cuBLAS
#                 fp16 and lowbit's 4-bit g128 and 2-bit g64 kernels
#   decode        bench_decode on the 7B-shaped random Llama: fp16, W4 g128, 2/4/16 with the
#                 Table 3 cost columns of Li et al., 2024, then SpQR 1 % and 0 %
#   memory        bench_memory --device cuda --shape 7b
#
# How many stages fit a session's device time is not measured yet (no GPU has run them);
# `tests gemv-mixed decode` covers the 2/4/16 issue's targets. Each stage writes a log and a
# table (decode: two of each) beside device.txt; the device tool returns at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dest="${OUT:-docs/results/gpu}"
stamp="$(date +%Y-%m-%d)"
shapes6="4096x4096 11008x4096 4096x11008 14336x4096 8192x8192 28672x8192"
status=0
py="${PYTHON:-python3}"

run() {  # run NAME COMMAND...: the command's output to the screen and $dest/NAME.log
    local name="$1"
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$dest/$name.log" || status=1
}

stages="tests gemv-int gemv-int-big gemv-spqr gemv-mixed decode memory"
if [ $# -eq 0 ]; then
    echo "usage: bash tools/gpu_session.sh STAGE [STAGE ...], STAGE in: $stages" >&2
    exit 2
fi
for stage in "$@"; do
    if [[ " $stages " != *" $stage "* ]]; then
        echo "unknown stage '$stage' (stages: $stages)" >&2
        exit 2
    fi
done
mkdir -p "$dest"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | tee "$dest/device.txt"
for stage in "$@"; do
    case "$stage" in
    tests) run tests "$py" -m pytest -q -p no:cacheprovider -m gpu tests ;;
    gemv-int) run gemv-int "$py" benchmarks/bench_gemv.py --device cuda \
        --shapes 4096x4096 11008x4096 --out "$dest/kernels_gpu_$stamp.md" ;;
    gemv-int-big) run gemv-int-big "$py" benchmarks/bench_gemv.py --device cuda \
        --shapes 4096x11008 14336x4096 --out "$dest/kernels_gpu_big_$stamp.md" ;;
    gemv-spqr) run gemv-spqr "$py" benchmarks/bench_gemv.py --device cuda --formats spqr \
        --rows 1 16 --shapes $shapes6 --out "$dest/spqr_gemv_gpu_$stamp.md" ;;
    gemv-mixed) run gemv-mixed "$py" benchmarks/bench_gemv.py --device cuda --mixed \
        --rows 1 16 --formats 4:128 2:64 --shapes $shapes6 \
        --out "$dest/mixed_gemv_gpu_$stamp.md" ;;
    decode)
        run decode-mixed "$py" benchmarks/bench_decode.py --device cuda --compile --cost \
            --new-tokens 256 --rows fp16 "W4 g128 (GPTQ 4-bit format)" "2/4/16 mixed" \
            --out "$dest/mixed_decode_gpu_$stamp.md"
        run decode-spqr "$py" benchmarks/bench_decode.py --device cuda --compile \
            --rows fp16 "SpQR w3 1%" "SpQR w3 0%" --out "$dest/spqr_decode_gpu_$stamp.md"
        ;;
    memory) run memory "$py" benchmarks/bench_memory.py --device cuda --shape 7b ;;
    esac
done
exit $status
