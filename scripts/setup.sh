#!/usr/bin/env bash
# One idempotent setup: .venv/ with ckptflow installed (editable, test + sim extras),
# CRIU >= 4.2 passing `criu check`, and llama.cpp's llama-server (scripts/install-llamacpp.sh).
# A second run with everything present is a no-op (<2 s).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
MIN_CRIU=4.2

criu_ok() {
  command -v criu >/dev/null 2>&1 || return 1
  local v
  v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1)
  [ -n "$v" ] || return 1
  [ "$(printf '%s\n%s\n' "$MIN_CRIU" "$v" | sort -V | head -1)" = "$MIN_CRIU" ] || return 1
  criu check >/dev/null 2>&1
}

if ! criu_ok; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: CRIU >= $MIN_CRIU missing, too old or failing 'criu check': building it" >&2
    ./scripts/install-criu.sh
    hash -r
    criu_ok || { echo "setup: CRIU still fails 'criu check' after install: run 'criu check' to see why" >&2; exit 1; }
  else
    echo "setup: warning: CRIU >= $MIN_CRIU is not usable and building it needs root;" \
         "checkpoint commands will fail until 'sudo ./scripts/install-criu.sh' is run" >&2
  fi
fi

# PostgreSQL binaries for the fleet-mode tests (Prefect's database there, as in production).
# Only the binaries: the tests run their own cluster on 127.0.0.1 and stop it; the package's
# own service is kept from starting (policy-rc.d) so nothing is left listening.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing PostgreSQL (Debian package) for the fleet-mode tests" >&2
    made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
      chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }
    if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "setup: warning: PostgreSQL is missing; the fleet-mode tests need it (apt-get install postgresql)" >&2
  fi
fi

# podman + runc for the container workloads (issue 22, tests/test_container.py): Debian's podman
# checkpoints through runc, which runs the first `criu` on PATH (the >= 4.2 above; the package
# also pulls Debian's older criu into /usr/sbin, which comes later on PATH). No registry is needed:
# the tests' image is built from local files below.
# curl: the how-to pages' commands use it, and a test runs them as written (tests/test_howto.py).
if ! command -v curl >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q curl >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q curl >/dev/null; }
fi
if ! { command -v podman && command -v runc; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing podman and runc (Debian packages) for the container workloads" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc >/dev/null; }
  else
    echo "setup: warning: podman/runc are missing; the container tests need them (apt-get install podman runc)" >&2
  fi
fi

# The stamp ties the venv to this pyproject and interpreter; anything else changed -> reinstall.
want="$(sha256sum pyproject.toml | cut -c1-16) $($PY -c 'import sys; print(sys.version.split()[0])')"
if ! { [ -x .venv/bin/python ] && [ "$(cat .venv/.ckptflow-stamp 2>/dev/null)" = "$want" ]; }; then
  echo "setup: creating .venv and installing ckptflow (first run takes about a minute)" >&2
  [ -x .venv/bin/python ] || $PY -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,sim]'
  echo "$want" > .venv/.ckptflow-stamp
fi

# llama.cpp's llama-server (pinned, hash-checked source; CPU build, ~6 min once, then cached)
# for the real-engine tests. CKPTFLOW_LLAMACPP_CUDA=1 builds the GPU flavour instead.
if [ "$(id -u)" = 0 ] || { command -v cmake && command -v g++ && command -v make; } >/dev/null 2>&1; then
  ./scripts/install-llamacpp.sh
else
  echo "setup: warning: cmake/g++/make are missing and installing them needs root; the llama.cpp" \
       "tests will skip until 'sudo apt-get install cmake build-essential && ./scripts/install-llamacpp.sh'" >&2
fi

# The container tests' image (python, numpy, prometheus_client and ckptflow from this machine's
# own files, `podman import`ed: no registry), tagged with the digest of its inputs; nothing to do
# when that tag exists.
if [ "$(id -u)" = 0 ] && command -v podman >/dev/null 2>&1; then
  .venv/bin/python -m ckptflow.runners.rootfs demo-image >/dev/null
fi

# vLLM's CPU build (pinned) in its own virtualenv for the real-engine vLLM tests (~3 min once,
# then cached under .ckptflow/vllm/).
./scripts/install-vllm.sh
