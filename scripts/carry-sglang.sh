#!/usr/bin/env bash
# Carry SGLang 0.5.17 (the newest release pinned to torch 2.11, the H200 image's torch), the
# packages its server imports that the image lacks, the CRIU bundle and ckptflow's runner wheels
# to a GPU machine that has no route to a package index, in parts of <= 58 MiB (scripts/carry-lib.sh).
#
# Here (with network):
#   scripts/carry-sglang.sh pack                    # -> .whl/sglang-carry/part-NN (+ MANIFEST)
# On the GPU machine, one call per part, each within 30 s of the last (as scripts/carry-vllm.sh):
#   scripts/carry-sglang.sh stage .whl/sglang-carry/part-01     # carry=[".whl/sglang-carry/part-01"]
#   scripts/carry-sglang.sh stage .whl/sglang-carry/part-03 && scripts/carry-sglang.sh install
#   eval "$(scripts/carry-sglang.sh env)"; python3 bench/sglang_gpu.py --rows a,b
#
# What is carried was found on this CPU machine: the distributions of every module loaded by
# importing SGLang's server, scheduler, tokenizer and detokenizer managers, model runner, Llama
# model, triton attention backend and radix/hierarchical caches (SGLang itself does not serve on
# CPU from registry packages: docs/engines/sglang.md), minus what torch brings (the image has it).
# sglang-kernel is slimmed to what a bf16 Llama on Hopper with the triton attention backend
# loads: sm90/common_ops (18 MB) of its 1.2 GB; FlashAttention-3 (flash_ops, 1.1 GB), FlashMLA,
# the sm100 build and a cp310-only extension stay behind. SGLang runs --attention-backend triton
# --sampling-backend pytorch; flashinfer's Python package is carried because SGLang's fp8 utilities
# import it at module level on CUDA (found on the H200: ModuleNotFoundError at server start).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/carry-lib.sh
NAME=sglang
SGLANG_VERSION=0.5.17
PYVER=${PYVER:-3.12}
SITE=${HOME}/ssite

DEPS=(
  sglang==$SGLANG_VERSION torchvision==0.26.0 transformers==5.12.1 huggingface_hub==1.33.0 hf-xet==1.8.0
  tokenizers==0.22.2 safetensors==0.8.0 regex==2026.11.19 PyYAML==6.0.4 tqdm==4.70.1 packaging==26.4
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 charset-normalizer==3.5.3
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 uvloop==0.23.0 h11==0.16.0
  anyio==4.16.0 sniffio==1.3.1 click==8.5.1 python-multipart==0.0.34 watchfiles==1.3.0
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 httpx==0.28.1 httpcore==1.0.9 httpx2==2.16.2 httpcore2==2.16.2
  openai==2.6.1 anthropic==2.15.0 jiter==0.19.0 distro==1.9.0 docstring_parser==0.18.0
  pyzmq==27.3.0 orjson==3.13.0 msgspec==0.23.0 pybase64==1.5.1 setproctitle==1.3.8 psutil==7.2.2
  prometheus_client==0.26.0 dill==0.4.1 xxhash==4.1.0 zstandard==0.25.0 easydict==1.14 einops==0.8.2
  interegular==0.3.3 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 xgrammar==0.2.1 apache-tvm-ffi==0.1.11
  compressed-tensors==0.20.1 gguf==0.19.0 sentencepiece==0.2.3 tiktoken==0.14.0 blobfile==3.0.0
  pycryptodomex==3.24.2 lxml==6.1.3 scipy==1.17.1 pillow==13.0.0 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  loguru==0.7.3 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 typer==0.29.2 shellingham==1.5.4
  opentelemetry-api==1.45.2 ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1
  parso==0.8.7 prompt_toolkit==3.0.53 wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0 stack-data==0.6.3
  executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 matplotlib-inline==0.2.2 decorator==5.2.1
  flashinfer_python==0.6.15.post1 tabulate==0.9.0 ninja==1.13.0
  torch_memory_saver==0.0.10
)
# In sglang-kernel's wheel, what a bf16 Llama on Hopper never loads (see the top).
KERNEL_DROP='sgl_kernel/flash_ops|sgl_kernel/flashmla_ops|sgl_kernel/sm100/|sgl_kernel/infllm_ops'

fetch_wheels() {  # DEST
  local dl=.whl/sglang
  rm -rf "$dl" && mkdir -p "$dl"
  download "$dl" "${DEPS[@]}" "sglang-kernel==0.4.5"
  python3 - "$dl" "$KERNEL_DROP" <<'PY'
import re, sys, zipfile
from pathlib import Path
dl, drop = Path(sys.argv[1]), re.compile(sys.argv[2])
src = next(dl.glob("sglang_kernel-*.whl"))
tmp = src.with_suffix(".slim")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if drop.match(item.filename):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):  # pip reads RECORD: no lines for absent files
            data = b"".join(l for l in data.splitlines(True) if not drop.match(l.decode()))
        zout.writestr(item, data)
tmp.replace(src)
print(f"carry-sglang: {src.name} slimmed to {src.stat().st_size >> 20} MiB")
PY
  cp "$dl"/*.whl "$1/"
}

env_() {
  env_common
}

carry_main "$@"
