"""`shardprep plan --report FILE.html`: the page carries `plan --json`'s numbers, draws them where they belong,
and needs nothing from the network.

The page is parsed back here: its embedded JSON against `plan --json`, every drawn point's position against the
axis its chart declares, every bar part's width against its bytes, the tables against the terminal's figures.
"""

import json
import math
import re
from html.parser import HTMLParser

import pytest
from test_plan import LAYERS, write_profile
from typer.testing import CliRunner

from shardprep.cli import app


@pytest.fixture(scope="module")
def llama8(checkpoint_cache):
    return checkpoint_cache("llama", layers=LAYERS)


class Page(HTMLParser):
    """Every element with its attributes, the text of each element with an id, and the embedded plan."""

    def __init__(self, text):
        super().__init__()
        self.elements, self.texts, self.data = [], {}, None
        self._open = []
        self.feed(text)

    def handle_starttag(self, tag, attrs, *, closed=False):
        attrs = dict(attrs)
        svg = [a for t, a, _ in self._open if t == "svg"]
        if svg:
            attrs["in-svg"] = svg[-1].get("id") or svg[-1].get("class")
        self.elements.append((tag, attrs))
        if not closed and tag not in ("meta", "br"):
            self._open.append((tag, attrs, []))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs, closed=True)

    def handle_endtag(self, tag):
        while self._open:
            open_tag, attrs, text = self._open.pop()
            joined = "".join(text)
            if self._open:
                self._open[-1][2].append(joined)
            if attrs.get("id"):
                self.texts[attrs["id"]] = joined
            if open_tag == "script" and attrs.get("type") == "application/json":
                self.data = json.loads(joined)
            if open_tag == tag:
                break

    def handle_data(self, data):
        if self._open:
            self._open[-1][2].append(data)

    def find(self, tag, **wanted):
        return [a for t, a in self.elements if t == tag and all(a.get(k.replace("_", "-")) == v
                                                                 for k, v in wanted.items())]


def plan_args(llama8, tmp_path, case):
    base = [str(llama8), "--ranks", "8", "--preset", "llama"]
    if case == "pays":
        profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(1.0, 2.0), gather_ms=1.6)
        data = json.loads(profile.read_text())  # as if profiled on a directory sharding layers 1-7
        for layer in data["layers"][1:]:
            layer["total_bytes"] = 4096
        data["backends"][0]["sharded_step_ms"] = [9.5, 17.25]
        profile.write_text(json.dumps(data))
    elif case == "pays-from":
        profile = write_profile(tmp_path / "p.json", tokens=(1, 16, 1024), compute_ms=(0.05, 0.1, 5.0),
                                gather_ms=1.0)
    elif case == "budget":
        profile = write_profile(tmp_path / "p.json", tokens=(16, 128), compute_ms=(0.1, 2.0), gather_ms=1.6)
        return [*base, "--profile", str(profile), "--budget-gb", "0.00001"]
    else:
        return [*base, "--link-gbps", "100"]
    return [*base, "--profile", str(profile)]


def run_plan(args):
    result = CliRunner().invoke(app, ["plan", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def axis(svg, name):
    low, high = float(svg[f"data-{name}-low"]), float(svg[f"data-{name}-high"])
    start, end = map(float, svg[f"data-{name}-px"].split())
    log = svg[f"data-{name}-log"] == "1"

    def at(value):
        f = ((math.log(value) - math.log(low)) / (math.log(high) - math.log(low)) if log
             else (value - low) / (high - low))
        return start + f * (end - start)

    return at


def expected_series(plan, key):
    """What a chart must draw, from the JSON alone: replicated (the step chart only), then each distinct set's
    predicted step or overhead."""
    every = plan["every_layer"]["predictions"]
    series = {"replicated": {p["tokens"]: p["replicated_ms"] for p in every}} if key == "step_ms" else {}
    seen = []
    for name, field in (("every", "every_layer"), ("chosen", "chosen"), ("pays_from", "pays_from")):
        choice = plan[field]
        if choice is not None and choice["layers"] not in seen:
            seen.append(choice["layers"])
            series[name] = {p["tokens"]: p[key] for p in choice["predictions"]}
    return series


def check_chart(page, chart_id, key_of_series):
    """Every circle of the chart sits where its chart's axes put its value, and each series' line runs through
    its circles; returns {series: {tokens: value}} as drawn."""
    (svg,) = page.find("svg", id=chart_id)
    x_at, y_at = axis(svg, "x"), axis(svg, "y")
    drawn = {}
    for circle in page.find("circle", **{"class": "point", "in-svg": chart_id}):
        if circle["data-series"] not in key_of_series:
            continue
        tokens, value = int(circle["data-tokens"]), float(circle["data-value"])
        assert float(circle["cx"]) == pytest.approx(x_at(tokens), abs=0.01)
        assert float(circle["cy"]) == pytest.approx(y_at(value), abs=0.01)
        drawn.setdefault(circle["data-series"], {})[tokens] = value
    for name in drawn:
        (line,) = page.find("polyline", data_series=name, **{"in-svg": chart_id})
        circles = page.find("circle", data_series=name, **{"in-svg": chart_id})
        assert line["points"].split() == [f"{c['cx']},{c['cy']}" for c in circles]
    return drawn


@pytest.mark.parametrize("case", ["pays", "pays-from", "budget", "no-profile"])
def test_the_page_carries_plan_json_and_draws_its_numbers(llama8, tmp_path, case):
    args = plan_args(llama8, tmp_path, case)
    plan = json.loads(run_plan([*args, "--json"]))
    terminal = run_plan(args)
    page_path = tmp_path / "report" / "plan.html"
    run_plan([*args, "--report", str(page_path)])
    text = page_path.read_text(encoding="utf-8")
    page = Page(text)
    assert page.data["plan"] == plan
    assert page.texts["verdict"] == plan["verdict_line"]

    if case == "no-profile":
        assert not page.find("svg", **{"class": "chart"}) and page.find("svg", **{"class": "stack"})
        assert "needs each layer's compute time" in page.texts["no-step-time"]
        assert "unknown without --profile" in page.texts["crossover"]
        gathers = sum(r["gather_ms"] for r in plan["layers"])
        assert f"{gathers:.3g} ms of gathers per forward" in text
    else:
        expected = expected_series(plan, "step_ms")
        measured = plan["measured"]
        expected["measured_replicated"] = dict(zip(plan["tokens"], measured["replicated_step_ms"]))
        if case == "pays":  # the profile says which layers its directory shards: its own step is drawn too
            assert measured["sharded_layers"] == list(range(1, LAYERS))
            expected["measured_sharded"] = {16: 9.5, 128: 17.25}
            assert "measured: the profiled directory's 7 layers (N = 8, ce)" in text
            assert "<td>9.500</td><td>17.250</td>" in text
        else:  # the profile recorded neither: nothing drawn for it
            assert measured["sharded_layers"] == [] and not page.find("polyline", data_series="measured_sharded")
        assert check_chart(page, "step-chart", expected) == expected
        overheads = expected_series(plan, "overhead")
        assert check_chart(page, "overhead-chart", overheads) == overheads
        for name, values in expected.items():  # the predicted steps are the terminal's (it prints no measured one)
            if name == "replicated" or name.startswith("measured"):
                continue
            for ms in values.values():
                assert f"{ms:.3f}" in terminal
        for p in plan["every_layer"]["predictions"]:
            assert f"{p['replicated_ms']:.3f}" in terminal and f"{p['overhead']:+.1%}" in terminal
            assert f"<td>{p['overhead']:+.1%}</td>" in text and f"<td>{p['step_ms']:.3f}</td>" in text
        crossover = page.find("p", id="crossover")[0]["data-tokens"]
        if case == "pays":
            assert plan["verdict"] == "pays" and crossover == str(min(plan["tokens"]))
        elif case == "budget":  # the least overhead that frees the budget: within the bound only at 128 tokens
            assert plan["chosen"]["predictions"][0]["overhead"] > 0.05 >= plan["chosen"]["predictions"][1]["overhead"]
            assert crossover == "128" and "from 128 tokens per step (not at 16" in page.texts["crossover"]
        else:
            assert plan["verdict"] == "pays only from" and crossover == str(plan["pays_from_tokens"]) == "1024"
            assert "only from 1024 tokens per step (not at 16" in page.texts["crossover"]
            # The pays-from set starts to pay where the plan says: a crossover line marks it.
            assert page.find("line", **{"class": "crossover", "data-tokens": "1024"})
    check_memory_stack(page, plan)


def check_memory_stack(page, plan):
    """The bars hold the capacity's set: the replicated part, R whole or R/N and the slots, and the KV room."""
    shown = plan["chosen"] or plan["pays_from"] or plan["every_layer"]
    memory, cap = shown["memory"], plan["capacity"]
    parts = {}
    for chart in ("weights-stack", "hbm-stack"):
        (svg,) = page.find("svg", id=chart)
        per_px = float(svg["data-bytes-per-px"])
        for rect in page.find("rect", **{"class": "part", "in-svg": chart}):
            assert parts.setdefault((rect["data-bar"], rect["data-part"]), int(rect["data-bytes"])) == \
                int(rect["data-bytes"])
            assert float(rect["width"]) == pytest.approx(int(rect["data-bytes"]) / per_px, abs=0.01)
    assert not page.find("rect", data_part="KV-cache room", **{"in-svg": "weights-stack"})
    assert parts[("replicated", "sharded targets")] == memory["sharded_bytes"]
    assert parts[("sharded", "sharded targets")] == memory["local_chunk_bytes"]
    assert parts[("sharded", "gather slots")] == memory["slot_bytes"]
    assert parts[("replicated", "replicated part")] == parts[("sharded", "replicated part")] == \
        cap["replicated_part_bytes"]
    assert parts[("replicated", "KV-cache room")] == cap["kv_room_replicated_bytes"]
    assert parts[("sharded", "KV-cache room")] == cap["kv_room_sharded_bytes"]
    weights = {bar: sum(b for (name, part), b in parts.items() if name == bar and part != "KV-cache room")
               for bar in ("replicated", "sharded")}
    assert weights["sharded"] == cap["startup_peak_bytes"]
    assert weights["replicated"] - weights["sharded"] == memory["saved_bytes"] == cap["saved_bytes"]


@pytest.mark.parametrize("case", ["pays", "no-profile"])
def test_the_page_needs_nothing_from_outside(llama8, tmp_path, case):
    page_path = tmp_path / "plan.html"
    run_plan([*plan_args(llama8, tmp_path, case), "--report", str(page_path)])
    text = page_path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    for outside in ("http", "src=", "href=", "<link", "url(", "@import", "<iframe", "<img"):
        assert outside not in text.lower(), outside
    scripts = re.findall(r"<script[^>]*>", text)
    assert scripts == ['<script type="application/json" id="plan-data">']  # data, never code


def test_the_report_refuses_an_unwritable_path_in_one_line_and_leaves_nothing(llama8, tmp_path):
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "plan.html"
    result = CliRunner().invoke(app, ["plan", *plan_args(llama8, tmp_path, "no-profile"), "--report", str(bad)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --report {bad}: cannot write there: {bad.parent} is not a directory"
    good = tmp_path / "plan.html"
    good.write_text("the previous page")
    run_plan([*plan_args(llama8, tmp_path, "no-profile"), "--report", str(good)])
    assert good.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "plan.html"]  # no temporary file left


def test_a_failed_plan_leaves_the_previous_page_whole(llama8, tmp_path):
    page = tmp_path / "plan.html"
    page.write_text("the previous page")
    result = CliRunner().invoke(app, ["plan", str(llama8), "--ranks", "8", "--preset", "llama", "--profile",
                                      str(tmp_path / "missing.json"), "--report", str(page)])
    assert result.exit_code != 0 and "missing.json: not found" in result.stderr
    assert page.read_text() == "the previous page" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.html"]


def test_the_crossover_is_the_least_count_from_which_a_set_stays_within_the_bound():
    from shardprep.planning.report import crossover_tokens

    assert crossover_tokens([1, 16, 128], [0.01, 0.2, 0.01], 0.05) == 128  # paying at 1 alone is no crossover
    assert crossover_tokens([128, 1, 16], [0.01, 0.01, 0.01], 0.05) == 1
    assert crossover_tokens([1, 16], [0.01, 0.06], 0.05) is None
