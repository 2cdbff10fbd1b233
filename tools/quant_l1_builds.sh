#!/usr/bin/env bash
# The quantize_act L1 experiment's builds, on the CPU (no GPU): configs/quant_l1.yaml once per switch setting.
#   bash tools/quant_l1_builds.sh [PREFIX]        (folders PREFIX_main, PREFIX_m3, ...; PREFIX defaults to artifacts_l1)
# Each folder holds the rank-32 bf16 sm_90a variant at four and at five warps per CTA; the switches are documented
# in kernel_src/quantize_kernel.py (SVDQ_KERNEL_QUANT_*), the question in docs/PERF.md (sessions 53-54):
#   main   no switch (the shipped kernel; its five-warp variant has no occupancy hint: 2 CTAs per SM)
#   m3     MINCTAS=3 (five warps at three CTAs per SM, 128 registers)
#   cg     m3 + LORACACHE=cg (lora_down tiles through L2 only)
#   na     m3 + XCACHE=no_allocate (x loads leave the L1 alone)
#   sec    m3 + XLOAD=sectors (each x load instruction reads whole 32-byte sectors)
#   secna  m3 + XLOAD=sectors + XCACHE=no_allocate
# Then the SASS summary of every folder (tools/sass_loops.py --compare: registers and the step loop's size).
# tools/quant_l1_ab.sh times them on a GPU (carry all six).
set -euo pipefail
P=${1:-artifacts_l1}
K=SVDQ_KERNEL_QUANT_
build() {
    local tag=$1; shift
    echo "== ${P}_$tag: ${*:-no switch}"
    env "$@" svdq-aot build configs/quant_l1.yaml -o "${P}_$tag" -j 2 | tail -1
}
build main
build m3 ${K}MINCTAS=3
build cg ${K}MINCTAS=3 ${K}LORACACHE=cg
build na ${K}MINCTAS=3 ${K}XCACHE=no_allocate
build sec ${K}MINCTAS=3 ${K}XLOAD=sectors
build secna ${K}MINCTAS=3 ${K}XLOAD=sectors ${K}XCACHE=no_allocate
python3 "$(dirname "$0")/sass_loops.py" "${P}_main" "${P}_m3" "${P}_cg" "${P}_na" "${P}_sec" "${P}_secna" \
    --match quantize --compare
