"""No data lost: what --overwrite may replace, the atomic swap, free space, disk full, modes, symlinks, leftovers.

The kill, SIGTERM and concurrency tests, which need real processes, are in test_output_kills.py.
"""

import errno
import fcntl
import json
import os
import resource
import shutil
import stat
import subprocess
import sys

import pytest
from support.hub_cache import make_hub_cache
from typer.testing import CliRunner

import shardprep.prep.output.output_dir as output_dir
import shardprep.prep.output.safetensors_writer as safetensors_writer
import shardprep.prep.output.writer as writer
from shardprep.cli import app
from shardprep.errors import OutputError, SourceError
from shardprep.prep.convert import convert
from shardprep.prep.convert_plan import make_plan
from shardprep.prep.output.output_dir import is_staging_dir, output_outcome, staged_output
from shardprep.prep.selection import Selection, load_preset
from shardprep.prep.source import open_source
from shardprep.prep.validate import validate

runner = CliRunner()


def world_size(out):
    return json.loads((out / "shard_manifest.json").read_text())["world_size"]


def tree(path):
    """Every file under `path` with its bytes: what 'unchanged' means."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def hidden_entries(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture
def old_output(checkpoint_cache, tmp_path):
    """A finished 3-rank output at tmp_path/out, and the source it came from."""
    src = checkpoint_cache("llama", sharded=True)
    out = tmp_path / "out"
    convert(src, out, 3, preset="llama")
    return src, out


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# -- what --overwrite may replace -------------------------------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_that_is_not_a_shardprep_output_is_never_replaced(checkpoint_cache, tmp_path, overwrite):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    args = ["convert", checkpoint_cache("llama"), out, "--ranks", 2, "--preset", "llama"]
    result = runner.invoke(app, [str(a) for a in args + (["--overwrite"] if overwrite else [])])
    one_line_error(result, f"{out}: directory is not empty and not a shardprep output")
    assert tree(out) == {"thesis.tex": b"years of work"}
    assert hidden_entries(tmp_path) == []


def test_overwrite_replaces_an_output_whose_manifest_is_damaged(old_output):
    # The mark of an output is the manifest's name, not its content: a damaged output can be reconverted.
    src, out = old_output
    (out / "shard_manifest.json").write_text('{"trunc')
    convert(src, out, 2, preset="llama", overwrite=True)
    assert world_size(out) == 2 and validate(out, source=src).ok


def test_an_empty_existing_directory_is_filled_without_overwrite(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    assert validate(out).ok


def test_a_symlinked_output_directory_is_refused(old_output, tmp_path):
    src, out = old_output
    link = tmp_path / "link"
    link.symlink_to(out)
    before = tree(out)
    with pytest.raises(OutputError, match="is a symbolic link"):
        convert(src, link, 2, preset="llama", overwrite=True)
    assert link.is_symlink() and tree(out) == before


# -- the atomic swap ------------------------------------------------------------------------------

def test_overwrite_swaps_old_and_new_in_one_exchange(old_output, monkeypatch):
    src, out = old_output
    real_exchange, swaps = output_dir.exchange, []

    def exchange(a, b):
        # At the instant of the swap both trees are complete: OUT the old one, the staging directory the new.
        if (b / "shard_manifest.json").exists():
            swaps.append((world_size(b), world_size(a), is_staging_dir(a)))
        real_exchange(a, b)

    monkeypatch.setattr(output_dir, "exchange", exchange)
    old_inode = out.stat().st_ino
    convert(src, out, 2, preset="llama", overwrite=True)
    assert swaps == [(3, 2, True)]
    assert out.stat().st_ino != old_inode and world_size(out) == 2 and validate(out, source=src).ok
    assert hidden_entries(out.parent) == [], "the old tree and the lock file are gone"


def test_filesystem_without_exchange_is_refused_before_anything_is_written(old_output, monkeypatch):
    src, out = old_output
    before, written = tree(out), []

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(output_dir, "exchange", no_exchange)
    monkeypatch.setattr(writer, "_write_rank_files", lambda *a: written.append(a))
    with pytest.raises(OutputError, match="cannot swap directories atomically") as info:
        convert(src, out, 2, preset="llama", overwrite=True)
    assert "\n" not in str(info.value) and not written
    assert tree(out) == before and hidden_entries(out.parent) == []


def test_exchange_swaps_two_real_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    output_dir.exchange(a, b)
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


# -- interrupts and failures say what is true --------------------------------------------------------

def test_ctrl_c_while_writing_reports_output_unchanged(old_output, monkeypatch):
    src, out = old_output
    before = tree(out)

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_copy_other_files", interrupt)
    result = runner.invoke(app, ["convert", str(src), str(out), "--ranks", "2", "--preset", "llama", "--overwrite"])
    assert result.exit_code == 130
    assert result.stderr.strip() == f"interrupted; {out} unchanged"
    assert tree(out) == before and hidden_entries(out.parent) == []


def test_ctrl_c_while_removing_the_old_tree_reports_the_new_output(old_output, monkeypatch):
    src, out = old_output

    def interrupted_removal(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(output_dir, "_remove_output", interrupted_removal)
    with pytest.raises(KeyboardInterrupt) as info:
        convert(src, out, 2, preset="llama", overwrite=True)
    outcome = output_outcome(info.value)
    assert outcome.startswith(f"{out} now holds the new output; the old one is left in "
                              f"{out.parent}/.out.shardprep-tmp-")
    assert world_size(out) == 2 and validate(out, source=src).ok
    [leftover] = [p for p in out.parent.iterdir() if is_staging_dir(p)]
    assert world_size(leftover) == 3 and not validate(leftover).ok, "a swapped-out old tree never validates"
    monkeypatch.undo()
    convert(src, out.parent / "other", 2, preset="llama")  # any later convert into the parent cleans up
    assert not leftover.exists()


def test_old_tree_that_cannot_be_removed_is_reported_with_the_new_output_in_place(old_output, monkeypatch):
    src, out = old_output

    def denied(path):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(output_dir, "_remove_output", denied)
    result = runner.invoke(app, ["convert", str(src), str(out), "--ranks", "2", "--preset", "llama", "--overwrite"])
    line = one_line_error(result, f"{out} now holds the new output; the old one could not be removed from ")
    assert "Permission denied" in line and world_size(out) == 2


# -- free space and disk full ------------------------------------------------------------------------

def test_not_enough_free_space_is_refused_with_needed_and_available(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError) as info:
        with staged_output(out, needed_bytes=3 << 30, free_space=lambda parent: 512 << 20):
            raise AssertionError("the block must not run")
    assert str(info.value) == (f"{tmp_path}: needs 3.00 GiB for {out}, 512.00 MiB available; "
                               "free some space or choose another location")
    assert list(tmp_path.iterdir()) == []


def test_convert_checks_free_space_before_writing(old_output, monkeypatch):
    src, out = old_output
    before = tree(out)
    monkeypatch.setattr(output_dir, "disk_free", lambda parent: 1000)
    result = runner.invoke(app, ["convert", str(src), str(out), "--ranks", "2", "--preset", "llama", "--overwrite"])
    one_line_error(result, f"{out.parent}: needs ", f"for {out}, 1000 B available")
    assert tree(out) == before and hidden_entries(out.parent) == []


def test_needed_bytes_cover_what_convert_writes_and_hard_links_cost_nothing(checkpoint_cache, tmp_path):
    src = checkpoint_cache("llama", sharded=True)
    plan = make_plan(open_source(src), 3, Selection(preset=load_preset("llama")))
    out = tmp_path / "out"
    estimate_copy = writer.output_bytes(plan, out, "copy")
    summary = convert(src, out, 3, preset="llama", copy_mode="copy")
    used = sum(-(-p.stat().st_size // 4096) * 4096 for p in out.rglob("*") if p.is_file())
    assert used <= estimate_copy
    linked = [f for f in plan.replicated if f.tensors is None]
    assert linked, "the sharded llama has files without targets"
    saved = sum(-(-plan.source.files[f.name].size // 4096) * 4096 for f in linked)
    assert writer.output_bytes(plan, out, "auto") == estimate_copy - saved
    assert summary.copied_files


def enospc_where(kind, monkeypatch):
    """Make one kind of write fail with ENOSPC; returns the output-relative file the error must name."""
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if kind == "rank file":
        monkeypatch.setattr(writer, "pwrite_all", no_space)
        return "shards/rank-00000-of-00002"
    if kind == "rewritten safetensors":
        monkeypatch.setattr(safetensors_writer, "copy_range", no_space)
        return "model-0000"
    real_copyfile = shutil.copyfile
    suffix = ".safetensors" if kind == "copied safetensors" else "tokenizer.json"

    def copyfile(src, dest, *args, **kwargs):
        if str(dest).endswith(suffix):
            no_space()
        return real_copyfile(src, dest, *args, **kwargs)

    monkeypatch.setattr(writer.shutil, "copyfile", copyfile)
    return suffix if kind == "other file" else "model-0000"


@pytest.mark.parametrize("kind", ["rank file", "rewritten safetensors", "copied safetensors", "other file"])
def test_disk_full_names_the_file_and_keeps_the_old_output(old_output, monkeypatch, kind):
    src, out = old_output
    before = tree(out)
    names = enospc_where(kind, monkeypatch)
    result = runner.invoke(app, ["convert", str(src), str(out), "--ranks", "2", "--preset", "llama", "--overwrite",
                                 "--copy-mode", "copy"])
    line = one_line_error(result, f"error: {out}/{names}", f": no space left on device; {out} unchanged")
    assert ".shardprep-tmp-" not in line, "names the file as it would be in OUT, not the staging path"
    assert tree(out) == before and validate(out).ok
    assert hidden_entries(out.parent) == []


# -- what is read from the source ----------------------------------------------------------------------

@pytest.fixture
def src_copy(checkpoint_cache, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoint_cache("llama", sharded=True), src)
    return src


def test_copied_files_keep_their_mode_bits(src_copy, tmp_path):
    (src_copy / "tokenizer.json").chmod(0o600)
    (src_copy / "modeling_tiny.py").write_text("print('custom code')\n")
    (src_copy / "modeling_tiny.py").chmod(0o755)
    index = json.loads((src_copy / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for shard in shards:
        (src_copy / shard).chmod(0o640)
    out = tmp_path / "out"
    summary = convert(src_copy, out, 2, preset="llama", copy_mode="copy")
    mode = {p: stat.S_IMODE((out / p).stat().st_mode)
            for p in ["tokenizer.json", "modeling_tiny.py", *summary.copied_files]}
    assert mode["tokenizer.json"] == 0o600 and mode["modeling_tiny.py"] == 0o755
    assert summary.copied_files and all(mode[name] == 0o640 for name in summary.copied_files)


@pytest.mark.parametrize("victim", ["config.json", "shard"])
def test_a_symlink_leaving_the_source_is_refused(src_copy, tmp_path, victim):
    secret = tmp_path / "elsewhere" / "secret.json"
    secret.parent.mkdir()
    if victim == "shard":
        index = json.loads((src_copy / "model.safetensors.index.json").read_text())
        victim = sorted(set(index["weight_map"].values()))[0]
    shutil.move(src_copy / victim, secret)
    (src_copy / victim).symlink_to(secret)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(src_copy), str(out), "--ranks", "2", "--preset", "llama"])
    one_line_error(result, f"{src_copy / victim}: is a symlink to {secret}, outside the source")
    assert not out.exists()


def test_a_symlink_inside_the_source_is_followed(src_copy, tmp_path):
    (src_copy / "extra").mkdir()
    shutil.move(src_copy / "tokenizer.json", src_copy / "extra" / "tokenizer.json")
    (src_copy / "tokenizer.json").symlink_to("extra/tokenizer.json")
    out = tmp_path / "out"
    convert(src_copy, out, 2, preset="llama")
    assert not (out / "tokenizer.json").is_symlink()
    assert (out / "tokenizer.json").read_bytes() == (src_copy / "extra" / "tokenizer.json").read_bytes()


def test_hub_snapshot_links_may_reach_the_repo_blobs_but_nothing_further(checkpoint_cache, tmp_path):
    cache = tmp_path / "hub"
    commit = make_hub_cache(cache, "tiny-org/tiny-llama", checkpoint_cache("llama", sharded=True))
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / commit
    convert(snapshot, tmp_path / "ok", 2, preset="llama")  # every file links to ../../blobs/<sha>
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside)
    with pytest.raises(SourceError, match="is a symlink to .*outside the source"):
        convert(snapshot, tmp_path / "bad", 2, preset="llama")
    assert not (tmp_path / "bad").exists()


# -- leftovers of killed runs ----------------------------------------------------------------------

def test_abandoned_staging_directories_are_removed_but_never_a_live_one(old_output, tmp_path):
    src, out = old_output
    abandoned = tmp_path / ".out.shardprep-tmp-abcd1234"
    shutil.copytree(out, abandoned)  # as complete as it gets: killed just before the final rename
    other_abandoned = tmp_path / ".other.shardprep-tmp-zz99__00"
    other_abandoned.mkdir()
    live = tmp_path / ".busy.shardprep-tmp-live0000"
    live.mkdir()
    not_ours = tmp_path / ".out.shardprep-tmp-MINE"
    not_ours.mkdir()
    assert is_staging_dir(abandoned) and not validate(abandoned).ok
    # A live writer into `busy`, in another process, holding its lock.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX);"
        " print('locked', flush=True); sys.stdin.read()"), str(tmp_path / ".busy.shardprep-lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        convert(src, out, 2, preset="llama", overwrite=True)
        assert not abandoned.exists() and not other_abandoned.exists()
        assert live.exists() and not_ours.exists()
    finally:
        holder.communicate("")
    convert(src, tmp_path / "third", 2, preset="llama")
    assert not live.exists(), "its writer is gone now"
    assert hidden_entries(tmp_path) == [".out.shardprep-tmp-MINE"]


def test_a_lock_held_elsewhere_refuses_with_one_line(old_output):
    src, out = old_output
    fd = os.open(out.parent / ".out.shardprep-lock", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"4242\n")
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX);"
            " print('locked', flush=True); sys.stdin.read()"), str(out.parent / ".out.shardprep-lock")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        before = tree(out)
        result = runner.invoke(app, ["convert", str(src), str(out), "--ranks", "2", "--preset", "llama",
                                     "--overwrite"])
        holder.communicate("")
    finally:
        os.close(fd)
    one_line_error(result, f"{out}: another shardprep (pid 4242) is writing it right now")
    assert tree(out) == before


def test_flock_is_what_the_lock_uses(tmp_path):
    # The lock must be an flock on the file next to OUT, so a killed writer's lock is freed by the kernel.
    with staged_output(tmp_path / "out"):
        fd = os.open(tmp_path / ".out.shardprep-lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert hidden_entries(tmp_path) == []


# -- open files ------------------------------------------------------------------------------------

def test_copies_keep_open_files_bounded(src_copy, tmp_path):
    for i in range(300):
        (src_copy / f"notes-{i:03d}.md").write_text(f"note {i}\n")
    out = tmp_path / "out"
    pid = os.fork()
    if pid == 0:  # a child with few file descriptors: a copy path that leaked one per file would fail
        code = 1
        try:
            open_now = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            convert(src_copy, out, 2, preset="llama", copy_mode="copy")
            code = 0
        except BaseException as exc:
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(list(out.glob("notes-*.md"))) == 300 and validate(out).ok
