#!/usr/bin/env bash
# The GPU checks of lowbit, in stages that each fit one device call.
#
#   bash tools/gpu_session.sh STAGE[:SECONDS] [STAGE[:SECONDS] ...]
#
# Built around the lent device's limits: one command at most 10 minutes, 15 minutes of device
# time a session (start-up included), a fresh machine whenever it went idle for 30 s, and at
# most 8 files back. So: several stages per call, each under its own time limit so that one slow
# stage cannot take the call's output with it, and Triton's compiled kernels kept in
# .triton-cache/ under the repository (ignored by git) so that a later call on a fresh machine
# reuses them -- pass it to the device tool's `carry`. Run from the repository root on a CUDA
# machine whose Python ($PYTHON, default python3) has torch, triton, transformers, safetensors,
# pytest and hypothesis; lowbit runs from src/ without being installed. Tables and logs go to
# $OUT/gpu.tgz when $OUT is set (the device tool's folder that comes back), else to
# docs/results/gpu/.
#
# The plan, in order, with what the first run took (H200, 2026-11-26, docs/results/gpu.md):
#
#   smoke       versions; every kernel compiled and launched once with tuning off against its
#               torch reference, with the resources the driver loaded it with
#               (tools/gpu_smoke.py), the 2/4/16 down projection first. Stop here if anything
#               fails. Smoke and int-4096 together: 182 s on a fresh H200, compiles included;
#               smoke alone over 90 s on a fresh H100; since 2026-11-27 it also launches
#               the three formats' weight decoders (ten more compiles: give it 170); later
#               that day every non-default M = 1 tile loop (TMA) and bf16 SpQR and 2/4/16
#               GEMVs (8 more: 180); then 8-bit g128 (8 more: 200)
#   irregular   the kernel tests on irregular shapes (tests/kernels, compiled instead of
#               interpreted) and every `gpu` test of tests/kernels: 46 tests in 60 s, not finished
#   int-4096    bench_gemv, 4-bit g128 at M = 1, 16, 256, 2048 on 4096x4096 (tuning on; from
#               M = 256 the decoded weight + cuBLAS beside the fused prefill kernel)
#   int-11008   the same on 11008x4096: under 100 s
#   int-28672   the same on 28672x8192
#   spqr        bench_gemv --formats spqr at M = 1, 16 on 4096x4096 and 11008x4096: over 70 s
#   mixed       bench_gemv --mixed at M = 1, 16 on 4096x4096 and 11008x4096: over 90 s
#   prefill     bench_gemv at M = 2048 on 11008x4096: SpQR's and 2/4/16's prefill (weights
#               decoded by spqr_dequantize_dense and mixed_dequant, then cuBLAS) beside
#               cuBLAS fp16 (not yet run)
#   decode      bench_decode on the 7B-shaped random Llama, compiled (CUDA graphs) only: W4
#               g128 first (three stages ended before it, behind fp16, which two runs measured),
#               then fp16 and 2/4/16 (with eager rows as well: over 240 s before W4 compiled)
#   decode-spqr bench_decode: fp16, SpQR w3 1 % and 0 %
#   kv-decode   bench_packed_decode: one layer's decode attention over packed KV pages (Triton:
#               kv-int, KVQuant with and without outliers) beside torch's SDPA over fp16, at
#               4k, 32k and 128k tokens of Llama-3-8B's KV shape (not yet run)
#   tests       every `gpu` test of the repository: 41 tests in 95 s, not finished (second run:
#               41 passed in 82 s, then the 2/4/16 kernel refused at 4096x11008; third, H100:
#               41 passed in 120 s, the 42nd still running at the limit)
#
# STAGE:SECONDS stops a stage after SECONDS (its log so far is kept). With $OUT set, the logs
# and tables are written under /tmp/lowbit-gpu and archived to $OUT/gpu.tgz after every stage
# (the device tool brings back 8 files at most), so a call cut by its own limit still returns
# what the stages before it measured. The first run's two calls were, in effect:
#   bash tools/gpu_session.sh smoke:170 int-4096:150
#   bash tools/gpu_session.sh decode:220 int-11008:100 mixed:90 spqr:70 irregular:60
# the second while the machine was still warm (30 s). The second run (same day) was
#   bash tools/gpu_session.sh smoke:100 int-4096:110 tests:130 decode:210
# (444 s; decode did not reach the compiled W4 row). The third (H100, same day) was
#   bash tools/gpu_session.sh smoke:90 decode:240 int-11008:90 mixed:80 spqr:60 irregular:50
# (546 s; every stage cut by its limit but int-11008), then tests:120 while warm. The fourth
# (H200, 2026-11-27) was
#   bash tools/gpu_session.sh smoke:160 int-11008:100 prefill:60 decode:230
#   bash tools/gpu_session.sh mixed:110 spqr:80 irregular:60
# (505 s and 251 s: smoke 44 launches, all ok; prefill failed on SpQR's capture, since fixed;
# decode cut before the compiled W4 row a third time: give decode a call of its own). Whatever
# the GPU measures goes to docs/results/ with the date and the device.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="$PWD/.triton-cache"
archive="${OUT:+$OUT/gpu.tgz}"
dest="${OUT:+/tmp/lowbit-gpu}"
dest="${dest:-docs/results/gpu}"
stamp="$(date +%Y-%m-%d)"
status=0
py="${PYTHON:-python3}"

limit=0  # the current stage's seconds (0: none)
run() {  # run NAME COMMAND...: the command's output to the screen and $dest/NAME.log
    local name="$1"
    shift
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$dest/$name.log" || status=1
}

gemv_int() {  # gemv_int NAME SHAPE: 4-bit g128 beside cuBLAS fp16 and torch's int4 kernel
    run "$1" "$py" benchmarks/bench_gemv.py --device cuda --formats 4:128 --rows 1 16 256 2048 \
        --shapes "$2" --out "$dest/${1}_$stamp.md"
}

stages="smoke irregular int-4096 int-11008 int-28672 spqr mixed prefill decode decode-spqr kv-decode tests"
if [ $# -eq 0 ]; then
    echo "usage: bash tools/gpu_session.sh STAGE[:SECONDS] ..., STAGE in: $stages" >&2
    exit 2
fi
for arg in "$@"; do
    stage="${arg%%:*}"
    if [[ " $stages " != *" $stage "* ]] || ! [[ "${arg#"$stage"}" =~ ^(:[0-9]+)?$ ]]; then
        echo "unknown stage '$arg' (STAGE or STAGE:SECONDS, stages: $stages)" >&2
        exit 2
    fi
done
mkdir -p "$dest" "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | tee "$dest/device.txt"
for arg in "$@"; do
    stage="${arg%%:*}"
    limit=0
    [[ "$arg" == *:* ]] && limit="${arg#*:}"
    case "$stage" in
    smoke)
        "$py" -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$dest/device.txt"
        LOWBIT_TRITON_TUNE=0 run smoke "$py" tools/gpu_smoke.py
        ;;
    irregular) run irregular "$py" -m pytest -q -p no:cacheprovider tests/kernels ;;
    int-4096) gemv_int int-4096 4096x4096 ;;
    int-11008) gemv_int int-11008 11008x4096 ;;
    int-28672) gemv_int int-28672 28672x8192 ;;
    spqr) run spqr "$py" benchmarks/bench_gemv.py --device cuda --formats spqr --rows 1 16 \
        --shapes 4096x4096 11008x4096 --out "$dest/spqr_gemv_$stamp.md" ;;
    mixed) run mixed "$py" benchmarks/bench_gemv.py --device cuda --mixed --rows 1 16 \
        --formats 4:128 --shapes 4096x4096 11008x4096 --out "$dest/mixed_gemv_$stamp.md" ;;
    prefill) run prefill "$py" benchmarks/bench_gemv.py --device cuda --mixed --formats spqr \
        --rows 2048 --shapes 11008x4096 --out "$dest/prefill_$stamp.md" ;;
    decode) run decode "$py" benchmarks/bench_decode.py --device cuda --compiled-only --cost \
        --new-tokens 128 --rows "W4 g128 (GPTQ 4-bit format)" fp16 "2/4/16 mixed" \
        --out "$dest/decode_$stamp.md" ;;
    decode-spqr) run decode-spqr "$py" benchmarks/bench_decode.py --device cuda --compiled-only \
        --new-tokens 128 --rows fp16 "SpQR w3 1%" "SpQR w3 0%" --out "$dest/decode_spqr_$stamp.md" ;;
    kv-decode) run kv-decode "$py" benchmarks/bench_packed_decode.py --device cuda \
        --contexts 4096 32768 131072 --out "$dest/kv_decode_$stamp.md" --force ;;
    tests) run tests "$py" -m pytest -q -p no:cacheprovider -m gpu tests ;;
    esac
    [ -n "$archive" ] && tar czf "$archive" -C "$dest" .
done
du -sh "$TRITON_CACHE_DIR" | tee -a "$dest/device.txt"
exit $status
