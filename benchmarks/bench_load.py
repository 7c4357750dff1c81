"""Startup loading: one rank's open_rank vs safetensors.load_file of the full checkpoint, in one run; and
(--steps) what each rank holds after each step of its startup.

    python3 benchmarks/bench_load.py --size-gb 2 --ranks 8 [--device cpu] [--write-docs]
    python3 benchmarks/bench_load.py --steps --size-gb 0.5 --ranks 2 [--device cuda] [--write-docs]

A synthetic Llama-layout bf16 checkpoint (HF names, ~500 MB safetensors shards plus an index) is
written with safetensors.torch.save_file and converted for `--ranks` ranks (attention and MLP of
layers 1- are targets; q/k/v fused). Then, each phase in a fresh subprocess:

- full load_file: safetensors.torch.load_file of every source file (what a rank loads unsharded);
- targets load_file: only the target tensors, read from the source with safe_open;
- open_rank: rank 0's shard file into one buffer on --device;
- open_rank + replicated: open_rank plus load_replicated (a shardprep rank's whole startup).

Each phase is measured cold (the model files evicted from the page cache with POSIX_FADV_DONTNEED;
--drop-caches drops the whole cache instead, libraries included) and warm (the same phase again right after): wall time,
bytes read from storage (/proc/self/io read_bytes), and peak anonymous memory (RssAnon sampled every
millisecond; VmHWM, which also counts mapped file pages, alongside). With --device cpu the buffer
itself is anonymous memory (it is the "device" memory); with --device cuda only the staging is.
open_rank reads the file on first use, so these phases touch `shards.buffer` (it reads the file there).

--steps: `--ranks` processes (gloo on the CPU, NCCL with one GPU each on CUDA) start up as a server
would: open_rank(verify=True), LayerGatherer, build_model (bind plus the replicated part), and after
each step every rank reports what it holds and the peak so far: host RSS and its peak (VmRSS,
VmHWM reset through /proc/self/clear_refs); on CUDA also torch's allocated memory and its peak, the
driver's used memory (cudaMemGetInfo, which sees the zero-copy allocations torch does not) and the
pinned host memory. Against `shardprep inspect`'s prediction: R/N + slots + replicated part.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Load (bench_load.py)"
STEPS_SECTION = "## Startup steps (bench_load.py --steps --device {device})"

PRELUDE = r"""
import gc, json, os, sys, threading, time
sys.path.insert(0, {repo!r})

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
"""

PHASE = PRELUDE + r"""
def read_bytes():
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])

import torch  # imported before the baseline is taken: the phases are compared, not torch's import
from safetensors import safe_open
from safetensors.torch import load_file
from shardprep.loader import open_rank
# Imports that a phase would otherwise pay for inside its measurement (dropping the page cache also
# drops these libraries' files): the manifest's schema validator.
import jsonschema
from shardprep.manifests.manifest import manifest_schema
jsonschema.Draft202012Validator(manifest_schema())
if {args!r}["device"].startswith("cuda"):  # the CUDA context's own memory is not the phase's
    torch.zeros(1, device={args!r}["device"])
    torch.empty(1, pin_memory=True)

def touch(tensors):
    # Read one byte of every page: safetensors maps files lazily, and a load that reads nothing is no load.
    n = 0
    for v in tensors:
        flat = v.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu" and flat.numel():
            flat[::4096].sum()
        n += flat.numel()
    return n

anon0, rss0, io0 = status("RssAnon"), status("VmRSS"), read_bytes()
peak, stop = [anon0, rss0], []
def sample():
    while not stop:
        peak[0] = max(peak[0], status("RssAnon"))
        peak[1] = max(peak[1], status("VmRSS"))
        time.sleep(0.001)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t = time.perf_counter()
phase, args = {phase!r}, {args!r}
buffer_bytes = 0
if phase == "full load_file":
    loaded = [load_file(f, device=args["device"]) for f in args["files"]]
    nbytes = touch(v for d in loaded for v in d.values())
elif phase == "targets load_file":
    by_file = {{}}
    for name, f in args["targets"].items():
        by_file.setdefault(f, []).append(name)
    out = {{}}
    for f, names in by_file.items():
        with safe_open(f, "pt", device=args["device"]) as h:
            for n in names:
                out[n] = h.get_tensor(n)
    nbytes = touch(out.values())
else:
    shards = open_rank(args["out"], 0, device=args["device"])
    nbytes = buffer_bytes = touch([shards.buffer])
    if phase == "open_rank + replicated":
        nbytes += touch(shards.load_replicated(args["device"]).values())
if args["device"].startswith("cuda"):
    torch.cuda.synchronize()
seconds = time.perf_counter() - t
stop.append(1)
sampler.join()
peak = [max(peak[0], status("RssAnon")), max(peak[1], status("VmRSS"))]
print(json.dumps({{"seconds": seconds, "read_bytes": read_bytes() - io0, "loaded_bytes": nbytes,
                  "buffer_bytes": buffer_bytes if args["device"] == "cpu" else 0,
                  "anon_peak": peak[0] - anon0, "rss_peak": peak[1] - rss0}}))
"""

STEPS = PRELUDE + r"""
import torch
import torch.distributed as dist
from shardprep.loader import open_rank
from shardprep.runtime import LayerGatherer, make_backend
from shardprep.standalone.hf_model import build_model
from transformers.models.llama import modeling_llama  # imported before the baseline, like everything else

rank, n, args = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), {args!r}
cuda = args["device"] == "cuda"
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
backend = make_backend(args["backend"], None, device)  # its probe and connections: not a startup step
if cuda:
    x = torch.ones(1 << 20, device=device)
    dist.all_gather_into_tensor(torch.empty(n << 20, device=device), x)
    torch.empty(1, pin_memory=True)
    del x
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    alloc0 = torch.cuda.memory_allocated(device)
    def pinned(key):  # torch's pinned host allocator (older torch has no statistics: 0)
        return getattr(torch.cuda, "host_memory_stats", dict)().get(key, 0)
    pinned0 = pinned("allocated_bytes.all.current")
    free0, total = torch.cuda.mem_get_info(device)
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
rss0 = status("VmRSS")
steps = []
def step(name):
    row = {{"step": name, "rss": status("VmRSS") - rss0, "rss_peak": status("VmHWM") - rss0}}
    if cuda:
        torch.cuda.synchronize(device)
        row.update(torch=torch.cuda.memory_allocated(device) - alloc0,
                   torch_peak=torch.cuda.max_memory_allocated(device) - alloc0,
                   device=free0 - torch.cuda.mem_get_info(device)[0],
                   pinned_peak=pinned("allocated_bytes.all.peak") - pinned0)
    steps.append(row)

shards = open_rank(args["out"], rank, n, device=device, verify=True)
step("open_rank")
gatherer = LayerGatherer(shards, backend=backend)
step("LayerGatherer")
binding = build_model(args["out"], device, shards=shards, gatherer=gatherer)
step("build_model (bind + replicated)")
bound = set(binding.target_parameters)
replicated = sum(p.numel() * p.element_size() for name, p in binding.model.named_parameters() if name not in bound)
print(json.dumps({{"rank": rank, "steps": steps, "shard_bytes": shards.nbytes, "slot_bytes": gatherer.slot_bytes,
                  "replicated_bytes": replicated, "zero_copy": gatherer.zero_copy, "backend": gatherer.backend_name}}))
dist.destroy_process_group()
"""

PHASES = ("full load_file", "targets load_file", "open_rank", "open_rank + replicated")
TARGETS = ["*.layers.*.self_attn.*_proj.weight", "*.layers.*.mlp.*_proj.weight"]


def make_checkpoint(root: Path, size_gb: float, hidden: int, inter: int, vocab: int) -> dict[str, int]:
    """Llama-named bf16 tensors in ~500 MB files plus model.safetensors.index.json; returns name → bytes."""
    import torch
    from safetensors.torch import save_file

    kv = hidden // 4
    layer = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
             "post_attention_layernorm.weight": (hidden,)}
    per_layer = sum(_numel(s) for s in layer.values()) * 2
    edges = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
             "model.norm.weight": (hidden,)}
    layers = max(2, round((size_gb * 1e9 - sum(_numel(s) for s in edges.values()) * 2) / per_layer))
    shapes = dict(edges)
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    torch.manual_seed(0)
    noise = torch.randn(1 << 24, dtype=torch.bfloat16)  # tiled: the content does not matter for loading
    files, current, size = [], {}, 0
    for name, shape in shapes.items():
        n = _numel(shape)
        reps = -(-n // noise.numel())
        current[name] = noise.repeat(reps)[:n].reshape(shape).clone()
        size += n * 2
        if size >= 500e6:
            files.append(current)
            current, size = {}, 0
    if current:
        files.append(current)
    root.mkdir(parents=True)
    weight_map = {}
    for k, tensors in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, root / fname, metadata={"format": "pt"})
        weight_map.update({name: fname for name in tensors})
    total = sum(_numel(s) * 2 for s in shapes.values())
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    # Heads of 64 and kv = hidden / 4: a config transformers builds the model of (build_model, --steps).
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "hidden_size": hidden, "intermediate_size": inter,
                                                  "num_hidden_layers": layers, "vocab_size": vocab,
                                                  "num_attention_heads": hidden // 64,
                                                  "num_key_value_heads": hidden // 256,
                                                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return {name: _numel(s) * 2 for name, s in shapes.items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def drop_cache(paths: list[Path], everything: bool) -> str:
    """Evict `paths` from the page cache: POSIX_FADV_DONTNEED per file (only the model's pages go, so
    shared libraries stay cached and do not count as model reads), or with `everything` the whole
    cache through /proc/sys/vm/drop_caches when permitted."""
    os.sync()
    if everything:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "echo 3 > /proc/sys/vm/drop_caches"
        except OSError as exc:
            print(f"drop_caches not permitted ({exc.strerror}); using POSIX_FADV_DONTNEED", file=sys.stderr)
    for p in paths:
        for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "POSIX_FADV_DONTNEED on every file of both checkpoints"


def run_phase(phase: str, args: dict) -> dict:
    code = PHASE.format(repo=str(REPO), phase=phase, args=args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{phase} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_steps(out: Path, ranks: int, device: str, backend: str) -> list[dict]:
    """STEPS on `ranks` fresh processes of one group; each rank's report, in rank order."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = STEPS.format(repo=str(REPO), args={"out": str(out), "device": device, "backend": backend})
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks),
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(ranks)]
    reports = []
    for r, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=1200)
        if proc.returncode:
            raise RuntimeError(f"rank {r} failed:\n{stderr[-3000:]}")
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", action="store_true", help="what each rank holds after each startup step")
    p.add_argument("--backend", default="auto", help="--steps: the gather backend")
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--drop-caches", action="store_true", help="cold = drop the whole page cache, not just the files")
    p.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--write-docs", action="store_true",
                   help=f"replace '{SECTION}' (with --steps, its own section per device) in docs/benchmarks.md")
    a = p.parse_args(argv)
    command = "python3 benchmarks/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:])

    sys.path.insert(0, str(REPO))
    from shardprep.prep.convert import convert

    work = Path(tempfile.mkdtemp(prefix="bench_load_", dir=a.workdir))
    try:
        src, out = work / "src", work / "out"
        t = time.perf_counter()
        sizes = make_checkpoint(src, a.size_gb, a.hidden, a.intermediate, a.vocab)
        made = time.perf_counter() - t
        t = time.perf_counter()
        summary = convert(src, out, a.ranks, targets=TARGETS, preset="llama")
        converted = time.perf_counter() - t
        if a.steps:
            from shardprep.prep.inspect import inspect

            predicted = inspect(out)
            report = {"command": command, "machine": machine(), "ranks": a.ranks, "device": a.device,
                      "checkpoint": {"bytes": sum(sizes.values()), "target_bytes": summary.target_bytes,
                                     "rank_file_bytes": summary.rank_file_bytes,
                                     "replicated_bytes": summary.replicated_bytes},
                      "predicted": {"slot_model": predicted["slot_model"], **predicted["capacity"]},
                      "ranks_report": run_steps(out, a.ranks, a.device, a.backend)}
            text = steps_markdown(report)
            print(text)
            if a.json:
                Path(a.json).write_text(json.dumps(report, indent=1))
            if a.write_docs:
                write_section(REPO / "docs" / "benchmarks.md", text, STEPS_SECTION.format(device=a.device))
            return 0
        weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        from shardprep.manifests import load_manifest

        m = load_manifest(out)
        targets = {n: str(src / weight_map[n]) for n in m.target_names()}
        args = {"files": [str(src / f) for f in sorted(set(weight_map.values()))], "targets": targets,
                "out": str(out), "device": a.device}
        results, how = {}, None
        for phase in PHASES:
            how = drop_cache([src, out], a.drop_caches)
            cold = run_phase(phase, args)
            warm = run_phase(phase, args)
            results[phase] = {"cold": cold, "warm": warm}
            print(f"{phase}: cold {cold['seconds']:.2f} s, read {cold['read_bytes'] / 1e6:.0f} MB, "
                  f"anon peak {cold['anon_peak'] / 1e6:.0f} MB; warm {warm['seconds']:.2f} s", flush=True)
        report = {
            "command": command,
            "machine": machine(),
            "checkpoint": {"bytes": sum(sizes.values()), "tensors": len(sizes), "layers": len(m.layers) + 1,
                           "target_bytes": summary.target_bytes, "rank_file_bytes": summary.rank_file_bytes,
                           "replicated_bytes": summary.replicated_bytes, "make_s": made, "convert_s": converted},
            "ranks": a.ranks, "device": a.device, "cache_drop": how, "phases": results,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = markdown(report)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.write_docs:
        write_section(REPO / "docs" / "benchmarks.md", text)
    return 0


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return f"{os.cpu_count()} × {cpu}, {mem / 2**20:.0f} GiB RAM, Python {platform.python_version()}"


def markdown(r: dict) -> str:
    c = r["checkpoint"]
    ph = r["phases"]
    full = ph["full load_file"]
    mb = 1e6

    def ratio(a, b):
        return f"{a / b:.3f}" if b else "–"

    lines = [
        SECTION, "",
        f"Command: `{r['command']}`", "",
        f"Machine: {r['machine']}; device `{r['device']}`; page cache dropped with {r['cache_drop']}. "
        "Absolute times on this small machine say little; the ratios are the result.", "",
        f"Checkpoint: {c['bytes'] / 1e9:.2f} GB bf16, {c['tensors']} tensors, {c['layers']} layers; targets "
        f"{c['target_bytes'] / 1e9:.2f} GB (attention + MLP of layers 1-), converted for {r['ranks']} ranks "
        f"(rank file {c['rank_file_bytes'] / mb:.0f} MB) in {c['convert_s']:.1f} s.", "",
        "| phase | loaded MB | cold s | read from disk MB | peak RSS MB | peak RssAnon MB | RssAnon beyond the "
        "CPU buffer MB | warm s | read / full | time / full (cold) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, v in ph.items():
        cold, warm = v["cold"], v["warm"]
        lines.append(f"| {name} | {cold['loaded_bytes'] / mb:.0f} | {cold['seconds']:.2f} | "
                     f"{cold['read_bytes'] / mb:.0f} | {cold['rss_peak'] / mb:.0f} | {cold['anon_peak'] / mb:.0f} | "
                     f"{(cold['anon_peak'] - cold['buffer_bytes']) / mb:.0f} | {warm['seconds']:.2f} | "
                     f"{ratio(cold['read_bytes'], full['cold']['read_bytes'])} | "
                     f"{ratio(cold['seconds'], full['cold']['seconds'])} |")
    t, o = ph["targets load_file"]["cold"], ph["open_rank"]["cold"]
    lines += ["", f"Sharded part alone (open_rank vs load_file of the same targets, cold): "
              f"{ratio(o['read_bytes'], t['read_bytes'])}× the bytes read, {ratio(o['seconds'], t['seconds'])}× "
              f"the time (1/{r['ranks']} = {1 / r['ranks']:.3f}). Peak RSS counts mapped file pages: safetensors "
              "returns CPU tensors over its file mapping (page cache, no anonymous memory), while open_rank "
              "copies into one buffer, which on a CPU device is anonymous memory by design; on a GPU device "
              "only the pinned staging buffer is."]
    return "\n".join(lines) + "\n"


def steps_markdown(r: dict) -> str:
    mb = 1e6
    pred = r["predicted"]
    cuda = r["device"] == "cuda"
    lines = [
        STEPS_SECTION.format(device=r["device"]), "",
        f"Command: `{r['command']}`", "",
        f"Machine: {r['machine']}. Checkpoint {r['checkpoint']['bytes'] / mb:.0f} MB bf16, targets "
        f"{r['checkpoint']['target_bytes'] / mb:.0f} MB, {r['ranks']} ranks (rank file "
        f"{r['checkpoint']['rank_file_bytes'] / mb:.1f} MB).", "",
        f"`inspect` predicts, for a CUDA device (slots: {pred['slot_model'].split(':')[0]}): startup peak on the "
        f"device {pred['startup_peak_bytes'] / mb:.1f} MB (rank file + slots + replicated part "
        f"{pred['replicated_part_bytes'] / mb:.1f} MB), host staging {pred['staging_bytes'] / mb:.0f} MB (pinned).", "",
        "| rank | step | host RSS MB | host peak MB |" + (" torch MB | torch peak MB | device used MB | "
                                                            "pinned peak MB |" if cuda else ""),
        "|---|---|---|---|" + ("---|---|---|---|" if cuda else ""),
    ]
    for rep in r["ranks_report"]:
        for row in rep["steps"]:
            cells = [rep["rank"], row["step"], f"{row['rss'] / mb:.1f}", f"{row['rss_peak'] / mb:.1f}"]
            if cuda:
                cells += [f"{row[k] / mb:.1f}" for k in ("torch", "torch_peak", "device", "pinned_peak")]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    rep = r["ranks_report"][0]
    lines += ["", f"Rank 0 holds: rank file {rep['shard_bytes'] / mb:.1f} MB, slots {rep['slot_bytes'] / mb:.1f} MB "
              f"({rep['backend']}, zero copy {'on' if rep['zero_copy'] else 'off'}), replicated parameters "
              f"{rep['replicated_bytes'] / mb:.1f} MB."]
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str, section: str = SECTION) -> None:
    """Replace (or append) the section starting at `section`, up to the next `## ` heading."""
    header = "# Benchmarks\n\nEvery figure here comes with the command that produced it.\n"
    old = path.read_text() if path.exists() else header
    start = old.find(section)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(section))
        new = old[:start] + text + (old[end + 1:] if end >= 0 else "")
    path.write_text(new)


if __name__ == "__main__":
    sys.exit(main())
