"""A bound model's sharded layers with their full weights resident: the replicated model, for comparison.

`shardprep profile` times each layer's compute with replicated weights (no gathers at all) on the very
model it then times sharded: every bound layer is gathered once into a buffer of its own, the hooks are
taken off, and the target parameters point at those buffers. `detach()` points them back at the
gatherer's views.
Costs R (all the targets) of device memory while attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..runtime.views import layer_views

if TYPE_CHECKING:
    from ..runtime.binding import Binding


class ResidentWeights:
    """Full copies of every bound layer's targets, gathered once through the binding's gatherer.

    Collective to construct (one forward's gathers on every rank).

    >>> resident = ResidentWeights(binding)  # doctest: +SKIP
    >>> resident.attach(); model(ids); resident.detach()  # doctest: +SKIP
    """

    def __init__(self, binding: Binding):
        self.binding = binding
        manifest = binding.shards.manifest
        gatherer = binding.gatherer
        self._full: dict[int, dict[str, torch.Tensor]] = {}
        gatherer.begin()
        for layer in binding.layers:
            record = manifest.layer(layer.index)
            views = gatherer.wait(layer.index)
            full = layer_views(record, torch.empty(record.total_bytes, dtype=torch.uint8,
                                                   device=binding.shards.device))
            for entry in record.entries:  # fused views alias their members, so the entries are every byte
                full[entry.name].copy_(views[entry.name])
            self._full[layer.index] = full
            gatherer.done(layer.index)
        if binding.shards.device.type == "cuda":
            torch.cuda.synchronize(binding.shards.device)

    def attach(self) -> None:
        """Take the binding's hooks off and point every target at its full copy (no gathers from now on)."""
        self.binding.remove()
        for layer in self.binding.layers:
            layer.point(self._full[layer.index])

    def detach(self) -> None:
        """Targets back on the gatherer's views and the copies freed; bind() the model again to gather."""
        for layer in self.binding.layers:
            layer.point(self.binding.gatherer.views(layer.index))
        self._full.clear()
