"""The shipped presets take the quantized names their servers read (`weight_packed`), with the same fused views.

compressed-tensors is not installed in this stage (it comes with vLLM: tests/vllm_engines/compressed_fixture.py
writes such checkpoints with the library itself). Here the W4A16 checkpoint is written by renaming: each attention
projection's `weight` becomes the tensors a pack-quantized compressed-tensors checkpoint holds, with their names,
dtypes and shapes (`weight_packed` int32 [out, in/8], `weight_scale` bf16 [out, in/32], `weight_shape` int64 [2]),
saved by the safetensors library.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.checkpoints import read_state_dict

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.inspect import inspect
from shardprep.prep.selection import Selection, builtin_presets, load_preset, parse_layers, select_targets
from shardprep.prep.source import open_source
from shardprep.prep.validate import validate

GROUP = 32
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def as_pack_quantized(src, dst):
    """`src` with its attention projections as compressed-tensors W4A16 (pack-quantized, groups of 32) names them."""
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = {}
    for name, t in read_state_dict(src).items():
        module, _, last = name.rpartition(".")
        if last == "weight" and module.rpartition(".")[2] in ATTENTION:
            out, cols = t.shape
            tensors[f"{module}.weight_packed"] = torch.randint(-2**31, 2**31 - 1, (out, cols // 8), dtype=torch.int32)
            tensors[f"{module}.weight_scale"] = torch.rand(out, cols // GROUP).to(torch.bfloat16)
            tensors[f"{module}.weight_shape"] = torch.tensor([out, cols], dtype=torch.int64)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["re:.*self_attn\\.(q|k|v|o)_proj$"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_qwen3_moe_preset_converts_a_w4a16_checkpoint_with_its_fused_view(checkpoint_cache, tmp_path):
    src = as_pack_quantized(checkpoint_cache("qwen3-moe"), tmp_path / "w4a16")
    out = tmp_path / "out"
    convert(src, out, 2, preset="qwen3-moe")  # was: preset 'qwen3-moe' matches no tensor
    m = load_manifest(out)
    for record in m.layers:
        p = f"model.layers.{record.layer}.self_attn."
        assert {e.name for e in record.entries} == {f"{p}{proj}.weight_packed" for proj in ATTENTION}
        assert {v.name: v.members for v in record.views} == {
            f"{p}qkv_proj.weight_packed": tuple(f"{p}{x}_proj.weight_packed" for x in "qkv")}
    # The scales and shapes stay replicated, and inspect counts them with their quantized targets.
    replicated = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.q_proj.weight_scale" in replicated
    assert "model.layers.1.self_attn.q_proj.weight_shape" in replicated
    assert inspect(out)["quantized_targets"]["targets"] == 4 * len(m.layers)
    assert validate(out, source=src).ok


@pytest.mark.parametrize("preset", builtin_presets())
def test_every_shipped_preset_takes_weight_packed_as_it_takes_weight(checkpoint_cache, preset):
    arch = {"llama": "llama", "qwen3-moe": "qwen3-moe", "deepseek-v3": "deepseek-v3-mla", "kimi-k3": "kimi-k3",
            "kimi-linear": "kimi-linear", "dflash": "dflash", "eagle3": "eagle3"}[preset]
    names = list(open_source(checkpoint_cache(arch)).tensors)
    shipped = load_preset(preset)
    selection = Selection(preset=shipped, layers=parse_layers("all"), unnumbered_layers=shipped.unnumbered_layers)
    plain = select_targets(names, selection)
    targets = plain.names
    packed = select_targets([f"{n}_packed" if n in targets else n for n in names], selection)
    # The same tensors, now named weight_packed, in the same layers, with the same fused views.
    assert targets and all(n.endswith(".weight") for n in targets)
    assert packed.layers == {i: [f"{n}_packed" for n in ns] for i, ns in plain.layers.items()}
    assert {i: [(g.name, g.members, g.row_multiple) for g in gs] for i, gs in packed.groups.items()} == {
        i: [(f"{g.name}_packed", tuple(f"{m}_packed" for m in g.members), g.row_multiple) for g in gs]
        for i, gs in plain.groups.items()}
