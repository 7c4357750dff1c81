"""Module binding in one process (a gloo world of one rank): which parameter each view replaces, and when.

Several ranks, idle steps and the memory formula are covered end to end by test_run.py.
"""

import gc

import pytest
import torch
import torch.distributed as dist
from support.checkpoints import read_state_dict
from support.spawn_group import free_port
from torch import nn

from shardprep.errors import RuntimeShardError
from shardprep.loader.rank_shards import open_rank
from shardprep.prep.convert import convert
from shardprep.runtime.binding import bind
from shardprep.runtime.gatherer import LayerGatherer
from shardprep.standalone.hf_model import build_model


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    # Free the tests' gatherers (they hold the group) now rather than at interpreter exit, where
    # destroying gloo objects can race with their threads (see shardprep/cli/run.py).
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


@pytest.fixture(scope="module")
def llama_dir(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama")
    return src, conversion_cache(src, 1, preset="llama")


def reference(src):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(src).eval()


def slot_ranges(binding):
    return [(s.memory.data_ptr(), s.memory.data_ptr() + s.memory.numel()) for s in binding.gatherer._slots]


def test_bound_model_matches_transformers_and_its_targets_live_in_the_slots(world_of_one, llama_dir):
    src, out = llama_dir
    binding = build_model(out, "cpu")
    model = binding.model
    targets = binding.target_parameters
    assert sorted(targets) == sorted(e.name for r in binding.shards.manifest.layers for e in r.entries)
    # Bound once, for good: layer 1 (position 0) lives in slot 0, layer 2 in slot 1; the model owns no target bytes.
    slots = slot_ranges(binding)
    for name, p in targets.items():
        position = 0 if ".layers.1." in name else 1
        start, end = slots[position]
        assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end, name
    addresses = {name: p.data_ptr() for name, p in targets.items()}

    inside = {}

    def record(module, args):
        q = module.self_attn.q_proj.weight
        inside[module] = (q.data_ptr(), q.clone())

    handles = [model.model.layers[i].register_forward_pre_hook(record) for i in (1, 2)]
    ids = torch.tensor([[1, 5, 7, 9, 33, 40]])
    with torch.no_grad():
        got = model(ids).logits
        want = reference(src)(ids).logits
    for h in handles:
        h.remove()
    assert torch.equal(got, want)

    # Inside its layer's forward, q_proj holds the source's bytes, at the address it was bound to.
    original = read_state_dict(src)
    for i in (1, 2):
        ptr, value = inside[model.model.layers[i]]
        assert ptr == addresses[f"model.layers.{i}.self_attn.q_proj.weight"]
        assert torch.equal(value, original[f"model.layers.{i}.self_attn.q_proj.weight"])
    assert {name: p.data_ptr() for name, p in targets.items()} == addresses  # no per-forward swaps
    assert binding.forward_count == 1


def test_fused_view_binds_to_a_fused_parameter(world_of_one, llama_dir):
    src, out = llama_dir
    shards = open_rank(out, 0, device="cpu")
    original = read_state_dict(src)

    class Attention(nn.Module):  # the vLLM / SGLang shape: one qkv_proj instead of q, k, v
        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
            self.o_proj = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()

        def forward(self, seen):
            seen.append(self.self_attn.qkv_proj.weight.clone())
            return seen

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(3))

        def forward(self, seen):
            for layer in self.layers:
                layer(seen)
            return seen

    model = Model()
    binding = bind(model, shards, LayerGatherer(shards))
    assert sorted(binding.target_parameters) == [f"model.layers.{i}.self_attn.{n}.weight"
                                                 for i in (1, 2) for n in ("o_proj", "qkv_proj")]
    seen = model([])
    for i in (1, 2):
        fused = torch.cat([original[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(seen[i], fused)
    assert torch.equal(seen[0], model.layers[0].self_attn.qkv_proj.weight)  # layer 0 is not a target
    start, end = slot_ranges(binding)[0]
    assert start <= model.layers[1].self_attn.qkv_proj.weight.data_ptr() < end  # bound to slot 0 for good


def test_layers_run_out_of_order_are_refused(world_of_one, llama_dir):
    _, out = llama_dir
    model = build_model(out, "cpu").model
    hidden = torch.zeros(1, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeShardError, match="layer 2 ran while layer 1 was expected"):
        model.model.layers[2](hidden)  # the check runs in the pre-hook, before the layer's own forward


def test_bind_names_the_tensor_it_cannot_place(world_of_one, llama_dir):
    src, out = llama_dir
    shards = open_rank(out, 0, device="cpu")
    gatherer = LayerGatherer(shards)
    with pytest.raises(RuntimeShardError, match=r"model.layers.1.self_attn.(qkv|q)_proj.weight.* torch.float32"):
        bind(reference(src).float(), shards, gatherer)
    model = reference(src)
    del model.model.layers[1].self_attn.o_proj
    with pytest.raises(RuntimeShardError, match="'model.layers.1.self_attn.o_proj.weight' has no parameter"):
        bind(model, shards, gatherer)
    model = reference(src)
    model.model.layers[0].self_attn.o_proj.weight = model.model.layers[1].self_attn.o_proj.weight
    with pytest.raises(RuntimeShardError, match="tied to 'model.layers.0.self_attn.o_proj.weight'"):
        bind(model, shards, gatherer)


def test_a_forward_that_raises_inside_a_layer_is_abandoned(world_of_one, llama_dir):
    src, out = llama_dir
    binding = build_model(out, "cpu")
    model = binding.model
    attention = model.model.layers[1].self_attn

    def fail(module, args):
        raise ValueError("boom")

    handle = attention.register_forward_pre_hook(fail)
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad(), pytest.raises(ValueError, match="boom"):
        model(ids)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(src)(ids).logits)
    assert binding.forward_count == 2


def test_every_other_layer_sharded_matches_transformers(world_of_one, checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", layers=5)
    out = tmp_path / "odd-layers"
    convert(src, out, 1, preset="llama", layers="1-:2")
    binding = build_model(out, "cpu")
    assert [layer.index for layer in binding.layers] == [1, 3]
    ids = torch.tensor([[1, 5, 7, 9, 33, 40]])
    with torch.no_grad():
        got = [binding.model(ids).logits for _ in range(2)]
        want = reference(src)(ids).logits
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    start, end = slot_ranges(binding)[1]
    assert start <= binding.model.model.layers[3].self_attn.q_proj.weight.data_ptr() < end  # sharded: slot 1
    original = read_state_dict(src)["model.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(binding.model.model.layers[2].self_attn.q_proj.weight, original)  # replicated: its own


def test_the_compile_key_tells_apart_bindings_that_trace_different_graphs(world_of_one, checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", layers=5)
    every, odd = tmp_path / "every", tmp_path / "odd"
    convert(src, every, 1, preset="llama")
    convert(src, odd, 1, preset="llama", layers="1-:2")
    keys = {}
    for name, out in [("every", every), ("every-again", every), ("odd", odd)]:
        binding = build_model(out, "cpu")
        handle = binding.handle
        keys[name, "own handle"] = binding.compile_key()
        # A fresh server process numbers its one binding 1: compare the bindings as two such processes would.
        binding.handle = 1
        keys[name] = binding.compile_key()
        binding.handle = handle
        binding.remove()
    assert keys["every"] == keys["every-again"]  # the same graph: a cached one may be reused
    assert keys["every"] != keys["odd"]  # layers 1 and 3 only: other ops, other weights declared written
    assert keys["every", "own handle"] != keys["every-again", "own handle"]  # another handle is baked in


def test_targets_bind_through_transformers_renamings_and_a_merged_key_is_refused_naming_both_names(
        world_of_one, checkpoint_cache, tmp_path):
    src = checkpoint_cache("kimi-linear", layers=4)
    out, stacked = tmp_path / "preset", tmp_path / "stacked"
    convert(src, out, 1, preset="kimi-linear")
    binding = build_model(out, "cpu")
    by_name = dict(binding.model.named_parameters())
    targets = binding.target_parameters
    # transformers loads the checkpoint's block_sparse_moe.* as mlp.*, and f_a_proj inside forget_gate
    assert targets["model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"] is by_name[
        "model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert targets["model.layers.1.self_attn.f_a_proj.weight"] is by_name[
        "model.layers.1.self_attn.forget_gate.f_a_proj.weight"]
    binding.remove()
    convert(src, stacked, 1, targets=["*.experts.*.w1.weight"])  # transformers merges these into one tensor
    refusal = (r"tensor 'model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight' "
               r"\(the model's name: 'model\.layers\.1\.mlp\.experts\.0\.w1\.weight'\) has no parameter")
    with pytest.raises(RuntimeShardError, match=refusal):
        build_model(stacked, "cpu")


def test_rehome_moves_the_bound_layers_onto_a_new_gatherer_keeping_the_hooks_and_the_compile_key(world_of_one,
                                                                                                  llama_dir):
    """What sharded mode does once a processed draft's layer joins the target's: the same layers, new slots."""
    src, out = llama_dir
    binding = build_model(out, "cpu")
    key, ids = binding.compile_key(), torch.tensor([[1, 5, 7, 9, 33, 40]])
    old = set(slot_ranges(binding))
    shards = open_rank(out, 0)
    binding.rehome(shards, LayerGatherer(shards))
    assert binding.compile_key() == key
    slots = slot_ranges(binding)
    assert not old & set(slots)  # really new slots: the comparison below could fail
    for name, p in binding.target_parameters.items():
        start, end = slots[0 if ".layers.1." in name else 1]
        assert start <= p.data_ptr() < end, name
    with torch.no_grad():
        assert torch.equal(binding.model(ids).logits, reference(src)(ids).logits)
    assert binding.forward_count == 1  # the hooks stayed: the forward gathered through them
    first = [binding.layers[0].index]  # a gatherer of fewer layers than the binding's is refused
    with pytest.raises(RuntimeShardError, match="not the bound layers"):
        binding.rehome(shards, _Layers(first))
    binding.remove()


class _Layers:
    """A gatherer's layer table, no more (what rehome checks first)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
