"""Sharded mode's guard against vLLM's post-load processing, in the parts that need no vLLM: sharded mode asks
the server's check about every bound parameter before loading anything, and a bound parameter that the
processing replaced or moved is refused naming it.

The check that knows vLLM's steps (`compat.refuse_post_processed`: MLA's absorption of kv_b_proj) runs inside vLLM
in tests/vllm_engines/test_vllm_mla.py; quantized targets are processed at load instead (test_processed_layers.py,
tests/vllm_engines/test_vllm_fp8.py and test_vllm_quantized.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardprep.errors import ShardprepError
from shardprep.integrations.server import ParallelLayout
from shardprep.integrations.sharded_load import load_sharded
from shardprep.integrations.vllm.adapter import bound_places, refuse_replaced_after_processing
from shardprep.manifests import load_manifest
from shardprep.prep.convert import convert


class Refused(ShardprepError):
    pass


def two_linears() -> tuple[nn.Module, dict[str, nn.Parameter]]:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    return model, {"layers.0.q.weight": model[0].weight, "layers.0.o.weight": model[1].weight}


def test_a_bound_parameter_left_where_it_was_passes():
    model, bound = two_linears()
    before = bound_places(model, bound)
    model[0].weight.requires_grad_(False)  # what processing may do without moving anything
    refuse_replaced_after_processing(before, bound)


def test_a_bound_parameter_replaced_by_a_new_one_is_refused_naming_it():
    model, bound = two_linears()
    before = bound_places(model, bound)
    model[1].weight = nn.Parameter(torch.empty(0), requires_grad=False)  # as vLLM's AMX MLA does to kv_b_proj
    with pytest.raises(ShardprepError, match=r"replaced 'layers.0.o.weight' \(Linear.weight\)"):
        refuse_replaced_after_processing(before, bound)


def test_a_bound_parameter_pointed_at_other_memory_is_refused_naming_it():
    model, bound = two_linears()
    before = bound_places(model, bound)
    model[0].weight.data = torch.zeros(4, 4)  # as a repacking step does to `.weight.data`
    with pytest.raises(ShardprepError, match="replaced 'layers.0.q.weight'"):
        refuse_replaced_after_processing(before, bound)


def test_sharded_mode_asks_about_every_bound_parameter_before_loading_anything(checkpoint_cache, tmp_path,
                                                                               world_of_one):
    import transformers

    src = checkpoint_cache("llama")
    out = tmp_path / "out"
    convert(src, out, 1, preset="llama")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src),
                                                          dtype=torch.bfloat16)
    model.load_weights = lambda weights: pytest.fail("loaded weights after the refusal")
    asked = {}

    def refuse(model: nn.Module, bound: dict[str, nn.Parameter]) -> None:
        asked.update(bound)
        raise Refused("refused")

    layout = ParallelLayout(dp_rank=0, dp_size=1, dp_world_ranks=(0,), tp_size=1, pp_size=1, lockstep_dp=True,
                            eager=True, device=torch.device("cpu"), platform="cpu")
    with pytest.raises(Refused):
        load_sharded(model, out, layout, keep_plain_linear=lambda m: pytest.fail("kept a module after the refusal"),
                     refuse_post_processed=refuse)
    # transformers' Llama has no fused qkv_proj: every entry is bound to its own parameter.
    assert set(asked) == {e.name for r in load_manifest(out).layers for e in r.entries}
    params = dict(model.named_parameters())
    assert all(asked[name] is params[name] for name in asked)
