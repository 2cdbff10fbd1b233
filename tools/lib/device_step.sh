# Sourced by the device-call scripts (tools/h200_all.sh, h200_ab.sh, h200_quant_ab.sh), not run alone.
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

# install_checkout: install this checkout into the device's Python, its log in $OUT/install.log (exit 1 with the
# log's tail if that fails).
install_checkout() {
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
        || { tail -20 "$OUT/install.log"; exit 1; }
}

# device_setup SCRIPT FOLDER...: refuse (exit 2) unless every FOLDER holds a manifest.json, then make $OUT (default
# /tmp/svdq-out), install_checkout, write the GPU's name, driver and clocks (current, max) to $OUT/gpu.txt (and show
# it) and start an empty $OUT/summary.txt.
device_setup() {
    local script=$1; shift
    local a
    for a in "$@"; do
        [ -f "$a/manifest.json" ] || { echo "$script: $a has no manifest.json (build it, then carry it)" >&2; exit 2; }
    done
    OUT=${OUT:-/tmp/svdq-out}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    install_checkout
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1 \
        | tee "$OUT/gpu.txt"
    : >"$OUT/summary.txt"
}
