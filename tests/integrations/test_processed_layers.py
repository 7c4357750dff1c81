"""Processing quantized targets once at load (integrations/processed_layers.py), in the parts that need no
vLLM: a transformers Llama bound to its rank files, whose o_proj stand in for quantized modules.
Their "processing" rewrites the bytes the forward reads (the weight negated, a sign parameter added that the
forward multiplies back), as a server's repacking step rewrites a weight that its kernel undoes. Bound to the
processed layout at N=2, the model's logits equal the source checkpoint's bit for bit, which they could not if
the gathered bytes were the unprocessed ones. Processed forms that a gathered view cannot feed are refused naming
the module, and `VllmAdapter.process_quantized` makes vLLM's later pass skip only the module it processed.

The real processing (vLLM's FP8 and 4-bit kernels) runs in tests/vllm_engines/test_vllm_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.spawn_group import run_ranks
from torch import nn

from shardprep.errors import ShardprepError
from shardprep.integrations.processed_layers import PlaceholderGatherer, needs_processing, process_layers
from shardprep.integrations.vllm.adapter import VllmAdapter
from shardprep.loader.rank_shards import open_rank
from shardprep.prep.convert import convert
from shardprep.runtime.binding import bind
from shardprep.standalone.hf_model import build_model

PROMPT = [[1, 5, 9, 2, 7, 3]]


def quantized(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and hasattr(module, "stand_in")


def placeholder_bound(out, rank: int = 0, world_size: int = 1):
    """A transformers model of `out` with its replicated weights loaded and its targets bound to placeholders over
    this rank's unread shards, as vLLM's sharded mode has it before processing. Every o_proj and down_proj becomes
    'quantized' (processed at load where the preset binds it)."""
    loaded = build_model(out, "cpu")
    loaded.remove()
    shards = open_rank(out, rank, world_size=world_size)
    binding = bind(loaded.model, shards, PlaceholderGatherer(shards))
    for name, module in binding.model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.stand_in = True
    return binding


def negate(module: nn.Module) -> None:
    """A processing step: the weight's bytes rewritten (as a new parameter, as vLLM's replace_parameter does)."""
    module.weight = nn.Parameter(-module.weight.detach(), requires_grad=False)
    module.sign = nn.Parameter(torch.tensor([-1.0], dtype=module.weight.dtype), requires_grad=False)
    module.forward = lambda x, m=module: F.linear(x, m.weight * m.sign)


def _bound_logits(rank: int, world_size: int, out: str) -> dict:
    binding = placeholder_bound(out, rank, world_size)
    assert not binding.shards.loaded
    assert needs_processing(binding, quantized)
    processed = process_layers(binding, None, quantized, negate)
    new = processed.binding
    with torch.no_grad():
        logits = new.model(torch.tensor(PROMPT)).logits
    o_proj = new.model.model.layers[1].self_attn.o_proj
    return {"logits": logits.float().tolist(), "modules": processed.modules, "sign": float(o_proj.sign),
            "entries": [e.name for e in new.shards.manifest.layer(1).entries],
            "never_read_whole": not binding.shards.loaded}  # each layer's chunk read alone


@pytest.fixture(scope="module")
def llama_n2(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama")
    return src, conversion_cache(src, 2, preset="llama")


@pytest.fixture(scope="module")
def llama_n1(checkpoint_cache, conversion_cache):
    return conversion_cache(checkpoint_cache("llama"), 1, preset="llama")


def test_a_model_bound_to_processed_layers_gives_the_sources_logits_bit_for_bit(llama_n2):
    import transformers

    src, out = llama_n2
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor(PROMPT)).logits
    results = run_ranks(_bound_logits, 2, str(out), timeout=300)
    for got in results:
        assert got["logits"] == expected.float().tolist()
        assert got["sign"] == -1.0  # the processed form ran: its parameter was gathered, not left at its hole
        # The llama preset shards layers 1.. (attention only): their o_proj are the processed modules.
        assert got["modules"] == ("model.layers.1.self_attn.o_proj", "model.layers.2.self_attn.o_proj")
        # The processed layout holds the processed modules' every parameter and the others' bound ones.
        assert "model.layers.1.self_attn.o_proj.sign" in got["entries"]
        assert "model.layers.1.self_attn.q_proj.weight" in got["entries"]
        assert got["never_read_whole"]


def test_without_a_quantized_module_nothing_is_processed(llama_n1, world_of_one):
    out = llama_n1
    assert not needs_processing(build_model(out, "cpu"), quantized)  # no module marked


def _refused(out, step) -> str:
    binding = placeholder_bound(out)
    with pytest.raises(ShardprepError) as caught:
        process_layers(binding, None, quantized, step)
    assert "\n" not in str(caught.value)
    return str(caught.value)


class Handle:
    """What a oneDNN-style kernel keeps: an object that holds the weight's address."""

    def __init__(self, weight: torch.Tensor):
        self.address = weight.data_ptr()


def weight_into_handle(module: nn.Module) -> None:
    module.handle = Handle(module.weight)
    module.weight = None


def tensor_as_attribute(module: nn.Module) -> None:
    module.packed = module.weight.detach().clone()


def handle_beside_weight(module: nn.Module) -> None:
    module.handle = Handle(module.weight)


def expanded(module: nn.Module) -> None:
    module.weight = nn.Parameter(module.weight.detach()[:1].expand(module.weight.shape), requires_grad=False)


def viewed_twice(module: nn.Module) -> None:
    module.weight_t = nn.Parameter(module.weight.detach().t(), requires_grad=False)


@pytest.mark.parametrize("step, says", [
    (weight_into_handle, "left model.layers.1.self_attn.o_proj.weight None"),
    (tensor_as_attribute, "keeps model.layers.1.self_attn.o_proj.packed (Tensor) outside the module's registered"),
    (handle_beside_weight, "keeps model.layers.1.self_attn.o_proj.handle (Handle) outside the module's registered"),
    (expanded, "left model.layers.1.self_attn.o_proj.weight with its elements overlap (stride 0 over 64 elements) "
               "(shape [64, 64], stride [0, 1])"),
])
def test_a_processed_form_a_gathered_view_cannot_feed_is_refused_naming_the_module(llama_n1, world_of_one, step,
                                                                                   says):
    error = _refused(llama_n1, step)
    assert error.startswith("shard_weights: Linear.process_weights_after_loading "), error
    assert says in error, error
    assert error.endswith("serve this directory in full mode"), error


def test_processed_tensors_that_share_memory_are_refused_naming_both(llama_n1, world_of_one):
    error = _refused(llama_n1, viewed_twice)
    assert error == ("shard_weights: after processing, model.layers.1.self_attn.o_proj.weight and "
                     "model.layers.1.self_attn.o_proj.weight_t share memory (views of one storage), which separate "
                     "gathered copies would not; serve this directory in full mode"), error


def mn_major(t: torch.Tensor) -> torch.Tensor:
    """`t` [N, K] laid out as DeepGEMM's SM100 scales are: MN-major, columns align(N, 4) + 4 elements apart (a gap
    in every column, so that its storage span has holes), same values."""
    n, k = t.shape
    return torch.empty_strided((n, k), (1, n + 4), dtype=t.dtype).copy_(t)


def into_strided(module: nn.Module) -> None:
    """A processing step that leaves strided tensors, as DeepGEMM's on SM100: the weight MN-major with gaps, and a
    [N, 1] scale whose size-1 dimension has stride N + 4 (contiguous to torch, not to the kernel). The forward
    asserts both layouts, as DeepGEMM asserts the scale's."""
    n = module.weight.shape[0]
    module.weight = nn.Parameter(mn_major(module.weight.detach()), requires_grad=False)
    module.scale = nn.Parameter(mn_major(torch.ones(n, 1, dtype=module.weight.dtype)), requires_grad=False)

    def forward(x: torch.Tensor, m: nn.Module = module) -> torch.Tensor:
        assert m.weight.stride() == (1, n + 4) and m.scale.stride() == (1, n + 4), (m.weight.stride(), m.scale.stride())
        return F.linear(x, m.weight * m.scale)

    module.forward = forward


def _strided_logits(rank: int, world_size: int, out: str) -> dict:
    binding = placeholder_bound(out, rank, world_size)
    new = process_layers(binding, None, quantized, into_strided).binding
    with torch.no_grad():
        logits = new.model(torch.tensor(PROMPT)).logits
    o_proj = new.model.model.layers[1].self_attn.o_proj
    return {"logits": logits.float().tolist(), "strides": [o_proj.weight.stride(), o_proj.scale.stride()],
            "in_slot": o_proj.weight.untyped_storage().data_ptr() != 0 and o_proj.weight.data_ptr()
            == new.gatherer.views(1)["model.layers.1.self_attn.o_proj.weight"].data_ptr()}


def test_strided_processed_tensors_are_gathered_by_their_span_and_keep_their_strides(llama_n2):
    import transformers

    src, out = llama_n2
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor(PROMPT)).logits
    for got in run_ranks(_strided_logits, 2, str(out), timeout=300):
        assert got["logits"] == expected.float().tolist()  # the forward's stride asserts held, the values too
        assert got["strides"] == [(1, 68), (1, 68)]
        assert got["in_slot"]


def test_a_parameter_a_module_holds_under_a_second_name_is_laid_out_once_and_both_names_follow_it(llama_n1,
                                                                                                  world_of_one):
    # SGLang's Kimi K3 keeps f_b_proj's weight as its attention's `_bfa_f_b_w` too (a Parameter assigned to a module
    # attribute is registered there): one object under two names, not two tensors that share memory.
    binding = placeholder_bound(llama_n1)
    for name, module in binding.model.named_modules():
        if name.endswith("self_attn"):
            module.q_alias = module.q_proj.weight
    new = process_layers(binding, None, quantized, negate).binding
    attention = new.model.model.layers[1].self_attn
    names = [e.name for e in new.shards.manifest.layer(1).entries]
    assert "model.layers.1.self_attn.q_proj.weight" in names and not any("q_alias" in n for n in names), names
    assert attention.q_alias is attention.q_proj.weight
    view = new.gatherer.views(1)["model.layers.1.self_attn.q_proj.weight"]
    assert attention.q_proj.weight.data_ptr() == view.data_ptr()


class Method:
    """A quant method as vLLM holds one: an object on the module, shared here by two modules."""

    def __init__(self):
        self.ran: list[nn.Module] = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.ran.append(layer)


def test_process_quantized_runs_vllms_step_each_time_and_makes_vllms_pass_skip_only_that_module():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    a.quant_method = b.quant_method = method = Method()
    VllmAdapter().process_quantized(a)
    VllmAdapter().process_quantized(a)  # sharded mode's second pass
    assert method.ran == [a, a]
    for module in (a, b):  # what vLLM's own pass does after loading
        module.quant_method.process_weights_after_loading(module)
    assert method.ran == [a, a, b]


class Kernel:
    """A kernel object a quant method holds, as vLLM's hold theirs, owning a module without weights (DeepGEMM's
    kernel owns a QuantFP8, which quantizes the activations)."""

    def __init__(self):
        self.quant_fp8 = nn.Module()


class QuantMethod:
    def __init__(self):
        self.kernel = Kernel()


def point_at_its_kernel(module: nn.Module) -> None:
    # DeepGEMM sets layer.deep_gemm_warmup_provider = the kernel itself, on SM90 and SM100.
    module.warmup_provider = module.method.kernel
    negate(module)


def test_a_processed_module_may_point_at_an_object_it_held_already(llama_n1, world_of_one):
    binding = placeholder_bound(llama_n1)
    for name, module in binding.model.named_modules():
        if name.endswith("o_proj"):
            module.method = QuantMethod()  # the kernel two attributes deep, as vLLM's quant_method holds it
    assert len(process_layers(binding, None, quantized, point_at_its_kernel).modules) == 2


def new_module_as_attribute(module: nn.Module) -> None:
    module.helper = Kernel()  # a new object, owning a new module
    negate(module)


def test_a_new_object_owning_a_module_is_still_refused(llama_n1, world_of_one):
    error = _refused(llama_n1, new_module_as_attribute)
    assert "keeps model.layers.1.self_attn.o_proj.helper (Kernel) outside" in error, error


def test_a_step_that_gives_other_bytes_the_second_time_is_refused(llama_n1, world_of_one):
    calls = []

    def drifting(module: nn.Module) -> None:
        calls.append(module)
        module.weight = nn.Parameter(module.weight.detach() + len(calls), requires_grad=False)

    error = _refused(llama_n1, drifting)
    assert error == ("shard_weights: processing layer 1 again gave other bytes (the server's processing is not "
                     "deterministic there); serve this directory in full mode"), error


def _with_processed_draft(rank: int, world_size: int, out: str) -> dict:
    """Layers 1..2 of a 4-layer Llama processed as the target's, layer 3 as a draft's (DeepSeek's MTP layer stands
    there in vLLM): bound to placeholders, processed only after the target's binding exists, then gathered after the
    target's layers by the target's gatherer. The model's forward runs the draft's layer after the target's last."""
    import dataclasses

    from shardprep.integrations.processed_layers import process_draft_layers
    from shardprep.manifests.draft_layers import DraftLayers
    from shardprep.manifests.manifest import load_manifest
    from shardprep.runtime.binding import draft_layers

    loaded = build_model(out, "cpu")
    loaded.remove()
    manifest = dataclasses.replace(load_manifest(out), draft=DraftLayers("mtp", (3,)))
    shards = open_rank(out, rank, world_size=world_size, manifest=manifest)
    binding = bind(loaded.model, shards, PlaceholderGatherer(shards))
    for name, module in binding.model.named_modules():
        if name.endswith(("o_proj", "down_proj")):
            module.stand_in = True
    target = process_layers(binding, None, quantized, negate)
    key = target.binding.compile_key()
    placeholders = PlaceholderGatherer(shards)
    layers = draft_layers(shards.manifest, placeholders.layers, {3: binding.model.model.layers[3]})
    for layer in layers:
        layer.point(placeholders.views(layer.index))
    draft = process_draft_layers(target, shards, None, layers, quantized, negate)
    new = draft.binding
    with torch.no_grad():
        logits = new.model(torch.tensor(PROMPT)).logits
    return {"logits": logits.float().tolist(), "modules": draft.modules, "same_binding": new is target.binding,
            "same_key": new.compile_key() == key, "gathered": list(new.gatherer.layers),
            "sign": float(new.model.model.layers[3].self_attn.o_proj.sign),
            "held": draft.rank_file_bytes == manifest.layer(3).chunk_bytes}


def test_a_draft_layer_processed_after_the_target_is_gathered_after_it_and_gives_the_sources_logits(
        checkpoint_cache, tmp_path_factory):
    import transformers

    src = checkpoint_cache("llama", layers=4)
    out = tmp_path_factory.mktemp("processed-draft") / "out"
    convert(src, out, 2, preset="llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor(PROMPT)).logits
    for got in run_ranks(_with_processed_draft, 2, str(out), timeout=300):
        assert got["logits"] == expected.float().tolist()
        assert got["sign"] == -1.0  # the draft's processed form was gathered
        assert got["modules"] == ("model.layers.3.self_attn.o_proj",)
        assert got["gathered"] == [1, 2, 3]
        assert got["same_binding"] and got["same_key"] and got["held"]



def _draft_model_beside_processed(rank: int, world_size: int, out: str, src: str, drafted: tuple[int, ...],
                                  rename: bool) -> dict:
    """A draft model from its own rank file (DFlash's kind: each layer gathered once per step) beside a target
    processed at load: the Llama's layer 2 o_proj processed into strided tensors (the target), the Llama's own rank
    file recorded as a DFlash draft of layers `drafted` (the draft's; its tensors named `draft.layers.*` with
    `rename`, as a draft's own checkpoint names them apart from the target's), bound to a second Llama loaded whole
    from `src`. The target's forward runs first (its last layer dispatches the draft's first gather), then the
    draft's."""
    import dataclasses

    import transformers

    from shardprep.integrations.drafts import join_draft_model, renumbered_names
    from shardprep.manifests.draft_layers import DraftLayers, DraftTarget
    from shardprep.manifests.manifest import load_manifest
    from shardprep.runtime.binding import bind_draft

    binding = placeholder_bound(out, rank, world_size)
    for name, module in binding.model.named_modules():
        if hasattr(module, "stand_in") and name != "model.layers.2.self_attn.o_proj":
            del module.stand_in
    target = process_layers(binding, None, quantized, into_strided)
    processed = target.binding.shards
    manifest = load_manifest(out)
    as_draft = dataclasses.replace(manifest, draft=DraftLayers("dflash", drafted, DraftTarget(64, 128)))
    if rename:  # as a draft's own checkpoint names its layers (DFlash's `layers.0...`): apart from the target's
        def draft_name(name: str) -> str:
            return name.replace("model.layers.", "draft.layers.", 1)

        as_draft = dataclasses.replace(as_draft, layers=tuple(dataclasses.replace(
            r, entries=tuple(dataclasses.replace(e, name=draft_name(e.name)) for e in r.entries),
            views=tuple(dataclasses.replace(v, name=draft_name(v.name), members=tuple(map(draft_name, v.members)))
                        for v in r.views)) for r in manifest.layers))
    own = open_rank(out, rank, world_size=world_size, manifest=as_draft)
    try:
        offset = join_draft_model(target.binding, own, target)
    except ShardprepError as e:
        return {"error": str(e)}
    draft_model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    bound = bind_draft(target.binding, {i + offset: draft_model.model.layers[i] for i in drafted},
                       renumbered_names(as_draft, offset))
    new = target.binding
    with torch.no_grad():
        logits = new.model(torch.tensor(PROMPT)).logits  # the processed o_proj's stride asserts run here
        draft_logits = draft_model(torch.tensor(PROMPT)).logits
    joined = new.shards
    return {"logits": logits.float().tolist(), "draft_logits": draft_logits.float().tolist(), "offset": offset,
            "gathered": list(new.gatherer.layers), "bound": [layer.index for layer in bound],
            "target_kept": bool(torch.equal(joined.buffer[:processed.nbytes], processed.buffer)),
            "draft_held": [joined.chunk(i + offset).numel() for i in drafted] == [own.chunk(i).numel()
                                                                                 for i in drafted],
            "draft_bytes": all(torch.equal(joined.chunk(i + offset), own.chunk(i)) for i in drafted)}


def test_a_draft_model_joins_a_processed_target_its_own_bytes_after_the_processed_ones(llama_n2):
    """What sharded mode does with a DFlash or EAGLE-3 draft beside a quantized target (drafts.join_draft_model):
    both models give the source's logits bit for bit, the target's from its processed, strided layout (its views
    rebuilt with their strides over the joined buffer, or its forward's stride assert fails), the draft's from its
    own unprocessed chunks, which follow the target's processed ones in one buffer."""
    import transformers

    src, out = llama_n2
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference(torch.tensor(PROMPT)).logits.float().tolist()
    for got in run_ranks(_draft_model_beside_processed, 2, str(out), str(src), (1, 2), True, timeout=300):
        assert got.get("logits") == expected, got.get("error")
        assert got["draft_logits"] == expected
        assert got["offset"] == 3 and got["gathered"] == [1, 2, 4, 5] and got["bound"] == [4, 5]
        assert got["target_kept"] and got["draft_held"] and got["draft_bytes"]


def test_a_draft_tensor_named_as_a_strided_processed_target_tensor_is_refused_naming_it(llama_n2):
    src, out = llama_n2
    for got in run_ranks(_draft_model_beside_processed, 2, str(out), str(src), (1, 2), False, timeout=300):
        assert got["error"] == (
            "model.layers.2.self_attn.o_proj.weight: a tensor of the draft model and a strided tensor of the "
            "processed target have this one name, so the draft's would be seen with the target's strides; serve "
            "the draft apart (draft_load_config with the server's own load format)"), got
