"""A vLLM plugin for the tests: what a worker holds while ShardprepModelLoader builds and loads a model.

vLLM loads the model in its worker process, which the tests cannot reach, so this module registers as a
second `vllm.general_plugins` entry point (`install(dir)` writes the entry point's metadata into `dir`,
which goes on PYTHONPATH) and, in every vLLM process where SHARDPREP_LOAD_PROBE names a file, wraps
the loader's `create_model` and `load_model`. Each model load appends one JSON line to that file:

- `construct_target_bytes`: bytes of storage the target parameters own right after vLLM's constructor
  (0 when they are built on `meta`); `construct_param_bytes`: the same for every parameter;
- `rss_before`, `rss_after`: VmRSS around `load_model`; `anon_before`, `anon_after`: RssAnon;
- `hwm`: VmHWM during `load_model` (reset just before it, through /proc/self/clear_refs);
  `anon_peak`: the largest RssAnon a thread sampling every millisecond saw meanwhile;
- `shard_weights`; in sharded mode `shard_bytes`, `slot_bytes`, `max_layer_bytes` (one layer's |T|) and
  `target_bytes` (R), from the binding.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
from pathlib import Path

ENV = "SHARDPREP_LOAD_PROBE"
NAME = "shardprep_load_probe"


def install(directory: Path) -> None:
    """Make `directory` (put it on PYTHONPATH) declare this module as a vLLM general plugin."""
    from engine_runs import declare_vllm_plugin

    declare_vllm_plugin(directory, NAME, "load_probe:register")


def register() -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    from shardprep.integrations.vllm.model_loader import ShardprepModelLoader

    if getattr(ShardprepModelLoader, "_probed", False):
        return
    ShardprepModelLoader._probed = True
    create_model, load_model = ShardprepModelLoader.create_model, ShardprepModelLoader.load_model

    def probed_create(self, vllm_config, model_config, prefix=""):
        model = create_model(self, vllm_config, model_config, prefix)
        self._probe = _construction(model, model_config.model)
        return model

    def probed_load(self, vllm_config, model_config, prefix=""):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # a baseline without memory an engine before this one freed
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak of this load alone
        sampler = _AnonSampler()
        before = {"rss_before": _status("VmRSS"), "anon_before": _status("RssAnon")}
        try:
            model = load_model(self, vllm_config, model_config, prefix)
        finally:
            sampler.stop()
        record = {**self._probe, **before, "hwm": _status("VmHWM"), "anon_peak": sampler.peak,
                  "rss_after": _status("VmRSS"), "anon_after": _status("RssAnon"), "pid": os.getpid()}
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what of RSS is memory freed but kept by the allocator
        record.update(rss_trimmed=_status("VmRSS"), anon_trimmed=_status("RssAnon"))
        record.update(_live_tensor_bytes())
        record.update(_held(self))
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return model

    ShardprepModelLoader.create_model = probed_create
    ShardprepModelLoader.load_model = probed_load


def _construction(model, directory: str) -> dict:
    from shardprep.manifests import load_manifest

    # The test models name their parameters as their checkpoints do (fused views: vLLM's qkv_proj, gate_up_proj).
    targets = {name for r in load_manifest(directory).layers for name in [*(e.name for e in r.entries),
                                                                          *(v.name for v in r.views)]}
    owned = {name: 0 if p.is_meta else p.untyped_storage().nbytes() for name, p in model.named_parameters()}
    return {"construct_target_bytes": sum(b for n, b in owned.items() if n in targets),
            "construct_param_bytes": sum(owned.values()), "targets_built": len(targets & set(owned))}


def _held(loader) -> dict:
    binding = loader.binding
    if binding is None:
        return {"shard_weights": False}
    manifest = binding.shards.manifest
    return {"shard_weights": True, "shard_bytes": binding.shards.nbytes, "slot_bytes": binding.gatherer.slot_bytes,
            "max_layer_bytes": manifest.max_total_bytes, "target_bytes": sum(r.total_bytes for r in manifest.layers)}


def _live_tensor_bytes() -> dict:
    """Bytes of the distinct CPU storages of every live tensor (what Python still references)."""
    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # a fake tensor (vLLM's compiler keeps some): no memory of its own
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return {"live_tensor_bytes": total}


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class _AnonSampler:
    """The peak of RssAnon, sampled every millisecond on a thread until stop()."""

    def __init__(self):
        self.peak = _status("RssAnon")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            time.sleep(0.001)

    def stop(self):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))
