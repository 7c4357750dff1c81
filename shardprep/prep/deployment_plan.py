"""`shardprep plan`: does sharding pay for this model, and which layers should be sharded?

From a checkpoint (SRC: the convert plan says what each layer's |T| would be; nothing is written) or a
converted directory (OUT: its manifest), plus its config.json, and optionally a profile of the target
machine (`shardprep profile`) or only a link bandwidth:

- per rank: memory saved, the KV-cache tokens and requests it buys, the startup peak;
- per layer: |T|, its gather time, and its compute time at each token count;
- the layers to shard (`layer_choice.choose_layers` over the step-time model) and the
  `convert --layers` argument that shards them;
- the shard groups: with `--dp W` on nodes of `--gpus-per-node G`, W/N groups of N consecutive ranks,
  N = `--ranks` or, without it, the largest group size that divides W and fits a node;
- the routed experts a GPU holds with `--ep E` (expert_parallel.py): 1/E of them, apart from the replicated part;
- a one-line verdict (`crosses nodes` when a group of N would span nodes);
- with `--draft DRAFT` (a DFlash or EAGLE-3 draft's checkpoint or converted directory), what sharding the draft
  adds beside the target's chosen layers, apart and together (accounting.draft_saving); a draft that cannot serve
  beside this target is refused in one line (draft_layers.target_mismatch).

No torch: the measuring is `shardprep profile`'s job.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import ProfileError, ShardprepError
from ..manifests.draft_layers import DraftLayers, draft_kind, mtp_layers, target_mismatch
from ..manifests.layout import align_up
from ..manifests.manifest import MANIFEST_NAME, load_manifest
from ..manifests.shard_groups import DEFAULT_GPUS_PER_NODE, GroupFit, group_size_problem, largest_node_local_group
from ..planning.accounting import (
    MemoryAccount,
    account_layers,
    draft_saving,
    human_bytes,
    unaligned_total_bytes,
    zero_copy_applies,
)
from ..planning.capacity import Capacity, capacity
from ..planning.expert_parallel import ExpertShard, check_expert_parallel, check_tensor_parallel, expert_shard
from ..planning.kv_cache import KvCacheShape, kv_cache_shape
from ..planning.layer_choice import LayerChoice, Predict, choose_layers, evaluate, least_overhead
from ..planning.profile_format import Profile, load_profile
from ..planning.step_time import StepPrediction, StepSchedule, predict_step, schedule_step
from .selection import (
    DEFAULT_LAYER_PATTERN,
    builtin_presets,
    check_preset_fits,
    format_layers,
    load_preset,
    make_selection,
    parse_layers,
)
from .target_kinds import bytes_by_kind, kind_totals

PLAN_SCHEMA = "shardprep/plan/1"
GB = 10**9


class Verdict(str, Enum):
    PAYS = "pays"
    PAYS_FROM = "pays only from"
    DOES_NOT_PAY = "does not pay"
    MEMORY_ONLY = "memory only"  # no compute time known: the step cost cannot be predicted
    CROSSES_NODES = "crosses nodes"  # a shard group would span nodes: its gathers cannot hide behind compute


@dataclass(frozen=True)
class PlanRequest:
    """What `shardprep plan` was asked. `layers` limits the candidate layers (default: every layer with
    targets; for OUT, its sharded layers). Sizes are bytes; `max_overhead` a fraction (0.05 = 5%).
    `ranks` is the shard group size N (None: the largest that fits a node, with `dp`); `dp` the
    data-parallel ranks W (None: one group, W = N); `gpus_per_node` the ranks of a node; `ep` the ranks
    each MoE layer's routed experts are split over (1: every GPU holds them all); `tp` the tensor-parallel
    size (only 1: sharded mode is DP attention). For OUT, `ranks` defaults to the N it was converted for.
    `allow_preset_mismatch`: plan with a preset that does not fit SRC's model type (convert's option)."""

    source: str
    ranks: int | None
    targets: tuple[str, ...] = ()
    preset: str | None = None
    layers: str = "all"
    layer_pattern: str | None = None
    revision: str | None = None
    profile: Path | None = None
    link_gbps: float | None = None
    backend: str | None = None
    tokens: tuple[int, ...] | None = None
    hbm_bytes: int | None = 141 * GB
    context_len: int = 8192
    max_overhead: float = 0.05
    budget_bytes: int | None = None
    kv_dtype: str = "auto"
    num_slots: int = 2
    chunk_alignment: int | None = None
    dp: int | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE
    ep: int = 1
    tp: int = 1
    draft: str | None = None
    """A DFlash or EAGLE-3 draft to serve beside the target: its checkpoint (local or hub id) or converted directory."""
    allow_preset_mismatch: bool = False


@dataclass(frozen=True)
class LayerRow:
    """One model layer: its |T| and chunk if it is a candidate, its gather and compute times if known."""

    layer: int
    total_bytes: int | None
    chunk_bytes: int | None
    gather_ms: float | None
    compute_ms: tuple[float, ...]
    kinds: dict[str, int] = field(default_factory=dict)
    """Its targets' bytes by kind (target_kinds.py: KDA, MLA, MoE periphery, ...); empty if not a candidate."""


@dataclass
class PlanReport:
    """Everything `shardprep plan` prints; `to_dict()` is its JSON (schema shardprep/plan/1)."""

    source: str
    kind: str  # "checkpoint" or "converted"
    ranks: int
    model_layers: int
    candidates: tuple[int, ...]
    tokens: tuple[int, ...]
    rows: list[LayerRow]
    slot_model: str
    every_layer: LayerChoice
    chosen: LayerChoice | None
    capacity: Capacity
    verdict: Verdict
    verdict_line: str
    groups: GroupFit
    experts: ExpertShard
    kv: KvCacheShape | None = None
    pays_from_tokens: int | None = None
    convert_layers: str | None = None
    convert_command: str | None = None
    """`shardprep convert ...` for the chosen layers, one line that runs as printed: SRC (for OUT, the source its
    manifest records), a new output directory, N, the selection (for OUT, its recorded one) and `--layers`."""
    gather_source: str = ""
    backend: str | None = None
    notes: list[str] = field(default_factory=list)
    # The predicted step of the layers shown (chosen, else pays-from, else every candidate) at each of
    # `tokens`: what `plan --trace` draws. Empty without a profile. Not in the JSON.
    schedules: tuple[StepSchedule, ...] = ()
    schedule_layers: tuple[int, ...] = ()
    num_slots: int = 2
    fetched_bytes: int | None = None
    """A hub id, read from its headers alone: the bytes fetched from the hub (None: a local source)."""
    draft: dict[str, Any] | None = None
    """With `--draft`: the draft model's record (kind, layers, target facts) and what it adds beside the shown
    layers (accounting.draft_saving), with `together_saved_bytes`; None without."""
    max_overhead: float = 0.05
    """The bound a set's worst predicted overhead is held to (`--max-overhead`, a fraction)."""
    budget_bytes: int | None = None
    """`--budget-gb` in bytes: free at least this much per rank at the least overhead (None: not asked)."""
    pays_from_choice: LayerChoice | None = None
    """With a "pays only from" verdict: the set that fits from `pays_from_tokens` up, predicted at every token count."""
    measured: dict[str, Any] | None = None
    """With `--profile`: what it measured at `tokens` (the replicated step, its own directory's sharded step with
    the planned backend, which layers that directory shards), beside the model's predictions; None without."""

    @property
    def kinds(self) -> dict[str, dict[str, int]]:
        """The candidates' target bytes per kind (target_kinds.kind_totals): layers, bytes, largest layer."""
        return kind_totals(r.kinds for r in self.rows if r.kinds)

    def to_dict(self) -> dict[str, Any]:
        def choice(c: LayerChoice | None) -> dict[str, Any] | None:
            if c is None:
                return None
            return {"layers": list(c.layers), "memory": c.memory.to_dict(), "worst_overhead": c.worst_overhead,
                    "predictions": [_prediction(t, p) for t, p in zip(self.tokens, c.predictions)]}

        return {
            "schema": PLAN_SCHEMA,
            "source": self.source,
            "kind": self.kind,
            "fetched_bytes": self.fetched_bytes,
            "ranks": self.ranks,
            "model_layers": self.model_layers,
            "candidates": list(self.candidates),
            "tokens": list(self.tokens),
            "slot_model": self.slot_model,
            "gather_source": self.gather_source,
            "backend": self.backend,
            "kv_cache": self.kv.to_dict() if self.kv else None,
            "layers": [{"layer": r.layer, "total_bytes": r.total_bytes, "chunk_bytes": r.chunk_bytes,
                        "gather_ms": r.gather_ms, "compute_ms": list(r.compute_ms), "kinds": r.kinds}
                       for r in self.rows],
            "kinds": self.kinds,
            "every_layer": choice(self.every_layer),
            "chosen": choice(self.chosen),
            "capacity": self.capacity.to_dict(),
            "groups": self.groups.to_dict(),
            "experts": self.experts.to_dict(),
            "pays_from_tokens": self.pays_from_tokens,
            "convert_layers": self.convert_layers,
            "convert_command": self.convert_command,
            "verdict": self.verdict.value,
            "verdict_line": self.verdict_line,
            "notes": list(self.notes),
            "draft": self.draft,
            "max_overhead": self.max_overhead,
            "budget_bytes": self.budget_bytes,
            "pays_from": choice(self.pays_from_choice),
            "measured": self.measured,
        }


def _prediction(tokens: int, p: StepPrediction) -> dict[str, Any]:
    return {"tokens": tokens, "step_ms": p.step_ms, "replicated_ms": p.replicated_ms, "overhead": p.overhead,
            "gathers_ms": p.gathers_ms, "floor_ms": p.floor.ms, "floor_term": p.floor.term}


@dataclass(frozen=True)
class _Model:
    """What the plan knows about the model, from SRC or OUT."""

    kind: str
    sizes: dict[int, int]  # candidate layer → |T| at the requested N
    replicated_bytes: int  # non-target bytes
    config: dict[str, Any] | None
    chunk_alignment: int
    notes: tuple[str, ...] = ()
    kinds: dict[int, dict[str, int]] = field(default_factory=dict)  # candidate layer → its target bytes by kind
    tensor_bytes: dict[str, int] = field(default_factory=dict)  # every non-target tensor → its bytes
    fetched_bytes: int | None = None  # a hub id read from its headers: the bytes fetched
    convert_args: tuple[str, ...] = ()  # SRC, a new OUT, then the selection's options: convert's arguments but N


def plan_sharding(request: PlanRequest) -> PlanReport:
    """Assess sharding the model at `request.source` over shard groups of N ranks; see the module docstring.

    >>> report = plan_sharding(PlanRequest("my-llama/", ranks=8, preset="llama",
    ...                                    profile=Path("profile.json")))  # doctest: +SKIP
    >>> report.verdict_line  # doctest: +SKIP
    """
    fit = _shard_groups(request, _converted_world_size(request.source))
    check_tensor_parallel(request.tp)
    check_expert_parallel(request.ep, fit.world_size)
    model = _read_model(request, fit.group_size)
    kind = draft_kind(model.config)
    if kind is not None:
        raise ShardprepError(f"{request.source} is a {kind} draft model's: plan weighs a target's layers; plan its "
                             f"target with --draft {request.source}")
    beside = _read_draft(request, fit.group_size, model.config) if request.draft else None
    inputs = _plan_inputs(request, fit, model)
    choices = _choose(inputs)
    shown = choices.shown
    verdict, line = _verdict(request, choices.every, choices.chosen, choices.pays_from, choices.from_choice,
                             choices.least, inputs.kv, inputs.gather_ms, inputs.gather_source, inputs.tokens)
    crossing = fit.crosses_nodes_line()
    if crossing is not None:
        at = f" at --dp {fit.world_size}" if request.dp is not None else ""
        verdict, line = Verdict.CROSSES_NODES, (f"{crossing}; plan --ranks {fit.largest_node_local}, the largest "
                                                f"shard group that fits a node{at}")
    if beside is not None:
        inputs.notes.append(f"the draft ({request.draft}) is counted beside the {len(shown.layers)} layers shown; "
                            "the step-time model weighs the target's layers alone (the draft runs after them)")
    pick = choices.chosen or choices.from_choice
    # Never open-ended past the target's last layer when a draft's layers follow it: `1-` would take them in.
    convert_layers = (format_layers(pick.layers, num_layers=None if inputs.draft_layers else inputs.model_layers)
                      if pick else None)
    return PlanReport(
        draft=None if beside is None else _draft_beside(beside, [model.sizes[i] for i in shown.layers],
                                                        inputs.alignment, fit.group_size, request.num_slots,
                                                        inputs.aliased),
        source=request.source, kind=model.kind, ranks=fit.group_size, model_layers=inputs.model_layers,
        candidates=inputs.candidates, tokens=inputs.tokens, rows=_layer_rows(inputs), slot_model=inputs.slot_model,
        every_layer=choices.every, chosen=choices.chosen, capacity=_shown_capacity(inputs, shown), verdict=verdict,
        verdict_line=line, groups=fit, experts=inputs.experts, kv=inputs.kv, pays_from_tokens=choices.pays_from,
        convert_layers=convert_layers, convert_command=_convert_command(model, fit.group_size, convert_layers),
        gather_source=inputs.gather_source, backend=inputs.backend, notes=inputs.notes,
        schedules=_schedules(inputs, shown.layers), schedule_layers=shown.layers, num_slots=request.num_slots,
        fetched_bytes=model.fetched_bytes, max_overhead=request.max_overhead, budget_bytes=request.budget_bytes,
        pays_from_choice=(evaluate(choices.from_choice.layers, inputs.memory, inputs.predictor(inputs.token_index))
                          if choices.from_choice else None),
        measured=_measured(inputs),
    )


@dataclass
class _PlanInputs:
    """What every step of the plan reads: the request, the model, the group size, and what follows from them
    (the candidates, each layer's chunk and gather time, the profile's token counts). `notes` collects caveats
    in the order the terminal prints them."""

    request: PlanRequest
    model: _Model
    n: int
    experts: ExpertShard
    alignment: int
    aliased: bool
    slot_model: str
    kv: KvCacheShape | None
    profile: Profile | None
    notes: list[str]
    draft_layers: tuple[int, ...]  # an MTP draft's layers inside the checkpoint: never a silent candidate
    candidates: tuple[int, ...]
    model_layers: int
    chunks: dict[int, int]
    gather_ms: dict[int, float] | None
    gather_source: str
    backend: str | None
    tokens: tuple[int, ...]
    token_index: list[int]

    def memory(self, layers: Sequence[int]) -> MemoryAccount:
        return account_layers([self.model.sizes[i] for i in layers], self.n, num_slots=self.request.num_slots,
                              chunk_alignment=self.alignment, aliased_own_chunk=self.aliased,
                              non_target_bytes=self.model.replicated_bytes)

    def predictor(self, indices: Sequence[int]) -> Predict | None:
        """The step-time prediction of a layer set at these token counts (profile indices); None where the
        compute or the gathers are unknown."""
        profile, gather_ms = self.profile, self.gather_ms
        if profile is None or gather_ms is None or not indices:
            return None
        b = profile.backend(self.backend)
        num_slots = self.request.num_slots

        def predict(layers: Sequence[int]) -> list[StepPrediction]:
            gathers = {i: gather_ms[i] for i in layers}
            return [predict_step(profile.segments(ti, gathers), b.interference(ti), num_slots) for ti in indices]

        return predict


def _plan_inputs(request: PlanRequest, fit: GroupFit, model: _Model) -> _PlanInputs:
    """Read the profile and derive what the layer search needs. The notes keep the terminal's order: the model's,
    the parallel layout's, the KV cache's, the profile's, the MTP draft's, then the gathers'."""
    n = fit.group_size
    experts = expert_shard(model.tensor_bytes, request.ep)
    alignment = model.chunk_alignment
    aliased = zero_copy_applies(alignment)
    where = str(Path(request.source) / "config.json")
    kv = kv_cache_shape(model.config, request.kv_dtype, where=where) if model.config else None
    notes = [*model.notes, *_layout_notes(request, model, experts, fit, kv)]
    profile = load_profile(request.profile) if request.profile else None
    if profile is not None and profile.compute_mode == "eager" and profile.device != "cpu":
        notes.append(f"the profile timed eager forwards ({profile.compute_mode_note or 'an older profile'}), not "
                     "the CUDA-graph replays a deployment runs: its compute times can be the host's")
    # An MTP layer is a draft model's, run apart from the target's forward: it is only sharded when asked for.
    draft = tuple(i for i in mtp_layers(model.config) if i in model.sizes)
    candidates = tuple(sorted(i for i in model.sizes if i not in draft))
    if draft:
        notes.append(_draft_note(draft, model.sizes))
    if not candidates:
        raise ShardprepError(f"{request.source}: the layers with targets are only the MTP draft's ({draft[0]}...); "
                             "plan weighs the target model's layers: widen --layers")
    model_layers = _model_layers(model, profile, candidates)
    chunks = {i: align_up(t // n, alignment) for i, t in model.sizes.items()}
    recv = {i: (n - 1) * c for i, c in chunks.items()}
    gather_ms, gather_source, backend = _gather_times(request, profile, recv, n, notes)
    tokens = (request.tokens or profile.tokens) if profile is not None else ()
    token_index = [profile.token_index(t) for t in tokens] if profile is not None else []
    return _PlanInputs(request, model, n, experts, alignment, aliased, _slot_model(aliased, alignment, request),
                       kv, profile, notes, draft, candidates, model_layers, chunks, gather_ms, gather_source, backend,
                       tuple(tokens), token_index)


def _slot_model(aliased: bool, alignment: int, request: PlanRequest) -> str:
    if aliased:
        return (f"aliased own chunk: slots {request.num_slots}·(N−1)/N·max|T| (CUDA, chunks aligned to "
                f"{human_bytes(alignment)} ≥ 2 MiB)")
    return (f"copy: slots {request.num_slots}·max|T| (chunk alignment {human_bytes(alignment)} < 2 MiB, so the "
            "own chunk cannot be mapped; convert with a 2 MiB chunk alignment for the smaller slots)")


def _layout_notes(request: PlanRequest, model: _Model, experts: ExpertShard, fit: GroupFit,
                  kv: KvCacheShape | None) -> list[str]:
    notes = []
    if request.ep == 1 and experts.routed_bytes and fit.world_size > 1:
        notes.append(f"the routed experts ({human_bytes(experts.routed_bytes)}) are counted whole on every GPU; "
                     "DP attention deployments split them by expert parallelism: give --ep")
    if model.config is None:
        notes.append("no config.json: KV-cache figures are left out")
    elif kv is None:
        notes.append("an encoder-only model keeps no KV cache")
    return notes


@dataclass(frozen=True)
class _Choices:
    """The layer sets the search found: every candidate, the chosen one (None: none fits), the pays-from set and
    its threshold, and the least costly set (named when nothing fits)."""

    every: LayerChoice
    chosen: LayerChoice | None
    pays_from: int | None
    from_choice: LayerChoice | None
    least: LayerChoice | None

    @property
    def shown(self) -> LayerChoice:
        """The set the capacity, the schedules and the draft are reported for."""
        return self.chosen or self.from_choice or self.every


def _choose(inputs: _PlanInputs) -> _Choices:
    request, candidates, memory = inputs.request, inputs.candidates, inputs.memory
    predict = inputs.predictor(inputs.token_index)
    every = evaluate(candidates, memory, predict)
    if request.budget_bytes is not None:
        chosen = choose_layers(candidates, memory, predict, budget_bytes=request.budget_bytes)
    else:
        chosen = choose_layers(candidates, memory, predict, max_overhead=request.max_overhead)
    pays_from, from_choice = None, None
    if chosen is None and predict is not None and request.budget_bytes is None:
        pays_from, from_choice = _pays_from(inputs)
    least = least_overhead(candidates, memory, predict) if predict is not None else None
    return _Choices(every, chosen, pays_from, from_choice, least)


def _pays_from(inputs: _PlanInputs) -> tuple[int | None, LayerChoice | None]:
    """The least token count from which some set fits the bound at that count and every larger one, and the set."""
    ordered = sorted(inputs.tokens)
    for k in range(1, len(ordered)):
        later = [ti for t, ti in zip(inputs.tokens, inputs.token_index) if t >= ordered[k]]
        found = choose_layers(inputs.candidates, inputs.memory, inputs.predictor(later),
                              max_overhead=inputs.request.max_overhead)
        if found is not None:
            return ordered[k], found
    return None, None


def _shown_capacity(inputs: _PlanInputs, shown: LayerChoice) -> Capacity:
    request, model, experts = inputs.request, inputs.model, inputs.experts
    # Under expert parallelism the routed experts leave the replicated part: each GPU holds its 1/E of them.
    expert_bytes = experts.shard_bytes if request.ep > 1 else 0
    unsharded = sum(model.sizes[i] for i in (*inputs.candidates, *inputs.draft_layers) if i not in shown.layers)
    replicated_part = model.replicated_bytes - (experts.routed_bytes if request.ep > 1 else 0) + unsharded
    return capacity(shown.memory, inputs.kv, replicated_part_bytes=replicated_part, context_len=request.context_len,
                    hbm_bytes=request.hbm_bytes, expert_shard_bytes=expert_bytes)


def _schedules(inputs: _PlanInputs, layers: tuple[int, ...]) -> tuple[StepSchedule, ...]:
    profile, gather_ms = inputs.profile, inputs.gather_ms
    if profile is None or gather_ms is None:
        return ()
    b = profile.backend(inputs.backend)
    gathers = {i: gather_ms[i] for i in layers}
    return tuple(schedule_step(profile.segments(ti, gathers), b.interference(ti), inputs.request.num_slots)
                 for ti in inputs.token_index)


def _layer_rows(inputs: _PlanInputs) -> list[LayerRow]:
    model, profile, gather_ms = inputs.model, inputs.profile, inputs.gather_ms
    return [LayerRow(i, model.sizes.get(i), inputs.chunks.get(i), gather_ms.get(i) if gather_ms else None,
                     tuple(profile.layers[i].compute_ms[ti] for ti in inputs.token_index) if profile else (),
                     model.kinds.get(i, {}))
            for i in range(inputs.model_layers)]


def _convert_command(model: _Model, n: int, convert_layers: str | None) -> str | None:
    if convert_layers is None:
        return None
    return shlex.join(["shardprep", "convert", *model.convert_args[:2], "--ranks", str(n), *model.convert_args[2:],
                       "--layers", convert_layers])


def _measured(inputs: _PlanInputs) -> dict[str, Any] | None:
    """What the profile measured at the planned token counts, beside the model's predictions: the replicated step
    and the profiled directory's own sharded step with the planned backend (None without a profile)."""
    profile = inputs.profile
    if profile is None:
        return None
    b = profile.backend(inputs.backend)
    return {"backend": b.name, "world_size": profile.world_size, "device": profile.device,
            "dry_run": profile.dry_run, "compute_mode": profile.compute_mode,
            "sharded_layers": [lay.layer for lay in profile.layers if lay.total_bytes is not None],
            "replicated_step_ms": [profile.replicated_step_ms[ti] for ti in inputs.token_index],
            "sharded_step_ms": [b.sharded_step_ms[ti] for ti in inputs.token_index]}


def _draft_note(draft: tuple[int, ...], sizes: dict[int, int]) -> str:
    layers = ", ".join(map(str, draft))
    return (f"layer{'s' if len(draft) > 1 else ''} {layers}: the MTP draft's (config.json's num_nextn_predict_layers, "
            f"|T| {human_bytes(sum(sizes[i] for i in draft))}), not planned with the target's layers and left out of "
            f"--layers; add {layers} to shard the draft too (its gathers hide behind the target's last layer)")


@dataclass(frozen=True)
class _Draft:
    """A draft model to serve beside the target: its record, |T| per layer at N, and its chunk alignment."""

    record: DraftLayers
    sizes: tuple[int, ...]
    chunk_alignment: int


def _read_draft(request: PlanRequest, n: int, target_config: dict[str, Any] | None) -> _Draft:
    """The draft `--draft` names (a converted directory, or a checkpoint read as convert would lay it out at N, with
    its own preset and every layer), refused in one line unless it is a draft model that fits this target."""
    assert request.draft is not None
    root = Path(request.draft)
    not_a_draft = ShardprepError(f"--draft {request.draft}: not a DFlash or EAGLE-3 draft model (its config.json's "
                                 "architectures, or its manifest's draft record, says none); an MTP draft is planned "
                                 "with its target's own checkpoint")
    if (root / MANIFEST_NAME).is_file():
        manifest = load_manifest(root)
        sizes = tuple(unaligned_total_bytes(r.entries, n) for r in manifest.layers)
        alignment = request.chunk_alignment or manifest.chunk_alignment
    else:
        from .convert_plan import make_plan
        from .header_source import open_headers
        from .requant_jobs import RequantOptions

        ckpt = open_headers(request.draft, request.revision)
        if draft_kind(ckpt.config) is None:
            raise not_a_draft
        plan = make_plan(ckpt, n, make_selection(ckpt.config), RequantOptions(mode="none"),
                         chunk_alignment=request.chunk_alignment or "auto")
        manifest = plan.skeleton_manifest()
        sizes = tuple(unaligned_total_bytes(lay.entries, n) for lay in plan.layouts)
        alignment = plan.chunk_alignment
    if manifest.draft is None or not manifest.draft.is_model:
        raise not_a_draft
    mismatch = target_mismatch(manifest.draft, target_config)
    if mismatch is not None:
        raise ShardprepError(f"--draft {request.draft} cannot serve beside {request.source}: {mismatch}")
    return _Draft(manifest.draft, sizes, alignment)


def _draft_beside(draft: _Draft, target_sizes: list[int], target_alignment: int, n: int, num_slots: int,
                  aliased: bool) -> dict[str, Any]:
    """The draft's record and what it adds beside these target layers (accounting.draft_saving), and both together."""
    saving = draft_saving(target_sizes, target_alignment, draft.sizes, draft.chunk_alignment, n, num_slots=num_slots,
                          aliased_own_chunk=aliased)
    record = draft.record.record()
    return {"kind": record["kind"], "layers": record["layers"], "target": record["target"],
            "max_layer_bytes": max(draft.sizes), **saving,
            "together_saved_bytes": saving["saved_bytes"] + saving["target_saved_bytes"]}


def _converted_world_size(source: str) -> int | None:
    """The N an output directory was converted for (None: SRC is a checkpoint)."""
    root = Path(source)
    return load_manifest(root).world_size if (root / MANIFEST_NAME).is_file() else None


def _shard_groups(request: PlanRequest, converted_n: int | None = None) -> GroupFit:
    """The group size N to plan for and how the DP ranks take groups of it; refuses what cannot be. Without
    --ranks and --dp, an output directory's own N (`converted_n`)."""
    g, dp, n = request.gpus_per_node, request.dp, request.ranks
    if g < 1:
        raise ShardprepError(f"--gpus-per-node must be >= 1, got {g}")
    if dp is not None and dp < 1:
        raise ShardprepError(f"--dp must be >= 1, got {dp}")
    if n is None and dp is None and converted_n is not None:
        n = converted_n
    if n is None:
        if dp is None:
            raise ShardprepError("give --ranks N (the shard group size), or --dp W to plan the largest group that "
                                 "fits a node")
        n = largest_node_local_group(dp, g)
    if n < 1:
        raise ShardprepError(f"--ranks must be >= 1, got {n}")
    world = n if dp is None else dp
    problem = group_size_problem(world, n)
    if problem is not None:
        raise ShardprepError(f"--dp {world} with --ranks {n}: {problem}; DP ranks form shard groups of N consecutive "
                             f"ranks, so use a --ranks that divides {world} (at most {g} GPUs per node: "
                             f"--ranks {largest_node_local_group(world, g)})")
    return GroupFit(world, g, n)


def _verdict(request: PlanRequest, every: LayerChoice, chosen: LayerChoice | None, pays_from: int | None,
             from_choice: LayerChoice | None, least: LayerChoice | None, kv: KvCacheShape | None,
             gather_ms: dict[int, float] | None, gather_source: str, tokens: tuple[int, ...]) -> tuple[Verdict, str]:
    bound = f"{request.max_overhead:.0%}"
    if every.memory.saved_bytes <= 0:
        return Verdict.DOES_NOT_PAY, f"does not pay: {every.memory.shortfall_reason()}"
    if request.budget_bytes is not None and chosen is None:
        return Verdict.DOES_NOT_PAY, (f"does not pay: cannot free {human_bytes(request.budget_bytes)} per rank; "
                                      f"sharding every candidate layer frees {human_bytes(every.memory.saved_bytes)}")
    if not every.predictions:
        pick = chosen or every
        gathers = ""
        if gather_ms is not None:
            total = sum(gather_ms[i] for i in pick.layers)
            gathers = f"; its gathers take {total:.2f} ms per forward at {gather_source}"
        return Verdict.MEMORY_ONLY, (f"memory only: sharding {len(pick.layers)} layers {_gain(pick, kv)}{gathers}; "
                                     "the step cost needs --profile (`shardprep profile` on the target GPUs)")
    if chosen is not None:
        worst = max(range(len(tokens)), key=lambda k: chosen.predictions[k].overhead)
        overhead = chosen.predictions[worst].overhead
        what = (f"shard {len(chosen.layers)} of {len(every.layers)} layers: {_gain(chosen, kv)} at "
                f"{overhead:+.1%} step time at worst ({tokens[worst]} tokens)")
        if overhead > request.max_overhead:
            return Verdict.DOES_NOT_PAY, f"does not pay within {bound}: the least costly way to {what}"
        return Verdict.PAYS, f"pays: {what}"
    if pays_from is not None and from_choice is not None:
        return Verdict.PAYS_FROM, (f"pays only from {pays_from} tokens per step: there, sharding "
                                   f"{len(from_choice.layers)} layers {_gain(from_choice, kv)} within {bound}; "
                                   "with fewer tokens every sharded layer costs more")
    cheapest = f" (the cheapest, {len(least.layers)} layers, costs {least.worst_overhead:+.1%})" if least else ""
    return Verdict.DOES_NOT_PAY, (f"does not pay within {bound} at {', '.join(map(str, tokens))} tokens: every "
                                  f"layer set that saves memory costs more{cheapest}")


def _gain(choice: LayerChoice, kv: KvCacheShape | None) -> str:
    saved = choice.memory.saved_bytes
    tokens = f" = {kv.tokens(saved):,} KV tokens" if kv else ""
    return f"frees {human_bytes(saved)} per rank{tokens}"


def _model_layers(model: _Model, profile: Profile | None, candidates: tuple[int, ...]) -> int:
    from_config = None
    if model.config:
        text = model.config.get("text_config") or {}
        from_config = model.config.get("num_hidden_layers") or text.get("num_hidden_layers")
    if profile is not None:
        if from_config and len(profile.layers) != int(from_config):
            raise ProfileError(f"the profile has {len(profile.layers)} layers but config.json has {from_config}; "
                               "profile the same model")
        if candidates and max(candidates) >= len(profile.layers):
            raise ProfileError(f"the profile has {len(profile.layers)} layers, but layer {max(candidates)} has "
                               "targets; profile the same model")
        return len(profile.layers)
    return int(from_config) if from_config else (max(candidates) + 1 if candidates else 0)


def _gather_times(request: PlanRequest, profile: Profile | None, recv: dict[int, int], n: int,
                  notes: list[str]) -> tuple[dict[int, float] | None, str, str | None]:
    """Gather ms per candidate layer, where they came from, and the backend."""
    if request.link_gbps is not None:
        if request.link_gbps <= 0:
            raise ShardprepError(f"--link-gbps must be > 0, got {request.link_gbps}")
        return ({i: b / (request.link_gbps * GB) * 1e3 for i, b in recv.items()},
                f"{request.link_gbps:g} GB/s received per rank (--link-gbps)", request.backend)
    if profile is None:
        return None, "", request.backend
    b = profile.backend(request.backend)
    if profile.world_size != n:
        if b.recv_gbps <= 0:  # one rank gathers nothing from peers: no bandwidth to scale to N ranks
            raise ProfileError(f"the profile was measured on {profile.world_size} rank, which receives no gather "
                               f"bytes, so it cannot predict gathers at N = {n}: profile on {n} GPUs, or give "
                               "--link-gbps (the per-rank receive bandwidth) with this profile's compute times")
        notes.append(f"the profile was measured at N = {profile.world_size}: gathers are estimated from its "
                     f"gather-only bandwidth ({b.recv_gbps:.1f} GB/s) at N = {n}")
        return ({i: r / (b.recv_gbps * GB) * 1e3 for i, r in recv.items()},
                f"{b.name} at {b.recv_gbps:.1f} GB/s (profile, N = {profile.world_size})", b.name)
    times = {i: b.estimate_gather_ms(i, r) for i, r in recv.items()}
    return times, f"{b.name} (profile: measured per layer, {b.recv_gbps:.1f} GB/s gather-only)", b.name


def _read_model(request: PlanRequest, n: int) -> _Model:
    root = Path(request.source)
    if (root / MANIFEST_NAME).is_file():
        return _read_converted(root, request, n)
    return _read_checkpoint(request, n)


def _read_checkpoint(request: PlanRequest, n: int) -> _Model:
    from .convert_plan import make_plan
    from .header_source import open_headers
    from .requant_jobs import RequantOptions

    ckpt = open_headers(request.source, request.revision)  # a hub id by HTTP range: no snapshot download
    selection = make_selection(ckpt.config, targets=request.targets, preset=request.preset, layers=request.layers,
                               layer_pattern=request.layer_pattern)
    if not request.allow_preset_mismatch:
        check_preset_fits(ckpt.tensors, ckpt.config, selection, request.source)
    # Laid out as convert would for this N (its chunk alignment too, `auto` unless given). Without the requant:
    # it keeps every size (scales stay F32 unless --scale-format says otherwise) and deciding it reads scales.
    plan = make_plan(ckpt, n, selection, RequantOptions(mode="none"),
                     chunk_alignment=request.chunk_alignment or "auto")
    sizes = {lay.layer: unaligned_total_bytes(lay.entries, n) for lay in plan.layouts}
    kinds = {lay.layer: bytes_by_kind({e.name: e.nbytes for e in lay.entries}) for lay in plan.layouts}
    rest = {name: t.nbytes for name, t in ckpt.tensors.items() if name not in plan.targets.names}
    selected = [*(["--preset", request.preset] if request.preset else []),
                *(a for t in request.targets for a in ("--target", t)),
                *(["--layer-pattern", request.layer_pattern] if request.layer_pattern else []),
                *(["--revision", request.revision] if request.revision else []),
                *(["--allow-preset-mismatch"] if request.allow_preset_mismatch else []),
                *(["--chunk-alignment", str(request.chunk_alignment)] if request.chunk_alignment else [])]
    return _Model("checkpoint", sizes, plan.replicated_bytes, ckpt.config, plan.chunk_alignment, kinds=kinds,
                  tensor_bytes=rest, fetched_bytes=ckpt.fetched_bytes() if ckpt.fetched_bytes else None,
                  convert_args=(request.source, f"{_base_name(request.source)}-n{n}", *selected))


def _read_converted(root: Path, request: PlanRequest, n: int) -> _Model:
    from .inspect import replicated_bytes, replicated_tensor_bytes
    from .source import read_config

    manifest = load_manifest(root)
    wanted = parse_layers(request.layers)
    records = [r for r in manifest.layers if r.layer in wanted]
    if not records:
        raise ShardprepError(f"{root}: none of its sharded layers ({', '.join(str(r.layer) for r in manifest.layers)})"
                             f" is in --layers {request.layers}")
    notes = []
    if request.targets or request.preset:
        notes.append(f"{root} is converted: its own targets are used, --preset/--target are ignored")
    # The entries sit at the same offsets for any N; as in `account`, |T| before the chunk alignment.
    sizes = {r.layer: unaligned_total_bytes(r.entries, n) for r in records}
    if n != manifest.world_size:
        notes.append(f"{root} was converted for {manifest.world_size} ranks; sizes are laid out again for "
                     f"{n}")
    config = read_config(root)
    unsharded = sum(r.total_bytes for r in manifest.layers if r not in records)
    kinds = {r.layer: bytes_by_kind({e.name: e.nbytes for e in r.entries}) for r in records}
    args = _recorded_convert_args(root, manifest, config, n, notes)
    return _Model("converted", sizes, replicated_bytes(root, manifest) + unsharded, config,
                  request.chunk_alignment or manifest.chunk_alignment, tuple(notes), kinds,
                  replicated_tensor_bytes(root, manifest) if request.ep > 1 else {}, convert_args=args)


def _base_name(source: str) -> str:
    """A directory name for a new output of SRC (a path or a hub id).

    >>> _base_name("deepseek-ai/DeepSeek-V3"), _base_name("out/")
    ('DeepSeek-V3', 'out')
    """
    return Path(source.rstrip("/")).name or "out"


def _recorded_convert_args(root: Path, manifest: Any, config: dict[str, Any] | None, n: int,
                           notes: list[str]) -> tuple[str, ...]:
    """convert's arguments (SRC, a new OUT, then options) that give OUT again with other layers: the source, the
    selection and the requant its manifest records."""
    source, selection = manifest.source or {}, manifest.selection or {}
    src = source.get("repo_id") or source.get("path") or "SRC"
    args = [str(src), f"{root.name}-n{n}"]
    if source.get("repo_id") and (source.get("commit") or source.get("revision")):
        args += ["--revision", str(source.get("commit") or source.get("revision"))]
    preset = selection.get("preset")
    if preset in builtin_presets() and selection.get("preset_targets") == list(load_preset(preset).targets):
        args += ["--preset", preset]
    elif selection.get("preset_targets"):
        notes.append(f"{root} was converted with the preset file {preset!r}, which its manifest records by its globs "
                     "alone: the command gives them as --target; give the file as --preset to keep its fused views")
        args += [a for glob in selection["preset_targets"] for a in ("--target", glob)]
    args += [a for glob in selection.get("targets") or () for a in ("--target", glob)]
    if selection.get("layer_pattern") not in (None, DEFAULT_LAYER_PATTERN):
        args += ["--layer-pattern", selection["layer_pattern"]]
    args += _recorded_requant_args(manifest.quantization, config)
    return tuple(args)


def _recorded_requant_args(record: dict[str, Any] | None, config: dict[str, Any] | None) -> list[str]:
    """The requant options that give this quantization record again (convert's defaults left out).

    >>> _recorded_requant_args({"recipe": "fp32", "scale_format": "f32", "scope": "all"}, None)
    ['--requant-recipe', 'fp32']
    >>> _recorded_requant_args(None, {"quantization_config": {"quant_method": "fp8"}})
    ['--requant', 'none']
    """
    if record is None:
        quant = (config or {}).get("quantization_config") or {}
        return ["--requant", "none"] if isinstance(quant, dict) and quant.get("quant_method") == "fp8" else []
    args = []
    for option, key, default in (("--requant-recipe", "recipe", "sglang"), ("--scale-format", "scale_format", "f32"),
                                 ("--requant-scope", "scope", "all")):
        if record.get(key, default) != default:
            args += [option, str(record[key])]
    return args + (["--allow-nonfinite"] if record.get("allow_nonfinite") else [])
