"""`shardprep profile`: measure, on the real model and GPUs, the numbers `shardprep plan` predicts from.

On a bound model (`profile_binding`), per token count and per gather backend:

1. replicated: every sharded layer is gathered once into a buffer of its own (`ResidentWeights`), and
   each decoder layer's compute is timed with no gather anywhere (hooks record a mark at every layer).
   On CUDA each forward is captured in a CUDA graph with those marks inside it and timed by its
   replays, as a deployment runs its steps (`--eager`: eager forwards, as on the CPU; a forward no graph
   can hold is refused, naming --eager); the profile says which (`compute_mode`);
2. gathers: each layer's gather alone and one forward's gathers back to back (`idle_step`), whose
   bytes received give the gather-only bandwidth;
3. interference: the replicated forward timed while this backend's gathers stream beside it for its
   whole length (κ, how much slower compute runs), and a forward's gathers timed while forwards run
   beside them (λ). On a GPU both share HBM: see docs/planning.md (the step-time model);
4. sharded: the model bound to the backend, one step timed per token count (what plan's prediction
   should match for this directory's layer choice), in the same mode as step 1.

Every time is a median over `iters` calls, the slowest rank's. A step is one forward from an idle
device to its last kernel (a decode step samples before the next begins).

`profile(DIR, nproc, options)` starts the ranks with torch's elastic launcher (`launch_local`); each
builds DIR's transformers model (`build_model`) and runs `profile_binding`; rank 0 returns the Profile.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, record_function

from ..errors import RuntimeShardError
from ..manifests.manifest import load_manifest
from ..planning.profile_format import BackendTimes, LayerTimes, Profile
from ..runtime.binding import Binding, bind
from ..runtime.gatherer import LayerGatherer
from .launch import init_local_rank, launch_local
from .resident_weights import ResidentWeights
from .timing import DeviceClock, Mark, median, slowest

Forward = Callable[[], Any]
DEFAULT_TOKENS = (1, 16, 128, 1024, 4096)
DRY_RUN_TOKENS = (1, 8)
# Background work is sized to outlast the foreground by this factor, so the foreground overlaps it
# from its first kernel to its last.
COVER = 1.5


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure and how often. `backends[0]` is the one the binding was built with."""

    tokens: tuple[int, ...] = DEFAULT_TOKENS
    backends: tuple[str, ...] = ("auto",)
    iters: int = 20
    warmup: int = 3
    device: str = "auto"
    dry_run: bool = False
    trace_path: str | None = None  # rank 0 writes torch.profiler's Chrome trace of the sharded steps here
    graphs: bool = True  # on CUDA, time forwards as CUDA-graph replays (the deployment's mode); False: eagerly
    progress: Callable[[str, int, int], None] | None = None
    """Rank 0 calls `progress(what, done, total)` after each measurement; a module-level function, since the
    options travel to the ranks' processes by pickle (the CLI's draws a bar on a terminal)."""

    @classmethod
    def for_dry_run(cls, tokens: tuple[int, ...] | None = None) -> ProfileOptions:
        """CPU, gloo, tiny iteration counts: the real code path, fast enough for CI."""
        return cls(tokens=tokens or DRY_RUN_TOKENS, backends=("gloo",), iters=2, warmup=1, device="cpu",
                   dry_run=True)


def profile_binding(binding: Binding, forward_at: Callable[[int], Forward], layer_modules: Sequence[nn.Module],
                    options: ProfileOptions, source: str = "") -> Profile:
    """Measure a bound model; collective (every rank of the gatherer's group, same arguments).

    `forward_at(tokens)` returns a call that runs one forward on that many tokens; `layer_modules` are
    the model's decoder layers in order (their positions are the manifest's layer indices). Returns the
    same Profile on every rank. The binding's hooks are off afterwards (the model is left unbound).

    >>> profile = profile_binding(binding, lambda t: lambda: model(ids[:, :t]), model.model.layers,
    ...                           ProfileOptions(tokens=(16, 1024)))  # doctest: +SKIP
    """
    shards = binding.shards
    group = binding.gatherer.group
    control = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    steps_per_backend = 1 + 2 * len(options.tokens)
    run = _Run(DeviceClock(shards.device), control, options,
               total=len(options.tokens) + len(dict.fromkeys(options.backends)) * steps_per_backend)
    forwards = {t: forward_at(t) for t in options.tokens}
    timer = _LayerTimer(run.clock, layer_modules)
    resident = ResidentWeights(binding)
    resident.attach()
    graphed, eager_because = _capture_forwards(timer, forwards, options, run.clock, run.control)
    # What steps 1 and 3 run: the graphs' replays, or the eager forwards.
    compute = {t: graphed[t].replay for t in options.tokens} if graphed else forwards
    replicated = _time_compute(run, timer, graphed, compute, forwards, len(layer_modules))
    gatherers = [binding.gatherer]
    for name in options.backends[1:]:
        if name not in {g.backend_name for g in gatherers}:
            gatherers.append(LayerGatherer(shards, group=group, backend=name))
    run.total = len(options.tokens) + len(gatherers) * steps_per_backend  # `auto` has resolved to a backend
    measured = [_time_beside(run, g, compute, replicated.step) for g in gatherers]
    graphed_mode = bool(graphed)
    del compute
    graphed.clear()  # the graphs go before the resident weights they read are freed
    resident.detach()
    if run.clock.cuda:
        torch.cuda.empty_cache()
    backends = []
    for g, (per_layer, gather_only, kappa, lam) in zip(gatherers, measured):
        trace = options.trace_path is not None and g is gatherers[0]
        sharded = _time_sharded_steps(run, binding, g, forwards, layer_modules, graphed_mode, trace)
        backends.append(BackendTimes(
            name=g.backend_name,
            gather_ms=per_layer,
            gather_only_ms=gather_only,
            recv_bytes_per_forward=(shards.world_size - 1) * sum(r.chunk_bytes for r in shards.manifest.layers),
            compute_slowdown=tuple(kappa),
            gather_slowdown=tuple(lam),
            sharded_step_ms=tuple(sharded),
        ))
    dist.destroy_process_group(run.control)
    return _profile(shards, options, replicated, backends, source, graphed_mode, eager_because)


@dataclass
class _Run:
    """What every phase of one profile shares: the device clock, the ranks' gloo side group (to agree on the
    slowest rank's times), the options, and the progress count rank 0 reports."""

    clock: DeviceClock
    control: Any
    options: ProfileOptions
    total: int
    done: int = 0

    def step_done(self, what: str) -> None:
        self.done += 1
        if self.options.progress is not None and dist.get_rank(self.control) == 0:
            self.options.progress(what, self.done, self.total)


@dataclass(frozen=True)
class _Replicated:
    """Step 1's times per token count (the slowest rank's medians): before the first layer, each layer, after
    the last, the whole step."""

    head: list[float]
    layers: list[list[float]]
    tail: list[float]
    step: list[float]


def _time_compute(run: _Run, timer: _LayerTimer, graphed: dict[int, _GraphedForward],
                  compute: dict[int, Forward], forwards: dict[int, Forward], n_layers: int) -> _Replicated:
    """Step 1: every layer's compute with resident weights, per token count."""
    times = _Replicated([], [], [], [])
    for t in run.options.tokens:
        for _ in range(run.options.warmup):
            compute[t]()
        samples = [graphed[t].time() if graphed else timer.time(forwards[t]) for _ in range(run.options.iters)]
        row = slowest([median([s[i] for s in samples]) for i in range(n_layers + 3)], run.control)
        times.head.append(row[0])
        times.layers.append(row[1:-2])
        times.tail.append(row[-2])
        times.step.append(row[-1])
        run.step_done(f"compute at {t} tokens")
    return times


def _time_beside(run: _Run, g: LayerGatherer, compute: dict[int, Forward],
                 alone_ms: list[float]) -> tuple[dict[int, float], float, list[float], list[float]]:
    """Steps 2 and 3 for one backend: its gathers alone, then (κ, λ) per token count, each side timed while the
    other runs beside it for its whole length."""
    per_layer, gather_only = _gather_times(run.clock, g, run.options, run.control)
    run.step_done(f"{g.backend_name} gathers")
    kappa, lam = [], []
    for t, alone in zip(run.options.tokens, alone_ms):
        fwd = compute[t]
        k = math.ceil(COVER * alone / gather_only) + 1 if gather_only > 0 else 1
        m = math.ceil(COVER * gather_only / alone) + 1 if alone > 0 else 1
        run.clock.beside(fwd, g.idle_step, k)  # warm-up of both together
        reps = max(3, run.options.iters // 4)
        with_gathers, with_compute = slowest([
            median([run.clock.beside(fwd, g.idle_step, k) for _ in range(reps)]),
            median([run.clock.beside(g.idle_step, fwd, m) for _ in range(reps)]),
        ], run.control)
        # Timing noise can make a run beside the other faster than alone; that is no speed-up.
        kappa.append(max(0.0, with_gathers / alone - 1) if alone > 0 else 0.0)
        lam.append(max(0.0, with_compute / gather_only - 1) if gather_only > 0 else 0.0)
        run.step_done(f"{g.backend_name} beside compute at {t} tokens")
    return per_layer, gather_only, kappa, lam


def _time_sharded_steps(run: _Run, binding: Binding, g: LayerGatherer, forwards: dict[int, Forward],
                        layer_modules: Sequence[nn.Module], graphed: bool, trace: bool) -> list[float]:
    """Step 4 for one backend: the model bound to it, one step per token count (the slowest rank's medians)."""
    bound = bind(binding.model, binding.shards, g)
    sharded = []
    for t in run.options.tokens:
        fwd = _sharded_graph(forwards[t], run.clock.device, g.backend_name, run.control) if graphed else forwards[t]
        for _ in range(run.options.warmup):
            fwd()
        sharded.append(median([run.clock.time_ms(fwd) for _ in range(run.options.iters)]))
        del fwd  # a graph's memory goes before the next token count's
        run.step_done(f"{g.backend_name} sharded step at {t} tokens")
    if trace:
        assert run.options.trace_path is not None
        _trace_sharded_steps(forwards, layer_modules, run.clock, run.options.trace_path,
                             dist.get_rank(run.control) == 0)
    bound.remove()
    return slowest(sharded, run.control)


def _profile(shards: Any, options: ProfileOptions, replicated: _Replicated, backends: list[BackendTimes],
             source: str, graphed: bool, eager_because: str) -> Profile:
    sizes = {r.layer: r.total_bytes for r in shards.manifest.layers}
    n_layers = len(replicated.layers[0]) if replicated.layers else 0
    return Profile(
        world_size=shards.manifest.world_size,
        device=torch.cuda.get_device_name(shards.device) if shards.device.type == "cuda" else "cpu",
        tokens=options.tokens,
        layers=tuple(LayerTimes(i, tuple(row[i] for row in replicated.layers), sizes.get(i))
                     for i in range(n_layers)),
        head_ms=tuple(replicated.head),
        tail_ms=tuple(replicated.tail),
        replicated_step_ms=tuple(replicated.step),
        backends=tuple(backends),
        iters=options.iters,
        dry_run=options.dry_run,
        source=source,
        environment=_environment(shards.device),
        compute_mode="cuda-graph" if graphed else "eager",
        compute_mode_note=eager_because,
    )


class _LayerTimer:
    """Marks at every layer's start and end during one forward (forward hooks on the layer modules)."""

    def __init__(self, clock: DeviceClock, modules: Sequence[nn.Module]):
        self.clock = clock
        self.modules = list(modules)

    def time(self, fwd: Forward) -> list[float]:
        """[head, layer 0, ..., layer L−1, tail, whole step] in ms for one eager forward.

        A layer's time runs from its start to the next layer's start (the last: to its end), so the
        glue between layers counts with the layer before it.
        """
        starts, ends, handles = self._marks(self.clock.mark)
        try:
            self.clock.sync()
            begin = self.clock.mark()
            fwd()
            end = self.clock.mark()
            self.clock.sync()
        finally:
            for h in handles:
                h.remove()
        return self._split(begin, starts, ends, end)

    def capture(self, fwd: Forward) -> _GraphedForward:
        """`fwd` captured in a CUDA graph whose replays record the layer marks (events recorded in the capture).

        Warmed up once on a side stream first, as CUDA graphs ask. Raises what the capture raised.
        """
        device = self.clock.device

        def event() -> Mark:
            mark = torch.cuda.Event(enable_timing=True, external=True)  # external: a node of the graph
            mark.record()
            return mark

        _warm_up_beside(fwd, device)
        starts, ends, handles = self._marks(event)
        try:
            graph = _captured(fwd, device)
        finally:
            for h in handles:
                h.remove()
        self._check_every_layer_ran(starts, ends)
        return _GraphedForward(graph, self, starts, ends)

    def _marks(self, mark: Callable[[], Mark]) -> tuple[list[Mark], list[Mark], list[Any]]:
        n = len(self.modules)
        starts: list[Mark] = [None] * n
        ends: list[Mark] = [None] * n
        handles = []
        for i, module in enumerate(self.modules):
            handles.append(module.register_forward_pre_hook(lambda _m, _a, i=i: starts.__setitem__(i, mark())))
            handles.append(module.register_forward_hook(lambda _m, _a, _o, i=i: ends.__setitem__(i, mark())))
        return starts, ends, handles

    @staticmethod
    def _check_every_layer_ran(starts: list[Mark], ends: list[Mark]) -> None:
        missing = [i for i in range(len(starts)) if starts[i] is None or ends[i] is None]
        if missing:
            raise RuntimeShardError(f"decoder layer {missing[0]} did not run in the forward; profile needs every "
                                    "layer to run once per forward")

    def _split(self, begin: Mark, starts: list[Mark], ends: list[Mark], end: Mark) -> list[float]:
        self._check_every_layer_ran(starts, ends)
        n = len(self.modules)
        ms = self.clock.elapsed_ms
        layers = [ms(starts[i], starts[i + 1]) for i in range(n - 1)] + [ms(starts[-1], ends[-1])]
        return [ms(begin, starts[0]), *layers, ms(ends[-1], end), ms(begin, end)]


@dataclass
class _GraphedForward:
    """A forward in a CUDA graph; each replay records the layer marks captured in it."""

    graph: torch.cuda.CUDAGraph
    timer: _LayerTimer
    starts: list[Mark]
    ends: list[Mark]

    def replay(self) -> None:
        self.graph.replay()

    def time(self) -> list[float]:
        """What `_LayerTimer.time` returns, for one replay: from before its launch to after its last kernel."""
        clock = self.timer.clock
        clock.sync()
        begin = clock.mark()
        self.graph.replay()
        end = clock.mark()
        clock.sync()
        return self.timer._split(begin, self.starts, self.ends, end)


def _warm_up_beside(fwd: Forward, device: torch.device) -> None:
    """One forward on a side stream, as CUDA graphs ask before a capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fwd()
    torch.cuda.current_stream(device).wait_stream(side)


def _captured(fwd: Forward, device: torch.device) -> torch.cuda.CUDAGraph:
    """`fwd` captured in a CUDA graph (thread-local mode: other threads' CUDA calls, NCCL's watchdog, go on)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fwd()
    return graph


def _capture_forwards(timer: _LayerTimer, forwards: dict[int, Forward], options: ProfileOptions,
                      clock: DeviceClock, control: dist.ProcessGroup) -> tuple[dict[int, _GraphedForward], str]:
    """Each replicated forward in a CUDA graph, or none and why (CPU, --eager); collective.

    A forward that cannot be captured (MoE routing that reads on the host which experts were hit) is refused
    on every rank, naming --eager: after a failed capture torch 2.11's caching allocator aborts the process
    at its next synchronize (seen on the H200), so the profile cannot go on eagerly in the same process.
    """
    if not clock.cuda:
        return {}, "no CUDA graphs on the CPU"
    if not options.graphs:
        return {}, "eager asked for (--eager)"
    graphed: dict[int, _GraphedForward] = {}
    failure = ""
    try:
        for t, fwd in forwards.items():
            graphed[t] = timer.capture(fwd)
    except RuntimeShardError:
        raise
    except Exception as exc:
        failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    if slowest([1.0 if failure else 0.0], control)[0] > 0:
        raise RuntimeShardError(f"the model's forward could not be captured in a CUDA graph "
                                f"({failure or 'on another rank'}); profile it with --eager")
    return graphed, ""


def _sharded_graph(fwd: Forward, device: torch.device, backend: str, control: dist.ProcessGroup) -> Forward:
    """The bound forward (gathers and all) in a CUDA graph: its replay. Collective; raises on every rank."""
    failure = ""
    try:
        _warm_up_beside(fwd, device)
        graph = _captured(fwd, device)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    if slowest([1.0 if failure else 0.0], control)[0] > 0:
        raise RuntimeShardError(f"the sharded forward with the {backend} gatherer could not be captured in a CUDA "
                                f"graph ({failure or 'on another rank'}); profile with --eager")
    return graph.replay


def _trace_sharded_steps(forwards: dict[int, Forward], layer_modules: Sequence[nn.Module], clock: DeviceClock,
                         path: str, write: bool) -> None:
    """One sharded step per token count under torch.profiler; `write`: export its Chrome trace to `path`.

    Collective: every rank runs the steps (their gathers meet). Each step is labelled
    "shardprep::sharded step, T tokens", each decoder layer "shardprep::layer ℓ" (forward hooks), and the
    gatherer labels its gathers "shardprep::gather layer ℓ". On CUDA the trace has the kernels of the compute
    and gather streams too; on the CPU only the host's ops.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clock.cuda else [])
    labels: dict[int, record_function] = {}
    handles = []
    for i, module in enumerate(layer_modules):
        def enter(_m: nn.Module, _a: Any, i: int = i) -> None:
            labels[i] = record_function(f"shardprep::layer {i}")
            labels[i].__enter__()

        def leave(_m: nn.Module, _a: Any, _o: Any, i: int = i) -> None:
            labels.pop(i).__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for t, fwd in forwards.items():
                clock.sync()
                with record_function(f"shardprep::sharded step, {t} tokens"):
                    fwd()
                clock.sync()
    finally:
        for h in handles:
            h.remove()
    if write:
        prof.export_chrome_trace(path)


def _gather_times(clock: DeviceClock, g: LayerGatherer, options: ProfileOptions,
                  control: dist.ProcessGroup) -> tuple[dict[int, float], float]:
    """Each layer's gather alone (layer → ms) and one forward's gathers back to back (ms).

    In an idle step every gather is issued as soon as the one before it: the compute stream's mark
    after wait(ℓ) passes when ℓ's gather is done, so consecutive marks bound one gather each.
    """
    for _ in range(options.warmup):
        g.idle_step()
    samples = []
    for _ in range(options.iters):
        clock.sync()
        begin = clock.mark()
        g.begin()
        marks = []
        for layer in g.layers:
            g.wait(layer)
            marks.append(clock.mark())
            g.done(layer)
        clock.sync()
        points = [begin, *marks]
        samples.append([clock.elapsed_ms(a, b) for a, b in zip(points, points[1:])])
    per_layer = slowest([median([s[i] for s in samples]) for i in range(len(g.layers))], control)
    total = slowest([median([sum(s) for s in samples])], control)[0]
    return dict(zip(g.layers, per_layer)), total


def _environment(device: torch.device) -> dict[str, str]:
    env = {"torch": str(torch.__version__)}
    if device.type == "cuda":
        env["cuda"] = str(torch.version.cuda)
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return env


# -- one rank of `shardprep profile DIR` -----------------------------------------------------------------
def profile_worker(directory: str, options: ProfileOptions) -> Profile | None:
    """One rank of `shardprep profile`, in a process started with torchrun's environment variables.

    Builds DIR's transformers model bound to this rank's shards, measures it, and returns the Profile
    on rank 0 (None elsewhere).

    >>> launch_local(profile_worker, 2, "out/", ProfileOptions())[0]  # doctest: +SKIP
    """
    from .hf_model import build_model, is_causal_lm

    # NVLink multicast stays off, as in serving (see docs/runtime.md).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, _, device = init_local_rank(options.device)
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        with torch.inference_mode():
            binding = build_model(directory, device, backend=options.backends[0])
            model = binding.model
            vocab = int(getattr(model.config, "vocab_size", 2) or 2)
            causal = is_causal_lm(directory)
            generator = torch.Generator().manual_seed(0)  # the same tokens on every rank

            def forward_at(tokens: int) -> Forward:
                ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
                extra = {"use_cache": False} if causal else {}
                return lambda: model(input_ids=ids, **extra)

            result = profile_binding(binding, forward_at, decoder_layers(binding), options, source=directory)
    finally:
        dist.destroy_process_group()
    return result if rank == 0 else None


def decoder_layers(binding: Binding) -> list[nn.Module]:
    """The model's list of decoder layers: the ModuleList that holds the bound layer modules.

    >>> len(decoder_layers(build_model("out/", "cpu")))  # doctest: +SKIP
    """
    first = binding.layers[0].module
    for module in binding.model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and any(m is first for m in module):
            return list(module)
    raise RuntimeShardError("cannot find the list of decoder layers that holds the bound layers")


def profile(directory: str | Path, nproc: int | None, options: ProfileOptions) -> Profile:
    """Profile DIR on `nproc` local ranks (default: the manifest's world size); rank 0's Profile.

    >>> profile("out/", 2, ProfileOptions(tokens=(16, 1024))).backends[0].recv_gbps  # doctest: +SKIP
    """
    manifest = load_manifest(directory)
    n = manifest.world_size if nproc is None else nproc
    if n != manifest.world_size:
        raise RuntimeShardError(f"{directory} was converted for {manifest.world_size} ranks but --nproc is {n}; "
                                f"profile with {manifest.world_size} ranks")
    if not options.tokens or min(options.tokens) < 1 or options.iters < 1:
        raise RuntimeShardError("--tokens must list counts >= 1 and --iters must be >= 1")
    from .hf_model import is_causal_lm

    is_causal_lm(directory)  # reads config.json: a missing or broken one is one line here, not N tracebacks
    result = launch_local(profile_worker, n, str(directory), options)[0]
    if not isinstance(result, Profile):
        raise RuntimeShardError("rank 0 returned no profile")
    return result
