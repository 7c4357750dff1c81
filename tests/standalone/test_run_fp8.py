"""Block-FP8 models in shardprep's own runtime: `shardprep run` keeps the FP8 codes and computes them itself.

A DeepSeek-V3 written by transformers and block-FP8-quantized by the test helper is converted at N=2 (the
default UE8M0 requant, and `--requant none`) and run on 2 gloo ranks; its logits must equal, bit for bit,
those of the same weights resident in one process on the same kernel (`hf_model.load_unsharded`: the source
for `--requant none`, the output's export for UE8M0). transformers alone would dequantize the model to bf16
on a machine without a GPU, or fetch its FP8 kernel from the hub on one.
"""

import pytest
import torch
from support.fp8_fixture import quantize_checkpoint_fp8
from support.runs import K, shardprep_run

from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.export import export
from shardprep.prep.requant_jobs import RequantOptions
from shardprep.standalone.block_fp8 import block_fp8_linear, dequantize_blocks
from shardprep.standalone.hf_model import load_unsharded

PROMPTS = ["hello world", "the model shard", "gpu"]


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory, checkpoint_cache):
    return quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", layers=4), tmp_path_factory.mktemp("fp8") / "src")


def reference_outputs(directory, prompts):
    """(greedy tokens, prompt logits) per prompt, from the plain checkpoint resident in this process."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = load_unsharded(directory)
    assert any(p.dtype == torch.float8_e4m3fn for p in model.parameters()), "the reference was dequantized"
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt")
            enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
            generated = model.generate(**enc, max_new_tokens=K, do_sample=False)
            results.append((generated[0, enc["input_ids"].shape[1]:].tolist(), model(**enc).logits))
    return results


@pytest.mark.parametrize("requant", ["ue8m0", "none"])
def test_run_of_a_block_fp8_model_at_n2_equals_the_resident_model_on_the_same_kernel(fp8_source, tmp_path, requant):
    out = tmp_path / "out"
    convert(fp8_source, out, 2, preset="deepseek-v3", requant=RequantOptions(mode=requant))
    manifest = load_manifest(out)
    assert {e.dtype for r in manifest.layers for e in r.entries} == {"F8_E4M3"}  # the targets are FP8 codes
    if requant == "none":
        reference_dir = fp8_source
    else:
        assert manifest.quantization is not None
        reference_dir = tmp_path / "plain"
        export(out, reference_dir)
    saved = tmp_path / "outputs.pt"
    prompt_args = [a for p in PROMPTS for a in ("--prompt", p)]
    summary = shardprep_run(out, 2, "--max-new-tokens", K, "--save-outputs", saved, *prompt_args)

    want = reference_outputs(reference_dir, PROMPTS)
    outputs = torch.load(saved)
    for r, output, (tokens, logits) in zip(summary["prompts"], outputs, want):
        assert r["token_ids"] == tokens and len(tokens) == K
        assert output.dtype == logits.dtype and torch.equal(output, logits), r["prompt"]


def test_the_cpu_block_fp8_linear_is_the_matmul_of_the_dequantized_blocks():
    torch.manual_seed(0)
    weight = (torch.randn(200, 300) * 4).to(torch.float8_e4m3fn)  # partial last blocks both ways
    scale = torch.rand(2, 3) + 0.5
    x = torch.randn(5, 300, dtype=torch.bfloat16)
    dequantized = dequantize_blocks(weight, scale, (128, 128), torch.float32)
    assert dequantized[127, 127] == weight[127, 127].float() * scale[0, 0]
    assert dequantized[199, 299] == weight[199, 299].float() * scale[1, 2]
    got = block_fp8_linear(x, weight, scale, (128, 128))
    assert torch.equal(got, torch.nn.functional.linear(x, dequantized.to(torch.bfloat16)))
    assert torch.equal(got, block_fp8_linear(x, weight, scale, (128, 128)))  # the same bits on every call


def test_profile_of_a_block_fp8_output_measures_its_fp8_layers_and_plan_reads_it(fp8_source, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from typer.testing import CliRunner

    from shardprep.cli import app
    from shardprep.planning.profile_format import load_profile

    out, path, trace = tmp_path / "out", tmp_path / "profile.json", tmp_path / "trace.json"
    convert(fp8_source, out, 2, preset="deepseek-v3")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "profile", str(out), "--dry-run", "--out", str(path),
                           "--trace", str(trace)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = load_profile(path)
    assert all(ms > 0 for layer in profile.layers for ms in layer.compute_ms)
    # The CPU block-FP8 kernel dequantizes per block (repeat_interleave of the scales): the profiled forward
    # ran the FP8 layers, not a model transformers dequantized to bf16 at load.
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::repeat_interleave" in names
    result = CliRunner().invoke(app, ["plan", str(out), "--ranks", "2", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert [p["tokens"] for p in json.loads(result.stdout)["every_layer"]["predictions"]] == list(profile.tokens)
