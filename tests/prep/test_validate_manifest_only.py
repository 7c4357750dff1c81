"""`validate --manifest-only`: a manifest alone (as a CI repository keeps it) is checked without any weight byte."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.errors import SourceError
from shardprep.manifests.manifest import MANIFEST_NAME, seal
from shardprep.prep import validate_manifest as manifest_only
from shardprep.prep.convert import convert
from shardprep.prep.requant_jobs import RequantOptions
from shardprep.prep.source import open_source
from shardprep.prep.validate import REPORT_SCHEMA
from shardprep.prep.validate_manifest import validate_manifest

runner = CliRunner()


@pytest.fixture(scope="module")
def converted(checkpoint_cache, conversion_cache):
    src = checkpoint_cache("deepseek-v3", sharded=True)
    return src, conversion_cache(src, 3, preset="deepseek-v3")


@pytest.fixture
def repo(converted, tmp_path):
    """A CI repository's copy of the output: its manifest and nothing else."""
    deploy = tmp_path / "deploy" / "model"
    deploy.mkdir(parents=True)
    shutil.copyfile(converted[1] / MANIFEST_NAME, deploy / MANIFEST_NAME)
    return deploy


def edit(directory: Path, change, *, sealed: bool = True) -> None:
    """Change the manifest's data and, unless `sealed` is False, seal it again as convert would."""
    path = directory / MANIFEST_NAME
    data = json.loads(path.read_text())
    change(data)
    text = json.dumps(data, indent=1) + "\n"
    path.write_text(seal(text) if sealed else text)


def codes(report) -> list[str]:
    return [p.code for p in report.problems]


def test_a_manifest_alone_validates_as_a_file_a_directory_and_against_its_source(converted, repo):
    src, out = converted
    targets = sum(len(layer["entries"]) for layer in json.loads((out / MANIFEST_NAME).read_text())["layers"])
    for path in (repo, repo / MANIFEST_NAME):
        report = validate_manifest(path)
        assert report.ok and report.format_version == 2 and report.checked["targets"] == targets
        assert [w.code for w in report.warnings] == ["bytes_not_checked"]
    report = validate_manifest(repo, source=src)
    assert report.ok, report.messages
    assert report.checked["targets_checked_against_source"] == targets and "tensor data" in report.warnings[0].message
    result = runner.invoke(app, ["validate", "--manifest-only", str(repo), "--source", str(src)])
    assert result.exit_code == 0 and result.stdout.startswith(f"valid, with warnings: {repo} (manifest only")
    assert "no byte of the output was read" in result.stderr
    result = runner.invoke(app, ["validate", "--manifest-only", str(repo), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == 0 and data["schema"] == REPORT_SCHEMA and data["ok"] is True


def test_full_validation_of_a_manifest_file_points_to_manifest_only(repo):
    result = runner.invoke(app, ["validate", str(repo / MANIFEST_NAME)])
    assert result.exit_code == 2 and "--manifest-only" in result.stderr and len(result.stderr.splitlines()) == 1


def flip_last_digit_of_an_offset(path: Path) -> None:
    # The last digit of a 16-aligned offset, moved by +1 (or -9): the offset can no longer be aligned.
    text = path.read_text()
    offsets = list(re.finditer(r'"offset": ([1-9][0-9]*)', text))
    last = offsets[1].end(1) - 1
    path.write_text(text[:last] + str((int(text[last]) + 1) % 10) + text[last + 1:])


def break_the_seal(path: Path) -> None:
    text = path.read_text()
    at = text.index('"manifest_xxh3_128": "') + len('"manifest_xxh3_128": "')
    path.write_text(text[:at] + ("1" if text[at] != "1" else "2") + text[at + 1:])


def overlap_two_entries(data: dict) -> None:
    entries = data["layers"][0]["entries"]
    entries[1]["offset"] = entries[0]["offset"] + 16


def unfused_entry(data: dict) -> dict:
    """An entry of the first layer that no fused view covers (editing it leaves the views as they are)."""
    layer = data["layers"][0]
    fused = {m for view in layer["views"] for m in view["members"]}
    return next(e for e in layer["entries"] if e["name"] not in fused)


def wrong_dtype(data: dict) -> None:
    entry = unfused_entry(data)
    assert entry["dtype"] == "BF16"
    entry["dtype"] = "F16"  # the same size: the layout still holds, only the source can tell


@pytest.mark.parametrize("damage,expected,fragment,with_source", [
    (flip_last_digit_of_an_offset, {"manifest_checksum_mismatch", "manifest_invariant"}, "-aligned", False),
    (break_the_seal, {"manifest_checksum_mismatch"}, "manifest_xxh3_128 is", False),
    (overlap_two_entries, {"manifest_invariant"}, "overlaps the previous entry", False),
    (wrong_dtype, {"tensor_mismatch"}, "manifest says F16", True),
])
def test_each_damage_is_refused_with_its_code(converted, repo, damage, expected, fragment, with_source):
    src, _ = converted
    if damage in (flip_last_digit_of_an_offset, break_the_seal):
        damage(repo / MANIFEST_NAME)
    else:
        edit(repo, damage)
    if with_source:
        assert validate_manifest(repo).ok  # the manifest alone is consistent
    report = validate_manifest(repo, source=src if with_source else None)
    assert set(codes(report)) == expected and any(fragment in m for m in report.messages), report.messages
    args = ["validate", "--manifest-only", str(repo / MANIFEST_NAME), *(["--source", str(src)] if with_source else [])]
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.startswith("invalid: ")]
    summary = 1 if len(report.problems) > 1 else 0  # several problems end with a line summing them up
    assert result.exit_code == 1 and len(lines) == len(report.problems) + summary and fragment in result.stderr
    result = runner.invoke(app, [*args, "--json"])
    assert {p["code"] for p in json.loads(result.stdout)["problems"]} == expected


def truncate_to_headers(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        with open(path, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            f.truncate(8 + n)


def test_the_source_check_reads_headers_only(converted, repo, tmp_path):
    src, _ = converted
    headers = shutil.copytree(src, tmp_path / "headers-only")
    truncate_to_headers(headers)
    with pytest.raises(SourceError, match="truncated"):
        open_source(headers)  # the data region is really gone
    report = validate_manifest(repo, source=headers)
    assert report.ok and report.checked["targets_checked_against_source"] > 0, report.messages


def test_a_source_with_more_than_the_output_is_named(repo, checkpoint_cache):
    bigger = checkpoint_cache("deepseek-v3", sharded=True, layers=4)
    report = validate_manifest(repo, source=bigger)
    assert {"source_tensor_missing", "source_file_mismatch"} <= set(codes(report)), report.messages
    assert any("model.layers.3.self_attn" in m and "has no entry" in m for m in report.messages)


def test_a_target_renamed_is_not_in_the_source(converted, repo):
    def rename(data: dict) -> None:
        unfused_entry(data)["name"] += ".renamed"

    edit(repo, rename)
    assert set(codes(validate_manifest(repo, source=converted[0]))) == {
        "tensor_not_in_source", "source_tensor_missing"}


def test_a_dropped_fused_view_is_a_fused_mismatch(converted, repo):
    def drop_view(data: dict) -> None:  # the preset fuses q_a/kv_a too: drop the shared experts' view only
        views = data["layers"][0]["views"]
        data["layers"][0]["views"] = [v for v in views if "gate_up_proj" not in v["name"]]
        assert len(data["layers"][0]["views"]) == len(views) - 1

    edit(repo, drop_view)
    assert validate_manifest(repo).ok  # a layout without the view is still a valid layout
    report = validate_manifest(repo, source=converted[0])
    assert codes(report) == ["fused_mismatch"] and "gate_up_proj" in report.messages[0]


def test_a_selection_that_does_not_give_the_targets_is_a_selection_mismatch(converted, repo):
    def narrow(data: dict) -> None:
        data["selection"]["layers"] = "2-"

    edit(repo, narrow)
    report = validate_manifest(repo, source=converted[0])
    assert set(codes(report)) == {"selection_mismatch"} and "does not select it" in report.messages[0]


def test_a_preset_this_shardprep_does_not_ship_leaves_the_fused_groups_unchecked(converted, repo):
    def rename_preset(data: dict) -> None:
        data["selection"]["preset"] = "my-team-preset"

    edit(repo, rename_preset)
    report = validate_manifest(repo, source=converted[0])
    assert report.ok and [w.code for w in report.warnings] == ["bytes_not_checked", "fused_groups_unchecked"]


def test_a_rank_header_over_the_safetensors_limit_is_refused(repo, monkeypatch):
    monkeypatch.setattr(manifest_only, "MAX_HEADER_BYTES", 1000)
    report = validate_manifest(repo)
    assert codes(report) == ["invalid_safetensors"] and "more than safetensors reads" in report.messages[0]


def test_several_manifests_give_a_json_list_and_one_bad_one_fails_the_run(repo, tmp_path):
    other = shutil.copytree(repo, tmp_path / "other")
    break_the_seal(other / MANIFEST_NAME)
    result = runner.invoke(app, ["validate", "--manifest-only", str(repo), str(other), "--json"])
    reports = json.loads(result.stdout)
    assert result.exit_code == 1 and [r["ok"] for r in reports] == [True, False]
    result = runner.invoke(app, ["validate", str(repo), str(other)])
    assert result.exit_code == 2 and "--manifest-only" in result.stderr


def test_a_missing_path_or_a_directory_without_a_manifest_cannot_run(tmp_path):
    result = runner.invoke(app, ["validate", "--manifest-only", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    result = runner.invoke(app, ["validate", "--manifest-only", str(tmp_path)])
    assert result.exit_code == 2 and result.stderr.strip() == (
        f"error: {tmp_path}: no shard_manifest.json: not an output directory of `shardprep convert`")


# -- a requantized output against its block-FP8 source -------------------------------------------


@pytest.fixture(scope="module")
def fp8_converted(checkpoint_cache, tmp_path_factory):
    from support.fp8_fixture import quantize_checkpoint_fp8

    root = tmp_path_factory.mktemp("manifest-only-fp8")
    src = root / "fp8"
    quantize_checkpoint_fp8(checkpoint_cache("deepseek-v3", sharded=True, hidden=160), src)
    out = root / "out"
    # The o_proj scales are targets too: written as F8_E8M0, a quarter of their F32 source.
    convert(src, out, 2, targets=["*.self_attn.o_proj.weight", "*.self_attn.o_proj.weight_scale_inv"],
            requant=RequantOptions(scale_format="e8m0"))
    return src, out


def test_a_requantized_output_checks_against_its_fp8_source_headers(fp8_converted, tmp_path):
    src, out = fp8_converted
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copyfile(out / MANIFEST_NAME, repo / MANIFEST_NAME)
    report = validate_manifest(repo, source=src)
    assert report.ok, report.messages
    scales = [e for layer in json.loads((repo / MANIFEST_NAME).read_text())["layers"] for e in layer["entries"]
              if e["name"].endswith("_scale_inv")]
    assert scales and all(e["dtype"] == "F8_E8M0" for e in scales)

    def claim_f32_scales(data: dict) -> None:
        data["quantization"]["scale_format"] = data["requant_options"]["scale_format"] = "f32"

    edit(repo, claim_f32_scales)
    report = validate_manifest(repo, source=src)
    assert set(codes(report)) == {"tensor_mismatch"} and "which convert writes as F32" in report.messages[0]

    def other_block(data: dict) -> None:
        data["quantization"]["block"] = [64, 64]

    edit(repo, other_block)
    report = validate_manifest(repo, source=src)
    assert codes(report) == ["requant_mismatch"] and "weight_block_size" in report.messages[0]

    def no_requant_recorded(data: dict) -> None:
        data["quantization"] = None
        data["requant_options"]["mode"] = "auto"

    edit(repo, no_requant_recorded)
    report = validate_manifest(repo, source=src)
    assert [w.code for w in report.warnings] == ["bytes_not_checked", "requant_unchecked"]
    assert set(codes(report)) == {"tensor_mismatch"} and all("_scale_inv" in m for m in report.messages)


def test_ue8m0_recorded_for_a_source_that_is_not_block_fp8_is_a_requant_mismatch(converted, repo):
    def ask_ue8m0(data: dict) -> None:
        data["requant_options"]["mode"] = "ue8m0"

    edit(repo, ask_ue8m0)
    report = validate_manifest(repo, source=converted[0])
    assert codes(report) == ["requant_mismatch"] and "declares no block-FP8" in report.messages[0]
