"""`plan` and `inspect` per GPU under DP attention with expert parallelism, on a DeepSeek-V3 at its published size.

The checkpoint is written by tests/support/sparse_checkpoints.py: real headers over holes, so nothing here reads or
writes its data. Every expected figure is computed here from the config and the documented formulas, not
taken from the tool.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from support.sparse_checkpoints import DEEPSEEK_V3_CONFIG, deepseek_v3_tensors, nbytes, write_sparse_checkpoint
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import ShardprepError
from shardprep.planning.expert_parallel import expert_shard, hbm_bytes
from shardprep.prep.convert import convert
from shardprep.prep.deployment_plan import PlanRequest, plan_sharding
from shardprep.prep.inspect import inspect
from shardprep.prep.requant_jobs import RequantOptions

C = DEEPSEEK_V3_CONFIG
MIB2 = 2 << 20
H200 = 141 * 10**9


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    files = deepseek_v3_tensors(C)
    return write_sparse_checkpoint(tmp_path_factory.mktemp("deepseek-v3") / "src", C, files), files


def attention_targets_bytes() -> int:
    """One layer's attention targets of the deepseek-v3 preset, one byte per FP8 weight."""
    h, heads = C["hidden_size"], C["num_attention_heads"]
    return (C["q_lora_rank"] * h + (C["kv_lora_rank"] + C["qk_rope_head_dim"]) * h
            + heads * (C["qk_nope_head_dim"] + C["qk_rope_head_dim"]) * C["q_lora_rank"]
            + h * heads * C["v_head_dim"])


def layer_targets_bytes(layer: int) -> int:
    shared = 3 * C["moe_intermediate_size"] * C["n_shared_experts"] * C["hidden_size"]
    return attention_targets_bytes() + (shared if layer >= C["first_k_dense_replace"] else 0)


def expert_bytes() -> int:
    """One routed expert: gate, up, down in FP8 with an F32 scale per 128×128 block."""
    inter, h = C["moe_intermediate_size"], C["hidden_size"]
    return 3 * (inter * h + math.ceil(inter / 128) * math.ceil(h / 128) * 4)


def test_deepseek_v3_per_gpu_at_dp16_ep16_on_h200(deepseek_v3):
    src, files = deepseek_v3
    report = plan_sharding(PlanRequest(str(src), ranks=None, dp=16, ep=16, preset="deepseek-v3", layers="1-60",
                                       hbm_bytes=hbm_bytes("h200", None)))
    n, layers = 8, range(1, 61)
    assert report.ranks == n and report.groups.groups.count == 2  # DP16 in two node-local groups of 8
    memory = report.every_layer.memory
    r = sum(layer_targets_bytes(i) for i in layers)
    assert r == memory.sharded_bytes == 12_774_014_976
    assert max(layer_targets_bytes(i) for i in layers) == memory.max_layer_bytes == 214_368_256

    # Routed experts: 59 MoE layers (3..60 and the MTP layer 61), 16 of 256 experts each on every GPU.
    moe_layers = C["num_hidden_layers"] + C["num_nextn_predict_layers"] - C["first_k_dense_replace"]
    shard = moe_layers * (C["n_routed_experts"] // 16) * expert_bytes()
    assert report.experts.experts_per_gpu == 16 and report.experts.moe_layers == moe_layers == 59
    assert report.capacity.expert_shard_bytes == shard

    # HBM left = 141 GB − (R/N + slots + replicated part + expert shard), chunks aligned to 2 MiB (auto: its
    # padding is under 1% of R) and the own chunk aliased: slots 2·(N−1)·max C.
    chunks = [-(-(layer_targets_bytes(i) // n) // MIB2) * MIB2 for i in layers]
    slots = 2 * (n - 1) * max(chunks)
    total = sum(nbytes(*t) for tensors in files.values() for t in tensors.values())
    replicated = total - r - moe_layers * C["n_routed_experts"] * expert_bytes()
    assert report.capacity.replicated_part_bytes == replicated
    peak = sum(chunks) + slots + replicated + shard
    assert report.capacity.startup_peak_bytes == peak
    assert report.capacity.kv_room_sharded_bytes == H200 - peak
    assert report.capacity.kv_room_replicated_bytes == H200 - (r + replicated + shard)
    # What the saving buys: MLA caches kv_lora + rope values per layer in BF16.
    per_token = C["num_hidden_layers"] * (C["kv_lora_rank"] + C["qk_rope_head_dim"]) * 2
    saved = r - sum(chunks) - slots
    assert report.capacity.kv_tokens == saved // per_token
    assert report.capacity.extra_requests == saved // per_token // 8192


def test_without_ep_the_experts_stay_whole_on_every_gpu_and_a_note_says_so(deepseek_v3):
    src, _ = deepseek_v3
    report = plan_sharding(PlanRequest(str(src), ranks=None, dp=16, preset="deepseek-v3", layers="1-60"))
    with_ep = plan_sharding(PlanRequest(str(src), ranks=None, dp=16, ep=16, preset="deepseek-v3", layers="1-60"))
    routed = with_ep.experts.routed_bytes
    assert report.capacity.expert_shard_bytes == 0
    assert report.capacity.replicated_part_bytes == with_ep.capacity.replicated_part_bytes + routed
    assert report.capacity.kv_room_sharded_bytes == 0  # 631 GiB of weights on a 141 GB GPU
    assert any("give --ep" in note for note in report.notes)


@pytest.mark.parametrize("args, message", [
    (["--dp", "24", "--ranks", "8", "--ep", "24"], "model.layers.3.mlp has 256 routed experts, which do not split "
                                                   "evenly over 24 ranks; use an --ep that divides 256"),
    (["--dp", "16", "--ep", "3"], "--ep 3 does not divide the 16 GPUs of the deployment"),
    (["--dp", "12", "--ranks", "8", "--ep", "4"], "--dp 12 with --ranks 8:"),
    (["--dp", "16", "--tp", "2"], "--tp 2: sharded mode serves DP attention at TP = 1"),
    (["--dp", "16", "--gpu", "h200", "--hbm-gb", "141"], "--gpu h200 and --hbm-gb 141: give one of them"),
    (["--dp", "16", "--gpu", "z9"], "--gpu z9: not a GPU shardprep knows"),
])
def test_a_layout_that_does_not_divide_is_refused_in_one_line(deepseek_v3, args, message):
    src, _ = deepseek_v3
    result = CliRunner().invoke(app, ["plan", str(src), "--preset", "deepseek-v3", *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_gpu_by_name_sets_the_hbm_in_the_json(deepseek_v3):
    src, _ = deepseek_v3
    result = CliRunner().invoke(app, ["plan", str(src), "--preset", "deepseek-v3", "--layers", "1-60", "--dp", "16",
                                      "--ep", "16", "--gpu", "b200", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["capacity"]["hbm_bytes"] == 192 * 10**9
    assert data["experts"]["ep"] == 16 and data["experts"]["experts_per_gpu"] == 16
    assert data["capacity"]["kv_room_sharded_bytes"] == 192 * 10**9 - data["capacity"]["startup_peak_bytes"]


def test_a_real_convert_of_the_sparse_checkpoint_refuses_for_lack_of_space(deepseek_v3, tmp_path):
    src, _ = deepseek_v3
    if shutil.disk_usage(tmp_path).free > 700 * 10**9:  # it would start writing the 689 GB of holes as data
        pytest.skip("this filesystem has room for the whole checkpoint")
    # No requant: deciding it would read the scales, which are holes.
    with pytest.raises(ShardprepError, match=r"needs .* available; free some space"):
        convert(src, tmp_path / "out", 8, preset="deepseek-v3", requant=RequantOptions(mode="none"))
    assert not (tmp_path / "out").exists()


def test_inspect_splits_the_experts_of_a_converted_moe(checkpoint_cache, tmp_path):
    src = checkpoint_cache("qwen3-moe", layers=3)
    out = tmp_path / "out"
    convert(src, out, 2, preset="qwen3-moe")
    whole, split = inspect(out, dp=4), inspect(out, dp=4, ep=4)
    experts = split["experts"]
    assert experts["ep"] == 4 and experts["experts_per_gpu"] == experts["experts_per_layer"] // 4
    assert experts["routed_bytes"] == 4 * experts["shard_bytes"]
    assert split["capacity"]["replicated_part_bytes"] == whole["capacity"]["replicated_part_bytes"] - \
        experts["routed_bytes"]
    assert split["capacity"]["startup_peak_bytes"] == whole["capacity"]["startup_peak_bytes"] - \
        experts["routed_bytes"] + experts["shard_bytes"]


def test_expert_shard_places_consecutive_experts_per_rank():
    # Unequal experts: rank 0 holds experts 0 and 1 of each layer, rank 1 experts 2 and 3.
    sizes = {f"m.layers.{i}.mlp.experts.{e}.w": 10 * (e + 1) for i in (0, 1) for e in range(4)}
    shard = expert_shard(sizes, ep=2)
    assert (shard.routed_bytes, shard.shard_bytes) == (200, 2 * (30 + 40))
