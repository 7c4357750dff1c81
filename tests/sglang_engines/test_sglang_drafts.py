"""Drafts in SGLang 0.5.23's sharded mode, by building and loading (no SGLang draft runs a forward on the CPU),
at DP=2 under DP attention (`tp_size=dp_size=2, enable_dp_attention`), each rank's directories holding only its own
rank files. draft_loading.py builds the target and the draft in each of two processes as SGLang's scheduler does
(the target's TpModelWorker, then the speculative worker, which builds the draft's ModelRunner with its own load
format and path), three ways: SGLang's own loader from the source checkpoints, shardprep's full mode, shardprep's
sharded mode; one launch for everything.

- NEXTN, a tiny DeepSeek-V3 with its MTP layer as DeepSeek publishes it (`deepseek-v3-published-mtp`; layer L = 4
  after 4 decoder layers), `--preset deepseek-v3` at N = 2: SGLang builds `DeepseekV3ForCausalLMNextN` from the
  target's own directory, its MTP layer as `model.decoder`. Full mode gives every target and draft parameter SGLang's
  own loader's bytes; sharded mode builds the draft's targets without storage, binds them to `model.decoder` (q_a and
  kv_a to SGLang's `fused_qkv_a_proj_with_mqa`) after the target's layers, and every gather, the target's and the
  draft's, gives those bytes.
- DFLASH, a tiny DFlash draft (z-lab's layout, three layers) of a tiny Qwen3-MoE, each converted for N = 2: SGLang
  builds `DFlashDraftModel`, q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj` like vLLM's (the `dflash`
  preset's fused views bind to them); full mode = SGLang's loader; sharded mode binds the draft's layers after the
  target's, in the target's gatherer over the joined buffer, every gather gives SGLang's loader's bytes, and the
  context K/V projection SGLang's DFlash worker computes between the target's forward and the draft's layers
  (`kv_proj_only`, reading each layer's K/V rows outside the layer) gives full mode's, from a resident copy
  (`SglangAdapter.copy_draft_weights_at_load`; without it, with three draft layers and two slots, it reads other
  layers' bytes). SGLang refuses DFLASH on the CPU while resolving its arguments: the test plugin dflash_on_cpu.py
  lets it resolve, only to build and load.
- Each rank's draft startup line gives the draft's resident and saved bytes as `inspect` / `draft_account` do.
- Refused in one line: a DFlash draft as published (no shard_manifest.json) beside a sharded target, saying to
  convert it (it cannot be loaded apart there: with `speculative_draft_load_format="auto"` SGLang gives the draft
  the target's `model_loader_extra_config`, and its own loader refuses `shard_weights`, checked too; beside a
  target in full mode it loads apart, whole); and a draft whose MLP SGLang pads on the CPU.

Kimi K3 has no NextN/MTP draft in SGLang 0.5.23 (its speculative decoding is DSPARK, a draft model of its own):
nothing to bind there. Skipped where SGLang is not installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.engine_harness import run_per_rank

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(1800)

import dflash_on_cpu  # noqa: E402
import gloo_groups  # noqa: E402
from sglang_runs import plugin_environment  # noqa: E402
from support.checkpoints import make_dflash_checkpoint  # noqa: E402
from support.spawn_group import free_port  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.inspect import inspect  # noqa: E402

HERE = Path(__file__).parent
DP = 2
L = 4  # the targets' decoder layers; DeepSeek's MTP layer is layer 4
DFLASH_LAYERS = 3  # more draft layers than slots: the context K/V check can tell a slot's bytes from the layer's
TAKEN_FROM_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}
"""A NextN draft's parameters SGLang's loader leaves unloaded: its EAGLE worker gives the draft the target's
embedding and LM head once the KV pools exist (`set_embed_and_head`), after this test stops."""
DP_ATTENTION = {"tp_size": DP, "dp_size": DP, "enable_dp_attention": True}
"""The parallel layout draft_loading.py builds every run with (attention TP 1)."""
REPLICATED_SHARED_EXPERT = {"SGLANG_SHARED_EXPERT_TP1": "1"}  # DeepSeek's shared expert replicated across DP ranks
ENV = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1", **REPLICATED_SHARED_EXPERT,
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       dflash_on_cpu.SWITCH: "1"}
PLUGINS = {gloo_groups.NAME: "gloo_groups:register", dflash_on_cpu.NAME: "dflash_on_cpu:register"}


def own_rank_directories(out: Path, root: Path) -> list[str]:
    """One directory per DP rank holding only its own rank file (hard links)."""
    files = [out / f for f in load_manifest(out).rank_files]
    dirs = []
    for rank in range(DP):
        others = {f for i, f in enumerate(files) if i != rank}
        dirs.append(str(shutil.copytree(out, root / f"{out.name}-dp{rank}", copy_function=os.link,
                                        ignore=lambda d, names, others=others: [n for n in names
                                                                                if Path(d, n) in others])))
    return dirs


@pytest.fixture(scope="module")
def loaded(checkpoint_cache, tmp_path_factory):
    """(root, the outputs, per DP rank the results of draft_loading.py)."""
    root = tmp_path_factory.mktemp("sglang-drafts")
    sources = {"deepseek": checkpoint_cache("deepseek-v3-published-mtp", layers=L),
               "qwen": checkpoint_cache("qwen3-moe", layers=L, head_dim=32),
               # an MLP size SGLang's CPU path leaves as is (a multiple of 32), and the fixture's default, padded
               "dflash": make_dflash_checkpoint(root / "dflash", layers=DFLASH_LAYERS, target_layers=L,
                                                intermediate=160),
               "dflash padded": make_dflash_checkpoint(root / "dflash-padded", layers=DFLASH_LAYERS, target_layers=L)}
    outs = {name: root / f"{name.replace(' ', '-')}-out" for name in sources}
    convert(sources["deepseek"], outs["deepseek"], DP, preset="deepseek-v3")
    convert(sources["qwen"], outs["qwen"], DP, preset="qwen3-moe")
    for name in ("dflash", "dflash padded"):
        convert(sources[name], outs[name], DP)  # the draft's preset, from its config.json
    mine = {name: own_rank_directories(out, root) for name, out in outs.items()}
    env = plugin_environment(root, PLUGINS, ENV)
    port = free_port()
    plans = []
    for rank in range(DP):
        nextn = {"algorithm": "NEXTN"}
        dflash = {"algorithm": "DFLASH"}
        runs = [
            {"name": "nextn source", "model": str(sources["deepseek"]), "load_format": "auto", **nextn},
            {"name": "nextn full", "model": str(outs["deepseek"]), "load_format": "shardprep", **nextn},
            {"name": "nextn sharded", "model": mine["deepseek"][rank], "load_format": "shardprep", "sharded": True,
             **nextn},
            {"name": "dflash source", "model": str(sources["qwen"]), "draft": str(sources["dflash"]),
             "load_format": "auto", **dflash},
            {"name": "dflash full", "model": str(outs["qwen"]), "draft": str(outs["dflash"]),
             "load_format": "shardprep", **dflash},
            {"name": "dflash sharded", "model": mine["qwen"][rank], "draft": mine["dflash"][rank],
             "load_format": "shardprep", "sharded": True, **dflash},
            {"name": "dflash full, draft apart", "model": str(outs["qwen"]), "draft": str(sources["dflash"]),
             "load_format": "shardprep", "draft_load_format": "auto", **dflash},
            {"name": "dflash apart", "model": mine["qwen"][rank], "draft": str(sources["dflash"]),
             "load_format": "shardprep", "sharded": True, "draft_load_format": "auto", **dflash},
            {"name": "dflash as published", "model": mine["qwen"][rank], "draft": str(sources["dflash"]),
             "load_format": "shardprep", "sharded": True, **dflash},
            {"name": "dflash padded", "model": mine["qwen"][rank], "draft": mine["dflash padded"][rank],
             "load_format": "shardprep", "sharded": True, **dflash},
        ]
        plans.append({"layout": DP_ATTENTION, "dp_rank": rank, "port": port, "runs": runs})
    results = run_per_rank(HERE / "draft_loading.py", plans, root, env)
    return root, outs, sources, results


def loaded_ok(rank: dict, name: str) -> dict:
    assert "error" not in rank[name], rank[name]
    return rank[name]


def differing(reference: dict, got: dict) -> set[str]:
    return {name for name in reference.keys() | got.keys() if reference.get(name) != got.get(name)}


def bound_names(records) -> set[str]:
    """The manifest names `bind` binds of these layer records: each fused view, and each entry no view covers."""
    names = set()
    for r in records:
        covered = {m for v in r.views for m in v.members}
        names |= {v.name for v in r.views} | {e.name for e in r.entries if e.name not in covered}
    return names


@pytest.mark.parametrize("draft", ["nextn", "dflash"])
def test_full_mode_fills_every_target_and_draft_parameter_with_sglangs_own_loaders_bytes(loaded, draft):
    *_, results = loaded
    for rank in results:
        source, full = loaded_ok(rank, f"{draft} source"), loaded_ok(rank, f"{draft} full")
        assert full["classes"] == source["classes"] == {
            "nextn": {"target": "DeepseekV3ForCausalLM", "draft": "DeepseekV3ForCausalLMNextN"},
            "dflash": {"target": "Qwen3MoeForCausalLM", "draft": "DFlashDraftModel"}}[draft]
        assert len(source["parameters"]["draft"]) >= 15  # 20 NextN, 25 DFlash parameters in SGLang 0.5.23
        assert differing(source["parameters"]["target"], full["parameters"]["target"]) == set()
        unloaded = TAKEN_FROM_TARGET if draft == "nextn" else set()
        assert differing(source["parameters"]["draft"], full["parameters"]["draft"]) <= unloaded


def check_sharded(rank: dict, draft: str, bound: dict[str, set[str]], unloaded: set[str]) -> dict:
    """`draft`'s sharded run: every gather (the target's and the draft's) gives SGLang's own loader's bytes (the
    source run's), every other parameter holds them (but `unloaded`), every target (`bound`: the manifest names, per
    role) was bound and built without storage; returns the run's `sharded` record."""
    sharded, source = loaded_ok(rank, f"{draft} sharded"), loaded_ok(rank, f"{draft} source")
    record = sharded["sharded"]
    assert {role: set(names) for role, names in record["bound"].items()} == bound
    for role in ("target", "draft"):
        assert record["built_without_storage"][role] == sorted(record["bound"][role].values()), role
        gathered = {key.split(":", 1)[1]: value for key, value in record["gathered"].items()
                    if key.startswith(f"{role}:")}
        assert set(gathered) == set(record["bound"][role].values()), role
        assert differing({name: source["parameters"][role][name] for name in gathered}, gathered) == set(), role
        unbound = {name: value for name, value in sharded["parameters"][role].items() if name not in gathered}
        assert differing({name: source["parameters"][role][name] for name in unbound}, unbound) <= unloaded, role
    return record


def test_nextn_sharded_binds_the_mtp_layer_to_sglangs_decoder_after_the_targets_and_every_gather_gives_its_bytes(
        loaded):
    _, outs, _, results = loaded
    manifest = load_manifest(outs["deepseek"])
    assert manifest.draft is not None and (manifest.draft.kind, manifest.draft.layers) == ("mtp", (L,))
    bound = {"target": bound_names(manifest.target_records), "draft": bound_names(manifest.draft_records)}
    for rank in results:
        record = check_sharded(rank, "nextn", bound, TAKEN_FROM_TARGET)
        assert record["gather_order"] == [1, 2, 3, L]  # layer 0 (dense) replicated; the draft's layer last
        assert record["bound"]["draft"] == {
            f"model.layers.{L}.self_attn.fused_qkv_a_proj.weight":
                "model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight",
            f"model.layers.{L}.self_attn.q_b_proj.weight": "model.decoder.self_attn.q_b_proj.weight",
            f"model.layers.{L}.self_attn.o_proj.weight": "model.decoder.self_attn.o_proj.weight",
            f"model.layers.{L}.mlp.shared_experts.gate_up_proj.weight":
                "model.decoder.mlp.shared_experts.gate_up_proj.weight",
            f"model.layers.{L}.mlp.shared_experts.down_proj.weight":
                "model.decoder.mlp.shared_experts.down_proj.weight"}


def test_dflash_sharded_binds_sglangs_fused_layers_after_the_targets_and_every_gather_gives_its_bytes(loaded):
    _, outs, _, results = loaded
    manifest = load_manifest(outs["dflash"])
    assert manifest.draft is not None and manifest.draft.layers == tuple(range(DFLASH_LAYERS))
    bound = {"target": bound_names(load_manifest(outs["qwen"]).target_records),
             "draft": bound_names(manifest.draft_records)}
    assert {f"layers.0.{name}.weight" for name in ("self_attn.qkv_proj", "mlp.gate_up_proj")} <= bound["draft"]
    for rank in results:
        record = check_sharded(rank, "dflash", bound, set())
        # Layer 0 replicated; the draft's layers renumbered after the target's in the joined buffer, names unchanged.
        assert record["gather_order"] == [1, 2, 3, L, L + 1, L + 2]
        assert all(name == model_name for name, model_name in record["bound"]["draft"].items())


def test_dflash_context_kv_projection_sglang_computes_outside_the_layers_gives_full_modes(loaded):
    *_, results = loaded
    for rank in results:
        full = loaded_ok(rank, "dflash full")["kv_projections"]
        assert len(full) == DFLASH_LAYERS
        assert loaded_ok(rank, "dflash sharded")["kv_projections"] == full


def test_each_ranks_draft_startup_line_gives_the_drafts_bytes_as_inspect_and_draft_account_do(loaded):
    _, outs, _, results = loaded
    nextn = inspect(outs["deepseek"])["draft"]
    dflash = draft_account(load_manifest(outs["dflash"]), target=load_manifest(outs["qwen"]).without_draft())
    own = sum(r.chunk_bytes for r in load_manifest(outs["dflash"]).layers)
    assert nextn["saved_bytes"] > 0 and dflash is not None and dflash["sharded_bytes"] == DP * own
    for dp_rank, rank in enumerate(results):
        lines = [line for line in rank["nextn sharded"]["lines"] if " binds the MTP draft of " in line]
        assert len(lines) == 1, rank["nextn sharded"]["lines"]
        assert lines[0].startswith(f"shardprep: DP rank {dp_rank} binds the MTP draft of ")
        assert (f"layer {L} gathered after the target's layers" in lines[0] and f"resident draft bytes "
                f"{nextn['resident_bytes']}, saved {nextn['saved_bytes']} against {nextn['sharded_bytes']}" in lines[0])
        lines = [line for line in rank["dflash sharded"]["lines"] if " binds the DFlash draft model " in line]
        assert len(lines) == 1, rank["dflash sharded"]["lines"]
        assert (f"this rank holds {own} bytes of its chunks (R/N); resident draft bytes {dflash['resident_bytes']}, "
                f"saved {dflash['saved_bytes']} against {dflash['sharded_bytes']} for its full weights") in lines[0]


def test_a_published_draft_beside_a_sharded_target_is_refused_in_one_line_saying_what_to_do(loaded):
    _, _, sources, results = loaded
    for rank in results:
        error = rank["dflash as published"].get("error", "")
        assert (f"{sources['dflash']}: the DFLASH draft model is loaded with load_format shardprep, as its target "
                "is, but is not an output of `shardprep convert`") in error, error
        assert "--speculative-draft-model-path DRAFT_OUT (SGLang gives the draft the target's" in error, error
        # Why it says so: loaded apart by SGLang's own loader, the draft gets the target's extra config and refuses it.
        assert rank["dflash apart"].get("error") == ("ValueError: Unexpected extra config keys for load format "
                                                     "LoadFormat.AUTO: {'shard_weights'}"), rank["dflash apart"]
        # Beside a target in full mode it loads apart, whole, as the full-mode refusal says.
        apart, source = loaded_ok(rank, "dflash full, draft apart"), loaded_ok(rank, "dflash source")
        assert differing(source["parameters"]["draft"], apart["parameters"]["draft"]) == set()


def test_a_draft_whose_mlp_sglang_pads_on_the_cpu_is_refused_in_one_line(loaded):
    _, outs, _, results = loaded
    for dp_rank, rank in enumerate(results):
        error = rank["dflash padded"].get("error", "")
        assert error.startswith(f"ShardprepError: {outs['dflash padded']}-dp{dp_rank}: SGLang pads intermediate_size "
                                "from 152 to 160 on the CPU"), error
