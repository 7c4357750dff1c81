"""Requantization inside convert: which tensors change (`plan_requant`), and their new bytes (`RequantRunner`).

The math lives in `shardprep.requant` (a pure transform); this module reads the FP8 weights and scales
from the source files, runs the transform on a thread pool, and hands the writer each tensor's bytes in
the order the writer consumes them, with a bounded window in flight.

Threads, not processes: on the CPU the work is numpy and `bytes.translate`, which release the GIL on
large inputs, so a thread per core scales with no process start-up and no pickling of weights back to
the parent; torch (CUDA, or non-finite blocks) is imported only by the jobs that need it.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..errors import RequantError, ShardprepError, SourceError
from ..manifests.exact_read import pread_exact
from ..manifests.layout import TensorSpec
from .source import SourceCheckpoint, SourceTensor

if TYPE_CHECKING:
    import numpy as np

    from ..manifests.manifest import Manifest

WINDOW_BYTES = 64 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only
# Smaller weights are read: a mapping costs more system calls than a copy of a few hundred KiB.
MAP_MIN_BYTES = 1 << 20


class RequantMode(str, Enum):
    """Whether to requantize: auto (block-FP8 checkpoints whose scales are not powers of two), ue8m0, none."""

    AUTO = "auto"
    UE8M0 = "ue8m0"
    NONE = "none"


class RequantScope(str, Enum):
    """Which block-FP8 weights to requantize: all of them, or only the sharded targets."""

    ALL = "all"
    TARGETS = "targets"


class RequantRecipe(str, Enum):
    """sglang: bit-exact with SGLang/DeepGEMM's online requant; fp32: vLLM's float32 dequantization."""

    SGLANG = "sglang"
    FP32 = "fp32"


class ScaleFormat(str, Enum):
    """f32: power-of-two float32 `weight_scale_inv`; e8m0: F8_E8M0 scale tensors."""

    F32 = "f32"
    E8M0 = "e8m0"


@dataclass(frozen=True)
class RequantOptions:
    """Every requantization option of convert, in one place (the CLI flags `--requant*`, `--scale-format`, ...).

    >>> RequantOptions(mode="none").mode
    <RequantMode.NONE: 'none'>
    """

    mode: RequantMode | str = RequantMode.AUTO
    scope: RequantScope | str = RequantScope.ALL
    recipe: RequantRecipe | str = RequantRecipe.SGLANG
    scale_format: ScaleFormat | str = ScaleFormat.F32
    allow_nonfinite: bool = False
    device: str = "cpu"
    workers: int = 0

    def record(self) -> dict[str, Any]:
        """The options as the manifest's `requant_options` records them (device and workers change no byte)."""
        return {"mode": RequantMode(self.mode).value, "scope": RequantScope(self.scope).value,
                "recipe": RequantRecipe(self.recipe).value, "scale_format": ScaleFormat(self.scale_format).value,
                "allow_nonfinite": self.allow_nonfinite}

    def __post_init__(self) -> None:
        # Strings are accepted (the Python API) and checked here, once, with the flag's name in the error.
        for attr, enum, flag in (("mode", RequantMode, "--requant"), ("scope", RequantScope, "--requant-scope"),
                                 ("recipe", RequantRecipe, "--requant-recipe"),
                                 ("scale_format", ScaleFormat, "--scale-format")):
            value = getattr(self, attr)
            try:
                object.__setattr__(self, attr, enum(value))
            except ValueError:
                allowed = ", ".join(e.value for e in enum)
                raise ShardprepError(f"{flag} {value!r}: expected one of {allowed}") from None
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ShardprepError(f"--device {self.device!r}: expected cpu or cuda")
        if not isinstance(self.allow_nonfinite, bool):
            raise ShardprepError(f"--allow-nonfinite {self.allow_nonfinite!r}: expected True or False")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 0:
            raise ShardprepError(f"--workers {self.workers!r}: expected 0 (one per core) or a positive count")


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


def run_job(job: RequantJob) -> tuple[np.ndarray, np.ndarray]:
    """Read one FP8 weight and its scale from disk, requantize, return (weight, scale) as flat uint8 arrays.

    numpy arrays rather than bytes: handing them to the writer costs no extra copy. On the CPU with
    float32 scales (DeepSeek's) the work is numpy alone (`shardprep.requant.lookup`), so a convert does
    not import torch; anything else (CUDA, other scale dtypes, non-finite values to report or allow)
    goes through the torch transform, which gives the same bytes.
    """
    import numpy as np

    from ..requant.lookup import e8m0_codes, refuse_negative_scale, requant_codes

    w, s = job.weight, job.scale
    if job.device == "cpu" and w.dtype == "F8_E4M3" and s.dtype == "F32":
        scale = read_array(s, job.scale_path, np.float32).reshape(s.shape)
        refuse_negative_scale(scale, job.name)
        read = map_array if w.nbytes >= MAP_MIN_BYTES else read_array
        codes = read(w, job.weight_path, np.uint8).reshape(w.shape)
        fast = requant_codes(codes, scale, job.recipe)
        del codes  # unmaps the weight
        if fast is not None:
            q, sf = fast
            if job.scale_format == "e8m0":
                return q.reshape(-1), e8m0_codes(sf).reshape(-1)
            return q.reshape(-1), sf.view(np.uint8).reshape(-1)
    return _run_job_torch(job)


def read_array(t: SourceTensor, path: str, dtype: Any) -> np.ndarray:
    """A tensor's bytes as a flat numpy array, read straight into it (one copy out of the page cache)."""
    import numpy as np

    raw = np.empty(t.nbytes, dtype=np.uint8)
    with open(path, "rb") as f:
        pread_exact(f.fileno(), memoryview(raw.data), t.start, path)
    return raw.view(dtype)


def map_array(t: SourceTensor, path: str, dtype: Any) -> np.ndarray:
    """A tensor's bytes as a flat read-only array over the source file's pages, not a copy of them.

    The weight is read in place from the page cache (a copy costs about as much as the lookups
    themselves); the mapping goes away with the last reference to the array.
    """
    import numpy as np

    start = t.start - t.start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < t.start + t.nbytes:
            raise SourceError(f"{path}: truncated (tensor {t.name!r} ends at byte {t.start + t.nbytes})")
        if t.nbytes == 0:
            return np.empty(0, dtype=dtype)
        # MAP_POPULATE maps every page at once instead of one fault per 64 KiB.
        pages = mmap.mmap(f.fileno(), t.start + t.nbytes - start, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                          prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(pages, dtype=dtype, count=t.nbytes // np.dtype(dtype).itemsize, offset=t.start - start)


def _run_job_torch(job: RequantJob) -> tuple[np.ndarray, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise RequantError(f"tensor {job.name!r}: requantizing it needs torch (CUDA, non-float32 scales or "
                           "non-finite values); pip install 'shardprep[runtime]'") from None

    from ..manifests.dtypes import torch_dtype
    from ..requant import requant_ue8m0, scale_to_e8m0

    def load(t: SourceTensor, path: str) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(read_array(t, path, np.uint8)).view(torch_dtype(t.dtype)).reshape(t.shape)

    q, s = requant_ue8m0(load(job.weight, job.weight_path), load(job.scale, job.scale_path), recipe=job.recipe,
                         allow_nonfinite=job.allow_nonfinite, name=job.name, device=job.device)
    if job.scale_format == "e8m0":
        s = scale_to_e8m0(s, name=job.scale.name)
    return q.view(torch.uint8).reshape(-1).numpy(), s.contiguous().view(torch.uint8).reshape(-1).numpy()


@dataclass(frozen=True)
class RequantPlan:
    """Which weights convert requantizes, the specs of what it writes instead, and what it records about it.

    Pure data: running the jobs is `RequantRunner`'s work.
    """

    jobs: dict[str, RequantJob]
    manifest_record: dict[str, Any]
    config_update: dict[str, Any]
    workers: int = 1

    def specs(self) -> dict[str, TensorSpec]:
        """Every tensor the requant rewrites (weights and their scales), with the dtype and shape written."""
        scale_dtype = "F8_E8M0" if self.manifest_record["scale_format"] == ScaleFormat.E8M0.value else "F32"
        out: dict[str, TensorSpec] = {}
        for name, job in self.jobs.items():
            out[name] = TensorSpec(name, "F8_E4M3", job.weight.shape)
            out[job.scale.name] = TensorSpec(job.scale.name, scale_dtype, job.scale.shape)
        return out


class RequantRunner:
    """Runs a plan's jobs on worker threads, in the order the writer will ask for their results.

    A bounded window (jobs and bytes) is in flight, so memory stays bounded whatever the checkpoint.
    Use as a context manager; `producer(name)` gives the callable that returns a rewritten tensor's bytes.

    With `on_disk` (a source fed a file at a time), only the jobs named in `order` run ahead, each once
    `on_disk(path)` holds for its weight's and its scale's file, in order: a job is never started on a file
    that is still to come or that will be dropped before the writer asks for the job (a file is dropped only
    after everything in `order` that reads it). Any other job runs when the writer asks for it.

    >>> with RequantRunner(plan, order) as runner:  # doctest: +SKIP
    ...     data = runner.producer("model.layers.1.mlp.down_proj.weight")()
    """

    def __init__(self, plan: RequantPlan, order: Sequence[str] = (), on_disk: Callable[[str], bool] | None = None):
        self.plan = plan
        self._on_disk = on_disk
        self._scale_owner = {job.scale.name: name for name, job in plan.jobs.items()}
        self._pool: ThreadPoolExecutor | None = None
        self._torch_threads = 0
        self._futures: OrderedDict[str, Future[tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self._in_flight_bytes = 0
        self._taken: set[str] = set()  # jobs whose result was handed out (or computed inline)
        self._scales: dict[str, np.ndarray] = {}
        queued = [n for n in dict.fromkeys(order) if n in plan.jobs]
        seen = set(queued)
        rest = [n for n in plan.jobs if n not in seen] if on_disk is None else []
        self._pending: deque[str] = deque(queued + rest)
        self._order = order

    def __enter__(self) -> RequantRunner:
        if self.plan.workers > 1:
            torch = sys.modules.get("torch")  # only jobs on the torch path use it; never import it for this
            if torch is not None:
                # One single-threaded op stream per worker thread; intra-op threads would only oversubscribe.
                self._torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)
            self._pool = ThreadPoolExecutor(self.plan.workers, thread_name_prefix="shardprep-requant")
        self._fill()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            for f in self._futures.values():
                f.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            if self._torch_threads:
                sys.modules["torch"].set_num_threads(self._torch_threads)

    def producer(self, name: str) -> Callable[[], np.ndarray]:
        """The callable that returns the new bytes of `name` (a requantized weight or one of their scales)."""
        if name in self.plan.jobs:
            return lambda: self._weight_bytes(name)
        owner = self._scale_owner.get(name)
        if owner is None:
            raise KeyError(name)
        return lambda: self._scale_bytes(owner)

    def _fill(self) -> None:
        # A bounded window, in jobs and in bytes: each job in flight holds about twice its weight, and
        # convert's memory bound (2·max|T| + 300 MB) must hold for DeepSeek-sized 132 MB weights too.
        # Every step is O(1), so scheduling stays linear in the number of jobs (44.5k for DeepSeek-V3).
        pool = self._pool
        while pool is not None and self._pending and len(self._futures) < 2 * self.plan.workers:
            name = self._pending[0]
            if name in self._taken or name in self._futures:
                self._pending.popleft()
                continue
            job = self.plan.jobs[name]
            nbytes = job.weight.nbytes
            if self._futures and self._in_flight_bytes + nbytes > WINDOW_BYTES:
                break
            if self._on_disk is not None and not (self._on_disk(job.weight_path) and self._on_disk(job.scale_path)):
                break  # its file is still to come: asked for, it runs inline, and the window moves on
            self._pending.popleft()
            self._futures[name] = pool.submit(run_job, job)
            self._in_flight_bytes += nbytes

    def _result(self, weight_name: str) -> tuple[np.ndarray, np.ndarray]:
        future = self._futures.pop(weight_name, None)
        self._taken.add(weight_name)
        try:
            if future is not None:
                self._in_flight_bytes -= self.plan.jobs[weight_name].weight.nbytes
                result = future.result()
            else:
                result = run_job(self.plan.jobs[weight_name])
        except ShardprepError:
            raise
        except Exception as exc:
            raise RequantError(f"tensor {weight_name!r}: requantization failed: {exc}") from exc
        self._fill()
        return result

    def _weight_bytes(self, weight_name: str) -> np.ndarray:
        q, s = self._result(weight_name)
        self._scales[self.plan.jobs[weight_name].scale.name] = s
        return q

    def _scale_bytes(self, weight_name: str) -> np.ndarray:
        scale_name = self.plan.jobs[weight_name].scale.name
        if scale_name in self._scales:
            return self._scales.pop(scale_name)
        return self._result(weight_name)[1]  # scale written before its weight: compute, keep only the scale


def plan_requant(ckpt: SourceCheckpoint, targets: set[str], options: RequantOptions) -> RequantPlan | None:
    """Decide whether and what to requantize; None when the checkpoint stays as it is.

    Reads the scales (1/16384 of the weights) to tell whether they are powers of two already.

    >>> plan = plan_requant(open_source("deepseek-fp8/"), set(), RequantOptions())  # doctest: +SKIP
    >>> plan.manifest_record  # doctest: +SKIP
    """
    if options.mode == RequantMode.NONE:
        return None
    from ..requant import detect_block_fp8

    config = ckpt.config or {}
    info = detect_block_fp8(config, ckpt.tensors)
    if info is None:
        if options.mode == RequantMode.UE8M0:
            raise RequantError(f"{ckpt.root}: --requant ue8m0 asked, but config.json declares no block-FP8 "
                               "quantization_config (quant_method 'fp8' with weight_block_size)")
        return None
    if info.scale_fmt == "ue8m0":
        return None  # the checkpoint says its scales are powers of two already
    names = [n for n in info.weight_names if options.scope == RequantScope.ALL or n in targets]
    jobs = {}
    for name in names:
        w, s = ckpt.tensors[name], ckpt.tensors[name + "_scale_inv"]
        if w.dtype != "F8_E4M3":
            raise RequantError(f"tensor {name!r} has a weight_scale_inv but dtype {w.dtype}, not F8_E4M3")
        jobs[name] = RequantJob(name, w, str(ckpt.files[w.file].path), s, str(ckpt.files[s.file].path),
                                RequantRecipe(options.recipe).value, options.allow_nonfinite, options.device,
                                ScaleFormat(options.scale_format).value)
    if not jobs or _all_pow2(ckpt, jobs):
        return None
    quant = dict(config.get("quantization_config") or {})
    quant["scale_fmt"] = "ue8m0"
    return RequantPlan(
        jobs=jobs,
        manifest_record={"method": "fp8", "block": list(info.block), "recipe": RequantRecipe(options.recipe).value,
                         "scale_format": ScaleFormat(options.scale_format).value,
                         "scope": RequantScope(options.scope).value, "allow_nonfinite": options.allow_nonfinite},
        config_update={"quantization_config": quant},
        workers=1 if options.device != "cpu" else (options.workers or os.cpu_count() or 1),
    )


def _all_pow2(ckpt: SourceCheckpoint, jobs: dict[str, RequantJob]) -> bool:
    """Scales are tiny (1/16384 of their weight), so reading all of them to check is cheap. Read through the
    checkpoint, which fetches them by range for a hub checkpoint read from its headers; the first scale that is
    not a power of two ends the check."""
    import numpy as np

    from ..requant.lookup import are_e8m0_powers_of_two

    for job in jobs.values():
        s = job.scale
        if s.dtype != "F32":
            return False  # bf16/f16 scales of a checkpoint still to requantize: treat as not UE8M0
        if not are_e8m0_powers_of_two(np.frombuffer(ckpt.read_tensor(s.name), np.float32)):
            return False
    return True


def reference_runner(ckpt: SourceCheckpoint, manifest: Manifest) -> RequantRunner | None:
    """What validate --source must expect: the requant recorded in the manifest, recomputed from the source.

    >>> runner = reference_runner(open_source("deepseek-fp8/"), load_manifest("out/"))  # doctest: +SKIP
    """
    q = manifest.quantization
    if not q:
        return None
    options = RequantOptions(mode=RequantMode.UE8M0, scope=q.get("scope", "all"), recipe=q["recipe"],
                             scale_format=q["scale_format"], allow_nonfinite=q.get("allow_nonfinite") is True,
                             workers=1)
    plan = plan_requant(ckpt, set(manifest.target_names()), options)
    if plan is None:
        raise RequantError(f"{ckpt.root}: the manifest records a requantization, but the source needs none")
    return RequantRunner(plan)
