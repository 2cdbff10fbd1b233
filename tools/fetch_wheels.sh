#!/usr/bin/env bash
# Wheels the H200 lacks for examples/flux_w4a4.py and tests/test_gpu_torch.py, for the device tool's `carry`.
#   bash tools/fetch_wheels.sh [DIR]          # default DIR: .whl in the repository root (git-ignored)
# That machine (Python 3.12, x86-64) already has torch, safetensors 0.8.0, huggingface_hub 1.33.0, numpy,
# regex, requests, filelock, Pillow and zipp; diffusers and importlib_metadata are what is missing
# (diffusers 0.42.1 needs huggingface-hub>=1.32, safetensors>=0.8; on Python 3.12 it imports the standard
# importlib.metadata, but importlib_metadata is a declared need: 8.7 needs only zipp, which is there).
# Both wheels are pure Python, 6.4 MB together.
# On the device, before anything imports diffusers:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
DIR=${1:-"$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)/.whl"}
mkdir -p "$DIR"
for spec in diffusers==0.42.1 importlib_metadata==8.7.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DIR" "$spec"
done
ls -l "$DIR"
for w in "$DIR"/*.whl; do                      # what each needs (the H200 list must cover the rest)
    echo "$(basename "$w"):"; unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
