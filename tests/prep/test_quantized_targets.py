"""`inspect`'s account of quantized targets (prep/quantized_targets.py): the scales a preset leaves replicated beside
each quantized target, which vLLM's sharded mode gathers with the weights after processing them at load.

The checkpoint is a transformers-written DeepSeek-V3 quantized by the test helper; the expected scales are read
back from the replicated files with safetensors itself, not from shardprep's header reader.
"""

from __future__ import annotations

import json

from safetensors import safe_open
from support.fp8_fixture import quantize_checkpoint_fp8

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.inspect import inspect
from shardprep.prep.quantized_targets import quantized_scales
from shardprep.prep.requant_jobs import RequantOptions


def test_inspect_counts_the_replicated_scales_of_quantized_targets_per_layer(checkpoint_cache, tmp_path):
    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", layers=3, hidden=160), tmp_path / "fp8")
    out = tmp_path / "out"
    convert(src, out, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    manifest = load_manifest(out)
    targets = {e.name for r in manifest.layers for e in r.entries}
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    expected: dict[int, int] = {}
    scaled = 0
    for name, file in weight_map.items():
        if name.endswith(".weight_scale_inv") and name.replace("_scale_inv", "") in targets:
            with safe_open(out / file, "pt") as f:
                t = f.get_tensor(name)
            layer = int(name.split(".")[2])
            expected[layer] = expected.get(layer, 0) + t.numel() * t.element_size()
            scaled += 1
    assert scaled > 0
    got = quantized_scales(out, manifest)
    assert (got.targets, got.bytes_by_layer) == (scaled, expected)
    q = inspect(out)["quantized_targets"]
    assert q["scale_bytes"] == sum(expected.values())
    assert q["gathered_bytes"] == sum(r.total_bytes for r in manifest.layers) + sum(expected.values())
    largest = max(r.total_bytes + expected.get(r.layer, 0) for r in manifest.layers)
    assert q["resident_bytes"] == -(-q["gathered_bytes"] // 2) + 2 * largest


def test_inspect_says_nothing_of_quantized_targets_for_a_bf16_checkpoint(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    assert inspect(out)["quantized_targets"] is None
