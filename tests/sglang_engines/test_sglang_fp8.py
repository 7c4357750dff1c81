"""Block-FP8 DeepSeek-V3 (MLA + MoE with a shared expert) in SGLang 0.5.23 on the CPU through `--load-format
shardprep`, under DP attention (`tp_size=2, dp_size=2, enable_dp_attention=True`, `SGLANG_SHARED_EXPERT_TP1=1`):

- full mode hands SGLang the bytes convert wrote: the output of `--requant none` gives SGLang's own loader's tokens
  from the FP8 source, bit for bit. (The default requant, UE8M0 scales, gave other tokens there in every run up to
  2026-12-06, when that engine left CI to save a minute: SGLang's CPU path computes with the scales it is given,
  requantizing to UE8M0 only for DeepGEMM, so on the CPU it computes the requantized weights' values);
- sharded mode processes each bound layer once at load with SGLang's own post-load step (VNNI packing of the FP8
  weight, float32 scales) and shards what SGLang's kernels then read (processed_layers.py): the tokens of full
  mode, bit for bit, under an uneven load (requests of 8, 2 and 6 tokens over two DP ranks, so one rank runs
  SGLang's IDLE batches while the other decodes); each rank's startup line gives the processed bytes.

SGLang's FP8 CPU path needs AMX and sgl_kernel's compiled CPU kernels; the test plugin fp8_kernels.py turns on its
AMX check in `fp8.py`/`amx_utils` only and defines the four kernels in torch (dequantize per block, multiply in
float32), so this runs on every CPU kind. SGLang's own CPU bug: with `SGLANG_SHARED_EXPERT_TP1=1` this path's
`forward_cpu` (`models/deepseek_v2.py`) adds the replicated shared expert on every TP rank before the MoE
all-reduce, so at TP 2 it is counted twice (`forward_normal` adds it after the all-reduce). Every engine here runs
that same path, so each comparison is like with like (SGLang's loader against shardprep's, full against
sharded); none is compared with a reference outside SGLang.

The checkpoint is `deepseek-v3-published-blocks` (tests/support/checkpoints.py), quantized by the helper fp8_fixture
(DeepSeek's layout: float8_e4m3fn and a float32 `weight_scale_inv` per 128×128 block): q_lora_rank a whole block
(SGLang concatenates q_a's and kv_a's scales), MLP sizes SGLang does not pad under TP 2 (multiples of 2 × 128), and
every projection's rows a multiple of 16 and columns of 32, which SGLang's CPU path packs (it leaves others
unpacked, for kernels that are not on the CPU). Every engine of this module runs in one process
(sglang_runs.py). Skipped where SGLang is not installed.
"""

from __future__ import annotations

import json
import math
import re

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(2400)

from fp8_kernels import FP8_KERNELS  # noqa: E402
from fp8_kernels import LINE as FP8_LINE  # noqa: E402
from sglang_runs import run_engines  # noqa: E402
from support.fp8_fixture import quantize_checkpoint_fp8  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402
from shardprep.prep.requant_jobs import RequantOptions  # noqa: E402

PROMPTS = ["hello world", "a b c", "the model shard weights"]
TOKENS = [8, 2, 6]
LAYERS = 3  # layer 0 dense, 1..2 MoE: the preset binds 1..2
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
SHARDED = {"model_loader_extra_config": '{"shard_weights": true}'}
ENV = {**FP8_KERNELS, "SGLANG_SHARED_EXPERT_TP1": "1"}
STARTUP = (r"shardprep: DP rank (\d) of 2 serves (\S+) sharded: (\d+) layers bound .*?resident target bytes (\d+) = "
           r"R/N (\d+) \+ 2 slots (\d+) .*?rank file (\d) of 2; processed at load: (\d+) quantized modules, their "
           r"bytes as SGLang's kernels read them \(the rank file held (\d+)\); (\d+) target weights built without "
           r"storage")


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-fp8")
    src = quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3-published-blocks", layers=LAYERS), root / "fp8")
    as_is = root / "as-is"
    convert(src, as_is, 2, preset="deepseek-v3", requant=RequantOptions(mode="none"))

    def run(name, model, **engine):
        return {"name": name, "model": str(model), "engine": {**DP_ATTENTION, **engine}, "prompts": PROMPTS,
                "max_tokens": TOKENS}

    plan = {"env": ENV, "runs": [run("source", src), run("as-is full", as_is, load_format="shardprep"),
                                 run("as-is sharded", as_is, load_format="shardprep", **SHARDED)]}
    results, log = run_engines(plan, root)
    return results, log, src, as_is


def startup_lines(log: str) -> list[tuple[str, ...]]:
    """The sharded engine's startup lines (logged while it loads, after the full engine's tokens)."""
    return re.findall(STARTUP, log.split("ENGINE-TIME 'as-is full'")[1].split("ENGINE-TIME 'as-is sharded'")[0])


def test_full_mode_without_requant_gives_sglangs_own_tokens_from_the_fp8_source(engines):
    results, log, *_ = engines
    assert FP8_LINE in log  # SGLang's block-FP8 CPU path ran, its kernels the plugin's
    assert "Unsupported dimension" not in log  # SGLang packed every FP8 weight (none left for a GPU kernel)
    assert "tokens" in results["source"], results["source"]
    assert [len(t) for t in results["source"]["tokens"]] == TOKENS
    assert results["as-is full"]["tokens"] == results["source"]["tokens"]


def test_sharded_mode_of_block_fp8_gives_full_modes_tokens_bit_for_bit_under_uneven_load(engines):
    results = engines[0]
    assert "tokens" in results["as-is sharded"], results["as-is sharded"]
    assert results["as-is sharded"]["tokens"] == results["as-is full"]["tokens"]


def processed_layer_bytes(config: dict, n: int) -> int:
    """One bound layer's bytes as SGLang's kernels read them after processing, laid out as processed_layers.py lays
    them out (each tensor 16-byte aligned, the layer padded to a multiple of 16·N): per module the FP8 weight
    [N, K] (VNNI-packed: as many bytes) and its float32 scales [ceil(N/128), ceil(K/128)]."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    shared = config["moe_intermediate_size"] * config["n_shared_experts"]
    weights = {"fused_qkv_a_proj_with_mqa": (config["q_lora_rank"] + config["kv_lora_rank"]
                                             + config["qk_rope_head_dim"], h),
               "q_b_proj": (heads * (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]), config["q_lora_rank"]),
               "o_proj": (h, heads * config["v_head_dim"]),
               "shared_experts.gate_up_proj": (2 * shared, h), "shared_experts.down_proj": (h, shared)}

    def aligned(nbytes: int, to: int = 16) -> int:
        return -(-nbytes // to) * to

    total = sum(aligned(rows * cols) + aligned(4 * math.ceil(rows / 128) * math.ceil(cols / 128))
                for rows, cols in weights.values())
    return aligned(total, 16 * n)


def test_each_sharded_rank_processes_its_fp8_targets_at_load_and_logs_the_processed_bytes(engines):
    _, log, _, as_is = engines
    lines = startup_lines(log)
    assert sorted(line[0] for line in lines) == ["0", "1"], lines
    layer = processed_layer_bytes(json.loads((as_is / "config.json").read_text()), 2)
    manifest = load_manifest(as_is)
    for rank, served, layers, resident, own, slots, rank_file, modules, held, made in lines:
        assert served == str(as_is) and rank_file == rank and int(layers) == LAYERS - 1
        # Per bound layer: fused_qkv_a_proj_with_mqa, q_b_proj, o_proj, the shared expert's gate_up and down.
        assert int(modules) == int(made) == 5 * (LAYERS - 1)
        # What the rank holds and gathers is the processed layout (weights and their scales), not the rank file's.
        assert int(slots) == 2 * layer
        assert int(own) == int(layers) * layer // 2
        assert int(resident) == int(own) + int(slots)
        assert int(held) == manifest.rank_file_bytes
