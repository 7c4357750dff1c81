"""Zero-copy own chunk on the CPU: the layout of every view, the decision, and the fallback.

The mappings themselves need a GPU (tests/runtime/test_gpu_runtime.py); here: which bytes of which memory
each view maps, that a manifest whose chunks do not sit on the mapping granularity is refused with
its reason, and that the gatherer falls back to copying (saying so) wherever zero copy cannot work.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from support.spawn_group import free_port

from shardprep.errors import RuntimeShardError
from shardprep.manifests import LayerRecord, Manifest, TensorSpec, align_up, plan_file_offsets, plan_layer
from shardprep.planning.accounting import account
from shardprep.runtime import zero_copy as zc

MIB = 1 << 20


def aligned_manifest(n: int, rows=(4096, 2048, 8192), alignment: int = 2 * MIB, first_offset: int = 0) -> Manifest:
    """Layers of bf16 rows × 1024, chunks padded to `alignment`, offsets aligned to it."""
    records = []
    for i, r in enumerate(rows):
        lay = plan_layer(i, [TensorSpec(f"l.{i}.w", "BF16", (r, 1024))], world_size=n)
        c = align_up(lay.chunk_bytes, alignment)
        records.append(replace(lay, chunk_bytes=c, total_bytes=c * n))
    offsets = [first_offset + o for o in plan_file_offsets([r.chunk_bytes for r in records], alignment)]
    return Manifest(n, tuple(f"r{i}" for i in range(n)),
                    tuple(LayerRecord.from_layout(lay, off) for lay, off in zip(records, offsets)))


@pytest.mark.parametrize("n", (2, 4, 8))
def test_each_view_maps_every_byte_once_own_chunk_from_the_shard_buffer_peers_from_the_slot(n):
    m = aligned_manifest(n, first_offset=2 * MIB)
    for rank in range(n):
        plan = zc.plan_views(m, rank, 2 * MIB)
        assert plan.unit == 2 * MIB  # the gcd of the (padded) chunk sizes
        assert plan.slot_bytes == (n - 1) * max(r.chunk_bytes for r in m.layers)
        # The shard buffer: every chunk where the file has it, gaps (the header) mapped too, no overlap.
        assert [(x.at, x.at + x.nbytes) for x in plan.shard if x.source == "chunk"] == \
               [(r.file_offset, r.file_offset + r.chunk_bytes) for r in m.layers]
        spans = [(x.at, x.at + x.nbytes) for x in plan.shard]
        assert spans[0][0] == 0 and spans[-1][1] == m.rank_file_bytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for i, (record, mappings) in enumerate(zip(m.layers, plan.layers)):
            c = record.chunk_bytes
            spans = [(x.at, x.at + x.nbytes) for x in mappings]
            assert spans[0][0] == 0 and spans[-1][1] == n * c
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
            assert [x for x in mappings if x.source == "chunk"] == [zc.Mapping(rank * c, c, "chunk", i)]
            # Peer p's part is the slot's units of the p-th peer (in rank order among the N−1 peers).
            per = c // plan.unit
            for x in mappings:
                if x.source == "unit":
                    p = x.at // c
                    q = p - (p > rank)
                    assert p != rank and x.index == q * per + (x.at - p * c) // plan.unit
            assert max(x.index for x in mappings if x.source == "unit") < plan.units_per_slot


def test_a_model_of_one_layer_size_maps_one_allocation_per_peer_part():
    m = aligned_manifest(4, rows=(4096, 4096, 4096))
    plan = zc.plan_views(m, 1, 2 * MIB)
    assert plan.unit == m.layers[0].chunk_bytes and plan.units_per_slot == 3
    assert all(len(mappings) == 4 for mappings in plan.layers)


def test_slots_shrink_to_n_minus_one_over_n_of_a_layer():
    for n in (2, 4, 8):
        m = aligned_manifest(n)
        copy, mapped = account(m).slot_bytes, account(m, aliased_own_chunk=True).slot_bytes
        assert copy == 2 * m.max_total_bytes and mapped * n == copy * (n - 1)
        # What the runtime maps per slot is what the accounting reports.
        assert 2 * zc.plan_views(m, n - 1, 2 * MIB).slot_bytes == mapped


def test_chunks_off_the_mapping_granularity_are_refused_naming_the_layer_and_the_fix():
    m = aligned_manifest(2)
    assert zc.misalignment(m, 2 * MIB) is None
    short = replace(m, layers=(replace(m.layers[0], chunk_bytes=m.layers[0].chunk_bytes - 4096,
                                       total_bytes=2 * (m.layers[0].chunk_bytes - 4096)), *m.layers[1:]))
    assert "layer 0's chunk_bytes" in zc.misalignment(short, 2 * MIB)
    shifted = replace(m, layers=(*m.layers[:2], replace(m.layers[2], file_offset=m.layers[2].file_offset + 4096)))
    reason = zc.layout_reason(shifted, 2 * MIB)
    assert "layer 2's file_offset" in reason and "--chunk-alignment 2MiB" in reason
    with pytest.raises(RuntimeShardError, match="layer 2's file_offset"):
        zc.plan_views(shifted, 0, 2 * MIB)


def test_the_decision_uses_zero_copy_where_possible_and_raises_only_when_required():
    assert zc.decide(None, None) == zc.Decision(True)
    assert zc.decide(True, None) == zc.Decision(True)
    assert zc.decide(None, "no VMM") == zc.Decision(False, "no VMM")
    assert not zc.decide(False, None).use
    with pytest.raises(RuntimeShardError, match="zero_copy=True, but own chunks cannot be mapped: no VMM"):
        zc.decide(True, "no VMM")


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def test_on_the_cpu_the_gatherer_copies_and_says_why_in_one_log_line(world_of_one, caplog):
    from shardprep.loader.rank_shards import RankShards
    from shardprep.runtime import LayerGatherer

    m = aligned_manifest(1, rows=(1024, 1024))
    shards = RankShards(m, 0, torch.arange(m.rank_file_bytes, dtype=torch.int64).to(torch.uint8))
    with caplog.at_level(logging.INFO, logger="shardprep.runtime"):
        g = LayerGatherer(shards)
    lines = [r.getMessage() for r in caplog.records if "zero copy" in r.getMessage()]
    assert lines == ["shardprep: own-chunk zero copy off (gloo gathers CPU memory, which has no CUDA mappings); "
                     "gathers copy the local chunk"]
    assert not g.zero_copy and g.slot_bytes == 2 * m.max_total_bytes
    g.begin()
    for layer in g.layers:
        w = g.wait(layer)[f"l.{layer}.w"]
        assert torch.equal(w.view(torch.uint8).flatten(), shards.chunk(layer)[:w.numel() * 2])
        g.done(layer)
    with pytest.raises(RuntimeShardError, match="zero_copy=True, but own chunks cannot be mapped: gloo"):
        LayerGatherer(shards, zero_copy=True)
