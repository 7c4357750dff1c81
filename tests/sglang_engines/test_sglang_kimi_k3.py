"""Kimi K3 (KDA + MLA + latent MoE) in SGLang 0.5.23 on the CPU with the `kimi-k3` preset, by loading and binding:
K3's forward does not run here (its KDA and short-convolution kernels are Triton), so no token is compared. One
engine under DP attention (`tp_size=2, dp_size=2, enable_dp_attention=True`: attention TP 1, one shard group of two
DP ranks) starts on K3 as published with SGLang's own loader; inside its two scheduler processes the test plugin
k3_load_probe.py loads the same model with shardprep's full mode and sharded mode, and K3's text layout all three
ways, and stops the engine. kimi_k3_build.py lets SGLang build K3 on the CPU (CUDA side streams made inert). The
tests hold the results against each other:

- full mode gives every parameter SGLang's own loader's bytes, and each KDA layer's merged [f_a; b] buffer too,
  for K3 as published (`KimiK3ForConditionalGeneration`: vision tower and projector built by SGLang's own classes
  and saved under the checkpoint's names, the text model under `language_model.*`, its decoder layers as
  `language_model.layers.N`; converted with the `kimi-k3` preset, the output that vLLM serves too) and for K3's
  text layout as SGLang loads one (`KimiK3LinearForCausalLM`, its MoE named `mlp.`);
- sharded mode at DP=2 builds every target without storage and binds SGLang's own parameters: the views of the
  manifest that lie inside vLLM's (fused_qkvg_proj, fused_qkv_a_proj → fused_qkv_a_proj_with_mqa) and the
  shared experts' gate_up_proj, and the entries those leave out (f_a_proj, b_proj, g_proj, f_b_proj, o_proj,
  q_b_proj, the latent projections, where SGLang's mapper puts them); after each layer's gather every bound target
  holds SGLang's own loader's bytes, and so does each KDA layer's merged [f_a; b] buffer, now a view of the
  gathered layer; every other parameter is loaded as SGLang's own loader loads it; each rank's resident target bytes
  are what `shardprep inspect` says;
- the shared experts: SGLang 0.5.23 splits K3's over its TP ranks unless an all-to-all MoE backend runs (none does
  on the CPU), so sharded mode serves a directory converted without them, and refuses the `kimi-k3` output in one
  line saying why.

The widths of the MLPs are 128 and 64 (SGLang on the CPU pads them to a multiple of 32·TP otherwise). Skipped where
SGLang is not installed.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(1800)

from k3_load_probe import ENV, write_published  # noqa: E402
from kimi_k3_build import ENV as BUILD  # noqa: E402
from sglang_runs import run_engines  # noqa: E402
from support.checkpoints import make_kimi_k3_checkpoint  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.inspect import inspect  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

DP = 2
L = 4  # KDA in layers 0, 1, 3, MLA in layer 2; layer 0 dense, replicated
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
WIDTHS = {"intermediate_size": 128, "moe_intermediate_size": 64}


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """(root, the probe's results per DP rank, the engine's log)."""
    root = tmp_path_factory.mktemp("sglang-kimi-k3")
    text = make_kimi_k3_checkpoint(root / "text", layers=L, **WIDTHS)
    published = root / "published"
    write_published(text, published)
    sglang_text = make_kimi_k3_checkpoint(root / "sglang-text", layers=L, sglang_text=True, **WIDTHS)
    preset = load_preset("kimi-k3")
    without = root / "kimi-k3-without-shared-experts.json"
    without.write_text(json.dumps({
        "name": "kimi-k3-without-shared-experts", "targets": [t for t in preset.targets if "shared_experts" not in t],
        "fused": [{"name": r.name, "members": list(r.members), "pad_rows_to": r.row_multiple} for r in preset.fused
                  if "shared_experts" not in r.name]}))
    convert(published, root / "published-out", DP, preset="kimi-k3")
    convert(published, root / "published-sharded", DP, preset=str(without))
    convert(sglang_text, root / "text-out", DP, preset=str(without))
    plan = {"results": str(root / "results{rank}.json"),
            "published": {"full": str(root / "published-out"), "sharded": str(root / "published-sharded"),
                          "refused": str(root / "published-out")},
            "text": {"source": str(sglang_text), "full": str(root / "text-out"), "sharded": str(root / "text-out")}}
    (root / "probe.json").write_text(json.dumps(plan))
    run = {"name": "kimi-k3", "model": str(published), "engine": {**DP_ATTENTION, "enable_multimodal": False},
           "prompts": ["a b"], "max_tokens": [1], "env": {BUILD: "1", ENV: str(root / "probe.json")},
           "refusal": True}  # the probe stops the engine once it has written its results
    _, log = run_engines({"runs": [run]}, root)
    results = []
    for rank in range(DP):
        path = root / f"results{rank}.json"
        assert path.exists(), log[-6000:]
        results.append(json.loads(path.read_text()))
    return root, results, log


def sglang_bound(records) -> set[str]:
    """The manifest names SGLang binds: each view that no other view contains (SGLang fuses fewer tensors than
    vLLM, whose fused parameters hold SGLang's), and each entry those leave out."""
    views = [v for r in records for v in r.views]
    inner = [v for v in views if not any(set(o.members) < set(v.members) for o in views)]
    members = {m for v in inner for m in v.members}
    return {v.name for v in inner} | {e.name for r in records for e in r.entries if e.name not in members}


def test_full_mode_gives_every_parameter_and_merged_buffer_sglangs_own_loaders_bytes(k3):
    _, results, _ = k3
    for rank in results:
        published, text = rank["published"], rank["text"]
        assert (published["class"], text["class"]) == ("KimiK3ForConditionalGeneration", "KimiK3LinearForCausalLM")
        assert published["full_mode_differs"] == [] and text["full_mode_differs"] == []
        # The vision tower and projector are built and loaded (18 parameters here), and the 4-layer text model's
        # parameters are the same in both layouts; the KDA layers' merged [f_a; b] buffers compared too (3).
        assert published["vision_parameters"] > 0 and text["vision_parameters"] == 0
        assert published["parameters"] == text["parameters"] + published["vision_parameters"]
        assert published["merged_buffers"] == text["merged_buffers"] == 3


@pytest.mark.parametrize("layout", ["published", "text"])
def test_sharded_dp2_binds_sglangs_own_parameters_and_each_gather_gives_its_own_loaders_bytes(k3, layout):
    root, results, _ = k3
    manifest = load_manifest(root / ("published-sharded" if layout == "published" else "text-out"))
    expected = sglang_bound(manifest.target_records)
    inside = {name.split(".", 3)[3] for name in expected}
    assert {"self_attn.fused_qkvg_proj.weight", "self_attn.f_a_proj.weight", "self_attn.b_proj.weight",
            "self_attn.fused_qkv_a_proj.weight", "self_attn.g_proj.weight"} <= inside
    for rank in results:
        sharded = rank[layout]["sharded"]
        assert set(sharded["bound"]) == expected
        if layout == "published":  # where SGLang's mapper puts them
            assert all(name == published_model_name(target) for target, name in sharded["bound"].items())
        else:
            assert all(name == target.replace("fused_qkv_a_proj.", "fused_qkv_a_proj_with_mqa.")
                       for target, name in sharded["bound"].items())
        # Built under the linear layers' prefixes: SGLang's wrapper builds its language model without
        # `language_model.` in them.
        assert sharded["built_without_storage"] == sorted(name.removeprefix("language_model.")
                                                          for name in sharded["bound"].values())
        assert set(sharded["gathered_equal"]) == expected and all(sharded["gathered_equal"].values())
        assert sharded["replicated_differs"] == []
        # Each KDA layer's merged [f_a; b] buffer is a view of the gathered layer, with SGLang's own bytes.
        kda = list(sharded["merged_equal"])
        assert len(kda) == 2 and all(sharded["merged_equal"].values())  # layers 1 and 3 (0 stays replicated)
        assert sharded["merged_over_gathered_bytes"] == sorted(kda)
        assert sharded["gathered_layers"] == [1, 2, 3]


def published_model_name(target: str) -> str:
    """SGLang's parameter for a manifest name of K3 as published: KimiK3ForConditionalGeneration's mapper
    (`language_model.layers.` → `language_model.model.layers.`, `block_sparse_moe` → `mlp`), then its fused MLA
    parameter's name."""
    name = target.replace("language_model.layers.", "language_model.model.layers.", 1)
    return name.replace(".block_sparse_moe.", ".mlp.").replace(".fused_qkv_a_proj.", ".fused_qkv_a_proj_with_mqa.")


@pytest.mark.parametrize("layout", ["published", "text"])
def test_each_ranks_resident_target_bytes_are_what_inspect_predicts(k3, layout):
    root, results, _ = k3
    directory = root / ("published-sharded" if layout == "published" else "text-out")
    totals = inspect(directory)["totals"]
    for dp_rank, rank in enumerate(results):
        sharded = rank[layout]["sharded"]
        resident = sharded["local_chunk_bytes"] + sharded["slot_bytes"]
        assert (sharded["local_chunk_bytes"], sharded["slot_bytes"], resident) == (
            totals["local_chunk_bytes"], totals["slot_bytes"], totals["resident_bytes"])
        assert f"DP rank {dp_rank} of {DP}" in sharded["startup_line"]
        assert f"resident target bytes {resident} = R/N {sharded['local_chunk_bytes']}" in sharded["startup_line"]


def test_the_kimi_k3_output_with_its_shared_experts_is_refused_in_one_line_naming_why(k3):
    root, results, _ = k3
    for rank in results:
        refused = rank["published"]["refused"]
        assert refused is not None and "\n" not in refused
        assert (f"{root / 'published-out'}: SGLang splits the target language_model.model.layers.1.mlp."
                "shared_experts.gate_up_proj over its 2 TP ranks") in refused
        assert "only under an all-to-all MoE backend" in refused
