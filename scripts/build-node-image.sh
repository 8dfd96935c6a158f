#!/usr/bin/env bash
# Build the node image `ckptflow deploy`'s DaemonSet names (default localhost/ckptflow:<version>)
# from this machine's own files, no registry: deployments/node-image/Containerfile FROM a rootfs
# of the venv's Python, site-packages, CRIU and tools (ckptflow/nodeimage.py). Run as root after
# ./scripts/setup.sh. Arguments: [TAG] [--workdir DIR] (DIR: the project's path in the image and
# `ckptflow deploy --workdir`, default /srv/ckptflow).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m ckptflow.nodeimage "$@"
