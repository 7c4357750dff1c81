"""The gathers as two ops that a compiler sees: `shardprep::layer_begin` and `shardprep::layer_end`.

Every bound decoder layer calls `layer_begin` before its forward and `layer_end` after it (binding.py
makes them the layer's forward pre-hook and forward hook). Run, they are the gatherer's `wait(ℓ)`
(which also dispatches ℓ+1's gather) and `done(ℓ)`; the first decoder layer's `layer_begin` also begins
the forward. Their fake implementations do nothing, so Dynamo traces them as two opaque calls (no graph
break), and tracing never gathers. An eager forward (no compiler tracing the hooks) calls the same
bodies directly: the dispatcher adds some 20 µs per mutating op call, for nothing to order there.

Why no compiler pass can move a read of layer ℓ's weights outside [layer_begin(ℓ), layer_end(ℓ)]:

- both ops declare that they write ℓ's bound parameters (`mutates_args`): every read of a weight
  depends on the layer_begin before it and comes before the layer_end after it, whatever the reads
  compute (a weight-only dequantization included). Each layer's weights have a storage of their own
  (`views.own_storage`), so the compiler needs no view of the slot that layers share;
- both take the layer's input (output) tensors, so layer_begin(ℓ) runs once layer ℓ−1's compute is
  issued, and layer_end(ℓ) once ℓ's is;
- both write one `order` element, so the ops keep their program order: begin(ℓ), end(ℓ), begin(ℓ+1).

vLLM's piecewise compilation cuts its graph at both ops (`SPLITTING_OPS`, as at attention) and runs
them eagerly between the compiled pieces; inside a full CUDA graph they are captured with their
gathers. docs/serving/index.md ("Compiled serving") has the whole argument.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

SPLITTING_OPS = ("shardprep::layer_begin", "shardprep::layer_end")
"""The ops' qualified names, for vLLM's `CompilationConfig.splitting_ops`."""

BEGIN_ONLY = -1
"""layer_begin's position for a first decoder layer that is not bound: it only begins the forward."""


class LayerSchedule(Protocol):
    """What the ops call: a Binding (runtime/binding.py)."""

    def layer_begin(self, position: int, weights: list[torch.Tensor] | None = None) -> None: ...

    def layer_end(self, position: int, weights: list[torch.Tensor] | None = None) -> None: ...


_schedules: weakref.WeakValueDictionary[int, LayerSchedule] = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(schedule: LayerSchedule) -> int:
    """A handle the ops take to find `schedule` (held weakly: the model's hooks keep it alive).

    >>> handle = register(binding)  # doctest: +SKIP
    """
    handle = next(_handles)
    _schedules[handle] = schedule
    return handle


def unregister(handle: int) -> None:
    """Forget `handle`: an op called with it raises from now on.

    >>> unregister(binding.handle)  # doctest: +SKIP
    """
    _schedules.pop(handle, None)


def _schedule(handle: int) -> LayerSchedule:
    try:
        return _schedules[handle]
    except KeyError:
        from ..errors import RuntimeShardError

        raise RuntimeShardError(f"shardprep binding {handle} was removed; bind() the model again") from None


@torch.library.custom_op("shardprep::layer_begin", mutates_args=("weights", "order"))
def layer_begin(inputs: list[torch.Tensor], weights: list[torch.Tensor], order: torch.Tensor, handle: int,
                position: int) -> None:
    """Before bound layer `position` runs: its gather is waited for, the next one dispatched.

    `inputs` are the layer's input tensors and `weights` its bound parameters (declared written);
    `position` is the layer's place in the gatherer's order, or BEGIN_ONLY.

    >>> torch.ops.shardprep.layer_begin([hidden], weights, order, binding.handle, 0)  # doctest: +SKIP
    """
    _schedule(handle).layer_begin(position, weights)


@layer_begin.register_fake
def _(inputs: list[torch.Tensor], weights: list[torch.Tensor], order: torch.Tensor, handle: int,
      position: int) -> None:
    return None


@torch.library.custom_op("shardprep::layer_end", mutates_args=("weights", "order"))
def layer_end(outputs: list[torch.Tensor], weights: list[torch.Tensor], order: torch.Tensor, handle: int,
              position: int) -> None:
    """After bound layer `position`'s compute is issued: its slot may be gathered into again.

    >>> torch.ops.shardprep.layer_end([hidden], weights, order, binding.handle, 0)  # doctest: +SKIP
    """
    _schedule(handle).layer_end(position, weights)


@layer_end.register_fake
def _(outputs: list[torch.Tensor], weights: list[torch.Tensor], order: torch.Tensor, handle: int,
      position: int) -> None:
    return None
