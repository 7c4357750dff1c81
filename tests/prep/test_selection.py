"""Target selection: globs, presets, layer ranges and the layer-index pattern."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardprep.errors import SelectionError
from shardprep.manifests.layout import FusedGroup
from shardprep.prep.selection import (
    FusedRule,
    Preset,
    Selection,
    builtin_presets,
    format_layers,
    load_preset,
    parse_layers,
    select_targets,
)

NAMES = [
    "model.embed_tokens.weight",
    *(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(3) for p in "qkvo"),
    *(f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)),
    "lm_head.weight",
]


def test_default_layer_range_skips_layer_zero():
    plan = select_targets(NAMES, Selection(preset=load_preset("llama")))
    assert list(plan.layers) == [1, 2]
    assert plan.layers[1] == sorted(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo")


def test_preset_fuses_qkv_per_layer():
    plan = select_targets(NAMES, Selection(preset=load_preset("llama"), layers=parse_layers("all")))
    (group,) = plan.groups[0]
    assert group.name == "model.layers.0.self_attn.qkv_proj.weight"
    assert group.members == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")


def test_glob_matching_nothing_is_an_error_naming_the_glob():
    with pytest.raises(SelectionError, match=r"--target '\*.nope.\*' matches no tensor"):
        select_targets(NAMES, Selection(targets=("*.nope.*",)))


def test_target_outside_any_layer_is_an_error():
    with pytest.raises(SelectionError, match="'lm_head.weight' is not inside a layer"):
        select_targets(NAMES, Selection(targets=("lm_head.weight",)))


def test_selection_outside_layer_range_is_an_error():
    with pytest.raises(SelectionError, match="matches no tensor in layers 5-"):
        select_targets(NAMES, Selection(targets=("*.mlp.*",), layers=parse_layers("5-")))


def test_custom_layer_pattern():
    names = ["enc.stage7.w", "enc.stage8.w"]
    plan = select_targets(names, Selection(targets=("enc.*",), layer_pattern=r"stage(\d+)\.",
                                           layers=parse_layers("8")))
    assert plan.layers == {8: ["enc.stage8.w"]}


@pytest.mark.parametrize("text,selected", [
    ("1-", [1, 2, 3, 4, 5, 6, 7, 8, 9]), ("2-4", [2, 3, 4]), ("-3", [0, 1, 2, 3]), ("5", [5]), ("all", list(range(10))),
    ("1,3,5-7", [1, 3, 5, 6, 7]), ("1-:2", [1, 3, 5, 7, 9]), ("0-6:3", [0, 3, 6]), ("-4:2,9", [0, 2, 4, 9]),
    (" 1 , 8- ", [1, 8, 9]),
])
def test_layers_parse_lists_ranges_and_strides(text, selected):
    assert parse_layers(text).resolve(range(10)) == selected


@pytest.mark.parametrize("bad,why", [("x", "not a layer N"), ("4-2", "before start"), ("1-2-3", "not a layer N"),
                                     ("1,,3", "not a layer N"), ("5:2", "stride needs a range"),
                                     ("1-:0", "stride must be >= 1")])
def test_bad_layers_are_refused_naming_the_item(bad, why):
    with pytest.raises(SelectionError, match=why):
        parse_layers(bad)


@given(st.sets(st.integers(0, 80), min_size=1), st.integers(81, 90))
def test_formatted_layers_parse_back_to_the_same_set(layers, num_layers):
    text = format_layers(layers, num_layers=num_layers)
    assert parse_layers(text).resolve(range(num_layers)) == sorted(layers)
    assert parse_layers(format_layers(layers)).resolve(range(num_layers)) == sorted(layers)


def test_format_folds_runs_and_strides():
    assert format_layers([1, 3, 5, 7], num_layers=8) == "1-:2"
    assert format_layers(range(8), num_layers=8) == "all"
    assert format_layers([1, 3, 5, 6, 7, 8]) == "1-5:2,6-8"
    assert format_layers([2, 9]) == "2,9"


def test_strided_selection_shards_every_other_layer():
    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(6)]
    plan = select_targets(names, Selection(targets=("*.q_proj.weight",), layers=parse_layers("1-:2")))
    assert list(plan.layers) == [1, 3, 5]


def test_builtin_presets_and_user_preset_file(tmp_path):
    assert {"llama", "qwen3-moe", "deepseek-v3"} <= set(builtin_presets())
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"targets": ["*.mlp.up_proj.weight"]}))
    plan = select_targets(NAMES, Selection(preset=load_preset(str(path))))
    assert plan.names == {"model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"}


def test_unknown_preset_is_refused():
    with pytest.raises(SelectionError, match="neither a built-in preset"):
        load_preset("no-such-preset")


def test_the_first_fused_rule_that_takes_a_tensor_wins_over_a_narrower_variant():
    # A server's wide variant (q_a, kv_a and the gate) listed before its narrow one (q_a and kv_a): a layer with all
    # three gets the wide view only, a layer without the gate the narrow one, and no tensor is in two views.
    wide = FusedRule("attn.qkv_g.weight", ("attn.q.weight", "attn.kv.weight", "attn.g.weight"))
    narrow = FusedRule("attn.qkv.weight", ("attn.q.weight", "attn.kv.weight"), row_multiple=16)
    preset = Preset("variants", ("*.attn.*.weight",), (wide, narrow))
    names = ["m.layers.1.attn.q.weight", "m.layers.1.attn.kv.weight", "m.layers.1.attn.g.weight",
             "m.layers.2.attn.q.weight", "m.layers.2.attn.kv.weight"]
    groups = select_targets(names, Selection(preset=preset)).groups
    assert groups[1] == [FusedGroup("m.layers.1.attn.qkv_g.weight", tuple(names[:3]))]
    assert groups[2] == [FusedGroup("m.layers.2.attn.qkv.weight", tuple(names[3:]), row_multiple=16)]
