#!/usr/bin/env bash
# Unpack the wheels ckptflow's runners import into .carry/py, for a GPU node that has Python,
# torch, cuda-bindings and nvidia-ml-py but no ckptflow install and no package mirror (the
# device machines): bench/on_device.sh puts .carry/py on PYTHONPATH. Idempotent.
#   scripts/carry-wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
pip=.venv/bin/pip
[ -x "$pip" ] || pip="python3 -m pip"
dl=$(mktemp -d)
trap 'rm -rf "$dl"' EXIT
$pip download -q --only-binary=:all: --python-version "$pyver" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dl" pydantic pyyaml prometheus_client psutil httpx
mkdir -p .carry/py
for w in "$dl"/*.whl; do python3 -m zipfile -e "$w" .carry/py; done
echo "carry-wheels: $(ls "$dl" | wc -l) wheels unpacked into .carry/py for Python $pyver"
