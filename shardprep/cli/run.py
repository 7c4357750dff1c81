"""`shardprep run DIR [--nproc N]` (also what `torchrun -m shardprep.run DIR` parses)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from ._errors import cli_errors


def run_command(
    directory: Annotated[Path, typer.Argument(help="Output directory of `shardprep convert`.")],
    nproc: Annotated[int | None, typer.Option(help="Local ranks to start (default: the manifest's world size). "
                                                   "Leave out under torchrun.")] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt; repeatable. Prompt i runs "
                                                     "on rank i mod N.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-k", min=1,
                                                help="Tokens to generate greedily (causal LMs).")] = 16,
    device: Annotated[str, typer.Option(help="auto, cpu (gloo) or cuda (NCCL, GPU = local rank).")] = "auto",
    backend: Annotated[str, typer.Option(help="Gather backend: auto, ce, nccl, nccl-symm or gloo.")] = "auto",
    save_outputs: Annotated[Path | None, typer.Option(help="Rank 0 torch.saves the prompt's output: logits "
                                                      "(causal LMs) or last_hidden_state (encoders).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print token ids, texts and per-rank bytes as JSON.")]
    = False,
) -> None:
    """Run prompts on N local ranks from a pre-sharded directory; rank 0 prints the generated text."""
    from ..run import DEFAULT_PROMPT, RunOptions, is_torchrun_worker, run

    options = RunOptions(directory, tuple(prompt or (DEFAULT_PROMPT,)), max_new_tokens, device, backend,
                         save_outputs, json_out)
    with cli_errors():
        run(options, nproc)
    if is_torchrun_worker():
        # A worker whose job is done leaves without interpreter teardown: destroying torch's gloo process
        # group objects during it raced with their C++ threads ("terminate called without an active
        # exception", abort, about one run in six of tests/test_run.py), failing a run that had finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
