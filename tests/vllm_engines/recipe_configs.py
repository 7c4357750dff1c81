"""vLLM's own configuration of each `vllm serve` line of docs/recipes.md, and of the engine arguments an engine test
ran, without starting an engine: what test_vllm_recipes.py compares.

`python tests/vllm_engines/recipe_configs.py IN.json OUT.json` (inside the vLLM virtual environment). IN: {name:
{"serve": [argv after `vllm`], "cpu_only": [arguments added on the CPU; test_vllm_recipes.py says why]} or
{"engine": EngineArgs kwargs} or {"k3": [model, dp_size]} (Kimi K3's, as k3_loading.engine_config builds it)}. A
`serve` line goes through the parser `vllm serve` builds (`ServeSubcommand.subparser_init`, `make_arg_parser`), its
own checks (`validate`), `AsyncEngineArgs.from_cli_args` and `create_engine_config`, which reads the model's
config.json and checks the parallel layout but loads no weight. OUT: {name: the deployment (`deployment`) or
{"error": "Type: message"}}.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support.spawn_group, for k3_loading's port


def deployment(config: Any) -> dict[str, Any]:
    """What a recipe decides of a VllmConfig: load format and its options, the parallel layout, the draft."""
    p, spec = config.parallel_config, config.speculative_config
    extra = dict(config.load_config.model_loader_extra_config or {})
    return {
        "load_format": config.load_config.load_format,
        **{f"extra.{k}": v for k, v in sorted(extra.items())},
        "data_parallel_size": p.data_parallel_size,
        "nodes": p.data_parallel_size // p.data_parallel_size_local,
        "tensor_parallel_size": p.tensor_parallel_size,
        "pipeline_parallel_size": p.pipeline_parallel_size,
        "enable_expert_parallel": p.enable_expert_parallel,
        "speculative": None if spec is None else f"{spec.method} k={spec.num_speculative_tokens}",
    }


def serve_config(argv: list[str], cpu_only: list[str]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subcommand"))
    args = parser.parse_args(argv + cpu_only)
    command.validate(args)
    args.model = args.model_tag or args.model  # what `vllm serve MODEL` does first (ServeSubcommand.cmd)
    found = deployment(AsyncEngineArgs.from_cli_args(args).create_engine_config())
    return {**found, "headless": bool(args.headless), "data_parallel_start_rank": args.data_parallel_start_rank}


def engine_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs

    return deployment(EngineArgs(**kwargs).create_engine_config())


def k3_config(model: str, dp_size: int) -> dict[str, Any]:
    from k3_loading import engine_config as k3_engine_config
    from support.spawn_group import free_port

    return deployment(k3_engine_config(model, "shardprep", {"shard_weights": True}, dp_size, 0, free_port()))


def configure(job: dict[str, Any]) -> dict[str, Any]:
    if "serve" in job:
        return serve_config(job["serve"], job.get("cpu_only", []))
    if "engine" in job:
        return engine_config(job["engine"])
    return k3_config(*job["k3"])


def main(in_path: str, out_path: str) -> None:
    from support.recipes import configure_each

    configure_each(in_path, out_path, configure)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
