#!/usr/bin/env bash
# The GPU lane, in one call on a GPU machine (DESIGN.md §7), from the repository root:
#
#   FLASHCUDA_COMMIT=$(git rev-parse HEAD) scripts/gpu_lane.sh [steps...]
#
# steps (default: info tests sanitize latency bench):
#   info       flashcuda info
#   tests      pytest -m gpu (the whole GPU lane), junit xml + log
#   sanitize   compute-sanitizer memcheck + racecheck (+ synccheck, initcheck) on the boundary-shape
#              suite (tests/gpu/test_sanitize.py; SANITIZE_K narrows it, e.g. "sm90 and not 65537": the
#              23 sm90 cases: ~15-30 s per tool, racecheck ~140 s; plain "sm90" adds three 65537-row
#              cases, which take racecheck and initcheck past minutes),
#              torch's caching allocator off so every tensor is its own allocation and an overrun is
#              visible. SANITIZE_TOOLS picks the tools (default "memcheck racecheck synccheck
#              initcheck"); the tool "none" runs the suite once without a sanitizer (a quick
#              correctness pass that also fills the kernel cache); the log is sanitize.log, or
#              sanitize-$SANITIZE_LABEL.log. SANITIZE_ARGS: more compute-sanitizer options, e.g.
#              "--kernel-regex kns=flash_" to check flashcuda's kernels only (not the oracle's)
#   soak       scripts/soak.py: SOAK_CALLS (default 10000) random-shape calls through the API, an
#              oracle check on a sample, memory flat; record soak-*.json (SOAK_ARGS: more options)
#   host       host-side microseconds per call (scripts/host_overhead.py; HOST_ARGS, e.g.
#              "--shape 1 2048 32 128 --causal")
#   latency    first-call latency: compile in a fresh cache, cache hit in a new process
#   bench      flashcuda bench --quick;   bench-full: the standard sweep;   ladder: ladder rungs
#   ab-sm90    the sm90 forward's scheduling variants (ping-pong, snake order, both, neither)
#   ncu        Nsight Compute sections of the sm90 forward and backward kernels at one shape
#              (NCU_SHAPE, NCU_ARGS, NCU_KERNELS), ncu.txt
#   ncu-source warp-stall samples per SASS instruction of one kernel (NCU_KERNELS, default
#              flash_bwd_sm90): ncu-source.ncu-rep, ncu-source-sass.csv, ncu-source-top.txt
#              (NCU_HOT=N adds the steady loop: the instructions run N to 4N times)
#   ncu-full   `ncu --set full` of one kernel (NCU_KERNELS, NCU_SHAPE, NCU_ARGS as ncu-source; e.g.
#              NCU_ARGS="--impl fa4" for the peer's): ncu-full-details.txt, ncu-full-raw.csv, and
#              the pipes that bound a step printed (L1/TEX, the LSU's shared wavefronts by op,
#              bank reads / writes, tensor pipe, issue slots)
#   timeline   the sm90 forward's per-CTA timeline (scripts/sm90_timeline.py) at TIMELINE_SHAPES
#              (default: the serving shape 1 2048 32 128 and 4 4096 16 128, causal), both
#              work-tile orders: timeline-*.json / .png, a summary per run
#   timeline-bwd  the sm90 backward's per-CTA timeline (scripts/sm90_bwd_timeline.py: entry, K / V
#              arrival, first / last step, step 0 split at its S^T wait and dS^T barrier, step
#              1's end, exit per CTA; fixed cost per CTA, idle gaps per SM; the kernel's defines
#              from FLASHCUDA_SM90_BWD_DEFINES, e.g. FC_MASK_NEVER=1) at
#              TIMELINE_BWD_SHAPES, ";"-separated, each "B S H D [options]" (default "4 1024 16
#              128;4 4096 16 128;4 4096 16 128 --causal"; options: --causal, --kv-heads N):
#              timeline-bwd-*.json / .png, timeline-bwd.txt
#   ab-probe   the same-process A/B (scripts/ab_probe.py ${AB_PROBE_ARGS}): arms rotated per
#              round, per-round ratios with p10-p90; ab-probe.txt / .json
#   power      sustained rate, SM clock and power draw (scripts/power_probe.py ${POWER_ARGS}):
#              the long d128 calls run at the power cap, where same-process arms share one
#              clock (perf-notes, session 24); POWER_ENVS="label:VAR=VAL ..." runs it once per
#              arm, arms interleaved twice; power-probe.txt
#   ab         any A/B: AB_VARIANTS="label:VAR=VAL[,VAR=VAL] ..." (e.g. "v2:FLASHCUDA_SM90_BWD_DQ=v2
#              v4:FLASHCUDA_SM90_BWD_DQ=v4"), AB_REPS (2) processes per variant interleaved, bench
#              ${AB_ARGS} (default 1k 4k 16k, both head dims, causal both), one table per direction
# Each step runs under a timeout (TESTS_TIMEOUT, SANITIZE_TIMEOUT per tool, SOAK_TIMEOUT,
# BENCH_TIMEOUT) so one hung step cannot eat the whole call.
# Logs and records go to $OUT (the device tool's folder) or ./gpu-lane-out. A short table is last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-lane-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHCUDA_CACHE_DIR=${FLASHCUDA_CACHE_DIR:-/tmp/flashcuda-lane-cache}
export FLASHCUDA_TEST_SHARED_CACHE=1
export FLASHCUDA_COMMIT=${FLASHCUDA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
steps=("$@")

# run_ab VARIANTS BENCH_ARGS TABLE: each "label:VAR=VAL[,VAR=VAL]" of VARIANTS benched in
# AB_REPS processes (default 2; the same kernel read up to ±3-6% between arms of two processes
# in session 18, so a 1-3% claim wants 3-4), interleaved (bench BENCH_ARGS, cuDNN as the peer),
# then one TFLOP/s table per direction timed into TABLE (scripts/compare_records.py).
run_ab() {
  local variant label assigns r=0 labels=()
  for rep in $(seq "${AB_REPS:-2}"); do
    for variant in $1; do
      label=${variant%%:*}; assigns=${variant#*:}
      [ $rep = 1 ] && labels+=("$label=$OUT/ab-$label")
      env ${assigns//,/ } timeout "${AB_TIMEOUT:-90}" python3 -m flashcuda bench --no-extras \
        --no-plot --peers sdpa_cudnn $2 --out "$OUT/ab-$label" > /dev/null 2>&1 || r=$?
    done
  done
  { python3 scripts/compare_records.py --direction fwd "${labels[@]}"
    [[ " $2 " == *" --fwd-only "* ]] || python3 scripts/compare_records.py --direction bwd "${labels[@]}"
  } | tee "$3"
  return $r
}
[ ${#steps[@]} -eq 0 ] && steps=(info tests sanitize latency bench)
status=()

for step in "${steps[@]}"; do
  t0=$(date +%s)
  case "$step" in
    info)
      python3 -m flashcuda info | tee "$OUT/info.txt"; rc=$? ;;
    tests)
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -m gpu tests/gpu -q --maxfail=60 -p no:cacheprovider \
        --tb=short --junitxml="$OUT/gpu-tests.xml" ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu-tests.log" 2>&1
      rc=${PIPESTATUS[0]}; tail -n 25 "$OUT/gpu-tests.log" ;;
    sanitize)
      rc=0
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
        if [ "$tool" = none ]; then
          timeout "${SANITIZE_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 \
            tests/gpu/test_sanitize.py ${SANITIZE_K:+-k "$SANITIZE_K"} > "$OUT/sanitize-tool-$tool.log" 2>&1
        else
          # initcheck skips API memory accesses: with a kernel filter (SANITIZE_ARGS --kernel-name)
          # torch's kernels are not instrumented, so every copy of what they wrote reads as
          # uninitialised (session 7), and the run outlasted 300 s on the 23 sm90 cases (session
          # 10); with the option, 9 s. Our kernels' own reads are still checked.
          extra=""; [ "$tool" = initcheck ] && extra="--check-api-memory-access no"
          PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" ${SANITIZE_ARGS:-} $extra --error-exitcode 99 \
            --report-api-errors no --print-limit 20 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_sanitize.py \
            ${SANITIZE_K:+-k "$SANITIZE_K"} > "$OUT/sanitize-tool-$tool.log" 2>&1
        fi
        r=$?; echo "compute-sanitizer $tool: rc=$r  $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize-tool-$tool.log" | tail -n 2 | tr '\n' ' ')"
        [ $r -ne 0 ] && rc=$r
      done
      # one log per step (SANITIZE_LABEL names it when a call runs several sanitize steps)
      cat "$OUT"/sanitize-tool-*.log > "$OUT/sanitize${SANITIZE_LABEL:+-$SANITIZE_LABEL}.log"
      rm -f "$OUT"/sanitize-tool-*.log ;;
    soak)
      timeout "${SOAK_TIMEOUT:-400}" python3 scripts/soak.py --calls "${SOAK_CALLS:-10000}" --max-seconds "${SOAK_MAX_SECONDS:-330}" \
        --out "$OUT" ${SOAK_ARGS:-} > "$OUT/soak.log" 2>&1; rc=$?; tail -n 14 "$OUT/soak.log" ;;
    host)
      python3 scripts/host_overhead.py ${HOST_ARGS:-} > "$OUT/host-overhead.txt" 2>&1; rc=$?; head -n 30 "$OUT/host-overhead.txt" ;;
    latency)
      { python3 scripts/jit_latency.py --kernel smoke; python3 scripts/jit_latency.py --kernel flash; } \
        > "$OUT/latency.jsonl"; rc=$?; cat "$OUT/latency.jsonl" ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" python3 -m flashcuda bench --quick --out "$OUT/bench" > "$OUT/bench.log" 2>&1; rc=$?; tail -n 40 "$OUT/bench.log" ;;
    bench-full)
      timeout "${BENCH_TIMEOUT:-540}" python3 -m flashcuda bench --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; rc=$?; tail -n 60 "$OUT/bench.log" ;;
    ladder)
      python3 -m flashcuda bench ladder --out "$OUT/bench" > "$OUT/ladder.log" 2>&1; rc=$?; tail -n 40 "$OUT/ladder.log" ;;
    ab-sm90)
      # the sm90 forward's scheduling switches set explicitly (dispatch's rule: ping-pong on,
      # snake with a mask)
      P=FLASHCUDA_SM90_PINGPONG S=FLASHCUDA_SM90_SNAKE
      run_ab "plain:$P=0,$S=0 pingpong:$P=1,$S=0 snake:$P=0,$S=1 both:$P=1,$S=1" \
        "--fwd-only ${AB_ARGS:---seqlens 1k 4k 16k}" "$OUT/ab-sm90.txt"; rc=$? ;;
    ab)
      run_ab "${AB_VARIANTS:?AB_VARIANTS is empty}" "${AB_ARGS:---seqlens 1k 4k 16k}" "$OUT/ab.txt"
      rc=$? ;;
    ab-probe)
      # the same A/B inside one process, arms rotated per round (scripts/ab_probe.py):
      # AB_PROBE_ARGS, e.g. "--arm def: --arm mb:FLASHCUDA_SM90_FWD_DEFINES=FC_MASK_BITS=0
      # --shapes 32,512,16,64 --causal 1 --rounds 15"
      timeout "${AB_TIMEOUT:-300}" python3 scripts/ab_probe.py ${AB_PROBE_ARGS:?AB_PROBE_ARGS is empty} \
        --out "$OUT/ab-probe.json" > "$OUT/ab-probe.txt" 2>&1; rc=$?; cat "$OUT/ab-probe.txt" ;;
    power)
      rc=0
      for round in 1 2; do
        for arm in ${POWER_ENVS:-def:}; do
          echo "== ${arm%%:*} (round $round)"
          env ${arm#*:} timeout "${POWER_TIMEOUT:-120}" python3 scripts/power_probe.py ${POWER_ARGS:-} \
            2>&1 | grep -v Warn || rc=$?
          [ -n "${POWER_ENVS:-}" ] || break 2
        done
      done > "$OUT/power-probe.txt"; cat "$OUT/power-probe.txt" ;;
    ncu)
      # Nsight Compute on the second call's sm90 kernels (scripts/profile_call.py): speed of
      # light, compute (tensor pipe), warp states (stall reasons), scheduler, memory sections.
      # NCU_SHAPE (default "4 4096 16 128"), NCU_ARGS (e.g. "--causal"), NCU_KERNELS (regex,
      # default flash_(fwd|bwd)_sm90), NCU_EXTRA (more ncu options, e.g. --metrics); clocks left
      # alone (--clock-control none, METHOD.md).
      timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none -k "regex:${NCU_KERNELS:-flash_(fwd|bwd)_sm90}" \
        --launch-skip "${NCU_SKIP:-1}" --launch-count "${NCU_COUNT:-2}" \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy ${NCU_EXTRA:-} \
        python3 scripts/profile_call.py --bwd --shape ${NCU_SHAPE:-4 4096 16 128} ${NCU_ARGS:-} \
        > "$OUT/ncu.txt" 2>&1; rc=$?
      grep -E "flash_|Duration|Compute \(SM\) Throughput|Issue Slots Busy|Stall|stalled|pipe_tensor|Warp Cycles Per Issued" \
        "$OUT/ncu.txt" | head -n 40 ;;
    timeline)
      rc=0
      IFS=';' read -ra shapes <<< "${TIMELINE_SHAPES:-1 2048 32 128;4 4096 16 128}"
      for shape in "${shapes[@]}"; do
        for snake in 0 1; do
          timeout "${TIMELINE_TIMEOUT:-120}" python3 scripts/sm90_timeline.py --shape $shape --causal \
            --snake "$snake" --out "$OUT" >> "$OUT/timeline.txt" 2>&1 || rc=$?
        done
      done
      cat "$OUT/timeline.txt" ;;
    timeline-bwd)
      rc=0
      IFS=';' read -ra shapes <<< "${TIMELINE_BWD_SHAPES:-4 1024 16 128;4 4096 16 128;4 4096 16 128 --causal}"
      for shape in "${shapes[@]}"; do
        timeout "${TIMELINE_TIMEOUT:-120}" python3 scripts/sm90_bwd_timeline.py --shape $shape \
          --out "$OUT" >> "$OUT/timeline-bwd.txt" 2>&1 || rc=$?
      done
      cat "$OUT/timeline-bwd.txt" ;;
    ncu-source)
      # Warp-stall samples per SASS instruction of one kernel (default the sm90 backward) at
      # NCU_SHAPE: the report (ncu-source.ncu-rep), its source page as CSV, and the summary
      # (scripts/ncu_source_summary.py: top instructions, by opcode, by reason)
      timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none -k "regex:${NCU_KERNELS:-flash_bwd_sm90}" \
        --launch-skip "${NCU_SKIP:-1}" --launch-count 1 --section SourceCounters \
        --section WarpStateStats --import-source yes -f -o "$OUT/ncu-source" \
        python3 scripts/profile_call.py --bwd --shape ${NCU_SHAPE:-4 4096 16 128} ${NCU_ARGS:-} \
        > "$OUT/ncu-source.log" 2>&1; rc=$?
      ncu --import "$OUT/ncu-source.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/ncu-source-sass.csv" 2>> "$OUT/ncu-source.log" || rc=$?
      python3 scripts/ncu_source_summary.py "$OUT/ncu-source-sass.csv" \
        ${NCU_HOT:+--hot "$NCU_HOT"} > "$OUT/ncu-source-top.txt" 2>&1
      head -n 60 "$OUT/ncu-source-top.txt" ;;
    ncu-full)
      timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none -k "regex:${NCU_KERNELS:-flash_bwd_sm90}" \
        --launch-skip "${NCU_SKIP:-1}" --launch-count 1 --set full -f -o "$OUT/ncu-full" \
        python3 scripts/profile_call.py --bwd --shape ${NCU_SHAPE:-4 4096 16 128} ${NCU_ARGS:-} \
        > "$OUT/ncu-full.log" 2>&1; rc=$?
      ncu --import "$OUT/ncu-full.ncu-rep" --page details > "$OUT/ncu-full-details.txt" 2>> "$OUT/ncu-full.log" || rc=$?
      ncu --import "$OUT/ncu-full.ncu-rep" --page raw --csv > "$OUT/ncu-full-raw.csv" 2>> "$OUT/ncu-full.log" || rc=$?
      python3 - "$OUT/ncu-full-raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:
    head, vals = rows[0], rows[-1]
    want = ("l1tex__throughput.avg.pct_of_peak_sustained_active",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum.pct_of_peak_sustained_elapsed",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum.pct_of_peak_sustained_elapsed",
            "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
            "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
            "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
            "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
            "gpu__time_duration.sum")
    for name in want:
        if name in head:
            print(f"{name:80s} {vals[head.index(name)]}")
PY
      ;;
    *)
      echo "unknown step $step"; rc=2 ;;
  esac
  status+=("$step|$rc|$(( $(date +%s) - t0 ))")
done

python3 scripts/lane_summary.py "$OUT" "${status[@]}"
