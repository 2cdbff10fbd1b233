#!/usr/bin/env bash
# One H200 call that decides a kernel build switch (an SVDQ_KERNEL_* experiment) against the shipped build:
#   bash tools/h200_ab.sh BASE EXP          (artifact folders, both carried; EXP built with the switch set)
# 1. every GEMM variant of EXP against the float64 reference (the selftest: M tails, calls without the affine);
# 2. tools/sm90_sweep.py BASE EXP: each variant of both builds timed on the same inputs in the same run, every output
#    checked (SWEEP_M, SWEEP_MATCH and SWEEP_ARGS choose the M values, the forms and more options);
# 3. ncu of one M = 1024 attn_out call (K = N = 3072) per build: GEMM duration and tensor-pipe activity.
# Everything lands in $OUT; docs/PERF.md (session 23) names the pending experiments.
set -uo pipefail
BASE=${1:?usage: h200_ab.sh BASE EXP}; EXP=${2:?usage: h200_ab.sh BASE EXP}
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
timeout "${T_SELFTEST:-200}" python3 -m svdq_loader.testing.selftest "$EXP" --require-gpu --op gemm_w4a4 \
    >"$OUT/selftest.log" 2>&1
echo "selftest exit $?"; tail -2 "$OUT/selftest.log"
timeout "${T_SWEEP:-300}" python3 tools/sm90_sweep.py "$BASE" "$EXP" --m "${SWEEP_M:-64,256,1024,4608}" \
    --match "${SWEEP_MATCH:-schedule=ws wsets}" --quick ${SWEEP_ARGS:-} --json "$OUT/sweep.json" >"$OUT/sweep.log" 2>&1
echo "sweep exit $?"; sed -n '/^| variant (knobs)/,$p' "$OUT/sweep.log" | head -80
if command -v ncu >/dev/null; then
    for A in "$BASE" "$EXP"; do
        SVDQ_ARTIFACTS="$A" timeout "${T_NCU:-60}" ncu --clock-control none -k regex:svdq_gemm -c 2 \
            --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
            python3 tools/sm90_one_call.py --m 1024,1024 --k 3072 --n 3072 >"$OUT/ncu_$(basename "$A").log" 2>&1
        echo "ncu ($A) exit $?"; grep -E "svdq_gemm|duration|hmma" "$OUT/ncu_$(basename "$A").log" | cut -c1-120
    done
fi
