"""Test-only SGLang plugin: DeepSeek's MLA attention on the torch-native backend takes MLA's absorbed path in
every forward, prefill included; never shipped in shardprep.

SGLang 0.5.23's DeepseekV2 attention asks a per-backend handler which path to run (`AttentionBackendRegistry`,
models/deepseek_common/attention_backend_handler.py). `torch_native` has none, so it gets the Triton backend's,
which runs a fresh prefill as plain multi-head attention (`AttnForwardMethod.MHA`: K and V of
qk_nope + qk_rope and v_head_dim per head). The torch-native backend then reads the whole sequence's K and V back
from the KV pool, which under MLA holds the compressed latent (kv_lora_rank + qk_rope_head_dim), and fails
(`Expected size for first two dimensions of batch2 tensor to be: [4, 24] but got: [4, 40]`). The handler
registered here gives the path SGLang's own dispatch gives every backend for MLA outside that case
(`_dispatch_mla_subtype`: `AttnForwardMethod.MLA`, the absorbed path through `w_kc`/`w_vc`, whose attention is
multi-query over the latent cache, which the torch-native backend computes). Installed through SGLang's own
registry, from a `sglang.srt.plugins` entry point declared by the engine runner (sglang_runs.py) for its engine
processes only; no SGLang file is changed.
"""

from __future__ import annotations

from typing import Any

NAME = "shardprep_test_torch_native_mla"


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    def handle_attention_torch_native(attn: Any, forward_batch: Any) -> Any:
        return _dispatch_mla_subtype(attn, forward_batch)  # AttnForwardMethod.MLA on the CPU without AMX

    AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)
