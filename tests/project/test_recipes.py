"""docs/recipes.md: every recipe says what was tested and what was not, its shardprep lines parse with shardprep's
own command line, and its commands agree with each other (the directory convert writes is the one served, N
divides every node's DP ranks, the nodes' lines differ only where a node must). The server lines are parsed by
the servers themselves in their CI stages (tests/vllm_engines/test_vllm_recipes.py,
tests/sglang_engines/test_sglang_recipes.py)."""

import json
import re
from pathlib import Path

import pytest
import typer
from support.recipes import PAGE, Recipe, read_recipes

from shardprep.cli import app
from shardprep.prep.selection import builtin_presets

ROOT = Path(__file__).resolve().parents[2]
RECIPES = read_recipes()
SERVED = {k: r for k, r in RECIPES.items() if r.commands}
# Where each server's stage checks its recipes; a recipe of a server is listed in that test.
SERVER_TESTS = {"vLLM": ROOT / "tests/vllm_engines/test_vllm_recipes.py",
                "SGLang": ROOT / "tests/sglang_engines/test_sglang_recipes.py"}


def test_every_recipe_says_its_status_and_a_supported_one_what_ran_and_what_did_not():
    assert len(RECIPES) >= 9 and len(SERVED) >= 8
    for recipe in RECIPES.values():
        assert recipe.text.startswith(("**Supported", "**Not yet supported:** ")), recipe.id
        if recipe.supported:
            assert "Tested: " in recipe.text and "Not run: " in recipe.text, recipe.id
            named = re.findall(r"`(tests/[\w/]+\.py)`", recipe.text)
            assert named and all((ROOT / t).is_file() for t in named), (recipe.id, named)
        else:
            why = recipe.text.split("**Not yet supported:** ", 1)[1]
            assert len(why.split()) >= 5, recipe.id  # a sentence saying why


def test_the_pages_table_lists_every_recipe_and_the_readme_links_the_page():
    text = PAGE.read_text()
    rows = re.findall(r"^\| \[[^\]]+\]\(#([\w-]+)\) \|", text, re.M)
    assert len(rows) == len(RECIPES) == len(set(rows))
    assert "(docs/recipes.md)" in (ROOT / "README.md").read_text()


def parse_shardprep(argv: list[str]) -> dict:
    """shardprep's own parser on a recipe's line, nothing run: the options by name, as the command gets them."""
    assert argv[0] == "shardprep", argv
    command = typer.main.get_command(app).commands[argv[1]]  # type: ignore[attr-defined]
    with command.make_context(argv[1], list(argv[2:])) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("recipe", SERVED.values(), ids=SERVED.keys())
def test_every_shardprep_line_parses_with_shardprep_and_names_a_shipped_preset(recipe: Recipe):
    lines = [c for c in recipe.commands if c.program == "shardprep"]
    assert lines and recipe.shardprep("convert") is not None
    for line in lines:
        params = parse_shardprep(line.argv)
        if "preset" in params and params["preset"] is not None:
            assert params["preset"] in builtin_presets(), (recipe.id, params["preset"])


def sharded_n(recipe: Recipe) -> int:
    return parse_shardprep(recipe.shardprep("convert").argv)["ranks"]


@pytest.mark.parametrize("recipe", SERVED.values(), ids=SERVED.keys())
def test_a_recipes_commands_serve_what_it_converts_in_node_local_groups(recipe: Recipe):
    convert = parse_shardprep(recipe.shardprep("convert").argv)
    n, out = convert["ranks"], str(convert["out"])
    validate = recipe.shardprep("validate")
    if validate is not None:
        checked = parse_shardprep(validate.argv)
        assert [str(p) for p in checked["paths"]] == [out] and checked["source"] == convert["src"]
    served = recipe.served()
    assert served and len({c.program for c in served}) == 1
    nodes = sorted(c.node for c in served if c.node is not None)
    assert nodes == list(range(len(nodes))) and (len(nodes) == len(served) or not nodes)
    for line in served:
        model = line.argv[2] if line.program == "vllm" else line.option("--model-path")
        assert model == out, (recipe.id, model)
        assert line.option("--load-format") == "shardprep"
        extra = json.loads(line.option("--model-loader-extra-config"))
        assert extra["shard_weights"] is True and extra.get("shard_group_size", n) == n
        if line.program == "vllm":
            assert line.argv[1] == "serve"
            dp = int(line.option("--data-parallel-size"))
            per_node = int(line.option("--data-parallel-size-local") or dp)
        else:
            dp, tp = int(line.option("--dp-size")), int(line.option("--tp-size"))
            assert tp == dp and "--enable-dp-attention" in line.argv  # attention TP 1
            per_node = dp // int(line.option("--nnodes") or 1)
            if convert["preset"] == "deepseek-v3":
                assert line.env == {"SGLANG_SHARED_EXPERT_TP1": "1"}  # else SGLang splits the shared expert
        # Whole shard groups of N consecutive DP ranks, none spanning a node.
        assert dp % n == 0 and per_node % n == 0 and dp % per_node == 0, (recipe.id, dp, per_node, n)
        assert dp // per_node == max(len(nodes), 1)
    if len(nodes) > 1:
        first = served[0].argv
        for line in served[1:]:
            extra = [a for a in line.argv if a not in first]
            if line.program == "vllm":  # node k: node 0's line, headless, its first DP rank
                local = int(line.option("--data-parallel-size-local"))
                assert line.argv[:len(first)] == first, recipe.id
                assert line.argv[len(first):] == ["--headless", "--data-parallel-start-rank", str(line.node * local)]
            else:  # node k: node 0's line with --node-rank k
                assert line.option("--node-rank") == str(line.node) and extra == [str(line.node)], extra


def test_each_servers_stage_checks_every_recipe_of_its_server():
    for server, test in SERVER_TESTS.items():
        text = test.read_text()
        ids = [k for k, r in SERVED.items() if r.server == server]
        assert ids, server
        missing = [k for k in ids if f'"{k}"' not in text]
        assert not missing, (server, missing)


def test_a_recipe_that_breaks_the_rules_is_caught(tmp_path):
    """The checks above can fail: a served path other than convert's, and N not dividing a node's DP ranks."""
    good = next(r for r in RECIPES.values() if r.id == "deepseek-v3-vllm-one-node")
    page = tmp_path / "recipes.md"
    body = PAGE.read_text().split("### DeepSeek-V3 (block FP8) in vLLM: one node", 1)[1].split("\n### ", 1)[0]
    page.write_text("## vLLM\n\n### Broken" + body.replace("vllm serve DeepSeek-V3-n8", "vllm serve elsewhere")
                    .replace("--data-parallel-size 8", "--data-parallel-size 12"))
    broken = next(iter(read_recipes(page).values()))
    assert broken.id == good.id
    with pytest.raises(AssertionError):
        test_a_recipes_commands_serve_what_it_converts_in_node_local_groups(broken)
