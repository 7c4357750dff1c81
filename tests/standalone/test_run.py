"""`shardprep run` end to end: gloo ranks on the CPU give exactly what transformers gives on the source.

Each run starts processes that import torch and transformers, so there are few cases: llama with
more prompts than ranks (rank 1 idles), Qwen3-MoE from a sharded checkpoint on 4 ranks (ranks 1-3
only idle), BERT with every layer sharded, the MLA + MoE family with the `deepseek-v3` preset
(DeepSeek-V3, a Kimi-K2-shaped config whose first sharded layer is dense, and DeepSeek-V3 without
q_lora_rank), where q_a_proj and kv_a_proj_with_mqa bind one by one from their fused view; and shard
groups: 4 ranks in 2 groups of 2, on one node and as two nodes on localhost (two launches, by
`shardprep run` or by torchrun, each with its own copy of OUT).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.runs import K, shardprep_run, transformers_outputs
from support.spawn_group import free_port
from support.terminal import run_on_a_terminal
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import load_manifest
from shardprep.planning.accounting import account
from shardprep.prep.convert import convert


def replicated_parameter_bytes(src, out, causal):
    """Bytes of the parameters transformers builds for the source's non-targets (its router may upcast to float32)."""
    import transformers

    from shardprep.standalone.hf_model import checkpoint_renaming

    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    model = auto.from_pretrained(src)
    renamed = checkpoint_renaming(model)  # Kimi-Linear's block_sparse_moe is its model's mlp
    targets = {renamed(e.name) for record in load_manifest(out).layers for e in record.entries}
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in targets)


def check_memory(summary, out, replicated_params):
    """Per rank: R/N (+ 4 KiB alignment per layer) + 2·max|T| + the non-target parameters, and nothing else."""
    manifest = load_manifest(out)
    acc = account(manifest, non_target_bytes=replicated_params)
    for m in summary["ranks"]:
        assert m["parameter_bytes"] == replicated_params  # the targets live in the slots
        assert acc.local_chunk_bytes <= m["shard_bytes"] <= acc.local_chunk_bytes + 4096 * len(manifest.layers)
        assert m["slot_bytes"] == 2 * manifest.max_total_bytes
        total = m["parameter_bytes"] + m["shard_bytes"] + m["slot_bytes"]
        formula = acc.local_chunk_bytes + 2 * acc.max_layer_bytes + acc.non_target_bytes
        assert formula <= total <= formula + 4096 * len(manifest.layers)


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
        ("kimi-linear", False, 2, {"preset": "kimi-linear"}, ["hello world", "the model shard", "gpu"]),
    ],
    ids=["llama-n2-idle-rank", "qwen3-moe-sharded-n4", "bert-all-layers-n2", "llama-even-layers-n2",
         "deepseek-v3-n2", "kimi-k2-sharded-n2", "deepseek-v3-q-proj-n2", "kimi-linear-n2"],
)
def test_run_matches_transformers_bit_for_bit(checkpoint_cache, tmp_path, arch, sharded, nproc, convert_kw,
                                              prompts):
    src = checkpoint_cache(arch, sharded=sharded, layers=4 if arch.endswith(("-mla", "-q-proj", "-linear")) else 3)
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
def llama_n2(checkpoint_cache, conversion_cache):
    return conversion_cache(checkpoint_cache("llama"), 2, preset="llama")


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


# -- shard groups: W = 4 ranks in 2 groups of N = 2 ------------------------------------------------------
# Prompt i runs on rank i mod 4: group 0 serves prompts 0, 1, 4 (rank 1 idles for one prompt), group 1
# prompts 2 and 3, so the groups make different numbers of forwards.
GROUP_PROMPTS = ["hello world", "the model", "shard the weights", "gpu rank", "a b c d"]


@pytest.fixture(scope="module")
def groups_case(checkpoint_cache, conversion_cache):
    """(source, OUT converted for 2 ranks, transformers' tokens and logits per prompt)."""
    src = checkpoint_cache("llama")
    return src, conversion_cache(src, 2, preset="llama"), transformers_outputs(src, GROUP_PROMPTS, causal=True)


def check_groups_run(summary, saved, src, out, want, nodes):
    """Bit-identical to transformers for every prompt; every rank in its group, gathering inside it."""
    assert (summary["world_size"], summary["group_size"]) == (4, 2)
    assert [r["rank"] for r in summary["prompts"]] == [i % 4 for i in range(len(GROUP_PROMPTS))]
    for r, output, (tokens, reference) in zip(summary["prompts"], torch.load(saved), want):
        assert r["token_ids"] == tokens and len(tokens) == K
        assert output.dtype == reference.dtype and torch.equal(output, reference), r["prompt"]
    layers = len(load_manifest(out).layers)
    per_prompt = K + 1  # generate()'s forwards and the saved logits' one
    for m in summary["ranks"]:
        rank = m["rank"]
        group = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert (m["group"], m["group_ranks"], m["rank_file"], m["node"]) == (rank // 2, group, rank % 2, nodes[rank])
        assert m["gather_group_ranks"] == group  # the gatherer's own process group
        busiest = 2 if rank < 2 else 1  # prompts of the busiest rank of its group
        assert m["forwards"] + m["idle_steps"] == per_prompt * busiest
        assert m["gathers"] == layers * per_prompt * busiest
    check_memory(summary, out, replicated_parameter_bytes(src, out, causal=True))


def test_four_ranks_in_two_shard_groups_on_one_node_match_transformers(groups_case, tmp_path):
    src, out, want = groups_case
    saved = tmp_path / "outputs.pt"
    summary = shardprep_run(out, 4, "--shard-group-size", 2, "--max-new-tokens", K, "--save-outputs", saved,
                            *[a for p in GROUP_PROMPTS for a in ("--prompt", p)])
    check_groups_run(summary, saved, src, out, want, nodes=[0, 0, 0, 0])


def node_command(launcher, out, node_rank, port, saved):
    prompts = [a for p in GROUP_PROMPTS for a in ("--prompt", p)]
    worker = [str(out), "--json", "--device", "cpu", "--max-new-tokens", str(K), "--save-outputs", str(saved),
              *prompts]
    if launcher == "shardprep":
        return [sys.executable, "-m", "shardprep", "run", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank",
                str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}", *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "shardprep.run",
            *worker]


def run_at_once(commands, env, timeout=300):
    """Start every command (the nodes of one launch) and wait for all: (exit code, stdout, stderr) of each."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


@pytest.mark.parametrize("launcher", ["shardprep", "torchrun"])
def test_two_nodes_of_two_ranks_each_with_its_own_copy_match_transformers(groups_case, tmp_path, launcher):
    src, out, want = groups_case
    saved = tmp_path / "outputs.pt"  # written by rank 0, on node 0
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    # What each node holds: its own OUT.
    copies = [shutil.copytree(out, tmp_path / f"node{node}" / "out") for node in range(2)]
    results = run_at_once([node_command(launcher, copies[node], node, port, saved) for node in range(2)], env)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert not results[1][1].strip()  # rank 0, on node 0, reports for everyone
    summary = json.loads(results[0][1].strip().splitlines()[-1])
    check_groups_run(summary, saved, src, tmp_path / "node0" / "out", want, nodes=[0, 0, 1, 1])


def test_run_refuses_a_shard_group_that_would_span_nodes(llama_n2):
    line = run_cli_error(llama_n2, "--nproc-per-node", 1, "--nnodes", 2, "--node-rank", 0,
                         "--rdzv-endpoint", "127.0.0.1:1")
    assert "shard group 0 (ranks 0..1) spans nodes 0 and 1 of the 2 nodes" in line
    assert "--allow-cross-node-groups" in line


@pytest.mark.parametrize("args,expected", [
    (["--shard-group-size", 4], "--shard-group-size 4, but "),
    (["--nproc", 4, "--shard-group-size", 3], "--shard-group-size 3, but "),
    (["--nproc-per-node", 1, "--nnodes", 3, "--rdzv-endpoint", "127.0.0.1:1"],
     "converted for 2 ranks but this run has 3 (3 ranks are not a whole number of shard groups of 2)"),
    (["--nnodes", 2], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", 2, "--node-rank", 2, "--rdzv-endpoint", "127.0.0.1:1"], "--node-rank 2 with --nnodes 2"),
    (["--nnodes", 2, "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0': expected HOST:PORT"),
], ids=["group-size-not-the-manifests", "group-size-with-more-ranks", "world-not-whole-groups",
        "nodes-without-endpoint", "node-rank-out-of-range", "endpoint-without-port"])
def test_run_refuses_launches_that_cannot_form_shard_groups(llama_n2, args, expected):
    assert expected in run_cli_error(llama_n2, *args)


@pytest.mark.parametrize("args,expected", [
    (["--nnodes", 3], "--nnodes 3 inside a torchrun job where it is 2; drop --nnodes"),
    (["--nproc-per-node", 4], "--nproc 4 inside a torchrun job of 2 processes per node; drop --nproc"),
    (["--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-endpoint inside a torchrun job"),
], ids=["nnodes", "nproc", "endpoint"])
def test_a_torchrun_worker_refuses_launch_options_that_contradict_torchrun(llama_n2, args, expected):
    torchrun = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2"}
    result = CliRunner().invoke(app, ["run", str(llama_n2), *map(str, args)], env=torchrun)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert expected in result.stderr


def test_a_checkpoint_given_to_run_is_told_to_convert_into_a_new_directory(checkpoint_cache):
    src = checkpoint_cache("llama")
    line = run_cli_error(src)
    assert f"run `shardprep convert {src} {src.name}-sharded --ranks N --preset NAME` first" in line
    assert f"then run {src.name}-sharded" in line


def test_run_on_a_terminal_shows_rank_0s_progress_and_ends_with_a_summary_line(checkpoint_cache, tmp_path):
    """Under a pseudo-terminal (stderr a TTY, as a user's shell has it), rank 0's rich bar counts its forwards
    and the last line sums the run up with its seconds. One rank, started as torchrun starts it (`python -m
    shardprep.run` with RANK and WORLD_SIZE): what `shardprep run` starts, without its launcher's start-up."""
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 1, preset="llama")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="80", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code, stdout, shown = run_on_a_terminal(
        [sys.executable, "-m", "shardprep.run", str(out), "--device", "cpu", "--max-new-tokens", "3"], env)
    assert code == 0, shown[-3000:]
    assert "generating" in shown and "3/3" in shown and "forwards" in shown, shown[-3000:]
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("[1 ranks on cpu") and summary.endswith(" s]"), stdout
