"""Zero-copy own chunk on 2 GPUs: does NCCL's in-place all-gather leave the own part alone?

    python3 benchmarks/check_zero_copy_gpu.py --out zc.json          # 2 GPUs, about 30 s
    python3 benchmarks/check_zero_copy_gpu.py --control              # 1 GPU: the read-only mapping faults

A view is mapped like the gatherer's (peer part from a slot's memory, own part from the shard
buffer's), except that the own part is mapped read-only for this GPU. An in-place all-gather into
it then succeeds only if NCCL never writes the own part: the local copy that an out-of-place gather
makes (|T|/N read + |T|/N written per layer) is gone. `--control` writes into such a read-only part
with an ordinary kernel, in a process of its own, to show that the protection is real (the write
must fail). Also times in-place against out-of-place all-gathers of the same bytes, and records the
mapping granularity.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

CHUNK = 64 << 20


def read_only_view(device, shard_physical, slot_physical, rank, chunk):
    """[peer part | own part] (rank 0: own first), own part mapped read-only."""
    from shardprep.runtime import vmm

    cu = vmm._driver()
    own_at, peer_at = rank * chunk, (1 - rank) * chunk
    view = vmm.map_pieces([vmm.Piece(own_at, shard_physical), vmm.Piece(peer_at, slot_physical)], 2 * chunk, device)
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device.index
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    with vmm._current(device):
        vmm._call("cuMemSetAccess", view.data_ptr() + own_at, chunk, [access], 1)
    return view


def worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from shardprep.runtime import vmm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    facts: dict = {"torch": torch.__version__, "nccl": str(torch.cuda.nccl.version()),
                   "vmm_unavailable": vmm.unavailable(device)}
    facts["granularity"] = vmm.granularity(device)
    shard = vmm.create(CHUNK, device)
    slot = vmm.create(CHUNK, device)
    shard_view = vmm.map_pieces([vmm.Piece(0, shard)], CHUNK, device)
    shard_view.fill_(rank + 1)
    view = read_only_view(device, shard, slot, rank, CHUNK)
    shard.release()
    slot.release()
    own, peer = view[rank * CHUNK:(rank + 1) * CHUNK], view[(1 - rank) * CHUNK:(2 - rank) * CHUNK]
    torch.cuda.synchronize()
    dist.barrier()
    try:
        dist.all_gather_into_tensor(view, own)
        torch.cuda.synchronize()
        facts["in_place_into_read_only_own_part"] = "ok"
        facts["peer_part_correct"] = bool((peer == 2 - rank).all())
        facts["own_part_intact"] = bool((own == rank + 1).all())
    except Exception as exc:  # a fault here would mean NCCL wrote the own part
        facts["in_place_into_read_only_own_part"] = f"{type(exc).__name__}: {exc}"

    # In-place against out-of-place, same bytes, plain memory.
    big = 4 * CHUNK
    inp = torch.full((big,), rank, dtype=torch.uint8, device=device)
    outp = torch.empty(2 * big, dtype=torch.uint8, device=device)
    for name, fn in (("out_of_place", lambda: dist.all_gather_into_tensor(outp, inp)),
                     ("in_place", lambda: dist.all_gather_into_tensor(outp, outp[rank * big:(rank + 1) * big]))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        facts[f"{name}_ms_per_{big >> 20}MiB_chunk"] = (time.perf_counter() - t) / 20 * 1e3
    if rank == 0:
        Path(out).write_text(json.dumps(facts, indent=1))
    print(f"[rank {rank}] {json.dumps(facts)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def control() -> int:
    """Write into a read-only own part with a kernel: it must fail, or the check above proves nothing."""
    import torch

    from shardprep.runtime import vmm

    device = torch.device("cuda", 0)
    shard, slot = vmm.create(CHUNK, device), vmm.create(CHUNK, device)
    view = read_only_view(device, shard, slot, 0, CHUNK)
    try:
        view[:CHUNK].fill_(7)
        torch.cuda.synchronize()
    except Exception as exc:
        print(f"control: the write into the read-only part failed as it must ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0]})")
        return 0
    print("control: the write into the read-only part succeeded: read-only mappings are not enforced here")
    return 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="zc.json")
    p.add_argument("--control", action="store_true")
    args = p.parse_args()
    if args.control:
        return control()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.out), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
