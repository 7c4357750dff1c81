"""Build a transformers model from a shardprep output directory, with its targets bound to the shards.

transformers does the loading (key renames, expert merges, tied weights, non-persistent buffers such
as rotary `inv_freq`), so the result is the model `from_pretrained` on the source would give. It is
handed a state dict of the replicated tensors plus, for every target, a placeholder that owns one
element: the targets' own storage is never allocated.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RuntimeShardError
from ..manifests.dtypes import torch_dtype
from ..manifests.manifest import MANIFEST_NAME, load_manifest
from ..runtime.binding import Binding, bind
from .block_fp8 import block_size, use_block_fp8_kernels

if TYPE_CHECKING:
    from ..loader.rank_shards import RankShards
    from ..runtime.gatherer import LayerGatherer

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm(directory: str | Path) -> bool:
    """True when DIR's config.json names a causal-LM architecture (`...ForCausalLM`, `...LMHeadModel`).

    >>> is_causal_lm("out/")  # doctest: +SKIP
    """
    return _names_causal_lm(_read_config(Path(directory)))


def _names_causal_lm(config_dict: dict[str, Any]) -> bool:
    return any(a.endswith(CAUSAL_LM_SUFFIXES) for a in config_dict.get("architectures") or ())


def build_model(
    directory: str | Path,
    device: str | torch.device = "cpu",
    *,
    rank: int | None = None,
    group: Any = None,
    backend: str = "auto",
    shards: RankShards | None = None,
    gatherer: LayerGatherer | None = None,
    trust_remote_code: bool = False,
) -> Binding:
    """The transformers model of DIR on `device`, its targets bound to this rank's shards.

    AutoModelForCausalLM for causal LMs, AutoModel otherwise, in the checkpoint's dtype. `group` is
    the shard group whose ranks gather together (None: `shard_group(N)`, this rank's group of the
    manifest's N consecutive ranks, the world itself when it has N ranks); `rank`, the rank file to
    serve, defaults to this process's rank in `group` (0 without torch.distributed). `trust_remote_code`
    lets transformers run the model code shipped in DIR (config.json's `auto_map`), as in `from_pretrained`.

    A draft model's layers in DIR (an MTP layer: `manifest.draft`, or config.json's `num_nextn_predict_layers`
    for a manifest written before drafts were recorded) are checked against the config and left unread:
    transformers builds no MTP layer.

    >>> binding = build_model("out/", f"cuda:{local_rank}")  # doctest: +SKIP
    >>> binding.model.generate(input_ids, max_new_tokens=8, do_sample=False)  # doctest: +SKIP
    """
    directory = Path(directory)
    config_dict = _read_config(directory)
    manifest = load_manifest(directory) if shards is None else shards.manifest
    manifest = manifest.with_serving_draft(config_dict, str(directory))
    draft = manifest.draft
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and group is None:
        from ..runtime.shard_groups import shard_group

        group = shard_group(manifest.world_size).process_group
    if shards is None:
        from ..loader.rank_shards import open_rank

        world_size = None
        if distributed:
            world_size = torch.distributed.get_world_size(group)
            rank = torch.distributed.get_rank(group) if rank is None else rank
        shards = open_rank(directory, rank or 0, world_size=world_size, device=device, manifest=manifest,
                           draft=False)
    if gatherer is None:
        from ..runtime.gatherer import LayerGatherer

        gatherer = LayerGatherer(shards, group=group, backend=backend)

    # transformers places everything on the CPU unless given a device_map, which needs accelerate; so
    # the model is loaded on the CPU (the replicated tensors mapped, not copied), bound, and then moved:
    # bound targets are views already on `device`, which `.to()` leaves as they are.
    state_dict = dict(shards.load_replicated("cpu"))
    if draft is not None:  # the draft's replicated tensors (its norms, eh_proj, experts) have no module either
        pattern = re.compile(r"(?:^|\.)layers\.(" + "|".join(map(str, draft.layers)) + r")\.")
        state_dict = {k: v for k, v in state_dict.items() if not pattern.search(k)}
    state_dict.update(_target_placeholders(shards))
    model = _from_state_dict(directory, config_dict, state_dict, trust_remote_code)
    binding = bind(model, shards, gatherer, model_name=checkpoint_renaming(model))
    model.to(device)
    return binding


def load_unsharded(directory: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The transformers model of a plain HF checkpoint (no shards), computed as `build_model`'s is.

    A block-FP8 checkpoint keeps its FP8 layers and runs them on shardprep's kernels (block_fp8.py), where
    `from_pretrained` alone would fetch its kernel from the hub (or dequantize to bf16 without a GPU): the
    resident reference a sharded model of the same weights must equal bit for bit.

    >>> reference = load_unsharded("exported/", "cuda:0")  # doctest: +SKIP
    """
    import transformers

    directory = Path(directory)
    config_dict = _read_config(directory, need_manifest=False)
    auto = transformers.AutoModelForCausalLM if _names_causal_lm(config_dict) else transformers.AutoModel
    model = _from_pretrained(auto, config_dict, directory, dtype="auto")
    return model.eval().to(device)


def checkpoint_renaming(model: torch.nn.Module) -> Callable[[str], str]:
    """The model's name for a checkpoint tensor name: transformers (>= 5) renames some keys as it loads them
    (Kimi-Linear's `block_sparse_moe.` becomes `mlp.`, its `self_attn.f_a_proj.` `self_attn.forget_gate.f_a_proj.`),
    by the model's `WeightRenaming`s; keys that a `WeightConverter` merges (stacked experts) keep their name and
    find no parameter. Where transformers has no such mapping, names are left as they are.

    >>> bind(model, shards, model_name=checkpoint_renaming(model))  # doctest: +SKIP
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return lambda name: name
    renamings = [t for t in get_model_conversion_mapping(model)  # type: ignore[arg-type]
                 if isinstance(t, WeightRenaming)]

    def renamed(name: str) -> str:
        for renaming in renamings:  # in order, each on the last one's result, as transformers loads
            name = renaming.rename_source_key(name)[0]
        return name

    return renamed


def _read_config(directory: Path, need_manifest: bool = True) -> dict[str, Any]:
    if need_manifest and not (directory / MANIFEST_NAME).is_file():
        raise RuntimeShardError(f"{directory}: no {MANIFEST_NAME}; is it an output directory of `shardprep convert`?")
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeShardError(f"{path}: not found; copy the source's config.json into {directory}") from None
    except json.JSONDecodeError as exc:
        raise RuntimeShardError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _target_placeholders(shards: RankShards) -> dict[str, torch.Tensor]:
    """A zero-stride expansion of one element per target: transformers assigns it without copying."""
    return {e.name: torch.zeros((1,), dtype=torch_dtype(e.dtype, tensor=e.name)).expand(e.shape)
            for record in shards.manifest.layers for e in record.entries}


def _from_state_dict(directory: Path, config_dict: dict[str, Any], state_dict: dict[str, torch.Tensor],
                     trust_remote_code: bool = False) -> torch.nn.Module:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    causal = _names_causal_lm(config_dict)
    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if causal else MODEL_MAPPING
    auto_map = config_dict.get("auto_map") or {}
    remote = auto_map.get("AutoModelForCausalLM" if causal else "AutoModel")
    try:
        model_class: Any
        if remote and trust_remote_code:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module

            model_class = get_class_from_dynamic_module(remote, str(directory))
        else:
            model_class = mapping[type(config)]
    except KeyError:
        raise RuntimeShardError(
            f"{directory / 'config.json'}: transformers {transformers.__version__} has no "
            f"{'causal-LM ' if mapping is MODEL_FOR_CAUSAL_LM_MAPPING else ''}model class for "
            f"model_type {config_dict.get('model_type')!r}"
        ) from None
    model, info = _from_pretrained(model_class, config_dict, None, config=config, state_dict=state_dict, dtype="auto",
                                   output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise RuntimeShardError(
            f"{directory}: the model needs {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if missing[1:] else "")
            + f" but neither the replicated safetensors nor the manifest have it; was DIR converted from a "
            f"{model_class.__name__} checkpoint?"
        )
    if model.can_generate() and (directory / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.eval()
    return model


def _from_pretrained(model_class: Any, config_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`model_class.from_pretrained(*args, **kwargs)`, a block-FP8 model's FP8 layers kept and computed by
    shardprep's kernels; what from_pretrained returns (the model, or with `output_loading_info` the pair)."""
    block = block_size(config_dict)
    if block is None:
        return model_class.from_pretrained(*args, **kwargs)
    with _fp8_layers_kept():
        loaded = model_class.from_pretrained(*args, **kwargs)
    use_block_fp8_kernels(loaded[0] if kwargs.get("output_loading_info") else loaded, block)
    return loaded


@contextlib.contextmanager
def _fp8_layers_kept() -> Iterator[None]:
    """transformers builds FP8Linear / FP8Experts layers for a block-FP8 checkpoint, also without a GPU.

    Its FP8 quantizer dequantizes the whole model to bf16 at load on a machine without a GPU, because its
    own kernels need one; shardprep computes those layers itself (block_fp8.py), so the FP8 codes are kept
    (and a bound target is then the FP8 view the manifest describes). transformers' check for accelerate,
    which the FP8 layers' construction needs, is kept.
    """
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise RuntimeShardError("a block-FP8 model needs accelerate to build its FP8 layers: pip install accelerate "
                                "(or shardprep[hf])")
    original = FineGrainedFP8HfQuantizer.validate_environment

    def keep_fp8(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    FineGrainedFP8HfQuantizer.validate_environment = keep_fp8  # type: ignore[method-assign]
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = original  # type: ignore[method-assign]
