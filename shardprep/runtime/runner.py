"""The serving runner behind `shardprep run DIR`: prompts on N local ranks from a pre-sharded directory.

Launched as `torchrun --nproc-per-node N -m shardprep.run DIR ...` (one worker per process) or as
`shardprep run DIR --nproc N`, which starts the N workers itself with torchrun's environment
variables. Each worker builds the model with its targets bound to its shards (gloo on CPU, NCCL on
GPU). Prompts are spread over the ranks as in DP attention: prompt i runs on rank i mod N, and a
rank with fewer forwards to do than the busiest one keeps taking part in the gathers (idle steps)
until every rank is done. Rank 0 returns the results (the CLI prints them) and saves the outputs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeShardError
from ..manifests.manifest import MANIFEST_NAME, Manifest, load_manifest

if TYPE_CHECKING:
    import torch

    from .binding import Binding

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
DEFAULT_PROMPT = "hello world"
DEVICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", "ce", "nccl", "nccl-symm", "gloo")
"""`make_backend`'s names plus auto (tests/test_run.py checks they match runtime.backends.BACKENDS)."""
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

    def worker_argv(self) -> list[str]:
        """The `python -m shardprep.run` arguments that make a worker run these options."""
        argv = [str(self.directory), "--max-new-tokens", str(self.max_new_tokens), "--device", self.device,
                "--backend", self.backend]
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
    """One rank's device, gather backend, and the bytes it holds: parameters, buffers, shards, slots."""

    rank: int
    device: str
    backend: str
    parameter_bytes: int
    buffer_bytes: int
    shard_bytes: int
    slot_bytes: int


@dataclass
class RunReport:
    """What rank 0 returns: every prompt's result, in prompt order, and every rank's memory."""

    results: list[PromptResult]
    ranks: list[RankInfo]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "shardprep/run-report/1",
                "prompts": [{k: v for k, v in asdict(r).items() if k != "output"} for r in self.results],
                "ranks": [asdict(r) for r in self.ranks]}


def check_run_dir(directory: str | Path, world_size: int | None = None) -> Manifest:
    """Check that DIR can be run with `world_size` ranks (manifest, config, tokenizer); returns the manifest.

    >>> check_run_dir("out/", world_size=2).world_size  # doctest: +SKIP
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise RuntimeShardError(f"{directory}: not a directory")
    if not (directory / MANIFEST_NAME).is_file():
        raise RuntimeShardError(
            f"{directory}: no {MANIFEST_NAME}, so it is not an output directory of `shardprep convert`; "
            f"run `shardprep convert SRC {directory} --ranks N` first"
        )
    manifest = load_manifest(directory)
    if world_size is not None and world_size != manifest.world_size:
        raise RuntimeShardError(
            f"{directory} was converted for {manifest.world_size} ranks but this run has {world_size}; "
            f"run with {manifest.world_size} ranks, or re-run `shardprep convert --ranks {world_size}`"
        )
    if not (directory / "config.json").is_file():
        raise RuntimeShardError(f"{directory}: no config.json; copy the source checkpoint's config.json into it")
    if not any((directory / f).is_file() for f in TOKENIZER_FILES):
        raise RuntimeShardError(
            f"{directory}: no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...); copy the source checkpoint's "
            "tokenizer files into it"
        )
    return manifest


def is_torchrun_worker() -> bool:
    """True in a process started by torchrun (or `launch`): RANK and WORLD_SIZE are set."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def run(options: RunOptions, nproc: int | None = None) -> RunReport | None:
    """Run `options` as a worker when started by torchrun (WORLD_SIZE set), else launch `nproc` workers.

    A worker returns its rank's `run_worker` result (the report on rank 0); the launcher returns None
    once every worker succeeded (each worker's CLI printed its part). `nproc` defaults to the manifest's
    world size.

    >>> report = run(RunOptions(Path("out/"), prompts=("hello world",), max_new_tokens=8))  # doctest: +SKIP
    """
    if is_torchrun_worker():
        if nproc is not None and nproc != int(os.environ["WORLD_SIZE"]):
            raise RuntimeShardError(
                f"--nproc {nproc} inside a torchrun job of {os.environ['WORLD_SIZE']} processes; drop --nproc"
            )
        return run_worker(options)
    launch(options, nproc)
    return None


def launch(options: RunOptions, nproc: int | None = None) -> None:
    """Start `nproc` local workers with torch's elastic launcher (as torchrun does) and wait for them.

    Each worker is `python -m shardprep.run ...`; if one fails, the launcher stops the others (they
    would wait for it in a collective forever) and this raises naming the failed rank.

    >>> launch(RunOptions(Path("out/")), nproc=2)  # doctest: +SKIP
    """
    from .launch import launch_local

    manifest = check_options(options, nproc)
    launch_local(sys.executable, manifest.world_size, "-m", "shardprep.run", *options.worker_argv())


def check_options(options: RunOptions, nproc: int | None = None) -> Manifest:
    """Everything that can be checked before starting processes; returns DIR's manifest.

    >>> check_options(RunOptions(Path("out/"), device="cpu", backend="ce"))  # doctest: +SKIP
    """
    manifest = check_run_dir(options.directory, nproc)
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
        if torch.cuda.device_count() < manifest.world_size:
            raise RuntimeShardError(f"{options.directory} needs {manifest.world_size} ranks, one GPU each, but "
                                    f"{torch.cuda.device_count()} GPUs are visible")
    if device == "cpu" and options.backend in CUDA_BACKENDS:
        raise RuntimeShardError(f"--backend {options.backend} needs --device cuda; on the CPU use gloo (or auto)")
    if device == "cuda" and options.backend == "gloo":
        raise RuntimeShardError("--backend gloo gathers CPU tensors; with --device cuda use auto, ce, nccl or "
                                "nccl-symm")
    return manifest


def run_worker(options: RunOptions) -> RunReport | None:
    """One rank of a run, in a process started by torchrun (or `launch`); rank 0 saves the outputs.

    Returns the report on rank 0, None on the other ranks.

    >>> run_worker(RunOptions(Path("out/")))  # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    from .launch import init_local_rank

    check_run_dir(options.directory, int(os.environ["WORLD_SIZE"]))
    rank, world_size, device = init_local_rank(options.device)
    try:
        results, info = _serve(options, device, rank, world_size)
        gathered: list[Any] = [None] * world_size if rank == 0 else []
        dist.gather_object((results, info), gathered if rank == 0 else None, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    everything = sorted((r for rs, _ in gathered for r in rs), key=lambda r: r.index)
    if options.save_outputs is not None:
        outputs = [r.output for r in everything]
        torch.save(outputs[0] if len(outputs) == 1 else outputs, options.save_outputs)
    return RunReport(everything, [m for _, m in gathered])


def _serve(options: RunOptions, device: torch.device, rank: int,
           world_size: int) -> tuple[list[PromptResult], RankInfo]:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()

    from .hf_model import build_model, is_causal_lm

    tokenizer = _tokenizer(options.directory, options.trust_remote_code)
    binding = build_model(options.directory, device, backend=options.backend,
                          trust_remote_code=options.trust_remote_code)
    info = _rank_info(binding, rank)
    causal = is_causal_lm(options.directory)
    # Forwards per prompt are known in advance (generate() makes one per new token), so every rank
    # can tell how many idle steps keep it aligned with the busiest rank without asking the others.
    per_prompt = (options.max_new_tokens if causal else 0) + (1 if options.save_outputs or not causal else 0)
    mine = list(range(rank, len(options.prompts), world_size))
    budget = per_prompt * -(-len(options.prompts) // world_size)
    results = []
    with torch.inference_mode():
        for i in mine:
            results.append(_serve_prompt(options, binding, tokenizer, i, rank, causal, device))
        if binding.forward_count > budget:
            raise RuntimeShardError(
                f"rank {rank} made {binding.forward_count} forwards, more than the {budget} planned; the ranks' "
                "gathers are no longer aligned"
            )
        for _ in range(budget - binding.forward_count):
            binding.idle_step()
    return results, info


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


def _rank_info(binding: Binding, rank: int) -> RankInfo:
    bound = {id(p) for p in binding.target_parameters.values()}
    return RankInfo(
        rank=rank,
        device=str(binding.shards.device),
        backend=binding.gatherer.backend_name,
        # The targets live in the slots (counted in slot_bytes), not in storage of the model's own.
        parameter_bytes=_storage_bytes(p for p in binding.model.parameters() if id(p) not in bound),
        buffer_bytes=_storage_bytes(binding.model.buffers()),
        shard_bytes=binding.shards.nbytes,
        slot_bytes=binding.gatherer.slot_bytes,
    )


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind `tensors` (tied weights and placeholders count once)."""
    seen: dict[tuple[Any, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(t.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())
