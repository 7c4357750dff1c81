"""`shardprep presets`: the shipped presets, their descriptions, globs and the servers each was checked with."""

from __future__ import annotations

from typing import Annotated

import typer

from ._errors import cli_errors
from ._format import print_json
from ._help import Debug

SCHEMA = "shardprep/presets/1"


def presets_command(
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")] = False,
    debug: Debug = False,
) -> None:
    """List the built-in presets (for `convert --preset NAME`): globs, fused views, servers checked with."""
    from ..prep.selection import QUANTIZED_WEIGHTS, builtin_presets, load_preset

    with cli_errors():
        presets = [load_preset(name) for name in builtin_presets()]
    if json_out:
        print_json({"schema": SCHEMA, "presets": [
            {"name": p.name, "description": p.description, "model_types": list(p.model_types),
             "targets": list(p.targets),
             "fused": [{"name": f.name, "members": list(f.members)} for f in p.fused],
             "quantized_weights": list(QUANTIZED_WEIGHTS), "unnumbered_layers": dict(p.unnumbered_layers),
             "checked_with": [{"server": c.server, "mode": c.mode, "test": c.test, "model_types": list(c.model_types)}
                              for c in p.checked_with]}
            for p in presets]})
        return
    for p in presets:
        typer.echo(f"{p.name}: {p.description}")
        typer.echo(f"    for model types (config.json's model_type): {', '.join(p.model_types) or 'any'}")
        for glob in p.targets:
            typer.echo(f"    {glob}")
        for f in p.fused:
            typer.echo(f"    fused {f.name} = {' + '.join(f.members)}")
        for name, index in p.unnumbered_layers:
            typer.echo(f"    {name}.* is layer {index}")
        typer.echo(f"    and of each ….weight, glob or fused view, the same module's "
                   f"{', '.join(f'….{q}' for q in QUANTIZED_WEIGHTS)} (quantized checkpoints)")
        typer.echo(f"    checked with: {', '.join(map(str, p.checked_with)) or 'nothing'}"
                   + (f" (on {', '.join(sorted({t for c in p.checked_with for t in c.model_types}))})"
                      if p.checked_with else ""))
