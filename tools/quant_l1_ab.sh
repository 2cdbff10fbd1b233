#!/usr/bin/env bash
# One device call for the quantize_act L1 experiment (docs/PERF.md, sessions 53-54):
#   bash tools/quant_l1_ab.sh [PREFIX]     (carry the six folders tools/quant_l1_builds.sh wrote: PREFIX_main, _m3,
#                                           _cg, _na, _sec, _secna; PREFIX defaults to artifacts_l1)
# 1. the selftest of each folder (both variants against the exact reference: codes and scales bit for bit, the
#    LoRA sums against float64; the sectors builds have never run);
# 2. tools/quant_sweep.py over all six folders, twice (M = 4608, K = 3072 / 12288 / 15360, rank 32, smooth_rcp,
#    one CTA per tile, whole waves and the loader's own schedule; every row's outputs checked), and between the two
#    (unless NCU=0) ncu of one K = 12288 launch of main's four-warp kernel and of the five-warp kernel of m3, sec and
#    secna: time, issue rate, stalls (tools/ncu_summary.py), L1 sector hit rate and the SMEM carveout;
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
sweep() {
    step "sweep $1" "${T_SWEEP:-150}" "sweep$1.txt" python3 tools/quant_sweep.py "${DIRS[@]}" --m 4608 \
        --k 3072,12288,15360 --ranks 32 --smooth 2 --ctas tiles,fill,auto --full-check
}
sweep 1
if [ "${NCU:-1}" != 0 ] && command -v ncu >/dev/null; then
    METRICS="$(python3 tools/ncu_summary.py --metrics),l1tex__t_sector_hit_rate.pct,launch__shared_mem_config_size"
    for PICK in main:warps4 m3:warps5 sec:warps5 secna:warps5; do
        A="${P}_${PICK%%:*}" W=${PICK##*:}
        step "ncu $A $W" "${T_NCU:-90}" "ncu_$(basename "$A")_$W.csv" ncu --clock-control none --csv \
            -k "regex:quantize_act.*_${W}_" -c 1 --metrics "$METRICS" python3 tools/quant_sweep.py "$A" --m 4608 \
            --k 12288 --ranks 32 --smooth 2 --ctas auto --timer loop
        python3 tools/ncu_summary.py "$OUT/ncu_$(basename "$A")_$W.csv" --label "$(basename "$A") $W" \
            --show l1tex__t_sector_hit_rate.pct,launch__shared_mem_config_size
    done
fi
sweep 2
grep -E '^\|' "$OUT/sweep2.txt" | head -80
if [[ $GPU == *H200* ]]; then
    step "stream probe" "${T_PROBE:-120}" stream_probe.txt python3 tools/stream_probe.py
    tail -20 "$OUT/stream_probe.txt"
fi
