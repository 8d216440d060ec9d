#!/usr/bin/env bash
# Another NVRTC on a GPU machine without network: the one `pip install flashcuda[cu13]` resolves
# today (nvidia-cuda-nvrtc 13.5.37 on 2026-12-01) instead of the image's 13.0, so the kernels a
# user compiles are the ones measured. The wheel (58 MB) and the tracked tree (~29 MB) exceed one
# call's 64 MiB: two consecutive calls. On this machine, once:
#
#   pip download --no-deps -d .whl nvidia-cuda-nvrtc==13.5.37
#   mkdir -p .nvrtca .nvrtcb
#   split -b 30M .whl/nvidia_cuda_nvrtc-13.5.37-*.whl .nvrtca/nvrtc.part.
#   mv .nvrtca/nvrtc.part.ab .nvrtcb/
#
# (.whl, .nvrtca, .nvrtcb are git-ignored.) Then, on the device, in consecutive calls (the
# machine keeps /root for ~30 s between calls):
#   carry [".nvrtca"]:  scripts/nvrtc_carry.sh stash
#   carry [".nvrtcb"]:  scripts/nvrtc_carry.sh install && eval "$(scripts/nvrtc_carry.sh env)" \
#                         && scripts/gpu_session.sh lane:info,tests ...
# `env` prints the exports that load it first (LD_PRELOAD: flashcuda.jit.compiler and
# cuda.bindings then find this libnvrtc.so.13 already loaded; LD_LIBRARY_PATH: its builtins).
# `flashcuda info` and every run record's versions.nvrtc name the version that compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=${NVRTC_STASH:-/root/stash-nvrtc}
TARGET=${NVRTC_TARGET:-/root/nvrtc}
WHEEL=nvidia_cuda_nvrtc-13.5.37-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl
SHA=${NVRTC_SHA:-86b4d68058807988b7d9af5b44917a0601e9c337f35ccd657bfb3c759ff8d8bc}
LIB=$TARGET/nvidia/cu13/lib

case "${1:-}" in
  stash)  # whatever parts this call carries, into the stash
    mkdir -p "$STASH"
    for d in .nvrtca .nvrtcb; do
      [ -d "$d" ] && cp "$d"/* "$STASH"/
    done
    ls -la "$STASH" ;;
  install)
    "$0" stash >/dev/null
    [ -f "$STASH/nvrtc.part.aa" ] && [ -f "$STASH/nvrtc.part.ab" ] \
      || { echo "$STASH lacks a part: run 'stash' in the previous call" >&2; exit 1; }
    cat "$STASH"/nvrtc.part.* > "$STASH/$WHEEL"
    echo "$SHA  $STASH/$WHEEL" | sha256sum -c -
    rm -f "$STASH"/nvrtc.part.*
    mkdir -p "$TARGET" && python3 -m zipfile -e "$STASH/$WHEEL" "$TARGET"
    ls "$LIB" ;;
  env)
    echo "export LD_LIBRARY_PATH=$LIB\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export LD_PRELOAD=$LIB/libnvrtc.so.13\${LD_PRELOAD:+:\$LD_PRELOAD}" ;;
  *)
    echo "usage: $0 stash|install|env" >&2; exit 2 ;;
esac
