"""The model loader behind `--load-format shardprep`: full mode or sharded mode, per the options."""

from __future__ import annotations

from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ...errors import ShardprepError
from ...manifests.manifest import Manifest, load_manifest
from ...runtime.binding import Binding
from ...runtime.layer_ops import SPLITTING_OPS
from ..load_options import ShardprepLoadOptions
from ..sharded_load import (
    bound_later,
    draft_startup_line,
    load_draft,
    load_sharded,
    parameter_names,
    serving_manifest,
    startup_line,
)
from . import adapter, cpu_workarounds
from .full_mode import load_full


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
        self.binding: Binding | None = None
        self._manifest: Manifest | None = None  # read once by create_model in sharded mode, used by load_weights
        self._draft_model = False  # this loader builds vLLM's draft model (DeepSeekMTP), not the target
        self._serves_draft = False  # the target is served with its MTP draft (speculative_config)
        self._without_storage: list[tuple[str, nn.Parameter]] = []
        self._without_storage_places: dict[int, tuple[nn.Module, str]] = {}
        self._bound_before_processing: dict[str, adapter.ParameterPlace] = {}

    def download_model(self, model_config: ModelConfig) -> None:
        load_manifest(model_config.model)  # nothing to download: a local output directory, or a clear refusal

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        if not self.options.shard_weights:
            return super().create_model(vllm_config, model_config, prefix)
        self._manifest = serving_manifest(model_config.model)
        self._draft_model = adapter.is_draft_model(model_config)
        self._serves_draft = adapter.serves_mtp_draft(vllm_config)
        with adapter.target_weights_without_storage(bound_later(self._manifest, self._draft_model)) as made:
            model = super().create_model(vllm_config, model_config, prefix)
        self._without_storage = made
        # Where each one is: a draft module processed at load holds a new parameter object under the same attribute.
        made_ids = {id(param) for _, param in made}
        self._without_storage_places = {id(p): (module, attribute) for module in model.modules()
                                        for attribute, p in module._parameters.items() if id(p) in made_ids}
        return model

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        directory = model_config.model
        layout = adapter.current_layout()
        if layout.dp_size > 1 and layout.platform == "cpu":
            cpu_workarounds.install_cpu_dp_collectives()
            if not layout.eager:
                cpu_workarounds.trace_moe_as_one_op(model)
        if not self.options.shard_weights:
            load_full(model, directory, self.options.verify, optional=adapter.defaulted_parameters(model))
            return
        if self._draft_model:
            self._load_draft(model, directory)
            return
        self.binding, processed = load_sharded(
            model, directory, layout, adapter.keep_plain_linear, self.options.verify, self.options.shard_group_size,
            self.options.allow_cross_node_groups, refuse_post_processed=adapter.refuse_post_processed,
            manifest=self._manifest, is_quantized=adapter.is_quantized, process_quantized=adapter.process_quantized,
            optional=adapter.defaulted_parameters(model), model_name=adapter.module_names(model),
            draft=self._serves_draft)
        self._bound_before_processing = adapter.bound_places(model, self.binding.target_parameters)
        # By name: a quantized module processed at load holds new parameter objects under the same names.
        bound = {id(param) for param in self.binding.target_parameters.values()}
        bound_names = parameter_names(model, bound)
        unbound = [name for name, _ in self._without_storage if name not in bound_names]
        if unbound:
            raise ShardprepError(f"{unbound[0]!r} was built without storage as a target of {directory}, but no "
                                 "manifest tensor was bound to it; was the directory converted from this model?")
        if not layout.eager:
            adapter.add_splitting_ops(SPLITTING_OPS)
        adapter.logger().info(startup_line(self.binding, directory, processed))

    def _load_draft(self, model: nn.Module, directory: str) -> None:
        assert self._manifest is not None
        binding, processed = load_draft(
            model, directory, self._manifest, adapter.mtp_blocks, adapter.keep_plain_linear, self.options.verify,
            adapter.is_quantized, adapter.defaulted_parameters(model),
            refuse_post_processed=adapter.refuse_post_processed)
        bound = set() if binding is None else {id(p) for p in binding.draft_parameters.values()}
        places = self._without_storage_places
        unbound = [name for name, param in self._without_storage
                   if id(places[id(param)][0]._parameters.get(places[id(param)][1])) not in bound]
        if unbound:
            raise ShardprepError(f"{unbound[0]!r} was built without storage as a draft target of {directory}, but "
                                 "no manifest tensor was bound to it; was the directory converted from this model?")
        if binding is not None:
            adapter.logger().info(draft_startup_line(binding, directory, processed))

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        # vLLM's process_weights_after_loading runs inside, after load_weights: check that it left every
        # bound parameter where the binding put it.
        model = super().load_model(vllm_config, model_config, prefix)
        if self.binding is not None:
            adapter.refuse_replaced_after_processing(self._bound_before_processing, self.binding.target_parameters)
            if not adapter.key_compile_cache(vllm_config, self.binding.compile_key()):
                adapter.logger().warning(
                    "shardprep: additional_config is not a dict, so vLLM's compile cache cannot tell this sharded "
                    "model's graphs from full mode's; set VLLM_DISABLE_COMPILE_CACHE=1")
        return model
