#!/usr/bin/env bash
# One H200 call that decides kernel experiments against the shipped build:
#   bash tools/h200_ab.sh BASE [EXP ...]      (artifact folders, all carried)
# An EXP is a build with a kernel switch set (SVDQ_KERNEL_*: the same variant names as BASE) or a config of
# experiment forms (configs/sm90_*.yaml: its own variant names, each timed beside the others of its folder).  A
# BASE alone is itself the experiment (e.g. configs/sm90_stages.yaml, whose forms are built at several depths).
# 1. every GEMM variant of each EXP (and of BASE when alone or with SELFTEST_BASE=1) against the float64 reference
#    (the selftest: M tails, calls without the affine); SELFTEST=0 skips it, for a first look at many folders in one
#    call (the sweep still checks every output against the eager pipeline; a winner gets its selftest before it
#    ships);
# 2. tools/sm90_sweep.py BASE EXP ...: each variant of every folder timed on the same inputs in the same run, every
#    output checked (SWEEP_M, SWEEP_MATCH and SWEEP_ARGS choose the M values, the forms and more options; the
#    FP8-compute mode's builds: SELFTEST_OP=act_fp8,gemm_w4a4_fp8 SWEEP_ARGS="--compute fp8");
# 3. unless NCU=0, ncu of one M = 1024 attn_out call (K = N = 3072) per folder, the loader's own pick: GEMM
#    duration and tensor-pipe activity;
# 4. with RACECHECK=1, compute-sanitizer racecheck of each folder's default variants at M = 77 and 1000 (a switch
#    that changes SMEM traffic: e.g. SVDQ_KERNEL_SM90_LORA_SPARE, docs/PERF.md session 40).
# Everything lands in $OUT; docs/PERF.md (sessions 23 and 24) names the pending experiments.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: h200_ab.sh BASE [EXP ...]" >&2
    exit 2
fi
BASE=$1
. "$(dirname "$0")/lib/device_step.sh"      # device_setup SCRIPT FOLDER...
device_setup h200_ab.sh "$@"
TESTED=("${@:2}")
if [ $# -eq 1 ] || [ "${SELFTEST_BASE:-0}" = 1 ]; then TESTED=("$BASE" "${@:2}"); fi
if [ "${SELFTEST:-1}" = 0 ]; then TESTED=(); fi      # a first look: the sweep's output checks only
SELFTEST_OP=${SELFTEST_OP:-gemm_w4a4}                 # a comma list of ops, e.g. act_fp8,gemm_w4a4_fp8
for EXP in "${TESTED[@]}"; do
    for OP in ${SELFTEST_OP//,/ }; do
        log="$OUT/selftest_$(basename "$EXP")_$OP.log"
        timeout "${T_SELFTEST:-200}" python3 -m svdq_loader.testing.selftest "$EXP" --require-gpu --op "$OP" >"$log" 2>&1
        echo "selftest $EXP --op $OP exit $?"; tail -2 "$log"
    done
done
timeout "${T_SWEEP:-300}" python3 tools/sm90_sweep.py "$@" --m "${SWEEP_M:-64,256,1024,4608}" \
    --match "${SWEEP_MATCH:-schedule=ws wsets}" --quick ${SWEEP_ARGS:-} --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
echo "sweep exit $?"
if grep -q '^| M | K | N | cuBLAS' "$OUT/sweep.log"; then
    sed -n '/^| M | K | N | cuBLAS/,$p' "$OUT/sweep.log" | head -150    # each folder's best per shape, then per form
else
    grep -E '^M=|cuBLAS|FAIL' "$OUT/sweep.log" | head -150          # one folder: its rows as the sweep printed them
fi
if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
    for A in "$@"; do
        SVDQ_ARTIFACTS="$A" timeout "${T_NCU:-60}" ncu --clock-control none -k regex:svdq_gemm -c 2 \
            --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
            python3 tools/sm90_one_call.py --m 1024,1024 --k 3072 --n 3072 >"$OUT/ncu_$(basename "$A").log" 2>&1
        echo "ncu ($A) exit $?"; grep -E "svdq_gemm|duration|hmma" "$OUT/ncu_$(basename "$A").log" | cut -c1-120
    done
fi
if [ "${RACECHECK:-0}" = 1 ]; then
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for A in "$@"; do
        log="$OUT/racecheck_$(basename "$A").log"
        timeout "${T_RACECHECK:-60}" "$SAN" --tool racecheck --error-exitcode 9 \
            python3 tools/sanitize_variants.py "$A" --default-only --m 77,1000 >"$log" 2>&1
        echo "racecheck $A exit $?"; grep -E "RACECHECK SUMMARY|hazards\]|all ok" "$log" | head -4 || true
    done
fi
