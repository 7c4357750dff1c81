"""Peak RSS of convert and reshard stays below 2 × (largest layer) + 300 MB, on a checkpoint of several hundred MB."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

MB = 1 << 20

MAKE = """
import sys, torch
sys.path.insert(0, {tests!r})
from support.checkpoints import make_checkpoint
make_checkpoint({path!r}, "llama", layers=14, hidden=1024, vocab=24000, sharded=True, tokenizer=False)
"""

MEASURE = """
import json, sys
# VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so it would report the parent's size.
def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from shardprep.prep.convert import convert
s = convert({src!r}, {out!r}, 8, preset={preset!r}, layers="all")
print(json.dumps({{"maxrss_kb": vm_hwm() // 1024, "target_bytes": s.target_bytes}}))
"""


RESHARD = """
import json, sys
def vm_hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from shardprep.prep.reshard import reshard
s = reshard({out!r}, {new!r}, 3)
print(json.dumps({{"maxrss_kb": vm_hwm() // 1024, "target_bytes": s.target_bytes}}))
"""


def largest_layer(out):
    manifest = json.loads((out / "shard_manifest.json").read_text())
    return max(lay["total_bytes"] for lay in manifest["layers"])


@pytest.fixture(scope="module")
def big_output(tmp_path_factory):
    """A checkpoint of several hundred MB, converted for 8 ranks in a fresh process: (out, convert's result)."""
    tmp_path = tmp_path_factory.mktemp("big")
    src = tmp_path / "big"
    tests = str(Path(__file__).parents[1])
    subprocess.run([sys.executable, "-c", MAKE.format(tests=tests, path=str(src))], check=True, capture_output=True)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert size > 300 * MB, f"checkpoint is only {size / MB:.0f} MB"
    preset = tmp_path / "all-linear.json"
    preset.write_text(json.dumps({"targets": ["*.layers.*.self_attn.*.weight", "*.layers.*.mlp.*.weight"]}))
    proc = subprocess.run([sys.executable, "-c", MEASURE.format(src=str(src), out=str(tmp_path / "out"),
                                                                preset=str(preset))],
                          check=True, capture_output=True, text=True)
    return tmp_path / "out", json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_rss_is_bounded_by_the_largest_layer(big_output):
    out, result = big_output
    largest = largest_layer(out)
    peak = result["maxrss_kb"] * 1024
    bound = 2 * largest + 300 * MB
    print(f"targets {result['target_bytes'] / MB:.0f} MB, largest layer {largest / MB:.1f} MB, peak RSS "
          f"{peak / MB:.0f} MB, bound {bound / MB:.0f} MB")
    assert result["target_bytes"] > 200 * MB
    assert peak < bound


@pytest.mark.slow
def test_reshard_peak_rss_is_bounded_by_the_largest_layer(big_output):
    out, _ = big_output
    new = out.parent / "new"
    proc = subprocess.run([sys.executable, "-c", RESHARD.format(out=str(out), new=str(new))],
                          check=True, capture_output=True, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    largest = max(largest_layer(out), largest_layer(new))  # |T| for 8 ranks and for 3
    peak = result["maxrss_kb"] * 1024
    bound = 2 * largest + 300 * MB
    print(f"largest layer {largest / MB:.1f} MB, reshard peak RSS {peak / MB:.0f} MB, bound {bound / MB:.0f} MB")
    assert result["target_bytes"] > 200 * MB
    assert peak < bound
