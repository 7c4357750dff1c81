"""`shardprep run DIR [--nproc-per-node P] [--nnodes M --node-rank k --rdzv-endpoint HOST:PORT]` (also what
`torchrun -m shardprep.run DIR` parses)."""

from __future__ import annotations

import json
import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ._errors import EXIT_ERROR, cli_errors, print_error
from ._extras import require_extra
from ._format import human_bytes, step_progress
from ._help import Debug, PlainHelpCommand

if TYPE_CHECKING:
    from ..standalone.runner import RunReport


class Device(str, Enum):
    """Where the ranks run."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Backend(str, Enum):
    """Gather backends (the runner's BACKEND_CHOICES; kept here so `--help` never imports torch)."""

    AUTO = "auto"
    CE = "ce"
    NCCL = "nccl"
    NCCL_SYMM = "nccl-symm"
    GLOO = "gloo"


def run_command(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Output directory of `shardprep convert`.")],
    nproc: Annotated[int | None, typer.Option("--nproc", "--nproc-per-node", metavar="P",
                                              help="Ranks to start on this node (default: the manifest's N). "
                                                   "Leave out under torchrun.")] = None,
    nnodes: Annotated[int | None, typer.Option("--nnodes", metavar="M", min=1,
                                               help="Nodes of the run, each started with this command and its "
                                                    "--node-rank (default 1).")] = None,
    node_rank: Annotated[int | None, typer.Option("--node-rank", metavar="K", min=0,
                                                  help="This node's rank, 0..M-1: it holds ranks K·P..K·P+P-1.")]
    = None,
    rdzv_endpoint: Annotated[str | None, typer.Option("--rdzv-endpoint", metavar="HOST:PORT",
                                                      help="Where the nodes meet: an address of node 0, the same "
                                                           "on every node (needed with --nnodes > 1).")] = None,
    shard_group_size: Annotated[int | None, typer.Option(
        "--shard-group-size", metavar="N", min=1, help="Ranks per shard group: the ranks that gather together "
                                                       "(default and only value: the manifest's N).")] = None,
    allow_cross_node_groups: Annotated[bool, typer.Option(
        "--allow-cross-node-groups", help="Accept a shard group whose ranks run on several nodes (its gathers "
                                          "cross the network).")] = False,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", metavar="TEXT",
                                                     help="Prompt; repeatable. Prompt i runs on rank i mod W "
                                                          "(W = M·P ranks).")]
    = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-k", min=1, metavar="K",
                                                help="Tokens to generate greedily (causal LMs).")] = 16,
    device: Annotated[Device, typer.Option(help="cpu: gloo; cuda: one GPU per local rank.")] = Device.AUTO,
    backend: Annotated[Backend, typer.Option(help="Gather backend (auto picks the best that works).")]
    = Backend.AUTO,
    save_outputs: Annotated[Path | None, typer.Option(metavar="FILE", help="Rank 0 torch.saves the prompt's "
                                                      "output: logits (causal LMs) or last_hidden_state.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print token ids, texts and per-rank bytes as JSON "
                                                          "(schema shardprep/run-report/1).")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Let transformers run model code "
                                                                                "shipped in DIR.")] = False,
    debug: Debug = False,
) -> None:
    """Run prompts on ranks in shard groups of N from a pre-sharded directory; rank 0 prints the generated text."""
    with cli_errors():
        require_extra("run", "hf")
    from ..standalone.runner import DEFAULT_PROMPT, RunOptions, is_torchrun_worker, run

    started = time.perf_counter()
    options = RunOptions(directory, tuple(prompt or (DEFAULT_PROMPT,)), max_new_tokens, device.value, backend.value,
                         save_outputs, json_out, trust_remote_code, shard_group_size, allow_cross_node_groups)
    worker = is_torchrun_worker()
    if not worker and not json_out and sys.stderr.isatty():
        # The ranks are processes of their own: until rank 0's bar shows, say that they are starting.
        typer.echo("starting the ranks (`python -m shardprep.run`); rank 0 shows its progress", err=True)
    with (cli_errors(report_worker_failure if worker else print_error),
          step_progress(worker and os.environ.get("RANK") == "0" and not json_out) as progress):
        report = run(options, nproc, nnodes, node_rank, rdzv_endpoint, on_peer_failure=leave_with_peer_failure,
                     progress=progress)
    if report is not None:
        print_report(report, json_out, time.perf_counter() - started)
    if worker:
        # A worker whose job is done leaves without interpreter teardown: destroying torch's gloo process
        # group objects during it raced with their C++ threads ("terminate called without an active
        # exception", abort, about one run in six of tests/standalone/test_run.py), failing a run that had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def report_worker_failure(line: str) -> None:
    """A worker's failure line: handed to its agent, which prints it (`shardprep run`: one line per node, not
    one per rank), or printed here too under another launcher (torchrun prints only its own summary)."""
    from ..standalone.launch import AGENT_PRINTS_FAILURES, hand_to_agent

    hand_to_agent(line)
    if not os.environ.get(AGENT_PRINTS_FAILURES):
        print_error(line)


def leave_with_peer_failure(line: str) -> None:
    """Another rank failed first (called from the runner's watching thread): report its line and end this
    process now, whatever its main thread is blocked in."""
    report_worker_failure(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_ERROR)


def print_report(report: RunReport, as_json: bool, seconds: float | None = None) -> None:
    """Rank 0's results: one line per prompt and a summary line (ranks, memory, rank 0's seconds), or one JSON
    document."""
    if as_json:
        print(json.dumps(report.to_dict()), flush=True)
        return
    for r in report.results:
        if r.token_ids:
            print(f"{r.prompt} → {r.text}", flush=True)
        else:
            print(f"{r.prompt} → output {r.output_shape}", flush=True)
    r0 = report.ranks[0]
    groups = len(report.ranks) // report.group_size if report.group_size else 1
    in_groups = f" in {groups} shard groups of {report.group_size}" if groups > 1 else ""
    print(f"[{len(report.ranks)} ranks on {r0.device.split(':')[0]}{in_groups}, gather backend {r0.backend}; "
          f"rank 0 holds {human_bytes(r0.shard_bytes)} of shards, {human_bytes(r0.slot_bytes)} of gather slots and "
          f"{human_bytes(r0.parameter_bytes)} of replicated parameters"
          + (f"; {seconds:.1f} s]" if seconds is not None else "]"), flush=True)


def main() -> None:
    """`python -m shardprep.run DIR ...` (what torchrun starts): the options of `shardprep run`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(cls=PlainHelpCommand)(run_command)
    app()
