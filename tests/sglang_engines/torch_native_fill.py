"""Test-only SGLang plugin: give the torch-native attention backend `get_cpu_graph_seq_len_fill_value`, which
SGLang's DP-attention path calls on every CPU backend; never shipped in shardprep.

Under DP attention SGLang pads an idle rank's dummy batch with `attn_backend.get_cpu_graph_seq_len_fill_value()`
(`forward_batch_info.py`), but in 0.5.23 only the AMX backend (`intel_amx`, which needs the compiled sgl_kernel)
defines it, returning 1. Without it a DP-attention engine with `attention_backend="torch_native"` fails with an
AttributeError on its first dummy batch. Installed through SGLang's own hook point (a `sglang.srt.plugins` entry
point registering a HookRegistry class REPLACE with a subclass that adds the one method, returning 1 as the AMX
backend does), declared by the engine runner (sglang_runs.py) for its engine processes only.
"""

from __future__ import annotations

NAME = "shardprep_test_torch_native_fill"
TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    class WithCpuGraphFill(TorchNativeAttnBackend):  # type: ignore[misc]
        def get_cpu_graph_seq_len_fill_value(self) -> int:
            return 1  # the AMX backend's value: a dummy request of one token

    WithCpuGraphFill.__name__ = WithCpuGraphFill.__qualname__ = "TorchNativeAttnBackend"
    HookRegistry.register(TARGET, WithCpuGraphFill, HookType.REPLACE)
