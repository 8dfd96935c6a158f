#!/usr/bin/env bash
# Carry vLLM 0.26.0 (the last release pinned to torch 2.11, the H200 image's torch), the
# packages its OpenAI server imports that the image lacks, the CRIU bundle and ckptflow's runner
# wheels to a GPU machine that has no route to a package index, in parts of <= 58 MiB (a device
# call carries <= 64 MiB, the working tree included).
#
# Here (with network):
#   scripts/carry-vllm.sh pack             # -> .whl/vllm-carry/part-NN (+ MANIFEST), ignored by git
# On the GPU machine, one call per part, each call within 30 s of the last (the machine stays
# warm and keeps $HOME; ignored files of the tree that a call does not carry are gone):
#   scripts/carry-vllm.sh stage .whl/vllm-carry/part-01      # carry=[".whl/vllm-carry/part-01"]
#   ...
#   scripts/carry-vllm.sh stage .whl/vllm-carry/part-06 && scripts/carry-vllm.sh install
#   eval "$(scripts/carry-vllm.sh env)"    # PYTHONPATH (vLLM + deps), CKPTFLOW_CRIU, PATH
#
# What the image lacks was found by resolving vLLM's own Requires-Dist (minus torch and the
# kernel packages a bf16 Llama on Hopper does not import: flashinfer, cutlass-dsl, quack,
# tilelang, tokenspeed-mla, humming-kernels, torchcodec, PyNvVideoCodec, fastsafetensors,
# nvidia-cudnn-frontend, apache-tvm-ffi) and dropping what the image's `pip list` has; an AST scan
# of the module-level imports from vllm.entrypoints.openai.api_server, the engine core, the GPU
# worker and model runner, FlashAttention's backend and the Llama model found nothing else missing
# (deep_ep, mori, flashinfer, torchao, modelscope are imported only behind checks).
# Found on the H200 (2026-11-30): xgrammar 0.2.9 (imported by vllm.v1.structured_output at server
# import) needs apache-tvm-ffi >= 0.1.11 (vLLM pins 0.1.10 for flashinfer, which is not carried);
# and the engine needs VLLM_USE_FLASHINFER_SAMPLER=0 without flashinfer (the V2 model runner's
# sampler imports it otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.26.0
PYVER=${PYVER:-3.12}
PART_MB=58
OUTDIR=.whl/vllm-carry
HOME_PARTS=${HOME}/vllm-parts
HOME_CARRY=${HOME}/vllm-carry
HOME_SITE=${HOME}/vsite

# Not on the H200 image (its pip list, 2026-11), needed by vLLM 0.26.0's server import chain.
DEPS=(
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 websockets==17.4 python-dotenv==1.2.4
  python-multipart==0.0.34 email-validator==2.4.0 dnspython==2.9.2
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-settings==2.16.3 pydantic-extra-types==2.11.1
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 anthropic==2.14.0 docstring_parser==0.18.0
  httpx2==2.16.2 httpcore2==2.16.2
  pyzmq==27.3.0 msgspec==0.23.0 blake3==1.0.11 cbor2==6.3.0 ijson==3.6.0 pybase64==1.5.1
  setproctitle==1.3.8 watchfiles==1.3.0 python-json-logger==4.2.0 cachetools==8.0.2
  partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0
  lm-format-enforcer==0.11.3 interegular==0.3.3 outlines_core==0.2.14 lark==1.2.2 llguidance==1.7.6
  xgrammar==0.2.9 apache-tvm-ffi==0.1.11 compressed-tensors==0.17.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1
  openai-harmony==0.0.8 mistral_common==1.13.1 pycountry==26.2.16
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 mcp==2.3.0 mcp-types==2.3.0 sse-starlette==3.7.0
  PyJWT==2.15.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-exporter-http-transport==0.66b2
  googleapis-common-protos==1.76.0 nvtx==0.2.15
)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 linux_x86_64)

download() {  # DEST SPEC...
  local dest=$1; shift
  local plat=()
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" "${plat[@]}" -d "$dest" "$@"
}

pack() {
  mkdir -p .whl/vllm .whl/deps
  ls .whl/vllm/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 || download .whl/vllm "vllm==$VLLM_VERSION"
  rm -rf .whl/deps && mkdir -p .whl/deps  # one wheel per package (an older download may hold another tag)
  download .whl/deps "${DEPS[@]}"
  [ -x .carry/criu/bin/criu ] || ./scripts/criu-bundle.sh
  [ -d .carry/py/pydantic ] || ./scripts/carry-wheels.sh "$PYVER"
  local stage
  stage=$(mktemp -d)
  trap 'rm -rf "$stage"' RETURN
  mkdir -p "$stage/wheels"
  cp .whl/vllm/vllm-$VLLM_VERSION-*.whl .whl/deps/*.whl "$stage/wheels/"
  cp -a .carry/criu "$stage/criu"
  cp -a .carry/py "$stage/py"
  rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
  tar -C "$stage" -cf - wheels criu py | gzip -6 | split -b "${PART_MB}M" -d -a 2 --numeric-suffixes=1 - "$OUTDIR/part-"
  (cd "$OUTDIR" && sha256sum part-* > MANIFEST)
  echo "carry-vllm: $(ls "$OUTDIR"/part-* | wc -l) parts in $OUTDIR ($(du -sh "$OUTDIR" | cut -f1)):"
  cat "$OUTDIR/MANIFEST"
}

stage() {  # PART: copy one carried part out of the tree (the next call removes it from the tree)
  mkdir -p "$HOME_PARTS"
  cp "$1" "$HOME_PARTS/"
  echo "carry-vllm: staged $(basename "$1"); have: $(ls "$HOME_PARTS" | tr '\n' ' ')"
}

install() {
  local want have
  want=$(cut -d' ' -f3 "$OUTDIR/MANIFEST" 2>/dev/null | wc -l || echo 0)
  have=$(ls "$HOME_PARTS" | wc -l)
  echo "carry-vllm: $have parts staged${want:+ (manifest lists $want)}"
  if [ -f "$OUTDIR/MANIFEST" ]; then (cd "$HOME_PARTS" && sha256sum -c --quiet "$OLDPWD/$OUTDIR/MANIFEST"); fi
  rm -rf "$HOME_CARRY" "$HOME_SITE" && mkdir -p "$HOME_CARRY"
  cat "$HOME_PARTS"/part-* | gzip -dc | tar -C "$HOME_CARRY" -xf -
  local t0=$SECONDS
  python3 -m pip install -q --disable-pip-version-check --no-deps --no-index --target "$HOME_SITE" "$HOME_CARRY"/wheels/*.whl
  echo "carry-vllm: installed $(ls "$HOME_CARRY"/wheels | wc -l) wheels into $HOME_SITE in $((SECONDS - t0)) s"
  rm -rf "$HOME_PARTS"
  "$HOME_CARRY/criu/bin/criu" --version | head -1
}

env_() {
  echo "export PYTHONPATH=$HOME_SITE:$PWD:$HOME_CARRY/py\${PYTHONPATH:+:\$PYTHONPATH}"
  echo "export CKPTFLOW_CRIU=$HOME_CARRY/criu/bin/criu PATH=$HOME_CARRY/criu/bin:\$PATH"
  echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
  echo "export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
}

case "${1:-}" in
  pack) pack ;;
  stage) stage "$2" ;;
  install) install ;;
  env) env_ ;;
  *) echo "usage: $0 pack | stage PART | install | env" >&2; exit 2 ;;
esac
