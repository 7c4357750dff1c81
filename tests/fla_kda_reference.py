"""fla-core's pure-torch KDA, the independent formulation both K3 test plugins (vLLM's k3_kernels.py, SGLang's
k3_ops.py) are checked against: `naive.py` loaded from its file, and its two torch gates taken from `gate.py`'s
source (the rest of fla's modules import Triton, which neither venv has).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F


def fla_kda_file(name: str) -> Path:
    spec = importlib.util.find_spec("fla")
    assert spec is not None and spec.submodule_search_locations, "fla-core is not installed (.ci/run installs it)"
    return Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / name


def load_fla_kda() -> tuple[ModuleType, dict]:
    """(fla's naive KDA module, a namespace with `naive_kda_gate` and `naive_kda_lowerbound_gate`)."""
    spec = importlib.util.spec_from_file_location("fla_kda_naive", fla_kda_file("naive.py"))
    assert spec is not None and spec.loader is not None
    naive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(naive)
    source = fla_kda_file("gate.py").read_text()
    wanted = {"naive_kda_gate", "naive_kda_lowerbound_gate"}
    functions = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in functions} == wanted
    gates: dict = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=functions, type_ignores=[]), "fla/ops/kda/gate.py", "exec"), gates)
    return naive, gates
