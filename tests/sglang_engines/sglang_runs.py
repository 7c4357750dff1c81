"""Run a list of SGLang engines one after another in one process and record each one's greedy tokens or its error.

`python tests/sglang_engines/sglang_runs.py PLAN.json RESULTS.json` (inside the SGLang virtual environment,
.ci/sglang_venv.sh). Tests call `run_engines(plan, workdir)`, which runs this script in a subprocess with the
test plugins declared (below) and keeps everything it prints in `workdir/engines.log`.

Importing SGLang and starting its scheduler processes is the cost of these tests (tens of seconds per engine on two
cores), so one process runs every engine of a module's plan. SGLang's `Engine` drives its data-parallel ranks
itself (one scheduler process per DP rank, requests dealt out by its DP controller), so an uneven load is a batch
whose requests ask for different numbers of tokens: the rank that finishes first keeps stepping on SGLang's dummy
batches while the other still decodes.

The test plugins, each documented in its file, are declared here as `sglang.srt.plugins` entry points of a
directory on PYTHONPATH (SGLang loads them in every one of its processes): gloo_groups.py (parallel groups without
PyNccl), torch_native_fill.py (the torch-native backend's `get_cpu_graph_seq_len_fill_value`), torch_native_mla.py
(MLA's absorbed path), and, each inactive unless its variables are set, fixed_cpu_memory.py (the KV pool's free
memory), opened_files.py (which files each rank opens), fp8_kernels.py (block FP8's CPU path, its kernels in
torch), kimi_k3_build.py (Kimi K3 built on the CPU), k3_ops.py (K3's forward, its Triton ops in torch) and
k3_load_probe.py (K3 loaded every way inside the engine's processes), and shared_imports.py (SGLang's engine
processes started from a fork server that imported SGLang once, not spawned; `SHARDPREP_TEST_SGLANG_START=spawn`
spawns them as SGLang does); stand_ins/sgl_kernel.py is put on PYTHONPATH
as the module `sgl_kernel`. shardprep's own plugin (`--load-format shardprep`) comes from its installed entry
point, as for any user.

A scheduler that fails while the model loads sends SIGQUIT to the engine's process, whose default handler kills
the whole process tree, this runner included; a run marked `"refusal": true` installs a handler that only notes
it (SGLang's `custom_sigquit_handler`), so the engine raises instead and the next run can start.

A run with "server" instead of "engine" launches `python -m sglang.launch_server` with BASE as its flags and
"server" (a list of command-line arguments) after them, as a user would, sends the prompts in one batch to its
HTTP `/generate`, records the tokens, and stops the server's process group. With "node_models" (a model path per
node) it launches one server per node on this host, each with its own path and `--nnodes`, `--node-rank` and a
shared `--dist-init-addr` added: the last node first (each node checks on its own host that the ports derived from
that address are free, and node 0 then takes them), node 0 once the others have logged their server_args; it asks
node 0, and each node's output follows the run's in the log.

PLAN: {"env" (optional: variables for every engine), "runs": [{"name", "model", "engine" (sgl.Engine kwargs, on
top of BASE) or "server" (launch_server arguments) and optionally "node_models", "prompts", "max_tokens" (one per
prompt), "env" (optional: variables for this run's processes), "refusal" (optional), "logprobs" (optional: also
record each generated token's log-probability)}]}.
RESULTS: {name: {"tokens": [[ids] per prompt], "max_total_num_tokens": int, "logprobs": [[float] per prompt] (with
"logprobs")} or {"error": "Type: message"}}.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

import fixed_cpu_memory
import fp8_kernels
import gloo_groups
import k3_load_probe
import k3_ops
import kimi_k3_build
import opened_files
import shared_imports
import torch_native_fill
import torch_native_mla

HERE = Path(__file__).parent
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # one core per rank: SGLang's CPU path binds each TP/DP rank's threads
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
# What every engine of these tests shares: the CPU, torch-native attention (the default on x86, intel_amx, needs
# the compiled sgl_kernel), no CUDA graphs, bfloat16, and a small KV pool: on the CPU SGLang sizes it from the
# host's free memory, which other processes move by gigabytes while a model loads (at mem_fraction_static 0.05
# SGLang once found "no memory left for the KV cache"), so the fraction leaves room and max_total_tokens caps it.
BASE = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True, "mem_fraction_static": 0.3,
        "max_total_tokens": 4096,
        "context_length": 128, "max_running_requests": 8, "random_seed": 0, "log_level": "info",
        "disable_radix_cache": True, "skip_server_warmup": True, "dtype": "bfloat16"}
PLUGINS = {gloo_groups.NAME: "gloo_groups:register", torch_native_fill.NAME: "torch_native_fill:register",
           opened_files.NAME: "opened_files:register", torch_native_mla.NAME: "torch_native_mla:register",
           fixed_cpu_memory.NAME: "fixed_cpu_memory:register", kimi_k3_build.NAME: "kimi_k3_build:register",
           k3_load_probe.NAME: "k3_load_probe:register", fp8_kernels.NAME: "fp8_kernels:register",
           k3_ops.NAME: "k3_ops:register", shared_imports.NAME: "shared_imports:register"}


def plugin_environment(workdir: Path, plugins: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """The environment of a process that runs SGLang with the test `plugins` ({name: "module:function"}) declared as
    `sglang.srt.plugins` entry points of a directory under `workdir`, that directory, this one and stand_ins/ on
    PYTHONPATH, and `env` on top of this process's."""
    from support.engine_harness import declare_plugin

    directory = workdir / "plugins"
    for name, entry in plugins.items():
        declare_plugin(directory, "sglang.srt.plugins", name, entry)
    path = os.pathsep.join(p for p in (str(HERE), str(HERE / "stand_ins"), str(directory),
                                       os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **env, "PYTHONPATH": path}


def run_engines(plan: dict, workdir: Path, timeout: float = 1800) -> tuple[dict, str]:
    """Run `plan` in a fresh process; (results, everything it and SGLang's processes printed)."""
    plan_path, results_path, log_path = workdir / "plan.json", workdir / "results.json", workdir / "engines.log"
    plan_path.write_text(json.dumps(plan))
    from support.engine_harness import record_engine_times

    env = plugin_environment(workdir, PLUGINS, ENV)
    with open(log_path, "w") as log:  # a file, not a pipe: a run that hangs can be read while it hangs
        done = subprocess.run([sys.executable, __file__, str(plan_path), str(results_path)], stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout, env=env)
    output = log_path.read_text()
    record_engine_times(output, workdir)
    assert done.returncode == 0 and results_path.exists(), output[-6000:]
    return json.loads(results_path.read_text()), output


def node_directories(out: Path, root: Path, nodes: int) -> list[str]:
    """One directory per node holding only the rank file its DP rank serves (tp 2, dp 2 over two nodes: node k
    runs DP rank k, rank file k); hard links keep the copies free."""
    from shardprep.manifests import load_manifest

    rank_files = load_manifest(out).rank_files
    dirs = []
    for node in range(nodes):
        mine = shutil.copytree(out, root / f"node{node}", copy_function=os.link)
        for rank, name in enumerate(rank_files):
            if rank != node % len(rank_files):
                os.unlink(mine / name)
        dirs.append(str(mine))
    return dirs


def check_nodes_served_their_rank_files(out: Path, log: str, nodes: int) -> None:
    """After a run over `node_directories(out, out.parent, nodes)`: node k's directory holds only rank file k, and
    node k's output (in `log`) says its one DP rank served that directory, from its own rank file."""
    import re

    from shardprep.manifests import load_manifest

    rank_files = load_manifest(out).rank_files
    for node in range(nodes):
        here = out.parent / f"node{node}"
        assert [name for name in rank_files if (here / name).exists()] == [rank_files[node]]
        output = log.split(f"sglang_runs: node {node}'s output")[1].split("sglang_runs: node")[0]
        assert re.search(rf"shardprep: DP rank {node} of 2 serves {here} sharded: .*rank file {node} of 2", output)


def noted_sigquit(signum: int, frame: object) -> None:
    print("sglang_runs: a scheduler failed (SIGQUIT); the engine raises", flush=True)


def run_plan(plan: dict, workdir: Path) -> dict[str, dict]:
    import sglang as sgl

    results: dict[str, dict] = {}
    for number, run in enumerate(plan["runs"]):
        engine = None
        started = time.monotonic()
        saved = {key: os.environ.get(key) for key in run.get("env", {})}
        os.environ.update(run.get("env", {}))  # SGLang's schedulers are started now and inherit it
        try:
            # Ports of their own: an engine's ports stay taken a while after its shutdown (TIME_WAIT).
            port = 20000 + 500 * number + os.getpid() % 400
            if "server" in run:
                outputs = served_outputs(run, port, workdir)
                results[run["name"]] = {"tokens": [o["output_ids"] for o in outputs], **logprobs(run, outputs)}
                continue
            extra = {"custom_sigquit_handler": noted_sigquit} if run.get("refusal") else {}
            engine = sgl.Engine(model_path=run["model"], port=port, **{**BASE, **run["engine"]}, **extra)
            ready = time.monotonic()
            params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in run["max_tokens"]]
            outputs = engine.generate(run["prompts"], params, return_logprob=bool(run.get("logprobs")))
            print(f"ENGINE-TIME {run['name']!r}: start {ready - started:.1f} s, "
                  f"generate {time.monotonic() - ready:.1f} s", flush=True)
            info = engine.get_server_info()
            results[run["name"]] = {"tokens": [o["output_ids"] for o in outputs],
                                    "max_total_num_tokens": info.get("max_total_num_tokens"), **logprobs(run, outputs)}
        except Exception as exc:  # recorded: the refusal cases expect one
            traceback.print_exc()
            results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
            if engine is None and "server" not in run:
                stop_failed_engine()
        finally:
            if engine is not None:
                engine.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return results


def stop_failed_engine() -> None:
    """What `Engine.shutdown` does, for an engine that failed to start (there is no engine to shut down): its
    processes that started are stopped, and its ZMQ contexts closed without waiting for their peers. Left to the
    garbage collector, such a context's `term()` waited for messages to processes that were gone, inside the next
    engine's start, forever (seen on 2026-12-07)."""
    import gc

    import zmq
    from sglang.srt.entrypoints import engine

    engine.kill_process_tree(os.getpid(), include_parent=False)
    for context in [o for o in gc.get_objects() if isinstance(o, zmq.Context)]:
        if not context.closed:
            context.destroy(linger=0)


def logprobs(run: dict, outputs: list[dict]) -> dict[str, list[list[float]]]:
    """{"logprobs": each generated token's log-probability per prompt} where `run` asks for them, else {}."""
    if not run.get("logprobs"):
        return {}
    return {"logprobs": [[entry[0] for entry in o["meta_info"]["output_token_logprobs"]] for o in outputs]}


def served_outputs(run: dict, port: int, workdir: Path, timeout: float = 900) -> list[dict]:
    """Launch `sglang.launch_server` for `run` (one process per node), generate its prompts over HTTP from node 0,
    stop it; /generate's output per prompt."""
    flags = [arg for key, value in BASE.items() if value is not False
             for arg in ([f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)]))]
    models = run.get("node_models", [run["model"]])
    # Node k serves HTTP (node 0) or SGLang's health check (the others) on port + k; the nodes meet at
    # --dist-init-addr, from which SGLang derives the ports of its own processes (the next few up).
    nodes = [["--model-path", model, "--host", "127.0.0.1", "--port", str(port + k), *flags, *run["server"],
              *(["--nnodes", str(len(models)), "--node-rank", str(k), "--dist-init-addr", f"127.0.0.1:{port + 100}"]
                if len(models) > 1 else [])] for k, model in enumerate(models)]
    started = time.monotonic()
    servers: list[subprocess.Popen] = []
    logs = [workdir / f"node{k}-{port}.log" for k in range(len(nodes))]
    try:
        # The last node first: on one host each node checks that the ports derived from --dist-init-addr are
        # free, which node 0 then takes; the others have checked once they log their server_args.
        for k in reversed(range(len(nodes))):
            argv = [sys.executable, "-m", "sglang.launch_server", *nodes[k]]
            print(f"sglang_runs: launching node {k}:", " ".join(argv), flush=True)
            # As on hosts of their own, each node's rank on a core of its own (SGLang binds by the local rank).
            cores = os.environ["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
            env = {**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": cores[k]} if len(models) > 1 else None
            with open(logs[k], "w") as log:  # its own process group: stopped as one below
                servers.append(subprocess.Popen(argv, start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
                                                env=env))
            while k and "server_args=" not in logs[k].read_text():
                wait_step(servers, started, timeout)
        url = f"http://127.0.0.1:{port}"
        while not healthy(url):
            wait_step(servers, started, timeout)
        ready = time.monotonic()
        body = {"text": run["prompts"],
                "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                    for n in run["max_tokens"]], "return_logprob": bool(run.get("logprobs"))}
        request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            outputs = json.loads(response.read())
        print(f"ENGINE-TIME {run['name']!r}: start {ready - started:.1f} s, "
              f"generate {time.monotonic() - ready:.1f} s", flush=True)
        return outputs
    finally:
        for server in reversed(servers):  # node 0 first: it stops the other nodes' schedulers
            stop_group(server, signal.SIGTERM)
        for server in reversed(servers):
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop_group(server, signal.SIGKILL)
                server.wait()
        for k, log in enumerate(logs):
            if log.exists():
                print(f"sglang_runs: node {k}'s output\n{log.read_text()}", flush=True)


def wait_step(servers: list[subprocess.Popen], started: float, timeout: float) -> None:
    """Sleep a second, unless a node has exited or `timeout` has passed since `started` (then raise)."""
    for server in servers:
        if server.poll() is not None:
            raise RuntimeError(f"a server exited with status {server.returncode} before it was ready")
    if time.monotonic() - started > timeout:
        raise TimeoutError(f"the server was not ready after {timeout} s")
    time.sleep(1)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def stop_group(process: subprocess.Popen, sig: int) -> None:
    """Send `sig` to `process`'s process group (the server and its scheduler processes), if any of it is left."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def main(plan_path: str, results_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    os.environ.update(plan.get("env", {}))
    Path(results_path).write_text(json.dumps(run_plan(plan, Path(results_path).parent)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
