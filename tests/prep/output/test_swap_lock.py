"""Readers never see a half-replaced directory: they hold the readers' lock that the swap of --overwrite waits for.

The CLI tests run real processes. The deterministic ones hold the race window open on purpose (a reader
that has read the old manifest waits for the swap before reading on, a writer that has staged waits for
that reader): without the lock the swap lands in the window every time. The race test runs the two
side by side with nothing held open.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import shardprep.loader.rank_shards as rank_shards
import shardprep.manifests.swap_lock as swap_lock
import shardprep.prep.export as export_module
import shardprep.prep.reshard as reshard_module
from shardprep.errors import OutputError, ShardprepError
from shardprep.loader import iter_replicated, load_replicated, open_rank
from shardprep.loader.full_targets import iter_full_targets
from shardprep.manifests.manifest import MANIFEST_NAME, load_manifest
from shardprep.manifests.swap_lock import reading, swap_lock_path, swapping
from shardprep.prep.convert import convert
from shardprep.prep.export import export
from shardprep.prep.output.output_dir import _remove_abandoned, staged_output
from shardprep.prep.reshard import reshard
from shardprep.prep.validate import validate

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# A writer (`shardprep ARGS...`) that, once its new output is staged and fsynced, waits until the reader has
# read the old manifest, then swaps at once and says so.
WRITER = """
import pathlib, sys, time
import shardprep.prep.output.output_dir as output_dir
from shardprep.cli import app
marks, args = pathlib.Path(sys.argv[1]), sys.argv[2:]
fsync_tree, exchange = output_dir._fsync_tree, output_dir.exchange

def staged_then_wait_for_the_reader(root):
    fsync_tree(root)
    (marks / "staged").touch()
    deadline = time.monotonic() + 120
    while not (marks / "read-manifest").exists() and time.monotonic() < deadline:
        time.sleep(0.005)

def exchange_and_say(a, b):
    exchange(a, b)
    if ".exchange-probe" not in str(a):  # the swap, not the probe of the filesystem before staging
        (marks / "swapped").touch()

output_dir._fsync_tree = staged_then_wait_for_the_reader
output_dir.exchange = exchange_and_say
sys.argv = ["shardprep", *args]
app()
"""

# `shardprep validate OUT` that, having read the manifest, waits for the writer to be ready to swap and then
# gives the swap WINDOW seconds to happen before it reads the files the manifest lists.
READER = """
import pathlib, sys, time
import shardprep.prep.validate as validate_module
from shardprep.cli import app
marks, window, out = pathlib.Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
read_manifest_file = validate_module.read_manifest_file

def read_then_hold_the_window_open(root, **kwargs):
    result = read_manifest_file(root, **kwargs)
    (marks / "read-manifest").touch()
    deadline = time.monotonic() + 120
    while not (marks / "staged").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    deadline = time.monotonic() + window
    while not (marks / "swapped").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    return result

def check_the_last_files_and_look(root, manifest, report, *meter):
    index = check_replicated(root, manifest, report, *meter)
    print("swapped while reading:", (marks / "swapped").exists(), flush=True)
    return index

validate_module.read_manifest_file = read_then_hold_the_window_open
check_replicated, validate_module._check_replicated = validate_module._check_replicated, check_the_last_files_and_look
app(["validate", out])
"""

# Runs `shardprep validate OUT` in a loop in one process until STOP exists, keeping the count of runs in COUNT;
# prints one JSON line per failure.
VALIDATE_LOOP = """
import json, os, pathlib, sys, time
from typer.testing import CliRunner
from shardprep.cli import app
out, stop, count = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
runner, runs = CliRunner(), 0
runner.invoke(app, ["validate", out])
print("ready", flush=True)
while not stop.exists():
    result = runner.invoke(app, ["validate", out])
    runs += 1
    if result.exit_code != 0:
        print(json.dumps({"exit": result.exit_code, "output": result.output[-400:]}), flush=True)
    count.with_suffix(".part").write_text(str(runs))
    os.replace(count.with_suffix(".part"), count)
    time.sleep(0.01)  # a gap for the swap, as between two runs of the command
print(json.dumps({"runs": runs}), flush=True)
"""

# Holds `reading(OUT)` until stdin closes.
HOLDER = """
import sys
from shardprep.manifests.swap_lock import reading
with reading(sys.argv[1]) as held:
    print("held" if held else "not held", flush=True)
    sys.stdin.read()
"""


def world_size(out: Path) -> int:
    return json.loads((out / MANIFEST_NAME).read_text())["world_size"]


def entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.fixture
def llama(checkpoint_cache):
    return checkpoint_cache("llama", sharded=True)


def writer_and_reader(tmp_path, command, out, window):
    """Run WRITER (`shardprep COMMAND...`) and READER (validate OUT) side by side; their (returncode, output)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(marks), *command], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(marks), str(window), str(out)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_out, _ = reader.communicate(timeout=300)
    write_out, _ = writer.communicate(timeout=300)
    return (reader.returncode, read_out), (writer.returncode, write_out)


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_validate_sees_the_old_output_whole_while_overwrite_swaps_in_the_new(command, llama, tmp_path):
    if command == "convert":
        out = tmp_path / "out"
        convert(llama, out, 2, preset="llama")
        args = ["convert", str(llama), str(out), "--ranks", "4", "--preset", "llama", "--overwrite", "--quiet"]
    else:
        convert(llama, tmp_path / "out2", 2, preset="llama")
        out = tmp_path / "new"
        reshard(tmp_path / "out2", out, 3)
        args = ["reshard", str(tmp_path / "out2"), str(out), "--ranks", "4", "--overwrite", "--quiet"]
    # Without the lock the swap lands inside the window at once; with it, the swap waits and the
    # window closes unused after this long.
    (read_code, read_out), (write_code, write_out) = writer_and_reader(tmp_path, args, out, window=1.0)
    assert read_code == 0 and read_out.splitlines()[1].startswith("valid"), read_out
    assert "swapped while reading: False" in read_out, "the swap did not wait for the reader"
    assert write_code == 0, write_out
    assert world_size(out) == 4 and validate(out).ok
    assert not list(tmp_path.glob(f".*{swap_lock.SWAP_LOCK_SUFFIX}")), "lock files are removed"


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_validate_in_a_loop_during_overwrites_never_reports_a_good_output_invalid(command, llama, tmp_path):
    # The race as a user meets it, nothing held open: a validate loop beside repeated --overwrite runs.
    out = tmp_path / "out"
    if command == "convert":
        convert(llama, out, 2, preset="llama")
    else:
        convert(llama, tmp_path / "src", 3, preset="llama")
        reshard(tmp_path / "src", out, 2)
    stop, count = tmp_path / "stop", tmp_path / "count"
    loop = subprocess.Popen([sys.executable, "-c", VALIDATE_LOOP, str(out), str(stop), str(count)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    overwrites = 0

    def validated() -> int:
        return int(count.read_text()) if count.exists() else 0

    try:
        assert loop.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 300  # a bound on a machine too busy to validate, never reached otherwise
        while (overwrites < 6 or validated() < 30) and time.monotonic() < deadline and loop.poll() is None:
            n = 4 if overwrites % 2 == 0 else 2
            if command == "convert":
                convert(llama, out, n, preset="llama", overwrite=True)
            else:
                reshard(tmp_path / "src", out, n, overwrite=True)
            overwrites += 1
    finally:
        stop.touch()
        output, _ = loop.communicate(timeout=300)
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    failures = [line for line in lines if "exit" in line]
    assert not failures, failures[:3]
    assert lines[-1]["runs"] >= 30, output  # validated throughout the overwrites
    assert validate(out).ok and not list(tmp_path.glob(f".*{swap_lock.SWAP_LOCK_SUFFIX}"))


def test_a_convert_staging_its_output_does_not_hold_readers_off(llama, tmp_path):
    # The writer holds the lock around the swap alone: readers run while it stages, however long.
    from test_output_kills import start_driver, wait_for

    out = tmp_path / "out"
    convert(llama, out, 3, preset="llama")
    proc = start_driver(llama, out, 2, tmp_path / "ready", tmp_path / "go", "--overwrite")
    try:
        wait_for(tmp_path / "ready", proc)  # paused inside its transaction, the new output half written
        t0 = time.monotonic()
        assert validate(out).ok and world_size(out) == 3
        assert time.monotonic() - t0 < 60  # a sanity bound: it did not wait for the writer to resume
    finally:
        (tmp_path / "go").touch()
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert world_size(out) == 2


def hold_reading(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stage_an_output(out: Path, swap_timeout: float | None = None) -> None:
    with staged_output(out, overwrite=True, swap_timeout=swap_timeout) as tmp:
        (tmp / MANIFEST_NAME).write_text("{}")
        (tmp / "new").write_text("new")


def test_the_swap_waits_for_a_reader_and_a_timeout_gives_up_naming_it(llama, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(swap_lock, "NOTICE_AFTER", 0.1)
    out = tmp_path / "out"
    convert(llama, out, 2, preset="llama")
    holder = hold_reading(out)
    try:
        with pytest.raises(OutputError) as exc:
            stage_an_output(out, swap_timeout=0.3)
        message = str(exc.value)
        assert "\n" not in message
        assert message.startswith(f"{out}: still being read after 0.3 s (pid {holder.pid}: python")
        assert message.endswith(f"run again once the readers are done; {out} unchanged")
        assert world_size(out) == 2 and validate(out).ok

        done = threading.Event()
        waiting = threading.Thread(target=lambda: (stage_an_output(out), done.set()))
        waiting.start()
        assert not done.wait(0.5) and world_size(out) == 2  # no timeout: it waits, and says for whom
        assert f"{out}: waiting for its readers (pid {holder.pid}: python" in caplog.text
    finally:
        holder.communicate("")
    waiting.join(60)
    assert done.is_set() and (out / "new").read_text() == "new"
    assert entries(tmp_path) == ["out"], "staging directories and lock files are all removed"


def test_a_process_reading_the_output_cannot_replace_it_and_is_told_at_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with reading(out), pytest.raises(OutputError, match="this process is reading it"):
        with swapping(out):
            pass


def test_reading_is_reentrant_and_leaves_no_lock_file_behind(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock = swap_lock_path(out)
    with reading(out) as outer:
        with reading(tmp_path / "." / "out") as inner:
            assert outer and inner and lock.exists()
            assert list(swap_lock._held.values()) == [[swap_lock._held[lock][0], 2]]  # one lock, two readers
        assert lock.exists()
    assert entries(tmp_path) == ["out"]


def test_a_reader_waits_for_a_swap_in_progress(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    got = []
    def read() -> None:
        try:
            got.append(validate(out))
        except ShardprepError as exc:  # an empty directory is not an output: validate cannot run on it
            got.append(exc)

    with swapping(out):
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(0.3)
        assert reader.is_alive() and not got
    reader.join(60)
    # Only once the swap was done did it look, and find no manifest.
    assert got and isinstance(got[0], ShardprepError) and "no shard_manifest.json" in str(got[0])


@pytest.mark.parametrize("failure", ["read-only filesystem", "no permission", "no locks"])
def test_a_reader_that_cannot_take_the_lock_reads_without_it(failure, llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert(llama, out, 2, preset="llama")
    if failure == "no locks":
        def flock(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(swap_lock.fcntl, "flock", flock)
    else:
        code = errno.EROFS if failure == "read-only filesystem" else errno.EACCES
        real_open = os.open

        def open_(path, flags, *args, **kwargs):
            if str(path).endswith(swap_lock.SWAP_LOCK_SUFFIX):
                raise OSError(code, os.strerror(code), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(swap_lock.os, "open", open_)
    with reading(out) as held:
        assert not held
    assert validate(out).ok
    assert open_rank(out, 1).rank == 1
    assert entries(tmp_path) == ["out"]


def test_open_rank_and_the_replicated_and_full_target_readers_hold_the_lock_while_they_read(llama, tmp_path,
                                                                                            monkeypatch):
    out = tmp_path / "out"
    convert(llama, out, 2, preset="llama")
    lock = swap_lock_path(out)
    seen = []
    check_rank_header = rank_shards.check_rank_header

    def check_and_look(*args):
        seen.append(lock.exists())
        return check_rank_header(*args)

    monkeypatch.setattr(rank_shards, "check_rank_header", check_and_look)
    open_rank(out, 0)
    assert seen == [True] and not lock.exists()
    manifest = load_manifest(out)
    real_check = rank_shards.check_replicated_file
    monkeypatch.setattr(rank_shards, "check_replicated_file",
                        lambda *args, **kwargs: (seen.append(lock.exists()), real_check(*args, **kwargs))[1])
    load_replicated(out, manifest)
    assert seen[1:] and all(seen) and not lock.exists()
    seen.clear()
    replicated = iter_replicated(out, manifest)
    next(replicated)
    assert seen and all(seen) and lock.exists()  # held between two tensors
    replicated.close()
    assert not lock.exists()
    targets = iter_full_targets(out)
    next(targets)
    with pytest.raises(OutputError, match="this process is reading it"):  # held between two tensors
        with swapping(out):
            pass
    targets.close()
    assert not lock.exists()


@pytest.mark.parametrize("command", ["reshard", "export"])
def test_reshard_and_export_hold_the_lock_on_out_while_they_read_it(command, llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert(llama, out, 2, preset="llama")
    lock = swap_lock_path(out)
    held = []
    real_read_layer = reshard_module.read_layer

    def read_and_look(*args):
        held.append(lock.exists())
        with pytest.raises(OutputError, match="this process is reading it"):
            with swapping(out):  # what an --overwrite of OUT would do now: wait for this reader
                pass
        return real_read_layer(*args)

    monkeypatch.setattr(reshard_module if command == "reshard" else export_module, "read_layer", read_and_look)
    if command == "reshard":
        reshard(out, tmp_path / "new", 3)
        assert validate(tmp_path / "new").ok
    else:
        export(out, tmp_path / "new")
        assert (tmp_path / "new" / "config.json").exists()  # a plain checkpoint: nothing for validate
    assert len(held) == len(load_manifest(out).layers) and all(held)
    assert not lock.exists()


def test_lock_files_of_killed_readers_are_removed_by_the_next_writer(llama, tmp_path):
    out = tmp_path / "out"
    convert(llama, out, 2, preset="llama")
    holder = hold_reading(out)
    holder.kill()
    holder.wait()
    lock = swap_lock_path(out)
    assert lock.exists()
    live = hold_reading(tmp_path / "other")  # another output's reader, alive: its lock file stays
    try:
        _remove_abandoned(tmp_path, own_name="")
        assert not lock.exists() and swap_lock_path(tmp_path / "other").exists()
    finally:
        live.communicate("")
    assert entries(tmp_path) == ["out"]
