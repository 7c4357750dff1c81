"""Runtime: gather backends, the layer gatherer and its views (streams, events, slots).

>>> from shardprep.runtime import LayerGatherer  # doctest: +SKIP
"""

from .backends import AUTO_ORDER, BACKENDS, make_backend
from .gatherer import LayerGatherer

__all__ = ["AUTO_ORDER", "BACKENDS", "LayerGatherer", "make_backend"]
from .binding import bind as bind
