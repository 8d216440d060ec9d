#!/usr/bin/env bash
# The sm90a backward's bring-up in one device call (from the repository root): every probe of
# scripts/sm90_bwd_probe.py in its own process under a timeout (a hang costs one case), with the
# watchdog on, then tests/gpu/test_bwd_sm90.py. Logs to $OUT/bwd90-*.log; a summary is last.
#
#   BRINGUP_CASES="dv:128 dk:128 ..." BRINGUP_TESTS=1 scripts/sm90_bwd_bringup.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-lane-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHCUDA_CACHE_DIR=${FLASHCUDA_CACHE_DIR:-/tmp/flashcuda-lane-cache}
export FLASHCUDA_ENABLE_SM90_BWD=1 FLASHCUDA_SM90_BWD_WATCHDOG=${FLASHCUDA_SM90_BWD_WATCHDOG:-1}
cases=${BRINGUP_CASES:-"dv:128 dv:64 dk:128 dk:64 dq:128 dq:64 tile:128 tile:64 steps:128 steps:64"}
log="$OUT/bwd90-probes.log"; : > "$log"
summary=()
for c in $cases; do
  IFS=: read -r case d <<< "$c"
  echo "=== $case d$d" >> "$log"
  timeout "${PROBE_TIMEOUT:-60}" python3 scripts/sm90_bwd_probe.py "$case" "$d" >> "$log" 2>&1
  rc=$?
  summary+=("$c rc=$rc $(awk -v c="=== $case d$d" '$0==c{f=1;next} /^===/{f=0} f && /max err/{printf "%s ", $0}' "$log" | cut -c1-160)")
done
if [ "${BRINGUP_TESTS:-1}" = 1 ]; then
  timeout "${BRINGUP_TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu tests/gpu/test_bwd_sm90.py -q -p no:cacheprovider \
    --tb=line ${BRINGUP_K:+-k "$BRINGUP_K"} > "$OUT/bwd90-tests.log" 2>&1
  summary+=("tests rc=$? $(tail -n 1 "$OUT/bwd90-tests.log")")
fi
printf '%s\n' "${summary[@]}"
