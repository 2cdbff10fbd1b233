#!/usr/bin/env bash
# The loader's H200 run (issue 8), bounded to about 5 minutes in all.  For the `device` tool, from the
# repository root of a tree with built artifacts (carry: ["artifacts"]):
#   bash tools/h200_loader.sh
# Steps (each with its own time budget, skipped once the total budget is spent; logs and JSON in $OUT):
#   1. GPU runtime tests: torch.compile fullgraph / reduce-overhead, streams, graphs, capture, preload,
#      launch error, allocations, threads (tests/test_gpu_runtime.py)
#   2. compute-sanitizer memcheck, racecheck and synccheck on the default variants (memcheck of every
#      variant: `bash tools/h200_all.sh sanitize`)
#   3. 10^5 call pairs over varying M: host and device memory (tools/long_run.py)
#   4. fresh-process import + load + first launch, graph replay cost (tools/fresh_process.py)
#   5. host cost per call (tools/host_cost.py)
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=${SVDQ_ARTIFACTS:-artifacts}
ART=$SVDQ_ARTIFACTS
TOTAL=${SVDQ_BUDGET_S:-295}
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
step() {  # step NAME BUDGET_S LOG CMD...
    local name=$1 budget=$2 log=$3; shift 3
    local l; l=$(left)
    if [ "$l" -le 5 ]; then echo "$name: SKIPPED (total budget spent)" | tee -a "$OUT/summary.txt"; return; fi
    [ "$budget" -gt "$l" ] && budget=$l
    local t0; t0=$(date +%s)
    timeout -k 5 "$budget" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    local verdict="exit $rc"; [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT after ${budget}s (partial log)"
    echo "$name: $verdict in $(( $(date +%s) - t0 ))s -> $log" | tee -a "$OUT/summary.txt"
    tail -3 "$OUT/$log" | sed 's/^/    /'
}
: >"$OUT/summary.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 -c "import torch, cuda.bindings as b; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cuda-bindings', b.__version__)" | tee -a "$OUT/summary.txt"

step "gpu runtime tests" 110 gpu_runtime.log python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runtime.py -rs
grep -E "^(FAILED|ERROR)" "$OUT/gpu_runtime.log" | head -10

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
    # every variant does not fit here (243 in the sm_90a flux build: more than 60 s, session 40); `h200_all.sh
    # sanitize` runs memcheck over all of them in a call of its own
    step "memcheck, default variants" 40 memcheck.log "$SAN" --tool memcheck --report-api-errors no --error-exitcode 9 \
        python3 tools/sanitize_variants.py "$ART" --default-only --m "${SVDQ_SAN_M:-1,77,1000,4592}"
    step "racecheck, default variants" 25 racecheck.log "$SAN" --tool racecheck --error-exitcode 9 \
        python3 tools/sanitize_variants.py "$ART" --default-only --m 77,1000
    step "synccheck, default variants" 15 synccheck.log "$SAN" --tool synccheck --error-exitcode 9 \
        python3 tools/sanitize_variants.py "$ART" --default-only --m 77,1000
    grep -hE "ERROR SUMMARY|Error SUMMARY|RACECHECK SUMMARY|hazard" "$OUT"/memcheck.log "$OUT"/racecheck.log \
        "$OUT"/synccheck.log 2>/dev/null | head -6
else
    echo "compute-sanitizer: NOT FOUND on this machine (memcheck/racecheck/synccheck not run)" | tee -a "$OUT/summary.txt"
fi
step "10^5-call memory run" 35 long_run.log python3 tools/long_run.py "$ART" --calls "${SVDQ_LONG_CALLS:-100000}" \
    --json "$OUT/long_run.json"
step "fresh process + graph replay" 60 fresh_process.log python3 tools/fresh_process.py "$ART" --json "$OUT/fresh_process.json"
step "host cost" 15 host_cost.log python3 tools/host_cost.py "$ART" --rounds 5
echo "total $(( $(date +%s) - START ))s"
cat "$OUT/summary.txt"
