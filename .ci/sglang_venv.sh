#!/usr/bin/env bash
# Build the SGLang test venv from nothing: .ci/sglang_venv.sh VENV [deps|shardprep]
# (deps: everything but shardprep, what .ci/run builds in the background while the README's tests run; shardprep:
# then shardprep itself and the check that the venv is whole; neither: both, one after the other).
# SGLang 0.5.23 on the CPU, the recipe measured in issue 35: torch 2.14.1 (SGLang pins it) with torchvision
# 0.29.1 (imported at module level by srt/configs/deepseek_ocr.py), sglang itself without its dependencies
# (its pinned graph wants CUDA-only packages and does not resolve on a CPU machine), then the runtime
# dependencies it imports, by name, then shardprep (editable, so its `sglang.srt.plugins` entry point is
# registered). No CPU build of sgl_kernel is published: tests/sglang_engines/ brings a pure-torch stand-in.
# uv builds it (the binary named with the venv's interpreter: `python3 -m uv pip` would install into python3's
# own environment); pip is the fallback. Prints its wall time and size.
set -euo pipefail
venv=${1:?usage: .ci/sglang_venv.sh VENV [deps|shardprep]}
part=${2:-all}
repo=$(cd "$(dirname "$0")/.." && pwd)
start=$SECONDS

torch_pins=(torch==2.14.1 torchvision==0.29.1)
# A CPU build of torch 2.14.1 saves ~5 GB of CUDA libraries; PyPI's build is a CUDA one that runs on the CPU.
cpu_index=https://download.pytorch.org/whl/cpu
# SGLang's runtime imports on the CPU path (tiny Llama / Qwen3-MoE / DeepSeek-V3 engines, and launch_server's HTTP
# server, which imports soundfile at module level for its audio endpoints), found by import errors;
# the CUDA-only ones (sglang-kernel, flashinfer, flash-attn, deep-gemm/ep, nvidia-*, tilelang, ...) are left out.
# fla-core: its pure-torch KDA (fla/ops/kda/naive.py) checks the K3 test plugin's references (test_k3_ops.py).
deps=(
  transformers==5.19.0 tokenizers==0.23.2 fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" orjson msgspec pybase64
  setproctitle interegular partial_json_parser xgrammar==0.2.7 "llguidance>=1.7.6,<2" openai==2.8.0
  openai-harmony==0.0.4 tiktoken sentencepiece==0.2.1 gguf blobfile==3.0.0 apache-tvm-ffi==0.1.11
  compressed-tensors==0.18.0 IPython dill aiohttp einops psutil requests pillow "prometheus-client>=0.20.0"
  python-multipart pydantic regex scipy tqdm numpy packaging xxhash zstandard watchfiles distro easydict
  soundfile pytest pytest-timeout
  fla-core==0.5.2
)

if uv=$(python3 -c "import uv; print(uv.find_uv_bin())" 2>/dev/null); then
  [ "$part" = shardprep ] || "$uv" venv -q -p python3 "$venv"
  install() { "$uv" pip install -q --python "$venv/bin/python" "$@"; }
else
  [ "$part" = shardprep ] || python3 -m venv "$venv"
  install() { "$venv/bin/pip" install -q "$@"; }
fi
if [ "$part" != shardprep ]; then
if ! install --index-url "$cpu_index" "${torch_pins[@]}" 2>/dev/null; then
  echo "sglang venv: no CPU torch 2.14.1 at $cpu_index; PyPI's CUDA build instead (~5 GB more)"
  install "${torch_pins[@]}"
fi
install --no-deps sglang==0.5.23
install "${deps[@]}" "${torch_pins[@]}"
fi
if [ "$part" = deps ]; then echo "sglang venv: its dependencies in $((SECONDS - start)) s"; exit 0; fi
install -e "$repo[runtime]" "${torch_pins[@]}"
# The venv is whole before the tests start: SGLang's engine and HTTP server, shardprep's SGLang glue, pytest.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$repo/tests/sglang_engines/stand_ins" "$venv/bin/python" -c \
  "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server, shardprep.integrations.sglang.model_loader, pytest"
if python3 -c "import sglang" 2>/dev/null; then echo "SGLang leaked into python3's own environment"; exit 1; fi
echo "sglang venv: built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
