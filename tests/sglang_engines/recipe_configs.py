"""SGLang's own configuration (ServerArgs) of each `launch_server` line of docs/recipes.md, and of the engine
arguments an engine test ran, without starting anything: what test_sglang_recipes.py compares.

`python tests/sglang_engines/recipe_configs.py IN.json OUT.json` (inside the SGLang virtual environment, with
stand_ins/ on PYTHONPATH for `sgl_kernel`). IN: {name: {"launch": [arguments after `-m sglang.launch_server`]} or
{"engine": ServerArgs kwargs, as sgl.Engine passes them}}. A `launch` line goes through `prepare_server_args`, what
`launch_server` parses its command line with, after SGLang has loaded its plugins (shardprep's adds
`--load-format shardprep`). OUT: {name: the deployment (`deployment`) or {"error": "Type: message"}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIELDS = ("load_format", "tp_size", "dp_size", "enable_dp_attention", "ep_size", "pp_size", "nnodes", "node_rank",
          "dist_init_addr", "trust_remote_code", "speculative_algorithm", "speculative_draft_model_path",
          "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")


def deployment(args: Any) -> dict[str, Any]:
    """What a recipe decides of ServerArgs: load format and its options, the parallel layout, the nodes, the
    draft."""
    extra = args.model_loader_extra_config
    extra = json.loads(extra) if isinstance(extra, str) else dict(extra or {})
    return {**{f: getattr(args, f) for f in FIELDS}, **{f"extra.{k}": v for k, v in sorted(extra.items())}}


def main(in_path: str, out_path: str) -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as launch_server does first: shardprep's plugin adds its load format to the choices
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support.recipes
    from support.recipes import configure_each

    configure_each(in_path, out_path, lambda job: deployment(prepare_server_args(job["launch"]) if "launch" in job
                                                             else ServerArgs(**job["engine"])))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
