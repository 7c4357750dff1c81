"""SGLang's `--load-format shardprep`, full mode, on SGLang 0.5.23 on the CPU: the greedy tokens SGLang's own loader
gives from the source checkpoint, a corrupt rank file stops the engine naming the file, and the command line
takes the name.

Every engine of this module runs in one process (sglang_runs.py), one after another: SGLang's start is the cost.
Run inside the SGLang venv (.ci/sglang_venv.sh); skipped where SGLang is not installed (the README's test command).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(1800)  # engines start in 1-2 minutes each on two shared cores

from sglang_runs import run_engines  # noqa: E402
from support.damage import flip_byte  # noqa: E402

from shardprep.manifests import load_manifest  # noqa: E402
from shardprep.prep.convert import convert  # noqa: E402

PROMPTS = ["hello world", "the model shard weights", "a b c d e f"]
TOKENS = [8, 8, 8]



@pytest.fixture(scope="module")
def engines(checkpoint_cache, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("sglang-full")
    src = checkpoint_cache("llama")
    out = root / "out"
    convert(src, out, 2, preset="llama")
    manifest = load_manifest(out)
    bad_chunk = shutil.copytree(out, root / "bad-chunk")
    record = manifest.layers[-1]
    flip_byte(bad_chunk / manifest.rank_files[1], record.file_offset + record.chunk_bytes // 3)

    def run(name, model, **engine):
        return {"name": name, "model": str(model), "engine": engine, "prompts": PROMPTS, "max_tokens": TOKENS}

    plan = {"runs": [run("source", src), run("shardprep", out, load_format="shardprep"),
                     {**run("flipped chunk byte", bad_chunk, load_format="shardprep"), "refusal": True}]}
    results, log = run_engines(plan, root)
    return results, manifest, out, log


def test_full_mode_gives_sglangs_own_tokens_from_the_source_checkpoint(engines):
    results = engines[0]
    assert "tokens" in results["source"], results["source"]
    assert [len(t) for t in results["source"]["tokens"]] == TOKENS
    assert results["shardprep"]["tokens"] == results["source"]["tokens"]


def test_a_flipped_byte_in_a_rank_file_stops_the_engine_naming_the_file(engines):
    results, manifest, _, log = engines
    assert "tokens" not in results["flipped chunk byte"], results["flipped chunk byte"]
    # SGLang reports a scheduler's failure in its own words; the scheduler's traceback carries shardprep's line.
    assert f"bad-chunk/{manifest.rank_files[1]}: layer {manifest.layers[-1].layer}'s chunk" in log
    assert "IntegrityError" in log


def test_the_command_line_takes_load_format_shardprep_and_hands_sglang_the_loader(engines):
    out = engines[2]
    code = (
        "import sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "from sglang.srt.configs.load_config import LoadConfig\n"
        "from sglang.srt.model_loader.loader import get_model_loader\n"
        f"args = prepare_server_args(['--model-path', {str(out)!r}, '--load-format', 'shardprep', '--device', 'cpu'])\n"
        "print(type(get_model_loader(LoadConfig(load_format=args.load_format))).__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "shardprep.integrations.sglang.model_loader"
