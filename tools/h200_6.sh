#!/usr/bin/env bash
# Issue 6 on the H200, as one command for the `device` tool (carry: ["artifacts"], artifacts built from
# configs/flux.yaml, which holds sm_90a, sm_100a and sm_103a variants):
#   bash tools/h200_6.sh
# 1. `svdq-aot selftest` over the sm_90a variants (table + JSON into $OUT);
# 2. the GPU tests whose code selftest shares, and the wrong-arch refusal with Blackwell variants present.
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=artifacts
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m svdq_loader.testing.selftest artifacts --require-gpu >"$OUT/selftest.txt" 2>&1
echo "selftest exit $?"; head -3 "$OUT/selftest.txt"; tail -3 "$OUT/selftest.txt"
python3 -m svdq_loader.testing.selftest artifacts --json --seed 6 >"$OUT/selftest.json" 2>"$OUT/selftest_json.err"
echo "selftest --json exit $?"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py tests/test_gpu_quantize.py \
    -k "features or bit_exact or wrong_arch or quantize_then_gemm" >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
