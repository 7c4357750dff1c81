"""The model loader behind SGLang's `--load-format shardprep`: full mode or sharded mode, per the options."""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype
from torch import nn

from ...errors import ShardprepError
from ...manifests.manifest import Manifest, load_manifest
from ...runtime.binding import Binding
from ..load_options import ShardprepLoadOptions
from ..output_weights import output_weights
from ..sharded_mode import bound_later, check_layout, load_sharded, parameter_names, startup_line
from . import compat


class ShardprepModelLoader(DefaultModelLoader):
    """Load an SGLang model from a `shardprep convert` output directory (`model_config.model_path`).

    Full mode: SGLang builds the model, quantization and post-processing included, exactly as for the source
    checkpoint (DefaultModelLoader.load_model); only the weights come from the output, every tensor of the
    source checkpoint under its checkpoint name, the targets rebuilt from all rank files, each checksum checked
    (`verify`), under the output's swap lock while read.

    Sharded mode (`model_loader_extra_config={"shard_weights": true}`, DP attention with attention TP 1): each DP
    rank maps only its own rank file, binds the model's targets to a gatherer's views over its shard group (one
    gather per layer, one layer ahead, two slots) and loads only the other weights; this happens inside
    `load_model`, before SGLang sizes its KV pool from the memory left. A target that SGLang splits over TP or
    pads is refused (`refuse_unshardable`). Quantized targets (block FP8) are processed at load, one layer at a
    time, by SGLang's own step (`compat.process_quantized`), and what its kernels read afterwards is sharded
    (processed_layers.py). SGLang's post-load step then runs on the rest of the model as usual: DeepseekV2's
    `post_load_weights` reads only kv_b_proj, which the deepseek-v3 preset keeps replicated.

    >>> sgl.Engine(model_path="out/", load_format="shardprep")  # doctest: +SKIP
    """

    def __init__(self, load_config: LoadConfig):
        # BaseModelLoader's, not DefaultModelLoader's: that one refuses any extra-config key but its own.
        BaseModelLoader.__init__(self, load_config)
        self.options = ShardprepLoadOptions.from_extra_config(load_config.model_loader_extra_config)
        self.binding: Binding | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model_path)  # nothing to download: a local output directory, or a clear refusal

    def _get_all_weights(self, model_config: ModelConfig, model: nn.Module
                         ) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from output_weights(model_config.model_path, self.options.verify)

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        if not self.options.shard_weights:
            return super().load_model(model_config=model_config, device_config=device_config)
        directory = model_config.model_path
        device = torch.device(device_config.device)
        manifest = load_manifest(directory)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            # The targets' weights are built without storage, so no rank ever holds them whole: the load peaks
            # at its steady state.
            is_target = bound_later(manifest)

            def sglang_target(name: str) -> bool:
                return is_target(compat.manifest_name(name))

            with device, compat.target_weights_without_storage(sglang_target) as made:
                model = _initialize_model(model_config, self.load_config, quant_config)
            layout = compat.current_layout(device)
            # The layout's refusals first: under attention TP > 1 every attention target is split too.
            check_layout(layout, manifest, directory, self.options.shard_group_size)
            refuse_unshardable(model, model_config, manifest, directory, sglang_target)
            self.binding, processed = load_sharded(
                model, directory, layout, compat.keep_plain_linear, self.options.verify,
                self.options.shard_group_size, self.options.allow_cross_node_groups, manifest=manifest,
                is_quantized=compat.is_quantized, process_quantized=compat.process_quantized,
                model_name=compat.model_name)
            bound = parameter_names(model, {id(p) for p in self.binding.target_parameters.values()})
            unbound = [name for name, _ in made if name not in bound]
            if unbound:
                raise ShardprepError(f"{unbound[0]!r} was built without storage as a target of {directory}, but no "
                                     "manifest tensor was bound to it; was the directory converted from this model?")
            DefaultModelLoader.postprocess_weights(model, device)
        compat.logger().info(startup_line(self.binding, directory, processed, server="SGLang")
                             + f"; {len(made)} target weights built without storage")
        return model.eval()


def refuse_unshardable(model: nn.Module, model_config: ModelConfig, manifest: Manifest, directory: str,
                       is_target: Callable[[str], bool]) -> None:
    """Refuse, in one line, targets that SGLang built so that no rank holds the checkpoint's replicated weight:
    split over its TP ranks, or padded (MLP sizes on the CPU under TP).

    >>> refuse_unshardable(model, model_config, manifest, "out/", is_target)  # doctest: +SKIP
    """
    split = compat.split_targets(model, is_target)
    if split:
        name, ranks = split[0]
        advice = ("set SGLANG_SHARED_EXPERT_TP1=1 (SGLang then replicates the shared experts, as under DeepEP), "
                  if ".shared_experts." in name else "")
        raise ShardprepError(f"{directory}: SGLang splits the target {name} over its {ranks} TP ranks, so it is not "
                             f"replicated under DP attention and cannot be sharded; {advice}convert with a preset "
                             "that leaves it out, or serve in full mode")
    padded = compat.padded_sizes(model_config)
    mlp_targets = [name for name in manifest.target_names() if ".mlp." in name]
    if padded and mlp_targets:
        size, (checkpoint, sglangs) = next(iter(padded.items()))
        raise ShardprepError(f"{directory}: SGLang pads {size} from {checkpoint} to {sglangs} on the CPU under TP, so "
                             f"MLP targets such as {mlp_targets[0]} are built larger than the checkpoint's; serve it "
                             f"in full mode, or convert a checkpoint whose {size} SGLang leaves as is (a multiple of "
                             "tp_size x 32, or of tp_size x the block size when block-quantized)")
