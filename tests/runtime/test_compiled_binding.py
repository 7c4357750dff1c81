"""torch.compile of a bound model on 2 gloo ranks: the gathers are two ops Dynamo traces in one graph, and no
compiled weight read can see another layer's bytes.

- Dynamo's graph (fullgraph=True, no graph break), run as traced, gives eager's logits bit for bit, and those
  are transformers' on the source.
- The race test: a model whose layers do work on their weights alone (a dequantization-like rounding and
  scaling before each matmul) in exact integer arithmetic, so Inductor's fusions cannot change a single bit.
  Layers 1 and 3 (2 and 4) share a slot and hold different weights, so a weight read moved across a gather
  would read the other layer's bytes and change the output. Compiled with Inductor, it gives exactly the
  output computed from the source checkpoint's weights, forward after forward.
- A compiler that hands the ops copies of the weights (AOTAutograd without Inductor's reinplacing) is
  refused with one line instead of computing with stale copies.
"""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import read_state_dict
from support.spawn_group import run_ranks
from torch import nn

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def llama(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama", layers=5)
    return src, conversion_cache(src, 2, preset="llama")  # layers 1-4 sharded: 1 and 3 share slot 0, 2 and 4 slot 1


def _transformers_logits(src, ids):
    import transformers

    with torch.inference_mode():
        return transformers.AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits


def _dynamo_rank(rank, world_size, src, out):
    from shardprep.standalone.hf_model import build_model

    ids = torch.tensor([[1, 5, 7, 9, 33, 40 + rank]])
    binding = build_model(out, "cpu")
    with torch.inference_mode():
        eager = binding.model(ids).logits
        compiled = torch.compile(binding.model, fullgraph=True, backend="eager")
        traced = [compiled(ids).logits for _ in range(2)]
    return {"eager_is_transformers": torch.equal(eager, _transformers_logits(src, ids)),
            "traced_is_eager": [torch.equal(t, eager) for t in traced],
            "forwards": binding.forward_count}


def test_dynamo_traces_the_bound_model_in_one_graph_and_its_graph_gives_eagers_logits(llama):
    src, out = llama
    for result in run_ranks(_dynamo_rank, 2, src, out, timeout=600):
        assert result == {"eager_is_transformers": True, "traced_is_eager": [True, True], "forwards": 3}


class ExactAttention(nn.Module):
    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
        self.k_proj = nn.Linear(hidden, kv, bias=False, dtype=torch.bfloat16)
        self.v_proj = nn.Linear(hidden, kv, bias=False, dtype=torch.bfloat16)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """Work on the weight alone, before its matmul (as FP8 dequantization does): small integers, exactly."""
    return torch.round(weight.float() * 64)


class ExactLayer(nn.Module):
    """Integer arithmetic below 2**24 throughout, so every evaluation order gives the same bits."""

    def __init__(self, hidden: int, kv: int):
        super().__init__()
        self.self_attn = ExactAttention(hidden, kv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        q = x @ dequantize(a.q_proj.weight).t()
        kv = torch.cat([x @ dequantize(a.k_proj.weight).t(), x @ dequantize(a.v_proj.weight).t()], dim=-1)
        y = torch.remainder(q + kv, 13.0) @ dequantize(a.o_proj.weight).t()
        return torch.remainder(x + y, 11.0) - 5


class ExactModel(nn.Module):
    def __init__(self, layers: int, hidden: int = 64, kv: int = 32):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(ExactLayer(hidden, kv) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


def _exact_model(src) -> ExactModel:
    weights = read_state_dict(src)
    model = ExactModel(5)
    model.load_state_dict({k: v for k, v in weights.items() if ".self_attn." in k and k.endswith("proj.weight")})
    return model.eval()


def _race_rank(rank, world_size, src, out):
    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind
    from shardprep.runtime.gatherer import LayerGatherer

    x = torch.remainder(torch.arange(8 * 64, dtype=torch.float32).view(8, 64) * (7 + rank), 9.0) - 4
    with torch.inference_mode():
        want = _exact_model(src)(x)  # every layer's own weights, resident
        model = _exact_model(src)
        shards = open_rank(out, rank, world_size=world_size)
        binding = bind(model, shards, LayerGatherer(shards))
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)  # Inductor
        got = [compiled(x) for _ in range(3)]
    return {"eager": torch.equal(eager, want), "compiled": [torch.equal(g, want) for g in got],
            "forwards": binding.forward_count}


def test_inductor_compiled_layers_read_only_their_own_gathered_weights(llama):
    src, out = llama
    weights = read_state_dict(src)
    for a, b in ((1, 3), (2, 4)):  # layers that share a slot: a stale read would change the output
        assert not torch.equal(dequantize(weights[f"model.layers.{a}.self_attn.q_proj.weight"]),
                               dequantize(weights[f"model.layers.{b}.self_attn.q_proj.weight"]))
    for result in run_ranks(_race_rank, 2, src, out, timeout=800):
        assert result == {"eager": True, "compiled": [True, True, True], "forwards": 4}


def _copies_rank(rank, world_size, src, out):
    from shardprep.errors import RuntimeShardError
    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind
    from shardprep.runtime.gatherer import LayerGatherer

    model = _exact_model(src)
    shards = open_rank(out, rank, world_size=world_size)
    bind(model, shards, LayerGatherer(shards))
    x = torch.zeros(2, 64)
    try:
        with torch.inference_mode():
            torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    except RuntimeShardError as exc:
        return str(exc)
    return "no error"


def test_a_compiled_graph_that_copies_the_weights_is_refused_in_one_line(llama):
    src, out = llama
    for message in run_ranks(_copies_rank, 2, src, out, timeout=600):
        assert message.startswith("model.layers.1.self_attn.q_proj.weight: the compiled graph passed a copy"), message
        assert "\n" not in message
