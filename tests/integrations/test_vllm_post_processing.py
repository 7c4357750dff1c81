"""Sharded mode's guard against a server's post-load processing, in the parts that need no server: a bound
parameter that the processing replaced or moved is refused naming it (sharded_load.py). That the flow asks the
server about every target before loading anything: test_sharded_load.py.

The check that knows vLLM's steps (`VllmAdapter.refuse_unshardable`: MLA's absorption of kv_b_proj) runs inside
vLLM in tests/vllm_engines/test_vllm_mla.py; quantized targets are processed at load instead
(test_processed_layers.py, tests/vllm_engines/test_vllm_fp8.py and test_vllm_quantized.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardprep.errors import ShardprepError
from shardprep.integrations.sharded_load import bound_places, refuse_replaced_after_processing


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

