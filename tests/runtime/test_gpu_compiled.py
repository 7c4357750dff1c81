"""Compiled serving on GPUs (marked `gpu`): a bound model, its targets at fixed addresses, captured in a CUDA graph
and compiled with Inductor (also with Inductor's CUDA graphs), gives the eager bytes, replay after replay.

The model is test_compiled_binding.py's exact-arithmetic one (integer values throughout, so Inductor's fusions
cannot change a bit), whose layers dequantize their weights before each matmul; layers that share a slot hold
different weights, so a read of a slot outside its layer's [layer_begin, layer_end] would change the output.
Before every replay the slots are wiped: a replay that did not gather again would read zeros.

It runs on as many ranks as there are GPUs, up to 2 (NCCL refuses two ranks on one GPU). On one GPU the
directory is converted for one rank: the ops, the slot schedule and the fixed addresses are exercised, but a
"gather" is a local copy; only 2 GPUs exercise real gathers inside a graph.

    python3 -m pytest -q -m gpu tests/runtime/test_gpu_compiled.py
"""

from __future__ import annotations

import pytest
import torch
from support.spawn_group import run_ranks
from test_compiled_binding import _exact_model

from shardprep.prep.convert import convert

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _ranks() -> int:
    return max(1, min(2, torch.cuda.device_count())) if torch.cuda.is_available() else 1


@pytest.fixture(scope="module")
def exact_dir(checkpoint_cache, tmp_path_factory):
    src = checkpoint_cache("llama", layers=5)
    out = tmp_path_factory.mktemp("gpu-compiled") / "llama"
    convert(src, out, _ranks(), preset="llama")
    return src, out


def _graphs_rank(rank, world_size, src, out, backend):
    from shardprep.loader.rank_shards import open_rank
    from shardprep.runtime.binding import bind
    from shardprep.runtime.gatherer import LayerGatherer

    device = torch.device("cuda", rank)
    x = (torch.remainder(torch.arange(8 * 64, dtype=torch.float32).view(8, 64) * (7 + rank), 9.0) - 4).to(device)
    with torch.inference_mode():
        want = _exact_model(src).to(device)(x)
        model = _exact_model(src).to(device)
        shards = open_rank(out, rank, world_size=world_size, device=device)
        gatherer = LayerGatherer(shards, backend=backend)
        binding = bind(model, shards, gatherer)
        addresses = {n: p.data_ptr() for n, p in binding.target_parameters.items()}
        eager = model(x)

        def wipe():
            for slot in gatherer._slots:
                slot.memory.zero_()

        # A CUDA graph of the whole forward: the ops run inside the capture, their gathers with them.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            model(x)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static = model(x)
        replays = []
        for _ in range(3):
            wipe()
            graph.replay()
            gatherer.check_alignment()
            replays.append(bool(torch.equal(static, want)))
        after = bool(torch.equal(model(x), want))  # eager again after replays

        compiled = torch.compile(model, fullgraph=True)
        inductor = [bool(torch.equal(compiled(x), want)) for _ in range(2)]
        overhead = torch.compile(model, fullgraph=True, mode="reduce-overhead")  # Inductor's CUDA graphs
        trees = []
        for _ in range(4):
            wipe()
            trees.append(bool(torch.equal(overhead(x).clone(), want)))
        torch.cuda.synchronize(device)
        moved = {n: p.data_ptr() for n, p in binding.target_parameters.items()} != addresses
    return {"eager": bool(torch.equal(eager, want)), "replays": replays, "eager_after": after,
            "inductor": inductor, "inductor_cuda_graphs": trees, "addresses_moved": moved,
            "zero_copy": gatherer.zero_copy}


@pytest.mark.parametrize("backend", ["nccl", "ce"])
def test_a_bound_model_in_a_cuda_graph_and_compiled_gives_the_eager_bytes(exact_dir, backend):
    src, out = exact_dir
    n = _ranks()
    if n == 1 and backend == "ce":
        pytest.skip("ce copies from peers: needs 2 GPUs")
    results = run_ranks(_graphs_rank, n, src, out, backend, backend="nccl", timeout=800)
    for r in results:
        assert {k: v for k, v in r.items() if k != "zero_copy"} == {
            "eager": True, "replays": [True] * 3, "eager_after": True, "inductor": [True, True],
            "inductor_cuda_graphs": [True] * 4, "addresses_moved": False}, r
