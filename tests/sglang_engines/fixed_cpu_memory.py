"""Test-only SGLang plugin: on the CPU, the free memory SGLang sizes its KV pool from is a fixed budget minus the
bytes of every tensor alive in the process, so that `max_total_num_tokens` follows what the model holds and not
what the rest of the host does; never shipped in shardprep.

SGLang 0.5.23 sizes the KV pool from the memory left after loading (`KVCacheConfigurator._profile_available_bytes`:
free memory after `load_model`, less `pre_model_load_memory * (1 - mem_fraction_static)`, divided by the bytes of
one token's KV cache over all layers). On the CPU "free memory" is `get_free_cpu_memory()` (psutil's available
host memory, split over NUMA nodes by `get_available_gpu_memory`), which other processes move by gigabytes
while a tiny model's weights are kilobytes, so the pool size is noise there. This plugin replaces
`sglang.srt.utils.common.get_free_cpu_memory` (HookRegistry REPLACE; SGLang's own hook point, from a
`sglang.srt.plugins` entry point declared by the engine runner, sglang_runs.py) with

    SHARDPREP_TEST_CPU_MEMORY_BYTES - (bytes of the storages of all live CPU tensors in this process)

where the live tensors are those the garbage collector tracks, each byte of memory under them counted once (the
union of their storages' address ranges).
What is real: SGLang's own sizing formula, from its own two measurements (before and after load), every
tensor the model, SGLang and shardprep hold at those moments (weights, shardprep's rank-file shards and gather
slots, the one-element placeholders). What is faked: the host's free memory (a fixed figure), and memory not
held in a tensor (the allocator's caches, Python objects, mapped files) is not counted. Active only where
SHARDPREP_TEST_CPU_MEMORY_BYTES is set; each measurement is printed (`fixed_cpu_memory: ...`).
"""

from __future__ import annotations

import gc
import os

NAME = "shardprep_test_fixed_cpu_memory"
TARGET = "sglang.srt.utils.common.get_free_cpu_memory"
BUDGET = "SHARDPREP_TEST_CPU_MEMORY_BYTES"


def live_cpu_tensor_bytes() -> int:
    """The bytes of memory under every CPU tensor the garbage collector tracks, each byte once: the union of their
    storages' address ranges (views share a storage; shardprep's bound weights have storage objects of their own
    over the gather slots' memory, which must not count twice).

    >>> import torch
    >>> before = live_cpu_tensor_bytes()
    >>> t = torch.zeros(1000, dtype=torch.uint8)
    >>> view = t[10:]
    >>> live_cpu_tensor_bytes() - before
    1000
    """
    import torch

    gc.collect()
    ranges = []
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads `__class__`, which some objects warn on (deprecated aliases).
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
                continue
            if storage.nbytes():
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    total, end = 0, 0
    for start, stop in sorted(ranges):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def fixed_free_memory() -> int:
    """The REPLACE hook: the budget less the live tensors' bytes."""
    live = live_cpu_tensor_bytes()
    free = int(os.environ[BUDGET]) - live
    print(f"fixed_cpu_memory: pid {os.getpid()} free {free} = budget {os.environ[BUDGET]} - live tensors {live}",
          flush=True)
    return free


def register() -> None:
    """SGLang's plugin hook (entry point group `sglang.srt.plugins`); does nothing without the budget."""
    if not os.environ.get(BUDGET):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, fixed_free_memory, HookType.REPLACE)
