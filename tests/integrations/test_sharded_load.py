"""The shared load flows (integrations/sharded_load.py, drafts.py, load_check.py, output_weights.py) against a server
that is not installed: `fake_server.FakeServer`, a `ServerAdapter` over a transformers model.

What every server's sharded mode does, proved once here: refusals in the server's own option names, the flow's
order (refusals before anything is read), the binding giving the source's logits, no silent weights whatever
`load_weights` reports, and the seam's own rules (shared modules name no server; no signature past 8 parameters; a
model loader asks its server only through its adapter's `ServerAdapter` methods, which hold their logic).
The servers' adapters run inside vLLM and SGLang in tests/vllm_engines/ and tests/sglang_engines/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict
from support.fake_server import FakeServer, give_load_weights
from torch import nn

from shardprep.errors import ManifestError, RuntimeShardError, ShardprepError
from shardprep.integrations import drafts
from shardprep.integrations.drafts import DraftLoad, hand_to_draft, target_for
from shardprep.integrations.load_check import check_all_loaded, tracked_loading
from shardprep.integrations.load_options import ShardprepLoadOptions
from shardprep.integrations.output_weights import load_full, output_weights
from shardprep.integrations.server import ServerAdapter, WorkerLayout
from shardprep.integrations.sglang.adapter import SglangAdapter
from shardprep.integrations.sharded_load import ShardedLoad, check_layout
from shardprep.integrations.vllm.adapter import VllmAdapter
from shardprep.manifests import load_manifest

ROOT = Path(__file__).resolve().parents[2]
SHARDED = ShardprepLoadOptions(shard_weights=True)


def layout(**changes) -> WorkerLayout:
    base = dict(dp_rank=0, dp_size=2, dp_world_ranks=(0, 1), tp_size=1, pp_size=1, lockstep_dp=True, eager=True,
                device=torch.device("cpu"), platform="cpu")
    return WorkerLayout(**{**base, **changes})


@pytest.fixture(scope="module")
def llama_out(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama")
    return src, conversion_cache(src, 2, preset="llama")


@pytest.fixture(scope="module")
def llama_one(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("llama")
    return src, conversion_cache(src, 1, preset="llama")


def llama(src: Path) -> nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src),
                                                         dtype=torch.bfloat16)


def test_sharded_mode_refuses_layouts_it_cannot_serve(llama_out):
    _, out = llama_out
    manifest, spelling = load_manifest(out), VllmAdapter.spelling
    check_layout(layout(), spelling, manifest, out)
    with pytest.raises(ShardprepError, match="converted for 2 ranks, but vLLM runs data_parallel_size=1"):
        check_layout(layout(dp_size=1, dp_world_ranks=(0,)), spelling, manifest, out)
    check_layout(layout(eager=False), spelling, manifest, out)  # compiled serving: the gathers are ops the graph calls
    with pytest.raises(ShardprepError, match="tensor_parallel_size and pipeline_parallel_size must be 1, got 2 and 1"):
        check_layout(layout(tp_size=2), spelling, manifest, out)
    with pytest.raises(ShardprepError, match="needs a MoE model"):
        check_layout(layout(lockstep_dp=False), spelling, manifest, out)


def test_sharded_modes_refusals_name_sglangs_options_under_sglang(llama_out):
    _, out = llama_out
    manifest, spelling = load_manifest(out), SglangAdapter.spelling
    with pytest.raises(ShardprepError, match=re.escape(
            "attention TP (tp_size / dp_size under enable_dp_attention) and pp_size must be 1, got 2 and 1; use "
            "tp_size = dp_size = 2 (or a multiple) with enable_dp_attention, or full mode")):
        check_layout(layout(tp_size=2), spelling, manifest, out)
    with pytest.raises(ShardprepError, match=re.escape("but SGLang runs dp_size=1 (")):
        check_layout(layout(dp_size=1, dp_world_ranks=(0,)), spelling, manifest, out)
    with pytest.raises(ShardprepError, match=re.escape("shard_weights needs DP attention (enable_dp_attention)")):
        check_layout(layout(lockstep_dp=False), spelling, manifest, out)


def test_a_third_servers_refusals_name_its_own_options(llama_out):
    _, out = llama_out
    with pytest.raises(ShardprepError, match=re.escape("but FakeServer runs dp=1 (")):
        check_layout(layout(dp_size=1, dp_world_ranks=(0,)), FakeServer.spelling, load_manifest(out), out)


def test_sharded_mode_refuses_a_model_whose_layers_it_cannot_find(llama_one, world_of_one):
    _, out = llama_one
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    with pytest.raises(RuntimeShardError, match="no ModuleList named like 'model.layers'"):
        ShardedLoad(FakeServer(), out, SHARDED).load(model)


def test_the_flow_asks_about_every_target_before_reading_anything(llama_one, world_of_one):
    src, out = llama_one
    model = llama(src)
    model.load_weights = lambda weights: pytest.fail("loaded weights after the refusal")
    asked = {}

    class Refused(ShardprepError):
        pass

    def refuse(model, targets, directory):
        asked.update(targets)
        raise Refused("refused")

    server = FakeServer(refuse=refuse)
    with pytest.raises(Refused):
        ShardedLoad(server, out, SHARDED).load(model)
    assert not server.kept_plain  # nothing kept before the refusal
    # transformers' Llama has no fused qkv_proj: every entry is bound to its own parameter.
    assert set(asked) == {e.name for r in load_manifest(out).layers for e in r.entries}
    params = dict(model.named_parameters())
    assert all(asked[name] is params[name] for name in asked)


@pytest.mark.parametrize("report", [True, False], ids=["load_weights-reports", "load_weights-returns-none"])
def test_the_flow_binds_a_model_that_gives_the_sources_logits(llama_one, world_of_one, report, caplog):
    src, out = llama_one
    reference = llama(src)
    reference.load_state_dict(read_state_dict(src))
    model = llama(src)
    give_load_weights(model, report=report)
    server = FakeServer()
    with caplog.at_level("INFO", logger=server.log.name):
        binding = ShardedLoad(server, out, SHARDED).load(model)
    targets = {e.name for r in load_manifest(out).layers for e in r.entries}
    assert set(binding.target_parameters) == targets
    assert {id(m) for m in server.kept_plain} == {id(m) for name, m in model.named_modules()
                                                  if f"{name}.weight" in targets}
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    assert torch.equal(model(ids).logits, reference(ids).logits)
    line = [r.getMessage() for r in caplog.records if "serves" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith(f"shardprep: DP rank 0 of 1 serves {out} sharded: 2 layers bound")


def test_a_parameter_nobody_loaded_is_refused_even_when_load_weights_reports_nothing(llama_one, world_of_one):
    """Today's failure (a draft whose load_weights returns None and whose weights were neither loaded nor bound)
    refused: the check sees which parameters a weight loader was called with."""
    src, out = llama_one
    model = llama(src)
    give_load_weights(model, report=False, skip=lambda name: name == "model.norm.weight")
    with pytest.raises(ShardprepError, match=re.escape(
            "the model's parameter 'model.norm.weight' is in no tensor of the output (its load_weights reports "
            "nothing: no weight loader was called for it)")):
        ShardedLoad(FakeServer(), out, SHARDED).load(model)


def test_full_mode_refuses_a_parameter_nobody_loaded_whatever_load_weights_reports(llama_one):
    src, out = llama_one
    for report in (True, False):
        model = llama(src)
        give_load_weights(model, report=report)
        load_full(model, out, True, FakeServer())  # every tensor loaded: passes
        give_load_weights(model, report=report, skip=lambda name: name.endswith("layers.1.self_attn.o_proj.weight"))
        with pytest.raises(ShardprepError, match="parameter 'model.layers.1.self_attn.o_proj.weight' is in no tensor"):
            load_full(model, out, True, FakeServer())


def test_tracking_restores_each_parameters_own_loader_and_compares_equal_to_it():
    layer = nn.Linear(2, 2)

    def own(param, tensor):
        param.data.copy_(tensor)

    layer.weight.weight_loader = own
    with tracked_loading(layer, lambda p, t: None) as seen:
        assert layer.weight.weight_loader == own  # a model testing `weight_loader == x` sees its own
        layer.bias.weight_loader(layer.bias, torch.zeros(2))
    assert seen == {id(layer.bias)}
    assert layer.weight.weight_loader is own and not hasattr(layer.bias, "weight_loader")
    check_all_loaded(layer, None, "out/", also={"weight"}, seen=seen)
    with pytest.raises(ShardprepError, match="'weight'"):
        check_all_loaded(layer, None, "out/", seen=seen)


def test_tracking_watches_a_loader_behind_a_read_only_property_and_puts_it_back():
    # SGLang's quantized parameters (BasevLLMParameter) expose `weight_loader` as a property over `_weight_loader`.
    class PropertyParameter(nn.Parameter):
        @property
        def weight_loader(self):
            return self._weight_loader

    def own(param, tensor):
        param.data.copy_(tensor)

    layer = nn.Linear(2, 2)
    layer.weight = PropertyParameter(torch.ones(2, 2))
    layer.weight._weight_loader = own
    with tracked_loading(layer, lambda p, t: None) as seen:
        layer.weight.weight_loader(layer.weight, torch.zeros(2, 2))
    assert seen == {id(layer.weight)} and torch.equal(layer.weight, torch.zeros(2, 2))
    assert layer.weight.weight_loader is own


def test_a_target_is_handed_to_its_draft_under_a_deployment_object_even_one_without_weak_references():
    class Referable:
        pass

    weak, strong = Referable(), object()  # object(): no weak references, as SGLang's ServerArgs (a msgspec Struct)
    target, other = object.__new__(ShardedLoad), object.__new__(ShardedLoad)
    hand_to_draft(weak, target)
    hand_to_draft(strong, other)
    assert target_for(weak) is target and target_for(strong) is other and target_for(object()) is None
    weak_id = id(weak)
    del weak  # the hand-over goes with a deployment that can go
    assert weak_id not in drafts._targets and target_for(strong) is other


class TextModel(nn.Module):
    """A language model that copies one weight in place (no weight loader) and reports what it loaded."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(2, 2, bias=False), nn.LayerNorm(2, elementwise_affine=False)

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            self.proj.weight.data.copy_(tensor)  # as SGLang's Kimi K3 fills fused_qkv_a_proj_with_mqa
            loaded.add(name)
        return loaded


class Wrapper(nn.Module):
    """A multimodal wrapper that hands its language model the weights and drops its answer."""

    def __init__(self):
        super().__init__()
        self.language_model, self.vision = TextModel(), nn.Linear(2, 2, bias=False)

    def load_weights(self, weights):
        self.vision.weight.weight_loader(self.vision.weight, torch.zeros(2, 2))
        self.language_model.load_weights((name.removeprefix("language_model."), t) for name, t in weights)


def test_what_an_inner_model_reports_loading_counts_when_its_wrapper_reports_nothing():
    model = Wrapper()
    with tracked_loading(model, lambda p, t: p.data.copy_(t)) as seen:
        loaded = model.load_weights([("language_model.proj.weight", torch.ones(2, 2))])
    check_all_loaded(model, loaded, "out/", seen=seen)
    assert "load_weights" not in model.language_model.__dict__  # put back as it was
    with tracked_loading(model, lambda p, t: p.data.copy_(t)) as seen:
        loaded = model.load_weights([])  # the language model loaded nothing
    with pytest.raises(ShardprepError, match="'language_model.proj.weight'"):
        check_all_loaded(model, loaded, "out/", seen=seen)
    text = TextModel()
    text.alias = text.proj.weight  # one parameter, two names: loaded under either
    check_all_loaded(text, {"proj.weight", "norm.weight"}, "out/")
    with pytest.raises(ShardprepError, match="'alias'"):  # the name torch lists it by: the module's own first
        check_all_loaded(text, {"norm.weight"}, "out/")
    with tracked_loading(text, lambda p, t: p.data.copy_(t)) as seen:
        text.load_weights([("proj.weight", torch.ones(2, 2))])  # the caller drops the answer (SGLang's loader does)
    check_all_loaded(text, None, "out/", seen=seen)


def test_options_default_to_verified_full_mode_and_refuse_unknown_keys():
    assert ShardprepLoadOptions.from_extra_config({}) == ShardprepLoadOptions(verify=True, shard_weights=False)
    assert ShardprepLoadOptions.from_extra_config({"verify": False}).verify is False
    with pytest.raises(ShardprepError, match="unknown key 'shard_weight'"):
        ShardprepLoadOptions.from_extra_config({"shard_weight": True})
    with pytest.raises(ShardprepError, match="'shard_weights' must be true or false"):
        ShardprepLoadOptions.from_extra_config({"shard_weights": "yes"})

def test_full_mode_hands_the_server_every_source_tensor_once(llama_out):
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


SHARED = [p for p in (ROOT / "shardprep" / "integrations").glob("*.py")]


def _code_strings(tree: ast.AST) -> list[str]:
    """Every string constant of the module that is not a docstring."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


@pytest.mark.parametrize("path", SHARED, ids=lambda p: p.name)
def test_shared_integration_modules_name_no_server_in_code_or_messages(path):
    tree = ast.parse(path.read_text())
    named = [s for s in _code_strings(tree) if re.search(r"vllm|sglang", s, re.I)]
    assert not named, f"{path.name} names a server outside its docstrings: {named[:3]}"
    imports = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imports += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imports if re.match(r"(vllm|sglang)\b", m) or m in (".vllm", ".sglang")], imports


def test_no_integration_function_takes_more_than_eight_parameters():
    widest = []
    for path in (ROOT / "shardprep" / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                count -= bool(a.args) and a.args[0].arg in ("self", "cls")
                widest.append((count, f"{path.name}:{node.name}"))
    assert max(widest)[0] <= 8, sorted(widest)[-3:]


def test_a_draft_load_finds_its_targets_load_under_the_servers_deployment_object(llama_out):
    src, out = llama_out

    class Deployment:  # as vLLM's speculative config: one object that both loads see
        pass

    deployment = Deployment()
    server = FakeServer(deployment=deployment)
    assert not server.loads_draft() and server.runs_a_draft()
    target = ShardedLoad(server, out, SHARDED, with_draft=server.serves_mtp_draft(str(out)))
    hand_to_draft(server.deployment(), target)  # what a loader does once its target is loaded
    draft_server = FakeServer(draft=True, deployment=deployment)
    assert draft_server.loads_draft()
    draft_server.refuse_published_draft(str(out), sharded=True)  # a convert output passes
    with pytest.raises(ShardprepError, match="is not an output of `shardprep convert`"):
        draft_server.refuse_published_draft(str(src), sharded=True)
    assert DraftLoad(draft_server, out, SHARDED, draft_server.deployment()).target is target
    assert DraftLoad(FakeServer(draft=True), out, SHARDED, Deployment()).target is None


LOADERS = {"vllm": "VllmAdapter", "sglang": "SglangAdapter"}


@pytest.mark.parametrize("server", sorted(LOADERS))
def test_a_model_loader_imports_nothing_of_its_adapter_module_but_the_adapter(server):
    tree = ast.parse((ROOT / "shardprep" / "integrations" / server / "model_loader.py").read_text())
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1]
    from_adapter = [a.name for n in relative if n.module == "adapter" for a in n.names]
    modules = [a.name for n in relative if n.module is None for a in n.names]
    assert from_adapter == [LOADERS[server]] and "adapter" not in modules, (from_adapter, modules)


@pytest.mark.parametrize("adapter", [VllmAdapter, SglangAdapter, FakeServer], ids=lambda a: a.__name__)
def test_every_public_method_of_an_adapter_answers_a_question_of_the_seam(adapter):
    own = [name for name, value in vars(adapter).items() if callable(value) and not name.startswith("_")]
    assert own, "no methods found: the check would pass vacuously"
    outside = [name for name in own if not hasattr(ServerAdapter, name)]
    assert not outside, f"{adapter.__name__} answers {outside} outside ServerAdapter"


@pytest.mark.parametrize("server", sorted(LOADERS))
def test_an_adapters_methods_hold_their_logic_instead_of_forwarding_to_module_functions(server):
    tree = ast.parse((ROOT / "shardprep" / "integrations" / server / "adapter.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    adapter = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == LOADERS[server])
    forwards = []
    for method in (n for n in adapter.body if isinstance(n, ast.FunctionDef)):
        body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in functions:
            forwards.append(f"{method.name} -> {call.func.id}")
    assert not forwards, forwards
    assert not functions & {n.name for n in adapter.body if isinstance(n, ast.FunctionDef)}
