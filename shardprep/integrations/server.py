"""The seam between shardprep and a server: what a server must tell shardprep, and nothing else.

A server (vLLM, SGLang, or the next one) is one `ServerAdapter`: how it spells its options, the parallel layout a
worker runs (`WorkerLayout`), how it names a checkpoint tensor's parameter, how it builds a weight without storage,
which modules it quantizes and how it processes them after loading, which targets it cannot serve sharded, its
drafts (whether this load is a draft's, which object a target's load and its draft's both see), its compiled graph,
and its logger. The load flows (`sharded_load.ShardedLoad` for a target, `drafts.DraftLoad` for a draft) call these
and nothing else of the server; each server's `model_loader.py` only follows that server's own lifecycle (when it
builds the model, loads weights, post-processes), calls the flow at each step, and asks its server only through its
adapter's methods. Code outside a server's own package names no server: a message names it through
`spelling.server`.

Adding a server: subclass `ServerAdapter` in `integrations/<server>/adapter.py` (the abstract methods at least),
and write a loader class that builds the model inside `ShardedLoad.build`, calls `ShardedLoad.load` where the server
loads weights, and `ShardedLoad.check_after_processing` after the server's own post-load step (docs/design.md,
"Adding a server"). FSDP2's `_fsdp_api.py` is the model: a small abstract class, not a bag of callbacks.

>>> WorkerLayout(dp_rank=0, dp_size=2, dp_world_ranks=(0, 1), tp_size=1, pp_size=1, lockstep_dp=True,
...              eager=True, device=torch.device("cpu"), platform="cpu").dp_size
2
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ShardprepError
from ..runtime.binding import Binding


@dataclass(frozen=True)
class WorkerLayout:
    """Where this worker sits in the server's parallel configuration: what a sharded load needs to know."""

    dp_rank: int
    dp_size: int
    dp_world_ranks: tuple[int, ...]
    tp_size: int
    """The attention's tensor-parallel size (1 under DP attention)."""
    pp_size: int
    lockstep_dp: bool
    """The server runs the DP ranks in lockstep (an idle one takes dummy forwards), so their gathers pair up."""
    eager: bool
    device: torch.device
    platform: str


@dataclass(frozen=True)
class OptionSpelling:
    """The server's name and its spelling of what a refusal tells the user to change.

    >>> OptionSpelling("vLLM", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    ...                "data_parallel_size={n}", "DP ranks of a dense model step apart").dp_advice.format(n=8)
    'data_parallel_size=8'
    """

    server: str
    tp_option: str
    pp_option: str
    dp_option: str
    dp_advice: str
    """What to launch instead of attention TP > 1, for a directory converted for `{n}` ranks."""
    without_lockstep: str
    """The refusal's start when the DP ranks do not step together: what sharded mode needs, and why they don't."""


Weights = Iterator[tuple[str, torch.Tensor]]
Built = list[tuple[str, nn.Parameter]]


class ServerAdapter(ABC):
    """What shardprep needs to know of one server, in one object (one subclass per server, in its own package).

    The abstract methods are what every server must say; the others have the answer of a server that fuses,
    renames and quantizes nothing.
    """

    spelling: ClassVar[OptionSpelling]

    @abstractmethod
    def layout(self) -> WorkerLayout:
        """Where the worker loading the model sits (called inside the server's load)."""

    @abstractmethod
    def targets_without_storage(self, is_target: Callable[[str], bool]) -> AbstractContextManager[Built]:
        """While the server builds a model inside this block, give each linear layer's parameter whose name
        (the model's) `is_target` accepts no storage: its shape, dtype, device and attributes, one element.
        Yields the (name, parameter) pairs made so, for the flow to check that each was bound."""

    @abstractmethod
    def keep_plain(self, module: nn.Module) -> None:
        """Keep `module` (unquantized, with a bound weight) on a forward that reads its weight each time, instead of
        a copy the server would repack after loading."""

    @abstractmethod
    def logger(self) -> logging.Logger:
        """Where the startup lines go (a child of the server's logger)."""

    def model_name(self, model: nn.Module) -> Callable[[str], str] | None:
        """The model's parameter name for a manifest (checkpoint) tensor name, where the server renames them
        (`bind`'s `model_name`); None: the same names."""
        return None

    def manifest_name(self, name: str) -> str:
        """The manifest's name for one of the model's parameter names (`model_name`'s inverse) while it is built."""
        return name

    def draft_manifest_name(self, name: str) -> str:
        """The draft manifest's name for a draft model's parameter while it is built, where the server numbers a
        draft model's layers otherwise than its checkpoint (vLLM: layer i as `i + the target's layers`)."""
        return name

    def refuse_unshardable(self, model: nn.Module, targets: Mapping[str, nn.Parameter], directory: str) -> None:
        """Raise ShardprepError, in one line, for a target that the server does not hold as the checkpoint's
        replicated weight: split over TP ranks, padded, or rewritten after loading by a step a gathered weight
        cannot go through. `targets`: the model's name → parameter of every weight that will be bound. Called
        before anything is bound or read."""
        return None

    def is_quantized(self, module: nn.Module) -> bool:
        """Whether the server rewrites `module`'s weights after loading with a quantized method's step."""
        return False

    def process_quantized(self, module: nn.Module) -> None:
        """Run the server's post-load step of a quantized `module` now, and make the server's own pass skip it.

        A server that does not implement it has its quantized targets refused in one line (`sharded_load`)."""
        raise ShardprepError(f"shard_weights: sharded mode does not process {self.spelling.server}'s quantized "
                             "layers; serve this directory in full mode, or convert an unquantized checkpoint")

    def processes_quantized(self) -> bool:
        """Whether `process_quantized` is implemented."""
        return type(self).process_quantized is not ServerAdapter.process_quantized

    def defaulted_parameters(self, model: nn.Module) -> set[str]:
        """The model's parameters a checkpoint may lack, because the server gives them defaults (KV-cache scales)."""
        return set()

    def default_weight_loader(self) -> Callable[..., Any] | None:
        """The function the server's models load a parameter with when it has no `weight_loader` of its own
        (the convention vLLM and SGLang share); the flow wraps both to see which parameters were loaded, whatever
        `load_weights` returns. None: the server has no such convention (then `load_weights`' answer is trusted)."""
        return None

    def copy_draft_weights_at_load(self, model: nn.Module) -> None:
        """Redo, now that the draft's sharded layers have their full weights, any copy the server made of them while
        loading (it copied placeholders then): DFlash's fused K/V projection of every layer. Nothing by default."""
        return None

    def draft_layer_modules(self, model: nn.Module, layers: Sequence[int]) -> Mapping[int, nn.Module]:
        """The draft model's module for each of the manifest's draft layers (an MTP layer's decoder block)."""
        raise ShardprepError(f"shard_weights: no draft binds in {self.spelling.server}'s sharded mode yet; serve "
                             "the draft in full mode")

    def relink_merged_weights(self, model: nn.Module, binding: Binding) -> list[str]:
        """Point whatever the server merged from bound weights while loading (when they were placeholders) at the
        gathered bytes, or drop it for a path that reads the bound weights; the names of the modules changed.
        Called once the target is bound, before the server's own post-load step. Nothing by default."""
        return []

    def add_splitting_ops(self, ops: Sequence[str]) -> None:
        """Make the server's compiled graph run `ops` (the gather ops) eagerly between compiled pieces, as it runs
        its attention op; called once the target is bound, when the layout is not eager. Nothing by default."""
        return None

    def key_compile_cache(self, key: str) -> bool:
        """Make the server's compile cache tell graphs bound as `key` says apart from every other's (after the
        load); False when it cannot (the loader then warns). True by default: no cache to key."""
        return True

    # A server with speculative decoding builds the draft model after the target, with a loader of its own.

    def loads_draft(self) -> bool:
        """Whether this load is the draft model's, not the target's."""
        return False

    def refuse_published_draft(self, directory: str, sharded: bool) -> None:
        """Refuse, in one line naming the ways on, a draft model handed to this load format that is no `shardprep
        convert` output (no manifest in `directory`); `sharded`: whether this is sharded mode. Nothing by default."""
        return None

    def serves_mtp_draft(self, directory: str) -> bool:
        """Whether the server runs the MTP layers of `directory`, the target's, as its draft."""
        return False

    def deployment(self) -> object | None:
        """The one object the target's load and its draft's both see (`drafts.hand_to_draft` keys the hand-over by
        it); None: the server has none."""
        return None

    def runs_a_draft(self) -> bool:
        """Whether a draft model's load follows this target's (its `ShardedLoad` is then handed over)."""
        return False

    def replicated_draft_line(self) -> str | None:
        """The line a sharded target logs when the server loads its draft apart, whole on every rank; None when
        it does not."""
        return None
