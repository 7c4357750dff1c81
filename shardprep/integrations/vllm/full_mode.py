"""Full mode: every worker rebuilds the full weights from the output directory and hands them to vLLM.

vLLM's own `model.load_weights` receives the checkpoint's tensors under their checkpoint names, exactly
as from the source checkpoint, so tensor parallelism, fused parameters and quantization scales are
handled by vLLM as usual. Nothing here imports vLLM; what reads the output is shared with the other servers
(integrations/output_weights.py).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from torch import nn

from ..output_weights import check_all_loaded, output_weights


def load_full(model: nn.Module, directory: str | Path, verify: bool = True, optional: Collection[str] = ()) -> None:
    """Load a vLLM model's weights from a convert output through the model's own `load_weights`.

    Refuses a model that is left with a parameter the output does not hold, other than those in `optional`
    (parameters the server gives defaults: `adapter.defaulted_parameters`).

    >>> load_full(model, "out/")  # doctest: +SKIP
    """
    loaded = model.load_weights(output_weights(directory, verify))  # type: ignore[operator]
    check_all_loaded(model, loaded, directory, also=optional)
