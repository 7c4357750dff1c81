"""A vLLM plugin for the tests: the full-mode reference runs its sharded layers on the kernels, and if asked in the
graph, that sharded mode uses.

Sharded mode keeps every bound linear layer on `torch.nn.functional.linear` (`VllmAdapter.keep_plain`: vLLM's
CPU GEMMs repack a weight once, which a weight gathered anew every forward cannot be). On a CPU with AVX-512 or
AMX, vLLM's own full-mode layers use oneDNN or its SGL kernels instead, whose bf16 rounding differs, so a token
comparison of sharded mode against full mode would compare kernels as much as sharding. With
SHARDPREP_TEST_SAME_KERNELS=1 in an engine's environment, full mode marks the same layers as sharded mode would
(`_cpu_skip_gemm_dispatch`: the unquantized ones; a quantized target goes through vLLM's own processing in both
modes), so the two runs differ only by where the weights come from. On an AVX2-only CPU
vLLM falls back to `F.linear` everywhere and this changes nothing.

Compiled by Inductor, kernels are not enough: sharded mode's graph has the two gather ops around every bound
layer, which take the layer's input and output tensors and declare its weights written, so Inductor must
materialize (round to bf16) the hidden states there, where the unsharded graph fuses across the layer boundary
in fp32. The two graphs then round differently, and whether that moves a token depends on the CPU (an AMD EPYC
met a tie where an Intel machine did not). With SHARDPREP_TEST_SAME_GRAPH=1 as well, full mode binds the same
layers with the same ops and a gatherer that gathers nothing (each weight stays its own loaded tensor), so both
graphs are cut at the same places and round alike: the Inductor comparison is then exact, log-probabilities
included (docs/serving/vllm.md, "Compiled serving in vLLM").

Registered as a second `vllm.general_plugins` entry point: `engine_runs.run_engines` declares it in a
directory it puts on PYTHONPATH for every plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "SHARDPREP_TEST_SAME_KERNELS"
SAME_KERNELS = {ENV: "1"}
"""A plan's `env` for engines whose tokens are compared with sharded mode's."""
GRAPH_ENV = "SHARDPREP_TEST_SAME_GRAPH"
SAME_GRAPH = {**SAME_KERNELS, GRAPH_ENV: "1"}
"""A plan's `env` for compiled engines whose graphs must match sharded mode's too (implies SAME_KERNELS)."""
NAME = "shardprep_same_kernels"
SAME_GRAPH_LINE = "shardprep test plugin: full mode runs the gather ops, gathering nothing, around layers"
"""What a full-mode engine logs once it is bound that way (the tests check that it was)."""


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from shardprep.integrations.sharded_load import bound_later
    from shardprep.integrations.vllm import model_loader
    from shardprep.integrations.vllm.adapter import VllmAdapter
    from shardprep.manifests import load_manifest

    loader = model_loader.ShardprepModelLoader
    if getattr(loader, "_same_kernels", False):  # vLLM calls every plugin once per process, maybe more
        return
    original = loader.load_weights

    def load_weights(self, model, model_config) -> None:
        original(self, model, model_config)
        if self.options.shard_weights:
            return
        manifest = load_manifest(model_config.model)
        is_target = bound_later(manifest)
        for name, module in model.named_modules():
            # As sharded mode does (VllmAdapter.keep_plain): a quantized module keeps vLLM's own processing.
            if any(is_target(f"{name}.{p}") for p, _ in module.named_parameters(recurse=False)) and \
                    not VllmAdapter().is_quantized(module):
                module._cpu_skip_gemm_dispatch = True
        if os.environ.get(GRAPH_ENV) == "1":
            bind_ops_without_gathers(model, manifest)

    loader.load_weights = load_weights
    loader._same_kernels = True


@dataclass
class _Resident:
    """What `bind` reads of a RankShards: the manifest, the device of the ops' order tensor, and the directory
    (a layer mismatch's refusal reads its config.json; None: no directory to read)."""

    manifest: object
    device: object
    directory: object = None


class _NoGathers:
    """A gatherer that gathers nothing: every view is the model's own loaded parameter, named as in the manifest
    (vLLM's Qwen3-MoE names its parameters as the checkpoint does, fused views included)."""

    def __init__(self, model, manifest):
        self.model, self.manifest = model, manifest
        self.layers = tuple(r.layer for r in manifest.layers)

    def views(self, layer: int) -> dict:
        record = self.manifest.layer(layer)
        names = [v.name for v in record.views] + [e.name for e in record.entries]
        params = dict(self.model.named_parameters())
        return {name: params[name].data for name in names if name in params}

    def begin(self, step=None) -> None:
        pass

    def wait(self, layer: int) -> None:
        pass

    def done(self, layer: int) -> None:
        pass

    def idle_step(self, step=None) -> None:
        pass


def bind_ops_without_gathers(model, manifest):
    """Hook `model` as sharded mode does (the same ops around the same layers, on the same parameters), with
    weights that stay where full mode loaded them."""
    from shardprep.integrations.vllm.adapter import VllmAdapter
    from shardprep.runtime.binding import bind
    from shardprep.runtime.layer_ops import SPLITTING_OPS

    device = next(model.parameters()).device
    binding = bind(model, _Resident(manifest, device), _NoGathers(model, manifest))
    if not VllmAdapter().layout().eager:
        VllmAdapter().add_splitting_ops(SPLITTING_OPS)  # as sharded mode does (piecewise graphs: CUDA only)
    VllmAdapter().logger().info(f"{SAME_GRAPH_LINE} {[layer.index for layer in binding.layers]}")
    return binding
