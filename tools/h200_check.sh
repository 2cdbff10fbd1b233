#!/usr/bin/env bash
# The H200 run, as one command for the `device` tool (carry: ["artifacts"]):
#   bash tools/h200_check.sh [pytest -k expression]
# Installs the project without dependencies (that machine has torch, cuda-bindings, pyyaml, click;
# it has no DSL and needs none), runs the GPU tests against the carried artifacts, then the benchmark.
# Logs and results go to $OUT (the device tool brings that folder back).
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=artifacts
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
K=${1:-}
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_quantize.py tests/test_gpu_gemm.py ${K:+-k "$K"} \
    >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
if [ -z "${SVDQ_NO_BENCH:-}" ]; then
    python3 -m svdq_loader.testing.bench --artifacts artifacts ${SVDQ_BENCH_ARGS:-} --json "$OUT/bench.json" \
        --table "$OUT/bench.md" --plot "$OUT/bench.png" >"$OUT/bench.log" 2>&1
    echo "bench exit $?"; tail -70 "$OUT/bench.log"
fi
