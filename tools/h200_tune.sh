#!/usr/bin/env bash
# The tune step on the H200 (issue 8), bounded to about 2 minutes.  Build the artifacts with several
# candidates per problem on the CPU first, then run from the repository root with the device tool
# (carry: ["artifacts"]):
#   svdq-aot build configs/tune.yaml -o artifacts/tune -j 2
#   bash tools/h200_tune.sh
# 1. tests/test_gpu_tune.py: a short tune; the loader launches the table's winners; the tuned choice is never
#    slower than the rules' choice (3 % noise allowed, re-measured before failing); the CLI writes a table
# 2. `svdq-aot tune` over the config's shapes (--quick), then verify and select with the table ($OUT/tuning.json)
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_TUNE_REQUIRE=1 SVDQ_ARTIFACTS=${SVDQ_ARTIFACTS:-artifacts/tune}
ART=$SVDQ_ARTIFACTS
START=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
[ -f "$ART/manifest.json" ] || { echo "no artifacts at $ART: run svdq-aot build configs/tune.yaml -o $ART" | tee -a "$OUT/summary.txt"; exit 2; }

timeout -k 5 85 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_tune.py -rs -s >"$OUT/gpu_tune.log" 2>&1
echo "gpu tune tests: exit $? in $(( $(date +%s) - START ))s -> gpu_tune.log" | tee -a "$OUT/summary.txt"
tail -3 "$OUT/gpu_tune.log"

T0=$(date +%s)
timeout -k 5 25 python3 -m svdq_aot.cli tune "$ART" --quick --m 64,1024,4608 >"$OUT/tune.log" 2>&1
echo "svdq-aot tune --quick: exit $? in $(( $(date +%s) - T0 ))s -> tune.log" | tee -a "$OUT/summary.txt"
cat "$OUT/tune.log"
cp "$ART/tuning.json" "$OUT/tuning.json" 2>/dev/null
python3 -m svdq_aot.cli verify "$ART" 2>&1 | tee -a "$OUT/summary.txt"
python3 -m svdq_aot.cli select "$ART" --op gemm_w4a4 --m 4608 --n 3072 --k 3072 --rank 32 2>&1 | head -4 | cut -c1-300
python3 -m svdq_aot.cli select "$ART" --op quantize_act --m 4608 --k 3072 --rank 32 2>&1 | head -4 | cut -c1-300
echo "total $(( $(date +%s) - START ))s"
