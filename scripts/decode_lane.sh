#!/usr/bin/env bash
# The decode kernels' device call, from the repository root on the GPU machine:
#
#   FLASHCUDA_COMMIT=<sha> OUT=<dir> scripts/decode_lane.sh [tests] [sanitize] [tune] [probe] [ncu]
#
# tests:    tests/gpu/test_decode.py, then test_api / test_examples' kvcache and decode cases
# sanitize: compute-sanitizer memcheck on the decode tests that reach the edges (counts 0 / 1 /
#           capacity, strided views, NaN, kvcache's steps and graph replays, determinism, paged
#           caches, cache rows, left padding, the pipeline depths, the combine modes, the
#           tensor-core step, the combine by quads and per column, CTAS_PER_SM; API errors not
#           reported: runtime.check_abi asks cuFuncGetParamInfo for one parameter past the
#           last, and its CUDA_ERROR_INVALID_VALUE is how the list's end shows)
# tune:     scripts/decode_probe.py --tune ($TUNE_ARGS, e.g. --mma-only) at batch 1 x 64k, 8 x 16k,
#           1 x 16k keys (d128, 32 / 8 heads), 1 x 64k, 8 x 16k at d64 (8 / 1 and 32 / 8 heads),
#           and the short 1 x 4k at d64 8 / 1 and d128 32 / 8 (the pieces' length there)
# probe:    scripts/decode_probe.py at batch 1 x 1k (host time of a small call)
# ncu:      ncu (full set) of one decode call and one SDPA cuDNN call at batch 1 x 64k ($NCU_ARGS:
#           the probe's shape, e.g. "--head-dim 64 --heads 8/1")
# Each step's log goes to $OUT/<step>.txt, packed at the end into $OUT/decode-lane.tgz (steps.txt and
# the ncu report stay beside it); a short table of pass/fail counts and timings ends it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/decode-lane-out}
export PYTHONPATH=$PWD FLASHCUDA_CACHE_DIR=${FLASHCUDA_CACHE_DIR:-/tmp/flashcuda-decode-cache}
mkdir -p "$OUT" "$FLASHCUDA_CACHE_DIR"
[ -d .kcache ] && cp -rn .kcache/. "$FLASHCUDA_CACHE_DIR"/ 2>/dev/null
chmod -R go-rwx "$FLASHCUDA_CACHE_DIR"
# the decode variants compiled in parallel first (a carried .kcache hits only where its NVRTC
# version is the machine's: the cache key holds it)
python3 scripts/precompile.py --only decode > "$OUT/precompile.txt" 2>&1
steps=${*:-tests sanitize tune probe}
for s in $steps; do
  t0=$(date +%s)
  case $s in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decode.py > "$OUT/tests.txt" 2>&1
      timeout 270 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_api.py tests/gpu/test_examples.py \
        -k "kvcache or decod" >> "$OUT/tests.txt" 2>&1 ;;
    sanitize)
      timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 --report-api-errors no python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_decode.py -k "per_entry or strided or nan or kvcache or determin or paged or cache_rows or depths or combine or mma_step_spans or quads or ctas_per_sm" \
        > "$OUT/sanitize.txt" 2>&1; echo "sanitizer rc $?" >> "$OUT/sanitize.txt" ;;
    tune)
      for a in "--keys 65536 --paged 16" "--batch 8 --keys 16384 --paged 256" "--keys 16384" \
          "--keys 65536 --head-dim 64 --heads 8/1" "--batch 8 --keys 16384 --head-dim 64 --heads 8/1" \
          "--keys 65536 --head-dim 64 --heads 32/8" "--batch 8 --keys 16384 --head-dim 64 --heads 32/8" \
          "--keys 4096 --head-dim 64 --heads 8/1" "--keys 4096"; do
        timeout 120 python3 scripts/decode_probe.py --tune ${TUNE_ARGS:-} $a 2>&1 | grep -v Warn
      done > "$OUT/tune.txt" ;;
    probe)
      timeout 120 python3 scripts/decode_probe.py --keys 1024 > "$OUT/probe.txt" 2>&1 ;;
    ncu)
      timeout 240 ncu --profile-from-start off --set full --target-processes all \
        -o "$OUT/decode-64k" python3 scripts/decode_probe.py --ncu ${NCU_ARGS:-} > "$OUT/ncu.txt" 2>&1
      ncu --import "$OUT/decode-64k.ncu-rep" --page details --print-units base \
        > "$OUT/ncu-details.txt" 2>&1
      gzip -f "$OUT/decode-64k.ncu-rep" ;;
  esac
  echo "== $s $(( $(date +%s) - t0 )) s" >> "$OUT/steps.txt"
done
echo "commit ${FLASHCUDA_COMMIT:-?}  $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
cat "$OUT/steps.txt"
grep -hE "passed|failed|error" "$OUT/tests.txt" "$OUT/sanitize.txt" 2>/dev/null | grep -E "^=|^[0-9]+ |ERROR SUMMARY|rc " | tail -8
grep -h "sanitizer rc\|ERROR SUMMARY" "$OUT/sanitize.txt" 2>/dev/null | tail -2
[ -f "$OUT/tune.txt" ] && grep -E "us " "$OUT/tune.txt"
[ -f "$OUT/probe.txt" ] && grep -E " us " "$OUT/probe.txt" | head -12
[ -f "$OUT/ncu-details.txt" ] && grep -E "^  [a-z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Waves Per SM" \
  "$OUT/ncu-details.txt" | head -40
# the device brings back at most 8 files: the logs in one tarball (the ncu report beside it)
(cd "$OUT" && tar czf decode-lane.tgz --exclude='*.tgz' --exclude='*.ncu-rep.gz' ./* &&
  find . -type f ! -name '*.tgz' ! -name '*.ncu-rep.gz' ! -name steps.txt -delete)
exit 0
