"""The config.json fields that shardprep's figures use, checked for sense before any arithmetic runs on them.

A config.json is untrusted input (a hub repo's, or any directory's): a `num_hidden_layers` of 10^9 made `plan`
loop and allocate for minutes, a negative one printed a negative layer count, and a huge
`num_nextn_predict_layers` makes the MTP layers a tuple of a billion. Each field the figures read (the layer
count, the MTP layers, the KV cache's sizes; in `text_config` too, where multimodal wrappers keep them) must be
absent, null, or a whole number in a range no real model leaves; anything else is refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SourceError
from ..manifests.problems import quoted

MAX_LAYERS = 10_000
"""Decoder layers of any real model: published ones have about 200 at most."""

FIGURE_FIELDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, MAX_LAYERS), "num_layers": (1, MAX_LAYERS), "n_layer": (1, MAX_LAYERS),
    "num_nextn_predict_layers": (0, 1024),
    "hidden_size": (1, 1 << 20), "n_embd": (1, 1 << 20),
    "num_attention_heads": (1, 1 << 16), "n_head": (1, 1 << 16), "num_key_value_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16), "kv_lora_rank": (0, 1 << 20), "qk_rope_head_dim": (0, 1 << 16),
}
"""Each field the figures read (`planning/kv_cache.py`, `manifests/draft_layers.py`, `plan`'s layer count) →
the whole numbers it may be, inclusive."""


def check_config_figures(config: Mapping[str, Any], where: str) -> None:
    """Refuse, in one line naming the field, a config whose figures no model has (see the module docstring).

    >>> check_config_figures({"num_hidden_layers": 61, "hidden_size": 7168, "head_dim": None}, "config.json")
    >>> check_config_figures({"text_config": {"n_head": 10**9}}, "c")
    Traceback (most recent call last):
    ...
    shardprep.errors.SourceError: c: text_config.n_head is 1000000000; a model's is a whole number from 1 to 65536
    """
    sections = [("", config)]
    if isinstance(config.get("text_config"), Mapping):
        sections.append(("text_config.", config["text_config"]))
    for prefix, section in sections:
        for name, (low, high) in FIGURE_FIELDS.items():
            value = section.get(name)
            if value is not None and (type(value) is not int or not low <= value <= high):
                raise SourceError(f"{where}: {prefix}{name} is {quoted(value)}; a model's is a whole number from "
                                  f"{low} to {high}")
