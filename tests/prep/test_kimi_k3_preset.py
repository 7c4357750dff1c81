"""The `kimi-k3` preset on the tiny Kimi K3 checkpoint (tests/support/checkpoints.py: KDA in layers 0, 1, 3, MLA with
q-LoRA and the output gate in layer 2, latent MoE after the dense layer 0): the fused views are vLLM's parameters,
byte for byte (in_proj_qkvgfab with its 14 zero pad rows), and SGLang's lie inside them over the same bytes
(fused_qkvg_proj in in_proj_qkvgfab, fused_qkv_a_proj in fused_qkv_a_g_proj), kv_b_proj stays replicated, the pad
rows are checked, and inspect splits each layer by kind. That the views bind to the servers' own parameters is
shown by tests/vllm_engines/test_vllm_kimi_k3.py and tests/sglang_engines/test_sglang_kimi_k3.py; here, that the
layout is the one they need."""

import json

import pytest
import torch
from support.checkpoints import kimi_k3_tensors, kimi_k3_values, read_state_dict
from support.reconstruct import rebuild_layers

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.inspect import inspect
from shardprep.prep.reshard import reshard
from shardprep.prep.selection import Selection, load_preset, select_targets
from shardprep.prep.validate import validate

KDA_MEMBERS = [f"self_attn.{p}_proj.weight" for p in ("q", "k", "v", "g", "f_a", "b")]
MLA_MEMBERS = [f"self_attn.{p}.weight" for p in ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")]
GATE_UP = [f"block_sparse_moe.shared_experts.{p}_proj.weight" for p in ("gate", "up")]
PERIPHERY = {*GATE_UP, "block_sparse_moe.shared_experts.down_proj.weight",
             "block_sparse_moe.routed_expert_down_proj.weight", "block_sparse_moe.routed_expert_up_proj.weight"}


@pytest.fixture(scope="module")
def k3(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("kimi-k3", layers=4)
    return src, conversion_cache(src, 2, preset="kimi-k3")


def short(name: str) -> str:
    return name.split(".", 3)[3]


def test_kimi_k3_preset_packs_vllms_fused_parameters_with_in_proj_pad_rows_and_leaves_kv_b_proj_replicated(k3):
    src, out = k3
    original, rebuilt = read_state_dict(src), rebuild_layers(out)
    manifest = load_manifest(out)
    assert [r.layer for r in manifest.layers] == [1, 2, 3]  # layer 0, dense, stays replicated by default
    for r in manifest.layers:
        p = f"model.layers.{r.layer}."
        views = {short(v.name): ([short(m) for m in v.members], v.pad_rows) for v in r.views}
        entries = {short(e.name) for e in r.entries}
        offsets = {short(v.name): v.offset for v in r.views}
        if r.layer == 2:
            assert views == {"self_attn.fused_qkv_a_g_proj.weight": (MLA_MEMBERS, 0),
                             "self_attn.fused_qkv_a_proj.weight": (MLA_MEMBERS[:2], 0),  # SGLang's, inside vLLM's
                             "block_sparse_moe.shared_experts.gate_up_proj.weight": (GATE_UP, 0)}
            assert offsets["self_attn.fused_qkv_a_proj.weight"] == offsets["self_attn.fused_qkv_a_g_proj.weight"]
            assert entries == {*MLA_MEMBERS, "self_attn.q_b_proj.weight", "self_attn.o_proj.weight", *PERIPHERY}
            fused = rebuilt[p + "self_attn.fused_qkv_a_g_proj.weight"]
            assert torch.equal(fused, torch.cat([original[p + m] for m in MLA_MEMBERS]))
            assert torch.equal(rebuilt[p + "self_attn.fused_qkv_a_proj.weight"], fused[:64 + 576])
        else:
            # 4·64 + 32 + 2 = 290 rows, up to 304: vLLM's in_proj_qkvgfab at TP=1
            assert views == {"self_attn.in_proj_qkvgfab.weight": (KDA_MEMBERS, 14),
                             "self_attn.fused_qkvg_proj.weight": (KDA_MEMBERS[:4], 0),  # SGLang's, inside vLLM's
                             "block_sparse_moe.shared_experts.gate_up_proj.weight": (GATE_UP, 0)}
            assert offsets["self_attn.fused_qkvg_proj.weight"] == offsets["self_attn.in_proj_qkvgfab.weight"]
            assert entries == {*KDA_MEMBERS, "self_attn.f_b_proj.weight", "self_attn.o_proj.weight", *PERIPHERY}
            fused = rebuilt[p + "self_attn.in_proj_qkvgfab.weight"]
            assert fused.shape == (304, 64)
            assert torch.equal(fused, torch.cat([*(original[p + m] for m in KDA_MEMBERS),
                                                 torch.zeros(14, 64, dtype=torch.bfloat16)]))
            assert torch.equal(rebuilt[p + "self_attn.fused_qkvg_proj.weight"], fused[:4 * 64])
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.2.self_attn.kv_b_proj.weight"] == "model-00001-of-00001.safetensors"
    assert validate(out, source=src).ok


def test_the_k3_wrappers_names_select_the_same_targets_and_views():
    values = kimi_k3_values(4)
    text = select_targets(kimi_k3_tensors(values), Selection(preset=load_preset("kimi-k3")))
    for prefix in ("language_model.model.", "language_model."):  # vLLM's module names, and what its mapper takes
        wrapped = select_targets(kimi_k3_tensors(values, prefix=prefix), Selection(preset=load_preset("kimi-k3")))
        assert {k: [n.removeprefix(prefix) for n in v] for k, v in wrapped.layers.items()} == {
            k: [n.removeprefix("model.") for n in v] for k, v in text.layers.items()}
        assert {k: [(g.name.removeprefix(prefix), g.row_multiple) for g in v] for k, v in wrapped.groups.items()} == {
            k: [(g.name.removeprefix("model."), g.row_multiple) for g in v] for k, v in text.groups.items()}


def test_sglangs_text_names_select_the_same_targets_and_views_under_mlp():
    # SGLang's text class (KimiK3LinearForCausalLM) has no name mapper: its checkpoint names the MoE `mlp.`.
    values = kimi_k3_values(4)
    text = select_targets(kimi_k3_tensors(values), Selection(preset=load_preset("kimi-k3")))
    sglang = select_targets(kimi_k3_tensors(values, moe="mlp."), Selection(preset=load_preset("kimi-k3")))
    assert {k: [n.replace(".mlp.", ".block_sparse_moe.") for n in v] for k, v in sglang.layers.items()} == text.layers
    assert {k: [(g.name.replace(".mlp.", ".block_sparse_moe."), g.row_multiple) for g in v]
            for k, v in sglang.groups.items()} == {k: [(g.name, g.row_multiple) for g in v]
                                                   for k, v in text.groups.items()}


def test_without_the_output_gate_mla_fuses_q_a_and_kv_a_as_fused_qkv_a_proj():
    names = [n for n in kimi_k3_tensors(kimi_k3_values(4)) if not n.startswith("model.layers.2.self_attn.g_proj")]
    (attention, _) = select_targets(names, Selection(preset=load_preset("kimi-k3"))).groups[2]
    assert (short(attention.name), [short(m) for m in attention.members]) == (
        "self_attn.fused_qkv_a_proj.weight", MLA_MEMBERS[:2])


def test_a_nonzero_byte_in_the_pad_rows_fails_validate_naming_the_layer(k3, tmp_path):
    src, out = k3
    broken = tmp_path / "broken"
    convert(src, broken, 2, preset="kimi-k3")
    manifest = load_manifest(broken)
    record = manifest.layers[0]
    view = next(v for v in record.views if v.pad_rows)
    at = view.offset + view.nbytes - 1  # the last byte of the last pad row, in T
    rank, inside = divmod(at, record.chunk_bytes)
    path = broken / manifest.rank_files[rank]
    data = bytearray(path.read_bytes())
    data[record.file_offset + inside] = 1  # file_offset: from the start of the rank file
    path.write_bytes(bytes(data))
    report = validate(broken)
    assert any(p.code == "nonzero_padding" and p.layer == record.layer for p in report.problems), report.messages


def test_reshard_of_a_k3_output_lays_the_pad_rows_out_again(k3, tmp_path):
    src, out = k3
    reshard(out, tmp_path / "out-3", 3)
    assert validate(tmp_path / "out-3", source=src).ok
    assert [r.views for r in load_manifest(tmp_path / "out-3").layers] == [r.views for r in load_manifest(out).layers]


def test_inspect_splits_k3_layers_into_kda_mla_and_moe_periphery(k3):
    _, out = k3
    info = inspect(out)
    # bf16, hidden 64: KDA q/k/v/g/o 64×64, f_a 32×64, b 2×64, f_b 64×32; MLA q_a 64×64, kv_a 576×64, g 64×64,
    # q_b 192×64, o 64×64; MoE periphery: shared gate/up 32×64 and down 64×32, latent down 32×64 and up 64×32.
    kda = 2 * (5 * 64 * 64 + 32 * 64 + 2 * 64 + 64 * 32)
    mla, periphery = 2 * 64 * (64 + 576 + 64 + 192 + 64), 2 * 5 * 2048
    assert [r["kinds"] for r in info["layers"]] == [{"KDA": kda, "MoE periphery": periphery},
                                                     {"MLA": mla, "MoE periphery": periphery},
                                                     {"KDA": kda, "MoE periphery": periphery}]
    assert info["checked_with"] and all("no forward" in c["mode"] for c in info["checked_with"])
