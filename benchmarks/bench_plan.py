"""Does `shardprep plan` predict the step? Profile, plan, then measure three layer choices side by side.

    python3 benchmarks/bench_plan.py --out plan.json            # 2 GPUs, a few minutes
    python3 benchmarks/bench_plan.py --dry-run --out dry.json   # CPU + gloo, tiny sizes, about a minute

The MEASURED.md setup: a synthetic decoder stack of 8 layers; per layer, sharded attention projections
(q, k, v, o: |T| = 0.336 GB of bf16 at the default sizes) and a replicated MLP (1.4 GB) whose GEMMs are
the compute. Public API only. In one launch of `--world` ranks (one GPU each):

1. profile: the stack with every layer sharded, bound with `bind`, measured by
   `shardprep.standalone.profile.profile_binding` (what `shardprep profile` runs on a real model);
2. plan: `shardprep.prep.deployment_plan.plan_sharding` on the stack's manifest and config with that profile
   (what `shardprep plan OUT --profile` runs); its choice of layers;
3. measure, per token count, the replicated step and three choices: every layer, every other layer
   (1-:2), and the plan's (if it chose none: its "pays from" choice, else the cheapest set that saves
   memory), each one's step and gather-only time (idle_step);
4. report predicted against measured step (goal: within 10%) and the physical floor: the longest of
   the measured replicated step, the compute with the profiled interference (Σc + κ·min(Σc, Σg)),
   and the measured gather-only time plus the layers from the last sharded one on.

A step is one forward from an idle device to its last kernel (decode: the next step waits for the
sampled token). Times are medians of --iters, the slowest rank's. Results go to --out as JSON and a
markdown table is printed. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

GB = 1e9
SCHEMA = "shardprep/bench-plan/1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--kv-ratio", type=float, default=0.25, help="k and v rows as a fraction of hidden")
    p.add_argument("--ffn", type=int, default=28672, help="replicated MLP width (the compute per layer)")
    p.add_argument("--tokens", default="16,128,1024,4096", help="activation rows per step")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backend", default="ce", help="gather backend (ce, nccl, nccl-symm, auto)")
    p.add_argument("--max-overhead", type=float, default=0.10, help="the plan's bound, as a fraction")
    p.add_argument("--dry-run", action="store_true", help="CPU + gloo, tiny sizes: checks the script itself")
    args = p.parse_args(argv)
    if args.dry_run:
        args.layers, args.hidden, args.ffn, args.tokens = 4, 64, 128, "4,16"
        args.iters, args.warmup, args.backend = 2, 1, "gloo"
    args.token_list = tuple(int(t) for t in args.tokens.split(","))
    return args


# -- the model --------------------------------------------------------------------------------------
def names(i: int) -> dict[str, str]:
    base = f"model.layers.{i}.self_attn."
    return {k: f"{base}{k}_proj.weight" for k in ("q", "k", "v", "o")} | {"qkv": f"{base}qkv_proj.weight"}


def build_weights(args, device):
    """Per layer: q, k, v, o (the targets) and gate, up, down (the replicated MLP), the same on every rank."""
    import torch

    h, kv = args.hidden, max(16, int(args.hidden * args.kv_ratio) // 16 * 16)
    gen = torch.Generator(device=device)
    weights = []
    for i in range(args.layers):
        gen.manual_seed(1000 + i)
        shapes = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h),
                  "gate": (args.ffn, h), "up": (args.ffn, h), "down": (h, args.ffn)}
        weights.append({k: torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
                        for k, s in shapes.items()})
    return weights


def make_stack(weights):
    """A Llama-shaped stack (`model.layers.i.self_attn.q_proj`, ...) whose parameters share `weights`."""
    import torch.nn.functional as F
    from torch import nn

    def linear(w):
        m = nn.Module()
        m.weight = nn.Parameter(w, requires_grad=False)  # shares the tensor: bind() only swaps .data
        return m

    class Block(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.self_attn = nn.Module()
            for k in ("q", "k", "v", "o"):
                setattr(self.self_attn, f"{k}_proj", linear(w[k]))
            self.mlp = nn.Module()
            for k in ("gate", "up", "down"):
                setattr(self.mlp, f"{k}_proj", linear(w[k]))

        def forward(self, x):
            a = self.self_attn
            q = x @ a.q_proj.weight.t()
            x @ a.k_proj.weight.t(), x @ a.v_proj.weight.t()  # attention itself depends on the context
            x = x + q @ a.o_proj.weight.t()
            m = self.mlp
            return x + (F.silu(x @ m.gate_proj.weight.t()) * (x @ m.up_proj.weight.t())) @ m.down_proj.weight.t()

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block(w) for w in weights)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def forward(self, x):
            for layer in self.model.layers:
                x = layer(x)
            return x

    return Stack()


def make_manifest(args, weights, layers, replicated_files=()):
    """The manifest `convert --layers` would write for these layers (qkv fused, as the llama preset does),
    with the checksums of the chunks cut from `weights`; `replicated_files` lists the other files' records."""
    import torch

    from shardprep.manifests import (
        FusedGroup,
        LayerRecord,
        Manifest,
        TensorSpec,
        plan_layer,
        plan_rank_file,
        rank_file_name,
    )
    from shardprep.manifests.checksums import digest

    layouts = []
    for i in layers:
        n, w = names(i), weights[i]
        specs = [TensorSpec(n[k], "BF16", tuple(w[k].shape)) for k in ("q", "k", "v", "o")]
        layouts.append(plan_layer(i, specs, args.world, [FusedGroup(n["qkv"], (n["q"], n["k"], n["v"]))]))
    offsets, _ = plan_rank_file([(lay.layer, lay.chunk_bytes) for lay in layouts], args.world, 4096)
    records = []
    for lay, off in zip(layouts, offsets):
        flat = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        by_name = {names(lay.layer)[k]: weights[lay.layer][k] for k in ("q", "k", "v", "o")}
        for e in lay.entries:
            flat[e.offset:e.offset + e.nbytes].copy_(by_name[e.name].detach().cpu().reshape(-1).view(torch.uint8))
        c = lay.chunk_bytes
        sums = tuple(digest(flat[r * c:(r + 1) * c].numpy().tobytes()) for r in range(args.world))
        records.append(LayerRecord.from_layout(lay, off, sums))
    return Manifest(args.world, tuple(rank_file_name(r, args.world) for r in range(args.world)), tuple(records),
                    source={"path": None, "repo_id": None, "revision": None, "commit": None, "files": []},
                    selection={"preset": None, "preset_targets": [], "targets": ["*.self_attn.*.weight"],
                               "layers": ",".join(str(i) for i in layers), "layer_pattern": r"layers\.(\d+)\."},
                    requant_options={"mode": "none", "scope": "all", "recipe": "sglang", "scale_format": "f32",
                                     "allow_nonfinite": False},
                    replicated_files=tuple(replicated_files), created_by="bench_plan synthetic stack")


def bind_layers(args, weights, layers, rank, device):
    """A fresh stack with `layers` sharded: this rank's chunks cut as convert would, a gatherer, bind()."""
    import torch

    from shardprep.loader.rank_shards import RankShards
    from shardprep.runtime import LayerGatherer, bind, make_backend

    manifest = make_manifest(args, weights, layers)
    backend = make_backend(args.backend, None, device)
    buf = backend.allocate_local(manifest.rank_file_bytes)
    buf.zero_()
    for rec in manifest.layers:
        flat = torch.zeros(rec.total_bytes, dtype=torch.uint8, device=device)
        by_name = {names(rec.layer)[k]: weights[rec.layer][k] for k in ("q", "k", "v", "o")}
        for e in rec.entries:
            flat[e.offset:e.offset + e.nbytes].copy_(by_name[e.name].reshape(-1).view(torch.uint8))
        c = rec.chunk_bytes
        buf[rec.file_offset:rec.file_offset + c].copy_(flat[rank * c:(rank + 1) * c])
    shards = RankShards(manifest, rank, buf)
    model = make_stack(weights)
    return bind(model, shards, LayerGatherer(shards, backend=backend))


# -- one rank ---------------------------------------------------------------------------------------
def worker(args, workdir: str):
    import torch
    import torch.distributed as dist

    from shardprep.standalone.profile import ProfileOptions, profile_binding
    from shardprep.standalone.timing import DeviceClock, median, slowest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    control = dist.new_group(backend="gloo")
    clock = DeviceClock(device)
    result = {"errors": {}}
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            weights = build_weights(args, device)
            gen = torch.Generator(device=device).manual_seed(7)
            inputs = {t: torch.randn(t, args.hidden, generator=gen, device=device, dtype=torch.bfloat16)
                      for t in args.token_list}
            every = list(range(args.layers))

            # 1. profile, with every layer sharded
            binding = bind_layers(args, weights, every, rank, device)
            model = binding.model
            options = ProfileOptions(tokens=args.token_list, backends=(args.backend,), iters=args.iters,
                                     warmup=args.warmup, device=device.type, dry_run=args.dry_run)
            profile = profile_binding(binding, lambda t: lambda: model(inputs[t]), model.model.layers, options,
                                      source="bench_plan synthetic stack")
            binding = None  # profile_binding left the stack unbound; its gatherer and slots can go
            result["profile"] = profile.to_dict()
            log(rank, f"profiled ({time.perf_counter() - t0:.1f} s)")

            # 2. plan, on the stack's manifest and config, as `shardprep plan OUT --profile` would
            choice = [None]
            if rank == 0:
                try:
                    choice[0] = plan(args, weights, profile, workdir)
                except Exception as exc:  # measure the other choices anyway; the error is reported
                    result["errors"]["plan"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
                    choice[0] = {"layers": list(range(0, args.layers, 3)), "label": "plan failed; every third layer",
                                 "verdict": None, "verdict_line": f"plan failed: {result['errors']['plan']}",
                                 "convert_layers": None, "report": None}
            dist.broadcast_object_list(choice, src=0, group=control)
            planned = choice[0]
            result["plan"] = planned
            log(rank, f"plan: {planned['verdict_line']}")

            # 3. measure
            configs = [("all", every), ("every other (1-:2)", list(range(1, args.layers, 2))),
                       (f"plan: {planned['label']}", planned["layers"])]
            replicated = make_stack(weights)

            def steps(model_):
                out = []
                for t in args.token_list:
                    for _ in range(args.warmup):
                        model_(inputs[t])
                    out.append(median([clock.time_ms(lambda t=t: model_(inputs[t])) for _ in range(args.iters)]))
                return slowest(out, control)

            rep_before = steps(replicated)
            rows = []
            for name, layers in configs:
                b = bind_layers(args, weights, layers, rank, device)
                for _ in range(args.warmup):
                    b.idle_step()
                gather_only = slowest([median([clock.time_ms(b.idle_step) for _ in range(args.iters)])], control)[0]
                measured = steps(b.model)
                rows.append({"config": name, "layers": layers, "gather_only_ms": gather_only, "step_ms": measured})
                b.remove()
                del b
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                log(rank, f"measured {name} ({time.perf_counter() - t0:.1f} s)")
            rep_after = steps(replicated)
            result["replicated_ms"] = {"before": rep_before, "after": rep_after}
            result["configs"] = [compare(args, profile, row, rep_before, rep_after) for row in rows]
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result["errors"][f"rank {rank}"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    gathered = [None] * world
    dist.all_gather_object(gathered, result["errors"], group=control)
    for errors in gathered:
        result["errors"].update(errors)
    dist.destroy_process_group()
    return result if rank == 0 else None


def plan(args, weights, profile, workdir):
    """Run the planner on a directory holding the stack's manifest (every layer) and config.json."""
    from shardprep.manifests import FileRecord
    from shardprep.manifests.checksums import file_digest
    from shardprep.planning.layer_choice import least_overhead
    from shardprep.prep.deployment_plan import PlanRequest, plan_sharding
    from shardprep.prep.selection import parse_layers

    out = Path(workdir) / "stack"
    out.mkdir(parents=True, exist_ok=True)
    # The planner reads the manifest and config.json only; the index is there because a manifest lists it.
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {}}))
    index = FileRecord("model.safetensors.index.json", *file_digest(out / "model.safetensors.index.json"))
    (out / "shard_manifest.json").write_text(make_manifest(args, weights, range(args.layers), (index,)).to_json())
    heads = max(1, args.hidden // 128)
    kv_rows = weights[0]["k"].shape[0]
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": args.layers, "hidden_size": args.hidden,
        "num_attention_heads": heads, "num_key_value_heads": max(1, kv_rows * heads // args.hidden),
        "intermediate_size": args.ffn, "torch_dtype": "bfloat16"}))
    (out / "profile.json").write_text(json.dumps(profile.to_dict()))
    report = plan_sharding(PlanRequest(str(out), ranks=args.world, profile=out / "profile.json",
                                       max_overhead=args.max_overhead))
    layers, label = None, None
    if report.convert_layers:
        layers = parse_layers(report.convert_layers).resolve(range(args.layers))
        label = report.convert_layers + (f" (pays from {report.pays_from_tokens} tokens)"
                                         if report.pays_from_tokens else "")
    else:
        from shardprep.planning.accounting import account_layers

        sizes = {r.layer: r.total_bytes for r in make_manifest(args, weights, range(args.layers)).layers}
        memory = lambda s: account_layers([sizes[i] for i in s], args.world)  # noqa: E731
        cheapest = least_overhead(range(args.layers), memory, lambda s: [])
        if cheapest is not None:
            layers = list(cheapest.layers)
            label = f"none chosen; the fewest layers that save memory ({len(layers)})"
        else:
            layers, label = list(range(args.layers)), "none chosen and no set saves memory; every layer"
    return {"layers": layers, "label": label, "verdict": report.verdict.value, "verdict_line": report.verdict_line,
            "convert_layers": report.convert_layers, "report": report.to_dict()}


def compare(args, profile, row, rep_before, rep_after):
    """Predicted against measured, and the floor, for one configuration at every token count."""
    from shardprep.planning.step_time import predict_step, step_floor

    backend = profile.backend(None)
    points = []
    for ti, t in enumerate(args.token_list):
        gathers = {i: backend.estimate_gather_ms(i, 0) for i in row["layers"]}
        segments = profile.segments(ti, gathers)
        interference = backend.interference(ti)
        predicted = predict_step(segments, interference)
        replicated = (rep_before[ti] + rep_after[ti]) / 2
        measured = row["step_ms"][ti]
        floor = step_floor(segments, interference, replicated_ms=replicated, gather_only_ms=row["gather_only_ms"])
        points.append({
            "tokens": t, "replicated_ms": replicated, "measured_ms": measured, "measured_ratio": measured / replicated,
            "predicted_ms": predicted.step_ms, "predicted_ratio": predicted.step_ms / predicted.replicated_ms,
            "prediction_error": predicted.step_ms / measured - 1, "floor_ms": floor.ms, "floor_term": floor.term,
            "floor_terms_ms": {"replicated": floor.replicated_ms,
                               "compute+interference": floor.compute_with_interference_ms,
                               "gathers+tail": floor.gathers_then_tail_ms},
            "measured_over_floor": measured / floor.ms,
        })
    return {**row, "points": points}


def log(rank, text):
    if rank == 0:
        print(f"[bench_plan] {text}", flush=True)


# -- report -------------------------------------------------------------------------------------------
def markdown(data: dict) -> str:
    prof = data.get("profile") or {}
    lines = [f"{prof.get('device')} × {prof.get('world_size')}, {data['args']['layers']} layers, hidden "
             f"{data['args']['hidden']}, MLP {data['args']['ffn']}, backend {data['args']['backend']}"]
    for b in prof.get("backends", []):
        lines.append(f"gather-only {b['gather_only_ms']:.3f} ms per forward, {b['recv_gbps']:.1f} GB/s; "
                     "κ (compute slowdown beside gathers) per token count: "
                     + ", ".join(f"{t}: {k:.2f}" for t, k in zip(prof["tokens"], b["compute_slowdown"])))
    if data.get("plan"):
        lines.append(f"plan: {data['plan']['verdict_line']}")
    lines += ["", "| config | tokens | replicated ms | measured ms (× repl.) | predicted ms (× repl.) | "
                  "prediction error | floor ms (set by) | measured / floor |",
              "|---|---|---|---|---|---|---|---|"]
    for c in data.get("configs", []):
        for p in c["points"]:
            lines.append(f"| {c['config']} | {p['tokens']} | {p['replicated_ms']:.3f} | {p['measured_ms']:.3f} "
                         f"({p['measured_ratio']:.3f}×) | {p['predicted_ms']:.3f} ({p['predicted_ratio']:.3f}×) | "
                         f"{p['prediction_error']:+.1%} | {p['floor_ms']:.3f} ({p['floor_term']}) | "
                         f"{p['measured_over_floor']:.3f} |")
    errors = [abs(p["prediction_error"]) for c in data.get("configs", []) for p in c["points"]]
    if errors:
        lines.append(f"\nworst |prediction error|: {max(errors):.1%} "
                     f"({sum(e <= 0.10 for e in errors)} of {len(errors)} within 10%)")
    for where, err in data.get("errors", {}).items():
        lines.append(f"\nerror on {where}: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.dry_run:
        import torch

        if torch.cuda.device_count() < args.world:
            print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
    from shardprep.standalone.launch import launch_local

    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        result = launch_local(worker, args.world, args, workdir)[0]
    data = {"schema": SCHEMA, "args": {k: v for k, v in vars(args).items() if k != "token_list"}, **result,
            "total_wall_s": round(time.perf_counter() - t, 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(markdown(data))
    return 1 if data.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
