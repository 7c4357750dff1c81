"""Module binding: a model's target parameters bound, once and for good, to the gatherer's views.

Every target parameter is pointed at its view when the model is bound: layer ℓ's weights always live
at the same addresses (its slot's, or its own zero-copy view's), and only their bytes change, gathered
while nothing reads them. Each bound decoder layer gets a forward pre-hook that calls
`shardprep::layer_begin` and a forward hook that calls `shardprep::layer_end` (runtime/layer_ops.py):
eagerly, `wait(ℓ)` (which dispatches ℓ+1's gather) and `done(ℓ)`. The first decoder layer's pre-hook
also begins the forward, so the first gather overlaps the replicated layers in front of the first
bound one. Because the hooks only call ops, `torch.compile` (and vLLM's compiled decode) traces them
without a graph break, and CUDA graphs capture fixed weight addresses.

Outside its layer's forward a target parameter reads whatever its slot holds at that moment (another
layer's weights once the slot is reused): only the layer itself may read it.

A draft model's layers (`manifest.draft`) are gathered with the target's, last, so the target's last layer's wait
dispatches the draft's first gather: it hides behind that layer. `bind_draft` binds them to the draft model's
modules. A draft of one layer (DeepSeek's MTP layer, EAGLE-3's midlayer) runs several passes per step on the same
weights, so the first pass waits for the gather and every later pass reads the slot as it is; the slot is released
when the next target forward begins. A draft of several layers (DFlash) runs each once per step, in order, and
walks its gathers as the target's layers do (a layer's slot is released when it ends); it cannot run twice in a
step, since its slots are refilled as it goes. The ranks' collective sequence is the target's forward, whatever the
draft does (idle ranks, rejected proposals): the draft's first gather is issued with the target's last layer, and a
draft that does not run in a step leaves its later gathers unissued on every rank alike, as the server runs its
drafts in lockstep across DP ranks (vLLM does: an idle rank runs a dummy draft pass).

When the target's forward is captured in a CUDA graph, the draft's first gather is not captured with it
(gatherer.py, "The draft's first gather"): call `binding.prefetch_draft()` right after the target's forward (its
capture), and `binding.prefetch_draft(replayed=True)` right after every replay of that graph, on every rank; the
draft's first pass waits for it, or gathers inline if none was issued. A later pass captured in a graph of its
own waits for it again in that graph.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._version import __version__
from ..errors import RuntimeShardError, ShardprepError
from ..manifests.draft_layers import ONE_PASS_KINDS, layer_mismatch, mtp_layers
from ..manifests.dtypes import torch_dtype
from ..manifests.manifest import LayerRecord, Manifest
from ..manifests.strict_json import read_json_file
from . import layer_ops

if TYPE_CHECKING:
    from ..loader.rank_shards import RankShards
    from .gatherer import LayerGatherer

LayerModules = str | Sequence[nn.Module] | Mapping[int, nn.Module]


@dataclass
class BoundLayer:
    """One manifest layer bound to its module: which parameter each gathered view backs."""

    index: int
    position: int
    module: nn.Module
    params: list[tuple[nn.Parameter, str]]

    @property
    def weights(self) -> list[torch.Tensor]:
        """The bound parameters, in binding order (what the layer ops declare they write)."""
        return [param for param, _ in self.params]

    def point(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Every bound parameter's data becomes its tensor in `weights` (a view), no copy.

        >>> layer.point(gatherer.views(layer.index))  # doctest: +SKIP
        """
        for param, name in self.params:
            param.data = weights[name]


class Binding:
    """A model whose target parameters live in the gatherer's slots, gathered layer by layer.

    Made by `bind`; `remove()` takes the hooks off (the targets keep pointing at the slots).

    >>> binding = bind(model, open_rank("out/", rank))  # doctest: +SKIP
    >>> logits = binding.model(input_ids).logits  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, shards: RankShards, gatherer: LayerGatherer, layers: list[BoundLayer],
                 first: nn.Module | None = None):
        self.model = model
        self.shards = shards
        self.gatherer = gatherer
        self.layers = layers
        self.draft_layers: list[BoundLayer] = []  # bound by bind_draft, to the draft model's modules
        self._draft_waited: set[int] = set()  # draft layers waited for since the last target forward
        self.forward_count = 0
        # Where the current forward is: the position (in gatherer order) of the next bound layer, and whether
        # begin() was issued for it. A forward ends when the last bound layer is done.
        self._position = 0
        self._begun = False
        # Written by both ops, so a compiler keeps them in program order (layer_ops.py).
        self.order = torch.zeros(1, dtype=torch.int32, device=shards.device)
        self.handle = layer_ops.register(self)
        for layer in layers:
            layer.point(gatherer.views(layer.index))
        self._handles: list[Any] = []
        self._begins_before_first_layer = False
        if first is not None and first is not layers[0].module:  # an unbound layer in front: it begins
            self._begins_before_first_layer = True
            self._handles.append(first.register_forward_pre_hook(
                _begin_hook(self, layers[0].weights, layer_ops.BEGIN_ONLY), with_kwargs=True))
        for layer in layers:
            self._handles.append(layer.module.register_forward_pre_hook(
                _begin_hook(self, layer.weights, layer.position), with_kwargs=True))
            self._handles.append(layer.module.register_forward_hook(_end_hook(self, layer.weights, layer.position)))

    @property
    def target_parameters(self) -> dict[str, nn.Parameter]:
        """Manifest name → the parameter it binds to (fused view names included), the target model's layers."""
        return {name: p for layer in self.layers for p, name in layer.params}

    @property
    def draft_parameters(self) -> dict[str, nn.Parameter]:
        """Manifest name → the draft model's parameter it binds to (empty before `bind_draft`)."""
        return {name: p for layer in self.draft_layers for p, name in layer.params}

    def add_draft(self, layers: list[BoundLayer]) -> None:
        """Point the draft model's layers at their views and hook them (see `bind_draft`)."""
        for layer in layers:
            layer.point(self.gatherer.views(layer.index))
            self._handles.append(layer.module.register_forward_pre_hook(
                _begin_hook(self, layer.weights, layer.position), with_kwargs=True))
            self._handles.append(layer.module.register_forward_hook(_end_hook(self, layer.weights, layer.position)))
        self.draft_layers.extend(layers)

    def rehome(self, shards: RankShards, gatherer: LayerGatherer) -> None:
        """Move the bound layers onto `gatherer` over `shards`, which gathers the same layers at the same positions
        and may gather more after them (sharded mode adds a quantized draft's processed layer so, once the draft
        model exists). The hooks, the ops' handle and positions, and so `compile_key`, stay; call it before any
        forward, since the old gatherer's slots are let go.

        >>> binding.rehome(RankShards(manifest, rank, buffer), LayerGatherer(...))  # doctest: +SKIP
        """
        if tuple(gatherer.layers[:len(self.layers)]) != tuple(layer.index for layer in self.layers):
            raise RuntimeShardError(f"the new gatherer gathers layers {list(gatherer.layers)}, not the bound "
                                    f"layers {[layer.index for layer in self.layers]} first")
        self.shards, self.gatherer = shards, gatherer
        for layer in [*self.layers, *self.draft_layers]:
            layer.point(gatherer.views(layer.index))

    def compile_key(self) -> str:
        """A digest of what a compiled graph of the bound model bakes in: the ops' constants (the handle, each
        bound layer's position, layer 0's begin-only op) and which parameters each op declares it writes.

        A compile cache keyed by model and config alone (vLLM's) would otherwise hand a sharded model a graph
        traced without the ops (a full-mode run of the same directory: weights never gathered), or with
        another binding's. Two bindings with equal keys trace the same graph.

        >>> vllm_config.additional_config["shardprep"] = binding.compile_key()  # doctest: +SKIP
        """
        shape = [__version__, self.handle, self._begins_before_first_layer,
                 [(layer.index, layer.position, [name for _, name in layer.params]) for layer in self.layers]]
        return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]

    def prefetch_draft(self, replayed: bool = False) -> None:
        """Issue the draft's first gather now, off the target's CUDA graph (`LayerGatherer.prefetch_draft`).

        `replayed=True`: the target's captured forward was just replayed (its hooks did not run), so this binding's
        step restarts where that forward ends: the draft's next pass is its first.

        >>> target_graph.replay(); binding.prefetch_draft(replayed=True)  # doctest: +SKIP
        """
        if replayed:
            self._position, self._begun = 0, False
            self._draft_waited.clear()  # the replay's gathers refilled the draft's slot: its first pass waits again
        self.gatherer.prefetch_draft(replayed)

    def idle_step(self) -> None:
        """Take part in one forward's gathers without computing (a rank with no work this step).

        >>> binding.idle_step()  # doctest: +SKIP
        """
        self._position, self._begun = 0, False  # like begin(), it abandons a forward that stopped midway
        self._release_draft()
        self.gatherer.idle_step()

    def remove(self) -> None:
        """Remove the hooks. The targets keep pointing at the slots, whose bytes change with every gather."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        layer_ops.unregister(self.handle)

    # -- what the ops run (eagerly, or between the pieces of a compiled graph) ------------------------
    def layer_begin(self, position: int, weights: list[torch.Tensor] | None = None) -> None:
        """layer_begin(position): begin the forward if this is its first op, then wait for the layer's gather.

        `weights`: what a compiled graph handed the op as the layer's weights (checked to be the bound ones).
        """
        if position == layer_ops.BEGIN_ONLY:
            self._begin()
            return
        if weights is not None:
            self._check_addresses(position, weights)
        if position >= len(self.layers):
            self._draft_begin(self.draft_layers[position - len(self.layers)])
            return
        # A forward that stopped midway (an exception inside a layer) is abandoned here: the gatherer lets
        # the gathers already issued complete and starts again at the first layer, as every rank must.
        if position == 0 and not (self._begun and self._position == 0):
            self._begin()
        if position != self._position:
            raise RuntimeShardError(self._out_of_order(self.layers[position]))
        self.gatherer.wait(self.layers[position].index)

    def layer_end(self, position: int, weights: list[torch.Tensor] | None = None) -> None:
        """layer_end(position): the layer's compute is issued, its slot may be gathered into again."""
        if weights is not None:
            self._check_addresses(position, weights)
        if position >= len(self.layers):
            if len(self.draft_layers) > 1:  # a draft of several layers walks its slots as the target does
                self.gatherer.done(self.draft_layers[position - len(self.layers)].index)
            return  # one draft layer's slot stays valid through its later passes; the next target forward releases it
        self.gatherer.done(self.layers[position].index)
        self._position = position + 1
        if self._position == len(self.layers):
            self._position, self._begun = 0, False

    def _check_addresses(self, position: int, weights: list[torch.Tensor]) -> None:
        # A compiler that does not run the ops in place (AOTAutograd's functionalization without Inductor's
        # reinplacing, e.g. backend="aot_eager") hands them copies taken before the gather, and the layer
        # would then read those stale copies: refuse instead of computing with the wrong weights.
        layer = self.layers[position] if position < len(self.layers) else self.draft_layers[position - len(self.layers)]
        for w, (param, name) in zip(weights, layer.params):
            if w.data_ptr() != param.data_ptr():
                raise RuntimeShardError(
                    f"{name}: the compiled graph passed a copy of this weight to shardprep::layer_begin/layer_end, "
                    "so the layer would read bytes gathered for another layer; compile with backend='inductor' "
                    "(which runs the ops in place) or without AOTAutograd (backend='eager'), or use vLLM's "
                    "piecewise compilation"
                )

    def _draft_begin(self, layer: BoundLayer) -> None:
        if layer.index in self._draft_waited:
            if len(self.draft_layers) > 1:
                raise RuntimeShardError(f"draft layer {layer.index} ran twice in one step; a draft of several layers "
                                        "runs once per target forward (its slots are refilled as it goes)")
            # A later pass of the draft in this step: the same weights, still in their slot. Eagerly nothing to do; a
            # pass captured in a graph of its own waits for them in that graph.
            self.gatherer.wait_again(layer.index)
            return
        if self._begun:
            raise RuntimeShardError(f"draft layer {layer.index} ran inside the target model's forward; the draft's "
                                    "layers are gathered after the target's last layer")
        self.gatherer.wait(layer.index)  # dispatched during the target's last layer
        self._draft_waited.add(layer.index)

    def _release_draft(self) -> None:
        # The draft's passes of the last step are over: its slot may be gathered into again.
        for index in sorted(self._draft_waited):
            self.gatherer.done(index)
        self._draft_waited.clear()

    def _begin(self) -> None:
        self._release_draft()
        self.gatherer.begin()
        self._position, self._begun = 0, True
        self.forward_count += 1

    def _out_of_order(self, layer: BoundLayer) -> str:
        expected = self.layers[self._position].index
        return (f"layer {layer.index} ran while layer {expected} was expected next; bound layers must run once "
                "per forward, in manifest order, because every rank gathers them in that order")


def _begin_hook(binding: Binding, weights: list[torch.Tensor], position: int) -> Callable[..., None]:
    handle, order = binding.handle, binding.order

    # `_owner` keeps the binding alive as long as the model holds the hook (the op registry is weak).
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], _owner: Binding = binding) -> None:
        if not torch.compiler.is_compiling():  # eager: the op's body, without the dispatcher's cost
            _owner.layer_begin(position)
            return
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        inputs += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        torch.ops.shardprep.layer_begin(inputs, weights, order, handle, position)

    return hook


def _end_hook(binding: Binding, weights: list[torch.Tensor], position: int) -> Callable[..., None]:
    handle, order = binding.handle, binding.order

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any, _owner: Binding = binding) -> None:
        if not torch.compiler.is_compiling():
            _owner.layer_end(position)
            return
        outputs = [output] if isinstance(output, torch.Tensor) else [
            o for o in (output if isinstance(output, (tuple, list)) else ()) if isinstance(o, torch.Tensor)]
        torch.ops.shardprep.layer_end(outputs, weights, order, handle, position)

    return hook


def bind(
    model: nn.Module,
    shards: RankShards,
    gatherer: LayerGatherer | None = None,
    layers: LayerModules | None = None,
    model_name: Callable[[str], str] | None = None,
) -> Binding:
    """Hook `model` so that every manifest layer runs on the weights gathered for it.

    `layers` says where the layer modules are: None finds the ModuleList named like the manifest's
    entries (`model.layers` for `model.layers.3.self_attn.q_proj.weight`), a dotted path names it,
    and a sequence or {index: module} mapping gives the modules directly. A fused view
    (`qkv_proj`, `gate_up_proj`) binds to a fused parameter when the model has one, else its members
    bind one by one. Every target parameter is pointed at its view now, for good; the storage the model
    had allocated for it is released. The first decoder layer begins each forward. `model_name` gives the
    model's name for a manifest (checkpoint) tensor name where the two differ (transformers renames some
    checkpoint keys as it loads them: `hf_model.checkpoint_renaming`); None: the same names.

    >>> shards = open_rank("out/", rank=dist.get_rank())  # doctest: +SKIP
    >>> binding = bind(model, shards)  # doctest: +SKIP
    >>> model.generate(input_ids, max_new_tokens=8)  # doctest: +SKIP
    """
    if gatherer is None:
        from .gatherer import LayerGatherer

        gatherer = LayerGatherer(shards)
    manifest: Manifest = shards.manifest
    renamed = model_name or _same_name
    drafted = set(manifest.draft.layers) if manifest.draft else set()
    order = [index for index in gatherer.layers if index not in drafted]  # the draft's come last (format.md)
    modules, first = _layer_modules(model, manifest, layers, renamed, order, shards.directory)
    bound = [_bind_layer(manifest.layer(index), position, modules[index], renamed)
             for position, index in enumerate(order)]
    _check_not_shared(model, bound)
    for layer in bound:
        for param, _ in layer.params:
            param.requires_grad_(False)
    return Binding(model, shards, gatherer, bound, first)


def bind_draft(binding: Binding, modules: Mapping[int, nn.Module],
               model_name: Callable[[str], str] | None = None) -> list[BoundLayer]:
    """Bind the draft's layers (`manifest.draft`) to the draft model's modules {layer index: module}, gathered by
    `binding`'s gatherer after the target's layers (the binding of the target model, over the whole manifest).

    The draft layer's pre-hook waits for its gather on the draft's first pass of a step and does nothing on the
    later ones; its slot is released when the target's next forward begins. One draft layer at most: with two
    slots a second one would be gathered into the first one's slot while later passes still read it.

    >>> bind_draft(target_binding, {61: mtp_model.model.layers["61"].mtp_block})  # doctest: +SKIP
    """
    bound = draft_layers(binding.shards.manifest, binding.gatherer.layers, modules, model_name)
    binding.add_draft(bound)
    return bound


def draft_layers(manifest: Manifest, gathered: Sequence[int], modules: Mapping[int, nn.Module],
                 model_name: Callable[[str], str] | None = None) -> list[BoundLayer]:
    """The draft's layers matched to the draft model's modules and checked, neither pointed at views nor hooked:
    what `bind_draft` binds, and what sharded mode processes first when the draft is quantized. `gathered`: the
    layers in gather order (the gatherer's `layers`), the draft's last.

    >>> layers = draft_layers(shards.manifest, gatherer.layers, {61: mtp_block})  # doctest: +SKIP
    """
    drafted = list(manifest.draft.layers) if manifest.draft else []
    if not drafted or any(i not in gathered for i in drafted):
        raise RuntimeShardError("the target's binding gathers no draft layer; open the rank file with the "
                                "draft's layers (open_rank(..., draft=True)) and bind the target over them")
    if len(drafted) > 1 and manifest.draft is not None and manifest.draft.kind not in ONE_PASS_KINDS:
        raise RuntimeShardError(f"{len(drafted)} draft layers ({drafted}): a draft that runs a pass per proposed token "
                                "has one layer at most when sharded (with two slots, a second layer would overwrite "
                                "the first's while later passes read it); serve the draft in full mode")
    missing = [i for i in drafted if i not in modules]
    if missing:
        raise RuntimeShardError(f"the draft model has no module for draft layer {missing[0]}")
    renamed = model_name or _same_name
    bound = [_bind_layer(manifest.layer(i), list(gathered).index(i), modules[i], renamed) for i in drafted]
    for layer in bound:
        for param, _ in layer.params:
            param.requires_grad_(False)
    return bound


def _same_name(name: str) -> str:
    return name


def _layer_modules(model: nn.Module, manifest: Manifest, layers: LayerModules | None,
                   renamed: Callable[[str], str], indices: list[int],
                   directory: Path | None = None) -> tuple[dict[int, nn.Module], nn.Module]:
    """{manifest layer index: its module} for `indices`, and the model's first decoder layer (the one that begins
    a forward)."""
    if isinstance(layers, Mapping):
        missing = [i for i in indices if i not in layers]
        if missing:
            raise RuntimeShardError(f"layers= has no module for manifest layer {missing[0]}")
        return {i: layers[i] for i in indices}, layers[min(layers)]
    found: Any = (_find_layer_list(model, manifest, layers, renamed) if layers is None or isinstance(layers, str)
                  else layers)
    try:
        return {i: found[i] for i in indices}, found[0]
    except IndexError:
        raise RuntimeShardError(layer_mismatch(len(found), indices, _config_mtp_layers(directory))) from None


def _config_mtp_layers(directory: Path | None) -> tuple[int, ...]:
    """config.json's MTP layers in the shards' directory, for the refusal's words only (() if unreadable)."""
    try:
        return mtp_layers(read_json_file(Path(directory) / "config.json", max_bytes=16 << 20, what="config.json",
                                         allow_duplicate_keys=True)) if directory is not None else ()
    except ShardprepError:
        return ()


def _find_layer_list(model: nn.Module, manifest: Manifest, path: str | None,
                     renamed: Callable[[str], str]) -> nn.Module:
    named = dict(model.named_modules())
    if path is not None:
        if path not in named:
            raise RuntimeShardError(f"layers={path!r}: the model has no submodule of that name")
        return named[path]
    first = manifest.layers[0]
    prefix = split_layer_name(renamed(first.entries[0].name), first.layer)[0]
    # The model's module names may lack (or add) the checkpoint's leading prefix, e.g. `bert.` when
    # a BertForMaskedLM checkpoint is loaded into a BertModel.
    candidates = [n for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.Sequential))
                  and (n == prefix or prefix.endswith("." + n) or n.endswith("." + prefix))]
    candidates.sort(key=lambda n: (n != prefix, abs(len(n) - len(prefix))))
    if not candidates:
        raise RuntimeShardError(
            f"the model has no ModuleList named like {prefix!r} (from {first.entries[0].name!r}); "
            "pass layers= (a dotted path, a list of modules, or {index: module})"
        )
    return named[candidates[0]]


def split_layer_name(name: str, layer: int) -> tuple[str, str]:
    """A manifest tensor name split around its layer index: the layer list's name and the name inside the layer.

    >>> split_layer_name("model.layers.3.self_attn.q_proj.weight", 3)
    ('model.layers', 'self_attn.q_proj.weight')
    """
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if k > 0 and part == str(layer):
            return ".".join(parts[:k]), ".".join(parts[k + 1:])
    raise RuntimeShardError(f"tensor {name!r} of layer {layer} has no `.{layer}.` component in its name")


def _bind_layer(record: LayerRecord, position: int, module: nn.Module, renamed: Callable[[str], str]) -> BoundLayer:
    params: list[tuple[nn.Parameter, str]] = []
    covered: set[str] = set()
    for view in record.views:
        param = _parameter(module, record, renamed(view.name))
        if param is not None:
            _check_param(param, view.name, view.dtype, view.shape)
            params.append((param, view.name))
            covered.update(view.members)
    for entry in record.entries:
        param = _parameter(module, record, renamed(entry.name))
        if param is None:
            if entry.name in covered:
                continue
            as_named = "" if renamed(entry.name) == entry.name else f" (the model's name: {renamed(entry.name)!r})"
            raise RuntimeShardError(
                f"tensor {entry.name!r}{as_named} has no parameter in the model's layer {record.layer} "
                f"({type(module).__name__}); was DIR converted from this architecture?"
            )
        _check_param(param, entry.name, entry.dtype, entry.shape)
        params.append((param, entry.name))
    return BoundLayer(record.layer, position, module, params)


def _parameter(module: nn.Module, record: LayerRecord, name: str) -> nn.Parameter | None:
    rest = split_layer_name(name, record.layer)[1]
    try:
        return module.get_parameter(rest)
    except AttributeError:
        return None


def _check_param(param: nn.Parameter, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    if tuple(param.shape) != tuple(shape):
        raise RuntimeShardError(
            f"tensor {name!r} is {list(shape)} in the manifest but the model's parameter is {list(param.shape)}; "
            "was DIR converted from this model's config?"
        )
    if param.dtype != torch_dtype(dtype, tensor=name):
        raise RuntimeShardError(
            f"tensor {name!r} is {dtype} in the manifest but the model's parameter is {param.dtype}; "
            f"build the model in {torch_dtype(dtype)} (from_pretrained(..., dtype='auto'))"
        )


def _check_not_shared(model: nn.Module, bound: list[BoundLayer]) -> None:
    # A target tied to a parameter outside its layer would read whatever its slot holds (another layer's
    # weights) whenever that other user runs.
    module_names = {id(m): n for n, m in model.named_modules()}
    owner = {id(p): layer for layer in bound for p, _ in layer.params}
    for name, p in model.named_parameters(remove_duplicate=False):
        layer = owner.get(id(p))
        prefix = module_names.get(id(layer.module)) if layer else None
        if layer is not None and prefix is not None and not name.startswith(prefix + "."):
            raise RuntimeShardError(
                f"a target of layer {layer.index} is tied to {name!r}, outside that layer; tied weights "
                "cannot be sharded, leave them out of the targets"
            )
