"""Requantization inside convert: which tensors change, and producing their new bytes on worker threads.

The math lives in `shardprep.requant` (a pure tensor transform); this module reads the FP8 weights and
scales from the source files, runs the transform on a thread pool, and hands convert `TensorOverride`s
in the order convert consumes them, with a bounded window in flight.

Threads, not processes: on the CPU the work is numpy and `bytes.translate`, which release the GIL on
large inputs, so a thread per core scales with no process start-up and no pickling of weights back to
the parent; torch (CUDA, or non-finite blocks) is imported only by the jobs that need it.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import RequantError, ShardprepError
from .source import SourceCheckpoint, SourceTensor, pread_exact

MODES = ("auto", "ue8m0", "none")
SCOPES = ("all", "targets")
SCALE_FORMATS = ("f32", "e8m0")
WINDOW_BYTES = 64 << 20


@dataclass(frozen=True)
class RequantJob:
    """Everything a worker thread needs to requantize one weight."""

    name: str
    weight: SourceTensor
    weight_path: str
    scale: SourceTensor
    scale_path: str
    recipe: str
    allow_nonfinite: bool
    device: str
    scale_format: str


def run_job(job: RequantJob) -> tuple[Any, Any]:
    """Read one FP8 weight and its scale from disk, requantize, return (weight, scale) as flat uint8 arrays.

    numpy arrays rather than bytes: handing them to the writer costs no extra copy. On the CPU with
    float32 scales (DeepSeek's) the work is numpy alone (`shardprep.requant.lookup`), so a convert does
    not import torch; anything else (CUDA, other scale dtypes, non-finite values to report or allow)
    goes through the torch transform, which gives the same bytes.
    """
    import numpy as np

    from ..requant.lookup import e8m0_codes, requant_codes

    w, s = job.weight, job.scale
    if job.device == "cpu" and w.dtype == "F8_E4M3" and s.dtype == "F32":
        codes = read_array(w, job.weight_path, np.uint8).reshape(w.shape)
        scale = read_array(s, job.scale_path, np.float32).reshape(s.shape)
        fast = requant_codes(codes, scale, job.recipe)
        if fast is not None:
            q, sf = fast
            if job.scale_format == "e8m0":
                return q.reshape(-1), e8m0_codes(sf).reshape(-1)
            return q.reshape(-1), sf.view(np.uint8).reshape(-1)
    return _run_job_torch(job)


def read_array(t: SourceTensor, path: str, dtype) -> Any:
    """A tensor's bytes as a flat numpy array, read straight into it (one copy out of the page cache)."""
    import numpy as np

    raw = np.empty(t.nbytes, dtype=np.uint8)
    with open(path, "rb") as f:
        pread_exact(f.fileno(), memoryview(raw), t.start, path)
    return raw.view(dtype)


def _run_job_torch(job: RequantJob) -> tuple[Any, Any]:
    import torch

    from ..requant import requant_ue8m0, scale_to_e8m0
    from ..runtime.views import torch_dtype

    def load(t: SourceTensor, path: str) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(read_array(t, path, np.uint8)).view(torch_dtype(t.dtype)).reshape(t.shape)

    q, s = requant_ue8m0(load(job.weight, job.weight_path), load(job.scale, job.scale_path), recipe=job.recipe,
                         allow_nonfinite=job.allow_nonfinite, name=job.name, device=job.device)
    if job.scale_format == "e8m0":
        s = scale_to_e8m0(s, name=job.scale.name)
    return q.view(torch.uint8).reshape(-1).numpy(), s.contiguous().view(torch.uint8).reshape(-1).numpy()


@dataclass
class RequantPlan:
    """The tensors convert must replace, how to produce them, and what to record about it."""

    jobs: dict[str, RequantJob]
    manifest_record: dict[str, Any]
    config_update: dict[str, Any]
    workers: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None
    _torch_threads: int = 0
    _futures: OrderedDict[str, Future] = field(default_factory=OrderedDict)
    _pending: list[str] = field(default_factory=list)
    _scales: dict[str, Any] = field(default_factory=dict)

    def start(self, order: Sequence[str] = ()) -> None:
        """Start workers and queue jobs in `order` (the order convert will ask for the weights)."""
        if self.workers > 1:
            torch = sys.modules.get("torch")  # only jobs on the torch path use it; never import it for this
            if torch is not None:
                # One single-threaded op stream per worker thread; intra-op threads would only oversubscribe.
                self._torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shardprep-requant")
        queued = [n for n in order if n in self.jobs]
        self._pending = queued + [n for n in self.jobs if n not in set(queued)]
        self._fill()

    def close(self) -> None:
        if self._pool is not None:
            for f in self._futures.values():
                f.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            if self._torch_threads:
                sys.modules["torch"].set_num_threads(self._torch_threads)

    def _fill(self) -> None:
        # A bounded window, in jobs and in bytes: each job in flight holds about twice its weight, and
        # convert's memory bound (2·max|T| + 300 MB) must hold for DeepSeek-sized 132 MB weights too.
        while self._pool is not None and self._pending and len(self._futures) < 2 * self.workers:
            in_flight = sum(self.jobs[n].weight.nbytes for n in self._futures)
            if self._futures and in_flight + self.jobs[self._pending[0]].weight.nbytes > WINDOW_BYTES:
                break
            name = self._pending.pop(0)
            if name not in self._futures:
                self._futures[name] = self._pool.submit(run_job, self.jobs[name])

    def _result(self, weight_name: str) -> tuple[Any, Any]:
        future = self._futures.pop(weight_name, None)
        if weight_name in self._pending:
            self._pending.remove(weight_name)
        try:
            result = future.result() if future is not None else run_job(self.jobs[weight_name])
        except ShardprepError:
            raise
        except Exception as exc:
            raise RequantError(f"tensor {weight_name!r}: requantization failed: {exc}") from exc
        self._fill()
        return result

    def weight_bytes(self, weight_name: str) -> Any:
        q, s = self._result(weight_name)
        self._scales[self.jobs[weight_name].scale.name] = s
        return q

    def scale_bytes(self, weight_name: str) -> Any:
        scale_name = self.jobs[weight_name].scale.name
        if scale_name in self._scales:
            return self._scales.pop(scale_name)
        return self._result(weight_name)[1]  # scale written before its weight: compute, keep only the scale


def plan_requant(
    ckpt: SourceCheckpoint,
    targets: set[str],
    *,
    mode: str = "auto",
    scope: str = "all",
    recipe: str = "sglang",
    scale_format: str = "f32",
    allow_nonfinite: bool = False,
    device: str = "cpu",
    workers: int = 0,
) -> RequantPlan | None:
    """Decide whether and what to requantize; None when the checkpoint stays as it is.

    >>> plan = plan_requant(open_source("deepseek-fp8/"), targets=set())  # doctest: +SKIP
    >>> plan.manifest_record  # doctest: +SKIP
    {'method': 'fp8', 'block': [128, 128], 'recipe': 'sglang', 'scale_format': 'f32', 'scope': 'all'}
    """
    from ..requant import RECIPES

    for value, allowed, flag in ((mode, MODES, "--requant"), (scope, SCOPES, "--requant-scope"),
                                 (recipe, RECIPES, "--requant-recipe"), (scale_format, SCALE_FORMATS,
                                                                         "--scale-format")):
        if value not in allowed:
            raise ShardprepError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
    if mode == "none":
        return None
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ShardprepError(f"--device {device!r}: expected cpu or cuda")
    from ..requant import detect_block_fp8

    config = ckpt.config or {}
    info = detect_block_fp8(config, ckpt.tensors)
    if info is None:
        if mode == "ue8m0":
            raise RequantError(f"{ckpt.root}: --requant ue8m0 asked, but config.json declares no block-FP8 "
                               "quantization_config (quant_method 'fp8' with weight_block_size)")
        return None
    if info.scale_fmt == "ue8m0":
        return None  # the checkpoint says its scales are powers of two already
    names = [n for n in info.weight_names if scope == "all" or n in targets]
    jobs = {}
    for name in names:
        w, s = ckpt.tensors[name], ckpt.tensors[name + "_scale_inv"]
        if w.dtype != "F8_E4M3":
            raise RequantError(f"tensor {name!r} has a weight_scale_inv but dtype {w.dtype}, not F8_E4M3")
        jobs[name] = RequantJob(name, w, str(ckpt.files[w.file].path), s, str(ckpt.files[s.file].path), recipe,
                                allow_nonfinite, device, scale_format)
    if not jobs or _all_pow2(ckpt, jobs):
        return None
    quant = dict(config.get("quantization_config") or {})
    quant["scale_fmt"] = "ue8m0"
    plan = RequantPlan(
        jobs=jobs,
        manifest_record={"method": "fp8", "block": list(info.block), "recipe": recipe,
                         "scale_format": scale_format, "scope": scope},
        config_update={"quantization_config": quant},
        workers=1 if device != "cpu" else (workers or os.cpu_count() or 1),
    )
    plan.overrides = _overrides(plan)
    return plan


def _all_pow2(ckpt: SourceCheckpoint, jobs: dict[str, RequantJob]) -> bool:
    """Scales are tiny (1/16384 of their weight), so reading all of them to check is cheap."""
    import numpy as np

    from ..requant.lookup import are_e8m0_powers_of_two

    for job in jobs.values():
        s = job.scale
        if s.dtype != "F32":
            return False  # bf16/f16 scales of a checkpoint still to requantize: treat as not UE8M0
        if not are_e8m0_powers_of_two(read_array(s, job.scale_path, np.float32)):
            return False
    return True


def _overrides(plan: RequantPlan) -> dict[str, Any]:
    from .convert import TensorOverride

    out: dict[str, Any] = {}
    scale_dtype = "F8_E8M0" if plan.manifest_record["scale_format"] == "e8m0" else "F32"
    for name, job in plan.jobs.items():
        out[name] = TensorOverride("F8_E4M3", job.weight.shape, lambda n=name: plan.weight_bytes(n))
        out[job.scale.name] = TensorOverride(scale_dtype, job.scale.shape, lambda n=name: plan.scale_bytes(n))
    return out


def reference_overrides(ckpt: SourceCheckpoint, manifest) -> dict[str, Any]:
    """What validate --source must expect: the requant recorded in the manifest, recomputed from the source."""
    q = manifest.quantization
    if not q:
        return {}
    plan = plan_requant(ckpt, set(manifest.target_names()), mode="ue8m0", scope=q.get("scope", "all"),
                        recipe=q["recipe"], scale_format=q["scale_format"], workers=1)
    if plan is None:
        raise RequantError(f"{ckpt.root}: the manifest records a requantization, but the source needs none")
    plan.start()
    return plan.overrides
