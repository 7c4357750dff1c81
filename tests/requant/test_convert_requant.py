"""convert on block-FP8 checkpoints: requantized weights and scales equal the reference recipe bit for bit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict
from support.fp8_fixture import quantize_checkpoint_fp8
from support.reconstruct import rebuild_layers
from test_requant import reference_requant

from shardprep.errors import RequantError
from shardprep.manifests.replicated import NOTICE_FILE, SHARDED_SENTINEL
from shardprep.prep.convert import convert
from shardprep.prep.requant_jobs import RequantOptions
from shardprep.prep.validate import validate


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory, checkpoint_cache):
    # hidden = 160: rows and columns that are not multiples of 128, so every weight has tail blocks.
    src = checkpoint_cache("deepseek-v3", sharded=True, hidden=160)
    dst = tmp_path_factory.mktemp("fp8") / "ds-fp8"
    quantize_checkpoint_fp8(src, dst)
    return dst


def read_replicated_part(out):
    """The output's replicated tensors, read by the safetensors library (the index minus shardprep's sentinels)."""
    from safetensors.torch import load_file

    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values()) - {SHARDED_SENTINEL, NOTICE_FILE}):
        tensors.update(load_file(out / name))
    return tensors


def as_plain_checkpoint(out, dest):
    """The replicated part of an output as an ordinary HF checkpoint (its targets left out)."""
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("shards", "shard_manifest.json", NOTICE_FILE))
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f not in (SHARDED_SENTINEL, NOTICE_FILE)}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


def bytes_equal(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_requantized_targets_and_replicated_weights_match_the_reference(fp8_source, tmp_path):
    out = tmp_path / "out"
    summary = convert(fp8_source, out, 3, preset="deepseek-v3")
    source = read_state_dict(fp8_source)
    replicated = read_replicated_part(out)
    rebuilt = rebuild_layers(out)
    fp8_weights = [n for n in source if n + "_scale_inv" in source]
    assert summary.requantized_tensors == 2 * len(fp8_weights) > 0
    for name in fp8_weights:
        q_ref, s_ref = reference_requant(source[name], source[name + "_scale_inv"], "sglang")
        got = rebuilt[name] if name in rebuilt else replicated[name]
        assert got.dtype == torch.float8_e4m3fn and bytes_equal(got, q_ref), name
        scale = replicated[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and bytes_equal(scale, s_ref.float()), name
    assert any(n in rebuilt for n in fp8_weights) and any(n in replicated for n in fp8_weights)
    for name, t in replicated.items():
        if not name.endswith("_scale_inv") and name not in fp8_weights:
            assert bytes_equal(t, source[name]), name
    manifest = json.loads((out / "shard_manifest.json").read_text())
    assert manifest["quantization"] == {"method": "fp8", "block": [128, 128], "recipe": "sglang",
                                        "scale_format": "f32", "scope": "all", "allow_nonfinite": False}
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    report = validate(out, source=fp8_source)
    assert report.ok, report.problems


def test_scope_targets_leaves_replicated_weights_untouched(fp8_source, tmp_path):
    out = tmp_path / "out"
    convert(fp8_source, out, 2, preset="deepseek-v3", requant=RequantOptions(scope="targets", recipe="fp32"))
    source, replicated = read_state_dict(fp8_source), read_replicated_part(out)
    rebuilt = rebuild_layers(out)
    name = "model.layers.1.self_attn.o_proj.weight"
    q_ref, _ = reference_requant(source[name], source[name + "_scale_inv"], "fp32")
    assert bytes_equal(rebuilt[name], q_ref)
    dense = "model.layers.0.mlp.gate_proj.weight"
    assert bytes_equal(replicated[dense], source[dense]) and bytes_equal(replicated[dense + "_scale_inv"],
                                                                         source[dense + "_scale_inv"])
    assert validate(out, source=fp8_source).ok


def test_requant_none_and_already_ue8m0_sources_are_left_alone(fp8_source, tmp_path):
    out = tmp_path / "none"
    summary = convert(fp8_source, out, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    assert summary.requantized_tensors == 0 and summary.quantization is None
    assert validate(out, source=fp8_source).ok
    # Requantize every FP8 weight into the replicated part (the targets are norms, not FP8).
    once = tmp_path / "once"
    first = convert(fp8_source, tmp_path / "first", 2, targets=["*.input_layernorm.weight"])
    assert first.requantized_tensors > 0
    as_plain_checkpoint(tmp_path / "first", once)
    config = json.loads((once / "config.json").read_text())
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    # Declared UE8M0: left alone.
    again = convert(once, tmp_path / "again", 2, targets=["*.post_attention_layernorm.weight"])
    assert again.requantized_tensors == 0 and again.quantization is None
    # Not declared, but every scale is a power of two: also left alone.
    del config["quantization_config"]["scale_fmt"]
    (once / "config.json").write_text(json.dumps(config))
    third = convert(once, tmp_path / "third", 2, targets=["*.post_attention_layernorm.weight"])
    assert third.requantized_tensors == 0


def test_e8m0_scale_format_writes_f8_e8m0_powers_of_two(fp8_source, tmp_path):
    out = tmp_path / "out"
    convert(fp8_source, out, 2, preset="deepseek-v3", requant=RequantOptions(scale_format="e8m0"))
    source, replicated = read_state_dict(fp8_source), read_replicated_part(out)
    name = "model.layers.0.self_attn.o_proj.weight"
    _, s_ref = reference_requant(source[name], source[name + "_scale_inv"], "sglang")
    scale = replicated[name + "_scale_inv"]
    assert scale.dtype == torch.float8_e8m0fnu and torch.equal(scale.float(), s_ref.float())
    assert validate(out, source=fp8_source).ok


def test_ue8m0_requested_on_a_bf16_checkpoint_is_refused(checkpoint_cache, tmp_path):
    with pytest.raises(RequantError, match="declares no block-FP8"):
        convert(checkpoint_cache("llama"), tmp_path / "out", 2, preset="llama", requant=RequantOptions(mode="ue8m0"))
    assert not (tmp_path / "out").exists()


def test_nonfinite_weight_is_refused_naming_it_unless_allowed(fp8_source, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fp8_source, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.2.self_attn.o_proj.weight"
    path = src / index["weight_map"][name + "_scale_inv"]
    tensors = load_file(path)
    tensors[name + "_scale_inv"][0, 0] = float("inf")
    save_file(tensors, path, metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, "-m", "shardprep", "convert", str(src), str(tmp_path / "out"), "-n", "2",
                           "--preset", "deepseek-v3"], capture_output=True, text=True)
    assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    summary = convert(src, tmp_path / "ok", 2, preset="deepseek-v3", requant=RequantOptions(allow_nonfinite=True))
    assert summary.requantized_tensors > 0
    # validate recomputes the requant with the option the manifest records, so the output checks out.
    manifest = json.loads((tmp_path / "ok" / "shard_manifest.json").read_text())
    assert manifest["quantization"]["allow_nonfinite"] is True
    assert manifest["requant_options"]["allow_nonfinite"] is True
    report = validate(tmp_path / "ok", source=src)
    assert report.ok, report.messages
    assert report.checked["target_tensors_compared"] > 0 and report.checked["replicated_tensors_compared"] > 0
    # Recomputing without the option refuses the same tensor: the recorded option is what made it pass.
    manifest["quantization"]["allow_nonfinite"] = False
    (tmp_path / "ok" / "shard_manifest.json").write_text(json.dumps(manifest))
    report = validate(tmp_path / "ok", source=src)
    assert any(p.code == "requant_mismatch" and p.tensor == name for p in report.problems), report.messages


def test_negative_block_scale_is_refused_naming_the_tensor(fp8_source, tmp_path):
    from safetensors.torch import load_file, save_file

    src = shutil.copytree(fp8_source, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    path = src / index["weight_map"][name + "_scale_inv"]
    tensors = load_file(path)
    tensors[name + "_scale_inv"][0, 0] = -tensors[name + "_scale_inv"][0, 0]
    save_file(tensors, path, metadata={"format": "pt"})
    for options in (RequantOptions(), RequantOptions(allow_nonfinite=True)):
        with pytest.raises(RequantError, match=rf"tensor '{name}': weight_scale_inv is negative at index \(0, 0\)"):
            convert(src, tmp_path / "out", 2, preset="deepseek-v3", requant=options)
        assert not (tmp_path / "out").exists()


MEASURE = """
import json, sys
sys.path.insert(0, {tests!r})
from support.checkpoints import make_checkpoint
from support.fp8_fixture import quantize_checkpoint_fp8
make_checkpoint({bf16!r}, "deepseek-v3", layers=6, hidden=1536, vocab=24000, sharded=True, tokenizer=False)
quantize_checkpoint_fp8({bf16!r}, {fp8!r})
import shutil; shutil.rmtree({bf16!r})
import os
pid = os.fork()
if pid == 0:
    # A fresh child: its VmHWM covers only the conversion (the fixture's tensors are freed but counted above).
    os.execv(sys.executable, [sys.executable, "-c", {child!r}])
os.waitpid(pid, 0)
"""

CHILD = """
import json
from shardprep.prep.convert import convert
from shardprep.prep.requant_jobs import RequantOptions
s = convert({fp8!r}, {out!r}, 4, preset="deepseek-v3")
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({{"hwm": hwm, "requantized": s.requantized_tensors, "bytes": s.target_bytes}}))
"""


@pytest.mark.slow
def test_requant_convert_memory_stays_bounded(tmp_path):
    tests = str(Path(__file__).parents[1])
    fp8, out = tmp_path / "fp8", tmp_path / "out"
    child = CHILD.format(fp8=str(fp8), out=str(out))
    proc = subprocess.run([sys.executable, "-c", MEASURE.format(tests=tests, bf16=str(tmp_path / "bf16"),
                                                                fp8=str(fp8), child=child)],
                          capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    size = sum(p.stat().st_size for p in fp8.glob("*.safetensors"))
    manifest = json.loads((out / "shard_manifest.json").read_text())
    largest = max(lay["total_bytes"] for lay in manifest["layers"])
    bound = 2 * largest + 300 * (1 << 20)
    print(f"fp8 checkpoint {size / 2**20:.0f} MiB, largest layer {largest / 2**20:.1f} MiB, "
          f"peak RSS {result['hwm'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert result["requantized"] > 0 and size > 100 * (1 << 20)
    assert result["hwm"] < bound


def test_negative_scale_is_refused_by_the_transform_itself():
    from shardprep.requant import requant_ue8m0

    weight = torch.full((4, 4), 1.0).to(torch.float8_e4m3fn)
    for scale in (torch.tensor([[-2.0]]), torch.tensor([[-2.0]], dtype=torch.bfloat16)):
        with pytest.raises(RequantError, match="'demo.weight': weight_scale_inv is negative at index"):
            requant_ue8m0(weight, scale, name="demo.weight", allow_nonfinite=True)
    q, s = requant_ue8m0(weight, torch.tensor([[2.0]]), name="demo.weight")
    assert s.item() > 0 and not torch.isnan(q.float()).any()
