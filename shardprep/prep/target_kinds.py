"""What kind of weight each target is (KDA, MLA or other attention; MoE periphery or dense MLP), from its name.

`inspect` and `plan` split each layer's |T| by these kinds, so that a hybrid model's accounting (Kimi K3: KDA
and MLA layers, latent MoE) can be held against a design note's per-kind figures. Pure: names in, kinds out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

KDA, MLA, ATTENTION, MOE_PERIPHERY, MLP, OTHER = "KDA", "MLA", "attention", "MoE periphery", "MLP", "other"
KINDS = (KDA, MLA, ATTENTION, MOE_PERIPHERY, MLP, OTHER)

_ATTENTION_MODULES = ("self_attn", "attention", "attn")
_MLP_MODULES = ("mlp", "block_sparse_moe", "feed_forward")
# Only Kimi Delta Attention has a forget gate (f_a/f_b) and a beta projection (b_proj); only MLA has latent
# projections. A layer's attention is one kind, whichever of its targets shows it.
_KDA_MARKS = ("f_a_proj", "f_b_proj", "b_proj", "in_proj_qkvgfab")
_MLA_MARKS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj", "fused_qkv_a_g_proj")
_MOE_PERIPHERY_MARKS = ("shared_experts", "shared_expert", "routed_expert_down_proj", "routed_expert_up_proj")


def layer_target_kinds(names: Iterable[str]) -> dict[str, str]:
    """Each of one layer's target names → its kind (KINDS).

    >>> kinds = layer_target_kinds(["m.layers.1.self_attn.q_proj.weight", "m.layers.1.self_attn.f_b_proj.weight",
    ...                             "m.layers.1.block_sparse_moe.shared_experts.up_proj.weight"])
    >>> sorted(set(kinds.values()))
    ['KDA', 'MoE periphery']
    """
    names = list(names)
    parts = {name: name.split(".") for name in names}
    attention = ATTENTION
    if any(mark in p for p in parts.values() for mark in _KDA_MARKS):
        attention = KDA
    elif any(mark in p for p in parts.values() for mark in _MLA_MARKS):
        attention = MLA
    kinds = {}
    for name, p in parts.items():
        if any(module in p for module in _ATTENTION_MODULES):
            kinds[name] = attention
        elif any(mark in p for mark in _MOE_PERIPHERY_MARKS):
            kinds[name] = MOE_PERIPHERY
        elif any(module in p for module in _MLP_MODULES):
            kinds[name] = MLP
        else:
            kinds[name] = OTHER
    return kinds


def bytes_by_kind(nbytes: Mapping[str, int]) -> dict[str, int]:
    """One layer's target bytes summed by kind, kinds in KINDS order, those with no target left out.

    >>> bytes_by_kind({"m.layers.2.self_attn.q_b_proj.weight": 96, "m.layers.2.mlp.shared_experts.up_proj.weight": 32})
    {'MLA': 96, 'MoE periphery': 32}
    """
    sums: dict[str, int] = {}
    for name, kind in layer_target_kinds(nbytes).items():
        sums[kind] = sums.get(kind, 0) + nbytes[name]
    return {kind: sums[kind] for kind in KINDS if kind in sums}


def kind_totals(layers: Iterable[Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """Per kind over layers (each `bytes_by_kind`'s result): the layers holding it, its bytes, and its largest layer.

    >>> kind_totals([{"KDA": 10, "MoE periphery": 4}, {"MLA": 7, "MoE periphery": 4}])["MoE periphery"]
    {'layers': 2, 'bytes': 8, 'max_layer_bytes': 4}
    """
    totals: dict[str, dict[str, int]] = {}
    for layer in layers:
        for kind, size in layer.items():
            t = totals.setdefault(kind, {"layers": 0, "bytes": 0, "max_layer_bytes": 0})
            t["layers"] += 1
            t["bytes"] += size
            t["max_layer_bytes"] = max(t["max_layer_bytes"], size)
    return {kind: totals[kind] for kind in KINDS if kind in totals}
