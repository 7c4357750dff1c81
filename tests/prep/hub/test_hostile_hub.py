"""The hub as untrusted input: `plan` and `convert --dry-run` on a hub id stay bounded in bytes, time and memory
whatever answers at HF_ENDPOINT, and fail in one true line (docs/reliability.md, "A hostile hub").

A local stand-in (tests/support/fake_hub.py) misbehaves on purpose, serving a DeepSeek-V3 at its published size (in
BF16: 1.3 TB) whose data is a hole (tests/support/sparse_checkpoints.py), so a client that reads what it should not
would read gigabytes. Each test is one cause of the issue (#45) and asserts, for each of its cases, the exit status, the
one line, the bytes the server sent (under 1% of the checkpoint) and the wall time. Requests time out after 2 s here
(SHARDPREP_HUB_TIMEOUT), so a stall costs seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from support.fake_hub import FakeHub, cut_short, endless_chunked, error, gzip_bomb, redirect, stall, trickle, whole_file
from support.sparse_checkpoints import DEEPSEEK_V3_CONFIG, deepseek_v3_tensors, write_sparse_checkpoint

REPO = "tiny-org/deepseek-v3-bf16"
TIMEOUT_S = 2
ENV_DROPPED = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT", "http_proxy", "https_proxy",
               "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "SHARDPREP_DEBUG")
PLAN = ["plan", REPO, "--ranks", "8", "--preset", "deepseek-v3"]
DRY_RUN = ["convert", REPO, "OUT", "--ranks", "8", "--preset", "deepseek-v3", "--dry-run"]


@pytest.fixture(scope="module")
def ds_v3(tmp_path_factory):
    config = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    return write_sparse_checkpoint(tmp_path_factory.mktemp("hostile") / "repo", config, deepseek_v3_tensors(config))


@pytest.fixture(scope="module")
def apparent_bytes(ds_v3):
    return sum(p.stat().st_size for p in ds_v3.iterdir())


def run_cli(args, tmp_path, endpoint, *, env=None, cwd=None):
    """The CLI in a fresh process against `endpoint`, with an empty HF cache; (process, wall seconds)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_DROPPED}
    full_env |= {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf-home"),
                 "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "SHARDPREP_HUB_TIMEOUT": str(TIMEOUT_S)}
    full_env |= env or {}
    args = [str(tmp_path / "out") if a == "OUT" else str(a) for a in args]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardprep", *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=120)
    return proc, time.monotonic() - t0


def assert_one_line(proc, fragment):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert fragment in lines[0], lines[0]
    return lines[0]


def assert_bounded(hub, apparent_bytes, wall, within_s=60.0):
    assert hub.sent_bytes < 0.01 * apparent_bytes, (hub.sent_bytes, apparent_bytes)
    assert wall < within_s, wall


def repo_variant(tmp_path, ds_v3, *, config=None, index=None):
    """A repo like `ds_v3` with another config.json or index (a dict, or bytes); its shards are links to ds_v3's."""
    repo = tmp_path / "variant"
    repo.mkdir()
    for p in ds_v3.iterdir():
        (repo / p.name).symlink_to(p)
    for name, value in (("config.json", config), ("model.safetensors.index.json", index)):
        if value is not None:
            (repo / name).unlink()
            (repo / name).write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
    return repo


# Cause 1: unbounded reads. A Range answered with more than the range is refused from its headers.
@pytest.mark.parametrize("case, pattern, how, command, says", [
    ("200 whole file for a range", "*.safetensors", whole_file(200), PLAN,
     "refused unread: the server (a mirror or proxy?) ignores Range"),
    ("200 whole file, dry run", "*.safetensors", whole_file(200), DRY_RUN, "refused unread"),
    ("206 covering the whole file", "*.safetensors", whole_file(206), PLAN, "refused unread"),
    ("200 whole file, chunked", "*.safetensors", whole_file(200, chunked=True), PLAN, "ignores Range"),
    ("gzip bomb for a range", "*.safetensors", gzip_bomb(6 << 30), PLAN, "gzip-encoded"),
    ("gzip bomb for config.json", "config.json", gzip_bomb(6 << 30), PLAN, "gzip-encoded"),
    ("endless chunked config.json", "config.json", endless_chunked(), PLAN, "more than a config.json may be"),
    ("endless chunked index", "*.index.json", endless_chunked(), DRY_RUN, "more than a safetensors index may be"),
])
def test_an_answer_longer_than_asked_is_refused_without_reading_it(ds_v3, apparent_bytes, tmp_path, case, pattern,
                                                                    how, command, says):
    # The index's cap (256 MiB) is read before the refusal: time enough for that on a busy machine.
    env = {"SHARDPREP_HUB_TIMEOUT": "60"} if case == "endless chunked index" else None
    with FakeHub({REPO: ds_v3}) as hub:
        hub.misbehave(pattern, how)
        proc, wall = run_cli(command, tmp_path, hub.endpoint, env=env)
    assert_one_line(proc, says)
    assert_bounded(hub, apparent_bytes, wall)
    # What is refused from its headers costs at most what the socket buffered before the client closed it; an
    # endless body, its cap (16 MiB for config.json, 256 MiB for the index) and what was buffered.
    cap = {"endless chunked config.json": 16 << 20, "endless chunked index": 256 << 20}.get(case, 0)
    assert hub.sent_bytes < cap + (64 << 20), hub.sent_bytes
    assert not (tmp_path / "out").exists()


def test_a_200_within_the_budget_is_the_answer(checkpoint_cache, tmp_path, monkeypatch):
    # A plain HTTP server ignores Range: asked for bytes 0-99,999 of a 107,800-byte file, it answers 200 with the
    # whole file, which a read of 100,000 bytes may take (WHOLE_ANSWER_BYTES): the range is cut from it.
    from shardprep.prep.hub.http import WHOLE_ANSWER_BYTES, HubReader

    repo = tmp_path / "plain"
    repo.mkdir()
    data = bytes(range(256)) * 421 + bytes(range(24))
    (repo / "blob.bin").write_bytes(data)
    assert len(data) == 107_800 < WHOLE_ANSWER_BYTES
    with FakeHub({"tiny-org/plain": repo}) as hub:
        hub.misbehave("blob.bin", whole_file(200))
        hub.serve_this_process(monkeypatch)
        reader = HubReader("tiny-org/plain", timeout_s=TIMEOUT_S)
        try:
            body = reader.fetch("blob.bin", None, first=0, nbytes=100_000)
            tail = reader.fetch("blob.bin", None, first=100_000, nbytes=10_000)
        finally:
            reader.close()
    assert body is not None and body.data == data[:100_000] and body.size == 107_800
    assert tail is not None and tail.data == data[100_000:] and tail.size == 107_800
    # `plan` of a small checkpoint from such a server reads each file whole, once per range it asks for.
    src = checkpoint_cache("llama")
    assert 100_000 < (src / "model.safetensors").stat().st_size < WHOLE_ANSWER_BYTES
    with FakeHub({"tiny-org/tiny-llama": src}) as hub:
        hub.misbehave("*.safetensors", whole_file(200))
        proc, _ = run_cli(["plan", "tiny-org/tiny-llama", "--ranks", "2", "--preset", "llama", "--json"], tmp_path,
                          hub.endpoint)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fetched_bytes"] >= (src / "model.safetensors").stat().st_size


# Cause 2: no time bound. Every request ends within SHARDPREP_HUB_TIMEOUT; retries are few; a long Retry-After ends.
@pytest.mark.parametrize("case, pattern, how, says, within_s", [
    ("shards stall", "*.safetensors", stall(), "no complete answer", 20),
    ("shards stall after their headers", "*.safetensors", stall(after_headers=True), "no complete answer", 20),
    ("shards trickle a byte a second", "*.safetensors", trickle(1.0), "no complete answer", 20),
    ("config.json stalls", "config.json", stall(), "no complete answer", 20),
    ("config.json trickles", "config.json", trickle(1.0), "no complete answer", 20),
    ("429 with Retry-After: 3600", "config.json", error(429, retry_after="3600"), "asks to wait 3600 s", 20),
    ("503 every time", "config.json", error(503), "503", 30),
])
def test_every_request_ends_in_time(ds_v3, apparent_bytes, tmp_path, case, pattern, how, says, within_s):
    with FakeHub({REPO: ds_v3}) as hub:
        hub.misbehave(pattern, how)
        proc, wall = run_cli(PLAN, tmp_path, hub.endpoint)
        line = assert_one_line(proc, says)
        assert_bounded(hub, apparent_bytes, wall, within_s)
        if case == "503 every time":  # a few tries, then one line that says so
            assert hub.count_requests("config.json") == 3 and "tried 3 times" in line, line
        if case.startswith("429"):  # no wait at all, and no second try
            assert hub.count_requests("config.json") == 1
        if pattern == "*.safetensors":  # the first failure stops the rest: 8 shards asked (those in flight), not 163
            assert hub.count_requests("*.safetensors") <= 8, hub.count_requests("*.safetensors")


def test_a_failure_another_try_mends_is_retried(ds_v3, apparent_bytes, tmp_path):
    with FakeHub({REPO: ds_v3}) as hub:
        hub.misbehave("model-00002-*", error(503), times=1)
        hub.misbehave("model-00003-*", cut_short(), times=1)
        hub.misbehave("model-00004-*", error(429, retry_after="1"), times=1)
        proc, wall = run_cli([*PLAN, "--json"], tmp_path, hub.endpoint)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "", proc.stderr  # no retry line from anything beneath
        assert json.loads(proc.stdout)["fetched_bytes"] == hub.sent_bytes
        assert hub.count_requests("model-00002-*") == 2 and hub.count_requests("model-00004-*") == 2
    assert_bounded(hub, apparent_bytes, wall)


# Cause 3: whole-file downloads before the size caps. config.json and the index are capped while read.
@pytest.mark.parametrize("case, name, size, chunked, says", [
    ("1 GB config.json", "config.json", 1 << 30, False, "more than a config.json may be (16777216); refused unread"),
    ("1 GB config.json, no length", "config.json", 1 << 30, True, "stopped reading there"),
    ("300 MB index", "model.safetensors.index.json", 300 << 20, False, "refused unread"),
])
def test_config_and_index_are_capped_while_read(ds_v3, apparent_bytes, tmp_path, case, name, size, chunked, says):
    repo = repo_variant(tmp_path, ds_v3)
    (repo / name).unlink()
    with open(repo / name, "wb") as f:
        f.truncate(size)  # sparse: costs no disk
    with FakeHub({REPO: repo}) as hub:
        hub.misbehave(name, whole_file(200, chunked=chunked))
        proc, wall = run_cli(PLAN, tmp_path, hub.endpoint)
    assert_one_line(proc, says)
    assert_bounded(hub, apparent_bytes, wall)
    # Refused from its Content-Length: unread. Without one: read up to the cap (16 MiB) and a little buffered.
    assert hub.sent_bytes < (64 << 20 if chunked else 16 << 20), hub.sent_bytes


# Cause 4: tracebacks. A broken body and a redirect loop are one line; --debug still shows the traceback.
@pytest.mark.parametrize("case, pattern, how, says", [
    ("config.json cut short", "config.json", cut_short(), "cut the answer short"),
    ("index cut short", "*.index.json", cut_short(), "cut the answer short"),
    ("shard header cut short", "*.safetensors", cut_short(), "cut the answer short"),
    ("relative redirect loop on config.json", "config.json", redirect(lambda ask: ask.h.path), "redirect loop"),
    ("redirect loop on the shards", "*.safetensors", redirect(lambda ask: ask.h.path, 307), "redirect loop"),
])
def test_a_broken_answer_is_one_line_not_a_traceback(ds_v3, apparent_bytes, tmp_path, case, pattern, how, says):
    with FakeHub({REPO: ds_v3}) as hub:
        hub.misbehave(pattern, how)
        proc, wall = run_cli(PLAN, tmp_path, hub.endpoint)
        assert_one_line(proc, says)
        assert_bounded(hub, apparent_bytes, wall)
        if case.startswith("relative redirect loop"):
            debug, _ = run_cli(["--debug", *PLAN], tmp_path, hub.endpoint)
            assert debug.returncode != 0 and "Traceback" in debug.stderr and "HubError" in debug.stderr


# Cause 5: false messages. Each status says what it is: 401 gated, 403, 404 repo, 404 revision, 429, 5xx.
@pytest.mark.parametrize("case, args, token, says", [
    ("gated, no token", PLAN, None, "a gated repository: ask for access on"),
    ("gated, a token without access", PLAN, "hf_other", "has no access to it yet"),
    ("403 from a proxy", PLAN, None, "refused the request (403 Forbidden"),
    ("no such repository", ["plan", "tiny-org/absent", "--ranks", "8"], None, "no such repository on 127.0.0.1"),
    ("no such revision", [*PLAN, "--revision", "v9"], None, "the hub has no revision 'v9'"),
])
def test_each_refusal_is_named_truly(ds_v3, apparent_bytes, tmp_path, case, args, token, says):
    gated = case.startswith("gated")
    with FakeHub({REPO: ds_v3}, tokens={REPO: "hf_right"} if gated else None) as hub:
        if case.startswith("403"):
            hub.misbehave("config.json", error(403))
        proc, wall = run_cli(args, tmp_path, hub.endpoint, env={"HF_TOKEN": token} if token else None)
    line = assert_one_line(proc, says)
    assert_bounded(hub, apparent_bytes, wall, 20)
    if gated:
        assert "HF_TOKEN" in line or "token" in line


def test_a_gated_repo_reads_with_a_token_that_never_leaves_the_hub(ds_v3, apparent_bytes, tmp_path):
    # The shards come from a CDN on another origin, as the hub's do: the token goes to the hub alone.
    with FakeHub({REPO: ds_v3}) as cdn, FakeHub({REPO: ds_v3}, tokens={REPO: "hf_right"}) as hub:
        hub.misbehave("*.safetensors", redirect(lambda ask: cdn.endpoint + ask.h.path))
        proc, wall = run_cli([*PLAN, "--json"], tmp_path, hub.endpoint, env={"HF_TOKEN": "hf_right"})
        assert proc.returncode == 0, proc.stderr
        assert set(hub.authorizations) == {"Bearer hf_right"}
        assert cdn.requests and set(cdn.authorizations) == {None}
        assert json.loads(proc.stdout)["fetched_bytes"] == hub.sent_bytes + cdn.sent_bytes
    assert_bounded(cdn, apparent_bytes, wall)


# Cause 6: paths checked late. An index's shard names are checked before any shard is asked for.
@pytest.mark.parametrize("shard", ["../../etc/passwd", "/etc/passwd", "a/../../b.safetensors"])
def test_an_unsafe_shard_name_is_refused_before_any_request(ds_v3, apparent_bytes, tmp_path, shard):
    index = json.loads((ds_v3 / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = shard
    with FakeHub({REPO: repo_variant(tmp_path, ds_v3, index=index)}) as hub:
        proc, wall = run_cli(PLAN, tmp_path, hub.endpoint)
    assert_one_line(proc, "is outside the model directory")
    asked = [path.rpartition("/")[2] for _, path, _ in hub.requests]
    assert asked == ["config.json", "model.safetensors.index.json"], asked
    assert_bounded(hub, apparent_bytes, wall, 20)


# Cause 7: config values not checked. What the figures use must make sense.
@pytest.mark.parametrize("field, value, command", [
    ("num_hidden_layers", 10**9, PLAN),
    ("num_hidden_layers", -3, PLAN),
    ("num_hidden_layers", "61", PLAN),
    ("num_nextn_predict_layers", 10**9, DRY_RUN),
])
def test_absurd_config_figures_are_refused(ds_v3, apparent_bytes, tmp_path, field, value, command):
    config = json.loads((ds_v3 / "config.json").read_text()) | {field: value}
    with FakeHub({REPO: repo_variant(tmp_path, ds_v3, config=config)}) as hub:
        proc, wall = run_cli(command, tmp_path, hub.endpoint)
    assert_one_line(proc, f"config.json: {field} is {value!r}; a model's is a whole number from")
    assert_bounded(hub, apparent_bytes, wall, 20)


# Offline: one line within 5 seconds; a complete copy in the HF cache serves instead.
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case, endpoint, env, says", [
    ("HF_HUB_OFFLINE=1, nothing cached", "http://127.0.0.1:9", {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ("DNS fails", "http://hub.invalid", {}, "hub.invalid does not resolve"),
    ("connection refused", None, {}, "cannot reach the hub at 127.0.0.1"),
])
def test_offline_is_one_line_within_5_seconds(tmp_path, case, endpoint, env, says):
    proc, wall = run_cli(PLAN, tmp_path, endpoint or f"http://127.0.0.1:{closed_port()}", env=env)
    assert_one_line(proc, says)
    assert wall < 5, wall


def test_offline_a_complete_cached_copy_is_read(checkpoint_cache, tmp_path):
    from support.hub_cache import make_hub_cache

    make_hub_cache(tmp_path / "cache", "tiny-org/tiny-llama", checkpoint_cache("llama", sharded=True))
    for env, endpoint in (({"HF_HUB_OFFLINE": "1"}, "http://127.0.0.1:9"), ({}, "http://hub.invalid")):
        proc, wall = run_cli(["plan", "tiny-org/tiny-llama", "--ranks", "2", "--preset", "llama", "--json"],
                             tmp_path, endpoint, env=env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["fetched_bytes"] is None  # read from the cache, not fetched
        assert wall < 10, wall


# A local path is never taken for a hub id.
@pytest.mark.parametrize("src, says", [
    ("examples/tiny-deepsek-fp8", "examples/tiny-deepsek-fp8: no such directory (examples/ exists here"),
    ("./tiny-deepsek-fp8", "./tiny-deepsek-fp8: no such directory"),
    ("~/no-such-model-dir-shardprep", "~/no-such-model-dir-shardprep: no such directory"),
])
def test_a_missing_local_path_is_no_such_directory(tmp_path, src, says):
    (tmp_path / "examples").mkdir()
    with FakeHub({}) as hub:
        for command in (["plan", src, "--ranks", "2"], ["convert", src, "OUT", "--ranks", "2", "--dry-run"]):
            proc, _ = run_cli(command, tmp_path, hub.endpoint, cwd=tmp_path)
            assert_one_line(proc, says)
        assert hub.requests == []
