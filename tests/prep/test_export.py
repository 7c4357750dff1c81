"""`shardprep export OUT DIR`: a plain HF checkpoint of the bytes convert wrote; refusals name the file; no loss."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.checkpoints import read_state_dict
from support.fp8_fixture import quantize_checkpoint_fp8
from support.paused import wait_for
from support.reconstruct import rebuild_layers
from test_reshard import KINDS, corrupt, one_line_error, tree
from typer.testing import CliRunner

import shardprep
import shardprep.prep.export as export_module
import shardprep.prep.output.output_dir as output_dir
from shardprep.cli import app
from shardprep.manifests.manifest import MANIFEST_NAME, load_manifest
from shardprep.manifests.replicated import NOTICE_FILE, NOTICE_TENSOR, SHARDED_SENTINEL
from shardprep.manifests.swap_lock import SWAP_LOCK_SUFFIX
from shardprep.prep.convert import convert
from shardprep.prep.export import export, target_file_name
from shardprep.prep.output.opened_output import open_output
from shardprep.prep.output.output_dir import EXPORT_RECORD, is_staging_dir

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def index_of(directory: Path) -> dict:
    return json.loads((directory / "model.safetensors.index.json").read_text())


def assert_plain_checkpoint(directory: Path) -> None:
    """The index names real files only, every safetensors file is in it, and nothing of shardprep's format is left."""
    weight_map = index_of(directory)["weight_map"]
    assert SHARDED_SENTINEL not in weight_map.values() and NOTICE_TENSOR not in weight_map
    files = set(weight_map.values())
    assert all((directory / f).is_file() for f in files)
    assert files == {p.name for p in directory.glob("*.safetensors")}
    assert not (directory / MANIFEST_NAME).exists() and not (directory / "shards").exists()
    assert not (directory / NOTICE_FILE).exists()


def replicated_tensors(out: Path) -> dict[str, torch.Tensor]:
    """The tensors of OUT's own safetensors files, read with the safetensors library (the notice aside)."""
    from safetensors.torch import load_file

    files = set(index_of(out)["weight_map"].values()) - {SHARDED_SENTINEL, NOTICE_FILE}
    return {name: t for f in sorted(files) for name, t in load_file(out / f).items()}


def logits(directory: Path) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(torch.arange(3, 40).reshape(1, -1)).logits


@pytest.mark.parametrize("arch,selection", [
    ("llama", {"preset": "llama"}),
    ("qwen3-moe", {"preset": "qwen3-moe", "layers": "all", "targets": ["*.layers.1.mlp.experts.*.weight"]}),
])
def test_a_bf16_export_loads_in_transformers_with_the_sources_logits_bit_for_bit(arch, selection, checkpoint_cache,
                                                                                 tmp_path):
    src = checkpoint_cache(arch, sharded=True)
    out, plain = tmp_path / "out", tmp_path / "plain"
    convert(src, out, 3, **selection)
    summary = export(out, plain)
    assert summary.target_files == [target_file_name(layer) for layer in summary.layers]
    assert_plain_checkpoint(plain)
    source = read_state_dict(src)
    exported = read_state_dict(plain)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert index_of(plain)["metadata"]["total_size"] == index_of(src)["metadata"]["total_size"]
    assert torch.equal(logits(plain), logits(src))


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory, checkpoint_cache):
    # hidden = 160: weights with tail blocks; every projection requantized to UE8M0 by convert.
    dst = tmp_path_factory.mktemp("fp8") / "ds-fp8"
    return quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", sharded=True, hidden=160), dst)


@pytest.mark.parametrize("scale_format", ["f32", "e8m0"])
def test_a_block_fp8_export_holds_the_bytes_of_the_rank_files_and_the_scales_as_converted(scale_format, fp8_deepseek,
                                                                                          tmp_path):
    out, plain = tmp_path / "out", tmp_path / "plain"
    options = shardprep.RequantOptions(scale_format=scale_format)
    convert(fp8_deepseek, out, 3, preset="deepseek-v3", layers="all", requant=options)
    assert load_manifest(out).quantization["scale_format"] == scale_format
    export(out, plain)
    assert_plain_checkpoint(plain)
    exported = read_state_dict(plain)
    targets = rebuild_layers(out)  # an independent reader of the rank files
    manifest = load_manifest(out)
    assert manifest.target_names()
    for name in manifest.target_names():
        assert exported[name].dtype == targets[name].dtype and exported[name].shape == targets[name].shape, name
        assert exported[name].view(torch.uint8).flatten().tolist() == \
            targets[name].view(torch.uint8).flatten().tolist(), name
    replicated = replicated_tensors(out)
    scales = [name for name in replicated if name.endswith("weight_scale_inv")]
    assert scales and all(replicated[name].dtype == (torch.float8_e8m0fnu if scale_format == "e8m0"
                                                     else torch.float32) for name in scales)
    for name, tensor in replicated.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name].view(torch.uint8),
                                                                    tensor.view(torch.uint8)), name
    assert set(exported) == set(manifest.target_names()) | set(replicated)
    assert sorted(exported) == sorted(read_state_dict(fp8_deepseek))  # every source tensor, once
    assert (plain / "config.json").read_bytes() == (out / "config.json").read_bytes()
    assert json.loads((plain / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"


def test_every_tensor_starts_on_a_multiple_of_its_element_size(fp8_deepseek, tmp_path):
    from shardprep.manifests.dtypes import DTYPE_SIZES
    from shardprep.manifests.safetensors_header import read_safetensors_header

    out, plain = tmp_path / "out", tmp_path / "plain"
    convert(fp8_deepseek, out, 2, preset="deepseek-v3", layers="all")
    summary = export(out, plain)
    for name in summary.target_files:
        header = read_safetensors_header(plain / name)
        assert header.data_start % 8 == 0
        for t in header.tensors.values():
            assert t.begin % DTYPE_SIZES[t.dtype] == 0, (name, t.name)


def test_the_summary_the_record_and_the_links(checkpoint_cache, tmp_path):
    out, plain = tmp_path / "out", tmp_path / "plain"
    convert(checkpoint_cache("llama", sharded=True), out, 2, preset="llama")
    (out / "notes.txt").write_text("unchecked")
    result = runner.invoke(app, ["export", str(out), str(plain), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    manifest = load_manifest(out)
    assert summary["schema"] == "shardprep/export-summary/1" and summary["unlisted_files"] == ["notes.txt"]
    assert summary["world_size"] == 2 and summary["target_tensors"] == len(manifest.target_names())
    carried = {f.path for f in manifest.replicated_files} - {"model.safetensors.index.json", NOTICE_FILE}
    assert sorted(summary["linked_files"]) == sorted(carried) and not summary["copied_files"]
    for rel in carried:
        assert (plain / rel).stat().st_ino == (out / rel).stat().st_ino, rel
    record = json.loads((plain / EXPORT_RECORD).read_text())
    assert record["schema"] == "shardprep/export/1" and record["exported_from"]["path"] == str(out.resolve())
    assert record["source"] == manifest.source and not (plain / "notes.txt").exists()
    os.chmod(out / "config.json", 0o640)
    result = runner.invoke(app, ["export", str(out), str(plain), "--copy-mode", "copy", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {plain}: {summary['target_tensors']} target tensors")
    assert result.stdout.rstrip().endswith(f"not carried over, as {out}'s manifest does not list them: notes.txt")
    assert (plain / "config.json").stat().st_ino != (out / "config.json").stat().st_ino
    assert (plain / "config.json").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "plain"]


# -- refused: one line naming the file, exit 2, DIR untouched --------------------------------------------


@pytest.fixture(scope="module")
def out8(checkpoint_cache, conversion_cache):
    return conversion_cache(checkpoint_cache("llama", sharded=True, layers=4), 8, preset="llama")


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_output_is_refused_naming_the_file_and_nothing_is_written(kind, out8, tmp_path):
    out = shutil.copytree(out8, tmp_path / "out", symlinks=True)
    fragment = corrupt(kind, out).replace("cannot be resharded", "cannot be exported")
    plain = tmp_path / "plain"
    result = runner.invoke(app, ["export", str(out), str(plain)])
    one_line_error(result, fragment)
    assert not plain.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(["elsewhere.json"] if "symlink" in kind
                                                                          else [])]), "no staging or lock left"


@pytest.mark.parametrize("kind", ["flipped byte in a rank chunk", "missing rank file", "edited manifest"])
def test_a_damaged_output_leaves_a_previous_export_unchanged(kind, out8, tmp_path):
    out = shutil.copytree(out8, tmp_path / "out")
    plain = tmp_path / "plain"
    export(out, plain)
    before = tree(plain)
    fragment = corrupt(kind, out)
    result = runner.invoke(app, ["export", str(out), str(plain), "--overwrite"])
    line = one_line_error(result, fragment)
    assert tree(plain) == before
    if kind == "flipped byte in a rank chunk":  # found while reading, inside the transaction
        assert line.endswith(f"; {plain} unchanged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "plain"]


def test_dir_must_not_be_out_or_inside_it_and_overwrite_replaces_only_shardprep_directories(out8, tmp_path):
    for dest in (out8, out8 / "sub"):
        result = runner.invoke(app, ["export", str(out8), str(dest), "--overwrite"])
        one_line_error(result, f"{dest}: output directory ")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    one_line_error(runner.invoke(app, ["export", str(out8), str(home), "--overwrite"]),
                   f"{home}: directory is not empty and not a shardprep output")
    assert (home / "notes.txt").read_text() == "mine" and sorted(p.name for p in home.iterdir()) == ["notes.txt"]


def test_free_space_is_checked_before_writing(out8, tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    monkeypatch.setattr(output_dir, "disk_free", lambda parent: 1000)
    one_line_error(runner.invoke(app, ["export", str(out8), str(plain)]), f"{tmp_path}: needs ")
    assert not plain.exists()


def test_needed_bytes_cover_what_export_writes(out8, tmp_path):
    source = open_output(out8, purpose="exported")
    plan = export_module.plan_export(source)
    plain = tmp_path / "plain"
    copy = export_module._output_bytes(plan, source, plain, export_module.CopyMode.COPY)
    export(out8, plain, copy_mode="copy")
    used = sum(-(-p.stat().st_size // 4096) * 4096 for p in plain.rglob("*") if p.is_file())
    assert used <= copy
    linked = sum(-(-f.size // 4096) * 4096 for f in plan.carried)
    assert export_module._output_bytes(plan, source, plain, export_module.CopyMode.AUTO) == copy - linked


# -- interrupts and kills say what is true -----------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_while_writing_reports_what_is_true(existing, out8, tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    if existing:
        export(out8, plain)
    before = tree(plain) if existing else None

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "write_atomically", interrupt)
    result = runner.invoke(app, ["export", str(out8), str(plain), "--overwrite"])
    assert result.exit_code == 130
    outcome = f"{plain} unchanged" if existing else f"nothing was written to {plain}"
    assert result.stderr.strip() == f"interrupted; {outcome}"
    assert (tree(plain) == before) if existing else not plain.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["plain"] if existing else [])
    assert not list(out8.parent.glob(f".*{SWAP_LOCK_SUFFIX}")), "OUT's readers' lock is released"


DRIVER = """
import pathlib, sys, time
import shardprep.prep.export as export
from shardprep.cli import app
ready, go, args = sys.argv[1], sys.argv[2], sys.argv[3:]
write_atomically = export.write_atomically

def pause_inside_the_transaction(path, text):
    if go != "-":
        pathlib.Path(ready).write_text(str(path.parent))
        while not pathlib.Path(go).exists():
            time.sleep(0.01)
    write_atomically(path, text)

export.write_atomically = pause_inside_the_transaction
if go == "-":
    print("ready", flush=True)
    sys.stdin.readline()
sys.argv = ["shardprep", *args]
app()
"""


def start_driver(out, plain, ready, go, *extra):
    return subprocess.Popen([sys.executable, "-c", DRIVER, str(ready), str(go), "export", str(out), str(plain),
                             "--quiet", *extra], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_stops_an_export_like_ctrl_c(out8, tmp_path):
    plain = tmp_path / "plain"
    export(out8, plain)
    before = tree(plain)
    ready = tmp_path / "ready"
    proc = start_driver(out8, plain, ready, tmp_path / "go", "--overwrite")
    assert is_staging_dir(wait_for(ready, proc))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip() == f"interrupted by SIGTERM; {plain} unchanged"
    assert tree(plain) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "ready"], "staging and lock removed"


def test_sigkill_at_random_moments_leaves_the_old_export_or_the_new_one(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", sharded=True)
    old_out, new_out = tmp_path / "out2", tmp_path / "out3"
    convert(src, old_out, 2, preset="llama")
    convert(src, new_out, 3, preset="llama", chunk_alignment="64KiB")
    plain = tmp_path / "plain"
    export(new_out, plain)
    new = tree(plain)
    export(old_out, plain, overwrite=True)
    old = tree(plain)
    assert old != new  # the record names another OUT
    proc = start_driver(new_out, plain, "-", "-", "--overwrite")
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    proc.communicate("\n")
    duration = time.perf_counter() - t0
    assert proc.returncode == 0 and tree(plain) == new
    for delay in (0.1 * duration, 0.5 * duration, 0.9 * duration):
        sources = (old_out, new_out) if tree(plain) == new else (new_out, old_out)
        proc = start_driver(sources[0], plain, "-", "-", "--overwrite")
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("\n")
        proc.stdin.flush()
        time.sleep(delay)
        proc.kill()
        proc.communicate()
        assert tree(plain) in (old, new)
        leftovers = [p for p in tmp_path.iterdir() if is_staging_dir(p)]
        assert len(leftovers) <= 1, leftovers
        output_dir._remove_abandoned(tmp_path, own_name="")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out2", "out3", "plain"]
