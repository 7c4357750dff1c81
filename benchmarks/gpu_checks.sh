#!/usr/bin/env bash
# Every GPU check in one call on a 2-GPU machine (the device tool's nvidia-h200-x2), logs under $OUT.
#   bash benchmarks/gpu_checks.sh checks   # every test marked gpu (requant/convert CPU==CUDA, runtime, run on cuda)
#   bash benchmarks/gpu_checks.sh bench    # bench_gather.py and bench_load.py
#   bash benchmarks/gpu_checks.sh plan     # bench_plan.py, then tests/standalone/test_gpu_plan.py (profile + plan via the CLI)
#   bash benchmarks/gpu_checks.sh all     # one GPU, one call (< 10 min): every gpu test one GPU can run, each with a
#                                         # timeout that fails it, then bench_draft_prefetch.py (3 invocations); a summary
#   bash benchmarks/gpu_checks.sh one-gpu        # every gpu test one GPU can run (the others skip)
#   bash benchmarks/gpu_checks.sh one-gpu-bench  # bench_binding.py and bench_load.py --steps at one rank, 3 times each
#   bash benchmarks/gpu_checks.sh draft-prefetch  # one GPU: every gpu test, then bench_draft_prefetch.py (3 invocations)
#   bash benchmarks/gpu_checks.sh fp8     # one GPU: tests/standalone/test_gpu_fp8.py, bench_fp8_gemm.py 3 times, bench_fp8_kernels.py
#   EAGER=1 bash benchmarks/gpu_checks.sh fp8-profile  # one GPU: profile + plan of a bf16 and a block-FP8 Llama
#                                                      # (EAGER=1: also profile --eager)
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
    tests/runtime/test_gpu_runtime.py >"$OUT/gpu_tests.log" 2>&1
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
  timeout 240 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/standalone/test_gpu_plan.py >"$OUT/gpu_plan.log" 2>&1
  echo "gpu plan test rc=$?" >>"$OUT/gpu_plan.log"
  tail -n 30 "$OUT/bench_plan.log"; tail -n 12 "$OUT/gpu_plan.log"
  ;;
retest)
  timeout 200 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/runtime/test_gpu_runtime.py >"$OUT/gpu_tests.log" 2>&1
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
all)  # env: TEST_TIMEOUT (the whole test run), PER_TEST (one test, unless its module sets more), BENCH_TIMEOUT
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
  versions=$(python3 -c "import torch;print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', '.'.join(map(str, torch.cuda.nccl.version())))")
  t=$SECONDS
  # timeout_method=signal: a stalled test fails and the run goes on (the default, thread, ends the whole run).
  SHARDPREP_TEST_RESULTS_DIR=/tmp/results timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -rfEs -p no:cacheprovider \
    -m gpu --timeout "${PER_TEST:-180}" -o timeout_method=signal tests/ >"$OUT/gpu_tests.log" 2>&1
  tests_rc=$? tests_s=$((SECONDS - t))
  t=$SECONDS
  timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_draft_prefetch.py --out "$OUT/bench_draft_prefetch.json" \
    --timeout 200 >"$OUT/bench_draft_prefetch.log" 2>&1
  bench_rc=$? bench_s=$((SECONDS - t))
  grep -E "FAILED|ERROR|Timeout" "$OUT/gpu_tests.log" | tail -n 20
  tail -n 24 "$OUT/bench_draft_prefetch.log"
  tests_line=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$OUT/gpu_tests.log" | tail -n 1)
  verdict=PASS; if [ "$tests_rc" != 0 ] || [ "$bench_rc" != 0 ]; then verdict=FAIL; fi
  echo "SUMMARY $verdict on $card ($versions): gpu tests rc=$tests_rc in ${tests_s} s: ${tests_line:-no pytest summary}; bench_draft_prefetch rc=$bench_rc in ${bench_s} s" | tee "$OUT/summary.txt"
  [ "$verdict" = PASS ]
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
draft-prefetch)  # env: TEST_TIMEOUT, BENCH_TIMEOUT, BENCH_ARGS
  { nvidia-smi -L
    python3 -c "import sys,torch;print(sys.version,torch.__version__,torch.version.cuda,torch.cuda.nccl.version(),torch.cuda.device_count())"
  } >"$OUT/checks.log" 2>&1
  SHARDPREP_TEST_RESULTS_DIR=/tmp/results timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
    tests/ >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >>"$OUT/gpu_tests.log"
  timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_draft_prefetch.py --out "$OUT/bench_draft_prefetch.json" \
    ${BENCH_ARGS:-} >"$OUT/bench_draft_prefetch.log" 2>&1
  echo "bench_draft_prefetch rc=$?" >>"$OUT/bench_draft_prefetch.log"
  tail -n 3 "$OUT/checks.log"; grep -E "passed|failed|rc=|Error|SKIPPED" "$OUT/gpu_tests.log" | tail -n 40
  tail -n 30 "$OUT/bench_draft_prefetch.log"
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
fp8)
  { nvidia-smi -L
    python3 -c "import sys,torch,transformers,triton;print(sys.version,torch.__version__,torch.version.cuda,transformers.__version__,triton.__version__)"
  } >"$OUT/checks.log" 2>&1
  timeout 300 python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/standalone/test_gpu_fp8.py >"$OUT/gpu_fp8_tests.log" 2>&1
  echo "gpu fp8 tests rc=$?" >>"$OUT/gpu_fp8_tests.log"
  for i in 1 2 3; do
    timeout 100 python3 benchmarks/bench_fp8_gemm.py >>"$OUT/bench_fp8_gemm.log" 2>&1  # its JSON lines are in the log
    echo "bench_fp8_gemm $i rc=$?" >>"$OUT/bench_fp8_gemm.log"
  done
  timeout 150 python3 benchmarks/bench_fp8_kernels.py --out "$OUT/bench_fp8_kernels.json" >"$OUT/bench_fp8_kernels.log" 2>&1
  echo "bench_fp8_kernels rc=$?" >>"$OUT/bench_fp8_kernels.log"
  tail -n 3 "$OUT/checks.log"; grep -E "passed|failed|rc=|Error|assert" "$OUT/gpu_fp8_tests.log" | tail -n 20
  grep -E "^\\||rc=" "$OUT/bench_fp8_gemm.log" "$OUT/bench_fp8_kernels.log"
  ;;
fp8-profile)
  # shardprep profile + plan of one Llama (4 layers of 4096 / 14336, whole 128-blocks) in bf16 and in block FP8,
  # each converted for 1 rank and profiled on the one GPU (a one-rank "gather" is a local copy)
  W=/tmp/fp8-profile; mkdir -p $W
  python3 - "$W" <<'PY' >"$OUT/fp8_profile.log" 2>&1
import sys, torch, transformers as tf
sys.path.insert(0, "tests")
from support.fp8_fixture import quantize_checkpoint_fp8
w = sys.argv[1]
cfg = tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):  # random init on the GPU: minutes on the host's CPU
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(f"{w}/bf16")
del model
quantize_checkpoint_fp8(f"{w}/bf16", f"{w}/fp8")
PY
  for kind in bf16 fp8; do
    python3 -m shardprep convert $W/$kind $W/$kind-out --ranks 1 --preset llama --requant none --quiet &&
      timeout 200 python3 -m shardprep profile $W/$kind-out --nproc 1 --tokens 16,128,1024 --iters 10 \
        --out "$OUT/profile_$kind.json" --trace "$OUT/trace_$kind.json" >>"$OUT/fp8_profile.log" 2>&1; echo "profile $kind rc=$?" >>"$OUT/fp8_profile.log"
    if [ "${EAGER:-0}" = 1 ]; then  # the same, timing eager forwards (what profile timed before CUDA graphs)
      timeout 200 python3 -m shardprep profile $W/$kind-out --nproc 1 --tokens 16,128,1024 --iters 10 --eager \
        --out "$OUT/profile_${kind}_eager.json" >>"$OUT/fp8_profile.log" 2>&1; echo "profile $kind --eager rc=$?" >>"$OUT/fp8_profile.log"
    fi
    # one rank receives no gather bytes: the 2-GPU gather-only bandwidth of ../shared/MEASURED.md (ce, 341 GB/s)
    python3 -m shardprep plan $W/$kind-out --ranks 2 --profile "$OUT/profile_$kind.json" --link-gbps 341 \
      >>"$OUT/fp8_profile.log" 2>&1
    echo "plan $kind rc=$?" >>"$OUT/fp8_profile.log"
  done
  tail -n 60 "$OUT/fp8_profile.log"
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
