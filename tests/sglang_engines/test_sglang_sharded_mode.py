"""SGLang's `--load-format shardprep`, sharded mode, under DP attention on SGLang 0.5.23 on the CPU (tiny Qwen3-MoE,
`tp_size=2, dp_size=2, enable_dp_attention=True`: attention TP 1, two DP ranks, one shard group of two): the
tokens of full mode, bit for bit, with one rank idle throughout; each rank logs its startup line, before SGLang sizes
its KV pool, and builds its targets' weights without storage. (That full mode under DP attention gives SGLang's own
loader's tokens from the source is checked on DeepSeek-V3 in block FP8, test_sglang_fp8.py, not again here: an
engine costs a minute of CI.)

One request: SGLang hands requests to its DP ranks in turn, so DP rank 1 gets none and runs SGLang's IDLE batches
for the whole generation while rank 0 prefills and decodes (the design note's dummy-step rule). Its gathers must
pair with the busy rank's (gloo collectives over the shard group): a rank that skipped a gather would hang the other,
and the test would time out instead of comparing tokens. A rank that finishes first and idles while the other still
decodes is checked on Kimi K3 (test_sglang_kimi_k3_tokens.py) and DeepSeek-V3 (test_sglang_mla.py).

Within one engine, SGLang gives all ranks one model path, so the ranks share a directory holding both rank files; a
test plugin (opened_files.py) records the files each rank opens, to check that a rank in sharded mode opens only its
own rank file (full mode opens both, which shows the record is taken). The deployment launched as a user launches it
on two nodes (`python -m sglang.launch_server ... --nnodes 2 --node-rank 0|1`, each node's directory holding only its
rank file, asked over HTTP) is checked once, on Kimi K3 (test_sglang_kimi_k3_tokens.py): a launch costs two minutes
of CI, and this module's launch of the same flags on Qwen3-MoE showed nothing K3's does not.

Every engine of this module runs in one process (sglang_runs.py). Skipped where SGLang is not installed.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(1800)

from sglang_runs import run_engines  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

PROMPTS = ["the model shard weights"]
TOKENS = [10]
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
SHARDED = {"model_loader_extra_config": '{"shard_weights": true}'}


@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-sharded")
    src = checkpoint_cache("qwen3-moe", layers=4)
    out = root / "out"
    convert(src, out, 2, preset="qwen3-moe")

    def run(name, model, **engine):
        return {"name": name, "model": str(model), "engine": {**DP_ATTENTION, **engine}, "prompts": PROMPTS,
                "max_tokens": TOKENS}

    def recording_opens(name, run):  # opened_files.py: which files under OUT each rank opens
        return {**run, "env": {"SHARDPREP_TEST_OPENED_LOG": str(root / f"opened-{name}.log"),
                               "SHARDPREP_TEST_OPENED_UNDER": str(out) + os.sep}}

    plan = {"runs": [recording_opens("full", run("full", out, load_format="shardprep")),
                     recording_opens("sharded", run("sharded", out, load_format="shardprep", **SHARDED))]}
    # Attention TP above 1 is refused in SGLang's option names by check_layout, tested without an engine
    # (tests/integrations/test_sharded_load.py): an engine to see it refused here cost half a minute of CI.
    results, log = run_engines(plan, root)
    return results, log, out


def logged_by_the_sharded_engine(log: str) -> str:
    """What the sharded engine's ranks logged."""
    return log.split("ENGINE-TIME 'full'")[1].split("ENGINE-TIME 'sharded'")[0]


def opened_rank_files(engines, name: str) -> dict[int, set[str]]:
    """Per torch.distributed rank (= DP rank under DP attention), the rank files of OUT it opened in run `name`."""
    out = engines[2]
    rank_files = set(load_manifest(out).rank_files)
    opened: dict[int, set[str]] = {}
    for line in (out.parent / f"opened-{name}.log").read_text().splitlines():
        rank, path = line.split("\t")
        name = os.path.relpath(path, out)  # as the manifest names it: shards/rank-...
        if name in rank_files:
            opened.setdefault(int(rank), set()).add(name)
    return opened


def test_sharded_mode_gives_full_modes_tokens_bit_for_bit_with_one_dp_rank_idle_throughout(engines):
    results = engines[0]
    assert "tokens" in results["full"], results["full"]
    assert [len(t) for t in results["full"]["tokens"]] == TOKENS
    assert results["sharded"]["tokens"] == results["full"]["tokens"]


def test_each_dp_rank_logs_its_resident_bytes_against_full_weights_from_its_own_rank_file(engines):
    log, out = logged_by_the_sharded_engine(engines[1]), engines[2]
    lines = re.findall(r"shardprep: DP rank (\d) of 2 serves (\S+) sharded: .*?resident target bytes (\d+) = "
                       r"R/N (\d+) \+ 2 slots (\d+) .*?against (\d+) for full weights; .*?rank file (\d) of 2", log)
    assert sorted(line[0] for line in lines) == ["0", "1"], lines
    for rank, served, resident, own, slots, full, rank_file in lines:
        assert served == str(out) and rank_file == rank
        assert int(resident) == int(own) + int(slots)
        assert int(own) < int(full)  # the rank holds half of the targets; with the slots, tiny models hold more


def test_each_dp_rank_builds_every_bound_weight_without_storage(engines):
    # Qwen3-MoE without a shared expert: qkv_proj and o_proj per bound layer, none ever allocated whole.
    lines = re.findall(r"shardprep: DP rank \d of 2 serves .*?(\d+) layers bound .*?; (\d+) target weights built "
                       r"without storage", logged_by_the_sharded_engine(engines[1]))
    assert len(lines) == 2, lines
    assert all(int(made) == 2 * int(layers) > 0 for layers, made in lines), lines


def test_sharding_is_finished_before_sglang_sizes_each_ranks_kv_pool(engines):
    sharded = logged_by_the_sharded_engine(engines[1])
    for rank in ("0", "1"):
        line = sharded.index(f"shardprep: DP rank {rank} of 2 serves")
        kv = re.search(rf"DP{rank} TP{rank}\] KV Cache is allocated", sharded)
        assert kv is not None and line < kv.start()


def test_in_sharded_mode_each_dp_rank_opens_only_its_own_rank_file(engines):
    rank_files = load_manifest(engines[2]).rank_files
    # Full mode rebuilds every target from both rank files on each rank: the record sees rank-file opens.
    assert opened_rank_files(engines, "full") == {0: set(rank_files), 1: set(rank_files)}
    assert opened_rank_files(engines, "sharded") == {0: {rank_files[0]}, 1: {rank_files[1]}}
