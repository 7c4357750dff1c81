"""`shardprep run` end to end: N gloo ranks on the CPU give exactly what transformers gives on the source.

Each run starts N processes that import torch and transformers, so there are few cases: llama with
more prompts than ranks (rank 1 idles), Qwen3-MoE from a sharded checkpoint on 4 ranks (ranks 1-3
only idle), BERT with every layer sharded, and the MLA + MoE family with the `deepseek-v3` preset
(DeepSeek-V3, a Kimi-K2-shaped config whose first sharded layer is dense, and DeepSeek-V3 without
q_lora_rank), where q_a_proj and kv_a_proj_with_mqa bind one by one from their fused view.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import account, load_manifest
from shardprep.prep.convert import convert

K = 6


def shardprep_run(out, nproc, *args):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "shardprep", "run", str(out), "--nproc", str(nproc), "--json",
                           "--device", "cpu", *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def transformers_outputs(src, prompts, causal, max_new_tokens=K, device="cpu"):
    """(generated token ids, prompt output on the CPU) per prompt, from transformers on the source checkpoint."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(src).eval().to(device)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            enc = tokenizer(prompt, return_tensors="pt")
            if causal:  # what `shardprep run` passes: causal LMs take no token_type_ids
                enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
            enc = {k: v.to(device) for k, v in enc.items()}
            if causal:
                generated = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
                results.append((generated[0, enc["input_ids"].shape[1]:].tolist(), model(**enc).logits.cpu()))
            else:
                results.append(([], model(**enc).last_hidden_state.cpu()))
    return results


def replicated_parameter_bytes(src, out, causal):
    """Bytes of the parameters transformers builds for the source's non-targets (its router may upcast to float32)."""
    import transformers

    targets = {e.name for record in load_manifest(out).layers for e in record.entries}
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(src)
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in targets)


def check_memory(summary, out, replicated_params):
    """Per rank: R/N (+ 4 KiB alignment per layer) + 2·max|T| + the non-target parameters, and nothing else."""
    manifest = load_manifest(out)
    acc = account(manifest, non_target_bytes=replicated_params)
    for m in summary["ranks"]:
        assert replicated_params <= m["parameter_bytes"] <= replicated_params + 16  # + one NaN placeholder
        assert acc.local_chunk_bytes <= m["shard_bytes"] <= acc.local_chunk_bytes + 4096 * len(manifest.layers)
        assert m["slot_bytes"] == 2 * manifest.max_total_bytes
        total = m["parameter_bytes"] + m["shard_bytes"] + m["slot_bytes"]
        formula = acc.local_chunk_bytes + 2 * acc.max_layer_bytes + acc.non_target_bytes
        assert formula <= total <= formula + 16 + 4096 * len(manifest.layers)


@pytest.mark.parametrize(
    "arch,sharded,nproc,convert_kw,prompts",
    [
        ("llama", False, 2, {"preset": "llama"}, ["hello world", "the model", "shard the weights"]),
        ("qwen3-moe", True, 4, {"preset": "qwen3-moe"}, ["gpu rank layer"]),
        ("bert", False, 2, {"targets": ["*.attention.self.*.weight", "*.intermediate.dense.weight"],
                            "layers": "all"}, ["hello fast world", "the layer"]),
        ("llama", False, 2, {"preset": "llama", "layers": "0,2-:2"}, ["shard every other layer"]),
        ("deepseek-v3-mla", False, 2, {"preset": "deepseek-v3"}, ["hello world", "the model shard"]),
        ("kimi-k2-mla", True, 2, {"preset": "deepseek-v3"}, ["hello world", "the model shard", "gpu"]),
        ("deepseek-v3-mla-q-proj", False, 2, {"preset": "deepseek-v3"}, ["hello world", "the model shard"]),
    ],
    ids=["llama-n2-idle-rank", "qwen3-moe-sharded-n4", "bert-all-layers-n2", "llama-even-layers-n2",
         "deepseek-v3-n2", "kimi-k2-sharded-n2", "deepseek-v3-q-proj-n2"],
)
def test_run_matches_transformers_bit_for_bit(checkpoint_cache, tmp_path, arch, sharded, nproc, convert_kw,
                                              prompts):
    src = checkpoint_cache(arch, sharded=sharded, layers=4 if arch.endswith(("-mla", "-q-proj")) else 3)
    out = tmp_path / "out"
    convert(src, out, nproc, **convert_kw)
    saved = tmp_path / "outputs.pt"
    prompt_args = [a for p in prompts for a in ("--prompt", p)]
    summary = shardprep_run(out, nproc, "--max-new-tokens", K, "--save-outputs", saved, *prompt_args)

    causal = arch != "bert"
    want = transformers_outputs(src, prompts, causal)
    got = summary["prompts"]
    assert [r["rank"] for r in got] == [i % nproc for i in range(len(prompts))]
    outputs = torch.load(saved)
    outputs = outputs if isinstance(outputs, list) else [outputs]
    for r, output, (tokens, reference) in zip(got, outputs, want):
        if causal:
            assert r["token_ids"] == tokens and len(tokens) == K
        assert output.dtype == reference.dtype and torch.equal(output, reference), r["prompt"]
    check_memory(summary, out, replicated_parameter_bytes(src, out, causal))


@pytest.fixture(scope="module")
def llama_n2(checkpoint_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("run-errors") / "llama-n2"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    return out


def run_cli_error(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    return lines[0]


def test_run_refuses_a_directory_convert_did_not_write(checkpoint_cache):
    assert "not an output directory of `shardprep convert`" in run_cli_error(checkpoint_cache("llama"))


def test_run_refuses_a_rank_count_other_than_the_manifests(llama_n2):
    assert "converted for 2 ranks but this run has 3" in run_cli_error(llama_n2, "--nproc", 3)


def test_run_refuses_a_directory_without_tokenizer(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", tokenizer=False), out, 2, preset="llama")
    assert "no tokenizer" in run_cli_error(out)
