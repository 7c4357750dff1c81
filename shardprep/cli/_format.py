"""Shared CLI presentation: byte sizes, JSON output, the progress bar."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ..planning.accounting import human_bytes as human_bytes  # one byte formatter for the library and the CLI
from ..planning.expert_parallel import GPU_HBM_GB

# Options that several commands take, declared once so that their checks and help agree.
NumSlots = Annotated[int, typer.Option(min=1, metavar="N", help="Gather slots the runtime keeps.")]
KvDtype = Annotated[str, typer.Option(
    metavar="DTYPE", help="KV-cache dtype: auto (the model's), bf16, fp16, fp8, fp32.")]
ContextLen = Annotated[int, typer.Option(
    min=1, metavar="TOKENS", help="Context length of one request, for the extra requests the saving allows.")]
HbmGb = Annotated[float | None, typer.Option(
    metavar="GB", help="HBM per GPU in GB (10^9 bytes); default 141 (an H200), or give --gpu.")]
Gpu = Annotated[str | None, typer.Option(
    metavar="NAME", help="The GPU, for its HBM instead of --hbm-gb, in GB: "
    + ", ".join(f"{name} {gb:g}" for name, gb in GPU_HBM_GB.items()) + ".")]
Ep = Annotated[int, typer.Option(
    "--ep", min=1, metavar="E", help="Expert-parallel ranks each MoE layer's routed experts are split over, as "
    "vLLM and SGLang place them (default 1: every GPU holds every expert).")]
Tp = Annotated[int, typer.Option(
    "--tp", min=1, metavar="T", help="Tensor-parallel size; sharded mode is DP attention, so only 1.")]
Dp = Annotated[int | None, typer.Option(
    "--dp", min=1, metavar="W", help="Data-parallel ranks W, in shard groups of N consecutive ranks (default: one "
    "group, W = N).")]
GpusPerNode = Annotated[int, typer.Option(
    "--gpus-per-node", min=1, metavar="G", help="GPUs (ranks) per node: a shard group should stay inside one.")]
AllowPresetMismatch = Annotated[bool, typer.Option(
    "--allow-preset-mismatch", help="Use --preset on a checkpoint of a model type it is not for, or where it selects "
    "under half of what that type's preset does (refused otherwise).")]
ChunkAlignment = Annotated[str, typer.Option(
    metavar="auto|none|SIZE", help="C is a multiple of this and chunks start on it (SIZE like 2MiB, for the "
    "zero-copy runtime); auto: 2MiB when its padding costs <= 1% of Σ|T| per rank, else none (16 bytes).")]


def kind_runs(kinds_by_layer: dict[int, dict[str, int]]) -> list[str]:
    """Which kinds of target each layer holds, one line per run of consecutive layers holding the same kinds (the
    bytes per kind are in `kind_totals_line`): a table cell of them per layer would not fit 80 columns.

    >>> kind_runs({1: {"MLA": 8, "MoE periphery": 4}, 2: {"MLA": 8, "MoE periphery": 4}, 3: {"KDA": 2}})
    ['targets of layers 1-2: MLA + MoE periphery', 'targets of layer 3: KDA']
    """
    runs: list[tuple[list[int], tuple[str, ...]]] = []
    for layer, kinds in sorted(kinds_by_layer.items()):
        names = tuple(kinds)
        if runs and runs[-1][1] == names and runs[-1][0][-1] == layer - 1:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], names))
    return [f"targets of layer{'s' if len(layers) > 1 else ''} "
            f"{layers[0]}{f'-{layers[-1]}' if len(layers) > 1 else ''}: {' + '.join(names)}"
            for layers, names in runs if names]


def kind_totals_line(kinds: dict[str, dict[str, int]]) -> str:
    """The targets' bytes per kind over all layers (target_kinds.kind_totals), in one line.

    >>> kind_totals_line({"KDA": {"layers": 2, "bytes": 106496, "max_layer_bytes": 53248}})
    'targets by kind: KDA 104.00 KiB in 2 layers (largest 52.00 KiB)'
    """
    return "targets by kind: " + "; ".join(
        f"{kind} {human_bytes(k['bytes'])} in {k['layers']} layers (largest {human_bytes(k['max_layer_bytes'])})"
        for kind, k in kinds.items())


def draft_line(draft: dict[str, Any]) -> str:
    """What the draft's layers cost and save apart from the target's (accounting.draft_account), in one line.

    >>> print(draft_line({"kind": "mtp", "layers": [3], "sharded_bytes": 8192, "resident_bytes": 2048,
    ...                   "saved_bytes": 6144, "target_saved_bytes": 1024}))  # doctest: +NORMALIZE_WHITESPACE
    draft (MTP layer 3): Σ|T| 8.00 KiB, per rank resident 2.00 KiB more, saved 6.00 KiB on top of the
    target's 1.00 KiB; the target alone: convert --layers without 3, or serve without a draft (its layers are
    left unread)
    >>> print(draft_line({"kind": "dflash", "layers": [0, 1], "sharded_bytes": 8192, "resident_bytes": 4096,
    ...                   "saved_bytes": 4096, "target_saved_bytes": None, "max_layer_bytes": 4096,
    ...                   "own_slots_saved_bytes": -8192, "target": {"hidden_size": 64, "vocab_size": 128,
    ...                   "aux_layers": [0, 2], "num_layers": 3}}))  # doctest: +NORMALIZE_WHITESPACE
    draft (a DFlash draft model, layers 0, 1; its target: hidden size 64, vocabulary 128, 3 layers, reads layers
    0, 2): Σ|T| 8.00 KiB, per rank resident 4.00 KiB, saved 4.00 KiB gathered in its target's slots (where the
    target's largest sharded layer is at least its 4.00 KiB: `shardprep plan TARGET --draft DIR` counts both);
    in slots of its own -8.00 KiB
    """
    layers = ", ".join(map(str, draft["layers"]))
    many = "s" if len(draft["layers"]) > 1 else ""
    if "target" not in draft:
        return (f"draft ({draft['kind'].upper()} layer{many} {layers}): Σ|T| {human_bytes(draft['sharded_bytes'])}, "
                f"per rank resident {human_bytes(draft['resident_bytes'])} more, saved "
                f"{human_bytes(draft['saved_bytes'])} on top of the target's "
                f"{human_bytes(draft['target_saved_bytes'])}; the target alone: convert --layers without {layers}, or "
                "serve without a draft (its layers are left unread)")
    facts = draft["target"]
    name = {"dflash": "DFlash", "eagle3": "EAGLE-3"}.get(draft["kind"], draft["kind"])
    known = [f"hidden size {facts['hidden_size']}", f"vocabulary {facts['vocab_size']}"]
    known += [f"{facts['num_layers']} layers"] if "num_layers" in facts else []
    known += [f"reads layers {', '.join(map(str, facts['aux_layers']))}"] if "aux_layers" in facts else []
    head = (f"draft ({'an' if name[0] in 'AEIOU' else 'a'} {name} draft model, layer{many} {layers}; its target: "
            f"{', '.join(known)}): "
            f"Σ|T| {human_bytes(draft['sharded_bytes'])}, per rank resident {human_bytes(draft['resident_bytes'])}")
    if draft["target_saved_bytes"] is None:
        return (f"{head}, saved {human_bytes(draft['saved_bytes'])} gathered in its target's slots (where the "
                f"target's largest sharded layer is at least its {human_bytes(draft['max_layer_bytes'])}: "
                f"`shardprep plan TARGET --draft DIR` counts both); in slots of its own "
                f"{human_bytes(draft['own_slots_saved_bytes'])}")
    together = draft["saved_bytes"] + draft["target_saved_bytes"]
    return (f"{head} more, saved {human_bytes(draft['saved_bytes'])} on top of the target's "
            f"{human_bytes(draft['target_saved_bytes'])}: {human_bytes(together)} together")


def quantization_words(record: dict[str, Any]) -> str:
    """The manifest's `quantization` record (the requant convert did) in words.

    >>> quantization_words({"method": "fp8", "block": [128, 128], "recipe": "sglang", "scale_format": "f32",
    ...                     "scope": "all", "allow_nonfinite": False})
    'block FP8 (128×128 blocks), requantized to UE8M0 scales (float32 powers of two), sglang recipe'
    """
    block = "×".join(str(b) for b in record.get("block", ()))
    scope = ", targets only" if record.get("scope") == "targets" else ""
    scales = "F8_E8M0 tensors" if record.get("scale_format") == "e8m0" else "float32 powers of two"
    nonfinite = ", non-finite values allowed" if record.get("allow_nonfinite") else ""
    method = "block FP8" if record.get("method") == "fp8" else str(record.get("method"))
    return (f"{method} ({block} blocks{scope}), requantized to UE8M0 scales ({scales}), {record.get('recipe')} "
            f"recipe{nonfinite}")


def plain_table(*columns: str, title: str | None = None, show_header: bool = True) -> Any:
    """A rich table for 80 columns: a rule under the header, no side borders, right-aligned numbers."""
    from rich import box
    from rich.table import Table

    table = Table(*columns, title=title, box=box.SIMPLE_HEAD, show_header=show_header, pad_edge=False,
                  title_justify="left")
    for column in table.columns:
        column.justify = "right"
    return table


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextmanager
def byte_progress(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar with bytes and throughput, shown only on a TTY (stderr) when enabled."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class BinarySpeedColumn(ProgressColumn):
        """Throughput in MiB/s, the units of the byte counts beside it (rich's own column gives MB/s)."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               BinarySpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextmanager
def step_progress(enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A rich progress bar of counted steps (`update(what, done, total)`), on a TTY (stderr) when enabled; it
    clears itself at the end, so that the results printed after it stand alone."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("forwards"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def update(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        yield update


_steps_bar: Any = None  # the bar `terminal_steps` draws in this process, while it runs


def terminal_steps(what: str, done: int, total: int) -> None:
    """A progress callback that a process of its own can take (a module-level function: it is pickled by name,
    as `shardprep profile` hands it to its ranks): rank 0 draws a rich bar on its terminal (stderr) and clears
    it at the last step; without a terminal it does nothing."""
    global _steps_bar
    if not sys.stderr.isatty():
        return
    if _steps_bar is None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        _steps_bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        _steps_bar.start()
        _steps_bar.add_task(what, total=total)
    _steps_bar.update(_steps_bar.task_ids[0], description=what, completed=done, total=total)
    if done >= total:
        _steps_bar.stop()
        _steps_bar = None


def parse_token_counts(text: str) -> tuple[int, ...]:
    """'1,16,128' -> (1, 16, 128); a ShardprepError naming the option otherwise."""
    from ..errors import ShardprepError

    try:
        counts = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ShardprepError(f"--tokens {text!r}: expected comma-separated token counts, e.g. 1,16,128") from None
    if not counts or min(counts) < 1:
        raise ShardprepError(f"--tokens {text!r}: expected token counts >= 1")
    return counts


def parse_fraction(text: str, option: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05."""
    from ..errors import ShardprepError

    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ShardprepError(f"{option} {text!r}: expected a percentage (5%) or a fraction (0.05)") from None
    if value < 0:
        raise ShardprepError(f"{option} {text!r}: must not be negative")
    return value


def rank_files_phrase(summary: Any) -> str:
    """"R (chunk alignment A, P of alignment padding per rank)", from a convert or reshard summary."""
    return (f"{human_bytes(summary.rank_file_bytes)} (chunk alignment {human_bytes(summary.chunk_alignment)}, "
            f"{human_bytes(summary.alignment_padding_bytes)} of alignment padding per rank)")


def not_carried_phrase(summary: Any) -> str:
    """"; not carried over, as OUT's manifest does not list them: a, b" of a reshard or export summary, or ""."""
    unlisted = summary.unlisted_files
    if not unlisted:
        return ""
    more = f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else ""
    return f"; not carried over, as {summary.out}'s manifest does not list them: {', '.join(unlisted[:5])}{more}"


def capacity_rows(totals: dict[str, Any], capacity: dict[str, Any], kv: dict[str, Any] | None,
                  experts: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """The per-rank memory and KV-cache lines `plan` and `inspect` both print, as (label, value); `experts`
    (an ExpertShard's dict) adds the routed experts a GPU holds under expert parallelism."""
    experts = experts if experts and experts["ep"] > 1 else None
    n = totals["world_size"]
    rows = [
        ("sharded weights R (held whole on every rank without sharding)", human_bytes(totals["sharded_bytes"])),
        ("local chunks R/N" + (" (padded to the chunk alignment)" if totals["padding_bytes"] else ""),
         human_bytes(totals["local_chunk_bytes"])),
        (f"gather slots {totals['slot_formula']}", human_bytes(totals["slot_bytes"])),
        ("resident with sharding R/N + slots", human_bytes(totals["resident_bytes"])),
        ("memory saved per rank R − R/N − slots", human_bytes(totals["saved_bytes"])),
    ]
    if totals["padding_bytes"]:
        rows.append(("  of which alignment padding", human_bytes(totals["padding_bytes"])))
    rows.append((f"gather bytes received per forward ({n}−1)·Σ C",
                 human_bytes(totals["gather_recv_bytes_per_forward"])))
    rows.append(("replicated part (non-targets, unsharded targets" + ("; not experts)" if experts else ")"),
                 human_bytes(capacity["replicated_part_bytes"])))
    if experts:
        rows.append((f"routed experts per GPU (EP {experts['ep']}: {experts['experts_per_gpu']} of "
                     f"{experts['experts_per_layer']} per layer, {experts['moe_layers']} MoE layers)",
                     human_bytes(capacity["expert_shard_bytes"])))
    rows.append(("startup peak on the GPU: R/N + slots + replicated part" + (" + experts" if experts else ""),
                 human_bytes(capacity["startup_peak_bytes"])))
    rows.append(("  host staging while loading (pinned)", human_bytes(capacity["staging_bytes"])))
    if kv is not None:
        rows.append((f"KV cache per token ({kv['kind']}, {kv['layers']} layers, {kv['dtype']})",
                     human_bytes(kv["bytes_per_token"])))
        rows.append(("KV-cache tokens the saving holds", f"{capacity['kv_tokens']:,}"))
        rows.append((f"extra concurrent requests at {capacity['context_len']:,} tokens of context",
                     f"{capacity['extra_requests']:,}"))
    if capacity["hbm_bytes"] is not None:
        rows.append((f"KV-cache room in {human_bytes(capacity['hbm_bytes'])} of HBM: replicated",
                     human_bytes(capacity["kv_room_replicated_bytes"])))
        rows.append(("  sharded (weights and slots only; activations not counted)",
                     human_bytes(capacity["kv_room_sharded_bytes"])))
    return rows
