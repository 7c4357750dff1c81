"""SGLang's side of the seam (server.py), and everything else that depends on SGLang's version (0.5.23).

`SglangAdapter` is what the load flows and the loader ask of SGLang, each answer in its method; beside it,
registering the load format and the pure name rules its methods apply.
- Registering the load format. SGLang's named load formats are a closed enum (`LoadFormat(name)` raises on an
  unknown name), but a `LoadConfig` may carry a loader class instead (`get_model_loader`: `isinstance(load_format,
  type)`). So the name is added to the command line's choices (`add_load_format_choices`, SGLang's own extension
  point), and a HookRegistry BEFORE hook on `LoadConfig._verify_load_format` turns the name into the class before
  the enum sees it.
- Reading the worker's parallel layout for sharded mode (`SglangAdapter.layout`): DP attention's rank and size, the
  attention TP size, whether the DP ranks step together (they do under DP attention: an idle rank runs SGLang's
  IDLE batches through every layer).
- Building the model: a linear layer creates its weight in its method's `create_weights` while the model's
  constructor runs; `targets_without_storage` makes the targets' weights there without storage.
- SGLang's parameter names where they differ from the manifest's (`model_name`: a fused parameter's name, and
  the model class's own `hf_to_sglang_mapper`, as its `load_weights` applies it), which targets SGLang splits
  over its TP ranks instead of replicating them, and which MLP sizes it pads on the CPU (`refuse_unshardable`).
- Kimi K3's buffers that SGLang merges from bound weights while loading (`relink_merged_weights`).
- The CPU linear layers: with AMX, SGLang repacks an unquantized weight after loading (`_amx_process_weight_
  after_loading`) for its own kernel; a layer whose weight is swapped in per forward must keep the plain path
  (`keep_plain`).
- Drafts: whether this load is the draft's (`loads_draft`), which object the target's load and the draft's both see
  (`deployment`: the scheduler process's ServerArgs), whether the draft is the target's own MTP layer
  (`serves_mtp_draft`), a draft that is no convert output (`refuse_published_draft`), how SGLang names a NextN
  draft's layer (`model.decoder`, the checkpoint's layer L: `nextn_layer`) and builds a DFlash draft's linear
  layers (without their names), and which draft parameters SGLang takes from the target.

Nothing else in shardprep imports SGLang's internals.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ...errors import ShardprepError
from ...runtime.binding import Binding
from ...runtime.views import placeholder
from ..processed_layers import run_post_load_step_now
from ..server import Built, OptionSpelling, ServerAdapter, WorkerLayout

PREFIX = "_shardprep_prefix"
"""Where a linear layer being built keeps its name while `targets_without_storage` is active."""
LOGGER_NAME = "sglang.shardprep"
"""A child of SGLang's logger, so the lines come out with SGLang's own handler and rank prefix."""

VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"


def register_load_format(name: str, loader: type) -> None:
    """Make `load_format=name` (Engine keyword, `--load-format` flag) select `loader`; idempotent.

    >>> register_load_format("shardprep", ShardprepModelLoader)  # doctest: +SKIP
    """
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if name in LOAD_FORMAT_CHOICES:
        return

    def name_to_class(config: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(config.load_format, str) and config.load_format.lower() == name:
            config.load_format = loader
        return None

    add_load_format_choices([name])
    HookRegistry.register(VERIFY_LOAD_FORMAT, name_to_class, HookType.BEFORE)


SPELLING = OptionSpelling(
    server="SGLang",
    tp_option="attention TP (tp_size / dp_size under enable_dp_attention)",
    pp_option="pp_size",
    dp_option="dp_size",
    dp_advice="tp_size = dp_size = {n} (or a multiple) with enable_dp_attention",
    without_lockstep="shard_weights needs DP attention (enable_dp_attention): without it SGLang runs its "
                     "data-parallel ranks independently",
)
"""SGLang's spelling of what sharded mode's refusals tell the user to change."""


class PlainLinearMethod:
    """A linear layer's quantization method, but its weight is left as loaded (no repacking after loading)."""

    def __init__(self, method: Any):
        self.method = method

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None  # the weight is a gathered view, rebound every forward: it must stay plain

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


MODEL_NAMES = {"self_attn.fused_qkv_a_proj.weight": "self_attn.fused_qkv_a_proj_with_mqa.weight"}
"""A manifest's fused view (the preset's name, vLLM's) → SGLang's parameter, where the two differ: SGLang's
DeepseekV2 (and Kimi K3's MLA, a subclass) fuses q_a_proj and kv_a_proj_with_mqa, in that order, into
`fused_qkv_a_proj_with_mqa`."""




NEXTN_DECODER = "model.decoder."
"""Where SGLang's NextN draft (`DeepseekV3ForCausalLMNextN`) builds its one decoder layer: the checkpoint's layer L
(`model.layers.L.`, its MTP layer) as `model.decoder.` (`deepseek_nextn.py`; the replicated `enorm`, `hnorm`,
`eh_proj` and `shared_head.norm` as `model.*`)."""
NEXTN_ARCHITECTURES = ("DeepseekV3ForCausalLMNextN",)
"""The draft architectures SGLang builds from a DeepSeek-V3 (or Kimi-K2) target's own MTP layer, NEXTN."""


def nextn_layer(model_config: Any) -> int | None:
    """The checkpoint layer SGLang builds as a NextN draft's `model.decoder` (SGLang's own rule,
    `_initialize_nextn_conf`: layer `num_hidden_layers`, or 0 for a one-layer draft checkpoint); None when
    `model_config` is not a NextN draft's.

    >>> layer = nextn_layer(draft_runner.model_config)  # doctest: +SKIP
    """
    if model_config is None or not getattr(model_config, "is_draft_model", False):
        return None
    config = model_config.hf_config
    if (getattr(config, "architectures", None) or [""])[0] not in NEXTN_ARCHITECTURES:
        return None
    return 0 if config.num_hidden_layers == 1 else int(config.num_hidden_layers)


def nextn_manifest_name(name: str, layer: int) -> str:
    """The manifest's name for a NextN draft's parameter: its decoder layer as the checkpoint's layer `layer`.

    >>> nextn_manifest_name("model.decoder.self_attn.o_proj.weight", 8)
    'model.layers.8.self_attn.o_proj.weight'
    """
    return f"model.layers.{layer}.{name[len(NEXTN_DECODER):]}" if name.startswith(NEXTN_DECODER) else name


def _renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    for old, new in renames:
        if name.endswith("." + old):
            return name[:-len(old)] + new
    return name


PADDED_SIZES = ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size")
"""The MLP sizes SGLang pads on the CPU under TP (`adjust_config_with_unaligned_cpu_tp`), keeping the checkpoint's
as `original_<name>` in the model's config."""


def _gathered_rows(module: nn.Module, names: Mapping[int, str], binding: Binding) -> torch.Tensor | None:
    """`module._bfa_w` as rows of a gathered fused view: f_a's, b's right after them, and the view's zero pad rows
    up to the merged buffer's rows; None where the manifest has no such view (SGLang then reads f_a_proj and
    b_proj)."""
    merged: Any = module._bfa_w  # SGLang's attributes, typed by nn.Module as Tensor | Module
    f_a: Any = module.f_a_proj.weight  # type: ignore[union-attr]
    b: Any = module.b_proj.weight  # type: ignore[union-attr]
    if id(f_a) not in names or id(b) not in names or merged.dtype != f_a.dtype or merged.shape[1:] != f_a.shape[1:]:
        return None
    first, second = names[id(f_a)], names[id(b)]
    record = next((r for r in binding.shards.manifest.layers if any(e.name == first for e in r.entries)), None)
    if record is None:
        return None
    rows = {e.name: e.shape[0] for e in record.entries}
    for view in record.views:
        members = list(view.members)
        if members[-2:] != [first, second] or rows[first] + rows[second] + view.pad_rows < merged.shape[0]:
            continue
        start = sum(rows[m] for m in members[:-2])
        rows_of_view = binding.gatherer.views(record.layer)[view.name]
        relinked = rows_of_view[start:start + merged.shape[0]]
        return relinked if relinked.data_ptr() == f_a.data_ptr() else None
    return None


MTP_ALGORITHMS = ("EAGLE", "NEXTN")
"""SGLang's speculative algorithms that, with the draft path the target's own (SGLang's default for DeepSeek-V3,
`_handle_eagle_family`), run the target checkpoint's MTP layer as the draft; NEXTN resolves to EAGLE."""


class SglangAdapter(ServerAdapter):
    """SGLang 0.5.23 as shardprep's sharded mode sees it, for the model `model_config` describes on `device`.

    >>> SglangAdapter.spelling.dp_option
    'dp_size'
    """

    spelling = SPELLING

    def __init__(self, model_config: Any, device: torch.device):
        self.model_config, self.device = model_config, device

    def layout(self) -> WorkerLayout:
        """The layout of the scheduler process that is loading the model (call it inside the loader's load_model).

        Under DP attention SGLang's DP ranks are its attention-DP ranks; the attention TP size is what sharded mode
        needs to be 1 (each DP rank computes whole attention heads from whole weights).
        """
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.runtime_context import get_parallel, get_server_args

        parallel, args = get_parallel(), get_server_args()
        dp_attention = is_dp_attention_enabled()
        world = torch.distributed.get_world_size()
        dp_size = parallel.attn_dp_size if dp_attention else 1
        attn_tp = world // (dp_size * args.pp_size)
        device = self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return WorkerLayout(
            dp_rank=parallel.attn_dp_rank if dp_attention else 0,
            dp_size=dp_size,
            dp_world_ranks=tuple(range(world)) if attn_tp == 1 else (),
            tp_size=attn_tp,
            pp_size=args.pp_size,
            lockstep_dp=dp_attention,
            eager=bool(args.disable_cuda_graph) and not args.enable_torch_compile,
            device=device,
            platform=device.type,
        )

    @contextmanager
    def targets_without_storage(self, is_target: Callable[[str], bool]) -> Iterator[Built]:
        """While SGLang builds a model inside this block, give every linear layer's weight whose name `is_target`
        accepts no storage: its shape, dtype, device and SGLang attributes, and one element.

        Yields the (name, parameter) pairs made so, for the caller to check that `bind` bound each. SGLang 0.5.23
        creates a linear layer's weight in its method's `create_weights(layer, ...)` (`UnquantizedLinearMethod`,
        `Fp8LinearMethod`, ...), called from the layer's constructor, and does not keep the layer's name (`prefix`)
        on it: `LinearBase.__init__` is wrapped to note it first, and every linear method's `create_weights` for the
        duration of the block. An unquantized weight is created on the `meta` device (nothing is allocated); a
        quantized layer's are created as SGLang creates them, since its scales (not targets) are loaded later, and its
        target weight (one layer's) is freed at once. The weight is then swapped for a zero-stride view of one element
        on the model's device with the parameter's class and attributes (a `meta` parameter could not be pointed at
        device memory later, which is what `bind` does).

        SGLang 0.5.23's DFlash draft (`models/dflash.py`) names its layers' linear layers only when its checkpoint is
        quantized (`DFlashDraftModel.quantizable`; otherwise every layer's is `qkv_proj`, `o_proj`, ...): while the
        model is built here, a DFlash decoder layer built without a prefix is given the one SGLang gives a quantized
        draft's, `layers.{i}`, which SGLang reads for nothing else (a linear layer's prefix selects its quant
        method).

        >>> with adapter.targets_without_storage(lambda name: name in targets) as made:  # doctest: +SKIP
        ...     model = _initialize_model(model_config, load_config, quant_config)
        """
        from sglang.srt.layers.linear import LinearBase
        from sglang.srt.layers.quantization.base_config import LinearMethodBase
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang.srt.models.dflash import DFlashDecoderLayer

        made: list[tuple[str, nn.Parameter]] = []
        original_init = LinearBase.__init__
        original_dflash_init = DFlashDecoderLayer.__init__
        prefix_of = inspect.signature(original_init)
        dflash_arguments = inspect.signature(original_dflash_init)
        depth = [0]  # a method's create_weights may call another's: only the outermost call swaps

        def dflash_init(layer: nn.Module, *args: Any, **kwargs: Any) -> None:
            arguments = dflash_arguments.bind(layer, *args, **kwargs).arguments
            if not arguments.get("prefix"):
                arguments["prefix"] = f"layers.{arguments['layer_id']}"
            original_dflash_init(**arguments)

        def init(layer: nn.Module, *args: Any, **kwargs: Any) -> None:
            layer.__dict__[PREFIX] = prefix_of.bind(layer, *args, **kwargs).arguments.get("prefix", "")
            original_init(layer, *args, **kwargs)

        def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
            def create_weights(method: Any, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
                name = f"{layer.__dict__.get(PREFIX, '')}.weight"
                if depth[0] or not is_target(name):
                    return original(method, layer, *args, **kwargs)
                depth[0] += 1
                try:
                    # Inside SGLang's `with target_device:`, the innermost context wins.
                    with torch.device("meta") if isinstance(method, UnquantizedLinearMethod) else nullcontext():
                        result = original(method, layer, *args, **kwargs)
                finally:
                    depth[0] -= 1
                built: Any = layer._parameters.get("weight")
                if built is not None:  # a method storing its weight under another name (`qweight`) is never bound
                    # On the model's device.
                    weight = nn.Parameter(placeholder(built.shape, built.dtype), requires_grad=False)
                    weight.__class__, weight.__dict__ = built.__class__, built.__dict__.copy()
                    layer.register_parameter("weight", weight)
                    made.append((name, weight))
                return result

            return create_weights

        classes, todo = [], [LinearMethodBase]
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "create_weights" in vars(cls):
                classes.append(cls)
        originals = {cls: vars(cls)["create_weights"] for cls in classes}
        LinearBase.__init__ = init
        for cls, original in originals.items():
            cls.create_weights = wrapped(original)
        DFlashDecoderLayer.__init__ = dflash_init
        try:
            yield made
        finally:
            LinearBase.__init__ = original_init
            for cls, original in originals.items():
                cls.create_weights = original
            DFlashDecoderLayer.__init__ = original_dflash_init

    def keep_plain(self, module: nn.Module) -> None:
        """Keep `module`'s weight a parameter that its forward reads each time: SGLang's CPU linear method repacks
        it for AMX after loading (and then reads only the packed copy); the plain path is `F.linear` on `.weight`."""
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, PlainLinearMethod):
            module.quant_method = PlainLinearMethod(method)  # type: ignore[assignment]  # an attribute of the layer

    def logger(self) -> logging.Logger:
        """A child of SGLang's logger, so the lines come out with SGLang's own handler and rank prefix."""
        return logging.getLogger(LOGGER_NAME)

    def model_name(self, model: nn.Module) -> Callable[[str], str] | None:
        """SGLang's name for a manifest tensor name (bind's `model_name`): the model class's `hf_to_sglang_mapper`
        (where it has one; Kimi K3's maps `language_model.layers.` and `block_sparse_moe`), then MODEL_NAMES.

        >>> SglangAdapter(None, torch.device("cpu")).model_name(nn.Linear(1, 1))(
        ...     "model.layers.1.self_attn.fused_qkv_a_proj.weight")
        'model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight'
        """
        mapper = getattr(type(model), "hf_to_sglang_mapper", None)

        def model_name(name: str) -> str:
            mapped = mapper.apply_list([name]) if mapper is not None else [name]
            return _renamed(mapped[0] if mapped else name, MODEL_NAMES.items())

        return model_name

    def manifest_name(self, name: str) -> str:
        """The manifest's name for an SGLang parameter name while the model is built (`model_name`'s inverse), as far
        as a name tells it: a NextN draft's decoder layer as the checkpoint's layer (`nextn_layer`), and a mapper's
        renamed substring renamed back wherever it appears (Kimi K3's `mlp` → `block_sparse_moe`, so K3's dense
        layer-0 MLP reads as `block_sparse_moe` here: a preset that shards it would have it built with storage, then
        bound all the same).

        >>> SglangAdapter(None, torch.device("cpu")).manifest_name(
        ...     "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight")
        'model.layers.1.self_attn.fused_qkv_a_proj.weight'
        """
        layer = nextn_layer(self.model_config)
        if layer is not None:
            name = nextn_manifest_name(name, layer)
        name = _renamed(name, ((sglangs, ours) for ours, sglangs in MODEL_NAMES.items()))
        mapper = self._mapper
        if mapper is None:
            return name
        for ours, sglangs in mapper.orig_to_new_prefix.items():
            if sglangs is not None and name.startswith(sglangs):
                name = ours + name[len(sglangs):]
                break
        for ours, sglangs in mapper.orig_to_new_substr.items():
            if sglangs and f".{sglangs}." in f".{name}.":
                name = f".{name}.".replace(f".{sglangs}.", f".{ours}.", 1)[1:-1]
                break
        return name

    @functools.cached_property
    def _mapper(self) -> Any:
        """The `hf_to_sglang_mapper` of the model class SGLang builds for `model_config` (None: it renames nothing),
        looked up when first asked for."""
        if self.model_config is None:
            return None
        from sglang.srt.model_loader.utils import get_model_architecture

        return getattr(get_model_architecture(self.model_config)[0], "hf_to_sglang_mapper", None)

    def is_quantized(self, module: nn.Module) -> bool:
        """Whether SGLang built `module` with a quantized linear method (sharded mode processes those at load:
        `SglangAdapter.process_quantized`)."""
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

        method = getattr(module, "quant_method", None)
        if isinstance(method, PlainLinearMethod):
            method = method.method
        return method is not None and not isinstance(method, UnquantizedLinearMethod)

    def process_quantized(self, module: nn.Module) -> None:
        """Run SGLang's post-load step of `module`'s quant method now, as its loader would
        (`DefaultModelLoader.postprocess_weights`), and make SGLang's own pass later skip the module. On the CPU,
        block FP8's step packs the weight for SGLang's kernels (VNNI, shape and dtype kept) and keeps the scales
        float32; sharded mode shards what the step left (processed_layers.py).

        >>> SglangAdapter(config, device).process_quantized(model.model.layers[1].mlp.down_proj)  # doctest: +SKIP
        """
        run_post_load_step_now(module)

    def default_weight_loader(self) -> Callable[..., Any]:
        """SGLang's loader of a parameter without a `weight_loader` of its own."""
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        return default_weight_loader

    def defaulted_parameters(self, model: nn.Module) -> set[str]:
        """The parameters SGLang marks `_skip_weight_check` (its own weight checker's rule: an attention layer's
        KV-cache scales, which `BaseKVCacheMethod` creates at -1 and replaces by 1.0 when no checkpoint has them),
        and a NextN draft's embedding and LM head: SGLang's NextN `load_weights` skips the checkpoint's
        (`embed_tokens`, `shared_head.head`), and its EAGLE worker gives the draft the target's after loading
        (`set_embed_and_head`).

        >>> check_all_loaded(model, None, "out/", also=adapter.defaulted_parameters(model), seen=seen)  # doctest: +SKIP
        """
        names = {name for name, param in model.named_parameters() if getattr(param, "_skip_weight_check", False)}
        if nextn_layer(self.model_config) is not None:
            names |= {name for name, _ in model.named_parameters()
                      if name in ("model.embed_tokens.weight", "lm_head.weight")}
        return names

    def copy_draft_weights_at_load(self, model: nn.Module) -> None:
        """SGLang 0.5.23's DFlash worker projects the target's hidden states to every draft layer's K/V before the
        draft's layers run (`_append_target_hidden_to_draft_kv`: each layer's `self_attn.kv_proj_only`, which reads
        the K/V rows of its `qkv_proj.weight`; on CUDA the fused path copies those rows of every layer once, when
        the worker starts). Those are reads of a bound weight outside its layer, which would find another layer's
        bytes in the slot. So each layer's K/V rows are kept resident, copied here from the gathered weights
        (`_keep_context_kv_resident`; on CUDA full mode holds the same copy, in SGLang's fused helper), and the
        fused path, whose copy would be taken from the slots, is turned off (`supports_fused_context_kv`,
        SGLang's own switch for drafts it cannot serve that way)."""
        layers = getattr(model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            return
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            if attention is not None and hasattr(attention, "kv_proj_only"):
                self._keep_context_kv_resident(attention)
        model.supports_fused_context_kv = False  # type: ignore[assignment]  # SGLang's attribute, read by its worker

    def draft_layer_modules(self, model: nn.Module, layers: Sequence[int]) -> Mapping[int, nn.Module]:
        """The draft model's module for each draft layer: a NextN draft's one decoder layer (`model.decoder`, the
        checkpoint's MTP layer L, `nextn_layer`), or a DFlash draft model's layer i (`layers[i]`: SGLang's
        DFlashDraftModel has no `model.` level, and numbers its layers as its checkpoint does)."""
        decoder = getattr(getattr(model, "model", None), "decoder", None)
        if isinstance(decoder, nn.Module):
            expected = nextn_layer(self.model_config)
            if expected is None or list(layers) != [expected]:
                raise ShardprepError(f"the manifest's MTP draft layers are {list(layers)}, but SGLang builds its NextN "
                                     f"draft ({type(model).__name__}) from layer {expected}; was the directory "
                                     "converted from this checkpoint?")
            return {expected: decoder}
        found = getattr(model, "layers", None)
        if not isinstance(found, nn.ModuleList):
            raise ShardprepError(f"the draft model ({type(model).__name__}) has neither a NextN decoder "
                                 "(model.decoder) nor a layer list (layers); shard_weights binds SGLang's NextN "
                                 "drafts of DeepSeek-V3 and its DFlash draft models")
        if max(layers) >= len(found):
            raise ShardprepError(f"the draft model ({type(model).__name__}) has {len(found)} layers, the draft's "
                                 f"output {max(layers) + 1}; was it converted from this draft?")
        return {i: found[i] for i in layers}

    def refuse_unshardable(self, model: nn.Module, targets: Mapping[str, nn.Parameter], directory: str) -> None:
        """Refuse, in one line, targets that SGLang builds so that no rank holds the checkpoint's replicated weight:
        split over its TP ranks, or padded (MLP sizes on the CPU under TP)."""
        split = self._split_targets(model, targets.__contains__)
        if split:
            name, ranks = split[0]
            advice = ("" if ".shared_experts." not in name else
                      "SGLang replicates Kimi K3's shared experts only under an all-to-all MoE backend "
                      "(moe_a2a_backend deepep, mooncake, ...), " if self._is_kimi_k3() else
                      "set SGLANG_SHARED_EXPERT_TP1=1 (SGLang then replicates the shared experts, as under DeepEP), ")
            raise ShardprepError(f"{directory}: SGLang splits the target {name} over its {ranks} TP ranks, so it is "
                                 f"not replicated under DP attention and cannot be sharded; {advice}convert with a "
                                 "preset that leaves it out, or serve in full mode")
        padded = self._padded_sizes()
        mlp_targets = [name for name in targets if ".mlp." in name]
        if padded and mlp_targets:
            size, (checkpoint, sglangs) = next(iter(padded.items()))
            raise ShardprepError(f"{directory}: SGLang pads {size} from {checkpoint} to {sglangs} on the CPU under "
                                 f"TP, so MLP targets such as {mlp_targets[0]} are built larger than the checkpoint's; "
                                 f"serve it in full mode, or convert a checkpoint whose {size} SGLang leaves as is (a "
                                 "multiple of tp_size x 32, of tp_size x 128 for block FP8)")

    def relink_merged_weights(self, model: nn.Module, binding: Binding) -> list[str]:
        """Point what SGLang merged from bound weights while loading at the gathered bytes, or let the layer read the
        bound weights themselves; the names of the modules changed.

        SGLang 0.5.23's Kimi K3 merges weights after loading (`post_load_weights`, run by its `load_weights`, while
        sharded mode has bound its targets to placeholders), into buffers of its own that its forward then reads:
        - a KDA layer's `_bfa_w` = [f_a_proj; b_proj; zero rows to a multiple of 8] (`_merge_bfa_weights`), read
          by `forward_qkvbfg_fused` in place of the two layers (and, on ROCm, `_qkvgbfa_layer`, the whole
          in-projection);
        - on CUDA/ROCm a MoE layer's `_front_w` = [shared gate_up_proj; router gate; routed_expert_down_proj]
          (`_merge_front_weights`).
        A bound weight is gathered into its slot before its layer runs, so such a copy would keep the placeholders'
        bytes. `_bfa_w` becomes the same rows of the gathered layer where a fused view of the manifest holds them
        so, f_a then b last, with as many pad rows after them (the kimi-k3 preset's in_proj_qkvgfab: its pad rows are
        zero bytes of the layer); otherwise, and for `_front_w` (its router gate is not a target), the merged buffer
        is dropped and SGLang's unmerged path runs, reading the bound weights (one GEMM more per layer).

        >>> SglangAdapter(model_config, device).relink_merged_weights(model, binding)  # doctest: +SKIP
        """
        names = {id(p): name for name, p in binding.target_parameters.items()}
        changed = []
        for name, module in model.named_modules():
            merged = [m for m in (getattr(module, "f_a_proj", None), getattr(module, "b_proj", None))
                      if m is not None]
            if getattr(module, "_bfa_w", None) is not None and any(id(m.weight) in names for m in merged):
                module._bfa_w = _gathered_rows(module, names, binding)
                if hasattr(module, "_qkvgbfa_sizes"):
                    module._qkvgbfa_sizes = None  # ROCm's whole in-projection buffer: its unmerged path instead
                changed.append(name)
            front = [getattr(module, m, None) for m in ("shared_experts", "gate", "routed_expert_down_proj")]
            weights = [w for m in front if isinstance(m, nn.Module) for w in m.parameters()]
            if getattr(module, "_front_w", None) is not None and any(id(w) in names for w in weights):
                module._front_w = module._front_sizes = None
                # SGLang's cached properties read _front_w.
                for cached in ("_eligible_for_fused_front", "_front_fp32", "_routing_contract_ok",
                               "_ep_front_eligible"):
                    module.__dict__.pop(cached, None)
                changed.append(name)
        return changed

    def loads_draft(self) -> bool:
        """Whether SGLang is loading the draft model (a draft worker's ModelRunner, `model_config.is_draft_model`)."""
        return bool(self.model_config.is_draft_model)

    def deployment(self) -> object | None:
        """The object the target's load and its draft's both see in SGLang's scheduler process: the published
        ServerArgs (`runtime_context.get_server_args`; a draft worker is built from the same one and never publishes
        its own). The target's `ShardedLoad` is handed to the draft's load under it (`drafts.hand_to_draft`)."""
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()

    def runs_a_draft(self) -> bool:
        """Whether SGLang runs speculative decoding here (a draft worker is built after the target)."""
        from sglang.srt.runtime_context import get_spec

        return get_spec().speculative_algorithm is not None

    def serves_mtp_draft(self, directory: str) -> bool:
        """Whether SGLang runs the MTP layer of `directory`, the target's, as its draft (NEXTN or EAGLE with the
        target's own path as the draft's)."""
        from pathlib import Path

        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        draft = spec.speculative_draft_model_path
        return (spec.speculative_algorithm in MTP_ALGORITHMS and draft is not None
                and Path(draft).resolve() == Path(directory).resolve())

    def refuse_published_draft(self, directory: str, sharded: bool) -> None:
        """Refuse, in one line naming the draft and the ways on, a draft model that SGLang loads with this load
        format (the target's, when `--speculative-draft-load-format` is not given) but that is no `shardprep convert`
        output. Beside a sharded target (`sharded`) the draft cannot be loaded apart: SGLang 0.5.23 gives the draft
        the target's `--model-loader-extra-config`, and its own loaders refuse the `shard_weights` key.

        >>> adapter.refuse_published_draft("z-lab/Qwen3-8B-DFlash-b16", sharded=True)  # doctest: +SKIP
        """
        from pathlib import Path

        from sglang.srt.runtime_context import get_spec

        from ...manifests.manifest import MANIFEST_NAME

        if (Path(directory) / MANIFEST_NAME).is_file():
            return
        apart = ("(SGLang gives the draft the target's --model-loader-extra-config, which its own loaders refuse, so "
                 "it cannot be loaded apart beside a sharded target)" if sharded else
                 "or load it apart with --speculative-draft-load-format auto")
        raise ShardprepError(
            f"{directory}: the {get_spec().speculative_algorithm or 'speculative'} draft model is loaded with "
            "load_format shardprep, as its target is, but is not an output of `shardprep convert` (no "
            f"shard_manifest.json); convert it with the target's --ranks (`shardprep convert {directory} DRAFT_OUT "
            f"--ranks N`) and pass --speculative-draft-model-path DRAFT_OUT {apart}")

    def _split_targets(self, model: nn.Module, is_target: Callable[[str], bool]) -> list[tuple[str, int]]:
        """The target linear layers that SGLang splits over several ranks (name, ranks): their weights differ from
        rank to rank, so there is nothing replicated to shard. Under DP attention SGLang's attention layers use the
        attention TP group (size 1), but a DeepSeek MoE layer's shared experts use the whole TP group unless SGLang
        replicates them (`SGLANG_SHARED_EXPERT_TP1=1`, or an all-to-all MoE backend such as DeepEP).

        >>> adapter._split_targets(model, load.is_target)  # doctest: +SKIP
        """
        from sglang.srt.distributed.utils import get_group_rank_size
        from sglang.srt.layers.linear import LinearBase

        split = []
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and is_target(f"{name}.weight"):
                ranks = get_group_rank_size(getattr(module, "tp_group", None))[1]
                if ranks > 1:
                    split.append((name, ranks))
        return split

    def _padded_sizes(self) -> dict[str, tuple[int, int]]:
        """{size name: (the checkpoint's, SGLang's)} for every MLP size SGLang padded: on the CPU it rounds them up
        to a multiple of tp_size × 32, and the MLP weights it builds are then larger than the checkpoint's
        (zero-padded).

        >>> adapter._padded_sizes()  # doctest: +SKIP
        """
        config = self.model_config.hf_config
        return {name: (getattr(config, f"original_{name}"), getattr(config, name)) for name in PADDED_SIZES
                if hasattr(config, f"original_{name}")
                and getattr(config, f"original_{name}") != getattr(config, name)}

    def _is_kimi_k3(self) -> bool:
        """Whether SGLang builds Kimi K3 (models/kimi_k3.py) for `model_config`."""
        from sglang.srt.configs.model_config import is_kimi_k3 as sglangs

        return self.model_config is not None and sglangs(self.model_config.hf_config)

    def _keep_context_kv_resident(self, attention: nn.Module) -> None:
        """Give a DFlash attention layer (SGLang 0.5.23's `DFlashAttention`) a resident copy of its `qkv_proj` K/V
        rows, taken now, and make its `kv_proj_only` project with it: SGLang's own fast path (`F.linear` on those
        rows, then the split and `v_scale`) on the copy instead of on the weight, which sharded mode rebinds to a slot.

        >>> adapter._keep_context_kv_resident(draft.layers[0].self_attn)  # doctest: +SKIP
        """
        import torch.nn.functional as F

        qkv: Any = attention.qkv_proj
        sizes: Any = attention  # SGLang's int attributes (q_size, kv_size), typed as modules' attributes
        if self.is_quantized(qkv):
            raise ShardprepError(f"shard_weights: the DFlash draft's qkv_proj is quantized "
                                 f"({type(qkv.quant_method).__name__}); its context K/V projection reads the weight "
                                 "outside its layer, which sharded mode keeps resident only unquantized; serve the "
                                 "draft in full mode")
        q_size, kv_size = int(sizes.q_size), int(sizes.kv_size)
        rows = slice(q_size, q_size + 2 * kv_size)
        weight = qkv.weight[rows].clone()
        bias = None if qkv.bias is None else qkv.bias[rows].clone()

        def kv_proj_only(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = F.linear(hidden_states, weight, bias).split([kv_size, kv_size], dim=-1)
            scale = getattr(attention, "v_scale", None)
            return k, (v if scale is None else v * scale)

        attention.kv_proj_only = kv_proj_only  # type: ignore[assignment]  # the instance's, over DFlashAttention's
