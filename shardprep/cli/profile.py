"""`shardprep profile OUT --nproc N --out profile.json`: measure what `shardprep plan` predicts from."""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ._errors import cli_errors
from ._extras import require_extra
from ._format import parse_token_counts, print_json, terminal_steps
from ._help import Debug
from ._output_file import replaced_on_success
from .run import Backend, Device

if TYPE_CHECKING:
    from ..planning.profile_format import Profile


def profile_command(
    directory: Annotated[Path, typer.Argument(metavar="OUT", help="Output directory of `shardprep convert`.")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="FILE", help="Where to write the profile JSON (schema shardprep/profile/1).")],
    nproc: Annotated[int | None, typer.Option(
        "--nproc", "--nproc-per-node", metavar="N", help="Local ranks, one GPU each (default: the manifest's N).")]
    = None,
    tokens: Annotated[str | None, typer.Option(
        metavar="T,T,...", help="Token counts per step to measure (default 1,16,128,1024,4096; 1,8 with "
                                "--dry-run).")] = None,
    backend: Annotated[list[Backend] | None, typer.Option(
        "--backend", "-b", metavar="auto|ce|nccl|nccl-symm|gloo", help="Gather backend to measure; repeatable "
                                                                     "(default auto).")] = None,
    iters: Annotated[int, typer.Option(min=1, metavar="N", help="Timed calls per measurement (medians kept).")] = 20,
    warmup: Annotated[int, typer.Option(min=0, metavar="N", help="Untimed calls before each measurement.")] = 3,
    device: Annotated[Device, typer.Option(help="cuda: NCCL, one GPU per local rank; cpu: gloo.")] = Device.AUTO,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="CPU + gloo, 2 iterations: checks the whole path on a tiny model; the times mean nothing.")]
    = False,
    eager: Annotated[bool, typer.Option(
        "--eager", help="Time eager forwards instead of CUDA-graph replays (CUDA; the CPU is always eager).")]
    = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the profile JSON instead of tables.")] = False,
    trace: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Also write rank 0's torch.profiler trace of one sharded step per token count (Chrome "
                             "trace JSON for ui.perfetto.dev or chrome://tracing).")] = None,
    debug: Debug = False,
) -> None:
    """Time each layer's compute (replicated weights, in CUDA-graph replays on CUDA), each backend's gathers and
    the HBM interference between them, on the real model bound to the real GPUs; write them for
    `shardprep plan --profile`."""
    with cli_errors():
        require_extra("profile", "hf")
    from ..standalone.profile import ProfileOptions, profile

    with cli_errors(), ExitStack() as stack:
        counts = parse_token_counts(tokens) if tokens else None
        if dry_run:
            options = ProfileOptions.for_dry_run(counts)
        else:
            backends = tuple(b.value for b in backend or [Backend.AUTO])
            options = ProfileOptions(tokens=counts or ProfileOptions.tokens, backends=backends, iters=iters,
                                     warmup=warmup, device=device.value, graphs=not eager)
        if trace is not None:
            part = stack.enter_context(replaced_on_success(trace, "--trace"))
            options = dataclasses.replace(options, trace_path=str(part))
        if not json_out and sys.stderr.isatty():
            typer.echo("starting the ranks; rank 0 shows the measurements as they are done", err=True)
            options = dataclasses.replace(options, progress=terminal_steps)
        result = profile(directory, nproc, options)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if json_out:
        print_json(result.to_dict())
    else:
        print_profile(result, out)


def print_profile(p: Profile, path: Path | None = None) -> None:
    """The profile as tables: per layer compute and gathers, per backend bandwidth, interference, steps."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    where = f" → {path}" if path else ""
    title = f"{p.source or 'profile'} on {p.world_size} × {p.device}{' (dry run)' if p.dry_run else ''}{where}"
    mode = "CUDA-graph replays" if p.compute_mode == "cuda-graph" else "eager forwards"
    if p.compute_mode_note:
        mode += f": {p.compute_mode_note}"
    layers = Table(title=title + f"\ncompute per layer with replicated weights (ms, {mode}); gather alone (ms)")
    layers.add_column("layer", justify="right")
    for t in p.tokens:
        layers.add_column(f"{t} tok", justify="right")
    for b in p.backends:
        layers.add_column(f"gather {b.name}", justify="right")
    rows = [("before", p.head_ms, None)] + [(str(lay.layer), lay.compute_ms, lay.layer) for lay in p.layers]
    rows.append(("after", p.tail_ms, None))
    for label, compute, index in rows:
        gathers = [f"{b.gather_ms[index]:.3f}" if index in b.gather_ms else "" for b in p.backends]
        layers.add_row(label, *(f"{ms:.3f}" for ms in compute), *gathers)
    layers.add_row("step", *(f"{ms:.3f}" for ms in p.replicated_step_ms), *("" for _ in p.backends))
    console.print(layers)
    for b in p.backends:
        table = Table(title=f"{b.name}: gather-only {b.gather_only_ms:.3f} ms per forward, "
                            f"{b.recv_gbps:.3g} GB/s received")
        table.add_column("tokens", justify="right")
        for col in ("compute slowdown κ", "gather slowdown λ", "replicated ms", "sharded ms", "sharded / replicated"):
            table.add_column(col, justify="right")
        for i, t in enumerate(p.tokens):
            rep, shd = p.replicated_step_ms[i], b.sharded_step_ms[i]
            table.add_row(str(t), f"{b.compute_slowdown[i]:.3f}", f"{b.gather_slowdown[i]:.3f}", f"{rep:.3f}",
                          f"{shd:.3f}", f"{shd / rep:.3f}" if rep > 0 else "")
        console.print(table)
