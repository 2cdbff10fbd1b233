#!/usr/bin/env bash
# One device call for the quantize_act L1 experiment (docs/PERF.md, sessions 53-54):
#   bash tools/quant_l1_ab.sh [PREFIX]     (carry the six folders tools/quant_l1_builds.sh wrote: PREFIX_main, _m3,
#                                           _cg, _na, _sec, _secna; PREFIX defaults to artifacts_l1)
# 1. the selftest of each folder (both variants against the exact reference: codes and scales bit for bit, the
#    LoRA sums against float64; the sectors builds have never run);
# 2. tools/quant_sweep.py over all six folders, twice (M = 4608, K = 3072 / 12288 / 15360, rank 32, smooth_rcp,
#    one CTA per tile, whole waves and the loader's own schedule; every row's outputs checked);
# 3. on an H200 only, tools/stream_probe.py (the gemv form's compute-free read rate, never run on an H200).
# A timing comparison is valid on any one card (the two sweeps run on the same one); logs land in $OUT, one verdict
# line per step in $OUT/summary.txt.
set -uo pipefail
P=${1:-artifacts_l1}
DIRS=("${P}_main" "${P}_m3" "${P}_cg" "${P}_na" "${P}_sec" "${P}_secna")
. "$(dirname "$0")/lib/device_step.sh"      # step NAME BUDGET_S LOG CMD...; device_setup SCRIPT FOLDER...
device_setup quant_l1_ab.sh "${DIRS[@]}"      # (build them with tools/quant_l1_builds.sh, then carry them)
GPU=$(cat "$OUT/gpu.txt")
for A in "${DIRS[@]}"; do
    step "selftest $A" "${T_SELFTEST:-60}" "selftest_$(basename "$A").txt" \
        python3 -m svdq_loader.testing.selftest "$A" --op quantize_act --require-gpu
done
for RUN in 1 2; do
    step "sweep $RUN" "${T_SWEEP:-150}" "sweep$RUN.txt" python3 tools/quant_sweep.py "${DIRS[@]}" --m 4608 \
        --k 3072,12288,15360 --ranks 32 --smooth 2 --ctas tiles,fill,auto --full-check
done
grep -E '^\|' "$OUT/sweep2.txt" | head -80
if [[ $GPU == *H200* ]]; then
    step "stream probe" "${T_PROBE:-120}" stream_probe.txt python3 tools/stream_probe.py
    tail -20 "$OUT/stream_probe.txt"
fi
