"""The SGLang K3 test plugin's references (k3_ops.py) against independent formulations: fla-core 0.5.2's pure-torch
KDA (`naive_recurrent_kda` and `naive_chunk_kda`, fla/ops/kda/naive.py, with fla's own torch gates from gate.py),
`F.conv1d` for the short convolution, and the formulas for the gated norm and the attention residuals, on float32
inputs, so that what differs is the order of float32 operations only.

fla-core is installed in the SGLang venv (.ci/sglang_venv.sh) for this test. Its package is not imported (`import
fla.ops.kda` builds Triton autotuners): naive.py is loaded from its file (torch and einops only) and the two torch
gates are taken from gate.py's source by name. State layouts differ: SGLang keeps a KDA state as [H, V, K], fla as
[H, K, V]. Skipped where SGLang is not installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from k3_ops import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_kda,
    fused_sigmoid_gating_delta_rule_update,
    mix_fused,
    rms_norm_gated_forward,
)
from support.fla_kda_reference import TOL, H, K, fla_kda, load_fla_kda, raw_inputs  # noqa: E402


@pytest.fixture(scope="module")
def fla():
    """fla's naive KDA and its two torch gates (tests/support/fla_kda_reference.py)."""
    return load_fla_kda()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_equals_flas_naive_chunk_and_recurrent_kda_and_writes_each_final_state_to_its_slot(fla,
                                                                                                     lower_bound):
    naive, gates = fla
    x = raw_inputs(128, seed=1)
    pool = torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(2)) * 0.1
    before = pool.clone()
    out = chunk_kda(x["q"], x["k"], x["v"].clone(), x["raw_g"], x["raw_beta"], initial_state=pool,
                    initial_state_indices=torch.tensor([3, 1]), use_qk_l2norm_in_kernel=True,
                    cu_seqlens=torch.tensor([0, 64, 128]), A_log=x["A_log"], dt_bias=x["dt_bias"],
                    lower_bound=lower_bound, beta_is_raw=True)
    for slot, span in ((3, slice(0, 64)), (1, slice(64, 128))):  # two packed sequences, each from its own slot
        for chunk in (True, False):
            want_out, want_state = fla_kda(naive, gates, x, span, before[slot], lower_bound, chunk=chunk)
            torch.testing.assert_close(out[0, span], want_out, **TOL)
            torch.testing.assert_close(pool[slot], want_state, **TOL)
    assert torch.equal(pool[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fused_sigmoid_gating_delta_rule_update_is_one_step_of_flas_naive_kda_per_sequence(fla, lower_bound):
    naive, gates = fla
    x = raw_inputs(3, seed=5)
    pool = torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(6)) * 0.1
    before = pool.clone()
    # Decode as SGLang's backend calls it: q, k, v [1, N, H, K], the raw gate [N, H·K], beta logits [1, N, H];
    # the second sequence is padding (slot -1): it starts from zeros and keeps no state.
    out = fused_sigmoid_gating_delta_rule_update(
        x["A_log"], x["raw_g"][0].flatten(1), x["dt_bias"], 1.0, 20.0, x["q"], x["k"], x["v"], x["raw_beta"],
        pool, torch.tensor([2, -1, 3]), use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor([0, 1, 2, 3]),
        is_kda=True, lower_bound=lower_bound)
    for n, slot in ((0, 2), (2, 3)):
        want_out, want_state = fla_kda(naive, gates, x, slice(n, n + 1), before[slot], lower_bound)
        torch.testing.assert_close(out[0, n], want_out[0], **TOL)
        torch.testing.assert_close(pool[slot], want_state, **TOL)
    want_out, _ = fla_kda(naive, gates, x, slice(1, 2), None, lower_bound)
    torch.testing.assert_close(out[0, 1], want_out[0], **TOL)
    assert torch.equal(pool[[0, 1]], before[[0, 1]])


def conv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """F.conv1d, depthwise, over [before | x] ([dim, T]), then silu."""
    window = torch.cat([before, x], dim=1)[None]
    return F.silu(F.conv1d(window, weight[:, None, :], bias, groups=weight.shape[0]))[0]


def test_causal_conv1d_fn_equals_f_conv1d_from_each_sequences_state_and_leaves_its_last_inputs_there():
    gen = torch.Generator().manual_seed(7)
    dim, width = 6, 4
    x = torch.randn(dim, 7, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    states = torch.randn(3, dim, width - 1, generator=gen)
    before = states.clone()
    # Three sequences of 5, 2 and 0 tokens: the first from zeros, the second from its slot's window (2 tokens:
    # its new window keeps one column of the old one).
    out = causal_conv1d_fn(x, weight, bias, states, torch.tensor([0, 5, 7, 7]), [5, 2, 0],
                           cache_indices=torch.tensor([2, 0, 1]), has_initial_state=torch.tensor([False, True, False]),
                           activation="silu")
    torch.testing.assert_close(out[:, :5], conv_reference(x[:, :5], weight, bias, torch.zeros(dim, 3)), **TOL)
    torch.testing.assert_close(out[:, 5:], conv_reference(x[:, 5:], weight, bias, before[0]), **TOL)
    assert torch.equal(states[2], x[:, 2:5])
    assert torch.equal(states[0], torch.cat([before[0][:, 2:], x[:, 5:]], dim=1))
    assert torch.equal(states[1], before[1])


def test_causal_conv1d_update_is_f_conv1ds_next_output_and_shifts_the_input_into_the_window():
    gen = torch.Generator().manual_seed(8)
    dim, width = 6, 4
    x = torch.randn(3, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    states = torch.randn(4, width - 1, dim, generator=gen)  # SGLang's pool: [slots, width - 1, dim], passed transposed
    before = states.clone()
    out = causal_conv1d_update(x, states.transpose(-1, -2), weight, bias, activation="silu",
                               conv_state_indices=torch.tensor([3, -1, 1]))
    for row, slot in ((0, 3), (2, 1)):
        want = conv_reference(x[row][:, None], weight, bias, before[slot].T)[:, 0]
        torch.testing.assert_close(out[row], want, **TOL)
        assert torch.equal(states[slot], torch.cat([before[slot][1:], x[row][None]]))
    assert torch.equal(out[1], torch.zeros(dim)) and torch.equal(states[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("activation", ["sigmoid", "silu"])
def test_rms_norm_gated_forward_is_the_rms_norm_times_the_gate(activation):
    gen = torch.Generator().manual_seed(9)
    x, g = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    norm = SimpleNamespace(weight=1 + 0.1 * torch.randn(32, generator=gen), eps=1e-5, activation=activation)
    gate = torch.sigmoid(g) if activation == "sigmoid" else F.silu(g)
    want = F.rms_norm(x, (32,), norm.weight, eps=1e-5) * gate
    torch.testing.assert_close(rms_norm_gated_forward(norm, x, g), want, **TOL)
    assert rms_norm_gated_forward(norm, x.bfloat16(), g.bfloat16()).dtype == torch.bfloat16


def test_mix_fused_is_the_softmax_mixture_of_the_bank_rows_and_the_prefix_scored_by_their_normed_projection():
    gen = torch.Generator().manual_seed(10)
    tokens, banked, hidden = 4, 3, 64
    prefix, bank = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, banked + 2, hidden, generator=gen)
    proj = SimpleNamespace(weight=torch.randn(1, hidden, generator=gen))
    norm = SimpleNamespace(weight=1 + 0.1 * torch.randn(hidden, generator=gen), variance_epsilon=1e-6)
    rows = torch.cat([bank[:, :banked], prefix[:, None]], dim=1)  # the last two bank rows are not yet valid
    scores = F.rms_norm(rows, (hidden,), norm.weight, eps=1e-6) @ proj.weight[0]
    want = torch.einsum("tr,trh->th", torch.softmax(scores, dim=-1), rows)
    torch.testing.assert_close(mix_fused(prefix, bank, banked, proj, norm), want, **TOL)
