"""The K3 test plugin's KDA references (k3_kernels.py) against fla-core 0.5.2's pure-torch KDA, an implementation
written by others: `naive_recurrent_kda` and `naive_chunk_kda` (fla/ops/kda/naive.py) with fla's own torch gates
(`naive_kda_gate`, `naive_kda_lowerbound_gate`, fla/ops/kda/gate.py), on float32 inputs, so that what differs is
the order of float32 operations only.

fla-core is installed in the vLLM venv (.ci/run) for this test alone. Its package cannot be imported here (`import
fla.ops.kda` builds Triton autotuners, which fail on this Triton without a CPU backend), so naive.py is loaded from
its file (it imports torch and einops only) and the two torch gates are taken from gate.py's source by name.

State layouts differ: vLLM keeps a KDA state as [H, V, K], fla as [H, K, V].
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # the vLLM stage's venv, which .ci/run gives fla-core

import torch  # noqa: E402
from k3_kernels import (  # noqa: E402
    chunk_kda_with_fused_gate,
    fused_recurrent_kda,
    fused_recurrent_kda_packed_decode,
    gather_initial_states,
)
from support.fla_kda_reference import TOL, H, K, fla_kda, load_fla_kda, raw_inputs  # noqa: E402


@pytest.fixture(scope="module")
def fla():
    """fla's naive KDA and its two torch gates (tests/support/fla_kda_reference.py)."""
    return load_fla_kda()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_with_fused_gate_equals_flas_naive_chunk_and_recurrent_kda(fla, lower_bound):
    naive, gates = fla
    x = raw_inputs(128, seed=1)
    initial = torch.randn(2, H, K, K, generator=torch.Generator().manual_seed(2)) * 0.1
    out, final = chunk_kda_with_fused_gate(
        x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], initial_state=initial,
        output_final_state=True, lower_bound=lower_bound, use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor([0, 64, 128]))
    for n, span in enumerate((slice(0, 64), slice(64, 128))):  # two packed sequences, each from its own state
        for chunk in (True, False):
            want_out, want_state = fla_kda(naive, gates, x, span, initial[n], lower_bound, chunk=chunk)
            torch.testing.assert_close(out[0, span], want_out, **TOL)
            torch.testing.assert_close(final[n], want_state, **TOL)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fused_recurrent_kda_reads_the_accepted_slot_and_writes_each_tokens_state_as_flas_naive_kda(fla,
                                                                                                    lower_bound):
    naive, gates = fla
    x = raw_inputs(7, seed=3)
    cache = torch.randn(8, H, K, K, generator=torch.Generator().manual_seed(4)) * 0.1
    before = cache.clone()
    # Three sequences of 3, 3 and 1 tokens; the second starts from its second slot (one token accepted more);
    # the third is padding (slot 0).
    slots = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 0]])
    out = torch.full((1, 7, H, K), float("nan"))
    fused_recurrent_kda(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], lower_bound,
                        cache, torch.tensor([0, 3, 6, 7]), slots, num_accepted_tokens=torch.tensor([1, 2, 1]),
                        out=out)
    for start, first_slot, written in ((0, 1, (1, 2, 3)), (3, 5, (4, 5, 6))):
        want_out, _ = fla_kda(naive, gates, x, slice(start, start + 3), before[first_slot], lower_bound)
        torch.testing.assert_close(out[0, start:start + 3], want_out, **TOL)
        for t, slot in enumerate(written):  # the state after token t, in slot [n, t]
            _, want_state = fla_kda(naive, gates, x, slice(start, start + t + 1), before[first_slot], lower_bound)
            torch.testing.assert_close(cache[slot], want_state, **TOL)
    assert torch.equal(out[0, 6], torch.zeros(H, K))
    assert torch.equal(cache[[0, 7]], before[[0, 7]])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_fused_recurrent_kda_packed_decode_is_one_step_of_flas_naive_kda(fla, lower_bound):
    naive, gates = fla
    x = raw_inputs(3, seed=5)
    cache = torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(6)) * 0.1
    before = cache.clone()
    packed = torch.cat([x["q"][0].flatten(1), x["k"][0].flatten(1), x["v"][0].flatten(1)], dim=1)
    out, _ = fused_recurrent_kda_packed_decode(packed, x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"],
                                               lower_bound, cache, torch.tensor([2, 0, 3]))
    for n, slot in ((0, 2), (2, 3)):
        want_out, want_state = fla_kda(naive, gates, x, slice(n, n + 1), before[slot], lower_bound)
        torch.testing.assert_close(out[0, n], want_out[0], **TOL)
        torch.testing.assert_close(cache[slot], want_state, **TOL)
    assert torch.equal(out[0, 1], torch.zeros(H, K)) and torch.equal(cache[[0, 1]], before[[0, 1]])


def test_gather_initial_states_reads_each_slot_and_zeroes_sequences_without_one():
    cache = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    rows = gather_initial_states(cache, torch.tensor([4, -1, 2]), torch.tensor([True, False, True]))
    assert torch.equal(rows, torch.stack([cache[4], torch.zeros(3), cache[2]]))
