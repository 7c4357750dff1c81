"""A vLLM plugin for the tests: the full-mode reference runs its sharded layers on the kernel sharded mode uses.

Sharded mode keeps every bound linear layer on `torch.nn.functional.linear` (`compat.keep_plain_linear`: vLLM's
CPU GEMMs repack a weight once, which a weight gathered anew every forward cannot be). On a CPU with AVX-512 or
AMX, vLLM's own full-mode layers use oneDNN or its SGL kernels instead, whose bf16 rounding differs, so a token
comparison of sharded mode against full mode would compare kernels as much as sharding. With
SHARDPREP_TEST_SAME_KERNELS=1 in an engine's environment, full mode marks the same layers as sharded mode would
(`_cpu_skip_gemm_dispatch`), so the two runs differ only by where the weights come from. On an AVX2-only CPU
vLLM falls back to `F.linear` everywhere and this changes nothing.

Registered as a second `vllm.general_plugins` entry point: `engine_runs.run_engines` declares it in a
directory it puts on PYTHONPATH for every plan.
"""

from __future__ import annotations

import os

ENV = "SHARDPREP_TEST_SAME_KERNELS"
SAME_KERNELS = {ENV: "1"}
"""A plan's `env` for engines whose tokens are compared with sharded mode's."""
NAME = "shardprep_same_kernels"


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from shardprep.integrations.vllm import model_loader
    from shardprep.manifests import load_manifest

    loader = model_loader.ShardprepModelLoader
    if getattr(loader, "_same_kernels", False):  # vLLM calls every plugin once per process, maybe more
        return
    original = loader.load_weights

    def load_weights(self, model, model_config) -> None:
        original(self, model, model_config)
        if self.options.shard_weights:
            return
        is_target = model_loader.bound_later(load_manifest(model_config.model))
        for name, module in model.named_modules():
            if any(is_target(f"{name}.{p}") for p, _ in module.named_parameters(recurse=False)):
                module._cpu_skip_gemm_dispatch = True

    loader.load_weights = load_weights
    loader._same_kernels = True
