#!/usr/bin/env bash
# One device call of a session, from the repository root on the GPU machine:
#
#   FLASHCUDA_COMMIT=<sha> scripts/gpu_session.sh PLAN...
#
# Each PLAN item is "label:step[,step...]" and runs `scripts/gpu_lane.sh step...` with
# OUT=$OUT/label (so one call can hold several lanes without one lane.json overwriting another),
# e.g.   scripts/gpu_session.sh lane:info,tests kt:kernel-times ab:ab
# Extra item kinds: "kernel-times" (scripts/kernel_times.py into $OUT/label/kernel-times.txt).
# Before the first item, the precompiled kernels carried in .kcache (if any) are copied into the
# lane's private cache directory. After the last, everything under $OUT is packed into
# $OUT/all-<pid>.tgz (the device tool brings back at most 8 files; a second invocation in the same
# call adds its own tarball) and each lane's summary is printed.
# Environment for the steps (TESTS_TIMEOUT, AB_VARIANTS, ...) passes through.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-lane-out}
CACHE=${FLASHCUDA_CACHE_DIR:-/tmp/flashcuda-lane-cache}
mkdir -p "$OUT" "$CACHE"
if [ -d .kcache ]; then
  cp -rn .kcache/. "$CACHE"/ 2>/dev/null
fi
chmod -R go-rwx "$CACHE"
export FLASHCUDA_CACHE_DIR=$CACHE

for item in "$@"; do
  label=${item%%:*}
  steps=${item#*:}
  mkdir -p "$OUT/$label"
  if [ "$steps" = kernel-times ]; then
    PYTHONPATH="$PWD" timeout "${KT_TIMEOUT:-150}" python3 scripts/kernel_times.py ${KT_ARGS:-} \
      > "$OUT/$label/kernel-times.txt" 2>&1
    grep -E "==|total" "$OUT/$label/kernel-times.txt" | grep -v Warn
  else
    OUT="$OUT/$label" scripts/gpu_lane.sh ${steps//,/ } 2>&1 | tail -n "${TAIL_LINES:-30}"
  fi
done

# One tarball per invocation (all-<pid>.tgz), so two invocations in one device call keep both.
cd "$OUT" && tar czf "all-$$.tgz" --exclude='all*.tgz' ./* \
  && find . -mindepth 1 ! -name 'all*.tgz' -delete
