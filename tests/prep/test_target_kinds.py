"""inspect and plan split each layer's targets by kind (KDA, MLA, MoE periphery), so that a hybrid model's
per-GPU saving can be held against a design note's per-kind accounting. On transformers' Kimi-Linear (KDA in
layers 1 and 3, MLA in layer 2, MoE with a shared expert after layer 0) with the `kimi-linear` preset."""

import json

import pytest
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import load_manifest
from shardprep.prep.inspect import inspect
from shardprep.prep.target_kinds import layer_target_kinds


@pytest.fixture(scope="module")
def kimi_linear(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("kimi-linear", layers=4)
    return src, conversion_cache(src, 2, preset="kimi-linear")


def expected_kinds(out):
    """Per layer, the entries' bytes summed by hand: attention by the layer's kind, the shared experts as MoE."""
    kinds = {}
    for r in load_manifest(out).layers:
        attention = "MLA" if r.layer % 4 == 2 else "KDA"
        sums = {}
        for e in r.entries:
            kind = attention if ".self_attn." in e.name else "MoE periphery"
            assert ".shared_experts." in e.name or kind == attention, e.name
            sums[kind] = sums.get(kind, 0) + e.nbytes
        kinds[r.layer] = sums
    return kinds


def test_inspect_splits_each_layers_targets_into_kda_mla_and_moe_periphery(kimi_linear):
    _, out = kimi_linear
    info = inspect(out)
    want = expected_kinds(out)
    assert {r["layer"]: r["kinds"] for r in info["layers"]} == want
    assert list(info["kinds"]) == ["KDA", "MLA", "MoE periphery"]
    assert info["kinds"]["KDA"] == {"layers": 2, "bytes": want[1]["KDA"] + want[3]["KDA"],
                                    "max_layer_bytes": max(want[1]["KDA"], want[3]["KDA"])}
    assert info["kinds"]["MLA"]["layers"] == 1 and info["kinds"]["MoE periphery"]["layers"] == 3


def test_plan_splits_the_same_per_layer_from_the_source_and_from_the_output(kimi_linear):
    src, out = kimi_linear
    want = expected_kinds(out)
    for args in ([src, "--preset", "kimi-linear", "--layers", "1-"], [out]):
        result = CliRunner().invoke(app, ["plan", *map(str, args), "--ranks", "2", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert {r["layer"]: r["kinds"] for r in report["layers"] if r["kinds"]} == want
        assert report["kinds"]["MLA"]["bytes"] == want[2]["MLA"]


def test_inspect_and_plan_print_each_layers_split_and_the_totals_by_kind(kimi_linear):
    src, out = kimi_linear
    env = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}
    plan = ["plan", str(src), "--preset", "kimi-linear", "--layers", "1-", "--ranks", "2"]
    for command in (["inspect", str(out)], plan):
        result = CliRunner().invoke(app, command, env=env)
        assert result.exit_code == 0, result.output
        assert "targets by kind" in result.output and "MLA " in result.output
        assert "targets by kind: KDA " in result.output and "in 2 layers (largest " in result.output


def test_a_layer_with_neither_kda_nor_mla_marks_is_plain_attention_and_a_dense_mlp_is_mlp():
    kinds = layer_target_kinds(["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                "model.layers.1.input_layernorm.weight"])
    assert list(kinds.values()) == ["attention", "MLP", "other"]
