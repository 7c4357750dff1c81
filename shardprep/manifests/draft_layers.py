"""Which of a manifest's layers belong to a draft model rather than to the target model.

DeepSeek-V3/R1/V3.1 ship their Multi-Token-Prediction (MTP) layers inside the checkpoint: config.json says
`num_hidden_layers: L` and `num_nextn_predict_layers: k`, and the checkpoint holds k more layers,
`model.layers.{L}` … `model.layers.{L+k-1}`, each a full decoder layer plus `enorm`, `hnorm`, `eh_proj`,
`shared_head` and `embed_tokens`. Servers run them as a draft model (vLLM: `deepseek_mtp`); transformers
builds no MTP layer. A manifest records them in its optional `draft` field (docs/format.md, "Drafts"), so
a reader binds the target's layers to the target model and the draft's to the draft, or leaves them unread.
Pure: no torch, no files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError
from .problems import quoted

MTP = "mtp"
DRAFT_KINDS = (MTP,)
"""What a draft record's `kind` may be: `mtp`, layers inside the target's own checkpoint."""


@dataclass(frozen=True)
class DraftLayers:
    """The manifest layers that belong to a draft model, and what kind of draft it is.

    >>> DraftLayers(MTP, (3,)).record()
    {'kind': 'mtp', 'layers': [3]}
    """

    kind: str
    layers: tuple[int, ...]

    def record(self) -> dict[str, Any]:
        """The manifest's `draft` field."""
        return {"kind": self.kind, "layers": list(self.layers)}

    def describe(self) -> str:
        """In words, for messages: `the MTP draft layer 3`.

        >>> DraftLayers(MTP, (3, 4)).describe()
        'the MTP draft layers 3, 4'
        """
        what = "MTP draft" if self.kind == MTP else f"{self.kind} draft"
        return f"the {what} layer{'s' if len(self.layers) > 1 else ''} {', '.join(map(str, self.layers))}"


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


def draft_of_config(config: Mapping[str, Any] | None, layers: Iterable[int]) -> DraftLayers | None:
    """The draft record for a manifest with these layers converted from a checkpoint with this config: its
    MTP layers that the manifest holds (None when it holds none).

    >>> draft_of_config({"num_hidden_layers": 3, "num_nextn_predict_layers": 1}, [1, 2, 3])
    DraftLayers(kind='mtp', layers=(3,))
    """
    held = set(layers)
    found = tuple(i for i in mtp_layers(config) if i in held)
    return DraftLayers(MTP, found) if found else None


def serving_draft(draft: DraftLayers | None, layers: Iterable[int], config: Mapping[str, Any] | None,
                  where: str = "DIR") -> DraftLayers | None:
    """The draft's layers as a server must treat them: the manifest's record, checked against config.json; for a
    manifest written before drafts were recorded, the config's MTP layers that it holds.

    A recorded draft must be exactly the config's MTP layers that the manifest holds: a ManifestError otherwise
    (a target layer would be left unbound, or a draft layer bound to the target model).

    >>> serving_draft(None, [1, 2, 3], {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    DraftLayers(kind='mtp', layers=(3,))
    """
    held = list(layers)
    from_config = draft_of_config(config, held)
    if draft is None:
        if from_config is not None and draft_problems(from_config, held):
            raise ManifestError(f"{where}: config.json's num_nextn_predict_layers makes {from_config.describe()}, "
                                f"but {draft_problems(from_config, held)[0]}; convert again", code="draft_layers")
        return from_config
    if from_config is None or from_config.layers != draft.layers:
        says = from_config.describe() if from_config else "no MTP layer among them"
        raise ManifestError(f"{where}: the manifest marks {draft.describe()} but config.json (num_hidden_layers, "
                            f"num_nextn_predict_layers) says {says}; was DIR converted from this config?",
                            code="draft_layers")
    return draft


def parse_draft(data: Any) -> DraftLayers | None:
    """The manifest's `draft` field as read (the schema has checked its types); None when absent."""
    if data is None:
        return None
    return DraftLayers(data["kind"], tuple(data["layers"]))


def draft_problems(draft: DraftLayers, layer_order: list[int]) -> list[str]:
    """What is wrong with a draft record against the manifest's layers (in file order); [] when nothing.

    The draft's layers come after every target layer in the rank files, so a reader that serves the target
    alone reads a prefix of each file and nothing of the draft's.

    >>> draft_problems(DraftLayers(MTP, (3,)), [1, 2, 3])
    []
    >>> print(*draft_problems(DraftLayers(MTP, (2,)), [1, 2, 3]))
    draft layer 2 comes before target layer 3 in the rank files; the draft's layers must come last
    """
    problems = []
    if draft.kind not in DRAFT_KINDS:
        problems.append(f"draft kind {quoted(draft.kind)} is not one of {', '.join(DRAFT_KINDS)}")
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
