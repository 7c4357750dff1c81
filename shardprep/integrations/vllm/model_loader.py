"""The model loader behind `--load-format shardprep`: vLLM's loader lifecycle, each step handed to the shared flows.

vLLM calls `create_model` (build), then `load_weights`, then runs its own post-load processing inside
`load_model`; the target model first, then, with speculative decoding, the draft model with a loader of its own.
What each step does is the flows' (`sharded_load.ShardedLoad`, `drafts.DraftLoad`, `output_weights.load_full`),
asking vLLM's questions through `VllmAdapter`.
"""

from __future__ import annotations

from torch import nn
from vllm.config import ModelConfig, VllmConfig, get_current_vllm_config
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ...manifests.manifest import load_manifest
from ...runtime.binding import Binding
from ...runtime.layer_ops import SPLITTING_OPS
from ..drafts import DraftLoad, hand_to_draft
from ..load_options import ShardprepLoadOptions
from ..output_weights import load_full
from ..sharded_load import ShardedLoad
from . import cpu_workarounds
from .adapter import VllmAdapter


class ShardprepModelLoader(BaseModelLoader):
    """Load a vLLM model from a `shardprep convert` output directory (`model_config.model`).

    vLLM builds the model and post-processes its weights as for any checkpoint; this loader supplies the
    weights: all of them rebuilt from the rank files (full mode), or only the non-targets, the targets
    bound to this DP rank's gatherer (sharded mode, `model_loader_extra_config={"shard_weights": true}`).
    In sharded mode the model is built with its targets' weights without storage (shape, dtype and device,
    one element), so no rank ever allocates the full targets; `bind` then gives them their gathered views.

    >>> LLM(model="out/", load_format="shardprep")  # doctest: +SKIP
    """

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = ShardprepLoadOptions.from_extra_config(load_config.model_loader_extra_config)
        # Sharded mode's `create_model` replaces it with one over the configs it is given (the hand-over to a draft
        # goes under their speculative config); the layout and the logger need no config.
        self.adapter = VllmAdapter()
        self.target: ShardedLoad | None = None  # sharded mode, the target model
        self.draft: DraftLoad | None = None  # sharded mode, vLLM's draft model

    @property
    def binding(self) -> Binding | None:
        """The target's binding in sharded mode (also the draft's, once the draft is bound); None otherwise."""
        return self.target.binding if self.target is not None else None

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model)  # nothing to download: a local output directory, or a clear refusal

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        if not self.options.shard_weights:
            return super().create_model(vllm_config, model_config, prefix)

        def construct() -> nn.Module:
            return BaseModelLoader.create_model(self, vllm_config, model_config, prefix)

        directory = model_config.model
        adapter = self.adapter = VllmAdapter(vllm_config, model_config)
        if adapter.loads_draft():
            adapter.refuse_published_draft(directory, sharded=True)
            self.draft = DraftLoad(adapter, directory, self.options, adapter.deployment())
            return self.draft.build(construct)
        self.target = ShardedLoad(adapter, directory, self.options, with_draft=adapter.serves_mtp_draft(directory))
        return self.target.build(construct)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        layout = self.adapter.layout()
        if layout.dp_size > 1 and layout.platform == "cpu":
            cpu_workarounds.install_cpu_dp_collectives()
            if not layout.eager:
                cpu_workarounds.trace_moe_as_one_op(model)
        if not self.options.shard_weights:
            # The model's own config tells a draft from a target, which decides what its checkpoint may lack.
            adapter = VllmAdapter(model_config=model_config)
            if adapter.loads_draft():
                # vLLM's current config is read for a draft only, as the target's full load needs none.
                draft = VllmAdapter(get_current_vllm_config(), model_config)
                draft.refuse_published_draft(model_config.model, sharded=False)
            load_full(model, model_config.model, self.options.verify, adapter)
        elif self.draft is not None:
            self.draft.load(model)
        else:
            assert self.target is not None, "create_model builds the model in sharded mode"
            self.target.load(model)
            if self.adapter.runs_a_draft():
                hand_to_draft(self.adapter.deployment(), self.target)
                line = self.adapter.replicated_draft_line()
                if line is not None:
                    self.adapter.logger().info(line)
            if not layout.eager:
                self.adapter.add_splitting_ops(SPLITTING_OPS)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # vLLM's process_weights_after_loading runs inside, after load_weights: check that it left every
        # bound parameter where the binding put it.
        model = super().load_model(vllm_config, model_config, prefix)
        if self.target is not None and self.target.binding is not None:
            self.target.check_after_processing()
            if not VllmAdapter(vllm_config, model_config).key_compile_cache(self.target.binding.compile_key()):
                self.adapter.logger().warning(
                    "shardprep: additional_config is not a dict, so vLLM's compile cache cannot tell this sharded "
                    "model's graphs from full mode's; set VLLM_DISABLE_COMPILE_CACHE=1")
        return model
