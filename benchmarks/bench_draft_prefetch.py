"""The draft's first gather against the target's CUDA graph, on one GPU: inside the graph, prefetched, inline.

    python3 benchmarks/bench_draft_prefetch.py --out draft_prefetch.json     # one GPU, three invocations, minutes
    python3 benchmarks/bench_draft_prefetch.py --dry-run --out dry.json     # CPU + gloo, tiny sizes, seconds

One process and one rank (a world of one), the copy path (zero copy off): a layer's "gather" is a same-device copy
of the layer into its slot, standing in for the peers' shares of a real gather (as bench_binding.py and
`shardprep profile` at one rank do). No byte crosses a link, and an HBM copy runs faster than an NVLink gather of
the same layer, so the times below are those of a faster link than a real one.

The model, sized like Kimi-K2.5-DFlash's draft (hidden 7168; a draft layer of 1.2 GB in bf16) and scaled to fit:
`--target-layers` decoder-like target layers (attention projections gathered, a replicated MLP of `--target-ffn`:
the compute the gathers hide behind) and `--draft-layers` draft layers (attention and an MLP of `--draft-ffn`, all
gathered), after the target's layers in one gatherer, as a draft is served. Per step, on `--tokens` rows: the
target's forward, replayed from a CUDA graph; sampling (an LM head of `--vocab` rows, its argmax, the sampled
token's embedding added to the draft's input; `--vocab 0`: none); the draft's forward, replayed from its own graph.
The draft's first gather, G(D), goes:

- in_target: inside the target's graph (LayerGatherer(draft_first="in_target"): issued one layer ahead as in eager
  serving, the graph ending once it is complete): today's schedule under capture;
- prefetch: outside the graphs, on the draft stream, by `prefetch_draft(replayed=True)` right after the target's
  replay is launched: it starts once the target's layer D−2 has computed and runs under the target's last layer
  and the sampling (gatherer.py, "The draft's first gather");
- inline: the same gather started only when the draft's phase starts (the draft stream waits for the compute
  stream to get there): what a cold start's inline gather at the draft's first wait costs;
- resident: prefetched, and complete before the draft's phase starts: the draft as if its first layer's weights
  were resident (the reference for the draft's time).

Timed with CUDA events on the compute stream around each part of a step, median over `--iters` steps, the four
schedules interleaved step by step: target = the target's replay (with in_target, up to G(D)'s end), sampling,
draft = the draft's replay, step = all three. "draft wait" = draft − resident's draft: how much longer the draft's
first layer waits than with its weights resident. "added" = step − (inline's target + inline's sampling +
resident's draft): what the draft's first gather adds to a step in which nothing overlapped it. `--invocations`
fresh processes (default 3) each measure everything; the table shows their values separated by " / ". Every
schedule's draft reads G(D)'s bytes: a sample of them is copied out in the draft's first layer and compared with
the weights (`checks`). Results go to --out as JSON, and a markdown table is printed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

GB, MB = 1e9, 1e6
SCHEDULES = ("in_target", "prefetch", "inline", "resident")
PROBES = 4096  # bytes sampled from each of the draft's first layer's tensors (the check that its gather happened)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON results file")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, eager, no graphs")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--kv-ratio", type=float, default=0.125, help="k and v rows as a fraction of hidden")
    p.add_argument("--target-layers", type=int, default=4)
    p.add_argument("--target-ffn", type=int, default=18432, help="a target layer's replicated MLP width")
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument("--draft-ffn", type=int, default=22528,
                   help="a draft layer's gathered MLP width (with hidden 7168: 1.2 GB of bf16 a layer)")
    p.add_argument("--tokens", default="16,128", help="activation rows per step (comma-separated)")
    p.add_argument("--vocab", default="163840,0", help="LM head rows of the sampling step (comma-separated; 0: none)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--backend", default="auto", help="gather backend (auto: ce on CUDA, gloo on the CPU)")
    p.add_argument("--invocations", type=int, default=None,
                   help="fresh processes, each measuring everything (default 3; dry run: 1, in this process)")
    p.add_argument("--timeout", type=float, default=420, help="seconds one invocation may run before it is killed")
    p.add_argument("--dry-run", action="store_true", help="CPU + gloo, tiny sizes, eager: checks the script itself")
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.hidden, args.target_ffn, args.draft_ffn = "cpu", 64, 128, 192
        args.target_layers, args.draft_layers, args.tokens, args.vocab = 3, 2, "4", "256,0"
        args.iters, args.warmup = 3, 1
    if args.invocations is None:
        args.invocations = 1 if args.dry_run else 3
    if args.device == "cpu" and args.backend == "auto":
        args.backend = "gloo"
    try:
        args.token_list = [int(t) for t in args.tokens.split(",")]
        args.vocab_list = [int(v) for v in args.vocab.split(",")]
    except ValueError:
        p.error(f"--tokens {args.tokens!r} / --vocab {args.vocab!r}: comma-separated integers expected")
    if min(args.token_list) < 1 or min(args.vocab_list) < 0 or args.target_layers < 2 or args.draft_layers < 1:
        p.error("--tokens must be ≥ 1, --vocab ≥ 0, --target-layers ≥ 2 (G(D) reuses layer D−2's slot), "
                "--draft-layers ≥ 1")
    if args.iters < 1 or args.invocations < 1:
        p.error("--iters and --invocations must be ≥ 1")
    return args


# -- the model --------------------------------------------------------------------------------------
def kv_rows(args) -> int:
    return max(16, int(args.hidden * args.kv_ratio) // 16 * 16)


def names(i: int) -> dict[str, str]:
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    return {"q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight", "o": a + "o_proj.weight",
            "qkv": a + "qkv_proj.weight", "gate": m + "gate_proj.weight", "up": m + "up_proj.weight",
            "down": m + "down_proj.weight", "gate_up": m + "gate_up_proj.weight"}


def shapes(args, draft: bool) -> dict[str, tuple[int, int]]:
    """The gathered tensors of a layer: attention for the target's, attention and MLP for the draft's."""
    h, kv, f = args.hidden, kv_rows(args), args.draft_ffn
    found = {"q": (h, h), "k": (kv, h), "v": (kv, h), "o": (h, h)}
    return found | ({"gate": (f, h), "up": (f, h), "down": (h, f)} if draft else {})


def make_manifest(args):
    """One rank's manifest (what convert would write at N = 1): the target's layers, then the draft's."""
    from shardprep.manifests import FusedGroup, LayerRecord, Manifest, TensorSpec, plan_file_offsets, plan_layer
    from shardprep.manifests.draft_layers import MTP, DraftLayers
    from shardprep.manifests.manifest import rank_file_name

    t, d = args.target_layers, args.draft_layers
    layouts = []
    for i in range(t + d):
        n = names(i)
        specs = [TensorSpec(n[k], "BF16", shape) for k, shape in shapes(args, i >= t).items()]
        groups = [FusedGroup(n["qkv"], (n["q"], n["k"], n["v"]))]
        if i >= t:
            groups.append(FusedGroup(n["gate_up"], (n["gate"], n["up"])))
        layouts.append(plan_layer(i, specs, 1, groups))
    offsets = plan_file_offsets([lay.chunk_bytes for lay in layouts])
    # The record's kind is not read by the gatherer, only its layers: "mtp" is today's one kind (a DFlash-like draft).
    records = tuple(LayerRecord.from_layout(lay, o) for lay, o in zip(layouts, offsets))
    return Manifest(1, (rank_file_name(0, 1),), records, draft=DraftLayers(MTP, tuple(range(t, t + d))))


def build(args, device):
    """The rank's buffer (every layer's tensors at their offsets), the target's replicated MLPs, the LM head, and the
    draft's first layer's sampled bytes, all from seeded random weights."""
    import torch

    manifest = make_manifest(args)
    buffer = torch.zeros(manifest.rank_file_bytes, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device)
    expected = {}
    for r in manifest.layers:
        gen.manual_seed(1000 + r.layer)
        n = names(r.layer)
        for key, shape in shapes(args, r.layer >= args.target_layers).items():
            w = torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
            e = next(e for e in r.entries if e.name == n[key])
            flat = w.reshape(-1).view(torch.uint8)
            buffer[r.file_offset + e.offset:r.file_offset + e.offset + e.nbytes].copy_(flat)
            if r.layer == args.target_layers:
                expected[n[key]] = flat[::max(1, flat.numel() // PROBES)].clone()
    mlps = []
    for i in range(args.target_layers):
        gen.manual_seed(2000 + i)
        f, h = args.target_ffn, args.hidden
        mlps.append((torch.randn(2 * f, h, generator=gen, device=device, dtype=torch.bfloat16) * 0.02,
                     torch.randn(h, f, generator=gen, device=device, dtype=torch.bfloat16) * 0.02))
    gen.manual_seed(3000)
    heads = {v: torch.randn(v, args.hidden, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
             for v in args.vocab_list if v}
    return manifest, buffer, mlps, heads, expected


def decoder(x, qkv, o, gate_up, down, hidden: int):
    """Attention's projections (attention itself depends on the context, not on the weights), then the MLP."""
    import torch.nn.functional as F

    x = F.rms_norm(x, (hidden,))
    x = x + (x @ qkv.t())[:, :hidden] @ o.t()
    g, u = (F.rms_norm(x, (hidden,)) @ gate_up.t()).chunk(2, dim=-1)
    return x + (F.silu(g) * u) @ down.t()


class Pipeline:
    """One gatherer's step: the target's forward, sampling, the draft's forward, on static buffers (graph-ready)."""

    def __init__(self, args, g, mlps, heads, tokens: int):
        import torch

        self.args, self.g, self.mlps, self.heads = args, g, mlps, heads
        self.d = g._draft_at
        h, device = args.hidden, g.device
        gen = torch.Generator(device=device).manual_seed(tokens)
        self.x = torch.randn(tokens, h, generator=gen, device=device, dtype=torch.bfloat16)
        self.y, self.xd, self.out = (torch.zeros_like(self.x) for _ in range(3))
        first = g.layers[self.d]
        # Strided views of the draft's first layer's tensors, at the slot's fixed addresses: sampled in that layer.
        tensors = {names(first)[k] for k in shapes(args, True)}
        self.probes = {name: view.reshape(-1).view(torch.uint8)[::max(1, view.numel() * 2 // PROBES)]
                       for name, view in g.views(first).items() if name in tensors}
        self.sampled = {name: torch.empty_like(src) for name, src in self.probes.items()}
        self.vocab = 0

    def target(self) -> None:
        g, x, h = self.g, self.x, self.args.hidden
        g.begin()
        for i, layer in enumerate(g.layers[:self.d]):
            w, n = g.wait(layer), names(layer)
            x = decoder(x, w[n["qkv"]], w[n["o"]], *self.mlps[i], h)
            g.done(layer)
        self.y.copy_(x)

    def sample(self) -> None:
        if not self.vocab:
            self.xd.copy_(self.y)
            return
        head = self.heads[self.vocab]
        ids = (self.y @ head.t()).argmax(-1)
        self.xd.copy_(self.y + head[ids])  # the sampled token's embedding (tied to the LM head) joins the draft's input

    def draft(self) -> None:
        # As a binding does, no done(): the draft's slots are released by the next target forward.
        g, x, h = self.g, self.xd, self.args.hidden
        for j, layer in enumerate(g.layers[self.d:]):
            w, n = g.wait(layer), names(layer)
            if j == 0:
                for name, src in self.probes.items():
                    self.sampled[name].copy_(src)
            x = decoder(x, w[n["qkv"]], w[n["o"]], w[n["gate_up"]], w[n["down"]], h)
        self.out.copy_(x)

    def eager_step(self) -> None:
        self.target()
        self.g.prefetch_draft()
        self.sample()
        self.draft()


def measure(args) -> dict:
    """One invocation: every schedule at every --tokens and --vocab."""
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardprep.loader.rank_shards import RankShards
    from shardprep.runtime import LayerGatherer

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), **kwargs)
    torch.set_grad_enabled(False)
    data: dict = {"machine": machine(device), "rows": [], "checks": {}, "errors": {}}
    manifest, buffer, mlps, heads, expected = build(args, device)
    target_bytes = sum(r.total_bytes for r in manifest.layers if r.layer < args.target_layers)
    draft_first = manifest.layer(args.target_layers).total_bytes
    data["sizes"] = {"draft_layer_bytes": draft_first,
                     "draft_bytes": sum(r.total_bytes for r in manifest.layers) - target_bytes,
                     "target_gathered_bytes_per_layer": target_bytes // args.target_layers,
                     "target_mlp_bytes_per_layer": sum(t.numel() * 2 for t in mlps[0])}
    data["sizes"]["copy_alone"] = copy_alone(buffer, manifest.layer(args.target_layers), device, args)
    # Two gatherers over the same bytes: G(D) in the target's graph, and out of it (the other three schedules).
    firsts = {"in_target": "in_target", "detached": "auto" if cuda else "detached"}
    gatherers = {k: LayerGatherer(RankShards(manifest, 0, buffer), backend=args.backend, zero_copy=False,
                                  draft_first=v) for k, v in firsts.items()}
    del buffer  # each gatherer holds the buffer as its backend wants it
    data["backend"] = gatherers["detached"].backend_name
    data["slot_bytes"] = gatherers["detached"].slot_bytes
    for tokens in args.token_list:
        pipes = {k: Pipeline(args, g, mlps, heads, tokens) for k, g in gatherers.items()}
        steps = {s: pipes["in_target" if s == "in_target" else "detached"] for s in SCHEDULES}
        runners = graphed(pipes, steps, device) if cuda else eager_runners(steps)
        for vocab in args.vocab_list:
            for p in pipes.values():
                p.vocab = vocab
            rows = timed(runners, args, device)
            for schedule in SCHEDULES:  # one more step each, its sampled bytes checked
                runners[schedule](None)
                if cuda:
                    torch.cuda.synchronize(device)
                p = steps[schedule]
                data["checks"][f"{schedule} tokens={tokens} vocab={vocab}"] = all(
                    torch.equal(p.sampled[name], expected[name]) for name in p.probes)
            data["rows"].extend({"tokens": tokens, "vocab": vocab, **row} for row in rows)
    if cuda:
        data["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    dist.destroy_process_group()
    return data


def copy_alone(buffer, record, device, args) -> dict:
    """One draft layer copied on the device, alone (what the one-rank "gather" of it is), median ms and GB/s."""
    import torch

    src = buffer[record.file_offset:record.file_offset + record.total_bytes]
    dst = torch.empty_like(src)
    samples = []
    for k in range(args.warmup + max(5, args.iters // 5)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            ms = (time.perf_counter() - t) * 1e3
        if k >= args.warmup:
            samples.append(ms)
    ms = statistics.median(samples)
    return {"bytes": record.total_bytes, "ms": ms, "GBps": record.total_bytes / (ms * 1e-3) / GB}


def graphed(pipes, steps, device):
    """Each pipeline's target and draft captured in two CUDA graphs; a runner per schedule replays one step."""
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up away from the default stream, as torch.cuda.graph asks
        for p in pipes.values():
            for _ in range(2):
                p.eager_step()
    torch.cuda.current_stream(device).wait_stream(side)
    graphs = {}
    for key, p in pipes.items():
        target, draft = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: other threads (NCCL's watchdog) may keep querying their events during the capture
        with torch.cuda.graph(target, capture_error_mode="thread_local"):
            p.target()
        p.g.prefetch_draft()  # the captured forward's G(D), once, so that the draft can be captured
        with torch.cuda.graph(draft, capture_error_mode="thread_local"):
            p.draft()
        graphs[key] = (target, draft)
    torch.cuda.synchronize(device)

    def runner(schedule):
        p = steps[schedule]
        target, draft = graphs["in_target" if schedule == "in_target" else "detached"]
        marker = torch.cuda.Event()

        def run(ev):
            compute = torch.cuda.current_stream(device)
            if ev:
                ev[0].record()
            target.replay()
            if schedule != "inline":
                p.g.prefetch_draft(replayed=True)  # in_target: nothing to issue; it only follows the replay
            if ev:
                ev[1].record()
            p.sample()
            if schedule == "resident":
                marker.record(p.g.streams.draft)
                compute.wait_event(marker)  # the draft's phase starts with G(D) complete
            if ev:
                ev[2].record()
            if schedule == "inline":
                marker.record(compute)
                p.g.streams.draft.wait_event(marker)  # G(D) starts only when the draft's phase does
                p.g.prefetch_draft(replayed=True)
            draft.replay()
            if ev:
                ev[3].record()

        return run

    return {s: runner(s) for s in SCHEDULES}


def eager_runners(steps):
    """The CPU's (dry run's) steps: no graphs, the gatherers' eager schedules; timed by the host clock."""

    def runner(schedule):
        p = steps[schedule]

        def run(ev):
            t0 = time.perf_counter()
            p.target()
            if schedule != "inline":
                p.g.prefetch_draft()  # in_target ("auto", eagerly): nothing to issue
            t1 = time.perf_counter()
            p.sample()
            t2 = time.perf_counter()
            p.draft()  # inline: its first wait gathers
            if ev is not None:
                ev.extend([t0, t1, t2, time.perf_counter()])

        return run

    return {s: runner(s) for s in SCHEDULES}


def timed(runners, args, device) -> list[dict]:
    """Medians of each part of a step, the schedules interleaved step by step."""
    import torch

    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        for run in runners.values():
            run(None)
    marks: dict[str, list] = {s: [] for s in SCHEDULES}
    for _ in range(args.iters):
        for s, run in runners.items():
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
            run(ev)
            marks[s].append(ev)
    if cuda:
        torch.cuda.synchronize(device)

    def ms(ev, a, b):
        return ev[a].elapsed_time(ev[b]) if cuda else (ev[b] - ev[a]) * 1e3

    rows = []
    for s in SCHEDULES:
        parts = {name: statistics.median(ms(ev, a, b) for ev in marks[s])
                 for name, (a, b) in {"target_ms": (0, 1), "sampling_ms": (1, 2), "draft_ms": (2, 3),
                                      "step_ms": (0, 3)}.items()}
        rows.append({"schedule": s, **parts})
    by = {r["schedule"]: r for r in rows}
    reference = by["inline"]["target_ms"] + by["inline"]["sampling_ms"] + by["resident"]["draft_ms"]
    for r in rows:
        r["draft_wait_ms"] = r["draft_ms"] - by["resident"]["draft_ms"]
        r["added_ms"] = None if r["schedule"] == "resident" else r["step_ms"] - reference
    return rows


def machine(device) -> dict:
    import platform

    import torch

    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


# -- the table --------------------------------------------------------------------------------------
def table(runs: list[dict]) -> str:
    """Markdown: one row per (tokens, vocab, schedule), each cell the invocations' values separated by " / "."""
    cols = [("target ms", "target_ms"), ("sampling ms", "sampling_ms"), ("draft ms", "draft_ms"),
            ("draft wait ms", "draft_wait_ms"), ("step ms", "step_ms"), ("added ms", "added_ms")]
    lines = ["| tokens | vocab | schedule | " + " | ".join(c for c, _ in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    keys = [(r["tokens"], r["vocab"], r["schedule"]) for r in runs[0]["rows"]]
    for key in keys:
        found = [next((r for r in run["rows"] if (r["tokens"], r["vocab"], r["schedule"]) == key), None)
                 for run in runs]
        cells = [" / ".join("—" if r is None or r[k] is None else f"{r[k]:.3f}" for r in found) for _, k in cols]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(runs: list[dict], args) -> str:
    first = runs[0]
    size = first["sizes"]
    lines = [
        f"device: {first['machine'].get('gpu', first['machine']['device'])} (torch {first['machine']['torch']}), "
        f"backend {first['backend']}, one rank, copy path: each gather is a same-device copy standing in for the "
        "peers' shares (no link)",
        f"draft: {args.draft_layers} layers of {size['draft_layer_bytes'] / MB:.1f} MB (hidden {args.hidden}); "
        f"target: {args.target_layers} layers, {size['target_gathered_bytes_per_layer'] / MB:.1f} MB gathered + "
        f"{size['target_mlp_bytes_per_layer'] / MB:.1f} MB replicated MLP each; "
        f"slots {first['slot_bytes'] / MB:.1f} MB",
        "a draft layer copied alone: " + " / ".join(f"{r['sizes']['copy_alone']['ms']:.3f} ms "
                                                    f"({r['sizes']['copy_alone']['GBps']:.0f} GB/s)" for r in runs),
        f"median of {args.iters} steps per cell, {len(runs)} invocation(s)"
        + ("; dry run: CPU, eager, tiny sizes, the times mean nothing" if args.dry_run else ""),
    ]
    return "\n".join(lines)


# -- driver -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child_out is not None:
        faulthandler.dump_traceback_later(args.timeout, exit=True)  # a hang on the device ends the invocation
        Path(args.child_out).write_text(json.dumps(measure(args)))
        return 0
    runs, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.invocations):
            out = Path(tmp, f"run{k}.json")
            if args.invocations == 1:
                try:
                    out.write_text(json.dumps(measure(args)))
                except Exception as exc:
                    traceback.print_exc()
                    failures.append(f"invocation {k + 1}: {type(exc).__name__}: {exc}")
            else:
                try:
                    proc = subprocess.run([sys.executable, __file__, *argv, "--child-out", str(out)],
                                          capture_output=True, text=True, timeout=args.timeout + 120)
                except subprocess.TimeoutExpired:
                    failures.append(f"invocation {k + 1}: still running after {args.timeout + 120:.0f} s, killed")
                    continue
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-4000:])
                    failures.append(f"invocation {k + 1}: exit {proc.returncode}")
            if out.exists():
                runs.append(json.loads(out.read_text()))
    result = {"args": {k: v for k, v in vars(args).items() if k != "child_out"}, "invocations": runs,
              "failures": failures,
              "checks": {k: all(r["checks"].get(k, False) for r in runs) for k in (runs[0]["checks"] if runs else {})}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if runs:
        print(summary(runs, args))
        print()
        print(table(runs))
        bad = [k for k, ok in result["checks"].items() if not ok]
        print(f"\nchecks: all {len(result['checks'])} passed" if not bad else f"\nchecks FAILED: {', '.join(bad)}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures or not runs or not all(result["checks"].values()) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown, which can abort while communicator threads are still joinable (as
    # bench_gather.py does); everything is written by now.
    os._exit(code)
