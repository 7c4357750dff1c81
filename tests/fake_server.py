"""A server for the shared load flows' tests, with no server installed: a `ServerAdapter` over plain torch models.

`FakeServer` answers the seam's questions the way a server that fuses, renames and quantizes nothing would, and
records what the flow asked (which modules it kept plain, what it was asked to refuse). `give_load_weights`
gives a transformers model the `load_weights` a server's model has: each tensor through the parameter's
`weight_loader` (the convention vLLM and SGLang share), reporting the names it loaded, or None as vLLM's draft
models do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shardprep.integrations.server import Built, OptionSpelling, ServerAdapter, WorkerLayout

SPELLING = OptionSpelling(server="FakeServer", tp_option="tp", pp_option="pp", dp_option="dp",
                          dp_advice="dp={n}", without_lockstep="FakeServer's DP ranks do not step together")


def copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """The fake server's default weight loader."""
    param.data.copy_(tensor)


class FakeServer(ServerAdapter):
    spelling = SPELLING

    def __init__(self, layout: WorkerLayout | None = None, refuse: Callable[..., None] | None = None):
        self._layout = layout or WorkerLayout(dp_rank=0, dp_size=1, dp_world_ranks=(0,), tp_size=1, pp_size=1,
                                              lockstep_dp=True, eager=True, device=torch.device("cpu"),
                                              platform="cpu")
        self._refuse = refuse
        self.kept_plain: list[nn.Module] = []
        self.log = logging.getLogger("fake_server.shardprep")

    def layout(self) -> WorkerLayout:
        return self._layout

    @contextmanager
    def targets_without_storage(self, is_target: Callable[[str], bool]) -> Iterator[Built]:
        yield []

    def keep_plain(self, module: nn.Module) -> None:
        self.kept_plain.append(module)

    def logger(self) -> logging.Logger:
        return self.log

    def refuse_unshardable(self, model: nn.Module, targets: Mapping[str, nn.Parameter], directory: str) -> None:
        if self._refuse is not None:
            self._refuse(model, targets, directory)

    def default_weight_loader(self) -> Callable[..., Any]:
        return copy_into


def give_load_weights(model: nn.Module, report: bool = True, skip: Callable[[str], bool] = lambda name: False) -> None:
    """Give `model` a server-style `load_weights(weights)`: each (name, tensor) whose name is a parameter of the
    model goes through that parameter's `weight_loader` (or `copy_into`), except those `skip` accepts; returns the
    names loaded, or None with `report=False`."""
    params = dict(model.named_parameters())

    def load_weights(weights: Any) -> set[str] | None:
        loaded = set()
        for name, tensor in weights:
            if name in params and not skip(name):
                getattr(params[name], "weight_loader", copy_into)(params[name], tensor)
                loaded.add(name)
        return loaded if report else None

    model.load_weights = load_weights  # type: ignore[assignment]
