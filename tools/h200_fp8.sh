#!/usr/bin/env bash
# One H200 call that checks and times the FP8-compute mode (op gemm_w4a4_fp8 and its act_fp8 pre-pass):
#   svdq-aot build configs/sm90_fp8.yaml -o artifacts_fp8 -j 2      # on the CPU machine; carry artifacts_fp8
#   bash tools/h200_fp8.sh [ARTIFACTS]                                # on the H200 (default: artifacts_fp8)
# 1. the selftest of every act_fp8 and gemm_w4a4_fp8 variant (the pre-pass bit for bit; the GEMM against the mode's
#    float64 reference at the exact mode's tolerance);
# 2. tests/test_gpu_fp8.py (the FLUX shapes at M = 1 ... 4608, both dtypes, calls without wcscale / bias, the mode's
#    distance from the exact operator, the compute-mode errors);
# 3. unless BENCH=0, svdq-aot bench of both modes at BENCH_M (default 1024,4608), bf16, against cuBLAS bf16 and fp8
#    (the FP8 GEMM from quantize_act's E4M3 activation, and from NVFP4 beside it);
# 4. with LINEAR=1, the bench of the whole linear (quantize_act + GEMM from bf16 x) in both modes, against cuBLAS bf16.
# SELFTEST=0 skips step 1 (SELFTEST_OPS="act_fp8" runs one op's), PYTEST=0 step 2.
# Everything lands in $OUT (bench JSON and tables).
set -uo pipefail
ART=${1:-artifacts_fp8}
[ -f "$ART/manifest.json" ] || { echo "h200_fp8.sh: $ART has no manifest.json (build it, then carry it)" >&2; exit 2; }
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
for op in $([ "${SELFTEST:-1}" != 0 ] && echo ${SELFTEST_OPS:-act_fp8 gemm_w4a4_fp8}); do
    timeout "${T_SELFTEST:-150}" python3 -m svdq_loader.testing.selftest "$ART" --require-gpu --op $op \
        >"$OUT/selftest_$op.log" 2>&1
    echo "selftest $op exit $?"; grep -E "^FAIL|passed" "$OUT/selftest_$op.log" | head -12
done
if [ "${PYTEST:-1}" != 0 ]; then
    SVDQ_ARTIFACTS="$ART" SVDQ_REQUIRE_GPU=1 timeout "${T_PYTEST:-200}" python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu_fp8.py >"$OUT/pytest_fp8.log" 2>&1
    echo "pytest exit $?"; tail -15 "$OUT/pytest_fp8.log"
fi
if [ "${BENCH:-1}" != 0 ]; then
    timeout "${T_BENCH:-200}" python3 -m svdq_loader.testing.bench "$ART" --op gemm_w4a4 --compute exact,fp8 \
        --dtype bf16 --m "${BENCH_M:-1024,4608}" --baselines dense,fp8 --json "$OUT/bench_fp8.json" \
        --table "$OUT/bench_fp8.md" >"$OUT/bench_fp8.log" 2>&1
    echo "bench exit $?"; grep -E "^\|" "$OUT/bench_fp8.md" 2>/dev/null | head -40 || tail -20 "$OUT/bench_fp8.log"
fi
if [ "${LINEAR:-0}" != 0 ]; then
    timeout "${T_LINEAR:-200}" python3 -m svdq_loader.testing.bench "$ART" --op linear --compute exact,fp8 \
        --dtype bf16 --m "${BENCH_M:-1024,4608}" --baselines dense --json "$OUT/bench_linear.json" \
        --table "$OUT/bench_linear.md" >"$OUT/bench_linear.log" 2>&1
    echo "linear bench exit $?"
    grep -E "^\|" "$OUT/bench_linear.md" 2>/dev/null | head -30 || tail -20 "$OUT/bench_linear.log"
fi
