"""Which layers to shard: the most memory whose predicted step overhead stays under a bound, or the least
overhead that frees a budget. Pure: it searches over layer sets with the two functions it is given.

Sharding fewer layers, spread out, gives each gather more compute to hide behind, so the sets tried are
the evenly spaced ones: k of the m candidate layers at a stride of m/k, for every k and every phase of
the stride (`spread_sets`). For layers of equal size and cost that family holds the best set of every
size; it is about m·ln m sets, each predicted at every token count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .accounting import MemoryAccount
from .step_time import StepPrediction

MAX_PHASES = 16  # phases tried per set size: enough to place a sparse set anywhere within its stride

Account = Callable[[Sequence[int]], MemoryAccount]
Predict = Callable[[Sequence[int]], Sequence[StepPrediction]]


@dataclass(frozen=True)
class LayerChoice:
    """A set of layers to shard, its memory, and its predicted step at each token count (if known)."""

    layers: tuple[int, ...]
    memory: MemoryAccount
    predictions: tuple[StepPrediction, ...] = ()

    @property
    def worst_overhead(self) -> float | None:
        """The largest predicted step overhead over the token counts; None when compute is unknown."""
        return max(p.overhead for p in self.predictions) if self.predictions else None


def spread_sets(candidates: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every evenly spaced subset of `candidates` (k of m at stride m/k, each phase), each once.

    >>> sorted(spread_sets([1, 2, 3, 4]), key=lambda s: (len(s), s))[:6]
    [(1,), (2,), (3,), (4,), (1, 3), (2, 4)]
    """
    m = len(candidates)
    seen: set[tuple[int, ...]] = set()
    for k in range(1, m + 1):
        stride = m / k
        for phase in range(min(MAX_PHASES, math.ceil(stride))):
            picks = tuple(candidates[int(phase + i * stride)] for i in range(k) if int(phase + i * stride) < m)
            if len(picks) == k and picks not in seen:
                seen.add(picks)
                yield picks


def evaluate(layers: Sequence[int], account: Account, predict: Predict | None) -> LayerChoice:
    """One layer set's memory and predicted steps."""
    return LayerChoice(tuple(layers), account(layers), tuple(predict(layers)) if predict else ())


def choose_layers(candidates: Sequence[int], account: Account, predict: Predict | None, *,
                  max_overhead: float | None = None, budget_bytes: int | None = None) -> LayerChoice | None:
    """The layers to shard among `candidates`, or None when no set satisfies the request.

    - `budget_bytes`: the set with the least worst-case overhead that saves at least that much (without
      `predict`: the fewest layers that do);
    - else `max_overhead`: the set that saves the most while its worst-case overhead stays <= it (without
      `predict` the overhead is unknown: the set that saves the most).

    >>> from shardprep.planning.accounting import account_layers
    >>> mem = lambda s: account_layers([1000 * 16] * len(s), world_size=2)
    >>> choose_layers(range(8), mem, None, budget_bytes=1).layers
    (0, 1, 3, 4, 6)
    """
    candidates = list(candidates)
    options = [evaluate(s, account, predict) for s in spread_sets(candidates)]
    if budget_bytes is not None:
        enough = [c for c in options if c.memory.saved_bytes >= budget_bytes]
        if not enough:
            return None
        return min(enough, key=lambda c: (c.worst_overhead or 0.0, len(c.layers), -c.memory.saved_bytes))
    saving = [c for c in options if c.memory.saved_bytes > 0]
    if predict is not None and max_overhead is not None:
        saving = [c for c in saving if (c.worst_overhead or 0.0) <= max_overhead]
    if not saving:
        return None
    return max(saving, key=lambda c: (c.memory.saved_bytes, -(c.worst_overhead or 0.0)))


def least_overhead(candidates: Sequence[int], account: Account, predict: Predict) -> LayerChoice | None:
    """Of the sets that save memory, the one whose worst-case predicted overhead is least.

    >>> from shardprep.planning.accounting import account_layers
    >>> mem = lambda s: account_layers([1000 * 16] * len(s), world_size=2)
    >>> least_overhead(range(8), mem, lambda s: []).layers  # no prediction: every set costs 0; the smallest wins
    (0, 1, 3, 4, 6)
    """
    saving = [c for c in (evaluate(s, account, predict) for s in spread_sets(list(candidates)))
              if c.memory.saved_bytes > 0]
    return min(saving, key=lambda c: (c.worst_overhead or 0.0, len(c.layers)), default=None)
