#!/usr/bin/env bash
# Run a bench on a GPU node that has no ckptflow install and no route to a mirror (the device
# machines): CRIU from the relocatable bundle (scripts/criu-bundle.sh -> .carry/criu) and the
# few wheels the runners need unpacked in .carry/py (scripts/carry-wheels.sh; torch, cuda-bindings and
# nvidia-ml-py are the node's own).
#   bench/on_device.sh python3 bench/gpu_tp.py --configs nccl:2:8
set -euo pipefail
cd "$(dirname "$0")/.."
export CKPTFLOW_CRIU=$PWD/.carry/criu/bin/criu
export PATH=$PWD/.carry/criu/bin:$PATH
export PYTHONPATH=$PWD/.carry/py:$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0
"$CKPTFLOW_CRIU" check >/dev/null 2>&1 || { echo "on_device: criu check failed:"; "$CKPTFLOW_CRIU" check; }
exec "$@"
