"""Which tensors are targets, which layer each belongs to, and which are fused. Pure: names in, plan out."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, SelectionError
from ..manifests.layout import FusedGroup
from ..manifests.strict_json import parse_json, read_json_file

# A preset lists globs; a larger file is not a preset.
MAX_PRESET_BYTES = 1 << 20

# `layers.N.`, `layer.N.`, `h.N.` and `blocks.N.` cover Llama/Qwen/DeepSeek, BERT, GPT-2 and ViT-style names.
DEFAULT_LAYER_PATTERN = r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\."
# Layer 0 is left replicated by default: its compute is what hides the gather of layer 1, and in
# DeepSeek/Kimi-style models it is the dense layer.
DEFAULT_LAYERS = "1-"


@dataclass(frozen=True)
class FusedRule:
    """A preset's fused group, by suffix: members `P+m` for every prefix P where all members are targets."""

    name: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Preset:
    name: str
    targets: tuple[str, ...]
    fused: tuple[FusedRule, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LayerRange:
    """Inclusive layer range; `stop=None` means open-ended."""

    start: int = 1
    stop: int | None = None

    def __contains__(self, layer: int) -> bool:
        return layer >= self.start and (self.stop is None or layer <= self.stop)


@dataclass(frozen=True)
class Selection:
    """What the user asked for: globs and/or a preset, a layer range, and how to read layer indices."""

    targets: tuple[str, ...] = ()
    preset: Preset | None = None
    layers: LayerRange = field(default_factory=LayerRange)
    layer_pattern: str = DEFAULT_LAYER_PATTERN

    def record(self) -> dict[str, Any]:
        """The manifest's `selection` record: the preset's name and globs, the --target globs, the layer range
        and the layer pattern.

        >>> Selection(targets=("*.q_proj.weight",)).record()["layers"]
        '1-'
        """
        return {
            "preset": self.preset.name if self.preset else None,
            "preset_targets": list(self.preset.targets) if self.preset else [],
            "targets": list(self.targets),
            "layers": _fmt_range(self.layers),
            "layer_pattern": self.layer_pattern,
        }


@dataclass(frozen=True)
class TargetPlan:
    """The selection's result: target names per layer, in layer order, and the fused groups per layer."""

    layers: dict[int, list[str]]
    groups: dict[int, list[FusedGroup]]

    @property
    def names(self) -> set[str]:
        return {n for names in self.layers.values() for n in names}


def parse_layer_range(text: str) -> LayerRange:
    """Parse `A-B`, `A-`, `-B`, `A` or `all`.

    >>> parse_layer_range("1-"), parse_layer_range("3-5"), parse_layer_range("all")
    (LayerRange(start=1, stop=None), LayerRange(start=3, stop=5), LayerRange(start=0, stop=None))
    """
    t = text.strip()
    if t in ("all", "*", ""):
        return LayerRange(0, None)
    m = re.fullmatch(r"(\d*)\s*-\s*(\d*)|(\d+)", t)
    if not m:
        raise SelectionError(f"--layers {text!r}: expected A-B, A-, -B, A or all")
    if m.group(3) is not None:
        return LayerRange(int(m.group(3)), int(m.group(3)))
    start = int(m.group(1)) if m.group(1) else 0
    stop = int(m.group(2)) if m.group(2) else None
    if stop is not None and stop < start:
        raise SelectionError(f"--layers {text!r}: end {stop} is before start {start}")
    return LayerRange(start, stop)


def builtin_presets() -> list[str]:
    """Names of the presets shipped in the package.

    >>> "llama" in builtin_presets()
    True
    """
    folder = resources.files(__package__).joinpath("presets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset(name_or_path: str) -> Preset:
    """A built-in preset by name, or a user's preset JSON file by path.

    >>> load_preset("deepseek-v3").fused[0].name
    'mlp.shared_experts.gate_up_proj.weight'
    """
    if name_or_path in builtin_presets():
        text = resources.files(__package__).joinpath("presets").joinpath(f"{name_or_path}.json").read_bytes()
        where = f"preset {name_or_path!r}"
        try:
            data = parse_json(text, where)
        except IntegrityError as exc:
            raise SelectionError(str(exc)) from None
    else:
        path = Path(name_or_path)
        if "\x00" in name_or_path or not path.is_file():
            raise SelectionError(
                f"--preset {name_or_path!r} is neither a built-in preset ({', '.join(builtin_presets())}) nor a file"
            )
        where = str(path)
        try:
            data = read_json_file(path, max_bytes=MAX_PRESET_BYTES, what="preset")
        except IntegrityError as exc:
            raise SelectionError(str(exc)) from None
    return _preset_from_json(data, where, name_or_path)


def _preset_from_json(data: object, where: str, default_name: str) -> Preset:
    def bad(why: str) -> SelectionError:
        return SelectionError(f"{where}: not a valid preset ({why}); see README, `--preset`")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    targets, fused = data.get("targets"), data.get("fused", [])
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise bad("'targets' must be a non-empty list of globs")
    if not isinstance(fused, list):
        raise bad("'fused' must be a list")
    rules = []
    for f in fused:
        name, members = (f.get("name"), f.get("members")) if isinstance(f, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(members, list) or len(members) < 2 or not all(
                isinstance(m, str) and m for m in members):
            raise bad("each 'fused' item needs a 'name' and at least two 'members', all strings")
        rules.append(FusedRule(name, tuple(members)))
    name, description = data.get("name", default_name), data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise bad("'name' and 'description' must be strings")
    return Preset(name, tuple(targets), tuple(rules), description)


def layer_index(name: str, pattern: re.Pattern[str]) -> int | None:
    """Layer index read from a tensor name, or None for tensors outside any layer.

    >>> layer_index("model.layers.12.mlp.up_proj.weight", re.compile(DEFAULT_LAYER_PATTERN))
    12
    """
    m = pattern.search(name)
    if not m:
        return None
    try:
        return int(m.group(1))
    except (TypeError, ValueError):
        raise SelectionError(f"--layer-pattern {pattern.pattern!r} captured {m.group(1)!r} in tensor {name!r}, "
                             "which is not a layer number; capture digits only") from None


def select_targets(names: Iterable[str], selection: Selection) -> TargetPlan:
    """Apply a selection to a checkpoint's tensor names.

    Every `--target` glob must match a tensor (a typo should not silently shard nothing); preset globs
    may match nothing, since a preset covers several model variants.

    >>> sel = Selection(targets=("*.self_attn.*.weight",), layers=parse_layer_range("all"))
    >>> select_targets(["m.layers.0.self_attn.q.weight", "m.embed.weight"], sel).layers
    {0: ['m.layers.0.self_attn.q.weight']}
    """
    all_names = sorted(names)
    try:
        pattern = re.compile(selection.layer_pattern)
    except re.error as exc:
        raise SelectionError(f"--layer-pattern {selection.layer_pattern!r} is not a valid regex: {exc}") from None
    if pattern.groups < 1:
        raise SelectionError(f"--layer-pattern {selection.layer_pattern!r} needs one group capturing the layer number")
    if not selection.targets and selection.preset is None:
        raise SelectionError("no targets selected: pass --target GLOB (repeatable) and/or --preset NAME")

    chosen: set[str] = set()
    for glob in selection.targets:
        hits = fnmatch.filter(all_names, glob)
        if not hits:
            raise SelectionError(f"--target {glob!r} matches no tensor in the checkpoint")
        chosen.update(hits)
    if selection.preset is not None:
        for glob in selection.preset.targets:
            chosen.update(fnmatch.filter(all_names, glob))

    layers: dict[int, list[str]] = {}
    for name in sorted(chosen):
        idx = layer_index(name, pattern)
        if idx is None:
            raise SelectionError(
                f"target {name!r} is not inside a layer (no match for {selection.layer_pattern!r}); "
                "narrow the glob or pass --layer-pattern"
            )
        if idx in selection.layers:
            layers.setdefault(idx, []).append(name)
    if not layers:
        raise SelectionError(
            f"the selection matches no tensor in layers {_fmt_range(selection.layers)} "
            f"({len(chosen)} matched outside that range); check --layers"
        )
    rules = selection.preset.fused if selection.preset else ()
    groups = {idx: _fused_groups(layer_names, rules) for idx, layer_names in layers.items()}
    return TargetPlan(dict(sorted(layers.items())), groups)


def _fused_groups(layer_names: Sequence[str], rules: Sequence[FusedRule]) -> list[FusedGroup]:
    present = set(layer_names)
    groups = []
    for rule in rules:
        first = rule.members[0]
        for name in layer_names:
            if name.endswith("." + first):
                prefix = name[: -len(first)]
                members = tuple(prefix + m for m in rule.members)
                if all(m in present for m in members):
                    groups.append(FusedGroup(prefix + rule.name, members))
    return groups


def _fmt_range(r: LayerRange) -> str:
    return f"{r.start}-{'' if r.stop is None else r.stop}"
