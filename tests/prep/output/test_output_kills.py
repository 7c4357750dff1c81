"""No data lost under SIGKILL, SIGTERM and a second writer: real processes, bounded iterations.

After a kill at any moment OUT is the complete old output or the complete new one, no staging directory
validates, and the next convert into the same parent leaves nothing behind.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.paused import wait_for
from typer.testing import CliRunner

import shardprep.prep.output.output_dir as output_dir
from shardprep.cli import app
from shardprep.prep.convert import convert
from shardprep.prep.output.output_dir import is_staging_dir
from shardprep.prep.validate import validate

ROOT = Path(__file__).resolve().parents[3]
# Every filesystem call convert makes through `os` (file objects' writes end in fsync/replace, also counted).
STEPS = ("open", "mkdir", "rename", "replace", "unlink", "rmdir", "link", "pwrite", "fsync", "ftruncate", "chmod",
         "sendfile", "copy_file_range", "scandir")
# Imports first, then wait: the kill lands in the convert, not in the interpreter's startup.
DRIVER = """
import pathlib, sys, time
import shardprep.prep.convert, shardprep.prep.output.writer as writer
from shardprep.cli import app
ready, go, args = sys.argv[1], sys.argv[2], sys.argv[3:]
if go == "-":
    print("ready", flush=True)
    sys.stdin.readline()
else:
    copy_other_files = writer._copy_other_files

    def pause_inside_the_transaction(directory, plan):
        pathlib.Path(ready).write_text(str(directory))
        while not pathlib.Path(go).exists():
            time.sleep(0.01)
        copy_other_files(directory, plan)

    writer._copy_other_files = pause_inside_the_transaction
sys.argv = ["shardprep", *args]
app()
"""


def world_size(out):
    return json.loads((out / "shard_manifest.json").read_text())["world_size"]


def staging_dirs(parent):
    return [p for p in parent.iterdir() if is_staging_dir(p)]


def assert_old_or_new(out, sizes):
    report = validate(out)
    assert report.ok, report.problems
    assert world_size(out) in sizes
    leftovers = staging_dirs(out.parent)
    # Each convert removes its dead predecessors before it stages, so leftovers never pile up.
    assert len(leftovers) <= 1, leftovers
    for leftover in leftovers:
        assert not validate(leftover).ok, f"{leftover} validates"


class KillingConverter:
    """Converts in forked children that SIGKILL themselves at their k-th filesystem call.

    The children fork from a small helper process (shardprep only, no torch), which makes a fork cheap.
    fsync is counted but skipped: it guards against power loss, not SIGKILL (the page cache outlives the
    process), and on a busy shared disk it makes each run several times slower.
    """

    def __init__(self, src, out, ranks):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", FORKER, str(src), str(out), str(ranks), ",".join(STEPS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, step):
        """Kill at call `step` (0: never). Returns the calls made when the child finished, None when killed."""
        self.proc.stdin.write(f"{step}\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["killed"]:
            return None
        assert reply["exit"] == 0, "the child failed without being killed"
        return reply["calls"]

    def close(self):
        self.proc.communicate("")


FORKER = """
import json, os, signal, sys, traceback
import shardprep.prep.output.output_dir as output_dir
import shardprep.prep.output.writeback as writeback
from shardprep.prep.convert import convert
# No background writeback thread: the requests it drops at the end vary from run to run, and so would the
# number of calls, and what call step k is.
writeback._sync_file_range = None
src, out, ranks, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
for line in sys.stdin:
    kill_at = int(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            calls, write = [], os.write

            def counted(name, fn):
                def call(*args, **kwargs):
                    calls.append(name)
                    if len(calls) == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)
                return call

            os.fsync = lambda fd: None
            for name in steps:
                setattr(os, name, counted(name, getattr(os, name)))
            output_dir.exchange = counted("exchange", output_dir.exchange)
            convert(src, out, ranks, preset="llama", overwrite=True)
            write(w, " ".join(calls).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        calls = f.read().split()
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    print(json.dumps({"killed": killed, "exit": os.waitstatus_to_exitcode(status), "calls": calls}), flush=True)
"""


@pytest.fixture
def llama(checkpoint_cache):
    return checkpoint_cache("llama", sharded=True)


def test_sigkill_at_every_filesystem_step_of_an_overwrite_leaves_old_or_new(llama, tmp_path):
    old = tmp_path / "old"
    convert(llama, old, 3, preset="llama")
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / "out"

    def reset():  # every run starts from the same state, so step k is the same call in every run
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(old, out)

    reset()
    converter = KillingConverter(llama, out, 2)
    calls = converter.run(0)
    assert world_size(out) == 2
    # Every call from writing the manifest to the swap (fsyncs and the opens for them aside), then every
    # 4th while the old tree is removed, the last three (releasing the lock), and every 8th call before.
    manifest = len(calls) - calls[::-1].index("replace")
    swap = max(i for i, name in enumerate(calls, 1) if name in ("exchange", "rename"))
    steps = sorted({i for i in range(manifest - 1, swap + 3) if calls[i - 1] not in ("open", "fsync")}
                   | set(range(swap + 3, len(calls) - 2, 4)) | set(range(len(calls) - 2, len(calls) + 1))
                   | set(range(1, manifest, 8)))
    for step in steps:
        reset()
        assert converter.run(step) is None, f"step {step} of {len(calls)} was not reached"
        assert_old_or_new(out, {3, 2})
        # What the next convert into this parent does first: remove what the killed run left.
        output_dir._remove_abandoned(parent, own_name="")
        assert sorted(p.name for p in parent.iterdir()) == ["out"], f"killed at step {step}: {calls[step - 1]}"
    converter.close()
    convert(llama, out, 3, preset="llama", overwrite=True)
    assert sorted(p.name for p in parent.iterdir()) == ["out"]


def start_driver(src, out, ranks, ready="-", go="-", *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", DRIVER, str(ready), str(go), "convert", str(src), str(out), "--ranks", str(ranks),
            "--preset", "llama", "--quiet", *extra]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_sigkill_of_the_cli_at_random_moments_leaves_old_or_new(llama, tmp_path):
    out = tmp_path / "out"
    convert(llama, out, 3, preset="llama")
    proc = start_driver(llama, out, 2, "-", "-", "--overwrite")
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    proc.communicate("\n")
    duration = time.perf_counter() - t0
    assert proc.returncode == 0 and world_size(out) == 2
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(2):
        before = world_size(out)
        proc = start_driver(llama, out, 3 if before == 2 else 2, "-", "-", "--overwrite")
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("\n")
        proc.stdin.flush()
        time.sleep(rng.uniform(0, duration))
        proc.kill()
        proc.communicate()
        assert_old_or_new(out, {2, 3})
    convert(llama, out, 2, preset="llama", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], f"seed {seed}"


def tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_sigterm_stops_a_convert_like_ctrl_c(llama, tmp_path):
    out = tmp_path / "out"
    convert(llama, out, 3, preset="llama")
    before = tree(out)
    proc = start_driver(llama, out, 2, tmp_path / "ready", tmp_path / "go", "--overwrite")
    staging = wait_for(tmp_path / "ready", proc)
    assert staging.is_dir() and is_staging_dir(staging)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip() == f"interrupted by SIGTERM; {out} unchanged"
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ready"], "staging and lock removed"


def test_a_second_convert_into_the_same_output_is_refused_while_the_first_runs(llama, tmp_path):
    out = tmp_path / "out"
    convert(llama, out, 3, preset="llama")
    first = start_driver(llama, out, 2, tmp_path / "ready", tmp_path / "go", "--overwrite")
    try:
        staging = wait_for(tmp_path / "ready", first)
        second = CliRunner().invoke(app, ["convert", str(llama), str(out), "--ranks", "4", "--preset", "llama",
                                          "--overwrite"])
        assert second.exit_code == 2
        assert second.stderr.strip() == (f"error: {out}: another shardprep (pid {first.pid}) is writing it right now; "
                                         "wait for it to finish or choose another output directory")
        assert world_size(out) == 3
        # A convert into another directory of the same parent runs, and leaves the live staging directory alone.
        convert(llama, tmp_path / "other", 2, preset="llama")
        assert staging.is_dir()
    finally:
        (tmp_path / "go").touch()
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert world_size(out) == 2 and validate(out, source=llama).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "other", "out", "ready"]
