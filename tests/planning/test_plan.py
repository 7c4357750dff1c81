"""`shardprep plan`: memory and KV figures, the layer choice and its `convert --layers`, the verdict, no torch.

Profiles here are written through the Profile dataclasses with chosen times, so each test controls where
the gathers hide; tests/standalone/test_profile.py checks a measured one end to end.
"""

import json
import shlex
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from shardprep.cli import app
from shardprep.manifests import load_manifest
from shardprep.planning.kv_cache import kv_cache_shape
from shardprep.planning.profile_format import BackendTimes, LayerTimes, Profile
from shardprep.prep.convert import convert
from shardprep.prep.convert_plan import make_plan
from shardprep.prep.selection import Selection, load_preset, parse_layers
from shardprep.prep.source import open_source

LAYERS = 8


@pytest.fixture(scope="module")
def llama8(checkpoint_cache):
    return checkpoint_cache("llama", layers=LAYERS)


def write_profile(path, *, tokens, compute_ms, gather_ms, kappa=0.0, world_size=8, layers=LAYERS):
    """A profile whose every layer computes `compute_ms[i]` ms at tokens[i] and gathers in `gather_ms` ms."""
    n = len(tokens)
    profile = Profile(
        world_size=world_size, device="test", tokens=tuple(tokens),
        layers=tuple(LayerTimes(i, tuple(compute_ms)) for i in range(layers)),
        head_ms=(0.05,) * n, tail_ms=(0.05,) * n, replicated_step_ms=tuple(c * layers for c in compute_ms),
        backends=(BackendTimes("ce", {i: gather_ms for i in range(layers)}, gather_ms * layers, 10**6 * layers,
                               (kappa,) * n, (0.0,) * n, (0.0,) * n),),
    )
    path.write_text(json.dumps(profile.to_dict()))
    return path


def plan_json(*args):
    result = CliRunner().invoke(app, ["plan", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_without_a_profile_the_plan_gives_memory_kv_and_link_gathers(llama8):
    report = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--link-gbps", 100, "--context-len", 64)
    assert report["schema"] == "shardprep/plan/1" and report["verdict"] == "memory only"
    sizes = {lay.layer: lay.total_bytes for lay in make_plan(open_source(llama8), 8, Selection(
        preset=load_preset("llama"), layers=parse_layers("all"))).layouts}
    for row in report["layers"]:
        assert row["gather_ms"] == pytest.approx(7 * sizes[row["layer"]] / 8 / 100e9 * 1e3)
    kv = kv_cache_shape(json.loads((llama8 / "config.json").read_text()))
    cap = report["capacity"]
    assert report["every_layer"]["memory"]["saved_bytes"] == cap["saved_bytes"] > 0
    assert cap["kv_tokens"] == cap["saved_bytes"] // kv.bytes_per_token
    assert cap["extra_requests"] == cap["kv_tokens"] // 64
    assert "the step cost needs --profile" in report["verdict_line"]


def test_the_chosen_layers_convert_and_stay_under_the_bound(llama8, tmp_path):
    profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(1.0, 2.0), gather_ms=1.6)
    report = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile, "--max-overhead", "5%")
    assert report["verdict"] == "pays"
    chosen = report["chosen"]
    assert chosen["worst_overhead"] <= 0.05 and 0 < len(chosen["layers"]) < LAYERS
    assert report["every_layer"]["worst_overhead"] > 0.05  # sharding everything would not fit the bound
    out = tmp_path / "out"
    convert(llama8, out, 8, preset="llama", layers=report["convert_layers"])
    assert [r.layer for r in load_manifest(out).layers] == chosen["layers"]


def test_a_model_that_pays_only_with_many_tokens_says_from_how_many(llama8, tmp_path):
    profile = write_profile(tmp_path / "p.json", tokens=(16, 1024), compute_ms=(0.1, 5.0), gather_ms=1.0)
    report = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile)
    assert report["verdict"] == "pays only from" and report["pays_from_tokens"] == 1024
    assert report["chosen"] is None and report["convert_layers"]
    assert report["verdict_line"].startswith("pays only from 1024 tokens per step")


def test_a_budget_is_freed_at_the_least_overhead(llama8, tmp_path):
    profile = write_profile(tmp_path / "p.json", tokens=(16,), compute_ms=(1.0,), gather_ms=1.6)
    everything = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile)["every_layer"]
    budget_gb = everything["memory"]["saved_bytes"] / 2 / 1e9
    report = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile, "--budget-gb", budget_gb)
    assert report["chosen"]["memory"]["saved_bytes"] >= budget_gb * 1e9
    assert report["chosen"]["worst_overhead"] <= everything["worst_overhead"]
    too_much = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile, "--budget-gb", 1)
    assert too_much["verdict"] == "does not pay" and "cannot free" in too_much["verdict_line"]


def test_a_converted_directory_that_saves_nothing_does_not_pay_and_says_why(checkpoint_cache, tmp_path):
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama")
    report = plan_json(out, "--ranks", 2)
    inspected = CliRunner().invoke(app, ["inspect", str(out), "--json"])
    assert report["kind"] == "converted" and report["verdict"] == "does not pay"
    assert "gather slots" in report["verdict_line"] and "pays from 5 sharded layers" in report["verdict_line"]
    assert report["every_layer"]["memory"]["saved_bytes"] == json.loads(inspected.stdout)["totals"]["saved_bytes"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_plan_counts_chunk_alignment_padding_as_inspect_does(checkpoint_cache, tmp_path, ranks):
    # Converted for 2 ranks with 64 KiB chunks: most of each chunk is padding, which must not count as saved
    # weights, whether the plan is for the directory's own N or another.
    out = tmp_path / "out"
    convert(checkpoint_cache("llama"), out, 2, preset="llama", chunk_alignment="64KiB")
    memory = plan_json(out, "--ranks", ranks)["every_layer"]["memory"]
    if ranks == 2:
        totals = json.loads(CliRunner().invoke(app, ["inspect", str(out), "--json"]).stdout)["totals"]
        assert (memory["saved_bytes"], memory["padding_bytes"]) == (totals["saved_bytes"], totals["padding_bytes"])
    assert memory["padding_bytes"] > 0 and memory["saved_bytes"] < 0


def test_a_config_field_of_the_wrong_type_is_one_line_naming_the_file(llama8, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama8, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_key_value_heads": "x"}))
    result = CliRunner().invoke(app, ["plan", str(src), "--ranks", "2", "--preset", "llama"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # Refused where config.json is read (planning/config_figures.py), naming the field, before any figure uses it.
    assert lines == [f"error: {src / 'config.json'}: num_key_value_heads is 'x'; a model's is a whole number from 1 "
                     "to 65536"]


def test_plan_and_inspect_refuse_what_convert_and_the_runtime_would(llama8, tmp_path):
    out = tmp_path / "out"
    convert(llama8, out, 2, preset="llama")
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "2", "--chunk-alignment", "3000"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --chunk-alignment '3000': expected auto, none, "
                                                               "or a power of two"), result.output
    for command in (["plan", str(out), "--ranks", "2"], ["inspect", str(out)]):
        result = CliRunner().invoke(app, [*command, "--num-slots", "0"])
        assert result.exit_code == 2 and "--num-slots" in result.stderr and "Traceback" not in result.output


def test_the_printed_plan_ends_with_its_verdict_and_names_the_convert_argument(llama8, tmp_path):
    profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(1.0, 2.0), gather_ms=1.6)
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--profile",
                                      str(profile)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("pays: shard")
    assert any(line.startswith("convert argument: --layers ") for line in lines)


def test_a_profile_of_another_model_is_refused_in_one_line(llama8, tmp_path):
    profile = write_profile(tmp_path / "p.json", tokens=(16,), compute_ms=(1.0,), gather_ms=1.0, layers=5)
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--profile",
                                      str(profile)])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: the profile has 5 layers but config.json has 8; profile the same model"


def test_a_one_rank_profile_without_link_bandwidth_is_refused_in_one_line_and_runs_with_it(llama8, tmp_path):
    # One GPU profiles compute, but its one rank receives no gather bytes: nothing to scale to N ranks.
    path = write_profile(tmp_path / "p.json", tokens=(16,), compute_ms=(1.0,), gather_ms=0.05, world_size=1)
    data = json.loads(path.read_text())
    data["backends"][0]["recv_bytes_per_forward"] = 0
    path.write_text(json.dumps(data))
    command = ["plan", str(llama8), "--ranks", "2", "--preset", "llama", "--profile", str(path)]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().startswith("error: the profile was measured on 1 rank, which receives no gather")
    with_link = plan_json(*command[1:], "--link-gbps", "300")  # the profile's compute, the given bandwidth
    assert with_link["every_layer"]["predictions"] and "--link-gbps" in with_link["gather_source"]


def test_plan_and_inspect_run_without_torch(llama8, tmp_path):
    out = tmp_path / "out"
    convert(llama8, out, 2, preset="llama")
    code = ("import sys; sys.modules['torch'] = None; from shardprep.cli import app; "
            "app(sys.argv[1:], standalone_mode=False)")
    for args in (["plan", str(llama8), "--ranks", "2", "--preset", "llama", "--json"],
                 ["plan", str(out), "--ranks", "4", "--json"], ["inspect", str(out), "--json"]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)


def plan_with_trace(llama8, tmp_path, *extra):
    profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(1.0, 2.0), gather_ms=1.6, kappa=0.01)
    trace = tmp_path / "traces" / "plan.json"
    report = plan_json(llama8, "--ranks", 8, "--preset", "llama", "--profile", profile, "--trace", trace, *extra)
    return report, trace


def x_events_by_thread(document):
    threads = {}
    for e in document["traceEvents"]:
        if e["ph"] == "X":
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    return threads


def test_the_predicted_trace_is_the_plans_own_step_layer_by_layer(llama8, tmp_path):
    report, trace = plan_with_trace(llama8, tmp_path)
    document = json.loads(trace.read_text())
    assert document["displayTimeUnit"] == "ms" and document["otherData"]["sharded_layers"] == report["chosen"]["layers"]
    threads = x_events_by_thread(document)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert set(names.values()) == {"step", "compute", "gather"}
    for pid, prediction in enumerate(report["chosen"]["predictions"], start=1):
        compute, gather = threads[(pid, 1)], threads[(pid, 2)]
        # The step ends where the plan's prediction does (times in µs, to the ns).
        assert compute[-1]["ts"] + compute[-1]["dur"] == pytest.approx(prediction["step_ms"] * 1e3, abs=2e-3)
        assert threads[(pid, 0)][0]["dur"] == pytest.approx(prediction["step_ms"] * 1e3, abs=2e-3)
        spans = [e["name"] for e in compute if not e["name"].startswith("wait")]
        assert spans == ["compute before layer 0", *(f"compute layer {i}" for i in range(LAYERS)),
                         "compute after the last layer"]
        gathers = [e for e in gather if e["name"].startswith("gather")]
        assert [e["name"] for e in gathers] == [f"gather layer {i}" for i in report["chosen"]["layers"]]
        start = {e["name"]: e["ts"] for e in compute}
        for g in gathers:  # a sharded layer computes only once its gather is done
            assert start[g["name"].replace("gather", "compute")] >= g["ts"] + g["dur"] - 1e-3
        for events in (compute, gather):  # spans on one thread follow one another, none overlaps the next
            assert all(e["dur"] >= 0 for e in events)
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(events, events[1:]))


def test_the_predicted_trace_loads_in_devtools_trace_engine(llama8, tmp_path):
    from support.trace_reader import read_trace

    _, trace = plan_with_trace(llama8, tmp_path)
    document = json.loads(trace.read_text())
    read = read_trace(trace)
    assert read["warnings"] == {}
    expected = x_events_by_thread(document)
    seen = {(int(pid), int(tid)): t for pid, p in read["processes"].items() for tid, t in p["threads"].items()}
    assert set(seen) == set(expected)
    for key, events in expected.items():
        # Every span on its thread, none dropped or nested under another (a thread's spans do not overlap).
        assert [(e["name"], e["ts"], e["dur"]) for e in seen[key]["entries"]] == [
            (e["name"], pytest.approx(e["ts"]), pytest.approx(e["dur"])) for e in events]
        assert seen[key]["roots"] == len(events)
    titles = {str(e["pid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert read["processNames"] == titles and len(titles) == 2


def test_plan_trace_refuses_no_profile_and_an_unwritable_path_in_one_line(llama8, tmp_path):
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--trace",
                                      str(tmp_path / "t.json")])
    assert result.exit_code == 2 and result.stderr.strip() == ("error: --trace needs --profile: the predicted "
                                                               "schedule needs each layer's compute time")
    profile = write_profile(tmp_path / "p.json", tokens=(16,), compute_ms=(1.0,), gather_ms=1.0)
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "t.json"
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--profile",
                                      str(profile), "--trace", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --trace {bad}: cannot write there: {bad.parent} is not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "p.json"]


def test_the_trace_shows_where_compute_waits_on_a_gather_and_a_gather_on_its_slot():
    from shardprep.planning.step_time import Segment, schedule_step
    from shardprep.prep.schedule_trace import schedule_events

    # One slot, gathers longer than the layers: layer 0 waits for its gather, layer 1's gather waits for done(0).
    segments = [Segment(0.5), Segment(1.0, 2.0), Segment(1.0, 2.0), Segment(0.5)]
    events = [e for e in schedule_events(schedule_step(segments, num_slots=1), pid=1, title="t", num_slots=1)
              if e["ph"] == "X"]
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events}
    assert spans["wait layer 0"] == (500.0, 2000.0) == (spans["compute before layer 0"][1], spans["gather layer 0"][1])
    assert spans["slot wait layer 1"] == (2000.0, 3000.0) and spans["compute layer 0"][1] == 3000.0
    assert spans["wait layer 1"] == (3000.0, 5000.0) == (spans["compute layer 0"][1], spans["gather layer 1"][1])
    assert spans["predicted step"] == (0.0, 6500.0) == (0.0, spans["compute after the last layer"][1])


def printed_convert_command(output: str) -> list[str]:
    """The `shardprep convert ...` line plan printed, as the shell splits it (it must be one line to paste)."""
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("shardprep convert ")]
    assert len(lines) == 1, output
    return shlex.split(lines[0])


@pytest.mark.parametrize("from_output", [False, True], ids=["from-src", "from-out"])
def test_the_printed_convert_command_runs_as_printed_at_80_columns(llama8, tmp_path, monkeypatch, from_output):
    profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(1.0, 2.0), gather_ms=1.6)
    monkeypatch.chdir(tmp_path)  # the command's new output directory is relative: it lands here
    if from_output:
        # OUT converted for 8 ranks: plan reads N, the source and the preset from its manifest (no --ranks).
        convert(llama8, tmp_path / "out", 8, preset="llama")
        args = ["plan", "out", "--profile", str(profile)]
    else:
        args = ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--profile", str(profile)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    argv = printed_convert_command(result.stdout)
    assert argv[:2] == ["shardprep", "convert"] and ["--preset", "llama"] == argv[argv.index("--preset"):][:2]
    ran = CliRunner().invoke(app, argv[1:] + ["-q"])
    assert ran.exit_code == 0, (argv, ran.output)
    chosen = plan_json(*args[1:])["chosen"]["layers"]
    written = load_manifest(tmp_path / argv[3])
    assert written.world_size == 8 and [r.layer for r in written.layers] == chosen


def test_inspect_and_plan_tables_fit_80_columns(checkpoint_cache, tmp_path):
    """The same output at 80 columns as at 200: no table needed folding. Prose is soft-wrapped (not folded by
    shardprep), so only the tables could differ. A MoE model under expert parallelism: the longest rows."""
    moe = checkpoint_cache("qwen3-moe", layers=LAYERS)
    out = tmp_path / "out"
    convert(moe, out, 8, preset="qwen3-moe")
    profile = write_profile(tmp_path / "p.json", tokens=(1, 16, 128, 1024, 4096), compute_ms=(1.0,) * 5,
                            gather_ms=1.6)
    for args in (["inspect", str(out), "--dp", "16", "--ep", "4", "--gpu", "h200"],
                 ["plan", str(moe), "--ranks", "8", "--preset", "qwen3-moe", "--profile", str(profile), "--ep", "4"]):
        narrow = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
        wide = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert narrow.exit_code == 0, narrow.output
        def lines(text):  # rich pads a table's title and blank lines with spaces to the terminal's width
            return [line.rstrip() for line in text.splitlines()]

        assert lines(narrow.stdout) == lines(wide.stdout)
        table_lines = [line for line in narrow.stdout.splitlines() if "─" in line or "  " in line.strip()]
        assert table_lines and max(len(line.rstrip()) for line in table_lines) <= 80
