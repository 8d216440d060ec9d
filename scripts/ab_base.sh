#!/usr/bin/env bash
# A previous commit's package next to the work tree, for a same-run A/B of kernel code on the
# device (the device copy has no .git):
#
#   scripts/ab_base.sh <rev>        # writes .abbase/ (ignored by git); carry it: carry [".abbase"]
#   # on the device:  PYTHONPATH=.abbase python3 scripts/masked_v_probe.py   (the old kernels)
#   #                 PYTHONPATH=.       python3 scripts/masked_v_probe.py   (the new ones)
#
# Kernels are cached by source hash, so both trees share one cache without mixing entries.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/ab_base.sh <rev>}
rm -rf .abbase && mkdir .abbase
git archive "$rev" flashcuda | tar -x -C .abbase
echo "$(git rev-parse "$rev")" > .abbase/REV
echo ".abbase: flashcuda/ of $(cat .abbase/REV)"
