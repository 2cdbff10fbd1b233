#!/usr/bin/env bash
# One device call that decides a quantize_act kernel switch (SVDQ_KERNEL_QUANT_*) against the default build:
#   bash tools/h200_quant_ab.sh BASE EXP            (artifact folders of the same config, both carried)
# e.g. a switch SVDQ_KERNEL_QUANT_X=1 in kernel_src/quantize_kernel.py, built on the CPU first (docs/PERF.md, session
# 46, ran it for a LoRA-meeting switch since removed):
#   svdq-aot build configs/quant_q5.yaml -o artifacts_q5 -j 2
#   SVDQ_KERNEL_QUANT_X=1 svdq-aot build configs/quant_q5.yaml -o artifacts_q5_x -j 2
#   bash tools/h200_quant_ab.sh artifacts_q5 artifacts_q5_x       (carry: ["artifacts_q5", "artifacts_q5_x"])
# 1. tools/quant_sweep.py over both folders on the same problems (SWEEP_M, SWEEP_K, SWEEP_RANKS, SWEEP_CTAS,
#    SWEEP_SMOOTH, SWEEP_DTYPE), every row's codes, scales and lora_act_in checked (--full-check);
# 2. EXP's bit-exact GPU tests (tests/test_gpu_quantize.py, the forced range and cluster forms included; TEST_K picks
#    a subset) and its selftest.
# Each step has a time budget; logs land in $OUT, one verdict line per step in $OUT/summary.txt.
set -uo pipefail
if [ $# -ne 2 ]; then
    echo "usage: h200_quant_ab.sh BASE EXP" >&2
    exit 2
fi
BASE=$1 EXP=$2
. "$(dirname "$0")/lib/device_step.sh"      # step NAME BUDGET_S LOG CMD...; device_setup SCRIPT FOLDER...
device_setup h200_quant_ab.sh "$@"
step sweep "${T_SWEEP:-200}" sweep.txt python3 tools/quant_sweep.py "$BASE" "$EXP" --m "${SWEEP_M:-4608,2048,9216}" \
    --k "${SWEEP_K:-3072,12288,15360}" --ksplit 1 --ctas "${SWEEP_CTAS:-fill,auto}" --smooth "${SWEEP_SMOOTH:-1}" \
    --ranks "${SWEEP_RANKS:-16,32,64}" --dtype "${SWEEP_DTYPE:-bf16}" --full-check
step tests "${T_TESTS:-250}" tests.txt env SVDQ_ARTIFACTS="$EXP" SVDQ_REQUIRE_GPU=1 python3 -m pytest -q \
    -p no:cacheprovider tests/test_gpu_quantize.py -k "${TEST_K:-not then_gemm}"
step selftest "${T_SELFTEST:-100}" selftest.txt python3 -m svdq_loader.testing.selftest "$EXP" --require-gpu \
    --op quantize_act
