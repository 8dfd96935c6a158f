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

source scripts/carry-lib.sh
NAME=vllm
VLLM_VERSION=0.26.0
PYVER=${PYVER:-3.12}
SITE=${HOME}/vsite

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
fetch_wheels() {  # DEST
  mkdir -p .whl/vllm
  ls .whl/vllm/vllm-$VLLM_VERSION-*.whl >/dev/null 2>&1 || download .whl/vllm "vllm==$VLLM_VERSION"
  rm -rf .whl/deps && mkdir -p .whl/deps  # one wheel per package (an older download may hold another tag)
  download .whl/deps "${DEPS[@]}"
  cp .whl/vllm/vllm-$VLLM_VERSION-*.whl .whl/deps/*.whl "$1/"
}

env_() {
  env_common
  echo "export VLLM_NO_USAGE_STATS=1"
}

carry_main "$@"
