#!/usr/bin/env bash
# FlashAttention 4 as a bench peer on a GPU machine without network, in five consecutive device
# calls (one call carries at most 64 MiB; the wheels are ~100 MB). On this machine, once:
#
#   pip download --no-deps --pre --only-binary=:all: -d .whl flash-attn-4==4.0.0b36 \
#       nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
#       nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels \
#       --python-version 3.12 --platform manylinux_2_28_x86_64
#   (flash-attn-4 has pre-releases only: without --pre and the pin pip finds no version)
#   mkdir -p .fa4a .fa4b .fa4c .fa4d .fa4e && split -b 21M .whl/nvidia_cutlass_dsl_libs_cu13-*.whl \
#       .fa4a/cu13.part. && for p in b c d e; do mv .fa4a/cu13.part.a$p .fa4$p/; done
#   cp .whl/*.whl .fa4e/ && rm .fa4e/nvidia_cutlass_dsl_libs_cu13-*.whl
#   (.fa4a - .fa4d 21 MiB each, .fa4e the 4 MiB tail with the seven small wheels: 14 MiB)
# (each part must fit 64 MiB together with the tracked tree: ~9 MB in session 8, 17 MB in
# session 14 with the run records, 29 MB in session 21, 33 MB in session 25 (four parts of
# 23 MiB, one per call), 39 MiB in session 31: five parts of at most 21 MiB, one per call; session
# 48, the tree at 35 MiB: four parts of 26 MiB (`split -b 26M`, the tail with the small wheels))
#
# (.whl, .fa4a - .fa4e are git-ignored.) Then, on the device, in consecutive calls:
#   carry [".fa4a"], [".fa4b"], [".fa4c"], [".fa4d"]:  scripts/fa4_carry.sh stash
#   carry [".fa4e"]:  scripts/fa4_carry.sh install && FLASHCUDA_BENCH_SITE=/root/fa4 \
#                       scripts/gpu_lane.sh bench-full
# The machine must still be warm for each next call (it keeps /root between calls for ~30 s).
# The kernel cache (.kcache) does not travel with the parts: the calls compile on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${FA4_STASH:-/root/stash}
TARGET=${FA4_TARGET:-/root/fa4}
# sha256 of nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
CU13_SHA=50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

case "${1:-}" in
  stash)  # whatever parts this call carries, into the stash
    mkdir -p "$STASH"
    for d in .fa4a .fa4b .fa4c .fa4d .fa4e; do
      [ -d "$d" ] && cp "$d"/* "$STASH"/
    done
    ls -la "$STASH" ;;
  install)
    "$0" stash >/dev/null
    [ -f "$STASH/cu13.part.aa" ] || { echo "no $STASH/cu13.part.aa: run 'stash' in the previous calls" >&2; exit 1; }
    cat "$STASH"/cu13.part.* > "$STASH/$CU13"
    echo "$CU13_SHA  $STASH/$CU13" | sha256sum -c -
    rm -f "$STASH"/cu13.part.*
    python3 -m pip install -q --no-deps --no-index --target "$TARGET" "$STASH"/*.whl
    python3 -c "import site; site.addsitedir('$TARGET'); import flash_attn.cute as m; print('fa4 ok:', m.__file__)" ;;
  *)
    echo "usage: $0 stash|install" >&2; exit 2 ;;
esac
