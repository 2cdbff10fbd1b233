#!/usr/bin/env bash
# Every H200 check of a merged tree, in device calls that each fit the 10-minute limit (one stage per call). Each
# step's budget is about 1.3x its longest time on an H100 (sessions 38-39: quantize_act numerics 165-212 s, GEMM 120 s,
# selftest 29-32 s, runtime + torch tests 70 s, FP8 tests 155-182 s, the speed bench 83 s). Whole stages: H100 core
# 438 s, speed + fp8 275 s (session 39); H200 core 397 s, fp8 167 s, measures 304 s (session 44).
# Build on the CPU first:
#   svdq-aot build configs/flux.yaml -o artifacts -j 2
#   svdq-aot build configs/tune.yaml -o artifacts/tune -j 2
#   svdq-aot build configs/quant_sweep.yaml -o artifacts_sweep -j 2
#   bash tools/fetch_wheels.sh                    # diffusers for the torch / FLUX checks -> .whl
# then, with the device tool (carry: ["artifacts", "artifacts_sweep", ".whl"]):
#   bash tools/h200_all.sh core      numerics of both operators, selftest of every variant, runtime + torch tests
#   bash tools/h200_all.sh speed     the bench of both operators (--quick) and the quantize_act sweep
#   bash tools/h200_all.sh fp8       the FP8-compute mode's tests
#   bash tools/h200_all.sh extras    sanitizers / memory / fresh process / host cost, tune, the FLUX example
#   bash tools/h200_all.sh sanitize  compute-sanitizer memcheck and racecheck over every built variant (its own call)
#   bash tools/h200_all.sh gemm      after a GEMM-only change: its numerics, selftest, torch tests, GEMM bench
#   bash tools/h200_all.sh measures  issue 5's and 7's measures: both operators' full bench (the GEMM in bf16 and fp16
#                                    at M = 16-9728, with plots) and ncu of the small-M kernels (304 s, H200)
# Where `artifacts` is a symlink to a build folder, carry that folder and run `ln -sfn FOLDER artifacts` first (the
# script refuses a symlink whose target is missing). Each step has its own time budget; logs, JSON and tables land in
# $OUT, one verdict line per step in $OUT/summary.txt. The device tool returns at most 8 files from $OUT: where a run
# that started in an empty $OUT leaves more, they are packed into $OUT/results.tgz (summary.txt stays beside it).
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
OUT_WAS_EMPTY=0; [ -z "$(ls -A "$OUT")" ] && OUT_WAS_EMPTY=1     # only then may the end pack (and remove) its files
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=artifacts
START=$(date +%s)
if [ -L artifacts ] && [ ! -e artifacts ]; then      # the device tool carries a symlink without its target
    echo "h200_all.sh: 'artifacts' is a symlink to '$(readlink artifacts)', which is not here: carry that folder" \
         "(the device tool carries a symlink without its target) and link it with 'ln -sfn FOLDER artifacts'" >&2
    exit 2
fi
. "$(dirname "$0")/lib/device_step.sh"      # step NAME BUDGET_S LOG CMD...; install_checkout
: >"$OUT/summary.txt"
install_checkout
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"

for stage in "${@:-core}"; do
case $stage in
core|gemm)     # gemm: the GEMM's share of core, and its bench (after a GEMM-only change)
    [ "$stage" = core ] && step "quantize_act numerics (bit-exact)" 280 gpu_quantize.log \
        python3 -m pytest -q -p no:cacheprovider --maxfail=10 tests/test_gpu_quantize.py
    step "gemm_w4a4 numerics (float64)" 160 gpu_gemm.log \
        python3 -m pytest -q -p no:cacheprovider --maxfail=10 tests/test_gpu_gemm.py ${GEMM_K:+-k "$GEMM_K"}
    step "selftest" 60 selftest.log python3 -m svdq_loader.testing.selftest artifacts --require-gpu
    tail -25 "$OUT/selftest.log"
    [ "$stage" = core ] && step "runtime tests" 60 gpu_runtime.log \
        python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_runtime.py
    step "torch module tests" 60 gpu_torch.log python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_torch.py
    if [ "$stage" = gemm ]; then
        step "bench" 110 bench.log python3 -m svdq_loader.testing.bench artifacts --dtype bf16 --m 16,256,1024,4608 \
            --quick --op gemm_w4a4 --json "$OUT/bench.json" --table "$OUT/bench.md" --plot "$OUT/bench.png"
        grep -E "^\|" "$OUT/bench.log" | head -60
    fi
    ;;
speed)
    op=${BENCH_OP:-}
    step "bench" 300 bench.log python3 -m svdq_loader.testing.bench artifacts --dtype bf16 --m 16,256,1024,4608 \
        --quick ${op:+--op "$op"} --json "$OUT/bench.json" --table "$OUT/bench.md" --plot "$OUT/bench.png"
    grep -E "^\|" "$OUT/bench.log" | head -60
    step "quantize_act sweep" 120 sweep.log python3 tools/quant_sweep.py artifacts_sweep --k 3072,15360
    cat "$OUT/sweep.log"
    ;;
fp8)
    step "FP8-compute mode tests" 240 gpu_fp8.log python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_fp8.py
    ;;
extras)
    SVDQ_BUDGET_S=${LOADER_BUDGET_S:-230} bash tools/h200_loader.sh >"$OUT/loader.log" 2>&1
    echo "loader script exit $?" | tee -a "$OUT/summary.txt"; tail -14 "$OUT/loader.log"
    step "tune tests" 70 gpu_tune.log env SVDQ_ARTIFACTS=artifacts/tune SVDQ_TUNE_REQUIRE=1 \
        python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_tune.py
    step "svdq-aot tune" 30 tune.log python3 -m svdq_aot.cli tune artifacts/tune --quick --m 64,1024,4608
    cat "$OUT/tune.log"; cp artifacts/tune/tuning.json "$OUT/tuning.json" 2>/dev/null
    step "FLUX example (eager)" 140 flux_eager.log python3 examples/flux_w4a4.py --artifacts artifacts --compile "" \
        --json "$OUT/flux_eager.json"
    grep -v "^  swapped\|^  skipped" "$OUT/flux_eager.log" | tail -30
    ;;
sanitize)      # compute-sanitizer over every built variant of this arch (its own call: several minutes)
    # memcheck at four Ms, then racecheck at one M, where the default variants' check (extras) misses tiles (session
    # 41: 17 GEMM variants had hazards in the previous LoRA staging). The whole stage on an H100 (session 42, 241
    # variants: every GEMM of both modes and every quantize_act): memcheck 76 s, racecheck 215 s, 294 s in all
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    step "memcheck, every variant" 200 memcheck_all.log "$SAN" --tool memcheck --report-api-errors no \
        --error-exitcode 9 python3 tools/sanitize_variants.py artifacts --m "${SVDQ_SAN_M:-1,77,1000,4592}"
    grep -E "ERROR SUMMARY|all ok|FAIL" "$OUT/memcheck_all.log" | tail -3
    step "racecheck, every variant" 340 racecheck_all.log "$SAN" --tool racecheck --error-exitcode 9 \
        python3 tools/sanitize_variants.py artifacts --m "${SVDQ_RACE_M:-77}"
    grep -E "RACECHECK SUMMARY|all ok|MISMATCH" "$OUT/racecheck_all.log" | tail -3
    grep -oE "access at [a-z0-9_]+\+0x[0-9a-f]+ \[[0-9]+ hazards\]" "$OUT/racecheck_all.log" | sort -u | head -20
    ;;
measures)      # issue 5's and 7's measures (what docs/PERF.md reports for them), each output checked by the bench
    step "quantize_act bench" 150 bench_quant.log python3 -m svdq_loader.testing.bench artifacts --dtype bf16 \
        --op quantize_act --json "$OUT/bench_quant.json" --table "$OUT/bench_quant.md"
    grep -E "^\|" "$OUT/bench_quant.log" | grep -v "^| op\|^|  " | head -8
    for dt in bf16 fp16; do
        step "gemm_w4a4 bench, $dt" 280 "bench_gemm_$dt.log" python3 -m svdq_loader.testing.bench artifacts \
            --dtype "$dt" --op gemm_w4a4 --m "${MEASURE_M:-16,64,256,1024,4608,9728}" --baselines dense,compile \
            --json "$OUT/bench_gemm_$dt.json" --table "$OUT/bench_gemm_$dt.md" --plot "$OUT/bench_gemm_$dt.png"
    done
    if command -v ncu >/dev/null; then
        python3 tools/ncu_summary.py --header >"$OUT/ncu_small_m.md"
        for kn in 3072,3072 3072,21504 15360,3072; do
            step "ncu (K, N) = ($kn)" 60 "ncu_${kn/,/_}.csv" ncu --clock-control none --csv -k regex:svdq \
                --metrics "$(python3 tools/ncu_summary.py --metrics)" \
                python3 tools/sm90_one_call.py --m 256,64,16 --k "${kn%,*}" --n "${kn#*,}"
            python3 tools/ncu_summary.py "$OUT/ncu_${kn/,/_}.csv" --label "($kn)" >>"$OUT/ncu_small_m.md"
        done
        cat "$OUT/ncu_small_m.md"
    else
        echo "ncu: not found (the profile of the small-M kernels not run)" | tee -a "$OUT/summary.txt"
    fi
    ;;
*) echo "unknown stage $stage (core, speed, fp8, extras, sanitize, gemm, measures)" ;;
esac
done
echo "total $(( $(date +%s) - START ))s"
cat "$OUT/summary.txt"
if [ "$OUT_WAS_EMPTY" = 1 ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then     # the device tool returns 8 files
    tar czf /tmp/h200_all_results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
        && mv /tmp/h200_all_results.tgz "$OUT/results.tgz" && echo "packed into $OUT/results.tgz"
fi
