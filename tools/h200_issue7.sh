#!/usr/bin/env bash
# One H200 run for the sm_90a wgmma kernel (issue 7), bounded to fit one device call:
#   bash tools/h200_issue7.sh            (artifacts: ./artifacts, built from configs/h200_sm90.yaml)
# 1. GPU numerics of both operators (tests/test_gpu_*.py; stops after 5 failures);
# 2. the bench on the shapes of configs/bench_issue7.yaml (SVDQ_BENCH_ARGS adds/overrides options);
# 3. ncu of one launch per tile (tensor-pipe utilisation, stall reasons), if ncu runs;
# 4. with ART_B="DIR ..." (e.g. built from configs/h200_sm90_b.yaml, h200_sm90_c.yaml): for each, the
#    feature-grid numerics and the same bench (bench_<dir>.*), an A/B against the first build.
# Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=artifacts
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
T_TEST=${T_TEST:-100}; T_BENCH=${T_BENCH:-110}; T_NCU=${T_NCU:-35}
timeout "$T_TEST" python3 -m pytest -q -p no:cacheprovider --maxfail=5 tests/test_gpu_gemm.py tests/test_gpu_quantize.py \
    ${PYTEST_K:+-k "$PYTEST_K"} >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)|relative error|Error" "$OUT/gpu_tests.log" | head -12
timeout "$T_BENCH" python3 -m svdq_loader.testing.bench artifacts --config configs/bench_issue7.yaml --op gemm_w4a4 \
    --dtype bf16 --m 16,256,1024,4608 --quick ${SVDQ_BENCH_ARGS:-} \
    --json "$OUT/bench.json" --table "$OUT/bench.md" --plot "$OUT/bench.png" >"$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -vE "^\s*$" "$OUT/bench.log" | tail -45
if command -v ncu >/dev/null && [ "$T_NCU" -gt 0 ]; then
    timeout "$T_NCU" ncu --clock-control none -k regex:svdq_gemm -c 2 \
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        python3 tools/sm90_one_call.py >"$OUT/ncu.log" 2>&1
    echo "ncu exit $?"; grep -vE "^==PROF==" "$OUT/ncu.log" | tail -30
fi
for B in ${ART_B:-}; do
    tag=$(basename "$B")
    SVDQ_ARTIFACTS="$B" timeout "$T_TEST" python3 -m pytest -q -p no:cacheprovider --maxfail=5 \
        tests/test_gpu_gemm.py -k "test_features or test_other_ranks" >"$OUT/gpu_tests_$tag.log" 2>&1
    echo "gpu tests ($B) exit $?"; grep -E "passed|failed|error" "$OUT/gpu_tests_$tag.log" | tail -3
    timeout "$T_BENCH" python3 -m svdq_loader.testing.bench "$B" --config configs/bench_issue7.yaml \
        --op gemm_w4a4 --dtype bf16 --m 16,256,1024,4608 --quick ${SVDQ_BENCH_ARGS:-} \
        --json "$OUT/bench_$tag.json" --table "$OUT/bench_$tag.md" >"$OUT/bench_$tag.log" 2>&1
    echo "bench ($B) exit $?"; grep -E "^\|" "$OUT/bench_$tag.log" | head -14
done
