"""The deployment's parallel layout per GPU: routed experts split over EP ranks, and the GPU's HBM.

DP attention gives every data-parallel rank the whole attention (and whatever else is not an expert),
which is what shardprep shards in groups of N (shard_groups.py). The routed experts are not replicated
in such a deployment: vLLM (`enable_expert_parallel`) and SGLang (`--ep-size`) split each MoE layer's K
experts over E ranks, K/E consecutive experts per rank (rank r holds experts r·K/E .. (r+1)·K/E − 1),
so a GPU holds 1/E of them. Counting them whole on every GPU, as a layout without `--ep` does, puts a
DeepSeek-V3 at 631 GiB per GPU.

Pure arithmetic over tensor names and sizes: `plan` and `inspect` pass the non-target tensors of a
checkpoint or of a converted directory's replicated part.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ShardprepError

GB = 10**9

GPU_HBM_GB: dict[str, float] = {
    "a100-40": 40, "a100": 80, "h100": 80, "h800": 80, "h100-nvl": 94, "h20": 96, "h200": 141, "b200": 192,
    "b300": 288, "mi300x": 192, "mi325x": 256, "mi355x": 288,
}
"""HBM per GPU as the vendors' datasheets give it, in GB of 10^9 bytes (what `--hbm-gb` takes). What the driver
reports differs a little (an H200 shows 143,771 MiB in nvidia-smi), and some systems ship less (DGX B200: 180 GB
per GPU): give `--hbm-gb` for those."""

ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.")
"""A routed expert's tensor: `….experts.<e>.…` (DeepSeek, Qwen3-MoE, Mixtral, Kimi). Not `shared_experts.`."""


def hbm_bytes(gpu: str | None, hbm_gb: float | None, default_gb: float = 141) -> int:
    """HBM per GPU in bytes from `--gpu NAME` or `--hbm-gb GB` (one of them; neither: `default_gb`, an H200).

    >>> hbm_bytes("b200", None), hbm_bytes(None, 80), hbm_bytes(None, None)
    (192000000000, 80000000000, 141000000000)
    """
    if gpu is not None and hbm_gb is not None:
        raise ShardprepError(f"--gpu {gpu} and --hbm-gb {hbm_gb:g}: give one of them")
    if gpu is None:
        return int((default_gb if hbm_gb is None else hbm_gb) * GB)
    size = GPU_HBM_GB.get(gpu.lower())
    if size is None:
        raise ShardprepError(f"--gpu {gpu}: not a GPU shardprep knows ({', '.join(GPU_HBM_GB)}); give its HBM with "
                             "--hbm-gb GB instead")
    return int(size * GB)


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts a GPU holds at expert parallelism `ep`.

    `experts_per_layer` is K (0: no routed experts), `moe_layers` the modules holding them, `routed_bytes`
    all of them, `shard_bytes` what the fullest EP rank holds (routed_bytes / E when experts are equal).
    """

    ep: int
    experts_per_layer: int
    moe_layers: int
    routed_bytes: int
    shard_bytes: int

    @property
    def experts_per_gpu(self) -> int:
        return self.experts_per_layer // self.ep

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "experts_per_gpu": self.experts_per_gpu}


def expert_shard(tensor_bytes: Mapping[str, int], ep: int) -> ExpertShard:
    """Split the routed experts among `tensor_bytes` (name → bytes) over `ep` ranks, K/E consecutive ones each.

    Refuses an `ep` that does not divide a MoE layer's expert count, or an `ep` > 1 for a model without routed
    experts, in one line.

    >>> sizes = {f"model.layers.{i}.mlp.experts.{e}.w{k}.weight": 100 for i in (1, 2) for e in range(8) for k in (1, 2)}
    >>> s = expert_shard({**sizes, "model.layers.1.mlp.shared_experts.w1.weight": 7}, ep=4)
    >>> s.experts_per_layer, s.experts_per_gpu, s.routed_bytes, s.shard_bytes
    (8, 2, 3200, 800)
    """
    if ep < 1:
        raise ShardprepError(f"--ep must be >= 1, got {ep}")
    # Experts by the module that holds them ("model.layers.3.mlp"): a MoE layer, whatever the layer names.
    layers: dict[str, dict[int, int]] = {}
    for name, size in tensor_bytes.items():
        m = ROUTED_EXPERT.search(name)
        if m is not None:
            experts = layers.setdefault(name[:m.start()], {})
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + size
    if not layers:
        if ep > 1:
            raise ShardprepError(f"--ep {ep}: the model has no routed experts (tensors named '….experts.<e>.…'); "
                                 "expert parallelism does not apply, leave --ep out")
        return ExpertShard(ep, 0, 0, 0, 0)
    per_rank = [0] * ep
    counts = set()
    for module, experts in layers.items():
        k = len(experts)
        if k % ep:
            raise ShardprepError(f"--ep {ep}: {module} has {k} routed experts, which do not split evenly over {ep} "
                                 f"ranks; use an --ep that divides {k}")
        counts.add(k)
        for position, expert in enumerate(sorted(experts)):
            per_rank[position // (k // ep)] += experts[expert]
    return ExpertShard(ep, max(counts), len(layers), sum(per_rank), max(per_rank))


def check_expert_parallel(ep: int, gpus: int) -> None:
    """Refuse an expert-parallel size that does not divide the deployment's GPUs (`--dp`, or N without it).

    vLLM's expert parallelism spans every DP rank (EP = DP·TP); SGLang's `--ep-size` divides its ranks.

    >>> check_expert_parallel(16, 16)
    >>> check_expert_parallel(3, 16)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    shardprep.errors.ShardprepError: --ep 3 does not divide the 16 GPUs of the deployment (--dp 16): ...
    """
    if gpus % ep:
        raise ShardprepError(f"--ep {ep} does not divide the {gpus} GPUs of the deployment (--dp {gpus}): experts "
                             f"are split over EP ranks among them; use an --ep that divides {gpus}")


def check_tensor_parallel(tp: int) -> None:
    """Refuse `--tp` above 1: shardprep's sharded mode is DP attention, each DP rank computing whole layers.

    >>> check_tensor_parallel(1)
    """
    if tp < 1:
        raise ShardprepError(f"--tp must be >= 1, got {tp}")
    if tp > 1:
        raise ShardprepError(f"--tp {tp}: sharded mode serves DP attention at TP = 1 (each DP rank computes its whole "
                             "layer, docs/serving/index.md), so the targets of a TP deployment are not replicated and "
                             "there is nothing to shard; give the DP ranks as --dp and the expert split as --ep")
