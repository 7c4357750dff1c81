"""The optional dependencies a command needs (pyproject.toml's extras), checked before it imports them: a
torch-free install then says in one line which extra to add, not a 40-line ModuleNotFoundError."""

from __future__ import annotations

import importlib.util

from ..errors import ShardprepError

EXTRAS = {"runtime": ("torch",), "hf": ("torch", "transformers")}
"""pyproject.toml's extras, by the modules whose absence each one fixes."""


def require_extra(command: str, extra: str) -> None:
    """Refuse `shardprep COMMAND` in one line when a module of `extra` is not installed.

    >>> require_extra("plan", "runtime")  # doctest: +SKIP
    """
    missing = [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]
    if missing:
        raise ShardprepError(
            f"`shardprep {command}` needs {' and '.join(missing)}, which this install lacks: add shardprep's "
            f"`{extra}` extra, `python3 -m pip install '.[{extra}]'` in the shardprep repository (a CPU-only torch "
            "first, to skip the CUDA download: README, Install)")
