#!/usr/bin/env bash
# A/B of sm80 backward tile configs on a GPU machine, from the repository root:
#
#   scripts/bwd_config_ab.sh [CONFIG ...]
#
# Each CONFIG is a FLASHCUDA_BWD_SM80_CONFIG value ("default" = CONFIG_TABLE); without arguments,
# the table and every bwd_sm80.CANDIDATES tag, a d64 and a d128 candidate per run
# ("d64=bm128_bn64_w4,d128=bm64_bn64_w4", ...). Each runs in its own process:
#   flashcuda bench --no-extras --no-plot --peers sdpa_flash --seqlens $SEQLENS --headdims <its dims>
# and the script ends with one table of backward TFLOP/s (and x SDPA flash) per point and config.
# Records go to $OUT/ab-<config>/ (OUT defaults to ./bwd-ab-out). SEQLENS defaults to "1k 4k 16k".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bwd-ab-out}
SEQLENS=${SEQLENS:-1k 4k 16k}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHCUDA_CACHE_DIR=${FLASHCUDA_CACHE_DIR:-/tmp/flashcuda-ab-cache}
export FLASHCUDA_COMMIT=${FLASHCUDA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

configs=("$@")
if [ ${#configs[@]} -eq 0 ]; then
  mapfile -t configs < <(python3 - <<'EOF'
from itertools import zip_longest

from flashcuda.ops.bwd_sm80 import CANDIDATES
print("default")
dims = sorted(CANDIDATES)
for tags in zip_longest(*(CANDIDATES[d] for d in dims)):
    print(",".join(f"d{d}={t}" for d, t in zip(dims, tags) if t))
EOF
)
fi

# Compile every bf16 sm80 variant (forward and backward: the bench times both) once, in parallel.
python3 scripts/precompile.py --arch "$(python3 -c 'from flashcuda.jit import device_arch; print(device_arch(0))')" \
  --only sm80_bf16 > "$OUT/precompile.log" 2>&1 || tail -n 5 "$OUT/precompile.log"

for c in "${configs[@]}"; do
  dir="$OUT/ab-${c//[=,]/_}"
  mkdir -p "$dir"
  # only the head dims the config names (d64=...,d128=...); both for "default" or a bare tag
  dims=$(echo "$c" | grep -o 'd[0-9]*=' | tr -d 'd=' | tr '\n' ' ')
  dims=${dims:-64 128}
  echo "== FLASHCUDA_BWD_SM80_CONFIG=$c (head dims $dims)"
  # shellcheck disable=SC2086
  FLASHCUDA_BWD_SM80_CONFIG=$([ "$c" = default ] && echo "" || echo "$c") \
    timeout "${BENCH_TIMEOUT:-240}" python3 -m flashcuda bench --no-extras --no-plot \
    --peers sdpa_flash --seqlens $SEQLENS --headdims $dims --out "$dir" --no-print-summary \
    > "$dir/bench.log" 2>&1 || { echo "   failed (rc=$?), see $dir/bench.log"; tail -n 5 "$dir/bench.log"; }
done

python3 - "$OUT" <<'EOF'
import glob, json, os, sys

import torch

from flashcuda.ops import bwd_sm80

out = sys.argv[1]
rows = {}  # (head dim, causal, seqlen) -> {effective tag: (ours, sdpa_flash)}
for path in sorted(glob.glob(os.path.join(out, "ab-*", "sweep-*.json"))):
    rec = json.load(open(path))
    raw = rec.get("config", {}).get("kernel_env", {}).get(bwd_sm80.CONFIG_ENV, "")
    for p in rec.get("points", []):
        d = p["headdim"]
        os.environ[bwd_sm80.CONFIG_ENV] = raw
        tag = bwd_sm80.config_for(torch.bfloat16, d, p["causal"]).tag  # what ran at this head dim
        res = p.get("results", {})
        ours = res.get("flashcuda", {}).get("bwd", {}).get("tflops")
        peer = res.get("sdpa_flash", {}).get("bwd", {}).get("tflops")
        rows.setdefault((d, p["causal"], p["seqlen"]), {}).setdefault(tag, (ours, peer))
print("backward TFLOP/s (x SDPA flash in the same process); column = the tag that ran")
for d in sorted({k[0] for k in rows}):
    tags = sorted({t for k, v in rows.items() if k[0] == d for t in v})
    print(f"\nd{d}  causal  seqlen  " + "  ".join(f"{t:>22}" for t in tags))
    for (dd, causal, s), v in sorted(rows.items()):
        if dd != d:
            continue
        cells = []
        for t in tags:
            ours, peer = v.get(t, (None, None))
            cells.append(f"{ours:7.1f} ({ours / peer:4.2f}x)".rjust(22) if ours and peer else " " * 22)
        print(f"     {str(causal):<7} {s:<7} " + "  ".join(cells))
EOF
