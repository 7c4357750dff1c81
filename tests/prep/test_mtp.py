"""A DeepSeek-V3 checkpoint with its MTP layer, as DeepSeek publishes it (tests/support/checkpoints.py,
make_mtp_checkpoint): convert records the MTP layer as a draft's and shards it like a decoder layer, dry-run /
inspect / plan show it apart from the target's layers, and `shardprep run` serves the target alone, the draft's
layers left unread.
Kimi K3 with its MTP layer (`kimi-k3-mtp`): the same record, its layer sharded by the `kimi-k3` preset's decoder
rules, shown apart by dry-run, inspect and plan.
"""

import json
import re

import pytest
import torch
from support.runs import K, shardprep_run, transformers_outputs
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import ManifestError, RuntimeShardError
from shardprep.manifests.draft_layers import DraftLayers
from shardprep.manifests.manifest import MANIFEST_NAME, load_manifest, seal
from shardprep.prep.convert import convert
from shardprep.prep.deployment_plan import PlanRequest, plan_sharding
from shardprep.prep.selection import parse_layers
from shardprep.prep.validate import validate

L = 3  # decoder layers; layer 3 is the MTP layer
MTP_ONLY = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


@pytest.fixture(scope="module")
def mtp_src(checkpoint_cache):
    return checkpoint_cache("deepseek-v3-mtp", layers=L)


@pytest.fixture(scope="module")
def mtp_out(mtp_src, conversion_cache):
    return conversion_cache(mtp_src, 2, preset="deepseek-v3")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def test_convert_records_the_mtp_layer_as_a_drafts_and_shards_it_like_a_decoder_layer(mtp_out):
    manifest = load_manifest(mtp_out)
    assert manifest.draft == DraftLayers("mtp", (L,))
    assert [r.layer for r in manifest.target_records] == [1, 2] and [r.layer for r in manifest.draft_records] == [L]
    assert manifest.layers[-1].layer == L, "the draft's chunk comes last in every rank file"
    names = {e.name.split(f"layers.{L}.", 1)[1] for e in manifest.layer(L).entries}
    decoder = {e.name.split("layers.2.", 1)[1] for e in manifest.layer(2).entries}
    assert names == decoder and not any("kv_b_proj" in n for n in names)
    assert not any(n.startswith(MTP_ONLY) for n in names), "eh_proj, shared_head, norms, embed_tokens stay replicated"
    assert json.loads((mtp_out / MANIFEST_NAME).read_text())["draft"] == {"kind": "mtp", "layers": [L]}
    assert validate(mtp_out).ok


def test_reshard_keeps_the_draft_record(mtp_out, tmp_path):
    from shardprep.prep.reshard import reshard

    reshard(mtp_out, tmp_path / "n1", 1)
    assert load_manifest(tmp_path / "n1").draft == DraftLayers("mtp", (L,))


def test_a_checkpoint_without_mtp_layers_writes_no_draft_key(checkpoint_cache, tmp_path):
    convert(checkpoint_cache("deepseek-v3"), tmp_path / "out", 2, preset="deepseek-v3")
    assert "draft" not in json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert load_manifest(tmp_path / "out").draft is None


def test_dry_run_and_inspect_show_the_drafts_layers_and_saving_apart(mtp_src, mtp_out, tmp_path):
    text = invoke("convert", mtp_src, tmp_path / "dry", "-n", 2, "--preset", "deepseek-v3", "--dry-run").output
    assert f"layer {L} (draft: MTP layer, not the target model's): 7 targets" in text
    assert "layer 2: 7 targets" in text and f"draft (MTP layer {L}): Σ|T|" in text
    info = json.loads(invoke("inspect", mtp_out, "--json").output)
    assert [r["model"] for r in info["layers"]] == ["target", "target", "draft"]
    draft, manifest = info["draft"], load_manifest(mtp_out)
    assert draft["layers"] == [L] and draft["sharded_bytes"] == manifest.layer(L).total_bytes
    # It gathers into the target's slots (no layer is larger): it adds its own chunk, no slot bytes.
    assert draft["resident_bytes"] == manifest.layer(L).chunk_bytes
    assert draft["saved_bytes"] == draft["sharded_bytes"] - draft["resident_bytes"]
    assert draft["target_saved_bytes"] + draft["saved_bytes"] == info["totals"]["saved_bytes"]


def test_plan_never_puts_the_mtp_layer_in_its_layers_argument(checkpoint_cache):
    src = checkpoint_cache("deepseek-v3-mtp", layers=6)  # enough layers for sharding to pay at N = 2
    report = plan_sharding(PlanRequest(str(src), ranks=2, preset="deepseek-v3"))
    assert report.convert_layers is not None
    assert 6 not in parse_layers(report.convert_layers).resolve(range(7)), report.convert_layers
    assert 6 not in report.candidates
    assert any(note.startswith("layer 6: the MTP draft's") for note in report.notes), report.notes


def test_run_serves_the_target_alone_and_n2_equals_n1_and_transformers(mtp_src, mtp_out, tmp_path):
    # N = 1 from a manifest as shardprep wrote it before drafts were recorded: the draft comes from config.json.
    old = tmp_path / "old-n1"
    convert(mtp_src, old, 1, preset="deepseek-v3")
    strip_draft_record(old)
    assert load_manifest(old).draft is None
    prompts = ["hello world", "the model shard", "gpu"]  # uneven: rank 0 serves two, rank 1 one
    args = ["--max-new-tokens", K, *(a for p in prompts for a in ("--prompt", p))]
    n2 = shardprep_run(mtp_out, 2, *args)
    n1 = shardprep_run(old, 1, *args)
    want = transformers_outputs(mtp_src, prompts, causal=True)
    assert [r["token_ids"] for r in n2["prompts"]] == [r["token_ids"] for r in n1["prompts"]]
    assert [r["token_ids"] for r in n2["prompts"]] == [tokens for tokens, _ in want]
    manifest = load_manifest(mtp_out)
    target_end = manifest.target_records[-1].file_offset + manifest.target_records[-1].chunk_bytes
    for rank in n2["ranks"]:  # the rank's buffer ends where the target's last chunk does: nothing of the draft
        assert rank["shard_bytes"] == target_end < manifest.rank_file_bytes
        assert rank["slot_bytes"] == 2 * max(r.total_bytes for r in manifest.target_records)


def strip_draft_record(out):
    """The manifest as shardprep wrote it before drafts were recorded (sealed again)."""
    data = json.loads((out / MANIFEST_NAME).read_text())
    del data["draft"]
    (out / MANIFEST_NAME).write_text(seal(json.dumps(data, indent=1) + "\n"))


def bind_to_transformers_model(out, layers=None):
    import transformers

    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind

    config = transformers.AutoConfig.from_pretrained(out)
    if layers is not None:
        config.num_hidden_layers = layers
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return bind(model, open_rank(out, 0))


def one_line_refusal(out, layers=None):
    with pytest.raises(RuntimeShardError) as exc:
        bind_to_transformers_model(out, layers)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_the_layer_mismatch_refusal_names_each_sides_layers_and_whether_the_extra_are_a_drafts(
        mtp_src, checkpoint_cache, tmp_path, world_of_one):
    old = tmp_path / "old"
    convert(mtp_src, old, 1, preset="deepseek-v3")
    strip_draft_record(old)  # bound without build_model, nothing says layer 3 is a draft's but config.json
    assert one_line_refusal(old).startswith(
        f"the model has layers 0..{L - 1} but the manifest's target layers are 1..{L}: layer {L} is a draft's "
        "(config.json's MTP layer, num_nextn_predict_layers) that the manifest does not mark as one")
    plain = tmp_path / "plain"
    convert(checkpoint_cache("deepseek-v3", layers=4), plain, 1, preset="deepseek-v3")
    assert one_line_refusal(plain, layers=3) == (
        "the model has layers 0..2 but the manifest's target layers are 1..3: layer 3 is neither the model's nor a "
        "draft's; was DIR converted from this model?")


def test_a_draft_record_that_disagrees_with_the_config_is_refused(mtp_out, tmp_path):
    import shutil

    from shardprep.standalone.hf_model import build_model

    bad = tmp_path / "bad"
    shutil.copytree(mtp_out, bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0  # the config of the target alone, with the MTP layer still marked
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ManifestError, match=re.escape(f"the manifest marks the MTP draft layer {L} but config.json")):
        build_model(bad)


def test_manifest_refuses_a_draft_layer_before_a_target_layer(mtp_out):
    from shardprep.manifests.manifest import Manifest

    data = json.loads((mtp_out / MANIFEST_NAME).read_text())
    data["draft"]["layers"] = [2]
    with pytest.raises(ManifestError, match="draft layer 2 comes before target layer 3"):
        Manifest.from_dict(data)
    data["draft"]["layers"] = [7]
    with pytest.raises(ManifestError, match="draft layer 7 is not a layer of the manifest"):
        Manifest.from_dict(data)


def test_a_draft_layer_is_gathered_once_per_target_forward_and_held_through_every_draft_pass(
        mtp_src, tmp_path, world_of_one):
    import transformers
    from support.checkpoints import read_state_dict
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind, bind_draft

    out = tmp_path / "n1"
    convert(mtp_src, out, 1, preset="deepseek-v3")
    config = transformers.AutoConfig.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    binding = bind(model, open_rank(out, 0, draft=True))  # the gatherer's layers: the target's, then the draft's
    assert [layer.index for layer in binding.layers] == [1, 2] and binding.gatherer.layers == (1, 2, L)
    block = DeepseekV3DecoderLayer(config, layer_idx=L).to(torch.bfloat16).eval()  # the MTP layer's decoder block
    (draft,) = bind_draft(binding, {L: block})
    source = read_state_dict(mtp_src)
    name = f"model.layers.{L}.self_attn.o_proj.weight"
    ids = torch.tensor([[5, 6, 7]])
    hidden = torch.randn(1, 3, config.hidden_size, dtype=torch.bfloat16)
    rotary = model.model.rotary_emb(hidden, torch.arange(3)[None])
    gatherer = binding.gatherer
    with torch.inference_mode():
        for step in range(2):
            model(ids)  # the target's forward; its last layer dispatched the draft's gather
            assert gatherer.gathers_issued == 3 * (step + 1)
            for _ in range(3):  # three draft passes on the weights of one gather
                block(hidden, position_embeddings=rotary, attention_mask=None)
                assert torch.equal(block.self_attn.o_proj.weight, source[name])
            assert gatherer.gathers_issued == 3 * (step + 1)
        binding.idle_step()  # an idle rank: the same gathers, the draft's included
        assert gatherer.gathers_issued == 9
    assert binding.draft_parameters[name] is block.self_attn.o_proj.weight and draft.index == L


K3_L = 4  # Kimi K3's decoder layers 0..3; layer 4 is its MTP layer (tests/support/checkpoints.py, kimi-k3-mtp)


@pytest.fixture(scope="module")
def k3_mtp(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("kimi-k3-mtp", layers=K3_L)
    return src, conversion_cache(src, 2, preset="kimi-k3")


def test_kimi_k3s_mtp_layer_is_recorded_as_a_drafts_and_sharded_like_its_mla_moe_decoder_layer(k3_mtp):
    _, out = k3_mtp
    manifest = load_manifest(out)
    assert manifest.draft == DraftLayers("mtp", (K3_L,))
    assert [r.layer for r in manifest.target_records] == [1, 2, 3] and manifest.layers[-1].layer == K3_L
    names = {e.name.split(f"layers.{K3_L}.", 1)[1] for e in manifest.layer(K3_L).entries}
    decoder = {e.name.split("layers.2.", 1)[1] for e in manifest.layer(2).entries}  # layer 2: MLA + MoE
    assert names == decoder and not any("kv_b_proj" in n for n in names)
    assert not any(n.startswith(MTP_ONLY) for n in names), "eh_proj, shared_head, norms, embed_tokens stay replicated"
    views = {v.name.split(f"layers.{K3_L}.", 1)[1] for v in manifest.layer(K3_L).views}
    # vLLM's fused_qkv_a_g_proj, and SGLang's fused_qkv_a_proj (q_a, kv_a) over the same bytes, a run of its members.
    assert views == {"self_attn.fused_qkv_a_g_proj.weight", "self_attn.fused_qkv_a_proj.weight",
                     "block_sparse_moe.shared_experts.gate_up_proj.weight"}
    assert validate(out).ok


def test_kimi_k3s_mtp_layer_shows_apart_in_dry_run_inspect_and_plan(k3_mtp, tmp_path):
    src, out = k3_mtp
    text = invoke("convert", src, tmp_path / "dry", "-n", 2, "--preset", "kimi-k3", "--dry-run").output
    assert f"layer {K3_L} (draft: MTP layer, not the target model's): 10 targets" in text
    assert f"draft (MTP layer {K3_L}): Σ|T|" in text
    info = json.loads(invoke("inspect", out, "--json").output)
    assert [r["model"] for r in info["layers"]] == ["target"] * 3 + ["draft"]
    assert info["draft"]["layers"] == [K3_L]
    assert info["draft"]["sharded_bytes"] == load_manifest(out).layer(K3_L).total_bytes
    report = plan_sharding(PlanRequest(str(src), ranks=2, preset="kimi-k3"))
    assert K3_L not in report.candidates
    assert any(note.startswith(f"layer {K3_L}: the MTP draft's") for note in report.notes), report.notes
