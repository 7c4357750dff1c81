"""Target selection: globs, presets, layer ranges and the layer-index pattern."""

import json

import pytest

from shardprep.errors import SelectionError
from shardprep.prep.selection import Selection, builtin_presets, load_preset, parse_layer_range, select_targets

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
    plan = select_targets(NAMES, Selection(preset=load_preset("llama"), layers=parse_layer_range("all")))
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
        select_targets(NAMES, Selection(targets=("*.mlp.*",), layers=parse_layer_range("5-")))


def test_custom_layer_pattern():
    names = ["enc.stage7.w", "enc.stage8.w"]
    plan = select_targets(names, Selection(targets=("enc.*",), layer_pattern=r"stage(\d+)\.",
                                           layers=parse_layer_range("8")))
    assert plan.layers == {8: ["enc.stage8.w"]}


@pytest.mark.parametrize("text,start,stop", [("1-", 1, None), ("2-4", 2, 4), ("-3", 0, 3), ("5", 5, 5),
                                             ("all", 0, None)])
def test_layer_range_parsing(text, start, stop):
    r = parse_layer_range(text)
    assert (r.start, r.stop) == (start, stop)


@pytest.mark.parametrize("bad", ["x", "4-2", "1-2-3"])
def test_bad_layer_range_is_refused(bad):
    with pytest.raises(SelectionError):
        parse_layer_range(bad)


def test_builtin_presets_and_user_preset_file(tmp_path):
    assert {"llama", "qwen3-moe", "deepseek-v3"} <= set(builtin_presets())
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"targets": ["*.mlp.up_proj.weight"]}))
    plan = select_targets(NAMES, Selection(preset=load_preset(str(path))))
    assert plan.names == {"model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight"}


def test_unknown_preset_is_refused():
    with pytest.raises(SelectionError, match="neither a built-in preset"):
        load_preset("no-such-preset")
