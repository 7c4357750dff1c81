"""`shardprep validate --manifest-only`: every check of an output that needs no byte of its weights.

A CI job of a deployment repository holds `shard_manifest.json` (kilobytes), not the rank files (hundreds
of GB). From the manifest alone this checks the schema, the manifest's checksum of itself, every layout
invariant, the rank files' header the manifest implies, and the rules on names and paths. With a source,
it compares the manifest with the source's index, safetensors headers and config.json, and reads none
of its tensor data. What it cannot check is the bytes: no chunk or file checksum, size or padding of the
output, no tensor bytes of the source. Every report says so in a `bytes_not_checked` warning; `shardprep
validate OUT` checks them where the files are.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import RequantError, SelectionError, ShardprepError
from ..manifests.layout import TensorSpec
from ..manifests.manifest import MANIFEST_NAME, Manifest, read_manifest_at
from ..manifests.problems import Problem, quoted
from ..manifests.safetensors_header import MAX_HEADER_BYTES
from ..requant.detect import SCALE_SUFFIX, detect_block_fp8
from .output.output_dir import is_staging_dir
from .selection import Preset, Selection, TargetPlan, builtin_presets, load_preset, parse_layers, select_targets
from .source import SourceCheckpoint, open_source
from .validate import (
    ValidationReport,
    checked_manifest,
    not_an_output,
    other_source,
    source_revision,
    staging_problem,
)

NOT_CHECKED = ("manifest only: no byte of the output was read, so the sizes, headers, padding and checksums of "
               "its rank files and other files are not checked (`shardprep validate OUT` checks them)")
NOT_CHECKED_IN_SOURCE = "; nor the source's tensor data, so no target's bytes were compared with it"


def validate_manifest(path: str | Path, source: str | Path | None = None,
                      revision: str | None = None) -> ValidationReport:
    """Check a manifest alone: `path` is the manifest file (of any name) or a directory holding
    `shard_manifest.json`. With `source` (a directory or a hub repo id, as `validate` takes it), also check
    it against the source's headers: every target's dtype, shape and size, the fused groups, the requant
    settings against config.json's quantization_config, and that no source tensor or file is left out.

    Raises ShardprepError only when the check cannot run (no such path, a directory without a manifest, a source
    that cannot be opened);
    everything wrong with the manifest is a `Problem` in the report, as `validate` reports it.

    >>> report = validate_manifest("deploy/llama-70b/shard_manifest.json", source="my-model/")  # doctest: +SKIP
    >>> assert report.ok, report.messages  # doctest: +SKIP
    """
    given = Path(path)
    if "\x00" in str(given):
        raise ShardprepError(f"{quoted(str(given))}: a path cannot contain a NUL byte")
    if not given.exists():
        raise ShardprepError(f"{given}: no such file or directory")
    report = ValidationReport(str(given))
    report.warnings.append(Problem("bytes_not_checked", NOT_CHECKED + (NOT_CHECKED_IN_SOURCE if source else "")))
    if given.is_dir() and is_staging_dir(given):
        report.add(staging_problem(given))
        return report
    file = given / MANIFEST_NAME if given.is_dir() else given
    if given.is_dir() and not os.path.lexists(file):
        raise ShardprepError(not_an_output(given))
    name = str(file)
    manifest = checked_manifest(lambda: read_manifest_at(file, check=False), name, report)
    if manifest is None:
        return report
    _check_implied_rank_header(manifest, name, report)
    report.count("layers", len(manifest.layers))
    report.count("targets", sum(len(r.entries) for r in manifest.layers))
    report.count("fused_views", sum(len(r.views) for r in manifest.layers))
    report.count("rank_files", len(manifest.rank_files))
    if source is not None:
        other = other_source(manifest, source)
        if other is not None:
            report.warnings.append(Problem("source_not_recorded", other))
        ckpt = open_source(source, source_revision(manifest, source, revision), whole_files=False)
        _check_against_headers(manifest, name, ckpt, report)
    return report


def _check_implied_rank_header(m: Manifest, name: str, report: ValidationReport) -> None:
    # Every rank file starts with this header (docs/format.md), built from the layers alone; the invariants
    # already hold the layers to the layout it describes. What they cannot see is its length: safetensors
    # refuses a header over 100 MB, which a manifest of hundreds of thousands of layers would give.
    if m.version < 2:
        return  # version 1 rank files have no header
    length = len(m.rank_header) - 8
    if length > MAX_HEADER_BYTES:
        report.add(Problem("invalid_safetensors", f"{name}: the rank files' safetensors header it implies is "
                           f"{length} bytes, more than safetensors reads ({MAX_HEADER_BYTES}); use fewer layers "
                           "per output", file=name))
    report.count("rank_header_bytes", length + 8)


# -- against the source's headers ----------------------------------------------------------------


def _check_against_headers(m: Manifest, name: str, ckpt: SourceCheckpoint, report: ValidationReport) -> None:
    _check_source_files(m, name, ckpt, report)
    rewritten = _requant_rewrites(m, name, ckpt, report)
    for r in m.layers:
        for e in r.entries:
            t = ckpt.tensors.get(e.name)
            if t is None:
                report.add(Problem("tensor_not_in_source", f"tensor {quoted(e.name)} is not in the source "
                                   f"{ckpt.root}", layer=r.layer, tensor=e.name))
                continue
            report.count("targets_checked_against_source")
            if rewritten is None:
                continue  # what convert writes is not known: the requant recorded cannot come from this source
            want = rewritten.get(e.name) or TensorSpec(t.name, t.dtype, t.shape)
            if (e.dtype, tuple(e.shape), e.nbytes) != (want.dtype, tuple(want.shape), want.nbytes):
                how = (f", which convert writes as {want.dtype}{list(want.shape)} (the requantization the "
                       "manifest records)") if e.name in rewritten else ""
                report.add(Problem("tensor_mismatch", f"tensor {quoted(e.name)}: manifest says {e.dtype}"
                                   f"{list(e.shape)} ({e.nbytes} bytes), the source's header has {t.dtype}"
                                   f"{list(t.shape)} ({t.nbytes} bytes){how}", layer=r.layer, tensor=e.name))
    _check_selection(m, name, ckpt, report)


def _check_source_files(m: Manifest, name: str, ckpt: SourceCheckpoint, report: ValidationReport) -> None:
    """The manifest records the safetensors files convert read. A source file it does not record holds
    tensors that are in neither the rank files nor the replicated part; for the replicated part, which only
    the output's index lists, this is what a manifest can tell."""
    recorded = {f["name"]: f["size"] for f in (m.source.get("files") or []) if isinstance(f, dict)}
    if not recorded:
        return  # nothing recorded to compare with
    present = {f.name: f.size for f in ckpt.files.values()}
    for file in sorted(present.keys() - recorded.keys()):
        report.add(Problem("source_file_mismatch", f"source file {quoted(file)} is not among those {name} records "
                           "(its tensors are not in this output)", file=file))
    for file in sorted(recorded.keys() - present.keys()):
        report.add(Problem("source_file_mismatch", f"{name} records source file {quoted(file)}, which is not in "
                           f"the source {ckpt.root}", file=file))
    for file in sorted(recorded.keys() & present.keys()):
        if recorded[file] != present[file]:
            report.add(Problem("source_file_mismatch", f"source file {quoted(file)}: {present[file]} bytes by its "
                               f"header, {name} records {recorded[file]}", file=file))
    report.count("source_files", len(present))


def _requant_rewrites(m: Manifest, name: str, ckpt: SourceCheckpoint,
                      report: ValidationReport) -> dict[str, TensorSpec] | None:
    """The targets the requantization the manifest records rewrites, as convert writes them (plan_requant's
    rule, from the headers and config.json alone). None, and a problem, when the source's quantization_config
    and the manifest's record disagree."""
    q, options = m.quantization, m.requant_options or {}
    try:
        info = detect_block_fp8(ckpt.config or {}, ckpt.tensors)
    except RequantError as exc:
        report.add(Problem("requant_mismatch", f"{ckpt.root}: {exc}"))
        return None
    if not q:
        if info is None and options.get("mode") == "ue8m0":
            report.add(Problem("requant_mismatch", f"{name} records --requant ue8m0, but the source's config.json "
                               "declares no block-FP8 quantization_config (convert would have refused)"))
        elif info is not None and info.scale_fmt != "ue8m0" and options.get("mode") != "none":
            report.warnings.append(Problem("requant_unchecked", f"{name} records no requantization of this "
                                           "block-FP8 source: right only if every scale was a power of two "
                                           "already, which only the scales' bytes can tell"))
        return {}
    why = None
    if info is None:
        why = "its config.json declares no block-FP8 quantization_config"
    elif info.scale_fmt == "ue8m0":
        why = "its config.json says its scales are UE8M0 already (scale_fmt), so convert does not requantize"
    elif list(info.block) != list(q.get("block") or []):
        why = f"its weight_block_size is {list(info.block)}, the manifest records {q.get('block')}"
    elif m.version >= 2 and (options.get("mode") == "none" or any(
            options.get(k) != q.get(k) for k in ("recipe", "scale_format", "scope", "allow_nonfinite"))):
        why = f"the manifest's requant_options {options} disagree with its quantization record {q}"
    if why or info is None:
        report.add(Problem("requant_mismatch", f"{name} records a requantization that cannot come from the source "
                           f"{ckpt.root}: {why}"))
        return None
    targets = set(m.target_names())
    scale_dtype = "F8_E8M0" if q.get("scale_format") == "e8m0" else "F32"
    out: dict[str, TensorSpec] = {}
    for weight_name in info.weight_names:
        if q.get("scope", "all") == "targets" and weight_name not in targets:
            continue
        weight, scale = ckpt.tensors[weight_name], ckpt.tensors[weight_name + SCALE_SUFFIX]
        if weight.dtype != "F8_E4M3":
            report.add(Problem("requant_mismatch", f"tensor {quoted(weight_name)} has a weight_scale_inv but dtype "
                               f"{weight.dtype}, not F8_E4M3: convert cannot requantize it", tensor=weight_name))
            continue
        out[weight_name] = TensorSpec(weight_name, "F8_E4M3", weight.shape)
        out[scale.name] = TensorSpec(scale.name, scale_dtype, scale.shape)
    return out


def _check_selection(m: Manifest, name: str, ckpt: SourceCheckpoint, report: ValidationReport) -> None:
    """Apply the selection the manifest records to the source's tensor names: the targets, their layers
    and (for a built-in preset) the fused groups must be the manifest's."""
    if not isinstance(m.selection, dict):
        return  # format version 1 records no selection
    try:
        selection, rules_known = _recorded_selection(m.selection)
        plan = select_targets(ckpt.tensors, selection)
    except SelectionError as exc:
        report.add(Problem("selection_mismatch", f"{name}: the selection it records does not apply to the source "
                           f"({exc})"))
        return
    layer_of = {t: layer for layer, names in plan.layers.items() for t in names}
    before = len(report.problems)
    for r in m.layers:
        for e in r.entries:
            if e.name in ckpt.tensors and layer_of.get(e.name) != r.layer:
                where = "does not select it" if e.name not in layer_of else f"puts it in layer {layer_of[e.name]}"
                report.add(Problem("selection_mismatch", f"tensor {quoted(e.name)} is a target of layer {r.layer} "
                                   f"in {name}, but the selection it records {where}", layer=r.layer,
                                   tensor=e.name))
    targets = set(m.target_names())
    for layer, names in plan.layers.items():
        for t in names:
            if t not in targets:
                report.add(Problem("source_tensor_missing", f"source tensor {quoted(t)} is a target of layer "
                                   f"{layer} under the selection {name} records, but the manifest has no entry "
                                   "for it", layer=layer, tensor=t))
    if len(report.problems) > before:
        return  # the fused groups would only repeat the difference
    if rules_known:
        _check_fused_groups(m, name, plan, report)
    else:
        report.warnings.append(Problem("fused_groups_unchecked", f"{name}: preset {quoted(m.selection['preset'])} "
                                       "is not a built-in preset of this shardprep (or its globs changed): which "
                                       "groups it fuses is not known, so only the views' members were checked"))


def _recorded_selection(record: dict) -> tuple[Selection, bool]:
    """The `Selection` a manifest's selection record describes, and whether its fused rules are known
    (a built-in preset with the recorded globs, or no preset at all; a preset file's rules are not recorded)."""
    preset = None
    rules_known = True
    if record["preset"] is not None:
        globs = tuple(record["preset_targets"])
        builtin = load_preset(record["preset"]) if record["preset"] in builtin_presets() else None
        rules_known = builtin is not None and builtin.targets == globs
        preset = Preset(record["preset"], globs, builtin.fused if builtin and rules_known else ())
    return Selection(targets=tuple(record["targets"]), preset=preset, layers=parse_layers(record["layers"]),
                     layer_pattern=record["layer_pattern"],
                     unnumbered_layers=tuple(record.get("unnumbered_layers", {}).items())), rules_known


def _check_fused_groups(m: Manifest, name: str, plan: TargetPlan, report: ValidationReport) -> None:
    for r in m.layers:
        groups = {g.name: g for g in plan.groups.get(r.layer, ())}
        want = {g.name: g.members for g in groups.values()}
        have = {v.name: v.members for v in r.views}
        rows = {e.name: e.shape[0] if e.shape else 0 for e in r.entries}
        for v in r.views:
            pad = -sum(rows.get(m, 0) for m in v.members) % groups[v.name].row_multiple if v.name in groups else None
            if pad is not None and want[v.name] == v.members and v.pad_rows != pad:
                report.add(Problem("fused_mismatch", f"{name}: layer {r.layer}: view {quoted(v.name)} has "
                                   f"{v.pad_rows} pad rows, the preset pads it with {pad}", layer=r.layer,
                                   tensor=v.name))
        for view in sorted(want.keys() | have.keys()):
            if want.get(view) == have.get(view):
                continue
            if view not in have:
                why = f"the preset fuses {quoted(view)} of {list(want[view])}, the manifest has no such view"
            elif view not in want:
                why = f"the manifest's view {quoted(view)} is not a group the preset fuses in the source"
            else:
                why = f"view {quoted(view)} has members {list(have[view])}, the preset fuses {list(want[view])}"
            report.add(Problem("fused_mismatch", f"{name}: layer {r.layer}: {why}", layer=r.layer, tensor=view))
