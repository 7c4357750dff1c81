"""fla-core's pure-torch KDA, the independent formulation both K3 test plugins (vLLM's k3_kernels.py, SGLang's
k3_ops.py) are checked against: `naive.py` loaded from its file, and its two torch gates taken from `gate.py`'s
source (the rest of fla's modules import Triton, which neither venv has); the inputs both op tests feed a plugin and
fla alike, and fla's answer in the servers' state layout.
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


H, K = 2, 32
"""Heads and head dimension of the op tests' inputs."""
TOL = {"rtol": 1e-4, "atol": 1e-5}


def raw_inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """What a K3 KDA layer hands the KDA ops (SGLang's KDA backend, vLLM's KimiK3DeltaAttention), in float32:
    post-conv q, k, v [1, T, H, K], the raw gate projection, the raw beta logits [1, T, H], A_log [H] and dt_bias
    [H·K]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)
    return {"q": rand(1, tokens, H, K), "k": rand(1, tokens, H, K), "v": rand(1, tokens, H, K),
            "raw_g": rand(1, tokens, H, K) * 2, "raw_beta": rand(1, tokens, H), "A_log": rand(H) * 0.5,
            "dt_bias": rand(H * K) * 0.5}


def fla_kda(naive: ModuleType, gates: dict, x: dict, span: slice, state: torch.Tensor | None,
            lower_bound: float | None, chunk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's naive KDA over tokens `span` of `x` from `state` ([H, V, K], both servers' layout): (output [T, H, V],
    final state [H, V, K])."""
    # fla's naive KDA takes q and k normalized; the servers' kernels normalize them as x / sqrt(sum(x²) + 1e-6).
    q, k = (x[n][:, span] / torch.sqrt((x[n][:, span] ** 2).sum(-1, keepdim=True) + 1e-6) for n in ("q", "k"))
    if lower_bound is None:
        g = gates["naive_kda_gate"](x["raw_g"], x["A_log"], x["dt_bias"])
    else:
        g = gates["naive_kda_lowerbound_gate"](x["raw_g"], x["A_log"], x["dt_bias"], lower_bound)
    beta = torch.sigmoid(x["raw_beta"][:, span])
    initial = None if state is None else state.transpose(-1, -2)[None].clone()
    kda = naive.naive_chunk_kda if chunk else naive.naive_recurrent_kda
    out, final = kda(q, k, x["v"][:, span], g[:, span], beta, initial_state=initial, output_final_state=True)
    return out[0], final[0].transpose(-1, -2)
