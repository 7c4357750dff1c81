"""`convert` of a hub repo id fetches the source a layer at a time (prep/hub/stream.py): the disk holds the output
plus a file or two of the source, what is fetched is checked against the hub's checksums, and the output is the
one a conversion of the local directory gives.

A local stand-in (tests/support/fake_hub.py) serves tiny checkpoints written by save_pretrained, sharded into many small
files (`max_shard_size="40KB"`), so that a layer's tensors span files as they do in real checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from support.fake_hub import FakeHub, cut_short, flipped_byte
from support.fp8_fixture import quantize_checkpoint_fp8

from shardprep.errors import HubError
from shardprep.manifests.manifest import MANIFEST_NAME, load_manifest, rank_file_name
from shardprep.prep.convert import convert
from shardprep.prep.hub import stream
from shardprep.prep.requant_jobs import RequantOptions

REPO = "tiny-org/tiny-llama"
ENV_DROPPED = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT", "SHARDPREP_DEBUG")


@pytest.fixture(scope="module")
def src(checkpoint_cache):
    return checkpoint_cache("llama", sharded=True, layers=4)


@pytest.fixture(scope="module")
def local_out(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    convert(src, out, 2, preset="llama")
    return out


def shard_sizes(src):
    return {p.name: p.stat().st_size for p in src.glob("*.safetensors")}


def disk_usage(directory, *, beside_the_output=False):
    """Blocks in use under `directory`, as `du` counts them; `beside_the_output`: only files no other directory
    links to (what the fetch directory costs beyond the output: its hard links to the staging directory's rank
    files and replicated files share their blocks)."""
    stats = [p.lstat() for p in directory.rglob("*") if p.is_file()]
    return sum(st.st_blocks * 512 for st in stats if not beside_the_output or st.st_nlink == 1)


def measured_peaks(monkeypatch):
    """The fetch directory's real disk use beside the output, right after each fetch (its peaks), filled as a
    conversion in this process runs."""
    peaks = []
    real_fetch = stream.HubSource.fetch

    def measured_fetch(self, name):
        size = real_fetch(self, name)
        peaks.append(disk_usage(self.fetch_dir, beside_the_output=True))
        return size

    monkeypatch.setattr(stream.HubSource, "fetch", measured_fetch)
    return peaks


def assert_same_output(out, local_out):
    """Every file byte for byte; the manifest apart from where the source came from."""
    ours = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    theirs = sorted(p.relative_to(local_out).as_posix() for p in local_out.rglob("*") if p.is_file())
    assert ours == theirs
    for rel in ours:
        if rel != MANIFEST_NAME:
            assert (out / rel).read_bytes() == (local_out / rel).read_bytes(), rel
    a, b = (json.loads((d / MANIFEST_NAME).read_text()) for d in (out, local_out))
    assert a["source"]["repo_id"] == REPO and b["source"]["repo_id"] is None
    for m in (a, b):
        m.pop("source")
        m.pop("created_at", None)
        m.pop("manifest_xxh3_128")  # the manifest's checksum of itself, its source record included
    assert a == b


def test_convert_from_the_hub_holds_a_layer_of_source_on_disk_and_matches_a_local_convert(
        src, local_out, tmp_path, monkeypatch):
    sizes = shard_sizes(src)
    assert len(sizes) >= 6, sizes  # enough files that holding them all would show
    peaks = measured_peaks(monkeypatch)
    out = tmp_path / "out"
    with FakeHub({REPO: src}) as hub:
        hub.serve_this_process(monkeypatch)
        hub.page_size = 4  # the file list in pages, each naming the next, as the hub pages a long one
        summary = convert(REPO, out, 2, preset="llama")
        assert len([r for r in hub.requests if "/tree/" in r[1]]) > 3
        fetched = {name: hub.fetched(name) for name in sizes}
    assert_same_output(out, local_out)
    assert fetched == {name: 1 for name in sizes}  # each shard downloaded once
    small = sum(p.stat().st_size for p in src.iterdir() if not p.name.endswith(".safetensors"))
    two_largest = sum(sorted(sizes.values())[-2:])
    # The source on disk never exceeded the small files plus two shard files (a layer spans at most two here),
    # block rounding included; the whole source is more than twice that.
    assert max(peaks) <= small + two_largest + 4096 * (len(peaks) + 1), (max(peaks), small, two_largest)
    assert sum(sizes.values()) > 2 * max(peaks)
    assert summary.source_peak_bytes is not None and summary.source_peak_bytes <= max(peaks)
    assert not stream.fetch_dir_for(out).exists()
    print(f"source {sum(sizes.values())} B in {len(sizes)} files; peak on disk {max(peaks)} B "
          f"(feed's count {summary.source_peak_bytes} B); output {disk_usage(out)} B")


def test_a_single_file_checkpoint_converts_as_a_local_one(checkpoint_cache, tmp_path, monkeypatch):
    # One file that every layer reads: it is on disk for the whole conversion, and no longer.
    single = checkpoint_cache("llama")
    local = tmp_path / "local"
    convert(single, local, 2, preset="llama")
    with FakeHub({REPO: single}) as hub:
        hub.serve_this_process(monkeypatch)
        summary = convert(REPO, tmp_path / "out", 2, preset="llama")
    assert_same_output(tmp_path / "out", local)
    assert summary.source_peak_bytes == sum(p.stat().st_size for p in single.iterdir())


def run_cli(args, tmp_path, endpoint):
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROPPED}
    env |= {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "SHARDPREP_HUB_TIMEOUT": "5"}
    return subprocess.run([sys.executable, "-m", "shardprep", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def one_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def assert_nothing_half_written(tmp_path, refused):
    """No output and no staging directory; what is kept for the next run to resume from holds no half-fetched
    file and not the refused one."""
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".shardprep-tmp-" in p.name]
    kept = stream.fetch_dir_for(tmp_path / "out")
    assert not list(kept.rglob("*.part")) and not (kept / refused).exists()


@pytest.mark.parametrize("case", ["bytes flipped in transit", "a wrong sha256 in the file list"])
def test_a_file_whose_bytes_do_not_match_its_sha256_is_refused_in_one_line(src, tmp_path, case):
    name = sorted(shard_sizes(src))[2]
    with FakeHub({REPO: src}) as hub:
        if case == "bytes flipped in transit":
            hub.misbehave(name, flipped_byte())
        else:
            hub.listed[name] = {"type": "file", "path": name, "size": shard_sizes(src)[name], "oid": "0" * 40,
                                "lfs": {"oid": "ab" * 32, "size": shard_sizes(src)[name], "pointerSize": 134}}
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "llama"], tmp_path,
                       hub.endpoint)
    line = one_line(proc)
    assert f"{REPO}/{name}: the fetched bytes' sha256 is" in line and "refused" in line, line
    assert_nothing_half_written(tmp_path, name)


def test_a_conversion_cut_in_the_middle_resumes_fetching_only_what_it_has_not_converted(
        src, local_out, tmp_path, monkeypatch):
    names = sorted(shard_sizes(src))
    cut = names[len(names) // 2]
    out = tmp_path / "out"
    with FakeHub({REPO: src}) as hub:
        hub.serve_this_process(monkeypatch)
        hub.misbehave(cut, cut_short(downloads_only=True))  # every try: the download is cut, and the run fails
        with pytest.raises(HubError, match=f"{cut}: .* cut the answer short"):
            convert(REPO, out, 2, preset="llama")
        first = {name: hub.fetched(name) for name in names}
    assert_nothing_half_written(tmp_path, cut)
    assert first[cut] == 3 and all(first[n] == 1 for n in names if n < cut)  # the files fetched, in layer order
    kept = stream.fetch_dir_for(out)
    recorded = json.loads((kept / "progress.json").read_text())
    assert recorded["layers"], "layers were written before the cut"
    # Converted: each file whose replicated part is recorded. Fetched and checked, not yet converted: the files
    # still in the fetch directory (a file takes its name only once checked). Neither is fetched again.
    converted, on_disk = set(recorded["files"]), {n for n in names if (kept / n).is_file()}
    assert cut not in converted | on_disk and len(converted) >= 3, (converted, on_disk)
    with FakeHub({REPO: src}) as hub:
        hub.serve_this_process(monkeypatch)
        convert(REPO, out, 2, preset="llama")
        second = {name: hub.fetched(name) for name in names}
    # Only what the first run had not converted (nor kept) is fetched again, each once; the cut file among them.
    assert second == {name: int(name not in converted | on_disk) for name in names}, (first, second, converted)
    assert second[cut] == 1
    print(f"cut at {cut}: first run wrote {len(recorded['layers'])} layers, converted {len(converted)} files, "
          f"kept {len(on_disk)}; second run fetched {sum(second.values())} of {len(names)} shard files")
    assert_same_output(out, local_out)
    assert not stream.fetch_dir_for(out).exists()


def test_a_saved_layer_whose_chunk_does_not_match_its_checksum_is_written_again(src, local_out, tmp_path,
                                                                                monkeypatch):
    # The rank files a failed run kept are checked before they are taken back: a layer whose chunk changed on
    # disk since (a crash before the page cache reached it) is written again from its source, not published.
    names = sorted(shard_sizes(src))
    out = tmp_path / "out"
    with FakeHub({REPO: src}) as hub:
        hub.serve_this_process(monkeypatch)
        hub.misbehave(names[len(names) // 2], cut_short(downloads_only=True))
        with pytest.raises(HubError):
            convert(REPO, out, 2, preset="llama")
    kept = stream.fetch_dir_for(out)
    assert json.loads((kept / "progress.json").read_text())["layers"]
    first_layer = load_manifest(local_out).layers[0]
    saved = kept / "written" / rank_file_name(0, 2)
    with open(saved, "r+b") as f:
        f.seek(first_layer.file_offset)
        byte = f.read(1)
        f.seek(first_layer.file_offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with FakeHub({REPO: src}) as hub:
        hub.serve_this_process(monkeypatch)
        convert(REPO, out, 2, preset="llama")
        again = [n for n in names if hub.fetched(n)]
    assert_same_output(out, local_out)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    layer_files = {weight_map[e.name] for e in first_layer.entries}
    assert layer_files and layer_files <= set(again), (layer_files, again)  # fetched again to write the layer


def test_a_shard_whose_listed_size_differs_from_its_header_is_refused_before_any_download(src, tmp_path):
    name = sorted(shard_sizes(src))[1]
    size = shard_sizes(src)[name]
    with FakeHub({REPO: src}) as hub:
        hub.listed[name] = {"type": "file", "path": name, "size": size + 1, "oid": "0" * 40,
                            "lfs": {"oid": "ab" * 32, "size": size + 1, "pointerSize": 134}}
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "llama"], tmp_path,
                       hub.endpoint)
        downloads = hub.fetched("*.safetensors")
    line = one_line(proc)
    assert f"{REPO}/{name}: {size} bytes by its header" in line and f"has {size + 1} bytes in" in line, line
    assert downloads == 0 and not (tmp_path / "out").exists()


def test_a_transfer_cut_in_the_middle_is_one_line_from_the_cli(src, tmp_path):
    name = sorted(shard_sizes(src))[3]
    with FakeHub({REPO: src}) as hub:
        hub.misbehave(name, cut_short())
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "llama"], tmp_path,
                       hub.endpoint)
    assert "cut the answer short" in one_line(proc)
    assert_nothing_half_written(tmp_path, name)


def test_the_cli_says_what_it_fetched_and_the_peak_on_disk(src, tmp_path):
    with FakeHub({REPO: src}) as hub:
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "llama"], tmp_path,
                       hub.endpoint)
        again = run_cli(["convert", REPO, tmp_path / "out2", "--ranks", "2", "--preset", "llama", "--json"],
                        tmp_path, hub.endpoint)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fetched ") and "a layer at a time: at most" in last, proc.stdout
    summary = json.loads(again.stdout)
    assert 0 < summary["source_peak_bytes"] < sum(shard_sizes(src).values()) < summary["fetched_bytes"]


def test_keep_source_downloads_the_snapshot_into_the_cache(src, local_out, tmp_path):
    with FakeHub({REPO: src}) as hub:
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "llama", "--keep-source"],
                       tmp_path, hub.endpoint)
    assert proc.returncode == 0, proc.stderr
    assert_same_output(tmp_path / "out", local_out)
    snapshots = list((tmp_path / "cache").glob("models--tiny-org--tiny-llama/snapshots/*"))
    assert len(snapshots) == 1 and {p.name for p in snapshots[0].iterdir()} >= set(shard_sizes(src))


@pytest.fixture(scope="module")
def fp8_src(checkpoint_cache, tmp_path_factory):
    """A block-FP8 DeepSeek-V3 as DeepSeek publishes one (amax / 448 scales, each beside its weight), in many files."""
    return quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", sharded=True, hidden=160),
                                   tmp_path_factory.mktemp("fp8") / "ds-fp8")


# Two worker threads: the requant runs ahead of the writer, so a job started on a file still to come (or dropped)
# would fail the conversion.
AHEAD = RequantOptions(workers=2)


@pytest.fixture(scope="module")
def fp8_local_out(fp8_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8-local") / "out"
    convert(fp8_src, out, 2, preset="deepseek-v3", requant=AHEAD)
    return out


def test_a_block_fp8_checkpoint_is_requantized_a_file_at_a_time_as_a_local_convert_does(
        fp8_src, fp8_local_out, tmp_path, monkeypatch):
    sizes = shard_sizes(fp8_src)
    peaks = measured_peaks(monkeypatch)
    with FakeHub({REPO: fp8_src}) as hub:
        hub.serve_this_process(monkeypatch)
        summary = convert(REPO, tmp_path / "out", 2, preset="deepseek-v3", requant=AHEAD)
        fetched = {name: hub.fetched(name) for name in sizes}
    assert summary.requantized_weights > 10 and summary.quantization["scale_format"] == "f32"
    assert_same_output(tmp_path / "out", fp8_local_out)
    assert fetched == {name: 1 for name in sizes}
    assert len(sizes) >= 6 and sum(sizes.values()) > 2 * max(peaks), (sizes, peaks)
    print(f"{summary.requantized_weights} weights requantized; source {sum(sizes.values())} B in {len(sizes)} "
          f"files, peak on disk {max(peaks)} B")


def test_a_requantizing_conversion_cut_in_the_middle_resumes_to_the_same_output(fp8_src, fp8_local_out, tmp_path,
                                                                                monkeypatch):
    names = sorted(shard_sizes(fp8_src))
    weight_map = json.loads((fp8_src / "model.safetensors.index.json").read_text())["weight_map"]
    last = max(int(n.split(".")[2]) for n in weight_map if n.startswith("model.layers."))
    cut = weight_map[f"model.layers.{last}.self_attn.o_proj.weight"]  # read by the last layer: earlier ones recorded
    out = tmp_path / "out"
    with FakeHub({REPO: fp8_src}) as hub:
        hub.serve_this_process(monkeypatch)
        hub.misbehave(cut, cut_short(downloads_only=True))
        with pytest.raises(HubError, match=f"{cut}: .* cut the answer short"):
            convert(REPO, out, 2, preset="deepseek-v3", requant=AHEAD)
    recorded = json.loads((stream.fetch_dir_for(out) / "progress.json").read_text())
    assert recorded["layers"] and recorded["files"], recorded.keys()  # the resumed run skips both kinds of work
    with FakeHub({REPO: fp8_src}) as hub:
        hub.serve_this_process(monkeypatch)
        convert(REPO, out, 2, preset="deepseek-v3", requant=AHEAD)
        again = sum(hub.fetched(name) for name in names)
    assert 0 < again < len(names)
    assert_same_output(out, fp8_local_out)


def test_a_weight_whose_scale_is_in_another_file_is_refused_in_one_line(fp8_src, tmp_path):
    from safetensors.torch import load_file, save_file

    split = tmp_path / "split"
    shutil.copytree(fp8_src, split)
    index_path = split / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    scale = next(n for n in sorted(index["weight_map"]) if n.endswith("mlp.experts.0.down_proj.weight_scale_inv"))
    home = index["weight_map"][scale]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    tensors = load_file(split / home)
    moved = tensors.pop(scale)
    save_file(tensors, split / home, metadata={"format": "pt"})
    save_file({**load_file(split / other), scale: moved}, split / other, metadata={"format": "pt"})
    index["weight_map"][scale] = other
    index_path.write_text(json.dumps(index))
    with FakeHub({REPO: split}) as hub:
        proc = run_cli(["convert", REPO, tmp_path / "out", "--ranks", "2", "--preset", "deepseek-v3"], tmp_path,
                       hub.endpoint)
        downloads = hub.fetched("*.safetensors")
    line = one_line(proc)
    weight = scale.removesuffix("_scale_inv")
    assert f"{weight!r} is in {home} and its scale in {other}" in line and "--keep-source" in line, line
    assert downloads == 0 and not (tmp_path / "out").exists()
