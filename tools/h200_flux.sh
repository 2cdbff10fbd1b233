#!/usr/bin/env bash
# The H200 run of svdq_loader.torch and the FLUX example, as one command for the device tool.
#   carry: [".whl", "artifacts"]      (.whl from tools/fetch_wheels.sh; artifacts from configs/flux.yaml)
#   bash tools/h200_flux.sh [tests] [eager] [compile]      (default: tests eager)
# tests:   tests/test_gpu_torch.py (layers vs float64, CUDA graphs, torch.compile, FLUX 1+1 blocks at 1024²)
# eager:   examples/flux_w4a4.py, full FLUX.1-dev, 4096+512 tokens: bf16 vs W4A4 eager, every swapped layer
#          checked against float64, per-kernel profile                      -> $OUT/flux_eager.json
# compile: the same with torch.compile of both models, no profile         -> $OUT/flux_compile.json
# Logs and JSON go to $OUT (the device tool brings that folder back).
set -uo pipefail
OUT=${OUT:-/tmp/svdq-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SVDQ_REQUIRE_GPU=1 SVDQ_ARTIFACTS=artifacts
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, diffusers, safetensors; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"
STAGES=${*:-tests eager}
rc=0
for s in $STAGES; do
    case $s in
    tests)
        python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_torch.py >"$OUT/gpu_torch.log" 2>&1
        r=$?; echo "gpu torch tests exit $r"; grep -E "passed|failed|error|flux 1\+1" "$OUT/gpu_torch.log" | tail -4
        grep -E "^(FAILED|ERROR)" "$OUT/gpu_torch.log" | head -20; [ $r -eq 0 ] || rc=$r ;;
    eager)
        python3 examples/flux_w4a4.py --artifacts artifacts --compile "" --json "$OUT/flux_eager.json" \
            ${FLUX_ARGS:-} >"$OUT/flux_eager.log" 2>&1
        r=$?; echo "flux eager exit $r"; grep -v "^  swapped\|^  skipped" "$OUT/flux_eager.log" | tail -25; [ $r -eq 0 ] || rc=$r ;;
    compile)
        python3 examples/flux_w4a4.py --artifacts artifacts --compile bf16,w4a4 --no-profile --iters 3 \
            --json "$OUT/flux_compile.json" ${FLUX_ARGS:-} >"$OUT/flux_compile.log" 2>&1
        r=$?; echo "flux compile exit $r"; tail -12 "$OUT/flux_compile.log"; [ $r -eq 0 ] || rc=$r ;;
    *) echo "unknown stage $s (tests, eager, compile)"; rc=2 ;;
    esac
done
exit $rc
