"""Module binding: point a model's target parameters at the gatherer's slot views while their layer runs.

Each bound layer gets a forward pre-hook (`wait(ℓ)`, which also dispatches ℓ+1's gather, then the
parameters are pointed at the views) and a forward hook (parameters back to placeholders, `done(ℓ)`).
Outside its layer's forward a target parameter is a placeholder: a zero-stride expansion of one NaN
element, so it has the right shape, dtype and device but owns no memory, and anything that reads it
outside the layer gets NaN instead of another layer's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import RuntimeShardError
from ..manifests.dtypes import torch_dtype
from ..manifests.manifest import LayerRecord, Manifest

if TYPE_CHECKING:
    from ..loader.rank_shards import RankShards
    from .gatherer import LayerGatherer

LayerModules = str | Sequence[nn.Module] | Mapping[int, nn.Module]


@dataclass
class BoundLayer:
    """One manifest layer bound to its module: which parameter each gathered view replaces."""

    index: int
    position: int
    module: nn.Module
    params: list[tuple[nn.Parameter, str]]
    placeholders: list[torch.Tensor] = field(default_factory=list)

    def point(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Every bound parameter's data becomes its tensor in `weights` (a gathered view), no copy.

        >>> layer.point(gatherer.wait(layer.index))  # doctest: +SKIP
        """
        for param, name in self.params:
            param.data = weights[name]

    def restore(self) -> None:
        """Every bound parameter back to its placeholder (no storage).

        >>> layer.restore()  # doctest: +SKIP
        """
        for (param, _), placeholder in zip(self.params, self.placeholders):
            param.data = placeholder


class Binding:
    """A model whose target parameters live in the gatherer's slots, one layer at a time.

    Made by `bind`; `remove()` takes the hooks off (the targets stay placeholders).

    >>> binding = bind(model, open_rank("out/", rank))  # doctest: +SKIP
    >>> logits = binding.model(input_ids).logits  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, shards: RankShards, gatherer: LayerGatherer, layers: list[BoundLayer]):
        self.model = model
        self.shards = shards
        self.gatherer = gatherer
        self.layers = layers
        self.forward_count = 0
        # Where the current forward is: the position (in gatherer order) of the next layer to run, and
        # whether begin() was issued for it. A forward ends when the last bound layer is done.
        self._position = 0
        self._begun = False
        self._inside: BoundLayer | None = None  # the layer whose views the parameters point at now
        self._handles = [model.register_forward_pre_hook(self._on_model_forward)]
        for layer in layers:
            self._handles.append(layer.module.register_forward_pre_hook(partial(self._enter, layer)))
            self._handles.append(layer.module.register_forward_hook(partial(self._exit, layer), always_call=True))

    @property
    def target_parameters(self) -> dict[str, nn.Parameter]:
        """Manifest name → the parameter it binds to (fused view names included)."""
        return {name: p for layer in self.layers for p, name in layer.params}

    def idle_step(self) -> None:
        """Take part in one forward's gathers without computing (a rank with no work this step).

        >>> binding.idle_step()  # doctest: +SKIP
        """
        self._position, self._begun = 0, False  # like begin(), it abandons a forward that stopped midway
        self.gatherer.idle_step()

    def remove(self) -> None:
        """Remove the hooks. Target parameters stay placeholders (their bytes live only in the shards)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _begin(self) -> None:
        self.gatherer.begin()
        self._begun = True
        self.forward_count += 1

    def _on_model_forward(self, module: nn.Module, args: Any) -> None:
        # Issuing the first gather here, not in the first layer's hook, lets it overlap the embedding
        # and the replicated layers in front of the first bound one.
        if self._begun and self._position == 0:
            return
        # A forward that stopped midway (an exception inside a layer) is abandoned: the gatherer lets
        # the gathers already issued complete and starts again at the first layer, as every rank must.
        self._position = 0
        self._begin()

    def _enter(self, layer: BoundLayer, module: nn.Module, args: Any) -> None:
        if layer.position != self._position:
            raise RuntimeShardError(self._out_of_order(layer))
        if not self._begun:  # the layers were called without the bound model's forward
            self._begin()
        layer.point(self.gatherer.wait(layer.index))
        self._inside = layer

    def _exit(self, layer: BoundLayer, module: nn.Module, args: Any, output: Any) -> None:
        if self._inside is not layer:  # _enter raised (always_call runs this hook anyway): nothing to undo
            return
        self._inside = None
        layer.restore()  # before done(): after done() the slot may be overwritten by a later gather
        self.gatherer.done(layer.index)
        self._position += 1
        if self._position == len(self.layers):
            self._position = 0
            self._begun = False

    def _out_of_order(self, layer: BoundLayer) -> str:
        expected = self.layers[self._position].index
        return (f"layer {layer.index} ran while layer {expected} was expected next; bound layers must run once "
                "per forward, in manifest order, because every rank gathers them in that order")


def bind(
    model: nn.Module,
    shards: RankShards,
    gatherer: LayerGatherer | None = None,
    layers: LayerModules | None = None,
) -> Binding:
    """Hook `model` so that every manifest layer runs on the weights gathered for it.

    `layers` says where the layer modules are: None finds the ModuleList named like the manifest's
    entries (`model.layers` for `model.layers.3.self_attn.q_proj.weight`), a dotted path names it,
    and a sequence or {index: module} mapping gives the modules directly. A fused view
    (`qkv_proj`, `gate_up_proj`) binds to a fused parameter when the model has one, else its members
    bind one by one. The targets' own storage is released: they become placeholders that own no memory.

    >>> shards = open_rank("out/", rank=dist.get_rank())  # doctest: +SKIP
    >>> binding = bind(model, shards)  # doctest: +SKIP
    >>> model.generate(input_ids, max_new_tokens=8)  # doctest: +SKIP
    """
    if gatherer is None:
        from .gatherer import LayerGatherer

        gatherer = LayerGatherer(shards)
    manifest: Manifest = shards.manifest
    modules = _layer_modules(model, manifest, layers)
    order = list(gatherer.layers)
    bound = [_bind_layer(manifest.layer(index), position, modules[index]) for position, index in enumerate(order)]
    _check_not_shared(model, bound)
    # Placeholders live where the views will, so moving the model (`.to(device)`) leaves them alone.
    holes: dict[torch.dtype, torch.Tensor] = {}
    for layer in bound:
        for param, _ in layer.params:
            hole = holes.get(param.dtype)
            if hole is None:
                fill = float("nan") if param.dtype.is_floating_point else 0
                hole = holes[param.dtype] = torch.full((1,), fill, dtype=param.dtype, device=shards.device)
            placeholder = hole.expand(param.shape)
            layer.placeholders.append(placeholder)
            param.requires_grad_(False)
            param.data = placeholder
    return Binding(model, shards, gatherer, bound)


def _layer_modules(model: nn.Module, manifest: Manifest, layers: LayerModules | None) -> dict[int, nn.Module]:
    indices = [r.layer for r in manifest.layers]
    if isinstance(layers, Mapping):
        missing = [i for i in indices if i not in layers]
        if missing:
            raise RuntimeShardError(f"layers= has no module for manifest layer {missing[0]}")
        return {i: layers[i] for i in indices}
    found: Any = _find_layer_list(model, manifest, layers) if layers is None or isinstance(layers, str) else layers
    try:
        return {i: found[i] for i in indices}
    except IndexError:
        raise RuntimeShardError(
            f"the model has {len(found)} layers but the manifest has layer {max(indices)}; "
            "was DIR converted from this model?"
        ) from None


def _find_layer_list(model: nn.Module, manifest: Manifest, path: str | None) -> nn.Module:
    named = dict(model.named_modules())
    if path is not None:
        if path not in named:
            raise RuntimeShardError(f"layers={path!r}: the model has no submodule of that name")
        return named[path]
    first = manifest.layers[0]
    prefix = _split_name(first.entries[0].name, first.layer)[0]
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


def _split_name(name: str, layer: int) -> tuple[str, str]:
    """`model.layers.3.self_attn.q_proj.weight`, 3 → (`model.layers`, `self_attn.q_proj.weight`)."""
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if k > 0 and part == str(layer):
            return ".".join(parts[:k]), ".".join(parts[k + 1:])
    raise RuntimeShardError(f"tensor {name!r} of layer {layer} has no `.{layer}.` component in its name")


def _bind_layer(record: LayerRecord, position: int, module: nn.Module) -> BoundLayer:
    params: list[tuple[nn.Parameter, str]] = []
    covered: set[str] = set()
    for view in record.views:
        param = _parameter(module, record, view.name)
        if param is not None:
            _check_param(param, view.name, view.dtype, view.shape)
            params.append((param, view.name))
            covered.update(view.members)
    for entry in record.entries:
        param = _parameter(module, record, entry.name)
        if param is None:
            if entry.name in covered:
                continue
            raise RuntimeShardError(
                f"tensor {entry.name!r} has no parameter in the model's layer {record.layer} "
                f"({type(module).__name__}); was DIR converted from this architecture?"
            )
        _check_param(param, entry.name, entry.dtype, entry.shape)
        params.append((param, entry.name))
    return BoundLayer(record.layer, position, module, params)


def _parameter(module: nn.Module, record: LayerRecord, name: str) -> nn.Parameter | None:
    rest = _split_name(name, record.layer)[1]
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
    # A target tied to a parameter outside its layer would read a placeholder (or another layer's
    # slot) whenever that other user runs.
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
