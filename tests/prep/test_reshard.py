"""`shardprep reshard OUT NEW --ranks M`: the bytes a convert for M writes, refusals naming the file, no data lost."""

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from support.fp8_fixture import quantize_checkpoint_fp8
from support.paused import wait_for
from test_format_v2 import downgrade_to_v1
from typer.testing import CliRunner

import shardprep
import shardprep.prep.output.output_dir as output_dir
import shardprep.prep.reshard as reshard_module
from shardprep.cli import app
from shardprep.errors import ManifestError
from shardprep.manifests.layout import Entry
from shardprep.manifests.manifest import MANIFEST_NAME, load_manifest
from shardprep.prep.convert import convert
from shardprep.prep.output.opened_output import open_output
from shardprep.prep.output.output_dir import is_staging_dir
from shardprep.prep.output.writer import CopyMode
from shardprep.prep.reshard_plan import plan_reshard
from shardprep.prep.validate import validate

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def files(directory):
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def tree(directory):
    return {rel: (directory / rel).read_bytes() for rel in files(directory)}


def assert_same_as_convert(resharded, converted):
    """Every file byte-identical, and the manifests equal apart from `resharded_from` and the seal; returns
    the `resharded_from` record."""
    assert files(resharded) == files(converted)
    for rel in files(converted):
        if rel != MANIFEST_NAME:
            assert (resharded / rel).read_bytes() == (converted / rel).read_bytes(), rel
    ours = json.loads((resharded / MANIFEST_NAME).read_text())
    theirs = json.loads((converted / MANIFEST_NAME).read_text())
    record = ours.pop("resharded_from")
    assert ours.pop("manifest_xxh3_128") != theirs.pop("manifest_xxh3_128")
    assert ours == theirs
    return record


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory, checkpoint_cache):
    # hidden = 160: weights with tail blocks; every projection requantized to UE8M0 by convert.
    dst = tmp_path_factory.mktemp("fp8") / "ds-fp8"
    return quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", sharded=True, hidden=160), dst)


# (source, N, M, convert's selection, --chunk-alignment for M). In the qwen3-moe case layer 1 also shards its
# experts, so layer 2 after it is smaller, and its 64 KiB chunks for M are longer than its T for N: the bytes
# above layer 2's last entry must be written as zeros, not as what layer 1 left in the buffer.
CASES = {
    "8to4-llama-fused-qkv": ("llama", 8, 4, {"preset": "llama"}, "auto"),
    "4to8-qwen3-moe-64KiB-chunks": ("qwen3-moe", 4, 8, {"preset": "qwen3-moe", "layers": "all",
                                                        "targets": ["*.layers.1.mlp.experts.*.weight"]}, "64KiB"),
    "8to3-deepseek-block-fp8-requantized": ("fp8", 8, 3, {"preset": "deepseek-v3", "layers": "all"}, "auto"),
    "2to1-bert-single-file": ("bert", 2, 1, {"targets": ["*.attention.self.*.weight"], "layers": "all"}, "none"),
}


@pytest.mark.parametrize("case", CASES)
def test_reshard_writes_the_bytes_convert_writes_for_m_ranks(case, checkpoint_cache, fp8_deepseek, tmp_path):
    arch, n, m, selection, alignment = CASES[case]
    src = fp8_deepseek if arch == "fp8" else checkpoint_cache(arch, sharded=arch != "bert")
    out, new, direct = tmp_path / "out", tmp_path / "new", tmp_path / "direct"
    convert(src, out, n, **selection)
    summary = shardprep.reshard(out, new, m, chunk_alignment=alignment)
    convert(src, direct, m, chunk_alignment=alignment, **selection)
    record = assert_same_as_convert(new, direct)
    m_in = load_manifest(out)
    assert record == {"path": str(out.resolve()), "world_size": n, "chunk_alignment": m_in.chunk_alignment,
                      "created_by": m_in.created_by}
    assert load_manifest(new).resharded_from == record, "the record survives a reader"
    assert validate(new, source=src).ok
    assert (summary.from_world_size, summary.world_size) == (n, m)
    assert summary.linked_files and not summary.copied_files and not summary.unlisted_files
    index = "model.safetensors.index.json"
    assert (new / index).stat().st_ino == (out / index).stat().st_ino, "the replicated part is hard-linked"
    if arch == "fp8":
        assert load_manifest(new).quantization is not None


def test_copy_mode_copies_the_replicated_part_with_its_mode_bits(checkpoint_cache, tmp_path):
    out, new = tmp_path / "out", tmp_path / "new"
    convert(checkpoint_cache("llama", sharded=True), out, 2, preset="llama")
    os.chmod(out / "config.json", 0o640)
    summary = shardprep.reshard(out, new, 3, copy_mode="copy")
    assert not summary.linked_files and "config.json" in summary.copied_files
    assert (new / "config.json").stat().st_ino != (out / "config.json").stat().st_ino
    assert (new / "config.json").stat().st_mode & 0o777 == 0o640
    assert validate(new).ok


def test_a_manifest_whose_entries_sit_elsewhere_is_not_resharded(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama", sharded=True), out, 2, preset="llama")
    m = load_manifest(out)
    layer = m.layers[0]
    last = layer.entries[-1]
    moved = replace(layer, entries=(*layer.entries[:-1], Entry(last.name, last.dtype, last.shape, last.offset + 16,
                                                                last.nbytes)))
    with pytest.raises(ManifestError, match=f"tensor '{last.name}' is at offset {last.offset + 16}, where the "
                                            f"layout rule puts it at {last.offset}"):
        plan_reshard(replace(m, layers=(moved, *m.layers[1:])), 4)
    assert [mv.layout.entries for mv in plan_reshard(m, 4).moves] == [r.entries for r in m.layers]


# -- refused inputs: one line naming the file, exit 2, NEW untouched ----------------------------------


@pytest.fixture(scope="module")
def out8(checkpoint_cache, conversion_cache):
    return conversion_cache(checkpoint_cache("llama", sharded=True, layers=4), 8, preset="llama")


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def rank_path(out, rank):
    return out / load_manifest(out).rank_files[rank]


def corrupt(kind, out):
    """Damage `out` one way; returns what the error line must say."""
    m = load_manifest(out)
    if kind == "flipped byte in a rank chunk":
        flip(rank_path(out, 5), m.layers[2].file_offset + 3)
        return f"{rank_path(out, 5)}: layer {m.layers[2].layer}'s chunk (bytes {m.layers[2].file_offset}.."
    if kind == "flipped byte in a rank file header":
        flip(rank_path(out, 0), 40)
        return f"{rank_path(out, 0)}: its safetensors header is not the one the manifest implies"
    if kind == "flipped byte in a replicated safetensors file":
        name = next(p.name for p in sorted(out.glob("model-*.safetensors")))
        flip(out / name, (out / name).stat().st_size - 2)
        return f"{out / name}: "
    if kind == "flipped byte in config.json":
        flip(out / "config.json", 5)
        return f"{out / 'config.json'}: "
    if kind == "missing rank file":
        rank_path(out, 2).unlink()
        return f"{rank_path(out, 2)}: rank 2's file is missing"
    if kind == "truncated rank file":
        os.truncate(rank_path(out, 7), m.rank_file_bytes - 100)
        return f"{rank_path(out, 7)}: {m.rank_file_bytes - 100} bytes, the manifest says {m.rank_file_bytes}"
    if kind == "missing replicated file":
        (out / "tokenizer.json").unlink()
        return f"{out / 'tokenizer.json'}: listed in the manifest but missing"
    if kind == "symlink out of OUT":
        outside = out.parent / "elsewhere.json"
        shutil.copyfile(out / "tokenizer.json", outside)
        (out / "tokenizer.json").unlink()
        (out / "tokenizer.json").symlink_to(outside)
        return f"{out / 'tokenizer.json'}: is a symlink to {outside.resolve()}, outside {out}"
    if kind == "format version 1":
        downgrade_to_v1(out)
        return f"{out / MANIFEST_NAME}: format version 1 cannot be resharded"
    if kind == "edited manifest":
        text = (out / MANIFEST_NAME).read_text()
        (out / MANIFEST_NAME).write_text(text.replace('"world_size": 8', '"world_size": 8 ', 1))
        return f"{out / MANIFEST_NAME}: manifest_xxh3_128 is "
    raise AssertionError(kind)


KINDS = ["flipped byte in a rank chunk", "flipped byte in a rank file header",
         "flipped byte in a replicated safetensors file", "flipped byte in config.json", "missing rank file",
         "truncated rank file", "missing replicated file", "symlink out of OUT", "format version 1", "edited manifest"]


def one_line_error(result, fragment):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_input_is_refused_naming_the_file_and_nothing_is_written(kind, out8, tmp_path):
    out = shutil.copytree(out8, tmp_path / "out", symlinks=True)
    fragment = corrupt(kind, out)
    new = tmp_path / "new"
    result = runner.invoke(app, ["reshard", str(out), str(new), "--ranks", "4"])
    one_line_error(result, fragment)
    assert not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(["elsewhere.json"] if "symlink" in kind
                                                                          else [])]), "no staging or lock left"


def test_a_chunk_found_corrupt_midway_leaves_the_previous_output_unchanged(out8, tmp_path):
    out = shutil.copytree(out8, tmp_path / "out")
    new = tmp_path / "new"
    shardprep.reshard(out, new, 2)
    before = tree(new)
    fragment = corrupt("flipped byte in a rank chunk", out)
    result = runner.invoke(app, ["reshard", str(out), str(new), "--ranks", "4", "--overwrite"])
    assert one_line_error(result, fragment).endswith(f"; {new} unchanged")
    assert tree(new) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]


@pytest.mark.parametrize("where", ["NEW is OUT", "NEW inside OUT", "OUT inside NEW"])
def test_new_and_out_must_not_contain_each_other(where, checkpoint_cache, tmp_path):
    if where == "OUT inside NEW":
        new = tmp_path / "new"
        out = new / "out"
        convert(checkpoint_cache("llama", sharded=True), out, 2, preset="llama")
    else:
        out = tmp_path / "out"
        convert(checkpoint_cache("llama", sharded=True), out, 2, preset="llama")
        new = out if where == "NEW is OUT" else out / "sub"
    before = tree(out)
    result = runner.invoke(app, ["reshard", str(out), str(new), "--ranks", "3", "--overwrite"])
    one_line_error(result, f"{new}: output directory ")
    assert tree(out) == before


def test_files_the_manifest_does_not_list_are_not_carried_over(out8, tmp_path):
    out = shutil.copytree(out8, tmp_path / "out")
    (out / "notes.txt").write_text("unchecked")
    new = tmp_path / "new"
    result = runner.invoke(app, ["reshard", str(out), str(new), "--ranks", "4"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {new}: 3 layers resharded from 8 to 4 rank files")
    assert result.stdout.rstrip().endswith(f"not carried over, as {out}'s manifest does not list them: notes.txt")
    result = runner.invoke(app, ["reshard", str(out), str(new), "--ranks", "2", "--json", "--overwrite"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["schema"] == "shardprep/reshard-summary/1"
    assert summary["unlisted_files"] == ["notes.txt"] and summary["world_size"] == 2
    assert not (new / "notes.txt").exists() and validate(new).ok


def test_free_space_is_checked_before_writing(out8, tmp_path, monkeypatch):
    new = tmp_path / "new"
    monkeypatch.setattr(output_dir, "disk_free", lambda parent: 1000)
    result = runner.invoke(app, ["reshard", str(out8), str(new), "--ranks", "4"])
    one_line_error(result, f"{tmp_path}: needs ")
    assert "1000 B available" in result.stderr and not new.exists()


def test_needed_bytes_cover_what_reshard_writes_and_hard_links_cost_nothing(out8, tmp_path):
    source = open_output(out8, purpose="resharded")
    plan = plan_reshard(source.manifest, 3)
    new = tmp_path / "new"
    copy = reshard_module._output_bytes(plan, source, new, CopyMode.COPY)
    shardprep.reshard(out8, new, 3, copy_mode="copy")
    used = sum(-(-p.stat().st_size // 4096) * 4096 for p in new.rglob("*") if p.is_file())
    assert used <= copy
    linked = sum(-(-f.size // 4096) * 4096 for f in source.manifest.replicated_files)
    assert reshard_module._output_bytes(plan, source, new, CopyMode.AUTO) == copy - linked


# -- interrupts say what is true -------------------------------------------------------------------------


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_while_writing_reports_what_is_true(existing, out8, tmp_path, monkeypatch):
    new = tmp_path / "new"
    if existing:
        shardprep.reshard(out8, new, 2)
    before = tree(new) if existing else None

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(reshard_module, "write_manifest", interrupt)
    result = runner.invoke(app, ["reshard", str(out8), str(new), "--ranks", "4", "--overwrite"])
    assert result.exit_code == 130
    outcome = f"{new} unchanged" if existing else f"nothing was written to {new}"
    assert result.stderr.strip() == f"interrupted; {outcome}"
    assert (tree(new) == before) if existing else not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["new"] if existing else [])


DRIVER = """
import pathlib, sys, time
import shardprep.prep.reshard as reshard
from shardprep.cli import app
ready, go, args = sys.argv[1], sys.argv[2], sys.argv[3:]
write_manifest = reshard.write_manifest

def pause_inside_the_transaction(directory, manifest):
    pathlib.Path(ready).write_text(str(directory))
    while not pathlib.Path(go).exists():
        time.sleep(0.01)
    write_manifest(directory, manifest)

reshard.write_manifest = pause_inside_the_transaction
sys.argv = ["shardprep", *args]
app()
"""


def test_sigterm_stops_a_reshard_like_ctrl_c(out8, tmp_path):
    new = tmp_path / "new"
    shardprep.reshard(out8, new, 2)
    before = tree(new)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(ready), str(tmp_path / "go"), "reshard", str(out8),
                             str(new), "--ranks", "4", "--overwrite"], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert is_staging_dir(wait_for(ready, proc))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip() == f"interrupted by SIGTERM; {new} unchanged"
    assert tree(new) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "ready"], "staging and lock removed"
