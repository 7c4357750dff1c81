"""The serving runner behind `shardprep run DIR`: prompts on W ranks in shard groups of N, from a pre-sharded DIR.

Launched as `torchrun ... -m shardprep.run DIR ...` (one worker per process) or as `shardprep run DIR
--nproc-per-node P [--nnodes M --node-rank k --rdzv-endpoint HOST:PORT]`, which starts this node's P
workers itself with torchrun's environment variables. The W = M·P ranks form W/N shard groups of N
consecutive ranks (N = the manifest's; `runtime/shard_groups.py`): rank r serves rank file r mod N
and gathers with the other ranks of group r // N only. Each worker builds the model with its targets
bound to its shards (gloo on CPU, NCCL on GPU). Prompts are spread over all W ranks as in DP
attention: prompt i runs on rank i mod W, and a rank with fewer forwards to do than the busiest rank
of its group keeps taking part in its group's gathers (idle steps) until its group is done. Rank 0
returns the results (the CLI prints them) and saves the outputs.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import OptionsMismatchError, RuntimeShardError, ShardprepError
from ..manifests.manifest import MANIFEST_NAME, Manifest, load_manifest
from ..manifests.shard_groups import ShardGroups, group_size_problem
from .launch import FailureBoard, Nodes

if TYPE_CHECKING:
    import torch

    from ..runtime.binding import Binding
    from ..runtime.shard_groups import ShardGroup

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
DEFAULT_PROMPT = "hello world"
DEVICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", "ce", "nccl", "nccl-symm", "gloo")
"""`make_backend`'s names plus auto (tests/standalone/test_run.py checks they match runtime.backends.BACKENDS)."""
CUDA_BACKENDS = ("ce", "nccl", "nccl-symm")


@dataclass(frozen=True)
class RunOptions:
    """What to run: the directory, the prompts, and how."""

    directory: Path
    prompts: tuple[str, ...] = (DEFAULT_PROMPT,)
    max_new_tokens: int = 16
    device: str = "auto"
    backend: str = "auto"
    save_outputs: Path | None = None
    json: bool = False
    trust_remote_code: bool = False
    group_size: int | None = None  # the shard group size N; None: the manifest's
    allow_cross_node_groups: bool = False

    def worker_argv(self) -> list[str]:
        """The `python -m shardprep.run` arguments that make a worker run these options."""
        argv = [str(self.directory), "--max-new-tokens", str(self.max_new_tokens), "--device", self.device,
                "--backend", self.backend]
        if self.group_size is not None:
            argv += ["--shard-group-size", str(self.group_size)]
        if self.allow_cross_node_groups:
            argv.append("--allow-cross-node-groups")
        for p in self.prompts:
            argv += ["--prompt", p]
        if self.save_outputs is not None:
            argv += ["--save-outputs", str(self.save_outputs)]
        if self.json:
            argv.append("--json")
        if self.trust_remote_code:
            argv.append("--trust-remote-code")
        return argv


@dataclass
class PromptResult:
    """One prompt's result: generated token ids and text (causal LMs) or the output's shape (encoders)."""

    index: int
    prompt: str
    rank: int
    input_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    output_shape: list[int] = field(default_factory=list)
    output: Any = None  # the saved tensor (on the CPU), only with --save-outputs


@dataclass
class RankInfo:
    """One rank's device, gather backend, and the bytes it holds: parameters, buffers, shards, slots.

    And where it gathered: its shard group (`group`, its global ranks `group_ranks`), the rank file it
    serves, its node, the global ranks of the process group its gatherer used (`gather_group_ranks`,
    read back from that group), the gathers it issued, and its forwards and idle steps (each issues one
    gather per sharded layer).
    """

    rank: int
    device: str
    backend: str
    parameter_bytes: int
    buffer_bytes: int
    shard_bytes: int
    slot_bytes: int
    group: int = 0
    group_ranks: list[int] = field(default_factory=list)
    rank_file: int = 0
    node: int = 0
    gather_group_ranks: list[int] = field(default_factory=list)
    gathers: int = 0
    forwards: int = 0
    idle_steps: int = 0


@dataclass
class RunReport:
    """What rank 0 returns: every prompt's result, in prompt order, and every rank's memory and group."""

    results: list[PromptResult]
    ranks: list[RankInfo]
    group_size: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "shardprep/run-report/1",
                "world_size": len(self.ranks), "group_size": self.group_size,
                "prompts": [{k: v for k, v in asdict(r).items() if k != "output"} for r in self.results],
                "ranks": [asdict(r) for r in self.ranks]}


def check_run_dir(directory: str | Path) -> Manifest:
    """Check that DIR can be run (manifest, config, tokenizer); returns the manifest.

    >>> check_run_dir("out/").world_size  # doctest: +SKIP
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise RuntimeShardError(f"{directory}: not a directory")
    if not (directory / MANIFEST_NAME).is_file():
        # A checkpoint is converted into a new directory, never into itself: name one beside it.
        checkpoint = (directory / "config.json").is_file() or any(directory.glob("*.safetensors"))
        src, out = (directory, f"{directory.name}-sharded") if checkpoint else ("SRC", directory)
        raise RuntimeShardError(
            f"{directory}: no {MANIFEST_NAME}, so it is not an output directory of `shardprep convert`"
            + (" (a checkpoint)" if checkpoint else "")
            + f"; run `shardprep convert {src} {out} --ranks N --preset NAME` first (`shardprep presets`)"
            + (f", then run {out}" if checkpoint else "")
        )
    manifest = load_manifest(directory)
    if not (directory / "config.json").is_file():
        raise RuntimeShardError(f"{directory}: no config.json; copy the source checkpoint's config.json into it")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise RuntimeShardError(
            f"{directory}: no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); copy the source checkpoint's "
            "tokenizer files into it"
        )
    return manifest


def check_group_size(options: RunOptions, manifest: Manifest, world_size: int) -> int:
    """The shard group size N of a run of `world_size` ranks; refuses one that the directory cannot serve.

    >>> check_group_size(RunOptions(Path("out/")), load_manifest("out/"), world_size=4)  # doctest: +SKIP
    """
    n, directory = manifest.world_size, options.directory
    if options.group_size is not None and options.group_size != n:
        raise RuntimeShardError(
            f"--shard-group-size {options.group_size}, but {directory} was converted for {n} ranks, its shard "
            f"group size; leave the option out, or make a directory for it with `shardprep reshard {directory} "
            f"NEW --ranks {options.group_size}`"
        )
    problem = group_size_problem(world_size, n)
    if problem is not None:
        raise RuntimeShardError(
            f"{directory} was converted for {n} ranks but this run has {world_size} ({problem}); run a multiple "
            f"of {n} ranks (--nnodes × --nproc-per-node), or re-run `shardprep convert --ranks {world_size}`"
        )
    return n


def is_torchrun_worker() -> bool:
    """True in a process started by torchrun (or `launch`): RANK and WORLD_SIZE are set."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


Progress = Callable[[str, int, int], None]
"""`progress(what, done, total)`: this rank's forwards so far of the `total` its prompts and idle steps make,
and what it is doing (building the model, generating, idle steps)."""


def run(options: RunOptions, nproc: int | None = None, nnodes: int | None = None, node_rank: int | None = None,
        rdzv_endpoint: str | None = None, on_peer_failure: Callable[[str], None] | None = None,
        progress: Progress | None = None) -> RunReport | None:
    """Run `options` as a worker when started by torchrun (WORLD_SIZE set), else launch this node's workers.

    A worker returns its rank's `run_worker` result (the report on rank 0); the launcher returns None
    once every worker succeeded (each worker's CLI printed its part). `nproc` (ranks per node) defaults
    to the manifest's N; `nnodes` (default 1), `node_rank` (default 0) and `rdzv_endpoint` (node 0's
    HOST:PORT) place this node among the others. Under torchrun, the launch options given must be
    torchrun's own. `on_peer_failure` and `progress`: see `run_worker`.

    >>> report = run(RunOptions(Path("out/"), prompts=("hello world",), max_new_tokens=8))  # doctest: +SKIP
    """
    if is_torchrun_worker():
        _check_torchrun_agrees(nproc, nnodes, node_rank, rdzv_endpoint)
        return run_worker(options, on_peer_failure, progress)
    launch(options, nproc, Nodes(nnodes or 1, node_rank or 0, rdzv_endpoint))
    return None


def _check_torchrun_agrees(nproc: int | None, nnodes: int | None, node_rank: int | None,
                           rdzv_endpoint: str | None) -> None:
    local = os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    given = {"--nproc": (nproc, local), "--nnodes": (nnodes, os.environ.get("GROUP_WORLD_SIZE")),
             "--node-rank": (node_rank, os.environ.get("GROUP_RANK"))}
    for flag, (value, torchrun) in given.items():
        if value is not None and torchrun is not None and value != int(torchrun):
            what = f"a torchrun job of {torchrun} processes per node" if flag == "--nproc" else \
                f"a torchrun job where it is {torchrun}"
            raise RuntimeShardError(f"{flag} {value} inside {what}; drop {flag} (torchrun's own options place the "
                                    "ranks)")
    if rdzv_endpoint is not None:
        raise RuntimeShardError("--rdzv-endpoint inside a torchrun job: torchrun's own rendezvous placed the nodes; "
                                "drop --rdzv-endpoint")


def launch(options: RunOptions, nproc: int | None = None, nodes: Nodes | None = None) -> None:
    """Start this node's `nproc` workers with torch's elastic launcher (as torchrun does) and wait for them.

    Each worker is `python -m shardprep.run ...`; if one fails, the launcher stops the others on this
    node (they would wait for it in a collective forever) and this raises naming the failed rank.

    >>> launch(RunOptions(Path("out/")), nproc=2)  # doctest: +SKIP
    >>> launch(RunOptions(Path("out/")), nproc=8, nodes=Nodes(2, 0, "node0:29400"))  # doctest: +SKIP
    """
    from .launch import launch_local

    manifest = check_options(options, nproc, nodes)
    launch_local(sys.executable, nproc or manifest.world_size, "-m", "shardprep.run", *options.worker_argv(),
                 nodes=nodes)


def check_options(options: RunOptions, nproc: int | None = None, nodes: Nodes | None = None) -> Manifest:
    """Everything that can be checked before starting processes; returns DIR's manifest.

    The shard groups of the whole launch (W = nnodes × nproc ranks, numbered node-major) are checked
    here too, so a run that would be refused by its workers is refused before any process starts.

    >>> check_options(RunOptions(Path("out/"), device="cpu", backend="ce"))  # doctest: +SKIP
    """
    nodes = nodes or Nodes()
    nodes.check()
    manifest = check_run_dir(options.directory)
    per_node = manifest.world_size if nproc is None else nproc
    if per_node < 1:
        raise RuntimeShardError(f"--nproc-per-node must be >= 1, got {per_node}")
    group_size = check_group_size(options, manifest, nodes.nnodes * per_node)
    if not options.allow_cross_node_groups:
        from ..runtime.shard_groups import cross_node_refusal

        refusal = cross_node_refusal(ShardGroups.node_major(nodes.nnodes * per_node, group_size, per_node))
        if refusal is not None:
            raise RuntimeShardError(refusal)
    if options.device not in DEVICES:
        raise RuntimeShardError(f"--device {options.device!r}: expected one of {', '.join(DEVICES)}")
    if options.backend not in BACKEND_CHOICES:
        raise RuntimeShardError(f"--backend {options.backend!r}: expected one of {', '.join(BACKEND_CHOICES)}")
    if not options.prompts or any(not p.strip() for p in options.prompts):
        raise RuntimeShardError("--prompt: prompts must not be empty")
    device = options.device
    if device != "cpu" and options.backend in CUDA_BACKENDS or device == "cuda":
        import torch

        if not torch.cuda.is_available():
            what = f"--backend {options.backend}" if options.backend in CUDA_BACKENDS else "--device cuda"
            raise RuntimeShardError(f"{what} needs CUDA, but torch sees no CUDA device; use --device cpu "
                                    "--backend gloo (or auto)")
        if torch.cuda.device_count() < per_node:
            raise RuntimeShardError(f"{per_node} ranks on this node need one GPU each, but "
                                    f"{torch.cuda.device_count()} GPUs are visible")
    if device == "cpu" and options.backend in CUDA_BACKENDS:
        raise RuntimeShardError(f"--backend {options.backend} needs --device cuda; on the CPU use gloo (or auto)")
    if device == "cuda" and options.backend == "gloo":
        raise RuntimeShardError("--backend gloo gathers CPU tensors; with --device cuda use auto, ce, nccl or "
                                "nccl-symm")
    return manifest


def run_worker(options: RunOptions, on_peer_failure: Callable[[str], None] | None = None,
               progress: Progress | None = None) -> RunReport | None:
    """One rank of a run, in a process started by torchrun (or `launch`); rank 0 saves the outputs.

    Returns the report on rank 0, None on the other ranks. Whatever fails on this rank raises one
    RuntimeShardError naming the launch's first failure: rank, node and message (`FailureBoard`); a failure
    first seen on another rank calls `on_peer_failure(line)` from a watching thread instead, at once (the
    CLI reports the line and ends the process, whose collectives could only break or hang now). `progress`
    follows this rank's forwards (the CLI shows rank 0's on a terminal).

    >>> run_worker(RunOptions(Path("out/")))  # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    from ..runtime.shard_groups import shard_group
    from .launch import init_local_rank

    manifest = check_run_dir(options.directory)
    group_size = check_group_size(options, manifest, int(os.environ["WORLD_SIZE"]))
    rank, world_size, device = init_local_rank(options.device)
    board = FailureBoard.join(on_peer_failure)
    try:
        check_same_options(options)
        # Every rank builds (or refuses) the same groups before anything is gathered.
        group = shard_group(group_size, allow_cross_node_groups=options.allow_cross_node_groups)
        results, info = _serve(options, device, group, progress or (lambda what, done, total: None))
        gathered: list[Any] = [None] * world_size if rank == 0 else []
        dist.gather_object((results, info), gathered if rank == 0 else None, dst=0)
    except Exception as exc:
        # Recorded before destroy_process_group closes this rank's sockets: a peer whose collective breaks
        # on them finds the cause on the board, and reports it instead of its "Connection closed by peer".
        raise RuntimeShardError(board.record(_failure_line(exc, rank))) from exc
    finally:
        board.close()
        dist.destroy_process_group()
    if rank != 0:
        return None
    everything = sorted((r for rs, _ in gathered for r in rs), key=lambda r: r.index)
    if options.save_outputs is not None:
        outputs = [r.output for r in everything]
        torch.save(outputs[0] if len(outputs) == 1 else outputs, options.save_outputs)
    return RunReport(everything, [m for _, m in gathered], group_size)


def _failure_line(exc: Exception, rank: int) -> str:
    if isinstance(exc, OptionsMismatchError):  # raised alike on every rank, and names the ranks itself
        return str(exc)
    text = str(exc).strip()
    what = text if isinstance(exc, ShardprepError) else f"{type(exc).__name__}: {text}"
    return f"rank {rank} (node {_node()}) failed first: {what.splitlines()[0] if what else type(exc).__name__}"


def _node() -> int:
    return int(os.environ.get("GROUP_RANK", "0"))


def agreed_options(options: RunOptions) -> dict[str, Any]:
    """What every rank of a launch must run with, by flag (torchrun's convention: one command line for all).

    Each of these decides a rank's gathers or the run's outputs: the prompts and --max-new-tokens (and
    --save-outputs, whose extra forward per prompt is in every rank's budget) set how many forwards, so how
    many gathers, each rank of a group makes; --save-outputs given on node 0 alone would also leave None
    for every prompt that ran elsewhere. --nproc-per-node places the ranks (node k holds k·P..k·P+P-1).
    Left out: DIR itself, which each node holds at a path of its own (a copy, or a mount); its
    shard_manifest.json stands for it, byte for byte. And --node-rank, the one option that differs by
    design (torchrun gives each rank its own RANK, LOCAL_RANK, GROUP_RANK).
    """
    manifest = (options.directory / MANIFEST_NAME).read_bytes()
    return {
        f"DIR ({MANIFEST_NAME} sha256)": hashlib.sha256(manifest).hexdigest()[:16],
        "--prompt": options.prompts,
        "--max-new-tokens": options.max_new_tokens,
        "--save-outputs": None if options.save_outputs is None else str(options.save_outputs),
        "--device": options.device,
        "--backend": options.backend,
        "--shard-group-size": options.group_size,
        "--allow-cross-node-groups": options.allow_cross_node_groups,
        "--json": options.json,
        "--trust-remote-code": options.trust_remote_code,
        "--nproc-per-node": os.environ.get("LOCAL_WORLD_SIZE"),
    }


def check_same_options(options: RunOptions) -> None:
    """Refuse, on every rank alike, a launch whose ranks were started with different options (collective).

    >>> check_same_options(RunOptions(Path("out/")))  # doctest: +SKIP
    """
    import torch.distributed as dist

    mine = (_node(), agreed_options(options))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for flag in mine[1]:
        sides: dict[str, list[tuple[int, int]]] = {}  # the flag's value, as the user reads it -> (rank, node)
        for rank, (node, agreed) in enumerate(everyone):
            sides.setdefault(_given(agreed[flag]), []).append((rank, node))
        if len(sides) > 1:
            where = " but ".join(f"{value} on {_ranks_and_nodes(ranks)}" for value, ranks in sides.items())
            raise OptionsMismatchError(f"the ranks were started with different options: {flag} is {where}; start "
                                       "every node with the same options (only DIR's path and --node-rank may "
                                       "differ)")


def _given(value: Any) -> str:
    if value is None or value is False:
        return "not given"
    if value is True:
        return "given"
    if not isinstance(value, tuple):
        return str(value)
    prompts = repr(list(value))  # all of them could fill a screen
    return prompts if len(prompts) <= 60 else f"{prompts[:56]}...] ({len(value)} prompts)"


def _ranks_and_nodes(ranks: list[tuple[int, int]]) -> str:
    nodes = sorted({node for _, node in ranks})
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r, _ in ranks)} "
            f"(node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})")


def forwards_per_rank(prompts: int, world_size: int, ranks: tuple[int, ...]) -> int:
    """Prompts of the busiest of `ranks` when prompt i runs on rank i mod `world_size`: what each rank of
    a group must step through, so that every rank of the group issues the same gathers.

    >>> forwards_per_rank(5, 4, (0, 1)), forwards_per_rank(5, 4, (2, 3)), forwards_per_rank(1, 4, (2, 3))
    (2, 1, 0)
    """
    return max(len(range(r, prompts, world_size)) for r in ranks)


def _serve(options: RunOptions, device: torch.device, group: ShardGroup,
           progress: Progress) -> tuple[list[PromptResult], RankInfo]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    from .hf_model import build_model, is_causal_lm

    rank, world_size = group.rank, group.layout.world_size
    causal = is_causal_lm(options.directory)
    # Forwards per prompt are known in advance (generate() makes one per new token), so every rank
    # can tell how many idle steps keep it aligned with the busiest rank of its group without asking.
    per_prompt = (options.max_new_tokens if causal else 0) + (1 if options.save_outputs or not causal else 0)
    mine = list(range(rank, len(options.prompts), world_size))
    budget = per_prompt * forwards_per_rank(len(options.prompts), world_size, group.ranks)
    progress("building the model from its rank file", 0, budget)
    tokenizer = _tokenizer(options.directory, options.trust_remote_code)
    binding = build_model(options.directory, device, group=group.process_group, backend=options.backend,
                          trust_remote_code=options.trust_remote_code)
    # Each forward (generate() makes one per token) moves the progress on.
    binding.model.register_forward_hook(lambda *_: progress("generating", binding.forward_count, budget))
    results = []
    with torch.inference_mode():
        for i in mine:
            results.append(_serve_prompt(options, binding, tokenizer, i, rank, causal, device))
        if binding.forward_count > budget:
            raise RuntimeShardError(
                f"rank {rank} made {binding.forward_count} forwards, more than the {budget} planned; the ranks' "
                "gathers are no longer aligned"
            )
        idle = budget - binding.forward_count
        for step in range(idle):
            binding.idle_step()
            progress("idle steps, in step with the busiest rank", budget - idle + step + 1, budget)
    return results, _rank_info(binding, group, idle)


def _serve_prompt(options: RunOptions, binding: Binding, tokenizer: Any, index: int, rank: int, causal: bool,
                  device: torch.device) -> PromptResult:
    model: Any = binding.model  # a transformers PreTrainedModel (generate() is not on nn.Module)
    prompt = options.prompts[index]
    encoded = tokenizer(prompt, return_tensors="pt")
    if causal:  # causal LMs take no token_type_ids
        encoded = {k: encoded[k] for k in ("input_ids", "attention_mask") if k in encoded}
    inputs = {k: v.to(device) for k, v in encoded.items()}
    result = PromptResult(index, prompt, rank, inputs["input_ids"][0].tolist())
    if options.save_outputs or not causal:
        out = model(**inputs)
        tensor: torch.Tensor = out.logits if causal else out.last_hidden_state
        result.output_shape = list(tensor.shape)
        if options.save_outputs:
            result.output = tensor.detach().cpu()
    if causal:
        generated = model.generate(**inputs, max_new_tokens=options.max_new_tokens, do_sample=False)
        result.token_ids = generated[0, inputs["input_ids"].shape[1]:].tolist()
        result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return result


def _tokenizer(directory: Path, trust_remote_code: bool) -> Any:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise RuntimeShardError(f"{directory}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None


def _rank_info(binding: Binding, group: ShardGroup, idle_steps: int) -> RankInfo:
    import torch.distributed as dist

    bound = {id(p) for p in binding.target_parameters.values()}
    return RankInfo(
        rank=group.rank,
        device=str(binding.shards.device),
        backend=binding.gatherer.backend_name,
        # The targets live in the slots (counted in slot_bytes), not in storage of the model's own.
        parameter_bytes=_storage_bytes(p for p in binding.model.parameters() if id(p) not in bound),
        buffer_bytes=_storage_bytes(binding.model.buffers()),
        shard_bytes=binding.shards.nbytes,
        slot_bytes=binding.gatherer.slot_bytes,
        group=group.index,
        group_ranks=list(group.ranks),
        rank_file=binding.shards.rank,
        node=group.node,
        gather_group_ranks=dist.get_process_group_ranks(binding.gatherer.group),
        gathers=binding.gatherer.gathers_issued,
        forwards=binding.forward_count,
        idle_steps=idle_steps,
    )


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights and placeholders count once)."""
    seen: dict[tuple[Any, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())
