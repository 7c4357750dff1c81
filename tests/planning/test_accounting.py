"""Per-rank memory: the copy and the aliased-own-chunk slot formulas, alignment padding, and the break-even."""

from hypothesis import given
from hypothesis import strategies as st

from shardprep.manifests import load_manifest
from shardprep.planning.accounting import (
    ZERO_COPY_MIN_ALIGNMENT,
    account,
    account_layers,
    break_even_layers,
    zero_copy_applies,
)
from shardprep.prep.convert import convert
from shardprep.prep.inspect import inspect

MIB = 1 << 20


def test_copy_formula_on_a_converted_directory_is_r_over_n_plus_two_full_layers(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", layers=5), out, 2, preset="llama")
    m = load_manifest(out)
    a = account(m)
    r = sum(rec.total_bytes for rec in m.layers)
    assert a.sharded_bytes == r and a.local_chunk_bytes == r // 2
    assert a.slot_bytes == 2 * m.max_total_bytes
    assert a.saved_bytes == r - r // 2 - 2 * m.max_total_bytes
    assert a.padding_bytes == 0 and not a.aliased_own_chunk


def test_aliased_own_chunk_slots_hold_only_the_peers_chunks():
    sizes = [64 * MIB] * 10
    for n in (2, 4, 8):
        copy = account_layers(sizes, n)
        aliased = account_layers(sizes, n, aliased_own_chunk=True)
        assert copy.slot_bytes == 2 * 64 * MIB
        assert aliased.slot_bytes == 2 * (n - 1) * (64 * MIB // n)
        assert aliased.saved_bytes - copy.saved_bytes == 2 * 64 * MIB // n  # one own chunk per slot
        assert aliased.slot_formula == "2·(N−1)/N·max|T|" and copy.slot_formula == "2·max|T|"


def test_chunk_alignment_padding_is_counted_in_shards_and_slots():
    # 3 layers of 5 MiB at N = 2: C = 2.5 MiB, padded to 4 MiB with a 2 MiB alignment.
    a = account_layers([5 * MIB] * 3, 2, chunk_alignment=ZERO_COPY_MIN_ALIGNMENT, aliased_own_chunk=True)
    assert a.local_chunk_bytes == 3 * 4 * MIB
    assert a.slot_bytes == 2 * 1 * 4 * MIB
    assert a.padding_bytes == 3 * (4 * MIB - 5 * MIB // 2) + 2 * (4 * MIB - 5 * MIB // 2)
    assert a.gather_recv_bytes_per_forward == 3 * 4 * MIB


@given(st.integers(2, 16), st.integers(1, 40), st.booleans())
def test_saving_turns_positive_exactly_past_the_break_even_layer_count(n, layers, aliased):
    size = 16 * n * 1000  # equal layers, already a multiple of 16·N
    a = account_layers([size] * layers, n, aliased_own_chunk=aliased)
    assert (a.saved_bytes > 0) == (layers > break_even_layers(n, aliased_own_chunk=aliased))
    assert (a.shortfall_reason() is None) == (a.saved_bytes > 0)


def test_zero_copy_needs_cuda_and_a_two_mib_alignment():
    assert zero_copy_applies(2 * MIB) and zero_copy_applies(4 * MIB)
    assert not zero_copy_applies(MIB) and not zero_copy_applies(2 * MIB, "cpu")


def test_inspect_says_why_a_tiny_model_saves_nothing(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")  # 2 sharded layers at N = 2
    info = inspect(out)
    totals = info["totals"]
    assert totals["saved_bytes"] < 0
    assert "gather slots (2·max|T|" in totals["shortfall_reason"]
    assert "pays from 5 sharded layers; 2 are sharded" in totals["shortfall_reason"]
    assert info["slot_model"].startswith("copy")
    assert info["capacity"]["kv_tokens"] == 0
