#!/usr/bin/env bash
# One H200 run for the sm_90a GEMM's small-M gemv form (docs/PERF.md, session 9), bounded to fit one device call.
# On the CPU first:  svdq-aot build configs/sm90_gemv.yaml -o artifacts_gemv -j 2   (then carry artifacts_gemv)
#   bash tools/h200_gemv.sh [ARTIFACTS]        (default artifacts_gemv)
# 1. float64 numerics of every variant (selftest, three M each, the gemv tails and splits among them);
# 2. the sweep at M = 1, 16, 32, 64 on the four FLUX (K, N) pairs of small-M interest, every variant of the build
#    (the gemv tiles beside the shipped 64-row wgmma forms), checked against the eager torch pipeline, then timed;
#    JSON in $OUT/sweep.json;
# 3. ncu stall reasons of each of the six gemv forms (tile 64 x 128 / 64 x 64 at prefetch 1 / 2, tile 16 x 128 /
#    16 x 64) at M = 16, K = 12288, N = 3072 (bf16, R = 32), if ncu runs.
set -uo pipefail
ART=${1:-artifacts_gemv}
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
timeout "${T_SELF:-150}" python3 -m svdq_loader.testing.selftest "$ART" --op gemm_w4a4 --require-gpu >"$OUT/selftest.log" 2>&1
echo "selftest exit $?"; grep -E "^FAIL|passed|failed" "$OUT/selftest.log" | tail -8
timeout "${T_SWEEP:-240}" python3 tools/sm90_sweep.py "$ART" --m 1,16,32,64 --quick --json "$OUT/sweep.json" \
    --kn 3072x3072,3072x12288,12288x3072,15360x3072 >"$OUT/sweep.log" 2>&1
echo "sweep exit $?"
# one line per (shape, variant): M K N, the form, us, x cuBLAS
sed -nE 's/^(M=.*N= *[0-9]+) +tile_m=([0-9]+) tile_n=([0-9]+) stages=[0-9] prefetch=([0-9]) .*schedule=([a-z_0-9]+) wsets=([0-9]) .* ([0-9.]+) us .* ([0-9.]+x) cuBLAS$/\1 \2x\3 pf\4 \5 w\6 \7 \8/p' \
    "$OUT/sweep.log" | head -80
if command -v ncu >/dev/null && [ "${T_NCU:-30}" -gt 0 ]; then
    for form in tilem64_tilen128_tilek64_stages4_prefetch1 tilem64_tilen128_tilek64_stages4_prefetch2 \
                tilem64_tilen64_tilek64_stages4_prefetch1 tilem64_tilen64_tilek64_stages4_prefetch2 \
                tilem16_tilen128_tilek64_stages4_prefetch1 tilem16_tilen64_tilek64_stages4_prefetch1; do
        timeout "${T_NCU:-30}" ncu --clock-control none -k regex:gemm -c 1 \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_active.avg,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.per_cycle_active" \
            python3 tools/sm90_pick_call.py "$ART" --m 16 --k 12288 --n 3072 --match schedulegemv \
            --match "$form" --match outdtypebf16 >"$OUT/ncu_$form.log" 2>&1
        echo "ncu $form exit $?"
        grep -E "ratio|sum|avg|pct" "$OUT/ncu_$form.log" | awk '$NF+0 > 0.05' | head -24
    done
fi
