"""The model loader behind SGLang's `--load-format shardprep`: SGLang's loader lifecycle, each step handed to the
shared flows (`sharded_load.ShardedLoad`, `drafts.DraftLoad`, `output_weights`), asking SGLang's questions through
`SglangAdapter`.

SGLang builds, loads and post-processes a model in one call, `load_model`; with speculative decoding its scheduler
process loads the target, then the draft (a ModelRunner of its own, `is_draft_worker`, with `model_config.
is_draft_model` set), each with a loader of its own made from the same load format (`--speculative-draft-load-format`
if given, else the target's) and the same `--model-loader-extra-config`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable

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

from ...manifests.manifest import load_manifest
from ...runtime.binding import Binding
from ..drafts import DraftLoad, hand_to_draft
from ..load_check import check_all_loaded, tracked_loading
from ..load_options import ShardprepLoadOptions
from ..output_weights import output_weights
from ..sharded_load import ShardedLoad
from .adapter import SglangAdapter


class ShardprepModelLoader(DefaultModelLoader):
    """Load an SGLang model from a `shardprep convert` output directory (`model_config.model_path`).

    Full mode: SGLang builds the model, quantization and post-processing included, exactly as for the source
    checkpoint (DefaultModelLoader.load_model); only the weights come from the output, every tensor of the
    source checkpoint under its checkpoint name, the targets rebuilt from all rank files, each checksum checked
    (`verify`), under the output's swap lock while read.

    Sharded mode (`model_loader_extra_config={"shard_weights": true}`, DP attention with attention TP 1): SGLang
    builds the model, loads and post-processes it in `load_model`, before it sizes its KV pool from the memory
    left; the flow runs there, in that order (sharded_load.py). A target that SGLang splits over TP or pads is
    refused (`SglangAdapter.refuse_unshardable`). SGLang's post-load step then runs on the model as usual:
    DeepseekV2's `post_load_weights` reads only kv_b_proj, which the deepseek-v3 preset keeps replicated; Kimi K3's
    (run inside its `load_weights`) also merges bound weights into buffers of its own, which are pointed at the
    gathered bytes or dropped once the model is bound (`SglangAdapter.relink_merged_weights`).

    With speculative decoding, the target's load is handed to the draft's under SGLang's ServerArgs, the one object
    both loads see in the scheduler process (`drafts.hand_to_draft`); the draft (a NextN draft of the target's own
    MTP layer, or a DFlash draft model from its own output) is then bound in the target's gatherer
    (`drafts.DraftLoad`).

    >>> sgl.Engine(model_path="out/", load_format="shardprep")  # doctest: +SKIP
    """

    def __init__(self, load_config: LoadConfig):
        # BaseModelLoader's, not DefaultModelLoader's: that one refuses any extra-config key but its own.
        BaseModelLoader.__init__(self, load_config)
        self.options = ShardprepLoadOptions.from_extra_config(load_config.model_loader_extra_config)
        self.target: ShardedLoad | None = None
        self.draft: DraftLoad | None = None
        self._directory = ""
        self._model_config: ModelConfig | None = None

    @property
    def binding(self) -> Binding | None:
        """The target's binding in sharded mode (also the draft's, once bound); None otherwise."""
        load = self.target if self.target is not None else self.draft
        return load.binding if load is not None else None

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model_path)  # nothing to download: a local output directory, or a clear refusal

    def _get_all_weights(self, model_config: ModelConfig, model: nn.Module
                         ) -> Generator[tuple[str, torch.Tensor], None, None]:
        yield from output_weights(model_config.model_path, self.options.verify)

    def load_weights_and_postprocess(self, model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                                     target_device: torch.device) -> None:
        """Full mode's load (SGLang's own, with the weights from DIR), watched: SGLang's models report nothing
        from `load_weights`, so every parameter must have gone through a weight loader (load_check.py)."""
        adapter = SglangAdapter(self._model_config, target_device)
        with tracked_loading(model, adapter.default_weight_loader()) as seen:
            DefaultModelLoader.load_weights_only(model, weights, target_device)
        check_all_loaded(model, None, self._directory, also=adapter.defaulted_parameters(model), seen=seen)
        DefaultModelLoader.postprocess_weights(model, target_device)

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        self._directory, self._model_config = model_config.model_path, model_config
        device = torch.device(device_config.device)
        adapter = SglangAdapter(model_config, device)
        if adapter.loads_draft():
            adapter.refuse_published_draft(model_config.model_path, self.options.shard_weights)
        if not self.options.shard_weights:
            return super().load_model(model_config=model_config, device_config=device_config)
        deployment = adapter.deployment()
        load: ShardedLoad | DraftLoad
        if adapter.loads_draft():
            load = self.draft = DraftLoad(adapter, model_config.model_path, self.options, deployment)
        else:
            load = self.target = ShardedLoad(adapter, model_config.model_path, self.options,
                                             with_draft=adapter.serves_mtp_draft(model_config.model_path))
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with device:
                model = load.build(lambda: _initialize_model(model_config, self.load_config, quant_config))
            binding = load.load(model)
            if self.target is not None and binding is not None:
                adapter.relink_merged_weights(model, binding)
            DefaultModelLoader.postprocess_weights(model, device)
            if self.target is not None:
                self.target.check_after_processing()
                if adapter.runs_a_draft():
                    hand_to_draft(deployment, self.target)
        return model.eval()
