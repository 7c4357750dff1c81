"""Startup memory: open_rank + LayerGatherer + bind hold what `inspect` predicts, R/N + slots + replicated, the
rank's bytes once.

open_rank checks the rank file and reads it only once its memory is chosen (the gatherer's), so the shards
are never held twice: before, it copied the file into one buffer (on the CPU: with the file's pages mapped
meanwhile) that the gatherer then copied again into zero-copy memory.

- CPU (gloo, 2 ranks): the peak RSS (VmHWM, reset through /proc/self/clear_refs) across open_rank and the
  gatherer, and across the whole startup (build_model: bind plus the replicated part). On the CPU the
  slots are `torch.empty` pages that nothing touches before the first gather, so they do not count yet.
- GPU (marked `gpu`, as many ranks as there are GPUs, up to 2; zero copy, chunks on the 2 MiB mapping
  granularity): torch's max_memory_allocated and the driver's used memory (cudaMemGetInfo: the zero-copy
  allocations are CUDA virtual memory, which torch's allocator does not see), and the pinned host memory.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.checkpoints import LLAMA_ALL_LINEAR
from support.spawn_group import run_ranks

from shardprep.prep.convert import convert
from shardprep.prep.inspect import inspect

MIB = 1 << 20
# Process-wide costs that do not grow with the model (gloo's group, the gatherer's bookkeeping, allocator
# rounding); on this machine the shards-only phase measured 3 MiB above R/N.
HOST_SLACK = 8 * MIB
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _converted(checkpoint_cache, tmp_path, ranks: int, chunk_alignment: str):
    preset = tmp_path / "all-linear.json"
    preset.write_text(json.dumps(LLAMA_ALL_LINEAR))
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", layers=4, hidden=1024, tokenizer=False), out, ranks, preset=str(preset),
            chunk_alignment=chunk_alignment)
    return out


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _warm_imports() -> None:
    # Imported before the baseline: the phases are measured, not the first import of their modules.
    import safetensors.torch  # noqa: F401
    import transformers  # noqa: F401
    import xxhash  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    from shardprep.runtime import LayerGatherer  # noqa: F401
    from shardprep.standalone.hf_model import build_model  # noqa: F401


# -- CPU ----------------------------------------------------------------------------------------------
def _cpu_startup(rank: int, n: int, out: str) -> dict:
    import gc

    from shardprep.loader import open_rank
    from shardprep.runtime import LayerGatherer, make_backend
    from shardprep.standalone.hf_model import build_model

    _warm_imports()
    make_backend("gloo", None, "cpu")  # gloo's connections, which the gatherer's probe would set up first
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS, so VmHWM is the peak of what follows
    except OSError as exc:
        return {"skip": f"cannot reset the peak RSS (/proc/self/clear_refs: {exc.strerror})"}
    base = _status("VmRSS")
    shards = open_rank(out, rank, n, verify=True)
    gatherer = LayerGatherer(shards)
    got = {"shards_peak": _status("VmHWM") - base, "shards_held": _status("VmRSS") - base}
    binding = build_model(out, "cpu", shards=shards, gatherer=gatherer)
    got["startup_peak"] = _status("VmHWM") - base
    replicated = {id(p): p for name, p in binding.model.named_parameters()
                  if name not in binding.target_parameters}
    got.update(shard_bytes=shards.nbytes, slot_bytes=gatherer.slot_bytes,
               replicated_bytes=sum(p.numel() * p.element_size() for p in replicated.values()))
    return got


@pytest.fixture(scope="module")
def cpu_runs(checkpoint_cache, tmp_path_factory):
    out = _converted(checkpoint_cache, tmp_path_factory.mktemp("startup-cpu"), 2, "none")
    runs = run_ranks(_cpu_startup, 2, str(out), timeout=300)
    if "skip" in runs[0]:
        pytest.skip(runs[0]["skip"])
    return out, runs


def test_inspect_predicts_the_bytes_the_runtime_holds_after_startup(cpu_runs):
    out, runs = cpu_runs
    predicted = inspect(out)["capacity"]
    for got in runs:
        assert got["replicated_bytes"] == predicted["replicated_part_bytes"]
        assert got["shard_bytes"] + got["slot_bytes"] + got["replicated_bytes"] == predicted["startup_peak_bytes"]


def test_cpu_open_rank_and_gatherer_hold_the_rank_file_once(cpu_runs):
    _, runs = cpu_runs
    for got in runs:
        assert got["shard_bytes"] > 24 * MIB  # large enough that a second copy could not hide in the slack
        assert got["shards_held"] >= got["shard_bytes"] - MIB, got  # the measurement sees the shards
        # The file read straight into the buffer; it used to be mapped (its pages in RSS) while copied: 2 × R/N.
        assert got["shards_peak"] <= got["shard_bytes"] + HOST_SLACK, got


def test_cpu_startup_peak_is_within_shards_slots_and_replicated(cpu_runs):
    out, runs = cpu_runs
    predicted = inspect(out)["capacity"]["startup_peak_bytes"]
    for got in runs:
        assert got["startup_peak"] <= predicted + HOST_SLACK, (got, predicted)


def test_one_rank_zero_copy_maps_each_view_on_its_own_chunk_and_needs_no_slot_memory():
    # What lets one GPU run the load-into-place path: a one-rank manifest's views are the chunks themselves.
    from test_zero_copy import aligned_manifest

    from shardprep.runtime import zero_copy as zc

    m = aligned_manifest(1, first_offset=2 * MIB)
    plan = zc.plan_views(m, 0, 2 * MIB)
    assert plan.slot_bytes == 0 and plan.units_per_slot == 0
    assert [[(x.at, x.source, x.index) for x in view] for view in plan.layers] == [
        [(0, "chunk", i)] for i in range(len(m.layers))]


# -- GPU ----------------------------------------------------------------------------------------------
def _gpu_startup(rank: int, n: int, out: str, backend: str) -> dict:
    import gc

    import torch.distributed as dist

    from shardprep.loader import open_rank
    from shardprep.runtime import LayerGatherer, make_backend
    from shardprep.standalone.hf_model import build_model

    device = torch.device("cuda", rank)
    _warm_imports()
    # Warm-up outside the measurement: the CUDA context, NCCL's communicator and its buffers, the backend
    # (its probe's allocations and, for ce, its symmetric-memory set-up), the pinned pool.
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(n << 20, device=device), x)
    gather_backend = make_backend(backend, None, device)
    torch.empty(1, pin_memory=True)
    del x
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    alloc0, reserved0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    pinned0 = getattr(torch.cuda, "host_memory_stats", dict)().get("allocated_bytes.all.current", 0)
    free0, total = torch.cuda.mem_get_info(device)
    used = []

    def step(name: str) -> None:
        torch.cuda.synchronize(device)
        free, _ = torch.cuda.mem_get_info(device)
        used.append((name, total - free - (total - free0)))

    shards = open_rank(out, rank, n, device=device, verify=True)
    step("open_rank")
    gatherer = LayerGatherer(shards, backend=gather_backend, zero_copy=True)
    step("gatherer")
    binding = build_model(out, device, shards=shards, gatherer=gatherer)
    step("bind + replicated")
    replicated = [p for name, p in binding.model.named_parameters() if name not in binding.target_parameters]
    return {
        "used": used,
        "torch_peak": torch.cuda.max_memory_allocated(device) - alloc0,
        "torch_reserved_peak": torch.cuda.max_memory_reserved(device) - reserved0,
        "pinned_peak": getattr(torch.cuda, "host_memory_stats", dict)().get("allocated_bytes.all.peak", 0) - pinned0,
        "shard_bytes": shards.nbytes, "slot_bytes": gatherer.slot_bytes, "zero_copy": gatherer.zero_copy,
        "replicated_bytes": sum(p.numel() * p.element_size() for p in replicated),
        "tag_bytes": 4 * (2 + 2 * n) * len(gatherer.layers),
    }


@pytest.mark.gpu
def test_gpu_startup_peak_is_shards_slots_and_replicated_as_inspect_predicts(checkpoint_cache, tmp_path):
    """On 1 GPU a 1-rank manifest, on 2 GPUs a 2-rank one (nccl, then ce): the rank file is read straight into
    its zero-copy allocations, so the device never holds R/N twice."""
    from shardprep.planning.capacity import STAGING_BYTES
    from shardprep.runtime import vmm

    n = min(torch.cuda.device_count(), 2)
    reason = vmm.unavailable(torch.device("cuda", 0))
    if reason is not None:
        pytest.skip(f"zero copy cannot run here: {reason}")
    out = _converted(checkpoint_cache, tmp_path, n, "2MiB")
    predicted = inspect(out)["capacity"]
    keep = os.environ.get("SHARDPREP_TEST_RESULTS_DIR")
    for backend in ("nccl", "ce") if n == 2 else ("nccl",):
        runs = run_ranks(_gpu_startup, n, str(out), backend, backend="nccl", env=ENV, timeout=600)
        if keep:
            os.makedirs(keep, exist_ok=True)
            with open(os.path.join(keep, f"startup_memory_{n}gpu_{backend}.json"), "w") as f:
                json.dump({"predicted": predicted, "runs": runs}, f, indent=1)
        for got in runs:
            assert got["zero_copy"], got
            vmm_bytes = got["shard_bytes"] + got["slot_bytes"]
            assert vmm_bytes + got["replicated_bytes"] == predicted["startup_peak_bytes"], (got, predicted)
            # torch's allocator holds the replicated part and the tags only: never a buffer of R/N.
            assert got["torch_peak"] <= got["replicated_bytes"] + got["tag_bytes"] + MIB, got
            # The device: zero-copy allocations once, plus what torch's allocator reserved (its rounding
            # included), plus 2 MiB for the driver's own bookkeeping. Nothing is freed during startup
            # (no empty_cache, zero-copy memory lives on), so the last reading is the peak.
            device_peak = max(u for _, u in got["used"])
            assert device_peak <= vmm_bytes + got["torch_reserved_peak"] + 2 * MIB, got
            assert got["torch_reserved_peak"] <= 1.1 * got["replicated_bytes"] + 20 * MIB, got
            assert got["pinned_peak"] <= STAGING_BYTES + MIB, got
