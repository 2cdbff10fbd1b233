# Sourced by the device-call scripts (tools/h200_all.sh, tools/h200_quant_ab.sh), not run alone.
# step NAME BUDGET_S LOG CMD...: CMD under its own time budget, its output in $OUT/LOG; one verdict line per step
# appended to $OUT/summary.txt (and shown), then the log's pass / fail lines (none is no failure).
step() {
    local name=$1 budget=$2 log=$3; shift 3
    local t0; t0=$(date +%s)
    timeout -k 5 "$budget" "$@" >"$OUT/$log" 2>&1
    local rc=$?
    local verdict="exit $rc"; { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && verdict="TIMED OUT after ${budget}s"
    echo "$name: $verdict in $(( $(date +%s) - t0 ))s -> $log" | tee -a "$OUT/summary.txt"
    grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/$log" | tail -6 | sed 's/^/    /' || true
}
