"""A server for the shared load flows' tests, with no server installed: a `ServerAdapter` over plain torch models.

`FakeServer` answers the seam's questions the way a server that fuses, renames and quantizes nothing would, and
records what the flow and a loader asked (which modules it kept plain, what it was asked to refuse, the splitting
ops and the compile key it was given). Its drafts: `draft` says the load is a draft's, `deployment` is the object a
target's load and its draft's both see (None: no draft runs), `mtp` whether it runs the target's MTP layers.
`give_load_weights` gives a transformers model the `load_weights` a server's model has: each tensor through the
parameter's `weight_loader` (the convention vLLM and SGLang share), reporting the names it loaded, or None as vLLM's
draft models do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardprep.errors import ShardprepError
from shardprep.integrations.server import Built, OptionSpelling, ServerAdapter, WorkerLayout
from shardprep.manifests.manifest import MANIFEST_NAME
from shardprep.runtime.binding import Binding

SPELLING = OptionSpelling(server="FakeServer", tp_option="tp", pp_option="pp", dp_option="dp",
                          dp_advice="dp={n}", without_lockstep="FakeServer's DP ranks do not step together")


def copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """The fake server's default weight loader."""
    param.data.copy_(tensor)


class FakeServer(ServerAdapter):
    spelling = SPELLING

    def __init__(self, layout: WorkerLayout | None = None, refuse: Callable[..., None] | None = None, *,
                 draft: bool = False, deployment: object | None = None, mtp: bool = False):
        self._layout = layout or WorkerLayout(dp_rank=0, dp_size=1, dp_world_ranks=(0,), tp_size=1, pp_size=1,
                                              lockstep_dp=True, eager=True, device=torch.device("cpu"),
                                              platform="cpu")
        self._refuse = refuse
        self._draft, self._deployment, self._mtp = draft, deployment, mtp
        self.kept_plain: list[nn.Module] = []
        self.splitting_ops: list[str] = []
        self.compile_key: str | None = None
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

    def relink_merged_weights(self, model: nn.Module, binding: Binding) -> list[str]:
        return []  # it merges nothing while loading

    def add_splitting_ops(self, ops: Sequence[str]) -> None:
        self.splitting_ops.extend(op for op in ops if op not in self.splitting_ops)

    def key_compile_cache(self, key: str) -> bool:
        self.compile_key = key
        return True

    def loads_draft(self) -> bool:
        return self._draft

    def refuse_published_draft(self, directory: str, sharded: bool) -> None:
        if not (Path(directory) / MANIFEST_NAME).is_file():
            raise ShardprepError(f"{directory}: FakeServer's draft model is not an output of `shardprep convert`; "
                                 "convert it with the target's --ranks")

    def serves_mtp_draft(self, directory: str) -> bool:
        return self._mtp

    def deployment(self) -> object | None:
        return self._deployment

    def runs_a_draft(self) -> bool:
        return self._deployment is not None

    def replicated_draft_line(self) -> str | None:
        return None  # it loads every draft with the load format of its target


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
