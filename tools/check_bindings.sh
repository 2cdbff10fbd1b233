#!/usr/bin/env bash
# The loader against each cuda-bindings major on the CPU, each in a temporary venv without torch or the DSL:
#   bash tools/check_bindings.sh [ARTIFACTS]          (default: builds configs/tiny.yaml with this venv's DSL)
# Needs the package index (pip); prints one verdict line per major.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ART=${1:-}
if [ -z "$ART" ]; then
    ART=$WORK/artifacts
    svdq-aot build "$ROOT/configs/tiny.yaml" -o "$ART" -j 1 >"$WORK/build.log" 2>&1 || { tail -5 "$WORK/build.log"; exit 1; }
fi
rc=0
for spec in "cuda-bindings>=12.8,<13" "cuda-bindings>=13,<14"; do
    venv=$WORK/venv-$(echo "$spec" | tr -c 'a-z0-9' '_')
    python3 -m venv "$venv" && "$venv/bin/pip" install -q "$spec" numpy pyyaml click "setuptools>=68" >"$WORK/pip.log" 2>&1 \
        && "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" >>"$WORK/pip.log" 2>&1 \
        || { echo "$spec: install failed"; tail -5 "$WORK/pip.log"; rc=1; continue; }
    out=$(cd "$WORK" && "$venv/bin/python" -m svdq_loader.bindings_check "$ART" 2>&1)
    code=$?
    echo "$spec: $(echo "$out" | tr '\n' ' ')"
    [ $code -eq 0 ] || rc=1
done
exit $rc
