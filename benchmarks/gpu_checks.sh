#!/usr/bin/env bash
# Every GPU check in one call on a 2-GPU machine (the device tool's nvidia-h200-x2), logs under $OUT.
#   bash benchmarks/gpu_checks.sh checks   # every test marked gpu (requant/convert CPU==CUDA, runtime, run on cuda)
#   bash benchmarks/gpu_checks.sh bench    # bench_gather.py and bench_load.py
#   bash benchmarks/gpu_checks.sh plan     # bench_plan.py, then tests/test_gpu_plan.py (profile + plan via the CLI)
#   bash benchmarks/gpu_checks.sh one-gpu        # every gpu test one GPU can run (the others skip)
#   bash benchmarks/gpu_checks.sh one-gpu-bench  # bench_binding.py and bench_load.py --steps at one rank, 3 times each
# Wheels the GPU image lacks (jsonschema and its dependencies) may be carried in .whl/.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
case "${1:-checks}" in
zero-copy)  # env: SCENARIOS, TEST_K (a pytest -k expression), TEST_TIMEOUT, BENCH_ARGS, BENCH_TIMEOUT, ZC_CHECK=1
  K=(); if [ -n "${TEST_K:-}" ]; then K=(-k "$TEST_K"); fi
  { nvidia-smi -L
    python3 -c "import torch, cuda.bindings; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), cuda.bindings.__version__)"
    if [ "${ZC_CHECK:-0}" = 1 ]; then
      timeout 90 python3 benchmarks/check_zero_copy_gpu.py --out "$OUT/zc_facts.json"; echo "check_zero_copy_gpu rc=$?"
      timeout 30 python3 benchmarks/check_zero_copy_gpu.py --control; echo "control rc=$?"
    fi
  } >"$OUT/zc_check.log" 2>&1
  SHARDPREP_GPU_SCENARIOS=${SCENARIOS:-memory,zero-copy,backends} SHARDPREP_TEST_RESULTS_DIR=/tmp/results \
    timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -q -rA -p no:cacheprovider -m gpu ${K[@]+"${K[@]}"} \
    tests/test_gpu_runtime.py >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/gpu_tests.log"
  tar -C /tmp -cf "$OUT/gpu_test_results.tar" results 2>/dev/null
  timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_gather.py --backends ce,nccl --no-fsdp --no-graphs --no-cta2 \
    ${BENCH_ARGS:---tokens 16,1024 --iters 10} --out "$OUT/bench_gather.json" >"$OUT/bench_gather.log" 2>&1
  echo "bench_gather rc=$?" >>"$OUT/bench_gather.log"
  tail -n 8 "$OUT/zc_check.log"; grep -E "passed|failed|rc=|Error|assert" "$OUT/gpu_tests.log" | tail -n 30
  tail -n 60 "$OUT/bench_gather.log"
  ;;
plan)
  # bench_plan on 2 GPUs (the MEASURED.md stack: profile, plan, measure 3 layer choices), then the profile and
  # plan test on a converted llama through the CLI.
  timeout 330 python3 benchmarks/bench_plan.py --out "$OUT/bench_plan.json" >"$OUT/bench_plan.log" 2>&1
  echo "bench_plan rc=$?" >>"$OUT/bench_plan.log"
  timeout 240 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu_plan.py >"$OUT/gpu_plan.log" 2>&1
  echo "gpu plan test rc=$?" >>"$OUT/gpu_plan.log"
  tail -n 30 "$OUT/bench_plan.log"; tail -n 12 "$OUT/gpu_plan.log"
  ;;
retest)
  timeout 200 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu_runtime.py >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/gpu_tests.log"
  timeout 360 python3 benchmarks/bench_gather.py --no-cta2 --out "$OUT/bench_gather.json" >"$OUT/bench_gather.log" 2>&1
  echo "bench_gather rc=$?" >>"$OUT/bench_gather.log"
  tail -n 16 "$OUT/gpu_tests.log"; tail -n 45 "$OUT/bench_gather.log"
  ;;
checks)
  { nvidia-smi -L; nvidia-smi topo -m
    python3 -c "import sys,torch;print(sys.version,torch.__version__,torch.version.cuda,torch.cuda.nccl.version(),torch.cuda.device_count())"
    python3 -c "import safetensors,xxhash,jsonschema,transformers,tokenizers,typer,rich;print('deps ok', transformers.__version__)"
  } >"$OUT/checks.log" 2>&1
  SHARDPREP_TEST_RESULTS_DIR=/tmp/results timeout 400 python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
    tests/ >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/gpu_tests.log"
  tar -C /tmp -cf "$OUT/gpu_test_results.tar" results 2>/dev/null
  tail -n 30 "$OUT/checks.log"; tail -n 40 "$OUT/gpu_tests.log"
  ;;
one-gpu)
  { nvidia-smi -L
    python3 -c "import sys,torch;print(sys.version,torch.__version__,torch.version.cuda,torch.cuda.nccl.version(),torch.cuda.device_count())"
    python3 -c "import safetensors,xxhash,jsonschema,transformers,tokenizers,typer,rich;print('deps ok', transformers.__version__)"
  } >"$OUT/checks.log" 2>&1
  SHARDPREP_TEST_RESULTS_DIR=/tmp/results timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
    tests/ >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/gpu_tests.log"
  tail -n 6 "$OUT/checks.log"; grep -E "passed|failed|rc=|Error|SKIPPED" "$OUT/gpu_tests.log" | tail -n 40
  ;;
one-gpu-bench)
  for i in 1 2 3; do
    timeout 80 python3 benchmarks/bench_binding.py --device cuda --workdir /tmp/bench-binding --out "$OUT/bench_binding_$i.json" \
      >>"$OUT/bench_binding.log" 2>&1; echo "bench_binding $i rc=$?" >>"$OUT/bench_binding.log"
    mkdir -p /tmp/bench-load
    timeout 100 python3 benchmarks/bench_load.py --steps --size-gb 2 --vocab 32000 --ranks 1 --device cuda \
      --workdir /tmp/bench-load --json "$OUT/bench_load_steps_$i.json" >>"$OUT/bench_load_steps.log" 2>&1
    echo "bench_load --steps $i rc=$?" >>"$OUT/bench_load_steps.log"
  done
  grep -E "^\\||rc=" "$OUT/bench_binding.log"; tail -n 40 "$OUT/bench_load_steps.log"
  ;;
bench)
  timeout 420 python3 benchmarks/bench_gather.py --out "$OUT/bench_gather.json" >"$OUT/bench_gather.log" 2>&1
  echo "bench_gather rc=$?" >>"$OUT/bench_gather.log"
  timeout 120 python3 benchmarks/bench_load.py --size-gb 1 --ranks 8 --device cuda:0 --json "$OUT/bench_load_gpu.json" \
    >"$OUT/bench_load_gpu.log" 2>&1
  echo "bench_load rc=$?" >>"$OUT/bench_load_gpu.log"
  tail -n 50 "$OUT/bench_gather.log"; tail -n 15 "$OUT/bench_load_gpu.log"
  ;;
esac
