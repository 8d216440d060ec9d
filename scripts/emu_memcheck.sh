#!/usr/bin/env bash
# A CPU memcheck of the SIMT kernels: tests/cpu/test_decode_emulated.py and
# test_simt_emulated.py (the decode and the SIMT flash kernels) with the kernels built
# under AddressSanitizer by the host emulator (FLASHCUDA_EMU_ASAN=1, tests/cpu/simt_emu), python
# run with libasan preloaded. torch's CPU tensors come from malloc, so every out-of-bounds read or
# write of q / k / v / the block table / out / lse / the partials, and of shared memory, stops the
# run with the kernel's file and line. Not a GPU run (compute-sanitizer's memcheck is the GPU's).
#   scripts/emu_memcheck.sh [pytest args]     EMU_MEMCHECK_K: the -k selection (default: every
#   case but the decode oracle grid and the emulator's own tests; "" for all)
# Exits 0 with a note where the compiler has no libasan.
set -euo pipefail
cd "$(dirname "$0")/.."
asan=$("${CXX:-g++}" -print-file-name=libasan.so 2>/dev/null || true)
if [ -z "$asan" ] || [ ! -e "$asan" ]; then
  echo "emu_memcheck: no libasan.so from ${CXX:-g++}; skipped"
  exit 0
fi
logs=$(mktemp -d)
set +e
FLASHCUDA_EMU_ASAN=1 LD_PRELOAD="$asan" ASAN_OPTIONS="detect_leaks=0:log_path=$logs/asan" \
  python -m pytest -q -p no:cacheprovider tests/cpu/test_decode_emulated.py \
  tests/cpu/test_simt_emulated.py \
  -k "${EMU_MEMCHECK_K-not (caught or emulator or matches_the_oracle)}" "$@"
rc=$?
set -e
if grep -l "ERROR: AddressSanitizer" "$logs"/asan* > /dev/null 2>&1; then
  grep -h -A12 "ERROR: AddressSanitizer" "$logs"/asan*
  echo "emu_memcheck: AddressSanitizer found an error (logs in $logs)" >&2
  exit 1
fi
[ "$rc" -eq 0 ] && echo "emu_memcheck: clean"
exit "$rc"
