"""Layer gathers against replicated weights and FSDP2, in one run, on one GPU per rank.

    python3 benchmarks/bench_gather.py --out gather.json            # 2 GPUs, about 3 minutes
    python3 benchmarks/bench_gather.py --shard all --shard odd --backends ce,nccl --no-fsdp --out g.json
    python3 benchmarks/bench_gather.py --device cpu --hidden 1024 --ffn 4096 --backends gloo --out cpu.json
    python3 benchmarks/bench_gather.py --dry-run --out dry.json     # CPU + gloo, tiny sizes, seconds

A synthetic decoder stack: per layer, sharded attention projections (q, k, v fused as qkv, and o;
about 336 MB of bf16 at the default sizes) and a replicated MLP whose GEMMs are the compute the
gathers hide behind, on `tokens` activation rows per step. Measured in the same processes:

- replicated: every rank holds every weight (no sharding), the baseline step time;
- shardprep-<backend>: LayerGatherer with each backend; exposed gather time = its step − replicated;
  gather-only: an idle_step() (every gather of a forward back to back, no compute), as GB/s received;
  "+zc": with the zero-copy own chunk (each layer's view maps this rank's chunk from the shard
  buffer, so a gather writes only the peers' parts; ce and nccl); "-notags": a collective backend
  without its alignment tags (what the tags cost); " [odd]" etc.: only the layers `--shard` names
  are sharded, the others keep replicated attention weights (the gatherer issues the next sharded
  layer's gather as soon as its slot is free, so it overlaps the replicated layers in between);
- fsdp2 / fsdp2-prefetch: torch's fully_shard over the same attention weights (inference,
  reshard_after_forward=True; default prefetch, then explicit forward prefetch of one layer);
- raw: all_gather_into_tensor of one layer, and one peer copy of one chunk from symmetric memory;
- graphs: the replicated and shardprep steps captured in CUDA graphs and replayed;
- nccl-symm with NCCL_CTA_POLICY=2, in a separate pair of processes after everything else (it has
  crashed NCCL 2.28.9), unless --no-cta2.

Peak memory per configuration is what a process running only that configuration would reach
(torch.cuda.max_memory_allocated during it, plus what it holds), next to the formula
R/N + slots + other, where slots = 2·max|T| (copy path) or 2·(N−1)·max C (zero copy), and other =
the MLP weights + the replicated run's transient peak (+ the replicated attention of layers that
are not sharded). "device delta" is the device's used memory (cudaMemGetInfo, caches emptied)
after the configuration ran minus before it: it sees VMM and symmetric allocations too.
HBM bytes per layer (computed, per rank, besides NCCL's own staging buffers): the slot writes, the
peers' reads of this rank's chunk, and without zero copy the local copy's read and write:
2·N·C with the copy path, 2·(N−1)·C with zero copy.
Results go to --out as JSON after every measurement (a crash keeps what was measured) and a
markdown table is printed at the end. NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are forced. Works with torch 2.11 and 2.13.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers in the stack")
    p.add_argument("--shard", action="append", default=None, metavar="SPEC",
                   help="which layers are sharded: all, odd, even, or a list such as 1,3,5-7 or 1-:2 "
                        "(repeat the option to measure several choices in one run; default all)")
    p.add_argument("--chunk-alignment", default="2MiB",
                   help="pad chunks and align file offsets to this (2MiB lets zero copy map them; none = 4 KiB)")
    p.add_argument("--zero-copy", default="both", choices=("both", "on", "off"),
                   help="ce and nccl with the zero-copy own chunk, with the copy path, or both")
    p.add_argument("--no-tag-cost", action="store_true",
                   help="skip the collective backends' runs without alignment tags")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo on the CPU")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--kv-ratio", type=float, default=0.25, help="k and v rows as a fraction of hidden")
    p.add_argument("--ffn", type=int, default=28672, help="replicated MLP width (the compute per layer)")
    p.add_argument("--tokens", default="16,128,1024,4096,8192", help="activation rows per step")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backends", default="nccl,ce,nccl-symm,auto")
    p.add_argument("--no-fsdp", action="store_true")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-cta2", action="store_true", help="skip nccl-symm with NCCL_CTA_POLICY=2")
    p.add_argument("--dry-run", action="store_true", help="CPU + gloo, tiny sizes: checks the script itself")
    p.add_argument("--phase", default="main", choices=("main", "cta2"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.hidden, args.ffn, args.tokens = 3, 64, 128, "4,16"
        args.iters, args.warmup = 2, 1
        args.shard = args.shard or ["all", "odd"]
        args.device = "cpu"
    if args.device == "cpu":
        args.backends, args.no_cta2, args.chunk_alignment = "gloo", True, "none"
    args.shard_list = args.shard or ["all"]
    for spec in args.shard_list:
        sharded_layers(spec, args.layers)  # a bad spec fails here, before any process starts
    args.alignment = 4096 if args.chunk_alignment == "none" else parse_size(args.chunk_alignment)
    args.token_list = [int(t) for t in args.tokens.split(",")]
    args.backend_list = [b for b in args.backends.split(",") if b]
    return args


def sharded_layers(spec: str, layers: int) -> list[int]:
    """Layer indices named by `spec` (all, odd, even, "1,3,5-7", "1-:2"), checked against `layers`.

    >>> sharded_layers("odd", 8), sharded_layers("1,4-5", 8), sharded_layers("2-:3", 8)
    ([1, 3, 5, 7], [1, 4, 5], [2, 5])
    """
    named = {"all": "0-", "odd": "1-:2", "even": "0-:2", "every-other": "1-:2"}
    chosen: set[int] = set()
    for part in named.get(spec, spec).split(","):
        where, _, step = part.partition(":")
        start, dash, end = where.partition("-")
        first = int(start)
        last = (int(end) if end else layers - 1) if dash else first
        chosen.update(range(first, last + 1, int(step) if step else 1))
    if not chosen or min(chosen) < 0 or max(chosen) >= layers:
        raise SystemExit(f"--shard {spec}: layers must lie in 0..{layers - 1}")
    return sorted(chosen)


def parse_size(text: str) -> int:
    """Bytes in "2MiB", "4096", "1GiB"."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * scale)
    return int(low)


# -- results ------------------------------------------------------------------------------------------
class Results:
    """Rank 0's record of everything measured, rewritten to --out after every addition."""

    def __init__(self, path: str, rank: int, fresh: bool):
        self.path, self.rank = Path(path), rank
        if not fresh and self.path.exists():
            self.data = json.loads(self.path.read_text())
        else:
            self.data = {"steps": [], "gather_only": {}, "memory": {}, "raw": {}, "checks": {}, "errors": {}}

    def put(self, section: str, key, value) -> None:
        if isinstance(self.data[section], list):
            self.data[section].append(value)
        else:
            self.data[section][key] = value
        self.save()

    def save(self) -> None:
        if self.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(self.path)


# -- the model --------------------------------------------------------------------------------------
def layer_names(i: int) -> dict[str, str]:
    base = f"model.layers.{i}.self_attn."
    return {k: base + f"{k}_proj.weight" for k in ("q", "k", "v", "o")} | {"qkv": base + "qkv_proj.weight"}


def build_weights(args, device):
    """Per layer: the attention weights (fused qkv, o) and the replicated MLP, the same on every rank."""
    import torch

    h, kv = args.hidden, kv_rows(args)
    gen = torch.Generator(device=device)
    qkv, o, mlp = [], [], []
    for i in range(args.layers):
        gen.manual_seed(1000 + i)  # the same weights on every rank, as a replicated checkpoint has
        qkv.append(torch.randn(h + 2 * kv, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
        o.append(torch.randn(h, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
        mlp.append(tuple(torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
                         for shape in ((args.ffn, h), (args.ffn, h), (h, args.ffn))))
    return qkv, o, mlp


def kv_rows(args) -> int:
    return max(16, int(args.hidden * args.kv_ratio) // 16 * 16)


def make_manifest(args, layers: list[int]):
    """The manifest convert would write for the attention weights of `layers`, chunks padded to
    --chunk-alignment (a multiple of it per rank) and placed at offsets aligned to it."""
    import dataclasses

    from shardprep.manifests import (
        FusedGroup,
        LayerRecord,
        Manifest,
        TensorSpec,
        align_up,
        plan_file_offsets,
        plan_layer,
    )
    from shardprep.manifests.manifest import rank_file_name

    h, kv, n = args.hidden, kv_rows(args), args.world
    records = []
    for i in layers:
        names = layer_names(i)
        specs = [TensorSpec(names["q"], "BF16", (h, h)), TensorSpec(names["k"], "BF16", (kv, h)),
                 TensorSpec(names["v"], "BF16", (kv, h)), TensorSpec(names["o"], "BF16", (h, h))]
        lay = plan_layer(i, specs, n, [FusedGroup(names["qkv"], (names["q"], names["k"], names["v"]))])
        c = align_up(lay.chunk_bytes, args.alignment)
        records.append(dataclasses.replace(lay, chunk_bytes=c, total_bytes=c * n))
    offsets = plan_file_offsets([r.chunk_bytes for r in records], max(4096, args.alignment))
    return Manifest(n, tuple(rank_file_name(r, n) for r in range(n)),
                    tuple(LayerRecord.from_layout(lay, off) for lay, off in zip(records, offsets)),
                    file_alignment=max(4096, args.alignment))


def local_buffer(manifest, rank, qkv, o, device):
    """This rank's shard buffer, cut from each layer's packed T exactly as convert would write it."""
    import torch

    buf = torch.zeros(manifest.rank_file_bytes, dtype=torch.uint8, device=device)
    for rec in manifest.layers:
        w_qkv, w_o = qkv[rec.layer], o[rec.layer]
        flat = torch.zeros(rec.total_bytes, dtype=torch.uint8, device=device)
        view = next(v for v in rec.views)
        flat[view.offset:view.offset + view.nbytes].copy_(w_qkv.reshape(-1).view(torch.uint8))
        e = next(e for e in rec.entries if e.name.endswith("o_proj.weight"))
        flat[e.offset:e.offset + e.nbytes].copy_(w_o.reshape(-1).view(torch.uint8))
        c = rec.chunk_bytes
        buf[rec.file_offset:rec.file_offset + c].copy_(flat[rank * c:(rank + 1) * c])
    return buf


def layer_compute(x, w_qkv, w_o, mlp, hidden):
    """Attention projections on the (gathered) weights, then the replicated MLP: the per-layer GEMMs."""
    import torch.nn.functional as F

    a = (x @ w_qkv.t())[:, :hidden]  # attention itself depends on the context, not on the weights
    x = x + a @ w_o.t()
    g, u, d = mlp
    return x + (F.silu(x @ g.t()) * (x @ u.t())) @ d.t()


def make_step(args, x, mlp, qkv=None, o=None, g=None):
    """One forward over all layers on `x`: with the replicated weights, or with `g`'s gathered views
    for the layers it gathers (the others use their replicated attention weights)."""
    sharded = set(g.layers) if g is not None else set()

    def step():
        y = x
        if g is not None:
            g.begin()
        for i in range(args.layers):
            if i in sharded:
                w = g.wait(i)
                names = layer_names(i)
                y = layer_compute(y, w[names["qkv"]], w[names["o"]], mlp[i], args.hidden)
                g.done(i)
            else:
                y = layer_compute(y, qkv[i], o[i], mlp[i], args.hidden)
        return y

    return step


# -- timing -----------------------------------------------------------------------------------------
def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device, iters, warmup, group) -> float:
    """Mean ms per call over `iters` calls after `warmup`, the slowest rank's (all ranks step together)."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier(group=group)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - t) * 1e3 / iters
    slowest = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


def device_used(device) -> int | None:
    """Bytes in use on the whole device (cudaMemGetInfo) with torch's cache emptied first."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class Memory:
    """Peak device bytes of one configuration: allocated-at-start is subtracted, its own holdings added."""

    def __init__(self, device):
        import torch

        self.device, self.cuda = device, device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self.start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def transient(self) -> int | None:
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.start


# -- one rank -----------------------------------------------------------------------------------------
def worker(rank: int, args, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cpu":
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(seconds=120))
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=args.world, timeout=timedelta(seconds=180),
                                device_id=device)
    cpu_group = dist.new_group(backend="gloo")  # timing and agreement, never on the measured streams
    res = Results(args.out, rank, fresh=args.phase == "main")
    torch.set_grad_enabled(False)
    if args.phase == "main":
        res.data["machine"] = machine(device, args)
        res.data["args"] = {k: v for k, v in vars(args).items() if k not in ("token_list", "backend_list",
                                                                               "shard_list")}
    try:
        if args.phase == "main":
            run_main(rank, args, device, res, cpu_group)
        else:
            run_cta2(rank, args, device, res, cpu_group)
    finally:
        res.save()
        dist.barrier(group=cpu_group)
        dist.destroy_process_group()
    # Leave without interpreter teardown, which can abort while gloo's C++ threads are still joinable
    # ("terminate called without an active exception"); everything is saved and the group is gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def machine(device, args) -> dict:
    import platform

    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "world": args.world,
            "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["nccl"] = str(torch.cuda.nccl.version())
        info["cuda"] = torch.version.cuda
    info["NCCL_NVLS_ENABLE"] = os.environ.get("NCCL_NVLS_ENABLE")
    return info


def attempt(res: Results, name: str, fn, cpu_group):
    """Run one configuration on every rank; record its error instead of stopping the benchmark."""
    import torch.distributed as dist

    try:
        out = fn()
        ok = True
    except Exception as exc:
        out, ok = None, False
        res.put("errors", name, f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500])
        traceback.print_exc()
    flags = [None] * dist.get_world_size(cpu_group)
    dist.all_gather_object(flags, ok, group=cpu_group)
    if not all(flags) and ok:
        res.put("errors", name, "failed on another rank")
    return out if all(flags) else None


def run_main(rank, args, device, res, cpu_group):
    import torch

    t0 = time.perf_counter()
    qkv, o, mlp = build_weights(args, device)
    n = args.world
    manifests = {spec: make_manifest(args, sharded_layers(spec, args.layers)) for spec in args.shard_list}
    full = make_manifest(args, list(range(args.layers)))
    total = sum(r.total_bytes for r in full.layers)
    max_c = max(r.chunk_bytes for r in full.layers)
    mlp_bytes = mlp_bytes_of(mlp)
    res.data["sizes"] = {
        "layers": args.layers, "T_bytes": full.max_total_bytes, "C_bytes": max_c, "R_bytes": total,
        "R_over_N": total // n, "mlp_bytes": mlp_bytes, "gather_recv_bytes_per_forward": total * (n - 1) // n,
        "chunk_alignment": args.alignment,
        "hbm_bytes_per_layer": {"copy": 2 * n * max_c, "zero_copy": 2 * (n - 1) * max_c},
        "sharded": {spec: [r.layer for r in m.layers] for spec, m in manifests.items()},
        "setup_s": round(time.perf_counter() - t0, 2),
    }
    res.save()
    print(f"[rank {rank}] built {args.layers} layers: |T| = {full.max_total_bytes / GB:.3f} GB, "
          f"R = {total / GB:.2f} GB, MLP {mlp_bytes / GB:.2f} GB ({time.perf_counter() - t0:.1f} s)", flush=True)

    attempt(res, "raw all_gather", lambda: raw_all_gather(args, device, full, res, cpu_group), cpu_group)
    if device.type == "cuda":
        attempt(res, "raw peer copy", lambda: raw_peer_copy(args, rank, device, full, res, cpu_group), cpu_group)

    # Replicated baseline: the weights as a server without sharding holds them.
    mem = Memory(device)
    for tokens in args.token_list:
        step = make_step(args, torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16), mlp, qkv, o)
        ms = attempt(res, f"replicated@{tokens}", lambda step=step: timed_ms(step, device, args.iters, args.warmup,
                                                                              cpu_group), cpu_group)
        res.put("steps", None, {"config": "replicated", "tokens": tokens, "ms": ms})
        del step
    activations = mem.transient()
    res.put("memory", "replicated", {"measured": None if activations is None else activations + mlp_bytes + total,
                                     "formula": None if activations is None else total + mlp_bytes + activations})
    replicated_ms = {s["tokens"]: s["ms"] for s in res.data["steps"] if s["config"] == "replicated"}
    other = None if activations is None else mlp_bytes + activations

    for spec, manifest in manifests.items():
        base = local_buffer(manifest, rank, qkv, o, device)
        kept = sum(qkv[i].numel() * 2 + o[i].numel() * 2 for i in range(args.layers)
                   if i not in {r.layer for r in manifest.layers})  # replicated attention of unsharded layers
        for backend in args.backend_list:
            for zero_copy, tags in variants(args, backend):
                label = f"shardprep-{backend}" + ("+zc" if zero_copy else "") + ("" if tags else "-notags")
                config = (manifest, base, backend, zero_copy, tags, spec, None if other is None else other + kept)
                attempt(res, label + ("" if spec == "all" else f" [{spec}]"), lambda config=config: run_shardprep(
                    args, rank, device, qkv, o, mlp, *config, res, cpu_group, replicated_ms), cpu_group)
        del base
    if not args.no_fsdp:
        for prefetch in (False, True):
            name = "fsdp2-prefetch" if prefetch else "fsdp2"
            attempt(res, name, lambda prefetch=prefetch, name=name: run_fsdp(
                args, device, qkv, o, mlp, prefetch, name, res, cpu_group, replicated_ms, other, total), cpu_group)
    if device.type == "cuda" and not args.no_graphs:
        base = local_buffer(full, rank, qkv, o, device)
        attempt(res, "graphs", lambda: run_graphs(args, rank, device, full, base, qkv, o, mlp, res, cpu_group),
                cpu_group)
    res.data["wall_s"] = round(time.perf_counter() - t0, 1)


def variants(args, backend: str) -> list[tuple[bool | None, bool]]:
    """(zero_copy, alignment tags) runs of one backend: zero copy where it can work (ce, nccl), and
    for a collective backend one run without tags (the last zero-copy setting) to price them."""
    mappable = backend in ("ce", "nccl")
    settings: list[bool | None] = [None] if backend == "auto" else (
        [False] if not mappable or args.zero_copy == "off" else [True] if args.zero_copy == "on" else [False, True])
    runs = [(z, True) for z in settings]
    if backend in ("gloo", "nccl", "nccl-symm") and not args.no_tag_cost:
        runs.append((settings[-1], False))
    return runs


def raw_all_gather(args, device, manifest, res, cpu_group):
    import torch

    from shardprep.runtime.backends.collective import all_gather_into

    nbytes = manifest.max_total_bytes
    inp = torch.ones(nbytes // args.world, dtype=torch.uint8, device=device)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    import torch.distributed as dist

    ms = timed_ms(lambda: all_gather_into(out, inp, dist.group.WORLD), device, args.iters * 2, args.warmup, cpu_group)
    res.put("raw", "all_gather", _bandwidth(nbytes, args.world, ms))


def raw_peer_copy(args, rank, device, manifest, res, cpu_group):
    """One chunk (|T|/N bytes) copied from the next rank's symmetric memory: the copy-engine path alone."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from shardprep.runtime.backends.ce import _enable_group

    c = manifest.max_total_bytes // args.world
    local = symm_mem.empty(c, dtype=torch.uint8, device=device)
    local.fill_(rank)
    _enable_group(symm_mem, dist.group.WORLD)
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(local, dist.group.WORLD)
    peer = handle.get_buffer((rank + 1) % args.world, (c,), torch.uint8)
    dst = torch.empty(c, dtype=torch.uint8, device=device)
    dist.barrier(group=cpu_group)
    ms = timed_ms(lambda: dst.copy_(peer), device, args.iters * 2, args.warmup, cpu_group)
    res.put("raw", "peer_copy", {"bytes": c, "ms": ms, "GBps": c / (ms * 1e-3) / GB,
                                 "correct": bool((dst == (rank + 1) % args.world).all())})
    dist.barrier(group=cpu_group)  # no rank frees its buffer while a peer may still be copying from it


def _bandwidth(nbytes, n, ms) -> dict:
    return {"bytes": nbytes, "ms": ms, "algbw_GBps": nbytes / (ms * 1e-3) / GB,
            "recv_GBps": nbytes * (n - 1) / n / (ms * 1e-3) / GB}


def make_gatherer(manifest, rank, base, device, backend, zero_copy=None, tags=True):
    """A gatherer over a copy of `base`, allocated by the backend itself (so no rehoming copy)."""
    from shardprep.loader.rank_shards import RankShards
    from shardprep.runtime import LayerGatherer, make_backend

    b = make_backend(backend, None, device) if isinstance(backend, str) else backend
    buf = b.allocate_local(base.numel())
    buf.copy_(base)
    shards = RankShards(manifest, rank, buf)
    return LayerGatherer(shards, backend=b, zero_copy=zero_copy, alignment_tags=tags), shards


def check_views(g, manifest, qkv, o) -> bool:
    import torch

    g.begin()
    ok = True
    for layer in g.layers:
        views = g.wait(layer)
        names = layer_names(layer)
        ok &= torch.equal(views[names["qkv"]], qkv[layer]) and torch.equal(views[names["o"]], o[layer])
        g.done(layer)
    return bool(ok)


def measure_gatherer(args, device, manifest, qkv, o, mlp, g, name, res, cpu_group, replicated_ms):
    """Check the views, time the gathers alone (idle_step), then a step per token count."""
    import torch

    exact = check_views(g, manifest, qkv, o)
    res.put("checks", f"{name} views equal the replicated weights", exact)
    if not exact:
        raise RuntimeError(f"{name}: gathered weights differ from the replicated ones")
    ms = timed_ms(g.idle_step, device, args.iters, args.warmup, cpu_group)
    recv = sum(r.total_bytes for r in manifest.layers) * (args.world - 1) / args.world
    res.put("gather_only", name, {"ms": ms, "recv_GBps": recv / (ms * 1e-3) / GB, "layers": len(g.layers),
                                  "symmetric_windows": getattr(g.backend, "symmetric", None)})
    for tokens in args.token_list:
        step = make_step(args, torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16), mlp, qkv, o, g)
        ms = timed_ms(step, device, args.iters, args.warmup, cpu_group)
        base_ms = replicated_ms.get(tokens)
        res.put("steps", None, {"config": name, "tokens": tokens, "ms": ms,
                                "exposed_ms": None if base_ms is None else ms - base_ms})
        del step


def run_shardprep(args, rank, device, qkv, o, mlp, manifest, base, backend, zero_copy, tags, spec, other, res,
                  cpu_group, replicated_ms):
    before = device_used(device)
    g, shards = make_gatherer(manifest, rank, base, device, backend, zero_copy, tags)
    name = (f"shardprep-{g.backend_name}" if backend != "auto" else f"shardprep-auto({g.backend_name})")
    name += ("+zc" if g.zero_copy else "") + ("" if tags else "-notags") + ("" if spec == "all" else f" [{spec}]")
    mem = Memory(device)
    measure_gatherer(args, device, manifest, qkv, o, mlp, g, name, res, cpu_group, replicated_ms)
    transient = mem.transient()
    held = device_used(device)
    # Alone, this configuration holds its shards, its slots and the MLP, plus what ran meanwhile.
    measured = None if transient is None else transient + shards.nbytes + g.slot_bytes + mlp_bytes_of(mlp)
    n, max_c = args.world, max(r.chunk_bytes for r in manifest.layers)
    slots = 2 * (n - 1) * max_c if g.zero_copy else 2 * manifest.max_total_bytes
    formula = None if other is None else shards.nbytes + slots + other
    res.put("memory", name, {"measured": measured, "formula": formula, "slot_bytes": g.slot_bytes,
                             "slot_formula": slots, "shard_bytes": shards.nbytes,
                             "device_delta": None if before is None else held - before,
                             "zero_copy_reason": g.zero_copy_reason})
    print(f"[rank {rank}] {name} done", flush=True)
    del g, shards


def mlp_bytes_of(mlp) -> int:
    return sum(t.numel() * t.element_size() for m in mlp for t in m)


def run_fsdp(args, device, qkv, o, mlp, prefetch, name, res, cpu_group, replicated_ms, other, total):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Attn(nn.Module):
        def __init__(self, w_qkv, w_o):
            super().__init__()
            self.qkv = nn.Parameter(w_qkv.clone(), requires_grad=False)
            self.o = nn.Parameter(w_o.clone(), requires_grad=False)

        def forward(self, x):
            return x + (x @ self.qkv.t())[:, :args.hidden] @ self.o.t()

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.attn = Attn(qkv[i], o[i])
            self.mlp = mlp[i]  # replicated: plain tensors, not parameters FSDP would shard

        def forward(self, x):
            x = self.attn(x)
            g, u, d = self.mlp
            return x + (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList()

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    mesh = init_device_mesh(device.type, (args.world,))
    model = Stack()
    for i in range(args.layers):  # shard layer by layer so the full clones never coexist
        block = Block(i)
        fully_shard(block.attn, mesh=mesh, reshard_after_forward=True)
        model.layers.append(block)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if prefetch:
        attns = [b.attn for b in model.layers]
        for a, nxt in zip(attns, attns[1:]):
            a.set_modules_to_forward_prefetch([nxt])
    sharded = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    x0 = torch.randn(4, args.hidden, device=device, dtype=torch.bfloat16)
    y_ref = x0
    for i in range(args.layers):
        y_ref = layer_compute(y_ref, qkv[i], o[i], mlp[i], args.hidden)
    res.put("checks", f"{name} output equals the replicated model's", bool(torch.equal(model(x0), y_ref)))
    mem = Memory(device)
    for tokens in args.token_list:
        x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
        ms = timed_ms(lambda x=x: model(x), device, args.iters, args.warmup, cpu_group)
        base_ms = replicated_ms.get(tokens)
        res.put("steps", None, {"config": name, "tokens": tokens, "ms": ms,
                                "exposed_ms": None if base_ms is None else ms - base_ms})
        del x
    transient = mem.transient()
    max_t = max(qkv[i].numel() * 2 + o[i].numel() * 2 for i in range(args.layers))
    res.put("memory", name, {
        "measured": None if transient is None else transient + sharded + mlp_bytes_of(mlp),
        "formula": None if other is None else total // args.world + 2 * max_t + other})


def run_graphs(args, rank, device, manifest, base, qkv, o, mlp, res, cpu_group):
    """The replicated and shardprep steps captured once per token count and replayed."""
    import torch

    configs = [("replicated", None, None)]  # first: the graphs' own baseline for the exposed time
    graph_ms: dict[int, float] = {}
    for backend in [b for b in args.backend_list if b != "auto"]:
        for zero_copy, tags in variants(args, backend):
            if tags:
                configs.append((f"shardprep-{backend}" + ("+zc" if zero_copy else ""), backend, zero_copy))
    for name, backend, zero_copy in configs:
        def one(name=name, backend=backend, zero_copy=zero_copy):
            g = make_gatherer(manifest, rank, base, device, backend, zero_copy)[0] if backend else None
            for tokens in args.token_list:
                x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16)
                step = make_step(args, x, mlp, qkv, o, g)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    step()
                    step()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    step()
                ms = timed_ms(graph.replay, device, args.iters, args.warmup, cpu_group)
                if g is None:
                    graph_ms[tokens] = ms
                exposed = None if g is None or tokens not in graph_ms else ms - graph_ms[tokens]
                res.put("steps", None, {"config": f"{name}+graph", "tokens": tokens, "ms": ms, "exposed_ms": exposed})
                del graph, step, x
        attempt(res, f"{name}+graph", one, cpu_group)


def run_cta2(rank, args, device, res, cpu_group):
    """nccl-symm with NCCL_CTA_POLICY=2, alone in fresh processes: if NCCL crashes, only this is lost."""
    from shardprep.runtime.backends.nccl_symm import NcclSymmBackend

    qkv, o, mlp = build_weights(args, device)
    manifest = make_manifest(args, list(range(args.layers)))
    base = local_buffer(manifest, rank, qkv, o, device)
    replicated_ms = {s["tokens"]: s["ms"] for s in res.data["steps"] if s["config"] == "replicated"}

    def go():
        b = NcclSymmBackend(None, device, cta_policy=2)
        g = make_gatherer(manifest, rank, base, device, b)[0]
        name = f"shardprep-nccl-symm-cta{b.cta_policy}" if b.cta_policy else "shardprep-nccl-symm(cta2 fell back)"
        measure_gatherer(args, device, manifest, qkv, o, mlp, g, name, res, cpu_group, replicated_ms)

    attempt(res, "shardprep-nccl-symm-cta2", go, cpu_group)


# -- report -------------------------------------------------------------------------------------------
def markdown(data: dict) -> str:
    lines = []
    m = data.get("machine", {})
    s = data.get("sizes", {})
    hbm = s.get("hbm_bytes_per_layer", {})
    lines.append(f"{m.get('gpu', m.get('device'))} × {m.get('world')}, torch {m.get('torch')}, NCCL {m.get('nccl')}; "
                 f"{s.get('layers')} layers, |T| = {s.get('T_bytes', 0) / GB:.3f} GB, "
                 f"R = {s.get('R_bytes', 0) / GB:.2f} GB, MLP {s.get('mlp_bytes', 0) / GB:.2f} GB; "
                 f"sharded layers {s.get('sharded')}")
    if hbm:
        lines.append(f"HBM bytes per sharded layer per rank (computed): copy path {hbm['copy'] / GB:.3f} GB, "
                     f"zero copy {hbm['zero_copy'] / GB:.3f} GB")
    steps = data.get("steps", [])
    tokens = sorted({st["tokens"] for st in steps})
    configs = list(dict.fromkeys(st["config"] for st in steps))
    ms = {(st["config"], st["tokens"]): st["ms"] for st in steps if st["ms"] is not None}
    lines += ["", "Step time, ms (ratio to replicated; graphs: to the replicated graph):", "",
              "| config | " + " | ".join(f"{t} tok" for t in tokens) + " |",
              "|---|" + "---|" * len(tokens)]
    for c in configs:
        base = "replicated+graph" if c.endswith("+graph") else "replicated"
        cells = []
        for t in tokens:
            if (c, t) not in ms:
                cells.append("–")
            elif c != base and (base, t) in ms:
                cells.append(f"{ms[c, t]:.3f} ({ms[c, t] / ms[base, t]:.3f})")
            else:
                cells.append(f"{ms[c, t]:.3f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    pairs = [(c, c.replace("+zc", "", 1)) for c in configs if "+zc" in c and "-notags" not in c
             and c.replace("+zc", "", 1) in configs]
    if pairs:
        lines += ["", "Zero copy: overhead over replicated (ms), copy path → zero copy, and the share removed:", "",
                  "| config | " + " | ".join(f"{t} tok" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
        for zc, copy in pairs:
            base = "replicated+graph" if zc.endswith("+graph") else "replicated"
            cells = []
            for t in tokens:
                if {(zc, t), (copy, t), (base, t)} <= ms.keys():
                    a, b = ms[copy, t] - ms[base, t], ms[zc, t] - ms[base, t]
                    cells.append(f"{a:+.3f} → {b:+.3f} ({1 - b / a:.0%})" if a > 0 else f"{a:+.3f} → {b:+.3f}")
                else:
                    cells.append("–")
            lines.append(f"| {zc} | " + " | ".join(cells) + " |")
    untagged = [(c.replace("-notags", ""), c) for c in configs
                if "-notags" in c and c.replace("-notags", "") in configs]
    if untagged:
        lines += ["", "Alignment tags: step time with tags / without:", "",
                  "| config | " + " | ".join(f"{t} tok" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
        for tagged, bare in untagged:
            cells = [f"{ms[tagged, t] / ms[bare, t]:.4f}" if {(tagged, t), (bare, t)} <= ms.keys() else "–"
                     for t in tokens]
            lines.append(f"| {tagged} | " + " | ".join(cells) + " |")
    if data.get("gather_only") or data.get("raw"):
        lines += ["", "| gathers only | ms per forward | GB/s received |", "|---|---|---|"]
        for name, g in data.get("gather_only", {}).items():
            lines.append(f"| {name} (idle_step) | {g['ms']:.3f} | {g['recv_GBps']:.1f} |")
        for name, r in data.get("raw", {}).items():
            gbps = r.get("recv_GBps", r.get("GBps"))
            lines.append(f"| raw {name} ({r['bytes'] / GB:.3f} GB) | {r['ms']:.3f} | {gbps:.1f} |")
    if any(v.get("measured") for v in data.get("memory", {}).values()):
        lines += ["", "Peak memory alone; formula R/N + slots + other (replicated: R + other, which defines other);",
                  "slots = 2·max|T| (copy) or 2·(N−1)·max C (zero copy); device delta: cudaMemGetInfo after − before:",
                  "", "| config | measured GB | formula GB | measured / formula | slots GB | device delta GB |",
                  "|---|---|---|---|---|---|"]
        for name, v in data["memory"].items():
            if v.get("measured") and v.get("formula"):
                delta = v.get("device_delta")
                lines.append(f"| {name} | {v['measured'] / GB:.3f} | {v['formula'] / GB:.3f} | "
                             f"{v['measured'] / v['formula']:.3f} | {v.get('slot_bytes', 0) / GB:.3f} | "
                             f"{'–' if delta is None else f'{delta / GB:.3f}'} |")
    for name, err in data.get("errors", {}).items():
        lines.append(f"\nerror in {name}: {err}")
    return "\n".join(lines)


def launch(args, phase: str) -> int:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.phase = phase
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args, port)) for r in range(args.world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.world:
            print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    t = time.perf_counter()
    rc = launch(args, "main")
    if rc:
        print(f"main run exited with code {rc}; results so far are in {args.out}", file=sys.stderr)
    if not args.no_cta2:
        rc2 = launch(args, "cta2")
        if rc2:
            print(f"NCCL_CTA_POLICY=2 run exited with code {rc2} (it is isolated; main results are kept)",
                  file=sys.stderr)
    data = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    data["total_wall_s"] = round(time.perf_counter() - t, 1)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(markdown(data))
    return rc


if __name__ == "__main__":
    sys.exit(main())
