"""Draft models from their own checkpoints, as published (tests/support/checkpoints.py: make_dflash_checkpoint,
make_eagle3_checkpoint), paired to the tiny `qwen3-moe` target (hidden 64, vocabulary 128, 3 layers):

- convert recognises them from config.json (their presets, every layer), takes EAGLE-3's unnumbered `midlayer` as
  layer 0, shards each layer's projections with vLLM's fused views, and records the draft's kind and its target's
  facts; what the record says is checked against the checkpoint's tensors and refused when they disagree;
- `target_mismatch` gives the one-line reason a draft cannot serve beside a target, None beside its own;
- validate, inspect, plan (`--draft`), reshard and export work on a draft's output;
- the schema refuses a bad draft record, and manifests without a draft or with an MTP draft keep their bytes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from support.checkpoints import read_state_dict
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import ManifestError, SelectionError, ShardprepError, SourceError
from shardprep.manifests.draft_layers import DraftLayers, DraftTarget, target_mismatch
from shardprep.manifests.manifest import MANIFEST_NAME, Manifest, load_manifest
from shardprep.manifests.replicated import SHARDED_SENTINEL
from shardprep.planning.accounting import draft_account, draft_saving
from shardprep.prep.convert import convert
from shardprep.prep.deployment_plan import PlanRequest, plan_sharding
from shardprep.prep.export import export
from shardprep.prep.inspect import inspect
from shardprep.prep.reshard import reshard
from shardprep.prep.selection import Selection, load_preset, parse_layers, select_targets
from shardprep.prep.validate import validate
from shardprep.prep.validate_manifest import validate_manifest

PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
VIEWS = {"self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
         "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}
TARGET = {"hidden_size": 64, "vocab_size": 128, "aux_layers": [0, 1, 2]}  # the tiny qwen3-moe target's, 3 layers


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def target_src(checkpoint_cache):
    return checkpoint_cache("qwen3-moe")


@pytest.fixture(scope="module")
def dflash_src(checkpoint_cache):
    return checkpoint_cache("dflash", layers=2)


@pytest.fixture(scope="module")
def eagle3_src(checkpoint_cache):
    return checkpoint_cache("eagle3", layers=1)


@pytest.fixture(scope="module")
def outs(dflash_src, eagle3_src, target_src, conversion_cache):
    """Each draft converted for N = 2 without --preset or --layers, and the target with its preset."""
    return {"dflash": conversion_cache(dflash_src, 2), "eagle3": conversion_cache(eagle3_src, 2),
            "target": conversion_cache(target_src, 2, preset="qwen3-moe")}


def replicated_names(out) -> set[str]:
    """The tensors OUT's replicated files hold (its index maps the targets to the sentinel plain loaders fail on)."""
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    return {name for name, file in weight_map.items() if file != SHARDED_SENTINEL}


def test_convert_takes_a_dflash_draft_as_published_every_layers_projections_sharded_and_fused(dflash_src, outs,
                                                                                             tmp_path):
    manifest = load_manifest(outs["dflash"])
    assert [r.layer for r in manifest.layers] == [0, 1], "every layer by default: no layer of its own hides layer 0"
    for r in manifest.layers:
        assert sorted(e.name for e in r.entries) == sorted(f"layers.{r.layer}.{p}" for p in PROJECTIONS)
        assert {v.name: list(v.members) for v in r.views} == {
            f"layers.{r.layer}.{view}": [f"layers.{r.layer}.{m}" for m in members] for view, members in VIEWS.items()}
    kept = replicated_names(outs["dflash"])
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
            "layers.1.self_attn.k_norm.weight"} <= kept
    assert not any(name.endswith(PROJECTIONS) for name in kept)
    record = json.loads((outs["dflash"] / MANIFEST_NAME).read_text())
    assert record["draft"] == {"kind": "dflash", "layers": [0, 1], "target": {**TARGET, "num_layers": 3}}
    assert record["selection"]["preset"] == "dflash" and record["selection"]["layers"] == "0-"
    assert "unnumbered_layers" not in record["selection"]
    # Its preset given by name gives the same manifest as the one chosen from config.json.
    convert(dflash_src, tmp_path / "named", 2, preset="dflash")
    assert (tmp_path / "named" / MANIFEST_NAME).read_text() == (outs["dflash"] / MANIFEST_NAME).read_text()
    assert validate(outs["dflash"], dflash_src).ok


def test_convert_takes_eagle3s_unnumbered_midlayer_as_layer_0_under_its_checkpoint_names(eagle3_src, outs, tmp_path):
    manifest = load_manifest(outs["eagle3"])
    (layer,) = manifest.layers
    assert layer.layer == 0
    assert sorted(e.name for e in layer.entries) == sorted(f"midlayer.{p}" for p in PROJECTIONS)
    assert {v.name: list(v.members) for v in layer.views} == {
        f"midlayer.{view}": [f"midlayer.{m}" for m in members] for view, members in VIEWS.items()}
    q = next(e for e in layer.entries if e.name == "midlayer.self_attn.q_proj.weight")
    assert q.shape == (128, 128), "EAGLE-3's q/k/v read the embedding and the hidden state: 2·hidden"
    assert replicated_names(outs["eagle3"]) >= {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                                "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                                                "midlayer.post_attention_layernorm.weight"}
    record = json.loads((outs["eagle3"] / MANIFEST_NAME).read_text())
    assert record["draft"] == {"kind": "eagle3", "layers": [0], "target": TARGET}, "no num_layers: EAGLE-3 says none"
    assert record["selection"]["unnumbered_layers"] == {"midlayer": 0}
    assert validate(outs["eagle3"], eagle3_src).ok
    # `validate --manifest-only --source` applies the recorded selection to the source's names: with its map.
    report = validate_manifest(outs["eagle3"], source=eagle3_src)
    assert report.ok, report.messages
    assert report.checked["targets_checked_against_source"] == 7
    assert [w.code for w in report.warnings] == ["bytes_not_checked"], "its fused groups were checked too"
    # Its preset given by name gives the same manifest as the one chosen from config.json.
    convert(eagle3_src, tmp_path / "named", 2, preset="eagle3")
    assert (tmp_path / "named" / MANIFEST_NAME).read_text() == (outs["eagle3"] / MANIFEST_NAME).read_text()


def test_an_unnumbered_layer_is_a_layer_only_where_a_preset_names_it(tmp_path):
    names = ["midlayer.self_attn.q_proj.weight", "midlayer.mlp.up_proj.weight", "fc.weight"]
    with pytest.raises(SelectionError, match="'midlayer.mlp.up_proj.weight' is not inside a layer"):
        select_targets(names, Selection(targets=("midlayer.*",), layers=parse_layers("all")))
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"targets": ["*.q_proj.weight", "*.up_proj.weight"],
                                  "unnumbered_layers": {"midlayer": 5}}))
    mine = load_preset(str(preset))
    plan = select_targets(names, Selection(preset=mine, layers=parse_layers("all"),
                                           unnumbered_layers=mine.unnumbered_layers))
    assert plan.layers == {5: ["midlayer.mlp.up_proj.weight", "midlayer.self_attn.q_proj.weight"]}
    clash = [*names, "model.layers.5.self_attn.q_proj.weight"]
    with pytest.raises(SelectionError, match="would both be layer 5"):
        select_targets(clash, Selection(preset=mine, layers=parse_layers("all"),
                                        unnumbered_layers=mine.unnumbered_layers))
    preset.write_text(json.dumps({"targets": ["*.q_proj.weight"], "unnumbered_layers": {"midlayer": "0"}}))
    with pytest.raises(SelectionError, match="'unnumbered_layers' must map names"):
        load_preset(str(preset))


def test_convert_names_the_drafts_preset_when_another_matches_nothing(eagle3_src, tmp_path):
    result = invoke("convert", eagle3_src, tmp_path / "out", "-n", 2, "--preset", "llama")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "config.json's architectures is LlamaForCausalLMEagle3, an EAGLE-3 draft: use --preset eagle3" in \
        result.output
    assert not (tmp_path / "out").exists()


def test_dry_run_says_which_preset_it_chose_and_the_drafts_target_and_saving(dflash_src, tmp_path):
    text = invoke("convert", dflash_src, tmp_path / "dry", "-n", 2, "--dry-run").output
    assert "preset dflash: " in text and "(no --preset given); every layer sharded" in text
    assert ("draft (a DFlash draft model, layers 0, 1; its target: hidden size 64, vocabulary 128, 3 layers, reads "
            "layers 0, 1, 2): Σ|T|") in text
    assert "layer 0: 7 targets, fused layers.0.self_attn.qkv_proj.weight, layers.0.mlp.gate_up_proj.weight" in text


def config_of(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def bad_copy(src, tmp_path, **changes):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = config_of(bad)
    config.update(changes)
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize("arch,changes,why", [
    ("dflash", {"dflash_config": {"target_layer_ids": "0,1"}},
     "dflash_config.target_layer_ids must be a non-empty list of target layer numbers"),
    ("dflash", {"num_target_layers": 0}, "num_target_layers must be a positive integer"),
    ("dflash", {"dflash_config": {"target_layer_ids": [0, 2]}},
     "'fc.weight' reads 192 features, but config.json says 2 target layers of hidden size 64 \\(128\\)"),
    ("eagle3", {"vocab_size": 100}, "'t2d' has 128 entries, one per target token, but config.json's vocab_size is 100"),
])
def test_a_draft_whose_config_contradicts_its_tensors_is_refused_in_one_line(arch, changes, why, checkpoint_cache,
                                                                             tmp_path):
    src = bad_copy(checkpoint_cache(arch, layers=2 if arch == "dflash" else 1), tmp_path, **changes)
    with pytest.raises(SourceError, match=why) as raised:
        convert(src, tmp_path / "out", 2)
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()


def target_config(target_src, **changes) -> dict:
    return {**config_of(target_src), **changes}


@pytest.mark.parametrize("changes,why", [
    ({"hidden_size": 96}, "the DFlash draft reads hidden states of size 64, this target's are 96 (config.json "
                          "hidden_size)"),
    ({"vocab_size": 256}, "the DFlash draft was trained for a vocabulary of 128 tokens (it runs the target's embedding "
                          "and LM head), this target has 256 (config.json vocab_size)"),
    ({"num_hidden_layers": 4}, "the DFlash draft was trained for a target of 3 layers (num_target_layers), this target "
                               "has 4 (num_hidden_layers)"),
])
def test_target_mismatch_gives_the_one_line_reason_a_dflash_draft_cannot_serve_beside_a_target(outs, target_src,
                                                                                              changes, why):
    draft = load_manifest(outs["dflash"]).draft
    assert target_mismatch(draft, target_config(target_src)) is None, "beside the target it was made for"
    assert target_mismatch(draft, target_config(target_src, **changes)) == why
    # A multimodal target (Kimi K2.5, K3) says it in its text_config.
    assert target_mismatch(draft, {"architectures": ["X"], "text_config": target_config(target_src)}) is None
    assert target_mismatch(draft, {"text_config": target_config(target_src, **changes)}) == why


def test_target_mismatch_checks_each_layer_a_draft_reads_in_its_own_meaning(outs, target_src):
    eagle3 = load_manifest(outs["eagle3"]).draft
    assert target_mismatch(eagle3, target_config(target_src)) is None
    assert target_mismatch(eagle3, target_config(target_src, vocab_size=129)) == (
        "the EAGLE-3 draft was trained for a vocabulary of 128 tokens (its d2t maps its tokens into the target's), "
        "this target has 129 (config.json vocab_size)")
    # EAGLE-3's id i is the hidden state entering layer i: i = L, the last layer's output, exists; L + 1 does not.
    reads = replace(eagle3, target=replace(eagle3.target, aux_layers=(0, 3)))
    assert target_mismatch(reads, target_config(target_src)) is None
    assert target_mismatch(replace(eagle3, target=replace(eagle3.target, aux_layers=(0, 4))),
                           target_config(target_src)) == (
        "the EAGLE-3 draft reads the hidden state entering target layer 4 (eagle_aux_hidden_state_layer_ids), but "
        "this target has 3 layers (num_hidden_layers)")
    # DFlash's id i is layer i's output: i = L does not exist.
    dflash = DraftLayers("dflash", (0, 1), DraftTarget(64, 128, (0, 3)))
    assert target_mismatch(dflash, target_config(target_src)) == (
        "the DFlash draft reads the output of target layer 3 (dflash_config.target_layer_ids), but this target has 3 "
        "layers (num_hidden_layers)")
    assert target_mismatch(DraftLayers("mtp", (3,)), target_config(target_src, hidden_size=1)) is None


def test_a_served_draft_is_checked_against_its_config_and_an_unrecorded_one_is_found_there(outs):
    manifest, config = load_manifest(outs["dflash"]), config_of(outs["dflash"])
    assert manifest.with_serving_draft(config).draft == manifest.draft
    # An output converted before draft models were recorded: its config.json says what it is.
    assert replace(manifest, draft=None).with_serving_draft(config).draft == manifest.draft
    with pytest.raises(ManifestError, match="says other target facts"):
        manifest.with_serving_draft({**config, "vocab_size": 256})


def test_validate_and_inspect_show_the_drafts_kind_its_target_and_its_saving(outs):
    assert validate(outs["eagle3"]).ok
    info = inspect(outs["dflash"])
    manifest = load_manifest(outs["dflash"])
    assert [r["model"] for r in info["layers"]] == ["draft", "draft"]
    draft = info["draft"]
    assert draft["kind"] == "dflash" and draft["target"] == {**TARGET, "num_layers": 3}
    assert draft["sharded_bytes"] == sum(r.total_bytes for r in manifest.layers)
    # Beside a target whose slots hold its largest layer it adds its chunks alone; in slots of its own, the slots too.
    assert draft["resident_bytes"] == sum(r.chunk_bytes for r in manifest.layers)
    assert draft["saved_bytes"] == draft["sharded_bytes"] - draft["resident_bytes"]
    assert draft["target_saved_bytes"] is None
    assert draft["own_slots_saved_bytes"] == info["totals"]["saved_bytes"] < draft["saved_bytes"]
    text = invoke("inspect", outs["eagle3"]).output
    assert "draft (an EAGLE-3 draft model, layer 0; its target: hidden size 64, vocabulary 128, reads layers 0, 1, 2)" \
        in text and "no memory saved" not in text


def test_draft_account_beside_its_target_counts_what_the_draft_adds_to_the_targets_slots(outs):
    draft, target = load_manifest(outs["dflash"]), load_manifest(outs["target"])
    beside = draft_account(draft, target=target)
    expected = draft_saving([r.total_bytes for r in target.layers], 16, [r.total_bytes for r in draft.layers], 16, 2)
    assert {k: beside[k] for k in expected} == expected
    # The draft's layers are larger than the target's: it adds its chunks and the slots' growth.
    growth = 2 * 2 * (max(r.chunk_bytes for r in draft.layers) - max(r.chunk_bytes for r in target.layers))
    assert beside["resident_bytes"] == sum(r.chunk_bytes for r in draft.layers) + growth
    one = replace(target, world_size=1)
    with pytest.raises(ShardprepError, match="converted for 2 ranks and its target for 1"):
        draft_account(draft, target=one)


def test_plan_with_a_draft_counts_the_targets_and_the_drafts_savings_apart_and_together(outs, target_src, dflash_src):
    request = PlanRequest(str(target_src), ranks=2, preset="qwen3-moe", draft=str(outs["dflash"]))
    report = plan_sharding(request)
    shown = report.every_layer
    draft, manifest = report.draft, load_manifest(outs["dflash"])
    assert draft["kind"] == "dflash" and draft["layers"] == [0, 1]
    assert draft["target_saved_bytes"] == shown.memory.saved_bytes
    assert draft["sharded_bytes"] == sum(r.total_bytes for r in manifest.layers)
    assert draft["together_saved_bytes"] == draft["saved_bytes"] + shown.memory.saved_bytes
    assert report.to_dict()["draft"] == draft
    # From the draft's checkpoint, laid out as convert would: the same figures.
    assert plan_sharding(replace(request, draft=str(dflash_src))).draft == draft
    text = invoke("plan", target_src, "-n", 2, "--preset", "qwen3-moe", "--draft", outs["eagle3"]).output
    assert "draft (an EAGLE-3 draft model, layer 0; its target: hidden size 64, vocabulary 128, reads layers 0, 1, 2)" \
        in text and "together" in text


def test_plan_refuses_a_draft_beside_the_wrong_target_and_a_draft_alone(outs, checkpoint_cache, dflash_src):
    four = checkpoint_cache("qwen3-moe", layers=4)
    result = invoke("plan", four, "-n", 2, "--preset", "qwen3-moe", "--draft", dflash_src)
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: --draft {dflash_src} cannot serve beside {four}: the DFlash draft was trained for a target of 3 "
        "layers (num_target_layers), this target has 4 (num_hidden_layers)")
    result = invoke("plan", four, "-n", 2, "--preset", "qwen3-moe", "--draft", outs["target"])
    assert result.exit_code == 2 and "not a DFlash or EAGLE-3 draft model" in result.output
    result = invoke("plan", outs["dflash"], "-n", 2)
    assert result.exit_code == 2 and f"plan its target with --draft {outs['dflash']}" in result.output


def test_reshard_keeps_the_draft_record_and_export_gives_the_drafts_checkpoint_back(outs, eagle3_src, tmp_path):
    reshard(outs["eagle3"], tmp_path / "n1", 1)
    convert(eagle3_src, tmp_path / "c1", 1)
    assert load_manifest(tmp_path / "n1").draft == load_manifest(outs["eagle3"]).draft
    assert replace(load_manifest(tmp_path / "n1"), resharded_from=None).to_json() == \
        load_manifest(tmp_path / "c1").to_json(), "byte-identical to a convert for N = 1, apart from resharded_from"
    assert validate(tmp_path / "n1").ok
    export(outs["eagle3"], tmp_path / "plain")
    source, exported = read_state_dict(eagle3_src), read_state_dict(tmp_path / "plain")
    assert sorted(exported) == sorted(source) and "midlayer.self_attn.q_proj.weight" in exported
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name].view(torch.uint8),
                                                                     tensor.view(torch.uint8)), name


def manifest_data(out) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


@pytest.mark.parametrize("edit,why", [
    (lambda d: d["draft"].pop("target"), "schema violation at draft: 'target' is a required property"),
    (lambda d: d["draft"].update(kind="medusa"), "schema violation at draft/kind"),
    (lambda d: d["draft"]["target"].pop("vocab_size"), "'vocab_size' is a required property"),
    (lambda d: d["draft"]["target"].update(aux_layers=[-1]), "schema violation at draft/target/aux_layers/0"),
    (lambda d: d["draft"]["target"].update(hidden_size=True), "schema violation at draft/target/hidden_size"),
    (lambda d: d["draft"].update(kind="mtp"), "schema violation at draft/target"),
    (lambda d: d["draft"].update(layers=[1]), "a dflash draft's layers must be every layer of the manifest, in order "
                                              "\\(1, not 0, 1\\)"),
])
def test_the_schema_and_the_invariants_refuse_a_bad_draft_record(outs, edit, why):
    data = manifest_data(outs["dflash"])
    Manifest.from_dict(data)  # as written: valid
    edit(data)
    with pytest.raises(ManifestError, match=why):
        Manifest.from_dict(data)


def test_manifests_without_a_draft_and_with_an_mtp_draft_keep_their_bytes(outs, checkpoint_cache, tmp_path):
    convert(checkpoint_cache("deepseek-v3-mtp"), tmp_path / "mtp", 2, preset="deepseek-v3")
    for out in (outs["target"], tmp_path / "mtp"):
        text = (out / MANIFEST_NAME).read_text()
        assert load_manifest(out).to_json() == text
    assert "draft" not in manifest_data(outs["target"])
    assert manifest_data(tmp_path / "mtp")["draft"] == {"kind": "mtp", "layers": [3]}
    assert "unnumbered_layers" not in manifest_data(tmp_path / "mtp")["selection"]


def test_a_quantized_draft_model_is_refused_naming_the_module_and_the_way_on():
    from support.fake_server import FakeServer

    from shardprep.integrations.drafts import refuse_quantized_draft_model

    class Quantizing(FakeServer):  # the server built the draft's o_proj with a quantized method
        def is_quantized(self, module):
            return getattr(module, "quantized", False)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].quantized = True
    draft = DraftLayers("dflash", (0, 1), DraftTarget(64, 128))
    refuse_quantized_draft_model(Quantizing(), model, {id(model[0].weight)}, "d/", draft, True)  # a plain one passes
    with pytest.raises(ShardprepError) as e:
        refuse_quantized_draft_model(Quantizing(), model, {id(model[1].weight)}, "d/", draft, True)
    assert str(e.value) == (
        "d/: the DFlash draft model (layers 0, 1) is quantized (1) and sharded beside a target processed at load, "
        "which is not supported (a draft model is sharded unquantized only); serve the draft apart "
        "(draft_load_config with the server's own load format) or convert an unquantized draft")
    with pytest.raises(ShardprepError, match="sharded beside an unquantized target"):
        refuse_quantized_draft_model(Quantizing(), model, {id(model[1].weight)}, "d/", draft, False)
