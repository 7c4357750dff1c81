"""No silent weights: after a load, every parameter of the model was loaded, bound to a gather, or given a default by
the server, or the load is refused in one line naming it.

A model's `load_weights` may report what it loaded (a set of names) or nothing (None: vLLM's EAGLE-3 and DFlash
drafts). Trusting a None would let a parameter nobody wrote keep whatever its memory held (a converted DFlash draft
once ran on uninitialized weights this way, every proposal token 0, with no error). So the load is watched: vLLM
and SGLang load a parameter by calling its `weight_loader` attribute, or their `default_weight_loader` when it has
none; `tracked_loading` wraps both for the duration of the load and records which parameters were passed to one.
A model that reports a set is checked against that set, as the servers' own loaders check it; one that reports
None is checked against what was seen, and against what it, or any model inside it, reported when the caller
dropped the answer: a server's loader may drop it (SGLang's `load_weights_only`), and a multimodal wrapper may pass
its language model's weights to that model's own `load_weights` and drop what it reports (SGLang's
KimiK3ForConditionalGeneration returns None), which names weights copied in place, through no weight loader
(SGLang's Kimi K3 fills `fused_qkv_a_proj_with_mqa` so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ShardprepError


class _Tracked:
    """A parameter's loader, wrapped: records the parameter it is called with, then loads as before.

    Compares equal to the loader it wraps (some models test `weight_loader == default_weight_loader`) and
    forwards attribute reads (a bound method's `__self__`, `__func__`), so a model sees its own loader.
    """

    def __init__(self, load: Callable[..., Any], seen: set[int]):
        self._load, self._seen = load, seen
        functools.update_wrapper(self, load)

    def __call__(self, param: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen.add(id(param))
        return self._load(param, *args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or self._load == other

    def __hash__(self) -> int:
        return hash(self._load)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._load, name)


@contextmanager
def tracked_loading(model: nn.Module, default_loader: Callable[..., Any] | None) -> Iterator[set[int] | None]:
    """Inside this block, record the id of every parameter of `model` that a loader is called with.

    Yields the set of ids (filled as the model loads), or None without a `default_loader` (a server without the
    `weight_loader` convention: nothing can be watched). Each parameter's `weight_loader` is put back as it was.

    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> def load(param, tensor): param.data.copy_(tensor)
    >>> with tracked_loading(layer, load) as seen:
    ...     layer.weight.weight_loader(layer.weight, layer.weight.detach() * 0)
    >>> seen == {id(layer.weight)}, hasattr(layer.weight, "weight_loader")
    (True, False)
    """
    if default_loader is None:
        yield None
        return
    seen: set[int] = set()
    restore: list[tuple[Any, str, Any]] = []
    missing: Any = object()
    for param in model.parameters():
        held: Any = param  # a server's parameters carry attributes of their own (`weight_loader`)
        # Most keep it as a plain attribute; SGLang's quantized parameter classes behind a read-only property over
        # `_weight_loader` (their BasevLLMParameter's), where it is replaced instead.
        where = "_weight_loader" if _read_only(type(held), "weight_loader") else "weight_loader"
        original = getattr(held, where, missing)
        loader = getattr(held, "weight_loader", missing)
        setattr(held, where, _Tracked(default_loader if loader is missing or loader is None else loader, seen))
        restore.append((held, where, original))
    # The model's own load_weights too: a server's loader may drop its answer (SGLang's DefaultModelLoader does).
    inner = [module for module in model.modules() if "load_weights" not in module.__dict__
             and callable(getattr(type(module), "load_weights", None))]
    for module in inner:
        module.__dict__["load_weights"] = _reporting(module, seen)
    try:
        yield seen
    finally:
        for module in inner:
            del module.__dict__["load_weights"]
        for held, where, original in restore:
            if original is missing:
                delattr(held, where)
            else:
                setattr(held, where, original)


def _reporting(module: nn.Module, seen: set[int]) -> Callable[..., Any]:
    """`module.load_weights`, which also marks as seen the parameters it reports loading (names inside `module`)."""
    load = type(module).load_weights  # type: ignore[attr-defined]

    def load_weights(*args: Any, **kwargs: Any) -> Any:
        loaded = load(module, *args, **kwargs)
        if isinstance(loaded, (set, frozenset, list, tuple)):  # a collection: reading it consumes nothing
            params = dict(module.named_parameters(remove_duplicate=False))
            seen.update(id(params[name]) for name in loaded if name in params)
        return loaded

    return load_weights


def _read_only(cls: type, name: str) -> bool:
    """Whether `cls` has `name` as a property without a setter."""
    found = getattr(cls, name, None)
    return isinstance(found, property) and found.fset is None


def check_all_loaded(model: nn.Module, loaded: Iterable[str] | None, directory: str | Path,
                     also: Collection[str] = (), seen: set[int] | None = None) -> None:
    """Refuse a model with a parameter that was not loaded and is not in `also` (bound to a gather, or defaulted).

    `loaded`: what `load_weights` reported; when it reported None, `seen` (from `tracked_loading`) says what was
    loaded instead. Only a model that reports None and whose load could not be watched passes unchecked. A parameter
    the model holds under two names (SGLang's Kimi K3 keeps f_b_proj's weight as `_bfa_f_b_w` too) is loaded, or in
    `also`, under either.

    >>> check_all_loaded(model, model.load_weights(weights), "out/")  # doctest: +SKIP
    """
    every_name = list(model.named_parameters(remove_duplicate=False))
    if loaded is not None:
        names = set(loaded)
        done = {id(p) for name, p in every_name if name in names}
    elif seen is not None:
        done = set(seen)
    else:
        return
    done |= {id(p) for name, p in every_name if name in set(also)}
    missing = sorted(name for name, p in model.named_parameters() if id(p) not in done)
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        how = "" if loaded is not None else " (its load_weights reports nothing: no weight loader was called for it)"
        raise ShardprepError(f"{directory}: the model's parameter {missing[0]!r}{more} is in no tensor of the "
                             f"output{how}; was it converted from this model?")
