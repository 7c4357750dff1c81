"""Everything that depends on SGLang's version (0.5.23), in one place.

- Registering the load format. SGLang's named load formats are a closed enum (`LoadFormat(name)` raises on an
  unknown name), but a `LoadConfig` may carry a loader class instead (`get_model_loader`: `isinstance(load_format,
  type)`). So the name is added to the command line's choices (`add_load_format_choices`, SGLang's own extension
  point), and a HookRegistry BEFORE hook on `LoadConfig._verify_load_format` turns the name into the class before
  the enum sees it.
- Reading the worker's parallel layout for sharded mode (`current_layout`): DP attention's rank and size, the
  attention TP size, whether the DP ranks step together (they do under DP attention: an idle rank runs SGLang's
  IDLE batches through every layer).
- Building the model: a linear layer creates its weight in its method's `create_weights` while the model's
  constructor runs; `target_weights_without_storage` makes the targets' weights there without storage.
- SGLang's parameter names where they differ from the manifest's (`model_name`), which targets SGLang splits
  over its TP ranks instead of replicating them (`split_targets`), and which MLP sizes it pads on the CPU
  (`padded_sizes`).
- The CPU linear layers: with AMX, SGLang repacks an unquantized weight after loading (`_amx_process_weight_
  after_loading`) for its own kernel; a layer whose weight is swapped in per forward must keep the plain path
  (`keep_plain_linear`). A quantized layer's post-load step (block FP8 on the CPU: VNNI packing) runs once at
  load in sharded mode instead, and SGLang's own pass then skips it (`process_quantized`).

Nothing else in shardprep imports SGLang's internals.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ...runtime.views import placeholder
from ..parallel_layout import ParallelLayout

PREFIX = "_shardprep_prefix"
"""Where a linear layer being built keeps its name while `target_weights_without_storage` is active."""
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


OPTION_NAMES = {
    "server": "SGLang",
    "tp_option": "attention TP (tp_size / dp_size under enable_dp_attention)",
    "pp_option": "pp_size",
    "dp_option": "dp_size",
    "dp_advice": "tp_size = dp_size = {n} (or a multiple) with enable_dp_attention",
    "without_lockstep": "shard_weights needs DP attention (enable_dp_attention): without it SGLang runs its "
                        "data-parallel ranks independently",
}
"""SGLang's spelling of what sharded mode's refusals tell the user to change (ParallelLayout's defaults are vLLM's)."""


def current_layout(device: torch.device) -> ParallelLayout:
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
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return ParallelLayout(
        dp_rank=parallel.attn_dp_rank if dp_attention else 0,
        dp_size=dp_size,
        dp_world_ranks=tuple(range(world)) if attn_tp == 1 else (),
        tp_size=attn_tp,
        pp_size=args.pp_size,
        lockstep_dp=dp_attention,
        eager=bool(args.disable_cuda_graph) and not args.enable_torch_compile,
        device=device,
        platform=device.type,
        **OPTION_NAMES,
    )


class PlainLinearMethod:
    """A linear layer's quantization method, but its weight is left as loaded (no repacking after loading)."""

    def __init__(self, method: Any):
        self.method = method

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None  # the weight is a gathered view, rebound every forward: it must stay plain

    def __getattr__(self, name: str) -> Any:
        return getattr(self.method, name)


def keep_plain_linear(module: nn.Module) -> None:
    """Keep `module`'s weight a parameter that its forward reads each time: SGLang's CPU linear method repacks it
    for AMX after loading (and then reads only the packed copy); the plain path is `F.linear` on `.weight`."""
    method = getattr(module, "quant_method", None)
    if method is not None and not isinstance(method, PlainLinearMethod):
        module.quant_method = PlainLinearMethod(method)  # type: ignore[assignment]  # an attribute of the layer


MODEL_NAMES = {"self_attn.fused_qkv_a_proj.weight": "self_attn.fused_qkv_a_proj_with_mqa.weight"}
"""A manifest's fused view (the preset's name, vLLM's) → SGLang's parameter, where the two differ: SGLang's
DeepseekV2 fuses q_a_proj and kv_a_proj_with_mqa, in that order, into `fused_qkv_a_proj_with_mqa`."""


def model_name(name: str) -> str:
    """SGLang's name for a manifest tensor name (bind's `model_name`).

    >>> model_name("model.layers.1.self_attn.fused_qkv_a_proj.weight")
    'model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight'
    """
    return _renamed(name, MODEL_NAMES.items())


def manifest_name(name: str) -> str:
    """The manifest's name for an SGLang parameter name (`model_name`'s inverse).

    >>> manifest_name("model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight")
    'model.layers.1.self_attn.fused_qkv_a_proj.weight'
    """
    return _renamed(name, ((sglangs, ours) for ours, sglangs in MODEL_NAMES.items()))


def _renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    for old, new in renames:
        if name.endswith("." + old):
            return name[:-len(old)] + new
    return name


def split_targets(model: nn.Module, is_target: Callable[[str], bool]) -> list[tuple[str, int]]:
    """The target linear layers that SGLang splits over several ranks (name, ranks): their weights differ from
    rank to rank, so there is nothing replicated to shard. Under DP attention SGLang's attention layers use the
    attention TP group (size 1), but a DeepSeek MoE layer's shared experts use the whole TP group unless SGLang
    replicates them (`SGLANG_SHARED_EXPERT_TP1=1`, or an all-to-all MoE backend such as DeepEP).

    >>> split_targets(model, bound_later(manifest))  # doctest: +SKIP
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


PADDED_SIZES = ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size")
"""The MLP sizes SGLang pads on the CPU under TP (`adjust_config_with_unaligned_cpu_tp`), keeping the checkpoint's
as `original_<name>` in the model's config."""


def padded_sizes(model_config: Any) -> dict[str, tuple[int, int]]:
    """{size name: (the checkpoint's, SGLang's)} for every MLP size SGLang padded: on the CPU it rounds them up to a
    multiple of tp_size × 32 (of tp_size × the block size, 128, for block FP8), and the MLP weights it builds are
    then larger than the checkpoint's (zero-padded).

    >>> padded_sizes(model_config)  # doctest: +SKIP
    """
    config = model_config.hf_config
    return {name: (getattr(config, f"original_{name}"), getattr(config, name)) for name in PADDED_SIZES
            if hasattr(config, f"original_{name}") and getattr(config, f"original_{name}") != getattr(config, name)}


def is_quantized(module: nn.Module) -> bool:
    """Whether SGLang built `module` with a quantized linear method (sharded mode processes those at load:
    `process_quantized`)."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    method = getattr(module, "quant_method", None)
    if isinstance(method, PlainLinearMethod):
        method = method.method
    return method is not None and not isinstance(method, UnquantizedLinearMethod)


def process_quantized(module: nn.Module) -> None:
    """Run SGLang's post-load step of `module`'s quant method now, as SGLang's loader would
    (`DefaultModelLoader.postprocess_weights`: `quant_method.process_weights_after_loading(module)`), and make
    SGLang's own pass later skip the module.

    On the CPU, block FP8's step packs the weight for SGLang's kernels (VNNI, shape and dtype kept) and keeps the
    scales float32; sharded mode then shards what the step left (processed_layers.py). Each call runs the step
    (sharded mode runs it twice per module); only SGLang's own later call is skipped, and only for modules
    processed here, so a method object shared with another module still processes that one.

    >>> process_quantized(model.model.layers[1].self_attn.o_proj)  # doctest: +SKIP
    """
    method: Any = module.quant_method
    if not hasattr(method, "_shardprep_step"):
        step, done = method.process_weights_after_loading, set[int]()

        def unless_done(layer: nn.Module) -> None:
            if id(layer) not in done:
                step(layer)

        method._shardprep_step, method._shardprep_done = step, done
        method.process_weights_after_loading = unless_done
    method._shardprep_step(module)
    method._shardprep_done.add(id(module))


def logger() -> logging.Logger:
    """The logger the startup line goes to."""
    return logging.getLogger(LOGGER_NAME)


@contextmanager
def target_weights_without_storage(is_target: Callable[[str], bool]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """While SGLang builds a model inside this block, give every linear layer's weight whose name `is_target`
    accepts no storage: its shape, dtype, device and SGLang attributes, and one element.

    Yields the (name, parameter) pairs made so, for the caller to check that `bind` bound each. SGLang 0.5.23
    creates a linear layer's weight in its method's `create_weights(layer, ...)` (`UnquantizedLinearMethod`,
    `Fp8LinearMethod`, ...), called from the layer's constructor, and does not keep the layer's name (`prefix`) on
    it: `LinearBase.__init__` is wrapped to note it first, and every linear method's `create_weights` for the
    duration of the block. An unquantized weight is created on the `meta` device (nothing is allocated); a quantized
    layer's are created as SGLang creates them, since its scales (not targets) are loaded later, and its target
    weight (one layer's) is freed at once. The weight is then swapped for a zero-stride view of one element on the
    model's device with the parameter's class and attributes (a `meta` parameter could not be pointed at device
    memory later, which is what `bind` does).

    >>> with target_weights_without_storage(lambda name: name in targets) as made:  # doctest: +SKIP
    ...     model = _initialize_model(model_config, load_config, quant_config)
    """
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.base_config import LinearMethodBase
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    made: list[tuple[str, nn.Parameter]] = []
    original_init = LinearBase.__init__
    prefix_of = inspect.signature(original_init)
    depth = [0]  # a method's create_weights may call another's: only the outermost call swaps

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
                weight = nn.Parameter(placeholder(built.shape, built.dtype), requires_grad=False)  # the model's device
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
    try:
        yield made
    finally:
        LinearBase.__init__ = original_init
        for cls, original in originals.items():
            cls.create_weights = original
