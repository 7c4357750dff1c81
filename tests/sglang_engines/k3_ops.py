"""Test-only SGLang plugin: torch references for the ops of Kimi K3's forward that SGLang 0.5.23 cannot run on the
CPU, so a tiny K3 generates there and can be tested by its tokens; never shipped in shardprep.

SGLang builds and loads K3 on the CPU (kimi_k3_build.py), but its forward calls Triton kernels (no Triton CPU
backend here) and a compiled `sgl_kernel` op (no CPU build is published). With SHARDPREP_TEST_K3_OPS=1 in an
engine's environment, each of those six is replaced by a torch reference written from what the op computes (where
its kernel computes in float32 the reference does too, and it rounds where the kernel stores):

- `srt/layers/attention/linear/kda_backend.py`: `causal_conv1d_fn` (KDA's prefill short convolution, Triton) and
  `causal_conv1d_update` (its decode step, bound under `is_cpu()` to `sgl_kernel.mamba.causal_conv1d_update_cpu`,
  which this plugin provides as the module `sgl_kernel.mamba`);
- `srt/layers/attention/linear/kernels/kda_triton.py`: `chunk_kda` (KDA prefill) and
  `fused_sigmoid_gating_delta_rule_update` (KDA decode), which that file does not even import under `is_cpu()`:
  the gated delta rule token by token in float32 (the chunked form computes the same function);
- `kernels/ops/attention/fla/fused_norm_gate.py`: `FusedRMSNormGated.forward` (K3's `o_norm` is sigmoid-gated;
  the CPU branch, taken only with AMX, takes silu only);
- `srt/layers/attn_residual.py`: `_mix_fused` (attention residuals: score every block source by its RMS-normed dot
  with the score projection, softmax, mix; Triton).

Each is checked against an independent formulation in test_k3_ops.py (fla-core's pure-torch KDA, `F.conv1d`, the
formula). The references use no matmul kernel (products and sums only), so nothing depends on which GEMM a CPU
picks, and SGLang's own loader, shardprep's full mode and its sharded mode all run the same arithmetic.
Only the paths a plain CPU engine takes are written: speculative verification, prefix-cache state tracking and
residual fusion raise, naming the argument. Installed through SGLang's own hook point (a `sglang.srt.plugins` entry
point registering HookRegistry REPLACE hooks), declared by the engine runner (sglang_runs.py).
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

import torch

NAME = "shardprep_test_k3_ops"
ENV = "SHARDPREP_TEST_K3_OPS"
LINE = "shardprep test plugin: Kimi K3's Triton ops run as torch references"
"""What each engine process logs once the references are registered (the tests check that they were)."""
PAD_SLOT_ID = -1  # SGLang's mamba kernels' padding slot
KDA_BACKEND = "sglang.srt.layers.attention.linear.kda_backend"
KDA_TRITON = "sglang.srt.layers.attention.linear.kernels.kda_triton"
_library: Any = None  # the torch.library fragment naming GDN's CPU ops (kept alive for the process)


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`); does nothing unless SHARDPREP_TEST_K3_OPS=1."""
    if os.environ.get(ENV) != "1":
        return
    import importlib

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _library
    # kda_backend imports `sgl_kernel.mamba` at module level on the CPU: it must exist before the hooks import it.
    # SGLang's hybrid-attention setup imports the GDN backend too (gdn_backend.py, kernels/gdn_triton.py), which
    # binds GDN's CPU kernels at import; K3 never calls them, so they raise if anything does.
    sgl_kernel = importlib.import_module("sgl_kernel")
    mamba = types.ModuleType("sgl_kernel.mamba")
    mamba.causal_conv1d_update_cpu = causal_conv1d_update  # type: ignore[attr-defined]
    for name in ("causal_conv1d_fn_cpu", "chunk_gated_delta_rule_cpu"):
        setattr(mamba, name, sgl_kernel.not_stood_in(f"mamba.{name}"))
    sys.modules["sgl_kernel.mamba"] = mamba
    sgl_kernel.mamba = mamba  # type: ignore[attr-defined]
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
        for name in ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu"):
            _library.define(f"{name}(Tensor x) -> Tensor")
            _library.impl(name, sgl_kernel.not_stood_in(name), "CPU")
    # kda_triton leaves both KDA names undefined under is_cpu(); its kernel class reads them as module globals.
    kda_triton = importlib.import_module(KDA_TRITON)
    kda_triton.chunk_kda = chunk_kda  # type: ignore[attr-defined]
    kda_triton.fused_sigmoid_gating_delta_rule_update = fused_sigmoid_gating_delta_rule_update  # type: ignore
    HookRegistry.register(f"{KDA_BACKEND}.causal_conv1d_fn", causal_conv1d_fn, HookType.REPLACE)
    HookRegistry.register("sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward",
                          rms_norm_gated_forward, HookType.REPLACE)
    HookRegistry.register("sglang.srt.layers.attn_residual._mix_fused", mix_fused, HookType.REPLACE)
    logging.getLogger("sglang.shardprep").warning(LINE)


# --- the short convolution ----------------------------------------------------------------------------------------


def _convolve(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: Any,
              tokens: int) -> torch.Tensor:
    """The last `tokens` outputs of a causal depthwise convolution over `window` [dim, width - 1 + tokens], in
    float32: bias + Σ_j window[:, t + j]·weight[:, j], then silu where asked. Products and sums only."""
    width = weight.shape[1]
    w = weight.float()
    out = torch.zeros(window.shape[0], tokens, dtype=torch.float32, device=window.device)
    if bias is not None:
        out += bias.float()[:, None]
    for j in range(width):
        out += window[:, j:j + tokens].float() * w[:, j:j + 1]
    if activation in ("silu", "swish", True):
        out = out * torch.sigmoid(out)
    return out


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens_cpu: Any = None,
                     cache_indices: torch.Tensor | None = None, has_initial_state: torch.Tensor | None = None,
                     activation: Any = "silu", pad_slot_id: int = PAD_SLOT_ID, **kwargs: Any) -> torch.Tensor:
    """Stands in for SGLang's Triton `causal_conv1d_fn` (KDA prefill): x [dim, tokens] holds the packed sequences
    (`query_start_loc`); sequence i convolves from the window in `conv_states[cache_indices[i]]` [dim, width - 1]
    where `has_initial_state[i]`, else from zeros, and leaves its last width - 1 inputs there. A sequence on the
    padding slot is skipped (its outputs zero). Returns [dim, tokens] in x's dtype.

    >>> x = torch.ones(2, 3); states = torch.zeros(1, 2, 3)
    >>> causal_conv1d_fn(x, torch.ones(2, 4), None, states, torch.tensor([0, 3]), activation=None).tolist()
    [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """
    if kwargs.get("block_table") is not None:
        raise NotImplementedError("causal_conv1d_fn reference: block_table is not supported")
    state_len = weight.shape[1] - 1
    out = torch.zeros_like(x)
    bounds = query_start_loc.tolist()
    for n in range(len(bounds) - 1):
        start, end = bounds[n], bounds[n + 1]
        slot = int(cache_indices[n]) if cache_indices is not None else n
        if slot == pad_slot_id or end == start:
            continue
        initial = has_initial_state is not None and bool(has_initial_state[n])
        before = conv_states[slot].to(x.dtype) if initial else x.new_zeros(x.shape[0], state_len)
        window = torch.cat([before, x[:, start:end]], dim=1)
        out[:, start:end] = _convolve(window, weight, bias, activation, end - start).to(x.dtype)
        conv_states[slot] = window[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: Any = None,
                         cache_seqlens: torch.Tensor | None = None, conv_state_indices: torch.Tensor | None = None,
                         pad_slot_id: int = PAD_SLOT_ID, **kwargs: Any) -> torch.Tensor:
    """Stands in for SGLang's `causal_conv1d_update` (KDA decode; `sgl_kernel.mamba.causal_conv1d_update_cpu` on the
    CPU): x [batch, dim] (or [batch, dim, seqlen]); row b convolves from the window in
    `conv_state[conv_state_indices[b]]` [dim, width - 1] and shifts its inputs in. A row on the padding slot is
    skipped (its output zero). Returns x's shape and dtype.

    >>> state = torch.ones(1, 2, 3)
    >>> causal_conv1d_update(torch.ones(1, 2), state, torch.ones(2, 4), conv_state_indices=torch.tensor([0])).shape
    torch.Size([1, 2])
    """
    unsupported = [name for name in ("num_accept_tokens", "intermediate_conv_window", "retrieve_parent_token")
                   if kwargs.get(name) is not None] + (["cache_seqlens"] if cache_seqlens is not None else [])
    if unsupported:
        raise NotImplementedError(f"causal_conv1d_update reference: {unsupported[0]} is not supported")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    state_len = weight.shape[1] - 1
    if conv_state.shape[-1] != state_len:
        raise NotImplementedError(f"causal_conv1d_update reference: a state of {conv_state.shape[-1]} columns for a "
                                  f"kernel of width {weight.shape[1]}")
    out = torch.zeros_like(x3)
    for b in range(x3.shape[0]):
        slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if slot == pad_slot_id:
            continue
        window = torch.cat([conv_state[slot].to(x.dtype), x3[b]], dim=1)
        out[b] = _convolve(window, weight, bias, activation, x3.shape[2]).to(x.dtype)
        conv_state[slot] = window[:, -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


# --- KDA ------------------------------------------------------------------------------------------------------------


def kda_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float | None,
             softplus_beta: float = 1.0, softplus_threshold: float = 20.0) -> torch.Tensor:
    """KDA's per-channel log decay from the raw gate [..., H, K] in float32: `lower_bound · sigmoid(exp(A_log) ·
    (g + dt_bias))` with a lower bound, else `-exp(A_log) · softplus(g + dt_bias)` (linear above the threshold), as
    SGLang's KDA kernels compute it."""
    heads, dim = raw.shape[-2:]
    g = raw.float()
    if dt_bias is not None:
        g = g + dt_bias.float().view(heads, dim)
    a = A_log.float().reshape(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * g)
    bg = softplus_beta * g
    return -a * torch.where(bg <= softplus_threshold, torch.log1p(torch.exp(bg)) / softplus_beta, g)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dimension, in float32 (the kernels' q/k l2 norm)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule on a float32 state [H, V, K] (SGLang's layout), updated in place: decay by
    exp(g), take out what the state predicts for k, write the beta-scaled rest; returns state·q [H, V].
    q (scaled), k, g: [H, K]; v: [H, V]; beta: [H]."""
    state.mul_(g.exp()[:, None, :])
    v = (v - (state * k[:, None, :]).sum(-1)) * beta[:, None]
    state.add_(v[:, :, None] * k[:, None, :])
    return (state * q[:, None, :]).sum(-1)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              initial_state_indices: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | None = None, A_log: torch.Tensor | None = None,
              dt_bias: torch.Tensor | None = None, lower_bound: float | None = None,
              output_intermediate_states: bool = False, beta_is_raw: bool = False, **kwargs: Any) -> torch.Tensor:
    """Stands in for SGLang's Triton `chunk_kda` (KDA prefill): q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]
    (sigmoid taken here when `beta_is_raw`); g is the raw gate when `A_log` is given (activated here, kda_gate), else
    already the log decay. Sequence n (of `cu_seqlens`, B = 1; else each batch row) starts from
    `initial_state[initial_state_indices[n]]` [H, V, K] and its final state is written back there. q and k are
    l2-normalized and stored in their dtype first, as its `l2norm_fwd` does. Returns the output [B, T, H, V] in v's
    dtype.
    """
    if output_intermediate_states or kwargs.get("track_state") is not None:
        raise NotImplementedError("chunk_kda reference: prefix-cache state tracking is not supported")
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalized(q).to(q.dtype), l2_normalized(k).to(k.dtype)
    batch, tokens, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, tokens) for b in range(batch)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    decay = kda_gate(g, A_log, dt_bias, lower_bound) if A_log is not None else g.float()
    betas = torch.sigmoid(beta.float()) if beta_is_raw else beta.float()
    qf, kf, vf = q.float() * scale, k.float(), v.float()
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for n, (b, start, end) in enumerate(spans):
        slot = int(initial_state_indices[n]) if initial_state_indices is not None else n
        state = (initial_state[slot].float().clone() if initial_state is not None
                 else torch.zeros(heads, v.shape[-1], dim, dtype=torch.float32, device=v.device))
        for t in range(start, end):
            out[b, t] = delta_rule_step(state, qf[b, t], kf[b, t], vf[b, t], decay[b, t], betas[b, t])
        if initial_state is not None:
            initial_state[slot] = state.to(initial_state.dtype)
    return out.to(v.dtype)


def fused_sigmoid_gating_delta_rule_update(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                                           softplus_beta: float, softplus_threshold: float, q: torch.Tensor,
                                           k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                                           initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
                                           scale: float | None = None, use_qk_l2norm_in_kernel: bool = False,
                                           cu_seqlens: torch.Tensor | None = None, is_kda: bool = False,
                                           lower_bound: float | None = None, disable_state_update: bool = False,
                                           **kwargs: Any) -> torch.Tensor:
    """Stands in for SGLang's Triton `fused_sigmoid_gating_delta_rule_update` with `is_kda` (KDA decode): q, k
    [B, T, H, K], v [B, T, HV, V], the raw gate `a` (HV·K per token) and beta logits `b` (HV per token); sequence n
    (of `cu_seqlens`, B = 1) starts from `initial_state_source[initial_state_indices[n]]` [HV, V, K] (from zeros on
    a negative slot), runs its tokens in float32 (q, k l2-normalized in float32, unrounded, as the kernel does) and
    writes its final state back unless `disable_state_update` or the slot is negative. Returns [B, T, HV, V] in
    q's dtype."""
    unsupported = [name for name in ("intermediate_states_buffer", "retrieve_parent_token", "replayssm_rawv")
                   if kwargs.get(name) is not None]
    if not is_kda or unsupported or kwargs.get("match_cutedsl_decode"):
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update reference: KDA decode only, got "
                                  f"is_kda={is_kda} {unsupported}")
    batch, tokens, heads, dim = k.shape
    value_heads = v.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2_normalized(qf), l2_normalized(kf)
    qf = (qf * scale).repeat_interleave(value_heads // heads, dim=2)
    kf = kf.repeat_interleave(value_heads // heads, dim=2)
    decay = kda_gate(a.reshape(batch, tokens, value_heads, dim), A_log, dt_bias, lower_bound, softplus_beta,
                     softplus_threshold)
    betas = torch.sigmoid(b.reshape(batch, tokens, value_heads).float())
    vf = v.float()
    if cu_seqlens is None:
        spans = [(n, 0, tokens) for n in range(batch)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    out = torch.zeros(batch, tokens, value_heads, v.shape[-1], dtype=torch.float32, device=v.device)
    for n, (row, start, end) in enumerate(spans):
        slot = int(initial_state_indices[n])
        state = (initial_state_source[slot].float().clone() if slot >= 0
                 else torch.zeros(value_heads, v.shape[-1], dim, dtype=torch.float32, device=v.device))
        for t in range(start, end):
            out[row, t] = delta_rule_step(state, qf[row, t], kf[row, t], vf[row, t], decay[row, t], betas[row, t])
        if slot >= 0 and not disable_state_update:
            initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out.to(q.dtype)


# --- the gated output norm and the attention residuals --------------------------------------------------------------


def rms_norm_gated_forward(self: Any, x: torch.Tensor, g: torch.Tensor, residual: torch.Tensor | None = None,
                           prenorm: bool = False, residual_in_fp32: bool = False) -> torch.Tensor:
    """Stands in for SGLang's `FusedRMSNormGated.forward` (Triton `rms_norm_gated`): over the last dimension, in
    float32, x / sqrt(mean(x²) + eps) · weight, times sigmoid(g) (`sigmoid`) or g·sigmoid(g) (`swish`/`silu`);
    returned in x's dtype."""
    if residual is not None or prenorm:
        raise NotImplementedError("FusedRMSNormGated reference: residual and prenorm are not supported")
    xf, gf = x.float(), g.float()
    y = xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    y = y * torch.sigmoid(gf) if self.activation == "sigmoid" else y * gf * torch.sigmoid(gf)
    return y.to(x.dtype)


def mix_fused(prefix_sum: torch.Tensor, bank: torch.Tensor, nvb: int, score_proj: Any, score_norm: Any
              ) -> torch.Tensor:
    """Stands in for SGLang's Triton `_mix_fused` (attention residuals, before the output norm): the rows
    [bank[:, :nvb], prefix_sum] of each token scored by dot(row, cw) / sqrt(mean(row²) + eps) (cw = the score
    norm's weight times the score projection's, SGLang's `get_cw`), softmax over the rows, their weighted sum; in
    float32, returned in prefix_sum's dtype."""
    from sglang.srt.layers.attn_residual import get_cw

    if prefix_sum.shape[0] == 0:
        return prefix_sum
    cw = get_cw(score_proj, score_norm)
    rows = torch.cat([bank[:, :nvb].float(), prefix_sum.float()[:, None]], dim=1)
    scores = (rows * cw).sum(-1) / torch.sqrt((rows * rows).mean(-1) + score_norm.variance_epsilon)
    p = torch.softmax(scores, dim=-1)
    return (p[..., None] * rows).sum(1).to(prefix_sum.dtype)
