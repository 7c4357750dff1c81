"""A vLLM plugin for the tests: a probe of what a quantized kernel reads, by moving its tensors after loading.

Sharded mode binds a processed module's registered parameters to gathered views, so it is right only if vLLM's
kernel reads those parameters at every forward and nothing else: not an address kept from before (a oneDNN handle
holding the scale's pointer), not a copy inside an object. With SHARDPREP_TEST_MOVE_WEIGHTS in a plan's
environment the probe is installed, and a full-mode engine loaded while it is "1" (a run's own `env`), once vLLM
has processed the weights, gives every quantized module that owns a
target of the directory a fresh copy of each registered parameter and overwrites the old storage with 0x55 bytes.
A kernel that reads only what is registered gives the same tokens as without the move; one that still reads an
old address reads the 0x55 bytes, and its tokens change. It logs `LINE` with the count of tensors moved.

Registered as a `vllm.general_plugins` entry point by `engine_runs.run_engines`.
"""

from __future__ import annotations

import os

ENV = "SHARDPREP_TEST_MOVE_WEIGHTS"
ARMED = {ENV: "0"}
"""A plan's `env`: the probe installed, acting in no engine unless a run's own `env` is MOVE_WEIGHTS."""
MOVE_WEIGHTS = {ENV: "1"}
NAME = "shardprep_moved_weights"
LINE = "shardprep test plugin: moved the registered tensors of quantized target modules:"


def register() -> None:
    if ENV not in os.environ:  # plugins load once per process: installed for the plan, acting per engine
        return
    from shardprep.integrations.vllm import model_loader

    loader = model_loader.ShardprepModelLoader
    if getattr(loader, "_moved_weights", False):  # vLLM calls every plugin once per process, maybe more
        return
    original = loader.load_model

    def load_model(self, vllm_config, model_config, prefix=""):
        model = original(self, vllm_config, model_config, prefix)
        if os.environ.get(ENV) == "1" and not self.options.shard_weights:
            move_quantized_targets(model, model_config.model)
        return model

    loader.load_model = load_model
    loader._moved_weights = True


def move_quantized_targets(model, directory) -> None:
    import torch

    from shardprep.integrations.sharded_load import bound_later
    from shardprep.integrations.vllm.adapter import VllmAdapter
    from shardprep.manifests import load_manifest

    is_target = bound_later(load_manifest(directory))
    moved = modules = 0
    for name, module in model.named_modules():
        # By attribute name, a parameter vLLM set to None included (oneDNN's int8 weight).
        if not VllmAdapter().is_quantized(module) or not any(is_target(f"{name}.{p}") for p in module._parameters):
            continue
        modules += 1
        for param in module._parameters.values():
            if param is None:
                continue
            old = param.data
            param.data = old.clone()
            with torch.no_grad():  # all of its storage, whatever the view's strides
                torch.empty(0, dtype=torch.uint8, device=old.device).set_(old.untyped_storage()).fill_(0x55)
            moved += 1
    VllmAdapter().logger().warning("%s %d tensors of %d modules", LINE, moved, modules)
