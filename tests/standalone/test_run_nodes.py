"""`shardprep run` as two nodes on localhost when something goes wrong: every node ends with one line.

Two launches (`--nnodes 2 --node-rank k --rdzv-endpoint`), 2 ranks each, each node with its own copy of
OUT, as in tests/standalone/test_run.py. A rank that fails on node 1 must not leave node 0 with transport tracebacks
and "rank 0 exited with status 1": both nodes print the launch's first failure (rank, node, what). And
options that differ between the nodes are refused on both, in one line naming the option.
"""

import os
import shutil
import sys

import pytest
from support.spawn_group import free_port
from test_run import run_at_once

from shardprep.errors import OptionsMismatchError
from shardprep.standalone.runner import RunOptions, agreed_options, check_same_options


@pytest.fixture(scope="module")
def llama_n2(checkpoint_cache, conversion_cache):
    return conversion_cache(checkpoint_cache("llama"), 2, preset="llama")


def run_two_nodes(out, tmp_path, node_args=((), ()), missing_on_node1=()):
    """Both nodes' (exit code, stdout, stderr); node k runs its own copy of `out` with `node_args[k]` added."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("SHARDPREP_DEBUG", None)
    commands = []
    for node in range(2):
        copy = shutil.copytree(out, tmp_path / f"node{node}" / "out")
        if node == 1:
            for name in missing_on_node1:
                (copy / name).unlink()
        commands.append([sys.executable, "-m", "shardprep", "run", str(copy), "--nproc-per-node", "2", "--nnodes",
                         "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--device", "cpu",
                         "--max-new-tokens", "2", "--prompt", "hello world", "--prompt", "the model",
                         "--prompt", "shard the weights", *map(str, node_args[node])])
    return run_at_once(commands, env)


def last_line_of_each_node(results):
    """Each node's last stderr line, after checking that the node failed, printed no traceback and said it once."""
    lines = []
    for node, (code, out, err) in enumerate(results):
        said = [line for line in err.splitlines() if line.strip()]
        assert code != 0, f"node {node} exited 0: {err[-2000:]}"
        assert "Traceback" not in out + err, f"node {node} printed a traceback:\n{err[-3000:]}"
        assert said and said[-1].startswith("error: "), f"node {node}'s stderr:\n{err[-3000:]}"
        assert sum(line.startswith("error: ") for line in said) == 1, f"node {node} said it per rank:\n{err}"
        lines.append(said[-1])
    return lines


def test_a_rank_failing_on_node_1_ends_both_nodes_with_its_line(llama_n2, tmp_path):
    # Rank 3 (node 1) serves rank file 1, which node 1's copy lacks; rank 2 waits for it in a collective,
    # node 0's ranks for node 1's at the end.
    missing = "shards/rank-00001-of-00002.safetensors"
    results = run_two_nodes(llama_n2, tmp_path, missing_on_node1=[missing])
    node0, node1 = last_line_of_each_node(results)
    assert node0 == node1, "the nodes name different first failures"
    assert node1.startswith("error: rank 3 (node 1) failed first: "), node1
    assert f"node1/out/{missing}: rank 1's shard file is missing; copy it next to shard_manifest.json" in node1
    assert all(code == 2 for code, _, _ in results), [code for code, _, _ in results]


def test_save_outputs_on_node_0_only_is_refused_on_both_nodes(llama_n2, tmp_path):
    saved = tmp_path / "outputs.pt"
    results = run_two_nodes(llama_n2, tmp_path, node_args=(("--save-outputs", saved), ()))
    node0, node1 = last_line_of_each_node(results)
    assert node0 == node1 == (
        f"error: the ranks were started with different options: --save-outputs is {saved} on ranks 0, 1 (node 0) "
        "but not given on ranks 2, 3 (node 1); start every node with the same options (only DIR's path and "
        "--node-rank may differ)")
    assert not saved.exists()


def test_options_that_differ_are_named_with_the_ranks_and_nodes_on_each_side(llama_n2, monkeypatch):
    # check_same_options is collective: here the other three ranks' views are made up, rank 3 given a prompt more.
    one, two = (RunOptions(llama_n2, prompts=prompts) for prompts in (("hello world",), ("hello world", "the model")))
    views = [(0, agreed_options(one)), (0, agreed_options(one)), (1, agreed_options(one)), (1, agreed_options(two))]

    def all_gather_object(everyone, mine):
        everyone[:] = views

    monkeypatch.setattr("torch.distributed.all_gather_object", all_gather_object)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda: 4)
    with pytest.raises(OptionsMismatchError) as refusal:
        check_same_options(one)
    assert str(refusal.value).startswith("the ranks were started with different options: --prompt is "
                                         "['hello world'] on ranks 0, 1, 2 (nodes 0, 1) but ['hello world', "
                                         "'the model'] on rank 3 (node 1); ")
