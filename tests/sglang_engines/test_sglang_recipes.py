"""docs/recipes.md's `launch_server` lines, parsed by SGLang itself into its ServerArgs (recipe_configs.py:
`prepare_server_args` after SGLang's plugins load; nothing starts), on a tiny converted DeepSeek-V3 in place of the
published one. A supported recipe's configuration is the one its test ran (test_sglang_mla.py's engine arguments,
test_sglang_drafts.py's in-process loads; their environment; imported) but for the values a CPU cannot run, which
the recipe names under "Not run" and this test under `gpu_only`: the DP and TP sizes (attention TP stays 1) and
expert parallelism. The recipes not yet supported are parsed as well: their flags are SGLang's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(900)

import draft_loading  # noqa: E402
import test_sglang_drafts  # noqa: E402
import test_sglang_fp8  # noqa: E402
import test_sglang_kimi_k3_tokens  # noqa: E402
import test_sglang_mla  # noqa: E402
import test_sglang_sharded_mode  # noqa: E402
from support.recipes import read_recipes  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

HERE = Path(__file__).parent
ALL = {k: r for k, r in read_recipes().items() if r.server == "SGLang"}
RECIPES = {
    "deepseek-v3-bf16-sglang-one-node": (
        {"load_format": "shardprep", **test_sglang_mla.DP_ATTENTION, **test_sglang_mla.SHARDED},
        test_sglang_mla.REPLICATED_SHARED_EXPERT, {"tp_size", "dp_size", "ep_size"}),
    "deepseek-v3-mtp-sglang-one-node": (
        {"load_format": "shardprep", **test_sglang_drafts.DP_ATTENTION, **test_sglang_mla.SHARDED,
         **draft_loading.SPECULATIVE["NEXTN"]},
        test_sglang_drafts.REPLICATED_SHARED_EXPERT, {"tp_size", "dp_size", "ep_size"}),
    "deepseek-v3-sglang-one-node": (
        {"load_format": "shardprep", **test_sglang_fp8.DP_ATTENTION, **test_sglang_fp8.SHARDED},
        # The test's other variable turns on its FP8 kernels' torch references (fp8_kernels.py): the CPU's only.
        {"SGLANG_SHARED_EXPERT_TP1": test_sglang_fp8.ENV["SGLANG_SHARED_EXPERT_TP1"]},
        {"tp_size", "dp_size", "ep_size"}),
    "deepseek-v3-sglang-two-nodes": (
        # Node 0's line as sglang_runs launches it (test_sglang_sharded_mode.py, "two nodes"); the tiny Qwen3-MoE it
        # ran has no shared expert, so no SGLANG_SHARED_EXPERT_TP1 there: the recipe's is DeepSeek's (test_sglang_mla).
        {"load_format": "shardprep", **test_sglang_sharded_mode.DP_ATTENTION, **test_sglang_sharded_mode.SHARDED,
         "nnodes": 2, "node_rank": 0, "dist_init_addr": "127.0.0.1:5000"},
        test_sglang_mla.REPLICATED_SHARED_EXPERT,
        {"tp_size", "dp_size", "ep_size", "dist_init_addr", "extra.shard_group_size"}),
    "kimi-k3-sglang-one-node": (
        # Each node's line of the two sharded nodes (test_sglang_kimi_k3_tokens.py) but for the node flags
        # sglang_runs adds; the deepep backend the recipe names is not compared (no all-to-all backend on the CPU).
        test_sglang_kimi_k3_tokens.SHARDED, {}, {"tp_size", "dp_size", "ep_size"}),
}
"""Every supported SGLang recipe: the engine arguments and environment its test ran (test_sglang_mla.py's engines,
test_sglang_drafts.py's in-process loads), and what the recipe sets otherwise (GPU only)."""
NOT_YET: tuple[str, ...] = ()
GPU_ONLY = {"tp_size", "dp_size", "ep_size", "nnodes", "node_rank", "dist_init_addr", "extra.shard_group_size"}
SAYS = {"tp_size": r"DP\s+\d+", "dp_size": r"DP\s+\d+", "ep_size": r"expert\s+parallelism",
        "dist_init_addr": r"two\s+machines", "extra.shard_group_size": r"shard\s+group\s+size"}


@pytest.fixture(scope="module")
def configs(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-recipes")
    model = root / "out"
    convert(checkpoint_cache("deepseek-v3-published", layers=3), model, 2, preset="deepseek-v3")
    jobs = {}
    for key, recipe in ALL.items():
        for i, line in enumerate(recipe.served()):
            args = line.server_args()
            args[args.index("--model-path") + 1] = str(model)
            jobs[f"{key} {i}"] = {"launch": args}
    for key, (engine, _, _) in RECIPES.items():
        jobs[f"{key} tested"] = {"engine": {"model_path": str(model), **engine}}
    (root / "in.json").write_text(json.dumps(jobs))
    path = os.pathsep.join(p for p in (str(HERE / "stand_ins"), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, str(HERE / "recipe_configs.py"), str(root / "in.json"),
                           str(root / "out.json")], capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": path, "SGLANG_USE_CPU_ENGINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


def test_every_sglang_recipe_is_held_to_an_engine_test_or_marked_not_yet_supported():
    assert {k for k, r in ALL.items() if r.supported and r.commands} == set(RECIPES)
    assert {k for k, r in ALL.items() if not r.supported and r.commands} == set(NOT_YET)
    assert all(gpu_only <= GPU_ONLY for _, _, gpu_only in RECIPES.values())


@pytest.mark.parametrize("key", list(ALL), ids=list(ALL))
def test_every_sglang_line_of_a_recipe_is_a_configuration_sglang_accepts(configs, key):
    lines = ALL[key].served()
    for i, line in enumerate(lines):
        got = configs[f"{key} {i}"]
        assert "error" not in got, got
        assert got["load_format"] == "shardprep" and got["extra.shard_weights"] is True
        assert got["enable_dp_attention"] and got["tp_size"] == got["dp_size"]  # attention TP 1
        assert got["nnodes"] == (len(lines) if line.node is not None else 1)
        assert got["node_rank"] == (line.node or 0)


@pytest.mark.parametrize("key", list(RECIPES), ids=list(RECIPES))
def test_a_recipe_is_the_configuration_its_engine_test_ran_but_for_gpu_only_values(configs, key):
    _, env, gpu_only = RECIPES[key]
    tested, recipe = configs[f"{key} tested"], ALL[key]
    assert "error" not in tested, tested
    line = recipe.served()[0]
    got = configs[f"{key} 0"]
    differ = {k for k in got.keys() | tested.keys() if got.get(k) != tested.get(k)}
    assert differ == gpu_only, {k: (got.get(k), tested.get(k)) for k in differ}
    assert line.env == env  # SGLANG_SHARED_EXPERT_TP1=1, as the test ran it
    not_run = recipe.text.split("Not run: ", 1)[1]
    for value in differ:
        assert re.search(SAYS[value], not_run), (key, value, not_run)
