"""The model loader behind `--load-format shardprep`: full mode or sharded mode, per the options."""

from __future__ import annotations

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ...manifests.manifest import load_manifest
from ...runtime.binding import Binding
from . import compat
from .full_mode import load_full
from .options import ShardprepLoadOptions
from .sharded_mode import load_sharded, startup_line


class ShardprepModelLoader(BaseModelLoader):
    """Load a vLLM model from a `shardprep convert` output directory (`model_config.model`).

    vLLM builds the model and post-processes its weights as for any checkpoint; this loader supplies the
    weights: all of them rebuilt from the rank files (full mode), or only the non-targets, the targets
    bound to this DP rank's gatherer (sharded mode, `model_loader_extra_config={"shard_weights": true}`).

    >>> LLM(model="out/", load_format="shardprep")  # doctest: +SKIP
    """

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = ShardprepLoadOptions.from_extra_config(load_config.model_loader_extra_config)
        self.binding: Binding | None = None

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model)  # nothing to download: a local output directory, or a clear refusal

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        directory = model_config.model
        layout = compat.current_layout()
        if layout.dp_size > 1 and layout.platform == "cpu":
            compat.install_cpu_dp_collectives()
        if not self.options.shard_weights:
            load_full(model, directory, self.options.verify)
            return
        self.binding = load_sharded(model, directory, layout, compat.keep_plain_linear, self.options.verify,
                                    self.options.shard_group_size, self.options.allow_cross_node_groups)
        compat.logger().info(startup_line(self.binding, directory))
