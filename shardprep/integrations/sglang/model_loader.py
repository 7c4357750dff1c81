"""The model loader behind SGLang's `--load-format shardprep`: full mode (sharded mode: not yet, refused)."""

from __future__ import annotations

from collections.abc import Generator

import torch
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import BaseModelLoader, DefaultModelLoader
from torch import nn

from ...errors import ShardprepError
from ...manifests.manifest import load_manifest
from ..load_options import ShardprepLoadOptions
from ..output_weights import output_weights


class ShardprepModelLoader(DefaultModelLoader):
    """Load an SGLang model from a `shardprep convert` output directory (`model_config.model_path`).

    Full mode: SGLang builds the model, quantization and post-processing included, exactly as for the source
    checkpoint (DefaultModelLoader.load_model); only the weights come from the output, every tensor of the
    source checkpoint under its checkpoint name, the targets rebuilt from all rank files, each checksum checked
    (`verify`), under the output's swap lock while read.

    >>> sgl.Engine(model_path="out/", load_format="shardprep")  # doctest: +SKIP
    """

    def __init__(self, load_config: LoadConfig):
        # BaseModelLoader's, not DefaultModelLoader's: that one refuses any extra-config key but its own.
        BaseModelLoader.__init__(self, load_config)
        self.options = ShardprepLoadOptions.from_extra_config(load_config.model_loader_extra_config)
        if self.options.shard_weights:
            raise ShardprepError("model_loader_extra_config: shard_weights is not supported by SGLang's load format "
                                 "shardprep yet; leave it out (full mode)")

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model_path)  # nothing to download: a local output directory, or a clear refusal

    def _get_all_weights(self, model_config: ModelConfig, model: nn.Module
                         ) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from output_weights(model_config.model_path, self.options.verify)
