"""Which of a manifest's layers belong to a draft model rather than to the target model.

DeepSeek-V3/R1/V3.1 ship their Multi-Token-Prediction (MTP) layers inside the checkpoint: config.json says
`num_hidden_layers: L` and `num_nextn_predict_layers: k`, and the checkpoint holds k more layers,
`model.layers.{L}` … `model.layers.{L+k-1}`, each a full decoder layer plus `enorm`, `hnorm`, `eh_proj`,
`shared_head` and `embed_tokens`. Servers run them as a draft model (vLLM: `deepseek_mtp`); transformers
builds no MTP layer. A manifest records them in its optional `draft` field (docs/format.md, "Drafts"), so
a reader binds the target's layers to the target model and the draft's to the draft, or leaves them unread.

DFlash and EAGLE-3 drafts ship as checkpoints of their own (config.json's `architectures` says which): a
manifest converted from one is all draft (`kind` dflash or eagle3, every layer), and records what the draft knows
of the target it was trained for (`DraftTarget`: hidden size, vocabulary, the target layers it reads), so that
serving it beside another target is refused in one line (`target_mismatch`).
Pure: no torch, no files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError, SourceError
from .problems import quoted
from .strict_json import is_int

MTP = "mtp"
DFLASH = "dflash"
EAGLE3 = "eagle3"
DRAFT_KINDS = (MTP, DFLASH, EAGLE3)
"""What a draft record's `kind` may be: `mtp`, layers inside the target's own checkpoint; `dflash` and `eagle3`, a
whole draft model converted from its own checkpoint (MODEL_KINDS)."""
MODEL_KINDS = (DFLASH, EAGLE3)
ONE_PASS_KINDS = (DFLASH,)
"""Drafts that run each of their layers once per step (DFlash proposes a whole block in one forward); the others run
their layer once per proposed token, so a gather slot must hold it through the step's passes."""
KIND_NAMES = {MTP: "MTP", DFLASH: "DFlash", EAGLE3: "EAGLE-3"}
DRAFT_ARCHITECTURES = {
    "DFlashDraftModel": DFLASH,
    "LlamaForCausalLMEagle3": EAGLE3,
    "Eagle3LlamaForCausalLM": EAGLE3,
}
"""config.json's `architectures` of the drafts convert takes as published, and their kind. vLLM 0.32 builds
DFlashDraftModel as qwen3_dflash.DFlashQwen3ForCausalLM (z-lab's DFlash drafts) and both EAGLE-3 names as
llama_eagle3.Eagle3LlamaForCausalLM (EAGLE-3's and SpecForge's drafts: one `midlayer`)."""


@dataclass(frozen=True)
class DraftTarget:
    """What a draft model converted from its own checkpoint knows of the target it was trained for.

    `hidden_size`: the target's (config.json's `target_hidden_size`, else `hidden_size`: the width of the hidden
    states the draft reads). `vocab_size`: the target's vocabulary (DFlash reads the target's embedding and LM
    head; EAGLE-3's d2t maps its draft tokens into these target tokens). `aux_layers`: the target layers whose
    hidden states the draft reads, as its config.json says them (DFlash's `target_layer_ids`: the output of layer
    i; EAGLE-3's `eagle_aux_hidden_state_layer_ids`: the hidden state entering layer i, vLLM's meaning), None where
    the config says none (EAGLE-3 then reads the target's default layers, which always exist). `num_layers`: the
    target's layer count where the config says it (DFlash's `num_target_layers`), else None.

    >>> DraftTarget(7168, 163840, (1, 12, 24), 61).record()
    {'hidden_size': 7168, 'vocab_size': 163840, 'aux_layers': [1, 12, 24], 'num_layers': 61}
    """

    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...] | None = None
    num_layers: int | None = None

    def record(self) -> dict[str, Any]:
        """The draft record's `target` field: only the keys the config said."""
        out: dict[str, Any] = {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size}
        if self.aux_layers is not None:
            out["aux_layers"] = list(self.aux_layers)
        if self.num_layers is not None:
            out["num_layers"] = self.num_layers
        return out


@dataclass(frozen=True)
class DraftLayers:
    """The manifest layers that belong to a draft model, what kind of draft it is, and (a draft model converted
    from its own checkpoint) what it knows of its target.

    >>> DraftLayers(MTP, (3,)).record()
    {'kind': 'mtp', 'layers': [3]}
    >>> DraftLayers(DFLASH, (0, 1), DraftTarget(64, 128, (0, 2), 3)).record()["target"]["aux_layers"]
    [0, 2]
    """

    kind: str
    layers: tuple[int, ...]
    target: DraftTarget | None = None
    """None for `mtp` (its target is the rest of its own manifest); required for MODEL_KINDS."""

    @property
    def is_model(self) -> bool:
        """A whole draft model from its own checkpoint (every layer of its manifest), not layers inside a target's."""
        return self.kind in MODEL_KINDS

    def record(self) -> dict[str, Any]:
        """The manifest's `draft` field (`target` only where there is one, so an MTP record keeps its bytes)."""
        out: dict[str, Any] = {"kind": self.kind, "layers": list(self.layers)}
        if self.target is not None:
            out["target"] = self.target.record()
        return out

    def describe(self) -> str:
        """In words, for messages: `the MTP draft layer 3`, `the DFlash draft model (layers 0, 1)`.

        >>> DraftLayers(MTP, (3, 4)).describe()
        'the MTP draft layers 3, 4'
        >>> DraftLayers(EAGLE3, (0,), DraftTarget(64, 128)).describe()
        'the EAGLE-3 draft model (layer 0)'
        """
        what = KIND_NAMES.get(self.kind, self.kind)
        layers = f"layer{'s' if len(self.layers) > 1 else ''} {', '.join(map(str, self.layers))}"
        return f"the {what} draft model ({layers})" if self.is_model else f"the {what} draft {layers}"


def mtp_layers(config: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The MTP layers a config.json declares (`num_nextn_predict_layers` after `num_hidden_layers`); () for none.

    >>> mtp_layers({"num_hidden_layers": 61, "num_nextn_predict_layers": 1})
    (61,)
    >>> mtp_layers({"num_hidden_layers": 3}), mtp_layers(None)
    ((), ())

    Kimi K3's published config keeps them in its `text_config` (vLLM 0.32 reads them there for `mtp`):

    >>> mtp_layers({"model_type": "kimi_k3", "text_config": {"num_hidden_layers": 4, "num_nextn_predict_layers": 1}})
    (4,)
    """
    if not isinstance(config, Mapping):
        return ()
    text = config.get("text_config")
    if isinstance(text, Mapping) and "num_nextn_predict_layers" in text:
        config = text
    count, first = config.get("num_nextn_predict_layers"), config.get("num_hidden_layers")
    if type(count) is not int or type(first) is not int or count < 1 or first < 0:
        return ()
    return tuple(range(first, first + count))


def draft_kind(config: Mapping[str, Any] | None) -> str | None:
    """The kind of draft model a checkpoint is, from its config.json's `architectures` (DRAFT_ARCHITECTURES);
    None for any other model.

    >>> draft_kind({"architectures": ["DFlashDraftModel"]}), draft_kind({"architectures": ["LlamaForCausalLM"]})
    ('dflash', None)
    """
    architectures = config.get("architectures") if isinstance(config, Mapping) else None
    if not isinstance(architectures, list):
        return None
    kinds = {DRAFT_ARCHITECTURES[a] for a in architectures if isinstance(a, str) and a in DRAFT_ARCHITECTURES}
    return kinds.pop() if len(kinds) == 1 else None


def draft_target(config: Mapping[str, Any]) -> DraftTarget:
    """What a draft checkpoint's config.json says of its target (`DraftTarget`); a SourceError naming the key
    when a value the record needs is missing or not a count.

    >>> draft_target({"architectures": ["DFlashDraftModel"], "hidden_size": 64, "vocab_size": 128,
    ...               "num_target_layers": 3, "dflash_config": {"target_layer_ids": [0, 2]}})
    DraftTarget(hidden_size=64, vocab_size=128, aux_layers=(0, 2), num_layers=3)
    >>> draft_target({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "target_hidden_size": 96,
    ...               "vocab_size": 128, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}).hidden_size
    96
    """
    kind = draft_kind(config)
    where = f"config.json of a {KIND_NAMES.get(kind or '', 'draft')} draft"

    def count(key: str, value: Any) -> int:
        if not is_int(value) or value < 1:
            raise SourceError(f"{where}: {key} must be a positive integer, got {quoted(value)}")
        return int(value)

    width = "target_hidden_size" if config.get("target_hidden_size") is not None else "hidden_size"
    hidden = count(width, config.get(width))
    vocab = count("vocab_size", config.get("vocab_size"))
    if kind == DFLASH:
        key, ids = "dflash_config.target_layer_ids", _section(config, "dflash_config").get("target_layer_ids")
    else:  # vLLM reads the top-level key first, then eagle_config's
        key, ids = "eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            key, ids = ("eagle_config.eagle_aux_hidden_state_layer_ids",
                        _section(config, "eagle_config").get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None and (not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids)):
        raise SourceError(f"{where}: {key} must be a non-empty list of target layer numbers, got {quoted(ids)}")
    layers = config.get("num_target_layers") if kind == DFLASH else None
    return DraftTarget(hidden, vocab, None if ids is None else tuple(ids),
                       None if layers is None else count("num_target_layers", layers))


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    section = config.get(key)
    return section if isinstance(section, Mapping) else {}


def draft_of_config(config: Mapping[str, Any] | None, layers: Iterable[int]) -> DraftLayers | None:
    """The draft record for a manifest with these layers (in file order) converted from a checkpoint with this
    config: for a draft model's own checkpoint (`draft_kind`), every layer, with its target's facts; else the
    checkpoint's MTP layers that the manifest holds (None when it holds none).

    >>> draft_of_config({"num_hidden_layers": 3, "num_nextn_predict_layers": 1}, [1, 2, 3])
    DraftLayers(kind='mtp', layers=(3,), target=None)
    >>> draft_of_config({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "vocab_size": 128}, [0])
    DraftLayers(kind='eagle3', layers=(0,), target=DraftTarget(hidden_size=64, vocab_size=128, aux_layers=None, \
num_layers=None))
    """
    held = list(layers)
    kind = draft_kind(config)
    if kind is not None and config is not None:
        return DraftLayers(kind, tuple(held), draft_target(config)) if held else None
    found = tuple(i for i in mtp_layers(config) if i in set(held))
    return DraftLayers(MTP, found) if found else None


def draft_tensor_problem(draft: DraftLayers, shapes: Mapping[str, Sequence[int]]) -> str | None:
    """Where a draft checkpoint's tensors contradict the target facts its config.json gives (convert records those
    facts, so they must be the tensors'), in one line; None when they agree or cannot be compared.

    EAGLE-3's `t2d` has one entry per target token (`vocab_size`); `fc.weight` reads the captured target hidden
    states concatenated: `hidden_size` × the number of target layers read (where the config lists them; without,
    vLLM takes a count from elsewhere in the config).

    >>> draft = DraftLayers(EAGLE3, (0,), DraftTarget(64, 128, (0, 1, 2)))
    >>> draft_tensor_problem(draft, {"t2d": (128,), "fc.weight": (64, 192)}) is None
    True
    >>> print(draft_tensor_problem(draft, {"t2d": (100,)}))
    tensor 't2d' has 100 entries, one per target token, but config.json's vocab_size is 128
    """
    facts = draft.target
    if not draft.is_model or facts is None:
        return None
    t2d = shapes.get("t2d")
    if t2d is not None and tuple(t2d) != (facts.vocab_size,):
        return (f"tensor 't2d' has {'×'.join(map(str, t2d))} entries, one per target token, but config.json's "
                f"vocab_size is {facts.vocab_size}")
    fc = shapes.get("fc.weight")
    reads = len(facts.aux_layers) if facts.aux_layers else 0
    if fc is not None and reads and len(fc) == 2 and fc[1] != reads * facts.hidden_size:
        return (f"tensor 'fc.weight' reads {fc[1]} features, but config.json says {reads} target layers of hidden "
                f"size {facts.hidden_size} ({reads * facts.hidden_size})")
    return None


def target_mismatch(draft: DraftLayers, target_config: Mapping[str, Any] | None) -> str | None:
    """Why a draft cannot serve beside a target with this config.json, in one line; None when it fits.

    Only a draft model from its own checkpoint is checked (an MTP draft is its target's own layers). Compared with
    the target's config (its `text_config` for a multimodal target, Kimi K2.5 and K3): the hidden size, since the
    draft reads the target's hidden states; the vocabulary, `vocab_size` exactly, since DFlash runs the target's
    embedding and LM head on its tokens and EAGLE-3's d2t maps its draft tokens into the target's token ids (its
    config's `vocab_size` is that target vocabulary; `draft_vocab_size` is its own); the layer count, where the
    draft's config says it (DFlash's `num_target_layers`); and each layer the draft reads, which must exist: a
    DFlash id i reads layer i's output (i < the target's layers), an EAGLE-3 id i the hidden state entering layer
    i (i <= the target's layers: the last is the final layer's output).

    >>> draft = DraftLayers(DFLASH, (0, 1), DraftTarget(64, 128, (0, 2), 3))
    >>> target_mismatch(draft, {"hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 3}) is None
    True
    >>> print(target_mismatch(draft, {"hidden_size": 64, "vocab_size": 128, "num_hidden_layers": 2}))
    the DFlash draft was trained for a target of 3 layers (num_target_layers), this target has 2 (num_hidden_layers)
    """
    facts = draft.target
    if not draft.is_model or facts is None:
        return None
    name = f"the {KIND_NAMES[draft.kind]} draft"
    text = target_config.get("text_config") if isinstance(target_config, Mapping) else None
    config = text if isinstance(text, Mapping) and "hidden_size" in text else target_config
    if not isinstance(config, Mapping):
        return f"{name} needs its target's config.json to check that it fits, and there is none"
    hidden, vocab, layers = (config.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if hidden != facts.hidden_size:
        return (f"{name} reads hidden states of size {facts.hidden_size}, this target's are {quoted(hidden)} "
                "(config.json hidden_size)")
    if vocab != facts.vocab_size:
        why = ("it runs the target's embedding and LM head" if draft.kind == DFLASH
               else "its d2t maps its tokens into the target's")
        return (f"{name} was trained for a vocabulary of {facts.vocab_size} tokens ({why}), this target has "
                f"{quoted(vocab)} (config.json vocab_size)")
    if facts.num_layers is not None and layers != facts.num_layers:
        return (f"{name} was trained for a target of {facts.num_layers} layers (num_target_layers), this target has "
                f"{quoted(layers)} (num_hidden_layers)")
    if facts.aux_layers is not None:
        if not isinstance(layers, int) or not is_int(layers):
            return (f"{name} reads target layers {list(facts.aux_layers)}, and this target's config.json has no "
                    "num_hidden_layers to check them against")
        dflash, count = draft.kind == DFLASH, layers
        past = [i for i in facts.aux_layers if (i >= count if dflash else i > count)]
        if past:
            what, key = (("the output of target layer", "dflash_config.target_layer_ids") if dflash else
                         ("the hidden state entering target layer", "eagle_aux_hidden_state_layer_ids"))
            return f"{name} reads {what} {past[0]} ({key}), but this target has {layers} layers (num_hidden_layers)"
    return None


def serving_draft(draft: DraftLayers | None, layers: Iterable[int], config: Mapping[str, Any] | None,
                  where: str = "DIR") -> DraftLayers | None:
    """The draft's layers as a server must treat them: the manifest's record, checked against config.json; for a
    manifest written before drafts were recorded, the config's MTP layers that it holds.

    A recorded draft must be exactly what the config makes of the manifest's layers (its MTP layers; for a draft
    model's own checkpoint, every layer with the same target facts): a ManifestError otherwise (a target layer
    would be left unbound, a draft layer bound to the target model, or the config changed since convert).

    >>> serving_draft(None, [1, 2, 3], {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    DraftLayers(kind='mtp', layers=(3,), target=None)
    """
    held = list(layers)
    from_config = draft_of_config(config, held)
    if draft is None:
        if from_config is not None and draft_problems(from_config, held):
            raise ManifestError(f"{where}: config.json's num_nextn_predict_layers makes {from_config.describe()}, "
                                f"but {draft_problems(from_config, held)[0]}; convert again", code="draft_layers")
        return from_config
    if from_config != draft:
        says = from_config.describe() if from_config else "no draft among them"
        if (from_config is not None and from_config.kind == draft.kind and from_config.layers == draft.layers
                and from_config.target is not None and draft.target is not None):
            says = f"other target facts ({from_config.target.record()}; the manifest's {draft.target.record()})"
        keys = ("architectures and its target's keys" if draft.is_model
                else "num_hidden_layers, num_nextn_predict_layers")
        raise ManifestError(f"{where}: the manifest marks {draft.describe()} but config.json ({keys}) says {says}; "
                            "was DIR converted from this config?", code="draft_layers")
    return draft


def parse_draft(data: Any) -> DraftLayers | None:
    """The manifest's `draft` field as read (the schema has checked its types); None when absent."""
    if data is None:
        return None
    target = data.get("target")
    if target is not None:
        aux = target.get("aux_layers")
        target = DraftTarget(target["hidden_size"], target["vocab_size"], None if aux is None else tuple(aux),
                             target.get("num_layers"))
    return DraftLayers(data["kind"], tuple(data["layers"]), target)


def draft_problems(draft: DraftLayers, layer_order: list[int]) -> list[str]:
    """What is wrong with a draft record against the manifest's layers (in file order); [] when nothing.

    The draft's layers come after every target layer in the rank files, so a reader that serves the target
    alone reads a prefix of each file and nothing of the draft's. A draft model from its own checkpoint
    (MODEL_KINDS) is every layer of its manifest, and says what its target is; an MTP draft does not.

    >>> draft_problems(DraftLayers(MTP, (3,)), [1, 2, 3])
    []
    >>> print(*draft_problems(DraftLayers(MTP, (2,)), [1, 2, 3]))
    draft layer 2 comes before target layer 3 in the rank files; the draft's layers must come last
    >>> print(*draft_problems(DraftLayers(DFLASH, (1,), DraftTarget(64, 128)), [0, 1]))
    a dflash draft's layers must be every layer of the manifest, in order (1, not 0, 1)
    """
    problems = []
    if draft.kind not in DRAFT_KINDS:
        problems.append(f"draft kind {quoted(draft.kind)} is not one of {', '.join(DRAFT_KINDS)}")
    if draft.is_model:
        if draft.target is None:
            problems.append(f"a {draft.kind} draft record needs its target's facts (`target`)")
        if list(draft.layers) != list(layer_order):
            problems.append(f"a {draft.kind} draft's layers must be every layer of the manifest, in order "
                            f"({', '.join(map(str, draft.layers))}, not {', '.join(map(str, layer_order))})")
        return problems
    if draft.target is not None:
        problems.append(f"a {draft.kind} draft record has no `target` (its target is the manifest's other layers)")
    if len(set(draft.layers)) != len(draft.layers) or not draft.layers:
        problems.append("draft layers must be a non-empty list without repeats")
    missing = [i for i in draft.layers if i not in layer_order]
    if missing:
        problems.append(f"draft layer {missing[0]} is not a layer of the manifest")
    elif draft.layers:
        targets = [i for i in layer_order if i not in draft.layers]
        first = min(layer_order.index(i) for i in draft.layers)
        after = [i for i in layer_order[first:] if i in targets]
        if after:
            problems.append(f"draft layer {layer_order[first]} comes before target layer {after[0]} in the rank "
                            "files; the draft's layers must come last")
    return problems


def layer_mismatch(model_layers: int, manifest_layers: Iterable[int], config_mtp: tuple[int, ...] = ()) -> str:
    """The one-line refusal when a model has fewer layers than the manifest's target layers bound to it: which
    layers each side has, and whether the extra ones are a draft's (`config_mtp`: config.json's MTP layers).

    >>> print(layer_mismatch(3, [1, 2, 3], (3,)))  # doctest: +NORMALIZE_WHITESPACE
    the model has layers 0..2 but the manifest's target layers are 1..3: layer 3 is a draft's (config.json's
    MTP layer, num_nextn_predict_layers) that the manifest does not mark as one (written before shardprep
    recorded drafts); build the model with build_model(DIR), which leaves it unread, or convert again
    >>> print(layer_mismatch(2, [1, 2, 3]))  # doctest: +NORMALIZE_WHITESPACE
    the model has layers 0..1 but the manifest's target layers are 1..3: layers 2, 3 are neither the model's
    nor a draft's; was DIR converted from this model?
    """
    held = sorted(set(manifest_layers))
    extra = [i for i in held if i >= model_layers]
    span = f"{held[0]}..{held[-1]}" if held else "none"
    head = f"the model has layers 0..{model_layers - 1} but the manifest's target layers are {span}: "
    which = f"layer{'s' if len(extra) > 1 else ''} {', '.join(map(str, extra))} {'are' if len(extra) > 1 else 'is'}"
    if extra and set(extra) <= set(config_mtp):
        return (head + f"{which} a draft's (config.json's MTP layer, num_nextn_predict_layers) that the manifest "
                "does not mark as one (written before shardprep recorded drafts); build the model with "
                "build_model(DIR), which leaves it unread, or convert again")
    return head + f"{which} neither the model's nor a draft's; was DIR converted from this model?"
